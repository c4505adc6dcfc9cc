//! The engine against transformers: tiny random-weight checkpoints of every architecture
//! (tests/reference/make_fixtures.py made them and transformers' logits), in one piece, in
//! chunks, and decoded in a batch of sequences at different positions.
//!
//! Tolerance: 1e-4 absolute on logits of magnitude 2-3.5. The reference is computed by
//! transformers in float64, the engine computes in float32. A wrong op, weight or position shows
//! up as differences of 0.1 and more.

mod common;

use common::*;
use llmq_engine::model::{host_f32, ChunkStage};
use mlx_rs::Array;

const TOL: f32 = 1e-4;
const MODELS: &[&str] = &[
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-qwen2-moe",
    "tiny-llama3",
    "tiny-llama-linear",
    "tiny-llama-dynamic",
    "tiny-qwen2-yarn",
    "tiny-phi3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-lfm2",
    "tiny-qwen35",
];
/// Without a sliding window: these decode in batches and (but LFM2 and Qwen3.5, whose
/// recurrent states cannot rewind) pad chunks to a grid.
const FULL_ATTENTION: &[&str] = &[
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-qwen2-moe",
    "tiny-llama3",
    "tiny-llama-linear",
    "tiny-llama-dynamic",
    "tiny-qwen2-yarn",
    "tiny-phi3",
    "tiny-lfm2",
    "tiny-qwen35",
];
/// Rotary scaling past the original context in the longer cases: llama3 (bf16), yarn, and the
/// position-dependent dynamic and longrope (with partial rotation).
const SCALED_ROPE: &[&str] = &[
    "tiny-llama3",
    "tiny-qwen2-yarn",
    "tiny-llama-dynamic",
    "tiny-phi3",
];
/// Mixtures of experts: a decode step's rows and a chunk's share the gathered expert matmuls.
const EXPERTS: &[&str] = &["tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"];

fn check_prefill(name: &str, chunk: usize) {
    check_prefill_on_grid(name, chunk, 1);
}

/// With `grid` > 1, chunks are padded to end on multiples of it (as on a GPU) and the padding
/// rewound: the next chunk overwrites the padding's keys.
fn check_prefill_on_grid(name: &str, chunk: usize, grid: usize) {
    let model = load(name).model.with_chunk_grid(grid);
    for (i, case) in reference(fixture(name).join("reference.safetensors"))
        .iter()
        .enumerate()
    {
        let mut cache = model.new_cache();
        let got = run_chunked(&model, &mut cache, &case.ids, chunk);
        let d = max_abs_diff(&got, &case.logits);
        assert!(
            d < TOL,
            "{name} case {i} (len {}) chunk {chunk} grid {grid}: max |diff| {d}",
            case.ids.len()
        );
        assert_eq!(cache.offset(), case.ids.len());
    }
}

#[test]
fn prefill_in_one_piece_matches_transformers() {
    for m in MODELS {
        check_prefill(m, 4096);
    }
}

#[test]
fn prefill_in_chunks_matches_transformers() {
    for m in MODELS {
        for chunk in [1, 7, 64] {
            check_prefill(m, chunk);
        }
    }
}

#[test]
fn prefill_in_chunks_padded_to_a_grid_matches_transformers() {
    // tiny-mistral has a sliding window: its caches cannot rewind, so it never pads.
    for m in FULL_ATTENTION {
        for chunk in [3, 7, 16, 4096] {
            check_prefill_on_grid(m, chunk, 8);
        }
    }
}

/// Three sequences of lengths 5, 37 and 100, prefilled up to 4 tokens before their ends, then
/// decoded together: each step's logits equal transformers' at that sequence's position.
#[test]
fn batched_decode_of_sequences_at_different_positions_matches_transformers() {
    const STEPS: usize = 4;
    for name in MODELS {
        let m = load(name);
        let cases = reference(fixture(name).join("reference.safetensors"));
        let seqs: Vec<_> = cases.iter().filter(|c| c.ids.len() > STEPS).collect();
        assert_eq!(seqs.len(), 3);
        let mut caches: Vec<_> = seqs
            .iter()
            .map(|c| {
                let mut cache = m.model.new_cache();
                run_chunked(&m.model, &mut cache, &c.ids[..c.ids.len() - STEPS], 16);
                cache
            })
            .collect();
        for step in 0..STEPS {
            let toks: Vec<i32> = seqs
                .iter()
                .map(|c| c.ids[c.ids.len() - STEPS + step] as i32)
                .collect();
            let x = Array::from_slice(&toks, &[toks.len() as i32, 1]);
            let mut refs: Vec<_> = caches.iter_mut().collect();
            let logits = host_f32(&m.model.forward(&x, &mut refs, false).unwrap()).unwrap();
            for (b, c) in seqs.iter().enumerate() {
                let got = &logits[b * c.vocab..(b + 1) * c.vocab];
                let d = max_abs_diff(got, c.row(c.ids.len() - STEPS + step));
                assert!(d < TOL, "{name} seq {b} step {step}: max |diff| {d}");
            }
        }
    }
}

/// The tiny Llama as GGUF with F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors and llama.cpp's
/// Q/K row order, against transformers' own GGUF loader.
#[test]
fn gguf_with_every_tensor_type_matches_transformers() {
    let m = load("tiny-llama.gguf");
    for (i, case) in reference(fixture("tiny-llama-gguf-reference.safetensors"))
        .iter()
        .enumerate()
    {
        let mut cache = m.model.new_cache();
        let got = run_chunked(&m.model, &mut cache, &case.ids, 7);
        let d = max_abs_diff(&got, &case.logits);
        assert!(d < TOL, "gguf case {i}: max |diff| {d}");
    }
}

/// The MoE fixtures as GGUF (Mixtral as arch `llama` with experts and permuted Q/K, Qwen3-MoE as
/// `qwen3moe` with a dense layer and unrenormalised routing), experts stacked and quantized, and
/// Phi-3's (fused q/k/v and gate/up, long RoPE's factors as tensors, partial rotation; past its
/// original context in the longer cases), against transformers on the weights the gguf package
/// dequantizes the files to.
#[test]
fn gguf_of_experts_and_phi3_matches_transformers() {
    for name in ["tiny-mixtral", "tiny-qwen3-moe", "tiny-phi3"] {
        let m = load(&format!("{name}.gguf"));
        assert_eq!(
            m.model.config.moe.is_some(),
            name != "tiny-phi3",
            "{name}: experts from the metadata"
        );
        let cases = reference(fixture(&format!("{name}-gguf-reference.safetensors")));
        check_gguf_cases(name, &m.model, &cases, &[7, 4096]);
    }
}

/// A GGUF model's logits against each reference case's, prefilled in chunks of each size.
fn check_gguf_cases(
    name: &str,
    model: &llmq_engine::model::Model,
    cases: &[Case],
    chunks: &[usize],
) {
    for (i, case) in cases.iter().enumerate() {
        for &chunk in chunks {
            let mut cache = model.new_cache();
            let got = run_chunked(model, &mut cache, &case.ids, chunk);
            let d = max_abs_diff(&got, &case.logits);
            assert!(
                d < TOL,
                "{name} gguf case {i} chunk {chunk}: max |diff| {d}"
            );
        }
    }
}

/// The hybrids as llama.cpp's own converter writes them (make_fixtures.py, `gguf_hybrids`):
/// LFM2 in Q8_0 with its KV heads per layer (0: a convolution layer), against transformers'
/// own GGUF loader; Qwen3.5 in F32 with its DeltaNet projections renamed, A stored as
/// -exp(A_log), norms with their 1 added and value heads tiled over the key heads, against
/// transformers on the checkpoint it was converted from; in one piece, in chunks and a token
/// at a time.
#[test]
fn gguf_of_the_hybrids_matches_transformers() {
    for (name, reference_file) in [
        ("tiny-lfm2", "tiny-lfm2-gguf-reference.safetensors"),
        ("tiny-qwen35", "tiny-qwen35/reference.safetensors"),
    ] {
        let m = load(&format!("{name}.gguf"));
        let c = &m.model.config;
        let recurrent: Vec<bool> = (0..c.num_layers).map(|l| c.recurrent_layer(l)).collect();
        assert_eq!(recurrent, [true, false, true, true], "{name}: layer kinds");
        if let Some(d) = &c.delta {
            assert!(d.value_heads_tiled && d.key_heads < d.value_heads);
        }
        check_gguf_cases(
            name,
            &m.model,
            &reference(fixture(reference_file)),
            &[1, 7, 4096],
        );
    }
}

#[test]
fn gguf_tokenizer_matches_transformers() {
    // Ours, and llama.cpp's converter's.
    for name in ["tiny-llama", "tiny-lfm2"] {
        let m = load(&format!("{name}.gguf"));
        let tok = m.tokenizer.as_ref().unwrap();
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(&format!("{name}-gguf-reference.json"))).unwrap(),
        )
        .unwrap();
        for t in meta["tokenizer"].as_array().unwrap() {
            let text = t["text"].as_str().unwrap();
            let want = json_ids(&t["ids"]);
            assert_eq!(tok.encode(text, false).unwrap(), want, "{name}: {text:?}");
            assert_eq!(tok.decode(&want, false).unwrap(), text);
        }
    }
}

/// A sequence's greedy tokens do not depend on the prefill chunk size or on its batch mates.
#[test]
fn greedy_tokens_are_batch_and_chunk_invariant() {
    for name in MODELS {
        let m = load(name);
        let cases = reference(fixture(name).join("reference.safetensors"));
        let greedy = |chunk: usize, mates: &[&[u32]]| -> Vec<u32> {
            let prompts: Vec<&[u32]> = std::iter::once(&cases[2].ids[..])
                .chain(mates.iter().copied())
                .collect();
            let mut caches: Vec<_> = prompts.iter().map(|_| m.model.new_cache()).collect();
            let mut next: Vec<u32> = prompts
                .iter()
                .zip(caches.iter_mut())
                .map(|(p, c)| {
                    let l = run_chunked(&m.model, c, p, chunk);
                    argmax(&l[l.len() - cases[0].vocab..])
                })
                .collect();
            let mut out = vec![next[0]];
            for _ in 0..12 {
                let toks: Vec<i32> = next.iter().map(|&t| t as i32).collect();
                let x = Array::from_slice(&toks, &[toks.len() as i32, 1]);
                let mut refs: Vec<_> = caches.iter_mut().collect();
                let l = host_f32(&m.model.forward(&x, &mut refs, false).unwrap()).unwrap();
                next = l.chunks(cases[0].vocab).map(argmax).collect();
                out.push(next[0]);
            }
            out
        };
        let alone = greedy(4096, &[]);
        assert_eq!(alone, greedy(1, &[]), "{name}: chunk 1");
        assert_eq!(alone, greedy(5, &[]), "{name}: chunk 5");
        assert_eq!(
            alone,
            greedy(64, &[&cases[3].ids, &cases[1].ids]),
            "{name}: in a batch of three"
        );
    }
}

/// The same through the decode batch (the KV in its block pool, one scatter and one attention
/// per layer): sequences join after their prefill, and one leaves mid-way, moving the last row
/// into its place; every remaining sequence's logits still equal transformers'.
#[test]
fn decode_batch_with_joins_and_leaves_matches_transformers() {
    for name in FULL_ATTENTION {
        decode_batch_matches(name, &load(name).model, "");
    }
    assert!(
        load("tiny-gemma2").model.new_decode_batch().is_none(),
        "soft-capped attention decodes per sequence"
    );
}

/// Sliding-window models (window 8) through the decode batch: prompts longer than the window
/// join with only its last positions, and each row's sliding layers attend over their window,
/// through llmq's CPU attention and through MLX's masked and row-by-row attention.
#[test]
fn sliding_windows_in_the_decode_batch_match_transformers() {
    for name in ["tiny-mistral", "tiny-gemma3"] {
        decode_batch_matches(name, &load(name).model, "");
        let masked = load(name).model.with_masked_decode_attention();
        decode_batch_matches(name, &masked, "masked");
    }
}

fn decode_batch_matches(name: &str, model: &llmq_engine::Model, how: &str) {
    const STEPS: usize = 6;
    let cases = reference(fixture(name).join("reference.safetensors"));
    let seqs: Vec<_> = cases.iter().filter(|c| c.ids.len() > STEPS).collect();
    for per_row in [0, 8] {
        let mut batch = model
            .new_decode_batch()
            .expect("a model that decodes in batches")
            .with_per_row_attention(per_row);
        // rows[r] = which sequence row r holds
        let mut rows: Vec<usize> = vec![];
        for (i, c) in seqs.iter().enumerate() {
            let mut cache = model.new_cache();
            run_chunked(model, &mut cache, &c.ids[..c.ids.len() - STEPS], 9);
            assert_eq!(batch.join(&cache).unwrap(), i);
            rows.push(i);
        }
        for step in 0..STEPS {
            if step == 3 {
                // The first sequence leaves; the last row moves into row 0.
                let moved = batch.leave(0).unwrap();
                assert_eq!(moved, Some(rows.len() - 1));
                let last = rows.pop().unwrap();
                rows[0] = last;
            }
            let toks: Vec<u32> = rows
                .iter()
                .map(|&s| seqs[s].ids[seqs[s].ids.len() - STEPS + step])
                .collect();
            let logits = host_f32(&model.decode_batch(&toks, &mut batch).unwrap()).unwrap();
            for (r, &s) in rows.iter().enumerate() {
                let c = seqs[s];
                let got = &logits[r * c.vocab..(r + 1) * c.vocab];
                let d = max_abs_diff(got, c.row(c.ids.len() - STEPS + step));
                assert!(
                    d < TOL,
                    "{name} {how} (per row: {per_row}) seq {s} (row {r}) step {step}: max |diff| {d}"
                );
            }
        }
        while !batch.is_empty() {
            batch.leave(0).unwrap();
        }
        assert_eq!(batch.nbytes(), 0, "an empty batch holds no memory");
    }
}

/// Sequences split over two decode batches (length groups) stepped together: one weight pass,
/// attention per group (the second group's rows also one by one, unmasked); logits still equal
/// transformers'.
#[test]
fn grouped_decode_matches_transformers() {
    const STEPS: usize = 4;
    let scaled = SCALED_ROPE
        .iter()
        .chain(EXPERTS)
        .flat_map(|&m| [(m, 0), (m, 8)]);
    for (name, per_row) in [
        ("tiny-llama", 0),
        ("tiny-qwen3", 0),
        ("tiny-llama", 8),
        ("tiny-qwen3", 8),
    ]
    .into_iter()
    .chain(scaled)
    {
        let m = load(name);
        let cases = reference(fixture(name).join("reference.safetensors"));
        let seqs: Vec<_> = cases.iter().filter(|c| c.ids.len() > STEPS).collect();
        assert!(
            seqs.len() >= 3,
            "the long group needs rows of different lengths"
        );
        let mut short = m.model.new_decode_batch().unwrap();
        let mut long = m
            .model
            .new_decode_batch()
            .unwrap()
            .with_per_row_attention(per_row);
        for (i, c) in seqs.iter().enumerate() {
            let mut cache = m.model.new_cache();
            run_chunked(&m.model, &mut cache, &c.ids[..c.ids.len() - STEPS], 16);
            if i == 0 {
                short.join(&cache).unwrap()
            } else {
                long.join(&cache).unwrap()
            };
        }
        for step in 0..STEPS {
            let tok = |c: &&Case| c.ids[c.ids.len() - STEPS + step];
            let a: Vec<u32> = seqs[..1].iter().map(tok).collect();
            let b: Vec<u32> = seqs[1..].iter().map(tok).collect();
            let logits = host_f32(
                &m.model
                    .decode_groups(&mut [(&a[..], &mut short), (&b[..], &mut long)])
                    .unwrap(),
            )
            .unwrap();
            for (r, c) in seqs.iter().enumerate() {
                let d = max_abs_diff(
                    &logits[r * c.vocab..(r + 1) * c.vocab],
                    c.row(c.ids.len() - STEPS + step),
                );
                assert!(
                    d < TOL,
                    "{name} (per row: {per_row}) seq {r} step {step}: max |diff| {d}"
                );
            }
        }
    }
}

/// A decode batch of `cases`, each prefilled up to `steps` tokens short of its end.
fn batch_short_of(
    model: &llmq_engine::Model,
    cases: &[&Case],
    steps: usize,
) -> llmq_engine::batch::DecodeBatch {
    let mut batch = model.new_decode_batch().unwrap();
    for c in cases {
        let mut cache = model.new_cache();
        run_chunked(model, &mut cache, &c.ids[..c.ids.len() - steps], 16);
        batch.join(&cache).unwrap();
    }
    batch
}

/// A decode step and another sequence's prefill chunk in one pass (`Model::step`): the decoding
/// sequences' logits and the chunk's last-position logits still equal transformers', chunk
/// after chunk, and the chunked sequence's cache ends where one-piece prefill's would (also with
/// the chunks padded to a grid, as on a GPU).
#[test]
fn decode_fused_with_a_prefill_chunk_matches_transformers() {
    const STEPS: usize = 4;
    let scaled = SCALED_ROPE
        .iter()
        .chain(EXPERTS)
        .flat_map(|&m| [(m, 1), (m, 8)]);
    for (name, grid) in [
        ("tiny-llama", 1),
        ("tiny-qwen2", 1),
        ("tiny-qwen3", 1),
        ("tiny-llama", 8),
        ("tiny-qwen3", 8),
    ]
    .into_iter()
    .chain(scaled)
    {
        let model = load(name).model.with_chunk_grid(grid);
        let cases = reference(fixture(name).join("reference.safetensors"));
        let decoding: Vec<_> = cases
            .iter()
            .filter(|c| c.ids.len() > STEPS && c.ids.len() < 60)
            .collect();
        let chunked = cases.iter().max_by_key(|c| c.ids.len()).unwrap();
        assert!(
            chunked.ids.len() >= 4 * STEPS,
            "{name}: a long case to chunk"
        );
        let mut batch = batch_short_of(&model, &decoding, STEPS);
        let mut cache = model.new_cache();
        let chunk = chunked.ids.len().div_ceil(STEPS);
        for step in 0..STEPS {
            let toks: Vec<u32> = decoding
                .iter()
                .map(|c| c.ids[c.ids.len() - STEPS + step])
                .collect();
            let (from, to) = (step * chunk, ((step + 1) * chunk).min(chunked.ids.len()));
            let logits = host_f32(
                &model
                    .step(
                        &mut [(&toks[..], &mut batch)],
                        Some((&chunked.ids[from..to], &mut cache)),
                    )
                    .unwrap(),
            )
            .unwrap();
            let v = chunked.vocab;
            assert_eq!(logits.len(), (decoding.len() + 1) * v);
            for (r, c) in decoding.iter().enumerate() {
                let d = max_abs_diff(
                    &logits[r * v..(r + 1) * v],
                    c.row(c.ids.len() - STEPS + step),
                );
                assert!(
                    d < TOL,
                    "{name} decoding seq {r} step {step}: max |diff| {d}"
                );
            }
            let d = max_abs_diff(&logits[decoding.len() * v..], chunked.row(to - 1));
            assert!(
                d < TOL,
                "{name} grid {grid} chunk ending at {to}: max |diff| {d}"
            );
        }
        assert_eq!(cache.offset(), chunked.ids.len());
    }
}

/// A prefill chunk's layers spread over two decode steps (`Model::step_staged`; the fixtures
/// have two layers: one a step): every step's decoding logits and each chunk's last-position
/// logits (after its second stage) still equal transformers', also padded to a grid; the
/// chunked sequence's cache ends where one-piece prefill's would.
#[test]
fn decode_fused_with_a_chunk_in_stages_matches_transformers() {
    const CHUNKS: usize = 3;
    const STEPS: usize = 2 * CHUNKS;
    let scaled = SCALED_ROPE.iter().chain(EXPERTS).map(|&m| (m, 1));
    for (name, grid) in [
        ("tiny-llama", 1),
        ("tiny-qwen3", 1),
        ("tiny-llama", 8),
        ("tiny-qwen2", 8),
    ]
    .into_iter()
    .chain(scaled)
    {
        let model = load(name).model.with_chunk_grid(grid);
        let layers = model.num_layers();
        assert!(layers >= 2, "{name}: two layers to split");
        let cases = reference(fixture(name).join("reference.safetensors"));
        let decoding: Vec<_> = cases
            .iter()
            .filter(|c| c.ids.len() > STEPS && c.ids.len() < 60)
            .collect();
        assert!(!decoding.is_empty(), "{name}: cases to decode");
        let chunked = cases.iter().max_by_key(|c| c.ids.len()).unwrap();
        let mut batch = batch_short_of(&model, &decoding, STEPS);
        let mut cache = model.new_cache();
        let chunk = chunked.ids.len().div_ceil(CHUNKS);
        let v = chunked.vocab;
        let mut hidden = None;
        for step in 0..STEPS {
            let toks: Vec<u32> = decoding
                .iter()
                .map(|c| c.ids[c.ids.len() - STEPS + step])
                .collect();
            let k = step / 2;
            let (from, to) = (k * chunk, ((k + 1) * chunk).min(chunked.ids.len()));
            let last = step % 2 == 1;
            let stage = if last {
                layers / 2..layers
            } else {
                0..layers / 2
            };
            let part = ChunkStage {
                tokens: &chunked.ids[from..to],
                cache: &mut cache,
                layers: stage,
                hidden: hidden.take(),
            };
            let (logits, h) = model
                .step_staged(&mut [(&toks[..], &mut batch)], None, Some(part))
                .unwrap();
            assert_eq!(
                h.is_some(),
                !last,
                "{name} step {step}: a hidden state between stages only"
            );
            hidden = h;
            let logits = host_f32(&logits).unwrap();
            assert_eq!(logits.len(), (decoding.len() + last as usize) * v);
            for (r, c) in decoding.iter().enumerate() {
                let d = max_abs_diff(
                    &logits[r * v..(r + 1) * v],
                    c.row(c.ids.len() - STEPS + step),
                );
                assert!(
                    d < TOL,
                    "{name} grid {grid} decoding seq {r} step {step}: max |diff| {d}"
                );
            }
            if last {
                let d = max_abs_diff(&logits[decoding.len() * v..], chunked.row(to - 1));
                assert!(
                    d < TOL,
                    "{name} grid {grid} chunk ending at {to}: max |diff| {d}"
                );
            }
        }
        assert_eq!(cache.offset(), chunked.ids.len());
    }
}

/// A recurrent model resumed from what the prefix cache keeps at a position (the attention
/// layers' keys and values, the recurrent layers' states there) continues exactly as
/// transformers' one pass over the whole sequence.
#[test]
fn a_state_snapshot_resumes_as_the_whole_computation() {
    for name in ["tiny-lfm2", "tiny-qwen35"] {
        let model = load(name).model;
        for (i, case) in reference(fixture(name).join("reference.safetensors"))
            .iter()
            .enumerate()
            .filter(|(_, c)| c.ids.len() > 4)
        {
            let at = case.ids.len() / 2;
            let mut first = model.new_cache();
            run_chunked(&model, &mut first, &case.ids[..at], 7);
            let kept = first.prefix_layers().expect("every layer keeps its part");
            let mut resumed = model.cache_from_prefix(&kept, at, case.ids.len()).unwrap();
            let got = run_chunked(&model, &mut resumed, &case.ids[at..], 3);
            let d = max_abs_diff(&got, &case.logits[at * case.vocab..]);
            assert!(d < TOL, "{name} case {i} resumed at {at}: max |diff| {d}");
        }
    }
}

/// `fixture` rewritten as mlx-lm's conversion writes it (its `sanitize`): the convolutions'
/// filters as [channels, kernel, 1]; for Qwen3.5, whose checkpoints are multimodal, the text
/// model's names under `language_model.`, the config nested in `text_config`, and the norms
/// (all but DeltaNet's own) stored with their 1 added.
fn write_as_mlx_lm(name: &str) -> std::path::PathBuf {
    let src = fixture(name);
    let dir = std::env::temp_dir().join(format!("llmq-mlx-lm-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let qwen35 = name == "tiny-qwen35";
    let norms = [
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    ];
    let mut out = std::collections::HashMap::new();
    for (key, a) in Array::load_safetensors(src.join("model.safetensors")).unwrap() {
        let a = if key.ends_with("conv.conv.weight") || key.ends_with("conv1d.weight") {
            a.swap_axes(1, 2).unwrap()
        } else if qwen35 && norms.iter().any(|n| key.ends_with(n)) {
            a.add(Array::from_f32(1.0)).unwrap()
        } else {
            a
        };
        let key = if qwen35 {
            format!("language_model.{key}")
        } else {
            key
        };
        out.insert(key, a);
    }
    Array::save_safetensors(out, None, dir.join("model.safetensors")).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let config = if qwen35 {
        serde_json::json!({
            "model_type": "qwen3_5",
            "tie_word_embeddings": config["tie_word_embeddings"],
            "text_config": config,
        })
    } else {
        config
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// The hybrid families' checkpoints as mlx-lm converts them load into the same model:
/// transformers' logits.
#[test]
fn mlx_lm_conversions_of_the_hybrids_match_transformers() {
    for name in ["tiny-lfm2", "tiny-qwen35"] {
        let dir = write_as_mlx_lm(name);
        let model = llmq_engine::load_model(&dir, mlx_rs::Dtype::Float32)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .model;
        for (i, case) in reference(fixture(name).join("reference.safetensors"))
            .iter()
            .enumerate()
        {
            let mut cache = model.new_cache();
            let got = run_chunked(&model, &mut cache, &case.ids, 16);
            let d = max_abs_diff(&got, &case.logits);
            assert!(d < TOL, "{name} (mlx-lm's layout) case {i}: max |diff| {d}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
