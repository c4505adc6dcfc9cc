//! Prefill by prefill workers, as a decode worker (`worker.role = "decode"`) sees it.
//!
//! The scheduler still grants one chunk a tick, and only one prompt advances at a time; for a
//! request prefilled remotely the role actors turn a granted chunk into a [`PrefillGrant`] to a prefill
//! worker instead of running it ([`RemotePrefill::plan`]). The chunk counts as done when the prefill
//! worker's first piece of its KV arrives (it sends only once the chunk is computed), so the
//! next chunk is granted while the rest of this one's KV travels; the KV is written into the
//! request's cache as each chunk's last piece arrives ([`Install`]). The prompt's last token is
//! always run here, in the chunk that completes the prompt: its logits give the first token,
//! sampled by the request's own sampler, and the sequence then joins the decode batch as any.
//!
//! Falls back to prefilling here, from the last position installed, when no prefill worker is
//! live at registration, when one fails a grant or goes silent, or when a grant or its KV takes
//! longer than `worker.remote_prefill_timeout_ms`; the request then stays local.
//!
//! The NATS side is `link`: it picks a prefill worker per request (the least loaded live one
//! by heartbeats, then the same one for every chunk), publishes orders (offering the worker's
//! direct KV connection, [`crate::disaggregated::kv_link`], where it listens), reassembles the KV pieces or
//! takes the direct connections' chunks (checking sizes and the checksum), and tells the device
//! thread what arrived.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use llmq_protocol::prefill::{DirectKv, KvAssembly, PrefillGrant, PrefillOrder, PrefillReply};
use llmq_protocol::workers::WorkerTable;
use llmq_protocol::{subjects, WorkerRole, WorkerStatus};
use llmq_scheduler::ReqId;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::disaggregated::kv_link::Received;

/// From the device thread to the link.
#[derive(Debug)]
pub enum Order {
    Grant(PrefillGrant),
    Drop(ReqId),
}

/// From the link to the device thread.
#[derive(Debug)]
pub enum Arrival {
    /// The first piece of the chunk at `start` arrived: the chunk is computed.
    Computed {
        key: ReqId,
        start: usize,
    },
    /// A whole chunk's KV, checked, and the time from its sending to its last piece's arrival.
    Kv {
        key: ReqId,
        start: usize,
        n: usize,
        bytes: Vec<u8>,
        transfer: Duration,
    },
    Failed {
        key: ReqId,
        why: String,
    },
}

/// What the role actors do with a granted chunk of a remote request.
#[derive(Debug, PartialEq)]
pub enum Plan {
    /// Granted to the prefill worker (now or before) and not computed yet.
    Pending,
    /// Computed by the prefill worker: the scheduler may count its tokens.
    Done,
    /// Run here `n` tokens from the last installed position: the prompt's last token (and
    /// whatever the chunk still lacks), or everything after a fallback.
    Local(usize),
}

/// A chunk's KV to write into a request's cache.
pub struct Install {
    pub key: ReqId,
    pub start: usize,
    pub n: usize,
    pub bytes: Vec<u8>,
    pub transfer: Duration,
}

struct Remote {
    prompt: Vec<u32>,
    salt: Option<String>,
    /// Positions the scheduler counts as prefilled (its chunks answered [`Done`]).
    counted: usize,
    /// Positions computed (by the prefill worker, or reused here from the prefix cache).
    computed: usize,
    /// Positions whose KV is in the request's cache here.
    installed: usize,
    /// The chunk granted and not yet computed: start, tokens, when.
    granted: Option<(usize, usize, Instant)>,
    /// Since when the request has waited for KV already computed.
    waiting_since: Option<Instant>,
    failed: Option<String>,
}

/// The device thread's end of remote prefill.
pub struct RemotePrefill {
    decoder: String,
    kv_layout: String,
    orders: UnboundedSender<Order>,
    arrivals: UnboundedReceiver<Arrival>,
    live: Arc<AtomicBool>,
    timeout: Duration,
    reqs: HashMap<ReqId, Remote>,
    /// KV bytes installed from prefill workers since start, and their chunks' transfer times.
    pub received_bytes: u64,
    pub transfer: Duration,
}

/// The link's end: what `link` needs.
pub struct LinkEnd {
    orders: UnboundedReceiver<Order>,
    arrivals: UnboundedSender<Arrival>,
    live: Arc<AtomicBool>,
}

impl RemotePrefill {
    /// Both ends; nothing is prefilled remotely until `link` runs and hears a prefill worker.
    pub fn new(decoder: &str, timeout: Duration) -> (RemotePrefill, LinkEnd) {
        let (orders_tx, orders_rx) = unbounded_channel();
        let (arrivals_tx, arrivals_rx) = unbounded_channel();
        let live = Arc::new(AtomicBool::new(false));
        let device = RemotePrefill {
            decoder: decoder.to_string(),
            kv_layout: String::new(),
            orders: orders_tx,
            arrivals: arrivals_rx,
            live: live.clone(),
            timeout,
            reqs: HashMap::new(),
            received_bytes: 0,
            transfer: Duration::ZERO,
        };
        (
            device,
            LinkEnd {
                orders: orders_rx,
                arrivals: arrivals_tx,
                live,
            },
        )
    }

    /// The decoder's model's KV layout, which grants name (see [`PrefillGrant::kv_layout`]).
    pub fn set_kv_layout(&mut self, layout: String) {
        self.kv_layout = layout;
    }

    /// A new request is prefilled remotely when a prefill worker is live now.
    pub fn register(&mut self, key: ReqId, prompt: &[u32], salt: Option<String>) {
        if self.live.load(Ordering::Relaxed) && prompt.len() > 1 {
            let r = Remote {
                prompt: prompt.to_vec(),
                salt,
                counted: 0,
                computed: 0,
                installed: 0,
                granted: None,
                waiting_since: None,
                failed: None,
            };
            self.reqs.insert(key, r);
        }
    }

    /// Its first `reused` positions came from the prefix cache here.
    pub fn admitted(&mut self, key: ReqId, reused: usize) {
        if let Some(r) = self.reqs.get_mut(&key) {
            // As the scheduler counts it: the last prompt token is always run.
            let reused = reused.min(r.prompt.len() - 1);
            r.counted = reused;
            r.computed = reused;
            r.installed = reused;
        }
    }

    pub fn is_remote(&self, key: ReqId) -> bool {
        self.reqs.contains_key(&key)
    }

    /// Whether any request waits on a prefill worker.
    pub fn waiting(&self) -> bool {
        self.reqs
            .values()
            .any(|r| r.granted.is_some() || r.installed < r.computed)
    }

    /// The request ended, or prefills here from now on: the prefill worker may forget it.
    pub fn forget(&mut self, key: ReqId) {
        if self.reqs.remove(&key).is_some() {
            let _ = self.orders.send(Order::Drop(key));
        }
    }

    pub fn forget_all(&mut self) {
        let keys: Vec<ReqId> = self.reqs.keys().copied().collect();
        keys.into_iter().for_each(|k| self.forget(k));
    }

    /// A chunk's KV could not be installed: the request prefills here from what it has.
    pub fn failed(&mut self, key: ReqId, why: String) {
        if let Some(r) = self.reqs.get_mut(&key) {
            tracing::warn!(key, why, "remote prefill failed; prefilling here");
            r.failed.get_or_insert(why);
        }
    }

    /// Installed `n` positions of `key`: `bytes`, which took `transfer` to arrive.
    pub fn installed(&mut self, key: ReqId, n: usize, bytes: usize, transfer: Duration) {
        if let Some(r) = self.reqs.get_mut(&key) {
            r.installed += n;
            r.waiting_since = (r.installed < r.computed).then(Instant::now);
            self.received_bytes += bytes as u64;
            self.transfer += transfer;
        }
    }

    /// Takes what arrived; when `wait` (nothing else to do this tick), first waits up to that
    /// long for something. Answers the chunks' KV to install, in order.
    pub async fn arrived(&mut self, wait: Option<Duration>) -> Vec<Install> {
        let mut got = vec![];
        if let Some(d) = wait {
            if let Ok(Some(a)) = tokio::time::timeout(d, self.arrivals.recv()).await {
                got.push(a);
            }
        }
        while let Ok(a) = self.arrivals.try_recv() {
            got.push(a);
        }
        let mut installs = vec![];
        for a in got {
            match a {
                Arrival::Computed { key, start } => {
                    if let Some(r) = self.reqs.get_mut(&key) {
                        if let Some((s, n, _)) = r.granted.filter(|(s, _, _)| *s == start) {
                            r.computed = s + n;
                            r.granted = None;
                            r.waiting_since.get_or_insert_with(Instant::now);
                        }
                    }
                }
                Arrival::Kv {
                    key,
                    start,
                    n,
                    bytes,
                    transfer,
                } => {
                    if let Some(r) = self.reqs.get(&key) {
                        if start
                            == r.installed
                                + installs
                                    .iter()
                                    .filter(|i: &&Install| i.key == key)
                                    .map(|i| i.n)
                                    .sum::<usize>()
                        {
                            installs.push(Install {
                                key,
                                start,
                                n,
                                bytes,
                                transfer,
                            });
                        } else {
                            self.failed(
                                key,
                                format!(
                                    "KV of [{start}, {}) arrived with {} positions installed",
                                    start + n,
                                    r.installed
                                ),
                            );
                        }
                    }
                }
                Arrival::Failed { key, why } => self.failed(key, why),
            }
        }
        installs
    }

    /// What to do with the scheduler's chunk of `n` tokens for `key` (granted again, the same,
    /// while `Pending`); sends the grant when there is one to send.
    pub fn plan(&mut self, key: ReqId, n: usize) -> Plan {
        let now = Instant::now();
        let Some(r) = self.reqs.get_mut(&key) else {
            return Plan::Local(n);
        };
        let end = r.counted + n;
        let timed_out = r.granted.is_some_and(|(_, _, t)| now - t > self.timeout)
            || r.waiting_since.is_some_and(|t| now - t > self.timeout);
        if timed_out {
            r.failed
                .get_or_insert_with(|| "the prefill worker took too long".into());
        }
        if let Some(why) = r.failed.clone() {
            let local = end.saturating_sub(r.installed);
            tracing::info!(key, why, from = r.installed, "prefilling here");
            self.forget(key);
            return Plan::Local(local);
        }
        // The prompt's last position is always run here (its logits give the first token).
        let remote_end = end.min(r.prompt.len() - 1);
        match r.granted {
            Some(_) => Plan::Pending,
            None if r.computed < remote_end => {
                let grant = PrefillGrant {
                    decoder: self.decoder.clone(),
                    key,
                    salt: r.salt.clone(),
                    prompt: r.prompt.clone(),
                    start: r.computed as u32,
                    n: (remote_end - r.computed) as u32,
                    kv_layout: self.kv_layout.clone(),
                    direct: None, // the link offers its connection
                };
                r.granted = Some((r.computed, remote_end - r.computed, now));
                let _ = self.orders.send(Order::Grant(grant));
                Plan::Pending
            }
            // Computed as far as the chunk goes remotely.
            None if remote_end == end => {
                r.counted = end;
                Plan::Done
            }
            // Only the last position is left: once every earlier one is here.
            None if r.installed == r.computed => {
                let local = end - r.installed;
                self.forget(key);
                Plan::Local(local)
            }
            None => Plan::Pending,
        }
    }
}

/// The NATS side of a decode worker's remote prefill: runs until the device end is dropped.
/// The KV arrives on `kv_client`, a connection of its own, so that the worker's heartbeats,
/// events and orders never wait behind it, or, where `direct` offers it, on direct connections
/// ([`crate::disaggregated::kv_link`]: the offer grants carry, and what those connections deliver).
pub async fn link(
    client: async_nats::Client,
    kv_client: async_nats::Client,
    end: LinkEnd,
    decoder: String,
    model: String,
    heartbeat: Duration,
    direct: Option<(DirectKv, UnboundedReceiver<Received>)>,
) -> Result<(), async_nats::SubscribeError> {
    let LinkEnd {
        mut orders,
        arrivals,
        live,
    } = end;
    let mut kv = kv_client.subscribe(subjects::prefill_kv(&decoder)).await?;
    let mut beats = client.subscribe(subjects::WORKER_STATUS_ALL).await?;
    let mut check = tokio::time::interval(heartbeat);
    let (offer, mut received) = match direct {
        Some((offer, rx)) => (Some(offer), rx),
        None => (None, unbounded_channel().1),
    };
    let mut link = Link {
        client,
        decoder,
        model,
        arrivals,
        live,
        peers: WorkerTable::new(3 * heartbeat),
        targets: HashMap::new(),
        assemblies: HashMap::new(),
        offer,
    };
    loop {
        tokio::select! {
            order = orders.recv() => match order {
                None => return Ok(()),
                Some(order) => link.order(order).await,
            },
            Some(m) = kv.next() => match llmq_protocol::decode::<PrefillReply>(&m.payload) {
                Ok(reply) => link.reply(reply),
                Err(e) => tracing::warn!(error = %e, "an undecodable prefill reply"),
            },
            Some(r) = received.recv() => link.direct(r),
            Some(m) = beats.next() => {
                if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                    link.heard(s);
                }
            }
            _ = check.tick() => link.check(),
        }
    }
}

/// The time since `sent_at_us` (UNIX microseconds, the sender's clock): a chunk's transfer.
fn since(sent_at_us: u64) -> Duration {
    let sent_at = std::time::UNIX_EPOCH + Duration::from_micros(sent_at_us);
    std::time::SystemTime::now()
        .duration_since(sent_at)
        .unwrap_or_default()
}

/// The link's state: the prefill workers heard, which one serves each request, the chunks
/// whose pieces are arriving.
struct Link {
    client: async_nats::Client,
    decoder: String,
    model: String,
    arrivals: UnboundedSender<Arrival>,
    live: Arc<AtomicBool>,
    peers: WorkerTable,
    targets: HashMap<ReqId, String>,
    assemblies: HashMap<(ReqId, u32), KvAssembly>,
    /// The direct KV connection grants offer, if this worker listens.
    offer: Option<DirectKv>,
}

impl Link {
    fn prefill_workers(&self) -> Vec<WorkerStatus> {
        self.peers
            .live()
            .filter(|w| w.role == WorkerRole::Prefill && w.model == self.model)
            .cloned()
            .collect()
    }

    fn fail(&self, key: ReqId, why: String) {
        let _ = self.arrivals.send(Arrival::Failed { key, why });
    }

    /// A grant goes to the request's prefill worker (the least loaded live one for its first);
    /// a drop to the worker that had it.
    async fn order(&mut self, order: Order) {
        match order {
            Order::Grant(mut g) => {
                g.direct = self.offer.clone();
                let key = g.key;
                if !self.targets.contains_key(&key) {
                    let Some(w) = self
                        .prefill_workers()
                        .into_iter()
                        .min_by_key(|w| (w.queued_prefill_tokens, w.active_streams))
                    else {
                        return self.fail(key, "no prefill worker is live".into());
                    };
                    self.targets.insert(key, w.worker_id);
                }
                let target = subjects::prefill_orders(&self.targets[&key]);
                let sent = match llmq_protocol::encode(&PrefillOrder::Grant(g)) {
                    Ok(bytes) => self
                        .client
                        .publish(target, bytes.into())
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(why) = sent {
                    self.fail(key, why);
                }
            }
            Order::Drop(key) => {
                self.assemblies.retain(|(k, _), _| *k != key);
                if let Some(target) = self.targets.remove(&key) {
                    if let Ok(bytes) = llmq_protocol::encode(&PrefillOrder::Drop {
                        decoder: self.decoder.clone(),
                        key,
                    }) {
                        let _ = self
                            .client
                            .publish(subjects::prefill_orders(&target), bytes.into())
                            .await;
                    }
                }
            }
        }
    }

    /// A chunk from a direct connection: its frame (the chunk is computed), then its bytes,
    /// checked against the frame by the connection, for the device thread.
    fn direct(&mut self, r: Received) {
        let key = match &r {
            Received::Frame(f) | Received::Bytes(f, ..) => f.key,
        };
        if !self.sign_of_life(key) {
            return; // a request forgotten here
        }
        match r {
            Received::Frame(f) => {
                let _ = self.arrivals.send(Arrival::Computed {
                    key,
                    start: f.start as usize,
                });
            }
            Received::Bytes(f, bytes, checked) => match checked {
                Ok(()) => {
                    let transfer = since(f.sent_at_us);
                    let _ = self.arrivals.send(Arrival::Kv {
                        key,
                        start: f.start as usize,
                        n: f.n as usize,
                        bytes,
                        transfer,
                    });
                }
                Err(e) => self.fail(key, format!("chunk at {}: {e}", f.start)),
            },
        }
    }

    /// A message about `key` from its prefill worker shows that worker alive, as a heartbeat
    /// would (its heartbeats may wait behind its KV in the server's queue for this worker).
    /// Whether `key` is still a remote request here.
    fn sign_of_life(&mut self, key: ReqId) -> bool {
        match self.targets.get(&key) {
            Some(target) => {
                self.peers.heard_from_at(target, Instant::now());
                true
            }
            None => false,
        }
    }

    /// A piece of a chunk's KV (its first: the chunk is computed; its last: the chunk goes to
    /// the device thread, checked), or a failed grant.
    fn reply(&mut self, reply: PrefillReply) {
        let key = match &reply {
            PrefillReply::Kv(p) => p.key,
            PrefillReply::Failed { key, .. } => *key,
        };
        let known = self.sign_of_life(key);
        let p = match reply {
            PrefillReply::Kv(p) if known => p,
            PrefillReply::Kv(_) => return, // for a request forgotten here
            PrefillReply::Failed { key, start, error } => {
                return self.fail(key, format!("chunk at {start}: {}", error.message))
            }
        };
        let (key, start, n) = (p.key, p.start, p.n as usize);
        let slot = (key, start);
        if !self.assemblies.contains_key(&slot) {
            let _ = self.arrivals.send(Arrival::Computed {
                key,
                start: start as usize,
            });
        }
        let sent_at_us = p.sent_at_us;
        match self.assemblies.entry(slot).or_default().add(p) {
            Ok(None) => {}
            Ok(Some(bytes)) => {
                self.assemblies.remove(&slot);
                let _ = self.arrivals.send(Arrival::Kv {
                    key,
                    start: start as usize,
                    n,
                    bytes,
                    transfer: since(sent_at_us),
                });
            }
            Err(e) => {
                self.assemblies.remove(&slot);
                self.fail(key, e.to_string());
            }
        }
    }

    fn heard(&mut self, s: WorkerStatus) {
        if s.role == WorkerRole::Prefill && s.model == self.model {
            self.live.store(true, Ordering::Relaxed);
        }
        self.peers.update(s);
    }

    /// Whether a prefill worker is live; the requests of one gone silent fail over.
    fn check(&mut self) {
        let alive = self.prefill_workers();
        self.live.store(!alive.is_empty(), Ordering::Relaxed);
        let gone: Vec<ReqId> = self
            .targets
            .iter()
            .filter(|(_, t)| !alive.iter().any(|w| &&w.worker_id == t))
            .map(|(k, _)| *k)
            .collect();
        for key in gone {
            let target = self.targets.remove(&key).unwrap_or_default();
            self.assemblies.retain(|(k, _), _| *k != key);
            self.fail(key, format!("prefill worker {target} went silent"));
        }
    }
}
