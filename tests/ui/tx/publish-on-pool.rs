use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, Publish, router, subscriber};
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

async fn on_a_pool(mut pool: PgPool, id: Uuid) {
    // Publishing straight on the pool: the event would not share the domain change's transaction.
    let _ = pool.publish(&PaymentSucceeded { subscription_id: id }).await;
    // Handing the pool to a service that publishes.
    record_charge(&mut pool, id).await;
}

fn main() {}
