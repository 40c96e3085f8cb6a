use outbox_core::subscriber;

#[subscriber(events = [BotKicked])]
fn licensing() {}

fn main() {}
