//! The worker's side of the jobs stream: its durable consumer, taking one job at a time while
//! placement allows (`Jobs`), handing back what a stopping worker has not started, draining
//! what it runs, and replaying stored cancels.

use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use llmq_config::Settings;
use llmq_protocol::{subjects, Cancel, ErrorClass, Event, Job, StreamEvent, WireError};

use crate::actor::{CancelRequest, EndAll, HandBack, HandedBack, Submit};
use crate::placement::Placement;
use actix::Addr;

use crate::actor::SchedulerActor;
use crate::error::{nats_err, WorkerError};
use crate::held::Inflight;
use crate::roles::RoleActors;

/// The worker's scheduler actor, around its role actors.
pub(crate) type Scheduler = Addr<SchedulerActor<RoleActors>>;

/// How long one fetch waits for a job: also how late a stopping worker notices its stop.
const FETCH_WAIT: Duration = Duration::from_millis(100);

/// The model's durable pull consumer of the jobs stream, shared by all its workers.
pub(crate) async fn jobs_consumer(
    js: &jetstream::Context,
    settings: &Settings,
) -> Result<jetstream::consumer::Consumer<pull::Config>, WorkerError> {
    let model = &settings.worker.model;
    let stream = subjects::jobs_stream(js).await.map_err(nats_err)?;
    let config = pull::Config {
        durable_name: Some(subjects::jobs_consumer(model)),
        filter_subject: subjects::jobs(model),
        ack_wait: Duration::from_millis(settings.worker.ack_wait_ms),
        ..Default::default()
    };
    stream
        .get_or_create_consumer(&subjects::jobs_consumer(model), config)
        .await
        .map_err(nats_err)
}

/// Taking jobs from the model's consumer while there is room.
pub(crate) struct Jobs<'a> {
    pub(crate) client: &'a async_nats::Client,
    pub(crate) consumer: &'a jetstream::consumer::Consumer<pull::Config>,
    pub(crate) placement: &'a Mutex<Placement>,
    pub(crate) inflight: &'a Inflight,
    pub(crate) actor: &'a Scheduler,
    pub(crate) handed_back: &'a jetstream::stream::Stream,
}

impl Jobs<'_> {
    /// Fetches at most one job (waiting up to `FETCH_WAIT` for one) when there is room, and submits
    /// it. One job per fetch: the server hands jobs to the workers' waiting fetches in turn, so
    /// equal workers share a burst evenly, and a worker without room asks for nothing.
    pub(crate) async fn fetch_one(&self) {
        let limit = self
            .placement
            .lock()
            .unwrap()
            .limit_at(std::time::Instant::now());
        if limit.saturating_sub(self.inflight.len()) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            return;
        }
        let fetched = std::time::Instant::now();
        let mut batch = match self
            .consumer
            .fetch()
            .max_messages(1)
            .expires(FETCH_WAIT)
            .messages()
            .await
        {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "fetching jobs");
                tokio::time::sleep(Duration::from_millis(200)).await;
                return;
            }
        };
        while let Some(msg) = batch.next().await {
            if let Ok(msg) = msg {
                self.take(msg, fetched).await;
            }
        }
    }

    /// Runs a job that came in answer to a fetch sent at `fetched`.
    async fn take(&self, msg: jetstream::Message, fetched: std::time::Instant) {
        let job = match llmq_protocol::decode::<Job>(&msg.payload) {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(error = %e, "undecodable job; dropping it");
                let _ = msg.ack_with(AckKind::Term).await;
                return;
            }
        };
        let mut first_seq = 0;
        if msg.info().map(|i| i.delivered).unwrap_or(1) > 1 {
            if let Ok(mark) = self
                .handed_back
                .get_last_raw_message_by_subject(&subjects::handed_back(&job.request_id))
                .await
            {
                // Handed back unstarted by a stopping worker: run it, going on from its seq.
                first_seq = String::from_utf8_lossy(&mark.payload).parse().unwrap_or(0);
                let _ = self.handed_back.delete_message(mark.sequence).await;
            } else {
                self.end_lost(&job, msg).await;
                return;
            }
        }
        let span = tracing::info_span!(
            "worker.request",
            request_id = %job.request_id,
            prompt_tokens = job.prompt_ids.len() as i64,
            cached_tokens = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
            queue_ms = tracing::field::Empty,
            ttft_ms = tracing::field::Empty,
            error = tracing::field::Empty
        );
        llmq_telemetry::extract(&span, msg.headers.as_ref());
        self.inflight
            .insert(job.request_id.clone(), msg, span, fetched);
        self.actor.do_send(Submit { job, first_seq });
    }

    /// Ends a job delivered again because its first worker stopped without finishing it (and
    /// without handing it back): that worker may have streamed events already, so it is not
    /// replayed.
    async fn end_lost(&self, job: &Job, msg: jetstream::Message) {
        // Every sample of it ends.
        for choice in 0..job.n.max(1) {
            let ev = StreamEvent {
                request_id: job.request_id.clone(),
                seq: llmq_protocol::SEQ_FROM_ANOTHER_WORKER,
                event: Event::Error {
                    error: WireError::new(
                        ErrorClass::WorkerLost,
                        "the worker running this request stopped",
                    ),
                },
                choice,
            };
            if let Ok(bytes) = llmq_protocol::encode(&ev) {
                let _ = self
                    .client
                    .publish(job.stream_subject.clone(), bytes.into())
                    .await;
            }
        }
        let _ = self.client.flush().await;
        let _ = msg.ack().await;
    }
}

/// A stopping worker's first step: the jobs it holds but has not started go back to the jobs
/// stream (nak'ed, marked in the handed-back stream with the seq to go on from), for another
/// worker, or this one once restarted, to run. Nothing is lost and nothing waits for the drain.
pub(crate) async fn hand_back(actor: &Scheduler, held: &Inflight, js: &jetstream::Context) {
    let back = actor.send(HandBack).await.unwrap_or_default();
    for HandedBack {
        request_id,
        next_seq,
    } in &back
    {
        let marked = match js
            .publish(
                subjects::handed_back(request_id),
                next_seq.to_string().into(),
            )
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = marked {
            tracing::warn!(error = %e, %request_id, "marking a job handed back; it will end with worker_lost");
        }
        if let Some((m, span)) = held.end(request_id) {
            span.record("error", "handed back unstarted");
            let _ = m.ack_with(AckKind::Nak(None)).await;
        }
    }
    if !back.is_empty() {
        tracing::info!(
            jobs = back.len(),
            "stopping: handed back the jobs not started"
        );
    }
}

/// Waits up to `grace` for every held job to end, then ends what is left with `worker_lost`
/// and waits (a few seconds at most) for those terminal events to be out and acknowledged.
pub(crate) async fn drain(actor: &Scheduler, inflight: &Inflight, grace: Duration) {
    let held = || inflight.len();
    tracing::info!(
        held = held(),
        grace_s = grace.as_secs(),
        "stopping: no more jobs; draining"
    );
    let wait_empty = |limit: Duration| async move {
        let until = tokio::time::Instant::now() + limit;
        while held() > 0 && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    wait_empty(grace).await;
    if held() > 0 {
        tracing::warn!(held = held(), "grace period over: ending what is left");
        let error = WireError::new(
            ErrorClass::WorkerLost,
            "the worker stopped before finishing this request",
        );
        let _ = actor.send(EndAll(error)).await;
        wait_empty(Duration::from_secs(5)).await;
    }
    tracing::info!(left = held(), "drained");
}

/// Hands every cancel the cancels stream holds to the actor (which remembers those of requests
/// it does not hold, and ends such a job with [`Cancelled`] if it ever arrives). Returns how many.
pub(crate) async fn replay_cancels(
    stream: &jetstream::stream::Stream,
    actor: &Scheduler,
) -> Result<usize, WorkerError> {
    let consumer = stream
        .create_consumer(pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ack_policy: jetstream::consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .map_err(nats_err)?;
    let mut n = 0;
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(1000)
            .messages()
            .await
            .map_err(nats_err)?;
        let mut got = 0;
        while let Some(Ok(m)) = batch.next().await {
            got += 1;
            if let Ok(c) = llmq_protocol::decode::<Cancel>(&m.payload) {
                actor.do_send(CancelRequest(c.request_id));
            }
        }
        n += got;
        if got == 0 {
            return Ok(n);
        }
    }
}
