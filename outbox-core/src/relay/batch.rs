//! One batch, run: the plan's queues run concurrently, up to the relay's concurrency, each in
//! order; a failure holds its key's later calls back; a handler starts only while the batch's
//! claim outlasts the handler timeout. Then the outcomes are put together in claim order.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;

use std::sync::Arc;

use futures_util::future::OptionFuture;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::instrument::WithSubscriber;
use uuid::Uuid;

use super::ahead::Progress;
use super::attempt::{Caller, Under};
use super::builds::Others;
use super::lease::Lease;
use super::plan::{self, Plan, Planned, Routes, Slot, Step};
use super::succession::Gate;
use super::{BatchReport, Map, Relay, Set};
use crate::error::DecodeError;
use crate::routing::{Decoded, Router};
use crate::store::{
    Claim, ClaimToken, DeliveryOutcome, DeliveryRecord, EventOutcome, Outcomes, Store, StoredEvent,
};

/// A relay's routes for planning one batch: its own, and what the other builds registered.
struct Planning<'a, S, R> {
    relay: &'a Relay<S, R>,
    others: Arc<Others>,
}

impl<S: Store, R: Router> Routes for Planning<'_, S, R> {
    type Decoded = Decoded;

    fn subscribers(&self, event_type: &str) -> Option<&[&'static str]> {
        self.relay.router.subscribers(event_type)
    }

    fn current_subscriber(&self, stored: &str) -> Option<&'static str> {
        self.relay
            .router
            .current_subscriber(stored)
            .or_else(|| self.others.alias(stored))
    }

    fn foreign_subscribers(&self, event_type: &str) -> &[String] {
        self.others.foreign_subscribers(event_type)
    }

    fn routed_elsewhere(&self, event_type: &str) -> bool {
        self.others.routes_event(event_type)
    }

    fn subscriber_elsewhere(&self, stored: &str) -> bool {
        self.others.has_subscriber(stored)
    }

    fn decode(&self, event: &StoredEvent) -> Result<Decoded, DecodeError> {
        Relay::decode(self.relay, event)
    }

    fn park_delay(&self) -> Duration {
        self.relay.config.park_delay
    }
}

/// What became of one planned handler call.
#[derive(Debug)]
enum Ran {
    Delivered,
    Failed(DeliveryOutcome),
    /// Not called: an earlier call of its key failed in this batch.
    Behind,
    /// Not called: the claim no longer outlasted the handler timeout.
    NoLease,
}

impl Ran {
    fn called(&self) -> bool {
        matches!(self, Ran::Delivered | Ran::Failed(_))
    }
}

/// How long no call of a batch may end, with call slots idle, before the keys still running
/// (slow calls) count as holding it back: long beside a call of a busy batch and a claim (well
/// under a millisecond apart, and a few milliseconds), short beside what other aggregates'
/// events should wait for.
pub(super) const STALLED_AFTER: Duration = Duration::from_millis(50);

/// Where a batch that may be recorded in parts sends its first part.
pub(super) type SplitTx = tokio::sync::oneshot::Sender<(BatchReport, Outcomes, Clean)>;

/// The aggregates of a batch (or part) whose work in it was all done: every event of theirs
/// published, every handler call delivered. A claim beside its record may take them over
/// ([`TakeOver`](crate::store::TakeOver)).
pub(super) type Clean = Vec<(String, Uuid)>;

impl<S: Store, R: Router> Relay<S, R> {
    /// Hands claimed events and deliveries to their subscribers, in order per key, while `lease`
    /// lasts, at most `permits` calls at once (the permits may be shared with other batches).
    ///
    /// With `split`, once the keys still running hold the batch back ([`Calls::held_back`]:
    /// they only wait for retries in place, or no call ended for [`STALLED_AFTER`] while call
    /// slots were idle), the outcomes of the aggregates that are done are sent there, even if
    /// none is: the delivery loop records them at once (their later events need not wait) and
    /// claims more work beside the rest, which this returns. Each time the keys left hold it
    /// back again, the rest records the aggregates done meanwhile itself, and tells the loop
    /// ([`Relay::freed`]). Once the batch after is claimed ahead and a call slot is idle
    /// ([`Calls::leaves_room`]), an empty first part is sent, so that the loop starts that batch
    /// beside this one's last calls; what is done is then recorded with the rest.
    pub(super) async fn deliver_batch(
        &self,
        plan: Plan<Decoded>,
        lease: Arc<Lease>,
        progress: Arc<Progress>,
        permits: Arc<Semaphore>,
        mut split: Option<SplitTx>,
        gate: Option<Arc<Gate>>,
    ) -> (BatchReport, Outcomes, Clean) {
        let claimed = plan.claims.len();
        let plan = Arc::new(plan);
        progress.planned(plan.queues.iter().map(Vec::len).sum());
        // A part is whole aggregates: a claim whose aggregate could not be read keeps the
        // batch whole.
        if plan.claims.iter().any(|claim| claim.aggregate().is_none()) {
            split = None;
        }
        let calls = Arc::new(Calls {
            gate: gate.clone(),
            permits,
            out_of_lease: AtomicBool::new(false),
            retried_in_place: AtomicUsize::new(0),
            progress: Arc::clone(&progress),
            running: AtomicUsize::new(plan.queues.len()),
            waiting: AtomicUsize::new(0),
            started: Instant::now(),
            last_end: AtomicU64::new(0),
            held_back: Notify::new(),
        });
        // Each queue's calls as it ends; the runners' asks for one more.
        let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel();
        let (more_tx, mut more) = tokio::sync::mpsc::unbounded_channel();
        // Fires STALLED_AFTER after the last call's end, if no call ended since: then it is
        // set again, as long as the batch runs.
        let stall = tokio::time::sleep(STALLED_AFTER);
        tokio::pin!(stall);
        // The queues run in runners, tasks of their own (aborted if the batch is dropped), as
        // many as calls may run at once: each takes the next queue not started, runs it, and
        // goes on to the next with the permit it holds, so that a call slot passes from one
        // key to the next without waiting for another task to be polled. A runner about to
        // wait (a retry in place, a take-over) asks for one more runner, so that the keys not
        // started do not wait for it; the permits bound the calls running.
        let caller = Arc::new(self.caller());
        let runners = Runners {
            caller: Arc::clone(&caller),
            plan: Arc::clone(&plan),
            lease: Arc::clone(&lease),
            calls: Arc::clone(&calls),
            next: Arc::new(AtomicUsize::new(0)),
            ended: ended_tx,
            more: more_tx,
        };
        let mut running = JoinSet::new();
        for _ in 0..self.config.concurrency.clamp(1, plan.queues.len().max(1)) {
            runners.spawn(&mut running);
        }
        let mut ran: Vec<Option<Vec<(Step, Ran)>>> = plan.queues.iter().map(|_| None).collect();
        let parts = split.is_some();
        // The aggregates recorded in parts: the first one sent to `split`, the later ones
        // recorded from here, one at a time, as more aggregates are done.
        let mut recorded: Set<(&str, Uuid)> = Set::default();
        let mut recording: Option<Pin<Box<dyn Future<Output = bool> + Send + '_>>> = None;
        let mut parts_recorded = true;
        // Whether a queue ended since the aggregates done were last looked for (at first:
        // aggregates without queues are done).
        let mut queue_ended = true;
        loop {
            tokio::select! {
                biased;
                Some((index, result)) = ended.recv() => {
                    ran[index] = Some(result);
                    queue_ended = true;
                }
                Some(()) = more.recv() => runners.spawn(&mut running),
                next = running.join_next() => match next {
                    Some(Ok(())) => {}
                    // A panic in the relay's own code (handlers' panics are caught) goes on
                    // as it would have in this task.
                    Some(Err(error)) if error.is_panic() => {
                        std::panic::resume_unwind(error.into_panic())
                    }
                    // Every runner ended: every queue's calls were sent before.
                    None => {
                        while let Ok((index, result)) = ended.try_recv() {
                            ran[index] = Some(result);
                        }
                        break;
                    }
                    // Cancelled: the runtime shuts down. The calls of the queues not reported
                    // are recorded as not made (waiting deliveries, or given back), as those
                    // of a batch cut short; without a record, its claim's expiry gives them
                    // back.
                    Some(Err(_)) => break,
                },
                Some(applied) = OptionFuture::from(recording.as_mut()) => {
                    recording = None;
                    parts_recorded &= applied;
                }
                () = calls.held_back.notified(), if parts => {}
                () = progress.next_claimed_told(), if parts => {}
                () = &mut stall, if parts => {
                    let now = Instant::now();
                    let next = calls.last_end() + STALLED_AFTER;
                    stall.as_mut().reset(if next > now { next } else { now + STALLED_AFTER });
                }
            }
            caller.count_dispatched();
            // (Checked after each event: a part record ending, or a queue, may leave the
            // batch held back, with more aggregates done.)
            if !parts || recording.is_some() || !parts_recorded {
                continue;
            }
            // (The batch claimed ahead starts beside this one's last calls through an empty
            // first part: the aggregates done are recorded with the rest, as they would have
            // been with the whole batch, for no record more.)
            // (Without a queue ended since the last look, no aggregate is done that was not.)
            let held_back = queue_ended && calls.held_back();
            let room = split.is_some() && calls.leaves_room();
            if !(held_back || room) {
                continue;
            }
            let mut done = match held_back {
                true => {
                    queue_ended = false;
                    done_aggregates(&plan, &ran)
                }
                false => Set::default(),
            };
            done.retain(|a| !recorded.contains(a));
            // (The first part goes to the delivery loop even when empty: the loop then claims
            // other aggregates' work instead of waiting for these keys.)
            if done.is_empty() && split.is_none() {
                continue;
            }
            let part: Vec<Vec<(Step, Ran)>> = ran
                .iter_mut()
                .filter_map(|r| {
                    r.take_if(|r| {
                        r.first().is_some_and(|(step, _)| {
                            plan.claims[step.claim]
                                .aggregate()
                                .is_some_and(|a| done.contains(&a))
                        })
                    })
                })
                .collect();
            let (report, outcomes, clean) = self.report(
                &plan,
                part,
                claimed,
                &lease,
                &|a| done.contains(&a),
                gate.as_deref(),
            );
            self.settle(lease.token(), &plan, &|a| done.contains(&a), &clean);
            recorded.extend(done);
            match split.take() {
                // (The receiver gone: the batch is over for its loop anyway.)
                Some(split) => drop(split.send((report, outcomes, clean))),
                None => {
                    let token = lease.token();
                    recording = Some(Box::pin(async move {
                        let applied = self.record_clean(token, &outcomes, true, &clean).await;
                        if applied {
                            self.freed.notify_one();
                        }
                        applied
                    }));
                }
            }
        }
        caller.count_dispatched();
        if let Some(recording) = recording {
            parts_recorded &= recording.await;
        }
        let ran: Vec<Vec<(Step, Ran)>> = ran.into_iter().flatten().collect();
        let (mut report, mut outcomes, mut clean) = self.report(
            &plan,
            ran,
            claimed,
            &lease,
            &|a| !recorded.contains(&a),
            gate.as_deref(),
        );
        if !parts_recorded {
            // A part's record failed: its deliveries stay marked with this claim, which only
            // its expiry gives back; recording the rest would end the claim first. Nothing
            // more is recorded, and the claim's work is delivered again when it expires.
            outcomes = Outcomes::default();
            clean = Clean::new();
        }
        self.settle(lease.token(), &plan, &|a| !recorded.contains(&a), &clean);
        report.retried_in_place = calls.retried_in_place.load(Ordering::Relaxed);
        (report, outcomes, clean)
    }

    /// The outcomes of the claims of `plan` whose aggregate is `in_part`, from the calls `ran`,
    /// their report, and their clean aggregates. The claims of aggregates the `gate` gives back
    /// are given back.
    fn report(
        &self,
        plan: &Plan<Decoded>,
        ran: Vec<Vec<(Step, Ran)>>,
        claimed: usize,
        lease: &Lease,
        in_part: &dyn Fn((&str, Uuid)) -> bool,
        gate: Option<&Gate>,
    ) -> (BatchReport, Outcomes, Clean) {
        let given_back = |a: (&str, Uuid)| gate.is_some_and(|gate| gate.gives_back(a));
        // (Only a store that takes them over needs the clean aggregates.)
        let (delivered, outcomes, clean) = assemble_with(
            plan,
            ran,
            in_part,
            &given_back,
            self.store.claims_take_over(),
        );
        let mut report = BatchReport {
            claimed,
            delivered,
            lost: lease.is_lost(),
            ..BatchReport::default()
        };
        tally(&outcomes, &mut report);
        (report, outcomes, clean)
    }

    /// Tells the successions that the calls of claim `token` on the aggregates of `plan` that
    /// `in_part` names are over, and which ended clean.
    fn settle(
        &self,
        token: ClaimToken,
        plan: &Plan<Decoded>,
        in_part: &dyn Fn((&str, Uuid)) -> bool,
        clean: &Clean,
    ) {
        if !self.store.claims_take_over() {
            return;
        }
        let clean: Set<(&str, Uuid)> = clean.iter().map(|(t, id)| (t.as_str(), *id)).collect();
        let part = plan
            .claims
            .iter()
            .filter_map(Planned::aggregate)
            .filter(|&a| in_part(a));
        self.successions
            .settled(token, part, |a| clean.contains(&a));
    }

    pub(super) fn plan(&self, claims: Vec<Claim>) -> Plan<Decoded> {
        let planning = Planning {
            relay: self,
            others: self.builds.others(),
        };
        plan::plan(claims, &planning)
    }

    /// The outcomes of a claimed batch given back unstarted (a relay stopping with a batch it
    /// claimed ahead): what needs no handler is decided, every handler call is left as if the
    /// lease had run short.
    pub(super) fn give_back(&self, plan: &Plan<Decoded>) -> Outcomes {
        let ran = plan
            .queues
            .iter()
            .map(|queue| queue.iter().map(|&step| (step, Ran::NoLease)).collect())
            .collect();
        assemble_with(plan, ran, &|_| true, &|_| false, false).1
    }
}

/// What the runners of one batch share.
struct Runners<R> {
    caller: Arc<Caller<R>>,
    plan: Arc<Plan<Decoded>>,
    lease: Arc<Lease>,
    calls: Arc<Calls>,
    /// The next queue no runner took.
    next: Arc<AtomicUsize>,
    /// Each queue's calls, as it ends.
    ended: UnboundedSender<(usize, Vec<(Step, Ran)>)>,
    /// A runner's ask for one more, as it is about to wait.
    more: UnboundedSender<()>,
}

impl<R: Router> Runners<R> {
    /// Adds a runner, if a queue is left for it.
    fn spawn(&self, running: &mut JoinSet<()>) {
        if self.next.load(Ordering::Relaxed) >= self.plan.queues.len() {
            return;
        }
        let runner = Runners {
            caller: Arc::clone(&self.caller),
            plan: Arc::clone(&self.plan),
            lease: Arc::clone(&self.lease),
            calls: Arc::clone(&self.calls),
            next: Arc::clone(&self.next),
            ended: self.ended.clone(),
            more: self.more.clone(),
        };
        running.spawn(runner.run().in_current_span().with_current_subscriber());
    }

    /// Runs the queues no runner took, one after the other, until none is left.
    async fn run(self) {
        let mut permit = None;
        loop {
            let index = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(queue) = self.plan.queues.get(index) else {
                return;
            };
            let ran = run_steps(
                &self.caller,
                &self.plan,
                queue,
                &self.lease,
                &self.calls,
                &mut permit,
                // (The receiver gone: the batch is over.)
                &|| {
                    let _ = self.more.send(());
                },
            )
            .await;
            self.calls.running.fetch_sub(1, Ordering::Relaxed);
            // (The receiver gone: the batch is over.)
            if self.ended.send((index, ran)).is_err() {
                return;
            }
            // A permit kept while no queue is left would hold a call slot idle.
            if self.next.load(Ordering::Relaxed) >= self.plan.queues.len() {
                drop(permit.take());
            }
            self.calls.note_waiting();
        }
    }
}

/// Makes one key's calls in order until one fails; the rest are held back. The key holds
/// one of the batch's permits while its calls run (`permit`, which its runner may hold
/// already and keeps for the next key). A failure whose retry is due within the
/// [in-place limit](crate::RelayConfig::with_retry_in_place) is waited for (without a
/// permit) and retried here, if the claim outlasts the wait and the handler timeout. Before
/// any wait, `waiting` is called (the runner asks for one more).
async fn run_steps<R: Router>(
    caller: &Caller<R>,
    plan: &Plan<Decoded>,
    queue: &[Step],
    lease: &Lease,
    calls: &Calls,
    permit: &mut Option<OwnedSemaphorePermit>,
    waiting: &(dyn Fn() + Sync),
) -> Vec<(Step, Ran)> {
    let mut ran = Vec::with_capacity(queue.len());
    // A key of an aggregate taken over from an earlier claim waits for that claim's work
    // on it to be recorded clean (as for a retry in place, the batch may split meanwhile);
    // otherwise none of its events' calls is made (their claims are given back). Its
    // deliveries (claimed as due, with or without the take-over) run as they would have.
    let aggregate = queue
        .first()
        .and_then(|step| plan.claims[step.claim].aggregate());
    let mut events_given_back = false;
    if let (Some(gate), Some(aggregate)) = (&calls.gate, aggregate)
        && gate.holds(aggregate)
    {
        // (Counted as waiting, as for a retry in place, if the calls before still ran:
        // the batch may split meanwhile. Not for a record under way, which is quick.)
        let counted = gate.waits_on_calls(aggregate);
        drop(permit.take());
        waiting();
        if counted {
            calls.waiting.fetch_add(1, Ordering::Relaxed);
            calls.note_waiting();
        }
        let clean = gate.wait(aggregate).await;
        if counted {
            calls.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        events_given_back = !clean;
    }
    let mut failed = false;
    // Held from the key's first call to its last, as a worker would hold the key, but
    // while it waits for a retry. (The semaphore is never closed.)
    for &step in queue {
        if events_given_back && matches!(plan.claims[step.claim], Planned::FanOut { .. }) {
            calls.ran(&mut ran, step, Ran::NoLease);
            continue;
        }
        if failed {
            calls.ran(&mut ran, step, Ran::Behind);
            continue;
        }
        if permit.is_none() {
            *permit = Arc::clone(&calls.permits).acquire_owned().await.ok();
        }
        if !calls.can_start(lease, caller.config.handler_timeout) {
            calls.ran(&mut ran, step, Ran::NoLease);
            continue;
        }
        let (event, decoded, subscriber, attempt, expired) = match &plan.claims[step.claim] {
            Planned::FanOut {
                event,
                decoded,
                expired,
                slots,
            } => (event, decoded, &*slots[step.slot].subscriber, 1, *expired),
            Planned::Again {
                event,
                decoded,
                current,
                attempts,
                expired,
                ..
            } => (
                event,
                decoded,
                *current,
                attempts.saturating_add(1),
                *expired,
            ),
            Planned::Event { .. } | Planned::Delivery(_) => {
                unreachable!("the plan queues only handler calls")
            }
        };
        let under = Under {
            token: lease.token(),
            expired_claims: expired,
        };
        let mut attempt = attempt;
        let result = loop {
            let outcome = match caller
                .attempt(subscriber, event, decoded, attempt, under)
                .await
            {
                Ok(()) => break Ran::Delivered,
                Err(outcome) => outcome,
            };
            let in_place = match &outcome {
                DeliveryOutcome::Retry {
                    attempts, retry_in, ..
                } if *retry_in <= caller.config.retry_in_place
                    && lease.can_start(*retry_in + caller.config.handler_timeout) =>
                {
                    Some((*attempts, *retry_in))
                }
                _ => None,
            };
            let Some((attempts, retry_in)) = in_place else {
                failed = true;
                break Ran::Failed(outcome);
            };
            calls.retried_in_place.fetch_add(1, Ordering::Relaxed);
            // Other keys' calls run meanwhile.
            drop(permit.take());
            waiting();
            calls.waiting.fetch_add(1, Ordering::Relaxed);
            calls.note_waiting();
            tokio::time::sleep(retry_in).await;
            calls.waiting.fetch_sub(1, Ordering::Relaxed);
            *permit = Arc::clone(&calls.permits).acquire_owned().await.ok();
            if !calls.can_start(lease, caller.config.handler_timeout) {
                // Written down as the failure it was, due about now.
                failed = true;
                break Ran::Failed(outcome);
            }
            attempt = attempts.saturating_add(1);
        };
        calls.ran(&mut ran, step, result);
    }
    ran
}

/// What the queues of one batch share.
struct Calls {
    /// What it took over from the claim before.
    gate: Option<Arc<Gate>>,
    /// The handler calls that may run at once: the relay's concurrency.
    permits: Arc<Semaphore>,
    /// Set once a call could not start for want of lease: no more start.
    out_of_lease: AtomicBool,
    retried_in_place: AtomicUsize,
    progress: Arc<Progress>,
    /// Queues not done.
    running: AtomicUsize,
    /// Queues waiting for a retry in place.
    waiting: AtomicUsize,
    /// When the batch started.
    started: Instant,
    /// When the last call ended, in microseconds after `started` (0: none yet).
    last_end: AtomicU64,
    /// Told when [`held_back`](Self::held_back) may have become true.
    held_back: Notify,
}

impl Calls {
    /// Whether the queues not done hold the batch back, so that the aggregates done should be
    /// recorded and the relay claim more beside it: every one of them waits for a retry in
    /// place (and one does), or a queue still runs, no call ended for [`STALLED_AFTER`] and no
    /// call waits for a permit (a free permit is a call slot left idle: waiting calls get
    /// permits first).
    fn held_back(&self) -> bool {
        let (waiting, running) = (
            self.waiting.load(Ordering::Relaxed),
            self.running.load(Ordering::Relaxed),
        );
        (waiting > 0 && waiting == running)
            || (running > 0
                && self.last_end().elapsed() >= STALLED_AFTER
                && self.permits.available_permits() > 0)
    }

    /// Whether the batch claimed ahead of this one should start beside its last calls: it is
    /// claimed, and a call slot is idle (no call of this batch waits for a permit).
    fn leaves_room(&self) -> bool {
        self.running.load(Ordering::Relaxed) > 0
            && self.progress.is_next_claimed()
            && self.permits.available_permits() > 0
    }

    /// When the last call ended (the batch's start if none has).
    fn last_end(&self) -> Instant {
        self.started + Duration::from_micros(self.last_end.load(Ordering::Relaxed))
    }

    /// Tells the batch when a queue starts waiting for a retry in place and that holds it
    /// back.
    fn note_waiting(&self) {
        if self.held_back() || self.leaves_room() {
            self.held_back.notify_one();
        }
    }

    /// Notes what became of a planned call.
    fn ran(&self, ran: &mut Vec<(Step, Ran)>, step: Step, result: Ran) {
        let ended = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.last_end.fetch_max(ended, Ordering::Relaxed);
        ran.push((step, result));
        self.progress.finished_one();
    }

    /// Whether a handler may start: the claim outlasts its timeout (and did for every call
    /// before).
    fn can_start(&self, lease: &Lease, handler_timeout: Duration) -> bool {
        if self.out_of_lease.load(Ordering::Relaxed) || !lease.can_start(handler_timeout) {
            self.out_of_lease.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }
}

/// Puts the outcomes of a run plan together, in claim order; returns the handler calls that
/// succeeded, and the outcomes.
///
/// An event none of whose handlers was called because the lease ran short is given back whole,
/// unless a later claim of its aggregate in the batch was kept (recorded other than released):
/// then it is published with its deliveries waiting, so that its aggregate's order holds.
///
/// Only the claims whose aggregate is `in_part` are assembled (`ran` has their calls): a batch
/// recorded in parts is split by aggregate.
#[cfg(test)]
fn assemble<D>(
    plan: &Plan<D>,
    ran: Vec<Vec<(Step, Ran)>>,
    in_part: &dyn Fn((&str, Uuid)) -> bool,
) -> (usize, Outcomes) {
    let (delivered, outcomes, _) = assemble_with(plan, ran, in_part, &|_| false, false);
    (delivered, outcomes)
}

/// [`assemble`], giving back every claim of the aggregates `given_back` names; also returns,
/// if `find_clean`, the aggregates whose claims all ended clean (each event published, each
/// call delivered).
fn assemble_with<D>(
    plan: &Plan<D>,
    ran: Vec<Vec<(Step, Ran)>>,
    in_part: &dyn Fn((&str, Uuid)) -> bool,
    given_back: &dyn Fn((&str, Uuid)) -> bool,
    find_clean: bool,
) -> (usize, Outcomes, Clean) {
    // Result slots for the claims of the part only: a batch records many parts when keys
    // wait for retries in place, and each part's calls are of its own claims. (The others'
    // outcomes are not assembled here, and whether a claim is given back whole depends on
    // its own aggregate's claims only.)
    let mut results: Vec<Vec<Option<Ran>>> = plan
        .claims
        .iter()
        .map(|claim| match claim {
            _ if !claim.aggregate().is_none_or(in_part) => Vec::new(),
            Planned::FanOut { slots, .. } => slots.iter().map(|_| None).collect(),
            Planned::Again { .. } => vec![None],
            Planned::Event { .. } | Planned::Delivery(_) => Vec::new(),
        })
        .collect();
    let mut delivered = 0;
    for (step, result) in ran.into_iter().flatten() {
        delivered += usize::from(matches!(result, Ran::Delivered));
        results[step.claim][step.slot] = Some(result);
    }
    let release_whole = given_back_whole(&plan.claims, &results);
    let mut outcomes = Outcomes::default();
    // Per aggregate of the part, in order: whether every claim of it so far ended clean.
    let mut clean: Vec<((&str, Uuid), bool)> = Vec::new();
    let mut seen: Map<(&str, Uuid), usize> = Map::default();
    for ((claim, results), release) in plan.claims.iter().zip(results).zip(release_whole) {
        let aggregate = claim.aggregate();
        if !aggregate.is_none_or(in_part) {
            continue;
        }
        // (Only events are given back: a delivery was claimed as due, as it would have been
        // without the take-over.)
        let given_back = matches!(claim, Planned::Event { .. } | Planned::FanOut { .. })
            && aggregate.is_some_and(given_back);
        let ended_clean = find_clean
            && !given_back
            && match claim {
                Planned::Event { outcome, .. } => *outcome == EventOutcome::Published,
                Planned::Delivery(record) => record.outcome == DeliveryOutcome::Delivered,
                Planned::FanOut { slots, .. } => {
                    !release
                        && slots.iter().zip(&results).all(|(slot, result)| {
                            matches!((&slot.slot, result), (Slot::Run, Some(Ran::Delivered)))
                        })
                }
                Planned::Again { .. } => matches!(results.first(), Some(Some(Ran::Delivered))),
            };
        if let Some(aggregate) = aggregate.filter(|_| find_clean) {
            let index = *seen.entry(aggregate).or_insert_with(|| {
                clean.push((aggregate, true));
                clean.len() - 1
            });
            clean[index].1 &= ended_clean;
        }
        match claim {
            // (Its calls were not made: the work before it did not end recorded and clean.)
            Planned::Event { id, .. } if given_back => {
                outcomes.events.push((*id, EventOutcome::Released));
            }
            Planned::FanOut { event, .. } if given_back => {
                outcomes.events.push((event.id, EventOutcome::Released));
            }
            Planned::Event { id, outcome, .. } => outcomes.events.push((*id, outcome.clone())),
            Planned::Delivery(record) => outcomes.deliveries.push(record.clone()),
            Planned::FanOut { event, .. } if release => {
                outcomes.events.push((event.id, EventOutcome::Released));
            }
            Planned::FanOut { event, slots, .. } => {
                for (slot, result) in slots.iter().zip(results) {
                    let subscriber = slot.stored_name().to_owned();
                    let outcome = match (&slot.slot, result) {
                        (Slot::Decided(outcome), _) => outcome.clone(),
                        (Slot::Run, Some(Ran::Delivered)) => continue,
                        (Slot::Run, Some(Ran::Failed(outcome))) => outcome,
                        (Slot::Run, _) => DeliveryOutcome::Waiting,
                    };
                    outcomes.deliveries.push(record(event, subscriber, outcome));
                }
                outcomes.events.push((event.id, EventOutcome::Published));
            }
            Planned::Again {
                event, subscriber, ..
            } => {
                let outcome = match results.into_iter().next().flatten() {
                    Some(Ran::Delivered) => DeliveryOutcome::Delivered,
                    Some(Ran::Failed(outcome)) => outcome,
                    _ => DeliveryOutcome::Released,
                };
                outcomes
                    .deliveries
                    .push(record(event, subscriber.clone(), outcome));
            }
        }
    }
    let clean = clean
        .into_iter()
        .filter(|(_, clean)| *clean)
        .map(|((aggregate_type, id), _)| (aggregate_type.to_owned(), id))
        .collect();
    (delivered, outcomes, clean)
}

/// The aggregates of `plan` none of whose queues is still running (`ran` has the results of
/// the queues done, by index).
fn done_aggregates<'p, D>(
    plan: &'p Plan<D>,
    ran: &[Option<Vec<(Step, Ran)>>],
) -> Set<(&'p str, Uuid)> {
    let busy: Set<(&str, Uuid)> = plan
        .queues
        .iter()
        .zip(ran)
        .filter(|(_, ran)| ran.is_none())
        .filter_map(|(queue, _)| queue.first())
        .filter_map(|step| plan.claims[step.claim].aggregate())
        .collect();
    plan.claims
        .iter()
        .filter_map(Planned::aggregate)
        .filter(|aggregate| !busy.contains(aggregate))
        .collect()
}

/// Which fanned-out events are given back whole: none of their handlers was called, one for
/// want of lease, and no later claim of their aggregate is kept.
fn given_back_whole<D>(claims: &[Planned<D>], results: &[Vec<Option<Ran>>]) -> Vec<bool> {
    let mut kept: Set<(&str, Uuid)> = Set::default();
    let mut kept_all = false;
    let mut release = vec![false; claims.len()];
    for (index, claim) in claims.iter().enumerate().rev() {
        let results = &results[index];
        let (aggregate, is_kept) = match claim {
            Planned::Event {
                aggregate, outcome, ..
            } => (
                aggregate.as_ref().map(|(t, id)| (t.as_str(), *id)),
                *outcome != EventOutcome::Released,
            ),
            Planned::Delivery(record) => (
                Some((record.aggregate_type.as_str(), record.aggregate_id)),
                record.outcome != DeliveryOutcome::Released,
            ),
            Planned::Again { event, .. } => (
                Some((event.aggregate_type.as_str(), event.aggregate_id)),
                results.iter().flatten().any(Ran::called),
            ),
            Planned::FanOut { event, .. } => {
                let aggregate = (event.aggregate_type.as_str(), event.aggregate_id);
                let called = results.iter().flatten().any(Ran::called);
                let short = results.iter().flatten().any(|r| matches!(r, Ran::NoLease));
                release[index] = !called && short && !kept_all && !kept.contains(&aggregate);
                (Some(aggregate), !release[index])
            }
        };
        if is_kept {
            match aggregate {
                Some(aggregate) => {
                    kept.insert(aggregate);
                }
                None => kept_all = true,
            }
        }
    }
    release
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

#[cfg(test)]
mod tests {
    use time::OffsetDateTime;

    use super::*;
    use crate::relay::plan::FanOutSlot;

    fn fan_out(id: i64, aggregate: u128, slots: &[&'static str]) -> Planned<()> {
        Planned::FanOut {
            event: StoredEvent {
                id,
                aggregate_type: "t".to_owned(),
                aggregate_id: Uuid::from_u128(aggregate),
                event_type: "e".to_owned(),
                payload: "{}".to_owned(),
                occurred_at: OffsetDateTime::UNIX_EPOCH,
            },
            decoded: (),
            expired: 0,
            slots: slots
                .iter()
                .map(|s| FanOutSlot {
                    subscriber: (*s).into(),
                    slot: Slot::Run,
                    record_as: None,
                })
                .collect(),
        }
    }

    fn step(claim: usize, slot: usize, ran: Ran) -> (Step, Ran) {
        (Step { claim, slot }, ran)
    }

    /// The aggregates a claim beside a batch's record may take over are those whose every call
    /// was delivered; the claims of aggregates taken over whose record was not applied are all
    /// given back, called or not.
    #[test]
    fn clean_aggregates_are_taken_over_and_given_back_whole() {
        // Aggregate 1: events 10 and 12 for x; aggregate 2: event 11 for x and y.
        let plan = Plan {
            claims: vec![
                fan_out(10, 1, &["x"]),
                fan_out(11, 2, &["x", "y"]),
                fan_out(12, 1, &["x"]),
            ],
            queues: vec![
                vec![Step { claim: 0, slot: 0 }, Step { claim: 2, slot: 0 }],
                vec![Step { claim: 1, slot: 0 }],
                vec![Step { claim: 1, slot: 1 }],
            ],
        };
        let ran = || {
            vec![
                vec![step(0, 0, Ran::Delivered), step(2, 0, Ran::Delivered)],
                vec![step(1, 0, Ran::Delivered)],
                vec![step(
                    1,
                    1,
                    Ran::Failed(DeliveryOutcome::Retry {
                        attempts: 1,
                        error: "no".to_owned(),
                        retry_in: Duration::from_secs(1),
                    }),
                )],
            ]
        };
        let (_, _, clean) = assemble_with(&plan, ran(), &|_| true, &|_| false, true);
        assert_eq!(clean, [("t".to_owned(), Uuid::from_u128(1))]);

        let one = ("t", Uuid::from_u128(1));
        let (_, outcomes, clean) = assemble_with(&plan, ran(), &|_| true, &|a| a == one, true);
        assert_eq!(
            outcomes.events,
            [
                (10, EventOutcome::Released),
                (11, EventOutcome::Published),
                (12, EventOutcome::Released)
            ]
        );
        assert!(clean.is_empty(), "{clean:?}");
    }

    #[test]
    fn a_batch_is_recorded_in_parts_of_whole_aggregates() {
        // Aggregate 1: events 10 and 12 for x and y; aggregate 2: event 11 for x and y.
        let plan = Plan {
            claims: vec![
                fan_out(10, 1, &["x", "y"]),
                fan_out(11, 2, &["x", "y"]),
                fan_out(12, 1, &["x", "y"]),
            ],
            queues: vec![
                vec![Step { claim: 0, slot: 0 }, Step { claim: 2, slot: 0 }],
                vec![Step { claim: 0, slot: 1 }, Step { claim: 2, slot: 1 }],
                vec![Step { claim: 1, slot: 0 }],
                vec![Step { claim: 1, slot: 1 }],
            ],
        };
        let delivered = |queue: &[Step]| -> Vec<(Step, Ran)> {
            queue.iter().map(|&step| (step, Ran::Delivered)).collect()
        };
        // Aggregate 1's two queues are done; aggregate 2's y still runs (waits for a retry).
        let mut ran: Vec<Option<Vec<(Step, Ran)>>> = vec![
            Some(delivered(&plan.queues[0])),
            Some(delivered(&plan.queues[1])),
            Some(delivered(&plan.queues[2])),
            None,
        ];
        let done = done_aggregates(&plan, &ran);
        let one = ("t", Uuid::from_u128(1));
        assert_eq!(done, Set::from_iter([one]));

        let part: Vec<_> = [ran[0].take().unwrap(), ran[1].take().unwrap()].into();
        let (succeeded, first) = assemble(&plan, part, &|a| done.contains(&a));
        assert_eq!(succeeded, 4);
        assert_eq!(
            first.events,
            [(10, EventOutcome::Published), (12, EventOutcome::Published)]
        );
        assert!(first.deliveries.is_empty());

        // The rest: aggregate 2, its x call done before the split, its y call failed after.
        ran[3] = Some(vec![step(
            1,
            1,
            Ran::Failed(DeliveryOutcome::Retry {
                attempts: 2,
                error: "no".to_owned(),
                retry_in: Duration::from_secs(1),
            }),
        )]);
        let rest: Vec<_> = ran.into_iter().flatten().collect();
        let (succeeded, rest) = assemble(&plan, rest, &|a| !done.contains(&a));
        assert_eq!(succeeded, 1);
        assert_eq!(rest.events, [(11, EventOutcome::Published)]);
        let deliveries: Vec<(i64, &str)> = rest
            .deliveries
            .iter()
            .map(|d| (d.event_id, d.subscriber.as_str()))
            .collect();
        assert_eq!(deliveries, [(11, "y")]);
    }

    #[test]
    fn an_event_short_of_lease_is_given_back_unless_a_later_one_of_its_aggregate_is_kept() {
        // 0: aggregate 1, y only, short of lease; 1: aggregate 1, x delivered and y short;
        // 2: aggregate 2, short of lease; 3: aggregate 2, x failed before the lease ran short.
        let plan = Plan {
            claims: vec![
                fan_out(10, 1, &["y"]),
                fan_out(11, 1, &["x", "y"]),
                fan_out(12, 3, &["x"]),
                fan_out(13, 2, &["x"]),
            ],
            queues: Vec::new(),
        };
        let ran = vec![vec![
            step(0, 0, Ran::NoLease),
            step(1, 0, Ran::Delivered),
            step(1, 1, Ran::NoLease),
            step(2, 0, Ran::NoLease),
            step(
                3,
                0,
                Ran::Failed(DeliveryOutcome::Dead {
                    attempts: 1,
                    error: "no".to_owned(),
                }),
            ),
        ]];
        let (delivered, outcomes) = assemble(&plan, ran, &|_| true);
        assert_eq!(delivered, 1);
        assert_eq!(
            outcomes.events,
            [
                // Given back whole, a later event of its aggregate would overtake it: kept.
                (10, EventOutcome::Published),
                (11, EventOutcome::Published),
                (12, EventOutcome::Released),
                (13, EventOutcome::Published),
            ]
        );
        let deliveries: Vec<(i64, &str, &DeliveryOutcome)> = outcomes
            .deliveries
            .iter()
            .map(|d| (d.event_id, d.subscriber.as_str(), &d.outcome))
            .collect();
        assert_eq!(
            deliveries,
            [
                (10, "y", &DeliveryOutcome::Waiting),
                (11, "y", &DeliveryOutcome::Waiting),
                (
                    13,
                    "x",
                    &DeliveryOutcome::Dead {
                        attempts: 1,
                        error: "no".to_owned()
                    }
                ),
            ]
        );
    }
}
