//! Recovery: opens a case when a customer may be slipping away, exactly once
//! (`Outbox::handle_once`), and after a final payment failure offers a win-back deal: a
//! follow-up event published in the same transaction as the case.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use outbox_core::{Delivery, Handle, HandlerError, subscriber};

use super::db::DbOutbox;
use super::events::{BotKicked, LicenseUpgraded, PaymentFailedFinal, WinBackOffered};
use super::story;
use crate::args;

/// The recovery subscriber. Its desk can be closed, to show a permanent failure, a dead letter,
/// and an operator's requeue.
#[subscriber(events = [PaymentFailedFinal, LicenseUpgraded, BotKicked])]
pub struct Recovery {
    outbox: DbOutbox,
    desk_open: Arc<AtomicBool>,
}

impl Recovery {
    /// Recovery writing through `outbox`; it refuses kicked bots while `desk_open` is false.
    pub fn new(outbox: DbOutbox, desk_open: Arc<AtomicBool>) -> Self {
        Self { outbox, desk_open }
    }

    async fn open_case(
        &self,
        d: &Delivery<'_>,
        subject: String,
        action: &str,
        follow_up: Option<WinBackOffered>,
    ) -> Result<(), HandlerError> {
        // One case per event, with its follow-up: a redelivery runs nothing.
        let offer = follow_up.as_ref().map(|f| f.offer.clone());
        self.outbox
            .exec_once(
                d,
                "INSERT INTO recovery_cases VALUES ($1, $2, $3)",
                args![d.event().id, subject.clone(), action],
                follow_up,
            )
            .await?;
        match offer {
            Some(offer) => story::handled(
                d,
                format!("{action}: {subject}; published WinBackOffered ({offer})"),
            ),
            None => story::handled(d, format!("{action}: {subject}")),
        }
        Ok(())
    }
}

impl Handle<PaymentFailedFinal> for Recovery {
    async fn handle(&self, e: &PaymentFailedFinal, d: &Delivery<'_>) -> Result<(), HandlerError> {
        let offer = WinBackOffered {
            subscription_id: e.subscription_id,
            offer: "two months at half price".to_owned(),
        };
        self.open_case(
            d,
            format!("subscription {}", story::short(e.subscription_id)),
            "win-back offer",
            Some(offer),
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
            None,
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
            None,
        )
        .await
    }
}
