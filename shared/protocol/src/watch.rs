//! A client's watch over one request's stream: every accepted job ends with exactly one
//! terminal event, and a client must see it even when NATS drops events on the way (core NATS
//! does not replay what a client missed while it reconnected, nor what a server restart lost).
//!
//! Two rules, for the gateway and for llmq's NATS client alike:
//! - Events come with consecutive `seq`s: a gap means events were lost, and the request ends at
//!   once with `worker_lost` (its text would be wrong).
//! - A stream silent for a while is asked about (`subjects::JOB_STATE`): while intake finds the
//!   job in the jobs stream (waiting, or held by a worker that has not finished it) it is alive,
//!   and the client may tell its own client so; once it is not there and no terminal event came,
//!   that event was lost, and the request ends with `worker_lost`. A stream that nothing has
//!   shown alive (no event, no answer) for `bound` ends the same way.
//!
//! The caller cancels a request the watch ends, so that no worker goes on with it.

use std::time::{Duration, Instant};

use crate::{
    decode, encode, subjects, ErrorClass, JobQuery, JobState, StreamEvent, WireError,
    SEQ_FROM_ANOTHER_WORKER,
};

/// How long intake may take to answer a job query.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// What a silent stream turned out to be.
#[derive(Debug, Clone, PartialEq)]
pub enum Silence {
    /// The job is in the jobs stream: waiting or running.
    Alive,
    /// Nobody could tell (no answer), and the bound has not run out.
    Unknown,
}

/// One request's watch.
#[derive(Debug, Clone)]
pub struct Watch {
    request_id: String,
    /// `Accepted.job_seq` (None from an intake that does not give it: only the bound applies).
    job_seq: Option<u64>,
    next_seq: u64,
    last_alive: Instant,
    bound: Duration,
}

fn lost(message: String) -> WireError {
    WireError::new(ErrorClass::WorkerLost, message)
}

impl Watch {
    /// Watches `request_id` (accepted as `job_seq` in the jobs stream, when intake named it); a
    /// stream nothing shows alive for `bound` ends.
    pub fn new(request_id: &str, job_seq: Option<u64>, bound: Duration) -> Self {
        Watch {
            request_id: request_id.to_string(),
            job_seq,
            next_seq: 0,
            last_alive: Instant::now(),
            bound,
        }
    }

    /// An event came: an error if events were lost before it.
    pub fn event(&mut self, ev: &StreamEvent) -> Result<(), WireError> {
        self.last_alive = Instant::now();
        if ev.seq == SEQ_FROM_ANOTHER_WORKER {
            return Ok(());
        }
        if ev.seq != self.next_seq {
            return Err(lost(format!(
                "events {} to {} of this stream were lost on the way (a NATS reconnect?)",
                self.next_seq,
                ev.seq.saturating_sub(1)
            )));
        }
        self.next_seq += 1;
        Ok(())
    }

    /// The stream has been silent: asks intake where the job is. An error ends the request.
    pub async fn silent(&mut self, nc: &async_nats::Client) -> Result<Silence, WireError> {
        let answer = match self.job_seq {
            Some(job_seq) => ask(nc, &self.request_id, job_seq).await,
            None => None,
        };
        self.judge(answer, Instant::now())
    }

    /// The verdict on a silence, given intake's answer (None: none came) at `now`.
    pub fn judge(&mut self, answer: Option<JobState>, now: Instant) -> Result<Silence, WireError> {
        match answer {
            Some(JobState::Pending) => {
                self.last_alive = now;
                Ok(Silence::Alive)
            }
            Some(JobState::Gone) => Err(lost(
                "the job ended or was lost, and its terminal event never reached this client"
                    .into(),
            )),
            None if now.duration_since(self.last_alive) > self.bound => Err(lost(format!(
                "nothing showed this request alive for {} s",
                self.bound.as_secs()
            ))),
            None => Ok(Silence::Unknown),
        }
    }
}

/// Intake's answer about a job, if one came in time.
async fn ask(nc: &async_nats::Client, request_id: &str, job_seq: u64) -> Option<JobState> {
    let q = encode(&JobQuery {
        request_id: request_id.to_string(),
        job_seq,
    })
    .ok()?;
    let reply = tokio::time::timeout(QUERY_TIMEOUT, nc.request(subjects::JOB_STATE, q.into()))
        .await
        .ok()?
        .ok()?;
    decode(&reply.payload).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Event;

    fn ev(seq: u64) -> StreamEvent {
        StreamEvent {
            request_id: "r".into(),
            seq,
            event: Event::Queued { position: 0 },
            choice: 0,
        }
    }

    #[test]
    fn a_gap_in_the_events_ends_the_request() {
        let mut w = Watch::new("r", Some(1), Duration::from_secs(30));
        assert!(w.event(&ev(0)).is_ok() && w.event(&ev(1)).is_ok());
        assert!(
            w.event(&ev(SEQ_FROM_ANOTHER_WORKER)).is_ok(),
            "another worker's worker_lost has no place in the sequence"
        );
        let e = w.event(&ev(4)).unwrap_err();
        assert_eq!(e.class, ErrorClass::WorkerLost);
        assert!(e.message.contains("2 to 3"), "{}", e.message);
    }

    #[test]
    fn a_silent_stream_lives_while_its_job_is_pending_and_ends_when_it_is_gone_or_unknown_too_long()
    {
        let t0 = Instant::now();
        let mut w = Watch::new("r", Some(1), Duration::from_secs(30));
        assert_eq!(
            w.judge(Some(JobState::Pending), t0 + Duration::from_secs(50)),
            Ok(Silence::Alive)
        );
        // No answer: alive as long as the last sign of life is within the bound.
        assert_eq!(
            w.judge(None, t0 + Duration::from_secs(70)),
            Ok(Silence::Unknown)
        );
        assert!(w.judge(None, t0 + Duration::from_secs(81)).is_err());
        let mut w = Watch::new("r", Some(1), Duration::from_secs(30));
        assert_eq!(
            w.judge(Some(JobState::Gone), t0).unwrap_err().class,
            ErrorClass::WorkerLost
        );
    }
}
