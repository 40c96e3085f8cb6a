//! Events and helpers shared by the cross-crate tests.
//!
//! - [`events`] model the seed's billing scenario; each has a canonical sample in [`samples`],
//!   whose encoded payload is pinned by a golden file under `fixtures/`.
//! - [`pg`] gives each test a fresh PostgreSQL database; [`backend`] runs one test body on
//!   PostgreSQL and on a SQLite file; [`server`] starts a PostgreSQL server of a test's own, for
//!   tests that restart it.
//! - [`kit`] has scripted subscribers and the routers that combine them, for relay tests.
//! - [`process`] runs an ignored test of the current binary as a process of its own (a relay
//!   that a test kills).
//! - [`seed`] is the seed's dispatcher as a router.

pub mod backend;
pub mod kit;
pub mod my;
pub mod pg;
pub mod process;
pub mod seed;
pub mod server;
pub mod workers;

pub mod events {
    //! Test events covering every form the derive supports.

    use outbox_core::OutboxEvent;
    use serde::{Deserialize, Serialize};
    use serde_json::{Value, json};
    use time::OffsetDateTime;
    use uuid::Uuid;

    /// The seed's event: a recurring charge succeeded. Carries its own `occurred_at`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "subscription", event_type = "PaymentSucceeded")]
    pub struct PaymentSucceeded {
        /// The subscription charged.
        #[outbox(aggregate_id)]
        pub subscription_id: Uuid,
        /// The payment attempt that succeeded.
        pub attempt_id: Uuid,
        /// The license the subscription pays for.
        pub license_id: Uuid,
        /// The end of the period now paid for.
        #[serde(with = "time::serde::rfc3339")]
        pub new_period_end: OffsetDateTime,
        /// How many cycles have been paid, this one included.
        pub cycle_count: u32,
        /// When the charge succeeded.
        #[outbox(occurred_at)]
        #[serde(with = "time::serde::rfc3339")]
        pub occurred_at: OffsetDateTime,
    }

    /// A bot was removed from a workspace. Event type defaults to the type name; optional fields.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "bot")]
    pub struct BotKicked {
        /// The bot.
        #[outbox(aggregate_id)]
        pub bot_id: Uuid,
        /// Why, when an operator gave a reason.
        pub reason: Option<String>,
        /// When, if known; `None` lets the store record the publishing time.
        #[outbox(occurred_at)]
        #[serde(with = "time::serde::rfc3339::option")]
        pub kicked_at: Option<OffsetDateTime>,
    }

    /// A license changed tier; now at version 3, with upcasters from versions 1 and 2.
    ///
    /// - v1: `{"license_id", "plan": "PRO"}`
    /// - v2: `plan` renamed to `tier`
    /// - v3: `tier` lower-cased, `seats` added (1 for licenses upgraded before seats existed)
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
    #[outbox(
        aggregate_type = "license",
        event_type = "LicenseUpgraded",
        version = 3
    )]
    #[outbox(upcast(from = 1, with = license_upgraded_v1_to_v2))]
    #[outbox(upcast(from = 2, with = license_upgraded_v2_to_v3))]
    pub struct LicenseUpgraded {
        /// The license.
        #[outbox(aggregate_id)]
        pub license_id: Uuid,
        /// The new tier, lower case.
        pub tier: String,
        /// Seats included.
        pub seats: u32,
    }

    /// v1 -> v2: `plan` is renamed to `tier`.
    pub fn license_upgraded_v1_to_v2(mut data: Value) -> Result<Value, String> {
        let obj = data.as_object_mut().ok_or("data is not an object")?;
        let plan = obj.remove("plan").ok_or("v1 data has no `plan`")?;
        obj.insert("tier".to_owned(), plan);
        Ok(data)
    }

    /// v2 -> v3: `tier` is lower-cased and `seats` is added with the old implicit value, 1.
    pub fn license_upgraded_v2_to_v3(mut data: Value) -> Result<Value, String> {
        let obj = data.as_object_mut().ok_or("data is not an object")?;
        let tier = obj
            .get("tier")
            .and_then(Value::as_str)
            .ok_or("v2 data has no string `tier`")?
            .to_lowercase();
        obj.insert("tier".to_owned(), json!(tier));
        obj.insert("seats".to_owned(), json!(1));
        Ok(data)
    }

    /// A charge failed for the last time: the subscription lapses.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "subscription", event_type = "PaymentFailedFinal")]
    pub struct PaymentFailedFinal {
        /// The subscription.
        #[outbox(aggregate_id)]
        pub subscription_id: Uuid,
        /// The license it paid for.
        pub license_id: Uuid,
    }

    /// A bot joined a workspace.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "bot")]
    pub struct BotInstalled {
        /// The bot.
        #[outbox(aggregate_id)]
        pub bot_id: Uuid,
        /// The license it counts against.
        pub license_id: Uuid,
    }

    /// An event at version 2 that keeps no upcaster: version 1 payloads cannot be read.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "subscription", version = 2)]
    pub struct SubscriptionStarted {
        /// The subscription.
        #[outbox(aggregate_id)]
        pub subscription_id: Uuid,
        /// The plan subscribed to.
        pub plan: String,
    }
}

pub mod samples {
    //! One canonical value per test event, for golden files.

    use time::macros::datetime;
    use uuid::{Uuid, uuid};

    use crate::events::{BotKicked, LicenseUpgraded, PaymentSucceeded, SubscriptionStarted};

    /// A fixed subscription id.
    pub const SUBSCRIPTION: Uuid = uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0c01");
    /// A fixed license id.
    pub const LICENSE: Uuid = uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0c02");
    /// A fixed bot id.
    pub const BOT: Uuid = uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0c03");

    /// The canonical `PaymentSucceeded`.
    pub fn payment_succeeded() -> PaymentSucceeded {
        PaymentSucceeded {
            subscription_id: SUBSCRIPTION,
            attempt_id: uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0c04"),
            license_id: LICENSE,
            new_period_end: datetime!(2026-12-31 15:00 UTC),
            cycle_count: 7,
            occurred_at: datetime!(2026-12-01 09:30:15 UTC),
        }
    }

    /// The canonical `BotKicked`.
    pub fn bot_kicked() -> BotKicked {
        BotKicked {
            bot_id: BOT,
            reason: Some("스팸 발송 — spam".to_owned()),
            kicked_at: None,
        }
    }

    /// The canonical `LicenseUpgraded`.
    pub fn license_upgraded() -> LicenseUpgraded {
        LicenseUpgraded {
            license_id: LICENSE,
            tier: "pro".to_owned(),
            seats: 5,
        }
    }

    /// The canonical `SubscriptionStarted`.
    pub fn subscription_started() -> SubscriptionStarted {
        SubscriptionStarted {
            subscription_id: SUBSCRIPTION,
            plan: "monthly".to_owned(),
        }
    }
}
