//! `outbox`: the operator's command-line tool for an outbox in PostgreSQL or SQLite.
//!
//! ```text
//! outbox --database-url postgres://... status
//! outbox dead-letters list --subscriber licensing
//! outbox requeue 42 43 --reason "fixed"   # or: --subscriber licensing [--failure "<first line>"]
//! outbox skip 42 --subscriber licensing --reason "refunded by hand"
//! outbox purge --published-before 30d
//! ```
//!
//! Tables by default, `--json` for scripts. Exit status: 0 when the command did what it says; 1
//! when it was tried and could not (the database unreachable, with the cause; nothing to requeue
//! or skip; tables not migrated); 2 when the command line is wrong, so nothing was tried (an
//! unknown flag, a malformed value, no or an unsupported database URL, an invalid table name, a
//! console address that is not local without `--allow-remote`).

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox_core::store::Requeue;
use outbox_sqlx::{Backend, DeadLetterGroup, ListQuery, ListState, Listed, Outbox, TableNames};
use serde_json::{Value, json};
use sqlx::Connection;
use sqlx::pool::PoolOptions;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

#[derive(Parser)]
#[command(
    name = "outbox",
    version,
    about = "Operate a transactional outbox: migrations, status, dead letters, retention"
)]
struct Cli {
    /// The database: postgres://user@host/db, mysql://user@host/db or sqlite://path/to/file.db
    #[arg(long, env = "DATABASE_URL", global = true)]
    database_url: Option<String>,
    /// The schema of the outbox tables (PostgreSQL only)
    #[arg(long, default_value = "events", global = true)]
    schema: String,
    /// The base name of the outbox tables
    #[arg(long, default_value = "outbox", global = true)]
    table: String,
    /// Print JSON instead of tables
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the outbox tables
    Migrate,
    /// Pending events, the oldest one's age, dead letters, blocked aggregates and held events,
    /// and blocked keys per subscriber
    Status,
    /// Dead letters: events that never decode, and deliveries that failed for good
    #[command(subcommand)]
    DeadLetters(DeadLetters),
    /// Events or deliveries in one state, a page at a time, in event id order
    List(ListArgs),
    /// Hand dead letters (or parked events) back to the relay
    Requeue(RequeueArgs),
    /// Give up one subscriber's delivery of an event (or a whole dead or parked event); recorded
    Skip(SkipArgs),
    /// The requeues made with a reason, newest first (skips: `list --state skipped`)
    Requeues(RequeuesArgs),
    /// Delete published events; dead letters and undelivered events are never deleted
    Purge(PurgeArgs),
    /// Serve the web console (with the `console` feature): the status over time, what holds
    /// work back, dead letters and parked events with their payloads; requeue and skip with
    /// --allow-writes
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// The address to listen on: a loopback address unless --allow-remote
    #[arg(long, default_value = "127.0.0.1:7890")]
    bind: std::net::SocketAddr,
    /// Let operators requeue and skip from the console (it is read-only without this)
    #[arg(long)]
    allow_writes: bool,
    /// Listen on an address other machines can reach
    #[arg(long)]
    allow_remote: bool,
    /// How often the console samples the status for its charts: 500ms, 5s, 1m
    #[arg(long, default_value = "5s", value_parser = parse_interval)]
    sample_every: Duration,
}

/// `500ms`, `5s` or `1m`.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}`: expected a number and a unit: 500ms, 5s, 1m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n.saturating_mul(60))),
        _ => Err(format!(
            "`{text}`: expected a number and a unit: 500ms, 5s, 1m"
        )),
    }
}

#[derive(Subcommand)]
enum DeadLetters {
    /// List dead letters, by event id, a page at a time (as `list --state dead`)
    List(PageArgs),
    /// Dead letters grouped by failure: subscriber, kind and first line of the error, largest
    /// groups first
    Groups,
}

#[derive(Args)]
#[group(required = true, multiple = true)]
struct RequeueArgs {
    /// The dead or parked events to requeue, with every dead delivery of them
    #[arg(conflicts_with_all = ["subscriber", "failure"])]
    ids: Vec<i64>,
    /// Requeue every dead delivery of this subscriber (with --failure: those of one failure)
    #[arg(long)]
    subscriber: Option<String>,
    /// Requeue one failure group, as `dead-letters groups` prints it: the dead letters whose
    /// error's first line is this (of --subscriber; without it, events that cannot be decoded)
    #[arg(long, value_name = "FIRST LINE")]
    failure: Option<String>,
    /// Why, for the record: kept in the `<table>_requeues` table with what went back
    #[arg(long)]
    reason: Option<String>,
}

#[derive(Args)]
struct ListArgs {
    /// pending, claimed, parked, held, retrying, waiting, dead or skipped
    #[arg(long, value_parser = parse_state)]
    state: ListState,
    #[command(flatten)]
    page: PageArgs,
}

#[derive(Args)]
struct PageArgs {
    /// Only this subscriber's deliveries
    #[arg(long)]
    subscriber: Option<String>,
    /// Only events of this type
    #[arg(long)]
    event_type: Option<String>,
    /// Only events of this aggregate (its id)
    #[arg(long)]
    aggregate: Option<uuid::Uuid>,
    /// Start after this row: `<event id>` or `<event id>/<subscriber>`, as the previous page
    /// says
    #[arg(long, value_parser = parse_after)]
    after: Option<String>,
    /// Rows per page
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    limit: u32,
}

fn parse_state(name: &str) -> Result<ListState, String> {
    name.parse()
}

/// `1042` or `1042/licensing`.
fn parse_after(after: &str) -> Result<String, String> {
    ListQuery::new(ListState::Dead)
        .after_key(after)
        .map(|_| after.to_owned())
}

#[derive(Args)]
struct RequeuesArgs {
    /// Only those made before this one (its id, as the previous page says)
    #[arg(long)]
    before: Option<i64>,
    /// Rows per page
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    limit: u32,
}

#[derive(Args)]
struct SkipArgs {
    /// The event
    event_id: i64,
    /// The subscriber whose delivery to give up; without it, the whole event (dead or parked)
    #[arg(long)]
    subscriber: Option<String>,
    /// Why, for the record
    #[arg(long)]
    reason: String,
}

#[derive(Args)]
struct PurgeArgs {
    /// Delete events published before this time: an RFC 3339 timestamp
    /// (2026-11-01T00:00:00Z) or an age (30d, 12h, 45m, 90s)
    #[arg(long, value_parser = parse_before)]
    published_before: OffsetDateTime,
    /// Events deleted per statement
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    batch_size: u32,
}

/// An RFC 3339 timestamp, or an age before now such as `30d`.
fn parse_before(text: &str) -> Result<OffsetDateTime, String> {
    if let Ok(time) = OffsetDateTime::parse(text, &Rfc3339) {
        if time > OffsetDateTime::now_utc() {
            return Err(format!("`{text}` is in the future"));
        }
        return Ok(time);
    }
    let unit = text.char_indices().last().map_or(0, |(i, _)| i);
    let (number, unit) = text.split_at(unit);
    let seconds: u64 = match unit {
        "d" => 24 * 3600,
        "h" => 3600,
        "m" => 60,
        "s" => 1,
        _ => 0,
    };
    match number.parse::<u64>() {
        Ok(n) if seconds > 0 => {
            let age = Duration::from_secs(n.saturating_mul(seconds));
            time::Duration::try_from(age)
                .ok()
                .and_then(|age| OffsetDateTime::now_utc().checked_sub(age))
                .ok_or_else(|| format!("`{text}` reaches too far back"))
        }
        _ => Err(format!(
            "`{text}` is neither an RFC 3339 timestamp (2026-11-01T00:00:00Z) nor an age (30d, \
             12h, 45m, 90s)"
        )),
    }
}

/// A failed command, for the user: tried and failed (exit 1), or a wrong command line, so that
/// nothing was tried (exit 2).
struct Failure {
    message: String,
    usage: bool,
}

impl Failure {
    /// The command was tried and could not be done.
    fn new(message: String) -> Self {
        Self {
            message,
            usage: false,
        }
    }

    /// The command line is wrong: nothing was tried.
    fn usage(message: String) -> Self {
        Self {
            message,
            usage: true,
        }
    }
}

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(error: E) -> Self {
        Self::new(error.to_string())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => return fail(&Failure::from(error)),
    };
    match runtime.block_on(connect_and_run(&cli)) {
        Ok(output) => {
            print!("{output}");
            ExitCode::SUCCESS
        }
        Err(failure) => fail(&failure),
    }
}

#[allow(clippy::print_stderr)] // The tool's errors are for the operator at the terminal.
fn fail(failure: &Failure) -> ExitCode {
    eprintln!("error: {}", failure.message);
    if failure.usage {
        ExitCode::from(2)
    } else {
        ExitCode::FAILURE
    }
}

async fn connect_and_run(cli: &Cli) -> Result<String, Failure> {
    let url = cli.database_url.as_deref().ok_or_else(|| {
        Failure::usage("no database: pass --database-url or set DATABASE_URL".to_owned())
    })?;
    let names = TableNames::new(&cli.schema, &cli.table)
        .map_err(|error| Failure::usage(error.to_string()))?;
    if let Command::Serve(args) = &cli.command {
        // Before connecting: a console that would not be allowed to listen is not started.
        check_serve(args)?;
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        run(connect::<sqlx::Postgres>(url).await?, names, cli).await
    } else if url.starts_with("sqlite:") {
        run(connect::<sqlx::Sqlite>(url).await?, names, cli).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        run(
            connect::<sqlx::MySql>(&url.replacen("mariadb://", "mysql://", 1)).await?,
            names,
            cli,
        )
        .await
    } else {
        Err(Failure::usage(format!(
            "unsupported database URL `{}`: use postgres://..., mysql://... or sqlite://...",
            url.split(':').next().unwrap_or(url)
        )))
    }
}

#[cfg(feature = "console")]
fn check_serve(args: &ServeArgs) -> Result<(), Failure> {
    outbox_sqlx::console::check_bind(args.bind, args.allow_remote).map_err(Failure::usage)
}

#[cfg(not(feature = "console"))]
fn check_serve(_: &ServeArgs) -> Result<(), Failure> {
    Err(Failure::usage(
        "this outbox tool was built without the web console: build it with `--features \
         console`"
            .to_owned(),
    ))
}

#[cfg(feature = "console")]
async fn serve<DB: Backend>(outbox: &Outbox<DB, ()>, args: &ServeArgs) -> Result<String, Failure> {
    use std::io::Write as _;
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .map_err(|error| Failure::new(format!("cannot listen on {}: {error}", args.bind)))?;
    let addr = listener.local_addr()?;
    let mode = if args.allow_writes {
        "writable: requeue and skip allowed"
    } else {
        "read-only"
    };
    // Ctrl-C stops it: listened for before the address is printed, so that a script that reads
    // the address and then interrupts is never early.
    #[cfg(unix)]
    let shutdown = {
        let mut interrupt =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        async move {
            interrupt.recv().await;
        }
    };
    #[cfg(not(unix))]
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    // Printed at once (not when the command ends), so that a script can read the address.
    let mut stdout = std::io::stdout();
    writeln!(
        stdout,
        "console on http://{addr}/ ({mode}); Ctrl-C stops it"
    )?;
    stdout.flush()?;
    outbox_sqlx::console::Console::new(outbox)
        .writable(args.allow_writes)
        .local_only(!args.allow_remote)
        .sample_every(args.sample_every)
        .serve(listener, shutdown)
        .await?;
    Ok(String::new())
}

#[cfg(not(feature = "console"))]
async fn serve<DB: Backend>(_: &Outbox<DB, ()>, args: &ServeArgs) -> Result<String, Failure> {
    check_serve(args).map(|()| String::new())
}

async fn connect<DB: Backend>(url: &str) -> Result<sqlx::Pool<DB>, Failure> {
    let cannot =
        |error: sqlx::Error| Failure::new(format!("cannot connect to the database: {error}"));
    // One connection first, alone: its error is the cause (connection refused, unknown host,
    // authentication), where a pool retries until its timeout and reports only that.
    let first = tokio::time::timeout(CONNECT_TIMEOUT, DB::Connection::connect(url))
        .await
        .map_err(|_| {
            Failure::new(format!(
                "cannot connect to the database: no answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            ))
        })?
        .map_err(cannot)?;
    let _ = first.close().await;
    PoolOptions::<DB>::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect(url)
        .await
        .map_err(cannot)
}

/// How long the tool waits for the database to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

async fn run<DB: Backend>(
    pool: sqlx::Pool<DB>,
    names: TableNames,
    cli: &Cli,
) -> Result<String, Failure> {
    let outbox: Outbox<DB, ()> = Outbox::with_names(pool, names);
    let json = cli.json;
    match &cli.command {
        Command::Migrate => {
            outbox.migrate().await?;
            Ok(say(
                json,
                &json!({"migrated": true}),
                "the outbox tables are up to date\n",
            ))
        }
        Command::Status => status(&outbox, json).await,
        Command::Serve(args) => serve(&outbox, args).await,
        Command::DeadLetters(DeadLetters::List(page)) => {
            list(&outbox, ListState::Dead, page, json).await
        }
        Command::List(args) => list(&outbox, args.state, &args.page, json).await,
        Command::DeadLetters(DeadLetters::Groups) => Ok(dead_letter_groups(
            &outbox.dead_letter_groups().await?,
            json,
        )),
        Command::Requeue(args) => {
            let which = match (&args.subscriber, &args.failure) {
                (subscriber, Some(first_line)) => Requeue::Failure {
                    subscriber: subscriber.clone(),
                    first_line: first_line.clone(),
                },
                (Some(subscriber), None) => Requeue::Subscriber(subscriber.clone()),
                (None, None) => Requeue::Events(args.ids.clone()),
            };
            let changed = match args.reason.as_deref().map(str::trim) {
                Some("") => {
                    return Err(Failure::usage(
                        "--reason is empty: say why, or leave it out".to_owned(),
                    ));
                }
                Some(reason) => outbox.requeue_because(&which, reason).await?,
                None => outbox.requeue(&which).await?,
            };
            if changed == 0 {
                return Err(Failure::new(match &args.subscriber {
                    _ if args.failure.is_some() => format!(
                        "nothing to requeue: no dead letter {}has the error `{}` (`outbox \
                         dead-letters groups` prints each group's first line)",
                        args.subscriber
                            .as_ref()
                            .map_or_else(String::new, |s| format!("of `{s}` ")),
                        args.failure.as_deref().unwrap_or_default()
                    ),
                    Some(subscriber) => {
                        let known: Vec<String> = outbox
                            .subscribers()
                            .await?
                            .into_iter()
                            .map(|s| s.subscriber)
                            .collect();
                        let known = if known.is_empty() {
                            "none".to_owned()
                        } else {
                            known.join(", ")
                        };
                        format!(
                            "nothing to requeue: subscriber `{subscriber}` has no dead \
                             deliveries (subscribers with deliveries: {known})"
                        )
                    }
                    None => format!(
                        "nothing to requeue: none of the events {:?} is dead, parked or has a \
                         dead delivery",
                        args.ids
                    ),
                }));
            }
            Ok(say(
                json,
                &json!({"requeued": changed}),
                &format!("requeued {changed} dead letters\n"),
            ))
        }
        Command::Requeues(args) => {
            let records = outbox.requeues(args.before, args.limit).await?;
            if json {
                return Ok(format!("{}\n", serde_json::to_string(&records)?));
            }
            if records.is_empty() {
                return Ok("no requeue recorded\n".to_owned());
            }
            let mut out = table(
                &["ID", "AT", "REQUEUED", "WHAT", "REASON"],
                &records
                    .iter()
                    .map(|r| {
                        let what = match (&r.subscriber, &r.first_line) {
                            (Some(s), Some(line)) => format!("{s}: {line}"),
                            (Some(s), None) => format!("{s}: every dead delivery"),
                            (None, Some(line)) => format!("undecodable: {line}"),
                            (None, None) => format!("events {:?}", r.event_ids),
                        };
                        vec![
                            r.id.to_string(),
                            r.requeued_at.format(&Rfc3339).unwrap_or_default(),
                            r.requeued.to_string(),
                            shorten(&what, 60),
                            shorten(&r.reason, 60),
                        ]
                    })
                    .collect::<Vec<_>>(),
            );
            if let (true, Some(last)) = (
                records.len() == usize::try_from(args.limit).unwrap_or(usize::MAX),
                records.last(),
            ) {
                out.push_str(&format!("more: --before {}\n", last.id));
            }
            Ok(out)
        }
        Command::Skip(args) => {
            let skipped = outbox
                .skip(args.event_id, args.subscriber.as_deref(), &args.reason)
                .await?;
            let what = match &args.subscriber {
                Some(subscriber) => {
                    format!("the delivery of event {} to `{subscriber}`", args.event_id)
                }
                None => format!("event {}", args.event_id),
            };
            if !skipped {
                let expected = if args.subscriber.is_some() {
                    "an undelivered delivery"
                } else {
                    "a dead or parked event"
                };
                return Err(Failure::new(format!(
                    "cannot skip {what}: it is not {expected}, or a relay is working on it now"
                )));
            }
            Ok(say(
                json,
                &json!({"skipped": {"event_id": args.event_id, "subscriber": args.subscriber}}),
                &format!("skipped {what}\n"),
            ))
        }
        Command::Purge(args) => {
            // (Parsed as a time no later than then: a clock going back since reads as now.)
            let age = OffsetDateTime::now_utc() - args.published_before;
            let older_than = Duration::try_from(age).unwrap_or_default();
            let purged = outbox.purge_published(older_than, args.batch_size).await?;
            Ok(say(
                json,
                &json!({"purged": purged}),
                &format!("purged {purged} published events\n"),
            ))
        }
    }
}

/// One page of the rows in `state`, and how to ask for the next.
async fn list<DB: Backend>(
    outbox: &Outbox<DB, ()>,
    state: ListState,
    page: &PageArgs,
    json: bool,
) -> Result<String, Failure> {
    let mut query = ListQuery::new(state).limit(page.limit);
    if let Some(subscriber) = &page.subscriber {
        query = query.subscriber(subscriber);
    }
    if let Some(event_type) = &page.event_type {
        query = query.event_type(event_type);
    }
    if let Some(aggregate) = page.aggregate {
        query = query.aggregate(aggregate);
    }
    if let Some(after) = &page.after {
        query = query.after_key(after).map_err(Failure::usage)?;
    }
    let page = outbox.list_page(&query).await?;
    Ok(listed(&page.rows, state, page.next.as_deref(), json))
}

fn say(json: bool, value: &Value, text: &str) -> String {
    if json {
        format!("{value}\n")
    } else {
        text.to_owned()
    }
}

async fn status<DB: Backend>(outbox: &Outbox<DB, ()>, json: bool) -> Result<String, Failure> {
    let report = outbox.report().await?;
    if json {
        return Ok(format!("{}\n", serde_json::to_string(&report)?));
    }
    let (status, overview, subscribers) = (&report.status, &report.overview, &report.subscribers);
    let held_back: Vec<_> = overview
        .held_back
        .iter()
        .filter(|held| held.blocked > 0)
        .collect();
    let mut out = table(
        &["", ""],
        &[
            vec!["pending events".into(), status.pending_events.to_string()],
            vec![
                "oldest pending".into(),
                status
                    .oldest_pending_age
                    .map_or_else(|| "-".to_owned(), human_age),
            ],
            vec![
                "pending deliveries".into(),
                status.pending_deliveries.to_string(),
            ],
            vec!["dead letters".into(), status.dead_letters.to_string()],
            vec!["blocked keys".into(), status.blocked_keys.to_string()],
            vec![
                "blocked aggregates".into(),
                status.blocked_aggregates.to_string(),
            ],
            vec!["held events".into(), status.held_events.to_string()],
            vec![
                "behind dead letters".into(),
                status.behind_dead_letters.to_string(),
            ],
            vec!["live relays".into(), status.live_relays.to_string()],
            // What no running relay's build routes (unknown while none runs).
            vec![
                "unroutable".into(),
                if status.live_relays == 0 {
                    "- (no relay running)".to_owned()
                } else {
                    format!(
                        "{} events, {} deliveries{}",
                        status.unroutable_events,
                        status.unroutable_deliveries,
                        status
                            .oldest_unroutable_age
                            .map_or_else(String::new, |age| format!(", oldest {}", human_age(age)))
                    )
                },
            ],
        ],
    );
    out.push('\n');
    out.push_str(&table(
        &["STATE", "COUNT"],
        &ListState::ALL
            .iter()
            .map(|state| {
                vec![
                    state.as_str().to_owned(),
                    overview.count(*state).to_string(),
                ]
            })
            .collect::<Vec<_>>(),
    ));
    out.push('\n');
    if held_back.is_empty() {
        out.push_str("nothing held back\n");
    } else {
        out.push_str(&table(
            &["HELD BACK BY", "BLOCKS", "WAITING BEHIND"],
            &held_back
                .iter()
                .map(|held| {
                    vec![
                        held.cause.as_str().to_owned(),
                        match (held.blocked, held.cause.blocks()) {
                            (1, blocks) => format!("1 {}", blocks.trim_end_matches('s')),
                            (n, blocks) => format!("{n} {blocks}"),
                        },
                        held.waiting.to_string(),
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    if !subscribers.is_empty() {
        out.push('\n');
        out.push_str(&table(
            &["SUBSCRIBER", "PENDING", "DEAD", "BLOCKED KEYS"],
            &subscribers
                .iter()
                .map(|s| {
                    vec![
                        s.subscriber.clone(),
                        s.pending.to_string(),
                        s.dead.to_string(),
                        s.blocked_keys.to_string(),
                    ]
                })
                .collect::<Vec<_>>(),
        ));
    }
    Ok(out)
}

fn listed(rows: &[Listed], state: ListState, next: Option<&str>, json: bool) -> String {
    if json {
        return format!("{}\n", serde_json::to_string(rows).unwrap_or_default());
    }
    if rows.is_empty() {
        return format!("nothing {}\n", state.as_str());
    }
    let mut out = table(
        &[
            "EVENT",
            "SUBSCRIBER",
            "EVENT TYPE",
            "AGGREGATE",
            "ATTEMPTS",
            "LAST ERROR",
        ],
        &rows
            .iter()
            .map(|r| {
                vec![
                    r.event_id.to_string(),
                    r.subscriber.clone().unwrap_or_else(|| "(all)".to_owned()),
                    r.event_type.clone(),
                    format!(
                        "{} {}",
                        r.aggregate_type,
                        r.aggregate_id
                            .map_or_else(|| "-".to_owned(), |id| id.to_string())
                    ),
                    r.attempts.to_string(),
                    shorten(
                        r.reason
                            .as_deref()
                            .or(r.last_error.as_deref())
                            .unwrap_or("-"),
                        60,
                    ),
                ]
            })
            .collect::<Vec<_>>(),
    );
    if let Some(next) = next {
        out.push_str(&format!("more: --after {next}\n"));
    }
    out
}

fn dead_letter_groups(groups: &[DeadLetterGroup], json: bool) -> String {
    if json {
        return format!("{}\n", serde_json::to_string(groups).unwrap_or_default());
    }
    if groups.is_empty() {
        return "no dead letters\n".to_owned();
    }
    table(
        &["DEAD", "SUBSCRIBER", "KIND", "EVENTS", "ERROR"],
        &groups
            .iter()
            .map(|g| {
                vec![
                    g.dead.to_string(),
                    g.subscriber.clone().unwrap_or_else(|| "(all)".to_owned()),
                    g.kind.to_owned(),
                    format!("{}..{}", g.first_event_id, g.last_event_id),
                    // Whole: it is what `requeue --failure` takes.
                    g.first_line.clone(),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

/// Columns padded to their widest cell; a header row unless every header is empty.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let with_header = headers.iter().any(|h| !h.is_empty());
    let header: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    let mut out = String::new();
    for row in with_header.then_some(&header).into_iter().chain(rows) {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn shorten(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() <= max && line.len() == text.len() {
        return line.to_owned();
    }
    let cut: String = line.chars().take(max.saturating_sub(1)).collect();
    format!("{cut}…")
}

fn human_age(age: Duration) -> String {
    let seconds = age.as_secs();
    match seconds {
        0..60 => format!("{:.1}s", age.as_secs_f64()),
        60..3600 => format!("{}m {}s", seconds / 60, seconds % 60),
        3600..86_400 => format!("{}h {}m", seconds / 3600, seconds % 3600 / 60),
        _ => format!("{}d {}h", seconds / 86_400, seconds % 86_400 / 3600),
    }
}
