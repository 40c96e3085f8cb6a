//! The application's router: the seed's dispatcher, checked by the compiler.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32};

use outbox_core::router;

use super::audit::Audit;
use super::db::{DbOutbox, DbPool};
use super::events::{
    BotInstalled, BotKicked, LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded,
    SubscriptionStarted, WinBackOffered,
};
use super::licensing::{DbLicenses, Licensing};
use super::notification::{DbMailer, Notification};
use super::recovery::Recovery;

/// Audit observes everything; licensing, notification and recovery take what the seed's
/// `resolveSubscribers` gives them (each subscriber's `events` list says which).
#[router(events = [
    SubscriptionStarted,
    PaymentSucceeded,
    PaymentFailedFinal,
    LicenseUpgraded,
    BotInstalled,
    BotKicked,
    WinBackOffered,
])]
pub struct App {
    /// Records every event, exactly once.
    #[observer]
    pub audit: Audit,
    /// Keeps licenses in step with billing.
    pub licensing: Licensing,
    /// Tells the customer.
    pub notification: Notification,
    /// Opens recovery cases.
    pub recovery: Recovery,
}

/// Switches the scenario uses to make subscribers fail.
#[derive(Debug, Clone)]
pub struct Controls {
    /// How many sends the mail server refuses (transient failures).
    pub mail_outage: Arc<AtomicU32>,
    /// Whether the recovery desk takes kicked bots (closed: permanent failures).
    pub recovery_desk_open: Arc<AtomicBool>,
}

impl Default for Controls {
    fn default() -> Self {
        Self {
            mail_outage: Arc::new(AtomicU32::new(0)),
            recovery_desk_open: Arc::new(AtomicBool::new(true)),
        }
    }
}

impl App {
    /// The application's subscribers over `pool`; audit and recovery write through `outbox`
    /// (the outbox of the same database), exactly once.
    pub fn new(pool: &DbPool, outbox: &DbOutbox, controls: &Controls) -> Self {
        Self {
            audit: Audit(outbox.clone()),
            licensing: Licensing {
                licenses: DbLicenses(pool.clone()),
            },
            notification: Notification {
                mailer: DbMailer::new(pool.clone(), controls.mail_outage.clone()),
            },
            recovery: Recovery::new(outbox.clone(), controls.recovery_desk_open.clone()),
        }
    }
}
