//! A relay on MySQL / MariaDB killed with SIGKILL at random moments, twenty times, while
//! producers commit: every committed event still reaches every subscriber, none is left
//! unpublished, and the subscriber that deduplicates by event id holds each exactly once.
//!
//! The relays are this test binary run again with `OUTBOX_FAULTS_DATABASE` set: see
//! `relay_process`, which does nothing when run without it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, RetryPolicy, router, subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::my::TestMyDb;
use outbox_tests::process::TestProcess;
use serde::{Deserialize, Serialize};
use sqlx::{MySql, MySqlPool};
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
struct Audit(MySqlPool);

/// Records every handling, redeliveries included.
#[subscriber(events = [Deposited], name = "log")]
struct Log(MySqlPool);

impl Handle<Deposited> for Audit {
    async fn handle(&self, _: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        sqlx::query("INSERT IGNORE INTO audit (event_id) VALUES (?)")
            .bind(delivery.event().id)
            .execute(&self.0)
            .await?;
        Ok(())
    }
}

impl Handle<Deposited> for Log {
    async fn handle(&self, _: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO log (event_id) VALUES (?)")
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
    let pool = TestMyDb::connect(&url, 4).await;
    // Short leases: claims of a killed relay come back soon.
    let config = RelayConfig::default()
        .with_batch_size(25)
        .with_lease(Duration::from_secs(2))
        .with_handler_timeout(Duration::from_millis(900))
        .with_poll_interval(Duration::from_millis(20))
        .with_retry(RetryPolicy::new([Duration::from_millis(30); 5]).unwrap());
    let relay = Outbox::<MySql, Bank>::new(pool.clone())
        .relay(
            Bank {
                audit: Audit(pool.clone()),
                log: Log(pool),
            },
            config,
        )
        .unwrap();
    relay.run(std::future::pending()).await;
}

async fn ids(pool: &MySqlPool, sql: &'static str) -> Vec<i64> {
    sqlx::query_scalar(sql).fetch_all(pool).await.unwrap()
}

async fn count(pool: &MySqlPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_at_random_moments_loses_nothing() {
    let db = TestMyDb::new().await;
    let outbox: Outbox<MySql, Bank> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE audit (event_id BIGINT PRIMARY KEY);
         CREATE TABLE log (n BIGINT AUTO_INCREMENT PRIMARY KEY, event_id BIGINT NOT NULL);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let accounts: Vec<Uuid> = (0..AGGREGATES).map(|_| Uuid::new_v4()).collect();

    // Producers commit, each every 2 ms, until the kills are over.
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
    let start_relay = || TestProcess::start("relay_process", &[("OUTBOX_FAULTS_DATABASE", &url)]);
    let mut delivered_while_killing = 0;
    for _ in 0..KILLS {
        let relay = start_relay();
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
    let relay = start_relay();
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

    let events: BTreeSet<i64> = ids(&db.pool, "SELECT id FROM outbox")
        .await
        .into_iter()
        .collect();
    assert_eq!(
        events.len() as i64,
        committed,
        "every commit stored one event"
    );
    let audit = ids(&db.pool, "SELECT event_id FROM audit").await;
    let log = ids(&db.pool, "SELECT event_id FROM log").await;
    let audited: BTreeSet<i64> = audit.iter().copied().collect();
    let logged: BTreeSet<i64> = log.iter().copied().collect();
    assert_eq!(
        (
            events.difference(&audited).count(),
            events.difference(&logged).count()
        ),
        (0, 0),
        "events never delivered to `audit`, to `log`"
    );
    assert_eq!(audit.len(), events.len(), "exactly one audit row per event");
    let unpublished = count(
        &db.pool,
        "SELECT count(*) FROM outbox WHERE published_at IS NULL",
    )
    .await;
    assert_eq!(unpublished, 0);
    println!(
        "{committed} events, {KILLS} relays killed, {} redeliveries to `log`",
        log.len() as i64 - committed
    );
}
