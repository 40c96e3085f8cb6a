//! Compile-time routing at run time: the seed's dispatcher expressed with `#[subscriber]` and
//! `#[router]`, and every catalog event reaching exactly its subscribers plus the observers.

use outbox_core::{Decoded, Delivery, OutboxEvent, Router, StoredEvent};
use outbox_tests::seed::{Calls, Licensing, Recovery, billing};

/// The seed's `resolveSubscribers`, as data.
const SEED_DISPATCH: [(&str, &[&str]); 6] = [
    ("PaymentSucceeded", &["licensing", "notification"]),
    (
        "PaymentFailedFinal",
        &["licensing", "notification", "recovery"],
    ),
    ("SubscriptionStarted", &["licensing", "notification"]),
    ("LicenseUpgraded", &["recovery", "notification"]),
    ("BotInstalled", &["licensing"]),
    ("BotKicked", &["licensing", "recovery"]),
];

fn sorted(names: &[&str]) -> Vec<String> {
    let mut names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    names.sort();
    names
}

#[test]
fn the_router_routes_as_the_seeds_dispatcher_plus_audit() {
    let router = billing(&Calls::default());
    for (event_type, seed) in SEED_DISPATCH {
        let routed = router.subscribers(event_type).unwrap();
        // Audit first, as declared; then the seed's subscribers.
        assert_eq!(routed[0], "audit", "{event_type}");
        assert_eq!(sorted(&routed[1..]), sorted(seed), "{event_type}");
    }
    assert_eq!(router.subscribers("Mystery"), None);
}

#[test]
fn subscribers_follow_the_order_the_router_declares() {
    let router = billing(&Calls::default());
    assert_eq!(
        router.subscribers("PaymentFailedFinal").unwrap(),
        ["audit", "licensing", "notification", "recovery"]
    );
    // The seed lists recovery before notification here, and after it for PaymentFailedFinal;
    // one router has one order, and each subscriber's delivery state is its own anyway.
    assert_eq!(
        router.subscribers("LicenseUpgraded").unwrap(),
        ["audit", "notification", "recovery"]
    );
}

#[test]
fn subscriber_names_and_events_come_from_the_attribute() {
    use outbox_core::Subscriber;
    assert_eq!(Licensing::NAME, "licensing");
    assert_eq!(
        Recovery::EVENTS,
        ["PaymentFailedFinal", "LicenseUpgraded", "BotKicked"]
    );
}

fn stored<E: OutboxEvent>(id: i64, event: &E) -> StoredEvent {
    StoredEvent {
        id,
        aggregate_type: E::AGGREGATE_TYPE.to_owned(),
        aggregate_id: event.aggregate_id(),
        event_type: E::EVENT_TYPE.to_owned(),
        payload: outbox_core::encode(event, &outbox_core::Metadata::new()).unwrap(),
        occurred_at: time::OffsetDateTime::UNIX_EPOCH,
    }
}

#[tokio::test]
async fn each_subscriber_gets_the_decoded_event_through_its_handler() {
    let calls = Calls::default();
    let router = billing(&calls);
    let event = stored(7, &outbox_tests::samples::license_upgraded());
    let decoded: Decoded = router.decode(&event).unwrap();
    for &subscriber in router.subscribers(&event.event_type).unwrap() {
        let delivery = Delivery::new(&event, decoded.metadata(), subscriber, 1);
        router
            .deliver(subscriber, &decoded, &delivery)
            .await
            .unwrap();
    }
    let calls = calls.all();
    let expected: Vec<(String, String)> = ["audit", "notification", "recovery"]
        .iter()
        .map(|s| ((*s).to_owned(), "LicenseUpgraded".to_owned()))
        .collect();
    assert_eq!(calls, expected);
}

#[tokio::test]
async fn an_unknown_event_type_or_subscriber_is_an_error_not_a_panic() {
    let router = billing(&Calls::default());
    let mut event = stored(1, &outbox_tests::samples::bot_kicked());
    event.event_type = "Mystery".to_owned();
    let error = router.decode(&event).unwrap_err();
    assert!(error.may_decode_in_newer_build());
    assert_eq!(
        error.to_string(),
        "event type `Mystery` is not in this build's catalog"
    );

    let event = stored(2, &outbox_tests::samples::bot_kicked());
    let decoded = router.decode(&event).unwrap();
    let delivery = Delivery::new(&event, decoded.metadata(), "billing_v2", 1);
    let error = router
        .deliver("billing_v2", &decoded, &delivery)
        .await
        .unwrap_err();
    assert!(!error.is_transient());
    assert_eq!(
        error.to_string(),
        "permanent error: this build's router has no subscriber `billing_v2`"
    );
    // A subscriber handed an event type it does not take (stored routing from another build).
    let delivery = Delivery::new(&event, decoded.metadata(), "notification", 1);
    let error = router
        .deliver("notification", &decoded, &delivery)
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "permanent error: subscriber `notification` does not take event type `BotKicked`"
    );
}
