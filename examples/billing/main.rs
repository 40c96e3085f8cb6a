//! The seed's billing scenario, end to end. See `outbox_examples::billing`.
//!
//! ```sh
//! cargo run --example billing                                   # SQLite, a temporary file
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --example billing
//! DATABASE_URL=mysql://root@127.0.0.1/test cargo run --example billing
//! cargo run --example billing -- catalog --format asyncapi      # what the service emits
//! ```

use std::process::ExitCode;

use outbox_core::{BoxError, Router};
use outbox_examples::billing::app::App;
use outbox_examples::billing::scenario;

#[tokio::main]
async fn main() -> ExitCode {
    outbox_examples::exit(run().await)
}

async fn run() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(command) = args.first() {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // The router's catalog: the events, their versions and JSON Schemas, the subscribers.
        let catalog = App::catalog();
        let document = match (command.as_str(), &args[1..]) {
            ("catalog", [] | ["--format", "json"]) => catalog.to_json(),
            ("catalog", ["--format", "asyncapi"]) => {
                catalog.to_asyncapi("billing", env!("CARGO_PKG_VERSION"))
            }
            _ => {
                return Err(format!(
                    "unknown arguments {args:?}: run with no arguments for the scenario, or \
                     `catalog [--format json|asyncapi]` for the catalog"
                )
                .into());
            }
        };
        println!("{}", serde_json::to_string_pretty(&document)?);
        return Ok(());
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            scenario::on_postgres(&url).await?;
        }
        Ok(url) if url.starts_with("mysql://") || url.starts_with("mariadb://") => {
            scenario::on_mysql(&url.replacen("mariadb://", "mysql://", 1)).await?;
        }
        Ok(url) => {
            return Err(format!(
                "DATABASE_URL must be a postgres:// or mysql:// URL (or unset, for SQLite); \
                 got {url:?}"
            )
            .into());
        }
        Err(_) => {
            let dir = tempfile::tempdir()?;
            scenario::on_sqlite_file(&dir.path().join("billing.db")).await?;
        }
    }
    Ok(())
}
