use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

// The default name (`licensing`) is the current one: it cannot be a former one too.
#[subscriber(events = [BotInstalled], formerly = ["billing", "licensing"])]
struct Licensing;

impl Handle<BotInstalled> for Licensing {
    async fn handle(&self, _: &BotInstalled, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn main() {}
