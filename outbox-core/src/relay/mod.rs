//! The relay: claims committed events from a [`Store`], hands them to the subscribers a
//! [`Router`] names, and records what happened.
//!
//! - `config.rs`: [`RelayConfig`] and [`Retention`], and their validation.
//! - this file: the run loop, its chores (status, retention) beside it on their own schedule,
//!   claiming and recording.
//! - `lease.rs`: the claim of the batch in progress, renewed while its handlers run.
//! - `plan.rs`: a batch's claims planned (a pure function): what needs no handler is decided,
//!   the handler calls are queued per (subscriber, aggregate) key.
//! - `batch.rs`: a plan run, its queues concurrently (by runners, tasks as many as the calls
//!   that may run at once, each taking the next queue as it ends one) and each in order, and
//!   its outcomes.
//! - `ahead.rs`: when handlers are slower than the store, the next batch is claimed (and
//!   planned) while the batch's last calls run.
//! - `attempt.rs`: one handler call (span, timeout, panic, metrics) and guarded decoding.
//! - `due.rs`: when an idle relay looks again, for the retries and parked events it recorded.

mod ahead;
mod attempt;
mod batch;
mod builds;
mod config;
mod due;
mod lease;
mod plan;
mod succession;

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::Empty;

use ahead::Progress;
use batch::Clean;
pub use config::{RelayConfig, Retention};
use due::DueTimes;
use lease::Lease;
use plan::Plan;

use crate::error::{ConfigError, StoreError};
use crate::routing::{Decoded, Router};
use crate::store::{
    Batch, Claim, ClaimLimit, ClaimToken, Outcomes, Recorded, Status, Store, TakeOver,
};
use crate::telemetry::{self, store_operation};
use succession::{Gate, Holding, Successions};

/// Maps and sets the relay fills and reads for every batch, keyed by aggregates, keys of a
/// batch's plan or claim tokens (random ids, and from the relay's own store): the hasher is a
/// quick one.
type Map<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
type Set<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Events and deliveries claimed.
    pub claimed: usize,
    /// Handler calls that succeeded.
    pub delivered: usize,
    /// Deliveries scheduled for another attempt (or set aside until a build that routes them runs).
    pub retried: usize,
    /// Failed handler calls retried within the batch, their retry being due within the
    /// [in-place limit](RelayConfig::with_retry_in_place).
    pub retried_in_place: usize,
    /// Deliveries and events that became dead letters.
    pub dead: usize,
    /// Events set aside until a newer build runs.
    pub parked: usize,
    /// Deliveries held back behind an earlier event of their aggregate.
    pub waiting: usize,
    /// Claims given back unprocessed.
    pub released: usize,
    /// The batch's claim expired before its outcomes were recorded (the relay stalled past its
    /// lease): nothing of it was recorded, and its work is delivered again.
    pub lost: bool,
    /// The store set held-back events aside while claiming and may find more work at once.
    pub more: bool,
}

impl BatchReport {
    fn made_progress(&self) -> bool {
        self.claimed > self.released
    }
}

/// Delivers committed events to their subscribers, at least once, in order per (subscriber,
/// aggregate).
///
/// A relay claims a batch from its [`Store`], hands each event to the subscribers its [`Router`]
/// names (each subscriber's failures are its own: a subscriber that succeeded is not called
/// again), and records the outcome of the whole batch in one call. No database transaction stays
/// open while handlers run: the claim is a lease, which the relay renews while the batch's
/// handlers run, and outcomes count only while the claim is live. Several relays may share one
/// store.
pub struct Relay<S, R> {
    store: S,
    /// Shared with the tasks that run a batch's queues.
    router: Arc<R>,
    config: Arc<RelayConfig>,
    /// Shared by every `run` of this relay: workers running one relay do the chores once per
    /// interval between them, and a `run` started again does not redo them.
    chores: Mutex<Chores>,
    /// Its registration in the store, and what relays of other builds route.
    builds: builds::Builds,
    /// Told when a record made beside the delivery loop (of a split batch's later part or its
    /// rest) freed aggregates: an idle loop claims their later events at once.
    freed: tokio::sync::Notify,
    /// The aggregates of its claims whose work has not ended, which its next claims take over
    /// (when the store does).
    successions: Successions,
    /// How many `run`s of this relay are under way: the last to stop ends its registration.
    runs: AtomicUsize,
}

/// One `run` under way, counted in [`Relay::runs`] until it leaves (or is dropped: aborted).
struct RunUnderWay<'a> {
    runs: &'a AtomicUsize,
    left: bool,
}

impl<'a> RunUnderWay<'a> {
    fn enter(runs: &'a AtomicUsize) -> Self {
        runs.fetch_add(1, SeqCst);
        Self { runs, left: false }
    }

    /// Leaves; true when no other `run` is under way.
    fn leave(mut self) -> bool {
        self.left = true;
        self.runs.fetch_sub(1, SeqCst) == 1
    }
}

impl Drop for RunUnderWay<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.runs.fetch_sub(1, SeqCst);
        }
    }
}

/// When a running relay next reports its status and purges old events.
struct Chores {
    next_status: Instant,
    next_purge: Instant,
}

impl Chores {
    fn new() -> Self {
        let now = Instant::now();
        Self {
            next_status: now,
            next_purge: now,
        }
    }
}

/// The chores a `do_chores` in progress has not finished: dropped before they are, they are made
/// due again.
struct Unfinished<'a> {
    chores: &'a Mutex<Chores>,
    status: bool,
    purge: bool,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if self.status || self.purge {
            let now = Instant::now();
            let mut chores = self.chores.lock().unwrap_or_else(PoisonError::into_inner);
            if self.status {
                chores.next_status = now;
            }
            if self.purge {
                chores.next_purge = now;
            }
        }
    }
}

/// How many broken connections in a row are retried at once. Each broken connection is
/// dropped from its pool, so a pool whose idle connections were all ended (a database
/// restarting its sessions, a proxy dropping them) is worked through at once, not over an
/// exponential backoff; past this, something keeps breaking connections: back off.
pub(crate) const LOST_CONNECTIONS_RETRIED_AT_ONCE: u32 = 16;

/// Consecutive store failures of a running relay, and how long to wait after the next one.
#[derive(Default)]
struct Failures {
    /// Lost connections retried at once since the last success.
    lost_connections: u32,
    /// The backoff before jitter; zero after a success.
    backoff: Duration,
}

impl Failures {
    /// A broken connection is replaced and the work retried at once; a store that cannot be
    /// reached, or connections that keep breaking, wait an exponential backoff with jitter:
    /// (before jitter, after jitter), or `None` to retry at once.
    fn after(&mut self, error: &StoreError, max: Duration) -> Option<(Duration, Duration)> {
        if error.is_connection_lost() && self.lost_connections < LOST_CONNECTIONS_RETRIED_AT_ONCE {
            self.lost_connections += 1;
            return None;
        }
        self.backoff = (self.backoff * 2).max(Duration::from_millis(50)).min(max);
        // Full jitter over the upper half: relays that failed together do not retry together.
        let jittered = self.backoff.mul_f64(0.5 + fastrand::f64() / 2.0);
        Some((self.backoff, jittered))
    }

    fn reset(&mut self) {
        *self = Self::default();
    }
}

/// A claimed batch, planned: ready to be delivered.
struct Ready {
    /// [`Batch::more`].
    more: bool,
    plan: Plan<Decoded>,
    /// Its batch span.
    span: tracing::Span,
    lease: Lease,
    /// What it took over.
    gate: Option<Gate>,
}

/// A batch claimed while the one before it ran, and its lease (kept meanwhile). It is planned
/// as soon as it is claimed, so that it starts as soon as the batch before leaves call slots
/// idle.
struct Ahead<'a> {
    ready: Ready,
    /// Its aggregates in the successions.
    holding: Option<Holding<'a>>,
    /// How long its claim took.
    took: Duration,
}

/// Outcomes the delivery loop records while it delivers the next batch: a whole batch's, or
/// the first part of a batch that split to let the batch claimed ahead of it start (`part`
/// then tells the rest whether it was recorded: the rest records itself only after it).
struct Unrecorded<'a> {
    token: ClaimToken,
    outcomes: Outcomes,
    part: Option<tokio::sync::oneshot::Sender<bool>>,
    /// Its aggregates whose work is all done.
    clean: Clean,
    /// Its claim's entry in the successions, when this is its last record.
    holding: Option<Holding<'a>>,
}

/// What the delivery loop knows for claiming ahead.
#[derive(Default)]
struct Lookahead<'a> {
    /// Whether to claim ahead at all.
    on: bool,
    /// How long the last claim took.
    claim_takes: Option<Duration>,
    /// Whether the next claims ask for less ([`RelayConfig::claim_size`]), as the batches so
    /// far say ([`ahead::claim_less`]).
    claim_less: bool,
    /// The next batch, claimed while the last one ran.
    next: Option<Ahead<'a>>,
}

/// What a relay's claim gave.
enum Claimed<'a> {
    /// A batch, delivered: its token, report, outcomes, clean aggregates and entry in the
    /// successions.
    Delivered(
        ClaimToken,
        BatchReport,
        Outcomes,
        Clean,
        Option<Holding<'a>>,
    ),
    /// A batch whose aggregates that are done are to be recorded now (the outcomes), while
    /// its rest, handed on to run beside the delivery loop ([`Relay::hand_on_rest`]), runs the
    /// keys waiting for a retry in place and records the rest of the outcomes once told
    /// through `part_recorded` whether these were recorded.
    Split {
        token: ClaimToken,
        report: BatchReport,
        outcomes: Outcomes,
        clean: Clean,
        part_recorded: tokio::sync::oneshot::Sender<bool>,
    },
    /// No work; `more` when the store may find some if asked again at once; `next_due`: when
    /// the store's earliest retry not due yet is due, from the claim (`Batch::next_due`).
    Nothing {
        more: bool,
        next_due: Option<Duration>,
    },
}

/// A batch's delivery under way: its report and outcomes when it is done.
type Running<'a> = Pin<Box<dyn Future<Output = (BatchReport, Outcomes, Clean)> + Send + 'a>>;

/// Where the delivery loop hands the rests of the batches it split, to be run beside it.
struct HandOn<'a> {
    rests: &'a Rests,
    to_finish: tokio::sync::mpsc::UnboundedSender<Pin<Box<dyn Future<Output = ()> + Send + 'a>>>,
}

/// What the rests of split batches, finished beside the delivery loop, tell it.
#[derive(Default)]
struct Rests {
    /// When the retries and parked events they recorded are due.
    next_due: Mutex<DueTimes>,
}

impl<S: Store, R: Router> Relay<S, R> {
    /// A relay over `store` and `router`, or the first invalid setting of `config`.
    pub fn new(store: S, router: R, config: RelayConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        telemetry::describe();
        Ok(Self {
            store,
            router: Arc::new(router),
            config: Arc::new(config),
            chores: Mutex::new(Chores::new()),
            builds: builds::Builds::new(&R::catalog()),
            freed: tokio::sync::Notify::new(),
            successions: Successions::default(),
            runs: AtomicUsize::new(0),
        })
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The router.
    pub fn router(&self) -> &R {
        &self.router
    }

    /// The settings.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Runs until `shutdown` resolves, then returns after the batch in progress is recorded.
    ///
    /// The outcomes of one batch are recorded while the next batch is claimed and delivered
    /// (until its outcomes are recorded, the claim of a batch holds its aggregates' later events
    /// back, so order is kept). A store that [takes over](Store::claims_take_over) lets the
    /// relay's claims take the later events of the aggregates of its own claims whose work has
    /// not ended (handled and being recorded, or with calls still running): their calls wait
    /// until that work is recorded clean, and are given back if it is not. When the handlers
    /// are slower than the store (a batch runs longer than a claim takes), the next batch is
    /// claimed while the last calls of the batch run, so that it is ready when they end; that
    /// claim takes over the batch's aggregates in the same way (other stores leave them out,
    /// as another relay's claim would). A relay stopping with such a batch gives it back
    /// unstarted.
    ///
    /// Store errors never end the loop. A broken connection is replaced and the work retried at
    /// once; a store that stays unreachable is retried with exponential backoff (with jitter, up
    /// to [`RelayConfig::with_max_error_backoff`]).
    ///
    /// The chores (the status gauges, retention) run beside the deliveries on their own
    /// schedule: a slow or stuck purge never delays a batch, nor the return after `shutdown`.
    ///
    /// One relay may run from several tasks at once (shared in an `Arc`): each `run` claims
    /// and delivers batches of its own, on its task, the chores are done once between them,
    /// and the relay stays registered (other builds count on its subscribers) until the last
    /// of them returns.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let under_way = RunUnderWay::enter(&self.runs);
        let deliveries = std::pin::pin!(self.deliver_until(shutdown));
        let chores = std::pin::pin!(self.chores());
        tokio::select! {
            biased;
            () = deliveries => {}
            never = chores => match never {},
        }
        // Other builds stop counting on it now, not when its registration expires; but not
        // while another `run` of it works on (they would fan events out without its
        // subscribers). A `run` started while the registration ended registers again at once.
        if under_way.leave() {
            self.builds.unregister(&self.store).await;
            if self.runs.load(SeqCst) > 0
                && let Err(error) = self.builds.renew(&self.store, &*self.router).await
            {
                tracing::debug!(%error, "outbox relay could not register again; its next claim will");
            }
        }
    }

    /// Does the chores when they are due, for ever.
    async fn chores(&self) -> Infallible {
        loop {
            self.do_chores().await;
            let next = {
                let chores = self.chores.lock().unwrap_or_else(PoisonError::into_inner);
                match self.config.retention {
                    Some(_) => chores.next_status.min(chores.next_purge),
                    None => chores.next_status,
                }
            };
            tokio::time::sleep_until(next).await;
        }
    }

    /// The delivery loop of [`run`](Self::run), and beside it the rests of the batches it
    /// split: it returns when both are done. Their handler calls share the relay's
    /// concurrency.
    async fn deliver_until(&self, shutdown: impl Future<Output = ()>) {
        let permits = Arc::new(Semaphore::new(self.config.concurrency));
        let rests = Rests::default();
        let (to_finish, finishing) = tokio::sync::mpsc::unbounded_channel();
        tokio::join!(
            self.delivery_loop(shutdown, &permits, &rests, to_finish),
            Self::finish_rests(finishing),
        );
    }

    /// Runs the rests of split batches (each records itself) until the delivery loop ended
    /// and every rest is done.
    async fn finish_rests(
        mut finishing: tokio::sync::mpsc::UnboundedReceiver<
            Pin<Box<dyn Future<Output = ()> + Send + '_>>,
        >,
    ) {
        let mut running = futures_util::stream::FuturesUnordered::new();
        let mut open = true;
        loop {
            tokio::select! {
                rest = finishing.recv(), if open => match rest {
                    Some(rest) => running.push(rest),
                    None => open = false,
                },
                Some(()) = running.next(), if !running.is_empty() => {}
                else => return,
            }
        }
    }

    /// The delivery loop: claims, delivers, records.
    async fn delivery_loop<'a>(
        &'a self,
        shutdown: impl Future<Output = ()>,
        permits: &Arc<Semaphore>,
        rests: &'a Rests,
        to_finish: tokio::sync::mpsc::UnboundedSender<
            Pin<Box<dyn Future<Output = ()> + Send + 'a>>,
        >,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let hand_on = HandOn { rests, to_finish };
        let parts = self.store.records_parts().then_some(&hand_on);
        let takes_over = self.store.claims_take_over();
        let mut failures = Failures::default();
        // The last batch's outcomes, not recorded yet.
        let mut unrecorded: Option<Unrecorded<'_>> = None;
        // When the retries and parked events this relay recorded are due: an idle relay looks
        // again at each, not only after its poll interval.
        let mut next_due = DueTimes::default();
        // A relay starts with the smaller claim, as it knows nothing of its handlers yet: with
        // slow ones a whole batch holds every aggregate of a backlog and nothing can be claimed
        // ahead of it; with quick ones the next claims take the whole batch size.
        let mut lookahead = Lookahead {
            on: true,
            claim_less: true,
            ..Lookahead::default()
        };
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                let given_back = lookahead.next.take().map(|ahead| Unrecorded {
                    outcomes: self.give_back(&ahead.ready.plan),
                    token: ahead.ready.lease.token(),
                    part: None,
                    clean: Clean::new(),
                    holding: ahead.holding,
                });
                for unrecorded in unrecorded.into_iter().chain(given_back) {
                    self.record_unrecorded(unrecorded).await;
                }
                return;
            }
            let recording = unrecorded.is_some();
            // The last batch is recorded while the next one is claimed and delivered; a claim
            // ahead of that one waits for the record (`recorded`: whether it was applied). The
            // claim beside the record may take over the aggregates of this relay's claims
            // whose work has not ended, that batch's among them.
            let (record_done, recorded) = tokio::sync::watch::channel((!recording).then_some(true));
            let take_over = takes_over.then(|| self.successions.take_over(self.config.lease));
            let next = self.claim_and_deliver(&mut lookahead, permits, parts, recorded, take_over);
            let claimed = match unrecorded.take() {
                None => next.await,
                Some(unrecorded) => {
                    let record = async {
                        let (outcomes, applied) = self.record_unrecorded(unrecorded).await;
                        record_done.send_replace(Some(applied));
                        outcomes
                    };
                    let (outcomes, claimed) = tokio::join!(record, next);
                    next_due.note(&outcomes);
                    claimed
                }
            };
            match claimed {
                Ok(Claimed::Delivered(token, report, outcomes, clean, holding)) => {
                    failures.reset();
                    if report.lost {
                        // Counted and logged by the lease; the store would refuse the record.
                        continue;
                    }
                    if report.made_progress() {
                        unrecorded = Some(Unrecorded {
                            token,
                            outcomes,
                            part: None,
                            clean,
                            holding,
                        });
                        continue;
                    }
                    // Everything was given back: record that, then wait for news (unless a
                    // batch was claimed ahead meanwhile).
                    self.record_or_log(token, &outcomes, false).await;
                    next_due.note(&outcomes);
                    if lookahead.next.is_none()
                        && self.idle(&mut shutdown, &mut next_due, rests).await
                    {
                        return;
                    }
                }
                Ok(Claimed::Split {
                    token,
                    report,
                    outcomes,
                    clean,
                    part_recorded,
                }) => {
                    failures.reset();
                    if report.lost {
                        let _ = part_recorded.send(false);
                    } else if lookahead.next.is_some() || takes_over {
                        // The next batch is claimed already (the batch split to let it start):
                        // the part is recorded while it runs, as a whole batch would be, and
                        // before any claim after it. Or the next claim, beside the record,
                        // takes over the part's aggregates (and the rest's).
                        unrecorded = Some(Unrecorded {
                            token,
                            outcomes,
                            part: Some(part_recorded),
                            clean,
                            holding: None,
                        });
                    } else {
                        // Recorded before the next claim, which may then take the later events
                        // of the aggregates it frees.
                        let recorded = self.record_clean(token, &outcomes, true, &clean).await;
                        next_due.note(&outcomes);
                        let _ = part_recorded.send(recorded);
                    }
                }
                // Events were set aside, or the batch just recorded may have held some back:
                // look again at once.
                Ok(Claimed::Nothing { more, .. }) if more || recording => failures.reset(),
                Ok(Claimed::Nothing { next_due: due, .. }) => {
                    failures.reset();
                    // (Retries recorded by other relays, or by this one before a restart.)
                    if let Some(due) = due {
                        next_due.note_in(due);
                    }
                    if self.idle(&mut shutdown, &mut next_due, rests).await {
                        return;
                    }
                }
                Err(error) => {
                    let Some((backoff, retry_in)) =
                        failures.after(&error, self.config.max_error_backoff)
                    else {
                        tracing::debug!(%error, "outbox relay lost a connection; retrying at once");
                        continue;
                    };
                    tracing::warn!(
                        %error,
                        ?backoff,
                        ?retry_in,
                        "outbox relay cannot reach its store"
                    );
                    tokio::select! {
                        biased;
                        () = &mut shutdown => return,
                        () = tokio::time::sleep(retry_in) => {}
                    }
                }
            }
        }
    }

    /// Hands the rest of a batch that split on, to run beside the delivery loop from now on:
    /// nothing it began waits unpolled (a part record it began keeps its transaction, and its
    /// locks, open until polled again), and a call of it may hold a transaction that locks the
    /// claim (`Outbox::hold_claim`), which the first part's record then waits for. It records
    /// itself once told, through the sender returned, whether the first part was recorded,
    /// and frees its aggregates.
    fn hand_on_rest<'a>(
        &'a self,
        hand_on: &HandOn<'a>,
        token: ClaimToken,
        rest: Running<'a>,
        holding: Option<Holding<'a>>,
    ) -> tokio::sync::oneshot::Sender<bool> {
        let (part_recorded, was_recorded) = tokio::sync::oneshot::channel();
        let rests = hand_on.rests;
        let finish = async move {
            let (report, outcomes, clean) = rest.await;
            // (Not after a part that could not be recorded: its deliveries stay marked with
            // the claim, which only its expiry gives back.)
            let recorded = was_recorded.await.unwrap_or(false);
            if recorded && !report.lost {
                self.record_clean(token, &outcomes, false, &clean).await;
                let mut next_due = rests
                    .next_due
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                next_due.note(&outcomes);
            }
            drop(holding);
            self.freed.notify_one();
        };
        // (The receiver outlives the delivery loop.)
        let _ = hand_on.to_finish.send(Box::pin(finish));
        part_recorded
    }

    /// Records outcomes the delivery loop left to record beside its next batch; tells a part's
    /// rest whether the part was recorded. Returns the outcomes, and whether they were
    /// recorded.
    async fn record_unrecorded(&self, unrecorded: Unrecorded<'_>) -> (Outcomes, bool) {
        let Unrecorded {
            token,
            outcomes,
            part,
            clean,
            holding,
        } = unrecorded;
        let recorded = self
            .record_clean(token, &outcomes, part.is_some(), &clean)
            .await;
        if let Some(part) = part {
            let _ = part.send(recorded);
        }
        drop(holding);
        (outcomes, recorded)
    }

    /// [`record_or_log`](Self::record_or_log), and once applied, tells the successions that
    /// the work of claim `token` on its `clean` aggregates ended clean.
    async fn record_clean(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
        part: bool,
        clean: &Clean,
    ) -> bool {
        let recorded = self.record_or_log(token, outcomes, part).await;
        if recorded {
            self.successions.recorded(token, clean);
        }
        recorded
    }

    /// Delivers the batch claimed ahead, or claims one and, if there is one, delivers it.
    /// While it runs, the next batch is claimed ahead if `lookahead` is on and the handlers are
    /// slower than a claim (about as long as the last one took), once `recorded` says the
    /// batch before was recorded. With `parts`, a batch whose keys left only wait for retries
    /// in place is split: what is done is returned to be recorded, with the rest still running.
    async fn claim_and_deliver<'a>(
        &'a self,
        lookahead: &mut Lookahead<'a>,
        permits: &Arc<Semaphore>,
        parts: Option<&HandOn<'a>>,
        recorded: tokio::sync::watch::Receiver<Option<bool>>,
        take_over: Option<(Vec<TakeOver>, Gate)>,
    ) -> Result<Claimed<'a>, StoreError> {
        let (ready, holding) = match lookahead.next.take() {
            Some(ahead) => {
                lookahead.claim_takes = Some(ahead.took);
                (ahead.ready, ahead.holding)
            }
            None => {
                let (take_over, gate) = take_over.unzip();
                let (batch, sent, took) = self
                    .claim(
                        self.config.claim_size(lookahead.claim_less),
                        take_over.unwrap_or_default(),
                    )
                    .await?;
                if batch.is_empty() {
                    return Ok(Claimed::Nothing {
                        more: batch.more,
                        next_due: batch.next_due,
                    });
                }
                lookahead.claim_takes = Some(took);
                let holding = self.hold(&batch);
                (self.ready(batch, sent, gate), holding)
            }
        };
        let token = ready.lease.token();
        let progress = Arc::new(Progress::new(
            lookahead.claim_takes.filter(|_| lookahead.on),
        ));
        let (split, mut first_part) = match parts {
            Some(_) => {
                let (split, first_part) = tokio::sync::oneshot::channel();
                (Some(split), Some(first_part))
            }
            None => (None, None),
        };
        let mut running: Running<'_> =
            Box::pin(self.deliver(ready, Arc::clone(&progress), Arc::clone(permits), split));
        let ahead_done = tokio::sync::Notify::new();
        let started = Instant::now();
        // How long the batch's calls took (until it ended or split): `None` when it split
        // before any ended.
        let mut calls_took = None;
        let delivering = async {
            let split_off = async {
                match first_part.as_mut() {
                    Some(first_part) => first_part.await.ok(),
                    None => None,
                }
            };
            let ended = tokio::select! {
                biased;
                whole = &mut running => Err(whole),
                Some(part) = split_off => Ok(part),
            };
            calls_took = (ended.is_err() || progress.finished() > 0).then(|| started.elapsed());
            progress.over();
            let Ok(part) = ended else {
                return ended;
            };
            // The rest runs on until the claim ahead is done: a call of it may hold a
            // transaction that locks the claim (`Outbox::hold_claim`), which that claim may
            // wait for.
            tokio::select! {
                biased;
                (report, mut outcomes, mut clean) = &mut running => {
                    absorb(&mut outcomes, &mut clean, part.1, part.2);
                    Err((report, outcomes, clean))
                }
                () = ahead_done.notified() => Ok(part),
            }
        };
        let claiming_ahead = async {
            let next = self.claim_ahead(&progress, recorded).await;
            ahead_done.notify_one();
            next
        };
        let (ended, next) = tokio::join!(delivering, claiming_ahead);
        lookahead.next = next;
        // (Of a split batch only the first part's deliveries are known here.)
        let was = lookahead.claim_less;
        let claim_less = |outcomes: &Outcomes| match lookahead.claim_takes {
            Some(claim_takes) => ahead::claim_less(
                was,
                calls_took,
                claim_takes,
                !outcomes.deliveries.is_empty(),
            ),
            None => was || !outcomes.deliveries.is_empty(),
        };
        Ok(match ended {
            Ok((report, outcomes, clean)) => {
                lookahead.claim_less = claim_less(&outcomes);
                let hand_on = parts.expect("a batch splits only with parts");
                Claimed::Split {
                    token,
                    report,
                    outcomes,
                    clean,
                    part_recorded: self.hand_on_rest(hand_on, token, running, holding),
                }
            }
            // (A part sent as the batch ended is recorded with the rest, at once.)
            Err((report, mut outcomes, mut clean)) => {
                if let Some(Ok((_, part, part_clean))) = first_part.map(|mut part| part.try_recv())
                {
                    absorb(&mut outcomes, &mut clean, part, part_clean);
                }
                lookahead.claim_less = claim_less(&outcomes);
                Claimed::Delivered(token, report, outcomes, clean, holding)
            }
        })
    }

    /// Claims the next batch when `progress` says so and the batch before the one in progress
    /// is recorded (`recorded`), and keeps its lease until the batch in progress is over. A
    /// failed claim is left to the claim after the batch.
    ///
    /// (Until its record ends, the batch before holds its aggregates: a claim would pass over
    /// their later events, and find nothing when they are all there is.)
    async fn claim_ahead(
        &self,
        progress: &Progress,
        mut recorded: tokio::sync::watch::Receiver<Option<bool>>,
    ) -> Option<Ahead<'_>> {
        if !progress.claim_next().await {
            return None;
        }
        // (The sender gone: the record is over too.)
        let _ = recorded.wait_for(Option::is_some).await;
        // (Only made when the handlers are slower than a claim.)
        let (take_over, gate) = match self.store.claims_take_over() {
            true => {
                let (take_over, gate) = self.successions.take_over(self.config.lease);
                (take_over, Some(gate))
            }
            false => (Vec::new(), None),
        };
        let (batch, sent, took) = match self.claim(self.config.claim_size(true), take_over).await {
            Ok((batch, sent, took)) if !batch.is_empty() => (batch, sent, took),
            Ok(_) => return None,
            Err(error) => {
                tracing::debug!(%error, "outbox relay could not claim ahead; it claims after the batch");
                return None;
            }
        };
        // (Planned now, while the calls of the batch in progress run in their own tasks: it
        // is ready when they leave slots idle.)
        let holding = self.hold(&batch);
        let ready = self.ready(batch, sent, gate);
        // The batch in progress splits once it leaves call slots idle, and this one starts.
        progress.next_claimed();
        tokio::select! {
            biased;
            () = progress.wait_over() => {}
            never = ready.lease.keep(&self.store) => match never {},
        }
        Some(Ahead {
            ready,
            holding,
            took,
        })
    }

    /// Waits for a commit, the poll interval, the next of `next_due` (those passed are
    /// forgotten), or `shutdown`, whichever comes first; true if `shutdown` came (it must not
    /// be polled again).
    async fn idle(
        &self,
        shutdown: &mut Pin<&mut impl Future<Output = ()>>,
        next_due: &mut DueTimes,
        rests: &Rests,
    ) -> bool {
        next_due.absorb(
            &mut rests
                .next_due
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let now = Instant::now();
        if next_due.take_passed(now) {
            return false;
        }
        let mut until = now + self.config.poll_interval;
        if let Some(due) = next_due.next() {
            until = until.min(due);
        }
        let shut_down = tokio::select! {
            biased;
            () = shutdown.as_mut() => true,
            () = self.store.notified() => false,
            // Part of a split batch, or its rest, was recorded: its aggregates are free again.
            () = self.freed.notified() => false,
            () = tokio::time::sleep_until(until) => false,
        };
        // (The claim after this takes what is due by now.)
        next_due.take_passed(Instant::now());
        shut_down
    }

    /// Reads the store's [`Status`] and sets the [gauges](crate::telemetry) from it. A running
    /// relay does this every [status interval](RelayConfig::with_status_interval).
    pub async fn report_status(&self) -> Result<Status, StoreError> {
        let status = self
            .store
            .status()
            .await
            .inspect_err(|_| telemetry::store_error(store_operation::STATUS))?;
        telemetry::report(&status);
        Ok(status)
    }

    /// Reports the status and purges old events when they are due. Failures are logged: chores
    /// never stop deliveries.
    async fn do_chores(&self) {
        let now = Instant::now();
        let retention = self.config.retention.as_ref();
        // Each due chore is pushed back before it runs, so that another `run` does not do it too.
        let (status_due, purge) = {
            let mut chores = self.chores.lock().unwrap_or_else(PoisonError::into_inner);
            let status_due = now >= chores.next_status;
            if status_due {
                chores.next_status = now + self.config.status_interval;
            }
            let purge = retention.filter(|_| now >= chores.next_purge);
            if let Some(retention) = purge {
                chores.next_purge = now + retention.interval;
            }
            (status_due, purge)
        };
        // A chore cut short (the relay stopped meanwhile) is due again at once, for the next
        // `run`.
        let mut unfinished = Unfinished {
            chores: &self.chores,
            status: status_due,
            purge: purge.is_some(),
        };
        if status_due && let Err(error) = self.report_status().await {
            tracing::warn!(%error, "outbox relay cannot read the store's status");
        }
        unfinished.status = false;
        if let Some(retention) = purge {
            match self
                .store
                .purge_published(retention.keep, retention.batch_size)
                .await
            {
                Ok(purged) => {
                    if purged.deleted > 0 {
                        tracing::debug!(
                            deleted = purged.deleted,
                            "outbox relay purged old published events"
                        );
                    }
                    // Old events are left to look at: go on at once.
                    if purged.more {
                        self.chores
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .next_purge = now;
                    }
                }
                Err(error) => {
                    telemetry::store_error(store_operation::PURGE);
                    tracing::warn!(%error, "outbox relay cannot purge old published events");
                }
            }
        }
        unfinished.purge = false;
    }

    /// Claims one batch, delivers it, and records the outcomes.
    pub async fn run_once(&self) -> Result<BatchReport, StoreError> {
        // (Never ahead: the batch after is not this call's.)
        let mut lookahead = Lookahead::default();
        let permits = Arc::new(Semaphore::new(self.config.concurrency));
        let claimed = self
            .claim_and_deliver(
                &mut lookahead,
                &permits,
                None,
                tokio::sync::watch::channel(Some(true)).1,
                None,
            )
            .await?;
        let (token, mut report, outcomes, clean, _holding) = match claimed {
            Claimed::Delivered(token, report, outcomes, clean, holding) => {
                (token, report, outcomes, clean, holding)
            }
            Claimed::Split { .. } => unreachable!("a batch is split only when asked"),
            Claimed::Nothing { more, .. } => {
                return Ok(BatchReport {
                    more,
                    ..BatchReport::default()
                });
            }
        };
        if !report.lost && !outcomes.is_empty() {
            report.lost = self.record(token, &outcomes, false).await? == Recorded::Lost;
            if !report.lost {
                self.successions.recorded(token, &clean);
            }
        }
        Ok(report)
    }

    /// Claims a batch, leaving to relays of other builds what only they route. The registry
    /// is read first when its heartbeat is due, and again when the claim saw it change, so
    /// that the batch is fanned out to the subscribers of every build registered before it.
    /// Returns with the batch when the store's claim was sent (its lease runs from then at the
    /// latest) and how long it took: the registry's reads are not the claim's time (the first
    /// claim registers the relay). With `take_over`, it may take over those aggregates of the
    /// relay's earlier claims.
    async fn claim(
        &self,
        size: ClaimLimit,
        take_over: Vec<TakeOver>,
    ) -> Result<(Batch, Instant, Duration), StoreError> {
        self.builds.renew_if_due(&self.store, &*self.router).await?;
        let others = self.builds.others();
        let filter = match take_over.is_empty() {
            false => Cow::Owned(others.filter().taking_over(take_over)),
            true => Cow::Borrowed(others.filter()),
        };
        let sent = Instant::now();
        let batch = self
            .store
            .claim(size, self.config.lease, &filter)
            .await
            .inspect_err(|_| telemetry::store_error(store_operation::CLAIM))?;
        let took = sent.elapsed();
        if self.builds.is_stale(batch.registry.as_ref()) {
            self.builds.renew(&self.store, &*self.router).await?;
        }
        Ok((batch, sent, took))
    }

    /// This relay's id in the store's registry of relays.
    pub fn id(&self) -> uuid::Uuid {
        self.builds.id()
    }

    /// Enters the aggregates of a claimed batch in the successions, until its last record, for
    /// the claims after it to take over (a store that takes them over only).
    fn hold(&self, batch: &Batch) -> Option<Holding<'_>> {
        self.store.claims_take_over().then(|| {
            self.successions.hold(
                batch.token,
                batch
                    .claims
                    .iter()
                    .filter_map(Claim::event)
                    .map(|event| (event.aggregate_type.as_str(), event.aggregate_id)),
            )
        })
    }

    /// A batch claimed when the claim was `sent` (its lease runs from then), planned in its
    /// batch span; `gate`: what its claim took over.
    fn ready(&self, batch: Batch, sent: Instant, gate: Option<Gate>) -> Ready {
        let span = tracing::info_span!(
            "outbox.batch",
            claim = batch.token.get(),
            claimed = batch.claims.len(),
            delivered = Empty,
            retried = Empty,
            dead = Empty,
            parked = Empty,
        );
        let plan = span.in_scope(|| self.plan(batch.claims));
        Ready {
            more: batch.more,
            plan,
            span,
            lease: Lease::new(batch.token, self.config.lease, sent),
            gate,
        }
    }

    /// Hands a planned batch to its subscribers in its batch span, renewing its claim while
    /// the handlers run.
    async fn deliver(
        &self,
        ready: Ready,
        progress: Arc<Progress>,
        permits: Arc<Semaphore>,
        split: Option<batch::SplitTx>,
    ) -> (BatchReport, Outcomes, Clean) {
        let Ready {
            more,
            plan,
            span,
            lease,
            gate,
        } = ready;
        let lease = Arc::new(lease);
        let delivering = self
            .deliver_batch(
                plan,
                Arc::clone(&lease),
                progress,
                permits,
                split,
                gate.map(Arc::new),
            )
            .instrument(span.clone());
        let (mut report, outcomes, clean) = tokio::select! {
            biased;
            done = delivering => done,
            never = lease.keep(&self.store) => match never {},
        };
        report.lost = lease.is_lost();
        report.more = more;
        span.record("delivered", report.delivered);
        span.record("retried", report.retried);
        span.record("dead", report.dead);
        span.record("parked", report.parked);
        (report, outcomes, clean)
    }

    /// Records outcomes; if that keeps failing, says so (the batch is delivered again once its
    /// claim expires, which at-least-once allows).
    /// Whether they were recorded (or there was nothing to record).
    async fn record_or_log(&self, token: ClaimToken, outcomes: &Outcomes, part: bool) -> bool {
        if outcomes.is_empty() {
            return true;
        }
        let recorded = self.record(token, outcomes, part).await;
        if let Err(error) = &recorded {
            tracing::error!(
                %error,
                claim = %token,
                "outbox relay cannot record a batch; it will be delivered again when its claim expires"
            );
        }
        matches!(recorded, Ok(Recorded::Applied))
    }

    /// Records outcomes, retrying a few times: the handlers already ran, and a lost record means
    /// delivering the batch again once its claim expires. A claim found lost is counted and
    /// logged: its outcomes are dropped. With `part`, the outcomes are of part of the batch
    /// ([`Store::record_part`]).
    async fn record(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
        part: bool,
    ) -> Result<Recorded, StoreError> {
        let mut wait = Duration::from_millis(50);
        let (mut tries, mut lost_connections) = (1, 0);
        loop {
            let recorded = match part {
                true => self.store.record_part(token, outcomes).await,
                false => self.store.record(token, outcomes).await,
            };
            if recorded.is_err() {
                telemetry::store_error(store_operation::RECORD);
            }
            match recorded {
                Ok(Recorded::Applied) => return Ok(Recorded::Applied),
                Ok(Recorded::Lost) => {
                    telemetry::claim_lost();
                    tracing::warn!(
                        claim = %token,
                        "outbox relay lost the claim of a batch before recording it (its lease \
                         expired; another relay may have its work): its outcomes are dropped and \
                         its work is delivered again"
                    );
                    return Ok(Recorded::Lost);
                }
                // A broken connection: at once, on another, without using up a try.
                Err(error)
                    if error.is_connection_lost()
                        && lost_connections < LOST_CONNECTIONS_RETRIED_AT_ONCE =>
                {
                    tracing::debug!(%error, "outbox relay lost a connection recording a batch");
                    lost_connections += 1;
                }
                Err(error) if tries >= 5 => return Err(error),
                Err(error) => {
                    tracing::warn!(%error, tries, "outbox relay cannot record a batch; retrying");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    tries += 1;
                }
            }
        }
    }
}

/// Adds the outcomes of a batch's first part to those of its rest, to be recorded whole.
fn absorb(outcomes: &mut Outcomes, clean: &mut Clean, part: Outcomes, part_clean: Clean) {
    outcomes.events.extend(part.events);
    outcomes.deliveries.extend(part.deliveries);
    clean.extend(part_clean);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RetryPolicy;

    #[test]
    fn a_relay_waiting_on_its_handlers_claims_a_quarter_of_the_batch() {
        let config = RelayConfig::default();
        assert_eq!(config.claim_size(false), ClaimLimit::new(2000, 16 << 20));
        assert_eq!(config.claim_size(true), ClaimLimit::new(500, 16 << 20));
        let small = RelayConfig::default()
            .with_batch_size(3)
            .with_batch_bytes(10);
        assert_eq!(
            (small.claim_size(false), small.claim_size(true)),
            (ClaimLimit::new(3, 10), ClaimLimit::new(1, 10))
        );
    }

    #[test]
    fn the_defaults_are_valid_and_the_seeds_but_the_batch() {
        let config = RelayConfig::default();
        config.validate().unwrap();
        assert_eq!(config.poll_interval(), Duration::from_secs(2));
        assert_eq!(config.batch_size(), 2000);
        assert_eq!(config.batch_bytes(), 16 << 20);
        assert_eq!(config.concurrency(), 32);
        assert_eq!(config.retention(), Some(&Retention::default()));
        assert_eq!(
            config.retention().unwrap().window(),
            Duration::from_secs(30 * 24 * 3600)
        );
        assert_eq!(config.retry(), &RetryPolicy::default());
        assert_eq!(config.retry_in_place(), Duration::from_millis(20));
        assert!(config.handler_timeout() * 2 < config.lease());
    }

    #[test]
    fn broken_connections_are_retried_at_once_and_outages_back_off_with_jitter() {
        let max = Duration::from_secs(1);
        let lost = || StoreError::connection_lost("connection reset");
        let down = || StoreError::new("connection refused");
        let mut failures = Failures::default();
        for _ in 0..LOST_CONNECTIONS_RETRIED_AT_ONCE {
            assert_eq!(failures.after(&lost(), max), None);
        }
        // Connections that keep breaking: back off, as for a store that cannot be reached.
        let (backoff, _) = failures.after(&lost(), max).unwrap();
        assert_eq!(backoff, Duration::from_millis(50));
        let mut expected = backoff;
        for _ in 0..6 {
            expected = (expected * 2).min(max);
            let (backoff, retry_in) = failures.after(&down(), max).unwrap();
            assert_eq!(backoff, expected);
            assert!(
                backoff / 2 <= retry_in && retry_in <= backoff,
                "{retry_in:?}"
            );
        }
        assert_eq!(expected, max);
        failures.reset();
        assert_eq!(failures.after(&lost(), max), None);
        assert_eq!(
            failures.after(&down(), max).map(|(backoff, _)| backoff),
            Some(Duration::from_millis(50))
        );
    }

    #[test]
    fn invalid_settings_are_named_in_the_error() {
        let cases = [
            (
                RelayConfig::default().with_batch_size(0),
                "invalid batch size: 0 is outside 1..=10000",
            ),
            (
                RelayConfig::default().with_batch_size(10_001),
                "invalid batch size: 10001 is outside 1..=10000",
            ),
            (
                RelayConfig::default().with_concurrency(0),
                "invalid concurrency: 0 is outside 1..=10000",
            ),
            (
                RelayConfig::default().with_poll_interval(Duration::ZERO),
                "invalid poll interval: must be greater than zero",
            ),
            (
                RelayConfig::default().with_lease(Duration::ZERO),
                "invalid lease: must be greater than zero",
            ),
            (
                RelayConfig::default()
                    .with_lease(Duration::from_secs(10))
                    .with_handler_timeout(Duration::from_secs(5)),
                "invalid handler timeout: 5s is not less than half the lease (10s): a claim could \
                 expire while its handler still runs; raise the lease to more than twice the \
                 timeout",
            ),
            (
                RelayConfig::default().with_status_interval(Duration::ZERO),
                "invalid status interval: must be greater than zero",
            ),
            (
                RelayConfig::default().with_retry_in_place(Duration::from_secs(4)),
                "invalid retry in place: 4s is more than the handler timeout (3s): retries due \
                 that late are written down and claimed again; keep retries in place short",
            ),
            (
                RelayConfig::default().with_retention(Retention::default().with_batch_size(0)),
                "invalid retention batch size: 0 is outside 1..=10000",
            ),
            (
                RelayConfig::default()
                    .with_retention(Retention::default().with_interval(Duration::ZERO)),
                "invalid retention interval: must be greater than zero",
            ),
        ];
        for (config, message) in cases {
            assert_eq!(config.validate().unwrap_err().to_string(), message);
        }
        // Settings that become times in the store: at most 1000 years, as every backend stores.
        let years = |n: u64| Duration::from_secs(n * 365 * 24 * 3600);
        let beyond = |setting: &str, value: Duration, instead: &str| {
            format!(
                "invalid {setting}: {value:?} is more than 1000 years, further than a database \
                 can store a time; {instead}"
            )
        };
        let cases = [
            (
                RelayConfig::default().with_park_delay(Duration::MAX),
                beyond(
                    "park delay",
                    Duration::MAX,
                    "an event parked that long would never be looked at again",
                ),
            ),
            (
                RelayConfig::default().with_lease(years(1001)),
                beyond(
                    "lease",
                    years(1001),
                    "a dead relay's work would never be free again",
                ),
            ),
            (
                RelayConfig::default().with_retention(Retention::keep(Duration::MAX)),
                beyond(
                    "retention",
                    Duration::MAX,
                    "to keep published events for ever, turn retention off (`without_retention`)",
                ),
            ),
        ];
        for (config, message) in cases {
            assert_eq!(config.validate().unwrap_err().to_string(), message);
        }
        let longest = RelayConfig::default()
            .with_park_delay(years(1000))
            .with_lease(years(1000))
            .with_retention(Retention::keep(years(1000)));
        assert!(longest.validate().is_ok());
    }
}
