use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, Publish, router, subscriber};
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

#[subscriber(events = [PaymentSucceeded])]
struct Licensing;

impl Handle<PaymentSucceeded> for Licensing {
    async fn handle(&self, _: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[router(events = [PaymentSucceeded])]
struct App {
    licensing: Licensing,
}

async fn record_charge(events: &mut impl Publish<PaymentSucceeded>, subscription_id: Uuid) {
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
