//! Raw [`GenerateRequest`] in, validated [`Job`] out: the one place where client input is checked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use llmq_config::SchemaObjects;
use llmq_protocol::{
    subjects, Constraint, ErrorClass, GenerateRequest, Job, Sampling, StopConditions, Tool,
    ToolChoice, ToolSyntax, WireError,
};
use llmq_text::constraint::Grammars;
use llmq_text::sampling;
use llmq_text::{load_tokenizer, resolve_model, Tokenizer};

pub struct ModelInfo {
    /// None for random-weight benchmark models, which take `prompt_ids` only.
    pub tokenizer: Option<Tokenizer>,
    pub context_tokens: usize,
    pub vocab_size: Option<usize>,
    /// Compiles constraints against the vocabulary (why not, for a model that cannot).
    pub grammars: Result<Grammars, String>,
}

impl ModelInfo {
    pub fn load(name: &str) -> Result<Self, llmq_text::Error> {
        if let Some(shape) = name.strip_prefix("random:") {
            let c = llmq_text::shapes::config(shape)?;
            let tokenizer = llmq_text::shapes::tokenizer(shape)?;
            let grammars = match &tokenizer {
                Some(t) => Grammars::new(t, c.vocab_size, &t.eos_ids).map_err(|e| e.to_string()),
                None => Err(format!(
                    "the random-weight shape {shape:?} has no tokenizer here"
                )),
            };
            return Ok(ModelInfo {
                tokenizer,
                context_tokens: c.max_position_embeddings,
                vocab_size: Some(c.vocab_size),
                grammars,
            });
        }
        let (tokenizer, context_tokens) = load_tokenizer(&resolve_model(name)?)?;
        let grammars = Grammars::new(&tokenizer, tokenizer.max_id_bound(), &tokenizer.eos_ids)
            .map_err(|e| e.to_string());
        Ok(ModelInfo {
            tokenizer: Some(tokenizer),
            context_tokens,
            vocab_size: None,
            grammars,
        })
    }
}

pub struct Validator {
    models: HashMap<String, ModelInfo>,
    /// Caps the tokens of a request that gives no `max_tokens` (None: the rest of the context).
    default_max_tokens: Option<u32>,
    schema_objects: SchemaObjects,
    counter: AtomicU64,
    salt: u64,
}

fn invalid(m: impl Into<String>) -> WireError {
    WireError::new(ErrorClass::InvalidRequest, m)
}

/// A text-side check's message, without the error's own "invalid request: " prefix.
fn text_invalid(e: llmq_text::Error) -> WireError {
    match e {
        llmq_text::Error::InvalidRequest(m) => invalid(m),
        other => invalid(other.to_string()),
    }
}

fn f32_param(name: &str, v: Option<f64>, default: f32) -> Result<f32, WireError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() => Ok(x as f32),
        Some(x) => Err(invalid(format!("{name} must be a finite number, got {x}"))),
    }
}

impl Validator {
    pub fn new(
        models: HashMap<String, ModelInfo>,
        default_max_tokens: Option<u32>,
        schema_objects: SchemaObjects,
    ) -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let salt = (t.as_nanos() as u64) ^ ((std::process::id() as u64) << 40);
        Validator {
            models,
            default_max_tokens,
            schema_objects,
            counter: AtomicU64::new(0),
            salt,
        }
    }

    /// The request with its schemas' objects closed where `intake.schema_objects` says so (a
    /// client asking for strict mode closes them itself).
    fn read_schemas(&self, mut r: GenerateRequest) -> GenerateRequest {
        if self.schema_objects == SchemaObjects::Open {
            return r;
        }
        let closed = |text: &str| -> Option<String> {
            let mut v: serde_json::Value = serde_json::from_str(text).ok()?;
            llmq_text::schema::close_objects(&mut v);
            Some(v.to_string())
        };
        // A schema that is not JSON is left as it came, for the checks below to refuse.
        if let Some(Constraint::JsonSchema { schema }) = &mut r.constraint {
            if let Some(c) = closed(schema) {
                *schema = c;
            }
        }
        for t in &mut r.tools {
            if let Some(c) = t.parameters.as_deref().and_then(closed) {
                t.parameters = Some(c);
            }
        }
        r
    }

    /// A new request id: unique per intake process and start, 16 hex digits.
    fn request_id(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let mut z = self
            .salt
            .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        format!("{:016x}", z ^ (z >> 31))
    }

    /// The job, and the syntax its output writes tool calls in when the request has tools.
    pub fn validate(&self, r: GenerateRequest) -> Result<(Job, Option<ToolSyntax>), WireError> {
        if let Some(f) = r
            .requires
            .iter()
            .find(|f| !llmq_protocol::REQUIRABLE.contains(&f.as_str()))
        {
            return Err(invalid(format!("this intake does not implement the request field {f:?}, which the request requires")));
        }
        let model = self.models.get(&r.model).ok_or_else(|| {
            let mut known: Vec<&String> = self.models.keys().collect();
            known.sort();
            WireError::new(
                ErrorClass::UnknownModel,
                format!("unknown model {:?} (served: {known:?})", r.model),
            )
        })?;
        let r = self.read_schemas(r);
        let asked = match r.max_tokens {
            Some(n) if n <= 0 => {
                return Err(invalid(format!("max_tokens must be at least 1, got {n}")))
            }
            asked => asked,
        };
        let sampling = sampling_of(&r)?;
        llmq_text::tools::check(&r.tools, r.tool_choice.as_ref()).map_err(text_invalid)?;
        let default_choice = if r.tools.is_empty() {
            ToolChoice::None
        } else {
            ToolChoice::Auto
        };
        let tool_choice = r.tool_choice.clone().unwrap_or(default_choice);
        // With `none` the tools are not shown: the model cannot call them.
        let tools = if tool_choice == ToolChoice::None {
            &[][..]
        } else {
            &r.tools[..]
        };
        let (prompt_ids, tool_syntax) = prompt_ids_of(model, &r, tools)?;
        // Without max_tokens, the answer may run to the end of the context (as OpenAI's), or
        // to the intake's cap when one is set.
        let max_tokens = asked.unwrap_or_else(|| {
            let rest = model.context_tokens.saturating_sub(prompt_ids.len()).max(1) as i64;
            self.default_max_tokens
                .map_or(rest, |cap| rest.min(cap as i64))
        });
        let mut stop = StopConditions {
            max_tokens: max_tokens.min(u32::MAX as i64) as u32,
            stop: r.stop.clone(),
            stop_token_ids: r.stop_token_ids.clone(),
            ignore_eos: r.ignore_eos,
            special_text: false,
        };
        sampling::validate_stop(&stop).map_err(text_invalid)?;
        let constraint = constraint_of(model, &r, tools, &tool_choice, tool_syntax, &mut stop)?;
        if prompt_ids.is_empty() {
            return Err(invalid("the prompt has no tokens"));
        }
        check_context(model, prompt_ids.len(), max_tokens)?;
        if let Some(c) = &constraint {
            check_constraint(model, c, r.ignore_eos)?;
        }
        let n = choices(r.n)?;
        let request_id = self.request_id();
        let stream_subject = match r.stream_subject {
            Some(s) if subjects::is_valid_stream_subject(&s) => s,
            Some(s) => {
                return Err(invalid(format!(
                    "stream_subject {s:?} is not a plain NATS subject"
                )))
            }
            None => subjects::stream(&request_id),
        };
        Ok((
            Job {
                request_id,
                model: r.model,
                prompt_ids,
                sampling,
                stop,
                stream_subject,
                accepted_at_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_millis() as u64,
                cache_salt: r.cache_salt,
                constraint,
                n,
            },
            tool_syntax,
        ))
    }
}

/// The request's constraint, or the grammar of its tool calls where `tool_choice` requires a
/// call; `stop.special_text` is set where the calls' markers are special tokens (they must
/// reach the output's text to be parsed).
fn constraint_of(
    model: &ModelInfo,
    r: &GenerateRequest,
    tools: &[Tool],
    tool_choice: &ToolChoice,
    syntax: Option<ToolSyntax>,
    stop: &mut StopConditions,
) -> Result<Option<Constraint>, WireError> {
    let (Some(syntax), Some(tok)) = (syntax, &model.tokenizer) else {
        return Ok(r.constraint.clone());
    };
    stop.special_text = llmq_text::tools::markers(syntax)
        .iter()
        .any(|m| tok.special_token_id(m).is_some());
    // A named function is called once (OpenAI's meaning of naming it); `required` makes one
    // call, or several where parallel calls are allowed (the default).
    let parallel = r.parallel_tool_calls.unwrap_or(true)
        && !matches!(tool_choice, ToolChoice::Function { .. });
    match llmq_text::tools::call_grammar(syntax, tools, tool_choice, parallel, |m| tok.special_token_id(m)) {
        Some(_) if r.constraint.is_some() => {
            Err(invalid("a constraint cannot go with tool_choice \"required\" or a named function, which constrain the output to the calls"))
        }
        Some(grammar) => Ok(Some(Constraint::Lark { grammar })),
        None => Ok(r.constraint.clone()),
    }
}

fn check_context(
    model: &ModelInfo,
    prompt_tokens: usize,
    max_tokens: i64,
) -> Result<(), WireError> {
    if prompt_tokens + max_tokens as usize <= model.context_tokens {
        return Ok(());
    }
    Err(WireError::new(
        ErrorClass::PromptTooLong,
        format!("{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the context of {} tokens", model.context_tokens),
    ))
}

/// A constraint compiled here, so that one the library rejects is refused with its reason.
fn check_constraint(model: &ModelInfo, c: &Constraint, ignore_eos: bool) -> Result<(), WireError> {
    if ignore_eos {
        return Err(invalid("ignore_eos cannot go with a constraint: a constrained output ends where its constraint is complete"));
    }
    let grammars = model
        .grammars
        .as_ref()
        .map_err(|why| invalid(format!("this model cannot take a constraint: {why}")))?;
    grammars.matcher(c).map_err(text_invalid)?;
    Ok(())
}

/// The number of samples asked for (`n`), checked.
fn choices(n: Option<i64>) -> Result<u32, WireError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=llmq_protocol::MAX_CHOICES as i64).contains(&n) => Ok(n as u32),
        Some(n) => Err(invalid(format!(
            "n must be between 1 and {}, got {n}",
            llmq_protocol::MAX_CHOICES
        ))),
    }
}

/// The request's sampling parameters, checked.
fn sampling_of(r: &GenerateRequest) -> Result<Sampling, WireError> {
    let sampling = Sampling {
        temperature: f32_param("temperature", r.temperature, 0.0)?,
        top_p: f32_param("top_p", r.top_p, 1.0)?,
        min_p: f32_param("min_p", r.min_p, 0.0)?,
        repetition_penalty: f32_param("repetition_penalty", r.repetition_penalty, 1.0)?,
        top_k: match r.top_k {
            None => 0,
            Some(k) if (0..=u32::MAX as i64).contains(&k) => k as u32,
            Some(k) => return Err(invalid(format!("top_k must be >= 0, got {k}"))),
        },
        seed: r.seed,
        logprobs: r.logprobs,
        top_logprobs: r.top_logprobs,
    };
    sampling::validate(&sampling).map_err(text_invalid)?;
    Ok(sampling)
}

/// The prompt's token ids from exactly one of `prompt` (encoded), `messages` (the model's chat
/// template, then encoded) and `prompt_ids` (checked against the vocabulary); with `tools`
/// (chats only), also the syntax the model will write its calls in.
fn prompt_ids_of(
    model: &ModelInfo,
    r: &GenerateRequest,
    tools: &[llmq_protocol::Tool],
) -> Result<(Vec<u32>, Option<ToolSyntax>), WireError> {
    let given = [
        r.prompt.is_some(),
        r.messages.is_some(),
        r.prompt_ids.is_some(),
    ]
    .iter()
    .filter(|&&b| b)
    .count();
    if given != 1 {
        return Err(invalid(
            "give exactly one of prompt, messages and prompt_ids",
        ));
    }
    if let Some(ids) = &r.prompt_ids {
        let vocab = model
            .vocab_size
            .or_else(|| model.tokenizer.as_ref().map(|t| t.max_id_bound()))
            .unwrap_or(usize::MAX);
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!(
                "prompt id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        if !tools.is_empty() {
            return Err(invalid(
                "tools go with a chat (messages), not with prompt_ids",
            ));
        }
        return Ok((ids.clone(), None));
    }
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or_else(|| invalid("this model has no tokenizer: give prompt_ids"))?;
    let mut syntax = None;
    let encoded = match (&r.prompt, &r.messages) {
        (Some(_), _) if !tools.is_empty() => {
            return Err(invalid(
                "tools go with a chat (messages), not with a plain prompt",
            ))
        }
        (Some(p), _) if p.is_empty() => return Err(invalid("empty prompt")),
        (Some(p), _) => tok.encode(p, true),
        (None, Some(msgs)) if msgs.is_empty() => return Err(invalid("empty messages")),
        (None, Some(msgs)) if !tools.is_empty() => {
            let (text, s) = tok
                .apply_chat_template_with_tools(msgs, tools)
                .map_err(text_invalid)?;
            syntax = Some(s);
            tok.encode(&text, false)
        }
        (None, Some(msgs)) => {
            let text = tok
                .apply_chat_template(msgs, true)
                .map_err(|e| invalid(e.to_string()))?;
            tok.encode(&text, false)
        }
        (None, None) => unreachable!("exactly one prompt form was checked above"),
    };
    encoded
        .map(|ids| (ids, syntax))
        .map_err(|e| invalid(e.to_string()))
}
