//! The messages of protocol v1. Field ownership: clients write [`GenerateRequest`] and [`Cancel`];
//! intake writes [`GenerateReply`] and [`Job`]; workers write [`StreamEvent`] and [`WorkerStatus`].

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One chat message (OpenAI / Hugging Face roles: system, user, assistant, tool).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct ChatMessage {
    /// `system` (or `developer`), `user`, `assistant` or `tool`.
    pub role: String,
    /// The message's text (text parts joined; empty for an assistant turn of calls only).
    #[serde(default)]
    pub content: String,
    /// An assistant's calls of the request's tools (added after v1's first fields).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the id of the call whose result `content` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with `content` and nothing else.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

/// A function the model may call: rendered into the prompt through the model's chat template.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct Tool {
    /// 1 to 64 of `a-z A-Z 0-9 _ -`.
    pub name: String,
    /// What the function does, shown to the model.
    #[serde(default)]
    pub description: Option<String>,
    /// The arguments' JSON Schema, as JSON text (an object schema; absent: no arguments).
    #[serde(default)]
    pub parameters: Option<String>,
}

/// One call of a tool, as the model made it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct ToolCall {
    /// The call's id (9 letters and digits), which the `tool` turn answering it names.
    pub id: String,
    /// The function called.
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// Whether and which tools the model may call (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoice {
    /// No call: the tools are not shown to the model.
    None,
    /// The model answers in text or calls tools, as it sees fit (the default with tools).
    Auto,
    /// At least one call, the arguments constrained to the tools' schemas.
    Required,
    /// A call of this function, the arguments constrained to its schema.
    Function {
        /// The function's name, one of the request's tools.
        name: String,
    },
}

/// How the model writes its tool calls in its output text (decided by its chat template):
/// intake names it in `Accepted` so that a client can parse the calls out of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolSyntax {
    /// `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`, one block per call
    /// (Qwen 2.5 and 3, Hermes, and llmq's own prompt for templates without tools).
    Hermes,
    /// The whole output is `{"name": .., "parameters": {..}}`, after an optional
    /// `<|python_tag|>` (Llama 3.1 to 3.3).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]` (Mistral).
    Mistral,
}

/// A client's job as submitted on `llm.v1.generate`. Unchecked: intake validates it into a [`Job`].
/// Numbers are wide and signed here so that out-of-range values can be reported, not wrapped.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct GenerateRequest {
    /// A model a worker serves (as `intake.models` names it).
    pub model: String,
    /// A plain prompt; exactly one of `prompt` and `messages` is given.
    pub prompt: Option<String>,
    /// A chat, rendered with the model's chat template (the assistant's turn opened).
    pub messages: Option<Vec<ChatMessage>>,
    /// An already tokenized prompt (instead of `prompt` or `messages`).
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate (default: the rest of the context, or `intake.default_max_tokens`
    /// where that is set and smaller).
    pub max_tokens: Option<i64>,
    /// Sampling temperature, at least 0 (0, the default: greedy).
    pub temperature: Option<f64>,
    /// Nucleus sampling: the smallest set of tokens whose probabilities reach this (0 to 1; 1:
    /// off).
    pub top_p: Option<f64>,
    /// Only the `top_k` likeliest tokens (0: off).
    pub top_k: Option<i64>,
    /// Tokens less likely than this times the likeliest one are cut (0 to 1; 0: off).
    pub min_p: Option<f64>,
    /// Above 1 discourages tokens already in the prompt or the output (1: off).
    pub repetition_penalty: Option<f64>,
    /// Seed of the sampler: the same request and seed give the same output.
    pub seed: Option<u64>,
    /// Strings that end the output (not included in it).
    pub stop: Vec<String>,
    /// Token ids that end the output, besides the model's end-of-sequence tokens.
    pub stop_token_ids: Vec<u32>,
    /// Go on past end-of-sequence tokens until `max_tokens` (not with a `constraint`).
    pub ignore_eos: bool,
    /// Report each output token's log-probability.
    pub logprobs: bool,
    /// Alternatives reported with each token's log-probability (0 to 20).
    pub top_logprobs: u32,
    /// Where to publish this job's events: the client's own inbox, subscribed before submitting,
    /// so that no event is missed. Default: `llm.v1.stream.<request_id>`.
    pub stream_subject: Option<String>,
    /// Prefixes are only reused between requests with the same salt.
    pub cache_salt: Option<String>,
    /// Reject with `no_worker` instead of queueing when no worker of the model has been heard
    /// from for `intake.no_worker_grace_ms` (the HTTP gateway sets it: its clients want an
    /// answer, not a durable queue; workers that are restarting still count).
    pub require_worker: bool,
    /// The fields of this request, by name, that change what is generated and that the client
    /// needs honoured. A field intake does not know is ignored, as MessagePack maps allow (a
    /// newer client's field reaching an older intake), unless it is named here: then intake
    /// refuses the request (`invalid_request`, naming it) rather than generate something else.
    /// A client sets a field added to the protocol after v1's first fields ([`REQUIRABLE`] lists
    /// them) and names it here.
    pub requires: Vec<String>,
    /// Holds the output to a JSON schema, any JSON object, a regular expression or a Lark
    /// grammar (constrained decoding); added after v1's first fields: name "constraint" in
    /// `requires`.
    pub constraint: Option<Constraint>,
    /// Samples of the same prompt (OpenAI's `n`; default 1): the prompt is prefilled once and
    /// its KV shared, each sample decodes on its own. Events carry their sample's `choice`.
    /// Added after v1's first fields: name "n" in `requires`.
    pub n: Option<i64>,
    /// Functions the model may call (chat requests only): rendered through the model's chat
    /// template; the calls come back as text in the syntax `Accepted.tool_syntax` names.
    /// Added after v1's first fields: name "tools" in `requires`.
    pub tools: Vec<Tool>,
    /// Default: `auto` with tools. Added after v1's first fields: name "tool_choice".
    pub tool_choice: Option<ToolChoice>,
    /// Whether one answer may hold several calls (default true, where the syntax allows it).
    pub parallel_tool_calls: Option<bool>,
}

/// The most samples one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// What a constrained request's output must match, from its first token to its end: the
/// sequence ends (end of sequence) only where the output is complete, and every token chosen
/// keeps it a prefix of some valid output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON document valid against a schema.
    JsonSchema {
        /// The JSON Schema, as JSON text.
        schema: String,
    },
    /// Text matching a regular expression as a whole.
    Regex {
        /// Rust regex syntax, no lookaround.
        pattern: String,
    },
    /// Text of a context-free grammar.
    Lark {
        /// In llguidance's Lark syntax, start rule `start`.
        grammar: String,
    },
}

/// The fields a request may name in `requires` and every intake of this version honours: the
/// output-changing fields of v1. Fields added later join this list in the version that adds
/// them.
pub const REQUIRABLE: &[&str] = &[
    "prompt",
    "messages",
    "prompt_ids",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "constraint",
    "n",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// Intake's immediate answer on the request's reply subject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GenerateReply {
    /// The job is in the jobs stream; its events will come on `stream_subject`.
    Accepted {
        /// The id intake gave the request: what cancels and events name.
        request_id: String,
        /// Where the events go (the request's own, or the default).
        stream_subject: String,
        /// How the output writes tool calls, for a request with tools (absent otherwise).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_syntax: Option<ToolSyntax>,
        /// The job's sequence in the jobs stream, to ask `subjects::JOB_STATE` about (absent
        /// from an intake that does not answer that).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job_seq: Option<u64>,
    },
    /// Refused; nothing was queued and no event will come.
    Rejected {
        /// Why.
        error: WireError,
    },
}

/// Asks intake whether an accepted job is still in the jobs stream (`subjects::JOB_STATE`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobQuery {
    /// The accepted request's id.
    pub request_id: String,
    /// `Accepted.job_seq`.
    pub job_seq: u64,
}

/// Intake's answer to a [`JobQuery`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// In the jobs stream: waiting for a worker, or held by one that has not finished it.
    Pending,
    /// Not there: finished (its terminal event was published) or lost.
    Gone,
}

/// An error as it crosses the wire: classified once, near its cause.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WireError {
    /// What kind of error, for a client to act on.
    pub class: ErrorClass,
    /// What went wrong, for a person.
    pub message: String,
}

impl WireError {
    /// An error of `class` saying `message`.
    pub fn new(class: ErrorClass, message: impl Into<String>) -> Self {
        WireError {
            class,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.class, self.message)
    }
}

/// The kinds of error a client may act on; each ends a request (or refuses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// Undecodable payload or a parameter out of range.
    InvalidRequest,
    /// No intake or worker serves the model named.
    UnknownModel,
    /// The prompt (plus max_tokens) exceeds the model's context.
    PromptTooLong,
    /// Admission queue full: try again later.
    QueueFull,
    /// No worker serves the model.
    NoWorker,
    /// The request can never fit the worker's KV memory budget.
    NeverFits,
    /// Cancelled on `llm.v1.cancel`.
    Cancelled,
    /// The worker running the request stopped before finishing it.
    WorkerLost,
    /// A constrained request's output could not be continued within its constraint (no token
    /// of the vocabulary keeps it valid); what was streamed is a valid prefix.
    ConstraintFailed,
    /// Anything else: a fault inside llmq (the request ends; others go on).
    Internal,
}

/// Sampling parameters of a validated job: checked once, where they enter the system (intake,
/// or the CLI's in-process generation), by `llmq_text::sampling::validate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Sampling {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: u32,
    /// 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub min_p: f32,
    /// 1 means off; > 1 discourages tokens already in the prompt or the output.
    pub repetition_penalty: f32,
    /// Seed of the sampler (none: a random one).
    pub seed: Option<u64>,
    /// Report each token's log-probability.
    pub logprobs: bool,
    /// How many alternatives to report with each token's logprob.
    pub top_logprobs: u32,
}

impl Default for Sampling {
    /// Greedy, nothing cut, no logprobs.
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl Sampling {
    /// True when the next token is simply the argmax of the raw logits, which a device can
    /// compute without sending the logits to the host.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0 && !self.wants_logprobs()
    }

    /// Whether any log-probabilities are reported.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }
}

/// When a job's generation ends (besides a cancel), validated like [`Sampling`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StopConditions {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Strings that end the output.
    pub stop: Vec<String>,
    /// Token ids that end the output, besides end-of-sequence.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Keep special tokens' text in the output (tool-call markers that are special tokens).
    #[serde(default)]
    pub special_text: bool,
}

impl Default for StopConditions {
    fn default() -> Self {
        StopConditions {
            max_tokens: 256,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
            special_text: false,
        }
    }
}

/// A validated, tokenized job: what intake puts on the jobs stream for a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Job {
    /// The request's id, as [`GenerateReply::Accepted`] named it.
    pub request_id: String,
    /// The model it runs on.
    pub model: String,
    /// The prompt, tokenized (chat template applied).
    pub prompt_ids: Vec<u32>,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// When the output ends.
    pub stop: StopConditions,
    /// Where its events go.
    pub stream_subject: String,
    /// Milliseconds since the Unix epoch when intake accepted the job.
    pub accepted_at_ms: u64,
    /// Prefixes are reused only between jobs of the same salt.
    pub cache_salt: Option<String>,
    /// Checked by intake: it compiles against the model's vocabulary.
    #[serde(default)]
    pub constraint: Option<Constraint>,
    /// Samples of the prompt, 1 to `MAX_CHOICES`.
    #[serde(default = "one")]
    pub n: u32,
}

fn one() -> u32 {
    1
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// `seq` of an event published by a worker other than the one that streamed the request so far
/// (the `worker_lost` error that ends a request whose worker died).
pub const SEQ_FROM_ANOTHER_WORKER: u64 = u64::MAX;

/// One event of a request's stream. `seq` starts at 0 and grows by one per event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StreamEvent {
    /// The request the event is about.
    pub request_id: String,
    /// The event's place in the request's stream (0, 1, 2, ...; a gap means events were lost).
    pub seq: u64,
    /// What happened.
    pub event: Event,
    /// Which sample of the request the event is about (0 to n - 1; absent for 0). With n > 1
    /// every sample ends with its own terminal event; `seq` counts the request's events.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub choice: u32,
}

/// What a stream carries: progress, tokens, and one terminal event per sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// Waiting for admission; `position` 0 is next.
    Queued {
        /// Requests ahead of this one in the worker's queue.
        position: u32,
    },
    /// Prompt tokens prefilled so far (monotonic; the last one has done == total).
    PrefillProgress {
        /// Prompt tokens prefilled.
        done: u32,
        /// Prompt tokens in all.
        total: u32,
    },
    /// The tokens of one tick, with the text they complete.
    Tokens {
        /// The tokens' ids.
        ids: Vec<u32>,
        /// The text they complete (may be empty while a character's bytes are incomplete).
        text: String,
        /// Each token's log-probability and alternatives, when asked for.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        logprobs: Vec<TokenLogprob>,
    },
    /// The sample ended normally.
    Done {
        /// Why it ended.
        finish_reason: FinishReason,
        /// Tokens counted.
        usage: Usage,
        /// Where its time went.
        timings: Timings,
    },
    /// The sample (or the request) ended with an error.
    Error {
        /// Which error.
        error: WireError,
    },
}

impl Event {
    /// `Done` and `Error` end a stream; exactly one of them is sent per accepted job.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Event::Done { .. } | Event::Error { .. })
    }
}

/// A token's log-probability, and the likeliest alternatives at its position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenLogprob {
    /// The token chosen.
    pub token: u32,
    /// Its log-probability under the model (before sampling's cuts).
    pub logprob: f32,
    /// The likeliest tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
    /// The token's text and the top alternatives' texts, as the model's tokenizer decodes each
    /// alone (empty without a tokenizer).
    #[serde(default)]
    pub text: String,
    /// The alternatives' texts, in `top`'s order.
    #[serde(default)]
    pub top_text: Vec<String>,
}

/// Why a sample ended normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End of sequence, a stop token or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
}

/// Tokens of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: u32,
    /// Tokens generated.
    pub completion: u32,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached: u32,
}

/// Where a request's time went, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
pub struct Timings {
    /// From acceptance to the start of its prefill.
    pub queue_ms: f64,
    /// From acceptance to its first token.
    pub ttft_ms: f64,
    /// From acceptance to its end.
    pub total_ms: f64,
}

/// Broadcast on `llm.v1.cancel`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Cancel {
    /// The request to cancel.
    pub request_id: String,
}

/// Published on `llm.v1.cache.clear`: every worker (of `model`, or all) drops its cached
/// prefixes and, when the message has a reply subject, answers with [`CacheCleared`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ClearCache {
    /// The model whose workers clear their caches (none: every model).
    pub model: Option<String>,
}

/// A worker's answer to [`ClearCache`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CacheCleared {
    /// Who answers.
    pub worker_id: String,
    /// Bytes its prefix cache freed.
    pub freed_bytes: u64,
}

/// What a worker does: `Both` takes jobs and prefills and decodes them; `Decode` takes jobs
/// and has their prompts prefilled by a live `Prefill` worker (itself when none is live);
/// `Prefill` takes no jobs, and computes prompt chunks for decode workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Takes jobs, prefills and decodes them.
    #[default]
    Both,
    /// Takes no jobs; computes prompt chunks for decode workers.
    Prefill,
    /// Takes jobs and has their prompts prefilled by a prefill worker.
    Decode,
}

impl WorkerRole {
    /// Whether the worker pulls jobs (and so serves its model to intake and the gateway).
    pub fn takes_jobs(self) -> bool {
        self != WorkerRole::Prefill
    }
}

impl std::str::FromStr for WorkerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(WorkerRole::Both),
            "prefill" => Ok(WorkerRole::Prefill),
            "decode" => Ok(WorkerRole::Decode),
            other => Err(format!(
                "unknown worker role {other:?} (both, prefill, decode)"
            )),
        }
    }
}

/// A worker's heartbeat on `llm.v1.worker.<id>.status`; intake routes by it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct WorkerStatus {
    /// The worker's id (unique while it lives).
    pub worker_id: String,
    /// The model it serves.
    pub model: String,
    /// What the worker does (an older worker's heartbeat has none: `Both`).
    pub role: WorkerRole,
    /// Prompt KV bytes sent to decode workers (a prefill worker) or received from prefill
    /// workers (a decode worker), since start.
    pub kv_bytes_sent: u64,
    /// Prompt KV bytes received from prefill workers, since start (a decode worker).
    pub kv_bytes_received: u64,
    /// Of `kv_bytes_sent`, those sent on direct connections (`worker.kv_listen`), not NATS.
    pub kv_bytes_sent_direct: u64,
    /// A decode worker's time from each chunk's KV leaving its prefill worker to its last piece
    /// arriving here, summed since start.
    pub kv_transfer_ms: f64,
    /// Longest prompt + output the model accepts.
    pub context_tokens: u32,
    /// Sequences decoding now.
    pub active_streams: u32,
    /// Requests held and not yet decoding (waiting for admission or prefilling).
    pub queued_requests: u32,
    /// Requests this worker has ended (Done or Error), since start.
    pub ended_requests: u64,
    /// Prompt tokens still to prefill.
    pub queued_prefill_tokens: u64,
    /// KV bytes held (running requests and the prefix cache).
    pub kv_bytes_used: u64,
    /// KV budget in blocks no running request holds.
    pub kv_bytes_free: u64,
    /// Blocks of the KV pool, and those running requests hold now.
    pub kv_blocks_total: u64,
    /// Blocks running requests hold now.
    pub kv_blocks_used: u64,
    /// Requests preempted (their KV freed, to be prefilled again) because the KV pool ran out,
    /// since start.
    pub preemptions: u64,
    /// KV bytes one token of a sequence takes (every layer's keys and values).
    pub kv_bytes_per_token: u64,
    /// Most sequences the worker runs at once (`scheduler.max_batch`).
    pub max_batch: u32,
    /// Prompt tokens reused from the prefix cache over prompt tokens looked up, since start.
    pub prefix_hit_rate: f64,
    /// Bytes and entries the prefix cache holds now (counted in `kv_bytes_used`), prompt
    /// tokens it has served, and entries it has evicted, since start.
    pub prefix_bytes: u64,
    /// Entries the prefix cache holds.
    pub prefix_entries: u64,
    /// Prompt tokens served from the prefix cache, since start.
    pub prefix_reused_tokens: u64,
    /// Prefix-cache entries evicted, since start.
    pub prefix_evictions: u64,
    /// When the heartbeat was sent (milliseconds since the Unix epoch).
    pub sent_at_ms: u64,
    /// Ticks since start, and their time: `tick_wall_ms` from each tick's start to the next
    /// one's (or to going idle), `engine_ms` inside the engine (prefill and decode calls, and
    /// the KV bookkeeping of admissions, releases and prefix trims). The difference is the
    /// control overhead (scheduling, actor messages, NATS publishing).
    pub ticks: u64,
    /// Milliseconds from each tick's start to the next one's, summed.
    pub tick_wall_ms: f64,
    /// Milliseconds inside the engine's calls, summed.
    pub engine_ms: f64,
    /// The engine's prefill-chunk and decode-step calls since start, and their time.
    pub prefill_calls: u64,
    /// Their milliseconds.
    pub prefill_ms: f64,
    /// Decode-step calls since start.
    pub decode_calls: u64,
    /// Their milliseconds.
    pub decode_ms: f64,
    /// Steps with constrained rows and those rows, since start; the host's wall time computing
    /// their token masks (mostly on threads beside the device's), how long the device's thread
    /// waited for masks computed beside it, and the time it then still waited for the steps'
    /// tokens (masks are hidden behind the device's work while this stays above zero).
    pub constrained_steps: u64,
    /// Rows of those steps under a constraint.
    pub constrained_rows: u64,
    /// Host wall time computing their masks.
    pub mask_ms: f64,
    /// Time the device's thread waited for masks computed beside it.
    pub mask_blocked_ms: f64,
    /// Time the device's thread then still waited for the steps' tokens.
    pub mask_wait_ms: f64,
}
