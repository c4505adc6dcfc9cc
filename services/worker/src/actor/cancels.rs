//! Cancels of requests this worker does not hold (yet): a job still waiting in the jobs stream
//! when its cancel went out is ended with [`Cancelled`] when it arrives, instead of run.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How long a cancel for a request not held here is remembered (the cancels stream keeps them
/// as long, for workers that start later).
pub const CANCEL_MEMORY: Duration = Duration::from_secs(3600);

/// Request ids cancelled while not held, each forgotten `CANCEL_MEMORY` after it came (in
/// arrival order, O(1) each). Invariant: every id in `at` has an entry in `order` with the same
/// instant; `order` may also hold entries already taken or superseded.
#[derive(Default)]
pub(super) struct RecentCancels {
    at: HashMap<String, Instant>,
    order: VecDeque<(Instant, String)>,
}

impl RecentCancels {
    pub(super) fn remember(&mut self, request_id: String, now: Instant) {
        while let Some((t, id)) = self.order.front() {
            if now.duration_since(*t) < CANCEL_MEMORY {
                break;
            }
            if self.at.get(id) == Some(t) {
                self.at.remove(id);
            }
            self.order.pop_front();
        }
        self.at.insert(request_id.clone(), now);
        self.order.push_back((now, request_id));
    }

    /// Whether `request_id` was cancelled (and forgets it).
    pub(super) fn take(&mut self, request_id: &str) -> bool {
        self.at.remove(request_id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn recent_cancels_are_taken_once_and_forgotten_after_the_memory() {
        let t0 = Instant::now();
        let mut c = RecentCancels::default();
        c.remember("a".into(), t0);
        c.remember("b".into(), t0 + Duration::from_secs(1));
        assert!(c.take("a"));
        assert!(!c.take("a"), "taken once");
        // A later cancel forgets what is older than the memory, and only that.
        c.remember("c".into(), t0 + CANCEL_MEMORY + Duration::from_millis(500));
        assert!(c.take("b"), "b is younger than the memory");
        c.remember("d".into(), t0 + CANCEL_MEMORY + Duration::from_secs(2));
        assert_eq!(c.at.len(), 2);
        assert!(c.take("c") && c.take("d"));
        // Remembered again later: the newer instant keeps it.
        c.remember("e".into(), t0);
        c.remember("e".into(), t0 + CANCEL_MEMORY);
        c.remember("f".into(), t0 + CANCEL_MEMORY + Duration::from_secs(1));
        assert!(c.take("e"), "the second cancel of e is still remembered");
    }
}
