//! The outbox handle: migrations, transactions, and the store the relay reads.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::backend::{Backend, PurgedUpTo, SubscriberStatus};
use crate::error::Error;
use crate::inbox::Received;
use crate::names::TableNames;
use crate::tx::OutboxTx;
use crate::views::{DeadLetterGroup, ListQuery, Listed, Overview, Page, Report};
use crate::wake::Wakeups;
use outbox_core::store::{
    Batch, ClaimFilter, ClaimLimit, ClaimToken, Outcomes, Purged, REGISTRATION_TTL, Recorded,
    Registry, Requeue, Status,
};
use outbox_core::{
    ConfigError, Delivery, HandlerError, Metadata, Relay, RelayConfig, Router, RunsOn, Store,
    StoreError,
};
use sqlx::{Pool, Transaction};
use uuid::Uuid;

/// The outbox of one database, for the application whose router is `R`: begins transactions
/// that can publish the events `R` routes, runs the migrations, and gives the relay its store.
///
/// Cheap to clone; clones share the pool and the in-process wake-up of the relay.
///
/// ```no_run
/// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
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
/// use outbox_sqlx::Outbox;
/// use sqlx::Postgres;
///
/// #[router(events = [BotInstalled])]
/// struct App {
///     licensing: Licensing,
/// }
///
/// # #[tokio::main] async fn main() -> Result<(), outbox_sqlx::Error> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
/// let outbox: Outbox<Postgres, App> = Outbox::new(pool);
/// outbox.migrate().await?;
/// # Ok(()) }
/// ```
pub struct Outbox<DB: Backend, R> {
    inner: Arc<Inner<DB>>,
    router: PhantomData<fn() -> R>,
}

struct Inner<DB: Backend> {
    pool: Pool<DB>,
    names: TableNames,
    queries: DB::Queries,
    /// Wakes relays after a commit that published events: at once in this process, by a
    /// coalesced NOTIFY in others.
    wakeups: Wakeups,
    /// Where the relays' purges go on from: past old events that deliveries still hold, so
    /// that each purge reads a batch, not those again. `None`: from the oldest.
    purged_up_to: Mutex<Option<PurgedUpTo>>,
}

impl<DB: Backend> Inner<DB> {
    /// Wakes the relays waiting for work if an operator `changed` anything (a requeue, a skip).
    async fn handed_back(&self, changed: bool) {
        if changed {
            self.wakeups.handed_back(&self.pool).await;
        }
    }
}

impl<DB: Backend, R> Clone for Outbox<DB, R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            router: PhantomData,
        }
    }
}

impl<DB: Backend, R> std::fmt::Debug for Outbox<DB, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("names", &self.inner.names)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, R> Outbox<DB, R> {
    /// The outbox in the default tables, `events.outbox` and its companions.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_names(pool, TableNames::default())
    }

    /// The outbox in the tables `names` gives.
    pub fn with_names(pool: Pool<DB>, names: TableNames) -> Self {
        Self {
            inner: Arc::new(Inner {
                queries: DB::queries(&names),
                wakeups: Wakeups::new(&names),
                purged_up_to: Mutex::new(None),
                pool,
                names,
            }),
            router: PhantomData,
        }
    }

    /// Creates or upgrades the outbox tables. Safe to call at every start, from several
    /// processes at once.
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate(&self.inner.pool, &self.inner.names).await
    }

    /// Begins a transaction on the outbox's pool. Run the domain change on it, publish the events
    /// the change causes, then commit: both are stored, or neither.
    pub async fn begin(&self) -> Result<OutboxTx<'static, DB, R>, Error> {
        let tx = self.inner.pool.begin().await?;
        Ok(self.wrap(tx))
    }

    /// Publishes on a transaction that already exists. To publish inside a transaction you only
    /// borrow, wrap a nested one: `outbox.wrap(tx.begin().await?)` (a savepoint in the outer
    /// transaction).
    pub fn wrap<'c>(&self, tx: Transaction<'c, DB>) -> OutboxTx<'c, DB, R> {
        OutboxTx::new(self.clone(), tx)
    }

    /// The store the relay claims events from.
    pub fn store(&self) -> SqlStore<DB> {
        SqlStore {
            inner: Arc::clone(&self.inner),
        }
    }

    /// A relay over this outbox, woken at once by commits made through this handle, and soon
    /// after by commits in other processes (see [`set_cross_process_wakeups`](Self::set_cross_process_wakeups)).
    ///
    /// # Connections
    ///
    /// A running relay ([`Relay::run`]) takes at most two of the pool's connections at a time,
    /// each for one statement or one short transaction: one claims the next batch (or renews
    /// its claim while handlers run) while the other records the last batch. It never holds a
    /// connection while handlers run. On PostgreSQL the claims run instead on one connection
    /// the outbox keeps for them, outside the pool (taken from it and detached, so the pool
    /// may open another; let go after 30 s unused): the claim's plan then survives from claim
    /// to claim. The outbox also keeps one connection of its own, outside the pool, to
    /// `LISTEN` for commits of other processes (none when
    /// [cross-process wake-ups](Self::set_cross_process_wakeups) are off), and briefly takes a
    /// pool connection to send `NOTIFY` after commits. A pool of one connection shared by the
    /// application, a relay and handlers works: they take turns. [`close`](Self::close) ends
    /// the listener and lets the claims' connection go.
    pub fn relay(
        &self,
        router: R,
        config: RelayConfig,
    ) -> Result<Relay<SqlStore<DB>, R>, ConfigError>
    where
        R: Router + RunsOn<DB>,
    {
        Relay::new(self.store(), router, config)
    }

    /// Deletes events published more than `older_than` ago, `batch_size` rows per statement (each
    /// its own short transaction), and returns how many went. Dead letters and events some
    /// subscriber has not received yet are never deleted.
    ///
    /// A relay can do the same as it runs: see
    /// [`RelayConfig::with_retention`](outbox_core::RelayConfig::with_retention).
    pub async fn purge_published(
        &self,
        older_than: std::time::Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        check_purge_batch_size(batch_size)?;
        let (mut total, mut after) = (0, None);
        loop {
            let step =
                DB::purge_published(self.pool(), self.queries(), older_than, batch_size, after)
                    .await?;
            total += step.deleted;
            match step.next {
                Some(next) => after = Some(next),
                None => return Ok(total),
            }
        }
    }

    /// Deletes the [inbox](crate::inbox) records older than `older_than`, `batch_size` at a
    /// time, and returns how many. A relay with
    /// [retention](outbox_core::RelayConfig::with_retention) does this as it runs; a service
    /// that only consumes (no relay) calls this now and then.
    pub async fn purge_inbox(
        &self,
        older_than: std::time::Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        check_purge_batch_size(batch_size)?;
        let mut total = 0;
        loop {
            let deleted =
                DB::purge_inbox(self.pool(), self.queries(), older_than, batch_size).await?;
            total += deleted;
            if deleted < u64::from(batch_size) {
                return Ok(total);
            }
        }
    }

    /// One page of the events or deliveries in one state, filtered, in (event id, subscriber)
    /// order: paginated in SQL, so listing 100 000 dead letters holds one page at a time.
    pub async fn list(&self, query: &ListQuery) -> Result<Vec<Listed>, Error> {
        Ok(DB::list(self.pool(), self.queries(), query).await?)
    }

    /// One page of [`list`](Self::list), and where the next one starts if there are more rows
    /// (one more row is read to know): what the tool and the console page through.
    pub async fn list_page(&self, query: &ListQuery) -> Result<Page, Error> {
        let limit = query.limit;
        let mut rows = self
            .list(&query.clone().limit(limit.saturating_add(1)))
            .await?;
        let more = rows.len() > usize::try_from(limit).unwrap_or(usize::MAX);
        rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        let next = rows.last().filter(|_| more).map(Listed::page_key);
        Ok(Page { rows, next })
    }

    /// How many events and deliveries are in each [`ListState`](crate::ListState), and what holds work back,
    /// by cause ([`HoldCause`](crate::HoldCause)): a parked event blocking its aggregate, a
    /// dead delivery blocking its key, and what waits behind each.
    pub async fn overview(&self) -> Result<Overview, Error> {
        Ok(DB::overview(self.pool(), self.queries()).await?)
    }

    /// The status, the overview and each subscriber's counts, read one after another: what
    /// `outbox status` shows.
    pub async fn report(&self) -> Result<Report, Error> {
        Ok(Report::new(
            self.status().await?,
            self.overview().await?,
            self.subscribers().await?,
        ))
    }

    /// How many events were published (handed to every subscriber, or skipped by an operator)
    /// within the last `window`: a rate, read by index. The console samples it for its chart.
    pub async fn published_within(&self, window: std::time::Duration) -> Result<u64, Error> {
        Ok(DB::published_within(self.pool(), self.queries(), window).await?)
    }

    /// The dead letters grouped by failure (subscriber and first line of the last error),
    /// largest groups first: what went wrong, once per cause.
    pub async fn dead_letter_groups(&self) -> Result<Vec<DeadLetterGroup>, Error> {
        Ok(DB::dead_letter_groups(self.pool(), self.queries()).await?)
    }

    /// What is left to deliver, how many dead letters wait for an operator, and what no
    /// running relay can route.
    pub async fn status(&self) -> Result<Status, Error> {
        Ok(status_of::<DB>(self.pool(), self.queries()).await?)
    }

    /// [`requeue`](Self::requeue), recorded with `reason` in the `<table>_requeues` table (what
    /// was named, how many rows went back, why) in the same transaction, when anything went
    /// back: what operators use (`outbox requeue --reason`, the console).
    pub async fn requeue_because(&self, which: &Requeue, reason: &str) -> Result<u64, Error> {
        let requeued =
            crate::backend::requeue::<DB>(self.pool(), self.queries(), which, Some(reason)).await?;
        self.inner.handed_back(requeued > 0).await;
        Ok(requeued)
    }

    /// The requeues made with a reason, newest first: at most `limit`, and with `before`
    /// (a [`RequeueRecord::id`](crate::RequeueRecord::id)) only those made before it.
    pub async fn requeues(
        &self,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Vec<crate::RequeueRecord>, Error> {
        Ok(DB::requeues(
            self.pool(),
            self.queries(),
            before.unwrap_or(i64::MAX),
            limit.max(1),
        )
        .await?)
    }

    /// Hands dead letters (and parked events) back to the relay; returns how many rows changed.
    /// Relays waiting for work take them at once: those of this process, and on PostgreSQL
    /// those of other processes (unless [cross-process wake-ups](Self::set_cross_process_wakeups)
    /// are off); elsewhere at their next poll.
    pub async fn requeue(&self, which: &Requeue) -> Result<u64, Error> {
        let requeued =
            crate::backend::requeue::<DB>(self.pool(), self.queries(), which, None).await?;
        self.inner.handed_back(requeued > 0).await;
        Ok(requeued)
    }

    /// Fences a handler's writes: locks the claim `token` (the one a delivery runs under,
    /// [`Delivery::claim_token`](outbox_core::Delivery::claim_token)) for the rest of the
    /// transaction of `conn`, and returns whether the claim is still live. While the lock is
    /// held the claim cannot expire, so its work cannot go to another relay: a handler that
    /// writes in that transaction only when this returns true writes only as the live owner of
    /// its delivery, even if its relay stalls past the lease in the handler. On PostgreSQL the
    /// lock also sets the transaction's `idle_in_transaction_session_timeout` to 2 s, so that a
    /// frozen process cannot hold the claim for long. On SQLite it takes the database's write
    /// lock for the rest of the transaction (SQLite has no finer lock), so keep that transaction
    /// short.
    ///
    /// ```no_run
    /// # use outbox_core::{Delivery, HandlerError};
    /// # #[allow(dead_code)]
    /// # async fn handle(outbox: &outbox_sqlx::Outbox<sqlx::Postgres, ()>, delivery: &Delivery<'_>)
    /// #     -> Result<(), HandlerError> {
    /// let mut tx = outbox.pool().begin().await?;
    /// if let Some(token) = delivery.claim_token() {
    ///     if !outbox.hold_claim(&mut *tx, token).await? {
    ///         // Another relay owns this delivery now: write nothing.
    ///         return Err(HandlerError::transient("the claim of this delivery was lost"));
    ///     }
    /// }
    /// sqlx::query("UPDATE licenses SET tier = 'pro' WHERE id = $1")
    ///     .bind(delivery.event().aggregate_id)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn hold_claim(
        &self,
        conn: &mut DB::Connection,
        token: ClaimToken,
    ) -> Result<bool, Error> {
        Ok(DB::hold_claim(conn, self.queries(), token).await?)
    }

    /// Runs a handler's effects exactly once: in one transaction on this outbox's database that
    /// also records the delivery in the [inbox](crate::inbox), fenced by the delivery's claim.
    ///
    /// For a subscriber whose effects live in the outbox's own database. The transaction
    ///
    /// 1. locks the claim the delivery runs under ([`hold_claim`](Self::hold_claim)); a claim
    ///    already lost is a transient error, and nothing is written;
    /// 2. records "`subscriber` handled event `id`" in the inbox; if a transaction that
    ///    committed recorded it before (a redelivery after a crash, a lost record), nothing is
    ///    written, `handler` is not called, and the delivery is done (`Ok`);
    /// 3. hands the transaction to `handler`, with [metadata](OutboxTx::set_metadata) that makes
    ///    the events it publishes follow-ups of the handled one ([`Metadata::follow_up`]: caused
    ///    by it, in its flow; change it with `set_metadata`);
    /// 4. commits the transaction `handler` gives back with `Ok`. An error (the handler's, or
    ///    the database's) rolls everything back: nothing happened, and the relay retries under
    ///    its policy.
    ///
    /// Commit, and the effects, the follow-up events and the inbox record are stored; anything
    /// else, and none of them is. Publishing a follow-up event needs the router `R` to route it,
    /// as everywhere; and `R` to run on `DB`: with `#[router(database = sqlx::Postgres)]`, a
    /// subscriber holding an outbox of another database does not compile. The price is a
    /// transaction per delivery.
    ///
    /// ```no_run
    /// # use outbox_core::{Delivery, Handle, HandlerError, OutboxEvent, router, subscriber};
    /// # use serde::{Deserialize, Serialize};
    /// # use uuid::Uuid;
    /// use outbox_sqlx::Outbox;
    /// use sqlx::Postgres;
    ///
    /// # #[derive(Serialize, Deserialize, OutboxEvent)]
    /// # #[outbox(aggregate_type = "subscription")]
    /// # struct PaymentSucceeded { #[outbox(aggregate_id)] subscription_id: Uuid }
    /// # #[derive(Serialize, Deserialize, OutboxEvent)]
    /// # #[outbox(aggregate_type = "subscription")]
    /// # struct AuditWritten { #[outbox(aggregate_id)] subscription_id: Uuid }
    /// # #[subscriber(events = [AuditWritten])]
    /// # struct Reports;
    /// # impl Handle<AuditWritten> for Reports {
    /// #     async fn handle(&self, _: &AuditWritten, _: &Delivery<'_>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// #[subscriber(events = [PaymentSucceeded])]
    /// struct Audit {
    ///     outbox: Outbox<Postgres, App>,
    /// }
    ///
    /// impl Handle<PaymentSucceeded> for Audit {
    ///     async fn handle(&self, event: &PaymentSucceeded, delivery: &Delivery<'_>)
    ///         -> Result<(), HandlerError> {
    ///         self.outbox
    ///             .handle_once(delivery, |mut tx| async move {
    ///                 // A plain insert: it happens once, however often the event is delivered.
    ///                 sqlx::query("INSERT INTO audit (subscription_id) VALUES ($1)")
    ///                     .bind(event.subscription_id)
    ///                     .execute(&mut *tx)
    ///                     .await?;
    ///                 tx.publish(&AuditWritten { subscription_id: event.subscription_id })
    ///                     .await?;
    ///                 Ok(tx) // committed by `handle_once`
    ///             })
    ///             .await
    ///     }
    /// }
    ///
    /// #[router(events = [PaymentSucceeded, AuditWritten], database = sqlx::Postgres)]
    /// struct App {
    ///     audit: Audit,
    ///     reports: Reports,
    /// }
    /// ```
    ///
    /// [`Metadata::follow_up`]: outbox_core::Metadata::follow_up
    pub async fn handle_once<F, Fut>(
        &self,
        delivery: &Delivery<'_>,
        handler: F,
    ) -> Result<(), HandlerError>
    where
        R: RunsOn<DB>,
        F: FnOnce(OutboxTx<'static, DB, R>) -> Fut + Send,
        Fut: Future<Output = Result<OutboxTx<'static, DB, R>, HandlerError>> + Send,
    {
        let mut tx = self.begin().await?;
        let event = delivery.event();
        let (consumer, message_id) = (delivery.subscriber(), event.id.to_string());
        let received = match delivery.claim_token() {
            // The claim's lock and the inbox record in one statement.
            Some(token) => {
                crate::inbox::check(consumer, &message_id)?;
                let held =
                    DB::hold_and_receive(&mut tx, self.queries(), token, consumer, &message_id)
                        .await?;
                match held {
                    None => {
                        return Err(HandlerError::transient(
                            "the claim of this delivery was lost (its lease expired and another \
                             relay may deliver it): nothing was written",
                        ));
                    }
                    Some(true) => Received::New,
                    Some(false) => Received::Duplicate,
                }
            }
            // A delivery that no claim fences (a consumer of a broker, a test kit delivery).
            None => tx.receive(consumer, &message_id).await?,
        };
        if received.is_duplicate() {
            tx.rollback().await?;
            tracing::debug!(
                event_id = event.id,
                subscriber = delivery.subscriber(),
                "outbox delivery handled before (the inbox has it): not handled again"
            );
            return Ok(());
        }
        tx.set_metadata(Metadata::follow_up(event.id, delivery.metadata()));
        handler(tx).await?.commit().await?;
        Ok(())
    }

    /// What each subscriber has left: pending and dead deliveries, and blocked aggregates.
    /// Subscribers with nothing left are not listed.
    pub async fn subscribers(&self) -> Result<Vec<SubscriberStatus>, Error> {
        Ok(DB::subscribers(self.pool(), self.queries()).await?)
    }

    /// Gives up `subscriber`'s undelivered delivery of event `event_id`, so that its later events
    /// flow again; with no subscriber, gives up a dead or parked event for every subscriber. The
    /// skip is recorded, with `reason`, the attempts and the last error, in the
    /// `<table>_skips` table. Returns false when there is nothing to skip: no such delivery (or
    /// dead or parked event), or a relay is working on it right now.
    pub async fn skip(
        &self,
        event_id: i64,
        subscriber: Option<&str>,
        reason: &str,
    ) -> Result<bool, Error> {
        let skipped = DB::skip(self.pool(), self.queries(), event_id, subscriber, reason).await?;
        // (What waited behind it is due now: relays take it as after a requeue.)
        self.inner.handed_back(skipped).await;
        Ok(skipped)
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.inner.pool
    }

    /// The table names.
    pub fn names(&self) -> &TableNames {
        &self.inner.names
    }

    pub(crate) fn queries(&self) -> &DB::Queries {
        &self.inner.queries
    }

    /// Whether commits wake relays of other processes too (default: on). Turn it off behind a
    /// connection pooler that does not support `LISTEN`; relays then find new events at their
    /// poll interval.
    pub fn set_cross_process_wakeups(&self, on: bool) {
        self.inner.wakeups.set_cross_process(on);
    }

    /// Ends what this outbox runs in the background: the connection on which its relays
    /// `LISTEN` for commits of other processes (a connection of its own, not one of the pool's)
    /// and the task that sends this process's `NOTIFY`; and closes the connection its relays
    /// claim on (PostgreSQL). Returns at once; the listener's connection closes within
    /// moments. Dropping the last clone of an outbox does the same.
    ///
    /// The pool is the application's and stays open: close it with `pool.close()` when nothing
    /// else uses it. Relays of this outbox still find new events by polling.
    pub fn close(&self) {
        self.inner.wakeups.close();
        DB::close(&self.inner.queries);
    }

    pub(crate) fn wake_relay(&self) {
        self.inner.wakeups.committed(&self.inner.pool);
    }
}

/// The relay's [`Store`] over an [`Outbox`]'s tables.
pub struct SqlStore<DB: Backend> {
    inner: Arc<Inner<DB>>,
}

impl<DB: Backend> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<DB: Backend> std::fmt::Debug for SqlStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("names", &self.inner.names)
            .finish_non_exhaustive()
    }
}

/// A store error, saying whether it was one connection that broke (reset, closed, or ended by
/// the server: another connection may work at once) rather than the store being unreachable
/// (refused, timed out, starting up, no connection to be had: worth backing off).
pub(crate) fn store_error(error: sqlx::Error) -> StoreError {
    use std::io::ErrorKind;
    let lost = match &error {
        sqlx::Error::Io(io) => matches!(
            io.kind(),
            ErrorKind::BrokenPipe
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::NotConnected
                | ErrorKind::UnexpectedEof
        ),
        // admin_shutdown (pg_terminate_backend), idle_in_transaction_session_timeout, and the
        // connection exceptions of class 08 (but not 08001/08004: a connection refused).
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            matches!(
                code.as_ref(),
                "57P01" | "25P03" | "08000" | "08003" | "08006"
            )
        }),
        _ => false,
    };
    if lost {
        StoreError::connection_lost(error)
    } else {
        StoreError::new(error)
    }
}

/// The status with what no live relay routes (when some relay is live).
async fn status_of<DB: Backend>(
    pool: &Pool<DB>,
    queries: &DB::Queries,
) -> Result<Status, sqlx::Error> {
    let mut status = DB::status(pool, queries).await?;
    let live = DB::live_relays(pool, queries, REGISTRATION_TTL).await?;
    status.live_relays = live.relays.len() as u64;
    if status.live_relays > 0 {
        let types = live.event_types().into_iter().collect();
        let subscribers = live.subscribers().into_iter().collect();
        let (events, deliveries, oldest) =
            DB::unroutable(pool, queries, types, subscribers).await?;
        status.unroutable_events = events;
        status.unroutable_deliveries = deliveries;
        status.oldest_unroutable_age = oldest;
    }
    Ok(status)
}

impl<DB: Backend> Store for SqlStore<DB> {
    async fn claim(
        &self,
        limit: ClaimLimit,
        lease: std::time::Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, StoreError> {
        DB::claim(&self.inner.pool, &self.inner.queries, limit, lease, filter)
            .await
            .map_err(store_error)
    }

    async fn register(
        &self,
        relay: Uuid,
        routing: &str,
        ttl: std::time::Duration,
    ) -> Result<Registry, StoreError> {
        DB::register(&self.inner.pool, &self.inner.queries, relay, routing, ttl)
            .await
            .map_err(store_error)
    }

    async fn unregister(&self, relay: Uuid) -> Result<(), StoreError> {
        DB::unregister(&self.inner.pool, &self.inner.queries, relay)
            .await
            .map_err(store_error)
    }

    async fn renew(
        &self,
        token: ClaimToken,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        DB::renew(&self.inner.pool, &self.inner.queries, token, lease)
            .await
            .map_err(store_error)
    }

    async fn record(&self, token: ClaimToken, outcomes: &Outcomes) -> Result<Recorded, StoreError> {
        DB::record(
            &self.inner.pool,
            &self.inner.queries,
            token,
            outcomes,
            false,
        )
        .await
        .map_err(store_error)
    }

    async fn record_part(
        &self,
        token: ClaimToken,
        outcomes: &Outcomes,
    ) -> Result<Recorded, StoreError> {
        DB::record(&self.inner.pool, &self.inner.queries, token, outcomes, true)
            .await
            .map_err(store_error)
    }

    fn records_parts(&self) -> bool {
        true
    }

    fn claims_take_over(&self) -> bool {
        DB::CLAIMS_TAKE_OVER
    }

    async fn requeue(&self, which: &Requeue) -> Result<u64, StoreError> {
        let requeued =
            crate::backend::requeue::<DB>(&self.inner.pool, &self.inner.queries, which, None)
                .await
                .map_err(store_error)?;
        self.inner.handed_back(requeued > 0).await;
        Ok(requeued)
    }

    async fn status(&self) -> Result<Status, StoreError> {
        status_of::<DB>(&self.inner.pool, &self.inner.queries)
            .await
            .map_err(store_error)
    }

    async fn purge_published(
        &self,
        older_than: std::time::Duration,
        limit: u32,
    ) -> Result<Purged, StoreError> {
        let after = *lock(&self.inner.purged_up_to);
        let step = DB::purge_published(
            &self.inner.pool,
            &self.inner.queries,
            older_than,
            limit,
            after,
        )
        .await
        .map_err(store_error)?;
        // Purges running at once may set this in either order: at worst a batch is looked at
        // twice; the next round, from the oldest, finds whatever one of them passed.
        *lock(&self.inner.purged_up_to) = step.next;
        // The inbox's old records go with them, a batch per call as well.
        let inbox = DB::purge_inbox(&self.inner.pool, &self.inner.queries, older_than, limit)
            .await
            .map_err(store_error)?;
        Ok(Purged::new(
            step.deleted + inbox,
            step.next.is_some() || inbox >= u64::from(limit),
        ))
    }

    async fn notified(&self) {
        self.inner.wakeups.notified(&self.inner.pool).await;
    }
}

/// A purge deletes at least one row per statement.
fn check_purge_batch_size(batch_size: u32) -> Result<(), ConfigError> {
    if batch_size == 0 {
        return Err(ConfigError::InvalidSetting {
            setting: "purge batch size",
            reason: "must be at least 1".to_owned(),
        });
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
