use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[subscriber(events = [BotInstalled], name = "billing")]
struct Billing;

// Renamed from `billing` while another subscriber is still called that: the deliveries
// stored as `billing` would belong to both.
#[subscriber(events = [BotInstalled], name = "ledger", formerly = ["billing"])]
struct Ledger;

impl<E: OutboxEvent> Handle<E> for Billing {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

impl<E: OutboxEvent> Handle<E> for Ledger {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[router(events = [BotInstalled])]
struct App {
    billing: Billing,
    ledger: Ledger,
}

fn main() {}
