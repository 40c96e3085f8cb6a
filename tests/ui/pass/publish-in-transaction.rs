//! The supported ways to publish: on an active transaction, directly or through the port.

use outbox_core::{
    Delivery, Handle, HandlerError, Metadata, OutboxEvent, Publish, PublishError, router, subscriber,
};
use outbox_sqlx::{Outbox, OutboxTx};
use serde::{Deserialize, Serialize};
use sqlx::Postgres;
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

async fn record_charge(events: &mut impl Publish<PaymentSucceeded>, subscription_id: Uuid) -> Result<(), PublishError> {
    events.publish(&PaymentSucceeded { subscription_id }).await
}

async fn concrete(tx: &mut OutboxTx<'_, Postgres, App>, id: Uuid) -> Result<(), outbox_sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    tx.publish(&PaymentSucceeded { subscription_id: id }).await?;
    tx.publish_with(&PaymentSucceeded { subscription_id: id }, &Metadata::new()).await?;
    tx.publish_all(&[PaymentSucceeded { subscription_id: id }]).await
}

async fn all(outbox: Outbox<Postgres, App>, pool: sqlx::PgPool, id: Uuid) -> Result<(), Box<dyn std::error::Error>> {
    let mut tx = outbox.begin().await?;
    concrete(&mut tx, id).await?;
    record_charge(&mut tx, id).await?;
    let committed = tx.commit().await?;
    assert_eq!(committed.published(), 4);

    let mut wrapped = outbox.wrap(pool.begin().await?);
    wrapped.publish(&PaymentSucceeded { subscription_id: id }).await?;
    wrapped.rollback().await?;
    Ok(())
}

fn main() {
    // Type-checked only: running it needs a database.
    let _ = all;
}
