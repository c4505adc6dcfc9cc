//! What the worker's engine tests share: the greedy tokens a prompt gets alone, through the
//! engine's own one-sequence generation, which the scheduler and actors must reproduce.
#![allow(dead_code)]

use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::Model;
use llmq_text::sampling::{Sampling, StopConditions};
use llmq_text::Tokenizer;

/// Each prompt's greedy tokens, generated alone in one piece under `stop`.
pub fn greedy_alone(
    model: &Model,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    stop: &StopConditions,
) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| {
            let req = LocalRequest {
                prompt_ids: p.clone(),
                sampling: Sampling::default(),
                stop: stop.clone(),
                prefill_chunk: 4096,
            };
            generate(model, Some(tok), &req, |_, _| {})
                .unwrap()
                .token_ids
        })
        .collect()
}

/// A named model (`smollm2`) or a fixture of tests/fixtures.
pub fn model_path(name: &str) -> std::path::PathBuf {
    match name {
        "smollm2" => llmq_text::resolve_model(name).unwrap(),
        fixture => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(fixture),
    }
}
