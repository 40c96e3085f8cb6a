use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(event_type = "PaymentSucceeded")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
struct PaymentFailed {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

fn main() {}
