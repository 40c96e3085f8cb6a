//! What operators rely on, on PostgreSQL and on SQLite: the relay's metrics, and retention of
//! published events.

use std::collections::BTreeMap;
use std::time::Duration;

use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use outbox_core::telemetry::{self, status};
use outbox_core::{Relay, RelayConfig, Retention, RetryPolicy, Store};
use outbox_sqlx::Outbox;
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{
    Fail, Ping, PingPong, Pong, Probe, WatchedStore, XAndY, run_until, wait_for,
};
use outbox_tests::on_every_backend;
use uuid::Uuid;

on_every_backend!(
    a_relay_reports_every_metric_with_its_value_and_labels,
    the_store_purges_old_published_events_in_batches_and_keeps_the_rest,
    a_relay_with_retention_purges_old_published_events_as_it_runs,
    a_relay_run_again_does_not_redo_its_chores_before_their_interval,
);

const WAIT: Duration = Duration::from_secs(20);
const DAY: Duration = Duration::from_secs(24 * 3600);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(ms(20))
        // Parked events stay parked for the whole test.
        .with_park_delay(Duration::from_secs(3600))
        // One retry, then a dead letter.
        .with_retry(RetryPolicy::new([ms(50)]).unwrap())
}

async fn publish<B: TestBackend>(outbox: &Outbox<B, PingPong>, aggregate: Uuid) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping { aggregate, seq: 1 }).await.unwrap();
    tx.commit().await.unwrap();
}

/// A metric as a test compares it: (kind, name, labels) -> value.
type Metrics = BTreeMap<(String, String, Vec<(String, String)>), Value>;

#[derive(Debug, PartialEq)]
enum Value {
    Counter(u64),
    Gauge(f64),
    /// The samples of a histogram.
    Histogram(Vec<f64>),
}

fn metrics(recorder: &DebuggingRecorder) -> Metrics {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let kind = match key.kind() {
                MetricKind::Counter => "counter",
                MetricKind::Gauge => "gauge",
                MetricKind::Histogram => "histogram",
            };
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            let value = match value {
                DebugValue::Counter(n) => Value::Counter(n),
                DebugValue::Gauge(x) => Value::Gauge(x.0),
                DebugValue::Histogram(samples) => {
                    Value::Histogram(samples.into_iter().map(|x| x.0).collect())
                }
            };
            ((kind.to_owned(), key.name().to_owned(), labels), value)
        })
        .collect()
}

fn key(kind: &str, name: &str, labels: &[(&str, &str)]) -> (String, String, Vec<(String, String)>) {
    (
        kind.to_owned(),
        name.to_owned(),
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    )
}

async fn a_relay_reports_every_metric_with_its_value_and_labels<B: TestBackend>() {
    let recorder = DebuggingRecorder::new();
    // The relay runs in this test's task, on this thread.
    let _recording = metrics::set_default_local_recorder(&recorder);
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let (fine, flaky, doomed) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", flaky, 1, [Fail::Transient]);
    probe.fail("y", doomed, 1, [Fail::Permanent]);
    for aggregate in [fine, flaky, doomed] {
        publish(&outbox, aggregate).await;
    }
    // Never decodes: a dead letter of its own.
    B::insert_raw(outbox.pool(), "Ping", Uuid::new_v4(), r#"{"version":1}"#).await;
    // This relay's router does not route `Pong`: it is parked, and stays pending.
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let relay = Relay::new(outbox.store(), XAndY::new(&probe), config()).unwrap();
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 3).await;
    let status = relay.report_status().await.unwrap();
    let oldest = status
        .oldest_pending_age
        .expect("the parked event is pending");
    assert!(oldest < WAIT, "{oldest:?}");

    let mut metrics = metrics(&recorder);
    let Some(Value::Histogram(durations)) = metrics.remove(&key(
        "histogram",
        telemetry::DISPATCH_DURATION_SECONDS,
        &[("event_type", "Ping")],
    )) else {
        panic!("no dispatch durations for Ping: {metrics:?}");
    };
    // x: fine, flaky (failed), flaky, doomed; y: fine, flaky, doomed (failed).
    assert_eq!(durations.len(), 7, "{durations:?}");
    assert!(
        durations.iter().all(|d| (0.0..20.0).contains(d)),
        "{durations:?}"
    );
    let Some(Value::Gauge(age)) =
        metrics.remove(&key("gauge", telemetry::OLDEST_PENDING_AGE_SECONDS, &[]))
    else {
        panic!("no oldest pending age: {metrics:?}");
    };
    assert!(
        (age - oldest.as_secs_f64()).abs() < 1e-6 && age > 0.0,
        "{age}"
    );

    let counter = |event_type, status| {
        key(
            "counter",
            telemetry::DISPATCHED_TOTAL,
            &[("event_type", event_type), ("status", status)],
        )
    };
    let expected: Metrics = [
        // x: fine, flaky (second try), doomed; y: fine, flaky.
        (counter("Ping", status::DELIVERED), Value::Counter(5)),
        // x on flaky, once.
        (counter("Ping", status::RETRY), Value::Counter(1)),
        // y on doomed (a permanent error), and the payload that never decodes.
        (counter("Ping", status::DEAD), Value::Counter(2)),
        (counter("Pong", status::PARKED), Value::Counter(1)),
        // The parked Pong.
        (
            key("gauge", telemetry::PENDING_COUNT, &[]),
            Value::Gauge(1.0),
        ),
        (
            key("gauge", telemetry::PENDING_DELIVERIES_COUNT, &[]),
            Value::Gauge(0.0),
        ),
        // The undecodable event, and y's delivery of doomed.
        (
            key("gauge", telemetry::DEAD_LETTER_COUNT, &[]),
            Value::Gauge(2.0),
        ),
        // (y, doomed).
        (
            key("gauge", telemetry::BLOCKED_KEYS_COUNT, &[]),
            Value::Gauge(1.0),
        ),
        // The aggregates of the undecodable event and of the parked Pong.
        (
            key("gauge", telemetry::BLOCKED_AGGREGATES_COUNT, &[]),
            Value::Gauge(2.0),
        ),
        // Nothing was published behind them.
        (
            key("gauge", telemetry::HELD_EVENTS_COUNT, &[]),
            Value::Gauge(0.0),
        ),
        // This relay, registered; the parked Pong is what it does not route.
        (
            key("gauge", telemetry::LIVE_RELAYS_COUNT, &[]),
            Value::Gauge(1.0),
        ),
        (
            key("gauge", telemetry::UNROUTABLE_EVENTS_COUNT, &[]),
            Value::Gauge(1.0),
        ),
        (
            key("gauge", telemetry::UNROUTABLE_DELIVERIES_COUNT, &[]),
            Value::Gauge(0.0),
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(metrics, expected);
}

/// `n` events published and delivered, then made `by` older; returns their ids.
async fn published<B: TestBackend, S: Store>(
    outbox: &Outbox<B, PingPong>,
    relay: &Relay<S, XAndY>,
    probe: &Probe,
    n: usize,
    by: Duration,
) -> Vec<i64> {
    let before = B::events(outbox.pool()).await.len();
    for _ in 0..n {
        publish(outbox, Uuid::new_v4()).await;
    }
    let delivered = probe.delivered_to("x").len();
    run_until(relay, WAIT, || {
        probe.delivered_to("x").len() == delivered + n
    })
    .await;
    let ids: Vec<i64> = B::events(outbox.pool()).await[before..]
        .iter()
        .map(|e| e.id)
        .collect();
    if !by.is_zero() {
        for &id in &ids {
            B::backdate_published(outbox.pool(), id, by).await;
        }
    }
    ids
}

/// Seven events published two days ago, plus what must stay: one published now, one published
/// two days ago whose delivery to `y` is dead, and a dead event. Returns (the old ones, the ones
/// to keep), in id order.
async fn retention_setup<B: TestBackend, S: Store>(
    outbox: &Outbox<B, PingPong>,
    relay: &Relay<S, XAndY>,
    probe: &Probe,
) -> (Vec<i64>, Vec<i64>) {
    let old = published(outbox, relay, probe, 7, 2 * DAY).await;
    let mut keep = published(outbox, relay, probe, 1, Duration::ZERO).await;
    let doomed = Uuid::new_v4();
    probe.fail("y", doomed, 1, [Fail::Permanent]);
    publish(outbox, doomed).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.delivered, report.dead), (1, 1), "{report:?}");
    let dead_delivery = B::events(outbox.pool()).await.last().unwrap().id;
    B::backdate_published(outbox.pool(), dead_delivery, 2 * DAY).await;
    keep.push(dead_delivery);
    keep.push(B::insert_raw(outbox.pool(), "Ping", Uuid::new_v4(), "[1, 2]").await);
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.dead, 1, "the raw event is a dead letter: {report:?}");
    (old, keep)
}

async fn remaining<B: TestBackend>(outbox: &Outbox<B, PingPong>) -> Vec<i64> {
    B::events(outbox.pool())
        .await
        .iter()
        .map(|e| e.id)
        .collect()
}

async fn the_store_purges_old_published_events_in_batches_and_keeps_the_rest<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), XAndY::new(&probe), config()).unwrap();
    let (old, keep) = retention_setup(&outbox, &relay, &probe).await;
    let store = outbox.store();

    // One call looks at one batch, oldest first, and deletes what no delivery holds; it says
    // whether it stopped at its limit.
    let purge = async |limit| {
        let purged = store.purge_published(DAY, limit).await.unwrap();
        (purged.deleted, purged.more)
    };
    assert_eq!(purge(3).await, (3, true));
    let mut expected: Vec<i64> = old[3..].iter().chain(&keep).copied().collect();
    expected.sort_unstable();
    assert_eq!(remaining(&outbox).await, expected);
    assert_eq!(purge(3).await, (3, true));
    // The last old one, and the one a dead delivery holds (published after it).
    assert_eq!(purge(3).await, (1, false));
    assert_eq!(purge(3).await, (0, false));
    assert_eq!(remaining(&outbox).await, keep);
    let status = store.status().await.unwrap();
    assert_eq!(status.dead_letters, 2, "{status:?}");

    // The next calls go on past the held one: they do not look at it again and again.
    let after = published(&outbox, &relay, &probe, 2, 2 * DAY).await;
    assert_eq!(purge(1).await, (0, true), "the held one");
    assert_eq!(purge(1).await, (1, true));
    assert_eq!(
        remaining(&outbox)
            .await
            .iter()
            .filter(|id| after.contains(id))
            .count(),
        1
    );
    assert_eq!(purge(1).await, (1, true));
    assert_eq!(purge(1).await, (0, false));
    assert_eq!(remaining(&outbox).await, keep);

    // The library call goes on until no batch is left.
    published(&outbox, &relay, &probe, 5, 2 * DAY).await;
    assert_eq!(outbox.purge_published(DAY, 2).await.unwrap(), 5);
    assert_eq!(remaining(&outbox).await, keep);
}

async fn a_relay_with_retention_purges_old_published_events_as_it_runs<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let store = WatchedStore::new(outbox.store());
    let purges = store.purges.clone();
    let setup_relay = Relay::new(outbox.store(), XAndY::new(&probe), config()).unwrap();
    let (_, keep) = retention_setup(&outbox, &setup_relay, &probe).await;

    let retention = Retention::keep(DAY)
        .with_batch_size(3)
        .with_interval(Duration::from_secs(3600));
    let relay = Relay::new(
        store,
        XAndY::new(&probe),
        config().with_retention(retention),
    )
    .unwrap();
    let stop = tokio::sync::Notify::new();
    let running = relay.run(stop.notified());
    let watching = async {
        wait_for(|| purges.lock().unwrap().len() == 3).await;
        stop.notify_one();
    };
    tokio::join!(running, watching);
    // Full batches follow each other; the short one ends the round until the interval passes.
    assert_eq!(*purges.lock().unwrap(), [(3, 3), (3, 3), (3, 1)]);
    assert_eq!(remaining(&outbox).await, keep);
}

async fn a_relay_run_again_does_not_redo_its_chores_before_their_interval<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    let probe = Probe::default();
    let store = WatchedStore::new(outbox.store());
    let (statuses, purges, idle) = (
        store.statuses.clone(),
        store.purges.clone(),
        store.idle.clone(),
    );
    let hour = Duration::from_secs(3600);
    let config = config()
        .with_status_interval(hour)
        .with_retention(Retention::keep(DAY).with_interval(hour));
    let relay = Relay::new(store, XAndY::new(&probe), config).unwrap();
    // The chores run beside the deliveries: the first run stops once both are done.
    relay
        .run(async {
            idle.notified().await;
            wait_for(|| {
                statuses.load(std::sync::atomic::Ordering::Relaxed) == 1
                    && purges.lock().unwrap().len() == 1
            })
            .await;
        })
        .await;
    for _ in 0..2 {
        // Each later run stops at its first claim that finds nothing.
        relay.run(idle.notified()).await;
    }
    assert_eq!(
        statuses.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "one status report per interval, however many runs"
    );
    assert_eq!(purges.lock().unwrap().len(), 1, "one purge per interval");
}

/// A relay whose claims fail while the database answers (here a trigger refuses the claim's
/// insert; in life a lock timeout, a permission, a full disk) counts each failed call by its
/// operation, so that an operator can alert on it, and counts nothing once claims work again.
#[tokio::test]
async fn a_relay_counts_each_failed_call_of_its_store_by_operation() {
    use sqlx::Postgres;

    let recorder = DebuggingRecorder::new();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let (_db, outbox) = outbox::<Postgres, PingPong>().await;
    let store_errors = |recorder: &DebuggingRecorder| -> Vec<(String, u64)> {
        metrics(recorder)
            .into_iter()
            .filter(|((_, name, _), _)| name == telemetry::STORE_ERRORS_TOTAL)
            .map(|((_, _, labels), value)| match value {
                Value::Counter(n) => (format!("{labels:?}"), n),
                other => panic!("not a counter: {other:?}"),
            })
            .collect()
    };
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), XAndY::new(&probe), config()).unwrap();
    let aggregate = Uuid::new_v4();
    publish(&outbox, aggregate).await;
    sqlx::raw_sql(
        "CREATE FUNCTION events.refuse() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION 'claims refused by the test'; END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON events.outbox_claims
             FOR EACH ROW EXECUTE FUNCTION events.refuse();",
    )
    .execute(outbox.pool())
    .await
    .unwrap();

    for _ in 0..3 {
        let error = relay.run_once().await.unwrap_err();
        assert!(
            error.to_string().contains("claims refused by the test"),
            "{error}"
        );
    }
    let claim = format!("{:?}", [("operation".to_owned(), "claim".to_owned())]);
    assert_eq!(store_errors(&recorder), [(claim.clone(), 3)]);
    assert!(probe.delivered_to("x").is_empty());

    sqlx::raw_sql("DROP TRIGGER refuse ON events.outbox_claims")
        .execute(outbox.pool())
        .await
        .unwrap();
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(aggregate, 1)]).await;
    // (A snapshot takes the counts since the one before.)
    assert_eq!(
        store_errors(&recorder),
        [(claim, 0)],
        "nothing more counted once claims work"
    );
}

/// A relay whose database cannot be reached counts the failed registration its claim starts
/// with (a claim comes after it) and a failed read of the status, each by its operation.
#[tokio::test]
async fn a_relay_that_cannot_reach_its_database_counts_what_failed() {
    use sqlx::postgres::PgPoolOptions;

    let recorder = DebuggingRecorder::new();
    let _recording = metrics::set_default_local_recorder(&recorder);
    // Nothing listens on port 1.
    let pool = PgPoolOptions::new()
        .acquire_timeout(ms(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/outbox")
        .unwrap();
    let outbox = Outbox::<sqlx::Postgres, PingPong>::new(pool);
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), XAndY::new(&probe), config()).unwrap();
    relay.run_once().await.unwrap_err();
    relay.report_status().await.unwrap_err();
    let counted: BTreeMap<String, Value> = metrics(&recorder)
        .into_iter()
        .filter(|((_, name, _), _)| name == telemetry::STORE_ERRORS_TOTAL)
        .map(|((_, _, labels), value)| (labels[0].1.clone(), value))
        .collect();
    assert_eq!(
        counted,
        BTreeMap::from([
            (
                telemetry::store_operation::REGISTER.to_owned(),
                Value::Counter(1)
            ),
            (
                telemetry::store_operation::STATUS.to_owned(),
                Value::Counter(1)
            ),
        ])
    );
}
