//! NATS subjects, v1. Everything a client or a service publishes or subscribes to is named here.

/// Request/reply: a client submits a `GenerateRequest`, gets a `GenerateReply` at once.
pub const GENERATE: &str = "llm.v1.generate";
/// Queue group of the intake services on `GENERATE`.
pub const INTAKE_QUEUE: &str = "intake";
/// Broadcast: `Cancel`. Whichever worker holds the request drops it.
pub const CANCEL: &str = "llm.v1.cancel";
/// Workers' `WorkerStatus` heartbeats: `llm.v1.worker.<id>.status`.
pub const WORKER_STATUS_ALL: &str = "llm.v1.worker.*.status";
/// JetStream stream holding accepted jobs, and its subjects.
pub const JOBS_STREAM: &str = "LLMQ_JOBS_V1";
pub const JOBS_ALL: &str = "llm.v1.jobs.>";
/// Jobs that any worker serving the model may take (no worker was up when they were accepted).
pub const JOBS_ANY_PREFIX: &str = "llm.v1.jobs.any";

/// The default event stream of a request, when the client named no inbox of its own.
pub fn stream(request_id: &str) -> String {
    format!("llm.v1.stream.{request_id}")
}

pub fn worker_status(worker_id: &str) -> String {
    format!("llm.v1.worker.{worker_id}.status")
}

/// Jobs routed to one worker.
pub fn worker_jobs(worker_id: &str) -> String {
    format!("llm.v1.jobs.worker.{worker_id}")
}

/// Jobs for any worker serving `model` (subject tokens may not contain '.', '*', '>' or spaces).
pub fn any_jobs(model: &str) -> String {
    format!("{JOBS_ANY_PREFIX}.{}", token(model))
}

/// Makes a string safe as one subject token.
pub fn token(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// A client-chosen stream subject must be a plain subject: no wildcards, no empty tokens.
pub fn is_valid_stream_subject(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 256
        && s.split('.').all(|t| !t.is_empty() && !t.contains(['*', '>', ' ', '\t', '\r', '\n']))
}
