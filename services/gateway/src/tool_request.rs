//! Tools in OpenAI's chat request (`tools`, `tool_choice`, `parallel_tool_calls`, an assistant
//! message's `tool_calls`) and their translation to the protocol's [`Tool`], [`ToolChoice`] and
//! [`ToolCall`]. Which syntax the model writes its calls in, and their checks against the
//! request's tools, are intake's ([`llmq_text::tools`]).

use llmq_protocol::{GenerateRequest, Tool, ToolCall, ToolChoice};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

#[derive(Debug, Deserialize)]
pub struct InToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: InFunctionCall,
}

#[derive(Debug, Deserialize)]
pub struct InFunctionCall {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

fn function_kind() -> String {
    "function".into()
}

/// A tool of the request: only functions exist.
#[derive(Debug, Deserialize)]
pub struct InTool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: InFunction,
}

#[derive(Debug, Deserialize)]
pub struct InFunction {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    /// llmq holds a required call's arguments to the schema whether `strict` is set or not;
    /// `strict: true` also closes its objects (see `ResponseFormat`).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `tool_choice`: "none", "auto", "required", or `{"type": "function", "function": {"name": ..}}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum InToolChoice {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Debug, Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

/// An assistant message's calls in the protocol.
pub fn message_calls(calls: Vec<InToolCall>) -> Result<Vec<ToolCall>, ApiError> {
    calls
        .into_iter()
        .map(|c| match c.kind.as_str() {
            "function" => Ok(ToolCall {
                id: c.id,
                name: c.function.name,
                arguments: c.function.arguments,
            }),
            other => Err(ApiError::invalid(format!(
                "tool calls of type {other:?} are not supported"
            ))),
        })
        .collect()
}

/// The request's tools, `tool_choice` and `parallel_tool_calls` in the protocol, which the
/// request then requires (an intake that does not know them refuses it).
pub fn apply(
    g: &mut GenerateRequest,
    tools: Vec<InTool>,
    choice: Option<InToolChoice>,
    parallel: Option<bool>,
) -> Result<(), ApiError> {
    for t in tools {
        if t.kind != "function" {
            return Err(ApiError::invalid(format!(
                "tools of type {:?} are not supported (only \"function\")",
                t.kind
            )));
        }
        let parameters = match t.function.parameters {
            None => None,
            Some(mut p @ Value::Object(_)) => {
                if t.function.strict == Some(true) {
                    llmq_text::schema::close_objects(&mut p);
                }
                Some(p.to_string())
            }
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tool {:?}: parameters must be a JSON Schema object",
                    t.function.name
                )))
            }
        };
        g.tools.push(Tool {
            name: t.function.name,
            description: t.function.description,
            parameters,
        });
    }
    g.tool_choice = match choice {
        None => None,
        Some(InToolChoice::Mode(m)) => Some(match m.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(format!(
                    "tool_choice {other:?} is not one of none, auto, required or a function"
                )))
            }
        }),
        Some(InToolChoice::Named { function }) => Some(ToolChoice::Function {
            name: function.name,
        }),
    };
    g.parallel_tool_calls = parallel;
    if g.tools.is_empty() {
        // What a client library sends by default without tools changes nothing.
        if matches!(g.tool_choice, Some(ToolChoice::None | ToolChoice::Auto)) {
            g.tool_choice = None;
        }
        g.parallel_tool_calls = None;
    }
    let named = [
        (!g.tools.is_empty(), "tools"),
        (g.tool_choice.is_some(), "tool_choice"),
        (g.parallel_tool_calls.is_some(), "parallel_tool_calls"),
    ];
    g.requires.extend(
        named
            .iter()
            .filter(|(set, _)| *set)
            .map(|(_, f)| f.to_string()),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{chat_request, Shape};
    use serde_json::json;

    fn chat(v: Value) -> Result<(GenerateRequest, Shape), ApiError> {
        chat_request(serde_json::from_value(v).unwrap())
    }

    /// Tools, the choice and the turns of a conversation with calls reach the protocol, and
    /// the request requires them.
    #[test]
    fn tools_and_tool_turns_map_to_the_protocol() {
        let (g, _) = chat(json!({
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "abc123def", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "abc123def", "content": "sunny"},
            ],
            "tools": [{"type": "function", "function": {"name": "weather", "description": "d", "parameters": {"type": "object"}, "strict": true}}],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            "parallel_tool_calls": false,
        }))
        .unwrap();
        // `strict` closes the parameters' objects.
        let closed = "{\"type\":\"object\",\"additionalProperties\":false}";
        assert_eq!(
            g.tools,
            vec![Tool {
                name: "weather".into(),
                description: Some("d".into()),
                parameters: Some(closed.into())
            }]
        );
        assert_eq!(
            g.tool_choice,
            Some(ToolChoice::Function {
                name: "weather".into()
            })
        );
        assert_eq!(g.parallel_tool_calls, Some(false));
        assert_eq!(
            g.requires,
            vec!["tools", "tool_choice", "parallel_tool_calls"]
        );
        let m = g.messages.unwrap();
        assert_eq!(
            m[1].tool_calls,
            vec![ToolCall {
                id: "abc123def".into(),
                name: "weather".into(),
                arguments: "{\"city\": \"Paris\"}".into()
            }]
        );
        assert_eq!(
            (
                m[2].role.as_str(),
                m[2].tool_call_id.as_deref(),
                m[2].content.as_str()
            ),
            ("tool", Some("abc123def"), "sunny")
        );
        let with = |extra: Value| {
            let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            chat(v).map(|(g, _)| g)
        };
        assert!(with(json!({"tool_choice": "sometimes"})).is_err());
        assert!(
            with(json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})).is_err()
        );
        assert!(with(
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]})
        )
        .is_err());
        // A client's defaults without tools change nothing and require nothing.
        let g =
            with(json!({"tools": [], "tool_choice": "auto", "parallel_tool_calls": true})).unwrap();
        assert!(
            g.tools.is_empty()
                && g.tool_choice.is_none()
                && g.parallel_tool_calls.is_none()
                && g.requires.is_empty(),
            "{g:?}"
        );
        // A required call needs tools: intake refuses it.
        assert_eq!(
            with(json!({"tool_choice": "required"})).unwrap().requires,
            vec!["tool_choice"]
        );
    }
}
