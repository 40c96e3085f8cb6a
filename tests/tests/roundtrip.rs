//! Property: encoding then decoding returns the same event and metadata, for arbitrary field
//! values (unicode strings, extreme integers, floats across their whole finite range).

use std::collections::BTreeMap;

use outbox_core::{Metadata, OutboxEvent, TraceContext, decode, encode};
use outbox_tests::events::LicenseUpgraded;
use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Line {
    sku: String,
    quantity: u16,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed", version = 7)]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: Uuid,
    note: String,
    nickname: Option<String>,
    total_minor: i64,
    counter: u64,
    small: i8,
    ratio: f64,
    ratio32: f32,
    paid: bool,
    lines: Vec<Line>,
    tags: BTreeMap<String, i32>,
    unit: (),
}

fn uuid() -> impl Strategy<Value = Uuid> {
    any::<u128>().prop_map(Uuid::from_u128)
}

/// Finite floats, including the extremes and subnormals; JSON has no NaN or infinity.
fn finite_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
        Just(f64::MAX),
        Just(f64::MIN),
        Just(f64::MIN_POSITIVE),
        Just(f64::EPSILON),
        Just(5e-324),
        Just(0.0),
    ]
}

fn finite_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<f32>().prop_filter("finite", |f| f.is_finite()),
        Just(f32::MAX),
        Just(f32::MIN),
        Just(f32::MIN_POSITIVE),
    ]
}

fn order_placed() -> impl Strategy<Value = OrderPlaced> {
    (
        (uuid(), any::<String>(), any::<Option<String>>()),
        (
            prop_oneof![any::<i64>(), Just(i64::MIN), Just(i64::MAX)],
            prop_oneof![any::<u64>(), Just(u64::MAX)],
            any::<i8>(),
        ),
        (finite_f64(), finite_f32(), any::<bool>()),
        (
            prop::collection::vec(
                (any::<String>(), any::<u16>()).prop_map(|(sku, quantity)| Line { sku, quantity }),
                0..4,
            ),
            prop::collection::btree_map(any::<String>(), any::<i32>(), 0..4),
        ),
    )
        .prop_map(
            |(
                (order_id, note, nickname),
                (total_minor, counter, small),
                (ratio, ratio32, paid),
                (lines, tags),
            )| OrderPlaced {
                order_id,
                note,
                nickname,
                total_minor,
                counter,
                small,
                ratio,
                ratio32,
                paid,
                lines,
                tags,
                unit: (),
            },
        )
}

fn metadata() -> impl Strategy<Value = Metadata> {
    (
        proptest::option::of(uuid()),
        proptest::option::of(uuid()),
        prop::collection::btree_map(any::<String>(), any::<String>(), 0..3),
    )
        .prop_map(|(causation, correlation, fields)| {
            let mut metadata = Metadata::new();
            if let Some(id) = causation {
                metadata = metadata.with_causation_id(id);
            }
            if let Some(id) = correlation {
                metadata = metadata.with_correlation_id(id);
            }
            let mut trace = TraceContext::new();
            for (key, value) in fields {
                trace.insert(key, value);
            }
            metadata.with_trace_context(trace)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn encode_then_decode_returns_the_same_event(event in order_placed(), metadata in metadata()) {
        let payload = encode(&event, &metadata).unwrap();
        let envelope = decode::<OrderPlaced>(&payload).unwrap();
        prop_assert_eq!(envelope.stored_version, 7);
        // Compare floats by bits: `0.0 == -0.0` would hide a lost sign.
        prop_assert_eq!(envelope.event.ratio.to_bits(), event.ratio.to_bits());
        prop_assert_eq!(envelope.event.ratio32.to_bits(), event.ratio32.to_bits());
        prop_assert_eq!(envelope.event, event);
        prop_assert_eq!(envelope.metadata, metadata);
    }

    #[test]
    fn current_version_license_upgraded_round_trips(
        id in uuid(), tier in any::<String>(), seats in any::<u32>()
    ) {
        let event = LicenseUpgraded { license_id: id, tier, seats };
        let payload = encode(&event, &Metadata::new()).unwrap();
        prop_assert_eq!(decode::<LicenseUpgraded>(&payload).unwrap().event, event);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode::<OrderPlaced>(&bytes);
        let _ = decode::<LicenseUpgraded>(&bytes);
    }
}
