//! The example runs on SQLite (a temporary file, no server), on PostgreSQL or on MySQL /
//! MariaDB (`DATABASE_URL`). An application picks one database; this module is what lets one
//! example serve all three: the domain SQL is written once (`$N` parameters, `ON CONFLICT`, as
//! PostgreSQL and SQLite both take it), and the [`Db`] trait runs it; on MySQL it is rewritten
//! first ([`mysql_dialect`]).

use std::future::Future;
use std::pin::Pin;

use outbox_core::{Delivery, HandlerError};
use outbox_sqlx::{Backend, Outbox};
use sqlx::{MySql, Pool, Postgres, Row, Sqlite};

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

/// The domain tables, in SQL every database here accepts (keys are `VARCHAR`: MySQL indexes
/// no `TEXT`).
pub const SCHEMA: &str = "
CREATE TABLE subscriptions (
    id             VARCHAR(64) PRIMARY KEY,
    license_id     VARCHAR(64) NOT NULL,
    customer_email TEXT NOT NULL,
    period_end     BIGINT NOT NULL,
    cycle_count    BIGINT NOT NULL,
    status         TEXT NOT NULL
);
CREATE TABLE payment_attempts (
    id              VARCHAR(64) PRIMARY KEY,
    subscription_id TEXT NOT NULL,
    status          TEXT NOT NULL,
    payment_key     TEXT
);
CREATE TABLE licenses (
    id         VARCHAR(64) PRIMARY KEY,
    tier       TEXT NOT NULL,
    status     TEXT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE TABLE bots (
    id         VARCHAR(64) PRIMARY KEY,
    license_id TEXT NOT NULL,
    status     TEXT NOT NULL
);
CREATE TABLE license_bots (
    license_id VARCHAR(64) NOT NULL,
    bot_id     VARCHAR(64) NOT NULL,
    PRIMARY KEY (license_id, bot_id)
);
CREATE TABLE audit_log (
    id              VARCHAR(64) PRIMARY KEY,
    outbox_event_id BIGINT NOT NULL UNIQUE,
    aggregate_type  TEXT NOT NULL,
    aggregate_id    TEXT NOT NULL,
    event_type      TEXT NOT NULL,
    payload         TEXT NOT NULL
);
CREATE TABLE notifications (
    outbox_event_id BIGINT NOT NULL,
    recipient       VARCHAR(255) NOT NULL,
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
    /// For the story: "SQLite", "PostgreSQL" or "MySQL".
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

    /// The rows of `sql`, each column read as text (integers written out).
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
    ($db:ty, $name:literal, $extend:literal, $variant:ident, $dialect:expr) => {
        impl Db for $db {
            const LABEL: &'static str = $name;
            const EXTEND_LICENSE: &'static str = $extend;

            fn exec<'a>(
                conn: &'a mut Self::Connection,
                sql: &'static str,
                args: Vec<Arg>,
            ) -> BoxFuture<'a, sqlx::Result<u64>> {
                Box::pin(async move {
                    let (sql, args) = $dialect(sql, args);
                    // The example's own statements (see `Db`), not user input.
                    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
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
                    let (sql, _) = $dialect(sql, Vec::new());
                    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                        .fetch_all(pool)
                        .await?;
                    rows.iter()
                        .map(|row| {
                            (0..row.len())
                                .map(|i| {
                                    row.try_get::<Option<String>, _>(i).or_else(|_| {
                                        row.try_get::<Option<i64>, _>(i)
                                            .map(|n| n.map(|n| n.to_string()))
                                    })
                                })
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
    Postgres,
    as_written
);
impl_db!(
    Sqlite,
    "SQLite",
    "UPDATE licenses SET expires_at = max(expires_at, $2) WHERE id = $1",
    Sqlite,
    as_written
);
impl_db!(
    MySql,
    "MySQL",
    "UPDATE licenses SET expires_at = GREATEST(expires_at, $2) WHERE id = $1",
    MySql,
    mysql_dialect
);

fn as_written(sql: &'static str, args: Vec<Arg>) -> (String, Vec<Arg>) {
    (sql.to_owned(), args)
}

/// The example's statements as MySQL takes them: its placeholders are `?`, bound in the order
/// they appear (`$2 ... $1` binds the second argument first); `INSERT ... ON CONFLICT (..) DO
/// NOTHING` is `INSERT IGNORE`; `ON CONFLICT (..) DO UPDATE SET c = excluded.c` is `ON DUPLICATE
/// KEY UPDATE c = VALUES(c)`. (Only what the example's own SQL uses; an application on MySQL
/// writes its SQL for MySQL.)
#[allow(clippy::needless_pass_by_value)] // The signature of `as_written`, which moves them.
pub fn mysql_dialect(sql: &'static str, args: Vec<Arg>) -> (String, Vec<Arg>) {
    let mut text = String::with_capacity(sql.len());
    let mut order = Vec::with_capacity(args.len());
    let mut chars = sql.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        let mut digits = String::new();
        while c == '$' && chars.peek().is_some_and(|(_, d)| d.is_ascii_digit()) {
            digits.extend(chars.next().map(|(_, d)| d));
        }
        match digits.parse::<usize>() {
            Ok(n) => {
                text.push('?');
                order.push(n - 1);
            }
            Err(_) => text.push(c),
        }
    }
    if let Some(at) = text.find("ON CONFLICT") {
        let clause = text[at..].to_owned();
        text.truncate(at);
        if clause.contains("DO NOTHING") {
            text = text.replacen("INSERT INTO", "INSERT IGNORE INTO", 1);
        } else if let Some((_, set)) = clause.split_once("DO UPDATE SET") {
            let mut set = set.to_owned();
            while let Some(start) = set.find("excluded.") {
                let end = set[start + 9..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(set.len(), |e| start + 9 + e);
                let column = set[start + 9..end].to_owned();
                set.replace_range(start..end, &format!("VALUES({column})"));
            }
            text.push_str("ON DUPLICATE KEY UPDATE");
            text.push_str(&set);
        }
    }
    let args: Vec<Arg> = args.into_iter().collect();
    (
        text,
        order
            .into_iter()
            .filter_map(|n| args.get(n).cloned())
            .collect(),
    )
}

/// A pool of either database, for the subscribers: they are fields of one router type, so they
/// cannot be generic over the database the way the services are.
#[derive(Clone, Debug)]
pub enum DbPool {
    /// PostgreSQL.
    Postgres(Pool<Postgres>),
    /// SQLite.
    Sqlite(Pool<Sqlite>),
    /// MySQL / MariaDB.
    MySql(Pool<MySql>),
}

impl DbPool {
    /// Runs `sql` with `args`; returns the rows it changed.
    pub async fn exec(&self, sql: &'static str, args: Vec<Arg>) -> sqlx::Result<u64> {
        match self {
            DbPool::Postgres(pool) => Postgres::exec_pool(pool, sql, args).await,
            DbPool::Sqlite(pool) => Sqlite::exec_pool(pool, sql, args).await,
            DbPool::MySql(pool) => MySql::exec_pool(pool, sql, args).await,
        }
    }

    /// The database's `EXTEND_LICENSE` statement.
    pub fn extend_license_sql(&self) -> &'static str {
        match self {
            DbPool::Postgres(_) => Postgres::EXTEND_LICENSE,
            DbPool::Sqlite(_) => Sqlite::EXTEND_LICENSE,
            DbPool::MySql(_) => MySql::EXTEND_LICENSE,
        }
    }

    /// The rows of `sql`, each column as text.
    pub async fn rows(&self, sql: &'static str) -> sqlx::Result<Vec<Vec<Option<String>>>> {
        match self {
            DbPool::Postgres(pool) => Postgres::rows(pool, sql).await,
            DbPool::Sqlite(pool) => Sqlite::rows(pool, sql).await,
            DbPool::MySql(pool) => MySql::rows(pool, sql).await,
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
    /// MySQL / MariaDB.
    MySql(Outbox<MySql, App>),
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
            DbOutbox::MySql(outbox) => once(outbox, d, sql, args, follow_up).await,
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
