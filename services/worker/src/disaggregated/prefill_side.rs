//! The prefill server: what a prefill worker (`worker.role = "prefill"`) runs on its device
//! thread. It holds one session per request a decode worker has granted it chunks of: the
//! prompt's KV cache as far as computed. A grant ([`Serve`]) brings the session to the chunk's
//! start (from the prefix cache, or by computing the positions it lacks), computes the chunk,
//! and answers with the chunk's KV as bytes ([`llmq_engine::kv_bytes`]: for a hybrid model, its
//! recurrent layers' states after the chunk too), which the NATS side
//! sends in pieces while the next grant is computed.
//!
//! Invariants: a session's cache holds exactly the prompt's first `offset` positions; a grant
//! for a prompt other than its session's starts the session again; a session is dropped when
//! its decoder says so ([`Forget`]), and when no grant has touched it for `SESSION_IDLE` (its
//! decoder went away); a dropped session's KV goes to the prefix cache. A panic in a handler
//! drops every session and becomes an error answer, never escapes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use actix::prelude::*;
use llmq_engine::cache::SequenceCache;
use llmq_protocol::prefill::PrefillGrant;
use llmq_protocol::WireError;
use mlx_rs::Array;

use crate::roles::cache::{CacheActor, Lookup, Remember};
use crate::seq::{guarded, internal, Busy, Shared};

/// A session no grant has touched for this long is dropped.
pub const SESSION_IDLE: Duration = Duration::from_secs(120);

struct Session {
    prompt: Vec<u32>,
    salt: Option<String>,
    cache: SequenceCache,
    touched: Instant,
}

pub struct PrefillServer {
    shared: Shared,
    cache: Addr<CacheActor>,
    sessions: HashMap<(String, u64), Session>,
    busy: Busy,
}

/// Counters a prefill worker's heartbeat reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerReport {
    pub sessions: usize,
    pub kv_bytes: u64,
    pub calls: u64,
    pub ms: f64,
}

impl PrefillServer {
    pub fn new(shared: Shared, cache: Addr<CacheActor>) -> Self {
        PrefillServer {
            shared,
            cache,
            sessions: HashMap::new(),
            busy: Busy::default(),
        }
    }

    pub fn report(&self) -> ServerReport {
        ServerReport {
            sessions: self.sessions.len(),
            kv_bytes: self
                .sessions
                .values()
                .map(|s| s.cache.nbytes() as u64)
                .sum(),
            calls: self.busy.calls,
            ms: self.busy.ms(),
        }
    }

    /// Drops a session, its KV kept in the prefix cache.
    fn drop_session(&mut self, key: &(String, u64)) {
        if let Some(s) = self.sessions.remove(key) {
            let n = s.cache.offset();
            if let Some(kv) = self.shared.prefix_copy(s.cache.prefix_layers()) {
                self.cache.do_send(Remember {
                    salt: s.salt,
                    tokens: s.prompt[..n.min(s.prompt.len())].to_vec(),
                    kv,
                });
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        let idle: Vec<(String, u64)> = self
            .sessions
            .iter()
            .filter(|(_, s)| now - s.touched > SESSION_IDLE)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            tracing::info!(decoder = %k.0, key = k.1, "dropping an idle prefill session");
            self.drop_session(&k);
        }
    }

    /// Computes the grant's chunk in `session`, first the positions before it that the session
    /// lacks; answers with the chunk's KV.
    fn compute(&mut self, session: &mut Session, g: &PrefillGrant) -> Result<Vec<u8>, WireError> {
        let (start, end) = (g.start as usize, (g.start + g.n) as usize);
        let model = self.shared.model.clone();
        if session.cache.offset() > start {
            // Ahead of the grant (its answer was lost, say): start again, the prefix cache
            // may still hold the prompt's beginning.
            session.cache = model.new_cache_for(session.prompt.len() + 1);
        }
        let from = session.cache.offset();
        let ids: Vec<i32> = session.prompt[from..end]
            .iter()
            .map(|&t| t as i32)
            .collect();
        let x = Array::from_slice(&ids, &[1, ids.len() as i32]);
        let logits = model
            .forward(&x, &mut [&mut session.cache], true)
            .map_err(internal)?;
        drop(logits);
        let kv = session.cache.chunk_layers(end - start).ok_or_else(|| {
            internal(format!(
                "the chunk [{start}, {end}) does not fit this model's sliding window"
            ))
        })?;
        llmq_engine::kv_bytes::to_bytes(&kv).map_err(internal)
    }
}

impl Actor for PrefillServer {
    type Context = Context<Self>;
}

/// Compute a granted chunk; answers with its KV bytes.
#[derive(Message)]
#[rtype(result = "Result<Vec<u8>, WireError>")]
pub struct Serve(pub PrefillGrant);

/// A decoder is done with a request (or gone: every session of `decoder` when `key` is None).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Forget {
    pub decoder: String,
    pub key: Option<u64>,
}

/// The server's counters.
#[derive(Message)]
#[rtype(result = "ServerReport")]
pub struct GetReport;

impl Handler<Serve> for PrefillServer {
    type Result = AtomicResponse<Self, Result<Vec<u8>, WireError>>;
    fn handle(&mut self, Serve(g): Serve, _: &mut Context<Self>) -> Self::Result {
        let now = Instant::now();
        self.expire(now);
        let key = (g.decoder.clone(), g.key);
        let invalid = |m: String| WireError::new(llmq_protocol::ErrorClass::InvalidRequest, m);
        let layout = self.shared.model.kv_layout().to_string();
        let bad = if g.kv_layout != layout {
            Some(invalid(format!(
                "the decoder's KV is {}, this prefill worker's {layout}",
                g.kv_layout
            )))
        } else if g.n == 0 || (g.start + g.n) as usize > g.prompt.len() {
            Some(invalid(format!(
                "chunk [{}, {}) of a {}-token prompt",
                g.start,
                g.start + g.n,
                g.prompt.len()
            )))
        } else {
            llmq_engine::generate::check_ids(&self.shared.model, &g.prompt)
                .err()
                .map(|e| invalid(e.to_string()))
        };
        if let Some(e) = bad {
            return AtomicResponse::new(Box::pin(actix::fut::ready(Err(e))));
        }
        if self
            .sessions
            .get(&key)
            .is_some_and(|s| s.prompt != g.prompt || s.salt != g.salt)
        {
            self.sessions.remove(&key);
        }
        // A new session starts from the longest cached prefix of its prompt.
        let ask = (!self.sessions.contains_key(&key)).then(|| {
            self.cache.send(Lookup {
                salt: g.salt.clone(),
                prompt: g.prompt.clone(),
            })
        });
        let fut = async move {
            match ask {
                Some(ask) => Some(ask.await.ok().and_then(|r| r.value)),
                None => None,
            }
        };
        AtomicResponse::new(Box::pin(fut.into_actor(self).map(move |lookup, a, _| {
            let mut busy = a.busy;
            let r = busy.time(true, || {
                guarded(|| {
                    let mut session = match (a.sessions.remove(&key), lookup) {
                        (Some(s), _) => s,
                        (None, hit) => {
                            let capacity = g.prompt.len() + 1;
                            // Keys and values serve any shorter prefix; a recurrent state only
                            // its own length.
                            let recurrent = a.shared.model.config.recurrent();
                            let cache = hit
                                .flatten()
                                .filter(|(n, _)| !recurrent || *n <= g.start as usize)
                                .map(|(n, layers)| (n.min(g.start as usize), layers))
                                .filter(|(n, _)| *n > 0)
                                .and_then(|(n, layers)| {
                                    a.shared.model.cache_from_prefix(&layers, n, capacity).ok()
                                })
                                .unwrap_or_else(|| a.shared.model.new_cache_for(capacity));
                            Session {
                                prompt: g.prompt.clone(),
                                salt: g.salt.clone(),
                                cache,
                                touched: now,
                            }
                        }
                    };
                    session.touched = now;
                    let r = a.compute(&mut session, &g);
                    if r.is_ok() {
                        a.sessions.insert(key.clone(), session);
                    }
                    r
                })
            });
            a.busy = busy;
            r.unwrap_or_else(|what| {
                tracing::error!(what, "the prefill server panicked; dropping its sessions");
                a.sessions.clear();
                Err(internal(format!("prefill worker fault: {what}")))
            })
        })))
    }
}

impl Handler<Forget> for PrefillServer {
    type Result = ();
    fn handle(&mut self, Forget { decoder, key }: Forget, _: &mut Context<Self>) {
        let keys: Vec<(String, u64)> = self
            .sessions
            .keys()
            .filter(|(d, k)| *d == decoder && key.is_none_or(|x| x == *k))
            .cloned()
            .collect();
        for k in keys {
            self.drop_session(&k);
        }
    }
}

impl Handler<GetReport> for PrefillServer {
    type Result = MessageResult<GetReport>;
    fn handle(&mut self, _: GetReport, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.report())
    }
}
