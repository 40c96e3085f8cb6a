//! The seed's dispatcher, expressed with `#[subscriber]` and `#[router]`: licensing,
//! notification and recovery take the events the seed's `resolveSubscribers` gives them, and
//! audit observes every event.

use std::sync::{Arc, Mutex};

use outbox_core::{Delivery, Handle, HandlerError, Observer, OutboxEvent, router, subscriber};

use crate::events::{
    BotInstalled, BotKicked, LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded,
    SubscriptionStarted,
};

/// Who was called with which event type, in call order.
#[derive(Clone, Default)]
pub struct Calls(Arc<Mutex<Vec<(String, String)>>>);

impl Calls {
    /// Every call so far, as (subscriber, event type).
    pub fn all(&self) -> Vec<(String, String)> {
        self.0.lock().unwrap().clone()
    }

    fn push(&self, delivery: &Delivery<'_>) {
        self.0.lock().unwrap().push((
            delivery.subscriber().to_owned(),
            delivery.event().event_type.clone(),
        ));
    }
}

/// Licensing: extends, suspends and counts licenses.
#[subscriber(events = [PaymentSucceeded, PaymentFailedFinal, SubscriptionStarted, BotInstalled, BotKicked])]
pub struct Licensing(Calls);

/// Notification: tells the user.
#[subscriber(events = [PaymentSucceeded, PaymentFailedFinal, SubscriptionStarted, LicenseUpgraded])]
pub struct Notification(Calls);

/// Recovery: offers ways back after a failure.
#[subscriber(events = [PaymentFailedFinal, LicenseUpgraded, BotKicked])]
pub struct Recovery(Calls);

/// Audit: records every event.
pub struct Audit(Calls);

impl<E: OutboxEvent> Handle<E> for Licensing {
    async fn handle(&self, _: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.push(delivery);
        Ok(())
    }
}

impl<E: OutboxEvent> Handle<E> for Notification {
    async fn handle(&self, _: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.push(delivery);
        Ok(())
    }
}

impl<E: OutboxEvent> Handle<E> for Recovery {
    async fn handle(&self, _: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.push(delivery);
        Ok(())
    }
}

impl Observer for Audit {
    const NAME: &'static str = "audit";

    async fn observe(&self, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.push(delivery);
        Ok(())
    }
}

/// The seed's dispatcher: audit takes every event, the rest as its `switch` says.
#[router(events = [
    PaymentSucceeded,
    PaymentFailedFinal,
    SubscriptionStarted,
    LicenseUpgraded,
    BotInstalled,
    BotKicked,
])]
pub struct Billing {
    #[observer]
    /// Observes every event.
    pub audit: Audit,
    /// Extends and suspends licenses.
    pub licensing: Licensing,
    /// Tells the user.
    pub notification: Notification,
    /// Offers recovery flows.
    pub recovery: Recovery,
}

/// The router, every member logging to `calls`.
pub fn billing(calls: &Calls) -> Billing {
    Billing {
        audit: Audit(calls.clone()),
        licensing: Licensing(calls.clone()),
        notification: Notification(calls.clone()),
        recovery: Recovery(calls.clone()),
    }
}
