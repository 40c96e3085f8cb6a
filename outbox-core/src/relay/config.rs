//! The relay's settings and their validation.

use std::time::Duration;

use crate::error::ConfigError;
use crate::retry::RetryPolicy;
use crate::store::ClaimLimit;

/// The default [concurrency](RelayConfig::with_concurrency).
const DEFAULT_CONCURRENCY: usize = 32;
/// The default [byte limit of a batch](RelayConfig::with_batch_bytes): 16 MiB.
const DEFAULT_BATCH_BYTES: u64 = 16 << 20;
/// The default [limit of retries in place](RelayConfig::with_retry_in_place).
const DEFAULT_RETRY_IN_PLACE: Duration = Duration::from_millis(20);

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
    pub(super) poll_interval: Duration,
    pub(super) batch_size: u32,
    pub(super) batch_bytes: u64,
    pub(super) concurrency: usize,
    pub(super) lease: Duration,
    pub(super) handler_timeout: Duration,
    pub(super) park_delay: Duration,
    pub(super) retry: RetryPolicy,
    pub(super) retry_in_place: Duration,
    pub(super) max_error_backoff: Duration,
    pub(super) status_interval: Duration,
    pub(super) retention: Option<Retention>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(2),
            batch_size: 2000,
            batch_bytes: DEFAULT_BATCH_BYTES,
            concurrency: DEFAULT_CONCURRENCY,
            lease: Duration::from_secs(8),
            handler_timeout: Duration::from_secs(3),
            park_delay: Duration::from_secs(300),
            retry: RetryPolicy::default(),
            retry_in_place: DEFAULT_RETRY_IN_PLACE,
            max_error_backoff: Duration::from_secs(30),
            status_interval: Duration::from_secs(15),
            retention: Some(Retention::default()),
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

    /// How many events (and as many pending deliveries) one batch claims at most (default 2000,
    /// at most 10 000).
    ///
    /// A claim takes what is there up to this many, so a large batch costs nothing when little
    /// waits; it pays when a backlog builds: one claim and one record per batch, and more
    /// (subscriber, aggregate) keys whose handlers can run at once. While the handlers are what
    /// the relay waits for (a batch's calls took longer than its claim), it claims a quarter of
    /// this (at least one), until a batch's calls take less than half its claim: the claims then
    /// overlap the handlers, and a smaller batch ends sooner and holds fewer aggregates back from
    /// the claim ahead of it. So it does after a batch with deliveries to record (failures or
    /// retries not made in place): a failed call makes the later events of its key in the batch
    /// delivery rows of their own, more of them in a larger batch. (A retry made in place writes
    /// no row: after it, quick handlers get the whole batch.) Its first claim is a quarter too
    /// (it knows nothing of its handlers yet: slow ones would make a whole first batch hold
    /// every aggregate of a backlog, with nothing to claim ahead of it). The seed's 50 drains a
    /// backlog at about a third of the rate of 500 on PostgreSQL, and 500 at about three
    /// quarters of the rate of 2000 (see the README's benchmark).
    #[must_use]
    pub fn with_batch_size(mut self, size: u32) -> Self {
        self.batch_size = size;
        self
    }

    /// How many bytes of payload one batch claims at most (default 16 MiB), among its events
    /// and as many among its pending deliveries (each counting its event's payload): the bound
    /// on what a batch holds in memory, whatever the payloads weigh.
    ///
    /// A claim takes events in order until the next one would go over this or over the
    /// [batch size](Self::with_batch_size), whichever comes first; it always takes the first,
    /// so an event larger than this is claimed alone, not left behind. A payload counts the
    /// bytes of its JSON text as the outbox stores it. At the default, events of up to 8 KiB
    /// fill whole batches of 2000; events of 1 MiB are claimed 16 at a time. A relay holds its
    /// batch, the batch claimed ahead of it and the rests of batches split for retries in
    /// place, each decoded as well as read: allow a few times this much memory per
    /// [`run`](crate::Relay::run).
    ///
    /// ```
    /// use outbox_core::{ConfigError, RelayConfig};
    ///
    /// let config = RelayConfig::default().with_batch_bytes(4 << 20);
    /// assert_eq!(config.batch_bytes(), 4 << 20);
    /// let Err(ConfigError::InvalidSetting { setting, reason }) =
    ///     RelayConfig::default().with_batch_bytes(0).validate()
    /// else {
    ///     panic!("a batch of 0 bytes is refused");
    /// };
    /// assert_eq!((setting, reason.as_str()), ("batch bytes", "0 bytes claim nothing"));
    /// ```
    #[must_use]
    pub fn with_batch_bytes(mut self, bytes: u64) -> Self {
        self.batch_bytes = bytes;
        self
    }

    /// How many handler calls run at once, at most (default 32, at most 10 000), per
    /// [`run`](crate::Relay::run): the batch in progress and the rests of the batches split
    /// before it share them. A relay run from several tasks has this many in each.
    ///
    /// Calls for different (subscriber, aggregate) keys run concurrently, in tasks of their own
    /// on the runtime the relay runs on (on a multi-threaded runtime, in parallel on its worker
    /// threads): a batch has this many, each running one key's calls and then the next key's;
    /// the calls of one key run one at a time, in commit order, whatever the setting. `1` calls every handler in turn. Handlers that wait on I/O
    /// (a database, a service) gain the most. A handler that blocks its thread holds that
    /// worker (and, on a current-thread runtime, everything else) up: run such work on
    /// `tokio::task::spawn_blocking`.
    #[must_use]
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// How long a claim lasts without renewal (default 8 s, more than twice the handler timeout).
    ///
    /// A relay renews the claim of the batch it works on every quarter of the lease, so a batch
    /// may run as long as it needs; the lease is how long work stays claimed after its relay
    /// died, stalled or lost its database: a relay killed with its batch's aggregates claimed
    /// holds them back for up to one lease, then another relay takes them (and may call
    /// handlers that already ran: see [`Delivery::is_redelivery`](crate::Delivery::is_redelivery)).
    /// A relay starts a handler only while its claim has more than the handler timeout left,
    /// so a handler never outlives its claim unless the relay's process stalls in it; the claim
    /// token ([`Delivery::claim_token`](crate::Delivery::claim_token)) lets a handler that
    /// writes to the outbox's database exclude even that.
    ///
    /// A longer lease costs nothing while relays are healthy and delays recovery from a dead
    /// relay by as much; a lease too short for the database's round trips under load makes
    /// renewals fail and batches stop early. At most 1000 years (a time the store keeps).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one handler call may take before it counts as a transient failure (default 3 s;
    /// it must be less than half the [lease](Self::with_lease): raise the lease to allow slower
    /// handlers).
    #[must_use]
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// How long a parked event (newer version, unknown event type) waits before it is looked at
    /// again (default 5 minutes; at most 1000 years, a time the store keeps).
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

    /// Retries due within `limit` of a failure are made in place (default 20 ms; at most the
    /// handler timeout; `Duration::ZERO` never).
    ///
    /// A failed delivery is otherwise written down as a delivery row, with the later events of
    /// its (subscriber, aggregate) waiting behind it, and claimed again once due: a record and
    /// a claim later at the earliest, tens of milliseconds. A retry due sooner than that gains
    /// nothing from the row, so the relay waits for it in memory and calls the handler again,
    /// in the same batch, while the key's later calls wait behind it as they would behind the
    /// row. The [retry policy](Self::with_retry) decides the delays and the attempts as
    /// always, and each attempt is counted and traced the same; only where the relay waits
    /// changes. A retry in place holds the batch's end back by its delay (the next batch is
    /// claimed when this one is done), so keep the limit short; a retry that the claim would
    /// not outlast is written down instead.
    #[must_use]
    pub fn with_retry_in_place(mut self, limit: Duration) -> Self {
        self.retry_in_place = limit;
        self
    }

    /// The longest wait between attempts to reach a failing store (default 30 s).
    #[must_use]
    pub fn with_max_error_backoff(mut self, backoff: Duration) -> Self {
        self.max_error_backoff = backoff;
        self
    }

    /// How often a running relay reads the store's [`Status`](crate::Status) into the
    /// [gauges](crate::telemetry) (default 15 s).
    #[must_use]
    pub fn with_status_interval(mut self, interval: Duration) -> Self {
        self.status_interval = interval;
        self
    }

    /// Deletes old published events as the relay runs (default: [`Retention::default`], the seed's
    /// 30 days, so that the table does not grow for ever; dead letters and events some
    /// subscriber still waits for are kept). [`without_retention`](Self::without_retention)
    /// keeps everything.
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

    /// Keeps published events for ever (the relay deletes nothing).
    #[must_use]
    pub fn without_retention(mut self) -> Self {
        self.retention = None;
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

    /// The byte limit of a batch.
    pub fn batch_bytes(&self) -> u64 {
        self.batch_bytes
    }

    /// What a claim asks for: the batch size, or a quarter of it (at least one) when the relay
    /// should claim `less` (its handlers are what it waits for, or its last batch met
    /// failures); the byte limit either way.
    pub(super) fn claim_size(&self, less: bool) -> ClaimLimit {
        let events = if less {
            (self.batch_size / 4).max(1)
        } else {
            self.batch_size
        };
        ClaimLimit::new(events, self.batch_bytes)
    }

    /// The most handler calls run at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retry policy.
    pub fn retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The handler timeout.
    pub fn handler_timeout(&self) -> Duration {
        self.handler_timeout
    }

    /// The longest retry delay waited for in place.
    pub fn retry_in_place(&self) -> Duration {
        self.retry_in_place
    }

    /// The first setting that is out of range, if any: [`Relay::new`](crate::Relay::new)
    /// refuses the same settings. For settings read from a file or the environment, to say
    /// what is wrong before anything starts.
    ///
    /// ```
    /// use outbox_core::{ConfigError, RelayConfig};
    ///
    /// let config = RelayConfig::default().with_batch_size(20_000);
    /// let Err(ConfigError::InvalidSetting { setting, reason }) = config.validate() else {
    ///     panic!("a batch of 20 000 is out of range");
    /// };
    /// assert_eq!(setting, "batch size");
    /// assert_eq!(reason, "20000 is outside 1..=10000");
    /// assert!(RelayConfig::default().validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |setting, reason: String| Err(ConfigError::InvalidSetting { setting, reason });
        if !(1..=10_000).contains(&self.batch_size) {
            return invalid(
                "batch size",
                format!("{} is outside 1..=10000", self.batch_size),
            );
        }
        if self.batch_bytes == 0 {
            return invalid("batch bytes", "0 bytes claim nothing".to_owned());
        }
        if !(1..=10_000).contains(&self.concurrency) {
            return invalid(
                "concurrency",
                format!("{} is outside 1..=10000", self.concurrency),
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
        // (Settings that become times in the store. The handler timeout and retries in place
        // are bounded by the lease, below and above.)
        crate::retry::within_longest(
            "park delay",
            self.park_delay,
            "an event parked that long would never be looked at again",
        )?;
        crate::retry::within_longest(
            "lease",
            self.lease,
            "a dead relay's work would never be free again",
        )?;
        if let Some(retention) = &self.retention {
            crate::retry::within_longest(
                "retention",
                retention.keep,
                "to keep published events for ever, turn retention off (`without_retention`)",
            )?;
        }
        if let Some(retention) = &self.retention
            && !(1..=10_000).contains(&retention.batch_size)
        {
            return invalid(
                "retention batch size",
                format!("{} is outside 1..=10000", retention.batch_size),
            );
        }
        if self.retry_in_place > self.handler_timeout {
            return invalid(
                "retry in place",
                format!(
                    "{:?} is more than the handler timeout ({:?}): retries due that late are \
                     written down and claimed again; keep retries in place short",
                    self.retry_in_place, self.handler_timeout
                ),
            );
        }
        if self.handler_timeout.saturating_mul(2) >= self.lease {
            return invalid(
                "handler timeout",
                format!(
                    "{:?} is not less than half the lease ({:?}): a claim could expire while its \
                     handler still runs; raise the lease to more than twice the timeout",
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
/// statement, between its own batches (and whatever else the store keeps for the same window:
/// the sqlx stores' inbox records); once a batch comes back short, it waits
/// [`interval`](Self::interval) before looking again. Dead letters, events not yet published and
/// events some subscriber has not received yet are never deleted. Several relays may purge at
/// once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub(super) keep: Duration,
    pub(super) batch_size: u32,
    pub(super) interval: Duration,
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
    /// Keeps published events for `window` (the default is 30 days; at most 1000 years: to
    /// keep them for ever, turn retention off, [`RelayConfig::without_retention`]).
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
