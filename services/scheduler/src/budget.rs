//! Prefill work sized to a time budget per tick.
//!
//! A tick that carries prefill work beside the decode batch takes a decode step's time plus
//! the work's, and that tick is the gap every running stream sees between two tokens. With a
//! budget `b`, the work is sized so that such a tick takes at most `b` times a tick of the
//! decode batch alone. Two users: the scheduler sizes whole chunks ([`ChunkSizer::size`], a
//! chunk in one tick), and the decode actor sizes each tick's share of a chunk spread over
//! ticks ([`ChunkSizer::pick`], in tokens' worth through the whole model).
//!
//! Rules:
//!
//! - Times are measured, never derived from a per-token rate: a tick's time is the interval to
//!   the next tick's start (taken only when the next followed at once); `decode_ms` averages
//!   decode-only ticks; each size keeps its own chunk ticks' time beyond `decode_ms`, since a
//!   chunk has fixed costs (its attention, its KV writes) and a size can cost as much as a
//!   larger one. A size not measured yet is estimated from a measured one in proportion.
//! - A chunk's time grows with its offset in the prompt (each token attends to every position
//!   before it): samples keep their offsets, one slope over positions is fitted to all sizes,
//!   and a whole chunk's time is moved along it to the offset asked about, so a long prompt's
//!   chunks shrink as it advances.
//! - The largest size expected to fit is granted. When none fits, a share takes the size with
//!   the shortest expected tick and a whole chunk the smallest; and a smaller size last
//!   measured `REMEASURE_TICKS` chunk ticks ago or more is granted once to measure it again,
//!   so that a few slow ticks do not rule it out for good.
//! - Whole chunks are committed in one tick, so they are judged cautiously: they start at the
//!   smallest size, a size's own time (however old) counts over what smaller sizes suggest,
//!   and its samples' mean deviation counts twice (`WHOLE_DEVIATIONS`): the streams see the
//!   slow ticks. Shares are chosen again every tick, so they start at the largest and take the
//!   most hopeful estimate.
//! - Sizes are `min`, `2·min`, `4·min`, ... below `max`, then `max`; a chunk of size `s` starts
//!   at a multiple of `s`, so that on a GPU each size meets one attention shape per position
//!   (MLX plans each new shape; the worker's warm-up runs every size once).
//!
//! Invariants: a granted chunk is never empty and never more than `max` tokens, so a prefill
//! always advances; a prompt position that is not a multiple of `min` (a prefix-cache hit off
//! the grid) is first brought back onto it.

use std::time::Duration;

/// Moving averages' weights of a new sample. A chunk's is low enough that one slow tick (a
/// host hiccup, a tick with an extra length group) does not flip the size chosen.
const DECODE_WEIGHT: f64 = 0.2;
const CHUNK_WEIGHT: f64 = 0.25;
/// The offset slope's fit forgets more slowly: it needs samples spread over positions.
const SLOPE_WEIGHT: f64 = 0.05;
/// A whole chunk is judged by its expected time plus this many of its size's mean deviations:
/// the budget bounds the slow ticks of a noisy host, not only the average one.
const WHOLE_DEVIATIONS: f64 = 2.0;

/// Chunk ticks after which a smaller size's time is stale and, while no size fits the budget,
/// measured again.
const REMEASURE_TICKS: u32 = 16;

/// What is sized: a whole chunk, committed for its tick, judged cautiously (the smallest size
/// before times are known; a size's own time, once it has one, over any estimate from another size;
/// times moved to the chunk's offset, their deviation added); or a tick's share of a chunk, chosen again each tick,
/// judged hopefully (the largest first; the least of a size's own time and the smaller sizes'
/// scaled up; times as measured, the moving averages following the offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Whole,
    Share,
}

/// One size's measurements: its tick time beyond a decode-only tick, at the mean offset of its
/// samples (moving averages), and the slowly forgetting sums of (offset, per-token time) that
/// the shared slope is fitted to.
#[derive(Debug, Clone, Copy, Default)]
struct Measured {
    extra_ms: f64,
    /// Moving average of the samples' distance from `extra_ms` (before each was added).
    dev_ms: f64,
    /// Mean position of the chunk's tokens (its offset plus half its tokens).
    mid: f64,
    fit: Sums,
}

/// Slowly forgetting weighted sums of samples (x: mid position, y: ms per token), for a least
/// squares line.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Sums {
    /// Adds the sample (x, y) with weight `keep` on what is new, `1 - keep` on what was.
    fn add(&mut self, x: f64, y: f64, keep: f64) {
        let mix = |sum: &mut f64, v: f64| *sum = (1.0 - keep) * *sum + keep * v;
        mix(&mut self.w, 1.0);
        mix(&mut self.x, x);
        mix(&mut self.y, y);
        mix(&mut self.xx, x * x);
        mix(&mut self.xy, x * y);
    }
}

impl Measured {
    /// This size's (centred x·x, centred x·y) sums, for the shared slope.
    fn centred(&self) -> (f64, f64) {
        let Sums { w, x, y, xx, xy } = self.fit;
        if w <= 0.0 {
            return (0.0, 0.0);
        }
        (xx - x * x / w, xy - x * y / w)
    }
}

/// A tick whose time is known only when the next one starts.
#[derive(Debug, Clone, Copy)]
struct LastTick {
    start: Duration,
    decoded: usize,
    chunk: usize,
    /// The chunk's offset in its prompt.
    at: usize,
}

#[derive(Debug, Clone, Default)]
pub struct ChunkSizer {
    /// Allowed tick time over a decode-only tick's; 0: off (always `max`).
    budget: f64,
    /// Chunk sizes, ascending.
    sizes: Vec<usize>,
    decode_ms: Option<f64>,
    /// Per entry of `sizes`: its measurements, once it has some.
    measured: Vec<Option<Measured>>,
    /// Per entry of `sizes`: chunk ticks measured since that size's own last measurement.
    age: Vec<u32>,
    /// The last tick, while the next follows at once (its end is the next one's start).
    last: Option<LastTick>,
    /// Shares judged as whole chunks are (see `with_cautious_shares`).
    cautious_shares: bool,
}

impl ChunkSizer {
    pub fn new(budget: f64, min: usize, max: usize) -> Self {
        let sizes = Self::sizes(min, max);
        ChunkSizer {
            budget,
            measured: vec![None; sizes.len()],
            age: vec![0; sizes.len()],
            sizes,
            ..Default::default()
        }
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

    /// Shares judged as whole chunks are, at their chunk's offset: where a share's time is the
    /// device's compute for its tokens' worth (a CPU's), it grows with the offset and varies
    /// with the host, as a whole chunk's does; on a GPU it is mostly the host's time to launch
    /// its layers, and the hopeful judgement keeps the shares large.
    pub fn with_cautious_shares(mut self) -> Self {
        self.cautious_shares = true;
        self
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0.0
    }

    /// A tick starts at `now`: times the previous one, if it ran right before.
    pub fn tick_started(&mut self, now: Duration) {
        let Some(LastTick {
            start,
            decoded,
            chunk,
            at,
        }) = self.last.take()
        else {
            return;
        };
        let ms = now.saturating_sub(start).as_secs_f64() * 1000.0;
        if decoded == 0 {
            return;
        }
        if chunk == 0 {
            self.decode_ms = Some(self.decode_ms.map_or(ms, |o| o + DECODE_WEIGHT * (ms - o)));
        } else if let (Some(d), Some(i)) =
            (self.decode_ms, self.sizes.iter().position(|&s| s == chunk))
        {
            // (A prompt's last chunk, of whatever tokens were left, is not timed.) A stale time
            // is replaced, not averaged.
            let stale = self.stale(i);
            self.record(
                i,
                (ms - d).max(0.0),
                at,
                if stale { 1.0 } else { CHUNK_WEIGHT },
            );
            for a in &mut self.age {
                *a = a.saturating_add(1);
            }
            // A retry speaks for the sizes below it too: one retry per stale period.
            let fresh = if stale { 0..=i } else { i..=i };
            self.age[fresh].fill(0);
        }
    }

    /// Adds a sample of `sizes[i]` at offset `at`: `extra` ms beyond a decode-only tick, with
    /// weight `w` in its moving averages.
    fn record(&mut self, i: usize, extra: f64, at: usize, w: f64) {
        let n = self.sizes[i] as f64;
        let mid = at as f64 + n / 2.0;
        let (x, y) = (mid, extra / n);
        let m = self.measured[i].get_or_insert(Measured {
            extra_ms: extra,
            dev_ms: 0.0,
            mid,
            fit: Sums::default(),
        });
        m.dev_ms += CHUNK_WEIGHT * ((extra - m.extra_ms).abs() - m.dev_ms);
        m.extra_ms += w * (extra - m.extra_ms);
        m.mid += w * (mid - m.mid);
        m.fit.add(x, y, SLOPE_WEIGHT);
    }

    /// The tick that started at `start` decoded `decoded` rows and prefilled `chunk` tokens
    /// from the prompt's position `at`; `next_follows`: the next tick starts at once.
    pub fn tick_ended(
        &mut self,
        start: Duration,
        decoded: usize,
        chunk: usize,
        at: usize,
        next_follows: bool,
    ) {
        self.last = next_follows.then_some(LastTick {
            start,
            decoded,
            chunk,
            at,
        });
    }

    /// Tokens to grant a prompt with `prefilled` positions done and `remaining` to go, beside a
    /// decode batch.
    pub fn size(&self, prefilled: usize, remaining: usize) -> usize {
        let Some(&min) = self.sizes.first() else {
            return remaining.max(1);
        };
        let off = prefilled % min;
        if off != 0 {
            return (min - off).min(remaining).max(1);
        }
        // Sizes that may start here.
        let aligned: Vec<usize> = (0..self.sizes.len())
            .filter(|&i| prefilled.is_multiple_of(self.sizes[i]))
            .collect();
        self.choose(&aligned, prefilled, Mode::Whole)
            .min(remaining)
            .max(1)
    }

    /// The prefill work to give the next tick when any size may be chosen (a chunk's share
    /// spread over ticks has no grid to keep), for a chunk from position `at`: as `size`,
    /// without alignment, judged as a share (or as a whole chunk, with `with_cautious_shares`).
    pub fn pick(&self, at: usize) -> usize {
        let all: Vec<usize> = (0..self.sizes.len()).collect();
        self.choose(
            &all,
            at,
            if self.cautious_shares {
                Mode::Whole
            } else {
                Mode::Share
            },
        )
    }

    /// Of the sizes at `candidates` (indices, ascending), for a chunk from position `at`: the
    /// largest expected to fit the budget; when none is, the smallest for a whole chunk, the one
    /// with the shortest expected tick for a share; before both times are known, the smallest
    /// for a whole chunk, the largest for a share.
    fn choose(&self, candidates: &[usize], at: usize, mode: Mode) -> usize {
        let expected: Vec<(usize, Option<f64>)> = candidates
            .iter()
            .rev()
            .map(|&i| (self.sizes[i], self.expected_ms(i, at, mode)))
            .collect();
        let first = self.sizes.first().copied().unwrap_or(1);
        match self.decode_ms {
            Some(d) if expected.iter().all(|(_, e)| e.is_some()) => {
                let room = (self.budget - 1.0) * d;
                let fits = expected.iter().find(|(_, e)| e.is_some_and(|e| e <= room));
                let cheapest = || {
                    expected
                        .iter()
                        .min_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal))
                };
                let pick = fits.or_else(cheapest).map_or(first, |(s, _)| *s);
                if fits.is_some() {
                    return pick;
                }
                // None fits. A whole chunk takes the smallest size: a larger one's time, measured
                // at another offset and moved along the slope, is the less certain, and a whole
                // chunk too large is a stall of its whole time.
                if mode == Mode::Whole {
                    return expected.last().map_or(first, |(s, _)| *s);
                }
                // A share: a smaller size measured long ago is tried again (the largest such).
                candidates
                    .iter()
                    .rev()
                    .find(|&&i| self.sizes[i] < pick && self.stale(i))
                    .map_or(pick, |&i| self.sizes[i])
            }
            _ if mode == Mode::Whole => expected.last().map_or(first, |(s, _)| *s),
            _ => expected.first().map_or(first, |(s, _)| *s),
        }
    }

    /// Whether `sizes[i]`'s measured time is old enough to measure again.
    fn stale(&self, i: usize) -> bool {
        self.measured[i].is_some() && self.age[i] >= REMEASURE_TICKS
    }

    /// The per-token time each position of offset adds: the slope of per-token time over
    /// position, fitted within each size and pooled (never negative; 0 before the samples
    /// spread over positions).
    fn slope(&self) -> f64 {
        let (xx, xy) = self
            .measured
            .iter()
            .flatten()
            .map(Measured::centred)
            .fold((0.0, 0.0), |a, c| (a.0 + c.0, a.1 + c.1));
        // Samples spread over less than a position carry no slope.
        if xx > 1.0 {
            (xy / xx).max(0.0)
        } else {
            0.0
        }
    }

    /// `sizes[j]`'s measured time moved to a chunk of `n` tokens from position `at`: per token
    /// along the slope, then in proportion to the tokens.
    fn moved(&self, j: usize, n: usize, at: usize, slope: f64) -> Option<f64> {
        let m = self.measured[j]?;
        let per_token =
            m.extra_ms / self.sizes[j] as f64 + slope * (at as f64 + n as f64 / 2.0 - m.mid);
        Some(per_token.max(0.0) * n as f64)
    }

    /// A whole chunk's cautious time: `moved`, plus `WHOLE_DEVIATIONS` of the size's mean
    /// deviation, scaled as its time was moved.
    fn cautious(&self, j: usize, n: usize, at: usize, slope: f64) -> Option<f64> {
        let m = self.measured[j]?;
        let t = self.moved(j, n, at, slope)?;
        let scale = if m.extra_ms > 0.0 {
            t / m.extra_ms
        } else {
            1.0
        };
        Some(t + WHOLE_DEVIATIONS * m.dev_ms * scale)
    }

    /// The time a chunk of `sizes[i]` from position `at` is expected to add to a tick: the
    /// least of its own measured time and smaller sizes' scaled up (for a whole chunk, its own
    /// time alone once it has one); unmeasured, a larger size's scaled down (each moved to
    /// `at`; for a whole chunk, `cautious`).
    fn expected_ms(&self, i: usize, at: usize, mode: Mode) -> Option<f64> {
        // A share's time is not moved along the slope: on a GPU a share's time is mostly the
        // host's launch of its layers, and moving it made the shares smaller and the prompts'
        // first tokens later for no better gaps (BENCHMARKS.md, the burst after the KV-cache
        // changes).
        let (n, slope) = (
            self.sizes[i],
            if mode == Mode::Whole {
                self.slope()
            } else {
                0.0
            },
        );
        let time = |j| {
            if mode == Mode::Whole {
                self.cautious(j, n, at, slope)
            } else {
                self.moved(j, n, at, slope)
            }
        };
        if mode == Mode::Whole && self.measured[i].is_some() {
            return time(i);
        }
        let upper = (0..=i).filter_map(time).min_by(|a, b| a.total_cmp(b));
        upper.or_else(|| (i + 1..self.sizes.len()).find_map(time))
    }

    /// (decode-only tick ms, each size's measured extra ms at the mean offset of its samples).
    pub fn estimates(&self) -> (Option<f64>, Vec<Option<f64>>) {
        (
            self.decode_ms,
            self.measured
                .iter()
                .map(|m| m.map(|m| m.extra_ms))
                .collect(),
        )
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
    fn whole_chunks_start_at_the_smallest_size_and_shares_at_the_largest() {
        let s = ChunkSizer::new(1.8, 64, 256);
        assert_eq!(s.size(0, 10_000), 64);
        assert_eq!(s.size(128, 10_000), 64);
        assert_eq!(s.size(100, 10_000), 28, "back onto the grid first");
        assert_eq!(s.size(0, 30), 30, "the rest of a prompt");
        assert_eq!(s.pick(0), 256);
    }

    /// Times the sizer as a scheduler would: `extra(n)` ms beyond a 10 ms decode step for an
    /// `n`-token chunk; returns the sizes granted over `ticks` chunk ticks of a long prompt.
    fn run(
        s: &mut ChunkSizer,
        t: &mut Duration,
        prefilled: &mut usize,
        ticks: usize,
        extra: impl Fn(usize) -> f64,
    ) -> Vec<usize> {
        let mut out = vec![];
        for _ in 0..ticks {
            let n = s.size(*prefilled, 1 << 20);
            s.tick_ended(*t, 16, n, *prefilled, true);
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
            s.tick_ended(t, 16, 0, 0, true);
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
        assert_eq!(sizes, vec![64, 64, 64, 64, 64, 64]);
        // cheaper (0.02 ms a token): once 64's average and deviation come down, it puts 128
        // and then 256 within the room (a single cheap tick moves an average only a quarter of
        // the way, and the change counts as deviation while it lasts)
        let sizes = run(&mut s, &mut t, &mut at, 14, |n| 0.02 * n as f64);
        assert_eq!(
            &sizes[10..],
            &[256, 256, 256, 256],
            "{sizes:?} {:?}",
            s.estimates()
        );
        // a tick after idle time is not timed
        s.tick_ended(t, 16, 256, at, false);
        s.tick_started(t + ms(5000));
        assert_eq!(s.size(at, 10_000), 256);
    }

    #[test]
    fn whole_chunks_leave_room_for_a_noisy_hosts_slow_ticks() {
        // 0.1 ms a token on average beside 10 ms decode ticks, a budget of 2.5 (15 ms of room):
        // 128 tokens (12.8 ms) fit when every tick costs the average; when ticks alternate
        // between 0.6x and 1.4x of it, a 128-token tick would take 17.9 ms, and 64 are granted.
        let settle = |noise: f64| {
            let (mut s, mut t) = with_decode_ticks(2.5);
            let mut at = 0;
            let flip = std::cell::Cell::new(1.0);
            let sizes = run(&mut s, &mut t, &mut at, 40, |n| {
                flip.set(-flip.get());
                0.1 * n as f64 * (1.0 + noise * flip.get())
            });
            sizes[20..].to_vec()
        };
        assert!(settle(0.0).iter().all(|&n| n == 128), "{:?}", settle(0.0));
        assert!(settle(0.4).iter().all(|&n| n == 64), "{:?}", settle(0.4));
    }

    #[test]
    fn picked_work_shrinks_to_the_budget_anywhere_and_grows_back() {
        // A staged chunk's share of a tick has no grid: any size may follow any other.
        let (mut s, mut t) = with_decode_ticks(1.5);
        let mut picked = vec![];
        for i in 0..8 {
            let w = s.pick(0);
            s.tick_ended(t, 16, w, 0, true);
            // 8 ms of extra device time for 256 tokens' work, in proportion below; cheaper from
            // the fifth tick (a slower host: the device has slack).
            let per_token = if i < 4 { 8.0 / 256.0 } else { 1.0 / 256.0 };
            t += Duration::from_secs_f64((10.0 + per_token * w as f64) / 1000.0);
            s.tick_started(t);
            picked.push(w);
        }
        // 256 (unmeasured) first, then 128 (4 ms fits 5 ms of room; 256's 8 does not)...
        assert_eq!(
            &picked[..4],
            &[256, 128, 128, 128],
            "{picked:?} {:?}",
            s.estimates()
        );
        // ...and back to 256 once it is cheap (estimated up from the smaller size measured).
        assert_eq!(
            *picked.last().unwrap(),
            256,
            "{picked:?} {:?}",
            s.estimates()
        );
        // Idle time between two ticks is not a tick's time.
        s.tick_ended(t, 16, 256, 0, false);
        s.tick_started(t + ms(5000));
        assert_eq!(s.pick(0), 256);
    }

    #[test]
    fn cautious_shares_start_small_and_shrink_as_the_offset_grows() {
        // A CPU's share: its time is compute for its tokens' worth, 0.02 ms a token at offset 0
        // and 0.02 ms more per 1,000 positions; 10 ms decode ticks, a budget of 2.0 (10 ms of
        // room). Judged as whole chunks: the smallest first, larger once measured, and smaller
        // again as the chunk's offset grows, with no tick over the budget.
        let mut s = ChunkSizer::new(2.0, 64, 256).with_cautious_shares();
        let mut t = ms(0);
        for _ in 0..3 {
            s.tick_ended(t, 16, 0, 0, true);
            t += ms(10);
            s.tick_started(t);
        }
        assert_eq!(s.pick(0), 64);
        let (mut picked, mut worst) = (vec![], 0.0f64);
        for tick in 0..120 {
            let at = tick * 50;
            let w = s.pick(at);
            let extra = w as f64 * 0.02 * (1.0 + at as f64 / 1000.0);
            worst = worst.max(extra);
            s.tick_ended(t, 16, w, at, true);
            t += Duration::from_secs_f64((10.0 + extra) / 1000.0);
            s.tick_started(t);
            picked.push(w);
        }
        assert!(
            worst <= 10.0,
            "{worst} ms over a 10 ms decode tick: {picked:?}"
        );
        assert!(picked[..40].contains(&256), "{picked:?}");
        assert_eq!(
            *picked.last().unwrap(),
            64,
            "{picked:?} {:?}",
            s.estimates()
        );
    }

    #[test]
    fn chunks_with_a_fixed_cost_are_not_shrunk_for_nothing() {
        // Shares (`pick`) start at the largest: 6 ms whatever the size (and 128 slower still),
        // nothing fits 5 ms of room; after trying smaller sizes, the shortest ticks.
        let (mut s, mut t) = with_decode_ticks(1.5);
        let sizes = picks(&mut s, &mut t, 8, |n| if n == 128 { 9.0 } else { 6.0 });
        assert_eq!(&sizes[..2], &[256, 128], "{sizes:?}");
        assert!(sizes[2..].iter().all(|&n| n == 256 || n == 64), "{sizes:?}");
        assert_eq!(*sizes.last().unwrap(), 256, "{sizes:?} {:?}", s.estimates());
        // Whole chunks start at the smallest and are judged larger in proportion (an upper
        // bound): over budget already, they are not made larger.
        let (mut s, mut t) = with_decode_ticks(1.5);
        let mut at = 0;
        let sizes = run(&mut s, &mut t, &mut at, 8, |_| 6.0);
        assert!(sizes.iter().all(|&n| n == 64), "{sizes:?}");
    }

    #[test]
    fn chunks_shrink_as_the_prompt_advances_and_start_large_again_at_the_next_prompt() {
        // A CPU's chunk: 0.5 ms a token plus 0.5 us a token for each position before it (7x
        // at position 6,000), beside 10 ms decode ticks with a budget of 3 (20 ms of room).
        let mut s = ChunkSizer::new(3.0, 4, 256);
        let mut t = ms(0);
        for _ in 0..3 {
            s.tick_ended(t, 16, 0, 0, true);
            t += ms(10);
            s.tick_started(t);
        }
        let cost = |n: usize, at: usize| n as f64 * (0.5 + 0.0005 * (at as f64 + n as f64 / 2.0));
        let mut at = 0;
        let mut over = vec![];
        let mut granted = vec![];
        while at < 6_000 {
            let n = s.size(at, 1 << 20);
            s.tick_ended(t, 16, n, at, true);
            let extra = cost(n, at);
            t += Duration::from_secs_f64((10.0 + extra) / 1000.0);
            s.tick_started(t);
            over.push(extra / 20.0);
            granted.push(n);
            at += n;
        }
        assert_eq!(granted[0], 4, "{granted:?}");
        assert!(
            granted.contains(&32) && granted.iter().rev().take(8).all(|&n| n == 4),
            "{granted:?}"
        );
        // Ticks stay within the budget as the costs grow, but for a few while the slope is
        // learnt (at most 1.5x the room).
        let worst = over.iter().copied().fold(0.0, f64::max);
        let within = over.iter().filter(|&&o| o <= 1.0).count() as f64 / over.len() as f64;
        assert!(
            worst < 1.5 && within > 0.95,
            "worst {worst}, within {within} {over:?}"
        );
        // The next prompt starts at position 0: its cost there, not the last one's at 6,000.
        assert!(s.size(0, 1 << 20) >= 32, "{:?}", s.estimates());
    }

    /// Times the sizer as the decode actor would (`pick`, any size after any other), as `run`.
    fn picks(
        s: &mut ChunkSizer,
        t: &mut Duration,
        ticks: usize,
        extra: impl Fn(usize) -> f64,
    ) -> Vec<usize> {
        (0..ticks)
            .map(|_| {
                let w = s.pick(0);
                s.tick_ended(*t, 16, w, 0, true);
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
        assert_eq!(
            first,
            vec![256, 128, 64, 256, 256, 256],
            "{:?}",
            s.estimates()
        );
        // Now the work costs in proportion (128: 4 ms, fits); 256 alone would stay over budget.
        let later = picks(&mut s, &mut t, 40, |n| 8.0 * n as f64 / 256.0);
        let tried = later
            .iter()
            .position(|&w| w != 256)
            .expect("a smaller size is tried again");
        assert!(tried < REMEASURE_TICKS as usize, "{later:?}");
        assert_eq!(
            later[tried], 128,
            "the largest stale size below the cheapest: {later:?}"
        );
        assert!(
            later[tried..].iter().all(|&w| w == 128),
            "kept once it fits: {later:?} {:?}",
            s.estimates()
        );
    }

    #[test]
    fn sizes_that_stay_slow_are_retried_only_now_and_then() {
        let (mut s, mut t) = with_decode_ticks(1.5);
        let sizes = picks(&mut s, &mut t, 64, |n| if n < 256 { 9.0 } else { 6.0 });
        let smaller = sizes[3..].iter().filter(|&&w| w < 256).count();
        assert!(
            (1..=64 / REMEASURE_TICKS as usize + 1).contains(&smaller),
            "{sizes:?}"
        );
    }

    #[test]
    fn a_whole_chunk_takes_the_smallest_size_when_none_fits() {
        // 10 ms of room beside 10 ms decode ticks. 8 tokens cost 4 ms, then 16 cost 10.5 (too
        // much: back to 8); then 8 cost 2 or 14 ms in turn: with its deviation nothing fits,
        // and 16's one time looks cheaper than 8's, but it is 8 that is granted.
        let mut s = ChunkSizer::new(2.0, 8, 16);
        let mut t = Duration::ZERO;
        for _ in 0..3 {
            s.tick_ended(t, 16, 0, 0, true);
            t += ms(10);
            s.tick_started(t);
        }
        let mut at = 0;
        let early = run(
            &mut s,
            &mut t,
            &mut at,
            6,
            |n| if n == 8 { 4.0 } else { 10.5 },
        );
        assert!(early.contains(&16), "{early:?}");
        let flip = std::cell::Cell::new(false);
        let later = run(&mut s, &mut t, &mut at, 12, |n| {
            flip.set(!flip.get());
            if n == 8 {
                if flip.get() {
                    14.0
                } else {
                    2.0
                }
            } else {
                22.0
            }
        });
        assert!(
            later[4..].iter().all(|&n| n == 8),
            "{later:?} {:?}",
            s.estimates()
        );
    }

    #[test]
    fn a_whole_size_that_costs_more_than_its_share_is_not_retried_on_a_smaller_sizes_time() {
        // 8 tokens fit a budget of 2.5x a 10 ms step (6 ms extra, 15 allowed); 16 cost more
        // than twice 8 (20 ms): after its first try, 16 is judged by its own time, stale or
        // not, never by 8's doubled (12 ms, which would fit).
        let mut s = ChunkSizer::new(2.5, 8, 16);
        let mut t = Duration::ZERO;
        let mut prefilled = 0;
        for _ in 0..3 {
            s.tick_ended(t, 16, 0, 0, true);
            t += ms(10);
            s.tick_started(t);
        }
        let sizes = run(&mut s, &mut t, &mut prefilled, 80, |n| {
            if n == 8 {
                6.0
            } else {
                20.0
            }
        });
        let sixteen = sizes.iter().filter(|&&n| n == 16).count();
        assert!(sixteen <= 1, "{sizes:?}");
    }
}
