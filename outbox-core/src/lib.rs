//! The core of **outbox**, a transactional outbox for Rust services: the event model, the versioned
//! envelope events are stored in, and (in later modules) routing and the relay. It has no database
//! code; `outbox-sqlx` stores events in PostgreSQL or SQLite.
//!
//! A domain crate depends on this crate only. It defines its events with
//! [`#[derive(OutboxEvent)]`](derive@OutboxEvent):
//!
//! ```
//! use outbox_core::{Metadata, OutboxEvent, decode, encode};
//! use serde::{Deserialize, Serialize};
//! use serde_json::{Value, json};
//! use uuid::Uuid;
//!
//! /// Version 2 split `amount` into `amount_minor` and `currency`.
//! #[derive(Debug, PartialEq, Serialize, Deserialize, OutboxEvent)]
//! #[outbox(aggregate_type = "subscription", event_type = "PaymentSucceeded", version = 2)]
//! #[outbox(upcast(from = 1, with = payment_v1_to_v2))]
//! struct PaymentSucceeded {
//!     #[outbox(aggregate_id)]
//!     subscription_id: Uuid,
//!     amount_minor: i64,
//!     currency: String,
//! }
//!
//! fn payment_v1_to_v2(mut data: Value) -> Result<Value, &'static str> {
//!     let obj = data.as_object_mut().ok_or("data is not an object")?;
//!     let amount = obj.remove("amount").ok_or("missing `amount`")?;
//!     obj.insert("amount_minor".into(), amount);
//!     obj.insert("currency".into(), json!("KRW"));
//!     Ok(data)
//! }
//!
//! let event = PaymentSucceeded {
//!     subscription_id: Uuid::nil(),
//!     amount_minor: 9_900,
//!     currency: "KRW".into(),
//! };
//! // The stored payload: {"version":2,"data":{..},"metadata":{..}}
//! let payload = encode(&event, &Metadata::new())?;
//! assert_eq!(decode::<PaymentSucceeded>(&payload)?.event, event);
//!
//! // A payload written before version 2 still decodes, through the upcaster.
//! let old = json!({
//!     "version": 1,
//!     "data": {"subscription_id": Uuid::nil(), "amount": 9_900},
//!     "metadata": {"causation_id": null, "correlation_id": null},
//! });
//! let upcast = decode::<PaymentSucceeded>(old.to_string())?;
//! assert_eq!(upcast.event, event);
//! assert_eq!(upcast.stored_version, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Features
//!
//! - `derive` (default): re-exports `#[derive(OutboxEvent)]`, `#[subscriber]` and `#[router]`.
//! - `testing`: [`testing`], a kit to test services and subscribers without a database.
#![doc(test(attr(deny(warnings))))]

pub mod catalog;
#[cfg(feature = "testing")]
mod compat;
mod envelope;
mod error;
mod event;
mod publish;
mod relay;
mod retry;
mod routing;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;

pub use catalog::Catalog;
pub use envelope::{
    Envelope, Metadata, RawEnvelope, TraceContext, decode, encode, event_id_of, event_uuid,
};
pub use error::{ConfigError, DecodeError, EncodeError, PublishError, StoreError};
pub use event::{AggregateId, BoxError, OutboxEvent, Timestamp, Upcaster};
pub use publish::Publish;
pub use relay::{BatchReport, Relay, RelayConfig, Retention};
pub use retry::RetryPolicy;
pub use routing::{
    Decoded, DeliverFuture, Delivery, Handle, HandlerError, Observer, RoutedBy, Router, Routes,
    RunsOn, Subscriber,
};
pub use store::{ClaimToken, Status, Store, StoredEvent};

/// Derives [`OutboxEvent`](trait@OutboxEvent) for a struct with named fields.
///
/// See the [trait's documentation](trait@OutboxEvent#the-derives-attributes) for its attributes.
#[cfg(feature = "derive")]
pub use outbox_derive::OutboxEvent;

/// Declares a subscriber: the events it takes, each handled by a [`Handle`] impl.
///
/// `#[subscriber(events = [A, B], name = "licensing")]` on a struct or enum implements
/// [`Subscriber`]. `name` defaults to the type's name in snake case. See the
/// [routing guide](crate::routing_guide).
#[cfg(feature = "derive")]
pub use outbox_derive::subscriber;

/// Declares the application's router: its event catalog and its subscribers.
///
/// `#[router(events = [A, B])]` on a struct whose fields are subscribers (and `#[observer]`
/// fields) implements [`Router`] and [`Routes`]. See the [routing guide](crate::routing_guide).
#[cfg(feature = "derive")]
pub use outbox_derive::router;

#[doc = include_str!("../docs/routing_guide.md")]
#[cfg(feature = "derive")]
pub mod routing_guide {}

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
