//! Choosing the next token: greedy, temperature, top-k, top-p, min-p, repetition penalty,
//! seeded randomness and top-n logprobs; and the stop conditions of a generation.
//!
//! Invariants: parameters are validated once (`validate`, where they enter the system) into
//! values the sampler uses without further checks; the same seed and logits give the same token.

pub use llmq_protocol::{FinishReason, Sampling, StopConditions, TokenLogprob};

use crate::error::{Error, Result};

/// Checks a job's sampling parameters: the one validation, where they enter the system.
pub fn validate(p: &Sampling) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidRequest(m));
    if !p.temperature.is_finite() || p.temperature < 0.0 {
        return bad(format!(
            "temperature must be a finite number >= 0, got {}",
            p.temperature
        ));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {}", p.top_p));
    }
    if !(p.min_p >= 0.0 && p.min_p < 1.0) {
        return bad(format!("min_p must be in [0, 1), got {}", p.min_p));
    }
    if !(p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0) {
        return bad(format!(
            "repetition_penalty must be > 0, got {}",
            p.repetition_penalty
        ));
    }
    if p.top_logprobs > 20 {
        return bad(format!(
            "top_logprobs must be at most 20, got {}",
            p.top_logprobs
        ));
    }
    Ok(())
}

/// Checks a job's stop conditions, like `validate`.
pub fn validate_stop(s: &StopConditions) -> Result<()> {
    if s.max_tokens == 0 {
        return Err(Error::InvalidRequest(
            "max_tokens must be at least 1".into(),
        ));
    }
    if s.stop.iter().any(String::is_empty) {
        return Err(Error::InvalidRequest(
            "stop strings must not be empty".into(),
        ));
    }
    Ok(())
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
    params: Sampling,
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
    pub fn new(params: Sampling) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        Sampler {
            params,
            rng: Rng(seed),
        }
    }

    pub fn params(&self) -> &Sampling {
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
                        *v = if *v > 0.0 {
                            *v / p.repetition_penalty
                        } else {
                            *v * p.repetition_penalty
                        };
                    }
                }
            }
        }
        let token = if p.temperature == 0.0 {
            argmax(&z)
        } else {
            self.draw(&z)
        };
        let lp = p.wants_logprobs().then(|| {
            let ls = log_softmax(&z);
            let mut order: Vec<u32> = (0..ls.len() as u32).collect();
            let n = (p.top_logprobs as usize).min(ls.len());
            if n > 0 {
                order.select_nth_unstable_by(n - 1, |&a, &b| {
                    ls[b as usize].total_cmp(&ls[a as usize])
                });
                order.truncate(n);
                order.sort_by(|&a, &b| ls[b as usize].total_cmp(&ls[a as usize]));
            } else {
                order.clear();
            }
            TokenLogprob {
                token,
                logprob: ls[token as usize],
                top: order.iter().map(|&i| (i, ls[i as usize])).collect(),
                text: String::new(),
                top_text: vec![],
            }
        });
        (token, lp)
    }

    fn draw(&mut self, z: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut cand: Vec<(u32, f64)> = z
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, (((v - max) * inv_t) as f64).exp()))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top_k = p.top_k as usize;
        if top_k > 0 && top_k < cand.len() {
            cand.truncate(top_k);
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

    fn params(t: f32) -> Sampling {
        Sampling {
            temperature: t,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[]).0, 1);
    }

    #[test]
    fn repetition_penalty_moves_greedy_off_a_seen_token() {
        let mut s = Sampler::new(Sampling {
            repetition_penalty: 2.0,
            ..params(0.0)
        });
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[1]).0, 3);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(Sampling {
            top_k: 1,
            ..params(5.0)
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5], &[]).0, 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let logits = [5.0, 4.9, -10.0, -10.0];
        let mut s = Sampler::new(Sampling {
            top_p: 0.9,
            ..params(1.0)
        });
        let mut t = Sampler::new(Sampling {
            min_p: 0.5,
            ..params(1.0)
        });
        for _ in 0..200 {
            assert!(s.sample(&logits, &[]).0 < 2);
            assert!(t.sample(&logits, &[]).0 < 2);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_temperature_spreads() {
        let logits = [1.0, 1.0, 1.0, 1.0];
        let run = |seed| {
            let mut s = Sampler::new(Sampling {
                seed: Some(seed),
                ..params(1.0)
            });
            (0..64)
                .map(|_| s.sample(&logits, &[]).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        let seen: std::collections::HashSet<u32> = run(3).into_iter().collect();
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn logprobs_are_normalised_and_ranked() {
        let mut s = Sampler::new(Sampling {
            top_logprobs: 2,
            ..params(0.0)
        });
        let (tok, lp) = s.sample(&[0.0, 2.0, 1.0], &[]);
        let lp = lp.unwrap();
        assert_eq!(tok, 1);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        let total: f32 = [0.0f32, 2.0, 1.0]
            .iter()
            .map(|v| (v - 2.0 + lp.logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        for p in [
            Sampling {
                temperature: f32::NAN,
                ..Default::default()
            },
            Sampling {
                temperature: -1.0,
                ..Default::default()
            },
            Sampling {
                top_p: 0.0,
                ..Default::default()
            },
            Sampling {
                min_p: 1.0,
                ..Default::default()
            },
            Sampling {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(validate(&p).is_err(), "{p:?}");
        }
        assert!(validate_stop(&StopConditions {
            max_tokens: 0,
            ..Default::default()
        })
        .is_err());
    }
}
