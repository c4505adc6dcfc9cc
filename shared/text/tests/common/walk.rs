//! A random walk through a constraint's allowed tokens, shared by the tests of constraints
//! (here) and of tool calls (the gateway's, through `#[path]`): at each step a random allowed
//! token, mostly one that `closes` says ends something, so that walks end; the end of sequence
//! as soon as it is allowed.

use llmq_text::constraint::{Constraint, Grammars};
use llmq_text::Tokenizer;

/// The walk's token ids, without the end of sequence; None when it did not end within `limit`
/// tokens. `closes(bytes, special)`: whether a token's bytes (and whether it is special) close
/// something, a string, an object or a call.
pub fn walk(
    g: &Grammars,
    tok: &Tokenizer,
    c: &Constraint,
    eos: &[u32],
    seed: u64,
    limit: usize,
    closes: &dyn Fn(&[u8], bool) -> bool,
) -> Option<Vec<u32>> {
    let mut m = g.matcher(c).unwrap();
    let mut mask = vec![0u32; g.mask_words()];
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let bytes = tok.token_bytes().unwrap();
    let mut ids = vec![];
    for _ in 0..limit {
        m.allowed(&mut mask).unwrap();
        let options: Vec<u32> = (0..mask.len() as u32 * 32)
            .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
            .collect();
        assert!(!options.is_empty(), "a constraint with no token allowed");
        if let Some(&e) = options.iter().find(|t| eos.contains(t)) {
            m.accept(e).unwrap();
            return Some(ids);
        }
        let closing: Vec<u32> = options
            .iter()
            .copied()
            .filter(|&t| closes(&bytes[t as usize].0, bytes[t as usize].1))
            .collect();
        let pool = if !closing.is_empty() && next(10) < 8 {
            &closing
        } else {
            &options
        };
        let t = pool[next(pool.len())];
        ids.push(t);
        m.accept(t).unwrap();
    }
    None
}
