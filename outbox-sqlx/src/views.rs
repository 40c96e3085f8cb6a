//! What operators look at: events and deliveries by state, dead letters grouped by failure,
//! and an overview of what holds work back. The SQL is shared by the backends, with the few
//! dialect differences passed in.

use outbox_core::store::Status;
use uuid::Uuid;

#[cfg(doc)]
use crate::Outbox;
use crate::SubscriberStatus;

/// A state an event or a delivery can be in, for [`Outbox::list`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListState {
    /// Events not yet handed to their subscribers, free to be claimed.
    Pending,
    /// Events and deliveries a relay has claimed and is working on now (or a relay that died
    /// held, until its lease ends).
    Claimed,
    /// Events this build could not read (unknown type, newer version), waiting for a build
    /// that can; they hold their aggregate back.
    Parked,
    /// Events set aside behind an earlier event of their aggregate (dead, parked, or in a
    /// claim that lasted).
    Held,
    /// Deliveries that failed and wait for their next attempt.
    Retrying,
    /// Deliveries that wait behind an earlier delivery of their (subscriber, aggregate) key,
    /// or for another build's relay.
    Waiting,
    /// Dead events and dead deliveries: they wait for an operator.
    Dead,
    /// What an operator gave up on (`Outbox::skip`), with the reason.
    Skipped,
}

impl ListState {
    /// Every state, in the order a lifecycle goes through them.
    pub const ALL: [ListState; 8] = [
        Self::Pending,
        Self::Claimed,
        Self::Parked,
        Self::Held,
        Self::Retrying,
        Self::Waiting,
        Self::Dead,
        Self::Skipped,
    ];

    /// Its place in [`ALL`](Self::ALL), which lists the states in declaration order.
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Its name, as the CLI writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Claimed => "claimed",
            Self::Parked => "parked",
            Self::Held => "held",
            Self::Retrying => "retrying",
            Self::Waiting => "waiting",
            Self::Dead => "dead",
            Self::Skipped => "skipped",
        }
    }
}

impl std::str::FromStr for ListState {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|s| s.as_str()).collect();
                format!(
                    "unknown state `{name}`: expected one of {}",
                    names.join(", ")
                )
            })
    }
}

/// Which page of which rows [`Outbox::list`] reads: rows of one state, filtered, in (event id,
/// subscriber) order, after a key (the last row of the previous page), at most `limit`.
///
/// ```
/// use outbox_sqlx::{ListQuery, ListState};
///
/// let first = ListQuery::new(ListState::Dead).subscriber("licensing").limit(100);
/// // ... then, after a page whose last row was event 1042 of `licensing`:
/// let next = first.clone().after(1042, Some("licensing"));
/// # let _ = next;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    pub(crate) state: ListState,
    pub(crate) subscriber: Option<String>,
    pub(crate) event_type: Option<String>,
    pub(crate) aggregate_id: Option<Uuid>,
    pub(crate) after: (i64, String),
    pub(crate) limit: u32,
}

impl ListQuery {
    /// The first 100 rows in `state`.
    pub fn new(state: ListState) -> Self {
        Self {
            state,
            subscriber: None,
            event_type: None,
            aggregate_id: None,
            after: (i64::MIN, String::new()),
            limit: 100,
        }
    }

    /// Only the deliveries of `subscriber` (and skips of it).
    #[must_use]
    pub fn subscriber(mut self, subscriber: impl Into<String>) -> Self {
        self.subscriber = Some(subscriber.into());
        self
    }

    /// Only events of `event_type`.
    #[must_use]
    pub fn event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Only events of the aggregate `aggregate_id`.
    #[must_use]
    pub fn aggregate(mut self, aggregate_id: Uuid) -> Self {
        self.aggregate_id = Some(aggregate_id);
        self
    }

    /// The rows after (event `event_id`, `subscriber`): the last row of the previous page.
    #[must_use]
    pub fn after(mut self, event_id: i64, subscriber: Option<&str>) -> Self {
        self.after = (event_id, subscriber.unwrap_or_default().to_owned());
        self
    }

    /// At most `limit` rows (at least 1).
    #[must_use]
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit.max(1);
        self
    }

    /// The rows after the page key `key`, as [`Listed::page_key`] writes it: `1042`, or
    /// `1042/licensing` after a delivery.
    ///
    /// ```
    /// use outbox_sqlx::{ListQuery, ListState};
    ///
    /// let next = ListQuery::new(ListState::Dead).after_key("1042/licensing").unwrap();
    /// assert_eq!(next, ListQuery::new(ListState::Dead).after(1042, Some("licensing")));
    /// assert!(ListQuery::new(ListState::Dead).after_key("licensing").is_err());
    /// ```
    pub fn after_key(self, key: &str) -> Result<Self, String> {
        let (id, subscriber) = match key.split_once('/') {
            Some((id, subscriber)) => (id, Some(subscriber)),
            None => (key, None),
        };
        let id = id
            .trim()
            .parse()
            .map_err(|_| format!("`{key}`: expected an event id, or `<event id>/<subscriber>`"))?;
        Ok(self.after(id, subscriber))
    }
}

/// One row of [`Outbox::list`]: an event, or one subscriber's delivery of it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Listed {
    /// The event.
    pub event_id: i64,
    /// The subscriber, for a delivery (or the skip of one); `None` for the event itself.
    pub subscriber: Option<String>,
    /// The state it was listed in.
    pub state: ListState,
    /// The event type (empty for a skipped event retention has deleted since).
    pub event_type: String,
    /// The aggregate type (likewise).
    pub aggregate_type: String,
    /// The aggregate (`None` for a skipped event retention has deleted since).
    pub aggregate_id: Option<Uuid>,
    /// Failed attempts (for an event: times parked).
    pub attempts: u32,
    /// The last error.
    pub last_error: Option<String>,
    /// Why an operator skipped it (state `skipped` only).
    pub reason: Option<String>,
    /// The event's stored payload, the envelope as JSON text (`None` for a skipped event
    /// retention has deleted since).
    pub payload: Option<String>,
}

impl Listed {
    /// Where the page after this row starts, for [`ListQuery::after_key`]: `1042`, or
    /// `1042/licensing` for a delivery.
    pub fn page_key(&self) -> String {
        match &self.subscriber {
            Some(subscriber) => format!("{}/{subscriber}", self.event_id),
            None => self.event_id.to_string(),
        }
    }
}

/// One page of [`Outbox::list_page`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Page {
    /// The rows, at most the query's limit.
    pub rows: Vec<Listed>,
    /// The key of the next page ([`ListQuery::after_key`]) when more rows follow.
    pub next: Option<String>,
}

/// A requeue made with a reason ([`Outbox::requeue_because`]), as `<table>_requeues` keeps
/// it; read by [`Outbox::requeues`], newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequeueRecord {
    /// Its id, in the order requeues were made.
    pub id: i64,
    /// The events named (for a failure group of undecodable events: those it found); empty when
    /// a subscriber was named.
    pub event_ids: Vec<i64>,
    /// The subscriber named, if any.
    pub subscriber: Option<String>,
    /// The failure group's first line, if one was named.
    pub first_line: Option<String>,
    /// How many rows went back.
    pub requeued: u64,
    /// Why.
    pub reason: String,
    /// When.
    pub requeued_at: time::OffsetDateTime,
}

/// Dead letters that failed alike: one subscriber, one first line of the last error. One bad
/// deploy is one group, not ten thousand rows.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct DeadLetterGroup {
    /// The subscriber; `None` for events that cannot be decoded at all.
    pub subscriber: Option<String>,
    /// What kind of failure: `permanent` (a handler said so), `retries exhausted` (transient
    /// failures until the retry schedule ran out), `undecodable` (the event itself), `other`.
    pub kind: &'static str,
    /// The first line of the last error.
    pub first_line: String,
    /// How many dead letters.
    pub dead: u64,
    /// The first and last event ids of the group.
    pub first_event_id: i64,
    /// See `first_event_id`.
    pub last_event_id: i64,
}

/// What differs between the backends' SQL for these views.
pub(crate) struct Dialect<'a> {
    pub(crate) outbox: &'a str,
    /// The outbox as `o`, in statements that read its unpublished events
    /// (`o.published_at IS NULL`): where the dialect needs to, with the index to read them by.
    pub(crate) unpublished: String,
    pub(crate) deliveries: &'a str,
    pub(crate) skips: &'a str,
    /// True for an event `o` that a claim holds.
    pub(crate) claimed_event: String,
    /// The payload of event `o`, as text.
    pub(crate) payload: &'a str,
    /// Parameter `n` of type `type`, with a cast where the dialect needs one.
    pub(crate) param: fn(u8, &str) -> String,
    /// Where the parameters come from, joined to the rows (MySQL's placeholders are
    /// positional, each used once: the parameters there are the columns of a one-row table);
    /// empty where `param` names them.
    pub(crate) params: &'a str,
}

/// The rows in `state`, before filters, as (event_id, subscriber, event_type, aggregate_type,
/// aggregate_id, attempts, last_error, reason, payload).
fn state_rows(d: &Dialect<'_>, state: ListState) -> String {
    use ListState as S;
    let Dialect {
        outbox,
        unpublished,
        deliveries,
        skips,
        claimed_event,
        payload,
        ..
    } = d;
    let event = |condition: &str| {
        format!(
            "SELECT o.id AS event_id, NULL AS subscriber, o.event_type, o.aggregate_type,
                    o.aggregate_id, o.retry_count AS attempts, o.last_error, NULL AS reason,
                    {payload} AS payload
             FROM {unpublished} WHERE o.published_at IS NULL AND {condition}"
        )
    };
    let delivery = |condition: &str| {
        format!(
            "SELECT d.event_id, d.subscriber, o.event_type, o.aggregate_type, o.aggregate_id,
                    d.attempts, d.last_error, NULL AS reason, {payload} AS payload
             FROM {deliveries} AS d JOIN {outbox} AS o ON o.id = d.event_id WHERE {condition}"
        )
    };
    match state {
        S::Pending => event(&format!(
            "o.dead_at IS NULL AND o.next_retry_at IS NULL AND o.held_by IS NULL
             AND o.held_behind IS NULL AND NOT ({claimed_event})"
        )),
        S::Claimed => format!(
            "{} UNION ALL {}",
            event(&format!(
                "o.dead_at IS NULL AND o.next_retry_at IS NULL AND ({claimed_event})"
            )),
            delivery("d.dead_at IS NULL AND d.claim_id IS NOT NULL")
        ),
        S::Parked => event("o.dead_at IS NULL AND o.next_retry_at IS NOT NULL"),
        // (A parked event set aside behind an earlier one is listed as parked.)
        S::Held => event(
            "o.dead_at IS NULL AND o.next_retry_at IS NULL
             AND (o.held_by IS NOT NULL OR o.held_behind IS NOT NULL)",
        ),
        S::Retrying => delivery("d.dead_at IS NULL AND d.claim_id IS NULL AND d.attempts > 0"),
        S::Waiting => delivery("d.dead_at IS NULL AND d.claim_id IS NULL AND d.attempts = 0"),
        S::Dead => format!(
            "{} UNION ALL {}",
            event("o.dead_at IS NOT NULL"),
            delivery("d.dead_at IS NOT NULL")
        ),
        S::Skipped => format!(
            "SELECT k.event_id, k.subscriber, coalesce(o.event_type, '') AS event_type,
                    coalesce(o.aggregate_type, '') AS aggregate_type, o.aggregate_id,
                    k.attempts, k.last_error, k.reason, {payload} AS payload
             FROM {skips} AS k LEFT JOIN {outbox} AS o ON o.id = k.event_id"
        ),
    }
}

/// The SQL of one page of the rows in `state`, filtered and after a (event id, subscriber)
/// key, in that order: the state's rows as `x`, then the filters. Parameters: $1 subscriber,
/// $2 event type, $3 aggregate id (each NULL for any), $4 and $5 the key to start after, $6 the
/// page size.
pub(crate) fn list_query(d: &Dialect<'_>, state: ListState) -> String {
    let rows = state_rows(d, state);
    let (param, params) = (d.param, d.params);
    let (subscriber, event_type, aggregate) =
        (param(1, "text"), param(2, "text"), param(3, "uuid"));
    let (after_id, after_subscriber, limit) =
        (param(4, "int8"), param(5, "text"), param(6, "int8"));
    format!(
        "SELECT * FROM ({rows}) AS x{params}
         WHERE ({subscriber} IS NULL OR x.subscriber = {subscriber})
           AND ({event_type} IS NULL OR x.event_type = {event_type})
           AND ({aggregate} IS NULL OR x.aggregate_id = {aggregate})
           AND (x.event_id, coalesce(x.subscriber, '')) > ({after_id}, {after_subscriber})
         ORDER BY x.event_id, coalesce(x.subscriber, '')
         LIMIT {limit}"
    )
}

/// The SQL of the [`Overview`]: one row, the count of each state in the order of
/// [`ListState::ALL`](ListState::ALL), then (blocked, waiting) for each
/// [`HoldCause`] in the order of [`HoldCause::ALL`].
pub(crate) fn overview_query(d: &Dialect<'_>) -> String {
    let Dialect {
        outbox,
        unpublished,
        deliveries,
        ..
    } = d;
    let counts = ListState::ALL
        .map(|state| format!("(SELECT count(*) FROM ({}) AS x)", state_rows(d, state)))
        .join(",\n       ");
    // The events that hold an aggregate back, by cause; what the claims set aside behind them
    // names them in `held_behind`.
    let events_behind = |holder: &str| {
        format!(
            "(SELECT count(*) FROM (SELECT DISTINCT o.aggregate_type, o.aggregate_id
                                    FROM {unpublished}
                                    WHERE o.published_at IS NULL AND {holder}) AS k),
             (SELECT count(*) FROM {outbox} AS h JOIN {outbox} AS o ON o.id = h.held_behind
              WHERE h.held_behind IS NOT NULL AND {holder})"
        )
    };
    // The (subscriber, aggregate) keys whose first delivery is in a state, and the rows of
    // those keys behind it.
    let keys_behind = |head: &str| {
        format!(
            "(SELECT count(*) FROM {deliveries} AS d WHERE {head} AND NOT EXISTS (
                 SELECT 1 FROM {deliveries} AS e
                 WHERE e.subscriber = d.subscriber AND e.aggregate_id = d.aggregate_id
                   AND e.aggregate_type = d.aggregate_type AND e.event_id < d.event_id)),
             (SELECT count(*) FROM {deliveries} AS d JOIN {deliveries} AS w
                ON w.subscriber = d.subscriber AND w.aggregate_id = d.aggregate_id
               AND w.aggregate_type = d.aggregate_type AND w.event_id > d.event_id
              WHERE {head} AND NOT EXISTS (
                 SELECT 1 FROM {deliveries} AS e
                 WHERE e.subscriber = d.subscriber AND e.aggregate_id = d.aggregate_id
                   AND e.aggregate_type = d.aggregate_type AND e.event_id < d.event_id))"
        )
    };
    let causes = HoldCause::ALL
        .map(|cause| match cause {
            HoldCause::DeadEvent => events_behind("o.dead_at IS NOT NULL"),
            HoldCause::ParkedEvent => {
                events_behind("o.dead_at IS NULL AND o.next_retry_at IS NOT NULL")
            }
            HoldCause::LastingClaim => format!(
                "(SELECT count(*) FROM (SELECT DISTINCT o.aggregate_type, o.aggregate_id
                                        FROM {outbox} AS o WHERE o.held_by IS NOT NULL) AS k),
                 (SELECT count(*) FROM {outbox} AS o WHERE o.held_by IS NOT NULL)"
            ),
            HoldCause::DeadDelivery => keys_behind("d.dead_at IS NOT NULL"),
            HoldCause::FailingDelivery => keys_behind("d.dead_at IS NULL AND d.attempts > 0"),
        })
        .join(",\n       ");
    format!("SELECT {counts},\n       {causes}")
}

/// Reads the one row of [`overview_query`].
pub(crate) fn overview<R: sqlx::Row>(row: &R) -> Result<Overview, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let count = |i: usize| -> Result<u64, sqlx::Error> {
        Ok(u64::try_from(row.try_get::<i64, _>(i)?).unwrap_or(0))
    };
    let mut counts = [0; ListState::ALL.len()];
    for (i, slot) in counts.iter_mut().enumerate() {
        *slot = count(i)?;
    }
    let base = counts.len();
    let mut held_back = Vec::new();
    for (i, cause) in HoldCause::ALL.into_iter().enumerate() {
        held_back.push(HeldBack {
            cause,
            blocked: count(base + 2 * i)?,
            waiting: count(base + 2 * i + 1)?,
        });
    }
    Ok(Overview { counts, held_back })
}

/// How many events and deliveries are in each state, and what holds work back, by cause.
///
/// Read by [`Outbox::overview`]; `outbox status` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Overview {
    counts: [u64; ListState::ALL.len()],
    /// What holds work back, one entry per [`HoldCause`] in the order of [`HoldCause::ALL`]
    /// (zeros included).
    pub held_back: Vec<HeldBack>,
}

impl Overview {
    /// The events and deliveries in `state` (for `dead`, `claimed` and `skipped`: events and
    /// deliveries together, as [`Outbox::list`] lists them).
    pub fn count(&self, state: ListState) -> u64 {
        self.counts[state.index()]
    }

    /// What `cause` holds back.
    pub fn held_back_by(&self, cause: HoldCause) -> HeldBack {
        self.held_back
            .iter()
            .copied()
            .find(|h| h.cause == cause)
            .unwrap_or(HeldBack {
                cause,
                blocked: 0,
                waiting: 0,
            })
    }
}

/// Why work is held back: the first undelivered thing of an aggregate, or of a (subscriber,
/// aggregate) key, is stuck, and everything after it waits, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldCause {
    /// A dead event (it cannot be decoded): its aggregate waits for every subscriber until an
    /// operator requeues or skips it.
    DeadEvent,
    /// A parked event (an unknown type, a newer version): its aggregate waits for a build
    /// that can read it.
    ParkedEvent,
    /// A claim that lasted past its lease (a relay that stalled or died): the events the next
    /// claims met behind it wait until it is over.
    LastingClaim,
    /// A dead delivery: its (subscriber, aggregate) key waits for an operator.
    DeadDelivery,
    /// A delivery that failed and waits for its retry: its key waits for it.
    FailingDelivery,
}

impl HoldCause {
    /// Every cause, in the order an [`Overview`] lists them.
    pub const ALL: [HoldCause; 5] = [
        Self::DeadEvent,
        Self::ParkedEvent,
        Self::LastingClaim,
        Self::DeadDelivery,
        Self::FailingDelivery,
    ];

    /// Its name, as `outbox status --json` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DeadEvent => "dead event",
            Self::ParkedEvent => "parked event",
            Self::LastingClaim => "lasting claim",
            Self::DeadDelivery => "dead delivery",
            Self::FailingDelivery => "failing delivery",
        }
    }

    /// What it blocks: whole aggregates (an event's cause), or one subscriber's key.
    pub fn blocks(self) -> &'static str {
        match self {
            Self::DeadEvent | Self::ParkedEvent | Self::LastingClaim => "aggregates",
            Self::DeadDelivery | Self::FailingDelivery => "keys",
        }
    }
}

/// What one [`HoldCause`] holds back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldBack {
    /// The cause.
    pub cause: HoldCause,
    /// Aggregates (for an event's cause) or (subscriber, aggregate) keys (for a delivery's)
    /// held back.
    pub blocked: u64,
    /// Events (set aside by the claims behind the cause) or deliveries waiting behind it.
    pub waiting: u64,
}

/// The [`Backend`](crate::Backend) methods that read the operator views, the same on every
/// backend (each has the queries `list`, `overview`, `dead_letter_groups`, `subscribers` and
/// `dead_events_failing`): written once, expanded in each backend's impl with its pool, queries
/// and connection types, and `begin`, which gives, from the queries, the statement that begins
/// the transaction the reads run in (on PostgreSQL, one that reads by index). They run now and
/// then, so each is planned at each run: PostgreSQL would keep a plan made when a table was
/// empty (`BY_INDEX` in `postgres.rs`).
macro_rules! operator_views {
    ($pool:ty, $queries:ty, $connection:ty, begin = $begin:expr) => {
        async fn list(
            pool: &$pool,
            queries: &$queries,
            query: &crate::ListQuery,
        ) -> Result<Vec<crate::Listed>, sqlx::Error> {
            let mut tx = pool.begin_with(($begin)(queries)).await?;
            let rows = sqlx::query(queries.list[query.state.index()].clone())
                .persistent(false)
                .bind(&query.subscriber)
                .bind(&query.event_type)
                .bind(query.aggregate_id)
                .bind(query.after.0)
                .bind(&query.after.1)
                .bind(i64::from(query.limit))
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            rows.iter()
                .map(|row| crate::views::listed(row, query.state))
                .collect()
        }

        async fn overview(
            pool: &$pool,
            queries: &$queries,
        ) -> Result<crate::Overview, sqlx::Error> {
            let mut tx = pool.begin_with(($begin)(queries)).await?;
            let row = sqlx::query(queries.overview.clone())
                .persistent(false)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            crate::views::overview(&row)
        }

        async fn dead_letter_groups(
            pool: &$pool,
            queries: &$queries,
        ) -> Result<Vec<crate::DeadLetterGroup>, sqlx::Error> {
            let mut tx = pool.begin_with(($begin)(queries)).await?;
            let rows = sqlx::query(queries.dead_letter_groups.clone())
                .persistent(false)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            rows.iter().map(crate::views::dead_letter_group).collect()
        }

        async fn subscribers(
            pool: &$pool,
            queries: &$queries,
        ) -> Result<Vec<crate::SubscriberStatus>, sqlx::Error> {
            let mut tx = pool.begin_with(($begin)(queries)).await?;
            let rows = sqlx::query(queries.subscribers.clone())
                .persistent(false)
                .fetch_all(&mut *tx)
                .await?;
            tx.commit().await?;
            rows.iter().map(crate::backend::subscriber_status).collect()
        }

        async fn dead_events_failing(
            conn: &mut $connection,
            queries: &$queries,
            first_line: &str,
        ) -> Result<Vec<i64>, sqlx::Error> {
            sqlx::query_scalar(queries.dead_events_failing.clone())
                .persistent(false)
                .bind(first_line)
                .fetch_all(conn)
                .await
        }
    };
}
pub(crate) use operator_views;

/// One row of a backend's `requeues` query, given the two columns each backend stores its own
/// way: the event ids and the time.
pub(crate) fn requeue_record<R: sqlx::Row>(
    row: &R,
    event_ids: Vec<i64>,
    requeued_at: time::OffsetDateTime,
) -> Result<RequeueRecord, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(RequeueRecord {
        id: row.try_get("id")?,
        event_ids,
        subscriber: row.try_get("subscriber")?,
        first_line: row.try_get("first_line")?,
        requeued: u64::try_from(row.try_get::<i64, _>("requeued")?).unwrap_or(0),
        reason: row.try_get("reason")?,
        requeued_at,
    })
}

/// One row of [`list_query`].
pub(crate) fn listed<R: sqlx::Row>(row: &R, state: ListState) -> Result<Listed, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Uuid>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let attempts = row
        .try_get::<i64, _>("attempts")
        .or_else(|_| row.try_get::<i32, _>("attempts").map(i64::from))?;
    Ok(Listed {
        event_id: row.try_get("event_id")?,
        subscriber: row.try_get("subscriber")?,
        state,
        event_type: row.try_get("event_type")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        last_error: row.try_get("last_error")?,
        reason: row.try_get("reason")?,
        payload: row.try_get("payload")?,
    })
}

/// Dead letters grouped by subscriber and the first line of their last error, largest groups
/// first; `first_line` is the dialect's expression for the first line of a text column.
pub(crate) fn dead_letter_groups_query(
    d: &Dialect<'_>,
    first_line: impl Fn(&str) -> String,
) -> String {
    let Dialect {
        unpublished,
        deliveries,
        ..
    } = d;
    let line = first_line("x.last_error");
    format!(
        r#"
SELECT x.subscriber, {line} AS first_line, count(*) AS dead,
       min(x.event_id) AS first_event_id, max(x.event_id) AS last_event_id
FROM (
    SELECT NULL AS subscriber, o.last_error, o.id AS event_id FROM {unpublished}
    WHERE o.published_at IS NULL AND o.dead_at IS NOT NULL
    UNION ALL
    SELECT d.subscriber, d.last_error, d.event_id FROM {deliveries} AS d
    WHERE d.dead_at IS NOT NULL
) AS x
GROUP BY x.subscriber, {line}
ORDER BY dead DESC, first_event_id"#
    )
}

/// One group of [`dead_letter_groups_query`]'s rows.
pub(crate) fn dead_letter_group<R: sqlx::Row>(row: &R) -> Result<DeadLetterGroup, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let subscriber: Option<String> = row.try_get("subscriber")?;
    let first_line: String = row.try_get("first_line")?;
    let kind = match (&subscriber, first_line.as_str()) {
        (None, _) => "undecodable",
        (Some(_), line) if line.starts_with("permanent error") => "permanent",
        (Some(_), line) if line.starts_with("transient error") => "retries exhausted",
        _ => "other",
    };
    Ok(DeadLetterGroup {
        subscriber,
        kind,
        first_line,
        dead: u64::try_from(row.try_get::<i64, _>("dead")?).unwrap_or(0),
        first_event_id: row.try_get("first_event_id")?,
        last_event_id: row.try_get("last_event_id")?,
    })
}

/// Everything `outbox status` shows, read at once: the [`Status`], the [`Overview`] and each
/// subscriber's counts. With the `serde` feature it serializes as `outbox status --json`
/// prints it (and the console reads it).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Report {
    /// What is left to deliver, dead letters, relays at work, what none of them routes.
    pub status: Status,
    /// Each state's count and what holds work back.
    pub overview: Overview,
    /// What each subscriber has left.
    pub subscribers: Vec<SubscriberStatus>,
}

impl Report {
    pub(crate) fn new(
        status: Status,
        overview: Overview,
        subscribers: Vec<SubscriberStatus>,
    ) -> Self {
        Self {
            status,
            overview,
            subscribers,
        }
    }
}

#[cfg(feature = "serde")]
mod serialize {
    use serde::ser::{Serialize, SerializeMap, SerializeStruct, Serializer};

    use super::{HeldBack, HoldCause, ListState, Overview, Report, RequeueRecord};
    use crate::SubscriberStatus;

    impl Serialize for ListState {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_str(self.as_str())
        }
    }

    impl Serialize for HoldCause {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_str(self.as_str())
        }
    }

    impl Serialize for HeldBack {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut held = serializer.serialize_struct("HeldBack", 4)?;
            held.serialize_field("cause", &self.cause)?;
            held.serialize_field("blocks", self.cause.blocks())?;
            held.serialize_field("blocked", &self.blocked)?;
            held.serialize_field("waiting", &self.waiting)?;
            held.end()
        }
    }

    /// `{"pending": n, ...}` in the order of `ListState::ALL`.
    struct States<'a>(&'a Overview);

    impl Serialize for States<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut states = serializer.serialize_map(Some(ListState::ALL.len()))?;
            for state in ListState::ALL {
                states.serialize_entry(state.as_str(), &self.0.count(state))?;
            }
            states.end()
        }
    }

    impl Serialize for Overview {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut overview = serializer.serialize_struct("Overview", 2)?;
            overview.serialize_field("states", &States(self))?;
            overview.serialize_field("held_back", &HeldBackNow(self))?;
            overview.end()
        }
    }

    /// The causes that hold something back now.
    struct HeldBackNow<'a>(&'a Overview);

    impl Serialize for HeldBackNow<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.collect_seq(self.0.held_back.iter().filter(|held| held.blocked > 0))
        }
    }

    impl Serialize for RequeueRecord {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let at = self
                .requeued_at
                .format(&time::format_description::well_known::Rfc3339)
                .map_err(serde::ser::Error::custom)?;
            let mut record = serializer.serialize_struct("RequeueRecord", 7)?;
            record.serialize_field("id", &self.id)?;
            record.serialize_field("event_ids", &self.event_ids)?;
            record.serialize_field("subscriber", &self.subscriber)?;
            record.serialize_field("first_line", &self.first_line)?;
            record.serialize_field("requeued", &self.requeued)?;
            record.serialize_field("reason", &self.reason)?;
            record.serialize_field("requeued_at", &at)?;
            record.end()
        }
    }

    impl Serialize for SubscriberStatus {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut subscriber = serializer.serialize_struct("SubscriberStatus", 4)?;
            subscriber.serialize_field("subscriber", &self.subscriber)?;
            subscriber.serialize_field("pending", &self.pending)?;
            subscriber.serialize_field("dead", &self.dead)?;
            subscriber.serialize_field("blocked_keys", &self.blocked_keys)?;
            subscriber.end()
        }
    }

    impl Serialize for Report {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let status = &self.status;
            let seconds = |age: Option<std::time::Duration>| age.map(|age| age.as_secs_f64());
            let mut report = serializer.serialize_struct("Report", 16)?;
            report.serialize_field("pending_events", &status.pending_events)?;
            report.serialize_field(
                "oldest_pending_age_seconds",
                &seconds(status.oldest_pending_age),
            )?;
            report.serialize_field("pending_deliveries", &status.pending_deliveries)?;
            report.serialize_field("dead_letters", &status.dead_letters)?;
            report.serialize_field("blocked_keys", &status.blocked_keys)?;
            report.serialize_field("blocked_aggregates", &status.blocked_aggregates)?;
            report.serialize_field("held_events", &status.held_events)?;
            report.serialize_field("behind_dead_letters", &status.behind_dead_letters)?;
            report.serialize_field("settled", &status.is_settled())?;
            report.serialize_field("live_relays", &status.live_relays)?;
            report.serialize_field("unroutable_events", &status.unroutable_events)?;
            report.serialize_field("unroutable_deliveries", &status.unroutable_deliveries)?;
            report.serialize_field(
                "oldest_unroutable_age_seconds",
                &seconds(status.oldest_unroutable_age),
            )?;
            report.serialize_field("subscribers", &self.subscribers)?;
            report.serialize_field("states", &States(&self.overview))?;
            report.serialize_field("held_back", &HeldBackNow(&self.overview))?;
            report.end()
        }
    }
}
