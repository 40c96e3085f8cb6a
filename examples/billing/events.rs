//! The events of the seed's billing scenario. Each derives `schemars::JsonSchema` beside
//! `OutboxEvent`, so that the router's catalog publishes its shape
//! (`cargo run --example billing -- catalog --format asyncapi`) and the compatibility check
//! (`examples/tests/catalog.rs`) pins it.

use outbox_core::OutboxEvent;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use uuid::Uuid;

/// A subscription began: a license is issued until the end of the first period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
pub struct SubscriptionStarted {
    /// The subscription.
    #[outbox(aggregate_id)]
    pub subscription_id: Uuid,
    /// The license it pays for.
    pub license_id: Uuid,
    /// Who to tell.
    pub customer_email: String,
    /// The end of the first period, Unix seconds.
    pub period_end: i64,
}

/// A recurring charge succeeded (the seed's `PaymentSucceededEvent`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
pub struct PaymentSucceeded {
    /// The subscription charged.
    #[outbox(aggregate_id)]
    pub subscription_id: Uuid,
    /// The payment attempt that succeeded.
    pub attempt_id: Uuid,
    /// The license it pays for.
    pub license_id: Uuid,
    /// The end of the period now paid for, Unix seconds.
    pub new_period_end: i64,
    /// Cycles paid so far, this one included.
    pub cycle_count: i64,
    /// When the charge succeeded.
    #[outbox(occurred_at)]
    #[serde(with = "time::serde::rfc3339")]
    #[schemars(with = "String", extend("format" = "date-time"))]
    pub occurred_at: OffsetDateTime,
}

/// The last retry of a charge failed: the subscription lapses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
pub struct PaymentFailedFinal {
    /// The subscription.
    #[outbox(aggregate_id)]
    pub subscription_id: Uuid,
    /// The attempt that failed last.
    pub attempt_id: Uuid,
    /// The license it paid for.
    pub license_id: Uuid,
    /// The payment provider's reason.
    pub reason: String,
}

/// A license moved to a higher tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "license")]
pub struct LicenseUpgraded {
    /// The license.
    #[outbox(aggregate_id)]
    pub license_id: Uuid,
    /// The new tier.
    pub tier: String,
}

/// A bot was installed in a workspace under a license.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
pub struct BotInstalled {
    /// The bot.
    #[outbox(aggregate_id)]
    pub bot_id: Uuid,
    /// The license it counts against.
    pub license_id: Uuid,
}

/// A bot was removed from its workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "bot")]
pub struct BotKicked {
    /// The bot.
    #[outbox(aggregate_id)]
    pub bot_id: Uuid,
    /// The license it counted against.
    pub license_id: Uuid,
    /// Why.
    pub reason: String,
}

/// Recovery made a win-back offer after a final payment failure: a follow-up event, published
/// by the recovery subscriber in the transaction that opened the case (so it exists exactly
/// when the case does), caused by the `PaymentFailedFinal` it handled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
pub struct WinBackOffered {
    /// The lapsed subscription.
    #[outbox(aggregate_id)]
    pub subscription_id: Uuid,
    /// What is offered.
    pub offer: String,
}
