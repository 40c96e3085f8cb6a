//! Spans (feature `opentelemetry`): a delivery span carries the event's ids and links to the span
//! the event was published in, through the trace context stored with the event.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outbox_core::testing::{MemoryStore, RecordingPublisher, drain};
use outbox_core::{
    Delivery, Handle, HandlerError, Metadata, OutboxEvent, Publish, Relay, RelayConfig, router,
    subscriber,
};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use tracing_subscriber::layer::SubscriberExt as _;
use uuid::Uuid;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order: Uuid,
}

/// Keeps the metadata each delivery carried.
#[subscriber(events = [OrderPlaced], name = "shipping")]
struct Shipping(Arc<Mutex<Vec<Metadata>>>);

impl Handle<OrderPlaced> for Shipping {
    async fn handle(&self, _: &OrderPlaced, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push(delivery.metadata().clone());
        Ok(())
    }
}

#[router(events = [OrderPlaced])]
struct Shop {
    shipping: Shipping,
}

fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

#[tokio::test(flavor = "current_thread")]
async fn a_delivery_span_carries_the_ids_and_links_to_the_publishing_span() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _default = tracing::subscriber::set_default(subscriber);

    let (order, correlation, causation) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let store = MemoryStore::new();
    {
        let request = tracing::info_span!("place order");
        let _entered = request.enter();
        let mut publisher = RecordingPublisher::new();
        publisher.set_metadata(
            Metadata::new()
                .with_correlation_id(correlation)
                .with_causation_id(causation),
        );
        publisher.publish(&OrderPlaced { order }).await.unwrap();
        store.commit(publisher);
    }
    let seen = Arc::default();
    let relay = Relay::new(
        store,
        Shop {
            shipping: Shipping(Arc::clone(&seen)),
        },
        RelayConfig::default(),
    )
    .unwrap();
    let report = drain(&relay).await.unwrap();
    assert_eq!(report.delivered, 1);
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
    let request = spans
        .iter()
        .find(|s| s.name == "place order")
        .unwrap_or_else(|| panic!("no publishing span in {names:?}"));
    let delivery = spans
        .iter()
        .find(|s| s.name == "outbox.deliver")
        .unwrap_or_else(|| panic!("no delivery span in {names:?}"));
    let batch = spans
        .iter()
        .find(|s| s.name == "outbox.batch")
        .unwrap_or_else(|| panic!("no batch span in {names:?}"));

    // The stored trace context is the publishing span's, and the delivery links to it.
    let stored = seen.lock().unwrap()[0].trace_context().clone();
    let traceparent = stored.get("traceparent").expect("a traceparent was stored");
    assert!(
        traceparent.contains(&request.span_context.trace_id().to_string())
            && traceparent.contains(&request.span_context.span_id().to_string()),
        "{traceparent} is not the publishing span's context"
    );
    let linked: Vec<_> = delivery
        .links
        .iter()
        .map(|link| (link.span_context.trace_id(), link.span_context.span_id()))
        .collect();
    assert_eq!(
        linked,
        [(
            request.span_context.trace_id(),
            request.span_context.span_id()
        )]
    );
    // The delivery runs inside its batch.
    assert_eq!(delivery.parent_span_id, batch.span_context.span_id());

    let attributes = &delivery.attributes;
    let string = |key| attribute(attributes, key).map(Value::as_str);
    assert_eq!(string("event_type").as_deref(), Some("OrderPlaced"));
    assert_eq!(string("subscriber").as_deref(), Some("shipping"));
    assert_eq!(
        string("aggregate_id").as_deref(),
        Some(order.to_string().as_str())
    );
    assert_eq!(
        string("correlation_id").as_deref(),
        Some(correlation.to_string().as_str())
    );
    assert_eq!(
        string("causation_id").as_deref(),
        Some(causation.to_string().as_str())
    );
    // Numbers arrive as the layer records them; compare their text.
    assert_eq!(string("event_id").as_deref(), Some("1"));
    assert_eq!(string("attempt").as_deref(), Some("1"));
    assert_eq!(string("traceparent").as_deref(), Some(traceparent));
}
