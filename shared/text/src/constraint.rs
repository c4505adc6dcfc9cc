//! Constrained decoding: a request's output held to a JSON schema, any JSON object, a regular
//! expression or a Lark grammar. llguidance compiles a constraint against the model's
//! vocabulary into a matcher; at each step the matcher gives the tokens that keep the output a
//! prefix of a valid one (a bit mask over the vocabulary), and follows the token chosen.
//!
//! Invariants: one [`Grammars`] per model (its token trie is built once, then shared by every
//! request's matcher); a mask never allows a token that would make the output invalid; the
//! model's end-of-sequence tokens are allowed exactly where the output is complete; in JSON
//! (a JSON constraint, or the `%json` parts of a grammar, as in tool calls) no object repeats a
//! key, which no grammar can say of keys it does not name (`json_keys`).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::ParserFactory;

pub use llmq_protocol::Constraint;

use crate::error::{Error, Result};
use crate::json_keys::{quote_tokens, KeyGuard, QuoteTokens};
use crate::Tokenizer;

/// The most bytes of a constraint's text (schema, pattern or grammar) accepted.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;

/// The vocabulary as llguidance sees it: each token's bytes in a trie.
struct Vocabulary {
    trie: TokTrie,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Only used for text a grammar forces: the trie's greedy split is a valid tokenization.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles constraints for one model.
pub struct Grammars {
    factory: ParserFactory,
    /// Mask words per row: the model's vocabulary (its logits' width) in 32-token words.
    words: usize,
    /// The tokens holding a quote, for the key guard.
    quotes: QuoteTokens,
}

impl Grammars {
    /// `vocab_size`: the model's output width, which may exceed the tokenizer's ids (those
    /// extra ids are never allowed); `eos`: the ids that end a sequence.
    pub fn new(tok: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let pieces = tok.token_bytes()?;
        let vocab_size = vocab_size.max(pieces.len());
        let first_eos = *eos.first().ok_or_else(|| {
            Error::InvalidRequest("constrained decoding needs an end-of-sequence token".into())
        })?;
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(vocab_size);
        for (id, (bytes, special)) in pieces.into_iter().enumerate() {
            // Special tokens are set apart (marker first) so that no text ever matches them;
            // ids without a token get a name nothing can produce.
            let marked = |b: &[u8]| [&[TokTrie::SPECIAL_TOKEN_MARKER][..], b].concat();
            words.push(match (special, bytes.is_empty()) {
                (false, false) => bytes,
                (true, false) => marked(&bytes),
                (_, true) => marked(format!("<[{id}]>").as_bytes()),
            });
        }
        while words.len() < vocab_size {
            words.push(
                [
                    &[TokTrie::SPECIAL_TOKEN_MARKER][..],
                    format!("<[{}]>", words.len()).as_bytes(),
                ]
                .concat(),
            );
        }
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let quotes = quote_tokens(words.len(), |id| &words[id as usize]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Vocabulary { trie });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::InvalidRequest(format!("constrained decoding: {e}")))?;
        factory.quiet();
        Ok(Grammars {
            factory,
            words: vocab_size.div_ceil(32),
            quotes,
        })
    }

    /// Mask words per row (32 tokens each).
    pub fn mask_words(&self) -> usize {
        self.words
    }

    /// A new matcher for `c`: a constraint the library rejects (bad schema, pattern or
    /// grammar, or one too large) is an invalid request with its reason.
    pub fn matcher(&self, c: &Constraint) -> Result<Matcher> {
        let bad = |m: String| Error::InvalidRequest(m);
        let size = match c {
            Constraint::JsonObject => 0,
            Constraint::JsonSchema { schema } => schema.len(),
            Constraint::Regex { pattern } => pattern.len(),
            Constraint::Lark { grammar } => grammar.len(),
        };
        if size > MAX_CONSTRAINT_BYTES {
            return Err(bad(format!(
                "the constraint is {size} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted"
            )));
        }
        let grammar = match c {
            Constraint::JsonObject => json_grammar(serde_json::json!({"type": "object"})),
            Constraint::JsonSchema { schema } => json_grammar(
                serde_json::from_str(schema)
                    .map_err(|e| bad(format!("the JSON schema is not JSON: {e}")))?,
            ),
            Constraint::Regex { pattern } => TopLevelGrammar::from_regex(pattern),
            Constraint::Lark { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
        };
        // The library reports a bad constraint as an error; a panic inside it is one too.
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|_| bad(format!("the {} could not be compiled", kind(c))))?
        .map_err(|e| bad(format!("the {} was rejected: {e}", kind(c))))?;
        let inner = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = inner.get_error() {
            return Err(bad(format!("the {} was rejected: {e}", kind(c))));
        }
        // JSON is held to distinct keys; so are the JSON parts of a grammar (`%json`), which
        // is how llmq writes tool calls.
        let json = match c {
            Constraint::JsonObject | Constraint::JsonSchema { .. } => true,
            Constraint::Lark { grammar } => grammar.contains("%json"),
            Constraint::Regex { .. } => false,
        };
        let guard = json.then(|| {
            (
                KeyGuard::default(),
                self.quotes.clone(),
                self.factory.tok_env().clone(),
            )
        });
        Ok(Matcher {
            inner,
            words: self.words,
            guard,
        })
    }
}

/// A JSON schema's grammar, in llmq's JSON layout.
fn json_grammar(mut schema: serde_json::Value) -> TopLevelGrammar {
    crate::schema::with_layout(&mut schema);
    TopLevelGrammar::from_json_schema(schema)
}

fn kind(c: &Constraint) -> &'static str {
    match c {
        Constraint::JsonObject | Constraint::JsonSchema { .. } => "JSON schema",
        Constraint::Regex { .. } => "regular expression",
        Constraint::Lark { .. } => "grammar",
    }
}

/// One request's position in its constraint.
pub struct Matcher {
    inner: llguidance::Matcher,
    words: usize,
    /// For JSON: the output's keys so far, the tokens that may close a key, the vocabulary.
    guard: Option<(KeyGuard, QuoteTokens, TokEnv)>,
}

impl Matcher {
    /// The tokens allowed next, written into `mask` ([`Grammars::mask_words`] words): bit `i % 32`
    /// of word `i / 32` is set when token `i` is allowed. Once the output is complete only the
    /// end-of-sequence tokens are. An error: the output cannot be continued validly.
    pub fn allowed(&mut self, mask: &mut [u32]) -> Result<(), String> {
        // A matcher stopped by a limit or an error (not by a complete output) would allow only
        // the end of sequence: that must not end an incomplete output.
        let reason = self.inner.stop_reason();
        if !reason.is_ok() {
            return Err(format!(
                "the constraint's parser stopped: {}",
                self.inner.get_error().unwrap_or_else(|| reason.to_string())
            ));
        }
        let vob = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let bits = vob.as_slice();
        let n = self.words.min(mask.len());
        mask[..n]
            .iter_mut()
            .zip(bits.iter().chain(std::iter::repeat(&0)))
            .for_each(|(m, b)| *m = *b);
        mask[n..].iter_mut().for_each(|m| *m = 0);
        if let Some((keys, quotes, _)) = &self.guard {
            keys.restrict(mask, quotes);
        }
        if mask.iter().all(|&w| w == 0) {
            return Err("no token can continue the output within its constraint".into());
        }
        Ok(())
    }

    /// Follows the token chosen (one the last mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.inner.is_stopped() {
            // Complete: only an end of sequence was allowed, and it ends the request.
            return Ok(());
        }
        if let Some((keys, _, env)) = &mut self.guard {
            keys.accept(env.tok_trie().token(token));
        }
        self.inner.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the output so far is complete and nothing more may follow.
    pub fn is_complete(&self) -> bool {
        self.inner.is_stopped()
    }
}
