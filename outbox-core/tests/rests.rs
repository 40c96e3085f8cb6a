//! A batch that splits (its keys left only wait for retries in place, or no call ended for a
//! while) goes on beside the delivery loop: its rest records the aggregates it finishes, as it
//! finishes them, even while the loop still records the batch before. (A part record the rest
//! began and nobody polled kept its transaction and its locks open; the record before, waiting
//! on those locks, gave up after five lock timeouts and its batch was delivered again.)

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::store::{
    Batch, ClaimFilter, ClaimLimit, Outcomes, Purged, Recorded, Requeue, Status,
};
use outbox_core::testing::MemoryStore;
use outbox_core::{
    ClaimToken, Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, RetryPolicy,
    Store, StoreError, router, subscriber,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "Opened")]
struct Opened {
    #[outbox(aggregate_id)]
    account: Uuid,
}

/// What the handler does with each account.
#[derive(Clone)]
struct Script {
    /// Waits for `go` (the first batch's only event).
    first: Uuid,
    go: Arc<Notify>,
    /// Fails once, then succeeds.
    failing: Uuid,
    failed: Arc<Mutex<HashSet<Uuid>>>,
    /// Takes 100 ms.
    slow: Uuid,
    done: Arc<AtomicUsize>,
}

#[subscriber(events = [Opened])]
struct Worker(Script);

impl Handle<Opened> for Worker {
    async fn handle(&self, event: &Opened, _: &Delivery<'_>) -> Result<(), HandlerError> {
        let script = &self.0;
        if event.account == script.first {
            script.go.notified().await;
        }
        if event.account == script.failing && script.failed.lock().unwrap().insert(event.account) {
            return Err(HandlerError::transient("fails once"));
        }
        if event.account == script.slow {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        script.done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[router(events = [Opened])]
struct App {
    worker: Worker,
}

/// A store whose record of the first batch waits for a part of a later batch to be recorded
/// (as a record waits on the locks of another's open transaction), for at most 3 s.
struct RecordWaitsForPart {
    inner: MemoryStore,
    first: Arc<Mutex<Option<ClaimToken>>>,
    part_recorded: Notify,
    parts: AtomicUsize,
    gave_up: Arc<AtomicBool>,
}

impl Store for RecordWaitsForPart {
    async fn claim(
        &self,
        limit: ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, StoreError> {
        let batch = self.inner.claim(limit, lease, filter).await?;
        if !batch.is_empty() {
            self.first.lock().unwrap().get_or_insert(batch.token);
        }
        Ok(batch)
    }

    async fn renew(&self, token: ClaimToken, lease: Duration) -> Result<bool, StoreError> {
        self.inner.renew(token, lease).await
    }

    async fn record(&self, token: ClaimToken, outcomes: &Outcomes) -> Result<Recorded, StoreError> {
        if *self.first.lock().unwrap() == Some(token) {
            let part = self.part_recorded.notified();
            if self.parts.load(Ordering::SeqCst) == 0
                && tokio::time::timeout(Duration::from_secs(3), part)
                    .await
                    .is_err()
            {
                self.gave_up.store(true, Ordering::SeqCst);
            }
        }
        self.inner.record(token, outcomes).await
    }

    async fn record_part(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> Result<Recorded, StoreError> {
        let recorded = self.inner.record_part(token, outcomes).await;
        self.parts.fetch_add(1, Ordering::SeqCst);
        self.part_recorded.notify_waiters();
        recorded
    }

    fn records_parts(&self) -> bool {
        true
    }

    async fn requeue(&self, which: &Requeue) -> Result<u64, StoreError> {
        self.inner.requeue(which).await
    }

    async fn status(&self) -> Result<Status, StoreError> {
        self.inner.status().await
    }

    async fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<Purged, StoreError> {
        self.inner.purge_published(older_than, limit).await
    }

    async fn notified(&self) {
        self.inner.notified().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_batch_records_its_parts_while_the_batch_before_is_recorded() {
    let inner = MemoryStore::new();
    let script = Script {
        first: Uuid::new_v4(),
        go: Arc::new(Notify::new()),
        failing: Uuid::new_v4(),
        failed: Arc::default(),
        slow: Uuid::new_v4(),
        done: Arc::default(),
    };
    let quick = Uuid::new_v4();
    inner
        .publish(&Opened {
            account: script.first,
        })
        .unwrap();
    let (first, gave_up) = (Arc::<Mutex<Option<ClaimToken>>>::default(), Arc::default());
    let store = RecordWaitsForPart {
        inner: inner.clone(),
        first: Arc::clone(&first),
        part_recorded: Notify::new(),
        parts: AtomicUsize::new(0),
        gave_up: Arc::clone(&gave_up),
    };
    let config = RelayConfig::default()
        .with_poll_interval(Duration::from_millis(10))
        .with_retry(RetryPolicy::new([Duration::from_millis(200)]).unwrap())
        .with_retry_in_place(Duration::from_millis(300));
    let relay = Relay::new(
        store,
        App {
            worker: Worker(script.clone()),
        },
        config,
    )
    .unwrap();
    let done = script.done.clone();
    let run = relay.run(async {
        while done.load(Ordering::Relaxed) < 4 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let drive = async {
        // The first batch holds the first event alone; the next one the other three, claimed
        // beside the first batch's record. Its quick key ends, the failing one waits 200 ms
        // for its retry in place, the slow one ends after 100 ms: the batch splits first
        // (no call ended for 50 ms), and its rest records the slow key's aggregate as it ends.
        while first.lock().unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for account in [script.failing, script.slow, quick] {
            inner.publish(&Opened { account }).unwrap();
        }
        script.go.notify_one();
    };
    tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(run, drive) })
        .await
        .expect("the relay delivers every event");
    assert_eq!(script.done.load(Ordering::Relaxed), 4);
    assert!(
        !gave_up.load(Ordering::SeqCst),
        "the record of the first batch waited 3 s for the split batch's rest to record a part"
    );
}
