use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
enum PaymentEvent {
    Succeeded { subscription_id: Uuid },
    Failed { subscription_id: Uuid },
}

fn main() {}
