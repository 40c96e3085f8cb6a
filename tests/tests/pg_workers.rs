//! Several relays sharing one PostgreSQL: four worker processes deliver what eight producers
//! write to overlapping aggregates. Each (subscriber, aggregate) must see its events in commit
//! order, every event must be delivered, and none twice: with handlers called one at a time,
//! and with 64 at a time per worker, handlers that take 0-5 ms and fail 10% of the time.
//!
//! The workers are this test binary run again with `OUTBOX_WORKER_DATABASE` set: see
//! `worker_process`, which does nothing when run without it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, RetryPolicy, router, subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use outbox_tests::process::TestProcess;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

const WORKERS: usize = 4;
const PRODUCERS: usize = 8;
const COMMITS_PER_PRODUCER: usize = 150;
const AGGREGATES: usize = 12;

/// One step of an aggregate: `version` counts its commits, so it is the commit order.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "counter")]
struct Stepped {
    #[outbox(aggregate_id)]
    aggregate: Uuid,
    version: i64,
}

/// Records each successful handling in `seen`, in handling order.
struct Recorder {
    pool: PgPool,
    worker: i32,
    /// Fail the first attempt of some events, so that retries cross workers too.
    flaky: bool,
    /// Take 0-5 ms and fail 10% of all attempts, whatever the subscriber.
    chaos: bool,
}

impl Recorder {
    async fn record(&self, event: &Stepped, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        let id = delivery.event().id;
        if self.flaky && delivery.attempt() == 1 && id % 7 == 0 {
            return Err(HandlerError::transient("scripted failure"));
        }
        if self.chaos {
            tokio::time::sleep(Duration::from_micros(fastrand::u64(0..5_000))).await;
            if fastrand::u32(0..10) == 0 {
                return Err(HandlerError::transient("random failure"));
            }
        }
        sqlx::query(
            "INSERT INTO seen (subscriber, aggregate, version, event_id, worker)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(delivery.subscriber())
        .bind(event.aggregate)
        .bind(event.version)
        .bind(id)
        .bind(self.worker)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}

#[subscriber(events = [Stepped], name = "steady")]
struct Steady(Recorder);

#[subscriber(events = [Stepped], name = "flaky")]
struct Flaky(Recorder);

impl Handle<Stepped> for Steady {
    async fn handle(&self, event: &Stepped, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.record(event, delivery).await
    }
}

impl Handle<Stepped> for Flaky {
    async fn handle(&self, event: &Stepped, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.record(event, delivery).await
    }
}

#[router(events = [Stepped])]
struct Counters {
    steady: Steady,
    flaky: Flaky,
}

/// A relay worker, when started by `several_worker_processes_keep_order_and_lose_nothing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process of several_worker_processes_keep_order_and_lose_nothing"]
async fn worker_process() {
    let Ok(url) = std::env::var("OUTBOX_WORKER_DATABASE") else {
        return;
    };
    let worker: i32 = std::env::var("OUTBOX_WORKER_ID").unwrap().parse().unwrap();
    let concurrency: usize = std::env::var("OUTBOX_WORKER_CONCURRENCY")
        .unwrap()
        .parse()
        .unwrap();
    let chaos = concurrency > 1;
    let pool = PgPoolOptions::new()
        .max_connections(if chaos { 16 } else { 4 })
        .connect(&url)
        .await
        .unwrap();
    let outbox: Outbox<Postgres, Counters> = Outbox::new(pool.clone());
    let recorder = |flaky| Recorder {
        pool: pool.clone(),
        worker,
        flaky,
        chaos,
    };
    // With failures on 10% of all attempts, enough retries that none runs out.
    let retry = if chaos {
        RetryPolicy::new([Duration::from_millis(10); 30])
    } else {
        RetryPolicy::new([Duration::from_millis(30); 5])
    };
    let relay = outbox
        .relay(
            Counters {
                steady: Steady(recorder(false)),
                flaky: Flaky(recorder(true)),
            },
            RelayConfig::default()
                .with_batch_size(20)
                .with_concurrency(concurrency)
                .with_poll_interval(Duration::from_millis(20))
                .with_retry(retry.unwrap()),
        )
        .unwrap();
    relay.run(std::future::pending()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_worker_processes_keep_order_and_lose_nothing() {
    workers_keep_order(None, 1, AGGREGATES).await;
}

/// Four worker processes calling up to 64 handlers at once each, over 200 aggregates, with
/// handlers that take 0-5 ms and fail 10% of their attempts: each (subscriber, aggregate) still
/// sees its events in commit order, each once, and every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_at_concurrency_64() {
    workers_keep_order(None, 64, 200).await;
}

/// The same, with the database's default isolation raised: the claim must run at READ
/// COMMITTED whatever the default (under REPEATABLE READ its snapshot would predate the claim
/// lock it waited for, and it would claim what the previous claimer just took).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_keep_order_under_repeatable_read_and_serializable_defaults() {
    workers_keep_order(Some("repeatable read"), 1, AGGREGATES).await;
    workers_keep_order(Some("serializable"), 1, AGGREGATES).await;
}

/// Whether a commit failed only because of a concurrent transaction: try it again.
fn is_serialization_failure(error: &outbox_sqlx::Error) -> bool {
    let text = error.to_string();
    text.contains("40001") || text.contains("could not serialize") || text.contains("deadlock")
}

async fn workers_keep_order(isolation: Option<&str>, concurrency: usize, aggregates: usize) {
    let db = TestDb::new().await;
    if let Some(isolation) = isolation {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{isolation}'",
            db.name()
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // New sessions take the default; the test's own pool connected before.
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(&db.url())
        .await
        .unwrap();
    if let Some(isolation) = isolation {
        let default: String = sqlx::query_scalar("SHOW default_transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(default, isolation);
    }
    let db_pool = pool;
    let outbox: Outbox<Postgres, Counters> = Outbox::new(db_pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE aggregates (id UUID PRIMARY KEY, version BIGINT NOT NULL);
         CREATE TABLE seen (n BIGSERIAL PRIMARY KEY, subscriber TEXT NOT NULL,
                            aggregate UUID NOT NULL, version BIGINT NOT NULL,
                            event_id BIGINT NOT NULL, worker INT NOT NULL);",
    )
    .execute(&db_pool)
    .await
    .unwrap();
    let aggregates: Vec<Uuid> = (0..aggregates).map(|_| Uuid::new_v4()).collect();
    sqlx::query("INSERT INTO aggregates SELECT unnest($1::uuid[]), 0")
        .bind(&aggregates)
        .execute(&db_pool)
        .await
        .unwrap();

    let url = db.url();
    let (concurrency, url) = (concurrency.to_string(), url.clone());
    let workers: Vec<TestProcess> = (0..WORKERS)
        .map(|worker| {
            TestProcess::start(
                "worker_process",
                &[
                    ("OUTBOX_WORKER_DATABASE", &url),
                    ("OUTBOX_WORKER_ID", &worker.to_string()),
                    ("OUTBOX_WORKER_CONCURRENCY", &concurrency),
                ],
            )
        })
        .collect();

    // Producers: each commit bumps an aggregate's version (the row lock orders writers of one
    // aggregate) and publishes that version.
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|_| {
            let (outbox, aggregates) = (outbox.clone(), aggregates.clone());
            tokio::spawn(async move {
                let mut committed = 0;
                while committed < COMMITS_PER_PRODUCER {
                    let aggregate = aggregates[fastrand::usize(..aggregates.len())];
                    match step(&outbox, aggregate).await {
                        Ok(()) => committed += 1,
                        Err(error) if is_serialization_failure(&error) => {}
                        Err(error) => panic!("{error}"),
                    }
                }
            })
        })
        .collect();
    for producer in producers {
        producer.await.unwrap();
    }
    let total = PRODUCERS * COMMITS_PER_PRODUCER;
    let db_pool = &db_pool;

    // Wait for both subscribers to have handled every event.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let handled: i64 = sqlx::query_scalar("SELECT count(*) FROM seen")
            .fetch_one(db_pool)
            .await
            .unwrap();
        let status = outbox.status().await.unwrap();
        if handled >= 2 * total as i64 && status.is_settled() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {handled} of {} handlings after 120 s; {status:?}",
            2 * total
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(workers);

    let rows: Vec<(String, Uuid, i64, i64, i32)> = sqlx::query_as(
        "SELECT subscriber, aggregate, version, event_id, worker FROM seen ORDER BY n",
    )
    .fetch_all(db_pool)
    .await
    .unwrap();
    let finals: BTreeMap<Uuid, i64> = sqlx::query_as("SELECT id, version FROM aggregates")
        .fetch_all(db_pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(finals.values().sum::<i64>(), total as i64);

    // Exactly once each: no event handled twice, by one worker or two.
    let distinct: BTreeSet<(&str, i64)> = rows.iter().map(|r| (r.0.as_str(), r.3)).collect();
    assert_eq!(distinct.len(), rows.len(), "an event was handled twice");
    assert_eq!(
        rows.len(),
        2 * total,
        "every event reached both subscribers"
    );

    // Commit order per (subscriber, aggregate): versions 1, 2, 3... in handling order.
    let mut by_key: BTreeMap<(&str, Uuid), Vec<i64>> = BTreeMap::new();
    for (subscriber, aggregate, version, _, _) in &rows {
        by_key
            .entry((subscriber, *aggregate))
            .or_default()
            .push(*version);
    }
    for ((subscriber, aggregate), versions) in &by_key {
        let expected: Vec<i64> = (1..=finals[aggregate]).collect();
        assert_eq!(
            versions, &expected,
            "{subscriber} saw {aggregate}'s events out of commit order"
        );
    }
    // The work was shared: more than one process delivered.
    let workers: BTreeSet<i32> = rows.iter().map(|r| r.4).collect();
    assert!(workers.len() > 1, "one worker did everything: {workers:?}");
}

/// One producer commit: bump the aggregate's version and publish it.
async fn step(
    outbox: &Outbox<Postgres, Counters>,
    aggregate: Uuid,
) -> Result<(), outbox_sqlx::Error> {
    let mut tx = outbox.begin().await?;
    let version: i64 = sqlx::query_scalar(
        "UPDATE aggregates SET version = version + 1 WHERE id = $1 RETURNING version",
    )
    .bind(aggregate)
    .fetch_one(&mut *tx)
    .await?;
    tx.publish(&Stepped { aggregate, version }).await?;
    tx.commit().await?;
    Ok(())
}
