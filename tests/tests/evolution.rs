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
use outbox_tests::kit::{WatchedStore, run_until};

use outbox_tests::on_every_backend;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

on_every_backend!(
    a_renamed_event_type_and_subscriber_keep_their_stored_work,
    relays_of_two_builds_leave_each_other_what_only_the_other_routes,
    a_relay_run_from_two_tasks_stays_registered_while_one_of_them_runs,
);

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

/// A new event type of the newer build.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", event_type = "BotRetired")]
struct BotRetired {
    #[outbox(aggregate_id)]
    bot: Uuid,
    seq: u32,
}

/// Records every call, whatever the event: (its name, stored type, aggregate, seq).
macro_rules! recording_subscriber {
    ($name:ident, $($attr:tt)*) => {
        #[subscriber($($attr)*)]
        struct $name(Calls);

        impl<E: OutboxEvent + Seq> Handle<E> for $name {
            async fn handle(&self, event: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
                self.0.lock().unwrap().push((
                    delivery.subscriber().to_owned(),
                    delivery.event().event_type.clone(),
                    event.aggregate_id(),
                    event.seq(),
                    delivery.attempt(),
                    true,
                ));
                Ok(())
            }
        }
    };
}

trait Seq {
    fn seq(&self) -> u32;
}

impl Seq for BotAdded {
    fn seq(&self) -> u32 {
        self.seq
    }
}

impl Seq for BotInstalled {
    fn seq(&self) -> u32 {
        self.seq
    }
}

impl Seq for BotRetired {
    fn seq(&self) -> u32 {
        self.seq
    }
}

recording_subscriber!(OldMailer, events = [BotAdded], name = "mailer");

#[router(events = [BotAdded])]
struct OldRelease {
    mailer: OldMailer,
}

recording_subscriber!(
    NewNotifier,
    events = [BotInstalled, BotRetired],
    name = "notifier",
    formerly = ["mailer"]
);
recording_subscriber!(Auditor, events = [BotInstalled], name = "auditor");

#[router(events = [BotInstalled, BotRetired])]
struct NewRelease {
    notifier: NewNotifier,
    auditor: Auditor,
}

/// The old and the new release on one database, each with a relay (not running yet).
struct Releases<B: TestBackend> {
    _db: B::Guard,
    old: Outbox<B, OldRelease>,
    new: Outbox<B, NewRelease>,
    old_calls: Calls,
    new_calls: Calls,
    old_relay: Relay<outbox_sqlx::SqlStore<B>, OldRelease>,
    new_relay: Relay<outbox_sqlx::SqlStore<B>, NewRelease>,
}

async fn releases<B: TestBackend>() -> Releases<B> {
    let (_db, old) = outbox::<B, OldRelease>().await;
    let new = Outbox::<B, NewRelease>::new(old.pool().clone());
    let (old_calls, new_calls) = (Calls::default(), Calls::default());
    let old_relay = Relay::new(
        old.store(),
        OldRelease {
            mailer: OldMailer(old_calls.clone()),
        },
        config(Duration::from_secs(3600)),
    )
    .unwrap();
    let new_relay = Relay::new(
        new.store(),
        NewRelease {
            notifier: NewNotifier(new_calls.clone()),
            auditor: Auditor(new_calls.clone()),
        },
        config(Duration::from_secs(3600)),
    )
    .unwrap();
    Releases {
        _db,
        old,
        new,
        old_calls,
        new_calls,
        old_relay,
        new_relay,
    }
}

async fn relays_of_two_builds_leave_each_other_what_only_the_other_routes<B: TestBackend>() {
    let Releases {
        _db,
        old,
        new,
        old_calls,
        new_calls,
        old_relay,
        new_relay,
    } = releases::<B>().await;
    // Both at work: each registered what its build routes, and the old one has seen the new
    // one register (its next claim saw the registry change). (A claim made before it saw that
    // would give back what only the new build routes, unparked: see `plan.rs`.)
    old_relay.run_once().await.unwrap();
    new_relay.run_once().await.unwrap();
    old_relay.run_once().await.unwrap();
    assert_eq!(old.status().await.unwrap().live_relays, 2);

    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut tx = new.begin().await.unwrap();
    tx.publish(&BotRetired { bot: a, seq: 1 }).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = old.begin().await.unwrap();
    tx.publish(&BotAdded { bot: a, seq: 2 }).await.unwrap();
    tx.publish(&BotAdded { bot: b, seq: 1 }).await.unwrap();
    tx.commit().await.unwrap();

    // The old build leaves `BotRetired` (and a's later event) to the new build, without
    // parking it, and fans b's event out to the new build's `auditor` too (a delivery that
    // waits for it), delivering it to `mailer` itself.
    let report = old_relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.parked), (1, 0), "{report:?}");
    let seen: Vec<(String, Uuid, u32)> = old_calls
        .lock()
        .unwrap()
        .iter()
        .map(|c| (c.0.clone(), c.2, c.3))
        .collect();
    assert_eq!(seen, [("mailer".to_owned(), b, 1)]);
    let waiting: Vec<(String, u64)> = old
        .subscribers()
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.subscriber, s.pending))
        .collect();
    assert_eq!(waiting, [("auditor".to_owned(), 1)]);

    // The new build delivers the rest, in order per aggregate.
    let of = |subscriber: &str, bot: Uuid| {
        new_calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.0 == subscriber && c.2 == bot)
            .map(|c| c.3)
            .collect::<Vec<_>>()
    };
    run_until(&new_relay, Duration::from_secs(20), || {
        of("notifier", a).len() == 2 && of("auditor", a).len() == 1 && of("auditor", b).len() == 1
    })
    .await;
    assert_eq!(of("notifier", a), [1, 2]);
    assert_eq!(
        of("notifier", b),
        [0u32; 0],
        "b reached `mailer`, the same subscriber"
    );
    let events = B::events(old.pool()).await;
    assert!(
        events.iter().all(|e| e.published && e.parked == 0),
        "{events:?}"
    );

    // What no live relay routes is shown, with its age.
    let status = new.status().await.unwrap();
    assert_eq!(
        (status.unroutable_events, status.unroutable_deliveries),
        (0, 0)
    );
    B::insert_raw(old.pool(), "BotExploded", a, "{}").await;
    let status = new.status().await.unwrap();
    assert_eq!(status.unroutable_events, 1);
    assert!(status.oldest_unroutable_age.is_some());
}

/// The live relays the store counts, once it counts `n` (within 2 s: a relay renews its
/// registration every 10 s, so nothing here waits for a renewal).
async fn wait_for_live_relays<B: TestBackend, R: Router>(outbox: &Outbox<B, R>, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let live = outbox.status().await.unwrap().live_relays;
        if live == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{live} live relays, not {n}, after 2 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A relay whose `run` is started from several tasks (workers sharing one relay) stays
/// registered until the last of them stops: another build's relay reads the registry to know
/// which subscribers it lacks, and fans an event out without them once a build is gone, so a
/// build that looked gone while it still ran would miss those events.
async fn a_relay_run_from_two_tasks_stays_registered_while_one_of_them_runs<B: TestBackend>() {
    let Releases {
        _db,
        old,
        new,
        new_calls,
        old_relay,
        ..
    } = releases::<B>().await;
    // (Its claims can be held back, so that the old build claims the event below.)
    let store = WatchedStore::new(new.store());
    let pause = store.claims_pause();
    let new_relay = Arc::new(
        Relay::new(
            store,
            NewRelease {
                notifier: NewNotifier(new_calls.clone()),
                auditor: Auditor(new_calls.clone()),
            },
            config(Duration::from_secs(3600)),
        )
        .unwrap(),
    );
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (relay, stop) = (Arc::clone(&new_relay), Arc::new(tokio::sync::Notify::new()));
            let worker = tokio::spawn({
                let stop = Arc::clone(&stop);
                async move { relay.run(stop.notified()).await }
            });
            (stop, worker)
        })
        .collect();
    old_relay.run_once().await.unwrap();
    wait_for_live_relays(&old, 2).await;

    // One of the new build's workers stops; the other works on.
    let (stop, worker) = &workers[0];
    stop.notify_one();
    while !worker.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        old.status().await.unwrap().live_relays,
        2,
        "the new build is still at work"
    );

    // So the old build, claiming an event (the new build's claims held back meanwhile), still
    // fans it out to the new build's `auditor` too, which the worker left delivers.
    let paused = pause.lock().await;
    let b = Uuid::new_v4();
    let mut tx = old.begin().await.unwrap();
    tx.publish(&BotAdded { bot: b, seq: 1 }).await.unwrap();
    tx.commit().await.unwrap();
    let report = old_relay.run_once().await.unwrap();
    drop(paused);
    assert_eq!(report.claimed, 1, "{report:?}");
    let audited = || {
        new_calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.0 == "auditor" && c.2 == b)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !audited() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "b's event never reached `auditor`"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (stop, worker) = &workers[1];
    stop.notify_one();
    while !worker.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
