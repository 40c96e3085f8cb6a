//! The web console (`outbox serve`, feature `console`) against a real PostgreSQL: in a real
//! headless browser (Debian's chromium, driven by Playwright), read-only unless asked, and on a
//! loopback address unless asked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use outbox_core::{Relay, RelayConfig};
use outbox_sqlx::Outbox;
use outbox_tests::kit::{PingPong, Probe, XAndY, run_until};
use outbox_tests::pg::{TestDb, publish_for_operators};
use serde_json::Value;
use sqlx::Postgres;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(20);

/// A database with: a `Ping` delivered to both subscribers, one whose delivery to `y` died (the
/// next attempt would succeed), and a `Pong` parked (the relay does not route it). Returns the
/// database, the relay's pieces and (dead delivery's event, its aggregate).
async fn scenario() -> (TestDb, Outbox<Postgres, PingPong>, Probe, i64, Uuid) {
    let db = TestDb::new().await;
    let outbox: Outbox<Postgres, PingPong> = Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let probe = Probe::default();
    let doomed = publish_for_operators(&outbox, &probe).await;
    let relay = relay(&outbox, &probe);
    run_until(&relay, WAIT, || probe.delivered_to("x").len() == 2).await;
    let dead = outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    (db, outbox, probe, dead[0].event_id, doomed)
}

fn relay(
    outbox: &Outbox<Postgres, PingPong>,
    probe: &Probe,
) -> Relay<outbox_sqlx::SqlStore<Postgres>, XAndY> {
    Relay::new(outbox.store(), XAndY::new(probe), RelayConfig::default()).unwrap()
}

/// `outbox serve` on `db`, killed when dropped.
struct Served {
    child: Child,
    addr: SocketAddr,
}

impl Served {
    /// Starts `outbox serve` with `args`, and waits for the address it prints.
    fn start(db: &TestDb, args: &[&str]) -> Served {
        let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args([
                "--database-url",
                &db.url(),
                "serve",
                "--sample-every",
                "100ms",
            ])
            // Any free port unless the test names one: tests run side by side.
            .args(if args.contains(&"--bind") {
                &[][..]
            } else {
                &["--bind", "127.0.0.1:0"]
            })
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the outbox binary runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let Some(addr) = line
            .strip_prefix("console on http://")
            .and_then(|rest| rest.split('/').next())
        else {
            let mut stderr = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .unwrap();
            panic!("outbox serve did not start: {line}{stderr}");
        };
        Served {
            addr: addr.parse().unwrap(),
            child,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// One request; (status, body).
    fn http(&self, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
        http(self.addr, method, path, json)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request with `Connection: close`; (status, body). A JSON body is sent as
/// `application/json`.
fn http(addr: SocketAddr, method: &str, path: &str, json: Option<&str>) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let body = json.unwrap_or("");
    let content_type = if json.is_some() {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{content_type}\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Waits until the console has sampled the status `n` times (its charts have points).
fn await_samples(served: &Served, n: usize) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (status, body) = served.http("GET", "/api/history", None);
        assert_eq!(status, 200, "{body}");
        if json(&body).as_array().unwrap().len() >= n {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "no samples: {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_console_shows_everything_and_changes_nothing() {
    let (db, outbox, _probe, dead, _) = scenario().await;
    let served = Served::start(&db, &[]);

    let (status, page) = served.http("GET", "/", None);
    assert_eq!(status, 200);
    assert!(page.contains("<title>outbox console</title>"), "{page}");
    // No external assets: nothing is fetched from another origin.
    for external in ["src=\"http", "href=\"http", "@import", "url(http"] {
        assert!(!page.contains(external), "the page loads `{external}`");
    }
    // Only to a loopback name: a page of another site cannot rebind its own name to it.
    for (host, expected) in [
        ("localhost", 200),
        ("evil.example", 421),
        ("evil.example:80", 421),
    ] {
        let (status, body) = http_to(served.addr, host, "GET", "/api/overview");
        assert_eq!(status, expected, "Host: {host}: {body}");
    }
    let overview = json(&served.http("GET", "/api/overview", None).1);
    assert_eq!(overview["writable"], false);
    assert_eq!(overview["dead_letters"], 1, "{overview}");
    let parked = overview["held_back"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["cause"] == "parked event")
        .cloned();
    assert_eq!(parked.unwrap()["blocked"], 1, "{overview}");
    let listed = json(&served.http("GET", "/api/list?state=dead", None).1);
    assert_eq!(listed["rows"][0]["event_id"], dead, "{listed}");
    assert!(
        listed["rows"][0]["payload"]
            .as_str()
            .unwrap()
            .contains("\"version\""),
        "{listed}"
    );
    let (status, body) = served.http("GET", "/api/list?state=lost", None);
    assert_eq!(status, 400, "{body}");
    assert!(
        json(&body)["error"]
            .as_str()
            .unwrap()
            .contains("unknown state `lost`")
    );

    // Every write is refused, and nothing changes.
    let requeue = format!(r#"{{"event_ids": [{dead}], "reason": "fixed"}}"#);
    let skip = format!(r#"{{"event_id": {dead}, "subscriber": "y", "reason": "fixed"}}"#);
    for (path, body) in [("/api/requeue", &requeue), ("/api/skip", &skip)] {
        let (status, answer) = served.http("POST", path, Some(body));
        assert_eq!(status, 403, "{path}: {answer}");
        assert!(
            json(&answer)["error"]
                .as_str()
                .unwrap()
                .contains("read-only: start it with --allow-writes"),
            "{answer}"
        );
    }
    let still = outbox
        .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
        .await
        .unwrap();
    assert_eq!(still.len(), 1, "{still:?}");
    assert_eq!(
        outbox
            .list(&outbox_sqlx::ListQuery::new(
                outbox_sqlx::ListState::Skipped
            ))
            .await
            .unwrap(),
        []
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_console_takes_json_with_a_reason_only() {
    let (db, outbox, _probe, dead, _) = scenario().await;
    let served = Served::start(&db, &["--allow-writes"]);
    // A form post (what another site's page could send without asking) is not a write.
    let (status, _) = http_form(served.addr, "/api/requeue", &format!("event_ids={dead}"));
    assert_eq!(status, 415);
    // No reason, no write.
    let (status, body) = served.http(
        "POST",
        "/api/requeue",
        Some(&format!(r#"{{"event_ids": [{dead}], "reason": "  "}}"#)),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("give a reason"), "{body}");
    assert_eq!(
        outbox
            .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
            .await
            .unwrap()
            .len(),
        1
    );
    // A failure group goes back as a whole: y's permanent failures (here, one).
    let (status, body) = served.http(
        "POST",
        "/api/requeue",
        Some(
            r#"{"subscriber": "y", "first_line": "permanent error: scripted permanent failure",
                "reason": "fixed in 1.4.2"}"#,
        ),
    );
    assert_eq!(
        (status, json(&body)["requeued"].as_u64()),
        (200, Some(1)),
        "{body}"
    );
    // Recorded with its reason, as `outbox requeue --reason` records it.
    let recorded: Vec<(Option<String>, i64, String)> =
        sqlx::query_as("SELECT subscriber, requeued, reason FROM events.outbox_requeues")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        recorded,
        [(Some("y".to_owned()), 1, "fixed in 1.4.2".to_owned())]
    );
    assert_eq!(
        outbox
            .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
            .await
            .unwrap(),
        []
    );
    // A skip with a reason is recorded as `outbox skip` records it (of a delivery not yet
    // delivered again).
    let (status, body) = served.http(
        "POST",
        "/api/skip",
        Some(&format!(
            r#"{{"event_id": {dead}, "subscriber": "y", "reason": "refunded by hand"}}"#
        )),
    );
    assert_eq!(status, 200, "{body}");
    let skipped = outbox
        .list(&outbox_sqlx::ListQuery::new(
            outbox_sqlx::ListState::Skipped,
        ))
        .await
        .unwrap();
    assert_eq!(skipped.len(), 1);
    assert_eq!(
        (skipped[0].event_id, skipped[0].reason.as_deref()),
        (dead, Some("refunded by hand"))
    );
    // Nothing left to requeue: a conflict, said so.
    let (status, body) = served.http(
        "POST",
        "/api/requeue",
        Some(&format!(r#"{{"event_ids": [{dead}], "reason": "again"}}"#)),
    );
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("nothing to requeue"), "{body}");
    // Nothing left to skip either, and requests that name nothing or name it badly: each
    // error says what is wrong.
    let skip = format!(r#"{{"event_id": {dead}, "subscriber": "y", "reason": "twice"}}"#);
    for (method, path, body, status, says) in [
        (
            "POST",
            "/api/skip",
            Some(skip.as_str()),
            409,
            "cannot skip event",
        ),
        (
            "POST",
            "/api/requeue",
            Some(r#"{"event_ids": [1], "subscriber": "y", "reason": "r"}"#),
            400,
            "name event ids, a subscriber, or a failure group",
        ),
        (
            "GET",
            "/api/list?state=dead&aggregate=nope",
            None,
            400,
            "aggregate `nope` is not a UUID",
        ),
        (
            "GET",
            "/api/list?state=dead&after=x",
            None,
            400,
            "after `x`: expected an event id",
        ),
    ] {
        let (code, answer) = served.http(method, path, body);
        assert_eq!(code, status, "{path}: {answer}");
        let error = json(&answer)["error"].as_str().unwrap().to_owned();
        assert!(error.contains(says), "{path}: {error}");
    }
}

/// A GET with the `Host` header `host`; (status, body).
fn http_to(addr: SocketAddr, host: &str, method: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split(' ').nth(1).unwrap().parse().unwrap();
    (status, response)
}

fn http_form(addr: SocketAddr, path: &str, form: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
        form.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split(' ').nth(1).unwrap().parse().unwrap();
    (status, response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_listens_on_loopback_unless_asked() {
    let db = TestDb::new().await;
    // Refused before connecting to anything.
    let output = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args([
            "--database-url",
            "postgres://127.0.0.1:1/none",
            "serve",
            "--bind",
            "0.0.0.0:0",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("refusing to serve the console on 0.0.0.0:0, which is not a loopback"),
        "{stderr}"
    );
    assert!(stderr.contains("--allow-remote"), "{stderr}");
    // By default: a loopback address.
    Outbox::<Postgres, ()>::new(db.pool.clone())
        .migrate()
        .await
        .unwrap();
    let mut local = Served::start(&db, &["--bind", "127.0.0.1:0"]);
    assert!(local.addr.ip().is_loopback());
    // Ctrl-C stops it, successfully.
    let interrupted = Command::new("kill")
        .args(["-INT", &local.child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    assert_eq!(local.child.wait().unwrap().code(), Some(0));
    // A port another program holds: said so.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let bind = format!("127.0.0.1:{port}");
    let output = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["--database-url", &db.url(), "serve", "--bind", &bind])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains(&format!("cannot listen on {bind}")),
        "{stderr}"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args([
            "--database-url",
            &db.url(),
            "serve",
            "--sample-every",
            "soon",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(
        stderr.contains("expected a number and a unit: 500ms, 5s, 1m"),
        "{stderr}"
    );
    // Asked: any address.
    let remote = Served::start(&db, &["--bind", "0.0.0.0:0", "--allow-remote"]);
    assert!(remote.addr.ip().is_unspecified(), "{}", remote.addr);
    let port = remote.addr.port();
    let (status, _) = http(SocketAddr::from(([127, 0, 0, 1], port)), "GET", "/", None);
    assert_eq!(status, 200);
    // Served for other machines, it answers under their names for it too.
    let (status, _) = http_to(
        SocketAddr::from(([127, 0, 0, 1], port)),
        "outbox.internal",
        "GET",
        "/",
    );
    assert_eq!(status, 200);
}

/// Debian's chromium, or `OUTBOX_CHROMIUM`; `None` (with why) when missing.
fn chromium() -> Result<PathBuf, String> {
    let path = std::env::var_os("OUTBOX_CHROMIUM")
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "no browser at {} (install Debian's `chromium` package, or set OUTBOX_CHROMIUM)",
            path.display()
        ))
    }
}

/// `playwright-core`, installed with npm into the target directory once.
fn playwright(dir: &Path) -> Result<(), String> {
    if dir
        .join("node_modules/playwright-core/package.json")
        .exists()
    {
        return Ok(());
    }
    if Command::new("node").arg("--version").output().is_err() {
        return Err("no `node` on PATH (install Node.js)".to_owned());
    }
    std::fs::create_dir_all(dir).unwrap();
    let output = Command::new("npm")
        .args([
            "install",
            "--no-save",
            "--no-audit",
            "--no-fund",
            "--prefix",
            dir.to_str().unwrap(),
            "playwright-core@1.65.2",
        ])
        .output()
        .map_err(|e| format!("cannot run npm: {e}"))?;
    assert!(
        output.status.success(),
        "npm could not install playwright-core: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_requeues_a_dead_letter_in_a_real_browser_and_it_is_delivered() {
    let browser = match chromium() {
        Ok(browser) => browser,
        Err(why) => {
            println!("skipped: the console's browser test needs Chromium: {why}");
            return;
        }
    };
    let driver = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-driver");
    if let Err(why) = playwright(&driver) {
        println!("skipped: the console's browser test needs Node.js: {why}");
        return;
    }
    let (db, outbox, probe, dead, doomed) = scenario().await;
    // And an event that cannot be decoded: a second failure group, requeued as a group.
    sqlx::query(
        "INSERT INTO events.outbox (aggregate_type, aggregate_id, event_type, payload, dead_at,
                                    last_error)
         VALUES ('probe', $1, 'Ping', '{\"version\": 1}', now(), 'cannot decode: no data')",
    )
    .bind(Uuid::new_v4())
    .execute(&db.pool)
    .await
    .unwrap();
    let served = Served::start(&db, &["--allow-writes"]);
    await_samples(&served, 10);
    let shots = std::env::var_os("OUTBOX_SCREENSHOTS")
        .map_or_else(|| driver.join("screenshots"), PathBuf::from);
    std::fs::create_dir_all(&shots).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/console/drive.cjs");
    let output = Command::new("node")
        .arg(&script)
        .args([served.url(), shots.display().to_string(), dead.to_string()])
        .env("CHROMIUM", &browser)
        .env("NODE_PATH", driver.join("node_modules"))
        .current_dir(&driver)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "the browser session failed:\n{log}"
    );
    for page in ["overview", "dead-letters", "groups", "parked"] {
        assert!(shots.join(format!("{page}.png")).exists(), "{page}: {log}");
    }
    // Requeued in the browser: no dead letter left, and the relay delivers it.
    assert_eq!(
        outbox
            .list(&outbox_sqlx::ListQuery::new(outbox_sqlx::ListState::Dead))
            .await
            .unwrap(),
        [],
        "{log}"
    );
    let relay = relay(&outbox, &probe);
    run_until(&relay, WAIT, || {
        probe.delivered_to("y").contains(&(doomed, 1))
    })
    .await;
}
