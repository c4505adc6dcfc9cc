//! Logging and tracing set-up shared by every llmq binary.
//!
//! - Logs: every binary reads the same variable (`LLMQ_LOG`, an [`EnvFilter`] directive such as
//!   `info` or `llmq_engine=debug`) and logs to stderr, leaving stdout to the program's output.
//! - Traces: when the standard OpenTelemetry variable `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, the same `tracing` spans are also exported
//!   over OTLP/HTTP (`OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf`, the default, or
//!   `http/json`), batched off the serving path (`OTEL_BSP_*` tune the batching), with
//!   `service.name` = the service (`OTEL_SERVICE_NAME` wins).
//! - Propagation: a request's trace context crosses NATS in W3C `traceparent`/`tracestate`
//!   message headers ([`headers_for`], [`extract`]): gateway -> intake on `llm.v1.generate`, intake ->
//!   worker on the jobs stream, so one trace shows a request from HTTP to its last token. A NATS
//!   client may send its own `traceparent` to make llmq's spans children of its trace.
//!
//! Invariant: without the OTLP variables nothing is exported and nothing is sent, and the
//! header helpers write nothing.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Keeps the trace exporter alive; dropping it flushes the spans not yet sent.
#[must_use = "traces are flushed when the guard drops"]
pub struct Guard(Option<SdkTracerProvider>);

impl Guard {
    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        self.0.is_some()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = p.shutdown();
        }
    }
}

fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

fn provider(service: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| e.to_string())?;
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_string());
    Ok(SdkTracerProvider::builder()
        .with_resource(Resource::builder().with_service_name(name).build())
        .with_batch_exporter(exporter)
        .build())
}

/// Installs the global subscriber; `default` applies when `LLMQ_LOG` is unset or invalid, and
/// `service` names this process in exported traces. Calling it twice is harmless (the second
/// call installs nothing and exports nothing).
pub fn init(default: &str, service: &str) -> Guard {
    let filter = EnvFilter::try_from_env("LLMQ_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let (provider, failed) = match otlp_configured().then(|| provider(service)) {
        Some(Ok(p)) => (Some(p), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("llmq")));
    if tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()
        .is_err()
    {
        return Guard(None);
    }
    if let Some(e) = failed {
        tracing::warn!(error = %e, "OTLP trace export not started");
    }
    Guard(provider)
}

struct HeaderWriter<'a>(&'a mut async_nats::HeaderMap);

impl Injector for HeaderWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct HeaderReader<'a>(&'a async_nats::HeaderMap);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// Writes `span`'s trace context into NATS headers (nothing when it is not being exported).
fn inject(span: &tracing::Span, headers: &mut async_nats::HeaderMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderWriter(headers));
}

/// Makes `span` a child of the trace context carried by `headers`, if any.
pub fn extract(span: &tracing::Span, headers: Option<&async_nats::HeaderMap>) {
    if let Some(h) = headers {
        let cx = TraceContextPropagator::new().extract(&HeaderReader(h));
        let _ = span.set_parent(cx);
    }
}

struct PairsReader<'a>(&'a [(String, String)]);

impl Extractor for PairsReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_str()).collect()
    }
}

/// The W3C trace context headers (`traceparent`, `tracestate`) an HTTP client may send.
pub const W3C_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// Makes `span` a child of the trace context in `headers` (name, value) as an HTTP client sends
/// them ([`W3C_HEADERS`]), if any.
pub fn extract_pairs(span: &tracing::Span, headers: &[(String, String)]) {
    if !headers.is_empty() {
        let cx = TraceContextPropagator::new().extract(&PairsReader(headers));
        let _ = span.set_parent(cx);
    }
}

/// NATS headers carrying `span`'s trace context.
pub fn headers_for(span: &tracing::Span) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    inject(span, &mut h);
    h
}
