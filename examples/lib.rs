//! Code shared by the runnable examples and their tests.
//!
//! - [`billing`]: the seed's billing scenario, run by `cargo run --example billing`.

pub mod billing;
