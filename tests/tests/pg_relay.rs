//! Relay behaviour only PostgreSQL can show: surviving killed sessions, and holding no
//! transaction open while handlers run. The behaviour shared with SQLite is in `relay.rs`.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Relay, RelayConfig};
use outbox_sqlx::Outbox;
use outbox_tests::kit::{Fail, OnlyX, Ping, PingPong, Probe, wait_for};
use outbox_tests::pg::TestDb;
use sqlx::Postgres;
use tokio::sync::Notify;
use uuid::Uuid;

type TestOutbox = Outbox<Postgres, PingPong>;

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_max_error_backoff(Duration::from_millis(200))
}

async fn setup() -> (TestDb, TestOutbox) {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate");
    (db, outbox)
}

async fn publish_one(outbox: &TestOutbox, aggregate: Uuid, seq: u32) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping { aggregate, seq }).await.unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn the_relay_survives_its_connections_being_killed() {
    let (db, outbox) = setup().await;
    let relay_pool = db.pool_named("outbox_relay", 2).await;
    let relay_outbox: TestOutbox = Outbox::new(relay_pool);
    let probe = Probe::default();
    let relay = Arc::new(Relay::new(relay_outbox.store(), OnlyX::new(&probe), config()).unwrap());
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
    let relay = Relay::new(relay_outbox.store(), OnlyX::new(&probe), config()).unwrap();
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
async fn a_late_commit_is_delivered_and_in_order_within_its_aggregate() {
    let (_db, outbox) = setup().await;
    outbox_tests::kit::a_late_commit_is_delivered_in_order(&outbox, config()).await;
}

#[tokio::test]
async fn a_commit_in_another_process_wakes_an_idle_relay() {
    let (db, producer) = setup().await;
    // Another Outbox on its own pool shares nothing in memory with the producer's: only the
    // database can carry the wake-up, as between two processes.
    let consumer: TestOutbox = Outbox::new(db.pool_named("other_process", 2).await);
    let probe = Probe::default();
    let store = outbox_tests::kit::WatchedStore::new(consumer.store());
    let idle = store.idle.clone();
    let sleepy = config().with_poll_interval(Duration::from_secs(3600));
    let relay = Relay::new(store, OnlyX::new(&probe), sleepy).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    idle.notified().await;
    // The relay now waits: for its poll interval (an hour), or for a notification. Wait until its
    // LISTEN is in place, then publish from the other side.
    wait_until_listening(&db).await;
    let a = Uuid::new_v4();
    publish_one(&producer, a, 1).await;
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    worker.abort();
}

async fn wait_until_listening(db: &TestDb) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = $1 AND application_name = 'other_process' AND query LIKE 'LISTEN%'",
        )
        .bind(db.name())
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if listening > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never listened"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
