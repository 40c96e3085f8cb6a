//! Several relays sharing one PostgreSQL (see `outbox_tests::workers`), also with the
//! database's default isolation raised.

use outbox_tests::backend::TestBackend;
use outbox_tests::pg::TestDb;
use outbox_tests::workers::{self, workers_keep_order};
use sqlx::Postgres;
use sqlx::postgres::PgPoolOptions;

/// Aggregates of the one-handler-at-a-time runs: few, so that producers and workers collide.
const AGGREGATES: usize = 12;

/// A relay worker, when started by `workers_keep_order`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process of the tests below"]
async fn worker_process() {
    workers::worker_process::<Postgres>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_worker_processes_keep_order_and_lose_nothing() {
    let (db, pool) = Postgres::fresh().await;
    workers_keep_order::<Postgres>(&db, pool, 1, AGGREGATES).await;
}

/// Four worker processes calling up to 64 handlers at once each, over 200 aggregates, with
/// handlers that take 0-5 ms and fail 10% of their attempts: each (subscriber, aggregate) still
/// sees its events in commit order, each once, and every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_at_concurrency_64() {
    let (db, pool) = Postgres::fresh().await;
    workers_keep_order::<Postgres>(&db, pool, 64, 200).await;
}

/// The same, with the database's default isolation raised: the claim must run at READ
/// COMMITTED whatever the default (under REPEATABLE READ its snapshot would predate the claim
/// lock it waited for, and it would claim what the previous claimer just took).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_keep_order_under_repeatable_read_and_serializable_defaults() {
    for isolation in ["repeatable read", "serializable"] {
        let db = TestDb::new().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{isolation}'",
            db.name()
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        // New sessions take the default; the database's own pool connected before.
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect(&db.url())
            .await
            .unwrap();
        let default: String = sqlx::query_scalar("SHOW default_transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(default, isolation);
        workers_keep_order::<Postgres>(&db, pool, 1, AGGREGATES).await;
    }
}
