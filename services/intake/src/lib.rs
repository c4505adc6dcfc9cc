//! Intake: the front door. Stateless; run as many as you like (they share the queue group).
//!
//! For each [`GenerateRequest`] on `llm.v1.generate` it decodes, validates, applies the chat
//! template, tokenizes, checks the context limit, assigns the request id, puts the [`Job`] on the
//! JetStream jobs stream (durable: a job accepted while no worker runs waits for one) and
//! replies `Accepted` at once, or `Rejected` with a typed error. Bad input disturbs nothing.
//!
//! It also follows the workers' heartbeats and the jobs stream: a model with
//! `intake.max_queued_requests` requests waiting (jobs no worker has taken yet, polled from the
//! stream's consumer every 250 ms, plus jobs workers hold but have not started, from their
//! heartbeats) refuses new ones (`queue_full`), and a request with `require_worker` is refused
//! (`no_worker`) when no worker of its model has been heard from for `intake.no_worker_grace_ms`
//! (workers that are restarting still serve it: its jobs wait for them). Jobs are not pushed to a chosen worker:
//! the model's workers pull them when they have a free slot (see the worker service), which
//! places work on the least loaded one without stranding jobs on a worker that stopped.

pub mod validate;

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;
use async_nats::jetstream;
use futures::StreamExt;
use llmq_config::Settings;
use llmq_protocol::workers::WorkerTable;
use llmq_protocol::{
    subjects, ErrorClass, GenerateReply, GenerateRequest, Job, JobQuery, JobState, ToolSyntax,
    WireError, WorkerStatus,
};

pub use validate::{ModelInfo, Validator};

#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error("model {model}: {source}")]
    Model {
        model: String,
        #[source]
        source: llmq_text::Error,
    },
    #[error("NATS: {0}")]
    Nats(#[source] Box<dyn std::error::Error + Send + Sync>),
}

fn nats(e: impl std::error::Error + Send + Sync + 'static) -> IntakeError {
    IntakeError::Nats(Box::new(e))
}

pub struct IntakeActor {
    validator: Arc<Validator>,
    client: async_nats::Client,
    js: jetstream::Context,
    workers: WorkerTable,
    max_queued_requests: u64,
    no_worker_grace: std::time::Duration,
    /// Per model: jobs in the stream that no worker has taken yet (last poll).
    untaken: HashMap<String, u64>,
    /// Requests received and not answered yet.
    pending: usize,
}

/// How many requests are received and not answered yet.
#[derive(Message)]
#[rtype(result = "usize")]
struct Pending;

impl Handler<Pending> for IntakeActor {
    type Result = usize;
    fn handle(&mut self, _: Pending, _: &mut Context<Self>) -> usize {
        self.pending
    }
}

impl IntakeActor {
    /// Decodes, validates, and checks the model's live workers.
    fn admit(&self, payload: &[u8]) -> Result<(Job, Option<ToolSyntax>), WireError> {
        let req: GenerateRequest = llmq_protocol::decode(payload)
            .map_err(|e| WireError::new(ErrorClass::InvalidRequest, e.to_string()))?;
        let require_worker = req.require_worker;
        let (job, tool_syntax) = self.validator.validate(req)?;
        let (mut live, mut queued) = (0, self.untaken.get(&job.model).copied().unwrap_or(0));
        for w in self.workers.live_for(&job.model) {
            live += 1;
            queued += w.queued_requests as u64;
        }
        if require_worker
            && live == 0
            && !self.workers.model_heard_within(
                &job.model,
                self.no_worker_grace,
                std::time::Instant::now(),
            )
        {
            return Err(WireError::new(
                ErrorClass::NoWorker,
                format!("no live worker serves model {:?}", job.model),
            ));
        }
        if queued >= self.max_queued_requests {
            return Err(WireError::new(
                ErrorClass::QueueFull,
                format!(
                    "{queued} requests are waiting for model {:?}: try again later",
                    job.model
                ),
            ));
        }
        Ok((job, tool_syntax))
    }
}

impl Actor for IntakeActor {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Incoming(async_nats::Message);

#[derive(Message)]
#[rtype(result = "()")]
struct Heartbeat(WorkerStatus);

#[derive(Message)]
#[rtype(result = "()")]
struct Untaken(String, u64);

impl Handler<Untaken> for IntakeActor {
    type Result = ();
    fn handle(&mut self, Untaken(model, n): Untaken, _: &mut Context<Self>) {
        self.untaken.insert(model, n);
    }
}

/// Jobs of `model` in the stream that no worker has taken: the shared consumer's pending count,
/// or, before any worker has created that consumer, every job stored under the model's subject.
async fn untaken_jobs(stream: &jetstream::stream::Stream, model: &str) -> Option<u64> {
    if let Ok(info) = stream.consumer_info(subjects::jobs_consumer(model)).await {
        return Some(info.num_pending);
    }
    let mut counts = stream
        .info_with_subjects(subjects::jobs(model))
        .await
        .ok()?;
    let mut n = 0;
    while let Some(Ok((_, c))) = counts.next().await {
        n += c as u64;
    }
    Some(n)
}

impl Handler<Heartbeat> for IntakeActor {
    type Result = ();
    fn handle(&mut self, Heartbeat(s): Heartbeat, _: &mut Context<Self>) {
        self.workers.update(s);
    }
}

async fn reply(client: &async_nats::Client, to: async_nats::Subject, r: &GenerateReply) {
    match llmq_protocol::encode(r) {
        Ok(b) => {
            if let Err(e) = client.publish(to, b.into()).await {
                tracing::warn!(error = %e, "replying");
            }
        }
        Err(e) => tracing::error!(error = %e, "encoding a reply"),
    }
}

impl Handler<Incoming> for IntakeActor {
    type Result = ();
    fn handle(&mut self, Incoming(msg): Incoming, ctx: &mut Context<Self>) {
        let Some(reply_to) = msg.reply.clone() else {
            tracing::debug!("generate request without a reply subject: dropped");
            return;
        };
        let client = self.client.clone();
        // A child of the client's trace when it sent one (`traceparent` header); the worker's
        // span for the job is a child of this one (the job's headers carry it on).
        let span = tracing::info_span!(
            "intake.accept",
            request_id = tracing::field::Empty,
            model = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            error = tracing::field::Empty
        );
        llmq_telemetry::extract(&span, msg.headers.as_ref());
        let verdict = self.admit(&msg.payload);
        match &verdict {
            Ok((job, _)) => {
                span.record("request_id", job.request_id.as_str());
                span.record("model", job.model.as_str());
                span.record("prompt_tokens", job.prompt_ids.len() as i64);
            }
            Err(e) => {
                span.record("error", tracing::field::debug(e.class));
            }
        }
        let js = self.js.clone();
        self.pending += 1;
        ctx.spawn(
            async move {
                let answer = match verdict {
                    Err(error) => GenerateReply::Rejected { error },
                    Ok((job, tool_syntax)) => {
                        let subject = subjects::jobs(&job.model);
                        let headers = llmq_telemetry::headers_for(&span);
                        let stored = match llmq_protocol::encode(&job) {
                            Ok(bytes) => match js
                                .publish_with_headers(subject, headers, bytes.into())
                                .await
                            {
                                Ok(ack) => ack.await.map(|a| a.sequence).map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            },
                            Err(e) => Err(e.to_string()),
                        };
                        match stored {
                            Ok(seq) => GenerateReply::Accepted {
                                request_id: job.request_id,
                                stream_subject: job.stream_subject,
                                tool_syntax,
                                job_seq: Some(seq),
                            },
                            Err(e) => GenerateReply::Rejected {
                                error: WireError::new(
                                    ErrorClass::Internal,
                                    format!("storing the job: {e}"),
                                ),
                            },
                        }
                    }
                };
                reply(&client, reply_to, &answer).await;
                drop(span);
            }
            .into_actor(self)
            .map(|_, act, _| act.pending -= 1),
        );
    }
}

/// Loads the configured models' tokenizers and serves `llm.v1.generate` until `stop` completes (the binary passes SIGTERM or SIGINT): then
/// it leaves the queue group (other intakes take new requests), answers every request it had
/// received (at most 10 s more), and returns. Must be called inside an actix System.
pub async fn run(
    settings: Settings,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), IntakeError> {
    let mut models = HashMap::new();
    for name in &settings.intake.models {
        let info = ModelInfo::load(name).map_err(|source| IntakeError::Model {
            model: name.clone(),
            source,
        })?;
        models.insert(name.clone(), info);
    }
    let validator = Arc::new(Validator::new(
        models,
        settings.intake.default_max_tokens,
        settings.intake.schema_objects,
    ));
    let client = llmq_protocol::connect(
        &settings.nats.url,
        settings.nats.ca_file.as_deref(),
        "llmq-intake",
    )
    .await
    .map_err(nats)?;
    let js = jetstream::new(client.clone());
    let stream = subjects::jobs_stream(&js).await.map_err(nats)?;
    // Cancels are stored from the start, so a job cancelled while it waits with no worker up is
    // ended, not run, by the worker that takes it.
    subjects::cancels_stream(&js).await.map_err(nats)?;
    let mut sub = client
        .queue_subscribe(subjects::GENERATE, subjects::INTAKE_QUEUE.into())
        .await
        .map_err(nats)?;
    let mut beats = client
        .subscribe(subjects::WORKER_STATUS_ALL)
        .await
        .map_err(nats)?;
    let mut queries = client
        .queue_subscribe(subjects::JOB_STATE, subjects::INTAKE_QUEUE.into())
        .await
        .map_err(nats)?;
    let addr = IntakeActor {
        validator,
        client: client.clone(),
        js,
        workers: WorkerTable::new(std::time::Duration::from_millis(
            settings.intake.worker_timeout_ms,
        )),
        max_queued_requests: settings.intake.max_queued_requests,
        no_worker_grace: std::time::Duration::from_millis(settings.intake.no_worker_grace_ms),
        untaken: HashMap::new(),
        pending: 0,
    }
    .start();
    let (query_client, query_stream) = (client.clone(), stream.clone());
    let (poll_addr, poll_models) = (addr.clone(), settings.intake.models.clone());
    actix::spawn(async move {
        loop {
            for m in &poll_models {
                if let Some(n) = untaken_jobs(&stream, m).await {
                    poll_addr.do_send(Untaken(m.clone(), n));
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    });
    let beat_addr = addr.clone();
    actix::spawn(async move {
        while let Some(m) = beats.next().await {
            if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                beat_addr.do_send(Heartbeat(s));
            }
        }
    });
    actix::spawn(async move {
        while let Some(m) = queries.next().await {
            let (client, stream) = (query_client.clone(), query_stream.clone());
            actix::spawn(async move { answer_job_query(&client, &stream, m).await });
        }
    });
    tracing::info!(models = ?settings.intake.models, "intake ready");
    tokio::pin!(stop);
    loop {
        tokio::select! {
            msg = sub.next() => match msg {
                Some(msg) => addr.do_send(Incoming(msg)),
                None => break,
            },
            _ = &mut stop => break,
        }
    }
    // No more requests: those already received are answered before the process goes.
    let _ = sub.unsubscribe().await;
    while let Ok(Some(msg)) =
        tokio::time::timeout(std::time::Duration::from_millis(100), sub.next()).await
    {
        addr.do_send(Incoming(msg));
    }
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while addr.send(Pending).await.unwrap_or(0) > 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let _ = client.flush().await;
    tracing::info!("intake stopped");
    Ok(())
}

/// Answers a [`JobQuery`]: [`Pending`] while the job's message is in the jobs stream (a worker
/// acknowledges it only once its terminal event is out), [`Gone`] once it is not. A stream that
/// cannot be read gets no answer: the client cannot tell, and asks again.
async fn answer_job_query(
    client: &async_nats::Client,
    stream: &jetstream::stream::Stream,
    m: async_nats::Message,
) {
    let Some(reply_to) = m.reply.clone() else {
        return;
    };
    let Ok(q) = llmq_protocol::decode::<JobQuery>(&m.payload) else {
        return;
    };
    let state = match stream.get_raw_message(q.job_seq).await {
        // The sequence must still be this job's (a stream made anew counts from 1 again).
        Ok(raw) => match llmq_protocol::decode::<Job>(&raw.payload) {
            Ok(job) if job.request_id == q.request_id => JobState::Pending,
            _ => JobState::Gone,
        },
        Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {
            JobState::Gone
        }
        Err(e) => {
            tracing::debug!(error = %e, "job query: the jobs stream could not be read");
            return;
        }
    };
    if let Ok(bytes) = llmq_protocol::encode(&state) {
        let _ = client.publish(reply_to, bytes.into()).await;
    }
}
