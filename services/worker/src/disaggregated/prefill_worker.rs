//! The prefill worker process (`worker.role = "prefill"`, `llmq worker` with
//! `LLMQ__WORKER__ROLE=prefill`): takes no jobs; serves the chunk grants of decode workers
//! (`subjects::prefill_orders(<its id>)`) one at a time, in the order they come, on its device
//! thread (`prefill_server`), and sends each chunk's KV to its decoder in pieces from a task of
//! its own, so the next grant is computed while the last chunk's KV is on the way: on the
//! decoder's direct connection where its grant offers one ([`crate::disaggregated::kv_link`]), else over NATS.
//!
//! It heartbeats like any worker (role `prefill`: sessions held, the grant's tokens in
//! progress, KV bytes sent), so decode workers find it and see it go. When a decoder goes
//! silent, its sessions are dropped.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use futures::StreamExt;
use llmq_config::Settings;
use llmq_engine::prefix::PrefixCache;
use llmq_protocol::prefill::{
    kv_checksum, kv_pieces, DirectKv, KvFrame, PrefillOrder, PrefillReply,
};
use llmq_protocol::workers::WorkerTable;
use llmq_protocol::{subjects, WireError, WorkerRole, WorkerStatus};
use tokio::sync::mpsc;

use crate::device::{auto_kv_budget, load_on_device, stop_device};
use crate::disaggregated::kv_link::Connections;
use crate::disaggregated::prefill_side::{Forget, GetReport, PrefillServer, Serve};
use crate::error::{nats_err, WorkerError};
use crate::roles::cache::CacheActor;
use crate::seq::Shared;
use crate::time::unix_ms;

/// A served grant's answer, on its way to its decoder.
struct Answer {
    decoder: String,
    key: u64,
    start: u32,
    n: u32,
    kv: Result<Vec<u8>, WireError>,
    /// The decoder's direct connection, if its grant offered one.
    direct: Option<DirectKv>,
}

/// Runs a prefill worker until `stop` completes.
pub async fn run(
    settings: Settings,
    client: async_nats::Client,
    worker_id: String,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), WorkerError> {
    let (server, status, device) = start_server(&settings, &worker_id).await?;
    let served = async {
        let mut orders = client.subscribe(subjects::prefill_orders(&worker_id)).await.map_err(nats_err)?;
        let mut beats = client.subscribe(subjects::WORKER_STATUS_ALL).await.map_err(nats_err)?;
        let (tx, rx) = mpsc::unbounded_channel::<Answer>();
        // The KV leaves on a connection of its own: heartbeats queued behind a prompt's
        // gigabyte of KV would make this worker look silent to its decoders.
        let kv_client = llmq_protocol::connect(&settings.nats.url, settings.nats.ca_file.as_deref(), "llmq-prefill-kv").await.map_err(nats_err)?;
        actix::spawn(send_answers(kv_client, rx, status.clone()));
        let heartbeat = Duration::from_millis(settings.worker.heartbeat_ms);
        actix::spawn(heartbeats(client.clone(), subjects::worker_status(&worker_id), status.clone(), heartbeat));
        tracing::info!(%worker_id, model = %settings.worker.model, "prefill worker ready");
        let mut peers = WorkerTable::new(3 * heartbeat);
        let mut decoders: HashSet<String> = HashSet::new();
        let mut check = tokio::time::interval(heartbeat);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Some(m) = orders.next() => match llmq_protocol::decode::<PrefillOrder>(&m.payload) {
                    Ok(PrefillOrder::Grant(g)) => {
                        decoders.insert(g.decoder.clone());
                        let (decoder, key, start, n, direct) = (g.decoder.clone(), g.key, g.start, g.n, g.direct.clone());
                        status.lock().unwrap().queued_prefill_tokens = n as u64;
                        let kv = server.send(Serve(g)).await.unwrap_or_else(|e| Err(crate::seq::internal(format!("prefill server lost: {e}"))));
                        status.lock().unwrap().queued_prefill_tokens = 0;
                        refresh(&server, &status).await;
                        let _ = tx.send(Answer { decoder, key, start, n, kv, direct });
                    }
                    Ok(PrefillOrder::Drop { decoder, key }) => {
                        let _ = server.send(Forget { decoder, key: Some(key) }).await;
                        refresh(&server, &status).await;
                    }
                    Err(e) => tracing::warn!(error = %e, "an undecodable prefill order"),
                },
                Some(m) = beats.next() => {
                    if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                        peers.update(s);
                    }
                }
                _ = check.tick() => {
                    // A decoder gone silent will not drop its sessions itself.
                    let gone: Vec<String> = decoders.iter().filter(|d| !peers.live().any(|w| &w.worker_id == *d)).cloned().collect();
                    for d in gone {
                        tracing::info!(decoder = %d, "a decoder went silent; dropping its sessions");
                        decoders.remove(&d);
                        let _ = server.send(Forget { decoder: d, key: None }).await;
                        refresh(&server, &status).await;
                    }
                }
            }
        }
        let _ = client.flush().await;
        Ok(())
    }
    .await;
    stop_device(device).await;
    served
}

/// Puts the server's counters into the status the heartbeats send.
async fn refresh(server: &Addr<PrefillServer>, status: &Mutex<WorkerStatus>) {
    let report = server.send(GetReport).await.unwrap_or_default();
    let mut s = status.lock().unwrap();
    s.active_streams = report.sessions as u32;
    s.kv_bytes_used = report.kv_bytes;
    s.prefill_calls = report.calls;
    s.prefill_ms = report.ms;
}

/// Loads the model on a device thread of its own and starts the prefill server there, with a
/// prefix cache of its own.
async fn start_server(
    settings: &Settings,
    worker_id: &str,
) -> Result<(Addr<PrefillServer>, Arc<Mutex<WorkerStatus>>, Arbiter), WorkerError> {
    let (ready_tx, ready_rx) =
        std::sync::mpsc::channel::<Result<(Addr<PrefillServer>, WorkerStatus), WorkerError>>();
    let w = settings.worker.clone();
    let prefix = settings.prefix_cache.clone();
    let kv_budget = settings.scheduler.kv_budget_bytes;
    let device = Arbiter::new();
    device.spawn_fn(move || {
        let loaded = load_on_device(&w, false);
        let _ = ready_tx.send(loaded.map(|m| {
            let model = m.model;
            let budget = kv_budget.unwrap_or_else(|| auto_kv_budget(model.weight_bytes()));
            let max = if prefix.max_bytes == 0 {
                budget
            } else {
                prefix.max_bytes.min(budget)
            };
            let cache = CacheActor::new(prefix.enabled.then(|| {
                PrefixCache::new(prefix.block_tokens, max).with_reuse_unit(model.chunk_grid())
            }))
            .start();
            let c = &model.config;
            let status = WorkerStatus {
                model: w.model.clone(),
                role: WorkerRole::Prefill,
                context_tokens: c.max_position_embeddings as u32,
                kv_bytes_per_token: model.kv_layout().bytes(1) as u64,
                ..Default::default()
            };
            let shared = Shared::new(model, m.tokenizer, prefix.enabled);
            (PrefillServer::new(shared, cache).start(), status)
        }));
    });
    match tokio::task::spawn_blocking(move || ready_rx.recv()).await {
        Ok(Ok(Ok((server, mut status)))) => {
            status.worker_id = worker_id.to_string();
            Ok((server, Arc::new(Mutex::new(status)), device))
        }
        Ok(Ok(Err(e))) => {
            stop_device(device).await;
            Err(e)
        }
        _ => {
            stop_device(device).await;
            Err(WorkerError::DeviceStopped)
        }
    }
}

/// Sends each served grant's KV to its decoder in pieces (or the grant's failure), in order.
async fn send_answers(
    client: async_nats::Client,
    mut answers: mpsc::UnboundedReceiver<Answer>,
    status: Arc<Mutex<WorkerStatus>>,
) {
    let mut connections = Connections::default();
    while let Some(a) = answers.recv().await {
        if let (Ok(bytes), Some(to)) = (&a.kv, &a.direct) {
            let frame = KvFrame {
                token: to.token,
                key: a.key,
                start: a.start,
                n: a.n,
                total_bytes: bytes.len() as u64,
                checksum: kv_checksum(bytes),
                sent_at_us: unix_us(),
            };
            if connections.send(to, &frame, bytes).await {
                let mut s = status.lock().unwrap();
                s.kv_bytes_sent += bytes.len() as u64;
                s.kv_bytes_sent_direct += bytes.len() as u64;
                continue;
            }
        }
        let subject = subjects::prefill_kv(&a.decoder);
        let replies: Vec<PrefillReply> = match &a.kv {
            Ok(bytes) => kv_pieces(a.key, a.start, a.n, unix_us(), bytes)
                .map(PrefillReply::Kv)
                .collect(),
            Err(error) => vec![PrefillReply::Failed {
                key: a.key,
                start: a.start,
                error: error.clone(),
            }],
        };
        for r in replies {
            match llmq_protocol::encode(&r) {
                Ok(bytes) => {
                    if let Err(e) = client.publish(subject.clone(), bytes.into()).await {
                        tracing::warn!(error = %e, "sending prompt KV");
                    }
                }
                Err(e) => tracing::error!(error = %e, "encoding prompt KV"),
            }
        }
        if let Ok(bytes) = &a.kv {
            let mut s = status.lock().unwrap();
            s.kv_bytes_sent += bytes.len() as u64;
        }
    }
}

fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

/// The status every `period`, whatever the device thread is doing.
async fn heartbeats(
    client: async_nats::Client,
    subject: String,
    status: Arc<Mutex<WorkerStatus>>,
    period: Duration,
) {
    loop {
        let mut s = status.lock().unwrap().clone();
        s.sent_at_ms = unix_ms();
        if let Ok(bytes) = llmq_protocol::encode(&s) {
            let _ = client.publish(subject.clone(), bytes.into()).await;
        }
        tokio::time::sleep(period).await;
    }
}
