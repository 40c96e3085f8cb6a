//! The database-specific half of the stores: SQL and how to run it.

use std::future::Future;
use std::time::Duration;

use outbox_core::store::{Claim, Outcomes, Requeue};
use sqlx::Pool;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::error::Error;
use crate::names::TableNames;

/// A database the outbox can live in. Sealed: implemented for `sqlx::Postgres` (feature
/// `postgres`) and `sqlx::Sqlite` (feature `sqlite`).
pub trait Backend: sqlx::Database + sealed::Sealed {
    /// The SQL for one set of tables, built once from the validated names.
    #[doc(hidden)]
    type Queries: Send + Sync + 'static;

    #[doc(hidden)]
    fn queries(names: &TableNames) -> Self::Queries;

    #[doc(hidden)]
    fn migrate(
        pool: &Pool<Self>,
        names: &TableNames,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    #[doc(hidden)]
    fn insert(
        conn: &mut Self::Connection,
        queries: &Self::Queries,
        events: &[NewEvent],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    #[doc(hidden)]
    fn claim(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Claim>, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn record(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        outcomes: &Outcomes,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    #[doc(hidden)]
    fn purge_published(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        older_than: Duration,
        batch_size: u32,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn dead_letters(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<Vec<crate::DeadLetter>, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn status(
        pool: &Pool<Self>,
        queries: &Self::Queries,
    ) -> impl Future<Output = Result<crate::Status, sqlx::Error>> + Send;

    /// Sends the wake-up hint to relays of other processes, marked with `sender`.
    #[doc(hidden)]
    fn notify(
        pool: &Pool<Self>,
        channel: &str,
        sender: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Listens for wake-up hints and passes those not marked with `own` to `wake`, until `wake`
    /// is gone.
    #[doc(hidden)]
    fn listen(
        pool: Pool<Self>,
        channel: String,
        own: String,
        wake: std::sync::Weak<tokio::sync::Notify>,
    ) -> impl Future<Output = ()> + Send + 'static;

    #[doc(hidden)]
    fn requeue(
        pool: &Pool<Self>,
        queries: &Self::Queries,
        which: &Requeue,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// An encoded event on its way into the store.
#[doc(hidden)]
#[derive(Debug)]
pub struct NewEvent {
    pub(crate) aggregate_type: &'static str,
    pub(crate) aggregate_id: Uuid,
    pub(crate) event_type: &'static str,
    pub(crate) payload: String,
    pub(crate) occurred_at: Option<OffsetDateTime>,
}

pub(crate) mod sealed {
    pub trait Sealed {}
}
