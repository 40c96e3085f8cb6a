//! The test kit users test their own code with: the recording publisher, single deliveries, and
//! the in-memory store with its manual clock.

use std::time::Duration;

use outbox_core::store::{ClaimFilter, ClaimLimit, EventOutcome, Outcomes, Recorded, Requeue};
use outbox_core::testing::{ManualClock, MemoryStore, RecordingPublisher, TestDelivery, drain};
use outbox_core::{Metadata, Publish, Relay, RelayConfig, RetryPolicy, Store};
use outbox_tests::kit::{Fail, OnlyX, Ping, PingPong, Pong, Probe, XAndY, XPing};
use uuid::Uuid;

fn minutes(n: u64) -> Duration {
    Duration::from_secs(60 * n)
}

fn relay<R: outbox_core::Router>(store: &MemoryStore, router: R) -> Relay<MemoryStore, R> {
    // The seed's schedule, on the store's manual clock.
    Relay::new(store.clone(), router, RelayConfig::default()).unwrap()
}

#[tokio::test]
async fn the_recording_publisher_keeps_what_a_service_published_in_order() {
    async fn service(
        events: &mut (impl Publish<Ping> + Publish<Pong>),
        id: Uuid,
    ) -> Result<(), outbox_core::PublishError> {
        events
            .publish(&Ping {
                aggregate: id,
                seq: 1,
            })
            .await?;
        events
            .publish(&Pong {
                aggregate: id,
                seq: 2,
            })
            .await?;
        events
            .publish_with(
                &Ping {
                    aggregate: id,
                    seq: 3,
                },
                &Metadata::new().with_causation_id(id),
            )
            .await
    }
    let id = Uuid::new_v4();
    let mut publisher = RecordingPublisher::new();
    publisher.set_metadata(Metadata::new().with_correlation_id(id));
    service(&mut publisher, id).await.unwrap();
    assert_eq!(publisher.event_types(), ["Ping", "Pong", "Ping"]);
    assert_eq!(
        publisher.events::<Ping>(),
        [
            Ping {
                aggregate: id,
                seq: 1
            },
            Ping {
                aggregate: id,
                seq: 3
            }
        ]
    );
    assert_eq!(
        publisher.events::<Pong>(),
        [Pong {
            aggregate: id,
            seq: 2
        }]
    );
    let records = publisher.records();
    assert_eq!(records[0].aggregate_id, id);
    let first = outbox_core::decode::<Ping>(&records[0].payload).unwrap();
    assert_eq!(first.metadata.correlation_id(), Some(id));
    let third = outbox_core::decode::<Ping>(&records[2].payload).unwrap();
    assert_eq!(third.metadata.causation_id(), Some(id));
}

#[tokio::test]
async fn a_test_delivery_reaches_the_handler_once_or_twice() {
    let probe = Probe::default();
    let id = Uuid::new_v4();
    let delivery = TestDelivery::of(&Ping {
        aggregate: id,
        seq: 7,
    })
    .id(42);
    delivery.to(&XPing(probe.clone())).await.unwrap();
    delivery.twice_to(&XPing(probe.clone())).await.unwrap();
    let seen = probe.seen();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.event_id == 42 && s.seq == 7));
    assert_eq!(
        seen.iter().map(|s| s.attempt).collect::<Vec<_>>(),
        [1, 1, 2],
        "the second delivery of twice_to is a redelivery"
    );
}

#[tokio::test]
async fn a_test_delivery_to_a_subscriber_that_does_not_take_the_event_is_a_permanent_error() {
    let error = TestDelivery::of(&Pong {
        aggregate: Uuid::new_v4(),
        seq: 1,
    })
    .to(&XPing(Probe::default()))
    .await
    .unwrap_err();
    assert!(!error.is_transient());
    assert_eq!(
        error.to_string(),
        "permanent error: subscriber `x` does not take event type `Pong`"
    );
}

#[tokio::test]
async fn the_memory_store_drains_every_event_to_its_subscribers() {
    let probe = Probe::default();
    let store = MemoryStore::new();
    let a = Uuid::new_v4();
    let mut publisher = RecordingPublisher::new();
    for seq in 1..=3 {
        publisher
            .publish(&Ping { aggregate: a, seq })
            .await
            .unwrap();
    }
    store.commit(publisher);
    let report = drain(&relay(&store, XAndY::new(&probe))).await.unwrap();
    assert_eq!(report.delivered, 6);
    assert_eq!(probe.delivered_to("x"), [(a, 1), (a, 2), (a, 3)]);
    assert_eq!(probe.delivered_to("y"), [(a, 1), (a, 2), (a, 3)]);
    assert_eq!(store.pending(), 0);
    // Nothing is delivered twice.
    assert_eq!(
        drain(&relay(&store, XAndY::new(&probe)))
            .await
            .unwrap()
            .claimed,
        0
    );
}

#[tokio::test]
async fn the_seeds_retry_schedule_runs_on_the_manual_clock() {
    let probe = Probe::default();
    let clock = ManualClock::default();
    let store = MemoryStore::with_clock(clock.clone());
    let a = Uuid::new_v4();
    // Fails on every attempt: the first one and the six retries.
    probe.fail("x", a, 1, std::iter::repeat_n(Fail::Transient, 7));
    store
        .publish(&Ping {
            aggregate: a,
            seq: 1,
        })
        .unwrap();
    let relay = relay(&store, OnlyX::new(&probe));

    drain(&relay).await.unwrap();
    assert_eq!(probe.calls_of("x").len(), 1);
    let schedule = [1, 5, 15, 60, 4 * 60, 24 * 60];
    for (retry, wait) in schedule.into_iter().enumerate() {
        // A second before the delay is up: nothing.
        clock.advance(minutes(wait) - Duration::from_secs(1));
        drain(&relay).await.unwrap();
        assert_eq!(
            probe.calls_of("x").len(),
            retry + 1,
            "retry {retry} came early"
        );
        clock.advance(Duration::from_secs(1));
        drain(&relay).await.unwrap();
        assert_eq!(
            probe.calls_of("x").len(),
            retry + 2,
            "retry {retry} did not come"
        );
    }
    let deliveries = store.deliveries();
    assert_eq!(deliveries.len(), 1);
    assert!(deliveries[0].dead, "{deliveries:?}");
    assert_eq!(deliveries[0].attempts, 7);
    // Dead: never attempted again, however long we wait.
    clock.advance(minutes(10 * 24 * 60));
    drain(&relay).await.unwrap();
    assert_eq!(probe.calls_of("x").len(), 7);
    // Until an operator requeues it: its failure group (another group, or another
    // subscriber's, is not it), or the subscriber's dead letters.
    let error = deliveries[0].last_error.clone().unwrap();
    let line = Requeue::first_line(Some(&error)).to_owned();
    for (subscriber, first_line, requeued) in [
        ("y", line.as_str(), 0),
        ("x", "permanent error: another failure", 0),
        ("x", line.as_str(), 1),
    ] {
        let failure = Requeue::Failure {
            subscriber: Some(subscriber.to_owned()),
            first_line: first_line.to_owned(),
        };
        assert_eq!(
            store.requeue(&failure).await.unwrap(),
            requeued,
            "{failure:?}"
        );
    }
    drain(&relay).await.unwrap();
    assert_eq!(probe.delivered_to("x"), [(a, 1)]);
    assert_eq!(store.pending(), 0);
}

#[tokio::test]
async fn the_memory_store_keeps_order_per_subscriber_and_aggregate() {
    let probe = Probe::default();
    let store = MemoryStore::new();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Transient]);
    for (aggregate, seq) in [(a, 1), (b, 1), (a, 2), (b, 2)] {
        store.publish(&Ping { aggregate, seq }).unwrap();
    }
    let relay = Relay::new(
        store.clone(),
        XAndY::new(&probe),
        RelayConfig::default().with_retry(RetryPolicy::new([minutes(1)]).unwrap()),
    )
    .unwrap();
    drain(&relay).await.unwrap();
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2)]);
    assert_eq!(probe.delivered_to("y").len(), 4);
    store.clock().advance(minutes(1));
    drain(&relay).await.unwrap();
    assert_eq!(probe.delivered_to("x"), [(b, 1), (b, 2), (a, 1), (a, 2)]);
    assert_eq!(probe.delivered_to("y").len(), 4, "y is not called again");
}

/// The reference store takes a claim's byte limit as the database stores do: events, then
/// deliveries, each up to the limit, the first whatever its size.
#[tokio::test]
async fn the_memory_store_claims_within_the_bytes_of_a_batch() {
    let store = MemoryStore::new();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let padded = |aggregate: Uuid, seq: u32, pad: usize| {
        format!(
            r#"{{"version":1,"data":{{"aggregate":"{aggregate}","seq":{seq},"pad":"{}"}}}}"#,
            "x".repeat(pad)
        )
    };
    for seq in 1..=3 {
        store.insert_raw("Ping", "probe", a, &padded(a, seq, 400));
    }
    store.insert_raw("Ping", "probe", b, &padded(b, 1, 5000));
    let lease = minutes(1);
    let limit = ClaimLimit::new(100, 1000);
    let filter = ClaimFilter::default();
    let mut claimed = Vec::new();
    loop {
        let batch = store.claim(limit, lease, &filter).await.unwrap();
        if batch.is_empty() {
            break;
        }
        claimed.push(batch.claims.len());
        let outcomes = batch
            .claims
            .iter()
            .filter_map(|claim| claim.event())
            .map(|event| (event.id, EventOutcome::Published))
            .collect();
        let outcomes = Outcomes {
            events: outcomes,
            deliveries: Vec::new(),
        };
        assert_eq!(
            store.record(batch.token, &outcomes).await.unwrap(),
            Recorded::Applied
        );
    }
    assert_eq!(
        claimed,
        [2, 1, 1],
        "two of 400 bytes in 1000, then one; 5000 alone"
    );
}

#[tokio::test]
async fn the_memory_store_parks_an_event_type_the_router_does_not_know() {
    let probe = Probe::default();
    let store = MemoryStore::new();
    let a = Uuid::new_v4();
    store
        .publish(&Pong {
            aggregate: a,
            seq: 1,
        })
        .unwrap();
    let old = relay(&store, OnlyX::new(&probe));
    assert_eq!(drain(&old).await.unwrap().parked, 1);
    let events = store.events();
    assert_eq!(
        events[0].last_error.as_deref(),
        Some("no subscriber in this build knows event type `Pong`")
    );
    assert!(!events[0].dead && !events[0].published);
    // Another relay of the same build leaves it parked until the park delay has passed.
    let same = relay(&store, OnlyX::new(&probe));
    assert_eq!(drain(&same).await.unwrap().claimed, 0);
    // A build that knows it delivers it as soon as it arrives, not when the park ends.
    let new = relay(&store, PingPong::new(&probe));
    assert_eq!(drain(&new).await.unwrap().delivered, 1);
    assert_eq!(probe.delivered_to("x"), [(a, 1)]);
}

#[tokio::test]
async fn the_memory_store_reports_its_status_and_purges_by_its_clock() {
    let store = MemoryStore::new();
    let probe = Probe::default();
    let (fine, doomed) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("y", doomed, 1, [Fail::Permanent]);
    store
        .publish(&Ping {
            aggregate: fine,
            seq: 1,
        })
        .unwrap();
    store
        .publish(&Ping {
            aggregate: doomed,
            seq: 1,
        })
        .unwrap();
    store.clock().advance(minutes(3));
    // This relay does not route Pong: it stays pending, three minutes after the Pings.
    store
        .publish(&Pong {
            aggregate: fine,
            seq: 2,
        })
        .unwrap();
    store.clock().advance(minutes(2));
    drain(&relay(&store, XAndY::new(&probe))).await.unwrap();

    let status = store.status().await.unwrap();
    assert_eq!(
        (
            status.pending_events,
            status.pending_deliveries,
            status.dead_letters,
            status.blocked_keys
        ),
        (1, 0, 1, 1),
        "{status:?}"
    );
    assert_eq!(status.oldest_pending_age, Some(minutes(2)));

    // The Pings were published just now. Eleven minutes on, the first is old enough and free to
    // go; the second keeps its dead delivery, and the Pong is not published.
    let purge = async || store.purge_published(minutes(10), 10).await.unwrap();
    assert_eq!(purge().await.deleted, 0);
    store.clock().advance(minutes(11));
    assert_eq!(purge().await.deleted, 1);
    let left: Vec<Uuid> = store
        .events()
        .iter()
        .map(|e| e.stored.aggregate_id)
        .collect();
    assert_eq!(left, [doomed, fine]);
}
