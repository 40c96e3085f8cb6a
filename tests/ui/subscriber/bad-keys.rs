use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotKicked {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[subscriber(events = [BotKicked], topic = "bots", name = "licensing", name = "licenses")]
struct Licensing;

#[subscriber(events = BotKicked, name = "")]
struct Recovery;

impl Handle<BotKicked> for Licensing {
    async fn handle(&self, _: &BotKicked, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
