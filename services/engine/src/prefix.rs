//! The prefix cache: the KV of earlier sequences (prompt, and output once the request ends),
//! found again by the tokens a new prompt starts with.
//!
//! Index: fixed-size token blocks, each hashed together with its parent's hash (the root hash is
//! the salt's), so one hash names a whole prefix and a lookup is one map probe per block. The
//! candidates of the last matching block are then compared token by token, so a hit extends past
//! the last whole block up to the longest common prefix. Entries are whole sequences, immutable
//! once stored: a hit copies the reused KV into the new sequence's own cache, so nothing a
//! running request holds is ever shared, evicted or modified underneath it.
//!
//! A model whose layers keep a recurrent state (LFM2's convolutions) stores with each entry the
//! states after the entry's last token: such an entry can resume a prompt only at its own full
//! length (`Payload::exact_only`), so a lookup takes the longest entry that is a whole prefix of
//! the prompt, and a longer entry never replaces it.
//!
//! Invariants: `held_bytes()` is the sum of the stored entries' sizes and never exceeds the
//! limit; an entry whose tokens are a prefix of a newer entry's is dropped (the newer one serves
//! every lookup it would); a lookup reuses at most `prompt.len() - 1` tokens (the last prompt
//! token is always computed: its logits give the first output token); requests with different
//! salts never see each other's entries.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// What an entry stores; its size counts against the cache's limit.
pub trait Payload {
    fn nbytes(&self) -> u64;
    /// Whether the entry can resume a prompt only at its own full length (it holds a
    /// recurrent state as it was after its last token, which no shorter prefix had).
    fn exact_only(&self) -> bool {
        false
    }
}

/// A sequence's KV on the device: per layer (keys, values) [1, kv_heads, len, head_dim], or,
/// for a layer with a recurrent state, that state after the sequence's last token
/// ([`crate::cache::KvCache::state`]).
pub struct KvPrefix {
    pub layers: Vec<(mlx_rs::Array, mlx_rs::Array)>,
    /// Some layer's entry is a state: the payload resumes only at its full length.
    pub states: bool,
}

impl KvPrefix {
    /// Copies `layers` (views into a sequence's buffers) into buffers of their own, so the
    /// entry keeps only its own bytes alive (once the copy has run) and its size is known. The
    /// copy is queued on the device, not waited for (on a GPU it stays off the host's path; on a
    /// CPU it is the device thread's work like any other).
    /// `states`: some layers are recurrent states (see [`KvPrefix`]).
    pub fn copy_of(
        layers: Vec<(mlx_rs::Array, mlx_rs::Array)>,
        states: bool,
    ) -> crate::Result<Self> {
        let layers = layers
            .iter()
            .map(|(k, v)| Ok((k.contiguous()?, v.contiguous()?)))
            .collect::<crate::Result<Vec<_>>>()?;
        mlx_rs::transforms::async_eval(layers.iter().flat_map(|(k, v)| [k, v]))?;
        Ok(KvPrefix { layers, states })
    }
}

impl Payload for KvPrefix {
    fn nbytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|(k, v)| (k.nbytes() + v.nbytes()) as u64)
            .sum()
    }

    fn exact_only(&self) -> bool {
        self.states
    }
}

struct Entry<P> {
    salt: Option<String>,
    tokens: Vec<u32>,
    /// Chained hash of each whole block of `tokens`.
    hashes: Vec<u64>,
    payload: P,
    bytes: u64,
    last_used: u64,
}

/// Counters since start (or since the cache was cleared, for `held`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hits: u64,
    /// Prompt tokens looked up, and how many of them were reused.
    pub prompt_tokens: u64,
    pub reused_tokens: u64,
    pub inserted: u64,
    pub evictions: u64,
    pub entries: u64,
    pub held_bytes: u64,
}

impl PrefixStats {
    /// Reused prompt tokens over looked-up prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.reused_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

pub struct PrefixCache<P> {
    block: usize,
    max_bytes: u64,
    entries: HashMap<u64, Entry<P>>,
    /// Block hash -> entries holding that prefix.
    index: HashMap<u64, Vec<u64>>,
    next_id: u64,
    clock: u64,
    held: u64,
    stats: PrefixStats,
    /// Hits are whole multiples of this many tokens (see `with_reuse_unit`).
    reuse_unit: usize,
}

fn root_hash(salt: Option<&str>) -> u64 {
    let mut h = DefaultHasher::new();
    "llmq-prefix".hash(&mut h);
    salt.hash(&mut h);
    h.finish()
}

fn block_hashes<'a>(
    salt: Option<&str>,
    tokens: &'a [u32],
    block: usize,
) -> impl Iterator<Item = u64> + 'a {
    let mut parent = root_hash(salt);
    tokens.chunks_exact(block).map(move |b| {
        let mut h = DefaultHasher::new();
        parent.hash(&mut h);
        b.hash(&mut h);
        parent = h.finish();
        parent
    })
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<P: Payload> PrefixCache<P> {
    /// `block`: tokens per index block (the shortest prefix that can hit); `max_bytes`: limit.
    pub fn new(block: usize, max_bytes: u64) -> Self {
        PrefixCache {
            block: block.max(1),
            max_bytes,
            entries: HashMap::new(),
            index: HashMap::new(),
            next_id: 0,
            clock: 0,
            held: 0,
            stats: PrefixStats::default(),
            reuse_unit: 1,
        }
    }

    /// Hits are rounded down to whole multiples of `unit` tokens (a GPU engine's chunk grid,
    /// so that the prefill after a hit starts on it); a hit shorter than one unit is a miss.
    pub fn with_reuse_unit(mut self, unit: usize) -> Self {
        self.reuse_unit = unit.max(1);
        self
    }

    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            entries: self.entries.len() as u64,
            held_bytes: self.held,
            ..self.stats
        }
    }

    /// The entry sharing the longest prefix with `tokens` (same salt) and that length;
    /// `hashes` are the chained hashes of `tokens`' whole blocks. An exact-only entry shares
    /// its whole length or nothing (`unit`: its length must also be a multiple of it).
    fn best_match(
        &self,
        salt: Option<&str>,
        tokens: &[u32],
        hashes: impl IntoIterator<Item = u64>,
        unit: usize,
    ) -> Option<(u64, usize)> {
        // The last matching block's entries share the longest prefixes; exact-only entries
        // may end at any matching block.
        let mut candidates: Vec<u64> = vec![];
        for h in hashes {
            match self.index.get(&h) {
                Some(ids) => candidates.extend(ids),
                None => break,
            }
        }
        candidates.sort_unstable();
        candidates.dedup();
        candidates
            .into_iter()
            .filter_map(|id| {
                let e = &self.entries[&id];
                let n = common_prefix(&e.tokens, tokens);
                let whole = n == e.tokens.len() && n.is_multiple_of(unit);
                let n = if !e.payload.exact_only() || whole {
                    n
                } else {
                    0
                };
                (e.salt.as_deref() == salt).then_some((id, n))
            })
            .filter(|&(_, n)| n >= self.block)
            .max_by_key(|&(id, n)| (n, self.entries[&id].last_used))
    }

    /// The longest reusable prefix of `prompt`: its length (at most `prompt.len() - 1`, a
    /// multiple of the reuse unit) and the entry holding its KV (positions 0..length of the
    /// payload). Counts toward the hit rate.
    pub fn lookup(&mut self, salt: Option<&str>, prompt: &[u32]) -> Option<(usize, &P)> {
        self.stats.lookups += 1;
        self.stats.prompt_tokens += prompt.len() as u64;
        let usable = &prompt[..prompt.len().saturating_sub(1)];
        let (id, n) = self.best_match(
            salt,
            usable,
            block_hashes(salt, usable, self.block),
            self.reuse_unit,
        )?;
        let n = n / self.reuse_unit * self.reuse_unit;
        if n == 0 {
            return None;
        }
        self.clock += 1;
        self.stats.hits += 1;
        self.stats.reused_tokens += n as u64;
        let e = self.entries.get_mut(&id).expect("indexed entries exist");
        e.last_used = self.clock;
        Some((n, &e.payload))
    }

    /// Stores `payload`, the KV of `tokens`. Entries that are a prefix of `tokens` are dropped;
    /// if an entry already covers all of `tokens`, nothing is stored. Returns whether it was
    /// stored.
    pub fn insert(&mut self, salt: Option<&str>, tokens: &[u32], payload: P) -> bool {
        if tokens.len() < self.block {
            return false;
        }
        let hashes: Vec<u64> = block_hashes(salt, tokens, self.block).collect();
        let exact = payload.exact_only();
        if let Some((id, n)) = self.best_match(salt, tokens, hashes.iter().copied(), 1) {
            // A longer entry covers these tokens, unless they need a state of their own.
            let same = self.entries[&id].tokens.len() == tokens.len();
            if n == tokens.len() && (!exact || same) {
                self.clock += 1;
                self.entries.get_mut(&id).expect("indexed").last_used = self.clock;
                return false;
            }
        }
        // Entries the new one subsumes: same salt, and all their tokens are a prefix of `tokens`.
        let mut subsumed: Vec<u64> = hashes
            .iter()
            .filter_map(|h| self.index.get(h))
            .flatten()
            .copied()
            .filter(|id| {
                let e = &self.entries[id];
                e.salt.as_deref() == salt
                    && e.tokens.len() <= tokens.len()
                    && tokens.starts_with(&e.tokens)
                    && (!e.payload.exact_only() || e.tokens.len() == tokens.len())
            })
            .collect();
        subsumed.sort_unstable();
        subsumed.dedup();
        for id in subsumed {
            self.remove(id);
        }
        let bytes = payload.nbytes();
        if bytes > self.max_bytes {
            return false;
        }
        self.trim(self.max_bytes - bytes);
        let id = self.next_id;
        self.next_id += 1;
        self.clock += 1;
        for h in &hashes {
            self.index.entry(*h).or_default().push(id);
        }
        self.entries.insert(
            id,
            Entry {
                salt: salt.map(str::to_string),
                tokens: tokens.to_vec(),
                hashes,
                payload,
                bytes,
                last_used: self.clock,
            },
        );
        self.held += bytes;
        self.stats.inserted += 1;
        true
    }

    fn remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else {
            return;
        };
        for h in &e.hashes {
            if let Some(ids) = self.index.get_mut(h) {
                ids.retain(|&x| x != id);
                if ids.is_empty() {
                    self.index.remove(h);
                }
            }
        }
        self.held -= e.bytes;
    }

    /// Evicts least recently used entries until at most `max` bytes are held; returns the bytes
    /// held after.
    pub fn trim(&mut self, max: u64) -> u64 {
        while self.held > max {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(id, _)| *id)
            else {
                break;
            };
            self.remove(oldest);
            self.stats.evictions += 1;
        }
        self.held
    }

    /// Zeroes the counters (not the entries).
    pub fn reset_stats(&mut self) {
        self.stats = PrefixStats::default();
    }

    /// Drops every entry; returns the bytes freed.
    pub fn clear(&mut self) -> u64 {
        let freed = self.held;
        self.entries.clear();
        self.index.clear();
        self.held = 0;
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(u64);
    impl Payload for Fake {
        fn nbytes(&self) -> u64 {
            self.0
        }
    }

    fn put(c: &mut PrefixCache<Fake>, salt: Option<&str>, t: &[u32]) -> bool {
        c.insert(salt, t, Fake(t.len() as u64))
    }

    fn seq(from: u32, n: u32) -> Vec<u32> {
        (from..from + n).collect()
    }

    /// A payload holding a recurrent state after its last token.
    struct State(u64);
    impl Payload for State {
        fn nbytes(&self) -> u64 {
            self.0
        }
        fn exact_only(&self) -> bool {
            true
        }
    }

    #[test]
    fn states_resume_only_at_their_own_length_and_are_never_subsumed() {
        let mut c = PrefixCache::new(4, 1000).with_reuse_unit(2);
        let short = seq(0, 8);
        let long = seq(0, 16);
        assert!(c.insert(None, &short, State(8)));
        assert!(c.insert(None, &long, State(16)));
        // The longer entry does not replace the shorter: it has no state at position 8.
        assert_eq!(c.stats().entries, 2);
        // Sharing 12 tokens with the longer one: only the shorter is a whole prefix.
        let mut p = seq(0, 12);
        p.extend([90, 91, 92]);
        assert_eq!(c.lookup(None, &p).map(|(n, e)| (n, e.0)), Some((8, 8)));
        // A prompt extending the longer one resumes at its end.
        let mut q = seq(0, 16);
        q.extend([90, 91]);
        assert_eq!(c.lookup(None, &q).map(|(n, e)| (n, e.0)), Some((16, 16)));
        // The longer one's own tokens: its last token is computed again, so only the shorter
        // one serves.
        assert_eq!(c.lookup(None, &long).map(|(n, _)| n), Some(8));
        // Sharing less than the shortest entry: a miss, not a partial hit.
        let mut r = seq(0, 6);
        r.extend([90, 91, 92, 93]);
        assert!(c.lookup(None, &r).is_none());
        // Storing the same tokens again keeps one entry; a length off the reuse unit is never
        // a hit.
        assert!(!c.insert(None, &short, State(8)));
        assert!(c.insert(None, &seq(0, 9), State(9)));
        let mut odd = seq(0, 9);
        odd.extend([90, 91]);
        assert_eq!(c.lookup(None, &odd).map(|(n, _)| n), Some(8));
    }

    #[test]
    fn exact_and_partial_hits_stop_before_the_last_token() {
        let mut c = PrefixCache::new(4, 1000);
        let a = seq(0, 10);
        assert!(put(&mut c, None, &a));
        // Exact: the whole prompt was seen; the last token is still computed.
        assert_eq!(c.lookup(None, &a).map(|(n, _)| n), Some(9));
        // Partial past the last whole block: 0..6 shared, then different.
        let mut b = seq(0, 6);
        b.extend([99, 98, 97]);
        assert_eq!(c.lookup(None, &b).map(|(n, _)| n), Some(6));
        // Shorter than one block in common: no hit.
        let mut d = seq(0, 3);
        d.extend([50, 51, 52, 53, 54]);
        assert!(c.lookup(None, &d).is_none());
        let s = c.stats();
        assert_eq!(
            (s.lookups, s.hits, s.reused_tokens, s.prompt_tokens),
            (3, 2, 15, 27)
        );
    }

    #[test]
    fn hits_are_whole_reuse_units() {
        let mut c = PrefixCache::new(4, 1000).with_reuse_unit(8);
        let a = seq(0, 20);
        assert!(put(&mut c, None, &a));
        // 19 reusable tokens: two whole units.
        assert_eq!(c.lookup(None, &a).map(|(n, _)| n), Some(16));
        // 6 shared tokens, less than one unit: a miss, counted as one.
        let mut b = seq(0, 6);
        b.extend([99, 98, 97]);
        assert!(c.lookup(None, &b).is_none());
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.reused_tokens), (2, 1, 16));
    }

    #[test]
    fn salts_isolate() {
        let mut c = PrefixCache::new(4, 1000);
        put(&mut c, Some("alice"), &seq(0, 12));
        assert!(c.lookup(None, &seq(0, 12)).is_none());
        assert!(c.lookup(Some("bob"), &seq(0, 12)).is_none());
        assert_eq!(
            c.lookup(Some("alice"), &seq(0, 12)).map(|(n, _)| n),
            Some(11)
        );
    }

    #[test]
    fn longer_entry_subsumes_its_prefix_and_covered_inserts_are_skipped() {
        let mut c = PrefixCache::new(4, 1000);
        put(&mut c, None, &seq(0, 8));
        assert!(put(&mut c, None, &seq(0, 20)));
        assert_eq!((c.stats().entries, c.held_bytes()), (1, 20));
        assert!(
            !put(&mut c, None, &seq(0, 13)),
            "covered by the longer entry"
        );
        assert_eq!(c.lookup(None, &seq(0, 30)).map(|(n, _)| n), Some(20));
    }

    #[test]
    fn least_recently_used_goes_first_and_bytes_stay_within_limit() {
        let mut c = PrefixCache::new(4, 30);
        put(&mut c, None, &seq(0, 10));
        put(&mut c, None, &seq(100, 10));
        put(&mut c, None, &seq(200, 10));
        c.lookup(None, &seq(0, 10)); // 0.. is now the most recent
        put(&mut c, None, &seq(300, 10));
        assert!(
            c.lookup(None, &seq(100, 10)).is_none(),
            "the least recently used was evicted"
        );
        assert!(c.lookup(None, &seq(0, 10)).is_some());
        assert_eq!((c.held_bytes(), c.stats().evictions), (30, 1));
        assert_eq!(c.trim(15), 10);
        assert!(
            !put(&mut c, None, &seq(500, 40)),
            "larger than the whole limit"
        );
        assert_eq!(c.clear(), 10);
        assert_eq!((c.held_bytes(), c.stats().entries), (0, 0));
    }

    #[test]
    fn hash_collisions_cannot_return_wrong_tokens() {
        // Same blocks under different salts share no hashes; same salt, different tokens after
        // a shared block: the token comparison bounds the reuse.
        let mut c = PrefixCache::new(2, 1000);
        put(&mut c, None, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(c.lookup(None, &[1, 2, 3, 9, 9, 9]).map(|(n, _)| n), Some(3));
    }
}
