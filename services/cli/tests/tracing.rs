//! Distributed tracing end to end: gateway, intake and worker processes export their spans over
//! OTLP/HTTP (JSON) to a collector played by this test, and one HTTP request must give one trace:
//! `gateway.request` -> `intake.accept` -> `worker.request`, parent to child across NATS, with
//! the request's outcome on the worker's span.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use llmq_gateway::client;
use serde_json::Value;

/// A minimal OTLP/HTTP collector: accepts POSTs (keep-alive), keeps each JSON body.
fn collector() -> (String, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
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
                    if let Ok(v) = serde_json::from_slice(&body) {
                        keep.lock().unwrap().push(v);
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    if w.write_all(ok.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, bodies)
}

/// A received span: its service and its OTLP JSON fields.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
    attrs: HashMap<String, Value>,
}

fn spans(bodies: &[Value]) -> Vec<Span> {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let mut out = vec![];
    for b in bodies {
        for rs in b["resourceSpans"].as_array().into_iter().flatten() {
            let service = rs["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["key"] == "service.name")
                .map(|a| s(&a["value"]["stringValue"]))
                .unwrap_or_default();
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                for sp in ss["spans"].as_array().into_iter().flatten() {
                    let attrs = sp["attributes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|a| (s(&a["key"]), a["value"].clone()))
                        .collect();
                    out.push(Span {
                        service: service.clone(),
                        name: s(&sp["name"]),
                        trace: s(&sp["traceId"]),
                        id: s(&sp["spanId"]),
                        parent: s(&sp["parentSpanId"]),
                        attrs,
                    });
                }
            }
        }
    }
    out
}

#[test]
fn one_request_is_one_trace_from_gateway_to_worker() {
    let (url, bodies) = collector();
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", url.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
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
        let r = client::request(&addr, "POST", "/v1/completions", Some(&body.to_string()))
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
    assert_eq!(gateway.trace.len(), 32, "{gateway:?}");
    assert!(
        gateway.parent.is_empty(),
        "the gateway's span is the root: {gateway:?}"
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
    let attr = |s: &Span, k: &str| s.attrs.get(k).cloned().unwrap_or(Value::Null);
    let text = |v: Value| {
        v["stringValue"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_default()
    };
    for s in [&gateway, &intake, &worker] {
        assert_eq!(text(attr(s, "request_id")), request_id, "{s:?}");
    }
    assert_eq!(
        attr(&worker, "completion_tokens")["intValue"],
        Value::from("5"),
        "{worker:?}"
    );
    assert_eq!(
        attr(&worker, "prompt_tokens"),
        attr(&intake, "prompt_tokens")
    );
    assert_eq!(text(attr(&worker, "finish_reason")), "Length");
    assert!(attr(&worker, "error").is_null(), "{worker:?}");
}
