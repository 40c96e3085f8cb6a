//! Code shared by the runnable examples and their tests.
//!
//! - [`billing`]: the seed's billing scenario, run by `cargo run --example billing`.
//! - [`orders`]: two services over NATS JetStream, run by `cargo run --example orders`.

pub mod billing;
pub mod orders;

/// An example's exit: success, or its error printed for its user (`error: ...`, by its
/// message, not its debug form) and a failure code.
pub fn exit(result: Result<(), outbox_core::BoxError>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            #[allow(clippy::print_stderr, reason = "the example's one error, for its user")]
            {
                eprintln!("error: {error}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
