// Subscribers, events and routers declared by the user's own `macro_rules!`, with the event
// types passed in from outside: the generated code's locals and `self` resolve whatever the
// hygiene of the tokens it is given.
use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! event {
    ($name:ident, $id:ty) => {
        #[derive(Serialize, Deserialize, OutboxEvent)]
        #[outbox(aggregate_type = "bot")]
        struct $name {
            #[outbox(aggregate_id)]
            bot_id: $id,
        }
    };
}

macro_rules! app {
    ($($event:ident),*) => {
        #[subscriber(events = [$($event),*])]
        struct Licensing;

        impl<E: OutboxEvent> Handle<E> for Licensing {
            async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
                Ok(())
            }
        }

        #[router(events = [$($event),*])]
        struct App {
            licensing: Licensing,
        }
    };
}

event!(BotInstalled, Uuid);
event!(BotKicked, Uuid);
app!(BotInstalled, BotKicked);

fn main() {
    let _ = App { licensing: Licensing };
}
