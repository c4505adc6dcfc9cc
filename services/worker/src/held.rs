//! The jobs a worker holds, and whether it may still speak for them.
//!
//! A held job is its JetStream message: acknowledged once its terminal event is out, kept with
//! progress acks meanwhile. The server hands a job to another worker when it has not processed
//! an ack of it for `worker.ack_wait_ms` (W), and that worker ends it with `worker_lost`. So a
//! worker must stop speaking for a job before that can happen, however slow the server or the
//! link: each progress ack asks the server for a reply, sent once the server has processed it
//! (its consumer takes acks from a queue, so a reply to anything else proves nothing). A reply
//! counts only if it came within W/3 of the ack's sending and the ack left while the job was
//! still this worker's; the job stays this worker's for 2W/3 after the sending of the last ack
//! that counted (after the fetch that brought it, before any), and so always ends before the
//! server's W after processing that ack. Then the worker gives the job up: it publishes nothing
//! more for it (its events are dropped, the actor is told to cancel it) and does not acknowledge
//! it, so the server hands it to a worker that ends it: exactly one terminal event per job, and a
//! stream's tokens never resume after its `worker_lost`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::jetstream::Message;
use std::sync::Arc;

/// Jobs held here, by request id, until their terminal event is out, with their trace spans.
pub(crate) type Inflight = Arc<HeldJobs>;

struct Job<M> {
    msg: M,
    span: tracing::Span,
    /// Until when the worker may speak for it.
    ours_until: Instant,
}

/// `M`: a job's message (JetStream's; anything cloneable in tests).
pub struct HeldJobs<M = Message> {
    jobs: Mutex<HashMap<String, Job<M>>>,
    /// Jobs given up whose terminal event has not come out of the actor yet.
    given_up: Mutex<HashSet<String>>,
    /// How long after an ack's sending the job stays this worker's (2W/3).
    ours_for: Duration,
    /// How long a reply to an ack may take and still count (W/3).
    reply_within: Duration,
}

impl<M: Clone> HeldJobs<M> {
    pub fn new(ack_wait: Duration) -> HeldJobs<M> {
        HeldJobs {
            jobs: Mutex::default(),
            given_up: Mutex::default(),
            ours_for: ack_wait * 2 / 3,
            reply_within: ack_wait / 3,
        }
    }

    /// Holds a job whose message came in answer to a fetch sent at `fetched`.
    pub fn insert(&self, request_id: String, msg: M, span: tracing::Span, fetched: Instant) {
        self.jobs.lock().unwrap().insert(
            request_id,
            Job {
                msg,
                span,
                ours_until: fetched + self.ours_for,
            },
        );
    }

    /// How long a reply to a progress ack may take and still count.
    pub fn reply_within(&self) -> Duration {
        self.reply_within
    }

    pub fn len(&self) -> usize {
        self.jobs.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The held jobs' messages by request id, for progress acks.
    pub fn messages(&self) -> Vec<(String, M)> {
        self.jobs
            .lock()
            .unwrap()
            .iter()
            .map(|(id, j)| (id.clone(), j.msg.clone()))
            .collect()
    }

    /// The server replied at `replied` to a progress ack of `request_id` sent at `sent`.
    pub fn confirmed(&self, request_id: &str, sent: Instant, replied: Instant) {
        if replied.saturating_duration_since(sent) > self.reply_within {
            return;
        }
        if let Some(job) = self.jobs.lock().unwrap().get_mut(request_id) {
            if sent < job.ours_until {
                job.ours_until = job.ours_until.max(sent + self.ours_for);
            }
        }
    }

    /// Whether the worker may publish an event of `request_id` now. Gives up every held job
    /// whose time is over; returns the ids given up then (to cancel).
    pub fn may_publish(&self, request_id: &str, now: Instant) -> (bool, Vec<String>) {
        let mut given_up = self.given_up.lock().unwrap();
        let mut now_given_up = vec![];
        self.jobs.lock().unwrap().retain(|id, job| {
            let ours = now < job.ours_until;
            if !ours {
                job.span.record(
                    "error",
                    "given up: the server did not confirm this worker's acks in time",
                );
                given_up.insert(id.clone());
                now_given_up.push(id.clone());
            }
            ours
        });
        (!given_up.contains(request_id), now_given_up)
    }

    /// The terminal event of `request_id` is out (or dropped, if it was given up): its message,
    /// to acknowledge, if it is still held.
    pub fn end(&self, request_id: &str) -> Option<(M, tracing::Span)> {
        self.given_up.lock().unwrap().remove(request_id);
        self.jobs
            .lock()
            .unwrap()
            .remove(request_id)
            .map(|j| (j.msg, j.span))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_job_is_given_up_two_thirds_of_the_ack_wait_after_its_last_confirmed_ack() {
        let held = HeldJobs::<u32>::new(Duration::from_secs(6));
        let t0 = Instant::now();
        held.insert("a".into(), 1, tracing::Span::none(), t0);
        held.insert("b".into(), 2, tracing::Span::none(), t0);
        // Fetched 3.9 s ago, no ack yet: still its jobs.
        assert_eq!(held.may_publish("a", t0 + S(3900)), (true, vec![]));
        assert_eq!(held.messages().len(), 2);
        // "a"'s ack sent at 1 s, answered at 1.2 s: "a" is ours until 5 s; "b" had no answer.
        held.confirmed("a", t0 + S(1000), t0 + S(1200));
        let (ok, gone) = held.may_publish("a", t0 + S(4500));
        assert_eq!((ok, gone), (true, vec!["b".to_string()]));
        assert_eq!(held.may_publish("b", t0 + S(4500)), (false, vec![]));
        // A job that ends normally is handed back for its ack.
        assert_eq!(held.end("a").map(|(m, _)| m), Some(1));
        // "b"'s terminal event (of the cancel) is dropped too; no ack, then it is forgotten.
        assert!(held.end("b").is_none());
        assert_eq!(held.may_publish("b", t0 + S(4600)), (true, vec![]));
        assert!(held.is_empty());
    }

    #[test]
    fn a_late_reply_or_an_ack_sent_after_the_job_was_lost_does_not_count() {
        let held = HeldJobs::<u32>::new(Duration::from_secs(6));
        let t0 = Instant::now();
        held.insert("a".into(), 1, tracing::Span::none(), t0);
        // Answered 2.1 s after its sending: the server may have processed it after redelivering.
        held.confirmed("a", t0 + S(1000), t0 + S(3100));
        assert_eq!(
            held.may_publish("a", t0 + S(4000)),
            (false, vec!["a".to_string()])
        );
        held.end("a");
        held.insert("b".into(), 2, tracing::Span::none(), t0);
        // Sent at 4 s, when "b" was no longer ours (nothing had counted since the fetch).
        held.confirmed("b", t0 + S(4000), t0 + S(4010));
        assert_eq!(
            held.may_publish("b", t0 + S(4020)),
            (false, vec!["b".to_string()])
        );
        held.end("b");
        // A chain of prompt replies keeps a job for as long as it runs.
        held.insert("c".into(), 3, tracing::Span::none(), t0);
        for k in 1..=20 {
            held.confirmed("c", t0 + S(1000 * k), t0 + S(1000 * k + 50));
            assert_eq!(
                held.may_publish("c", t0 + S(1000 * k + 3900)),
                (true, vec![])
            );
        }
    }
}
