//! Errors of the sqlx stores.

use outbox_core::{ConfigError, EncodeError};

/// What can go wrong in `outbox-sqlx`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database returned an error or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// An event could not be encoded; nothing was stored.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// A setting is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A consumer name or message id given to the [inbox](crate::OutboxTx::receive) cannot be
    /// stored; nothing was recorded.
    #[error("invalid inbox {role} {value:?}: {reason}")]
    InvalidInboxKey {
        /// `"consumer"` or `"message id"`.
        role: &'static str,
        /// The value (its first 80 characters).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The database holds outbox tables migrated by a newer build.
    #[error(
        "the outbox tables `{schema}.{table}` are at migration {found}, newer than the {known} \
         this build knows: run a build of outbox-sqlx at least as new as the one that migrated them"
    )]
    SchemaTooNew {
        /// The schema.
        schema: String,
        /// The base table name.
        table: String,
        /// The migration the database is at.
        found: i32,
        /// The last migration this build knows.
        known: i32,
    },
    /// A transaction published for more aggregates than the database server can lock at once;
    /// the transaction can only be rolled back (nothing of it is kept).
    ///
    /// On PostgreSQL, publishing locks each aggregate until the transaction ends (so that ids
    /// follow commit order within an aggregate), in the server's lock table, which holds about
    /// `max_locks_per_transaction` x `max_connections` locks for all sessions together (about
    /// ten thousand on a default server). Publish a bulk import in transactions of a few
    /// thousand aggregates at most, or raise `max_locks_per_transaction`.
    #[error(
        "a publish of {events} events ran out of the database server's lock table: a \
         transaction holds one lock per aggregate it publishes for, and the server holds about \
         max_locks_per_transaction x max_connections locks for all sessions; publish them in \
         smaller transactions (a few thousand aggregates each), or raise \
         max_locks_per_transaction ({source})"
    )]
    TooManyAggregates {
        /// The events of the publish that failed.
        events: usize,
        /// The server's error.
        source: sqlx::Error,
    },
    /// Other transactions held the outbox's events table for as long as an operation that must
    /// lock it for a moment (partitioning it) was willing to wait; nothing was changed.
    #[error(
        "the outbox table `{schema}.{table}` stayed locked by other transactions for {waited_secs} s \
         (a long report or migration?); nothing was changed: try again when they are done"
    )]
    TableBusy {
        /// The schema.
        schema: String,
        /// The base table name.
        table: String,
        /// How long it waited in all, in seconds.
        waited_secs: u64,
    },
}
