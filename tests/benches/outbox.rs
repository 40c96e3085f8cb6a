//! Throughput and latency of the outbox on PostgreSQL, each figure next to a raw-SQL baseline
//! measured in the same process and run, and their ratio.
//!
//! ```sh
//! cargo bench -p outbox-tests --bench outbox                      # every scenario
//! cargo bench -p outbox-tests --bench outbox -- drain --events 1000000
//! ```
//!
//! Scenarios: `producer`, `drain`, `sustained`, `latency`, `naive`, `soak` (by hand, not in `all`).
//! Options: `--runs N` (3), `--events N` (200000), `--seconds N` (5: length of a producer run),
//! `--window N` (60: how long lag must stay flat in `sustained`), `--soak-minutes N` (10).
//! Each figure is the median of the runs; ours and raw alternate, after a warm-up of the WAL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, router, subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

/// The benchmark's event: a deposit on an account.
#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "Deposited")]
struct Deposited {
    #[outbox(aggregate_id)]
    account: Uuid,
    seq: u64,
    amount: i64,
}

/// Counts deliveries, and the commit-to-handler latency of events whose commit time it knows.
#[derive(Clone, Default)]
struct Meter {
    delivered: Arc<AtomicU64>,
    committed_at: Arc<Mutex<HashMap<u64, Instant>>>,
    latencies: Arc<Mutex<Vec<Duration>>>,
}

#[subscriber(events = [Deposited], name = "ledger")]
struct Ledger(Meter);

impl Handle<Deposited> for Ledger {
    async fn handle(&self, event: &Deposited, _: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.delivered.fetch_add(1, Ordering::Relaxed);
        let committed = self.0.committed_at.lock().unwrap().remove(&event.seq);
        if let Some(at) = committed {
            self.0.latencies.lock().unwrap().push(at.elapsed());
        }
        Ok(())
    }
}

#[router(events = [Deposited])]
struct Bench {
    ledger: Ledger,
}

struct Options {
    scenarios: Vec<String>,
    runs: usize,
    events: u64,
    seconds: u64,
    window: u64,
    soak_minutes: u64,
}

fn options() -> Options {
    let mut options = Options {
        scenarios: Vec::new(),
        runs: 3,
        events: 200_000,
        seconds: 5,
        window: 60,
        soak_minutes: 10,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match arg.as_str() {
            "--bench" => {}
            "--runs" => options.runs = number("--runs") as usize,
            "--events" => options.events = number("--events"),
            "--seconds" => options.seconds = number("--seconds"),
            "--window" => options.window = number("--window"),
            "--soak-minutes" => options.soak_minutes = number("--soak-minutes"),
            scenario if !scenario.starts_with('-') => options.scenarios.push(scenario.to_owned()),
            other => panic!("unknown option {other}"),
        }
    }
    if options.scenarios.is_empty() || options.scenarios.iter().any(|s| s == "all") {
        options.scenarios = ["producer", "drain", "sustained", "latency", "naive"]
            .map(str::to_owned)
            .to_vec();
    }
    options
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn report(name: &str, unit: &str, ours: &[f64], raw: &[f64]) {
    let (o, r) = (median(ours.to_vec()), median(raw.to_vec()));
    println!(
        "{name:<34} ours {o:>10.0} {unit:<9} raw {r:>10.0} {unit:<9} ratio {:.2}   (runs: ours {:?}, raw {:?})",
        o / r,
        ours.iter().map(|v| v.round()).collect::<Vec<_>>(),
        raw.iter().map(|v| v.round()).collect::<Vec<_>>()
    );
}

async fn setup(accounts: usize) -> (TestDb, Outbox<Postgres, Bench>, Vec<Uuid>) {
    let db = TestDb::new().await;
    let pool = db.pool_named("bench", 20).await;
    let outbox: Outbox<Postgres, Bench> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE accounts (id UUID PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let ids: Vec<Uuid> = (0..accounts).map(|_| Uuid::new_v4()).collect();
    sqlx::query("INSERT INTO accounts SELECT unnest($1::uuid[]), 0")
        .bind(&ids)
        .execute(&pool)
        .await
        .unwrap();
    (db, outbox, ids)
}

/// Writes and deletes a few hundred megabytes of WAL, so that the first measured run does not pay
/// for segment creation.
async fn warm_up(pool: &PgPool) {
    sqlx::query("CREATE TABLE IF NOT EXISTS warmup (id BIGINT, payload TEXT)")
        .execute(pool)
        .await
        .unwrap();
    for _ in 0..3 {
        sqlx::query(
            "INSERT INTO warmup SELECT g, repeat('x', 200) FROM generate_series(1, 300000) g",
        )
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("DELETE FROM warmup")
            .execute(pool)
            .await
            .unwrap();
    }
    sqlx::query("DROP TABLE warmup")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("CHECKPOINT").execute(pool).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// (a) producer

/// Commits per second of 16 tasks each running domain update + event + commit.
async fn producer(raw: bool, seconds: u64) -> f64 {
    let (_db, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..16 {
        let (outbox, pool, ids, stop, commits) = (
            outbox.clone(),
            pool.clone(),
            ids.clone(),
            stop.clone(),
            commits.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seq = task as u64 * 1_000_000_000;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let account = ids[fastrand::usize(..ids.len())];
                let event = Deposited {
                    account,
                    seq,
                    amount: 1,
                };
                if raw {
                    let mut tx = pool.begin().await.unwrap();
                    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                        .bind(account)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    let payload = serde_json::json!({
                        "version": 1,
                        "data": event,
                        "metadata": {"causation_id": null, "correlation_id": null},
                    })
                    .to_string();
                    sqlx::query(
                        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ($1, $2, $3, $4::jsonb)",
                    )
                    .bind("account")
                    .bind(account)
                    .bind("Deposited")
                    .bind(payload)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                } else {
                    let mut tx = outbox.begin().await.unwrap();
                    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                        .bind(account)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    tx.publish(&event).await.unwrap();
                    tx.commit().await.unwrap();
                }
                commits.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Let the pool fill and the tasks start, then measure a window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (start, before) = (Instant::now(), commits.load(Ordering::Relaxed));
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let rate = (commits.load(Ordering::Relaxed) - before) as f64 / start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    rate
}

// ---------------------------------------------------------------------------------------------
// (b) drain

async fn prefill(pool: &PgPool, events: u64) {
    // The same payloads `publish` would write, made by the database to keep the set-up short.
    sqlx::query(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'account', a.id, 'Deposited',
                jsonb_build_object('version', 1,
                    'data', jsonb_build_object('account', a.id, 'seq', g, 'amount', 1),
                    'metadata', jsonb_build_object('causation_id', null, 'correlation_id', null))
         FROM generate_series(1, $1) AS g
         JOIN (SELECT id, row_number() OVER () - 1 AS n FROM accounts) AS a
           ON a.n = g % (SELECT count(*) FROM accounts)",
    )
    .bind(i64::try_from(events).unwrap())
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("VACUUM ANALYZE events.outbox")
        .execute(pool)
        .await
        .unwrap();
}

async fn commits(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Events per second to drain a backlog, and relay commits per 100 events.
async fn drain(raw: bool, events: u64) -> (f64, f64) {
    let (_db, outbox, _) = setup(10_000).await;
    let pool = outbox.pool().clone();
    prefill(&pool, events).await;
    let meter = Meter::default();
    // pg_stat_database is updated when a session reports; give the set-up time to be counted.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&pool)
        .await
        .ok();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let commits_before = commits(&pool).await;
    let start = Instant::now();
    if raw {
        loop {
            let mut tx = pool.begin().await.unwrap();
            let rows: Vec<(i64, String)> = sqlx::query_as(
                "SELECT id, payload::text FROM events.outbox
                 WHERE published_at IS NULL ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED",
            )
            .fetch_all(&mut *tx)
            .await
            .unwrap();
            if rows.is_empty() {
                break;
            }
            let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
            meter
                .delivered
                .fetch_add(rows.len() as u64, Ordering::Relaxed);
            sqlx::query("UPDATE events.outbox SET published_at = now() WHERE id = ANY($1)")
                .bind(&ids)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
    } else {
        let relay = Relay::new(
            outbox.store(),
            Bench {
                ledger: Ledger(meter.clone()),
            },
            RelayConfig::default().with_batch_size(500),
        )
        .unwrap();
        while relay.run_once().await.unwrap().claimed > 0 {}
    }
    let elapsed = start.elapsed().as_secs_f64();
    assert_eq!(
        meter.delivered.load(Ordering::Relaxed),
        events,
        "every event delivered"
    );
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&pool)
        .await
        .ok();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let relay_commits = (commits(&pool).await - commits_before) as f64;
    (
        events as f64 / elapsed,
        relay_commits / events as f64 * 100.0,
    )
}

// ---------------------------------------------------------------------------------------------
// (c) sustained, (d) latency: producers at a fixed rate while a relay delivers

/// Producers committing `rate` events per second in total, until `stop`; the commit time of each
/// event goes to `meter` when `measure_latency`.
fn spawn_producers(
    outbox: &Outbox<Postgres, Bench>,
    ids: &[Uuid],
    rate: f64,
    raw: bool,
    meter: &Meter,
    measure_latency: bool,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let tasks: u32 = 8;
    let interval = Duration::from_secs_f64(f64::from(tasks) / rate);
    (0..tasks)
        .map(|task| {
            let (outbox, ids, meter, stop) =
                (outbox.clone(), ids.to_vec(), meter.clone(), stop.clone());
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut seq = u64::from(task) * 1_000_000_000;
                while !stop.load(Ordering::Relaxed) {
                    ticker.tick().await;
                    seq += 1;
                    let account = ids[fastrand::usize(..ids.len())];
                    let event = Deposited { account, seq, amount: 1 };
                    let mut tx = outbox.begin().await.unwrap();
                    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                        .bind(account)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    if raw {
                        let payload = outbox_core::encode(&event, &outbox_core::Metadata::new())
                            .unwrap();
                        sqlx::query(
                            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
                             VALUES ('account', $1, 'Deposited', $2::jsonb)",
                        )
                        .bind(account)
                        .bind(payload)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    } else {
                        tx.publish(&event).await.unwrap();
                    }
                    tx.commit().await.unwrap();
                    if measure_latency {
                        meter.committed_at.lock().unwrap().insert(seq, Instant::now());
                    }
                }
            })
        })
        .collect()
}

/// The raw relay loop: claim 500 with `FOR UPDATE SKIP LOCKED`, mark them, commit; when it finds
/// nothing, wait for the poll interval.
async fn raw_relay(pool: PgPool, meter: Meter, stop: Arc<AtomicBool>, poll: Duration) {
    while !stop.load(Ordering::Relaxed) {
        let mut tx = pool.begin().await.unwrap();
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, payload::text FROM events.outbox
             WHERE published_at IS NULL ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        if rows.is_empty() {
            tx.commit().await.unwrap();
            tokio::time::sleep(poll).await;
            continue;
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        meter
            .delivered
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        sqlx::query("UPDATE events.outbox SET published_at = now() WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}

async fn pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE published_at IS NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs producers at `rate` with a relay for `window`; returns (achieved rate, backlog growth in
/// events over the window, the meter).
async fn steady(
    raw: bool,
    rate: f64,
    window: Duration,
    measure_latency: bool,
) -> (f64, i64, Meter) {
    let (_db, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    let meter = Meter::default();
    let stop = Arc::new(AtomicBool::new(false));
    let relay_task = if raw {
        tokio::spawn(raw_relay(
            pool.clone(),
            meter.clone(),
            stop.clone(),
            Duration::from_millis(2),
        ))
    } else {
        let relay = Relay::new(
            outbox.store(),
            Bench {
                ledger: Ledger(meter.clone()),
            },
            RelayConfig::default().with_batch_size(500),
        )
        .unwrap();
        let stop = stop.clone();
        tokio::spawn(async move {
            relay
                .run(async move {
                    while !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await;
        })
    };
    let producers = spawn_producers(&outbox, &ids, rate, raw, &meter, measure_latency, &stop);
    // Settle, then measure the window.
    tokio::time::sleep(Duration::from_secs(2)).await;
    meter.latencies.lock().unwrap().clear();
    let (start, backlog_before, delivered_before) = (
        Instant::now(),
        pending(&pool).await,
        meter.delivered.load(Ordering::Relaxed),
    );
    let committed_before = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events.outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    tokio::time::sleep(window).await;
    let committed = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM events.outbox")
        .fetch_one(&pool)
        .await
        .unwrap()
        - committed_before;
    let growth = pending(&pool).await - backlog_before;
    let _ = delivered_before;
    let achieved = committed as f64 / start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for task in producers {
        task.await.unwrap();
    }
    relay_task.await.unwrap();
    (achieved, growth, meter)
}

/// The highest rate at which the backlog grows by less than one second of production over the
/// window: a search between 50 events/s and the producers' ceiling.
async fn sustained(raw: bool, window: Duration, ceiling: f64) -> f64 {
    let (mut low, mut high) = (50.0_f64, ceiling * 1.1);
    let mut best = 0.0_f64;
    for _ in 0..6 {
        let rate = (low + high) / 2.0;
        let (achieved, growth, _) = steady(raw, rate, window, false).await;
        let flat = (growth as f64) < achieved.max(1.0) && achieved > rate * 0.9;
        println!(
            "    {} at {rate:>6.0}/s: achieved {achieved:>6.0}/s, backlog {growth:+} -> {}",
            if raw { "raw " } else { "ours" },
            if flat { "flat" } else { "growing" }
        );
        if flat {
            best = best.max(achieved);
            low = rate;
        } else {
            high = rate;
        }
    }
    best
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index]
}

async fn latency(rate: f64, window: Duration) -> (Duration, Duration, Duration, usize) {
    let (_, _, meter) = steady(false, rate, window, true).await;
    let mut latencies = meter.latencies.lock().unwrap().clone();
    latencies.sort();
    (
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default(),
        latencies.len(),
    )
}

// ---------------------------------------------------------------------------------------------
// (e) the seed's naive poller

/// The seed's poller: every 2 s, 50 rows, one UPDATE per row. Returns events per second over
/// `events` events.
async fn naive(events: u64) -> f64 {
    let (_db, outbox, _) = setup(100).await;
    let pool = outbox.pool().clone();
    prefill(&pool, events).await;
    let start = Instant::now();
    let mut done = 0;
    let mut ticker = tokio::time::interval(Duration::from_secs(2));
    while done < events {
        ticker.tick().await;
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, payload::text FROM events.outbox WHERE published_at IS NULL
             AND (next_retry_at IS NULL OR next_retry_at <= now()) ORDER BY id ASC LIMIT 50",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        for (id, _) in rows {
            sqlx::query("UPDATE events.outbox SET published_at = now() WHERE id = $1")
                .bind(id)
                .execute(&pool)
                .await
                .unwrap();
            done += 1;
        }
    }
    events as f64 / start.elapsed().as_secs_f64()
}

// ---------------------------------------------------------------------------------------------
// soak

async fn table_size(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT pg_table_size('events.outbox'), pg_indexes_size('events.outbox')")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Half capacity for `minutes`, with retention deleting what was published more than a minute
/// ago; prints throughput and sizes each minute.
async fn soak(rate: f64, minutes: u64) {
    let (_db, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    let meter = Meter::default();
    let stop = Arc::new(AtomicBool::new(false));
    let relay = Relay::new(
        outbox.store(),
        Bench {
            ledger: Ledger(meter.clone()),
        },
        RelayConfig::default().with_batch_size(500),
    )
    .unwrap();
    let relay_stop = stop.clone();
    let relay_task = tokio::spawn(async move {
        relay
            .run(async move {
                while !relay_stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
    });
    let retention_outbox = outbox.clone();
    let retention_stop = stop.clone();
    let retention = tokio::spawn(async move {
        while !retention_stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(10)).await;
            retention_outbox
                .purge_published(Duration::from_secs(60), 5_000)
                .await
                .unwrap();
        }
    });
    let producers = spawn_producers(&outbox, &ids, rate, false, &meter, false, &stop);
    println!("    minute  delivered/s  backlog  table MB  indexes MB");
    let mut rates = Vec::new();
    for minute in 1..=minutes {
        let before = meter.delivered.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(60)).await;
        let per_second = (meter.delivered.load(Ordering::Relaxed) - before) as f64 / 60.0;
        let (table, indexes) = table_size(&pool).await;
        println!(
            "    {minute:>6}  {per_second:>11.0}  {:>7}  {:>8.1}  {:>10.1}",
            pending(&pool).await,
            table as f64 / 1e6,
            indexes as f64 / 1e6
        );
        rates.push(per_second);
    }
    stop.store(true, Ordering::Relaxed);
    for task in producers {
        task.await.unwrap();
    }
    relay_task.await.unwrap();
    retention.await.unwrap();
    let (first, last) = (rates[0], rates[rates.len() - 1]);
    println!(
        "    throughput drift first to last minute: {:+.1}%",
        (last - first) / first * 100.0
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let options = options();
    {
        let db = TestDb::new().await;
        println!("warming up the WAL...");
        warm_up(&db.pool).await;
    }
    println!(
        "median of {} runs; ours and raw alternate within one process",
        options.runs
    );
    for scenario in &options.scenarios {
        match scenario.as_str() {
            "producer" => {
                let (mut ours, mut raw) = (Vec::new(), Vec::new());
                for _ in 0..options.runs {
                    ours.push(producer(false, options.seconds).await);
                    raw.push(producer(true, options.seconds).await);
                }
                report("(a) producer, 16 tasks", "commits/s", &ours, &raw);
            }
            "drain" => {
                let (mut ours, mut raw, mut ours_commits) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..options.runs {
                    let (rate, commits) = drain(false, options.events).await;
                    ours.push(rate);
                    ours_commits.push(commits);
                    raw.push(drain(true, options.events).await.0);
                }
                report(
                    &format!("(b) drain {} events", options.events),
                    "events/s",
                    &ours,
                    &raw,
                );
                println!(
                    "    relay commits per 100 events (ours): {:.2}",
                    median(ours_commits)
                );
            }
            "sustained" => {
                let ceiling = producer(false, options.seconds).await;
                let window = Duration::from_secs(options.window);
                let (mut ours, mut raw) = (Vec::new(), Vec::new());
                for _ in 0..options.runs {
                    ours.push(sustained(false, window, ceiling).await);
                    raw.push(sustained(true, window, ceiling).await);
                }
                report(
                    &format!("(c) sustained, flat for {} s", options.window),
                    "events/s",
                    &ours,
                    &raw,
                );
            }
            "latency" => {
                let window = Duration::from_secs(options.seconds.max(10));
                let half = sustained_half(&options).await;
                for rate in [10.0, half] {
                    let mut runs = Vec::new();
                    for _ in 0..options.runs {
                        runs.push(latency(rate, window).await);
                    }
                    let pick = |f: fn(&(Duration, Duration, Duration, usize)) -> Duration| {
                        median(runs.iter().map(|r| f(r).as_secs_f64() * 1e3).collect())
                    };
                    println!(
                        "(d) latency at {rate:>5.0} events/s       p50 {:>6.2} ms  p99 {:>6.2} ms  max {:>7.2} ms   ({} events per run)",
                        pick(|r| r.0),
                        pick(|r| r.1),
                        pick(|r| r.2),
                        runs[0].3
                    );
                }
            }
            "naive" => {
                let mut runs = Vec::new();
                for _ in 0..options.runs {
                    runs.push(naive(500).await);
                }
                println!(
                    "(e) naive seed poller (2 s, 50 rows, one UPDATE each)  {:>6.1} events/s",
                    median(runs)
                );
            }
            "soak" => {
                let half = sustained_half(&options).await;
                println!(
                    "soak at {half:.0} events/s for {} minutes",
                    options.soak_minutes
                );
                soak(half, options.soak_minutes).await;
            }
            other => panic!("unknown scenario {other}"),
        }
    }
}

/// Half the sustained rate: measured once with a short window, or given by `OUTBOX_BENCH_HALF`.
async fn sustained_half(options: &Options) -> f64 {
    if let Some(rate) = std::env::var("OUTBOX_BENCH_HALF")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return rate;
    }
    let ceiling = producer(false, options.seconds).await;
    sustained(false, Duration::from_secs(10), ceiling).await / 2.0
}
