//! Tools in the prompt and the grammar of a required call.
//!
//! A chat template decides how a model sees its tools and writes its calls: `support` reads
//! which of the syntaxes llmq parses ([`ToolSyntax`]) a template uses. Templates that show no
//! tools (SmolLM2's, Gemma's) get llmq's own instructions in the system message, in the Hermes
//! syntax, and their tool turns as plain text; a template with tools in a syntax llmq does not
//! parse is refused rather than half served. Messages and tools reach a template as
//! transformers hands them over: `tools` as `[{"type": "function", "function": {..}}]`, an
//! assistant's `tool_calls` with their arguments as objects.
//!
//! With `tool_choice` `required` or a named function, `call_grammar` writes a Lark grammar
//! (llguidance) of the model's call syntax whose arguments are held to each function's JSON
//! schema, so that the calls always parse and validate.

use llmq_protocol::{ChatMessage, Tool, ToolCall, ToolChoice, ToolSyntax};
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// What a chat template does with tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The template renders `tools` and the calls in this syntax.
    Template(ToolSyntax),
    /// The template ignores tools: llmq instructs the model itself, in the Hermes syntax.
    Instructed,
}

/// The most tools one request may carry.
pub const MAX_TOOLS: usize = 128;

/// How `template` handles tools; an error for a template with tools in a syntax llmq does not
/// parse (its calls could not be returned as calls).
pub fn support(template: &str) -> Result<Support> {
    if template.contains("<tool_call>") {
        Ok(Support::Template(ToolSyntax::Hermes))
    } else if template.contains("[TOOL_CALLS]") {
        Ok(Support::Template(ToolSyntax::Mistral))
    } else if template.contains("\"parameters\"")
        && (template.contains("ipython") || template.contains("<|python_tag|>"))
    {
        Ok(Support::Template(ToolSyntax::Llama3Json))
    } else if template.contains("tools") {
        Err(Error::InvalidRequest(
            "this model's chat template writes tool calls in a syntax llmq does not parse".into(),
        ))
    } else {
        Ok(Support::Instructed)
    }
}

impl Support {
    pub fn syntax(self) -> ToolSyntax {
        match self {
            Support::Template(s) => s,
            Support::Instructed => ToolSyntax::Hermes,
        }
    }
}

/// The marker text that opens a call in `syntax`'s output, if it has one.
pub fn opening_marker(syntax: ToolSyntax) -> Option<&'static str> {
    match syntax {
        ToolSyntax::Hermes => Some("<tool_call>"),
        ToolSyntax::Mistral => Some("[TOOL_CALLS]"),
        ToolSyntax::Llama3Json => None,
    }
}

/// The markers of `syntax` (special tokens in some vocabularies).
pub fn markers(syntax: ToolSyntax) -> &'static [&'static str] {
    match syntax {
        ToolSyntax::Hermes => &["<tool_call>", "</tool_call>"],
        ToolSyntax::Mistral => &["[TOOL_CALLS]"],
        ToolSyntax::Llama3Json => &["<|python_tag|>"],
    }
}

/// Checks a request's tools: names, schemas, the choice naming one of them.
pub fn check(tools: &[Tool], choice: Option<&ToolChoice>) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidRequest(m));
    if tools.len() > MAX_TOOLS {
        return bad(format!("at most {MAX_TOOLS} tools, got {}", tools.len()));
    }
    for (i, t) in tools.iter().enumerate() {
        let name_ok = (1..=64).contains(&t.name.len())
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !name_ok {
            return bad(format!(
                "tools[{i}].name {:?} must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                t.name
            ));
        }
        if tools[..i].iter().any(|u| u.name == t.name) {
            return bad(format!("two tools are named {:?}", t.name));
        }
        if let Some(p) = &t.parameters {
            match serde_json::from_str::<Value>(p) {
                Ok(Value::Object(_)) => {}
                _ => {
                    return bad(format!(
                        "tools[{i}].parameters must be a JSON Schema object"
                    ))
                }
            }
        }
    }
    match choice {
        Some(ToolChoice::Required) if tools.is_empty() => {
            bad("tool_choice \"required\" needs tools".into())
        }
        Some(ToolChoice::Function { name }) if !tools.iter().any(|t| &t.name == name) => bad(
            format!("tool_choice names the function {name:?}, which is not among the tools"),
        ),
        _ => Ok(()),
    }
}

fn parameters(t: &Tool) -> Value {
    t.parameters
        .as_deref()
        .and_then(|p| serde_json::from_str(p).ok())
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
}

/// The tools as chat templates take them.
pub fn template_tools(tools: &[Tool]) -> Vec<Value> {
    tools
        .iter()
        .map(|t| {
            let mut f = json!({"name": t.name, "parameters": parameters(t)});
            if let Some(d) = &t.description {
                f["description"] = json!(d);
            }
            json!({"type": "function", "function": f})
        })
        .collect()
}

fn arguments_value(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| Value::String(call.arguments.clone()))
}

/// The messages as chat templates take them (an assistant's calls with their arguments as
/// objects, a tool result with its call's id).
pub fn template_messages(messages: &[ChatMessage]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let mut v = json!({"role": m.role, "content": m.content});
            if !m.tool_calls.is_empty() {
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_value(c)}}))
                    .collect();
                v["tool_calls"] = Value::Array(calls);
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = json!(id);
            }
            if let Some(n) = &m.name {
                v["name"] = json!(n);
            }
            v
        })
        .collect()
}

/// One call as the Hermes syntax writes it.
fn hermes_call(c: &ToolCall) -> String {
    format!(
        "<tool_call>\n{}\n</tool_call>",
        json!({"name": c.name, "arguments": arguments_value(c)})
    )
}

/// For a template that shows no tools: the tools described in the system message (its own
/// text kept after them), the assistant's calls written out in the Hermes syntax, and tool
/// results as the user's turn (consecutive results in one turn), which any template renders.
pub fn instructed_messages(messages: &[ChatMessage], tools: &[Tool]) -> Vec<ChatMessage> {
    let listing: Vec<String> = template_tools(tools)
        .iter()
        .map(|t| t["function"].to_string())
        .collect();
    let instructions = format!(
        "You may call functions to answer. Each function's name, description and parameters \
         (a JSON Schema) are listed between <tools> and </tools>:\n<tools>\n{}\n</tools>\n\n\
         To call a function, answer with a JSON object of its name and arguments between \
         <tool_call> and </tool_call>, one block per call:\n<tool_call>\n\
         {{\"name\": \"the function's name\", \"arguments\": {{\"an argument\": \"its value\"}}}}\n</tool_call>\n\
         Each result comes back between <tool_response> and </tool_response>.",
        listing.join("\n")
    );
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    match messages.first() {
        Some(m) if m.role == "system" => {
            out.push(ChatMessage::new(
                "system",
                &format!("{instructions}\n\n{}", m.content),
            ));
            rest = &messages[1..];
        }
        _ => out.push(ChatMessage::new("system", &instructions)),
    }
    for m in rest {
        if m.role == "tool" {
            let result = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                Some(last)
                    if last.role == "user" && last.content.starts_with("<tool_response>") =>
                {
                    last.content.push('\n');
                    last.content.push_str(&result);
                }
                _ => out.push(ChatMessage::new("user", &result)),
            }
        } else if !m.tool_calls.is_empty() {
            let mut text = m.content.clone();
            for c in &m.tool_calls {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&hermes_call(c));
            }
            out.push(ChatMessage::new(&m.role, &text));
        } else {
            out.push(ChatMessage::new(&m.role, &m.content));
        }
    }
    out
}

/// Rewrites every local `$ref` (`#`, `#/...`) in `schema` to point below the JSON pointer `at`.
fn rebase_refs(schema: &mut Value, at: &str) {
    match schema {
        Value::Object(m) => {
            for (k, v) in m.iter_mut() {
                match v {
                    Value::String(r) if k == "$ref" && (r == "#" || r.starts_with("#/")) => {
                        *r = format!("#{at}{}", &r[1..])
                    }
                    _ => rebase_refs(v, at),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, at)),
        _ => {}
    }
}

/// The Lark grammar that a `required` or named-function answer must match in `syntax`: one
/// call (or, with `parallel`, one or more where the syntax allows several) whose `name` is a
/// tool's and whose arguments match that tool's schema. None for `auto` and `none`.
/// `special`: the id of a marker that is a single special token of the vocabulary, which the
/// grammar then names as that token.
pub fn call_grammar(
    syntax: ToolSyntax,
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    special: impl Fn(&str) -> Option<u32>,
) -> Option<String> {
    let chosen: Vec<&Tool> = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function { name } => tools.iter().filter(|t| &t.name == name).collect(),
    };
    let args_key = if syntax == ToolSyntax::Llama3Json {
        "parameters"
    } else {
        "arguments"
    };
    // Each tool's parameters stand whole under the grammar's root `$defs`, named after the
    // tool, and the call refers to them there: their own local references (`#/$defs/..`, `#`),
    // which resolve against the document's root, are rebased onto that place.
    let mut defs = serde_json::Map::new();
    let variants: Vec<Value> = chosen
        .iter()
        .map(|t| {
            let mut params = parameters(t);
            rebase_refs(&mut params, &format!("/$defs/{}", t.name));
            defs.insert(t.name.clone(), params);
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: {"$ref": format!("#/$defs/{}", t.name)}},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    let with_defs = move |mut root: Value| {
        root["$defs"] = Value::Object(defs);
        crate::schema::with_layout(&mut root);
        root
    };
    let one_call = if variants.len() == 1 {
        variants[0].clone()
    } else {
        json!({"anyOf": variants})
    };
    // A marker as the vocabulary's special token, or as text.
    let marker = |m: &str| {
        special(m)
            .map(|id| format!("<[{id}]>"))
            .unwrap_or_else(|| json!(m).to_string())
    };
    Some(match syntax {
        ToolSyntax::Hermes => {
            let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
            format!(
                "start: call{repeat}\ncall: {} \"\\n\" %json {} \"\\n\" {}\n",
                marker("<tool_call>"),
                with_defs(one_call),
                marker("</tool_call>")
            )
        }
        ToolSyntax::Mistral => {
            let mut list = json!({"type": "array", "items": one_call, "minItems": 1});
            if !parallel {
                list["maxItems"] = json!(1);
            }
            format!(
                "start: {} %json {}\n",
                marker("[TOOL_CALLS]"),
                with_defs(list)
            )
        }
        // Llama 3.1's template takes one call per turn.
        ToolSyntax::Llama3Json => format!("start: %json {}\n", with_defs(one_call)),
    })
}
