//! The decode batch: every running sequence's KV cache as one row of per-layer buffers
//! [slots, kv_heads, capacity, head_dim], so that one decode step is one batched forward pass
//! (one RoPE and one KV write per layer for the whole batch; one masked attention over all rows,
//! or, for a batch of few long rows, one unmasked attention per row over its own length).
//!
//! Invariants: active rows are dense, 0..len(); a sequence joins by copying only its own KV into
//! the next row, and leaves by moving the last row into its place, so nobody else's cache is
//! copied or re-padded when the batch changes (buffers grow by doubling rows and by 256-token
//! steps of capacity, which copies everything but happens rarely). Rows past len() are scratch:
//! computed and ignored. With no sequence left, the buffers are freed. A batch of long rows
//! (one that attends row by row) starts at one row: its first sequence's KV, with room to
//! grow, becomes its buffers (nothing else is allocated, zeroed or copied for it).
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

const CAPACITY_STEP: usize = 256;

/// `tokens` rounded up to whole capacity steps.
fn whole_steps(tokens: usize) -> usize {
    tokens.div_ceil(CAPACITY_STEP) * CAPACITY_STEP
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
    /// Per layer: (keys, values), each [slots, kv_heads, capacity, head_dim].
    pub(crate) layers: Vec<(Array, Array)>,
    /// Tokens in each active row's cache.
    lens: Vec<usize>,
    slots: usize,
    capacity: usize,
    kv_heads: i32,
    head_dim: i32,
    dtype: Dtype,
    num_layers: usize,
    /// Per layer, for a recurrent layer: what it keeps per row.
    states: Vec<Option<RowState>>,
    /// While the batch has at most this many rows, they attend row by row over each row's own
    /// length (no mask, MLX's fused vector kernel) instead of in one masked attention over every
    /// row's whole capacity, which MLX runs unfused and which is slow for long rows. 0: never.
    per_row_up_to: usize,
}

impl DecodeBatch {
    /// `states`: per layer, what a recurrent layer keeps per row (None for an attention layer).
    pub(crate) fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: Dtype,
        states: Vec<Option<RowState>>,
    ) -> Self {
        DecodeBatch {
            layers: vec![],
            lens: vec![],
            slots: 0,
            capacity: 0,
            kv_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            dtype,
            num_layers,
            states,
            per_row_up_to: 0,
        }
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

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .enumerate()
            .map(|(l, (k, v))| k.nbytes() + if self.shares_pair(l) { 0 } else { v.nbytes() })
            .sum()
    }

    fn zeros(&self, slots: usize, capacity: usize) -> Result<Array> {
        Ok(zeros_dtype(
            &[slots as i32, self.kv_heads, capacity as i32, self.head_dim],
            self.dtype,
        )?)
    }

    /// Layer `l`'s zeros for `slots` rows of `capacity` positions (a recurrent layer's: its
    /// state's positions, whatever the capacity), first or second of its pair.
    fn zeros_of(&self, l: usize, second: bool, slots: usize, capacity: usize) -> Result<Array> {
        let rows = slots as i32;
        match self.states.get(l).copied().flatten() {
            Some(s) => match s.memory_shape(rows).filter(|_| second) {
                Some(memory) => Ok(zeros_dtype(&memory, Dtype::Float32)?),
                None => Ok(zeros_dtype(&s.inputs_shape(rows), self.dtype)?),
            },
            None => self.zeros(slots, capacity),
        }
    }

    /// A new layer pair of zeros (a convolution layer's two arrays are one).
    fn zero_pair(&self, l: usize, slots: usize, capacity: usize) -> Result<(Array, Array)> {
        let k = self.zeros_of(l, false, slots, capacity)?;
        let v = if self.shares_pair(l) {
            k.clone()
        } else {
            self.zeros_of(l, true, slots, capacity)?
        };
        Ok((k, v))
    }

    /// Evaluates the buffers (for timing what a join costs).
    pub fn eval(&self) -> Result<()> {
        Ok(mlx_rs::transforms::eval(
            self.layers.iter().flat_map(|(k, v)| [k, v]),
        )?)
    }

    /// Makes room for `slots` rows of `capacity` tokens.
    pub(crate) fn reserve(&mut self, slots: usize, capacity: usize) -> Result<()> {
        // Short rows come many at a time; long ones few (a row there is gigabytes).
        let least = if self.per_row_up_to > 0 { 1 } else { 4 };
        let slots = if slots > self.slots {
            slots.max(self.slots * 2).max(least)
        } else {
            self.slots
        };
        let capacity = if capacity > self.capacity {
            whole_steps(capacity)
        } else {
            self.capacity
        };
        if slots == self.slots && capacity == self.capacity {
            return Ok(());
        }
        if self.layers.is_empty() {
            for l in 0..self.num_layers {
                let pair = self.zero_pair(l, slots, capacity)?;
                self.layers.push(pair);
            }
        } else {
            let (old_slots, old_cap) = (self.slots, self.capacity);
            let grown: Result<Vec<(Array, Array)>> = self
                .layers
                .iter()
                .enumerate()
                .map(|(l, (k, v))| {
                    let recurrent = self.is_recurrent(l);
                    let grow = |a: &Array, second: bool| -> Result<Array> {
                        let mut a = a.clone();
                        if capacity > old_cap && !recurrent {
                            a = concatenate(&[a, self.zeros(old_slots, capacity - old_cap)?], 2)?;
                        }
                        if slots > old_slots {
                            a = concatenate(
                                &[a, self.zeros_of(l, second, slots - old_slots, capacity)?],
                                0,
                            )?;
                        }
                        Ok(a)
                    };
                    let k = grow(k, false)?;
                    let v = if self.shares_pair(l) {
                        k.clone()
                    } else {
                        grow(v, true)?
                    };
                    Ok((k, v))
                })
                .collect();
            self.layers = grown?;
        }
        self.slots = slots;
        self.capacity = capacity;
        Ok(())
    }

    /// Moves a prefilled sequence's KV into the next row; returns the row.
    pub fn join(&mut self, cache: &SequenceCache) -> Result<usize> {
        let len = cache.offset();
        let row = self.lens.len();
        // A recurrent layer's row is the sequence's state (which it has from its first input).
        let state = |l: usize| {
            cache.state(l).ok_or_else(|| {
                EngineError::InvalidRequest(format!(
                    "layer {l}'s recurrent state is missing: a sequence with no input cannot join"
                ))
            })
        };
        let contents = |l: usize| {
            cache.contents(l).ok_or_else(|| {
                EngineError::InvalidRequest(
                    "a sliding-window cache cannot join the decode batch".into(),
                )
            })
        };
        if row == 0 && self.per_row_up_to > 0 {
            // The first long row: its own KV plus room to grow are the buffers. A cache whose
            // buffers already have that room lends them (no copy: a long prompt's KV is
            // hundreds of megabytes, seconds of a CPU's time to copy); once the sequence drops
            // its cache, the batch writes into them in place.
            if let Some(layers) = cache.buffers_with_room(len + 1) {
                (self.slots, self.capacity) =
                    (1, layers.first().map_or(0, |(k, _)| k.shape()[2] as usize));
                self.layers = layers;
                self.lens.push(len);
                return Ok(0);
            }
            let capacity = whole_steps(len + 1);
            let room = self.zeros(1, capacity - len)?;
            self.layers = (0..self.num_layers)
                .map(|l| {
                    if self.is_recurrent(l) {
                        let (s, m) = state(l)?;
                        return Ok(if self.shares_pair(l) {
                            (s.clone(), s)
                        } else {
                            (s, m)
                        });
                    }
                    let (ck, cv) = contents(l)?;
                    Ok((
                        concatenate(&[&ck, &room], 2)?,
                        concatenate(&[&cv, &room], 2)?,
                    ))
                })
                .collect::<Result<_>>()?;
            (self.slots, self.capacity) = (1, capacity);
            self.lens.push(len);
            return Ok(0);
        }
        self.reserve(row + 1, len + 1)?;
        let r = row as i32;
        for l in 0..self.num_layers {
            if self.is_recurrent(l) {
                let (s, m) = state(l)?;
                let shared = self.shares_pair(l);
                let (k, v) = &mut self.layers[l];
                k.try_index_mut((r..r + 1, .., .., ..), &s)?;
                if shared {
                    *v = k.clone();
                } else {
                    v.try_index_mut((r..r + 1, .., .., ..), &m)?;
                }
                continue;
            }
            let (ck, cv) = contents(l)?;
            let (k, v) = &mut self.layers[l];
            k.try_index_mut((r..r + 1, .., 0..len as i32, ..), &ck)?;
            v.try_index_mut((r..r + 1, .., 0..len as i32, ..), &cv)?;
        }
        self.lens.push(len);
        Ok(row)
    }

    /// Row `row`'s keys and values per layer, [1, kv_heads, len, head_dim] (lazy views); None
    /// when some layer keeps recurrent states (they cannot be cut back to a prefix).
    pub fn row_contents(&self, row: usize) -> Option<Vec<(Array, Array)>> {
        if self.states.iter().any(Option::is_some) {
            return None;
        }
        let len = *self.lens.get(row)? as i32;
        let r = row as i32;
        Some(
            self.layers
                .iter()
                .map(|(k, v)| {
                    (
                        k.index((r..r + 1, .., ..len, ..)),
                        v.index((r..r + 1, .., ..len, ..)),
                    )
                })
                .collect(),
        )
    }

    /// What the prefix cache keeps of row `row` (see
    /// [`crate::cache::SequenceCache::prefix_layers`]): per layer its keys and values, or a
    /// recurrent layer's state ([`crate::cache::KvCache::state`]).
    pub fn row_prefix(&self, row: usize) -> Option<Vec<(Array, Array)>> {
        let len = *self.lens.get(row)? as i32;
        let r = row as i32;
        Some(
            self.layers
                .iter()
                .enumerate()
                .map(|(l, (k, v))| {
                    if self.shares_pair(l) {
                        (k.index((r..r + 1, .., .., ..)), crate::cache::empty())
                    } else if self.is_recurrent(l) {
                        (
                            k.index((r..r + 1, .., .., ..)),
                            v.index((r..r + 1, .., .., ..)),
                        )
                    } else {
                        (
                            k.index((r..r + 1, .., ..len, ..)),
                            v.index((r..r + 1, .., ..len, ..)),
                        )
                    }
                })
                .collect(),
        )
    }

    /// Removes a row. The last row moves into its place: returns that row's old index, so the
    /// caller can update its map (None when `row` was the last one).
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
        let moved = if row != last {
            let (r, e) = (row as i32, last as i32);
            let shared: Vec<bool> = (0..self.num_layers).map(|l| self.shares_pair(l)).collect();
            for (l, (k, v)) in self.layers.iter_mut().enumerate() {
                let lk = k.index((e..e + 1, .., .., ..));
                k.try_index_mut((r..r + 1, .., .., ..), &lk)?;
                if shared[l] {
                    *v = k.clone();
                    continue;
                }
                let lv = v.index((e..e + 1, .., .., ..));
                v.try_index_mut((r..r + 1, .., .., ..), &lv)?;
            }
            self.lens[row] = self.lens[last];
            Some(last)
        } else {
            None
        };
        self.lens.pop();
        if self.lens.is_empty() {
            self.layers.clear();
            self.slots = 0;
            self.capacity = 0;
        }
        Ok(moved)
    }

    /// Per-row positions of the next token (scratch rows: 0) as an int32 array [slots].
    pub(crate) fn positions(&self) -> Array {
        let mut p: Vec<i32> = self.lens.iter().map(|&l| l as i32).collect();
        p.resize(self.slots, 0);
        Array::from_slice(&p, &[self.slots as i32])
    }

    /// Scatter indices [slots, kv_heads, 1, head_dim] writing each row's new token at its position.
    pub(crate) fn write_index(&self, positions: &Array) -> Result<Array> {
        let p = positions.reshape(&[self.slots as i32, 1, 1, 1])?;
        Ok(broadcast_to(
            &p,
            &[self.slots as i32, self.kv_heads, 1, self.head_dim],
        )?)
    }

    pub(crate) fn advance(&mut self) {
        for l in &mut self.lens {
            *l += 1;
        }
    }
}
