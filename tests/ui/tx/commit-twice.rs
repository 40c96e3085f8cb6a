use outbox_sqlx::Outbox;
use sqlx::Postgres;

// Any router type will do: committing does not depend on it.
async fn commits_a_committed_transaction(outbox: Outbox<Postgres, ()>) {
    let tx = outbox.begin().await.unwrap();
    let committed = tx.commit().await.unwrap();
    let _ = committed.commit().await;
}

fn main() {}
