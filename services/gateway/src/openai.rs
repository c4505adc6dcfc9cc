//! OpenAI's request and response shapes, and their translation to and from llmq's protocol.
//!
//! Requests are checked here for what the protocol cannot express (`n` > 1, content parts that
//! are not text) and for fields the gateway does not implement (`unsupported`: refused with a
//! 400 naming them, never dropped); everything else (ranges, unknown model, context length) is
//! intake's job, and its typed errors are mapped to OpenAI-style error bodies and HTTP statuses
//! by [`ApiError`].

use llmq_protocol::{ChatMessage, Constraint, GenerateRequest};

use crate::error::ApiError;
use crate::tool_request::{self, InTool, InToolCall, InToolChoice};
use serde::Deserialize;
use serde_json::{json, Value};

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// Accepted: OpenAI pads its chunks against length side channels; llmq's chunks carry no
    /// padding, which changes nothing a client reads.
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// A chat message's content: a string, or parts of which only text is supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct InMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's calls (sent back in the next turn).
    #[serde(default)]
    pub tool_calls: Vec<InToolCall>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// Fields both endpoints share.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: String,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Accepted and not used: they identify the caller to OpenAI (abuse monitoring, cache
    /// routing) and change nothing generated; llmq's prefix cache finds shared prefixes by
    /// their content.
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub n: Option<i64>,
    /// Extension (as in vLLM): keep generating past end-of-sequence, up to max_tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Extensions (as in vLLM): the sampler's other parameters, and token ids that stop.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    pub response_format: Option<ResponseFormat>,
}

/// `response_format`: plain text, any JSON object, or JSON valid against a schema. llmq holds
/// the output to the schema whether `strict` is set or not (it decodes under the constraint);
/// `strict: true` also closes the schema's objects, as OpenAI's strict mode reads them (without
/// it, intake's `schema_objects` setting decides).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: String,
    /// Absent: any JSON value.
    pub schema: Option<Value>,
    #[serde(default)]
    pub strict: Option<bool>,
    #[serde(default)]
    pub description: Option<String>,
}

impl ResponseFormat {
    /// The protocol's constraint for it (none for text).
    fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        Ok(match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(Constraint::JsonObject),
            ResponseFormat::JsonSchema { json_schema } => {
                if json_schema.name.is_empty() || json_schema.name.len() > 64 {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name must be 1 to 64 characters",
                    ));
                }
                let mut schema = json_schema.schema.clone().unwrap_or_else(|| json!({}));
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema must be a JSON Schema object",
                    ));
                }
                if json_schema.strict == Some(true) {
                    llmq_text::schema::close_objects(&mut schema);
                }
                Some(Constraint::JsonSchema {
                    schema: schema.to_string(),
                })
            }
        })
    }
}

/// Fields of OpenAI's API the gateway does not implement, accepted only with the value that
/// changes nothing (a client library may send its defaults): `null` for any of them, or
/// the neutral value given here.
fn neutral(field: &str, v: &Value) -> bool {
    match field {
        "frequency_penalty" | "presence_penalty" => v.as_f64() == Some(0.0),
        "logit_bias" | "metadata" => v.as_object().is_some_and(|m| m.is_empty()),
        "functions" => v.as_array().is_some_and(|a| a.is_empty()),
        "function_call" => v.as_str() == Some("none") || v.as_str() == Some("auto"),
        "store" => v.as_bool() == Some(false),
        "best_of" => v.as_i64() == Some(1),
        "suffix" => v.as_str() == Some(""),
        "modalities" => v
            .as_array()
            .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text"))),
        "service_tier" => v.as_str() == Some("auto") || v.as_str() == Some("default"),
        _ => false,
    }
}

/// The request's fields beyond those the gateway reads, refused unless neutral: OpenAI's API
/// answers an argument it does not know with a 400, and a field that changes what is generated
/// must never be dropped unnoticed.
pub fn unsupported(rest: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let mut bad: Vec<&str> = rest
        .iter()
        .filter(|(k, v)| !v.is_null() && !neutral(k, v))
        .map(|(k, _)| k.as_str())
        .collect();
    bad.sort_unstable();
    match bad.as_slice() {
        [] => Ok(()),
        fields => Err(ApiError::invalid(format!(
            "unsupported request {}: {} (llmq's gateway refuses what it does not implement rather than ignore it; see its README)",
            if fields.len() == 1 { "field" } else { "fields" },
            fields.iter().map(|f| format!("`{f}`")).collect::<Vec<_>>().join(", ")
        ))),
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: Common,
    pub messages: Vec<InMessage>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub tools: Vec<InTool>,
    pub tool_choice: Option<InToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    /// Every other field (see `unsupported`).
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// `prompt`: a string, or a list holding one string or one list of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: Common,
    pub prompt: Prompt,
    /// Legacy completions: the number of top alternatives to return with each token.
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    /// Every other field (see `unsupported`).
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// Which endpoint a request came through: decides the response shapes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    /// The endpoint's label in the metrics.
    pub fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
        }
    }

    /// The response id OpenAI's clients expect for a request.
    pub fn response_id(self, request_id: &str) -> String {
        match self {
            Kind::Chat => format!("chatcmpl-{request_id}"),
            Kind::Completion => format!("cmpl-{request_id}"),
        }
    }

    /// `object` of a whole response and of a stream's chunk.
    pub fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

/// What the response writer needs to know about the request.
#[derive(Debug, Clone)]
pub struct Shape {
    pub kind: Kind,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    /// Return logprobs, with this many alternatives per token.
    pub logprobs: Option<u32>,
    /// Choices (samples of the prompt).
    pub n: u32,
}

fn common_request(c: &Common) -> Result<GenerateRequest, ApiError> {
    let n = match c.n {
        None | Some(1) => None,
        Some(n) if (2..=llmq_protocol::MAX_CHOICES as i64).contains(&n) => Some(n),
        Some(n) => {
            return Err(ApiError::invalid(format!(
                "n must be between 1 and {}, got {n}",
                llmq_protocol::MAX_CHOICES
            )))
        }
    };
    let seed = match c.seed {
        Some(s) if s < 0 => return Err(ApiError::invalid(format!("seed must be >= 0, got {s}"))),
        s => s.map(|s| s as u64),
    };
    let stop = match &c.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    let constraint = match &c.response_format {
        Some(f) => f.constraint()?,
        None => None,
    };
    // An intake that does not know these fields must refuse the request, not ignore them.
    let requires = constraint
        .iter()
        .map(|_| "constraint")
        .chain(n.map(|_| "n"))
        .map(String::from)
        .collect();
    Ok(GenerateRequest {
        model: c.model.clone(),
        constraint,
        requires,
        n,
        max_tokens: c.max_completion_tokens.or(c.max_tokens),
        temperature: c.temperature,
        top_p: c.top_p,
        top_k: c.top_k,
        min_p: c.min_p,
        repetition_penalty: c.repetition_penalty,
        seed,
        stop,
        stop_token_ids: c.stop_token_ids.clone(),
        ignore_eos: c.ignore_eos,
        require_worker: true,
        ..Default::default()
    })
}

fn shape(kind: Kind, c: &Common, logprobs: Option<u32>) -> Shape {
    Shape {
        kind,
        model: c.model.clone(),
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        logprobs,
        n: c.n.unwrap_or(1).clamp(1, llmq_protocol::MAX_CHOICES as i64) as u32,
    }
}

fn top_count(n: Option<i64>) -> Result<u32, ApiError> {
    match n.unwrap_or(0) {
        n @ 0..=20 => Ok(n as u32),
        n => Err(ApiError::invalid(format!(
            "top_logprobs must be between 0 and 20, got {n}"
        ))),
    }
}

pub fn chat_request(r: ChatRequest) -> Result<(GenerateRequest, Shape), ApiError> {
    unsupported(&r.rest)?;
    let mut g = common_request(&r.common)?;
    let mut messages = Vec::with_capacity(r.messages.len());
    for m in r.messages {
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(format!(
                                "content parts of type {kind:?} are not supported"
                            )))
                        }
                    }
                }
                text
            }
        };
        let tool_calls = tool_request::message_calls(m.tool_calls)?;
        // OpenAI's newer name for the system turn; chat templates know only "system".
        let role = if m.role == "developer" {
            "system".to_string()
        } else {
            m.role
        };
        messages.push(ChatMessage {
            role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id,
            name: m.name,
        });
    }
    g.messages = Some(messages);
    tool_request::apply(&mut g, r.tools, r.tool_choice, r.parallel_tool_calls)?;
    let top = top_count(r.top_logprobs)?;
    if top > 0 && !r.logprobs {
        return Err(ApiError::invalid("top_logprobs needs logprobs: true"));
    }
    g.logprobs = r.logprobs;
    g.top_logprobs = top;
    let s = shape(Kind::Chat, &r.common, r.logprobs.then_some(top));
    Ok((g, s))
}

pub fn completion_request(r: CompletionRequest) -> Result<(GenerateRequest, Shape), ApiError> {
    unsupported(&r.rest)?;
    let mut g = common_request(&r.common)?;
    if r.echo {
        return Err(ApiError::invalid("echo is not supported"));
    }
    match r.prompt {
        Prompt::Text(t) => g.prompt = Some(t),
        Prompt::Texts(mut v) if v.len() == 1 => g.prompt = v.pop(),
        Prompt::Ids(ids) => g.prompt_ids = Some(ids),
        Prompt::IdLists(mut v) if v.len() == 1 => g.prompt_ids = v.pop(),
        _ => {
            return Err(ApiError::invalid(
                "prompt must be one string or one list of token ids (batches are not supported)",
            ))
        }
    }
    let top = match r.logprobs {
        None => None,
        Some(n) => Some(top_count(Some(n))?),
    };
    g.logprobs = top.is_some();
    g.top_logprobs = top.unwrap_or(0);
    let s = shape(Kind::Completion, &r.common, top);
    Ok((g, s))
}

#[cfg(test)]
mod tests;
