//! The relay under trouble, on PostgreSQL and on SQLite: an aggregate that is stuck (behind a dead
//! event, a parked one, a waiting delivery or the claim of a crashed relay) never stops the other
//! aggregates, and a relay that stalls past its lease and then resumes cannot overwrite the work
//! of the relay that took over.

use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use outbox_core::store::{DeliveryOutcome, DeliveryRecord, EventOutcome, Outcomes, Recorded};
use outbox_core::telemetry;
use outbox_core::{
    ClaimToken, Delivery, Handle, HandlerError, Relay, RelayConfig, RetryPolicy, Router, Store,
    router, subscriber,
};
use outbox_sqlx::{Outbox, SqlStore};
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{Fail, OnlyX, Ping, PingPong, PingTock, Pong, Probe, Tock, run_until};
use outbox_tests::on_every_backend;
use tokio::sync::Notify;
use uuid::Uuid;

on_every_backend!(
    a_stuck_aggregate_does_not_stop_the_others_behind_a_dead_event,
    a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_an_unknown_type,
    a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_a_newer_version,
    a_stuck_aggregate_does_not_stop_the_others_behind_a_waiting_delivery,
    a_stuck_aggregate_does_not_stop_the_others_behind_the_claim_of_a_crashed_relay,
    a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_transient_failure,
    a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_permanent_failure,
    aggregates_of_two_types_with_one_id_do_not_block_each_other,
    a_redelivery_after_an_expired_claim_says_so,
    a_batch_that_outlasts_its_lease_keeps_its_claim_by_renewing_it,
    a_handler_fencing_its_writes_with_the_claim_token_writes_nothing_once_the_claim_is_lost,
    a_claim_that_frees_events_set_aside_behind_an_ended_claim_says_there_is_more,
    a_claim_that_frees_the_deliveries_of_an_expired_claim_says_there_is_more,
);

const BATCH: u32 = 10;
/// A claim of a batch, as the relay asks for it.
const CLAIM: outbox_core::store::ClaimLimit = outbox_core::store::ClaimLimit::events(BATCH);
/// Events published behind the stuck one: ten batches and a half.
const BEHIND: u32 = 10 * BATCH + 5;
/// How soon the other aggregates' events must be delivered, whatever is stuck.
const BOUND: Duration = Duration::from_secs(5);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_batch_size(BATCH)
        .with_poll_interval(ms(20))
        .with_lease(Duration::from_secs(10))
        .with_handler_timeout(Duration::from_secs(4))
        .with_park_delay(Duration::from_secs(3600))
        .with_max_error_backoff(ms(200))
        .with_retry(RetryPolicy::new([Duration::from_secs(3600)]).unwrap())
}

type TestOutbox<B> = Outbox<B, PingPong>;

fn relay<B: TestBackend, R: Router>(
    outbox: &TestOutbox<B>,
    router: R,
    config: RelayConfig,
) -> Relay<SqlStore<B>, R> {
    Relay::new(outbox.store(), router, config).expect("valid config")
}

async fn publish<B: TestBackend>(
    outbox: &TestOutbox<B>,
    aggregate: Uuid,
    seqs: std::ops::Range<u32>,
) {
    let mut tx = outbox.begin().await.unwrap();
    for seq in seqs {
        tx.publish(&Ping { aggregate, seq }).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// How the stuck aggregate shows in the status once the others flowed.
#[derive(Clone, Copy)]
enum Shows {
    /// Held back for every subscriber, with every later event set aside.
    BlockedAggregate,
    /// Held back for the one subscriber whose delivery waits.
    BlockedKey,
}

/// Publishes `BEHIND` events of `stuck` after whatever holds it, then five of a fresh aggregate,
/// runs `relay` in the background, and checks that the fresh aggregate's events arrive within
/// `BOUND` while none of `stuck`'s later events does, and that the status shows `stuck` as
/// blocked. Returns the fresh aggregate.
async fn others_flow<B: TestBackend, R: Router>(
    outbox: &TestOutbox<B>,
    relay: Relay<SqlStore<B>, R>,
    probe: &Probe,
    stuck: Uuid,
    first_behind: u32,
    shows: Shows,
) -> Uuid {
    publish(outbox, stuck, first_behind..first_behind + BEHIND).await;
    let free = Uuid::new_v4();
    publish(outbox, free, 0..5).await;
    let stop = Arc::new(Notify::new());
    let worker = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop.notified()).await }
    });
    let started = tokio::time::Instant::now();
    let expected: Vec<(Uuid, u32)> = (0..5).map(|seq| (free, seq)).collect();
    loop {
        let delivered: Vec<(Uuid, u32)> = probe
            .delivered_to("x")
            .into_iter()
            .filter(|d| d.0 == free)
            .collect();
        if delivered == expected {
            break;
        }
        assert!(
            started.elapsed() < BOUND,
            "{} of the free aggregate's 5 events delivered after {BOUND:?}; status {:?}",
            delivered.len(),
            outbox.status().await.unwrap()
        );
        tokio::time::sleep(ms(10)).await;
    }
    // The stuck aggregate's later events are all handled as far as they can be (set aside, or
    // waiting for x) soon after: events that only skipped behind a claim of the relay's own are
    // taken by its next batch.
    let settled = |status: &outbox_core::Status| match shows {
        Shows::BlockedAggregate => status.held_events == u64::from(BEHIND),
        Shows::BlockedKey => status.pending_events == 0,
    };
    let mut status = outbox.status().await.unwrap();
    while !settled(&status) {
        assert!(started.elapsed() < 2 * BOUND, "{status:?}");
        tokio::time::sleep(ms(10)).await;
        status = outbox.status().await.unwrap();
    }
    stop.notify_one();
    worker.await.unwrap();
    assert!(
        probe
            .delivered_to("x")
            .iter()
            .all(|d| d.0 != stuck || d.1 < first_behind),
        "an event of the stuck aggregate overtook the one that holds it"
    );
    let status = outbox.status().await.unwrap();
    match shows {
        Shows::BlockedAggregate => {
            assert_eq!(status.blocked_aggregates, 1, "{status:?}");
            assert_eq!(status.held_events, u64::from(BEHIND), "{status:?}");
        }
        Shows::BlockedKey => {
            assert_eq!(status.blocked_keys, 1, "{status:?}");
            assert_eq!(
                status.pending_deliveries,
                u64::from(BEHIND) + 1,
                "x's failed delivery and those waiting behind it: {status:?}"
            );
        }
    }
    free
}

/// `relay` claims x's delivery of (`aggregate`, `seq`) and dies in its handler: its claim stays
/// behind, as a crashed process's would. The event must be published already.
async fn dies_in_handler<S: Store, R: Router>(
    relay: Relay<S, R>,
    probe: &Probe,
    aggregate: Uuid,
    seq: u32,
) {
    let (entered, never) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    probe.fail(
        "x",
        aggregate,
        seq,
        [Fail::Block {
            entered: entered.clone(),
            release: never,
        }],
    );
    let task = tokio::spawn(async move { relay.run_once().await });
    entered.notified().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
}

async fn a_stuck_aggregate_does_not_stop_the_others_behind_a_dead_event<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let stuck = Uuid::new_v4();
    B::insert_raw(
        outbox.pool(),
        "Ping",
        stuck,
        r#"{"version":1,"data":{"seq":"zero"}}"#,
    )
    .await;
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    others_flow(&outbox, relay, &probe, stuck, 1, Shows::BlockedAggregate).await;
}

async fn a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_an_unknown_type<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let stuck = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: stuck,
        seq: 0,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // An older build: it does not know `Pong`, so it parks it.
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    others_flow(&outbox, relay, &probe, stuck, 1, Shows::BlockedAggregate).await;
}

async fn a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_a_newer_version<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let stuck = Uuid::new_v4();
    B::insert_raw(
        outbox.pool(),
        "Ping",
        stuck,
        &format!(r#"{{"version":2,"data":{{"aggregate":"{stuck}","seq":0,"colour":"red"}}}}"#),
    )
    .await;
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    others_flow(&outbox, relay, &probe, stuck, 1, Shows::BlockedAggregate).await;
}

async fn a_stuck_aggregate_does_not_stop_the_others_behind_a_waiting_delivery<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let stuck = Uuid::new_v4();
    // x fails on the first event; its retry is an hour away.
    probe.fail("x", stuck, 0, [Fail::Transient]);
    publish(&outbox, stuck, 0..1).await;
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    assert_eq!(relay.run_once().await.unwrap().retried, 1);
    others_flow(&outbox, relay, &probe, stuck, 1, Shows::BlockedKey).await;
}

async fn a_stuck_aggregate_does_not_stop_the_others_behind_the_claim_of_a_crashed_relay<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let stuck = Uuid::new_v4();
    publish(&outbox, stuck, 0..1).await;
    // The crashed relay: it claimed the event (its lease is long), then died in the handler.
    let long = config().with_lease(Duration::from_secs(120));
    dies_in_handler(relay(&outbox, OnlyX::new(&probe), long), &probe, stuck, 0).await;
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    others_flow(&outbox, relay, &probe, stuck, 1, Shows::BlockedAggregate).await;
}

/// Relay A calls x for e1 of an aggregate and freezes in the handler (its thread blocks: no
/// timeout, no renewal) past its lease; relay B takes over and delivers e1 and e2; then A is
/// released and x's call on e1 fails with `failure`. What A learned must not be recorded over B's
/// work: x's successful handlings are e1 then e2, with nothing after, and no dead letter.
async fn paused_past_lease<B: TestBackend>(failure: Fail) {
    let (db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let aggregate = Uuid::new_v4();
    let (freeze, entered, release) = Fail::freeze(Some(failure));
    probe.fail("x", aggregate, 1, [freeze]);
    publish(&outbox, aggregate, 1..3).await;
    let lease = Duration::from_secs(2);
    let config = config()
        .with_lease(lease)
        .with_handler_timeout(ms(900))
        .with_retry(RetryPolicy::new([ms(50); 3]).unwrap());

    // Relay A, on a thread and a runtime of its own, with a pool of its own: freezing its thread
    // freezes all of it, and nothing of B's.
    let relay_a = std::thread::spawn({
        let (probe, config, url) = (probe.clone(), config.clone(), B::url(&db));
        move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    // A's metrics, on its own thread.
                    let recorder = DebuggingRecorder::new();
                    let _recording = metrics::set_default_local_recorder(&recorder);
                    let outbox = Outbox::<B, PingPong>::new(B::connect(url).await);
                    let report = relay(&outbox, OnlyX::new(&probe), config).run_once().await;
                    let lost = recorder
                        .snapshotter()
                        .snapshot()
                        .into_vec()
                        .into_iter()
                        .find(|(key, ..)| key.key().name() == telemetry::CLAIMS_LOST_TOTAL)
                        .map(|(.., value)| value);
                    report.map(|report| (report.claimed, report.lost, lost))
                })
        }
    });
    tokio::task::spawn_blocking(move || entered.recv().unwrap())
        .await
        .unwrap();
    let frozen_at = tokio::time::Instant::now();

    // Relay B takes over once A's lease is over.
    let relay_b = relay(&outbox, OnlyX::new(&probe), config);
    let both = [(aggregate, 1), (aggregate, 2)];
    run_until(&relay_b, Duration::from_secs(20), || {
        probe.delivered_to("x") == both
    })
    .await;
    assert!(
        frozen_at.elapsed() >= lease - ms(200),
        "B took over within A's lease"
    );

    // A resumes: its handler fails; it must neither record that nor call x again.
    release.send(()).unwrap();
    let (claimed, lost, counted) = tokio::task::spawn_blocking(move || relay_a.join().unwrap())
        .await
        .unwrap()
        .expect("relay A's batch ends without a store error");
    assert_eq!(claimed, 2, "A had claimed both events");
    assert!(lost, "A's batch was lost");
    assert_eq!(
        counted,
        Some(DebugValue::Counter(1)),
        "A counted its lost claim in {}",
        telemetry::CLAIMS_LOST_TOTAL
    );
    // Long enough for any retry A might have scheduled (50 ms) to come due and be delivered.
    let settle = tokio::time::Instant::now() + ms(500);
    while tokio::time::Instant::now() < settle {
        relay_b.run_once().await.unwrap();
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(
        probe.delivered_to("x"),
        both,
        "x's successful handlings, in order; calls: {:?}",
        probe.calls_of("x")
    );
    assert!(
        !probe.calls_of("x").contains(&(aggregate, 2, 2)) && probe.calls_of("x").len() == 3,
        "A called x once (e1, frozen), B twice: {:?}",
        probe.calls_of("x")
    );
    let status = outbox.status().await.unwrap();
    assert_eq!(status.dead_letters, 0, "{status:?}");
    assert!(status.is_settled(), "{status:?}");
    assert!(
        outbox
            .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
            .await
            .unwrap()
            .is_empty()
    );
}

async fn publish_tock<B: TestBackend>(outbox: &Outbox<B, PingTock>, aggregate: Uuid, seq: u32) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Tock { aggregate, seq }).await.unwrap();
    tx.commit().await.unwrap();
}

async fn publish_ping<B: TestBackend>(outbox: &Outbox<B, PingTock>, aggregate: Uuid, seq: u32) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping { aggregate, seq }).await.unwrap();
    tx.commit().await.unwrap();
}

/// The seqs of the events of type `event_type` and aggregate id `aggregate` x handled.
fn handled(probe: &Probe, event_type: &str, aggregate: Uuid) -> Vec<u32> {
    probe
        .seen()
        .into_iter()
        .filter(|s| s.event_type == event_type && s.aggregate == aggregate && s.ok)
        .map(|s| s.seq)
        .collect()
}

/// A `probe` aggregate (`Ping`) and an `other` aggregate (`Tock`) share one id. The `probe` one
/// is stuck three ways in turn (behind a dead event, behind a failed delivery to x, behind a
/// live claim of another relay); each time the `other` one's event reaches x at once.
async fn aggregates_of_two_types_with_one_id_do_not_block_each_other<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingTock>().await;
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), PingTock::new(&probe), config()).unwrap();

    // Behind a dead event.
    let shared = Uuid::new_v4();
    B::insert_raw(outbox.pool(), "Ping", shared, r#"{"version":1}"#).await;
    publish_ping(&outbox, shared, 1).await;
    publish_tock(&outbox, shared, 1).await;
    run_until(&relay, BOUND, || handled(&probe, "Tock", shared) == [1]).await;
    // The Ping behind the dead event was given back by the batch that found the event dead; the
    // next claim sets it aside.
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.more), (0, true), "{report:?}");
    assert!(handled(&probe, "Ping", shared).is_empty());
    let status = outbox.status().await.unwrap();
    assert_eq!(
        (status.blocked_aggregates, status.held_events),
        (1, 1),
        "{status:?}"
    );

    // Behind a failed delivery to x.
    let shared = Uuid::new_v4();
    probe.fail("x", shared, 1, [Fail::Transient]);
    publish_ping(&outbox, shared, 1).await;
    run_until(&relay, BOUND, || {
        probe.calls_of("x").contains(&(shared, 1, 1))
    })
    .await;
    publish_tock(&outbox, shared, 1).await;
    run_until(&relay, BOUND, || handled(&probe, "Tock", shared) == [1]).await;
    let status = outbox.status().await.unwrap();
    assert_eq!(
        (status.pending_deliveries, status.blocked_keys),
        (1, 1),
        "only x's failed Ping waits: {status:?}"
    );

    // Behind another relay's live claim (it died in x's handler; its lease is long).
    let shared = Uuid::new_v4();
    publish_ping(&outbox, shared, 1).await;
    let long = config().with_lease(Duration::from_secs(120));
    let dead = Relay::new(outbox.store(), PingTock::new(&probe), long).unwrap();
    dies_in_handler(dead, &probe, shared, 1).await;
    publish_tock(&outbox, shared, 2).await;
    run_until(&relay, BOUND, || handled(&probe, "Tock", shared) == [2]).await;
}

/// A batch whose handlers take three times its lease keeps its claim: the relay renews it as
/// they run, and another relay claiming all along takes none of its events.
async fn a_batch_that_outlasts_its_lease_keeps_its_claim_by_renewing_it<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let aggregate = Uuid::new_v4();
    for seq in 1..=10 {
        probe.fail("x", aggregate, seq, [Fail::Delay(ms(300))]);
    }
    publish(&outbox, aggregate, 1..11).await;
    let config = config()
        .with_lease(Duration::from_secs(1))
        .with_handler_timeout(ms(400));
    let slow = relay(&outbox, OnlyX::new(&probe), config.clone());
    let started = tokio::time::Instant::now();
    let batch = tokio::spawn(async move { slow.run_once().await });
    // Once the slow relay is well into its batch (its first handler has run).
    while probe.seen().is_empty() {
        tokio::time::sleep(ms(10)).await;
    }
    let other = relay(&outbox, OnlyX::new(&probe), config);
    let mut claims = 0;
    while !batch.is_finished() {
        claims += 1;
        assert_eq!(
            other.run_once().await.unwrap().claimed,
            0,
            "the other relay took work of a claim being renewed"
        );
        tokio::time::sleep(ms(50)).await;
    }
    let report = batch.await.unwrap().unwrap();
    assert!(started.elapsed() >= Duration::from_secs(3));
    assert!(claims > 20, "the other relay claimed {claims} times");
    assert_eq!(
        (report.claimed, report.delivered, report.lost),
        (10, 10, false)
    );
    let seqs: Vec<u32> = probe.calls_of("x").into_iter().map(|c| c.1).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
}

/// A handler learns when an event may have been handled before: after the claim of a relay
/// that died expired (a redelivery of attempt 1), and after a failed attempt.
async fn a_redelivery_after_an_expired_claim_says_so<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let aggregate = Uuid::new_v4();
    probe.fail("x", aggregate, 2, [Fail::Transient]);
    publish(&outbox, aggregate, 1..2).await;
    let short = config()
        .with_lease(Duration::from_secs(1))
        .with_handler_timeout(ms(400))
        .with_retry(RetryPolicy::new([ms(50)]).unwrap());
    let crashed = relay(&outbox, OnlyX::new(&probe), short.clone());
    dies_in_handler(crashed, &probe, aggregate, 1).await;

    let relay = relay(&outbox, OnlyX::new(&probe), short);
    run_until(&relay, Duration::from_secs(20), || {
        probe.delivered_to("x") == [(aggregate, 1)]
    })
    .await;
    publish(&outbox, aggregate, 2..4).await;
    run_until(&relay, Duration::from_secs(20), || {
        probe.delivered_to("x").len() == 3
    })
    .await;
    let seen: Vec<(u32, u32, u32, bool)> = probe
        .seen()
        .into_iter()
        .filter(|s| s.subscriber == "x")
        .map(|s| (s.seq, s.attempt, s.expired_claims, s.redelivery))
        .collect();
    assert_eq!(
        seen,
        [
            // Redelivered after the dead relay's claim expired: attempt 1, but maybe handled.
            (1, 1, 1, true),
            // Failed once, then attempt 2.
            (2, 1, 0, false),
            (2, 2, 0, true),
            (3, 1, 0, false),
        ]
    );
    assert!(probe.seen().iter().all(|s| s.claim.is_some()));
}

/// Writes an effect row for each event, in a transaction that first locks the claim it runs
/// under (`Outbox::hold_claim`): the write happens only while the claim is live.
#[subscriber(events = [Ping], name = "x")]
struct Fenced(Arc<dyn Fn(i64, Option<ClaimToken>) -> EffectFuture + Send + Sync>);

type EffectFuture = std::pin::Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;

impl Handle<Ping> for Fenced {
    async fn handle(&self, _: &Ping, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        (self.0)(delivery.event().id, delivery.claim_token()).await
    }
}

#[router(events = [Ping])]
struct FencedApp {
    x: Fenced,
}

/// The fenced handler of relay `name` over `outbox`; it first runs `before` (a freeze).
fn fenced<B: TestBackend>(
    outbox: Outbox<B, FencedApp>,
    name: &'static str,
    before: Arc<dyn Fn() + Send + Sync>,
) -> FencedApp {
    FencedApp {
        x: Fenced(Arc::new(move |event_id, token| {
            before();
            let outbox = outbox.clone();
            Box::pin(async move {
                let token = token.expect("a relay's delivery runs under a claim");
                let mut tx = outbox.pool().begin().await?;
                if !outbox
                    .hold_claim(&mut *tx, token)
                    .await
                    .map_err(HandlerError::transient)?
                {
                    return Err(HandlerError::transient(
                        "the claim of this delivery was lost",
                    ));
                }
                B::insert_effect(&mut *tx, event_id, name).await?;
                tx.commit().await?;
                Ok(())
            })
        })),
    }
}

/// Relay A freezes in its handler (its thread blocked) before writing, past its lease; relay
/// B takes the event over and writes its effect. A resumes: its write is refused, because it
/// locks its claim first and finds it gone. One effect row, B's.
async fn a_handler_fencing_its_writes_with_the_claim_token_writes_nothing_once_the_claim_is_lost<
    B: TestBackend,
>() {
    let (db, outbox) = outbox::<B, FencedApp>().await;
    B::create_effects(outbox.pool()).await;
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let lease = Duration::from_secs(1);
    let config = config().with_lease(lease).with_handler_timeout(ms(400));

    let (entered_tx, entered) = std::sync::mpsc::sync_channel::<()>(1);
    let (release, released) = std::sync::mpsc::sync_channel::<()>(1);
    let released = std::sync::Mutex::new(Some(released));
    let freeze: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        if let Some(released) = released.lock().unwrap().take() {
            entered_tx.send(()).unwrap();
            released.recv().unwrap();
        }
    });
    let relay_a = std::thread::spawn({
        let (config, url) = (config.clone(), B::url(&db));
        move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let outbox = Outbox::<B, FencedApp>::new(B::connect(url).await);
                    let relay = outbox
                        .relay(fenced(outbox.clone(), "a", freeze), config)
                        .unwrap();
                    relay.run_once().await.map(|report| report.lost)
                })
        }
    });
    tokio::task::spawn_blocking(move || entered.recv().unwrap())
        .await
        .unwrap();
    let relay_b = outbox
        .relay(fenced(outbox.clone(), "b", Arc::new(|| {})), config)
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while B::effects(outbox.pool()).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "B wrote nothing");
        relay_b.run_once().await.unwrap();
        tokio::time::sleep(ms(20)).await;
    }
    release.send(()).unwrap();
    let lost = tokio::task::spawn_blocking(move || relay_a.join().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(lost, "A's batch was lost");
    let effects: Vec<String> = B::effects(outbox.pool())
        .await
        .into_iter()
        .map(|(_, relay)| relay)
        .collect();
    assert_eq!(effects, ["b"]);
}

async fn a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_transient_failure<
    B: TestBackend,
>() {
    paused_past_lease::<B>(Fail::Transient).await;
}

async fn a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_permanent_failure<
    B: TestBackend,
>() {
    paused_past_lease::<B>(Fail::Permanent).await;
}

/// The same scenarios over the test kit's memory store, whose clock the test moves.
mod memory {
    use std::time::Duration;

    use outbox_core::testing::{MemoryStore, drain};
    use outbox_core::{Relay, RetryPolicy, Store};
    use outbox_tests::kit::{Fail, OnlyX, Ping, PingTock, Pong, Probe, Tock};
    use uuid::Uuid;

    use super::{BEHIND, config, ms};

    fn publish(store: &MemoryStore, aggregate: Uuid, seqs: std::ops::Range<u32>) {
        for seq in seqs {
            store.publish(&Ping { aggregate, seq }).unwrap();
        }
    }

    /// Publishes what waits behind `stuck` and five events of a fresh aggregate, drains, and
    /// checks the fresh aggregate got through while `stuck` waits; returns the status.
    async fn others_flow(
        store: &MemoryStore,
        relay: &Relay<MemoryStore, OnlyX>,
        probe: &Probe,
        stuck: Uuid,
    ) -> outbox_core::Status {
        publish(store, stuck, 1..1 + BEHIND);
        let free = Uuid::new_v4();
        publish(store, free, 0..5);
        drain(relay).await.unwrap();
        let delivered = probe.delivered_to("x");
        assert_eq!(
            delivered.iter().filter(|d| d.0 == free).count(),
            5,
            "{delivered:?}"
        );
        assert!(delivered.iter().all(|d| d.0 != stuck || d.1 == 0));
        store.status().await.unwrap()
    }

    #[tokio::test]
    async fn a_stuck_aggregate_does_not_stop_the_others_behind_a_dead_event() {
        let (store, probe, stuck) = (MemoryStore::new(), Probe::default(), Uuid::new_v4());
        store.insert_raw(
            "Ping",
            "probe",
            stuck,
            r#"{"version":1,"data":{"seq":"zero"}}"#,
        );
        let relay = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        let status = others_flow(&store, &relay, &probe, stuck).await;
        assert_eq!(
            (
                status.dead_letters,
                status.blocked_aggregates,
                status.held_events
            ),
            (1, 1, u64::from(BEHIND))
        );
    }

    #[tokio::test]
    async fn a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_an_unknown_type() {
        let (store, probe, stuck) = (MemoryStore::new(), Probe::default(), Uuid::new_v4());
        store
            .publish(&Pong {
                aggregate: stuck,
                seq: 0,
            })
            .unwrap();
        let relay = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        let status = others_flow(&store, &relay, &probe, stuck).await;
        assert_eq!(
            (status.blocked_aggregates, status.held_events),
            (1, u64::from(BEHIND))
        );
    }

    #[tokio::test]
    async fn a_stuck_aggregate_does_not_stop_the_others_behind_a_waiting_delivery() {
        let (store, probe, stuck) = (MemoryStore::new(), Probe::default(), Uuid::new_v4());
        probe.fail("x", stuck, 0, [Fail::Transient]);
        publish(&store, stuck, 0..1);
        let relay = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        let status = others_flow(&store, &relay, &probe, stuck).await;
        assert_eq!(
            (status.blocked_keys, status.pending_deliveries),
            (1, u64::from(BEHIND) + 1)
        );
    }

    #[tokio::test]
    async fn a_stuck_aggregate_does_not_stop_the_others_behind_the_claim_of_a_crashed_relay() {
        let (store, probe, stuck) = (MemoryStore::new(), Probe::default(), Uuid::new_v4());
        publish(&store, stuck, 0..1);
        let crashed = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        super::dies_in_handler(crashed, &probe, stuck, 0).await;
        let relay = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        others_flow(&store, &relay, &probe, stuck).await;
        // Once the claim expires, the stuck aggregate flows, in order.
        store.clock().advance(Duration::from_secs(11));
        drain(&relay).await.unwrap();
        let stuck_seqs: Vec<u32> = probe
            .delivered_to("x")
            .into_iter()
            .filter(|d| d.0 == stuck)
            .map(|d| d.1)
            .collect();
        assert_eq!(stuck_seqs, (0..1 + BEHIND).collect::<Vec<_>>());
    }

    /// As `paused_past_lease` above: relay A freezes in x's handler of e1 past its lease (the
    /// store's clock is moved past it), relay B delivers e1 and e2, then A resumes and fails.
    async fn paused_past_lease(failure: Fail) {
        let (store, probe, aggregate) = (MemoryStore::new(), Probe::default(), Uuid::new_v4());
        let (freeze, entered, release) = Fail::freeze(Some(failure));
        probe.fail("x", aggregate, 1, [freeze]);
        publish(&store, aggregate, 1..3);
        let lease = ms(300);
        let config = config()
            .with_lease(lease)
            .with_handler_timeout(ms(100))
            .with_retry(RetryPolicy::new([ms(50); 3]).unwrap());
        let relay_a = std::thread::spawn({
            let (store, probe, config) = (store.clone(), probe.clone(), config.clone());
            move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(async move {
                        Relay::new(store, OnlyX::new(&probe), config)
                            .unwrap()
                            .run_once()
                            .await
                    })
            }
        });
        tokio::task::spawn_blocking(move || entered.recv().unwrap())
            .await
            .unwrap();
        // A's lease runs out, on both clocks.
        tokio::time::sleep(lease + ms(100)).await;
        store.clock().advance(lease + ms(100));
        let relay_b = Relay::new(store.clone(), OnlyX::new(&probe), config.clone()).unwrap();
        drain(&relay_b).await.unwrap();
        let both = [(aggregate, 1), (aggregate, 2)];
        assert_eq!(probe.delivered_to("x"), both);

        release.send(()).unwrap();
        let report = tokio::task::spawn_blocking(move || relay_a.join().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert!(report.lost, "A's batch was lost: {report:?}");
        store.clock().advance(Duration::from_secs(1));
        drain(&relay_b).await.unwrap();
        assert_eq!(probe.delivered_to("x"), both, "{:?}", probe.calls_of("x"));
        assert_eq!(probe.calls_of("x").len(), 3, "{:?}", probe.calls_of("x"));
        let status = store.status().await.unwrap();
        assert!(
            status.is_settled() && status.dead_letters == 0,
            "{status:?}"
        );
    }

    #[tokio::test]
    async fn a_redelivery_after_an_expired_claim_says_so() {
        let (store, probe, aggregate) = (MemoryStore::new(), Probe::default(), Uuid::new_v4());
        publish(&store, aggregate, 1..2);
        let crashed = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        super::dies_in_handler(crashed, &probe, aggregate, 1).await;
        store.clock().advance(Duration::from_secs(11));
        let relay = Relay::new(store.clone(), OnlyX::new(&probe), config()).unwrap();
        drain(&relay).await.unwrap();
        let seen: Vec<(u32, u32, bool)> = probe
            .seen()
            .into_iter()
            .map(|s| (s.attempt, s.expired_claims, s.redelivery))
            .collect();
        assert_eq!(seen, [(1, 1, true)]);
    }

    #[tokio::test]
    async fn aggregates_of_two_types_with_one_id_do_not_block_each_other() {
        let (store, probe) = (MemoryStore::new(), Probe::default());
        let relay = Relay::new(store.clone(), PingTock::new(&probe), config()).unwrap();
        // Behind a dead event.
        let shared = Uuid::new_v4();
        store.insert_raw("Ping", "probe", shared, r#"{"version":1}"#);
        publish(&store, shared, 1..2);
        store
            .publish(&Tock {
                aggregate: shared,
                seq: 1,
            })
            .unwrap();
        drain(&relay).await.unwrap();
        assert_eq!(super::handled(&probe, "Tock", shared), [1]);
        assert!(super::handled(&probe, "Ping", shared).is_empty());
        // Behind a failed delivery to x.
        let shared = Uuid::new_v4();
        probe.fail("x", shared, 1, [Fail::Transient]);
        publish(&store, shared, 1..2);
        store
            .publish(&Tock {
                aggregate: shared,
                seq: 2,
            })
            .unwrap();
        drain(&relay).await.unwrap();
        assert_eq!(super::handled(&probe, "Tock", shared), [2]);
        let status = store.status().await.unwrap();
        assert_eq!((status.pending_deliveries, status.blocked_keys), (1, 1));
    }

    #[tokio::test]
    async fn a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_transient_failure()
     {
        paused_past_lease(Fail::Transient).await;
    }

    #[tokio::test]
    async fn a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_permanent_failure()
     {
        paused_past_lease(Fail::Permanent).await;
    }
}

/// An event set aside behind a claim that lasted (a slow batch) is freed by the first claim
/// after that claim ends, and taken by the claim after it. The claim that frees it must say that
/// there is more: a relay that found nothing and heard "no more" waits for its poll interval
/// (seconds) before it looks again, though the event is ready now.
async fn a_claim_that_frees_events_set_aside_behind_an_ended_claim_says_there_is_more<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let store = outbox.store();
    let (lease, filter) = (Duration::from_secs(30), Default::default());
    let aggregate = Uuid::new_v4();
    publish(&outbox, aggregate, 1..2).await;
    let slow = store.claim(CLAIM, lease, &filter).await.unwrap();
    assert_eq!(slow.claims.len(), 1, "{slow:?}");
    // Older than a young claim (a second at most), whose aggregates' later events are only
    // skipped, not set aside.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    publish(&outbox, aggregate, 2..3).await;
    let behind = store.claim(CLAIM, lease, &filter).await.unwrap();
    assert!(behind.is_empty() && behind.more, "set aside: {behind:?}");

    let published = Outcomes {
        events: vec![(slow.claims[0].event_id(), EventOutcome::Published)],
        deliveries: Vec::new(),
    };
    let recorded = store.record(slow.token, &published).await.unwrap();
    assert_eq!(recorded, Recorded::Applied);
    let batch = claim_what_was_freed(&store).await;
    let ids: Vec<_> = batch
        .claims
        .iter()
        .map(outbox_core::store::Claim::event_id)
        .collect();
    assert!(
        ids.len() == 1 && ids[0] > slow.claims[0].event_id(),
        "the event set aside: {batch:?}"
    );
}

/// Claims until a batch is not empty, each empty one saying that there is more (at most two).
async fn claim_what_was_freed<S: Store>(store: &S) -> outbox_core::store::Batch {
    for claim in 1..=3 {
        let batch = store
            .claim(CLAIM, Duration::from_secs(30), &Default::default())
            .await
            .unwrap();
        if !batch.is_empty() {
            return batch;
        }
        assert!(
            batch.more && claim < 3,
            "claim {claim} after the claim ended found nothing, more: {}",
            batch.more
        );
    }
    unreachable!("the loop returns or fails")
}

/// The deliveries of a claim that expired are freed by the claim that ends it, and taken by
/// the claim after it: the claim that frees them says that there is more.
async fn a_claim_that_frees_the_deliveries_of_an_expired_claim_says_there_is_more<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let store = outbox.store();
    let (lease, filter) = (Duration::from_secs(30), Default::default());
    publish(&outbox, Uuid::new_v4(), 1..2).await;
    let first = store.claim(CLAIM, lease, &filter).await.unwrap();
    let event = first.claims[0].event().unwrap().clone();
    // Published, with x's delivery left to wait (due at once) as a row of its own.
    let outcomes = Outcomes {
        events: vec![(event.id, EventOutcome::Published)],
        deliveries: vec![DeliveryRecord {
            event_id: event.id,
            aggregate_type: event.aggregate_type.clone(),
            aggregate_id: event.aggregate_id,
            subscriber: "x".to_owned(),
            outcome: DeliveryOutcome::Waiting,
        }],
    };
    let recorded = store.record(first.token, &outcomes).await.unwrap();
    assert_eq!(recorded, Recorded::Applied);
    let lost = store.claim(CLAIM, lease, &filter).await.unwrap();
    assert_eq!(lost.claims.len(), 1, "x's delivery: {lost:?}");
    // The relay that claimed it died: its claim expired.
    B::expire_claims(outbox.pool()).await;

    let batch = claim_what_was_freed(&store).await;
    assert_eq!(batch.claims.len(), 1, "x's delivery again: {batch:?}");
    assert_eq!(batch.claims[0].event_id(), event.id, "{batch:?}");
}
