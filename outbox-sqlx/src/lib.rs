//! Storage for **outbox** on sqlx: PostgreSQL (feature `postgres`, default) and, later, SQLite.
//!
//! This crate will hold what touches a database: the migrations of the outbox tables, the typestate
//! transaction that publishes events atomically with the domain change, and the relay's `Store`.
//! None of it exists yet; the event model it stores lives in [`outbox_core`], re-exported here as
//! [`core`].
#![doc(test(attr(deny(warnings))))]

pub use outbox_core as core;
