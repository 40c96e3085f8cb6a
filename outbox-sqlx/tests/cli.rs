//! The `outbox` binary against a real PostgreSQL: every subcommand, in tables and in JSON, bad
//! arguments, and databases it cannot use; and on SQLite and MySQL.

use std::process::{Command, Output};
use std::time::Duration;

use outbox_core::{Relay, RelayConfig};
use outbox_sqlx::Outbox;
use outbox_tests::kit::{Fail, OnlyX, Ping, PingPong, Probe, XAndY, run_idle, run_until, wait_for};
use outbox_tests::my::TestMyDb;
use outbox_tests::pg::{TestDb, publish_for_operators};
use serde_json::{Value, json};
use sqlx::{MySql, Postgres};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

/// Runs the binary with `args` and no `DATABASE_URL` from the environment.
fn outbox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("the outbox binary runs")
}

/// Runs the binary on `db`, or on no database; returns its output.
fn on(db: Option<&TestDb>, args: &[&str]) -> Output {
    match db.map(TestDb::url) {
        Some(url) => outbox(&[&["--database-url", url.as_str()], args].concat()),
        None => outbox(args),
    }
}

/// Runs the binary on `db`; asserts it succeeds and returns its standard output.
fn ok(db: &TestDb, args: &[&str]) -> String {
    let output = on(Some(db), args);
    assert!(
        output.status.success(),
        "outbox {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Runs the binary on `db` with `--json`; asserts it succeeds and returns what it printed.
fn json_of(db: &TestDb, args: &[&str]) -> Value {
    serde_json::from_str(&ok(db, &[args, &["--json"]].concat())).expect("JSON output")
}

/// Runs the binary on `db` (or none); asserts it exits with `code` and returns its standard
/// error.
fn fails(db: Option<&TestDb>, args: &[&str], code: i32) -> String {
    let output = on(db, args);
    assert_eq!(
        output.status.code(),
        Some(code),
        "outbox {args:?}: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8(output.stderr).unwrap()
}

/// A database migrated by the binary, holding: a `Ping` delivered to both subscribers, one
/// whose delivery to `y` is dead, one that never decodes (dead), and a `Pong` parked (this relay
/// does not route it). Returns the database and the ids of (delivered, dead delivery, dead event).
async fn scenario() -> (TestDb, [i64; 3]) {
    let db = TestDb::new().await;
    assert!(ok(&db, &["migrate"]).contains("up to date"));
    let outbox: Outbox<Postgres, PingPong> = Outbox::new(db.pool.clone());
    let probe = Probe::default();
    publish_for_operators(&outbox, &probe).await;
    let raw: i64 = sqlx::query_scalar(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('probe', $1, 'Ping', '{\"version\": 1}') RETURNING id",
    )
    .bind(Uuid::new_v4())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let relay = Relay::new(outbox.store(), XAndY::new(&probe), RelayConfig::default()).unwrap();
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM events.outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    (db, [ids[0], ids[1], raw])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_dead_letters_show_what_is_left_in_tables_and_json() {
    let (db, [_, doomed, raw]) = scenario().await;

    let status = json_of(&db, &["status"]);
    assert_eq!(status["pending_events"], 1, "{status}");
    assert_eq!(status["pending_deliveries"], 0, "{status}");
    assert_eq!(status["dead_letters"], 2, "{status}");
    assert_eq!(status["blocked_keys"], 1, "{status}");
    // The parked Pong's aggregate and the dead event's.
    assert_eq!(status["blocked_aggregates"], 2, "{status}");
    assert_eq!(status["held_events"], 0, "{status}");
    // Nothing waits behind the dead letters, but the parked Pong is work left to do.
    assert_eq!(status["behind_dead_letters"], 0, "{status}");
    assert_eq!(status["settled"], false, "{status}");
    // The relay that ran is registered (for 30 s): the parked Pong is what no running relay
    // routes.
    assert_eq!(status["live_relays"], 1, "{status}");
    assert_eq!(status["unroutable_events"], 1, "{status}");
    assert_eq!(status["unroutable_deliveries"], 0, "{status}");
    assert!(status["oldest_unroutable_age_seconds"].as_f64().unwrap() > 0.0);
    let age = status["oldest_pending_age_seconds"].as_f64().unwrap();
    assert!(age > 0.0 && age < WAIT.as_secs_f64(), "{status}");
    assert_eq!(
        status["subscribers"],
        json!([{"subscriber": "y", "pending": 0, "dead": 1, "blocked_keys": 1}])
    );
    // Every state counted, and what holds what back: the parked Pong blocks its aggregate,
    // the dead event its own, y's dead delivery its key.
    assert_eq!(
        status["states"],
        json!({"pending": 0, "claimed": 0, "parked": 1, "held": 0, "retrying": 0,
               "waiting": 0, "dead": 2, "skipped": 0}),
        "{status}"
    );
    assert_eq!(
        status["held_back"],
        json!([
            {"cause": "dead event", "blocks": "aggregates", "blocked": 1, "waiting": 0},
            {"cause": "parked event", "blocks": "aggregates", "blocked": 1, "waiting": 0},
            {"cause": "dead delivery", "blocks": "keys", "blocked": 1, "waiting": 0},
        ]),
        "{status}"
    );
    let table = ok(&db, &["status"]);
    assert!(table.contains("parked    1\n"), "{table}");
    assert!(
        table.contains("HELD BACK BY   BLOCKS       WAITING BEHIND\n"),
        "{table}"
    );
    assert!(table.contains("parked event   1 aggregate  0\n"), "{table}");
    assert!(table.contains("dead letters         2\n"), "{table}");
    assert!(table.contains("blocked aggregates   2\n"), "{table}");
    assert!(
        table.contains("unroutable           1 events, 0 deliveries, oldest "),
        "{table}"
    );
    assert!(
        table.contains("SUBSCRIBER  PENDING  DEAD  BLOCKED KEYS\n"),
        "{table}"
    );
    assert!(
        table.lines().any(|l| l == "y           0        1     1"),
        "{table}"
    );

    let all = json_of(&db, &["dead-letters", "list"]);
    let ids: Vec<(i64, Value)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["event_id"].as_i64().unwrap(), d["subscriber"].clone()))
        .collect();
    assert_eq!(ids, [(doomed, Value::from("y")), (raw, Value::Null)]);
    let of_y = json_of(&db, &["dead-letters", "list", "--subscriber", "y"]);
    assert_eq!(of_y.as_array().unwrap().len(), 1, "{of_y}");
    assert_eq!(
        of_y[0]["last_error"],
        "permanent error: scripted permanent failure"
    );
    let pongs = json_of(&db, &["dead-letters", "list", "--event-type", "Pong"]);
    assert_eq!(pongs, json!([]));
    // Each state by name, with its filters.
    let rows = |args: &[&str]| -> Vec<(i64, Value)> {
        json_of(&db, &[&["list"], args].concat())
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["event_id"].as_i64().unwrap(), r["subscriber"].clone()))
            .collect()
    };
    let parked = json_of(&db, &["list", "--state", "parked"]);
    assert_eq!(parked.as_array().unwrap().len(), 1, "{parked}");
    assert_eq!(parked[0]["event_type"], "Pong", "{parked}");
    assert!(
        parked[0]["payload"]
            .as_str()
            .unwrap()
            .contains("\"version\"")
    );
    let pong = parked[0]["aggregate_id"].as_str().unwrap().to_owned();
    assert_eq!(rows(&["--state", "parked", "--event-type", "Ping"]), []);
    assert_eq!(rows(&["--state", "parked", "--aggregate", &pong]).len(), 1);
    assert_eq!(
        rows(&["--state", "dead", "--subscriber", "y"]),
        [(doomed, Value::from("y"))]
    );
    assert_eq!(
        rows(&["--state", "dead", "--event-type", "Ping", "--limit", "1"]),
        [(doomed, Value::from("y"))]
    );
    assert_eq!(
        rows(&["--state", "dead", "--after", &format!("{doomed}/y")]),
        [(raw, Value::Null)]
    );
    for state in [
        "pending", "claimed", "held", "retrying", "waiting", "skipped",
    ] {
        assert_eq!(rows(&["--state", state]), [], "{state}");
    }
    let table = ok(&db, &["list", "--state", "parked"]);
    assert!(table.contains("Pong"), "{table}");
    assert_eq!(ok(&db, &["list", "--state", "held"]), "nothing held\n");
    let table = ok(&db, &["dead-letters", "list"]);
    assert!(
        table.starts_with("EVENT  SUBSCRIBER  EVENT TYPE"),
        "{table}"
    );
    assert!(table.contains("(all)"), "{table}");
    assert_eq!(table.lines().count(), 3, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_grouped_by_failure_one_line_per_cause() {
    let db = TestDb::new().await;
    ok(&db, &["migrate"]);
    let outbox: Outbox<Postgres, PingPong> = Outbox::new(db.pool.clone());
    let probe = Probe::default();
    // One bad deploy of `y`: 50 dead deliveries for one cause; `x` fails 5; 3 events never
    // decode.
    for n in 0..50 {
        let aggregate = Uuid::new_v4();
        probe.fail("y", aggregate, 1, [Fail::Permanent]);
        if n < 5 {
            probe.fail("x", aggregate, 1, [Fail::Permanent]);
        }
        let mut tx = outbox.begin().await.unwrap();
        tx.publish(&Ping { aggregate, seq: 1 }).await.unwrap();
        tx.commit().await.unwrap();
    }
    for _ in 0..3 {
        sqlx::query(
            "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('probe', $1, 'Ping', '{\"version\": 1}')",
        )
        .bind(Uuid::new_v4())
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let relay = Relay::new(outbox.store(), XAndY::new(&probe), RelayConfig::default()).unwrap();
    run_until(&relay, WAIT, || probe.calls_of("y").len() == 50).await;
    let deadline = std::time::Instant::now() + WAIT;
    while outbox.status().await.unwrap().dead_letters < 58 {
        assert!(
            std::time::Instant::now() < deadline,
            "the dead letters were not recorded"
        );
        relay.run_once().await.unwrap();
    }

    let groups = json_of(&db, &["dead-letters", "groups"]);
    let rows: Vec<(Value, String, u64)> = groups
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["subscriber"].clone(),
                g["kind"].as_str().unwrap().to_owned(),
                g["dead"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            (Value::from("y"), "permanent".to_owned(), 50),
            (Value::from("x"), "permanent".to_owned(), 5),
            (Value::Null, "undecodable".to_owned(), 3),
        ]
    );
    assert_eq!(
        groups[0]["first_line"],
        "permanent error: scripted permanent failure"
    );
    let table = ok(&db, &["dead-letters", "groups"]);
    assert!(table.starts_with("DEAD  SUBSCRIBER  KIND"), "{table}");
    assert_eq!(table.lines().count(), 4, "{table}");
    // Whole first lines: what `requeue --failure` takes. One group goes back, the others stay.
    assert!(
        table.contains("permanent error: scripted permanent failure\n"),
        "{table}"
    );
    let line = "permanent error: scripted permanent failure";
    assert_eq!(
        json_of(
            &db,
            &[
                "requeue",
                "--subscriber",
                "y",
                "--failure",
                line,
                "--reason",
                "fixed in 1.4.2"
            ]
        ),
        json!({"requeued": 50})
    );
    let recorded: Vec<(Option<String>, Option<String>, i64, String)> = sqlx::query_as(
        "SELECT subscriber, first_line, requeued, reason FROM events.outbox_requeues",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        recorded,
        [(
            Some("y".to_owned()),
            Some(line.to_owned()),
            50,
            "fixed in 1.4.2".to_owned()
        )]
    );
    let stderr = fails(
        Some(&db),
        &["requeue", "--subscriber", "x", "--reason", " "],
        2,
    );
    assert!(stderr.contains("--reason is empty"), "{stderr}");
    let history = json_of(&db, &["requeues"]);
    assert_eq!(history.as_array().unwrap().len(), 1, "{history}");
    assert_eq!(
        (
            &history[0]["subscriber"],
            &history[0]["requeued"],
            &history[0]["reason"]
        ),
        (&json!("y"), &json!(50), &json!("fixed in 1.4.2"))
    );
    assert!(
        history[0]["requeued_at"].as_str().unwrap().ends_with('Z'),
        "{history}"
    );
    let table = ok(&db, &["requeues"]);
    assert!(table.starts_with("ID  AT"), "{table}");
    assert!(
        table.contains("y: permanent error: scripted permanent failure"),
        "{table}"
    );
    let stderr = fails(
        Some(&db),
        &["requeue", "--subscriber", "y", "--failure", line],
        1,
    );
    assert!(
        stderr.contains("nothing to requeue: no dead letter of `y` has the error"),
        "{stderr}"
    );
    let left = json_of(&db, &["dead-letters", "groups"]);
    let left: Vec<Value> = left
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["subscriber"].clone())
        .collect();
    assert_eq!(left, [Value::from("x"), Value::Null]);
    let stderr = fails(Some(&db), &["requeue", "1", "--failure", line], 2);
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_dead_letters_are_listed_a_page_at_a_time() {
    const DEAD: usize = 100_000;
    const PAGE: usize = 10_000;
    let db = TestDb::new().await;
    ok(&db, &["migrate"]);
    sqlx::query(
        "INSERT INTO events.outbox
             (aggregate_type, aggregate_id, event_type, payload, dead_at, last_error)
         SELECT 'probe', gen_random_uuid(), 'Ping', '{}', now(), 'broken'
         FROM generate_series(1, $1)",
    )
    .bind(i32::try_from(DEAD).unwrap())
    .execute(&db.pool)
    .await
    .unwrap();
    // Each page is one query with a LIMIT: the tool holds a page, never the whole list.
    let limit = PAGE.to_string();
    let (mut seen, mut pages, mut after): (Vec<i64>, usize, Option<String>) = (Vec::new(), 0, None);
    loop {
        let mut args = vec!["list", "--state", "dead", "--limit", &limit];
        if let Some(after) = &after {
            args.extend(["--after", after]);
        }
        let page = json_of(&db, &args);
        let ids: Vec<i64> = page
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row["event_id"].as_i64().unwrap())
            .collect();
        assert!(ids.len() <= PAGE);
        let Some(last) = ids.last() else { break };
        after = Some(last.to_string());
        seen.extend(ids);
        pages += 1;
    }
    assert_eq!((seen.len(), pages), (DEAD, DEAD / PAGE));
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "in event id order, no repeats"
    );
    // A full page in a table says where the next one starts.
    let table = ok(&db, &["list", "--state", "dead", "--limit", "2"]);
    assert_eq!(table.lines().count(), 4, "{table}");
    assert_eq!(
        table.lines().last().unwrap(),
        format!("more: --after {}", seen[1])
    );
    let stderr = fails(Some(&db), &["list", "--state", "lost"], 2);
    assert!(
        stderr.contains("unknown state `lost`: expected one of pending, claimed, parked"),
        "{stderr}"
    );
    let stderr = fails(Some(&db), &["list", "--state", "dead", "--after", "x/y"], 2);
    assert!(
        stderr.contains("invalid value 'x/y' for '--after <AFTER>': `x/y`: expected an event id"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_skip_and_purge_change_the_outbox_and_say_so() {
    let (db, [delivered, doomed, raw]) = scenario().await;
    let (doomed_id, raw_id) = (doomed.to_string(), raw.to_string());

    assert_eq!(
        ok(&db, &["requeue", &doomed_id]),
        "requeued 1 dead letters\n"
    );
    let status = json_of(&db, &["status"]);
    assert_eq!(status["dead_letters"], 1, "{status}");
    assert_eq!(status["pending_deliveries"], 1, "{status}");
    let stderr = fails(Some(&db), &["requeue", &delivered.to_string()], 1);
    assert!(stderr.contains("nothing to requeue"), "{stderr}");
    // Nothing to requeue exits 1, for a subscriber as for event ids; a misspelt subscriber
    // is told which subscribers have deliveries.
    let stderr = fails(Some(&db), &["requeue", "--subscriber", "y"], 1);
    assert!(
        stderr.contains("nothing to requeue: subscriber `y` has no dead deliveries"),
        "{stderr}"
    );
    let stderr = fails(Some(&db), &["requeue", "--subscriber", "yy"], 1);
    assert!(
        stderr.contains("nothing to requeue: subscriber `yy` has no dead deliveries")
            && stderr.contains("subscribers with deliveries: y"),
        "{stderr}"
    );

    let skip_y = [
        "skip",
        &doomed_id,
        "--subscriber",
        "y",
        "--reason",
        "done by hand",
    ];
    assert_eq!(
        ok(&db, &skip_y),
        format!("skipped the delivery of event {doomed} to `y`\n")
    );
    let stderr = fails(Some(&db), &skip_y, 1);
    assert!(stderr.contains("cannot skip"), "{stderr}");
    ok(&db, &["skip", &raw_id, "--reason", "bad payload"]);
    let skips: Vec<(i64, Option<String>, String)> = sqlx::query_as(
        "SELECT event_id, subscriber, reason FROM events.outbox_skips ORDER BY event_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        skips,
        [
            (doomed, Some("y".to_owned()), "done by hand".to_owned()),
            (raw, None, "bad payload".to_owned())
        ]
    );
    let status = json_of(&db, &["status"]);
    assert_eq!(status["dead_letters"], 0, "{status}");
    assert_eq!(status["blocked_keys"], 0, "{status}");

    assert_eq!(
        ok(&db, &["purge", "--published-before", "1d"]),
        "purged 0 published events\n"
    );
    let stderr = fails(
        Some(&db),
        &["purge", "--published-before", "2999-01-01T00:00:00Z"],
        2,
    );
    assert!(stderr.contains("is in the future"), "{stderr}");
    // Everything but the parked Pong is published now.
    assert_eq!(
        json_of(
            &db,
            &["purge", "--published-before", "0s", "--batch-size", "2"]
        ),
        json!({"purged": 3})
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM events.outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 1);
}

/// The tool runs in a process of its own and exits when done: what it hands back (a requeue, a
/// skip that frees the events behind a dead delivery) wakes a relay of another process that
/// waits for work, at once, not at its next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_or_a_skip_by_the_tool_wakes_a_waiting_relay_at_once() {
    let db = TestDb::new().await;
    assert!(ok(&db, &["migrate"]).contains("up to date"));
    let outbox: Outbox<Postgres, PingPong> = Outbox::new(db.pool_named("relay_process", 4).await);
    let probe = Probe::default();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    probe.fail("x", a, 1, [Fail::Permanent]);
    probe.fail("x", b, 1, [Fail::Permanent]);
    for (aggregate, seq) in [(a, 1), (b, 1), (b, 2)] {
        let mut tx = outbox.begin().await.unwrap();
        tx.publish(&Ping { aggregate, seq }).await.unwrap();
        tx.commit().await.unwrap();
    }
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM events.outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let quick = Relay::new(outbox.store(), OnlyX::new(&probe), RelayConfig::default()).unwrap();
    run_until(&quick, WAIT, || probe.calls_of("x").len() == 2).await;
    // A relay that polls once an hour, waiting for work: its claim found nothing, and it
    // listens for the database's notifications.
    let sleepy = RelayConfig::default().with_poll_interval(Duration::from_secs(3600));
    let waiting_relay = async || {
        let running = run_idle(outbox.store(), OnlyX::new(&probe), sleepy.clone()).await;
        db.wait_until_listening("relay_process").await;
        running
    };
    let running = waiting_relay().await;
    ok(&db, &["requeue", &ids[0].to_string()]);
    wait_for(|| probe.delivered_to("x") == [(a, 1)]).await;
    running.stop().await;
    let running = waiting_relay().await;
    let b1 = ids[1].to_string();
    ok(
        &db,
        &["skip", &b1, "--subscriber", "x", "--reason", "by hand"],
    );
    wait_for(|| probe.delivered_to("x") == [(a, 1), (b, 2)]).await;
    running.stop().await;
}

#[test]
fn bad_arguments_are_usage_errors_with_exit_code_2() {
    for (args, expected) in [
        (&[][..], "Usage"),
        (&["requeue"][..], "required"),
        (
            &["requeue", "1", "--subscriber", "y"][..],
            "cannot be used with",
        ),
        (&["skip", "abc", "--reason", "r"][..], "invalid digit"),
        (&["skip", "1"][..], "--reason"),
        (
            &["purge", "--published-before", "yesterday"][..],
            "neither an RFC 3339 timestamp",
        ),
        (
            &["purge", "--published-before", "1d", "--batch-size", "0"][..],
            "not in 1..=10000",
        ),
        (&["dead-letters"][..], "Usage"),
        (&["vacuum"][..], "unrecognized subcommand"),
    ] {
        let stderr = fails(None, args, 2);
        assert!(stderr.contains(expected), "outbox {args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_it_cannot_use_are_clear_errors() {
    // No database, or one it does not speak: the command line is wrong (2).
    let stderr = fails(None, &["status"], 2);
    assert!(
        stderr.contains("no database: pass --database-url or set DATABASE_URL"),
        "{stderr}"
    );
    let unreachable = [
        "--database-url",
        "postgres://postgres@127.0.0.1:1/none",
        "status",
    ];
    // The cause, at once: not a pool's timeout after ten seconds.
    let started = std::time::Instant::now();
    let stderr = fails(None, &unreachable, 1);
    let took = started.elapsed();
    assert!(
        stderr.starts_with("error: cannot connect to the database")
            && stderr.to_lowercase().contains("connection refused"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let redis = ["--database-url", "redis://127.0.0.1/0", "status"];
    let stderr = fails(None, &redis, 2);
    assert!(
        stderr.contains(
            "unsupported database URL `redis`: use postgres://..., mysql://... or sqlite://..."
        ),
        "{stderr}"
    );
    let db = TestDb::new().await;
    let stderr = fails(Some(&db), &["--table", "outbox; drop", "status"], 2);
    assert!(
        stderr.contains(r#"invalid SQL identifier "outbox; drop" for the table"#),
        "{stderr}"
    );
    // Not migrated yet: the database says what is missing.
    let stderr = fails(Some(&db), &["status"], 1);
    assert!(stderr.contains("does not exist"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_exits_0_when_done_1_when_it_could_not_2_on_a_wrong_command_line() {
    let (db, [delivered, doomed, raw]) = scenario().await;
    let (delivered, doomed, raw) = (delivered.to_string(), doomed.to_string(), raw.to_string());
    let states = [
        "pending", "claimed", "parked", "held", "retrying", "waiting", "dead", "skipped",
    ];
    let mut cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["migrate"], 0),
        (vec!["status"], 0),
        (vec!["dead-letters", "list"], 0),
        (vec!["dead-letters", "groups"], 0),
        (vec!["requeues"], 0),
        (vec!["requeues", "--limit", "0"], 2),
        // Nothing to requeue or skip: tried, and could not.
        (vec!["requeue", &delivered], 1),
        (vec!["requeue", "--subscriber", "nobody"], 1),
        (vec!["skip", &delivered, "--reason", "r"], 1),
        (
            vec!["skip", &delivered, "--subscriber", "y", "--reason", "r"],
            1,
        ),
        // Done.
        (vec!["requeue", &doomed], 0),
        (vec!["skip", &raw, "--reason", "bad payload"], 0),
        (vec!["purge", "--published-before", "30d"], 0),
        // The command line is wrong: nothing tried.
        (vec!["list", "--state", "dead", "--after", "x"], 2),
        (vec!["list", "--state", "dead", "--limit", "0"], 2),
        (
            vec!["purge", "--published-before", "2999-01-01T00:00:00Z"],
            2,
        ),
        (vec!["--table", "bad name", "status"], 2),
        (vec!["serve", "--bind", "10.0.0.1:80"], 2),
        (vec!["serve", "--sample-every", "soon"], 2),
        (vec!["status", "--bogus"], 2),
    ];
    for state in states {
        cases.insert(4, (vec!["list", "--state", state], 0));
    }
    for (args, code) in cases {
        // Reads in tables and in JSON; a change once, in JSON.
        let changes = ["requeue", "skip", "purge"].contains(&args[0]) && code == 0;
        for json in [false, true] {
            if (json && code != 0) || (changes && !json) {
                continue;
            }
            let args = if json {
                [&args[..], &["--json"]].concat()
            } else {
                args.clone()
            };
            let output = on(Some(&db), &args);
            let (stdout, stderr) = (
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr),
            );
            assert_eq!(
                output.status.code(),
                Some(code),
                "outbox {args:?}: {stdout}{stderr}"
            );
            if code == 0 {
                assert_eq!(stderr, "", "outbox {args:?}");
                if json {
                    serde_json::from_str::<Value>(&stdout)
                        .unwrap_or_else(|e| panic!("outbox {args:?}: not JSON ({e}): {stdout}"));
                }
            } else {
                assert_eq!(stdout, "", "outbox {args:?}");
                assert!(stderr.starts_with("error: "), "outbox {args:?}: {stderr}");
            }
        }
    }
    // A requeue, then nothing left: every code is about this database's state.
    let stderr = fails(Some(&db), &["requeue", &doomed], 1);
    assert!(stderr.contains("nothing to requeue"), "{stderr}");
}

#[test]
fn sqlite_files_work_too() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("outbox.db").display()
    );
    let run = |args: &[&str]| outbox(&[&["--database-url", url.as_str()], args].concat());
    assert!(run(&["migrate"]).status.success());
    let output = run(&["status", "--json"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let status: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(status["pending_events"], 0, "{status}");
    assert_eq!(
        status["oldest_pending_age_seconds"],
        Value::Null,
        "{status}"
    );
}

/// On MySQL / MariaDB: migrate, what the relay left (a parked event, a dead delivery) in
/// `status` and the lists, a requeue with its reason, and the record of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_databases_work_too() {
    let db = TestMyDb::new().await;
    let url = db.url();
    let run = |args: &[&str]| {
        let output = outbox(&[&["--database-url", url.as_str()], args].concat());
        assert!(
            output.status.success(),
            "outbox {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };
    let json = |args: &[&str]| -> Value {
        serde_json::from_str(&run(&[args, &["--json"]].concat())).expect("JSON output")
    };
    assert!(run(&["migrate"]).contains("up to date"));
    let outbox: Outbox<MySql, PingPong> = Outbox::new(db.pool.clone());
    let probe = Probe::default();
    let doomed = publish_for_operators(&outbox, &probe).await;
    let relay = Relay::new(outbox.store(), XAndY::new(&probe), RelayConfig::default()).unwrap();
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;

    let status = json(&["status"]);
    assert_eq!(status["states"]["parked"], 1, "{status}");
    assert_eq!(status["states"]["dead"], 1, "{status}");
    let dead = json(&["list", "--state", "dead"]);
    assert_eq!(dead[0]["subscriber"], "y", "{dead}");
    assert_eq!(dead[0]["aggregate_id"], doomed.to_string(), "{dead}");
    let parked = json(&["list", "--state", "parked"]);
    assert_eq!(parked[0]["event_type"], "Pong", "{parked}");
    let groups = json(&["dead-letters", "groups"]);
    assert_eq!(groups[0]["dead"], 1, "{groups}");

    let out = run(&[
        "requeue",
        "--subscriber",
        "y",
        "--reason",
        "fixed the handler",
    ]);
    assert!(out.contains("requeued 1"), "{out}");
    let requeues = json(&["requeues"]);
    assert_eq!(requeues[0]["reason"], "fixed the handler", "{requeues}");
    assert_eq!(requeues[0]["requeued"], 1, "{requeues}");
    run_until(&relay, WAIT, || probe.delivered_to("y").len() == 2).await;
    assert_eq!(json(&["status"])["states"]["dead"], 0);
}
