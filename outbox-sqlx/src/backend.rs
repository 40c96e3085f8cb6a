//! The database-specific half of the stores: SQL and how to run it.

use std::future::Future;
use std::time::Duration;

use outbox_core::store::{
    Batch, ClaimFilter, ClaimLimit, ClaimToken, Outcomes, Recorded, Registry, Requeue,
};
use sqlx::Pool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::Error;
use crate::names::TableNames;

/// A database the outbox can live in. Sealed: implemented for `sqlx::Postgres` (feature
/// `postgres`), `sqlx::Sqlite` (feature `sqlite`) and `sqlx::MySql` (feature `mysql`: MySQL 8.0
/// or MariaDB 10.6 and later).
pub trait Backend: sqlx::Database + sealed::Sealed {
    /// The SQL for one set of tables, built once from the validated names.
    #[doc(hidden)]
    type Queries: Send + Sync + 'static;

    #[doc(hidden)]
    fn queries(names: &TableNames) -> Self::Queries;

    /// Lets go of the connections the queries keep of their own (`Outbox::close`); later
    /// statements take connections as they need them.
    #[doc(hidden)]
    fn close(_queries: &Self::Queries) {}

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

    /// The error of a publish of `events` events that failed with `error`.
    #[doc(hidden)]
    fn publish_error(error: sqlx::Error, events: usize) -> Error {
        let _ = events;
        Error::Database(error)
    }

    /// Whether [`claim`](Self::claim) honours [`ClaimFilter::take_over`].
    #[doc(hidden)]
    const CLAIMS_TAKE_OVER: bool = false;

    #[doc(hidden)]
    fn claim(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        limit: ClaimLimit,
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

    /// Records `outcomes` under the claim `token`; with `part`, the claim stays live for what
    /// the outcomes do not name (`Store::record_part`), else it ends.
    #[doc(hidden)]
    fn record(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        token: ClaimToken,
        outcomes: &Outcomes,
        part: bool,
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

    /// The count of each state and what holds work back.
    #[doc(hidden)]
    fn overview(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<crate::Overview, sqlx::Error>> + Send;

    /// How many events were published (handed to every subscriber, or skipped) within the
    /// last `window`.
    #[doc(hidden)]
    fn published_within(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        window: Duration,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// The dead letters grouped by (subscriber, first line of the last error).
    #[doc(hidden)]
    fn dead_letter_groups(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<Vec<crate::DeadLetterGroup>, sqlx::Error>> + Send;

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

    /// Begins a transaction under the claim lock, for a requeue: no claim may set events aside
    /// behind what it hands back, on an older snapshot, meanwhile.
    #[doc(hidden)]
    fn begin_locked(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Self>, sqlx::Error>> + Send;

    /// Hands the dead or parked events `ids` back, with every dead delivery of them; returns
    /// the rows changed.
    #[doc(hidden)]
    fn requeue_events(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        ids: &[i64],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Hands `subscriber`'s dead deliveries back (only those whose error's first line is
    /// `first_line`, when given); returns how many.
    #[doc(hidden)]
    fn requeue_deliveries(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        subscriber: &str,
        first_line: Option<&str>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// The dead events whose error's first line is `first_line`.
    #[doc(hidden)]
    fn dead_events_failing(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        first_line: &str,
    ) -> impl Future<Output = Result<Vec<i64>, sqlx::Error>> + Send;

    /// The recorded requeues, newest first: at most `limit`, with ids below `before`.
    #[doc(hidden)]
    fn requeues(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        before: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<crate::RequeueRecord>, sqlx::Error>> + Send;

    /// Records a requeue made with a reason in `<table>_requeues`.
    #[doc(hidden)]
    fn record_requeue(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        named: &Named<'_>,
        requeued: u64,
        reason: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// What a requeue named, as `<table>_requeues` records it.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Named<'a> {
    pub(crate) event_ids: Option<&'a [i64]>,
    pub(crate) subscriber: Option<&'a str>,
    pub(crate) first_line: Option<&'a str>,
}

/// Hands back what `which` names, in one transaction under the claim lock, on any backend;
/// with a reason, records it (when anything went back) in the same transaction.
pub(crate) async fn requeue<DB: Backend>(
    pool: &Pool<DB>,
    queries: &DB::Queries,
    which: &Requeue,
    reason: Option<&str>,
) -> Result<u64, sqlx::Error> {
    let mut tx = DB::begin_locked(pool, queries).await?;
    let failing;
    let (requeued, named) = match which {
        Requeue::Events(ids) => (
            DB::requeue_events(&mut tx, queries, ids).await?,
            Named {
                event_ids: Some(ids),
                ..Named::default()
            },
        ),
        Requeue::Subscriber(subscriber) => (
            DB::requeue_deliveries(&mut tx, queries, subscriber, None).await?,
            Named {
                subscriber: Some(subscriber),
                ..Named::default()
            },
        ),
        Requeue::Failure {
            subscriber: Some(subscriber),
            first_line,
        } => (
            DB::requeue_deliveries(&mut tx, queries, subscriber, Some(first_line)).await?,
            Named {
                subscriber: Some(subscriber),
                first_line: Some(first_line),
                ..Named::default()
            },
        ),
        Requeue::Failure {
            subscriber: None,
            first_line,
        } => {
            failing = DB::dead_events_failing(&mut tx, queries, first_line).await?;
            (
                DB::requeue_events(&mut tx, queries, &failing).await?,
                Named {
                    event_ids: Some(&failing),
                    first_line: Some(first_line),
                    ..Named::default()
                },
            )
        }
    };
    if let Some(reason) = reason.filter(|_| requeued > 0) {
        DB::record_requeue(&mut tx, queries, &named, requeued, reason).await?;
    }
    tx.commit().await?;
    Ok(requeued)
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

/// The registry of (relay id as text, generation, routing) rows, for databases that store the
/// id as text.
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) fn registry_of_text(rows: Vec<(String, i64, String)>) -> Registry {
    registry_of(
        rows.into_iter()
            .filter_map(|(id, generation, routing)| {
                Some((Uuid::parse_str(&id).ok()?, generation, routing))
            })
            .collect(),
    )
}

/// A count read from the database as a `u32` (0 if it does not fit).
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) fn count(value: i64) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

/// The size of a payload as the database reports it (NULL, for a row gone meanwhile: 0), for
/// a claim's byte limit.
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) fn payload_bytes(value: Option<i64>) -> u64 {
    value.map_or(0, row_count)
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

/// Per-subscriber counts; the same SQL on every backend (`count`, not `sum`: MySQL sums into
/// a DECIMAL).
pub(crate) fn subscribers_query(deliveries: &str) -> String {
    format!(
        "SELECT subscriber,
                count(CASE WHEN dead_at IS NULL THEN 1 END) AS pending,
                count(CASE WHEN dead_at IS NOT NULL THEN 1 END) AS dead,
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
/// `record` (an insert of version `$1` and description `$2`). `render` turns a migration's
/// template into SQL ([`TableNames::render`], with the backend's quoting).
pub(crate) async fn apply_migrations<DB>(
    conn: &mut DB::Connection,
    names: &TableNames,
    migrations: &[Migration],
    last: i32,
    ledger: &str,
    record: &str,
    render: impl Fn(&str) -> String,
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
        let text = render(template);
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

/// How long until a time `micros` microseconds away is due, rounded up to the millisecond (a
/// relay then wakes at most a millisecond late, never early); zero for a time passed.
#[cfg_attr(not(any(feature = "sqlite", feature = "mysql")), allow(dead_code))]
pub(crate) fn due_in_micros(micros: i128) -> Duration {
    let micros = u64::try_from(micros).unwrap_or(if micros > 0 { u64::MAX } else { 0 });
    Duration::from_millis(micros.div_ceil(1000))
}

/// A delay in seconds, as PostgreSQL multiplies an interval by it: at most
/// [`LONGEST_DELAY`](outbox_core::store::LONGEST_DELAY) (a longer one, from another caller of
/// the store, means as much, where PostgreSQL would refuse the statement).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn seconds(delay: Duration) -> f64 {
    delay.min(outbox_core::store::LONGEST_DELAY).as_secs_f64()
}

/// How old a claim must be before the events waiting behind it are set aside (out of the claim
/// scan, until it ends or lets go of their aggregate): a claim is normally recorded within
/// milliseconds, and setting its aggregates' later events aside would cost two writes each for
/// nothing. One that lasts is a slow batch or a dead relay.
pub(crate) fn hold_after(lease: Duration) -> Duration {
    (lease / 4).min(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_due_time_is_counted_in_milliseconds_rounded_up_never_negative() {
        assert_eq!(due_in_micros(0), Duration::ZERO);
        assert_eq!(due_in_micros(1), Duration::from_millis(1));
        assert_eq!(due_in_micros(40_000), Duration::from_millis(40));
        assert_eq!(due_in_micros(40_001), Duration::from_millis(41));
        assert_eq!(due_in_micros(-4_000), Duration::ZERO);
    }
}
