//! A batch's handler calls run on the runtime's worker threads, in tasks of their own,
//! not all on the relay's task: two calls of different keys that each hold their thread until
//! the other has started both succeed on a runtime of two workers. (On one task, the first
//! would hold the thread its partner needs, and give up.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use outbox_core::testing::MemoryStore;
use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, router, subscriber,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "Opened")]
struct Opened {
    #[outbox(aggregate_id)]
    account: Uuid,
}

/// How many calls started, and how many ended well or not.
#[derive(Default)]
struct Meeting {
    started: Mutex<usize>,
    changed: Condvar,
    delivered: AtomicUsize,
    failed: AtomicUsize,
}

#[subscriber(events = [Opened])]
struct Partner(Arc<Meeting>);

impl Handle<Opened> for Partner {
    async fn handle(&self, _: &Opened, _: &Delivery<'_>) -> Result<(), HandlerError> {
        let meeting = &*self.0;
        // Holds this thread, as work that computes (or blocks) does, until both calls started.
        let mut started = meeting.started.lock().unwrap();
        *started += 1;
        meeting.changed.notify_all();
        let (started, waited) = meeting
            .changed
            .wait_timeout_while(started, Duration::from_secs(5), |started| *started < 2)
            .unwrap();
        drop(started);
        if waited.timed_out() {
            meeting.failed.fetch_add(1, Ordering::Relaxed);
            return Err(HandlerError::permanent(
                "the other call did not start while this one held its thread",
            ));
        }
        meeting.delivered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[router(events = [Opened])]
struct App {
    partner: Partner,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_of_different_keys_run_in_parallel_on_the_runtimes_workers() {
    let store = MemoryStore::new();
    for _ in 0..2 {
        store
            .publish(&Opened {
                account: Uuid::new_v4(),
            })
            .unwrap();
    }
    let meeting = Arc::new(Meeting::default());
    let relay = Relay::new(
        store,
        App {
            partner: Partner(meeting.clone()),
        },
        RelayConfig::default()
            .with_concurrency(2)
            .with_poll_interval(Duration::from_millis(10)),
    )
    .unwrap();
    let ended = meeting.clone();
    let run = relay.run(async move {
        while ended.delivered.load(Ordering::Relaxed) + ended.failed.load(Ordering::Relaxed) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("both calls ended");
    assert_eq!(
        meeting.failed.load(Ordering::Relaxed),
        0,
        "no call waited in vain"
    );
    assert_eq!(meeting.delivered.load(Ordering::Relaxed), 2);
}
