//! (k) SQLite, the embedded backend the README's first command runs on: the producer and the
//! drain, each against raw sqlx on the same file, in the same way as (a) and (b) on PostgreSQL
//! and (j) on MySQL: ours and raw alternate in half-second slices on one database. The file is
//! opened as the examples open it (WAL, a busy timeout, a pool of 4).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::RelayConfig;
use outbox_sqlx::Outbox;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool};
use uuid::Uuid;

use super::{
    Bench, Deposited, Meter, alternate_commits, alternate_drain, bench_relay, producer_and_drain,
};

async fn setup(accounts: usize) -> (tempfile::TempDir, Outbox<Sqlite, Bench>, Vec<Uuid>) {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::from_str(&format!(
        "sqlite://{}",
        dir.path().join("bench.db").display()
    ))
    .unwrap()
    .create_if_missing(true)
    .journal_mode(SqliteJournalMode::Wal)
    .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let outbox: Outbox<Sqlite, Bench> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE accounts (id BLOB PRIMARY KEY, balance INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let ids: Vec<Uuid> = (0..accounts).map(|_| Uuid::new_v4()).collect();
    for chunk in ids.chunks(500) {
        let mut insert = sqlx::QueryBuilder::new("INSERT INTO accounts (id, balance) ");
        insert.push_values(chunk, |mut row, id| {
            row.push_bind(*id).push_bind(0_i64);
        });
        insert.build().execute(&pool).await.unwrap();
    }
    (dir, outbox, ids)
}

/// Microseconds since the epoch, as the SQLite backend stores times.
fn now_micros() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros(),
    )
    .unwrap()
}

/// Commits per second of 16 tasks each running domain update + event + commit, ours and raw
/// alternating every [`SLICE`](super::SLICE): (ours, raw).
async fn producer(seconds: u64) -> (f64, f64) {
    let (_dir, outbox, ids) = setup(1000).await;
    let pool = outbox.pool().clone();
    alternate_commits(seconds, move |raw, seq| {
        let (outbox, pool) = (outbox.clone(), pool.clone());
        let account = ids[fastrand::usize(..ids.len())];
        async move {
            let event = Deposited {
                account,
                seq,
                amount: 1,
            };
            let update = "UPDATE accounts SET balance = balance + 1 WHERE id = ?";
            if raw {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(update)
                    .bind(account)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                let payload = outbox_core::encode(&event, &outbox_core::Metadata::new()).unwrap();
                sqlx::query(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload,
                                         occurred_at)
                     VALUES (?, ?, ?, ?, ?)",
                )
                .bind("account")
                .bind(account)
                .bind("Deposited")
                .bind(payload)
                .bind(now_micros())
                .execute(&mut *tx)
                .await
                .unwrap();
                tx.commit().await.unwrap();
            } else {
                let mut tx = outbox.begin().await.unwrap();
                sqlx::query(update)
                    .bind(account)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.publish(&event).await.unwrap();
                tx.commit().await.unwrap();
            }
        }
    })
    .await
}

/// A backlog of `events` over the accounts, in turn, with the payloads `publish` writes.
async fn prefill(pool: &SqlitePool, events: u64) {
    let now = now_micros();
    sqlx::query(
        "WITH RECURSIVE g (n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?),
         a AS (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM accounts),
         c AS (SELECT count(*) AS n FROM accounts)
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)
         SELECT 'account', a.id, 'Deposited',
                json_object('version', 1,
                    'data', json_object('account', lower(
                        substr(hex(a.id), 1, 8) || '-' || substr(hex(a.id), 9, 4) || '-' ||
                        substr(hex(a.id), 13, 4) || '-' || substr(hex(a.id), 17, 4) || '-' ||
                        substr(hex(a.id), 21, 12)),
                        'seq', g.n, 'amount', 1),
                    'metadata', json_object('causation_id', NULL, 'correlation_id', NULL)),
                ?
         FROM g JOIN a ON a.n = g.n % (SELECT n FROM c)
         ORDER BY g.n",
    )
    .bind(i64::try_from(events).unwrap())
    .bind(now)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE").execute(pool).await.unwrap();
}

/// One cycle of the raw drain: in a write transaction, read the next 500 unpublished events,
/// mark them published, commit; returns how many it took.
async fn raw_batch(pool: &SqlitePool) -> u64 {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, payload FROM outbox WHERE published_at IS NULL ORDER BY id LIMIT 500",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    if !rows.is_empty() {
        let mut update = sqlx::QueryBuilder::new("UPDATE outbox SET published_at = ");
        update.push_bind(now_micros()).push(" WHERE id IN (");
        let mut ids = update.separated(", ");
        for (id, _) in &rows {
            ids.push_bind(*id);
        }
        update.push(")");
        update.build().execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    rows.len() as u64
}

/// Drains a backlog of `events`, ours (`Relay::run`) and the raw loop alternating every
/// [`SLICE`](super::SLICE) on the same table: events per second of each.
async fn drain(events: u64, config: RelayConfig) -> (f64, f64) {
    let (_dir, outbox, _) = setup(10_000).await;
    let pool = outbox.pool().clone();
    prefill(&pool, events).await;
    let meter = Meter::default();
    let relay = Arc::new(bench_relay(outbox.store(), &meter, config));
    let raw = {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move { raw_batch(&pool).await }
        }
    };
    let (rates, _) = alternate_drain(&relay, &meter, events, &[raw]).await;
    let unpublished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(unpublished, 0, "every event recorded as published");
    (rates[0], rates[1])
}

/// (k): the producer, then the drain at the defaults and, when `tuned` is given, at those
/// settings too.
pub(crate) async fn sqlite(runs: usize, seconds: u64, events: u64, tuned: Option<RelayConfig>) {
    producer_and_drain(
        "(k) SQLite",
        runs,
        events,
        tuned,
        || producer(seconds),
        |config| drain(events, config),
    )
    .await;
}
