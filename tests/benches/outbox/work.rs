//! Scenarios with handlers that do work: (f) handlers that wait 2 ms, at several concurrencies;
//! (g) handlers that insert a row, against a raw loop doing the same inserts; failures: a share
//! of transient handler failures, against the failure-free drain of the same run; (h) the audit
//! insert made exactly once with `Outbox::handle_once`, against an idempotent insert.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use outbox_core::{
    Delivery, Handle, HandlerError, Relay, RelayConfig, RetryPolicy, Router, router, subscriber,
};
use outbox_sqlx::Outbox;
use sqlx::{PgPool, Postgres};

use super::{Deposited, RAW_BATCH, median, prefill, raw_cycle, setup};

/// What each handler does: fail with a given chance, wait, insert an audit row.
#[derive(Clone, Default)]
struct Work {
    done: Arc<AtomicU64>,
    wait: Duration,
    /// Nanoseconds spent waiting, over all calls.
    waited: Arc<AtomicU64>,
    /// Chance of a transient failure, in per mille.
    fail_per_mille: u32,
    audit: Option<PgPool>,
    /// The audit insert skips an event already audited (`ON CONFLICT DO NOTHING`).
    idempotent: bool,
    /// How long each call computes, holding its thread (a busy loop).
    compute: Duration,
}

impl Work {
    async fn run(&self, event: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        // (A failing call works as long as one that succeeds: a service that fails takes its
        // time to say so.)
        if !self.wait.is_zero() {
            let start = Instant::now();
            precise_sleep(self.wait).await;
            let waited = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.waited.fetch_add(waited, Ordering::Relaxed);
        }
        if !self.compute.is_zero() {
            let start = Instant::now();
            while start.elapsed() < self.compute {
                std::hint::spin_loop();
            }
        }
        if self.fail_per_mille > 0 && fastrand::u32(0..1000) < self.fail_per_mille {
            return Err(HandlerError::transient("injected failure"));
        }
        if let Some(pool) = &self.audit {
            let insert = if self.idempotent {
                "INSERT INTO audit (event_id, seq) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            } else {
                INSERT_AUDIT
            };
            sqlx::query(insert)
                .bind(delivery.event().id)
                .bind(i64::try_from(event.seq).unwrap())
                .execute(pool)
                .await
                .map_err(HandlerError::transient)?;
        }
        self.done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Waits `wait` to the OS's precision (tens of microseconds), for many waits at once: one
/// thread sleeps until the earliest deadline and wakes every wait that is due. tokio's timer
/// fires on the millisecond tick after a deadline, so its "2 ms" takes 2 to 3 ms, and (f) would
/// measure that; a blocking thread per wait keeps time but costs two thread hand-offs per call,
/// which at 64 000 waits a second on two cores is the bench measuring itself.
///
/// The timer thread stands in for the services the handlers call, which answer in their own
/// time whatever this machine is doing: it runs at a real-time priority where the OS allows
/// it. At normal priority, on two cores kept busy by the relay and the server, it woke the
/// waits 0.13-0.18 ms late at concurrency 128 (a tenth of the call), against 0.01 ms so.
/// [`timer_lateness`] tells how late it fired, and whether it had that priority.
async fn precise_sleep(wait: Duration) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let at = Instant::now() + wait;
    let timer = timer();
    {
        let mut due = timer.due.lock().unwrap();
        let earliest = due.peek().is_none_or(|first| at < first.0.at);
        due.push(Reverse(Due { at, tx }));
        if earliest {
            timer.changed.notify_one();
        }
    }
    // The timer thread lives as long as the process: the sender is never dropped unsent.
    let _ = rx.await;
}

struct Due {
    at: Instant,
    tx: tokio::sync::oneshot::Sender<()>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

struct Timer {
    due: Mutex<BinaryHeap<Reverse<Due>>>,
    changed: Condvar,
    /// Whether the timer thread runs at a real-time priority.
    realtime: AtomicBool,
    /// Waits woken, and how late, in nanoseconds after their deadlines, in all.
    fired: AtomicU64,
    late: AtomicU64,
}

/// How many waits the timer woke, how late in all, and whether it ran at a real-time
/// priority; the difference of two readings is what happened between them.
fn timer_lateness() -> (u64, Duration, bool) {
    let timer = timer();
    (
        timer.fired.load(Ordering::Relaxed),
        Duration::from_nanos(timer.late.load(Ordering::Relaxed)),
        timer.realtime.load(Ordering::Relaxed),
    )
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            due: Mutex::new(BinaryHeap::new()),
            changed: Condvar::new(),
            realtime: AtomicBool::new(false),
            fired: AtomicU64::new(0),
            late: AtomicU64::new(0),
        }));
        std::thread::Builder::new()
            .name("bench-timer".into())
            .spawn(move || {
                // (The lowest real-time priority: above every thread of normal priority. It
                // needs the privilege to; without, the thread keeps its priority.)
                let realtime = thread_priority::set_thread_priority_and_policy(
                    thread_priority::thread_native_id(),
                    thread_priority::ThreadPriority::Min,
                    thread_priority::ThreadSchedulePolicy::Realtime(
                        thread_priority::RealtimeThreadSchedulePolicy::Fifo,
                    ),
                )
                .is_ok();
                timer.realtime.store(realtime, Ordering::Relaxed);
                let mut fired = Vec::new();
                let mut due = timer.due.lock().unwrap();
                loop {
                    let now = Instant::now();
                    while due.peek().is_some_and(|first| first.0.at <= now) {
                        let Reverse(Due { at, tx }) = due.pop().unwrap();
                        let late = u64::try_from((now - at).as_nanos()).unwrap_or(u64::MAX);
                        timer.late.fetch_add(late, Ordering::Relaxed);
                        timer.fired.fetch_add(1, Ordering::Relaxed);
                        fired.push(tx);
                    }
                    let next = due.peek().map(|first| first.0.at - now);
                    if !fired.is_empty() {
                        // Wake the waits outside the lock, so new waits are not held up.
                        drop(due);
                        for tx in fired.drain(..) {
                            let _ = tx.send(());
                        }
                        due = timer.due.lock().unwrap();
                        continue;
                    }
                    due = match next {
                        Some(wait) => timer.changed.wait_timeout(due, wait).unwrap().0,
                        None => timer.changed.wait(due).unwrap(),
                    };
                }
            })
            .unwrap();
        timer
    })
}

const INSERT_AUDIT: &str = "INSERT INTO audit (event_id, seq) VALUES ($1, $2)";

async fn insert_audit(pool: &PgPool, event_id: i64, seq: u64) -> Result<(), sqlx::Error> {
    sqlx::query(INSERT_AUDIT)
        .bind(event_id)
        .bind(i64::try_from(seq).unwrap())
        .execute(pool)
        .await
        .map(|_| ())
}

macro_rules! workers {
    ($($name:ident = $label:literal),*) => {$(
        #[subscriber(events = [Deposited], name = $label)]
        struct $name(Work);

        impl Handle<Deposited> for $name {
            async fn handle(&self, event: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
                self.0.run(event, delivery).await
            }
        }
    )*};
}

workers!(Audit = "audit", Notify = "notify", License = "license");

#[router(events = [Deposited])]
struct Three {
    audit: Audit,
    notify: Notify,
    license: License,
}

#[router(events = [Deposited])]
struct One {
    audit: Audit,
}

/// The audit insert, plain, made exactly once: in `handle_once`'s transaction with the inbox
/// record of the delivery.
#[subscriber(events = [Deposited], name = "audit")]
struct OnceAudit {
    outbox: Outbox<Postgres, Once>,
    done: Arc<AtomicU64>,
}

impl Handle<Deposited> for OnceAudit {
    async fn handle(&self, event: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.outbox
            .handle_once(delivery, |mut tx| async move {
                sqlx::query(INSERT_AUDIT)
                    .bind(delivery.event().id)
                    .bind(i64::try_from(event.seq).unwrap())
                    .execute(&mut *tx)
                    .await?;
                Ok(tx)
            })
            .await?;
        self.done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[router(events = [Deposited])]
struct Once {
    audit: OnceAudit,
}

fn three(work: &Work) -> Three {
    Three {
        audit: Audit(work.clone()),
        notify: Notify(work.clone()),
        license: License(work.clone()),
    }
}

/// Drains `events` prefilled events over `accounts` aggregates with `router`; returns events/s.
async fn drain_with<R: Router + Send + Sync + 'static>(
    events: u64,
    accounts: usize,
    subscribers: u64,
    config: RelayConfig,
    router: impl FnOnce(&Work) -> R,
    mut work: Work,
    audit_table: bool,
) -> f64 {
    let (_db, outbox, _) = setup(accounts).await;
    let pool = outbox.pool().clone();
    prefill(&pool, events).await;
    if audit_table {
        create_audit(&pool).await;
        work.audit = Some(pool.clone());
    }
    let done = work.done.clone();
    let relay = Relay::new(outbox.store(), router(&work), config).unwrap();
    let target = events * subscribers;
    let start = Instant::now();
    // In a spawned task, as a service runs its relay: on a runtime worker, which drives the
    // sockets and timers itself, not on the main thread.
    let watched = done.clone();
    tokio::spawn(async move {
        relay
            .run(async {
                while watched.load(Ordering::Relaxed) < target {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
    })
    .await
    .unwrap();
    let elapsed = start.elapsed();
    assert_eq!(
        done.load(Ordering::Relaxed),
        target,
        "every delivery made once"
    );
    events as f64 / elapsed.as_secs_f64()
}

async fn create_audit(pool: &PgPool) {
    // Keyed by event: a second insert of an event fails, unless it is idempotent.
    sqlx::query("CREATE TABLE audit (event_id BIGINT PRIMARY KEY, seq BIGINT NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

/// (f): three subscribers whose handlers await a 2 ms timer (the OS's, which keeps time to
/// tens of microseconds), 20 000 events over 1 000
/// aggregates, at concurrency 1, 8, 32 and 128, each next to the ideal
/// min(concurrency / 2 ms / 3, the no-op drain of the same settings).
pub(crate) async fn waiting_handlers(runs: usize, config: &RelayConfig) {
    const EVENTS: u64 = 20_000;
    const WAIT: Duration = Duration::from_millis(2);
    let mut noop = Vec::new();
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); 4];
    // Milliseconds per wait, as the handlers measured them.
    let mut waits: Vec<Vec<f64>> = vec![Vec::new(); 4];
    // Milliseconds the timer woke a wait after its deadline, on average.
    let mut late: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let concurrencies = [1, 8, 32, 128];
    for _ in 0..runs {
        let noop_config = config.clone().with_concurrency(128);
        noop.push(drain_with(EVENTS, 1000, 3, noop_config, three, Work::default(), false).await);
        for (i, &concurrency) in concurrencies.iter().enumerate() {
            // At concurrency 1, a tenth of the events: the ideal is 167 events/s.
            let events = if concurrency == 1 {
                EVENTS / 10
            } else {
                EVENTS
            };
            let work = Work {
                wait: WAIT,
                ..Work::default()
            };
            let (done, waited) = (work.done.clone(), work.waited.clone());
            let config = config.clone().with_concurrency(concurrency);
            let (fired, late_before, _) = timer_lateness();
            rates[i].push(drain_with(events, 1000, 3, config, three, work, false).await);
            let (fired_after, late_after, _) = timer_lateness();
            late[i].push(
                (late_after - late_before).as_secs_f64() * 1e3
                    / (fired_after - fired).max(1) as f64,
            );
            waits[i].push(
                waited.load(Ordering::Relaxed) as f64 / done.load(Ordering::Relaxed) as f64 / 1e6,
            );
        }
    }
    let noop = median(noop);
    let priority = match timer_lateness().2 {
        true => "real-time",
        false => "normal (no privilege for real-time)",
    };
    println!(
        "(f) 2 ms handlers x 3 subscribers, 20000 events / 1000 aggregates (no-op drain {noop:.0} events/s; the timer thread at {priority} priority)"
    );
    for (i, concurrency) in concurrencies.into_iter().enumerate() {
        let ideal = (concurrency as f64 / WAIT.as_secs_f64() / 3.0).min(noop);
        let ours = median(rates[i].clone());
        println!(
            "    concurrency {concurrency:>3}   ours {ours:>8.0} events/s   ideal {ideal:>8.0}   ratio {:.2}   (runs {:?}; a wait took {:.2} ms, the timer fired {:.3} ms late)",
            ours / ideal,
            rates[i].iter().map(|v| v.round()).collect::<Vec<_>>(),
            median(waits[i].clone()),
            median(late[i].clone())
        );
    }
}

/// (g): one subscriber whose handler inserts an audit row on its own pool, against a raw loop
/// that claims the same events with `SKIP LOCKED` and makes the same inserts at the same
/// concurrency.
pub(crate) async fn writing_handlers(runs: usize, config: &RelayConfig) {
    const EVENTS: u64 = 20_000;
    let concurrency = config.concurrency();
    let (mut ours, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        ours.push(
            drain_with(
                EVENTS,
                1000,
                1,
                config.clone(),
                |work| One {
                    audit: Audit(work.clone()),
                },
                Work::default(),
                true,
            )
            .await,
        );
        raw.push(tokio::spawn(raw_writes(EVENTS, concurrency)).await.unwrap());
    }
    super::report(
        &format!("(g) audit insert per event, concurrency {concurrency}"),
        "events/s",
        &ours,
        &raw,
    );
}

/// The raw loop of (g): claim 500 with `SKIP LOCKED`, insert their audit rows `concurrency` at a
/// time on another pool, mark them published, commit.
async fn raw_writes(events: u64, concurrency: usize) -> f64 {
    let (_db, outbox, _) = setup(1000).await;
    let pool = outbox.pool().clone();
    prefill(&pool, events).await;
    create_audit(&pool).await;
    let start = Instant::now();
    let mut done = 0;
    while done < events {
        let pool = &pool;
        done += raw_cycle(pool, RAW_BATCH, false, async |rows| {
            futures_util::stream::iter(rows)
                .for_each_concurrent(concurrency, |(id, payload)| async move {
                    let event: serde_json::Value = serde_json::from_str(payload).unwrap();
                    let seq = event["data"]["seq"].as_u64().unwrap();
                    insert_audit(pool, *id, seq).await.unwrap();
                })
                .await;
        })
        .await;
    }
    events as f64 / start.elapsed().as_secs_f64()
}

/// (f'): three subscribers whose handlers compute for 200 us each (a busy loop that holds its
/// thread, as serializing, hashing or rendering does), 5 000 events over 1 000 aggregates, at the
/// given settings, against what one thread can compute: 1 / (3 x 200 us) events/s. The bench
/// runs on two worker threads.
pub(crate) async fn computing_handlers(runs: usize, config: &RelayConfig) {
    const EVENTS: u64 = 5_000;
    const COMPUTE: Duration = Duration::from_micros(200);
    let one_thread = 1.0 / COMPUTE.as_secs_f64() / 3.0;
    let mut rates = Vec::new();
    for _ in 0..runs {
        let work = Work {
            compute: COMPUTE,
            ..Work::default()
        };
        rates.push(drain_with(EVENTS, 1000, 3, config.clone(), three, work, false).await);
    }
    let rate = median(rates.clone());
    println!(
        "(f') handlers computing 200 us x 3 subscribers, 5000 events / 1000 aggregates, concurrency {}: {rate:>6.0} events/s   one thread's ceiling {one_thread:.0}   ratio {:.2}   (runs {:?})",
        config.concurrency(),
        rate / one_thread,
        rates.iter().map(|v| v.round()).collect::<Vec<_>>(),
    );
}

/// (h): one subscriber's audit insert, exactly once (a plain insert in `handle_once`: a
/// transaction per delivery with the claim's lock and the inbox record) against the same insert
/// made idempotent (`ON CONFLICT DO NOTHING` on the pool), 20 000 events over 1 000 aggregates,
/// at the given settings.
pub(crate) async fn transactional_handlers(runs: usize, config: &RelayConfig) {
    const EVENTS: u64 = 20_000;
    let (mut once, mut idempotent) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let work = Work::default();
        once.push(
            drain_with(
                EVENTS,
                1000,
                1,
                config.clone(),
                |work| Once {
                    audit: OnceAudit {
                        outbox: Outbox::new(work.audit.clone().unwrap()),
                        done: work.done.clone(),
                    },
                },
                work,
                true,
            )
            .await,
        );
        let work = Work {
            idempotent: true,
            ..Work::default()
        };
        idempotent.push(
            drain_with(
                EVENTS,
                1000,
                1,
                config.clone(),
                |work| One {
                    audit: Audit(work.clone()),
                },
                work,
                true,
            )
            .await,
        );
    }
    let (o, i) = (median(once.clone()), median(idempotent.clone()));
    println!(
        "(h) audit insert per event, concurrency {}: exactly once (handle_once) {o:>7.0} events/s   idempotent {i:>7.0} events/s   ratio {:.2}   (runs {:?} / {:?})",
        config.concurrency(),
        o / i,
        once.iter().map(|v| v.round()).collect::<Vec<_>>(),
        idempotent.iter().map(|v| v.round()).collect::<Vec<_>>(),
    );
}

/// Drains with 1% and 10% transient failures (retried after 10 ms), 20 000 events over 100
/// aggregates and three subscribers, against the failure-free drain of the same run: at the
/// given settings (retries that short are made in place by default), with retries in place off
/// (every failure written down as a delivery row and claimed again), and with handlers that
/// work 2 ms per call (as in (f); a failing call fails after its 2 ms), against the
/// failure-free drain of those.
pub(crate) async fn failing_handlers(runs: usize, config: &RelayConfig) {
    const EVENTS: u64 = 20_000;
    const WORK: Duration = Duration::from_millis(2);
    let retry = RetryPolicy::new([Duration::from_millis(10); 100]).unwrap();
    let config = config.clone().with_retry(retry);
    let rows = config.clone().with_retry_in_place(Duration::ZERO);
    // (name, failures per mille, settings, work per call, the case its ratio is to)
    let cases = [
        ("no failures", 0, &config, Duration::ZERO, 0),
        ("1% failures", 10, &config, Duration::ZERO, 0),
        ("10% failures", 100, &config, Duration::ZERO, 0),
        (
            "1% failures, no retry in place",
            10,
            &rows,
            Duration::ZERO,
            0,
        ),
        (
            "10% failures, no retry in place",
            100,
            &rows,
            Duration::ZERO,
            0,
        ),
        ("2 ms handlers, no failures", 0, &config, WORK, 5),
        ("2 ms handlers, 1% failures", 10, &config, WORK, 5),
        ("2 ms handlers, 10% failures", 100, &config, WORK, 5),
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..runs {
        for (i, &(_, fail_per_mille, config, wait, _)) in cases.iter().enumerate() {
            let work = Work {
                fail_per_mille,
                wait,
                ..Work::default()
            };
            rates[i].push(drain_with(EVENTS, 100, 3, config.clone(), three, work, false).await);
        }
    }
    println!(
        "(2b) transient failures, retry after 10 ms, 20000 events / 100 aggregates x 3 subscribers, concurrency {}",
        config.concurrency()
    );
    for (i, &(name, _, _, _, clean)) in cases.iter().enumerate() {
        let rate = median(rates[i].clone());
        println!(
            "    {name:<32} {rate:>8.0} events/s   ratio to no failures {:.2}   (runs {:?})",
            rate / median(rates[clean].clone()),
            rates[i].iter().map(|v| v.round()).collect::<Vec<_>>()
        );
    }
}
