//! Placement: how many jobs a worker may hold, from what its peers' heartbeats say.
//!
//! The jobs stream is one queue in front of all of a model's workers; each worker pulls. A
//! worker holds at most `max_batch` jobs (it can start each at once) while any live peer of its
//! model has a free slot, so no job waits on a busy worker while another could run it; only when
//! every live peer is full (or there is none) does it hold up to `max_queued`, its own queue.
//!
//! Invariants: a peer (one that takes jobs: not a prefill worker) counts as having room when
//! its running + waiting requests are fewer than its `max_batch` and some of its KV budget is
//! unreserved; a worker that has listened to the heartbeats for less than two periods assumes a
//! peer has room (it does not yet know its peers).

use std::time::{Duration, Instant};

use llmq_protocol::workers::WorkerTable;
use llmq_protocol::WorkerStatus;

pub struct Placement {
    peers: WorkerTable,
    me: String,
    model: String,
    heartbeat: Duration,
    listening_since: Instant,
    max_batch: usize,
    max_queued: usize,
}

impl Placement {
    /// Starts listening now; peers silent for three heartbeat periods count as gone.
    pub fn new(
        me: &str,
        model: &str,
        heartbeat: Duration,
        max_batch: usize,
        max_queued: usize,
    ) -> Self {
        Self::new_at(me, model, heartbeat, max_batch, max_queued, Instant::now())
    }

    pub fn new_at(
        me: &str,
        model: &str,
        heartbeat: Duration,
        max_batch: usize,
        max_queued: usize,
        now: Instant,
    ) -> Self {
        Placement {
            peers: WorkerTable::new(3 * heartbeat),
            me: me.to_string(),
            model: model.to_string(),
            heartbeat,
            listening_since: now,
            max_batch,
            max_queued,
        }
    }

    /// A heartbeat (this worker's own are ignored).
    pub fn heard_at(&mut self, status: WorkerStatus, at: Instant) {
        if status.worker_id != self.me {
            self.peers.update_at(status, at);
        }
    }

    fn peer_has_room_at(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.listening_since) < 2 * self.heartbeat
            || self.peers.live_at(now).any(|w| {
                w.model == self.model
                    && w.role.takes_jobs()
                    && w.active_streams + w.queued_requests < w.max_batch
                    && w.kv_bytes_free > 0
            })
    }

    /// How many jobs this worker may hold now.
    pub fn limit_at(&self, now: Instant) -> usize {
        if self.peer_has_room_at(now) {
            self.max_batch.min(self.max_queued)
        } else {
            self.max_queued
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: &str, model: &str, held: u32, kv_free: u64) -> WorkerStatus {
        WorkerStatus {
            worker_id: id.into(),
            model: model.into(),
            active_streams: held,
            max_batch: 4,
            kv_bytes_free: kv_free,
            ..Default::default()
        }
    }

    const HB: Duration = Duration::from_millis(100);

    #[test]
    fn holds_one_batch_while_a_peer_has_a_free_slot() {
        let t0 = Instant::now();
        let mut p = Placement::new_at("me", "m", HB, 4, 100, t0);
        let later = t0 + 3 * HB;
        p.heard_at(peer("b", "m", 3, 1), later);
        assert_eq!(p.limit_at(later), 4);
        // The peer fills up: now this worker keeps a queue of its own.
        p.heard_at(peer("b", "m", 4, 1), later);
        assert_eq!(p.limit_at(later), 100);
        // A slot but no KV to start anything counts as full.
        p.heard_at(peer("b", "m", 1, 0), later);
        assert_eq!(p.limit_at(later), 100);
    }

    #[test]
    fn alone_it_queues_but_not_before_it_knows_its_peers() {
        let t0 = Instant::now();
        let mut p = Placement::new_at("me", "m", HB, 4, 100, t0);
        assert_eq!(p.limit_at(t0 + HB), 4, "still listening");
        assert_eq!(p.limit_at(t0 + 2 * HB), 100, "no peer: its own queue");
        // Its own heartbeats and other models' workers do not count.
        p.heard_at(peer("me", "m", 0, 1), t0 + 2 * HB);
        p.heard_at(peer("x", "other", 0, 1), t0 + 2 * HB);
        assert_eq!(p.limit_at(t0 + 2 * HB), 100);
    }

    #[test]
    fn a_silent_peer_stops_counting() {
        let t0 = Instant::now();
        let mut p = Placement::new_at("me", "m", HB, 4, 100, t0);
        p.heard_at(peer("b", "m", 0, 1), t0 + 2 * HB);
        assert_eq!(p.limit_at(t0 + 3 * HB), 4);
        assert_eq!(
            p.limit_at(t0 + 6 * HB),
            100,
            "silent for over three periods"
        );
    }

    #[test]
    fn never_more_than_max_queued() {
        let t0 = Instant::now();
        let p = Placement::new_at("me", "m", HB, 64, 8, t0);
        assert_eq!(p.limit_at(t0), 8);
    }
}
