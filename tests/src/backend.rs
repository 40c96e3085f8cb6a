//! One harness over every backend, so that a behavioural test is written once and run on
//! PostgreSQL, on a real SQLite file and on MySQL / MariaDB.
//!
//! A test body is a generic `async fn body<B: TestBackend>()`; [`crate::on_every_backend!`] runs
//! it as `postgres::body`, `sqlite::body` and `mysql::body`. The harness gives a fresh, migrated database and the
//! few backend-specific queries tests use to look at the tables.

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use outbox_sqlx::{Backend, Outbox, OutboxTx};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{MySql, Pool, Postgres, Row, Sqlite};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::my::TestMyDb;
use crate::pg::TestDb;

/// An event row, as tests look at it.
#[derive(Debug, Clone, PartialEq)]
pub struct EventRow {
    /// The id.
    pub id: i64,
    /// `aggregate_type`.
    pub aggregate_type: String,
    /// `aggregate_id`.
    pub aggregate_id: Uuid,
    /// `event_type`.
    pub event_type: String,
    /// The payload as text.
    pub payload: String,
    /// `occurred_at`.
    pub occurred_at: OffsetDateTime,
    /// Whether `published_at` is set.
    pub published: bool,
    /// Whether `dead_at` is set.
    pub dead: bool,
    /// `retry_count`: times parked.
    pub parked: i64,
    /// `last_error`.
    pub last_error: Option<String>,
    /// Whether `next_retry_at` is in the future.
    pub waiting: bool,
}

/// A delivery row, as tests look at it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryRow {
    /// `attempts`.
    pub attempts: i64,
    /// `last_error`.
    pub last_error: Option<String>,
    /// Whether `dead_at` is set.
    pub dead: bool,
    /// Seconds until `next_retry_at` (negative when due).
    pub due_in: f64,
}

/// A recorded requeue: (event ids, comma-separated; subscriber; first line; rows requeued;
/// reason).
pub type RequeueRecord = (String, Option<String>, Option<String>, i64, String);

/// A backend the behavioural tests run on.
pub trait TestBackend: Backend + Sized {
    /// Keeps the database alive; dropping it removes the database.
    type Guard: Send + Sync;

    /// `"postgres"` or `"sqlite"`.
    const NAME: &'static str;

    /// The version of this backend's last migration in this build.
    const LATEST_MIGRATION: i32;

    /// A fresh, empty database and a pool on it.
    fn fresh() -> impl Future<Output = (Self::Guard, Pool<Self>)> + Send;

    /// Shapes a freshly migrated outbox as the environment asks: on PostgreSQL, with
    /// `OUTBOX_TEST_PARTITION_SIZE=N`, its events table partitioned by id, N ids a partition
    /// (to run the shared tests on that layout).
    fn shape(pool: &Pool<Self>) -> impl Future<Output = ()> + Send {
        let _ = pool;
        async {}
    }

    /// The URL of the database of `guard`.
    fn url(guard: &Self::Guard) -> String;

    /// Another pool on the database at `url`: for a relay of its own, on another runtime say.
    fn connect(url: String) -> impl Future<Output = Pool<Self>> + Send;

    /// Every event row, in id order.
    fn events(pool: &Pool<Self>) -> impl Future<Output = Vec<EventRow>> + Send;

    /// One subscriber's delivery row of an event.
    fn delivery(
        pool: &Pool<Self>,
        subscriber: &str,
        event_id: i64,
    ) -> impl Future<Output = Option<DeliveryRow>> + Send;

    /// How many delivery rows there are.
    fn delivery_count(pool: &Pool<Self>) -> impl Future<Output = i64> + Send;

    /// Inserts an event row by hand, bypassing the typed API; returns its id.
    fn insert_raw(
        pool: &Pool<Self>,
        event_type: &str,
        aggregate: Uuid,
        payload: &str,
    ) -> impl Future<Output = i64> + Send;

    /// Overwrites an event's payload, as an operator repairing it would.
    fn set_payload(pool: &Pool<Self>, id: i64, payload: &str) -> impl Future<Output = ()> + Send;

    /// Writes an `occurred_at` this build cannot read into an event, as other SQL might.
    fn break_occurred_at(pool: &Pool<Self>, id: i64) -> impl Future<Output = ()> + Send;

    /// Moves a published event's `published_at` back by `by`, as if it were published long ago.
    fn backdate_published(
        pool: &Pool<Self>,
        id: i64,
        by: Duration,
    ) -> impl Future<Output = ()> + Send;

    /// Moves the inbox record of `message_id` (any consumer) back by `by`, as if it were
    /// handled long ago.
    fn backdate_inbox(
        pool: &Pool<Self>,
        message_id: &str,
        by: Duration,
    ) -> impl Future<Output = ()> + Send;

    /// How many inbox records there are.
    fn inbox_count(pool: &Pool<Self>) -> impl Future<Output = i64> + Send;

    /// The recorded requeues, oldest first: (event ids, subscriber, first line, requeued,
    /// reason).
    fn requeue_records(pool: &Pool<Self>) -> impl Future<Output = Vec<RequeueRecord>> + Send;

    /// Makes every delivery waiting for a retry due now, as if its delay had passed.
    fn make_deliveries_due(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;

    /// Records a migration newer than this build knows.
    fn insert_future_migration(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;

    /// Creates the domain table `accounts (id, balance)`.
    fn create_accounts(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;

    /// Inserts an account in the transaction.
    fn insert_account<'c, R: Send>(
        tx: &mut OutboxTx<'c, Self, R>,
        id: Uuid,
        balance: i64,
    ) -> impl Future<Output = ()> + Send;

    /// How many accounts there are.
    fn account_count(pool: &Pool<Self>) -> impl Future<Output = i64> + Send;

    /// Creates the table `effects (event_id, relay)`: what handlers did, one row each.
    fn create_effects(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;

    /// Records, on `conn`, that relay `relay` handled event `event_id`.
    fn insert_effect(
        conn: &mut Self::Connection,
        event_id: i64,
        relay: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Every effect, as (event id, relay), in insertion order.
    fn effects(pool: &Pool<Self>) -> impl Future<Output = Vec<(i64, String)>> + Send;

    /// Makes a second effect of one event fail loudly: a unique index on `effects (event_id)`.
    fn make_effects_unique(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;

    /// Whether a connection can be killed from SQL (PostgreSQL: yes; SQLite: no).
    const CAN_KILL_CONNECTIONS: bool;

    /// Kills the server session of `conn` from within it, as a database restart or a proxy
    /// would: the statement and the transaction fail. Only where `CAN_KILL_CONNECTIONS`.
    fn kill_own_connection(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Ends every claim's lease now, as if its relay had stalled past it: renewals and
    /// [`hold_claim`](outbox_sqlx::Outbox::hold_claim) find the claims lost.
    fn expire_claims(pool: &Pool<Self>) -> impl Future<Output = ()> + Send;
}

/// A fresh, migrated outbox on backend `B`, tied to router `R`.
pub async fn outbox<B: TestBackend, R>() -> (B::Guard, Outbox<B, R>) {
    let (guard, pool) = B::fresh().await;
    let outbox = Outbox::new(pool);
    outbox.migrate().await.expect("migrate");
    B::shape(outbox.pool()).await;
    (guard, outbox)
}

impl TestBackend for Postgres {
    type Guard = TestDb;
    const NAME: &'static str = "postgres";
    const LATEST_MIGRATION: i32 = 14;

    async fn fresh() -> (TestDb, Pool<Postgres>) {
        let db = TestDb::new().await;
        let pool = db.pool.clone();
        (db, pool)
    }

    async fn shape(pool: &Pool<Postgres>) {
        if let Some(size) = std::env::var("OUTBOX_TEST_PARTITION_SIZE")
            .ok()
            .and_then(|size| size.parse().ok())
        {
            Outbox::<Postgres, ()>::new(pool.clone())
                .partition_by_id(size)
                .await
                .expect("partition");
        }
    }

    fn url(guard: &TestDb) -> String {
        guard.url()
    }

    async fn connect(url: String) -> Pool<Postgres> {
        PgPoolOptions::new()
            .max_connections(5)
            .connect(&url)
            .await
            .expect("connect to the test database")
    }

    async fn events(pool: &Pool<Postgres>) -> Vec<EventRow> {
        sqlx::query(
            "SELECT id, aggregate_type, aggregate_id, event_type, payload::text AS payload,
                    occurred_at, published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead,
                    retry_count::int8 AS parked, last_error,
                    coalesce(next_retry_at > now(), false) AS waiting
             FROM events.outbox ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| EventRow {
            id: r.get("id"),
            aggregate_type: r.get("aggregate_type"),
            aggregate_id: r.get("aggregate_id"),
            event_type: r.get("event_type"),
            payload: r.get("payload"),
            occurred_at: r.get("occurred_at"),
            published: r.get("published"),
            dead: r.get("dead"),
            parked: r.get("parked"),
            last_error: r.get("last_error"),
            waiting: r.get("waiting"),
        })
        .collect()
    }

    async fn delivery(
        pool: &Pool<Postgres>,
        subscriber: &str,
        event_id: i64,
    ) -> Option<DeliveryRow> {
        sqlx::query(
            "SELECT attempts::int8 AS attempts, last_error, dead_at IS NOT NULL AS dead,
                    extract(epoch FROM next_retry_at - now())::float8 AS due_in
             FROM events.outbox_deliveries WHERE subscriber = $1 AND event_id = $2",
        )
        .bind(subscriber)
        .bind(event_id)
        .fetch_optional(pool)
        .await
        .unwrap()
        .map(|r| DeliveryRow {
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            dead: r.get("dead"),
            due_in: r.get("due_in"),
        })
    }

    async fn delivery_count(pool: &Pool<Postgres>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM events.outbox_deliveries")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn insert_raw(
        pool: &Pool<Postgres>,
        event_type: &str,
        aggregate: Uuid,
        payload: &str,
    ) -> i64 {
        sqlx::query_scalar(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('probe', $1, $2, $3::jsonb) RETURNING id",
        )
        .bind(aggregate)
        .bind(event_type)
        .bind(payload)
        .fetch_one(pool)
        .await
        .unwrap()
    }

    async fn backdate_inbox(pool: &Pool<Postgres>, message_id: &str, by: Duration) {
        let changed = sqlx::query(
            "UPDATE events.outbox_inbox SET handled_at = handled_at - $2 * interval '1 second'
             WHERE message_id = $1",
        )
        .bind(message_id)
        .bind(by.as_secs_f64())
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        assert!(changed > 0, "message {message_id} is in the inbox");
    }

    async fn make_deliveries_due(pool: &Pool<Postgres>) {
        sqlx::query(
            "UPDATE events.outbox_deliveries SET next_retry_at = now() WHERE next_retry_at > now()",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn requeue_records(pool: &Pool<Postgres>) -> Vec<RequeueRecord> {
        sqlx::query_as(
            "SELECT coalesce(array_to_string(event_ids, ','), ''), subscriber, first_line,
                    requeued, reason
             FROM events.outbox_requeues ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    }

    async fn inbox_count(pool: &Pool<Postgres>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM events.outbox_inbox")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn backdate_published(pool: &Pool<Postgres>, id: i64, by: Duration) {
        let changed = sqlx::query(
            "UPDATE events.outbox SET published_at = published_at - $2 * interval '1 second'
             WHERE id = $1 AND published_at IS NOT NULL",
        )
        .bind(id)
        .bind(by.as_secs_f64())
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(changed, 1, "event {id} is published");
    }

    async fn break_occurred_at(pool: &Pool<Postgres>, id: i64) {
        sqlx::query("UPDATE events.outbox SET occurred_at = 'infinity' WHERE id = $1")
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
    }

    async fn set_payload(pool: &Pool<Postgres>, id: i64, payload: &str) {
        sqlx::query("UPDATE events.outbox SET payload = $2::jsonb WHERE id = $1")
            .bind(id)
            .bind(payload)
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_future_migration(pool: &Pool<Postgres>) {
        sqlx::query(
            "INSERT INTO events.outbox_migrations (version, description) VALUES (99, 'future')",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn create_accounts(pool: &Pool<Postgres>) {
        sqlx::query("CREATE TABLE accounts (id UUID PRIMARY KEY, balance BIGINT NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_account<'c, R: Send>(
        tx: &mut OutboxTx<'c, Postgres, R>,
        id: Uuid,
        balance: i64,
    ) {
        sqlx::query("INSERT INTO accounts VALUES ($1, $2)")
            .bind(id)
            .bind(balance)
            .execute(&mut **tx)
            .await
            .unwrap();
    }

    const CAN_KILL_CONNECTIONS: bool = true;

    async fn kill_own_connection(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
            .execute(conn)
            .await
            .map(|_| ())
    }

    async fn make_effects_unique(pool: &Pool<Postgres>) {
        sqlx::query("CREATE UNIQUE INDEX effects_once ON effects (event_id)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn expire_claims(pool: &Pool<Postgres>) {
        sqlx::query("UPDATE events.outbox_claims SET until = now() - interval '1 hour'")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn create_effects(pool: &Pool<Postgres>) {
        sqlx::query(
            "CREATE TABLE effects (n BIGSERIAL PRIMARY KEY, event_id BIGINT NOT NULL, relay TEXT NOT NULL)",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn insert_effect(
        conn: &mut sqlx::PgConnection,
        event_id: i64,
        relay: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO effects (event_id, relay) VALUES ($1, $2)")
            .bind(event_id)
            .bind(relay)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn effects(pool: &Pool<Postgres>) -> Vec<(i64, String)> {
        sqlx::query_as("SELECT event_id, relay FROM effects ORDER BY n")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    async fn account_count(pool: &Pool<Postgres>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM accounts")
            .fetch_one(pool)
            .await
            .unwrap()
    }
}

/// A SQLite database file in a directory of its own, removed when dropped.
pub struct SqliteFile {
    dir: tempfile::TempDir,
}

impl SqliteFile {
    fn url(&self) -> String {
        format!("sqlite://{}", self.dir.path().join("outbox.db").display())
    }

    async fn pool(url: &str) -> Pool<Sqlite> {
        let options = SqliteConnectOptions::from_str(url)
            .expect("a SQLite URL")
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .expect("open the SQLite file")
    }
}

impl TestBackend for Sqlite {
    type Guard = SqliteFile;
    const NAME: &'static str = "sqlite";
    const LATEST_MIGRATION: i32 = 9;

    async fn fresh() -> (SqliteFile, Pool<Sqlite>) {
        let file = SqliteFile {
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        let pool = SqliteFile::pool(&file.url()).await;
        (file, pool)
    }

    fn url(guard: &SqliteFile) -> String {
        guard.url()
    }

    async fn connect(url: String) -> Pool<Sqlite> {
        SqliteFile::pool(&url).await
    }

    async fn events(pool: &Pool<Sqlite>) -> Vec<EventRow> {
        let now = OffsetDateTime::now_utc().unix_timestamp_nanos() / 1000;
        sqlx::query(
            "SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at,
                    published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead,
                    retry_count AS parked, last_error,
                    coalesce(next_retry_at > $1, 0) AS waiting
             FROM outbox ORDER BY id",
        )
        .bind(i64::try_from(now).unwrap())
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| EventRow {
            id: r.get("id"),
            aggregate_type: r.get("aggregate_type"),
            aggregate_id: r.get("aggregate_id"),
            event_type: r.get("event_type"),
            payload: r.get("payload"),
            occurred_at: OffsetDateTime::from_unix_timestamp_nanos(
                i128::from(r.get::<i64, _>("occurred_at")) * 1000,
            )
            .unwrap(),
            published: r.get("published"),
            dead: r.get("dead"),
            parked: r.get("parked"),
            last_error: r.get("last_error"),
            waiting: r.get("waiting"),
        })
        .collect()
    }

    async fn delivery(pool: &Pool<Sqlite>, subscriber: &str, event_id: i64) -> Option<DeliveryRow> {
        let now = i64::try_from(OffsetDateTime::now_utc().unix_timestamp_nanos() / 1000).unwrap();
        sqlx::query(
            "SELECT attempts, last_error, dead_at IS NOT NULL AS dead,
                    (next_retry_at - $3) / 1000000.0 AS due_in
             FROM outbox_deliveries WHERE subscriber = $1 AND event_id = $2",
        )
        .bind(subscriber)
        .bind(event_id)
        .bind(now)
        .fetch_optional(pool)
        .await
        .unwrap()
        .map(|r| DeliveryRow {
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            dead: r.get("dead"),
            due_in: r.get("due_in"),
        })
    }

    async fn delivery_count(pool: &Pool<Sqlite>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn insert_raw(
        pool: &Pool<Sqlite>,
        event_type: &str,
        aggregate: Uuid,
        payload: &str,
    ) -> i64 {
        sqlx::query_scalar(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)
             VALUES ('probe', $1, $2, $3, 0) RETURNING id",
        )
        .bind(aggregate)
        .bind(event_type)
        .bind(payload)
        .fetch_one(pool)
        .await
        .unwrap()
    }

    async fn backdate_inbox(pool: &Pool<Sqlite>, message_id: &str, by: Duration) {
        let changed = sqlx::query(
            "UPDATE outbox_inbox SET handled_at = handled_at - $2 WHERE message_id = $1",
        )
        .bind(message_id)
        .bind(i64::try_from(by.as_micros()).unwrap())
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        assert!(changed > 0, "message {message_id} is in the inbox");
    }

    async fn make_deliveries_due(pool: &Pool<Sqlite>) {
        sqlx::query("UPDATE outbox_deliveries SET next_retry_at = $1 WHERE next_retry_at > $1")
            .bind(i64::try_from(OffsetDateTime::now_utc().unix_timestamp_nanos() / 1000).unwrap())
            .execute(pool)
            .await
            .unwrap();
    }

    async fn requeue_records(pool: &Pool<Sqlite>) -> Vec<RequeueRecord> {
        sqlx::query_as(
            "SELECT coalesce(replace(replace(event_ids, '[', ''), ']', ''), ''), subscriber,
                    first_line, requeued, reason
             FROM outbox_requeues ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    }

    async fn inbox_count(pool: &Pool<Sqlite>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_inbox")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn backdate_published(pool: &Pool<Sqlite>, id: i64, by: Duration) {
        let changed = sqlx::query(
            "UPDATE outbox SET published_at = published_at - $2
             WHERE id = $1 AND published_at IS NOT NULL",
        )
        .bind(id)
        .bind(i64::try_from(by.as_micros()).unwrap())
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(changed, 1, "event {id} is published");
    }

    async fn break_occurred_at(pool: &Pool<Sqlite>, id: i64) {
        sqlx::query("UPDATE outbox SET occurred_at = 'not a time' WHERE id = $1")
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
    }

    async fn set_payload(pool: &Pool<Sqlite>, id: i64, payload: &str) {
        sqlx::query("UPDATE outbox SET payload = $2 WHERE id = $1")
            .bind(id)
            .bind(payload)
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_future_migration(pool: &Pool<Sqlite>) {
        sqlx::query(
            "INSERT INTO outbox_migrations (version, description, applied_at)
             VALUES (99, 'future', 0)",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn create_accounts(pool: &Pool<Sqlite>) {
        sqlx::query("CREATE TABLE accounts (id BLOB PRIMARY KEY, balance INTEGER NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_account<'c, R: Send>(tx: &mut OutboxTx<'c, Sqlite, R>, id: Uuid, balance: i64) {
        sqlx::query("INSERT INTO accounts VALUES ($1, $2)")
            .bind(id)
            .bind(balance)
            .execute(&mut **tx)
            .await
            .unwrap();
    }

    const CAN_KILL_CONNECTIONS: bool = false;

    async fn kill_own_connection(_: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        unreachable!("an embedded SQLite connection has no server session to kill")
    }

    async fn make_effects_unique(pool: &Pool<Sqlite>) {
        sqlx::query("CREATE UNIQUE INDEX effects_once ON effects (event_id)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn expire_claims(pool: &Pool<Sqlite>) {
        sqlx::query("UPDATE outbox_claims SET until = 0")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn create_effects(pool: &Pool<Sqlite>) {
        sqlx::query(
            "CREATE TABLE effects (n INTEGER PRIMARY KEY AUTOINCREMENT, event_id INTEGER NOT NULL, relay TEXT NOT NULL)",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn insert_effect(
        conn: &mut sqlx::SqliteConnection,
        event_id: i64,
        relay: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO effects (event_id, relay) VALUES ($1, $2)")
            .bind(event_id)
            .bind(relay)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn effects(pool: &Pool<Sqlite>) -> Vec<(i64, String)> {
        sqlx::query_as("SELECT event_id, relay FROM effects ORDER BY n")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    async fn account_count(pool: &Pool<Sqlite>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM accounts")
            .fetch_one(pool)
            .await
            .unwrap()
    }
}

impl TestBackend for MySql {
    type Guard = TestMyDb;
    const NAME: &'static str = "mysql";
    const LATEST_MIGRATION: i32 = 1;

    async fn fresh() -> (TestMyDb, Pool<MySql>) {
        let db = TestMyDb::new().await;
        let pool = db.pool.clone();
        (db, pool)
    }

    fn url(guard: &TestMyDb) -> String {
        guard.url()
    }

    async fn connect(url: String) -> Pool<MySql> {
        TestMyDb::connect(&url, 5).await
    }

    async fn events(pool: &Pool<MySql>) -> Vec<EventRow> {
        sqlx::query(
            "SELECT id, aggregate_type, aggregate_id, event_type, payload, occurred_at,
                    published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead,
                    CAST(retry_count AS SIGNED) AS parked, last_error,
                    coalesce(next_retry_at > UTC_TIMESTAMP(6), 0) AS waiting
             FROM outbox ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| EventRow {
            id: r.get("id"),
            aggregate_type: r.get("aggregate_type"),
            aggregate_id: r.get("aggregate_id"),
            event_type: r.get("event_type"),
            payload: r.get("payload"),
            occurred_at: r.get("occurred_at"),
            published: r.get::<i64, _>("published") == 1,
            dead: r.get::<i64, _>("dead") == 1,
            parked: r.get("parked"),
            last_error: r.get("last_error"),
            waiting: r.get::<i64, _>("waiting") == 1,
        })
        .collect()
    }

    async fn delivery(pool: &Pool<MySql>, subscriber: &str, event_id: i64) -> Option<DeliveryRow> {
        sqlx::query(
            "SELECT CAST(attempts AS SIGNED) AS attempts, last_error,
                    dead_at IS NOT NULL AS dead,
                    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_retry_at) AS DOUBLE)
                        / 1000000 AS due_in
             FROM outbox_deliveries WHERE subscriber = ? AND event_id = ?",
        )
        .bind(subscriber)
        .bind(event_id)
        .fetch_optional(pool)
        .await
        .unwrap()
        .map(|r| DeliveryRow {
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            dead: r.get::<i64, _>("dead") == 1,
            due_in: r.get::<Option<f64>, _>("due_in").unwrap_or(0.0),
        })
    }

    async fn delivery_count(pool: &Pool<MySql>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_deliveries")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn insert_raw(
        pool: &Pool<MySql>,
        event_type: &str,
        aggregate: Uuid,
        payload: &str,
    ) -> i64 {
        let id = sqlx::query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)
             VALUES ('probe', ?, ?, ?, UTC_TIMESTAMP(6))",
        )
        .bind(aggregate)
        .bind(event_type)
        .bind(payload)
        .execute(pool)
        .await
        .unwrap()
        .last_insert_id();
        i64::try_from(id).unwrap()
    }

    async fn backdate_inbox(pool: &Pool<MySql>, message_id: &str, by: Duration) {
        let changed = sqlx::query(
            "UPDATE outbox_inbox SET handled_at = handled_at - INTERVAL ? MICROSECOND
             WHERE message_id = ?",
        )
        .bind(i64::try_from(by.as_micros()).unwrap())
        .bind(message_id)
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        assert!(changed > 0, "message {message_id} is in the inbox");
    }

    async fn make_deliveries_due(pool: &Pool<MySql>) {
        sqlx::query(
            "UPDATE outbox_deliveries SET next_retry_at = UTC_TIMESTAMP(6)
             WHERE next_retry_at > UTC_TIMESTAMP(6)",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn requeue_records(pool: &Pool<MySql>) -> Vec<RequeueRecord> {
        sqlx::query_as(
            "SELECT coalesce(replace(replace(event_ids, '[', ''), ']', ''), ''), subscriber,
                    first_line, requeued, reason
             FROM outbox_requeues ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    }

    async fn inbox_count(pool: &Pool<MySql>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_inbox")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn backdate_published(pool: &Pool<MySql>, id: i64, by: Duration) {
        let changed = sqlx::query(
            "UPDATE outbox SET published_at = published_at - INTERVAL ? MICROSECOND
             WHERE id = ? AND published_at IS NOT NULL",
        )
        .bind(i64::try_from(by.as_micros()).unwrap())
        .bind(id)
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(changed, 1, "event {id} is published");
    }

    async fn break_occurred_at(pool: &Pool<MySql>, id: i64) {
        // A zero date, as a server without strict mode keeps it: no time this build can read.
        let mut conn = pool.acquire().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET SESSION sql_mode = '';
             UPDATE outbox SET occurred_at = '0000-00-00 00:00:00' WHERE id = {id};
             SET SESSION sql_mode = DEFAULT"
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
    }

    async fn set_payload(pool: &Pool<MySql>, id: i64, payload: &str) {
        sqlx::query("UPDATE outbox SET payload = ? WHERE id = ?")
            .bind(payload)
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_future_migration(pool: &Pool<MySql>) {
        sqlx::query(
            "INSERT INTO outbox_migrations (version, description, applied_at)
             VALUES (99, 'future', UTC_TIMESTAMP(6))",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn create_accounts(pool: &Pool<MySql>) {
        sqlx::query("CREATE TABLE accounts (id BINARY(16) PRIMARY KEY, balance BIGINT NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_account<'c, R: Send>(tx: &mut OutboxTx<'c, MySql, R>, id: Uuid, balance: i64) {
        sqlx::query("INSERT INTO accounts VALUES (?, ?)")
            .bind(id)
            .bind(balance)
            .execute(&mut **tx)
            .await
            .unwrap();
    }

    const CAN_KILL_CONNECTIONS: bool = true;

    async fn kill_own_connection(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::query("KILL CONNECTION_ID()")
            .execute(conn)
            .await
            .map(|_| ())
    }

    async fn make_effects_unique(pool: &Pool<MySql>) {
        sqlx::query("CREATE UNIQUE INDEX effects_once ON effects (event_id)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn expire_claims(pool: &Pool<MySql>) {
        sqlx::query("UPDATE outbox_claims SET until = UTC_TIMESTAMP(6) - INTERVAL 1 HOUR")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn create_effects(pool: &Pool<MySql>) {
        sqlx::query(
            "CREATE TABLE effects (n BIGINT AUTO_INCREMENT PRIMARY KEY, event_id BIGINT NOT NULL,
                                   relay VARCHAR(255) NOT NULL)",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn insert_effect(
        conn: &mut sqlx::MySqlConnection,
        event_id: i64,
        relay: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO effects (event_id, relay) VALUES (?, ?)")
            .bind(event_id)
            .bind(relay)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn effects(pool: &Pool<MySql>) -> Vec<(i64, String)> {
        sqlx::query_as("SELECT event_id, relay FROM effects ORDER BY n")
            .fetch_all(pool)
            .await
            .unwrap()
    }

    async fn account_count(pool: &Pool<MySql>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM accounts")
            .fetch_one(pool)
            .await
            .unwrap()
    }
}

/// Runs each listed generic test body on PostgreSQL, on SQLite and on MySQL:
/// `on_every_backend!(name_one, name_two)` defines `postgres::name_one`, `sqlite::name_one`,
/// `mysql::name_one`, ...
#[macro_export]
macro_rules! on_every_backend {
    ($($test:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::Postgres>().await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::Sqlite>().await;
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<sqlx::MySql>().await;
                }
            )*
        }
    };
}
