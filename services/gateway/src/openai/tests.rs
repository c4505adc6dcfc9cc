//! The request shapes' translation to the protocol and the errors' statuses.

use super::*;

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
    assert_eq!((g.temperature, g.top_p, g.seed), (Some(0.5), Some(0.9), Some(3)));
    assert_eq!(g.stop, vec!["x".to_string()]);
    assert_eq!(g.messages.as_ref().unwrap()[1].content, "Hi!");
    assert!(g.logprobs && g.top_logprobs == 2 && g.require_worker);
    assert!(s.stream && s.include_usage && s.logprobs == Some(2));
}

#[test]
fn unsupported_requests_are_invalid() {
    let base = |extra: Value| {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        chat(v).unwrap_err().status
    };
    assert_eq!(base(json!({"n": 17})), StatusCode::BAD_REQUEST);
    assert_eq!(base(json!({"n": 0})), StatusCode::BAD_REQUEST);
    assert_eq!(base(json!({"top_logprobs": 30, "logprobs": true})), StatusCode::BAD_REQUEST);
    assert_eq!(base(json!({"seed": -1})), StatusCode::BAD_REQUEST);
    let img = json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]});
    assert_eq!(chat(img).unwrap_err().status, StatusCode::BAD_REQUEST);
    let batch: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": ["a", "b"]})).unwrap();
    assert_eq!(completion_request(batch).unwrap_err().status, StatusCode::BAD_REQUEST);
}

/// Fields the gateway does not implement are refused naming them, unless neutral (a
/// client's defaults); the vLLM-style sampler extensions reach the protocol.
#[test]
fn unimplemented_fields_are_refused_by_name_never_dropped() {
    let with = |extra: Value| {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
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
    assert!(e.message.contains("`functions`, `presence_penalty`"), "{}", e.message);
    // What a client library sends by default changes nothing and is accepted.
    let (g, _) = with(json!({
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
        "parallel_tool_calls": true, "response_format": {"type": "text"}, "metadata": null, "store": false,
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [7],
    }))
    .unwrap();
    assert_eq!((g.top_k, g.min_p, g.repetition_penalty, g.stop_token_ids.clone()), (Some(5), Some(0.1), Some(1.1), vec![7]));
    let legacy: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": "a", "suffix": "b"})).unwrap();
    assert!(completion_request(legacy).unwrap_err().message.contains("`suffix`"));
    let legacy: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": "a", "best_of": 1})).unwrap();
    assert!(completion_request(legacy).is_ok());
}

/// `response_format` becomes the protocol's constraint, which the request then requires
/// (an intake that does not know it refuses the request); `strict: true` closes the schema's
/// objects, and without it the schema goes as it came (intake's setting reads it).
#[test]
fn response_formats_become_required_constraints() {
    let with = |format: Value| chat(json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": format}));
    let (g, _) = with(json!({"type": "text"})).unwrap();
    assert_eq!((g.constraint, g.requires.len()), (None, 0));
    let (g, _) = with(json!({"type": "json_object"})).unwrap();
    assert_eq!((g.constraint, g.requires), (Some(Constraint::JsonObject), vec!["constraint".to_string()]));
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let sent = |strict: Value| match with(json!({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": strict}})).unwrap().0.constraint {
        Some(Constraint::JsonSchema { schema: text }) => serde_json::from_str::<Value>(&text).unwrap(),
        other => panic!("{other:?}"),
    };
    let mut closed = schema.clone();
    closed["additionalProperties"] = json!(false);
    assert_eq!(sent(json!(true)), closed);
    assert_eq!(sent(json!(false)), schema);
    assert_eq!(sent(Value::Null), schema);
    assert_eq!(with(json!({"type": "json_schema", "json_schema": {"name": "", "schema": {}}})).unwrap_err().status, StatusCode::BAD_REQUEST);
    assert_eq!(with(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}})).unwrap_err().status, StatusCode::BAD_REQUEST);
}

#[test]
fn wire_errors_get_openai_statuses() {
    let st = |c| ApiError::from_wire(&WireError::new(c, "m")).status.as_u16();
    assert_eq!(
        [ErrorClass::InvalidRequest, ErrorClass::UnknownModel, ErrorClass::PromptTooLong, ErrorClass::QueueFull, ErrorClass::NoWorker, ErrorClass::Internal].map(st),
        [400, 404, 413, 429, 503, 500]
    );
    let b = ApiError::from_wire(&WireError::new(ErrorClass::UnknownModel, "unknown model \"x\"")).body();
    assert_eq!(b["error"]["type"], "invalid_request_error");
    assert_eq!(b["error"]["code"], "model_not_found");
}
