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

#[subscriber(events = [PaymentSucceeded, BotKicked])]
struct Licensing;

impl<E: OutboxEvent> Handle<E> for Licensing {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

// Forgot `#[subscriber]` on this one, and `Audit` is no `Observer`.
struct Notification;
struct Audit;

#[router(events = [PaymentSucceeded, BotKicked])]
struct App {
    licensing: Licensing,
    notification: Notification,
    #[observer]
    audit: Audit,
}

fn main() {}
