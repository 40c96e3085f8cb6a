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

async fn keeps_the_committed_transaction(outbox: Outbox<Postgres, App>, id: Uuid) {
    let tx = outbox.begin().await.unwrap();
    let mut committed = tx.commit().await.unwrap();
    let _ = committed.publish(&PaymentSucceeded { subscription_id: id }).await;
}

async fn reuses_the_moved_transaction(outbox: Outbox<Postgres, App>, id: Uuid) {
    let mut tx = outbox.begin().await.unwrap();
    tx.commit().await.unwrap();
    let _ = tx.publish(&PaymentSucceeded { subscription_id: id }).await;
}

fn main() {}
