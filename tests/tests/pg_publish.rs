//! Publishing on PostgreSQL: events are stored iff the transaction commits, in the transaction
//! that holds the domain change.

use outbox_core::{Metadata, OutboxEvent, TraceContext, decode};
use outbox_sqlx::prelude::*;
use outbox_sqlx::{Error, Outbox, TableNames};
use outbox_tests::kit::{Everything, Ping};
use outbox_tests::pg::TestDb;
use sqlx::{Acquire, Postgres, Row};
use uuid::Uuid;

type TestOutbox = Outbox<Postgres, Everything>;

async fn setup() -> (TestDb, TestOutbox) {
    let db = TestDb::new().await;
    let outbox = Outbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE accounts (id UUID PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    (db, outbox)
}

async fn count_events(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn committed_transaction_stores_domain_change_and_event_together() {
    let (db, outbox) = setup().await;
    let id = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    sqlx::query("INSERT INTO accounts VALUES ($1, 100)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    // Not visible outside the transaction before commit.
    assert_eq!(count_events(&db).await, 0);
    let committed = tx.commit().await.unwrap();
    assert_eq!(committed.published(), 1);

    let row = sqlx::query(
        "SELECT aggregate_type, aggregate_id, event_type, payload::text AS payload,
                published_at IS NULL AS pending
         FROM events.outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>("aggregate_type"), "probe");
    assert_eq!(row.get::<Uuid, _>("aggregate_id"), id);
    assert_eq!(row.get::<String, _>("event_type"), "Ping");
    assert!(row.get::<bool, _>("pending"));
    let stored = decode::<Ping>(row.get::<String, _>("payload")).unwrap();
    assert_eq!(
        stored.event,
        Ping {
            aggregate: id,
            seq: 1
        }
    );
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(balance, 100);
}

#[tokio::test]
async fn rolled_back_transaction_stores_neither() {
    let (db, outbox) = setup().await;
    let id = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    sqlx::query("INSERT INTO accounts VALUES ($1, 100)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    let rolled_back = tx.rollback().await.unwrap();
    assert_eq!(rolled_back.published(), 1);
    assert_eq!(count_events(&db).await, 0);
    let accounts: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(accounts, 0);
}

#[tokio::test]
async fn dropped_transaction_stores_neither() {
    let (db, outbox) = setup().await;
    let id = Uuid::new_v4();
    {
        let mut tx = outbox.begin().await.unwrap();
        sqlx::query("INSERT INTO accounts VALUES ($1, 100)")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.publish(&Ping {
            aggregate: id,
            seq: 1,
        })
        .await
        .unwrap();
    }
    // The rollback of a dropped transaction runs when its connection is next used; a fresh
    // query on the pool sees no trace of it either way.
    assert_eq!(count_events(&db).await, 0);
    let accounts: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(accounts, 0);
}

#[tokio::test]
async fn publish_all_inserts_in_order_in_one_statement() {
    let (db, outbox) = setup().await;
    let a = Uuid::new_v4();
    let b = Uuid::new_v4();
    let events: Vec<Ping> = (1..=5)
        .map(|seq| Ping {
            aggregate: if seq % 2 == 0 { a } else { b },
            seq,
        })
        .collect();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish_all(&events).await.unwrap();
    tx.publish_all(&Vec::<Ping>::new()).await.unwrap();
    assert_eq!(tx.commit().await.unwrap().published(), 5);
    let seqs: Vec<i64> = sqlx::query_scalar(
        "SELECT (payload -> 'data' ->> 'seq')::bigint FROM events.outbox ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn metadata_of_the_transaction_or_of_one_publish_is_stored() {
    let (db, outbox) = setup().await;
    let id = Uuid::new_v4();
    let cause = Uuid::new_v4();
    let mut trace = TraceContext::new();
    trace.insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    let mut tx = outbox.begin().await.unwrap();
    tx.set_metadata(
        Metadata::new()
            .with_correlation_id(cause)
            .with_trace_context(trace.clone()),
    );
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    tx.publish_with(
        &Ping {
            aggregate: id,
            seq: 2,
        },
        &Metadata::new().with_causation_id(cause),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let payloads: Vec<String> =
        sqlx::query_scalar("SELECT payload::text FROM events.outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let first = decode::<Ping>(&payloads[0]).unwrap().metadata;
    assert_eq!(first.correlation_id(), Some(cause));
    assert_eq!(first.trace_context(), &trace);
    let second = decode::<Ping>(&payloads[1]).unwrap().metadata;
    assert_eq!(second.causation_id(), Some(cause));
    assert_eq!(second.correlation_id(), None);
}

#[tokio::test]
async fn an_existing_sqlx_transaction_can_be_wrapped_or_nested() {
    let (db, outbox) = setup().await;
    let id = Uuid::new_v4();

    // Wrapping a transaction the caller owns.
    let tx = db.pool.begin().await.unwrap();
    let mut tx = outbox.wrap(tx);
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_events(&db).await, 1);

    // Publishing inside a transaction the caller only borrows: a savepoint, committed with the
    // outer transaction or rolled back with it.
    let mut outer = db.pool.begin().await.unwrap();
    let mut inner = outbox.wrap(outer.begin().await.unwrap());
    inner
        .publish(&Ping {
            aggregate: id,
            seq: 2,
        })
        .await
        .unwrap();
    inner.commit().await.unwrap();
    outer.rollback().await.unwrap();
    assert_eq!(count_events(&db).await, 1);

    let mut outer = db.pool.begin().await.unwrap();
    let mut inner = outbox.wrap(outer.begin().await.unwrap());
    inner
        .publish(&Ping {
            aggregate: id,
            seq: 3,
        })
        .await
        .unwrap();
    inner.commit().await.unwrap();
    outer.commit().await.unwrap();
    assert_eq!(count_events(&db).await, 2);
}

#[tokio::test]
async fn a_service_written_against_the_publish_port_runs_on_the_transaction() {
    async fn service(
        events: &mut impl Publish<Ping>,
        aggregate: Uuid,
    ) -> Result<(), outbox_core::PublishError> {
        events.publish(&Ping { aggregate, seq: 1 }).await?;
        events
            .publish_all([&Ping { aggregate, seq: 2 }, &Ping { aggregate, seq: 3 }])
            .await
    }
    let (db, outbox) = setup().await;
    let mut tx = outbox.begin().await.unwrap();
    service(&mut tx, Uuid::new_v4()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_events(&db).await, 3);
}

#[tokio::test]
async fn occurred_at_is_the_events_own_or_the_time_of_publishing() {
    use outbox_tests::samples;
    let (db, outbox) = setup().await;
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&samples::payment_succeeded()).await.unwrap();
    tx.publish(&samples::bot_kicked()).await.unwrap();
    tx.commit().await.unwrap();
    let rows: Vec<(String, time::OffsetDateTime, time::OffsetDateTime)> =
        sqlx::query_as("SELECT event_type, occurred_at, now() FROM events.outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(rows[0].0, "PaymentSucceeded");
    assert_eq!(Some(rows[0].1), samples::payment_succeeded().occurred_at());
    assert_eq!(rows[1].0, "BotKicked");
    assert!(
        rows[1].2 - rows[1].1 < time::Duration::minutes(5),
        "{rows:?}"
    );
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_to_run_concurrently() {
    let db = TestDb::new().await;
    let outbox: TestOutbox = Outbox::new(db.pool.clone());
    let (a, b, c) = tokio::join!(outbox.migrate(), outbox.migrate(), outbox.migrate());
    a.unwrap();
    b.unwrap();
    c.unwrap();
    outbox.migrate().await.unwrap();
    let versions: Vec<i32> = sqlx::query_scalar("SELECT version FROM events.outbox_migrations")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(versions, [1]);
}

#[tokio::test]
async fn a_database_migrated_by_a_newer_build_is_refused_with_a_clear_error() {
    let (db, outbox) = setup().await;
    sqlx::query(
        "INSERT INTO events.outbox_migrations (version, description) VALUES (99, 'future')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let error = outbox.migrate().await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::SchemaTooNew {
                found: 99,
                known: 1,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains("`events.outbox` are at migration 99"),
        "{error}"
    );
}

#[tokio::test]
async fn custom_schema_and_table_names_are_used() {
    let db = TestDb::new().await;
    let names = TableNames::new("billing", "event_log").unwrap();
    let outbox: TestOutbox = Outbox::with_names(db.pool.clone(), names);
    outbox.migrate().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM billing.event_log")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 1);
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables
         WHERE table_schema = 'billing' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        ["event_log", "event_log_deliveries", "event_log_migrations"]
    );
    // Nothing went to the default schema.
    let default_schema: Option<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname = 'events'")
            .fetch_optional(&db.pool)
            .await
            .unwrap();
    assert_eq!(default_schema, None);
}

#[tokio::test]
async fn an_injection_attempt_in_a_table_name_never_reaches_the_database() {
    let error = TableNames::new("events", "outbox\"; DROP TABLE accounts; --").unwrap_err();
    assert!(
        error.to_string().starts_with("invalid SQL identifier"),
        "{error}"
    );
    let error = TableNames::new("public; DROP SCHEMA public CASCADE", "outbox").unwrap_err();
    assert!(error.to_string().contains("for the schema"), "{error}");
}

#[tokio::test]
async fn an_event_that_cannot_be_encoded_is_an_error_and_stores_nothing() {
    #[derive(Debug, serde::Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "probe")]
    struct Unencodable {
        #[outbox(aggregate_id)]
        id: Uuid,
    }
    impl serde::Serialize for Unencodable {
        fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("refused"))
        }
    }
    #[outbox_core::subscriber(events = [Unencodable])]
    struct Nobody;
    impl outbox_core::Handle<Unencodable> for Nobody {
        async fn handle(
            &self,
            _: &Unencodable,
            _: &outbox_core::Delivery<'_>,
        ) -> Result<(), outbox_core::HandlerError> {
            Ok(())
        }
    }
    #[outbox_core::router(events = [Unencodable])]
    struct Strict {
        nobody: Nobody,
    }
    let (db, _) = setup().await;
    let outbox: Outbox<Postgres, Strict> = Outbox::new(db.pool.clone());
    let mut tx = outbox.begin().await.unwrap();
    let error = tx
        .publish(&Unencodable { id: Uuid::new_v4() })
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Encode(_)), "{error:?}");
    assert_eq!(
        error.to_string(),
        "cannot encode `Unencodable` as JSON: refused"
    );
    tx.commit().await.unwrap();
    assert_eq!(count_events(&db).await, 0);
}

#[tokio::test]
async fn publishers_of_one_aggregate_take_ids_in_commit_order() {
    let (db, outbox) = setup().await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let mut first = outbox.begin().await.unwrap();
    first
        .publish(&Ping {
            aggregate: a,
            seq: 1,
        })
        .await
        .unwrap();

    // A second writer of the same aggregate waits for the first to commit...
    let second = tokio::spawn({
        let outbox = outbox.clone();
        async move {
            let mut tx = outbox.begin().await.unwrap();
            tx.publish(&Ping {
                aggregate: a,
                seq: 2,
            })
            .await
            .unwrap();
            tx.commit().await.unwrap();
        }
    });
    let waiting = "SELECT count(*) FROM pg_stat_activity
                   WHERE datname = current_database() AND wait_event = 'advisory'";
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(waiting)
        .fetch_one(&db.pool)
        .await
        .unwrap()
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second writer never waited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // ...while a writer of another aggregate does not.
    let mut other = outbox.begin().await.unwrap();
    other
        .publish(&Ping {
            aggregate: b,
            seq: 1,
        })
        .await
        .unwrap();
    other.commit().await.unwrap();

    first.commit().await.unwrap();
    second.await.unwrap();
    let order: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT aggregate_id, (payload -> 'data' ->> 'seq')::bigint FROM events.outbox
         WHERE aggregate_id = $1 ORDER BY id",
    )
    .bind(a)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(order, [(a, 1), (a, 2)]);
}
