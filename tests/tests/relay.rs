//! The relay, on PostgreSQL and on SQLite: at-least-once delivery per subscriber, retries, dead
//! letters, parking, ordering per (subscriber, aggregate), claims that expire, shutdown and
//! wake-ups. What only PostgreSQL can show (killed connections, sessions) is in `pg_relay.rs`.

use outbox_core::store::ClaimLimit;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::Requeue;
use outbox_core::{Relay, RelayConfig, RetryPolicy, Router, Store};
use outbox_sqlx::{ListQuery, ListState, Outbox, SqlStore};
use outbox_tests::backend::{TestBackend, outbox};
use outbox_tests::kit::{
    Fail, OnlyX, Ping, PingPong, Pong, Probe, WatchedStore, XAndY, run_idle, run_until, wait_for,
};
use outbox_tests::on_every_backend;
use sqlx::Pool;
use tokio::sync::Notify;
use uuid::Uuid;

on_every_backend!(
    committed_events_reach_each_routed_subscriber_exactly_once,
    transient_failure_records_attempts_error_and_next_retry_then_delivers_after_the_delay,
    exhausted_retries_make_a_dead_letter_that_is_never_claimed_or_purged_while_others_flow,
    a_permanent_error_is_a_dead_letter_at_once_with_its_reason,
    a_failure_group_is_requeued_and_nothing_else,
    settled_means_only_dead_letters_and_what_they_hold_back_are_left,
    every_state_is_listed_filtered_and_a_page_at_a_time,
    a_panicking_handler_is_a_transient_failure_not_a_crash,
    undecodable_payloads_become_dead_letters_and_the_relay_keeps_running,
    an_event_type_this_build_does_not_route_is_parked_until_a_build_that_does_runs,
    an_event_parked_for_want_of_a_build_is_taken_when_the_build_arrives_not_after_its_park,
    a_payload_of_a_newer_version_is_parked_not_dead,
    a_subscriber_that_fails_is_retried_alone,
    a_failing_event_holds_back_its_aggregate_for_that_subscriber_only,
    a_key_free_again_drains_what_waited_behind_it_in_one_batch_in_order,
    a_batch_claims_at_most_its_bytes_of_payload_and_a_larger_event_alone,
    deliveries_are_claimed_within_the_bytes_of_a_batch_too,
    a_retry_due_within_the_in_place_limit_is_made_in_the_batch_in_order,
    a_key_waiting_for_its_retry_in_place_holds_back_only_its_own_aggregate,
    a_key_waiting_for_its_retry_in_place_leaves_its_call_slot_to_the_keys_after_it,
    aggregates_whose_retries_in_place_end_are_freed_while_others_still_wait,
    a_key_waiting_alone_in_its_batch_for_a_retry_in_place_holds_back_no_other_aggregate,
    aggregates_freed_while_a_batch_still_waits_are_claimed_at_once,
    a_slow_call_holds_back_only_its_own_aggregate,
    events_set_aside_behind_a_lasting_claim_go_once_their_aggregate_is_recorded,
    a_part_of_a_batch_that_cannot_be_recorded_is_delivered_again_after_its_claim_expires,
    requeue_hands_dead_letters_back_to_the_relay,
    a_dead_undecodable_event_can_be_requeued_after_a_fix,
    an_aborted_relay_leaves_claims_that_expire_and_another_relay_delivers,
    graceful_shutdown_records_the_batch_in_progress,
    a_commit_in_this_process_wakes_an_idle_relay,
    each_retry_a_relay_recorded_is_made_when_due_not_at_its_next_poll,
    a_retry_another_relay_recorded_is_made_when_due_not_at_the_next_poll,
    an_event_another_relay_parked_is_looked_at_again_when_due_not_at_the_next_poll,
    a_claim_a_dead_relay_left_is_taken_when_it_expires_not_at_the_next_poll,
    a_requeue_or_a_skip_wakes_an_idle_relay_at_once,
    slow_handlers_have_the_next_batch_claimed_before_their_last_calls_end,
    a_relay_stopping_gives_back_the_batch_it_claimed_ahead,
    a_relay_waiting_on_its_handlers_claims_a_quarter_of_its_batch,
    a_claim_is_timed_without_the_registration_before_it,
    a_batch_is_claimed_ahead_only_once_the_batch_before_is_recorded,
    a_batch_claimed_ahead_starts_beside_the_last_calls_of_the_batch_before,
    a_relay_with_quick_handlers_claims_its_whole_batch_after_the_first,
    a_batch_split_for_a_retry_in_place_is_followed_by_a_whole_claim,
    a_batch_whose_record_is_lost_hands_its_aggregates_on_only_in_order,
    a_later_event_of_an_aggregate_whose_call_runs_waits_for_that_call,
    a_later_event_taken_over_goes_back_behind_a_call_that_failed_for_good,
);

const WAIT: Duration = Duration::from_secs(20);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Fast settings: the retry schedule in milliseconds.
fn config() -> RelayConfig {
    RelayConfig::default()
        .with_poll_interval(ms(20))
        .with_lease(Duration::from_secs(10))
        .with_handler_timeout(Duration::from_secs(4))
        .with_park_delay(ms(200))
        .with_max_error_backoff(ms(200))
        .with_retry(RetryPolicy::new([ms(50), ms(50)]).unwrap())
}

/// The outbox publishes `Ping` and `Pong`; relays may route fewer (an older build).
type TestOutbox<B> = Outbox<B, PingPong>;

async fn setup<B: TestBackend>() -> (B::Guard, TestOutbox<B>) {
    outbox::<B, PingPong>().await
}

fn relay<B: TestBackend, R: Router>(
    outbox: &TestOutbox<B>,
    router: R,
    config: RelayConfig,
) -> Relay<SqlStore<B>, R> {
    Relay::new(outbox.store(), router, config).expect("valid config")
}

async fn publish<B: TestBackend>(outbox: &TestOutbox<B>, events: &[Ping]) {
    let mut tx = outbox.begin().await.unwrap();
    for event in events {
        tx.publish(event).await.unwrap();
    }
    tx.commit().await.unwrap();
}

/// Publishes `Pong` 1 of `aggregate`, a type relays that route only `Ping` do not know.
async fn publish_pong<B: TestBackend>(outbox: &TestOutbox<B>, aggregate: Uuid) {
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong { aggregate, seq: 1 }).await.unwrap();
    tx.commit().await.unwrap();
}

async fn publish_one<B: TestBackend>(outbox: &TestOutbox<B>, aggregate: Uuid, seq: u32) -> i64 {
    publish(outbox, &[Ping { aggregate, seq }]).await;
    B::events(outbox.pool()).await.last().unwrap().id
}

/// (attempts, last_error, dead, seconds until the next attempt) of a delivery.
async fn delivery<B: TestBackend>(
    pool: &Pool<B>,
    subscriber: &str,
    event_id: i64,
) -> Option<(i64, Option<String>, bool, f64)> {
    B::delivery(pool, subscriber, event_id)
        .await
        .map(|d| (d.attempts, d.last_error, d.dead, d.due_in))
}

/// (published, dead, times parked, last_error) of an event.
async fn event_state<B: TestBackend>(pool: &Pool<B>, id: i64) -> (bool, bool, i64, Option<String>) {
    let events = B::events(pool).await;
    let e = events
        .iter()
        .find(|e| e.id == id)
        .expect("the event exists");
    (e.published, e.dead, e.parked, e.last_error.clone())
}

async fn insert_raw<B: TestBackend>(
    pool: &Pool<B>,
    event_type: &str,
    aggregate: Uuid,
    payload: &str,
) -> i64 {
    B::insert_raw(pool, event_type, aggregate, payload).await
}

async fn committed_events_reach_each_routed_subscriber_exactly_once<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let router = PingPong::new(&probe);
    let relay = relay(&outbox, router, config());
    B::create_accounts(outbox.pool()).await;
    let a = Uuid::new_v4();
    let mut tx = outbox.begin().await.unwrap();
    B::insert_account(&mut tx, a, 2).await;
    let pings = [
        Ping {
            aggregate: a,
            seq: 1,
        },
        Ping {
            aggregate: a,
            seq: 2,
        },
    ];
    tx.publish_all(&pings).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        B::account_count(outbox.pool()).await,
        1,
        "the domain change committed with its events"
    );
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: a,
        seq: 3,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();

    run_until(&relay, WAIT, || probe.seen().len() == 5).await;
    // Running more batches delivers nothing again.
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    }
    assert_eq!(probe.delivered_to("x"), [(a, 1), (a, 2), (a, 3)]);
    assert_eq!(probe.delivered_to("y"), [(a, 1), (a, 2)]);
    assert!(B::events(outbox.pool()).await.iter().all(|e| e.published));
    assert_eq!(B::delivery_count(outbox.pool()).await, 0);
}

async fn transient_failure_records_attempts_error_and_next_retry_then_delivers_after_the_delay<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Transient]);
    let config = config().with_retry(RetryPolicy::new([ms(800)]).unwrap());
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    let id = publish_one(&outbox, a, 1).await;

    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.retried), (1, 1));
    let status = outbox.status().await.unwrap();
    assert_eq!((status.pending_events, status.pending_deliveries), (0, 1));
    assert!(!status.is_settled());
    let (attempts, error, dead, due_in) = delivery::<B>(outbox.pool(), "x", id).await.unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(
        error.as_deref(),
        Some("transient error: scripted transient failure")
    );
    assert!(!dead);
    assert!(due_in > 0.0 && due_in <= 0.8, "next retry in {due_in}s");
    // The event itself is handed out; only x's delivery waits.
    assert!(event_state::<B>(outbox.pool(), id).await.0);

    // Not due yet: nothing is claimed.
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    assert_eq!(probe.calls_of("x"), [(a, 1, 1)]);

    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 1).await;
    assert_eq!(probe.calls_of("x"), [(a, 1, 1), (a, 1, 2)]);
    assert_eq!(delivery::<B>(outbox.pool(), "x", id).await, None);
}

async fn exhausted_retries_make_a_dead_letter_that_is_never_claimed_or_purged_while_others_flow<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail(
        "x",
        a,
        1,
        [Fail::Transient, Fail::Transient, Fail::Transient],
    );
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let dead_id = publish_one(&outbox, a, 1).await;

    // Two retries of 50 ms, then the third failure is final.
    run_until(&relay, WAIT, || probe.calls_of("x").len() == 3).await;
    let (attempts, error, dead, _) = delivery::<B>(outbox.pool(), "x", dead_id).await.unwrap();
    assert_eq!((attempts, dead), (3, true));
    assert_eq!(
        error.as_deref(),
        Some("transient error: scripted transient failure")
    );

    // Events of another aggregate keep flowing past it.
    publish(
        &outbox,
        &[
            Ping {
                aggregate: b,
                seq: 1,
            },
            Ping {
                aggregate: b,
                seq: 2,
            },
        ],
    )
    .await;
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2)]);

    let status = outbox.status().await.unwrap();
    assert_eq!(
        (
            status.pending_events,
            status.pending_deliveries,
            status.dead_letters
        ),
        (0, 0, 1)
    );
    assert!(status.is_settled());

    // The dead letter is never claimed again.
    tokio::time::sleep(ms(120)).await; // longer than any retry delay of this policy
    for _ in 0..3 {
        assert_eq!(relay.run_once().await.unwrap().claimed, 0);
    }
    assert_eq!(probe.calls_of("x").iter().filter(|c| c.0 == a).count(), 3);

    // Retention removes the published events of b, not the dead letter's event.
    let purged = outbox.purge_published(Duration::ZERO, 1).await.unwrap();
    assert_eq!(purged, 2);
    let left: Vec<i64> = B::events(outbox.pool())
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(left, [dead_id]);
    assert!(delivery::<B>(outbox.pool(), "x", dead_id).await.unwrap().2);
}

async fn settled_means_only_dead_letters_and_what_they_hold_back_are_left<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Permanent]);
    // a: x's delivery of the first dies, the next two wait behind it for x; b: flows; c: an
    // event that never decodes (dead), and one after it.
    for seq in 1..=3 {
        publish_one(&outbox, a, seq).await;
    }
    publish_one(&outbox, b, 1).await;
    insert_raw::<B>(outbox.pool(), "Ping", c, r#"{"version": 1}"#).await;
    publish_one(&outbox, c, 2).await;
    let status = outbox.status().await.unwrap();
    assert!(!status.is_settled(), "{status:?}");

    let relay = relay(&outbox, XAndY::new(&probe), config());
    run_until(&relay, WAIT, || {
        probe.delivered_to("y").len() == 4 && probe.delivered_to("x").len() == 1
    })
    .await;
    // The relay looks once more and finds nothing to do (c:2 is set aside behind c's dead
    // event as a claim meets it).
    for _ in 0..10 {
        let report = relay.run_once().await.unwrap();
        if report.claimed == 0 && !report.more {
            break;
        }
    }
    let status = outbox.status().await.unwrap();
    // Left: x's dead delivery of a:1 and its a:2, a:3 behind it; the dead event of c and c:2.
    assert_eq!(status.dead_letters, 2, "{status:?}");
    assert_eq!(status.pending_deliveries, 2, "{status:?}");
    assert_eq!(status.pending_events, 1, "{status:?}");
    assert_eq!(status.behind_dead_letters, 3, "{status:?}");
    assert!(status.is_settled(), "{status:?}");
    assert!(!status.is_empty());
    // Grouped by failure: one group per cause.
    let groups: Vec<(Option<String>, &str, u64)> = outbox
        .dead_letter_groups()
        .await
        .unwrap()
        .into_iter()
        .map(|g| (g.subscriber, g.kind, g.dead))
        .collect();
    assert_eq!(
        groups,
        [
            (Some("x".to_owned()), "permanent", 1),
            (None, "undecodable", 1)
        ]
    );

    // A parked event is work left for a build that can read it: not settled.
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(relay.run_once().await.unwrap().parked, 1);
    let status = outbox.status().await.unwrap();
    assert!(!status.is_settled(), "{status:?}");
}

async fn every_state_is_listed_filtered_and_a_page_at_a_time<B: TestBackend>() {
    use outbox_sqlx::HoldCause;
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c, d) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    // a: x fails a:1 (retry far away), a:2 waits behind it; b: y's delivery dies, then it is
    // skipped; c: an event that never decodes, c:2 set aside behind it; d: a Pong this build
    // does not route (parked).
    probe.fail("x", a, 1, [Fail::Transient]);
    probe.fail("y", b, 1, [Fail::Permanent]);
    let config = config().with_retry(RetryPolicy::new([Duration::from_secs(3600)]).unwrap());
    let relay = relay(&outbox, XAndY::new(&probe), config);
    let a1 = publish_one(&outbox, a, 1).await;
    let a2 = publish_one(&outbox, a, 2).await;
    let b1 = publish_one(&outbox, b, 1).await;
    let c1 = insert_raw::<B>(outbox.pool(), "Ping", c, r#"{"version": 1}"#).await;
    let c2 = publish_one(&outbox, c, 2).await;
    let mut tx = outbox.begin().await.unwrap();
    tx.publish(&Pong {
        aggregate: d,
        seq: 1,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let d1 = B::events(outbox.pool()).await.last().unwrap().id;
    let list = |query: ListQuery| {
        let outbox = outbox.clone();
        async move {
            outbox
                .list(&query)
                .await
                .unwrap()
                .into_iter()
                .map(|l| (l.event_id, l.subscriber))
                .collect::<Vec<_>>()
        }
    };
    // Before any relay: all pending.
    assert_eq!(
        list(ListQuery::new(ListState::Pending)).await,
        [a1, a2, b1, c1, c2, d1].map(|id| (id, None))
    );
    // A claim (a relay working on a batch, or one that died holding it) shows as claimed,
    // and only as claimed, until it is given back.
    let batch = outbox
        .store()
        .claim(
            ClaimLimit::events(1),
            Duration::from_secs(60),
            &Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(list(ListQuery::new(ListState::Claimed)).await, [(a1, None)]);
    assert_eq!(
        list(ListQuery::new(ListState::Pending)).await,
        [a2, b1, c1, c2, d1].map(|id| (id, None))
    );
    let overview = outbox.overview().await.unwrap();
    assert_eq!(
        (
            overview.count(ListState::Claimed),
            overview.count(ListState::Pending)
        ),
        (1, 5),
        "{overview:?}"
    );
    let released = outbox_core::store::Outcomes {
        events: batch
            .claims
            .iter()
            .filter_map(|claim| claim.event())
            .map(|event| (event.id, outbox_core::store::EventOutcome::Released))
            .collect(),
        deliveries: Vec::new(),
    };
    let _ = outbox.store().record(batch.token, &released).await.unwrap();
    assert_eq!(list(ListQuery::new(ListState::Claimed)).await, []);
    for _ in 0..10 {
        let report = relay.run_once().await.unwrap();
        if report.claimed == 0 && !report.more {
            break;
        }
    }
    let x = Some("x".to_owned());
    let y = Some("y".to_owned());
    assert_eq!(
        list(ListQuery::new(ListState::Retrying)).await,
        [(a1, x.clone())]
    );
    assert_eq!(
        list(ListQuery::new(ListState::Waiting)).await,
        [(a2, x.clone())]
    );
    assert_eq!(list(ListQuery::new(ListState::Parked)).await, [(d1, None)]);
    assert_eq!(list(ListQuery::new(ListState::Held)).await, [(c2, None)]);
    assert_eq!(
        list(ListQuery::new(ListState::Dead)).await,
        [(b1, y.clone()), (c1, None)]
    );
    assert_eq!(list(ListQuery::new(ListState::Pending)).await, []);
    // The overview counts every state and says what holds what back: the dead event c:1 its
    // aggregate (c:2 set aside behind it), the parked d:1 its aggregate, x's failing a:1 its key
    // (a:2 waits), y's dead b:1 its key.
    let overview = outbox.overview().await.unwrap();
    let counts = ListState::ALL.map(|state| (state.as_str(), overview.count(state)));
    assert_eq!(
        counts,
        [
            ("pending", 0),
            ("claimed", 0),
            ("parked", 1),
            ("held", 1),
            ("retrying", 1),
            ("waiting", 1),
            ("dead", 2),
            ("skipped", 0)
        ],
        "{overview:?}"
    );
    // Each event and delivery is in one state only.
    let mut seen = std::collections::BTreeMap::new();
    for state in ListState::ALL {
        for row in list(ListQuery::new(state)).await {
            if let Some(before) = seen.insert(row.clone(), state) {
                panic!("{row:?} is both {before:?} and {state:?}");
            }
        }
    }
    assert_eq!(seen.len(), 6, "{seen:?}");
    let held = |cause| {
        let held = overview.held_back_by(cause);
        (held.blocked, held.waiting)
    };
    assert_eq!(held(HoldCause::DeadEvent), (1, 1), "{overview:?}");
    assert_eq!(held(HoldCause::ParkedEvent), (1, 0), "{overview:?}");
    assert_eq!(held(HoldCause::LastingClaim), (0, 0), "{overview:?}");
    assert_eq!(held(HoldCause::FailingDelivery), (1, 1), "{overview:?}");
    assert_eq!(held(HoldCause::DeadDelivery), (1, 0), "{overview:?}");
    // Filters.
    assert_eq!(
        list(ListQuery::new(ListState::Dead).subscriber("y")).await,
        [(b1, y.clone())]
    );
    assert_eq!(
        list(ListQuery::new(ListState::Dead).aggregate(c)).await,
        [(c1, None)]
    );
    assert_eq!(
        list(ListQuery::new(ListState::Parked).event_type("Ping")).await,
        []
    );
    // A page at a time.
    let first = list(ListQuery::new(ListState::Dead).limit(1)).await;
    assert_eq!(first, [(b1, y.clone())]);
    let next = list(
        ListQuery::new(ListState::Dead)
            .limit(1)
            .after(b1, Some("y")),
    )
    .await;
    assert_eq!(next, [(c1, None)]);
    assert_eq!(
        list(ListQuery::new(ListState::Dead).limit(1).after(c1, None)).await,
        []
    );
    // Pages that say whether more follow (one row more is read to know).
    let page = outbox
        .list_page(&ListQuery::new(ListState::Dead).limit(1))
        .await
        .unwrap();
    let b1_of_y = format!("{b1}/y");
    assert_eq!(
        (page.rows[0].event_id, page.next.as_deref()),
        (b1, Some(b1_of_y.as_str()))
    );
    let last = outbox
        .list_page(
            &ListQuery::new(ListState::Dead)
                .limit(1)
                .after_key(&b1_of_y)
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!((last.rows[0].event_id, last.next), (c1, None));
    // Skipped, with the reason.
    assert!(
        outbox
            .skip(b1, Some("y"), "refunded by hand")
            .await
            .unwrap()
    );
    let skipped = outbox
        .list(&ListQuery::new(ListState::Skipped))
        .await
        .unwrap();
    assert_eq!(skipped.len(), 1);
    assert_eq!(
        (
            skipped[0].event_id,
            skipped[0].reason.as_deref(),
            skipped[0].aggregate_id
        ),
        (b1, Some("refunded by hand"), Some(b))
    );
    // A dead event, skipped for every subscriber; a second skip finds nothing to skip.
    assert!(outbox.skip(c1, None, "payload lost").await.unwrap());
    assert!(!outbox.skip(c1, None, "again").await.unwrap());
    let skipped = outbox
        .list(&ListQuery::new(ListState::Skipped))
        .await
        .unwrap();
    assert_eq!(
        skipped
            .iter()
            .map(|s| (s.event_id, s.subscriber.clone(), s.reason.clone()))
            .collect::<Vec<_>>(),
        [
            (
                b1,
                Some("y".to_owned()),
                Some("refunded by hand".to_owned())
            ),
            (c1, None, Some("payload lost".to_owned()))
        ]
    );
    assert_eq!(outbox.overview().await.unwrap().count(ListState::Dead), 0);
}

async fn a_failure_group_is_requeued_and_nothing_else<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    // y: a and b fail alike, c otherwise (a transient failure, no retries left); x: a as y's.
    probe.fail("y", a, 1, [Fail::Permanent]);
    probe.fail("y", b, 1, [Fail::Permanent]);
    probe.fail(
        "y",
        c,
        1,
        [Fail::Message("quota exceeded\nfor tenant 7".into())],
    );
    probe.fail("x", a, 1, [Fail::Permanent]);
    let config = config().with_retry(RetryPolicy::new([]).unwrap());
    let relay = relay(&outbox, XAndY::new(&probe), config);
    for aggregate in [a, b, c] {
        publish_one(&outbox, aggregate, 1).await;
    }
    let undecodable =
        insert_raw::<B>(outbox.pool(), "Ping", Uuid::new_v4(), r#"{"version": 1}"#).await;
    let dead = || {
        let outbox = outbox.clone();
        async move {
            let mut dead: Vec<(Option<String>, i64)> = outbox
                .list(&ListQuery::new(ListState::Dead))
                .await
                .unwrap()
                .into_iter()
                .map(|d| (d.subscriber, d.event_id))
                .collect();
            dead.sort();
            dead
        }
    };
    for _ in 0..10 {
        relay.run_once().await.unwrap();
    }
    assert_eq!(dead().await.len(), 5, "{:?}", dead().await);
    let groups = outbox.dead_letter_groups().await.unwrap();
    let line_of = |subscriber: Option<&str>, kind: &str| {
        groups
            .iter()
            .find(|g| g.subscriber.as_deref() == subscriber && g.kind == kind)
            .map(|g| g.first_line.clone())
            .unwrap_or_else(|| panic!("no {kind} group of {subscriber:?}: {groups:?}"))
    };
    let permanent = line_of(Some("y"), "permanent");
    assert_eq!(
        line_of(Some("y"), "retries exhausted"),
        "transient error: quota exceeded"
    );
    let requeue = |subscriber: Option<&str>, first_line: &str| {
        let which = Requeue::Failure {
            subscriber: subscriber.map(str::to_owned),
            first_line: first_line.to_owned(),
        };
        let outbox = outbox.clone();
        async move { outbox.requeue(&which).await.unwrap() }
    };
    // y's permanent failures go back (a and b), nothing else: not x's alike, not y's other.
    // With a reason, recorded (in the same transaction); without, or when nothing went
    // back, not.
    let which = Requeue::Failure {
        subscriber: Some("y".to_owned()),
        first_line: permanent.clone(),
    };
    assert_eq!(
        outbox
            .requeue_because(&which, "fixed in 1.4.2")
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        requeue(Some("y"), "permanent error: no such failure").await,
        0
    );
    assert_eq!(
        outbox
            .requeue_because(&which, "again, by mistake")
            .await
            .unwrap(),
        0
    );
    let ids = B::events(outbox.pool()).await;
    let id_of = |n: usize| ids[n].id;
    let mut left = vec![
        (None, undecodable),
        (Some("x".to_owned()), id_of(0)),
        (Some("y".to_owned()), id_of(2)),
    ];
    left.sort();
    assert_eq!(dead().await, left);
    // The events that cannot be decoded, by their error.
    let undecodable_line = line_of(None, "undecodable");
    let which = Requeue::Failure {
        subscriber: None,
        first_line: undecodable_line.clone(),
    };
    assert_eq!(
        outbox
            .requeue_because(&which, "the decoder is fixed")
            .await
            .unwrap(),
        1
    );
    // Read back newest first, a page at a time.
    let records = outbox.requeues(None, 10).await.unwrap();
    let summary: Vec<(Vec<i64>, Option<&str>, u64, &str)> = records
        .iter()
        .map(|r| {
            (
                r.event_ids.clone(),
                r.subscriber.as_deref(),
                r.requeued,
                r.reason.as_str(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (vec![undecodable], None, 1, "the decoder is fixed"),
            (vec![], Some("y"), 2, "fixed in 1.4.2"),
        ]
    );
    assert!(records[0].requeued_at >= records[1].requeued_at);
    let older = outbox.requeues(Some(records[0].id), 1).await.unwrap();
    assert_eq!(older, records[1..]);
    assert_eq!(
        B::requeue_records(outbox.pool()).await,
        [
            (
                String::new(),
                Some("y".to_owned()),
                Some(permanent.clone()),
                2,
                "fixed in 1.4.2".to_owned()
            ),
            (
                undecodable.to_string(),
                None,
                Some(undecodable_line.clone()),
                1,
                "the decoder is fixed".to_owned()
            ),
        ]
    );
    left.retain(|(subscriber, _)| subscriber.is_some());
    assert_eq!(dead().await, left);
    // Requeued, y's two are delivered (their scripts are spent).
    for _ in 0..10 {
        relay.run_once().await.unwrap();
    }
    assert!(
        probe.delivered_to("y").contains(&(a, 1)),
        "{:?}",
        probe.seen()
    );
    assert!(
        probe.delivered_to("y").contains(&(b, 1)),
        "{:?}",
        probe.seen()
    );
}

async fn a_permanent_error_is_a_dead_letter_at_once_with_its_reason<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Permanent]);
    let relay = relay(&outbox, XAndY::new(&probe), config());
    let id = publish_one(&outbox, a, 1).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.delivered, report.dead), (1, 1));
    let (attempts, error, dead, _) = delivery::<B>(outbox.pool(), "x", id).await.unwrap();
    assert_eq!((attempts, dead), (1, true));
    assert_eq!(
        error.as_deref(),
        Some("permanent error: scripted permanent failure")
    );
    assert_eq!(probe.delivered_to("y"), [(a, 1)]);
    let dead = outbox.list(&ListQuery::new(ListState::Dead)).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (
            dead[0].event_id,
            dead[0].subscriber.as_deref(),
            dead[0].event_type.as_str()
        ),
        (id, Some("x"), "Ping")
    );
    assert_eq!(dead[0].attempts, 1);
    assert_eq!(dead[0].aggregate_id, Some(a));
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("permanent error: scripted permanent failure")
    );
}

async fn a_panicking_handler_is_a_transient_failure_not_a_crash<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Panic]);
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let id = publish_one(&outbox, a, 1).await;
    assert_eq!(relay.run_once().await.unwrap().retried, 1);
    let (attempts, error, _, _) = delivery::<B>(outbox.pool(), "x", id).await.unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(
        error.as_deref(),
        Some("transient error: handler panicked: scripted panic")
    );
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
}

async fn undecodable_payloads_become_dead_letters_and_the_relay_keeps_running<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let relay = Arc::new(relay(&outbox, OnlyX::new(&probe), config()));
    let wrong_shape = insert_raw::<B>(
        outbox.pool(),
        "Ping",
        Uuid::new_v4(),
        r#"{"version":1,"data":{"seq":"one"}}"#,
    )
    .await;
    let not_envelope = insert_raw::<B>(
        outbox.pool(),
        "Ping",
        Uuid::new_v4(),
        r#"{"hello":"world"}"#,
    )
    .await;
    let stop = Arc::new(Notify::new());
    let worker = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop.notified()).await }
    });
    let good = Uuid::new_v4();
    publish_one(&outbox, good, 1).await;
    wait_for(|| probe.delivered_to("x") == [(good, 1)]).await;
    stop.notify_one();
    worker.await.unwrap();

    let (published, dead, _, reason) = event_state::<B>(outbox.pool(), wrong_shape).await;
    assert!(!published && dead);
    let reason = reason.unwrap();
    assert!(
        reason.starts_with("`data` of a version 1 `Ping` payload does not fit the event"),
        "{reason}"
    );
    let (published, dead, _, reason) = event_state::<B>(outbox.pool(), not_envelope).await;
    assert!(!published && dead);
    assert!(
        reason
            .unwrap()
            .starts_with("payload is not an outbox envelope: missing field `version`")
    );
    assert!(probe.seen().iter().all(|s| s.aggregate == good));
    let dead = outbox.list(&ListQuery::new(ListState::Dead)).await.unwrap();
    let ids: Vec<(i64, Option<String>)> = dead
        .iter()
        .map(|d| (d.event_id, d.subscriber.clone()))
        .collect();
    assert_eq!(ids, [(wrong_shape, None), (not_envelope, None)]);
}

async fn an_event_type_this_build_does_not_route_is_parked_until_a_build_that_does_runs<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let old_build = relay(&outbox, OnlyX::new(&probe), config());
    let a = Uuid::new_v4();
    publish_pong(&outbox, a).await;
    let id = B::events(outbox.pool()).await[0].id;

    assert_eq!(old_build.run_once().await.unwrap().parked, 1);
    let (published, dead, parked, reason) = event_state::<B>(outbox.pool(), id).await;
    assert!(!published && !dead);
    assert_eq!(parked, 1);
    assert_eq!(
        reason.as_deref(),
        Some("no subscriber in this build knows event type `Pong`")
    );

    let new_build = relay(&outbox, PingPong::new(&probe), config());
    run_until(&new_build, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
    assert!(event_state::<B>(outbox.pool(), id).await.0);
}

/// An event parked because no running build could handle it is looked at again when a build
/// that was not running registers (a deploy: it may be the build that reads it), not only when
/// its park ends: with a park of an hour, the new build delivers it at once.
async fn an_event_parked_for_want_of_a_build_is_taken_when_the_build_arrives_not_after_its_park<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let long_park = config().with_park_delay(Duration::from_secs(3600));
    let old_build = relay(&outbox, OnlyX::new(&probe), long_park.clone());
    let a = Uuid::new_v4();
    publish_pong(&outbox, a).await;
    assert_eq!(old_build.run_once().await.unwrap().parked, 1);
    // Another relay of the old build changes nothing: it reads what the first one did not.
    let same_build = relay(&outbox, OnlyX::new(&probe), long_park.clone());
    assert_eq!(same_build.run_once().await.unwrap().claimed, 0);
    let new_build = relay(&outbox, PingPong::new(&probe), long_park);
    run_until(&new_build, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
}

async fn a_payload_of_a_newer_version_is_parked_not_dead<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let a = Uuid::new_v4();
    let id = insert_raw::<B>(
        outbox.pool(),
        "Ping",
        a,
        &format!(r#"{{"version":2,"data":{{"aggregate":"{a}","seq":1,"colour":"red"}}}}"#),
    )
    .await;
    let later = publish_one(&outbox, a, 2).await;
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.parked, 1);
    let (published, dead, parked, reason) = event_state::<B>(outbox.pool(), id).await;
    assert!(!published && !dead);
    assert_eq!(parked, 1);
    assert_eq!(
        reason.as_deref(),
        Some(
            "`Ping` payload version 2 is newer than version 1 known to this build: run the newer code to deliver it"
        )
    );
    // The aggregate's later event waits behind it: order is kept.
    assert!(!event_state::<B>(outbox.pool(), later).await.0);
    assert!(probe.seen().is_empty());
}

async fn a_subscriber_that_fails_is_retried_alone<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Transient]);
    let relay = relay(&outbox, XAndY::new(&probe), config());
    publish_one(&outbox, a, 1).await;
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 1).await;
    for _ in 0..3 {
        relay.run_once().await.unwrap();
    }
    assert_eq!(probe.calls_of("y"), [(a, 1, 1)]);
    assert_eq!(probe.calls_of("x"), [(a, 1, 1), (a, 1, 2)]);
}

async fn a_failing_event_holds_back_its_aggregate_for_that_subscriber_only<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient, Fail::Transient]);
    let config = config().with_retry(RetryPolicy::new([ms(300), ms(300)]).unwrap());
    let relay = relay(&outbox, XAndY::new(&probe), config);
    publish(
        &outbox,
        &[
            Ping {
                aggregate: a,
                seq: 1,
            },
            Ping {
                aggregate: b,
                seq: 1,
            },
            Ping {
                aggregate: a,
                seq: 2,
            },
            Ping {
                aggregate: b,
                seq: 2,
            },
            Ping {
                aggregate: a,
                seq: 3,
            },
        ],
    )
    .await;

    // First pass: y gets everything, x gets b's events, and a's later events wait for x.
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.retried, report.waiting), (5, 1, 2));
    // In order per aggregate; aggregates run concurrently.
    let of = |aggregate: Uuid, subscriber: &str| -> Vec<u32> {
        let delivered = probe.delivered_to(subscriber);
        delivered
            .iter()
            .filter(|(k, _)| *k == aggregate)
            .map(|(_, seq)| *seq)
            .collect()
    };
    assert_eq!((of(a, "y"), of(b, "y")), (vec![1, 2, 3], vec![1, 2]));
    assert_eq!((of(a, "x"), of(b, "x")), (vec![], vec![1, 2]));
    // More events of b flow while a is held back for x.
    publish(
        &outbox,
        &[Ping {
            aggregate: b,
            seq: 3,
        }],
    )
    .await;
    relay.run_once().await.unwrap();
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2), (b, 3)]);
    assert!(!probe.calls_of("x").contains(&(a, 2, 1)));

    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 6).await;
    let x_on_a: Vec<(u32, u32)> = probe
        .calls_of("x")
        .into_iter()
        .filter(|c| c.0 == a)
        .map(|c| (c.1, c.2))
        .collect();
    // a1 failed twice, then a1, a2, a3 in commit order, each handed over once.
    assert_eq!(x_on_a, [(1, 1), (1, 2), (1, 3), (2, 1), (3, 1)]);
    // y took each of the six events once, in order per aggregate.
    let mut y = probe.calls_of("y");
    y.sort_by_key(|c| c.0 != a);
    assert_eq!(
        y,
        [
            (a, 1, 1),
            (a, 2, 1),
            (a, 3, 1),
            (b, 1, 1),
            (b, 2, 1),
            (b, 3, 1)
        ]
    );
}

/// After a failure, the later events of its (subscriber, aggregate) wait as deliveries; once
/// the failed one is delivered, the next claim takes them all, in order, not one per batch.
async fn a_key_free_again_drains_what_waited_behind_it_in_one_batch_in_order<B: TestBackend>() {
    const EVENTS: u32 = 30;
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Transient]);
    let relay = relay(&outbox, XAndY::new(&probe), config().with_batch_size(50));
    let events: Vec<Ping> = (1..=EVENTS).map(|seq| Ping { aggregate: a, seq }).collect();
    publish(&outbox, &events).await;

    let first = relay.run_once().await.unwrap();
    assert_eq!((first.retried, first.waiting), (1, EVENTS as usize - 1));
    // Claims until x has everything; claims that find nothing (the retry is not due yet) are
    // not counted.
    let reports = run_until(&relay, WAIT, || {
        probe.delivered_to("x").len() == EVENTS as usize
    })
    .await;
    let batches: Vec<usize> = reports
        .iter()
        .filter(|r| r.claimed > 0)
        .map(|r| r.claimed)
        .collect();
    assert_eq!(
        batches,
        [EVENTS as usize],
        "the retry and the {} deliveries behind it in one batch",
        EVENTS - 1
    );
    let seqs: Vec<u32> = probe.delivered_to("x").iter().map(|(_, s)| *s).collect();
    assert_eq!(seqs, (1..=EVENTS).collect::<Vec<_>>());
    assert_eq!(probe.delivered_to("y").len(), EVENTS as usize);
}

/// A `Ping` whose payload carries `pad` bytes more (a field `Ping` does not read).
async fn insert_padded_ping<B: TestBackend>(
    outbox: &TestOutbox<B>,
    aggregate: Uuid,
    seq: u32,
    pad: usize,
) -> i64 {
    let payload = format!(
        r#"{{"version":1,"data":{{"aggregate":"{aggregate}","seq":{seq},"pad":"{}"}}}}"#,
        "x".repeat(pad)
    );
    insert_raw(outbox.pool(), "Ping", aggregate, &payload).await
}

/// A claim stops before the event that would take its payloads over the batch's bytes, so
/// what a batch holds in memory is bounded whatever the events weigh; an event larger than
/// that is claimed alone, and everything is delivered, in order.
async fn a_batch_claims_at_most_its_bytes_of_payload_and_a_larger_event_alone<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // Five events of about 4 KB and one of about 25 KB, against 10 000 bytes a batch.
    for seq in 1..=5 {
        insert_padded_ping(&outbox, a, seq, 4000).await;
    }
    insert_padded_ping(&outbox, b, 1, 25_000).await;
    let relay = relay(
        &outbox,
        XAndY::new(&probe),
        config().with_batch_bytes(10_000),
    );
    let reports = run_until(&relay, WAIT, || probe.delivered_to("y").len() == 6).await;
    let batches: Vec<usize> = reports.iter().map(|r| r.claimed).collect();
    assert_eq!(
        batches,
        [2, 2, 1, 1],
        "two of 4 KB fit in 10 000 bytes, a third does not; the 25 KB event goes alone"
    );
    for subscriber in ["x", "y"] {
        assert_eq!(
            probe.delivered_to(subscriber),
            [(a, 1), (a, 2), (a, 3), (a, 4), (a, 5), (b, 1)],
            "{subscriber}"
        );
    }
    assert_eq!(relay.run_once().await.unwrap().claimed, 0);
}

/// Deliveries (what waits behind a failure) count against the batch's bytes as events do,
/// each with its event's payload, and still drain in order.
async fn deliveries_are_claimed_within_the_bytes_of_a_batch_too<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    for seq in 1..=5 {
        insert_padded_ping(&outbox, a, seq, 4000).await;
    }
    // A relay without a byte limit to speak of takes all five; x fails the first, so x's five
    // wait as deliveries (the retry after 50 ms, beyond the in-place limit).
    probe.fail("x", a, 1, [Fail::Transient]);
    let first = relay(&outbox, XAndY::new(&probe), config());
    let report = first.run_once().await.unwrap();
    assert_eq!((report.claimed, report.retried), (5, 1), "{report:?}");
    assert_eq!(probe.delivered_to("y").len(), 5);

    let relay = relay(
        &outbox,
        XAndY::new(&probe),
        config().with_batch_bytes(10_000),
    );
    let reports = run_until(&relay, WAIT, || probe.delivered_to("x").len() == 5).await;
    let batches: Vec<usize> = reports
        .iter()
        .filter(|r| r.claimed > 0)
        .map(|r| r.claimed)
        .collect();
    assert_eq!(batches, [2, 2, 1], "two deliveries of 4 KB a batch");
    assert_eq!(
        probe.delivered_to("x"),
        (1..=5).map(|seq| (a, seq)).collect::<Vec<_>>()
    );
}

/// A retry due within the in-place limit is waited for in the batch, with the key's later
/// calls behind it: no delivery row is written. One due later is written down as before, with
/// every attempt made counted.
async fn a_retry_due_within_the_in_place_limit_is_made_in_the_batch_in_order<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, c) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient, Fail::Transient]);
    probe.fail(
        "x",
        c,
        1,
        [Fail::Transient, Fail::Transient, Fail::Transient],
    );
    let config = config()
        .with_retry(RetryPolicy::new([ms(10), ms(10), ms(800)]).unwrap())
        .with_retry_in_place(ms(20));
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    let events: Vec<Ping> = [a, c]
        .into_iter()
        .flat_map(|aggregate| (1..=2).map(move |seq| Ping { aggregate, seq }))
        .collect();
    publish(&outbox, &events).await;
    let ids: Vec<i64> = B::events(outbox.pool())
        .await
        .iter()
        .map(|e| e.id)
        .collect();

    let report = relay.run_once().await.unwrap();
    // a: two retries in place, then delivered, and its second event after it. c: two retries
    // in place, then a third failure whose retry is due too late: written down, with c's
    // second event waiting behind it.
    assert_eq!(
        (
            report.delivered,
            report.retried_in_place,
            report.retried,
            report.waiting
        ),
        (2, 4, 1, 1),
        "{report:?}"
    );
    assert_eq!(
        probe
            .calls_of("x")
            .iter()
            .filter(|(g, _, _)| *g == a)
            .collect::<Vec<_>>(),
        [&(a, 1, 1), &(a, 1, 2), &(a, 1, 3), &(a, 2, 1)]
    );
    assert_eq!(
        probe
            .calls_of("x")
            .iter()
            .filter(|(g, _, _)| *g == c)
            .collect::<Vec<_>>(),
        [&(c, 1, 1), &(c, 1, 2), &(c, 1, 3)]
    );
    assert_eq!(
        B::delivery_count(outbox.pool()).await,
        2,
        "c's two rows only"
    );
    let (attempts, _, dead, due_in) = delivery::<B>(outbox.pool(), "x", ids[2]).await.unwrap();
    assert_eq!((attempts, dead), (3, false));
    assert!(due_in > 0.1, "the late retry waits its delay: {due_in}s");

    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 4).await;
    let seqs: Vec<u32> = probe
        .delivered_to("x")
        .iter()
        .filter(|(g, _)| *g == c)
        .map(|(_, s)| *s)
        .collect();
    assert_eq!(seqs, [1, 2]);
    assert_eq!(B::delivery_count(outbox.pool()).await, 0);
}

/// Publishes (aggregate, seq) pings in one transaction.
async fn publish_pings<B: TestBackend>(outbox: &TestOutbox<B>, pings: &[(Uuid, u32)]) {
    let events: Vec<Ping> = pings
        .iter()
        .map(|&(aggregate, seq)| Ping { aggregate, seq })
        .collect();
    publish(outbox, &events).await;
}

/// Waits until `ping` is delivered to `x`, then checks that `x` was called `calls` times for
/// `waiting` by then: `ping` did not wait for `waiting`'s next call.
async fn delivered_while_waiting(probe: &Probe, ping: (Uuid, u32), waiting: Uuid, calls: usize) {
    wait_for(|| probe.delivered_to("x").contains(&ping)).await;
    assert_eq!(
        calls_for(probe, waiting),
        calls,
        "{ping:?} waited for the next call for {waiting}: {:?}",
        probe.calls_of("x")
    );
}

/// How many times `x` was called for `aggregate`.
fn calls_for(probe: &Probe, aggregate: Uuid) -> usize {
    probe
        .calls_of("x")
        .iter()
        .filter(|(g, _, _)| *g == aggregate)
        .count()
}

async fn a_key_waiting_for_its_retry_in_place_holds_back_only_its_own_aggregate<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient]);
    // a's first event fails and waits 3 s for its retry, in the batch.
    let config = config()
        .with_retry(RetryPolicy::new([Duration::from_secs(3)]).unwrap())
        .with_retry_in_place(Duration::from_millis(3500));
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    publish_pings(&outbox, &[(a, 1), (b, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.calls_of("x").len() == 2).await;
    assert_eq!(probe.delivered_to("x"), [(b, 1)]);

    // While a waits, b's next event is claimed and delivered; a's waits behind a's first.
    publish_pings(&outbox, &[(b, 2), (a, 2)]).await;
    delivered_while_waiting(&probe, (b, 2), a, 1).await;
    wait_for(|| probe.delivered_to("x").len() == 4).await;
    worker.abort();
    each_once_in_order(&probe, &[a, b], 2);
    assert_eq!(
        calls_for(&probe, a),
        3,
        "a: one failure, its retry, its second event"
    );
}

/// At concurrency 1, a key of a batch waiting for its retry in place leaves its call slot to the
/// keys after it in the same batch: they are called meanwhile, not after its retry.
async fn a_key_waiting_for_its_retry_in_place_leaves_its_call_slot_to_the_keys_after_it<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient]);
    // a's first event fails and waits 3 s for its retry, in the batch; one call at a time.
    let config = config()
        .with_concurrency(1)
        .with_retry(RetryPolicy::new([Duration::from_secs(3)]).unwrap())
        .with_retry_in_place(Duration::from_millis(3500));
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    // One commit, so one claim: a's queue first, then b's and c's.
    publish_pings(&outbox, &[(a, 1), (b, 1), (c, 1), (b, 2)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    delivered_while_waiting(&probe, (c, 1), a, 1).await;
    delivered_while_waiting(&probe, (b, 2), a, 1).await;
    wait_for(|| probe.delivered_to("x").len() == 4).await;
    worker.abort();
    each_once_in_order(&probe, &[b], 2);
    each_once_in_order(&probe, &[a, c], 1);
    assert_eq!(calls_for(&probe, a), 2, "a: one failure, its retry");
}

async fn aggregates_whose_retries_in_place_end_are_freed_while_others_still_wait<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    // a's first event fails twice (retried after 300 ms, then 2 s), c's once (after 300 ms).
    // (c is done well before the batch's claim is a second old: a claim made after that sets
    // c's next event aside behind it, and a part's record frees only what it names.)
    probe.fail("x", a, 1, [Fail::Transient, Fail::Transient]);
    probe.fail("x", c, 1, [Fail::Transient]);
    let config = config()
        .with_retry(RetryPolicy::new([ms(300), Duration::from_secs(2)]).unwrap())
        .with_retry_in_place(Duration::from_millis(2500));
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    publish_pings(&outbox, &[(a, 1), (b, 1), (c, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").contains(&(c, 1))).await;

    // c is done while a still waits: c's next event is delivered before a's third attempt.
    publish_pings(&outbox, &[(c, 2), (a, 2)]).await;
    delivered_while_waiting(&probe, (c, 2), a, 2).await;
    wait_for(|| probe.delivered_to("x").len() == 5).await;
    worker.abort();
    each_once_in_order(&probe, &[a, c], 2);
    each_once_in_order(&probe, &[b], 1);
}

/// A batch whose every aggregate still has a key waiting for a retry in place holds only those
/// aggregates: the relay claims and delivers other aggregates' events meanwhile. (The poll
/// interval is long: only the commit wakes the relay.)
async fn a_key_waiting_alone_in_its_batch_for_a_retry_in_place_holds_back_no_other_aggregate<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient]);
    let config = config()
        .with_poll_interval(Duration::from_secs(30))
        .with_retry(RetryPolicy::new([Duration::from_secs(3)]).unwrap())
        .with_retry_in_place(Duration::from_millis(3500));
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    publish_pings(&outbox, &[(a, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.calls_of("x").len() == 1).await;

    // a's batch holds nothing else: b's event is claimed and delivered while a waits.
    publish_pings(&outbox, &[(b, 1)]).await;
    delivered_while_waiting(&probe, (b, 1), a, 1).await;
    wait_for(|| probe.delivered_to("x").len() == 2).await;
    worker.abort();
    each_once_in_order(&probe, &[a, b], 1);
}

/// An aggregate whose keys are done while others of its batch still wait for retries in place
/// is recorded at once, and the relay, idle meanwhile, claims its later events then, not at its
/// next poll or when the batch ends.
async fn aggregates_freed_while_a_batch_still_waits_are_claimed_at_once<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    // a's first event fails twice (retried after 1 s, then 2 s), c's once (after 1 s), both
    // retried in the batch.
    probe.fail("x", a, 1, [Fail::Transient, Fail::Transient]);
    probe.fail("x", c, 1, [Fail::Transient]);
    let config = config()
        .with_poll_interval(Duration::from_secs(30))
        .with_retry(RetryPolicy::new([Duration::from_secs(1), Duration::from_secs(2)]).unwrap())
        .with_retry_in_place(Duration::from_millis(2500));
    let relay = relay(&outbox, OnlyX::new(&probe), config);
    publish_pings(&outbox, &[(a, 1), (b, 1), (c, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").contains(&(b, 1))).await;
    // c's next event comes while c's first still waits: claims pass over it until c is done.
    publish_pings(&outbox, &[(c, 2)]).await;
    delivered_while_waiting(&probe, (c, 2), a, 2).await;
    wait_for(|| probe.delivered_to("x").len() == 4).await;
    worker.abort();
    each_once_in_order(&probe, &[a, b], 1);
    each_once_in_order(&probe, &[c], 2);
}

/// For a call blocked until the test releases it: a handler timeout longer than the test waits
/// (and the lease to go with it), and a poll interval so long that only the relay's own
/// wake-ups count.
fn blocked_call_config() -> RelayConfig {
    config()
        .with_poll_interval(Duration::from_secs(30))
        .with_lease(Duration::from_secs(150))
        .with_handler_timeout(Duration::from_secs(60))
}

/// A call that takes long (a slow service, within the handler timeout) holds back only its own
/// aggregate: the relay claims and delivers other aggregates' events beside it.
async fn a_slow_call_holds_back_only_its_own_aggregate<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let (entered, release) = probe.block("x", a, 1);
    let relay = relay(&outbox, OnlyX::new(&probe), blocked_call_config());
    publish_pings(&outbox, &[(a, 1), (c, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    entered.notified().await;

    // While a's call runs, b's event and c's next are claimed and delivered; a's next waits.
    publish_pings(&outbox, &[(b, 1), (c, 2), (a, 2)]).await;
    wait_for(|| probe.delivered_to("x").len() == 3).await;
    assert_eq!(calls_for(&probe, a), 0, "{:?}", probe.calls_of("x"));
    assert_eq!(
        probe.busy.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "a's call still runs"
    );
    release.notify_one();
    wait_for(|| probe.delivered_to("x").len() == 5).await;
    worker.abort();
    each_once_in_order(&probe, &[a, c], 2);
    each_once_in_order(&probe, &[b], 1);
}

/// A claim older than a second (a quarter lease at most) has its aggregates' new events set
/// aside behind it (`held_by`) rather than skipped. When part of that claim is recorded (here c,
/// whose slow call ended while a's still runs), the events set aside behind c must go with it:
/// they must not wait for the claim's end, that is a's call.
async fn events_set_aside_behind_a_lasting_claim_go_once_their_aggregate_is_recorded<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, c) = (Uuid::new_v4(), Uuid::new_v4());
    let (a_entered, release_a) = probe.block("x", a, 1);
    let (c_entered, release_c) = probe.block("x", c, 1);
    let relay = relay(&outbox, OnlyX::new(&probe), blocked_call_config());
    publish_pings(&outbox, &[(a, 1), (c, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    a_entered.notified().await;
    c_entered.notified().await;

    // Once the claim has lasted a second, a claim sets c's next event aside behind it. (A
    // store whose claims take over the relay's own aggregates has the relay's next claim
    // take it instead, to wait in the relay for c's call: nothing is set aside there.)
    tokio::time::sleep(Duration::from_millis(1200)).await;
    publish_pings(&outbox, &[(c, 2)]).await;
    if !outbox.store().claims_take_over() {
        for _ in 0..2000 {
            if outbox.status().await.unwrap().held_events == 1 {
                break;
            }
            tokio::time::sleep(ms(10)).await;
        }
        assert_eq!(
            outbox.status().await.unwrap().held_events,
            1,
            "c's next event is held"
        );
    }

    // c's call ends: c's part is recorded and its next event delivered while a's call runs.
    release_c.notify_one();
    delivered_while_waiting(&probe, (c, 2), a, 0).await;
    release_a.notify_one();
    wait_for(|| probe.delivered_to("x").len() == 3).await;
    worker.abort();
    each_once_in_order(&probe, &[c], 2);
    each_once_in_order(&probe, &[a], 1);
}

async fn a_part_of_a_batch_that_cannot_be_recorded_is_delivered_again_after_its_claim_expires<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // b's event is a delivery of its own (a dead letter requeued), claimed with a's event.
    probe.fail("x", b, 1, [Fail::Permanent]);
    publish_pings(&outbox, &[(b, 1)]).await;
    relay(&outbox, OnlyX::new(&probe), config())
        .run_once()
        .await
        .unwrap();
    let requeued = outbox.requeue(&Requeue::Subscriber("x".into())).await;
    assert_eq!(requeued.unwrap(), 1);
    // a's first event waits for a retry in place: b's delivery is recorded first, as a part,
    // and that record fails (five tries: every try of the relay's).
    probe.fail("x", a, 1, [Fail::Transient]);
    publish_pings(&outbox, &[(a, 1)]).await;
    let store = WatchedStore::new(outbox.store()).losing_parts(5);
    let lost = store.lost_records.clone();
    let config = config()
        .with_lease(Duration::from_secs(3))
        .with_handler_timeout(Duration::from_secs(1))
        .with_retry(RetryPolicy::new([ms(300)]).unwrap())
        .with_retry_in_place(ms(500));
    let relay = Relay::new(store, OnlyX::new(&probe), config).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| lost.load(std::sync::atomic::Ordering::SeqCst) == 5).await;
    // Nothing of the claim was recorded (the rest neither: its record would end the claim and
    // leave b's delivery marked with it for ever): when it expires, both are delivered again,
    // and then recorded.
    wait_for(|| probe.delivered_to("x").iter().filter(|d| d.0 == b).count() == 2).await;
    wait_for(|| probe.delivered_to("x").iter().filter(|d| d.0 == a).count() == 2).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let status = outbox.status().await.unwrap();
        if status.is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(ms(20)).await;
    }
    worker.abort();
}

/// The claim made beside a batch's record may take over the aggregates the batch handled
/// cleanly (PostgreSQL does), but their calls wait for that record: when it is lost, the events
/// taken over are given back, and each aggregate's events are handled again from the first one
/// the lost record left unpublished. No event is handled after a later one of its aggregate,
/// redeliveries included.
async fn a_batch_whose_record_is_lost_hands_its_aggregates_on_only_in_order<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    // The first claim is a quarter of the batch: a's and b's first events. The record of
    // that batch is lost (five tries: every try of the relay's), and the claim beside it finds
    // only their later events.
    publish_pings::<B>(&outbox, &[(a, 1), (b, 1)]).await;
    let store = WatchedStore::new(outbox.store())
        .losing_records(5)
        .slow_records(ms(20));
    let (lost, took_over) = (store.lost_records.clone(), store.took_over.clone());
    let config = config()
        .with_batch_size(8)
        .with_lease(Duration::from_secs(2))
        .with_handler_timeout(ms(500));
    let relay = Relay::new(store, OnlyX::new(&probe), config).unwrap();
    let (entered, release) = probe.block("x", a, 1);
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    // (The later events are there before the first batch ends.)
    entered.notified().await;
    publish_pings::<B>(&outbox, &[(a, 2), (b, 2), (a, 3), (b, 3)]).await;
    release.notify_one();
    wait_for(|| lost.load(std::sync::atomic::Ordering::SeqCst) == 5).await;
    for aggregate in [a, b] {
        wait_for(|| {
            probe
                .delivered_to("x")
                .iter()
                .any(|&(x, seq)| x == aggregate && seq == 3)
        })
        .await;
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    while !outbox.status().await.unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "not settled");
        tokio::time::sleep(ms(20)).await;
    }
    worker.abort();
    for aggregate in [a, b] {
        let seqs: Vec<u32> = probe
            .delivered_to("x")
            .into_iter()
            .filter(|&(x, _)| x == aggregate)
            .map(|(_, seq)| seq)
            .collect();
        assert!(
            seqs.windows(2).all(|pair| pair[0] <= pair[1]),
            "an event of {aggregate} was handled after a later one: {seqs:?}"
        );
        assert_eq!(seqs.first(), Some(&1));
        assert_eq!(seqs.iter().filter(|&&seq| seq == 1).count(), 2, "{seqs:?}");
    }
    if outbox.store().claims_take_over() {
        assert!(
            took_over.load(std::sync::atomic::Ordering::SeqCst) > 0,
            "no claim took over the lost batch's aggregates"
        );
    }
}

/// A claim made while an aggregate's call runs may take over the aggregate's later events
/// (PostgreSQL's does: the relay names the aggregates of its own claims still under way), but
/// their calls wait until the call before has ended and its record is applied: the later event
/// is handled after the earlier one, once each.
async fn a_later_event_of_an_aggregate_whose_call_runs_waits_for_that_call<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let (entered, release) = probe.block("x", a, 1);
    let store = WatchedStore::new(outbox.store());
    let took_over = store.took_over.clone();
    let relay = Relay::new(store, OnlyX::new(&probe), blocked_call_config()).unwrap();
    publish_pings::<B>(&outbox, &[(a, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    entered.notified().await;

    // While a's first call runs, a's next event and b's are claimed; b's is delivered.
    publish_pings::<B>(&outbox, &[(a, 2), (b, 1)]).await;
    wait_for(|| probe.delivered_to("x").contains(&(b, 1))).await;
    if outbox.store().claims_take_over() {
        wait_for(|| took_over.load(std::sync::atomic::Ordering::SeqCst) > 0).await;
    }
    assert_eq!(calls_for(&probe, a), 0, "{:?}", probe.calls_of("x"));
    release.notify_one();
    wait_for(|| probe.delivered_to("x").len() == 3).await;
    worker.abort();
    each_once_in_order(&probe, &[a], 2);
    each_once_in_order(&probe, &[b], 1);
}

/// A claim that took over an aggregate's later event while the call before waited for its
/// retry (PostgreSQL's does) gives it back when that call then fails for good: the later event
/// waits behind the dead letter, as it would have without the take-over, and is not handled.
async fn a_later_event_taken_over_goes_back_behind_a_call_that_failed_for_good<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient, Fail::Permanent]);
    let store = WatchedStore::new(outbox.store());
    let took_over = store.took_over.clone();
    // a's first call fails and waits a second for its retry in place, which fails for good.
    let config = config()
        .with_poll_interval(Duration::from_secs(30))
        .with_retry(RetryPolicy::new([Duration::from_secs(1)]).unwrap())
        .with_retry_in_place(Duration::from_secs(2));
    let relay = Relay::new(store, OnlyX::new(&probe), config).unwrap();
    publish_pings::<B>(&outbox, &[(a, 1)]).await;
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| calls_for(&probe, a) == 1).await;
    publish_pings::<B>(&outbox, &[(a, 2), (b, 1)]).await;
    wait_for(|| probe.delivered_to("x").contains(&(b, 1))).await;
    if outbox.store().claims_take_over() {
        wait_for(|| took_over.load(std::sync::atomic::Ordering::SeqCst) > 0).await;
    }
    // The retry fails for good: a's first event is a dead letter, its second waits behind it.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let status = outbox.status().await.unwrap();
        if status.dead_letters == 1 && status.behind_dead_letters == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{status:?}");
        tokio::time::sleep(ms(20)).await;
    }
    worker.abort();
    assert_eq!(calls_for(&probe, a), 2, "{:?}", probe.calls_of("x"));
    assert!(
        !probe.delivered_to("x").contains(&(a, 2)),
        "{:?}",
        probe.calls_of("x")
    );
}

async fn requeue_hands_dead_letters_back_to_the_relay<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Permanent]);
    probe.fail("x", b, 1, [Fail::Permanent]);
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let a_id = publish_one(&outbox, a, 1).await;
    let b_id = publish_one(&outbox, b, 1).await;
    run_until(&relay, WAIT, || probe.calls_of("x").len() == 2).await;
    assert!(delivery::<B>(outbox.pool(), "x", a_id).await.unwrap().2);

    // By event id.
    assert_eq!(
        outbox.requeue(&Requeue::Events(vec![a_id])).await.unwrap(),
        1
    );
    let (attempts, _, dead, _) = delivery::<B>(outbox.pool(), "x", a_id).await.unwrap();
    assert_eq!((attempts, dead), (0, false));
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
    assert_eq!(delivery::<B>(outbox.pool(), "x", a_id).await, None);

    // Every dead letter of a subscriber.
    assert_eq!(
        outbox
            .requeue(&Requeue::Subscriber("x".into()))
            .await
            .unwrap(),
        1
    );
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;
    assert_eq!(delivery::<B>(outbox.pool(), "x", b_id).await, None);
    // Nothing left to requeue.
    assert_eq!(
        outbox
            .requeue(&Requeue::Subscriber("x".into()))
            .await
            .unwrap(),
        0
    );
}

async fn a_dead_undecodable_event_can_be_requeued_after_a_fix<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let a = Uuid::new_v4();
    let id = insert_raw::<B>(
        outbox.pool(),
        "Ping",
        a,
        r#"{"version":1,"data":{"seq":1}}"#,
    )
    .await;
    relay.run_once().await.unwrap();
    assert!(event_state::<B>(outbox.pool(), id).await.1);
    // An operator repairs the payload, then requeues the event.
    let repaired = format!(r#"{{"version":1,"data":{{"aggregate":"{a}","seq":1}}}}"#);
    B::set_payload(outbox.pool(), id, &repaired).await;
    assert_eq!(outbox.requeue(&Requeue::Events(vec![id])).await.unwrap(), 1);
    run_until(&relay, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
}

/// Publishes event 1 of `a`, and has a relay with `lease` claim it and die (aborted) in its call
/// of `x`, which never returns: the claim is left to expire. Returns the event's id and when
/// the relay died.
async fn a_relay_dies_in_a_call<B: TestBackend>(
    outbox: &TestOutbox<B>,
    probe: &Probe,
    a: Uuid,
    lease: Duration,
) -> (i64, std::time::Instant) {
    let entered = Arc::new(Notify::new());
    probe.fail(
        "x",
        a,
        1,
        [Fail::Block {
            entered: entered.clone(),
            release: Arc::new(Notify::new()),
        }],
    );
    let short = config().with_lease(lease).with_handler_timeout(lease / 3);
    let first = relay(outbox, OnlyX::new(probe), short);
    let id = publish_one(outbox, a, 1).await;
    let task = tokio::spawn(async move { first.run_once().await });
    entered.notified().await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    (id, std::time::Instant::now())
}

async fn an_aborted_relay_leaves_claims_that_expire_and_another_relay_delivers<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let lease = Duration::from_secs(1);
    let (id, claimed_at) = a_relay_dies_in_a_call(&outbox, &probe, a, lease).await;
    let short = config().with_lease(lease).with_handler_timeout(ms(400));
    let second = relay(&outbox, OnlyX::new(&probe), short);
    // The claim still holds: nothing for the second relay yet.
    assert_eq!(second.run_once().await.unwrap().claimed, 0);
    run_until(&second, WAIT, || probe.delivered_to("x") == [(a, 1)]).await;
    assert!(
        claimed_at.elapsed() >= lease - ms(100),
        "taken again after {:?}",
        claimed_at.elapsed()
    );
    assert!(event_state::<B>(outbox.pool(), id).await.0);
}

async fn graceful_shutdown_records_the_batch_in_progress<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let (entered, release) = probe.block("x", a, 1);
    let relay = relay(&outbox, OnlyX::new(&probe), config());
    let id = publish_one(&outbox, a, 1).await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stop_rx.await;
            })
            .await;
    });
    entered.notified().await;
    stop_tx.send(()).unwrap();
    release.notify_one();
    tokio::time::timeout(WAIT, worker)
        .await
        .expect("run returns after shutdown")
        .unwrap();
    assert!(
        event_state::<B>(outbox.pool(), id).await.0,
        "the batch in progress was recorded"
    );
    assert_eq!(probe.delivered_to("x"), [(a, 1)]);
}

async fn a_commit_in_this_process_wakes_an_idle_relay<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let sleepy = config().with_poll_interval(Duration::from_secs(3600));
    // The relay found nothing; from here only a wake-up makes it claim within the hour.
    let running = run_idle(outbox.store(), OnlyX::new(&probe), sleepy).await;
    let a = Uuid::new_v4();
    publish_one(&outbox, a, 1).await;
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    running.stop().await;
}

/// A relay that records retries due at different times wakes for each, not only for the
/// first: a relay that polls once an hour makes both within seconds.
async fn each_retry_a_relay_recorded_is_made_when_due_not_at_its_next_poll<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient]);
    probe.fail("x", b, 1, [Fail::Transient]);
    let sleepy = config()
        .with_poll_interval(Duration::from_secs(3600))
        .with_retry_in_place(Duration::ZERO)
        .with_retry(RetryPolicy::new([ms(300)]).unwrap());
    let relay = relay(&outbox, OnlyX::new(&probe), sleepy);
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    publish_one(&outbox, a, 1).await;
    wait_for(|| probe.calls_of("x").len() == 1).await;
    // (Spaces the two retries: when a's is due, b's is not yet, so the relay makes a's alone
    // and must still wake for b's.)
    tokio::time::sleep(ms(150)).await;
    publish_one(&outbox, b, 1).await;
    wait_for(|| probe.delivered_to("x").len() == 2).await;
    assert_eq!(probe.calls_of("x").len(), 4, "{:?}", probe.calls_of("x"));
    worker.abort();
}

/// A retry that another relay recorded (or this one, before it restarted) is made when it is
/// due: a relay that polls once an hour learns from its claims when the next retry it cannot
/// take yet will be due, and wakes then.
async fn a_retry_another_relay_recorded_is_made_when_due_not_at_the_next_poll<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    probe.fail("x", a, 1, [Fail::Transient]);
    let retry_after = Duration::from_secs(2);
    let sleepy = config()
        .with_poll_interval(Duration::from_secs(3600))
        .with_retry_in_place(Duration::ZERO)
        .with_retry(RetryPolicy::new([retry_after]).unwrap());
    // The first relay makes the call that fails, records its retry and stops.
    let first = relay(&outbox, OnlyX::new(&probe), sleepy.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = std::time::Instant::now();
    let worker = tokio::spawn(async move {
        first
            .run(async {
                let _ = stop_rx.await;
            })
            .await;
    });
    publish_one(&outbox, a, 1).await;
    wait_for(|| probe.calls_of("x").len() == 1).await;
    stop_tx.send(()).unwrap();
    tokio::time::timeout(WAIT, worker)
        .await
        .expect("run returns after shutdown")
        .unwrap();
    // (Else the second relay's first claim would find the retry due, which proves nothing.)
    assert!(
        started.elapsed() < retry_after,
        "the first relay took {:?}",
        started.elapsed()
    );
    // The second finds nothing due at first, then makes the retry when it is due.
    let second = relay(&outbox, OnlyX::new(&probe), sleepy);
    let worker = tokio::spawn(async move { second.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    assert!(
        started.elapsed() >= retry_after,
        "made {:?} after the first call, before it was due",
        started.elapsed()
    );
    assert_eq!(probe.calls_of("x").len(), 2, "{:?}", probe.calls_of("x"));
    worker.abort();
}

/// The same for a parked event (a payload of a newer version): a relay that polls once an
/// hour looks at it again when its park ends, though another relay parked it.
async fn an_event_another_relay_parked_is_looked_at_again_when_due_not_at_the_next_poll<
    B: TestBackend,
>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let id = insert_raw::<B>(
        outbox.pool(),
        "Ping",
        a,
        &format!(r#"{{"version":2,"data":{{"aggregate":"{a}","seq":1}}}}"#),
    )
    .await;
    let park = Duration::from_secs(2);
    let sleepy = config()
        .with_poll_interval(Duration::from_secs(3600))
        .with_park_delay(park);
    let started = std::time::Instant::now();
    let first = relay(&outbox, OnlyX::new(&probe), sleepy.clone());
    assert_eq!(first.run_once().await.unwrap().parked, 1);
    assert!(
        started.elapsed() < park,
        "the first relay took {:?}",
        started.elapsed()
    );
    let second = relay(&outbox, OnlyX::new(&probe), sleepy);
    let worker = tokio::spawn(async move { second.run(std::future::pending()).await });
    // Parked again when its park ended: the second relay looked at it then.
    let deadline = tokio::time::Instant::now() + WAIT;
    while event_state::<B>(outbox.pool(), id).await.2 < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not looked at again within {WAIT:?}"
        );
        tokio::time::sleep(ms(20)).await;
    }
    assert!(started.elapsed() >= park, "looked at before its park ended");
    worker.abort();
}

/// The same for the claim of a relay that died: a relay that polls once an hour takes the
/// claim's work when its lease ends, with the events of its aggregate that came after and were
/// left behind it.
async fn a_claim_a_dead_relay_left_is_taken_when_it_expires_not_at_the_next_poll<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let a = Uuid::new_v4();
    let lease = Duration::from_secs(2);
    let (_, claimed_at) = a_relay_dies_in_a_call(&outbox, &probe, a, lease).await;
    publish_one(&outbox, a, 2).await;
    let sleepy = config().with_poll_interval(Duration::from_secs(3600));
    let second = relay(&outbox, OnlyX::new(&probe), sleepy);
    let worker = tokio::spawn(async move { second.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x") == [(a, 1), (a, 2)]).await;
    assert!(
        claimed_at.elapsed() >= lease - ms(200),
        "taken {:?} after the claim, before its lease ended",
        claimed_at.elapsed()
    );
    worker.abort();
}

/// Work an operator hands back (a requeue, a skip that frees the events behind a dead
/// delivery) is taken at once by an idle relay of the process, not at its next poll.
async fn a_requeue_or_a_skip_wakes_an_idle_relay_at_once<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Permanent]);
    probe.fail("x", b, 1, [Fail::Permanent]);
    let a_id = publish_one(&outbox, a, 1).await;
    let b_id = publish_one(&outbox, b, 1).await;
    publish_one(&outbox, b, 2).await;
    run_until(&relay(&outbox, OnlyX::new(&probe), config()), WAIT, || {
        probe.calls_of("x").len() == 2
    })
    .await;
    // A relay that polls once an hour, idle: it found nothing to claim.
    let sleepy = config().with_poll_interval(Duration::from_secs(3600));
    let idle_relay = || run_idle(outbox.store(), OnlyX::new(&probe), sleepy.clone());
    let running = idle_relay().await;
    assert_eq!(
        outbox.requeue(&Requeue::Events(vec![a_id])).await.unwrap(),
        1
    );
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    running.stop().await;
    let running = idle_relay().await;
    assert!(outbox.skip(b_id, Some("x"), "by hand").await.unwrap());
    wait_for(|| probe.delivered_to("x") == [(a, 1), (b, 2)]).await;
    running.stop().await;
}

/// Publishes `seqs` events of each of `aggregates` new aggregates, one round of all aggregates
/// per seq (as commits of many aggregates interleave); each call of `x` will take `delay`.
async fn publish_rounds<B: TestBackend>(
    outbox: &TestOutbox<B>,
    probe: &Probe,
    aggregates: usize,
    seqs: u32,
    delay: Duration,
) -> Vec<Uuid> {
    let ids: Vec<Uuid> = (0..aggregates).map(|_| Uuid::new_v4()).collect();
    for seq in 1..=seqs {
        let round: Vec<Ping> = ids
            .iter()
            .map(|&aggregate| Ping { aggregate, seq })
            .collect();
        publish(outbox, &round).await;
        for &aggregate in &ids {
            probe.fail("x", aggregate, seq, [Fail::Delay(delay)]);
        }
    }
    ids
}

/// Each aggregate's events reached `x` once each, in order.
fn each_once_in_order(probe: &Probe, aggregates: &[Uuid], seqs: u32) {
    let delivered = probe.delivered_to("x");
    for &aggregate in aggregates {
        let got: Vec<u32> = delivered
            .iter()
            .filter(|(a, _)| *a == aggregate)
            .map(|&(_, seq)| seq)
            .collect();
        assert_eq!(got, (1..=seqs).collect::<Vec<_>>(), "aggregate {aggregate}");
    }
}

/// 300 events over 100 aggregates for `x`, whose calls take `call`, in batches of 40 (the
/// first and those after slow calls a quarter) made one call at a time. The store watches the
/// probe's running calls, and its claims take `call` at least: the relay claims ahead once
/// what is left of a batch takes about two claims, so whatever the machine, each batch leaves
/// time for that, its last two calls.
async fn slow_batches<B: TestBackend>(
    outbox: &TestOutbox<B>,
    probe: &Probe,
    call: Duration,
) -> (Vec<Uuid>, WatchedStore<SqlStore<B>>, RelayConfig) {
    let aggregates = publish_rounds(outbox, probe, 100, 3, call).await;
    let store = WatchedStore::new(outbox.store())
        .watching(probe)
        .slow_claims(call);
    let slow = config().with_batch_size(40).with_concurrency(1);
    (aggregates, store, slow)
}

async fn slow_handlers_have_the_next_batch_claimed_before_their_last_calls_end<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (aggregates, store, slow) = slow_batches(&outbox, &probe, ms(2)).await;
    let ahead = store.claimed_while_busy.clone();
    let relay = Relay::new(store, OnlyX::new(&probe), slow).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").len() == 300).await;
    worker.abort();
    assert!(
        ahead.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "no batch was claimed while a handler ran"
    );
    // The batch claimed ahead left out the aggregates of the batch still running.
    each_once_in_order(&probe, &aggregates, 3);
}

/// A relay whose handlers are slower than its claims asks for a quarter of its batch: the
/// claims overlap the handlers anyway, and a smaller batch ends sooner.
async fn a_relay_waiting_on_its_handlers_claims_a_quarter_of_its_batch<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    // 40 calls of 10 ms in the first batch: far longer than any claim.
    let aggregates = publish_rounds(&outbox, &probe, 100, 1, ms(10)).await;
    let store = WatchedStore::new(outbox.store());
    let claims = store.claims.clone();
    let slow = config().with_batch_size(40).with_concurrency(1);
    let relay = Relay::new(store, OnlyX::new(&probe), slow).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").len() == 100).await;
    worker.abort();
    let claims = claims.lock().unwrap().clone();
    assert!(claims.len() >= 2, "{claims:?}");
    assert_eq!(
        claims[0],
        (10, 10),
        "the first claim, knowing nothing of the handlers, asks for a quarter"
    );
    assert_eq!(
        claims[1].0, 10,
        "asked for after a batch of slow calls: {claims:?}"
    );
    each_once_in_order(&probe, &aggregates, 1);
}

/// How long a claim takes (against which the relay weighs its handlers) is the store's claim
/// alone: the first claim also registers the relay, which a loaded machine may make slower than
/// a whole batch of calls.
async fn a_claim_is_timed_without_the_registration_before_it<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    // A first batch of 10 calls of 10 ms (about 100 ms), after a registration of 300 ms.
    let aggregates = publish_rounds(&outbox, &probe, 100, 1, ms(10)).await;
    let store = WatchedStore::new(outbox.store()).slow_registers(ms(300));
    let claims = store.claims.clone();
    let slow = config().with_batch_size(40).with_concurrency(1);
    let relay = Relay::new(store, OnlyX::new(&probe), slow).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").len() == 100).await;
    worker.abort();
    let claims = claims.lock().unwrap().clone();
    assert_eq!(
        claims[1].0, 10,
        "the calls were slower than the claim, not than the claim and the registration: \
         {claims:?}"
    );
    each_once_in_order(&probe, &aggregates, 1);
}

/// A relay starts with a quarter of its batch and, once a batch's calls took less than its
/// claim (the store, not the handlers, is what it waits for), claims the whole batch size.
async fn a_relay_with_quick_handlers_claims_its_whole_batch_after_the_first<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let aggregates: Vec<Uuid> = (0..100).map(|_| Uuid::new_v4()).collect();
    let claims = claims_of_quick_calls(&outbox, &probe, &aggregates, config()).await;
    assert_eq!(
        claims[1],
        (40, 40),
        "asked for after a batch of quick calls: {claims:?}"
    );
    assert_eq!(probe.calls_of("x").len(), 100, "each delivered once");
}

/// A batch split because a key waits for a retry in place says nothing of the handlers (they
/// are quick): the claim after it asks for the whole batch, as after any batch of quick calls.
async fn a_batch_split_for_a_retry_in_place_is_followed_by_a_whole_claim<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let aggregates: Vec<Uuid> = (0..100).map(|_| Uuid::new_v4()).collect();
    // The first event fails once: its retry, due in 50 ms, is waited for in place, and the
    // first batch is split (the other nine recorded at once).
    probe.fail("x", aggregates[0], 1, [Fail::Transient]);
    let config = config().with_retry_in_place(ms(100));
    let claims = claims_of_quick_calls(&outbox, &probe, &aggregates, config).await;
    assert_eq!(
        claims[1],
        (40, 40),
        "asked for after a batch split for a retry: {claims:?}"
    );
    assert_eq!(
        probe.calls_of("x").len(),
        101,
        "one failed call, then each delivered once"
    );
}

/// One event of each of `aggregates` for `x`, whose handler returns at once, relayed in
/// batches of 40 calls made one at a time (`config` otherwise) until all are delivered, in
/// order: the claims made, as (asked for, got). The first asks for a quarter.
async fn claims_of_quick_calls<B: TestBackend>(
    outbox: &TestOutbox<B>,
    probe: &Probe,
    aggregates: &[Uuid],
    config: RelayConfig,
) -> Vec<(u32, usize)> {
    let round: Vec<Ping> = aggregates
        .iter()
        .map(|&aggregate| Ping { aggregate, seq: 1 })
        .collect();
    publish(outbox, &round).await;
    let store = WatchedStore::new(outbox.store());
    let claims = store.claims.clone();
    let config = config.with_batch_size(40).with_concurrency(1);
    let relay = Relay::new(store, OnlyX::new(probe), config).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").len() == aggregates.len()).await;
    worker.abort();
    each_once_in_order(probe, aggregates, 1);
    let claims = claims.lock().unwrap().clone();
    assert!(claims.len() >= 2, "{claims:?}");
    assert_eq!(claims[0], (10, 10), "the first claim asks for a quarter");
    claims
}

/// The claim made ahead of a batch waits for the record of the batch before it, which runs
/// while the batch does: until then that batch's aggregates are held by its claim, and a claim
/// would pass over their later events (or, when they are all there is, find nothing and leave
/// the next claim to after the batch).
async fn a_batch_is_claimed_ahead_only_once_the_batch_before_is_recorded<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    // Calls of 10 ms: a batch (a quarter of 40, one call at a time) takes about 100 ms (only
    // the first batch has no record before it to wait for: it is claimed ahead of).
    let (aggregates, store, slow) = slow_batches(&outbox, &probe, ms(10)).await;
    // Records that outlast a batch: a claim ahead that did not wait for the record before it
    // would start while it runs.
    let store = store.slow_records(ms(150));
    let (ahead, racing) = (
        store.claimed_while_busy.clone(),
        store.claimed_while_recording.clone(),
    );
    let relay = Relay::new(store, OnlyX::new(&probe), slow).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").len() == 300).await;
    worker.abort();
    let (ahead, racing) = (
        ahead.load(std::sync::atomic::Ordering::SeqCst),
        racing.load(std::sync::atomic::Ordering::SeqCst),
    );
    assert!(ahead > 0, "no batch was claimed while a handler ran");
    assert_eq!(
        racing, 0,
        "claims made ahead while the record of the batch before ran ({ahead} claimed ahead)"
    );
    each_once_in_order(&probe, &aggregates, 3);
}

/// A batch claimed ahead starts as soon as the batch before it leaves a call slot idle, not
/// when that batch's last call ends: here the batch before is one aggregate's 60 calls of
/// 10 ms in a row, on one of two slots, and the batch claimed ahead another aggregate's event,
/// published while those calls run.
async fn a_batch_claimed_ahead_starts_beside_the_last_calls_of_the_batch_before<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let q = publish_rounds(&outbox, &probe, 1, 60, ms(10)).await[0];
    // Claims of 200 ms: the claim ahead starts when about 400 ms of calls are left, and ends
    // with about 200 ms left.
    let store = WatchedStore::new(outbox.store()).slow_claims(ms(200));
    let config = config()
        .with_poll_interval(Duration::from_secs(30))
        .with_batch_size(400)
        .with_concurrency(2);
    let relay = Relay::new(store, OnlyX::new(&probe), config).unwrap();
    let worker = tokio::spawn(async move { relay.run(std::future::pending()).await });
    wait_for(|| !probe.delivered_to("x").is_empty()).await;
    let b = Uuid::new_v4();
    publish_pings(&outbox, &[(b, 1)]).await;
    wait_for(|| probe.delivered_to("x").contains(&(b, 1))).await;
    let before = calls_for(&probe, q);
    assert!(
        before < 60,
        "b's event waited for q's last call ({before} of q's calls before)"
    );
    wait_for(|| probe.delivered_to("x").len() == 61).await;
    worker.abort();
    each_once_in_order(&probe, &[q], 60);
}

async fn a_relay_stopping_gives_back_the_batch_it_claimed_ahead<B: TestBackend>() {
    let (_db, outbox) = setup::<B>().await;
    let probe = Probe::default();
    let (aggregates, store, slow) = slow_batches(&outbox, &probe, ms(2)).await;
    let ahead = store.claimed_ahead.clone();
    // A lease longer than this test waits: a batch kept claimed would not be delivered again
    // in time.
    let slow = slow.with_lease(Duration::from_secs(60));
    let stopping = Relay::new(store, OnlyX::new(&probe), slow).unwrap();
    tokio::time::timeout(WAIT, stopping.run(ahead.notified()))
        .await
        .expect("the relay stops after the batch in progress");
    let first = probe.delivered_to("x").len();
    assert!(first < 300, "stopped with work left: {first} delivered");

    let after = relay::<B, _>(&outbox, OnlyX::new(&probe), config());
    let worker = tokio::spawn(async move { after.run(std::future::pending()).await });
    wait_for(|| probe.delivered_to("x").len() == 300).await;
    worker.abort();
    each_once_in_order(&probe, &aggregates, 3);
}
