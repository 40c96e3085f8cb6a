//! The consuming side: messages that a [`JetStreamPublisher`](crate::JetStreamPublisher) put on
//! a stream, delivered to the subscribers of this service's own `#[router]`.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::{AckKind, Message};
use futures_util::StreamExt;
use outbox_core::{Delivery, Router, StoredEvent};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use crate::{AGGREGATE_ID, AGGREGATE_TYPE, EVENT_ID, EVENT_TYPE, OCCURRED_AT};

/// The settings of a durable consumer for [`JetStreamConsumer`]: named `durable`, taking the
/// subjects `filter` matches, from the start of the stream, each message acknowledged
/// explicitly within `ack_wait` (else delivered again), and **one message in flight at a time**
/// (`max_ack_pending` 1), so that the service sees each aggregate's events in the stream's order,
/// which is the producer's commit order per aggregate. (Messages of different aggregates wait
/// for each other too: per-subject consumption in parallel is not built yet.)
pub fn consumer_config(durable: &str, filter: &str, ack_wait: Duration) -> pull::Config {
    pull::Config {
        durable_name: Some(durable.to_owned()),
        filter_subject: filter.to_owned(),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        max_ack_pending: 1,
        ..pull::Config::default()
    }
}

/// Delivers the events of a JetStream consumer to a router's subscribers, with the same
/// `Handle<E>` impls and upcasting as a relay.
///
/// Each message is decoded into the event it carries (the stored envelope, and the id, types,
/// aggregate and time from its headers) and handed to every subscriber the router names for its
/// type, in order. When all of them succeed it is acknowledged, after the handlers' commits;
/// when one fails, it is delivered again after the retry delay, to every subscriber: delivery is
/// at least once, so make each handler's effects exactly once with
/// `outbox_sqlx::Outbox::handle_once` on the service's own database (its inbox records the event
/// id per subscriber, in the transaction of the effects) or idempotent. A message that is not an outbox event (a header missing or
/// unreadable) is terminated for this consumer and logged: it stays in the stream. An event
/// type this build does not know is delivered again after the park delay, for a newer build.
/// With one message in flight, a message that keeps failing holds back every later one until
/// it succeeds (there is no dead-letter table on the consuming side yet): the log says which.
pub struct JetStreamConsumer<R> {
    consumer: PullConsumer,
    router: R,
    retry_delay: Duration,
    park_delay: Duration,
}

impl<R: Router> JetStreamConsumer<R> {
    /// Consumes `consumer` (see [`consumer_config`]) into `router`; failures are delivered
    /// again after 1 s, unknown event types after 5 minutes.
    pub fn new(consumer: PullConsumer, router: R) -> Self {
        Self {
            consumer,
            router,
            retry_delay: Duration::from_secs(1),
            park_delay: Duration::from_secs(300),
        }
    }

    /// Delivers a failed message again after `delay`.
    #[must_use]
    pub fn with_retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The router.
    pub fn router(&self) -> &R {
        &self.router
    }

    /// Handles messages until `shutdown` resolves (the message in hand is finished first).
    /// Returns an error only when the consumer's message stream cannot be opened or ends.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<(), ConsumeError> {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut messages = self
            .consumer
            .messages()
            .await
            .map_err(|error| ConsumeError(format!("cannot consume: {error}")))?;
        loop {
            let message = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                message = messages.next() => message,
            };
            match message {
                None => return Err(ConsumeError("the consumer's messages ended".to_owned())),
                Some(Err(error)) => {
                    tracing::warn!(%error, "outbox consumer could not receive a message");
                }
                Some(Ok(message)) => self.handle(&message).await,
            }
        }
    }

    /// Delivers one message to its subscribers and acknowledges it, or asks for it again.
    pub async fn handle(&self, message: &Message) {
        let reply = match self.deliver(message).await {
            Outcome::Done => AckKind::Ack,
            Outcome::Retry => AckKind::Nak(Some(self.retry_delay)),
            Outcome::Park => AckKind::Nak(Some(self.park_delay)),
            Outcome::Malformed => AckKind::Term,
        };
        // After the handlers' commits: a crash before this line delivers the message again.
        let acked = if matches!(reply, AckKind::Ack) {
            message.double_ack().await
        } else {
            message.ack_with(reply).await
        };
        if let Err(error) = acked {
            tracing::warn!(%error, subject = %message.subject, "outbox consumer could not answer a message; it will come again");
        }
    }

    async fn deliver(&self, message: &Message) -> Outcome {
        let event = match stored_event(message) {
            Ok(event) => event,
            Err(reason) => {
                tracing::error!(subject = %message.subject, %reason, "outbox consumer got a message that is not an outbox event: terminated for this consumer (it stays in the stream)");
                return Outcome::Malformed;
            }
        };
        let Some(subscribers) = self.router.subscribers(&event.event_type) else {
            tracing::warn!(event_id = event.id, event_type = %event.event_type, "outbox consumer does not know this event type: delivered again after the park delay");
            return Outcome::Park;
        };
        let decoded = match self.router.decode(&event) {
            Ok(decoded) => decoded,
            Err(error) => {
                tracing::warn!(event_id = event.id, %error, "outbox consumer cannot decode an event: delivered again after the park delay");
                return Outcome::Park;
            }
        };
        // Read with the envelope by `decode`.
        let metadata = decoded.metadata().clone();
        let attempt = message
            .info()
            .ok()
            .and_then(|info| u32::try_from(info.delivered).ok())
            .unwrap_or(1);
        for subscriber in subscribers {
            let delivery = Delivery::new(&event, &metadata, subscriber, attempt);
            if let Err(error) = self.router.deliver(subscriber, &decoded, &delivery).await {
                tracing::warn!(event_id = event.id, subscriber, %error, attempt, "outbox consumer's subscriber failed: delivered again after the retry delay");
                return Outcome::Retry;
            }
        }
        Outcome::Done
    }
}

enum Outcome {
    Done,
    Retry,
    Park,
    Malformed,
}

/// The event a message carries, from its headers and body.
fn stored_event(message: &Message) -> Result<StoredEvent, String> {
    let headers = message
        .headers
        .as_ref()
        .ok_or_else(|| "it has no headers".to_owned())?;
    let header = |name: &str| {
        headers
            .get(name)
            .map(|value| value.as_str().to_owned())
            .ok_or_else(|| format!("it has no {name} header"))
    };
    let id = header(EVENT_ID)?
        .parse::<i64>()
        .map_err(|error| format!("its {EVENT_ID} is not an integer: {error}"))?;
    let aggregate_id = header(AGGREGATE_ID)?
        .parse::<Uuid>()
        .map_err(|error| format!("its {AGGREGATE_ID} is not a UUID: {error}"))?;
    let occurred_at = OffsetDateTime::parse(&header(OCCURRED_AT)?, &Rfc3339)
        .map_err(|error| format!("its {OCCURRED_AT} is not an RFC 3339 time: {error}"))?;
    let payload = String::from_utf8(message.payload.to_vec())
        .map_err(|error| format!("its body is not UTF-8: {error}"))?;
    Ok(StoredEvent {
        id,
        aggregate_type: header(AGGREGATE_TYPE)?,
        aggregate_id,
        event_type: header(EVENT_TYPE)?,
        payload,
        occurred_at,
    })
}

/// The consumer's message stream could not be opened, or it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumeError(String);

impl std::fmt::Display for ConsumeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "outbox consumer: {}", self.0)
    }
}

impl std::error::Error for ConsumeError {}
