use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

// Four mistakes, four errors, and nothing else: the stub impl keeps the rest of the crate quiet.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription", event_type = "", version = 0, colour = "blue")]
struct PaymentSucceeded {
    subscription_id: Uuid,
}

fn uses_the_trait<E: OutboxEvent>() {}

fn main() {
    uses_the_trait::<PaymentSucceeded>();
}
