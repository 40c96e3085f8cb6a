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

pub use std::boxed::Box;
pub use std::sync::LazyLock;
pub use std::vec::Vec;

pub use crate::error::DecodeError;
pub use crate::routing::{
    Decoded, DeliverFuture, Delivery, Handle, HandlerError, Observer, Router, Routes, RunsOn,
    Subscriber,
};
pub use crate::store::StoredEvent;

/// `#[subscriber]` implements it for every router `R` that routes each of the subscriber's events;
/// `#[router]` requires it of each subscriber field, so that a subscriber event missing from the
/// catalog is a compile error naming both (the unmet bound is `R: Routes<E>`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a subscriber",
    label = "a router's field must be a subscriber or an `#[observer]`",
    note = "mark the type `#[subscriber(events = [...])]`, or mark the field `#[observer]` if it takes every event"
)]
pub trait SubscribedIn<R>: Subscriber {}

/// What a router needs of one catalog event.
#[derive(Clone, Copy)]
pub struct EventInfo {
    /// `E::EVENT_TYPE`.
    pub event_type: &'static str,
    /// `E::FORMERLY`.
    pub formerly: &'static [&'static str],
    /// Decodes a stored `E`.
    pub decode: fn(&StoredEvent) -> Result<Decoded, DecodeError>,
    /// Its catalog entry, given its schema and members.
    pub entry: fn(Option<SchemaFn>, Vec<&'static str>) -> CatalogEvent,
}

impl EventInfo {
    /// The info of `E`; the one place a router requires `E: OutboxEvent`, so that a catalog entry
    /// that is not an event is one error.
    pub const fn of<E: OutboxEvent>() -> Self {
        Self {
            event_type: E::EVENT_TYPE,
            formerly: E::FORMERLY,
            decode: Decoded::decode::<E>,
            entry: CatalogEvent::of::<E>,
        }
    }

    /// Whether the event is stored as `name`: its type or a former one.
    pub fn is_named(&self, name: &str) -> bool {
        self.event_type == name || self.formerly.contains(&name)
    }
}

pub use crate::catalog::{Catalog, CatalogEvent, CatalogSubscriber, SchemaFn};

/// Finds an event's schema, if it has one: `(&&SchemaProbe::<E>::new()).schema_fn()` with
/// [`HasSchema`] and [`NoSchema`] in scope is `Some` when `E: JsonSchema` and `None` otherwise
/// (method resolution tries the impl on `&SchemaProbe` first).
pub struct SchemaProbe<T>(std::marker::PhantomData<T>);

impl<T> SchemaProbe<T> {
    /// The probe of `T`.
    pub const fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T> Default for SchemaProbe<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The schema of a type that has one. See [`SchemaProbe`].
pub trait HasSchema {
    /// `Some(root_schema_for::<T>)`.
    fn schema_fn(&self) -> Option<SchemaFn>;
}

impl<T: schemars::JsonSchema> HasSchema for &SchemaProbe<T> {
    fn schema_fn(&self) -> Option<SchemaFn> {
        Some(schemars::SchemaGenerator::root_schema_for::<T>)
    }
}

/// No schema, for a type without one. See [`SchemaProbe`].
pub trait NoSchema {
    /// `None`.
    fn schema_fn(&self) -> Option<SchemaFn>;
}

impl<T> NoSchema for SchemaProbe<T> {
    fn schema_fn(&self) -> Option<SchemaFn> {
        None
    }
}

/// What a router needs of one member (a field): its name, its events, how to deliver to it.
pub struct MemberInfo<T> {
    /// The stored name.
    pub name: &'static str,
    /// The names it had before.
    pub formerly: &'static [&'static str],
    /// The events it takes; `None` for an observer, which takes all.
    pub events: Option<&'static [&'static str]>,
    /// Hands it a decoded event.
    pub deliver: for<'a> fn(&'a T, &'a Decoded, &'a Delivery<'a>) -> DeliverFuture<'a>,
}

impl<T> MemberInfo<T> {
    /// The info of subscriber `T` in router `R`; the one place a router requires it of `T`.
    pub const fn subscriber_in<R>() -> Self
    where
        T: SubscribedIn<R>,
    {
        Self {
            name: T::NAME,
            formerly: <T as Subscriber>::FORMERLY,
            events: Some(T::EVENTS),
            deliver: T::deliver,
        }
    }

    /// The info of observer `T`; the one place a router requires it of `T`.
    pub const fn observer() -> Self
    where
        T: Observer,
    {
        Self {
            name: T::NAME,
            formerly: <T as Observer>::FORMERLY,
            events: None,
            deliver: observe_decoded::<T>,
        }
    }

    /// The member without its type, for the route table.
    pub const fn member(&self) -> Member {
        match self.events {
            Some(events) => Member::Subscriber(self.name, events),
            None => Member::Observer(self.name),
        }
    }

    /// Whether the member's deliveries are stored as `name`: its name or a former one.
    pub fn is_named(&self, name: &str) -> bool {
        self.name == name || self.formerly.contains(&name)
    }

    /// Its catalog entry.
    pub const fn entry(&self) -> CatalogSubscriber {
        CatalogSubscriber::new(self.name, self.formerly, self.events)
    }
}

/// Whether two durable names and their former names share a name, in const context.
pub const fn names_overlap(a: &str, a_formerly: &[&str], b: &str, b_formerly: &[&str]) -> bool {
    contains(b_formerly, a) || contains(a_formerly, b) || {
        let mut i = 0;
        let mut found = false;
        while i < a_formerly.len() {
            if contains(b_formerly, a_formerly[i]) {
                found = true;
            }
            i += 1;
        }
        found
    }
}

fn observe_decoded<'a, O: Observer>(
    observer: &'a O,
    _: &'a Decoded,
    delivery: &'a Delivery<'a>,
) -> DeliverFuture<'a> {
    Box::pin(observer.observe(delivery))
}

/// Whether a subscriber (not an observer) of `members` takes `event_type`, in const context.
pub const fn routed(members: &[Member], event_type: &str) -> bool {
    let mut i = 0;
    while i < members.len() {
        if let Member::Subscriber(_, events) = members[i]
            && contains(events, event_type)
        {
            return true;
        }
        i += 1;
    }
    false
}

/// `a == b`, in const context.
pub const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether `list` holds `item`, in const context.
pub const fn contains(list: &[&str], item: &str) -> bool {
    let mut i = 0;
    while i < list.len() {
        if str_eq(list[i], item) {
            return true;
        }
        i += 1;
    }
    false
}

/// A member of a router: a subscriber with its events, or an observer that takes all.
#[derive(Debug, Clone, Copy)]
pub enum Member {
    /// A subscriber.
    Subscriber(&'static str, &'static [&'static str]),
    /// An observer.
    Observer(&'static str),
}

/// A router's table: for each catalog event type (and each name it had before), its members in
/// declaration order.
#[derive(Debug)]
pub struct RouteTable {
    routes: std::collections::HashMap<&'static str, Vec<&'static str>>,
}

impl RouteTable {
    /// Builds the table of `events` over `members`.
    pub fn new(events: &[EventInfo], members: &[Member]) -> Self {
        let routes = events
            .iter()
            .flat_map(|event| {
                let names: Vec<&'static str> = Self::members_of(event.event_type, members);
                std::iter::once(event.event_type)
                    .chain(event.formerly.iter().copied())
                    .map(move |name| (name, names.clone()))
            })
            .collect();
        Self { routes }
    }

    /// The members that take `event_type`, in declaration order.
    pub fn members_of(event_type: &str, members: &[Member]) -> Vec<&'static str> {
        members
            .iter()
            .filter_map(|member| match *member {
                Member::Subscriber(name, taken) => contains(taken, event_type).then_some(name),
                Member::Observer(name) => Some(name),
            })
            .collect()
    }

    /// The members of `event_type`, or `None` when it is not in the catalog.
    pub fn get(&self, event_type: &str) -> Option<&[&'static str]> {
        self.routes.get(event_type).map(Vec::as_slice)
    }
}

/// The error of a delivery that reached a subscriber with an event it does not take: the stored
/// routing and this build's disagree.
pub fn not_taken<'a>(subscriber: &'static str, delivery: &Delivery<'_>) -> DeliverFuture<'a> {
    let message = format!(
        "subscriber `{subscriber}` does not take event type `{}`",
        delivery.event().event_type
    );
    Box::pin(async move { Err(HandlerError::permanent(message)) })
}

/// The decode error of an event type outside the catalog.
pub fn unknown_event_type(event: &StoredEvent) -> DecodeError {
    DecodeError::UnknownEventType {
        event_type: event.event_type.clone(),
    }
}

/// The error of a delivery to a subscriber this router does not have.
pub fn unknown_subscriber<'a>(subscriber: &str) -> DeliverFuture<'a> {
    let message = format!("this build's router has no subscriber `{subscriber}`");
    Box::pin(async move { Err(HandlerError::permanent(message)) })
}
