//! (i) Relay to NATS JetStream: a relay whose one subscriber publishes each event to a stream and
//! waits for its acknowledgement, against a raw async-nats loop publishing the same messages
//! (same subjects, headers and bodies) with acknowledgements awaited at the same concurrency,
//! and against a raw relay: that loop fed by the raw `SKIP LOCKED` drain, which claims 500,
//! publishes them and marks them published in one transaction (no order per aggregate, no
//! retries: the least a relay from the database does).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, message::PublishMessage};
use futures_util::StreamExt;
use outbox_core::{Delivery, Handle, HandlerError, Relay, RelayConfig, router, subscriber};
use outbox_nats::JetStreamPublisher;
use uuid::Uuid;

use super::{Deposited, mark_published, prefill, setup};

const EVENTS: u64 = 20_000;

#[subscriber(events = [Deposited], name = "jetstream")]
struct ToNats {
    publisher: JetStreamPublisher,
    done: Arc<AtomicU64>,
}

impl Handle<Deposited> for ToNats {
    async fn handle(&self, _: &Deposited, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.publisher.publish(delivery).await?;
        self.done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[router(events = [Deposited])]
struct Nats {
    to_nats: ToNats,
}

/// A stream of its own for one run, deleted after: (name, subject prefix).
async fn stream(jetstream: &jetstream::Context) -> (String, String) {
    let id = Uuid::new_v4().simple().to_string();
    let (name, prefix) = (format!("OUTBOX_BENCH_{id}"), format!("b{id}"));
    outbox_nats::ensure_stream(
        jetstream,
        outbox_nats::stream_config(name.clone(), [format!("{prefix}.>")]),
    )
    .await
    .unwrap();
    (name, prefix)
}

pub(crate) async fn relay_to_jetstream(runs: usize, config: &RelayConfig) {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let jetstream = jetstream::new(async_nats::connect(url).await.unwrap());
    let concurrency = config.concurrency();
    let (mut ours, mut raw, mut raw_relay) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        ours.push(ours_once(&jetstream, config.clone()).await);
        raw.push(raw_once(&jetstream, concurrency).await);
        raw_relay.push(raw_relay_once(&jetstream, concurrency).await);
    }
    super::report(
        &format!(
            "(i) relay to JetStream, {EVENTS} events / 1000 aggregates, concurrency {concurrency}"
        ),
        "events/s",
        &ours,
        &raw,
    );
    super::report(
        "(i) the same, against a raw relay",
        "events/s",
        &ours,
        &raw_relay,
    );
}

async fn ours_once(jetstream: &jetstream::Context, config: RelayConfig) -> f64 {
    let (name, prefix) = stream(jetstream).await;
    let (_db, outbox, _) = setup(1000).await;
    prefill(outbox.pool(), EVENTS).await;
    let done = Arc::new(AtomicU64::new(0));
    let router = Nats {
        to_nats: ToNats {
            publisher: JetStreamPublisher::new(jetstream.clone()).with_subject_prefix(&prefix),
            done: done.clone(),
        },
    };
    let relay = Relay::new(outbox.store(), router, config).unwrap();
    let start = Instant::now();
    let watched = done.clone();
    tokio::spawn(async move {
        relay
            .run(async {
                while watched.load(Ordering::Relaxed) < EVENTS {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
    })
    .await
    .unwrap();
    let rate = EVENTS as f64 / start.elapsed().as_secs_f64();
    let mut stream = jetstream.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, EVENTS);
    jetstream.delete_stream(&name).await.unwrap();
    rate
}

/// An outbox row as the raw loops read it: id, aggregate type and id, event type, payload.
type Row = (i64, String, Uuid, String, String);

/// The same messages as the relay publishes, built from the same rows beforehand, published
/// `concurrency` at a time, each waiting for its acknowledgement.
async fn raw_once(jetstream: &jetstream::Context, concurrency: usize) -> f64 {
    let (name, prefix) = stream(jetstream).await;
    let (_db, outbox, _) = setup(1000).await;
    prefill(outbox.pool(), EVENTS).await;
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, aggregate_type, aggregate_id, event_type, payload::text
         FROM events.outbox ORDER BY id",
    )
    .fetch_all(outbox.pool())
    .await
    .unwrap();
    let messages = messages(&prefix, rows);
    let start = Instant::now();
    publish_all(jetstream, messages, concurrency).await;
    let rate = EVENTS as f64 / start.elapsed().as_secs_f64();
    let mut stream = jetstream.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, EVENTS);
    jetstream.delete_stream(&name).await.unwrap();
    rate
}

/// The raw relay: claims 500 unpublished rows with `SKIP LOCKED`, publishes them
/// `concurrency` at a time (each waiting for its acknowledgement), marks them published and
/// commits, until none is left.
async fn raw_relay_once(jetstream: &jetstream::Context, concurrency: usize) -> f64 {
    let (name, prefix) = stream(jetstream).await;
    let (_db, outbox, _) = setup(1000).await;
    prefill(outbox.pool(), EVENTS).await;
    let pool = outbox.pool();
    let start = Instant::now();
    loop {
        let mut tx = pool.begin().await.unwrap();
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, aggregate_type, aggregate_id, event_type, payload::text
             FROM events.outbox
             WHERE published_at IS NULL ORDER BY id LIMIT 500 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        if rows.is_empty() {
            break;
        }
        let ids: Vec<i64> = rows.iter().map(|row| row.0).collect();
        publish_all(jetstream, messages(&prefix, rows), concurrency).await;
        mark_published(tx, &ids).await;
    }
    let rate = EVENTS as f64 / start.elapsed().as_secs_f64();
    let mut stream = jetstream.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, EVENTS);
    jetstream.delete_stream(&name).await.unwrap();
    rate
}

/// Publishes `messages`, `concurrency` at a time, each waiting for its acknowledgement.
async fn publish_all(
    jetstream: &jetstream::Context,
    messages: Vec<(String, PublishMessage)>,
    concurrency: usize,
) {
    futures_util::stream::iter(messages)
        .for_each_concurrent(concurrency, |(subject, message)| async move {
            let ack = jetstream.send_publish(subject, message).await.unwrap();
            ack.await.unwrap();
        })
        .await;
}

/// The messages the relay publishes for `rows`: subject, headers and body.
fn messages(prefix: &str, rows: Vec<Row>) -> Vec<(String, PublishMessage)> {
    rows.into_iter()
        .map(|(id, aggregate_type, aggregate_id, event_type, payload)| {
            let mut headers = HeaderMap::new();
            let id = id.to_string();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            headers.insert(outbox_nats::EVENT_ID, id.as_str());
            headers.insert(outbox_nats::EVENT_TYPE, event_type.as_str());
            headers.insert(outbox_nats::EVENT_VERSION, "1");
            headers.insert(outbox_nats::AGGREGATE_TYPE, aggregate_type.as_str());
            headers.insert(outbox_nats::AGGREGATE_ID, aggregate_id.to_string().as_str());
            let subject = format!("{prefix}.{aggregate_type}.{event_type}");
            let message = PublishMessage::build()
                .payload(payload.into_bytes().into())
                .headers(headers);
            (subject, message)
        })
        .collect()
}
