//! The relay over PostgreSQL: at-least-once delivery per subscriber, retries, dead letters,
//! parking, ordering per (subscriber, aggregate), claims that expire, and a relay that survives
//! its connections dying.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::Requeue;
use outbox_core::{Relay, RelayConfig, RetryPolicy, Router};
use outbox_sqlx::{Outbox, SqlStore};
use outbox_tests::kit::{Fail, OnlyX, Ping, PingPong, Pong, Probe, WatchedStore, XAndY, run_until};
use outbox_tests::pg::TestDb;
use sqlx::{PgPool, Postgres, Row};
use tokio::sync::Notify;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Fast settings: the retry schedule in milliseconds.
fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(ms(20))
        .with_lease(Duration::from_secs(10))
        .with_handler_timeout(Duration::from_secs(5))
        .with_park_delay(ms(200))
        .with_max_error_backoff(ms(200))
        .with_retry(RetryPolicy::new([ms(50), ms(50)]).unwrap())
}

/// The outbox publishes `Ping` and `Pong`; relays may route fewer (an older build).
type TestOutbox = Outbox<Postgres, PingPong>;

async fn setup() -> (TestDb, TestOutbox) {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate");
    (db, outbox)
}

fn relay<R: Router>(
    outbox: &TestOutbox,
    router: R,
    config: RelayConfig,
) -> Relay<SqlStore<Postgres>, R> {
    Relay::new(outbox.store(), router, config).expect("valid config")
}

async fn publish(outbox: &TestOutbox, events: &[Ping]) {
    let mut tx = outbox.begin().await.unwrap();
    for event in events {
        tx.publish(event).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn publish_one(outbox: &TestOutbox, aggregate: Uuid, seq: u32) -> i64 {
    publish(outbox, &[Ping { aggregate, seq }]).await;
    sqlx::query_scalar("SELECT max(id) FROM events.outbox")
        .fetch_one(outbox.pool())
        .await
        .unwrap()
}

/// (attempts, last_error, dead, seconds until next_retry_at) of a delivery.
async fn delivery(
    pool: &PgPool,
    subscriber: &str,
    event_id: i64,
) -> Option<(i32, Option<String>, bool, f64)> {
    sqlx::query(
        "SELECT attempts, last_error, dead_at IS NOT NULL AS dead,
                extract(epoch FROM next_retry_at - now())::float8 AS due_in
         FROM events.outbox_deliveries WHERE subscriber = $1 AND event_id = $2",
    )
    .bind(subscriber)
    .bind(event_id)
    .fetch_optional(pool)
    .await
    .unwrap()
    .map(|r| {
        (
            r.get("attempts"),
            r.get("last_error"),
            r.get("dead"),
            r.get("due_in"),
        )
    })
}

/// (published, dead, retry_count, last_error) of an event.
async fn event_state(pool: &PgPool, id: i64) -> (bool, bool, i32, Option<String>) {
    let r = sqlx::query(
        "SELECT published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead, retry_count,
                last_error
         FROM events.outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    (
        r.get("published"),
        r.get("dead"),
        r.get("retry_count"),
        r.get("last_error"),
    )
}

async fn insert_raw(pool: &PgPool, event_type: &str, aggregate: Uuid, payload: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('probe', $1, $2, $3::jsonb) RETURNING id",
    )
    .bind(aggregate)
    .bind(event_type)
    .bind(payload)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn committed_events_reach_each_routed_subscriber_exactly_once() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let router = PingPong::new(&probe);
    let relay = relay(&outbox, router, config());
    sqlx::query("CREATE TABLE probes (id UUID PRIMARY KEY, pings INT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let a = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    sqlx::query("INSERT INTO probes VALUES ($1, 2)")
        .bind(a)
        .execute(&mut *tx)
        .await
        .unwrap();
    let pings = [
        Ping {
            aggregate: a,
            seq: 1,
        },
        Ping {
            aggregate: a,
            seq: 2,
        },
    ];
    tx.publish_all(&pings).await.unwrap();
    tx.commit().await.unwrap();
    let pings: i32 = sqlx::query_scalar("SELECT pings FROM probes WHERE id = $1")
        .bind(a)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(pings, 2, "the domain change committed with its events");
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: a,
        seq: 3,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();

    run_until(&relay, WAIT, || probe.seen().len() == 5).await;
    // Running more batches delivers nothing again.
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    }
    assert_eq!(probe.delivered_to("x"), [(a, 1), (a, 2), (a, 3)]);
    assert_eq!(probe.delivered_to("y"), [(a, 1), (a, 2)]);
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(pending, 0);
    let deliveries: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox_deliveries")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(deliveries, 0);
}

#[tokio::test]
async fn transient_failure_records_attempts_error_and_next_retry_then_delivers_after_the_delay() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Transient]);
    let config = config().with_retry(RetryPolicy::new([ms(800)]).unwrap());
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    let id = publish_one(&outbox, a, 1).await;

    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.retried), (1, 1));
    let (attempts, error, dead, due_in) = delivery(&db.pool, "x", id).await.unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(
        error.as_deref(),
        Some("transient error: scripted transient failure")
    );
    assert!(!dead);
    assert!(due_in > 0.0 && due_in <= 0.8, "next retry in {due_in}s");
    // The event itself is handed out; only x's delivery waits.
    assert!(event_state(&db.pool, id).await.0);

    // Not due yet: nothing is claimed.
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    assert_eq!(probe.calls_of("x"), [(a, 1, 1)]);

    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 1).await;
    assert_eq!(probe.calls_of("x"), [(a, 1, 1), (a, 1, 2)]);
    assert_eq!(delivery(&db.pool, "x", id).await, None);
}

#[tokio::test]
async fn exhausted_retries_make_a_dead_letter_that_is_never_claimed_or_purged_while_others_flow() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail(
        "x",
        a,
        1,
        [Fail::Transient, Fail::Transient, Fail::Transient],
    );
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let dead_id = publish_one(&outbox, a, 1).await;

    // Two retries of 50 ms, then the third failure is final.
    run_until(&relay, WAIT, || probe.calls_of("x").len() == 3).await;
    let (attempts, error, dead, _) = delivery(&db.pool, "x", dead_id).await.unwrap();
    assert_eq!((attempts, dead), (3, true));
    assert_eq!(
        error.as_deref(),
        Some("transient error: scripted transient failure")
    );

    // Events of another aggregate keep flowing past it.
    publish(
        &outbox,
        &[
            Ping {
                aggregate: b,
                seq: 1,
            },
            Ping {
                aggregate: b,
                seq: 2,
            },
        ],
    )
    .await;
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2)]);

    // The dead letter is never claimed again.
    tokio::time::sleep(ms(120)).await; // longer than any retry delay of this policy
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    }
    assert_eq!(probe.calls_of("x").iter().filter(|c| c.0 == a).count(), 3);

    // Retention removes the published events of b, not the dead letter's event.
    let purged = outbox.purge_published(Duration::ZERO, 1).await.unwrap();
    assert_eq!(purged, 2);
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM events.outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, [dead_id]);
    assert!(delivery(&db.pool, "x", dead_id).await.unwrap().2);
}

#[tokio::test]
async fn a_permanent_error_is_a_dead_letter_at_once_with_its_reason() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Permanent]);
    let relay = relay(&outbox, XAndY::new(&probe), config());
    let id = publish_one(&outbox, a, 1).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.delivered, report.dead), (1, 1));
    let (attempts, error, dead, _) = delivery(&db.pool, "x", id).await.unwrap();
    assert_eq!((attempts, dead), (1, true));
    assert_eq!(
        error.as_deref(),
        Some("permanent error: scripted permanent failure")
    );
    assert_eq!(probe.delivered_to("y"), [(a, 1)]);
}

#[tokio::test]
async fn a_panicking_handler_is_a_transient_failure_not_a_crash() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Panic]);
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let id = publish_one(&outbox, a, 1).await;
    assert_eq!(relay.run_once().await.unwrap().retried, 1);
    let (attempts, error, _, _) = delivery(&db.pool, "x", id).await.unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(
        error.as_deref(),
        Some("transient error: handler panicked: scripted panic")
    );
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
}

#[tokio::test]
async fn undecodable_payloads_become_dead_letters_and_the_relay_keeps_running() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let relay = Arc::new(relay(&outbox, OnlyX::new(&probe), config()));
    let wrong_shape = insert_raw(
        &db.pool,
        "Ping",
        Uuid::new_v4(),
        r#"{"version":1,"data":{"seq":"one"}}"#,
    )
    .await;
    let not_envelope = insert_raw(&db.pool, "Ping", Uuid::new_v4(), r#"{"hello":"world"}"#).await;
    let stop = Arc::new(Notify::new());
    let worker = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop.notified()).await }
    });
    let good = Uuid::new_v4();
    publish_one(&outbox, good, 1).await;
    wait_for(|| probe.delivered_to("x") == [(good, 1)]).await;
    stop.notify_one();
    worker.await.unwrap();

    let (published, dead, _, reason) = event_state(&db.pool, wrong_shape).await;
    assert!(!published && dead);
    let reason = reason.unwrap();
    assert!(
        reason.starts_with("`data` of a version 1 `Ping` payload does not fit the event"),
        "{reason}"
    );
    let (published, dead, _, reason) = event_state(&db.pool, not_envelope).await;
    assert!(!published && dead);
    assert!(
        reason
            .unwrap()
            .starts_with("payload is not an outbox envelope: missing field `version`")
    );
    assert!(probe.seen().iter().all(|s| s.aggregate == good));
}

#[tokio::test]
async fn an_event_type_this_build_does_not_route_is_parked_until_a_build_that_does_runs() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let old_build = relay(&outbox, OnlyX::new(&probe), config());
    let a = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: a,
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let id: i64 = sqlx::query_scalar("SELECT id FROM events.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    assert_eq!(old_build.run_once().await.unwrap().parked, 1);
    let (published, dead, parked, reason) = event_state(&db.pool, id).await;
    assert!(!published && !dead);
    assert_eq!(parked, 1);
    assert_eq!(
        reason.as_deref(),
        Some("no subscriber in this build knows event type `Pong`")
    );

    let new_build = relay(&outbox, PingPong::new(&probe), config());
    run_until(&new_build, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
    assert!(event_state(&db.pool, id).await.0);
}

#[tokio::test]
async fn a_payload_of_a_newer_version_is_parked_not_dead() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let a = Uuid::new_v4();
    let id = insert_raw(
        &db.pool,
        "Ping",
        a,
        &format!(r#"{{"version":2,"data":{{"aggregate":"{a}","seq":1,"colour":"red"}}}}"#),
    )
    .await;
    let later = publish_one(&outbox, a, 2).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.parked, 1);
    let (published, dead, parked, reason) = event_state(&db.pool, id).await;
    assert!(!published && !dead);
    assert_eq!(parked, 1);
    assert_eq!(
        reason.as_deref(),
        Some(
            "`Ping` payload version 2 is newer than version 1 known to this build: run the newer code to deliver it"
        )
    );
    // The aggregate's later event waits behind it: order is kept.
    assert!(!event_state(&db.pool, later).await.0);
    assert!(probe.seen().is_empty());
}

#[tokio::test]
async fn a_subscriber_that_fails_is_retried_alone() {
    let (_db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Transient]);
    let relay = relay(&outbox, XAndY::new(&probe), config());
    publish_one(&outbox, a, 1).await;
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 1).await;
    for _ in 0..3 {
        relay.run_once().await.unwrap();
    }
    assert_eq!(probe.calls_of("y"), [(a, 1, 1)]);
    assert_eq!(probe.calls_of("x"), [(a, 1, 1), (a, 1, 2)]);
}

#[tokio::test]
async fn a_failing_event_holds_back_its_aggregate_for_that_subscriber_only() {
    let (_db, outbox) = setup().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient, Fail::Transient]);
    let config = config().with_retry(RetryPolicy::new([ms(300), ms(300)]).unwrap());
    let relay = relay(&outbox, XAndY::new(&probe), config);
    publish(
        &outbox,
        &[
            Ping {
                aggregate: a,
                seq: 1,
            },
            Ping {
                aggregate: b,
                seq: 1,
            },
            Ping {
                aggregate: a,
                seq: 2,
            },
            Ping {
                aggregate: b,
                seq: 2,
            },
            Ping {
                aggregate: a,
                seq: 3,
            },
        ],
    )
    .await;

    // First pass: y gets everything, x gets b's events, and a's later events wait for x.
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.retried, report.waiting), (5, 1, 2));
    assert_eq!(
        probe.delivered_to("y"),
        [(a, 1), (b, 1), (a, 2), (b, 2), (a, 3)]
    );
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2)]);
    // More events of b flow while a is held back for x.
    publish(
        &outbox,
        &[Ping {
            aggregate: b,
            seq: 3,
        }],
    )
    .await;
    relay.run_once().await.unwrap();
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2), (b, 3)]);
    assert!(!probe.calls_of("x").contains(&(a, 2, 1)));

    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 6).await;
    let x_on_a: Vec<(u32, u32)> = probe
        .calls_of("x")
        .into_iter()
        .filter(|c| c.0 == a)
        .map(|c| (c.1, c.2))
        .collect();
    // a1 failed twice, then a1, a2, a3 in commit order, each handed over once.
    assert_eq!(x_on_a, [(1, 1), (1, 2), (1, 3), (2, 1), (3, 1)]);
    // y took each of the six events once.
    assert_eq!(
        probe.calls_of("y"),
        [
            (a, 1, 1),
            (b, 1, 1),
            (a, 2, 1),
            (b, 2, 1),
            (a, 3, 1),
            (b, 3, 1)
        ]
    );
}

#[tokio::test]
async fn requeue_hands_dead_letters_back_to_the_relay() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Permanent]);
    probe.fail("x", b, 1, [Fail::Permanent]);
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let a_id = publish_one(&outbox, a, 1).await;
    let b_id = publish_one(&outbox, b, 1).await;
    run_until(&relay, WAIT, || probe.calls_of("x").len() == 2).await;
    assert!(delivery(&db.pool, "x", a_id).await.unwrap().2);

    // By event id.
    assert_eq!(
        outbox.requeue(&Requeue::Events(vec![a_id])).await.unwrap(),
        1
    );
    let (attempts, _, dead, _) = delivery(&db.pool, "x", a_id).await.unwrap();
    assert_eq!((attempts, dead), (0, false));
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
    assert_eq!(delivery(&db.pool, "x", a_id).await, None);

    // Every dead letter of a subscriber.
    assert_eq!(
        outbox
            .requeue(&Requeue::Subscriber("x".into()))
            .await
            .unwrap(),
        1
    );
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;
    assert_eq!(delivery(&db.pool, "x", b_id).await, None);
    // Nothing left to requeue.
    assert_eq!(
        outbox
            .requeue(&Requeue::Subscriber("x".into()))
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn a_dead_undecodable_event_can_be_requeued_after_a_fix() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let a = Uuid::new_v4();
    let id = insert_raw(&db.pool, "Ping", a, r#"{"version":1,"data":{"seq":1}}"#).await;
    relay.run_once().await.unwrap();
    assert!(event_state(&db.pool, id).await.1);
    // An operator repairs the payload, then requeues the event.
    sqlx::query("UPDATE events.outbox SET payload = jsonb_set(payload, '{data,aggregate}', to_jsonb($1::text)) WHERE id = $2")
        .bind(a.to_string())
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(outbox.requeue(&Requeue::Events(vec![id])).await.unwrap(), 1);
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
}

#[tokio::test]
async fn an_aborted_relay_leaves_claims_that_expire_and_another_relay_delivers() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let entered = Arc::new(Notify::new());
    let never = Arc::new(Notify::new());
    probe.fail(
        "x",
        a,
        1,
        [Fail::Block {
            entered: entered.clone(),
            release: never,
        }],
    );
    let lease = Duration::from_secs(1);
    let short = config().with_lease(lease).with_handler_timeout(ms(500));
    let first = relay(&outbox, OnlyX::new(&probe), short.clone());
    let id = publish_one(&outbox, a, 1).await;
    let task = tokio::spawn(async move { first.run_once().await });
    entered.notified().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let claimed_at = tokio::time::Instant::now();

    let second = relay(&outbox, OnlyX::new(&probe), short);
    // The claim still holds: nothing for the second relay yet.
    assert_eq!(second.run_once().await.unwrap().claimed, 0);
    run_until(&second, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
    assert!(
        claimed_at.elapsed() >= lease - ms(100),
        "taken again after {:?}",
        claimed_at.elapsed()
    );
    assert!(event_state(&db.pool, id).await.0);
}

#[tokio::test]
async fn the_relay_survives_its_connections_being_killed() {
    let (db, outbox) = setup().await;
    let relay_pool = db.pool_named("outbox_relay", 2).await;
    let relay_outbox: TestOutbox = Outbox::new(relay_pool);
    let probe = Probe::default();
    let relay = Arc::new(relay(&relay_outbox, OnlyX::new(&probe), config()));
    let stop = Arc::new(Notify::new());
    let worker = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop.notified()).await }
    });
    let a = Uuid::new_v4();
    publish_one(&outbox, a, 1).await;
    wait_for(|| probe.delivered_to("x").len() == 1).await;

    for round in 2..=4 {
        let killed = db.kill_sessions("outbox_relay").await;
        assert!(killed >= 1, "round {round}: no relay session to kill");
        publish_one(&outbox, a, round).await;
        wait_for(|| probe.delivered_to("x").len() == round as usize).await;
    }
    stop.notify_one();
    worker.await.unwrap();
    assert_eq!(probe.delivered_to("x"), [(a, 1), (a, 2), (a, 3), (a, 4)]);
}

#[tokio::test]
async fn no_relay_transaction_stays_open_while_handlers_run() {
    let (db, outbox) = setup().await;
    let relay_outbox: TestOutbox = Outbox::new(db.pool_named("outbox_relay", 2).await);
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    probe.fail(
        "x",
        a,
        1,
        [Fail::Block {
            entered: entered.clone(),
            release: release.clone(),
        }],
    );
    let relay = relay(&relay_outbox, OnlyX::new(&probe), config());
    publish_one(&outbox, a, 1).await;
    let task = tokio::spawn(async move { relay.run_once().await });
    entered.notified().await;

    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = $1 AND application_name = 'outbox_relay' AND xact_start IS NOT NULL",
    )
    .bind(db.name())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        open, 0,
        "a relay session holds a transaction while a handler runs"
    );
    release.notify_one();
    assert_eq!(task.await.unwrap().unwrap().delivered, 1);
}

#[tokio::test]
async fn graceful_shutdown_records_the_batch_in_progress() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    probe.fail(
        "x",
        a,
        1,
        [Fail::Block {
            entered: entered.clone(),
            release: release.clone(),
        }],
    );
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let id = publish_one(&outbox, a, 1).await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stop_rx.await;
            })
            .await;
    });
    entered.notified().await;
    stop_tx.send(()).unwrap();
    release.notify_one();
    tokio::time::timeout(WAIT, worker)
        .await
        .expect("run returns after shutdown")
        .unwrap();
    assert!(
        event_state(&db.pool, id).await.0,
        "the batch in progress was recorded"
    );
    assert_eq!(probe.delivered_to("x"), [(a, 1)]);
}

#[tokio::test]
async fn a_commit_in_this_process_wakes_an_idle_relay() {
    let (_db, outbox) = setup().await;
    let probe = Probe::default();
    let store = WatchedStore::new(outbox.store());
    let idle = store.idle.clone();
    let sleepy = config().with_poll_interval(Duration::from_secs(3600));
    let relay = Relay::new(store, OnlyX::new(&probe), sleepy).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    // The relay found nothing; from here only a wake-up makes it claim within the hour.
    idle.notified().await;
    let a = Uuid::new_v4();
    publish_one(&outbox, a, 1).await;
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    worker.abort();
}

/// Waits for a background relay to make `done` true; panics after [`WAIT`].
async fn wait_for(mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not reached within {WAIT:?}"
        );
        tokio::time::sleep(ms(10)).await;
    }
}
