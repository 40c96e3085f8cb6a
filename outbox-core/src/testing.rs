//! A test kit for code that publishes and handles events, with no database (feature `testing`).
//!
//! - [`RecordingPublisher`] implements the [`Publish`] port: hand it to a domain service and assert
//!   what the service published.
//! - [`TestDelivery`] hands one event to one subscriber or observer, or through a whole router,
//!   once or twice: test a handler alone, and prove it idempotent.
//! - [`MemoryStore`] is a [`Store`] in memory with a [`ManualClock`]; [`drain`] runs a relay over
//!   it until nothing is due, so retry schedules are tested by moving the clock, not by waiting.
//! - [`check_catalog`] checks the router's event types, payload versions and subscriber names
//!   against a committed snapshot, so that a change that would break stored events fails a test
//!   instead of production.
//!
//! ```
//! use outbox_core::testing::{MemoryStore, RecordingPublisher, TestDelivery, drain};
//! use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, Publish, PublishError, Relay, RelayConfig, router, subscriber};
//! use serde::{Deserialize, Serialize};
//! use uuid::Uuid;
//!
//! #[derive(Debug, PartialEq, Serialize, Deserialize, OutboxEvent)]
//! #[outbox(aggregate_type = "subscription")]
//! struct SubscriptionStarted {
//!     #[outbox(aggregate_id)]
//!     subscription_id: Uuid,
//! }
//!
//! // The domain service, written against the port.
//! async fn start(events: &mut impl Publish<SubscriptionStarted>, id: Uuid) -> Result<(), PublishError> {
//!     events.publish(&SubscriptionStarted { subscription_id: id }).await
//! }
//!
//! #[subscriber(events = [SubscriptionStarted])]
//! struct Licensing;
//!
//! impl Handle<SubscriptionStarted> for Licensing {
//!     async fn handle(&self, _: &SubscriptionStarted, _: &Delivery<'_>) -> Result<(), HandlerError> {
//!         Ok(())
//!     }
//! }
//!
//! #[router(events = [SubscriptionStarted])]
//! struct App {
//!     licensing: Licensing,
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let id = Uuid::nil();
//! let mut publisher = RecordingPublisher::new();
//! start(&mut publisher, id).await?;
//! assert_eq!(publisher.events::<SubscriptionStarted>(), [SubscriptionStarted { subscription_id: id }]);
//!
//! // The handler alone, delivered twice: it must be idempotent.
//! TestDelivery::of(&SubscriptionStarted { subscription_id: id })
//!     .twice_to(&Licensing)
//!     .await
//!     .map_err(HandlerError::into_error)?;
//!
//! // The whole flow, in memory.
//! let store = MemoryStore::new();
//! store.commit(publisher);
//! let relay = Relay::new(store.clone(), App { licensing: Licensing }, RelayConfig::default())?;
//! let report = drain(&relay).await?;
//! assert_eq!(report.delivered, 1);
//! assert_eq!(store.pending(), 0);
//! # Ok::<(), outbox_core::BoxError>(())
//! # }).unwrap();
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::envelope::{Metadata, decode, encode};
use crate::error::{EncodeError, PublishError, StoreError};
use crate::event::OutboxEvent;
use crate::publish::Publish;
use crate::relay::{BatchReport, Relay};
use crate::routing::{Decoded, Delivery, HandlerError, Observer, Router, Subscriber};
use crate::store::{
    self, Batch, Claim, ClaimFilter, ClaimLimit, ClaimToken, DeliveryOutcome, EventOutcome,
    Outcomes, Purged, Registry, Requeue, Status, Store, StoredEvent,
};

/// One event a [`RecordingPublisher`] was given, encoded as the outbox would store it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The event type.
    pub event_type: &'static str,
    /// The aggregate type.
    pub aggregate_type: &'static str,
    /// The aggregate id.
    pub aggregate_id: Uuid,
    /// The encoded envelope.
    pub payload: String,
    /// The event's own `occurred_at`, if it has one.
    pub occurred_at: Option<OffsetDateTime>,
}

/// A publisher that records what it is given, for unit tests of domain services.
///
/// It implements [`Publish<E>`] for every event, encodes each event as the outbox would (so an
/// event that cannot be encoded fails here too), and decodes them back on request.
#[derive(Debug, Default, Clone)]
pub struct RecordingPublisher {
    records: Vec<Recorded>,
    metadata: Metadata,
}

impl RecordingPublisher {
    /// An empty publisher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the metadata `publish` and `publish_all` use, as a transaction's would.
    pub fn set_metadata(&mut self, metadata: Metadata) {
        self.metadata = metadata;
    }

    /// Everything published, in order.
    pub fn records(&self) -> &[Recorded] {
        &self.records
    }

    /// The event types published, in order.
    pub fn event_types(&self) -> Vec<&'static str> {
        self.records.iter().map(|r| r.event_type).collect()
    }

    /// The published events of type `E`, decoded from their payloads, in order.
    ///
    /// # Panics
    ///
    /// If a recorded `E` does not decode: it was encoded by this publisher, so that is a bug in
    /// the event's serde implementation, which the test should show.
    pub fn events<E: OutboxEvent>(&self) -> Vec<E> {
        self.records
            .iter()
            .filter(|r| r.event_type == E::EVENT_TYPE)
            .map(|r| match decode::<E>(&r.payload) {
                Ok(envelope) => envelope.event,
                Err(error) => panic!("a recorded `{}` does not decode: {error}", E::EVENT_TYPE),
            })
            .collect()
    }

    /// How many events were published.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether nothing was published.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    fn record<E: OutboxEvent>(
        &mut self,
        event: &E,
        metadata: &Metadata,
    ) -> Result<(), EncodeError> {
        #[cfg(feature = "opentelemetry")]
        let metadata = &metadata.clone().with_current_trace_context();
        self.records.push(Recorded {
            event_type: E::EVENT_TYPE,
            aggregate_type: E::AGGREGATE_TYPE,
            aggregate_id: event.aggregate_id(),
            payload: encode(event, metadata)?,
            occurred_at: event.occurred_at(),
        });
        Ok(())
    }
}

impl<E: OutboxEvent> Publish<E> for RecordingPublisher {
    async fn publish(&mut self, event: &E) -> Result<(), PublishError> {
        let metadata = self.metadata.clone();
        Ok(self.record(event, &metadata)?)
    }

    async fn publish_with(&mut self, event: &E, metadata: &Metadata) -> Result<(), PublishError> {
        Ok(self.record(event, metadata)?)
    }

    async fn publish_all<'e>(
        &mut self,
        events: impl IntoIterator<Item = &'e E> + Send,
    ) -> Result<(), PublishError>
    where
        E: 'e,
    {
        let metadata = self.metadata.clone();
        for event in events {
            self.record(event, &metadata)?;
        }
        Ok(())
    }
}

/// One event, stored and decoded as the relay would have it, ready to hand to a subscriber.
#[derive(Debug)]
pub struct TestDelivery {
    stored: StoredEvent,
    decoded: Decoded,
    attempt: u32,
}

impl TestDelivery {
    /// `event` as stored event 1, with empty metadata, on its first attempt.
    ///
    /// # Panics
    ///
    /// If the event cannot be encoded or decoded: the test should show that first.
    pub fn of<E: OutboxEvent>(event: &E) -> Self {
        Self::with_metadata(event, &Metadata::new())
    }

    /// `event` as stored event 1 with `metadata`, on its first attempt.
    ///
    /// # Panics
    ///
    /// If the event cannot be encoded or decoded.
    pub fn with_metadata<E: OutboxEvent>(event: &E, metadata: &Metadata) -> Self {
        let payload = encode(event, metadata)
            .unwrap_or_else(|e| panic!("the test event does not encode: {e}"));
        let stored = StoredEvent {
            id: 1,
            aggregate_type: E::AGGREGATE_TYPE.to_owned(),
            aggregate_id: event.aggregate_id(),
            event_type: E::EVENT_TYPE.to_owned(),
            payload,
            occurred_at: event.occurred_at().unwrap_or_else(OffsetDateTime::now_utc),
        };
        let decoded = Decoded::decode::<E>(&stored)
            .unwrap_or_else(|e| panic!("the test event does not decode: {e}"));
        Self {
            stored,
            decoded,
            attempt: 1,
        }
    }

    /// Sets the stored event's id (handlers that key on it, such as an audit log, see it).
    #[must_use]
    pub fn id(mut self, id: i64) -> Self {
        self.stored.id = id;
        self
    }

    /// Sets which attempt this is, from 1.
    #[must_use]
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt;
        self
    }

    /// The stored event.
    pub fn stored(&self) -> &StoredEvent {
        &self.stored
    }

    /// Hands the event to `subscriber`, as the relay would.
    pub async fn to<S: Subscriber>(&self, subscriber: &S) -> Result<(), HandlerError> {
        let delivery = Delivery::new(&self.stored, self.decoded.metadata(), S::NAME, self.attempt);
        subscriber.deliver(&self.decoded, &delivery).await
    }

    /// Hands the event to `subscriber` twice, the second time as a redelivery of the same event:
    /// at-least-once delivery does that, so a handler must give the same result.
    pub async fn twice_to<S: Subscriber>(&self, subscriber: &S) -> Result<(), HandlerError> {
        self.to(subscriber).await?;
        let again = Delivery::new(
            &self.stored,
            self.decoded.metadata(),
            S::NAME,
            self.attempt.saturating_add(1),
        );
        subscriber.deliver(&self.decoded, &again).await
    }

    /// Hands the event to every subscriber `router` routes it to, in the router's order, as the
    /// relay's first pass would; stops at the first error.
    pub async fn through<R: Router>(&self, router: &R) -> Result<(), HandlerError> {
        let subscribers = router.subscribers(&self.stored.event_type).ok_or_else(|| {
            HandlerError::permanent(format!(
                "the router does not route event type `{}`",
                self.stored.event_type
            ))
        })?;
        for &subscriber in subscribers {
            let delivery = Delivery::new(
                &self.stored,
                self.decoded.metadata(),
                subscriber,
                self.attempt,
            );
            router.deliver(subscriber, &self.decoded, &delivery).await?;
        }
        Ok(())
    }

    /// Hands the event to `observer`.
    pub async fn to_observer<O: Observer>(&self, observer: &O) -> Result<(), HandlerError> {
        let delivery = Delivery::new(&self.stored, self.decoded.metadata(), O::NAME, self.attempt);
        observer.observe(&delivery).await
    }
}

/// A clock that moves only when told: the time of a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<OffsetDateTime>>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::starting_at(OffsetDateTime::now_utc())
    }
}

impl ManualClock {
    /// A clock at `time`.
    pub fn starting_at(time: OffsetDateTime) -> Self {
        Self {
            now: Arc::new(Mutex::new(time)),
        }
    }

    /// The clock's time.
    pub fn now(&self) -> OffsetDateTime {
        *lock(&self.now)
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let mut now = lock(&self.now);
        *now = now.saturating_add(time::Duration::try_from(by).unwrap_or(time::Duration::MAX));
    }
}

/// Hands the dead or parked events `ids` back, with every dead delivery of them.
fn requeue_events(
    state: &mut State,
    ids: &[i64],
    reset: impl Fn(&mut DeliveryRow, &mut u64),
    changed: &mut u64,
) {
    for row in state.deliveries.values_mut() {
        if row.delivery.dead && ids.contains(&row.delivery.event_id) {
            reset(row, changed);
        }
    }
    for id in ids {
        if let Some(row) = state.events.get_mut(id)
            && !row.event.published
            && (row.event.dead || row.next_retry_at.is_some())
        {
            row.event.dead = false;
            row.event.parked = 0;
            row.event.last_error = None;
            row.next_retry_at = None;
            *changed += 1;
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; the test that panicked reports it.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An event in a [`MemoryStore`], as a test looks at it.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryEvent {
    /// The stored event.
    pub stored: StoredEvent,
    /// Handed to every subscriber (or to its own delivery).
    pub published: bool,
    /// Never decodable: a dead letter.
    pub dead: bool,
    /// Times parked.
    pub parked: u32,
    /// Why it was parked or is dead.
    pub last_error: Option<String>,
}

/// A subscriber's pending delivery in a [`MemoryStore`].
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryDelivery {
    /// The subscriber.
    pub subscriber: String,
    /// The event.
    pub event_id: i64,
    /// Failed attempts.
    pub attempts: u32,
    /// The last error.
    pub last_error: Option<String>,
    /// When it is next due.
    pub next_attempt_at: OffsetDateTime,
    /// A dead letter.
    pub dead: bool,
}

#[derive(Debug)]
struct EventRow {
    event: MemoryEvent,
    published_at: Option<OffsetDateTime>,
    next_retry_at: Option<OffsetDateTime>,
    /// The claim holding it, if any (live or expired).
    claim: Option<i64>,
    expired_claims: u32,
}

#[derive(Debug)]
struct DeliveryRow {
    delivery: MemoryDelivery,
    aggregate_type: String,
    aggregate_id: Uuid,
    claim: Option<i64>,
    expired_claims: u32,
}

#[derive(Debug, Default)]
struct State {
    next_id: i64,
    next_claim: i64,
    events: BTreeMap<i64, EventRow>,
    /// Keyed by (event id, subscriber): iteration is in event id order.
    deliveries: BTreeMap<(i64, String), DeliveryRow>,
    /// Claims by token, with the end of their lease.
    claims: BTreeMap<i64, OffsetDateTime>,
    /// Registered relays: (routing, generation, last seen).
    relays: BTreeMap<Uuid, (String, i64, OffsetDateTime)>,
    next_generation: i64,
}

impl State {
    /// Stores a committed event; returns its id.
    fn insert(
        &mut self,
        aggregate_type: &str,
        aggregate_id: Uuid,
        event_type: &str,
        payload: String,
        occurred_at: OffsetDateTime,
    ) -> i64 {
        self.next_id += 1;
        let id = self.next_id;
        let stored = StoredEvent {
            id,
            aggregate_type: aggregate_type.to_owned(),
            aggregate_id,
            event_type: event_type.to_owned(),
            payload,
            occurred_at,
        };
        self.events.insert(
            id,
            EventRow {
                event: MemoryEvent {
                    stored,
                    published: false,
                    dead: false,
                    parked: 0,
                    last_error: None,
                },
                published_at: None,
                next_retry_at: None,
                claim: None,
                expired_claims: 0,
            },
        );
        id
    }

    /// Ends the claims whose lease is over: their work is free again, and counts the expiry.
    fn expire(&mut self, now: OffsetDateTime) {
        let expired: BTreeSet<i64> = self
            .claims
            .iter()
            .filter(|(_, until)| **until < now)
            .map(|(token, _)| *token)
            .collect();
        if expired.is_empty() {
            return;
        }
        self.claims.retain(|token, _| !expired.contains(token));
        for row in self.events.values_mut() {
            if row.claim.is_some_and(|c| expired.contains(&c)) {
                row.claim = None;
                row.expired_claims += 1;
            }
        }
        for row in self.deliveries.values_mut() {
            if row.claim.is_some_and(|c| expired.contains(&c)) {
                row.claim = None;
                row.expired_claims += 1;
            }
        }
    }

    fn is_live(&self, token: i64, now: OffsetDateTime) -> bool {
        self.claims.get(&token).is_some_and(|until| *until >= now)
    }

    /// The registry as it stands: its version changes when a relay registers anew or leaves.
    fn registry(&self) -> Registry {
        let version = self
            .relays
            .values()
            .map(|(_, generation, _)| generation.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let relays = self
            .relays
            .iter()
            .map(|(id, (routing, _, _))| (*id, routing.clone()))
            .collect();
        Registry::new(version, relays)
    }
}

/// A [`Store`] in memory, with the same semantics as the database stores, on a [`ManualClock`].
///
/// Committed events go in with [`commit`](Self::commit) or [`publish`](Self::publish). Cheap to
/// clone; clones share the data.
///
/// It keeps the rules the SQL stores keep (claims are leases with tokens, outcomes count only
/// under a live claim, order per (subscriber, aggregate), an aggregate being its type and id),
/// without their concern for cost: it looks at every row on every claim.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    clock: ManualClock,
    wake: Arc<Notify>,
}

impl MemoryStore {
    /// An empty store on a clock of its own, starting now.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store on `clock`.
    pub fn with_clock(clock: ManualClock) -> Self {
        Self {
            clock,
            ..Self::default()
        }
    }

    /// The store's clock.
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }

    /// Stores what `publisher` recorded, as one committed transaction.
    pub fn commit(&self, publisher: RecordingPublisher) {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        for record in publisher.records {
            state.insert(
                record.aggregate_type,
                record.aggregate_id,
                record.event_type,
                record.payload,
                record.occurred_at.unwrap_or(now),
            );
        }
        drop(state);
        self.wake.notify_one();
    }

    /// Stores an event as other code may have written it, payload and all, as its own
    /// committed transaction; returns its id. For tests of what the relay does with payloads it
    /// cannot decode, or event types it does not know.
    pub fn insert_raw(
        &self,
        event_type: &str,
        aggregate_type: &str,
        aggregate_id: Uuid,
        payload: &str,
    ) -> i64 {
        let now = self.clock.now();
        let id = lock(&self.state).insert(
            aggregate_type,
            aggregate_id,
            event_type,
            payload.to_owned(),
            now,
        );
        self.wake.notify_one();
        id
    }

    /// Stores one event, as its own committed transaction.
    pub fn publish<E: OutboxEvent>(&self, event: &E) -> Result<(), EncodeError> {
        let mut publisher = RecordingPublisher::new();
        publisher.record(event, &Metadata::new())?;
        self.commit(publisher);
        Ok(())
    }

    /// Every event, in id order.
    pub fn events(&self) -> Vec<MemoryEvent> {
        lock(&self.state)
            .events
            .values()
            .map(|row| row.event.clone())
            .collect()
    }

    /// Every pending delivery, in event id order.
    pub fn deliveries(&self) -> Vec<MemoryDelivery> {
        lock(&self.state)
            .deliveries
            .values()
            .map(|row| row.delivery.clone())
            .collect()
    }

    /// Events not yet published plus deliveries not yet delivered (dead letters included).
    pub fn pending(&self) -> usize {
        let state = lock(&self.state);
        state.events.values().filter(|r| !r.event.published).count() + state.deliveries.len()
    }

    /// Records `outcomes` under `token`; `whole`: the claim ends, else it keeps what the
    /// outcomes do not name.
    fn record_in(&self, token: ClaimToken, outcomes: &Outcomes, whole: bool) -> store::Recorded {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        let token = token.get();
        if !state.is_live(token, now) {
            return store::Recorded::Lost;
        }
        if whole {
            state.claims.remove(&token);
        }
        for (id, outcome) in &outcomes.events {
            let Some(row) = state.events.get_mut(id) else {
                continue;
            };
            match outcome {
                EventOutcome::Published => {
                    row.event.published = true;
                    row.published_at = Some(now);
                }
                EventOutcome::Parked { reason, retry_in } => {
                    row.event.parked += 1;
                    row.event.last_error = Some(reason.clone());
                    row.next_retry_at = Some(after(now, *retry_in));
                }
                EventOutcome::Dead { reason } => {
                    row.event.dead = true;
                    row.event.last_error = Some(reason.clone());
                }
                EventOutcome::Released => {}
            }
        }
        for record in &outcomes.deliveries {
            let key = (record.event_id, record.subscriber.clone());
            let (attempts, last_error, next_attempt_at, dead) = match &record.outcome {
                DeliveryOutcome::Delivered => {
                    state.deliveries.remove(&key);
                    continue;
                }
                DeliveryOutcome::Released => continue,
                DeliveryOutcome::Waiting => (0, None, now, false),
                DeliveryOutcome::Retry {
                    attempts,
                    error,
                    retry_in,
                } => (*attempts, Some(error.clone()), after(now, *retry_in), false),
                DeliveryOutcome::Dead { attempts, error } => {
                    (*attempts, Some(error.clone()), now, true)
                }
            };
            let expired_claims = state.deliveries.get(&key).map_or(0, |d| d.expired_claims);
            state.deliveries.insert(
                key,
                DeliveryRow {
                    delivery: MemoryDelivery {
                        subscriber: record.subscriber.clone(),
                        event_id: record.event_id,
                        attempts,
                        last_error,
                        next_attempt_at,
                        dead,
                    },
                    aggregate_type: record.aggregate_type.clone(),
                    aggregate_id: record.aggregate_id,
                    claim: None,
                    expired_claims,
                },
            );
        }
        if whole {
            // Whatever the outcomes did not mention is given back.
            for row in state.events.values_mut() {
                if row.claim == Some(token) {
                    row.claim = None;
                }
            }
            for row in state.deliveries.values_mut() {
                if row.claim == Some(token) {
                    row.claim = None;
                }
            }
        } else {
            // What they mention leaves the claim; the rest stays claimed.
            for (id, _) in &outcomes.events {
                if let Some(row) = state.events.get_mut(id)
                    && row.claim == Some(token)
                {
                    row.claim = None;
                }
            }
            for record in &outcomes.deliveries {
                if let Some(row) = state
                    .deliveries
                    .get_mut(&(record.event_id, record.subscriber.clone()))
                    && row.claim == Some(token)
                {
                    row.claim = None;
                }
            }
        }
        store::Recorded::Applied
    }
}

fn after(now: OffsetDateTime, delay: Duration) -> OffsetDateTime {
    now.saturating_add(time::Duration::try_from(delay).unwrap_or(time::Duration::MAX))
}

impl Store for MemoryStore {
    async fn claim(
        &self,
        limit: ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, StoreError> {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        let state = &mut *state;
        state.expire(now);
        let token = state.next_claim + 1;

        // Events in id order; an aggregate with an unfinished event not taken into this batch
        // (dead, parked, claimed elsewhere, or left out by the limit) holds its later ones back.
        let mut held: BTreeSet<(String, Uuid)> = BTreeSet::new();
        let mut taken = Vec::new();
        let mut budget = limit.budget();
        for row in state.events.values() {
            if row.event.published {
                continue;
            }
            let stored = &row.event.stored;
            let key = (stored.aggregate_type.clone(), stored.aggregate_id);
            if held.contains(&key) {
                continue;
            }
            // Left to a relay of another build, with its aggregate's later events.
            if filter.skip_event_types.contains(&stored.event_type) {
                held.insert(key);
                continue;
            }
            let free = !row.event.dead
                && row.next_retry_at.is_none_or(|at| at <= now)
                && row.claim.is_none()
                && budget.take(stored.payload.len() as u64);
            if free {
                taken.push(stored.id);
            } else {
                held.insert(key);
            }
        }
        // Per (subscriber, aggregate), the ready rows from its first one on, in order: a due
        // head and the rows right behind it that are not dead, claimed or waiting for a retry.
        let mut closed: BTreeSet<(&str, &str, Uuid)> = BTreeSet::new();
        let mut due: Vec<(i64, String)> = Vec::new();
        let mut budget = limit.budget();
        for (key, row) in &state.deliveries {
            let of = (
                key.1.as_str(),
                row.aggregate_type.as_str(),
                row.aggregate_id,
            );
            if closed.contains(&of) || filter.skip_subscribers.contains(&key.1) {
                continue;
            }
            let ready =
                !row.delivery.dead && row.delivery.next_attempt_at <= now && row.claim.is_none();
            let size = state
                .events
                .get(&key.0)
                .map_or(0, |event| event.event.stored.payload.len() as u64);
            if ready && budget.take(size) {
                due.push(key.clone());
            } else {
                closed.insert(of);
            }
        }
        let mut claims = Vec::new();
        for id in taken {
            let Some(row) = state.events.get(&id) else {
                continue;
            };
            let stored = &row.event.stored;
            // Deliveries of this claim do not hold the event back: they run first, in their
            // subscriber's queue.
            let blocked: BTreeSet<String> = state
                .deliveries
                .iter()
                .filter(|(key, d)| {
                    d.aggregate_id == stored.aggregate_id
                        && d.aggregate_type == stored.aggregate_type
                        && !due.contains(key)
                })
                .map(|(_, d)| d)
                .map(|d| d.delivery.subscriber.clone())
                .collect();
            claims.push(Claim::Event {
                event: stored.clone(),
                parked: row.event.parked,
                expired: row.expired_claims,
                blocked: blocked.into_iter().collect(),
            });
            if let Some(row) = state.events.get_mut(&id) {
                row.claim = Some(token);
            }
        }

        for key in due {
            let Some(event) = state.events.get(&key.0).map(|e| e.event.stored.clone()) else {
                continue;
            };
            let Some(row) = state.deliveries.get_mut(&key) else {
                continue;
            };
            row.claim = Some(token);
            claims.push(Claim::Delivery {
                event,
                subscriber: key.1,
                attempts: row.delivery.attempts,
                expired: row.expired_claims,
            });
        }
        let registry = Some(state.registry().version);
        if claims.is_empty() {
            return Ok(Batch::empty().with_registry(registry));
        }
        state.next_claim = token;
        state.claims.insert(token, after(now, lease));
        claims.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        Ok(Batch::new(ClaimToken::new(token), claims).with_registry(registry))
    }

    async fn register(
        &self,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> Result<Registry, StoreError> {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        let oldest = now.checked_sub(time::Duration::try_from(ttl).unwrap_or(time::Duration::MAX));
        state
            .relays
            .retain(|_, (_, _, seen)| oldest.is_none_or(|oldest| *seen >= oldest));
        // A build no live relay runs arrives: what was parked for want of it is due now.
        let arrives = !state.relays.contains_key(&relay)
            && state.relays.values().all(|(other, _, _)| other != routing);
        if arrives {
            for row in state.events.values_mut() {
                if row.published_at.is_none()
                    && !row.event.dead
                    && row.next_retry_at.is_some_and(|at| at > now)
                {
                    row.next_retry_at = Some(now);
                }
            }
        }
        let generation = match state.relays.get(&relay) {
            Some((_, generation, _)) => *generation,
            None => {
                state.next_generation += 1;
                state.next_generation
            }
        };
        state
            .relays
            .insert(relay, (routing.to_owned(), generation, now));
        Ok(state.registry())
    }

    async fn unregister(&self, relay: Uuid) -> Result<(), StoreError> {
        lock(&self.state).relays.remove(&relay);
        Ok(())
    }

    async fn renew(&self, token: ClaimToken, lease: Duration) -> Result<bool, StoreError> {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        if !state.is_live(token.get(), now) {
            return Ok(false);
        }
        state.claims.insert(token.get(), after(now, lease));
        Ok(true)
    }

    async fn record(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> Result<store::Recorded, StoreError> {
        Ok(self.record_in(token, outcomes, true))
    }

    async fn record_part(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> Result<store::Recorded, StoreError> {
        Ok(self.record_in(token, outcomes, false))
    }

    fn records_parts(&self) -> bool {
        true
    }

    async fn requeue(&self, which: &Requeue) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut state = lock(&self.state);
        let mut changed = 0;
        let reset = |row: &mut DeliveryRow, changed: &mut u64| {
            row.delivery.dead = false;
            row.delivery.attempts = 0;
            row.delivery.last_error = None;
            row.delivery.next_attempt_at = now;
            *changed += 1;
        };
        match which {
            Requeue::Events(ids) => requeue_events(&mut state, ids, reset, &mut changed),
            Requeue::Subscriber(subscriber) => {
                for row in state.deliveries.values_mut() {
                    if row.delivery.dead && &row.delivery.subscriber == subscriber {
                        reset(row, &mut changed);
                    }
                }
            }
            Requeue::Failure {
                subscriber: Some(subscriber),
                first_line,
            } => {
                for row in state.deliveries.values_mut() {
                    if row.delivery.dead
                        && &row.delivery.subscriber == subscriber
                        && Requeue::first_line(row.delivery.last_error.as_deref()) == first_line
                    {
                        reset(row, &mut changed);
                    }
                }
            }
            Requeue::Failure {
                subscriber: None,
                first_line,
            } => {
                let ids: Vec<i64> = state
                    .events
                    .iter()
                    .filter(|(_, row)| {
                        row.event.dead
                            && !row.event.published
                            && Requeue::first_line(row.event.last_error.as_deref()) == first_line
                    })
                    .map(|(id, _)| *id)
                    .collect();
                requeue_events(&mut state, &ids, reset, &mut changed);
            }
        }
        Ok(changed)
    }

    async fn status(&self) -> Result<Status, StoreError> {
        let now = self.clock.now();
        let state = lock(&self.state);
        let mut status = Status::default();
        // Aggregates with a dead or parked event: their later events are held back.
        let mut stalled: BTreeSet<(&str, Uuid)> = BTreeSet::new();
        for row in state.events.values() {
            let stored = &row.event.stored;
            let key = (stored.aggregate_type.as_str(), stored.aggregate_id);
            if row.event.dead {
                status.dead_letters += 1;
                stalled.insert(key);
            } else if !row.event.published {
                status.pending_events += 1;
                let age = (now - stored.occurred_at)
                    .try_into()
                    .unwrap_or(Duration::ZERO);
                status.oldest_pending_age = status.oldest_pending_age.max(Some(age));
                if stalled.contains(&key) {
                    status.held_events += 1;
                } else if row.next_retry_at.is_some() {
                    stalled.insert(key);
                }
            }
        }
        status.blocked_aggregates = stalled.len() as u64;
        let mut keys = BTreeSet::new();
        for row in state.deliveries.values() {
            if row.delivery.dead {
                status.dead_letters += 1;
            } else {
                status.pending_deliveries += 1;
            }
            keys.insert((
                row.delivery.subscriber.as_str(),
                row.aggregate_type.as_str(),
                row.aggregate_id,
            ));
        }
        status.blocked_keys = keys.len() as u64;
        // What dead letters hold back: events of an aggregate after its first dead event,
        // deliveries of a key after its first dead one (rows are in id order).
        let mut dead_aggregates: BTreeSet<(&str, Uuid)> = BTreeSet::new();
        for row in state.events.values() {
            let stored = &row.event.stored;
            let key = (stored.aggregate_type.as_str(), stored.aggregate_id);
            if row.event.published {
                continue;
            }
            if row.event.dead {
                dead_aggregates.insert(key);
            } else if dead_aggregates.contains(&key) {
                status.behind_dead_letters += 1;
            }
        }
        let mut dead_keys: BTreeSet<(&str, &str, Uuid)> = BTreeSet::new();
        for ((_, subscriber), row) in &state.deliveries {
            let key = (
                subscriber.as_str(),
                row.aggregate_type.as_str(),
                row.aggregate_id,
            );
            if row.delivery.dead {
                dead_keys.insert(key);
            } else if dead_keys.contains(&key) {
                status.behind_dead_letters += 1;
            }
        }
        // What no live relay routes (nothing can be said when none is registered).
        let oldest_live = now.checked_sub(
            time::Duration::try_from(store::REGISTRATION_TTL).unwrap_or(time::Duration::MAX),
        );
        let live = Registry::new(
            String::new(),
            state
                .relays
                .iter()
                .filter(|(_, (_, _, seen))| oldest_live.is_none_or(|oldest| *seen >= oldest))
                .map(|(id, (routing, _, _))| (*id, routing.clone()))
                .collect(),
        );
        status.live_relays = live.relays.len() as u64;
        if status.live_relays > 0 {
            let (types, subscribers) = (live.event_types(), live.subscribers());
            let age = |at: OffsetDateTime| (now - at).try_into().unwrap_or(Duration::ZERO);
            for row in state.events.values() {
                let stored = &row.event.stored;
                if !row.event.published && !row.event.dead && !types.contains(&stored.event_type) {
                    status.unroutable_events += 1;
                    status.oldest_unroutable_age = status
                        .oldest_unroutable_age
                        .max(Some(age(stored.occurred_at)));
                }
            }
            for ((id, subscriber), row) in &state.deliveries {
                if !row.delivery.dead && !subscribers.contains(subscriber) {
                    status.unroutable_deliveries += 1;
                    if let Some(event) = state.events.get(id) {
                        let at = event.event.stored.occurred_at;
                        status.oldest_unroutable_age =
                            status.oldest_unroutable_age.max(Some(age(at)));
                    }
                }
            }
        }
        Ok(status)
    }

    async fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<Purged, StoreError> {
        let Some(before) = time::Duration::try_from(older_than)
            .ok()
            .and_then(|window| self.clock.now().checked_sub(window))
        else {
            return Ok(Purged::default());
        };
        let mut state = lock(&self.state);
        let state = &mut *state;
        let doomed: Vec<i64> = state
            .events
            .iter()
            .filter(|(id, row)| {
                row.published_at.is_some_and(|at| at < before)
                    && !state.deliveries.keys().any(|(event_id, _)| event_id == *id)
            })
            .map(|(id, _)| *id)
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .collect();
        for id in &doomed {
            state.events.remove(id);
        }
        // Everything was looked at; a full batch may have left more.
        Ok(Purged::new(
            doomed.len() as u64,
            doomed.len() as u64 >= u64::from(limit),
        ))
    }

    async fn notified(&self) {
        self.wake.notified().await;
    }
}

/// Runs batches until one finds nothing to do, and returns their reports added up. With a
/// [`MemoryStore`], work scheduled for later (a retry, a parked event) waits for its
/// [`ManualClock`] to be moved past it.
pub async fn drain<S: Store, R: Router>(relay: &Relay<S, R>) -> Result<BatchReport, StoreError> {
    let mut total = BatchReport::default();
    loop {
        let report = relay.run_once().await?;
        if report.more {
            continue;
        }
        if report.claimed == 0 || report.claimed == report.released {
            return Ok(total);
        }
        total.claimed += report.claimed;
        total.delivered += report.delivered;
        total.retried += report.retried;
        total.dead += report.dead;
        total.parked += report.parked;
        total.waiting += report.waiting;
        total.released += report.released;
    }
}

pub use crate::compat::{
    CatalogReport, bless as bless_catalog, compare as compare_catalog, sample_of,
};

/// Checks router `R`'s catalog against the snapshot at `snapshot` (a JSON file committed with
/// the code), and panics, saying what to do, when a change would break what is stored:
///
/// - a recorded sample payload of any version ever recorded no longer decodes with the current
///   code (through the upcasters): a removed upcaster, a field renamed without a version bump;
/// - the current version's shape (its JSON Schema, from `schemars::JsonSchema`, which every
///   event must derive) changed without a version bump;
/// - an event type or subscriber name disappeared without a declared rename (`formerly`);
/// - something is not recorded yet (a new event, version or subscriber).
///
/// With the environment variable `OUTBOX_BLESS` set, it records the current catalog into the
/// snapshot instead (creating it if need be), keeping every version recorded before, with a
/// sample payload of each new version made from its schema; it refuses to record a breaking
/// change. Review the diff and commit it, as with any golden file.
///
/// One line in a test of the application:
///
/// ```no_run
/// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize, schemars::JsonSchema, OutboxEvent)]
/// # #[outbox(aggregate_type = "bot")]
/// # struct BotInstalled { #[outbox(aggregate_id)] bot_id: uuid::Uuid }
/// # #[subscriber(events = [BotInstalled])]
/// # struct Licensing;
/// # impl Handle<BotInstalled> for Licensing {
/// #     async fn handle(&self, _: &BotInstalled, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # #[router(events = [BotInstalled])]
/// # struct App { licensing: Licensing }
/// #[test]
/// fn the_catalog_keeps_what_is_stored() {
///     outbox_core::testing::check_catalog::<App>(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/catalog.json"));
/// }
/// ```
///
/// # Panics
///
/// When the catalog does not match the snapshot, when there is no snapshot (and `OUTBOX_BLESS`
/// is not set), or when blessing is refused.
#[track_caller]
pub fn check_catalog<R: Router>(snapshot: impl AsRef<std::path::Path>) {
    let bless = std::env::var_os("OUTBOX_BLESS").is_some();
    if let Err(message) = crate::compat::check_file(&R::catalog(), snapshot.as_ref(), bless) {
        panic!("{message}");
    }
}
