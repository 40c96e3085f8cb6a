//! What the relay needs from the application: which subscribers take an event, and how to hand
//! it to each.

use std::any::Any;
use std::fmt;
use std::future::Future;

use crate::envelope::{Metadata, RawEnvelope};
use crate::error::DecodeError;
use crate::event::{BoxError, OutboxEvent};
use crate::store::StoredEvent;

/// The application's routing table, as the relay sees it.
///
/// The relay asks for the subscribers of an event type, decodes the event once with
/// [`decode`](Router::decode), then calls [`deliver`](Router::deliver) for each subscriber in
/// the order [`subscribers`](Router::subscribers) gives.
pub trait Router: Send + Sync + 'static {
    /// The subscribers that take `event_type`, in delivery order, or `None` when this build does
    /// not know the event type (the relay parks such events until a build that knows it runs).
    fn subscribers(&self, event_type: &str) -> Option<&[&'static str]>;

    /// Decodes a stored event into its concrete type.
    fn decode(&self, event: &StoredEvent) -> Result<Decoded, DecodeError>;

    /// Hands a decoded event to one subscriber.
    fn deliver<'a>(
        &'a self,
        subscriber: &'a str,
        event: &'a Decoded,
        delivery: &'a Delivery<'a>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send + 'a;
}

/// An event decoded into its concrete type, held without naming the type.
pub struct Decoded {
    event: Box<dyn Any + Send + Sync>,
    metadata: Metadata,
}

impl Decoded {
    /// Decodes `stored` as `E`.
    pub fn decode<E: OutboxEvent>(stored: &StoredEvent) -> Result<Self, DecodeError> {
        let envelope = RawEnvelope::parse(stored.payload.as_bytes())?;
        let event = envelope.decode_data::<E>()?;
        Ok(Self {
            event: Box::new(event),
            metadata: envelope.metadata().clone(),
        })
    }

    /// The event, if it is an `E`.
    pub fn downcast_ref<E: OutboxEvent>(&self) -> Option<&E> {
        self.event.downcast_ref()
    }

    /// The metadata stored with the event.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }
}

impl fmt::Debug for Decoded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoded")
            .field("metadata", &self.metadata)
            .finish_non_exhaustive()
    }
}

/// What a handler knows about the delivery it is running: the stored event, its metadata, and
/// which attempt this is.
#[derive(Debug)]
pub struct Delivery<'a> {
    pub(crate) event: &'a StoredEvent,
    pub(crate) metadata: &'a Metadata,
    pub(crate) subscriber: &'a str,
    pub(crate) attempt: u32,
}

impl<'a> Delivery<'a> {
    /// Describes the `attempt`-th attempt (from 1) to deliver `event` to `subscriber`.
    pub fn new(
        event: &'a StoredEvent,
        metadata: &'a Metadata,
        subscriber: &'a str,
        attempt: u32,
    ) -> Self {
        Self {
            event,
            metadata,
            subscriber,
            attempt,
        }
    }

    /// The stored event: id, aggregate, event type, raw payload, occurred-at.
    pub fn event(&self) -> &'a StoredEvent {
        self.event
    }

    /// The event's metadata: causation and correlation ids, trace context.
    pub fn metadata(&self) -> &'a Metadata {
        self.metadata
    }

    /// The subscriber this delivery is for.
    pub fn subscriber(&self) -> &'a str {
        self.subscriber
    }

    /// Which attempt this is, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// Why a handler did not handle an event.
///
/// A *transient* error (a timeout, a 503, a deadlock) is retried on the relay's retry schedule and
/// becomes a dead letter when the schedule runs out; a *permanent* one (a business rule that will
/// never accept this event) is a dead letter at once.
///
/// Any error converts into a transient one, so `?` works in handlers:
///
/// ```
/// use outbox_core::HandlerError;
///
/// fn parse_amount(raw: &str) -> Result<u64, HandlerError> {
///     let amount: u64 = raw.parse()?; // a ParseIntError becomes transient
///     if amount == 0 {
///         return Err(HandlerError::permanent("a charge of zero is never valid"));
///     }
///     Ok(amount)
/// }
/// assert!(parse_amount("x").unwrap_err().is_transient());
/// assert!(!parse_amount("0").unwrap_err().is_transient());
/// ```
pub struct HandlerError {
    transient: bool,
    error: BoxError,
}

impl HandlerError {
    /// An error worth retrying.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        Self {
            transient: true,
            error: error.into(),
        }
    }

    /// An error no retry will fix: the delivery becomes a dead letter now.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        Self {
            transient: false,
            error: error.into(),
        }
    }

    /// Whether the delivery should be retried.
    pub fn is_transient(&self) -> bool {
        self.transient
    }

    /// The underlying error.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }
}

impl<E: Into<BoxError>> From<E> for HandlerError {
    fn from(error: E) -> Self {
        Self::transient(error)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("transient", &self.transient)
            .field("error", &self.error)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.transient {
            "transient"
        } else {
            "permanent"
        };
        write!(f, "{kind} error: {}", self.error)
    }
}
