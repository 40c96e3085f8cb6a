//! Storage for **outbox** on sqlx: PostgreSQL (feature `postgres`, default), SQLite (feature
//! `sqlite`, embedded: one relay per database file) and MySQL / MariaDB (feature `mysql`; see
//! below).
//!
//! - [`Outbox`] runs the migrations ([`Outbox::migrate`]) and begins transactions that can
//!   publish ([`Outbox::begin`]).
//! - [`OutboxTx`] is such a transaction. Domain SQL runs on it, [`publish`](OutboxTx::publish)
//!   stores events in it, and [`commit`](OutboxTx::commit) stores both or neither. Publishing is
//!   only possible there: not on a pool, a bare connection, or a finished transaction.
//! - [`OutboxTx::receive`] records in the same transaction that a consumer handled a message
//!   from outside (a broker, a webhook) and tells a duplicate: the [`inbox`].
//! - [`SqlStore`] is the relay's view of the same tables; [`Outbox::relay`] builds an
//!   [`outbox_core::Relay`] over it.
//!
//! ```no_run
//! use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber};
//! use outbox_sqlx::Outbox;
//! use serde::{Deserialize, Serialize};
//! use sqlx::Postgres;
//! use uuid::Uuid;
//!
//! #[derive(Serialize, Deserialize, OutboxEvent)]
//! #[outbox(aggregate_type = "subscription")]
//! struct PaymentSucceeded {
//!     #[outbox(aggregate_id)]
//!     subscription_id: Uuid,
//! }
//!
//! #[subscriber(events = [PaymentSucceeded])]
//! struct Licensing;
//!
//! impl Handle<PaymentSucceeded> for Licensing {
//!     async fn handle(&self, event: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> {
//!         println!("extend the license of {}", event.subscription_id);
//!         Ok(())
//!     }
//! }
//!
//! #[router(events = [PaymentSucceeded])]
//! struct App {
//!     licensing: Licensing,
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! let outbox: Outbox<Postgres, App> = Outbox::new(pool);
//! outbox.migrate().await?;
//!
//! // Deliver in the background until shutdown.
//! let relay = outbox.relay(App { licensing: Licensing }, RelayConfig::default())?;
//! let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
//!
//! let mut tx = outbox.begin().await?;
//! tx.publish(&PaymentSucceeded { subscription_id: Uuid::nil() }).await?;
//! tx.commit().await?;
//! # worker.abort();
//! # Ok(())
//! # }
//! ```
//!
//! # Tables
//!
//! By default the events live in the seed's `events.outbox` and per-subscriber delivery state in
//! `events.outbox_deliveries`; [`TableNames`] picks other names, validated as SQL identifiers.
#![cfg_attr(feature = "mysql", doc = include_str!("../docs/mysql.md"))]
#![doc(test(attr(deny(warnings))))]

// Without a database there is nothing to store events in: say so once, rather than with a
// warning for every piece that only a backend uses.
#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
compile_error!(
    "outbox-sqlx needs a database: enable one of its features `postgres` (the default), \
     `sqlite` or `mysql`"
);

mod backend;
#[cfg(feature = "console")]
pub mod console;
mod error;
pub mod inbox;
#[cfg(feature = "mysql")]
mod mysql;
mod names;
mod outbox;
#[cfg(feature = "postgres")]
mod partitions;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
mod tx;
mod views;
mod wake;

pub use backend::{Backend, SubscriberStatus};
#[doc(hidden)]
pub use backend::{PurgeStep, PurgedUpTo};
pub use error::Error;
pub use inbox::Received;
pub use names::TableNames;
pub use outbox::{Outbox, SqlStore};
pub use outbox_core as core;
pub use outbox_core::store::{Requeue, Status};
pub use tx::{
    Active, CanPublish, Committed, OutboxTx, PublishFuture, PublishGuard, RolledBack, State,
};
pub use views::{
    DeadLetterGroup, HeldBack, HoldCause, ListQuery, ListState, Listed, Overview, Page, Report,
    RequeueRecord,
};

/// Test-only hooks into the stores, for fault tests (feature `_fault-injection`; not a public
/// API).
#[cfg(feature = "_fault-injection")]
#[doc(hidden)]
pub mod __fault_injection {
    use std::sync::OnceLock;

    static IN_CLAIM: OnceLock<Box<dyn Fn() + Send + Sync>> = OnceLock::new();

    /// Runs `hook` in every PostgreSQL claim, once its transaction holds the claim lock and
    /// before the claim statement: a blocking hook freezes the claimer there. Set once per
    /// process.
    pub fn in_claim(hook: impl Fn() + Send + Sync + 'static) {
        let _ = IN_CLAIM.set(Box::new(hook));
    }

    pub(crate) fn claim_lock_held() {
        if let Some(hook) = IN_CLAIM.get() {
            hook();
        }
    }
}

/// Imports for code that publishes: the [`Publish`](outbox_core::Publish) port, and the guard
/// that turns `publish` on a pool or a connection into an explained compile error.
pub mod prelude {
    pub use crate::tx::PublishGuard as _;
    pub use outbox_core::Publish;
}
