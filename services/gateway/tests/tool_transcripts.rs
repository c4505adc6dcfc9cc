//! The tool-call parser on transcripts made with each family's real chat template (llama.cpp's
//! collection, from the set-up) and tokenizer: a conversation whose last turn is the
//! assistant's calls is rendered; the assistant's part, as the template writes it (what the
//! model was trained to emit), is tokenized and detokenized piece by piece as a worker streams
//! it, and the parser must give back the same calls and no content. The template's tools and
//! the syntax intake names for it come from `llmq_text::tools`. And the grammar intake holds a
//! required call to, walked at random on each family's vocabulary, gives calls that parse and
//! validate (checked with the `jsonschema` crate).

#[path = "../../../shared/text/tests/common/walk.rs"]
mod text_walk;

use std::path::PathBuf;

use llmq_gateway::tool_calls::{Parsed, ToolCallParser};
use llmq_protocol::{ChatMessage, Constraint, Tool, ToolCall, ToolChoice, ToolSyntax};
use llmq_text::constraint::Grammars;
use llmq_text::detok::Detokenizer;
use llmq_text::tools::{self, Support};
use llmq_text::Tokenizer;
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A family's tokenizer with one of llama.cpp's templates in place of its own.
fn family(tokenizer: &str, template: &str, bos: &str, eos: &str) -> Tokenizer {
    let mut tok =
        Tokenizer::from_hf_dir(&repo().join(".cache/tokenizers").join(tokenizer)).unwrap();
    let path = repo()
        .join(".cache/templates")
        .join(format!("{template}.jinja"));
    tok.chat_template = Some(
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run `make setup`)", path.display())),
    );
    tok.bos_token = Some(bos.into());
    tok.eos_token = Some(eos.into());
    tok
}

fn tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "get_weather".into(),
            description: Some("The weather in a city".into()),
            parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}).to_string()),
        },
        // A reference to a definition, as pydantic writes nested models and enums: it must
        // resolve inside the call's grammar too.
        Tool {
            name: "get_time".into(),
            description: Some("The time in a zone".into()),
            parameters: Some(json!({"type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "$defs": {"Zone": {"type": "string", "maxLength": 12}}}).to_string()),
        },
    ]
}

/// The assistant's turn of calls as `tok`'s template writes it, up to its end of turn.
fn written_calls(tok: &Tokenizer, calls: &[ToolCall]) -> String {
    let ask = vec![ChatMessage::new(
        "user",
        "What is the weather in Paris, and the time in Tokyo?",
    )];
    let mut answered = ask.clone();
    answered.push(ChatMessage {
        role: "assistant".into(),
        tool_calls: calls.to_vec(),
        ..Default::default()
    });
    let render = |m: &[ChatMessage], open: bool| {
        let t = tools::template_tools(&tools());
        llmq_text::tokenizer::render_chat(
            tok.chat_template.as_deref().unwrap(),
            &tools::template_messages(m),
            Some(&t),
            open,
            tok.bos_token.as_deref(),
            tok.eos_token.as_deref(),
        )
        .unwrap()
    };
    let prompt = render(&ask, true);
    let full = render(&answered, false);
    let turn = full.strip_prefix(prompt.as_str()).unwrap_or_else(|| {
        panic!("the prompt does not begin the conversation:\n{prompt}\n---\n{full}")
    });
    // The model's output stops at its end of turn (an end-of-sequence token, not text).
    let end = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>"]
        .iter()
        .filter_map(|e| turn.find(e))
        .min()
        .unwrap_or(turn.len());
    turn[..end].to_string()
}

/// `text` tokenized, then streamed through a detokenizer (special tokens' text kept where the
/// syntax's markers are special tokens, as intake asks) and the parser.
fn stream(tok: &Tokenizer, syntax: ToolSyntax, text: &str) -> Parsed {
    stream_ids(tok, syntax, &tok.encode(text, false).unwrap())
}

fn stream_ids(tok: &Tokenizer, syntax: ToolSyntax, ids: &[u32]) -> Parsed {
    let special = tools::markers(syntax)
        .iter()
        .any(|m| tok.special_token_id(m).is_some());
    let mut detok = if special {
        Detokenizer::with_special_text()
    } else {
        Detokenizer::new()
    };
    let mut parser = ToolCallParser::new(syntax);
    let mut all = Parsed::default();
    let mut take = |p: Parsed| {
        all.content.push_str(&p.content);
        all.calls.extend(p.calls);
    };
    for &id in ids {
        let piece = detok.push(tok, id).unwrap();
        take(parser.push(&piece));
    }
    take(parser.push(&detok.flush(tok).unwrap()));
    take(parser.finish(false));
    all
}

#[test]
fn each_family_s_calls_come_back_from_its_own_template_s_text() {
    let families = [
        (
            "Llama 3.1",
            family(
                "llama3",
                "meta-llama-Llama-3.1-8B-Instruct",
                "<|begin_of_text|>",
                "<|eot_id|>",
            ),
            ToolSyntax::Llama3Json,
        ),
        (
            "Qwen 2.5",
            family("qwen3", "Qwen-Qwen2.5-7B-Instruct", "", "<|im_end|>"),
            ToolSyntax::Hermes,
        ),
        (
            "Hermes 3",
            family(
                "llama3",
                "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
                "<|begin_of_text|>",
                "<|im_end|>",
            ),
            ToolSyntax::Hermes,
        ),
        (
            "Mistral Nemo",
            family(
                "mistral-v3",
                "mistralai-Mistral-Nemo-Instruct-2407",
                "<s>",
                "</s>",
            ),
            ToolSyntax::Mistral,
        ),
    ];
    let weather = ToolCall {
        id: "call0abcd".into(),
        name: "get_weather".into(),
        arguments: json!({"city": "Paris", "days": 3}).to_string(),
    };
    let time = ToolCall {
        id: "call1efgh".into(),
        name: "get_time".into(),
        arguments: json!({"zone": "Asia/Tokyo"}).to_string(),
    };
    for (name, tok, syntax) in families {
        assert_eq!(
            tools::support(tok.chat_template.as_deref().unwrap()).unwrap(),
            Support::Template(syntax),
            "{name}"
        );
        // Llama 3.1's template takes one call per turn.
        let calls = if syntax == ToolSyntax::Llama3Json {
            vec![weather.clone()]
        } else {
            vec![weather.clone(), time.clone()]
        };
        let text = written_calls(&tok, &calls);
        let parsed = stream(&tok, syntax, &text);
        assert_eq!(parsed.content, "", "{name}: {text:?}");
        let got: Vec<(String, Value)> = parsed
            .calls
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        let want: Vec<(String, Value)> = calls
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        assert_eq!(got, want, "{name}: {text:?}");
        eprintln!("{name}: {text:?} -> {} calls", parsed.calls.len());
    }
}

/// A template that shows no tools (SmolLM2's) gets llmq's instructions in the system turn and
/// its calls and results as text, which the Hermes parser reads back.
#[test]
fn a_template_without_tools_is_instructed_and_its_turns_written_as_text() {
    let (tok, _) =
        llmq_text::load_tokenizer(&llmq_text::resolve_model("smollm2").unwrap()).unwrap();
    assert_eq!(
        tools::support(tok.chat_template.as_deref().unwrap()).unwrap(),
        Support::Instructed
    );
    let call = ToolCall {
        id: "abcdefghi".into(),
        name: "get_weather".into(),
        arguments: "{\"city\":\"Paris\"}".into(),
    };
    let conversation = vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Weather in Paris?"),
        ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![call],
            ..Default::default()
        },
        ChatMessage {
            role: "tool".into(),
            content: "sunny".into(),
            tool_call_id: Some("abcdefghi".into()),
            ..Default::default()
        },
    ];
    let (text, syntax) = tok
        .apply_chat_template_with_tools(&conversation, &tools())
        .unwrap();
    assert_eq!(syntax, ToolSyntax::Hermes);
    assert!(
        text.contains("\"name\":\"get_weather\"") && text.contains("Be brief."),
        "{text}"
    );
    assert!(text.contains("<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"), "{text}");
    assert!(
        text.contains("<tool_response>\nsunny\n</tool_response>"),
        "{text}"
    );
    let parsed = stream(
        &tok,
        syntax,
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>",
    );
    assert_eq!((parsed.content.as_str(), parsed.calls.len()), ("", 1));
}

/// Token ids of a walk through the call grammar, mostly by tokens that close something (or are
/// special: a call's markers), so that it ends.
fn walk(
    g: &Grammars,
    tok: &Tokenizer,
    c: &Constraint,
    eos: &[u32],
    seed: u64,
    limit: usize,
) -> Option<Vec<u32>> {
    let closes = |b: &[u8], special: bool| special || b.iter().any(|b| b"\"}]<>".contains(b));
    text_walk::walk(g, tok, c, eos, seed, limit, &closes)
}

/// What intake asks for with `required` or a named function: in every family's syntax and
/// vocabulary, random walks through the call grammar are calls of the allowed functions (one
/// only without parallel calls) whose arguments validate, and the parser reads them back.
#[test]
fn required_calls_are_calls_with_valid_arguments_in_every_syntax() {
    let families = [
        ("llama3", ToolSyntax::Llama3Json),
        ("llama3", ToolSyntax::Hermes),
        ("qwen3", ToolSyntax::Hermes),
        ("mistral-v3", ToolSyntax::Mistral),
    ];
    let tools = tools();
    let schema_of = |name: &str| -> Value {
        serde_json::from_str(
            tools
                .iter()
                .find(|t| t.name == name)
                .unwrap()
                .parameters
                .as_deref()
                .unwrap(),
        )
        .unwrap()
    };
    for (fam, syntax) in families {
        let tok = Tokenizer::from_hf_dir(&repo().join(".cache/tokenizers").join(fam)).unwrap();
        // The tokenizer's own end of sequence, else its family's (a bare tokenizer.json names none).
        let eos: Vec<u32> = match tok.eos_ids.as_slice() {
            [] => ["</s>", "<|end_of_text|>"]
                .iter()
                .filter_map(|t| tok.special_token_id(t))
                .take(1)
                .collect(),
            ids => ids.to_vec(),
        };
        let g = Grammars::new(&tok, tok.max_id_bound(), &eos).unwrap();
        for (choice, parallel) in [
            (ToolChoice::Required, true),
            (ToolChoice::Required, false),
            (
                ToolChoice::Function {
                    name: "get_time".into(),
                },
                true,
            ),
        ] {
            let grammar = tools::call_grammar(syntax, &tools, &choice, parallel, |m| {
                tok.special_token_id(m)
            })
            .unwrap();
            let c = Constraint::Lark {
                grammar: grammar.clone(),
            };
            let mut ended = 0;
            for seed in 1..=6 {
                let Some(ids) = walk(&g, &tok, &c, &eos, seed, 300) else {
                    continue;
                };
                ended += 1;
                let text = tok.decode(&ids, false).unwrap();
                let parsed = stream_ids(&tok, syntax, &ids);
                assert_eq!(parsed.content, "", "{fam} {syntax:?}: {text:?}");
                assert!(!parsed.calls.is_empty(), "{fam} {syntax:?}: {text:?}");
                if !parallel || syntax == ToolSyntax::Llama3Json {
                    assert_eq!(parsed.calls.len(), 1, "{fam} {syntax:?}: {text:?}");
                }
                for call in &parsed.calls {
                    if let ToolChoice::Function { name } = &choice {
                        assert_eq!(&call.name, name);
                    }
                    let args: Value = serde_json::from_str(&call.arguments).unwrap();
                    assert!(
                        jsonschema::validator_for(&schema_of(&call.name))
                            .unwrap()
                            .is_valid(&args),
                        "{fam} {syntax:?}: {text:?}"
                    );
                }
            }
            assert!(
                ended >= 3,
                "{fam} {syntax:?} {choice:?}: only {ended} of 6 walks ended\n{grammar}"
            );
        }
    }
}
