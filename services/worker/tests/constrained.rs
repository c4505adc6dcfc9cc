//! Constrained decoding through the real engine (SmolLM2) and the scheduler: constrained rows
//! beside free ones in the decode batch, with chunked prefill whose chunks are staged over steps
//! and share steps queued ahead, greedy and sampled, a prefix-cache hit and a cancellation.
//! Every constrained output that ends is a document its schema accepts (checked with the
//! `jsonschema` crate); the free rows' tokens are those they get alone; all KV comes back. And
//! Gemma 3 (a GGUF vocabulary of 262k tokens; sliding-window layers, so rows decode one by one).

mod common;

use common::greedy_alone;

use std::collections::HashMap;
use std::time::Instant;

use llmq_engine::load_model;
use llmq_protocol::{Constraint, ErrorClass, Event, FinishReason};
use llmq_scheduler::{Admission, ReqId, Scheduler, SchedulerConfig};
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};
use llmq_worker::actor::WorkerExecutor;
use llmq_worker::roles::{PrefixOptions, RoleActors, RoleOptions};
use llmq_worker::seq::SeqSpec;
use mlx_rs::Dtype;
use serde_json::{json, Value};

const MAX_TOKENS: u32 = 80;

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 30}, "indoor": {"type": "boolean"}}, "required": ["name", "age", "indoor"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 2}}, "required": ["colours"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "population": {"type": "number"}}, "required": ["city", "population"], "additionalProperties": false}),
    ]
}

/// The text of a request's output and how it ended.
fn outcome(events: &[(ReqId, Event)], id: ReqId) -> (String, Option<Event>) {
    let mut text = String::new();
    let mut end = None;
    for (i, e) in events.iter().filter(|(i, _)| *i == id) {
        let _ = i;
        match e {
            Event::Tokens { text: t, .. } => text.push_str(t),
            e if e.is_terminal() => {
                assert!(end.is_none(), "request {id}: two terminal events");
                end = Some(e.clone());
            }
            _ => {}
        }
    }
    (text, end)
}

/// Registers and submits a request under the next id.
async fn submit(
    engine: &mut RoleActors,
    s: &mut Scheduler,
    next: &mut ReqId,
    spec: SeqSpec,
    start: Instant,
    events: &mut Vec<(ReqId, Event)>,
) -> ReqId {
    let id = *next;
    *next += 1;
    let n = spec.prompt.len();
    engine.register(id, spec).await.unwrap();
    let a = Admission {
        id,
        prompt_tokens: n,
        max_tokens: MAX_TOKENS as usize,
        accepted_at: start.elapsed(),
        after: None,
    };
    events.extend(s.submit(a).into_iter().map(|e| (e.id, e.event)));
    id
}

/// SmolLM2 behind the role actors with a prefix cache, and a scheduler granting chunks of 6
/// tokens, each run in stages of 3 (two steps each), sharing steps queued ahead or not.
fn staged_smollm2(decode_ahead: bool) -> (RoleActors, Scheduler) {
    let fresh = load_model(&resolve_model("smollm2").unwrap(), Dtype::Float32).unwrap();
    let opts = RoleOptions {
        decode_ahead,
        prefix: Some(PrefixOptions {
            block_tokens: 4,
            max_bytes: u64::MAX,
        }),
        chunk_stages: 2,
        stage_tokens: 3,
        stage_budget: 0.0,
        min_stage_tokens: 1,
    };
    let engine = RoleActors::start(fresh.model, fresh.tokenizer, opts);
    let kv_bytes_per_token = engine.kv_bytes_per_token();
    let s = Scheduler::new(SchedulerConfig {
        prefill_chunk: 6,
        idle_prefill_chunk: 6,
        kv_bytes_per_token,
        kv_budget_bytes: 1 << 30,
        ..Default::default()
    });
    (engine, s)
}

#[test]
fn constrained_rows_decode_beside_free_ones_into_valid_documents() {
    let loaded = load_model(&resolve_model("smollm2").unwrap(), Dtype::Float32).unwrap();
    let tok = loaded.tokenizer.as_ref().unwrap();
    let ask = |q: &str| tok.prompt_ids(q, true).unwrap();
    let stop = StopConditions {
        max_tokens: MAX_TOKENS,
        ..Default::default()
    };
    let free_prompts = [
        ask("What is the capital of France?"),
        ask("Write one sentence about the sea."),
    ];
    let free_alone = greedy_alone(&loaded.model, tok, &free_prompts, &stop);
    let questions = [
        "Describe a cat as JSON.",
        "Name two colours as JSON.",
        "Give a city and its population as JSON.",
    ];

    // With steps queued ahead (constrained rows' masks then computed while the queued step
    // runs) and without: the same documents.
    let mut documents = vec![];
    for decode_ahead in [true, false] {
        let docs = actix::System::new().block_on(async {
            let (mut engine, mut s) = staged_smollm2(decode_ahead);
            let start = Instant::now();
            let mut events: Vec<(ReqId, Event)> = vec![];
            let mut constrained: HashMap<ReqId, Value> = HashMap::new();
            let mut next: ReqId = 0;
            let plan = plan(&ask, &free_prompts, &questions, &stop);
            let mut ids = vec![];
            for (spec, schema) in plan {
                let id = submit(&mut engine, &mut s, &mut next, spec, start, &mut events).await;
                if let Some(schema) = schema {
                    constrained.insert(id, schema);
                }
                ids.push(id);
                for _ in 0..3 {
                    events.extend(
                        s.tick(&mut engine, start.elapsed())
                            .await
                            .0
                            .into_iter()
                            .map(|e| (e.id, e.event)),
                    );
                }
            }
            // One more constrained request, cancelled while it decodes.
            let c = Constraint::JsonObject;
            let spec = SeqSpec {
                constraint: Some(c),
                ..SeqSpec::new(ask(questions[0]), Sampling::default(), stop.clone())
            };
            let doomed = submit(&mut engine, &mut s, &mut next, spec, start, &mut events).await;
            let mut ticks = 0;
            while !s.is_idle() && ticks < 2000 {
                ticks += 1;
                if ticks == 12 {
                    assert!(s.cancel(doomed));
                }
                events.extend(
                    s.tick(&mut engine, start.elapsed())
                        .await
                        .0
                        .into_iter()
                        .map(|e| (e.id, e.event)),
                );
            }
            assert!(s.is_idle(), "still busy after {ticks} ticks");
            // The first constrained prompt, again: a prefix hit, the same document.
            let again = SeqSpec {
                constraint: Some(Constraint::JsonSchema {
                    schema: schemas()[0].to_string(),
                }),
                ..SeqSpec::new(ask(questions[0]), Sampling::default(), stop.clone())
            };
            let again_id = submit(&mut engine, &mut s, &mut next, again, start, &mut events).await;
            while !s.is_idle() {
                events.extend(
                    s.tick(&mut engine, start.elapsed())
                        .await
                        .0
                        .into_iter()
                        .map(|e| (e.id, e.event)),
                );
            }

            let free: Vec<(ReqId, &Vec<u32>)> = free_alone
                .iter()
                .enumerate()
                .map(|(i, want)| (ids[2 * i], want))
                .collect();
            check_outcomes(
                &events,
                &constrained,
                &free,
                Repeated {
                    first: ids[1],
                    again: again_id,
                },
                doomed,
            );
            assert_eq!(engine.held(), 0);
            assert_eq!(s.held_kv_bytes(), 0);
            let masks = engine.mask_times();
            assert!(masks.steps > 0 && masks.rows >= masks.steps, "{masks:?}");
            assert_eq!(
                masks.ahead > 0,
                decode_ahead,
                "masked steps queued ahead: {masks:?}"
            );
            assert_eq!(
                masks.beside > 0,
                decode_ahead,
                "masks computed beside the device's thread: {masks:?}"
            );
            let mut docs: Vec<(ReqId, String)> = constrained
                .keys()
                .map(|id| (*id, outcome(&events, *id).0))
                .collect();
            docs.sort();
            docs
        });
        documents.push(docs);
    }
    assert_eq!(
        documents[0], documents[1],
        "steps queued ahead change no constrained document"
    );
}

/// The requests of `constrained_rows_decode_beside_free_ones_into_valid_documents`, each with
/// its schema where it has one: free and constrained ones in turn, then one sampled under a
/// constraint (host sampling of masked logits).
fn plan(
    ask: &dyn Fn(&str) -> Vec<u32>,
    free: &[Vec<u32>],
    questions: &[&str],
    stop: &StopConditions,
) -> Vec<(SeqSpec, Option<Value>)> {
    let mut plan = vec![];
    for (i, p) in free.iter().enumerate() {
        plan.push((
            SeqSpec::new(p.clone(), Sampling::default(), stop.clone()),
            None,
        ));
        let schema = &schemas()[i];
        let c = Constraint::JsonSchema {
            schema: schema.to_string(),
        };
        plan.push((
            SeqSpec {
                constraint: Some(c),
                ..SeqSpec::new(ask(questions[i]), Sampling::default(), stop.clone())
            },
            Some(schema.clone()),
        ));
    }
    let sampled = Sampling {
        temperature: 0.9,
        seed: Some(11),
        ..Default::default()
    };
    let schema = schemas()[2].clone();
    let c = Constraint::JsonSchema {
        schema: schema.to_string(),
    };
    plan.push((
        SeqSpec {
            constraint: Some(c),
            ..SeqSpec::new(ask(questions[2]), sampled, stop.clone())
        },
        Some(schema),
    ));
    plan
}

/// A constrained prompt sent twice, the second time a prefix-cache hit.
struct Repeated {
    first: ReqId,
    again: ReqId,
}

/// Every constrained request ended with a document valid against its schema; the free ones
/// with the tokens they get alone; the repeated one with the same document from cached KV; the
/// cancelled one with `Cancelled`.
fn check_outcomes(
    events: &[(ReqId, Event)],
    constrained: &HashMap<ReqId, Value>,
    free: &[(ReqId, &Vec<u32>)],
    repeated: Repeated,
    cancelled: ReqId,
) {
    for (id, schema) in constrained {
        let (text, end) = outcome(events, *id);
        eprintln!("request {id}: {text}");
        match end {
            Some(Event::Done {
                finish_reason: FinishReason::Stop,
                ..
            }) => {
                let doc: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("request {id}: {text:?} is not JSON: {e}"));
                assert!(
                    jsonschema::validator_for(schema).unwrap().is_valid(&doc),
                    "request {id}: {text} against {schema}"
                );
            }
            other => panic!("request {id} ({text:?}) ended with {other:?}"),
        }
    }
    let (first, _) = outcome(events, repeated.first);
    let (repeat, end) = outcome(events, repeated.again);
    assert_eq!(repeat, first, "the same greedy document after a prefix hit");
    match end {
        Some(Event::Done { usage, .. }) => assert!(usage.cached > 0, "{usage:?}"),
        other => panic!("{other:?}"),
    }
    match outcome(events, cancelled).1 {
        Some(Event::Error { error }) => assert_eq!(error.class, ErrorClass::Cancelled),
        other => panic!("the cancelled request ended with {other:?}"),
    }
    for &(id, want) in free {
        let got: Vec<u32> = events
            .iter()
            .filter(|(x, _)| *x == id)
            .flat_map(|(_, e)| {
                if let Event::Tokens { ids, .. } = e {
                    ids.clone()
                } else {
                    vec![]
                }
            })
            .collect();
        assert_eq!(&got, want, "free request {id} beside constrained ones");
    }
}

#[test]
fn gemma_decodes_row_by_row_under_a_schema() {
    let loaded = load_model(&resolve_model("gemma3-270m").unwrap(), Dtype::Float32).unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France as JSON:",
        "The capital of Japan as JSON:",
    ]
    .iter()
    .map(|p| loaded.tokenizer.as_ref().unwrap().encode(p, true).unwrap())
    .collect();
    let schema = json!({"type": "object", "properties": {"country": {"type": "string", "maxLength": 20}, "capital": {"type": "string", "maxLength": 20}}, "required": ["country", "capital"], "additionalProperties": false});
    actix::System::new().block_on(async {
        let mut engine = RoleActors::start(loaded.model, loaded.tokenizer, RoleOptions::default());
        let mut s = Scheduler::new(SchedulerConfig {
            kv_bytes_per_token: engine.kv_bytes_per_token(),
            kv_budget_bytes: 1 << 30,
            ..Default::default()
        });
        let start = Instant::now();
        let (mut events, mut next) = (vec![], 0);
        let mut ids = vec![];
        for p in prompts {
            let c = Constraint::JsonSchema {
                schema: schema.to_string(),
            };
            let spec = SeqSpec {
                constraint: Some(c),
                ..SeqSpec::new(
                    p,
                    Sampling::default(),
                    StopConditions {
                        max_tokens: 60,
                        ..Default::default()
                    },
                )
            };
            ids.push(submit(&mut engine, &mut s, &mut next, spec, start, &mut events).await);
        }
        while !s.is_idle() {
            events.extend(
                s.tick(&mut engine, start.elapsed())
                    .await
                    .0
                    .into_iter()
                    .map(|e| (e.id, e.event)),
            );
        }
        let validator = jsonschema::validator_for(&schema).unwrap();
        for id in ids {
            let (text, end) = outcome(&events, id);
            eprintln!("gemma {id}: {text}");
            assert!(
                matches!(
                    end,
                    Some(Event::Done {
                        finish_reason: FinishReason::Stop,
                        ..
                    })
                ),
                "{text:?}: {end:?}"
            );
            assert!(
                validator.is_valid(&serde_json::from_str(&text).unwrap()),
                "{text}"
            );
        }
    });
}
