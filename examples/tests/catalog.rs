//! The billing example's catalog: its AsyncAPI document is valid AsyncAPI 3.0, as checked
//! against the specification's own JSON Schema with a validator this project did not write.

use std::path::{Path, PathBuf};
use std::process::Command;

use outbox_core::Router;
use outbox_examples::billing::app::App;
use serde_json::Value;

/// The AsyncAPI project's JSON Schemas (npm package `@asyncapi/specs`), fetched once into the
/// target directory with `npm pack`.
fn asyncapi_3_schema() -> Value {
    const PACKAGE: &str = "@asyncapi/specs@6.11.1";
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("asyncapi-specs-6.11.1");
    let schema: PathBuf = dir.join("package/schemas/3.0.0-without-$id.json");
    if !schema.is_file() {
        std::fs::create_dir_all(&dir).unwrap();
        let packed = Command::new("npm")
            .args(["pack", "--silent", PACKAGE])
            .current_dir(&dir)
            .output()
            .expect("npm runs (the test fetches the AsyncAPI schemas from the npm registry)");
        assert!(
            packed.status.success(),
            "npm pack {PACKAGE} failed: {}",
            String::from_utf8_lossy(&packed.stderr)
        );
        let tarball = String::from_utf8(packed.stdout).unwrap();
        let status = Command::new("tar")
            .arg("xzf")
            .arg(tarball.trim())
            .current_dir(&dir)
            .status()
            .unwrap();
        assert!(status.success(), "tar could not unpack {tarball}");
    }
    serde_json::from_str(&std::fs::read_to_string(&schema).unwrap()).unwrap()
}

#[test]
fn the_billing_asyncapi_document_is_valid_asyncapi_3() {
    let validator = jsonschema::validator_for(&asyncapi_3_schema()).expect("a valid schema");
    let document = App::catalog().to_asyncapi("billing", "1.0.0");
    let errors: Vec<String> = validator
        .iter_errors(&document)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");

    // Each event is a message with its payload schema and its version; each a send operation.
    let messages = document["components"]["messages"].as_object().unwrap();
    assert_eq!(messages.len(), 7);
    let payment = &messages["PaymentSucceeded"];
    assert_eq!(payment["x-outbox-version"], 1);
    let data = &payment["payload"]["properties"]["data"];
    assert_eq!(data["properties"]["occurred_at"]["format"], "date-time");
    assert_eq!(data["properties"]["subscription_id"]["format"], "uuid");
    assert_eq!(
        document["operations"]["send_PaymentSucceeded"]["x-outbox-subscribers"],
        serde_json::json!(["audit", "licensing", "notification"])
    );

    // The validator does reject what the specification forbids: the check can fail.
    let mut broken = document.clone();
    broken["channels"]["PaymentSucceeded"]["address"] = Value::from(42);
    broken["operations"]["send_PaymentSucceeded"]["action"] = Value::from("publish");
    assert!(validator.iter_errors(&broken).count() >= 2);
}

/// The compatibility check, as an application adds it: the catalog against the snapshot
/// committed beside this test (`OUTBOX_BLESS=1` records it after a deliberate change).
#[test]
fn the_billing_catalog_keeps_what_is_stored() {
    outbox_core::testing::check_catalog::<App>(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/catalog.json"
    ));
}
