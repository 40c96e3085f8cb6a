//! Paths used by the code that `outbox-derive` generates. Not a public API: it changes without
//! notice.

pub use time::OffsetDateTime;
pub use uuid::Uuid;

use serde_json::Value;

pub use crate::event::{AggregateId, BoxError, OutboxEvent, Timestamp, Upcaster};

/// A function that can be named in `#[outbox(upcast(from = K, with = ...))]`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an upcaster",
    label = "not a `fn(serde_json::Value) -> Result<serde_json::Value, E>`",
    note = "an upcaster takes the old `data` as a `serde_json::Value` and returns the new one, or an error that converts into `outbox_core::BoxError` (such as `&str`, `String` or your own error type)"
)]
pub trait UpcastFn {
    /// Runs the upcaster.
    fn call(self, data: Value) -> Result<Value, BoxError>;
}

impl<F, E> UpcastFn for F
where
    F: FnOnce(Value) -> Result<Value, E>,
    E: Into<BoxError>,
{
    fn call(self, data: Value) -> Result<Value, BoxError> {
        self(data).map_err(Into::into)
    }
}

/// Runs `upcaster` on `data`; a function so that a wrong signature is reported on the user's path.
pub fn upcast_with(upcaster: impl UpcastFn, data: Value) -> Result<Value, BoxError> {
    upcaster.call(data)
}
