//! Poison never stalls the relay, on PostgreSQL and on SQLite (and the memory store where the
//! case applies): text the database refuses (a NUL), a stored row this build cannot read, and
//! user code that panics while decoding each end as one stored retry or one dead letter, while
//! every other event is delivered. The relay keeps running throughout.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, Relay, RelayConfig, RetryPolicy, router,
    subscriber,
};
use outbox_sqlx::Outbox;
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{Fail, OnlyX, Ping, Probe, run_until};
use outbox_tests::on_every_backend;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use uuid::Uuid;

on_every_backend!(
    a_nul_in_a_handler_error_is_stored_as_a_retry,
    a_nul_in_a_payload_string_is_stored_and_delivered_exactly,
    a_row_that_cannot_be_read_is_one_dead_letter,
    a_delivery_whose_row_cannot_be_read_is_one_dead_letter,
    a_panicking_deserialize_is_one_dead_letter,
    a_panicking_upcaster_is_one_dead_letter,
);

const WAIT: Duration = Duration::from_secs(20);

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(20))
        .with_retry(RetryPolicy::new([Duration::from_secs(3600)]).unwrap())
}

/// A note with free text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "note")]
struct Noted {
    #[outbox(aggregate_id)]
    note: Uuid,
    text: String,
}

/// Its `Deserialize` has a bug: it panics on 13.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "note")]
struct Fragile {
    #[outbox(aggregate_id)]
    note: Uuid,
    #[serde(deserialize_with = "panics_on_13")]
    value: u32,
}

fn panics_on_13<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let value = u32::deserialize(deserializer)?;
    assert_ne!(value, 13, "a bug in a Deserialize impl");
    Ok(value)
}

/// Version 2; its upcaster from version 1 has a bug: it panics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "note", version = 2)]
#[outbox(upcast(from = 1, with = panicking_upcast))]
struct Upcast {
    #[outbox(aggregate_id)]
    note: Uuid,
    value: u32,
}

fn panicking_upcast(_: Value) -> Result<Value, &'static str> {
    panic!("a bug in an upcaster")
}

/// Everything the notes subscriber handled, by event type.
#[derive(Clone, Default)]
struct Handled(Arc<Mutex<Vec<(String, Uuid, String)>>>);

impl Handled {
    fn of(&self, note: Uuid) -> Vec<(String, String)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|h| h.1 == note)
            .map(|h| (h.0.clone(), h.2.clone()))
            .collect()
    }
}

#[subscriber(events = [Noted, Fragile, Upcast], name = "notes")]
struct Notes(Handled);

impl Handle<Noted> for Notes {
    async fn handle(&self, event: &Noted, _: &Delivery<'_>) -> Result<(), HandlerError> {
        let handled = ("Noted".to_owned(), event.note, event.text.clone());
        self.0.0.lock().unwrap().push(handled);
        Ok(())
    }
}

impl Handle<Fragile> for Notes {
    async fn handle(&self, event: &Fragile, _: &Delivery<'_>) -> Result<(), HandlerError> {
        let handled = ("Fragile".to_owned(), event.note, event.value.to_string());
        self.0.0.lock().unwrap().push(handled);
        Ok(())
    }
}

impl Handle<Upcast> for Notes {
    async fn handle(&self, event: &Upcast, _: &Delivery<'_>) -> Result<(), HandlerError> {
        let handled = ("Upcast".to_owned(), event.note, event.value.to_string());
        self.0.0.lock().unwrap().push(handled);
        Ok(())
    }
}

#[router(events = [Noted, Fragile, Upcast])]
struct NotesApp {
    notes: Notes,
}

async fn notes<B: TestBackend>() -> (B::Guard, Outbox<B, NotesApp>, Handled) {
    let (db, outbox) = outbox::<B, NotesApp>().await;
    (db, outbox, Handled::default())
}

fn relay_of<B: TestBackend>(
    outbox: &Outbox<B, NotesApp>,
    handled: &Handled,
) -> Relay<outbox_sqlx::SqlStore<B>, NotesApp> {
    outbox
        .relay(
            NotesApp {
                notes: Notes(handled.clone()),
            },
            config(),
        )
        .unwrap()
}

async fn publish<B: TestBackend, E: OutboxEvent + outbox_core::RoutedBy<NotesApp>>(
    outbox: &Outbox<B, NotesApp>,
    event: &E,
) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(event).await.unwrap();
    tx.commit().await.unwrap();
}

fn noted(note: Uuid, text: &str) -> Noted {
    Noted {
        note,
        text: text.to_owned(),
    }
}

/// Publishes a note of a fresh aggregate after the poison and checks it is delivered.
async fn others_are_delivered<B: TestBackend>(
    outbox: &Outbox<B, NotesApp>,
    relay: &Relay<outbox_sqlx::SqlStore<B>, NotesApp>,
    handled: &Handled,
) {
    let other = Uuid::new_v4();
    publish(outbox, &noted(other, "fine")).await;
    run_until(relay, WAIT, || !handled.of(other).is_empty()).await;
}

async fn a_nul_in_a_handler_error_is_stored_as_a_retry<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, outbox_tests::kit::PingPong>().await;
    let probe = Probe::default();
    let (poisoned, other) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", poisoned, 1, [Fail::Message("bad\0byte".to_owned())]);
    let relay = Relay::new(outbox.store(), OnlyX::new(&probe), config()).unwrap();
    let mut tx = outbox.begin().await.unwrap();
    for aggregate in [poisoned, other] {
        tx.publish(&Ping { aggregate, seq: 1 }).await.unwrap();
    }
    tx.commit().await.unwrap();
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.retried, report.delivered), (1, 1), "{report:?}");
    assert!(!report.lost);
    let id = B::events(outbox.pool()).await[0].id;
    let delivery = B::delivery(outbox.pool(), "x", id).await.unwrap();
    assert_eq!(
        delivery.last_error.as_deref(),
        Some("transient error: bad\u{FFFD}byte")
    );
    assert_eq!(probe.delivered_to("x"), [(other, 1)]);
}

async fn a_nul_in_a_payload_string_is_stored_and_delivered_exactly<B: TestBackend>() {
    let (_db, outbox, handled) = notes::<B>().await;
    let relay = relay_of(&outbox, &handled);
    let note = Uuid::new_v4();
    let text = "nul:\0, escaped: \\u0000, and U+FFFD: \u{FFFD}";
    publish(&outbox, &noted(note, text)).await;
    run_until(&relay, WAIT, || !handled.of(note).is_empty()).await;
    assert_eq!(handled.of(note), [("Noted".to_owned(), text.to_owned())]);
    others_are_delivered(&outbox, &relay, &handled).await;
    let status = outbox.status().await.unwrap();
    assert!(
        status.is_settled() && status.dead_letters == 0,
        "{status:?}"
    );
}

async fn a_row_that_cannot_be_read_is_one_dead_letter<B: TestBackend>() {
    let (_db, outbox, handled) = notes::<B>().await;
    let relay = relay_of(&outbox, &handled);
    let note = Uuid::new_v4();
    publish(&outbox, &noted(note, "first")).await;
    let id = B::events(outbox.pool()).await[0].id;
    B::break_occurred_at(outbox.pool(), id).await;
    publish(&outbox, &noted(note, "second")).await;
    others_are_delivered(&outbox, &relay, &handled).await;
    let dead = outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0].event_id, dead[0].subscriber.as_deref()),
        (id, None)
    );
    let reason = dead[0].last_error.clone().unwrap();
    assert!(
        reason.starts_with("the stored event cannot be read: "),
        "{reason}"
    );
    // Its aggregate's later event waits behind it.
    assert!(handled.of(note).is_empty());
    let status = outbox.status().await.unwrap();
    assert_eq!(status.blocked_aggregates, 1, "{status:?}");
}

async fn a_delivery_whose_row_cannot_be_read_is_one_dead_letter<B: TestBackend>() {
    let (_db, outbox) = outbox::<B, outbox_tests::kit::PingPong>().await;
    let probe = Probe::default();
    let (poisoned, other) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", poisoned, 1, [Fail::Transient]);
    let config = config().with_retry(RetryPolicy::new([Duration::from_millis(50)]).unwrap());
    let relay = Relay::new(outbox.store(), OnlyX::new(&probe), config).unwrap();
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: poisoned,
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(relay.run_once().await.unwrap().retried, 1);
    // x's retry is due soon; by then its event's row cannot be read.
    let id = B::events(outbox.pool()).await[0].id;
    B::break_occurred_at(outbox.pool(), id).await;
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Ping {
        aggregate: other,
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    run_until(&relay, WAIT, || {
        probe.delivered_to("x").contains(&(other, 1))
    })
    .await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap()
        .is_empty()
    {
        assert!(tokio::time::Instant::now() < deadline, "no dead letter");
        relay.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(
        (dead[0].event_id, dead[0].subscriber.as_deref()),
        (id, Some("x"))
    );
    assert_eq!(
        probe
            .calls_of("x")
            .iter()
            .filter(|c| c.0 == poisoned)
            .count(),
        1
    );
}

async fn a_panicking_deserialize_is_one_dead_letter<B: TestBackend>() {
    let (_db, outbox, handled) = notes::<B>().await;
    let relay = relay_of(&outbox, &handled);
    let note = Uuid::new_v4();
    publish(&outbox, &Fragile { note, value: 13 }).await;
    publish(&outbox, &Fragile { note, value: 14 }).await;
    others_are_delivered(&outbox, &relay, &handled).await;
    let dead = outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0].last_error.clone().unwrap();
    assert_eq!(
        reason,
        "decoding `Fragile` panicked: assertion `left != right` failed: a bug in a Deserialize \
         impl\n  left: 13\n right: 13"
    );
    assert!(handled.of(note).is_empty(), "14 waits behind 13");
}

async fn a_panicking_upcaster_is_one_dead_letter<B: TestBackend>() {
    let (_db, outbox, handled) = notes::<B>().await;
    let relay = relay_of(&outbox, &handled);
    let note = Uuid::new_v4();
    let id = B::insert_raw(
        outbox.pool(),
        "Upcast",
        note,
        &format!(r#"{{"version":1,"data":{{"note":"{note}","value":1}}}}"#),
    )
    .await;
    others_are_delivered(&outbox, &relay, &handled).await;
    let dead = outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].event_id, id);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("decoding `Upcast` panicked: a bug in an upcaster")
    );
}

/// The decoding panics over the test kit's memory store.
mod memory {
    use outbox_core::testing::{MemoryStore, drain};
    use outbox_core::{Relay, Store};
    use uuid::Uuid;

    use super::{Fragile, Handled, Noted, Notes, NotesApp, config};

    #[tokio::test]
    async fn a_panicking_deserialize_or_upcaster_is_one_dead_letter() {
        let (store, handled) = (MemoryStore::new(), Handled::default());
        let (fragile, upcast, other) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        store
            .publish(&Fragile {
                note: fragile,
                value: 13,
            })
            .unwrap();
        store.insert_raw(
            "Upcast",
            "note",
            upcast,
            &format!(r#"{{"version":1,"data":{{"note":"{upcast}","value":1}}}}"#),
        );
        store
            .publish(&Noted {
                note: other,
                text: "fine\0".into(),
            })
            .unwrap();
        let relay = Relay::new(
            store.clone(),
            NotesApp {
                notes: Notes(handled.clone()),
            },
            config(),
        )
        .unwrap();
        let report = drain(&relay).await.unwrap();
        assert_eq!((report.delivered, report.dead), (1, 2), "{report:?}");
        assert_eq!(
            handled.of(other),
            [("Noted".to_owned(), "fine\0".to_owned())]
        );
        assert_eq!(store.status().await.unwrap().dead_letters, 2);
    }
}
