//! The example runs on SQLite (a temporary file, no server) or on PostgreSQL (`DATABASE_URL`).
//! An application picks one database; this module is what lets one example serve both: the
//! domain SQL is written once (portable, `$N` parameters), and the [`Db`] trait runs it.

use std::future::Future;
use std::pin::Pin;

use outbox_core::{Delivery, HandlerError};
use outbox_sqlx::{Backend, Outbox};
use sqlx::{Pool, Postgres, Row, Sqlite};

use super::app::App;
use super::events::WinBackOffered;

/// A value bound to a `$N` parameter.
#[derive(Debug, Clone)]
pub enum Arg {
    /// Text (ids are stored as text, so that one schema fits both databases).
    Text(String),
    /// An integer (timestamps are Unix seconds).
    Int(i64),
}

impl From<&str> for Arg {
    fn from(value: &str) -> Self {
        Arg::Text(value.to_owned())
    }
}

impl From<String> for Arg {
    fn from(value: String) -> Self {
        Arg::Text(value)
    }
}

impl From<uuid::Uuid> for Arg {
    fn from(value: uuid::Uuid) -> Self {
        Arg::Text(value.to_string())
    }
}

impl From<i64> for Arg {
    fn from(value: i64) -> Self {
        Arg::Int(value)
    }
}

/// `args![a, b]`: parameters `$1`, `$2`.
#[macro_export]
macro_rules! args {
    ($($arg:expr),* $(,)?) => { vec![$($crate::billing::db::Arg::from($arg)),*] };
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The domain tables, in SQL both databases accept.
pub const SCHEMA: &str = "
CREATE TABLE subscriptions (
    id             TEXT PRIMARY KEY,
    license_id     TEXT NOT NULL,
    customer_email TEXT NOT NULL,
    period_end     BIGINT NOT NULL,
    cycle_count    BIGINT NOT NULL,
    status         TEXT NOT NULL
);
CREATE TABLE payment_attempts (
    id              TEXT PRIMARY KEY,
    subscription_id TEXT NOT NULL,
    status          TEXT NOT NULL,
    payment_key     TEXT
);
CREATE TABLE licenses (
    id         TEXT PRIMARY KEY,
    tier       TEXT NOT NULL,
    status     TEXT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE TABLE bots (
    id         TEXT PRIMARY KEY,
    license_id TEXT NOT NULL,
    status     TEXT NOT NULL
);
CREATE TABLE license_bots (
    license_id TEXT NOT NULL,
    bot_id     TEXT NOT NULL,
    PRIMARY KEY (license_id, bot_id)
);
CREATE TABLE audit_log (
    id              TEXT PRIMARY KEY,
    outbox_event_id BIGINT NOT NULL UNIQUE,
    aggregate_type  TEXT NOT NULL,
    aggregate_id    TEXT NOT NULL,
    event_type      TEXT NOT NULL,
    payload         TEXT NOT NULL
);
CREATE TABLE notifications (
    outbox_event_id BIGINT NOT NULL,
    recipient       TEXT NOT NULL,
    message         TEXT NOT NULL,
    PRIMARY KEY (outbox_event_id, recipient)
);
CREATE TABLE recovery_cases (
    outbox_event_id BIGINT PRIMARY KEY,
    subject         TEXT NOT NULL,
    action          TEXT NOT NULL
);
";

/// A database the example runs on.
pub trait Db: Backend {
    /// For the story: "SQLite" or "PostgreSQL".
    const LABEL: &'static str;
    /// Extends a license to `$2` unless it already runs longer: the seed's
    /// `GREATEST(expires_at, $1)`, idempotent under redelivery. (SQLite spells it `max`.)
    const EXTEND_LICENSE: &'static str;

    /// Runs `sql` on a connection (inside a transaction, say); returns the rows it changed.
    fn exec<'a>(
        conn: &'a mut Self::Connection,
        sql: &'static str,
        args: Vec<Arg>,
    ) -> BoxFuture<'a, sqlx::Result<u64>>;

    /// Runs `sql` on the pool.
    fn exec_pool<'a>(
        pool: &'a Pool<Self>,
        sql: &'static str,
        args: Vec<Arg>,
    ) -> BoxFuture<'a, sqlx::Result<u64>>;

    /// The rows of `sql`, each column read as text (cast it in the query).
    fn rows<'a>(
        pool: &'a Pool<Self>,
        sql: &'static str,
    ) -> BoxFuture<'a, sqlx::Result<Vec<Vec<Option<String>>>>>;

    /// Runs several statements, such as [`SCHEMA`].
    fn execute_script<'a>(pool: &'a Pool<Self>, sql: &'a str) -> BoxFuture<'a, sqlx::Result<()>>;

    /// The pool, for the subscribers.
    fn into_handle(pool: Pool<Self>) -> DbPool;

    /// The outbox, for the subscribers whose effects it makes exactly once.
    fn into_outbox(outbox: Outbox<Self, App>) -> DbOutbox;
}

macro_rules! impl_db {
    ($db:ty, $name:literal, $extend:literal, $variant:ident) => {
        impl Db for $db {
            const LABEL: &'static str = $name;
            const EXTEND_LICENSE: &'static str = $extend;

            fn exec<'a>(
                conn: &'a mut Self::Connection,
                sql: &'static str,
                args: Vec<Arg>,
            ) -> BoxFuture<'a, sqlx::Result<u64>> {
                Box::pin(async move {
                    let mut query = sqlx::query(sql);
                    for arg in args {
                        query = match arg {
                            Arg::Text(text) => query.bind(text),
                            Arg::Int(int) => query.bind(int),
                        };
                    }
                    Ok(query.execute(conn).await?.rows_affected())
                })
            }

            fn exec_pool<'a>(
                pool: &'a Pool<Self>,
                sql: &'static str,
                args: Vec<Arg>,
            ) -> BoxFuture<'a, sqlx::Result<u64>> {
                Box::pin(async move {
                    let mut conn = pool.acquire().await?;
                    Self::exec(&mut conn, sql, args).await
                })
            }

            fn rows<'a>(
                pool: &'a Pool<Self>,
                sql: &'static str,
            ) -> BoxFuture<'a, sqlx::Result<Vec<Vec<Option<String>>>>> {
                Box::pin(async move {
                    let rows = sqlx::query(sql).fetch_all(pool).await?;
                    rows.iter()
                        .map(|row| {
                            (0..row.len())
                                .map(|i| row.try_get::<Option<String>, _>(i))
                                .collect()
                        })
                        .collect()
                })
            }

            fn execute_script<'a>(
                pool: &'a Pool<Self>,
                sql: &'a str,
            ) -> BoxFuture<'a, sqlx::Result<()>> {
                Box::pin(async move {
                    // The example's own DDL and schema names, not user input.
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                        .execute(pool)
                        .await?;
                    Ok(())
                })
            }

            fn into_handle(pool: Pool<Self>) -> DbPool {
                DbPool::$variant(pool)
            }

            fn into_outbox(outbox: Outbox<Self, App>) -> DbOutbox {
                DbOutbox::$variant(outbox)
            }
        }
    };
}

impl_db!(
    Postgres,
    "PostgreSQL",
    "UPDATE licenses SET expires_at = GREATEST(expires_at, $2) WHERE id = $1",
    Postgres
);
impl_db!(
    Sqlite,
    "SQLite",
    "UPDATE licenses SET expires_at = max(expires_at, $2) WHERE id = $1",
    Sqlite
);

/// A pool of either database, for the subscribers: they are fields of one router type, so they
/// cannot be generic over the database the way the services are.
#[derive(Clone, Debug)]
pub enum DbPool {
    /// PostgreSQL.
    Postgres(Pool<Postgres>),
    /// SQLite.
    Sqlite(Pool<Sqlite>),
}

impl DbPool {
    /// Runs `sql` with `args`; returns the rows it changed.
    pub async fn exec(&self, sql: &'static str, args: Vec<Arg>) -> sqlx::Result<u64> {
        match self {
            DbPool::Postgres(pool) => Postgres::exec_pool(pool, sql, args).await,
            DbPool::Sqlite(pool) => Sqlite::exec_pool(pool, sql, args).await,
        }
    }

    /// The database's `EXTEND_LICENSE` statement.
    pub fn extend_license_sql(&self) -> &'static str {
        match self {
            DbPool::Postgres(_) => Postgres::EXTEND_LICENSE,
            DbPool::Sqlite(_) => Sqlite::EXTEND_LICENSE,
        }
    }

    /// The rows of `sql`, each column as text.
    pub async fn rows(&self, sql: &'static str) -> sqlx::Result<Vec<Vec<Option<String>>>> {
        match self {
            DbPool::Postgres(pool) => Postgres::rows(pool, sql).await,
            DbPool::Sqlite(pool) => Sqlite::rows(pool, sql).await,
        }
    }
}

/// The outbox of either database, for the subscribers whose effects happen exactly once.
#[derive(Clone, Debug)]
pub enum DbOutbox {
    /// PostgreSQL.
    Postgres(Outbox<Postgres, App>),
    /// SQLite.
    Sqlite(Outbox<Sqlite, App>),
}

impl DbOutbox {
    /// Runs `sql` for delivery `d` exactly once, with `Outbox::handle_once`: in one transaction
    /// with the inbox record of the delivery and the `follow_up` event, if any. A redelivery
    /// runs nothing.
    pub async fn exec_once(
        &self,
        d: &Delivery<'_>,
        sql: &'static str,
        args: Vec<Arg>,
        follow_up: Option<WinBackOffered>,
    ) -> Result<(), HandlerError> {
        match self {
            DbOutbox::Postgres(outbox) => once(outbox, d, sql, args, follow_up).await,
            DbOutbox::Sqlite(outbox) => once(outbox, d, sql, args, follow_up).await,
        }
    }
}

async fn once<B: Db>(
    outbox: &Outbox<B, App>,
    d: &Delivery<'_>,
    sql: &'static str,
    args: Vec<Arg>,
    follow_up: Option<WinBackOffered>,
) -> Result<(), HandlerError> {
    outbox
        .handle_once(d, |mut tx| async move {
            B::exec(&mut tx, sql, args).await?;
            if let Some(event) = &follow_up {
                tx.publish(event).await?;
            }
            Ok(tx)
        })
        .await
}
