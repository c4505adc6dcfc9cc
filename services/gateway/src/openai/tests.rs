//! The request shapes' translation to the protocol and the errors' statuses.

use super::*;
use actix_web::http::StatusCode;
use llmq_protocol::{ErrorClass, WireError};

fn chat(v: Value) -> Result<(GenerateRequest, Shape), ApiError> {
    chat_request(serde_json::from_value(v).unwrap())
}

#[test]
fn chat_fields_map_to_the_protocol() {
    let (g, s) = chat(json!({
        "model": "smollm2", "messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
        "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
        "stop": "x", "stream": true, "stream_options": {"include_usage": true},
        "logprobs": true, "top_logprobs": 2, "user": "u1", "n": 1,
    }))
    .unwrap();
    assert_eq!(g.max_tokens, Some(7), "max_completion_tokens wins");
    assert_eq!(
        (g.temperature, g.top_p, g.seed),
        (Some(0.5), Some(0.9), Some(3))
    );
    assert_eq!(g.stop, vec!["x".to_string()]);
    assert_eq!(g.messages.as_ref().unwrap()[1].content, "Hi!");
    assert!(g.logprobs && g.top_logprobs == 2 && g.require_worker);
    assert!(s.stream && s.include_usage && s.logprobs == Some(2));
}

#[test]
fn unsupported_requests_are_invalid() {
    let base = |extra: Value| {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        chat(v).unwrap_err().status
    };
    assert_eq!(base(json!({"n": 17})), StatusCode::BAD_REQUEST);
    assert_eq!(base(json!({"n": 0})), StatusCode::BAD_REQUEST);
    assert_eq!(
        base(json!({"top_logprobs": 30, "logprobs": true})),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(base(json!({"seed": -1})), StatusCode::BAD_REQUEST);
    let img =
        json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]});
    assert_eq!(chat(img).unwrap_err().status, StatusCode::BAD_REQUEST);
    let batch: CompletionRequest =
        serde_json::from_value(json!({"model": "m", "prompt": ["a", "b"]})).unwrap();
    assert_eq!(
        completion_request(batch).unwrap_err().status,
        StatusCode::BAD_REQUEST
    );
}

/// Fields the gateway does not implement are refused naming them, unless neutral (a
/// client's defaults); the vLLM-style sampler extensions reach the protocol.
#[test]
fn unimplemented_fields_are_refused_by_name_never_dropped() {
    let with = |extra: Value| {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        chat(v)
    };
    for field in [
        json!({"functions": [{"name": "f"}]}),
        json!({"frequency_penalty": 0.5}),
        json!({"logit_bias": {"1": 5}}),
        json!({"function_call": {"name": "f"}}),
        json!({"reasoning_effort": "low"}),
        json!({"made_up": 1}),
    ] {
        let name = field.as_object().unwrap().keys().next().unwrap().clone();
        let e = with(field).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains(&format!("`{name}`")), "{}", e.message);
    }
    let e = with(json!({"functions": [{}], "presence_penalty": 1})).unwrap_err();
    assert!(
        e.message.contains("`functions`, `presence_penalty`"),
        "{}",
        e.message
    );
    // What a client library sends by default changes nothing and is accepted.
    let (g, _) = with(json!({
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
        "parallel_tool_calls": true, "response_format": {"type": "text"}, "metadata": null, "store": false,
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [7],
    }))
    .unwrap();
    assert_eq!(
        (
            g.top_k,
            g.min_p,
            g.repetition_penalty,
            g.stop_token_ids.clone()
        ),
        (Some(5), Some(0.1), Some(1.1), vec![7])
    );
    let legacy: CompletionRequest =
        serde_json::from_value(json!({"model": "m", "prompt": "a", "suffix": "b"})).unwrap();
    assert!(completion_request(legacy)
        .unwrap_err()
        .message
        .contains("`suffix`"));
    let legacy: CompletionRequest =
        serde_json::from_value(json!({"model": "m", "prompt": "a", "best_of": 1})).unwrap();
    assert!(completion_request(legacy).is_ok());
}

/// `response_format` becomes the protocol's constraint, which the request then requires
/// (an intake that does not know it refuses the request); `strict: true` closes the schema's
/// objects, and without it the schema goes as it came (intake's setting reads it).
#[test]
fn response_formats_become_required_constraints() {
    let with = |format: Value| {
        chat(
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": format}),
        )
    };
    let (g, _) = with(json!({"type": "text"})).unwrap();
    assert_eq!((g.constraint, g.requires.len()), (None, 0));
    let (g, _) = with(json!({"type": "json_object"})).unwrap();
    assert_eq!(
        (g.constraint, g.requires),
        (Some(Constraint::JsonObject), vec!["constraint".to_string()])
    );
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let sent = |strict: Value| {
        match with(json!({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": strict}})).unwrap().0.constraint {
        Some(Constraint::JsonSchema { schema: text }) => serde_json::from_str::<Value>(&text).unwrap(),
        other => panic!("{other:?}"),
    }
    };
    let mut closed = schema.clone();
    closed["additionalProperties"] = json!(false);
    assert_eq!(sent(json!(true)), closed);
    assert_eq!(sent(json!(false)), schema);
    assert_eq!(sent(Value::Null), schema);
    assert_eq!(
        with(json!({"type": "json_schema", "json_schema": {"name": "", "schema": {}}}))
            .unwrap_err()
            .status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        with(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}))
            .unwrap_err()
            .status,
        StatusCode::BAD_REQUEST
    );
}

#[test]
fn wire_errors_get_openai_statuses() {
    let st = |c| ApiError::from_wire(&WireError::new(c, "m")).status.as_u16();
    assert_eq!(
        [
            ErrorClass::InvalidRequest,
            ErrorClass::UnknownModel,
            ErrorClass::PromptTooLong,
            ErrorClass::QueueFull,
            ErrorClass::NoWorker,
            ErrorClass::Internal
        ]
        .map(st),
        [400, 404, 413, 429, 503, 500]
    );
    let b = ApiError::from_wire(&WireError::new(
        ErrorClass::UnknownModel,
        "unknown model \"x\"",
    ))
    .body();
    assert_eq!(b["error"]["type"], "invalid_request_error");
    assert_eq!(b["error"]["code"], "model_not_found");
}

/// docs/openai-api.md's table of chat-completion fields, as (field, status) rows.
fn documented_fields() -> Vec<(String, String)> {
    let doc = include_str!("../../../../docs/openai-api.md");
    let mut rows = vec![];
    for line in doc
        .lines()
        .skip_while(|l| !l.starts_with("| field |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
    {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (names, status) = (cells[1], cells[2]);
        for name in names
            .split(',')
            .map(str::trim)
            .filter(|n| n.starts_with('`'))
        {
            rows.push((name.trim_matches('`').to_string(), status.to_string()));
        }
    }
    rows
}

/// Every field in the documented table does what the table says: a field the gateway reads is
/// one its request shape knows (it never reaches the refused rest), one that is accepted and
/// not used passes with any value, and a refused one is a 400 naming it when its value is not
/// neutral, and passes when it is.
#[test]
fn the_documented_field_table_is_true() {
    let rows = documented_fields();
    assert!(rows.len() >= 30, "{rows:?}");
    let request = |field: &str, value: Value| {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        v[field] = value;
        serde_json::from_value::<ChatRequest>(v)
            .map_err(|e| ApiError::invalid(e.to_string()))
            .and_then(chat_request)
    };
    // A value each refused field can take that changes something, and its neutral value.
    let values = |field: &str| -> (Value, Option<Value>) {
        match field {
            "service_tier" => (json!("priority"), Some(json!("auto"))),
            "store" => (json!(true), Some(json!(false))),
            "metadata" | "logit_bias" => (json!({"a": "1"}), Some(json!({}))),
            "modalities" => (json!(["text", "audio"]), Some(json!(["text"]))),
            "frequency_penalty" | "presence_penalty" => (json!(0.5), Some(json!(0))),
            "functions" => (json!([{"name": "f"}]), Some(json!([]))),
            "function_call" => (json!({"name": "f"}), Some(json!("auto"))),
            _ => (json!("x"), None),
        }
    };
    for (field, status) in rows {
        if field == "any other name" {
            continue;
        }
        let known = {
            let mut v = json!({"model": "m", "messages": []});
            v[&field] = Value::Null;
            serde_json::from_value::<ChatRequest>(v)
                .map(|r| !r.rest.contains_key(&field))
                .unwrap_or(true)
        };
        match status.as_str() {
            "implemented" => assert!(
                known,
                "{field} is documented as implemented but the gateway does not read it"
            ),
            "accepted, not used" => {
                assert!(known, "{field}");
                assert!(request(&field, json!("anything")).is_ok(), "{field}");
            }
            s if s.starts_with("refused") => {
                assert!(
                    !known,
                    "{field} is documented as refused but the gateway reads it"
                );
                let (bad, neutral) = values(&field);
                let e = request(&field, bad).expect_err(&field);
                assert!(
                    e.status == StatusCode::BAD_REQUEST
                        && e.message.contains(&format!("`{field}`")),
                    "{field}: {}",
                    e.message
                );
                if let Some(n) = neutral {
                    assert!(
                        request(&field, n).is_ok(),
                        "{field}'s neutral value refused"
                    );
                }
                assert!(
                    request(&field, Value::Null).is_ok(),
                    "{field}: null refused"
                );
            }
            other => panic!("{field}: unknown status {other:?}"),
        }
    }
    // OpenAI's newer name for the system turn.
    let mut v = json!({"model": "m", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}]});
    v["stream_options"] = json!({"include_usage": true, "include_obfuscation": true});
    let (g, _) = chat(v).unwrap();
    assert_eq!(g.messages.unwrap()[0].role, "system");
}
