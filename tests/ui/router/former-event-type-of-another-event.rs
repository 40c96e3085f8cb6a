use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

// `BotInstalled` is another event's name: stored events of it could be either.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", formerly = ["BotInstalled"])]
struct BotAdded {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[subscriber(events = [BotInstalled, BotAdded])]
struct Licensing;

impl<E: OutboxEvent> Handle<E> for Licensing {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[router(events = [BotInstalled, BotAdded])]
struct App {
    licensing: Licensing,
}

fn main() {}
