//! The HTTP gateway end to end: a real nats-server, intake, worker and gateway processes; the
//! official `openai` Python package (set-up installs it in .cache/pyclient) as the client, and
//! raw HTTP for the error statuses and health.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::client::Client;
use common::*;
use futures::StreamExt;
use llmq_gateway::client;
use llmq_protocol::{subjects, Cancel};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The gateway, with workers counted gone after a second of silence; its address.
fn spawn_gateway(stack: &mut Stack) -> String {
    stack
        .spawn_gateway(&[("LLMQ__GATEWAY__WORKER_TIMEOUT_MS", "1000")])
        .1
}

/// Polls `GET /health` until it answers `want` (the gateway is up, and has or lacks workers).
async fn wait_health(addr: &str, want: u16) {
    let t = Instant::now();
    loop {
        if let Ok(r) = client::request(addr, "GET", "/health", None).await {
            if r.status == want {
                return;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "/health never answered {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn post(addr: &str, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = client::request(addr, "POST", path, Some(&body.to_string()))
        .await
        .unwrap();
    (
        r.status,
        serde_json::from_str(&r.body).unwrap_or(serde_json::Value::String(r.body)),
    )
}

/// nats-server, intake, one worker and the gateway, for SmolLM2; the gateway's address.
fn smollm2_stack() -> (Stack, String) {
    let mut stack = Stack::nats_for("smollm2");
    stack.spawn("intake", &[]);
    stack.spawn("worker", &[]);
    let addr = spawn_gateway(&mut stack);
    (stack, addr)
}

/// Runs tests/gateway/`script` with the Python of set-up's venv `.cache/<venv>` against the
/// gateway at `addr` (model smollm2); its standard output, or a failure with both outputs.
async fn run_script(venv: &str, script: &str, addr: &str) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = root.join(".cache").join(venv).join("bin/python");
    assert!(
        python.exists(),
        "{} missing: run `make setup`",
        python.display()
    );
    let out = tokio::process::Command::new(&python)
        .arg(root.join("tests/gateway").join(script))
        .arg(format!("http://{addr}"))
        .arg("smollm2")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_openai_package_works_unchanged_and_an_early_close_cancels() {
    let (stack, addr) = smollm2_stack();
    rt().block_on(async {
        wait_health(&addr, 200).await;
        let nc = async_nats::connect(&stack.url).await.unwrap();
        let mut cancels = nc.subscribe(subjects::CANCEL).await.unwrap();
        nc.flush().await.unwrap();
        let stdout = run_script("pyclient", "openai_client.py", &addr).await;
        let closed = stdout
            .lines()
            .find_map(|l| l.strip_prefix("CLOSED_EARLY="))
            .expect("the script names the stream it closed")
            .to_string();
        // The gateway notices the closed connection at the stream's next event and cancels.
        let m = tokio::time::timeout(Duration::from_secs(5), cancels.next())
            .await
            .expect("a cancel within 5 s")
            .unwrap();
        let c: Cancel = llmq_protocol::decode(&m.payload).unwrap();
        assert_eq!(c.request_id, closed);
        let metrics = client::request(&addr, "GET", "/metrics", None)
            .await
            .unwrap()
            .body;
        for want in [
            "llmq_gateway_requests_total{endpoint=\"chat\",outcome=\"ok\"} 16",
            "llmq_gateway_requests_total{endpoint=\"chat\",outcome=\"cancelled\"} 1",
            "llmq_gateway_requests_total{endpoint=\"chat\",outcome=\"model_not_found\"} 1",
            "llmq_gateway_requests_total{endpoint=\"completions\",outcome=\"ok\"} 1",
            "llmq_worker_prefix_cache_hit_rate{",
        ] {
            assert!(metrics.contains(want), "{want} missing from\n{metrics}");
        }
    });
}

/// Agent frameworks from PyPI (instructor, langchain-openai; set-up installs them in
/// .cache/pyagents) get valid pydantic models from SmolLM2 in each of their structured modes,
/// and the tool choices end as OpenAI's do (tests/gateway/agent_frameworks.py says what).
#[test]
fn agent_frameworks_get_valid_models_and_tool_calls() {
    let (_stack, addr) = smollm2_stack();
    rt().block_on(async {
        wait_health(&addr, 200).await;
        let stdout = run_script("pyagents", "agent_frameworks.py", &addr).await;
        assert!(stdout.contains("AGENT FRAMEWORKS OK"), "{stdout}");
        eprintln!("{stdout}");
    });
}

#[test]
fn typed_errors_health_and_worker_loss() {
    // SmolLM2, not the tiny fixture: its streams must still be decoding when the worker is
    // killed (the fixture decodes 400 tokens in well under a second, inside the heartbeats'
    // delay), and SmolLM2 takes about 50 ms a token on a CPU.
    let model = "smollm2";
    let mut stack = Stack::nats_for(model);
    stack.spawn("intake", &[("LLMQ__INTAKE__MAX_QUEUED_REQUESTS", "1")]);
    let addr = spawn_gateway(&mut stack);
    let completion = |extra: serde_json::Value| {
        let mut v = serde_json::json!({ "model": model, "prompt": "Hello", "max_tokens": 4 });
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    };
    rt().block_on(async {
        // No worker yet: not healthy, and a request is refused at once rather than queued
        // (once intake answers: a malformed request's reply says it does).
        wait_health(&addr, 503).await;
        Client::connect(&stack.url).await.submit_raw(vec![0xc1]).await;
        let (status, body) = post(&addr, "/v1/completions", completion(serde_json::json!({}))).await;
        assert_eq!((status, body["error"]["code"].as_str()), (503, Some("no_worker")), "{body}");
        let (status, body) = post(&addr, "/v1/completions", completion(serde_json::json!({"model": "nope"}))).await;
        assert_eq!((status, body["error"]["code"].as_str()), (404, Some("model_not_found")), "{body}");

        let worker = stack.spawn("worker", &[("LLMQ__SCHEDULER__MAX_BATCH", "1")]);
        wait_health(&addr, 200).await;
        let models = client::request(&addr, "GET", "/v1/models", None).await.unwrap();
        assert!(models.body.contains(&format!("\"id\":{}", serde_json::json!(model))), "{}", models.body);
        for (extra, status, code) in [
            (serde_json::json!({"temperature": -1}), 400, "invalid_request"),
            (serde_json::json!({"n": 17}), 400, "invalid_request"),
            (serde_json::json!({"max_tokens": 1_000_000}), 413, "context_length_exceeded"),
        ] {
            let (s, body) = post(&addr, "/v1/completions", completion(extra.clone())).await;
            assert_eq!((s, body["error"]["code"].as_str()), (status, Some(code)), "{extra}: {body}");
        }
        let bad = client::request(&addr, "POST", "/v1/completions", Some("{\"model\":")).await.unwrap();
        assert_eq!(bad.status, 400, "{}", bad.body);
        assert!(bad.body.contains("invalid_request_error"), "{}", bad.body);
        let (s, body) = post(&addr, "/v1/completions", serde_json::json!({"model": model, "prompt": "Paris is", "max_tokens": 3})).await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");

        // Queue full: one request decodes (max_batch 1), one waits; the intake limit is 1.
        let mut held = vec![];
        for i in 0..2 {
            let (a, body) = (addr.clone(), serde_json::json!({"model": model, "prompt": format!("Story {i}"), "max_tokens": 400, "stream": true}));
            held.push(tokio::spawn(async move {
                let mut lines = vec![];
                client::stream(&a, "/v1/completions", &body.to_string(), |_, l| lines.push(l.to_string())).await.map(|_| lines)
            }));
        }
        let t = Instant::now();
        loop {
            let metrics = client::request(&addr, "GET", "/metrics", None).await.unwrap().body;
            if metrics.lines().any(|l| l.starts_with("llmq_worker_queued_requests{") && !l.ends_with(" 0")) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "the second request never showed as queued");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (s, body) = post(&addr, "/v1/completions", serde_json::json!({"model": model, "prompt": "x", "max_tokens": 2})).await;
        assert_eq!((s, body["error"]["code"].as_str()), (429, Some("queue_full")), "{body}");

        // The worker dies: within a few heartbeats the gateway reports no worker and refuses
        // new requests with 503; the streams that were running or queued on it end with a
        // worker_lost error and [DONE] rather than hang.
        stack.kill(worker);
        wait_health(&addr, 503).await;
        let (s, body) = post(&addr, "/v1/completions", serde_json::json!({"model": model, "prompt": "x", "max_tokens": 2})).await;
        assert_eq!((s, body["error"]["code"].as_str()), (503, Some("no_worker")), "{body}");
        for h in held {
            let lines = tokio::time::timeout(Duration::from_secs(30), h).await.expect("the stream ends").unwrap().unwrap();
            let n = lines.len();
            assert_eq!(lines.last().map(String::as_str), Some("data: [DONE]"), "{lines:?}");
            assert!(lines[n - 2].contains("\"worker_lost\""), "{:?}", &lines[n.saturating_sub(3)..]);
        }
    });
}

#[test]
fn with_api_keys_set_only_a_valid_bearer_key_gets_in() {
    let mut stack = Stack::nats_only();
    let open = stack
        .spawn_gateway(&[("LLMQ__GATEWAY__API_KEYS", "key-one,key-two")])
        .1;
    let closed = stack
        .spawn_gateway(&[
            ("LLMQ__GATEWAY__API_KEYS", "key-one"),
            ("LLMQ__GATEWAY__KEYS_FOR_HEALTH_AND_METRICS", "true"),
        ])
        .1;
    rt().block_on(async {
        let get = |addr: &str, path: &str, key: Option<&str>| {
            let (addr, path) = (addr.to_string(), path.to_string());
            let auth = key.map(|k| format!("Bearer {k}"));
            async move {
                let headers: Vec<(&str, &str)> =
                    auth.iter().map(|a| ("Authorization", a.as_str())).collect();
                client::request_with(&addr, "GET", &path, None, &headers)
                    .await
                    .unwrap()
            }
        };
        for key in [None, Some("wrong"), Some("key-one-")] {
            let r = get(&open, "/v1/models", key).await;
            assert_eq!(r.status, 401, "{key:?}: {}", r.body);
            let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(body["error"]["code"], "invalid_api_key");
            assert_eq!(body["error"]["type"], "invalid_request_error");
        }
        // A POST without a key is refused before its body is read.
        let r = client::request(&open, "POST", "/v1/chat/completions", Some("{}"))
            .await
            .unwrap();
        assert_eq!(r.status, 401, "{}", r.body);
        for key in ["key-one", "key-two"] {
            assert_eq!(get(&open, "/v1/models", Some(key)).await.status, 200);
        }
        // /health and /metrics stay open unless configured otherwise.
        assert_eq!(
            get(&open, "/health", None).await.status,
            503,
            "no worker: 503, not 401"
        );
        assert_eq!(get(&open, "/metrics", None).await.status, 200);
        assert_eq!(get(&closed, "/health", None).await.status, 401);
        assert_eq!(get(&closed, "/metrics", None).await.status, 401);
        assert_eq!(get(&closed, "/metrics", Some("key-one")).await.status, 200);
    });
}

/// A job that disappears without its terminal event (its record lost, as a NATS restart or a
/// missed `Done` leaves it) does not leave its stream hanging, for the gateway's clients and for
/// `llmq generate --nats` alike: while the job waits in the jobs stream the gateway keeps the
/// stream alive (`: alive`), and once intake no longer finds it the stream ends with
/// `worker_lost` and `[DONE]` within the silence check's period (5 s) and the query's.
#[test]
fn a_job_lost_without_its_terminal_event_ends_its_stream() {
    let mut stack = Stack::nats_for("smollm2");
    let grace = [("LLMQ__INTAKE__NO_WORKER_GRACE_MS", "600000")];
    stack.spawn("intake", &grace);
    let addr = stack
        .spawn_gateway(&[grace[0], ("LLMQ__GATEWAY__WORKER_TIMEOUT_MS", "1000")])
        .1;
    rt().block_on(async {
        let nc = async_nats::connect(&stack.url).await.unwrap();
        // A worker of the model, as intake and the gateway see it: heartbeats, and no job taken.
        let beat = nc.clone();
        let beats = tokio::spawn(async move {
            let status = llmq_protocol::WorkerStatus { worker_id: "absent".into(), model: "smollm2".into(), ..Default::default() };
            loop {
                let _ = beat.publish(subjects::worker_status("absent"), llmq_protocol::encode(&status).unwrap().into()).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        wait_health(&addr, 200).await;
        let jobs = subjects::jobs_stream(&async_nats::jetstream::new(nc.clone())).await.unwrap();
        // Once the stream has shown the job alive, the job's record goes.
        let (alive_tx, mut alive_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let purged_at = tokio::spawn(async move {
            alive_rx.recv().await;
            jobs.purge().await.unwrap();
            Instant::now()
        });
        let body = serde_json::json!({"model": "smollm2", "stream": true, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]});
        let mut lines: Vec<(Instant, String)> = vec![];
        // Refused (503) until intake is up and has heard the worker.
        let t = Instant::now();
        loop {
            lines.clear();
            let status = tokio::time::timeout(
                Duration::from_secs(60),
                client::stream(&addr, "/v1/chat/completions", &body.to_string(), |at, l| {
                    if l == ": alive" {
                        let _ = alive_tx.send(());
                    }
                    lines.push((at, l.to_string()));
                }),
            )
            .await
            .expect("the stream ended within 60 s")
            .unwrap();
            if status == 200 {
                break;
            }
            assert!(status == 503 && t.elapsed() < Duration::from_secs(60), "{status}: {lines:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let purged_at = purged_at.await.unwrap();
        let texts: Vec<&str> = lines.iter().map(|(_, l)| l.as_str()).collect();
        assert!(texts.contains(&": alive"), "{texts:?}");
        let errors: Vec<&(Instant, String)> = lines.iter().filter(|(_, l)| l.contains("\"error\"")).collect();
        assert_eq!(errors.len(), 1, "{texts:?}");
        assert!(errors[0].1.contains("worker_lost"), "{}", errors[0].1);
        assert!(errors[0].0.duration_since(purged_at) < Duration::from_secs(9), "ended {:?} after the job went", errors[0].0.duration_since(purged_at));
        assert_eq!(texts.last(), Some(&"data: [DONE]"), "{texts:?}");
        assert_eq!(texts.iter().filter(|l| **l == "data: [DONE]").count(), 1);

        // llmq's NATS client: the same job lost, the same end.
        let mut generate = tokio::process::Command::new(env!("CARGO_BIN_EXE_llmq"))
            .args(["generate", "--nats", &stack.url, "--model", "smollm2", "--prompt", "Hi", "--max-tokens", "8"])
            .env("LLMQ_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(7)).await;
        let jobs = subjects::jobs_stream(&async_nats::jetstream::new(nc.clone())).await.unwrap();
        jobs.purge().await.unwrap();
        let purged = Instant::now();
        let status = tokio::time::timeout(Duration::from_secs(20), generate.wait()).await.expect("llmq generate ended").unwrap();
        let mut err = String::new();
        tokio::io::AsyncReadExt::read_to_string(generate.stderr.as_mut().unwrap(), &mut err).await.unwrap();
        assert!(!status.success() && err.contains("WorkerLost"), "{status}: {err}");
        assert!(purged.elapsed() < Duration::from_secs(12), "{:?}", purged.elapsed());
        beats.abort();
    });
}
