//! A real checkpoint of a family added beside Llama's: Gemma 3 270M in Q4_K_M (F32, Q5_0, Q8_0,
//! Q4_K and Q6_K tensors; a 262k-token SentencePiece vocabulary; one KV head; five 512-token
//! sliding layers to each global one), fetched by the set-up, against transformers reading the
//! same GGUF (tests/reference/make_fixtures.py).

mod common;

use common::*;
use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::load_model;
use llmq_engine::model::host_f32;
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};
use mlx_rs::Dtype;

fn reference() -> Vec<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(fixture("gemma3-270m-reference.json")).unwrap())
        .unwrap()
}

#[test]
fn gemma3_270m_tokenizes_scores_and_continues_text_as_transformers_does() {
    let path = resolve_model("gemma3-270m").expect("Gemma 3 270M is fetched by `make setup`");
    let m = load_model(&path, Dtype::Float32).expect("load Gemma 3 270M");
    let tok = m.tokenizer.as_ref().unwrap();
    assert!(
        tok.apply_chat_template(&[], true).is_err(),
        "a base model without a chat template"
    );
    for case in reference() {
        let prompt = case["prompt"].as_str().unwrap();
        let prompt_ids = tok.prompt_ids(prompt, false).unwrap();
        assert_eq!(
            prompt_ids,
            json_ids(&case["prompt_ids"]),
            "{prompt:?}: prompt ids"
        );

        // The first position's largest logits: within 2e-3 of their size (18 layers of f32
        // against transformers' f32 on the same dequantized weights).
        let mut cache = m.model.new_cache();
        let logits = host_f32(
            &m.model
                .forward(&ids_array(&prompt_ids), &mut [&mut cache], true)
                .unwrap(),
        )
        .unwrap();
        let top = json_ids(&case["top_ids"]);
        let want: Vec<f32> = case["top_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let got: Vec<f32> = top.iter().map(|&i| logits[i as usize]).collect();
        let d = max_abs_diff(&got, &want);
        assert!(
            d < 2e-3 * want[0].abs(),
            "{prompt:?}: top logits differ by {d}"
        );
        assert_eq!(
            argmax(&logits) as u32,
            top[0],
            "{prompt:?}: greedy first token"
        );

        let want = json_ids(&case["greedy_ids"]);
        let req = LocalRequest {
            prompt_ids,
            sampling: Sampling::default(),
            stop: StopConditions {
                max_tokens: want.len() as u32,
                ..Default::default()
            },
            prefill_chunk: 3,
        };
        let out = generate(&m.model, Some(tok), &req, |_, _| {}).unwrap();
        assert_eq!(
            out.token_ids, want,
            "{prompt:?}: greedy continuation {:?}",
            out.text
        );
        assert_eq!(out.text, case["greedy_text"].as_str().unwrap());
    }
}
