//! Several relays sharing one MySQL / MariaDB (see `outbox_tests::workers`): InnoDB's default
//! REPEATABLE READ for the producers, whose ids are taken at insert, not at commit.

use outbox_tests::backend::TestBackend;
use outbox_tests::workers::{self, workers_keep_order};
use sqlx::MySql;

/// A relay worker, when started by `workers_keep_order`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process of the tests below"]
async fn worker_process() {
    workers::worker_process::<MySql>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_worker_processes_keep_order_and_lose_nothing() {
    let (db, pool) = MySql::fresh().await;
    workers_keep_order::<MySql>(&db, pool, 1, 12).await;
}

/// Four worker processes calling up to 64 handlers at once each, over 200 aggregates, with
/// handlers that take 0-5 ms and fail 10% of their attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_order_holds_at_concurrency_64() {
    let (db, pool) = MySql::fresh().await;
    workers_keep_order::<MySql>(&db, pool, 64, 200).await;
}
