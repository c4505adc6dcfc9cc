//! Starting a local nats-server (Debian's `nats-server` package) with JetStream on 127.0.0.1,
//! for `llmq up` (`serve::start_stack`) and for the test harness (`tests/common`, which includes
//! this file by path: the binary crate has no library to import from), so both start and wait
//! for it the same way; and the wait itself (`wait_listening`), which both also use for the
//! gateway's address file.
//!
//! Invariant: the URL returned is always the started server's own. It comes from the ports file
//! nats-server writes (`--ports_file_dir`) once it listens; a port picked here and bound by the
//! server later could be taken in between (parallel test stacks did), and the stack would then
//! talk to another server.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Starts nats-server on `port`, or (None) on a free port it picks itself, storing under `dir`;
/// returns it and its client URL once it accepts connections. A server that exits first (its
/// port in use) is an error; one not listening within 10 s is killed and an error.
pub fn start(port: Option<u16>, dir: &Path) -> Result<(Child, String)> {
    std::fs::create_dir_all(dir)?;
    let port = port.map_or("-1".to_string(), |p| p.to_string());
    let mut child = Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port, "-js", "--ports_file_dir"])
        .arg(dir)
        .arg("-sd")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting nats-server (Debian package nats-server; `make setup` installs it)")?;
    let pid = child.id();
    match wait_listening(&mut child, Duration::from_secs(10), || {
        url_from_ports_file(dir, pid)
    })? {
        Listening::At(url) => Ok((child, url)),
        Listening::Exited(status) => {
            bail!("nats-server exited ({status}) before listening on port {port} (-1: one of its choosing); is the port in use?")
        }
        Listening::TimedOut => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("nats-server did not start listening on port {port} within 10 s")
        }
    }
}

/// How a wait for a child to listen ended.
pub enum Listening {
    /// Its address, as `address` read it.
    At(String),
    Exited(std::process::ExitStatus),
    TimedOut,
}

/// Polls `address` (every 20 ms, for up to `limit`) until it gives the address `child` listens
/// on, which a server writes to a file once listening; stops early if `child` exits.
pub fn wait_listening(
    child: &mut Child,
    limit: Duration,
    address: impl Fn() -> Option<String>,
) -> Result<Listening> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(a) = address() {
            return Ok(Listening::At(a));
        }
        if let Some(status) = child.try_wait()? {
            return Ok(Listening::Exited(status));
        }
        if Instant::now() > deadline {
            return Ok(Listening::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The client URL in the ports file of the nats-server with process id `pid`, once written
/// (`{"nats":["nats://127.0.0.1:PORT"]}`); None while it is absent or half written.
fn url_from_ports_file(dir: &Path, pid: u32) -> Option<String> {
    let bytes = std::fs::read(dir.join(format!("nats-server_{pid}.ports"))).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    v["nats"][0].as_str().map(str::to_string)
}
