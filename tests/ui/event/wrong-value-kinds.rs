use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = subscription, event_type, crate = 5)]
struct PaymentSucceeded {
    #[outbox(aggregate_id = true)]
    subscription_id: Uuid,
}

fn main() {}
