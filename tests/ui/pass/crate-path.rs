//! `#[outbox(crate = ...)]` points the generated code at a re-exported `outbox_core`, quoted or bare.

mod platform {
    pub use outbox_core as events;
}

use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, platform::events::OutboxEvent)]
#[outbox(crate = "crate::platform::events", aggregate_type = "bot")]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[derive(Serialize, Deserialize, platform::events::OutboxEvent)]
#[outbox(crate = crate::platform::events, aggregate_type = "bot")]
struct BotKicked {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

fn main() {
    use platform::events::OutboxEvent;
    assert_eq!(BotInstalled::EVENT_TYPE, "BotInstalled");
    assert_eq!(BotKicked { bot_id: Uuid::nil() }.aggregate_id(), Uuid::nil());
}
