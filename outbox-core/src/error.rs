//! Errors of encoding and decoding event payloads.

use crate::event::BoxError;

/// An event could not be turned into JSON.
#[derive(Debug, thiserror::Error)]
#[error("cannot encode `{event_type}` as JSON: {source}")]
pub struct EncodeError {
    pub(crate) event_type: &'static str,
    #[source]
    pub(crate) source: serde_json::Error,
}

impl EncodeError {
    /// The event type that failed to encode.
    pub fn event_type(&self) -> &'static str {
        self.event_type
    }
}

/// A stored payload could not be decoded into an event.
///
/// Each variant names one way a payload can be wrong, so that the relay can tell a payload that will
/// never decode (a dead letter) from one written by newer code (parked until that code runs here).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload is not JSON at all, or is cut short.
    #[error("payload is not valid JSON: {0}")]
    MalformedJson(#[source] serde_json::Error),

    /// The payload is JSON but not an envelope: `version` or `data` is missing, `version` is not a
    /// positive integer, or the payload is not an object.
    #[error("payload is not an outbox envelope: {0}")]
    InvalidEnvelope(#[source] serde_json::Error),

    /// `data` does not have the shape of the event (after upcasting, if the payload was older).
    #[error(
        "`data` of a version {version} `{event_type}` payload does not fit the event: {source}"
    )]
    InvalidData {
        /// The event type it was decoded as.
        event_type: &'static str,
        /// The version stored in the payload.
        version: u32,
        /// What serde_json reported.
        #[source]
        source: serde_json::Error,
    },

    /// The payload is older than the oldest version this build can upcast from.
    #[error(
        "`{event_type}` payload version {found} is older than this build can read \
         (versions {oldest} to {current}): declare `#[outbox(upcast(from = {found}, with = ...))]`"
    )]
    MissingUpcaster {
        /// The event type it was decoded as.
        event_type: &'static str,
        /// The version stored in the payload.
        found: u32,
        /// The oldest version this build can upcast from.
        oldest: u32,
        /// The version this build serializes.
        current: u32,
    },

    /// The payload was written by newer code than this build: a rolling deploy is under way, or
    /// this process is out of date.
    #[error(
        "`{event_type}` payload version {found} is newer than version {current} known to this \
         build: run the newer code to deliver it"
    )]
    NewerVersion {
        /// The event type it was decoded as.
        event_type: &'static str,
        /// The version stored in the payload.
        found: u32,
        /// The version this build serializes.
        current: u32,
    },

    /// The event type is not in this build's catalog: it was written by newer code, or by code
    /// that routes events this build does not.
    #[error("event type `{event_type}` is not in this build's catalog")]
    UnknownEventType {
        /// The stored event type.
        event_type: String,
    },

    /// Decoding panicked: a `Deserialize` implementation or an upcaster of the event has a bug.
    /// The relay catches the panic and makes the event a dead letter, as a payload that can
    /// never be decoded by this code.
    #[error("decoding `{event_type}` panicked: {message}")]
    Panicked {
        /// The stored event type.
        event_type: String,
        /// The panic's message.
        message: String,
    },

    /// An upcaster returned an error.
    #[error("upcasting `{event_type}` from version {from} failed: {source}")]
    UpcastFailed {
        /// The event type it was decoded as.
        event_type: &'static str,
        /// The version the failing step reads.
        from: u32,
        /// What the upcaster returned.
        #[source]
        source: BoxError,
    },
}

impl DecodeError {
    /// Whether the payload may decode in a newer build (a newer version, an unknown event type):
    /// such events are parked and looked at again, not dead-lettered.
    pub fn may_decode_in_newer_build(&self) -> bool {
        matches!(
            self,
            DecodeError::NewerVersion { .. } | DecodeError::UnknownEventType { .. }
        )
    }
}

/// An event could not be published.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The event could not be encoded; nothing was stored.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The store failed; the transaction should be rolled back (dropping it does that).
    #[error("cannot store the event: {0}")]
    Store(#[source] BoxError),
}

/// A setting is not valid. Returned when a relay, a store or a retry policy is built, never later.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A schema or table name is not a plain SQL identifier.
    #[error(
        "invalid SQL identifier {value:?} for the {role}: use 1 to {max_len} lowercase ASCII \
         letters, digits and underscores, starting with a letter or an underscore"
    )]
    InvalidIdentifier {
        /// What the name was for, such as `"schema"`.
        role: &'static str,
        /// The rejected name.
        value: String,
        /// The longest name allowed for this role.
        max_len: usize,
    },
    /// A setting is out of its range.
    #[error("invalid {setting}: {reason}")]
    InvalidSetting {
        /// The setting, such as `"batch size"`.
        setting: &'static str,
        /// What is wrong and what is allowed.
        reason: String,
    },
}

/// A store could not do what the relay or an operator asked; the relay logs it and tries again.
///
/// A store says when the error was the loss of one connection (closed, reset, or ended by the
/// server): the relay then tries again at once, on a new connection, instead of backing off as
/// it does for a store that stays unreachable.
#[derive(Debug, thiserror::Error)]
#[error("outbox store failed: {error}")]
pub struct StoreError {
    #[source]
    error: BoxError,
    connection_lost: bool,
}

impl StoreError {
    /// Wraps any error.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Self {
            error: error.into(),
            connection_lost: false,
        }
    }

    /// Wraps the error of a connection that broke: another connection may work at once.
    pub fn connection_lost(error: impl Into<BoxError>) -> Self {
        Self {
            error: error.into(),
            connection_lost: true,
        }
    }

    /// Whether one connection broke, rather than the store failing.
    pub fn is_connection_lost(&self) -> bool {
        self.connection_lost
    }

    /// The underlying error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }
}
