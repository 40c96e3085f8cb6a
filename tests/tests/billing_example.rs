//! The billing example, run on every backend: the same final state on SQLite, PostgreSQL and
//! MySQL, and every example event delivered twice leaves the state as one delivery did.

use outbox_core::OutboxEvent;
use outbox_core::testing::TestDelivery;
use outbox_examples::billing::app::{App, Controls};
use outbox_examples::billing::db::{Db, SCHEMA};
use outbox_examples::billing::events::{
    BotInstalled, BotKicked, LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded,
    SubscriptionStarted, WinBackOffered,
};
use outbox_examples::billing::scenario::{self, FinalState};
use outbox_sqlx::{Outbox, TableNames};
use outbox_tests::backend::TestBackend;
use outbox_tests::my::TestMyDb;
use outbox_tests::on_every_backend;
use outbox_tests::pg::TestDb;
use sqlx::{MySql, Postgres};
use time::macros::datetime;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scenario_ends_in_the_same_state_on_every_backend() {
    let dir = tempfile::tempdir().unwrap();
    let on_sqlite = scenario::on_sqlite_file(&dir.path().join("billing.db"))
        .await
        .unwrap();
    let db = TestDb::new().await;
    let on_postgres = scenario::run::<Postgres>(db.pool.clone(), TableNames::default())
        .await
        .unwrap();
    assert_eq!(on_sqlite, on_postgres);
    let db = TestMyDb::new().await;
    let on_mysql = scenario::run::<MySql>(db.pool.clone(), TableNames::default())
        .await
        .unwrap();
    assert_eq!(on_sqlite, on_mysql);

    // And that state is the scenario's, not just the same on both.
    let text = |s: &str| Some(s.to_owned());
    let license = scenario::LICENSE.to_string();
    let lapsing_license = scenario::LAPSING_LICENSE.to_string();
    assert_eq!(
        on_sqlite.licenses,
        [
            vec![
                text(&license),
                text("pro"),
                text("active"),
                text("1801267200")
            ],
            vec![
                text(&lapsing_license),
                text("basic"),
                text("suspended"),
                text("1798675200")
            ],
        ]
    );
    assert!(on_sqlite.license_bots.is_empty(), "the bot was kicked");
    let audited: Vec<&str> = on_sqlite
        .audit
        .iter()
        .map(|row| row[1].as_deref().unwrap())
        .collect();
    assert_eq!(
        audited,
        [
            "SubscriptionStarted",
            "SubscriptionStarted",
            "BotInstalled",
            "PaymentSucceeded",
            "LicenseUpgraded",
            "BotKicked",
            "PaymentFailedFinal",
            "WinBackOffered"
        ]
    );
    assert_eq!(
        on_sqlite.notifications.len(),
        6,
        "the win-back offer included"
    );
    assert_eq!(
        on_sqlite.recovery_cases.len(),
        3,
        "the requeued BotKicked included"
    );
    assert_eq!(on_sqlite.dead_letters, 0);
}

on_every_backend!(every_example_event_delivered_twice_leaves_the_state_unchanged);

async fn every_example_event_delivered_twice_leaves_the_state_unchanged<B: TestBackend + Db>() {
    let (_db, pool) = B::fresh().await;
    B::execute_script(&pool, SCHEMA).await.unwrap();
    // Audit and recovery apply their effects exactly once through the outbox: its tables too.
    let outbox: Outbox<B, App> = Outbox::new(pool.clone());
    outbox.migrate().await.unwrap();
    let handle = B::into_handle(pool);
    let app = App::new(&handle, &B::into_outbox(outbox), &Controls::default());
    let (subscription, license, bot) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let deliveries = [
        TestDelivery::of(&SubscriptionStarted {
            subscription_id: subscription,
            license_id: license,
            customer_email: "ada@example.com".to_owned(),
            period_end: 1_000,
        }),
        TestDelivery::of(&BotInstalled {
            bot_id: bot,
            license_id: license,
        }),
        TestDelivery::of(&PaymentSucceeded {
            subscription_id: subscription,
            attempt_id: Uuid::new_v4(),
            license_id: license,
            new_period_end: 2_000,
            cycle_count: 2,
            occurred_at: datetime!(2026-12-02 10:00 UTC),
        }),
        TestDelivery::of(&LicenseUpgraded {
            license_id: license,
            tier: "pro".to_owned(),
        }),
        TestDelivery::of(&BotKicked {
            bot_id: bot,
            license_id: license,
            reason: "spam".to_owned(),
        }),
        TestDelivery::of(&PaymentFailedFinal {
            subscription_id: subscription,
            attempt_id: Uuid::new_v4(),
            license_id: license,
            reason: "card expired".to_owned(),
        }),
        TestDelivery::of(&WinBackOffered {
            subscription_id: subscription,
            offer: "a free month".to_owned(),
        }),
    ];
    assert_eq!(
        deliveries.len(),
        7,
        "every event of the example's catalog: {:?}",
        [
            SubscriptionStarted::EVENT_TYPE,
            BotInstalled::EVENT_TYPE,
            PaymentSucceeded::EVENT_TYPE,
            LicenseUpgraded::EVENT_TYPE,
            BotKicked::EVENT_TYPE,
            PaymentFailedFinal::EVENT_TYPE,
            WinBackOffered::EVENT_TYPE,
        ]
    );
    let mut before = FinalState::read(&handle).await.unwrap();
    for (n, delivery) in deliveries.into_iter().enumerate() {
        let id = i64::try_from(n).unwrap() + 1;
        let delivery = delivery.id(id);
        let event_type = delivery.stored().event_type.clone();
        delivery.through(&app).await.unwrap();
        let once = FinalState::read(&handle).await.unwrap();
        assert_ne!(
            once, before,
            "{event_type} changed nothing: the test would prove nothing"
        );
        assert_eq!(once.audit.len(), before.audit.len() + 1, "{event_type}");

        delivery.attempt(2).through(&app).await.unwrap();
        let twice = FinalState::read(&handle).await.unwrap();
        assert_eq!(
            twice, once,
            "{event_type} delivered twice changed the state"
        );
        before = twice;
    }
}

/// A `DATABASE_URL` the example cannot reach gets an error that says which setting named the
/// server and what to check, from the connection's own error (a pool would retry for 30 s and
/// then say only that it timed out), and never the URL's password.
#[tokio::test]
async fn a_database_the_example_cannot_reach_gets_a_clear_error_without_the_password() {
    // Nothing listens on port 1.
    for error in [
        scenario::on_postgres("postgres://someone:s3cret@127.0.0.1:1/db")
            .await
            .unwrap_err(),
        scenario::on_mysql("mysql://someone:s3cret@127.0.0.1:1/db")
            .await
            .unwrap_err(),
    ] {
        let message = error.to_string();
        assert!(
            message.starts_with("cannot connect to the database DATABASE_URL names: ")
                && message.contains("refused")
                && message.ends_with("is the server running, at the host and port the URL names?"),
            "{message}"
        );
        assert!(!message.contains("s3cret"), "{message}");
    }
    // A server that answers and refuses says why.
    let admin = outbox_tests::pg::admin_url();
    let (base, query) = admin.split_once('?').unwrap_or((&admin, ""));
    let server = base.rsplit_once('/').map_or(base, |(server, _)| server);
    let url = format!("{server}/no_such_database_here?{query}");
    let error = scenario::on_postgres(&url).await.unwrap_err().to_string();
    assert!(
        error.starts_with("cannot connect to the database DATABASE_URL names: ")
            && error.contains("no_such_database_here")
            && error.contains("does not exist"),
        "{error}"
    );
}
