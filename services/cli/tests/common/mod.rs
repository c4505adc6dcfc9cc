//! The test harness shared by the end-to-end tests: a real nats-server on a free loopback port
//! and llmq's own processes, all stopped when the `Stack` is dropped, whatever happens.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

pub mod client;
pub mod compose;
pub mod python;

// How `llmq up` starts nats-server (the binary crate has no library to import from).
#[path = "../../src/nats_server.rs"]
mod nats_server;

pub fn fixture() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-llama")
        .canonicalize()
        .unwrap()
        .display()
        .to_string()
}

/// Processes stopped on drop, even when a test fails.
struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct Stack {
    pub url: String,
    dir: PathBuf,
    procs: Vec<Proc>,
    /// The model intake and workers are started with.
    model: String,
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.procs.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Stack {
    /// nats-server alone, for the tiny Llama fixture.
    pub fn nats_only() -> Stack {
        Stack::nats_for(&fixture())
    }

    /// nats-server alone, on a port of its own choosing (started as `llmq up` starts it, so its
    /// URL is its own: `nats_server`); services spawned later serve `model`.
    pub fn nats_for(model: &str) -> Stack {
        static STACKS: AtomicUsize = AtomicUsize::new(0);
        let n = STACKS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("llmq-e2e-{}-{n}", std::process::id()));
        let (nats, url) =
            nats_server::start(None, &dir).expect("nats-server (Debian package nats-server)");
        Stack {
            url,
            dir,
            procs: vec![Proc(nats)],
            model: model.to_string(),
        }
    }

    /// Starts `llmq <what>` against this stack's NATS; returns its index (for `kill`).
    pub fn spawn(&mut self, what: &str, env: &[(&str, &str)]) -> usize {
        let mut c = Command::new(env!("CARGO_BIN_EXE_llmq"));
        c.arg(what)
            .env("LLMQ__NATS__URL", &self.url)
            .env("LLMQ__WORKER__MODEL", &self.model)
            .env("LLMQ__INTAKE__MODELS", &self.model)
            .env("LLMQ__WORKER__HEARTBEAT_MS", "200")
            .env("LLMQ_LOG", "warn")
            .env("LLMQ__INTAKE__WORKER_TIMEOUT_MS", "1000")
            .env("LLMQ__INTAKE__NO_WORKER_GRACE_MS", "1000")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        for (k, v) in env {
            c.env(k, v);
        }
        self.procs.push(Proc(c.spawn().unwrap()));
        self.procs.len() - 1
    }

    /// Kills a process started by `spawn`.
    pub fn kill(&mut self, index: usize) {
        let p = &mut self.procs[index].0;
        let _ = p.kill();
        let _ = p.wait();
    }

    /// Starts the HTTP gateway on a port the system picks (no race for a free one); returns its
    /// index and its address, read from the file it writes once listening.
    pub fn spawn_gateway(&mut self, env: &[(&str, &str)]) -> (usize, String) {
        let file = self.dir.join(format!("gateway-{}.addr", self.procs.len()));
        let file_env = file.display().to_string();
        let mut all = vec![
            ("LLMQ__GATEWAY__LISTEN", "127.0.0.1:0"),
            ("LLMQ__GATEWAY__ADDRESS_FILE", file_env.as_str()),
        ];
        all.extend_from_slice(env);
        let index = self.spawn("gateway", &all);
        let read = || std::fs::read_to_string(&file).ok();
        match nats_server::wait_listening(
            &mut self.procs[index].0,
            std::time::Duration::from_secs(60),
            read,
        )
        .unwrap()
        {
            nats_server::Listening::At(addr) => (index, addr),
            nats_server::Listening::Exited(status) => panic!("the gateway exited ({status})"),
            nats_server::Listening::TimedOut => panic!("the gateway did not listen within 60 s"),
        }
    }

    /// Sends SIGTERM to a process started by `spawn` (a graceful stop).
    pub fn terminate(&mut self, index: usize) {
        extern "C" {
            fn kill(pid: i32, sig: i32) -> i32;
        }
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(
            unsafe { kill(self.procs[index].0.id() as i32, 15) },
            0,
            "SIGTERM"
        );
    }

    /// How a process started by `spawn` exited, once it has (None if still running after `limit`).
    pub fn wait_exit(
        &mut self,
        index: usize,
        limit: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.procs[index].0.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    pub fn up(worker_env: &[(&str, &str)]) -> Stack {
        let mut s = Stack::nats_only();
        s.spawn("intake", &[]);
        s.spawn("worker", worker_env);
        s
    }
}
