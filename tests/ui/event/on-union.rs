use outbox_core::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(aggregate_type = "subscription")]
union PaymentBits {
    cents: u64,
    raw: [u8; 8],
}

fn main() {}
