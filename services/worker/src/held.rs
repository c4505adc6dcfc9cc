//! The jobs a worker holds, and whether it may still speak for them.
//!
//! A held job is its JetStream message: acknowledged once its terminal event is out, kept with
//! progress acks meanwhile. The server hands a job to another worker when it has not heard an
//! ack for `worker.ack_wait_ms`, and that worker ends it with `worker_lost`. So a worker cut off
//! from the server (a partition, a stalled connection) must stop speaking for its jobs before
//! that can happen: once the server has not confirmed hearing it (its own heartbeat, sent after
//! the progress acks, coming back) for two thirds of the ack wait, the worker gives up every
//! job it holds. It
//! publishes nothing more for them (their events are dropped, the actor is told to cancel them)
//! and does not acknowledge them, so the server hands each to a worker that ends it: exactly one
//! terminal event per job, and a stream's tokens never resume after its `worker_lost`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::jetstream::Message;

/// `M`: a job's message (JetStream's; anything cloneable in tests).
pub struct Held<M = Message> {
    jobs: Mutex<HashMap<String, (M, tracing::Span)>>,
    /// Jobs given up whose terminal event has not come out of the actor yet.
    given_up: Mutex<HashSet<String>>,
    /// When the last round of acks that the server confirmed was sent.
    confirmed: Mutex<Instant>,
    /// Silence after which the jobs are given up.
    lost_after: Duration,
}

impl<M: Clone> Held<M> {
    pub fn new(ack_wait: Duration) -> Held<M> {
        Held {
            jobs: Mutex::default(),
            given_up: Mutex::default(),
            confirmed: Mutex::new(Instant::now()),
            lost_after: ack_wait * 2 / 3,
        }
    }

    pub fn insert(&self, request_id: String, msg: M, span: tracing::Span) {
        self.jobs.lock().unwrap().insert(request_id, (msg, span));
    }

    pub fn len(&self) -> usize {
        self.jobs.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The held jobs' messages, for progress acks.
    pub fn messages(&self) -> Vec<M> {
        self.jobs.lock().unwrap().values().map(|(m, _)| m.clone()).collect()
    }

    /// The server confirmed hearing what was sent up to `sent`.
    pub fn confirmed(&self, sent: Instant) {
        let mut c = self.confirmed.lock().unwrap();
        *c = (*c).max(sent);
    }

    /// Whether the worker may publish an event of `request_id` now. Gives every held job up when
    /// the server has been silent too long; returns the ids given up then (to cancel).
    pub fn may_publish(&self, request_id: &str, now: Instant) -> (bool, Vec<String>) {
        let mut given_up = self.given_up.lock().unwrap();
        let mut now_given_up = vec![];
        if now.saturating_duration_since(*self.confirmed.lock().unwrap()) >= self.lost_after {
            for (id, (_, span)) in self.jobs.lock().unwrap().drain() {
                span.record("error", "given up: the server did not hear this worker");
                given_up.insert(id.clone());
                now_given_up.push(id);
            }
        }
        (!given_up.contains(request_id), now_given_up)
    }

    /// The terminal event of `request_id` is out (or dropped, if it was given up): its message,
    /// to acknowledge, if it is still held.
    pub fn end(&self, request_id: &str) -> Option<(M, tracing::Span)> {
        self.given_up.lock().unwrap().remove(request_id);
        self.jobs.lock().unwrap().remove(request_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_silent_for_two_thirds_of_the_ack_wait_makes_the_worker_give_up_its_jobs() {
        let held = Held::<u32>::new(Duration::from_secs(6));
        let t0 = Instant::now();
        held.confirmed(t0);
        held.insert("a".into(), 1, tracing::Span::none());
        held.insert("b".into(), 2, tracing::Span::none());
        // Heard 3.9 s ago: still its jobs.
        assert_eq!(held.may_publish("a", t0 + Duration::from_millis(3900)), (true, vec![]));
        assert_eq!(held.messages().len(), 2);
        // A job that ends normally is handed back for its ack.
        assert_eq!(held.end("b").map(|(m, _)| m), Some(2));
        // Silent for 4 s: every held job is given up, and nothing more is published for it,
        // even once the server is heard again.
        assert_eq!(held.may_publish("a", t0 + Duration::from_secs(4)), (false, vec!["a".to_string()]));
        assert!(held.is_empty() && held.messages().is_empty());
        held.confirmed(t0 + Duration::from_secs(5));
        assert_eq!(held.may_publish("a", t0 + Duration::from_secs(5)), (false, vec![]));
        // Its terminal event (of the cancel) is dropped too; no ack, then it is forgotten.
        assert!(held.end("a").is_none());
        assert_eq!(held.may_publish("a", t0 + Duration::from_secs(5)), (true, vec![]));
        // New jobs after the reconnection are held normally.
        held.insert("c".into(), 3, tracing::Span::none());
        assert_eq!(held.may_publish("c", t0 + Duration::from_secs(6)), (true, vec![]));
    }
}
