//! The MySQL / MariaDB backend: the same tables and semantics as PostgreSQL and SQLite, in
//! MySQL's dialect (MySQL 8.0, MariaDB 10.6 or later: `SKIP LOCKED`-era InnoDB, `JSON_TABLE`).
//!
//! The tables are named after [`TableNames::table`] alone, in the connection's database. Times
//! are `DATETIME(6)` in UTC, from the server's clock (`UTC_TIMESTAMP(6)`), so that relays on
//! several hosts agree on leases.
//!
//! What differs from PostgreSQL, and why it is still correct:
//!
//! - **Ids and commit order.** InnoDB takes an auto-increment id when a row is inserted, not when
//!   its transaction commits: a transaction that inserts first and commits last leaves its event
//!   behind later ids. Nothing here reads by a high-water mark: the claim scans every pending
//!   event in id order each time, so a late commit is found by the next claim after it. Within
//!   an aggregate, id order is commit order: a publishing transaction first locks (an `UPDATE`
//!   that changes nothing) the row of `<table>_aggregate_locks` its aggregate hashes to, until
//!   it commits, so a second transaction publishing for that aggregate takes its id only after
//!   the first committed.
//!   These are row locks, which every isolation level takes alike: the user's transaction may
//!   run at InnoDB's default REPEATABLE READ (its snapshot plays no part in publishing).
//! - **One claimer at a time.** Claims, skips, requeues and the records that write deliveries
//!   lock the one row of `<table>_claim_lock` first, for the rest of their transaction, and run
//!   at READ COMMITTED: each statement sees what every earlier one committed (under REPEATABLE
//!   READ a claim would read the snapshot of its first read). A relay that dies in one releases
//!   the lock with its connection. `GET_LOCK` is not used: its locks belong to the session, not
//!   the transaction, and would outlive a transaction whose connection goes back to the pool.
//!   A record that only settles events takes no claim lock: what a claim writes that such a
//!   record reads (an event set aside behind its claim) is written only while the claim holds
//!   that claim's row in share mode, which the record's delete of the row waits for.
//! - **Claims write one row.** The events a claim holds are listed in its row (with the first
//!   event of each aggregate), not marked on the events: the scans leave out what live claims
//!   list, and the events are free again the moment the row is deleted.
//! - **No `LISTEN/NOTIFY`.** Commits wake relays of the same `Outbox` in-process, as on every
//!   backend; relays of other processes find new events by polling.
//! - **No partial indexes.** Generated columns that are NULL outside the rows a scan looks for
//!   are indexed instead (see the migration).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use outbox_core::StoredEvent;
use outbox_core::store::{
    Batch, Claim, ClaimFilter, ClaimLimit, ClaimToken, DeliveryOutcome, DeliveryRecord,
    EventOutcome, Outcomes, Recorded, Registry, Status,
};
use serde_json::json;
use sqlx::mysql::MySqlRow;
use sqlx::{Executor, MySql, MySqlConnection, MySqlPool, Row, SqlStr, Transaction};
use time::{OffsetDateTime, PrimitiveDateTime};
use uuid::Uuid;

use crate::backend::{
    self, Backend, MIN_SHARE, Migration, Named, NewEvent, PurgeStep, PurgedUpTo, apply_migrations,
    due_in_micros, hold_after, payload_bytes, row_count, sealed, sql, subscribers_query,
};
use crate::error::Error;
use crate::names::TableNames;
use crate::views::{Dialect, dead_letter_groups_query, list_query, overview_query, requeue_record};

impl sealed::Sealed for MySql {}

/// The migrations, in order; templates for [`TableNames::render`].
const MIGRATIONS: &[Migration] = &[(
    1,
    "the outbox tables",
    include_str!("../migrations/mysql/0001_the_outbox_tables.sql"),
)];

/// How many rows `<table>_aggregate_locks` has (the migration creates them).
const AGGREGATE_SLOTS: u32 = 4096;

/// The start of every transaction that takes the claim lock.
const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// A JSON array of ids as a table `j (id)`.
const IDS: &str = "JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j";

/// The rows of `table` (as `alias`) whose `column` is in a JSON array of ids, read through
/// `index`: the array first, then one index lookup per id. The order and the index are forced:
/// for a small table MySQL would rather scan it, and a scan under an `UPDATE` waits for every
/// row another transaction holds (an event a producer has not committed yet), not only for
/// the rows it changes.
fn by_ids(table: &str, alias: &str, index: &str, column: &str) -> String {
    format!(
        "JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j
         STRAIGHT_JOIN {table} AS {alias} FORCE INDEX ({index}) ON {alias}.{column} = j.id"
    )
}

/// A JSON array of names as a table `j (name)`, compared as the tables compare names.
const NAMES: &str = "(SELECT name COLLATE utf8mb4_bin AS name
                      FROM JSON_TABLE(?, '$[*]' COLUMNS (name VARCHAR(255) PATH '$')) AS n)";

/// The SQL of one set of tables.
#[doc(hidden)]
#[derive(Debug)]
pub struct MySqlQueries {
    lock: SqlStr,
    now: SqlStr,
    /// When the earliest retry and the earliest parked event not due at `?` are due.
    next_due: SqlStr,
    lock_aggregate: SqlStr,
    outbox: String,
    aggregate_locks: String,
    insert_one: SqlStr,
    expire_relays: SqlStr,
    look_again_at_parked: SqlStr,
    register: SqlStr,
    unregister: SqlStr,
    live_relays: SqlStr,
    state: SqlStr,
    unroutable: SqlStr,
    expire_events: SqlStr,
    expire_deliveries: SqlStr,
    expire_holds: SqlStr,
    expire_claims: SqlStr,
    candidates: SqlStr,
    blockers: SqlStr,
    mark: SqlStr,
    share_claims: SqlStr,
    due_heads: SqlStr,
    /// The rows of each head's key from the head on, at most `share` of them (`{share}` is
    /// replaced by the offset of the last one).
    behind_heads: String,
    first_of_key: SqlStr,
    make_due: SqlStr,
    new_claim: SqlStr,
    blocked_by: SqlStr,
    claim_deliveries: SqlStr,
    claimed_deliveries: SqlStr,
    renew: SqlStr,
    hold_claim: SqlStr,
    receive: SqlStr,
    purge_inbox: SqlStr,
    end_claim: SqlStr,
    publish: SqlStr,
    unhold_behind: SqlStr,
    park: SqlStr,
    kill: SqlStr,
    unhold_by: SqlStr,
    /// Releases what was set aside behind a claim of the aggregates (a JSON array of [type,
    /// id as hex]) a record of part of it took out.
    unhold_freed: SqlStr,
    delete_delivery: SqlStr,
    upsert_delivery: SqlStr,
    release_deliveries: SqlStr,
    /// One delivery of a claim given back by a record of part of it.
    release_delivery: SqlStr,
    /// A live claim's row, locked: its events and aggregates (for a record of part of it).
    claim_row: SqlStr,
    /// The claim's row shrunk to what a record of part of it leaves.
    shrink_claim: SqlStr,
    requeue_events: SqlStr,
    requeue_event_deliveries: SqlStr,
    requeue_subscriber: SqlStr,
    dead_events_failing: SqlStr,
    record_requeue: SqlStr,
    requeues: SqlStr,
    purge_examined: SqlStr,
    purge: SqlStr,
    status: SqlStr,
    subscribers: SqlStr,
    dead_letter_groups: SqlStr,
    list: [SqlStr; 8],
    overview: SqlStr,
    published_within: SqlStr,
    find_delivery: SqlStr,
    skip_delivery: SqlStr,
    find_skippable_event: SqlStr,
    skip_event: SqlStr,
    record_skip: SqlStr,
}

/// `at + delay`, saturating at the latest time a `DATETIME` holds.
fn plus(at: PrimitiveDateTime, delay: Duration) -> PrimitiveDateTime {
    at.checked_add(time::Duration::try_from(delay).unwrap_or(time::Duration::MAX))
        .filter(|t| *t <= LATEST)
        .unwrap_or(LATEST)
}

/// `at - delay`, saturating at the earliest time a `DATETIME` holds.
fn minus(at: PrimitiveDateTime, delay: Duration) -> PrimitiveDateTime {
    at.checked_sub(time::Duration::try_from(delay).unwrap_or(time::Duration::MAX))
        .filter(|t| t.year() >= 1000)
        .unwrap_or(EARLIEST)
}

/// The earliest time a `DATETIME` holds.
const EARLIEST: PrimitiveDateTime = time::macros::datetime!(1000-01-01 0:00);

/// The latest time a `DATETIME` holds.
const LATEST: PrimitiveDateTime = time::macros::datetime!(9999-12-31 23:59:59.999_999);

fn micros(time: PrimitiveDateTime) -> i64 {
    i64::try_from(time.assume_utc().unix_timestamp_nanos() / 1000).unwrap_or(i64::MAX)
}

fn from_micros(micros: i64) -> PrimitiveDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1000).map_or(EARLIEST, utc)
}

/// A time as the tables hold it: UTC, without an offset. (Times are bound as `DATETIME`, never
/// as `TIMESTAMP`: MariaDB compares a `TIMESTAMP` parameter with an indexed `DATETIME` column
/// wrongly in range scans.)
fn utc(time: OffsetDateTime) -> PrimitiveDateTime {
    let time = time.to_offset(time::UtcOffset::UTC);
    PrimitiveDateTime::new(time.date(), time.time())
}

/// The first line of the text column `c`, as failure groups compare errors.
fn first_line(c: &str) -> String {
    format!("SUBSTRING_INDEX(coalesce({c}, ''), CHAR(10 USING utf8mb4), 1)")
}

/// The row of `<table>_aggregate_locks` an aggregate's publishers lock (FNV-1a of its id: stable
/// across builds, so that processes of different builds lock the same row).
fn aggregate_slot(aggregate_id: Uuid) -> i16 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in aggregate_id.as_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    i16::try_from(hash % AGGREGATE_SLOTS).unwrap_or(0)
}

/// `n` placeholders, comma-separated.
fn placeholders(n: usize, one: &str) -> String {
    vec![one; n].join(", ")
}

impl MySqlQueries {
    async fn now(&self, conn: &mut MySqlConnection) -> Result<PrimitiveDateTime, sqlx::Error> {
        sqlx::query_scalar(self.now.clone()).fetch_one(conn).await
    }
}

/// Begins a READ COMMITTED transaction that holds the claim lock; returns it with the server's
/// time once the lock is granted.
async fn begin_locked(
    pool: &MySqlPool,
    queries: &MySqlQueries,
) -> Result<(Transaction<'static, MySql>, PrimitiveDateTime), sqlx::Error> {
    let mut tx = pool.begin_with(BEGIN).await?;
    let now: PrimitiveDateTime = sqlx::query_scalar(queries.lock.clone())
        .fetch_one(&mut *tx)
        .await?;
    Ok((tx, now))
}

impl Backend for MySql {
    type Queries = MySqlQueries;

    #[allow(clippy::too_many_lines)]
    fn queries(names: &TableNames) -> MySqlQueries {
        let outbox = names.backticked("");
        let deliveries = names.backticked("_deliveries");
        let claims = names.backticked("_claims");
        let skips = names.backticked("_skips");
        let inbox = names.backticked("_inbox");
        let relays = names.backticked("_relays");
        let requeues = names.backticked("_requeues");
        let claim_lock = names.backticked("_claim_lock");
        let aggregate_locks = names.backticked("_aggregate_locks");
        let dialect = Dialect {
            outbox: &outbox,
            // The index that holds the unpublished events first, in id order: with a tenth
            // of the table unpublished, the optimizer read it whole by its primary key for a
            // page of a state, and for each count of the overview.
            unpublished: format!(
                "{outbox} AS o FORCE INDEX ({})",
                names.backticked("_published_idx")
            ),
            deliveries: &deliveries,
            skips: &skips,
            claimed_event: format!(
                "EXISTS (SELECT 1 FROM {claims} AS k
                         WHERE JSON_CONTAINS(k.event_ids, CAST(o.id AS CHAR)))"
            ),
            payload: "o.payload",
            param: |n, ty| match (n, ty) {
                // `LIMIT` takes a placeholder, not a column.
                (6, _) => "?".to_owned(),
                (_, "text") => format!("p.p{n} COLLATE utf8mb4_bin"),
                _ => format!("p.p{n}"),
            },
            params: ", (SELECT ? AS p1, ? AS p2, ? AS p3, ? AS p4, ? AS p5) AS p",
        };
        let line = first_line("last_error");
        let index = |suffix: &str| names.backticked(suffix);
        let events_by_id = by_ids(&outbox, "o", "PRIMARY", "id");
        // The events the live claims hold (and those of expired claims not yet ended).
        let live = format!(
            "(SELECT j.id FROM {claims} AS k,
                  JSON_TABLE(k.event_ids, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j)"
        );
        MySqlQueries {
            lock: sql(format!(
                "SELECT UTC_TIMESTAMP(6) FROM {claim_lock} WHERE id = 1 FOR UPDATE"
            )),
            now: sql("SELECT UTC_TIMESTAMP(6)".to_owned()),
            // (`deliveries_due_idx`, `parked_idx`, `claims_until_idx`: a probe each. A live
            // claim expires, its relay dead and its work free, the first moment after `until`.)
            // (The first due time not claimed, read in the index's order up to it: `min()`
            // with a condition on another column read every later due time too.)
            next_due: sql(format!(
                "SELECT (SELECT due_at FROM {deliveries} FORCE INDEX ({due})
                         WHERE due_at > ? AND claim_id IS NULL ORDER BY due_at LIMIT 1),
                        (SELECT min(parked_until) FROM {outbox} WHERE parked_until > ?),
                        (SELECT min(until) + INTERVAL 1 MICROSECOND FROM {claims} WHERE until >= ?)",
                due = index("_deliveries_due_idx"),
            )),
            lock_aggregate: sql(format!(
                "UPDATE {aggregate_locks} SET slot = slot WHERE slot = ?"
            )),
            outbox: outbox.clone(),
            aggregate_locks: aggregate_locks.clone(),
            insert_one: sql(format!(
                "INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, occurred_at)
                 VALUES (?, ?, ?, ?, coalesce(?, UTC_TIMESTAMP(6)))"
            )),
            expire_relays: sql(format!("DELETE FROM {relays} WHERE seen_at < ? AND id <> ?")),
            // After `expire_relays`: a build that no live relay runs arrives (this relay's
            // first registration, a routing no live relay has); it may read what was parked
            // for want of a build, so parked events are due now, not when their park ends.
            // (`parked_idx`.)
            look_again_at_parked: sql(format!(
                "UPDATE {outbox} SET next_retry_at = ?
                 WHERE parked_until > ?
                   AND NOT EXISTS (SELECT 1 FROM {relays} WHERE id = ? OR routing = ?)"
            )),
            // A new registration takes the next generation; a renewal keeps its own.
            register: sql(format!(
                "INSERT INTO {relays} (id, generation, routing, registered_at, seen_at)
                 SELECT ?, coalesce(max(generation), 0) + 1, ?, ?, ? FROM {relays}
                 ON DUPLICATE KEY UPDATE routing = VALUES(routing), seen_at = VALUES(seen_at)"
            )),
            unregister: sql(format!("DELETE FROM {relays} WHERE id = ?")),
            live_relays: sql(format!(
                "SELECT id, generation, routing FROM {relays} WHERE seen_at >= ?"
            )),
            // What the claim needs to know first: the registry's version, the expired claims
            // and their events, whether any unpublished event is set aside, parked or dead,
            // the live claims (whether each has lasted, and the first event of each aggregate
            // it holds) and whether any delivery row exists.
            state: sql(format!(
                "SELECT (SELECT coalesce(GROUP_CONCAT(generation ORDER BY generation
                                                      SEPARATOR ','), '')
                         FROM {relays}),
                        (SELECT coalesce(JSON_ARRAYAGG(id), '[]') FROM {claims} WHERE until < ?),
                        (SELECT coalesce(JSON_ARRAYAGG(j.id), '[]')
                         FROM {claims} AS k,
                              JSON_TABLE(k.event_ids, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j
                         WHERE k.until < ?),
                        EXISTS (SELECT 1 FROM {outbox} WHERE stalled = 1),
                        (SELECT coalesce(JSON_ARRAYAGG(JSON_ARRAY(id, IF(claimed_at < ?, 1, 0),
                                                                  JSON_EXTRACT(aggregates, '$'))),
                                         '[]')
                         FROM {claims} WHERE until >= ?),
                        EXISTS (SELECT 1 FROM {deliveries})"
            )),
            // (The unpublished events that are not dead, by the indexes of pending and of
            // stalled events, as the status reads them.)
            unroutable: sql(format!(
                "SELECT (SELECT count(*) FROM {outbox} FORCE INDEX ({pending})
                         WHERE pending = 1 AND event_type NOT IN {NAMES})
                          + (SELECT count(*) FROM {outbox} FORCE INDEX ({stalled})
                             WHERE stalled = 1 AND dead_at IS NULL
                               AND event_type NOT IN {NAMES}),
                        (SELECT count(*) FROM {deliveries}
                         WHERE dead_at IS NULL AND subscriber NOT IN {NAMES}),
                        (SELECT min(t.occurred_at) FROM (
                             SELECT min(occurred_at) AS occurred_at
                             FROM {outbox} FORCE INDEX ({pending})
                             WHERE pending = 1 AND event_type NOT IN {NAMES}
                             UNION ALL
                             SELECT min(occurred_at) FROM {outbox} FORCE INDEX ({stalled})
                             WHERE stalled = 1 AND dead_at IS NULL
                               AND event_type NOT IN {NAMES}) AS t),
                        (SELECT min(o.occurred_at)
                         FROM {deliveries} AS d JOIN {outbox} AS o ON o.id = d.event_id
                         WHERE d.dead_at IS NULL AND d.subscriber NOT IN {NAMES}),
                        UTC_TIMESTAMP(6)",
                pending = index("_pending_idx"),
                stalled = index("_stalled_idx"),
            )),
            expire_events: sql(format!(
                "UPDATE {events_by_id} SET o.expired_claims = o.expired_claims + 1
                 WHERE o.published_at IS NULL"
            )),
            expire_deliveries: sql(format!(
                "UPDATE {} SET d.claim_id = NULL, d.expired_claims = d.expired_claims + 1",
                by_ids(&deliveries, "d", &index("_deliveries_claim_idx"), "claim_id")
            )),
            expire_holds: sql(format!(
                "UPDATE {} SET o.held_by = NULL",
                by_ids(&outbox, "o", &index("_held_by_idx"), "held_by")
            )),
            // (Only if it is still expired: a handler holding it may have had it renewed.)
            expire_claims: sql(format!(
                "DELETE k FROM {} WHERE k.until < ?",
                by_ids(&claims, "k", "PRIMARY", "id")
            )),
            // The next pending events nothing holds, in id order, and the parked ones due, with
            // what a claim hands on.
            candidates: sql(format!(
                r#"
SELECT c.id, c.aggregate_type, c.aggregate_id, c.event_type, c.payload, c.occurred_at,
       c.retry_count, c.expired_claims, LENGTH(c.payload) AS payload_bytes
FROM (
    (SELECT * FROM {outbox} WHERE pending = 1 AND id NOT IN {live}
     ORDER BY pending, id LIMIT ?)
    UNION ALL
    (SELECT * FROM {outbox}
     WHERE parked_until <= ? AND held_by IS NULL AND held_behind IS NULL AND id NOT IN {live}
     ORDER BY parked_until LIMIT ?)
) AS c
ORDER BY c.id"#
            )),
            // For each aggregate of the candidates ($2: [type, id as hex, last candidate id]),
            // its first unpublished event below its last candidate that is not a candidate
            // ($1: the candidates' ids), with that event's claim and holds: every candidate of
            // the aggregate above it waits for it. (The blockers are found first, then read by
            // primary key: joined on the subquery, the event table was scanned whole.)
            blockers: sql(format!(
                r#"
SELECT b.n, e.id, k.id, k.claimed_at, e.held_by, e.held_behind
FROM (
    SELECT a.n, (
        SELECT x.id FROM {outbox} AS x
        WHERE x.unpublished_aggregate = UNHEX(a.a) AND x.aggregate_type = a.t COLLATE utf8mb4_bin
          AND x.id < a.last
          AND x.id NOT IN (SELECT id FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS c)
        ORDER BY x.id
        LIMIT 1) AS blocker
    FROM JSON_TABLE(?, '$[*]' COLUMNS (
             n FOR ORDINALITY,
             t VARCHAR(255) PATH '$[0]',
             a CHAR(32) PATH '$[1]',
             last BIGINT PATH '$[2]')) AS a
) AS b
STRAIGHT_JOIN {outbox} AS e FORCE INDEX (PRIMARY) ON e.id = b.blocker
LEFT JOIN {claims} AS k ON JSON_CONTAINS(k.event_ids, CAST(e.id AS CHAR))"#
            )),
            mark: sql(format!(
                "UPDATE {outbox} SET held_by = ?, held_behind = ? WHERE id = ?"
            )),
            share_claims: sql(format!(
                "SELECT k.id, k.aggregates FROM {} LOCK IN SHARE MODE",
                by_ids(&claims, "k", "PRIMARY", "id")
            )),
            // Due deliveries that are the first of their key: rows behind a head have no due
            // time and are not read here, however many wait. (Not those of subscribers left to
            // relays of other builds.)
            due_heads: sql(format!(
                r#"
SELECT d.subscriber, d.aggregate_type, d.aggregate_id, d.event_id FROM {deliveries} AS d
WHERE d.due_at <= ? AND d.claim_id IS NULL
  AND d.subscriber NOT IN {NAMES}
  AND NOT EXISTS (
      SELECT 1 FROM {deliveries} AS h
      WHERE h.subscriber = d.subscriber AND h.aggregate_id = d.aggregate_id
        AND h.aggregate_type = d.aggregate_type AND h.event_id < d.event_id)
ORDER BY d.due_at
LIMIT ?"#
            )),
            behind_heads: format!(
                r#"
SELECT h.n, f.subscriber, f.event_id,
       CASE WHEN f.event_id = h.e
                 OR (f.dead_at IS NULL AND f.claim_id IS NULL
                     AND (f.next_retry_at IS NULL OR f.next_retry_at <= ?))
            THEN 1 ELSE 0 END AS ready,
       (SELECT LENGTH(o.payload) FROM {outbox} AS o WHERE o.id = f.event_id) AS payload_bytes
FROM JSON_TABLE(?, '$[*]' COLUMNS (
         n FOR ORDINALITY,
         s VARCHAR(255) PATH '$[0]',
         t VARCHAR(255) PATH '$[1]',
         a CHAR(32) PATH '$[2]',
         e BIGINT PATH '$[3]')) AS h
JOIN {deliveries} AS f
  ON f.subscriber = h.s COLLATE utf8mb4_bin AND f.aggregate_id = UNHEX(h.a)
 AND f.aggregate_type = h.t COLLATE utf8mb4_bin AND f.event_id >= h.e
 AND f.event_id <= coalesce((
     SELECT x.event_id FROM {deliveries} AS x
     WHERE x.subscriber = h.s COLLATE utf8mb4_bin AND x.aggregate_id = UNHEX(h.a)
       AND x.aggregate_type = h.t COLLATE utf8mb4_bin AND x.event_id >= h.e
     ORDER BY x.event_id LIMIT 1 OFFSET {{share}}),
     9223372036854775807)
ORDER BY h.n, f.event_id"#
            ),
            first_of_key: sql(format!(
                "SELECT event_id, next_retry_at IS NULL AND dead_at IS NULL AS waits
                 FROM {deliveries}
                 WHERE subscriber = ? AND aggregate_id = ? AND aggregate_type = ?
                 ORDER BY event_id LIMIT 1"
            )),
            make_due: sql(format!(
                "UPDATE {deliveries} SET next_retry_at = ? WHERE subscriber = ? AND event_id = ?"
            )),
            new_claim: sql(format!(
                "INSERT INTO {claims} (until, claimed_at, event_ids, aggregates) VALUES (?, ?, ?, ?)"
            )),
            // For each event of the claim ($1: their ids), the subscribers with a delivery of
            // its aggregate that this claim ($2) does not take: they run first, in its
            // subscriber's queue. Those whose last row of the key this claim does not take (it
            // takes a key's rows from its head on): one backward probe of `deliveries_head_idx`
            // per event and subscriber with deliveries (those read once, a step of the primary
            // key each), however many rows wait in the key. (A join with the aggregate's
            // deliveries read all of them for each event: 1 000 rows an event, for an
            // aggregate with 1 000 waiting.)
            blocked_by: sql(format!(
                "SELECT o.id, s.subscriber
                 FROM {} STRAIGHT_JOIN (SELECT DISTINCT subscriber FROM {deliveries}) AS s
                 WHERE coalesce((
                     SELECT NOT (d.claim_id <=> ?) FROM {deliveries} AS d FORCE INDEX ({})
                     WHERE d.subscriber = s.subscriber AND d.aggregate_id = o.aggregate_id
                       AND d.aggregate_type = o.aggregate_type
                     ORDER BY d.event_id DESC LIMIT 1), 0) = 1
                 ORDER BY o.id, s.subscriber",
                events_by_id,
                index("_deliveries_head_idx")
            )),
            claim_deliveries: sql(format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (s VARCHAR(255) PATH '$[0]',
                                                     e BIGINT PATH '$[1]')) AS j
                 STRAIGHT_JOIN {deliveries} AS d FORCE INDEX (PRIMARY)
                   ON d.subscriber = j.s COLLATE utf8mb4_bin AND d.event_id = j.e
                 SET d.claim_id = ?"
            )),
            claimed_deliveries: sql(format!(
                "SELECT d.subscriber, d.attempts, d.expired_claims, o.id, o.aggregate_type,
                        o.aggregate_id, o.event_type, o.payload, o.occurred_at
                 FROM {deliveries} AS d JOIN {outbox} AS o ON o.id = d.event_id
                 WHERE d.claim_id = ?"
            )),
            renew: sql(format!(
                "UPDATE {claims} SET until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
                 WHERE id = ? AND until >= UTC_TIMESTAMP(6)"
            )),
            // (A write that changes nothing: it locks the claim's row for the transaction.)
            hold_claim: sql(format!(
                "UPDATE {claims} SET until = until WHERE id = ? AND until >= UTC_TIMESTAMP(6)"
            )),
            // (Consumer and message id are checked for length before: IGNORE only ever
            // ignores the duplicate.)
            receive: sql(format!(
                "INSERT IGNORE INTO {inbox} (consumer, message_id, handled_at)
                 VALUES (?, ?, UTC_TIMESTAMP(6))"
            )),
            purge_inbox: sql(format!(
                "DELETE FROM {inbox} WHERE handled_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
                 ORDER BY handled_at LIMIT ?"
            )),
            end_claim: sql(format!("DELETE FROM {claims} WHERE id = ? AND until >= ?")),
            publish: sql(format!(
                "UPDATE {events_by_id} SET o.published_at = ?"
            )),
            // (Through the rows set aside, usually none, not through the ids.)
            unhold_behind: sql(format!(
                "UPDATE {outbox} SET held_behind = NULL
                 WHERE held_behind IS NOT NULL
                   AND held_behind IN (SELECT id FROM {IDS})"
            )),
            park: sql(format!(
                "UPDATE {outbox}
                 SET retry_count = retry_count + 1, last_error = ?, next_retry_at = ?
                 WHERE id = ?"
            )),
            kill: sql(format!(
                "UPDATE {outbox} SET dead_at = ?, last_error = ? WHERE id = ?"
            )),
            unhold_by: sql(format!("UPDATE {outbox} SET held_by = NULL WHERE held_by = ?")),
            // (Through the aggregates' unpublished events, one index range each.)
            unhold_freed: sql(format!(
                "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (t VARCHAR(255) PATH '$[0]',
                                                     a CHAR(32) PATH '$[1]')) AS f
                 STRAIGHT_JOIN {outbox} AS o FORCE INDEX ({aggregate})
                   ON o.unpublished_aggregate = UNHEX(f.a)
                  AND o.aggregate_type = f.t COLLATE utf8mb4_bin
                 SET o.held_by = NULL
                 WHERE o.held_by = ?",
                aggregate = index("_aggregate_idx")
            )),
            delete_delivery: sql(format!(
                "DELETE FROM {deliveries} WHERE subscriber = ? AND event_id = ? AND claim_id = ?"
            )),
            upsert_delivery: sql(format!(
                "INSERT INTO {deliveries}
                     (event_id, subscriber, aggregate_type, aggregate_id, attempts, last_error,
                      next_retry_at, dead_at)
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?)
                 ON DUPLICATE KEY UPDATE
                     attempts = VALUES(attempts), last_error = VALUES(last_error),
                     next_retry_at = VALUES(next_retry_at), dead_at = VALUES(dead_at),
                     claim_id = NULL"
            )),
            release_deliveries: sql(format!(
                "UPDATE {deliveries} SET claim_id = NULL WHERE claim_id = ?"
            )),
            release_delivery: sql(format!(
                "UPDATE {deliveries} SET claim_id = NULL
                 WHERE subscriber = ? AND event_id = ? AND claim_id = ?"
            )),
            claim_row: sql(format!(
                "SELECT event_ids, aggregates FROM {claims} WHERE id = ? AND until >= ? FOR UPDATE"
            )),
            shrink_claim: sql(format!(
                "UPDATE {claims} SET event_ids = ?, aggregates = ? WHERE id = ?"
            )),
            requeue_events: sql(format!(
                "UPDATE {events_by_id}
                 SET o.dead_at = NULL, o.next_retry_at = NULL, o.retry_count = 0,
                     o.last_error = NULL
                 WHERE o.published_at IS NULL
                   AND (o.dead_at IS NOT NULL OR o.next_retry_at IS NOT NULL)"
            )),
            requeue_event_deliveries: sql(format!(
                "UPDATE {}
                 SET d.dead_at = NULL, d.attempts = 0, d.next_retry_at = ?, d.last_error = NULL
                 WHERE d.dead_at IS NOT NULL",
                by_ids(&deliveries, "d", &index("_deliveries_event_idx"), "event_id")
            )),
            requeue_subscriber: sql(format!(
                "UPDATE {deliveries}
                 SET dead_at = NULL, attempts = 0, next_retry_at = ?, last_error = NULL
                 WHERE subscriber = ? AND dead_at IS NOT NULL AND (? IS NULL OR {line} = ?)"
            )),
            requeues: sql(format!(
                "SELECT id, event_ids, subscriber, first_line, requeued, reason, requeued_at
                 FROM {requeues} WHERE id < ? ORDER BY id DESC LIMIT ?"
            )),
            record_requeue: sql(format!(
                "INSERT INTO {requeues}
                     (event_ids, subscriber, first_line, requeued, reason, requeued_at)
                 VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))"
            )),
            dead_events_failing: sql(format!(
                "SELECT id FROM {outbox}
                 WHERE published_at IS NULL AND dead_at IS NOT NULL AND {line} = ?
                 ORDER BY id"
            )),
            list: crate::ListState::ALL.map(|state| sql(list_query(&dialect, state))),
            overview: sql(overview_query(&dialect)),
            published_within: sql(format!(
                "SELECT count(*) FROM {outbox}
                 WHERE published_at > UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
            )),
            dead_letter_groups: sql(dead_letter_groups_query(&dialect, first_line)),
            // Each count reads what it counts, by index: unpublished events are pending
            // (`pending_idx`) or set aside, parked or dead (`stalled_idx`, read once for all
            // its counts), however many published ones the table keeps. The indexes are
            // named: with dead letters a tenth of the table, the optimizer read the whole
            // table for each count.
            status: sql(format!(
                r#"
SELECT p.n + s.live,
       CASE WHEN p.oldest IS NULL OR s.oldest < p.oldest THEN s.oldest ELSE p.oldest END,
       (SELECT count(*) FROM {deliveries} WHERE dead_at IS NULL),
       s.dead + (SELECT count(*) FROM {deliveries} WHERE dead_at IS NOT NULL),
       (SELECT count(*) FROM (
            SELECT DISTINCT subscriber, aggregate_type, aggregate_id FROM {deliveries}) AS k),
       s.aggregates,
       (SELECT count(*) FROM {outbox} WHERE held_by IS NOT NULL)
         + (SELECT count(*) FROM {outbox} WHERE held_behind IS NOT NULL),
       -- What dead letters hold back: events of an aggregate set aside after its first dead
       -- event, deliveries of a key after its first dead one.
       (SELECT count(*) FROM (
            SELECT aggregate_type, aggregate_id, min(id) AS id FROM {outbox}
            FORCE INDEX ({stalled})
            WHERE stalled = 1 AND dead_at IS NOT NULL
            GROUP BY aggregate_type, aggregate_id) AS r
        JOIN {outbox} AS e
          ON e.unpublished_aggregate = r.aggregate_id AND e.aggregate_type = r.aggregate_type
        WHERE e.dead_at IS NULL AND e.id > r.id
          AND (e.next_retry_at IS NOT NULL OR e.held_by IS NOT NULL
               OR e.held_behind IS NOT NULL))
         + (SELECT count(*) FROM (
                SELECT subscriber, aggregate_type, aggregate_id, min(event_id) AS event_id
                FROM {deliveries} WHERE dead_at IS NOT NULL
                GROUP BY subscriber, aggregate_type, aggregate_id) AS k
            JOIN {deliveries} AS d
              ON d.subscriber = k.subscriber AND d.aggregate_id = k.aggregate_id
             AND d.aggregate_type = k.aggregate_type
            WHERE d.dead_at IS NULL AND d.event_id > k.event_id),
       UTC_TIMESTAMP(6)
FROM (SELECT count(*) AS n, min(occurred_at) AS oldest
      FROM {outbox} FORCE INDEX ({pending}) WHERE pending = 1) AS p,
     (SELECT CAST(coalesce(sum(dead_at IS NULL), 0) AS SIGNED) AS live,
             CAST(coalesce(sum(dead_at IS NOT NULL), 0) AS SIGNED) AS dead,
             min(IF(dead_at IS NULL, occurred_at, NULL)) AS oldest,
             count(DISTINCT aggregate_type, aggregate_id) AS aggregates
      FROM {outbox} FORCE INDEX ({stalled}) WHERE stalled = 1) AS s"#,
                pending = index("_pending_idx"),
                stalled = index("_stalled_idx"),
            )),
            subscribers: sql(subscribers_query(&deliveries)),
            find_delivery: sql(format!(
                "SELECT attempts, last_error, aggregate_type, aggregate_id FROM {deliveries}
                 WHERE event_id = ? AND subscriber = ? AND claim_id IS NULL FOR UPDATE"
            )),
            skip_delivery: sql(format!(
                "DELETE FROM {deliveries} WHERE event_id = ? AND subscriber = ?"
            )),
            find_skippable_event: sql(format!(
                "SELECT o.retry_count AS attempts, o.last_error FROM {outbox} AS o
                 WHERE o.id = ? AND o.published_at IS NULL
                   AND (o.dead_at IS NOT NULL OR o.next_retry_at IS NOT NULL)
                   AND NOT {claimed}
                 FOR UPDATE",
                claimed = dialect.claimed_event
            )),
            skip_event: sql(format!(
                "UPDATE {outbox} SET published_at = ?, dead_at = NULL, next_retry_at = NULL
                 WHERE id = ?"
            )),
            record_skip: sql(format!(
                "INSERT INTO {skips} (event_id, subscriber, attempts, last_error, reason, skipped_at)
                 VALUES (?, ?, ?, ?, ?, ?)"
            )),
            purge_examined: sql(format!(
                r#"
SELECT o.id, o.published_at,
       EXISTS (SELECT 1 FROM {deliveries} AS d WHERE d.event_id = o.id) AS held
FROM {outbox} AS o
WHERE o.published_at < ?
  AND (o.published_at > ? OR (o.published_at = ? AND o.id > ?))
ORDER BY o.published_at, o.id
LIMIT ?"#
            )),
            // (What a delivery still holds stays, whatever the examination saw.)
            purge: sql(format!(
                "DELETE o FROM {events_by_id}
                 WHERE NOT EXISTS (SELECT 1 FROM {deliveries} AS d WHERE d.event_id = o.id)"
            )),
        }
    }

    async fn migrate(pool: &MySqlPool, names: &TableNames) -> Result<(), Error> {
        let migrations = names.backticked("_migrations");
        let mut conn = pool.acquire().await?;
        // MySQL commits around every DDL statement: migrations cannot run in a transaction.
        // One migrator at a time, by a lock of the session (released below, or with the
        // connection if this process dies).
        let lock = format!("outbox_migrate_{}", names.lock_namespace());
        let granted: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if granted != Some(1) {
            return Err(Error::Database(sqlx::Error::Protocol(format!(
                "another process has been migrating the outbox tables for a minute (lock {lock})"
            ))));
        }
        let result = async {
            conn.execute(sqlx::raw_sql(sql(format!(
                "CREATE TABLE IF NOT EXISTS {migrations} (
                     version     INT NOT NULL PRIMARY KEY,
                     description TEXT NOT NULL,
                     applied_at  DATETIME(6) NOT NULL
                 ) ENGINE = InnoDB"
            ))))
            .await?;
            apply_migrations::<MySql>(
                &mut conn,
                names,
                MIGRATIONS,
                i32::MAX,
                &migrations,
                &format!(
                    "INSERT INTO {migrations} (version, description, applied_at)
                     VALUES (?, ?, UTC_TIMESTAMP(6))"
                ),
                |template| names.render(template, |s| names.backticked(s), |s| names.backticked(s)),
            )
            .await
        }
        .await;
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        result?;
        released?;
        Ok(())
    }

    async fn insert(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        events: &[NewEvent],
    ) -> Result<(), sqlx::Error> {
        // The aggregates' rows first, in one order (two transactions locking the same rows
        // never wait for each other crosswise within one publish), then the insert. The lock
        // is an `UPDATE` that changes nothing: it takes the rows' exclusive locks as
        // `SELECT ... FOR UPDATE` does, and sends no result set back (measured, the producer
        // went from 0.80 to 0.85 of raw inserts' commits/s). Tried and slower: one
        // `INSERT ... SELECT ... FOR UPDATE` (under MariaDB's default
        // `innodb_autoinc_lock_mode = 1` it takes the table's auto-increment lock for the
        // statement: 895 us against 340 us per insert), and the lock and the insert sent as
        // one text query with the values as literals (0.78: the server parses the insert
        // each time, which costs more than the round trip it saves).
        let slots: BTreeSet<i16> = events
            .iter()
            .map(|e| aggregate_slot(e.aggregate_id))
            .collect();
        if let [slot] = slots.iter().copied().collect::<Vec<_>>()[..] {
            sqlx::query(queries.lock_aggregate.clone())
                .bind(slot)
                .execute(&mut *conn)
                .await?;
        } else {
            let mut lock = sqlx::query(sql(format!(
                "UPDATE {} SET slot = slot WHERE slot IN ({}) ORDER BY slot",
                queries.aggregate_locks,
                placeholders(slots.len(), "?")
            )));
            for slot in &slots {
                lock = lock.bind(*slot);
            }
            lock.execute(&mut *conn).await?;
        }

        if let [event] = events {
            sqlx::query(queries.insert_one.clone())
                .bind(event.aggregate_type)
                .bind(event.aggregate_id)
                .bind(event.event_type)
                .bind(&event.payload)
                .bind(event.occurred_at.map(utc))
                .execute(conn)
                .await?;
            return Ok(());
        }
        // One statement with a row per event: the rows take their ids in this order.
        let mut insert = sqlx::query(sql(format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, occurred_at)
             VALUES {}",
            queries.outbox,
            placeholders(events.len(), "(?, ?, ?, ?, coalesce(?, UTC_TIMESTAMP(6)))")
        )));
        for event in events {
            insert = insert
                .bind(event.aggregate_type)
                .bind(event.aggregate_id)
                .bind(event.event_type)
                .bind(&event.payload)
                .bind(event.occurred_at.map(utc));
        }
        insert.execute(conn).await?;
        Ok(())
    }

    #[allow(clippy::too_many_lines)]
    async fn claim(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        limit: ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, sqlx::Error> {
        // The lease runs from when the claim lock is granted.
        let (mut tx, now) = begin_locked(pool, queries).await?;
        let until = plus(now, lease);
        let old = minus(now, hold_after(lease));

        let (registry, expired, expired_events, stalled, live, deliveries): (
            String,
            String,
            String,
            i64,
            String,
            i64,
        ) = sqlx::query_as(queries.state.clone())
            .bind(now)
            .bind(now)
            .bind(old)
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
        // Expired claims end: their work is free again, and counts a redelivery.
        if expired != "[]" {
            sqlx::query(queries.expire_events.clone())
                .bind(&expired_events)
                .execute(&mut *tx)
                .await?;
            for query in [&queries.expire_deliveries, &queries.expire_holds] {
                sqlx::query(query.clone())
                    .bind(&expired)
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(queries.expire_claims.clone())
                .bind(&expired)
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }

        let candidates = sqlx::query(queries.candidates.clone())
            .bind(i64::from(limit.events))
            .bind(now)
            .bind(i64::from(limit.events))
            .fetch_all(&mut *tx)
            .await?;
        // Which candidates wait, and which of those are set aside (and behind what): behind
        // an event a live claim holds, read from the claims' rows; behind one set aside, parked
        // or dead, when there is any, probed for each aggregate (the probe finds claimed ones
        // too).
        let blockers = if stalled == 1 {
            blockers(&mut tx, queries, &candidates, old).await?
        } else {
            claimed_aggregates(&live)?
        };
        let mut claimable = Vec::new();
        let mut budget = limit.budget();
        let mut marks = Vec::new();
        let mut skipped: HashSet<(String, Uuid)> = Default::default();
        for row in &candidates {
            let id: i64 = row.try_get("id")?;
            let aggregate: (String, Uuid) =
                (row.try_get("aggregate_type")?, row.try_get("aggregate_id")?);
            if !filter.skip_event_types.is_empty() {
                let event_type: String = row.try_get("event_type")?;
                if filter.skip_event_types.contains(&event_type) {
                    skipped.insert(aggregate);
                    continue;
                }
                if skipped.contains(&aggregate) {
                    continue;
                }
            }
            let Some(blocker) = blockers.get(&aggregate).filter(|b| b.id < id) else {
                if budget.take(payload_bytes(row.try_get("payload_bytes")?)) {
                    claimable.push(row);
                }
                continue;
            };
            let mark = match blocker.claim {
                // Behind a claim: set aside only once the claim has lasted.
                Some(claim) => blocker.lasted.then_some((Some(claim), None)),
                None if blocker.held_by.is_some() || blocker.held_behind.is_some() => {
                    Some((blocker.held_by, blocker.held_behind))
                }
                // Behind a dead or parked event.
                None => Some((None, Some(blocker.id))),
            };
            if let Some(mark) = mark {
                marks.push((id, mark, aggregate));
            }
        }
        // (Asks for another claim at once even when a mark is dropped: its event is free.)
        let more = !marks.is_empty();
        let marks = hold_behind_claims(&mut tx, queries, marks).await?;
        for (id, (by, behind), _) in &marks {
            sqlx::query(queries.mark.clone())
                .bind(by)
                .bind(behind)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        let due = if deliveries == 1 {
            due_deliveries(&mut tx, queries, now, limit, filter).await?
        } else {
            Vec::new()
        };
        if claimable.is_empty() && due.is_empty() {
            // (For the relay to wake when the next retry is due, whoever recorded it.)
            let (retry, parked, expiry): (
                Option<PrimitiveDateTime>,
                Option<PrimitiveDateTime>,
                Option<PrimitiveDateTime>,
            ) = sqlx::query_as(queries.next_due.clone())
                .bind(now)
                .bind(now)
                .bind(now)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            let next_due = [retry, parked, expiry]
                .into_iter()
                .flatten()
                .min()
                .map(|at| due_in_micros((at - now).whole_microseconds()));
            return Ok(Batch::empty()
                .with_more(more)
                .with_registry(Some(registry))
                .with_next_due(next_due));
        }
        let ids = claimable
            .iter()
            .map(|row| row.try_get("id"))
            .collect::<Result<Vec<i64>, _>>()?;
        let ids = json!(ids).to_string();
        // The claim's row lists its events: the claim writes nothing else of them.
        let token = i64::try_from(
            sqlx::query(queries.new_claim.clone())
                .bind(until)
                .bind(now)
                .bind(&ids)
                .bind(aggregates_of(&claimable)?)
                .execute(&mut *tx)
                .await?
                .last_insert_id(),
        )
        .unwrap_or(i64::MAX);

        let mut claims = Vec::with_capacity(claimable.len() + due.len());
        // Deliveries first: the events' lookup of what holds them back skips this claim's.
        if !due.is_empty() {
            sqlx::query(queries.claim_deliveries.clone())
                .bind(json!(due).to_string())
                .bind(token)
                .execute(&mut *tx)
                .await?;
            for row in sqlx::query(queries.claimed_deliveries.clone())
                .bind(token)
                .fetch_all(&mut *tx)
                .await?
            {
                let subscriber: String = row.try_get("subscriber")?;
                claims.push(match stored_event(&row) {
                    Ok(event) => Claim::Delivery {
                        event,
                        subscriber,
                        attempts: backend::count(row.try_get("attempts")?),
                        expired: backend::count(row.try_get("expired_claims")?),
                    },
                    Err(error) => unreadable(&row, Some(subscriber), &error),
                });
            }
        }
        if !claimable.is_empty() {
            let mut blocked: HashMap<i64, Vec<String>> = HashMap::new();
            if deliveries == 1 {
                for (id, subscriber) in
                    sqlx::query_as::<_, (i64, String)>(queries.blocked_by.clone())
                        .bind(&ids)
                        .bind(token)
                        .fetch_all(&mut *tx)
                        .await?
                {
                    blocked.entry(id).or_default().push(subscriber);
                }
            }
            for row in claimable {
                let id: i64 = row.try_get("id")?;
                claims.push(event_claim(row, blocked.remove(&id).unwrap_or_default()));
            }
        }

        tx.commit().await?;
        claims.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        Ok(Batch::new(ClaimToken::new(token), claims)
            .with_more(more)
            .with_registry(Some(registry)))
    }

    async fn register(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> Result<Registry, sqlx::Error> {
        let mut tx = pool.begin_with(BEGIN).await?;
        let now = queries.now(&mut tx).await?;
        let oldest = minus(now, ttl);
        sqlx::query(queries.expire_relays.clone())
            .bind(oldest)
            .bind(relay.to_string())
            .execute(&mut *tx)
            .await?;
        sqlx::query(queries.look_again_at_parked.clone())
            .bind(now)
            .bind(now)
            .bind(relay.to_string())
            .bind(routing)
            .execute(&mut *tx)
            .await?;
        sqlx::query(queries.register.clone())
            .bind(relay.to_string())
            .bind(routing)
            .bind(now)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        let rows: Vec<(String, i64, String)> = sqlx::query_as(queries.live_relays.clone())
            .bind(oldest)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(backend::registry_of_text(rows))
    }

    async fn unregister(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        relay: Uuid,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(queries.unregister.clone())
            .bind(relay.to_string())
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn live_relays(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        ttl: Duration,
    ) -> Result<Registry, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        let now = queries.now(&mut conn).await?;
        let rows: Vec<(String, i64, String)> = sqlx::query_as(queries.live_relays.clone())
            .bind(minus(now, ttl))
            .fetch_all(&mut *conn)
            .await?;
        Ok(backend::registry_of_text(rows))
    }

    async fn unroutable(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        event_types: Vec<String>,
        subscribers: Vec<String>,
    ) -> Result<(u64, u64, Option<Duration>), sqlx::Error> {
        let (types, subscribers) = (
            json!(event_types).to_string(),
            json!(subscribers).to_string(),
        );
        type Row = (
            i64,
            i64,
            Option<PrimitiveDateTime>,
            Option<PrimitiveDateTime>,
            PrimitiveDateTime,
        );
        let (events, deliveries, oldest_event, oldest_delivery, now): Row =
            sqlx::query_as(queries.unroutable.clone())
                .bind(&types)
                .bind(&types)
                .bind(&subscribers)
                .bind(&types)
                .bind(&types)
                .bind(&subscribers)
                .fetch_one(pool)
                .await?;
        let age = oldest_event
            .into_iter()
            .chain(oldest_delivery)
            .min()
            .map(|oldest| Duration::try_from(now - oldest).unwrap_or_default());
        Ok((row_count(events), row_count(deliveries), age))
    }

    async fn renew(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let renewed = sqlx::query(queries.renew.clone())
            .bind(i64::try_from(lease.as_micros()).unwrap_or(i64::MAX))
            .bind(token.get())
            .execute(pool)
            .await?
            .rows_affected();
        Ok(renewed == 1)
    }

    async fn hold_claim(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        token: ClaimToken,
    ) -> Result<bool, sqlx::Error> {
        // The claim's row stays locked for the rest of the transaction: a claim that would end
        // it as expired, or its record, waits until then. (The connection reports rows found,
        // not rows changed.)
        let held = sqlx::query(queries.hold_claim.clone())
            .bind(token.get())
            .execute(conn)
            .await?
            .rows_affected();
        Ok(held == 1)
    }

    #[allow(clippy::too_many_lines)]
    async fn record(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        token: ClaimToken,
        outcomes: &Outcomes,
        part: bool,
    ) -> Result<Recorded, sqlx::Error> {
        let token = token.get();
        // A record that writes deliveries runs under the claim lock: a skip or a requeue (which
        // hand a key's work back) and the claims (which read the keys' heads) see it whole. One
        // that only settles its events does not wait for the claims: the only thing a claim
        // writes that it reads is an event set aside behind this claim, and a claim does that
        // only holding this claim's row (see `hold_behind_claims`), which the delete below
        // waits for.
        let (mut tx, now) = if outcomes.deliveries.is_empty() {
            let mut tx = pool.begin_with(BEGIN).await?;
            let now = queries.now(&mut tx).await?;
            (tx, now)
        } else {
            begin_locked(pool, queries).await?
        };
        // For a record of part of the claim, the aggregates it takes out of it.
        let (live, freed) = if part {
            match shrink_claim(&mut tx, queries, token, now, outcomes).await? {
                Some(freed) => (true, freed),
                None => (false, Vec::new()),
            }
        } else {
            let ended = sqlx::query(queries.end_claim.clone())
                .bind(token)
                .bind(now)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            (ended == 1, Vec::new())
        };
        if !live {
            tx.rollback().await?;
            return Ok(Recorded::Lost);
        }
        let mut published = Vec::new();
        for (id, outcome) in &outcomes.events {
            match outcome {
                EventOutcome::Published => published.push(*id),
                // Ending the claim gives the event back.
                EventOutcome::Released => {}
                EventOutcome::Parked { reason, retry_in } => {
                    sqlx::query(queries.park.clone())
                        .bind(reason)
                        .bind(plus(now, *retry_in))
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                }
                EventOutcome::Dead { reason } => {
                    sqlx::query(queries.kill.clone())
                        .bind(now)
                        .bind(reason)
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        if !published.is_empty() {
            let published = json!(published).to_string();
            sqlx::query(queries.publish.clone())
                .bind(&published)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            // Events set aside behind a parked event that is published now.
            sqlx::query(queries.unhold_behind.clone())
                .bind(&published)
                .execute(&mut *tx)
                .await?;
        }
        // (Events neither published, parked nor dead are free again: the claim's row, which
        // listed them, is gone, or no longer lists them.) What was set aside behind the claim
        // goes with it: all of it when the claim ends, that of the aggregates a part took out
        // of it otherwise. (A claim that sets events aside behind this claim re-reads its row
        // once this commits: `hold_behind_claims`.)
        if !part {
            sqlx::query(queries.unhold_by.clone())
                .bind(token)
                .execute(&mut *tx)
                .await?;
        } else if !freed.is_empty() {
            sqlx::query(queries.unhold_freed.clone())
                .bind(json!(freed).to_string())
                .bind(token)
                .execute(&mut *tx)
                .await?;
        }
        for d in &outcomes.deliveries {
            let upsert = |attempts: u32,
                          error: Option<&String>,
                          at: Option<PrimitiveDateTime>,
                          dead: Option<PrimitiveDateTime>| {
                sqlx::query(queries.upsert_delivery.clone())
                    .bind(d.event_id)
                    .bind(d.subscriber.clone())
                    .bind(d.aggregate_type.clone())
                    .bind(d.aggregate_id)
                    .bind(i64::from(attempts))
                    .bind(error.cloned())
                    .bind(at)
                    .bind(dead)
            };
            let query = match &d.outcome {
                DeliveryOutcome::Delivered => sqlx::query(queries.delete_delivery.clone())
                    .bind(d.subscriber.clone())
                    .bind(d.event_id)
                    .bind(token),
                DeliveryOutcome::Released if part => sqlx::query(queries.release_delivery.clone())
                    .bind(d.subscriber.clone())
                    .bind(d.event_id)
                    .bind(token),
                // Released below, with whatever else this claim holds.
                DeliveryOutcome::Released => continue,
                // Due once it is the first of its key: see `promote_head` below.
                DeliveryOutcome::Waiting => upsert(0, None, None, None),
                DeliveryOutcome::Retry {
                    attempts,
                    error,
                    retry_in,
                } => upsert(*attempts, Some(error), Some(plus(now, *retry_in)), None),
                DeliveryOutcome::Dead { attempts, error } => {
                    upsert(*attempts, Some(error), Some(now), Some(now))
                }
            };
            query.execute(&mut *tx).await?;
        }
        if !part {
            sqlx::query(queries.release_deliveries.clone())
                .bind(token)
                .execute(&mut *tx)
                .await?;
        }
        // The first row of each key this record touched is due; the rest wait behind it.
        let keys: BTreeSet<(&str, &str, Uuid)> = outcomes
            .deliveries
            .iter()
            .map(DeliveryRecord::key)
            .collect();
        for (subscriber, aggregate_type, aggregate_id) in keys {
            promote_head(
                &mut tx,
                queries,
                subscriber,
                aggregate_type,
                aggregate_id,
                now,
            )
            .await?;
        }
        tx.commit().await?;
        Ok(Recorded::Applied)
    }

    async fn receive(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        consumer: &str,
        message_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let inserted = sqlx::query(queries.receive.clone())
            .bind(consumer)
            .bind(message_id)
            .execute(conn)
            .await?
            .rows_affected();
        Ok(inserted == 1)
    }

    async fn hold_and_receive(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        token: ClaimToken,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<bool>, sqlx::Error> {
        if !Self::hold_claim(&mut *conn, queries, token).await? {
            return Ok(None);
        }
        Ok(Some(
            Self::receive(conn, queries, consumer, message_id).await?,
        ))
    }

    async fn purge_inbox(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(queries.purge_inbox.clone())
            .bind(i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX))
            .bind(i64::from(batch_size))
            .execute(pool)
            .await?
            .rows_affected())
    }

    async fn purge_published(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        older_than: Duration,
        batch_size: u32,
        after: Option<PurgedUpTo>,
    ) -> Result<PurgeStep, sqlx::Error> {
        let mut tx = pool.begin_with(BEGIN).await?;
        let before = minus(queries.now(&mut tx).await?, older_than);
        let (from, from_id) = after.map_or((EARLIEST, 0), |a| (from_micros(a.published_at), a.id));
        let examined: Vec<(i64, PrimitiveDateTime, i64)> =
            sqlx::query_as(queries.purge_examined.clone())
                .bind(before)
                .bind(from)
                .bind(from)
                .bind(from_id)
                .bind(i64::from(batch_size))
                .fetch_all(&mut *tx)
                .await?;
        let doomed: Vec<i64> = examined
            .iter()
            .filter(|(_, _, held)| *held == 0)
            .map(|(id, _, _)| *id)
            .collect();
        let deleted = if doomed.is_empty() {
            0
        } else {
            sqlx::query(queries.purge.clone())
                .bind(json!(doomed).to_string())
                .execute(&mut *tx)
                .await?
                .rows_affected()
        };
        tx.commit().await?;
        let full = examined.len() >= usize::try_from(batch_size).unwrap_or(usize::MAX);
        Ok(PurgeStep {
            deleted,
            next: examined
                .last()
                .filter(|_| full)
                .map(|&(id, published_at, _)| PurgedUpTo {
                    published_at: micros(published_at),
                    id,
                }),
        })
    }

    crate::views::operator_views!(
        MySqlPool,
        MySqlQueries,
        MySqlConnection,
        begin = |_: &MySqlQueries| "BEGIN"
    );

    async fn published_within(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        window: Duration,
    ) -> Result<u64, sqlx::Error> {
        let count: i64 = sqlx::query_scalar(queries.published_within.clone())
            .bind(i64::try_from(window.as_micros()).unwrap_or(i64::MAX))
            .fetch_one(pool)
            .await?;
        Ok(row_count(count))
    }

    async fn status(pool: &MySqlPool, queries: &MySqlQueries) -> Result<Status, sqlx::Error> {
        let row = sqlx::query(queries.status.clone()).fetch_one(pool).await?;
        let count = |i: usize| -> Result<u64, sqlx::Error> { Ok(row_count(row.try_get(i)?)) };
        let oldest: Option<PrimitiveDateTime> = row.try_get(1)?;
        let now: PrimitiveDateTime = row.try_get(8)?;
        let mut status = Status::default();
        status.pending_events = count(0)?;
        status.oldest_pending_age =
            oldest.map(|occurred| Duration::try_from(now - occurred).unwrap_or_default());
        status.pending_deliveries = count(2)?;
        status.dead_letters = count(3)?;
        status.blocked_keys = count(4)?;
        status.blocked_aggregates = count(5)?;
        status.held_events = count(6)?;
        status.behind_dead_letters = count(7)?;
        Ok(status)
    }

    async fn skip(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        event_id: i64,
        subscriber: Option<&str>,
        reason: &str,
    ) -> Result<bool, sqlx::Error> {
        let (mut tx, now) = begin_locked(pool, queries).await?;
        let found = match subscriber {
            Some(subscriber) => {
                sqlx::query(queries.find_delivery.clone())
                    .bind(event_id)
                    .bind(subscriber)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            None => {
                sqlx::query(queries.find_skippable_event.clone())
                    .bind(event_id)
                    .fetch_optional(&mut *tx)
                    .await?
            }
        };
        let Some(row) = found else {
            return Ok(false);
        };
        match subscriber {
            None => {
                sqlx::query(queries.skip_event.clone())
                    .bind(now)
                    .bind(event_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(queries.unhold_behind.clone())
                    .bind(json!([event_id]).to_string())
                    .execute(&mut *tx)
                    .await?;
            }
            // The row behind it, if it is now the first of its key, is due.
            Some(subscriber) => {
                sqlx::query(queries.skip_delivery.clone())
                    .bind(event_id)
                    .bind(subscriber)
                    .execute(&mut *tx)
                    .await?;
                let aggregate_type: String = row.try_get("aggregate_type")?;
                let aggregate_id: Uuid = row.try_get("aggregate_id")?;
                promote_head(
                    &mut tx,
                    queries,
                    subscriber,
                    &aggregate_type,
                    aggregate_id,
                    now,
                )
                .await?;
            }
        }
        sqlx::query(queries.record_skip.clone())
            .bind(event_id)
            .bind(subscriber)
            .bind(row.try_get::<i64, _>("attempts")?)
            .bind(row.try_get::<Option<String>, _>("last_error")?)
            .bind(reason)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// No `LISTEN/NOTIFY`: relays of other processes poll.
    async fn notify(_: &MySqlPool, _: &str, _: &str) -> Result<(), sqlx::Error> {
        Ok(())
    }

    async fn listen(
        _: MySqlPool,
        _: String,
        _: String,
        _: std::sync::Weak<tokio::sync::Notify>,
        _: tokio::sync::watch::Receiver<bool>,
    ) {
    }

    async fn begin_locked(
        pool: &MySqlPool,
        queries: &MySqlQueries,
    ) -> Result<Transaction<'static, MySql>, sqlx::Error> {
        Ok(begin_locked(pool, queries).await?.0)
    }

    async fn requeue_events(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        ids: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let now = queries.now(&mut *conn).await?;
        let ids = json!(ids).to_string();
        let events = sqlx::query(queries.requeue_events.clone())
            .bind(&ids)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        let deliveries = sqlx::query(queries.requeue_event_deliveries.clone())
            .bind(&ids)
            .bind(now)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        // What waited behind them is claimed again with them, in order.
        sqlx::query(queries.unhold_behind.clone())
            .bind(&ids)
            .execute(&mut *conn)
            .await?;
        Ok(events + deliveries)
    }

    async fn requeue_deliveries(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        subscriber: &str,
        first_line: Option<&str>,
    ) -> Result<u64, sqlx::Error> {
        let now = queries.now(&mut *conn).await?;
        Ok(sqlx::query(queries.requeue_subscriber.clone())
            .bind(now)
            .bind(subscriber)
            .bind(first_line)
            .bind(first_line)
            .execute(conn)
            .await?
            .rows_affected())
    }

    async fn requeues(
        pool: &MySqlPool,
        queries: &MySqlQueries,
        before: i64,
        limit: u32,
    ) -> Result<Vec<crate::RequeueRecord>, sqlx::Error> {
        sqlx::query(queries.requeues.clone())
            .bind(before)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?
            .iter()
            .map(|row| {
                // (Written by `record_requeue` as a JSON array of ids.)
                let event_ids = row
                    .try_get::<Option<String>, _>("event_ids")?
                    .and_then(|ids| serde_json::from_str(&ids).ok())
                    .unwrap_or_default();
                requeue_record(
                    row,
                    event_ids,
                    row.try_get::<PrimitiveDateTime, _>("requeued_at")?
                        .assume_utc(),
                )
            })
            .collect()
    }

    async fn record_requeue(
        conn: &mut MySqlConnection,
        queries: &MySqlQueries,
        named: &Named<'_>,
        requeued: u64,
        reason: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(queries.record_requeue.clone())
            .bind(named.event_ids.map(|ids| json!(ids).to_string()))
            .bind(named.subscriber)
            .bind(named.first_line)
            .bind(i64::try_from(requeued).unwrap_or(i64::MAX))
            .bind(reason)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// The due deliveries to claim, as `[subscriber, event id]` pairs in event id order: the due
/// heads of their keys, each with the ready rows right behind it, at most its share of the
/// batch (at least [`MIN_SHARE`]), so that a key that is free again drains in bulk; then, in
/// that order, as many as `limit` allows (its byte limit counting each row's payload).
async fn due_deliveries(
    conn: &mut MySqlConnection,
    queries: &MySqlQueries,
    now: PrimitiveDateTime,
    limit: ClaimLimit,
    filter: &ClaimFilter,
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let heads: Vec<(String, String, Uuid, i64)> = sqlx::query_as(queries.due_heads.clone())
        .bind(now)
        .bind(json!(filter.skip_subscribers).to_string())
        .bind(i64::from(limit.events))
        .fetch_all(&mut *conn)
        .await?;
    if heads.is_empty() {
        return Ok(Vec::new());
    }
    let heads_json: Vec<serde_json::Value> = heads
        .iter()
        .map(|(s, t, a, e)| json!([s, t, a.simple().to_string(), e]))
        .collect();
    let share = (i64::from(limit.events) / i64::try_from(heads.len()).unwrap_or(1)).max(MIN_SHARE);
    // (The share is a number this function computed: formatted into the SQL, as `OFFSET` in
    // a subquery takes no placeholder.)
    let rows: Vec<(i64, String, i64, i64, Option<i64>)> = sqlx::query_as(sql(queries
        .behind_heads
        .replace("{share}", &(share - 1).to_string())))
    .bind(now)
    .bind(serde_json::Value::Array(heads_json).to_string())
    .fetch_all(&mut *conn)
    .await?;
    let mut due = Vec::new();
    let mut stopped = None;
    for (head, subscriber, event_id, ready, bytes) in rows {
        if stopped == Some(head) {
            continue;
        }
        if ready == 0 {
            // Every later row of the key waits behind this one.
            stopped = Some(head);
            continue;
        }
        due.push((event_id, subscriber, payload_bytes(bytes)));
    }
    due.sort_unstable();
    let mut budget = limit.budget();
    Ok(due
        .into_iter()
        .take_while(|(_, _, bytes)| budget.take(*bytes))
        .map(|(event_id, subscriber, _)| (subscriber, event_id))
        .collect())
}

/// The marks of events set aside behind a claim, kept only for claims that still hold the
/// event's aggregate, each of whose rows is locked (shared) for the rest of the transaction: a
/// record deleting it (and then releasing what is held behind it) or taking aggregates out of
/// it (and then releasing what is held behind those) waits until these marks are committed,
/// and a claim already recorded, whole or in that part, sets nothing aside behind it: the
/// claims' rows are read as they are now, not as the candidates' snapshot saw them. Marks behind
/// dead or parked events pass as they are. A mark dropped is not lost: the event stays a
/// candidate for the next claim.
async fn hold_behind_claims(
    conn: &mut MySqlConnection,
    queries: &MySqlQueries,
    marks: Vec<Mark>,
) -> Result<Vec<Mark>, sqlx::Error> {
    let claims: BTreeSet<i64> = marks.iter().filter_map(|(_, (by, _), _)| *by).collect();
    if claims.is_empty() {
        return Ok(marks);
    }
    let rows: Vec<(i64, String)> = sqlx::query_as(queries.share_claims.clone())
        .bind(json!(claims).to_string())
        .fetch_all(conn)
        .await?;
    let mut held: HashSet<(i64, String, Uuid)> = HashSet::new();
    for (claim, aggregates) in rows {
        let aggregates: Vec<(String, String, i64)> =
            serde_json::from_str(&aggregates).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
        for (aggregate_type, aggregate_id, _) in aggregates {
            let aggregate_id =
                Uuid::parse_str(&aggregate_id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            held.insert((claim, aggregate_type, aggregate_id));
        }
    }
    Ok(marks
        .into_iter()
        .filter(|(_, (by, _), (aggregate_type, aggregate_id))| {
            by.is_none_or(|claim| held.contains(&(claim, aggregate_type.clone(), *aggregate_id)))
        })
        .collect())
}

/// An event set aside: (its id, (held by a claim, held behind an event), its aggregate).
type Mark = (i64, (Option<i64>, Option<i64>), (String, Uuid));

/// The first unpublished event of an aggregate that is not among the claim's candidates, and
/// what holds it.
struct Blocker {
    id: i64,
    claim: Option<i64>,
    /// The claim is older than a quarter lease, at most a second: what waits behind it is set
    /// aside.
    lasted: bool,
    held_by: Option<i64>,
    held_behind: Option<i64>,
}

/// The [`Blocker`]s the live claims are, from the claims' rows (the state query's `live`:
/// `[[claim id, lasted, [[aggregate type, aggregate id as hex, first event id], ...]], ...]`):
/// for each aggregate a live claim holds, its first event there.
fn claimed_aggregates(live: &str) -> Result<HashMap<(String, Uuid), Blocker>, sqlx::Error> {
    let mut blockers = HashMap::new();
    let claims: Vec<LiveClaim> =
        serde_json::from_str(live).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    for (claim, lasted, aggregates) in claims {
        for (aggregate_type, aggregate_id, first) in aggregates {
            let aggregate_id =
                Uuid::parse_str(&aggregate_id).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            blockers.insert(
                (aggregate_type, aggregate_id),
                Blocker {
                    id: first,
                    claim: Some(claim),
                    lasted: lasted == 1,
                    held_by: None,
                    held_behind: None,
                },
            );
        }
    }
    Ok(blockers)
}

/// For a record of part of the claim `token`: takes the events `outcomes` names out of the
/// claim's row (and the aggregates whose first event there they are: a part is whole
/// aggregates), if the claim is live; false if it is not.
async fn shrink_claim(
    tx: &mut MySqlConnection,
    queries: &MySqlQueries,
    token: i64,
    now: PrimitiveDateTime,
    outcomes: &Outcomes,
) -> Result<Option<Vec<(String, String)>>, sqlx::Error> {
    let Some((event_ids, aggregates)): Option<(String, String)> =
        sqlx::query_as(queries.claim_row.clone())
            .bind(token)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?
    else {
        return Ok(None);
    };
    let decode = |e: serde_json::Error| sqlx::Error::Decode(Box::new(e));
    let named: HashSet<i64> = outcomes.events.iter().map(|(id, _)| *id).collect();
    let mut event_ids: Vec<i64> = serde_json::from_str(&event_ids).map_err(decode)?;
    event_ids.retain(|id| !named.contains(id));
    let (freed, kept): (Vec<(String, String, i64)>, _) =
        serde_json::from_str::<Vec<(String, String, i64)>>(&aggregates)
            .map_err(decode)?
            .into_iter()
            .partition(|(_, _, first)| named.contains(first));
    sqlx::query(queries.shrink_claim.clone())
        .bind(json!(event_ids).to_string())
        .bind(json!(kept).to_string())
        .bind(token)
        .execute(&mut *tx)
        .await?;
    Ok(Some(freed.into_iter().map(|(t, a, _)| (t, a)).collect()))
}

/// A live claim as the state query lists it: (id, lasted, [(aggregate type, aggregate id as
/// hex, first event id)]).
type LiveClaim = (i64, i64, Vec<(String, String, i64)>);

/// What a claim's row says of its events' aggregates: the first event of each (see
/// [`claimed_aggregates`]).
fn aggregates_of(rows: &[&MySqlRow]) -> Result<String, sqlx::Error> {
    let mut first: HashMap<(String, Uuid), i64> = HashMap::new();
    for row in rows {
        let id: i64 = row.try_get("id")?;
        let entry = first
            .entry((row.try_get("aggregate_type")?, row.try_get("aggregate_id")?))
            .or_insert(id);
        *entry = (*entry).min(id);
    }
    Ok(serde_json::Value::Array(
        first
            .into_iter()
            .map(|((t, a), id)| json!([t, a.simple().to_string(), id]))
            .collect(),
    )
    .to_string())
}

/// For each aggregate of `candidates`, its [`Blocker`] below its last candidate, if any: every
/// candidate of the aggregate above it waits. (One probe per aggregate: the first such event
/// below the last candidate is the first below each of them that has one.)
async fn blockers(
    conn: &mut MySqlConnection,
    queries: &MySqlQueries,
    candidates: &[MySqlRow],
    old: PrimitiveDateTime,
) -> Result<HashMap<(String, Uuid), Blocker>, sqlx::Error> {
    let mut last: HashMap<(String, Uuid), i64> = HashMap::new();
    let mut ids = Vec::with_capacity(candidates.len());
    for row in candidates {
        let id: i64 = row.try_get("id")?;
        ids.push(id);
        let aggregate = (row.try_get("aggregate_type")?, row.try_get("aggregate_id")?);
        let entry = last.entry(aggregate).or_insert(id);
        *entry = (*entry).max(id);
    }
    let aggregates: Vec<(String, Uuid)> = last.keys().cloned().collect();
    let probes: Vec<serde_json::Value> = aggregates
        .iter()
        .map(|(t, a)| json!([t, a.simple().to_string(), last[&(t.clone(), *a)]]))
        .collect();
    let rows = sqlx::query(queries.blockers.clone())
        .bind(json!(ids).to_string())
        .bind(serde_json::Value::Array(probes).to_string())
        .fetch_all(conn)
        .await?;
    let mut blockers = HashMap::new();
    for row in rows {
        let n: i64 = row.try_get(0)?;
        let Some(aggregate) = usize::try_from(n - 1).ok().and_then(|i| aggregates.get(i)) else {
            continue;
        };
        blockers.insert(
            aggregate.clone(),
            Blocker {
                id: row.try_get(1)?,
                claim: row.try_get(2)?,
                lasted: row
                    .try_get::<Option<PrimitiveDateTime>, _>(3)?
                    .is_some_and(|at| at < old),
                held_by: row.try_get(4)?,
                held_behind: row.try_get(5)?,
            },
        );
    }
    Ok(blockers)
}

/// Gives the first delivery of a key its due time, if it waited behind another.
async fn promote_head(
    conn: &mut MySqlConnection,
    queries: &MySqlQueries,
    subscriber: &str,
    aggregate_type: &str,
    aggregate_id: Uuid,
    now: PrimitiveDateTime,
) -> Result<(), sqlx::Error> {
    let first: Option<(i64, i64)> = sqlx::query_as(queries.first_of_key.clone())
        .bind(subscriber)
        .bind(aggregate_id)
        .bind(aggregate_type)
        .fetch_optional(&mut *conn)
        .await?;
    if let Some((event_id, 1)) = first {
        sqlx::query(queries.make_due.clone())
            .bind(now)
            .bind(subscriber)
            .bind(event_id)
            .execute(conn)
            .await?;
    }
    Ok(())
}

/// A claimed event row; one whose values this build cannot read becomes [`Claim::Unreadable`].
fn event_claim(row: &MySqlRow, blocked: Vec<String>) -> Claim {
    let read = || -> Result<Claim, sqlx::Error> {
        Ok(Claim::Event {
            event: stored_event(row)?,
            parked: backend::count(row.try_get("retry_count")?),
            expired: backend::count(row.try_get("expired_claims")?),
            blocked,
        })
    };
    read().unwrap_or_else(|error| unreadable(row, None, &error))
}

/// A row that cannot be read: its id (an integer primary key, always readable) and, when it can
/// be read, its aggregate.
fn unreadable(row: &MySqlRow, subscriber: Option<String>, error: &sqlx::Error) -> Claim {
    let aggregate = row
        .try_get::<String, _>("aggregate_type")
        .ok()
        .zip(row.try_get::<Uuid, _>("aggregate_id").ok());
    Claim::Unreadable {
        id: row.try_get("id").unwrap_or_default(),
        subscriber,
        aggregate,
        reason: error.to_string(),
    }
}

fn stored_event(row: &MySqlRow) -> Result<StoredEvent, sqlx::Error> {
    Ok(StoredEvent {
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get::<Uuid, _>("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        occurred_at: row
            .try_get::<PrimitiveDateTime, _>("occurred_at")?
            .assume_utc(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregate_slots_are_spread_and_stable() {
        let slots: HashSet<i16> = (0..10_000)
            .map(|_| aggregate_slot(Uuid::new_v4()))
            .collect();
        assert!(slots.len() > 3_000, "{} distinct slots", slots.len());
        assert!(slots.iter().all(|s| (0..4096).contains(s)));
        // Pinned: processes of different builds must lock the same row for an aggregate.
        assert_eq!(aggregate_slot(Uuid::nil()), 2_309);
    }

    /// A time beyond what a `DATETIME` holds is its last moment, never an earlier one (a retry
    /// "now" instead of never, as it once was).
    #[test]
    fn times_saturate_at_the_ends_of_what_a_datetime_holds() {
        let now = time::macros::datetime!(2026-12-06 12:00);
        assert_eq!(plus(now, Duration::MAX), LATEST);
        assert_eq!(
            plus(now, Duration::from_secs(9000 * 366 * 24 * 3600)),
            LATEST
        );
        assert_eq!(
            plus(now, Duration::from_secs(60)),
            time::macros::datetime!(2026-12-06 12:01)
        );
        assert_eq!(minus(now, Duration::MAX), EARLIEST);
    }
}
