//! llmq's attention on a CPU: a sequence's new queries over its cache, causal, in f32.
//!
//! MLX's CPU attention computes the whole score matrix and its softmax unfused, and on x86 its
//! `exp` runs one element at a time through libm's `fmaf`: most of a long prompt's prefill
//! (BENCHMARKS.md, "The 2-core CPU"), and the reason a chunk beside
//! decoding streams costs more the further into its prompt it is. This kernel streams over
//! the keys in blocks with a running softmax (no score matrix), with the 8-wide FMAs of AVX2
//! where the CPU has them and an `exp` of plain arithmetic the compiler vectorizes, one task
//! per kv head and tile of queries on the host's cores, and per range of keys where those are
//! too few to keep the cores busy (a chunk of 8 queries of SmolLM2 is 3 tasks for 2 cores
//! otherwise), the ranges' running softmaxes merged in order.
//!
//! Layout: queries [heads, t, d] at the last `t` of `len` positions, keys and values
//! [kv_heads, cap, d] with positions `0..len` written; query `i` sees positions `0..=len-t+i`
//! (the bottom-right causal mask of a chunk). Heads share kv heads in groups (GQA).

use std::ops::Range;

use rayon::prelude::*;

use crate::batch::{slot_of, BLOCK_TOKENS};
use crate::kernels::cpu::elementwise::exp_le0;

/// Keys per block: the block's transposed keys and one row's scores stay in the L1 cache.
const BLOCK: usize = 64;
const _: () = assert!(
    BLOCK_TOKENS.is_multiple_of(BLOCK),
    "a tile of keys lies within one of a pool's blocks"
);
/// Queries per task (times the heads sharing a kv head).
const QUERY_TILE: usize = 8;
/// Fewest keys a task takes when a call's keys are split across tasks.
const MIN_SPLIT_KEYS: usize = 8 * BLOCK;
/// Tasks per core a call is cut into, where its keys allow: with as many tasks as cores, one
/// slow task (or a core lent to another thread) leaves the rest idle.
const TASKS_PER_CORE: usize = 4;

/// The shapes of one call (see the module's layout).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub heads: usize,
    pub kv_heads: usize,
    /// New queries.
    pub t: usize,
    /// Positions written in the cache, the new ones included.
    pub len: usize,
    /// Positions the cache buffers hold.
    pub cap: usize,
    pub d: usize,
}

/// Attention of `q` over `k` and `v` (see the module's layout), scores scaled by `scale`.
/// Returns [heads, t, d].
///
/// # Panics
/// When the slices' lengths do not match `s`, `t > len`, `len > cap`, or the heads are not a
/// multiple of the kv heads.
pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], s: Shape, scale: f32) -> Vec<f32> {
    assert!(
        s.kv_heads > 0 && s.heads.is_multiple_of(s.kv_heads) && s.t <= s.len && s.len <= s.cap,
        "{s:?}"
    );
    assert_eq!(q.len(), s.heads * s.t * s.d, "queries of {s:?}");
    assert!(
        k.len() == s.kv_heads * s.cap * s.d && v.len() == k.len(),
        "keys and values of {s:?}"
    );
    let tiles = s.t.div_ceil(QUERY_TILE);
    let group = s.heads / s.kv_heads;
    let queries = |tile: usize| tile * QUERY_TILE..((tile + 1) * QUERY_TILE).min(s.t);
    // A unit: a kv head's heads for a tile of queries, over keys up to its last query's.
    let parts = split_over_keys(
        s.kv_heads * tiles,
        s.len,
        |unit| 0..s.len - s.t + queries(unit % tiles).end,
        |unit, keys| {
            let layout = Layout::Contiguous { cap: s.cap };
            let tile = queries(unit % tiles);
            run_tile(q, k, v, layout, s, scale, unit / tiles, tile, keys, 0)
        },
    );
    let mut out = vec![0.0; q.len()];
    for (unit, part) in parts.into_iter().enumerate() {
        let (g, first) = (unit / tiles, queries(unit % tiles).start);
        let rows = part.finish();
        let n = rows.len() / (group * s.d);
        for (r, row) in rows.chunks_exact(s.d).enumerate() {
            let (h, i) = (g * group + r / n, first + r % n);
            out[(h * s.t + i) * s.d..][..s.d].copy_from_slice(row);
        }
    }
    out
}

/// A decode step's rows, one query each, over a pool of keys and values: `q` [slots, heads,
/// 1, d]; `k` and `v` token slots [pool slots, kv_heads, d] in blocks of `BLOCK_TOKENS`; row
/// `r` over its first `lens[r]` positions (its new token's included), position p at slot
/// `tables[r][p / BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS` (`tables`: [rows, width]
/// block ids, flat); with a `window`, over only its last `window` of them (a sliding-window
/// layer's); slots past `lens` (scratch rows) get zeros. Returns [slots, heads, 1, d]. Of `s`,
/// `t`, `len` and `cap` are each row's (1, `lens[r]`, unused), whatever `s` says.
#[allow(clippy::too_many_arguments)]
pub fn rows_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tables: &[i32],
    width: usize,
    lens: &[usize],
    window: Option<usize>,
    s: Shape,
    scale: f32,
) -> Vec<f32> {
    let slots = q.len() / (s.heads * s.d).max(1);
    let row_q = s.heads * s.d;
    let pool = k.len() / (s.kv_heads * s.d).max(1);
    assert!(
        lens.len() <= slots
            && v.len() == k.len()
            && tables.len() >= lens.len() * width
            && lens.iter().all(|&l| l <= width * BLOCK_TOKENS),
        "{s:?} for {} rows of {slots} over {width} blocks",
        lens.len()
    );
    assert!(
        tables[..lens.len() * width]
            .iter()
            .all(|&b| b >= 0 && (b as usize + 1) * BLOCK_TOKENS <= pool),
        "a table's block lies outside the pool of {pool} slots"
    );
    let first = |len: usize| window.map_or(0, |w| len.saturating_sub(w));
    let longest = lens.iter().map(|&l| l - first(l)).max().unwrap_or(0);
    // A unit: a row's kv head.
    let parts = split_over_keys(
        lens.len() * s.kv_heads,
        longest,
        |unit| {
            let len = lens[unit / s.kv_heads];
            first(len)..len
        },
        |unit, keys| {
            let (r, g) = (unit / s.kv_heads, unit % s.kv_heads);
            let one = Shape {
                t: 1,
                len: lens[r],
                ..s
            };
            let layout = Layout::Paged {
                table: &tables[r * width..][..width],
                kv_heads: s.kv_heads,
            };
            let q = &q[r * row_q..][..row_q];
            run_tile(q, k, v, layout, one, scale, g, 0..1, keys, first(lens[r]))
        },
    );
    let mut out = vec![0.0; q.len()];
    let group = s.heads / s.kv_heads;
    for (unit, part) in parts.into_iter().enumerate() {
        let (r, g) = (unit / s.kv_heads, unit % s.kv_heads);
        let heads = part.finish();
        out[r * row_q + g * group * s.d..][..heads.len()].copy_from_slice(&heads);
    }
    out
}

/// Where a kv head's keys (and values) lie in the arrays a call reads.
#[derive(Clone, Copy)]
enum Layout<'a> {
    /// [kv_heads, cap, d]: a sequence's own buffers.
    Contiguous { cap: usize },
    /// Token slots [slots, kv_heads, d] of a pool, through a row's table of blocks.
    Paged { table: &'a [i32], kv_heads: usize },
}

impl Layout<'_> {
    /// Where key `j` of kv head `g` starts, and how far apart consecutive keys of its tile of
    /// [`BLOCK`] keys are (a tile never straddles two of a pool's blocks).
    fn at(&self, g: usize, j: usize, d: usize) -> (usize, usize) {
        match *self {
            Layout::Contiguous { cap } => ((g * cap + j) * d, d),
            Layout::Paged { table, kv_heads } => {
                let slot = slot_of(table[j / BLOCK_TOKENS] as usize, j);
                ((slot * kv_heads + g) * d, kv_heads * d)
            }
        }
    }
}

/// Runs `units` of attention on the host's cores, each unit's keys (`span(unit)`, at most
/// `longest` of them, from the start of the [`BLOCK`] holding its first) cut into as many
/// ranges as balance the cores (whole blocks, at least `MIN_SPLIT_KEYS` each): `run(unit,
/// keys)` gives a range's running softmax (keys before the span's start masked by the run),
/// and each unit's ranges are merged in order (the result does not depend on which core ran
/// what).
fn split_over_keys(
    units: usize,
    longest: usize,
    span: impl Fn(usize) -> Range<usize> + Sync,
    run: impl Fn(usize, Range<usize>) -> Partial + Sync,
) -> Vec<Partial> {
    let wanted = (TASKS_PER_CORE * rayon::current_num_threads()).div_ceil(units.max(1));
    let splits = wanted.min(longest / MIN_SPLIT_KEYS).max(1);
    let parts: Vec<Partial> = (0..units * splits)
        .into_par_iter()
        .map(|task| {
            let (unit, split) = (task / splits, task % splits);
            let keys = span(unit);
            let (from, end) = (keys.start / BLOCK * BLOCK, keys.end);
            let step = (end - from.min(end))
                .div_ceil(splits)
                .next_multiple_of(BLOCK);
            run(
                unit,
                (from + split * step).min(end)..(from + (split + 1) * step).min(end),
            )
        })
        .collect();
    let mut parts = parts.into_iter();
    (0..units)
        .map(|_| {
            let mut unit = parts.next().expect("a task per split");
            for other in parts.by_ref().take(splits - 1) {
                unit.merge(other);
            }
            unit
        })
        .collect()
}

/// A running softmax over some of the keys, per row: the largest score, the sum of the
/// scores' exponentials relative to it, and the values weighted by them (unnormalised, [rows,
/// d]). A row that saw no key has max -inf and sums 0.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
    /// Adds the same rows' running softmax over other keys.
    fn merge(&mut self, other: Partial) {
        let d = self.acc.len() / self.max.len().max(1);
        for r in 0..self.max.len() {
            if other.sum[r] == 0.0 {
                continue;
            }
            let m = self.max[r].max(other.max[r]);
            let (a, b) = (exp_le0(self.max[r] - m), exp_le0(other.max[r] - m));
            self.sum[r] = self.sum[r] * a + other.sum[r] * b;
            self.max[r] = m;
            for (x, &y) in self.acc[r * d..][..d]
                .iter_mut()
                .zip(&other.acc[r * d..][..d])
            {
                *x = *x * a + y * b;
            }
        }
    }

    /// The rows' attention: the weighted values over the sums ([rows, d]).
    fn finish(mut self) -> Vec<f32> {
        let d = self.acc.len() / self.max.len().max(1);
        for (out, &sum) in self.acc.chunks_exact_mut(d.max(1)).zip(&self.sum) {
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            for o in out {
                *o *= inv;
            }
        }
        self.acc
    }
}

/// One task: the heads of kv head `g` for `queries` over the positions `keys`. Rows are (head
/// in the group, query), query fastest.
#[allow(clippy::too_many_arguments)]
fn run_tile(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: Layout,
    s: Shape,
    scale: f32,
    g: usize,
    queries: Range<usize>,
    keys: Range<usize>,
    first: usize,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { tile_avx2(q, k, v, layout, s, scale, g, queries, keys, first) };
    }
    tile::<false>(q, k, v, layout, s, scale, g, queries, keys, first)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: Layout,
    s: Shape,
    scale: f32,
    g: usize,
    queries: Range<usize>,
    keys: Range<usize>,
    first: usize,
) -> Partial {
    tile::<true>(q, k, v, layout, s, scale, g, queries, keys, first)
}

/// `a * b + c`, fused where the caller is compiled with FMA (elsewhere `mul_add` would be a
/// libm call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// A running softmax over blocks of `keys` for each row of the tile (positions past a row's
/// last, and before `first`, are masked).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<const FMA: bool>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: Layout,
    s: Shape,
    scale: f32,
    g: usize,
    queries: Range<usize>,
    keys: Range<usize>,
    first: usize,
) -> Partial {
    let (d, n) = (s.d, queries.len());
    let group = s.heads / s.kv_heads;
    let rows = group * n;
    // Rows' queries, scaled; the last key each may see.
    let mut qs = vec![0.0f32; rows * d];
    let mut last = vec![0usize; rows];
    for r in 0..rows {
        let (h, i) = (g * group + r / n, queries.start + r % n);
        for (dst, src) in qs[r * d..][..d]
            .iter_mut()
            .zip(&q[(h * s.t + i) * d..][..d])
        {
            *dst = src * scale;
        }
        last[r] = s.len - s.t + i;
    }
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut rescale = vec![0.0f32; rows];
    let mut sum = vec![0.0f32; rows];
    let mut acc = vec![0.0f32; rows * d];
    let mut kt = vec![0.0f32; d * BLOCK];
    let mut scores = vec![[0.0f32; BLOCK]; rows];
    let end = last.iter().max().map_or(0, |&l| l + 1).min(keys.end);
    for j0 in (keys.start..end).step_by(BLOCK) {
        let b = BLOCK.min(end - j0);
        let (at, stride) = layout.at(g, j0, d);
        // The block's keys transposed, [d][BLOCK]: a row's scores are then FMAs across keys.
        for jj in 0..b {
            for (c, &x) in k[at + jj * stride..][..d].iter().enumerate() {
                kt[c * BLOCK + jj] = x;
            }
        }
        let live: Vec<usize> = (0..rows).filter(|&r| last[r] >= j0).collect();
        block_scores::<FMA>(&qs, &kt, d, &live, &mut scores);
        // Keys before `first` (a window's start, in the range's first block only) are masked.
        let skip = first.saturating_sub(j0).min(b);
        for &r in &live {
            let seen = (last[r] + 1 - j0).min(b);
            scores[r][..skip.min(seen)].fill(f32::NEG_INFINITY);
            let (sc, masked) = scores[r][..b].split_at_mut(seen);
            let new_max = max[r].max(lanes(sc, f32::NEG_INFINITY, f32::max));
            rescale[r] = exp_le0(max[r] - new_max);
            for x in sc.iter_mut() {
                *x = exp_le0(*x - new_max);
            }
            masked.fill(0.0);
            sum[r] = sum[r] * rescale[r] + lanes(sc, 0.0, |a, b| a + b);
            max[r] = new_max;
        }
        let block = Values {
            v: &v[at..],
            stride,
            keys: b,
        };
        let mut groups = live.chunks_exact(3);
        for g in &mut groups {
            accumulate::<FMA, 3>(&mut acc, d, [g[0], g[1], g[2]], &rescale, &scores, block);
        }
        match *groups.remainder() {
            [r0, r1] => accumulate::<FMA, 2>(&mut acc, d, [r0, r1], &rescale, &scores, block),
            [r0] => accumulate::<FMA, 1>(&mut acc, d, [r0], &rescale, &scores, block),
            _ => {}
        }
    }
    Partial { max, sum, acc }
}

/// `xs` folded with `f` in 8 independent lanes, then across them: a fold the compiler can
/// vectorize (a float sum in order cannot be reordered, and waits on each addition).
#[inline(always)]
fn lanes(xs: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] = f(acc[l], c[l]);
        }
    }
    chunks
        .remainder()
        .iter()
        .fold(acc.into_iter().fold(init, &f), |a, &x| f(a, x))
}

/// Scores of the `live` rows over a block's keys (`kt`, [d][BLOCK]), two rows and half a block
/// at a time: 8 vector accumulators that stay in registers, each key vector loaded once for two
/// rows.
#[inline(always)]
fn block_scores<const FMA: bool>(
    qs: &[f32],
    kt: &[f32],
    d: usize,
    live: &[usize],
    scores: &mut [[f32; BLOCK]],
) {
    const HALF: usize = BLOCK / 2;
    for pair in live.chunks(2) {
        let (r0, r1) = (pair[0], pair[pair.len() - 1]);
        for h in 0..2 {
            let mut a = [[0.0f32; HALF]; 2];
            for c in 0..d {
                let kc: &[f32; HALF] = kt[c * BLOCK + h * HALF..][..HALF]
                    .try_into()
                    .expect("a half block");
                let (q0, q1) = (qs[r0 * d + c], qs[r1 * d + c]);
                for l in 0..HALF {
                    a[0][l] = madd::<FMA>(q0, kc[l], a[0][l]);
                    a[1][l] = madd::<FMA>(q1, kc[l], a[1][l]);
                }
            }
            scores[r0][h * HALF..][..HALF].copy_from_slice(&a[0]);
            scores[r1][h * HALF..][..HALF].copy_from_slice(&a[1]);
        }
    }
}

/// Columns of the values one pass of `accumulate` takes: `R` rows' accumulators of this width
/// (three rows: 12 AVX registers) stay in registers across the block's keys.
const WIDTH: usize = 32;

/// A tile's values: value `j` at `v[j * stride..][..d]`.
#[derive(Clone, Copy)]
struct Values<'a> {
    v: &'a [f32],
    stride: usize,
    keys: usize,
}

/// For the rows `rows` of `acc` ([rows, d]): `acc[r] = acc[r] * rescale[r] + sum_j p[r][j] v_j`
/// over the block's values (`block`; `p` is `scores`, zero past a row's last key).
/// Each value vector is loaded once for `R` rows, [`WIDTH`] columns (or, where `d` is not a
/// multiple of it, all of them) at a time.
#[inline(always)]
fn accumulate<const FMA: bool, const R: usize>(
    acc: &mut [f32],
    d: usize,
    rows: [usize; R],
    rescale: &[f32],
    scores: &[[f32; BLOCK]],
    block: Values,
) {
    let (keys, stride) = (block.keys, block.stride);
    if !d.is_multiple_of(WIDTH) {
        for &r in &rows {
            let out = &mut acc[r * d..][..d];
            for o in out.iter_mut() {
                *o *= rescale[r];
            }
            for (j, &p) in scores[r][..keys].iter().enumerate() {
                for (o, &x) in out.iter_mut().zip(&block.v[j * stride..][..d]) {
                    *o = madd::<FMA>(p, x, *o);
                }
            }
        }
        return;
    }
    for c in (0..d).step_by(WIDTH) {
        let mut a = [[0.0f32; WIDTH]; R];
        for (k, &r) in rows.iter().enumerate() {
            for (x, &o) in a[k].iter_mut().zip(&acc[r * d + c..][..WIDTH]) {
                *x = o * rescale[r];
            }
        }
        for (j, value) in block.v.chunks(stride).take(keys).enumerate() {
            let v: &[f32; WIDTH] = value[c..][..WIDTH].try_into().expect("a width of columns");
            for k in 0..R {
                let p = scores[rows[k]][j];
                for l in 0..WIDTH {
                    a[k][l] = madd::<FMA>(p, v[l], a[k][l]);
                }
            }
        }
        for (k, &r) in rows.iter().enumerate() {
            acc[r * d + c..][..WIDTH].copy_from_slice(&a[k]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain definition: scores, a causal mask, a softmax in f64, the weighted values.
    fn reference(q: &[f32], k: &[f32], v: &[f32], s: Shape, scale: f32) -> Vec<f32> {
        let mut out = vec![0.0; q.len()];
        let group = s.heads / s.kv_heads;
        for h in 0..s.heads {
            let g = h / group;
            for i in 0..s.t {
                let last = s.len - s.t + i;
                let qr = &q[(h * s.t + i) * s.d..][..s.d];
                let sc: Vec<f64> = (0..=last)
                    .map(|j| {
                        qr.iter()
                            .zip(&k[(g * s.cap + j) * s.d..][..s.d])
                            .map(|(a, b)| (a * b) as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..s.d {
                    let x: f64 = (0..=last)
                        .map(|j| e[j] * v[(g * s.cap + j) * s.d + c] as f64)
                        .sum();
                    out[(h * s.t + i) * s.d + c] = (x / z) as f32;
                }
            }
        }
        out
    }

    fn random(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    #[test]
    fn decode_rows_attend_over_their_own_lengths() {
        let mut seed = 11;
        let s = Shape {
            heads: 6,
            kv_heads: 2,
            t: 1,
            len: 0,
            cap: 40,
            d: 32,
        };
        let (slots, lens) = (4, [1usize, 40, 17]);
        rows_match(s, slots, &lens, &mut seed);
        // Rows ending at, just past and well past a block's end.
        rows_match(s, 4, &[64, 65, 129, 200], &mut seed);
        // Rows long enough for their keys to be split across tasks, one of them not.
        let s = Shape {
            heads: 9,
            kv_heads: 3,
            t: 1,
            len: 0,
            cap: 1700,
            d: 64,
        };
        rows_match(s, 2, &[1700], &mut seed);
        rows_match(s, 3, &[1033, 30], &mut seed);
        // A sliding window: rows shorter than it, longer, its start mid-block and on a block's
        // edge, keys split across tasks.
        for w in [5, 64, 100, 1000] {
            rows_match_window(s, 5, &[3, 64, 130, 1700], Some(w), &mut seed);
        }
    }

    /// Rows over a pool whose blocks are handed out in a shuffled order (a row's blocks are
    /// neither consecutive nor ascending), each against the definition over its own keys
    /// copied out in order.
    fn rows_match(s: Shape, slots: usize, lens: &[usize], seed: &mut u64) {
        rows_match_window(s, slots, lens, None, seed);
    }

    /// `rows_match` with the rows over only their last `window` positions.
    fn rows_match_window(
        s: Shape,
        slots: usize,
        lens: &[usize],
        window: Option<usize>,
        seed: &mut u64,
    ) {
        let width = lens
            .iter()
            .map(|l| l.div_ceil(BLOCK_TOKENS))
            .max()
            .unwrap_or(1);
        let blocks = 1 + lens.len() * width + 3;
        let mut order: Vec<i32> = (1..blocks as i32).collect();
        for i in (1..order.len()).rev() {
            let j = random(1, seed)[0].abs() as usize * 7919 % (i + 1);
            order.swap(i, j);
        }
        let mut tables = vec![0i32; lens.len() * width];
        for (r, &len) in lens.iter().enumerate() {
            for b in 0..len.div_ceil(BLOCK_TOKENS) {
                tables[r * width + b] = order[r * width + b];
            }
        }
        let slot_kv = s.kv_heads * s.d;
        let q = random(slots * s.heads * s.d, seed);
        let k = random(blocks * BLOCK_TOKENS * slot_kv, seed);
        let v = random(blocks * BLOCK_TOKENS * slot_kv, seed);
        let got = rows_attention(&q, &k, &v, &tables, width, lens, window, s, 0.3);
        let row_q = s.heads * s.d;
        for (r, &len) in lens.iter().enumerate() {
            // This row's keys in order from its window's first, [kv_heads, n, d].
            let first = window.map_or(0, |w| len.saturating_sub(w));
            let n = len - first;
            let own = |pool: &[f32]| -> Vec<f32> {
                let mut out = vec![0.0; s.kv_heads * n * s.d];
                for p in first..len {
                    let b = tables[r * width + p / BLOCK_TOKENS] as usize;
                    let slot = b * BLOCK_TOKENS + p % BLOCK_TOKENS;
                    for g in 0..s.kv_heads {
                        out[(g * n + p - first) * s.d..][..s.d]
                            .copy_from_slice(&pool[(slot * s.kv_heads + g) * s.d..][..s.d]);
                    }
                }
                out
            };
            let one = Shape {
                len: n,
                cap: n,
                ..s
            };
            let want = reference(&q[r * row_q..][..row_q], &own(&k), &own(&v), one, 0.3);
            let worst = got[r * row_q..][..row_q]
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 2e-5, "row {r}: {worst}");
        }
        assert!(
            got[lens.len() * row_q..].iter().all(|&x| x == 0.0),
            "a scratch row is zeros"
        );
    }

    #[test]
    fn matches_the_definition_for_chunks_rows_and_head_groups() {
        let mut seed = 7;
        for s in [
            Shape {
                heads: 9,
                kv_heads: 3,
                t: 1,
                len: 1,
                cap: 16,
                d: 64,
            },
            Shape {
                heads: 9,
                kv_heads: 3,
                t: 1,
                len: 300,
                cap: 320,
                d: 64,
            },
            Shape {
                heads: 4,
                kv_heads: 4,
                t: 37,
                len: 37,
                cap: 64,
                d: 32,
            },
            Shape {
                heads: 8,
                kv_heads: 2,
                t: 20,
                len: 200,
                cap: 256,
                d: 128,
            },
            Shape {
                heads: 2,
                kv_heads: 1,
                t: 65,
                len: 130,
                cap: 130,
                d: 16,
            },
            // Keys split across tasks: ranges of whole blocks, some past a row's last key.
            Shape {
                heads: 9,
                kv_heads: 3,
                t: 8,
                len: 2100,
                cap: 2200,
                d: 64,
            },
            Shape {
                heads: 4,
                kv_heads: 1,
                t: 300,
                len: 1100,
                cap: 1100,
                d: 32,
            },
        ] {
            let q = random(s.heads * s.t * s.d, &mut seed);
            let k = random(s.kv_heads * s.cap * s.d, &mut seed);
            let v = random(s.kv_heads * s.cap * s.d, &mut seed);
            let scale = 1.0 / (s.d as f32).sqrt();
            let (got, want) = (
                causal_attention(&q, &k, &v, s, scale),
                reference(&q, &k, &v, s, scale),
            );
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 2e-5, "{s:?}: {worst}");
        }
    }
}
