//! The seed's billing scenario, end to end. See `outbox_examples::billing`.
//!
//! ```sh
//! cargo run --example billing                                   # SQLite, a temporary file
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --example billing
//! ```

use outbox_core::BoxError;
use outbox_examples::billing::scenario;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            scenario::on_postgres(&url).await?;
        }
        Ok(url) => {
            return Err(format!(
                "DATABASE_URL must be a postgres:// URL (or unset, for SQLite); got {url:?}"
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
