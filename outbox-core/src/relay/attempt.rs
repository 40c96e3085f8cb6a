//! One handler call: its span, timeout, panic and metrics, and what a failure becomes. Also
//! decoding, which runs user code (`Deserialize` impls, upcasters) and is guarded the same way.

use futures_util::FutureExt;
use std::any::Any;
use std::panic::AssertUnwindSafe;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::{Empty, display};

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{Relay, RelayConfig};
use crate::error::DecodeError;
use crate::routing::{Decoded, Delivery, HandlerError, Router};
use crate::store::{ClaimToken, DeliveryOutcome, Store, StoredEvent};
use crate::telemetry::{self, status};

/// Errors stored with a delivery are cut to this many bytes.
pub(super) const MAX_ERROR_LEN: usize = 4096;

/// The claim a handler runs under, as its [`Delivery`] shows it.
#[derive(Clone, Copy)]
pub(super) struct Under {
    pub(super) token: ClaimToken,
    pub(super) expired_claims: u32,
}

impl<S: Store, R: Router> Relay<S, R> {
    /// Decodes `event` with the router, turning a panic in user code (a `Deserialize` impl, an
    /// upcaster) into a [`DecodeError::Panicked`].
    pub(super) fn decode(&self, event: &StoredEvent) -> Result<Decoded, DecodeError> {
        std::panic::catch_unwind(AssertUnwindSafe(|| self.router.decode(event))).unwrap_or_else(
            |panic| {
                Err(DecodeError::Panicked {
                    event_type: event.event_type.clone(),
                    message: panic_message(&*panic),
                })
            },
        )
    }

    /// What the tasks of a batch's queues call handlers with.
    pub(super) fn caller(&self) -> Caller<R> {
        Caller {
            router: Arc::clone(&self.router),
            config: Arc::clone(&self.config),
            dispatched: Mutex::default(),
        }
    }
}

/// The router and the settings a handler call needs, shared with the tasks that run a batch's
/// queues (its runners, tasks of their own: the runtime's workers run handlers in parallel, and
/// a queue's next call, or the next queue's first, starts when its last one ends, whatever the
/// relay's own task is doing).
pub(super) struct Caller<R> {
    router: Arc<R>,
    pub(super) config: Arc<RelayConfig>,
    /// The calls made and not counted yet: event type, status, duration. The batch's own task
    /// counts them ([`count_dispatched`](Self::count_dispatched)), where the relay runs, so
    /// that a recorder set for that thread alone (`metrics::set_default_local_recorder`, as
    /// tests set one) sees them as it saw them when every call ran on that task.
    dispatched: Mutex<Vec<(String, &'static str, Duration)>>,
}

impl<R> Caller<R> {
    /// Counts the calls made since the last count.
    pub(super) fn count_dispatched(&self) {
        let dispatched = std::mem::take(
            &mut *self
                .dispatched
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (event_type, status, took) in dispatched {
            telemetry::dispatch_duration(&event_type, took);
            telemetry::dispatched(&event_type, status);
        }
    }

    fn dispatched(&self, event_type: &str, status: &'static str, took: Duration) {
        self.dispatched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((event_type.to_owned(), status, took));
    }
}

impl<R: Router> Caller<R> {
    /// Calls one handler in a delivery span, turning a timeout or a panic into a transient
    /// error, and counts the outcome; a failure comes back as what to record.
    pub(super) async fn attempt(
        &self,
        subscriber: &str,
        event: &StoredEvent,
        decoded: &Decoded,
        attempt: u32,
        under: Under,
    ) -> Result<(), DeliveryOutcome> {
        let metadata = decoded.metadata();
        let span = tracing::info_span!(
            "outbox.deliver",
            event_id = event.id,
            event_type = %event.event_type,
            aggregate_type = %event.aggregate_type,
            aggregate_id = %event.aggregate_id,
            subscriber,
            attempt,
            claim = under.token.get(),
            correlation_id = Empty,
            causation_id = Empty,
            traceparent = Empty,
        );
        if let Some(id) = metadata.correlation_id() {
            span.record("correlation_id", display(id));
        }
        if let Some(id) = metadata.causation_id() {
            span.record("causation_id", display(id));
        }
        if let Some(traceparent) = metadata.trace_context().get("traceparent") {
            span.record("traceparent", traceparent);
        }
        #[cfg(feature = "opentelemetry")]
        telemetry::link(&span, metadata.trace_context());
        let started = Instant::now();
        let result = self
            .call(subscriber, event, decoded, attempt, under)
            .instrument(span.clone())
            .await;
        let took = started.elapsed();
        let Err(error) = result else {
            self.dispatched(&event.event_type, status::DELIVERED, took);
            return Ok(());
        };
        let outcome = self.after_failure(&error, attempt);
        let _entered = span.enter();
        if let DeliveryOutcome::Retry { retry_in, .. } = &outcome {
            self.dispatched(&event.event_type, status::RETRY, took);
            tracing::warn!(%error, ?retry_in, "outbox handler failed; it will be retried");
        } else {
            self.dispatched(&event.event_type, status::DEAD, took);
            tracing::error!(%error, "outbox handler failed for good: a dead letter");
        }
        Err(outcome)
    }

    /// Calls one handler, turning a timeout or a panic into a transient error.
    async fn call(
        &self,
        subscriber: &str,
        event: &StoredEvent,
        decoded: &Decoded,
        attempt: u32,
        under: Under,
    ) -> Result<(), HandlerError> {
        let delivery = Delivery::new(event, decoded.metadata(), subscriber, attempt)
            .with_claim(under.token, under.expired_claims);
        let call = AssertUnwindSafe(self.router.deliver(subscriber, decoded, &delivery));
        match tokio::time::timeout(self.config.handler_timeout, call.catch_unwind()).await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(HandlerError::transient(format!(
                "handler panicked: {}",
                panic_message(&*panic)
            ))),
            Err(_) => Err(HandlerError::transient(format!(
                "handler timed out after {:?}",
                self.config.handler_timeout
            ))),
        }
    }

    fn after_failure(&self, error: &HandlerError, attempts: u32) -> DeliveryOutcome {
        let message = stored_text(error.to_string());
        match error
            .is_transient()
            .then(|| self.config.retry.delay_after(attempts))
            .flatten()
        {
            Some(retry_in) => DeliveryOutcome::Retry {
                attempts,
                error: message,
                retry_in,
            },
            None => DeliveryOutcome::Dead {
                attempts,
                error: message,
            },
        }
    }
}

/// The message of a caught panic.
pub(super) fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_owned())
}

/// A message as it is stored with an event or a delivery: at most [`MAX_ERROR_LEN`] bytes, cut
/// on a character boundary, and without NUL characters, which SQL text columns refuse (a NUL
/// in a handler's error must not make its batch unrecordable).
pub(super) fn stored_text(message: String) -> String {
    let mut message = if message.contains('\0') {
        message.replace('\0', "\u{FFFD}")
    } else {
        message
    };
    if message.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_errors_are_cut_on_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = stored_text(long);
        assert!(cut.len() <= MAX_ERROR_LEN + '…'.len_utf8());
        assert!(cut.ends_with('…'));
        assert_eq!(stored_text("short".to_owned()), "short");
    }

    #[test]
    fn nul_characters_are_replaced_so_that_sql_text_columns_take_the_message() {
        assert_eq!(stored_text("a\0b".to_owned()), "a\u{FFFD}b");
    }
}
