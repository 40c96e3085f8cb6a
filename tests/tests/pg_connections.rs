//! The relay's connections on PostgreSQL: its `LISTEN` connection is its own, not one of the
//! application's pool; an application pool of one connection shared by producers, a relay and
//! a handler that writes with it neither deadlocks nor starves; closing the outbox ends its
//! listener at once.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};
use tokio::sync::Notify;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account")]
struct Opened {
    #[outbox(aggregate_id)]
    account: Uuid,
}

/// Writes each event into `audit`, with the pool it was given.
#[subscriber(events = [Opened], name = "audit")]
struct Audit(PgPool);

impl Handle<Opened> for Audit {
    async fn handle(&self, _: &Opened, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO audit (event_id) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(delivery.event().id)
            .execute(&self.0)
            .await?;
        Ok(())
    }
}

#[router(events = [Opened])]
struct Accounts {
    audit: Audit,
}

fn config() -> RelayConfig {
    RelayConfig::default().with_poll_interval(Duration::from_millis(50))
}

/// A pool on the test database whose sessions are named `name`.
async fn pool(db: &TestDb, name: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(
            db.url()
                .parse::<sqlx::postgres::PgConnectOptions>()
                .unwrap()
                .application_name(name),
        )
        .await
        .unwrap()
}

/// Sessions of the test database named `name` whose last statement was a `LISTEN`.
async fn listeners(db: &TestDb, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = $1 AND application_name = $2 AND query LIKE 'LISTEN%'",
    )
    .bind(db.name())
    .bind(name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn audited(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A running relay over an outbox on a pool of `max` connections named `name`, whose handler
/// writes with that same pool: (the pool, the outbox, its stop signal, its task).
async fn running(
    db: &TestDb,
    name: &str,
    max: u32,
) -> (
    PgPool,
    Outbox<Postgres, Accounts>,
    Arc<Notify>,
    tokio::task::JoinHandle<()>,
) {
    sqlx::query("CREATE TABLE audit (event_id BIGINT PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let pool = pool(db, name, max).await;
    let outbox: Outbox<Postgres, Accounts> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let relay = outbox
        .relay(
            Accounts {
                audit: Audit(pool.clone()),
            },
            config(),
        )
        .unwrap();
    let stop = Arc::new(Notify::new());
    let worker = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(stop.notified()).await }
    });
    (pool, outbox, stop, worker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_and_the_application_share_a_pool_of_one() {
    const EVENTS: i64 = 50;
    let db = TestDb::new().await;
    let (shared, outbox, stop, worker) = running(&db, "outbox_pool_of_one", 1).await;
    // The application commits through the same single connection while the relay runs.
    for _ in 0..EVENTS {
        let mut tx = outbox.begin().await.unwrap();
        tx.publish(&Opened {
            account: Uuid::new_v4(),
        })
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while audited(&db).await < EVENTS {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {EVENTS} events handled after 20 s",
            audited(&db).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The relay listens on a connection of its own: the pool's one connection is free.
    assert_eq!(listeners(&db, "outbox_pool_of_one").await, 1);
    assert!(shared.size() <= 1);
    stop.notify_one();
    tokio::time::timeout(Duration::from_secs(10), worker)
        .await
        .expect("the relay stops")
        .unwrap();
    assert!(outbox.status().await.unwrap().is_settled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_outbox_ends_its_listener_promptly() {
    let db = TestDb::new().await;
    let name = "outbox_closing";
    let (pool, outbox, stop, worker) = running(&db, name, 2).await;
    // An idle relay waits for wake-ups: its listener connects.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while listeners(&db, name).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no LISTEN session");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.notify_one();
    worker.await.unwrap();

    let closing = tokio::time::Instant::now();
    outbox.close();
    while listeners(&db, name).await > 0 {
        assert!(
            closing.elapsed() < Duration::from_secs(2),
            "the listener outlived the outbox's close by 2 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let closed_in = closing.elapsed();
    // Nothing of the pool is held: closing it returns at once.
    tokio::time::timeout(Duration::from_secs(2), pool.close())
        .await
        .expect("the pool closes within 2 s");
    println!("listener gone {closed_in:?} after close");
}
