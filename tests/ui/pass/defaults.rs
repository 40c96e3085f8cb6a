//! The least an event needs: an aggregate type and an aggregate id. `event_type` defaults to the
//! type's name, `version` to 1.

use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

/// A raw identifier names the event without its `r#`.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct r#Move {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

fn main() {
    assert_eq!(BotInstalled::AGGREGATE_TYPE, "bot");
    assert_eq!(BotInstalled::EVENT_TYPE, "BotInstalled");
    assert_eq!(BotInstalled::VERSION, 1);
    assert!(BotInstalled::UPCASTERS.is_empty());
    let id = Uuid::from_u128(7);
    let event = BotInstalled { bot_id: id };
    assert_eq!(event.aggregate_id(), id);
    assert_eq!(event.occurred_at(), None);
    assert_eq!(r#Move::EVENT_TYPE, "Move");
}
