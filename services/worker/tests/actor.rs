//! The scheduler actor with a fake engine: a panic inside a tick never escapes the actor; the
//! requests it held end with an `Error`, and the actor goes on serving.

use std::collections::HashMap;
use std::time::Duration;

use actix::prelude::*;
use llmq_protocol::*;
use llmq_scheduler::*;
use llmq_text::sampling::{Sampling, StopConditions};
use llmq_worker::actor::{CallTimes, WorkerExecutor};
use llmq_worker::actor::{Outbound, SchedulerActor, Submit};
use llmq_worker::seq::SeqSpec;

/// One token per step; panics when it decodes a request whose prompt has 13 tokens. With
/// `ticks` above 1 it is like a decode actor that spreads a chunk's layers over `ticks` steps
/// while rows decode: a chunk beside decode rows is `Pending` until its last step. Logs each
/// step as the prompt lengths of its decode rows and of its chunk's request.
#[derive(Default)]
struct Fake {
    ticks: usize,
    prompt: HashMap<ReqId, usize>,
    max: HashMap<ReqId, usize>,
    made: HashMap<ReqId, usize>,
    done: HashMap<ReqId, usize>,
    stage: usize,
    log: std::sync::Arc<std::sync::Mutex<Vec<TickSeen>>>,
}

/// A tick as the fake executor saw it: its decode rows' and its chunk's prompt lengths.
#[derive(Debug, Clone)]
struct TickSeen {
    rows: Vec<usize>,
    chunk: Option<usize>,
}

impl Fake {
    fn token(&mut self, id: ReqId) -> StepOut {
        let n = self.made.entry(id).or_default();
        *n += 1;
        let finished = (*n >= self.max[&id]).then_some(FinishReason::Length);
        StepOut {
            ids: vec![*n as u32],
            text: "x".into(),
            logprobs: vec![],
            finished,
        }
    }
}

impl Executor for Fake {
    async fn preempt(&mut self, ids: &[ReqId]) {
        for id in ids {
            self.done.remove(id);
        }
    }
    async fn prefill(&mut self, id: ReqId, n: usize) -> Result<Option<StepOut>, WireError> {
        let done = self.done.entry(id).or_default();
        *done += n;
        Ok((*done >= self.prompt[&id]).then(|| self.token(id)))
    }
    async fn decode(&mut self, ids: &[ReqId]) -> Vec<Result<StepOut, WireError>> {
        if ids.iter().any(|id| self.prompt[id] == 13) {
            panic!("injected fault");
        }
        ids.iter().map(|&id| Ok(self.token(id))).collect()
    }
    async fn step(
        &mut self,
        decode: &[ReqId],
        prefill: Option<(ReqId, usize)>,
    ) -> (Vec<Result<StepOut, WireError>>, Option<PrefillResult>) {
        let rows = decode.iter().map(|id| self.prompt[id]).collect();
        self.log.lock().unwrap().push(TickSeen {
            rows,
            chunk: prefill.map(|(id, _)| self.prompt[&id]),
        });
        if prefill.is_some() && !decode.is_empty() {
            self.stage += 1;
            if self.stage < self.ticks {
                return (self.decode(decode).await, Some(Ok(Prefilled::Pending)));
            }
            self.stage = 0;
        }
        step_separately(self, decode, prefill).await
    }
    async fn release(&mut self, ids: &[ReqId]) {
        for id in ids {
            self.prompt.remove(id);
        }
    }
}

impl WorkerExecutor for Fake {
    async fn register(&mut self, id: ReqId, spec: SeqSpec) -> Result<(), WireError> {
        self.prompt.insert(id, spec.prompt.len());
        self.max.insert(id, spec.stop.max_tokens as usize);
        Ok(())
    }
    async fn reset(&mut self) {
        self.prompt.clear();
    }
    fn kv_bytes_per_token(&self) -> u64 {
        1
    }
    fn kv_bytes_in_use(&self) -> u64 {
        0
    }
    fn context_tokens(&self) -> usize {
        4096
    }
    fn chunk_ticks(&self, _n: usize) -> usize {
        self.ticks.max(1)
    }
    fn engine_ms(&self) -> f64 {
        0.0
    }
    fn call_times(&self) -> CallTimes {
        CallTimes::default()
    }
}

fn job(id: &str, prompt_len: usize, max_tokens: u32) -> Job {
    Job {
        request_id: id.into(),
        model: "fake".into(),
        prompt_ids: vec![1; prompt_len],
        sampling: Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            logprobs: false,
            top_logprobs: 0,
        },
        stop: StopConditions {
            max_tokens,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
            special_text: false,
        },
        stream_subject: format!("s.{id}"),
        accepted_at_ms: 0,
        cache_salt: None,
        constraint: None,
        n: 1,
    }
}

async fn until_terminal(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Outbound>,
    id: &str,
    seen: &mut HashMap<String, Vec<Event>>,
) -> Event {
    loop {
        if let Some(ev) = seen
            .get(id)
            .and_then(|v| v.iter().find(|e| e.is_terminal()))
        {
            return ev.clone();
        }
        let o = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("event")
            .expect("open");
        seen.entry(o.request_id).or_default().push(o.event.event);
    }
}

#[test]
fn a_panic_in_a_tick_fails_the_held_requests_and_the_actor_goes_on() {
    actix::System::new().block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cfg = SchedulerConfig {
            kv_budget_bytes: 1 << 20,
            ..Default::default()
        };
        let addr = SchedulerActor::new(Fake::default(), cfg, tx, "w".into(), "fake".into()).start();
        addr.do_send(Submit {
            job: job("a", 5, 1000),
            first_seq: 0,
        });
        addr.do_send(Submit {
            job: job("poison", 13, 1000),
            first_seq: 0,
        });
        let mut seen = HashMap::new();
        for id in ["a", "poison"] {
            match until_terminal(&mut rx, id, &mut seen).await {
                Event::Error { error } => {
                    assert_eq!(error.class, ErrorClass::Internal, "{id}: {error}")
                }
                e => panic!("{id}: {e:?}"),
            }
        }
        for id in ["a", "poison"] {
            assert_eq!(
                seen[id].iter().filter(|e| e.is_terminal()).count(),
                1,
                "{id}: exactly one terminal event"
            );
        }
        addr.do_send(Submit {
            job: job("after", 5, 3),
            first_seq: 0,
        });
        assert!(
            matches!(
                until_terminal(&mut rx, "after", &mut seen).await,
                Event::Done { .. }
            ),
            "the actor still serves"
        );
    });
}

/// The warm-up runs its dummy requests through the real engine (tiny Llama) and leaves nothing
/// behind: no KV, no cached prefix, no counted calls, no events.
#[test]
fn warm_up_leaves_nothing_behind() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    let loaded = llmq_engine::load_model(&dir, mlx_rs::Dtype::Float32).unwrap();
    actix::System::new().block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let opts = llmq_worker::roles::RoleOptions {
            prefix: Some(llmq_worker::roles::PrefixOptions {
                block_tokens: 16,
                max_bytes: 1 << 30,
            }),
            ..Default::default()
        };
        let engine = llmq_worker::roles::RoleActors::start(loaded.model, loaded.tokenizer, opts);
        let cfg = SchedulerConfig {
            prefill_chunk: 16,
            kv_budget_bytes: 1 << 30,
            ..Default::default()
        };
        let addr = SchedulerActor::new(engine, cfg, tx, "w".into(), "tiny".into()).start();
        let ms = addr
            .send(llmq_worker::actor::WarmUp {
                tokens: 40,
                rows: vec![1, 3],
            })
            .await
            .unwrap()
            .unwrap();
        assert!(ms > 0.0);
        let s = addr.send(llmq_worker::actor::GetStatus).await.unwrap();
        assert_eq!(
            (
                s.kv_bytes_used,
                s.prefix_entries,
                s.prefix_reused_tokens,
                s.prefill_calls,
                s.decode_calls
            ),
            (0, 0, 0, 0, 0),
            "{s:?}"
        );
        assert_eq!((s.active_streams, s.queued_requests), (0, 0));
        assert!(rx.try_recv().is_err(), "the warm-up publishes nothing");
    });
}

fn long_job(id: &str, prompt_len: usize, max_tokens: u32) -> Job {
    let mut j = job(id, prompt_len, max_tokens);
    j.model = "tiny".into();
    j.prompt_ids = (0..prompt_len as u32).map(|i| 3 + i % 40).collect();
    j.stop.ignore_eos = true;
    j
}

/// The real role actors (tiny Llama): a panic inside the prefill actor ends the request it was
/// prefilling with an `Error` while a decoding stream goes on; a panic inside the decode actor
/// ends that stream; the worker then serves a new request, and no KV is left behind.
#[test]
fn a_panicking_role_actor_fails_its_own_requests_and_the_rest_go_on() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    let loaded = llmq_engine::load_model(&dir, mlx_rs::Dtype::Float32).unwrap();
    actix::System::new().block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let engine = llmq_worker::roles::RoleActors::start(
            loaded.model,
            loaded.tokenizer,
            Default::default(),
        );
        let (prefill, decode) = (engine.prefill.clone(), engine.decode.clone());
        let cfg = SchedulerConfig {
            prefill_chunk: 8,
            kv_budget_bytes: 1 << 30,
            ..Default::default()
        };
        let addr = SchedulerActor::new(engine, cfg, tx, "w".into(), "tiny".into()).start();
        let mut seen: HashMap<String, Vec<Event>> = HashMap::new();
        let until = |seen: &HashMap<String, Vec<Event>>, id: &str, f: &dyn Fn(&Event) -> bool| {
            seen.get(id).is_some_and(|v| v.iter().any(f))
        };
        async fn pump(
            rx: &mut tokio::sync::mpsc::UnboundedReceiver<Outbound>,
            seen: &mut HashMap<String, Vec<Event>>,
        ) {
            let o = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("event")
                .expect("open");
            seen.entry(o.request_id).or_default().push(o.event.event);
        }
        let tokens = |seen: &HashMap<String, Vec<Event>>, id: &str| {
            seen.get(id).map_or(0, |v| {
                v.iter()
                    .filter(|e| matches!(e, Event::Tokens { .. }))
                    .count()
            })
        };

        addr.do_send(Submit {
            job: long_job("a", 10, 400),
            first_seq: 0,
        });
        while !until(&seen, "a", &|e| matches!(e, Event::Tokens { .. })) {
            pump(&mut rx, &mut seen).await;
        }
        // "c" prefills in 8-token chunks beside "a"'s decode; mid-prefill, the prefill actor panics.
        addr.do_send(Submit {
            job: long_job("c", 480, 8),
            first_seq: 0,
        });
        while !until(&seen, "c", &|e| matches!(e, Event::PrefillProgress { .. })) {
            pump(&mut rx, &mut seen).await;
        }
        prefill.do_send(llmq_worker::roles::messages::InjectPanic);
        let c = until_terminal(&mut rx, "c", &mut seen).await;
        match &c {
            Event::Error { error } => assert!(
                error.class == ErrorClass::Internal && error.message.contains("fault in prefill"),
                "{error}"
            ),
            e => panic!("c ended with {e:?}"),
        }
        assert!(
            !until(&seen, "a", &|e| e.is_terminal()),
            "a is not disturbed"
        );
        let before = tokens(&seen, "a");
        while tokens(&seen, "a") < before + 3 {
            pump(&mut rx, &mut seen).await;
        }
        // Now the decode actor panics: "a" ends with an error.
        decode.do_send(llmq_worker::roles::messages::InjectPanic);
        match until_terminal(&mut rx, "a", &mut seen).await {
            Event::Error { error } => assert!(
                error.class == ErrorClass::Internal && error.message.contains("fault in decode"),
                "{error}"
            ),
            e => panic!("a ended with {e:?}"),
        }
        // The worker goes on, and holds nothing of the failed requests.
        addr.do_send(Submit {
            job: long_job("d", 20, 5),
            first_seq: 0,
        });
        assert!(matches!(
            until_terminal(&mut rx, "d", &mut seen).await,
            Event::Done { .. }
        ));
        for id in ["a", "c", "d"] {
            assert_eq!(
                seen[id].iter().filter(|e| e.is_terminal()).count(),
                1,
                "{id}: exactly one terminal event"
            );
        }
        let s = addr.send(llmq_worker::actor::GetStatus).await.unwrap();
        assert_eq!(
            (s.kv_bytes_used, s.active_streams, s.queued_requests),
            (0, 0, 0),
            "{s:?}"
        );
    });
}

/// With chunks that take several ticks each, the warm-up's short requests still decode beside
/// every chunk of both long prompts, and the first long prompt decodes beside the second's
/// first chunk: the steps a burst meets have all run (an H200 otherwise paid 30-40 ms for the
/// first of them in a burst).
#[test]
fn the_warm_up_keeps_short_rows_decoding_through_long_prefills_in_staged_chunks() {
    actix::System::new().block_on(async {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let engine = Fake {
            ticks: 4,
            ..Default::default()
        };
        let log = engine.log.clone();
        let cfg = SchedulerConfig {
            prefill_chunk: 16,
            kv_budget_bytes: 1 << 30,
            ..Default::default()
        };
        let addr = SchedulerActor::new(engine, cfg, tx, "w".into(), "fake".into()).start();
        addr.send(llmq_worker::actor::WarmUp {
            tokens: 64,
            rows: vec![1, 3],
        })
        .await
        .unwrap()
        .unwrap();
        let log = log.lock().unwrap();
        let (long, short) = (64, 16);
        let beside_rows: Vec<&Vec<usize>> = log
            .iter()
            .filter(|t| t.chunk == Some(long) && !t.rows.is_empty())
            .map(|t| &t.rows)
            .collect();
        assert_eq!(
            beside_rows.len(),
            2 * 2 * 4 * 4,
            "two rounds of two long prompts, four chunks of four ticks each"
        );
        for rows in &beside_rows {
            assert!(
                rows.contains(&short),
                "a long prompt's chunk with no short row decoding: {rows:?}"
            );
        }
        let with_both = beside_rows
            .iter()
            .filter(|rows| rows.contains(&long) && rows.contains(&short))
            .count();
        assert_eq!(
            with_both,
            2 * 4 * 4,
            "the first long prompt decodes beside every tick of the second's chunks"
        );
    });
}
