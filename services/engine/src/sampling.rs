//! Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty,
//! seeded randomness and top-n logprobs; and the stop conditions of a generation.
//!
//! Invariants: parameters are validated once (`SamplingParams::validate`) into values the
//! sampler can use without further checks; the same seed and logits give the same token.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: usize,
    /// 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub min_p: f32,
    /// 1 means off; > 1 discourages tokens already in the prompt or the output.
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// How many alternatives to report with each token's logprob (0: no logprobs).
    pub top_logprobs: usize,
    pub logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            top_logprobs: 0,
            logprobs: false,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return bad(format!("min_p must be in [0, 1), got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        if self.top_logprobs > 20 {
            return bad(format!("top_logprobs must be at most 20, got {}", self.top_logprobs));
        }
        Ok(())
    }

    /// True when the next token is simply the argmax of the raw logits, which the device can
    /// compute without sending the logits to the host.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0 && !self.wants_logprobs()
    }

    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StopParams {
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub stop: Vec<String>,
    /// Keep going past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for StopParams {
    fn default() -> Self {
        StopParams { max_tokens: 256, stop_token_ids: vec![], stop: vec![], ignore_eos: false }
    }
}

impl StopParams {
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(EngineError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(EngineError::InvalidRequest("stop strings must not be empty".into()));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token id or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// splitmix64: small, fast, and reproducible across platforms for a given seed.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    x.iter().map(|&v| v - lse).collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        Sampler { params, rng: Rng(seed) }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits; `history` is the prompt and output so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> (u32, Option<TokenLogprob>) {
        let p = self.params.clone();
        let mut z = logits.to_vec();
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; z.len()];
            for &t in history {
                if let Some(s) = seen.get_mut(t as usize) {
                    if !*s {
                        *s = true;
                        let v = &mut z[t as usize];
                        *v = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
                    }
                }
            }
        }
        let token = if p.temperature == 0.0 { argmax(&z) } else { self.draw(&z) };
        let lp = p.wants_logprobs().then(|| {
            let ls = log_softmax(&z);
            let mut order: Vec<u32> = (0..ls.len() as u32).collect();
            let n = p.top_logprobs.min(ls.len());
            if n > 0 {
                order.select_nth_unstable_by(n - 1, |&a, &b| ls[b as usize].total_cmp(&ls[a as usize]));
                order.truncate(n);
                order.sort_by(|&a, &b| ls[b as usize].total_cmp(&ls[a as usize]));
            } else {
                order.clear();
            }
            TokenLogprob { token, logprob: ls[token as usize], top: order.iter().map(|&i| (i, ls[i as usize])).collect() }
        });
        (token, lp)
    }

    fn draw(&mut self, z: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut cand: Vec<(u32, f64)> =
            z.iter().enumerate().map(|(i, &v)| (i as u32, (((v - max) * inv_t) as f64).exp())).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        if p.min_p > 0.0 {
            let floor = cand[0].1 * p.min_p as f64;
            cand.retain(|c| c.1 >= floor);
        }
        if p.top_p < 1.0 {
            let total: f64 = cand.iter().map(|c| c.1).sum();
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.next_f64() * total;
        for c in &cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand.last().map(|c| c.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams { temperature: t, seed: Some(7), ..Default::default() }
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[]).0, 1);
    }

    #[test]
    fn repetition_penalty_moves_greedy_off_a_seen_token() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..params(0.0) });
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[1]).0, 3);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams { top_k: 1, ..params(5.0) });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5], &[]).0, 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let logits = [5.0, 4.9, -10.0, -10.0];
        let mut s = Sampler::new(SamplingParams { top_p: 0.9, ..params(1.0) });
        let mut t = Sampler::new(SamplingParams { min_p: 0.5, ..params(1.0) });
        for _ in 0..200 {
            assert!(s.sample(&logits, &[]).0 < 2);
            assert!(t.sample(&logits, &[]).0 < 2);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_temperature_spreads() {
        let logits = [1.0, 1.0, 1.0, 1.0];
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..params(1.0) });
            (0..64).map(|_| s.sample(&logits, &[]).0).collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        let seen: std::collections::HashSet<u32> = run(3).into_iter().collect();
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn logprobs_are_normalised_and_ranked() {
        let mut s = Sampler::new(SamplingParams { top_logprobs: 2, ..params(0.0) });
        let (tok, lp) = s.sample(&[0.0, 2.0, 1.0], &[]);
        let lp = lp.unwrap();
        assert_eq!(tok, 1);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        let total: f32 = [0.0f32, 2.0, 1.0].iter().map(|v| (v - 2.0 + lp.logprob).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        for p in [
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 1.0, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
        ] {
            assert!(p.validate().is_err(), "{p:?}");
        }
        assert!(StopParams { max_tokens: 0, ..Default::default() }.validate().is_err());
    }
}
