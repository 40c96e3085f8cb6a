//! Several relays sharing one database: four worker processes deliver what eight producers
//! write to overlapping aggregates. Each (subscriber, aggregate) must see its events in commit
//! order, every event must be delivered, and none twice: with handlers called one at a time,
//! and with 64 at a time per worker, handlers that take 0-5 ms and fail 10% of the time.
//!
//! A test file runs [`workers_keep_order`] and has an ignored test `worker_process` that calls
//! [`worker_process`]: the workers are that test binary run again with `OUTBOX_WORKER_DATABASE`
//! set (the ignored test does nothing without it).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, RetryPolicy, router, subscriber,
};
use outbox_sqlx::Outbox;
use serde::{Deserialize, Serialize};
use sqlx::{MySql, MySqlPool, PgPool, Pool, Postgres};
use uuid::Uuid;

use crate::backend::TestBackend;
use crate::process::TestProcess;

const WORKERS: usize = 4;
const PRODUCERS: usize = 8;
const COMMITS_PER_PRODUCER: usize = 150;

/// One step of an aggregate: `version` counts its commits, so it is the commit order.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "counter")]
pub struct Stepped {
    #[outbox(aggregate_id)]
    aggregate: Uuid,
    version: i64,
}

/// Where handlings are recorded.
#[derive(Clone)]
pub enum Seen {
    /// On PostgreSQL.
    Postgres(PgPool),
    /// On MySQL.
    MySql(MySqlPool),
}

/// Records each successful handling in `seen`, in handling order.
pub struct Recorder {
    seen: Seen,
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
        match &self.seen {
            Seen::Postgres(pool) => {
                sqlx::query(
                    "INSERT INTO seen (subscriber, aggregate, version, event_id, worker)
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(delivery.subscriber())
                .bind(event.aggregate)
                .bind(event.version)
                .bind(id)
                .bind(self.worker)
                .execute(pool)
                .await?;
            }
            Seen::MySql(pool) => {
                sqlx::query(
                    "INSERT INTO seen (subscriber, aggregate, version, event_id, worker)
                     VALUES (?, ?, ?, ?, ?)",
                )
                .bind(delivery.subscriber())
                .bind(event.aggregate)
                .bind(event.version)
                .bind(id)
                .bind(self.worker)
                .execute(pool)
                .await?;
            }
        }
        Ok(())
    }
}

/// A subscriber that never fails on purpose.
#[subscriber(events = [Stepped], name = "steady")]
pub struct Steady(Recorder);

/// A subscriber whose first attempt fails for every seventh event.
#[subscriber(events = [Stepped], name = "flaky")]
pub struct Flaky(Recorder);

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

/// The workers' router.
#[router(events = [Stepped])]
pub struct Counters {
    steady: Steady,
    flaky: Flaky,
}

/// What differs between the databases the workers test runs on.
pub trait WorkersDb: TestBackend {
    /// The pool handlers record in.
    fn seen(pool: &Pool<Self>) -> Seen;

    /// Creates `aggregates (id, version)` with a row of version 0 for each of `ids`, and
    /// `seen (n, subscriber, aggregate, version, event_id, worker)`.
    fn create_tables(pool: &Pool<Self>, ids: &[Uuid]) -> impl Future<Output = ()> + Send;

    /// Bumps the version of `aggregate` in the transaction (its row lock orders the writers of
    /// one aggregate); returns the new version.
    fn bump(
        conn: &mut Self::Connection,
        aggregate: Uuid,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send;

    /// How many handlings `seen` holds.
    fn handled(pool: &Pool<Self>) -> impl Future<Output = i64> + Send;

    /// Every handling: (subscriber, aggregate, version, event id, worker), in handling order.
    fn handlings(pool: &Pool<Self>) -> impl Future<Output = Vec<Handling>> + Send;

    /// Each aggregate's final version.
    fn finals(pool: &Pool<Self>) -> impl Future<Output = BTreeMap<Uuid, i64>> + Send;
}

/// One handling: (subscriber, aggregate, version, event id, worker).
pub type Handling = (String, Uuid, i64, i64, i32);

/// The queries that read `seen` and `aggregates`: the same SQL on every database.
macro_rules! reads {
    ($db:ty) => {
        async fn handled(pool: &Pool<$db>) -> i64 {
            sqlx::query_scalar("SELECT count(*) FROM seen")
                .fetch_one(pool)
                .await
                .unwrap()
        }

        async fn handlings(pool: &Pool<$db>) -> Vec<Handling> {
            sqlx::query_as(
                "SELECT subscriber, aggregate, version, event_id, worker FROM seen ORDER BY n",
            )
            .fetch_all(pool)
            .await
            .unwrap()
        }

        async fn finals(pool: &Pool<$db>) -> BTreeMap<Uuid, i64> {
            sqlx::query_as("SELECT id, version FROM aggregates")
                .fetch_all(pool)
                .await
                .unwrap()
                .into_iter()
                .collect()
        }
    };
}

impl WorkersDb for Postgres {
    reads!(Postgres);

    fn seen(pool: &PgPool) -> Seen {
        Seen::Postgres(pool.clone())
    }

    async fn create_tables(pool: &PgPool, ids: &[Uuid]) {
        sqlx::raw_sql(
            "CREATE TABLE aggregates (id UUID PRIMARY KEY, version BIGINT NOT NULL);
             CREATE TABLE seen (n BIGSERIAL PRIMARY KEY, subscriber TEXT NOT NULL,
                                aggregate UUID NOT NULL, version BIGINT NOT NULL,
                                event_id BIGINT NOT NULL, worker INT NOT NULL);",
        )
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("INSERT INTO aggregates SELECT unnest($1::uuid[]), 0")
            .bind(ids)
            .execute(pool)
            .await
            .unwrap();
    }

    async fn bump(conn: &mut sqlx::PgConnection, aggregate: Uuid) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "UPDATE aggregates SET version = version + 1 WHERE id = $1 RETURNING version",
        )
        .bind(aggregate)
        .fetch_one(conn)
        .await
    }
}

impl WorkersDb for MySql {
    reads!(MySql);

    fn seen(pool: &MySqlPool) -> Seen {
        Seen::MySql(pool.clone())
    }

    async fn create_tables(pool: &MySqlPool, ids: &[Uuid]) {
        sqlx::raw_sql(
            "CREATE TABLE aggregates (id BINARY(16) PRIMARY KEY, version BIGINT NOT NULL);
             CREATE TABLE seen (n BIGINT AUTO_INCREMENT PRIMARY KEY,
                                subscriber VARCHAR(64) NOT NULL, aggregate BINARY(16) NOT NULL,
                                version BIGINT NOT NULL, event_id BIGINT NOT NULL,
                                worker INT NOT NULL);",
        )
        .execute(pool)
        .await
        .unwrap();
        for id in ids {
            sqlx::query("INSERT INTO aggregates VALUES (?, 0)")
                .bind(id)
                .execute(pool)
                .await
                .unwrap();
        }
    }

    async fn bump(conn: &mut sqlx::MySqlConnection, aggregate: Uuid) -> Result<i64, sqlx::Error> {
        sqlx::query("UPDATE aggregates SET version = version + 1 WHERE id = ?")
            .bind(aggregate)
            .execute(&mut *conn)
            .await?;
        sqlx::query_scalar("SELECT version FROM aggregates WHERE id = ?")
            .bind(aggregate)
            .fetch_one(conn)
            .await
    }
}

/// The body of a test file's ignored `worker_process`: a relay worker, when started by
/// [`workers_keep_order`] (nothing otherwise).
pub async fn worker_process<B: WorkersDb>() {
    let Ok(url) = std::env::var("OUTBOX_WORKER_DATABASE") else {
        return;
    };
    let worker: i32 = std::env::var("OUTBOX_WORKER_ID").unwrap().parse().unwrap();
    let concurrency: usize = std::env::var("OUTBOX_WORKER_CONCURRENCY")
        .unwrap()
        .parse()
        .unwrap();
    let chaos = concurrency > 1;
    let pool = B::connect(url).await;
    let outbox: Outbox<B, Counters> = Outbox::new(pool.clone());
    let recorder = |flaky| Recorder {
        seen: B::seen(&pool),
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

/// Whether a commit failed only because of a concurrent transaction: try it again.
fn is_serialization_failure(error: &outbox_sqlx::Error) -> bool {
    let text = error.to_string();
    text.contains("40001") || text.contains("could not serialize") || text.contains("deadlock")
}

/// Four worker processes (each calling up to `concurrency` handlers at once) deliver what
/// eight producers commit over `aggregates` aggregates, on the database of `guard` (migrated,
/// `pool` on it): checks commit order per key, each handling once, nothing lost, work shared.
pub async fn workers_keep_order<B: WorkersDb>(
    guard: &B::Guard,
    pool: Pool<B>,
    concurrency: usize,
    aggregates: usize,
) {
    let outbox: Outbox<B, Counters> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let aggregates: Vec<Uuid> = (0..aggregates).map(|_| Uuid::new_v4()).collect();
    B::create_tables(&pool, &aggregates).await;

    let url = B::url(guard);
    let concurrency = concurrency.to_string();
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

    // Producers: each commit bumps an aggregate's version and publishes that version.
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

    // Wait for both subscribers to have handled every event.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let handled = B::handled(&pool).await;
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

    let rows = B::handlings(&pool).await;
    let finals = B::finals(&pool).await;
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
async fn step<B: WorkersDb>(
    outbox: &Outbox<B, Counters>,
    aggregate: Uuid,
) -> Result<(), outbox_sqlx::Error> {
    let mut tx = outbox.begin().await?;
    let version = B::bump(&mut tx, aggregate).await?;
    tx.publish(&Stepped { aggregate, version }).await?;
    tx.commit().await?;
    Ok(())
}
