//! Tool calls out of a model's output as it streams, in the syntax intake named
//! ([`ToolSyntax`]): text becomes content and whole calls, each call released as soon as its
//! JSON is complete, so a streamed answer carries each call in one delta.
//!
//! Invariants: text that may still turn out to be a call's marker is held back until it can
//! be told apart; content plus the calls' source text accounts for all the output (a block that
//! does not parse as a call is given back as content, never dropped), except that an output cut
//! by `max_tokens` drops the call it was writing (and a marker's beginning): a cut call is no
//! call, and its syntax is not the answer's text; whitespace around calls is not content.

use llmq_protocol::ToolSyntax;
use serde_json::Value;

/// One call parsed out of the output.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// Its position among the answer's calls.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// JSON text of an object.
    pub arguments: String,
}

/// What a piece of output turned into.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<Call>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Before the first visible character (Llama 3's JSON calls are the whole answer).
    Start,
    Content,
    /// Inside a call's block (Hermes), or past the marker of a list of calls (Mistral), or in a
    /// JSON call (Llama 3).
    Call,
}

pub struct ToolCallParser {
    syntax: ToolSyntax,
    state: State,
    /// Output received and not released yet.
    pending: String,
    calls: usize,
    /// No content since the last call: whitespace is dropped.
    after_call: bool,
    /// The output was cut (`max_tokens`): what was held back as a possible call is dropped.
    cut: bool,
    ids: std::collections::hash_map::RandomState,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

/// Length of the longest end of `text` that begins `marker` (text to hold back).
fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// The first JSON value at the start of `text` (after whitespace) and the bytes it spans;
/// Ok(None) while it is incomplete.
fn json_prefix(text: &str) -> Result<Option<(Value, usize)>, ()> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match values.next() {
        Some(Ok(v)) => Ok(Some((v, values.byte_offset()))),
        Some(Err(e)) if e.is_eof() => Ok(None),
        None => Ok(None),
        Some(Err(_)) => Err(()),
    }
}

impl ToolCallParser {
    pub fn new(syntax: ToolSyntax) -> Self {
        let state = if syntax == ToolSyntax::Llama3Json {
            State::Start
        } else {
            State::Content
        };
        ToolCallParser {
            syntax,
            state,
            pending: String::new(),
            calls: 0,
            after_call: false,
            cut: false,
            ids: Default::default(),
        }
    }

    /// Whether any call has been parsed.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Takes the next piece of output.
    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut out = Parsed::default();
        self.advance(&mut out, false);
        out
    }

    /// The output ended: releases what was held back. An unfinished call whose JSON is complete
    /// is a call; otherwise it is content, or, where the output was `cut` short by `max_tokens`,
    /// dropped.
    pub fn finish(&mut self, cut: bool) -> Parsed {
        self.cut = cut;
        let mut out = Parsed::default();
        self.advance(&mut out, true);
        let rest = std::mem::take(&mut self.pending);
        self.content(&mut out, &rest);
        out
    }

    /// Text of a call left unfinished at the output's end: content, unless the output was cut.
    fn unfinished(&mut self, out: &mut Parsed, raw: &str) {
        if !self.cut {
            self.content(out, raw);
        }
    }

    /// A call id: 9 letters and digits (what Mistral's template demands; any template takes it).
    fn id(&self) -> String {
        use std::hash::{BuildHasher, Hasher};
        let mut h = self.ids.build_hasher();
        h.write_usize(self.calls);
        let mut x = h.finish();
        const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
        (0..9)
            .map(|_| {
                let c = DIGITS[(x % 62) as usize] as char;
                x /= 62;
                c
            })
            .collect()
    }

    /// A call from its JSON (`{"name": .., "arguments"|"parameters": {..}}`), if it is one.
    fn call(&mut self, v: &Value) -> Option<Call> {
        let name = v.get("name")?.as_str()?.to_string();
        let args = v
            .get("arguments")
            .or_else(|| v.get("parameters"))
            .cloned()
            .unwrap_or(Value::Object(Default::default()));
        let arguments = match args {
            Value::String(s) => s,
            other => other.to_string(),
        };
        let call = Call {
            index: self.calls,
            id: self.id(),
            name,
            arguments,
        };
        self.calls += 1;
        self.after_call = true;
        Some(call)
    }

    /// Adds content; whitespace next to calls is not content.
    fn content(&mut self, out: &mut Parsed, text: &str) {
        let text = if self.after_call {
            text.trim_start()
        } else {
            text
        };
        self.after_call &= text.is_empty();
        out.content.push_str(text);
    }

    fn advance(&mut self, out: &mut Parsed, ended: bool) {
        loop {
            let progressed = match (self.syntax, self.state) {
                (_, State::Start) => self.start(ended),
                (ToolSyntax::Hermes, State::Content) => self.until_marker(out, HERMES_OPEN, ended),
                (ToolSyntax::Mistral, State::Content) => {
                    self.until_marker(out, MISTRAL_OPEN, ended)
                }
                (ToolSyntax::Llama3Json, State::Content) => {
                    let all = std::mem::take(&mut self.pending);
                    self.content(out, &all);
                    false
                }
                (ToolSyntax::Hermes, State::Call) => self.hermes_block(out, ended),
                (_, State::Call) => self.json_calls(out, ended),
            };
            if !progressed {
                return;
            }
        }
    }

    /// Llama 3: a call is the whole answer, after an optional `<|python_tag|>`.
    fn start(&mut self, ended: bool) -> bool {
        let trimmed = self.pending.trim_start();
        let trimmed = trimmed
            .strip_prefix(PYTHON_TAG)
            .unwrap_or(trimmed)
            .trim_start();
        if ended && self.cut && PYTHON_TAG.starts_with(trimmed) {
            self.pending.clear();
            self.state = State::Content;
            return true;
        }
        if trimmed.is_empty() || (PYTHON_TAG.starts_with(trimmed) && !ended) {
            if ended {
                self.state = State::Content;
                return true;
            }
            return false;
        }
        if trimmed.starts_with('{') {
            self.pending = trimmed.to_string();
            self.state = State::Call;
        } else {
            self.state = State::Content;
        }
        true
    }

    /// Content up to `marker`, then the calls; holds back a possible marker's beginning.
    fn until_marker(&mut self, out: &mut Parsed, marker: &str, ended: bool) -> bool {
        if let Some(at) = self.pending.find(marker) {
            let before = self.pending[..at].to_string();
            self.content(out, &before);
            self.pending.drain(..at + marker.len());
            self.state = State::Call;
            return true;
        }
        let keep = if ended && !self.cut {
            0
        } else {
            partial_marker(&self.pending, marker)
        };
        let release: String = self.pending.drain(..self.pending.len() - keep).collect();
        self.content(out, &release);
        if ended {
            self.pending.clear();
        }
        false
    }

    /// Hermes: `{..}` up to `</tool_call>` (or the end of the output).
    fn hermes_block(&mut self, out: &mut Parsed, ended: bool) -> bool {
        let end = match self.pending.find(HERMES_CLOSE) {
            Some(at) => at,
            None if ended => self.pending.len(),
            None => return false,
        };
        let body = self.pending[..end].to_string();
        let closed = end < self.pending.len();
        let parsed = serde_json::from_str::<Value>(body.trim())
            .ok()
            .and_then(|v| self.call(&v));
        match parsed {
            Some(c) => out.calls.push(c),
            None if closed => self.content(out, &format!("{HERMES_OPEN}{body}{HERMES_CLOSE}")),
            None => self.unfinished(out, &format!("{HERMES_OPEN}{body}")),
        }
        self.pending
            .drain(..(end + HERMES_CLOSE.len()).min(self.pending.len()));
        self.state = State::Content;
        true
    }

    /// Mistral's list of calls, or Llama 3's call objects (separated by `;`).
    fn json_calls(&mut self, out: &mut Parsed, ended: bool) -> bool {
        let restore = |p: &Self| {
            if p.syntax == ToolSyntax::Mistral {
                MISTRAL_OPEN
            } else {
                ""
            }
        };
        match json_prefix(&self.pending) {
            Ok(Some((v, used))) => {
                let items = match &v {
                    Value::Array(items) => items.clone(),
                    one => vec![one.clone()],
                };
                let calls: Option<Vec<Call>> = items.iter().map(|i| self.call(i)).collect();
                match calls {
                    Some(calls) => out.calls.extend(calls),
                    None => {
                        let raw = format!("{}{}", restore(self), &self.pending[..used]);
                        self.content(out, &raw);
                    }
                }
                self.pending.drain(..used);
                let rest = self.pending.trim_start();
                let rest = rest
                    .strip_prefix(';')
                    .unwrap_or(rest)
                    .trim_start()
                    .to_string();
                self.pending = rest;
                // Llama 3: another call may follow; Mistral: text after the list is content.
                if self.syntax == ToolSyntax::Mistral || !self.pending.starts_with('{') {
                    self.state = State::Content;
                }
                !self.pending.is_empty() || self.state == State::Content
            }
            Ok(None) if !ended => false,
            Ok(None) => {
                let raw = format!("{}{}", restore(self), std::mem::take(&mut self.pending));
                self.unfinished(out, &raw);
                self.state = State::Content;
                true
            }
            Err(()) => {
                let raw = format!("{}{}", restore(self), std::mem::take(&mut self.pending));
                self.content(out, &raw);
                self.state = State::Content;
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `step` bytes (on character boundaries), then finishes.
    fn parse(syntax: ToolSyntax, text: &str, step: usize) -> Parsed {
        let mut p = ToolCallParser::new(syntax);
        let mut all = Parsed::default();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            let got = p.push(&rest[..cut]);
            all.content.push_str(&got.content);
            all.calls.extend(got.calls);
            rest = &rest[cut..];
        }
        let got = p.finish(false);
        all.content.push_str(&got.content);
        all.calls.extend(got.calls);
        all
    }

    fn names_args(p: &Parsed) -> Vec<(String, Value)> {
        p.calls
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
            .collect()
    }

    #[test]
    fn hermes_blocks_between_content_at_any_split() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            let p = parse(ToolSyntax::Hermes, text, step);
            assert_eq!(p.content, "Let me look.\n", "step {step}");
            assert_eq!(
                names_args(&p),
                vec![
                    ("weather".into(), serde_json::json!({"city": "Paris"})),
                    ("time".into(), serde_json::json!({}))
                ]
            );
            assert_eq!(
                p.calls.iter().map(|c| c.index).collect::<Vec<_>>(),
                vec![0, 1]
            );
            assert!(p
                .calls
                .iter()
                .all(|c| c.id.len() == 9 && c.id.chars().all(|ch| ch.is_ascii_alphanumeric())));
            assert_ne!(p.calls[0].id, p.calls[1].id);
        }
    }

    #[test]
    fn text_that_only_looks_like_a_marker_stays_content() {
        for step in [1, 4, 100] {
            let p = parse(ToolSyntax::Hermes, "a <tool is < than b <tool_cal", step);
            assert_eq!(
                (p.content.as_str(), p.calls.len()),
                ("a <tool is < than b <tool_cal", 0)
            );
            let p = parse(
                ToolSyntax::Hermes,
                "x<tool_call>{not json}</tool_call>y",
                step,
            );
            assert_eq!(
                (p.content.as_str(), p.calls.len()),
                ("x<tool_call>{not json}</tool_call>y", 0)
            );
        }
        // A block the output's end cut short is content, unless its JSON is whole.
        let p = parse(
            ToolSyntax::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"argu",
            3,
        );
        assert_eq!(
            (p.content.as_str(), p.calls.len()),
            ("<tool_call>\n{\"name\": \"f\", \"argu", 0)
        );
        let p = parse(
            ToolSyntax::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n",
            3,
        );
        assert_eq!(
            names_args(&p),
            vec![("f".into(), serde_json::json!({"a": 1}))]
        );
    }

    /// Feeds `text` whole, then finishes it as cut by `max_tokens`.
    fn parse_cut(syntax: ToolSyntax, text: &str) -> Parsed {
        let mut p = ToolCallParser::new(syntax);
        let mut all = p.push(text);
        let got = p.finish(true);
        all.content.push_str(&got.content);
        all.calls.extend(got.calls);
        all
    }

    /// A call that `max_tokens` cut short is dropped with its syntax; the calls before it, and
    /// one whose JSON was whole, stay calls.
    #[test]
    fn a_cut_call_never_becomes_content() {
        let whole = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n";
        let p = parse_cut(
            ToolSyntax::Hermes,
            &format!("Hi {whole}<tool_call>\n{{\"name\": \"f\", \"arguments\": {{\"a\""),
        );
        assert_eq!(
            (p.content.as_str(), names_args(&p)),
            ("Hi ", vec![("f".into(), serde_json::json!({"a": 1}))])
        );
        let p = parse_cut(ToolSyntax::Hermes, &format!("{whole}<tool_c"));
        assert_eq!((p.content.as_str(), p.calls.len()), ("", 1));
        let p = parse_cut(
            ToolSyntax::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n",
        );
        assert_eq!((p.content.as_str(), p.calls.len()), ("", 1));
        let p = parse_cut(
            ToolSyntax::Mistral,
            "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\"",
        );
        assert_eq!((p.content.as_str(), p.calls.len()), ("", 0));
        let p = parse_cut(
            ToolSyntax::Llama3Json,
            "<|python_tag|>{\"name\": \"a\", \"param",
        );
        assert_eq!((p.content.as_str(), p.calls.len()), ("", 0));
        let p = parse_cut(ToolSyntax::Llama3Json, "<|python_t");
        assert_eq!((p.content.as_str(), p.calls.len()), ("", 0));
        // Plain text cut short is still the answer's text.
        let p = parse_cut(ToolSyntax::Hermes, "The weather in Par");
        assert_eq!(
            (p.content.as_str(), p.calls.len()),
            ("The weather in Par", 0)
        );
    }

    #[test]
    fn mistral_lists_and_llama_objects() {
        let text = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}, {\"name\": \"b\", \"arguments\": {\"y\": \"]\"}, \"id\": \"abcdefghi\"}]";
        for step in [1, 5, 1000] {
            let p = parse(ToolSyntax::Mistral, text, step);
            assert_eq!(p.content, "");
            assert_eq!(
                names_args(&p),
                vec![
                    ("a".into(), serde_json::json!({"x": [1, 2]})),
                    ("b".into(), serde_json::json!({"y": "]"}))
                ]
            );
        }
        for text in [
            "{\"name\": \"a\", \"parameters\": {\"q\": \"{\"}}",
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"q\": \"{\"}}",
            "  {\"name\": \"a\", \"parameters\": {\"q\": \"{\"}}",
        ] {
            for step in [1, 6, 1000] {
                let p = parse(ToolSyntax::Llama3Json, text, step);
                assert_eq!(
                    (p.content.as_str(), names_args(&p)),
                    ("", vec![("a".into(), serde_json::json!({"q": "{"}))]),
                    "{text:?} by {step}"
                );
            }
        }
        for step in [1, 1000] {
            let p = parse(ToolSyntax::Llama3Json, "The answer is {42}.", step);
            assert_eq!(
                (p.content.as_str(), p.calls.len()),
                ("The answer is {42}.", 0)
            );
            let p = parse(ToolSyntax::Llama3Json, "{\"not\": \"a call\"}", step);
            assert_eq!(
                (p.content.as_str(), p.calls.len()),
                ("{\"not\": \"a call\"}", 0)
            );
        }
    }
}
