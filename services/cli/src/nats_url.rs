//! Where a nats-server started with `-p -1 --ports_file_dir DIR` listens: it picks a free port
//! itself and, once it listens, writes `DIR/nats-server_<pid>.ports` with its client URLs. Used
//! by `llmq up` (`serve::start_nats`) and by the test harness (`tests/common`), so that a stack
//! always talks to the server it started, never to one that took a port picked for it.

use std::path::Path;

/// The client URL in the ports file of the nats-server with process id `pid`, once written
/// (`{"nats":["nats://127.0.0.1:PORT"]}`); None while it is absent or half written.
pub fn from_ports_file(dir: &Path, pid: u32) -> Option<String> {
    let bytes = std::fs::read(dir.join(format!("nats-server_{pid}.ports"))).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    v["nats"][0].as_str().map(str::to_string)
}
