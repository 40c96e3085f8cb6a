//! Relays outbox events to a NATS JetStream stream, so that other services learn what happened,
//! and consumes them there ([`JetStreamConsumer`]).
//!
//! [`JetStreamPublisher`] publishes the events a relay hands it: as an `#[observer]` of a router
//! (every event), or inside a subscriber of the events to share (see below). Each event becomes
//! one message:
//!
//! - subject `<prefix>.<aggregate type>.<event type>` (prefix `outbox` by default;
//!   [`with_subject_prefix`](JetStreamPublisher::with_subject_prefix) and
//!   [`with_subject`](JetStreamPublisher::with_subject) change it);
//! - body: the stored envelope `{"version":N,"data":{..},"metadata":{..}}`, byte for byte;
//! - headers: `Nats-Msg-Id` (the event id, after an optional
//!   [prefix](JetStreamPublisher::with_message_id_prefix)), so that JetStream drops a message it
//!   stored within its duplicate window when a relay publishes it again; and
//!   [`EVENT_ID`], [`EVENT_TYPE`], [`EVENT_VERSION`], [`AGGREGATE_TYPE`], [`AGGREGATE_ID`],
//!   [`OCCURRED_AT`], [`CORRELATION_ID`] and [`CAUSATION_ID`] (when set), and the trace context
//!   (`traceparent`, `tracestate`).
//!
//! A delivery is done when JetStream acknowledges the message (a duplicate acknowledged as such
//! included). Order per aggregate is the relay's: one key's deliveries run one at a time, each
//! waiting for its acknowledgement; different aggregates publish concurrently, up to the relay's
//! concurrency. A missing stream, a broker that is down or slow, a refused publish: transient
//! errors with a message that says which, retried under the relay's policy. A message larger than
//! the server accepts, or a subject the event's names cannot form, is permanent (a dead letter).
//!
//! ```no_run
//! use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, router, subscriber};
//! use outbox_nats::JetStreamPublisher;
//! use outbox_sqlx::Outbox;
//! use serde::{Deserialize, Serialize};
//! use sqlx::Postgres;
//! use uuid::Uuid;
//!
//! #[derive(Serialize, Deserialize, OutboxEvent)]
//! #[outbox(aggregate_type = "order")]
//! struct OrderPlaced {
//!     #[outbox(aggregate_id)]
//!     order_id: Uuid,
//! }
//!
//! /// Shares the events other services need.
//! #[subscriber(events = [OrderPlaced], name = "jetstream")]
//! struct Broker(JetStreamPublisher);
//!
//! impl<E: Sync> Handle<E> for Broker {
//!     async fn handle(&self, _: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
//!         self.0.publish(delivery).await
//!     }
//! }
//!
//! #[router(events = [OrderPlaced])]
//! struct App {
//!     broker: Broker,
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let jetstream = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
//! outbox_nats::ensure_stream(&jetstream, outbox_nats::stream_config("ORDERS", ["outbox.order.>"]))
//!     .await?;
//! let outbox: Outbox<Postgres, App> =
//!     Outbox::new(sqlx::PgPool::connect("postgres://127.0.0.1/orders").await?);
//! let relay = outbox.relay(App { broker: Broker(JetStreamPublisher::new(jetstream)) },
//!     RelayConfig::default())?;
//! relay.run(std::future::pending()).await;
//! # Ok(())
//! # }
//! ```

mod consumer;

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{CreateStreamError, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use outbox_core::{Delivery, HandlerError, Observer, RawEnvelope, StoredEvent};

pub use consumer::{ConsumeError, JetStreamConsumer, consumer_config};

/// Header: the stored event's id.
pub const EVENT_ID: &str = "Outbox-Event-Id";
/// Header: the event type.
pub const EVENT_TYPE: &str = "Outbox-Event-Type";
/// Header: the payload version.
pub const EVENT_VERSION: &str = "Outbox-Event-Version";
/// Header: the aggregate's type.
pub const AGGREGATE_TYPE: &str = "Outbox-Aggregate-Type";
/// Header: the aggregate's id.
pub const AGGREGATE_ID: &str = "Outbox-Aggregate-Id";
/// Header: when the event occurred (RFC 3339).
pub const OCCURRED_AT: &str = "Outbox-Occurred-At";
/// Header: the correlation id, when the event has one.
pub const CORRELATION_ID: &str = "Outbox-Correlation-Id";
/// Header: the causation id, when the event has one.
pub const CAUSATION_ID: &str = "Outbox-Causation-Id";

type SubjectFn = dyn Fn(&StoredEvent) -> String + Send + Sync;

/// Publishes events to JetStream, one message per event; see the [crate documentation](crate).
#[derive(Clone)]
pub struct JetStreamPublisher {
    jetstream: jetstream::Context,
    subject: Arc<SubjectFn>,
    message_id_prefix: String,
}

impl std::fmt::Debug for JetStreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamPublisher")
            .field("message_id_prefix", &self.message_id_prefix)
            .finish_non_exhaustive()
    }
}

impl JetStreamPublisher {
    /// Publishes through `jetstream` on `outbox.<aggregate type>.<event type>`.
    pub fn new(jetstream: jetstream::Context) -> Self {
        Self {
            jetstream,
            subject: subject_with_prefix("outbox".to_owned()),
            message_id_prefix: String::new(),
        }
    }

    /// Publishes on `<prefix>.<aggregate type>.<event type>`.
    #[must_use]
    pub fn with_subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject = subject_with_prefix(prefix.into());
        self
    }

    /// Publishes each event on the subject `subject` gives for it.
    #[must_use]
    pub fn with_subject(
        mut self,
        subject: impl Fn(&StoredEvent) -> String + Send + Sync + 'static,
    ) -> Self {
        self.subject = Arc::new(subject);
        self
    }

    /// Puts `prefix` before the event id in `Nats-Msg-Id`: set one per outbox (per service and
    /// database) when several publish into one stream, whose ids would otherwise collide.
    #[must_use]
    pub fn with_message_id_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.message_id_prefix = prefix.into();
        self
    }

    /// The subject of `event`.
    pub fn subject(&self, event: &StoredEvent) -> String {
        (self.subject)(event)
    }

    /// Publishes the event of `delivery` and waits for JetStream's acknowledgement.
    pub async fn publish(&self, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        let event = delivery.event();
        let subject = self.subject(event);
        if let Some(reason) = invalid_subject(&subject) {
            return Err(HandlerError::permanent(format!(
                "event {} ({}) cannot be published on the NATS subject {subject:?}: {reason}; \
                 choose another with JetStreamPublisher::with_subject",
                event.id, event.event_type
            )));
        }
        let headers = self.headers(event)?;
        let message = PublishMessage::build()
            .payload(event.payload.clone().into_bytes().into())
            .headers(headers);
        let ack = self
            .jetstream
            .send_publish(subject.clone(), message)
            .await
            .map_err(|error| publish_error(&subject, &error))?;
        ack.await.map_err(|error| publish_error(&subject, &error))?;
        Ok(())
    }

    fn headers(&self, event: &StoredEvent) -> Result<HeaderMap, HandlerError> {
        // The relay decoded this envelope already; a payload that is not one never gets here.
        let envelope = RawEnvelope::parse(event.payload.as_bytes())
            .map_err(|error| HandlerError::permanent(error.to_string()))?;
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("{}{}", self.message_id_prefix, event.id).as_str(),
        );
        headers.insert(EVENT_ID, event.id.to_string().as_str());
        headers.insert(EVENT_TYPE, event.event_type.as_str());
        headers.insert(EVENT_VERSION, envelope.version().to_string().as_str());
        headers.insert(AGGREGATE_TYPE, event.aggregate_type.as_str());
        headers.insert(AGGREGATE_ID, event.aggregate_id.to_string().as_str());
        if let Ok(time) = event
            .occurred_at
            .format(&time::format_description::well_known::Rfc3339)
        {
            headers.insert(OCCURRED_AT, time.as_str());
        }
        let metadata = envelope.metadata();
        if let Some(id) = metadata.correlation_id() {
            headers.insert(CORRELATION_ID, id.to_string().as_str());
        }
        if let Some(id) = metadata.causation_id() {
            headers.insert(CAUSATION_ID, id.to_string().as_str());
        }
        for (key, value) in metadata.trace_context().iter() {
            if matches!(key, "traceparent" | "tracestate") {
                headers.insert(key, value);
            }
        }
        Ok(headers)
    }
}

/// Publishes every event of the router it is an `#[observer]` of.
impl Observer for JetStreamPublisher {
    const NAME: &'static str = "jetstream";

    async fn observe(&self, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.publish(delivery).await
    }
}

fn subject_with_prefix(prefix: String) -> Arc<SubjectFn> {
    Arc::new(move |event: &StoredEvent| {
        format!("{prefix}.{}.{}", event.aggregate_type, event.event_type)
    })
}

/// Why `subject` cannot be published on, if it cannot.
fn invalid_subject(subject: &str) -> Option<&'static str> {
    if subject.is_empty() {
        Some("it is empty")
    } else if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("it holds whitespace or a control character")
    } else if subject.split('.').any(str::is_empty) {
        Some("it has an empty token")
    } else if subject.split('.').any(|token| token == "*" || token == ">") {
        Some("it has a wildcard token (`*` or `>`), which only subscriptions may use")
    } else {
        None
    }
}

fn publish_error(subject: &str, error: &PublishError) -> HandlerError {
    let message = match error.kind() {
        PublishErrorKind::StreamNotFound => format!(
            "no JetStream stream takes the subject {subject:?}: create one (see \
             outbox_nats::ensure_stream) or change the subject ({error})"
        ),
        PublishErrorKind::TimedOut => {
            format!("JetStream did not acknowledge {subject:?} in time ({error})")
        }
        PublishErrorKind::BrokenPipe => {
            format!("the connection to NATS is down, publishing {subject:?} ({error})")
        }
        PublishErrorKind::MaxPayloadExceeded => {
            return HandlerError::permanent(format!(
                "the message for {subject:?} is larger than the NATS server accepts ({error})"
            ));
        }
        _ => format!("JetStream refused {subject:?} ({error})"),
    };
    HandlerError::transient(message)
}

/// How long a stream made by [`stream_config`] drops a message id it stored already: longer
/// than a relay takes to deliver again after a crash (a lease, then its retries).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(10 * 60);

/// How long a stream made by [`stream_config`] keeps messages.
pub const MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// The settings of a stream for outbox events: `name`, taking `subjects`, on file storage,
/// messages kept [`MAX_AGE`], duplicates dropped within [`DUPLICATE_WINDOW`]. Change any field
/// before [`ensure_stream`].
pub fn stream_config<S: Into<String>>(
    name: impl Into<String>,
    subjects: impl IntoIterator<Item = S>,
) -> stream::Config {
    stream::Config {
        name: name.into(),
        subjects: subjects.into_iter().map(Into::into).collect(),
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        max_age: MAX_AGE,
        duplicate_window: DUPLICATE_WINDOW,
        ..stream::Config::default()
    }
}

/// Creates the stream `config` describes, or finds it if it exists.
pub async fn ensure_stream(
    jetstream: &jetstream::Context,
    config: stream::Config,
) -> Result<stream::Stream, CreateStreamError> {
    jetstream.get_or_create_stream(config).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_a_server_would_refuse_are_named() {
        assert_eq!(invalid_subject("outbox.order.OrderPlaced"), None);
        assert_eq!(invalid_subject(""), Some("it is empty"));
        assert!(invalid_subject("outbox.order.Order Placed").is_some());
        assert!(invalid_subject("outbox..OrderPlaced").is_some());
        assert!(invalid_subject("outbox.*.OrderPlaced").is_some());
        assert!(invalid_subject("outbox.order.>").is_some());
    }
}
