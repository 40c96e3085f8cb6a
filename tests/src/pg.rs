//! A fresh PostgreSQL database per test, dropped when the test ends (also when it panics).

use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// Where the tests find PostgreSQL: `DATABASE_URL`, or the local server with trust auth.
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// Databases this harness creates are named `outbox_test_<unix seconds>_<random>`.
const PREFIX: &str = "outbox_test_";
/// Databases of runs older than this are dropped by the next run (left by a killed test).
const STALE_AFTER_SECS: u64 = 2 * 3600;

/// A database created for one test.
pub struct TestDb {
    name: String,
    options: PgConnectOptions,
    /// A pool on the test database.
    pub pool: PgPool,
}

impl TestDb {
    /// Creates an empty database and a pool on it.
    pub async fn new() -> TestDb {
        let admin = PgConnectOptions::from_str(&admin_url()).expect("DATABASE_URL is a URL");
        let mut conn = admin
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {}: {e}", admin_url()));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        drop_stale(&mut conn, now).await;
        let name = format!("{PREFIX}{now}_{:016x}", fastrand::u64(..));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        conn.close().await.ok();
        let options = admin.database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(5)
            .connect_with(options.clone())
            .await
            .expect("connect to the test database");
        TestDb {
            name,
            options,
            pool,
        }
    }

    /// Another pool on the test database whose sessions carry `application_name`, so that a test
    /// can find (and kill) them.
    pub async fn pool_named(&self, application_name: &str, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(self.options.clone().application_name(application_name))
            .await
            .expect("connect to the test database")
    }

    /// A URL of the test database, for programs run by the test.
    pub fn url(&self) -> String {
        let admin = admin_url();
        let (base, query) = admin.split_once('?').unwrap_or((&admin, ""));
        let server = match base.split_once("://") {
            Some((scheme, rest)) => {
                format!(
                    "{scheme}://{}",
                    rest.split_once('/').map_or(rest, |(server, _)| server)
                )
            }
            None => base.to_owned(),
        };
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        format!("{server}/{}{query}", self.name)
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Terminates every session of the test database named `application_name`; returns how many.
    pub async fn kill_sessions(&self, application_name: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = $1 AND application_name = $2",
        )
        .bind(&self.name)
        .bind(application_name)
        .fetch_one(&self.pool)
        .await
        .expect("terminate sessions")
    }

    /// Waits until a session of the test database named `application_name` runs `LISTEN` (a
    /// relay waiting for work on a pool so named); panics after 20 seconds.
    pub async fn wait_until_listening(&self, application_name: &str) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let listening: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = $1 AND application_name = $2 AND query LIKE 'LISTEN%'",
            )
            .bind(&self.name)
            .bind(application_name)
            .fetch_one(&self.pool)
            .await
            .expect("read the sessions");
            if listening > 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no session named {application_name} listened"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

impl Drop for TestDb {
    #[allow(clippy::print_stderr)] // A leftover database is worth a line in the test log.
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside any async context we could await in; do it on a thread of its own.
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for cleanup")
                .block_on(async move {
                    let mut conn = PgConnection::connect(&admin_url()).await?;
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await?;
                    conn.close().await
                })
        })
        .join();
        if let Ok(Err(error)) = dropped {
            eprintln!("could not drop test database {}: {error}", self.name);
        }
    }
}

async fn drop_stale(conn: &mut PgConnection, now: u64) {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT datname FROM pg_database WHERE datname LIKE 'outbox\\_test\\_%'",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap_or_default();
    for name in names {
        let created = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        if created.is_some_and(|created| created + STALE_AFTER_SECS < now) {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
            )))
            .execute(&mut *conn)
            .await;
        }
    }
}

/// What the operator tools are tried on: publishes a `Ping` on a fresh aggregate, a `Ping` on
/// an aggregate whose delivery to `y` will fail permanently once (`probe` is told), and a `Pong`
/// (which `XAndY` does not route, so its relay parks it). Returns the doomed aggregate.
pub async fn publish_for_operators<B: outbox_sqlx::Backend>(
    outbox: &outbox_sqlx::Outbox<B, crate::kit::PingPong>,
    probe: &crate::kit::Probe,
) -> uuid::Uuid {
    use crate::kit::{Fail, Ping, Pong};
    let doomed = uuid::Uuid::new_v4();
    probe.fail("y", doomed, 1, [Fail::Permanent]);
    for aggregate in [uuid::Uuid::new_v4(), doomed] {
        let mut tx = outbox.begin().await.unwrap();
        tx.publish(&Ping { aggregate, seq: 1 }).await.unwrap();
        tx.commit().await.unwrap();
    }
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: uuid::Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    doomed
}

/// Waits until `query` (one boolean) answers true, at most `limit`; panics saying that `what`
/// did not happen.
pub async fn wait_until_true(
    pool: &PgPool,
    query: &'static str,
    limit: std::time::Duration,
    what: &str,
) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let done: bool = sqlx::query_scalar(query).fetch_one(pool).await.unwrap();
        if done {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}
