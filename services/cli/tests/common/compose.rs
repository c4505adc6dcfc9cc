//! The compose harness: docker-compose.yml started as a project of its own on the host's Docker
//! daemon (image llmq:local, from `make image`), its ports published on free loopback ports
//! (fixed for the project's life, so that a restarted container keeps its address), and removed
//! with its network and volumes when the `Compose` is dropped, whatever happens.
//! Projects run one at a time (two stacks of three workers would share two cores).

use std::hash::BuildHasher;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use llmq_gateway::client;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

pub struct Compose {
    pub project: String,
    root: PathBuf,
    /// Compose files over docker-compose.yml (deploy/docker/tls.yml, say).
    overlays: Vec<String>,
    /// Variables for docker-compose.yml besides the addresses and passwords.
    vars: Vec<(String, String)>,
    /// Where NATS and the gateway are published on the host.
    pub nats: String,
    pub gateway: String,
    /// NATS passwords of this project's users (`.env`'s variables, fresh for each project).
    passwords: Vec<(&'static str, String)>,
    _turn: MutexGuard<'static, ()>,
}

impl Compose {
    /// `docker-compose up -d --scale worker=<workers>`; fails (never skips) without a daemon or
    /// the image.
    pub fn up(name: &str, workers: usize) -> Compose {
        Compose::up_with(name, workers, &[])
    }

    /// `up`, with compose files over docker-compose.yml.
    pub fn up_with(name: &str, workers: usize, overlays: &[&str]) -> Compose {
        Compose::up_full(name, workers, overlays, &[])
    }

    /// `up`, with compose files over docker-compose.yml and its variables set (`LLMQ_WORKER_MAX_BATCH`, say).
    pub fn up_full(
        name: &str,
        workers: usize,
        overlays: &[&str],
        vars: &[(&str, &str)],
    ) -> Compose {
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .canonicalize()
            .unwrap();
        let ok = |c: &mut Command| {
            c.stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        };
        assert!(
            ok(Command::new("docker").arg("info")),
            "no Docker daemon answers `docker info`: compose tests need one"
        );
        assert!(
            ok(Command::new("docker").args(["image", "inspect", "llmq:local"])),
            "no image llmq:local: run `make image`"
        );
        remove_stale_projects(&root);
        let project = format!("llmqt{}x{name}", std::process::id());
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .to_string()
        };
        let password = |n: usize| {
            format!(
                "pw{:016x}{n}",
                std::collections::hash_map::RandomState::new().hash_one(n)
            )
        };
        let users = ["intake", "worker", "gateway", "client1", "client2"];
        let passwords = users
            .iter()
            .enumerate()
            .map(|(i, u)| (*u, password(i)))
            .collect();
        let overlays = overlays.iter().map(|o| o.to_string()).collect();
        let vars = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let c = Compose {
            project,
            root,
            overlays,
            vars,
            nats: free(),
            gateway: free(),
            passwords,
            _turn: turn,
        };
        c.run(&["down", "-v", "-t", "1"]);
        c.ok(&["up", "-d", "--scale", &format!("worker={workers}")]);
        c
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("docker-compose");
        c.current_dir(&self.root)
            .args(["-p", &self.project, "-f", "docker-compose.yml"]);
        for o in &self.overlays {
            c.args(["-f", o]);
        }
        c.args(args)
            .env("LLMQ_NATS_PUBLISH", &self.nats)
            .env("LLMQ_GATEWAY_PUBLISH", &self.gateway)
            .env("LLMQ_MODELS", self.root.join(".cache/models"))
            .stdin(Stdio::null());
        for (k, v) in &self.vars {
            c.env(k, v);
        }
        for (user, password) in &self.passwords {
            c.env(
                format!("LLMQ_NATS_{}_PASSWORD", user.to_uppercase()),
                password,
            );
        }
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args)
            .output()
            .expect("docker-compose (Debian package docker-compose)")
    }

    /// Runs `docker-compose <args>`, panicking with its output if it fails; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "docker-compose {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A file of the checkout.
    pub fn path(&self, relative: &str) -> PathBuf {
        self.root.join(relative)
    }

    /// NATS's URL for a client application (user client1).
    pub fn nats_url(&self) -> String {
        self.nats_url_as("client1")
    }

    /// The NATS password of `user` (a user of nats.conf).
    pub fn password(&self, user: &str) -> &str {
        &self
            .passwords
            .iter()
            .find(|(u, _)| *u == user)
            .expect("a user of nats.conf")
            .1
    }

    /// NATS's URL with the credentials of `user`.
    pub fn nats_url_as(&self, user: &str) -> String {
        format!("nats://{user}:{}@{}", self.password(user), self.nats)
    }

    /// The ids of a service's running containers.
    pub fn containers(&self, service: &str) -> Vec<String> {
        self.ok(&["ps", "-q", service])
            .lines()
            .map(str::to_string)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// `ok` without blocking the runtime's thread (requests go on meanwhile).
    pub async fn ok_async(&self, args: &[&str]) -> String {
        let out = tokio::process::Command::from(self.command(args))
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "docker-compose {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until the gateway's /metrics lists `workers` live workers; returns its address.
    pub async fn wait_workers(&self, workers: usize) -> String {
        let addr = self.gateway.clone();
        let t = Instant::now();
        loop {
            if let Ok(r) = client::request(&addr, "GET", "/metrics", None).await {
                if metric(&r.body, "llmq_worker_active_streams").len() == workers {
                    return addr;
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(180),
                "{workers} workers never reported in /metrics"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = self.run(&["logs", "--no-color", "--tail", "200"]);
            eprintln!("{}", String::from_utf8_lossy(&logs.stdout));
        }
        self.run(&["down", "-v", "-t", "2", "--remove-orphans"]);
    }
}

/// Removes the compose projects earlier test processes left behind (a run killed before its
/// `Compose`s were dropped): they would hold cores and ports.
fn remove_stale_projects(root: &std::path::Path) {
    let own = format!("llmqt{}x", std::process::id());
    let out = Command::new("docker")
        .args([
            "ps",
            "-a",
            "--format",
            "{{.Label \"com.docker.compose.project\"}}",
        ])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut stale: Vec<&str> = listed
        .lines()
        .filter(|p| p.starts_with("llmqt") && !p.starts_with(&own))
        .collect();
    stale.sort();
    stale.dedup();
    for p in stale {
        let _ = Command::new("docker-compose")
            .current_dir(root)
            .args(["-p", p, "-f", "docker-compose.yml", "down", "-v", "-t", "1"])
            .envs(
                ["INTAKE", "WORKER", "GATEWAY", "CLIENT1", "CLIENT2"]
                    .map(|u| (format!("LLMQ_NATS_{u}_PASSWORD"), "unused")),
            )
            .stdin(Stdio::null())
            .output();
    }
}

/// `docker <args>`, panicking if it fails.
pub fn docker(args: &[&str]) {
    let out = Command::new("docker").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The samples of one metric in a Prometheus text page: (labels, value).
pub fn metric(page: &str, name: &str) -> Vec<(String, f64)> {
    page.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|l| {
            let (labels, value) = l.split_once("} ")?;
            Some((labels.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}
