//! Golden payloads: the encoded envelope of each test event equals a committed JSON file, and
//! committed payloads of older versions decode to the current structs.
//!
//! After a deliberate change of the wire format, refresh the files with
//! `OUTBOX_BLESS=1 cargo test -p outbox-tests --test golden` and review the diff.

use std::path::PathBuf;

use outbox_core::{Metadata, OutboxEvent, TraceContext, decode, encode};
use outbox_tests::events::{LicenseUpgraded, PaymentSucceeded};
use outbox_tests::samples;
use uuid::uuid;

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// Compares `payload`, pretty-printed with its key order kept, with the committed file `name`;
/// writes the file instead when `OUTBOX_BLESS` is set.
fn assert_golden(name: &str, payload: &str) {
    let path = fixture_path(name);
    let mut pretty = Vec::new();
    serde_transcode::transcode(
        &mut serde_json::Deserializer::from_str(payload),
        &mut serde_json::Serializer::pretty(&mut pretty),
    )
    .expect("encoded payload is JSON");
    let pretty = String::from_utf8(pretty).unwrap() + "\n";
    if std::env::var_os("OUTBOX_BLESS").is_some() {
        std::fs::write(&path, pretty).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; run with OUTBOX_BLESS=1",
            path.display()
        )
    });
    assert_eq!(
        pretty, committed,
        "payload of {name} differs from the committed file"
    );
}

fn metadata() -> Metadata {
    let mut trace = TraceContext::new();
    trace.insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    Metadata::new()
        .with_causation_id(uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0cc1"))
        .with_correlation_id(uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0cc2"))
        .with_trace_context(trace)
}

fn check_event<E: OutboxEvent + PartialEq + std::fmt::Debug>(event: &E, metadata: &Metadata) {
    let name = format!("{}.v{}.json", E::EVENT_TYPE, E::VERSION);
    let payload = encode(event, metadata).unwrap();
    assert_golden(&name, &payload);
    let decoded = decode::<E>(&payload).unwrap();
    assert_eq!(&decoded.event, event);
    assert_eq!(&decoded.metadata, metadata);
}

#[test]
fn payment_succeeded_payload_matches_golden_file() {
    check_event(&samples::payment_succeeded(), &metadata());
}

#[test]
fn bot_kicked_payload_without_metadata_matches_golden_file() {
    check_event(&samples::bot_kicked(), &Metadata::new());
}

#[test]
fn license_upgraded_payload_matches_golden_file() {
    check_event(&samples::license_upgraded(), &metadata());
}

#[test]
fn subscription_started_payload_matches_golden_file() {
    check_event(&samples::subscription_started(), &metadata());
}

#[test]
fn committed_v1_license_upgraded_decodes_through_both_upcasters() {
    let payload = std::fs::read(fixture_path("LicenseUpgraded.v1.json")).unwrap();
    let envelope = decode::<LicenseUpgraded>(&payload).unwrap();
    assert_eq!(envelope.stored_version, 1);
    assert_eq!(
        envelope.event,
        LicenseUpgraded {
            license_id: samples::LICENSE,
            tier: "enterprise".to_owned(),
            seats: 1,
        }
    );
    assert_eq!(
        envelope.metadata.correlation_id(),
        Some(uuid!("0190c4a6-5e8a-7b3c-9d21-6f4e2a1b0cc2"))
    );
}

#[test]
fn committed_v2_license_upgraded_decodes_through_the_last_upcaster() {
    let payload = std::fs::read(fixture_path("LicenseUpgraded.v2.json")).unwrap();
    let envelope = decode::<LicenseUpgraded>(&payload).unwrap();
    assert_eq!(envelope.stored_version, 2);
    assert_eq!(envelope.event.tier, "team");
    assert_eq!(envelope.event.seats, 1);
}

#[test]
fn seed_payload_without_metadata_decodes() {
    // The seed's own example payload has no `metadata` key.
    let payload = std::fs::read(fixture_path("PaymentSucceeded.seed.json")).unwrap();
    let envelope = decode::<PaymentSucceeded>(&payload).unwrap();
    assert_eq!(envelope.event, samples::payment_succeeded());
    assert_eq!(envelope.metadata, Metadata::new());
}
