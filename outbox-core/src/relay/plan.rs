//! Batch planning: a pure function from a batch's claims to what is decided at once and which
//! handler calls are left to make, in one queue per (subscriber, aggregate) key.
//!
//! A queue's calls run one at a time, in claim order (commit order); queues run concurrently.
//! Everything that needs no handler is decided here: events behind a stalled aggregate are
//! released, events of unknown types and undecodable events are parked or dead, deliveries behind
//! a key held back by the store or by an earlier decision wait. What a handler's failure holds
//! back is decided as the queue runs (`batch.rs`).

use std::time::Duration;

use uuid::Uuid;

use super::attempt::stored_text;
use super::{Map, Set};
use crate::error::DecodeError;
use crate::store::{Claim, DeliveryOutcome, DeliveryRecord, EventOutcome, StoredEvent};
use crate::telemetry::{self, status};

/// The label of events the store could not read, in metrics.
const UNREADABLE: &str = "(unreadable)";

/// What planning needs of a relay: its routes, its (guarded) decoding and its park delay.
pub(super) trait Routes {
    /// A decoded event.
    type Decoded;
    /// The subscribers of `event_type`, in delivery order, or `None` if this build does not know it.
    fn subscribers(&self, event_type: &str) -> Option<&[&'static str]>;
    /// The current name of the subscriber whose deliveries are stored as `stored` (its name, or
    /// one it had before a rename), or `None` if this build has no such subscriber.
    fn current_subscriber(&self, stored: &str) -> Option<&'static str>;
    /// The subscribers that relays of other builds route `event_type` to and this build does
    /// not have, by the names they registered.
    fn foreign_subscribers(&self, event_type: &str) -> &[String] {
        let _ = event_type;
        &[]
    }
    /// Whether a live relay of another build routes `event_type` (which this build does not).
    fn routed_elsewhere(&self, event_type: &str) -> bool {
        let _ = event_type;
        false
    }
    /// Whether a live relay of another build has a subscriber stored as `stored`.
    fn subscriber_elsewhere(&self, stored: &str) -> bool {
        let _ = stored;
        false
    }
    /// Decodes `event`.
    fn decode(&self, event: &StoredEvent) -> Result<Self::Decoded, DecodeError>;
    /// How long parked work waits.
    fn park_delay(&self) -> Duration;
}

/// A batch's claims, planned.
pub(super) struct Plan<D> {
    /// One entry per claim, in claim order.
    pub(super) claims: Vec<Planned<D>>,
    /// The handler calls to make: one queue per (subscriber, aggregate) key, in the order of
    /// each key's first claim. A queue runs in order; queues may run concurrently.
    pub(super) queues: Vec<Vec<Step>>,
}

/// One claim, planned.
pub(super) enum Planned<D> {
    /// An event decided without a handler: released behind a stalled aggregate, parked, or dead.
    Event {
        /// The event's id.
        id: i64,
        /// Its aggregate, unless it could not be read.
        aggregate: Option<(String, Uuid)>,
        /// What became of it.
        outcome: EventOutcome,
    },
    /// A delivery decided without a handler: released behind a held-back key, parked, or dead.
    Delivery(DeliveryRecord),
    /// An event handed to its subscribers: one slot per subscriber, in routing order.
    FanOut {
        event: StoredEvent,
        decoded: D,
        expired: u32,
        slots: Vec<FanOutSlot>,
    },
    /// A pending delivery attempted again: one step.
    Again {
        event: StoredEvent,
        decoded: D,
        /// The name the delivery is stored under.
        subscriber: String,
        /// The subscriber's current name (another when it was renamed since).
        current: &'static str,
        /// Failed attempts so far.
        attempts: u32,
        expired: u32,
    },
}

impl<D> Planned<D> {
    /// The claim's aggregate (type and id); `None` for an event that could not be read.
    pub(super) fn aggregate(&self) -> Option<(&str, Uuid)> {
        match self {
            Planned::Event { aggregate, .. } => aggregate.as_ref().map(|(t, id)| (t.as_str(), *id)),
            Planned::Delivery(record) => {
                Some((record.aggregate_type.as_str(), record.aggregate_id))
            }
            Planned::FanOut { event, .. } | Planned::Again { event, .. } => {
                Some((event.aggregate_type.as_str(), event.aggregate_id))
            }
        }
    }
}

/// One subscriber's share of a fanned-out event.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FanOutSlot {
    /// The subscriber: one of this build's, or another build's (whose delivery waits for it).
    pub(super) subscriber: std::borrow::Cow<'static, str>,
    /// What to do.
    pub(super) slot: Slot,
    /// The name to record a delivery under, when not `subscriber`: the subscriber was renamed
    /// and the deliveries of its key that wait are stored under a former name, which this one
    /// joins so that the key's deliveries stay in one ordered queue in the store.
    pub(super) record_as: Option<String>,
}

impl FanOutSlot {
    /// The name the slot's delivery is recorded under.
    pub(super) fn stored_name(&self) -> &str {
        self.record_as.as_deref().unwrap_or(&self.subscriber)
    }
}

/// What a subscriber's slot of a fanned-out event does.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Slot {
    /// Decided at planning (it waits behind its key).
    Decided(DeliveryOutcome),
    /// A handler call, in one of the plan's queues.
    Run,
}

/// A handler call: the claim and, for a fan-out, the subscriber's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Step {
    pub(super) claim: usize,
    pub(super) slot: usize,
}

/// A (subscriber, aggregate type, aggregate id) key.
type Key = (String, String, Uuid);

fn key(subscriber: &str, event: &StoredEvent) -> Key {
    (
        subscriber.to_owned(),
        event.aggregate_type.clone(),
        event.aggregate_id,
    )
}

/// Keys and aggregates held back while planning, and the queue of each key.
#[derive(Default)]
struct Planner {
    /// Keys whose later claims must wait: held back by the store or by a decision of this batch.
    blocked: Set<Key>,
    /// Aggregates with an event parked or dead in this batch: their later events are released.
    stalled: Set<(String, Uuid)>,
    /// An event whose aggregate could not be read died: every later event is released.
    stall_all: bool,
    queue_of: Map<Key, usize>,
    queues: Vec<Vec<Step>>,
    /// Keys of renamed subscribers whose waiting deliveries are stored under a former name.
    stored_as: Map<Key, String>,
}

impl Planner {
    fn is_stalled(&self, event: &StoredEvent) -> bool {
        self.stall_all
            || (!self.stalled.is_empty()
                && self
                    .stalled
                    .contains(&(event.aggregate_type.clone(), event.aggregate_id)))
    }

    fn stall(&mut self, event: &StoredEvent) {
        self.stalled
            .insert((event.aggregate_type.clone(), event.aggregate_id));
    }

    fn enqueue(&mut self, key: Key, step: Step) {
        let queues = &mut self.queues;
        let index = *self.queue_of.entry(key).or_insert_with(|| {
            queues.push(Vec::new());
            queues.len() - 1
        });
        self.queues[index].push(step);
    }
}

/// Plans a batch: decides what needs no handler and queues the handler calls per key.
pub(super) fn plan<R: Routes>(claims: Vec<Claim>, routes: &R) -> Plan<R::Decoded> {
    let mut planner = Planner::default();
    let mut planned = Vec::with_capacity(claims.len());
    for (index, claim) in claims.into_iter().enumerate() {
        let entry = match claim {
            Claim::Unreadable {
                id,
                subscriber,
                aggregate,
                reason,
            } => {
                telemetry::dispatched(UNREADABLE, status::DEAD);
                let reason = stored_text(format!("the stored event cannot be read: {reason}"));
                tracing::error!(event_id = id, ?subscriber, %reason, "outbox dead letter");
                match subscriber {
                    None => {
                        match &aggregate {
                            Some(key) => {
                                planner.stalled.insert(key.clone());
                            }
                            None => planner.stall_all = true,
                        }
                        Planned::Event {
                            id,
                            aggregate,
                            outcome: EventOutcome::Dead { reason },
                        }
                    }
                    // One subscriber's delivery: its later events of the aggregate wait.
                    Some(subscriber) => {
                        let (aggregate_type, aggregate_id) = aggregate.unwrap_or_default();
                        planner.blocked.insert((
                            subscriber.clone(),
                            aggregate_type.clone(),
                            aggregate_id,
                        ));
                        Planned::Delivery(DeliveryRecord {
                            event_id: id,
                            aggregate_type,
                            aggregate_id,
                            subscriber,
                            outcome: DeliveryOutcome::Dead {
                                attempts: 0,
                                error: reason,
                            },
                        })
                    }
                }
            }
            Claim::Event {
                event,
                blocked,
                expired,
                ..
            } => plan_event(&mut planner, index, event, &blocked, expired, routes),
            Claim::Delivery {
                event,
                subscriber,
                attempts,
                expired,
            } => plan_again(
                &mut planner,
                index,
                event,
                subscriber,
                attempts,
                expired,
                routes,
            ),
        };
        planned.push(entry);
    }
    Plan {
        claims: planned,
        queues: planner.queues,
    }
}

fn plan_event<R: Routes>(
    planner: &mut Planner,
    index: usize,
    event: StoredEvent,
    held_by_store: &[String],
    expired: u32,
    routes: &R,
) -> Planned<R::Decoded> {
    let decided = |event: &StoredEvent, outcome| Planned::Event {
        id: event.id,
        aggregate: Some((event.aggregate_type.clone(), event.aggregate_id)),
        outcome,
    };
    if planner.is_stalled(&event) {
        return decided(&event, EventOutcome::Released);
    }
    let Some(subscribers) = routes.subscribers(&event.event_type) else {
        planner.stall(&event);
        if routes.routed_elsewhere(&event.event_type) {
            // A relay of another build routes it (it registered after this claim was made):
            // give it back, with its aggregate's later events, for that relay.
            return decided(&event, EventOutcome::Released);
        }
        telemetry::dispatched(&event.event_type, status::PARKED);
        let reason = stored_text(format!(
            "no subscriber in this build knows event type `{}`",
            event.event_type
        ));
        let retry_in = routes.park_delay();
        return decided(&event, EventOutcome::Parked { reason, retry_in });
    };
    let decoded = match routes.decode(&event) {
        Ok(decoded) => decoded,
        Err(error) => {
            planner.stall(&event);
            let reason = stored_text(error.to_string());
            let outcome = if error.may_decode_in_newer_build() {
                telemetry::dispatched(&event.event_type, status::PARKED);
                EventOutcome::Parked {
                    reason,
                    retry_in: routes.park_delay(),
                }
            } else {
                telemetry::dispatched(&event.event_type, status::DEAD);
                tracing::error!(
                    event_id = event.id,
                    event_type = %event.event_type,
                    %reason,
                    "outbox event can never be decoded: a dead letter"
                );
                EventOutcome::Dead { reason }
            };
            return decided(&event, outcome);
        }
    };
    let mut slots = Vec::with_capacity(subscribers.len());
    for &subscriber in subscribers {
        let key = key(subscriber, &event);
        // The store names subscribers as their deliveries are stored: maybe a former name.
        let held_as = held_by_store
            .iter()
            .find(|s| *s == subscriber || routes.current_subscriber(s) == Some(subscriber));
        if let Some(stored) = held_as.filter(|s| *s != subscriber) {
            planner
                .stored_as
                .entry(key.clone())
                .or_insert_with(|| stored.clone());
        }
        let record_as = planner.stored_as.get(&key).cloned();
        let slot = if held_as.is_some() || planner.blocked.contains(&key) {
            planner.blocked.insert(key);
            Slot::Decided(DeliveryOutcome::Waiting)
        } else {
            planner.enqueue(
                key,
                Step {
                    claim: index,
                    slot: slots.len(),
                },
            );
            Slot::Run
        };
        slots.push(FanOutSlot {
            subscriber: subscriber.into(),
            slot,
            record_as,
        });
    }
    // Subscribers of other builds: their deliveries wait for a relay that has them.
    for foreign in routes.foreign_subscribers(&event.event_type) {
        planner.blocked.insert(key(foreign, &event));
        slots.push(FanOutSlot {
            subscriber: foreign.clone().into(),
            slot: Slot::Decided(DeliveryOutcome::Waiting),
            record_as: None,
        });
    }
    Planned::FanOut {
        event,
        decoded,
        expired,
        slots,
    }
}

fn plan_again<R: Routes>(
    planner: &mut Planner,
    index: usize,
    event: StoredEvent,
    subscriber: String,
    attempts: u32,
    expired: u32,
    routes: &R,
) -> Planned<R::Decoded> {
    let current = routes.current_subscriber(&subscriber);
    let key = key(current.unwrap_or(&subscriber), &event);
    if current.is_some_and(|c| c != subscriber) {
        planner
            .stored_as
            .entry(key.clone())
            .or_insert_with(|| subscriber.clone());
    }
    let decided = |event: &StoredEvent, subscriber, outcome| {
        Planned::Delivery(DeliveryRecord {
            event_id: event.id,
            aggregate_type: event.aggregate_type.clone(),
            aggregate_id: event.aggregate_id,
            subscriber,
            outcome,
        })
    };
    if planner.blocked.contains(&key) {
        return decided(&event, subscriber, DeliveryOutcome::Released);
    }
    let routed = current.filter(|current| {
        routes
            .subscribers(&event.event_type)
            .is_some_and(|subscribers| subscribers.contains(current))
    });
    let park = |reason: String| DeliveryOutcome::Retry {
        attempts,
        error: stored_text(reason),
        retry_in: routes.park_delay(),
    };
    let outcome = if let Some(current) = routed {
        match routes.decode(&event) {
            Ok(decoded) => {
                planner.enqueue(
                    key,
                    Step {
                        claim: index,
                        slot: 0,
                    },
                );
                return Planned::Again {
                    event,
                    decoded,
                    subscriber,
                    current,
                    attempts,
                    expired,
                };
            }
            Err(error) if error.may_decode_in_newer_build() => {
                telemetry::dispatched(&event.event_type, status::PARKED);
                park(error.to_string())
            }
            Err(error) => {
                telemetry::dispatched(&event.event_type, status::DEAD);
                DeliveryOutcome::Dead {
                    attempts,
                    error: stored_text(error.to_string()),
                }
            }
        }
    } else if current.is_none() && routes.subscriber_elsewhere(&subscriber) {
        // A relay of another build has it (it registered after this claim was made).
        DeliveryOutcome::Released
    } else {
        telemetry::dispatched(&event.event_type, status::PARKED);
        park(format!(
            "subscriber `{subscriber}` does not take event type `{}` in this build",
            event.event_type
        ))
    };
    planner.blocked.insert(key);
    decided(&event, subscriber, outcome)
}

#[cfg(test)]
mod tests {
    use time::OffsetDateTime;

    use super::*;

    /// Event types `a` (subscribers x, y) and `b` (x); payload "bad" is undecodable for good,
    /// "new" is of a newer version. Subscriber `y` was called `old_y` before.
    struct Fake;

    impl Routes for Fake {
        type Decoded = ();

        fn subscribers(&self, event_type: &str) -> Option<&[&'static str]> {
            match event_type {
                "a" => Some(&["x", "y"]),
                "b" => Some(&["x"]),
                _ => None,
            }
        }

        fn current_subscriber(&self, stored: &str) -> Option<&'static str> {
            match stored {
                "x" => Some("x"),
                "y" | "old_y" => Some("y"),
                _ => None,
            }
        }

        fn decode(&self, event: &StoredEvent) -> Result<(), DecodeError> {
            match event.payload.as_str() {
                "bad" => Err(DecodeError::Panicked {
                    event_type: event.event_type.clone(),
                    message: "a bug".to_owned(),
                }),
                "new" => Err(DecodeError::NewerVersion {
                    event_type: "a",
                    found: 9,
                    current: 1,
                }),
                _ => Ok(()),
            }
        }

        fn park_delay(&self) -> Duration {
            Duration::from_secs(300)
        }
    }

    fn aggregate(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn stored(id: i64, event_type: &str, agg: u128, payload: &str) -> StoredEvent {
        StoredEvent {
            id,
            aggregate_type: "t".to_owned(),
            aggregate_id: aggregate(agg),
            event_type: event_type.to_owned(),
            payload: payload.to_owned(),
            occurred_at: OffsetDateTime::UNIX_EPOCH,
        }
    }

    fn event(id: i64, event_type: &str, agg: u128) -> Claim {
        event_with(stored(id, event_type, agg, "{}"), &[])
    }

    fn event_with(event: StoredEvent, blocked: &[&str]) -> Claim {
        Claim::Event {
            event,
            parked: 0,
            expired: 0,
            blocked: blocked.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn again(id: i64, subscriber: &str, agg: u128) -> Claim {
        Claim::Delivery {
            event: stored(id, "a", agg, "{}"),
            subscriber: subscriber.to_owned(),
            attempts: 1,
            expired: 0,
        }
    }

    /// The plan's queues as (event id, subscriber) pairs.
    fn queues(plan: &Plan<()>) -> Vec<Vec<(i64, &str)>> {
        plan.queues
            .iter()
            .map(|queue| {
                queue
                    .iter()
                    .map(|step| match &plan.claims[step.claim] {
                        Planned::FanOut { event, slots, .. } => {
                            (event.id, &*slots[step.slot].subscriber)
                        }
                        Planned::Again { event, current, .. } => (event.id, *current),
                        _ => panic!("a decided claim in a queue"),
                    })
                    .collect()
            })
            .collect()
    }

    fn event_outcome(plan: &Plan<()>, claim: usize) -> &EventOutcome {
        match &plan.claims[claim] {
            Planned::Event { outcome, .. } => outcome,
            _ => panic!("claim {claim} is not a decided event"),
        }
    }

    fn delivery_outcome(plan: &Plan<()>, claim: usize) -> &DeliveryOutcome {
        match &plan.claims[claim] {
            Planned::Delivery(record) => &record.outcome,
            _ => panic!("claim {claim} is not a decided delivery"),
        }
    }

    #[test]
    fn one_queue_per_subscriber_and_aggregate_in_claim_order() {
        let plan = plan(
            vec![
                event(1, "a", 1),
                event(2, "a", 2),
                event(3, "b", 1),
                event(4, "a", 1),
            ],
            &Fake,
        );
        assert_eq!(
            queues(&plan),
            vec![
                vec![(1, "x"), (3, "x"), (4, "x")],
                vec![(1, "y"), (4, "y")],
                vec![(2, "x")],
                vec![(2, "y")],
            ]
        );
    }

    #[test]
    fn a_retry_runs_before_the_later_events_of_its_key() {
        let plan = plan(vec![again(1, "y", 1), event(2, "a", 1)], &Fake);
        assert_eq!(
            queues(&plan),
            vec![vec![(1, "y"), (2, "y")], vec![(2, "x")]]
        );
    }

    #[test]
    fn a_key_the_store_holds_back_waits_and_its_later_events_too() {
        let plan = plan(
            vec![
                event_with(stored(1, "a", 1, "{}"), &["y"]),
                event(2, "a", 1),
                again(3, "y", 1),
            ],
            &Fake,
        );
        assert_eq!(queues(&plan), vec![vec![(1, "x"), (2, "x")]]);
        for claim in [0, 1] {
            let Planned::FanOut { slots, .. } = &plan.claims[claim] else {
                panic!("not a fan-out");
            };
            assert_eq!(
                slots,
                &[
                    slot("x", Slot::Run, None),
                    slot("y", Slot::Decided(DeliveryOutcome::Waiting), None)
                ]
            );
        }
        assert_eq!(delivery_outcome(&plan, 2), &DeliveryOutcome::Released);
    }

    fn slot(subscriber: &'static str, slot: Slot, record_as: Option<&str>) -> FanOutSlot {
        FanOutSlot {
            subscriber: subscriber.into(),
            slot,
            record_as: record_as.map(str::to_owned),
        }
    }

    #[test]
    fn a_delivery_stored_under_a_former_name_runs_as_the_renamed_subscriber_in_its_key() {
        // Aggregate 1: a retry stored as `old_y`, then a new event; aggregate 2: a new event
        // whose key the store says `old_y` holds back; aggregate 3: nothing under the old name.
        let plan = plan(
            vec![
                again(1, "old_y", 1),
                event(2, "a", 1),
                event_with(stored(3, "a", 2, "{}"), &["old_y"]),
                event(4, "a", 3),
            ],
            &Fake,
        );
        assert_eq!(
            queues(&plan),
            vec![
                vec![(1, "y"), (2, "y")],
                vec![(2, "x")],
                vec![(3, "x")],
                vec![(4, "x")],
                vec![(4, "y")],
            ]
        );
        let Planned::Again { subscriber, .. } = &plan.claims[0] else {
            panic!("a delivery attempted again");
        };
        assert_eq!(
            subscriber, "old_y",
            "its outcome is recorded on its stored row"
        );
        let slots_of = |claim: usize| match &plan.claims[claim] {
            Planned::FanOut { slots, .. } => slots.clone(),
            _ => panic!("not a fan-out"),
        };
        // Deliveries of a key that waits under the former name join it there, so that the
        // store keeps one ordered queue per key; other keys take the new name.
        assert_eq!(slots_of(1)[1], slot("y", Slot::Run, Some("old_y")));
        assert_eq!(slots_of(1)[1].stored_name(), "old_y");
        assert_eq!(
            slots_of(2)[1],
            slot("y", Slot::Decided(DeliveryOutcome::Waiting), Some("old_y"))
        );
        assert_eq!(slots_of(3)[1], slot("y", Slot::Run, None));
    }

    /// `Fake`, beside a relay of another build that routes event type `c`, has subscriber `w`,
    /// and routes `a` to `w` too.
    struct BesideAnother;

    impl Routes for BesideAnother {
        type Decoded = ();

        fn subscribers(&self, event_type: &str) -> Option<&[&'static str]> {
            Fake.subscribers(event_type)
        }

        fn current_subscriber(&self, stored: &str) -> Option<&'static str> {
            Fake.current_subscriber(stored)
        }

        fn foreign_subscribers(&self, event_type: &str) -> &[String] {
            static W: std::sync::LazyLock<Vec<String>> =
                std::sync::LazyLock::new(|| vec!["w".to_owned()]);
            if event_type == "a" { &W } else { &[] }
        }

        fn routed_elsewhere(&self, event_type: &str) -> bool {
            event_type == "c"
        }

        fn subscriber_elsewhere(&self, stored: &str) -> bool {
            stored == "w"
        }

        fn decode(&self, event: &StoredEvent) -> Result<(), DecodeError> {
            Fake.decode(event)
        }

        fn park_delay(&self) -> Duration {
            Fake.park_delay()
        }
    }

    #[test]
    fn work_another_build_routes_is_given_back_and_its_subscribers_get_their_deliveries() {
        let plan = plan(
            vec![
                event(1, "c", 1),
                event(2, "a", 1),
                event(3, "a", 2),
                Claim::Delivery {
                    event: stored(4, "a", 3, "{}"),
                    subscriber: "w".to_owned(),
                    attempts: 0,
                    expired: 0,
                },
            ],
            &BesideAnother,
        );
        // A type only the other build routes: given back, unparked, with its aggregate's later
        // events; a delivery of the other build's subscriber: given back.
        assert_eq!(event_outcome(&plan, 0), &EventOutcome::Released);
        assert_eq!(event_outcome(&plan, 1), &EventOutcome::Released);
        assert_eq!(delivery_outcome(&plan, 3), &DeliveryOutcome::Released);
        // Its subscriber `w` takes `a` in the other build: a delivery that waits for it.
        let Planned::FanOut { slots, .. } = &plan.claims[2] else {
            panic!("a fan-out");
        };
        assert_eq!(
            slots,
            &[
                slot("x", Slot::Run, None),
                slot("y", Slot::Run, None),
                slot("w", Slot::Decided(DeliveryOutcome::Waiting), None),
            ]
        );
        assert_eq!(queues(&plan), vec![vec![(3, "x")], vec![(3, "y")]]);
    }

    #[test]
    fn an_event_that_cannot_be_decoded_stalls_its_aggregate_only() {
        let plan = plan(
            vec![
                event_with(stored(1, "a", 1, "bad"), &[]),
                event(2, "a", 1),
                event(3, "a", 2),
                event_with(stored(4, "a", 3, "new"), &[]),
                event(5, "zzz", 4),
                event(6, "b", 4),
                event(7, "b", 3),
            ],
            &Fake,
        );
        assert!(matches!(event_outcome(&plan, 0), EventOutcome::Dead { .. }));
        assert_eq!(event_outcome(&plan, 1), &EventOutcome::Released);
        assert!(matches!(
            event_outcome(&plan, 3),
            EventOutcome::Parked { retry_in, .. } if *retry_in == Duration::from_secs(300)
        ));
        let EventOutcome::Parked { reason, .. } = event_outcome(&plan, 4) else {
            panic!("an unknown type is parked");
        };
        assert_eq!(reason, "no subscriber in this build knows event type `zzz`");
        assert_eq!(event_outcome(&plan, 5), &EventOutcome::Released);
        assert_eq!(event_outcome(&plan, 6), &EventOutcome::Released);
        assert_eq!(queues(&plan), vec![vec![(3, "x")], vec![(3, "y")]]);
    }

    #[test]
    fn an_unreadable_event_of_no_known_aggregate_releases_every_later_event() {
        let plan = plan(
            vec![
                event(1, "a", 1),
                Claim::Unreadable {
                    id: 2,
                    subscriber: None,
                    aggregate: None,
                    reason: "bad timestamp".to_owned(),
                },
                event(3, "a", 2),
            ],
            &Fake,
        );
        let EventOutcome::Dead { reason } = event_outcome(&plan, 1) else {
            panic!("an unreadable event is dead");
        };
        assert_eq!(reason, "the stored event cannot be read: bad timestamp");
        assert_eq!(event_outcome(&plan, 2), &EventOutcome::Released);
        assert_eq!(queues(&plan).len(), 2);
    }

    #[test]
    fn a_delivery_its_build_cannot_route_is_parked_and_holds_its_key_back() {
        let plan = plan(
            vec![
                Claim::Delivery {
                    event: stored(1, "b", 1, "{}"),
                    subscriber: "y".to_owned(),
                    attempts: 2,
                    expired: 0,
                },
                event(2, "a", 1),
            ],
            &Fake,
        );
        let DeliveryOutcome::Retry {
            attempts, error, ..
        } = delivery_outcome(&plan, 0)
        else {
            panic!("parked as a retry");
        };
        assert_eq!(*attempts, 2, "parking spends no attempt");
        assert_eq!(
            error,
            "subscriber `y` does not take event type `b` in this build"
        );
        assert_eq!(queues(&plan), vec![vec![(2, "x")]]);
    }
}
