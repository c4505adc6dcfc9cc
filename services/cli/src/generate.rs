//! `llmq generate`: streams a model's answer to stdout. `--local` runs the engine in process.

use std::io::Write;

use anyhow::{Context, Result};
use llmq_engine::generate::{generate, LocalRequest};
use llmq_engine::{load_model, LoadOptions};
use llmq_text::resolve_model;
use llmq_text::sampling::{self, Sampling, StopConditions};

#[derive(clap::Args)]
pub struct Args {
    /// Run the engine in this process (no NATS).
    #[arg(long)]
    pub local: bool,
    /// A known model name (smollm2) or a path to a Hugging Face directory or a .gguf file.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Report this many alternatives' logprobs per token (with --json).
    #[arg(long, default_value_t = 0)]
    pub top_logprobs: u32,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 4096)]
    prefill_chunk: usize,
    #[command(flatten)]
    pub weights: WeightArgs,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// NATS server to submit to (without --local).
    #[arg(long, env = "LLMQ_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats: String,
}

/// How a model's weights are loaded (`llmq generate --local`, `llmq bench`).
#[derive(clap::Args)]
pub struct WeightArgs {
    /// f32, f16 or bf16 (default: f32 on CPU, bf16 on GPU).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Quantize full-precision weights at load to this many bits (2, 3, 4, 5, 6, 8), kept
    /// quantized on the device.
    #[arg(long)]
    pub quantize: Option<i32>,
    /// Elements per scale and bias for --quantize: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    pub group_size: i32,
    /// Keep a quantized checkpoint's weights quantized (true) or dequantize them at load
    /// (false). Default: true on a GPU, false on a CPU (dense f32 is faster there).
    #[arg(long)]
    pub keep_quantized: Option<bool>,
}

impl WeightArgs {
    pub fn options(&self) -> Result<LoadOptions> {
        Ok(LoadOptions::from_settings(
            self.dtype.as_deref(),
            self.quantize,
            self.group_size,
            self.keep_quantized,
        )?)
    }
}

pub fn run(a: Args) -> Result<()> {
    if !a.local {
        return crate::client::generate(&a);
    }
    let path = resolve_model(&a.model)?;
    let loaded = load_model(&path, a.weights.options()?)
        .with_context(|| format!("loading {}", path.display()))?;
    eprintln!("weights: {}", loaded.model.weights_summary());
    let tok = loaded
        .tokenizer
        .as_ref()
        .context("this model has no tokenizer")?;
    let prompt_ids = tok.prompt_ids(&a.prompt, a.chat)?;
    let req = LocalRequest {
        prompt_ids: prompt_ids.clone(),
        sampling: Sampling {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            seed: a.seed,
            top_logprobs: a.top_logprobs,
            logprobs: a.top_logprobs > 0,
        },
        stop: StopConditions {
            max_tokens: a.max_tokens,
            stop: a.stop.clone(),
            ..Default::default()
        },
        prefill_chunk: a.prefill_chunk,
    };
    sampling::validate(&req.sampling)?;
    sampling::validate_stop(&req.stop)?;
    let mut stdout = std::io::stdout().lock();
    let out = generate(&loaded.model, Some(tok), &req, |_, piece| {
        if !a.json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if a.json {
        let v = serde_json::json!({
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": prompt_ids,
            "finish_reason": out.finish_reason,
            "ttft_ms": out.ttft.as_secs_f64() * 1000.0,
            "ms_per_token": out.ms_per_token(),
            "logprobs": out.logprobs,
            "model": path,
            "weights": loaded.model.weights_summary(),
        });
        writeln!(stdout, "{v}")?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}
