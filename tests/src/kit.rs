//! Subscribers with scripted failures and a log of what they saw, and the routers that combine
//! them, declared with `#[subscriber]` and `#[router]` like an application's.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{
    BatchReport, Delivery, Handle, HandlerError, Metadata, OutboxEvent, Relay, Router, Store,
    router, subscriber,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::events::{
    BotInstalled, BotKicked, LicenseUpgraded, PaymentFailedFinal, PaymentSucceeded,
    SubscriptionStarted,
};

/// The event most relay tests publish: a numbered ping on an aggregate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "probe", event_type = "Ping")]
pub struct Ping {
    /// The aggregate.
    #[outbox(aggregate_id)]
    pub aggregate: Uuid,
    /// Its number within the aggregate, in publishing order.
    pub seq: u32,
}

/// A second event type, for routing tests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "probe", event_type = "Pong")]
pub struct Pong {
    /// The aggregate.
    #[outbox(aggregate_id)]
    pub aggregate: Uuid,
    /// Its number.
    pub seq: u32,
}

/// An event of another aggregate type than `Ping`'s, for tests of aggregates of two types that
/// share an id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "other", event_type = "Tock")]
pub struct Tock {
    /// The aggregate.
    #[outbox(aggregate_id)]
    pub aggregate: Uuid,
    /// Its number.
    pub seq: u32,
}

/// One handler call, as a subscriber saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// The subscriber.
    pub subscriber: String,
    /// The event type.
    pub event_type: String,
    /// The stored event's id.
    pub event_id: i64,
    /// The aggregate.
    pub aggregate: Uuid,
    /// The event's `seq`.
    pub seq: u32,
    /// The attempt, from 1.
    pub attempt: u32,
    /// Whether the call succeeded.
    pub ok: bool,
    /// The metadata delivered with the event.
    pub metadata: Metadata,
    /// The claim the call ran under.
    pub claim: Option<i64>,
    /// How many earlier claims of the delivery had expired.
    pub expired_claims: u32,
    /// Whether the delivery said it may be a redelivery.
    pub redelivery: bool,
}

/// What a scripted handler call does instead of succeeding.
#[derive(Debug, Clone)]
pub enum Fail {
    /// Returns a transient error.
    Transient,
    /// Returns a permanent error.
    Permanent,
    /// Returns a transient error with this message.
    Message(String),
    /// Takes this long (asynchronously), then succeeds.
    Delay(Duration),
    /// Panics.
    Panic,
    /// Signals `entered`, then waits for `release` before succeeding.
    Block {
        /// Notified when the handler starts.
        entered: Arc<tokio::sync::Notify>,
        /// The handler returns once this is notified.
        release: Arc<tokio::sync::Notify>,
    },
    /// Freezes the handler's thread (a blocking wait, as a stalled process or a handler that
    /// blocks its runtime would): sends on `entered`, blocks until `release` receives, then does
    /// what `then` says (`None`: succeeds). Nothing else runs on that thread meanwhile: no
    /// timeout, no lease renewal.
    Freeze {
        /// Told when the handler starts.
        entered: std::sync::mpsc::SyncSender<()>,
        /// The handler's thread blocks until this receives.
        release: Arc<Mutex<std::sync::mpsc::Receiver<()>>>,
        /// What the call does once released.
        then: Option<Box<Fail>>,
    },
}

impl Fail {
    /// A [`Fail::Freeze`] and the two ends the test holds: the receiver told when the handler
    /// is frozen, and the sender that releases it.
    pub fn freeze(
        then: Option<Fail>,
    ) -> (
        Fail,
        std::sync::mpsc::Receiver<()>,
        std::sync::mpsc::SyncSender<()>,
    ) {
        let (entered_tx, entered_rx) = std::sync::mpsc::sync_channel(1);
        let (release_tx, release_rx) = std::sync::mpsc::sync_channel(1);
        let fail = Fail::Freeze {
            entered: entered_tx,
            release: Arc::new(Mutex::new(release_rx)),
            then: then.map(Box::new),
        };
        (fail, entered_rx, release_tx)
    }
}

/// Scripted failures per (subscriber, aggregate, seq).
type Script = HashMap<(String, Uuid, u32), VecDeque<Fail>>;

/// Scripted failures and the log of calls, shared by the probe subscribers.
#[derive(Clone, Default)]
pub struct Probe {
    script: Arc<Mutex<Script>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Calls running now.
    pub busy: Arc<std::sync::atomic::AtomicUsize>,
    /// Calls started so far.
    pub started: Arc<std::sync::atomic::AtomicUsize>,
}

impl Probe {
    /// Makes the next call of `subscriber` for (`aggregate`, `seq`) a [`Fail::Block`]: returns
    /// what it notifies when it starts, and what releases it.
    pub fn block(
        &self,
        subscriber: &str,
        aggregate: Uuid,
        seq: u32,
    ) -> (Arc<tokio::sync::Notify>, Arc<tokio::sync::Notify>) {
        let (entered, release) = (
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Notify::new()),
        );
        let block = Fail::Block {
            entered: entered.clone(),
            release: release.clone(),
        };
        self.fail(subscriber, aggregate, seq, [block]);
        (entered, release)
    }

    /// Makes the next calls of `subscriber` for (`aggregate`, `seq`) fail as listed, in order.
    pub fn fail(
        &self,
        subscriber: &str,
        aggregate: Uuid,
        seq: u32,
        fails: impl IntoIterator<Item = Fail>,
    ) {
        self.script
            .lock()
            .unwrap()
            .entry((subscriber.to_owned(), aggregate, seq))
            .or_default()
            .extend(fails);
    }

    /// Every call so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Successful calls of `subscriber`, in call order, as (aggregate, seq).
    pub fn delivered_to(&self, subscriber: &str) -> Vec<(Uuid, u32)> {
        self.seen()
            .into_iter()
            .filter(|s| s.subscriber == subscriber && s.ok)
            .map(|s| (s.aggregate, s.seq))
            .collect()
    }

    /// All calls of `subscriber`, successful or not, as (aggregate, seq, attempt).
    pub fn calls_of(&self, subscriber: &str) -> Vec<(Uuid, u32, u32)> {
        self.seen()
            .into_iter()
            .filter(|s| s.subscriber == subscriber)
            .map(|s| (s.aggregate, s.seq, s.attempt))
            .collect()
    }

    async fn handle(&self, seen: Seen) -> Result<(), HandlerError> {
        self.busy.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // Counted down however the call ends (a scripted panic too).
        let _busy = Busy(&self.busy);
        let key = (seen.subscriber.clone(), seen.aggregate, seen.seq);
        let mut fail = self
            .script
            .lock()
            .unwrap()
            .get_mut(&key)
            .and_then(VecDeque::pop_front);
        if let Some(Fail::Freeze {
            entered,
            release,
            then,
        }) = fail
        {
            let _ = entered.send(());
            let _ = release.lock().unwrap().recv();
            fail = then.map(|then| *then);
        }
        let result = match fail {
            None => Ok(()),
            Some(Fail::Transient) => Err(HandlerError::transient("scripted transient failure")),
            Some(Fail::Permanent) => Err(HandlerError::permanent("scripted permanent failure")),
            Some(Fail::Message(message)) => Err(HandlerError::transient(message)),
            Some(Fail::Delay(delay)) => {
                tokio::time::sleep(delay).await;
                Ok(())
            }
            Some(Fail::Panic) => {
                self.log(seen, false);
                panic!("scripted panic");
            }
            Some(Fail::Block { entered, release }) => {
                entered.notify_one();
                release.notified().await;
                Ok(())
            }
            Some(Fail::Freeze { .. }) => unreachable!("a freeze is handled above"),
        };
        self.log(seen, result.is_ok());
        result
    }

    fn log(&self, mut seen: Seen, ok: bool) {
        seen.ok = ok;
        self.seen.lock().unwrap().push(seen);
    }
}

/// Counts a probe's call down when dropped.
struct Busy<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Events a probe subscriber can take: they carry an aggregate and a sequence number.
pub trait Probed: OutboxEvent + Clone {
    /// The event's `seq`.
    fn seq(&self) -> u32;
}

impl Probed for Ping {
    fn seq(&self) -> u32 {
        self.seq
    }
}

impl Probed for Pong {
    fn seq(&self) -> u32 {
        self.seq
    }
}

impl Probed for Tock {
    fn seq(&self) -> u32 {
        self.seq
    }
}

/// Subscriber `x` taking `Ping`.
#[subscriber(events = [Ping], name = "x")]
pub struct XPing(pub Probe);

/// Subscriber `x` taking `Ping` and `Pong`.
#[subscriber(events = [Ping, Pong], name = "x")]
pub struct XPingPong(pub Probe);

/// Subscriber `y` taking `Ping`.
#[subscriber(events = [Ping], name = "y")]
pub struct YPing(pub Probe);

/// Subscriber `x` taking `Ping` and `Tock`.
#[subscriber(events = [Ping, Tock], name = "x")]
pub struct XPingTock(pub Probe);

macro_rules! probe_handlers {
    ($($subscriber:ty),*) => {$(
        impl<E: Probed> Handle<E> for $subscriber {
            async fn handle(&self, event: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
                self.0.handle(Seen {
                    subscriber: delivery.subscriber().to_owned(),
                    event_type: E::EVENT_TYPE.to_owned(),
                    event_id: delivery.event().id,
                    aggregate: event.aggregate_id(),
                    seq: event.seq(),
                    attempt: delivery.attempt(),
                    ok: false,
                    metadata: delivery.metadata().clone(),
                    claim: delivery.claim_token().map(|token| token.get()),
                    expired_claims: delivery.expired_claims(),
                    redelivery: delivery.is_redelivery(),
                })
                .await
            }
        }
    )*};
}

probe_handlers!(XPing, XPingPong, YPing, XPingTock);

/// One subscriber, `x`, taking `Ping`.
#[router(events = [Ping])]
pub struct OnlyX {
    /// x
    pub x: XPing,
}

/// Two subscribers of `Ping`: `x`, then `y`.
#[router(events = [Ping])]
pub struct XAndY {
    /// x
    pub x: XPing,
    /// y
    pub y: YPing,
}

/// `x` takes `Ping` and `Pong`, `y` takes `Ping`.
#[router(events = [Ping, Pong])]
pub struct PingPong {
    /// x
    pub x: XPingPong,
    /// y
    pub y: YPing,
}

/// `x` takes `Ping` (aggregate type `probe`) and `Tock` (aggregate type `other`).
#[router(events = [Ping, Tock])]
pub struct PingTock {
    /// x
    pub x: XPingTock,
}

impl PingTock {
    /// Logging to `probe`.
    pub fn new(probe: &Probe) -> Self {
        Self {
            x: XPingTock(probe.clone()),
        }
    }
}

impl OnlyX {
    /// Logging to `probe`.
    pub fn new(probe: &Probe) -> Self {
        Self {
            x: XPing(probe.clone()),
        }
    }
}

impl XAndY {
    /// Logging to `probe`.
    pub fn new(probe: &Probe) -> Self {
        Self {
            x: XPing(probe.clone()),
            y: YPing(probe.clone()),
        }
    }
}

impl PingPong {
    /// Logging to `probe`.
    pub fn new(probe: &Probe) -> Self {
        Self {
            x: XPingPong(probe.clone()),
            y: YPing(probe.clone()),
        }
    }
}

/// A subscriber that takes every test event and does nothing: for tests of publishing.
#[subscriber(events = [
    Ping,
    Pong,
    PaymentSucceeded,
    PaymentFailedFinal,
    SubscriptionStarted,
    LicenseUpgraded,
    BotInstalled,
    BotKicked,
])]
pub struct Sink;

impl<E: OutboxEvent> Handle<E> for Sink {
    async fn handle(&self, _: &E, _: &Delivery<'_>) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Routes every test event to [`Sink`].
#[router(events = [
    Ping,
    Pong,
    PaymentSucceeded,
    PaymentFailedFinal,
    SubscriptionStarted,
    LicenseUpgraded,
    BotInstalled,
    BotKicked,
])]
pub struct Everything {
    /// The sink.
    pub sink: Sink,
}

/// Runs batches until `done` holds, pausing briefly when a batch finds nothing to do; panics
/// after `timeout`. Returns the reports of the batches run.
pub async fn run_until<S: Store, R: Router>(
    relay: &Relay<S, R>,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> Vec<BatchReport> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut reports = Vec::new();
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached within {timeout:?}; batches: {reports:?}"
        );
        let report = relay.run_once().await.expect("the store works");
        if report.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        reports.push(report);
    }
    reports
}

/// A relay running in the background (see [`run_idle`]).
pub struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    worker: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops the relay as a shutdown does (its batch in progress recorded) and waits for it.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.worker.await.expect("the relay stops");
    }
}

/// Runs a relay on `store` in the background, and returns once its first claim found nothing:
/// from then on it claims only when woken or when `config`'s poll interval passes.
pub async fn run_idle<S, R>(store: S, router: R, config: outbox_core::RelayConfig) -> Running
where
    S: Store + 'static,
    R: Router + Send + Sync + 'static,
{
    let store = WatchedStore::new(store);
    let idle = store.idle.clone();
    let relay = Relay::new(store, router, config).expect("valid config");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await;
    });
    idle.notified().await;
    Running { stop, worker }
}

/// A store that forwards to another and tells when a claim found nothing: after that, a relay
/// only claims again when woken or when its poll interval passes.
pub struct WatchedStore<S> {
    inner: S,
    /// Notified each time a claim returns no work.
    pub idle: Arc<tokio::sync::Notify>,
    /// Each purge: (batch size asked, rows deleted).
    pub purges: Arc<Mutex<Vec<(u32, u64)>>>,
    /// How many times the status was read.
    pub statuses: Arc<std::sync::atomic::AtomicUsize>,
    /// How many of the next records fail (see [`losing_records`](Self::losing_records)).
    records_to_lose: Arc<std::sync::atomic::AtomicUsize>,
    /// How many records failed so.
    pub lost_records: Arc<std::sync::atomic::AtomicUsize>,
    /// How many of the next records of part of a claim fail (see
    /// [`losing_parts`](Self::losing_parts)).
    parts_to_lose: Arc<std::sync::atomic::AtomicUsize>,
    /// The handler calls running, and started (see [`watching`](Self::watching)).
    busy: Arc<std::sync::atomic::AtomicUsize>,
    started: Arc<std::sync::atomic::AtomicUsize>,
    /// How many claims that found work were made while handler calls ran: one ran as the
    /// claim started, or one started before it returned.
    pub claimed_while_busy: Arc<std::sync::atomic::AtomicUsize>,
    /// Notified each time such a claim returns.
    pub claimed_ahead: Arc<tokio::sync::Notify>,
    /// Each claim that found work: (events asked for, claimed events and deliveries).
    pub claims: Arc<Mutex<Vec<(u32, usize)>>>,
    /// How many claims that took over aggregates of the claim before
    /// ([`ClaimFilter::take_over`](outbox_core::store::ClaimFilter::take_over)) found work.
    pub took_over: Arc<std::sync::atomic::AtomicUsize>,
    /// How long each record waits before it records (see [`slow_records`](Self::slow_records)).
    record_delay: Duration,
    /// How long each registration waits (see [`slow_registers`](Self::slow_registers)).
    register_delay: Duration,
    /// How long each claim waits before it claims (see [`slow_claims`](Self::slow_claims)).
    claim_delay: Duration,
    /// The records in flight.
    recording: Arc<std::sync::atomic::AtomicUsize>,
    /// How many claims started while handler calls ran and a record was in flight: claims
    /// made ahead of a batch before the record of the batch before it ended.
    pub claimed_while_recording: Arc<std::sync::atomic::AtomicUsize>,
    /// Held by each claim while it runs: whoever holds it holds the claims back (see
    /// [`claims_pause`](Self::claims_pause)).
    pause: Arc<tokio::sync::Mutex<()>>,
}

impl<S> WatchedStore<S> {
    /// Watches `inner`.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            idle: Arc::new(tokio::sync::Notify::new()),
            purges: Arc::default(),
            statuses: Arc::default(),
            records_to_lose: Arc::default(),
            lost_records: Arc::default(),
            parts_to_lose: Arc::default(),
            busy: Arc::default(),
            started: Arc::default(),
            claimed_while_busy: Arc::default(),
            claimed_ahead: Arc::new(tokio::sync::Notify::new()),
            claims: Arc::default(),
            took_over: Arc::default(),
            record_delay: Duration::ZERO,
            register_delay: Duration::ZERO,
            claim_delay: Duration::ZERO,
            recording: Arc::default(),
            claimed_while_recording: Arc::default(),
            pause: Arc::default(),
        }
    }

    /// A lock each claim holds while it runs: locked (`pause.lock().await`, which waits for
    /// the claim in flight, if any), no claim runs until the guard is dropped.
    pub fn claims_pause(&self) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(&self.pause)
    }

    /// Makes every record (whole or of a part) wait `delay` before it records.
    #[must_use]
    pub fn slow_records(mut self, delay: Duration) -> Self {
        self.record_delay = delay;
        self
    }

    /// Makes every claim wait `delay` before it claims: a claim then takes a known time at
    /// least, whatever the machine (the relay weighs its handlers against it).
    #[must_use]
    pub fn slow_claims(mut self, delay: Duration) -> Self {
        self.claim_delay = delay;
        self
    }

    /// Makes every registration of a relay (its first claim makes one) wait `delay` first.
    #[must_use]
    pub fn slow_registers(mut self, delay: Duration) -> Self {
        self.register_delay = delay;
        self
    }

    /// Counts the claims that find work while `probe`'s handler calls run (one runs as the
    /// claim starts, or one starts before it returns): claims made ahead, while a batch runs.
    /// (A batch's calls run in tasks of their own: a claim ahead may start between two of
    /// them.)
    #[must_use]
    pub fn watching(mut self, probe: &Probe) -> Self {
        self.busy = probe.busy.clone();
        self.started = probe.started.clone();
        self
    }

    /// Fails the first `n` records of part of a claim ([`Store::record_part`]), as a store
    /// that stops answering would.
    #[must_use]
    pub fn losing_parts(self, n: usize) -> Self {
        self.parts_to_lose
            .store(n, std::sync::atomic::Ordering::SeqCst);
        self
    }

    /// Fails the first `n` records, as a relay that dies after its handlers ran would lose
    /// them: the batch's work is delivered again once its claim expires.
    #[must_use]
    pub fn losing_records(self, n: usize) -> Self {
        self.records_to_lose
            .store(n, std::sync::atomic::Ordering::SeqCst);
        self
    }
}

impl<S> WatchedStore<S> {
    /// Fails this record if `to_lose` says so (counting it down, and the records lost up).
    fn lose_one(
        &self,
        to_lose: &std::sync::atomic::AtomicUsize,
    ) -> Result<(), outbox_core::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        if to_lose
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.lost_records.fetch_add(1, SeqCst);
            return Err(outbox_core::StoreError::new(
                "the record was lost (injected)",
            ));
        }
        Ok(())
    }

    /// Runs `record`, counted among the records in flight, after the record delay.
    async fn recording<T>(&self, record: impl Future<Output = T>) -> T {
        use std::sync::atomic::Ordering::SeqCst;
        self.recording.fetch_add(1, SeqCst);
        if !self.record_delay.is_zero() {
            tokio::time::sleep(self.record_delay).await;
        }
        let recorded = record.await;
        self.recording.fetch_sub(1, SeqCst);
        recorded
    }
}

impl<S: Store> Store for WatchedStore<S> {
    async fn claim(
        &self,
        limit: outbox_core::store::ClaimLimit,
        lease: Duration,
        filter: &outbox_core::store::ClaimFilter,
    ) -> Result<outbox_core::store::Batch, outbox_core::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        let started = self.started.load(SeqCst);
        let busy = self.busy.load(SeqCst) > 0;
        if busy && self.recording.load(SeqCst) > 0 {
            self.claimed_while_recording.fetch_add(1, SeqCst);
        }
        if !self.claim_delay.is_zero() {
            tokio::time::sleep(self.claim_delay).await;
        }
        let paused = self.pause.lock().await;
        let batch = self.inner.claim(limit, lease, filter).await;
        drop(paused);
        let batch = batch?;
        if batch.is_empty() {
            self.idle.notify_one();
        } else {
            self.claims
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((limit.events, batch.claims.len()));
            if !filter.take_over.is_empty() {
                self.took_over.fetch_add(1, SeqCst);
            }
            if busy || self.started.load(SeqCst) != started {
                self.claimed_while_busy.fetch_add(1, SeqCst);
                self.claimed_ahead.notify_one();
            }
        }
        Ok(batch)
    }

    async fn register(
        &self,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> Result<outbox_core::store::Registry, outbox_core::StoreError> {
        if !self.register_delay.is_zero() {
            tokio::time::sleep(self.register_delay).await;
        }
        self.inner.register(relay, routing, ttl).await
    }

    async fn unregister(&self, relay: Uuid) -> Result<(), outbox_core::StoreError> {
        self.inner.unregister(relay).await
    }

    async fn renew(
        &self,
        token: outbox_core::ClaimToken,
        lease: Duration,
    ) -> Result<bool, outbox_core::StoreError> {
        self.inner.renew(token, lease).await
    }

    async fn record(
        &self,
        token: outbox_core::ClaimToken,
        outcomes: &outbox_core::store::Outcomes,
    ) -> Result<outbox_core::store::Recorded, outbox_core::StoreError> {
        self.lose_one(&self.records_to_lose)?;
        self.recording(self.inner.record(token, outcomes)).await
    }

    async fn record_part(
        &self,
        token: outbox_core::ClaimToken,
        outcomes: &outbox_core::store::Outcomes,
    ) -> Result<outbox_core::store::Recorded, outbox_core::StoreError> {
        self.lose_one(&self.parts_to_lose)?;
        self.recording(self.inner.record_part(token, outcomes))
            .await
    }

    fn records_parts(&self) -> bool {
        self.inner.records_parts()
    }

    fn claims_take_over(&self) -> bool {
        self.inner.claims_take_over()
    }

    async fn requeue(
        &self,
        which: &outbox_core::store::Requeue,
    ) -> Result<u64, outbox_core::StoreError> {
        self.inner.requeue(which).await
    }

    async fn status(&self) -> Result<outbox_core::store::Status, outbox_core::StoreError> {
        self.statuses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.status().await
    }

    async fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<outbox_core::store::Purged, outbox_core::StoreError> {
        let purged = self.inner.purge_published(older_than, limit).await?;
        self.purges.lock().unwrap().push((limit, purged.deleted));
        Ok(purged)
    }

    async fn notified(&self) {
        self.inner.notified().await;
    }
}

/// Waits for a relay running in the background to make `done` true; panics after 20 seconds.
pub async fn wait_for(mut done: impl FnMut() -> bool) {
    let limit = Duration::from_secs(20);
    let deadline = tokio::time::Instant::now() + limit;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A late commit, on a database where several transactions publish at once (PostgreSQL,
/// MySQL): a transaction takes the first id and stays open while later ids commit, of another
/// aggregate and (its writer waiting for the late one) of the same aggregate. The relay
/// delivers what committed, then the late event, before its aggregate's next one.
pub async fn a_late_commit_is_delivered_in_order<B: outbox_sqlx::Backend>(
    outbox: &outbox_sqlx::Outbox<B, PingPong>,
    config: outbox_core::RelayConfig,
) {
    let probe = Probe::default();
    let relay = Relay::new(outbox.store(), OnlyX::new(&probe), config).unwrap();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let publish_one = async |outbox: &outbox_sqlx::Outbox<B, PingPong>, aggregate, seq| {
        let mut tx = outbox.begin().await.unwrap();
        tx.publish(&Ping { aggregate, seq }).await.unwrap();
        tx.commit().await.unwrap();
    };

    // A transaction takes the first id and stays open...
    let mut late = outbox.begin().await.unwrap();
    late.publish(&Ping {
        aggregate: a,
        seq: 1,
    })
    .await
    .unwrap();
    // ...while later ids commit, of another aggregate...
    publish_one(outbox, b, 1).await;
    publish_one(outbox, b, 2).await;
    // ...and of the same aggregate, whose writer waits for the late one.
    let same_aggregate = tokio::spawn({
        let outbox = outbox.clone();
        async move { publish_one(&outbox, a, 2).await }
    });
    let wait = Duration::from_secs(20);
    run_until(&relay, wait, || probe.delivered_to("x").len() == 2).await;
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2)]);

    late.commit().await.unwrap();
    same_aggregate.await.unwrap();
    run_until(&relay, wait, || probe.delivered_to("x").len() == 4).await;
    assert_eq!(
        probe.delivered_to("x"),
        [(b, 1), (b, 2), (a, 1), (a, 2)],
        "the late event is delivered, before its aggregate's next one"
    );
    let ids: Vec<(i64, u32)> = probe
        .seen()
        .iter()
        .filter(|s| s.aggregate == a)
        .map(|s| (s.event_id, s.seq))
        .collect();
    assert!(
        ids[0].0 < ids[1].0,
        "the late event took the lower id: {ids:?}"
    );
    assert_eq!(ids[0].0, 1, "and the first id of all: {ids:?}");
}
