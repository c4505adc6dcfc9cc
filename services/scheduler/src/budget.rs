//! Prefill work sized to a time budget per tick.
//!
//! A tick that carries prefill work beside the decode batch takes a decode step's time plus
//! the work's, and that tick is the gap every running stream sees between two tokens. With a
//! budget `b`, the work is sized so that such a tick takes at most `b` times a tick of the
//! decode batch alone. Two users: the scheduler sizes whole chunks (`size`, chunks in one tick),
//! and the decode actor sizes each tick's share of a chunk spread over ticks (`pick`, in tokens'
//! worth through the whole model; its clock is the interval between its steps). Both times are
//! measured:
//!
//! - a tick's time is the interval from its start to the next tick's start (what a stream sees
//!   between two tokens), taken only when the next tick followed at once (the scheduler was not
//!   idle in between);
//! - `decode_ms`: moving average of decode-only ticks;
//! - `extra_ms[size]`: moving average, per chunk size, of a chunk tick's time beyond
//!   `decode_ms`.
//!
//! A chunk's time is not proportional to its tokens: it has fixed costs (its attention, its KV
//! writes: on an H200 most of a 256-token chunk's time at 8b), and a size can even be slower
//! than a larger one. So each size's time is measured, not derived from a per-token rate. A size
//! not measured yet is estimated from a measured one in proportion to their tokens (from a
//! smaller size upward, an upper bound when costs are partly fixed; downward, a guess to try).
//! The sizer grants the largest size expected to fit the budget; when none is, the size with
//! the shortest expected tick (it does not shrink chunks that cost as much as larger ones).
//! While none fits, a smaller size whose time was last measured `REMEASURE_TICKS` chunk ticks
//! ago or more is granted once to measure it again (the largest such; the sizes below it count
//! as measured then too), and that sample replaces its old time: a
//! size abandoned after a few slow ticks (a host hiccup, a tick with an extra length group)
//! would otherwise never be tried again, though it may fit now. A smaller size costs little to
//! try: at worst about what the size it replaces costs.
//!
//! Sizes: `min`, `2·min`, `4·min`, ... below `max`, then `max`. A chunk of size `s` starts at a
//! multiple of `s` of the prompt's positions, so that on a GPU each size meets one attention
//! shape per position on its own grid (MLX plans a new shape for tens of ms; the worker's
//! warm-up runs every size once).
//!
//! Invariants: a granted chunk is never empty and never more than `max` tokens, so a prefill
//! always advances; a prompt position that is not a multiple of `min` (a prefix-cache hit off
//! the grid) is first brought back onto it; before both times are known, the largest aligned
//! size is granted.

use std::time::Duration;

/// Moving averages' weights of a new sample. A chunk's is low enough that one slow tick (a
/// host hiccup, a tick with an extra length group) does not flip the size chosen.
const DECODE_WEIGHT: f64 = 0.2;
const CHUNK_WEIGHT: f64 = 0.25;

/// Chunk ticks after which a smaller size's time is stale and, while no size fits the budget,
/// measured again.
const REMEASURE_TICKS: u32 = 16;

#[derive(Debug, Clone, Default)]
pub struct ChunkSizer {
    /// Allowed tick time over a decode-only tick's; 0: off (always `max`).
    budget: f64,
    /// Chunk sizes, ascending.
    sizes: Vec<usize>,
    decode_ms: Option<f64>,
    /// Per entry of `sizes`: a tick's time beyond `decode_ms` with a chunk of that size.
    extra_ms: Vec<Option<f64>>,
    /// Per entry of `sizes`: chunk ticks measured since that size's own last measurement.
    age: Vec<u32>,
    /// The last tick's start, rows decoded and chunk tokens, while the next follows at once.
    last: Option<(Duration, usize, usize)>,
}

impl ChunkSizer {
    pub fn new(budget: f64, min: usize, max: usize) -> Self {
        let sizes = Self::sizes(min, max);
        ChunkSizer { budget, extra_ms: vec![None; sizes.len()], age: vec![0; sizes.len()], sizes, ..Default::default() }
    }

    /// The sizes chunks take between `min` and `max` tokens: `min` doubled while below `max`,
    /// then `max`.
    pub fn sizes(min: usize, max: usize) -> Vec<usize> {
        let max = max.max(1);
        let mut s = min.clamp(1, max);
        let mut out = Vec::new();
        while s < max {
            out.push(s);
            s *= 2;
        }
        out.push(max);
        out
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0.0
    }

    /// A tick starts at `now`: times the previous one, if it ran right before.
    pub fn tick_started(&mut self, now: Duration) {
        let Some((start, decoded, chunk)) = self.last.take() else { return };
        let ms = now.saturating_sub(start).as_secs_f64() * 1000.0;
        if decoded == 0 {
            return;
        }
        let avg = |old: Option<f64>, w: f64, x: f64| Some(old.map_or(x, |o| o + w * (x - o)));
        if chunk == 0 {
            self.decode_ms = avg(self.decode_ms, DECODE_WEIGHT, ms);
        } else if let (Some(d), Some(i)) = (self.decode_ms, self.sizes.iter().position(|&s| s == chunk)) {
            // (A prompt's last chunk, of whatever tokens were left, is not timed.) A stale time
            // is replaced, not averaged.
            let stale = self.stale(i);
            self.extra_ms[i] = avg(self.extra_ms[i], if stale { 1.0 } else { CHUNK_WEIGHT }, (ms - d).max(0.0));
            for a in &mut self.age {
                *a = a.saturating_add(1);
            }
            // A retry speaks for the sizes below it too: one retry per stale period.
            let fresh = if stale { 0..=i } else { i..=i };
            self.age[fresh].fill(0);
        }
    }

    /// The tick that started at `start` decoded `decoded` rows and prefilled `chunk` tokens;
    /// `next_follows`: the next tick starts at once.
    pub fn tick_ended(&mut self, start: Duration, decoded: usize, chunk: usize, next_follows: bool) {
        self.last = next_follows.then_some((start, decoded, chunk));
    }

    /// Tokens to grant a prompt with `prefilled` positions done and `remaining` to go, beside a
    /// decode batch.
    pub fn size(&self, prefilled: usize, remaining: usize) -> usize {
        let Some(&min) = self.sizes.first() else { return remaining.max(1) };
        let off = prefilled % min;
        if off != 0 {
            return (min - off).min(remaining).max(1);
        }
        // Sizes that may start here.
        let aligned: Vec<usize> = (0..self.sizes.len()).filter(|&i| prefilled % self.sizes[i] == 0).collect();
        self.choose(&aligned).min(remaining).max(1)
    }

    /// The prefill work to give the next tick when any size may be chosen (a chunk's share
    /// spread over ticks has no grid to keep): as `size`, without alignment.
    pub fn pick(&self) -> usize {
        let all: Vec<usize> = (0..self.sizes.len()).collect();
        self.choose(&all)
    }

    /// Of the sizes at `candidates` (indices, ascending): the largest expected to fit the
    /// budget; when none is, the one with the shortest expected tick; before both times are
    /// known, the largest.
    fn choose(&self, candidates: &[usize]) -> usize {
        let expected: Vec<(usize, Option<f64>)> = candidates.iter().rev().map(|&i| (self.sizes[i], self.expected_ms(i))).collect();
        let first = self.sizes.first().copied().unwrap_or(1);
        match self.decode_ms {
            Some(d) if expected.iter().all(|(_, e)| e.is_some()) => {
                let room = (self.budget - 1.0) * d;
                let fits = expected.iter().find(|(_, e)| e.is_some_and(|e| e <= room));
                let cheapest = || expected.iter().min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal));
                let pick = fits.or_else(cheapest).map_or(first, |(s, _)| *s);
                if fits.is_some() {
                    return pick;
                }
                // None fits: a smaller size measured long ago is tried again (the largest such).
                candidates.iter().rev().find(|&&i| self.sizes[i] < pick && self.stale(i)).map_or(pick, |&i| self.sizes[i])
            }
            _ => expected.first().map_or(first, |(s, _)| *s),
        }
    }

    /// Whether `sizes[i]`'s measured time is old enough to measure again.
    fn stale(&self, i: usize) -> bool {
        self.extra_ms[i].is_some() && self.age[i] >= REMEASURE_TICKS
    }

    /// The time a chunk of `sizes[i]` is expected to add to a tick: the least of its own
    /// measured time and smaller sizes' scaled up; unmeasured, a larger size's scaled down.
    fn expected_ms(&self, i: usize) -> Option<f64> {
        let scaled = |j: usize| self.extra_ms[j].map(|e| e * self.sizes[i] as f64 / self.sizes[j] as f64);
        let upper = (0..i).filter_map(scaled).chain(self.extra_ms[i]).min_by(|a, b| a.total_cmp(b));
        upper.or_else(|| (i + 1..self.sizes.len()).find_map(scaled))
    }

    /// (decode-only tick ms, each size's measured extra ms), as measured so far.
    pub fn estimates(&self) -> (Option<f64>, &[Option<f64>]) {
        (self.decode_ms, &self.extra_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn sizes_double_from_the_smallest_to_the_largest() {
        assert_eq!(ChunkSizer::sizes(64, 256), vec![64, 128, 256]);
        assert_eq!(ChunkSizer::sizes(128, 384), vec![128, 256, 384]);
        assert_eq!(ChunkSizer::sizes(256, 256), vec![256]);
        assert_eq!(ChunkSizer::sizes(512, 256), vec![256]);
        assert_eq!(ChunkSizer::sizes(0, 16), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn the_largest_aligned_size_until_times_are_known() {
        let s = ChunkSizer::new(1.8, 64, 256);
        assert_eq!(s.size(0, 10_000), 256);
        assert_eq!(s.size(128, 10_000), 128);
        assert_eq!(s.size(192, 10_000), 64);
        assert_eq!(s.size(100, 10_000), 28, "back onto the grid first");
        assert_eq!(s.size(0, 100), 100, "the rest of a prompt");
    }

    /// Times the sizer as a scheduler would: `extra(n)` ms beyond a 10 ms decode step for an
    /// `n`-token chunk; returns the sizes granted over `ticks` chunk ticks of a long prompt.
    fn run(s: &mut ChunkSizer, t: &mut Duration, prefilled: &mut usize, ticks: usize, extra: impl Fn(usize) -> f64) -> Vec<usize> {
        let mut out = vec![];
        for _ in 0..ticks {
            let n = s.size(*prefilled, 1 << 20);
            s.tick_ended(*t, 16, n, true);
            *t += Duration::from_secs_f64((10.0 + extra(n)) / 1000.0);
            s.tick_started(*t);
            *prefilled += n;
            out.push(n);
        }
        out
    }

    fn with_decode_ticks(budget: f64) -> (ChunkSizer, Duration) {
        let mut s = ChunkSizer::new(budget, 64, 256);
        let mut t = ms(0);
        for _ in 0..3 {
            s.tick_ended(t, 16, 0, true);
            t += ms(10);
            s.tick_started(t);
        }
        assert_eq!(s.estimates().0, Some(10.0));
        (s, t)
    }

    #[test]
    fn chunks_costing_per_token_shrink_to_the_budget_and_grow_back() {
        let (mut s, mut t) = with_decode_ticks(2.0);
        let mut at = 0;
        // 0.1 ms a token: 10 ms of room fits 64 tokens (6.4 ms), not 128 (12.8)
        let sizes = run(&mut s, &mut t, &mut at, 6, |n| 0.1 * n as f64);
        assert_eq!(sizes, vec![256, 64, 64, 64, 64, 64]);
        // cheaper (0.02 ms a token): once 64's average comes down, it puts 128 and then 256
        // within the room (a single cheap tick moves an average only a quarter of the way)
        let sizes = run(&mut s, &mut t, &mut at, 10, |n| 0.02 * n as f64);
        assert_eq!(&sizes[6..], &[256, 256, 256, 256], "{sizes:?} {:?}", s.estimates());
        // a tick after idle time is not timed
        s.tick_ended(t, 16, 256, false);
        s.tick_started(t + ms(5000));
        assert_eq!(s.size(256, 10_000), 256);
    }

    #[test]
    fn picked_work_shrinks_to_the_budget_anywhere_and_grows_back() {
        // A staged chunk's share of a tick has no grid: any size may follow any other.
        let (mut s, mut t) = with_decode_ticks(1.5);
        let mut picked = vec![];
        for i in 0..8 {
            let w = s.pick();
            s.tick_ended(t, 16, w, true);
            // 8 ms of extra device time for 256 tokens' work, in proportion below; cheaper from
            // the fifth tick (a slower host: the device has slack).
            let per_token = if i < 4 { 8.0 / 256.0 } else { 1.0 / 256.0 };
            t += Duration::from_secs_f64((10.0 + per_token * w as f64) / 1000.0);
            s.tick_started(t);
            picked.push(w);
        }
        // 256 (unmeasured) first, then 128 (4 ms fits 5 ms of room; 256's 8 does not)...
        assert_eq!(&picked[..4], &[256, 128, 128, 128], "{picked:?} {:?}", s.estimates());
        // ...and back to 256 once it is cheap (estimated up from the smaller size measured).
        assert_eq!(*picked.last().unwrap(), 256, "{picked:?} {:?}", s.estimates());
        // Idle time between two ticks is not a tick's time.
        s.tick_ended(t, 16, 256, false);
        s.tick_started(t + ms(5000));
        assert_eq!(s.pick(), 256);
    }

    #[test]
    fn chunks_with_a_fixed_cost_are_not_shrunk_for_nothing() {
        let (mut s, mut t) = with_decode_ticks(1.5);
        let mut at = 0;
        // 6 ms whatever the size (and 128 slower still): nothing fits 5 ms of room; after
        // trying smaller sizes, whole chunks, the shortest ticks.
        let sizes = run(&mut s, &mut t, &mut at, 8, |n| if n == 128 { 9.0 } else { 6.0 });
        assert_eq!(&sizes[..2], &[256, 128], "{sizes:?}");
        assert!(sizes[2..].iter().all(|&n| n == 256 || n == 64), "{sizes:?}");
        assert_eq!(*sizes.last().unwrap(), 256, "{sizes:?} {:?}", s.estimates());
    }

    /// Times the sizer as the decode actor would (`pick`, any size after any other), as `run`.
    fn picks(s: &mut ChunkSizer, t: &mut Duration, ticks: usize, extra: impl Fn(usize) -> f64) -> Vec<usize> {
        (0..ticks)
            .map(|_| {
                let w = s.pick();
                s.tick_ended(*t, 16, w, true);
                *t += Duration::from_secs_f64((10.0 + extra(w)) / 1000.0);
                s.tick_started(*t);
                w
            })
            .collect()
    }

    #[test]
    fn a_smaller_size_abandoned_after_slow_ticks_is_measured_again_and_kept_when_it_fits() {
        let (mut s, mut t) = with_decode_ticks(1.5);
        // Slow ticks while the smaller sizes are first tried: none fits 5 ms of room, and 256
        // (6 ms) is the cheapest.
        let first = picks(&mut s, &mut t, 6, |n| if n < 256 { 9.0 } else { 6.0 });
        assert_eq!(first, vec![256, 128, 64, 256, 256, 256], "{:?}", s.estimates());
        // Now the work costs in proportion (128: 4 ms, fits); 256 alone would stay over budget.
        let later = picks(&mut s, &mut t, 40, |n| 8.0 * n as f64 / 256.0);
        let tried = later.iter().position(|&w| w != 256).expect("a smaller size is tried again");
        assert!(tried < REMEASURE_TICKS as usize, "{later:?}");
        assert_eq!(later[tried], 128, "the largest stale size below the cheapest: {later:?}");
        assert!(later[tried..].iter().all(|&w| w == 128), "kept once it fits: {later:?} {:?}", s.estimates());
    }

    #[test]
    fn sizes_that_stay_slow_are_retried_only_now_and_then() {
        let (mut s, mut t) = with_decode_ticks(1.5);
        let sizes = picks(&mut s, &mut t, 64, |n| if n < 256 { 9.0 } else { 6.0 });
        let smaller = sizes[3..].iter().filter(|&&w| w < 256).count();
        assert!((1..=64 / REMEASURE_TICKS as usize + 1).contains(&smaller), "{sizes:?}");
    }
}
