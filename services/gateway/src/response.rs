//! OpenAI's response pieces: a stream's chunks (text, a whole tool call), calls in OpenAI's
//! shape, finish reasons, usage and logprobs in each endpoint's format.

use actix_web::web::Bytes;
use llmq_protocol::{Event, FinishReason, TokenLogprob, ToolSyntax, Usage};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openai::{Kind, Shape};
use crate::tool_calls::{Call, ToolCallParser};

/// One chunk of a stream in the endpoint's format, for choice `index`.
#[allow(clippy::too_many_arguments)]
pub fn chunk(
    shape: &Shape,
    id: &str,
    created: u64,
    index: u32,
    text: Option<&str>,
    role: bool,
    lps: &[TokenLogprob],
    finish: Option<&str>,
) -> Value {
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
    (0..shape.n)
        .map(|_| {
            syntax
                .filter(|_| shape.kind == Kind::Chat)
                .map(ToolCallParser::new)
        })
        .collect()
}

pub fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The end of every stream.
const DONE: &[u8] = b"data: [DONE]\n\n";

/// How a stream ends on an error: the error chunk, then `[DONE]`.
pub fn failed(e: &ApiError) -> [Bytes; 2] {
    [sse(&e.body()), Bytes::from_static(DONE)]
}

/// A stream's events turned into server-sent events: the choices' chunks, their tool calls,
/// the usage chunk once every choice has ended, and `[DONE]` after the last one or an error.
pub struct SseWriter<'a> {
    shape: &'a Shape,
    id: String,
    created: u64,
    /// Choices still running, and the usage of those ended (the prompt counted once).
    open: u32,
    total: Usage,
    parsers: Vec<Option<ToolCallParser>>,
}

impl<'a> SseWriter<'a> {
    pub fn new(shape: &'a Shape, id: String, created: u64, syntax: Option<ToolSyntax>) -> Self {
        SseWriter {
            shape,
            id,
            created,
            open: shape.n,
            total: Usage::default(),
            parsers: parsers(shape, syntax),
        }
    }

    /// What a stream starts with: a chat's choices each open with the assistant's role.
    pub fn opening(&self) -> Vec<Bytes> {
        match self.shape.kind {
            Kind::Chat => (0..self.shape.n)
                .map(|i| self.chunk(i, Some(""), true, &[], None))
                .collect(),
            Kind::Completion => vec![],
        }
    }

    /// One event's output, and the request's outcome where the event ended it.
    pub fn event(&mut self, choice: u32, event: Event) -> (Vec<Bytes>, Option<&'static str>) {
        let mut out = vec![];
        let mut end = None;
        match event {
            Event::Queued { position } => out.push(Bytes::from(format!(": queued {position}\n\n"))),
            Event::PrefillProgress { done, total } => {
                out.push(Bytes::from(format!(": prefill {done}/{total}\n\n")))
            }
            Event::Tokens { text, logprobs, .. } => {
                let (text, calls) = match self.parser(choice) {
                    Some(p) => {
                        let parsed = p.push(&text);
                        (parsed.content, parsed.calls)
                    }
                    None => (text, vec![]),
                };
                if !text.is_empty() || !logprobs.is_empty() {
                    out.push(self.chunk(choice, Some(&text), false, &logprobs, None));
                }
                out.extend(calls.iter().map(|c| self.call(choice, c)));
            }
            Event::Done {
                finish_reason: reason,
                usage,
                ..
            } => {
                if self.choice_done(choice, reason, usage, &mut out) {
                    end = Some("ok");
                }
            }
            Event::Error { error } => {
                let e = ApiError::from_wire(&error);
                out.extend(failed(&e));
                return (out, Some(e.code));
            }
        }
        if end.is_some() {
            out.push(Bytes::from_static(DONE));
        }
        (out, end)
    }

    /// A choice's last chunks (what its parser held back, its finish reason); whether it was
    /// the last choice running (the usage chunk then follows where asked for).
    fn choice_done(
        &mut self,
        choice: u32,
        reason: FinishReason,
        usage: Usage,
        out: &mut Vec<Bytes>,
    ) -> bool {
        let mut called = false;
        if let Some(p) = self.parser(choice) {
            let rest = p.finish(reason == FinishReason::Length);
            called = p.called();
            if !rest.content.is_empty() {
                out.push(self.chunk(choice, Some(&rest.content), false, &[], None));
            }
            out.extend(rest.calls.iter().map(|c| self.call(choice, c)));
        }
        let text = (self.shape.kind == Kind::Completion).then_some("");
        out.push(self.chunk(
            choice,
            text,
            false,
            &[],
            Some(finish_reason(reason, called)),
        ));
        self.total = Usage {
            prompt: usage.prompt,
            completion: self.total.completion + usage.completion,
            cached: self.total.cached.max(usage.cached),
        };
        self.open = self.open.saturating_sub(1);
        if self.open > 0 {
            return false;
        }
        if self.shape.include_usage {
            let s = self.shape;
            out.push(sse(&json!({
                "id": self.id, "object": s.kind.object(true), "created": self.created, "model": s.model,
                "choices": [], "usage": crate::response::usage(&self.total),
            })));
        }
        true
    }

    fn parser(&mut self, choice: u32) -> Option<&mut ToolCallParser> {
        self.parsers
            .get_mut(choice as usize)
            .and_then(Option::as_mut)
    }

    fn chunk(
        &self,
        choice: u32,
        text: Option<&str>,
        role: bool,
        lps: &[TokenLogprob],
        finish: Option<&str>,
    ) -> Bytes {
        sse(&chunk(
            self.shape,
            &self.id,
            self.created,
            choice,
            text,
            role,
            lps,
            finish,
        ))
    }

    fn call(&self, choice: u32, c: &Call) -> Bytes {
        sse(&tool_call_chunk(
            self.shape,
            &self.id,
            self.created,
            choice,
            c,
        ))
    }
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
