//! Handlers whose effects live in the outbox's database, run with `Outbox::handle_once`: the
//! effect, the inbox record of the delivery and any follow-up events commit together, so the
//! effect happens exactly once whatever fails, on PostgreSQL and on SQLite.

use outbox_core::store::ClaimLimit;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{
    DeliverFuture, Delivery, Handle, HandlerError, Metadata, OutboxEvent, Relay, RelayConfig,
    RetryPolicy, Store, event_uuid, router, subscriber,
};
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{Ping, WatchedStore, wait_for};
use outbox_tests::on_every_backend;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

on_every_backend!(
    a_transactional_subscriber_commits_its_effect_and_its_delivery_together,
    a_follow_up_event_published_in_a_handler_carries_causation_and_correlation,
    a_lost_claim_writes_nothing_and_says_so,
);

/// The follow-up event a transactional handler publishes for each `Ping` it handles.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "report", event_type = "Pinged")]
struct Pinged {
    #[outbox(aggregate_id)]
    aggregate: Uuid,
    seq: u32,
}

type Handler = Arc<dyn for<'a> Fn(&'a Ping, &'a Delivery<'a>) -> DeliverFuture<'a> + Send + Sync>;

/// Runs the handler the test body builds for its backend (a subscriber cannot be generic).
#[subscriber(events = [Ping], name = "ledger")]
struct Ledger {
    run: Handler,
}

impl Handle<Ping> for Ledger {
    async fn handle(&self, event: &Ping, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        (self.run)(event, delivery).await
    }
}

/// What the subscribers of the follow-up events saw: (aggregate, seq, metadata, event id).
type Reported = Arc<Mutex<Vec<(Uuid, u32, Metadata, i64)>>>;

#[subscriber(events = [Pinged], name = "reports")]
struct Reports {
    seen: Reported,
}

impl Handle<Pinged> for Reports {
    async fn handle(&self, event: &Pinged, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.seen.lock().unwrap().push((
            event.aggregate,
            event.seq,
            delivery.metadata().clone(),
            delivery.event().id,
        ));
        Ok(())
    }
}

#[router(events = [Ping, Pinged])]
struct Books {
    ledger: Ledger,
    reports: Reports,
}

fn handler(
    f: impl for<'a> Fn(&'a Ping, &'a Delivery<'a>) -> DeliverFuture<'a> + Send + Sync + 'static,
) -> Handler {
    Arc::new(f)
}

/// A fault injected into one delivery of a `Ping`, by its `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The handler's SQL ran; then it returns an error.
    ErrorAfterSql,
    /// The handler's SQL ran; then it panics.
    PanicAfterSql,
    /// The handler's SQL ran; then its connection is killed (PostgreSQL).
    KillAfterSql,
    /// The claim is lost (its lease ended: a stalled relay) before the handler's transaction.
    ClaimLost,
    /// The transaction committed; then the handler outlives its timeout, so the relay records
    /// a failure and delivers the event again.
    TimeoutAfterCommit,
}

/// Counts of what the handler did.
#[derive(Default)]
struct Counts {
    /// Calls of the subscriber's handler (deliveries, redeliveries included).
    calls: AtomicUsize,
    /// Runs of the transactional part (not for a delivery the inbox knew).
    runs: AtomicUsize,
}

const AGGREGATES: u32 = 4;
const PER_AGGREGATE: u32 = 10;

async fn a_transactional_subscriber_commits_its_effect_and_its_delivery_together<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, Books>().await;
    B::create_effects(outbox.pool()).await;
    // A second effect of an event would fail loudly (and its delivery for ever).
    B::make_effects_unique(outbox.pool()).await;

    let mut faults: HashMap<u32, Fault> = HashMap::from([
        (1, Fault::ErrorAfterSql),
        (2, Fault::PanicAfterSql),
        (4, Fault::ClaimLost),
        (5, Fault::TimeoutAfterCommit),
    ]);
    if B::CAN_KILL_CONNECTIONS {
        faults.insert(3, Fault::KillAfterSql);
    }
    let injected: Arc<Mutex<HashSet<(Uuid, u32)>>> = Arc::default();
    let counts = Arc::new(Counts::default());
    let run = {
        let (outbox, injected, counts) = (outbox.clone(), injected.clone(), counts.clone());
        let faults = faults.clone();
        handler(move |ping, delivery| {
            let (outbox, injected, counts) = (outbox.clone(), injected.clone(), counts.clone());
            let ping = ping.clone();
            // Each fault strikes the first delivery of its seq that reaches the point where it
            // acts, on every aggregate: a delivery that fails before (its claim lost to another
            // aggregate's fault, say) leaves it for the next one.
            let planned = faults.get(&ping.seq).copied();
            let strikes = {
                let injected = injected.clone();
                move |fault: Fault| {
                    planned == Some(fault)
                        && injected.lock().unwrap().insert((ping.aggregate, ping.seq))
                }
            };
            Box::pin(async move {
                counts.calls.fetch_add(1, Ordering::SeqCst);
                if strikes(Fault::ClaimLost) {
                    B::expire_claims(outbox.pool()).await;
                }
                let strikes = &strikes;
                outbox
                    .handle_once(delivery, |mut tx| async move {
                        counts.runs.fetch_add(1, Ordering::SeqCst);
                        B::insert_effect(&mut tx, delivery.event().id, "ledger").await?;
                        tx.publish(&Pinged {
                            aggregate: ping.aggregate,
                            seq: ping.seq,
                        })
                        .await?;
                        if strikes(Fault::ErrorAfterSql) {
                            return Err(HandlerError::transient("injected after the SQL"));
                        }
                        if strikes(Fault::PanicAfterSql) {
                            panic!("injected after the SQL");
                        }
                        if strikes(Fault::KillAfterSql) {
                            B::kill_own_connection(&mut tx).await?;
                            unreachable!("the killed session answered");
                        }
                        Ok(tx)
                    })
                    .await?;
                if strikes(Fault::TimeoutAfterCommit) {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                Ok(())
            })
        })
    };
    let seen: Reported = Arc::default();
    // The first ten records are lost (a record is tried five times before the relay gives up
    // on it: two batches' records).
    let store = WatchedStore::new(outbox.store()).losing_records(10);
    let lost_records = store.lost_records.clone();
    let config = RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_batch_size(8)
        .with_lease(Duration::from_millis(1200))
        .with_handler_timeout(Duration::from_millis(400))
        .with_retry(RetryPolicy::new([Duration::from_millis(20); 20]).unwrap());
    let relay = Relay::new(
        store,
        Books {
            ledger: Ledger { run },
            reports: Reports { seen: seen.clone() },
        },
        config,
    )
    .unwrap();

    let aggregates: Vec<Uuid> = (0..AGGREGATES).map(|_| Uuid::new_v4()).collect();
    for seq in 0..PER_AGGREGATE {
        for &aggregate in &aggregates {
            let mut tx = outbox.begin().await.unwrap();
            tx.publish(&Ping { aggregate, seq }).await.unwrap();
            tx.commit().await.unwrap();
        }
    }
    let events = (AGGREGATES * PER_AGGREGATE) as usize;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                stopped.await.ok();
            })
            .await;
    });
    let reported = |seen: &Reported| {
        seen.lock()
            .unwrap()
            .iter()
            .map(|(a, s, _, _)| (*a, *s))
            .collect::<HashSet<_>>()
            .len()
    };
    wait_for(|| reported(&seen) == events).await;
    // Every Ping published, so nothing is left to redeliver.
    let status_settled = async {
        loop {
            let status = outbox.status().await.unwrap();
            if status.pending_events == 0 && status.pending_deliveries == 0 {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let status = tokio::time::timeout(Duration::from_secs(20), status_settled)
        .await
        .expect("everything delivered");
    stop.send(()).unwrap();
    running.await.unwrap();
    assert_eq!(status.dead_letters, 0);

    // Exactly one effect per event: the unique index would have failed any second one.
    let effects = B::effects(outbox.pool()).await;
    let pings: HashSet<i64> = effects.iter().map(|(id, _)| *id).collect();
    assert_eq!(effects.len(), events, "{effects:?}");
    assert_eq!(pings.len(), events);

    // The faults struck, and were redelivered: each fault's delivery and each lost record's
    // batch came again; the deliveries whose transaction had committed (a lost record, a
    // timeout after the commit) were recognised by the inbox and not run again.
    let calls = counts.calls.load(Ordering::SeqCst);
    let runs = counts.runs.load(Ordering::SeqCst);
    let faulted = injected.lock().unwrap().len();
    assert_eq!(faulted, faults.len() * AGGREGATES as usize);
    assert_eq!(lost_records.load(Ordering::SeqCst), 10);
    assert!(
        calls > runs,
        "some redeliveries were duplicates: {calls} calls, {runs} runs"
    );
    // The transactional part ran at least once per event, and again after each rolled-back
    // fault (the claim-lost fault never reaches it).
    let rolled_back = faults
        .values()
        .filter(|f| !matches!(f, Fault::ClaimLost | Fault::TimeoutAfterCommit))
        .count()
        * AGGREGATES as usize;
    assert!(runs >= events + rolled_back, "{runs} runs");
    println!(
        "{} events: {calls} handler calls, {runs} transactional runs, {} duplicates skipped",
        events,
        calls - runs
    );

    // Each Ping's follow-up was published once, with it.
    let follow_ups = B::events(outbox.pool())
        .await
        .into_iter()
        .filter(|e| e.event_type == "Pinged")
        .count();
    assert_eq!(follow_ups, events);
}

async fn a_follow_up_event_published_in_a_handler_carries_causation_and_correlation<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, Books>().await;
    B::create_effects(outbox.pool()).await;
    let run = {
        let outbox = outbox.clone();
        handler(move |ping, delivery| {
            let outbox = outbox.clone();
            let ping = ping.clone();
            Box::pin(async move {
                outbox
                    .handle_once(delivery, |mut tx| async move {
                        B::insert_effect(&mut tx, delivery.event().id, "ledger").await?;
                        tx.publish(&Pinged {
                            aggregate: ping.aggregate,
                            seq: ping.seq,
                        })
                        .await?;
                        Ok(tx)
                    })
                    .await
            })
        })
    };
    let seen: Reported = Arc::default();
    let relay = Relay::new(
        outbox.store(),
        Books {
            ledger: Ledger { run },
            reports: Reports { seen: seen.clone() },
        },
        RelayConfig::default().with_poll_interval(Duration::from_millis(20)),
    )
    .unwrap();

    // Two flows: one with a correlation id, one without (its first event starts the flow).
    let (with_flow, without_flow) = (Uuid::new_v4(), Uuid::new_v4());
    let flow = Uuid::new_v4();
    let mut ping_ids = HashMap::new();
    for seq in 0..5 {
        for (aggregate, metadata) in [
            (with_flow, Metadata::new().with_correlation_id(flow)),
            (without_flow, Metadata::new()),
        ] {
            let mut tx = outbox.begin().await.unwrap();
            tx.publish_with(&Ping { aggregate, seq }, &metadata)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            let id = B::events(outbox.pool()).await.last().unwrap().id;
            ping_ids.insert((aggregate, seq), id);
        }
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                stopped.await.ok();
            })
            .await;
    });
    wait_for(|| seen.lock().unwrap().len() == 10).await;
    stop.send(()).unwrap();
    running.await.unwrap();

    let seen = seen.lock().unwrap().clone();
    for aggregate in [with_flow, without_flow] {
        // Delivered to its own subscriber, in the order of the events that caused them.
        let seqs: Vec<u32> = seen
            .iter()
            .filter(|(a, ..)| *a == aggregate)
            .map(|(_, s, ..)| *s)
            .collect();
        assert_eq!(seqs, vec![0, 1, 2, 3, 4]);
    }
    for (aggregate, seq, metadata, _) in &seen {
        let cause = event_uuid(ping_ids[&(*aggregate, *seq)]);
        assert_eq!(metadata.causation_id(), Some(cause), "caused by its Ping");
        let expected_flow = if *aggregate == with_flow { flow } else { cause };
        assert_eq!(metadata.correlation_id(), Some(expected_flow));
    }
    // Each follow-up committed with its Ping's effect: one of each.
    assert_eq!(B::effects(outbox.pool()).await.len(), 10);
}

async fn a_lost_claim_writes_nothing_and_says_so<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, Books>().await;
    B::create_effects(outbox.pool()).await;
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: Uuid::new_v4(),
        seq: 0,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let batch = outbox
        .store()
        .claim(
            ClaimLimit::events(10),
            Duration::from_secs(30),
            &Default::default(),
        )
        .await
        .unwrap();
    let event = batch.claims[0].event().unwrap().clone();
    // The relay stalled past its lease: the claim is over before the handler's transaction.
    B::expire_claims(outbox.pool()).await;
    let metadata = Metadata::new();
    let delivery = Delivery::new(&event, &metadata, "ledger", 1).with_claim(batch.token, 0);
    let error = outbox
        .handle_once(&delivery, |mut tx| async move {
            B::insert_effect(&mut tx, event.id, "ledger").await?;
            Ok(tx)
        })
        .await
        .unwrap_err();
    assert!(error.is_transient());
    assert_eq!(
        error.error().to_string(),
        "the claim of this delivery was lost (its lease expired and another relay may deliver \
         it): nothing was written"
    );
    assert!(B::effects(outbox.pool()).await.is_empty());
    assert_eq!(B::inbox_count(outbox.pool()).await, 0);
}
