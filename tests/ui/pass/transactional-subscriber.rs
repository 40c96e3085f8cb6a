//! A subscriber that applies its effects exactly once, publishing a follow-up event, in an
//! application that names its database.

use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber};
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
                sqlx::query("INSERT INTO audit (subscription_id) VALUES ($1)")
                    .bind(event.subscription_id)
                    .execute(&mut *tx)
                    .await?;
                tx.publish(&AuditWritten { subscription_id: event.subscription_id }).await?;
                Ok(tx)
            })
            .await
    }
}

#[subscriber(events = [AuditWritten])]
struct Reports;

impl Handle<AuditWritten> for Reports {
    async fn handle(&self, _: &AuditWritten, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[router(events = [PaymentSucceeded, AuditWritten], database = sqlx::Postgres)]
struct App {
    audit: Audit,
    reports: Reports,
}

fn relay(outbox: Outbox<Postgres, App>) {
    let audit = Audit { outbox: outbox.clone() };
    let _relay = outbox.relay(App { audit, reports: Reports }, RelayConfig::default());
}

fn main() {}
