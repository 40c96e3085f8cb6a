//! MySQL runs DDL outside transactions: a migration that failed halfway left some of its tables
//! behind, and running the migrations again must finish the job, not fail on what exists.

use outbox_sqlx::Outbox;
use outbox_tests::kit::{Ping, PingPong};
use outbox_tests::my::TestMyDb;
use sqlx::MySql;
use uuid::Uuid;

#[tokio::test]
async fn a_migration_that_stopped_halfway_completes_when_run_again() {
    let db = TestMyDb::new().await;
    let outbox: Outbox<MySql, PingPong> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    // As if the first run had stopped after some tables: later ones missing, nothing recorded.
    sqlx::raw_sql(
        "DROP TABLE outbox_requeues; DROP TABLE outbox_relays; DROP TABLE outbox_inbox;
         DELETE FROM outbox_aggregate_locks WHERE slot >= 2048;
         DELETE FROM outbox_migrations;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    outbox.migrate().await.expect("the migration runs again");

    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables
         WHERE table_schema = DATABASE() AND table_name LIKE 'outbox%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(tables, 10, "every table of the outbox, the ledger included");
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_aggregate_locks")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(slots, 4096);
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(outbox.status().await.unwrap().pending_events, 1);
}
