//! The billing example's own tests, with the test kit and no database: the billing service with a
//! recording publisher (the seed's publisher test), the licensing consumer with a single delivery
//! (the seed's consumer test), and the retry schedule on a manual clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::testing::{ManualClock, MemoryStore, RecordingPublisher, TestDelivery, drain};
use outbox_core::{
    BoxError, HandlerError, Metadata, OutboxEvent, Publish, PublishError, Relay, RelayConfig,
    router,
};
use outbox_examples::billing::events::{
    LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded, SubscriptionStarted, WinBackOffered,
};
use outbox_examples::billing::licensing::{Licenses, Licensing};
use outbox_examples::billing::notification::{Mailer, Notification};
use outbox_examples::billing::service::{self, BillingTx, PaymentAttempt, Subscription};
use time::macros::datetime;
use uuid::Uuid;

/// A billing transaction without a database: rows in vectors, events in a recording publisher.
#[derive(Default)]
struct FakeBilling {
    events: RecordingPublisher,
    subscriptions: Vec<Subscription>,
    attempts: Vec<PaymentAttempt>,
}

impl<E: OutboxEvent> Publish<E> for FakeBilling {
    async fn publish(&mut self, event: &E) -> Result<(), PublishError> {
        self.events.publish(event).await
    }

    async fn publish_with(&mut self, event: &E, metadata: &Metadata) -> Result<(), PublishError> {
        self.events.publish_with(event, metadata).await
    }

    async fn publish_all<'e>(
        &mut self,
        events: impl IntoIterator<Item = &'e E> + Send,
    ) -> Result<(), PublishError>
    where
        E: 'e,
    {
        self.events.publish_all(events).await
    }
}

impl BillingTx for FakeBilling {
    async fn insert_subscription(&mut self, subscription: &Subscription) -> Result<(), BoxError> {
        self.subscriptions.push(subscription.clone());
        Ok(())
    }

    async fn update_subscription(&mut self, subscription: &Subscription) -> Result<(), BoxError> {
        self.subscriptions.push(subscription.clone());
        Ok(())
    }

    async fn save_attempt(&mut self, attempt: &PaymentAttempt) -> Result<(), BoxError> {
        self.attempts.push(attempt.clone());
        Ok(())
    }
}

fn subscription() -> Subscription {
    Subscription {
        id: Uuid::new_v4(),
        license_id: Uuid::new_v4(),
        customer_email: "ada@example.com".to_owned(),
        period_end: 1_000_000,
        cycle_count: 3,
        status: "active".to_owned(),
    }
}

#[tokio::test]
async fn a_successful_charge_advances_the_subscription_and_publishes_payment_succeeded() {
    let mut tx = FakeBilling::default();
    let sub = subscription();
    let attempt = Uuid::new_v4();
    let now = datetime!(2026-12-02 10:00 UTC);
    let advanced = service::record_successful_charge(&mut tx, &sub, attempt, "key-1", 100, now)
        .await
        .unwrap();

    assert_eq!(tx.events.event_types(), ["PaymentSucceeded"]);
    let published = tx.events.events::<PaymentSucceeded>();
    assert_eq!(
        published,
        [PaymentSucceeded {
            subscription_id: sub.id,
            attempt_id: attempt,
            license_id: sub.license_id,
            new_period_end: 1_000_100,
            cycle_count: 4,
            occurred_at: now,
        }]
    );
    assert_eq!(advanced.period_end, 1_000_100);
    assert_eq!(tx.subscriptions, [advanced]);
    assert_eq!(tx.attempts[0].status, "succeeded");
    assert_eq!(tx.attempts[0].payment_key.as_deref(), Some("key-1"));
}

#[tokio::test]
async fn a_final_failure_lapses_the_subscription_and_publishes_payment_failed_final() {
    let mut tx = FakeBilling::default();
    let sub = subscription();
    let attempt = Uuid::new_v4();
    service::record_final_failure(&mut tx, &sub, attempt, "card expired")
        .await
        .unwrap();
    assert_eq!(
        tx.events.events::<PaymentFailedFinal>(),
        [PaymentFailedFinal {
            subscription_id: sub.id,
            attempt_id: attempt,
            license_id: sub.license_id,
            reason: "card expired".to_owned(),
        }]
    );
    assert_eq!(tx.subscriptions[0].status, "lapsed");
    assert!(tx.events.events::<PaymentSucceeded>().is_empty());
}

/// Licenses that record what licensing asked of them.
#[derive(Default, Clone)]
struct FakeLicenses(Arc<Mutex<Vec<String>>>);

impl FakeLicenses {
    fn calls(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    fn push(&self, call: String) -> Result<(), BoxError> {
        self.0.lock().unwrap().push(call);
        Ok(())
    }
}

impl Licenses for FakeLicenses {
    async fn issue(&self, license_id: Uuid, until: i64) -> Result<(), BoxError> {
        self.push(format!("issue {license_id} {until}"))
    }

    async fn extend(&self, license_id: Uuid, until: i64) -> Result<(), BoxError> {
        self.push(format!("extend {license_id} {until}"))
    }

    async fn suspend(&self, license_id: Uuid) -> Result<(), BoxError> {
        self.push(format!("suspend {license_id}"))
    }

    async fn add_bot(&self, license_id: Uuid, bot_id: Uuid) -> Result<(), BoxError> {
        self.push(format!("add {license_id} {bot_id}"))
    }

    async fn remove_bot(&self, license_id: Uuid, bot_id: Uuid) -> Result<(), BoxError> {
        self.push(format!("remove {license_id} {bot_id}"))
    }
}

#[tokio::test]
async fn licensing_extends_the_license_on_payment_succeeded() {
    let licenses = FakeLicenses::default();
    let licensing = Licensing {
        licenses: licenses.clone(),
    };
    let event = PaymentSucceeded {
        subscription_id: Uuid::new_v4(),
        attempt_id: Uuid::new_v4(),
        license_id: Uuid::new_v4(),
        new_period_end: 1_234,
        cycle_count: 2,
        occurred_at: datetime!(2026-12-02 10:00 UTC),
    };
    TestDelivery::of(&event).to(&licensing).await.unwrap();
    assert_eq!(
        licenses.calls(),
        [format!("extend {} 1234", event.license_id)]
    );
}

#[tokio::test]
async fn licensing_does_not_take_license_upgraded() {
    let licensing = Licensing {
        licenses: FakeLicenses::default(),
    };
    let event = LicenseUpgraded {
        license_id: Uuid::new_v4(),
        tier: "pro".to_owned(),
    };
    let error = TestDelivery::of(&event).to(&licensing).await.unwrap_err();
    assert!(!error.is_transient());
}

/// A mailer that fails a number of times before it sends, and logs each attempt.
#[derive(Clone)]
struct FlakyMailer {
    failures_left: Arc<Mutex<u32>>,
    sent: Arc<Mutex<Vec<String>>>,
}

impl Mailer for FlakyMailer {
    async fn send(&self, _event_id: i64, to: &str, _message: &str) -> Result<(), HandlerError> {
        let mut left = self.failures_left.lock().unwrap();
        if *left > 0 {
            *left -= 1;
            return Err(HandlerError::transient("mail server answered 503"));
        }
        self.sent.lock().unwrap().push(to.to_owned());
        Ok(())
    }
}

#[router(events = [
    SubscriptionStarted,
    PaymentSucceeded,
    PaymentFailedFinal,
    LicenseUpgraded,
    WinBackOffered,
])]
struct MailOnly {
    notification: Notification<FlakyMailer>,
}

#[tokio::test]
async fn a_failing_mailer_is_retried_on_the_seeds_schedule() {
    let clock = ManualClock::default();
    let store = MemoryStore::with_clock(clock.clone());
    let mailer = FlakyMailer {
        failures_left: Arc::new(Mutex::new(3)),
        sent: Arc::default(),
    };
    let relay = Relay::new(
        store.clone(),
        MailOnly {
            notification: Notification {
                mailer: mailer.clone(),
            },
        },
        RelayConfig::default(),
    )
    .unwrap();
    store
        .publish(&SubscriptionStarted {
            subscription_id: Uuid::new_v4(),
            license_id: Uuid::new_v4(),
            customer_email: "ada@example.com".to_owned(),
            period_end: 0,
        })
        .unwrap();
    let minute = Duration::from_secs(60);

    // Fails at once, then after 1 minute, then after 5 more; the third retry, 15 minutes later,
    // gets through.
    for (wait, failures_so_far) in [(Duration::ZERO, 1), (minute, 2), (5 * minute, 3)] {
        clock.advance(wait);
        drain(&relay).await.unwrap();
        let attempts = store.deliveries()[0].attempts;
        assert_eq!(attempts, failures_so_far);
        assert!(mailer.sent.lock().unwrap().is_empty());
    }
    clock.advance(15 * minute - Duration::from_secs(1));
    drain(&relay).await.unwrap();
    assert!(mailer.sent.lock().unwrap().is_empty(), "retried early");
    clock.advance(Duration::from_secs(1));
    let report = drain(&relay).await.unwrap();
    assert_eq!(report.delivered, 1);
    assert_eq!(*mailer.sent.lock().unwrap(), ["ada@example.com"]);
    assert_eq!(store.pending(), 0);
}
