//! The inbox, on PostgreSQL and on SQLite: a consumer's record of the messages it handled,
//! written in the transaction of their effects.

use std::time::Duration;

use outbox_core::Store;
use outbox_sqlx::{Error, Outbox, Received};
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::PingPong;
use outbox_tests::on_every_backend;

on_every_backend!(
    the_inbox_drops_a_duplicate_in_the_same_transaction_as_the_effect,
    a_bad_consumer_or_message_id_is_refused_and_the_transaction_goes_on,
    old_inbox_records_are_purged_by_retention_and_young_ones_kept,
);

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Handles message `id` as consumer `consumer` would: records it and, if it is new, applies its
/// effect (a plain insert into `effects`, tagged `tag`) in the same transaction, which it then
/// commits, or rolls back when `commit` is false. Returns what the inbox said.
async fn handle<B: TestBackend>(
    outbox: &Outbox<B, PingPong>,
    consumer: &str,
    id: &str,
    effect: i64,
    tag: &str,
    commit: bool,
) -> Received {
    let mut tx = outbox.begin().await.unwrap();
    let received = tx.receive(consumer, id).await.unwrap();
    if received.is_new() {
        B::insert_effect(&mut tx, effect, tag).await.unwrap();
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    received
}

async fn the_inbox_drops_a_duplicate_in_the_same_transaction_as_the_effect<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    B::create_effects(outbox.pool()).await;

    // The first arrival is new and has its effect; the second, after that commit, is a
    // duplicate and has none.
    let first = handle(&outbox, "audit", "m-1", 1, "first", true).await;
    assert_eq!(first, Received::New);
    let again = handle(&outbox, "audit", "m-1", 1, "again", true).await;
    assert_eq!(again, Received::Duplicate);
    assert!(again.is_duplicate() && !again.is_new());

    // A handling rolled back records nothing: the message is new again, and its effect
    // happens once, with the handling that committed.
    assert_eq!(
        handle(&outbox, "audit", "m-2", 2, "rolled back", false).await,
        Received::New
    );
    // So does a transaction dropped without commit (a handler that returned early, a crash).
    {
        let mut tx = outbox.begin().await.unwrap();
        assert_eq!(tx.receive("audit", "m-2").await.unwrap(), Received::New);
        B::insert_effect(&mut tx, 2, "dropped").await.unwrap();
    }
    assert_eq!(
        handle(&outbox, "audit", "m-2", 2, "committed", true).await,
        Received::New
    );
    assert_eq!(
        handle(&outbox, "audit", "m-2", 2, "once more", true).await,
        Received::Duplicate
    );

    // Consumers are independent: another consumer's record of m-1 is its own.
    assert_eq!(
        handle(&outbox, "notifications", "m-1", 1, "other consumer", true).await,
        Received::New
    );
    assert_eq!(
        handle(&outbox, "notifications", "m-1", 1, "other again", true).await,
        Received::Duplicate
    );

    // Within one transaction, a second receive of the same message is a duplicate too.
    let mut tx = outbox.begin().await.unwrap();
    assert_eq!(tx.receive("audit", "m-3").await.unwrap(), Received::New);
    assert_eq!(
        tx.receive("audit", "m-3").await.unwrap(),
        Received::Duplicate
    );
    tx.commit().await.unwrap();

    assert_eq!(
        B::effects(outbox.pool()).await,
        vec![
            (1, "first".to_owned()),
            (2, "committed".to_owned()),
            (1, "other consumer".to_owned()),
        ]
    );
    assert_eq!(B::inbox_count(outbox.pool()).await, 4);
}

async fn a_bad_consumer_or_message_id_is_refused_and_the_transaction_goes_on<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    B::create_effects(outbox.pool()).await;
    let mut tx = outbox.begin().await.unwrap();
    let long = "x".repeat(501);
    for (consumer, id, role) in [
        ("", "m-1", "consumer"),
        ("audit\n", "m-1", "consumer"),
        ("audit", "", "message id"),
        ("audit", "m\0-1", "message id"),
        ("audit", long.as_str(), "message id"),
    ] {
        match tx.receive(consumer, id).await {
            Err(Error::InvalidInboxKey { role: r, .. }) => assert_eq!(r, role, "{consumer:?}"),
            other => panic!("{consumer:?} / {id:?}: {other:?}"),
        }
    }
    // Refused before reaching the database: the transaction is still good (on PostgreSQL a
    // failed statement would have aborted it).
    assert_eq!(tx.receive("audit", "m-1").await.unwrap(), Received::New);
    B::insert_effect(&mut tx, 1, "after the refusals")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(B::inbox_count(outbox.pool()).await, 1);
    assert_eq!(B::effects(outbox.pool()).await.len(), 1);
}

async fn old_inbox_records_are_purged_by_retention_and_young_ones_kept<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, PingPong>().await;
    for id in ["old-1", "old-2", "old-3", "young"] {
        let mut tx = outbox.begin().await.unwrap();
        assert!(tx.receive("audit", id).await.unwrap().is_new());
        tx.commit().await.unwrap();
    }
    for id in ["old-1", "old-2"] {
        B::backdate_inbox(outbox.pool(), id, 31 * DAY).await;
    }

    // From code: every old record, a batch at a time.
    assert_eq!(outbox.purge_inbox(30 * DAY, 1).await.unwrap(), 2);
    assert_eq!(B::inbox_count(outbox.pool()).await, 2);
    assert!(matches!(
        outbox.purge_inbox(30 * DAY, 0).await,
        Err(Error::Config(_))
    ));

    // A relay's retention: the store's purge deletes old inbox records with old events.
    B::backdate_inbox(outbox.pool(), "old-3", 31 * DAY).await;
    let purged = outbox.store().purge_published(30 * DAY, 500).await.unwrap();
    assert_eq!((purged.deleted, purged.more), (1, false));
    assert_eq!(B::inbox_count(outbox.pool()).await, 1);

    // The young record still tells a duplicate; a purged one is forgotten (hence: keep the
    // window longer than senders redeliver).
    let mut tx = outbox.begin().await.unwrap();
    assert_eq!(
        tx.receive("audit", "young").await.unwrap(),
        Received::Duplicate
    );
    assert_eq!(tx.receive("audit", "old-1").await.unwrap(), Received::New);
    tx.commit().await.unwrap();
}

/// PostgreSQL only: transactions run at once there. A transaction that receives a message
/// another open transaction recorded waits for that one, and learns its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_for_the_first_and_follows_its_outcome() {
    let (_db, outbox) = outbox::<sqlx::Postgres, PingPong>().await;
    for (first_commits, expected) in [(true, Received::Duplicate), (false, Received::New)] {
        let id = format!("m-{first_commits}");
        let mut first = outbox.begin().await.unwrap();
        assert_eq!(first.receive("audit", &id).await.unwrap(), Received::New);
        let second = {
            let (outbox, id) = (outbox.clone(), id.clone());
            tokio::spawn(async move {
                let mut tx = outbox.begin().await.unwrap();
                let received = tx.receive("audit", &id).await.unwrap();
                tx.commit().await.unwrap();
                received
            })
        };
        // The second waits on the first's row lock (seen in pg_stat_activity), whatever the
        // scheduling: it has not answered yet.
        wait_for_a_lock_wait(outbox.pool()).await;
        assert!(!second.is_finished());
        if first_commits {
            first.commit().await.unwrap();
        } else {
            first.rollback().await.unwrap();
        }
        assert_eq!(
            second.await.unwrap(),
            expected,
            "first commits: {first_commits}"
        );
    }
}

async fn wait_for_a_lock_wait(pool: &sqlx::PgPool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE 'INSERT INTO %outbox_inbox%'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second transaction never waited for the first"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
