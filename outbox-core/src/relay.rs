//! The relay: claims committed events from a [`Store`], hands them to the subscribers a
//! [`Router`] names, and records what happened.

use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::{Empty, display};
use uuid::Uuid;

use crate::error::{ConfigError, StoreError};
use crate::retry::RetryPolicy;
use crate::routing::{Decoded, Delivery, HandlerError, Router};
use crate::store::{
    Claim, DeliveryOutcome, DeliveryRecord, EventOutcome, Outcomes, Status, Store, StoredEvent,
};
use crate::telemetry::{self, status};

/// Errors stored with a delivery are cut to this many bytes.
const MAX_ERROR_LEN: usize = 4096;

/// How a relay runs. Every setting has a default; see each setter.
///
/// ```
/// use std::time::Duration;
/// use outbox_core::{RelayConfig, RetryPolicy};
///
/// let config = RelayConfig::default()
///     .with_poll_interval(Duration::from_millis(500))
///     .with_batch_size(200)
///     .with_retry(RetryPolicy::new([Duration::from_secs(5), Duration::from_secs(60)])?);
/// assert_eq!(config.batch_size(), 200);
/// # Ok::<(), outbox_core::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct RelayConfig {
    poll_interval: Duration,
    batch_size: u32,
    lease: Duration,
    handler_timeout: Duration,
    park_delay: Duration,
    retry: RetryPolicy,
    max_error_backoff: Duration,
    status_interval: Duration,
    retention: Option<Retention>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(2),
            batch_size: 50,
            lease: Duration::from_secs(60),
            handler_timeout: Duration::from_secs(20),
            park_delay: Duration::from_secs(300),
            retry: RetryPolicy::default(),
            max_error_backoff: Duration::from_secs(30),
            status_interval: Duration::from_secs(15),
            retention: None,
        }
    }
}

impl RelayConfig {
    /// How long an idle relay waits before looking for work again (default 2 s). A commit in the
    /// same process wakes it sooner.
    #[must_use]
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// How many events (and as many retries) one batch claims at most (default 50, at most 10 000).
    #[must_use]
    pub fn with_batch_size(mut self, size: u32) -> Self {
        self.batch_size = size;
        self
    }

    /// How long a claim lasts (default 60 s). If the relay dies, its claims are taken again when
    /// they expire. A batch stops starting handlers after half the lease and gives back the rest.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one handler call may take before it counts as a transient failure (default 20 s,
    /// at most half the lease).
    #[must_use]
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long a parked event (newer version, unknown event type) waits before it is looked at
    /// again (default 5 minutes).
    #[must_use]
    pub fn with_park_delay(mut self, delay: Duration) -> Self {
        self.park_delay = delay;
        self
    }

    /// When failed deliveries are retried (default: the seed's 1m, 5m, 15m, 1h, 4h, 24h).
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The longest wait between attempts to reach a failing store (default 30 s).
    #[must_use]
    pub fn with_max_error_backoff(mut self, backoff: Duration) -> Self {
        self.max_error_backoff = backoff;
        self
    }

    /// How often a running relay reads the store's [`Status`] into the
    /// [gauges](crate::telemetry) (default 15 s).
    #[must_use]
    pub fn with_status_interval(mut self, interval: Duration) -> Self {
        self.status_interval = interval;
        self
    }

    /// Deletes old published events as the relay runs (default: off; see [`Retention`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use outbox_core::{RelayConfig, Retention};
    ///
    /// // Keep published events for 7 days; delete 1000 per statement.
    /// let config = RelayConfig::default()
    ///     .with_retention(Retention::keep(Duration::from_secs(7 * 24 * 3600)).with_batch_size(1000));
    /// assert_eq!(config.retention().unwrap().batch_size(), 1000);
    /// ```
    #[must_use]
    pub fn with_retention(mut self, retention: Retention) -> Self {
        self.retention = Some(retention);
        self
    }

    /// The retention, if any.
    pub fn retention(&self) -> Option<&Retention> {
        self.retention.as_ref()
    }

    /// The poll interval.
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// The batch size.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// The lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retry policy.
    pub fn retry(&self) -> &RetryPolicy {
        &self.retry
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |setting, reason: String| Err(ConfigError::InvalidSetting { setting, reason });
        if !(1..=10_000).contains(&self.batch_size) {
            return invalid(
                "batch size",
                format!("{} is outside 1..=10000", self.batch_size),
            );
        }
        for (setting, value) in [
            ("poll interval", self.poll_interval),
            ("lease", self.lease),
            ("handler timeout", self.handler_timeout),
            ("park delay", self.park_delay),
            ("error backoff", self.max_error_backoff),
            ("status interval", self.status_interval),
            (
                "retention interval",
                self.retention.map_or(Duration::MAX, |r| r.interval),
            ),
        ] {
            if value.is_zero() {
                return invalid(setting, "must be greater than zero".to_owned());
            }
        }
        if let Some(retention) = &self.retention
            && !(1..=10_000).contains(&retention.batch_size)
        {
            return invalid(
                "retention batch size",
                format!("{} is outside 1..=10000", retention.batch_size),
            );
        }
        if self.handler_timeout > self.lease / 2 {
            return invalid(
                "handler timeout",
                format!(
                    "{:?} is more than half the lease ({:?}): a claim could expire while its \
                     handler still runs",
                    self.handler_timeout, self.lease
                ),
            );
        }
        Ok(())
    }
}

/// Which published events a relay deletes as it runs, and how: see
/// [`RelayConfig::with_retention`].
///
/// The relay deletes events published more than [`keep`](Self::keep) ago, one batch per
/// statement, between its own batches; once a batch comes back short, it waits
/// [`interval`](Self::interval) before looking again. Dead letters, events not yet published and
/// events some subscriber has not received yet are never deleted. Several relays may purge at
/// once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    keep: Duration,
    batch_size: u32,
    interval: Duration,
}

impl Default for Retention {
    /// The seed's rule: published events go after 30 days; 500 per batch, looked for every minute.
    fn default() -> Self {
        Self {
            keep: Duration::from_secs(30 * 24 * 3600),
            batch_size: 500,
            interval: Duration::from_secs(60),
        }
    }
}

impl Retention {
    /// Keeps published events for `window` (the default is 30 days).
    pub fn keep(window: Duration) -> Self {
        Self {
            keep: window,
            ..Self::default()
        }
    }

    /// Deletes at most `size` events per statement (default 500, at most 10 000).
    #[must_use]
    pub fn with_batch_size(mut self, size: u32) -> Self {
        self.batch_size = size;
        self
    }

    /// Waits `interval` after a short batch before looking for old events again (default 60 s).
    #[must_use]
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// How long published events are kept.
    pub fn window(&self) -> Duration {
        self.keep
    }

    /// Events deleted per statement.
    pub fn batch_size(&self) -> u32 {
        self.batch_size
    }

    /// The wait after a short batch.
    pub fn interval(&self) -> Duration {
        self.interval
    }
}

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
    /// Deliveries and events that became dead letters.
    pub dead: usize,
    /// Events set aside until a newer build runs.
    pub parked: usize,
    /// Deliveries held back behind an earlier event of their aggregate.
    pub waiting: usize,
    /// Claims given back unprocessed.
    pub released: usize,
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
/// open while handlers run. Several relays may share one store.
pub struct Relay<S, R> {
    store: S,
    router: R,
    config: RelayConfig,
    /// Shared by every `run` of this relay: workers running one relay do the chores once per
    /// interval between them, and a `run` started again does not redo them.
    chores: Mutex<Chores>,
}

/// Keys held back within one batch.
#[derive(Default)]
struct BatchState {
    /// (subscriber, aggregate) pairs that failed or waited in this batch: their later events wait.
    blocked: HashSet<(String, Uuid)>,
    /// Aggregates with an event parked or dead in this batch: their later events are released.
    stalled: HashSet<Uuid>,
    /// Handler calls that succeeded.
    delivered: usize,
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

impl<S: Store, R: Router> Relay<S, R> {
    /// A relay over `store` and `router`, or the first invalid setting of `config`.
    pub fn new(store: S, router: R, config: RelayConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        telemetry::describe();
        Ok(Self {
            store,
            router,
            config,
            chores: Mutex::new(Chores::new()),
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

    /// Runs until `shutdown` resolves, then returns after the batch in progress is recorded.
    ///
    /// The outcomes of one batch are recorded while the next batch is claimed and delivered
    /// (until its outcomes are recorded, the claim of a batch holds its aggregates' later events
    /// back, so order is kept).
    ///
    /// Store errors (a lost connection, a restarting database) are logged and retried with
    /// exponential backoff; they never end the loop.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = Duration::ZERO;
        // The last batch's outcomes, not recorded yet.
        let mut unrecorded: Option<Outcomes> = None;
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                if let Some(outcomes) = unrecorded.take() {
                    self.record_or_log(&outcomes).await;
                }
                return;
            }
            self.do_chores().await;
            let recording = unrecorded.is_some();
            let next = async {
                match self.claim().await {
                    Ok(claims) if !claims.is_empty() => Ok(Some(self.deliver(claims).await)),
                    Ok(_) => Ok(None),
                    Err(error) => Err(error),
                }
            };
            let delivered = match unrecorded.take() {
                None => next.await,
                Some(outcomes) => tokio::join!(self.record_or_log(&outcomes), next).1,
            };
            match delivered {
                Ok(Some((report, outcomes))) => {
                    backoff = Duration::ZERO;
                    if report.made_progress() {
                        unrecorded = Some(outcomes);
                        continue;
                    }
                    // Everything was given back: record that, then wait for news.
                    self.record_or_log(&outcomes).await;
                    if self.idle(&mut shutdown).await {
                        return;
                    }
                }
                // The batch just recorded may have held events back: look again at once.
                Ok(None) if recording => backoff = Duration::ZERO,
                Ok(None) => {
                    backoff = Duration::ZERO;
                    if self.idle(&mut shutdown).await {
                        return;
                    }
                }
                Err(error) => {
                    backoff = (backoff * 2)
                        .max(Duration::from_millis(50))
                        .min(self.config.max_error_backoff);
                    tracing::warn!(%error, retry_in = ?backoff, "outbox relay cannot reach its store");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                }
            }
        }
    }

    /// Waits for a commit, the poll interval, or `shutdown`, whichever comes first; true if
    /// `shutdown` came (it must not be polled again).
    async fn idle(&self, shutdown: &mut Pin<&mut impl Future<Output = ()>>) -> bool {
        tokio::select! {
            biased;
            () = shutdown.as_mut() => true,
            () = self.store.notified() => false,
            () = tokio::time::sleep(self.config.poll_interval) => false,
        }
    }

    /// Reads the store's [`Status`] and sets the [gauges](crate::telemetry) from it. A running
    /// relay does this every [status interval](RelayConfig::with_status_interval).
    pub async fn report_status(&self) -> Result<Status, StoreError> {
        let status = self.store.status().await?;
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
        if status_due && let Err(error) = self.report_status().await {
            tracing::warn!(%error, "outbox relay cannot read the store's status");
        }
        if let Some(retention) = purge {
            match self
                .store
                .purge_published(retention.keep, retention.batch_size)
                .await
            {
                // A full batch: there may be more; go on after the next batch of deliveries.
                Ok(deleted) if deleted >= u64::from(retention.batch_size) => {
                    self.chores
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .next_purge = now;
                }
                Ok(deleted) => {
                    if deleted > 0 {
                        tracing::debug!(deleted, "outbox relay purged old published events");
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox relay cannot purge old published events");
                }
            }
        }
    }

    /// Claims one batch, delivers it, and records the outcomes.
    pub async fn run_once(&self) -> Result<BatchReport, StoreError> {
        let claims = self.claim().await?;
        let (report, outcomes) = self.deliver(claims).await;
        if !outcomes.is_empty() {
            self.record(&outcomes).await?;
        }
        Ok(report)
    }

    async fn claim(&self) -> Result<Vec<Claim>, StoreError> {
        self.store
            .claim(self.config.batch_size, self.config.lease)
            .await
    }

    /// Hands claimed events and deliveries to their subscribers, in a batch span.
    async fn deliver(&self, claims: Vec<Claim>) -> (BatchReport, Outcomes) {
        let span = tracing::info_span!(
            "outbox.batch",
            claimed = claims.len(),
            delivered = Empty,
            retried = Empty,
            dead = Empty,
            parked = Empty,
        );
        let (report, outcomes) = self.deliver_batch(claims).instrument(span.clone()).await;
        span.record("delivered", report.delivered);
        span.record("retried", report.retried);
        span.record("dead", report.dead);
        span.record("parked", report.parked);
        (report, outcomes)
    }

    async fn deliver_batch(&self, claims: Vec<Claim>) -> (BatchReport, Outcomes) {
        let deadline = Instant::now() + self.config.lease / 2;
        let mut report = BatchReport {
            claimed: claims.len(),
            ..BatchReport::default()
        };
        let mut state = BatchState::default();
        let mut outcomes = Outcomes::default();
        for claim in claims {
            let out_of_time = Instant::now() >= deadline;
            match claim {
                Claim::Event { event, .. } if out_of_time => {
                    outcomes.events.push((event.id, EventOutcome::Released));
                }
                Claim::Delivery {
                    event, subscriber, ..
                } if out_of_time => {
                    outcomes
                        .deliveries
                        .push(record(&event, subscriber, DeliveryOutcome::Released));
                }
                Claim::Event { event, blocked, .. } => {
                    self.fan_out(&event, &blocked, &mut state, &mut outcomes)
                        .await;
                }
                Claim::Delivery {
                    event,
                    subscriber,
                    attempts,
                } => {
                    let outcome = self
                        .redeliver(&event, &subscriber, attempts, &mut state)
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
        state: &mut BatchState,
        outcomes: &mut Outcomes,
    ) {
        if state.stalled.contains(&event.aggregate_id) {
            outcomes.events.push((event.id, EventOutcome::Released));
            return;
        }
        let Some(subscribers) = self.router.subscribers(&event.event_type) else {
            state.stalled.insert(event.aggregate_id);
            telemetry::dispatched(&event.event_type, status::PARKED);
            outcomes.events.push((
                event.id,
                EventOutcome::Parked {
                    reason: format!(
                        "no subscriber in this build knows event type `{}`",
                        event.event_type
                    ),
                    retry_in: self.config.park_delay,
                },
            ));
            return;
        };
        let decoded = match self.router.decode(event) {
            Ok(decoded) => decoded,
            Err(error) => {
                state.stalled.insert(event.aggregate_id);
                let reason = truncate(error.to_string());
                let outcome = if error.may_decode_in_newer_build() {
                    telemetry::dispatched(&event.event_type, status::PARKED);
                    EventOutcome::Parked {
                        reason,
                        retry_in: self.config.park_delay,
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
        for &subscriber in subscribers {
            let held_back = blocked.iter().any(|b| b == subscriber)
                || (!state.blocked.is_empty()
                    && state
                        .blocked
                        .contains(&(subscriber.to_owned(), event.aggregate_id)));
            let outcome = if held_back {
                DeliveryOutcome::Waiting
            } else {
                match self.attempt(subscriber, event, &decoded, 1).await {
                    Ok(()) => {
                        state.delivered += 1;
                        continue;
                    }
                    Err(outcome) => outcome,
                }
            };
            state
                .blocked
                .insert((subscriber.to_owned(), event.aggregate_id));
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
        state: &mut BatchState,
    ) -> DeliveryOutcome {
        let key = (subscriber.to_owned(), event.aggregate_id);
        if state.blocked.contains(&key) {
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
            match self.router.decode(event) {
                Err(error) if error.may_decode_in_newer_build() => {
                    telemetry::dispatched(&event.event_type, status::PARKED);
                    self.park_delivery(attempts, error.to_string())
                }
                Err(error) => {
                    telemetry::dispatched(&event.event_type, status::DEAD);
                    DeliveryOutcome::Dead {
                        attempts,
                        error: truncate(error.to_string()),
                    }
                }
                Ok(decoded) => {
                    let attempt = attempts.saturating_add(1);
                    match self.attempt(subscriber, event, &decoded, attempt).await {
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
            state.blocked.insert(key);
        }
        outcome
    }

    /// Calls one handler in a delivery span, turning a timeout or a panic into a transient
    /// error, and counts the outcome; a failure comes back as what to record.
    async fn attempt(
        &self,
        subscriber: &str,
        event: &StoredEvent,
        decoded: &Decoded,
        attempt: u32,
    ) -> Result<(), DeliveryOutcome> {
        let metadata = decoded.metadata();
        let span = tracing::info_span!(
            "outbox.deliver",
            event_id = event.id,
            event_type = %event.event_type,
            aggregate_id = %event.aggregate_id,
            subscriber,
            attempt,
            correlation_id = Empty,
            causation_id = Empty,
            traceparent = Empty,
        );
        if let Some(id) = metadata.correlation_id() {
            span.record("correlation_id", display(id));
        }
        if let Some(id) = metadata.causation_id() {
            span.record("causation_id", display(id));
        }
        if let Some(traceparent) = metadata.trace_context().get("traceparent") {
            span.record("traceparent", traceparent);
        }
        #[cfg(feature = "opentelemetry")]
        telemetry::link(&span, metadata.trace_context());
        let started = Instant::now();
        let result = self
            .call(subscriber, event, decoded, attempt)
            .instrument(span.clone())
            .await;
        telemetry::dispatch_duration(&event.event_type, started.elapsed());
        let Err(error) = result else {
            telemetry::dispatched(&event.event_type, status::DELIVERED);
            return Ok(());
        };
        let outcome = self.after_failure(&error, attempt);
        let _entered = span.enter();
        if let DeliveryOutcome::Retry { retry_in, .. } = &outcome {
            telemetry::dispatched(&event.event_type, status::RETRY);
            tracing::warn!(%error, ?retry_in, "outbox handler failed; it will be retried");
        } else {
            telemetry::dispatched(&event.event_type, status::DEAD);
            tracing::error!(%error, "outbox handler failed for good: a dead letter");
        }
        Err(outcome)
    }

    /// Calls one handler, turning a timeout or a panic into a transient error.
    async fn call(
        &self,
        subscriber: &str,
        event: &StoredEvent,
        decoded: &Decoded,
        attempt: u32,
    ) -> Result<(), HandlerError> {
        let delivery = Delivery::new(event, decoded.metadata(), subscriber, attempt);
        let call = AssertUnwindSafe(self.router.deliver(subscriber, decoded, &delivery));
        match tokio::time::timeout(self.config.handler_timeout, call.catch_unwind()).await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string payload".to_owned());
                Err(HandlerError::transient(format!(
                    "handler panicked: {message}"
                )))
            }
            Err(_) => Err(HandlerError::transient(format!(
                "handler timed out after {:?}",
                self.config.handler_timeout
            ))),
        }
    }

    fn after_failure(&self, error: &HandlerError, attempts: u32) -> DeliveryOutcome {
        let message = truncate(error.to_string());
        match error
            .is_transient()
            .then(|| self.config.retry.delay_after(attempts))
            .flatten()
        {
            Some(retry_in) => DeliveryOutcome::Retry {
                attempts,
                error: message,
                retry_in,
            },
            None => DeliveryOutcome::Dead {
                attempts,
                error: message,
            },
        }
    }

    /// Sets a delivery aside until a newer build runs, without counting an attempt.
    fn park_delivery(&self, attempts: u32, reason: String) -> DeliveryOutcome {
        DeliveryOutcome::Retry {
            attempts,
            error: truncate(reason),
            retry_in: self.config.park_delay,
        }
    }

    /// Records outcomes; if that keeps failing, says so (the batch is delivered again once its
    /// claims expire, which at-least-once allows).
    async fn record_or_log(&self, outcomes: &Outcomes) {
        if outcomes.is_empty() {
            return;
        }
        if let Err(error) = self.record(outcomes).await {
            tracing::error!(
                %error,
                "outbox relay cannot record a batch; it will be delivered again when its claims expire"
            );
        }
    }

    /// Records outcomes, retrying a few times: the handlers already ran, and a lost record means
    /// delivering the batch again once its claims expire.
    async fn record(&self, outcomes: &Outcomes) -> Result<(), StoreError> {
        let mut wait = Duration::from_millis(50);
        let mut tries = 1;
        loop {
            match self.store.record(outcomes).await {
                Ok(()) => return Ok(()),
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

fn record(event: &StoredEvent, subscriber: String, outcome: DeliveryOutcome) -> DeliveryRecord {
    DeliveryRecord {
        event_id: event.id,
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

fn truncate(mut message: String) -> String {
    if message.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_the_seeds() {
        let config = RelayConfig::default();
        config.validate().unwrap();
        assert_eq!(config.poll_interval(), Duration::from_secs(2));
        assert_eq!(config.batch_size(), 50);
        assert_eq!(config.retry(), &RetryPolicy::default());
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
                    .with_handler_timeout(Duration::from_secs(6)),
                "invalid handler timeout: 6s is more than half the lease (10s): a claim could \
                 expire while its handler still runs",
            ),
            (
                RelayConfig::default().with_status_interval(Duration::ZERO),
                "invalid status interval: must be greater than zero",
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
    }

    #[test]
    fn long_errors_are_cut_on_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = truncate(long);
        assert!(cut.len() <= MAX_ERROR_LEN + '…'.len_utf8());
        assert!(cut.ends_with('…'));
        assert_eq!(truncate("short".to_owned()), "short");
    }
}
