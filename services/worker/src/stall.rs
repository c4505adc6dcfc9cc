//! The device thread's watchdog. Every MLX call of a worker runs on its device thread; a call
//! that never returns (a driver or library fault) would leave the jobs the worker holds silent
//! forever, kept alive by progress acks that run on another thread. So a worker whose scheduler
//! has work but has finished no tick for `worker.stall_exit_s` is stuck: it exits with an error,
//! its jobs unacknowledged, so that the server hands them to other workers (which end them with
//! `worker_lost`) and the orchestrator restarts it. The limit must exceed the longest tick the
//! worker can legitimately run (a whole idle prefill chunk of a large model on a CPU).

use std::time::{Duration, Instant};

/// Watches the scheduler's tick count while it has work.
pub struct Watchdog {
    limit: Option<Duration>,
    ticks: u64,
    since: Instant,
}

impl Watchdog {
    /// `limit` zero: never stuck.
    pub fn new(limit: Duration, now: Instant) -> Watchdog {
        Watchdog {
            limit: (!limit.is_zero()).then_some(limit),
            ticks: 0,
            since: now,
        }
    }

    /// Notes the ticks run so far and whether the scheduler has work; true once it has had work
    /// and run no tick for the limit.
    pub fn stuck(&mut self, ticks: u64, has_work: bool, now: Instant) -> bool {
        if ticks != self.ticks || !has_work {
            self.ticks = ticks;
            self.since = now;
            return false;
        }
        self.limit
            .is_some_and(|l| now.saturating_duration_since(self.since) >= l)
    }

    /// How long the scheduler has had work without finishing a tick.
    pub fn stalled_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn stuck_only_with_work_and_no_tick_for_the_limit() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(S(60), t0);
        assert!(!w.stuck(0, true, t0));
        assert!(!w.stuck(0, true, t0 + S(59)));
        assert!(
            w.stuck(0, true, t0 + S(60)),
            "work and no tick for the limit"
        );
        // A tick resets it; so does having no work (an idle scheduler runs no ticks).
        assert!(!w.stuck(1, true, t0 + S(61)));
        assert!(!w.stuck(1, true, t0 + S(120)));
        assert!(!w.stuck(1, false, t0 + S(121)));
        assert!(!w.stuck(1, true, t0 + S(180)));
        assert!(w.stuck(1, true, t0 + S(181)));
        assert_eq!(w.stalled_for(t0 + S(181)), S(60));
    }

    #[test]
    fn a_zero_limit_never_fires() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(Duration::ZERO, t0);
        assert!(!w.stuck(0, true, t0 + S(100_000)));
    }
}
