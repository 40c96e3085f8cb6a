//! Throughput and latency of the outbox on PostgreSQL, each figure next to a raw-SQL baseline
//! measured in the same process and run, and their ratio.
//!
//! ```sh
//! cargo bench -p outbox-tests --bench outbox                      # every scenario
//! cargo bench -p outbox-tests --bench outbox -- drain --events 1000000
//! ```
//!
//! Scenarios: `producer`, `drain`, `sustained`, `latency`, `naive`, `handlers` (f), `computing`
//! (f'), `writes` (g), `failures`, `transactional` (h), `nats` (i: needs a NATS server with JetStream at
//! 127.0.0.1:4222 or `NATS_URL`), `mysql` (j: producer and drain on MySQL / MariaDB at
//! 127.0.0.1:3306 or `MYSQL_URL`), `sqlite` (k: producer and drain on a SQLite file), and by
//! hand, not in `all`: `soak`, `pressure` (a held snapshot at half capacity).
//! Options: `--runs N` (3), `--events N` (200000), `--seconds N` (5: length of a producer run),
//! `--window N` (60: how long lag must stay flat in `sustained`), `--soak-minutes N` (10),
//! `--pressure-minutes N` (5), `--retention S` (in `pressure`: published events are deleted
//! S seconds after, by our relay's retention and by a purge beside the raw loop; without it,
//! the default 30 days and nothing),
//! `--batch N` and `--concurrency N` (the relay's settings in `handlers`, `computing`, `writes`,
//! `failures`, `transactional`, `nats` and the tuned `drain`; the defaults otherwise), `--raw-batch N` (500:
//! how many events a cycle of the raw loop claims in `drain`).
//! Each figure is the median of the runs, after a warm-up of the WAL. Within a run, ours and raw
//! alternate in half-second slices on one database (producer, drain), or probe by probe
//! (sustained), so that the machine's noise falls on both alike.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::store::{
    Batch, ClaimFilter, Outcomes, Purged, Recorded, Registry, Requeue, Status,
};
use outbox_core::{
    ClaimToken, Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, Retention, Store,
    StoreError, router, subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use serde::{Deserialize, Serialize};

#[path = "outbox/mysql.rs"]
mod mysql;
#[path = "outbox/nats.rs"]
mod nats;
#[path = "outbox/pressure.rs"]
mod pressure;
#[path = "outbox/sqlite.rs"]
mod sqlite;
#[path = "outbox/work.rs"]
mod work;
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

/// A relay over `store` whose one subscriber counts its deliveries on `meter`.
fn bench_relay<S: Store>(store: S, meter: &Meter, config: RelayConfig) -> Relay<S, Bench> {
    Relay::new(
        store,
        Bench {
            ledger: Ledger(meter.clone()),
        },
        config,
    )
    .unwrap()
}

struct Options {
    scenarios: Vec<String>,
    runs: usize,
    events: u64,
    seconds: u64,
    window: u64,
    soak_minutes: u64,
    pressure_minutes: u64,
    retention: Option<u64>,
    partition: Option<u64>,
    batch: Option<u32>,
    concurrency: Option<usize>,
    raw_batch: i64,
}

impl Options {
    /// The relay's settings for the scenarios that take `--batch` and `--concurrency`.
    fn config(&self) -> RelayConfig {
        let mut config = RelayConfig::default();
        if let Some(batch) = self.batch {
            config = config.with_batch_size(batch);
        }
        if let Some(concurrency) = self.concurrency {
            config = config.with_concurrency(concurrency);
        }
        config
    }
}

/// The scenarios of `all`, in the order they run.
const ALL: [&str; 13] = [
    "producer",
    "drain",
    "sustained",
    "latency",
    "naive",
    "handlers",
    "computing",
    "writes",
    "failures",
    "transactional",
    "nats",
    "mysql",
    "sqlite",
];
/// The scenarios run only when named.
const BY_HAND: [&str; 2] = ["soak", "pressure"];

/// What `--help` prints (the options of this file's documentation).
const USAGE: &str = "\
usage: cargo bench -p outbox-tests --bench outbox -- [SCENARIO...] [OPTION...]

scenarios: producer, drain, sustained, latency, naive, handlers (f), computing (f'), writes (g),
  failures (2b), transactional (h), nats (i), mysql (j), sqlite (k), all (these, the default);
  by hand: soak, pressure
options:
  --runs N              runs per scenario, the median reported (3)
  --events N            events of a drain (200000)
  --seconds N           length of a producer run (5)
  --window N            how long lag must stay flat in `sustained` (60)
  --soak-minutes N      (10)
  --pressure-minutes N  (5)
  --retention S         in pressure: keep published events S seconds (ours: the relay's
                        retention; raw: a purge beside the loop), not the default 30 days
  --partition N         in pressure: ours' events table partitioned by id, N ids a
                        partition (`Outbox::partition_by_id`)
  --batch N             the relay's batch size in handlers, writes, failures, transactional,
                        nats and the tuned drain (the default otherwise)
  --concurrency N       the relay's concurrency, in the same scenarios
  --raw-batch N         how many events a cycle of the raw loop claims in `drain` (500)";

/// Says what is wrong with the command line, and how it goes, and exits.
#[allow(
    clippy::print_stderr,
    reason = "the bench's command line is wrong: said where errors go"
)]
fn usage_error(what: &str) -> ! {
    eprintln!("{what}\n\n{USAGE}");
    std::process::exit(2)
}

fn options() -> Options {
    let mut options = Options {
        scenarios: Vec::new(),
        runs: 3,
        events: 200_000,
        seconds: 5,
        window: 60,
        soak_minutes: 10,
        pressure_minutes: 5,
        retention: None,
        partition: None,
        batch: None,
        concurrency: None,
        raw_batch: RAW_BATCH,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage_error(&format!("{name} takes a number")))
        };
        match arg.as_str() {
            "--bench" => {}
            "--runs" => {
                options.runs = number("--runs") as usize;
                if options.runs == 0 {
                    usage_error("--runs takes 1 or more");
                }
            }
            "--events" => options.events = number("--events"),
            "--seconds" => options.seconds = number("--seconds"),
            "--window" => options.window = number("--window"),
            "--soak-minutes" => options.soak_minutes = number("--soak-minutes"),
            "--pressure-minutes" => options.pressure_minutes = number("--pressure-minutes"),
            "--retention" => options.retention = Some(number("--retention")),
            "--partition" => options.partition = Some(number("--partition")),
            "--batch" => options.batch = Some(number("--batch") as u32),
            "--concurrency" => options.concurrency = Some(number("--concurrency") as usize),
            "--raw-batch" => options.raw_batch = number("--raw-batch") as i64,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            scenario if !scenario.starts_with('-') => options.scenarios.push(scenario.to_owned()),
            other => usage_error(&format!("unknown option {other}")),
        }
    }
    // (Checked before any runs: a misspelt name after a long scenario would waste it.)
    if let Some(unknown) = options
        .scenarios
        .iter()
        .find(|s| !(*s == "all" || ALL.contains(&s.as_str()) || BY_HAND.contains(&s.as_str())))
    {
        usage_error(&format!("unknown scenario {unknown}"));
    }
    if let Err(error) = options.config().validate() {
        usage_error(&error.to_string());
    }
    if options.scenarios.is_empty() || options.scenarios.iter().any(|s| s == "all") {
        options.scenarios = ALL.map(str::to_owned).to_vec();
    }
    options
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Prints the medians of `ours` and `raw` and their ratio, then each run's own ratio (ours and
/// raw of a run alternate within it, so a run's ratio is the one the machine's drift between
/// runs does not move) and their median.
fn report(name: &str, unit: &str, ours: &[f64], raw: &[f64]) {
    let (o, r) = (median(ours.to_vec()), median(raw.to_vec()));
    let per_run: Vec<f64> = ours.iter().zip(raw).map(|(o, r)| o / r).collect();
    println!(
        "{name:<34} ours {o:>10.0} {unit:<9} raw {r:>10.0} {unit:<9} ratio {:.2}   (runs: ours {:?}, raw {:?}; ratio of each run {:?}, median {:.2})",
        o / r,
        ours.iter().map(|v| v.round()).collect::<Vec<_>>(),
        raw.iter().map(|v| v.round()).collect::<Vec<_>>(),
        per_run
            .iter()
            .map(|v| (v * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        median(per_run.clone()),
    );
}

async fn setup(accounts: usize) -> (TestDb, Outbox<Postgres, Bench>, Vec<Uuid>) {
    let db = TestDb::new().await;
    let pool = db.pool_named("bench", 40).await;
    let outbox: Outbox<Postgres, Bench> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    // The seed's index, which the raw loops' query needs. Our claim does not use it (it scans the
    // outbox's own pending index and looks claimed events up by primary key); our producers pay
    // for maintaining it, as the raw producers do.
    sqlx::query(
        "CREATE INDEX outbox_unpublished_idx ON events.outbox (id) WHERE published_at IS NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
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

/// Ours and raw alternate in slices of this length within one measurement, so that the
/// machine's noise falls on both alike.
const SLICE: Duration = Duration::from_millis(500);

/// Commits per second of 16 tasks each running domain update + event + commit, ours and raw
/// alternating every [`SLICE`] on one database for `seconds` each: (ours, raw).
async fn producer(seconds: u64) -> (f64, f64) {
    let (_db, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    alternate_commits(seconds, move |raw, seq| {
        let (outbox, pool) = (outbox.clone(), pool.clone());
        let account = ids[fastrand::usize(..ids.len())];
        async move {
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
        }
    })
    .await
}

/// Commits per second of 16 tasks each calling `commit(raw, seq)` in a loop (`seq` unique per
/// call), ours (`raw` false) and raw alternating every [`SLICE`] for `seconds` each: (ours,
/// raw). A commit counts for the mode it started in.
async fn alternate_commits<F, C>(seconds: u64, commit: F) -> (f64, f64)
where
    F: Fn(bool, u64) -> C + Clone + Send + Sync + 'static,
    C: Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let raw_mode = Arc::new(AtomicBool::new(false));
    let commits = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let mut tasks = Vec::new();
    for task in 0..16 {
        let (commit, stop, raw_mode, commits) = (
            commit.clone(),
            stop.clone(),
            raw_mode.clone(),
            commits.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seq = task as u64 * 1_000_000_000;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let raw = raw_mode.load(Ordering::Relaxed);
                commit(raw, seq).await;
                commits[usize::from(raw)].fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Let the pool fill and the tasks start.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut time = [Duration::ZERO; 2];
    let mut counted = [0_u64; 2];
    let slices = (seconds * 1000 / SLICE.as_millis() as u64).max(1) * 2;
    for slice in 0..slices {
        let raw = slice % 2 == 1;
        raw_mode.store(raw, Ordering::Relaxed);
        // Skip commits that started in the previous slice.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (start, before) = (
            Instant::now(),
            commits[usize::from(raw)].load(Ordering::Relaxed),
        );
        tokio::time::sleep(SLICE).await;
        time[usize::from(raw)] += start.elapsed();
        counted[usize::from(raw)] += commits[usize::from(raw)].load(Ordering::Relaxed) - before;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let rate = |i: usize| counted[i] as f64 / time[i].as_secs_f64();
    (rate(0), rate(1))
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
           ON a.n = g % (SELECT count(*) FROM accounts)
         -- In turn over the accounts, as commits of many aggregates interleave.
         ORDER BY g",
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

/// A store that counts the relay's transactions: each claim and each record is one commit.
struct Counting<S> {
    inner: S,
    commits: Arc<AtomicU64>,
}

impl<S: Store> Store for Counting<S> {
    async fn claim(
        &self,
        limit: outbox_core::store::ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, StoreError> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.inner.claim(limit, lease, filter).await
    }

    async fn register(
        &self,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> Result<Registry, StoreError> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.inner.register(relay, routing, ttl).await
    }

    async fn unregister(&self, relay: Uuid) -> Result<(), StoreError> {
        self.inner.unregister(relay).await
    }

    async fn renew(&self, token: ClaimToken, lease: Duration) -> Result<bool, StoreError> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.inner.renew(token, lease).await
    }

    async fn record(&self, token: ClaimToken, outcomes: &Outcomes) -> Result<Recorded, StoreError> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.inner.record(token, outcomes).await
    }

    // (Forwarded as every other method: without them the relay measured here would record
    // each batch whole, as no relay over the sqlx stores does.)
    async fn record_part(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> Result<Recorded, StoreError> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.inner.record_part(token, outcomes).await
    }

    fn records_parts(&self) -> bool {
        self.inner.records_parts()
    }

    fn claims_take_over(&self) -> bool {
        self.inner.claims_take_over()
    }

    async fn requeue(&self, which: &Requeue) -> Result<u64, StoreError> {
        self.inner.requeue(which).await
    }

    async fn status(&self) -> Result<Status, StoreError> {
        self.inner.status().await
    }

    async fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<Purged, StoreError> {
        self.inner.purge_published(older_than, limit).await
    }

    async fn notified(&self) {
        self.inner.notified().await;
    }
}

/// Drains a backlog of `events`, three ways alternating every [`SLICE`] on the same table:
/// ours (the relay's own loop, `Relay::run`), the raw loop, and the raw loop with asynchronous
/// commit (as our relay commits). Returns events per second of each, and our relay's commits
/// per 100 events.
async fn drain(events: u64, config: RelayConfig, raw_batch: i64) -> ([f64; 3], f64) {
    let (_db, outbox, _) = setup(10_000).await;
    let pool = outbox.pool().clone();
    prefill(&pool, events).await;
    let meter = Meter::default();
    let store = Counting {
        inner: outbox.store(),
        commits: Arc::default(),
    };
    let commits = store.commits.clone();
    let relay = Arc::new(bench_relay(store, &meter, config));
    // The raw loop, committing synchronously or not.
    let raw = |asynchronous: bool| {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move { raw_cycle(&pool, raw_batch, asynchronous, async |_| {}).await }
        }
    };
    let (rates, ours) = alternate_drain(&relay, &meter, events, &[raw(false), raw(true)]).await;
    let unpublished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(unpublished, 0, "every event recorded as published");
    (
        [rates[0], rates[1], rates[2]],
        commits.load(Ordering::Relaxed) as f64 / ours as f64 * 100.0,
    )
}

/// Runs `relay` from `start` until the slice is over or `rest` events are delivered (it records
/// its last batch before returning); returns how many it delivered. In a spawned task, as a
/// service runs its relay: on a runtime worker, which drives the sockets itself, not on the
/// main thread.
async fn relay_slice<S, R>(
    relay: &Arc<Relay<S, R>>,
    meter: &Meter,
    start: Instant,
    rest: u64,
) -> u64
where
    S: Store + Send + Sync + 'static,
    R: outbox_core::Router + Send + Sync + 'static,
{
    let before = meter.delivered.load(Ordering::Relaxed);
    let (relay, meter) = (relay.clone(), meter.clone());
    tokio::spawn(async move {
        relay
            .run(async {
                while start.elapsed() < SLICE && meter.delivered.load(Ordering::Relaxed) < rest {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
        meter.delivered.load(Ordering::Relaxed) - before
    })
    .await
    .unwrap()
}

/// Drains a backlog of `events`: `relay` and raw loops (`raws`, each one cycle of its loop,
/// returning how many events it took) taking turns every [`SLICE`] on the same table, ours
/// first. Returns events per second of ours and of each raw loop, in that order, and how many
/// events ours delivered.
async fn alternate_drain<S, R, F, C>(
    relay: &Arc<Relay<S, R>>,
    meter: &Meter,
    events: u64,
    raws: &[F],
) -> (Vec<f64>, u64)
where
    S: Store + Send + Sync + 'static,
    R: outbox_core::Router + Send + Sync + 'static,
    F: Fn() -> C + Clone + Send + 'static,
    C: Future<Output = u64> + Send,
{
    let modes = raws.len() + 1;
    let (mut time, mut done) = (vec![Duration::ZERO; modes], vec![0_u64; modes]);
    let mut mode = 0;
    loop {
        let start = Instant::now();
        let delivered = if mode == 0 {
            relay_slice(relay, meter, start, events - done[1..].iter().sum::<u64>()).await
        } else {
            let raw = raws[mode - 1].clone();
            tokio::spawn(async move {
                let mut delivered = 0;
                while start.elapsed() < SLICE {
                    let n = raw().await;
                    if n == 0 {
                        break;
                    }
                    delivered += n;
                }
                delivered
            })
            .await
            .unwrap()
        };
        time[mode] += start.elapsed();
        done[mode] += delivered;
        if done.iter().sum::<u64>() >= events {
            break;
        }
        mode = (mode + 1) % modes;
    }
    assert_eq!(done.iter().sum::<u64>(), events, "every event drained once");
    let rates = (0..modes)
        .map(|i| done[i] as f64 / time[i].as_secs_f64())
        .collect();
    (rates, done[0])
}

/// A backend's producer and drain against raw sqlx, as (j) and (k) report them: `producer`
/// runs `runs` times, then `drain` at the defaults and, when `tuned` is given, at those
/// settings too; each row headed by `name`.
async fn producer_and_drain<P, PF, D, DF>(
    name: &str,
    runs: usize,
    events: u64,
    tuned: Option<RelayConfig>,
    producer: P,
    drain: D,
) where
    P: Fn() -> PF,
    PF: Future<Output = (f64, f64)>,
    D: Fn(RelayConfig) -> DF,
    DF: Future<Output = (f64, f64)>,
{
    let (mut ours, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let (o, r) = producer().await;
        ours.push(o);
        raw.push(r);
    }
    report(
        &format!("{name} producer, 16 tasks"),
        "commits/s",
        &ours,
        &raw,
    );
    let settings = std::iter::once(("defaults", RelayConfig::default()))
        .chain(tuned.map(|config| ("as given", config)));
    for (settings, config) in settings {
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let (o, r) = drain(config.clone()).await;
            ours.push(o);
            raw.push(r);
        }
        report(
            &format!(
                "{name} drain {events}, {settings} (batch {})",
                config.batch_size()
            ),
            "events/s",
            &ours,
            &raw,
        );
    }
}

/// How many events a raw cycle claims, unless the drain is given `--raw-batch`.
const RAW_BATCH: i64 = 500;

/// One raw cycle: claim `limit` with `SKIP LOCKED`, hand them to `work`, mark them published,
/// commit; returns how many it claimed.
async fn raw_cycle(
    pool: &PgPool,
    limit: i64,
    asynchronous: bool,
    work: impl AsyncFnOnce(&[(i64, String)]),
) -> u64 {
    let mut tx = pool.begin().await.unwrap();
    if asynchronous {
        sqlx::query("SET LOCAL synchronous_commit = off")
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, payload::text FROM events.outbox
         WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    work(&rows).await;
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    mark_published(tx, &ids).await;
    rows.len() as u64
}

/// The end of a raw cycle: the claimed `ids` marked published, and `tx` committed.
async fn mark_published(mut tx: sqlx::Transaction<'_, Postgres>, ids: &[i64]) {
    sqlx::query("UPDATE events.outbox SET published_at = now() WHERE id = ANY($1)")
        .bind(ids)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
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
    // Enough tasks to offer the rate whatever the commit latency: with 8, the producers, not the
    // relay, set the limit (they fell short of the rate while the backlog stayed flat).
    let tasks: u32 = 32;
    let interval = Duration::from_secs_f64(f64::from(tasks) / rate);
    (0..tasks)
        .map(|task| {
            let (outbox, ids, meter, stop) =
                (outbox.clone(), ids.to_vec(), meter.clone(), stop.clone());
            tokio::spawn(async move {
                // Staggered starts: the tasks together make an even stream, not a burst of one
                // event per task every interval.
                let offset = interval.mul_f64(f64::from(task) / f64::from(tasks));
                let mut ticker =
                    tokio::time::interval_at(tokio::time::Instant::now() + offset, interval);
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
        let delivered = raw_cycle(&pool, RAW_BATCH, false, async |_| {}).await;
        if delivered == 0 {
            tokio::time::sleep(poll).await;
        }
        meter.delivered.fetch_add(delivered, Ordering::Relaxed);
    }
}

/// Our relay on `outbox`, counting deliveries into `meter`, in a task that runs until `stop`.
fn spawn_relay(
    outbox: &Outbox<Postgres, Bench>,
    meter: &Meter,
    stop: &Arc<AtomicBool>,
    config: RelayConfig,
) -> tokio::task::JoinHandle<()> {
    let relay = bench_relay(outbox.store(), meter, config);
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
        spawn_relay(&outbox, &meter, &stop, RelayConfig::default())
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
/// window, for ours and raw: two searches between 50 events/s and the producers' ceiling, whose
/// probes alternate so that the machine's noise falls on both alike.
async fn sustained(window: Duration, ceiling: f64) -> (f64, f64) {
    let mut bounds = [(50.0_f64, ceiling * 1.1); 2];
    let mut best = [0.0_f64; 2];
    for _ in 0..6 {
        for raw in [false, true] {
            let (low, high) = bounds[usize::from(raw)];
            let rate = (low + high) / 2.0;
            let (achieved, growth, _) = steady(raw, rate, window, false).await;
            let growing = (growth as f64) >= achieved.max(1.0);
            // Producers that cannot offer the rate (the machine is busy) fail the probe too: the
            // rate was not sustained end to end.
            let short = achieved <= rate * 0.9;
            let flat = !growing && !short;
            println!(
                "    {} at {rate:>6.0}/s: achieved {achieved:>6.0}/s, backlog {growth:+} -> {}",
                if raw { "raw " } else { "ours" },
                match (growing, short) {
                    (true, _) => "growing",
                    (false, true) => "short of the rate",
                    (false, false) => "flat",
                }
            );
            let i = usize::from(raw);
            if flat {
                best[i] = best[i].max(achieved);
                bounds[i].0 = rate;
            } else {
                bounds[i].1 = rate;
            }
        }
    }
    (best[0], best[1])
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

/// When the server's autovacuum is off (as on this project's machines), vacuums the outbox
/// tables every 10 s until `stop`, at autovacuum's cost limits, as autovacuum would, and says
/// so; `None` when the server vacuums them itself. Deleted and updated rows only become free
/// space once vacuumed: without it a run would measure a server nobody runs.
async fn vacuum_as_autovacuum_would(
    pool: &PgPool,
    stop: &Arc<AtomicBool>,
) -> Option<tokio::task::JoinHandle<()>> {
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
        .fetch_one(pool)
        .await
        .unwrap();
    if autovacuum != "off" {
        return None;
    }
    println!(
        "    autovacuum is off on this server: the bench vacuums the outbox tables every 10 s, \
         at autovacuum's cost limits"
    );
    let mut conn = pool.acquire().await.unwrap().detach();
    for set in [
        "SET vacuum_cost_delay = '2ms'",
        "SET vacuum_cost_limit = 200",
    ] {
        sqlx::raw_sql(set).execute(&mut conn).await.unwrap();
    }
    let stop = stop.clone();
    Some(tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(10)).await;
            sqlx::raw_sql(
                "VACUUM events.outbox, events.outbox_deliveries, events.outbox_claims,
                        events.outbox_claim_parts",
            )
            .execute(&mut conn)
            .await
            .unwrap();
        }
    }))
}

/// Half capacity for `minutes`, with retention deleting what was published more than a minute
/// ago; prints throughput and sizes each minute, the tables vacuumed as autovacuum would.
async fn soak(rate: f64, minutes: u64) {
    let (_db, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    let meter = Meter::default();
    let stop = Arc::new(AtomicBool::new(false));
    // Retention by the relay itself: published events go after a minute.
    let relay_task = spawn_relay(
        &outbox,
        &meter,
        &stop,
        RelayConfig::default().with_retention(
            Retention::keep(Duration::from_secs(60))
                .with_batch_size(5_000)
                .with_interval(Duration::from_secs(10)),
        ),
    );
    let vacuum = vacuum_as_autovacuum_would(&pool, &stop).await;
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
    if let Some(vacuum) = vacuum {
        vacuum.await.unwrap();
    }
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
                    let (o, r) = producer(options.seconds).await;
                    ours.push(o);
                    raw.push(r);
                }
                report("(a) producer, 16 tasks", "commits/s", &ours, &raw);
            }
            "drain" => {
                let (mut ours, mut raw, mut raw_async, mut ours_commits) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for _ in 0..options.runs {
                    let ([o, r, a], commits) =
                        drain(options.events, options.config(), options.raw_batch).await;
                    ours.push(o);
                    raw.push(r);
                    raw_async.push(a);
                    ours_commits.push(commits);
                }
                report(
                    &format!(
                        "(b) drain {} events, batch {} (raw {})",
                        options.events,
                        options.config().batch_size(),
                        options.raw_batch
                    ),
                    "events/s",
                    &ours,
                    &raw,
                );
                report(
                    "    against raw, asynchronous commit",
                    "events/s",
                    &ours,
                    &raw_async,
                );
                println!(
                    "    relay commits per 100 events (ours): {:.2}",
                    median(ours_commits)
                );
            }
            "sustained" => {
                let ceiling = producer(options.seconds).await.0;
                let window = Duration::from_secs(options.window);
                let (mut ours, mut raw) = (Vec::new(), Vec::new());
                for _ in 0..options.runs {
                    let (o, r) = sustained(window, ceiling).await;
                    ours.push(o);
                    raw.push(r);
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
            "handlers" => work::waiting_handlers(options.runs, &options.config()).await,
            "computing" => work::computing_handlers(options.runs, &options.config()).await,
            "writes" => work::writing_handlers(options.runs, &options.config()).await,
            "failures" => work::failing_handlers(options.runs, &options.config()).await,
            "transactional" => {
                work::transactional_handlers(options.runs, &options.config()).await;
            }
            "nats" => nats::relay_to_jetstream(options.runs, &options.config()).await,
            "mysql" => {
                let tuned = (options.batch.is_some() || options.concurrency.is_some())
                    .then(|| options.config());
                mysql::mysql(options.runs, options.seconds, options.events, tuned).await;
            }
            "sqlite" => {
                let tuned = (options.batch.is_some() || options.concurrency.is_some())
                    .then(|| options.config());
                sqlite::sqlite(options.runs, options.seconds, options.events, tuned).await;
            }
            "pressure" => {
                let half = sustained_half(&options).await;
                pressure::pressure(
                    half,
                    options.pressure_minutes,
                    2,
                    options.retention,
                    options.partition,
                )
                .await;
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
    let ceiling = producer(options.seconds).await.0;
    sustained(Duration::from_secs(10), ceiling).await.0 / 2.0
}
