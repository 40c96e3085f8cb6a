//! A PostgreSQL server of one test's own, for tests that stop and restart the server: the shared
//! server must stay up for the tests running beside them.
//!
//! The server is made with `initdb` in a temporary directory and listens on 127.0.0.1 at a free
//! port. Its programs are found with `pg_config --bindir`, or in `OUTBOX_PG_BINDIR`. PostgreSQL
//! refuses to run as root: under root the programs run as the `postgres` user, through `runuser`.
//! The server is stopped (immediately) and its directory removed when the value is dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

/// How [`PrivateServer::stop`] shuts the server down (`pg_ctl stop -m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Disconnects clients, checkpoints, exits: a planned restart.
    Fast,
    /// Kills every server process with no checkpoint: a crash, recovered from the WAL at start.
    Immediate,
}

/// A PostgreSQL server started for one test.
pub struct PrivateServer {
    bindir: PathBuf,
    /// Holds `data/`, the cluster, which is also the directory of its Unix socket.
    dir: TempDir,
    port: u16,
    /// `Some("postgres")` when running as root.
    run_as: Option<&'static str>,
}

impl PrivateServer {
    /// Creates a cluster (trust auth, superuser `postgres`, `fsync` off) and starts it.
    ///
    /// # Panics
    /// When the PostgreSQL programs are missing or fail; the message says which and why.
    pub fn start() -> PrivateServer {
        let bindir = bindir();
        let run_as = is_root().then_some("postgres");
        let dir = tempfile::Builder::new()
            .prefix("outbox-pg-")
            .tempdir()
            .expect("a temporary directory for the server");
        if let Some(user) = run_as {
            let (uid, gid) = (id(&["-u", user]), id(&["-g", user]));
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .expect("give the server's directory to its user");
        }
        let server = PrivateServer {
            bindir,
            port: free_port(),
            dir,
            run_as,
        };
        let data = server.data();
        server.pg(
            "initdb",
            &[
                "-D",
                data.to_str().expect("a UTF-8 temporary path"),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        server.start_again();
        server
    }

    /// The URL of database `postgres` on this server.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server; returns once it is down.
    pub fn stop(&self, mode: StopMode) {
        let mode = match mode {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        };
        let data = self.data();
        self.pg(
            "pg_ctl",
            &["stop", "-D", data.to_str().unwrap(), "-m", mode, "-w"],
        );
    }

    /// Starts the stopped server on the same port; returns once it accepts connections.
    pub fn start_again(&self) {
        let data = self.data();
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=40",
            self.port,
            data.to_str().unwrap(),
        );
        let log = data.join("server.log");
        self.pg(
            "pg_ctl",
            &[
                "start",
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &options,
                "-w",
            ],
        );
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// One of the server's programs, to run as the server's user in the server's directory (the
    /// server's user may not be able to enter the test's working directory).
    fn command(&self, program: &str) -> Command {
        let path = self.bindir.join(program);
        let mut command = match self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(path);
                command
            }
            None => Command::new(path),
        };
        command.current_dir(self.dir.path());
        command
    }

    /// Runs one of the server's programs; panics with its output, and the server's log (which
    /// goes with the temporary directory), on failure.
    fn pg(&self, program: &str, args: &[&str]) -> Output {
        let output = self
            .command(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed ({}):\n{}{}\nserver log:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(self.data().join("server.log")).unwrap_or_default(),
        );
        output
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        // Best effort: the server may be down already, and a panic here would hide the test's.
        let _ = self
            .command("pg_ctl")
            .args(["stop", "-D"])
            .arg(self.data())
            .args(["-m", "immediate", "-w"])
            .output();
    }
}

/// The directory of the PostgreSQL server programs.
fn bindir() -> PathBuf {
    if let Some(dir) = std::env::var_os("OUTBOX_PG_BINDIR") {
        return PathBuf::from(dir);
    }
    let output = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("pg_config is not on PATH: install PostgreSQL or set OUTBOX_PG_BINDIR");
    assert!(output.status.success(), "pg_config --bindir failed");
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    assert!(
        Path::new(&dir).join("initdb").exists(),
        "no initdb in {} (pg_config --bindir): set OUTBOX_PG_BINDIR to the server's programs",
        dir.display()
    );
    dir
}

fn is_root() -> bool {
    id(&["-u"]) == 0
}

/// `id <args>`, as a number.
fn id(args: &[&str]) -> u32 {
    let output = Command::new("id").args(args).output().expect("run id");
    assert!(output.status.success(), "id {args:?} failed");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("id prints a number")
}

/// A TCP port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}
