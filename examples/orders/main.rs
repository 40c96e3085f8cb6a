//! Two services over NATS JetStream. See `outbox_examples::orders`.
//!
//! ```sh
//! cargo run --example orders                  # needs nats-server -js at 127.0.0.1:4222
//! NATS_URL=127.0.0.1:4223 cargo run --example orders
//! ```

use std::process::ExitCode;

use outbox_core::BoxError;
use outbox_examples::orders;

#[tokio::main]
async fn main() -> ExitCode {
    outbox_examples::exit(run().await)
}

async fn run() -> Result<(), BoxError> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let dir = tempfile::tempdir()?;
    orders::run(&url, dir.path()).await?;
    Ok(())
}
