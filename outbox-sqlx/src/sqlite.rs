//! The SQLite backend: the same tables and semantics as PostgreSQL, for one relay per database
//! file.
//!
//! SQLite has no schemas: the tables are named after [`TableNames::table`] alone, in the main
//! database. Timestamps are stored as integer microseconds since the Unix epoch, taken from this
//! process's clock. SQLite allows one writer at a time, so ids follow commit order without the
//! advisory lock PostgreSQL needs, and a claim is a short `BEGIN IMMEDIATE` transaction.

use std::time::Duration;

use outbox_core::StoredEvent;
use outbox_core::store::{Claim, DeliveryOutcome, EventOutcome, Outcomes, Requeue, Status};
use serde_json::json;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Executor, Row, SqlStr, Sqlite, SqliteConnection, SqlitePool};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::backend::{
    Backend, NewEvent, SubscriberStatus, row_count, sealed, subscriber_status, subscribers_query,
};
use crate::error::Error;
use crate::names::TableNames;

impl sealed::Sealed for Sqlite {}

/// The migrations, in order; templates for [`TableNames::render`].
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "events and per-subscriber deliveries",
        r#"
CREATE TABLE {outbox} (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    aggregate_type  TEXT NOT NULL,
    aggregate_id    BLOB NOT NULL,
    event_type      TEXT NOT NULL,
    payload         TEXT NOT NULL,
    occurred_at     INTEGER NOT NULL,
    published_at    INTEGER,
    retry_count     INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   INTEGER,
    dead_at         INTEGER,
    claimed_until   INTEGER
);
CREATE INDEX {pending_idx} ON {outbox} (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX {aggregate_idx} ON {outbox} (aggregate_id, id)
    WHERE published_at IS NULL;

CREATE TABLE {deliveries} (
    event_id        INTEGER NOT NULL REFERENCES {outbox} (id),
    subscriber      TEXT NOT NULL,
    aggregate_id    BLOB NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   INTEGER NOT NULL,
    dead_at         INTEGER,
    claimed_until   INTEGER,
    PRIMARY KEY (subscriber, event_id)
);
CREATE INDEX {deliveries_head_idx} ON {deliveries} (subscriber, aggregate_id, event_id);
CREATE INDEX {deliveries_aggregate_idx} ON {deliveries} (aggregate_id);
CREATE INDEX {deliveries_due_idx} ON {deliveries} (next_retry_at) WHERE dead_at IS NULL;
"#,
    ),
    (
        2,
        "a record of skipped deliveries",
        r#"
-- Deliveries an operator gave up on; subscriber NULL: the whole event, for every subscriber.
CREATE TABLE {skips} (
    event_id    INTEGER NOT NULL,
    subscriber  TEXT,
    attempts    INTEGER NOT NULL,
    last_error  TEXT,
    reason      TEXT NOT NULL,
    skipped_at  INTEGER NOT NULL
);
"#,
    ),
    (
        3,
        "an index of deliveries by event, for the foreign key",
        r#"
-- Deleting an event (retention) checks that no delivery refers to it: without this index, by a
-- scan of every delivery per deleted event.
CREATE INDEX {deliveries_event_idx} ON {deliveries} (event_id);
"#,
    ),
];

/// The SQL of one set of tables.
#[doc(hidden)]
#[derive(Debug)]
pub struct SqliteQueries {
    insert: SqlStr,
    claim_events: SqlStr,
    claim_deliveries: SqlStr,
    events_by_id: SqlStr,
    publish: SqlStr,
    park: SqlStr,
    kill: SqlStr,
    release: SqlStr,
    delete_delivery: SqlStr,
    upsert_delivery: SqlStr,
    release_delivery: SqlStr,
    requeue_events: SqlStr,
    requeue_event_deliveries: SqlStr,
    requeue_subscriber: SqlStr,
    purge_published: SqlStr,
    status: SqlStr,
    subscribers: SqlStr,
    dead_letters: SqlStr,
    skip_delivery: SqlStr,
    skip_event: SqlStr,
    record_skip: SqlStr,
}

fn sql(text: String) -> SqlStr {
    // Every name in `text` was validated by `TableNames::new` and is quoted.
    sqlx::SqlSafeStr::into_sql_str(AssertSqlSafe(text))
}

/// Microseconds since the Unix epoch, the unit of every timestamp column.
fn micros(time: OffsetDateTime) -> i64 {
    i64::try_from(time.unix_timestamp_nanos() / 1000).unwrap_or(i64::MAX)
}

fn now() -> i64 {
    micros(OffsetDateTime::now_utc())
}

fn after(delay: Duration) -> i64 {
    now().saturating_add(i64::try_from(delay.as_micros()).unwrap_or(i64::MAX))
}

impl Backend for Sqlite {
    type Queries = SqliteQueries;

    fn queries(names: &TableNames) -> SqliteQueries {
        let outbox = names.local("");
        let deliveries = names.local("_deliveries");
        let skips = names.local("_skips");
        SqliteQueries {
            insert: sql(format!(
                r#"
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, occurred_at)
SELECT json_extract(value, '$.t'), unhex(json_extract(value, '$.a')), json_extract(value, '$.e'),
       json_extract(value, '$.p'), coalesce(json_extract(value, '$.o'), $2)
FROM json_each($1)
ORDER BY key"#
            )),
            claim_events: sql(format!(
                r#"
WITH candidates AS (
    SELECT id, aggregate_id FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL
      AND (next_retry_at IS NULL OR next_retry_at <= $1)
      AND (claimed_until IS NULL OR claimed_until < $1)
    ORDER BY id
    LIMIT $2
)
UPDATE {outbox} SET claimed_until = $3
WHERE id IN (
    SELECT c.id FROM candidates AS c
    WHERE NOT EXISTS (
        SELECT 1 FROM {outbox} AS e
        WHERE e.aggregate_id = c.aggregate_id AND e.id < c.id AND e.published_at IS NULL
          AND e.id NOT IN (SELECT id FROM candidates)))
RETURNING id, aggregate_type, aggregate_id, event_type, payload, occurred_at, retry_count,
          (SELECT json_group_array(DISTINCT d.subscriber) FROM {deliveries} AS d
           WHERE d.aggregate_id = {outbox}.aggregate_id) AS blocked"#
            )),
            claim_deliveries: sql(format!(
                r#"
WITH due AS (
    SELECT d.subscriber, d.event_id FROM {deliveries} AS d
    WHERE d.dead_at IS NULL AND d.next_retry_at <= $1
      AND (d.claimed_until IS NULL OR d.claimed_until < $1)
      AND NOT EXISTS (
          SELECT 1 FROM {deliveries} AS h
          WHERE h.subscriber = d.subscriber AND h.aggregate_id = d.aggregate_id
            AND h.event_id < d.event_id)
    ORDER BY d.event_id
    LIMIT $2
)
UPDATE {deliveries} SET claimed_until = $3
WHERE (subscriber, event_id) IN (SELECT subscriber, event_id FROM due)
RETURNING subscriber, event_id, attempts"#
            )),
            events_by_id: sql(format!(
                r#"
SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at FROM {outbox}
WHERE id IN (SELECT value FROM json_each($1))"#
            )),
            publish: sql(format!(
                "UPDATE {outbox} SET published_at = $1, claimed_until = NULL
                 WHERE id IN (SELECT value FROM json_each($2))"
            )),
            park: sql(format!(
                "UPDATE {outbox}
                 SET retry_count = retry_count + 1, last_error = $2, next_retry_at = $3,
                     claimed_until = NULL
                 WHERE id = $1"
            )),
            kill: sql(format!(
                "UPDATE {outbox} SET dead_at = $3, last_error = $2, claimed_until = NULL
                 WHERE id = $1"
            )),
            release: sql(format!(
                "UPDATE {outbox} SET claimed_until = NULL
                 WHERE id IN (SELECT value FROM json_each($1))"
            )),
            delete_delivery: sql(format!(
                "DELETE FROM {deliveries} WHERE subscriber = $1 AND event_id = $2"
            )),
            upsert_delivery: sql(format!(
                "INSERT INTO {deliveries}
                     (event_id, subscriber, aggregate_id, attempts, last_error, next_retry_at,
                      dead_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (subscriber, event_id) DO UPDATE
                 SET attempts = excluded.attempts, last_error = excluded.last_error,
                     next_retry_at = excluded.next_retry_at, dead_at = excluded.dead_at,
                     claimed_until = NULL"
            )),
            release_delivery: sql(format!(
                "UPDATE {deliveries} SET claimed_until = NULL
                 WHERE subscriber = $1 AND event_id = $2"
            )),
            requeue_events: sql(format!(
                "UPDATE {outbox}
                 SET dead_at = NULL, next_retry_at = NULL, retry_count = 0, last_error = NULL,
                     claimed_until = NULL
                 WHERE id IN (SELECT value FROM json_each($1)) AND published_at IS NULL
                   AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL)"
            )),
            requeue_event_deliveries: sql(format!(
                "UPDATE {deliveries}
                 SET dead_at = NULL, attempts = 0, next_retry_at = $2, last_error = NULL,
                     claimed_until = NULL
                 WHERE event_id IN (SELECT value FROM json_each($1)) AND dead_at IS NOT NULL"
            )),
            requeue_subscriber: sql(format!(
                "UPDATE {deliveries}
                 SET dead_at = NULL, attempts = 0, next_retry_at = $2, last_error = NULL,
                     claimed_until = NULL
                 WHERE subscriber = $1 AND dead_at IS NOT NULL"
            )),
            dead_letters: sql(format!(
                r#"
SELECT o.id AS event_id, NULL AS subscriber, o.event_type, o.aggregate_type, o.aggregate_id,
       o.retry_count AS attempts, o.last_error
FROM {outbox} AS o WHERE o.dead_at IS NOT NULL
UNION ALL
SELECT d.event_id, d.subscriber, o.event_type, o.aggregate_type, o.aggregate_id, d.attempts,
       d.last_error
FROM {deliveries} AS d JOIN {outbox} AS o ON o.id = d.event_id
WHERE d.dead_at IS NOT NULL
ORDER BY event_id, subscriber"#
            )),
            status: sql(format!(
                r#"
SELECT (SELECT count(*) FROM {outbox} WHERE published_at IS NULL AND dead_at IS NULL),
       (SELECT min(occurred_at) FROM {outbox} WHERE published_at IS NULL AND dead_at IS NULL),
       (SELECT count(*) FROM {deliveries} WHERE dead_at IS NULL),
       (SELECT count(*) FROM {outbox} WHERE published_at IS NULL AND dead_at IS NOT NULL)
         + (SELECT count(*) FROM {deliveries} WHERE dead_at IS NOT NULL),
       (SELECT count(*) FROM (SELECT DISTINCT subscriber, aggregate_id FROM {deliveries}))"#
            )),
            subscribers: sql(subscribers_query(&deliveries)),
            skip_delivery: sql(format!(
                r#"
DELETE FROM {deliveries}
WHERE event_id = $1 AND subscriber = $2 AND (claimed_until IS NULL OR claimed_until < $3)
RETURNING attempts, last_error"#
            )),
            skip_event: sql(format!(
                r#"
UPDATE {outbox} SET published_at = $2, dead_at = NULL, next_retry_at = NULL
WHERE id = $1 AND published_at IS NULL
  AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL)
  AND (claimed_until IS NULL OR claimed_until < $2)
RETURNING retry_count AS attempts, last_error"#
            )),
            record_skip: sql(format!(
                "INSERT INTO {skips} (event_id, subscriber, attempts, last_error, reason, skipped_at)
                 VALUES ($1, $2, $3, $4, $5, $6)"
            )),
            purge_published: sql(format!(
                r#"
DELETE FROM {outbox} WHERE id IN (
    SELECT id FROM {outbox} AS o
    WHERE published_at < $1
      AND NOT EXISTS (SELECT 1 FROM {deliveries} AS d WHERE d.event_id = o.id)
    ORDER BY id
    LIMIT $2)"#
            )),
        }
    }

    async fn migrate(pool: &SqlitePool, names: &TableNames) -> Result<(), Error> {
        let migrations = names.local("_migrations");
        let known = MIGRATIONS.last().map_or(0, |m| m.0);
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
        let current: i32 = sqlx::query_scalar(sql(format!(
            "SELECT coalesce(max(version), 0) FROM {migrations}"
        )))
        .fetch_one(&mut *tx)
        .await?;
        if current > known {
            return Err(Error::SchemaTooNew {
                schema: names.schema().to_owned(),
                table: names.table().to_owned(),
                found: current,
                known,
            });
        }
        for (version, description, template) in MIGRATIONS {
            if *version <= current {
                continue;
            }
            let text = names.render(template, |suffix| names.local(suffix));
            tx.execute(sqlx::raw_sql(sql(text))).await?;
            sqlx::query(sql(format!(
                "INSERT INTO {migrations} (version, description, applied_at) VALUES ($1, $2, $3)"
            )))
            .bind(version)
            .bind(description)
            .bind(now())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn insert(
        conn: &mut SqliteConnection,
        queries: &SqliteQueries,
        events: &[NewEvent],
    ) -> Result<(), sqlx::Error> {
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
        limit: u32,
        lease: Duration,
    ) -> Result<Vec<Claim>, sqlx::Error> {
        let (now, until) = (now(), after(lease));
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let event_rows = sqlx::query(queries.claim_events.clone())
            .bind(now)
            .bind(i64::from(limit))
            .bind(until)
            .fetch_all(&mut *tx)
            .await?;
        let delivery_rows = sqlx::query(queries.claim_deliveries.clone())
            .bind(now)
            .bind(i64::from(limit))
            .bind(until)
            .fetch_all(&mut *tx)
            .await?;
        let mut claims = Vec::with_capacity(event_rows.len() + delivery_rows.len());
        for row in &event_rows {
            let blocked: String = row.try_get("blocked")?;
            claims.push(Claim::Event {
                event: stored_event(row)?,
                parked: count(row.try_get("retry_count")?),
                blocked: serde_json::from_str(&blocked)
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            });
        }
        if !delivery_rows.is_empty() {
            let ids: Vec<i64> = delivery_rows
                .iter()
                .map(|row| row.try_get("event_id"))
                .collect::<Result<_, _>>()?;
            let events = sqlx::query(queries.events_by_id.clone())
                .bind(json!(ids).to_string())
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(stored_event)
                .collect::<Result<Vec<_>, _>>()?;
            for row in &delivery_rows {
                let id: i64 = row.try_get("event_id")?;
                let Some(event) = events.iter().find(|e| e.id == id) else {
                    continue;
                };
                claims.push(Claim::Delivery {
                    event: event.clone(),
                    subscriber: row.try_get("subscriber")?,
                    attempts: count(row.try_get("attempts")?),
                });
            }
        }
        tx.commit().await?;
        claims.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        Ok(claims)
    }

    async fn record(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        outcomes: &Outcomes,
    ) -> Result<(), sqlx::Error> {
        let now = now();
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let (mut published, mut released) = (Vec::new(), Vec::new());
        for (id, outcome) in &outcomes.events {
            match outcome {
                EventOutcome::Published => published.push(*id),
                EventOutcome::Released => released.push(*id),
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
            sqlx::query(queries.publish.clone())
                .bind(now)
                .bind(json!(published).to_string())
                .execute(&mut *tx)
                .await?;
        }
        if !released.is_empty() {
            sqlx::query(queries.release.clone())
                .bind(json!(released).to_string())
                .execute(&mut *tx)
                .await?;
        }
        for d in &outcomes.deliveries {
            let upsert = |attempts: u32, error: Option<&String>, at: i64, dead: Option<i64>| {
                sqlx::query(queries.upsert_delivery.clone())
                    .bind(d.event_id)
                    .bind(d.subscriber.clone())
                    .bind(d.aggregate_id)
                    .bind(i64::from(attempts))
                    .bind(error.cloned())
                    .bind(at)
                    .bind(dead)
            };
            let query = match &d.outcome {
                DeliveryOutcome::Delivered => sqlx::query(queries.delete_delivery.clone())
                    .bind(d.subscriber.clone())
                    .bind(d.event_id),
                DeliveryOutcome::Released => sqlx::query(queries.release_delivery.clone())
                    .bind(d.subscriber.clone())
                    .bind(d.event_id),
                DeliveryOutcome::Waiting => upsert(0, None, now, None),
                DeliveryOutcome::Retry {
                    attempts,
                    error,
                    retry_in,
                } => upsert(*attempts, Some(error), after(*retry_in), None),
                DeliveryOutcome::Dead { attempts, error } => {
                    upsert(*attempts, Some(error), now, Some(now))
                }
            };
            query.execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    async fn purge_published(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, sqlx::Error> {
        let before =
            now().saturating_sub(i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX));
        Ok(sqlx::query(queries.purge_published.clone())
            .bind(before)
            .bind(i64::from(batch_size))
            .execute(pool)
            .await?
            .rows_affected())
    }

    async fn dead_letters(
        pool: &SqlitePool,
        queries: &SqliteQueries,
    ) -> Result<Vec<crate::DeadLetter>, sqlx::Error> {
        sqlx::query(queries.dead_letters.clone())
            .fetch_all(pool)
            .await?
            .iter()
            .map(|row| {
                Ok(crate::DeadLetter {
                    event_id: row.try_get("event_id")?,
                    subscriber: row.try_get("subscriber")?,
                    event_type: row.try_get("event_type")?,
                    aggregate_type: row.try_get("aggregate_type")?,
                    aggregate_id: row.try_get("aggregate_id")?,
                    attempts: u32::try_from(row.try_get::<i32, _>("attempts")?).unwrap_or(0),
                    last_error: row.try_get("last_error")?,
                })
            })
            .collect()
    }

    async fn status(pool: &SqlitePool, queries: &SqliteQueries) -> Result<Status, sqlx::Error> {
        let (events, oldest, deliveries, dead, blocked): (i64, Option<i64>, i64, i64, i64) =
            sqlx::query_as(queries.status.clone())
                .fetch_one(pool)
                .await?;
        let mut status = Status::default();
        status.pending_events = row_count(events);
        status.oldest_pending_age = oldest.map(|occurred| {
            Duration::from_micros(u64::try_from(now().saturating_sub(occurred)).unwrap_or(0))
        });
        status.pending_deliveries = row_count(deliveries);
        status.dead_letters = row_count(dead);
        status.blocked_keys = row_count(blocked);
        Ok(status)
    }

    async fn subscribers(
        pool: &SqlitePool,
        queries: &SqliteQueries,
    ) -> Result<Vec<SubscriberStatus>, sqlx::Error> {
        sqlx::query(queries.subscribers.clone())
            .fetch_all(pool)
            .await?
            .iter()
            .map(subscriber_status)
            .collect()
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
                    .bind(now)
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

    async fn listen(_: SqlitePool, _: String, _: String, _: std::sync::Weak<tokio::sync::Notify>) {}

    async fn requeue(
        pool: &SqlitePool,
        queries: &SqliteQueries,
        which: &Requeue,
    ) -> Result<u64, sqlx::Error> {
        let now = now();
        match which {
            Requeue::Events(ids) => {
                let ids = json!(ids).to_string();
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let events = sqlx::query(queries.requeue_events.clone())
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                let deliveries = sqlx::query(queries.requeue_event_deliveries.clone())
                    .bind(&ids)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                tx.commit().await?;
                Ok(events + deliveries)
            }
            Requeue::Subscriber(subscriber) => Ok(sqlx::query(queries.requeue_subscriber.clone())
                .bind(subscriber)
                .bind(now)
                .execute(pool)
                .await?
                .rows_affected()),
        }
    }
}

fn count(value: i64) -> u32 {
    u32::try_from(value).unwrap_or(0)
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
