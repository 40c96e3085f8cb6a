//! Arbitrary payloads and event-type strings, fed through decoding and through a relay's dispatch
//! (the seed's router, with upcasters): nothing panics, and every event claimed gets an outcome.

use std::sync::Mutex;
use std::time::Duration;

use outbox_core::store::{Batch, Claim, EventOutcome, Outcomes, Purged, Recorded, Requeue, Status};
use outbox_core::{ClaimToken, Relay, RelayConfig, Router, Store, StoreError, StoredEvent};
use outbox_tests::seed::{Calls, billing};
use proptest::prelude::*;
use serde_json::{Value, json};
use time::OffsetDateTime;
use uuid::Uuid;

/// Event types: the router's own, near misses, and anything at all.
fn event_type() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("PaymentSucceeded".to_owned()),
        Just("LicenseUpgraded".to_owned()),
        Just("BotKicked".to_owned()),
        Just("paymentsucceeded".to_owned()),
        Just(String::new()),
        any::<String>(),
    ]
}

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        any::<String>().prop_map(Value::from),
        any::<u128>().prop_map(|n| Value::from(Uuid::from_u128(n).to_string())),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(
                prop_oneof![
                    any::<String>(),
                    Just("subscription_id".to_owned()),
                    Just("bot_id".to_owned()),
                    Just("license_id".to_owned()),
                    Just("tier".to_owned()),
                ],
                inner,
                0..6
            )
            .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Payloads: raw bytes, any JSON, and envelopes with arbitrary versions, data and metadata.
fn payload() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|bytes| String::from_utf8_lossy(&bytes).into_owned()),
        json_value().prop_map(|v| v.to_string()),
        (json_value(), json_value(), json_value()).prop_map(|(version, data, metadata)| {
            json!({"version": version, "data": data, "metadata": metadata}).to_string()
        }),
        (any::<i64>(), json_value()).prop_map(|(version, data)| {
            json!({"version": version, "data": data, "metadata": {}}).to_string()
        }),
        (0_u32..5, json_value(), any::<u128>()).prop_map(|(version, data, id)| {
            json!({
                "version": version,
                "data": data,
                "metadata": {"causation_id": Uuid::from_u128(id), "correlation_id": "not a uuid"},
            })
            .to_string()
        }),
    ]
}

/// A store that hands out one batch of the given events, and keeps the outcomes recorded.
struct OneBatch {
    claims: Mutex<Option<Vec<Claim>>>,
    recorded: Mutex<Vec<Outcomes>>,
}

impl Store for OneBatch {
    async fn claim(
        &self,
        _: outbox_core::store::ClaimLimit,
        _: Duration,
        _: &outbox_core::store::ClaimFilter,
    ) -> Result<Batch, StoreError> {
        let claims = self.claims.lock().unwrap().take().unwrap_or_default();
        Ok(Batch::new(ClaimToken::new(1), claims))
    }

    async fn renew(&self, _: ClaimToken, _: Duration) -> Result<bool, StoreError> {
        Ok(true)
    }

    async fn record(&self, _: ClaimToken, outcomes: &Outcomes) -> Result<Recorded, StoreError> {
        self.recorded.lock().unwrap().push(outcomes.clone());
        Ok(Recorded::Applied)
    }

    async fn requeue(&self, _: &Requeue) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn status(&self) -> Result<Status, StoreError> {
        Ok(Status::default())
    }

    async fn purge_published(&self, _: Duration, _: u32) -> Result<Purged, StoreError> {
        Ok(Purged::default())
    }
}

fn stored(id: i64, event_type: String, payload: String) -> StoredEvent {
    StoredEvent {
        id,
        aggregate_type: "fuzz".to_owned(),
        aggregate_id: Uuid::from_u128(u128::try_from(id).unwrap()),
        event_type,
        payload,
        occurred_at: OffsetDateTime::UNIX_EPOCH,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decoding_arbitrary_input_returns_a_result_and_never_panics(
        event_type in event_type(),
        payload in payload(),
    ) {
        let router = billing(&Calls::default());
        let event = stored(1, event_type, payload);
        // An `Err` is the expected answer for most inputs; a panic fails the test.
        if let Ok(decoded) = router.decode(&event) {
            prop_assert!(router.subscribers(&event.event_type).is_some());
            let _ = decoded.metadata();
        }
    }

    #[test]
    fn a_relay_dispatching_arbitrary_events_records_an_outcome_for_each(
        events in prop::collection::vec((event_type(), payload()), 1..12),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let claims: Vec<Claim> = events
            .into_iter()
            .zip(1..)
            .map(|((event_type, payload), id)| Claim::Event {
                event: stored(id, event_type, payload),
                parked: 0,
                expired: 0,
                blocked: Vec::new(),
            })
            .collect();
        let ids: Vec<i64> = claims.iter().map(Claim::event_id).collect();
        let store = OneBatch { claims: Mutex::new(Some(claims)), recorded: Mutex::default() };
        let relay = Relay::new(store, billing(&Calls::default()), RelayConfig::default()).unwrap();
        let report = runtime.block_on(relay.run_once()).unwrap();
        prop_assert_eq!(report.claimed, ids.len());
        let recorded = relay.store().recorded.lock().unwrap();
        prop_assert_eq!(recorded.len(), 1);
        let outcomes: Vec<i64> = recorded[0].events.iter().map(|(id, _)| *id).collect();
        prop_assert_eq!(outcomes, ids);
        for (_, outcome) in &recorded[0].events {
            prop_assert!(!matches!(outcome, EventOutcome::Released), "{:?}", outcome);
        }
    }
}
