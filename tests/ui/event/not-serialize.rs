use outbox_core::OutboxEvent;
use serde::Deserialize;
use uuid::Uuid;

#[derive(Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

fn main() {}
