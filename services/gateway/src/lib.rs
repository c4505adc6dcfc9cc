//! The OpenAI-compatible HTTP gateway: one more NATS client of llmq, like the CLI. It turns
//! `POST /v1/chat/completions` and `POST /v1/completions` into [`GenerateRequest`]s on
//! `llm.v1.generate` (with `require_worker`, so a model nobody serves is a 503 at once),
//! and the request's events into OpenAI's responses: server-sent chunks ending with
//! `data: [DONE]`, or one JSON body. `GET /v1/models` and `GET /health` come from the workers'
//! heartbeats, `GET /metrics` is Prometheus text. With tools, each choice's text goes through
//! a `ToolCallParser` in the syntax intake named: calls leave as `tool_calls` (streamed, one
//! delta per whole call) and the choice finishes with `tool_calls`.
//!
//! Invariants: every accepted request ends in exactly one outcome counted in the metrics; a
//! client that goes away before the end (a closed stream, a dropped connection while waiting for
//! a non-streamed answer) causes one [`Cancel`] on `llm.v1.cancel` as soon as the gateway notices,
//! which is at once for a waiting handler and at the next event (within a tick) for a stream;
//! errors leave as OpenAI error bodies with the status of their class; a request whose model
//! has had no worker for `intake.no_worker_grace_ms` while the request waits ends with
//! `worker_lost` (503) within `SILENCE` of that, instead of hanging (a restart of every worker
//! is shorter than the grace: its requests wait for the workers to come back); and each request's
//! [`Watch`] ends it with `worker_lost` when NATS lost its events or its job (a gap in the events,
//! a job gone without its terminal event, nothing alive for `gateway.silent_stream_timeout_ms`),
//! while a silent stream whose job is still waiting or running gets `: alive` comments.

pub mod client;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod response;
pub mod tool_calls;
pub mod tool_request;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse, HttpServer};
use futures::StreamExt;
use llmq_config::Settings;
use llmq_protocol::watch::{Silence, Watch};
use llmq_protocol::workers::WorkerTable;
use llmq_protocol::{
    subjects, Cancel, Event, FinishReason, GenerateReply, GenerateRequest, StreamEvent, ToolSyntax,
    Usage, WorkerStatus,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use error::ApiError;
use metrics::{Clock, Metrics};
use openai::{Kind, Shape};
use response::{failed, finish_reason, parsers, tool_call, SseWriter};

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("NATS: {0}")]
    Nats(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("HTTP server: {0}")]
    Http(#[from] std::io::Error),
    #[error("gateway.address_file {path}: {source}")]
    AddressFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn nats(e: impl std::error::Error + Send + Sync + 'static) -> GatewayError {
    GatewayError::Nats(Box::new(e))
}

/// What every handler shares.
pub struct State {
    nc: async_nats::Client,
    workers: Mutex<WorkerTable>,
    /// `intake.no_worker_grace_ms`: how long a model's workers may all be silent (restarting)
    /// before a waiting request is ended.
    no_worker_grace: Duration,
    /// `gateway.silent_stream_timeout_ms`: how long a stream may go without any sign of life.
    silent_stream_timeout: Duration,
    /// `gateway.api_keys` (none: every request is let in), and whether /health and /metrics
    /// need one too.
    api_keys: Vec<String>,
    keys_for_health_and_metrics: bool,
    metrics: Metrics,
}

/// Largest request body accepted (a long prompt as JSON fits easily).
const MAX_BODY_BYTES: usize = 4 << 20;
/// How long intake may take to answer a submission.
const INTAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A request with no event for this long is checked: if no worker of its model has been heard
/// from for the grace period, it ends with `worker_lost` instead of waiting for a worker that
/// may never come; else its [`Watch`] asks where its job is (and a stream then gets a keep-alive).
const SILENCE: Duration = Duration::from_secs(5);

/// The end of a request whose model has lost every worker while it waited.
fn orphaned(state: &State, model: &str) -> Option<ApiError> {
    let served = state.workers.lock().unwrap().model_heard_within(
        model,
        state.no_worker_grace,
        std::time::Instant::now(),
    );
    (!served).then(|| {
        ApiError::from_wire(&llmq_protocol::WireError::new(
            llmq_protocol::ErrorClass::WorkerLost,
            format!("no live worker serves {model:?} any more"),
        ))
    })
}

/// A request its [`Watch`] ended (events or its job lost on the way): logged, for the client.
fn watch_ended(request_id: &str, e: &llmq_protocol::WireError) -> ApiError {
    tracing::warn!(request_id, reason = %e.message, "request ended by its watch");
    ApiError::from_wire(e)
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// Publishes a cancel for a request whose client went away.
fn cancel(nc: &async_nats::Client, request_id: &str) {
    let (nc, request_id) = (nc.clone(), request_id.to_string());
    actix_web::rt::spawn(async move {
        if let Ok(bytes) = llmq_protocol::encode(&Cancel { request_id }) {
            let _ = nc.publish(subjects::CANCEL, bytes.into()).await;
            let _ = nc.flush().await;
        }
    });
}

/// Cancels its request when dropped before `done`: the handler's future is dropped when the
/// client disconnects mid-request.
struct CancelOnDrop<'a> {
    nc: &'a async_nats::Client,
    request_id: String,
    done: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if !self.done {
            cancel(self.nc, &self.request_id);
        }
    }
}

/// An accepted request: its id, its event subscription, and its trace span (open while the
/// response is being served).
struct Accepted {
    request_id: String,
    /// How the output writes tool calls, for a request with tools.
    tool_syntax: Option<ToolSyntax>,
    events: async_nats::Subscriber,
    /// Makes sure the request ends: lost events, a job that is gone.
    watch: Watch,
    started: Instant,
    _span: tracing::Span,
}

/// Submits to intake, subscribed to the request's inbox first so that no event is missed. The
/// request's span (`gateway.request`) is the child of the HTTP client's trace context, when it
/// sent one (`trace`: its W3C headers), and the parent of intake's and the worker's (its trace
/// context travels in the NATS headers).
async fn submit(
    state: &State,
    mut g: GenerateRequest,
    trace: &[(String, String)],
) -> Result<Accepted, ApiError> {
    let started = Instant::now();
    let span = tracing::info_span!("gateway.request", model = %g.model, request_id = tracing::field::Empty, error = tracing::field::Empty);
    llmq_telemetry::extract_pairs(&span, trace);
    let inbox = state.nc.new_inbox();
    let events = state
        .nc
        .subscribe(inbox.clone())
        .await
        .map_err(|e| ApiError::internal(format!("NATS: {e}")))?;
    g.stream_subject = Some(inbox);
    let payload = llmq_protocol::encode(&g).map_err(|e| ApiError::internal(e.to_string()))?;
    let headers = llmq_telemetry::headers_for(&span);
    let asked = state
        .nc
        .request_with_headers(subjects::GENERATE, headers, payload.into());
    let reply = match tokio::time::timeout(INTAKE_TIMEOUT, asked).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => return Err(ApiError::unavailable(format!("intake did not answer: {e}"))),
        Err(_) => return Err(ApiError::unavailable("intake did not answer in time")),
    };
    match llmq_protocol::decode::<GenerateReply>(&reply.payload) {
        Ok(GenerateReply::Accepted {
            request_id,
            tool_syntax,
            job_seq,
            ..
        }) => {
            span.record("request_id", request_id.as_str());
            let watch = Watch::new(&request_id, job_seq, state.silent_stream_timeout);
            Ok(Accepted {
                request_id,
                tool_syntax,
                events,
                watch,
                started,
                _span: span,
            })
        }
        Ok(GenerateReply::Rejected { error }) => {
            span.record("error", tracing::field::debug(error.class));
            Err(ApiError::from_wire(&error))
        }
        Err(e) => Err(ApiError::internal(format!(
            "undecodable reply from intake: {e}"
        ))),
    }
}

/// Forwards a request's events to the client as server-sent events, until its terminal event or
/// until the client goes away (then cancels it).
async fn stream_events(
    state: Arc<State>,
    shape: Shape,
    mut acc: Accepted,
    tx: mpsc::Sender<Bytes>,
) {
    let mut clock = Clock {
        started: acc.started,
        last: None,
    };
    let mut writer = SseWriter::new(
        &shape,
        shape.kind.response_id(&acc.request_id),
        unix_secs(),
        acc.tool_syntax,
    );
    let outcome: &'static str = 'run: {
        for b in writer.opening() {
            if tx.send(b).await.is_err() {
                break 'run "cancelled";
            }
        }
        loop {
            let msg = tokio::select! {
                _ = tx.closed() => break 'run "cancelled",
                m = acc.events.next() => m,
                _ = tokio::time::sleep(SILENCE) => {
                    let ended = match orphaned(&state, &shape.model) {
                        Some(e) => Err(e),
                        None => acc.watch.silent(&state.nc).await.map_err(|e| watch_ended(&acc.request_id, &e)),
                    };
                    match ended {
                        Ok(Silence::Alive) => {
                            if tx.send(Bytes::from_static(b": alive\n\n")).await.is_err() {
                                break 'run "cancelled";
                            }
                            continue;
                        }
                        Ok(Silence::Unknown) => continue,
                        Err(e) => break 'run end_failed(&tx, e).await,
                    }
                }
            };
            let Some(msg) = msg else {
                break 'run "internal_error";
            };
            let Ok(ev) = llmq_protocol::decode::<StreamEvent>(&msg.payload) else {
                continue;
            };
            if let Err(e) = acc.watch.event(&ev) {
                break 'run end_failed(&tx, watch_ended(&acc.request_id, &e)).await;
            }
            if matches!(ev.event, Event::Tokens { .. }) {
                clock.tokens(&state.metrics);
            }
            let (out, end) = writer.event(ev.choice, ev.event);
            for b in out {
                if tx.send(b).await.is_err() {
                    break 'run end.unwrap_or("cancelled");
                }
            }
            if let Some(o) = end {
                break 'run o;
            }
        }
    };
    // Whatever did not end well (with n > 1 the other choices may still run) is cancelled.
    if outcome != "ok" {
        cancel(&state.nc, &acc.request_id);
    }
    state.metrics.request(shape.kind.endpoint(), outcome);
}

/// Ends a stream on `e` (its error chunk, then `[DONE]`, sent as far as the client is still
/// there); the request's outcome.
async fn end_failed(tx: &mpsc::Sender<Bytes>, e: ApiError) -> &'static str {
    for b in failed(&e) {
        let _ = tx.send(b).await;
    }
    e.code
}

/// Collects a request's events into one OpenAI response body.
async fn collect(state: &State, shape: &Shape, mut acc: Accepted) -> Result<Value, ApiError> {
    let mut guard = CancelOnDrop {
        nc: &state.nc,
        request_id: acc.request_id.clone(),
        done: false,
    };
    let mut clock = Clock {
        started: acc.started,
        last: None,
    };
    let n = shape.n as usize;
    let (mut texts, mut lps) = (vec![String::new(); n], vec![vec![]; n]);
    let mut ended: Vec<Option<FinishReason>> = vec![None; n];
    let mut total = Usage::default();
    let mut parsers = parsers(shape, acc.tool_syntax);
    loop {
        let msg = match tokio::time::timeout(SILENCE, acc.events.next()).await {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(_) => match orphaned(state, &shape.model) {
                Some(e) => return Err(e),
                None => {
                    acc.watch
                        .silent(&state.nc)
                        .await
                        .map_err(|e| watch_ended(&acc.request_id, &e))?;
                    continue;
                }
            },
        };
        let Ok(ev) = llmq_protocol::decode::<StreamEvent>(&msg.payload) else {
            continue;
        };
        acc.watch
            .event(&ev)
            .map_err(|e| watch_ended(&acc.request_id, &e))?;
        let c = (ev.choice as usize).min(n - 1);
        match ev.event {
            Event::Tokens {
                text: t, logprobs, ..
            } => {
                clock.tokens(&state.metrics);
                texts[c].push_str(&t);
                lps[c].extend(logprobs);
            }
            Event::Done {
                finish_reason: reason,
                usage,
                ..
            } => {
                ended[c] = Some(reason);
                total = Usage {
                    prompt: usage.prompt,
                    completion: total.completion + usage.completion,
                    cached: total.cached.max(usage.cached),
                };
                if ended.iter().any(Option::is_none) {
                    continue;
                }
                guard.done = true;
                let id = shape.kind.response_id(&acc.request_id);
                let choices: Vec<Value> = (0..n)
                    .map(|i| {
                        let logprobs = if shape.logprobs.is_some() { response::logprobs(shape.kind, &lps[i]) } else { Value::Null };
                        let mut text = std::mem::take(&mut texts[i]);
                        let mut message = json!({ "role": "assistant", "content": text });
                        let mut called = false;
                        if let Some(p) = parsers[i].as_mut() {
                            let mut parsed = p.push(&text);
                            let rest = p.finish(ended[i] == Some(FinishReason::Length));
                            parsed.content.push_str(&rest.content);
                            parsed.calls.extend(rest.calls);
                            text = parsed.content;
                            called = !parsed.calls.is_empty();
                            message["content"] = if text.is_empty() && called { Value::Null } else { json!(text) };
                            if called {
                                message["tool_calls"] = parsed.calls.iter().map(|c| tool_call(c, false)).collect();
                            }
                        }
                        let reason = finish_reason(ended[i].expect("every choice ended"), called);
                        match shape.kind {
                            Kind::Chat => json!({
                                "index": i, "message": message,
                                "logprobs": logprobs, "finish_reason": reason,
                            }),
                            Kind::Completion => json!({ "index": i, "text": text, "logprobs": logprobs, "finish_reason": reason }),
                        }
                    })
                    .collect();
                return Ok(json!({
                    "id": id, "object": shape.kind.object(false), "created": unix_secs(), "model": shape.model,
                    "choices": choices, "usage": response::usage(&total),
                }));
            }
            Event::Error { error } => {
                // With more choices, the others are cancelled as the guard drops.
                guard.done = n == 1;
                return Err(ApiError::from_wire(&error));
            }
            Event::Queued { .. } | Event::PrefillProgress { .. } => {}
        }
    }
    Err(ApiError::internal(
        "the event stream ended without a terminal event",
    ))
}

/// The W3C trace context headers of an HTTP request.
fn trace_headers(req: &actix_web::HttpRequest) -> Vec<(String, String)> {
    llmq_telemetry::W3C_HEADERS
        .iter()
        .filter_map(|&k| {
            let v = req.headers().get(k)?.to_str().ok()?;
            Some((k.to_string(), v.to_string()))
        })
        .collect()
}

async fn serve(
    state: web::Data<State>,
    g: Result<(GenerateRequest, Shape), ApiError>,
    kind: Kind,
    trace: Vec<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let result: Result<(HttpResponse, Option<&'static str>), ApiError> = async {
        let (g, shape) = g?;
        let acc = submit(&state, g, &trace).await?;
        if shape.stream {
            let (tx, rx) = mpsc::channel::<Bytes>(256);
            actix_web::rt::spawn(stream_events(state.clone().into_inner(), shape, acc, tx));
            let body = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|b| (Ok::<_, actix_web::Error>(b), rx))
            });
            return Ok((
                HttpResponse::Ok()
                    .content_type("text/event-stream")
                    .insert_header(("Cache-Control", "no-cache"))
                    .insert_header(("X-Accel-Buffering", "no"))
                    .streaming(body),
                None,
            ));
        }
        let body = collect(&state, &shape, acc).await?;
        Ok((HttpResponse::Ok().json(body), Some("ok")))
    }
    .await;
    match result {
        Ok((resp, outcome)) => {
            if let Some(o) = outcome {
                state.metrics.request(kind.endpoint(), o);
            }
            Ok(resp)
        }
        Err(e) => {
            state.metrics.request(kind.endpoint(), e.code);
            Err(e)
        }
    }
}

async fn chat(
    state: web::Data<State>,
    req: actix_web::HttpRequest,
    body: web::Json<openai::ChatRequest>,
) -> Result<HttpResponse, ApiError> {
    let trace = trace_headers(&req);
    serve(
        state,
        openai::chat_request(body.into_inner()),
        Kind::Chat,
        trace,
    )
    .await
}

async fn completions(
    state: web::Data<State>,
    req: actix_web::HttpRequest,
    body: web::Json<openai::CompletionRequest>,
) -> Result<HttpResponse, ApiError> {
    serve(
        state,
        openai::completion_request(body.into_inner()),
        Kind::Completion,
        trace_headers(&req),
    )
    .await
}

async fn models(state: web::Data<State>) -> HttpResponse {
    let models = state.workers.lock().unwrap().models();
    let data: Vec<Value> = models
        .iter()
        .map(|m| json!({ "id": m, "object": "model", "created": 0, "owned_by": "llmq" }))
        .collect();
    HttpResponse::Ok().json(json!({ "object": "list", "data": data }))
}

async fn health(state: web::Data<State>) -> HttpResponse {
    let models = state.workers.lock().unwrap().models();
    if models.is_empty() {
        HttpResponse::ServiceUnavailable().json(json!({ "status": "no_worker", "models": models }))
    } else {
        HttpResponse::Ok().json(json!({ "status": "ok", "models": models }))
    }
}

async fn metrics_text(state: web::Data<State>) -> HttpResponse {
    let text = state.metrics.render(&state.workers.lock().unwrap());
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(text)
}

/// With API keys set, a request to /v1 (and to /health and /metrics, if so configured) without
/// `Authorization: Bearer <key>` for one of them gets 401 in OpenAI's error format.
async fn require_key(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    if let Some(state) = req.app_data::<web::Data<State>>() {
        let guarded = req.path().starts_with("/v1/") || state.keys_for_health_and_metrics;
        if guarded && !state.api_keys.is_empty() {
            let given = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|k| {
                state
                    .api_keys
                    .iter()
                    .any(|key| same(key.as_bytes(), k.trim().as_bytes()))
            }) {
                return Err(ApiError::unauthorized().into());
            }
        }
    }
    next.call(req).await
}

/// Compares in a time that does not depend on where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Malformed or oversized JSON bodies get OpenAI error bodies too.
fn json_error(
    e: actix_web::error::JsonPayloadError,
    _: &actix_web::HttpRequest,
) -> actix_web::Error {
    use actix_web::error::JsonPayloadError as J;
    let err = match &e {
        J::Overflow { .. } | J::OverflowKnownLength { .. } => ApiError {
            status: actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body over {MAX_BODY_BYTES} bytes"),
            code: "body_too_large",
        },
        _ => ApiError::invalid(format!("invalid JSON body: {e}")),
    };
    err.into()
}

/// Serves until the process stops. Must be called inside an actix-web (actix-rt) System.
pub async fn run(settings: Settings) -> Result<(), GatewayError> {
    let nc = llmq_protocol::connect(
        &settings.nats.url,
        settings.nats.ca_file.as_deref(),
        "llmq-gateway",
    )
    .await
    .map_err(nats)?;
    let mut beats = nc
        .subscribe(subjects::WORKER_STATUS_ALL)
        .await
        .map_err(nats)?;
    let state = web::Data::new(State {
        nc,
        workers: Mutex::new(WorkerTable::new(Duration::from_millis(
            settings.gateway.worker_timeout_ms,
        ))),
        no_worker_grace: Duration::from_millis(settings.intake.no_worker_grace_ms),
        silent_stream_timeout: Duration::from_millis(settings.gateway.silent_stream_timeout_ms),
        // An empty key (an unset variable in a list) lets nobody in by itself.
        api_keys: settings
            .gateway
            .api_keys
            .iter()
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect(),
        keys_for_health_and_metrics: settings.gateway.keys_for_health_and_metrics,
        metrics: Metrics::default(),
    });
    let beat_state = state.clone();
    actix_web::rt::spawn(async move {
        while let Some(m) = beats.next().await {
            if let Ok(s) = llmq_protocol::decode::<WorkerStatus>(&m.payload) {
                beat_state.workers.lock().unwrap().update(s);
            }
        }
    });
    let server = HttpServer::new(move || {
        App::new()
            .wrap(actix_web::middleware::from_fn(require_key))
            .app_data(state.clone())
            .app_data(
                web::JsonConfig::default()
                    .limit(MAX_BODY_BYTES)
                    .error_handler(json_error),
            )
            .route("/v1/chat/completions", web::post().to(chat))
            .route("/v1/completions", web::post().to(completions))
            .route("/v1/models", web::get().to(models))
            .route("/health", web::get().to(health))
            .route("/metrics", web::get().to(metrics_text))
    })
    .bind(&settings.gateway.listen)?;
    let bound = server
        .addrs()
        .first()
        .map(ToString::to_string)
        .unwrap_or_else(|| settings.gateway.listen.clone());
    if let Some(path) = &settings.gateway.address_file {
        // Whole or not at all: written aside, then renamed.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &bound)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|source| GatewayError::AddressFile {
                path: path.clone(),
                source,
            })?;
    }
    tracing::info!(listen = %bound, "gateway ready");
    server.run().await?;
    Ok(())
}
