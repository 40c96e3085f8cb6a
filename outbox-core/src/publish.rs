//! The publish port: what a domain service needs to publish events, whatever stores them.

use std::future::Future;

use crate::envelope::Metadata;
use crate::error::PublishError;
use crate::event::OutboxEvent;

/// Something that publishes events atomically with the domain change it belongs to.
///
/// It is the port a domain service writes against, one bound per event type it publishes
/// (`impl Publish<PaymentSucceeded> + Publish<PaymentFailedFinal>`). In production it is a live
/// outbox transaction (`outbox_sqlx::OutboxTx` in the `Active` state), whose events commit or roll
/// back with the rest of the transaction, and which publishes only the events its router routes;
/// in unit tests it can be a publisher that records what it is given. Pools, bare connections and
/// finished transactions do not implement it: there an event could outlive a rolled-back change,
/// or be lost after a committed one.
///
/// ```
/// use outbox_core::{EncodeError, Metadata, OutboxEvent, Publish, PublishError, encode};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// # #[derive(Serialize, Deserialize, OutboxEvent)]
/// # #[outbox(aggregate_type = "subscription")]
/// # struct SubscriptionStarted { #[outbox(aggregate_id)] subscription_id: Uuid }
///
/// /// A domain service that depends on the port only.
/// async fn start_subscription(
///     events: &mut impl Publish<SubscriptionStarted>,
///     subscription_id: Uuid,
/// ) -> Result<(), PublishError> {
///     events.publish(&SubscriptionStarted { subscription_id }).await
/// }
///
/// /// A publisher for unit tests: keeps the encoded payloads.
/// #[derive(Default)]
/// struct Recorder(Vec<String>);
///
/// impl<E: OutboxEvent> Publish<E> for Recorder {
///     async fn publish(&mut self, event: &E) -> Result<(), PublishError> {
///         self.publish_with(event, &Metadata::new()).await
///     }
///     async fn publish_with(&mut self, event: &E, metadata: &Metadata) -> Result<(), PublishError> {
///         self.0.push(encode(event, metadata)?);
///         Ok(())
///     }
///     async fn publish_all<'e>(
///         &mut self,
///         events: impl IntoIterator<Item = &'e E> + Send,
///     ) -> Result<(), PublishError>
///     where
///         E: 'e,
///     {
///         let payloads: Result<Vec<_>, EncodeError> =
///             events.into_iter().map(|e| encode(e, &Metadata::new())).collect();
///         self.0.extend(payloads?);
///         Ok(())
///     }
/// }
///
/// let mut recorder = Recorder::default();
/// let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
/// runtime.block_on(start_subscription(&mut recorder, Uuid::nil()))?;
/// assert_eq!(recorder.0.len(), 1);
/// # Ok::<(), PublishError>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot publish outbox events",
    label = "not a live outbox transaction",
    note = "events are published inside a transaction, so that they commit or roll back with the domain change: begin one with `outbox.begin().await?` and publish on it"
)]
pub trait Publish<E: OutboxEvent>: Send {
    /// Publishes one event with the publisher's default metadata.
    fn publish(&mut self, event: &E) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// Publishes one event with the given metadata.
    fn publish_with(
        &mut self,
        event: &E,
        metadata: &Metadata,
    ) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// Publishes several events, in order, with the publisher's default metadata.
    fn publish_all<'e>(
        &mut self,
        events: impl IntoIterator<Item = &'e E> + Send,
    ) -> impl Future<Output = Result<(), PublishError>> + Send
    where
        E: 'e;
}
