//! Publishing behaviour specific to PostgreSQL: schemas, and the advisory lock that keeps ids in
//! commit order within an aggregate when transactions run concurrently. The behaviour shared
//! with SQLite is tested in `publish.rs`.

use outbox_sqlx::{Outbox, TableNames};
use outbox_tests::kit::{Everything, Ping};
use outbox_tests::pg::TestDb;
use outbox_tests::server::PrivateServer;
use sqlx::Postgres;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

type TestOutbox = Outbox<Postgres, Everything>;

async fn setup() -> (TestDb, TestOutbox) {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate");
    (db, outbox)
}

#[tokio::test]
async fn custom_schema_and_table_names_are_used() {
    let db = TestDb::new().await;
    let names = TableNames::new("billing", "event_log").unwrap();
    let outbox: TestOutbox = Outbox::with_names(db.pool.clone(), names);
    outbox.migrate().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM billing.event_log")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
         WHERE table_schema = 'billing' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "event_log",
            "event_log_claim_parts",
            "event_log_claims",
            "event_log_deliveries",
            "event_log_holds",
            "event_log_inbox",
            "event_log_migrations",
            "event_log_relays",
            "event_log_requeues",
            "event_log_skips"
        ]
    );
    // Nothing went to the default schema.
    let default_schema: Option<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname = 'events'")
            .fetch_optional(&db.pool)
            .await
            .unwrap();
    assert_eq!(default_schema, None);
}

#[tokio::test]
async fn an_injection_attempt_in_a_table_name_never_reaches_the_database() {
    let error = TableNames::new("events", "outbox\"; DROP TABLE accounts; --").unwrap_err();
    assert!(
        error.to_string().starts_with("invalid SQL identifier"),
        "{error}"
    );
    let error = TableNames::new("public; DROP SCHEMA public CASCADE", "outbox").unwrap_err();
    assert!(error.to_string().contains("for the schema"), "{error}");
}

#[tokio::test]
async fn publishers_of_one_aggregate_take_ids_in_commit_order() {
    let (db, outbox) = setup().await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut first = outbox.begin().await.unwrap();
    first
        .publish(&Ping {
            aggregate: a,
            seq: 1,
        })
        .await
        .unwrap();

    // A second writer of the same aggregate waits for the first to commit...
    let second = tokio::spawn({
        let outbox = outbox.clone();
        async move {
            let mut tx = outbox.begin().await.unwrap();
            tx.publish(&Ping {
                aggregate: a,
                seq: 2,
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }
    });
    let waiting = "SELECT count(*) FROM pg_stat_activity
                   WHERE datname = current_database() AND wait_event = 'advisory'";
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(waiting)
        .fetch_one(&db.pool)
        .await
        .unwrap()
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second writer never waited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // ...while a writer of another aggregate does not.
    let mut other = outbox.begin().await.unwrap();
    other
        .publish(&Ping {
            aggregate: b,
            seq: 1,
        })
        .await
        .unwrap();
    other.commit().await.unwrap();

    first.commit().await.unwrap();
    second.await.unwrap();
    let order: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT aggregate_id, (payload -> 'data' ->> 'seq')::bigint FROM events.outbox
         WHERE aggregate_id = $1 ORDER BY id",
    )
    .bind(a)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(order, [(a, 1), (a, 2)]);
}

/// Pings for `n` new aggregates.
fn pings(n: usize) -> Vec<Ping> {
    (0..n)
        .map(|_| Ping {
            aggregate: Uuid::new_v4(),
            seq: 1,
        })
        .collect()
}

/// A transaction publishing for more aggregates than the server's lock table holds (one
/// advisory lock each until it ends, in a table all sessions share) fails with an error that
/// says so and what to do; nothing of it is kept, and smaller transactions publish as before.
/// On a server of this test's own: filling the shared one's lock table would fail the tests
/// running beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_publishing_for_more_aggregates_than_the_server_can_lock_fails_clearly() {
    let server = tokio::task::spawn_blocking(PrivateServer::start)
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&server.url())
        .await
        .unwrap();
    let outbox: TestOutbox = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    let error = tx.publish_all(&pings(20_000)).await.unwrap_err();
    assert!(
        matches!(
            error,
            outbox_sqlx::Error::TooManyAggregates { events: 20_000, .. }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    for says in [
        "one lock per aggregate",
        "smaller transactions",
        "max_locks_per_transaction",
    ] {
        assert!(message.contains(says), "{message}");
    }
    tx.rollback().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish_all(&pings(1_000)).await.unwrap();
    tx.commit().await.unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1_000);
}
