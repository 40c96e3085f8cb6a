use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", version = 2)]
#[outbox(version = 3)]
struct PaymentSucceeded {
    #[outbox(aggregate_id, aggregate_id)]
    subscription_id: Uuid,
}

fn main() {}
