//! What the relay needs from the database, whichever database it is.
//!
//! A store keeps two kinds of rows:
//!
//! - **events**, one per published event. A new event is *pending* until the relay has handed it
//!   to every subscriber routed to it; it is then *published*. An event that cannot be read at all
//!   (a payload that does not decode) is *dead*; one this build cannot read yet (a newer version, an
//!   unknown event type) is *parked* and looked at again later.
//! - **deliveries**, one per (subscriber, event) that did not succeed on the first pass: the
//!   subscriber failed, or it was still held up by an earlier event of the same aggregate. Each has
//!   its own attempt count, last error, next attempt time and dead-letter mark, and is deleted
//!   once delivered.
//!
//! The relay claims a batch of both ([`Store::claim`]), runs the handlers outside any database
//! transaction, and records what happened in one call ([`Store::record`]).

use std::future::Future;
use std::time::Duration;

use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::StoreError;

/// An event as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    /// The store's id; ids grow in publishing order.
    pub id: i64,
    /// [`OutboxEvent::AGGREGATE_TYPE`](crate::OutboxEvent::AGGREGATE_TYPE) of the event.
    pub aggregate_type: String,
    /// [`OutboxEvent::aggregate_id`](crate::OutboxEvent::aggregate_id) of the event.
    pub aggregate_id: Uuid,
    /// [`OutboxEvent::EVENT_TYPE`](crate::OutboxEvent::EVENT_TYPE) of the event.
    pub event_type: String,
    /// The envelope, as [`encode`](crate::encode) wrote it.
    pub payload: String,
    /// When the event happened, or when it was published if the event did not say.
    pub occurred_at: OffsetDateTime,
}

/// One unit of work handed to a relay.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// A pending event, to be handed to every subscriber routed to it.
    Event {
        /// The event.
        event: StoredEvent,
        /// How many times it was parked before.
        parked: u32,
        /// Subscribers that still hold an undelivered earlier event of the same aggregate: they
        /// must not get this one before that one.
        blocked: Vec<String>,
    },
    /// One subscriber's pending delivery: a retry, or an event that waited behind an earlier one.
    Delivery {
        /// The event.
        event: StoredEvent,
        /// The subscriber.
        subscriber: String,
        /// Failed attempts so far.
        attempts: u32,
    },
}

impl Claim {
    /// The event claimed.
    pub fn event(&self) -> &StoredEvent {
        match self {
            Claim::Event { event, .. } | Claim::Delivery { event, .. } => event,
        }
    }

    /// The order a store returns claims in: by event id, an event before its deliveries.
    pub fn order_key(&self) -> (i64, Option<&str>) {
        match self {
            Claim::Event { event, .. } => (event.id, None),
            Claim::Delivery {
                event, subscriber, ..
            } => (event.id, Some(subscriber)),
        }
    }
}

/// What became of a claimed event.
#[derive(Debug, Clone, PartialEq)]
pub enum EventOutcome {
    /// Every subscriber handled it, or holds it as a delivery of its own.
    Published,
    /// This build cannot read it yet; look again after `retry_in`.
    Parked {
        /// Why.
        reason: String,
        /// When to look again.
        retry_in: Duration,
    },
    /// It can never be read: an operator must act.
    Dead {
        /// Why.
        reason: String,
    },
    /// Not processed in this batch; give the claim back.
    Released,
}

/// What became of one subscriber's delivery of an event.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryOutcome {
    /// The subscriber handled it: the delivery is done.
    Delivered,
    /// Not attempted: an earlier event of the same aggregate is still pending for this subscriber.
    Waiting,
    /// Attempt it again after `retry_in`.
    Retry {
        /// Failed attempts so far, this one included.
        attempts: u32,
        /// The last error.
        error: String,
        /// When to attempt it again.
        retry_in: Duration,
    },
    /// Give up until an operator requeues it.
    Dead {
        /// Failed attempts so far, this one included.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// Not processed in this batch; give the claim back.
    Released,
}

/// Everything a batch did, recorded by the store in one go.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcomes {
    /// Outcomes of claimed events, by event id.
    pub events: Vec<(i64, EventOutcome)>,
    /// Outcomes of deliveries: of claimed deliveries, and new ones for subscribers of a claimed
    /// event that failed or had to wait.
    pub deliveries: Vec<DeliveryRecord>,
}

/// One delivery outcome with the keys that identify it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryRecord {
    /// The event.
    pub event_id: i64,
    /// Its aggregate, which orders the subscriber's deliveries.
    pub aggregate_id: Uuid,
    /// The subscriber.
    pub subscriber: String,
    /// What happened.
    pub outcome: DeliveryOutcome,
}

impl Outcomes {
    /// Whether there is nothing to record.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty() && self.deliveries.is_empty()
    }
}

/// Which dead or parked work to hand back to the relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requeue {
    /// The dead or parked events with these ids, and every dead delivery of them.
    Events(Vec<i64>),
    /// Every dead delivery of this subscriber.
    Subscriber(String),
}

/// What a store holds that is not done: the figures behind the relay's gauges and the
/// operators' `status`.
///
/// ```
/// use outbox_core::store::Status;
///
/// let status = Status::default();
/// assert!(status.is_settled());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Status {
    /// Events not yet handed to all their subscribers (parked ones included), dead ones excluded.
    pub pending_events: u64,
    /// Subscribers' deliveries waiting for a retry or behind an earlier event, dead ones excluded.
    pub pending_deliveries: u64,
    /// Dead events and dead deliveries: they wait for an operator.
    pub dead_letters: u64,
    /// How long ago the oldest pending event occurred (by its `occurred_at`); `None` when no
    /// event is pending.
    pub oldest_pending_age: Option<Duration>,
    /// (subscriber, aggregate) pairs with an undelivered delivery, dead or not: later events of
    /// that aggregate wait for that subscriber.
    pub blocked_keys: u64,
}

impl Status {
    /// Whether the relay has nothing left to do but dead letters.
    pub fn is_settled(&self) -> bool {
        self.pending_events == 0 && self.pending_deliveries == 0
    }
}

/// The relay's view of a database: claim work, record what happened, requeue dead letters.
///
/// Implemented by the PostgreSQL and SQLite stores of `outbox-sqlx`.
pub trait Store: Send + Sync + 'static {
    /// Claims up to `limit` pending events and up to `limit` due deliveries for `lease`.
    ///
    /// A store must return only work that is due and not dead, claimed by nobody else (or whose
    /// claim expired), and whose aggregate has no earlier unfinished work elsewhere: pending
    /// events whose aggregate has no earlier pending event outside this batch, and deliveries
    /// that are the earliest undelivered one of their (subscriber, aggregate). Claims come in
    /// event id order.
    fn claim(
        &self,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send;

    /// Records the outcomes of a batch, atomically.
    fn record(&self, outcomes: &Outcomes) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Hands dead letters (and parked events) back to the relay; returns how many rows changed.
    fn requeue(&self, which: &Requeue) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts what is not done.
    fn status(&self) -> impl Future<Output = Result<Status, StoreError>> + Send;

    /// Deletes at most `limit` events published more than `older_than` ago, oldest first, and
    /// returns how many went. Never deletes a dead letter, an event not yet published, or one
    /// some subscriber has not received yet.
    fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Resolves when new work may have arrived, such as after a commit in this process. The relay
    /// also polls, so a store without such a signal may never resolve.
    fn notified(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}
