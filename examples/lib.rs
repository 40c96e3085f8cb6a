//! Code shared by the runnable examples and their tests.
//!
//! - [`billing`]: the seed's billing scenario, run by `cargo run --example billing`.
//! - [`orders`]: two services over NATS JetStream, run by `cargo run --example orders`.

pub mod billing;
pub mod orders;
