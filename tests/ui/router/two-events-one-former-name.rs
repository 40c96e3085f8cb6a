use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

// Both claim to have been `BotChanged`: its stored events could be either.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", formerly = ["BotChanged"])]
struct BotRenamed {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", formerly = ["BotMoved", "BotChanged"])]
struct BotRelocated {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[subscriber(events = [BotRenamed, BotRelocated])]
struct Licensing;

impl<E: OutboxEvent> Handle<E> for Licensing {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[router(events = [BotRenamed, BotRelocated])]
struct App {
    licensing: Licensing,
}

fn main() {}
