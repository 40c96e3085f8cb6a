use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "system")]
struct Heartbeat;

fn main() {}
