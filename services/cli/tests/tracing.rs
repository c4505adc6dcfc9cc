//! Distributed tracing end to end: gateway, intake and worker processes export their spans over
//! OTLP/HTTP (protobuf, the exporters' default) to a receiver played by this test, which decodes
//! them with OpenTelemetry's own message types (`opentelemetry-proto`). One HTTP request sent
//! with a client's `traceparent` must give one trace: the client's span as parent of
//! `gateway.request` -> `intake.accept` -> `worker.request`, parent to child across NATS, with
//! the attributes docs/configuration.md lists and the request's outcome on the worker's span.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use llmq_gateway::client;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message;
use serde_json::Value;

/// An OTLP/HTTP receiver: accepts POSTs (keep-alive) and keeps each body's spans, decoded from
/// protobuf.
fn collector() -> (String, Arc<Mutex<Vec<ExportTraceServiceRequest>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let bodies: Arc<Mutex<Vec<ExportTraceServiceRequest>>> = Arc::default();
    let keep = bodies.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let keep = keep.clone();
            std::thread::spawn(move || {
                let mut w = conn.try_clone().unwrap();
                let mut r = BufReader::new(conn);
                loop {
                    let mut len = 0usize;
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        line.clear();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                len = v.trim().parse().unwrap_or(0);
                            }
                        }
                    }
                    let mut body = vec![0; len];
                    if r.read_exact(&mut body).is_err() {
                        return;
                    }
                    match ExportTraceServiceRequest::decode(body.as_slice()) {
                        Ok(r) => keep.lock().unwrap().push(r),
                        Err(e) => panic!("an OTLP payload that is not protobuf: {e}"),
                    }
                    // An empty ExportTraceServiceResponse.
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if w.write_all(ok.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, bodies)
}

/// A received span: its service, ids (hex) and attributes.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
    attrs: HashMap<String, Any>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn spans(bodies: &[ExportTraceServiceRequest]) -> Vec<Span> {
    let mut out = vec![];
    for rs in bodies.iter().flat_map(|b| &b.resource_spans) {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                Any::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for sp in rs.scope_spans.iter().flat_map(|ss| &ss.spans) {
            out.push(Span {
                service: service.clone(),
                name: sp.name.clone(),
                trace: hex(&sp.trace_id),
                id: hex(&sp.span_id),
                parent: hex(&sp.parent_span_id),
                attrs: sp
                    .attributes
                    .iter()
                    .filter_map(|a| Some((a.key.clone(), a.value.as_ref()?.value.clone()?)))
                    .collect(),
            });
        }
    }
    out
}

#[test]
fn one_request_is_one_trace_from_gateway_to_worker() {
    let (url, bodies) = collector();
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", url.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        (
            "LLMQ_LOG",
            "warn,llmq_worker=info,llmq_intake=info,llmq_gateway=info",
        ),
    ];
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &otel);
    stack.spawn("worker", &otel);
    let (_, addr) = stack.spawn_gateway(&otel);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = serde_json::json!({"model": fixture(), "prompt": "Hello there", "max_tokens": 5, "ignore_eos": true});
    let (status, answer) = rt.block_on(async {
        let t = Instant::now();
        loop {
            if let Ok(r) = client::request(&addr, "GET", "/health", None).await {
                if r.status == 200 {
                    break;
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the gateway never saw a worker"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let r = client::request_with(
            &addr,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            &[("traceparent", CLIENT_TRACEPARENT)],
        )
        .await
        .unwrap();
        (r.status, r.body)
    });
    assert_eq!(status, 200, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    let request_id = answer["id"]
        .as_str()
        .unwrap()
        .trim_start_matches("cmpl-")
        .to_string();

    // The three spans arrive within a few export intervals.
    let t = Instant::now();
    let (gateway, intake, worker) = loop {
        let all = spans(&bodies.lock().unwrap());
        let find = |name: &str| all.iter().find(|s| s.name == name).cloned();
        if let (Some(g), Some(i), Some(w)) = (
            find("gateway.request"),
            find("intake.accept"),
            find("worker.request"),
        ) {
            break (g, i, w);
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "spans received: {all:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        (
            gateway.service.as_str(),
            intake.service.as_str(),
            worker.service.as_str()
        ),
        ("llmq-gateway", "llmq-intake", "llmq-worker")
    );
    // The client's span is the parent of the gateway's, in the client's trace.
    assert_eq!(
        (gateway.trace.as_str(), gateway.parent.as_str()),
        (CLIENT_TRACE, CLIENT_SPAN),
        "the gateway under the client: {gateway:?}"
    );
    assert_eq!(
        (intake.trace.as_str(), intake.parent.as_str()),
        (gateway.trace.as_str(), gateway.id.as_str()),
        "intake under the gateway"
    );
    assert_eq!(
        (worker.trace.as_str(), worker.parent.as_str()),
        (gateway.trace.as_str(), intake.id.as_str()),
        "worker under intake"
    );
    let attr = |s: &Span, k: &str| s.attrs.get(k).cloned();
    let text = |v: Option<Any>| match v {
        Some(Any::StringValue(s)) => s,
        other => format!("{other:?}"),
    };
    let int = |v: Option<Any>| match v {
        Some(Any::IntValue(i)) => i,
        other => panic!("not an integer: {other:?}"),
    };
    for s in [&gateway, &intake, &worker] {
        assert_eq!(text(attr(s, "request_id")), request_id, "{s:?}");
    }
    assert_eq!(text(attr(&gateway, "model")), fixture(), "{gateway:?}");
    assert_eq!(int(attr(&worker, "completion_tokens")), 5, "{worker:?}");
    assert_eq!(
        int(attr(&worker, "prompt_tokens")),
        int(attr(&intake, "prompt_tokens"))
    );
    assert!(int(attr(&intake, "prompt_tokens")) > 0, "{intake:?}");
    assert_eq!(text(attr(&worker, "finish_reason")), "Length");
    assert!(attr(&worker, "error").is_none(), "{worker:?}");
    assert_eq!(int(attr(&worker, "cached_tokens")), 0, "{worker:?}");
    for timing in ["queue_ms", "ttft_ms"] {
        assert!(
            matches!(attr(&worker, timing), Some(Any::DoubleValue(ms)) if ms >= 0.0),
            "{timing}: {worker:?}"
        );
    }
}

/// The client's own trace and span, as it sends them in `traceparent`.
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const CLIENT_TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
