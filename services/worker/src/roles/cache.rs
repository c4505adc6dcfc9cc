//! The cache actor: owns the worker's prefix cache (the KV of prompts and outputs already
//! computed, by salt and token prefix). The prefill actor asks it for a new request's longest
//! cached prefix; the prefill and decode actors send it a copy of the KV of every completed
//! prompt and ended sequence (made before the message goes, so the sender's buffers are theirs
//! alone again at once, and a decode batch keeps writing its rows in place); the scheduler
//! trims it to the KV budget its reservations leave.
//!
//! Invariants: entries are copies (a hit never shares memory with a running sequence, and
//! nothing a running request uses is evicted); what it holds never exceeds the last trim's
//! bound or its own limit; a panic in a handler empties the cache (it only ever holds
//! copies, so no request is harmed) and never escapes.

use actix::prelude::*;
use llmq_engine::prefix::{KvPrefix, PrefixCache};
use mlx_rs::Array;

use crate::roles::messages::{Reply, Report, ResetCounters};
use crate::seq::{guarded, Busy};

pub struct CacheActor {
    prefix: Option<PrefixCache<KvPrefix>>,
    busy: Busy,
}

impl CacheActor {
    /// An actor around `prefix`; `None`: no prefix cache (every lookup misses, nothing is kept).
    pub fn new(prefix: Option<PrefixCache<KvPrefix>>) -> Self {
        CacheActor {
            prefix,
            busy: Busy::default(),
        }
    }

    fn report(&self) -> Report {
        let prefix = self.prefix.as_ref().map(|p| p.stats()).unwrap_or_default();
        Report {
            kv_bytes: prefix.held_bytes,
            held: prefix.entries as usize,
            busy: self.busy,
            prefix,
            ..Default::default()
        }
    }

    fn reply<T>(&self, value: T) -> Reply<T> {
        Reply {
            value,
            report: self.report(),
        }
    }

    /// Runs `f` on the cache, timed; a panic empties it and gives `fallback`.
    fn work<T>(&mut self, fallback: T, f: impl FnOnce(&mut PrefixCache<KvPrefix>) -> T) -> T {
        let Some(prefix) = self.prefix.as_mut() else {
            return fallback;
        };
        match self.busy.time(false, || guarded(|| f(prefix))) {
            Ok(v) => v,
            Err(what) => {
                tracing::error!(what, "the prefix cache panicked; emptying it");
                if let Some(p) = self.prefix.as_mut() {
                    let _ = guarded(|| p.clear());
                }
                fallback
            }
        }
    }
}

impl Actor for CacheActor {
    type Context = Context<Self>;
}

/// The longest cached prefix of `prompt` under `salt`: its length and its per-layer KV (the
/// entry's own arrays; whoever starts a cache from them copies).
#[derive(Message)]
#[rtype(result = "Reply<Option<(usize, Vec<(Array, Array)>)>>")]
pub struct Lookup {
    pub salt: Option<String>,
    pub prompt: Vec<u32>,
}

/// Keep the KV of `tokens` (a copy of its sequence's, see [`crate::seq::Shared::prefix_copy`]).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Remember {
    pub salt: Option<String>,
    pub tokens: Vec<u32>,
    pub kv: KvPrefix,
}

/// Evict, least recently used first, until at most this many bytes are held; answers with
/// the bytes held.
#[derive(Message)]
#[rtype(result = "Reply<u64>")]
pub struct Trim(pub u64);

/// Drop every entry; answers with the bytes freed.
#[derive(Message)]
#[rtype(result = "Reply<u64>")]
pub struct Clear;

impl Handler<Lookup> for CacheActor {
    type Result = MessageResult<Lookup>;
    fn handle(&mut self, m: Lookup, _: &mut Context<Self>) -> Self::Result {
        let hit = self.work(None, |p| {
            p.lookup(m.salt.as_deref(), &m.prompt)
                .map(|(n, kv)| (n, kv.layers.clone()))
        });
        MessageResult(self.reply(hit))
    }
}

impl Handler<Remember> for CacheActor {
    type Result = ();
    fn handle(&mut self, m: Remember, _: &mut Context<Self>) {
        self.work((), |p| {
            p.insert(m.salt.as_deref(), &m.tokens, m.kv);
        });
    }
}

impl Handler<Trim> for CacheActor {
    type Result = MessageResult<Trim>;
    fn handle(&mut self, Trim(max): Trim, _: &mut Context<Self>) -> Self::Result {
        let held = self.work(0, |p| p.trim(max));
        MessageResult(self.reply(held))
    }
}

impl Handler<Clear> for CacheActor {
    type Result = MessageResult<Clear>;
    fn handle(&mut self, _: Clear, _: &mut Context<Self>) -> Self::Result {
        let freed = self.work(0, |p| p.clear());
        MessageResult(self.reply(freed))
    }
}

impl Handler<ResetCounters> for CacheActor {
    type Result = MessageResult<ResetCounters>;
    fn handle(&mut self, _: ResetCounters, _: &mut Context<Self>) -> Self::Result {
        self.busy = Busy::default();
        if let Some(p) = self.prefix.as_mut() {
            p.reset_stats();
        }
        MessageResult(self.reply(()))
    }
}
