use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

const TWO: u32 = 2;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", version = "2")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", version = TWO)]
struct PaymentFailed {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", version = 2u8)]
struct PaymentRefunded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

fn main() {}
