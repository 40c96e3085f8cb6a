//! Relay behaviour only PostgreSQL can show: surviving killed sessions, and holding no
//! transaction open while handlers run. The behaviour shared with SQLite is in `relay.rs`.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Relay, RelayConfig};
use outbox_sqlx::Outbox;
use outbox_tests::kit::{OnlyX, Ping, PingPong, Probe, wait_for};
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
    let (entered, release) = probe.block("x", a, 1);
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
    db.wait_until_listening("other_process").await;
    let a = Uuid::new_v4();
    publish_one(&producer, a, 1).await;
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    worker.abort();
}

/// An insert draws its event's id before it writes the event: for a moment the transaction
/// holds an id and nothing else. The id's default takes the transaction id first, so that a
/// claim in that moment counts the transaction as running and the floor of the relay's scan
/// (which follows the relay) waits for it; for every insert, `publish` or not. The moment is
/// made long here: a trigger holds a plain `INSERT` (as a producer of an earlier build, or SQL
/// by hand, makes it) between drawing the id and writing the row, while the relay claims and
/// delivers later events again and again.
#[tokio::test]
async fn an_event_whose_id_was_drawn_before_claims_and_written_after_them_is_delivered() {
    let (db, outbox) = setup().await;
    let (late, other) = (Uuid::new_v4(), Uuid::new_v4());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION events.hold_insert() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.aggregate_id = '{late}' THEN
                 PERFORM pg_advisory_lock_shared(4242);
                 PERFORM pg_advisory_unlock_shared(4242);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER hold_insert BEFORE INSERT ON events.outbox
             FOR EACH ROW EXECUTE FUNCTION events.hold_insert();"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), OnlyX::new(&probe), config()).unwrap();
    let wait = Duration::from_secs(20);
    // (Not the sequence's first id: a draw that writes the sequence ahead to the log takes a
    // transaction id of its own, one in 32.)
    publish_one(&outbox, other, 1).await;
    outbox_tests::kit::run_until(&relay, wait, || probe.delivered_to("x").len() == 1).await;
    let mut gate = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    let held = tokio::spawn({
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('probe', $1, 'Ping', $2::jsonb)",
            )
            .bind(late)
            .bind(format!(
                r#"{{"version":1,"data":{{"aggregate":"{late}","seq":1}}}}"#
            ))
            .execute(&pool)
            .await
            .unwrap();
        }
    });
    outbox_tests::pg::wait_until_true(
        &db.pool,
        "SELECT EXISTS (SELECT 1 FROM pg_locks
                        WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted)",
        Duration::from_secs(10),
        "the insert never reached the gate",
    )
    .await;

    for seq in 2..=4 {
        publish_one(&outbox, other, seq).await;
        outbox_tests::kit::run_until(&relay, wait, || {
            probe.delivered_to("x").len() == seq as usize
        })
        .await;
        relay.run_once().await.unwrap();
    }
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .unwrap();
    held.await.unwrap();
    outbox_tests::kit::run_until(&relay, wait, || probe.delivered_to("x").len() == 5).await;
    assert_eq!(
        probe.delivered_to("x"),
        [(other, 1), (other, 2), (other, 3), (other, 4), (late, 1)]
    );
}

/// Once the relay has moved on, a dead event and the events set aside behind it lie below the
/// floor its scan starts from. Putting them back moves a sequence (a trigger does it, whoever
/// puts them back: a requeue, an `outbox` tool of an earlier version, SQL by hand), and the
/// relay then scans from the lowest id again: it finds them, in order.
#[tokio::test]
async fn events_put_back_below_the_floor_of_the_scan_are_delivered_in_order() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), OnlyX::new(&probe), config()).unwrap();
    let wait = Duration::from_secs(20);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let undecodable = async |aggregate: Uuid| -> i64 {
        sqlx::query_scalar(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('probe', $1, 'Ping', '{\"version\":1,\"data\":{\"seq\":1}}') RETURNING id",
        )
        .bind(aggregate)
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let repair = async |id: i64, aggregate: Uuid| {
        sqlx::query("UPDATE events.outbox SET payload = $2::jsonb WHERE id = $1")
            .bind(id)
            .bind(format!(
                r#"{{"version":1,"data":{{"aggregate":"{aggregate}","seq":1}}}}"#
            ))
            .execute(&db.pool)
            .await
            .unwrap();
    };
    let dead = undecodable(a).await;
    let dead_by_hand = undecodable(b).await;
    for seq in 2..=3 {
        publish_one(&outbox, a, seq).await;
        publish_one(&outbox, b, seq).await;
    }
    let other = Uuid::new_v4();
    for seq in 1..=3 {
        publish_one(&outbox, other, seq).await;
        outbox_tests::kit::run_until(&relay, wait, || {
            probe.delivered_to("x").len() == seq as usize
        })
        .await;
    }
    for _ in 0..3 {
        relay.run_once().await.unwrap();
    }
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE held_behind IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        held, 4,
        "a's and b's later events wait behind their dead ones"
    );

    repair(dead, a).await;
    assert_eq!(
        outbox
            .requeue(&outbox_core::store::Requeue::Events(vec![dead]))
            .await
            .unwrap(),
        1
    );
    outbox_tests::kit::run_until(&relay, wait, || probe.delivered_to("x").len() == 6).await;
    // What a requeue of an earlier version does, by hand.
    repair(dead_by_hand, b).await;
    sqlx::query(
        "UPDATE events.outbox SET dead_at = NULL, next_retry_at = NULL, retry_count = 0
         WHERE id = $1;",
    )
    .bind(dead_by_hand)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE events.outbox SET held_behind = NULL WHERE held_behind = $1")
        .bind(dead_by_hand)
        .execute(&db.pool)
        .await
        .unwrap();
    outbox_tests::kit::run_until(&relay, wait, || probe.delivered_to("x").len() == 9).await;
    let delivered = probe.delivered_to("x");
    assert_eq!(
        delivered[3..],
        [(a, 1), (a, 2), (a, 3), (b, 1), (b, 2), (b, 3)]
    );
}
