//! The seed's billing scenario, end to end: billing charges a subscription and publishes what
//! happened in the same transaction; licensing, notification and recovery react, audit records
//! every event exactly once, recovery publishes a follow-up event from its handler, and the relay
//! retries what fails and parks what keeps failing.
//!
//! `cargo run --example billing` runs it on a temporary SQLite file;
//! `DATABASE_URL=postgres://... cargo run --example billing` on PostgreSQL (in a fresh schema,
//! dropped at the end).

pub mod app;
pub mod audit;
pub mod db;
pub mod events;
pub mod licensing;
pub mod notification;
pub mod recovery;
pub mod scenario;
pub mod service;
pub mod story;
