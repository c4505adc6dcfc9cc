//! The prefill actor: owns every request whose prompt is not complete yet: its sequence, its
//! own KV cache as it grows chunk by chunk, its sampler. A new request starts here ([`Register`],
//! then [`Admit`], which asks the cache actor for a cached prefix to start from). A chunk runs
//! here when nothing decodes ([`Chunk`]); while the decode batch runs, the chunk's sequence is
//! lent to the decode actor ([`Lend`]), which runs the chunk in the same pass as its step over
//! the weights and gives the sequence back ([`Return`]) unless that chunk completed the prompt.
//! A completed prompt's sequence leaves for the decode actor (which sends the prompt's KV to
//! the cache actor); a released one's KV goes to the cache actor from here.
//!
//! A prompt prefilled by a prefill worker grows here by [`Install`]: its chunks' KV, written
//! into its cache as a chunk run here would write it.
//!
//! Invariants: a sequence is here from [`Register`] until its prompt completes or it is
//! released, except while lent; a panic in a handler drops every sequence held here (their
//! requests then fail with the fault at their next chunk) and never escapes.

use std::collections::HashMap;

use actix::prelude::*;
use llmq_protocol::WireError;

use crate::roles::cache::{CacheActor, Lookup, Remember};
use crate::roles::messages::{InjectPanic, Preempt, Release, Reply, Report, Reset, ResetCounters};
use crate::seq::{guarded, internal, run_chunk, unknown, Busy, Seq, SeqSpec, Shared};
use llmq_scheduler::{ReqId, StepOut};

pub struct PrefillActor {
    shared: Shared,
    seqs: HashMap<ReqId, Seq>,
    cache: Addr<CacheActor>,
    busy: Busy,
    /// Requests dropped after a panic, with its message, until released: their next chunk
    /// fails with it.
    lost: HashMap<ReqId, String>,
    /// Sequences lent to the decode actor (still this actor's requests).
    lent: std::collections::HashSet<ReqId>,
}

impl PrefillActor {
    pub fn new(shared: Shared, cache: Addr<CacheActor>) -> Self {
        PrefillActor {
            shared,
            seqs: HashMap::new(),
            cache,
            busy: Busy::default(),
            lost: HashMap::new(),
            lent: Default::default(),
        }
    }

    fn reply<T>(&self, value: T) -> Reply<T> {
        let kv_bytes = self.seqs.values().map(|s| s.cache.nbytes() as u64).sum();
        Reply {
            value,
            report: Report {
                kv_bytes,
                held: self.seqs.len(),
                busy: self.busy,
                ..Default::default()
            },
        }
    }

    /// Runs a handler's work, timed (a call when `call`); a panic drops every sequence held
    /// here and becomes an internal error.
    fn work<T>(
        &mut self,
        call: bool,
        f: impl FnOnce(&mut Self) -> Result<T, WireError>,
    ) -> Result<T, WireError> {
        let mut busy = self.busy;
        let r = busy.time(call, || guarded(|| f(self)));
        self.busy = busy;
        r.unwrap_or_else(|what| {
            self.restart(&what);
            Err(Self::fault(&what))
        })
    }

    /// After a panic: drops every sequence; their requests are remembered as lost.
    fn restart(&mut self, what: &str) {
        tracing::error!(what, "the prefill actor panicked; dropping its sequences");
        let lent: Vec<ReqId> = self.lent.iter().copied().collect();
        for id in self.seqs.drain().map(|(id, _)| id).chain(lent) {
            self.lost.insert(id, what.to_string());
        }
    }

    fn fault(what: &str) -> WireError {
        internal(format!("worker fault in prefill: {what}"))
    }

    /// Takes a request's sequence out (to run or lend a chunk).
    fn take_seq(&mut self, id: ReqId) -> Result<Seq, WireError> {
        match self.seqs.remove(&id) {
            Some(seq) => Ok(seq),
            None => Err(self
                .lost
                .get(&id)
                .map_or_else(|| unknown("prefill", id), |what| Self::fault(what))),
        }
    }

    /// Sends the KV of a sequence's first `fed` history tokens to the cache actor.
    /// A prompt part-way through prefill keeps its recurrent states where it has got to, if
    /// that is a snapshot position ([`crate::seq::Shared::snapshot_at`]).
    fn snapshot(&self, seq: &Seq) {
        let at = seq.cache.offset();
        if self.shared.snapshot_at(at, seq.prompt.len()) {
            self.remember(seq, at);
        }
    }

    fn remember(&self, seq: &Seq, fed: usize) {
        if let Some(kv) = self.shared.prefix_copy(seq.layers()) {
            let tokens = seq.history[..fed.min(seq.history.len())].to_vec();
            self.cache.do_send(Remember {
                salt: seq.salt.clone(),
                tokens,
                kv,
            });
        }
    }
}

impl Actor for PrefillActor {
    type Context = Context<Self>;
}

/// A new request's sequence (its parameters validated).
#[derive(Message)]
#[rtype(result = "Reply<Result<(), WireError>>")]
pub struct Register {
    pub id: ReqId,
    pub spec: SeqSpec,
}

/// An admitted request: start its cache from the longest cached prefix of its prompt; answers
/// with the prompt tokens reused.
#[derive(Message)]
#[rtype(result = "Reply<usize>")]
pub struct Admit(pub ReqId);

/// Prefill `n` more prompt tokens of a request, on its own.
#[derive(Message)]
#[rtype(result = "Reply<Result<Chunked, WireError>>")]
pub struct Chunk {
    pub id: ReqId,
    pub n: usize,
}

pub enum Chunked {
    /// The prompt is not complete yet.
    Partial,
    /// The prompt is complete: its first token, and the sequence, which leaves for the decode
    /// actor.
    Complete { first: StepOut, seq: Box<Seq> },
}

/// Hand a request's sequence over for a chunk in the decode actor's pass.
#[derive(Message)]
#[rtype(result = "Reply<Result<Box<Seq>, WireError>>")]
pub struct Lend(pub ReqId);

/// A lent sequence whose prompt is still not complete comes back.
#[derive(Message)]
#[rtype(result = "Reply<()>")]
pub struct Return {
    pub id: ReqId,
    pub seq: Box<Seq>,
}

impl Handler<Register> for PrefillActor {
    type Result = MessageResult<Register>;
    fn handle(&mut self, m: Register, _: &mut Context<Self>) -> Self::Result {
        let r = self.work(false, |a| {
            let seq = Seq::new(&a.shared, m.spec)?;
            a.seqs.insert(m.id, seq);
            Ok(())
        });
        MessageResult(self.reply(r))
    }
}

impl Handler<Admit> for PrefillActor {
    type Result = AtomicResponse<Self, Reply<usize>>;
    fn handle(&mut self, Admit(id): Admit, _: &mut Context<Self>) -> Self::Result {
        let ask = self.seqs.get(&id).map(|s| {
            self.cache.send(Lookup {
                salt: s.salt.clone(),
                prompt: s.prompt.clone(),
            })
        });
        let fut = async move {
            match ask {
                Some(ask) => ask.await.ok().and_then(|r| r.value),
                None => None,
            }
        };
        AtomicResponse::new(Box::pin(fut.into_actor(self).map(move |hit, a, _| {
            let reused = a.work(false, |a| {
                let (Some((n, layers)), Some(seq)) = (hit, a.seqs.get_mut(&id)) else {
                    return Ok(0);
                };
                match a
                    .shared
                    .model
                    .cache_from_prefix(&layers, n, seq.prompt.len() + 1)
                {
                    Ok(cache) => {
                        seq.cache = cache;
                        seq.prefilled = n;
                        Ok(n)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not reuse a cached prefix");
                        Ok(0)
                    }
                }
            });
            a.reply(reused.unwrap_or(0))
        })))
    }
}

impl Handler<Chunk> for PrefillActor {
    type Result = MessageResult<Chunk>;
    fn handle(&mut self, Chunk { id, n }: Chunk, _: &mut Context<Self>) -> Self::Result {
        let r = self.work(true, |a| {
            let mut seq = a.take_seq(id)?;
            match run_chunk(&a.shared.model, &mut seq, n) {
                Ok(None) => {
                    a.snapshot(&seq);
                    a.seqs.insert(id, seq);
                    Ok(Chunked::Partial)
                }
                Ok(Some(logits)) => {
                    let first = seq.first_token(&logits, &a.shared);
                    match first {
                        // Its prompt's KV is remembered when it joins the decode batch.
                        Ok(first) => Ok(Chunked::Complete {
                            first,
                            seq: Box::new(seq),
                        }),
                        Err(e) => {
                            a.seqs.insert(id, seq);
                            Err(e)
                        }
                    }
                }
                Err(e) => {
                    a.seqs.insert(id, seq);
                    Err(e)
                }
            }
        });
        MessageResult(self.reply(r))
    }
}

/// KV computed elsewhere (a prefill worker) for the next `n` prompt positions of a request.
#[derive(Message)]
#[rtype(result = "Reply<Result<(), WireError>>")]
pub struct Install {
    pub id: ReqId,
    pub start: usize,
    pub n: usize,
    pub layers: Vec<(mlx_rs::Array, mlx_rs::Array)>,
}

impl Handler<Install> for PrefillActor {
    type Result = MessageResult<Install>;
    fn handle(
        &mut self,
        Install {
            id,
            start,
            n,
            layers,
        }: Install,
        _: &mut Context<Self>,
    ) -> Self::Result {
        let r = self.work(false, |a| {
            let seq = a.seqs.get_mut(&id).ok_or_else(|| unknown("install", id))?;
            if seq.prefilled != start || start + n >= seq.prompt.len() {
                return Err(internal(format!(
                    "KV of [{start}, {}) for a {}-token prompt prefilled to {}",
                    start + n,
                    seq.prompt.len(),
                    seq.prefilled
                )));
            }
            seq.cache.append(&layers, n).map_err(internal)?;
            seq.prefilled += n;
            // Its states are kept where a chunk computed here would keep them.
            a.snapshot(&a.seqs[&id]);
            Ok(())
        });
        MessageResult(self.reply(r))
    }
}

impl Handler<Lend> for PrefillActor {
    type Result = MessageResult<Lend>;
    fn handle(&mut self, Lend(id): Lend, _: &mut Context<Self>) -> Self::Result {
        let seq = self.take_seq(id).map(Box::new);
        if seq.is_ok() {
            self.lent.insert(id);
        }
        MessageResult(self.reply(seq))
    }
}

impl Handler<Return> for PrefillActor {
    type Result = MessageResult<Return>;
    fn handle(&mut self, Return { id, seq }: Return, _: &mut Context<Self>) -> Self::Result {
        self.lent.remove(&id);
        // One lost to a restart while lent stays lost.
        if !self.lost.contains_key(&id) {
            self.seqs.insert(id, *seq);
        }
        MessageResult(self.reply(()))
    }
}

impl Handler<Release> for PrefillActor {
    type Result = MessageResult<Release>;
    fn handle(&mut self, Release(ids): Release, _: &mut Context<Self>) -> Self::Result {
        let _ = self.work(false, |a| {
            for id in ids {
                a.lost.remove(&id);
                a.lent.remove(&id);
                if let Some(seq) = a.seqs.remove(&id) {
                    // What it fed the model so far stays reusable.
                    a.remember(&seq, seq.cache.offset());
                }
            }
            Ok(())
        });
        MessageResult(self.reply(()))
    }
}

impl Handler<Preempt> for PrefillActor {
    type Result = MessageResult<Preempt>;
    fn handle(&mut self, Preempt { ids, back }: Preempt, _: &mut Context<Self>) -> Self::Result {
        let _ = self.work(false, |a| {
            let model = a.shared.model.clone();
            for id in &ids {
                a.lent.remove(id);
                // Prefilling here, in its own cache: what it fed the model stays reusable.
                if let Some(mut seq) = a.seqs.remove(id) {
                    if seq.cache.offset() > 0 {
                        a.remember(&seq, seq.cache.offset());
                    }
                    seq.start_over(&model);
                    a.seqs.insert(*id, seq);
                }
            }
            // The decode actor's (remembered there, if whole).
            for (id, mut seq) in back {
                if !a.lost.contains_key(&id) {
                    seq.start_over(&model);
                    a.seqs.insert(id, *seq);
                }
            }
            Ok(())
        });
        MessageResult(self.reply(vec![]))
    }
}

impl Handler<Reset> for PrefillActor {
    type Result = MessageResult<Reset>;
    fn handle(&mut self, _: Reset, _: &mut Context<Self>) -> Self::Result {
        self.seqs.clear();
        self.lost.clear();
        self.lent.clear();
        MessageResult(self.reply(()))
    }
}

impl Handler<InjectPanic> for PrefillActor {
    type Result = ();
    fn handle(&mut self, _: InjectPanic, _: &mut Context<Self>) {
        let _ = self.work(false, |_| -> Result<(), WireError> {
            panic!("injected fault")
        });
    }
}

impl Handler<ResetCounters> for PrefillActor {
    type Result = MessageResult<ResetCounters>;
    fn handle(&mut self, _: ResetCounters, _: &mut Context<Self>) -> Self::Result {
        self.busy = Busy::default();
        MessageResult(self.reply(()))
    }
}
