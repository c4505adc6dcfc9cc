//! The key guard: no JSON object in a constrained output names a key twice.
//!
//! A grammar cannot say "distinct keys" for properties it does not name (`json_object`, an open
//! schema's additional properties): llguidance lets such an object repeat a key for as long as
//! the model likes. The guard follows the output's JSON as it is written (`accept`) and, at every
//! step, takes out of the grammar's mask each token that would close a key string already used
//! in its object (`restrict`). Only tokens holding a quote can close a key, so it looks at those
//! alone; a key is compared decoded (`"\u0061"` is `"a"`).
//!
//! Text outside JSON (a tool call's markers) passes through: a `{` or `[` there opens a JSON
//! value, and the guard follows it until it closes. The lexer is one function over `Frames`,
//! which the output's own frames implement and a token's trial (`Trial`) overlays without
//! copying them.

use std::collections::HashSet;
use std::sync::Arc;

/// One open container of the output.
#[derive(Debug, Clone, Default)]
struct Frame {
    object: bool,
    /// An object's next string is a key (after `{` or `,`, until `:`).
    expect_key: bool,
    keys: HashSet<String>,
}

/// Where the lexer is.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
enum Lex {
    /// Between values, or outside any JSON.
    #[default]
    Text,
    /// In a string: a key's or a value's; after a backslash.
    Str { key: bool, escape: bool },
}

/// What the lexer needs of the frames it runs over.
trait Frames {
    fn push(&mut self, object: bool);
    fn pop(&mut self);
    fn depth(&self) -> usize;
    fn top_object(&self) -> bool;
    fn expect_key(&self) -> bool;
    fn set_expect_key(&mut self, v: bool);
    /// Adds a key to the innermost object; false if it was there already.
    fn insert_key(&mut self, key: String) -> bool;
}

/// A finished key's text: its JSON escapes decoded.
fn key_text(raw: &[u8]) -> String {
    if !raw.contains(&b'\\') {
        return String::from_utf8_lossy(raw).into_owned();
    }
    let quoted = [&b"\""[..], raw, b"\""].concat();
    serde_json::from_slice::<String>(&quoted)
        .unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned())
}

/// Runs `bytes` through the lexer; false if a key repeated in its object (the bytes are
/// followed to their end all the same).
fn feed(bytes: &[u8], frames: &mut impl Frames, lex: &mut Lex, key: &mut Vec<u8>) -> bool {
    let mut distinct = true;
    for &b in bytes {
        match *lex {
            Lex::Str {
                key: in_key,
                escape: true,
            } => {
                *lex = Lex::Str {
                    key: in_key,
                    escape: false,
                };
                if in_key {
                    key.push(b);
                }
            }
            Lex::Str {
                key: in_key,
                escape: false,
            } => match b {
                b'"' => {
                    *lex = Lex::Text;
                    if in_key {
                        distinct &= frames.insert_key(key_text(key));
                    }
                    key.clear();
                }
                _ => {
                    if b == b'\\' {
                        *lex = Lex::Str {
                            key: in_key,
                            escape: true,
                        };
                    }
                    if in_key {
                        key.push(b);
                    }
                }
            },
            Lex::Text => match b {
                b'"' => {
                    let in_key = frames.depth() > 0 && frames.top_object() && frames.expect_key();
                    *lex = Lex::Str {
                        key: in_key,
                        escape: false,
                    };
                    key.clear();
                }
                b'{' => frames.push(true),
                b'[' => frames.push(false),
                b'}' | b']' if frames.depth() > 0 => frames.pop(),
                b':' if frames.depth() > 0 && frames.top_object() => frames.set_expect_key(false),
                b',' if frames.depth() > 0 && frames.top_object() => frames.set_expect_key(true),
                _ => {}
            },
        }
    }
    distinct
}

impl Frames for Vec<Frame> {
    fn push(&mut self, object: bool) {
        Vec::push(
            self,
            Frame {
                object,
                expect_key: object,
                keys: HashSet::new(),
            },
        );
    }
    fn pop(&mut self) {
        Vec::pop(self);
    }
    fn depth(&self) -> usize {
        self.len()
    }
    fn top_object(&self) -> bool {
        self.last().is_some_and(|f| f.object)
    }
    fn expect_key(&self) -> bool {
        self.last().is_some_and(|f| f.expect_key)
    }
    fn set_expect_key(&mut self, v: bool) {
        if let Some(f) = self.last_mut() {
            f.expect_key = v;
        }
    }
    fn insert_key(&mut self, key: String) -> bool {
        self.last_mut().is_none_or(|f| f.keys.insert(key))
    }
}

/// A token's trial over the output's frames: frames the token opens are its own, and what it
/// does to the output's frames (closing them, adding keys) is noted beside them.
struct Trial<'a> {
    base: &'a [Frame],
    /// The output's frames still open in the trial.
    open: usize,
    /// `expect_key` of the output's innermost open frame, where the trial changed it.
    top_expect: Option<bool>,
    own: Vec<Frame>,
    /// Keys the trial added to the output's frames: (frame index, key).
    added: Vec<(usize, String)>,
}

impl Frames for Trial<'_> {
    fn push(&mut self, object: bool) {
        Frames::push(&mut self.own, object);
    }
    fn pop(&mut self) {
        if self.own.pop().is_none() {
            self.open = self.open.saturating_sub(1);
            self.top_expect = None;
        }
    }
    fn depth(&self) -> usize {
        self.open + self.own.len()
    }
    fn top_object(&self) -> bool {
        match self.own.last() {
            Some(f) => f.object,
            None => self.open > 0 && self.base[self.open - 1].object,
        }
    }
    fn expect_key(&self) -> bool {
        match self.own.last() {
            Some(f) => f.expect_key,
            None => {
                self.open > 0
                    && self
                        .top_expect
                        .unwrap_or(self.base[self.open - 1].expect_key)
            }
        }
    }
    fn set_expect_key(&mut self, v: bool) {
        match self.own.last_mut() {
            Some(f) => f.expect_key = v,
            None => self.top_expect = Some(v),
        }
    }
    fn insert_key(&mut self, key: String) -> bool {
        if !self.own.is_empty() {
            return self.own.insert_key(key);
        }
        let Some(at) = self.open.checked_sub(1) else {
            return true;
        };
        if self.base[at].keys.contains(&key)
            || self.added.iter().any(|(i, k)| *i == at && *k == key)
        {
            return false;
        }
        self.added.push((at, key));
        true
    }
}

/// The tokens that can close a string: each holding a quote, with its bytes.
pub type QuoteTokens = Arc<Vec<(u32, Box<[u8]>)>>;

/// The tokens of a vocabulary (`bytes(id)` for every id below `n`) that hold a quote.
pub fn quote_tokens<'a>(n: usize, bytes: impl Fn(u32) -> &'a [u8]) -> QuoteTokens {
    Arc::new(
        (0..n as u32)
            .filter(|&id| bytes(id).contains(&b'"'))
            .map(|id| (id, bytes(id).into()))
            .collect(),
    )
}

/// One output's JSON as far as it is written, and the keys of its open objects.
#[derive(Debug, Clone, Default)]
pub struct KeyGuard {
    frames: Vec<Frame>,
    lex: Lex,
    /// The key being written (raw, escapes undecoded).
    key: Vec<u8>,
}

impl KeyGuard {
    /// Follows the output's next bytes. False if they repeat a key (a token `restrict` would
    /// have taken out); the guard then goes on from after them.
    pub fn accept(&mut self, bytes: &[u8]) -> bool {
        feed(bytes, &mut self.frames, &mut self.lex, &mut self.key)
    }

    /// Whether `bytes` next would repeat a key.
    pub fn repeats(&self, bytes: &[u8]) -> bool {
        let mut trial = Trial {
            base: &self.frames,
            open: self.frames.len(),
            top_expect: None,
            own: vec![],
            added: vec![],
        };
        let (mut lex, mut key) = (self.lex, self.key.clone());
        !feed(bytes, &mut trial, &mut lex, &mut key)
    }

    /// Clears, in `mask` (bit `i % 32` of word `i / 32` for token `i`), the tokens among
    /// `quotes` that would repeat a key.
    pub fn restrict(&self, mask: &mut [u32], quotes: &[(u32, Box<[u8]>)]) {
        for (id, bytes) in quotes {
            let (word, bit) = (*id as usize / 32, 1u32 << (id % 32));
            if mask.get(word).is_some_and(|w| w & bit != 0) && self.repeats(bytes) {
                mask[word] &= !bit;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(text: &str) -> KeyGuard {
        let mut g = KeyGuard::default();
        assert!(g.accept(text.as_bytes()), "{text}");
        g
    }

    #[test]
    fn a_key_cannot_close_twice_in_one_object() {
        let g = written(r#"{"a": 1, "b": {"a": [1, {"x": "a\"}"}]}, "c": 2, ""#);
        // Back in the outer object, expecting its fourth key.
        assert!(g.repeats(br#"a""#) && g.repeats(br#"b":"#) && g.repeats(br#"c""#));
        assert!(!g.repeats(br#"d""#) && !g.repeats(br#"ab""#) && !g.repeats(b"a"));
        // Escapes are decoded: \u0061 is a.
        assert!(g.repeats(br#"\u0061""#));
        // A value string is no key: its text may repeat a key's.
        let g = written(r#"{"a": ""#);
        assert!(!g.repeats(br#"a""#));
        // A token that finishes a value and starts and closes a key.
        let g = written(r#"{"a": "x"#);
        assert!(g.repeats(br#"", "a""#) && !g.repeats(br#"", "b""#));
        // Keys of a nested object the token itself opens are its own.
        let g = written(r#"{"a": "#);
        assert!(!g.repeats(br#"{"a""#) && g.repeats(br#"{"b": 1, "b""#));
        // A token closing the inner object goes back to the outer one's keys.
        let g = written(r#"{"a": {"b": 1"#);
        assert!(g.repeats(br#"}, "a""#) && !g.repeats(br#"}, "b""#));
    }

    #[test]
    fn text_around_json_and_arrays_pass() {
        let g = written(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": 1}}\n</tool_call>\n<tool_call>\n{\"",
        );
        assert!(!g.repeats(br#"name""#), "a new call is a new object");
        let g = written(r#"[{"a": 1}, {""#);
        assert!(!g.repeats(br#"a""#));
        let g = written(r#"["a", ""#);
        assert!(!g.repeats(br#"a""#), "array items are values");
    }

    #[test]
    fn restrict_clears_only_repeating_tokens() {
        let quotes = quote_tokens(4, |id| [&b"a\""[..], b"b\"", b"c", b"a\":"][id as usize]);
        assert_eq!(
            quotes.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            vec![0, 1, 3]
        );
        let g = written(r#"{"a": 1, ""#);
        let mut mask = [0b1111u32];
        g.restrict(&mut mask, &quotes);
        assert_eq!(mask, [0b0110]);
        // The output went on past a repeat anyway: reported, and followed.
        let mut g = written(r#"{"a": 1, ""#);
        assert!(!g.accept(b"a\": 2, \""));
        assert!(g.repeats(b"a\""));
    }
}
