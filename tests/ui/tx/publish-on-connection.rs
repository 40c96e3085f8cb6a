use outbox_core::{OutboxEvent, Publish};
use outbox_sqlx::prelude::*;
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
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

async fn on_a_connection(conn: &mut PgConnection, id: Uuid) {
    let _ = conn.publish(&PaymentSucceeded { subscription_id: id }).await;
    record_charge(conn, id).await;
}

async fn on_a_bare_sqlx_transaction(pool: sqlx::PgPool, id: Uuid) {
    let mut tx = pool.begin().await.unwrap();
    let _ = tx.publish(&PaymentSucceeded { subscription_id: id }).await;
}

fn main() {}
