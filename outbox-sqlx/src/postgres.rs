//! The PostgreSQL backend.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::time::Duration;

use outbox_core::StoredEvent;
use outbox_core::store::{
    Batch, Claim, ClaimFilter, ClaimLimit, ClaimToken, DeliveryOutcome, DeliveryRecord,
    EventOutcome, Outcomes, REGISTRATION_TTL, Recorded, Registry, Status,
};
use std::sync::{Mutex, PoisonError, Weak};

use sqlx::postgres::{PgListener, PgPoolOptions, PgRow};
use sqlx::{
    Connection, Executor, PgConnection, PgExecutor, PgPool, Postgres, Row, SqlStr, Transaction,
};
use time::OffsetDateTime;
use tokio::sync::{Notify, watch};
use uuid::Uuid;

use crate::backend::{
    Backend, MIN_SHARE, Migration, Named, NewEvent, PurgeStep, PurgedUpTo, apply_migrations,
    hold_after, registry_of, row_count, sealed, seconds, sql, subscribers_query,
};
use crate::error::Error;
use crate::names::TableNames;
use crate::views::{Dialect, dead_letter_groups_query, list_query, overview_query, requeue_record};

impl sealed::Sealed for Postgres {}

/// The migrations, in order; templates for [`TableNames::render`].
const MIGRATIONS: &[Migration] = &[
    (
        1,
        "events and per-subscriber deliveries",
        include_str!("../migrations/postgres/0001_events_and_per_subscriber_deliveries.sql"),
    ),
    (
        2,
        "a record of skipped deliveries",
        include_str!("../migrations/postgres/0002_a_record_of_skipped_deliveries.sql"),
    ),
    (
        3,
        "an index of deliveries by event, for the foreign key",
        include_str!("../migrations/postgres/0003_an_index_of_deliveries_by_event.sql"),
    ),
    (
        4,
        "claims remember the aggregates of their events, uncompressed",
        include_str!("../migrations/postgres/0004_claims_remember_the_aggregates_of_their.sql"),
    ),
    (
        5,
        "fenced claims, events set aside behind a stuck aggregate, the aggregate type in every key",
        include_str!("../migrations/postgres/0005_fenced_claims_events_set_aside_behind.sql"),
    ),
    (
        6,
        "deliveries behind the head of their key wait without a due time",
        include_str!("../migrations/postgres/0006_deliveries_behind_the_head_of_their.sql"),
    ),
    (
        7,
        "retention reads old published events by when they were published",
        include_str!("../migrations/postgres/0007_retention_reads_old_published_events_by.sql"),
    ),
    (
        8,
        "an inbox of the messages consumers handled",
        include_str!("../migrations/postgres/0008_an_inbox_of_handled_messages.sql"),
    ),
    (
        9,
        "a registry of live relays and what their builds route",
        include_str!("../migrations/postgres/0009_a_registry_of_live_relays.sql"),
    ),
    (
        10,
        "a record of requeues made with a reason",
        include_str!("../migrations/postgres/0010_a_record_of_requeues.sql"),
    ),
    (
        11,
        "the relay scans pending events from a floor",
        include_str!("../migrations/postgres/0011_the_relay_scans_from_a_floor.sql"),
    ),
    (
        12,
        "holds remember how many events their claim listed",
        include_str!("../migrations/postgres/0012_holds_remember_how_many_events_their_claim.sql"),
    ),
    (
        13,
        "a handler holds its claim by index",
        include_str!("../migrations/postgres/0013_a_handler_holds_its_claim_by_index.sql"),
    ),
    (
        14,
        "records of parts of claims note what they took out",
        include_str!("../migrations/postgres/0014_records_of_parts_of_claims_note_what.sql"),
    ),
];

/// The SQL of one set of tables.
#[doc(hidden)]
#[derive(Debug)]
pub struct PgQueries {
    lock_namespace: i32,
    /// The tables' names, for the work on partitions (`crate::partitions`).
    names: TableNames,
    /// No claim with a lower id is live: the claim reads the claims table from here, by index
    /// (rows deleted below it may be kept for a long time by a session holding an old
    /// snapshot). Claims are taken one at a time and their ids only grow, so the lowest live
    /// claim one claim saw is a bound for every later claim; each claim returns the new one.
    claims_floor: AtomicI64,
    /// Where the claim's scan of pending events starts.
    events_floor: Mutex<EventFloor>,
    /// The ids whose events the purges of this round leave to their partitions
    /// (`crate::partitions::Maintained::whole`), set when a round starts from the oldest.
    purge_whole: Mutex<(i64, i64)>,
    /// The connection claims run on (see [`Claimer`]).
    claimer: Claimer,
    /// Registers a relay (see [`Backend::register`]).
    register: SqlStr,
    unregister: SqlStr,
    /// The live relays' routing.
    live_relays: SqlStr,
    /// Pending events and deliveries of names no live relay routes.
    unroutable: SqlStr,
    /// Begins a claim (see [`claim_begin`]).
    claim_begin: SqlStr,
    /// Begins an operator's action that can release held events: it takes the claim lock, so
    /// that no claim sets events aside on a snapshot older than the action (and reads by
    /// index, see [`BY_INDEX`]).
    locked_begin: SqlStr,
    insert_one: SqlStr,
    insert: SqlStr,
    claim: SqlStr,
    renew: SqlStr,
    hold_claim: SqlStr,
    receive: SqlStr,
    hold_and_receive: SqlStr,
    purge_inbox: SqlStr,
    /// `record` when every claimed event was simply published: the common case, made cheap.
    record_published: SqlStr,
    record: SqlStr,
    /// `record_published` and `record` of part of a claim: the claim stays live for the events
    /// the record does not name ($2, or $20 for `record_part`).
    record_published_part: SqlStr,
    record_part: SqlStr,
    requeue_events: SqlStr,
    requeue_subscriber: SqlStr,
    /// The dead events whose error's first line is $1.
    dead_events_failing: SqlStr,
    record_requeue: SqlStr,
    requeues: SqlStr,
    purge_published: SqlStr,
    status: SqlStr,
    /// Begins a record that writes deliveries (see `lock_keys`).
    record_begin: SqlStr,
    /// Begins every other transaction that reads the tables: a record that writes no
    /// deliveries, a purge's step, the status, the operator's views... (see [`BY_INDEX`]).
    by_index_begin: SqlStr,
    /// Locks (subscriber, aggregate) keys of deliveries, in one order.
    lock_keys: SqlStr,
    /// Locks the key of one delivery.
    lock_delivery_key: SqlStr,
    subscribers: SqlStr,
    dead_letter_groups: SqlStr,
    /// One page of each state, in the order of `ListState::ALL`.
    list: [SqlStr; 8],
    overview: SqlStr,
    /// Events published within a window (`published_idx`).
    published_within: SqlStr,
    skip_delivery: SqlStr,
    skip_event: SqlStr,
}

impl PgQueries {
    /// The floor of pending events and the count of releases it holds for (see
    /// [`EventFloor`]): where claims, the status and the count of unroutable events start
    /// reading pending events.
    fn scan_from(&self) -> (i64, i64) {
        self.events_floor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .scan_from()
    }
}

/// The connection an outbox's claims run on, kept between claims (taken from the pool and
/// detached: it does not take one of the pool's connections away from the application).
///
/// The claim is one large statement, prepared once per connection; its generic plan is made
/// again on a connection whenever a table it reads changes its statistics (a vacuum, an
/// analyze). Run on the pool's connections, taken in turn, a claim found after every such
/// change a connection whose plan was gone, each of them once: on a table partitioned by id,
/// where planning the claim takes 15 ms or more, that made 1164 plans in 8 minutes of the
/// pressure benchmark (issue 16, point 6; 147 on one connection). Claims run one at a time
/// anyway (the claim lock): the connection is taken in turn.
///
/// A connection unused for [`CLAIMER_IDLE`] is let go and another taken from the pool
/// (which checks it), so that a relay at rest does not claim on a connection the server or a
/// proxy closed meanwhile; a claim that fails lets its connection go too, and so does
/// [`Outbox::close`](crate::Outbox::close).
#[derive(Debug, Default)]
struct Claimer {
    kept: tokio::sync::Mutex<Option<Kept>>,
    closed: std::sync::atomic::AtomicBool,
}

/// The claims' connection between claims.
#[derive(Debug)]
struct Kept {
    conn: PgConnection,
    /// When its last claim ended.
    used: std::time::Instant,
    /// What the claim's plan on it was made for: [`TableSizes`] when it was made.
    planned: Option<TableSizes>,
}

/// How long the claims' connection may sit unused before it is let go.
const CLAIMER_IDLE: Duration = Duration::from_secs(30);

type ClaimerSlot<'a> = tokio::sync::MutexGuard<'a, Option<Kept>>;

/// The sizes in bytes of the deliveries table and of the events table (its own: 0 when it is
/// partitioned) as a claim saw them.
///
/// The claim's generic plan is made at its first run on a connection and kept until a table
/// it reads changes its statistics (a vacuum, an analyze, which may be rare or never: autovacuum
/// is a setting). Made while a table was empty, it believes every part of the claim holds a
/// row or two and picks among the indexes blindly: a key's deliveries read through the event-id
/// index (every later delivery of every key, at each probe). So each claim also returns the
/// sizes, and the claimer has the plan made again by the next claim (the connection's
/// statements dropped) once a table has more than doubled, and grown by [`REPLAN_GROWTH`],
/// since it was made: a few plans while a table fills, none once its size settles; one claim
/// at most runs an outgrown plan, on what the tables gained since the claim before. (Planned at
/// each run instead, a claim cost 2.5 ms more, and the relay's latency at 10 events/s went
/// from 2.4 to 4.8 ms, p50; the sizes read in a statement of their own before each claim cost
/// it about 0.2 ms, 2.1 against 1.9.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TableSizes([i64; 2]);

/// The least growth of a table, in bytes, that has the claim's plan made again.
const REPLAN_GROWTH: i64 = 8 * 8192;

impl TableSizes {
    /// Whether a table has grown past what a plan made at `self` was made for.
    fn outgrown_by(self, now: TableSizes) -> bool {
        self.0
            .iter()
            .zip(now.0)
            .any(|(&then, now)| now > then.saturating_mul(2).saturating_add(REPLAN_GROWTH))
    }
}

impl Claimer {
    /// The claims' connection, out of its slot while it is used: a claim cancelled half way
    /// drops it (the server rolls its transaction back) rather than leave it mid-statement.
    /// Put back with [`Claimer::keep`] once it did its work; one claim at a time holds the
    /// slot.
    ///
    /// Also returns what the claim's plan on it was made for (`None`: a plan is made at its
    /// next claim).
    async fn take(
        &self,
        pool: &PgPool,
    ) -> Result<(ClaimerSlot<'_>, PgConnection, Option<TableSizes>), sqlx::Error> {
        let mut slot = self.kept.lock().await;
        let (conn, planned) = match slot.take() {
            Some(kept) if kept.used.elapsed() < CLAIMER_IDLE && !pool.is_closed() => {
                (kept.conn, kept.planned)
            }
            _ => (pool.acquire().await?.detach(), None),
        };
        Ok((slot, conn, planned))
    }

    /// Puts the connection back after a claim that saw the tables at `sizes`, run on a plan
    /// made for `planned` (`None`: made by this claim). A plan that a table outgrew is dropped,
    /// to be made again by the next claim; if that fails, the connection is let go instead (the
    /// claim is committed: its batch is the relay's either way).
    async fn keep(
        &self,
        mut slot: ClaimerSlot<'_>,
        mut conn: PgConnection,
        planned: Option<TableSizes>,
        sizes: Option<TableSizes>,
    ) {
        let planned = match (planned, sizes) {
            (Some(planned), Some(sizes)) if planned.outgrown_by(sizes) => {
                if conn.clear_cached_statements().await.is_err() {
                    return;
                }
                None
            }
            (None, sizes) => sizes,
            (planned, _) => planned,
        };
        if !self.closed.load(Relaxed) {
            *slot = Some(Kept {
                conn,
                used: std::time::Instant::now(),
                planned,
            });
        }
    }

    /// Lets the kept connection go, and every later one after its claim.
    fn close(&self) {
        self.closed.store(true, Relaxed);
        if let Ok(mut slot) = self.kept.try_lock() {
            slot.take();
        }
    }
}

/// The statements that begin a claim's transaction, sent in one round trip.
///
/// - READ COMMITTED whatever the database's default: the claim statement then sees what
///   committed before it started, after the claim lock was granted (under REPEATABLE READ it
///   would read a snapshot taken before it waited for the lock).
/// - Timeouts, so that a relay frozen while it holds the claim lock (or stuck in a slow
///   statement) cannot stop the other relays for long: the server ends its session.
/// - No JIT: the claim's generic plan is estimated costly enough that the server would compile
///   it on every execution, which took 50 ms of a claim that runs in about 2 (measured). No
///   merge joins: they sorted a batch by aggregate type with the collation.
/// - A generic plan (made at the first claim on a connection, kept), without sequential scans:
///   the claim reads every table by index. A plan made while a table or partition was empty
///   (a new database, a vacuum) believes every part of the claim holds a row or two, and so
///   would scan that partition whole once events filled it, and read a key's deliveries
///   through `deliveries_event_idx` (every later delivery, at each probe) once deliveries
///   waited: the claimer has it made again when a table outgrows it ([`TableSizes`]). And the
///   claim's parts meet without joins, whatever the plan (a plan made on empty tables joined
///   them in nested loops, a batch times a batch: 3.5 s for 2 000 events behind 20 waiting
///   keys, past the claim's 10 s timeout at every try with a few thousand more): lookups in
///   objects keyed by aggregate or by event, hash lookups (`NOT IN`), index probes (scalar and
///   `LATERAL` subqueries, `= ANY`).
/// - No bitmap scans: a key's rows are read in the order of `deliveries_head_idx`, and only as
///   far as the claim needs them (its last row, the head and a share behind it). A plan that
///   believes a key holds a row or two (the table grew since it was last analyzed, as it does
///   in an outage) found a bitmap of the key's rows and a sort as cheap, and so read every row
///   of a key at each probe: claims of 0.3 to 0.6 s, for tens of seconds, once a few hundred
///   deliveries waited per key
///   (`a_claim_reads_a_batch_whatever_waits_in_the_keys_of_its_work`). The claim's other
///   reads are index lookups, which plain index scans serve as well.
/// - The advisory lock that admits one claimer at a time (its one-key form never collides with
///   the two-key locks of publishing and migrating); asynchronous commit (a claim lost in a
///   crash only lets its events be claimed again).
fn claim_begin(lock: i64) -> String {
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';
SET LOCAL statement_timeout = '{STATEMENT_TIMEOUT}';
SET LOCAL idle_in_transaction_session_timeout = '{IDLE_TIMEOUT}';
SET LOCAL enable_mergejoin = off;
SET LOCAL enable_bitmapscan = off;
{BY_INDEX};
SELECT set_config('synchronous_commit', 'off', true),
       set_config('plan_cache_mode', 'force_generic_plan', true),
       pg_advisory_xact_lock({lock})"
    )
}

/// The planner settings of the claim's transaction ([`claim_begin`], which says why there) and
/// of every other transaction this backend begins to read its tables: no sequential scans,
/// and no JIT.
///
/// A statement prepared once per pooled connection keeps its generic plan until a table it
/// reads changes (a vacuum, an analyze), and a plan made while a table or partition was empty,
/// as a vacuum leaves it, would scan it whole at every run once rows filled it. So:
///
/// - The claim keeps its plan until a table outgrows it ([`claim_begin`] says why).
/// - What the relay runs at every batch or status interval (records, a purge's steps, the
///   status, the count of what no live relay routes) keeps its plan, and reads by index: a
///   record the events it names, a purge the old published events, the status and the count
///   the partial indexes of what is not published (each statement's shape leaves no other
///   path; a test per statement plans it while a partition is empty, then fills it).
/// - Everything else (a lease's renewal, a relay's registration, the inbox's purge, the
///   operator's views and actions) is planned at each run (`persistent(false)`), for the sizes
///   the tables have then, and without sequential scans too: a table whose columns were never
///   analyzed gives a range a third of its rows, and a scan of it whole looks right.
/// - In the user's transaction, where a setting would outlive the statement, a handler's hold
///   of its claim (alone or with the inbox's record) calls a function (migration 13) whose own
///   settings turn sequential scans off while it looks the claim up: planned at each run, the
///   hold cost a round trip and a plan per delivery, and `Outbox::handle_once` drained 0.30 to
///   0.34 of the idempotent insert's rate against 0.54 (bench (h)).
///
/// No JIT: a scan with no other path is costed, with sequential scans off, so high that the
/// server would compile the statement at every execution (the status then took 5 s).
const BY_INDEX: &str = "SET LOCAL enable_seqscan = off; SET LOCAL jit = off";

/// The most keys a record locks one by one; a record of more takes the lock of all keys alone.
///
/// Records that write deliveries of the same key take turns (`lock_keys`). The server's lock
/// table holds `max_locks_per_transaction` (64 by default) times `max_connections` locks for
/// all sessions together, and a record of 20 000 keys (a batch failing for five subscribers)
/// ran out of it at every try. A record of more keys than this holds the lock of all keys
/// alone, and waits for the records of fewer, which hold it shared beside their keys' locks.
///
/// Relays of builds before this lock existed take only their keys' locks: while one of them is
/// live in the registry (a rolling deploy), a record of many keys takes each key's lock as
/// they do, so that theirs and it still take turns (and may run out of locks as they would).
const MAX_KEY_LOCKS: usize = 1000;

/// How long a claimer waits for the claim lock before it gives up and tries again.
const LOCK_TIMEOUT: &str = "3s";
/// The longest a claim statement may run.
const STATEMENT_TIMEOUT: &str = "10s";
/// How long a relay may sit in its claim transaction without sending anything (frozen, say)
/// before the server ends its session and so releases the claim lock.
const IDLE_TIMEOUT: &str = "2s";

/// Where a claim's scan of pending events starts: a floor below which no event is pending, nor
/// can become pending again unannounced.
///
/// A session that holds an old snapshot (idle in a transaction, a long report) keeps the index
/// entries of every event published since: a scan from the lowest id reads them all, on every
/// claim. The floor follows the relay instead. Each claim reports a bound: the lowest id that
/// is pending and unclaimed, in a live claim, parked or held by a claim (or, when nothing is,
/// the next id), and its snapshot's `xmax`. A bound is not a floor yet: a transaction running
/// then may commit an event below it (ids are drawn before commit; the id's default, since
/// migration 11, takes the transaction id first, so that it counts as running). The bound becomes the
/// floor at a later claim whose snapshot's `xmin` has passed that `xmax` (every such
/// transaction has ended) and whose scan, still from the old floor, saw what they committed:
/// the floor is the lower of the bound and that claim's own bound. (The snapshots' `xmin` is
/// the server's: a long transaction in another database of the server holds the floor where it
/// is until it ends, and the scan reads from there meanwhile, as without a floor.)
///
/// Events below it come back only announced: an update that puts a dead event, or an event set
/// aside behind one, back among the pending (a requeue, a skip, by any code) moves the
/// `<table>_released` sequence from a trigger; a claim that sees it move scans from the lowest
/// id, and the floor starts again. (Dead events, and events set aside
/// behind them, are not counted in bounds: a dead letter would otherwise pin the floor until
/// an operator came.)
#[derive(Debug, Default)]
struct EventFloor {
    floor: i64,
    /// `<table>_released` when the floor was set.
    released: i64,
    /// Claims' bounds with their snapshots' `xmax`, oldest first: a busy server always runs
    /// some transaction, so the bound that qualifies is seldom the last one.
    bounds: VecDeque<(i64, u64)>,
}

/// How many bounds the floor keeps waiting (older ones are dropped: the floor only moves later).
const FLOOR_BOUNDS: usize = 256;

impl EventFloor {
    /// The floor and the count of releases it holds for: the claim's `$7` and `$8`.
    fn scan_from(&self) -> (i64, i64) {
        (self.floor, self.released)
    }

    /// What a committed claim saw: the releases count, its bound, its snapshot's `xmin` and
    /// `xmax`.
    fn advance(&mut self, released: i64, bound: Option<i64>, xmin: u64, xmax: u64) {
        if released != self.released {
            // Events were put back: this claim scanned from the start, and the floor starts
            // again from its bound.
            *self = Self {
                released,
                ..Self::default()
            };
        } else if let Some(qualified) = self.bounds.iter().rposition(|&(_, taken)| xmin >= taken) {
            // Every transaction running when that bound was taken has ended before this
            // claim's snapshot, and this claim scanned from the old floor: what they committed
            // below the bound is in this claim's bound.
            let (earlier, _) = self.bounds[qualified];
            self.bounds.drain(..=qualified);
            let floor = bound.map_or(earlier, |bound| bound.min(earlier));
            self.floor = self.floor.max(floor);
        }
        if let Some(bound) = bound {
            if self.bounds.len() == FLOOR_BOUNDS {
                self.bounds.pop_front();
            }
            self.bounds.push_back((bound, xmax));
        }
    }
}

/// The id a scan of pending events starts at: the floor `$floor` if the events put back below
/// floors are still `$released` (see [`EventFloor`]), else the start. A scalar subquery.
fn from_floor(released: &str, floor: u8, put_back: u8) -> String {
    format!(
        "(SELECT CASE WHEN (CASE WHEN r.is_called THEN r.last_value ELSE 0 END) = ${put_back}::int8
                      THEN ${floor}::int8 ELSE 0 END
          FROM {released} AS r)"
    )
}

/// The first line of the text column `c`, as failure groups compare errors.
fn first_line(c: &str) -> String {
    format!("split_part(coalesce({c}, ''), E'\\n', 1)")
}

impl Backend for Postgres {
    type Queries = PgQueries;

    const CLAIMS_TAKE_OVER: bool = true;

    fn close(queries: &PgQueries) {
        queries.claimer.close();
    }

    fn queries(names: &TableNames) -> PgQueries {
        let outbox = names.qualified("");
        let deliveries = names.qualified("_deliveries");
        let claims = names.qualified("_claims");
        let holds = names.qualified("_holds");
        let claim_parts = names.qualified("_claim_parts");
        let skips = names.qualified("_skips");
        let inbox = names.qualified("_inbox");
        let relays = names.qualified("_relays");
        let requeues = names.qualified("_requeues");
        let released = names.qualified("_released");
        // The function a handler's hold of its claim calls (migration 13).
        let hold = names.qualified("_hold_claim");
        // Where the status and the count of unroutable events read pending events from: the
        // claim's floor (`EventFloor`), bound as their first and last two parameters.
        let status_floor = from_floor(&released, 1, 2);
        let unroutable_floor = from_floor(&released, 3, 4);
        let dialect = Dialect {
            outbox: &outbox,
            unpublished: format!("{outbox} AS o"),
            deliveries: &deliveries,
            skips: &skips,
            // (Less what records of parts took out of the claims: `claim_parts`.)
            claimed_event: format!(
                "o.id IN (SELECT e.id FROM {claims} AS c CROSS JOIN LATERAL unnest(c.event_ids) \
                 AS e(id) WHERE (c.id, e.id) NOT IN \
                 (SELECT p.claim_id, unnest(p.event_ids) FROM {claim_parts} AS p))"
            ),
            payload: "coalesce(o.payload_text, o.payload::text)",
            param: |n, ty| format!("${n}::{ty}"),
            params: "",
        };
        let lock = (i64::from(names.lock_namespace()) << 1) | 1;
        // Writers of a (subscriber, aggregate) key's deliveries take a two-key lock in their
        // own namespace (publishers lock aggregates under the table's namespace itself).
        let keys_lock = !names.lock_namespace();
        // And, before those, the lock of all the keys of these tables (`lock_keys`): one-key,
        // beyond the range of the one-key locks of claims and partition workers (twice a
        // namespace, and one more).
        let all_keys_lock = (i64::from(names.lock_namespace()) << 1) + (1 << 40);
        let registration_ttl = REGISTRATION_TTL.as_secs();
        // The columns the relay reads of a claimed event, in `claim_from_row`'s order after the
        // token: id, aggregate_type, aggregate_id, event_type, payload, occurred_at. The time is
        // read as microseconds since the epoch (NULL when not finite): sqlx's decoder panics
        // on a timestamp out of its range, which other SQL may have written.
        let event_columns = "o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                             coalesce(o.payload_text, o.payload::text) AS payload, \
                             CASE WHEN isfinite(o.occurred_at) \
                             THEN (extract(epoch FROM o.occurred_at) * 1000000)::int8 END \
                             AS occurred_at";
        // The record's first step: the claim, if it is still live (nothing else happens
        // otherwise), ended, or for a record of part of it, shrunk to the events the record
        // does not name (`ids`). (A claimer ending it as expired at the same moment holds its
        // row lock first, or waits for this statement.)
        let end_claim = format!(
            r#"mine AS (
    DELETE FROM {claims}
    WHERE id = $1 AND until >= clock_timestamp() AND (SELECT count(*) FROM asynchronous) = 1
    RETURNING id
),
parts_ended AS (
    DELETE FROM {claim_parts} WHERE claim_id = (SELECT m.id FROM mine AS m)
),"#
        );
        // A record of part of a claim takes the events it names (`ids`) out of the claim by a
        // row of `claim_parts` (migration 14), which every reader of the claim's lists leaves
        // out: rewriting the claim's three arrays cost each part a read and a write of the
        // whole claim, about 2 ms for a claim of 2000 events, and records of parts are many
        // when failures wait for retries in place. The claim's row is locked as an update of
        // it would lock it (an expiring claimer skips it, a handler's hold does not wait).
        let shrink_claim = |ids: &str| {
            format!(
                r#"mine AS (
    SELECT c.id FROM {claims} AS c
    WHERE c.id = $1 AND c.until >= clock_timestamp() AND (SELECT count(*) FROM asynchronous) = 1
    FOR NO KEY UPDATE
),
parted AS (
    INSERT INTO {claim_parts} (claim_id, event_ids)
    SELECT m.id, {ids}::int8[] FROM mine AS m WHERE cardinality({ids}::int8[]) > 0
),"#
            )
        };
        let record_published_sql = |mine: &str| {
            format!(
                r#"
WITH asynchronous AS (
    -- As in `record`.
    SELECT set_config('synchronous_commit', 'off', true)
),
{mine}
published AS (
    UPDATE {outbox} SET published_at = now()
    WHERE id = ANY($2::int8[]) AND EXISTS (SELECT 1 FROM mine)
    RETURNING id, retry_count
),
unheld AS (
    -- Events set aside behind a parked event that is published now.
    UPDATE {outbox} SET held_behind = NULL
    WHERE held_behind = ANY(ARRAY(SELECT p.id FROM published AS p WHERE p.retry_count > 0))
)
SELECT count(*) FROM mine"#
            )
        };
        let record_sql = |mine: &str| {
            format!(
                r#"
WITH asynchronous AS (
    -- Handlers already ran: an outcome lost in a crash means delivering again, which
    -- at-least-once allows, so this commit need not wait for the disk.
    SELECT set_config('synchronous_commit', 'off', true)
),
{mine}
live AS (
    SELECT count(*) = 1 AS live FROM mine
),
published AS (
    UPDATE {outbox} SET published_at = now()
    WHERE id = ANY($2::int8[]) AND (SELECT live FROM live)
    RETURNING id, retry_count
),
unheld AS (
    UPDATE {outbox} SET held_behind = NULL
    WHERE held_behind = ANY(ARRAY(SELECT p.id FROM published AS p WHERE p.retry_count > 0))
),
-- (Each event's reason and delay looked up by its id in an object made once: a join with the
-- arrays could scan them once per event.)
parked AS (
    UPDATE {outbox} AS o
    SET retry_count = o.retry_count + 1,
        last_error = (SELECT jsonb_object($3::int8[]::text[], $4::text[])) ->> o.id::text,
        next_retry_at = now()
            + ((SELECT jsonb_object($3::int8[]::text[], $5::float8[]::text[])) ->> o.id::text)
              ::float8 * interval '1 second'
    WHERE o.id = ANY($3::int8[]) AND (SELECT live FROM live)
),
dead AS (
    UPDATE {outbox} AS o
    SET dead_at = now(),
        last_error = (SELECT jsonb_object($6::int8[]::text[], $7::text[])) ->> o.id::text
    WHERE o.id = ANY($6::int8[]) AND (SELECT live FROM live)
),
gone_rows AS MATERIALIZED (
    SELECT * FROM unnest($8::text[], $9::int8[]) AS x(subscriber, event_id)
),
new_rows AS MATERIALIZED (
    -- A NULL delay: the delivery waits behind an earlier one of its key.
    SELECT * FROM unnest($10::int8[], $11::text[], $12::text[], $13::uuid[], $14::int4[],
                         $15::text[], $16::float8[], $17::bool[])
         AS x(event_id, subscriber, aggregate_type, aggregate_id, attempts, error, delay, dead)
),
released_rows AS MATERIALIZED (
    SELECT * FROM unnest($18::text[], $19::int8[]) AS x(subscriber, event_id)
),
-- (The parts below meet without joins, whatever the plan: one made while the tables were
-- empty joined them in nested loops, the rows a record writes times its keys. They look rows
-- up by index (`= ANY`, `LATERAL ... LIMIT 1`) and sets up by hash (`IN`, `NOT IN` of a
-- subquery that names no outer column: one hash table, made once).)
keys AS MATERIALIZED (
    -- Each key this record touches, with the first of the rows it writes there.
    SELECT x.subscriber, x.aggregate_type, x.aggregate_id, min(x.event_id) AS first_new
    FROM (
        -- (Lateral, and kept so by its `LIMIT`: a primary-key lookup per recorded row, never a
        -- join over every delivery, whatever the estimates.)
        SELECT d.subscriber, d.aggregate_type, d.aggregate_id, NULL::int8 AS event_id
        FROM (SELECT * FROM gone_rows UNION ALL SELECT * FROM released_rows) AS x
        CROSS JOIN LATERAL (
            SELECT d.subscriber, d.aggregate_type, d.aggregate_id FROM {deliveries} AS d
            WHERE d.subscriber = x.subscriber AND d.event_id = x.event_id
            LIMIT 1
        ) AS d
        UNION ALL
        SELECT n.subscriber, n.aggregate_type, n.aggregate_id, n.event_id FROM new_rows AS n
    ) AS x
    GROUP BY x.subscriber, x.aggregate_type, x.aggregate_id
),
heads AS MATERIALIZED (
    -- The first row of each key this record touches, once it is applied: the rows it keeps
    -- and the ones it writes, less the ones it deletes. That row is due (a waiting one at
    -- once); the rest of the key waits behind it without a due time.
    SELECT k.subscriber, k.aggregate_type, k.aggregate_id,
           least(
               -- The first row kept from the key's first row on, in `deliveries_head_idx`,
               -- when it is the key's. (A row comparison, not equalities: with the key's
               -- columns equal to values, its order would be the events' alone, which the
               -- events' index and the primary key serve too, reading every delivery, or
               -- every delivery of the subscriber, before the key's, under a plan that
               -- believes the table empty. A row of the aggregate's id under another type is
               -- passed over; a row of another key ends the probe.)
               (SELECT CASE WHEN h.subscriber = k.subscriber AND h.aggregate_id = k.aggregate_id
                       THEN h.event_id END
                FROM {deliveries} AS h
                WHERE (h.subscriber, h.aggregate_id) >= (k.subscriber, k.aggregate_id)
                  AND (h.aggregate_type = k.aggregate_type OR h.subscriber <> k.subscriber
                       OR h.aggregate_id <> k.aggregate_id)
                  AND (h.subscriber, h.event_id) NOT IN (
                      SELECT g.subscriber, g.event_id FROM gone_rows AS g)
                ORDER BY h.subscriber, h.aggregate_id, h.event_id LIMIT 1),
               k.first_new) AS event_id
    FROM keys AS k
    WHERE (SELECT live FROM live)
),
delivered AS (
    DELETE FROM {deliveries} AS d
    WHERE d.event_id = ANY($9::int8[])
      AND NOT ((d.subscriber, d.event_id) NOT IN (
          SELECT g.subscriber, g.event_id FROM gone_rows AS g))
      AND (d.claim_id = $1) IS TRUE AND (SELECT live FROM live)
),
upserted AS (
    INSERT INTO {deliveries} AS d
        (event_id, subscriber, aggregate_type, aggregate_id, attempts, last_error,
         next_retry_at, dead_at)
    SELECT x.event_id, x.subscriber, x.aggregate_type, x.aggregate_id, x.attempts, x.error,
           CASE
               WHEN x.delay IS NOT NULL THEN now() + x.delay * interval '1 second'
               WHEN (x.subscriber, x.event_id) IN (
                   SELECT h.subscriber, h.event_id FROM heads AS h) THEN now()
           END,
           CASE WHEN x.dead THEN now() END
    FROM new_rows AS x
    WHERE (SELECT live FROM live)
    ON CONFLICT (subscriber, event_id) DO UPDATE
    SET attempts = excluded.attempts, last_error = excluded.last_error,
        next_retry_at = excluded.next_retry_at, dead_at = excluded.dead_at, claim_id = NULL
),
released_deliveries AS (
    UPDATE {deliveries} AS d SET claim_id = NULL,
        next_retry_at = CASE
            WHEN d.next_retry_at IS NULL AND (d.subscriber, d.event_id) IN (
                SELECT h.subscriber, h.event_id FROM heads AS h)
            THEN now() ELSE d.next_retry_at END
    WHERE d.event_id = ANY($19::int8[])
      AND NOT ((d.subscriber, d.event_id) NOT IN (
          SELECT r.subscriber, r.event_id FROM released_rows AS r))
      AND (d.claim_id = $1) IS TRUE AND (SELECT live FROM live)
),
promoted AS (
    -- Rows that this record made the first of their key (the rows before them were
    -- delivered): due now. (Not rows written above: a row is written once per statement.)
    -- (`= ANY` makes this a lookup of the event index per head. The conditions on the row
    -- are wrapped so that they cannot pick the due index instead, whose entries without a
    -- due time are every waiting row.)
    UPDATE {deliveries} AS d SET next_retry_at = now()
    WHERE d.event_id = ANY(ARRAY(SELECT h.event_id FROM heads AS h))
      AND NOT ((d.subscriber, d.event_id) NOT IN (
          SELECT h.subscriber, h.event_id FROM heads AS h WHERE h.event_id IS NOT NULL))
      AND (d.subscriber, d.event_id) NOT IN (SELECT n.subscriber, n.event_id FROM new_rows AS n)
      AND (d.subscriber, d.event_id) NOT IN (
          SELECT r.subscriber, r.event_id FROM released_rows AS r)
      AND (d.next_retry_at IS NULL AND d.dead_at IS NULL) IS TRUE
)
SELECT live FROM live"#
            )
        };
        PgQueries {
            lock_namespace: names.lock_namespace(),
            names: names.clone(),
            claims_floor: AtomicI64::new(0),
            events_floor: Mutex::default(),
            purge_whole: Mutex::default(),
            claimer: Claimer::default(),
            register: sql(format!(
                r#"
WITH gone AS (
    DELETE FROM {relays} WHERE seen_at < now() - $3 * interval '1 second' AND id <> $1
),
looked_again AS (
    -- A build that no live relay runs arrives (this relay's first registration, a routing no
    -- live relay has): it may read what was parked for want of a build, so parked events are
    -- due now, not when their park ends. (`parked_idx`; a relay that still cannot read one
    -- parks it again.)
    UPDATE {outbox} SET next_retry_at = now()
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at > now()
      AND NOT EXISTS (
          SELECT 1 FROM {relays} AS r
          WHERE r.id = $1
             OR (r.routing = $2 AND r.seen_at >= now() - $3 * interval '1 second'))
),
me AS (
    INSERT INTO {relays} (id, routing) VALUES ($1, $2)
    ON CONFLICT (id) DO UPDATE SET routing = excluded.routing, seen_at = now()
    RETURNING id, generation, routing
)
SELECT id, generation, routing FROM me
UNION ALL
SELECT id, generation, routing FROM {relays}
WHERE id <> $1 AND seen_at >= now() - $3 * interval '1 second'"#
            )),
            unregister: sql(format!("DELETE FROM {relays} WHERE id = $1")),
            live_relays: sql(format!(
                "SELECT id, generation, routing FROM {relays}
                 WHERE seen_at >= now() - $1 * interval '1 second'"
            )),
            unroutable: sql(format!(
                r#"
-- Pending events and deliveries whose names no live relay routes, and how long ago the oldest
-- of them occurred. The events are read through `pending_idx` and `stalled_idx` (the
-- conditions are theirs), never through the published events the table keeps.
WITH events AS (
    SELECT count(*) AS n, min(u.occurred_at) AS oldest FROM (
        SELECT occurred_at FROM {outbox}
        WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NULL
          AND held_by IS NULL AND held_behind IS NULL AND event_type <> ALL($1::text[])
          AND id >= {unroutable_floor}
        UNION ALL
        SELECT occurred_at FROM {outbox}
        WHERE published_at IS NULL
          AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL
               OR held_by IS NOT NULL OR held_behind IS NOT NULL)
          AND dead_at IS NULL AND event_type <> ALL($1::text[])
    ) AS u
),
deliveries AS (
    -- (Each delivery's event looked up by its id, under `LIMIT 1`: never a join that reads the
    -- events first, whatever the plan believes the tables hold.)
    SELECT count(*) AS n, min(o.occurred_at) AS oldest
    FROM {deliveries} AS d
    CROSS JOIN LATERAL (
        SELECT x.occurred_at FROM {outbox} AS x WHERE x.id = d.event_id LIMIT 1
    ) AS o
    WHERE d.dead_at IS NULL AND d.subscriber <> ALL($2::text[])
)
SELECT e.n, d.n,
       extract(epoch FROM now() - least(e.oldest, d.oldest))::float8
FROM events AS e, deliveries AS d"#
            )),
            claim_begin: sql(claim_begin(lock)),
            record_begin: sql(format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED;
                 SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';
                 {BY_INDEX}"
            )),
            by_index_begin: sql(format!("BEGIN ISOLATION LEVEL READ COMMITTED; {BY_INDEX}")),
            lock_keys: sql(format!(
                r#"
WITH keys AS MATERIALIZED (
    SELECT DISTINCT hashtext(x.subscriber || '/' || x.aggregate_type || '/' || x.aggregate_id)
        AS k
    FROM unnest($1::text[], $2::text[], $3::uuid[]) AS x(subscriber, aggregate_type, aggregate_id)
),
whole AS MATERIALIZED (
    -- The lock of all keys first: alone for more than {MAX_KEY_LOCKS} keys, shared otherwise.
    -- Not alone while a relay of a build before relay protocol 1 is live (its registered
    -- routing has no "protocol"): such a relay's records take each key's lock only, so this
    -- one does too (they would not take turns otherwise).
    SELECT m.many FROM (
        SELECT count(*) > {MAX_KEY_LOCKS}
               AND NOT EXISTS (
                   SELECT 1 FROM {relays} AS r
                   WHERE r.seen_at >= now() - interval '{registration_ttl} seconds'
                     AND NOT (r.routing::jsonb ? 'protocol'))
            AS many
        FROM keys) AS m
    CROSS JOIN LATERAL (
        SELECT pg_advisory_xact_lock({all_keys_lock}) WHERE m.many
        UNION ALL
        SELECT pg_advisory_xact_lock_shared({all_keys_lock}) WHERE NOT m.many
    ) AS l
)
SELECT count(pg_advisory_xact_lock({keys_lock}, k.k))
FROM whole AS w
CROSS JOIN LATERAL (SELECT k.k FROM keys AS k WHERE NOT w.many ORDER BY k.k) AS k"#
            )),
            lock_delivery_key: sql(format!(
                r#"
SELECT pg_advisory_xact_lock({keys_lock},
           hashtext(subscriber || '/' || aggregate_type || '/' || aggregate_id))
FROM {deliveries}, pg_advisory_xact_lock_shared({all_keys_lock}) AS whole
WHERE event_id = $1 AND subscriber = $2"#
            )),
            locked_begin: sql(format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED;
                 SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';
                 {BY_INDEX};
                 SELECT pg_advisory_xact_lock({lock})"
            )),
            insert_one: sql(format!(
                r#"
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, payload_text, occurred_at)
SELECT $3, $4, $5, $6::jsonb, $7, coalesce($8, now())
FROM pg_advisory_xact_lock($1::int4, $2::int4)"#
            )),
            insert: sql(format!(
                r#"
WITH locks AS MATERIALIZED (
    SELECT pg_advisory_xact_lock($1::int4, k)
    FROM (SELECT DISTINCT unnest($2::int4[]) AS k ORDER BY 1) AS keys
)
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, payload_text, occurred_at)
SELECT e.aggregate_type, e.aggregate_id, e.event_type, e.payload::jsonb, e.payload_text,
       coalesce(e.occurred_at, now())
FROM unnest($3::text[], $4::uuid[], $5::text[], $6::text[], $7::text[], $8::timestamptz[])
     WITH ORDINALITY AS e(aggregate_type, aggregate_id, event_type, payload, payload_text,
                          occurred_at, n)
WHERE (SELECT count(*) FROM locks) >= 0
ORDER BY e.n"#
            )),
            claim: sql(format!(
                r#"
WITH gone AS (
    -- Expired claims end: their events and deliveries are free again and count a redelivery.
    -- Rows locked by a record of their own claim (or by a handler fencing its writes on it)
    -- are skipped, not waited for, and treated as live: they are, for a moment more.
    -- (Every read of the claims table starts at $6, below which no claim is live, by index:
    -- the rows deleted below it may be kept long, by a session holding an old snapshot.)
    DELETE FROM {claims} WHERE id = ANY(ARRAY(
        SELECT id FROM {claims} WHERE id >= $6 AND until < clock_timestamp()
        ORDER BY id
        FOR UPDATE SKIP LOCKED))
    RETURNING id, event_ids
),
gone_parts AS (
    -- What records of parts of them took out (read before this statement deletes it).
    DELETE FROM {claim_parts} WHERE claim_id = ANY(ARRAY(SELECT g.id FROM gone AS g))
    RETURNING claim_id, event_ids
),
gone_events AS MATERIALIZED (
    SELECT e.id FROM gone AS g CROSS JOIN LATERAL unnest(g.event_ids) AS e(id)
    WHERE (g.id, e.id) NOT IN (SELECT p.claim_id, unnest(p.event_ids) FROM gone_parts AS p)
),
expired_events AS (
    UPDATE {outbox} SET expired_claims = expired_claims + 1
    WHERE id = ANY(ARRAY(SELECT g.id FROM gone_events AS g)) AND published_at IS NULL
),
expired_deliveries AS (
    -- Not due in this statement (their claim is set in its snapshot): the next claim sees them
    -- (counted in the last row, so that the relay asks again at once).
    UPDATE {deliveries} SET claim_id = NULL, expired_claims = expired_claims + 1
    WHERE claim_id = ANY(ARRAY(SELECT g.id FROM gone AS g))
    RETURNING 1
),
ended AS (
    -- Claims that events were set aside behind, and that are over: recorded, or expired now.
    DELETE FROM {holds} AS h
    WHERE h.claim_id = ANY(ARRAY(SELECT g.id FROM gone AS g))
       OR h.claim_id <> ALL(ARRAY(SELECT c.id FROM {claims} AS c WHERE c.id >= $6))
    RETURNING h.claim_id
),
active AS MATERIALIZED (
    -- The events of the live claims, with their aggregates (each claim's arrays are in step),
    -- less those records of parts of them took out.
    SELECT c.id AS claim_id, c.claimed_at, a.event_id, a.aggregate_type, a.aggregate_id
    FROM {claims} AS c
    CROSS JOIN LATERAL unnest(c.event_ids, c.aggregate_types, c.aggregate_ids)
        AS a(event_id, aggregate_type, aggregate_id)
    WHERE c.id >= $6 AND c.id <> ALL(ARRAY(SELECT g.id FROM gone AS g))
      AND (c.id, a.event_id) NOT IN (
              SELECT p.claim_id, unnest(p.event_ids) FROM {claim_parts} AS p
              WHERE p.claim_id >= $6)
),
shrunk AS (
    -- Live claims that let go of aggregates since events were set aside behind them (a record
    -- of part of a claim takes whole aggregates out of it). Their holds are released too: an
    -- event of an aggregate the claim still lists is set aside again by the next claim.
    UPDATE {holds} AS h
    SET events = (SELECT count(*) FROM active AS a WHERE a.claim_id = c.id)
    FROM {claims} AS c
    WHERE c.id = h.claim_id AND c.id >= $6
      AND h.events > (SELECT count(*) FROM active AS a WHERE a.claim_id = c.id)
      AND c.id <> ALL(ARRAY(SELECT g.id FROM gone AS g))
    RETURNING h.claim_id
),
released AS (
    -- Their events are pending again; the next claim takes them or sets them aside anew (as
    -- above, counted in the last row).
    UPDATE {outbox} SET held_by = NULL
    WHERE held_by = ANY(ARRAY(SELECT e.claim_id FROM ended AS e
                              UNION ALL SELECT s.claim_id FROM shrunk AS s))
    RETURNING 1
),
claimed_aggregates AS MATERIALIZED (
    -- The aggregates the live claims hold, less those this relay takes over from its own
    -- claims (every aggregate of the claims $12; and $9, $10, $11 in step: claim, aggregate;
    -- `TakeOver`: their work in it is done and recorded soon, or still running, and this
    -- relay starts none of their later events before that work is recorded). (Their events in
    -- those claims stay in `active`: only their later ones may be claimed.)
    SELECT a.aggregate_type, a.aggregate_id, min(a.claim_id) AS claim_id,
           min(a.claimed_at) AS claimed_at
    FROM active AS a
    WHERE a.claim_id <> ALL($12::int8[])
      AND (a.claim_id, a.aggregate_id, a.aggregate_type) NOT IN (
              SELECT t.claim_id, t.aggregate_id, t.aggregate_type
              FROM unnest($9::int8[], $11::uuid[], $10::text[])
                  AS t(claim_id, aggregate_id, aggregate_type))
    GROUP BY a.aggregate_type, a.aggregate_id
),
put_back AS MATERIALIZED (
    -- How many times events were put back below floors.
    SELECT CASE WHEN r.is_called THEN r.last_value ELSE 0 END AS n FROM {released} AS r
),
scan_from AS MATERIALIZED (
    -- The relay's floor ($7), if nothing was put back since it was set ($8); else the start.
    SELECT CASE WHEN p.n = $8 THEN $7 ELSE 0 END AS id FROM put_back AS p
),
scanned AS (
    -- The next pending events that nothing holds, in id order from the floor: a batch of
    -- them, whatever waits elsewhere (held events are out of this index).
    SELECT {event_columns}, o.retry_count, o.expired_claims
    FROM {outbox} AS o
    WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_retry_at IS NULL
      AND o.held_by IS NULL AND o.held_behind IS NULL
      AND o.id >= (SELECT f.id FROM scan_from AS f)
      -- NOT IN over a subquery is a hash lookup, whatever the planner thinks of the backlog.
      AND o.id NOT IN (SELECT a.event_id FROM active AS a)
    ORDER BY o.id
    LIMIT $1
),
due_parked AS (
    SELECT {event_columns}, o.retry_count, o.expired_claims
    FROM {outbox} AS o
    WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.next_retry_at <= now()
      AND o.id NOT IN (SELECT a.event_id FROM active AS a)
    ORDER BY o.next_retry_at
    LIMIT $1
),
candidates AS MATERIALIZED (
    SELECT * FROM scanned UNION ALL SELECT * FROM due_parked
),
stalled AS MATERIALIZED (
    -- Per aggregate of the candidates, its first unpublished event (not a candidate) that is
    -- dead, parked or held: one index lookup each, and none when nothing anywhere is stalled.
    SELECT k.aggregate_type, k.aggregate_id, s.id, s.held_by, s.held_behind,
           s.held_by IS NULL AND s.held_behind IS NULL AS root
    FROM (SELECT DISTINCT c.aggregate_type, c.aggregate_id FROM candidates AS c) AS k
    CROSS JOIN LATERAL (
        SELECT e.id, e.held_by, e.held_behind FROM {outbox} AS e
        WHERE e.aggregate_id = k.aggregate_id AND e.aggregate_type = k.aggregate_type
          AND e.published_at IS NULL
          AND (e.dead_at IS NOT NULL OR e.next_retry_at IS NOT NULL
               OR e.held_by IS NOT NULL OR e.held_behind IS NOT NULL)
          AND e.id NOT IN (SELECT c.id FROM candidates AS c)
        ORDER BY e.id
        LIMIT 1
    ) AS s
    -- (In the order of `stalled_idx`, so that the check reads that index, not the outbox.)
    WHERE (SELECT true FROM {outbox} AS e
           WHERE e.published_at IS NULL
             AND (e.dead_at IS NOT NULL OR e.next_retry_at IS NOT NULL
                  OR e.held_by IS NOT NULL OR e.held_behind IS NOT NULL)
           ORDER BY e.aggregate_id, e.id
           LIMIT 1)
),
skipped AS MATERIALIZED (
    -- Per aggregate, its first candidate of a type left to relays of other builds ($4): it
    -- and the aggregate's later candidates wait for them, unmarked.
    SELECT c.aggregate_type, c.aggregate_id, min(c.id) AS id FROM candidates AS c
    WHERE c.event_type = ANY($4::text[])
    GROUP BY c.aggregate_type, c.aggregate_id
),
keyed AS MATERIALIZED (
    -- What decides the candidates of an aggregate (the live claim that holds it, and whether
    -- that claim is older than $3 seconds; its first stalled event, and the event its later
    -- ones are set aside behind; its first candidate left to other builds), as objects keyed by
    -- aggregate, made once: each candidate looks its aggregate up (a binary search). (Not a
    -- join: the plan is made once and kept, and a plan made while the tables were empty
    -- believes each part holds a row or two, and joins them in a nested loop, every candidate
    -- against every aggregate a live claim holds.)
    SELECT
        (SELECT coalesce(jsonb_object_agg(
                    h.aggregate_id::text || h.aggregate_type,
                    jsonb_build_array(h.claim_id,
                                      h.claimed_at < clock_timestamp() - $3 * interval '1 second')),
                    '{{}}')
         FROM claimed_aggregates AS h) AS held,
        (SELECT coalesce(jsonb_object_agg(
                    s.aggregate_id::text || s.aggregate_type,
                    jsonb_build_array(s.id, CASE WHEN s.root THEN s.id ELSE s.held_behind END)),
                    '{{}}')
         FROM stalled AS s) AS stalled,
        (SELECT coalesce(jsonb_object_agg(x.aggregate_id::text || x.aggregate_type, x.id), '{{}}')
         FROM skipped AS x) AS skipped
),
decided AS MATERIALIZED (
    -- A candidate waits when its aggregate is in a live claim, or has an earlier stalled event.
    -- Behind a claim older than $3 seconds (a slow batch, a dead relay) it is set aside, held by
    -- that claim; behind a young one it is only skipped (the claim will be over in a moment).
    -- Behind a dead or parked event, or an event set aside behind one, it is set aside behind
    -- that event. Behind an event held by a claim that is not live (it ended, and this
    -- statement releases what it held), it is only skipped: taking over that hold would
    -- outlive its release. (With the candidate's columns: the claim returns them.)
    SELECT c.*,
           CASE WHEN (c.held ->> 1)::bool THEN (c.held ->> 0)::int8 END AS mark_by,
           CASE
               WHEN c.held IS NULL AND (c.stalled ->> 0)::int8 < c.id
               THEN (c.stalled ->> 1)::int8
           END AS mark_behind,
           c.held IS NOT NULL OR coalesce((c.stalled ->> 0)::int8 < c.id, false)
               OR coalesce(c.skipped::int8 <= c.id, false) AS waits
    FROM (
        SELECT c.*, k.held -> a.key AS held, k.stalled -> a.key AS stalled,
               k.skipped -> a.key AS skipped
        FROM candidates AS c
        CROSS JOIN LATERAL (SELECT c.aggregate_id::text || c.aggregate_type AS key) AS a
        CROSS JOIN keyed AS k
        -- (Kept from being merged into the query above, which would make the key and look
        -- it up again at each use of a value, about ten times a candidate: a fifth of the
        -- claim's time.)
        OFFSET 0
    ) AS c
),
marks AS MATERIALIZED (
    -- The candidates set aside, and by what, keyed by event (as `keyed`, for the same reason).
    -- (Not the events of a claim that expired just now: `expired_events` writes those rows,
    -- and a row is written once per statement. The next claim sets them aside if need be.)
    SELECT coalesce(array_agg(m.id), '{{}}') AS ids,
           coalesce(jsonb_object_agg(m.id::text, jsonb_build_array(m.mark_by, m.mark_behind)),
                    '{{}}') AS by
    FROM decided AS m
    WHERE (m.mark_by IS NOT NULL OR m.mark_behind IS NOT NULL)
      -- (A hash lookup: `<> ALL` of an array compares each event with every event of the
      -- claims that expired.)
      AND m.id NOT IN (SELECT g.id FROM gone_events AS g WHERE g.id IS NOT NULL)
),
marked AS (
    -- (`= ANY` of a value computed once: a primary-key lookup per event, whatever the plan.)
    UPDATE {outbox} AS o
    SET held_by = ((SELECT m.by FROM marks AS m) -> o.id::text ->> 0)::int8,
        held_behind = ((SELECT m.by FROM marks AS m) -> o.id::text ->> 1)::int8
    WHERE o.id = ANY((SELECT m.ids FROM marks AS m)::int8[])
    RETURNING o.id
),
new_holds AS (
    -- (With how many events the claim lists in this statement's snapshot: a record of part of
    -- it that commits after the snapshot is found by a later claim, in `shrunk`.)
    INSERT INTO {holds} (claim_id, events)
    SELECT m.claim_id, (SELECT count(*) FROM active AS a WHERE a.claim_id = m.claim_id)
    FROM (SELECT DISTINCT d.mark_by AS claim_id FROM decided AS d
          WHERE d.mark_by IS NOT NULL) AS m
    ON CONFLICT DO NOTHING
),
claimable_up_to AS MATERIALIZED (
    SELECT d.id, d.aggregate_type, d.aggregate_id, d.event_type, d.payload, d.occurred_at,
           d.retry_count, d.expired_claims
    FROM decided AS d
    WHERE NOT d.waits ORDER BY d.id LIMIT $1
),
cutoff AS MATERIALIZED (
    -- Where the byte limit ($13) cuts the batch: the first event (not the first of all) whose
    -- payload goes over it, and every event after it, wait for the next claim. Looked for only
    -- when the batch's payloads go over the limit.
    SELECT coalesce(CASE WHEN (SELECT sum(octet_length(c.payload)) FROM claimable_up_to AS c) > $13
        THEN (SELECT min(w.id) FROM (
                  SELECT c.id, row_number() OVER w AS n, sum(octet_length(c.payload)) OVER w AS bytes
                  FROM claimable_up_to AS c
                  WINDOW w AS (ORDER BY c.id ROWS UNBOUNDED PRECEDING)) AS w
              WHERE w.n > 1 AND w.bytes > $13)
        END, 9223372036854775807) AS id
),
claimable AS NOT MATERIALIZED (
    -- In id order, up to $1 events and $13 bytes of payload (the first whatever its size).
    SELECT c.* FROM claimable_up_to AS c WHERE c.id < (SELECT f.id FROM cutoff AS f)
),
due_heads AS MATERIALIZED (
    -- Due deliveries that are the first of their key, longest due first: rows behind a head
    -- have no due time and are not read here, however many wait (nor are dead ones).
    SELECT d.subscriber, d.aggregate_type, d.aggregate_id, d.event_id FROM {deliveries} AS d
    WHERE d.dead_at IS NULL AND d.next_retry_at <= now() AND d.claim_id IS NULL
      -- (A scalar subquery in the order of `deliveries_head_idx`: a probe of that index per
      -- due row, never a join that reads every delivery, nor every delivery of the aggregate.)
      AND (SELECT true FROM {deliveries} AS h
           WHERE h.subscriber = d.subscriber AND h.aggregate_id = d.aggregate_id
             AND h.aggregate_type = d.aggregate_type AND h.event_id < d.event_id
           ORDER BY h.subscriber, h.aggregate_id, h.event_id
           LIMIT 1) IS NULL
    ORDER BY d.next_retry_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
due AS MATERIALIZED (
    -- Each due head with the rows right behind it that are ready (not dead, not claimed, not
    -- waiting for a retry), in order: a key that is free again drains in bulk. The batch is
    -- split between the heads (each gets at least MIN_SHARE rows), so this reads about a
    -- batch of rows.
    -- (Not the heads of subscribers left to relays of other builds, $5: a filter here, after
    -- the heads' `LIMIT`, leaves the plan of `due_heads` alone.)
    -- Then, in the same order, up to $13 bytes of their events' payloads (the first row
    -- whatever its size): each key keeps rows from its head on.
    SELECT u.subscriber, u.event_id, u.aggregate_type, u.aggregate_id
    FROM (
    SELECT r.subscriber, r.event_id, r.aggregate_type, r.aggregate_id,
           row_number() OVER w AS n, sum(p.bytes) OVER w AS bytes
    FROM (
    SELECT r.subscriber, r.event_id, r.aggregate_type, r.aggregate_id
    FROM (SELECT * FROM due_heads WHERE subscriber <> ALL($5::text[])) AS h
    CROSS JOIN LATERAL (
        SELECT f.subscriber, f.event_id, f.aggregate_type, f.aggregate_id,
               bool_and(f.event_id = h.event_id
                        OR (f.dead_at IS NULL AND f.claim_id IS NULL
                            AND (f.next_retry_at IS NULL OR f.next_retry_at <= now())))
                   OVER (ORDER BY f.subscriber, f.aggregate_id, f.event_id) AS ready
        FROM {deliveries} AS f
        WHERE f.subscriber = h.subscriber AND f.aggregate_id = h.aggregate_id
          AND f.aggregate_type = h.aggregate_type AND f.event_id >= h.event_id
        ORDER BY f.subscriber, f.aggregate_id, f.event_id
        LIMIT greatest({MIN_SHARE}, $1 / (SELECT count(*) FROM due_heads))
    ) AS r
    WHERE r.ready
    ORDER BY r.event_id
    LIMIT $1
    ) AS r
    CROSS JOIN LATERAL (
        SELECT octet_length(coalesce(o.payload_text, o.payload::text)) AS bytes
        FROM {outbox} AS o WHERE o.id = r.event_id
    ) AS p
    WINDOW w AS (ORDER BY r.event_id, r.subscriber ROWS UNBOUNDED PRECEDING)
    ) AS u
    WHERE u.n = 1 OR u.bytes <= $13
),
subscribers AS MATERIALIZED (
    -- The subscribers with deliveries, one index probe each; none when no delivery waits.
    SELECT s.subscriber FROM (
        WITH RECURSIVE walk AS (
            (SELECT d.subscriber FROM {deliveries} AS d ORDER BY d.subscriber LIMIT 1)
            UNION ALL
            SELECT (SELECT d.subscriber FROM {deliveries} AS d
                    WHERE d.subscriber > w.subscriber ORDER BY d.subscriber LIMIT 1)
            FROM walk AS w WHERE w.subscriber IS NOT NULL
        )
        SELECT subscriber FROM walk
    ) AS s
    WHERE s.subscriber IS NOT NULL
),
claim AS (
    -- One aggregation step feeds the three arrays each row: they stay in step. The lease
    -- runs from now, after any wait for the claim lock.
    INSERT INTO {claims} (until, claimed_at, event_ids, aggregate_types, aggregate_ids)
    SELECT clock_timestamp() + $2 * interval '1 second', clock_timestamp(),
           coalesce(array_agg(c.id), '{{}}'), coalesce(array_agg(c.aggregate_type), '{{}}'),
           coalesce(array_agg(c.aggregate_id), '{{}}')
    FROM claimable AS c
    HAVING count(*) > 0 OR EXISTS (SELECT 1 FROM due)
    RETURNING id
),
claimed_deliveries AS (
    -- (The rows of `due`: their events' ids through `= ANY` of a value computed once, an index
    -- lookup each, and the pairs through a hash of `due`: no join, whatever the plan. Their
    -- events are read below, one primary-key lookup each.)
    UPDATE {deliveries} AS d SET claim_id = (SELECT id FROM claim)
    WHERE d.event_id = ANY(ARRAY(SELECT u.event_id FROM due AS u))
      AND NOT ((d.subscriber, d.event_id) NOT IN (SELECT u.subscriber, u.event_id FROM due AS u))
      AND d.claim_id IS NULL
    RETURNING d.claim_id, d.event_id, d.attempts, d.expired_claims, d.subscriber
),
claimed_events AS (
    SELECT (SELECT id FROM claim), c.id, c.aggregate_type, c.aggregate_id, c.event_type,
           c.payload, c.occurred_at, c.retry_count,
           -- Counting the claim of it that expired just now.
           c.expired_claims
               + (c.id IN (SELECT g.id FROM gone_events AS g WHERE g.id IS NOT NULL))::int4,
           NULL::text,
           -- The subscribers that hold an earlier event of its aggregate beyond the rows this
           -- claim takes of their key (those run first, in the subscriber's queue): those whose
           -- last row of the key this claim does not take (it takes a key's rows from its head
           -- on). One probe of `deliveries_head_idx` per subscriber, from its end, and a hash
           -- lookup: however many rows wait.
           (SELECT array_agg(s.subscriber)
            FROM subscribers AS s
            CROSS JOIN LATERAL (
                SELECT d.event_id FROM {deliveries} AS d
                WHERE d.subscriber = s.subscriber AND d.aggregate_id = c.aggregate_id
                  AND d.aggregate_type = c.aggregate_type
                ORDER BY d.subscriber DESC, d.aggregate_id DESC, d.event_id DESC
                LIMIT 1
            ) AS l
            WHERE (s.subscriber, l.event_id) NOT IN (SELECT u.subscriber, u.event_id FROM due AS u))
    FROM claimable AS c
)
SELECT * FROM claimed_events
UNION ALL
SELECT d.claim_id, o.*, d.attempts, d.expired_claims, d.subscriber, NULL::text[]
FROM claimed_deliveries AS d
CROSS JOIN LATERAL (
    SELECT {event_columns} FROM {outbox} AS o WHERE o.id = d.event_id LIMIT 1
) AS o
UNION ALL
-- The last row says how many events and deliveries were set aside or freed for the next
-- claim (which finds work this one could not see: the relay asks again at once; the id is
-- NULL), the lowest claim live
-- after this one (NULL: none), the version of the relay registry this claim saw, and what the
-- event floor needs (`EventFloor`): the releases count, this claim's bound, its snapshot's
-- xmin and xmax; and when the next retry not due yet is due.
SELECT (SELECT id FROM claim), NULL, NULL, NULL, NULL, NULL,
       least((SELECT min(c.id) FROM {claims} AS c
              WHERE c.id >= $6 AND c.id <> ALL(ARRAY(SELECT g.id FROM gone AS g))),
             (SELECT id FROM claim)),
       ((SELECT count(*) FROM marked) + (SELECT count(*) FROM released)
        + (SELECT count(*) FROM expired_deliveries))::int4, NULL,
       (SELECT coalesce(string_agg(r.generation::text, ',' ORDER BY r.generation), '')
        FROM {relays} AS r),
       ARRAY[
           (SELECT p.n FROM put_back AS p)::text,
           least(
               coalesce((SELECT min(s.id) FROM scanned AS s),
                        (SELECT max(o.id) + 1 FROM {outbox} AS o)),
               (SELECT min(a.event_id) FROM active AS a),
               -- (`waiting_idx`: one probe.)
               (SELECT min(w.id) FROM {outbox} AS w
                WHERE w.published_at IS NULL AND w.dead_at IS NULL
                  AND (w.next_retry_at IS NOT NULL OR w.held_by IS NOT NULL)))::text,
           pg_snapshot_xmin(pg_current_snapshot())::text,
           pg_snapshot_xmax(pg_current_snapshot())::text,
           -- When no claim was made, milliseconds until the earliest retry or parked event
           -- not due yet (`due_idx`, `parked_idx`: a probe each), or a live claim's expiry (a
           -- dead relay's work is free then; the first moment after its `until`), so that an
           -- idle relay wakes for it. (A claim that took work skips them: its relay looks again
           -- at once.)
           CASE WHEN (SELECT id FROM claim) IS NULL THEN
           (SELECT ceil(extract(epoch FROM min(n.at) - now()) * 1000)::int8
            FROM ((SELECT d.next_retry_at AS at FROM {deliveries} AS d
                   WHERE d.dead_at IS NULL AND d.next_retry_at > now() AND d.claim_id IS NULL
                   ORDER BY d.next_retry_at LIMIT 1)
                  UNION ALL
                  (SELECT o.next_retry_at FROM {outbox} AS o
                   WHERE o.published_at IS NULL AND o.dead_at IS NULL
                     AND o.next_retry_at > now()
                   ORDER BY o.next_retry_at LIMIT 1)
                  UNION ALL
                  (SELECT min(c.until) + interval '1 microsecond' FROM {claims} AS c
                   WHERE c.id >= $6 AND c.until > now())) AS n) END::text,
           -- The sizes of the deliveries' and the events' tables (`TableSizes`).
           pg_relation_size('{deliveries}'::regclass)::text,
           pg_relation_size('{outbox}'::regclass)::text]"#
            )),
            renew: sql(format!(
                "UPDATE {claims} SET until = clock_timestamp() + $2 * interval '1 second'
                 WHERE id = $1 AND until >= clock_timestamp()"
            )),
            // (The claim looked up in a function of migration 13: see `BY_INDEX`.)
            hold_claim: sql(format!(
                "SELECT set_config('idle_in_transaction_session_timeout', '{IDLE_TIMEOUT}', true)
                 FROM {hold}($1) AS h (held) WHERE h.held"
            )),
            // A transaction that recorded the same message and is still open makes this wait
            // for its end: a duplicate if it committed, recorded here if it rolled back.
            receive: sql(format!(
                "INSERT INTO {inbox} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            )),
            // `hold_claim` and `receive` in one round trip: the record only under a live claim.
            hold_and_receive: sql(format!(
                r#"
WITH held AS (
    SELECT set_config('idle_in_transaction_session_timeout', '{IDLE_TIMEOUT}', true)
    FROM {hold}($3) AS h (held) WHERE h.held
),
received AS (
    INSERT INTO {inbox} (consumer, message_id)
    SELECT $1, $2 WHERE EXISTS (SELECT 1 FROM held)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM held), EXISTS (SELECT 1 FROM received)"#
            )),
            purge_inbox: sql(format!(
                r#"
DELETE FROM {inbox} WHERE (consumer, message_id) IN (
    SELECT i.consumer, i.message_id FROM {inbox} AS i
    WHERE i.handled_at < now() - $1 * interval '1 second'
    ORDER BY i.handled_at
    LIMIT $2
)"#
            )),
            record_published: sql(record_published_sql(&end_claim)),
            record: sql(record_sql(&end_claim)),
            record_published_part: sql(record_published_sql(&shrink_claim("$2"))),
            record_part: sql(record_sql(&shrink_claim("$20"))),
            requeue_events: sql(format!(
                r#"
WITH events AS (
    UPDATE {outbox}
    SET dead_at = NULL, next_retry_at = NULL, retry_count = 0, last_error = NULL
    WHERE id = ANY($1::int8[]) AND published_at IS NULL
      AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL)
    RETURNING 1
),
unheld AS (
    -- What waited behind them is claimed again with them, in order.
    UPDATE {outbox} SET held_behind = NULL WHERE held_behind = ANY($1::int8[])
),
deliveries AS (
    UPDATE {deliveries}
    SET dead_at = NULL, attempts = 0, next_retry_at = now(), last_error = NULL
    WHERE event_id = ANY($1::int8[]) AND dead_at IS NOT NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM events) + (SELECT count(*) FROM deliveries)"#
            )),
            purge_published: sql(format!(
                r#"
WITH examined AS MATERIALIZED (
    -- The next batch of old published events, after where the last purge stopped ($3, $4:
    -- published_at in microseconds since the epoch, and id; NULL: from the oldest).
    -- (A time other SQL wrote as -infinity is never purged: the cursor could not hold it.)
    SELECT o.id, o.published_at FROM {outbox} AS o
    WHERE o.published_at IS NOT NULL
      AND o.published_at < now() - $1 * interval '1 second'
      AND isfinite(o.published_at)
      AND (o.published_at, o.id) > (
          CASE WHEN $3::int8 IS NULL THEN '-infinity'::timestamptz
               ELSE timestamptz 'epoch' + $3::int8 * interval '1 microsecond' END,
          coalesce($4::int8, 0))
      -- Not the ids $5..$6, left to go with their partitions whole (pruned: their indexes
      -- are not read).
      AND (o.id < $5 OR o.id >= $6)
    ORDER BY o.published_at, o.id
    LIMIT $2
),
doomed AS (
    -- Those no delivery holds (a subscriber has yet to receive them). (A scalar subquery: a
    -- probe of the deliveries' event index per event, never a join over every delivery.)
    SELECT o.id FROM {outbox} AS o
    WHERE o.id = ANY(ARRAY(SELECT e.id FROM examined AS e))
      AND (SELECT true FROM {deliveries} AS d WHERE d.event_id = o.id LIMIT 1) IS NULL
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    -- (An array, as above: a lookup of each id, whatever the plan believes the table holds.)
    DELETE FROM {outbox} WHERE id = ANY(ARRAY(SELECT d.id FROM doomed AS d)) RETURNING 1
),
last AS (
    SELECT e.published_at, e.id FROM examined AS e
    WHERE (SELECT count(*) FROM examined) = $2
    ORDER BY e.published_at DESC, e.id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM deleted),
       (SELECT (extract(epoch FROM l.published_at) * 1000000)::int8 FROM last AS l),
       (SELECT l.id FROM last AS l)"#
            )),
            list: crate::ListState::ALL.map(|state| sql(list_query(&dialect, state))),
            overview: sql(overview_query(&dialect)),
            published_within: sql(format!(
                "SELECT count(*) FROM {outbox} WHERE published_at > now() - $1 * interval '1 second'"
            )),
            dead_letter_groups: sql(dead_letter_groups_query(&dialect, first_line)),
            status: sql(format!(
                r#"
-- Each count reads its own partial index (the conditions are those of the indexes): the
-- published events a table keeps for retention are never read.
WITH pending AS MATERIALIZED (
    -- Pending events nothing holds (`pending_idx`), from the relay's floor (none is below it).
    SELECT count(*) AS events, min(occurred_at) AS oldest FROM {outbox}
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NULL
      AND held_by IS NULL AND held_behind IS NULL
      AND id >= {status_floor}
),
stalled AS MATERIALIZED (
    -- Dead, parked and held events (`stalled_idx`).
    SELECT id, aggregate_type, aggregate_id, dead_at, occurred_at FROM {outbox}
    WHERE published_at IS NULL
      AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL
           OR held_by IS NOT NULL OR held_behind IS NOT NULL)
)
SELECT p.events + (SELECT count(*) FROM stalled WHERE dead_at IS NULL),
       extract(epoch FROM now() - least(
           p.oldest, (SELECT min(occurred_at) FROM stalled WHERE dead_at IS NULL)))::float8,
       (SELECT count(*) FROM {deliveries} WHERE dead_at IS NULL),
       (SELECT count(*) FROM stalled WHERE dead_at IS NOT NULL)
         + (SELECT count(*) FROM {deliveries} WHERE dead_at IS NOT NULL),
       (SELECT count(*) FROM (
            SELECT DISTINCT subscriber, aggregate_type, aggregate_id FROM {deliveries}) AS k),
       (SELECT count(*) FROM (SELECT DISTINCT aggregate_type, aggregate_id FROM stalled) AS k),
       (SELECT count(*) FROM {outbox} WHERE held_by IS NOT NULL)
         + (SELECT count(*) FROM {outbox} WHERE held_behind IS NOT NULL),
       -- What dead letters hold back: events of an aggregate set aside after its first dead
       -- event (the claim sets aside what it meets behind one; `stalled` has them), and
       -- deliveries of a key after its first dead one (probes of `deliveries_head_idx`).
       (SELECT count(*) FROM (
            SELECT s.aggregate_type, s.aggregate_id, min(s.id) AS id FROM stalled AS s
            WHERE s.dead_at IS NOT NULL GROUP BY s.aggregate_type, s.aggregate_id) AS r
        JOIN stalled AS e
          ON e.aggregate_id = r.aggregate_id AND e.aggregate_type = r.aggregate_type
        WHERE e.dead_at IS NULL AND e.id > r.id)
         + (SELECT count(*) FROM (
                SELECT k.subscriber, k.aggregate_type, k.aggregate_id, min(k.event_id) AS event_id
                FROM {deliveries} AS k WHERE k.dead_at IS NOT NULL
                GROUP BY k.subscriber, k.aggregate_type, k.aggregate_id) AS k
            JOIN {deliveries} AS d
              ON d.subscriber = k.subscriber AND d.aggregate_id = k.aggregate_id
             AND d.aggregate_type = k.aggregate_type
            WHERE d.dead_at IS NULL AND d.event_id > k.event_id)
FROM pending AS p"#
            )),
            subscribers: sql(subscribers_query(&deliveries)),
            skip_delivery: sql(format!(
                r#"
WITH gone AS (
    DELETE FROM {deliveries}
    WHERE event_id = $1 AND subscriber = $2 AND claim_id IS NULL
    RETURNING event_id, subscriber, aggregate_type, aggregate_id, attempts, last_error
),
promoted AS (
    -- The row behind it, if it is now the first of its key, is due.
    UPDATE {deliveries} AS d SET next_retry_at = now()
    FROM gone AS g
    WHERE d.subscriber = g.subscriber AND d.next_retry_at IS NULL AND d.dead_at IS NULL
      AND d.event_id = (
          SELECT h.event_id FROM {deliveries} AS h
          WHERE h.subscriber = g.subscriber AND h.aggregate_id = g.aggregate_id
            AND h.aggregate_type = g.aggregate_type AND h.event_id <> g.event_id
          ORDER BY h.subscriber, h.aggregate_id, h.event_id LIMIT 1)
)
INSERT INTO {skips} (event_id, subscriber, attempts, last_error, reason)
SELECT event_id, subscriber, attempts, last_error, $3 FROM gone"#
            )),
            skip_event: sql(format!(
                r#"
WITH gone AS (
    UPDATE {outbox} AS o SET published_at = now(), dead_at = NULL, next_retry_at = NULL
    WHERE o.id = $1 AND o.published_at IS NULL
      AND (o.dead_at IS NOT NULL OR o.next_retry_at IS NOT NULL)
      AND NOT EXISTS (
          SELECT 1 FROM {claims} AS c WHERE o.id = ANY(c.event_ids)
            AND NOT EXISTS (SELECT 1 FROM {claim_parts} AS p
                            WHERE p.claim_id = c.id AND o.id = ANY(p.event_ids)))
    RETURNING o.id, o.retry_count, o.last_error
),
unheld AS (
    UPDATE {outbox} SET held_behind = NULL
    WHERE held_behind = ANY(ARRAY(SELECT g.id FROM gone AS g))
)
INSERT INTO {skips} (event_id, subscriber, attempts, last_error, reason)
SELECT id, NULL, retry_count, last_error, $2 FROM gone"#
            )),
            requeue_subscriber: sql(format!(
                r#"
UPDATE {deliveries}
SET dead_at = NULL, attempts = 0, next_retry_at = now(), last_error = NULL
WHERE subscriber = $1 AND dead_at IS NOT NULL
  AND ($2::text IS NULL OR {line} = $2::text)"#,
                line = first_line("last_error")
            )),
            requeues: sql(format!(
                "SELECT id, coalesce(event_ids, '{{}}') AS event_ids, subscriber, first_line, requeued, reason,
                        requeued_at
                 FROM {requeues} WHERE id < $1 ORDER BY id DESC LIMIT $2"
            )),
            record_requeue: sql(format!(
                "INSERT INTO {requeues} (event_ids, subscriber, first_line, requeued, reason)
                 VALUES ($1, $2, $3, $4, $5)"
            )),
            dead_events_failing: sql(format!(
                "SELECT id FROM {outbox}
                 WHERE published_at IS NULL AND dead_at IS NOT NULL AND {line} = $1
                 ORDER BY id",
                line = first_line("last_error")
            )),
        }
    }

    async fn migrate(pool: &PgPool, names: &TableNames) -> Result<(), Error> {
        migrate_to(pool, names, MIGRATIONS.last().map_or(0, |m| m.0)).await
    }

    fn publish_error(error: sqlx::Error, events: usize) -> Error {
        // (53200: out of shared memory, which a lock the server's lock table has no room for
        // raises; an insert takes no other.)
        match &error {
            sqlx::Error::Database(e) if e.code().as_deref() == Some("53200") => {
                Error::TooManyAggregates {
                    events,
                    source: error,
                }
            }
            _ => Error::Database(error),
        }
    }

    async fn insert(
        conn: &mut PgConnection,
        queries: &PgQueries,
        events: &[NewEvent],
    ) -> Result<(), sqlx::Error> {
        if let [event] = events {
            let (payload, exact) = jsonb_payload(&event.payload);
            sqlx::query(queries.insert_one.clone())
                .bind(queries.lock_namespace)
                .bind(lock_key(event.aggregate_id))
                .bind(event.aggregate_type)
                .bind(event.aggregate_id)
                .bind(event.event_type)
                .bind(payload.as_ref())
                .bind(exact)
                .bind(event.occurred_at)
                .execute(conn)
                .await?;
            return Ok(());
        }
        let keys: Vec<i32> = events.iter().map(|e| lock_key(e.aggregate_id)).collect();
        let aggregate_types: Vec<&str> = events.iter().map(|e| e.aggregate_type).collect();
        let aggregate_ids: Vec<Uuid> = events.iter().map(|e| e.aggregate_id).collect();
        let event_types: Vec<&str> = events.iter().map(|e| e.event_type).collect();
        let (payloads, exact): (Vec<_>, Vec<_>) =
            events.iter().map(|e| jsonb_payload(&e.payload)).unzip();
        let payloads: Vec<&str> = payloads.iter().map(AsRef::as_ref).collect();
        let occurred: Vec<Option<OffsetDateTime>> = events.iter().map(|e| e.occurred_at).collect();
        sqlx::query(queries.insert.clone())
            .bind(queries.lock_namespace)
            .bind(keys)
            .bind(aggregate_types)
            .bind(aggregate_ids)
            .bind(event_types)
            .bind(payloads)
            .bind(exact)
            .bind(occurred)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn claim(
        pool: &PgPool,
        queries: &PgQueries,
        limit: ClaimLimit,
        lease: Duration,
        filter: &ClaimFilter,
    ) -> Result<Batch, sqlx::Error> {
        // One claimer at a time: the transaction's first statements take the claim lock; the
        // claim statement then sees every claim and record committed before it was granted.
        let (events_floor, released) = queries.scan_from();
        // Claims taken over whole; (claim, type, id) of each other aggregate taken over, as
        // three arrays in step.
        let taken_whole: Vec<i64> = filter
            .take_over
            .iter()
            .filter(|t| t.whole)
            .map(|t| t.claim.get())
            .collect();
        let mut take_over_claims = Vec::new();
        let (take_over_types, take_over_ids): (Vec<&str>, Vec<Uuid>) = filter
            .take_over
            .iter()
            .filter(|t| !t.whole)
            .flat_map(|t| {
                take_over_claims.extend(t.aggregates.iter().map(|_| t.claim.get()));
                t.aggregates.iter().map(|(t, id)| (t.as_str(), *id))
            })
            .unzip();
        let (slot, mut conn, planned) = queries.claimer.take(pool).await?;
        let mut tx = conn.begin_with(queries.claim_begin.clone()).await?;
        #[cfg(feature = "_fault-injection")]
        crate::__fault_injection::claim_lock_held();
        let rows = sqlx::query(queries.claim.clone())
            .bind(i64::from(limit.events))
            .bind(seconds(lease))
            .bind(seconds(hold_after(lease)))
            .bind(&filter.skip_event_types)
            .bind(&filter.skip_subscribers)
            .bind(queries.claims_floor.load(Relaxed))
            .bind(events_floor)
            .bind(released)
            .bind(take_over_claims)
            .bind(take_over_types)
            .bind(take_over_ids)
            .bind(taken_whole)
            .bind(i64::try_from(limit.payload_bytes).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let mut token = None;
        // Events and deliveries set aside or freed: the next claim may find work.
        let mut for_next = 0;
        let mut registry = None;
        let mut floor = None;
        let mut seen = Vec::new();
        let mut claims = Vec::with_capacity(rows.len());
        for row in &rows {
            token = token.or(row.try_get::<Option<i64>, _>(0)?);
            match row.try_get::<Option<i64>, _>(1)? {
                Some(_) => claims.push(claim_from_row(row)?),
                // The last row: how many events and deliveries were set aside or freed, the
                // registry's version.
                None => {
                    floor = row.try_get::<Option<i64>, _>(6)?;
                    for_next = row.try_get::<Option<i32>, _>(7)?.unwrap_or(0);
                    registry = row.try_get::<Option<String>, _>(9)?;
                    seen = row.try_get::<Vec<Option<String>>, _>(10)?;
                }
            }
        }
        // Committed: what this claim saw is settled. (A rolled-back claim's expired claims
        // would still be live.)
        if let Some(floor) = floor {
            queries.claims_floor.fetch_max(floor, Relaxed);
        }
        // (Sent as text: the last row's columns have the claimed rows' types.)
        let seen = |i: usize| seen.get(i).cloned().flatten().unwrap_or_default();
        let sizes = seen(5)
            .parse()
            .and_then(|deliveries| Ok(TableSizes([deliveries, seen(6).parse()?])))
            .ok();
        // (On an error above the connection is dropped, not kept.)
        queries.claimer.keep(slot, conn, planned, sizes).await;
        if let (Ok(released), Ok(xmin), Ok(xmax)) =
            (seen(0).parse(), seen(2).parse(), seen(3).parse())
        {
            let bound = seen(1).parse().ok();
            let mut events_floor = queries
                .events_floor
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            events_floor.advance(released, bound, xmin, xmax);
        }
        let next_due = seen(4).parse().ok().map(Duration::from_millis);
        let Some(token) = token.filter(|_| !claims.is_empty()) else {
            return Ok(Batch::empty()
                .with_more(for_next > 0)
                .with_registry(registry)
                .with_next_due(next_due));
        };
        claims.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        Ok(Batch::new(ClaimToken::new(token), claims)
            .with_more(for_next > 0)
            .with_registry(registry)
            .with_next_due(next_due))
    }

    async fn register(
        pool: &PgPool,
        queries: &PgQueries,
        relay: Uuid,
        routing: &str,
        ttl: Duration,
    ) -> Result<Registry, sqlx::Error> {
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let rows: Vec<(Uuid, i64, String)> = sqlx::query_as(queries.register.clone())
            .persistent(false)
            .bind(relay)
            .bind(routing)
            .bind(seconds(ttl))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(registry_of(rows))
    }

    async fn unregister(
        pool: &PgPool,
        queries: &PgQueries,
        relay: Uuid,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(queries.unregister.clone())
            .bind(relay)
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn live_relays(
        pool: &PgPool,
        queries: &PgQueries,
        ttl: Duration,
    ) -> Result<Registry, sqlx::Error> {
        let rows: Vec<(Uuid, i64, String)> = sqlx::query_as(queries.live_relays.clone())
            .bind(seconds(ttl))
            .fetch_all(pool)
            .await?;
        Ok(registry_of(rows))
    }

    async fn unroutable(
        pool: &PgPool,
        queries: &PgQueries,
        event_types: Vec<String>,
        subscribers: Vec<String>,
    ) -> Result<(u64, u64, Option<Duration>), sqlx::Error> {
        let (floor, released) = queries.scan_from();
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let (events, deliveries, oldest): (i64, i64, Option<f64>) =
            sqlx::query_as(queries.unroutable.clone())
                .bind(event_types)
                .bind(subscribers)
                .bind(floor)
                .bind(released)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok((
            row_count(events),
            row_count(deliveries),
            oldest.map(|age| Duration::try_from_secs_f64(age.max(0.0)).unwrap_or_default()),
        ))
    }

    async fn renew(
        pool: &PgPool,
        queries: &PgQueries,
        token: ClaimToken,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let renewed = sqlx::query(queries.renew.clone())
            .persistent(false)
            .bind(token.get())
            .bind(seconds(lease))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(renewed == 1)
    }

    async fn hold_claim(
        conn: &mut PgConnection,
        queries: &PgQueries,
        token: ClaimToken,
    ) -> Result<bool, sqlx::Error> {
        Ok(sqlx::query(queries.hold_claim.clone())
            .bind(token.get())
            .fetch_optional(conn)
            .await?
            .is_some())
    }

    async fn record(
        pool: &PgPool,
        queries: &PgQueries,
        token: ClaimToken,
        outcomes: &Outcomes,
        part: bool,
    ) -> Result<Recorded, sqlx::Error> {
        let all_published = outcomes.deliveries.is_empty()
            && outcomes
                .events
                .iter()
                .all(|(_, outcome)| *outcome == EventOutcome::Published);
        let recorded = |live: bool| {
            if live {
                Recorded::Applied
            } else {
                Recorded::Lost
            }
        };
        if all_published {
            let ids: Vec<i64> = outcomes.events.iter().map(|(id, _)| *id).collect();
            let query = if part {
                &queries.record_published_part
            } else {
                &queries.record_published
            };
            let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
            let live: i64 = sqlx::query_scalar(query.clone())
                .bind(token.get())
                .bind(ids)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(recorded(live == 1));
        }
        let mut published = Vec::new();
        let (mut parked_ids, mut parked_reasons, mut parked_delays) = (vec![], vec![], vec![]);
        let (mut dead_ids, mut dead_reasons) = (vec![], vec![]);
        for (id, outcome) in &outcomes.events {
            match outcome {
                EventOutcome::Published => published.push(*id),
                EventOutcome::Parked { reason, retry_in } => {
                    parked_ids.push(*id);
                    parked_reasons.push(reason.as_str());
                    parked_delays.push(seconds(*retry_in));
                }
                EventOutcome::Dead { reason } => {
                    dead_ids.push(*id);
                    dead_reasons.push(reason.as_str());
                }
                // Ending the claim gives the event back.
                EventOutcome::Released => {}
            }
        }
        let (mut done_subscribers, mut done_ids) = (vec![], vec![]);
        let (mut rel_subscribers, mut rel_ids) = (vec![], vec![]);
        let mut up = Upserts::default();
        for d in &outcomes.deliveries {
            match &d.outcome {
                DeliveryOutcome::Delivered => {
                    done_subscribers.push(d.subscriber.as_str());
                    done_ids.push(d.event_id);
                }
                DeliveryOutcome::Released => {
                    rel_subscribers.push(d.subscriber.as_str());
                    rel_ids.push(d.event_id);
                }
                // Due when it is the first of its key, else behind the first.
                DeliveryOutcome::Waiting => up.push(d, 0, None, None, false),
                DeliveryOutcome::Retry {
                    attempts,
                    error,
                    retry_in,
                } => up.push(d, *attempts, Some(error), Some(*retry_in), false),
                DeliveryOutcome::Dead { attempts, error } => {
                    up.push(d, *attempts, Some(error), Some(Duration::ZERO), true);
                }
            }
        }
        let query = if part {
            &queries.record_part
        } else {
            &queries.record
        };
        let record = sqlx::query_scalar(query.clone())
            .bind(token.get())
            .bind(published)
            .bind(parked_ids)
            .bind(parked_reasons)
            .bind(parked_delays)
            .bind(dead_ids)
            .bind(dead_reasons)
            .bind(done_subscribers)
            .bind(done_ids)
            .bind(up.event_ids)
            .bind(up.subscribers)
            .bind(up.aggregate_types)
            .bind(up.aggregate_ids)
            .bind(up.attempts)
            .bind(up.errors)
            .bind(up.delays)
            .bind(up.dead)
            .bind(rel_subscribers)
            .bind(rel_ids);
        // What leaves the claim when the record is of part of it: every event it names.
        let record = if part {
            record.bind(
                outcomes
                    .events
                    .iter()
                    .map(|(id, _)| *id)
                    .collect::<Vec<i64>>(),
            )
        } else {
            record
        };
        if outcomes.deliveries.is_empty() {
            let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
            let live = record.fetch_one(&mut *tx).await?;
            tx.commit().await?;
            return Ok(recorded(live));
        }
        // Records that write deliveries of the same key take turns, each statement reading
        // after the previous record committed: the first row of a key is always due (see
        // `heads` in `record`), also when one record delivers the first row while another
        // writes a row behind it.
        let mut tx = pool.begin_with(queries.record_begin.clone()).await?;
        let (subscribers, aggregate_types, aggregate_ids): (Vec<&str>, Vec<&str>, Vec<Uuid>) =
            outcomes
                .deliveries
                .iter()
                .map(DeliveryRecord::key)
                .collect();
        sqlx::query(queries.lock_keys.clone())
            .bind(subscribers)
            .bind(aggregate_types)
            .bind(aggregate_ids)
            .execute(&mut *tx)
            .await?;
        let live: bool = record.fetch_one(&mut *tx).await?;
        tx.commit().await?;
        Ok(recorded(live))
    }

    async fn receive(
        conn: &mut PgConnection,
        queries: &PgQueries,
        consumer: &str,
        message_id: &str,
    ) -> Result<bool, sqlx::Error> {
        let inserted = sqlx::query(queries.receive.clone())
            .bind(consumer)
            .bind(message_id)
            .execute(conn)
            .await?
            .rows_affected();
        Ok(inserted == 1)
    }

    async fn hold_and_receive(
        conn: &mut PgConnection,
        queries: &PgQueries,
        token: ClaimToken,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<bool>, sqlx::Error> {
        let (held, new): (bool, bool) = sqlx::query_as(queries.hold_and_receive.clone())
            .bind(consumer)
            .bind(message_id)
            .bind(token.get())
            .fetch_one(conn)
            .await?;
        Ok(held.then_some(new))
    }

    async fn purge_inbox(
        pool: &PgPool,
        queries: &PgQueries,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, sqlx::Error> {
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let purged = sqlx::query(queries.purge_inbox.clone())
            .persistent(false)
            .bind(seconds(older_than))
            .bind(i64::from(batch_size))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(purged)
    }

    async fn purge_published(
        pool: &PgPool,
        queries: &PgQueries,
        older_than: Duration,
        batch_size: u32,
        after: Option<PurgedUpTo>,
    ) -> Result<PurgeStep, sqlx::Error> {
        let mut emptied = 0;
        if after.is_none() {
            // A purge from the oldest: first, whole partitions (when the table has them).
            let whole = match crate::partitions::maintain(pool, &queries.names, older_than).await {
                Ok(done) => {
                    if done != crate::partitions::Maintained::default() {
                        tracing::debug!(?done, "outbox purge worked on partitions");
                    }
                    emptied = done.events;
                    done.whole
                }
                Err(error) => {
                    tracing::warn!(%error, "outbox purge cannot work on partitions");
                    // Then every old event goes one by one, as without partitions.
                    (0, 0)
                }
            };
            *queries
                .purge_whole
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = whole;
        }
        // The round's, decided when it started from the oldest.
        let (start, end) = *queries
            .purge_whole
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let mut step = purge_step(
            &mut *tx,
            queries,
            older_than,
            i64::from(batch_size),
            after,
            start..end,
        )
        .await?;
        tx.commit().await?;
        step.deleted += emptied;
        Ok(step)
    }

    crate::views::operator_views!(
        PgPool,
        PgQueries,
        PgConnection,
        begin = |queries: &PgQueries| queries.by_index_begin.clone()
    );

    async fn published_within(
        pool: &PgPool,
        queries: &PgQueries,
        window: Duration,
    ) -> Result<u64, sqlx::Error> {
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let count: i64 = sqlx::query_scalar(queries.published_within.clone())
            .persistent(false)
            .bind(seconds(window))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(row_count(count))
    }

    async fn status(pool: &PgPool, queries: &PgQueries) -> Result<Status, sqlx::Error> {
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let status = status_in(&mut *tx, queries).await?;
        tx.commit().await?;
        Ok(status)
    }

    async fn skip(
        pool: &PgPool,
        queries: &PgQueries,
        event_id: i64,
        subscriber: Option<&str>,
        reason: &str,
    ) -> Result<bool, sqlx::Error> {
        let query = match subscriber {
            Some(subscriber) => sqlx::query(queries.skip_delivery.clone())
                .persistent(false)
                .bind(event_id)
                .bind(subscriber)
                .bind(reason),
            None => sqlx::query(queries.skip_event.clone())
                .persistent(false)
                .bind(event_id)
                .bind(reason),
        };
        // Under the claim lock: events held behind the skipped one are released, and no claim
        // may set more aside behind it on an older snapshot meanwhile.
        let mut tx = pool.begin_with(queries.locked_begin.clone()).await?;
        if let Some(subscriber) = subscriber {
            // As a record: the row behind the skipped one is due once it is the first.
            sqlx::query(queries.lock_delivery_key.clone())
                .persistent(false)
                .bind(event_id)
                .bind(subscriber)
                .execute(&mut *tx)
                .await?;
        }
        let skipped = query.execute(&mut *tx).await?.rows_affected() > 0;
        tx.commit().await?;
        Ok(skipped)
    }

    async fn notify(pool: &PgPool, channel: &str, sender: &str) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(channel)
            .bind(sender)
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn listen(
        pool: PgPool,
        channel: String,
        own: String,
        wake: Weak<Notify>,
        mut closed: watch::Receiver<bool>,
    ) {
        // A pool of one connection of its own, on the application pool's settings: the
        // application's pool lends nothing to the listener (a pool of one would be starved), and
        // closing it does not wait for the listener. The pool reconnects after a loss.
        let own_pool = PgPoolOptions::new()
            .max_connections(1)
            .max_lifetime(None)
            .idle_timeout(None)
            .connect_lazy_with((*pool.connect_options()).clone());
        drop(pool);
        loop {
            let outcome = tokio::select! {
                biased;
                _ = closed.wait_for(|closed| *closed) => break,
                outcome = listen_until_lost(&own_pool, &channel, &own, &wake) => outcome,
            };
            match outcome {
                Ok(()) => break,
                Err(error) => {
                    tracing::debug!(%error, "outbox relay lost its LISTEN connection; reconnecting");
                    tokio::select! {
                        biased;
                        _ = closed.wait_for(|closed| *closed) => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
        own_pool.close().await;
    }

    async fn begin_locked(
        pool: &PgPool,
        queries: &PgQueries,
    ) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        pool.begin_with(queries.locked_begin.clone()).await
    }

    async fn requeue_events(
        conn: &mut PgConnection,
        queries: &PgQueries,
        ids: &[i64],
    ) -> Result<u64, sqlx::Error> {
        let changed: i64 = sqlx::query_scalar(queries.requeue_events.clone())
            .persistent(false)
            .bind(ids)
            .fetch_one(conn)
            .await?;
        Ok(u64::try_from(changed).unwrap_or(0))
    }

    async fn requeue_deliveries(
        conn: &mut PgConnection,
        queries: &PgQueries,
        subscriber: &str,
        first_line: Option<&str>,
    ) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(queries.requeue_subscriber.clone())
            .persistent(false)
            .bind(subscriber)
            .bind(first_line)
            .execute(conn)
            .await?
            .rows_affected())
    }

    async fn requeues(
        pool: &PgPool,
        queries: &PgQueries,
        before: i64,
        limit: u32,
    ) -> Result<Vec<crate::RequeueRecord>, sqlx::Error> {
        let mut tx = pool.begin_with(queries.by_index_begin.clone()).await?;
        let rows = sqlx::query(queries.requeues.clone())
            .persistent(false)
            .bind(before)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows.iter()
            .map(|row| requeue_record(row, row.try_get("event_ids")?, row.try_get("requeued_at")?))
            .collect()
    }

    async fn record_requeue(
        conn: &mut PgConnection,
        queries: &PgQueries,
        named: &Named<'_>,
        requeued: u64,
        reason: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(queries.record_requeue.clone())
            .persistent(false)
            .bind(named.event_ids)
            .bind(named.subscriber)
            .bind(named.first_line)
            .bind(i64::try_from(requeued).unwrap_or(i64::MAX))
            .bind(reason)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// Passes notifications on `channel`, except those marked `own`, to `wake` until `wake` is gone
/// (`Ok`) or the connection is lost (`Err`). The caller stops it when the outbox closes.
async fn listen_until_lost(
    pool: &PgPool,
    channel: &str,
    own: &str,
    wake: &Weak<Notify>,
) -> Result<(), sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    // Notifications sent while not listening are lost: look once.
    let mut look = true;
    loop {
        let Some(wake) = wake.upgrade() else {
            return Ok(());
        };
        if look {
            wake.notify_one();
        }
        drop(wake);
        look = match listener.try_recv().await {
            Ok(Some(notification)) => notification.payload() != own,
            Ok(None) => return Err(sqlx::Error::PoolClosed),
            Err(error) => return Err(error),
        };
    }
}

/// Delivery rows to insert or update, as parallel arrays for `unnest`.
#[derive(Default)]
struct Upserts<'a> {
    event_ids: Vec<i64>,
    subscribers: Vec<&'a str>,
    aggregate_types: Vec<&'a str>,
    aggregate_ids: Vec<Uuid>,
    attempts: Vec<i32>,
    errors: Vec<Option<&'a str>>,
    delays: Vec<Option<f64>>,
    dead: Vec<bool>,
}

impl<'a> Upserts<'a> {
    fn push(
        &mut self,
        record: &'a DeliveryRecord,
        attempts: u32,
        error: Option<&'a String>,
        delay: Option<Duration>,
        dead: bool,
    ) {
        self.event_ids.push(record.event_id);
        self.subscribers.push(&record.subscriber);
        self.aggregate_types.push(&record.aggregate_type);
        self.aggregate_ids.push(record.aggregate_id);
        self.attempts
            .push(i32::try_from(attempts).unwrap_or(i32::MAX));
        self.errors.push(error.map(String::as_str));
        self.delays.push(delay.map(seconds));
        self.dead.push(dead);
    }
}

/// The status, read on `executor`.
async fn status_in<'c>(
    executor: impl PgExecutor<'c>,
    queries: &PgQueries,
) -> Result<Status, sqlx::Error> {
    type Row = (i64, Option<f64>, i64, i64, i64, i64, i64, i64);
    let (floor, released) = queries.scan_from();
    let (events, oldest, deliveries, dead, blocked, aggregates, held, behind_dead): Row =
        sqlx::query_as(queries.status.clone())
            .bind(floor)
            .bind(released)
            .fetch_one(executor)
            .await?;
    let mut status = Status::default();
    status.blocked_aggregates = row_count(aggregates);
    status.held_events = row_count(held);
    status.pending_events = row_count(events);
    status.oldest_pending_age =
        oldest.map(|age| Duration::try_from_secs_f64(age).unwrap_or_default());
    status.pending_deliveries = row_count(deliveries);
    status.dead_letters = row_count(dead);
    status.blocked_keys = row_count(blocked);
    status.behind_dead_letters = row_count(behind_dead);
    Ok(status)
}

/// One purge statement on `executor`: see [`Backend::purge_published`].
async fn purge_step<'c>(
    executor: impl PgExecutor<'c>,
    queries: &PgQueries,
    older_than: Duration,
    batch_size: i64,
    after: Option<PurgedUpTo>,
    whole: std::ops::Range<i64>,
) -> Result<PurgeStep, sqlx::Error> {
    let (deleted, published_at, id): (i64, Option<i64>, Option<i64>) =
        sqlx::query_as(queries.purge_published.clone())
            .bind(seconds(older_than))
            .bind(batch_size)
            .bind(after.map(|a| a.published_at))
            .bind(after.map(|a| a.id))
            .bind(whole.start)
            .bind(whole.end)
            .fetch_one(executor)
            .await?;
    Ok(PurgeStep {
        deleted: u64::try_from(deleted).unwrap_or(0),
        next: published_at
            .zip(id)
            .map(|(published_at, id)| PurgedUpTo { published_at, id }),
    })
}

/// Applies the migrations up to version `last` (all of them, but in tests of an upgrade).
async fn migrate_to(pool: &PgPool, names: &TableNames, last: i32) -> Result<(), Error> {
    let schema = names.quoted_schema();
    let migrations = names.qualified("_migrations");
    let mut tx = pool.begin().await?;
    // One migrator at a time per set of tables.
    sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
        .bind(names.lock_namespace())
        .execute(&mut *tx)
        .await?;
    tx.execute(sqlx::raw_sql(sql(format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};
         CREATE TABLE IF NOT EXISTS {migrations} (
             version     INTEGER PRIMARY KEY,
             description TEXT NOT NULL,
             applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
         );"
    ))))
    .await?;
    apply_migrations::<Postgres>(
        &mut tx,
        names,
        MIGRATIONS,
        last,
        &migrations,
        &format!("INSERT INTO {migrations} (version, description) VALUES ($1, $2)"),
        |template| names.render(template, |s| names.qualified(s), |s| names.local(s)),
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// A claimed row; a row whose values this build cannot read becomes [`Claim::Unreadable`].
fn claim_from_row(row: &PgRow) -> Result<Claim, sqlx::Error> {
    // By position, in the claim's column order: a claim is hundreds of rows.
    let id: i64 = row.try_get(1)?;
    let aggregate_type: String = row.try_get(2)?;
    let aggregate_id: Uuid = row.try_get(3)?;
    let read = || -> Result<Claim, sqlx::Error> {
        let occurred_at = row
            .try_get::<Option<i64>, _>(6)?
            .ok_or("occurred_at is not a finite time")
            .and_then(|micros| {
                OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1000)
                    .map_err(|_| "occurred_at is out of the range this build reads")
            })
            .map_err(|e| sqlx::Error::Decode(e.into()))?;
        let event = StoredEvent {
            id,
            aggregate_type: aggregate_type.clone(),
            aggregate_id,
            event_type: row.try_get(4)?,
            payload: row.try_get(5)?,
            occurred_at,
        };
        let attempts = count(row.try_get(7)?);
        let expired = count(row.try_get(8)?);
        Ok(match row.try_get::<Option<String>, _>(9)? {
            Some(subscriber) => Claim::Delivery {
                event,
                subscriber,
                attempts,
                expired,
            },
            None => Claim::Event {
                event,
                parked: attempts,
                expired,
                // NULL when no subscriber holds the aggregate back.
                blocked: row
                    .try_get::<Option<Vec<String>>, _>(10)?
                    .unwrap_or_default(),
            },
        })
    };
    Ok(read().unwrap_or_else(|error| Claim::Unreadable {
        id,
        subscriber: row.try_get(9).ok().flatten(),
        aggregate: Some((aggregate_type.clone(), aggregate_id)),
        reason: error.to_string(),
    }))
}

fn count(value: i32) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

/// The payload as JSONB takes it, and the exact text when JSONB cannot hold it: JSONB refuses
/// the escape `\u0000` (a NUL in a string), so such a payload is stored exactly in
/// `payload_text`, and in `payload` with U+FFFD in its place, for queries.
fn jsonb_payload(payload: &str) -> (std::borrow::Cow<'_, str>, Option<&str>) {
    if payload.contains("\\u0000") {
        (payload.replace("\\u0000", "\\ufffd").into(), Some(payload))
    } else {
        (payload.into(), None)
    }
}

/// The advisory lock key of an aggregate: publishers of one aggregate take ids one after the
/// other, so that id order is commit order within an aggregate.
fn lock_key(aggregate_id: Uuid) -> i32 {
    let bytes = aggregate_id.as_u128().to_le_bytes();
    let folded = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .fold(0u32, |acc, word| acc ^ word);
    i32::from_ne_bytes(folded.to_ne_bytes())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use outbox_tests::pg::TestDb;
    use serde_json::Value;
    use sqlx::AssertSqlSafe;

    use super::*;
    use crate::ListState;
    use crate::Outbox;
    use outbox_core::store::TakeOver;

    /// A fresh database with the outbox tables in their default names.
    /// The latest migration: tests that stop at an older one and then claim go on to it (the
    /// claim reads every table).
    const LATEST: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

    /// A claim of up to 10 events for a minute, nothing left to other builds.
    async fn claim_ten(pool: &PgPool, queries: &PgQueries) -> Batch {
        Postgres::claim(
            pool,
            queries,
            ClaimLimit::events(10),
            Duration::from_secs(60),
            &ClaimFilter::default(),
        )
        .await
        .unwrap()
    }

    async fn migrated() -> TestDb {
        let db = TestDb::new().await;
        Outbox::<Postgres, ()>::new(db.pool.clone())
            .migrate()
            .await
            .unwrap();
        db
    }

    /// Rows the nodes of `plan` that read `relation` produced or filtered out, over all loops.
    fn rows_read(plan: &Value, relation: &str) -> f64 {
        rows_read_of(plan, &|name| name == relation)
    }

    /// Rows the nodes of `plan` that read a relation whose name `of` accepts produced or
    /// filtered out, over all loops.
    fn rows_read_of(plan: &Value, of: &dyn Fn(&str) -> bool) -> f64 {
        let number = |key: &str| plan.get(key).and_then(Value::as_f64).unwrap_or(0.0);
        let own = if plan
            .get("Relation Name")
            .and_then(Value::as_str)
            .is_some_and(of)
        {
            (number("Actual Rows") + number("Rows Removed by Filter")) * number("Actual Loops")
        } else {
            0.0
        };
        let children = plan
            .get("Plans")
            .and_then(Value::as_array)
            .map_or(0.0, |plans| plans.iter().map(|p| rows_read_of(p, of)).sum());
        own + children
    }

    /// Pages of `relation` (its heap and its indexes) that the scans of `plan` read.
    fn blocks_read(plan: &Value, relation: &str) -> f64 {
        blocks_read_of(plan, &|name| name == relation)
    }

    /// Pages of the relations whose names `of` accepts that the scans of `plan` read.
    fn blocks_read_of(plan: &Value, of: &dyn Fn(&str) -> bool) -> f64 {
        let scan = plan
            .get("Node Type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.ends_with("Scan"));
        let blocks = |plan: &Value| {
            ["Shared Hit Blocks", "Shared Read Blocks"]
                .iter()
                .map(|key| plan.get(key).and_then(Value::as_f64).unwrap_or(0.0))
                .sum::<f64>()
        };
        let children = plan
            .get("Plans")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        // A node's counts include its children's: its own are the difference.
        let own = if scan
            && plan
                .get("Relation Name")
                .and_then(Value::as_str)
                .is_some_and(of)
        {
            blocks(plan) - children.iter().map(blocks).sum::<f64>()
        } else {
            0.0
        };
        own + children.iter().map(|p| blocks_read_of(p, of)).sum::<f64>()
    }

    /// The session of the connection the claims' slot keeps, if any.
    async fn kept_session(queries: &PgQueries) -> Option<i32> {
        let mut slot = queries.claimer.kept.lock().await;
        let conn = &mut slot.as_mut()?.conn;
        Some(
            sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(conn)
                .await
                .unwrap(),
        )
    }

    /// Claims run on one connection, kept between them, while the pool hands its connections
    /// out in turn (there, each connection's plan of the claim would be made again after every
    /// vacuum); one whose claim failed, or that sat unused too long, is let go, and so is the
    /// kept one when the outbox closes.
    #[tokio::test]
    async fn claims_run_on_one_connection_kept_between_them() {
        let db = migrated().await;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&db.url())
            .await
            .unwrap();
        // The pool holds several idle connections.
        let lend_all = async || {
            let mut lent = Vec::new();
            for _ in 0..4 {
                lent.push(pool.acquire().await.unwrap());
            }
        };
        lend_all().await;
        let outbox = Outbox::<Postgres, ()>::new(pool.clone());
        let queries = outbox.queries();
        assert_eq!(kept_session(queries).await, None);
        claim_ten(&pool, queries).await;
        let first = kept_session(queries).await.expect("a connection is kept");
        for _ in 0..5 {
            claim_ten(&pool, queries).await;
            assert_eq!(kept_session(queries).await, Some(first));
        }
        // The kept connection is not one of the pool's: the pool can still lend all four.
        lend_all().await;

        // Its session ends: the claim on it fails (the relay tries again at once, as after any
        // broken connection) and lets it go; the next claim runs on another.
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(first)
            .execute(&db.pool)
            .await
            .unwrap();
        let error = Postgres::claim(
            &pool,
            queries,
            ClaimLimit::events(10),
            Duration::from_secs(60),
            &ClaimFilter::default(),
        )
        .await
        .expect_err("the kept connection's session is gone");
        let error = crate::outbox::store_error(error);
        assert!(error.is_connection_lost(), "{error}");
        assert_eq!(kept_session(queries).await, None);
        claim_ten(&pool, queries).await;
        let second = kept_session(queries).await.expect("a connection is kept");
        assert_ne!(second, first);

        // Unused for longer than CLAIMER_IDLE: let go, another taken.
        if let Some(kept) = queries.claimer.kept.lock().await.as_mut() {
            kept.used -= CLAIMER_IDLE;
        }
        claim_ten(&pool, queries).await;
        let third = kept_session(queries).await.expect("a connection is kept");
        assert_ne!(third, second);

        outbox.close();
        assert_eq!(kept_session(queries).await, None);
        claim_ten(&pool, queries).await;
        assert_eq!(kept_session(queries).await, None, "none kept once closed");
    }

    /// Another relay's claim holds its events' aggregates back: their later events are not
    /// claimed until it is recorded or expires. Claims written before migration 5 (with their
    /// aggregate ids since migration 4, without before) are completed by the migration and hold
    /// their aggregates back too.
    #[tokio::test]
    async fn another_claim_holds_its_aggregates_back_also_one_written_before_migration_5() {
        let db = TestDb::new().await;
        let names = TableNames::default();
        migrate_to(&db.pool, &names, 4).await.unwrap();
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let ids: Vec<i64> = sqlx::query_scalar(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 't', x.aggregate_id, 'E', '{}'
             FROM unnest($1::uuid[]) WITH ORDINALITY AS x(aggregate_id, n)
             ORDER BY x.n
             RETURNING id",
        )
        .bind([a, b, a, b, c])
        .fetch_all(&db.pool)
        .await
        .unwrap();
        // Event 0 (of a) claimed as a version 4 relay did, event 1 (of b) as an earlier one.
        sqlx::query(
            "INSERT INTO events.outbox_claims (until, event_ids, aggregate_ids)
             VALUES (now() + interval '1 minute', ARRAY[$1::int8], ARRAY[$2::uuid]),
                    (now() + interval '1 minute', ARRAY[$3::int8], NULL)",
        )
        .bind(ids[0])
        .bind(a)
        .bind(ids[1])
        .execute(&db.pool)
        .await
        .unwrap();
        migrate_to(&db.pool, &names, LATEST).await.unwrap();
        let queries = Postgres::queries(&names);
        let batch = claim_ten(&db.pool, &queries).await;
        let claimed: Vec<i64> = batch.claims.iter().map(Claim::event_id).collect();
        assert_eq!(
            claimed,
            [ids[4]],
            "only c's event is free: a and b are held back by the claims of their first events"
        );
    }

    /// A claim reads about a batch of the outbox, however large the backlog, even when the
    /// statistics still say that nothing is pending (autovacuum analyzes a large table rarely) and
    /// another relay holds a batch. Both conditions once made the claim read the whole backlog,
    /// which slowed claims as the backlog grew, until the relay fell behind for good.
    #[tokio::test]
    async fn a_claim_reads_a_batch_not_the_backlog_whatever_the_statistics() {
        const BATCH: i64 = 100;
        const BACKLOG: i64 = 100 * BATCH;
        let db = migrated().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, 2000);
             ANALYZE events.outbox;
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}' FROM generate_series(1, {BACKLOG});
             INSERT INTO events.outbox_claims (until, event_ids, aggregate_types, aggregate_ids)
             SELECT now() + interval '1 hour', array_agg(id), array_agg(aggregate_type),
                    array_agg(aggregate_id)
             FROM (
                 SELECT id, aggregate_type, aggregate_id FROM events.outbox
                 WHERE published_at IS NULL ORDER BY id
                 LIMIT {BATCH}) AS held;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        let mut conn = db.pool.acquire().await.unwrap();
        let plan = explain_claim(&mut conn, BATCH, true).await;
        // A batch, and the row that says how many events were set aside.
        assert_eq!(plan["Actual Rows"], BATCH + 1, "the claim took a batch");
        let read = rows_read(&plan, "outbox");
        assert!(
            read <= (10 * BATCH) as f64,
            "a claim of {BATCH} read {read} rows of a backlog of {BACKLOG}: {plan:#}"
        );
    }

    /// Runs a claim of `batch` as the relay does (its transaction's settings, a generic plan) on
    /// `conn`, under EXPLAIN ANALYZE, and returns the plan; commits the claim or rolls it back.
    async fn explain_claim(conn: &mut PgConnection, batch: i64, rollback: bool) -> Value {
        let fresh = Postgres::queries(&TableNames::default());
        explain_claim_of(conn, batch, rollback, &fresh).await
    }

    /// [`explain_claim`] by a relay whose earlier claims went through `queries`: from the floors
    /// they left.
    async fn explain_claim_of(
        conn: &mut PgConnection,
        batch: i64,
        rollback: bool,
        queries: &PgQueries,
    ) -> Value {
        let claims_floor = queries.claims_floor.load(Relaxed);
        let (events_floor, released) = queries.events_floor.lock().unwrap().scan_from();
        let queries = Postgres::queries(&TableNames::default());
        let prepared: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = 'claim')",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        conn.execute(sqlx::raw_sql(queries.claim_begin.clone()))
            .await
            .unwrap();
        if !prepared {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "PREPARE claim(int8, float8, float8, text[], text[], int8, int8, int8, int8[],
                               text[], uuid[], int8[], int8) AS {}",
                queries.claim.as_str()
            )))
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        let plan = explain_execute(
            &mut *conn,
            &format!(
                "claim({batch}, 30, 1, '{{}}', '{{}}', {claims_floor}, {events_floor},
                       {released}, '{{}}', '{{}}', '{{}}', '{{}}', {})",
                i64::MAX
            ),
        )
        .await;
        let end = if rollback { "ROLLBACK" } else { "COMMIT" };
        conn.execute(end).await.unwrap();
        plan
    }

    /// The plan of `EXECUTE {statement}`, run, with the buffers each node read.
    async fn explain_execute(conn: &mut PgConnection, statement: &str) -> Value {
        // `json` is sent as its text; this crate does not enable sqlx's `json` feature.
        let explained: String = sqlx::query(AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {statement}"
        )))
        .fetch_one(conn)
        .await
        .unwrap()
        .try_get_unchecked(0)
        .unwrap();
        serde_json::from_str::<Value>(&explained).unwrap()[0]["Plan"].clone()
    }

    /// A claim's plan is made once and kept (a generic plan, on the connection the relay keeps
    /// for claims) until a table it reads changes: a vacuum, a partition made or emptied. Made
    /// while a partition was empty as a vacuum left it (no rows, no pages), it scanned that
    /// partition whole, at each of the claim's reads of the events table, once events filled
    /// it: claims of 50 to 100 ms, for seconds on end, in the pressure benchmark (until the next
    /// vacuum had the plan made again). The claim reads by index whatever a table held when
    /// its plan was made.
    #[tokio::test]
    async fn a_claim_planned_while_a_partition_was_empty_reads_it_by_index_once_it_fills() {
        const PUBLISHED: i64 = 20_000;
        let (db, queries, mut conn) = vacuumed_empty_partitions().await;
        // Planned with every partition empty (and kept: nothing below changes a table's
        // definition or its statistics).
        let plan = explain_claim_of(&mut conn, 10, true, &queries).await;
        assert_eq!(plan["Actual Rows"], 1, "nothing to claim yet");
        // The relay's floor, as its claims would have set it: past the published events (from
        // the start, a scan of the primary key would read them all, whatever the plan).
        queries.events_floor.lock().unwrap().floor = fill(&db.pool, PUBLISHED, TEN_PENDING).await;
        let plan = explain_claim_of(&mut conn, 10, true, &queries).await;
        assert_eq!(
            plan["Actual Rows"], 11,
            "the claim took the 10 pending events"
        );
        let pages = blocks_read_of(&plan, &|name| name.starts_with("outbox_p"));
        assert!(
            pages <= 40.0,
            "a claim read {pages} pages of the partitions ({PUBLISHED} events kept): {plan:#}"
        );
    }

    /// Rows the nodes of `plan` produced or filtered out (by a filter, a join's filter or an
    /// index recheck), over all their loops: the work the plan did, wherever it did it.
    /// The events claim 1 still lists (its arrays, less what records of parts of it took
    /// out); `None` if it is over.
    async fn listed_by_claim_1(pool: &PgPool) -> Option<Vec<i64>> {
        sqlx::query_scalar(
            "SELECT ARRAY(SELECT e FROM unnest(c.event_ids) AS e WHERE e NOT IN (
                 SELECT unnest(p.event_ids) FROM events.outbox_claim_parts AS p
                 WHERE p.claim_id = c.id))
             FROM events.outbox_claims AS c WHERE c.id = 1",
        )
        .fetch_optional(pool)
        .await
        .unwrap()
    }

    fn work_of(plan: &Value) -> f64 {
        let number = |key: &str| plan.get(key).and_then(Value::as_f64).unwrap_or(0.0);
        let own = (number("Actual Rows")
            + number("Rows Removed by Filter")
            + number("Rows Removed by Join Filter")
            + number("Rows Removed by Index Recheck"))
            * number("Actual Loops");
        let children = plan
            .get("Plans")
            .and_then(Value::as_array)
            .map_or(0.0, |plans| plans.iter().map(work_of).sum());
        own + children
    }

    /// A claim joined its parts in nested loops, a batch times a batch, whenever the planner
    /// believed they held a row or two (a plan made while the tables were empty, or made on
    /// tables never analyzed): a claim of 2 000 events over 20 aggregates behind a
    /// subscriber's waiting deliveries compared every candidate with every claimable event
    /// and looked the waiting subscribers up again for each, 3.5 s. A few thousand events
    /// more, and it ran past the claim's timeout (10 s) at each try: the relay delivered
    /// nothing more (a broker down for ten seconds left such a backlog, and
    /// `a_broker_down_for_ten_seconds_loses_nothing_and_doubles_nothing` failed one run in
    /// five). The claim's parts meet without joins now: its work grows with its batch, not
    /// with its square. (Planned on tables that hold what they hold here, vacuumed while empty:
    /// a plan made while they were empty is made again once they grow, below.)
    #[tokio::test]
    async fn a_claims_work_grows_with_its_batch_not_its_square_whatever_its_plan() {
        const BATCH: i64 = 2_000;
        let db = migrated().await;
        sqlx::raw_sql("VACUUM").execute(&db.pool).await.unwrap();
        let queries = Postgres::queries(&TableNames::default());
        sqlx::raw_sql(AssertSqlSafe(format!(
            "-- 20 aggregates whose subscriber 'slow' waits for a retry of an earlier event...
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', md5('a' || g)::uuid, 'E', '{{}}', now() FROM generate_series(0, 19) AS g;
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at)
             SELECT id, 'slow', aggregate_type, aggregate_id, 1, now() + interval '1 hour'
             FROM events.outbox;
             -- ...and 1 000 aggregates with a dead event.
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, dead_at)
             SELECT 'c', md5('c' || g)::uuid, 'E', '{{}}', now() FROM generate_series(1, 1000) AS g;
             -- A batch of events: half of them behind the waiting deliveries, half behind the
             -- dead events.
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT CASE WHEN g % 2 = 0 THEN 'a' ELSE 'c' END,
                    CASE WHEN g % 2 = 0 THEN md5('a' || g % 20) ELSE md5('c' || g / 2 + 1)
                    END::uuid,
                    'E', '{{}}'
             FROM generate_series(0, {BATCH} - 1) AS g;
             -- 100 more aggregates whose subscriber 'slow' waits: 10 000 deliveries behind
             -- heads due in an hour.
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'w', md5('w' || g % 100)::uuid, 'E', '{{}}', now()
             FROM generate_series(1, 10000) AS g;
             -- And 20 keys of subscriber 'up' due again, 50 deliveries each (a key free again
             -- drains in bulk).
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'd', md5('d' || g % 20)::uuid, 'E', '{{}}', now()
             FROM generate_series(1, 1000) AS g;
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at)
             SELECT id, CASE WHEN aggregate_type = 'w' THEN 'slow' ELSE 'up' END,
                    aggregate_type, aggregate_id, (first)::int,
                    CASE WHEN first AND aggregate_type = 'w' THEN now() + interval '1 hour'
                         WHEN first THEN now() END
             FROM (SELECT id, aggregate_type, aggregate_id,
                          row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1 AS first
                   FROM events.outbox WHERE aggregate_type IN ('w', 'd')) AS o;
             -- Another relay's live claim of a batch of other aggregates.
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'b', gen_random_uuid(), 'E', '{{}}' FROM generate_series(1, {BATCH});
             INSERT INTO events.outbox_claims
                 (until, claimed_at, event_ids, aggregate_types, aggregate_ids)
             SELECT now() + interval '1 hour', now(), array_agg(id ORDER BY id),
                    array_agg(aggregate_type ORDER BY id), array_agg(aggregate_id ORDER BY id)
             FROM events.outbox WHERE aggregate_type = 'b';"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let mut conn = db.pool.acquire().await.unwrap();
        let plan = explain_claim_of(&mut conn, BATCH, true, &queries).await;
        assert_eq!(
            plan["Actual Rows"],
            BATCH / 2 + 1000 + 1,
            "the claim took the events behind the waiting deliveries (not those behind the dead \
             ones) and the deliveries due: {plan:#}"
        );
        let work = work_of(&plan);
        assert!(
            work <= (60 * BATCH) as f64,
            "a claim of {BATCH} did the work of {work} rows: {plan:#}"
        );
        // What the claim takes (the explained one was rolled back): each event with the
        // subscriber it waits for, each key's deliveries from its head on, in order.
        let batch = Postgres::claim(
            &db.pool,
            &queries,
            ClaimLimit::events(BATCH as u32),
            Duration::from_secs(60),
            &ClaimFilter::default(),
        )
        .await
        .unwrap();
        let mut events = 0;
        let mut keys: std::collections::HashMap<Uuid, Vec<i64>> = Default::default();
        for claim in &batch.claims {
            match claim {
                Claim::Event { event, blocked, .. } => {
                    assert_eq!(event.aggregate_type, "a");
                    assert_eq!(blocked, &["slow"], "event {}", event.id);
                    events += 1;
                }
                Claim::Delivery {
                    event, subscriber, ..
                } => {
                    assert_eq!(
                        (subscriber.as_str(), event.aggregate_type.as_str()),
                        ("up", "d")
                    );
                    keys.entry(event.aggregate_id).or_default().push(event.id);
                }
                Claim::Unreadable { reason, .. } => panic!("{reason}"),
            }
        }
        assert_eq!(events, BATCH / 2);
        assert_eq!(keys.len(), 20);
        for ids in keys.values() {
            assert_eq!(ids.len(), 50);
            assert!(ids.is_sorted(), "{ids:?}");
        }
    }

    /// The name and the time of preparation of the claim statement on the claims' connection.
    async fn claim_prepared(queries: &PgQueries) -> (String, String) {
        let mut slot = queries.claimer.kept.lock().await;
        let conn = &mut slot.as_mut().expect("a connection is kept").conn;
        sqlx::query_as(
            "SELECT name, prepare_time::text FROM pg_prepared_statements
             WHERE statement LIKE '%Expired claims end%'",
        )
        .fetch_one(conn)
        .await
        .unwrap()
    }

    /// The claim's generic plan is made at its first run on the claims' connection, and kept
    /// until a table it reads changes its statistics (which autovacuum may do late, or never:
    /// it is a setting). Made while the tables were empty, it picks among their indexes
    /// blindly: it read a key's deliveries through `deliveries_event_idx` once deliveries
    /// waited, every later delivery of every key at each probe. The claimer has it made again
    /// once a claim finds that a table has outgrown what it was made for, and keeps it while
    /// the sizes settle.
    #[tokio::test]
    async fn a_claim_planned_while_the_tables_were_empty_is_planned_again_once_they_grow() {
        let db = migrated().await;
        sqlx::raw_sql("VACUUM").execute(&db.pool).await.unwrap();
        let queries = Postgres::queries(&TableNames::default());
        claim_ten(&db.pool, &queries).await;
        let first = claim_prepared(&queries).await;
        claim_ten(&db.pool, &queries).await;
        assert_eq!(
            claim_prepared(&queries).await,
            first,
            "kept while nothing grows"
        );
        // 10 000 deliveries wait behind heads due in an hour (nothing to claim).
        sqlx::raw_sql(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'w', md5('w' || g % 100)::uuid, 'E', '{}', now()
             FROM generate_series(1, 10000) AS g;
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at)
             SELECT id, 'slow', aggregate_type, aggregate_id, (first)::int,
                    CASE WHEN first THEN now() + interval '1 hour' END
             FROM (SELECT id, aggregate_type, aggregate_id,
                          row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1 AS first
                   FROM events.outbox) AS o",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        // The first claim after runs the plan it finds, and drops it; the next makes another.
        claim_ten(&db.pool, &queries).await;
        claim_ten(&db.pool, &queries).await;
        let second = claim_prepared(&queries).await;
        assert_ne!(second, first, "planned again once the tables grew");
        claim_ten(&db.pool, &queries).await;
        assert_eq!(
            claim_prepared(&queries).await,
            second,
            "kept once they settle"
        );
    }

    /// A plan is made again when a table has more than doubled and grown by
    /// [`REPLAN_GROWTH`] since it was made: not for every page, not when tables shrink.
    #[test]
    fn a_claim_plan_is_outgrown_by_a_table_that_doubled_and_grew() {
        let planned = TableSizes([0, 8192 * 100]);
        let outgrown = |sizes| planned.outgrown_by(TableSizes(sizes));
        assert!(!outgrown([0, 8192 * 100]));
        assert!(!outgrown([REPLAN_GROWTH, 8192 * 100]), "a few pages more");
        assert!(outgrown([REPLAN_GROWTH + 8192, 8192 * 100]));
        assert!(
            !outgrown([0, 8192 * 200 + REPLAN_GROWTH]),
            "doubled, grown by the growth"
        );
        assert!(outgrown([0, 8192 * 201 + REPLAN_GROWTH]));
        assert!(!outgrown([0, 0]), "shrunk");
        assert!(!TableSizes([i64::MAX, 0]).outgrown_by(TableSizes([i64::MAX, 0])));
    }

    /// A database whose events table is partitioned by id, every partition vacuumed while
    /// empty (no rows, no pages: as a vacuum leaves a partition made ahead), and a connection.
    async fn vacuumed_empty_partitions() -> (TestDb, PgQueries, sqlx::pool::PoolConnection<Postgres>)
    {
        let db = migrated().await;
        Outbox::<Postgres, ()>::new(db.pool.clone())
            .partition_by_id(100_000)
            .await
            .unwrap();
        sqlx::raw_sql("VACUUM events.outbox")
            .execute(&db.pool)
            .await
            .unwrap();
        let conn = db.pool.acquire().await.unwrap();
        (db, Postgres::queries(&TableNames::default()), conn)
    }

    /// Prepares `statement` as `name` (`types`: its parameters' types, or empty to let the
    /// server infer them) on `conn` and runs `{name}{args}` often enough, each time in a
    /// transaction begun by `begin` before `setup`, that its plan is the generic one, kept.
    async fn plan_generic(
        conn: &mut PgConnection,
        name: &str,
        types: &str,
        statement: &SqlStr,
        (begin, setup): (&SqlStr, &str),
        args: &str,
    ) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "PREPARE {name}{types} AS {}",
            statement.as_str()
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        for _ in 0..8 {
            conn.execute(sqlx::raw_sql(begin.clone())).await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(format!("{setup}; EXECUTE {name}{args}")))
                .execute(&mut *conn)
                .await
                .unwrap();
            conn.execute("COMMIT").await.unwrap();
        }
    }

    /// Rows of the partitions that `EXECUTE {statement}` read, run under EXPLAIN in a
    /// transaction begun by `begin` before `setup`, then rolled back.
    async fn partition_rows_read(
        conn: &mut PgConnection,
        (begin, setup): (&SqlStr, &str),
        statement: &str,
    ) -> (f64, Value) {
        conn.execute(sqlx::raw_sql(begin.clone())).await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(setup.to_owned()))
            .execute(&mut *conn)
            .await
            .unwrap();
        let plan = explain_execute(&mut *conn, statement).await;
        conn.execute("ROLLBACK").await.unwrap();
        (
            rows_read_of(&plan, &|name| name.starts_with("outbox_p")),
            plan,
        )
    }

    /// Inserts `published` published events, then runs `more` (SQL), on `pool`; returns the id
    /// of the first unpublished event: the relay's floor, as its claims would have set it.
    async fn fill(pool: &PgPool, published: i64, more: &str) -> i64 {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now()
             FROM generate_series(1, {published});
             {more}"
        )))
        .execute(pool)
        .await
        .unwrap();
        sqlx::query_scalar(
            "SELECT coalesce(min(id), 0) FROM events.outbox WHERE published_at IS NULL",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// Ten pending events.
    const TEN_PENDING: &str = "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
                               SELECT 'a', gen_random_uuid(), 'E', '{}' FROM generate_series(1, 10)";

    /// The records are prepared once per pooled connection, and their generic plans are kept
    /// as the claim's are: made while a partition was empty as a vacuum left it, the plan of a
    /// record of published events scanned that partition whole, twice, once events filled it
    /// (40 020 rows read to record ten events beside 20 000 kept). Every record reads the
    /// events by index, whatever a partition held when its plan was made, in a transaction
    /// begun as the relay begins it.
    #[tokio::test]
    async fn records_planned_while_a_partition_was_empty_read_it_by_index_once_it_fills() {
        const PUBLISHED: i64 = 20_000;
        let (db, queries, mut conn) = vacuumed_empty_partitions().await;
        // Claim 1, live.
        let claim = "INSERT INTO events.outbox_claims (id, until, event_ids, aggregate_types,
                                                       aggregate_ids)
                     VALUES (1, now() + interval '1 hour', '{}', '{}', '{}')
                     ON CONFLICT (id) DO NOTHING";
        // (name, statement, how the relay begins its transaction, its arguments after the
        // claim and the events published)
        let empty = "'{}', ".repeat(17);
        let statements = [
            (
                "published",
                &queries.record_published,
                &queries.by_index_begin,
                String::new(),
            ),
            (
                "published_part",
                &queries.record_published_part,
                &queries.by_index_begin,
                String::new(),
            ),
            (
                "record",
                &queries.record,
                &queries.record_begin,
                format!(", {}", empty.trim_end_matches(", ")),
            ),
            (
                "record_part",
                &queries.record_part,
                &queries.by_index_begin,
                format!(", {empty}'{{1}}'"),
            ),
        ];
        for (name, statement, begin, rest) in &statements {
            let args = format!("(1, '{{1, 2, 3}}'{rest})");
            plan_generic(&mut conn, name, "", statement, (begin, claim), &args).await;
        }
        fill(&db.pool, PUBLISHED, TEN_PENDING).await;
        let pending: Vec<String> =
            sqlx::query_scalar("SELECT id::text FROM events.outbox WHERE published_at IS NULL")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let pending = pending.join(", ");
        let mut read = Vec::new();
        for (name, _, begin, rest) in &statements {
            // (Rolled back: the next statement records the same events.)
            let statement = format!("{name}(1, '{{{pending}}}'{rest})");
            let (rows, _) = partition_rows_read(&mut conn, (begin, claim), &statement).await;
            read.push((*name, rows));
        }
        // (Ten events, looked up in each of the four partitions: a plan made for them all.)
        assert!(
            read.iter().all(|&(_, rows)| rows <= 100.0),
            "rows of the partitions ({PUBLISHED} events kept) each record read: {read:?}"
        );
    }

    /// A purge's step is prepared once per pooled connection too: planned while a partition
    /// was empty as a vacuum left it, it read every event of that partition, young ones
    /// included, at each step once events filled it (60 030 rows read to delete 10 beside
    /// 20 000 young events; with sequential scans off, its delete still joined them all, 20 030,
    /// until it looked up its ids as an array). It reads the old events by index, whatever a
    /// partition held when its plan was made, in a transaction begun as the purge begins it.
    #[tokio::test]
    async fn a_purge_planned_while_a_partition_was_empty_reads_only_old_events_once_it_fills() {
        const YOUNG: i64 = 20_000;
        let (db, queries, mut conn) = vacuumed_empty_partitions().await;
        let begin = (&queries.by_index_begin, "SELECT 1");
        // A minute's retention, 500 a step, from the oldest, no partition left whole.
        let step = "(60, 500, NULL, NULL, 0, 0)";
        let types = "(float8, int8, int8, int8, int8, int8)";
        plan_generic(
            &mut conn,
            "purge",
            types,
            &queries.purge_published,
            begin,
            step,
        )
        .await;
        fill(
            &db.pool,
            YOUNG,
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{}', now() - interval '1 day'
             FROM generate_series(1, 10)",
        )
        .await;
        let (read, plan) = partition_rows_read(&mut conn, begin, &format!("purge{step}")).await;
        assert!(
            read <= 100.0,
            "a purge step read {read} rows of the partitions to delete 10 ({YOUNG} young events \
             kept): {plan:#}"
        );
        let deleted = purge_step(&db.pool, &queries, Duration::from_secs(60), 500, None, 0..0)
            .await
            .unwrap()
            .deleted;
        assert_eq!(deleted, 10, "the old events, not the young");
    }

    /// The relay's status, every status interval, is prepared once per pooled connection too:
    /// planned while a partition was empty as a vacuum left it, its counts scanned that
    /// partition whole, four times, once events filled it (80 072 rows read beside 20 000
    /// published events). It reads the partial indexes of what is not published, whatever a
    /// partition held when its plan was made, in a transaction begun as the status begins it.
    #[tokio::test]
    async fn a_status_planned_while_a_partition_was_empty_reads_what_is_unpublished_once_it_fills()
    {
        const PUBLISHED: i64 = 20_000;
        let (db, queries, mut conn) = vacuumed_empty_partitions().await;
        let begin = (&queries.by_index_begin, "SELECT 1");
        plan_generic(
            &mut conn,
            "status",
            "(int8, int8)",
            &queries.status,
            begin,
            "(0, 0)",
        )
        .await;
        let floor = fill(
            &db.pool,
            PUBLISHED,
            &format!(
                "{TEN_PENDING};
                 INSERT INTO events.outbox
                     (aggregate_type, aggregate_id, event_type, payload, held_by)
                 SELECT 'a', gen_random_uuid(), 'E', '{{}}', 1 FROM generate_series(1, 5);
                 INSERT INTO events.outbox
                     (aggregate_type, aggregate_id, event_type, payload, dead_at)
                 SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, 3)"
            ),
        )
        .await;
        queries.events_floor.lock().unwrap().floor = floor;
        let statement = format!("status({floor}, 0)");
        let (read, plan) = partition_rows_read(&mut conn, begin, &statement).await;
        assert!(
            read <= 100.0,
            "the status read {read} rows of the partitions ({PUBLISHED} published events kept, \
             18 not): {plan:#}"
        );
        let status = Postgres::status(&db.pool, &queries).await.unwrap();
        assert_eq!(
            (
                status.pending_events,
                status.held_events,
                status.dead_letters
            ),
            (15, 5, 3),
            "pending (nothing holds them, or held), held, dead"
        );
    }

    /// So is its count of what no live relay routes (40 020 rows read beside 20 000 published
    /// events; with sequential scans off, its join of deliveries to their events still read
    /// them all until each delivery's event was looked up by its id): it reads the unpublished
    /// events, whatever a partition held when its plan was made.
    #[tokio::test]
    async fn an_unroutable_count_planned_while_a_partition_was_empty_reads_what_is_unpublished() {
        const PUBLISHED: i64 = 20_000;
        let (db, queries, mut conn) = vacuumed_empty_partitions().await;
        let begin = (&queries.by_index_begin, "SELECT 1");
        let types = "(text[], text[], int8, int8)";
        let args = "('{E}', '{}', 0, 0)";
        plan_generic(
            &mut conn,
            "unroutable",
            types,
            &queries.unroutable,
            begin,
            args,
        )
        .await;
        let floor = fill(
            &db.pool,
            PUBLISHED,
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'Unknown', '{}' FROM generate_series(1, 10)",
        )
        .await;
        queries.events_floor.lock().unwrap().floor = floor;
        let statement = format!("unroutable('{{E}}', '{{}}', {floor}, 0)");
        let (read, plan) = partition_rows_read(&mut conn, begin, &statement).await;
        assert!(
            read <= 100.0,
            "the count read {read} rows of the partitions ({PUBLISHED} published events kept, \
             10 not): {plan:#}"
        );
        let (events, _, _) = Postgres::unroutable(&db.pool, &queries, vec!["E".into()], vec![])
            .await
            .unwrap();
        assert_eq!(events, 10, "the events of a type no relay routes");
    }

    /// Rows read so far of the tables of schema `events` whose names are `LIKE` `pattern`:
    /// by their sequential scans, and index entries by the scans of their indexes; counted
    /// once the session of `pool` (a pool of one connection) flushed its counts to the
    /// server's statistics.
    async fn rows_read_so_far(pool: &PgPool, pattern: &str) -> i64 {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(pool)
            .await
            .unwrap();
        sqlx::query_scalar(
            "SELECT (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables
                     WHERE schemaname = 'events' AND relname LIKE $1)::int8
                  + (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
                     WHERE schemaname = 'events' AND relname LIKE $1)::int8",
        )
        .bind(pattern)
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// A lease's renewal (run every quarter of a lease, on the relay's pool), and a handler's
    /// hold of its claim (in the handler's own transaction, alone or with the inbox's record)
    /// read the claims table by id. Prepared once per connection and kept, their plans were
    /// made again only when the table's statistics changed: made while the table was empty,
    /// as a vacuum leaves it, they scanned it whole once claims filled it (as a session
    /// holding an old snapshot makes them pile up), at each run: 50 000 rows read by each.
    /// They read the one claim, whatever the table held when they were first run.
    #[tokio::test]
    async fn a_renewal_or_a_hold_of_a_claim_reads_one_claim_whatever_the_table_held_before() {
        const CLAIMS: i64 = 50_000;
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        sqlx::raw_sql(
            "INSERT INTO events.outbox_claims (id, until, event_ids) VALUES (1, now(), '{}');
             DELETE FROM events.outbox_claims",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::raw_sql("VACUUM events.outbox_claims")
            .execute(&db.pool)
            .await
            .unwrap();
        // One connection: every statement below runs on the same session, as the relay's and a
        // handler's statements come back to the same pooled connections.
        let pool = db.pool_named("claims", 1).await;
        let token = ClaimToken::new(1);
        let minute = Duration::from_secs(60);
        // While the table is empty, more often than the server takes to keep a plan.
        for round in 0..8 {
            assert!(
                !Postgres::renew(&pool, &queries, token, minute)
                    .await
                    .unwrap()
            );
            let mut tx = pool.begin().await.unwrap();
            assert!(
                !Postgres::hold_claim(&mut tx, &queries, token)
                    .await
                    .unwrap()
            );
            let message = format!("m{round}");
            let held = Postgres::hold_and_receive(&mut tx, &queries, token, "c", &message);
            assert_eq!(held.await.unwrap(), None, "no claim to hold yet");
            tx.rollback().await.unwrap();
        }
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox_claims (id, until, event_ids)
             SELECT n, now() + interval '1 hour', '{{}}' FROM generate_series(1, {CLAIMS}) AS n"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut read = Vec::new();
        let before = rows_read_so_far(&pool, "outbox\\_claims").await;
        assert!(
            Postgres::renew(&pool, &queries, token, minute)
                .await
                .unwrap()
        );
        let after = rows_read_so_far(&pool, "outbox\\_claims").await;
        read.push(("renew", after - before));
        let mut tx = pool.begin().await.unwrap();
        assert!(
            Postgres::hold_claim(&mut tx, &queries, token)
                .await
                .unwrap()
        );
        tx.rollback().await.unwrap();
        let before = after;
        let after = rows_read_so_far(&pool, "outbox\\_claims").await;
        read.push(("hold_claim", after - before));
        let mut tx = pool.begin().await.unwrap();
        let held = Postgres::hold_and_receive(&mut tx, &queries, token, "c", "new");
        assert_eq!(
            held.await.unwrap(),
            Some(true),
            "held, and the message is new"
        );
        tx.rollback().await.unwrap();
        let before = after;
        let after = rows_read_so_far(&pool, "outbox\\_claims").await;
        read.push(("hold_and_receive", after - before));
        assert!(
            read.iter().all(|&(_, rows)| rows <= 10),
            "rows of the claims table ({CLAIMS} claims) each statement read: {read:?}"
        );
    }

    /// Rows read (see [`rows_read_so_far`]) of the tables named `LIKE` `pattern` since `at`,
    /// which becomes now.
    async fn rows_read_since(pool: &PgPool, pattern: &str, at: &mut i64) -> i64 {
        let now = rows_read_so_far(pool, pattern).await;
        let read = now - *at;
        *at = now;
        read
    }

    /// Each read of an operator's console (the sampler's count of what was published in the
    /// last minute, the overview, a page of each state, the dead letters' groups, the
    /// subscribers) once, on `pool`, each with the rows of the partitions it read.
    async fn console_reads(pool: &PgPool, queries: &PgQueries) -> Vec<(String, i64)> {
        let partitions = "outbox\\_p%";
        let mut at = rows_read_so_far(pool, partitions).await;
        let mut read = Vec::new();
        Postgres::published_within(pool, queries, Duration::from_secs(60))
            .await
            .unwrap();
        let rows = rows_read_since(pool, partitions, &mut at).await;
        read.push(("published_within".to_owned(), rows));
        Postgres::overview(pool, queries).await.unwrap();
        let rows = rows_read_since(pool, partitions, &mut at).await;
        read.push(("overview".to_owned(), rows));
        for state in ListState::ALL {
            let page = crate::ListQuery::new(state).limit(5);
            Postgres::list(pool, queries, &page).await.unwrap();
            let rows = rows_read_since(pool, partitions, &mut at).await;
            read.push((format!("list {state:?}"), rows));
        }
        Postgres::dead_letter_groups(pool, queries).await.unwrap();
        let rows = rows_read_since(pool, partitions, &mut at).await;
        read.push(("dead_letter_groups".to_owned(), rows));
        Postgres::subscribers(pool, queries).await.unwrap();
        let rows = rows_read_since(pool, partitions, &mut at).await;
        read.push(("subscribers".to_owned(), rows));
        read
    }

    /// What an operator's console reads every few seconds, and the inbox's purge at each
    /// retention round, are prepared once per pooled connection too. Planned while a
    /// partition (or the inbox) was empty as a vacuum left it, they read it whole once it
    /// filled: 20 023 rows each for the count of events published in the last minute, a page
    /// of each of the five states of events and the dead letters' groups, 240 277 for the
    /// overview, 40 020 of the inbox to purge 10 messages. They read what they are about,
    /// whatever a table held before.
    #[tokio::test]
    async fn console_reads_and_the_inbox_purge_read_what_they_are_about_whatever_a_table_held_before()
     {
        const KEPT: i64 = 20_000;
        let (db, queries, conn) = vacuumed_empty_partitions().await;
        drop(conn);
        sqlx::raw_sql(
            "INSERT INTO events.outbox_inbox (consumer, message_id) VALUES ('c', 'm');
             DELETE FROM events.outbox_inbox",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        sqlx::raw_sql("VACUUM events.outbox_inbox")
            .execute(&db.pool)
            .await
            .unwrap();
        // One connection, as in `a_renewal_or_a_hold_of_a_claim_reads_one_claim_...`.
        let pool = db.pool_named("console", 1).await;
        let day = Duration::from_secs(86_400);
        for _ in 0..8 {
            console_reads(&pool, &queries).await;
            let purged = Postgres::purge_inbox(&pool, &queries, day, 500).await;
            assert_eq!(purged.unwrap(), 0);
        }
        // Events published a day ago and ten just now, ten pending, three dead; messages
        // handled just now and ten a week ago.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() - interval '1 day'
             FROM generate_series(1, {KEPT});
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, 10);
             {TEN_PENDING};
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, dead_at, last_error)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now(), 'undecodable'
             FROM generate_series(1, 3);
             INSERT INTO events.outbox_inbox (consumer, message_id)
             SELECT 'c', n::text FROM generate_series(1, {KEPT}) AS n;
             INSERT INTO events.outbox_inbox (consumer, message_id, handled_at)
             SELECT 'c', 'old' || n, now() - interval '7 days' FROM generate_series(1, 10) AS n"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut read = console_reads(&pool, &queries).await;
        let mut at = rows_read_so_far(&pool, "outbox\\_inbox").await;
        let purged = Postgres::purge_inbox(&pool, &queries, day, 500).await;
        assert_eq!(purged.unwrap(), 10, "the messages handled a week ago");
        let rows = rows_read_since(&pool, "outbox\\_inbox", &mut at).await;
        read.push(("purge_inbox (rows of the inbox)".to_owned(), rows));
        assert!(
            read.iter().all(|(_, rows)| *rows <= 100),
            "rows of the partitions ({KEPT} old events kept) or of the inbox ({KEPT} young \
             messages) each read: {read:?}"
        );
        // And what they read is right.
        let minute = Duration::from_secs(60);
        let published = Postgres::published_within(&pool, &queries, minute).await;
        assert_eq!(
            published.unwrap(),
            10,
            "the events published in the last minute"
        );
        let overview = Postgres::overview(&pool, &queries).await.unwrap();
        let counts = [ListState::Pending, ListState::Dead].map(|s| overview.count(s));
        assert_eq!(counts, [10, 3], "pending, dead");
        let groups = Postgres::dead_letter_groups(&pool, &queries).await.unwrap();
        assert_eq!(groups.iter().map(|g| g.dead).sum::<u64>(), 3);
    }

    /// The status of a running relay counts what no live relay routes, every status interval:
    /// it reads the unpublished events through their indexes, not the published ones the table
    /// keeps for retention (30 days by default).
    #[tokio::test]
    async fn the_unroutable_count_reads_the_unpublished_events_not_the_retained_table() {
        const RETAINED: i64 = 20_000;
        let db = migrated().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now()
             FROM generate_series(1, {RETAINED});
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'Unknown', '{{}}' FROM generate_series(1, 30);
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, next_retry_at)
             SELECT 'a', gen_random_uuid(), 'Unknown', '{{}}', now()
             FROM generate_series(1, 20);
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, dead_at)
             SELECT 'a', gen_random_uuid(), 'Unknown', '{{}}', now()
             FROM generate_series(1, 10);
             ANALYZE events.outbox;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let queries = Postgres::queries(&TableNames::default());
        let (events, _, _) = Postgres::unroutable(&db.pool, &queries, vec!["E".into()], vec![])
            .await
            .unwrap();
        assert_eq!(events, 50, "pending and parked, not dead nor published");

        let mut conn = db.pool.acquire().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET plan_cache_mode = force_generic_plan;
             PREPARE unroutable(text[], text[], int8, int8) AS {}",
            queries.unroutable.as_str()
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        let plan = explain_execute(&mut conn, "unroutable('{E}', '{}', 0, 0)").await;
        let read = rows_read(&plan, "outbox");
        assert!(
            read <= 200.0,
            "the count read {read} rows of an outbox of {RETAINED} published events: {plan:#}"
        );
    }

    /// The floor takes a bound only once the transactions running when it was taken have
    /// ended, and then no higher than what a later claim, scanning from the old floor, saw; it
    /// never goes down but starts again when events are put back.
    #[test]
    fn the_floor_waits_for_the_transactions_of_its_bound_and_starts_again_when_events_are_put_back()
    {
        let mut floor = EventFloor::default();
        // A claim sees pending events from 100; transactions up to xid 50 may still commit.
        floor.advance(0, Some(100), 40, 50);
        assert_eq!(floor.scan_from(), (0, 0), "a bound is not a floor yet");
        // The transaction with xid 45 is still running: no floor yet.
        floor.advance(0, Some(120), 45, 60);
        assert_eq!(floor.scan_from(), (0, 0));
        // Every transaction below xid 60 has ended, and this claim (from the old floor) found
        // what one of them committed at 90.
        floor.advance(0, Some(90), 60, 70);
        assert_eq!(
            floor.scan_from(),
            (90, 0),
            "the lower of the bound and what was found"
        );
        floor.advance(0, Some(130), 70, 80);
        assert_eq!(floor.scan_from(), (90, 0));
        // Nothing pending: the claim's bound is the next id.
        floor.advance(0, Some(200), 80, 90);
        assert_eq!(floor.scan_from(), (130, 0));
        // A bound below the floor (a parked event, say) does not lower it.
        floor.advance(0, Some(50), 90, 95);
        assert_eq!(floor.scan_from(), (130, 0));
        // Events were put back: the claim scanned from the start, and the floor starts again.
        floor.advance(1, Some(10), 95, 100);
        assert_eq!(floor.scan_from(), (0, 1));
        floor.advance(1, Some(300), 100, 110);
        assert_eq!(floor.scan_from(), (10, 1));
        // A long transaction (xid 105): the bounds taken since wait; the newest one whose
        // transactions have all ended is taken.
        floor.advance(1, Some(400), 105, 120);
        assert_eq!(floor.scan_from(), (10, 1));
        floor.advance(1, Some(500), 115, 130);
        assert_eq!(floor.scan_from(), (300, 1));
    }

    /// A session idle in a `REPEATABLE READ` transaction: until it ends, vacuum removes nothing
    /// deleted or updated after its snapshot.
    async fn hold_a_snapshot(db: &TestDb) -> sqlx::pool::PoolConnection<Postgres> {
        let mut held = db.pool.acquire().await.unwrap();
        sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM events.outbox")
            .execute(&mut *held)
            .await
            .unwrap();
        held
    }

    /// A session that holds an old snapshot (idle in a transaction, a long report) keeps every
    /// claim row deleted since: vacuum can remove none, and a relay under load claims and
    /// records hundreds of batches a second. A claim reads the claims table from the oldest
    /// claim it knew to be live, by index: a few pages per read, not every row the snapshot
    /// keeps.
    #[tokio::test]
    async fn a_claim_reads_the_live_claims_not_every_claim_a_held_snapshot_keeps() {
        const KEPT: i64 = 5_000;
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        sqlx::query(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'E', '{}' FROM generate_series(1, 30)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let mut held = hold_a_snapshot(&db).await;
        // Batches claimed and recorded while it holds its snapshot.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox_claims (until, event_ids, aggregate_types, aggregate_ids)
             SELECT now() + interval '1 minute', ARRAY[g::int8], '{{a}}', ARRAY[gen_random_uuid()]
             FROM generate_series(1, {KEPT}) AS g;
             DELETE FROM events.outbox_claims;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        // The relay's claim, which stays live (its batch is being delivered), and the next one.
        assert_eq!(claim_ten(&db.pool, &queries).await.claims.len(), 10);
        let mut conn = db.pool.acquire().await.unwrap();
        let plan = explain_claim_of(&mut conn, 10, true, &queries).await;
        assert_eq!(plan["Actual Rows"], 11, "the next claim took the next 10");
        let pages = blocks_read(&plan, "outbox_claims");
        // (About 20: a few index and heap pages for each of its reads of the claims; from the
        // lowest claim, the same plan read 676.)
        assert!(
            pages <= 30.0,
            "a claim read {pages} pages of claims ({KEPT} deleted rows kept): {plan:#}"
        );
        held.execute("ROLLBACK").await.unwrap();
    }

    /// A session that holds an old snapshot keeps the index entries of every event published
    /// since (vacuum can remove none): a claim that scanned pending events from the lowest id
    /// read them all, more with every batch, until the relay fell behind. The scan starts at a
    /// floor that follows the relay: after thousands of events published under the held
    /// snapshot, a claim reads a few pages of the outbox. So do the relay's status and its
    /// count of unroutable events, read every status interval.
    #[tokio::test]
    async fn claims_and_the_status_scan_from_a_floor_not_every_event_a_held_snapshot_keeps() {
        const EVENTS: i64 = 20_000;
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        let mut held = hold_a_snapshot(&db).await;
        let publish = async |n: i64| {
            sqlx::query(
                "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'a', gen_random_uuid(), 'E', '{}' FROM generate_series(1, $1)",
            )
            .bind(n)
            .execute(&db.pool)
            .await
            .unwrap();
        };
        publish(EVENTS).await;
        // The relay drains them in batches while the snapshot is held.
        let mut drained = 0;
        while drained < EVENTS {
            let batch = Postgres::claim(
                &db.pool,
                &queries,
                ClaimLimit::events(500),
                Duration::from_secs(60),
                &ClaimFilter::default(),
            )
            .await
            .unwrap();
            assert!(
                !batch.claims.is_empty(),
                "{drained} drained, then nothing claimed"
            );
            drained += i64::try_from(batch.claims.len()).unwrap();
            let outcomes = Outcomes {
                events: batch
                    .claims
                    .iter()
                    .map(|c| (c.event_id(), EventOutcome::Published))
                    .collect(),
                deliveries: Vec::new(),
            };
            let recorded = Postgres::record(&db.pool, &queries, batch.token, &outcomes, false);
            assert_eq!(recorded.await.unwrap(), Recorded::Applied);
        }
        // The floor passes them once every transaction of the server that ran while they were
        // claimed has ended (other tests' too): claims until it has.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while queries.events_floor.lock().unwrap().scan_from().0 <= EVENTS {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the floor stayed at {:?}",
                queries.events_floor.lock().unwrap()
            );
            claim_ten(&db.pool, &queries).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        publish(10).await;

        let mut conn = db.pool.acquire().await.unwrap();
        let plan = explain_claim_of(&mut conn, 10, true, &queries).await;
        assert_eq!(plan["Actual Rows"], 11, "the claim took the 10 new events");
        let pages = blocks_read(&plan, "outbox");
        assert!(
            pages <= 40.0,
            "a claim read {pages} pages of the outbox ({EVENTS} published events kept): {plan:#}"
        );

        // The status counts the 10 (the claim above was rolled back), as does the count of
        // events no relay routes; from the floor, the status reads a few pages.
        let status = status_in(&db.pool, &queries).await.unwrap();
        assert_eq!(status.pending_events, 10);
        let (unroutable, _, _) =
            Postgres::unroutable(&db.pool, &queries, vec!["Other".into()], vec![])
                .await
                .unwrap();
        assert_eq!(unroutable, 10);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ANALYZE events.outbox; PREPARE status(int8, int8) AS {}",
            queries.status.as_str()
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        let (floor, released) = queries.scan_from();
        let mut status_pages = async |floor: i64| {
            let plan = explain_execute(&mut conn, &format!("status({floor}, {released})")).await;
            (blocks_read(&plan, "outbox"), plan)
        };
        let (from_floor, plan) = status_pages(floor).await;
        assert!(
            from_floor <= 40.0,
            "the status read {from_floor} pages of the outbox ({EVENTS} published events kept): \
             {plan:#}"
        );
        // What the floor spares it: the same status from the lowest id.
        let (from_start, _) = status_pages(0).await;
        assert!(
            from_start >= 4.0 * from_floor.max(10.0),
            "{from_start} pages from the start, {from_floor} from the floor"
        );
        held.execute("ROLLBACK").await.unwrap();
    }

    /// A claim that takes over aggregates of an earlier claim of its relay (whose record is
    /// under way) takes their later events; without it, or naming another claim, it leaves
    /// them to wait for that claim's end. The earlier claim's own events stay with it.
    #[tokio::test]
    async fn a_claim_takes_over_the_aggregates_its_relay_names_and_no_others() {
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        let none = ClaimFilter::default();
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let insert = |aggregates: &[Uuid]| {
            let aggregates = aggregates.to_vec();
            let pool = db.pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 't', a, 'E', '{}' FROM unnest($1::uuid[]) WITH ORDINALITY AS x(a, n)
                     ORDER BY n RETURNING id",
                )
                .bind(aggregates)
                .fetch_all(&pool)
                .await
                .unwrap()
            }
        };
        let claim = |filter: ClaimFilter| {
            let pool = db.pool.clone();
            let queries = &queries;
            async move {
                let batch = Postgres::claim(
                    &pool,
                    queries,
                    ClaimLimit::events(10),
                    Duration::from_secs(60),
                    &filter,
                )
                .await
                .unwrap();
                let ids: Vec<i64> = batch.claims.iter().map(Claim::event_id).collect();
                (batch.token, ids)
            }
        };
        let first = insert(&[a, b]).await;
        let (earlier, ids) = claim(none.clone()).await;
        assert_eq!(ids, first, "the earlier claim holds a and b");
        let later = insert(&[a, b, c]).await;
        let (_, ids) = claim(none.clone()).await;
        assert_eq!(ids, vec![later[2]], "a and b wait for the earlier claim");

        let elsewhere = TakeOver::new(ClaimToken::new(earlier.get() + 1000), vec![("t".into(), a)]);
        let (_, ids) = claim(none.taking_over(vec![elsewhere])).await;
        assert_eq!(ids, Vec::<i64>::new(), "another claim's name frees nothing");
        let (_, ids) =
            claim(none.taking_over(vec![TakeOver::new(earlier, vec![("t".into(), a)])])).await;
        assert_eq!(
            ids,
            vec![later[0]],
            "a's later event is taken over, b's is not"
        );
        let listed: Vec<i64> =
            sqlx::query_scalar("SELECT unnest(event_ids) FROM events.outbox_claims WHERE id = $1")
                .bind(earlier.get())
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(listed, first, "the earlier claim keeps its events");

        let (_, ids) =
            claim(none.taking_over(vec![TakeOver::whole(ClaimToken::new(earlier.get() + 1000))]))
                .await;
        assert_eq!(
            ids,
            Vec::<i64>::new(),
            "another claim taken whole frees nothing"
        );
        let (_, ids) = claim(none.taking_over(vec![TakeOver::whole(earlier)])).await;
        assert_eq!(
            ids,
            vec![later[1]],
            "b's later event is taken over with the whole claim; a's is in the claim before"
        );
    }

    /// Events held back cost a claim a bounded amount of work, however many: an aggregate with
    /// a dead event and thousands of events already set aside behind it, hundreds more arriving
    /// behind those, and thousands of deliveries waiting for a subscriber that is down. Each
    /// claim reads about a batch of the outbox, sets a batch of the new arrivals aside, and once
    /// they are all aside, claims the other aggregates' events.
    #[tokio::test]
    async fn a_claim_reads_a_batch_whatever_is_held_back() {
        const BATCH: i64 = 100;
        const HELD: i64 = 50 * BATCH;
        const ARRIVING: i64 = 5 * BATCH;
        const WAITING: i64 = 200 * BATCH;
        let db = migrated().await;
        let stuck = Uuid::new_v4();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, {WAITING});
             ANALYZE events.outbox;
             WITH dead AS (
                 INSERT INTO events.outbox
                     (aggregate_type, aggregate_id, event_type, payload, dead_at)
                 VALUES ('a', '{stuck}', 'E', '{{}}', now()) RETURNING id
             )
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, held_behind)
             SELECT 'a', '{stuck}', 'E', '{{}}', (SELECT id FROM dead)
             FROM generate_series(1, {HELD});
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', '{stuck}', 'E', '{{}}' FROM generate_series(1, {ARRIVING});
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}' FROM generate_series(1, {BATCH});
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at)
             SELECT id, 'down', 'a', aggregate_id, now() + interval '1 hour'
             FROM events.outbox WHERE published_at IS NOT NULL;
             ANALYZE events.outbox_deliveries;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        let mut conn = db.pool.acquire().await.unwrap();
        for round in 0..=ARRIVING / BATCH {
            let plan = explain_claim(&mut conn, BATCH, false).await;
            let read = rows_read(&plan, "outbox");
            assert!(
                read <= (10 * BATCH) as f64,
                "claim {round} read {read} rows of the outbox: {plan:#}"
            );
            let deliveries = rows_read(&plan, "outbox_deliveries");
            assert!(
                deliveries <= (10 * BATCH) as f64,
                "claim {round} read {deliveries} deliveries: {plan:#}"
            );
            let claimed = plan["Actual Rows"].as_i64().unwrap() - 1;
            let expected = if round < ARRIVING / BATCH { 0 } else { BATCH };
            assert_eq!(claimed, expected, "claim {round}");
        }
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE held_behind IS NOT NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(held, HELD + ARRIVING);
    }

    /// A subscriber that is down does not slow the others' claims, however much waits for it:
    /// 100 000 deliveries wait behind its dead head deliveries (1 000 keys), 10 000 events are
    /// dead and 10 000 parked for an hour. A claim for a batch of pending events and a batch of
    /// due deliveries of a healthy subscriber reads at most 10 rows per row it claims, of the
    /// outbox and of the deliveries.
    #[tokio::test]
    async fn a_claim_reads_a_batch_whatever_waits_behind_a_blocked_subscriber() {
        const BATCH: i64 = 100;
        const KEYS: i64 = 1_000;
        const WAITING: i64 = 100 * KEYS;
        const DEAD: i64 = 10_000;
        const PARKED: i64 = 10_000;
        let db = migrated().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', md5((g % {KEYS})::text)::uuid, 'E', '{{}}', now()
             FROM generate_series(1, {WAITING}) AS g;
             -- Per key, the first delivery is dead; the rest wait behind it.
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at,
                  dead_at)
             SELECT id, 'down', 'a', aggregate_id, 0,
                    CASE WHEN first THEN now() END, CASE WHEN first THEN now() END
             FROM (SELECT id, aggregate_id,
                          row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1 AS first
                   FROM events.outbox) AS o;
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, dead_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, {DEAD});
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, next_retry_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() + interval '1 hour'
             FROM generate_series(1, {PARKED});
             -- A batch of due deliveries of a healthy subscriber, and a batch of new events.
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at)
             SELECT id, 'up', 'a', aggregate_id, now()
             FROM events.outbox WHERE published_at IS NOT NULL ORDER BY id DESC LIMIT {BATCH};
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}' FROM generate_series(1, {BATCH});
             ANALYZE events.outbox;
             ANALYZE events.outbox_deliveries;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        let mut conn = db.pool.acquire().await.unwrap();
        let plan = explain_claim(&mut conn, BATCH, true).await;
        // A batch of events, a batch of deliveries, and the row that says how many events
        // were set aside.
        assert_eq!(
            plan["Actual Rows"],
            2 * BATCH + 1,
            "the claim took both batches"
        );
        for relation in ["outbox", "outbox_deliveries"] {
            let read = rows_read(&plan, relation);
            assert!(
                read <= (2 * 10 * BATCH) as f64,
                "a claim of {BATCH} + {BATCH} read {read} rows of {relation}: {plan:#}"
            );
        }
    }

    /// Nor do the rows waiting in the keys of the claim's own work: 100 aggregates each with
    /// 1 000 deliveries waiting for a subscriber that is down, and 1 000 ready behind a due head
    /// of a subscriber that is up again, the events analyzed when they were one per aggregate
    /// and the deliveries never (deliveries pile up in an outage faster than the server
    /// analyzes them). A claim of a new event per aggregate and of the due keys looks up each
    /// key's last row and reads a share of each due key, by index, never the whole key: at most
    /// 10 rows of the deliveries per row it claims.
    #[tokio::test]
    async fn a_claim_reads_a_batch_whatever_waits_in_the_keys_of_its_work() {
        const BATCH: i64 = 100;
        const KEYS: i64 = 100;
        const WAITING: i64 = 1_000;
        let db = migrated().await;
        // (One event per key and its deliveries, the events analyzed; then the outage.)
        let fill = |per_key: i64| {
            format!(
                "WITH e AS (
                     INSERT INTO events.outbox
                         (aggregate_type, aggregate_id, event_type, payload, published_at)
                     SELECT 'a', md5((g % {KEYS})::text)::uuid, 'E', '{{}}', now()
                     FROM generate_series(1, {KEYS} * {per_key}) AS g
                     RETURNING id, aggregate_id
                 ),
                 numbered AS (
                     SELECT id, aggregate_id, NOT EXISTS (
                                SELECT 1 FROM events.outbox_deliveries AS d
                                WHERE d.aggregate_id = e.aggregate_id
                            ) AND row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1
                                AS first
                     FROM e
                 )
                 -- The first of each key: dead for `down`, due for `up`; the rest wait.
                 INSERT INTO events.outbox_deliveries
                     (event_id, subscriber, aggregate_type, aggregate_id, attempts,
                      next_retry_at, dead_at)
                 SELECT id, s, 'a', aggregate_id, 0,
                        CASE WHEN first THEN now() END,
                        CASE WHEN first AND s = 'down' THEN now() END
                 FROM numbered CROSS JOIN (VALUES ('down'), ('up')) AS s(s)"
            )
        };
        sqlx::raw_sql(AssertSqlSafe(format!(
            "{};
             ANALYZE events.outbox;
             {};
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', md5((g % {KEYS})::text)::uuid, 'E', '{{}}'
             FROM generate_series(1, {BATCH}) AS g;",
            fill(1),
            fill(WAITING - 1),
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        let mut conn = db.pool.acquire().await.unwrap();
        let plan = explain_claim(&mut conn, BATCH, true).await;
        let claimed = plan["Actual Rows"].as_i64().unwrap() - 1;
        assert!(
            claimed >= BATCH,
            "the claim took the new events and due deliveries: {claimed}"
        );
        let read = rows_read(&plan, "outbox_deliveries");
        assert!(
            read <= (10 * claimed) as f64,
            "a claim of {claimed} rows read {read} deliveries ({KEYS} keys of {WAITING} rows \
             waiting for each of two subscribers): {plan:#}"
        );
    }

    /// Deliveries that waited behind the head of their key before migration 6 (due, as
    /// version 5 wrote them) lose their due time in the migration; delivering the head makes
    /// the rest due, and the next claim takes them all, in order.
    #[tokio::test]
    async fn deliveries_waiting_before_migration_6_are_delivered_in_order_after_it() {
        let db = TestDb::new().await;
        let names = TableNames::default();
        migrate_to(&db.pool, &names, 5).await.unwrap();
        let x = Uuid::new_v4();
        let ids: Vec<i64> = sqlx::query_scalar(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 't', $1, 'E', '{}', now() FROM generate_series(1, 5) RETURNING id",
        )
        .bind(x)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        // The first failed once and is due again; the rest wait, due at once as version 5 had it.
        sqlx::query(
            "INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at)
             SELECT id, 's', 't', $2, (id = $3)::int, now() - interval '1 second'
             FROM unnest($1::int8[]) AS id",
        )
        .bind(&ids)
        .bind(x)
        .bind(ids[0])
        .execute(&db.pool)
        .await
        .unwrap();
        migrate_to(&db.pool, &names, LATEST).await.unwrap();
        let due: Vec<(i64, bool)> = sqlx::query_as(
            "SELECT event_id, next_retry_at IS NOT NULL FROM events.outbox_deliveries
             ORDER BY event_id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            due,
            ids.iter()
                .map(|id| (*id, *id == ids[0]))
                .collect::<Vec<_>>(),
            "only the head keeps a due time"
        );

        let queries = Postgres::queries(&names);
        let none = ClaimFilter::default();
        let claim = || {
            Postgres::claim(
                &db.pool,
                &queries,
                ClaimLimit::events(10),
                Duration::from_secs(60),
                &none,
            )
        };
        let delivered = |claims: &[Claim]| Outcomes {
            deliveries: claims
                .iter()
                .map(|c| DeliveryRecord {
                    event_id: c.event_id(),
                    aggregate_type: "t".to_owned(),
                    aggregate_id: x,
                    subscriber: "s".to_owned(),
                    outcome: DeliveryOutcome::Delivered,
                })
                .collect(),
            ..Outcomes::default()
        };
        // The head and the ready rows behind it, in one claim, in order.
        let batch = claim().await.unwrap();
        let claimed: Vec<i64> = batch.claims.iter().map(Claim::event_id).collect();
        assert_eq!(claimed, ids);
        let recorded = Postgres::record(
            &db.pool,
            &queries,
            batch.token,
            &delivered(&batch.claims),
            false,
        )
        .await
        .unwrap();
        assert_eq!(recorded, Recorded::Applied);
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox_deliveries")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(left, 0);
    }

    /// Inserts one event of `aggregate` (type `t`, event type `E`) by SQL; returns its id.
    async fn insert_event(pool: &PgPool, aggregate: Uuid) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('t', $1, 'E', '{}') RETURNING id",
        )
        .bind(aggregate)
        .fetch_one(pool)
        .await
    }

    /// Claims and records as a relay would, until a claim finds nothing; returns the event ids
    /// claimed, in order.
    async fn drain_ids(pool: &PgPool, queries: &PgQueries) -> Vec<i64> {
        let mut claimed = Vec::new();
        loop {
            let batch = claim_ten(pool, queries).await;
            if batch.is_empty() && !batch.more {
                return claimed;
            }
            let mut outcomes = Outcomes::default();
            for claim in &batch.claims {
                claimed.push(claim.event_id());
                outcomes
                    .events
                    .push((claim.event_id(), EventOutcome::Published));
            }
            if !batch.is_empty() {
                let recorded = Postgres::record(pool, queries, batch.token, &outcomes, false)
                    .await
                    .unwrap();
                assert_eq!(recorded, Recorded::Applied);
            }
        }
    }

    /// Events held behind a claim that lasted are released when it ends; an event arriving
    /// behind them meanwhile must not take over their hold: the claim that releases them once
    /// copied it onto the newcomer (held by a claim no one would release again), which then
    /// waited for ever.
    #[tokio::test]
    async fn an_event_behind_released_ones_is_not_held_by_the_claim_that_ended() {
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        let x = Uuid::new_v4();
        let insert = || insert_event(&db.pool, x);
        // A relay claims e1 and dies; its claim has lasted.
        let e1 = insert().await.unwrap();
        let first = claim_ten(&db.pool, &queries).await;
        assert_eq!(first.claims.len(), 1);
        sqlx::query("UPDATE events.outbox_claims SET claimed_at = now() - interval '1 minute'")
            .execute(&db.pool)
            .await
            .unwrap();
        // e2 arrives and is set aside behind that claim.
        let e2 = insert().await.unwrap();
        let batch = claim_ten(&db.pool, &queries).await;
        assert!(batch.is_empty() && batch.more, "{batch:?}");
        // The dead relay's claim expires; e3 arrives.
        sqlx::query("UPDATE events.outbox_claims SET until = now() - interval '1 second'")
            .execute(&db.pool)
            .await
            .unwrap();
        let e3 = insert().await.unwrap();

        assert_eq!(drain_ids(&db.pool, &queries).await, [e1, e2, e3]);
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM events.outbox WHERE held_by IS NOT NULL OR held_behind IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(held, 0);
    }

    /// A record of part of a claim that commits while another claim is setting an event aside
    /// behind that claim (after the other claim's snapshot, before its write) leaves the event
    /// held by a claim that no longer holds its aggregate: the record found nothing to release.
    /// The next claim releases it, while the first claim still runs.
    #[tokio::test]
    async fn an_event_set_aside_behind_a_claim_while_part_of_it_is_recorded_is_released() {
        let db = migrated().await;
        let queries = Arc::new(Postgres::queries(&TableNames::default()));
        let insert = |aggregate: Uuid| insert_event(&db.pool, aggregate);
        let (x, y) = (Uuid::new_v4(), Uuid::new_v4());
        insert(x).await.unwrap();
        let y1 = insert(y).await.unwrap();
        // A claim of x and y that has lasted.
        let first = claim_ten(&db.pool, &queries).await;
        assert_eq!(first.claims.len(), 2);
        sqlx::query("UPDATE events.outbox_claims SET claimed_at = now() - interval '1 minute'")
            .execute(&db.pool)
            .await
            .unwrap();
        // y2 arrives; a claim that will set it aside waits for its row (locked here) once it
        // has its snapshot.
        let y2 = insert(y).await.unwrap();
        let mut locker = db.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM events.outbox WHERE id = $1 FOR UPDATE")
            .bind(y2)
            .execute(&mut *locker)
            .await
            .unwrap();
        let claim = tokio::spawn({
            let (pool, queries) = (db.pool.clone(), queries.clone());
            async move { claim_ten(&pool, &queries).await }
        });
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                   AND query LIKE '%WITH gone AS%'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Meanwhile the first claim's y is recorded: the claim lets go of y.
        let mut outcomes = Outcomes::default();
        outcomes.events.push((y1, EventOutcome::Published));
        let recorded = Postgres::record(&db.pool, &queries, first.token, &outcomes, true)
            .await
            .unwrap();
        assert_eq!(recorded, Recorded::Applied);
        locker.commit().await.unwrap();
        let batch = claim.await.unwrap();
        assert!(batch.is_empty() && batch.more, "{batch:?}");
        let held_by: Option<i64> =
            sqlx::query_scalar("SELECT held_by FROM events.outbox WHERE id = $1")
                .bind(y2)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(held_by.is_some(), "y2 was set aside behind the first claim");

        // The next claims free y2 and take it, while the first claim still holds x.
        let mut claimed = Vec::new();
        for _ in 0..3 {
            let batch = claim_ten(&db.pool, &queries).await;
            claimed.extend(batch.claims.iter().map(Claim::event_id));
            if !batch.more {
                break;
            }
        }
        assert_eq!(claimed, [y2], "y2 is claimed once its aggregate is free");
    }

    /// A lease runs from when the claim is granted, after any wait for the claim lock: a claim
    /// that waited longer than its lease still holds its batch for a whole lease.
    #[tokio::test]
    async fn a_lease_runs_from_when_the_claim_lock_is_granted() {
        let db = migrated().await;
        let names = TableNames::default();
        let queries = Postgres::queries(&names);
        sqlx::query(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('t', gen_random_uuid(), 'E', '{}')",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        // Another claimer holds the claim lock for 1.5 s.
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind((i64::from(names.lock_namespace()) << 1) | 1)
            .execute(&mut *holder)
            .await
            .unwrap();
        let claim = tokio::spawn({
            let pool = db.pool.clone();
            async move {
                Postgres::claim(
                    &pool,
                    &queries,
                    ClaimLimit::events(10),
                    Duration::from_secs(1),
                    &ClaimFilter::default(),
                )
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(1500)).await;
        holder.commit().await.unwrap();
        let batch = claim.await.unwrap().unwrap();
        assert_eq!(batch.claims.len(), 1);
        let left: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM until - clock_timestamp())::float8 FROM events.outbox_claims",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(
            left > 0.8,
            "the lease has {left} s left just after the claim"
        );
    }

    /// Retention deletes old events one statement per batch; each deleted event's foreign key is
    /// checked against the deliveries. With a subscriber down for long the deliveries pile up,
    /// and a check that scans them all per deleted event made purges (and the relay that runs
    /// them) crawl. The purge must read about as many delivery rows as there are, once.
    #[tokio::test]
    async fn a_purge_does_not_scan_the_deliveries_once_per_deleted_event() {
        const PURGED: i64 = 500;
        const DELIVERIES: i64 = 5000;
        let db = migrated().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() - interval '2 days'
             FROM generate_series(1, {PURGED});
             WITH waiting AS (
                 INSERT INTO events.outbox
                     (aggregate_type, aggregate_id, event_type, payload, published_at)
                 SELECT 'a', gen_random_uuid(), 'E', '{{}}', now()
                 FROM generate_series(1, {DELIVERIES})
                 RETURNING id, aggregate_id
             )
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id)
             SELECT id, 'down', 'a', aggregate_id FROM waiting;
             ANALYZE events.outbox_deliveries;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();

        let queries = Postgres::queries(&TableNames::default());
        let mut tx = db.pool.begin().await.unwrap();
        let (_, before) = rows_read_in(&mut tx).await;
        let purged = purge_step(
            &mut *tx,
            &queries,
            Duration::from_secs(86_400),
            PURGED + 1,
            None,
            0..0,
        )
        .await
        .unwrap()
        .deleted;
        let read = rows_read_in(&mut tx).await.1 - before;
        tx.rollback().await.unwrap();

        assert_eq!(purged, PURGED as u64);
        assert!(
            read <= 2 * (DELIVERIES + PURGED),
            "purging {PURGED} events read {read} delivery rows of {DELIVERIES}"
        );
    }

    /// Rows of the outbox and of the deliveries read on `tx`, through any index or
    /// sequentially, as the server counts them: since its counts were last flushed, which may
    /// be before this transaction began (so take differences).
    async fn rows_read_in(tx: &mut PgConnection) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT coalesce(sum(seq_tup_read), 0)::int8 FROM pg_stat_xact_user_tables
                     WHERE relid = r.relid)
                  + (SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0)::int8
                     FROM pg_index WHERE indrelid = r.relid)
             FROM unnest(ARRAY['events.outbox'::regclass, 'events.outbox_deliveries'::regclass])
                  WITH ORDINALITY AS r(relid, n)
             ORDER BY r.n",
        )
        .fetch_all(&mut *tx)
        .await
        .map(|rows: Vec<(i64,)>| (rows[0].0, rows[1].0))
        .unwrap()
    }

    /// Retention and status read what they act on, not the retained table: with 100 000
    /// events published recently (kept), 100 000 old ones that a blocked subscriber's waiting
    /// deliveries still hold (kept), 10 000 dead events and 1 000 old events free to go, each
    /// purge statement reads at most a few rows per row of its batch, the purges go through
    /// the held events once and delete exactly the free ones, and the status reads none of
    /// the published events.
    #[tokio::test]
    async fn purge_and_status_read_what_they_act_on_not_the_retained_table() {
        const BATCH: i64 = 500;
        const YOUNG: i64 = 100_000;
        const HELD: i64 = 100_000;
        const KEYS: i64 = 1_000;
        const DEAD: i64 = 10_000;
        const FREE: i64 = 1_000;
        const PENDING: i64 = 100;
        let db = migrated().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "-- Old events, held and free interleaved, then young ones, dead ones, pending ones.
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', md5((g % {KEYS})::text)::uuid, 'E', '{{}}',
                    now() - interval '2 days' + g * interval '1 millisecond'
             FROM generate_series(1, {HELD} + {FREE}) AS g;
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at,
                  dead_at)
             SELECT id, 'down', 'a', aggregate_id, 0,
                    CASE WHEN first THEN now() END, CASE WHEN first THEN now() END
             FROM (SELECT id, aggregate_id,
                          row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1 AS first
                   FROM events.outbox WHERE id % ({HELD} / {FREE} + 1) <> 0) AS o;
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, {YOUNG});
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, dead_at)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}', now() FROM generate_series(1, {DEAD});
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}' FROM generate_series(1, {PENDING});
             ANALYZE events.outbox;
             ANALYZE events.outbox_deliveries;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let held: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox_deliveries")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(held, HELD, "the set-up holds {HELD} old events");

        let queries = Postgres::queries(&TableNames::default());
        let (mut deleted, mut statements, mut after) = (0, 0, None);
        loop {
            let mut tx = db.pool.begin().await.unwrap();
            let before = rows_read_in(&mut tx).await;
            let step = purge_step(
                &mut *tx,
                &queries,
                Duration::from_secs(86_400),
                BATCH,
                after,
                0..0,
            )
            .await
            .unwrap();
            let read = rows_read_in(&mut tx).await;
            let (outbox, deliveries) = (read.0 - before.0, read.1 - before.1);
            tx.commit().await.unwrap();
            statements += 1;
            assert!(
                outbox <= 4 * BATCH && deliveries <= 4 * BATCH,
                "purge statement {statements} read {outbox} rows of the outbox and \
                 {deliveries} deliveries for a batch of {BATCH}"
            );
            deleted += step.deleted;
            match step.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(deleted, FREE as u64, "exactly the free old events went");
        assert!(
            statements <= (HELD + FREE) / BATCH + 2,
            "{statements} purge statements went through {} old events",
            HELD + FREE
        );
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(left, HELD + YOUNG + DEAD + PENDING, "the rest is kept");

        let mut tx = db.pool.begin().await.unwrap();
        let (before, _) = rows_read_in(&mut tx).await;
        let status = status_in(&mut *tx, &queries).await.unwrap();
        let outbox = rows_read_in(&mut tx).await.0 - before;
        tx.rollback().await.unwrap();
        assert_eq!(status.pending_events, PENDING as u64);
        assert_eq!(status.dead_letters, (DEAD + KEYS) as u64);
        assert!(
            outbox <= 2 * (PENDING + DEAD) + 100,
            "the status read {outbox} rows of the outbox, which holds {PENDING} pending and \
             {DEAD} dead events"
        );
    }

    /// Rows of the deliveries every backend of the server read so far, through any index or
    /// sequentially, once this backend's counts are flushed.
    async fn deliveries_read(pool: &PgPool) -> i64 {
        sqlx::query_scalar(
            "SELECT coalesce(t.seq_tup_read, 0)
                  + (SELECT coalesce(sum(i.idx_tup_read), 0)::int8 FROM pg_stat_user_indexes AS i
                     WHERE i.relid = t.relid)
             FROM pg_stat_user_tables AS t WHERE t.relid = 'events.outbox_deliveries'::regclass",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// Recording a batch of deliveries reads about the rows it records, however many wait
    /// behind them: 50 keys with 200 deliveries waiting behind each head. The record deletes
    /// what was delivered and gives each key's next row its due time, by probes, not by
    /// reading the waiting rows (it read them through the due index when its estimate said
    /// there were none, and looked through the delivered rows once per row of every key).
    #[tokio::test]
    async fn a_record_reads_about_the_rows_it_records_whatever_waits_behind_them() {
        const KEYS: i64 = 50;
        const WAITING: i64 = 200;
        // One connection: the counts this test reads are that backend's, flushed on demand.
        let db = TestDb::new().await;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect(&db.url())
            .await
            .unwrap();
        Outbox::<Postgres, ()>::new(pool.clone())
            .migrate()
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'a', md5((g % {KEYS})::text)::uuid, 'E', '{{}}', now()
             FROM generate_series(0, {KEYS} * ({WAITING} + 1) - 1) AS g;
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, next_retry_at)
             SELECT id, 'x', 'a', aggregate_id, CASE WHEN first THEN now() END
             FROM (SELECT id, aggregate_id,
                          row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1 AS first
                   FROM events.outbox) AS o;
             ANALYZE events.outbox;
             ANALYZE events.outbox_deliveries;"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let queries = Postgres::queries(&TableNames::default());
        let batch = Postgres::claim(
            &pool,
            &queries,
            ClaimLimit::events(100),
            Duration::from_secs(30),
            &ClaimFilter::default(),
        )
        .await
        .unwrap();
        let mut outcomes = Outcomes::default();
        for claim in &batch.claims {
            let Claim::Delivery {
                event, subscriber, ..
            } = claim
            else {
                panic!("only deliveries wait: {claim:?}");
            };
            outcomes.deliveries.push(DeliveryRecord {
                event_id: event.id,
                aggregate_type: event.aggregate_type.clone(),
                aggregate_id: event.aggregate_id,
                subscriber: subscriber.clone(),
                outcome: DeliveryOutcome::Delivered,
            });
        }
        let recorded = outcomes.deliveries.len() as i64;
        assert!(
            recorded >= KEYS,
            "the claim took every key's head: {recorded}"
        );

        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&pool)
            .await
            .unwrap();
        let before = deliveries_read(&pool).await;
        let applied = Postgres::record(&pool, &queries, batch.token, &outcomes, false)
            .await
            .unwrap();
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&pool)
            .await
            .unwrap();
        let read = deliveries_read(&pool).await - before;
        assert_eq!(applied, Recorded::Applied);
        assert!(
            read <= 10 * recorded,
            "recording {recorded} deliveries read {read} delivery rows ({} wait)",
            KEYS * WAITING
        );
        // Each key's next row is due now.
        let due: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM events.outbox_deliveries WHERE next_retry_at IS NOT NULL",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(due, KEYS);
    }

    /// A record of part of a claim rewrote the claim's lists without the events it named: a read
    /// and a write of the whole claim for a part of a few events (about 2 ms for a claim of
    /// 2 000), and a batch whose keys wait for retries in place records many parts. It now
    /// notes what it took out beside the claim, and its work is its part's.
    #[tokio::test]
    async fn a_record_of_part_of_a_claim_works_on_its_part_not_on_the_whole_claim() {
        const CLAIMED: i64 = 2_000;
        const PART: i64 = 10;
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', md5(g::text)::uuid, 'E', '{{}}' FROM generate_series(1, {CLAIMED}) AS g;
             INSERT INTO events.outbox_claims
                 (id, until, event_ids, aggregate_types, aggregate_ids)
             SELECT 1, now() + interval '1 hour', array_agg(id ORDER BY id),
                    array_agg(aggregate_type ORDER BY id), array_agg(aggregate_id ORDER BY id)
             FROM events.outbox"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM events.outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        let (part, rest) = ids.split_at(PART as usize);
        let mut conn = db.pool.acquire().await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "PREPARE record_published_part AS {}",
            queries.record_published_part.as_str()
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        let literal = |ids: &[i64]| {
            let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
            format!("'{{{}}}'", ids.join(","))
        };
        conn.execute(sqlx::raw_sql(queries.record_begin.clone()))
            .await
            .unwrap();
        let plan = explain_execute(
            &mut conn,
            &format!("record_published_part(1, {})", literal(part)),
        )
        .await;
        conn.execute("COMMIT").await.unwrap();
        assert_eq!(plan["Actual Rows"], 1, "{plan:#}");
        let work = work_of(&plan);
        assert!(
            work <= (10 * PART) as f64,
            "a record of {PART} events of a claim of {CLAIMED} did the work of {work} rows: {plan:#}"
        );
        let published: i64 =
            sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE published_at IS NOT NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(published, PART);
        // The claim lists the rest, and the views count only the rest as claimed.
        assert_eq!(listed_by_claim_1(&db.pool).await, Some(rest.to_vec()));
        let overview = Outbox::<Postgres, ()>::new(db.pool.clone())
            .overview()
            .await
            .unwrap();
        assert_eq!(
            overview.count(ListState::Claimed),
            (CLAIMED - PART) as u64,
            "{overview:?}"
        );
    }

    /// A record of a batch that failed everywhere (its subscribers down) writes a delivery row
    /// per subscriber and event: 6 000 here, the first of each key due for a retry, the rest
    /// waiting behind it, beside 1 000 deliveries done, 1 000 given back, 500 events parked and
    /// 500 dead. It compared the rows it writes with its keys, each with each (59 million rows
    /// of work, 5 s). Its work grows with the rows it records, not with their square, whatever
    /// its plan: the generic one made while the tables were empty (as a relay's first records
    /// make it) or one made for these rows, for a record of the whole claim or of part of it.
    #[tokio::test]
    async fn a_records_work_grows_with_its_rows_not_their_square_whatever_its_plan() {
        for mode in ["force_generic_plan", "force_custom_plan"] {
            for part in [false, true] {
                record_of_a_batch_that_failed_everywhere(mode, part).await;
            }
        }
    }

    async fn record_of_a_batch_that_failed_everywhere(mode: &str, part: bool) {
        const AGGREGATES: i64 = 1_000;
        const STALLED: i64 = 500;
        let db = migrated().await;
        sqlx::raw_sql("VACUUM").execute(&db.pool).await.unwrap();
        let queries = Postgres::queries(&TableNames::default());
        let (name, statement) = if part {
            ("record_part", &queries.record_part)
        } else {
            ("record", &queries.record)
        };
        let mut conn = db.pool.acquire().await.unwrap();
        let claim = "INSERT INTO events.outbox_claims (id, until, event_ids, aggregate_types,
                                                       aggregate_ids)
                     VALUES (1, now() + interval '1 hour', '{}', '{}', '{}')
                     ON CONFLICT (id) DO NOTHING";
        let empty = "'{}', ".repeat(17);
        let empty = if part {
            format!("{empty}'{{1}}'")
        } else {
            empty.trim_end_matches(", ").to_owned()
        };
        let args = format!("(1, '{{1, 2, 3}}', {empty})");
        let begin = (&queries.record_begin, claim);
        plan_generic(&mut conn, name, "", statement, begin, &args).await;
        sqlx::raw_sql(AssertSqlSafe(format!("SET plan_cache_mode = {mode}")))
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "{claim};
             -- The batch: two events of each aggregate, then events to park and dead ones, all
             -- in the claim.
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', md5('a' || g % {AGGREGATES})::uuid, 'E', '{{}}'
             FROM generate_series(0, 2 * {AGGREGATES} - 1) AS g;
             INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT t, gen_random_uuid(), 'E', '{{}}'
             FROM generate_series(1, {STALLED}), unnest('{{p, x}}'::text[]) AS t;
             UPDATE events.outbox_claims
             SET event_ids = o.ids, aggregate_types = o.types, aggregate_ids = o.aggregates
             FROM (SELECT array_agg(id ORDER BY id) AS ids,
                          array_agg(aggregate_type ORDER BY id) AS types,
                          array_agg(aggregate_id ORDER BY id) AS aggregates
                   FROM events.outbox) AS o;
             -- Keys of subscribers 'up' and 'back' whose first delivery the claim took, ten
             -- more waiting behind each.
             INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT 'd', md5('d' || g % {AGGREGATES})::uuid, 'E', '{{}}', now()
             FROM generate_series(0, 11 * {AGGREGATES} - 1) AS g;
             INSERT INTO events.outbox_deliveries
                 (event_id, subscriber, aggregate_type, aggregate_id, attempts, next_retry_at,
                  claim_id)
             SELECT o.id, s, 'd', o.aggregate_id, 1, CASE WHEN first THEN now() END,
                    CASE WHEN first THEN 1 END
             FROM (SELECT id, aggregate_id,
                          row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1 AS first
                   FROM events.outbox WHERE aggregate_type = 'd') AS o,
                  unnest('{{up, back}}'::text[]) AS s;"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        // The record's arguments after the claim, as literals: events published, parked (a
        // reason, a delay), dead (a reason), deliveries done, rows to write, deliveries given
        // back, and for a record of part, the events it names.
        let events = |of: &str, what: &str| {
            format!(
                "SELECT array_agg({what} ORDER BY id) FROM events.outbox WHERE aggregate_type {of}"
            )
        };
        let new = |what: &str| {
            format!(
                "SELECT array_agg({what} ORDER BY o.id, s)
                 FROM (SELECT id, aggregate_id,
                              row_number() OVER (PARTITION BY aggregate_id ORDER BY id) = 1
                                  AS first
                       FROM events.outbox WHERE aggregate_type = 'a') AS o,
                      unnest('{{one, two, three}}'::text[]) AS s"
            )
        };
        let taken = |by: &str, what: &str| {
            format!(
                "SELECT array_agg({what} ORDER BY event_id) FROM events.outbox_deliveries
                 WHERE claim_id = 1 AND subscriber = '{by}'"
            )
        };
        let mut arguments = vec![
            events("= 'a'", "id"),
            events("= 'p'", "id"),
            events("= 'p'", "'unreadable'::text"),
            events("= 'p'", "id % 7 + 0.5"),
            events("= 'x'", "id"),
            events("= 'x'", "'x' || id"),
            taken("up", "subscriber"),
            taken("up", "event_id"),
            new("id"),
            new("s"),
            new("'a'::text"),
            new("aggregate_id"),
            new("first::int"),
            new("CASE WHEN first THEN 'down' END"),
            new("CASE WHEN first THEN 60 END"),
            new("false"),
            taken("back", "subscriber"),
            taken("back", "event_id"),
        ];
        if part {
            arguments.push(events("IN ('a', 'p', 'x')", "id"));
        }
        let select = arguments
            .iter()
            .map(|a| format!("quote_literal(({a})::text)"))
            .collect::<Vec<_>>()
            .join(", ");
        let row = sqlx::query(AssertSqlSafe(format!("SELECT {select}")))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let arguments: Vec<String> = (0..row.len()).map(|i| row.get(i)).collect();
        let execute = format!("{name}(1, {})", arguments.join(", "));
        conn.execute(sqlx::raw_sql(queries.record_begin.clone()))
            .await
            .unwrap();
        let plan = explain_execute(&mut conn, &execute).await;
        conn.execute("COMMIT").await.unwrap();
        assert_eq!(plan["Actual Rows"], 1, "{plan:#}");
        let recorded = 2 * AGGREGATES + 2 * STALLED + AGGREGATES + AGGREGATES + 6 * AGGREGATES;
        let work = work_of(&plan);
        assert!(
            work <= (20 * recorded) as f64,
            "{mode} {name}: a record of {recorded} rows did the work of {work} rows: {plan:#}"
        );
        // What it recorded: every key's first row due, the rest waiting behind it; the events
        // published, parked, dead.
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT subscriber, count(*) FILTER (WHERE next_retry_at IS NOT NULL),
                    count(*) FILTER (WHERE next_retry_at IS NULL)
             FROM events.outbox_deliveries GROUP BY 1 ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        let keys = AGGREGATES;
        assert_eq!(
            rows,
            [
                ("back".into(), keys, 10 * keys),
                ("one".into(), keys, keys),
                ("three".into(), keys, keys),
                ("two".into(), keys, keys),
                ("up".into(), keys, 9 * keys),
            ],
            "{mode} {name}"
        );
        let events: Vec<(String, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT aggregate_type, count(published_at), count(dead_at),
                    count(*) FILTER (WHERE last_error = CASE aggregate_type
                        WHEN 'p' THEN 'unreadable' ELSE 'x' || id END),
                    -- (Parked for its delay from the record's time, its events' publication.)
                    count(*) FILTER (WHERE retry_count = 1 AND next_retry_at
                        = (SELECT max(published_at) FROM events.outbox)
                          + (id % 7 + 0.5) * interval '1 second')
             FROM events.outbox WHERE aggregate_type IN ('a', 'p', 'x') GROUP BY 1 ORDER BY 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            events,
            [
                ("a".into(), 2 * AGGREGATES, 0, 0, 0),
                ("p".into(), 0, 0, STALLED, STALLED),
                ("x".into(), 0, STALLED, STALLED, 0),
            ],
            "{mode} {name}"
        );
        // A record of part leaves its claim live, with none of the events it named (the claim
        // lists them, and the part it noted takes them out).
        assert_eq!(
            listed_by_claim_1(&db.pool).await,
            part.then(Vec::new),
            "{mode} {name}"
        );
    }

    /// A record takes a lock per key it writes deliveries of (records of one key take turns),
    /// and the server's lock table holds about ten thousand locks, for every session at once
    /// (64 a connection by default): a batch failing for five subscribers over 4 000
    /// aggregates, 20 000 keys, failed to record ("out of shared memory") at every try, and
    /// its events came back to be delivered again, for ever. A record of that many keys takes
    /// one lock for them all (and waits for the records of few keys, which take it shared).
    #[tokio::test]
    async fn a_record_of_more_keys_than_the_server_can_lock_is_applied() {
        const EVENTS: u32 = 4_000;
        const SUBSCRIBERS: usize = 5;
        let db = migrated().await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'a', gen_random_uuid(), 'E', '{{}}' FROM generate_series(1, {EVENTS})"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let queries = Postgres::queries(&TableNames::default());
        let batch = Postgres::claim(
            &db.pool,
            &queries,
            ClaimLimit::events(EVENTS),
            Duration::from_secs(60),
            &ClaimFilter::default(),
        )
        .await
        .unwrap();
        let mut outcomes = Outcomes::default();
        for claim in &batch.claims {
            let Claim::Event { event, .. } = claim else {
                panic!("only events wait: {claim:?}");
            };
            outcomes.events.push((event.id, EventOutcome::Published));
            for subscriber in 0..SUBSCRIBERS {
                outcomes.deliveries.push(DeliveryRecord {
                    event_id: event.id,
                    aggregate_type: event.aggregate_type.clone(),
                    aggregate_id: event.aggregate_id,
                    subscriber: format!("s{subscriber}"),
                    outcome: DeliveryOutcome::Retry {
                        attempts: 1,
                        error: "down".into(),
                        retry_in: Duration::from_secs(60),
                    },
                });
            }
        }
        assert_eq!(outcomes.events.len(), EVENTS as usize);
        let recorded = Postgres::record(&db.pool, &queries, batch.token, &outcomes, false).await;
        assert_eq!(recorded.unwrap(), Recorded::Applied);
        let rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM events.outbox_deliveries WHERE next_retry_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(rows, i64::from(EVENTS) * SUBSCRIBERS as i64);
    }

    /// `n` keys of subscriber `s` and aggregate type `a`, the first of aggregate `first`, as
    /// `lock_keys` takes them.
    fn keys_from(n: usize, first: Uuid) -> (Vec<&'static str>, Vec<&'static str>, Vec<Uuid>) {
        let ids = std::iter::once(first)
            .chain(std::iter::repeat_with(Uuid::new_v4))
            .take(n)
            .collect();
        (vec!["s"; n], vec!["a"; n], ids)
    }

    /// Whether a record locking `keys` waits (more than 100 ms) for the locks held now.
    async fn waits_to_lock_keys(
        pool: &PgPool,
        queries: &PgQueries,
        (subscribers, types, ids): (Vec<&str>, Vec<&str>, Vec<Uuid>),
    ) -> bool {
        let mut record = pool.begin().await.unwrap();
        record
            .execute("SET LOCAL lock_timeout = '100ms'")
            .await
            .unwrap();
        let locked = sqlx::query(queries.lock_keys.clone())
            .bind(subscribers)
            .bind(types)
            .bind(ids)
            .execute(&mut *record)
            .await;
        record.rollback().await.unwrap();
        match locked {
            Ok(_) => false,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => true,
            Err(e) => panic!("{e}"),
        }
    }

    /// Records of many keys and records of a few take turns: one holds the lock of all keys, the
    /// others that lock shared; records of a few keys take turns only on the keys they share.
    #[tokio::test]
    async fn records_of_many_keys_wait_for_records_of_few_and_the_other_way_round() {
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        let one = Uuid::new_v4();
        // Whether a transaction can lock `second`'s keys while another holds `first`'s.
        let waits = async |first: usize, first_key: Uuid, second: usize, second_key: Uuid| {
            let mut held = db.pool.begin().await.unwrap();
            let (s, t, a) = keys_from(first, first_key);
            sqlx::query(queries.lock_keys.clone())
                .bind(s)
                .bind(t)
                .bind(a)
                .execute(&mut *held)
                .await
                .unwrap();
            let waits = waits_to_lock_keys(&db.pool, &queries, keys_from(second, second_key)).await;
            held.rollback().await.unwrap();
            waits
        };
        let many = MAX_KEY_LOCKS + 1;
        assert!(waits(1, one, many, Uuid::new_v4()).await, "many after few");
        assert!(waits(many, Uuid::new_v4(), 1, one).await, "few after many");
        assert!(waits(1, one, 3, one).await, "a key in common");
        assert!(!waits(1, one, 3, Uuid::new_v4()).await, "no key in common");
        assert!(
            !waits(MAX_KEY_LOCKS, one, 3, Uuid::new_v4()).await,
            "as many as are locked"
        );
    }

    /// While a relay of a build before the lock of all keys is live (its registration has no
    /// relay protocol), a record of many keys takes each key's lock, as that relay's records
    /// do: both take turns on the keys they share. Once it is gone (or its registration
    /// expired), the lock of all keys again.
    #[tokio::test]
    async fn a_record_of_many_keys_takes_each_keys_lock_while_an_earlier_build_is_live() {
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        let one = Uuid::new_v4();
        // Whether a record of many keys, `one`'s among them, waits for an earlier build's
        // record of `one` (which takes that key's lock alone).
        let waits_for_an_earlier_record = async || {
            let mut earlier = db.pool.begin().await.unwrap();
            sqlx::query(
                "SELECT pg_advisory_xact_lock($1, hashtext('s' || '/' || 'a' || '/' || $2::text))",
            )
            .bind(!TableNames::default().lock_namespace())
            .bind(one)
            .execute(&mut *earlier)
            .await
            .unwrap();
            let many = keys_from(MAX_KEY_LOCKS + 1, one);
            let waits = waits_to_lock_keys(&db.pool, &queries, many).await;
            earlier.rollback().await.unwrap();
            waits
        };
        assert!(
            !waits_for_an_earlier_record().await,
            "no relay registered: the lock of all keys, which an earlier build does not take"
        );
        let register = async |routing: &str, age: &str| {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO events.outbox_relays (id, routing, seen_at)
                 VALUES ($1, $2, now() - interval '{age}')"
            )))
            .bind(Uuid::new_v4())
            .bind(routing)
            .execute(&db.pool)
            .await
            .unwrap();
        };
        register(r#"{"events": [], "subscribers": [], "protocol": 1}"#, "0 s").await;
        assert!(
            !waits_for_an_earlier_record().await,
            "a relay of this protocol is live"
        );
        register(r#"{"events": [], "subscribers": []}"#, "1 minute").await;
        assert!(
            !waits_for_an_earlier_record().await,
            "an earlier build's registration expired"
        );
        register(r#"{"events": [], "subscribers": []}"#, "0 s").await;
        assert!(
            waits_for_an_earlier_record().await,
            "an earlier build is live: each key's lock"
        );
    }

    /// A publication time other SQL wrote as -infinity stops no purge: that row is kept, the
    /// others go.
    #[tokio::test]
    async fn a_purge_goes_on_past_a_publication_time_of_minus_infinity() {
        let db = migrated().await;
        sqlx::raw_sql(
            "INSERT INTO events.outbox
                 (aggregate_type, aggregate_id, event_type, payload, published_at)
             VALUES ('a', gen_random_uuid(), 'E', '{}', '-infinity'),
                    ('a', gen_random_uuid(), 'E', '{}', now() - interval '2 days'),
                    ('a', gen_random_uuid(), 'E', '{}', now() - interval '2 days')",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let queries = Postgres::queries(&TableNames::default());
        let step = purge_step(
            &db.pool,
            &queries,
            Duration::from_secs(86_400),
            1,
            None,
            0..0,
        )
        .await
        .unwrap();
        assert_eq!(step.deleted, 1);
        let step = purge_step(
            &db.pool,
            &queries,
            Duration::from_secs(86_400),
            1,
            step.next,
            0..0,
        )
        .await
        .unwrap();
        assert_eq!((step.deleted, step.next.is_some()), (1, true));
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(left, 1);
    }

    /// A retry or a park longer than a timestamp holds (a caller of the store other than the
    /// relay, whose settings stop at 1000 years) is recorded far ahead, not refused: a refused
    /// record would deliver the batch again at its lease's end.
    #[tokio::test]
    async fn a_delay_no_timestamp_holds_is_recorded_far_ahead_not_refused() {
        let db = migrated().await;
        let queries = Postgres::queries(&TableNames::default());
        let (parked, retried) = (
            insert_event(&db.pool, Uuid::new_v4()).await.unwrap(),
            insert_event(&db.pool, Uuid::new_v4()).await.unwrap(),
        );
        let batch = claim_ten(&db.pool, &queries).await;
        assert_eq!(batch.claims.len(), 2);
        let outcomes = Outcomes {
            events: vec![
                (
                    parked,
                    EventOutcome::Parked {
                        reason: "newer".to_owned(),
                        retry_in: Duration::MAX,
                    },
                ),
                (retried, EventOutcome::Published),
            ],
            deliveries: vec![DeliveryRecord {
                event_id: retried,
                aggregate_type: "t".to_owned(),
                aggregate_id: Uuid::new_v4(),
                subscriber: "s".to_owned(),
                outcome: DeliveryOutcome::Retry {
                    attempts: 1,
                    error: "down".to_owned(),
                    retry_in: Duration::MAX,
                },
            }],
        };
        let recorded = Postgres::record(&db.pool, &queries, batch.token, &outcomes, false);
        assert_eq!(recorded.await.unwrap(), Recorded::Applied);
        let far: (bool, bool) = sqlx::query_as(
            "SELECT (SELECT next_retry_at > now() + interval '999 years'
                     FROM events.outbox WHERE id = $1),
                    (SELECT next_retry_at > now() + interval '999 years'
                     FROM events.outbox_deliveries WHERE event_id = $2)",
        )
        .bind(parked)
        .bind(retried)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(far, (true, true));
    }
}
