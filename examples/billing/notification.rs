//! Notification: tells the customer what happened.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use outbox_core::{Delivery, Handle, HandlerError, subscriber};

use super::db::DbPool;
use super::events::{
    LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded, SubscriptionStarted, WinBackOffered,
};
use super::story;
use crate::args;

/// How a notification leaves.
pub trait Mailer: Send + Sync + 'static {
    /// Sends `message` to `to`, once per `event_id`.
    fn send(
        &self,
        event_id: i64,
        to: &str,
        message: &str,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// A mailer that records what it sends in the `notifications` table, and can be told to be down
/// for a number of sends (a mail server answering 503), to show a retry.
#[derive(Debug, Clone)]
pub struct DbMailer {
    pool: DbPool,
    outage: Arc<AtomicU32>,
}

impl DbMailer {
    /// A mailer writing to `pool`, down for as many sends as `outage` says.
    pub fn new(pool: DbPool, outage: Arc<AtomicU32>) -> Self {
        Self { pool, outage }
    }
}

impl Mailer for DbMailer {
    async fn send(&self, event_id: i64, to: &str, message: &str) -> Result<(), HandlerError> {
        let was_down = self
            .outage
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if was_down {
            return Err(HandlerError::transient(
                "mail server answered 503 Service Unavailable",
            ));
        }
        // The key (event, recipient) makes a redelivered event send nothing twice.
        self.pool
            .exec(
                "INSERT INTO notifications VALUES ($1, $2, $3)
                 ON CONFLICT (outbox_event_id, recipient) DO NOTHING",
                args![event_id, to, message],
            )
            .await?;
        Ok(())
    }
}

/// The notification subscriber.
#[subscriber(events = [
    SubscriptionStarted,
    PaymentSucceeded,
    PaymentFailedFinal,
    LicenseUpgraded,
    WinBackOffered,
])]
pub struct Notification<M: Mailer = DbMailer> {
    /// How notifications leave.
    pub mailer: M,
}

impl<M: Mailer> Notification<M> {
    async fn notify(
        &self,
        d: &Delivery<'_>,
        to: String,
        message: String,
    ) -> Result<(), HandlerError> {
        if let Err(error) = self.mailer.send(d.event().id, &to, &message).await {
            story::handled(d, format!("failed, {error}"));
            return Err(error);
        }
        story::handled(d, format!("mailed {to}: {message}"));
        Ok(())
    }
}

impl<M: Mailer> Handle<SubscriptionStarted> for Notification<M> {
    async fn handle(&self, e: &SubscriptionStarted, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.notify(d, e.customer_email.clone(), "welcome aboard".to_owned())
            .await
    }
}

impl<M: Mailer> Handle<PaymentSucceeded> for Notification<M> {
    async fn handle(&self, e: &PaymentSucceeded, d: &Delivery<'_>) -> Result<(), HandlerError> {
        let message = format!("receipt for cycle {}", e.cycle_count);
        self.notify(
            d,
            format!("subscription {}", story::short(e.subscription_id)),
            message,
        )
        .await
    }
}

impl<M: Mailer> Handle<PaymentFailedFinal> for Notification<M> {
    async fn handle(&self, e: &PaymentFailedFinal, d: &Delivery<'_>) -> Result<(), HandlerError> {
        let message = format!("your subscription lapsed ({})", e.reason);
        self.notify(
            d,
            format!("subscription {}", story::short(e.subscription_id)),
            message,
        )
        .await
    }
}

impl<M: Mailer> Handle<LicenseUpgraded> for Notification<M> {
    async fn handle(&self, e: &LicenseUpgraded, d: &Delivery<'_>) -> Result<(), HandlerError> {
        let message = format!("you are now on {}", e.tier);
        self.notify(
            d,
            format!("license {}", story::short(e.license_id)),
            message,
        )
        .await
    }
}

impl<M: Mailer> Handle<WinBackOffered> for Notification<M> {
    async fn handle(&self, e: &WinBackOffered, d: &Delivery<'_>) -> Result<(), HandlerError> {
        let message = format!("come back: {}", e.offer);
        self.notify(
            d,
            format!("subscription {}", story::short(e.subscription_id)),
            message,
        )
        .await
    }
}
