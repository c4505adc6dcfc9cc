//! `bench batch --constrained KIND`: the same batch free and then with every stream under a
//! constraint, in one stack, with what the masks cost the worker.

use anyhow::{bail, Result};
use llmq_protocol::Constraint;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::batch::batch;
use super::measure::round;
use super::stack::{Client, Knobs, Seen};

/// A constraint no stream completes within `output_tokens`: a JSON array of at least that many
/// records (an integer, a short string, a boolean each), so that every stream decodes its
/// whole length under a mask that follows keys, strings, numbers and structure.
fn bench_constraint(kind: &str, output_tokens: usize) -> Result<Constraint> {
    match kind {
        "json" => {
            let record = json!({
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
                "required": ["id", "name", "ok"],
                "additionalProperties": false,
            });
            let schema =
                json!({"type": "array", "items": record, "minItems": output_tokens.max(1)});
            Ok(Constraint::JsonSchema {
                schema: schema.to_string(),
            })
        }
        other => bail!("unknown constraint kind {other:?} (json)"),
    }
}

/// The batch twice in one stack: every stream free, then every stream constrained; their
/// steady output rates side by side, and what the masks cost the worker.
pub(super) async fn constrained_batch(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
    kind: &str,
) -> Result<Value> {
    let free = batch(&mut c, &mut rx, k, 7).await?;
    c.constraint = Some(bench_constraint(kind, k.output_tokens)?);
    let s0 = c.status().await?;
    // Prompts of their own: the free batch's would be prefix-cache hits, and start together.
    let held = batch(&mut c, &mut rx, k, 7 + k.streams as u64).await?;
    let s1 = c.status().await?;
    let rate = |v: &Value| v["steady_output_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    let steps = (s1.constrained_steps - s0.constrained_steps).max(1) as f64;
    let rows = (s1.constrained_rows - s0.constrained_rows).max(1) as f64;
    Ok(json!({
        "scenario": "batch", "constrained": kind, "streams": k.streams, "prompt_tokens": k.prompt_tokens,
        "output_tokens": k.output_tokens,
        "free_steady_output_tokens_per_s": rate(&free),
        "constrained_steady_output_tokens_per_s": rate(&held),
        "constrained_over_free": round(rate(&held) / rate(&free), 3),
        "free_decode_step_ms": free["decode_step_ms"], "constrained_decode_step_ms": held["decode_step_ms"],
        "constrained_steps": s1.constrained_steps - s0.constrained_steps,
        "mask_ms_per_step": round((s1.mask_ms - s0.mask_ms) / steps, 3),
        "mask_ms_per_row": round((s1.mask_ms - s0.mask_ms) / rows, 4),
        "mask_blocked_ms_per_step": round((s1.mask_blocked_ms - s0.mask_blocked_ms) / steps, 3),
        "logits_wait_after_masks_ms_per_step": round((s1.mask_wait_ms - s0.mask_wait_ms) / steps, 3),
    }))
}
