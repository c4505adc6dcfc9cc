//! docker-compose.yml on a real Docker daemon (`make compose-test`): the stack as users start
//! it, driven from the host through the gateway and through NATS, and the faults a deployment
//! meets. Needs the image (`make image`); fails, never skips, without a daemon.

mod common;

use std::time::{Duration, Instant};

use common::client::Client;
use common::compose::{docker, metric, Compose};
use futures::future::join_all;
use llmq_gateway::client;
use llmq_protocol::{ErrorClass, Event, FinishReason, GenerateRequest};

fn request(prompt: &str, max_tokens: i64) -> GenerateRequest {
    GenerateRequest { model: "smollm2".into(), prompt: Some(prompt.into()), max_tokens: Some(max_tokens), ..Default::default() }
}

/// One chat completion through the gateway: its status and the answer's text.
async fn chat(addr: &str, i: usize) -> (u16, String) {
    let body = serde_json::json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": format!("Count from {i} to {}.", i + 5)}],
        "max_tokens": 12,
    });
    let r = client::request(addr, "POST", "/v1/chat/completions", Some(&body.to_string())).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
    (r.status, v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string())
}

#[test]
fn three_workers_share_requests_from_the_gateway_and_from_nats() {
    let stack = Compose::up("scale", 3);
    common::client::rt().block_on(async {
        let addr = stack.wait_workers(3).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let http = join_all((0..48).map(|i| chat(&addr, i)));
        let direct = join_all((0..16).map(|i| nats.run(request(&format!("Story number {i}:"), 12))));
        let (http, direct) = futures::join!(http, direct);
        for (status, text) in &http {
            assert_eq!(*status, 200, "{text}");
            assert!(!text.is_empty());
        }
        for run in &direct {
            assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
            assert!(!run.tokens().is_empty());
        }
        // Every worker ended some of the 64 requests (heartbeats report them within a second).
        let t = Instant::now();
        loop {
            let page = client::request(&addr, "GET", "/metrics", None).await.unwrap().body;
            let ended = metric(&page, "llmq_worker_requests_ended_total");
            let total: f64 = ended.iter().map(|(_, n)| n).sum();
            if total >= 64.0 {
                assert_eq!(ended.len(), 3, "{page}");
                assert!(ended.iter().all(|(_, n)| *n > 0.0), "a worker took no request: {ended:?}");
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "/metrics counts {total} ended requests of 64: {ended:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}

#[test]
fn a_killed_worker_ends_its_streams_with_worker_lost_and_the_survivor_takes_new_ones() {
    let stack = Compose::up("kill", 2);
    common::client::rt().block_on(async {
        stack.wait_workers(2).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let long = |i: usize| GenerateRequest { ignore_eos: true, ..request(&format!("Essay {i}:"), 400) };
        let mut started = vec![];
        for i in 0..6 {
            started.push(nats.start(long(i)).await);
        }
        // Both workers are streaming (one job per fetch, handed out in turn) once every stream
        // has sent tokens.
        let mut runs = vec![];
        let mut first = vec![];
        for (id, mut sub) in started {
            first.push(Client::first_tokens(&mut sub).await);
            runs.push((id, sub));
        }
        let victim = stack.containers("worker")[0].clone();
        docker(&["kill", &victim]);
        let killed = Instant::now();
        let ends = join_all(runs.into_iter().map(|(id, sub)| async move {
            let run = Client::finish(id, sub, |_| {}).await;
            (Instant::now(), run)
        }))
        .await;
        let mut lost = 0;
        for ((at, run), first) in ends.iter().zip(&first) {
            match run.last() {
                Event::Error { error } => {
                    assert_eq!(error.class, ErrorClass::WorkerLost, "{error:?}");
                    assert!(*at - killed < Duration::from_secs(10), "worker_lost after {:?}", *at - killed);
                    lost += 1;
                }
                Event::Done { finish_reason, .. } => {
                    assert_eq!(*finish_reason, FinishReason::Length);
                    assert_eq!(first.len() + run.tokens().len(), 400, "a surviving stream lost tokens");
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(lost > 0 && lost < 6, "{lost} of 6 streams lost: both workers should have held some");
        // New requests go to the survivor.
        for run in join_all((0..4).map(|i| nats.run(request(&format!("After {i}:"), 8)))).await {
            assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
        }
    });
}
