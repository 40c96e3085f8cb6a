//! Publishing, on PostgreSQL and on SQLite: events are stored iff the transaction commits, in
//! the transaction that holds the domain change.

use outbox_core::{Metadata, OutboxEvent, Publish, TraceContext, decode};
use outbox_sqlx::{Error, Outbox};
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{Everything, Ping};
use outbox_tests::on_every_backend;
use outbox_tests::samples;
use sqlx::Acquire;
use uuid::Uuid;

on_every_backend!(
    committed_transaction_stores_domain_change_and_event_together,
    rolled_back_transaction_stores_neither,
    dropped_transaction_stores_neither,
    publish_all_inserts_in_order_in_one_statement,
    metadata_of_the_transaction_or_of_one_publish_is_stored,
    an_existing_sqlx_transaction_can_be_wrapped_or_nested,
    a_service_written_against_the_publish_port_runs_on_the_transaction,
    occurred_at_is_the_events_own_or_the_time_of_publishing,
    migrate_is_idempotent_and_safe_to_run_concurrently,
    a_database_migrated_by_a_newer_build_is_refused_with_a_clear_error,
    an_event_that_cannot_be_encoded_is_an_error_and_stores_nothing,
);

async fn setup<B: TestBackend>() -> (B::Guard, Outbox<B, Everything>) {
    let (guard, outbox) = outbox::<B, Everything>().await;
    B::create_accounts(outbox.pool()).await;
    (guard, outbox)
}

async fn committed_transaction_stores_domain_change_and_event_together<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let id = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    B::insert_account(&mut tx, id, 100).await;
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    let committed = tx.commit().await.unwrap();
    assert_eq!(committed.published(), 1);

    let events = B::events(outbox.pool()).await;
    assert_eq!(events.len(), 1);
    let row = &events[0];
    assert_eq!(row.aggregate_type, "probe");
    assert_eq!(row.aggregate_id, id);
    assert_eq!(row.event_type, "Ping");
    assert!(!row.published);
    let stored = decode::<Ping>(&row.payload).unwrap();
    assert_eq!(
        stored.event,
        Ping {
            aggregate: id,
            seq: 1
        }
    );
    assert_eq!(B::account_count(outbox.pool()).await, 1);
}

async fn rolled_back_transaction_stores_neither<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let id = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    B::insert_account(&mut tx, id, 100).await;
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    let rolled_back = tx.rollback().await.unwrap();
    assert_eq!(rolled_back.published(), 1);
    assert!(B::events(outbox.pool()).await.is_empty());
    assert_eq!(B::account_count(outbox.pool()).await, 0);
}

async fn dropped_transaction_stores_neither<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let id = Uuid::new_v4();
    {
        let mut tx = outbox.begin().await.unwrap();
        B::insert_account(&mut tx, id, 100).await;
        tx.publish(&Ping {
            aggregate: id,
            seq: 1,
        })
        .await
        .unwrap();
    }
    assert!(B::events(outbox.pool()).await.is_empty());
    assert_eq!(B::account_count(outbox.pool()).await, 0);
}

async fn publish_all_inserts_in_order_in_one_statement<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
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
    let stored: Vec<Ping> = B::events(outbox.pool())
        .await
        .iter()
        .map(|row| decode::<Ping>(&row.payload).unwrap().event)
        .collect();
    assert_eq!(stored, events);
}

async fn metadata_of_the_transaction_or_of_one_publish_is_stored<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
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
    let events = B::events(outbox.pool()).await;
    let first = decode::<Ping>(&events[0].payload).unwrap().metadata;
    assert_eq!(first.correlation_id(), Some(cause));
    assert_eq!(first.trace_context(), &trace);
    let second = decode::<Ping>(&events[1].payload).unwrap().metadata;
    assert_eq!(second.causation_id(), Some(cause));
    assert_eq!(second.correlation_id(), None);
}

async fn an_existing_sqlx_transaction_can_be_wrapped_or_nested<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let id = Uuid::new_v4();
    let count = || async { B::events(outbox.pool()).await.len() };

    // Wrapping a transaction the caller owns.
    let tx = outbox.pool().begin().await.unwrap();
    let mut tx = outbox.wrap(tx);
    tx.publish(&Ping {
        aggregate: id,
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count().await, 1);

    // Publishing inside a transaction the caller only borrows: a savepoint, committed with the
    // outer transaction or rolled back with it.
    let mut outer = outbox.pool().begin().await.unwrap();
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
    assert_eq!(count().await, 1);

    let mut outer = outbox.pool().begin().await.unwrap();
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
    assert_eq!(count().await, 2);
}

async fn a_service_written_against_the_publish_port_runs_on_the_transaction<B: TestBackend>() {
    async fn service(
        events: &mut impl Publish<Ping>,
        aggregate: Uuid,
    ) -> Result<(), outbox_core::PublishError> {
        events.publish(&Ping { aggregate, seq: 1 }).await?;
        events
            .publish_all([&Ping { aggregate, seq: 2 }, &Ping { aggregate, seq: 3 }])
            .await
    }
    let (_db, outbox) = setup::<B>().await;
    let mut tx = outbox.begin().await.unwrap();
    service(&mut tx, Uuid::new_v4()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(B::events(outbox.pool()).await.len(), 3);
}

async fn occurred_at_is_the_events_own_or_the_time_of_publishing<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let before = time::OffsetDateTime::now_utc() - time::Duration::seconds(5);
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&samples::payment_succeeded()).await.unwrap();
    tx.publish(&samples::bot_kicked()).await.unwrap();
    tx.commit().await.unwrap();
    let after = time::OffsetDateTime::now_utc() + time::Duration::seconds(5);
    let events = B::events(outbox.pool()).await;
    assert_eq!(events[0].event_type, "PaymentSucceeded");
    assert_eq!(
        Some(events[0].occurred_at),
        samples::payment_succeeded().occurred_at()
    );
    assert_eq!(events[1].event_type, "BotKicked");
    assert!(
        (before..after).contains(&events[1].occurred_at),
        "{events:?}"
    );
}

async fn migrate_is_idempotent_and_safe_to_run_concurrently<B: TestBackend>() {
    let (_db, pool) = B::fresh().await;
    let outbox: Outbox<B, Everything> = Outbox::new(pool);
    let (a, b, c) = tokio::join!(outbox.migrate(), outbox.migrate(), outbox.migrate());
    a.unwrap();
    b.unwrap();
    c.unwrap();
    outbox.migrate().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(B::events(outbox.pool()).await.len(), 1);
}

async fn a_database_migrated_by_a_newer_build_is_refused_with_a_clear_error<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    B::insert_future_migration(outbox.pool()).await;
    let error = outbox.migrate().await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::SchemaTooNew {
                found: 99,
                known,
                ..
            } if known == B::LATEST_MIGRATION
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

async fn an_event_that_cannot_be_encoded_is_an_error_and_stores_nothing<B: TestBackend>() {
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
    let (_db, everything) = setup::<B>().await;
    let outbox: Outbox<B, Strict> = Outbox::new(everything.pool().clone());
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
    assert!(B::events(outbox.pool()).await.is_empty());
}
