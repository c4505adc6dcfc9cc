//! Token masks on the device: rows of logits restricted to the tokens a constraint allows.
//! Masks come from the host packed 32 tokens to a word (bit `i % 32` of word `i / 32` allows
//! token `i`), so a step uploads a few kilobytes a row; the device unpacks them beside the
//! logits and sets every disallowed token's logit to -inf.

use mlx_rs::ops::{floor_divide, remainder, select};
use mlx_rs::{Array, Dtype};

use crate::error::{EngineError, Result};

/// Where each token's bit sits: its word and its place value within it, for a vocabulary.
pub struct MaskLayout {
    vocab: usize,
    word: Array,
    place: Array,
}

impl MaskLayout {
    pub fn new(vocab: usize) -> Self {
        let word = Array::from_iter((0..vocab).map(|i| (i / 32) as i32), &[vocab as i32]);
        let place = Array::from_iter((0..vocab).map(|i| 1u32 << (i % 32)), &[vocab as i32]);
        MaskLayout { vocab, word, place }
    }

    /// Words per row.
    pub fn words(&self) -> usize {
        self.vocab.div_ceil(32)
    }

    /// `logits` [rows, .., vocab] with every token not allowed by its row's mask at -inf;
    /// `masks`: `words()` words a row, row after row.
    pub fn restrict(&self, logits: &Array, masks: &[u32]) -> Result<Array> {
        let shape = logits.shape().to_vec();
        let rows = shape[0];
        let vocab = *shape.last().unwrap_or(&0) as usize;
        if vocab != self.vocab || masks.len() != rows as usize * self.words() {
            return Err(EngineError::Host(format!(
                "token masks of {} words for {rows} rows of {vocab} logits (expected {} words a row of {})",
                masks.len(),
                self.words(),
                self.vocab
            )));
        }
        let packed = Array::from_slice(masks, &[rows, self.words() as i32]);
        let per_token = packed.take_axis(&self.word, 1)?;
        let bit = remainder(floor_divide(&per_token, &self.place)?, Array::from_int(2).as_dtype(Dtype::Uint32)?)?;
        let allowed = bit.eq(Array::from_int(1).as_dtype(Dtype::Uint32)?)?.reshape(&shape)?;
        let floor = Array::from_f32(f32::NEG_INFINITY).as_dtype(logits.dtype())?;
        Ok(select(&allowed, logits, &floor)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::host_f32;

    #[test]
    fn only_the_allowed_tokens_keep_their_logits() {
        let vocab = 70;
        let layout = MaskLayout::new(vocab);
        assert_eq!(layout.words(), 3);
        let logits = Array::from_iter((0..2 * vocab).map(|i| i as f32), &[2, 1, vocab as i32]);
        // Row 0 allows tokens 0, 31, 32 and 69; row 1 allows everything.
        let masks = [1 | 1 << 31, 1, 1 << 5, u32::MAX, u32::MAX, u32::MAX];
        let out = host_f32(&layout.restrict(&logits, &masks).unwrap()).unwrap();
        for (i, v) in out.iter().enumerate() {
            let (row, tok) = (i / vocab, i % vocab);
            let allowed = row == 1 || [0, 31, 32, 69].contains(&tok);
            assert_eq!(v.is_finite(), allowed, "row {row} token {tok}");
            if allowed {
                assert_eq!(*v, i as f32);
            }
        }
        assert!(layout.restrict(&logits, &masks[..3]).is_err(), "too few words");
    }
}
