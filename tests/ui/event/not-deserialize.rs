use outbox_core::OutboxEvent;
use serde::Serialize;
use uuid::Uuid;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

fn main() {}
