use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
struct PaymentSucceeded {
    #[outbox(aggregate_id)]
    subscription_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
struct BotKicked {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
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

async fn publishes_an_event_nobody_routes(outbox: outbox_sqlx::Outbox<sqlx::Postgres, App>, id: Uuid) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&PaymentSucceeded { subscription_id: id }).await.unwrap();
    tx.publish(&BotKicked { bot_id: id }).await.unwrap();
    tx.commit().await.unwrap();
}

fn main() {}
