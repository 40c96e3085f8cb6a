use outbox_sqlx::Outbox;
use sqlx::Postgres;

async fn commits_a_committed_transaction(outbox: Outbox<Postgres>) {
    let tx = outbox.begin().await.unwrap();
    let committed = tx.commit().await.unwrap();
    let _ = committed.commit().await;
}

fn main() {}
