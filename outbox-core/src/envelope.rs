//! The stored form of an event: `{"version": N, "data": {..}, "metadata": {..}}`.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::error::{DecodeError, EncodeError};
use crate::event::{OutboxEvent, oldest_readable_version, upcaster_from};

/// What travels with an event besides its data: why it happened and which flow it belongs to.
///
/// Stored under `"metadata"` in the envelope as
/// `{"causation_id": <uuid or null>, "correlation_id": <uuid or null>}`, plus `"trace_context"` when
/// one is set. Unknown keys are ignored when reading, so newer writers can add some.
///
/// ```
/// use outbox_core::Metadata;
/// use uuid::Uuid;
///
/// let command_id = Uuid::nil();
/// let metadata = Metadata::new()
///     .with_causation_id(command_id)
///     .with_correlation_id(command_id);
/// assert_eq!(metadata.causation_id(), Some(command_id));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Metadata {
    causation_id: Option<Uuid>,
    correlation_id: Option<Uuid>,
    #[serde(skip_serializing_if = "TraceContext::is_empty")]
    trace_context: TraceContext,
}

impl Metadata {
    /// Metadata with no ids and no trace context.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the id of the message (command or event) that caused this event.
    #[must_use]
    pub fn with_causation_id(mut self, id: Uuid) -> Self {
        self.causation_id = Some(id);
        self
    }

    /// Sets the id that ties together every message of one business flow.
    #[must_use]
    pub fn with_correlation_id(mut self, id: Uuid) -> Self {
        self.correlation_id = Some(id);
        self
    }

    /// Sets the trace context to carry to the subscribers.
    #[must_use]
    pub fn with_trace_context(mut self, trace_context: TraceContext) -> Self {
        self.trace_context = trace_context;
        self
    }

    /// The id of the message that caused this event, if known.
    pub fn causation_id(&self) -> Option<Uuid> {
        self.causation_id
    }

    /// The id of the business flow this event belongs to, if known.
    pub fn correlation_id(&self) -> Option<Uuid> {
        self.correlation_id
    }

    /// The trace context the event was published in (empty when none).
    pub fn trace_context(&self) -> &TraceContext {
        &self.trace_context
    }

    /// The metadata of an event published by the handler of the stored event `handled_id`,
    /// whose metadata was `handled`: caused by that event ([`event_uuid`]`(handled_id)`), in the
    /// same business flow (its correlation id, or the handled event's own when it had none),
    /// with the same trace context.
    ///
    /// ```
    /// use outbox_core::{Metadata, event_uuid};
    /// # use uuid::Uuid;
    /// let flow = Uuid::from_u128(7);
    /// let handled = Metadata::new().with_correlation_id(flow);
    /// let follow_up = Metadata::follow_up(42, &handled);
    /// assert_eq!(follow_up.causation_id(), Some(event_uuid(42)));
    /// assert_eq!(follow_up.correlation_id(), Some(flow));
    /// // The first event of a flow starts it.
    /// let first = Metadata::follow_up(42, &Metadata::new());
    /// assert_eq!(first.correlation_id(), Some(event_uuid(42)));
    /// ```
    pub fn follow_up(handled_id: i64, handled: &Metadata) -> Metadata {
        let cause = event_uuid(handled_id);
        Metadata {
            causation_id: Some(cause),
            correlation_id: Some(handled.correlation_id.unwrap_or(cause)),
            trace_context: handled.trace_context.clone(),
        }
    }
}

/// The first eight bytes of every [`event_uuid`]: `outbox` and two zero bytes (the version
/// nibble of a UUID version 8 overwrites the high half of the seventh).
const EVENT_UUID_PREFIX: [u8; 8] = *b"outbox\0\0";

/// The UUID that stands for the stored event `id` where metadata names an event (a causation
/// or correlation id): a UUID version 8 holding `outbox` and the id, so that
/// [`event_id_of`] reads the id back. Ids from 0 to 2^62 - 1 are represented (a stored event's
/// id is a positive 64-bit integer; others are cut to their low 62 bits).
pub fn event_uuid(id: i64) -> Uuid {
    let mut bytes = [0_u8; 16];
    bytes[..8].copy_from_slice(&EVENT_UUID_PREFIX);
    bytes[8..].copy_from_slice(&id.to_be_bytes());
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// The stored event's id that an [`event_uuid`] stands for; `None` for any other UUID.
///
/// ```
/// use outbox_core::{event_id_of, event_uuid};
/// assert_eq!(event_id_of(event_uuid(1042)), Some(1042));
/// assert_eq!(event_id_of(uuid::Uuid::nil()), None);
/// ```
pub fn event_id_of(uuid: Uuid) -> Option<i64> {
    let bytes = uuid.as_bytes();
    let mut prefix = EVENT_UUID_PREFIX;
    prefix[6] = 0x80;
    if uuid.get_version_num() != 8 || bytes[..8] != prefix {
        return None;
    }
    let mut id = [0_u8; 8];
    id.copy_from_slice(&bytes[8..]);
    id[0] &= 0x3f;
    Some(i64::from_be_bytes(id))
}

/// A propagated trace context as text fields, such as W3C `traceparent` and `tracestate`.
///
/// It is the carrier that tracing propagators inject into and extract from; the outbox only stores
/// and returns it.
///
/// ```
/// use outbox_core::TraceContext;
///
/// let mut cx = TraceContext::new();
/// cx.insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
/// assert!(cx.get("traceparent").is_some());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TraceContext(BTreeMap<String, String>);

impl TraceContext {
    /// An empty trace context.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets one field, returning the value it replaces.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) -> Option<String> {
        self.0.insert(key.into(), value.into())
    }

    /// The value of one field.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// All fields, ordered by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A decoded event with the metadata it was stored with.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Envelope<E> {
    /// The event, upcast to the current version.
    pub event: E,
    /// The metadata stored with it.
    pub metadata: Metadata,
    /// The payload version that was stored, before any upcasting.
    pub stored_version: u32,
}

#[derive(Serialize)]
struct EnvelopeRef<'a, E> {
    version: u32,
    data: &'a E,
    metadata: &'a Metadata,
}

/// Encodes an event as the JSON payload stored in the outbox:
/// `{"version": N, "data": {..}, "metadata": {..}}`, keys in that order.
///
/// Fails only if the event's own `Serialize` impl fails or produces something JSON cannot hold
/// (a map with non-string keys, say).
///
/// Note that JSON has no NaN or infinity: serde_json writes a non-finite float as `null`, which the
/// event then fails to decode from. Keep such values out of events.
///
/// ```
/// # use outbox_core::{Metadata, OutboxEvent, encode};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// #[derive(Serialize, Deserialize, OutboxEvent)]
/// #[outbox(aggregate_type = "bot", version = 2)]
/// struct BotKicked {
///     #[outbox(aggregate_id)]
///     bot_id: Uuid,
/// }
///
/// let json = encode(&BotKicked { bot_id: Uuid::nil() }, &Metadata::new())?;
/// assert_eq!(
///     json,
///     r#"{"version":2,"data":{"bot_id":"00000000-0000-0000-0000-000000000000"},"metadata":{"causation_id":null,"correlation_id":null}}"#
/// );
/// # Ok::<(), outbox_core::EncodeError>(())
/// ```
pub fn encode<E: OutboxEvent>(event: &E, metadata: &Metadata) -> Result<String, EncodeError> {
    serde_json::to_string(&EnvelopeRef {
        version: E::VERSION,
        data: event,
        metadata,
    })
    .map_err(|source| EncodeError {
        event_type: E::EVENT_TYPE,
        source,
    })
}

/// Decodes a stored payload into `E`, upcasting older versions through `E`'s upcasters.
///
/// Every way a payload can be wrong is a [`DecodeError`] variant; decoding never panics.
///
/// ```
/// # use outbox_core::{DecodeError, OutboxEvent, decode};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// #[derive(Debug, PartialEq, Serialize, Deserialize, OutboxEvent)]
/// #[outbox(aggregate_type = "bot")]
/// struct BotKicked {
///     #[outbox(aggregate_id)]
///     bot_id: Uuid,
/// }
///
/// let stored = br#"{"version":1,"data":{"bot_id":"00000000-0000-0000-0000-000000000000"}}"#;
/// let envelope = decode::<BotKicked>(stored)?;
/// assert_eq!(envelope.event, BotKicked { bot_id: Uuid::nil() });
///
/// let too_new = br#"{"version":2,"data":{}}"#;
/// assert!(matches!(decode::<BotKicked>(too_new), Err(DecodeError::NewerVersion { found: 2, .. })));
/// # Ok::<(), DecodeError>(())
/// ```
pub fn decode<E: OutboxEvent>(payload: impl AsRef<[u8]>) -> Result<Envelope<E>, DecodeError> {
    RawEnvelope::parse(payload.as_ref())?.into_event()
}

/// An envelope whose `data` is not decoded yet: for code that handles events of any type, such as
/// an audit log, and for decoding once and handing the result to several subscribers.
#[derive(Debug, Clone)]
pub struct RawEnvelope {
    version: NonZeroU32,
    data: Box<RawValue>,
    metadata: Metadata,
}

#[derive(Deserialize)]
#[serde(expecting = r#"an outbox envelope {"version": N, "data": {..}, "metadata": {..}}"#)]
struct WireEnvelope {
    version: NonZeroU32,
    data: Box<RawValue>,
    #[serde(default)]
    metadata: Option<Metadata>,
}

impl RawEnvelope {
    /// Parses the envelope around `data`, leaving `data` itself as raw JSON.
    pub fn parse(payload: &[u8]) -> Result<Self, DecodeError> {
        let wire: WireEnvelope = serde_json::from_slice(payload).map_err(|e| {
            if e.is_data() {
                DecodeError::InvalidEnvelope(e)
            } else {
                DecodeError::MalformedJson(e)
            }
        })?;
        Ok(Self {
            version: wire.version,
            data: wire.data,
            metadata: wire.metadata.unwrap_or_default(),
        })
    }

    /// The payload version as stored.
    pub fn version(&self) -> u32 {
        self.version.get()
    }

    /// The raw JSON of `data`.
    pub fn data(&self) -> &RawValue {
        &self.data
    }

    /// The stored metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Decodes `data` as `E`, upcasting it first when it is older than `E::VERSION`.
    pub fn into_event<E: OutboxEvent>(self) -> Result<Envelope<E>, DecodeError> {
        let event = self.decode_data::<E>()?;
        Ok(Envelope {
            event,
            metadata: self.metadata,
            stored_version: self.version.get(),
        })
    }

    /// Decodes `data` as `E` without consuming the envelope.
    pub fn decode_data<E: OutboxEvent>(&self) -> Result<E, DecodeError> {
        let found = self.version.get();
        let invalid_data = |source| DecodeError::InvalidData {
            event_type: E::EVENT_TYPE,
            version: found,
            source,
        };
        if found == E::VERSION {
            return serde_json::from_str(self.data.get()).map_err(invalid_data);
        }
        if found > E::VERSION {
            return Err(DecodeError::NewerVersion {
                event_type: E::EVENT_TYPE,
                found,
                current: E::VERSION,
            });
        }
        let oldest = oldest_readable_version::<E>();
        let missing_upcaster = || DecodeError::MissingUpcaster {
            event_type: E::EVENT_TYPE,
            found,
            oldest,
            current: E::VERSION,
        };
        if found < oldest {
            return Err(missing_upcaster());
        }
        let mut data: Value = serde_json::from_str(self.data.get()).map_err(invalid_data)?;
        for from in found..E::VERSION {
            let step = upcaster_from::<E>(from).ok_or_else(missing_upcaster)?;
            data = step
                .apply(data)
                .map_err(|source| DecodeError::UpcastFailed {
                    event_type: E::EVENT_TYPE,
                    from,
                    source,
                })?;
        }
        serde_json::from_value(data).map_err(invalid_data)
    }
}

#[cfg(test)]
mod event_uuid_tests {
    use super::*;

    #[test]
    fn an_event_uuid_is_a_version_8_uuid_that_gives_its_id_back() {
        for id in [0, 1, 1042, i64::from(u32::MAX) + 1, (1 << 62) - 1] {
            let uuid = event_uuid(id);
            assert_eq!(uuid.get_version_num(), 8, "{uuid}");
            assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{uuid}");
            assert_eq!(event_id_of(uuid), Some(id), "{uuid}");
        }
        assert_ne!(event_uuid(1), event_uuid(2));
        // Other UUIDs are not event ids: not version 8, or another prefix.
        assert_eq!(event_id_of(Uuid::nil()), None);
        assert_eq!(event_id_of(Uuid::from_u128(0x1234)), None);
        let mut other = *event_uuid(5).as_bytes();
        other[0] = b'x';
        assert_eq!(event_id_of(Uuid::from_bytes(other)), None);
    }
}
