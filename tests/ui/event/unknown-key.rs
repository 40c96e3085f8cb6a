use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", topic = "payments")]
struct PaymentSucceeded {
    #[outbox(aggregate_id, key)]
    subscription_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", aggregate_id)]
struct PaymentFailed {
    #[outbox(aggregate_id, version = 2)]
    subscription_id: Uuid,
}

fn main() {}
