use outbox_core::{Delivery, Handle, HandlerError, subscriber};

struct PaymentSucceeded {
    amount: u64,
}

#[subscriber(events = [PaymentSucceeded])]
struct Licensing;

impl Handle<PaymentSucceeded> for Licensing {
    async fn handle(&self, event: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> {
        let _ = event.amount;
        Ok(())
    }
}

fn main() {}
