//! llguidance (through llmq's `constraint` module) against outlines-core on Llama 3's 128k
//! vocabulary: the time to make a schema usable (llguidance: compile a parser; outlines-core:
//! turn the schema into a regular expression and index it over the vocabulary) and the time per
//! token to know the allowed set while following a valid document.
//!
//! Run: cargo run --release -- ../../.cache/tokenizers/llama3

use std::time::Instant;

use llmq_text::constraint::{Constraint, Grammars};
use llmq_text::Tokenizer;
use outlines_core::prelude::*;
use serde_json::json;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn main() {
    let dir = std::env::args().nth(1).expect("a tokenizer directory");
    let tok = Tokenizer::from_hf_dir(std::path::Path::new(&dir)).unwrap();
    let eos = tok.eos_ids[0];
    let vocab = tok.max_id_bound();
    let t = Instant::now();
    let g = Grammars::new(&tok, vocab, &tok.eos_ids).unwrap();
    println!(
        "vocabulary of {vocab} tokens: llguidance trie {:.0} ms",
        ms(t)
    );
    let t = Instant::now();
    let mut v = Vocabulary::new(eos);
    for (id, (bytes, special)) in tok.token_bytes().unwrap().into_iter().enumerate() {
        if !special && !bytes.is_empty() && id as u32 != eos {
            v.try_insert(bytes, id as u32).unwrap();
        }
    }
    println!(
        "vocabulary of {vocab} tokens: outlines-core vocabulary {:.0} ms",
        ms(t)
    );
    let record = json!({"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"], "additionalProperties": false});
    let cases = [
        (
            "flat object",
            json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false}),
            r#"{"name": "Ada Lovelace", "age": 36}"#.to_string(),
        ),
        (
            "nested, arrays, enums",
            json!({"type": "object", "properties": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}, "required": ["name", "tags"], "additionalProperties": false}, "score": {"type": "number"}}, "required": ["person", "score"], "additionalProperties": false}),
            r#"{"person": {"name": "Grace", "tags": ["a", "c"]}, "score": 9.5}"#.to_string(),
        ),
        (
            "array of 8 records",
            json!({"type": "array", "items": record, "minItems": 8}),
            format!(
                "[{}]",
                vec![r#"{"id": 7, "name": "x", "ok": true}"#; 8].join(", ")
            ),
        ),
        (
            "array of 256 records (llmq bench)",
            json!({"type": "array", "items": record, "minItems": 256}),
            format!(
                "[{}",
                vec![r#"{"id": 7, "name": "x", "ok": true}"#; 12].join(", ")
            ),
        ),
        (
            "recursive tree ($ref)",
            json!({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"], "additionalProperties": false}}, "$ref": "#/$defs/node"}),
            r#"{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": []}]}]}"#.to_string(),
        ),
    ];
    println!("| schema | llguidance compile ms | llguidance mask us/token (mean, max) | outlines-core regex+index ms | outlines-core us/token (mean, max) |");
    println!("|---|---|---|---|---|");
    for (name, schema, doc) in cases {
        let ids = tok.encode(&doc, false).unwrap();
        let c = Constraint::JsonSchema {
            schema: schema.to_string(),
        };
        let t = Instant::now();
        let mut m = g.matcher(&c).unwrap();
        let compile = ms(t);
        let mut mask = vec![0u32; g.mask_words()];
        let mut per = vec![];
        for &id in &ids {
            let t = Instant::now();
            m.allowed(&mut mask).unwrap();
            m.accept(id).unwrap();
            per.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let llg = format!(
            "{:.0}, {:.0}",
            per.iter().sum::<f64>() / per.len() as f64,
            per.iter().cloned().fold(0.0, f64::max)
        );
        let t = Instant::now();
        let outlines = match json_schema::regex_from_str(&schema.to_string(), None, None)
            .map_err(|e| e.to_string())
            .and_then(|rx| Index::new(&rx, &v).map_err(|e| e.to_string()))
        {
            Ok(index) => {
                let build = ms(t);
                let mut state = index.initial_state();
                let mut per = vec![];
                let mut ok = true;
                for &id in &ids {
                    let t = Instant::now();
                    let allowed = index.allowed_tokens(&state).unwrap_or_default();
                    let mut words = vec![0u32; vocab.div_ceil(32)];
                    for a in allowed {
                        words[a as usize / 32] |= 1 << (a % 32);
                    }
                    match index.next_state(&state, &id) {
                        Some(s) => state = s,
                        None => {
                            ok = false;
                            break;
                        }
                    }
                    per.push(t.elapsed().as_secs_f64() * 1e6);
                }
                let walk = if ok {
                    format!(
                        "{:.0}, {:.0}",
                        per.iter().sum::<f64>() / per.len().max(1) as f64,
                        per.iter().cloned().fold(0.0, f64::max)
                    )
                } else {
                    "refused the document's tokens".into()
                };
                format!("{build:.0} | {walk}")
            }
            Err(e) => format!(
                "failed after {:.0} ms: {} |",
                ms(t),
                e.chars().take(60).collect::<String>()
            ),
        };
        println!("| {name} | {compile:.1} | {llg} | {outlines} |");
    }
}
