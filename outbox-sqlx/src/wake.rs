//! Waking relays when events commit: at once in this process, and in other processes through a
//! coalesced `NOTIFY` sent outside the publishing transaction. Work an operator hands back (a
//! requeue, a skip) wakes them the same way, its `NOTIFY` sent at once.
//!
//! A `NOTIFY` inside every publishing transaction would serialise commits (PostgreSQL takes a
//! global lock to commit a transaction that notifies), so the publishing side only pokes a
//! background task, which sends one `NOTIFY` for however many commits poked it meanwhile. The
//! notification is a hint: relays still poll at their interval, so nothing depends on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use sqlx::Pool;
use tokio::sync::{Notify, mpsc, watch};

use crate::backend::Backend;
use crate::names::TableNames;

/// The least time between two NOTIFYs of one outbox: the most a relay in another process waits
/// for a busy producer's wake-up, beyond the NOTIFY's own trip.
const NOTIFY_GAP: Duration = Duration::from_millis(5);

/// The wake-ups of one set of outbox tables.
#[derive(Debug)]
pub(crate) struct Wakeups {
    /// Relays of this process wait on it.
    local: Arc<Notify>,
    /// The `NOTIFY` channel of these tables.
    channel: String,
    /// The payload of this handle's own notifications, which its listener ignores: this process's
    /// relays were woken at commit already, and the echo would only cost them an empty claim.
    sender: String,
    /// Off for connection poolers that do not support `LISTEN` (poll-only mode).
    cross_process: AtomicBool,
    /// Pokes the task that sends `NOTIFY`; started by the first commit.
    notifier: OnceLock<mpsc::Sender<()>>,
    /// Whether the task that `LISTEN`s was started, by the first relay that waits.
    listening: AtomicBool,
    /// Set when the outbox closes; dropped with it. The listener and the notifier end on either.
    closed: watch::Sender<bool>,
}

impl Wakeups {
    pub(crate) fn new(names: &TableNames) -> Self {
        Self {
            local: Arc::new(Notify::new()),
            channel: format!("outbox_{:08x}", names.lock_namespace()),
            sender: uuid::Uuid::new_v4().simple().to_string(),
            cross_process: AtomicBool::new(true),
            notifier: OnceLock::new(),
            listening: AtomicBool::new(false),
            closed: watch::Sender::new(false),
        }
    }

    /// Ends the listener and the notifier.
    pub(crate) fn close(&self) {
        self.closed.send_replace(true);
    }

    pub(crate) fn set_cross_process(&self, on: bool) {
        self.cross_process.store(on, Ordering::Relaxed);
    }

    /// After a commit that published: wake this process's relays, and poke the notifier.
    pub(crate) fn committed<DB: Backend>(&self, pool: &Pool<DB>) {
        self.local.notify_one();
        if !self.cross_process.load(Ordering::Relaxed) {
            return;
        }
        let notifier = self.notifier.get_or_init(|| {
            let (poke, mut poked) = mpsc::channel::<()>(1);
            let (pool, channel, sender) =
                (pool.clone(), self.channel.clone(), self.sender.clone());
            let mut closed = self.closed.subscribe();
            tokio::spawn(async move {
                // Ends when the outbox closes or is dropped.
                loop {
                    tokio::select! {
                        biased;
                        _ = closed.wait_for(|closed| *closed) => return,
                        poke = poked.recv() => if poke.is_none() { return },
                    }
                    if let Err(error) = DB::notify(&pool, &channel, &sender).await {
                        tracing::debug!(%error, "outbox could not notify relays in other processes");
                    }
                    // Commits meanwhile share the next NOTIFY: at most one per gap, however many
                    // commits (a NOTIFY per commit cost producers 8%, measured).
                    tokio::time::sleep(NOTIFY_GAP).await;
                }
            });
            poke
        });
        // Full: a NOTIFY is already due, which covers this commit too.
        let _ = notifier.try_send(());
    }

    /// After an operator handed work back (a requeue, a skip that frees the events behind a
    /// delivery): wake this process's relays, and those of other processes by a `NOTIFY` sent
    /// now and awaited, not coalesced (the tool that handed the work back may exit at once).
    pub(crate) async fn handed_back<DB: Backend>(&self, pool: &Pool<DB>) {
        self.local.notify_one();
        if !self.cross_process.load(Ordering::Relaxed) {
            return;
        }
        if let Err(error) = DB::notify(pool, &self.channel, &self.sender).await {
            tracing::debug!(%error, "outbox could not notify relays in other processes");
        }
    }

    /// Resolves when a relay should look for work: a commit in this process, or a notification
    /// from another (listening starts on the first call).
    pub(crate) async fn notified<DB: Backend>(&self, pool: &Pool<DB>) {
        if self.cross_process.load(Ordering::Relaxed)
            && !self.listening.swap(true, Ordering::AcqRel)
        {
            let wake: Weak<Notify> = Arc::downgrade(&self.local);
            tokio::spawn(DB::listen(
                pool.clone(),
                self.channel.clone(),
                self.sender.clone(),
                wake,
                self.closed.subscribe(),
            ));
        }
        self.local.notified().await;
    }
}
