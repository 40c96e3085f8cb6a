//! Processes that run one ignored test of the current test binary (a relay, a worker, a
//! consumer), for tests that kill them: the test binary is started again with
//! `<test> --exact --ignored --nocapture` and the given environment, which the ignored test
//! reads (it does nothing without it).

use std::process::{Child, Command, Stdio};

/// A process running the ignored test `test` of this test binary; killed and reaped when
/// dropped, also when the test that started it fails.
#[derive(Debug)]
pub struct TestProcess(Child);

impl TestProcess {
    /// Starts `test` with the environment `env` added.
    pub fn start(test: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(std::env::current_exe().expect("the test binary"));
        command
            .args([test, "--exact", "--ignored", "--nocapture"])
            .stdout(Stdio::null());
        for (key, value) in env {
            command.env(key, value);
        }
        Self(
            command
                .spawn()
                .unwrap_or_else(|error| panic!("start {test}: {error}")),
        )
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// SIGKILL: no shutdown, no last record.
    pub fn kill(mut self) {
        self.0.kill().expect("kill the process");
        self.0.wait().expect("reap the process");
    }
}

impl Drop for TestProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
