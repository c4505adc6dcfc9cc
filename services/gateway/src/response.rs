//! OpenAI's response pieces: a stream's chunks (text, a whole tool call), calls in OpenAI's
//! shape, finish reasons, usage and logprobs in each endpoint's format.

use actix_web::web::Bytes;
use llmq_protocol::{FinishReason, TokenLogprob, ToolSyntax, Usage};
use serde_json::{json, Value};

use crate::openai::{Kind, Shape};
use crate::tool_calls::{Call, ToolCallParser};

/// One chunk of a stream in the endpoint's format, for choice `index`.
#[allow(clippy::too_many_arguments)]
pub fn chunk(shape: &Shape, id: &str, created: u64, index: u32, text: Option<&str>, role: bool, lps: &[TokenLogprob], finish: Option<&str>) -> Value {
    let logprobs = match shape.logprobs {
        Some(_) if !lps.is_empty() => logprobs(shape.kind, lps),
        _ => Value::Null,
    };
    match shape.kind {
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "id": id, "object": shape.kind.object(true), "created": created, "model": shape.model,
                "choices": [{ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish }],
            })
        }
        Kind::Completion => json!({
            "id": id, "object": shape.kind.object(true), "created": created, "model": shape.model,
            "choices": [{ "index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish }],
        }),
    }
}

/// A chat stream's chunk carrying one whole tool call, for choice `index`.
pub fn tool_call_chunk(shape: &Shape, id: &str, created: u64, index: u32, call: &Call) -> Value {
    json!({
        "id": id, "object": shape.kind.object(true), "created": created, "model": shape.model,
        "choices": [{ "index": index, "delta": { "tool_calls": [tool_call(call, true)] }, "logprobs": null, "finish_reason": null }],
    })
}

/// A call in OpenAI's shape (with its index in a stream's delta).
pub fn tool_call(c: &Call, with_index: bool) -> Value {
    let mut v = json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } });
    if with_index {
        v["index"] = json!(c.index);
    }
    v
}

/// The finish reason of a choice: `tool_calls` where it ended by calling.
pub fn finish_reason(reason: FinishReason, called: bool) -> &'static str {
    match reason {
        FinishReason::Stop if called => "tool_calls",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// One tool-call parser per choice, for a chat request with tools.
pub fn parsers(shape: &Shape, syntax: Option<ToolSyntax>) -> Vec<Option<ToolCallParser>> {
    (0..shape.n).map(|_| syntax.filter(|_| shape.kind == Kind::Chat).map(ToolCallParser::new)).collect()
}

pub fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}


pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.prompt + u.completion,
        "prompt_tokens_details": { "cached_tokens": u.cached },
    })
}

fn bytes(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// Logprobs of some tokens in the endpoint's format: chat's `{content: [...]}`, or the legacy
/// completions' parallel lists.
pub fn logprobs(kind: Kind, lps: &[TokenLogprob]) -> Value {
    match kind {
        Kind::Chat => json!({
            "content": lps.iter().map(|lp| json!({
                "token": lp.text, "logprob": lp.logprob, "bytes": bytes(&lp.text),
                "top_logprobs": lp.top.iter().zip(&lp.top_text).map(|((_, l), t)| json!({
                    "token": t, "logprob": l, "bytes": bytes(t),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
        Kind::Completion => json!({
            "tokens": lps.iter().map(|lp| lp.text.clone()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|lp| {
                lp.top.iter().zip(&lp.top_text).map(|((_, l), t)| (t.clone(), json!(l))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
        }),
    }
}
