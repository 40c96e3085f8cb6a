use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use outbox_sqlx::Outbox;
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

// The application runs on PostgreSQL...
#[router(events = [PaymentSucceeded], database = sqlx::Postgres)]
struct App {
    audit: Audit,
}

// ...but this subscriber would run its effects in a transaction on a SQLite outbox: its
// deliveries' claims and inbox records are not there.
#[subscriber(events = [PaymentSucceeded])]
struct Audit {
    outbox: Outbox<Sqlite, App>,
}

impl Handle<PaymentSucceeded> for Audit {
    async fn handle(&self, event: &PaymentSucceeded, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.outbox
            .handle_once(delivery, |mut tx| async move {
                sqlx::query("INSERT INTO audit (subscription_id) VALUES ($1)")
                    .bind(event.subscription_id)
                    .execute(&mut *tx)
                    .await?;
                Ok(tx)
            })
            .await
    }
}

fn main() {}
