//! The SQLite backend: the same tables and semantics as PostgreSQL, for one relay per database
//! file.
//!
//! SQLite has no schemas: the tables are named after [`TableNames::table`] alone, in the main
//! database. Timestamps are stored as integer microseconds since the Unix epoch, taken from this
//! process's clock. SQLite allows one writer at a time, so ids follow commit order without the
//! advisory lock PostgreSQL needs, and a claim is a short `BEGIN IMMEDIATE` transaction.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use outbox_core::StoredEvent;
use outbox_core::store::{
    Batch, Claim, ClaimFilter, ClaimLimit, ClaimToken, DeliveryOutcome, DeliveryRecord,
    EventOutcome, Outcomes, Recorded, Registry, Status,
};
use serde_json::json;
use sqlx::sqlite::SqliteRow;
use sqlx::{Executor, Row, SqlStr, Sqlite, SqliteConnection, SqlitePool, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::backend::{
    self, Backend, MIN_SHARE, Migration, Named, NewEvent, PurgeStep, PurgedUpTo, apply_migrations,
    due_in_micros, hold_after, payload_bytes, row_count, sealed, sql, subscribers_query,
};
use crate::error::Error;
use crate::names::TableNames;
use crate::views::{Dialect, dead_letter_groups_query, list_query, overview_query, requeue_record};

impl sealed::Sealed for Sqlite {}

/// The migrations, in order; templates for [`TableNames::render`].
const MIGRATIONS: &[Migration] = &[
    (
        1,
        "events and per-subscriber deliveries",
        include_str!("../migrations/sqlite/0001_events_and_per_subscriber_deliveries.sql"),
    ),
    (
        2,
        "a record of skipped deliveries",
        include_str!("../migrations/sqlite/0002_a_record_of_skipped_deliveries.sql"),
    ),
    (
        3,
        "an index of deliveries by event, for the foreign key",
        include_str!("../migrations/sqlite/0003_an_index_of_deliveries_by_event.sql"),
    ),
    (
        4,
        "fenced claims, events set aside behind a stuck aggregate, the aggregate type in every key",
        include_str!("../migrations/sqlite/0004_fenced_claims_events_set_aside_behind.sql"),
    ),
    (
        5,
        "deliveries behind the head of their key wait without a due time",
        include_str!("../migrations/sqlite/0005_deliveries_behind_the_head_of_their.sql"),
    ),
    (
        6,
        "retention reads old published events by when they were published",
        include_str!("../migrations/sqlite/0006_retention_reads_old_published_events_by.sql"),
    ),
    (
        7,
        "an inbox of the messages consumers handled",
        include_str!("../migrations/sqlite/0007_an_inbox_of_handled_messages.sql"),
    ),
    (
        8,
        "a registry of live relays and what their builds route",
        include_str!("../migrations/sqlite/0008_a_registry_of_live_relays.sql"),
    ),
    (
        9,
        "a record of requeues made with a reason",
        include_str!("../migrations/sqlite/0009_a_record_of_requeues.sql"),
    ),
];

/// The SQL of one set of tables.
#[doc(hidden)]
#[derive(Debug)]
pub struct SqliteQueries {
    insert: SqlStr,
    /// `insert` of one event: its values bound as they are, not read out of a JSON array.
    insert_one: SqlStr,
    expire_relays: SqlStr,
    look_again_at_parked: SqlStr,
    register: SqlStr,
    unregister: SqlStr,
    live_relays: SqlStr,
    registry_version: SqlStr,
    unroutable: SqlStr,
    expired: SqlStr,
    expire_events: SqlStr,
    expire_deliveries: SqlStr,
    expire_holds: SqlStr,
    expire_claims: SqlStr,
    candidates: SqlStr,
    mark: SqlStr,
    due_deliveries: SqlStr,
    /// When the earliest retry or parked event not due at `$1` is due.
    next_due: SqlStr,
    /// Gives the first delivery of a key its due time, if it waited behind another.
    promote_head: SqlStr,
    new_claim: SqlStr,
    claim_events: SqlStr,
    claim_deliveries: SqlStr,
    events_by_id: SqlStr,
    renew: SqlStr,
    hold_claim: SqlStr,
    receive: SqlStr,
    purge_inbox: SqlStr,
    end_claim: SqlStr,
    publish: SqlStr,
    unhold_behind: SqlStr,
    park: SqlStr,
    kill: SqlStr,
    release_events: SqlStr,
    /// One event of a claim given back by a record of part of it.
    release_event: SqlStr,
    unhold_by: SqlStr,
    /// Releases what was set aside behind a claim of the aggregates it no longer holds (after
    /// a record of part of it).
    unhold_freed: SqlStr,
    delete_delivery: SqlStr,
    upsert_delivery: SqlStr,
    release_deliveries: SqlStr,
    /// One delivery of a claim given back by a record of part of it.
    release_delivery: SqlStr,
    requeue_events: SqlStr,
    requeue_event_deliveries: SqlStr,
    requeue_subscriber: SqlStr,
    /// The dead events whose error's first line is $1.
    dead_events_failing: SqlStr,
    record_requeue: SqlStr,
    requeues: SqlStr,
    /// The next batch of old published events after where the last purge stopped (published
    /// time, then id), and whether a delivery still holds each.
    purge_examined: SqlStr,
    purge: SqlStr,
    status: SqlStr,
    subscribers: SqlStr,
    dead_letter_groups: SqlStr,
    /// One page of each state, in the order of `ListState::ALL`.
    list: [SqlStr; 8],
    overview: SqlStr,
    /// Events published within a window (`published_idx`).
    published_within: SqlStr,
    skip_delivery: SqlStr,
    skip_event: SqlStr,
    record_skip: SqlStr,
}

/// Microseconds since the Unix epoch, the unit of every timestamp column.
fn micros(time: OffsetDateTime) -> i64 {
    i64::try_from(time.unix_timestamp_nanos() / 1000).unwrap_or(i64::MAX)
}

/// The time `micros` microseconds after the Unix epoch (the epoch for a value out of range).
fn from_micros(micros: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

fn now() -> i64 {
    micros(OffsetDateTime::now_utc())
}

fn after(delay: Duration) -> i64 {
    now().saturating_add(i64::try_from(delay.as_micros()).unwrap_or(i64::MAX))
}

/// The first line of the text column `c`, as failure groups compare errors.
fn first_line(c: &str) -> String {
    format!("substr(coalesce({c}, ''), 1, instr(coalesce({c}, '') || char(10), char(10)) - 1)")
}

impl Backend for Sqlite {
    type Queries = SqliteQueries;

    fn queries(names: &TableNames) -> SqliteQueries {
        let outbox = names.local("");
        let deliveries = names.local("_deliveries");
        let claims = names.local("_claims");
        let skips = names.local("_skips");
        let inbox = names.local("_inbox");
        let relays = names.local("_relays");
        let requeues = names.local("_requeues");
        let dialect = Dialect {
            outbox: &outbox,
            unpublished: format!("{outbox} AS o"),
            deliveries: &deliveries,
            skips: &skips,
            claimed_event: "o.claim_id IS NOT NULL".to_owned(),
            payload: "o.payload",
            param: |n, _| format!("${n}"),
            params: "",
        };
        // Stalled: the event holds its aggregate's later events back for every subscriber.
        let expired_ids = format!("SELECT id FROM {claims} WHERE until < $1");
        SqliteQueries {
            expire_relays: sql(format!("DELETE FROM {relays} WHERE seen_at < $1 AND id <> $2")),
            // After `expire_relays`: a build that no live relay runs arrives (this relay's
            // first registration, a routing no live relay has); it may read what was parked
            // for want of a build, so parked events are due now, not when their park ends.
            look_again_at_parked: sql(format!(
                r#"
UPDATE {outbox} SET next_retry_at = $3
WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at > $3
  AND NOT EXISTS (SELECT 1 FROM {relays} WHERE id = $1 OR routing = $2)"#
            )),
            // A new registration takes the next generation; a renewal keeps its own.
            register: sql(format!(
                r#"
INSERT INTO {relays} (id, generation, routing, registered_at, seen_at)
VALUES ($1, (SELECT coalesce(max(generation), 0) + 1 FROM {relays}), $2, $3, $3)
ON CONFLICT (id) DO UPDATE SET routing = excluded.routing, seen_at = excluded.seen_at"#
            )),
            unregister: sql(format!("DELETE FROM {relays} WHERE id = $1")),
            live_relays: sql(format!(
                "SELECT id, generation, routing FROM {relays} WHERE seen_at >= $1"
            )),
            registry_version: sql(format!(
                "SELECT coalesce(group_concat(generation, ','), '')
                 FROM (SELECT generation FROM {relays} ORDER BY generation)"
            )),
            unroutable: sql(format!(
                r#"
WITH events AS (
    SELECT count(*) AS n, min(occurred_at) AS oldest FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL
      AND event_type NOT IN (SELECT value FROM json_each($1))
),
deliveries AS (
    SELECT count(*) AS n, min(o.occurred_at) AS oldest
    FROM {deliveries} AS d JOIN {outbox} AS o ON o.id = d.event_id
    WHERE d.dead_at IS NULL AND d.subscriber NOT IN (SELECT value FROM json_each($2))
)
SELECT ev.n, dv.n, min(coalesce(ev.oldest, dv.oldest), coalesce(dv.oldest, ev.oldest))
FROM events AS ev, deliveries AS dv"#
            )),
            insert: sql(format!(
                r#"
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, occurred_at)
SELECT json_extract(value, '$.t'), unhex(json_extract(value, '$.a')), json_extract(value, '$.e'),
       json_extract(value, '$.p'), coalesce(json_extract(value, '$.o'), $2)
FROM json_each($1)
ORDER BY key"#
            )),
            insert_one: sql(format!(
                "INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, occurred_at)
                 VALUES ($1, $2, $3, $4, coalesce($5, $6))"
            )),
            expired: sql(format!("SELECT count(*) FROM {claims} WHERE until < $1")),
            expire_events: sql(format!(
                "UPDATE {outbox} SET claim_id = NULL, expired_claims = expired_claims + 1
                 WHERE claim_id IN ({expired_ids}) AND published_at IS NULL"
            )),
            expire_deliveries: sql(format!(
                "UPDATE {deliveries} SET claim_id = NULL, expired_claims = expired_claims + 1
                 WHERE claim_id IN ({expired_ids})"
            )),
            expire_holds: sql(format!(
                "UPDATE {outbox} SET held_by = NULL WHERE held_by IN ({expired_ids})"
            )),
            expire_claims: sql(format!("DELETE FROM {claims} WHERE until < $1")),
            // The next pending events nothing holds, in id order, and the parked ones due; each
            // with the first earlier unpublished event of its aggregate that is not a candidate
            // (what it must wait for), and that event's claim and holds.
            candidates: sql(format!(
                r#"
WITH scanned AS (
    SELECT id, aggregate_type, aggregate_id, event_type,
           length(CAST(payload AS BLOB)) AS bytes
    FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NULL
      AND held_by IS NULL AND held_behind IS NULL AND claim_id IS NULL
    ORDER BY id
    LIMIT $2
),
due_parked AS (
    SELECT id, aggregate_type, aggregate_id, event_type,
           length(CAST(payload AS BLOB)) AS bytes
    FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at <= $1
      AND held_by IS NULL AND held_behind IS NULL AND claim_id IS NULL
    ORDER BY next_retry_at
    LIMIT $2
),
candidates AS MATERIALIZED (
    SELECT * FROM scanned UNION ALL SELECT * FROM due_parked
),
blockers AS (
    SELECT c.id, c.aggregate_type, c.aggregate_id, c.event_type, c.bytes, (
        SELECT e.id FROM {outbox} AS e
        WHERE e.aggregate_id = c.aggregate_id AND e.aggregate_type = c.aggregate_type
          AND e.published_at IS NULL AND e.id < c.id
          AND e.id NOT IN (SELECT id FROM candidates)
        ORDER BY e.id
        LIMIT 1
    ) AS blocker
    FROM candidates AS c
)
SELECT b.id, b.blocker, e.claim_id, k.claimed_at, e.held_by, e.held_behind,
       b.aggregate_type, b.aggregate_id, b.event_type, b.bytes
FROM blockers AS b
LEFT JOIN {outbox} AS e ON e.id = b.blocker
LEFT JOIN {claims} AS k ON k.id = e.claim_id
ORDER BY b.id"#
            )),
            mark: sql(format!(
                r#"
UPDATE {outbox} SET held_by = json_extract(m.value, '$[1]'),
                    held_behind = json_extract(m.value, '$[2]')
FROM json_each($1) AS m
WHERE {outbox}.id = json_extract(m.value, '$[0]')"#
            )),
            next_due: sql(format!(
                r#"
SELECT min(at) FROM (
    SELECT min(next_retry_at) AS at FROM {deliveries}
    WHERE dead_at IS NULL AND next_retry_at > $1 AND claim_id IS NULL
    UNION ALL
    SELECT min(next_retry_at) FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at > $1
    UNION ALL
    -- A live claim expires (its relay died: its work is free) the first moment after `until`.
    SELECT min(until) + 1 FROM {claims} WHERE until >= $1
)"#
            )),
            due_deliveries: sql(format!(
                r#"
WITH heads AS MATERIALIZED (
    -- Due deliveries that are the first of their key: rows behind a head have no due time
    -- and are not read here, however many wait.
    -- (Not those of subscribers left to relays of other builds, $3.)
    SELECT d.subscriber, d.aggregate_type, d.aggregate_id, d.event_id FROM {deliveries} AS d
    WHERE d.dead_at IS NULL AND d.next_retry_at <= $1 AND d.claim_id IS NULL
      AND d.subscriber NOT IN (SELECT value FROM json_each($3))
      AND NOT EXISTS (
          SELECT 1 FROM {deliveries} AS h
          WHERE h.subscriber = d.subscriber AND h.aggregate_id = d.aggregate_id
            AND h.aggregate_type = d.aggregate_type AND h.event_id < d.event_id)
    -- Longest due first, as the due index reads them: ordered by event id, the plan read
    -- every delivery (through the event index) to find the due ones.
    ORDER BY d.next_retry_at
    LIMIT $2
),
share AS (SELECT max({MIN_SHARE}, $2 / (SELECT count(*) FROM heads)) AS per_key),
candidates AS (
    -- Each head with the rows right behind it, at most its share of the batch.
    SELECT f.subscriber, f.event_id,
           min(f.event_id = h.event_id
               OR (f.dead_at IS NULL AND f.claim_id IS NULL
                   AND (f.next_retry_at IS NULL OR f.next_retry_at <= $1)))
               OVER (PARTITION BY h.subscriber, h.event_id ORDER BY f.event_id) AS ready
    FROM heads AS h
    JOIN {deliveries} AS f
      ON f.subscriber = h.subscriber AND f.aggregate_id = h.aggregate_id
     AND f.aggregate_type = h.aggregate_type AND f.event_id >= h.event_id
     AND f.event_id <= coalesce((
         SELECT x.event_id FROM {deliveries} AS x
         WHERE x.subscriber = h.subscriber AND x.aggregate_id = h.aggregate_id
           AND x.aggregate_type = h.aggregate_type AND x.event_id >= h.event_id
         ORDER BY x.event_id LIMIT 1 OFFSET (SELECT per_key FROM share) - 1),
         9223372036854775807)
)
-- With the size of the event's payload, for the claim's byte limit.
SELECT c.subscriber, c.event_id, length(CAST(o.payload AS BLOB)) AS bytes
FROM candidates AS c
JOIN {outbox} AS o ON o.id = c.event_id
WHERE c.ready
ORDER BY c.event_id, c.subscriber
LIMIT $2"#
            )),
            promote_head: sql(format!(
                r#"
UPDATE {deliveries} SET next_retry_at = $4
WHERE subscriber = $1 AND next_retry_at IS NULL AND dead_at IS NULL
  AND event_id = (
      SELECT h.event_id FROM {deliveries} AS h
      WHERE h.subscriber = $1 AND h.aggregate_type = $2 AND h.aggregate_id = $3
      ORDER BY h.event_id LIMIT 1)"#
            )),
            new_claim: sql(format!(
                "INSERT INTO {claims} (until, claimed_at) VALUES ($1, $2) RETURNING id"
            )),
            claim_events: sql(format!(
                r#"
UPDATE {outbox} SET claim_id = $2
WHERE id IN (SELECT value FROM json_each($1))
RETURNING id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count,
          expired_claims,
          -- Deliveries of this claim do not hold the event back: they run first, in its
          -- subscriber's queue (a subscriber with any other row does). Those whose last row of
          -- the key this claim does not take (it takes a key's rows from its head on): the
          -- subscribers with deliveries walked one index step each, and one probe of the
          -- key's end each, however many rows wait in the key.
          (SELECT json_group_array(w.subscriber)
           FROM (
               WITH RECURSIVE walk(subscriber) AS (
                   SELECT min(subscriber) FROM {deliveries}
                   UNION ALL
                   SELECT (SELECT min(x.subscriber) FROM {deliveries} AS x
                           WHERE x.subscriber > walk.subscriber)
                   FROM walk WHERE walk.subscriber IS NOT NULL
               )
               SELECT subscriber FROM walk WHERE subscriber IS NOT NULL
           ) AS w
           WHERE (SELECT coalesce(d.claim_id, -1) <> $2 FROM {deliveries} AS d
                  WHERE d.subscriber = w.subscriber AND d.aggregate_id = {outbox}.aggregate_id
                    AND d.aggregate_type = {outbox}.aggregate_type
                  ORDER BY d.event_id DESC LIMIT 1)) AS blocked"#
            )),
            claim_deliveries: sql(format!(
                r#"
UPDATE {deliveries} SET claim_id = $2
WHERE (subscriber, event_id) IN (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each($1))
RETURNING subscriber, event_id, attempts, expired_claims"#
            )),
            events_by_id: sql(format!(
                r#"
SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at FROM {outbox}
WHERE id IN (SELECT value FROM json_each($1))"#
            )),
            renew: sql(format!(
                "UPDATE {claims} SET until = $2 WHERE id = $1 AND until >= $3"
            )),
            receive: sql(format!(
                "INSERT INTO {inbox} (consumer, message_id, handled_at) VALUES ($1, $2, $3)
                 ON CONFLICT DO NOTHING"
            )),
            purge_inbox: sql(format!(
                "DELETE FROM {inbox} WHERE rowid IN (
                     SELECT rowid FROM {inbox} WHERE handled_at < $1 ORDER BY handled_at LIMIT $2)"
            )),
            hold_claim: sql(format!(
                "UPDATE {claims} SET until = until WHERE id = $1 AND until >= $2"
            )),
            end_claim: sql(format!(
                "DELETE FROM {claims} WHERE id = $1 AND until >= $2"
            )),
            publish: sql(format!(
                "UPDATE {outbox} SET published_at = $1, claim_id = NULL
                 WHERE id IN (SELECT value FROM json_each($2))"
            )),
            unhold_behind: sql(format!(
                "UPDATE {outbox} SET held_behind = NULL
                 WHERE held_behind IN (SELECT value FROM json_each($1))"
            )),
            park: sql(format!(
                "UPDATE {outbox}
                 SET retry_count = retry_count + 1, last_error = $2, next_retry_at = $3,
                     claim_id = NULL
                 WHERE id = $1"
            )),
            kill: sql(format!(
                "UPDATE {outbox} SET dead_at = $3, last_error = $2, claim_id = NULL
                 WHERE id = $1"
            )),
            release_events: sql(format!(
                "UPDATE {outbox} SET claim_id = NULL WHERE claim_id = $1"
            )),
            release_event: sql(format!(
                "UPDATE {outbox} SET claim_id = NULL WHERE id = $1 AND claim_id = $2"
            )),
            unhold_by: sql(format!(
                "UPDATE {outbox} SET held_by = NULL WHERE held_by = $1"
            )),
            unhold_freed: sql(format!(
                "UPDATE {outbox} SET held_by = NULL
                 WHERE held_by = $1 AND (aggregate_id, aggregate_type) NOT IN (
                     SELECT e.aggregate_id, e.aggregate_type FROM {outbox} AS e
                     WHERE e.claim_id = $1)"
            )),
            delete_delivery: sql(format!(
                "DELETE FROM {deliveries} WHERE subscriber = $1 AND event_id = $2 AND claim_id = $3"
            )),
            upsert_delivery: sql(format!(
                "INSERT INTO {deliveries}
                     (event_id, subscriber, aggregate_type, aggregate_id, attempts, last_error,
                      next_retry_at, dead_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                 ON CONFLICT (subscriber, event_id) DO UPDATE
                 SET attempts = excluded.attempts, last_error = excluded.last_error,
                     next_retry_at = excluded.next_retry_at, dead_at = excluded.dead_at,
                     claim_id = NULL"
            )),
            release_deliveries: sql(format!(
                "UPDATE {deliveries} SET claim_id = NULL WHERE claim_id = $1"
            )),
            release_delivery: sql(format!(
                "UPDATE {deliveries} SET claim_id = NULL
                 WHERE subscriber = $1 AND event_id = $2 AND claim_id = $3"
            )),
            requeue_events: sql(format!(
                "UPDATE {outbox}
                 SET dead_at = NULL, next_retry_at = NULL, retry_count = 0, last_error = NULL
                 WHERE id IN (SELECT value FROM json_each($1)) AND published_at IS NULL
                   AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL)"
            )),
            requeue_event_deliveries: sql(format!(
                "UPDATE {deliveries}
                 SET dead_at = NULL, attempts = 0, next_retry_at = $2, last_error = NULL
                 WHERE event_id IN (SELECT value FROM json_each($1)) AND dead_at IS NOT NULL"
            )),
            requeue_subscriber: sql(format!(
                "UPDATE {deliveries}
                 SET dead_at = NULL, attempts = 0, next_retry_at = $2, last_error = NULL
                 WHERE subscriber = $1 AND dead_at IS NOT NULL
                   AND ($3 IS NULL OR {line} = $3)",
                line = first_line("last_error")
            )),
            requeues: sql(format!(
                "SELECT id, event_ids, subscriber, first_line, requeued, reason, requeued_at
                 FROM {requeues} WHERE id < $1 ORDER BY id DESC LIMIT $2"
            )),
            record_requeue: sql(format!(
                "INSERT INTO {requeues}
                     (event_ids, subscriber, first_line, requeued, reason, requeued_at)
                 VALUES ($1, $2, $3, $4, $5, $6)"
            )),
            dead_events_failing: sql(format!(
                "SELECT id FROM {outbox}
                 WHERE published_at IS NULL AND dead_at IS NOT NULL AND {line} = $1
                 ORDER BY id",
                line = first_line("last_error")
            )),
            list: crate::ListState::ALL.map(|state| sql(list_query(&dialect, state))),
            overview: sql(overview_query(&dialect)),
            published_within: sql(format!(
                "SELECT count(*) FROM {outbox} WHERE published_at > $1"
            )),
            dead_letter_groups: sql(dead_letter_groups_query(&dialect, first_line)),
            status: sql(format!(
                r#"
SELECT (SELECT count(*) FROM {outbox} WHERE published_at IS NULL AND dead_at IS NULL),
       (SELECT min(occurred_at) FROM {outbox} WHERE published_at IS NULL AND dead_at IS NULL),
       (SELECT count(*) FROM {deliveries} WHERE dead_at IS NULL),
       (SELECT count(*) FROM {outbox} WHERE published_at IS NULL AND dead_at IS NOT NULL)
         + (SELECT count(*) FROM {deliveries} WHERE dead_at IS NOT NULL),
       (SELECT count(*) FROM (
            SELECT DISTINCT subscriber, aggregate_type, aggregate_id FROM {deliveries})),
       (SELECT count(*) FROM (
            SELECT DISTINCT aggregate_type, aggregate_id FROM {outbox}
            WHERE published_at IS NULL
              AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL
                   OR held_by IS NOT NULL OR held_behind IS NOT NULL))),
       (SELECT count(*) FROM {outbox} WHERE held_by IS NOT NULL)
         + (SELECT count(*) FROM {outbox} WHERE held_behind IS NOT NULL),
       -- What dead letters hold back: events of an aggregate set aside after its first dead
       -- event (the claim sets aside what it meets behind one), deliveries of a key after
       -- its first dead one.
       (SELECT count(*) FROM (
            SELECT aggregate_type, aggregate_id, min(id) AS id FROM {outbox}
            WHERE published_at IS NULL AND dead_at IS NOT NULL
            GROUP BY aggregate_type, aggregate_id) AS r
        JOIN {outbox} AS e
          ON e.aggregate_id = r.aggregate_id AND e.aggregate_type = r.aggregate_type
        WHERE e.published_at IS NULL AND e.dead_at IS NULL AND e.id > r.id
          AND (e.next_retry_at IS NOT NULL OR e.held_by IS NOT NULL
               OR e.held_behind IS NOT NULL))
         + (SELECT count(*) FROM (
                SELECT subscriber, aggregate_type, aggregate_id, min(event_id) AS event_id
                FROM {deliveries} WHERE dead_at IS NOT NULL
                GROUP BY subscriber, aggregate_type, aggregate_id) AS k
            JOIN {deliveries} AS d
              ON d.subscriber = k.subscriber AND d.aggregate_id = k.aggregate_id
             AND d.aggregate_type = k.aggregate_type
            WHERE d.dead_at IS NULL AND d.event_id > k.event_id)"#
            )),
            subscribers: sql(subscribers_query(&deliveries)),
            skip_delivery: sql(format!(
                r#"
DELETE FROM {deliveries}
WHERE event_id = $1 AND subscriber = $2 AND claim_id IS NULL
RETURNING attempts, last_error, aggregate_type, aggregate_id"#
            )),
            skip_event: sql(format!(
                r#"
UPDATE {outbox} SET published_at = $2, dead_at = NULL, next_retry_at = NULL
WHERE id = $1 AND published_at IS NULL
  AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL)
  AND claim_id IS NULL
RETURNING retry_count AS attempts, last_error"#
            )),
            record_skip: sql(format!(
                "INSERT INTO {skips} (event_id, subscriber, attempts, last_error, reason, skipped_at)
                 VALUES ($1, $2, $3, $4, $5, $6)"
            )),
            purge_examined: sql(format!(
                r#"
SELECT o.id, o.published_at,
       EXISTS (SELECT 1 FROM {deliveries} AS d WHERE d.event_id = o.id) AS held
FROM {outbox} AS o
WHERE o.published_at IS NOT NULL AND o.published_at < $1
  AND (o.published_at, o.id) > (coalesce($2, -9223372036854775808), coalesce($3, 0))
ORDER BY o.published_at, o.id
LIMIT $4"#
            )),
            purge: sql(format!(
                "DELETE FROM {outbox} WHERE id IN (SELECT value FROM json_each($1))"
            )),
        }
    }

    async fn migrate(pool: &SqlitePool, names: &TableNames) -> Result<(), Error> {
        let migrations = names.local("_migrations");
        // IMMEDIATE: one migrator at a time.
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        tx.execute(sqlx::raw_sql(sql(format!(
            "CREATE TABLE IF NOT EXISTS {migrations} (
                 version     INTEGER PRIMARY KEY,
                 description TEXT NOT NULL,
                 applied_at  INTEGER NOT NULL
             );"
        ))))
        .await?;
        // (`applied_at` in microseconds since the epoch, as every time on SQLite.)
        apply_migrations::<Sqlite>(
            &mut tx,
            names,
            MIGRATIONS,
            i32::MAX,
            &migrations,
            &format!(
                "INSERT INTO {migrations} (version, description, applied_at)
                 VALUES ($1, $2, CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))"
            ),
            |template| names.render(template, |s| names.local(s), |s| names.local(s)),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn insert(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        events: &[NewEvent],
    ) -> Result<(), sqlx::Error> {
        if let [event] = events {
            sqlx::query(queries.insert_one.clone())
                .bind(event.aggregate_type)
                .bind(event.aggregate_id)
                .bind(event.event_type)
                .bind(&event.payload)
                .bind(event.occurred_at.map(micros))
                .bind(now())
                .execute(conn)
                .await?;
            return Ok(());
        }
        let rows: Vec<serde_json::Value> = events
            .iter()
            .map(|e| {
                json!({
                    "t": e.aggregate_type,
                    "a": e.aggregate_id.simple().to_string(),
                    "e": e.event_type,
                    "p": e.payload,
                    "o": e.occurred_at.map(micros),
                })
            })
            .collect();
        sqlx::query(queries.insert.clone())
            .bind(serde_json::Value::Array(rows).to_string())
            .bind(now())
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn claim(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        limit: ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        // The lease runs from when the write lock is granted.
        let now = now();
        let until = now.saturating_add(i64::try_from(lease.as_micros()).unwrap_or(i64::MAX));
        let old = now.saturating_sub(i64::try_from(hold_after(lease).as_micros()).unwrap_or(0));

        // Expired claims end: their work is free again, and counts a redelivery.
        let expired: i64 = sqlx::query_scalar(queries.expired.clone())
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
        if expired > 0 {
            for query in [
                &queries.expire_events,
                &queries.expire_deliveries,
                &queries.expire_holds,
                &queries.expire_claims,
            ] {
                sqlx::query(query.clone())
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
        }

        // Which candidates wait, and which of those are set aside (and behind what).
        let rows = sqlx::query(queries.candidates.clone())
            .bind(now)
            .bind(i64::from(limit.events))
            .fetch_all(&mut *tx)
            .await?;
        let mut claimable = Vec::new();
        let mut budget = limit.budget();
        let mut marks = Vec::new();
        // Aggregates with a candidate of a type left to relays of other builds: it and their
        // later candidates wait for those, unmarked.
        let mut skipped: HashSet<(String, Uuid)> = HashSet::new();
        for row in &rows {
            let id: i64 = row.try_get(0)?;
            if !filter.skip_event_types.is_empty() {
                let aggregate: (String, Uuid) = (row.try_get(6)?, row.try_get(7)?);
                let event_type: String = row.try_get(8)?;
                if filter.skip_event_types.contains(&event_type) {
                    skipped.insert(aggregate);
                    continue;
                }
                if skipped.contains(&aggregate) {
                    continue;
                }
            }
            let Some(blocker) = row.try_get::<Option<i64>, _>(1)? else {
                if budget.take(payload_bytes(row.try_get(9)?)) {
                    claimable.push(id);
                }
                continue;
            };
            let claim: Option<i64> = row.try_get(2)?;
            let claimed_at: Option<i64> = row.try_get(3)?;
            let (held_by, held_behind): (Option<i64>, Option<i64>) =
                (row.try_get(4)?, row.try_get(5)?);
            let mark = match claim {
                // Behind a claim: set aside only once the claim has lasted.
                Some(claim) => claimed_at
                    .filter(|at| *at < old)
                    .map(|_| (Some(claim), None)),
                None if held_by.is_some() || held_behind.is_some() => Some((held_by, held_behind)),
                // Behind a dead or parked event.
                None => Some((None, Some(blocker))),
            };
            if let Some((by, behind)) = mark {
                marks.push(json!([id, by, behind]));
            }
        }
        if !marks.is_empty() {
            sqlx::query(queries.mark.clone())
                .bind(serde_json::Value::Array(marks.clone()).to_string())
                .execute(&mut *tx)
                .await?;
        }
        let mut budget = limit.budget();
        let mut due = Vec::new();
        for row in sqlx::query(queries.due_deliveries.clone())
            .bind(now)
            .bind(i64::from(limit.events))
            .bind(json!(filter.skip_subscribers).to_string())
            .fetch_all(&mut *tx)
            .await?
        {
            if !budget.take(payload_bytes(row.try_get(2)?)) {
                break;
            }
            due.push(row);
        }
        let registry: String = sqlx::query_scalar(queries.registry_version.clone())
            .fetch_one(&mut *tx)
            .await?;
        if claimable.is_empty() && due.is_empty() {
            // (For the relay to wake when the next retry is due, whoever recorded it.)
            let next_due: Option<i64> = sqlx::query_scalar(queries.next_due.clone())
                .bind(now)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(Batch::empty()
                .with_more(!marks.is_empty())
                .with_registry(Some(registry))
                .with_next_due(
                    next_due.map(|at| due_in_micros(i128::from(at) - i128::from(now))),
                ));
        }
        let token: i64 = sqlx::query_scalar(queries.new_claim.clone())
            .bind(until)
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;

        let mut claims = Vec::with_capacity(claimable.len() + due.len());
        // Deliveries first: the events' lookup of what holds them back skips this claim's.
        if !due.is_empty() {
            let keys: Vec<serde_json::Value> = due
                .iter()
                .map(|row| {
                    Ok(json!([
                        row.try_get::<String, _>(0)?,
                        row.try_get::<i64, _>(1)?
                    ]))
                })
                .collect::<Result<_, sqlx::Error>>()?;
            let delivery_rows = sqlx::query(queries.claim_deliveries.clone())
                .bind(serde_json::Value::Array(keys).to_string())
                .bind(token)
                .fetch_all(&mut *tx)
                .await?;
            let ids: Vec<i64> = delivery_rows
                .iter()
                .map(|row| row.try_get("event_id"))
                .collect::<Result<_, _>>()?;
            let events = sqlx::query(queries.events_by_id.clone())
                .bind(json!(ids).to_string())
                .fetch_all(&mut *tx)
                .await?;
            for row in &delivery_rows {
                let id: i64 = row.try_get("event_id")?;
                let Some(event) = events
                    .iter()
                    .find(|e| e.try_get::<i64, _>("id").is_ok_and(|e| e == id))
                else {
                    continue;
                };
                let subscriber: String = row.try_get("subscriber")?;
                claims.push(match stored_event(event) {
                    Ok(event) => Claim::Delivery {
                        event,
                        subscriber,
                        attempts: backend::count(row.try_get("attempts")?),
                        expired: backend::count(row.try_get("expired_claims")?),
                    },
                    Err(error) => unreadable(event, Some(subscriber), &error),
                });
            }
        }
        if !claimable.is_empty() {
            let event_rows = sqlx::query(queries.claim_events.clone())
                .bind(json!(claimable).to_string())
                .bind(token)
                .fetch_all(&mut *tx)
                .await?;
            for row in &event_rows {
                claims.push(event_claim(row)?);
            }
        }

        tx.commit().await?;
        claims.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        Ok(Batch::new(ClaimToken::new(token), claims)
            .with_more(!marks.is_empty())
            .with_registry(Some(registry)))
    }

    async fn register(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> Result<Registry, sqlx::Error> {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let now = now();
        let oldest = now.saturating_sub(i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX));
        sqlx::query(queries.expire_relays.clone())
            .bind(oldest)
            .bind(relay.to_string())
            .execute(&mut *tx)
            .await?;
        sqlx::query(queries.look_again_at_parked.clone())
            .bind(relay.to_string())
            .bind(routing)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query(queries.register.clone())
            .bind(relay.to_string())
            .bind(routing)
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
        pool: &SqlitePool,
        queries: &SqliteQueries,
        relay: Uuid,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(queries.unregister.clone())
            .bind(relay.to_string())
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn live_relays(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        ttl: Duration,
    ) -> Result<Registry, sqlx::Error> {
        let oldest = now().saturating_sub(i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX));
        let rows: Vec<(String, i64, String)> = sqlx::query_as(queries.live_relays.clone())
            .bind(oldest)
            .fetch_all(pool)
            .await?;
        Ok(backend::registry_of_text(rows))
    }

    async fn unroutable(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        event_types: Vec<String>,
        subscribers: Vec<String>,
    ) -> Result<(u64, u64, Option<Duration>), sqlx::Error> {
        let (events, deliveries, oldest): (i64, i64, Option<i64>) =
            sqlx::query_as(queries.unroutable.clone())
                .bind(json!(event_types).to_string())
                .bind(json!(subscribers).to_string())
                .fetch_one(pool)
                .await?;
        let age = oldest
            .map(|at| Duration::from_micros(u64::try_from(now().saturating_sub(at)).unwrap_or(0)));
        Ok((
            u64::try_from(events).unwrap_or(0),
            u64::try_from(deliveries).unwrap_or(0),
            age,
        ))
    }

    async fn renew(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let renewed = sqlx::query(queries.renew.clone())
            .bind(token.get())
            .bind(after(lease))
            .bind(now())
            .execute(pool)
            .await?
            .rows_affected();
        Ok(renewed == 1)
    }

    async fn hold_claim(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        token: ClaimToken,
    ) -> Result<bool, sqlx::Error> {
        // A write to the claim takes the database's write lock for the rest of the transaction:
        // no claim can end it as expired meanwhile. (The write changes nothing.)
        let held = sqlx::query(queries.hold_claim.clone())
            .bind(token.get())
            .bind(now())
            .execute(conn)
            .await?
            .rows_affected();
        Ok(held == 1)
    }

    async fn record(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        token: ClaimToken,
        outcomes: &Outcomes,
        part: bool,
    ) -> Result<Recorded, sqlx::Error> {
        let now = now();
        let token = token.get();
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        // The claim ends, or for a record of part of it stays (the write only checks it).
        let end_or_keep = if part {
            &queries.hold_claim
        } else {
            &queries.end_claim
        };
        let live = sqlx::query(end_or_keep.clone())
            .bind(token)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
        if !live {
            tx.rollback().await?;
            return Ok(Recorded::Lost);
        }
        let mut published = Vec::new();
        for (id, outcome) in &outcomes.events {
            match outcome {
                EventOutcome::Published => published.push(*id),
                // Ending the claim gives the event back; a record of part of it, this.
                EventOutcome::Released if part => {
                    sqlx::query(queries.release_event.clone())
                        .bind(id)
                        .bind(token)
                        .execute(&mut *tx)
                        .await?;
                }
                EventOutcome::Released => {}
                EventOutcome::Parked { reason, retry_in } => {
                    sqlx::query(queries.park.clone())
                        .bind(id)
                        .bind(reason)
                        .bind(after(*retry_in))
                        .execute(&mut *tx)
                        .await?;
                }
                EventOutcome::Dead { reason } => {
                    sqlx::query(queries.kill.clone())
                        .bind(id)
                        .bind(reason)
                        .bind(now)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        if !published.is_empty() {
            let published = json!(published).to_string();
            sqlx::query(queries.publish.clone())
                .bind(now)
                .bind(&published)
                .execute(&mut *tx)
                .await?;
            // Events set aside behind a parked event that is published now.
            sqlx::query(queries.unhold_behind.clone())
                .bind(&published)
                .execute(&mut *tx)
                .await?;
        }
        // What was set aside behind the claim goes with it: all of it when the claim ends, that
        // of the aggregates a part took out of it otherwise. (Claims and records are one
        // writer at a time here: no claim sets an event aside behind what this takes out.)
        let unhold: &[&SqlStr] = if part {
            &[&queries.unhold_freed]
        } else {
            &[&queries.release_events, &queries.unhold_by]
        };
        for query in unhold {
            sqlx::query((*query).clone())
                .bind(token)
                .execute(&mut *tx)
                .await?;
        }
        for d in &outcomes.deliveries {
            let upsert =
                |attempts: u32, error: Option<&String>, at: Option<i64>, dead: Option<i64>| {
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
                } => upsert(*attempts, Some(error), Some(after(*retry_in)), None),
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
            sqlx::query(queries.promote_head.clone())
                .bind(subscriber)
                .bind(aggregate_type)
                .bind(aggregate_id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(Recorded::Applied)
    }

    async fn receive(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        consumer: &str,
        message_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let inserted = sqlx::query(queries.receive.clone())
            .bind(consumer)
            .bind(message_id)
            .bind(now())
            .execute(conn)
            .await?
            .rows_affected();
        Ok(inserted == 1)
    }

    async fn hold_and_receive(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        token: ClaimToken,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<bool>, sqlx::Error> {
        // Two statements: the transaction holds the database's write lock from the first.
        if !Self::hold_claim(&mut *conn, queries, token).await? {
            return Ok(None);
        }
        Ok(Some(
            Self::receive(conn, queries, consumer, message_id).await?,
        ))
    }

    async fn purge_inbox(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, sqlx::Error> {
        let before =
            now().saturating_sub(i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX));
        Ok(sqlx::query(queries.purge_inbox.clone())
            .bind(before)
            .bind(i64::from(batch_size))
            .execute(pool)
            .await?
            .rows_affected())
    }

    async fn purge_published(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        older_than: Duration,
        batch_size: u32,
        after: Option<PurgedUpTo>,
    ) -> Result<PurgeStep, sqlx::Error> {
        let before =
            now().saturating_sub(i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX));
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let examined: Vec<(i64, i64, bool)> = sqlx::query_as(queries.purge_examined.clone())
            .bind(before)
            .bind(after.map(|a| a.published_at))
            .bind(after.map(|a| a.id))
            .bind(i64::from(batch_size))
            .fetch_all(&mut *tx)
            .await?;
        let doomed: Vec<i64> = examined
            .iter()
            .filter(|(_, _, held)| !held)
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
                .map(|&(id, published_at, _)| PurgedUpTo { published_at, id }),
        })
    }

    crate::views::operator_views!(
        SqlitePool,
        SqliteQueries,
        SqliteConnection,
        begin = |_: &SqliteQueries| "BEGIN"
    );

    async fn published_within(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        window: Duration,
    ) -> Result<u64, sqlx::Error> {
        let count: i64 = sqlx::query_scalar(queries.published_within.clone())
            .bind(now().saturating_sub(i64::try_from(window.as_micros()).unwrap_or(i64::MAX)))
            .fetch_one(pool)
            .await?;
        Ok(row_count(count))
    }

    async fn status(pool: &SqlitePool, queries: &SqliteQueries) -> Result<Status, sqlx::Error> {
        type Row = (i64, Option<i64>, i64, i64, i64, i64, i64, i64);
        let (events, oldest, deliveries, dead, blocked, aggregates, held, behind_dead): Row =
            sqlx::query_as(queries.status.clone())
                .fetch_one(pool)
                .await?;
        let mut status = Status::default();
        status.blocked_aggregates = row_count(aggregates);
        status.held_events = row_count(held);
        status.pending_events = row_count(events);
        status.oldest_pending_age = oldest.map(|occurred| {
            Duration::from_micros(u64::try_from(now().saturating_sub(occurred)).unwrap_or(0))
        });
        status.pending_deliveries = row_count(deliveries);
        status.dead_letters = row_count(dead);
        status.blocked_keys = row_count(blocked);
        status.behind_dead_letters = row_count(behind_dead);
        Ok(status)
    }

    async fn skip(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        event_id: i64,
        subscriber: Option<&str>,
        reason: &str,
    ) -> Result<bool, sqlx::Error> {
        let now = now();
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let gone = match subscriber {
            Some(subscriber) => {
                sqlx::query(queries.skip_delivery.clone())
                    .bind(event_id)
                    .bind(subscriber)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            None => {
                sqlx::query(queries.skip_event.clone())
                    .bind(event_id)
                    .bind(now)
                    .fetch_optional(&mut *tx)
                    .await?
            }
        };
        let Some(row) = gone else {
            return Ok(false);
        };
        match subscriber {
            None => {
                sqlx::query(queries.unhold_behind.clone())
                    .bind(json!([event_id]).to_string())
                    .execute(&mut *tx)
                    .await?;
            }
            // The row behind it, if it is now the first of its key, is due.
            Some(subscriber) => {
                sqlx::query(queries.promote_head.clone())
                    .bind(subscriber)
                    .bind(row.try_get::<String, _>("aggregate_type")?)
                    .bind(row.try_get::<Uuid, _>("aggregate_id")?)
                    .bind(now)
                    .execute(&mut *tx)
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

    /// One process per database file: commits wake relays in-process, nothing to send.
    async fn notify(_: &SqlitePool, _: &str, _: &str) -> Result<(), sqlx::Error> {
        Ok(())
    }

    async fn listen(
        _: SqlitePool,
        _: String,
        _: String,
        _: std::sync::Weak<tokio::sync::Notify>,
        _: tokio::sync::watch::Receiver<bool>,
    ) {
    }

    async fn begin_locked(
        pool: &SqlitePool,
        _: &SqliteQueries,
    ) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        pool.begin_with("BEGIN IMMEDIATE").await
    }

    async fn requeue_events(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        ids: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let ids = json!(ids).to_string();
        let events = sqlx::query(queries.requeue_events.clone())
            .bind(&ids)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        let deliveries = sqlx::query(queries.requeue_event_deliveries.clone())
            .bind(&ids)
            .bind(now())
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
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        subscriber: &str,
        first_line: Option<&str>,
    ) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(queries.requeue_subscriber.clone())
            .bind(subscriber)
            .bind(now())
            .bind(first_line)
            .execute(conn)
            .await?
            .rows_affected())
    }

    async fn requeues(
        pool: &SqlitePool,
        queries: &SqliteQueries,
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
                requeue_record(row, event_ids, from_micros(row.try_get("requeued_at")?))
            })
            .collect()
    }

    async fn record_requeue(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
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
            .bind(now())
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// A claimed event row; one whose values this build cannot read becomes [`Claim::Unreadable`].
fn event_claim(row: &SqliteRow) -> Result<Claim, sqlx::Error> {
    let read = || -> Result<Claim, sqlx::Error> {
        let blocked: String = row.try_get("blocked")?;
        Ok(Claim::Event {
            event: stored_event(row)?,
            parked: backend::count(row.try_get("retry_count")?),
            expired: backend::count(row.try_get("expired_claims")?),
            blocked: serde_json::from_str(&blocked)
                .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        })
    };
    match read() {
        Ok(claim) => Ok(claim),
        Err(error) => Ok(unreadable(row, None, &error)),
    }
}

/// A row that cannot be read: its id (an integer primary key, always readable) and, when it can
/// be read, its aggregate.
fn unreadable(row: &SqliteRow, subscriber: Option<String>, error: &sqlx::Error) -> Claim {
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

fn stored_event(row: &SqliteRow) -> Result<StoredEvent, sqlx::Error> {
    let occurred: i64 = row.try_get("occurred_at")?;
    Ok(StoredEvent {
        id: row.try_get("id")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get::<Uuid, _>("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        occurred_at: OffsetDateTime::from_unix_timestamp_nanos(i128::from(occurred) * 1000)
            .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
    })
}

#[cfg(test)]
mod tests {
    use outbox_tests::backend::TestBackend;
    use sqlx::AssertSqlSafe;

    use super::*;
    use crate::Outbox;

    /// A migrated database on a fresh file with 20 000 published events, of aggregate
    /// `aggregate` (an SQL expression of `n`, 1 to 20 000), and a delivery row waiting for a
    /// subscriber that is down for each of those that `waiting` (a condition) holds true of;
    /// analyzed.
    async fn filled(
        aggregate: &str,
        waiting: &str,
    ) -> (<Sqlite as TestBackend>::Guard, SqlitePool) {
        let (file, pool) = <Sqlite as TestBackend>::fresh().await;
        Outbox::<Sqlite, ()>::new(pool.clone())
            .migrate()
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < 20000)
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at,
                                 published_at)
             SELECT 'a', {aggregate}, 'E', '{{}}', 0, n FROM g;
             INSERT INTO outbox_deliveries (event_id, subscriber, aggregate_type, aggregate_id)
             SELECT id, 'down', aggregate_type, aggregate_id FROM outbox WHERE {waiting};
             ANALYZE;"
        )))
        .execute(&pool)
        .await
        .unwrap();
        (file, pool)
    }

    /// The steps of SQLite's plan for `statement` (`EXPLAIN QUERY PLAN`'s details).
    async fn plan(pool: &SqlitePool, statement: &SqlStr) -> Vec<String> {
        let plan: Vec<(i64, i64, i64, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "EXPLAIN QUERY PLAN {}",
            statement.as_str()
        )))
        .fetch_all(pool)
        .await
        .unwrap();
        plan.into_iter().map(|(_, _, _, detail)| detail).collect()
    }

    /// The steps of SQLite's plan for `statement` that read a table or an index whole, but for
    /// the partial indexes of unpublished events (`pending_idx` is read in order up to the
    /// batch; `aggregate_idx` holds what the status counts) and for the deliveries when
    /// `deliveries_counted` (the status counts them all).
    async fn full_scans(
        pool: &SqlitePool,
        statement: &SqlStr,
        deliveries_counted: bool,
    ) -> Vec<String> {
        plan(pool, statement)
            .await
            .into_iter()
            .filter(|detail| {
                let Some(what) = detail.strip_prefix("SCAN ") else {
                    return false;
                };
                let (table, index) = what.split_once(" USING ").unwrap_or((what, ""));
                // (`d`: the deliveries, in these statements.)
                if deliveries_counted && ["outbox_deliveries", "d"].contains(&table) {
                    return false;
                }
                if index.is_empty() {
                    // These statements name their tables so; CTEs and subqueries have other
                    // names.
                    ["o", "e", "d", "f", "outbox", "outbox_deliveries"].contains(&table)
                } else {
                    // (The other partial indexes hold events set aside, or claimed.)
                    ![
                        "outbox_pending_idx",
                        "outbox_aggregate_idx",
                        "outbox_held_by_idx",
                        "outbox_held_behind_idx",
                        "outbox_claim_idx",
                    ]
                    .iter()
                    .any(|partial| index.ends_with(&format!("INDEX {partial}")))
                }
            })
            .collect()
    }

    /// What a relay runs often (its claim, its purge, its status) and what an operator's
    /// console reads every few seconds (the overview, a page of each state, the dead letters'
    /// groups) read the outbox and the deliveries through indexes, on a table that keeps many
    /// published events and a subscriber's waiting deliveries: no plan reads the retained
    /// events, and the claim no waiting delivery but through an index probe.
    #[tokio::test]
    async fn the_claim_the_purge_and_the_status_read_by_index() {
        let (_file, pool) = filled("randomblob(16)", "id % 2 = 0").await;
        let queries = Sqlite::queries(&TableNames::default());
        for (name, statement, deliveries_counted) in [
            ("candidates", &queries.candidates, false),
            ("due_deliveries", &queries.due_deliveries, false),
            ("purge_examined", &queries.purge_examined, false),
            ("status", &queries.status, true),
            ("unroutable", &queries.unroutable, true),
            ("overview", &queries.overview, true),
            ("dead_letter_groups", &queries.dead_letter_groups, true),
        ]
        .into_iter()
        .chain(
            queries
                .list
                .iter()
                .map(|page| ("a page of a state", page, true)),
        ) {
            let scans = full_scans(&pool, statement, deliveries_counted).await;
            assert!(scans.is_empty(), "{name} reads a table whole: {scans:?}");
        }
    }

    /// Which subscribers hold a claimed event back is found with one probe per subscriber
    /// with deliveries, of the last row of the event's key in `deliveries_head_idx`, never by
    /// reading the deliveries of the event's aggregate (all of a down subscriber's waiting
    /// rows of it, for each event claimed: the cost grew with the rows waiting; PostgreSQL's
    /// and MySQL's claims measure it). The subscribers are walked one index step each. Planned
    /// on 10 aggregates with 2 000 deliveries each waiting for a subscriber that is down.
    #[tokio::test]
    async fn the_claim_finds_what_holds_an_event_back_by_one_probe_per_subscriber() {
        let (_file, pool) = filled("CAST(printf('%016d', n % 10) AS BLOB)", "TRUE").await;
        let queries = Sqlite::queries(&TableNames::default());
        let plan = plan(&pool, &queries.claim_events).await;
        let deliveries: Vec<&str> = plan
            .iter()
            .map(String::as_str)
            .filter(|detail| detail.contains("outbox_deliveries") || detail.contains(" d "))
            .collect();
        assert!(
            deliveries
                .iter()
                .any(|detail| detail.starts_with("SEARCH d USING ")
                    && detail.contains(
                        "INDEX outbox_deliveries_head_idx (subscriber=? AND aggregate_id=?"
                    )),
            "no probe of a key's rows: {deliveries:?}"
        );
        assert!(
            deliveries
                .iter()
                .all(|detail| !detail.contains("aggregate_idx") && !detail.starts_with("SCAN")),
            "the aggregate's deliveries are read: {deliveries:?}"
        );
        assert!(
            !plan.iter().any(|detail| detail.contains("TEMP B-TREE")),
            "rows are sorted, not read in index order: {plan:?}"
        );
    }
}
