//! Constrained decoding on real vocabularies (Llama 3 and Qwen3 byte-level BPE, Mistral's
//! SentencePiece): every token's bytes spell the text
//! the tokenizer decodes; a valid document's tokens are allowed one after the other and the end
//! of sequence only where it is complete; walks that pick random allowed tokens end in documents
//! that the `jsonschema` crate (an independent validator) accepts; what cannot be compiled is an
//! invalid request with the library's reason.

mod common {
    pub mod walk;
}

use std::path::PathBuf;

use llmq_text::constraint::{Constraint, Grammars, Matcher};
use llmq_text::Tokenizer;
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The test vocabularies, with their end-of-sequence ids.
fn vocabularies() -> Vec<(&'static str, Tokenizer)> {
    let mut out = vec![];
    for fam in ["llama3", "qwen3", "mistral"] {
        let tok = Tokenizer::from_hf_dir(&repo().join(".cache/tokenizers").join(fam)).unwrap();
        out.push((fam, tok));
    }
    out
}

fn eos_of(tok: &Tokenizer) -> Vec<u32> {
    if tok.eos_ids.is_empty() {
        ["</s>", "<|end_of_text|>", "<|endoftext|>"]
            .iter()
            .filter_map(|t| tok.token_to_id(t))
            .take(1)
            .collect()
    } else {
        tok.eos_ids.clone()
    }
}

fn allowed(mask: &[u32], t: u32) -> bool {
    mask[t as usize / 32] >> (t % 32) & 1 == 1
}

fn set(mask: &[u32]) -> Vec<u32> {
    (0..mask.len() as u32 * 32)
        .filter(|&t| allowed(mask, t))
        .collect()
}

#[test]
fn token_bytes_spell_the_decoded_text() {
    for (fam, tok) in vocabularies() {
        let bytes = tok.token_bytes().unwrap();
        for text in [
            "Hello, world!",
            "  {\"a\": [1, 2.5e-3, true]}\n",
            "naïve café — 東京 🦀",
            "tab\tand\r\nnewline",
        ] {
            let ids = tok.encode(text, false).unwrap();
            let spelled: Vec<u8> = ids
                .iter()
                .flat_map(|&i| bytes[i as usize].0.clone())
                .collect();
            // SentencePiece marks the start of the text with a space it then drops.
            let spelled = if fam == "mistral" {
                spelled.strip_prefix(b" ").unwrap_or(&spelled).to_vec()
            } else {
                spelled
            };
            assert_eq!(String::from_utf8_lossy(&spelled), text, "{fam}");
        }
        let eos = eos_of(&tok)[0];
        assert!(
            bytes[eos as usize].1,
            "{fam}: the end of sequence is a special token"
        );
    }
}

/// Feeds `text`'s tokens to a matcher, checking that each was allowed; returns the mask after.
fn follow(m: &mut Matcher, tok: &Tokenizer, words: usize, text: &str) -> Vec<u32> {
    let mut mask = vec![0; words];
    for id in tok.encode(text, false).unwrap() {
        m.allowed(&mut mask).unwrap();
        assert!(
            allowed(&mask, id),
            "token {id} ({:?}) of {text:?} refused",
            tok.decode(&[id], false).unwrap()
        );
        m.accept(id).unwrap();
    }
    m.allowed(&mut mask).unwrap();
    mask
}

#[test]
fn a_valid_document_is_followed_and_ends_only_where_complete() {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    // Byte-level vocabularies only: SentencePiece's encoder starts a text with a space that a
    // model continuing a prompt does not produce.
    for (fam, tok) in vocabularies().into_iter().filter(|(f, _)| *f != "mistral") {
        let eos = eos_of(&tok);
        let g = Grammars::new(&tok, tok.max_id_bound() + 7, &eos).unwrap();
        let words = g.mask_words();
        let c = Constraint::JsonSchema {
            schema: schema.to_string(),
        };
        let mut m = g.matcher(&c).unwrap();
        let mask = follow(&mut m, &tok, words, r#"{"name": "Ada", "age": 36"#);
        assert!(
            eos.iter().all(|&e| !allowed(&mask, e)),
            "{fam}: ended before the object closed"
        );
        let close = tok.encode("}", false).unwrap()[0];
        assert!(allowed(&mask, close), "{fam}");
        // A property the schema does not have, or a string where the age goes, is refused.
        let mut m2 = g.matcher(&c).unwrap();
        let mask2 = follow(&mut m2, &tok, words, r#"{"name": "Ada", "#);
        let bad = tok.encode(r#""x"#, false).unwrap()[0];
        assert!(
            !allowed(&mask2, bad) || tok.decode(&[bad], false).unwrap() == "\"",
            "{fam}"
        );
        m.accept(close).unwrap();
        let mut end = vec![0; words];
        m.allowed(&mut end).unwrap();
        assert_eq!(
            set(&end),
            {
                let mut e = eos.clone();
                e.sort();
                e
            },
            "{fam}: only the end of sequence follows a complete object"
        );
        // Ids past the tokenizer's (the model's padding) are never allowed.
        assert!(!allowed(&end, tok.max_id_bound() as u32 + 3), "{fam}");
        assert!(m.is_complete(), "{fam}");
    }
}

/// A walk's text, preferring tokens that close strings, objects and arrays or write numbers.
fn walk(
    g: &Grammars,
    tok: &Tokenizer,
    c: &Constraint,
    eos: &[u32],
    seed: u64,
    limit: usize,
) -> Option<String> {
    let closes = |b: &[u8], _: bool| b.iter().any(|b| b"\"}],0123456789".contains(b));
    let ids = common::walk::walk(g, tok, c, eos, seed, limit, &closes)?;
    let bytes = tok.token_bytes().unwrap();
    Some(
        String::from_utf8(
            ids.iter()
                .flat_map(|&t| bytes[t as usize].0.clone())
                .collect(),
        )
        .expect("the constraint keeps the output UTF-8"),
    )
}

#[test]
fn random_walks_end_in_documents_the_schema_accepts() {
    let schemas = [
        json!({"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}, "required": ["id", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "score": {"type": "number"}}, "required": ["colour"]}),
        json!({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9999, "maximum": 9999}}, "required": ["x"], "additionalProperties": false}, "minItems": 1, "maxItems": 3}),
        json!({"type": "object", "properties": {"inner": {"type": "object", "properties": {"list": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}, "required": ["list"], "additionalProperties": false}}, "required": ["inner"], "additionalProperties": false}),
    ];
    for (fam, tok) in vocabularies() {
        let eos = eos_of(&tok);
        let g = Grammars::new(&tok, tok.max_id_bound(), &eos).unwrap();
        for schema in &schemas {
            let validator = jsonschema::validator_for(schema).unwrap();
            let c = Constraint::JsonSchema {
                schema: schema.to_string(),
            };
            let mut ended = 0;
            for seed in 0..6 {
                if let Some(text) = walk(&g, &tok, &c, &eos, seed, 200) {
                    ended += 1;
                    let doc: Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("{fam}: {text:?} is not JSON: {e}"));
                    assert!(
                        validator.is_valid(&doc),
                        "{fam}: {text} does not validate against {schema}"
                    );
                }
            }
            assert!(
                ended >= 3,
                "{fam}: only {ended} of 6 walks ended within 200 tokens for {schema}"
            );
        }
        // Any JSON object, a regular expression, a Lark grammar: the first walk that ends.
        let first = |c: &Constraint, limit| {
            (0..20)
                .find_map(|seed| walk(&g, &tok, c, &eos, seed, limit))
                .unwrap_or_else(|| panic!("{fam}: no walk ended for {c:?}"))
        };
        let object = first(&Constraint::JsonObject, 400);
        assert!(
            serde_json::from_str::<Value>(&object).unwrap().is_object(),
            "{fam}: {object}"
        );
        let date = first(
            &Constraint::Regex {
                pattern: r"[0-9]{4}-[0-9]{2}-[0-9]{2}".into(),
            },
            50,
        );
        assert!(
            date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-',
            "{fam}: {date}"
        );
        let lark = Constraint::Lark {
            grammar: "start: (\"yes\" | \"no\") \" because \" /[a-z]{1,8}/".into(),
        };
        let answer = first(&lark, 50);
        assert!(
            answer.starts_with("yes because ") || answer.starts_with("no because "),
            "{fam}: {answer}"
        );
    }
}

#[test]
fn constraints_the_library_rejects_are_invalid_requests() {
    let tok = Tokenizer::from_hf_dir(&repo().join(".cache/tokenizers/qwen3")).unwrap();
    let g = Grammars::new(&tok, tok.max_id_bound(), &eos_of(&tok)).unwrap();
    for (c, says) in [
        (
            Constraint::JsonSchema {
                schema: "{not json".into(),
            },
            "not JSON",
        ),
        (
            Constraint::JsonSchema {
                schema: json!({"type": "no-such-type"}).to_string(),
            },
            "rejected",
        ),
        (
            Constraint::Regex {
                pattern: "(unclosed".into(),
            },
            "rejected",
        ),
        (
            Constraint::Lark {
                grammar: "start: undefined_rule".into(),
            },
            "rejected",
        ),
        (
            Constraint::Regex {
                pattern: "a".repeat(300_000),
            },
            "at most",
        ),
    ] {
        match g.matcher(&c) {
            Err(llmq_text::Error::InvalidRequest(m)) => assert!(m.contains(says), "{c:?}: {m}"),
            Err(e) => panic!("{c:?}: {e}"),
            Ok(_) => panic!("{c:?} accepted"),
        }
    }
}

/// No object repeats a key: inside a key of an open object (any JSON object, an open schema's
/// additional properties, a tool call's arguments), every token that would close a key already
/// used in that object is refused, and the keys of other objects do not count.
#[test]
fn no_object_repeats_a_key() {
    let open_schema =
        json!({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]});
    let call = Constraint::Lark {
        grammar: format!("start: \"<tool_call>\" %json {}", json!({"type": "object"})),
    };
    for (fam, tok) in vocabularies().into_iter().filter(|(f, _)| *f != "mistral") {
        let eos = eos_of(&tok);
        let g = Grammars::new(&tok, tok.max_id_bound(), &eos).unwrap();
        let bytes = tok.token_bytes().unwrap();
        let quote_first: Vec<u32> = (0..bytes.len() as u32)
            .filter(|&t| bytes[t as usize].0.first() == Some(&b'"'))
            .collect();
        let after = |c: &Constraint, text: &str| {
            let mut m = g.matcher(c).unwrap();
            follow(&mut m, &tok, g.mask_words(), text)
        };
        for (c, written) in [
            (Constraint::JsonObject, r#"{"id": 1, "a": {"b": 2}, ""#),
            (
                Constraint::JsonSchema {
                    schema: open_schema.to_string(),
                },
                r#"{"name": "x", "id": 1, "a": {"b": 2}, ""#,
            ),
            (call.clone(), r#"<tool_call>{"id": 1, "a": {"b": 2}, ""#),
        ] {
            // A key written up to an old one's name: no token may close it there.
            for key in ["id", "a"] {
                let mask = after(&c, &format!("{written}{key}"));
                assert!(
                    quote_first.iter().all(|&t| !allowed(&mask, t)),
                    "{fam} {c:?}: the key {key:?} may close again"
                );
                assert!(
                    !set(&mask).is_empty(),
                    "{fam} {c:?}: the key {key:?} may go on"
                );
            }
            // A new key, and one used only in the inner object, may close.
            for key in ["ida", "b"] {
                let mask = after(&c, &format!("{written}{key}"));
                assert!(
                    quote_first.iter().any(|&t| allowed(&mask, t)),
                    "{fam} {c:?}: the new key {key:?} cannot close"
                );
            }
        }
        // The outer object's keys do not bind a new inner object.
        let mask = after(&Constraint::JsonObject, r#"{"id": 1, "b": {"id"#);
        assert!(quote_first.iter().any(|&t| allowed(&mask, t)), "{fam}");
    }
}
