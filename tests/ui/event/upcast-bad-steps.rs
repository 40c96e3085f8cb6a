use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", version = 2)]
#[outbox(upcast(from = 1, with = step), upcast(from = 1, with = step))]
#[outbox(upcast(from = 2, with = step), upcast(from = 0, with = step))]
#[outbox(upcast(from = 1), upcast(with = step), upcast)]
struct LicenseUpgraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", upcast(from = 1, with = step))]
struct LicenseDowngraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
}

fn step(data: Value) -> Result<Value, String> {
    Ok(data)
}

fn main() {}
