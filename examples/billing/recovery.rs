//! Recovery: opens a case when a customer may be slipping away.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use outbox_core::{Delivery, Handle, HandlerError, subscriber};

use super::db::DbPool;
use super::events::{BotKicked, LicenseUpgraded, PaymentFailedFinal};
use super::story;
use crate::args;

/// The recovery subscriber. Its desk can be closed, to show a permanent failure, a dead letter,
/// and an operator's requeue.
#[subscriber(events = [PaymentFailedFinal, LicenseUpgraded, BotKicked])]
pub struct Recovery {
    pool: DbPool,
    desk_open: Arc<AtomicBool>,
}

impl Recovery {
    /// Recovery writing to `pool`; it refuses kicked bots while `desk_open` is false.
    pub fn new(pool: DbPool, desk_open: Arc<AtomicBool>) -> Self {
        Self { pool, desk_open }
    }

    async fn open_case(
        &self,
        d: &Delivery<'_>,
        subject: String,
        action: &str,
    ) -> Result<(), HandlerError> {
        // One case per event: a redelivery finds it there.
        self.pool
            .exec(
                "INSERT INTO recovery_cases VALUES ($1, $2, $3)
                 ON CONFLICT (outbox_event_id) DO NOTHING",
                args![d.event().id, subject.clone(), action],
            )
            .await?;
        story::handled(d, format!("{action}: {subject}"));
        Ok(())
    }
}

impl Handle<PaymentFailedFinal> for Recovery {
    async fn handle(&self, e: &PaymentFailedFinal, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.open_case(
            d,
            format!("subscription {}", story::short(e.subscription_id)),
            "win-back offer",
        )
        .await
    }
}

impl Handle<LicenseUpgraded> for Recovery {
    async fn handle(&self, e: &LicenseUpgraded, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.open_case(
            d,
            format!("license {}", story::short(e.license_id)),
            "close churn watch",
        )
        .await
    }
}

impl Handle<BotKicked> for Recovery {
    async fn handle(&self, e: &BotKicked, d: &Delivery<'_>) -> Result<(), HandlerError> {
        if !self.desk_open.load(Ordering::SeqCst) {
            let error = HandlerError::permanent("the recovery desk is closed");
            story::handled(d, format!("failed, {error}"));
            return Err(error);
        }
        self.open_case(
            d,
            format!("bot {}", story::short(e.bot_id)),
            "offer reinstall",
        )
        .await
    }
}
