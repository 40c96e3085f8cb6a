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

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
struct AuditWritten {
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
                // A follow-up event the router does not route: nobody would receive it.
                tx.publish(&AuditWritten { subscription_id: event.subscription_id }).await?;
                Ok(tx)
            })
            .await
    }
}

#[router(events = [PaymentSucceeded])]
struct App {
    audit: Audit,
}

fn main() {}
