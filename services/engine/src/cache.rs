//! KV caches: one trait for every architecture, two kinds of storage.
//!
//! A [`SequenceCache`] holds one [`KvCache`] per layer for one sequence. Sequences never share a
//! buffer, so a sequence joins or leaves a batch without touching anybody else's cache.
//! Invariants: `offset()` is the absolute position of the next token; `update` returns exactly
//! the keys the new queries may see, with the mask that makes attention causal (and windowed).

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use crate::error::Result;

/// How the new queries of an `update` attend to the returned keys.
pub enum AttnMask {
    /// Every query sees every returned key (a single decoded token).
    None,
    /// Query i sees keys up to its own position; the queries are the last keys (bottom-right).
    Causal,
    /// Boolean [T, L] mask, true where attention is allowed.
    Explicit(Array),
}

pub trait KvCache: Send {
    /// Tokens seen so far: the position of the next token.
    fn offset(&self) -> usize;
    /// Appends keys/values [1, kv_heads, T, head_dim]; returns what the T queries attend to.
    fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, AttnMask)>;
    /// Forgets the last `n` tokens written (a padded chunk's padding): the next token is
    /// written at `offset() - n`, over them.
    fn rewind(&mut self, n: usize) -> Result<()> {
        let _ = n;
        Err(crate::EngineError::InvalidRequest(
            "this cache cannot rewind".into(),
        ))
    }
    /// Bytes of device memory held.
    fn nbytes(&self) -> usize;
    /// Every position's keys and values [1, kv_heads, offset, head_dim], when this cache keeps
    /// them all (a sliding-window cache only until its window first drops a token).
    fn contents(&self) -> Option<(Array, Array)> {
        None
    }
    /// The keys and values of the last `n` positions written [1, kv_heads, n, head_dim], when
    /// this cache still keeps them (a sliding window keeps its last `window - 1`).
    fn last(&self, n: usize) -> Option<(Array, Array)>;
    /// A recurrent layer's state as the decode batch keeps a row of it: the convolution's kept
    /// inputs [1, 1, kernel - 1, width] and, for a DeltaNet layer, its memory [1, heads,
    /// key_dim, value_dim] (else an empty array); None for keys and values or before any input.
    fn state(&self) -> Option<(Array, Array)> {
        None
    }
    /// A DeltaNet layer's memory (see [`ConvCache`]), None elsewhere or before any input.
    fn memory(&self) -> Option<&Array> {
        None
    }
    /// Takes a recurrent layer's state after `n` more positions, computed elsewhere (another
    /// worker's prefill): the pair [`KvCache::state`] gives.
    fn install_state(&mut self, inputs: &Array, memory: &Array, n: usize) -> Result<()> {
        let _ = (inputs, memory, n);
        Err(crate::EngineError::InvalidRequest(
            "this cache keeps keys and values, not a recurrent state".into(),
        ))
    }
    /// Replaces a DeltaNet layer's memory with the one after the positions its last update
    /// took.
    fn set_memory(&mut self, memory: Array) -> Result<()> {
        let _ = memory;
        Err(crate::EngineError::InvalidRequest(
            "this cache keeps no recurrent memory".into(),
        ))
    }
    /// Whether this cache keeps a recurrent state (which keys and values cannot continue).
    fn recurrent(&self) -> bool {
        false
    }
    /// The whole buffers [1, kv_heads, capacity, head_dim] whose first `offset` positions are
    /// written, when this cache keeps positions in order in such buffers (what llmq's CPU
    /// attention reads).
    fn buffers(&self) -> Option<(&Array, &Array)> {
        None
    }
}

/// Grows geometrically (in whole steps) and writes new tokens in place: decode copies nothing
/// that already exists. Its first buffers hold at least `room` positions: a sequence whose
/// length is known (a prompt) is never copied to grow while it is prefilled.
pub struct StandardCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    step: usize,
    room: usize,
}

impl StandardCache {
    pub fn new(step: usize) -> Self {
        Self::with_room(step, 0)
    }

    /// A cache whose first buffers hold at least `room` positions.
    pub fn with_room(step: usize, room: usize) -> Self {
        StandardCache {
            keys: None,
            values: None,
            offset: 0,
            step: step.max(1),
            room,
        }
    }

    fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize)
    }

    /// A cache that starts with the first `n` positions of keys/values [1, kv_heads, >=n, d]
    /// (a prefix-cache hit): copied into a buffer of its own with room for `capacity` tokens
    /// (the whole prompt, so that prefilling the rest does not grow it), in whole steps.
    pub fn with_prefix(
        step: usize,
        k: &Array,
        v: &Array,
        n: usize,
        capacity: usize,
    ) -> Result<Self> {
        let mut c = StandardCache::new(step);
        let cap = n.max(capacity).div_ceil(c.step).max(1) * c.step;
        let (ks, vs) = (
            k.index((.., .., ..n as i32, ..)),
            v.index((.., .., ..n as i32, ..)),
        );
        c.keys = Some(grow(Some(&ks), &ks, cap - n)?);
        c.values = Some(grow(Some(&vs), &vs, cap - n)?);
        c.offset = n;
        Ok(c)
    }
}

fn grow(buf: Option<&Array>, like: &Array, extra: usize) -> Result<Array> {
    let s = like.shape();
    let pad = zeros_dtype(&[s[0], s[1], extra as i32, s[3]], like.dtype())?;
    Ok(match buf {
        Some(b) => concatenate(&[b, &pad], 2)?,
        None => pad,
    })
}

impl KvCache for StandardCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, AttnMask)> {
        let t = k.shape()[2] as usize;
        let end = self.offset + t;
        if end > self.capacity() {
            // Geometric growth: a long prompt prefilled in chunks copies its cache O(log n)
            // times, not once per chunk.
            let target = end
                .max(2 * self.capacity())
                .max(self.room)
                .div_ceil(self.step)
                * self.step;
            let extra = target - self.capacity();
            self.keys = Some(grow(self.keys.as_ref(), k, extra)?);
            self.values = Some(grow(self.values.as_ref(), v, extra)?);
        }
        let (o, e) = (self.offset as i32, end as i32);
        let keys = self.keys.as_mut().expect("allocated above");
        keys.try_index_mut((.., .., o..e, ..), k)?;
        let values = self.values.as_mut().expect("allocated above");
        values.try_index_mut((.., .., o..e, ..), v)?;
        self.offset = end;
        // New tokens attend over the keys up to their end, a chunk bottom-right causal: MLX
        // runs that as one fused (cuDNN) attention, where an explicit mask over the buffer
        // would take MLX's unfused path, several times slower. The fused kernel is planned once
        // per shape, which is why the model pads chunks to a grid of positions on a GPU
        // (`Model::chunk_grid`).
        let mask = if t == 1 {
            AttnMask::None
        } else {
            AttnMask::Causal
        };
        Ok((
            keys.index((.., .., ..e, ..)),
            values.index((.., .., ..e, ..)),
            mask,
        ))
    }

    fn buffers(&self) -> Option<(&Array, &Array)> {
        self.keys.as_ref().zip(self.values.as_ref())
    }

    fn last(&self, n: usize) -> Option<(Array, Array)> {
        let (o, e) = (self.offset.checked_sub(n)? as i32, self.offset as i32);
        Some((
            self.keys.as_ref()?.index((.., .., o..e, ..)),
            self.values.as_ref()?.index((.., .., o..e, ..)),
        ))
    }

    fn rewind(&mut self, n: usize) -> Result<()> {
        if n > self.offset {
            return Err(crate::EngineError::InvalidRequest(format!(
                "rewind of {n} tokens from position {}",
                self.offset
            )));
        }
        self.offset -= n;
        Ok(())
    }

    fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.nbytes())
            + self.values.as_ref().map_or(0, |v| v.nbytes())
    }

    fn contents(&self) -> Option<(Array, Array)> {
        let e = self.offset as i32;
        Some((
            self.keys.as_ref()?.index((.., .., ..e, ..)),
            self.values.as_ref()?.index((.., .., ..e, ..)),
        ))
    }
}

/// Sliding-window attention: keeps only the last `window - 1` tokens, which is all that any
/// later query can see, so its memory is bounded however long the sequence grows.
pub struct RotatingCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    window: usize,
}

impl RotatingCache {
    pub fn new(window: usize) -> Self {
        RotatingCache {
            keys: None,
            values: None,
            offset: 0,
            window: window.max(1),
        }
    }

    /// A cache that starts with the first `n` positions of keys/values; only possible while
    /// nothing has left the window (`n < window`), which is all `contents` ever hands out.
    pub fn with_prefix(window: usize, k: &Array, v: &Array, n: usize) -> Result<Self> {
        let mut c = RotatingCache::new(window);
        if n >= c.window {
            return Err(crate::EngineError::InvalidRequest(format!(
                "a prefix of {n} tokens does not fit a window of {window}"
            )));
        }
        if n > 0 {
            c.keys = Some(k.index((.., .., ..n as i32, ..)));
            c.values = Some(v.index((.., .., ..n as i32, ..)));
        }
        c.offset = n;
        Ok(c)
    }
}

impl KvCache for RotatingCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, AttnMask)> {
        let t = k.shape()[2] as usize;
        let kept = self.keys.as_ref().map_or(0, |a| a.shape()[2] as usize);
        let (keys, values) = match (&self.keys, &self.values) {
            (Some(pk), Some(pv)) => (concatenate(&[pk, k], 2)?, concatenate(&[pv, v], 2)?),
            _ => (k.clone(), v.clone()),
        };
        let len = kept + t;
        let first = self.offset - kept; // absolute position of keys[0]
        let mask = if t == 1 && len <= self.window {
            AttnMask::None
        } else {
            let mut m = Vec::with_capacity(t * len);
            for i in 0..t {
                let q = self.offset + i;
                for j in 0..len {
                    let p = first + j;
                    m.push(p <= q && p + self.window > q);
                }
            }
            AttnMask::Explicit(Array::from_slice(&m, &[t as i32, len as i32]))
        };
        let keep = len.min(self.window - 1) as i32;
        let start = len as i32 - keep;
        self.keys = (keep > 0).then(|| keys.index((.., .., start.., ..)));
        self.values = (keep > 0).then(|| values.index((.., .., start.., ..)));
        self.offset += t;
        Ok((keys, values, mask))
    }

    fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.nbytes())
            + self.values.as_ref().map_or(0, |v| v.nbytes())
    }

    fn last(&self, n: usize) -> Option<(Array, Array)> {
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        let kept = k.shape()[2] as usize;
        let from = kept.checked_sub(n)? as i32;
        Some((k.index((.., .., from.., ..)), v.index((.., .., from.., ..))))
    }

    /// Every position, as long as the window has not dropped any (a wrapped cache cannot be
    /// resumed at an earlier position: the keys it would need are gone).
    fn contents(&self) -> Option<(Array, Array)> {
        let (k, v) = (self.keys.as_ref()?, self.values.as_ref()?);
        (k.shape()[2] as usize == self.offset).then(|| (k.clone(), v.clone()))
    }
}

/// The state of a short causal convolution (LFM2's conv layers, and the convolution in front of
/// a gated DeltaNet): the last `kernel - 1` inputs it has seen, zeros before the sequence's
/// start. Its "keys" are those inputs ([1, 1, T, width]); `update` returns the window a chunk
/// convolves over: the state followed by the chunk, [1, 1, kernel - 1 + T, width] (the values
/// are the same; the mask says nothing). A DeltaNet layer also keeps its memory here (the
/// matrices its rule updates, [1, heads, key_dim, value_dim] float32), which the layer reads
/// and replaces itself.
///
/// Unlike keys and values, the state of a longer sequence cannot be cut back to a prefix, so
/// this cache hands out no contents and cannot rewind: a prefix-cache entry or a padded chunk
/// would need the state as it was.
pub struct ConvCache {
    state: Option<Array>,
    memory: Option<Array>,
    offset: usize,
    kernel: usize,
}

impl ConvCache {
    pub fn new(kernel: usize) -> Self {
        ConvCache {
            state: None,
            memory: None,
            offset: 0,
            kernel: kernel.max(1),
        }
    }

    /// A cache resuming at position `offset` from `state` [1, 1, kernel - 1, width], the
    /// state after that position's input (a prefix-cache entry's), and a DeltaNet layer's
    /// `memory` as it was then.
    pub fn resumed(kernel: usize, state: &Array, memory: Option<&Array>, offset: usize) -> Self {
        ConvCache {
            state: Some(state.clone()),
            memory: memory.cloned(),
            offset,
            kernel: kernel.max(1),
        }
    }
}

impl KvCache for ConvCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update(&mut self, k: &Array, _v: &Array) -> Result<(Array, Array, AttnMask)> {
        let s = k.shape();
        let keep = self.kernel as i32 - 1;
        let window = match &self.state {
            Some(state) => concatenate(&[state, k], 2)?,
            None => {
                let zeros = zeros_dtype(&[1, s[1], keep, s[3]], k.dtype())?;
                concatenate(&[&zeros, k], 2)?
            }
        };
        // Kept from the first input on, even empty (a kernel of one position).
        let len = window.shape()[2];
        self.state = Some(window.index((.., .., len - keep.., ..)));
        self.offset += s[2] as usize;
        Ok((window.clone(), window, AttnMask::None))
    }

    fn nbytes(&self) -> usize {
        self.state
            .iter()
            .chain(&self.memory)
            .map(|s| s.nbytes())
            .sum()
    }

    fn last(&self, _n: usize) -> Option<(Array, Array)> {
        None
    }

    fn state(&self) -> Option<(Array, Array)> {
        let state = self.state.clone()?;
        Some((state, self.memory.clone().unwrap_or_else(empty)))
    }

    fn memory(&self) -> Option<&Array> {
        self.memory.as_ref()
    }

    fn install_state(&mut self, inputs: &Array, memory: &Array, n: usize) -> Result<()> {
        self.state = Some(inputs.clone());
        if memory.size() > 0 {
            self.memory = Some(memory.clone());
        }
        self.offset += n;
        Ok(())
    }

    fn set_memory(&mut self, memory: Array) -> Result<()> {
        self.memory = Some(memory);
        Ok(())
    }

    fn recurrent(&self) -> bool {
        true
    }

    /// Only by nothing: the inputs a state has shifted out are gone.
    fn rewind(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        Err(crate::EngineError::InvalidRequest(
            "a convolution's state cannot rewind".into(),
        ))
    }
}

/// The empty array a recurrent layer's prefix entry pairs its state with.
pub(crate) fn empty() -> Array {
    Array::from_slice::<f32>(&[], &[0])
}

/// One sequence's caches, one per layer.
pub struct SequenceCache {
    pub(crate) layers: Vec<Box<dyn KvCache>>,
}

impl SequenceCache {
    /// Forgets the last `n` tokens in every layer (see [`KvCache::rewind`]).
    pub fn rewind(&mut self, n: usize) -> Result<()> {
        if n > 0 {
            self.layers.iter_mut().try_for_each(|l| l.rewind(n))?;
        }
        Ok(())
    }
    pub fn offset(&self) -> usize {
        self.layers.first().map_or(0, |l| l.offset())
    }
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(|l| l.nbytes()).sum()
    }
    /// Every layer's keys and values of the last `n` positions written, if every layer still
    /// keeps them (see [`KvCache::last`]).
    pub fn last(&self, n: usize) -> Option<Vec<(Array, Array)>> {
        self.layers
            .iter()
            .map(|l| if n == 0 { None } else { l.last(n) })
            .collect()
    }
    /// Appends `n` positions computed elsewhere (another worker's prefill), one pair per layer
    /// as [`SequenceCache::chunk_layers`] gives them: an attention layer's keys and values
    /// [1, kv_heads, n, head_dim], written as a chunk run here would write them, or a recurrent
    /// layer's state after those positions, which replaces its own.
    pub fn append(&mut self, layers: &[(Array, Array)], n: usize) -> Result<()> {
        if layers.len() != self.layers.len() {
            return Err(crate::EngineError::InvalidRequest(format!(
                "KV of {} layers for a cache of {}",
                layers.len(),
                self.layers.len()
            )));
        }
        for (cache, (k, v)) in self.layers.iter_mut().zip(layers) {
            if cache.recurrent() {
                cache.install_state(k, v, n)?;
            } else {
                cache.update(k, v)?;
            }
        }
        // Written now, on the device: left lazy, every chunk appended so far would be read
        // from the host's memory by the step that completes the prompt, stalling that step's
        // streams.
        let written: Vec<Array> = self
            .layers
            .iter()
            .filter_map(|l| {
                l.buffers()
                    .map(|(k, v)| [k.clone(), v.clone()])
                    .or_else(|| l.contents().map(|(k, v)| [k, v]))
            })
            .flatten()
            .collect();
        mlx_rs::transforms::async_eval(written.iter())?;
        Ok(())
    }
    /// What another worker continuing this sequence needs of its last `n` positions (see
    /// [`SequenceCache::append`]): per layer their keys and values, or a recurrent layer's
    /// state after them. None when some layer no longer keeps them (a sliding window shorter
    /// than `n`) or has no state yet.
    pub fn chunk_layers(&self, n: usize) -> Option<Vec<(Array, Array)>> {
        self.layers
            .iter()
            .map(|l| if l.recurrent() { l.state() } else { l.last(n) })
            .collect()
    }
    /// What the prefix cache keeps of this sequence ([`crate::prefix::KvPrefix`]): per layer its
    /// keys and values of every position, or a recurrent layer's state ([`KvCache::state`]).
    /// None when some layer no longer keeps every position (a wrapped window) or has no state
    /// yet.
    pub fn prefix_layers(&self) -> Option<Vec<(Array, Array)>> {
        self.layers
            .iter()
            .map(|l| {
                if l.recurrent() {
                    l.state()
                } else {
                    l.contents()
                }
            })
            .collect()
    }
    /// Whether some layer keeps a recurrent state.
    pub fn recurrent(&self) -> bool {
        self.layers.iter().any(|l| l.recurrent())
    }
    /// Layer `l`'s recurrent state (see [`KvCache::state`]).
    pub fn state(&self, l: usize) -> Option<(Array, Array)> {
        self.layers.get(l)?.state()
    }
    /// Layer `l`'s keys and values for every position, if this cache keeps them all.
    pub fn contents(&self, l: usize) -> Option<(Array, Array)> {
        self.layers.get(l)?.contents()
    }
    /// Every layer's whole buffers (see [`KvCache::buffers`]), shared, when each layer keeps its
    /// positions in order in buffers of one capacity of at least `room` positions.
    pub fn buffers_with_room(&self, room: usize) -> Option<Vec<(Array, Array)>> {
        let layers: Vec<(Array, Array)> = self
            .layers
            .iter()
            .map(|l| l.buffers().map(|(k, v)| (k.clone(), v.clone())))
            .collect::<Option<_>>()?;
        let capacity = layers.first()?.0.shape()[2] as usize;
        layers
            .iter()
            .all(|(k, v)| k.shape()[2] as usize == capacity && v.shape()[2] as usize == capacity)
            .then_some(layers)
            .filter(|_| capacity >= room)
    }
}
