//! Runs the tick log's speed probe (`usage::SpeedProbe`) in a process of its own, every
//! PERIOD_MS, for SECONDS, printing one line per run: UNIX time (ms), integer chain (us),
//! memory walk (us), the CPU it ran on. Beside a burst benchmark it tells whether the memory
//! slowdown the worker's decode thread sees is the whole machine's (this process slows too) or
//! the worker's own.
//!
//! Usage: memory_probe [PERIOD_MS (10)] [SECONDS (60)]

use std::io::Write;

use llmq_worker::usage::{unix_ms, SpeedProbe};

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().expect("whole numbers: PERIOD_MS SECONDS"));
    let (period, seconds) = (args.next().unwrap_or(10), args.next().unwrap_or(60));
    let probe = SpeedProbe::new();
    let mut out = std::io::stdout().lock();
    let end = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    while std::time::Instant::now() < end {
        let (alu, walk, core) = probe.run();
        if writeln!(out, "{} {alu:.1} {walk:.1} {core}", unix_ms()).and_then(|_| out.flush()).is_err() {
            break; // the reader went away
        }
        std::thread::sleep(std::time::Duration::from_millis(period));
    }
}
