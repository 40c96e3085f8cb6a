//! The seed's router driving a real relay over PostgreSQL: each catalog event reaches exactly its
//! routed subscribers plus the observer, in the order the router declares; an event type this
//! build does not know is parked with its reason.

use std::time::Duration;

use outbox_core::{RelayConfig, Router};
use outbox_sqlx::Outbox;
use outbox_tests::events::{BotInstalled, PaymentFailedFinal};
use outbox_tests::kit::run_until;
use outbox_tests::pg::TestDb;
use outbox_tests::samples;
use outbox_tests::seed::{Billing, Calls, billing};
use sqlx::{Postgres, Row};
use uuid::Uuid;

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_park_delay(Duration::from_secs(60))
}

#[tokio::test]
async fn each_catalog_event_reaches_its_subscribers_and_the_observer_in_declared_order() {
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Billing> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let calls = Calls::default();
    let relay = outbox.relay(billing(&calls), config()).unwrap();

    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&samples::payment_succeeded()).await.unwrap();
    tx.publish(&PaymentFailedFinal {
        subscription_id: samples::SUBSCRIPTION,
        license_id: samples::LICENSE,
    })
    .await
    .unwrap();
    tx.publish(&samples::subscription_started()).await.unwrap();
    tx.publish(&samples::license_upgraded()).await.unwrap();
    tx.publish(&BotInstalled {
        bot_id: samples::BOT,
        license_id: samples::LICENSE,
    })
    .await
    .unwrap();
    tx.publish(&samples::bot_kicked()).await.unwrap();
    tx.commit().await.unwrap();

    let router = billing(&Calls::default());
    let event_types = [
        "PaymentSucceeded",
        "PaymentFailedFinal",
        "SubscriptionStarted",
        "LicenseUpgraded",
        "BotInstalled",
        "BotKicked",
    ];
    let expected_calls: usize = event_types
        .iter()
        .map(|t| router.subscribers(t).unwrap().len())
        .sum();
    assert_eq!(
        expected_calls,
        6 + 12,
        "audit six times, the seed's table twelve"
    );
    run_until(&relay, Duration::from_secs(20), || {
        calls.all().len() == expected_calls
    })
    .await;
    for _ in 0..2 {
        relay.run_once().await.unwrap();
    }
    let all = calls.all();
    assert_eq!(all.len(), expected_calls, "no event handled twice: {all:?}");
    for event_type in event_types {
        let got: Vec<&str> = all
            .iter()
            .filter(|(_, t)| t == event_type)
            .map(|(s, _)| s.as_str())
            .collect();
        assert_eq!(got, router.subscribers(event_type).unwrap(), "{event_type}");
    }
}

#[tokio::test]
async fn an_event_type_from_the_database_that_the_router_does_not_know_is_parked() {
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Billing> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let calls = Calls::default();
    let relay = outbox.relay(billing(&calls), config()).unwrap();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('subscription', $1, 'SubscriptionRenamed', '{\"version\":1,\"data\":{}}')
         RETURNING id",
    )
    .bind(Uuid::new_v4())
    .fetch_one(&db.pool)
    .await
    .unwrap();

    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.parked), (1, 1));
    let row = sqlx::query(
        "SELECT published_at IS NULL AS pending, dead_at IS NULL AS alive, last_error,
                next_retry_at > now() AS later
         FROM events.outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(row.get::<bool, _>("pending") && row.get::<bool, _>("alive"));
    assert!(row.get::<bool, _>("later"));
    assert_eq!(
        row.get::<Option<String>, _>("last_error").as_deref(),
        Some("no subscriber in this build knows event type `SubscriptionRenamed`")
    );
    assert!(calls.all().is_empty(), "not even the observer saw it");
}
