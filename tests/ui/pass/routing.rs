//! The supported forms of `#[subscriber]` and `#[router]`: events, subscribers and the router
//! in different modules; a name override; a generic subscriber; an observer; a renamed crate.

mod events {
    use outbox_core::OutboxEvent;
    use serde::{Deserialize, Serialize};
    use uuid::Uuid;

    #[derive(Serialize, Deserialize, OutboxEvent)]
    #[outbox(aggregate_type = "subscription")]
    pub struct PaymentSucceeded {
        #[outbox(aggregate_id)]
        pub subscription_id: Uuid,
    }

    pub mod bots {
        use super::*;

        #[derive(Serialize, Deserialize, OutboxEvent)]
        #[outbox(aggregate_type = "bot", event_type = "bots.Kicked")]
        pub struct BotKicked {
            #[outbox(aggregate_id)]
            pub bot_id: Uuid,
        }
    }
}

mod licensing {
    use outbox_core::{Delivery, Handle, HandlerError, subscriber};

    use crate::events::{PaymentSucceeded, bots::BotKicked};

    /// Handles each event with its own impl.
    #[subscriber(events = [PaymentSucceeded, BotKicked])]
    pub struct Licensing {
        pub extended: std::sync::atomic::AtomicUsize,
    }

    impl Handle<PaymentSucceeded> for Licensing {
        async fn handle(&self, _: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> {
            self.extended.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    impl Handle<BotKicked> for Licensing {
        async fn handle(&self, event: &BotKicked, d: &Delivery<'_>) -> Result<(), HandlerError> {
            if d.attempt() > 3 {
                return Err(HandlerError::permanent(format!("bot {} keeps failing", event.bot_id)));
            }
            Ok(())
        }
    }
}

mod notification {
    use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent};

    /// Generic over its mailer, so that it can be tested with a fake one.
    pub trait Mailer: Send + Sync + 'static {
        fn send(&self, to: &str);
    }

    #[outbox_core::subscriber(events = [crate::events::PaymentSucceeded], name = "mail")]
    pub struct Notification<M: Mailer> {
        pub mailer: M,
    }

    impl<M: Mailer, E: OutboxEvent> Handle<E> for Notification<M> {
        async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
            self.mailer.send("user@example.com");
            Ok(())
        }
    }

    pub struct Smtp;

    impl Mailer for Smtp {
        fn send(&self, _: &str) {}
    }
}

mod audit {
    use outbox_core::{Delivery, HandlerError, Observer};

    pub struct Audit;

    impl Observer for Audit {
        const NAME: &'static str = "audit";

        async fn observe(&self, _: &Delivery<'_>) -> Result<(), HandlerError> {
            Ok(())
        }
    }
}

mod app {
    use crate::audit::Audit;
    use crate::events::{PaymentSucceeded, bots::BotKicked};
    use crate::licensing::Licensing;
    use crate::notification::{Notification, Smtp};

    mod reexport {
        pub use outbox_core as core;
    }

    #[outbox_core::router(events = [PaymentSucceeded, BotKicked], crate = "self::reexport::core")]
    pub struct App {
        #[observer]
        pub audit: Audit,
        pub licensing: Licensing,
        pub notification: Notification<Smtp>,
    }
}

fn main() {
    use outbox_core::{Router, Routes, Subscriber};

    fn routes<R: Routes<E>, E>() {}
    routes::<app::App, events::PaymentSucceeded>();
    routes::<app::App, events::bots::BotKicked>();

    assert_eq!(<notification::Notification<notification::Smtp>>::NAME, "mail");
    assert_eq!(licensing::Licensing::EVENTS, ["PaymentSucceeded", "bots.Kicked"]);

    let app = app::App {
        audit: audit::Audit,
        licensing: licensing::Licensing { extended: Default::default() },
        notification: notification::Notification { mailer: notification::Smtp },
    };
    assert_eq!(
        app.subscribers("PaymentSucceeded").unwrap(),
        ["audit", "licensing", "mail"]
    );
    assert_eq!(app.subscribers("bots.Kicked").unwrap(), ["audit", "licensing"]);
}
