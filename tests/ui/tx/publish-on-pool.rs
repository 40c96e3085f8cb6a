use outbox_core::{OutboxEvent, Publish};
use outbox_sqlx::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

async fn record_charge(events: &mut impl Publish, subscription_id: Uuid) {
    let _ = events.publish(&PaymentSucceeded { subscription_id }).await;
}

async fn on_a_pool(mut pool: PgPool, id: Uuid) {
    // Publishing straight on the pool: the event would not share the domain change's transaction.
    let _ = pool.publish(&PaymentSucceeded { subscription_id: id }).await;
    // Handing the pool to a service that publishes.
    record_charge(&mut pool, id).await;
}

fn main() {}
