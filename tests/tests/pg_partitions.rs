//! An events table partitioned by id (`Outbox::partition_by_id`, PostgreSQL): retention gives
//! old events back whole, keeps every partition that holds something not done, and nothing is
//! refused when the ids outrun the partitions.

use std::time::Duration;

use outbox_core::{Relay, RelayConfig, RetryPolicy};
use outbox_sqlx::Outbox;
use outbox_sqlx::Requeue;
use outbox_tests::kit::{Fail, Ping, Probe, XAndY, run_until, wait_for};
use outbox_tests::pg::TestDb;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

type TestOutbox = Outbox<Postgres, XAndY>;

async fn setup() -> (TestDb, TestOutbox) {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate");
    (db, outbox)
}

type TestRelay = Relay<outbox_sqlx::SqlStore<Postgres>, XAndY>;

/// An outbox whose events table is partitioned, `size` ids a partition, and a relay on it.
async fn partitioned(size: u64) -> (TestDb, TestOutbox, Probe, TestRelay) {
    let (db, outbox) = setup().await;
    outbox.partition_by_id(size).await.unwrap();
    let probe = Probe::default();
    let relay = outbox.relay(XAndY::new(&probe), config()).unwrap();
    (db, outbox, probe, relay)
}

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_retry(RetryPolicy::new([Duration::from_secs(3600)]).unwrap())
}

/// Publishes `seqs` of `aggregate`, one transaction each; returns their ids.
async fn publish(outbox: &TestOutbox, aggregate: Uuid, seqs: std::ops::Range<u32>) -> Vec<i64> {
    let mut ids = Vec::new();
    for seq in seqs {
        let mut tx = outbox.begin().await.unwrap();
        tx.publish(&Ping { aggregate, seq }).await.unwrap();
        tx.commit().await.unwrap();
        ids.push(last_event(outbox.pool()).await);
    }
    ids
}

async fn last_event(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT max(id) FROM events.outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The partitions of the events table, by name, with the events each holds.
async fn partitions(pool: &PgPool) -> Vec<(String, i64)> {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'events.outbox'::regclass ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut counted = Vec::new();
    for name in names {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM events.{name}"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        counted.push((name, n));
    }
    counted
}

/// The tables of the events table's schema named as its partitions, attached or not.
async fn tables_named_like_partitions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT relname::text FROM pg_class
         WHERE relnamespace = 'events'::regnamespace AND relkind = 'r'
           AND relname ~ '^outbox_p([0-9]+|default)$' ORDER BY relname",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Purges every published event, and returns the names of the partitions left.
async fn purge_now(outbox: &TestOutbox) -> Vec<String> {
    outbox.purge_published(Duration::ZERO, 500).await.unwrap();
    partitions(outbox.pool())
        .await
        .into_iter()
        .map(|p| p.0)
        .collect()
}

/// An outbox with three events of an aggregate, and a transaction that read its events table
/// and stays open (a report), holding a lock on it.
async fn with_a_report() -> (
    TestDb,
    TestOutbox,
    Uuid,
    sqlx::Transaction<'static, Postgres>,
) {
    let (db, outbox) = setup().await;
    let a = Uuid::new_v4();
    publish(&outbox, a, 0..3).await;
    let mut report = db.pool.begin().await.unwrap();
    sqlx::query("SELECT count(*) FROM events.outbox")
        .execute(&mut *report)
        .await
        .unwrap();
    (db, outbox, a, report)
}

/// A transaction that published an event of `aggregate` (an id drawn in the partition being
/// filled) and has not ended.
async fn a_late_publisher(
    outbox: &TestOutbox,
    aggregate: Uuid,
) -> outbox_sqlx::OutboxTx<'static, Postgres, XAndY> {
    let mut late = outbox.begin().await.unwrap();
    late.publish(&Ping { aggregate, seq: 0 }).await.unwrap();
    late
}

/// Every published event was published two hours ago.
async fn published_two_hours_ago(pool: &PgPool) {
    sqlx::query("UPDATE events.outbox SET published_at = now() - interval '2 hours'")
        .execute(pool)
        .await
        .unwrap();
}

/// The partition that holds event `id`.
async fn partition_of(pool: &PgPool, id: i64) -> String {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM events.outbox WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Delivers until both subscribers took `aggregate`'s events `0..n`, and checks they took them
/// in order, and nothing else.
async fn deliver_in_order(relay: &TestRelay, probe: &Probe, aggregate: Uuid, n: u32) {
    deliver(relay, probe, 2 * n as usize).await;
    let expected: Vec<(Uuid, u32)> = (0..n).map(|seq| (aggregate, seq)).collect();
    assert_eq!(probe.delivered_to("x"), expected);
    assert_eq!(probe.delivered_to("y"), expected);
}

/// The events of `aggregate` that `subscriber` took, by number, in the order it took them.
fn delivered(probe: &Probe, subscriber: &str, aggregate: Uuid) -> Vec<u32> {
    probe
        .delivered_to(subscriber)
        .into_iter()
        .filter(|(agg, _)| *agg == aggregate)
        .map(|(_, seq)| seq)
        .collect()
}

/// Delivers until `probe` saw `n` successful calls in all.
async fn deliver(relay: &TestRelay, probe: &Probe, n: usize) {
    run_until(relay, Duration::from_secs(20), || {
        probe.delivered_to("x").len() + probe.delivered_to("y").len() >= n
    })
    .await;
}

#[tokio::test]
async fn retention_gives_old_partitions_back_whole_and_new_events_go_on() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let relay = outbox.relay(XAndY::new(&probe), config()).unwrap();
    let a = Uuid::new_v4();
    // Events from before the conversion stay, in the first partition.
    let before = publish(&outbox, a, 0..3).await;
    outbox.partition_by_id(5).await.unwrap();
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'events.outbox'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kind, "p");
    assert_eq!(partition_of(&db.pool, before[0]).await, "events.outbox_p0");
    let mut after = publish(&outbox, a, 3..13).await;
    // A purge makes partitions ahead of the ids (two), as the relay's do as it runs.
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    after.extend(publish(&outbox, a, 13..20).await);
    assert_ne!(partition_of(&db.pool, after[0]).await, "events.outbox_p0");
    assert_eq!(
        partition_of(&db.pool, after[0]).await,
        format!("events.outbox_p{}", after[0])
    );
    deliver_in_order(&relay, &probe, a, 20).await;

    assert_eq!(
        partition_of(&db.pool, after[10]).await,
        format!("events.outbox_p{}", after[10])
    );
    let held = partitions(&db.pool).await;
    let current = partition_of(&db.pool, *after.last().unwrap()).await;
    outbox.purge_published(Duration::ZERO, 500).await.unwrap();
    let left = partitions(&db.pool).await;
    // The first partition and the three full ones went whole; the one still drawing ids (and
    // the ones ahead) stay.
    let names = |parts: &[(String, i64)]| parts.iter().map(|p| p.0.clone()).collect::<Vec<_>>();
    assert!(names(&held).contains(&"outbox_p0".to_owned()), "{held:?}");
    for full in [0, 5, 10] {
        let gone = format!("outbox_p{}", after[full]);
        assert!(names(&held).contains(&gone), "{held:?}");
        assert!(
            !names(&left).contains(&gone),
            "{gone} is still there: {left:?}"
        );
    }
    assert!(!names(&left).contains(&"outbox_p0".to_owned()), "{left:?}");
    // Gone, not only detached.
    assert_eq!(tables_named_like_partitions(&db.pool).await, names(&left));
    assert!(
        names(&left).contains(&current.trim_start_matches("events.").to_owned()),
        "{left:?}"
    );
    assert!(names(&left).contains(&"outbox_pdefault".to_owned()));
    // Partitions are made ahead of the ids: two above the current one.
    let ahead = left
        .iter()
        .filter(|(name, _)| {
            name.strip_prefix("outbox_p")
                .and_then(|lo| lo.parse::<i64>().ok())
                .is_some_and(|lo| lo > *after.last().unwrap())
        })
        .count();
    assert_eq!(ahead, 2, "{left:?}");

    // Publishing and delivering go on, in order, across partitions made by the purge.
    let more = publish(&outbox, a, 20..40).await;
    deliver_in_order(&relay, &probe, a, 40).await;
    assert_ne!(
        partition_of(&db.pool, more[0]).await,
        "events.outbox_pdefault"
    );
}

#[tokio::test]
async fn a_partition_that_holds_a_dead_letter_or_an_undelivered_event_is_kept() {
    let (db, outbox, probe, relay) = partitioned(5).await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // a's events fill the first partition, b's the second: b's first event is a dead letter
    // for `x` (a permanent failure), a's third waits for a retry of `y` an hour away.
    probe.fail("y", a, 2, [Fail::Transient]);
    probe.fail("x", b, 0, [Fail::Permanent]);
    let first = publish(&outbox, a, 0..5).await;
    let second = publish(&outbox, b, 0..5).await;
    let third = publish(&outbox, a, 5..10).await;
    publish(&outbox, b, 5..6).await;
    assert_ne!(
        partition_of(&db.pool, first[0]).await,
        partition_of(&db.pool, second[0]).await
    );
    assert_ne!(
        partition_of(&db.pool, second[0]).await,
        partition_of(&db.pool, third[0]).await
    );
    // Everything else is delivered: y's for a stop at 2 (the retry), x's for b at 0 (dead).
    run_until(&relay, Duration::from_secs(20), || {
        probe.delivered_to("x").len() == 10 && probe.delivered_to("y").len() == 2 + 6
    })
    .await;

    let left = purge_now(&outbox).await;
    assert!(
        left.contains(&format!("outbox_p{}", first[0])),
        "the undelivered event's partition went: {left:?}"
    );
    assert!(
        left.contains(&format!("outbox_p{}", second[0])),
        "the dead letter's partition went: {left:?}"
    );
    // Nothing of what is not done was lost: both go on once let go.
    assert_eq!(
        outbox
            .requeue(&Requeue::Subscriber("x".to_owned()))
            .await
            .unwrap(),
        1
    );
    sqlx::query("UPDATE events.outbox_deliveries SET next_retry_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    run_until(&relay, Duration::from_secs(20), || {
        probe.delivered_to("x").len() == 16 && probe.delivered_to("y").len() == 16
    })
    .await;
    let of = |subscriber: &str, aggregate: Uuid| delivered(&probe, subscriber, aggregate);
    assert_eq!(of("x", a), (0..10).collect::<Vec<_>>());
    assert_eq!(of("y", a), (0..10).collect::<Vec<_>>());
    assert_eq!(of("x", b), (0..6).collect::<Vec<_>>());
    assert_eq!(of("y", b), (0..6).collect::<Vec<_>>());
    // Now they go too.
    let left = purge_now(&outbox).await;
    assert!(!left.contains(&format!("outbox_p{}", first[0])), "{left:?}");
    assert!(
        !left.contains(&format!("outbox_p{}", second[0])),
        "{left:?}"
    );
}

#[tokio::test]
async fn partitions_are_kept_while_their_events_are_younger_than_the_window() {
    let (db, outbox, probe, relay) = partitioned(5).await;
    let a = Uuid::new_v4();
    let ids = publish(&outbox, a, 0..12).await;
    deliver(&relay, &probe, 24).await;
    let holding = |parts: Vec<(String, i64)>| -> Vec<(String, i64)> {
        parts.into_iter().filter(|(_, n)| *n > 0).collect()
    };
    let before = holding(partitions(&db.pool).await);
    assert_eq!(before.len(), 3, "{before:?}");
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    assert_eq!(holding(partitions(&db.pool).await), before);
    // Published two hours ago: they go.
    published_two_hours_ago(&db.pool).await;
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    let left: Vec<String> = partitions(&db.pool)
        .await
        .into_iter()
        .map(|p| p.0)
        .collect();
    assert!(!left.contains(&format!("outbox_p{}", ids[0])), "{left:?}");
}

#[tokio::test]
async fn events_beyond_the_partitions_made_ahead_are_taken_by_the_default_partition() {
    // Partitions of one event, two ahead: no purge runs while 10 are published.
    let (db, outbox, probe, relay) = partitioned(1).await;
    let a = Uuid::new_v4();
    let ids = publish(&outbox, a, 0..10).await;
    assert_eq!(
        partition_of(&db.pool, ids[9]).await,
        "events.outbox_pdefault"
    );
    deliver_in_order(&relay, &probe, a, 10).await;
    // A purge makes partitions above the ids drawn; the next events go there.
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    let next = publish(&outbox, a, 10..11).await;
    assert_ne!(
        partition_of(&db.pool, next[0]).await,
        "events.outbox_pdefault"
    );
}

#[tokio::test]
async fn converting_keeps_pending_events_in_order_and_publishers_go_on_meanwhile() {
    let (db, outbox) = setup().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    publish(&outbox, a, 0..10).await;
    // Publishers commit while the table is converted.
    let publishers = {
        let outbox = outbox.clone();
        tokio::spawn(async move {
            let b = Uuid::new_v4();
            publish(&outbox, b, 0..200).await;
            b
        })
    };
    outbox.partition_by_id(50).await.unwrap();
    // Again: only the size of new partitions changes.
    outbox.partition_by_id(20).await.unwrap();
    let b = publishers.await.unwrap();
    let relay = outbox.relay(XAndY::new(&probe), config()).unwrap();
    deliver(&relay, &probe, 420).await;
    let of = |aggregate: Uuid| delivered(&probe, "x", aggregate);
    assert_eq!(of(a), (0..10).collect::<Vec<_>>());
    assert_eq!(of(b), (0..200).collect::<Vec<_>>());
    let size: i64 =
        sqlx::query_scalar("SELECT events_per_partition FROM events.outbox_partitioning")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(size, 20);
}

#[tokio::test]
async fn a_relay_running_through_the_conversion_delivers_everything_in_order() {
    let (_db, outbox) = setup().await;
    let probe = Probe::default();
    let relay = std::sync::Arc::new(outbox.relay(XAndY::new(&probe), config()).unwrap());
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let worker = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop.notified()).await }
    });
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    publish(&outbox, a, 0..50).await;
    let publisher = {
        let outbox = outbox.clone();
        tokio::spawn(async move { publish(&outbox, b, 0..300).await })
    };
    outbox.partition_by_id(20).await.unwrap();
    publish(&outbox, a, 50..100).await;
    publisher.await.unwrap();
    wait_for(|| probe.delivered_to("x").len() == 400 && probe.delivered_to("y").len() == 400).await;
    stop.notify_one();
    worker.await.unwrap();
    for subscriber in ["x", "y"] {
        let of = |aggregate: Uuid| delivered(&probe, subscriber, aggregate);
        assert_eq!(of(a), (0..100).collect::<Vec<_>>(), "{subscriber}");
        assert_eq!(of(b), (0..300).collect::<Vec<_>>(), "{subscriber}");
    }
}

#[tokio::test]
async fn a_conversion_waiting_for_a_long_transaction_does_not_stop_publishers() {
    // A long transaction that read the events table (a report, say) holds a lock on it.
    let (_db, outbox, a, report) = with_a_report().await;
    let conversion = {
        let outbox = outbox.clone();
        tokio::spawn(async move { outbox.partition_by_id(5).await })
    };
    // Publishers go on meanwhile: each waits a second at most behind the conversion's turn.
    for seq in 3..6 {
        tokio::time::timeout(Duration::from_secs(20), publish(&outbox, a, seq..seq + 1))
            .await
            .expect("a publisher waited for the conversion");
    }
    // The conversion cannot have locked the table while the report holds it.
    assert!(!conversion.is_finished());
    report.rollback().await.unwrap();
    conversion.await.unwrap().unwrap();
    let probe = Probe::default();
    let relay = outbox.relay(XAndY::new(&probe), config()).unwrap();
    deliver_in_order(&relay, &probe, a, 6).await;
}

#[tokio::test]
async fn a_conversion_that_cannot_lock_the_table_gives_up_saying_so_and_changes_nothing() {
    // A report that reads the events table for longer than the conversion waits (about 31 s).
    let (db, outbox, a, report) = with_a_report().await;
    let error = outbox.partition_by_id(5).await.unwrap_err().to_string();
    assert!(
        error.contains("`events.outbox` stayed locked by other transactions for 31 s")
            && error.contains("nothing was changed: try again"),
        "{error}"
    );
    report.rollback().await.unwrap();
    let kind: String = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = 'events.outbox'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kind, "r", "the table is as it was");
    // Nothing left behind refuses events; a conversion then goes through.
    publish(&outbox, a, 3..6).await;
    outbox.partition_by_id(5).await.unwrap();
    let probe = Probe::default();
    let relay = outbox.relay(XAndY::new(&probe), config()).unwrap();
    deliver_in_order(&relay, &probe, a, 6).await;
}

#[tokio::test]
async fn a_partition_size_out_of_range_is_refused_with_the_range() {
    let (_db, outbox) = setup().await;
    let error = outbox.partition_by_id(0).await.unwrap_err().to_string();
    assert!(
        error.contains("events per partition") && error.contains("use 1 to"),
        "{error}"
    );
}

#[tokio::test]
async fn a_conversion_that_died_half_way_leaves_nothing_that_refuses_events() {
    let (db, outbox) = setup().await;
    let a = Uuid::new_v4();
    publish(&outbox, a, 0..2).await;
    // A conversion's first step, as if its process died right after: a check that ids stay
    // below a bound (here two ids away).
    let bound = last_event(&db.pool).await + 2;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE events.outbox ADD CONSTRAINT outbox_p0_ids CHECK (id < {bound}) NOT VALID"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    publish(&outbox, a, 2..3).await;
    // The next purge drops it: events beyond the bound are taken.
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    publish(&outbox, a, 3..6).await;
    // And a conversion then goes through.
    outbox.partition_by_id(5).await.unwrap();
    let probe = Probe::default();
    let relay = outbox.relay(XAndY::new(&probe), config()).unwrap();
    deliver_in_order(&relay, &probe, a, 6).await;
}

#[tokio::test]
async fn a_partition_left_detached_by_a_purge_that_died_is_dropped_by_the_next_one() {
    let (db, outbox, probe, relay) = partitioned(5).await;
    let a = Uuid::new_v4();
    publish(&outbox, a, 0..12).await;
    deliver_in_order(&relay, &probe, a, 12).await;
    let ids = publish(&outbox, a, 12..13).await;
    deliver_in_order(&relay, &probe, a, 13).await;
    // A purge that died between its two transactions: a partition emptied and detached (with
    // the mark `drop_empty` leaves on it), not dropped. And a table of the application's that
    // happens to be named like a partition, empty.
    let emptied = partition_of(&db.pool, ids[0] - 10).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "TRUNCATE {emptied};
         ALTER TABLE events.outbox DETACH PARTITION {emptied};
         COMMENT ON TABLE {emptied} IS
             'outbox: an empty partition, detached; the next purge drops it';
         CREATE TABLE events.outbox_p777 (id int8)"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let named = tables_named_like_partitions(&db.pool).await;
    let emptied = emptied.trim_start_matches("events.").to_owned();
    assert!(named.contains(&emptied), "{named:?}");

    // A purge that finds nothing to empty drops it all the same; the other table stays.
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    let named = tables_named_like_partitions(&db.pool).await;
    assert!(!named.contains(&emptied), "{named:?}");
    assert!(named.contains(&"outbox_p777".to_owned()), "{named:?}");
    // Publishing and delivering go on.
    publish(&outbox, a, 13..20).await;
    deliver_in_order(&relay, &probe, a, 20).await;
}

/// A publisher that drew an id in a partition and commits while a purge looks at it: the
/// purge waits for it before it looks (its event was not visible before), so the event is not
/// emptied with its partition's published ones, and is delivered.
#[tokio::test]
async fn an_event_committed_while_its_partition_is_looked_at_is_not_emptied_with_it() {
    let (db, outbox, probe, relay) = partitioned(5).await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let late = a_late_publisher(&outbox, a).await;
    // Others fill the rest of its partition and the next; all published.
    publish(&outbox, b, 0..12).await;
    deliver_in_order(&relay, &probe, b, 12).await;

    let purge = tokio::spawn({
        let outbox = outbox.clone();
        async move { outbox.purge_published(Duration::ZERO, 500).await.unwrap() }
    });
    // The purge waits for the writers of the late event's partition: it commits then.
    outbox_tests::pg::wait_until_true(
        &db.pool,
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                        WHERE datname = current_database() AND pid <> pg_backend_pid()
                          AND query LIKE '%virtualxid = ANY%')",
        Duration::from_secs(20),
        "the purge never waited for the partition's writers",
    )
    .await;
    late.commit().await.unwrap();
    purge.await.unwrap();
    let id: i64 = sqlx::query_scalar("SELECT id FROM events.outbox WHERE aggregate_id = $1")
        .bind(a)
        .fetch_one(&db.pool)
        .await
        .expect("the late event is kept");
    deliver(&relay, &probe, 2 * 13).await;
    for subscriber in ["x", "y"] {
        assert_eq!(delivered(&probe, subscriber, a), [0]);
        assert_eq!(
            delivered(&probe, subscriber, b),
            (0..12).collect::<Vec<_>>()
        );
    }
    // Once delivered, its partition goes.
    let partition = partition_of(&db.pool, id).await;
    purge_now(&outbox).await;
    let named = tables_named_like_partitions(&db.pool).await;
    assert!(
        !named.contains(&partition.trim_start_matches("events.").to_owned()),
        "{named:?}"
    );
}

/// The events of a partition.
async fn count_in(pool: &PgPool, partition: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {partition}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// On a partitioned table a partition's old events wait to go with it, whole, while it is in
/// its window (deleting them one by one first would only leave dead rows behind); where a
/// partition cannot go whole, past its window but kept for a dead letter, its published events
/// go one by one as on a table without partitions.
#[tokio::test]
async fn old_events_of_a_partition_in_its_window_wait_to_go_with_it_whole() {
    let (db, outbox, probe, relay) = partitioned(5).await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // b's event is a dead letter for `x`; a's fill its partition and the next two.
    probe.fail("x", b, 0, [Fail::Permanent]);
    let mut first = publish(&outbox, b, 0..1).await;
    first.extend(publish(&outbox, a, 0..4).await);
    let second = publish(&outbox, a, 4..9).await;
    let third = publish(&outbox, a, 9..11).await;
    let (kept, young) = (
        partition_of(&db.pool, first[0]).await,
        partition_of(&db.pool, second[0]).await,
    );
    assert_eq!(partition_of(&db.pool, first[4]).await, kept);
    assert_eq!(partition_of(&db.pool, second[4]).await, young);
    assert_ne!(partition_of(&db.pool, third[0]).await, young);
    run_until(&relay, Duration::from_secs(20), || {
        probe.delivered_to("x").len() == 11 && probe.delivered_to("y").len() == 12
    })
    .await;
    // The first partition and the first two events of the second were published two hours ago.
    sqlx::query(
        "UPDATE events.outbox SET published_at = now() - interval '2 hours'
         WHERE id <= $1 AND published_at IS NOT NULL",
    )
    .bind(second[1])
    .execute(&db.pool)
    .await
    .unwrap();

    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    assert_eq!(
        count_in(&db.pool, &young).await,
        5,
        "old events of a partition in its window were deleted one by one"
    );
    assert_eq!(
        count_in(&db.pool, &kept).await,
        1,
        "a partition kept for its dead letter keeps its published events"
    );
    let dead: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT id FROM {kept}")))
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(dead, [first[0]]);
}

/// Events that went to the default partition (beyond the partitions made ahead) go one by one
/// once past the window: it is never emptied whole.
#[tokio::test]
async fn old_events_of_the_default_partition_go_one_by_one() {
    let (db, outbox, probe, relay) = partitioned(1).await;
    let a = Uuid::new_v4();
    let ids = publish(&outbox, a, 0..10).await;
    assert_eq!(
        partition_of(&db.pool, ids[9]).await,
        "events.outbox_pdefault"
    );
    deliver_in_order(&relay, &probe, a, 10).await;
    published_two_hours_ago(&db.pool).await;
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    assert_eq!(count_in(&db.pool, "events.outbox_pdefault").await, 0);
    assert_eq!(count_in(&db.pool, "events.outbox").await, 0);
}

/// A partition past its window that waits to be emptied whole (here for a writer still in it)
/// is left to go whole, not deleted one by one meanwhile.
#[tokio::test]
async fn a_partition_waiting_to_be_emptied_is_not_deleted_one_by_one_meanwhile() {
    let (db, outbox, probe, relay) = partitioned(5).await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // A transaction drew an id in the first partition and has not ended.
    let late = a_late_publisher(&outbox, a).await;
    let ids = publish(&outbox, b, 0..12).await;
    deliver_in_order(&relay, &probe, b, 12).await;
    let waiting = partition_of(&db.pool, ids[0]).await;
    let before = count_in(&db.pool, &waiting).await;
    assert!(before > 0);
    published_two_hours_ago(&db.pool).await;

    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    assert_eq!(
        count_in(&db.pool, &waiting).await,
        before,
        "a partition waiting for its writer lost events one by one"
    );
    // Once the writer is gone and its event delivered, the partition goes whole.
    late.commit().await.unwrap();
    deliver(&relay, &probe, 2 * 13).await;
    published_two_hours_ago(&db.pool).await;
    purge_now(&outbox).await;
    let named = tables_named_like_partitions(&db.pool).await;
    assert!(
        !named.contains(&waiting.trim_start_matches("events.").to_owned()),
        "{named:?}"
    );
}

/// A partition that fills slower than the window (few events, large partitions) does not keep
/// its old events for ever: past the window they go one by one.
#[tokio::test]
async fn old_events_of_a_partition_still_filling_go_one_by_one() {
    let (db, outbox, probe, relay) = partitioned(1000).await;
    let a = Uuid::new_v4();
    let ids = publish(&outbox, a, 0..3).await;
    deliver_in_order(&relay, &probe, a, 3).await;
    published_two_hours_ago(&db.pool).await;
    let filling = partition_of(&db.pool, ids[0]).await;
    let purged = outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    assert_eq!(purged, 3);
    assert_eq!(count_in(&db.pool, &filling).await, 0);
    // Events published since stay.
    let more = publish(&outbox, a, 3..5).await;
    deliver_in_order(&relay, &probe, a, 5).await;
    outbox
        .purge_published(Duration::from_secs(3600), 500)
        .await
        .unwrap();
    assert_eq!(count_in(&db.pool, &filling).await, 2);
    assert_eq!(partition_of(&db.pool, more[0]).await, filling);
}
