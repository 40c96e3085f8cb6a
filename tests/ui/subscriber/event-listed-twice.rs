use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotKicked {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[subscriber(events = [BotKicked, BotInstalled, BotKicked])]
struct Licensing;

impl<E: OutboxEvent> Handle<E> for Licensing {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
