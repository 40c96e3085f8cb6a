//! Fault injection: a relay process killed with SIGKILL at random moments, twenty times, while
//! producers keep committing. Afterwards every committed event reached every subscriber at least
//! once, and the audit subscriber (one row per event, enforced by a unique key) holds exactly one
//! row per event.
//!
//! The relay is this test binary run again with `OUTBOX_FAULTS_DATABASE` set: see
//! `relay_process`, which does nothing when run without it.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, RetryPolicy, router, subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

const KILLS: usize = 20;
const PRODUCERS: usize = 4;
const AGGREGATES: usize = 16;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account")]
struct Deposited {
    #[outbox(aggregate_id)]
    account: Uuid,
    amount: i64,
}

/// Records each event once per event id: a unique key makes a redelivery a no-op.
#[subscriber(events = [Deposited], name = "audit")]
struct Audit(PgPool);

/// Records every handling, redeliveries included.
#[subscriber(events = [Deposited], name = "log")]
struct Log(PgPool);

impl Handle<Deposited> for Audit {
    async fn handle(&self, _: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO audit (event_id) VALUES ($1) ON CONFLICT (event_id) DO NOTHING")
            .bind(delivery.event().id)
            .execute(&self.0)
            .await?;
        Ok(())
    }
}

impl Handle<Deposited> for Log {
    async fn handle(&self, _: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO log (event_id) VALUES ($1)")
            .bind(delivery.event().id)
            .execute(&self.0)
            .await?;
        Ok(())
    }
}

#[router(events = [Deposited])]
struct Bank {
    audit: Audit,
    log: Log,
}

/// The relay, when started by `a_relay_killed_at_random_moments_loses_nothing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the relay process of a_relay_killed_at_random_moments_loses_nothing"]
async fn relay_process() {
    let Ok(url) = std::env::var("OUTBOX_FAULTS_DATABASE") else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let outbox: Outbox<Postgres, Bank> = Outbox::new(pool.clone());
    let relay = outbox
        .relay(
            Bank {
                audit: Audit(pool.clone()),
                log: Log(pool),
            },
            // Short leases: claims of a killed relay come back soon.
            RelayConfig::default()
                .with_batch_size(25)
                .with_lease(Duration::from_secs(2))
                .with_handler_timeout(Duration::from_secs(1))
                .with_poll_interval(Duration::from_millis(20))
                .with_retry(RetryPolicy::new([Duration::from_millis(30); 5]).unwrap()),
        )
        .unwrap();
    relay.run(std::future::pending()).await;
}

/// Kills the relay when the test ends, also when it fails.
struct RelayProcess(Child);

impl RelayProcess {
    fn start(url: &str) -> Self {
        Self(
            Command::new(std::env::current_exe().unwrap())
                .args(["relay_process", "--exact", "--ignored", "--nocapture"])
                .env("OUTBOX_FAULTS_DATABASE", url)
                .stdout(Stdio::null())
                .spawn()
                .expect("start the relay process"),
        )
    }

    /// SIGKILL: no shutdown, no last record.
    fn kill(mut self) {
        self.0.kill().expect("kill the relay");
        self.0.wait().expect("reap the relay");
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_at_random_moments_loses_nothing() {
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Bank> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE audit (event_id BIGINT PRIMARY KEY);
         CREATE TABLE log (event_id BIGINT NOT NULL);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let accounts: Vec<Uuid> = (0..AGGREGATES).map(|_| Uuid::new_v4()).collect();

    // Producers commit until the kills are over.
    let producing = Arc::new(AtomicBool::new(true));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|_| {
            let (outbox, accounts, producing) =
                (outbox.clone(), accounts.clone(), producing.clone());
            tokio::spawn(async move {
                let mut committed = 0_i64;
                while producing.load(Ordering::Relaxed) {
                    let account = accounts[fastrand::usize(..accounts.len())];
                    let mut tx = outbox.begin().await.unwrap();
                    tx.publish(&Deposited { account, amount: 1 }).await.unwrap();
                    tx.commit().await.unwrap();
                    committed += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                committed
            })
        })
        .collect();

    // The fault schedule: each relay runs for a random 50 to 500 ms, then dies.
    let url = db.url();
    let mut delivered_while_killing = 0;
    for _ in 0..KILLS {
        let relay = RelayProcess::start(&url);
        tokio::time::sleep(Duration::from_millis(fastrand::u64(50..500))).await;
        relay.kill();
        delivered_while_killing = count(&db.pool, "SELECT count(*) FROM audit").await;
    }
    producing.store(false, Ordering::Relaxed);
    let mut committed = 0;
    for producer in producers {
        committed += producer.await.unwrap();
    }
    assert!(
        delivered_while_killing > 0,
        "the killed relays delivered nothing: the test would show nothing"
    );

    // A last relay finishes the work, once the dead relays' claims expire.
    let relay = RelayProcess::start(&url);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let audited = count(&db.pool, "SELECT count(*) FROM audit").await;
        let status = outbox.status().await.unwrap();
        if audited == committed && status.is_settled() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{audited} of {committed} events audited after 60 s; {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.kill();

    let events = count(&db.pool, "SELECT count(*) FROM events.outbox").await;
    assert_eq!(events, committed, "every commit stored one event");
    let missing_audit = count(
        &db.pool,
        "SELECT count(*) FROM events.outbox o WHERE NOT EXISTS
             (SELECT 1 FROM audit a WHERE a.event_id = o.id)",
    )
    .await;
    let missing_log = count(
        &db.pool,
        "SELECT count(*) FROM events.outbox o WHERE NOT EXISTS
             (SELECT 1 FROM log l WHERE l.event_id = o.id)",
    )
    .await;
    assert_eq!(
        (missing_audit, missing_log),
        (0, 0),
        "events never delivered"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM audit").await,
        committed,
        "exactly one audit row per event"
    );
    let unpublished = count(
        &db.pool,
        "SELECT count(*) FROM events.outbox WHERE published_at IS NULL",
    )
    .await;
    assert_eq!(unpublished, 0);
    let handled = count(&db.pool, "SELECT count(*) FROM log").await;
    println!(
        "{committed} events, {KILLS} relays killed, {} redeliveries to `log`",
        handled - committed
    );
}
