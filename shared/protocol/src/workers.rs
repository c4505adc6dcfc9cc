//! The workers a service has heard from: the latest [`WorkerStatus`] heartbeat of each, and which
//! are alive (heard from within a timeout). Intake and the gateway keep one each.
//!
//! Invariant: a worker silent for longer than the timeout is not live, and is forgotten after
//! ten timeouts; when a model's workers were last heard from is kept apart, for as long as the
//! table lives (a model whose workers are restarting is not a model nobody serves).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::WorkerStatus;

/// The workers a service has heard from, by their heartbeats: who is live, and which models are
/// served.
pub struct WorkerTable {
    seen: HashMap<String, (WorkerStatus, Instant)>,
    model_heard: HashMap<String, Instant>,
    timeout: Duration,
}

impl WorkerTable {
    /// A table where a worker silent for `timeout` is no longer live.
    pub fn new(timeout: Duration) -> Self {
        WorkerTable {
            seen: HashMap::new(),
            model_heard: HashMap::new(),
            timeout,
        }
    }

    /// Notes a heartbeat, received now.
    pub fn update(&mut self, status: WorkerStatus) {
        self.update_at(status, Instant::now());
    }

    /// Notes a heartbeat received at `at` (forgetting workers silent for ten timeouts).
    pub fn update_at(&mut self, status: WorkerStatus, at: Instant) {
        let forget = self.timeout * 10;
        self.seen
            .retain(|_, (_, t)| at.saturating_duration_since(*t) < forget);
        if status.role.takes_jobs() {
            self.model_heard.insert(status.model.clone(), at);
        }
        self.seen.insert(status.worker_id.clone(), (status, at));
    }

    /// A message from a known worker other than its heartbeat (a prefill worker's KV, say) shows
    /// it alive as its heartbeat would; its last status stays. An unknown worker stays unknown.
    pub fn heard_from_at(&mut self, worker_id: &str, at: Instant) {
        if let Some((_, t)) = self.seen.get_mut(worker_id) {
            *t = (*t).max(at);
        }
    }

    /// Whether some worker of `model` was heard from within `window` before `now`.
    pub fn model_heard_within(&self, model: &str, window: Duration, now: Instant) -> bool {
        self.model_heard
            .get(model)
            .is_some_and(|t| now.saturating_duration_since(*t) <= window)
    }

    /// Workers heard from within the timeout (as of `now`).
    pub fn live_at(&self, now: Instant) -> impl Iterator<Item = &WorkerStatus> {
        let timeout = self.timeout;
        self.seen
            .values()
            .filter(move |(_, t)| now.saturating_duration_since(*t) <= timeout)
            .map(|(s, _)| s)
    }

    /// Workers heard from within the timeout.
    pub fn live(&self) -> impl Iterator<Item = &WorkerStatus> {
        self.live_at(Instant::now())
    }

    /// Live workers serving `model`: those that take its jobs (not prefill workers).
    pub fn live_for<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a WorkerStatus> + 'a {
        self.live()
            .filter(move |s| s.model == model && s.role.takes_jobs())
    }

    /// The models live workers serve, sorted, once each.
    pub fn models(&self) -> Vec<String> {
        let mut m: Vec<String> = self
            .live()
            .filter(|s| s.role.takes_jobs())
            .map(|s| s.model.clone())
            .collect();
        m.sort();
        m.dedup();
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(id: &str, model: &str) -> WorkerStatus {
        WorkerStatus {
            worker_id: id.into(),
            model: model.into(),
            ..Default::default()
        }
    }

    #[test]
    fn silent_workers_leave_the_rotation() {
        let mut t = WorkerTable::new(Duration::from_secs(1));
        let t0 = Instant::now();
        t.update_at(status("a", "m"), t0);
        t.update_at(status("b", "n"), t0 + Duration::from_millis(900));
        let at = t0 + Duration::from_millis(1500);
        let live: Vec<&str> = t.live_at(at).map(|s| s.worker_id.as_str()).collect();
        assert_eq!(live, vec!["b"]);
        t.update_at(status("a", "m"), at);
        assert_eq!(t.live_at(at).count(), 2);
        // Forgotten entirely after ten timeouts.
        t.update_at(status("c", "m"), t0 + Duration::from_secs(20));
        assert_eq!(t.seen.len(), 1);
        // The model's last heartbeat outlives its workers' entries.
        let later = t0 + Duration::from_secs(50);
        assert!(t.model_heard_within("n", Duration::from_secs(60), later));
        assert!(!t.model_heard_within("n", Duration::from_secs(10), later));
        assert!(!t.model_heard_within("x", Duration::from_secs(60), later));
    }

    #[test]
    fn other_messages_keep_a_known_worker_alive() {
        let mut t = WorkerTable::new(Duration::from_secs(1));
        let t0 = Instant::now();
        t.update_at(status("a", "m"), t0);
        t.heard_from_at("a", t0 + Duration::from_millis(900));
        t.heard_from_at("stranger", t0 + Duration::from_millis(900));
        let ids = |at| {
            t.live_at(at)
                .map(|s| s.worker_id.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(t0 + Duration::from_millis(1800)), ["a"]);
        assert!(ids(t0 + Duration::from_millis(2000)).is_empty());
    }

    #[test]
    fn prefill_workers_do_not_serve_a_model() {
        let mut t = WorkerTable::new(Duration::from_secs(1));
        let t0 = Instant::now();
        t.update_at(
            WorkerStatus {
                role: crate::WorkerRole::Prefill,
                ..status("p", "m")
            },
            t0,
        );
        assert!(!t.model_heard_within("m", Duration::from_secs(5), t0));
        assert!(!t.models().contains(&"m".to_string()));
        assert_eq!(t.live_for("m").count(), 0);
        t.update_at(
            WorkerStatus {
                role: crate::WorkerRole::Decode,
                ..status("d", "m")
            },
            t0,
        );
        assert!(t.model_heard_within("m", Duration::from_secs(5), t0));
    }
}
