//! A rolling deploy on PostgreSQL: relays of an old and a new build run at once, as separate
//! processes, while producers of both builds commit. The new build has one more event type, one
//! more subscriber, and one subscriber renamed. Every event must reach every subscriber its
//! newest route names, in order per (subscriber, aggregate), without a park delay, nothing lost.
//!
//! The relays are this test binary run again with `OUTBOX_ROLLING_DATABASE` and
//! `OUTBOX_ROLLING_BUILD` set: see `rolling_relay`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use outbox_tests::process::TestProcess;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres};
use uuid::Uuid;

/// The events of both builds (the handlers log the stored event, whatever its type).
trait Numbered: OutboxEvent {}

macro_rules! event {
    ($name:ident) => {
        #[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
        #[outbox(aggregate_type = "order")]
        struct $name {
            #[outbox(aggregate_id)]
            order: Uuid,
            seq: u32,
        }

        impl Numbered for $name {}
    };
}

event!(OrderPlaced);
event!(OrderPaid);
// Only in the new build.
event!(OrderShipped);

/// Writes each delivery to the `log` table: which build, under which name, which event.
async fn log(pool: &PgPool, build: &str, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO log (subscriber, build, event_id) VALUES ($1, $2, $3)")
        .bind(delivery.subscriber())
        .bind(build)
        .bind(delivery.event().id)
        .execute(pool)
        .await?;
    Ok(())
}

macro_rules! logging_subscriber {
    ($name:ident, $build:literal, $($attr:tt)*) => {
        #[subscriber($($attr)*)]
        struct $name(PgPool);

        impl<E: Numbered> Handle<E> for $name {
            async fn handle(&self, _: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
                log(&self.0, $build, delivery).await
            }
        }
    };
}

// The old build.
logging_subscriber!(
    Mailer,
    "a",
    events = [OrderPlaced, OrderPaid],
    name = "mailer"
);
logging_subscriber!(LedgerA, "a", events = [OrderPaid], name = "ledger");

#[router(events = [OrderPlaced, OrderPaid], database = sqlx::Postgres)]
struct OldShop {
    mailer: Mailer,
    ledger: LedgerA,
}

// The new build: `mailer` renamed `notifier`, and it takes the new event; `analytics` is new.
logging_subscriber!(
    Notifier,
    "b",
    events = [OrderPlaced, OrderPaid, OrderShipped],
    name = "notifier",
    formerly = ["mailer"]
);
logging_subscriber!(LedgerB, "b", events = [OrderPaid], name = "ledger");
logging_subscriber!(
    Analytics,
    "b",
    events = [OrderPlaced, OrderPaid, OrderShipped],
    name = "analytics"
);

#[router(events = [OrderPlaced, OrderPaid, OrderShipped], database = sqlx::Postgres)]
struct NewShop {
    notifier: Notifier,
    ledger: LedgerB,
    analytics: Analytics,
}

/// The defaults (a park would wait 5 minutes), polling often.
fn config() -> RelayConfig {
    RelayConfig::default().with_poll_interval(Duration::from_millis(50))
}

/// A relay of build `OUTBOX_ROLLING_BUILD` (`a` or `b`), when started by the test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a relay process of a_rolling_deploy_delivers_everything_promptly"]
async fn rolling_relay() {
    let (Ok(url), Ok(build)) = (
        std::env::var("OUTBOX_ROLLING_DATABASE"),
        std::env::var("OUTBOX_ROLLING_BUILD"),
    ) else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .connect(&url)
        .await
        .unwrap();
    if build == "a" {
        let outbox = Outbox::<Postgres, OldShop>::new(pool.clone());
        let shop = OldShop {
            mailer: Mailer(pool.clone()),
            ledger: LedgerA(pool.clone()),
        };
        outbox
            .relay(shop, config())
            .unwrap()
            .run(std::future::pending())
            .await;
    } else {
        let outbox = Outbox::<Postgres, NewShop>::new(pool.clone());
        let shop = NewShop {
            notifier: Notifier(pool.clone()),
            ledger: LedgerB(pool.clone()),
            analytics: Analytics(pool.clone()),
        };
        outbox
            .relay(shop, config())
            .unwrap()
            .run(std::future::pending())
            .await;
    }
}

/// The subscribers each event type's newest route names, `mailer` counted as `notifier`.
fn newest_route(event_type: &str) -> &'static [&'static str] {
    match event_type {
        "OrderPlaced" | "OrderShipped" => &["notifier", "analytics"],
        "OrderPaid" => &["notifier", "ledger", "analytics"],
        other => panic!("unexpected event type {other}"),
    }
}

fn logical(subscriber: &str) -> &str {
    if subscriber == "mailer" {
        "notifier"
    } else {
        subscriber
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_delivers_everything_promptly() {
    const ORDERS: usize = 20;
    const COMMITS_PER_BUILD: usize = 300;
    let db = TestDb::new().await;
    let old: Outbox<Postgres, OldShop> = Outbox::new(db.pool.clone());
    let new: Outbox<Postgres, NewShop> = Outbox::new(db.pool.clone());
    old.migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE log (n BIGSERIAL PRIMARY KEY, subscriber TEXT NOT NULL, build TEXT NOT NULL,
                           event_id BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let url = db.url();
    let _a = TestProcess::start(
        "rolling_relay",
        &[
            ("OUTBOX_ROLLING_DATABASE", &url),
            ("OUTBOX_ROLLING_BUILD", "a"),
        ],
    );
    let _b = TestProcess::start(
        "rolling_relay",
        &[
            ("OUTBOX_ROLLING_DATABASE", &url),
            ("OUTBOX_ROLLING_BUILD", "b"),
        ],
    );
    // Both builds are at work before the producers start.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while old.status().await.unwrap().live_relays < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relays did not register"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Each registered the relay protocol its build keeps to (a record of many keys on
    // PostgreSQL takes each key's lock while a relay registered without one is live).
    let without_protocol: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM events.outbox_relays WHERE NOT (routing::jsonb ? 'protocol')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(without_protocol, 0);

    // Producers of both builds commit at once, on the same orders.
    let orders: Vec<Uuid> = (0..ORDERS).map(|_| Uuid::new_v4()).collect();
    let produce_old = async {
        for n in 0..COMMITS_PER_BUILD {
            let order = orders[n % ORDERS];
            let seq = u32::try_from(n).unwrap();
            let mut tx = old.begin().await.unwrap();
            if n % 2 == 0 {
                tx.publish(&OrderPlaced { order, seq }).await.unwrap();
            } else {
                tx.publish(&OrderPaid { order, seq }).await.unwrap();
            }
            tx.commit().await.unwrap();
        }
    };
    let produce_new = async {
        for n in 0..COMMITS_PER_BUILD {
            let order = orders[(n * 7) % ORDERS];
            let seq = u32::try_from(n).unwrap();
            let mut tx = new.begin().await.unwrap();
            match n % 3 {
                0 => tx.publish(&OrderPlaced { order, seq }).await.unwrap(),
                1 => tx.publish(&OrderPaid { order, seq }).await.unwrap(),
                _ => tx.publish(&OrderShipped { order, seq }).await.unwrap(),
            }
            tx.commit().await.unwrap();
        }
    };
    tokio::join!(produce_old, produce_new);

    // Every (event, subscriber of its newest route) is delivered.
    let events: Vec<(i64, String, Uuid)> =
        sqlx::query_as("SELECT id, event_type, aggregate_id FROM events.outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(events.len(), 2 * COMMITS_PER_BUILD);
    let expected: BTreeSet<(i64, &str)> = events
        .iter()
        .flat_map(|(id, t, _)| newest_route(t).iter().map(move |s| (*id, *s)))
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let log = loop {
        let log: Vec<(i64, String, String, i64, f64)> = sqlx::query_as(
            "SELECT l.n, l.subscriber, l.build, l.event_id,
                    extract(epoch FROM l.at - o.occurred_at)::float8
             FROM log AS l JOIN events.outbox AS o ON o.id = l.event_id ORDER BY l.n",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let seen: BTreeSet<(i64, &str)> = log
            .iter()
            .map(|(_, s, _, id, _)| (*id, logical(s)))
            .collect();
        if expected.is_subset(&seen) {
            break log;
        }
        let missing: Vec<_> = expected.difference(&seen).take(10).collect();
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered within 60 s (first missing: {missing:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Nothing else was delivered, and nothing was parked or is left over.
    for (_, subscriber, _, id, _) in &log {
        assert!(
            expected.contains(&(*id, logical(subscriber))),
            "event {id} reached {subscriber}, which its route does not name"
        );
    }
    let parked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE retry_count > 0")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(parked, 0, "no event was parked");

    // In order per (subscriber, aggregate): the first deliveries follow the event ids.
    let aggregate_of: BTreeMap<i64, Uuid> = events.iter().map(|(id, _, a)| (*id, *a)).collect();
    let mut last: BTreeMap<(&str, Uuid), i64> = BTreeMap::new();
    let mut first_seen: BTreeSet<(i64, &str)> = BTreeSet::new();
    for (_, subscriber, _, id, _) in &log {
        let subscriber = logical(subscriber);
        if !first_seen.insert((*id, subscriber)) {
            continue;
        }
        let key = (subscriber, aggregate_of[id]);
        if let Some(previous) = last.insert(key, *id) {
            assert!(
                previous < *id,
                "{subscriber} got event {id} after {previous} of the same order"
            );
        }
    }

    // Promptly: no delivery waited anything like a park delay (5 minutes).
    let slowest = log.iter().map(|l| l.4).fold(0.0, f64::max);
    assert!(slowest < 10.0, "the slowest delivery took {slowest:.1} s");

    // Both builds did their share: the old one delivered to `mailer`, the new one to
    // `notifier` and `analytics`, and events of the new type went to the new build only.
    let by_build: BTreeSet<(&str, &str)> = log
        .iter()
        .map(|(_, s, b, _, _)| (b.as_str(), s.as_str()))
        .collect();
    assert!(by_build.contains(&("a", "mailer")), "{by_build:?}");
    assert!(by_build.contains(&("b", "notifier")), "{by_build:?}");
    assert!(by_build.contains(&("b", "analytics")), "{by_build:?}");
    let status = new.status().await.unwrap();
    assert!(status.is_settled(), "{status:?}");
    assert_eq!(status.unroutable_events + status.unroutable_deliveries, 0);
    println!(
        "rolling deploy: {} events, {} deliveries ({} by the old build), slowest {slowest:.2} s",
        events.len(),
        log.len(),
        log.iter().filter(|l| l.2 == "a").count()
    );
}
