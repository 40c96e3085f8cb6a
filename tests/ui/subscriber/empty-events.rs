use outbox_core::subscriber;

#[subscriber(events = [])]
struct Licensing;

#[subscriber(name = "audit")]
struct Audit;

fn main() {}
