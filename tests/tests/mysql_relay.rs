//! Relay behaviour that needs a MySQL server to show: a late commit (InnoDB takes ids at insert,
//! not at commit), surviving killed sessions, and holding no transaction open while handlers
//! run. The behaviour shared with the other backends is in `relay.rs` and the others.

use outbox_core::store::ClaimLimit;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{ClaimFilter, EventOutcome, Outcomes, Recorded};
use outbox_core::{Relay, RelayConfig, Store};
use outbox_sqlx::Outbox;
use outbox_tests::kit::{OnlyX, Ping, PingPong, Probe, wait_for};
use outbox_tests::my::TestMyDb;
use sqlx::MySql;
use tokio::sync::Notify;
use uuid::Uuid;

type TestOutbox = Outbox<MySql, PingPong>;

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_max_error_backoff(Duration::from_millis(200))
}

async fn setup() -> (TestMyDb, TestOutbox) {
    let db = TestMyDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate");
    (db, outbox)
}

async fn publish_one(outbox: &TestOutbox, aggregate: Uuid, seq: u32) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping { aggregate, seq }).await.unwrap();
    tx.commit().await.unwrap();
}

/// The sessions on the test database other than the one asking.
const OTHER_SESSIONS: &str = "FROM information_schema.processlist
                              WHERE db = ? AND id <> CONNECTION_ID()";

#[tokio::test]
async fn a_late_commit_is_delivered_and_in_order_within_its_aggregate() {
    let (_db, outbox) = setup().await;
    outbox_tests::kit::a_late_commit_is_delivered_in_order(&outbox, config()).await;
}

#[tokio::test]
async fn the_relay_survives_its_connections_being_killed() {
    let (db, outbox) = setup().await;
    let relay_outbox: TestOutbox = Outbox::new(TestMyDb::connect(&db.url(), 2).await);
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

    let mut admin = db.pool.acquire().await.unwrap();
    for round in 2..=4 {
        let killed = db.kill_sessions(&mut admin).await;
        assert!(killed >= 1, "round {round}: no session to kill");
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
    let relay_outbox: TestOutbox = Outbox::new(TestMyDb::connect(&db.url(), 2).await);
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let (entered, release) = probe.block("x", a, 1);
    let relay = Relay::new(relay_outbox.store(), OnlyX::new(&probe), config()).unwrap();
    publish_one(&outbox, a, 1).await;
    let task = tokio::spawn(async move { relay.run_once().await });
    entered.notified().await;

    let open: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM information_schema.innodb_trx
         WHERE trx_mysql_thread_id IN (SELECT id {OTHER_SESSIONS})"
    )))
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

/// A transaction that publishes for an aggregate another open transaction published for waits
/// for it (so that their ids follow commit order), and holds nothing else back meanwhile:
/// publishers of other aggregates commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_waiting_for_its_aggregate_holds_no_other_aggregate_back() {
    let (db, outbox) = setup().await;
    // Fixed ids, so that the two aggregates lock different rows whatever the run.
    let (a, b) = (Uuid::nil(), Uuid::from_u128(1));
    let mut first = outbox.begin().await.unwrap();
    first
        .publish(&Ping {
            aggregate: a,
            seq: 1,
        })
        .await
        .unwrap();
    let second = tokio::spawn({
        let outbox = outbox.clone();
        async move { publish_one(&outbox, a, 2).await }
    });
    wait_for_lock_wait(&db).await;
    tokio::time::timeout(Duration::from_secs(5), publish_one(&outbox, b, 1))
        .await
        .expect("another aggregate's publisher was held back");
    assert!(!second.is_finished(), "the second publisher of `a` waits");
    first.commit().await.unwrap();
    second.await.unwrap();
    let ids: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT id, aggregate_id FROM outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let ids: Vec<(i64, Uuid)> = ids
        .into_iter()
        .map(|(id, aggregate)| (id, Uuid::from_slice(&aggregate).unwrap()))
        .collect();
    assert_eq!(
        ids.iter().map(|(_, a)| *a).collect::<Vec<_>>(),
        [a, b, a],
        "{ids:?}"
    );
}

/// Waits until a session on the test database is in its aggregate's lock statement (read from
/// the process list: a lock wait does not always show in `innodb_trx`).
async fn wait_for_lock_wait(db: &TestMyDb) {
    wait_for_statement(db, "UPDATE %aggregate_locks%").await;
}

/// A claim sets an event aside behind another claim only if that claim, read as it is once this
/// claim holds its row in share mode, still lists the event's aggregate. Here a record of part
/// of the first claim takes y out of it while a claim decides to set y's next event aside
/// behind it (the record holds the claim's row, then waits for y1's row, locked here): the
/// event must stay free for the next claim, not wait for the first claim's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_set_aside_behind_a_claim_for_an_aggregate_a_record_of_part_of_it_took_out() {
    let (db, outbox) = setup().await;
    let store = outbox.store();
    let filter = ClaimFilter::default();
    let lease = Duration::from_secs(60);
    let (x, y) = (Uuid::new_v4(), Uuid::new_v4());
    publish_one(&outbox, x, 1).await;
    publish_one(&outbox, y, 1).await;
    let first = store
        .claim(ClaimLimit::events(10), lease, &filter)
        .await
        .unwrap();
    assert_eq!(first.claims.len(), 2);
    let y1 = last_event_of(&db, y).await;
    // The claim has lasted: a claim sets its aggregates' later events aside behind it.
    sqlx::query("UPDATE outbox_claims SET claimed_at = UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE")
        .execute(&db.pool)
        .await
        .unwrap();
    publish_one(&outbox, y, 2).await;
    let y2 = last_event_of(&db, y).await;

    let mut locker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM outbox WHERE id = ? FOR UPDATE")
        .bind(y1)
        .execute(&mut *locker)
        .await
        .unwrap();
    let record = tokio::spawn({
        let store = store.clone();
        async move {
            let mut outcomes = Outcomes::default();
            outcomes.events.push((y1, EventOutcome::Published));
            store.record_part(first.token, &outcomes).await.unwrap()
        }
    });
    wait_for_statement(&db, "UPDATE JSON_TABLE%published_at%").await;
    let claim = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .claim(
                    ClaimLimit::events(10),
                    Duration::from_secs(60),
                    &ClaimFilter::default(),
                )
                .await
                .unwrap()
        }
    });
    wait_for_statement(&db, "%LOCK IN SHARE MODE%").await;
    locker.commit().await.unwrap();
    assert_eq!(record.await.unwrap(), Recorded::Applied);
    let batch = claim.await.unwrap();
    assert!(batch.claims.is_empty(), "{batch:?}");
    let held_by: Option<i64> = sqlx::query_scalar("SELECT held_by FROM outbox WHERE id = ?")
        .bind(y2)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        held_by, None,
        "y2 was set aside behind a claim that no longer holds y"
    );
    let next = store
        .claim(ClaimLimit::events(10), lease, &filter)
        .await
        .unwrap();
    let claimed: Vec<i64> = next
        .claims
        .iter()
        .map(outbox_core::store::Claim::event_id)
        .collect();
    assert_eq!(claimed, [y2]);
}

/// The id of `aggregate`'s last event.
async fn last_event_of(db: &TestMyDb, aggregate: Uuid) -> i64 {
    sqlx::query_scalar("SELECT max(id) FROM outbox WHERE aggregate_id = ?")
        .bind(aggregate)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Waits until a session on the test database runs a statement like `pattern` (read from the
/// process list).
async fn wait_for_statement(db: &TestMyDb, pattern: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.processlist WHERE db = ? AND info LIKE ?",
        )
        .bind(db.name())
        .bind(pattern)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if running > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no session runs {pattern}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Rows the session of `outbox`'s pool (of one connection) has read from tables and indexes
/// so far (its `Handler_read_*` counters: lookups, index steps both ways, and rows of full
/// scans).
async fn rows_read(outbox: &TestOutbox) -> i64 {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SHOW SESSION STATUS WHERE Variable_name IN ('Handler_read_first', 'Handler_read_key',
             'Handler_read_last', 'Handler_read_next', 'Handler_read_prev', 'Handler_read_rnd',
             'Handler_read_rnd_next')",
    )
    .fetch_all(outbox.pool())
    .await
    .unwrap();
    rows.iter().map(|(_, n)| n.parse::<i64>().unwrap()).sum()
}

/// An outbox on a pool of one connection to `db`: what it runs, and the counters of
/// [`rows_read`], are that session's.
async fn one_session(db: &TestMyDb) -> TestOutbox {
    Outbox::new(TestMyDb::connect(&db.url(), 1).await)
}

/// A claim of up to `events` events (and as many deliveries) on `outbox`, with the rows it read.
async fn claim_counted(outbox: &TestOutbox, events: i64) -> (outbox_core::store::Batch, i64) {
    let before = rows_read(outbox).await;
    let batch = outbox
        .store()
        .claim(
            ClaimLimit::events(u32::try_from(events).unwrap()),
            Duration::from_secs(60),
            &ClaimFilter::default(),
        )
        .await
        .unwrap();
    (batch, rows_read(outbox).await - before)
}

/// A claim's cost does not grow with the rows waiting in the keys of the events it claims: 10
/// aggregates each with 1 000 deliveries waiting behind a dead one for a subscriber that is
/// down, and 10 new events of each. The claim finds, for each event, that the subscriber holds
/// an earlier one (its key's last row, one probe) and reads at most 100 rows per event it
/// claims, where reading each aggregate's waiting rows for each event would be 1 000.
#[tokio::test]
async fn a_claim_reads_a_batch_whatever_waits_in_the_keys_of_its_events() {
    const KEYS: i64 = 10;
    const WAITING: i64 = 1_000;
    const NEW: i64 = 10;
    let (db, _outbox) = setup().await;
    fill(
        &db,
        &[
            events(
                1..=KEYS * WAITING,
                &format!("n % {KEYS}"),
                &[("published_at", NOW)],
            ),
            waiting_behind_dead_heads("TRUE"),
            events(1..=KEYS * NEW, &format!("n % {KEYS}"), &[]),
        ]
        .concat(),
    )
    .await;

    let (batch, read) = claim_counted(&one_session(&db).await, 1_000).await;
    assert_eq!(batch.claims.len() as i64, KEYS * NEW);
    assert!(
        batch.claims.iter().all(|claim| matches!(
            claim,
            outbox_core::store::Claim::Event { blocked, .. } if blocked == &["down"]
        )),
        "every event waits for the subscriber that is down"
    );
    assert!(
        read <= 100 * KEYS * NEW,
        "a claim of {} events read {read} rows ({KEYS} aggregates with {WAITING} deliveries \
         waiting each)",
        KEYS * NEW
    );
}

/// Runs `sql` (several statements) with recursive sets of up to a million rows allowed.
async fn fill(db: &TestMyDb, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET SESSION max_recursive_iterations = 1000000; {sql}"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

/// The server's time, in the SQL of a set-up.
const NOW: &str = "UTC_TIMESTAMP(6)";

/// SQL that analyzes the tables, at the end of a set-up.
const ANALYZED: &str = "ANALYZE TABLE outbox; ANALYZE TABLE outbox_deliveries;";

/// SQL that inserts an event for each `n` of `ns`, of aggregate `UNHEX(MD5(<aggregate>))`
/// (`aggregate`: an expression of `n`), type `E`, with each column of `set` given its value.
fn events(ns: std::ops::RangeInclusive<i64>, aggregate: &str, set: &[(&str, &str)]) -> String {
    let (from, to) = ns.into_inner();
    let columns: String = set
        .iter()
        .map(|(column, _)| format!(", {column}"))
        .collect();
    let values: String = set.iter().map(|(_, value)| format!(", {value}")).collect();
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at{columns})
         WITH RECURSIVE g (n) AS (SELECT {from} UNION ALL SELECT n + 1 FROM g WHERE n < {to})
         SELECT 'a', UNHEX(MD5({aggregate})), 'E', '{{}}', {NOW}{values} FROM g;"
    )
}

/// SQL that gives subscriber `down` a delivery row of each event `o` that `which` holds true
/// of: in each key, the first is dead and the others wait behind it.
fn waiting_behind_dead_heads(which: &str) -> String {
    format!(
        "INSERT INTO outbox_deliveries
             (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at, dead_at)
         SELECT o.id, 'down', 'a', o.aggregate_id,
                IF(f.first = o.id, {NOW}, NULL), IF(f.first = o.id, {NOW}, NULL)
         FROM outbox AS o
         JOIN (SELECT aggregate_id, min(id) AS first FROM outbox AS o WHERE {which}
               GROUP BY aggregate_id) AS f
           ON f.aggregate_id = o.aggregate_id
         WHERE {which};"
    )
}

/// A subscriber that is down does not slow the others' claims, however much waits for it:
/// 100 000 deliveries wait behind its dead head deliveries (1 000 keys), 10 000 events are
/// dead and 10 000 parked for an hour. A claim of a batch of new events and a batch of due deliveries of a healthy
/// subscriber reads at most 20 rows per row it claims, of every table.
#[tokio::test]
async fn a_claim_reads_a_batch_whatever_waits_behind_a_blocked_subscriber() {
    const BATCH: i64 = 100;
    const KEYS: i64 = 1_000;
    const WAITING: i64 = 100 * KEYS;
    const DEAD: i64 = 10_000;
    const PARKED: i64 = 10_000;
    let (db, _outbox) = setup().await;
    fill(
        &db,
        &[
            events(
                1..=WAITING,
                &format!("n % {KEYS}"),
                &[("published_at", NOW)],
            ),
            waiting_behind_dead_heads("TRUE"),
            events(1..=DEAD, "CONCAT('dead', n)", &[("dead_at", NOW)]),
            events(
                1..=PARKED,
                "CONCAT('parked', n)",
                &[("next_retry_at", &format!("{NOW} + INTERVAL 1 HOUR"))],
            ),
            // A batch of due deliveries of a healthy subscriber, and a batch of new events.
            format!(
                "INSERT INTO outbox_deliveries
                     (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at)
                 SELECT id, 'up', 'a', aggregate_id, {NOW}
                 FROM outbox WHERE published_at IS NOT NULL ORDER BY id DESC LIMIT {BATCH};"
            ),
            events(1..=BATCH, "CONCAT('new', n)", &[]),
            ANALYZED.to_owned(),
        ]
        .concat(),
    )
    .await;

    let (batch, read) = claim_counted(&one_session(&db).await, BATCH).await;
    assert_eq!(
        batch.claims.len() as i64,
        2 * BATCH,
        "the claim took both batches"
    );
    assert!(
        read <= 20 * 2 * BATCH,
        "a claim of {BATCH} + {BATCH} read {read} rows ({WAITING} deliveries waiting for a \
         subscriber that is down, {DEAD} dead events)"
    );
}

/// Events held back cost a claim a bounded amount of work, however many: an aggregate with a
/// dead event and 5 000 events already set aside behind it, 500 more arriving behind those, and
/// 20 000 deliveries waiting for a subscriber that is down. Each claim of 100 reads at most 20
/// rows per event of its batch (of every table), sets a batch of the new arrivals aside, and
/// once they are all aside, claims the other aggregates' events.
#[tokio::test]
async fn a_claim_reads_a_batch_whatever_is_held_back() {
    const BATCH: i64 = 100;
    const HELD: i64 = 50 * BATCH;
    const ARRIVING: i64 = 5 * BATCH;
    const WAITING: i64 = 200 * BATCH;
    let (db, _outbox) = setup().await;
    let stuck = "'stuck'";
    fill(
        &db,
        &[
            events(
                1..=WAITING,
                "CONCAT('published', n)",
                &[("published_at", NOW)],
            ),
            events(1..=1, stuck, &[("dead_at", NOW)]),
            events(
                1..=HELD,
                stuck,
                &[(
                    "held_behind",
                    "(SELECT id FROM outbox AS d WHERE d.dead_at IS NOT NULL)",
                )],
            ),
            events(1..=ARRIVING, stuck, &[]),
            events(1..=BATCH, "CONCAT('other', n)", &[]),
            format!(
                "INSERT INTO outbox_deliveries
                     (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at)
                 SELECT id, 'down', 'a', aggregate_id, {NOW} + INTERVAL 1 HOUR
                 FROM outbox WHERE published_at IS NOT NULL;"
            ),
            ANALYZED.to_owned(),
        ]
        .concat(),
    )
    .await;

    let claimer = one_session(&db).await;
    for round in 0..=ARRIVING / BATCH {
        let (batch, read) = claim_counted(&claimer, BATCH).await;
        assert!(
            read <= 20 * BATCH,
            "claim {round} read {read} rows ({HELD} events held back, {WAITING} deliveries \
             waiting)"
        );
        let expected = if round < ARRIVING / BATCH { 0 } else { BATCH };
        assert_eq!(batch.claims.len() as i64, expected, "claim {round}");
    }
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE held_behind IS NOT NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(held, HELD + ARRIVING);
}

/// Recording a batch of deliveries reads about the rows it records, however many wait behind
/// them: 50 keys with 200 deliveries waiting behind each due head. The record deletes what was
/// delivered and makes each key's next row due, by probes, reading at most 10 rows (of every
/// table) per row it records, where reading the waiting rows would be 10 000.
#[tokio::test]
async fn a_record_reads_about_the_rows_it_records_whatever_waits_behind_them() {
    const KEYS: i64 = 50;
    const WAITING: i64 = 200;
    let (db, _outbox) = setup().await;
    fill(
        &db,
        &[
            events(
                1..=KEYS * (WAITING + 1),
                &format!("n % {KEYS}"),
                &[("published_at", NOW)],
            ),
            format!(
                "INSERT INTO outbox_deliveries
                     (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at)
                 SELECT o.id, 'x', 'a', o.aggregate_id, IF(f.first = o.id, {NOW}, NULL)
                 FROM outbox AS o
                 JOIN (SELECT aggregate_id, min(id) AS first FROM outbox GROUP BY aggregate_id)
                   AS f ON f.aggregate_id = o.aggregate_id;"
            ),
            ANALYZED.to_owned(),
        ]
        .concat(),
    )
    .await;

    let relay = one_session(&db).await;
    let (batch, _) = claim_counted(&relay, 100).await;
    let mut outcomes = Outcomes::default();
    for claim in &batch.claims {
        let outbox_core::store::Claim::Delivery {
            event, subscriber, ..
        } = claim
        else {
            panic!("only deliveries wait: {claim:?}");
        };
        outcomes
            .deliveries
            .push(outbox_core::store::DeliveryRecord {
                event_id: event.id,
                aggregate_type: event.aggregate_type.clone(),
                aggregate_id: event.aggregate_id,
                subscriber: subscriber.clone(),
                outcome: outbox_core::store::DeliveryOutcome::Delivered,
            });
    }
    let recorded = outcomes.deliveries.len() as i64;
    assert!(
        recorded >= KEYS,
        "the claim took every key's head: {recorded}"
    );

    let before = rows_read(&relay).await;
    let applied = relay.store().record(batch.token, &outcomes).await.unwrap();
    let read = rows_read(&relay).await - before;
    assert_eq!(applied, Recorded::Applied);
    assert!(
        read <= 10 * recorded,
        "recording {recorded} deliveries read {read} rows ({} wait)",
        KEYS * WAITING
    );
    // Each key's next row is due now.
    let due: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_deliveries WHERE next_retry_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(due, KEYS);
}

/// Retention reads what it acts on, not the retained table: with 100 000 events published
/// recently (kept), 100 000 old ones that a blocked subscriber's waiting deliveries still hold
/// (kept), 10 000 dead events and 1 000 old events free to go, each purge reads at most a few
/// rows per row of its batch, the purges go through the held events once and delete exactly
/// the free ones.
#[tokio::test]
async fn a_purge_reads_what_it_acts_on_not_the_retained_table() {
    const BATCH: u32 = 500;
    const YOUNG: i64 = 100_000;
    const HELD: i64 = 100_000;
    const KEYS: i64 = 1_000;
    const DEAD: i64 = 10_000;
    const FREE: i64 = 1_000;
    const PENDING: i64 = 100;
    let (db, _outbox) = setup().await;
    // Old events, held and free interleaved, then young ones, dead ones, pending ones.
    let old = format!("{NOW} - INTERVAL 2 DAY + INTERVAL n * 1000 MICROSECOND");
    fill(
        &db,
        &[
            events(
                1..=HELD + FREE,
                &format!("n % {KEYS}"),
                &[("published_at", &old)],
            ),
            waiting_behind_dead_heads(&format!("o.id % ({HELD} / {FREE} + 1) <> 0")),
            events(1..=YOUNG, "CONCAT('young', n)", &[("published_at", NOW)]),
            events(1..=DEAD, "CONCAT('dead', n)", &[("dead_at", NOW)]),
            events(1..=PENDING, "CONCAT('new', n)", &[]),
            ANALYZED.to_owned(),
        ]
        .concat(),
    )
    .await;
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(held, HELD, "the set-up holds {HELD} old events");

    let purger = one_session(&db).await;
    let store = purger.store();
    let (mut deleted, mut calls) = (0, 0);
    loop {
        let before = rows_read(&purger).await;
        let purged = store
            .purge_published(Duration::from_secs(86_400), BATCH)
            .await
            .unwrap();
        let read = rows_read(&purger).await - before;
        calls += 1;
        assert!(
            read <= 6 * i64::from(BATCH),
            "purge {calls} read {read} rows for a batch of {BATCH}"
        );
        deleted += purged.deleted;
        if !purged.more {
            break;
        }
    }
    assert_eq!(deleted, FREE as u64, "exactly the free old events went");
    assert!(
        calls <= (HELD + FREE) / i64::from(BATCH) + 2,
        "{calls} purges went through {} old events",
        HELD + FREE
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, HELD + YOUNG + DEAD + PENDING, "the rest is kept");
}

/// The status counts what is not done without reading what is: with 100 000 events published
/// (and kept), 10 000 dead, 1 000 deliveries waiting behind 10 dead ones and 100 pending
/// events, it reads at most 15 rows per row it counts (what no live relay routes included:
/// about 10 in all), where one read of the published events alone is 100 000.
#[tokio::test]
async fn the_status_reads_none_of_the_published_events() {
    const PUBLISHED: i64 = 100_000;
    const DEAD: i64 = 10_000;
    const KEYS: i64 = 10;
    const WAITING: i64 = 1_000;
    const PENDING: i64 = 100;
    let (db, _outbox) = setup().await;
    fill(
        &db,
        &[
            events(
                1..=PUBLISHED,
                &format!("n % {KEYS}"),
                &[("published_at", NOW)],
            ),
            waiting_behind_dead_heads(&format!("o.id <= {WAITING}")),
            events(1..=DEAD, "CONCAT('dead', n)", &[("dead_at", NOW)]),
            events(1..=PENDING, "CONCAT('new', n)", &[]),
            ANALYZED.to_owned(),
        ]
        .concat(),
    )
    .await;

    // A live relay that routes `E` to `down`: the status then also counts what no relay routes.
    let outbox = one_session(&db).await;
    outbox
        .store()
        .register(
            Uuid::new_v4(),
            r#"{"events": [{"type": "E", "subscribers": ["down"]}],
                "subscribers": [{"name": "down"}], "protocol": 1}"#,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let before = rows_read(&outbox).await;
    let status = outbox.store().status().await.unwrap();
    let read = rows_read(&outbox).await - before;
    assert_eq!(status.pending_events, PENDING as u64);
    assert_eq!(status.pending_deliveries, (WAITING - KEYS) as u64);
    assert_eq!(status.dead_letters, (DEAD + KEYS) as u64);
    assert_eq!(status.behind_dead_letters, (WAITING - KEYS) as u64);
    assert_eq!(status.live_relays, 1);
    assert_eq!(
        (status.unroutable_events, status.unroutable_deliveries),
        (0, 0)
    );
    let counted = DEAD + PENDING + WAITING;
    assert!(
        read <= 15 * counted,
        "the status read {read} rows to count {counted} ({PUBLISHED} events published)"
    );
}

/// Each read an operator's console makes every few seconds (the count of the last minute's
/// publications, the overview, a page of each state, the dead letters' groups, the
/// subscribers), with the rows of every table it read.
async fn console_reads(console: &TestOutbox) -> Vec<(String, i64)> {
    let mut read = Vec::new();
    let mut at = rows_read(console).await;
    let mut since = async |what: String| {
        let now = rows_read(console).await;
        read.push((what, now - at));
        at = now;
    };
    console
        .published_within(Duration::from_secs(60))
        .await
        .unwrap();
    since("published_within".to_owned()).await;
    console.overview().await.unwrap();
    since("overview".to_owned()).await;
    for state in outbox_sqlx::ListState::ALL {
        console
            .list(&outbox_sqlx::ListQuery::new(state).limit(5))
            .await
            .unwrap();
        since(format!("list {state:?}")).await;
    }
    console.dead_letter_groups().await.unwrap();
    since("dead_letter_groups".to_owned()).await;
    console.subscribers().await.unwrap();
    since("subscribers".to_owned()).await;
    read
}

/// What an operator's console reads reads what it is about, not the retained table: with
/// 200 000 published events kept, 10 pending and 3 dead, each read reads at most 300 rows;
/// with 10 000 more dead (the optimizer's choices change when a twentieth of the table is
/// unpublished), at most 12 rows per unpublished event, where one read of the published
/// events alone is 200 000 (and reading the table by its primary key for a page of pending
/// events, as the lists did, 210 000).
#[tokio::test]
async fn console_reads_read_what_they_are_about() {
    const KEPT: i64 = 200_000;
    const DEAD: i64 = 10_000;
    let (db, _outbox) = setup().await;
    let dead = |ns| {
        events(
            ns,
            "CONCAT('dead', n)",
            &[("dead_at", NOW), ("last_error", "'undecodable'")],
        )
    };
    let yesterday = format!("{NOW} - INTERVAL 1 DAY");
    fill(
        &db,
        &[
            events(1..=KEPT, "n", &[("published_at", &yesterday)]),
            events(1..=10, "CONCAT('new', n)", &[]),
            dead(1..=3),
            ANALYZED.to_owned(),
        ]
        .concat(),
    )
    .await;
    let console = one_session(&db).await;
    let read = console_reads(&console).await;
    assert!(
        read.iter().all(|(_, rows)| *rows <= 300),
        "rows ({KEPT} published events kept, 13 unpublished) each read: {read:?}"
    );
    // And what they read is right.
    let overview = console.overview().await.unwrap();
    let counts = [
        outbox_sqlx::ListState::Pending,
        outbox_sqlx::ListState::Dead,
    ]
    .map(|s| overview.count(s));
    assert_eq!(counts, [10, 3], "pending, dead");
    let groups = console.dead_letter_groups().await.unwrap();
    assert_eq!(groups.iter().map(|g| g.dead).sum::<u64>(), 3);

    fill(&db, &[dead(4..=3 + DEAD), ANALYZED.to_owned()].concat()).await;
    let unpublished = 13 + DEAD;
    let read = console_reads(&console).await;
    assert!(
        read.iter().all(|(_, rows)| *rows <= 12 * unpublished),
        "rows ({KEPT} published events kept, {unpublished} unpublished) each read: {read:?}"
    );
    let overview = console.overview().await.unwrap();
    assert_eq!(
        overview.count(outbox_sqlx::ListState::Dead),
        3 + DEAD as u64
    );
    let page = console
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Pending).limit(5))
        .await
        .unwrap();
    assert_eq!(page.len(), 5, "a page of pending events");
}
