use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use outbox_sqlx::Outbox;
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
struct Audit {
    outbox: Outbox<Postgres, App>,
}

impl Handle<PaymentSucceeded> for Audit {
    async fn handle(&self, event: &PaymentSucceeded, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.outbox
            .handle_once(delivery, |mut tx| async move {
                sqlx::query("INSERT INTO audit (subscription_id) VALUES ($1)")
                    .bind(event.subscription_id)
                    .execute(&mut *tx)
                    .await?;
                // The transaction must be given back to be committed: dropping it here would
                // roll the effect back while the delivery counts as done.
                Ok(())
            })
            .await
    }
}

#[router(events = [PaymentSucceeded])]
struct App {
    audit: Audit,
}

fn main() {}
