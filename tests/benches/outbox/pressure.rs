//! Pressure: a session idle in a transaction pins the xmin horizon (vacuum can reclaim nothing
//! it might still see) while producers run at half capacity; then it ends. Ours at
//! `RelayConfig::default()` and the raw `SKIP LOCKED` loop, each on a fresh database: delivered
//! and offered events per second, commit-to-handler latency (p50, p99) per 30 s window; dead
//! tuples and sizes of the tables at the start, at the end of the pressure and after. The
//! tables are vacuumed as autovacuum would (it cannot reclaim what the held snapshot may see).
//! With a retention (`--retention S`), published events are deleted S seconds after their
//! publication, on both sides, and the figures start once the table holds that much. With
//! `--partition N`, ours' events table is partitioned by id, N ids a partition: its retention
//! then empties and drops whole partitions. Sizes and dead tuples count every partition.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_core::{RelayConfig, Retention};
use sqlx::{Connection, PgConnection, PgPool};

use super::{
    Meter, RAW_BATCH, percentile, raw_cycle, setup, spawn_producers, spawn_relay,
    vacuum_as_autovacuum_would,
};

/// A measurement window.
const WINDOW: Duration = Duration::from_secs(30);

/// The tables each side writes, by what they hold.
const TABLES: [&str; 4] = [
    "events.outbox",
    "events.outbox_claims",
    "events.outbox_claim_parts",
    "events.outbox_deliveries",
];

pub(crate) async fn pressure(
    rate: f64,
    pressure_minutes: u64,
    after_minutes: u64,
    retention: Option<u64>,
    partition: Option<u64>,
) {
    let retention = retention.map(Duration::from_secs);
    println!(
        "(6) pressure: {rate:.0} events/s offered; a session holds its snapshot for \
         {pressure_minutes} min, then ends; {after_minutes} min after; {}",
        match retention {
            Some(keep) => format!("published events kept {} s", keep.as_secs()),
            None => "published events kept (the default 30 days)".to_owned(),
        }
    );
    if let Some(size) = partition {
        println!("  ours: the events table partitioned by id, {size} ids a partition");
    }
    for raw in [false, true] {
        let partition = partition.filter(|_| !raw);
        run(
            raw,
            rate,
            pressure_minutes,
            after_minutes,
            retention,
            partition,
        )
        .await;
    }
}

async fn run(
    raw: bool,
    rate: f64,
    pressure_minutes: u64,
    after_minutes: u64,
    retention: Option<Duration>,
    partition: Option<u64>,
) {
    let (_db, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    if let Some(size) = partition {
        outbox.partition_by_id(size).await.unwrap();
    }
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        .execute(&pool)
        .await
        .unwrap();
    let meter = Meter::default();
    let stop = Arc::new(AtomicBool::new(false));
    let relay_task = if raw {
        tokio::spawn(raw_relay(pool.clone(), meter.clone(), stop.clone()))
    } else {
        let config = match retention {
            // As the soak: the relay purges in batches of 5000, every 10 s when it finds little.
            Some(keep) => RelayConfig::default().with_retention(
                Retention::keep(keep)
                    .with_batch_size(5_000)
                    .with_interval(PURGE_EVERY),
            ),
            None => RelayConfig::default(),
        };
        spawn_relay(&outbox, &meter, &stop, config)
    };
    let purge = match (raw, retention) {
        (true, Some(keep)) => Some(tokio::spawn(raw_purge(pool.clone(), keep, stop.clone()))),
        _ => None,
    };
    let producers = spawn_producers(&outbox, &ids, rate, raw, &meter, true, &stop);
    println!(
        "  {}",
        if raw {
            "raw SKIP LOCKED loop"
        } else {
            "ours, RelayConfig::default()"
        }
    );
    let vacuum = vacuum_as_autovacuum_would(&pool, &stop).await;
    // A window to settle before the first figures; with a retention, until the table holds
    // what it keeps (and a window more).
    tokio::time::sleep(WINDOW + retention.unwrap_or_default()).await;
    report_tables(&pool, "start").await;

    // Out of the pool: the session that holds the snapshot.
    let mut holder: PgConnection = pool.acquire().await.unwrap().detach();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM accounts;")
        .execute(&mut holder)
        .await
        .unwrap();
    println!("    window  phase     offered/s  delivered/s  p50 ms  p99 ms  backlog  outbox MB");
    let windows = |minutes: u64| minutes * 60 / WINDOW.as_secs();
    let mut window = 0;
    for _ in 0..windows(pressure_minutes) {
        window += 1;
        measure(&pool, &meter, window, "held").await;
    }
    report_tables(&pool, "end of the pressure").await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    holder.close().await.unwrap();
    for _ in 0..windows(after_minutes) {
        window += 1;
        measure(&pool, &meter, window, "released").await;
    }
    report_tables(&pool, "after").await;

    stop.store(true, Ordering::Relaxed);
    for task in producers {
        task.await.unwrap();
    }
    relay_task.await.unwrap();
    if let Some(purge) = purge {
        purge.await.unwrap();
    }
    if let Some(vacuum) = vacuum {
        vacuum.await.unwrap();
    }
}

/// How often the purges look for old events when they found few.
const PURGE_EVERY: Duration = Duration::from_secs(10);

/// The raw loop's retention: deletes events published more than `keep` ago, 5000 per
/// statement (by the published index the migrations make), then waits when a batch was short.
async fn raw_purge(pool: PgPool, keep: Duration, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let deleted = sqlx::query(
            "DELETE FROM events.outbox WHERE id IN (
                 SELECT id FROM events.outbox
                 WHERE published_at IS NOT NULL
                   AND published_at < now() - $1 * interval '1 second'
                 ORDER BY published_at, id
                 LIMIT 5000)",
        )
        .bind(keep.as_secs_f64())
        .execute(&pool)
        .await
        .unwrap()
        .rows_affected();
        if deleted < 5000 {
            let until = Instant::now() + PURGE_EVERY;
            while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One window: events committed and delivered per second, latency percentiles of the events
/// delivered in it, and the backlog at its end.
async fn measure(pool: &PgPool, meter: &Meter, window: u32, phase: &str) {
    meter.latencies.lock().unwrap().clear();
    let (committed, delivered) = (last_id(pool).await, meter.delivered.load(Ordering::Relaxed));
    let start = Instant::now();
    tokio::time::sleep(WINDOW).await;
    let seconds = start.elapsed().as_secs_f64();
    let offered = (last_id(pool).await - committed) as f64 / seconds;
    let delivered = (meter.delivered.load(Ordering::Relaxed) - delivered) as f64 / seconds;
    let mut latencies = meter.latencies.lock().unwrap().clone();
    latencies.sort();
    let backlog: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE published_at IS NULL")
            .fetch_one(pool)
            .await
            .unwrap();
    // (With its indexes and TOAST, as in `report_tables`: when a vacuum gives space back.)
    let size: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT coalesce(sum(pg_total_relation_size(oid)), 0)::int8 FROM ({LEAVES}) AS leaves"
    )))
    .bind("events.outbox")
    .fetch_one(pool)
    .await
    .unwrap();
    println!(
        "    {window:>6}  {phase:<8}  {offered:>9.0}  {delivered:>11.0}  {:>6.1}  {:>6.1}  {backlog:>7}  {:>9.1}",
        percentile(&latencies, 0.5).as_secs_f64() * 1000.0,
        percentile(&latencies, 0.99).as_secs_f64() * 1000.0,
        size as f64 / 1e6,
    );
}

async fn last_id(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM events.outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The tables that hold the rows of table $1: itself, or its partitions.
const LEAVES: &str =
    "SELECT c.oid FROM pg_class AS c WHERE c.oid = $1::regclass AND c.relkind <> 'p'
     UNION ALL SELECT i.inhrelid FROM pg_inherits AS i WHERE i.inhparent = $1::regclass";

/// Size (with indexes and TOAST) and dead tuples of each table (of its partitions together).
async fn report_tables(pool: &PgPool, when: &str) {
    let mut parts = Vec::new();
    for table in TABLES {
        let query = format!(
            "SELECT coalesce(sum(pg_total_relation_size(leaves.oid)), 0)::int8,
                    coalesce(sum(s.dead_tuple_count), 0)::int8,
                    coalesce(100.0 * sum(s.dead_tuple_len) / nullif(sum(s.table_len), 0), 0)::float8
             FROM ({LEAVES}) AS leaves, LATERAL pgstattuple(leaves.oid::regclass) AS s"
        );
        // A partition dropped between the list and its reading: read again.
        let mut tries = 0;
        let (size, dead, dead_percent): (i64, i64, f64) = loop {
            match sqlx::query_as(sqlx::AssertSqlSafe(query.clone()))
                .bind(table)
                .fetch_one(pool)
                .await
            {
                Ok(row) => break row,
                Err(error) if tries < 5 => {
                    tries += 1;
                    println!("    (reading the tables again: {error})");
                }
                Err(error) => panic!("cannot read the tables: {error}"),
            }
        };
        parts.push(format!(
            "{} {:.1} MB, {dead} dead tuples ({dead_percent:.0}%)",
            table.trim_start_matches("events."),
            size as f64 / 1e6
        ));
    }
    println!("    tables at the {when}: {}", parts.join("; "));
}

/// The raw loop, measuring commit-to-handler latency from the payloads it claims.
async fn raw_relay(pool: PgPool, meter: Meter, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        let delivered = raw_cycle(&pool, RAW_BATCH, false, async |rows: &[(i64, String)]| {
            let mut committed = meter.committed_at.lock().unwrap();
            let mut latencies = meter.latencies.lock().unwrap();
            for (_, payload) in rows {
                let seq = serde_json::from_str::<serde_json::Value>(payload)
                    .ok()
                    .and_then(|v| v["data"]["seq"].as_u64());
                if let Some(at) = seq.and_then(|seq| committed.remove(&seq)) {
                    latencies.push(at.elapsed());
                }
            }
        })
        .await;
        meter.delivered.fetch_add(delivered, Ordering::Relaxed);
        if delivered == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}
