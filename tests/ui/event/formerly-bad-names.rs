use outbox_core::OutboxEvent;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

// `formerly` lists the names the event type had before a rename: never its current name,
// never one name twice, and always a list of strings.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", event_type = "BotInstalled")]
#[outbox(formerly = ["BotAdded", "BotInstalled", "BotAdded", ""])]
struct BotInstalled {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", formerly = "BotGone")]
struct BotKicked {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

// The default event type (the struct's name) counts as the current name too.
#[derive(Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "bot", formerly = ["BotMoved"])]
struct BotMoved {
    #[outbox(aggregate_id)]
    bot_id: Uuid,
}

fn main() {}
