use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", event_type = "")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "", event_type = "Payment Failed")]
struct PaymentFailed {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

fn main() {}
