//! A fresh MySQL / MariaDB database per test, dropped when the test ends (also when it panics).

use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Connection, MySqlConnection, MySqlPool};

/// Where the tests find MySQL: `MYSQL_URL`, or the local server (root, no password).
pub fn admin_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// Databases this harness creates are named `outbox_test_<unix seconds>_<random>`.
const PREFIX: &str = "outbox_test_";
/// Databases of runs older than this are dropped by the next run (left by a killed test).
const STALE_AFTER_SECS: u64 = 2 * 3600;

/// A database created for one test.
pub struct TestMyDb {
    name: String,
    /// A pool on the test database.
    pub pool: MySqlPool,
}

impl TestMyDb {
    /// Creates an empty database and a pool on it.
    pub async fn new() -> TestMyDb {
        let admin = MySqlConnectOptions::from_str(&admin_url()).expect("MYSQL_URL is a URL");
        let mut conn = admin
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot reach MySQL at {}: {e}", admin_url()));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        drop_stale(&mut conn, now).await;
        let name = format!("{PREFIX}{now}_{:016x}", fastrand::u64(..));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        conn.close().await.ok();
        let pool = Self::connect(&Self::url_of(&name), 5).await;
        TestMyDb { name, pool }
    }

    /// A pool of at most `max_connections` on the database at `url`.
    pub async fn connect(url: &str, max_connections: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max_connections)
            .connect(url)
            .await
            .expect("connect to the test database")
    }

    fn url_of(name: &str) -> String {
        let admin = admin_url();
        let (base, query) = admin.split_once('?').unwrap_or((&admin, ""));
        let server = match base.split_once("://") {
            Some((scheme, rest)) => format!(
                "{scheme}://{}",
                rest.split_once('/').map_or(rest, |(server, _)| server)
            ),
            None => base.to_owned(),
        };
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        format!("{server}/{name}{query}")
    }

    /// A URL of the test database, for programs run by the test.
    pub fn url(&self) -> String {
        Self::url_of(&self.name)
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Kills every session on the test database but the one of `conn` (a connection to it):
    /// as a database restart or a proxy would. Returns how many.
    pub async fn kill_sessions(&self, conn: &mut MySqlConnection) -> usize {
        let sessions: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM information_schema.processlist
             WHERE db = ? AND id <> CONNECTION_ID()",
        )
        .bind(&self.name)
        .fetch_all(&mut *conn)
        .await
        .expect("list the sessions");
        for id in &sessions {
            // (A session may end by itself meanwhile.)
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
                .execute(&mut *conn)
                .await;
        }
        sessions.len()
    }
}

impl Drop for TestMyDb {
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
                    let mut conn = MySqlConnection::connect(&admin_url()).await?;
                    drop_database(&mut conn, &name).await?;
                    conn.close().await
                })
        })
        .join();
        if let Ok(Err(error)) = dropped {
            eprintln!("could not drop test database {}: {error}", self.name);
        }
    }
}

async fn drop_stale(conn: &mut MySqlConnection, now: u64) {
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT schema_name FROM information_schema.schemata
         WHERE schema_name LIKE 'outbox\\_test\\_%'",
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
            let _ = drop_database(conn, &name).await;
        }
    }
}

/// Ends the sessions on database `name` (a session in a transaction would hold `DROP
/// DATABASE` back: a relay task of a test that failed, say), then drops it.
async fn drop_database(conn: &mut MySqlConnection, name: &str) -> sqlx::Result<()> {
    let sessions: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM information_schema.processlist WHERE db = ? AND id <> CONNECTION_ID()",
    )
    .bind(name)
    .fetch_all(&mut *conn)
    .await?;
    for id in sessions {
        // (A session may end by itself meanwhile.)
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(&mut *conn)
            .await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS `{name}`"
    )))
    .execute(&mut *conn)
    .await?;
    Ok(())
}
