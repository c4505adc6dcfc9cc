//! The prefix cache inside the real engine, driven by the scheduler: greedy tokens with a cache
//! hit equal those of the same prompt generated alone without any cache (`generate`, itself
//! checked against transformers), for exact and partial hits, chunked prefill after the reused
//! prefix, hits on a prefix of a request still running, whole grid blocks on a chunk grid,
//! sliding-window models, eviction under
//! memory pressure, cancellation, salts; and the bytes held add up.

use std::time::Duration;

use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::{load_model, Model};
use llmq_protocol::Event;
use llmq_scheduler::{Admission, ReqId, Scheduler, SchedulerConfig};
use llmq_text::sampling::{Sampling, StopConditions};
use llmq_worker::actor::WorkerExecutor;
use llmq_worker::roles::{PrefixOptions, RoleActors, RoleOptions};
use llmq_worker::seq::SeqSpec;
use mlx_rs::Dtype;

const MAX_TOKENS: usize = 8;
const BLOCK: usize = 4;

fn tiny(name: &str) -> Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    load_model(&dir, Dtype::Float32).unwrap().model
}

fn stop() -> StopConditions {
    StopConditions {
        max_tokens: MAX_TOKENS as u32,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Greedy tokens of `prompt` alone, no cache, one piece.
fn alone(model: &Model, prompt: &[u32]) -> Vec<u32> {
    let req = LocalRequest {
        prompt_ids: prompt.to_vec(),
        sampling: Sampling::default(),
        stop: stop(),
        prefill_chunk: 4096,
    };
    generate(model, None, &req, |_, _| {}).unwrap().token_ids
}

/// The first prompt `make(0)`, `make(1)`, ... whose greedy continuation (returned with it)
/// varies: random tiny models often repeat one token, and a repeated token would hide a wrong
/// cache.
fn pick(model: &Model, make: impl Fn(u64) -> Vec<u32>) -> (Vec<u32>, Vec<u32>) {
    (0..200)
        .map(|s| {
            let p = make(s);
            let want = alone(model, &p);
            (p, want)
        })
        .find(|(_, want)| want.iter().collect::<std::collections::HashSet<_>>().len() >= 4)
        .expect("a prompt with a varied continuation")
}

fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((x >> 33) % 370) as u32
        })
        .collect()
}

/// A scheduler over the real engine with a prefix cache; requests by id, events collected.
struct Rig {
    engine: RoleActors,
    s: Scheduler,
    now: Duration,
    events: Vec<(ReqId, Event)>,
    next: ReqId,
    /// The actors' system: every call into the engine runs on it.
    sys: actix::SystemRunner,
}

impl Rig {
    fn new(model: Model, budget_tokens: u64, chunk: usize) -> Rig {
        let sys = actix::System::new();
        let opts = RoleOptions {
            prefix: Some(PrefixOptions {
                block_tokens: BLOCK,
                max_bytes: u64::MAX,
            }),
            ..Default::default()
        };
        let engine = sys.block_on(async { RoleActors::start(model, None, opts) });
        let bpt = engine.kv_bytes_per_token();
        let s = Scheduler::new(llmq_worker::actor::fitted_to(
            &engine,
            SchedulerConfig {
                prefill_chunk: chunk,
                idle_prefill_chunk: chunk,
                kv_budget_bytes: budget_tokens * bpt,
                ..Default::default()
            },
        ));
        Rig {
            engine,
            s,
            now: Duration::ZERO,
            events: vec![],
            next: 0,
            sys,
        }
    }

    fn submit(&mut self, p: &[u32], salt: Option<&str>) -> ReqId {
        let id = self.next;
        self.next += 1;
        self.sys
            .block_on(self.engine.register(
                id,
                SeqSpec {
                    salt: salt.map(Into::into),
                    ..SeqSpec::new(p.to_vec(), Sampling::default(), stop())
                },
            ))
            .unwrap();
        let a = Admission {
            id,
            prompt_tokens: p.len(),
            max_tokens: MAX_TOKENS,
            accepted_at: self.now,
            after: None,
        };
        self.events
            .extend(self.s.submit(a).into_iter().map(|e| (e.id, e.event)));
        id
    }

    /// Submits `p` (no salt) and runs until every request has ended.
    fn submit_and_run(&mut self, p: &[u32]) -> ReqId {
        let id = self.submit(p, None);
        self.run();
        id
    }

    fn tick(&mut self) {
        self.now += Duration::from_millis(10);
        let (emits, _) = self.sys.block_on(self.s.tick(&mut self.engine, self.now));
        self.events
            .extend(emits.into_iter().map(|e| (e.id, e.event)));
        // The cache lives in what the running requests' reservations leave over.
        let left = self.s.config().kv_budget_bytes - self.s.held_kv_bytes();
        assert!(
            self.engine.prefix_stats().held_bytes <= left,
            "prefix cache over the budget"
        );
    }

    fn run(&mut self) {
        for _ in 0..2000 {
            if self.s.is_idle() {
                return;
            }
            self.tick();
        }
        panic!("did not finish");
    }

    fn tokens(&self, id: ReqId) -> Vec<u32> {
        self.events
            .iter()
            .filter(|(i, _)| *i == id)
            .flat_map(|(_, e)| {
                if let Event::Tokens { ids, .. } = e {
                    ids.clone()
                } else {
                    vec![]
                }
            })
            .collect()
    }

    /// The prompt tokens done in each of the request's `PrefillProgress` events.
    fn progress(&self, id: ReqId) -> Vec<u32> {
        self.events
            .iter()
            .filter(|(i, _)| *i == id)
            .filter_map(|(_, e)| {
                if let Event::PrefillProgress { done, .. } = e {
                    Some(*done)
                } else {
                    None
                }
            })
            .collect()
    }

    /// Done's usage.cached (panics if the request did not end with Done).
    fn cached(&self, id: ReqId) -> u32 {
        match self.events.iter().rev().find(|(i, _)| *i == id) {
            Some((_, Event::Done { usage, .. })) => usage.cached,
            other => panic!("request {id} ended with {other:?}"),
        }
    }

    /// After every request: the engine holds exactly what the cache reports, and clear frees it.
    fn check_memory_returns(&mut self) {
        assert!(self.s.is_idle());
        assert_eq!(self.engine.held(), 0);
        assert_eq!(self.s.held_kv_bytes(), 0);
        let held = self.engine.prefix_stats().held_bytes;
        assert_eq!(self.engine.kv_bytes_in_use(), held);
        assert_eq!(self.sys.block_on(self.engine.prefix_clear()), held);
        assert_eq!(self.engine.kv_bytes_in_use(), 0);
    }
}

#[test]
fn exact_and_partial_hits_give_the_same_greedy_tokens() {
    // tiny-phi3's long RoPE switches at position 32: the hits straddle it.
    for name in [
        "tiny-llama",
        "tiny-qwen3",
        "tiny-llama3",
        "tiny-phi3",
        "tiny-mixtral",
        "tiny-qwen3-moe",
        "tiny-qwen2-moe",
    ] {
        let model = tiny(name);
        let (a, want_a) = pick(&model, |s| prompt(s, 40));
        // 29 shared tokens, then 23 new ones (chunks of 5 after the hit).
        let (partial, want_partial) = pick(&model, |s| [&a[..29], &prompt(1000 + s, 23)].concat());
        let mut rig = Rig::new(model, 100_000, 5);
        let first = rig.submit_and_run(&a);
        let exact = rig.submit_and_run(&a);
        let part = rig.submit_and_run(&partial);
        assert_eq!(rig.tokens(first), want_a, "{name}: no hit");
        assert_eq!(rig.cached(first), 0);
        assert_eq!(rig.tokens(exact), want_a, "{name}: exact hit");
        assert_eq!(
            rig.cached(exact),
            39,
            "{name}: all but the last prompt token reused"
        );
        assert_eq!(rig.tokens(part), want_partial, "{name}: partial hit");
        assert_eq!(rig.cached(part), 29, "{name}: the shared prefix reused");
        // Progress after a hit starts past the reused tokens and ends at the total.
        assert_eq!(rig.progress(part), vec![34, 39, 44, 49, 52]);
        let st = rig.engine.prefix_stats();
        assert_eq!((st.lookups, st.hits, st.reused_tokens), (3, 2, 68));
        assert!((st.hit_rate() - 68.0 / 132.0).abs() < 1e-9);
        rig.check_memory_returns();
    }
}

/// On a chunk grid (as on a GPU, here 8 positions), hits reuse whole grid blocks only, so the
/// chunks after them start on the grid; the tokens are still those of the prompt alone.
#[test]
fn on_a_chunk_grid_hits_reuse_whole_blocks() {
    let model = tiny("tiny-llama");
    let (a, want_a) = pick(&model, |s| prompt(s, 40));
    let (partial, want_partial) = pick(&model, |s| [&a[..29], &prompt(2000 + s, 23)].concat());
    let mut rig = Rig::new(model.with_chunk_grid(8), 100_000, 8);
    let first = rig.submit_and_run(&a);
    let exact = rig.submit_and_run(&a);
    let part = rig.submit_and_run(&partial);
    assert_eq!(rig.tokens(first), want_a, "no hit");
    assert_eq!(rig.tokens(exact), want_a, "exact hit");
    assert_eq!(rig.cached(exact), 32, "39 reusable tokens, 4 whole blocks");
    assert_eq!(rig.tokens(part), want_partial, "partial hit");
    assert_eq!(rig.cached(part), 24, "29 shared tokens, 3 whole blocks");
    assert_eq!(rig.progress(part), vec![32, 40, 48, 52]);
    let st = rig.engine.prefix_stats();
    assert_eq!(
        (st.hits, st.reused_tokens),
        (2, 56),
        "the hit rate counts what was reused"
    );
    rig.check_memory_returns();
}

/// A prompt's KV is cached as soon as its prefill completes: a request arriving while the
/// first one still decodes reuses it. Cancelling the first does not disturb the second.
#[test]
fn hit_on_a_running_request_and_its_cancellation() {
    let model = tiny("tiny-llama");
    let shared = prompt(3, 32);
    let (b, want_b) = pick(&model, |s| [&shared[..], &prompt(s, 9)].concat());
    let mut rig = Rig::new(model, 100_000, 8);
    let a = rig.submit(&shared, None);
    while rig.tokens(a).is_empty() {
        rig.tick();
    }
    let second = rig.submit(&b, None);
    rig.tick(); // admitted with the hit, first chunk
    assert!(rig.s.cancel(a));
    rig.run();
    assert!(matches!(
        rig.events.iter().rev().find(|(i, _)| *i == a),
        Some((_, Event::Error { .. }))
    ));
    assert_eq!(rig.tokens(second), want_b);
    assert_eq!(rig.cached(second), 32);
    rig.check_memory_returns();
}

/// Sliding window 8 (every layer: Mistral; some layers: Gemma 2 and 3): a sequence whose
/// cache never wrapped is reusable; one that wrapped is not reused beyond what it kept (not at
/// all), and tokens stay right in both cases.
#[test]
fn sliding_window_prefixes_are_reused_only_before_the_window_wraps() {
    for name in ["tiny-mistral", "tiny-gemma2", "tiny-gemma3"] {
        let model = tiny(name);
        assert_eq!(model.config.sliding_window, Some(8));
        let short = prompt(5, 6); // 6 prompt tokens: fed 6 + 7 outputs = 13 > 7 kept at the end...
        let (after_short, want_after_short) =
            pick(&model, |s| [&short[..], &prompt(s, 3)].concat());
        let long = prompt(7, 30);
        let (after_long, want_after_long) = pick(&model, |s| [&long[..20], &prompt(s, 5)].concat());
        let mut rig = Rig::new(model, 100_000, 4);
        // ...so it is remembered when its prompt completes (6 tokens, inside the window).
        rig.submit(&short, None);
        rig.run();
        let s2 = rig.submit(&after_short, None);
        rig.run();
        rig.submit(&long, None);
        rig.run();
        let l2 = rig.submit(&after_long, None);
        rig.run();
        assert_eq!(rig.tokens(s2), want_after_short, "{name}");
        assert_eq!(rig.cached(s2), 6, "{name}");
        assert_eq!(rig.tokens(l2), want_after_long, "{name}");
        assert_eq!(
            rig.cached(l2),
            0,
            "{name}: a wrapped window cannot be resumed"
        );
        rig.check_memory_returns();
    }
}

/// LFM2's convolution layers and Qwen3.5's DeltaNet layers keep a state that cannot be cut back
/// to a shorter prefix: the prefix cache keeps each state where it was taken (one token before a
/// prompt's end, a request's end, some chunks' ends), and a prompt extending one of those (the
/// same prompt sent again among them) resumes exactly there,
/// with the tokens it gets alone, in chunks of every size; nothing is reused between two such
/// positions.
#[test]
fn recurrent_states_resume_only_where_they_were_taken() {
    for name in RECURRENT {
        let model = tiny(name);
        assert!(model.config.recurrent());
        let first = prompt(11, 20);
        let (after, want_after) = pick(&model, |s| [&first[..], &prompt(s, 6)].concat());
        let want_first = alone(&model, &first);
        // Shares 15 tokens with `first`: keys and values would serve them all, a state serves
        // only where one was kept.
        let (diverging, want_diverging) =
            pick(&model, |s| [&first[..15], &prompt(s + 50, 9)].concat());
        for chunk in [1, 5, 64] {
            let mut rig = Rig::new(tiny(name), 100_000, chunk);
            let a = rig.submit(&first, None);
            rig.run();
            let b = rig.submit(&after, None);
            rig.run();
            let c = rig.submit(&diverging, None);
            rig.run();
            let again = rig.submit(&first, None);
            rig.run();
            assert_eq!(rig.tokens(a), want_first, "{name} chunk {chunk}");
            // `after` and the same prompt again resume one token before `first`'s end.
            assert_eq!(rig.tokens(b), want_after, "{name} chunk {chunk}");
            assert_eq!(
                rig.cached(b),
                first.len() as u32 - 1,
                "{name} chunk {chunk}"
            );
            assert_eq!(rig.tokens(again), want_first, "{name} chunk {chunk}");
            assert_eq!(
                rig.cached(again),
                first.len() as u32 - 1,
                "{name} chunk {chunk}"
            );
            assert_eq!(rig.tokens(c), want_diverging, "{name} chunk {chunk}");
            // Of `first`'s states, only those kept where its chunks ended at 4 times a power
            // of two lie within the 15 shared tokens: at 8 with chunks of 1, none with chunks
            // of 5 (ends 5, 10, 15) or 64 (one chunk).
            let deepest = if chunk == 1 { 8 } else { 0 };
            assert_eq!(rig.cached(c), deepest, "{name} chunk {chunk}");
            rig.check_memory_returns();
        }
    }
}

/// The recurrent fixtures: LFM2's convolutions, Qwen3.5's gated DeltaNet.
const RECURRENT: [&str; 2] = ["tiny-lfm2", "tiny-qwen35"];

/// A long prompt of a recurrent model also keeps its states where prefill chunks end at the
/// block size times a power of two (chunks of 8, blocks of 4: at 8, 16 and 32 of 40): a prompt
/// sharing its first 35 tokens resumes at 32, with the tokens it gets alone.
#[test]
fn a_shared_beginning_resumes_from_the_deepest_state_kept_within_it() {
    for name in RECURRENT {
        let model = tiny(name);
        let long = prompt(21, 40);
        let (other, want) = pick(&model, |s| [&long[..35], &prompt(s + 80, 6)].concat());
        // Alone (its chunks run in the prefill actor), and beside a decoding request (its
        // chunks share the decode actor's steps).
        for beside in [false, true] {
            let mut rig = Rig::new(tiny(name), 100_000, 8);
            if beside {
                rig.submit(&prompt(5, 6), None);
                rig.tick();
                rig.tick();
            }
            rig.submit(&long, None);
            rig.run();
            let b = rig.submit(&other, None);
            rig.run();
            assert_eq!(
                rig.tokens(b),
                want,
                "{name} beside a decoding request: {beside}"
            );
            assert_eq!(
                rig.cached(b),
                32,
                "{name} beside a decoding request: {beside}"
            );
            rig.check_memory_returns();
        }
    }
}

#[test]
fn salts_keep_prefixes_apart() {
    let model = tiny("tiny-llama");
    let (p, want) = pick(&model, |s| prompt(s, 24));
    let mut rig = Rig::new(model, 100_000, 64);
    let ids: Vec<ReqId> = [Some("alice"), None, Some("bob"), Some("alice")]
        .into_iter()
        .map(|salt| {
            let id = rig.submit(&p, salt);
            rig.run();
            id
        })
        .collect();
    let cached: Vec<u32> = ids.iter().map(|&i| rig.cached(i)).collect();
    assert_eq!(cached, vec![0, 0, 0, 23]);
    for id in ids {
        assert_eq!(rig.tokens(id), want);
    }
    rig.check_memory_returns();
}

/// A budget of 200 tokens with requests of 40 + 8 running three at a time: the cache gives way
/// to admissions (least recently used first), never exceeds what reservations leave, and every
/// stream's tokens stay right.
#[test]
fn eviction_under_memory_pressure_while_requests_run() {
    let model = tiny("tiny-llama");
    let (prompts, want): (Vec<Vec<u32>>, Vec<Vec<u32>>) = (0..8)
        .map(|i| pick(&model, |s| prompt(1000 * i + s, 40)))
        .unzip();
    let mut rig = Rig::new(model, 200, 16);
    let mut ids = vec![];
    for (i, p) in prompts.iter().enumerate() {
        ids.push(rig.submit(p, None));
        if i % 3 == 2 {
            for _ in 0..4 {
                rig.tick();
            }
        }
    }
    rig.run();
    // And once more, newest first: the most recent ones may still be cached, the rest are
    // recomputed.
    let again: Vec<ReqId> = prompts.iter().rev().map(|p| rig.submit(p, None)).collect();
    rig.run();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(rig.tokens(*id), want[i], "request {i}");
    }
    for (i, id) in again.iter().enumerate() {
        assert_eq!(rig.tokens(*id), want[7 - i], "request {} again", 7 - i);
    }
    let st = rig.engine.prefix_stats();
    assert!(st.evictions > 0, "{st:?}");
    assert!(st.hits > 0, "{st:?}");
    rig.check_memory_returns();
}

/// On a CPU a completed prompt is copied for the cache from its decode row over the steps that
/// follow (a few layers a step), not in the tick that completed it: it is in the cache while
/// its request still decodes, whole.
#[test]
fn a_completed_prompt_is_remembered_while_its_request_decodes() {
    let model = tiny("tiny-llama");
    let (a, want) = pick(&model, |s| prompt(s, 40));
    let mut rig = Rig::new(model, 100_000, 64);
    let id = rig.submit(&a, None);
    while rig.tokens(id).is_empty() {
        rig.tick();
    }
    for _ in 0..3 {
        rig.tick();
    }
    assert!(!rig.s.is_idle(), "still decoding");
    let st = rig.engine.prefix_stats();
    assert_eq!(
        (st.entries, st.held_bytes),
        (1, 40 * rig.engine.kv_bytes_per_token()),
        "{st:?}"
    );
    rig.run();
    assert_eq!(rig.tokens(id), want);
    rig.check_memory_returns();
}
