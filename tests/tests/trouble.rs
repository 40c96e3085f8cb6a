//! The relay under trouble, on PostgreSQL and on SQLite: an aggregate that is stuck (behind a dead
//! event, a parked one, a waiting delivery or the claim of a crashed relay) never stops the other
//! aggregates, and a relay that stalls past its lease and then resumes cannot overwrite the work
//! of the relay that took over.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Relay, RelayConfig, RetryPolicy, Router};
use outbox_sqlx::{Outbox, SqlStore};
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{Fail, OnlyX, Ping, PingPong, Pong, Probe, run_until};
use outbox_tests::on_both_backends;
use tokio::sync::Notify;
use uuid::Uuid;

on_both_backends!(
    a_stuck_aggregate_does_not_stop_the_others_behind_a_dead_event,
    a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_an_unknown_type,
    a_stuck_aggregate_does_not_stop_the_others_behind_an_event_of_a_newer_version,
    a_stuck_aggregate_does_not_stop_the_others_behind_a_waiting_delivery,
    a_stuck_aggregate_does_not_stop_the_others_behind_the_claim_of_a_crashed_relay,
    a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_transient_failure,
    a_relay_paused_past_its_lease_cannot_overwrite_the_next_owner_after_a_permanent_failure,
);

const BATCH: u32 = 10;
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

/// Publishes `BEHIND` events of `stuck` after whatever holds it, then five of a fresh aggregate,
/// runs `relay` in the background, and checks that the fresh aggregate's events arrive within
/// `BOUND` while none of `stuck`'s later events does. Returns the fresh aggregate.
async fn others_flow<B: TestBackend, R: Router>(
    outbox: &TestOutbox<B>,
    relay: Relay<SqlStore<B>, R>,
    probe: &Probe,
    stuck: Uuid,
    first_behind: u32,
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
    stop.notify_one();
    worker.await.unwrap();
    assert!(
        probe
            .delivered_to("x")
            .iter()
            .all(|d| d.0 != stuck || d.1 < first_behind),
        "an event of the stuck aggregate overtook the one that holds it"
    );
    free
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
    others_flow(&outbox, relay, &probe, stuck, 1).await;
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
    others_flow(&outbox, relay, &probe, stuck, 1).await;
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
    others_flow(&outbox, relay, &probe, stuck, 1).await;
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
    others_flow(&outbox, relay, &probe, stuck, 1).await;
}

async fn a_stuck_aggregate_does_not_stop_the_others_behind_the_claim_of_a_crashed_relay<
    B: TestBackend,
>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let stuck = Uuid::new_v4();
    let (entered, never) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    probe.fail(
        "x",
        stuck,
        0,
        [Fail::Block {
            entered: entered.clone(),
            release: never,
        }],
    );
    publish(&outbox, stuck, 0..1).await;
    // The crashed relay: it claimed the event (its lease is long), then died in the handler.
    let crashed = relay(
        &outbox,
        OnlyX::new(&probe),
        config().with_lease(Duration::from_secs(120)),
    );
    let task = tokio::spawn(async move { crashed.run_once().await });
    entered.notified().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    others_flow(&outbox, relay, &probe, stuck, 1).await;
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
                    let outbox = Outbox::<B, PingPong>::new(B::connect(url).await);
                    relay(&outbox, OnlyX::new(&probe), config)
                        .run_once()
                        .await
                        .map(|report| report.claimed)
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
    let claimed = tokio::task::spawn_blocking(move || relay_a.join().unwrap())
        .await
        .unwrap()
        .expect("relay A's batch ends without a store error");
    assert_eq!(claimed, 2, "A had claimed both events");
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
    assert!(outbox.dead_letters().await.unwrap().is_empty());
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
