//! What a relay reports about itself: metrics through the [`metrics`] facade, and
//! `tracing` spans.
//!
//! # Metrics
//!
//! Install any `metrics` recorder (a Prometheus exporter, StatsD, ...) before starting a relay;
//! without one, recording costs next to nothing. A relay reports:
//!
//! | Name | Kind | Labels | Meaning |
//! |------|------|--------|---------|
//! | `outbox_events_dispatched_total` | counter | `event_type`, `status` | outcomes of deliveries: `status` is `delivered`, `retry` (a transient failure, attempted again later), `dead` (a dead letter) or `parked` (this build cannot read the event yet) |
//! | `outbox_events_dispatch_duration_seconds` | histogram | `event_type` | how long one handler call took, failed ones included |
//! | `outbox_events_pending_count` | gauge | | events not yet handed to all their subscribers, dead ones excluded |
//! | `outbox_deliveries_pending_count` | gauge | | subscribers' deliveries waiting for a retry or behind an earlier event |
//! | `outbox_events_dead_letter_count` | gauge | | dead events and dead deliveries, waiting for an operator |
//! | `outbox_events_oldest_pending_age_seconds` | gauge | | how long ago the oldest pending event occurred (0 when none) |
//! | `outbox_blocked_keys_count` | gauge | | (subscriber, aggregate) pairs whose later events wait behind an undelivered one |
//! | `outbox_blocked_aggregates_count` | gauge | | aggregates held back for every subscriber, behind a dead or parked event or a claim that lasted |
//! | `outbox_held_events_count` | gauge | | events set aside behind an earlier event of their aggregate |
//! | `outbox_relays_live_count` | gauge | | relays at work on the store (registered, of any build) |
//! | `outbox_events_unroutable_count` | gauge | | pending events of a type no live relay routes |
//! | `outbox_deliveries_unroutable_count` | gauge | | pending deliveries to a subscriber no live relay has |
//! | `outbox_claims_lost_total` | counter | | batches whose claim expired before the relay recorded them (a relay that stalled past its lease): their outcomes were dropped and the work is delivered again |
//! | `outbox_store_errors_total` | counter | `operation` | calls of the store that failed, each try counted: `operation` is `claim`, `record` (of a batch or part of one), `renew` (a batch's claim), `register` (the relay's registration: made, renewed or ended), `status` or `purge`. A relay retries them (a broken connection at once, an unreachable store with backoff) and logs them; a rate that stays above zero means its work waits |
//!
//! Counters and the histogram are recorded as deliveries happen. Gauges come from the store
//! ([`Store::status`](crate::Store::status)), read by each running relay every
//! [status interval](crate::RelayConfig::with_status_interval) and by
//! [`Relay::report_status`](crate::Relay::report_status).
//!
//! # Spans
//!
//! - `outbox.batch` around each batch, with `claimed`, and when it ends `delivered`, `retried`,
//!   `dead` and `parked`.
//! - `outbox.deliver` around each handler call, inside its batch's span, with `event_id`,
//!   `event_type`, `aggregate_id`, `subscriber`, `attempt`, and when the event carries them
//!   `correlation_id`, `causation_id` and `traceparent` (the W3C trace context stored with the
//!   event).
//!
//! A failed call logs a warning, a dead letter an error, each inside its delivery's span.
//!
//! # Trace context (feature `opentelemetry`)
//!
//! With the feature on, publishing stores the current span's OpenTelemetry context (through the
//! global propagator, W3C `traceparent` with `TraceContextPropagator`) in the event's metadata,
//! unless the metadata already carries one; each `outbox.deliver` span then links to it, so a
//! trace viewer leads from a delivery back to the request that published the event. The
//! application installs the `tracing-opentelemetry` layer and the propagator, as usual.

use std::time::Duration;

use ::metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::store::Status;

/// Outcomes of deliveries, labelled `event_type` and `status`.
pub const DISPATCHED_TOTAL: &str = "outbox_events_dispatched_total";
/// Duration of handler calls in seconds, labelled `event_type`.
pub const DISPATCH_DURATION_SECONDS: &str = "outbox_events_dispatch_duration_seconds";
/// Events not yet handed to all their subscribers.
pub const PENDING_COUNT: &str = "outbox_events_pending_count";
/// Subscribers' deliveries waiting for a retry or behind an earlier event.
pub const PENDING_DELIVERIES_COUNT: &str = "outbox_deliveries_pending_count";
/// Dead events and dead deliveries.
pub const DEAD_LETTER_COUNT: &str = "outbox_events_dead_letter_count";
/// Age of the oldest pending event in seconds.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "outbox_events_oldest_pending_age_seconds";
/// (subscriber, aggregate) pairs held back by an undelivered event.
pub const BLOCKED_KEYS_COUNT: &str = "outbox_blocked_keys_count";
/// Aggregates held back for every subscriber.
pub const BLOCKED_AGGREGATES_COUNT: &str = "outbox_blocked_aggregates_count";
/// Events set aside behind an earlier event of their aggregate.
pub const HELD_EVENTS_COUNT: &str = "outbox_held_events_count";
/// Gauge: relays at work on the store, of any build.
pub const LIVE_RELAYS_COUNT: &str = "outbox_relays_live_count";
/// Gauge: pending events of a type no live relay routes.
pub const UNROUTABLE_EVENTS_COUNT: &str = "outbox_events_unroutable_count";
/// Gauge: pending deliveries to a subscriber no live relay has.
pub const UNROUTABLE_DELIVERIES_COUNT: &str = "outbox_deliveries_unroutable_count";
/// Counter: batches whose claim expired before they were recorded.
pub const CLAIMS_LOST_TOTAL: &str = "outbox_claims_lost_total";
/// Failed calls of the store, labelled `operation` (one of [`store_operation`]'s).
pub const STORE_ERRORS_TOTAL: &str = "outbox_store_errors_total";

/// `status` label values of [`DISPATCHED_TOTAL`].
pub mod status {
    /// The handler succeeded.
    pub const DELIVERED: &str = "delivered";
    /// The handler failed transiently; the delivery is attempted again later.
    pub const RETRY: &str = "retry";
    /// A dead letter: a permanent failure, the last retry, or a payload that never decodes.
    pub const DEAD: &str = "dead";
    /// This build cannot read the event yet (a newer version, an unknown event type).
    pub const PARKED: &str = "parked";
}

/// Values of the `operation` label of [`STORE_ERRORS_TOTAL`].
pub mod store_operation {
    /// A claim of a batch (the registration a claim renews first counts as [`REGISTER`]).
    pub const CLAIM: &str = "claim";
    /// A record of a batch's outcomes, or of a part of them.
    pub const RECORD: &str = "record";
    /// A renewal of a batch's claim while its handlers run.
    pub const RENEW: &str = "renew";
    /// The relay's registration: made, renewed, or ended.
    pub const REGISTER: &str = "register";
    /// A read of the store's status.
    pub const STATUS: &str = "status";
    /// A purge of old published events (retention).
    pub const PURGE: &str = "purge";
}

/// Describes the metrics to the installed recorder (units and help texts).
pub(crate) fn describe() {
    describe_counter!(
        DISPATCHED_TOTAL,
        Unit::Count,
        "Outcomes of outbox deliveries"
    );
    describe_histogram!(
        DISPATCH_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of one outbox handler call"
    );
    describe_gauge!(
        PENDING_COUNT,
        Unit::Count,
        "Outbox events not yet handed to all their subscribers"
    );
    describe_gauge!(
        PENDING_DELIVERIES_COUNT,
        Unit::Count,
        "Outbox deliveries waiting for a retry or behind an earlier event"
    );
    describe_gauge!(
        DEAD_LETTER_COUNT,
        Unit::Count,
        "Outbox dead letters waiting for an operator"
    );
    describe_gauge!(
        OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest pending outbox event"
    );
    describe_gauge!(
        BLOCKED_KEYS_COUNT,
        Unit::Count,
        "(subscriber, aggregate) pairs held back by an undelivered outbox event"
    );
    describe_gauge!(
        BLOCKED_AGGREGATES_COUNT,
        Unit::Count,
        "Aggregates held back for every subscriber by a dead or parked outbox event or a lasting claim"
    );
    describe_gauge!(
        HELD_EVENTS_COUNT,
        Unit::Count,
        "Outbox events set aside behind an earlier event of their aggregate"
    );
    describe_gauge!(
        LIVE_RELAYS_COUNT,
        Unit::Count,
        "Relays at work on the outbox, of any build"
    );
    describe_gauge!(
        UNROUTABLE_EVENTS_COUNT,
        Unit::Count,
        "Pending outbox events of a type no live relay routes"
    );
    describe_gauge!(
        UNROUTABLE_DELIVERIES_COUNT,
        Unit::Count,
        "Pending outbox deliveries to a subscriber no live relay has"
    );
    describe_counter!(
        STORE_ERRORS_TOTAL,
        Unit::Count,
        "Failed calls of the outbox's store, by operation; the relay retries them"
    );
    describe_counter!(
        CLAIMS_LOST_TOTAL,
        Unit::Count,
        "Outbox batches whose claim expired before they were recorded; their outcomes were dropped"
    );
}

pub(crate) fn store_error(operation: &'static str) {
    counter!(STORE_ERRORS_TOTAL, "operation" => operation).increment(1);
}

pub(crate) fn claim_lost() {
    counter!(CLAIMS_LOST_TOTAL).increment(1);
}

pub(crate) fn dispatched(event_type: &str, status: &'static str) {
    counter!(DISPATCHED_TOTAL, "event_type" => event_type.to_owned(), "status" => status)
        .increment(1);
}

pub(crate) fn dispatch_duration(event_type: &str, took: Duration) {
    histogram!(DISPATCH_DURATION_SECONDS, "event_type" => event_type.to_owned())
        .record(took.as_secs_f64());
}

pub(crate) fn report(status: &Status) {
    gauge!(PENDING_COUNT).set(status.pending_events as f64);
    gauge!(PENDING_DELIVERIES_COUNT).set(status.pending_deliveries as f64);
    gauge!(DEAD_LETTER_COUNT).set(status.dead_letters as f64);
    gauge!(OLDEST_PENDING_AGE_SECONDS).set(
        status
            .oldest_pending_age
            .map_or(0.0, |age| age.as_secs_f64()),
    );
    gauge!(BLOCKED_KEYS_COUNT).set(status.blocked_keys as f64);
    gauge!(BLOCKED_AGGREGATES_COUNT).set(status.blocked_aggregates as f64);
    gauge!(HELD_EVENTS_COUNT).set(status.held_events as f64);
    gauge!(LIVE_RELAYS_COUNT).set(status.live_relays as f64);
    gauge!(UNROUTABLE_EVENTS_COUNT).set(status.unroutable_events as f64);
    gauge!(UNROUTABLE_DELIVERIES_COUNT).set(status.unroutable_deliveries as f64);
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::propagation::{Extractor, Injector};
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use crate::envelope::{Metadata, TraceContext};

    impl Injector for TraceContext {
        fn set(&mut self, key: &str, value: String) {
            self.insert(key, value);
        }
    }

    impl Extractor for TraceContext {
        fn get(&self, key: &str) -> Option<&str> {
            TraceContext::get(self, key)
        }

        fn keys(&self) -> Vec<&str> {
            self.iter().map(|(key, _)| key).collect()
        }
    }

    impl Metadata {
        /// This metadata with the current span's trace context, unless it carries one already.
        /// Publishing calls it; feature `opentelemetry`.
        #[must_use]
        pub fn with_current_trace_context(self) -> Self {
            if !self.trace_context().is_empty() {
                return self;
            }
            let mut carrier = TraceContext::new();
            let context = tracing::Span::current().context();
            opentelemetry::global::get_text_map_propagator(|propagator| {
                propagator.inject_context(&context, &mut carrier);
            });
            self.with_trace_context(carrier)
        }
    }

    /// Links `span` to the span the event was published in, if the event carries its context.
    pub(crate) fn link(span: &tracing::Span, trace_context: &TraceContext) {
        if trace_context.is_empty() {
            return;
        }
        let context = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(trace_context)
        });
        let published_in = context.span().span_context().clone();
        if published_in.is_valid() {
            span.add_link(published_in);
        }
    }
}

#[cfg(feature = "opentelemetry")]
pub(crate) use otel::link;
