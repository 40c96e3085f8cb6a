use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", version = 2, upcast(from = 1, with = takes_a_string))]
struct LicenseUpgraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
}

fn takes_a_string(data: String) -> String {
    data
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "license", version = 2, upcast(from = 1, with = returns_no_result))]
struct LicenseDowngraded {
    #[outbox(aggregate_id)]
    license_id: Uuid,
}

fn returns_no_result(data: Value) -> Value {
    data
}

fn main() {}
