//! Evolution, on PostgreSQL and on SQLite: durable names that outlive the code that wrote them.
//! A renamed event type and a renamed subscriber, declared with `formerly`, keep the work
//! stored under their old names.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, RetryPolicy, Router, router,
    subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::run_until;
use outbox_tests::on_both_backends;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

on_both_backends!(a_renamed_event_type_and_subscriber_keep_their_stored_work);

/// The old build's event.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", event_type = "BotAdded")]
struct BotAdded {
    #[outbox(aggregate_id)]
    bot: Uuid,
    seq: u32,
}

/// The new build's: the same event, renamed.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", event_type = "BotInstalled", formerly = ["BotAdded"])]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot: Uuid,
    seq: u32,
}

/// Calls as (subscriber name the handler saw, event type stored, aggregate, seq, attempt, ok).
type Calls = Arc<Mutex<Vec<(String, String, Uuid, u32, u32, bool)>>>;

/// The old build's subscriber: it fails the first attempt of `fail_first`.
#[subscriber(events = [BotAdded], name = "mailer")]
struct Mailer {
    calls: Calls,
    fail_first: (Uuid, u32),
}

impl Handle<BotAdded> for Mailer {
    async fn handle(&self, event: &BotAdded, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        let ok = (event.bot, event.seq) != self.fail_first || delivery.attempt() > 1;
        self.calls.lock().unwrap().push((
            delivery.subscriber().to_owned(),
            delivery.event().event_type.clone(),
            event.bot,
            event.seq,
            delivery.attempt(),
            ok,
        ));
        if ok {
            Ok(())
        } else {
            Err(HandlerError::transient("the mail server is down"))
        }
    }
}

#[router(events = [BotAdded])]
struct OldBuild {
    mailer: Mailer,
}

/// The new build's subscriber: `mailer`, renamed.
#[subscriber(events = [BotInstalled], name = "notifier", formerly = ["mailer"])]
struct Notifier {
    calls: Calls,
}

impl Handle<BotInstalled> for Notifier {
    async fn handle(
        &self,
        event: &BotInstalled,
        delivery: &Delivery<'_>,
    ) -> Result<(), HandlerError> {
        self.calls.lock().unwrap().push((
            delivery.subscriber().to_owned(),
            delivery.event().event_type.clone(),
            event.bot,
            event.seq,
            delivery.attempt(),
            true,
        ));
        Ok(())
    }
}

#[router(events = [BotInstalled])]
struct NewBuild {
    notifier: Notifier,
}

fn config(retry: Duration) -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_retry(RetryPolicy::new([retry]).unwrap())
        .with_retry_in_place(Duration::ZERO)
}

async fn a_renamed_event_type_and_subscriber_keep_their_stored_work<B: TestBackend>() {
    let (_db, old) = outbox::<B, OldBuild>().await;
    let new = Outbox::<B, NewBuild>::new(old.pool().clone());
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let publish_old = async |events: &[(Uuid, u32)]| {
        let mut tx = old.begin().await.unwrap();
        for &(bot, seq) in events {
            tx.publish(&BotAdded { bot, seq }).await.unwrap();
        }
        tx.commit().await.unwrap();
    };

    // The old build delivers some events: the mailer fails a's first, so that a's first three
    // wait as deliveries stored under `mailer` (the first for a retry far away), while b's
    // are delivered.
    publish_old(&[(a, 1), (a, 2), (a, 3), (b, 1), (b, 2)]).await;
    let old_calls = Calls::default();
    let old_relay = Relay::new(
        old.store(),
        OldBuild {
            mailer: Mailer {
                calls: old_calls.clone(),
                fail_first: (a, 1),
            },
        },
        config(Duration::from_secs(3600)),
    )
    .unwrap();
    run_until(&old_relay, Duration::from_secs(20), || {
        old_calls.lock().unwrap().len() == 3
    })
    .await;
    let waiting: Vec<(String, u64)> = old
        .subscribers()
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.subscriber, s.pending))
        .collect();
    assert_eq!(
        waiting,
        [("mailer".to_owned(), 3)],
        "a's events wait, stored as `mailer`"
    );
    // Events the old build never saw: of the old type, and (after the deploy) of the new.
    publish_old(&[(a, 4), (b, 3)]).await;
    let mut tx = new.begin().await.unwrap();
    tx.publish(&BotInstalled { bot: a, seq: 5 }).await.unwrap();
    tx.publish(&BotInstalled { bot: b, seq: 4 }).await.unwrap();
    tx.commit().await.unwrap();

    // The new build delivers everything to the renamed subscriber, in order per aggregate:
    // the deliveries stored as `mailer`, the events stored as `BotAdded`, and its own.
    let calls = Calls::default();
    let new_relay = Relay::new(
        new.store(),
        NewBuild {
            notifier: Notifier {
                calls: calls.clone(),
            },
        },
        config(Duration::from_millis(50)),
    )
    .unwrap();
    let of = |bot: Uuid| {
        let calls = calls.lock().unwrap();
        calls
            .iter()
            .filter(|c| c.2 == bot)
            .map(|c| c.3)
            .collect::<Vec<_>>()
    };
    // First while a's retry is not due: b flows, a's new events wait behind the deliveries
    // stored as `mailer`.
    run_until(&new_relay, Duration::from_secs(20), || of(b).len() == 2).await;
    for _ in 0..3 {
        new_relay.run_once().await.unwrap();
    }
    assert_eq!(of(a), [0u32; 0], "a waits for its retry");
    // Then the retry the old build scheduled is due (as after its delay).
    B::make_deliveries_due(old.pool()).await;
    run_until(&new_relay, Duration::from_secs(20), || of(a).len() == 5).await;
    assert_eq!(of(a), [1, 2, 3, 4, 5]);
    assert_eq!(of(b), [3, 4]);
    let calls = calls.lock().unwrap().clone();
    assert!(
        calls.iter().all(|c| c.0 == "notifier"),
        "the handler sees its current name: {calls:?}"
    );
    let stored_types: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
    assert_eq!(
        stored_types.iter().filter(|t| **t == "BotAdded").count(),
        5,
        "{stored_types:?}"
    );
    assert_eq!(
        calls.iter().find(|c| c.3 == 1).unwrap().4,
        2,
        "a:1 was a retry"
    );
    // Nothing is left: no delivery under either name, no event unpublished, no park.
    assert!(new.subscribers().await.unwrap().is_empty());
    let events = B::events(old.pool()).await;
    assert!(
        events
            .iter()
            .all(|e| e.published && !e.dead && e.parked == 0),
        "{events:?}"
    );
    assert!(new.status().await.unwrap().is_settled());
}

#[test]
fn the_catalog_resolves_former_names() {
    let catalog = NewBuild::catalog();
    assert_eq!(
        catalog.event("BotAdded").unwrap().event_type,
        "BotInstalled"
    );
    assert_eq!(catalog.subscriber("mailer").unwrap().name, "notifier");
    assert!(catalog.event("Mailer").is_none());
}
