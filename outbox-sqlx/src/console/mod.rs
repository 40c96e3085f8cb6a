//! A web console for operators: `outbox serve`, or [`Console::serve`] from an application.
//!
//! One page, no external assets (it works offline): the status and its history (pending work,
//! events published per second, the oldest pending event's age), every state's count, what
//! holds work back and why, dead letters and parked events with their payloads and errors, dead
//! letters grouped by failure, and any state's rows a page at a time. It reads through the same
//! [`Outbox`] methods as the command-line tool.
//!
//! Read-only unless [`writable`](Console::writable): then it requeues and skips, each with a
//! reason, recorded as `outbox requeue --reason` and `outbox skip` record them (in the
//! `<table>_requeues` and `<table>_skips` tables). It listens on a loopback address unless told
//! otherwise ([`check_bind`]).
//!
//! ```no_run
//! # #[allow(dead_code)]
//! # async fn run(outbox: outbox_sqlx::Outbox<sqlx::Postgres, ()>) -> std::io::Result<()> {
//! use outbox_sqlx::console::{Console, check_bind};
//!
//! let addr = "127.0.0.1:7890".parse().unwrap();
//! check_bind(addr, false).expect("a loopback address");
//! let listener = tokio::net::TcpListener::bind(addr).await?;
//! Console::new(&outbox)
//!     .writable(true)
//!     .serve(listener, std::future::pending())
//!     .await
//! # }
//! ```
//!
//! Writes are accepted only as JSON (`Content-Type: application/json`): a page of another site
//! cannot send one without the browser asking first, which the console never allows.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use uuid::Uuid;

use crate::{Backend, DeadLetterGroup, ListQuery, ListState, Outbox, Requeue};

/// The page: HTML, CSS and script in one file, nothing fetched from elsewhere.
const PAGE: &str = include_str!("page.html");

/// How many samples of the status the console keeps: an hour at the default interval.
const HISTORY: usize = 720;

/// A web console over one outbox's tables. See the [module](self) documentation.
pub struct Console<DB: Backend> {
    outbox: Outbox<DB, ()>,
    writable: bool,
    local_only: bool,
    sample_every: Duration,
}

impl<DB: Backend> Console<DB> {
    /// A read-only console over `outbox`'s tables, sampling the status every 5 s.
    pub fn new<R>(outbox: &Outbox<DB, R>) -> Self {
        Self {
            outbox: Outbox::with_names(outbox.pool().clone(), outbox.names().clone()),
            writable: false,
            local_only: true,
            sample_every: Duration::from_secs(5),
        }
    }

    /// Whether operators may requeue and skip from the console (default: no, read-only).
    #[must_use]
    pub fn writable(mut self, writable: bool) -> Self {
        self.writable = writable;
        self
    }

    /// Whether the console answers only requests addressed to a loopback name (`localhost`,
    /// `127.0.0.1`, `[::1]`; default: yes). A page of another site cannot then reach a local
    /// console by making its own name point at 127.0.0.1 (DNS rebinding). Turn it off to serve
    /// the console under another name ([`check_bind`]'s `allow_remote`).
    #[must_use]
    pub fn local_only(mut self, local_only: bool) -> Self {
        self.local_only = local_only;
        self
    }

    /// How often the console samples the status for its charts (default 5 s; at least 100 ms).
    #[must_use]
    pub fn sample_every(mut self, every: Duration) -> Self {
        self.sample_every = every.max(Duration::from_millis(100));
        self
    }

    /// Serves the console on `listener` until `shutdown` completes.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let state = Arc::new(Shared {
            outbox: self.outbox,
            writable: self.writable,
            history: Mutex::new(VecDeque::new()),
        });
        let app = axum::Router::new()
            .route("/", get(page))
            .route("/api/overview", get(overview::<DB>))
            .route("/api/history", get(history::<DB>))
            .route("/api/list", get(list::<DB>))
            .route("/api/groups", get(groups::<DB>))
            .route("/api/requeues", get(requeues::<DB>))
            .route("/api/requeue", post(requeue::<DB>))
            .route("/api/skip", post(skip::<DB>))
            .with_state(Arc::clone(&state));
        let app = if self.local_only {
            app.layer(axum::middleware::from_fn(local_hosts_only))
        } else {
            app
        };
        let sampler = sample(state, self.sample_every);
        tokio::select! {
            served = axum::serve(listener, app).with_graceful_shutdown(shutdown) => served,
            never = sampler => match never {},
        }
    }
}

/// Refuses to listen on `addr` unless it is a loopback address (127.0.0.0/8, `::1`) or
/// `allow_remote` says so: the console shows payloads, and a writable one changes the outbox.
pub fn check_bind(addr: SocketAddr, allow_remote: bool) -> Result<(), String> {
    if addr.ip().is_loopback() || allow_remote {
        Ok(())
    } else {
        Err(format!(
            "refusing to serve the console on {addr}, which is not a loopback address: it \
             shows event payloads to whoever reaches it (pass --allow-remote to mean it)"
        ))
    }
}

/// Whether `host` (a `Host` header: a name or an address, and maybe a port) names this machine
/// by a loopback name.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((address, port)) if port.is_empty() || port.starts_with(':') => address,
            _ => return false,
        }
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuses requests addressed to another name than a loopback one.
async fn local_hosts_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|host| host.to_str().ok())
        .unwrap_or("");
    if is_loopback_host(host) {
        next.run(request).await
    } else {
        Failure(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "the console answers only to localhost, 127.0.0.1 or [::1], not `{host}` \
                 (start it with --allow-remote to serve it under other names)"
            ),
        )
        .into_response()
    }
}

struct Shared<DB: Backend> {
    outbox: Outbox<DB, ()>,
    writable: bool,
    history: Mutex<VecDeque<Sample>>,
}

/// The status at one moment, for the charts.
#[derive(Clone, Serialize)]
struct Sample {
    /// Seconds since the Unix epoch.
    at: f64,
    /// Pending events and deliveries, dead letters excluded.
    pending: u64,
    /// Events published per second since the previous sample.
    published_per_second: f64,
    /// The oldest pending event's age, in seconds (0 when none is pending).
    oldest_age: f64,
    dead_letters: u64,
}

/// Samples the status every `every`, for ever; a failed read is skipped (and logged).
async fn sample<DB: Backend>(state: Arc<Shared<DB>>, every: Duration) -> std::convert::Infallible {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = tokio::time::Instant::now();
    loop {
        ticks.tick().await;
        let window = last.elapsed();
        last = tokio::time::Instant::now();
        let read = async {
            let status = state.outbox.status().await?;
            let published = state.outbox.published_within(window).await?;
            Ok::<_, crate::Error>((status, published))
        };
        match read.await {
            Ok((status, published)) => {
                let sample = Sample {
                    at: SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs_f64(),
                    pending: status.pending_events + status.pending_deliveries,
                    #[allow(clippy::cast_precision_loss)] // A rate for a chart.
                    published_per_second: published as f64 / window.as_secs_f64().max(1e-3),
                    oldest_age: status
                        .oldest_pending_age
                        .map_or(0.0, |age| age.as_secs_f64()),
                    dead_letters: status.dead_letters,
                };
                let mut history = state.history.lock().unwrap_or_else(PoisonError::into_inner);
                if history.len() == HISTORY {
                    history.pop_front();
                }
                history.push_back(sample);
            }
            Err(error) => tracing::warn!(%error, "outbox console could not sample the status"),
        }
    }
}

/// An error for the page: a status and a message.
struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<crate::Error> for Failure {
    fn from(error: crate::Error) -> Self {
        Self(StatusCode::SERVICE_UNAVAILABLE, error.to_string())
    }
}

async fn page() -> impl IntoResponse {
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:",
            ),
        ],
        Html(PAGE),
    )
}

async fn overview<DB: Backend>(
    State(state): State<Arc<Shared<DB>>>,
) -> Result<Json<Value>, Failure> {
    let mut report = serde_json::to_value(state.outbox.report().await?)
        .map_err(|error| Failure(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    report["writable"] = Value::from(state.writable);
    Ok(Json(report))
}

async fn history<DB: Backend>(State(state): State<Arc<Shared<DB>>>) -> Json<Vec<Sample>> {
    let history = state.history.lock().unwrap_or_else(PoisonError::into_inner);
    Json(history.iter().cloned().collect())
}

#[derive(Deserialize)]
struct ListParams {
    state: String,
    subscriber: Option<String>,
    event_type: Option<String>,
    aggregate: Option<String>,
    /// `<event id>` or `<event id>/<subscriber>`: the last row of the previous page.
    after: Option<String>,
    limit: Option<u32>,
}

async fn list<DB: Backend>(
    State(state): State<Arc<Shared<DB>>>,
    Query(params): Query<ListParams>,
) -> Result<Json<Value>, Failure> {
    let bad = |message: String| Failure(StatusCode::BAD_REQUEST, message);
    let list_state: ListState = params.state.parse().map_err(bad)?;
    let limit = params.limit.unwrap_or(50).clamp(1, 1000);
    let mut query = ListQuery::new(list_state).limit(limit);
    if let Some(subscriber) = params.subscriber.filter(|s| !s.is_empty()) {
        query = query.subscriber(subscriber);
    }
    if let Some(event_type) = params.event_type.filter(|s| !s.is_empty()) {
        query = query.event_type(event_type);
    }
    if let Some(aggregate) = params.aggregate.filter(|s| !s.is_empty()) {
        let id = Uuid::parse_str(aggregate.trim())
            .map_err(|error| bad(format!("aggregate `{aggregate}` is not a UUID: {error}")))?;
        query = query.aggregate(id);
    }
    if let Some(after) = params.after.filter(|s| !s.is_empty()) {
        query = query
            .after_key(&after)
            .map_err(|error| bad(format!("after {error}")))?;
    }
    let page = state.outbox.list_page(&query).await?;
    Ok(Json(json!({
        "state": list_state.as_str(),
        "rows": page.rows,
        "next": page.next,
    })))
}

async fn groups<DB: Backend>(
    State(state): State<Arc<Shared<DB>>>,
) -> Result<Json<Vec<DeadLetterGroup>>, Failure> {
    Ok(Json(state.outbox.dead_letter_groups().await?))
}

#[derive(Deserialize)]
struct RequeuesParams {
    before: Option<i64>,
    limit: Option<u32>,
}

async fn requeues<DB: Backend>(
    State(state): State<Arc<Shared<DB>>>,
    Query(params): Query<RequeuesParams>,
) -> Result<Json<Vec<crate::RequeueRecord>>, Failure> {
    let limit = params.limit.unwrap_or(50).clamp(1, 1000);
    Ok(Json(state.outbox.requeues(params.before, limit).await?))
}

/// Refuses a write unless the console is writable; returns the reason, which must be given.
fn may_write<DB: Backend>(state: &Shared<DB>, reason: &str) -> Result<String, Failure> {
    if !state.writable {
        return Err(Failure(
            StatusCode::FORBIDDEN,
            "the console is read-only: start it with --allow-writes to requeue or skip".to_owned(),
        ));
    }
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(Failure(
            StatusCode::BAD_REQUEST,
            "give a reason: it is kept with what you change".to_owned(),
        ));
    }
    Ok(reason.to_owned())
}

#[derive(Deserialize)]
struct RequeueBody {
    /// Dead or parked events, with every dead delivery of them.
    #[serde(default)]
    event_ids: Vec<i64>,
    /// Or every dead delivery of this subscriber.
    subscriber: Option<String>,
    /// Or one failure group: the dead letters (of `subscriber`, or undecodable events) whose
    /// error's first line is this.
    first_line: Option<String>,
    reason: String,
}

async fn requeue<DB: Backend>(
    State(state): State<Arc<Shared<DB>>>,
    Json(body): Json<RequeueBody>,
) -> Result<Json<Value>, Failure> {
    let reason = may_write(&state, &body.reason)?;
    let which = match (body.subscriber, body.first_line, body.event_ids.is_empty()) {
        (subscriber, Some(first_line), true) => Requeue::Failure {
            subscriber,
            first_line,
        },
        (Some(subscriber), None, true) => Requeue::Subscriber(subscriber),
        (None, None, false) => Requeue::Events(body.event_ids),
        _ => {
            return Err(Failure(
                StatusCode::BAD_REQUEST,
                "name event ids, a subscriber, or a failure group (first_line, and its \
                 subscriber if it has one)"
                    .to_owned(),
            ));
        }
    };
    let requeued = state.outbox.requeue_because(&which, &reason).await?;
    if requeued == 0 {
        return Err(Failure(
            StatusCode::CONFLICT,
            "nothing to requeue: nothing named is dead or parked (any more)".to_owned(),
        ));
    }
    Ok(Json(json!({ "requeued": requeued })))
}

#[derive(Deserialize)]
struct SkipBody {
    event_id: i64,
    subscriber: Option<String>,
    reason: String,
}

async fn skip<DB: Backend>(
    State(state): State<Arc<Shared<DB>>>,
    Json(body): Json<SkipBody>,
) -> Result<Json<Value>, Failure> {
    let reason = may_write(&state, &body.reason)?;
    let skipped = state
        .outbox
        .skip(body.event_id, body.subscriber.as_deref(), &reason)
        .await?;
    if !skipped {
        return Err(Failure(
            StatusCode::CONFLICT,
            format!(
                "cannot skip event {}: it is not {}, or a relay is working on it now",
                body.event_id,
                if body.subscriber.is_some() {
                    "an undelivered delivery of that subscriber"
                } else {
                    "a dead or parked event"
                }
            ),
        ));
    }
    Ok(Json(json!({ "skipped": true })))
}

#[cfg(test)]
mod tests {
    use super::{check_bind, is_loopback_host};

    #[test]
    fn loopback_names_only() {
        for local in [
            "localhost",
            "localhost:7890",
            "LOCALHOST:1",
            "127.0.0.1:7890",
            "127.9.9.9",
            "[::1]:7890",
            "[::1]",
        ] {
            assert!(is_loopback_host(local), "{local}");
        }
        for other in [
            "evil.example",
            "evil.example:7890",
            "localhost.evil.example:80",
            "10.0.0.1:7890",
            "[::]:7890",
            "",
            "[::1",
        ] {
            assert!(!is_loopback_host(other), "{other}");
        }
    }

    #[test]
    fn only_loopback_addresses_unless_asked() {
        for local in ["127.0.0.1:7890", "127.1.2.3:0", "[::1]:7890"] {
            assert_eq!(check_bind(local.parse().unwrap(), false), Ok(()), "{local}");
        }
        for remote in ["0.0.0.0:7890", "192.168.1.5:80", "[::]:7890"] {
            let refused = check_bind(remote.parse().unwrap(), false).unwrap_err();
            assert!(refused.contains("not a loopback address"), "{refused}");
            assert!(refused.contains("--allow-remote"), "{refused}");
            assert_eq!(
                check_bind(remote.parse().unwrap(), true),
                Ok(()),
                "{remote}"
            );
        }
    }
}
