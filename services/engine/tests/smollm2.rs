//! The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF, fetched by the set-up), against
//! transformers loading the same GGUF (tests/reference/make_fixtures.py).

mod common;

use common::*;
use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::load_model;
use llmq_engine::model::host_f32;
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};
use mlx_rs::Dtype;

const QUESTION: &str = "What is the capital of France?";

fn smollm2() -> llmq_engine::LoadedModel {
    let path = resolve_model("smollm2").expect("SmolLM2 is fetched by `make setup`");
    load_model(&path, Dtype::Float32).expect("load SmolLM2")
}

#[test]
fn chat_prompt_and_first_logits_match_transformers() {
    let m = smollm2();
    let tok = m.tokenizer.as_ref().unwrap();
    let refp = fixture("smollm2-reference.safetensors");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2-reference.json")).unwrap())
            .unwrap();
    let ids = tok.prompt_ids(QUESTION, true).unwrap();
    let want_text = meta["prompt_text"].as_str().unwrap();
    let text = tok.apply_chat_template(
        &[llmq_text::tokenizer::ChatMessage::new("user", QUESTION)],
        true,
    );
    assert_eq!(text.unwrap(), want_text, "chat template rendering");
    let want_ids: Vec<u32> = tensor(&refp, "prompt.ids")
        .as_slice::<i32>()
        .iter()
        .map(|&v| v as u32)
        .collect();
    assert_eq!(ids, want_ids, "prompt token ids");

    let mut cache = m.model.new_cache();
    let logits = m
        .model
        .forward(&ids_array(&ids), &mut [&mut cache], true)
        .unwrap();
    let got = host_f32(&logits).unwrap();
    let want = tensor(&refp, "first.logits");
    let want = want.as_slice::<f32>();
    let d = max_abs_diff(&got, want);
    let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    // 30 layers in float32 against float64: 1e-3 of the logits' range.
    assert!(d < 1e-3 * scale, "max |diff| {d} over logits up to {scale}");
    assert_eq!(argmax(&got), argmax(want));
}

#[test]
fn greedy_answer_says_paris_and_matches_transformers_tokens() {
    let m = smollm2();
    let tok = m.tokenizer.as_ref().unwrap();
    let refp = fixture("smollm2-reference.safetensors");
    let want: Vec<u32> = tensor(&refp, "greedy.ids")
        .as_slice::<i32>()
        .iter()
        .map(|&v| v as u32)
        .collect();
    let req = LocalRequest {
        prompt_ids: tok.prompt_ids(QUESTION, true).unwrap(),
        sampling: Sampling::default(),
        stop: StopConditions {
            max_tokens: want.len() as u32,
            ..Default::default()
        },
        prefill_chunk: 16,
    };
    let mut streamed = String::new();
    let out = generate(&m.model, Some(tok), &req, |_, piece| {
        streamed.push_str(piece)
    })
    .unwrap();
    assert!(out.text.contains("Paris"), "{:?}", out.text);
    assert_eq!(streamed, out.text);
    // transformers stops at the end-of-turn token too; compare the common length.
    assert_eq!(&out.token_ids[..], &want[..out.token_ids.len()]);
}
