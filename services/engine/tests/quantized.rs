//! Weights kept quantized: checkpoints as mlx-lm writes them (every family, 4 and 8 bits,
//! groups of 32, 64 and 128), weights quantized at load, and GGUF blocks kept as affine groups,
//! each against the same model with its weights dequantized (the dense path the reference tests
//! check against transformers).
//!
//! Tolerance: 1e-4 absolute on logits of magnitude 2-3.5, as against transformers. Both sides
//! hold exactly the same weights (the dequantized ones are MLX's dequantization of the quantized
//! ones, or `quants`' decoding, which equals the gguf package's values exactly); only the order
//! of the f32 sums differs between the quantized matmul and the dense one. A wrong scale, bias,
//! packing or row order shows up as differences of 0.1 and more. On a GPU (these tests also run
//! there, in f32) MLX's dense f32 matmul rounds through TF32, so the tolerance is 2e-2.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::*;
use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::model::host_f32;
use llmq_engine::{load_model, LoadOptions, LoadedModel, Model, QuantSpec};
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};
use mlx_rs::ops::{quantize, stack};
use mlx_rs::{Array, Dtype};

fn tol() -> f32 {
    if llmq_engine::on_gpu() {
        2e-2
    } else {
        1e-4
    }
}
const MODELS: &[&str] = &[
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-qwen2-moe",
    "tiny-llama3",
    "tiny-phi3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-lfm2",
    "tiny-qwen35",
];

fn f32_opts() -> LoadOptions {
    LoadOptions::new(Dtype::Float32)
}

fn load_with(path: &Path, opts: LoadOptions) -> LoadedModel {
    load_model(path, opts).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

/// A fresh directory of its own for each call (tests run in parallel).
fn scratch(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("llmq-quantized-{}-{n}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `fixture` as mlx-lm writes a quantized checkpoint of a model loaded in f32: experts
/// stacked into `switch_mlp`, every weight matrix whose rows split into groups quantized
/// (`.weight` packed, `.scales`, `.biases`), config.json's `quantization` giving the form, with
/// `overrides` per module.
fn write_mlx_checkpoint(
    fixture_name: &str,
    spec: QuantSpec,
    overrides: &[(&str, QuantSpec)],
) -> PathBuf {
    let src = fixture(fixture_name);
    let dir = scratch(&format!("{fixture_name}-{}-{}", spec.bits, spec.group_size));
    let mut arrays: HashMap<String, Array> = HashMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        if file.starts_with("model") && file.ends_with(".safetensors") {
            arrays.extend(Array::load_safetensors(&path).unwrap());
        }
    }
    stack_experts(&mut arrays);
    let mut out = HashMap::new();
    for (name, a) in arrays {
        let module = name.strip_suffix(".weight");
        let spec = module
            .and_then(|m| overrides.iter().find(|(o, _)| *o == m))
            .map_or(spec, |(_, s)| *s);
        let quantizable =
            module.is_some() && a.ndim() >= 2 && a.shape()[a.ndim() - 1] % spec.group_size == 0;
        if quantizable {
            let module = module.unwrap();
            let (w, scales, biases) = quantize(
                a.as_dtype(Dtype::Float32).unwrap(),
                spec.group_size,
                spec.bits,
            )
            .unwrap();
            out.insert(format!("{module}.weight"), w);
            out.insert(format!("{module}.scales"), scales);
            out.insert(format!("{module}.biases"), biases);
        } else {
            out.insert(name, a);
        }
    }
    Array::save_safetensors(out, None, dir.join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let mut q = serde_json::json!({"group_size": spec.group_size, "bits": spec.bits});
    for (module, s) in overrides {
        q[*module] = serde_json::json!({"group_size": s.group_size, "bits": s.bits});
    }
    config["quantization"] = q;
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// `...experts.N.gate_proj.weight` (or Mixtral's w1/w3/w2) into `...switch_mlp.gate_proj.weight`
/// [experts, out, in], as mlx-lm's checkpoints hold them.
fn stack_experts(arrays: &mut HashMap<String, Array>) {
    let mut groups: HashMap<String, Vec<(usize, Array)>> = HashMap::new();
    let names: Vec<String> = arrays
        .keys()
        .filter(|k| k.contains(".experts."))
        .cloned()
        .collect();
    for name in names {
        let (prefix, rest) = name.split_once(".experts.").unwrap();
        let (index, proj) = rest.split_once('.').unwrap();
        let proj = match proj {
            "w1.weight" => "gate_proj.weight",
            "w3.weight" => "up_proj.weight",
            "w2.weight" => "down_proj.weight",
            p => p,
        };
        let a = arrays.remove(&name).unwrap();
        groups
            .entry(format!("{prefix}.switch_mlp.{proj}"))
            .or_default()
            .push((index.parse().unwrap(), a));
    }
    for (name, mut parts) in groups {
        parts.sort_by_key(|(i, _)| *i);
        let v: Vec<Array> = parts.into_iter().map(|(_, a)| a).collect();
        arrays.insert(name, stack(&v, 0).unwrap());
    }
}

/// Logits of every reference prompt prefilled in chunks of 7, then of four decode steps of the
/// three longest prompts' sequences together (a batch at different positions), flattened.
fn logits_of(model: &Model, fixture_name: &str) -> Vec<Vec<f32>> {
    let cases = reference(fixture(fixture_name).join("reference.safetensors"));
    let mut out = vec![];
    let mut caches = vec![];
    let mut next = vec![];
    for case in &cases {
        let mut cache = model.new_cache();
        let logits = run_chunked(model, &mut cache, &case.ids, 7);
        next.push(argmax(&logits[logits.len() - case.vocab..]) as i32);
        out.push(logits);
        caches.push(cache);
    }
    for _ in 0..4 {
        let tokens = Array::from_slice(&next, &[next.len() as i32, 1]);
        let mut refs: Vec<_> = caches.iter_mut().collect();
        let logits = host_f32(&model.forward(&tokens, &mut refs, true).unwrap()).unwrap();
        let vocab = logits.len() / next.len();
        next = logits.chunks(vocab).map(|row| argmax(row) as i32).collect();
        out.push(logits);
    }
    out
}

fn assert_close(name: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = max_abs_diff(g, w);
        assert!(d < tol(), "{name}: pass {i}: max |diff| {d}");
    }
}

#[test]
fn mlx_quantized_checkpoints_of_every_family_match_their_dequantized_weights() {
    for name in MODELS {
        for (bits, group) in [(4, 32), (8, 64)] {
            let spec = QuantSpec::new(bits, group).unwrap();
            let dir = write_mlx_checkpoint(name, spec, &[]);
            let kept = load_with(&dir, f32_opts().keep_quantized(true));
            let dense = load_with(&dir, f32_opts().keep_quantized(false));
            let label = format!("{name} {spec}");
            assert!(
                kept.model
                    .weights_summary()
                    .contains(&format!("mlx {spec} -> {spec}")),
                "{label}: {}",
                kept.model.weights_summary()
            );
            assert!(
                !dense.model.weights_summary().contains("-> 4-bit")
                    && !dense.model.weights_summary().contains("-> 8-bit"),
                "{label}"
            );
            assert!(
                kept.model.weight_bytes() < dense.model.weight_bytes(),
                "{label}: quantized weights are smaller"
            );
            assert_close(
                &label,
                &logits_of(&kept.model, name),
                &logits_of(&dense.model, name),
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Groups of 128 and a module given its own form in config.json (as mlx-lm writes mixed
/// quantizations): the packed parts of the fused q/k/v projection differ in width.
#[test]
fn per_module_forms_and_wide_groups_load() {
    let spec = QuantSpec::new(4, 64).unwrap();
    let eight = QuantSpec::new(8, 64).unwrap();
    let dir = write_mlx_checkpoint(
        "tiny-llama",
        spec,
        &[
            ("model.layers.0.self_attn.v_proj", eight),
            (
                "model.layers.1.mlp.down_proj",
                QuantSpec::new(8, 128).unwrap(),
            ),
        ],
    );
    let kept = load_with(&dir, f32_opts().keep_quantized(true));
    let dense = load_with(&dir, f32_opts().keep_quantized(false));
    assert!(
        kept.model
            .weights_summary()
            .contains("mlx 8-bit, groups of 64"),
        "{}",
        kept.model.weights_summary()
    );
    assert_close(
        "tiny-llama mixed",
        &logits_of(&kept.model, "tiny-llama"),
        &logits_of(&dense.model, "tiny-llama"),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--quantize`: full-precision weights quantized at load give what the same quantization
/// written as an mlx-lm checkpoint gives.
#[test]
fn quantizing_at_load_equals_loading_the_quantized_checkpoint() {
    for name in ["tiny-llama", "tiny-qwen3-moe", "tiny-gemma3"] {
        let spec = QuantSpec::new(4, 32).unwrap();
        let at_load = load_with(&fixture(name), f32_opts().quantized(Some(spec)));
        assert!(
            at_load
                .model
                .weights_summary()
                .contains("(quantized at load)"),
            "{}",
            at_load.model.weights_summary()
        );
        let dir = write_mlx_checkpoint(name, spec, &[]);
        let written = load_with(&dir, f32_opts().keep_quantized(true));
        assert_close(
            &format!("{name} quantized at load"),
            &logits_of(&at_load.model, name),
            &logits_of(&written.model, name),
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The GGUF fixtures (the tiny Llama's Q8_0, Q4_0 and Q4_1 matrices in llama.cpp's Q/K row
/// order; the MoE ones' stacked experts in Q8_0, Q4_0, Q4_1 and Q5_0; Phi-3's fused projections;
/// LFM2's convolution projections as llama.cpp's converter writes them) kept as affine groups
/// give the dequantized model's logits.
#[test]
fn gguf_blocks_kept_quantized_match_their_dequantized_weights() {
    for (name, kinds) in [
        (
            "tiny-llama",
            &[
                "Q8_0 (exact) -> 8-bit",
                "Q4_0 (exact) -> 4-bit",
                "Q4_1 (exact) -> 4-bit",
            ][..],
        ),
        (
            "tiny-mixtral",
            &["Q5_0 (exact) -> 5-bit", "Q4_1 (exact) -> 4-bit"][..],
        ),
        (
            "tiny-qwen3-moe",
            &["Q5_0 (exact) -> 5-bit", "Q4_0 (exact) -> 4-bit"][..],
        ),
        (
            "tiny-phi3",
            &["Q5_0 (exact) -> 5-bit", "Q8_0 (exact) -> 8-bit"][..],
        ),
        ("tiny-lfm2", &["Q8_0 (exact) -> 8-bit"][..]),
    ] {
        let path = fixture(&format!("{name}.gguf"));
        let kept = load_with(&path, f32_opts().keep_quantized(true));
        let dense = load_with(&path, f32_opts().keep_quantized(false));
        let summary = kept.model.weights_summary();
        for kind in kinds {
            assert!(summary.contains(kind), "{name}: {kind} in {summary}");
        }
        let cases = reference(fixture(&format!("{name}-gguf-reference.safetensors")));
        for (i, case) in cases.iter().enumerate() {
            let run = |m: &Model| run_chunked(m, &mut m.new_cache(), &case.ids, 7);
            let d = max_abs_diff(&run(&kept.model), &run(&dense.model));
            assert!(d < tol(), "{name} gguf case {i}: max |diff| {d}");
        }
    }
}

/// SmolLM2 in Q4_1 (every matrix an exact affine form) decodes the same greedy tokens kept
/// quantized as dequantized.
#[test]
fn smollm2_q4_1_decodes_the_same_greedy_tokens_kept_quantized() {
    let path = resolve_model("smollm2").expect("fetched by `make setup`");
    let kept = load_with(&path, f32_opts().keep_quantized(true));
    let dense = load_with(&path, f32_opts().keep_quantized(false));
    assert!(
        !kept.model.weights_summary().contains("requantized"),
        "{}",
        kept.model.weights_summary()
    );
    assert!(
        kept.model.weight_bytes() * 4 < dense.model.weight_bytes(),
        "{} vs {}",
        kept.model.weight_bytes(),
        dense.model.weight_bytes()
    );
    let tok = kept.tokenizer.as_ref().unwrap();
    for prompt in [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
    ] {
        let req = LocalRequest {
            prompt_ids: tok.prompt_ids(prompt, false).unwrap(),
            sampling: Sampling::default(),
            stop: StopConditions {
                max_tokens: 32,
                ..Default::default()
            },
            prefill_chunk: 5,
        };
        let a = generate(&kept.model, Some(tok), &req, |_, _| {}).unwrap();
        let b = generate(&dense.model, Some(tok), &req, |_, _| {}).unwrap();
        assert_eq!(
            a.token_ids, b.token_ids,
            "{prompt:?}: {:?} vs {:?}",
            a.text, b.text
        );
    }
}

/// Gemma 3 270M in Q4_K_M: its Q4_K, Q5_0 and Q8_0 matrices are kept exactly, its nine Q6_K
/// ones (16-wide groups, no exact affine form) requantized to 8 bits in groups of 32. Along the
/// dense model's greedy continuation of each reference prompt, the kept model's logits of the
/// dense model's ten likeliest tokens stay within 0.2 of the dense model's (logits of size
/// 10-40; quantizing to 4 bits itself moves them by whole units), and its greedy token is the
/// dense one wherever the dense model's two best tokens are further apart than twice the largest
/// difference seen.
#[test]
fn gemma3_q4_k_m_kept_quantized_stays_within_the_requantization_error() {
    let path = resolve_model("gemma3-270m").expect("fetched by `make setup`");
    let kept = load_with(&path, f32_opts().keep_quantized(true));
    let dense = load_with(&path, f32_opts().keep_quantized(false));
    assert!(
        kept.model
            .weights_summary()
            .contains("9 x Q6_K (requantized) -> 8-bit, groups of 32"),
        "{}",
        kept.model.weights_summary()
    );
    let tok = kept.tokenizer.as_ref().unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(fixture("gemma3-270m-reference.json")).unwrap(),
    )
    .unwrap();
    let (mut worst, mut margins) = (0f32, vec![]);
    for case in &cases {
        let prompt = tok
            .prompt_ids(case["prompt"].as_str().unwrap(), false)
            .unwrap();
        let req = LocalRequest {
            prompt_ids: prompt.clone(),
            sampling: Sampling::default(),
            stop: StopConditions {
                max_tokens: 24,
                ..Default::default()
            },
            prefill_chunk: 4096,
        };
        let greedy = generate(&dense.model, Some(tok), &req, |_, _| {})
            .unwrap()
            .token_ids;
        let ids: Vec<u32> = prompt
            .iter()
            .chain(&greedy[..greedy.len() - 1])
            .copied()
            .collect();
        let rows = |m: &Model| run_chunked(m, &mut m.new_cache(), &ids, 4096);
        let (k, d) = (rows(&kept.model), rows(&dense.model));
        let vocab = k.len() / ids.len();
        for t in prompt.len() - 1..ids.len() {
            let (kr, dr) = (
                &k[t * vocab..(t + 1) * vocab],
                &d[t * vocab..(t + 1) * vocab],
            );
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| dr[b].total_cmp(&dr[a]));
            let top = &order[..10];
            worst = worst.max(
                top.iter()
                    .map(|&i| (kr[i] - dr[i]).abs())
                    .fold(0.0, f32::max),
            );
            margins.push((dr[top[0]] - dr[top[1]], argmax(kr) as usize == top[0]));
        }
    }
    assert!(worst < 0.2, "kept and dense logits differ by {worst}");
    let flips: Vec<f32> = margins
        .iter()
        .filter(|(_, same)| !same)
        .map(|(m, _)| *m)
        .collect();
    assert!(
        flips.iter().all(|&m| m <= 2.0 * worst),
        "a greedy token changed where the dense margin exceeded {}: {flips:?}",
        2.0 * worst
    );
    eprintln!("gemma3-270m kept vs dense: max |logit diff| {worst}, {} of {} greedy tokens changed (margins {flips:?})", flips.len(), margins.len());
}

#[test]
fn malformed_quantized_checkpoints_are_refused_naming_the_tensor() {
    let spec = QuantSpec::new(4, 64).unwrap();
    // Scales of another group size than config.json says.
    let dir = write_mlx_checkpoint("tiny-llama", spec, &[]);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["quantization"]["group_size"] = 32.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_model(&dir, f32_opts())
        .err()
        .expect("refused")
        .to_string();
    // Whichever tensor is read first is named: a layer's projection or the output head.
    assert!(
        err.contains("scales") && (err.contains("model.") || err.contains("lm_head")),
        "{err}"
    );
    // A mode other than affine.
    config["quantization"]["mode"] = "mxfp4".into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_model(&dir, f32_opts())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("mxfp4"), "{err}");
    // Bits the kernels do not have.
    config["quantization"] = serde_json::json!({"group_size": 64, "bits": 7});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let err = load_model(&dir, f32_opts())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("bits 7"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    // Asking to quantize to a width or group MLX does not have.
    assert!(LoadOptions::from_settings(None, Some(7), 64, None).is_err());
    assert!(LoadOptions::from_settings(None, Some(4), 48, None).is_err());
}
