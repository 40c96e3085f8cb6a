//! (j) MySQL / MariaDB: the producer and the drain, each against raw sqlx on the same server, in
//! the same way as (a) and (b) on PostgreSQL: ours and raw alternate in half-second slices on
//! one database.

use std::sync::Arc;

use outbox_core::RelayConfig;
use outbox_sqlx::Outbox;
use outbox_tests::my::TestMyDb;
use sqlx::{MySql, MySqlPool};
use uuid::Uuid;

use super::{
    Bench, Deposited, Meter, alternate_commits, alternate_drain, bench_relay, producer_and_drain,
};

async fn setup(accounts: usize) -> (TestMyDb, Outbox<MySql, Bench>, Vec<Uuid>) {
    let db = TestMyDb::new().await;
    let pool = TestMyDb::connect(&db.url(), 40).await;
    let outbox: Outbox<MySql, Bench> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE accounts (id BINARY(16) PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let ids: Vec<Uuid> = (0..accounts).map(|_| Uuid::new_v4()).collect();
    for chunk in ids.chunks(1000) {
        let mut insert = sqlx::QueryBuilder::new("INSERT INTO accounts (id, balance) ");
        insert.push_values(chunk, |mut row, id| {
            row.push_bind(*id).push_bind(0_i64);
        });
        insert.build().execute(&pool).await.unwrap();
    }
    (db, outbox, ids)
}

/// Commits per second of 16 tasks each running domain update + event + commit, ours and raw
/// alternating every [`SLICE`](super::SLICE): (ours, raw).
async fn producer(seconds: u64) -> (f64, f64) {
    let (_db, outbox, ids) = setup(1000).await;
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
                     VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6))",
                )
                .bind("account")
                .bind(account)
                .bind("Deposited")
                .bind(payload)
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
async fn prefill(pool: &MySqlPool, events: u64) {
    sqlx::query(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, occurred_at)
         WITH RECURSIVE d (n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM d WHERE n < 999),
         g (n) AS (SELECT a.n * 1000 + b.n + 1 FROM d AS a CROSS JOIN d AS b)
         SELECT 'account', a.id, 'Deposited',
                JSON_OBJECT('version', 1,
                    'data', JSON_OBJECT('account', LOWER(CONCAT_WS('-',
                        HEX(SUBSTR(a.id, 1, 4)), HEX(SUBSTR(a.id, 5, 2)), HEX(SUBSTR(a.id, 7, 2)),
                        HEX(SUBSTR(a.id, 9, 2)), HEX(SUBSTR(a.id, 11, 6)))),
                        'seq', g.n, 'amount', 1),
                    'metadata', JSON_OBJECT('causation_id', NULL, 'correlation_id', NULL)),
                UTC_TIMESTAMP(6)
         FROM g
         JOIN (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM accounts) AS a
           ON a.n = g.n % (SELECT count(*) FROM accounts)
         WHERE g.n <= ?
         ORDER BY g.n",
    )
    .bind(i64::try_from(events).unwrap())
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE TABLE outbox")
        .execute(pool)
        .await
        .unwrap();
}

/// One cycle of the raw drain: claim 500 with `SKIP LOCKED`, mark them published, commit;
/// returns how many it claimed.
async fn raw_batch(pool: &MySqlPool) -> u64 {
    let mut tx = pool.begin().await.unwrap();
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, payload FROM outbox
         WHERE published_at IS NULL ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    if !rows.is_empty() {
        let mut update = sqlx::QueryBuilder::new(
            "UPDATE outbox SET published_at = UTC_TIMESTAMP(6) WHERE id IN (",
        );
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
    let (_db, outbox, _) = setup(10_000).await;
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

/// (j): the producer, then the drain at the defaults and, when `tuned` is given, at those
/// settings too.
pub(crate) async fn mysql(runs: usize, seconds: u64, events: u64, tuned: Option<RelayConfig>) {
    producer_and_drain(
        "(j) MySQL",
        runs,
        events,
        tuned,
        || producer(seconds),
        |config| drain(events, config),
    )
    .await;
}
