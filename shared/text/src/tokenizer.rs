//! Tokenizers and chat templates.
//!
//! A Hugging Face directory brings its own `tokenizer.json` (or SentencePiece's `tokenizer.model`,
//! read as the GGUF metadata it is equivalent to); a GGUF file brings a vocabulary,
//! merges (or SentencePiece scores), token types and the name of its pre-tokenizer, from which
//! an equivalent `tokenizer.json` is rebuilt here. Chat templates are Jinja, rendered with
//! minijinja in Hugging Face's mode (trimmed blocks, Python string methods).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value as Json};

use crate::error::{Error, Result};
use crate::gguf::Value;
use crate::sentencepiece::SentencePieceModel;

pub use llmq_protocol::ChatMessage;
use llmq_protocol::{Tool, ToolSyntax};

use crate::tools::Support;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    source: PathBuf,
    pub eos_ids: Vec<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<String>,
}

fn tok_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer {
        path: path.into(),
        message: e.to_string(),
    }
}

/// GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte.
fn gpt2_unbytes() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                next += 1;
                (char::from_u32(next - 1).expect("below the surrogates"), b)
            }
        })
        .collect()
}

/// `"<s>"` or `{"content": "<s>", ...}` as tokenizer_config.json writes special tokens.
fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(String::from),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::format(path, e.to_string()))
}

impl Tokenizer {
    /// `tokenizer.json` (or SentencePiece's `tokenizer.model` where there is none), with
    /// `tokenizer_config.json` and `generation_config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let sp_path = dir.join("tokenizer.model");
        let mut tok = if path.is_file() {
            let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| tok_err(&path, e))?;
            Tokenizer {
                inner,
                source: path,
                eos_ids: vec![],
                bos_token: None,
                eos_token: None,
                chat_template: None,
            }
        } else if sp_path.is_file() {
            let sp = SentencePieceModel::read(&sp_path)?;
            Self::from_gguf_metadata(&sp_path, &sp.to_gguf_metadata(&sp_path)?)?
        } else {
            let missing = std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such file (nor tokenizer.model)",
            );
            return Err(Error::io(&path, missing));
        };
        let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
        let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);
        tok.bos_token = token_text(cfg.get("bos_token")).or(tok.bos_token);
        tok.eos_token = token_text(cfg.get("eos_token")).or(tok.eos_token);
        tok.chat_template = match cfg.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Json::as_str).map(String::from)),
            _ => None,
        };
        match gen.get("eos_token_id") {
            Some(Json::Number(n)) => {
                tok.eos_ids = n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
            }
            Some(Json::Array(a)) => {
                tok.eos_ids = a
                    .iter()
                    .filter_map(|v| v.as_u64().map(|v| v as u32))
                    .collect()
            }
            _ => {}
        }
        if let Some(id) = tok
            .eos_token
            .as_deref()
            .and_then(|t| tok.inner.token_to_id(t))
        {
            if !tok.eos_ids.contains(&id) {
                tok.eos_ids.push(id);
            }
        }
        if tok.eos_ids.is_empty() {
            // A bare tokenizer.json: its family's well-known end-of-text token.
            let known = [
                "<|end_of_text|>",
                "<|endoftext|>",
                "<|im_end|>",
                "</s>",
                "<eos>",
            ];
            tok.eos_ids.extend(
                known
                    .iter()
                    .filter_map(|t| tok.inner.token_to_id(t))
                    .take(1),
            );
        }
        Ok(tok)
    }

    /// Rebuilds the tokenizer that a GGUF file's `tokenizer.ggml.*` metadata describes.
    pub fn from_gguf_metadata(path: &Path, md: &HashMap<String, Value>) -> Result<Self> {
        let g = GgufVocab { path, md };
        let model = g.get("model").and_then(Value::as_str).unwrap_or("");
        let tokens = g
            .strings("tokens")
            .ok_or_else(|| tok_err(path, "no tokenizer.ggml.tokens"))?;
        let types: Vec<u64> = g
            .get("token_type")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_else(|| vec![1; tokens.len()]);
        let (bos, eos) = (g.id("bos_token_id"), g.id("eos_token_id"));
        let add_bos = g
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(model == "llama");
        let vocab: serde_json::Map<String, Json> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        let mut tj = match model {
            "gpt2" => g.byte_level_bpe(vocab)?,
            "llama" => g.sentencepiece(vocab, &tokens, &types)?,
            other => {
                return Err(tok_err(
                    path,
                    format!("unsupported tokenizer model {other:?} (tokenizer.ggml.model)"),
                ))
            }
        };
        let obj = tj.as_object_mut().expect("built as an object");
        obj.insert("version".into(), json!("1.0"));
        obj.insert("truncation".into(), Json::Null);
        obj.insert("padding".into(), Json::Null);
        obj.insert(
            "added_tokens".into(),
            Json::Array(added_tokens(&tokens, &types)),
        );
        let post = bos
            .filter(|_| add_bos)
            .map_or(Json::Null, |b| bos_first(&tokens[b as usize], b));
        obj.insert("post_processor".into(), post);
        let inner: tokenizers::Tokenizer = tj.to_string().parse().map_err(|e| tok_err(path, e))?;
        let tok_at = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize).cloned());
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        // Chat models end a turn with their end-of-turn token, which GGUF often records as EOT.
        if let Some(eot) = g.id("eot_token_id") {
            if !eos_ids.contains(&eot) {
                eos_ids.push(eot);
            }
        }
        let chat_template = md
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(String::from);
        Ok(Tokenizer {
            inner,
            source: path.into(),
            eos_ids,
            bos_token: tok_at(bos),
            eos_token: tok_at(eos),
            chat_template,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Largest token id plus one: must not exceed the model's embedding rows.
    pub fn max_id_bound(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .map(|&i| i as usize + 1)
            .max()
            .unwrap_or(0)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| tok_err(&self.source, e))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| tok_err(&self.source, e))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Every token's bytes as it contributes them to decoded text, by id (ids without a token
    /// are empty), and whether each is special (added tokens such as `<|im_end|>`, which
    /// stand for themselves, not for their spelling). Byte-level BPE maps GPT-2's printable
    /// characters back to bytes; SentencePiece-style vocabularies turn `▁` into a space and
    /// `<0xAB>` into its byte.
    pub fn token_bytes(&self) -> Result<Vec<(Vec<u8>, bool)>> {
        let decoder =
            serde_json::to_value(self.inner.get_decoder()).map_err(|e| tok_err(&self.source, e))?;
        let kinds = |d: &Json| -> Vec<String> {
            let parts = d
                .get("decoders")
                .and_then(Json::as_array)
                .cloned()
                .unwrap_or_else(|| vec![d.clone()]);
            parts
                .iter()
                .filter_map(|p| p.get("type").and_then(Json::as_str).map(String::from))
                .collect()
        };
        let kinds = kinds(&decoder);
        let byte_level = kinds.iter().any(|k| k == "ByteLevel");
        if !byte_level
            && !kinds
                .iter()
                .any(|k| k == "ByteFallback" || k == "Metaspace" || k == "Replace")
        {
            return Err(tok_err(
                &self.source,
                format!("cannot tell the bytes of its tokens (decoder {kinds:?})"),
            ));
        }
        let unbyte = gpt2_unbytes();
        let special: std::collections::HashSet<u32> = self
            .inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let mut out = vec![(Vec::new(), false); self.max_id_bound()];
        for (piece, id) in self.inner.get_vocab(true) {
            let bytes = if special.contains(&id) {
                piece.into_bytes()
            } else if byte_level {
                // Added, non-special tokens are plain text; vocabulary entries use GPT-2's map.
                piece
                    .chars()
                    .map(|c| unbyte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| piece.into_bytes())
            } else if let Some(b) = piece
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                vec![b]
            } else {
                piece.replace('\u{2581}', " ").into_bytes()
            };
            out[id as usize] = (bytes, special.contains(&id));
        }
        Ok(out)
    }

    /// Renders the chat template for `messages` (with the assistant's turn opened).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render(
            &crate::tools::template_messages(messages),
            None,
            add_generation_prompt,
        )
    }

    /// Renders the chat template for `messages` with `tools` the model may call; returns the
    /// text and the syntax its calls will come in (see `tools`).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
    ) -> Result<(String, ToolSyntax)> {
        let support = crate::tools::support(self.template()?)?;
        let text = match support {
            Support::Template(_) => {
                let tools = crate::tools::template_tools(tools);
                self.render(
                    &crate::tools::template_messages(messages),
                    Some(&tools),
                    true,
                )?
            }
            Support::Instructed => {
                self.apply_chat_template(&crate::tools::instructed_messages(messages, tools), true)?
            }
        };
        Ok((text, support.syntax()))
    }

    fn template(&self) -> Result<&str> {
        self.chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("this model has no chat template".into()))
    }

    fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        render_chat(
            self.template()?,
            messages,
            tools,
            add_generation_prompt,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
    }

    /// The id of the special token whose text is `content`, if the vocabulary has one.
    pub fn special_token_id(&self, content: &str) -> Option<u32> {
        self.inner
            .get_added_tokens_decoder()
            .iter()
            .find(|(_, t)| t.special && t.content == content)
            .map(|(&id, _)| id)
    }

    /// The prompt's token ids: chat-templated (special tokens come from the template) or plain.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let text = self.apply_chat_template(&[ChatMessage::new("user", prompt)], true)?;
            self.encode(&text, false)
        } else {
            self.encode(prompt, true)
        }
    }
}

/// A GGUF file's `tokenizer.ggml.*` metadata, turned into the `tokenizers` crate's JSON.
struct GgufVocab<'a> {
    path: &'a Path,
    md: &'a HashMap<String, Value>,
}

impl GgufVocab<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.md.get(&format!("tokenizer.ggml.{k}"))
    }

    fn strings(&self, k: &str) -> Option<Vec<String>> {
        self.get(k)?
            .as_array()?
            .iter()
            .map(|v| v.as_str().map(String::from))
            .collect()
    }

    fn id(&self, k: &str) -> Option<u32> {
        self.get(k).and_then(Value::as_u64).map(|v| v as u32)
    }

    /// GPT-2's byte-level BPE (Llama 3, Qwen), with the pre-tokenizer `tokenizer.ggml.pre` names.
    fn byte_level_bpe(&self, vocab: serde_json::Map<String, Json>) -> Result<Json> {
        let merges = self
            .strings("merges")
            .ok_or_else(|| tok_err(self.path, "BPE vocabulary without tokenizer.ggml.merges"))?;
        let pre_name = self.get("pre").and_then(Value::as_str).unwrap_or("default");
        let (pre, ignore_merges) = byte_level_pre_tokenizer(pre_name).ok_or_else(|| {
            tok_err(
                self.path,
                format!("unknown pre-tokenizer {pre_name:?} (tokenizer.ggml.pre)"),
            )
        })?;
        Ok(json!({
            "normalizer": if pre_name == "qwen2" { json!({"type": "NFC"}) } else { Json::Null },
            "pre_tokenizer": pre,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
        }))
    }

    /// SentencePiece's vocabulary with scores (Llama 2, Gemma), as a BPE with byte fallback.
    fn sentencepiece(
        &self,
        vocab: serde_json::Map<String, Json>,
        tokens: &[String],
        types: &[u64],
    ) -> Result<Json> {
        let scores: Vec<f64> = self
            .get("scores")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect())
            .ok_or_else(|| {
                tok_err(
                    self.path,
                    "SentencePiece vocabulary without tokenizer.ggml.scores",
                )
            })?;
        let unk = self
            .id("unknown_token_id")
            .map(|i| tokens[i as usize].clone());
        // SentencePiece prefixes a space unless the model says not to (Gemma).
        let prefix_space = self
            .get("add_space_prefix")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let mut normalizers =
            vec![json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"})];
        if prefix_space {
            normalizers.insert(0, json!({"type": "Prepend", "prepend": "\u{2581}"}));
        }
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if prefix_space {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        Ok(json!({
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": null,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                      "vocab": vocab, "merges": merges_from_scores(tokens, &scores, types)},
        }))
    }
}

/// The control (3) and user-defined (4) tokens, as `tokenizer.json`'s added tokens.
fn added_tokens(tokens: &[String], types: &[u64]) -> Vec<Json> {
    tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": types[i] == 3})
        })
        .collect()
}

/// A post-processor that puts the beginning-of-sequence token `t` (id `id`) first.
fn bos_first(t: &str, id: u32) -> Json {
    json!({"type": "TemplateProcessing",
           "single": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {t.to_string(): {"id": t, "ids": [id], "tokens": [t]}}})
}

/// Pre-tokenizers of the byte-level BPE vocabularies, by llama.cpp's `tokenizer.ggml.pre` name.
/// Returns the pre-tokenizer and whether whole words found in the vocabulary skip the merges.
fn byte_level_pre_tokenizer(name: &str) -> Option<(Json, bool)> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let split_then_bytes = |re: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
    };
    let gpt2 = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    Some(match name {
        "gpt2" | "default" | "starcoder" | "gpt-2" => (gpt2, false),
        "smollm" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, gpt2]}),
            false,
        ),
        "llama-bpe" | "llama3" => (split_then_bytes(LLAMA3), true),
        "qwen2" => (split_then_bytes(QWEN2), false),
        _ => return None,
    })
}

/// SentencePiece vocabularies carry scores, not merges: a merge (a, b) exists wherever a, b and
/// a+b are all pieces, ranked by the score of a+b (best first), as SentencePiece's BPE applies them.
fn merges_from_scores(tokens: &[String], scores: &[f64], types: &[u64]) -> Vec<Json> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id).copied().unwrap_or(1) != 1 || piece.chars().count() < 2 {
            continue;
        }
        for (cut, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(cut);
            if let (Some(&ia), Some(&ib)) = (ids.get(a), ids.get(b)) {
                merges.push((-scores.get(id).copied().unwrap_or(0.0), id, ia, ib));
            }
        }
    }
    merges.sort_by(|x, y| x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal));
    merges
        .into_iter()
        .map(|(_, _, a, b)| json!([tokens[a], tokens[b]]))
        .collect()
}

/// Renders a chat template as transformers does: `messages` and `tools` (None: undefined)
/// in its shapes (`tools::template_messages`, `tools::template_tools`).
pub fn render_chat(
    template: &str,
    messages: &[Json],
    tools: Option<&[Json]>,
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    minijinja_contrib::add_to_environment(&mut env);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| Error::Template(e.to_string()))?;
    let t = env
        .get_template("chat")
        .map_err(|e| Error::Template(e.to_string()))?;
    t.render(minijinja::context! {
        messages => messages,
        tools => tools,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token.unwrap_or(""),
        eos_token => eos_token.unwrap_or(""),
    })
    .map_err(|e| Error::Template(e.to_string()))
}
