//! The relay's chores (status, retention) run beside its deliveries: a chore that hangs does not
//! hold deliveries back, nor the relay's shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use outbox_core::store::{Batch, Outcomes, Purged, Recorded, Requeue, Status};
use outbox_core::testing::MemoryStore;
use outbox_core::{
    ClaimToken, Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, Store, StoreError,
    router, subscriber,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "Opened")]
struct Opened {
    #[outbox(aggregate_id)]
    account: Uuid,
}

#[subscriber(events = [Opened])]
struct Counter(Arc<AtomicUsize>);

impl Handle<Opened> for Counter {
    async fn handle(&self, _: &Opened, _: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[router(events = [Opened])]
struct App {
    counter: Counter,
}

/// A store whose purge never returns (a statement stuck behind a lock, say).
struct HangingPurge {
    inner: MemoryStore,
    purging: Arc<AtomicBool>,
}

impl Store for HangingPurge {
    async fn claim(
        &self,
        limit: outbox_core::store::ClaimLimit,
        lease: Duration,
        filter: &outbox_core::store::ClaimFilter,
    ) -> Result<Batch, StoreError> {
        self.inner.claim(limit, lease, filter).await
    }

    async fn renew(&self, token: ClaimToken, lease: Duration) -> Result<bool, StoreError> {
        self.inner.renew(token, lease).await
    }

    async fn record(&self, token: ClaimToken, outcomes: &Outcomes) -> Result<Recorded, StoreError> {
        self.inner.record(token, outcomes).await
    }

    async fn requeue(&self, which: &Requeue) -> Result<u64, StoreError> {
        self.inner.requeue(which).await
    }

    async fn status(&self) -> Result<Status, StoreError> {
        self.inner.status().await
    }

    async fn purge_published(&self, _: Duration, _: u32) -> Result<Purged, StoreError> {
        self.purging.store(true, Ordering::Relaxed);
        std::future::pending().await
    }

    async fn notified(&self) {
        self.inner.notified().await;
    }
}

#[tokio::test]
async fn a_purge_that_hangs_holds_neither_deliveries_nor_shutdown_back() {
    let inner = MemoryStore::new();
    for _ in 0..3 {
        inner
            .publish(&Opened {
                account: Uuid::new_v4(),
            })
            .unwrap();
    }
    let purging = Arc::new(AtomicBool::new(false));
    let delivered = Arc::new(AtomicUsize::new(0));
    let relay = Relay::new(
        HangingPurge {
            inner,
            purging: purging.clone(),
        },
        App {
            counter: Counter(delivered.clone()),
        },
        // The defaults purge as the relay starts.
        RelayConfig::default().with_poll_interval(Duration::from_millis(10)),
    )
    .unwrap();
    let run = relay.run(async {
        while !(purging.load(Ordering::Relaxed) && delivered.load(Ordering::Relaxed) == 3) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the relay delivered while its purge hung, and stopped when told");
    assert_eq!(delivered.load(Ordering::Relaxed), 3);
}
