//! The catalog: what an application publishes and who takes it, as a value.
//!
//! A `#[router]` knows its events (types, versions, aggregate types, earlier names), its
//! subscribers and its routes at compile time; [`Router::catalog`](crate::Router::catalog) hands
//! them out as a [`Catalog`], which renders as JSON ([`Catalog::to_json`]) or as an AsyncAPI 3
//! document ([`Catalog::to_asyncapi`]) with a JSON Schema per event, so that other teams can read
//! what a service emits. The schemas come from [`schemars`]: an event that derives
//! `schemars::JsonSchema` beside `OutboxEvent` has one.
//!
//! A user's own binary prints it, since only it knows its router:
//!
//! ```
//! use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, Router, router, subscriber};
//! use schemars::JsonSchema;
//! use serde::{Deserialize, Serialize};
//! use uuid::Uuid;
//!
//! #[derive(Serialize, Deserialize, JsonSchema, OutboxEvent)]
//! #[outbox(aggregate_type = "bot", formerly = ["BotAdded"])]
//! struct BotInstalled {
//!     #[outbox(aggregate_id)]
//!     bot_id: Uuid,
//! }
//!
//! #[subscriber(events = [BotInstalled])]
//! struct Licensing;
//! impl Handle<BotInstalled> for Licensing {
//!     async fn handle(&self, _: &BotInstalled, _: &Delivery<'_>) -> Result<(), HandlerError> {
//!         Ok(())
//!     }
//! }
//!
//! #[router(events = [BotInstalled])]
//! struct App {
//!     licensing: Licensing,
//! }
//!
//! let catalog = App::catalog();
//! let json = catalog.to_json();
//! assert_eq!(json["events"][0]["event_type"], "BotInstalled");
//! assert_eq!(json["events"][0]["formerly"][0], "BotAdded");
//! assert_eq!(json["events"][0]["subscribers"][0], "licensing");
//! assert_eq!(json["events"][0]["schema"]["properties"]["bot_id"]["format"], "uuid");
//! // What `cargo run --bin my-service -- catalog --format asyncapi` would print:
//! let asyncapi = catalog.to_asyncapi("bots", "1.0.0");
//! assert_eq!(asyncapi["asyncapi"], "3.0.0");
//! ```

use schemars::generate::SchemaSettings;
use schemars::{Schema, SchemaGenerator};
use serde_json::{Map, Value, json};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::DecodeError;
use crate::routing::Decoded;
use crate::store::StoredEvent;

/// Writes the JSON Schema of an event's `data` with a generator: `root_schema_for::<E>`.
pub type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

/// Decodes a stored event as the catalog event's type.
type DecodeFn = fn(&StoredEvent) -> Result<Decoded, DecodeError>;

/// A router's catalog: its events and its subscribers. See the [module](self).
#[derive(Clone)]
pub struct Catalog {
    router: &'static str,
    events: Vec<CatalogEvent>,
    subscribers: Vec<CatalogSubscriber>,
}

/// One event type of a catalog.
#[derive(Clone)]
#[non_exhaustive]
pub struct CatalogEvent {
    /// The event type, as stored with each event.
    pub event_type: &'static str,
    /// The names it was stored under before (`#[outbox(formerly = [...])]`).
    pub formerly: &'static [&'static str],
    /// Its aggregate type.
    pub aggregate_type: &'static str,
    /// The payload version this build writes.
    pub version: u32,
    /// The oldest payload version this build reads (through its upcasters).
    pub oldest_readable_version: u32,
    /// The members it is delivered to, in delivery order: the subscribers that take it, and the
    /// observers.
    pub subscribers: Vec<&'static str>,
    schema: Option<SchemaFn>,
    decode: DecodeFn,
}

/// One member of a catalog's router: a subscriber or an observer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CatalogSubscriber {
    /// The name its deliveries are stored under.
    pub name: &'static str,
    /// The names they were stored under before (`#[subscriber(formerly = [...])]`).
    pub formerly: &'static [&'static str],
    /// The event types it takes; `None` for an observer, which takes every event.
    pub events: Option<&'static [&'static str]>,
}

impl std::fmt::Debug for CatalogEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatalogEvent")
            .field("event_type", &self.event_type)
            .field("formerly", &self.formerly)
            .field("aggregate_type", &self.aggregate_type)
            .field("version", &self.version)
            .field("oldest_readable_version", &self.oldest_readable_version)
            .field("subscribers", &self.subscribers)
            .field("has_schema", &self.schema.is_some())
            .finish()
    }
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog")
            .field("router", &self.router)
            .field("events", &self.events)
            .field("subscribers", &self.subscribers)
            .finish()
    }
}

impl CatalogEvent {
    /// The entry of `E`, with its schema (if it has one) and members. Used by `#[router]`.
    #[doc(hidden)]
    pub fn of<E: crate::OutboxEvent>(
        schema: Option<SchemaFn>,
        subscribers: Vec<&'static str>,
    ) -> Self {
        Self {
            event_type: E::EVENT_TYPE,
            formerly: E::FORMERLY,
            aggregate_type: E::AGGREGATE_TYPE,
            version: E::VERSION,
            oldest_readable_version: crate::event::oldest_readable_version::<E>(),
            subscribers,
            schema,
            decode: Decoded::decode::<E>,
        }
    }

    /// Its current name and the names it had before.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.event_type).chain(self.formerly.iter().copied())
    }

    /// Whether the event derives `schemars::JsonSchema`, so that it has a [`schema`](Self::schema).
    pub fn has_schema(&self) -> bool {
        self.schema.is_some()
    }

    /// The JSON Schema (draft 2020-12, self-contained) of the event's `data` at its current
    /// version; `None` when the event does not derive `schemars::JsonSchema`.
    pub fn schema(&self) -> Option<Value> {
        let schema = self.schema?;
        let mut generator = SchemaSettings::draft2020_12().into_generator();
        Some(schema(&mut generator).to_value())
    }

    /// Decodes `data` stored as version `version` under the name `stored_as` (this type's name
    /// or a former one), as the relay would: through the upcasters, into the event's type.
    ///
    /// ```
    /// # use outbox_core::{OutboxEvent, Router, router, subscriber, Handle, Delivery, HandlerError};
    /// # use serde::{Deserialize, Serialize};
    /// # use uuid::Uuid;
    /// # #[derive(Serialize, Deserialize, OutboxEvent)]
    /// # #[outbox(aggregate_type = "bot")]
    /// # struct BotInstalled { #[outbox(aggregate_id)] bot_id: Uuid }
    /// # #[subscriber(events = [BotInstalled])]
    /// # struct Licensing;
    /// # impl Handle<BotInstalled> for Licensing {
    /// #     async fn handle(&self, _: &BotInstalled, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// # #[router(events = [BotInstalled])]
    /// # struct App { licensing: Licensing }
    /// let catalog = App::catalog();
    /// let event = catalog.event("BotInstalled").unwrap();
    /// let data = serde_json::json!({"bot_id": uuid::Uuid::nil()});
    /// assert!(event.decode_data("BotInstalled", 1, &data).is_ok());
    /// assert!(event.decode_data("BotInstalled", 1, &serde_json::json!({})).is_err());
    /// ```
    pub fn decode_data(
        &self,
        stored_as: &str,
        version: u32,
        data: &Value,
    ) -> Result<(), DecodeError> {
        let payload = json!({
            "version": version,
            "data": data,
            "metadata": {"causation_id": null, "correlation_id": null},
        });
        let stored = StoredEvent {
            id: 0,
            aggregate_type: self.aggregate_type.to_owned(),
            aggregate_id: Uuid::nil(),
            event_type: stored_as.to_owned(),
            payload: payload.to_string(),
            occurred_at: OffsetDateTime::UNIX_EPOCH,
        };
        (self.decode)(&stored).map(drop)
    }
}

impl CatalogSubscriber {
    /// The entry of a member. Used by `#[router]`.
    #[doc(hidden)]
    pub const fn new(
        name: &'static str,
        formerly: &'static [&'static str],
        events: Option<&'static [&'static str]>,
    ) -> Self {
        Self {
            name,
            formerly,
            events,
        }
    }

    /// Its current name and the names it had before.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.name).chain(self.formerly.iter().copied())
    }

    /// Whether it is an observer (it takes every event).
    pub fn is_observer(&self) -> bool {
        self.events.is_none()
    }
}

impl Catalog {
    /// The catalog of router `router`. Used by `#[router]`.
    #[doc(hidden)]
    pub fn new(
        router: &'static str,
        events: Vec<CatalogEvent>,
        subscribers: Vec<CatalogSubscriber>,
    ) -> Self {
        Self {
            router,
            events,
            subscribers,
        }
    }

    /// The router's type name.
    pub fn router(&self) -> &'static str {
        self.router
    }

    /// Its events, in the order of the router's `events = [...]`.
    pub fn events(&self) -> &[CatalogEvent] {
        &self.events
    }

    /// Its subscribers and observers, in the order of the router's fields.
    pub fn subscribers(&self) -> &[CatalogSubscriber] {
        &self.subscribers
    }

    /// The event stored as `name`: its current name or a former one.
    pub fn event(&self, name: &str) -> Option<&CatalogEvent> {
        self.events.iter().find(|e| e.names().any(|n| n == name))
    }

    /// The member whose deliveries are stored as `name`: its current name or a former one.
    pub fn subscriber(&self, name: &str) -> Option<&CatalogSubscriber> {
        self.subscribers
            .iter()
            .find(|s| s.names().any(|n| n == name))
    }

    /// The catalog as JSON: `{"router", "events": [{"event_type", "formerly", "aggregate_type",
    /// "version", "oldest_readable_version", "subscribers", "schema"}], "subscribers": [{"name",
    /// "formerly", "kind", "events"}]}`, `schema` being [`CatalogEvent::schema`] (or `null`).
    pub fn to_json(&self) -> Value {
        let events: Vec<Value> = self
            .events
            .iter()
            .map(|e| {
                json!({
                    "event_type": e.event_type,
                    "formerly": e.formerly,
                    "aggregate_type": e.aggregate_type,
                    "version": e.version,
                    "oldest_readable_version": e.oldest_readable_version,
                    "subscribers": e.subscribers,
                    "schema": e.schema(),
                })
            })
            .collect();
        let all: Vec<&str> = self.events.iter().map(|e| e.event_type).collect();
        let subscribers: Vec<Value> = self
            .subscribers
            .iter()
            .map(|s| {
                json!({
                    "name": s.name,
                    "formerly": s.formerly,
                    "kind": if s.is_observer() { "observer" } else { "subscriber" },
                    "events": s.events.unwrap_or(&all),
                })
            })
            .collect();
        json!({"router": self.router, "events": events, "subscribers": subscribers})
    }

    /// The catalog as an [AsyncAPI 3.0](https://www.asyncapi.com/docs/reference/specification/v3.0.0)
    /// document of the application `title` at `version`: one channel per event type (address
    /// `<aggregate type>.<event type>`, as the NATS relay publishes it), one `send` operation
    /// each, and one message each whose payload is the stored envelope `{"version", "data",
    /// "metadata"}` with the event's JSON Schema as `data` (draft-07 form, shared definitions
    /// under `components.schemas`). Extensions say what AsyncAPI has no word for:
    /// `x-outbox-version`, `x-outbox-oldest-readable-version`, `x-outbox-aggregate-type`,
    /// `x-outbox-formerly` on messages and `x-outbox-subscribers` on operations.
    pub fn to_asyncapi(&self, title: &str, version: &str) -> Value {
        let mut generator = SchemaSettings::draft07()
            .with(|s| {
                s.definitions_path = "/components/schemas".into();
                s.meta_schema = None;
            })
            .into_generator();
        let mut channels = Map::new();
        let mut operations = Map::new();
        let mut messages = Map::new();
        for event in &self.events {
            let id = component_key(event.event_type);
            let data = match event.schema {
                Some(schema) => {
                    let mut value = schema(&mut generator).to_value();
                    if let Some(object) = value.as_object_mut() {
                        // Definitions go to the document's components, once.
                        object.remove("components");
                    }
                    value
                }
                None => json!({
                    "description": "this event does not derive `schemars::JsonSchema`: its \
                                    shape is not published"
                }),
            };
            let payload = json!({
                "type": "object",
                "required": ["version", "data", "metadata"],
                "properties": {
                    "version": {"type": "integer", "const": event.version},
                    "data": data,
                    "metadata": metadata_schema(),
                },
            });
            messages.insert(
                id.clone(),
                json!({
                    "name": event.event_type,
                    "title": event.event_type,
                    "summary": format!(
                        "`{}` of a `{}` aggregate, payload version {}",
                        event.event_type, event.aggregate_type, event.version
                    ),
                    "contentType": "application/json",
                    "payload": payload,
                    "x-outbox-version": event.version,
                    "x-outbox-oldest-readable-version": event.oldest_readable_version,
                    "x-outbox-aggregate-type": event.aggregate_type,
                    "x-outbox-formerly": event.formerly,
                }),
            );
            let mut channel_messages = Map::new();
            channel_messages.insert(
                id.clone(),
                json!({"$ref": format!("#/components/messages/{id}")}),
            );
            channels.insert(
                id.clone(),
                json!({
                    "address": format!("{}.{}", event.aggregate_type, event.event_type),
                    "messages": channel_messages,
                }),
            );
            operations.insert(
                format!("send_{id}"),
                json!({
                    "action": "send",
                    "channel": {"$ref": format!("#/channels/{id}")},
                    "messages": [{"$ref": format!("#/channels/{id}/messages/{id}")}],
                    "x-outbox-subscribers": event.subscribers,
                }),
            );
        }
        let schemas = generator.take_definitions(true);
        json!({
            "asyncapi": "3.0.0",
            "info": {
                "title": title,
                "version": version,
                "description": format!(
                    "Events published through the transactional outbox of router `{}`.",
                    self.router
                ),
            },
            "defaultContentType": "application/json",
            "channels": channels,
            "operations": operations,
            "components": {"messages": messages, "schemas": schemas},
        })
    }
}

/// The schema of an envelope's metadata.
fn metadata_schema() -> Value {
    let id = json!({"type": ["string", "null"], "format": "uuid"});
    json!({
        "type": "object",
        "properties": {
            "causation_id": id,
            "correlation_id": id,
            "trace_context": {
                "type": "object",
                "description": "propagated trace context, such as W3C `traceparent`",
                "additionalProperties": {"type": "string"},
            },
        },
    })
}

/// An AsyncAPI component key for an event type: keys are `[A-Za-z0-9._-]+`.
fn component_key(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::component_key;

    #[test]
    fn component_keys_keep_what_asyncapi_allows_and_replace_the_rest() {
        assert_eq!(
            component_key("billing/Payment Succeeded"),
            "billing_Payment_Succeeded"
        );
        assert_eq!(component_key("a.b-c_d9"), "a.b-c_d9");
        assert_eq!(component_key("é"), "_");
    }
}
