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
//! The relay claims a batch of both ([`Store::claim`]) under a lease with a token
//! ([`ClaimToken`]), runs the handlers outside any database transaction while renewing the lease
//! ([`Store::renew`]), and records what happened in one call ([`Store::record`]), which counts
//! only while the claim is still live. Events held back behind an earlier event of their
//! aggregate (dead, parked, or claimed by a relay that may have died) are *held*: they wait
//! without costing the claims of other aggregates' events anything.

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

/// The identity of one claim: the lease a relay holds over a batch of events and deliveries.
///
/// A store hands out a new token with every batch ([`Store::claim`]); renewals
/// ([`Store::renew`]) and outcomes ([`Store::record`]) name it, and the store applies them only
/// while that claim is still the live owner of its work: a relay that stalled past its lease and
/// lost the batch to another relay can record nothing over the other relay's work.
///
/// Handlers see the token of the claim they run under
/// ([`Delivery::claim_token`](crate::Delivery::claim_token)), so that a handler writing to the
/// outbox's own database can fence its writes the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimToken(i64);

impl ClaimToken {
    /// A token with the store's own id for the claim.
    pub fn new(id: i64) -> Self {
        Self(id)
    }

    /// The store's id for the claim (the id of its row in the `<table>_claims` table of the SQL
    /// stores).
    pub fn get(self) -> i64 {
        self.0
    }
}

impl std::fmt::Display for ClaimToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What one call of [`Store::claim`] returned: the work of one claim, under one token.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Batch {
    /// The claim's token. Meaningless when `claims` is empty: no claim was made then.
    pub token: ClaimToken,
    /// The claimed events and deliveries, in [`Claim::order_key`] order.
    pub claims: Vec<Claim>,
    /// The store set events aside this time (events held back behind an earlier event of their
    /// aggregate, which later claims need not look at again) and may find more work if asked
    /// again at once.
    pub more: bool,
    /// The version of the relay registry ([`Store::register`]) as the claim saw it: when it
    /// differs from the one a relay last registered with, another build came or went, and the
    /// relay reads the registry again before it fans this batch out. `None` for a store
    /// without a registry.
    pub registry: Option<String>,
    /// How long after the claim the earliest retry or parked event that was not due yet
    /// becomes due, or the earliest live claim expires (its work is free then, if its relay
    /// died), if the store knows (`None`: nothing waits for a time, or the store does not
    /// say). A relay that found no work wakes then, whoever recorded that retry or made that
    /// claim (another relay, or this one before it restarted), not only at its poll interval.
    pub next_due: Option<Duration>,
}

impl Batch {
    /// The claims of `token`.
    pub fn new(token: ClaimToken, claims: Vec<Claim>) -> Self {
        Self {
            token,
            claims,
            more: false,
            registry: None,
            next_due: None,
        }
    }

    /// No work.
    pub fn empty() -> Self {
        Self::new(ClaimToken(0), Vec::new())
    }

    /// Says whether the store may find more work if asked again at once.
    #[must_use]
    pub fn with_more(mut self, more: bool) -> Self {
        self.more = more;
        self
    }

    /// Says how long after the claim the earliest retry or parked event not due yet is due, or
    /// the earliest live claim expires.
    #[must_use]
    pub fn with_next_due(mut self, next_due: Option<Duration>) -> Self {
        self.next_due = next_due;
        self
    }

    /// Says which version of the relay registry the claim saw.
    #[must_use]
    pub fn with_registry(mut self, version: Option<String>) -> Self {
        self.registry = version;
        self
    }

    /// Whether nothing was claimed.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }
}

/// Whether [`Store::record`] applied a batch's outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Recorded {
    /// The claim was still live: its outcomes are recorded and the claim is over.
    Applied,
    /// The claim had expired (and its work may belong to another relay by now): nothing was
    /// recorded. The work is claimed and delivered again, which at-least-once allows.
    Lost,
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
        /// How many earlier claims of it expired before their outcomes were recorded: a relay
        /// may have handed it to some subscribers already.
        expired: u32,
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
        /// How many earlier claims of this delivery expired before their outcomes were recorded.
        expired: u32,
    },
    /// A stored event the store cannot read into a [`StoredEvent`] (a value written by other
    /// SQL that this build cannot map, such as a timestamp out of range): it is dead-lettered
    /// alone, with `reason`.
    Unreadable {
        /// The event's id.
        id: i64,
        /// The subscriber, when the claim was one subscriber's delivery of the event; `None`
        /// when it was the event itself.
        subscriber: Option<String>,
        /// Its aggregate, when that much could be read; `None` holds back every later event of
        /// the batch, since any of them could be of the same aggregate.
        aggregate: Option<(String, Uuid)>,
        /// What could not be read.
        reason: String,
    },
}

impl Claim {
    /// The event claimed, unless it could not be read.
    pub fn event(&self) -> Option<&StoredEvent> {
        match self {
            Claim::Event { event, .. } | Claim::Delivery { event, .. } => Some(event),
            Claim::Unreadable { .. } => None,
        }
    }

    /// The id of the event claimed.
    pub fn event_id(&self) -> i64 {
        match self {
            Claim::Event { event, .. } | Claim::Delivery { event, .. } => event.id,
            Claim::Unreadable { id, .. } => *id,
        }
    }

    /// The order a store returns claims in: by event id, an event before its deliveries.
    pub fn order_key(&self) -> (i64, Option<&str>) {
        match self {
            Claim::Event { event, .. } => (event.id, None),
            Claim::Unreadable { id, subscriber, .. } => (*id, subscriber.as_deref()),
            Claim::Delivery {
                event, subscriber, ..
            } => (event.id, Some(subscriber)),
        }
    }
}

/// How much one claim takes at most: a number of events and a number of bytes of their payloads,
/// and as much again of due deliveries (each counting its event's payload).
///
/// A claim takes work in order and stops at the first piece that would go over either limit,
/// except that it always takes its first piece, however large: an event bigger than the byte
/// limit is claimed alone, never left behind for ever. A store takes the limits through a
/// [`ClaimBudget`] for its events and another for its deliveries.
///
/// ```
/// use outbox_core::store::ClaimLimit;
///
/// let limit = ClaimLimit::new(2000, 1024);
/// let mut events = limit.budget();
/// assert!(events.take(4096), "the first piece always fits");
/// assert!(!events.take(1), "then the bytes are spent");
/// assert!(!events.take(0), "and nothing after the first refusal is taken");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimLimit {
    /// Events (and as many deliveries) at most.
    pub events: u32,
    /// Bytes of payload (the payload's JSON text, as stored) among the events, and as many
    /// among the deliveries, at most: the first piece of each is taken whatever its size.
    pub payload_bytes: u64,
}

impl ClaimLimit {
    /// At most `events` events and `payload_bytes` bytes of their payloads.
    pub const fn new(events: u32, payload_bytes: u64) -> Self {
        Self {
            events,
            payload_bytes,
        }
    }

    /// At most `events` events, whatever their size.
    pub const fn events(events: u32) -> Self {
        Self::new(events, u64::MAX)
    }

    /// A budget of this much, for a claim's events or for its deliveries.
    pub fn budget(self) -> ClaimBudget {
        ClaimBudget {
            limit: self,
            taken: 0,
            bytes: 0,
            full: false,
        }
    }
}

/// What is left of a [`ClaimLimit`] as a store takes work in order; once it refuses a piece it
/// refuses every later one, so that what a claim takes is a prefix of what it looked at (an
/// aggregate's later events never jump ahead of an earlier one left out).
#[derive(Debug, Clone)]
pub struct ClaimBudget {
    limit: ClaimLimit,
    taken: u32,
    bytes: u64,
    full: bool,
}

impl ClaimBudget {
    /// Whether the next piece, of `payload_bytes`, fits; if it does, it is counted.
    pub fn take(&mut self, payload_bytes: u64) -> bool {
        let bytes = self.bytes.saturating_add(payload_bytes);
        self.full = self.full
            || self.taken >= self.limit.events
            || (self.taken > 0 && bytes > self.limit.payload_bytes);
        if !self.full {
            self.taken += 1;
            self.bytes = bytes;
        }
        !self.full
    }
}

/// What a relay leaves to relays of other builds when it claims: the events of types, and the
/// deliveries of subscribers, that it cannot route but a live relay of another build can. An
/// event left so also holds back the later events of its aggregate from this claim.
///
/// ```
/// use outbox_core::store::ClaimFilter;
///
/// assert!(ClaimFilter::default().is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimFilter {
    /// Event types to leave pending.
    pub skip_event_types: Vec<String>,
    /// Subscribers whose deliveries to leave pending.
    pub skip_subscribers: Vec<String>,
    /// Aggregates of earlier claims of the same relay whose later events this claim may take
    /// although those claims still list them ([`Store::claims_take_over`]).
    pub take_over: Vec<TakeOver>,
}

impl ClaimFilter {
    /// Leaves `event_types` and the deliveries of `subscribers` to other relays.
    pub fn new(skip_event_types: Vec<String>, skip_subscribers: Vec<String>) -> Self {
        Self {
            skip_event_types,
            skip_subscribers,
            take_over: Vec::new(),
        }
    }

    /// The same filter, taking over the aggregates `take_over` names.
    #[must_use]
    pub fn taking_over(&self, take_over: Vec<TakeOver>) -> Self {
        Self {
            take_over,
            ..self.clone()
        }
    }

    /// Whether it leaves nothing.
    pub fn is_empty(&self) -> bool {
        self.skip_event_types.is_empty() && self.skip_subscribers.is_empty()
    }
}

/// Aggregates of claim `claim` that the relay hands on to its next claim: their work in it is
/// done and the record that says so under way, or their handler calls still run. A store that
/// [takes them over](Store::claims_take_over) treats them, in that claim, as if it were over:
/// their later events may be claimed at once (so that a relay need not wait for a record, or
/// for the slowest key of a batch, to claim an aggregate's next events). The relay starts no
/// handler of those events until the record of the claim's work on the aggregate is applied,
/// and gives them back if it is not, or if that work did not end clean (a failure left a
/// delivery behind, an event was parked or dead-lettered), so their order holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TakeOver {
    /// The earlier claim.
    pub claim: ClaimToken,
    /// Its aggregates taken over: (type, id). Empty when it is taken over `whole`.
    pub aggregates: Vec<(String, Uuid)>,
    /// Whether every aggregate the claim lists is taken over (then none is named: a batch's
    /// worth of names would cost the claim more than the rest of its filter).
    pub whole: bool,
}

impl TakeOver {
    /// `aggregates` of `claim`, taken over.
    pub fn new(claim: ClaimToken, aggregates: Vec<(String, Uuid)>) -> Self {
        Self {
            claim,
            aggregates,
            whole: false,
        }
    }

    /// Every aggregate `claim` lists, taken over.
    pub fn whole(claim: ClaimToken) -> Self {
        Self {
            claim,
            aggregates: Vec::new(),
            whole: true,
        }
    }
}

/// How long a relay's registration ([`Store::register`]) lasts unrenewed: a relay that died
/// stops counting for the others after this. A running relay renews it every 10 seconds.
pub const REGISTRATION_TTL: Duration = Duration::from_secs(30);

/// The relays registered in a store ([`Store::register`]): one entry per live relay, with the
/// routing its build declared, and the registry's version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Registry {
    /// Changes whenever a relay registers anew or leaves (it is compared, not interpreted).
    pub version: String,
    /// (relay id, its routing as JSON), the registering relay's own included.
    pub relays: Vec<(Uuid, String)>,
}

impl Registry {
    /// A registry of `relays` at `version`.
    pub fn new(version: String, relays: Vec<(Uuid, String)>) -> Self {
        Self { version, relays }
    }

    /// Every event type a live relay routes, by any of its names (current and former).
    pub fn event_types(&self) -> std::collections::BTreeSet<String> {
        self.names("events", "type")
    }

    /// Every subscriber a live relay has, by any of its names (current and former).
    pub fn subscribers(&self) -> std::collections::BTreeSet<String> {
        self.names("subscribers", "name")
    }

    fn names(&self, list: &str, current: &str) -> std::collections::BTreeSet<String> {
        let mut out = std::collections::BTreeSet::new();
        for (_, routing) in &self.relays {
            let Ok(routing) = serde_json::from_str::<serde_json::Value>(routing) else {
                continue;
            };
            for entry in routing[list].as_array().into_iter().flatten() {
                let formerly = entry["formerly"].as_array().into_iter().flatten();
                for name in std::iter::once(&entry[current]).chain(formerly) {
                    if let Some(name) = name.as_str() {
                        out.insert(name.to_owned());
                    }
                }
            }
        }
        out
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
    /// Not attempted: an earlier event of the same aggregate is still pending for this subscriber,
    /// or the batch's lease ran short before this handler could start. Due at once, no attempt
    /// counted.
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
    /// The type of its aggregate: with `aggregate_id`, the key that orders the subscriber's
    /// deliveries.
    pub aggregate_type: String,
    /// Its aggregate.
    pub aggregate_id: Uuid,
    /// The subscriber.
    pub subscriber: String,
    /// What happened.
    pub outcome: DeliveryOutcome,
}

impl DeliveryRecord {
    /// The (subscriber, aggregate type, aggregate id) key that orders the delivery.
    pub fn key(&self) -> (&str, &str, Uuid) {
        (&self.subscriber, &self.aggregate_type, self.aggregate_id)
    }
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
    /// One failure group, as operators see dead letters grouped (`outbox dead-letters groups`):
    /// the dead deliveries of `subscriber` whose last error's first line is `first_line`; with
    /// no subscriber, the dead events whose error's first line it is (and every dead delivery
    /// of them). After a fix for one bad deploy, its failures go back and nothing else does.
    Failure {
        /// The subscriber; `None` for events that could not be decoded.
        subscriber: Option<String>,
        /// The first line of the last error, exactly.
        first_line: String,
    },
}

impl Requeue {
    /// The first line of `error` as failure groups compare it (up to the first `\n`; empty for
    /// no error).
    pub fn first_line(error: Option<&str>) -> &str {
        error.unwrap_or("").split('\n').next().unwrap_or("")
    }
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
    /// Relays registered and live ([`Store::register`]); 0 when none runs (or the store keeps
    /// no registry), and then `unroutable_*` are 0 too: nothing says what could be routed.
    pub live_relays: u64,
    /// Pending events (dead ones excluded) whose event type no live relay routes: they wait
    /// for a build that knows them (included in `pending_events`).
    pub unroutable_events: u64,
    /// Pending deliveries (dead ones excluded) to subscribers no live relay has (included in
    /// `pending_deliveries`).
    pub unroutable_deliveries: u64,
    /// How long ago the oldest unroutable event occurred, or the oldest unroutable delivery's
    /// event; `None` when there is none.
    pub oldest_unroutable_age: Option<Duration>,
    /// Dead events and dead deliveries: they wait for an operator.
    pub dead_letters: u64,
    /// How long ago the oldest pending event occurred (by its `occurred_at`); `None` when no
    /// event is pending.
    pub oldest_pending_age: Option<Duration>,
    /// (subscriber, aggregate) pairs with an undelivered delivery, dead or not: later events of
    /// that aggregate wait for that subscriber.
    pub blocked_keys: u64,
    /// Aggregates held back for every subscriber: they have a dead or parked event, or events
    /// set aside behind one (or behind a claim that has lasted, such as that of a relay that
    /// died). Their later events wait; other aggregates' events flow.
    pub blocked_aggregates: u64,
    /// Events set aside behind an earlier event of their aggregate (included in
    /// `pending_events`).
    pub held_events: u64,
    /// Pending events and deliveries (included in `pending_events` and
    /// `pending_deliveries`) that wait behind a dead letter: events of an aggregate after its
    /// first dead event (once a claim has met them and set them aside), deliveries of a
    /// (subscriber, aggregate) key after its first dead one. Only an operator moves them
    /// (requeue or skip the dead letter).
    pub behind_dead_letters: u64,
}

impl Status {
    /// Whether the relay has nothing left to do: what is not done is dead letters and what
    /// waits behind them ([`behind_dead_letters`](Self::behind_dead_letters)), which only an
    /// operator moves. Parked events (waiting for a build that can read them) and deliveries
    /// waiting for a retry are work left to do: not settled.
    pub fn is_settled(&self) -> bool {
        self.pending_events + self.pending_deliveries <= self.behind_dead_letters
    }

    /// Whether nothing at all is left: no pending work and no dead letter.
    pub fn is_empty(&self) -> bool {
        self.pending_events == 0 && self.pending_deliveries == 0 && self.dead_letters == 0
    }
}

/// What one [`Store::purge_published`] call did.
///
/// ```
/// use outbox_core::store::Purged;
///
/// let purged = Purged::new(3, false);
/// assert_eq!((purged.deleted, purged.more), (3, false));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Purged {
    /// Events deleted.
    pub deleted: u64,
    /// Old events are left to look at: the call stopped at its limit.
    pub more: bool,
}

impl Purged {
    /// `deleted` events went; `more` when old events are left to look at.
    pub fn new(deleted: u64, more: bool) -> Self {
        Self { deleted, more }
    }
}

/// The longest delay a store is asked to hold as a time from now (a retry, a park, a lease, a
/// retention window): 1000 years, which every backend stores (MySQL's `DATETIME` ends in the
/// year 9999), also twice over, with the most jitter. The relay's settings stop there; a store
/// given a longer one treats it as this long.
pub const LONGEST_DELAY: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// The relay's view of a database: claim work, renew and record claims, requeue dead letters.
///
/// Implemented by the PostgreSQL and SQLite stores of `outbox-sqlx` and by the test kit's
/// `MemoryStore`, which is the reference: `tests/tests/interleavings.rs` checks all three
/// against the same scenarios.
///
/// An aggregate is identified by its type *and* id: two aggregates of different types that share
/// an id are independent.
pub trait Store: Send + Sync + 'static {
    /// Claims pending events and due deliveries, each up to `limit` ([`ClaimLimit`]: so many,
    /// and so many bytes of payload), for `lease`, under a new [`ClaimToken`]. The lease runs
    /// from when the store grants the claim.
    ///
    /// A store must return only work that is due and not dead, claimed by no live claim, and
    /// whose aggregate has no earlier unfinished work elsewhere: pending events whose aggregate
    /// has no earlier unpublished event outside this batch, and deliveries that are the earliest
    /// undelivered one of their (subscriber, aggregate). Events held back that way must cost a
    /// claim a bounded amount of work and must never hide other aggregates' events. Claims come
    /// in event id order.
    ///
    /// What `filter` names stays pending, unclaimed, for relays of other builds: events of its
    /// types (and the later events of their aggregates), deliveries of its subscribers.
    fn claim(
        &self,
        limit: ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> impl Future<Output = Result<Batch, StoreError>> + Send;

    /// Registers (or keeps registered) relay `relay` with its build's `routing` (JSON, as the
    /// relay writes it), ends the registrations not renewed within `ttl`, and returns the live
    /// ones. Relays of different builds (a rolling deploy) learn from it what the others route.
    /// A store without a registry returns an empty one: each relay acts as the only build.
    ///
    /// A registration that brings a build no live relay runs (the relay's first, with a
    /// routing no live relay has) makes the parked events due at once: the new build may read
    /// what was parked for want of it (an event type, a newer payload version), and should not
    /// wait for the end of each park.
    fn register(
        &self,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Registry, StoreError>> + Send {
        let _ = (relay, routing, ttl);
        async { Ok(Registry::default()) }
    }

    /// Ends the registration of relay `relay` (a relay shutting down).
    fn unregister(&self, relay: Uuid) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = relay;
        async { Ok(()) }
    }

    /// Extends the claim `token` to `lease` from now, if it is still live; false when it is
    /// not (it expired, and its work may belong to another claim by now).
    fn renew(
        &self,
        token: ClaimToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Records the outcomes of the batch claimed as `token`, atomically, and ends the claim;
    /// records nothing and returns [`Recorded::Lost`] when the claim is no longer live.
    fn record(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> impl Future<Output = Result<Recorded, StoreError>> + Send;

    /// Records the outcomes of part of the batch claimed as `token`, atomically, and keeps the
    /// claim live for the rest: the events named in `outcomes.events` (whatever their outcome)
    /// leave the claim, so later events of their aggregates can be claimed again, as do the
    /// deliveries named in `outcomes.deliveries`; everything else stays claimed under `token`
    /// until a later `record_part` or [`record`](Self::record). Records nothing and returns
    /// [`Recorded::Lost`] when the claim is no longer live.
    ///
    /// The relay records part of a batch when what is left of it only waits (keys waiting for
    /// a retry in place), and only for whole aggregates: every claim of an aggregate in the
    /// batch is in the same part. Called only when [`records_parts`](Self::records_parts) says
    /// the store can; the default says it cannot.
    fn record_part(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> impl Future<Output = Result<Recorded, StoreError>> + Send {
        let _ = (token, outcomes);
        async { Err(StoreError::new("this store cannot record part of a claim")) }
    }

    /// Whether [`record_part`](Self::record_part) is implemented; false by default (the relay
    /// then records each batch whole, when its last call is done).
    fn records_parts(&self) -> bool {
        false
    }

    /// Whether [`claim`](Self::claim) honours [`ClaimFilter::take_over`] (the aggregates each
    /// [`TakeOver`] names, or every aggregate of a claim it names [`whole`](TakeOver::whole));
    /// false by default (the filter's aggregates then stay held until the record of their
    /// claim ends, which is correct too).
    fn claims_take_over(&self) -> bool {
        false
    }

    /// Hands dead letters (and parked events) back to the relay; returns how many rows changed.
    fn requeue(&self, which: &Requeue) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts what is not done.
    fn status(&self) -> impl Future<Output = Result<Status, StoreError>> + Send;

    /// Looks at up to `limit` of the events published more than `older_than` ago, oldest first,
    /// and deletes those no subscriber still needs. Never deletes a dead letter, an event not
    /// yet published, or one some subscriber has not received yet.
    ///
    /// Each call reads about `limit` events, not the whole retained table: a store may go on
    /// where its previous call stopped, past events it had to keep. [`Purged::more`] says
    /// whether old events are left to look at (call again at once).
    ///
    /// A store may delete other records it keeps for the same window in the same call (the
    /// sqlx stores delete old inbox records too), counted in [`Purged::deleted`].
    fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<Purged, StoreError>> + Send;

    /// Resolves when new work may have arrived, such as after a commit in this process. The relay
    /// also polls, so a store without such a signal may never resolve.
    fn notified(&self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}
