//! PostgreSQL: an events table partitioned by id, whose retention gives old events back whole.
//!
//! Retention that deletes rows frees their space for reuse inside the table's files, not for
//! the file system: a table that grew under a burst, or while a session held an old snapshot
//! (vacuum can then reclaim nothing), keeps its size. [`Outbox::partition_by_id`] makes the
//! events table a parent of range partitions of consecutive ids; retention then empties a
//! partition whose events are all published, delivered and older than its window with one
//! `TRUNCATE` (its files go at once), and drops it. See ARCHITECTURE.md, "Partitions".
//!
//! The partitions:
//!
//! - `<table>_p0`: the table as it was, events up to the first id drawn after the conversion;
//! - `<table>_p<first id>`: `events_per_partition` ids each, made ahead of the ids being drawn
//!   ([`AHEAD`] of them) by each purge;
//! - `<table>_pdefault`: the events no range partition takes, when the purges fell behind (or
//!   retention is off): nothing is refused. Its events are purged row by row, as before.
//!
//! Locks: a purge makes a partition with `ATTACH PARTITION` (it takes `SHARE UPDATE EXCLUSIVE`
//! on the table, publishers and relays go on, and the default partition's lock for a moment:
//! the new partition's indexes are made before); it empties one with `TRUNCATE`, which locks
//! that partition alone, and detaches an empty one, which locks the table for a moment (then
//! drops it, detached). Each waits at most [`LOCK_WAIT`] for its lock and leaves the work to
//! the next purge otherwise, so that no publisher or relay queues behind it for longer; each
//! commits asynchronously, so that it holds its locks no longer than its work. Relays' claims
//! and records read every partition (their plans cover them all), so they wait while any one
//! is locked.

use std::time::Duration;

use sqlx::{Executor, PgConnection, PgPool, Postgres};

use crate::backend::{seconds, sql};
use crate::error::Error;
use crate::names::TableNames;
use crate::outbox::Outbox;

/// Range partitions kept made ahead of the ids being drawn. Each partition is in the plan of
/// every statement that reads the table (generic plans cannot leave out empty ones): few.
pub(crate) const AHEAD: i64 = 2;

/// How long partition work waits for a lock before it leaves the work to the next purge:
/// while it waits, statements that need the table (or the partition) queue behind it.
pub(crate) const LOCK_WAIT: Duration = Duration::from_millis(20);

/// The most events one partition may hold.
pub(crate) const MOST_PER_PARTITION: u64 = 1 << 40;

/// How far above the last id drawn a partition made after the ids outran the partitions
/// starts, at most (a partition's size if smaller): events written meanwhile, between the
/// two, go to the default partition, where they do not stop the new partition's attachment.
const SLACK: i64 = 1_000;

/// How long the conversion waits for the events table's lock, each time; how many times it
/// tries again, and after what pause, before it gives up.
const TABLE_LOCK_WAIT: Duration = Duration::from_secs(1);
const TABLE_LOCK_TRIES: u32 = 30;
const TABLE_LOCK_PAUSE: Duration = Duration::from_millis(200);

/// How many ids the table as it was (`<table>_p0`) takes beyond the last one drawn when the
/// conversion began: the ids drawn while the conversion checks its rows, without blocking.
const CONVERSION_MARGIN: i64 = 1_000_000;

/// How long a purge waits for the transactions that may still write into a partition it
/// would empty before it leaves the partition to the next purge.
const WRITERS_WAIT: Duration = Duration::from_secs(1);

/// The most steps (a partition made, emptied or dropped) of one purge's partition work.
const MOST_STEPS: usize = 64;

impl<R> Outbox<Postgres, R> {
    /// Partitions the events table by id, `events_per_partition` ids a partition, so that
    /// [retention](outbox_core::RelayConfig::with_retention) gives old events back to the file
    /// system whole: a partition whose events are all published, delivered and older than the
    /// window is emptied with `TRUNCATE` and dropped, instead of deleting its rows one by one
    /// (whose space the table keeps). A table that grew under a burst, or while a session held
    /// an old snapshot, shrinks back once its events are past the window.
    ///
    /// Migrates first. The table keeps its name, its rows (in the first partition, `<table>_p0`)
    /// and its indexes; publishers and relays of any build go on using it. Without blocking
    /// them, the conversion checks every row once (an event id below a bound), then takes the
    /// table's lock for a moment to rename and attach it. It waits at most a second for that
    /// lock each time, so that publishers do not queue behind it for longer while a long
    /// transaction holds the table, and tries again; after about half a minute of such waits
    /// it returns [`Error::TableBusy`], changing nothing: run it again when the table is
    /// quieter. The partitions' own purges make the
    /// next partitions ahead of the ids being drawn; events beyond them (no purge ran for a
    /// while, or retention is off) go to a default partition, never refused. The events table
    /// no longer has a foreign key from the deliveries (the relay never writes one without its
    /// event, and retention checks it before an event goes).
    ///
    /// Size the partitions so that one holds about a retention window of events (and more
    /// than a purge interval's): partitions are given back whole, so the table holds the
    /// window plus up to one partition; and each partition, empty or not, is in the plan of
    /// every statement that reads the table (the relay's claim is planned again after a
    /// vacuum changes one), and each one emptied, made or dropped locks relays out for a
    /// moment: a few large partitions, not many small ones. (In the pressure benchmark, with
    /// a window of events a partition, the relay's 99th percentile stayed under 50 ms in every
    /// window, a held snapshot and its release included, and the table came back within 2x of
    /// its size: `BENCHMARKS.md`, (6).)
    /// Calling this again on a partitioned table changes the size of the partitions made from
    /// then on.
    ///
    /// PostgreSQL only; 12 or newer.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool) -> Result<(), outbox_sqlx::Error> {
    /// use outbox_sqlx::Outbox;
    ///
    /// let outbox: Outbox<sqlx::Postgres, ()> = Outbox::new(pool);
    /// outbox.partition_by_id(1_000_000).await?;
    /// # Ok(()) }
    /// # let _ = f;
    /// ```
    pub async fn partition_by_id(&self, events_per_partition: u64) -> Result<(), Error> {
        if !(1..=MOST_PER_PARTITION).contains(&events_per_partition) {
            return Err(outbox_core::ConfigError::InvalidSetting {
                setting: "events per partition",
                reason: format!(
                    "{events_per_partition} is out of range: use 1 to {MOST_PER_PARTITION}"
                ),
            }
            .into());
        }
        let size = i64::try_from(events_per_partition).unwrap_or(i64::MAX);
        self.migrate().await?;
        match convert(self.pool(), self.names(), size).await {
            Err(error) if is_lock_timeout(&error) => Err(Error::TableBusy {
                schema: self.names().schema().to_owned(),
                table: self.names().table().to_owned(),
                waited_secs: (TABLE_LOCK_WAIT * (TABLE_LOCK_TRIES + 1)).as_secs(),
            }),
            converted => Ok(converted?),
        }
    }
}

/// The SQL names of one set of tables' partitions.
struct Names<'a> {
    names: &'a TableNames,
    outbox: String,
    deliveries: String,
    settings: String,
    id_seq: String,
}

impl<'a> Names<'a> {
    fn new(names: &'a TableNames) -> Self {
        Self {
            names,
            outbox: names.qualified(""),
            deliveries: names.qualified("_deliveries"),
            settings: names.qualified("_partitioning"),
            id_seq: names.qualified("_id_seq"),
        }
    }

    /// The range partition whose first id is `lo`.
    fn partition(&self, lo: i64) -> String {
        self.names.qualified(&format!("_p{lo}"))
    }

    /// The one-key advisory lock that admits one partition worker at a time (the claim's lock
    /// is the odd one of the same namespace).
    fn lock(&self) -> i64 {
        i64::from(self.names.lock_namespace()) << 1
    }
}

/// Whether the events table is partitioned.
async fn is_partitioned(conn: &mut PgConnection, n: &Names<'_>) -> Result<bool, sqlx::Error> {
    let kind: Option<bool> = sqlx::query_scalar(
        "SELECT c.relkind = 'p' FROM pg_class AS c WHERE c.oid = to_regclass($1)",
    )
    .bind(&n.outbox)
    .fetch_optional(&mut *conn)
    .await?
    .flatten();
    Ok(kind == Some(true))
}

/// The last event id drawn (none yet: 0).
async fn last_id(conn: &mut PgConnection, n: &Names<'_>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sql(format!(
        "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {}",
        n.id_seq
    )))
    .fetch_one(&mut *conn)
    .await
}

/// Makes the events table of `names` partitioned, or sets the size of the partitions made from
/// now on if it is.
///
/// On a connection of its own that holds the partition workers' lock throughout (purges leave
/// their partition work meanwhile): if the conversion fails, or its process dies, half way,
/// the check it added goes with it (here, or at the next purge, `drop_leftover_check`).
async fn convert(pool: &PgPool, names: &TableNames, size: i64) -> Result<(), sqlx::Error> {
    let n = Names::new(names);
    let mut conn = pool.acquire().await?.detach();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(n.lock())
        .execute(&mut conn)
        .await?;
    let converted = convert_locked(&mut conn, &n, size).await;
    if converted.is_err() {
        let _ = drop_leftover_check(&mut conn, &n).await;
    }
    let _ = sqlx::Connection::close(conn).await;
    converted
}

/// The check constraint a conversion adds to the table as it was (ids below a bound).
fn leftover_check(names: &TableNames) -> String {
    names.local("_p0_ids")
}

/// Drops the check a conversion that did not finish left on the events table (it would refuse
/// ids beyond its bound), unless a conversion is at work (it holds the lock; the session that
/// holds it may take it again).
async fn drop_leftover_check(conn: &mut PgConnection, n: &Names<'_>) -> Result<(), sqlx::Error> {
    let Some(mut tx) = begin_step(conn, n).await? else {
        return Ok(());
    };
    if is_partitioned(&mut tx, n).await? {
        return Ok(());
    }
    run(
        &mut tx,
        format!(
            "ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}",
            n.outbox,
            leftover_check(n.names)
        ),
    )
    .await?;
    tx.commit().await
}

async fn convert_locked(
    conn: &mut PgConnection,
    n: &Names<'_>,
    size: i64,
) -> Result<(), sqlx::Error> {
    let check = leftover_check(n.names);
    // The two moments the table is locked wait at most `TABLE_LOCK_WAIT` each time (a long
    // transaction on the table would otherwise queue every publisher behind the conversion).
    let mut tries = 0;
    let bound = loop {
        let mut tx = begin_table_step(conn).await?;
        match add_check(&mut tx, n, size).await {
            Ok(bound) => {
                tx.commit().await?;
                match bound {
                    Some(bound) => break bound,
                    // Partitioned already: the size was set.
                    None => return Ok(()),
                }
            }
            Err(error) if is_lock_timeout(&error) && tries < TABLE_LOCK_TRIES => {
                tx.rollback().await?;
                tries += 1;
                tokio::time::sleep(TABLE_LOCK_PAUSE).await;
            }
            Err(error) => return Err(error),
        }
    };
    // Reads every row, while publishers and relays go on.
    run(
        &mut *conn,
        format!("ALTER TABLE {} VALIDATE CONSTRAINT {check}", n.outbox),
    )
    .await?;
    let mut tries = 0;
    loop {
        let mut tx = begin_table_step(conn).await?;
        match attach_old(&mut tx, n, size, bound).await {
            Ok(()) => return tx.commit().await,
            Err(error) if is_lock_timeout(&error) && tries < TABLE_LOCK_TRIES => {
                tx.rollback().await?;
                tries += 1;
                tokio::time::sleep(TABLE_LOCK_PAUSE).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Begins a transaction of the conversion that waits at most [`TABLE_LOCK_WAIT`] for a lock.
async fn begin_table_step(
    conn: &mut PgConnection,
) -> Result<sqlx::Transaction<'_, Postgres>, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    run(
        &mut tx,
        format!(
            "SET LOCAL lock_timeout = '{}ms'",
            TABLE_LOCK_WAIT.as_millis()
        ),
    )
    .await?;
    Ok(tx)
}

/// The conversion's first step: a check that every id stays below a bound, not yet validated;
/// returns the bound, or `None` (after setting the size of new partitions) if the table is
/// partitioned already.
async fn add_check(
    tx: &mut PgConnection,
    n: &Names<'_>,
    size: i64,
) -> Result<Option<i64>, sqlx::Error> {
    let check = leftover_check(n.names);
    if is_partitioned(tx, n).await? {
        run(
            &mut *tx,
            format!("UPDATE {} SET events_per_partition = {size}", n.settings),
        )
        .await?;
        return Ok(None);
    }
    // Every id drawn until the table is converted stays below the bound; rows written from
    // now on are checked at once, those before by the validation that follows.
    let bound = last_id(tx, n).await?.saturating_add(CONVERSION_MARGIN);
    run(
        &mut *tx,
        format!(
            "ALTER TABLE {outbox} DROP CONSTRAINT IF EXISTS {check};
             ALTER TABLE {outbox} ADD CONSTRAINT {check} CHECK (id < {bound}) NOT VALID;",
            outbox = n.outbox
        ),
    )
    .await?;
    Ok(Some(bound))
}

/// The conversion's last step, under the table's lock: the table as it was becomes the first
/// partition of a new parent of the same name.
async fn attach_old(
    tx: &mut PgConnection,
    n: &Names<'_>,
    size: i64,
    bound: i64,
) -> Result<(), sqlx::Error> {
    let names = n.names;
    let check = leftover_check(names);
    let old = names.qualified("_p0");
    run(
        &mut *tx,
        format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", n.outbox),
    )
    .await?;
    // The ids drawn from now on go to the partitions after the old table.
    let last = last_id(tx, n).await?;
    if last < bound - 1 {
        sqlx::query("SELECT setval($1::regclass, $2)")
            .bind(&n.id_seq)
            .bind(bound - 1)
            .execute(&mut *tx)
            .await?;
    }
    // The old table and what hangs on it, before it is renamed: its indexes (re-created on
    // the parent under their names, and attached), its triggers (moved to the parent, which
    // gives them to every partition) and the foreign keys that point at it (dropped: a
    // partition referred to cannot be emptied with TRUNCATE).
    let indexes: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT i.indexrelid::regclass::text, c.relname::text, i.indisprimary
         FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
         WHERE i.indrelid = $1::regclass ORDER BY c.relname",
    )
    .bind(&n.outbox)
    .fetch_all(&mut *tx)
    .await?;
    let foreign_keys: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, quote_ident(c.conname)
         FROM pg_constraint AS c WHERE c.confrelid = $1::regclass AND c.contype = 'f'",
    )
    .bind(&n.outbox)
    .fetch_all(&mut *tx)
    .await?;
    let old_text: String = {
        run(
            &mut *tx,
            format!("ALTER TABLE {} RENAME TO {}", n.outbox, names.local("_p0")),
        )
        .await?;
        // As `pg_get_indexdef` and `pg_get_triggerdef` print it: always with its schema.
        sqlx::query_scalar(
            "SELECT quote_ident(s.nspname) || '.' || quote_ident(c.relname)
             FROM pg_class AS c JOIN pg_namespace AS s ON s.oid = c.relnamespace
             WHERE c.oid = $1::regclass",
        )
        .bind(&old)
        .fetch_one(&mut *tx)
        .await?
    };
    let triggers: Vec<(String, String)> = sqlx::query_as(
        "SELECT t.tgname::text, pg_get_triggerdef(t.oid)
         FROM pg_trigger AS t WHERE t.tgrelid = $1::regclass AND NOT t.tgisinternal",
    )
    .bind(&old)
    .fetch_all(&mut *tx)
    .await?;
    for (referring, constraint) in &foreign_keys {
        run(
            &mut *tx,
            format!("ALTER TABLE {referring} DROP CONSTRAINT {constraint}"),
        )
        .await?;
    }
    for (name, _) in &triggers {
        run(&mut *tx, format!("DROP TRIGGER {} ON {old}", quote(name))).await?;
    }
    // Free the indexes' names for the parent's.
    let mut definitions = Vec::new();
    for (i, (index, name, primary)) in indexes.iter().enumerate() {
        let temporary = names.local(&format!("_p0_index{i}"));
        run(
            &mut *tx,
            format!("ALTER INDEX {index} RENAME TO {temporary}"),
        )
        .await?;
        let definition: String = sqlx::query_scalar("SELECT pg_get_indexdef(to_regclass($1))")
            .bind(format!("{}.{temporary}", names.quoted_schema()))
            .fetch_one(&mut *tx)
            .await?;
        definitions.push((name.clone(), definition, *primary));
    }
    run(
        &mut *tx,
        format!(
        "CREATE TABLE {outbox} (LIKE {old} INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING COMMENTS)
             PARTITION BY RANGE (id);
         ALTER SEQUENCE {id_seq} OWNED BY {outbox}.id;",
        outbox = n.outbox,
        id_seq = n.id_seq,
    ),
    )
    .await?;
    for (name, definition, primary) in &definitions {
        if *primary {
            run(
                &mut *tx,
                format!(
                    "ALTER TABLE {} ADD CONSTRAINT {} PRIMARY KEY (id)",
                    n.outbox,
                    quote(name)
                ),
            )
            .await?;
        } else {
            // "CREATE INDEX <temporary> ON <old> USING ..." -> "... <name> ON <parent> USING".
            let on_old = format!(" ON {old_text} USING ");
            let Some(((create, _), tail)) = definition
                .split_once(&on_old)
                .and_then(|(head, tail)| Some((head.rsplit_once(' ')?, tail)))
            else {
                return Err(sqlx::Error::Protocol(format!(
                    "cannot read the definition of index {name}: {definition}"
                )));
            };
            run(
                &mut *tx,
                format!("{create} {} ON {} USING {tail}", quote(name), n.outbox),
            )
            .await?;
        }
    }
    for (name, definition) in &triggers {
        let on_old = format!(" ON {old_text} ");
        let Some((head, tail)) = definition.split_once(&on_old) else {
            return Err(sqlx::Error::Protocol(format!(
                "cannot read the definition of trigger {name}: {definition}"
            )));
        };
        run(&mut *tx, format!("{head} ON {} {tail}", n.outbox)).await?;
    }
    // The check proves the old table's range: attaching it reads no row.
    run(
        &mut *tx,
        format!(
            "ALTER TABLE {outbox} ATTACH PARTITION {old} FOR VALUES FROM (MINVALUE) TO ({bound});
         ALTER TABLE {old} DROP CONSTRAINT {check};
         CREATE TABLE {default} PARTITION OF {outbox} DEFAULT;
         CREATE TABLE {settings} (events_per_partition BIGINT NOT NULL);
         INSERT INTO {settings} VALUES ({size});",
            outbox = n.outbox,
            default = names.qualified("_pdefault"),
            settings = n.settings,
        ),
    )
    .await?;
    for k in 0..AHEAD {
        let lo = bound.saturating_add(k.saturating_mul(size));
        run(
            &mut *tx,
            format!(
                "CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({lo}) TO ({})",
                n.partition(lo),
                n.outbox,
                lo.saturating_add(size)
            ),
        )
        .await?;
    }
    Ok(())
}

/// `"name"`, quoted.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Begins a step of partition work on `conn`: a transaction that holds the partition workers'
/// lock (`None` when another worker or a conversion holds it) and waits at most [`LOCK_WAIT`]
/// for any other lock.
async fn begin_step<'c>(
    conn: &'c mut PgConnection,
    n: &Names<'_>,
) -> Result<Option<sqlx::Transaction<'c, Postgres>>, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(n.lock())
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        return Ok(None);
    }
    // Asynchronous commit: the locks go as soon as the step is done, not after the flush of
    // its commit (tens of milliseconds under load, while relays and publishers queue). A step
    // lost in a crash is only undone: done again by the next purge (whatever committed after
    // it and survived was flushed with it).
    run(
        &mut tx,
        format!(
            "SET LOCAL lock_timeout = '{}ms'; SET LOCAL synchronous_commit = off",
            LOCK_WAIT.as_millis()
        ),
    )
    .await?;
    Ok(Some(tx))
}

/// Runs `text` (statements naming partitions: not kept as prepared statements).
async fn run(conn: &mut PgConnection, text: String) -> Result<(), sqlx::Error> {
    conn.execute(sqlx::raw_sql(sql(text))).await?;
    Ok(())
}

/// What one purge's partition work did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Maintained {
    /// Partitions made ahead of the ids.
    pub made: u64,
    /// Partitions emptied, and the events they held.
    pub emptied: u64,
    pub events: u64,
    /// Empty partitions dropped.
    pub dropped: u64,
    /// The ids (`start..end`) whose events a purge leaves to their partitions, to go whole:
    /// from the first partition that is in its window (its newest publication within it) or
    /// may go whole but could not yet (its writers not gone, a lock not granted in time), to
    /// the last one made. Deleting their events one by one first would gain no space (the
    /// partition goes soon after) and leave dead rows that every scan of it reads while a
    /// snapshot is held. Below it: partitions kept for a dead letter or an event some
    /// subscriber still waits for, and a partition still filling whose newest publication is
    /// past the window, whose published events go one by one; above and between the ranges,
    /// the default partition's. Empty when the table is not partitioned.
    pub whole: (i64, i64),
}

/// One partition: its first id (`None`: from the lowest) and the id after its last.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Partition {
    name: String,
    lo: Option<i64>,
    hi: i64,
}

impl Partition {
    /// Its first id; the lowest there is for the partition from the lowest.
    fn first_id(&self) -> i64 {
        self.lo.unwrap_or(i64::MIN)
    }
}

/// The range of a partition from `pg_get_expr` of its bound; `None` for the default partition
/// (or a bound this code did not make).
fn range(bound: &str) -> Option<(Option<i64>, i64)> {
    let rest = bound.strip_prefix("FOR VALUES FROM (")?;
    let (from, to) = rest.split_once(") TO (")?;
    let to = to.strip_suffix(')')?;
    let number = |s: &str| s.trim_matches('\'').parse::<i64>().ok();
    let lo = if from == "MINVALUE" {
        None
    } else {
        Some(number(from)?)
    };
    Some((lo, number(to)?))
}

/// The range partitions of the events table, by first id.
async fn partitions(conn: &mut PgConnection, n: &Names<'_>) -> Result<Vec<Partition>, sqlx::Error> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid)
         FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
         WHERE i.inhparent = $1::regclass",
    )
    .bind(&n.outbox)
    .fetch_all(&mut *conn)
    .await?;
    let mut found: Vec<Partition> = rows
        .into_iter()
        .filter_map(|(name, bound)| range(&bound).map(|(lo, hi)| Partition { name, lo, hi }))
        .collect();
    found.sort_by_key(|p| p.lo);
    Ok(found)
}

/// The partition work of one purge: makes the partitions ahead of the ids, empties those whose
/// events are all published, delivered and published more than `keep` ago, and drops the
/// empty ones. Nothing when the table is not partitioned. Work whose lock is not granted
/// within [`LOCK_WAIT`] is left to the next purge.
pub(crate) async fn maintain(
    pool: &PgPool,
    names: &TableNames,
    keep: Duration,
) -> Result<Maintained, sqlx::Error> {
    let n = Names::new(names);
    let mut conn = pool.acquire().await?;
    let mut done = Maintained::default();
    if !is_partitioned(&mut conn, &n).await? {
        // A conversion whose process died half way left its check: dropped once no conversion
        // holds the lock.
        let leftover: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_constraint
                            WHERE conrelid = to_regclass($1) AND conname = $2)",
        )
        .bind(&n.outbox)
        .bind(leftover_check(names).trim_matches('"'))
        .fetch_one(&mut *conn)
        .await?;
        if leftover {
            drop_leftover_check(&mut conn, &n).await?;
        }
        return Ok(done);
    }
    let mut progress = Progress::default();
    // Empty partitions: detached together at the end, each detach locks the table.
    let mut empties = Vec::new();
    // The first partition left to go whole (see `Maintained::whole`), and the partitions.
    let mut whole_from = None;
    let mut found = Vec::new();
    for _ in 0..MOST_STEPS {
        let Some(mut tx) = begin_step(&mut conn, &n).await? else {
            break;
        };
        let last = last_id(&mut tx, &n).await?;
        found = partitions(&mut tx, &n).await?;
        let size: i64 = sqlx::query_scalar(sql(format!(
            "SELECT events_per_partition FROM {}",
            n.settings
        )))
        .fetch_one(&mut *tx)
        .await?;
        let Some(step) = next_step(&found, last, size, progress) else {
            break;
        };
        let outcome = match &step {
            Step::Make { lo, hi } => make(&mut tx, &n, *lo, *hi).await.map(|()| Looked::Made),
            Step::Look(partition) => empty(&mut tx, &n, partition, keep).await,
        };
        match outcome {
            Ok(looked) => {
                tx.commit().await?;
                match looked {
                    Looked::Made => done.made += 1,
                    // Looked at again by the next step: found empty then.
                    Looked::Emptied(events) => {
                        done.emptied += 1;
                        done.events += events;
                        continue;
                    }
                    Looked::Empty => {
                        if let Step::Look(partition) = &step {
                            empties.push(partition.clone());
                        }
                    }
                    Looked::Held => {}
                    Looked::Young | Looked::Busy => {
                        if let Step::Look(partition) = &step {
                            whole_from.get_or_insert(partition.first_id());
                        }
                    }
                }
            }
            // A lock not granted in time: the next purge tries again.
            Err(error) if is_lock_timeout(&error) => {
                tx.rollback().await?;
                match &step {
                    Step::Make { .. } => progress.making = false,
                    Step::Look(partition) => {
                        whole_from.get_or_insert(partition.first_id());
                    }
                }
            }
            Err(error) => return Err(error),
        }
        if let Step::Look(partition) = &step {
            progress.looked_at = Some(partition.hi);
        }
    }
    if found.is_empty() {
        // No step ran (another purge works on the partitions): all are left to go whole.
        found = partitions(&mut conn, &n).await?;
    }
    if let Some(top) = found.iter().map(|p| p.hi).max() {
        if whole_from.is_none() {
            // Of those not looked at (ids still drawn in them, or the steps ran out), the
            // first in its window: a partition that fills slower than the window does not keep
            // its old events for ever.
            for partition in found
                .iter()
                .filter(|p| progress.looked_at.is_none_or(|seen| p.hi > seen))
            {
                if !old_enough(&mut conn, &partition.name, keep).await? {
                    whole_from = Some(partition.first_id());
                    break;
                }
            }
        }
        done.whole = (whole_from.unwrap_or(top).min(top), top);
    }
    if !empties.is_empty() {
        match drop_empty(&mut conn, &n, &empties).await {
            Ok(detached) => done.dropped += detached,
            Err(error) if is_lock_timeout(&error) => {}
            Err(error) => return Err(error),
        }
    }
    // Those detached now, and any a process that died left detached.
    match drop_detached(&mut conn, &n).await {
        Ok(_) => {}
        Err(error) if is_lock_timeout(&error) => {}
        Err(error) => return Err(error),
    }
    Ok(done)
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Looked {
    /// A partition made ahead.
    Made,
    /// A partition whose newest publication is within the window, left as it is.
    Young,
    /// A partition past its window whose events may go, but whose writers have not all ended:
    /// the next purge looks again.
    Busy,
    /// A partition past its window kept for a dead letter, an event not yet published or one
    /// some subscriber has yet to receive.
    Held,
    /// A partition emptied, and the events it held.
    Emptied(u64),
    /// A partition found empty.
    Empty,
}

/// What partition work to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// Make the partition of ids `lo..hi`.
    Make { lo: i64, hi: i64 },
    /// Look at a partition whose ids are all drawn: empty it if its events may go, drop it if
    /// it is empty.
    Look(Partition),
}

/// How far one purge's partition work went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Progress {
    /// The partitions looked at already: those below this id.
    looked_at: Option<i64>,
    /// Whether partitions may still be made: not after one could not be (its lock was not
    /// granted in time), which leaves the rest to the next purge, not the partitions to empty.
    making: bool,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            looked_at: None,
            making: true,
        }
    }
}

/// The next step, given the range partitions (by first id), the last id drawn, the size of new
/// partitions and what was done already.
fn next_step(found: &[Partition], last: i64, size: i64, done: Progress) -> Option<Step> {
    let top = found.iter().map(|p| p.hi).max()?;
    let wanted = last.saturating_add(AHEAD.saturating_mul(size));
    if done.making && top <= wanted {
        // Partitions ahead of the ids; when the ids outran them, above the ids drawn (those
        // went to the default partition).
        let lo = if top > last {
            top
        } else {
            last.saturating_add(SLACK.min(size))
        };
        return Some(Step::Make {
            lo,
            hi: lo.saturating_add(size),
        });
    }
    found
        .iter()
        .find(|p| p.hi <= last.saturating_add(1) && done.looked_at.is_none_or(|seen| p.hi > seen))
        .cloned()
        .map(Step::Look)
}

/// Makes the partition of ids `lo..hi`: an empty table, attached, which locks the events table
/// only against other schema changes.
async fn make(tx: &mut PgConnection, n: &Names<'_>, lo: i64, hi: i64) -> Result<(), sqlx::Error> {
    let partition = n.partition(lo);
    run(
        &mut *tx,
        format!(
            "CREATE TABLE {partition}
                 (LIKE {outbox} INCLUDING DEFAULTS INCLUDING STORAGE INCLUDING INDEXES);
             ALTER TABLE {outbox} ATTACH PARTITION {partition} FOR VALUES FROM ({lo}) TO ({hi});",
            outbox = n.outbox
        ),
    )
    .await?;
    Ok(())
}

/// Empties `partition` if every event in it is published, delivered to every subscriber and
/// published more than `keep` ago.
async fn empty(
    tx: &mut PgConnection,
    n: &Names<'_>,
    partition: &Partition,
    keep: Duration,
) -> Result<Looked, sqlx::Error> {
    let name = &partition.name;
    let holds_any: bool =
        sqlx::query_scalar(sql(format!("SELECT EXISTS (SELECT 1 FROM ONLY {name})")))
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
    if !holds_any {
        return Ok(Looked::Empty);
    }
    // Every event of the partition is final (committed or rolled back) once its writers are
    // gone: then the look below holds, and the one under the lock can be short. (Not waited
    // for while the partition is too young anyway: one probe of the published index.)
    if !old_enough(tx, name, keep).await? {
        return Ok(Looked::Young);
    }
    if !writers_gone(tx, n, name).await? {
        return Ok(Looked::Busy);
    }
    if !may_go(tx, name, keep).await? || undelivered(tx, &n.deliveries, partition).await? {
        return Ok(Looked::Held);
    }
    // Counted before the lock: statements whose plans cover every partition wait while it is
    // held.
    let events: i64 = sqlx::query_scalar(sql(format!("SELECT count(*) FROM ONLY {name}")))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
    // Locks this partition alone. No event can come into it now (its ids are drawn, their
    // writers gone) nor become unpublished again; what is looked at again, in one probe, is
    // that no delivery row names one of its events.
    run(
        &mut *tx,
        format!("LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE"),
    )
    .await?;
    if undelivered(tx, &n.deliveries, partition).await? {
        return Ok(Looked::Held);
    }
    run(&mut *tx, format!("TRUNCATE {name}")).await?;
    Ok(Looked::Emptied(u64::try_from(events).unwrap_or(0)))
}

/// Detaches the `empties` in one transaction (the table's lock is taken once, and held for
/// the detaches alone: [`drop_detached`] drops them after); returns how many. An event may
/// still arrive in one (an id drawn before the last, written late): each is detached only if
/// it is still empty once detached, else none goes this time.
async fn drop_empty(
    conn: &mut PgConnection,
    n: &Names<'_>,
    empties: &[Partition],
) -> Result<u64, sqlx::Error> {
    let Some(mut tx) = begin_step(conn, n).await? else {
        return Ok(0);
    };
    for partition in empties {
        run(
            &mut tx,
            format!(
                "ALTER TABLE {} DETACH PARTITION {}",
                n.outbox, partition.name
            ),
        )
        .await?;
    }
    for partition in empties {
        let still_empty: bool = sqlx::query_scalar(sql(format!(
            "SELECT NOT EXISTS (SELECT 1 FROM {})",
            partition.name
        )))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        if !still_empty {
            tx.rollback().await?;
            return Ok(0);
        }
        // Marked: a process that dies before the drop leaves it to the next purge.
        run(
            &mut tx,
            format!("COMMENT ON TABLE {} IS '{DETACHED}'", partition.name),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(empties.len() as u64)
}

/// The comment on a partition detached to be dropped.
const DETACHED: &str = "outbox: an empty partition, detached; the next purge drops it";

/// Drops the tables of the events table's schema that [`drop_empty`] detached (by their
/// comment); returns how many.
async fn drop_detached(conn: &mut PgConnection, n: &Names<'_>) -> Result<u64, sqlx::Error> {
    let Some(mut tx) = begin_step(conn, n).await? else {
        return Ok(0);
    };
    let detached: Vec<String> = sqlx::query_scalar(
        "SELECT c.oid::regclass::text FROM pg_class AS c
         WHERE c.relnamespace = to_regnamespace($1) AND c.relkind = 'r'
           AND NOT c.relispartition AND obj_description(c.oid, 'pg_class') = $2",
    )
    .bind(n.names.quoted_schema())
    .bind(DETACHED)
    .fetch_all(&mut *tx)
    .await?;
    if detached.is_empty() {
        return Ok(0);
    }
    run(&mut tx, format!("DROP TABLE {}", detached.join(", "))).await?;
    tx.commit().await?;
    Ok(detached.len() as u64)
}

/// Whether every event of the partition `name` is published, and published more than `keep`
/// ago: read by its indexes (the unpublished ones are in the pending or the stalled index,
/// the newest publication time at the end of the published index).
async fn may_go(tx: &mut PgConnection, name: &str, keep: Duration) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(sql(format!(
        "SELECT NOT EXISTS (
                SELECT 1 FROM ONLY {name}
                WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NULL
                  AND held_by IS NULL AND held_behind IS NULL)
            AND NOT EXISTS (
                SELECT 1 FROM ONLY {name}
                WHERE published_at IS NULL AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL
                  OR held_by IS NOT NULL OR held_behind IS NOT NULL))
            AND coalesce((SELECT max(published_at) FROM ONLY {name}
                          WHERE published_at IS NOT NULL), '-infinity')
                < now() - $1 * interval '1 second'"
    )))
    .persistent(false)
    .bind(seconds(keep))
    .fetch_one(&mut *tx)
    .await
}

/// Whether a delivery row names an event of `partition` (a subscriber has yet to receive it,
/// or it is a dead letter): one probe of the deliveries' event index.
async fn undelivered(
    tx: &mut PgConnection,
    deliveries: &str,
    partition: &Partition,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(sql(format!(
        "SELECT EXISTS (SELECT 1 FROM {deliveries}
                        WHERE event_id >= coalesce($1, '-9223372036854775808'::int8)
                          AND event_id < $2)"
    )))
    .persistent(false)
    .bind(partition.lo)
    .bind(partition.hi)
    .fetch_one(&mut *tx)
    .await
}

/// Whether the newest publication in the partition `name` is more than `keep` ago.
async fn old_enough(
    tx: &mut PgConnection,
    name: &str,
    keep: Duration,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(sql(format!(
        "SELECT coalesce((SELECT max(published_at) FROM ONLY {name}
                          WHERE published_at IS NOT NULL), '-infinity')
                < now() - $1 * interval '1 second'"
    )))
    .persistent(false)
    .bind(seconds(keep))
    .fetch_one(&mut *tx)
    .await
}

/// Waits until the transactions that may still write an event into the partition `name`
/// (whose ids are all drawn) have ended; false if one of them is still running after
/// [`WRITERS_WAIT`] (the next purge looks again).
///
/// Those are the transactions that wrote into the partition (they hold their lock on it until
/// they end), and those running a statement on the events table at this moment: a publisher
/// draws its event's id inside its insert, after it locked the table, and locks the partition
/// the row goes to right after. (Read in this order: a statement that ends between the two
/// reads has locked its partition by then; one that starts after the first draws an id past
/// the partition's.) A transaction that published into other partitions and idles does not
/// count.
async fn writers_gone(
    tx: &mut PgConnection,
    n: &Names<'_>,
    name: &str,
) -> Result<bool, sqlx::Error> {
    let writers: Vec<String> = sqlx::query_scalar(
        "WITH busy AS MATERIALIZED (
             SELECT l.virtualtransaction FROM pg_locks AS l
             JOIN pg_stat_activity AS a ON a.pid = l.pid
             WHERE l.locktype = 'relation' AND l.relation = $1::regclass
               AND l.mode = 'RowExclusiveLock' AND a.state = 'active'
         )
         SELECT virtualtransaction FROM busy
         UNION
         SELECT l.virtualtransaction FROM pg_locks AS l
         WHERE l.locktype = 'relation' AND l.relation = $2::regclass
           AND l.mode = 'RowExclusiveLock'",
    )
    .bind(&n.outbox)
    .bind(name)
    .fetch_all(&mut *tx)
    .await?;
    let deadline = tokio::time::Instant::now() + WRITERS_WAIT;
    loop {
        // (Each transaction holds the lock of its own virtual id until it ends.)
        let running: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks
                            WHERE locktype = 'virtualxid' AND virtualxid = ANY($1)
                              AND pid <> pg_backend_pid())",
        )
        .bind(&writers)
        .fetch_one(&mut *tx)
        .await?;
        if !running {
            return Ok(true);
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether `error` is a lock not granted within `lock_timeout`.
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(sqlx::error::DatabaseError::code)
        .is_some_and(|code| code == "55P03")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_bound_is_read_as_postgresql_prints_it() {
        assert_eq!(
            range("FOR VALUES FROM ('1000') TO ('2000')"),
            Some((Some(1000), 2000))
        );
        assert_eq!(
            range("FOR VALUES FROM (MINVALUE) TO ('17')"),
            Some((None, 17))
        );
        assert_eq!(range("DEFAULT"), None);
        assert_eq!(range("FOR VALUES IN ('1')"), None);
    }

    fn partition(lo: Option<i64>, hi: i64) -> Partition {
        Partition {
            name: format!("p{lo:?}"),
            lo,
            hi,
        }
    }

    fn looked_at(id: i64) -> Progress {
        Progress {
            looked_at: Some(id),
            ..Progress::default()
        }
    }

    #[test]
    fn a_partition_that_could_not_be_made_leaves_the_old_ones_to_be_looked_at() {
        let found = [
            partition(None, 100),
            partition(Some(100), 110),
            partition(Some(110), 120),
        ];
        let not_making = Progress {
            making: false,
            ..Progress::default()
        };
        assert_eq!(
            next_step(&found, 115, 10, not_making),
            Some(Step::Look(found[0].clone()))
        );
        let looked_at_all = Progress {
            making: false,
            ..looked_at(110)
        };
        assert_eq!(next_step(&found, 115, 10, looked_at_all), None);
    }

    #[test]
    fn partitions_are_made_ahead_of_the_ids_then_old_ones_are_looked_at_in_order() {
        let found = [
            partition(None, 100),
            partition(Some(100), 110),
            partition(Some(110), 120),
        ];
        // Ahead: AHEAD partitions of 10 above id 105.
        assert_eq!(
            next_step(&found, 105, 10, Progress::default()),
            Some(Step::Make { lo: 120, hi: 130 })
        );
        let mut found = found.to_vec();
        for lo in [120, 130, 140, 150] {
            found.push(partition(Some(lo), lo + 10));
        }
        // Enough ahead: the first partition whose ids are all drawn, then the next ones.
        assert_eq!(
            next_step(&found, 115, 10, Progress::default()),
            Some(Step::Look(found[0].clone()))
        );
        assert_eq!(
            next_step(&found, 115, 10, looked_at(100)),
            Some(Step::Look(found[1].clone()))
        );
        // The partition still drawing ids is never looked at.
        assert_eq!(next_step(&found, 115, 10, looked_at(110)), None);
        assert_eq!(
            next_step(&found, 119, 10, looked_at(110)),
            Some(Step::Look(found[2].clone()))
        );
    }

    #[test]
    fn ids_that_outran_the_partitions_leave_a_gap_for_the_default_partition() {
        let found = [partition(None, 100), partition(Some(100), 110)];
        assert_eq!(
            next_step(&found, 5_000, 10, Progress::default()),
            Some(Step::Make {
                lo: 5_010,
                hi: 5_020
            })
        );
        assert_eq!(
            next_step(&found, 5_000, 10_000, Progress::default()),
            Some(Step::Make {
                lo: 5_000 + SLACK,
                hi: 15_000 + SLACK
            })
        );
    }
}
