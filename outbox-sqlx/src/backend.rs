//! The database-specific half of the stores: SQL and how to run it.

use std::future::Future;
use std::time::Duration;

use outbox_core::store::{Batch, ClaimFilter, ClaimToken, Outcomes, Recorded, Registry, Requeue};
use sqlx::Pool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::Error;
use crate::names::TableNames;

/// A database the outbox can live in. Sealed: implemented for `sqlx::Postgres` (feature
/// `postgres`) and `sqlx::Sqlite` (feature `sqlite`).
pub trait Backend: sqlx::Database + sealed::Sealed {
    /// The SQL for one set of tables, built once from the validated names.
    #[doc(hidden)]
    type Queries: Send + Sync + 'static;

    #[doc(hidden)]
    fn queries(names: &TableNames) -> Self::Queries;

    #[doc(hidden)]
    fn migrate(
        pool: &Pool<Self>,
        names: &TableNames,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    #[doc(hidden)]
    fn insert(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        events: &[NewEvent],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    #[doc(hidden)]
    fn claim(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        limit: u32,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> impl Future<Output = Result<Batch, sqlx::Error>> + Send;

    /// See [`Store::register`](outbox_core::Store::register).
    #[doc(hidden)]
    fn register(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Registry, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn unregister(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        relay: Uuid,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The relays registered within `ttl`, read only.
    #[doc(hidden)]
    fn live_relays(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        ttl: Duration,
    ) -> impl Future<Output = Result<Registry, sqlx::Error>> + Send;

    /// Pending events whose type is not in `event_types`, pending deliveries whose subscriber
    /// is not in `subscribers`, and how long ago the oldest of them occurred.
    #[doc(hidden)]
    fn unroutable(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        event_types: Vec<String>,
        subscribers: Vec<String>,
    ) -> impl Future<Output = Result<(u64, u64, Option<Duration>), sqlx::Error>> + Send;

    #[doc(hidden)]
    fn renew(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        token: ClaimToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Locks the claim `token` for the rest of the transaction of `conn`, if it is live: it
    /// cannot expire (nor its work be claimed again) before that transaction ends.
    #[doc(hidden)]
    fn hold_claim(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        token: ClaimToken,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn record(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> impl Future<Output = Result<Recorded, sqlx::Error>> + Send;

    /// Looks at the next `batch_size` old published events after `after`, in the order they
    /// were published, and deletes those no delivery holds.
    #[doc(hidden)]
    fn purge_published(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        older_than: Duration,
        batch_size: u32,
        after: Option<PurgedUpTo>,
    ) -> impl Future<Output = Result<PurgeStep, sqlx::Error>> + Send;

    /// Records in the transaction of `conn` that `consumer` handled `message_id`; false when
    /// that was recorded before (by a transaction that committed).
    #[doc(hidden)]
    fn receive(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        consumer: &str,
        message_id: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// [`hold_claim`](Self::hold_claim) of `token`, then, if it is live, [`receive`](Self::receive)
    /// of `message_id` by `consumer`, in the transaction of `conn`: `None` when the claim is lost
    /// (nothing recorded), else whether the message is new.
    #[doc(hidden)]
    fn hold_and_receive(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        token: ClaimToken,
        consumer: &str,
        message_id: &str,
    ) -> impl Future<Output = Result<Option<bool>, sqlx::Error>> + Send;

    /// Deletes up to `batch_size` inbox records older than `older_than`, oldest first.
    #[doc(hidden)]
    fn purge_inbox(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        older_than: Duration,
        batch_size: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// One page of the events or deliveries in one state (see [`crate::ListQuery`]).
    #[doc(hidden)]
    fn list(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        query: &crate::ListQuery,
    ) -> impl Future<Output = Result<Vec<crate::Listed>, sqlx::Error>> + Send;

    /// The dead letters grouped by (subscriber, first line of the last error).
    #[doc(hidden)]
    fn dead_letter_groups(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<Vec<crate::DeadLetterGroup>, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn dead_letters(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<Vec<crate::DeadLetter>, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn status(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<outbox_core::store::Status, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn subscribers(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<Vec<SubscriberStatus>, sqlx::Error>> + Send;

    /// Gives up one subscriber's delivery (or, with no subscriber, a dead or parked event) and
    /// records it; false when there is no such delivery free to skip.
    #[doc(hidden)]
    fn skip(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        event_id: i64,
        subscriber: Option<&str>,
        reason: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Sends the wake-up hint to relays of other processes, marked with `sender`.
    #[doc(hidden)]
    fn notify(
        pool: &Pool<Self>,
        channel: &str,
        sender: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Listens for wake-up hints, on a connection of its own (not one of `pool`'s), and passes
    /// those not marked with `own` to `wake`, until `closed` says the outbox closed (or is gone).
    #[doc(hidden)]
    fn listen(
        pool: Pool<Self>,
        channel: String,
        own: String,
        wake: std::sync::Weak<tokio::sync::Notify>,
        closed: tokio::sync::watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static;

    #[doc(hidden)]
    fn requeue(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        which: &Requeue,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// A registry of (relay, generation, routing) rows: its version is the ordered generations.
pub(crate) fn registry_of(mut rows: Vec<(Uuid, i64, String)>) -> Registry {
    rows.sort_by_key(|row| row.1);
    let version = rows
        .iter()
        .map(|row| row.1.to_string())
        .collect::<Vec<_>>()
        .join(",");
    Registry::new(
        version,
        rows.into_iter()
            .map(|(id, _, routing)| (id, routing))
            .collect(),
    )
}

/// An encoded event on its way into the store.
#[doc(hidden)]
#[derive(Debug)]
pub struct NewEvent {
    pub(crate) aggregate_type: &'static str,
    pub(crate) aggregate_id: Uuid,
    pub(crate) event_type: &'static str,
    pub(crate) payload: String,
    pub(crate) occurred_at: Option<OffsetDateTime>,
}

/// What one subscriber has left, as operators see it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriberStatus {
    /// The subscriber.
    pub subscriber: String,
    /// Deliveries waiting for a retry or behind an earlier event.
    pub pending: u64,
    /// Dead deliveries, waiting for an operator.
    pub dead: u64,
    /// Aggregates whose later events wait for this subscriber.
    pub blocked_keys: u64,
}

/// The SQL of one page of the rows in `state`, filtered and after a (event id, subscriber)
/// key, in that order: the state's rows as `x`, then the filters. Parameters: $1 subscriber,
/// $2 event type, $3 aggregate id (each NULL for any), $4 and $5 the key to start after, $6 the
/// page size; `param(n, type)` writes parameter `n` in the dialect (with a cast where needed).
pub(crate) fn list_query(
    outbox: &str,
    deliveries: &str,
    skips: &str,
    state: crate::ListState,
    param: impl Fn(u8, &str) -> String,
) -> String {
    use crate::ListState as S;
    let event = |condition: &str| {
        format!(
            "SELECT o.id AS event_id, NULL AS subscriber, o.event_type, o.aggregate_type,
                    o.aggregate_id, o.retry_count AS attempts, o.last_error, NULL AS reason
             FROM {outbox} AS o WHERE o.published_at IS NULL AND {condition}"
        )
    };
    let delivery = |condition: &str| {
        format!(
            "SELECT d.event_id, d.subscriber, o.event_type, o.aggregate_type, o.aggregate_id,
                    d.attempts, d.last_error, NULL AS reason
             FROM {deliveries} AS d JOIN {outbox} AS o ON o.id = d.event_id WHERE {condition}"
        )
    };
    let rows = match state {
        S::Pending => event(
            "o.dead_at IS NULL AND o.next_retry_at IS NULL AND o.held_by IS NULL
             AND o.held_behind IS NULL",
        ),
        S::Parked => event("o.dead_at IS NULL AND o.next_retry_at IS NOT NULL"),
        S::Held => {
            event("o.dead_at IS NULL AND (o.held_by IS NOT NULL OR o.held_behind IS NOT NULL)")
        }
        S::Retrying => delivery("d.dead_at IS NULL AND d.attempts > 0"),
        S::Waiting => delivery("d.dead_at IS NULL AND d.attempts = 0"),
        S::Dead => format!(
            "{} UNION ALL {}",
            event("o.dead_at IS NOT NULL"),
            delivery("d.dead_at IS NOT NULL")
        ),
        S::Skipped => format!(
            "SELECT k.event_id, k.subscriber, coalesce(o.event_type, '') AS event_type,
                    coalesce(o.aggregate_type, '') AS aggregate_type, o.aggregate_id,
                    k.attempts, k.last_error, k.reason
             FROM {skips} AS k LEFT JOIN {outbox} AS o ON o.id = k.event_id"
        ),
    };
    let (subscriber, event_type, aggregate) =
        (param(1, "text"), param(2, "text"), param(3, "uuid"));
    let (after_id, after_subscriber, limit) =
        (param(4, "int8"), param(5, "text"), param(6, "int8"));
    format!(
        "SELECT * FROM ({rows}) AS x
         WHERE ({subscriber} IS NULL OR x.subscriber = {subscriber})
           AND ({event_type} IS NULL OR x.event_type = {event_type})
           AND ({aggregate} IS NULL OR x.aggregate_id = {aggregate})
           AND (x.event_id, coalesce(x.subscriber, '')) > ({after_id}, {after_subscriber})
         ORDER BY x.event_id, coalesce(x.subscriber, '')
         LIMIT {limit}"
    )
}

/// One row of [`list_query`].
pub(crate) fn listed<R: sqlx::Row>(
    row: &R,
    state: crate::ListState,
) -> Result<crate::Listed, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Uuid>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let attempts = row
        .try_get::<i64, _>("attempts")
        .or_else(|_| row.try_get::<i32, _>("attempts").map(i64::from))?;
    Ok(crate::Listed {
        event_id: row.try_get("event_id")?,
        subscriber: row.try_get("subscriber")?,
        state,
        event_type: row.try_get("event_type")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        last_error: row.try_get("last_error")?,
        reason: row.try_get("reason")?,
    })
}

/// Dead letters grouped by subscriber and the first line of their last error, largest groups
/// first; `first_line` is the dialect's expression for the first line of a text column.
pub(crate) fn dead_letter_groups_query(
    outbox: &str,
    deliveries: &str,
    first_line: impl Fn(&str) -> String,
) -> String {
    let line = first_line("x.last_error");
    format!(
        r#"
SELECT x.subscriber, {line} AS first_line, count(*) AS dead,
       min(x.event_id) AS first_event_id, max(x.event_id) AS last_event_id
FROM (
    SELECT NULL AS subscriber, o.last_error, o.id AS event_id FROM {outbox} AS o
    WHERE o.published_at IS NULL AND o.dead_at IS NOT NULL
    UNION ALL
    SELECT d.subscriber, d.last_error, d.event_id FROM {deliveries} AS d
    WHERE d.dead_at IS NOT NULL
) AS x
GROUP BY x.subscriber, {line}
ORDER BY dead DESC, first_event_id"#
    )
}

/// One group of [`dead_letter_groups_query`]'s rows.
pub(crate) fn dead_letter_group<R: sqlx::Row>(
    row: &R,
) -> Result<crate::DeadLetterGroup, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let subscriber: Option<String> = row.try_get("subscriber")?;
    let first_line: String = row.try_get("first_line")?;
    let kind = match (&subscriber, first_line.as_str()) {
        (None, _) => "undecodable",
        (Some(_), line) if line.starts_with("permanent error") => "permanent",
        (Some(_), line) if line.starts_with("transient error") => "retries exhausted",
        _ => "other",
    };
    Ok(crate::DeadLetterGroup {
        subscriber,
        kind,
        first_line,
        dead: u64::try_from(row.try_get::<i64, _>("dead")?).unwrap_or(0),
        first_event_id: row.try_get("first_event_id")?,
        last_event_id: row.try_get("last_event_id")?,
    })
}

/// Per-subscriber counts; the same SQL on every backend.
pub(crate) fn subscribers_query(deliveries: &str) -> String {
    format!(
        "SELECT subscriber,
                sum(CASE WHEN dead_at IS NULL THEN 1 ELSE 0 END) AS pending,
                sum(CASE WHEN dead_at IS NOT NULL THEN 1 ELSE 0 END) AS dead,
                count(DISTINCT aggregate_id) AS blocked
         FROM {deliveries} GROUP BY subscriber ORDER BY subscriber"
    )
}

pub(crate) fn subscriber_status<R: sqlx::Row>(row: &R) -> Result<SubscriberStatus, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(SubscriberStatus {
        subscriber: row.try_get("subscriber")?,
        pending: row_count(row.try_get("pending")?),
        dead: row_count(row.try_get("dead")?),
        blocked_keys: row_count(row.try_get("blocked")?),
    })
}

/// A migration: its version, what it does, and its SQL, a template for
/// [`TableNames::render`] (the files in `migrations/`).
pub(crate) type Migration = (i32, &'static str, &'static str);

/// Applies, on `conn` (in the caller's transaction, under its migration lock), the
/// `migrations` above the version `ledger` records, up to `last`, and records each with
/// `record` (an insert of version `$1` and description `$2`). `table` names a table by its
/// suffix, as the backend spells it.
pub(crate) async fn apply_migrations<DB>(
    conn: &mut DB::Connection,
    names: &TableNames,
    migrations: &[Migration],
    last: i32,
    ledger: &str,
    record: &str,
    table: impl Fn(&str) -> String,
) -> Result<(), Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    i32: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB> + for<'r> sqlx::Decode<'r, DB>,
    for<'q> &'q str: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let known = migrations.last().map_or(0, |m| m.0);
    let current: i32 = sqlx::query_scalar(sql(format!(
        "SELECT coalesce(max(version), 0) FROM {ledger}"
    )))
    .fetch_one(&mut *conn)
    .await?;
    if current > known {
        return Err(Error::SchemaTooNew {
            schema: names.schema().to_owned(),
            table: names.table().to_owned(),
            found: current,
            known,
        });
    }
    for (version, description, template) in migrations {
        if *version <= current || *version > last {
            continue;
        }
        let text = names.render(template, &table);
        sqlx::raw_sql(sql(text)).execute(&mut *conn).await?;
        sqlx::query(sql(record.to_owned()))
            .bind(*version)
            .bind(*description)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// SQL built from table names: every name in `text` was validated by [`TableNames::new`] and
/// is quoted.
pub(crate) fn sql(text: String) -> sqlx::SqlStr {
    sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(text))
}

/// A row count from SQL as a `u64`.
/// The fewest deliveries of one (subscriber, aggregate) a claim takes behind a due head (when
/// several keys are due, the batch is split between them, but not thinner than this): a key
/// that is free again drains in bulk, and a claim reads at most this many rows per row it
/// takes, plus a batch.
pub(crate) const MIN_SHARE: i64 = 8;

pub(crate) fn row_count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// Where a purge stopped: the last old published event it looked at, by (`published_at` in
/// microseconds since the epoch, id), the order in which purges go through them.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgedUpTo {
    pub published_at: i64,
    pub id: i64,
}

/// What one purge statement did.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeStep {
    /// Events deleted.
    pub deleted: u64,
    /// Where to go on from, when the statement looked at a full batch; `None` when it reached
    /// the events too young to go.
    pub next: Option<PurgedUpTo>,
}
