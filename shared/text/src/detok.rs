//! Incremental detokenization: turns a growing list of token ids into text pieces.
//!
//! Invariant: a piece is released only when the decoded text does not end in an incomplete
//! UTF-8 sequence (which decodes to U+FFFD), so a multi-byte character split over several
//! byte-level tokens is never cut in half; the concatenated pieces equal the full decode.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

#[derive(Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the window decoded for context (byte-level and SentencePiece decoders need
    /// the token before to know about leading spaces).
    prefix: usize,
    /// Tokens before this index have been released as text.
    read: usize,
    /// Special tokens' text is kept (tool-call markers), not skipped.
    special_text: bool,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A detokenizer that keeps special tokens' text.
    pub fn with_special_text() -> Self {
        Detokenizer {
            special_text: true,
            ..Self::default()
        }
    }

    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.release(tok, false)
    }

    /// Releases whatever is left, replacement characters included.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        self.release(tok, true)
    }

    fn release(&mut self, tok: &Tokenizer, force: bool) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let skip = !self.special_text;
        let before = tok.decode(&self.ids[self.prefix..self.read], skip)?;
        let full = tok.decode(&self.ids[self.prefix..], skip)?;
        if !force && full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let piece = match full.strip_prefix(before.as_str()) {
            Some(rest) => rest.to_string(),
            None => full.chars().skip(before.chars().count()).collect(),
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }
}
