//! One batch: each claimed event goes to its subscribers in claim order; what must wait for an
//! earlier event of its aggregate waits; handlers start only while the batch's claim is held.

use std::collections::HashSet;

use uuid::Uuid;

use super::attempt::{Under, stored_text};
use super::lease::Lease;
use super::{BatchReport, Relay};
use crate::routing::Router;
use crate::store::{
    Claim, DeliveryOutcome, DeliveryRecord, EventOutcome, Outcomes, Store, StoredEvent,
};
use crate::telemetry::{self, status};

/// The label of events the store could not read, in metrics.
const UNREADABLE: &str = "(unreadable)";

/// Keys held back within one batch.
#[derive(Default)]
struct BatchState {
    /// (subscriber, aggregate type, aggregate id) keys that failed or waited in this batch: their
    /// later events wait.
    blocked: HashSet<(String, String, Uuid)>,
    /// Aggregates with an event parked or dead in this batch: their later events are released.
    stalled: HashSet<(String, Uuid)>,
    /// An event whose aggregate could not be read died in this batch: every later event is
    /// released, since any could be of its aggregate.
    stall_all: bool,
    /// The claim no longer lasts long enough to start a handler: the rest is released.
    out_of_lease: bool,
    /// Handler calls that succeeded.
    delivered: usize,
}

impl BatchState {
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

    fn is_blocked(&self, subscriber: &str, event: &StoredEvent) -> bool {
        !self.blocked.is_empty()
            && self.blocked.contains(&(
                subscriber.to_owned(),
                event.aggregate_type.clone(),
                event.aggregate_id,
            ))
    }

    fn block(&mut self, subscriber: &str, event: &StoredEvent) {
        self.blocked.insert((
            subscriber.to_owned(),
            event.aggregate_type.clone(),
            event.aggregate_id,
        ));
    }
}

impl<S: Store, R: Router> Relay<S, R> {
    /// Hands claimed events and deliveries to their subscribers, in order, while `lease` lasts.
    pub(super) async fn deliver_batch(
        &self,
        claims: Vec<Claim>,
        lease: &Lease,
    ) -> (BatchReport, Outcomes) {
        let mut report = BatchReport {
            claimed: claims.len(),
            ..BatchReport::default()
        };
        let mut state = BatchState::default();
        let mut outcomes = Outcomes::default();
        for claim in claims {
            match claim {
                Claim::Event { event, .. } if state.out_of_lease => {
                    outcomes.events.push((event.id, EventOutcome::Released));
                }
                Claim::Delivery {
                    event, subscriber, ..
                } if state.out_of_lease => {
                    outcomes
                        .deliveries
                        .push(record(&event, subscriber, DeliveryOutcome::Released));
                }
                Claim::Unreadable {
                    id,
                    subscriber,
                    aggregate,
                    reason,
                } => {
                    telemetry::dispatched(UNREADABLE, status::DEAD);
                    let reason = stored_text(format!("the stored event cannot be read: {reason}"));
                    tracing::error!(event_id = id, ?subscriber, %reason, "outbox dead letter");
                    let Some(subscriber) = subscriber else {
                        match aggregate {
                            Some(key) => {
                                state.stalled.insert(key);
                            }
                            None => state.stall_all = true,
                        }
                        outcomes.events.push((id, EventOutcome::Dead { reason }));
                        continue;
                    };
                    // One subscriber's delivery: its later events of the aggregate wait.
                    let (aggregate_type, aggregate_id) = aggregate.unwrap_or_default();
                    state.blocked.insert((
                        subscriber.clone(),
                        aggregate_type.clone(),
                        aggregate_id,
                    ));
                    outcomes.deliveries.push(DeliveryRecord {
                        event_id: id,
                        aggregate_type,
                        aggregate_id,
                        subscriber,
                        outcome: DeliveryOutcome::Dead {
                            attempts: 0,
                            error: reason,
                        },
                    });
                }
                Claim::Event {
                    event,
                    blocked,
                    expired,
                    ..
                } => {
                    let under = Under {
                        token: lease.token(),
                        expired_claims: expired,
                    };
                    self.fan_out(&event, &blocked, under, lease, &mut state, &mut outcomes)
                        .await;
                }
                Claim::Delivery {
                    event,
                    subscriber,
                    attempts,
                    expired,
                } => {
                    let under = Under {
                        token: lease.token(),
                        expired_claims: expired,
                    };
                    let outcome = self
                        .redeliver(&event, &subscriber, attempts, under, lease, &mut state)
                        .await;
                    outcomes
                        .deliveries
                        .push(record(&event, subscriber, outcome));
                }
            }
        }
        report.delivered = state.delivered;
        tally(&outcomes, &mut report);
        (report, outcomes)
    }

    /// Hands a pending event to each of its subscribers.
    async fn fan_out(
        &self,
        event: &StoredEvent,
        blocked: &[String],
        under: Under,
        lease: &Lease,
        state: &mut BatchState,
        outcomes: &mut Outcomes,
    ) {
        if state.is_stalled(event) {
            outcomes.events.push((event.id, EventOutcome::Released));
            return;
        }
        let Some(subscribers) = self.router.subscribers(&event.event_type) else {
            state.stall(event);
            telemetry::dispatched(&event.event_type, status::PARKED);
            outcomes.events.push((
                event.id,
                EventOutcome::Parked {
                    reason: stored_text(format!(
                        "no subscriber in this build knows event type `{}`",
                        event.event_type
                    )),
                    retry_in: self.park_delay(),
                },
            ));
            return;
        };
        let decoded = match self.decode(event) {
            Ok(decoded) => decoded,
            Err(error) => {
                state.stall(event);
                let reason = stored_text(error.to_string());
                let outcome = if error.may_decode_in_newer_build() {
                    telemetry::dispatched(&event.event_type, status::PARKED);
                    EventOutcome::Parked {
                        reason,
                        retry_in: self.park_delay(),
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
                outcomes.events.push((event.id, outcome));
                return;
            }
        };
        // The records of this event, dropped again if no handler of it ran before the lease ran
        // short (the event is then given back whole).
        let first_record = outcomes.deliveries.len();
        let mut ran = false;
        for &subscriber in subscribers {
            let held_back =
                blocked.iter().any(|b| b == subscriber) || state.is_blocked(subscriber, event);
            let outcome = if held_back || state.out_of_lease {
                DeliveryOutcome::Waiting
            } else if !lease.can_start(self.config.handler_timeout) {
                state.out_of_lease = true;
                if !ran {
                    outcomes.deliveries.truncate(first_record);
                    outcomes.events.push((event.id, EventOutcome::Released));
                    return;
                }
                DeliveryOutcome::Waiting
            } else {
                ran = true;
                match self.attempt(subscriber, event, &decoded, 1, under).await {
                    Ok(()) => {
                        state.delivered += 1;
                        continue;
                    }
                    Err(outcome) => outcome,
                }
            };
            state.block(subscriber, event);
            outcomes
                .deliveries
                .push(record(event, subscriber.to_owned(), outcome));
        }
        outcomes.events.push((event.id, EventOutcome::Published));
    }

    /// Attempts one pending delivery again.
    async fn redeliver(
        &self,
        event: &StoredEvent,
        subscriber: &str,
        attempts: u32,
        under: Under,
        lease: &Lease,
        state: &mut BatchState,
    ) -> DeliveryOutcome {
        if state.is_blocked(subscriber, event) {
            return DeliveryOutcome::Released;
        }
        let routed = self
            .router
            .subscribers(&event.event_type)
            .is_some_and(|subscribers| subscribers.contains(&subscriber));
        let outcome = if !routed {
            telemetry::dispatched(&event.event_type, status::PARKED);
            self.park_delivery(
                attempts,
                format!(
                    "subscriber `{subscriber}` does not take event type `{}` in this build",
                    event.event_type
                ),
            )
        } else {
            match self.decode(event) {
                Err(error) if error.may_decode_in_newer_build() => {
                    telemetry::dispatched(&event.event_type, status::PARKED);
                    self.park_delivery(attempts, error.to_string())
                }
                Err(error) => {
                    telemetry::dispatched(&event.event_type, status::DEAD);
                    DeliveryOutcome::Dead {
                        attempts,
                        error: stored_text(error.to_string()),
                    }
                }
                Ok(_) if !lease.can_start(self.config.handler_timeout) => {
                    state.out_of_lease = true;
                    return DeliveryOutcome::Released;
                }
                Ok(decoded) => {
                    let attempt = attempts.saturating_add(1);
                    match self
                        .attempt(subscriber, event, &decoded, attempt, under)
                        .await
                    {
                        Ok(()) => {
                            state.delivered += 1;
                            DeliveryOutcome::Delivered
                        }
                        Err(outcome) => outcome,
                    }
                }
            }
        };
        if outcome != DeliveryOutcome::Delivered {
            state.block(subscriber, event);
        }
        outcome
    }
}

fn record(event: &StoredEvent, subscriber: String, outcome: DeliveryOutcome) -> DeliveryRecord {
    DeliveryRecord {
        event_id: event.id,
        aggregate_type: event.aggregate_type.clone(),
        aggregate_id: event.aggregate_id,
        subscriber,
        outcome,
    }
}

fn tally(outcomes: &Outcomes, report: &mut BatchReport) {
    for (_, outcome) in &outcomes.events {
        match outcome {
            EventOutcome::Published => {}
            EventOutcome::Parked { .. } => report.parked += 1,
            EventOutcome::Dead { .. } => report.dead += 1,
            EventOutcome::Released => report.released += 1,
        }
    }
    for delivery in &outcomes.deliveries {
        match delivery.outcome {
            DeliveryOutcome::Delivered => {}
            DeliveryOutcome::Waiting => report.waiting += 1,
            DeliveryOutcome::Retry { .. } => report.retried += 1,
            DeliveryOutcome::Dead { .. } => report.dead += 1,
            DeliveryOutcome::Released => report.released += 1,
        }
    }
}
