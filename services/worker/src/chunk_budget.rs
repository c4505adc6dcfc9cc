//! Prefill chunks sized to a time budget per tick (`scheduler.tick_budget`).
//!
//! While streams decode, every tick that also carries a prefill chunk lengthens the gap between
//! their tokens. With a fixed chunk the lengthening is whatever the chunk happens to cost at its
//! position in the prompt (a chunk late in a long prompt attends over more keys), and on a fast
//! device a 256-token chunk costs several decode steps. This module turns that around: it keeps
//! the tick with a chunk near `factor` times the tick without one, and grants the chunk that
//! fits.
//!
//! How: it watches the time between the starts of consecutive busy ticks (what a stream sees as
//! its inter-token gap), keeps a moving average of gaps after decode-only ticks (`decode_ms`)
//! and of the extra milliseconds per prefill token after ticks that carried a chunk
//! (`per_token_ms`), and grants `(factor - 1) * decode_ms / per_token_ms` tokens. This is a
//! feedback loop whose fixed point is a tick that costs exactly the budget, whatever part of a
//! chunk's cost is fixed and whatever part grows with it; the grant at most doubles from one
//! chunk to the next (costs are not linear in the chunk), stays within [min, max] and is rounded
//! to the nearest multiple of `QUANTUM` tokens (fewer distinct shapes for the device's kernels;
//! a tick may then exceed the budget by half a quantum's cost).
//!
//! Invariants: without a decode-only tick seen yet (nothing to measure against) or with the
//! budget off, the grant is the configured maximum; the grant is never 0.

/// Grants are multiples of this (when the maximum allows).
pub const QUANTUM: usize = 16;

/// Weight of a new observation in the moving averages.
const DECODE_ALPHA: f64 = 0.2;
const TOKEN_ALPHA: f64 = 0.5;

#[derive(Debug, Clone, Default)]
pub struct ChunkBudget {
    /// Target tick with a chunk, as a multiple of the tick without one; 0 turns sizing off.
    factor: f64,
    min: usize,
    decode_ms: Option<f64>,
    per_token_ms: Option<f64>,
    last_grant: Option<usize>,
}

impl ChunkBudget {
    pub fn new(factor: f64, min: usize) -> Self {
        ChunkBudget { factor, min: min.max(1), ..Default::default() }
    }

    pub fn enabled(&self) -> bool {
        self.factor > 1.0
    }

    /// Records a busy tick: it decoded `decoded` rows and prefilled `chunk` tokens, and the next
    /// tick started `gap_ms` after it started.
    pub fn observe(&mut self, decoded: usize, chunk: usize, gap_ms: f64) {
        if decoded == 0 || !gap_ms.is_finite() || gap_ms <= 0.0 {
            return;
        }
        if chunk == 0 {
            self.decode_ms = Some(ema(self.decode_ms, gap_ms, DECODE_ALPHA));
        } else if let Some(d) = self.decode_ms {
            // A chunk that cost less than a decode-only tick still cost something.
            let per_token = ((gap_ms - d).max(0.02 * d)) / chunk as f64;
            self.per_token_ms = Some(ema(self.per_token_ms, per_token, TOKEN_ALPHA));
        }
    }

    /// Prefill tokens to grant this tick, at most `max`, while streams decode.
    pub fn grant(&mut self, max: usize) -> usize {
        let max = max.max(1);
        let (Some(d), true) = (self.decode_ms, self.enabled()) else { return max };
        let min = self.min.min(max);
        let n = match self.per_token_ms {
            // The first chunk measured against the decode ticks: start small.
            None => min,
            Some(p) => {
                let fit = (self.factor - 1.0) * d / p;
                // To the nearest quantum: rounding down would stop short of the fixed point.
                let fit = if fit >= QUANTUM as f64 { (fit / QUANTUM as f64).round() as usize * QUANTUM } else { fit as usize };
                let cap = self.last_grant.map_or(max, |g| 2 * g);
                fit.min(cap).min(max)
            }
        };
        let n = n.clamp(min, max);
        self.last_grant = Some(n);
        n
    }

    /// The moving averages, for status and tests: (decode-only tick ms, ms per prefill token).
    pub fn estimates(&self) -> (Option<f64>, Option<f64>) {
        (self.decode_ms, self.per_token_ms)
    }
}

fn ema(old: Option<f64>, new: f64, alpha: f64) -> f64 {
    old.map_or(new, |o| (1.0 - alpha) * o + alpha * new)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device whose tick costs `fixed` ms plus `k` ms per chunk token over a `d` ms decode.
    fn converge(b: &mut ChunkBudget, d: f64, fixed: f64, k: f64, ticks: usize) -> Vec<(usize, f64)> {
        for _ in 0..20 {
            b.observe(16, 0, d);
        }
        (0..ticks)
            .map(|_| {
                let n = b.grant(256);
                let t = d + fixed + k * n as f64;
                b.observe(16, n, t);
                (n, t)
            })
            .collect()
    }

    #[test]
    fn grants_converge_to_the_chunk_that_fits_the_budget() {
        // 10 ms decode, 0.1 ms per token, budget 2x: 100 tokens fit (96 after rounding).
        let mut b = ChunkBudget::new(2.0, 16);
        let run = converge(&mut b, 10.0, 0.0, 0.1, 30);
        assert_eq!(run[0].0, 16, "the first chunk is the minimum");
        assert!(run[1].0 <= 32, "grants at most double: {:?}", &run[..4]);
        for &(n, t) in &run[10..] {
            assert!((80..=112).contains(&n), "{run:?}");
            assert!(t <= 21.2, "tick {t} ms over the 20 ms budget: {run:?}");
        }
    }

    #[test]
    fn a_fixed_cost_per_chunk_is_learned_too() {
        // 3 ms of every chunk tick is fixed: 70 tokens fit in 2 x 10 ms.
        let mut b = ChunkBudget::new(2.0, 16);
        let run = converge(&mut b, 10.0, 3.0, 0.1, 40);
        for &(n, t) in &run[20..] {
            assert!((56..=80).contains(&n), "{run:?}");
            assert!(t <= 21.0, "{run:?}");
        }
    }

    #[test]
    fn off_without_a_factor_or_a_decode_measurement() {
        let mut b = ChunkBudget::new(0.0, 16);
        b.observe(16, 0, 10.0);
        assert_eq!(b.grant(256), 256);
        let mut b = ChunkBudget::new(2.0, 16);
        assert_eq!(b.grant(256), 256, "nothing measured yet");
        b.observe(0, 64, 10.0); // prefill alone says nothing about decode
        assert_eq!(b.grant(256), 256);
    }

    #[test]
    fn grants_stay_within_min_and_max() {
        // A chunk token costs more than the whole budget: the minimum still goes.
        let mut b = ChunkBudget::new(2.0, 16);
        let run = converge(&mut b, 10.0, 0.0, 5.0, 10);
        assert!(run.iter().all(|&(n, _)| n == 16), "{run:?}");
        // Nearly free tokens: never over the maximum.
        let mut b = ChunkBudget::new(2.0, 16);
        let run = converge(&mut b, 10.0, 0.0, 0.0001, 20);
        assert_eq!(run.last().unwrap().0, 256);
        // A maximum under the quantum is kept as is.
        let mut b = ChunkBudget::new(2.0, 4);
        b.observe(1, 0, 10.0);
        assert_eq!(b.grant(10), 4);
        b.observe(1, 4, 11.0);
        assert_eq!(b.grant(10), 8, "at most doubles");
        b.observe(1, 8, 12.0);
        assert_eq!(b.grant(10), 10);
    }
}
