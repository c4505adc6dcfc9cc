//! The scheduler driving the real engine (SmolLM2, and the hybrid fixtures tiny-lfm2 and
//! tiny-qwen35): chunked and interleaved prefill gives the
//! same greedy tokens as one-piece generation (also with chunks, final ones included, sharing
//! decode steps queued ahead, padded to a grid, spread over steps in stages of fixed or varying
//! layers, and beside a sampled request, which turns
//! queuing ahead off while it decodes), and all KV memory comes back. The engine is the
//! worker's: its prefill, decode and cache actors, driven through their messages.

mod common;

use common::{greedy_alone, model_path};

use std::time::Instant;

use llmq_engine::load_model;
use llmq_protocol::Event;
use llmq_scheduler::{Admission, Scheduler, SchedulerConfig};
use llmq_text::sampling::{Sampling, StopConditions};
use llmq_worker::actor::WorkerExecutor;
use llmq_worker::roles::{RoleActors, RoleOptions};
use llmq_worker::seq::SeqSpec;
use mlx_rs::Dtype;

#[test]
fn chunked_interleaved_prefill_gives_the_same_greedy_tokens() {
    check_interleaved("smollm2");
}

/// The same for the hybrid families, whose recurrent states go through every path too (but the
/// grid: their chunks are never padded).
#[test]
fn chunked_interleaved_prefill_of_hybrid_models_gives_the_same_greedy_tokens() {
    check_interleaved("tiny-lfm2");
    check_interleaved("tiny-qwen35");
}

fn check_interleaved(model: &'static str) {
    let loaded = load_model(&model_path(model), Dtype::Float32).unwrap();
    let recurrent = loaded.model.config.recurrent();
    let tok = loaded.tokenizer.as_ref().unwrap();
    let prompts = [
        tok.prompt_ids("What is the capital of France?", true)
            .unwrap(),
        tok.prompt_ids("Write one sentence about the sea.", true)
            .unwrap(),
        tok.prompt_ids("List three fruits.", true).unwrap(),
    ];
    let stop = StopConditions {
        max_tokens: 12,
        ..Default::default()
    };
    let alone = greedy_alone(&loaded.model, tok, &prompts, &stop);

    // With decode steps queued ahead (the default; prefill chunks then share the queued steps),
    // without, with chunks padded to a grid as on a GPU, and with a sampled request among the
    // greedy ones.
    // Last, with each chunk's layers spread over two or three decode steps (`prefill_chunk_stages`),
    // and with a tick budget no step can keep (1.01), so each step's share of a chunk is sized
    // from measured times, down to one token's worth: stages of varying layers.
    for (ahead, grid, with_sampled, stages, budget) in [
        (true, 1, false, 1, 0.0),
        (false, 1, false, 1, 0.0),
        (true, 8, false, 1, 0.0),
        (true, 1, true, 1, 0.0),
        (true, 8, false, 2, 0.0),
        (true, 1, true, 2, 0.0),
        (false, 1, true, 3, 0.0),
        (true, 1, false, 2, 1.01),
    ] {
        if recurrent && grid > 1 {
            continue;
        }
        let case = Interleaved {
            model,
            ahead,
            grid,
            with_sampled,
            stages,
            budget,
        };
        actix::System::new().block_on(case.run(&prompts, &alone, &stop, tok));
    }
}

/// One way of running `chunked_interleaved_prefill_gives_the_same_greedy_tokens`'s prompts.
struct Interleaved {
    model: &'static str,
    ahead: bool,
    grid: usize,
    with_sampled: bool,
    stages: usize,
    budget: f64,
}

impl Interleaved {
    const SAMPLED: u64 = 10;

    /// Runs the prompts through the scheduler and the actors, arrivals spread over ticks; checks
    /// their greedy tokens against `alone` and that nothing is left held.
    async fn run(
        &self,
        prompts: &[Vec<u32>],
        alone: &[Vec<u32>],
        stop: &StopConditions,
        tok: &llmq_text::Tokenizer,
    ) {
        let Interleaved {
            model,
            ahead,
            grid,
            with_sampled,
            stages,
            budget,
        } = *self;
        let fresh = load_model(&model_path(model), Dtype::Float32).unwrap();
        // Chunks of 7 tokens: with `stages` stages, 7 / stages tokens (rounded up) a step.
        let opts = RoleOptions {
            decode_ahead: ahead,
            prefix: None,
            chunk_stages: stages,
            stage_tokens: 7usize.div_ceil(stages),
            stage_budget: budget,
            min_stage_tokens: 1,
        };
        let mut engine =
            RoleActors::start(fresh.model.with_chunk_grid(grid), fresh.tokenizer, opts);
        let bpt = engine.kv_bytes_per_token();
        let mut s = Scheduler::new(SchedulerConfig {
            prefill_chunk: 7,
            idle_prefill_chunk: 9,
            kv_bytes_per_token: bpt,
            kv_budget_bytes: 1 << 30,
            ..Default::default()
        });
        let start = Instant::now();
        let mut events = vec![];
        for (i, p) in prompts.iter().enumerate() {
            let id = i as u64;
            engine
                .register(
                    id,
                    SeqSpec::new(p.clone(), Sampling::default(), stop.clone()),
                )
                .await
                .unwrap();
            events.extend(s.submit(Admission {
                id,
                prompt_tokens: p.len(),
                max_tokens: 12,
                accepted_at: start.elapsed(),
                after: None,
            }));
            if i == 1 && with_sampled {
                // A sampled request among the greedy ones: while it decodes no step is queued
                // ahead, and its own prompt's last chunk cannot ride in one.
                let p = tok.prompt_ids("Name a colour.", true).unwrap();
                let sampling = Sampling {
                    temperature: 0.7,
                    seed: Some(3),
                    ..Default::default()
                };
                engine
                    .register(
                        Self::SAMPLED,
                        SeqSpec::new(p.clone(), sampling, stop.clone()),
                    )
                    .await
                    .unwrap();
                events.extend(s.submit(Admission {
                    id: Self::SAMPLED,
                    prompt_tokens: p.len(),
                    max_tokens: 12,
                    accepted_at: start.elapsed(),
                    after: None,
                }));
            }
            // Arrivals spread over ticks, so prefills interleave with running decodes; with a
            // budget, far enough apart that decode-only steps are timed before chunks arrive.
            for _ in 0..if budget > 0.0 { 8 } else { 3 } {
                events.extend(s.tick(&mut engine, start.elapsed()).await.0);
            }
        }
        for _ in 0..500 {
            if s.is_idle() {
                break;
            }
            events.extend(s.tick(&mut engine, start.elapsed()).await.0);
        }
        assert!(s.is_idle());
        self.check_tokens(&events, alone);
        // Chunks, and chunks that complete a prompt (its first token then comes with the next
        // decode step), ride in steps queued ahead.
        let queued = engine.chunks_queued_ahead();
        let (chunks, completions) = (queued.run, queued.completed_prompt);
        if !with_sampled {
            assert_eq!(
                chunks > 0,
                ahead,
                "chunks queued ahead with decode_ahead {ahead}"
            );
            // (With arrivals far apart, a prompt may complete in a step of its own.)
            if budget == 0.0 {
                assert_eq!(
                    completions > 0,
                    ahead,
                    "prompts completed ahead with decode_ahead {ahead}"
                );
            }
        }
        assert_eq!(
            engine.stages_pending() > 0,
            stages > 1,
            "chunks part-way through the model with {stages} stages"
        );
        assert_eq!(engine.held(), 0);
        assert_eq!(engine.kv_bytes_in_use(), 0, "decode_ahead {ahead}");
        assert_eq!(s.held_kv_bytes(), 0);
    }

    /// Every greedy request got the tokens it gets alone and ended once; the sampled one ended
    /// with as many tokens as its usage says.
    fn check_tokens(&self, events: &[llmq_scheduler::Emit], alone: &[Vec<u32>]) {
        if self.with_sampled {
            let sampled: Vec<&Event> = events
                .iter()
                .filter(|e| e.id == Self::SAMPLED)
                .map(|e| &e.event)
                .collect();
            let n: usize = sampled
                .iter()
                .map(|e| {
                    if let Event::Tokens { ids, .. } = e {
                        ids.len()
                    } else {
                        0
                    }
                })
                .sum();
            match sampled.last() {
                Some(Event::Done { usage, .. }) => assert!(
                    n >= 1 && usage.completion as usize == n,
                    "sampled request: {n} tokens, {usage:?}"
                ),
                e => panic!("sampled request ended with {e:?}"),
            }
        }
        let Interleaved {
            model,
            ahead,
            grid,
            with_sampled,
            stages,
            budget,
        } = *self;
        for (i, want) in alone.iter().enumerate() {
            let got: Vec<u32> = events
                .iter()
                .filter(|e| e.id == i as u64)
                .flat_map(|e| {
                    if let Event::Tokens { ids, .. } = &e.event {
                        ids.clone()
                    } else {
                        vec![]
                    }
                })
                .collect();
            let end = events.iter().rfind(|e| e.id == i as u64).map(|e| &e.event);
            assert_eq!(&got, want, "{model} request {i}, decode_ahead {ahead}, grid {grid}, with a sampled one {with_sampled}, stages {stages}, budget {budget}: ended with {end:?}");
            assert!(end.unwrap().is_terminal());
        }
    }
}
