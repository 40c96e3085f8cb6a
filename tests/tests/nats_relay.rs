//! Events relayed to NATS JetStream (the real nats-server at 127.0.0.1:4222, or `NATS_URL`) by a
//! relay process killed with SIGKILL at random moments, ten times: every event reaches the stream
//! once (`Nats-Msg-Id` drops what a restarted relay publishes again), with its headers, in commit
//! order per aggregate. Each test has a stream and subjects of its own, deleted after.
//!
//! The relay is this test binary run again with `OUTBOX_NATS_DATABASE` set: see
//! `nats_relay_process`, which does nothing when run without it.
//!
//! The broker down for 10 s mid-run (a nats-server of the test's own, killed and started again
//! on the same store): nothing lost, nothing twice, the backlog drained after.
//!
//! The consuming side: a service's `JetStreamConsumer` process killed at random, messages coming
//! again (a kill before the ack, `AckWait` expiry, failed handlers): each event's effect exactly
//! once, each aggregate's first handlings in commit order.
//!
//! And the wire format read by a client this project did not write: nats-py (from PyPI,
//! installed by the test into the target directory), running `tests/python/check_stream.py`.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use outbox_core::{
    Delivery, Handle, HandlerError, OutboxEvent, RelayConfig, RetryPolicy, router, subscriber,
};
use outbox_nats::{
    AGGREGATE_ID, AGGREGATE_TYPE, EVENT_ID, EVENT_TYPE, EVENT_VERSION, JetStreamPublisher,
};
use outbox_sqlx::Outbox;
use outbox_tests::pg::TestDb;
use outbox_tests::process::TestProcess;
use serde::{Deserialize, Serialize};
use sqlx::Postgres;
use uuid::Uuid;

const EVENTS: usize = 10_000;
const AGGREGATES: usize = 100;
const KILLS: usize = 10;

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order: Uuid,
    /// Its number within the aggregate, in commit order.
    seq: u32,
}

/// Shares every event on JetStream.
#[subscriber(events = [OrderPlaced], name = "jetstream")]
struct Broker(JetStreamPublisher);

impl<E: Sync> Handle<E> for Broker {
    async fn handle(&self, _: &E, delivery: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.publish(delivery).await
    }
}

#[router(events = [OrderPlaced])]
struct Shop {
    broker: Broker,
}

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned())
}

async fn jetstream() -> jetstream::Context {
    let client = async_nats::connect(nats_url()).await.unwrap_or_else(|error| {
        panic!(
            "no NATS server at {} ({error}): start nats-server with JetStream (-js), as .ci/run does",
            nats_url()
        )
    });
    jetstream::new(client)
}

/// The relay, when started by the test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the relay process of events_reach_jetstream_once_in_commit_order_though_the_relay_is_killed"]
async fn nats_relay_process() {
    let Ok(url) = std::env::var("OUTBOX_NATS_DATABASE") else {
        return;
    };
    let prefix = std::env::var("OUTBOX_NATS_PREFIX").unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .unwrap();
    let outbox: Outbox<Postgres, Shop> = Outbox::new(pool);
    let publisher = JetStreamPublisher::new(jetstream().await).with_subject_prefix(prefix);
    let relay = outbox
        .relay(
            Shop {
                broker: Broker(publisher),
            },
            // Short leases: the claims of a killed relay come back soon.
            RelayConfig::default()
                .with_lease(Duration::from_secs(2))
                .with_handler_timeout(Duration::from_millis(900))
                .with_poll_interval(Duration::from_millis(20))
                .with_retry(RetryPolicy::new([Duration::from_millis(50); 20]).unwrap()),
        )
        .unwrap();
    relay.run(std::future::pending()).await;
}

/// A stream of the test's own, deleted when dropped.
struct TestStream {
    jetstream: jetstream::Context,
    name: String,
    prefix: String,
}

impl TestStream {
    async fn new() -> Self {
        let jetstream = jetstream().await;
        let id = Uuid::new_v4().simple().to_string();
        let (name, prefix) = (format!("OUTBOX_TEST_{id}"), format!("t{id}"));
        outbox_nats::ensure_stream(
            &jetstream,
            outbox_nats::stream_config(name.clone(), [format!("{prefix}.>")]),
        )
        .await
        .unwrap();
        Self {
            jetstream,
            name,
            prefix,
        }
    }

    async fn messages(&self) -> u64 {
        let mut stream = self.jetstream.get_stream(&self.name).await.unwrap();
        stream.info().await.unwrap().state.messages
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let (jetstream, name) = (self.jetstream.clone(), self.name.clone());
        // Deleted on a runtime of its own: the test's may be shutting down.
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async { jetstream.delete_stream(&name).await.ok() });
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_jetstream_once_in_commit_order_though_the_relay_is_killed() {
    let stream = TestStream::new().await;
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Shop> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();

    // Commits of 100 events each, every aggregate's in its own order.
    let orders: Vec<Uuid> = (0..AGGREGATES).map(|_| Uuid::new_v4()).collect();
    let per_aggregate = EVENTS / AGGREGATES;
    for seq in 0..per_aggregate {
        let events: Vec<OrderPlaced> = orders
            .iter()
            .map(|&order| OrderPlaced {
                order,
                seq: u32::try_from(seq).unwrap(),
            })
            .collect();
        let mut tx = outbox.begin().await.unwrap();
        tx.publish_all(&events).await.unwrap();
        tx.commit().await.unwrap();
    }

    // The fault schedule: each relay runs for a random 100 to 600 ms, then dies.
    let url = db.url();
    for _ in 0..KILLS {
        let relay = TestProcess::start(
            "nats_relay_process",
            &[
                ("OUTBOX_NATS_DATABASE", &url),
                ("OUTBOX_NATS_PREFIX", &stream.prefix),
            ],
        );
        tokio::time::sleep(Duration::from_millis(fastrand::u64(100..600))).await;
        relay.kill();
    }
    let published_while_killing = stream.messages().await;
    let relay = TestProcess::start(
        "nats_relay_process",
        &[
            ("OUTBOX_NATS_DATABASE", &url),
            ("OUTBOX_NATS_PREFIX", &stream.prefix),
        ],
    );
    wait_until_delivered(&outbox, Duration::from_secs(120)).await;
    relay.kill();
    assert!(
        published_while_killing > 0,
        "the killed relays published nothing: the test would show nothing"
    );

    // The kills cut claims short: their events were published again, and JetStream dropped the
    // copies.
    let redelivered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events.outbox WHERE expired_claims > 0")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        stream.messages().await,
        EVENTS as u64,
        "no duplicate in the stream"
    );

    // Every message, in stream order: its headers, its body, and each aggregate's in commit order.
    let events: HashMap<i64, (Uuid, u32)> =
        sqlx::query_as::<_, (i64, String)>("SELECT id, payload::text FROM events.outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(id, payload)| {
                let event = outbox_core::decode::<OrderPlaced>(payload).unwrap().event;
                (id, (event.order, event.seq))
            })
            .collect();
    let js_stream = stream.jetstream.get_stream(&stream.name).await.unwrap();
    let mut last: HashMap<Uuid, (i64, u32)> = HashMap::new();
    for sequence in 1..=EVENTS as u64 {
        let message = js_stream.get_raw_message(sequence).await.unwrap();
        let header = |name: &str| {
            message
                .headers
                .get(name)
                .unwrap_or_else(|| panic!("message {sequence} has no {name}"))
                .as_str()
                .to_owned()
        };
        let id: i64 = header(EVENT_ID).parse().unwrap();
        assert_eq!(header("Nats-Msg-Id"), id.to_string());
        assert_eq!(header(EVENT_TYPE), "OrderPlaced");
        assert_eq!(header(EVENT_VERSION), "1");
        assert_eq!(header(AGGREGATE_TYPE), "order");
        let (order, seq) = events[&id];
        assert_eq!(header(AGGREGATE_ID), order.to_string());
        assert_eq!(
            message.subject.as_str(),
            format!("{}.order.OrderPlaced", stream.prefix)
        );
        let body = outbox_core::decode::<OrderPlaced>(&message.payload[..]).unwrap();
        assert_eq!((body.event.order, body.event.seq), (order, seq));
        if let Some(&(before, before_seq)) = last.get(&order) {
            assert!(
                before < id && before_seq + 1 == seq,
                "order {order}: event {id} (seq {seq}) after {before} (seq {before_seq})"
            );
        } else {
            assert_eq!(seq, 0, "order {order} starts with its first event");
        }
        last.insert(order, (id, seq));
    }
    assert_eq!(last.len(), AGGREGATES);
    println!(
        "{EVENTS} events over {AGGREGATES} aggregates, {KILLS} relays killed \
         ({published_while_killing} in the stream by then), {redelivered} events claimed again \
         after a kill; the stream holds each once, in commit order per aggregate"
    );
}

/// Waits until nothing is left to deliver and nothing is dead; panics after `limit`.
async fn wait_until_delivered(outbox: &Outbox<Postgres, Shop>, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let status = outbox.status().await.unwrap();
        if status.pending_events == 0 && status.pending_deliveries == 0 {
            assert_eq!(status.dead_letters, 0, "{status:?}");
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered in {limit:?}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs a relay in this process until everything is delivered.
async fn relay_until_delivered(outbox: &Outbox<Postgres, Shop>, publisher: JetStreamPublisher) {
    let relay = outbox
        .relay(
            Shop {
                broker: Broker(publisher),
            },
            RelayConfig::default().with_poll_interval(Duration::from_millis(20)),
        )
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                stopped.await.ok();
            })
            .await;
    });
    wait_until_delivered(outbox, Duration::from_secs(60)).await;
    stop.send(()).unwrap();
    running.await.unwrap();
}

/// nats-py, installed once into the target directory.
fn nats_py() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("nats-py-2.16.0");
    if !dir.join("nats").is_dir() {
        let status = Command::new("python3")
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg("--target")
            .arg(&dir)
            .arg("nats-py==2.16.0")
            .status()
            .expect("python3 runs");
        assert!(status.success(), "pip could not install nats-py");
    }
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_this_project_did_not_write_reads_the_stream_as_promised() {
    const ORDERS: usize = 10;
    const PER_ORDER: usize = 100;
    let stream = TestStream::new().await;
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Shop> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let orders: Vec<Uuid> = (0..ORDERS).map(|_| Uuid::new_v4()).collect();
    for seq in 0..PER_ORDER {
        let mut tx = outbox.begin().await.unwrap();
        // Half the commits belong to a business flow: their correlation id travels too.
        if seq % 2 == 0 {
            tx.set_metadata(outbox_core::Metadata::new().with_correlation_id(Uuid::new_v4()));
        }
        for &order in &orders {
            let seq = u32::try_from(seq).unwrap();
            tx.publish(&OrderPlaced { order, seq }).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let publisher = JetStreamPublisher::new(jetstream().await).with_subject_prefix(&stream.prefix);
    relay_until_delivered(&outbox, publisher).await;

    let url = nats_url();
    let url = if url.contains("://") {
        url
    } else {
        format!("nats://{url}")
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/check_stream.py");
    let output = Command::new("python3")
        .arg(script)
        .args([
            url.as_str(),
            stream.name.as_str(),
            stream.prefix.as_str(),
            &(ORDERS * PER_ORDER).to_string(),
        ])
        .env("PYTHONPATH", nats_py())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "nats-py found a fault: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        summary,
        serde_json::json!({
            "ok": true, "messages": ORDERS * PER_ORDER, "aggregates": ORDERS, "versions": [1]
        })
    );
}

/// A nats-server of the test's own, on a free port, storing JetStream data in a directory that
/// outlives its restarts.
struct PrivateNats {
    port: u16,
    store: tempfile::TempDir,
    process: Option<Child>,
}

impl PrivateNats {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = Self {
            port,
            store: tempfile::tempdir().unwrap(),
            process: None,
        };
        server.up();
        server
    }

    fn url(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the server and waits until it takes connections.
    fn up(&mut self) {
        let child = Command::new("nats-server")
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server runs (Debian's nats-server package)");
        self.process = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: the broker vanishes.
    fn kill(&mut self) {
        if let Some(mut child) = self.process.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_down_for_ten_seconds_loses_nothing_and_doubles_nothing() {
    const ORDERS: usize = 20;
    let mut nats = PrivateNats::start();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(nats.url())
        .await
        .unwrap();
    let jetstream = jetstream::new(client);
    outbox_nats::ensure_stream(
        &jetstream,
        outbox_nats::stream_config("ORDERS", ["outbox.>"]),
    )
    .await
    .unwrap();
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Shop> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let relay = outbox
        .relay(
            Shop {
                broker: Broker(JetStreamPublisher::new(jetstream.clone())),
            },
            RelayConfig::default()
                .with_poll_interval(Duration::from_millis(20))
                // Failures while the broker is away are retried every 500 ms, for 50 s.
                .with_retry(RetryPolicy::new([Duration::from_millis(500); 100]).unwrap()),
        )
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                stopped.await.ok();
            })
            .await;
    });

    // Producers commit one event per order every 20 ms, before, during and after the outage.
    let orders: Vec<Uuid> = (0..ORDERS).map(|_| Uuid::new_v4()).collect();
    let producing = {
        let (outbox, orders) = (outbox.clone(), orders.clone());
        tokio::spawn(async move {
            let mut seq = 0_u32;
            let start = tokio::time::Instant::now();
            while start.elapsed() < Duration::from_secs(14) {
                let mut tx = outbox.begin().await.unwrap();
                for &order in &orders {
                    tx.publish(&OrderPlaced { order, seq }).await.unwrap();
                }
                tx.commit().await.unwrap();
                seq += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seq
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut before_outage = jetstream.get_stream("ORDERS").await.unwrap();
    let stored_before = before_outage.info().await.unwrap().state.messages;
    nats.kill();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let status = outbox.status().await.unwrap();
    let pending_during_outage = status.pending_events + status.pending_deliveries;
    nats.up();
    let rounds = producing.await.unwrap() as usize;
    wait_until_delivered(&outbox, Duration::from_secs(60)).await;
    stop.send(()).unwrap();
    running.await.unwrap();

    let events = ORDERS * rounds;
    let stream = jetstream.get_stream("ORDERS").await.unwrap();
    let mut stored = stream.clone();
    assert_eq!(
        stored.info().await.unwrap().state.messages,
        events as u64,
        "each event once in the stream"
    );
    let mut next: HashMap<Uuid, u32> = HashMap::new();
    for sequence in 1..=events as u64 {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let body = outbox_core::decode::<OrderPlaced>(&message.payload[..]).unwrap();
        let expected = next.entry(body.event.order).or_insert(0);
        assert_eq!(body.event.seq, *expected, "order {}", body.event.order);
        *expected += 1;
    }
    assert!(stored_before > 0 && pending_during_outage > 0);
    println!(
        "{events} events: {stored_before} in the stream before the outage, {pending_during_outage} \
         events or deliveries waiting when the broker came back; each once after, in order per aggregate"
    );
}

/// The consuming service's subscriber: applies each order to its ledger exactly once
/// (`handle_once`: the effect and the inbox record in one transaction), and logs every call.
#[subscriber(events = [OrderPlaced], name = "ledger")]
struct Ledger {
    outbox: Outbox<Postgres, Books>,
}

impl Handle<OrderPlaced> for Ledger {
    async fn handle(
        &self,
        event: &OrderPlaced,
        delivery: &Delivery<'_>,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO calls (event_id) VALUES ($1)")
            .bind(delivery.event().id)
            .execute(self.outbox.pool())
            .await?;
        // Some first attempts fail: the message comes again after the retry delay.
        if delivery.attempt() == 1 && event.seq % 7 == 3 {
            return Err(HandlerError::transient("scripted failure"));
        }
        self.outbox
            .handle_once(delivery, |mut tx| async move {
                sqlx::query("INSERT INTO ledger (event_id, order_id, seq) VALUES ($1, $2, $3)")
                    .bind(delivery.event().id)
                    .bind(event.order)
                    .bind(i64::from(event.seq))
                    .execute(&mut *tx)
                    .await?;
                Ok(tx)
            })
            .await?;
        let id = delivery.event().id;
        if delivery.attempt() == 1 && event.seq % 7 == 5 {
            // Committed, but the acknowledgement is lost: the message comes again.
            return Err(HandlerError::transient("scripted: the ack is lost"));
        }
        if delivery.attempt() == 1 && id % 97 == 0 {
            // Committed, then slower than the consumer's AckWait: the server sends it again.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        Ok(())
    }
}

#[router(events = [OrderPlaced], database = sqlx::Postgres)]
struct Books {
    ledger: Ledger,
}

/// The consuming service, when started by the test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the consumer process of a_consumer_applies_each_event_once_in_order_though_killed"]
async fn nats_consumer_process() {
    let Ok(url) = std::env::var("OUTBOX_NATS_CONSUMER_DATABASE") else {
        return;
    };
    let stream_name = std::env::var("OUTBOX_NATS_STREAM").unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let outbox: Outbox<Postgres, Books> = Outbox::new(pool);
    let jetstream = jetstream().await;
    let stream = jetstream.get_stream(&stream_name).await.unwrap();
    let consumer = stream
        .get_consumer::<jetstream::consumer::pull::Config>("books")
        .await
        .unwrap();
    let consumer = outbox_nats::JetStreamConsumer::new(
        consumer,
        Books {
            ledger: Ledger { outbox },
        },
    )
    .with_retry_delay(Duration::from_millis(50));
    consumer.run(std::future::pending()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_applies_each_event_once_in_order_though_killed() {
    const ORDERS: usize = 20;
    const PER_ORDER: usize = 25;
    let stream = TestStream::new().await;

    // The producing service fills the stream.
    let producer_db = TestDb::new().await;
    let producer: Outbox<Postgres, Shop> = Outbox::new(producer_db.pool.clone());
    producer.migrate().await.unwrap();
    let orders: Vec<Uuid> = (0..ORDERS).map(|_| Uuid::new_v4()).collect();
    for seq in 0..PER_ORDER {
        let mut tx = producer.begin().await.unwrap();
        for &order in &orders {
            let seq = u32::try_from(seq).unwrap();
            tx.publish(&OrderPlaced { order, seq }).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let publisher = JetStreamPublisher::new(jetstream().await).with_subject_prefix(&stream.prefix);
    relay_until_delivered(&producer, publisher).await;
    let events = ORDERS * PER_ORDER;

    // The consuming service: its own database, its durable consumer (a message not acknowledged
    // within a second comes again).
    let db = TestDb::new().await;
    Outbox::<Postgres, Books>::new(db.pool.clone())
        .migrate()
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE ledger (n BIGSERIAL, event_id BIGINT PRIMARY KEY, order_id UUID NOT NULL,
                              seq BIGINT NOT NULL);
         CREATE TABLE calls (event_id BIGINT NOT NULL);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let js_stream = stream.jetstream.get_stream(&stream.name).await.unwrap();
    js_stream
        .create_consumer(outbox_nats::consumer_config(
            "books",
            &format!("{}.>", stream.prefix),
            Duration::from_secs(1),
        ))
        .await
        .unwrap();
    let start = |url: &str| {
        TestProcess::start(
            "nats_consumer_process",
            &[
                ("OUTBOX_NATS_CONSUMER_DATABASE", url),
                ("OUTBOX_NATS_STREAM", &stream.name),
            ],
        )
    };
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let url = db.url();
    for _ in 0..5 {
        let consumer = start(&url);
        tokio::time::sleep(Duration::from_millis(fastrand::u64(200..600))).await;
        consumer.kill();
    }
    let applied_while_killing = count("SELECT count(*) FROM ledger").await;
    let consumer = start(&url);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while count("SELECT count(*) FROM ledger").await < events as i64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not consumed in 90 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.kill();

    // Exactly one effect per event (the primary key would have refused a second), one inbox
    // record each, and each order's effects in commit order.
    assert_eq!(count("SELECT count(*) FROM ledger").await, events as i64);
    assert_eq!(
        count("SELECT count(*) FROM events.outbox_inbox").await,
        events as i64
    );
    let rows: Vec<(Uuid, i64)> = sqlx::query_as("SELECT order_id, seq FROM ledger ORDER BY n")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut next: HashMap<Uuid, i64> = HashMap::new();
    for (order, seq) in rows {
        let expected = next.entry(order).or_insert(0);
        assert_eq!(seq, *expected, "order {order}");
        *expected += 1;
    }
    let calls = count("SELECT count(*) FROM calls").await;
    // Every event with a scripted failure or a lost ack came at least twice.
    let scripted = (0..PER_ORDER).filter(|s| s % 7 == 3 || s % 7 == 5).count() * ORDERS;
    assert!(
        calls >= (events + scripted) as i64,
        "messages came again: {calls} calls for {events} events"
    );
    assert!(
        applied_while_killing > 0,
        "the killed consumers applied nothing"
    );
    println!(
        "{events} events consumed by 6 consumer processes (5 killed, {applied_while_killing} \
         applied by then): {calls} handler calls, one effect each, in order per order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_example_carries_each_order_to_the_shipping_service_once() {
    let dir = tempfile::tempdir().unwrap();
    let crossed = outbox_examples::orders::run(&nats_url(), dir.path())
        .await
        .unwrap();
    assert_eq!(
        crossed,
        outbox_examples::orders::Crossed {
            orders: 3,
            messages: 3,
            shipments: 3
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_is_a_transient_error_that_says_so() {
    use outbox_tests::backend::TestBackend;
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, Shop> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let mut tx = outbox.begin().await.unwrap();
    let order = Uuid::new_v4();
    tx.publish(&OrderPlaced { order, seq: 0 }).await.unwrap();
    tx.commit().await.unwrap();
    let id = <Postgres as TestBackend>::events(&db.pool).await[0].id;

    // No stream takes the subjects yet.
    let jetstream = jetstream().await;
    let prefix = format!("nostream{}", Uuid::new_v4().simple());
    let relay = outbox
        .relay(
            Shop {
                broker: Broker(
                    JetStreamPublisher::new(jetstream.clone()).with_subject_prefix(&prefix),
                ),
            },
            RelayConfig::default()
                .with_retry_in_place(Duration::ZERO)
                .with_retry(RetryPolicy::new([Duration::from_millis(10); 5]).unwrap()),
        )
        .unwrap();
    let report = relay.run_once().await.unwrap();
    assert_eq!(report.retried, 1, "{report:?}");
    let row = <Postgres as TestBackend>::delivery(&db.pool, "jetstream", id)
        .await
        .expect("a delivery row for the retry");
    let error = row.last_error.unwrap();
    assert!(
        error.contains("no JetStream stream takes the subject")
            && error.contains(&format!("{prefix}.order.OrderPlaced")),
        "{error}"
    );

    // Once the stream exists, the retry goes through.
    let name = format!("OUTBOX_TEST_{}", Uuid::new_v4().simple());
    outbox_nats::ensure_stream(
        &jetstream,
        outbox_nats::stream_config(name.clone(), [format!("{prefix}.>")]),
    )
    .await
    .unwrap();
    // (The retry is due 10 ms after the failure: batches until it is made.)
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let report = relay.run_once().await.unwrap();
        if report.delivered == 1 {
            break;
        }
        assert_eq!(report.retried, 0, "the retry failed again: {report:?}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the retry never came"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut stream = jetstream.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    jetstream.delete_stream(&name).await.unwrap();
}

/// A stored `OrderPlaced`, as a relay would hand it to a subscriber.
fn stored_order(id: i64, order: Uuid, seq: u32) -> outbox_core::StoredEvent {
    outbox_core::StoredEvent {
        id,
        aggregate_type: "order".to_owned(),
        aggregate_id: order,
        event_type: "OrderPlaced".to_owned(),
        payload: outbox_core::encode(&OrderPlaced { order, seq }, &outbox_core::Metadata::new())
            .unwrap(),
        occurred_at: time::OffsetDateTime::now_utc(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_a_server_would_refuse_is_a_permanent_error_that_says_why() {
    let publisher = JetStreamPublisher::new(jetstream().await)
        .with_subject(|event| format!("orders.{} placed", event.aggregate_id));
    let event = stored_order(7, Uuid::nil(), 0);
    let metadata = outbox_core::Metadata::new();
    let error = publisher
        .publish(&Delivery::new(&event, &metadata, "jetstream", 1))
        .await
        .unwrap_err();
    assert!(!error.is_transient(), "no retry makes that subject valid");
    assert_eq!(
        error.error().to_string(),
        "event 7 (OrderPlaced) cannot be published on the NATS subject \
         \"orders.00000000-0000-0000-0000-000000000000 placed\": it holds whitespace or a \
         control character; choose another with JetStreamPublisher::with_subject"
    );
}

/// Records the orders a consumer hands it.
#[subscriber(events = [OrderPlaced], name = "watcher")]
struct Watcher(std::sync::Arc<std::sync::Mutex<Vec<(Uuid, u32)>>>);

impl Handle<OrderPlaced> for Watcher {
    async fn handle(&self, event: &OrderPlaced, _: &Delivery<'_>) -> Result<(), HandlerError> {
        self.0.lock().unwrap().push((event.order, event.seq));
        Ok(())
    }
}

#[router(events = [OrderPlaced])]
struct Watching {
    watcher: Watcher,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_is_not_an_outbox_event_is_set_aside_and_the_next_one_delivered() {
    let stream = TestStream::new().await;
    let subject = format!("{}.order.OrderPlaced", stream.prefix);
    // Something other than a relay wrote to the stream: no headers, not an envelope.
    stream
        .jetstream
        .publish(subject.clone(), "hello".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let order = Uuid::new_v4();
    let publisher =
        JetStreamPublisher::new(stream.jetstream.clone()).with_subject_prefix(&stream.prefix);
    let event = stored_order(1, order, 0);
    let metadata = outbox_core::Metadata::new();
    publisher
        .publish(&Delivery::new(&event, &metadata, "jetstream", 1))
        .await
        .unwrap();

    let js_stream = stream.jetstream.get_stream(&stream.name).await.unwrap();
    let durable = js_stream
        .create_consumer(outbox_nats::consumer_config(
            "watching",
            &format!("{}.>", stream.prefix),
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    let seen = std::sync::Arc::default();
    let consumer = outbox_nats::JetStreamConsumer::new(
        durable,
        Watching {
            watcher: Watcher(std::sync::Arc::clone(&seen)),
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        consumer
            .run(async {
                stopped.await.ok();
            })
            .await
    });
    let watched = std::sync::Arc::clone(&seen);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while watched.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the event behind the stray message never came"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    assert_eq!(*seen.lock().unwrap(), [(order, 0)]);
    // The stray message was terminated for this consumer, not lost: it is still in the stream.
    assert_eq!(stream.messages().await, 2);
}
