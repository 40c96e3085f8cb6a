//! The scenario: the steps of the seed's billing flow, on either database.

use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_core::store::Requeue;
use outbox_core::{BoxError, RelayConfig, RetryPolicy};
use outbox_sqlx::{Outbox, Status, TableNames};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Connection as _, MySql, Pool, Postgres, Sqlite};
use time::OffsetDateTime;
use time::macros::datetime;
use uuid::{Uuid, uuid};

use super::app::{App, Controls};
use super::db::{Db, DbPool, SCHEMA};
use super::service::{self, Subscription};
use super::story;

/// The first subscription and its license.
pub const SUBSCRIPTION: Uuid = uuid!("01938a6e-0000-7000-8000-000000000001");
/// The license the first subscription pays for.
pub const LICENSE: Uuid = uuid!("01938a6e-0000-7000-8000-0000000000a1");
/// A subscription whose card keeps failing.
pub const LAPSING_SUBSCRIPTION: Uuid = uuid!("01938a6e-0000-7000-8000-000000000002");
/// Its license.
pub const LAPSING_LICENSE: Uuid = uuid!("01938a6e-0000-7000-8000-0000000000a2");
/// A bot on the first license.
pub const BOT: Uuid = uuid!("01938a6e-0000-7000-8000-0000000000b1");

const PERIOD_SECS: i64 = 30 * 24 * 3600;
const START: OffsetDateTime = datetime!(2026-12-01 00:00 UTC);

/// What the scenario leaves in the database, to compare runs on different databases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalState {
    /// (id, status, period_end, cycle_count) of each subscription.
    pub subscriptions: Vec<Vec<Option<String>>>,
    /// (id, tier, status, expires_at) of each license.
    pub licenses: Vec<Vec<Option<String>>>,
    /// (license, bot) pairs counted.
    pub license_bots: Vec<Vec<Option<String>>>,
    /// (event id, event type, aggregate type, aggregate id) of each audit row.
    pub audit: Vec<Vec<Option<String>>>,
    /// (event id, recipient, message) of each notification.
    pub notifications: Vec<Vec<Option<String>>>,
    /// (event id, subject, action) of each recovery case.
    pub recovery_cases: Vec<Vec<Option<String>>>,
    /// Dead letters left.
    pub dead_letters: u64,
}

impl FinalState {
    /// Reads the state from `pool`.
    pub async fn read(pool: &DbPool) -> Result<Self, BoxError> {
        Ok(Self {
            subscriptions: pool
                .rows(
                    "SELECT id, status, period_end, cycle_count
                       FROM subscriptions ORDER BY id",
                )
                .await?,
            licenses: pool
                .rows("SELECT id, tier, status, expires_at FROM licenses ORDER BY id")
                .await?,
            license_bots: pool
                .rows("SELECT license_id, bot_id FROM license_bots ORDER BY license_id, bot_id")
                .await?,
            audit: pool
                .rows(
                    "SELECT outbox_event_id, event_type, aggregate_type, aggregate_id
                       FROM audit_log ORDER BY outbox_event_id",
                )
                .await?,
            notifications: pool
                .rows(
                    "SELECT outbox_event_id, recipient, message
                       FROM notifications ORDER BY outbox_event_id, recipient",
                )
                .await?,
            recovery_cases: pool
                .rows(
                    "SELECT outbox_event_id, subject, action
                       FROM recovery_cases ORDER BY outbox_event_id",
                )
                .await?,
            dead_letters: 0,
        })
    }
}

/// The relay's settings for the example: the seed's schedule shortened to milliseconds.
pub fn relay_config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(Duration::from_millis(100))
        .with_park_delay(Duration::from_secs(1))
        .with_retry(
            RetryPolicy::new([200, 400, 800].map(Duration::from_millis))
                .expect("a short schedule is valid"),
        )
}

/// Creates the domain tables and the outbox tables in `names`, runs the scenario with a relay in
/// the background, and returns the final state.
pub async fn run<DB: Db>(pool: Pool<DB>, names: TableNames) -> Result<FinalState, BoxError> {
    story::step(&format!("The seed's billing scenario, on {}.", DB::LABEL));
    DB::execute_script(&pool, SCHEMA).await?;
    let outbox: Outbox<DB, App> = Outbox::with_names(pool.clone(), names);
    outbox.migrate().await?;
    story::note(
        "migrated: the domain tables, and the outbox's events, deliveries and inbox tables",
    );

    let handle = DB::into_handle(pool);
    let controls = Controls::default();
    let exactly_once = DB::into_outbox(outbox.clone());
    let relay = outbox.relay(App::new(&handle, &exactly_once, &controls), relay_config())?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await;
    });
    story::note("relay started: each commit below wakes it at once");

    let result = steps(&outbox, &controls).await;
    let _ = stop.send(());
    worker.await?;
    result?;

    let mut state = FinalState::read(&handle).await?;
    state.dead_letters = outbox.status().await?.dead_letters;
    story::step("Final state.");
    for (name, rows) in [
        ("licenses", &state.licenses),
        ("license bots", &state.license_bots),
        ("audit rows", &state.audit),
        ("notifications", &state.notifications),
        ("recovery cases", &state.recovery_cases),
    ] {
        story::note(&format!("{name}: {}", rows.len()));
    }
    story::note(&format!("dead letters: {}", state.dead_letters));
    Ok(state)
}

async fn steps<DB: Db>(outbox: &Outbox<DB, App>, controls: &Controls) -> Result<(), BoxError> {
    let period_end = START.unix_timestamp() + PERIOD_SECS;
    let subscription = Subscription {
        id: SUBSCRIPTION,
        license_id: LICENSE,
        customer_email: "ada@example.com".to_owned(),
        period_end,
        cycle_count: 1,
        status: "active".to_owned(),
    };
    let lapsing = Subscription {
        id: LAPSING_SUBSCRIPTION,
        license_id: LAPSING_LICENSE,
        customer_email: "bob@example.com".to_owned(),
        ..subscription.clone()
    };

    story::step("1. Billing starts two subscriptions, each in its own transaction.");
    for sub in [&subscription, &lapsing] {
        let mut tx = outbox.begin().await?;
        service::start_subscription(&mut tx, sub).await?;
        tx.commit().await?;
        story::note(&format!(
            "committed: subscription {} + SubscriptionStarted",
            story::short(sub.id)
        ));
    }
    settle(outbox).await?;

    story::step("2. A workspace installs a bot under the first license.");
    service::install_bot(outbox, BOT, LICENSE).await?;
    story::note("committed: bot row + BotInstalled");
    settle(outbox).await?;

    story::step("3. Billing records a successful charge; the mail server is down for one send.");
    controls.mail_outage.store(1, Ordering::SeqCst);
    let mut tx = outbox.begin().await?;
    let attempt = uuid!("01938a6e-0000-7000-8000-0000000000c1");
    service::record_successful_charge(
        &mut tx,
        &subscription,
        attempt,
        "toss-pay-7",
        PERIOD_SECS,
        START,
    )
    .await?;
    tx.commit().await?;
    story::note("committed: payment attempt + subscription advanced + PaymentSucceeded");
    settle(outbox).await?;

    story::step("4. Licensing upgrades the first license to pro.");
    service::upgrade_license(outbox, LICENSE, "pro").await?;
    story::note("committed: license row + LicenseUpgraded");
    settle(outbox).await?;

    story::step("5. The bot is kicked while the recovery desk is closed.");
    controls.recovery_desk_open.store(false, Ordering::SeqCst);
    service::kick_bot(outbox, BOT, LICENSE, "spam").await?;
    story::note("committed: bot row + BotKicked");
    let status = settle(outbox).await?;
    for dead in outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await?
    {
        story::note(&format!(
            "dead letter: {} #{} for {}: {}",
            dead.event_type,
            dead.event_id,
            dead.subscriber.as_deref().unwrap_or("every subscriber"),
            dead.last_error.as_deref().unwrap_or("")
        ));
    }
    story::note(&format!(
        "dead letters waiting for an operator: {}",
        status.dead_letters
    ));

    story::step("6. An operator opens the desk and requeues recovery's dead letters.");
    controls.recovery_desk_open.store(true, Ordering::SeqCst);
    let requeued = outbox
        .requeue(&Requeue::Subscriber("recovery".to_owned()))
        .await?;
    story::note(&format!("requeued: {requeued}"));
    settle(outbox).await?;

    story::step("7. The second subscription's last charge fails.");
    let mut tx = outbox.begin().await?;
    let attempt = uuid!("01938a6e-0000-7000-8000-0000000000c2");
    service::record_final_failure(&mut tx, &lapsing, attempt, "card expired").await?;
    tx.commit().await?;
    story::note("committed: payment attempt + subscription lapsed + PaymentFailedFinal");
    settle(outbox).await?;
    Ok(())
}

/// Waits until the relay has nothing left to do: what is left is dead letters and what waits
/// behind them (`Status::is_settled`).
async fn settle<DB: Db>(outbox: &Outbox<DB, App>) -> Result<Status, BoxError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = outbox.status().await?;
        if status.is_settled() {
            return Ok(status);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("the relay did not settle within 30 s: {status:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the scenario on a new SQLite file at `path`.
pub async fn on_sqlite_file(path: &std::path::Path) -> Result<FinalState, BoxError> {
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool: Pool<Sqlite> = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    run(pool, TableNames::default()).await
}

/// Connects once, for the error a first connection gives: a pool retries until its timeout
/// (30 s) and then says only that it timed out.
async fn reachable<O>(options: &O) -> Result<(), BoxError>
where
    O: sqlx::ConnectOptions,
    O::Connection: Sized,
{
    options
        .connect()
        .await
        .map_err(|error| cannot_connect(&error))?
        .close()
        .await?;
    Ok(())
}

/// The error of a first connection, saying which setting named the server (not its value:
/// a URL may hold a password).
fn cannot_connect(error: &sqlx::Error) -> BoxError {
    let hint = match error {
        sqlx::Error::Io(_) => ": is the server running, at the host and port the URL names?",
        _ => "",
    };
    format!("cannot connect to the database DATABASE_URL names: {error}{hint}").into()
}

/// Runs the scenario on the PostgreSQL at `url`, in a new schema that is dropped at the end.
pub async fn on_postgres(url: &str) -> Result<FinalState, BoxError> {
    let schema = format!(
        "billing_example_{}_{:08x}",
        OffsetDateTime::now_utc().unix_timestamp(),
        rand_u32()
    );
    let options = PgConnectOptions::from_str(url)?;
    reachable(&options).await?;
    let admin: Pool<Postgres> = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await?;
    Postgres::execute_script(&admin, &format!("CREATE SCHEMA \"{schema}\"")).await?;
    let pool: Pool<Postgres> = PgPoolOptions::new()
        .max_connections(5)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await?;
    let names = TableNames::new(&schema, "outbox")?;
    let result = run(pool, names).await;
    Postgres::execute_script(&admin, &format!("DROP SCHEMA \"{schema}\" CASCADE")).await?;
    story::note(&format!("dropped the example's schema {schema}"));
    result
}

/// Runs the scenario on the MySQL / MariaDB server at `url`, in a new database that is dropped at
/// the end.
pub async fn on_mysql(url: &str) -> Result<FinalState, BoxError> {
    let database = format!(
        "billing_example_{}_{:08x}",
        OffsetDateTime::now_utc().unix_timestamp(),
        rand_u32()
    );
    let options = MySqlConnectOptions::from_str(url)?;
    reachable(&options).await?;
    let admin: Pool<MySql> = MySqlPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await?;
    MySql::execute_script(&admin, &format!("CREATE DATABASE `{database}`")).await?;
    let pool: Pool<MySql> = MySqlPoolOptions::new()
        .max_connections(5)
        .connect_with(options.database(&database))
        .await?;
    let result = run(pool, TableNames::default()).await;
    MySql::execute_script(&admin, &format!("DROP DATABASE `{database}`")).await?;
    story::note(&format!("dropped the example's database {database}"));
    result
}

fn rand_u32() -> u32 {
    let bytes = *Uuid::new_v4().as_bytes();
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}
