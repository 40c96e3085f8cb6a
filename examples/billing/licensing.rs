//! Licensing: issues, extends and suspends licenses, and counts the bots on them.
//!
//! Each handler is idempotent, because delivery is at least once: extending uses the seed's
//! `GREATEST(expires_at, $1)`, issuing and adding a bot ignore a row that is already there,
//! suspending and removing are no-ops the second time.

use std::future::Future;

use outbox_core::{BoxError, Delivery, Handle, HandlerError, subscriber};
use uuid::Uuid;

use super::db::DbPool;
use super::events::{
    BotInstalled, BotKicked, PaymentFailedFinal, PaymentSucceeded, SubscriptionStarted,
};
use super::story;
use crate::args;

/// Where licenses live: the port licensing's handlers write through.
pub trait Licenses: Send + Sync + 'static {
    /// Issues a license valid until `until` (Unix seconds), unless it exists.
    fn issue(
        &self,
        license_id: Uuid,
        until: i64,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Extends a license to `until`, unless it already runs longer.
    fn extend(
        &self,
        license_id: Uuid,
        until: i64,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Suspends a license, unless it was canceled.
    fn suspend(&self, license_id: Uuid) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Counts a bot against a license.
    fn add_bot(
        &self,
        license_id: Uuid,
        bot_id: Uuid,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
    /// Stops counting a bot against a license.
    fn remove_bot(
        &self,
        license_id: Uuid,
        bot_id: Uuid,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// Licenses in the example's database.
#[derive(Debug, Clone)]
pub struct DbLicenses(pub DbPool);

impl Licenses for DbLicenses {
    async fn issue(&self, license_id: Uuid, until: i64) -> Result<(), BoxError> {
        self.0
            .exec(
                "INSERT INTO licenses VALUES ($1, 'basic', 'active', $2) ON CONFLICT (id) DO NOTHING",
                args![license_id, until],
            )
            .await?;
        Ok(())
    }

    async fn extend(&self, license_id: Uuid, until: i64) -> Result<(), BoxError> {
        self.0
            .exec(self.0.extend_license_sql(), args![license_id, until])
            .await?;
        Ok(())
    }

    async fn suspend(&self, license_id: Uuid) -> Result<(), BoxError> {
        self.0
            .exec(
                "UPDATE licenses SET status = 'suspended' WHERE id = $1 AND status <> 'canceled'",
                args![license_id],
            )
            .await?;
        Ok(())
    }

    async fn add_bot(&self, license_id: Uuid, bot_id: Uuid) -> Result<(), BoxError> {
        self.0
            .exec(
                "INSERT INTO license_bots VALUES ($1, $2) ON CONFLICT (license_id, bot_id) DO NOTHING",
                args![license_id, bot_id],
            )
            .await?;
        Ok(())
    }

    async fn remove_bot(&self, license_id: Uuid, bot_id: Uuid) -> Result<(), BoxError> {
        self.0
            .exec(
                "DELETE FROM license_bots WHERE license_id = $1 AND bot_id = $2",
                args![license_id, bot_id],
            )
            .await?;
        Ok(())
    }
}

/// The licensing subscriber, generic over where licenses live so that its handlers can be unit
/// tested with a fake.
#[subscriber(events = [SubscriptionStarted, PaymentSucceeded, PaymentFailedFinal, BotInstalled, BotKicked])]
pub struct Licensing<L: Licenses = DbLicenses> {
    /// Where licenses live.
    pub licenses: L,
}

impl<L: Licenses> Handle<SubscriptionStarted> for Licensing<L> {
    async fn handle(&self, e: &SubscriptionStarted, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.licenses.issue(e.license_id, e.period_end).await?;
        story::handled(
            d,
            format!(
                "issued license {} until {}",
                story::short(e.license_id),
                story::date(e.period_end)
            ),
        );
        Ok(())
    }
}

impl<L: Licenses> Handle<PaymentSucceeded> for Licensing<L> {
    async fn handle(&self, e: &PaymentSucceeded, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.licenses.extend(e.license_id, e.new_period_end).await?;
        story::handled(
            d,
            format!(
                "extended license {} to {}",
                story::short(e.license_id),
                story::date(e.new_period_end)
            ),
        );
        Ok(())
    }
}

impl<L: Licenses> Handle<PaymentFailedFinal> for Licensing<L> {
    async fn handle(&self, e: &PaymentFailedFinal, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.licenses.suspend(e.license_id).await?;
        story::handled(
            d,
            format!("suspended license {}", story::short(e.license_id)),
        );
        Ok(())
    }
}

impl<L: Licenses> Handle<BotInstalled> for Licensing<L> {
    async fn handle(&self, e: &BotInstalled, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.licenses.add_bot(e.license_id, e.bot_id).await?;
        story::handled(
            d,
            format!(
                "counted bot {} on license {}",
                story::short(e.bot_id),
                story::short(e.license_id)
            ),
        );
        Ok(())
    }
}

impl<L: Licenses> Handle<BotKicked> for Licensing<L> {
    async fn handle(&self, e: &BotKicked, d: &Delivery<'_>) -> Result<(), HandlerError> {
        self.licenses.remove_bot(e.license_id, e.bot_id).await?;
        story::handled(
            d,
            format!("freed the seat of bot {}", story::short(e.bot_id)),
        );
        Ok(())
    }
}
