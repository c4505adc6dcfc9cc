//! NATS subjects, v1. Everything a client or a service publishes or subscribes to is named here.

/// Request/reply: a client submits a `GenerateRequest`, gets a `GenerateReply` at once.
pub const GENERATE: &str = "llm.v1.generate";
/// Queue group of the intake services on [`GENERATE`].
pub const INTAKE_QUEUE: &str = "intake";
/// Broadcast: `Cancel`. Whichever worker holds the request drops it. The server also stores
/// cancels in the stream `CANCELS_STREAM` for an hour, so a worker that starts later ends a
/// cancelled job that was still waiting instead of running it.
pub const CANCEL: &str = "llm.v1.cancel";
/// JetStream stream keeping recent cancels (subject [`CANCEL`]).
pub const CANCELS_STREAM: &str = "LLMQ_CANCELS_V1";
/// Broadcast: `ClearCache`. Workers drop their cached prefixes (reply: `CacheCleared`).
pub const CACHE_CLEAR: &str = "llm.v1.cache.clear";
/// Workers' `WorkerStatus` heartbeats: `llm.v1.worker.<id>.status`.
pub const WORKER_STATUS_ALL: &str = "llm.v1.worker.*.status";
/// Request/reply (queue group `INTAKE_QUEUE`): `JobQuery` in, `JobState` out. Whether an
/// accepted job is still in the jobs stream (waiting, or held by a worker that has not finished
/// it), for a client whose stream has gone silent: a job that is not there has ended or been
/// lost, and a client that has not seen its terminal event ends it (`watch`).
pub const JOB_STATE: &str = "llm.v1.job.state";
/// JetStream stream holding accepted jobs until a worker has finished them, and its subjects.
pub const JOBS_STREAM: &str = "LLMQ_JOBS_V1";
/// Every model's jobs subject.
pub const JOBS_ALL: &str = "llm.v1.jobs.>";

/// The default event stream of a request, when the client named no inbox of its own.
pub fn stream(request_id: &str) -> String {
    format!("llm.v1.stream.{request_id}")
}

/// A worker's heartbeats ([`crate::WorkerStatus`]).
pub fn worker_status(worker_id: &str) -> String {
    format!("llm.v1.worker.{worker_id}.status")
}

/// A prefill worker's orders (`PrefillOrder`): grants of prompt chunks from decode workers.
pub fn prefill_orders(worker_id: &str) -> String {
    format!("llm.v1.prefill.{}.orders", token(worker_id))
}

/// A decode worker's inbox for the prompt KV prefill workers send it (`PrefillReply`).
pub fn prefill_kv(worker_id: &str) -> String {
    format!("llm.v1.prefill.{}.kv", token(worker_id))
}

/// Accepted jobs for `model`: every worker serving the model pulls from one durable consumer
/// on this subject, when it has room.
pub fn jobs(model: &str) -> String {
    format!("llm.v1.jobs.{}", token(model))
}

/// The durable JetStream consumer that the workers of `model` share.
pub fn jobs_consumer(model: &str) -> String {
    format!("llmq-workers-{}", token(model))
}

/// Makes a string safe as one subject token.
pub fn token(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A client-chosen stream subject must be a plain subject: no wildcards, no empty tokens.
pub fn is_valid_stream_subject(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 256
        && s.split('.')
            .all(|t| !t.is_empty() && !t.contains(['*', '>', ' ', '\t', '\r', '\n']))
}

#[cfg(feature = "nats")]
type StreamResult = Result<
    async_nats::jetstream::stream::Stream,
    async_nats::jetstream::context::CreateStreamError,
>;

/// Creates (or finds) a stream. Intake and workers both call this, so either may start first;
/// a server whose JetStream is still starting is retried for up to 30 s.
#[cfg(feature = "nats")]
async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    config: async_nats::jetstream::stream::Config,
) -> StreamResult {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await
            }
            r => return r,
        }
    }
}

/// Creates (or finds) the jobs stream: work-queue retention, so a job stays until a worker
/// acknowledges it.
#[cfg(feature = "nats")]
pub async fn jobs_stream(js: &async_nats::jetstream::Context) -> StreamResult {
    use async_nats::jetstream::stream;
    let config = stream::Config {
        name: JOBS_STREAM.into(),
        subjects: vec![JOBS_ALL.into()],
        retention: stream::RetentionPolicy::WorkQueue,
        ..Default::default()
    };
    ensure_stream(js, config).await
}

/// Creates (or finds) the stream that keeps recent cancels (an hour, at most a million).
#[cfg(feature = "nats")]
pub async fn cancels_stream(js: &async_nats::jetstream::Context) -> StreamResult {
    use async_nats::jetstream::stream;
    let config = stream::Config {
        name: CANCELS_STREAM.into(),
        subjects: vec![CANCEL.into()],
        retention: stream::RetentionPolicy::Limits,
        max_age: std::time::Duration::from_secs(3600),
        max_messages: 1_000_000,
        ..Default::default()
    };
    ensure_stream(js, config).await
}

/// The jobs a stopping worker handed back before starting them: one message on
/// `llm.v1.handed_back.<request id as a token>` per job, whose payload is the `seq` its next event
/// gets, kept in the stream `HANDED_BACK_STREAM` (the last per subject, for an hour). The worker
/// that is handed such a job again runs it from that seq instead of ending it with
/// `worker_lost`, and deletes the message.
pub const HANDED_BACK_STREAM: &str = "LLMQ_HANDED_BACK_V1";

/// The subject of a handed-back job's mark.
pub fn handed_back(request_id: &str) -> String {
    format!("llm.v1.handed_back.{}", token(request_id))
}

/// Creates (or finds) the handed-back stream.
#[cfg(feature = "nats")]
pub async fn handed_back_stream(js: &async_nats::jetstream::Context) -> StreamResult {
    use async_nats::jetstream::stream;
    let config = stream::Config {
        name: HANDED_BACK_STREAM.into(),
        subjects: vec!["llm.v1.handed_back.*".into()],
        retention: stream::RetentionPolicy::Limits,
        max_messages_per_subject: 1,
        max_age: std::time::Duration::from_secs(3600),
        ..Default::default()
    };
    ensure_stream(js, config).await
}
