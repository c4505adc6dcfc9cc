//! The scheduler's test bench: a fake executor (one token per decode step, each request done after
//! its max_tokens; options for chunks in stages and first tokens deferred) and a harness with a
//! fake clock. No model, no NATS.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use llmq_protocol::{Event, FinishReason, WireError};
use llmq_scheduler::*;

/// Produces one token per decode step and finishes each request after its max_tokens.
#[derive(Default)]
pub struct FakeExecutor {
    pub max_tokens: HashMap<ReqId, usize>,
    pub produced: HashMap<ReqId, usize>,
    pub prefilled: HashMap<ReqId, usize>,
    pub prompt: HashMap<ReqId, usize>,
    pub live: HashSet<ReqId>,
    pub released: Vec<ReqId>,
    pub prefill_calls: Vec<(ReqId, usize)>,
    pub decode_calls: Vec<Vec<ReqId>>,
    /// Like an executor whose prefill chunks ride in decode steps queued ahead: a chunk that
    /// completes its prompt gives no token; the request's first decode step gives its first.
    pub defer_first: bool,
    /// Like an executor that spreads a chunk's layers over this many ticks while rows decode:
    /// the chunk is `Pending` until its last one.
    pub stages: usize,
    /// (request, stages run) of the chunk in flight.
    pub stage: Option<(ReqId, usize)>,
    /// Every chunk granted beside decode rows, with whether it was still pending after.
    pub grants: Vec<(ReqId, usize, bool)>,
    /// Prompt tokens a request finds in the prefix cache at admission.
    pub cached: HashMap<ReqId, usize>,
    /// Every preemption, in order.
    pub preempted: Vec<ReqId>,
    /// A preempted request's tokens to prefill again: its prompt and what it generated.
    pub resume: HashMap<ReqId, usize>,
}

impl FakeExecutor {
    /// Tokens `id`'s prefill must reach.
    fn target(&self, id: ReqId) -> usize {
        self.resume.get(&id).copied().unwrap_or(self.prompt[&id])
    }
    fn token(&mut self, id: ReqId) -> StepOut {
        let n = self.produced.entry(id).or_default();
        *n += 1;
        let finished = (*n >= self.max_tokens[&id]).then_some(FinishReason::Length);
        StepOut {
            ids: vec![*n as u32],
            text: format!("t{n} "),
            logprobs: vec![],
            finished,
        }
    }
}

impl Executor for FakeExecutor {
    async fn admit(&mut self, id: ReqId) -> usize {
        self.live.insert(id);
        let hit = self.cached.get(&id).copied().unwrap_or(0);
        if hit > 0 {
            self.prefilled.insert(id, hit);
        }
        hit
    }
    async fn prefill(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError> {
        self.live.insert(id);
        self.prefill_calls.push((id, n));
        let done = self.prefilled.entry(id).or_default();
        *done += n;
        let done = *done;
        let target = self.target(id);
        assert!(done <= target, "prefilled past the prompt");
        let complete = done == target;
        Ok((complete && !self.defer_first).then(|| self.token(id)))
    }
    async fn decode(&mut self, ids: &[ReqId]) -> Vec<Result<StepOut, WireError>> {
        self.decode_calls.push(ids.to_vec());
        ids.iter().map(|&id| Ok(self.token(id))).collect()
    }
    async fn step(
        &mut self,
        decode: &[ReqId],
        prefill: Option<(ReqId, usize)>,
    ) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        if let (Some((id, n)), false) = (prefill, decode.is_empty()) {
            let ran = match self.stage {
                Some((s, k)) => {
                    assert_eq!(s, id, "another chunk granted while one is in flight");
                    k + 1
                }
                None => 1,
            };
            if ran < self.stages {
                self.stage = Some((id, ran));
                self.grants.push((id, n, true));
                return (self.decode(decode).await, Some(Ok(Prefilled::Pending)));
            }
            self.stage = None;
            self.grants.push((id, n, false));
        }
        step_separately(self, decode, prefill).await
    }
    async fn preempt(&mut self, ids: &[ReqId]) {
        for &id in ids {
            assert!(
                self.live.contains(&id),
                "preempted {id}, which holds nothing"
            );
            self.preempted.push(id);
            let produced = self.produced.get(&id).copied().unwrap_or(0);
            self.resume.insert(id, self.prompt[&id] + produced);
            self.prefilled.insert(id, 0);
            if self.stage.is_some_and(|(s, _)| s == id) {
                self.stage = None;
            }
        }
    }
    async fn release(&mut self, ids: &[ReqId]) {
        for &id in ids {
            assert!(
                self.live.remove(&id) || !self.prefilled.contains_key(&id),
                "released twice: {id}"
            );
            self.released.push(id);
        }
    }
}

pub struct Harness {
    pub s: Scheduler,
    pub e: FakeExecutor,
    pub now: Duration,
    pub events: Vec<Emit>,
    pub reports: Vec<TickReport>,
    /// Fake clock: what each prefill token adds to a tick.
    pub per_token: Duration,
    /// Fake clock: each tick's duration, in order.
    pub ticks: Vec<Duration>,
}

impl Harness {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Harness {
            s: Scheduler::new(cfg),
            e: FakeExecutor::default(),
            now: Duration::ZERO,
            events: vec![],
            reports: vec![],
            per_token: Duration::from_micros(100),
            ticks: vec![],
        }
    }
    pub fn submit(&mut self, id: ReqId, prompt: usize, max_tokens: usize) {
        self.submit_after(id, prompt, max_tokens, None);
    }
    /// A request admitted only once `after`'s prompt is complete (another sample of it).
    pub fn submit_after(
        &mut self,
        id: ReqId,
        prompt: usize,
        max_tokens: usize,
        after: Option<ReqId>,
    ) {
        self.e.max_tokens.insert(id, max_tokens);
        self.e.prompt.insert(id, prompt);
        let a = Admission {
            id,
            prompt_tokens: prompt,
            max_tokens,
            accepted_at: self.now,
            after,
        };
        let ev = self.s.submit(a);
        self.events.extend(ev);
    }
    /// One tick; the fake clock advances 10 ms per decode step plus `per_token` (0.1 ms) per
    /// prefill token.
    pub fn tick(&mut self) -> (Vec<Emit>, TickReport) {
        let (ev, rep) = futures::executor::block_on(self.s.tick(&mut self.e, self.now));
        let took = Duration::from_millis(if rep.decoded > 0 { 10 } else { 0 })
            + self.per_token * rep.prefill_tokens as u32;
        self.now += took;
        self.ticks.push(took);
        self.events.extend(ev.clone());
        self.reports.push(rep.clone());
        (ev, rep)
    }
    /// One tick in which `stream`, the only one decoding, steps and gets a token (`i`: the
    /// tick's number, for messages).
    pub fn tick_streaming(&mut self, stream: ReqId, i: usize) -> TickReport {
        let (ev, rep) = self.tick();
        assert_eq!(rep.decoded, 1, "tick {i}: the active stream steps");
        assert!(
            ev.iter()
                .any(|e| e.id == stream && matches!(e.event, Event::Tokens { .. })),
            "tick {i}: token for stream {stream}"
        );
        rep
    }
    pub fn run_until_idle(&mut self, max_ticks: usize) {
        for _ in 0..max_ticks {
            if self.s.is_idle() {
                return;
            }
            self.tick();
        }
        panic!("not idle after {max_ticks} ticks");
    }
    pub fn of(&self, id: ReqId) -> Vec<&Event> {
        self.events
            .iter()
            .filter(|e| e.id == id)
            .map(|e| &e.event)
            .collect()
    }
    /// Every request ended with exactly one terminal event, last; nothing is held any more.
    pub fn assert_all_ended(&self, ids: &[ReqId]) {
        for &id in ids {
            let ev = self.of(id);
            let terminals = ev.iter().filter(|e| e.is_terminal()).count();
            assert_eq!(terminals, 1, "request {id}: {ev:?}");
            assert!(
                ev.last().unwrap().is_terminal(),
                "request {id}: terminal not last"
            );
        }
        assert_eq!(self.s.held_kv_bytes(), 0);
        assert_eq!(self.s.pool().used(), 0);
        assert!(
            self.e.live.is_empty(),
            "executor still holds {:?}",
            self.e.live
        );
    }
}

pub fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        kv_bytes_per_token: 1,
        kv_budget_bytes: 1 << 20,
        block_tokens: 16,
        ..Default::default()
    }
}

impl Harness {
    pub fn run_until_idle_or(&mut self, stop: impl Fn(&Harness) -> bool, max_ticks: usize) {
        for _ in 0..max_ticks {
            if self.s.is_idle() || stop(self) {
                return;
            }
            self.tick();
        }
        panic!("condition not reached");
    }
}
