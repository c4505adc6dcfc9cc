//! The tick log: one line per scheduler tick, for finding where a worker's time goes (how a
//! GPU's chunk settings are tuned; `deploy/gpu/tick_report.py` summarises it). Off unless
//! `worker.tick_log` names a path; each worker writes `<path>.<worker id>`.
//!
//! A line: the tick's start (ms since the log opened), its ms, rows decoded, chunk tokens, that
//! prompt's tokens done, then `name=value` fields: the decode actor's host time in the step
//! it delivered ([`StepTimes`]), the chunk stage the tick launched (`layers`, `work`), and MLX's
//! memory after the tick (`active_gb`, `cache_gb`).

use std::io::Write;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::roles::messages::StepTimes;
use llmq_scheduler::TickReport;

pub struct TickLog {
    file: std::fs::File,
    opened: Instant,
}

impl TickLog {
    /// Creates `<path>.<worker_id>`; its first line gives the log's start as UNIX ms, to line it
    /// up with other logs.
    pub fn create(path: &Path, worker_id: &str) -> std::io::Result<Self> {
        let mut name = path.as_os_str().to_owned();
        name.push(format!(".{worker_id}"));
        let mut file = std::fs::File::create(name)?;
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        file.write_all(format!("# t0_unix_ms {unix_ms}\n").as_bytes())?;
        Ok(TickLog {
            file,
            opened: Instant::now(),
        })
    }

    /// One tick's line, written in one unbuffered write: a worker may be killed, not stopped.
    pub fn write(
        &mut self,
        started: Instant,
        ms: f64,
        report: &TickReport,
        step: Option<StepTimes>,
    ) {
        let at = started.saturating_duration_since(self.opened).as_secs_f64() * 1000.0;
        let mut line = format!(
            "{at:.3} {ms:.3} {} {} {}",
            report.decoded, report.prefill_tokens, report.prefill_done
        );
        if let Some(s) = step {
            let fields = [
                ("masks", s.masks),
                ("join", s.join),
                ("queue", s.queue),
                ("build", s.build),
                ("launch", s.launch),
                ("wait", s.wait),
                ("rest", s.rest),
            ];
            for (name, v) in fields {
                line.push_str(&format!(" {name}={v:.3}"));
            }
            line.push_str(&format!(" layers={} work={}", s.stage_layers, s.stage_work));
        }
        let gb = |r: mlx_rs::error::Result<usize>| r.map_or(f64::NAN, |b| b as f64 / 1e9);
        line.push_str(&format!(
            " active_gb={:.2} cache_gb={:.2}\n",
            gb(mlx_rs::memory::active_memory()),
            gb(mlx_rs::memory::cache_memory())
        ));
        if let Err(e) = self.file.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "cannot write the tick log");
        }
    }
}
