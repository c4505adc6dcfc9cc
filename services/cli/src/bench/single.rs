//! `llmq bench single`: one stream, greedy, in process (no NATS): ms per token at steady
//! state, with the weights' bytes and the single-stream roofline of the H200's memory.

use std::time::Instant;

use anyhow::{bail, Result};
use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::{load_model, on_gpu, shapes, Model};
use llmq_text::resolve_model;
use llmq_text::sampling::{Sampling, StopConditions};

use super::args::SingleArgs;
use super::measure::{median, print, random_prompt, round};

/// H200 HBM bandwidth: the single-stream decode roofline is the bytes a token reads / this.
const HBM_BYTES_PER_S: f64 = 4.8e12;

fn single(model: &Model, a: &SingleArgs) -> Result<serde_json::Value> {
    let req = LocalRequest {
        prompt_ids: random_prompt(a.prompt_tokens, 1),
        sampling: Sampling::default(),
        stop: StopConditions {
            max_tokens: a.output_tokens as u32,
            ignore_eos: true,
            ..Default::default()
        },
        prefill_chunk: 4096,
    };
    // Warm-up: the first run compiles kernels and allocates.
    generate(
        model,
        None,
        &LocalRequest {
            stop: StopConditions {
                max_tokens: 16,
                ..req.stop.clone()
            },
            ..req.clone()
        },
        |_, _| {},
    )?;
    let mut times = Vec::with_capacity(a.output_tokens);
    generate(model, None, &req, |_, _| times.push(Instant::now()))?;
    let gaps: Vec<f64> = times
        .windows(2)
        .skip(10)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1000.0)
        .collect();
    if gaps.is_empty() {
        bail!("--output-tokens must be above 12 to measure steady gaps");
    }
    let ms = median(gaps);
    Ok(serde_json::json!({
        "scenario": "single",
        "ms_per_token": round(ms, 3),
        "tokens_per_s": (10000.0 / ms).round() / 10.0,
    }))
}

pub(super) fn run(a: SingleArgs) -> Result<()> {
    let m = &a.model;
    let opts = m.weights.options()?;
    let dtype = opts.dtype;
    let t0 = Instant::now();
    let (model, label, random) = match (&m.model, &m.random_weights) {
        (_, Some(shape)) => (shapes::random_model(shape, opts, 0)?, shape.clone(), true),
        (Some(name), None) => (
            load_model(&resolve_model(name)?, opts)?.model,
            name.clone(),
            false,
        ),
        (None, None) => bail!("give --model NAME or --random-weights SHAPE"),
    };
    let load_s = t0.elapsed().as_secs_f64();
    let nbytes = model.weight_bytes();
    let read_per_token = model.bytes_read_per_token();
    let mut res = single(&model, &a)?;
    let obj = res.as_object_mut().expect("object");
    let key = if random { "shape" } else { "model" };
    obj.insert(key.into(), label.into());
    obj.insert("engine".into(), "llmq".into());
    obj.insert("device".into(), if on_gpu() { "gpu" } else { "cpu" }.into());
    obj.insert("dtype".into(), format!("{dtype:?}").into());
    obj.insert("weights".into(), model.weights_summary().into());
    obj.insert("weight_bytes".into(), nbytes.into());
    obj.insert("load_s".into(), round(load_s, 2).into());
    if let (true, Some(ms)) = (random, obj.get("ms_per_token").and_then(|v| v.as_f64())) {
        let roof = read_per_token as f64 / HBM_BYTES_PER_S * 1000.0;
        obj.insert("hbm_roofline_ms".into(), round(roof, 3).into());
        // Six decimals: tiny shapes on a CPU are far below the H200 roofline, and still above 0.
        obj.insert(
            "fraction_of_roofline".into(),
            ((roof / ms * 1e6).round() / 1e6).into(),
        );
    }
    print(&res, m.json)
}
