//! The event model: what an outbox event is and what the outbox needs to know about it.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use time::OffsetDateTime;
use uuid::Uuid;

/// The error type an [`Upcaster`] returns: any error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A domain event that can be stored in the outbox.
///
/// Implement it with `#[derive(OutboxEvent)]` (feature `derive`, on by default) rather than by hand:
/// the derive checks at compile time what a hand-written impl could only get wrong at run time
/// (a missing aggregate id, version `0`, a gap in the upcaster chain, an empty event type name).
///
/// The payload stored for an event is its [envelope](crate::encode):
/// `{"version": N, "data": {..}, "metadata": {..}}`, where `data` is the event's own serde form.
///
/// # Example
///
/// ```
/// use outbox_core::OutboxEvent;
/// use serde::{Deserialize, Serialize};
/// use uuid::Uuid;
///
/// #[derive(Debug, Serialize, Deserialize, OutboxEvent)]
/// #[outbox(aggregate_type = "subscription", event_type = "PaymentSucceeded")]
/// struct PaymentSucceeded {
///     #[outbox(aggregate_id)]
///     subscription_id: Uuid,
///     cycle_count: u32,
/// }
///
/// assert_eq!(PaymentSucceeded::AGGREGATE_TYPE, "subscription");
/// assert_eq!(PaymentSucceeded::EVENT_TYPE, "PaymentSucceeded");
/// assert_eq!(PaymentSucceeded::VERSION, 1);
/// let id = Uuid::nil();
/// assert_eq!(PaymentSucceeded { subscription_id: id, cycle_count: 3 }.aggregate_id(), id);
/// ```
///
/// # The derive's attributes
///
/// On the struct, in one or several `#[outbox(...)]` attributes:
///
/// | key | meaning | default |
/// | --- | --- | --- |
/// | `aggregate_type = "..."` | the kind of aggregate the event belongs to | required |
/// | `event_type = "..."` | the name stored with the event and used for routing | the type's name |
/// | `formerly = ["..."]` | the names it was stored under before a rename, still routed to it | none |
/// | `version = N` | the current payload version, `N >= 1` | `1` |
/// | `upcast(from = K, with = path)` | turns version `K` data into version `K + 1` data | none |
/// | `crate = "path"` | where `outbox_core` is, when it is renamed or re-exported | `::outbox_core` |
///
/// On fields: `#[outbox(aggregate_id)]` on exactly one field whose type implements [`AggregateId`]
/// ([`Uuid`] does), and optionally `#[outbox(occurred_at)]` on a field whose type implements
/// [`Timestamp`] (such as [`OffsetDateTime`]).
///
/// Upcasters run on the JSON of `data`, oldest first, and must form an unbroken chain that ends at
/// `version - 1`: an event at version 3 may declare `from = 2` alone, or `from = 1` and `from = 2`,
/// but not `from = 1` alone. See [`Upcaster`] for the function's signature.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an outbox event",
    label = "not an `OutboxEvent`",
    note = "derive it: `#[derive(Serialize, Deserialize, OutboxEvent)]` with `#[outbox(aggregate_type = \"...\")]`"
)]
pub trait OutboxEvent: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The kind of aggregate this event belongs to, such as `"subscription"`.
    const AGGREGATE_TYPE: &'static str;
    /// The event's name as stored in the outbox and used for routing, such as `"PaymentSucceeded"`.
    const EVENT_TYPE: &'static str;
    /// The names this event type had before, stored with events published before a rename: the
    /// relay routes and decodes such events as this type. Keep a name here as long as stored
    /// events may carry it; `outbox_core::testing::check_catalog` fails when one disappears.
    const FORMERLY: &'static [&'static str] = &[];
    /// The version of `data` that this type serializes, at least 1.
    const VERSION: u32;
    /// Steps that turn older versions of `data` into newer ones, see [`Upcaster`].
    const UPCASTERS: &'static [Upcaster] = &[];

    /// The id of the aggregate this event belongs to. Events of one aggregate are delivered in
    /// commit order.
    fn aggregate_id(&self) -> Uuid;

    /// When the event happened, if the event carries that itself. When `None`, the store records
    /// the time of publishing.
    fn occurred_at(&self) -> Option<OffsetDateTime> {
        None
    }
}

/// One step of an upcaster chain: turns the `data` of version `from` into the `data` of version
/// `from + 1`.
///
/// With the derive, name a function in `#[outbox(upcast(from = K, with = path::to::function))]`.
/// The function takes the old `data` as a [`serde_json::Value`] and returns the new one, or an error
/// that says why it cannot (the event then becomes a dead letter, with that reason):
///
/// ```
/// use serde_json::{Value, json};
///
/// /// Version 2 renamed `amount` to `amount_minor`.
/// fn v1_to_v2(mut data: Value) -> Result<Value, &'static str> {
///     let obj = data.as_object_mut().ok_or("data is not an object")?;
///     let amount = obj.remove("amount").ok_or("missing `amount`")?;
///     obj.insert("amount_minor".into(), amount);
///     Ok(data)
/// }
/// # assert_eq!(v1_to_v2(json!({"amount": 5})).unwrap(), json!({"amount_minor": 5}));
/// ```
///
/// Any error type that converts into [`BoxError`] works: `&'static str`, `String`, your own error.
#[derive(Clone, Copy)]
pub struct Upcaster {
    from: u32,
    apply: fn(Value) -> Result<Value, BoxError>,
}

impl Upcaster {
    /// An upcaster from version `from` to version `from + 1`.
    pub const fn new(from: u32, apply: fn(Value) -> Result<Value, BoxError>) -> Self {
        Self { from, apply }
    }

    /// The version this step reads.
    pub const fn from(&self) -> u32 {
        self.from
    }

    /// Runs the step on `data` of version [`from`](Self::from).
    pub fn apply(&self, data: Value) -> Result<Value, BoxError> {
        (self.apply)(data)
    }
}

impl std::fmt::Debug for Upcaster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upcaster")
            .field("from", &self.from)
            .finish_non_exhaustive()
    }
}

/// The oldest payload version of `E` that can be read: the start of the unbroken upcaster chain
/// that ends at `E::VERSION`.
pub(crate) fn oldest_readable_version<E: OutboxEvent>() -> u32 {
    let mut oldest = E::VERSION;
    while oldest > 1 && upcaster_from::<E>(oldest - 1).is_some() {
        oldest -= 1;
    }
    oldest
}

pub(crate) fn upcaster_from<E: OutboxEvent>(version: u32) -> Option<&'static Upcaster> {
    E::UPCASTERS.iter().find(|u| u.from == version)
}

/// A type that can be an event's aggregate id: a [`Uuid`], or a newtype around one.
///
/// ```
/// use outbox_core::{AggregateId, OutboxEvent};
/// use serde::{Deserialize, Serialize};
/// use uuid::Uuid;
///
/// #[derive(Clone, Copy, Serialize, Deserialize)]
/// struct SubscriptionId(Uuid);
///
/// impl AggregateId for SubscriptionId {
///     fn to_uuid(&self) -> Uuid {
///         self.0
///     }
/// }
///
/// #[derive(Serialize, Deserialize, OutboxEvent)]
/// #[outbox(aggregate_type = "subscription")]
/// struct SubscriptionStarted {
///     #[outbox(aggregate_id)]
///     subscription_id: SubscriptionId,
/// }
///
/// let id = SubscriptionId(Uuid::nil());
/// assert_eq!(SubscriptionStarted { subscription_id: id }.aggregate_id(), Uuid::nil());
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an aggregate id",
    label = "the `#[outbox(aggregate_id)]` field must be a `Uuid`",
    note = "use `uuid::Uuid`, or implement `outbox_core::AggregateId` for a newtype that wraps one"
)]
pub trait AggregateId {
    /// The aggregate id as a [`Uuid`].
    fn to_uuid(&self) -> Uuid;
}

impl AggregateId for Uuid {
    fn to_uuid(&self) -> Uuid {
        *self
    }
}

/// A type that can be an event's `#[outbox(occurred_at)]` field.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an event's `occurred_at`",
    label = "the `#[outbox(occurred_at)]` field must be a timestamp",
    note = "use `time::OffsetDateTime` or `Option<time::OffsetDateTime>`"
)]
pub trait Timestamp {
    /// The timestamp, or `None` when the event does not know it.
    fn to_offset_date_time(&self) -> Option<OffsetDateTime>;
}

impl Timestamp for OffsetDateTime {
    fn to_offset_date_time(&self) -> Option<OffsetDateTime> {
        Some(*self)
    }
}

impl<T: Timestamp> Timestamp for Option<T> {
    fn to_offset_date_time(&self) -> Option<OffsetDateTime> {
        self.as_ref().and_then(Timestamp::to_offset_date_time)
    }
}
