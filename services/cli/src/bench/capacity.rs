//! `llmq bench capacity`: `streams` chat requests that each allow `max_tokens`, far more than
//! their answers take (they stop at end of sequence, as chat and agent clients' requests do),
//! against the worker's KV budget. Reports the most streams decoding at once (from the worker's
//! heartbeats, sent every 100 ms for this scenario), the output tokens/s, the preemptions, the
//! most KV bytes the worker's actors held (buffers as allocated, and the prefix cache), and how
//! many of these requests a reservation of prompt + `max_tokens` each would have admitted.

use std::time::Instant;

use anyhow::{bail, Result};
use futures::StreamExt;
use llmq_protocol::{subjects, ChatMessage, GenerateRequest, WorkerStatus};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::measure::round;
use super::stack::{Client, Knobs, Seen};

/// The worker's heartbeat interval while this scenario runs.
pub(super) const HEARTBEAT_MS: u64 = 100;

/// Questions SmolLM2-135M-Instruct answers in 6 to 200 tokens, greedily.
const QUESTIONS: [&str; 16] = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain in two sentences why the sky is blue.",
    "What is the largest ocean on Earth?",
    "What is photosynthesis?",
    "List five fruits.",
    "How many days are in a leap year?",
    "What is the speed of light?",
    "What does a compiler do?",
    "Suggest a name for a small grey cat.",
    "Why do we have seasons?",
    "What is the boiling point of water at sea level?",
    "Describe a rainbow in one paragraph.",
    "What are the planets of the solar system?",
    "Give two tips for sleeping better.",
    "What is the difference between weather and climate?",
];

pub(super) async fn capacity(
    c: &mut Client,
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    k: &Knobs,
) -> Result<Value> {
    let before = c.status().await?;
    let mut beats = c.nc.subscribe(subjects::WORKER_STATUS_ALL).await?;
    let t0 = Instant::now();
    for i in 0..k.streams {
        let q = QUESTIONS[i % QUESTIONS.len()];
        c.submit_request(GenerateRequest {
            model: k.model.clone(),
            messages: Some(vec![ChatMessage::new("user", q)]),
            max_tokens: Some(k.output_tokens as i64),
            ..Default::default()
        })
        .await?;
    }
    let (mut produced, mut ended, mut prompts) = (0usize, 0usize, 0u64);
    let (mut peak, mut peak_bytes) = (0u32, 0u64);
    while ended < k.streams {
        tokio::select! {
            seen = rx.recv() => {
                let Some(s) = seen else { bail!("the streams' channel closed") };
                produced += s.tokens;
                prompts += s.prompt.unwrap_or(0) as u64;
                ended += s.terminal as usize;
            }
            Some(m) = beats.next() => {
                if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                    if s.role.takes_jobs() {
                        peak = peak.max(s.active_streams);
                        peak_bytes = peak_bytes.max(s.kv_bytes_used);
                    }
                }
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let after = c.status().await?;
    let mean_prompt = prompts as f64 / k.streams.max(1) as f64;
    let per_request = before.kv_bytes_per_token as f64 * (mean_prompt + k.output_tokens as f64);
    Ok(json!({
        "scenario": "capacity", "streams": k.streams, "max_tokens": k.output_tokens,
        "kv_budget_bytes": before.kv_bytes_free, "kv_blocks": before.kv_blocks_total,
        "peak_decoding": peak, "peak_kv_bytes_held": peak_bytes,
        "admitted_by_reserving_max_tokens": (before.kv_bytes_free as f64 / per_request).floor(),
        "mean_prompt_tokens": round(mean_prompt, 1),
        "mean_output_tokens": round(produced as f64 / k.streams.max(1) as f64, 1),
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(produced as f64 / wall, 1),
        "preemptions": after.preemptions.saturating_sub(before.preemptions),
    }))
}
