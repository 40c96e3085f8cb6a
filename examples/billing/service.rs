//! The services that change domain state and publish what happened, each in one transaction.
//!
//! Billing is written against a port, [`BillingTx`]: its tables and the events it publishes. In
//! production the port is an outbox transaction; in unit tests it is a fake with a
//! [`RecordingPublisher`](outbox_core::testing::RecordingPublisher) inside (see the example's
//! tests), so the service is tested without a database, as the seed's publisher test does.

use std::future::Future;

use outbox_core::{BoxError, Publish};
use outbox_sqlx::{Outbox, OutboxTx};
use time::OffsetDateTime;
use uuid::Uuid;

use super::app::App;
use super::db::Db;
use super::events::{
    BotInstalled, BotKicked, LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded,
    SubscriptionStarted,
};
use crate::args;

/// A subscription, as billing keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct Subscription {
    /// Its id.
    pub id: Uuid,
    /// The license it pays for.
    pub license_id: Uuid,
    /// Who pays.
    pub customer_email: String,
    /// The end of the period paid for, Unix seconds.
    pub period_end: i64,
    /// Cycles paid so far.
    pub cycle_count: i64,
    /// `active` or `lapsed`.
    pub status: String,
}

/// One attempt to charge a subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct PaymentAttempt {
    /// Its id.
    pub id: Uuid,
    /// The subscription charged.
    pub subscription_id: Uuid,
    /// `succeeded` or `failed`.
    pub status: String,
    /// The payment provider's key, on success.
    pub payment_key: Option<String>,
}

/// What billing needs inside one transaction: its tables and the events it publishes.
pub trait BillingTx:
    Publish<SubscriptionStarted> + Publish<PaymentSucceeded> + Publish<PaymentFailedFinal>
{
    /// Stores a new subscription.
    fn insert_subscription(
        &mut self,
        subscription: &Subscription,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Stores a subscription's new period, cycle count and status.
    fn update_subscription(
        &mut self,
        subscription: &Subscription,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Stores a payment attempt.
    fn save_attempt(
        &mut self,
        attempt: &PaymentAttempt,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

impl<DB: Db> BillingTx for OutboxTx<'_, DB, App> {
    async fn insert_subscription(&mut self, s: &Subscription) -> Result<(), BoxError> {
        DB::exec(
            self,
            "INSERT INTO subscriptions VALUES ($1, $2, $3, $4, $5, $6)",
            args![
                s.id,
                s.license_id,
                s.customer_email.clone(),
                s.period_end,
                s.cycle_count,
                s.status.clone()
            ],
        )
        .await?;
        Ok(())
    }

    async fn update_subscription(&mut self, s: &Subscription) -> Result<(), BoxError> {
        DB::exec(
            self,
            "UPDATE subscriptions SET period_end = $2, cycle_count = $3, status = $4 WHERE id = $1",
            args![s.id, s.period_end, s.cycle_count, s.status.clone()],
        )
        .await?;
        Ok(())
    }

    async fn save_attempt(&mut self, a: &PaymentAttempt) -> Result<(), BoxError> {
        let key = a.payment_key.clone().unwrap_or_default();
        DB::exec(
            self,
            "INSERT INTO payment_attempts VALUES ($1, $2, $3, NULLIF($4, ''))
             ON CONFLICT (id) DO UPDATE SET status = excluded.status,
                                            payment_key = excluded.payment_key",
            args![a.id, a.subscription_id, a.status.clone(), key],
        )
        .await?;
        Ok(())
    }
}

/// Starts a subscription: the subscription row and `SubscriptionStarted`, together.
pub async fn start_subscription(
    tx: &mut impl BillingTx,
    subscription: &Subscription,
) -> Result<(), BoxError> {
    tx.insert_subscription(subscription).await?;
    tx.publish(&SubscriptionStarted {
        subscription_id: subscription.id,
        license_id: subscription.license_id,
        customer_email: subscription.customer_email.clone(),
        period_end: subscription.period_end,
    })
    .await?;
    Ok(())
}

/// The seed's `handleChargeSuccess`: the attempt succeeded, the subscription advances one
/// period, and `PaymentSucceeded` is published, all in `tx`.
pub async fn record_successful_charge(
    tx: &mut impl BillingTx,
    subscription: &Subscription,
    attempt_id: Uuid,
    payment_key: &str,
    period_length_secs: i64,
    now: OffsetDateTime,
) -> Result<Subscription, BoxError> {
    tx.save_attempt(&PaymentAttempt {
        id: attempt_id,
        subscription_id: subscription.id,
        status: "succeeded".to_owned(),
        payment_key: Some(payment_key.to_owned()),
    })
    .await?;
    let advanced = Subscription {
        period_end: subscription.period_end + period_length_secs,
        cycle_count: subscription.cycle_count + 1,
        ..subscription.clone()
    };
    tx.update_subscription(&advanced).await?;
    tx.publish(&PaymentSucceeded {
        subscription_id: advanced.id,
        attempt_id,
        license_id: advanced.license_id,
        new_period_end: advanced.period_end,
        cycle_count: advanced.cycle_count,
        occurred_at: now,
    })
    .await?;
    Ok(advanced)
}

/// The last retry of a charge failed: the attempt fails, the subscription lapses, and
/// `PaymentFailedFinal` is published, all in `tx`.
pub async fn record_final_failure(
    tx: &mut impl BillingTx,
    subscription: &Subscription,
    attempt_id: Uuid,
    reason: &str,
) -> Result<Subscription, BoxError> {
    tx.save_attempt(&PaymentAttempt {
        id: attempt_id,
        subscription_id: subscription.id,
        status: "failed".to_owned(),
        payment_key: None,
    })
    .await?;
    let lapsed = Subscription {
        status: "lapsed".to_owned(),
        ..subscription.clone()
    };
    tx.update_subscription(&lapsed).await?;
    tx.publish(&PaymentFailedFinal {
        subscription_id: lapsed.id,
        attempt_id,
        license_id: lapsed.license_id,
        reason: reason.to_owned(),
    })
    .await?;
    Ok(lapsed)
}

/// Licensing sells a higher tier: the license row and `LicenseUpgraded`, together.
pub async fn upgrade_license<DB: Db>(
    outbox: &Outbox<DB, App>,
    license_id: Uuid,
    tier: &str,
) -> Result<(), BoxError> {
    let mut tx = outbox.begin().await?;
    DB::exec(
        &mut tx,
        "UPDATE licenses SET tier = $2 WHERE id = $1",
        args![license_id, tier],
    )
    .await?;
    tx.publish(&LicenseUpgraded {
        license_id,
        tier: tier.to_owned(),
    })
    .await?;
    tx.commit().await?;
    Ok(())
}

/// A workspace installs a bot: the bot row and `BotInstalled`, together.
pub async fn install_bot<DB: Db>(
    outbox: &Outbox<DB, App>,
    bot_id: Uuid,
    license_id: Uuid,
) -> Result<(), BoxError> {
    let mut tx = outbox.begin().await?;
    DB::exec(
        &mut tx,
        "INSERT INTO bots VALUES ($1, $2, 'installed')",
        args![bot_id, license_id],
    )
    .await?;
    tx.publish(&BotInstalled { bot_id, license_id }).await?;
    tx.commit().await?;
    Ok(())
}

/// A workspace kicks a bot: the bot row and `BotKicked`, together.
pub async fn kick_bot<DB: Db>(
    outbox: &Outbox<DB, App>,
    bot_id: Uuid,
    license_id: Uuid,
    reason: &str,
) -> Result<(), BoxError> {
    let mut tx = outbox.begin().await?;
    DB::exec(
        &mut tx,
        "UPDATE bots SET status = 'kicked' WHERE id = $1",
        args![bot_id],
    )
    .await?;
    tx.publish(&BotKicked {
        bot_id,
        license_id,
        reason: reason.to_owned(),
    })
    .await?;
    tx.commit().await?;
    Ok(())
}
