use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", version = 3)]
#[outbox(upcast(from = 1, with = v1_to_v2))]
struct LicenseUpgraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
}

fn v1_to_v2(data: Value) -> Result<Value, String> {
    Ok(data)
}

fn main() {}
