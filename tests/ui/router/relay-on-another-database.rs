use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber};
use outbox_sqlx::Outbox;
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, SqlitePool};
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

#[router(events = [PaymentSucceeded], database = sqlx::Postgres)]
struct App {
    licensing: Licensing,
}

fn relays_on_sqlite(pool: SqlitePool) {
    let outbox: Outbox<Sqlite, App> = Outbox::new(pool);
    let _relay = outbox.relay(App { licensing: Licensing }, RelayConfig::default());
}

fn main() {}
