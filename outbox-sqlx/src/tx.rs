//! The typestate transaction: the only value that can publish.
//!
//! An [`OutboxTx<'c, DB, R, S>`](OutboxTx) is a database transaction of `DB` that borrows its
//! connection for `'c` (`'static` when it owns a pooled connection), publishes the events that
//! the application's router `R` routes, and is in the state `S`:
//!
//! - [`Active`]: open. Run domain SQL on it (it dereferences to the connection), publish events,
//!   then [`commit`](OutboxTx::commit) or [`rollback`](OutboxTx::rollback), which consume it.
//!   Dropping it rolls back.
//! - [`Committed`], [`RolledBack`]: what `commit` and `rollback` return. They can tell how many
//!   events were published, and nothing else: publishing on them does not compile.
//!
//! Publishing `E` needs the state to implement [`CanPublish`], which only [`Active`] does, and the
//! router to implement [`Routes<E>`](outbox_core::Routes), which `#[router]` does for each event of its
//! catalog. Pools, bare connections and bare sqlx transactions cannot publish at all, so an event
//! is always stored in the same transaction as the domain change it describes, and every stored
//! event has a subscriber.

use std::future::Future;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;

use outbox_core::{Metadata, OutboxEvent, Publish, PublishError, RoutedBy, encode};
use sqlx::{Database, Pool, Transaction};

use crate::backend::{Backend, NewEvent};
use crate::error::Error;
use crate::inbox::Received;
use crate::outbox::Outbox;

/// The transaction is open.
#[derive(Debug)]
pub struct Active;

/// The transaction was committed.
#[derive(Debug)]
pub struct Committed;

/// The transaction was rolled back.
#[derive(Debug)]
pub struct RolledBack;

/// A state of an [`OutboxTx`]. Sealed.
pub trait State: sealed::Sealed + Send + 'static {
    /// What a transaction in this state holds.
    #[doc(hidden)]
    type Inner<'c, DB: Backend>: Send;
}

impl State for Active {
    type Inner<'c, DB: Backend> = Transaction<'c, DB>;
}

impl State for Committed {
    type Inner<'c, DB: Backend> = ();
}

impl State for RolledBack {
    type Inner<'c, DB: Backend> = ();
}

/// The states in which a transaction can publish: only [`Active`].
#[diagnostic::on_unimplemented(
    message = "a `{Self}` outbox transaction cannot publish events",
    label = "this transaction is over",
    note = "publish before `commit()`; for more events, begin a new transaction with `outbox.begin().await?`"
)]
pub trait CanPublish: State {
    #[doc(hidden)]
    fn connection<'a, 'c, DB: Backend>(
        inner: &'a mut Self::Inner<'c, DB>,
    ) -> &'a mut DB::Connection;
}

impl CanPublish for Active {
    fn connection<'a, 'c, DB: Backend>(tx: &'a mut Transaction<'c, DB>) -> &'a mut DB::Connection {
        tx
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Active {}
    impl Sealed for super::Committed {}
    impl Sealed for super::RolledBack {}
}

/// A database transaction that can publish events: they commit, or roll back, with it.
///
/// Get one from [`Outbox::begin`] (or [`Outbox::wrap`] around a sqlx transaction). Run domain
/// SQL on it through `&mut *tx`, publish, then commit:
///
/// ```no_run
/// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// # #[derive(Serialize, Deserialize, OutboxEvent)]
/// # #[outbox(aggregate_type = "subscription")]
/// # struct PaymentSucceeded { #[outbox(aggregate_id)] subscription_id: Uuid }
/// # #[subscriber(events = [PaymentSucceeded])]
/// # struct Licensing;
/// # impl Handle<PaymentSucceeded> for Licensing {
/// #     async fn handle(&self, _: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # #[router(events = [PaymentSucceeded])]
/// # struct App { licensing: Licensing }
/// # #[tokio::main] async fn main() -> Result<(), outbox_sqlx::Error> {
/// # let outbox: outbox_sqlx::Outbox<sqlx::Postgres, App> =
/// #     outbox_sqlx::Outbox::new(sqlx::PgPool::connect_lazy("postgres://").unwrap());
/// # let id = Uuid::nil();
/// let mut tx = outbox.begin().await?;
/// sqlx::query("UPDATE subscriptions SET cycle_count = cycle_count + 1 WHERE id = $1")
///     .bind(id)
///     .execute(&mut *tx)
///     .await?;
/// tx.publish(&PaymentSucceeded { subscription_id: id }).await?;
/// tx.commit().await?; // the update and the event, or neither
/// # Ok(()) }
/// ```
///
/// Dropping it without `commit` rolls everything back, the events included. After `commit` the
/// transaction is gone, and so is the ability to publish on it:
///
/// ```compile_fail,E0277
/// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// # #[derive(Serialize, Deserialize, OutboxEvent)]
/// # #[outbox(aggregate_type = "subscription")]
/// # struct PaymentSucceeded { #[outbox(aggregate_id)] subscription_id: Uuid }
/// # #[subscriber(events = [PaymentSucceeded])]
/// # struct Licensing;
/// # impl Handle<PaymentSucceeded> for Licensing {
/// #     async fn handle(&self, _: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # #[router(events = [PaymentSucceeded])]
/// # struct App { licensing: Licensing }
/// # async fn demo(outbox: outbox_sqlx::Outbox<sqlx::Postgres, App>, id: Uuid) -> Result<(), outbox_sqlx::Error> {
/// let tx = outbox.begin().await?;
/// let mut committed = tx.commit().await?;
/// committed.publish(&PaymentSucceeded { subscription_id: id }).await?; // does not compile
/// # Ok(()) }
/// ```
///
/// A transaction publishes only the events its router routes:
///
/// ```compile_fail,E0277
/// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
/// # use serde::{Deserialize, Serialize};
/// # use uuid::Uuid;
/// # #[derive(Serialize, Deserialize, OutboxEvent)]
/// # #[outbox(aggregate_type = "subscription")]
/// # struct PaymentSucceeded { #[outbox(aggregate_id)] subscription_id: Uuid }
/// #[derive(Serialize, Deserialize, OutboxEvent)]
/// #[outbox(aggregate_type = "bot")]
/// struct BotKicked {
///     #[outbox(aggregate_id)]
///     bot_id: Uuid,
/// }
/// # #[subscriber(events = [PaymentSucceeded])]
/// # struct Licensing;
/// # impl Handle<PaymentSucceeded> for Licensing {
/// #     async fn handle(&self, _: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
/// # }
///
/// #[router(events = [PaymentSucceeded])]
/// struct App {
///     licensing: Licensing,
/// }
///
/// # async fn demo(outbox: outbox_sqlx::Outbox<sqlx::Postgres, App>, id: Uuid) -> Result<(), outbox_sqlx::Error> {
/// let mut tx = outbox.begin().await?;
/// tx.publish(&BotKicked { bot_id: id }).await?; // `BotKicked` is not in the catalog of `App`
/// # Ok(()) }
/// ```
pub struct OutboxTx<'c, DB: Backend, R, S: State = Active> {
    inner: S::Inner<'c, DB>,
    outbox: Outbox<DB, R>,
    metadata: Metadata,
    published: u64,
    state: PhantomData<S>,
}

impl<'c, DB: Backend, R> OutboxTx<'c, DB, R, Active> {
    pub(crate) fn new(outbox: Outbox<DB, R>, tx: Transaction<'c, DB>) -> Self {
        Self {
            inner: tx,
            outbox,
            metadata: Metadata::new(),
            published: 0,
            state: PhantomData,
        }
    }

    /// Commits the domain change and the events. A relay of the same [`Outbox`] in this process
    /// starts delivering them at once.
    pub async fn commit(self) -> Result<OutboxTx<'c, DB, R, Committed>, Error> {
        self.inner.commit().await?;
        if self.published > 0 {
            self.outbox.wake_relay();
        }
        Ok(OutboxTx {
            inner: (),
            outbox: self.outbox,
            metadata: self.metadata,
            published: self.published,
            state: PhantomData,
        })
    }

    /// Rolls back the domain change and the events. Dropping the transaction does the same.
    pub async fn rollback(self) -> Result<OutboxTx<'c, DB, R, RolledBack>, Error> {
        self.inner.rollback().await?;
        Ok(OutboxTx {
            inner: (),
            outbox: self.outbox,
            metadata: self.metadata,
            published: self.published,
            state: PhantomData,
        })
    }
}

/// The future of a publish: boxed, so that publishing in a state that cannot publish is one
/// compile error at the call, not one more at every `.await`.
pub type PublishFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl<DB: Backend, R, S: State> OutboxTx<'_, DB, R, S> {
    /// Publishes `event` in this transaction, with the transaction's metadata. `E` must be in the
    /// event catalog of the router `R` (`R: Routes<E>`).
    ///
    /// The event is encoded at once; the returned future inserts it.
    pub fn publish<E>(&mut self, event: &E) -> PublishFuture<'_, Result<(), Error>>
    where
        S: CanPublish,
        E: OutboxEvent + RoutedBy<R>,
    {
        let rows = encode_all([event], &self.metadata);
        self.insert(rows)
    }

    /// Publishes `event` in this transaction, with `metadata`.
    pub fn publish_with<E>(
        &mut self,
        event: &E,
        metadata: &Metadata,
    ) -> PublishFuture<'_, Result<(), Error>>
    where
        S: CanPublish,
        E: OutboxEvent + RoutedBy<R>,
    {
        let rows = encode_all([event], metadata);
        self.insert(rows)
    }

    /// Publishes `events` in this transaction, in order, in one statement, with the
    /// transaction's metadata.
    ///
    /// On PostgreSQL a transaction locks each aggregate it publishes for until it ends, in the
    /// server's lock table (about `max_locks_per_transaction` x `max_connections` locks for
    /// all sessions: about ten thousand on a default server). Publish a bulk import in
    /// transactions of a few thousand aggregates at most: beyond what the table holds, the
    /// publish fails with [`Error::TooManyAggregates`] and the transaction can only be rolled
    /// back.
    pub fn publish_all<'e, E>(
        &mut self,
        events: impl IntoIterator<Item = &'e E>,
    ) -> PublishFuture<'_, Result<(), Error>>
    where
        S: CanPublish,
        E: OutboxEvent + RoutedBy<R>,
    {
        let rows = encode_all(events, &self.metadata);
        self.insert(rows)
    }

    /// Records in this transaction that `consumer` handled the message `message_id` (the
    /// [inbox](crate::inbox)), and says whether that was recorded before.
    ///
    /// For messages that arrive from outside the outbox and may arrive more than once: a
    /// broker's redelivery, a webhook sent again. Call it first in the transaction that applies
    /// the message's effects; on [`Received::Duplicate`] skip them. The record commits with the
    /// effects or rolls back with them, so each message's effects happen once per consumer.
    /// Consumers are independent: each has its own record of a message id.
    ///
    /// On PostgreSQL, while another transaction that recorded the same message is open, this
    /// waits for it to end: then it is a duplicate if that one committed, and new if it rolled
    /// back. On SQLite transactions write one at a time anyway.
    ///
    /// Records older than the [retention](outbox_core::RelayConfig::with_retention) window are
    /// deleted by a relay's retention, or by [`Outbox::purge_inbox`]: keep the window longer
    /// than the senders redeliver.
    ///
    /// ```no_run
    /// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
    /// # use serde::{Deserialize, Serialize};
    /// # use uuid::Uuid;
    /// # #[derive(Serialize, Deserialize, OutboxEvent)]
    /// # #[outbox(aggregate_type = "subscription")]
    /// # struct PaymentSucceeded { #[outbox(aggregate_id)] subscription_id: Uuid }
    /// # #[subscriber(events = [PaymentSucceeded])]
    /// # struct Licensing;
    /// # impl Handle<PaymentSucceeded> for Licensing {
    /// #     async fn handle(&self, _: &PaymentSucceeded, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// # #[router(events = [PaymentSucceeded])]
    /// # struct App { licensing: Licensing }
    /// # #[tokio::main] async fn main() -> Result<(), outbox_sqlx::Error> {
    /// # let outbox: outbox_sqlx::Outbox<sqlx::Postgres, App> =
    /// #     outbox_sqlx::Outbox::new(sqlx::PgPool::connect_lazy("postgres://").unwrap());
    /// # let (webhook_id, subscription_id) = ("evt_1", Uuid::nil());
    /// // A payment provider's webhook, which it may send more than once.
    /// let mut tx = outbox.begin().await?;
    /// if tx.receive("payment-webhooks", webhook_id).await?.is_new() {
    ///     sqlx::query("UPDATE subscriptions SET paid = true WHERE id = $1")
    ///         .bind(subscription_id)
    ///         .execute(&mut *tx)
    ///         .await?;
    ///     tx.publish(&PaymentSucceeded { subscription_id }).await?;
    /// }
    /// tx.commit().await?; // the record, the update and the event, or none of them
    /// # Ok(()) }
    /// ```
    ///
    /// An empty or overlong consumer name (more than [`MAX_CONSUMER_LEN`] bytes, or holding a
    /// control character) or message id (more than [`MAX_MESSAGE_ID_LEN`] bytes, or holding a
    /// NUL) is an [`Error::InvalidInboxKey`]; nothing is recorded.
    ///
    /// [`MAX_CONSUMER_LEN`]: crate::inbox::MAX_CONSUMER_LEN
    /// [`MAX_MESSAGE_ID_LEN`]: crate::inbox::MAX_MESSAGE_ID_LEN
    /// [`Outbox::purge_inbox`]: crate::Outbox::purge_inbox
    pub async fn receive(&mut self, consumer: &str, message_id: &str) -> Result<Received, Error>
    where
        S: CanPublish,
    {
        crate::inbox::check(consumer, message_id)?;
        let connection = S::connection::<DB>(&mut self.inner);
        let new = DB::receive(connection, self.outbox.queries(), consumer, message_id).await?;
        Ok(if new {
            Received::New
        } else {
            Received::Duplicate
        })
    }

    /// Sets the metadata (causation and correlation ids, trace context) that
    /// [`publish`](Self::publish) and [`publish_all`](Self::publish_all) store with each event.
    pub fn set_metadata(&mut self, metadata: Metadata)
    where
        S: CanPublish,
    {
        self.metadata = metadata;
    }

    /// How many events this transaction published.
    pub fn published(&self) -> u64 {
        self.published
    }

    fn insert(&mut self, rows: Result<Vec<NewEvent>, Error>) -> PublishFuture<'_, Result<(), Error>>
    where
        S: CanPublish,
    {
        Box::pin(async move {
            let rows = rows?;
            if rows.is_empty() {
                return Ok(());
            }
            let connection = S::connection::<DB>(&mut self.inner);
            DB::insert(connection, self.outbox.queries(), &rows)
                .await
                .map_err(|error| DB::publish_error(error, rows.len()))?;
            self.published += rows.len() as u64;
            Ok(())
        })
    }
}

fn encode_all<'e, E: OutboxEvent>(
    events: impl IntoIterator<Item = &'e E>,
    metadata: &Metadata,
) -> Result<Vec<NewEvent>, Error> {
    #[cfg(feature = "opentelemetry")]
    let metadata = &metadata.clone().with_current_trace_context();
    events
        .into_iter()
        .map(|event| {
            Ok(NewEvent {
                aggregate_type: E::AGGREGATE_TYPE,
                aggregate_id: event.aggregate_id(),
                event_type: E::EVENT_TYPE,
                payload: encode(event, metadata)?,
                occurred_at: event.occurred_at(),
            })
        })
        .collect()
}

impl<DB: Backend, R> Deref for OutboxTx<'_, DB, R, Active> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.inner
    }
}

impl<DB: Backend, R> DerefMut for OutboxTx<'_, DB, R, Active> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.inner
    }
}

impl<DB: Backend, R, S: State> std::fmt::Debug for OutboxTx<'_, DB, R, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxTx")
            .field("state", &std::any::type_name::<S>())
            .field("published", &self.published)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, R: Send, E: OutboxEvent + RoutedBy<R>> Publish<E>
    for OutboxTx<'_, DB, R, Active>
{
    async fn publish(&mut self, event: &E) -> Result<(), PublishError> {
        OutboxTx::publish(self, event)
            .await
            .map_err(into_publish_error)
    }

    async fn publish_with(&mut self, event: &E, metadata: &Metadata) -> Result<(), PublishError> {
        OutboxTx::publish_with(self, event, metadata)
            .await
            .map_err(into_publish_error)
    }

    async fn publish_all<'e>(
        &mut self,
        events: impl IntoIterator<Item = &'e E> + Send,
    ) -> Result<(), PublishError>
    where
        E: 'e,
    {
        OutboxTx::publish_all(self, events)
            .await
            .map_err(into_publish_error)
    }
}

fn into_publish_error(error: Error) -> PublishError {
    match error {
        Error::Encode(error) => PublishError::Encode(error),
        other => PublishError::Store(Box::new(other)),
    }
}

/// Makes `publish` on a pool, a connection or a bare sqlx transaction a compile error that says
/// what to do instead. It has no other use; it comes with `use outbox_sqlx::prelude::*`.
pub trait PublishGuard {
    /// Never callable: `Self` does not implement [`Publish`].
    fn publish<'a, E: OutboxEvent>(
        &'a mut self,
        event: &'a E,
    ) -> PublishFuture<'a, Result<(), PublishError>>
    where
        Self: Publish<E>,
    {
        Box::pin(Publish::publish(self, event))
    }
}

impl<DB: Database> PublishGuard for Pool<DB> {}
impl<DB: Database> PublishGuard for Transaction<'_, DB> {}
#[cfg(feature = "postgres")]
impl PublishGuard for sqlx::PgConnection {}
#[cfg(feature = "sqlite")]
impl PublishGuard for sqlx::SqliteConnection {}
#[cfg(feature = "mysql")]
impl PublishGuard for sqlx::MySqlConnection {}
