//! The event model in one run: derive an event, encode it as the stored envelope, read an old
//! payload through the upcasters, and see what a bad payload turns into.
//!
//! Run it with `cargo run --example event_model`.

use outbox_core::{DecodeError, Metadata, OutboxEvent, decode, encode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

/// A license moved to another tier. Version 3 of its payload; versions 1 and 2 still decode.
#[derive(Debug, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(
    aggregate_type = "license",
    event_type = "LicenseUpgraded",
    version = 3
)]
#[outbox(upcast(from = 1, with = rename_plan_to_tier))]
#[outbox(upcast(from = 2, with = add_seats))]
struct LicenseUpgraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
    tier: String,
    seats: u32,
}

/// Version 2 renamed `plan` to `tier`.
fn rename_plan_to_tier(mut data: Value) -> Result<Value, &'static str> {
    let obj = data.as_object_mut().ok_or("data is not an object")?;
    let plan = obj.remove("plan").ok_or("missing `plan`")?;
    obj.insert("tier".into(), plan);
    Ok(data)
}

/// Version 3 added `seats`; licenses from before had one.
fn add_seats(mut data: Value) -> Result<Value, &'static str> {
    let obj = data.as_object_mut().ok_or("data is not an object")?;
    obj.insert("seats".into(), json!(1));
    Ok(data)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("1. #[derive(OutboxEvent)] on `LicenseUpgraded` gives:");
    println!("   aggregate type  {}", LicenseUpgraded::AGGREGATE_TYPE);
    println!("   event type      {}", LicenseUpgraded::EVENT_TYPE);
    println!("   payload version {}", LicenseUpgraded::VERSION);
    let steps: Vec<String> = LicenseUpgraded::UPCASTERS
        .iter()
        .map(|u| format!("v{} -> v{}", u.from(), u.from() + 1))
        .collect();
    println!("   upcasters       {}", steps.join(", "));

    let license_id = Uuid::new_v4();
    let event = LicenseUpgraded {
        license_id,
        tier: "team".into(),
        seats: 10,
    };
    let command_id = Uuid::new_v4();
    let metadata = Metadata::new()
        .with_causation_id(command_id)
        .with_correlation_id(command_id);
    let payload = encode(&event, &metadata)?;
    println!("\n2. encode() gives the payload the outbox stores:\n   {payload}");

    let decoded = decode::<LicenseUpgraded>(&payload)?;
    assert_eq!(decoded.event, event);
    println!(
        "\n3. decode() reads it back: {:?} (causation {})",
        decoded.event,
        decoded.metadata.causation_id().unwrap_or_default()
    );

    let v1 = format!(
        r#"{{"version":1,"data":{{"license_id":"{license_id}","plan":"enterprise"}},"metadata":{{"causation_id":null,"correlation_id":null}}}}"#
    );
    let upcast = decode::<LicenseUpgraded>(&v1)?;
    println!("\n4. a payload written by version 1 of the code:\n   {v1}");
    println!(
        "   decodes through v1 -> v2 -> v3 to {:?} (stored version {})",
        upcast.event, upcast.stored_version
    );

    println!("\n5. bad payloads are errors, never panics:");
    for bad in [
        r#"{"version":1,"data":{"license_"#.to_owned(),
        r#"{"version":"3","data":{}}"#.to_owned(),
        r#"{"version":4,"data":{}}"#.to_owned(),
        format!(r#"{{"version":1,"data":{{"license_id":"{license_id}"}}}}"#),
    ] {
        let error: DecodeError = decode::<LicenseUpgraded>(&bad)
            .err()
            .ok_or("a bad payload decoded")?;
        println!("   {bad}\n     -> {error}");
    }
    Ok(())
}
