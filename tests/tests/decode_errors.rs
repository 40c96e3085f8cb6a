//! Bad payloads: each returns the matching `DecodeError` variant with a message that says what is
//! wrong, and none panics.

use outbox_core::{DecodeError, Metadata, OutboxEvent, RawEnvelope, decode, encode};
use outbox_tests::events::{BotKicked, LicenseUpgraded, SubscriptionStarted};
use outbox_tests::samples;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

fn valid_payload() -> String {
    encode(&samples::bot_kicked(), &Metadata::new()).unwrap()
}

fn decode_bot(payload: &[u8]) -> DecodeError {
    decode::<BotKicked>(payload).expect_err("payload must not decode")
}

#[test]
fn truncated_json_is_malformed() {
    let payload = valid_payload();
    for cut in [1, payload.len() / 2, payload.len() - 1] {
        let error = decode_bot(&payload.as_bytes()[..cut]);
        assert!(
            matches!(error, DecodeError::MalformedJson(_)),
            "cut at {cut}: {error:?}"
        );
        assert!(error.to_string().starts_with("payload is not valid JSON"));
    }
}

#[test]
fn bytes_that_are_not_json_are_malformed() {
    for payload in [&b""[..], b"\xff\xfe\x00", b"version=1", b"{\"version\":1,}"] {
        assert!(matches!(decode_bot(payload), DecodeError::MalformedJson(_)));
    }
}

#[test]
fn trailing_garbage_after_the_envelope_is_malformed() {
    let payload = valid_payload() + "}";
    assert!(matches!(
        decode_bot(payload.as_bytes()),
        DecodeError::MalformedJson(_)
    ));
}

#[test]
fn missing_data_is_an_invalid_envelope() {
    let error = decode_bot(br#"{"version":1,"metadata":{}}"#);
    assert!(
        matches!(error, DecodeError::InvalidEnvelope(_)),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("missing field `data`"),
        "{error}"
    );
}

#[test]
fn missing_version_is_an_invalid_envelope() {
    let error = decode_bot(br#"{"data":{}}"#);
    assert!(
        matches!(error, DecodeError::InvalidEnvelope(_)),
        "{error:?}"
    );
    assert!(error.to_string().contains("missing field `version`"));
}

#[test]
fn version_as_a_string_is_an_invalid_envelope() {
    let error = decode_bot(br#"{"version":"1","data":{}}"#);
    assert!(
        matches!(error, DecodeError::InvalidEnvelope(_)),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .starts_with("payload is not an outbox envelope"),
        "{error}"
    );
}

#[test]
fn version_zero_negative_or_fractional_is_an_invalid_envelope() {
    for version in ["0", "-1", "1.5", "4294967296", "null"] {
        let payload = format!(r#"{{"version":{version},"data":{{}}}}"#);
        let error = decode_bot(payload.as_bytes());
        assert!(
            matches!(error, DecodeError::InvalidEnvelope(_)),
            "version {version}: {error:?}"
        );
    }
}

#[test]
fn a_payload_that_is_not_an_object_is_an_invalid_envelope() {
    for payload in ["[]", "1", "\"x\"", "null"] {
        let error = decode_bot(payload.as_bytes());
        assert!(
            matches!(error, DecodeError::InvalidEnvelope(_)),
            "{payload}: {error:?}"
        );
        assert!(error.to_string().contains("an outbox envelope"), "{error}");
    }
}

#[test]
fn metadata_of_the_wrong_shape_is_an_invalid_envelope() {
    let error = decode_bot(br#"{"version":1,"data":{},"metadata":{"causation_id":"not-a-uuid"}}"#);
    assert!(
        matches!(error, DecodeError::InvalidEnvelope(_)),
        "{error:?}"
    );
}

#[test]
fn data_of_the_wrong_shape_is_invalid_data() {
    let payload = json!({"version": 1, "data": {"bot_id": 5}}).to_string();
    let error = decode_bot(payload.as_bytes());
    let DecodeError::InvalidData {
        event_type,
        version,
        ..
    } = &error
    else {
        panic!("expected InvalidData, got {error:?}");
    };
    assert_eq!((*event_type, *version), ("BotKicked", 1));
    assert!(
        error
            .to_string()
            .starts_with("`data` of a version 1 `BotKicked` payload does not fit the event"),
        "{error}"
    );
}

#[test]
fn a_newer_version_than_this_build_knows_is_reported_as_newer() {
    let payload = json!({"version": 4, "data": {}}).to_string();
    let error = decode::<LicenseUpgraded>(payload).unwrap_err();
    assert!(
        matches!(
            error,
            DecodeError::NewerVersion {
                event_type: "LicenseUpgraded",
                found: 4,
                current: 3
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "`LicenseUpgraded` payload version 4 is newer than version 3 known to this build: run \
         the newer code to deliver it"
    );
}

#[test]
fn an_older_version_without_upcaster_is_reported_as_missing_upcaster() {
    let payload = json!({"version": 1, "data": {"subscription_id": Uuid::nil(), "plan": "x"}});
    let error = decode::<SubscriptionStarted>(payload.to_string()).unwrap_err();
    assert!(
        matches!(
            error,
            DecodeError::MissingUpcaster {
                event_type: "SubscriptionStarted",
                found: 1,
                oldest: 2,
                current: 2
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "`SubscriptionStarted` payload version 1 is older than this build can read (versions 2 \
         to 2): declare `#[outbox(upcast(from = 1, with = ...))]`"
    );
}

/// At version 3 with an upcaster from 2 only: version 2 reads, version 1 does not.
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", version = 3, upcast(from = 2, with = add_seats))]
struct ChainFromTwo {
    #[outbox(aggregate_id)]
    license_id: Uuid,
    seats: u32,
}

fn add_seats(mut data: Value) -> Result<Value, &'static str> {
    data.as_object_mut()
        .ok_or("expected an object")?
        .insert("seats".into(), json!(1));
    Ok(data)
}

#[test]
fn a_version_below_the_upcaster_chain_is_reported_as_missing_upcaster() {
    let v2 = json!({"version": 2, "data": {"license_id": Uuid::nil()}});
    assert_eq!(
        decode::<ChainFromTwo>(v2.to_string()).unwrap().event.seats,
        1
    );
    let v1 = json!({"version": 1, "data": {"license_id": Uuid::nil()}});
    let error = decode::<ChainFromTwo>(v1.to_string()).unwrap_err();
    assert!(
        matches!(
            error,
            DecodeError::MissingUpcaster {
                found: 1,
                oldest: 2,
                current: 3,
                ..
            }
        ),
        "{error:?}"
    );
}

#[test]
fn a_failing_upcaster_is_reported_with_its_reason() {
    let payload = json!({"version": 1, "data": {"license_id": Uuid::nil()}});
    let error = decode::<LicenseUpgraded>(payload.to_string()).unwrap_err();
    assert!(
        matches!(
            error,
            DecodeError::UpcastFailed {
                event_type: "LicenseUpgraded",
                from: 1,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "upcasting `LicenseUpgraded` from version 1 failed: v1 data has no `plan`"
    );
}

#[test]
fn upcast_data_that_does_not_fit_is_invalid_data_with_the_stored_version() {
    let payload = json!({"version": 2, "data": {"license_id": "nope", "tier": "PRO"}});
    let error = decode::<LicenseUpgraded>(payload.to_string()).unwrap_err();
    assert!(
        matches!(error, DecodeError::InvalidData { version: 2, .. }),
        "{error:?}"
    );
}

#[test]
fn deeply_nested_data_is_an_error_not_a_stack_overflow() {
    let depth = 100_000;
    let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    // The envelope keeps `data` raw, so only decoding `data` meets the nesting.
    let current = format!(r#"{{"version":1,"data":{nested}}}"#);
    let raw = RawEnvelope::parse(current.as_bytes()).unwrap();
    assert!(matches!(
        raw.decode_data::<BotKicked>(),
        Err(DecodeError::InvalidData { .. })
    ));
    // An older version is parsed into a `serde_json::Value` for the upcasters.
    let old = format!(r#"{{"version":1,"data":{nested}}}"#);
    assert!(matches!(
        decode::<LicenseUpgraded>(old.as_bytes()),
        Err(DecodeError::InvalidData { version: 1, .. })
    ));
    // Nesting in the envelope itself.
    let envelope = format!(r#"{{"version":1,"data":{{}},"metadata":{nested}}}"#);
    assert!(matches!(
        decode::<BotKicked>(envelope.as_bytes()),
        Err(DecodeError::InvalidEnvelope(_) | DecodeError::MalformedJson(_))
    ));
}

#[test]
fn unknown_envelope_and_metadata_keys_are_ignored() {
    // Newer writers may add keys; older readers must not fail on them.
    let payload = json!({
        "version": 1,
        "data": {"bot_id": samples::BOT, "reason": null, "kicked_at": null},
        "metadata": {"causation_id": null, "correlation_id": null, "tenant": "acme"},
        "schema": "bot/v1",
    });
    let envelope = decode::<BotKicked>(payload.to_string()).unwrap();
    assert_eq!(envelope.event.bot_id, samples::BOT);
}
