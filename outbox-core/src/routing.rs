//! Routing: which subscribers take an event, and how to hand it to each.
//!
//! Applications declare subscribers with `#[subscriber(events = [...])]` and their router with
//! `#[router(events = [...])]`; see the [routing guide](crate::routing_guide). The traits here are
//! what those macros implement and what the relay calls.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::catalog::Catalog;
use crate::envelope::{Metadata, RawEnvelope};
use crate::error::DecodeError;
use crate::event::{BoxError, OutboxEvent};
use crate::store::{ClaimToken, StoredEvent};

/// The application's routing table, as the relay sees it.
///
/// `#[router(events = [...])]` implements it; see the [routing guide](crate::routing_guide).
/// The relay asks for the subscribers of an event type, decodes the event once with
/// [`decode`](Router::decode), then calls [`deliver`](Router::deliver) for each subscriber in
/// the order [`subscribers`](Router::subscribers) gives.
pub trait Router: Send + Sync + 'static {
    /// The subscribers that take `event_type` (a current name, or one declared in `formerly`), in
    /// delivery order, or `None` when this build does not know the event type (the relay parks
    /// such events until a build that knows it runs).
    fn subscribers(&self, event_type: &str) -> Option<&[&'static str]>;

    /// Decodes a stored event into its concrete type.
    fn decode(&self, event: &StoredEvent) -> Result<Decoded, DecodeError>;

    /// The name a subscriber of this router has now, for a name `stored` with a delivery: its
    /// current name or one it had before a declared rename. `None` when no subscriber of this
    /// build has or had that name.
    fn current_subscriber(&self, stored: &str) -> Option<&'static str>;

    /// The router's catalog: its events, their versions and schemas, its subscribers and
    /// routes, as a value (rendered as JSON or AsyncAPI by [`Catalog`]).
    fn catalog() -> Catalog
    where
        Self: Sized;

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
    pub fn downcast_ref<E: Any>(&self) -> Option<&E> {
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

/// What a handler knows about the delivery it is running: the stored event, its metadata, which
/// attempt this is, and the claim it runs under.
///
/// # Fencing a handler's own writes
///
/// Delivery is at least once, and ordered per (subscriber, aggregate) as long as relays are
/// healthy. A relay whose process stalls *inside* a handler (a pause, a blocked thread) past its
/// lease loses its claim to another relay, which delivers the event and its successors again;
/// when the stalled handler resumes, its late effect can land after the new owner's. The relay
/// records nothing of a lost claim and starts no further handler for it, but it cannot recall a
/// call already under way. A handler that writes to the outbox's own database can exclude even
/// that: in the transaction of its write, it locks the claim it runs under, and writes only if
/// the claim is still live. `outbox-sqlx` does this for you: `Outbox::hold_claim`.
#[derive(Debug)]
pub struct Delivery<'a> {
    pub(crate) event: &'a StoredEvent,
    pub(crate) metadata: &'a Metadata,
    pub(crate) subscriber: &'a str,
    pub(crate) attempt: u32,
    pub(crate) claim: Option<ClaimToken>,
    pub(crate) expired_claims: u32,
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
            claim: None,
            expired_claims: 0,
        }
    }

    /// This delivery, running under the claim `token`, after `expired_claims` earlier claims of
    /// it expired unrecorded.
    #[must_use]
    pub fn with_claim(mut self, token: ClaimToken, expired_claims: u32) -> Self {
        self.claim = Some(token);
        self.expired_claims = expired_claims;
        self
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

    /// Which attempt this is, from 1: failed attempts so far, plus one. A redelivery after an
    /// expired claim is not a failed attempt; see [`expired_claims`](Self::expired_claims).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The claim this delivery runs under; `None` outside a relay (as in the test kit's
    /// `TestDelivery`). See [fencing](Self#fencing-a-handlers-own-writes).
    pub fn claim_token(&self) -> Option<ClaimToken> {
        self.claim
    }

    /// How many earlier claims of this event (for this subscriber) expired before their
    /// outcomes were recorded: their relay died or stalled, maybe after calling this handler.
    pub fn expired_claims(&self) -> u32 {
        self.expired_claims
    }

    /// Whether this handler may have been called for this event before: an earlier attempt
    /// failed (its effect may have happened anyway, as with a timeout), or an earlier claim of
    /// it expired unrecorded. An idempotent handler need not care; one that counts or charges
    /// can check.
    pub fn is_redelivery(&self) -> bool {
        self.attempt > 1 || self.expired_claims > 0
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

    /// The error as a boxed `std::error::Error`, its message saying whether it is transient: for
    /// `?` in a function returning `Box<dyn Error>`, such as a test. (`HandlerError` is not an
    /// `Error` itself: that is what lets any error convert into it.)
    pub fn into_error(self) -> BoxError {
        self.to_string().into()
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

/// The future a subscriber's delivery returns.
pub type DeliverFuture<'a> = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'a>>;

/// A subscriber: a type that takes the events listed in its `#[subscriber(events = [...])]`,
/// with a [`Handle`] impl for each.
///
/// Implemented by the attribute macro; see the [routing guide](crate::routing_guide).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a subscriber",
    label = "a router's field must be a subscriber or an `#[observer]`",
    note = "mark the type `#[subscriber(events = [...])]`, or mark the field `#[observer]` if it takes every event"
)]
pub trait Subscriber: Send + Sync + 'static {
    /// The name the subscriber's delivery state is stored under. To rename it, keep the old name
    /// in [`FORMERLY`](Self::FORMERLY) (`#[subscriber(name = "new", formerly = ["old"])]`), so
    /// that the deliveries stored under it still reach this subscriber.
    const NAME: &'static str;
    /// The names the subscriber's deliveries were stored under before a rename.
    const FORMERLY: &'static [&'static str] = &[];
    /// The event types it takes.
    const EVENTS: &'static [&'static str];

    /// Hands a decoded event to the matching [`Handle`] impl.
    fn deliver<'a>(&'a self, event: &'a Decoded, delivery: &'a Delivery<'a>) -> DeliverFuture<'a>;
}

/// How a subscriber handles one event type.
///
/// ```
/// use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, subscriber};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// # #[derive(Serialize, Deserialize, OutboxEvent)]
/// # #[outbox(aggregate_type = "bot")]
/// # struct BotInstalled { #[outbox(aggregate_id)] bot_id: Uuid }
///
/// #[subscriber(events = [BotInstalled])]
/// struct Licensing;
///
/// impl Handle<BotInstalled> for Licensing {
///     async fn handle(&self, event: &BotInstalled, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
///         if delivery.attempt() > 3 {
///             return Err(HandlerError::permanent(format!("bot {} keeps failing", event.bot_id)));
///         }
///         Ok(())
///     }
/// }
///
/// // A handler is a plain async method: call it directly in a unit test.
/// # use outbox_core::{Metadata, StoredEvent};
/// let event = BotInstalled { bot_id: Uuid::nil() };
/// let metadata = Metadata::new();
/// let stored = StoredEvent {
///     id: 1,
///     aggregate_type: "bot".into(),
///     aggregate_id: Uuid::nil(),
///     event_type: "BotInstalled".into(),
///     payload: outbox_core::encode(&event, &metadata)?,
///     occurred_at: time::OffsetDateTime::UNIX_EPOCH,
/// };
/// let delivery = Delivery::new(&stored, &metadata, "licensing", 1);
/// let runtime = tokio::runtime::Builder::new_current_thread().build()?;
/// assert!(runtime.block_on(Licensing.handle(&event, &delivery)).is_ok());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "subscriber `{Self}` takes `{E}` but does not handle it",
    label = "`{Self}` has no `Handle<{E}>` impl",
    note = "implement it: `impl Handle<{E}> for {Self} {{ async fn handle(&self, event: &{E}, delivery: &Delivery<'_>) -> Result<(), HandlerError> {{ ... }} }}`, or remove `{E}` from `events`"
)]
pub trait Handle<E>: Send + Sync {
    /// Handles one delivery of `event`. Deliveries are at least once: make it idempotent.
    fn handle(
        &self,
        event: &E,
        delivery: &Delivery<'_>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// A subscriber that takes every event of the catalog, undecoded, such as an audit log. It does
/// not count as routing: every catalog event still needs a [`Subscriber`].
///
/// ```
/// use outbox_core::{Delivery, HandlerError, Observer};
///
/// struct Audit;
///
/// impl Observer for Audit {
///     const NAME: &'static str = "audit";
///
///     async fn observe(&self, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
///         let stored = delivery.event();
///         println!("event {} ({}): {}", stored.id, stored.event_type, stored.payload);
///         Ok(())
///     }
/// }
/// # let _ = Audit;
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an observer",
    label = "an `#[observer]` field takes every event",
    note = "implement `Observer` for it: a `NAME` and `async fn observe(&self, delivery: &Delivery<'_>) -> Result<(), HandlerError>`"
)]
pub trait Observer: Send + Sync + 'static {
    /// The name the observer's delivery state is stored under.
    const NAME: &'static str;
    /// The names its deliveries were stored under before a rename.
    const FORMERLY: &'static [&'static str] = &[];

    /// Handles one delivery of any event; the raw event is `delivery.event()`.
    fn observe(
        &self,
        delivery: &Delivery<'_>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Marks that a router routes `E` to at least one subscriber. `#[router]` implements it for each
/// event of its catalog; publishing `E` in a transaction tied to the router requires it.
#[diagnostic::on_unimplemented(
    message = "`{E}` is not in the event catalog of router `{Self}`",
    label = "`{Self}` does not route `{E}`",
    note = "add `{E}` to `#[router(events = [...])]` of `{Self}` and to a subscriber's `events`: only events the router routes can be published or subscribed to"
)]
pub trait Routes<E> {}

/// Implemented for each event a router `R` routes: the bound on publishing `E` in a transaction
/// tied to `R`. It is [`Routes`] seen from the event's side, so that the compiler takes the event
/// type from the value published, and an unrouted event is reported as `R: Routes<E>`.
pub trait RoutedBy<R> {}

impl<E, R: Routes<E>> RoutedBy<R> for E {}

/// Marks the databases a router's application runs on: an outbox of another database cannot
/// deliver to its subscribers, nor run their effects in a transaction.
///
/// `#[router]` implements it for every database, or, with `#[router(database = ...)]`, for that
/// one only; a relay (`outbox_sqlx::Outbox::relay`) and a transactional handler
/// (`outbox_sqlx::Outbox::handle_once`) on an outbox of database `DB` require it. An
/// application that runs on one database names it, so that a subscriber holding an outbox of
/// another one does not compile.
#[diagnostic::on_unimplemented(
    message = "router `{Self}` does not run on the database `{DB}`",
    label = "an outbox on `{DB}`, for router `{Self}`",
    note = "`#[router(database = ...)]` of `{Self}` names the one database it runs on: use an outbox of that database here (`Outbox<that database, {Self}>`), or change `database`"
)]
pub trait RunsOn<DB> {}
