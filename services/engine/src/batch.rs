//! The decode batch: every running sequence's keys and values in a pool of fixed-size blocks,
//! and every recurrent layer's state as one row per sequence, so that one decode step is one
//! batched forward pass (one RoPE and one KV write per layer for the whole batch; one attention
//! over all rows, each through its own block table).
//!
//! The pool: per attention layer, keys and values as token slots [blocks * BLOCK_TOKENS,
//! kv_heads, head_dim]; block b holds slots b * BLOCK_TOKENS.. of each layer. A row's table
//! lists its blocks in position order: position p lives in slot `table[p / BLOCK_TOKENS] *
//! BLOCK_TOKENS + p % BLOCK_TOKENS`. A row takes a block when its next token starts one and
//! gives its blocks back when it leaves, so memory follows the tokens held, not a capacity per
//! row (the slack is at most one partly filled block a row, plus the pool's growth).
//!
//! Invariants: active rows are dense, 0..len(); block 0 is scratch (never in a table: the
//! step's scratch rows write there); a block is in at most one table or in the free list,
//! never both, and every block but 0 is in one of them; a row's table covers its length (and,
//! during a step, its new token). A sequence joins by writing only its own KV into its blocks,
//! and leaves by giving its blocks back and moving the last row's table and states into its
//! place: nobody else's keys are copied when the batch changes. The pool grows by half its
//! size when the free blocks run out (which copies it, rarely) and is freed when the last row
//! leaves. Rows past len() are scratch: computed and ignored.
//!
//! MLX writes a step's keys into the pool in place only while no unevaluated read of the pool
//! is alive: anything read out of it (`row_contents`, `row_prefix`) must be evaluated before
//! the next step is built, or that step copies the whole pool.
//!
//! A recurrent layer holds each row's state instead of keys and values ([`RowState`]): the
//! convolution's kept inputs [slots, 1, kernel - 1, width] and, for a DeltaNet layer, its
//! memory [slots, heads, key_dim, value_dim] float32 as the pair's second array (else the
//! pair's second array is the first). They grow in rows only, and a step replaces them whole.

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{broadcast_to, concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};

use crate::cache::SequenceCache;
use crate::error::{EngineError, Result};

/// Positions a block holds. A multiple of the CPU attention's key tile (64), so that a tile
/// never straddles two blocks; at most 63 positions of a sequence's last block lie unused.
pub const BLOCK_TOKENS: usize = 64;

/// Blocks of a new pool (the scratch block included).
const FIRST_BLOCKS: usize = 16;

/// The slot of position `p` of a row whose block `p / BLOCK_TOKENS` is `block`.
pub(crate) fn slot_of(block: usize, p: usize) -> usize {
    block * BLOCK_TOKENS + p % BLOCK_TOKENS
}

/// Slot of position `p` of a row whose table is `table`.
fn slot(table: &[u32], p: usize) -> i32 {
    slot_of(table[p / BLOCK_TOKENS] as usize, p) as i32
}

/// The slots of a row's first `len` positions, from its table as int32 block ids.
pub(crate) fn slots_of(table: &[i32], len: usize) -> impl Iterator<Item = i32> + '_ {
    (0..len).map(|p| slot_of(table[p / BLOCK_TOKENS] as usize, p) as i32)
}

/// A pool's keys and values at `slots`, as one sequence's [1, kv_heads, n, head_dim].
pub(crate) fn take_slots(pool: &(Array, Array), slots: &[i32]) -> Result<(Array, Array)> {
    let n = slots.len() as i32;
    take_rows(pool, &Array::from_slice(slots, &[n]), 1, n)
}

/// A pool's keys and values at `index` (from [`DecodeBatch::gather_index`]), as `rows` rows of
/// `n` positions each: [rows, kv_heads, n, head_dim].
pub(crate) fn take_rows(
    pool: &(Array, Array),
    index: &Array,
    rows: i32,
    n: i32,
) -> Result<(Array, Array)> {
    let one = |a: &Array| -> Result<Array> {
        let s = a.shape();
        Ok(a.take_axis(index, 0)?
            .reshape(&[rows, n, s[1], s[2]])?
            .transpose_axes(&[0, 2, 1, 3])?)
    };
    Ok((one(&pool.0)?, one(&pool.1)?))
}

/// What a recurrent layer keeps per sequence (a row of the batch, a prefix-cache entry, a chunk
/// sent between workers): see the module's notes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowState {
    /// The convolution's kept inputs (kernel - 1) and their width.
    pub keep: i32,
    pub width: i32,
    /// A DeltaNet layer's memory per row: [heads, key_dim, value_dim].
    pub memory: Option<[i32; 3]>,
}

impl RowState {
    /// The length of the convolution whose inputs it keeps.
    pub fn kernel(&self) -> usize {
        self.keep as usize + 1
    }

    /// The convolution's kept inputs of `rows` rows: [rows, 1, keep, width].
    pub fn inputs_shape(&self, rows: i32) -> [i32; 4] {
        [rows, 1, self.keep, self.width]
    }

    /// A DeltaNet's memory of `rows` rows: [rows, heads, key_dim, value_dim] (float32).
    pub fn memory_shape(&self, rows: i32) -> Option<[i32; 4]> {
        self.memory.map(|[h, dk, dv]| [rows, h, dk, dv])
    }
}

pub struct DecodeBatch {
    /// Per layer: an attention layer's pool of keys and values, each [blocks * BLOCK_TOKENS,
    /// kv_heads, head_dim]; a recurrent layer's row states (see [`RowState`]).
    pub(crate) layers: Vec<(Array, Array)>,
    /// Tokens in each active row's cache.
    lens: Vec<usize>,
    /// Each active row's blocks, in position order.
    tables: Vec<Vec<u32>>,
    /// Blocks no row holds (taken from the end; block 0 is never here).
    free: Vec<u32>,
    /// Blocks of the pool (0: no pool yet).
    blocks: usize,
    /// Rows the step's inputs and the recurrent states have room for.
    slots: usize,
    kv_heads: i32,
    head_dim: i32,
    dtype: Dtype,
    num_layers: usize,
    /// Per layer, for a recurrent layer: what it keeps per row.
    states: Vec<Option<RowState>>,
    /// Per layer, a sliding-window layer's window: its rows attend over their last `window`
    /// positions, and a joining sequence brings only those (all its cache keeps).
    windows: Vec<Option<usize>>,
    /// While the batch has at most this many rows, they attend row by row over each row's own
    /// keys (no mask, MLX's fused vector kernel) where no kernel of llmq's own reads the
    /// pool, instead of in one masked attention over the longest row's keys. 0: never.
    per_row_up_to: usize,
}

impl DecodeBatch {
    /// `states`: per layer, what a recurrent layer keeps per row (None for an attention layer);
    /// `windows`: per layer, a sliding-window layer's window.
    pub(crate) fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: Dtype,
        states: Vec<Option<RowState>>,
        windows: Vec<Option<usize>>,
    ) -> Self {
        DecodeBatch {
            layers: vec![],
            lens: vec![],
            tables: vec![],
            free: vec![],
            blocks: 0,
            slots: 0,
            kv_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            dtype,
            num_layers,
            states,
            windows,
            per_row_up_to: 0,
        }
    }

    /// Whether row `row` still holds every position in every layer (no sliding window has
    /// dropped any): only then can it be read out as a prefix.
    fn whole(&self, row: usize) -> bool {
        let len = self.lens.get(row).copied().unwrap_or(0);
        self.windows.iter().flatten().all(|&w| len < w)
    }

    /// Whether layer `l` keeps recurrent states.
    fn is_recurrent(&self, l: usize) -> bool {
        self.states.get(l).is_some_and(Option::is_some)
    }

    /// Whether layer `l`'s pair holds one array twice (a convolution's state alone).
    fn shares_pair(&self, l: usize) -> bool {
        self.states
            .get(l)
            .copied()
            .flatten()
            .is_some_and(|s| s.memory.is_none())
    }

    /// Rows attend one by one while there are at most `rows` of them (see `per_row_up_to`).
    pub fn with_per_row_attention(mut self, rows: usize) -> Self {
        self.per_row_up_to = rows;
        self
    }

    /// Whether this step's rows attend one by one.
    pub fn per_row_attention(&self) -> bool {
        !self.lens.is_empty() && self.lens.len() <= self.per_row_up_to
    }

    /// Active rows.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Each active row's blocks, in position order.
    pub fn tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    /// Blocks of the pool, and of those the ones no row holds (the scratch block is neither
    /// free nor a row's).
    pub fn pool_blocks(&self) -> (usize, usize) {
        (self.blocks, self.free.len())
    }

    /// The longest table's blocks.
    pub fn table_width(&self) -> usize {
        self.tables.iter().map(Vec::len).max().unwrap_or(0)
    }

    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .enumerate()
            .map(|(l, (k, v))| k.nbytes() + if self.shares_pair(l) { 0 } else { v.nbytes() })
            .sum()
    }

    /// Layer `l`'s zeros: a recurrent layer's states of `rows` rows (first or second of its
    /// pair), an attention layer's pool of `blocks` blocks.
    fn zeros_of(&self, l: usize, second: bool, rows: usize, blocks: usize) -> Result<Array> {
        let rows = rows as i32;
        match self.states.get(l).copied().flatten() {
            Some(s) => match s.memory_shape(rows).filter(|_| second) {
                Some(memory) => Ok(zeros_dtype(&memory, Dtype::Float32)?),
                None => Ok(zeros_dtype(&s.inputs_shape(rows), self.dtype)?),
            },
            None => Ok(zeros_dtype(
                &[(blocks * BLOCK_TOKENS) as i32, self.kv_heads, self.head_dim],
                self.dtype,
            )?),
        }
    }

    /// Layer `l` grown by `rows` rows of states and `blocks` blocks of pool (zeros), each of
    /// its pair (a convolution layer's two arrays are one).
    fn grow_layer(&mut self, l: usize, rows: usize, blocks: usize) -> Result<()> {
        let recurrent = self.is_recurrent(l);
        if (recurrent && rows == 0) || (!recurrent && blocks == 0) {
            return Ok(());
        }
        let grow = |a: Option<&Array>, second: bool| -> Result<Array> {
            let extra = self.zeros_of(l, second, rows, blocks)?;
            Ok(match a {
                Some(a) => concatenate(&[a, &extra], 0)?,
                None => extra,
            })
        };
        let old = self.layers.get(l).cloned();
        let k = grow(old.as_ref().map(|p| &p.0), false)?;
        let v = if self.shares_pair(l) {
            k.clone()
        } else {
            grow(old.as_ref().map(|p| &p.1), true)?
        };
        match self.layers.get_mut(l) {
            Some(pair) => *pair = (k, v),
            None => self.layers.push((k, v)),
        }
        Ok(())
    }

    /// Evaluates the pool and the states (for timing what a join costs).
    pub fn eval(&self) -> Result<()> {
        Ok(mlx_rs::transforms::eval(
            self.layers.iter().flat_map(|(k, v)| [k, v]),
        )?)
    }

    /// Makes room for `slots` rows of inputs and states.
    pub(crate) fn reserve(&mut self, slots: usize) -> Result<()> {
        if slots <= self.slots && !self.layers.is_empty() {
            return Ok(());
        }
        // Short rows come many at a time; long ones few.
        let least = if self.per_row_up_to > 0 { 1 } else { 4 };
        let slots = slots.max(self.slots * 2).max(least);
        let (rows, blocks) = if self.layers.is_empty() {
            (slots, FIRST_BLOCKS)
        } else {
            (slots - self.slots, 0)
        };
        for l in 0..self.num_layers {
            self.grow_layer(l, rows, blocks)?;
        }
        if blocks > 0 {
            self.add_free(0, blocks);
        }
        self.slots = slots;
        Ok(())
    }

    /// Blocks `from..to` (past the scratch block) join the free list, the lowest taken first.
    fn add_free(&mut self, from: usize, to: usize) {
        self.free.extend((from.max(1)..to).rev().map(|b| b as u32));
        self.blocks = to;
    }

    /// `n` blocks from the free list, the pool grown by at least half when it has too few.
    fn take_blocks(&mut self, n: usize) -> Result<Vec<u32>> {
        if self.free.len() < n {
            let blocks = self.blocks + (n - self.free.len()).max(self.blocks / 2);
            let extra = blocks - self.blocks;
            for l in 0..self.num_layers {
                self.grow_layer(l, 0, extra)?;
            }
            // The new blocks go under the free ones, so that the lowest are taken first.
            let old = std::mem::take(&mut self.free);
            self.add_free(self.blocks, blocks);
            self.free.extend(old);
        }
        let at = self.free.len() - n;
        Ok(self.free.split_off(at))
    }

    /// Makes row `row`'s table cover `len` positions.
    fn cover(&mut self, row: usize, len: usize) -> Result<()> {
        let need = len
            .div_ceil(BLOCK_TOKENS)
            .saturating_sub(self.tables[row].len());
        if need > 0 {
            let mut taken = self.take_blocks(need)?;
            taken.reverse();
            self.tables[row].extend(taken);
        }
        Ok(())
    }

    /// Makes room for one more token in every row (a step's).
    pub(crate) fn reserve_step(&mut self) -> Result<()> {
        self.reserve(self.lens.len())?;
        for row in 0..self.lens.len() {
            self.cover(row, self.lens[row] + 1)?;
        }
        Ok(())
    }

    /// Moves a prefilled sequence's KV into the next row's blocks; returns the row.
    pub fn join(&mut self, cache: &SequenceCache) -> Result<usize> {
        let len = cache.offset();
        let row = self.lens.len();
        // Checked before anything changes: a sequence that cannot join leaves no trace.
        let mut parts = Vec::with_capacity(self.num_layers);
        for l in 0..self.num_layers {
            parts.push(if self.is_recurrent(l) {
                cache.state(l).ok_or_else(|| {
                    EngineError::InvalidRequest(format!(
                        "layer {l}'s recurrent state is missing: a sequence with no input cannot join"
                    ))
                })?
            } else {
                // A window keeps its last `window - 1` positions: all the next token sees.
                let kept = self.windows[l].map_or(len, |w| len.min(w - 1));
                let kv = match kept {
                    0 => Some((crate::cache::empty(), crate::cache::empty())),
                    k if k == len => cache.contents(l),
                    k => cache.layers[l].last(k),
                };
                kv.ok_or_else(|| {
                    EngineError::InvalidRequest(format!(
                        "layer {l} no longer keeps the {kept} positions the batch needs"
                    ))
                })?
            });
        }
        self.reserve(row + 1)?;
        self.tables.push(vec![]);
        self.lens.push(len);
        if let Err(e) = self.cover(row, len) {
            self.leave(row)?;
            return Err(e);
        }
        let slots: Vec<i32> = (0..len).map(|p| slot(&self.tables[row], p)).collect();
        // Scatter indices by how many of the last positions a layer brings (all of them, or
        // a sliding window's), each made once.
        let mut indices: Vec<(usize, Array)> = vec![];
        let r = row as i32;
        for (l, (ck, cv)) in parts.into_iter().enumerate() {
            let shared = self.shares_pair(l);
            let kept = ck.shape().get(2).copied().unwrap_or(0) as usize;
            let index = if self.states[l].is_none() && kept > 0 {
                Some(match indices.iter().find(|(n, _)| *n == kept) {
                    Some((_, index)) => index.clone(),
                    None => {
                        let index = self.slot_index(&slots[len - kept..])?;
                        indices.push((kept, index.clone()));
                        index
                    }
                })
            } else {
                None
            };
            let (k, v) = &mut self.layers[l];
            if self.states[l].is_some() {
                k.try_index_mut((r..r + 1, .., .., ..), &ck)?;
                if shared {
                    *v = k.clone();
                } else {
                    v.try_index_mut((r..r + 1, .., .., ..), &cv)?;
                }
            } else if let Some(index) = index {
                *k = k.put_along_axis(&index, as_slots(&ck)?, 0)?;
                *v = v.put_along_axis(&index, as_slots(&cv)?, 0)?;
            }
        }
        Ok(row)
    }

    /// Scatter indices [n, kv_heads, head_dim] writing token i at slot `slots[i]`.
    fn slot_index(&self, slots: &[i32]) -> Result<Array> {
        let n = slots.len() as i32;
        let s = Array::from_slice(slots, &[n, 1, 1]);
        Ok(broadcast_to(&s, &[n, self.kv_heads, self.head_dim])?)
    }

    /// Row `row`'s slots, in position order.
    fn row_slots(&self, row: usize) -> Option<Vec<i32>> {
        let table = self.tables.get(row)?;
        Some((0..self.lens[row]).map(|p| slot(table, p)).collect())
    }

    /// Row `row`'s keys and values per layer, [1, kv_heads, len, head_dim] (lazy reads of the
    /// pool: evaluate them before the next step); None when some layer keeps recurrent states
    /// (they cannot be cut back to a prefix).
    pub fn row_contents(&self, row: usize) -> Option<Vec<(Array, Array)>> {
        if self.states.iter().any(Option::is_some) || !self.whole(row) {
            return None;
        }
        let slots = self.row_slots(row)?;
        self.layers
            .iter()
            .map(|pool| take_slots(pool, &slots).ok())
            .collect()
    }

    /// What the prefix cache keeps of row `row` (see
    /// [`crate::cache::SequenceCache::prefix_layers`]): per layer its keys and values, or a
    /// recurrent layer's state ([`crate::cache::KvCache::state`]); lazy reads, as
    /// [`DecodeBatch::row_contents`].
    pub fn row_prefix(&self, row: usize) -> Option<Vec<(Array, Array)>> {
        if !self.whole(row) {
            return None;
        }
        let slots = self.row_slots(row)?;
        let r = row as i32;
        (0..self.num_layers)
            .map(|l| {
                let (k, v) = &self.layers[l];
                if self.shares_pair(l) {
                    Some((k.index((r..r + 1, .., .., ..)), crate::cache::empty()))
                } else if self.is_recurrent(l) {
                    Some((
                        k.index((r..r + 1, .., .., ..)),
                        v.index((r..r + 1, .., .., ..)),
                    ))
                } else {
                    take_slots(&self.layers[l], &slots).ok()
                }
            })
            .collect()
    }

    /// Removes a row, its blocks freed. The last row moves into its place: returns that row's
    /// old index, so the caller can update its map (None when `row` was the last one).
    pub fn leave(&mut self, row: usize) -> Result<Option<usize>> {
        let last = self
            .lens
            .len()
            .checked_sub(1)
            .ok_or_else(|| EngineError::InvalidRequest("leave from an empty batch".into()))?;
        if row > last {
            return Err(EngineError::InvalidRequest(format!(
                "no row {row} in a batch of {}",
                last + 1
            )));
        }
        let freed = self.tables.swap_remove(row);
        self.free.extend(freed.into_iter().rev());
        self.lens.swap_remove(row);
        let moved = if row != last {
            let (r, e) = (row as i32, last as i32);
            for l in 0..self.num_layers {
                if !self.is_recurrent(l) {
                    continue;
                }
                let shared = self.shares_pair(l);
                let (k, v) = &mut self.layers[l];
                let lk = k.index((e..e + 1, .., .., ..));
                k.try_index_mut((r..r + 1, .., .., ..), &lk)?;
                if shared {
                    *v = k.clone();
                    continue;
                }
                let lv = v.index((e..e + 1, .., .., ..));
                v.try_index_mut((r..r + 1, .., .., ..), &lv)?;
            }
            Some(last)
        } else {
            None
        };
        if self.lens.is_empty() {
            self.layers.clear();
            self.free.clear();
            self.blocks = 0;
            self.slots = 0;
        }
        Ok(moved)
    }

    /// Per-row positions of the next token (scratch rows: 0) as an int32 array [slots].
    pub(crate) fn positions(&self) -> Array {
        let mut p: Vec<i32> = self.lens.iter().map(|&l| l as i32).collect();
        p.resize(self.slots, 0);
        Array::from_slice(&p, &[self.slots as i32])
    }

    /// Scatter indices [slots, kv_heads, head_dim] writing each row's new token into its
    /// slot (scratch rows into the scratch block). Needs [`DecodeBatch::reserve_step`] first.
    pub(crate) fn write_index(&self) -> Result<Array> {
        let mut slots: Vec<i32> = self
            .tables
            .iter()
            .zip(&self.lens)
            .map(|(t, &len)| slot(t, len))
            .collect();
        slots.resize(self.slots, 0);
        self.slot_index(&slots)
    }

    /// Every slot's table padded with the scratch block to `width` blocks, rows first
    /// ([slots, width] as a flat list).
    pub(crate) fn padded_tables(&self, width: usize) -> Vec<i32> {
        let mut out = vec![0i32; self.slots * width];
        for (r, table) in self.tables.iter().enumerate() {
            for (i, &b) in table.iter().enumerate().take(width) {
                out[r * width + i] = b as i32;
            }
        }
        out
    }

    /// Gather indices of every slot's first `width` blocks' positions ([slots * width *
    /// BLOCK_TOKENS], rows first), for [`take_rows`].
    pub(crate) fn gather_index(&self, width: usize) -> Array {
        let tables = self.padded_tables(width);
        let slots: Vec<i32> = tables
            .chunks(width.max(1))
            .flat_map(|t| slots_of(t, width * BLOCK_TOKENS))
            .collect();
        Array::from_slice(&slots, &[slots.len() as i32])
    }

    /// Checks the pool's invariants (see the module's notes); the error names the first one
    /// broken.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut held = vec![false; self.blocks];
        let listed = self.tables.iter().flatten().map(|&b| (b, "a table"));
        for (b, place) in listed.chain(self.free.iter().map(|&b| (b, "the free list"))) {
            match held.get_mut(b as usize) {
                None => return Err(format!("block {b} in {place} lies outside the pool")),
                Some(_) if b == 0 => return Err(format!("the scratch block is in {place}")),
                Some(h) if *h => return Err(format!("block {b} is listed twice ({place})")),
                Some(h) => *h = true,
            }
        }
        if let Some(b) = held.iter().skip(1).position(|h| !h) {
            return Err(format!("block {} is neither free nor held", b + 1));
        }
        for (r, (t, &len)) in self.tables.iter().zip(&self.lens).enumerate() {
            if t.len() * BLOCK_TOKENS < len || t.len() > len.div_ceil(BLOCK_TOKENS) + 1 {
                return Err(format!("row {r}'s {} blocks for {len} positions", t.len()));
            }
        }
        if self.lens.is_empty() && (self.blocks > 0 || !self.layers.is_empty()) {
            return Err("an empty batch holds memory".into());
        }
        Ok(())
    }

    pub(crate) fn advance(&mut self) {
        for l in &mut self.lens {
            *l += 1;
        }
    }
}

/// One sequence's keys or values [1, kv_heads, n, head_dim] as token slots [n, kv_heads,
/// head_dim].
fn as_slots(a: &Array) -> Result<Array> {
    Ok(a.squeeze_axes(&[0])?.transpose_axes(&[1, 0, 2])?)
}
