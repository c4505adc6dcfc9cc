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
    GenerateRequest {
        model: "smollm2".into(),
        prompt: Some(prompt.into()),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// One chat completion through the gateway: its status and the answer's text.
async fn chat(addr: &str, i: usize) -> (u16, String) {
    let body = serde_json::json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": format!("Count from {i} to {}.", i + 5)}],
        "max_tokens": 12,
    });
    let r = client::request(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    )
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
    (
        r.status,
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

#[test]
fn three_workers_share_requests_from_the_gateway_and_from_nats() {
    // A worker holds at most 16 requests while a peer has room: 64 at once reach all three
    // (with 64, the first to pull could take them all, as placement allows).
    let stack = Compose::up_full("scale", 3, &[], &[("LLMQ_WORKER_MAX_BATCH", "16")]);
    common::client::rt().block_on(async {
        let addr = stack.wait_workers(3).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let http = join_all((0..48).map(|i| chat(&addr, i)));
        let direct =
            join_all((0..16).map(|i| nats.run(request(&format!("Story number {i}:"), 12))));
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
            let page = client::request(&addr, "GET", "/metrics", None)
                .await
                .unwrap()
                .body;
            let ended = metric(&page, "llmq_worker_requests_ended_total");
            let total: f64 = ended.iter().map(|(_, n)| n).sum();
            if total >= 64.0 {
                assert_eq!(ended.len(), 3, "{page}");
                assert!(
                    ended.iter().all(|(_, n)| *n > 0.0),
                    "a worker took no request: {ended:?}"
                );
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "/metrics counts {total} ended requests of 64: {ended:?}"
            );
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
        let long = |i: usize| GenerateRequest {
            ignore_eos: true,
            ..request(&format!("Essay {i}:"), 400)
        };
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
                    assert!(
                        *at - killed < Duration::from_secs(10),
                        "worker_lost after {:?}",
                        *at - killed
                    );
                    lost += 1;
                }
                Event::Done { finish_reason, .. } => {
                    assert_eq!(*finish_reason, FinishReason::Length);
                    assert_eq!(
                        first.len() + run.tokens().len(),
                        400,
                        "a surviving stream lost tokens"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(
            lost > 0 && lost < 6,
            "{lost} of 6 streams lost: both workers should have held some"
        );
        // New requests go to the survivor.
        for run in join_all((0..4).map(|i| nats.run(request(&format!("After {i}:"), 8)))).await {
            assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
        }
    });
}

/// Each event of a run once, in order: its worker's `seq`s strictly increase.
fn assert_once(run: &common::client::Run) {
    let seqs: Vec<u64> = run.events.iter().map(|e| e.seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "events repeated or out of order: {seqs:?}"
    );
}

#[test]
fn jobs_accepted_before_a_nats_restart_run_after_it_once_each() {
    let stack = Compose::up("natsrestart", 1);
    common::client::rt().block_on(async {
        let addr = stack.wait_workers(1).await;
        stack.ok(&["stop", "worker"]);
        let nats = Client::connect(&stack.nats_url()).await;
        let mut waiting = vec![];
        for i in 0..4 {
            waiting.push(nats.start(request(&format!("Waiting job {i}:"), 8)).await);
        }
        // JetStream's store is on a volume: the four jobs outlive the server's restart.
        stack.ok(&["restart", "nats"]);
        stack.ok(&["start", "worker"]);
        for (id, sub) in waiting {
            let run = Client::finish(id, sub, |_| {}).await;
            assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
            assert_once(&run);
        }
        // Intake, the gateway and the worker reconnected by themselves.
        let (status, text) = chat(&addr, 0).await;
        assert_eq!(status, 200, "{text}");
        // None ran twice: the one worker ended five requests.
        let t = Instant::now();
        loop {
            let page = client::request(&addr, "GET", "/metrics", None)
                .await
                .unwrap()
                .body;
            let ended: f64 = metric(&page, "llmq_worker_requests_ended_total")
                .iter()
                .map(|(_, n)| n)
                .sum();
            if ended == 5.0 {
                break;
            }
            assert!(
                ended < 5.0 && t.elapsed() < Duration::from_secs(10),
                "{ended} requests ended, not 5"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}

#[test]
fn a_rolling_restart_of_the_workers_under_load_fails_no_request() {
    let stack = Compose::up("rolling", 2);
    common::client::rt().block_on(async {
        let addr = stack.wait_workers(2).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let stop = std::cell::Cell::new(false);
        // Steady load: three HTTP clients and one NATS client, each sending one request after
        // another, from before the restart until after it; each returns how many it sent.
        let http = |c: usize| {
            let (addr, stop) = (&addr, &stop);
            async move {
                let mut sent = 0;
                while !stop.get() {
                    let (status, text) = chat(addr, c * 1000 + sent).await;
                    assert_eq!(status, 200, "{text}");
                    sent += 1;
                }
                sent
            }
        };
        let direct = async {
            let mut sent = 0;
            while !stop.get() {
                let run = nats.run(request(&format!("Steady {sent}:"), 12)).await;
                assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
                sent += 1;
            }
            sent
        };
        // While `docker-compose restart worker` runs, a request every 250 ms, each on its own
        // task: they reach the stack while the workers stop, are gone, and start again.
        let restart = async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let began = Instant::now();
            let command = stack.ok_async(&["restart", "worker"]);
            futures::pin_mut!(command);
            let mut during = vec![];
            loop {
                let addr = addr.clone();
                let i = 9000 + during.len();
                during.push(tokio::spawn(async move { chat(&addr, i).await }));
                let tick = tokio::time::sleep(Duration::from_millis(250));
                if let futures::future::Either::Left(_) =
                    futures::future::select(command.as_mut(), Box::pin(tick)).await
                {
                    break;
                }
            }
            let ended = Instant::now();
            tokio::time::sleep(Duration::from_secs(3)).await;
            stop.set(true);
            (during, ended - began)
        };
        let (a, b, c, d, (during, took)) =
            futures::join!(http(0), http(1), http(2), direct, restart);
        let steady = a + b + c + d;
        eprintln!(
            "{steady} steady requests; {} sent during the {took:?} restart",
            during.len()
        );
        assert!(
            during.len() >= 2,
            "the restart took {took:?}: too short to send requests during it"
        );
        for task in during {
            let (status, text) = task.await.unwrap();
            assert_eq!(status, 200, "{text}");
            assert!(!text.is_empty());
        }
    });
}

#[test]
fn a_worker_cut_off_for_20_s_neither_repeats_nor_drops_tokens() {
    let stack = Compose::up("partition", 2);
    common::client::rt().block_on(async {
        stack.wait_workers(2).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let n = 200;
        let mut runs = vec![];
        // At least six streams, and more until each worker holds one: which worker pulls a job
        // is NATS's choice, and the test needs streams on both sides of the cut.
        let held = loop {
            let i = runs.len();
            let (_, mut sub) = nats
                .start(GenerateRequest {
                    ignore_eos: true,
                    ..request(&format!("Essay {i}:"), n)
                })
                .await;
            let first = match Client::first_tokens_within(&mut sub, Duration::from_secs(100)).await
            {
                Ok(ids) => ids.len(),
                Err(e) => panic!(
                    "stream {i}: {e}; the workers say {}",
                    worker_heartbeats(&nats).await
                ),
            };
            runs.push((first, sub));
            if runs.len() < 6 {
                continue;
            }
            let held = streams_held(&stack, runs.len()).await;
            if held.len() == 2 && held.iter().all(|(_, k)| *k > 0) || runs.len() == 12 {
                break held;
            }
        };
        assert!(
            held.len() == 2 && held.iter().all(|(_, k)| *k > 0),
            "{} streams never spread over both workers: {held:?}",
            runs.len()
        );
        let started = runs.len();
        let network = format!("{}_default", stack.project);
        let cut = stack.containers("worker")[0].clone();
        docker(&["network", "disconnect", &network, &cut]);
        tokio::time::sleep(Duration::from_secs(20)).await;
        docker(&["network", "connect", &network, &cut]);
        let back = Instant::now();
        // Every event of each stream with its arrival: up to its terminal event (however long
        // the survivors take on a loaded machine), then whatever else comes until 10 s after
        // the reconnection (and at least 1 s after the end).
        let ends = join_all(runs.into_iter().map(|(first, mut sub)| async move {
            let mut events = vec![];
            let mut until = None;
            loop {
                let next = match until {
                    None => {
                        tokio::time::timeout(
                            Duration::from_secs(60),
                            futures::StreamExt::next(&mut sub),
                        )
                        .await
                    }
                    Some(t) => tokio::time::timeout_at(t, futures::StreamExt::next(&mut sub)).await,
                };
                let Ok(Some(m)) = next else { break };
                let ev = llmq_protocol::decode::<llmq_protocol::StreamEvent>(&m.payload).unwrap();
                if until.is_none() && ev.event.is_terminal() {
                    let t = tokio::time::Instant::now().max(tokio::time::Instant::from_std(
                        back + Duration::from_secs(10),
                    ));
                    until = Some(t + Duration::from_secs(1));
                }
                events.push((Instant::now(), ev));
            }
            (first, events)
        }))
        .await;
        let mut lost = 0;
        for (first, events) in ends {
            let end = events
                .iter()
                .position(|(_, e)| e.event.is_terminal())
                .expect("the stream ended");
            let seqs: Vec<u64> = events[..end].iter().map(|(_, e)| e.seq).collect();
            assert!(
                seqs.windows(2).all(|w| w[1] == w[0] + 1),
                "tokens repeated or missing: {seqs:?}"
            );
            let tokens: usize = events[..end]
                .iter()
                .map(|(_, e)| {
                    if let Event::Tokens { ids, .. } = &e.event {
                        ids.len()
                    } else {
                        0
                    }
                })
                .sum();
            match &events[end].1.event {
                Event::Done { .. } => assert_eq!(first + tokens, n as usize),
                Event::Error { error } => {
                    assert_eq!(error.class, ErrorClass::WorkerLost, "{error:?}");
                    lost += 1;
                }
                _ => unreachable!(),
            }
            // After its end a stream may still get the few tokens the cut-off worker had sent
            // before it knew (they were on their way), but no second end, and nothing once the
            // reconnection has delivered them.
            for (at, e) in &events[end + 1..] {
                assert!(
                    !e.event.is_terminal(),
                    "a second terminal event: {:?}",
                    e.event
                );
                assert!(
                    *at < back + Duration::from_secs(5),
                    "the cut-off worker still speaks for a lost stream"
                );
            }
        }
        assert!(
            lost > 0 && lost < started,
            "{lost} of {started} streams lost ({held:?})"
        );
    });
}

/// What each worker's heartbeats say over 3 s (streams held, queued, ended, ticks run), for a
/// failure's message: a worker whose ticks stand still while it holds streams is stuck.
async fn worker_heartbeats(nats: &Client) -> String {
    let mut sub = nats
        .nc
        .subscribe(llmq_protocol::subjects::WORKER_STATUS_ALL)
        .await
        .unwrap();
    let mut seen = vec![];
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(Some(m)) = tokio::time::timeout_at(until, futures::StreamExt::next(&mut sub)).await
    {
        if let Ok(s) = llmq_protocol::decode::<llmq_protocol::WorkerStatus>(&m.payload) {
            seen.push(format!(
                "{} at {}: {} active, {} queued, {} ended, {} ticks",
                s.worker_id,
                s.sent_at_ms,
                s.active_streams,
                s.queued_requests,
                s.ended_requests,
                s.ticks
            ));
        }
    }
    seen.join("; ")
}

/// Each live worker's id with the streams it holds (decoding or queued), once the gateway's
/// /metrics accounts for all `started` of them (or after 5 s, as they stand).
async fn streams_held(stack: &Compose, started: usize) -> Vec<(String, usize)> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let page = client::request(&stack.gateway, "GET", "/metrics", None)
            .await
            .map(|r| r.body)
            .unwrap_or_default();
        let mut held: Vec<(String, usize)> = metric(&page, "llmq_worker_active_streams")
            .into_iter()
            .map(|(labels, v)| {
                let queued = metric(&page, "llmq_worker_queued_requests")
                    .into_iter()
                    .find(|(l, _)| *l == labels)
                    .map_or(0.0, |(_, q)| q);
                (labels, (v + queued) as usize)
            })
            .collect();
        held.sort();
        if held.iter().map(|(_, k)| k).sum::<usize>() >= started || Instant::now() > until {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Connects as `url`'s user, collecting what the server reports about this connection
/// (permission violations arrive as server errors).
async fn watched(
    url: &str,
) -> (
    async_nats::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let (opts, address) = llmq_protocol::connect::options(url, None, "llmq-test");
    let nc = opts
        .event_callback(move |e| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(e.to_string());
            }
        })
        .connect(address)
        .await
        .unwrap();
    (nc, rx)
}

/// Waits up to 5 s for a server report containing `what`.
async fn reported(rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>, what: &str) -> bool {
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Some(e)) = tokio::time::timeout_at(until, rx.recv()).await {
        if e.contains(what) {
            return true;
        }
    }
    false
}

#[test]
fn nats_lets_in_only_the_right_users_each_to_its_own_subjects() {
    let stack = Compose::up("auth", 1);
    common::client::rt().block_on(async {
        stack.wait_workers(1).await;
        // No credentials, or a wrong password: the connection is refused.
        assert!(async_nats::connect(format!("nats://{}", stack.nats))
            .await
            .is_err());
        assert!(llmq_protocol::connect(
            &format!("nats://client1:wrong@{}", stack.nats),
            None,
            "llmq-test"
        )
        .await
        .is_err());

        let (nc, mut reports) = watched(&stack.nats_url_as("client1")).await;
        // Another user's inbox: the server refuses the subscription.
        let _spy = nc.subscribe("_INBOX.client2.>").await.unwrap();
        nc.flush().await.unwrap();
        assert!(
            reported(
                &mut reports,
                "Permissions Violation for Subscription to \"_INBOX.client2.>\""
            )
            .await
        );
        // A job put on the jobs subject directly, past intake: refused, and no worker runs it.
        let inbox = nc.new_inbox();
        let mut events = nc.subscribe(inbox.clone()).await.unwrap();
        let job = llmq_protocol::Job {
            request_id: "forged".into(),
            model: "smollm2".into(),
            prompt_ids: vec![1, 2, 3],
            sampling: Default::default(),
            stop: llmq_text::sampling::StopConditions {
                max_tokens: 4,
                ..Default::default()
            },
            stream_subject: inbox,
            accepted_at_ms: 0,
            cache_salt: None,
            constraint: None,
            n: 1,
        };
        nc.publish(
            llmq_protocol::subjects::jobs("smollm2"),
            llmq_protocol::encode(&job).unwrap().into(),
        )
        .await
        .unwrap();
        nc.flush().await.unwrap();
        assert!(
            reported(
                &mut reports,
                "Permissions Violation for Publish to \"llm.v1.jobs.smollm2\""
            )
            .await
        );
        assert!(
            tokio::time::timeout(
                Duration::from_secs(3),
                futures::StreamExt::next(&mut events)
            )
            .await
            .is_err(),
            "the forged job ran"
        );

        // The legitimate clients are unaffected: each gets its own answers.
        for user in ["client1", "client2"] {
            let run = Client::connect(&stack.nats_url_as(user))
                .await
                .run(request("Hello", 4))
                .await;
            assert!(
                matches!(run.last(), Event::Done { .. }),
                "{user}: {:?}",
                run.last()
            );
        }
    });
}

#[test]
fn nats_over_tls_from_the_services_and_from_the_host() {
    let stack = Compose::up_with("tls", 1, &["deploy/docker/tls.yml"]);
    common::client::rt().block_on(async {
        // Intake, the worker and the gateway reached the server over TLS.
        let addr = stack.wait_workers(1).await;
        let ca = stack.path(".cache/tls/ca.pem");
        assert!(
            ca.exists(),
            "{} missing: run deploy/setup/setup.sh tls (make image does)",
            ca.display()
        );
        // A client that cannot check the server's certificate does not get in.
        assert!(llmq_protocol::connect(&stack.nats_url(), None, "llmq-test")
            .await
            .is_err());
        let nc = llmq_protocol::connect(&stack.nats_url(), Some(&ca), "llmq-test")
            .await
            .unwrap();
        let run = Client { nc }.run(request("Over TLS:", 6)).await;
        assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
        let (status, text) = chat(&addr, 1).await;
        assert_eq!(status, 200, "{text}");
        // The Python client as an application would use it: its own NATS user, reading only
        // its own inbox prefix, over TLS.
        let url = format!("tls://{}", stack.nats);
        let ca = ca.display().to_string();
        let out = common::python::run_python_client(
            &[
                &url,
                "smollm2",
                "--user",
                "client2",
                "--password",
                stack.password("client2"),
                "--tls-ca",
                &ca,
                "--inbox-prefix",
                "_INBOX.client2",
                "--only",
                "streaming,cancel,errors",
            ],
            || {},
        )
        .await;
        assert!(out.contains("streaming:"), "{out}");
    });
}

#[test]
fn stopping_the_workers_hands_back_what_they_had_not_started_and_loses_nothing() {
    // Two streams at a time, so that most of the jobs wait in the worker when it stops.
    let overlay =
        std::env::temp_dir().join(format!("llmq-compose-batch2-{}.yml", std::process::id()));
    std::fs::write(
        &overlay,
        "services:\n  worker:\n    environment:\n      LLMQ__SCHEDULER__MAX_BATCH: \"2\"\n",
    )
    .unwrap();
    let stack = Compose::up_with("stop", 1, &[overlay.to_str().unwrap()]);
    common::client::rt().block_on(async {
        stack.wait_workers(1).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let n = 40;
        let mut runs = vec![];
        for i in 0..6 {
            runs.push(
                nats.start(GenerateRequest {
                    ignore_eos: true,
                    ..request(&format!("Job {i}:"), n)
                })
                .await,
            );
        }
        // Stopped while two stream and four wait: the two finish, the four go back to the
        // stream, and run once the worker is back.
        let mut sub0 = runs.remove(0);
        let first = Client::first_tokens(&mut sub0.1).await.len();
        stack.ok_async(&["stop", "worker"]).await;
        stack.ok_async(&["start", "worker"]).await;
        let mut all = vec![(first, Client::finish(sub0.0, sub0.1, |_| {}).await)];
        for (id, sub) in runs {
            all.push((0, Client::finish(id, sub, |_| {}).await));
        }
        for (first, run) in &all {
            assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
            assert_eq!(
                first + run.tokens().len(),
                n as usize,
                "tokens lost or repeated"
            );
            assert_once(run);
        }
        let logs = stack.ok(&["logs", "--no-color", "worker"]);
        assert!(
            logs.contains("handed back the jobs not started"),
            "the stopping worker ran everything itself"
        );
    });
    drop(stack); // `down` reads the overlay too
    let _ = std::fs::remove_file(&overlay);
}

#[test]
fn a_prefill_worker_container_prefills_for_the_decode_worker() {
    let stack = Compose::up_with("prefill", 1, &["deploy/docker/prefill.yml"]);
    let prompt =
        "The history of the city of Paris begins long ago, with many kings and people. ".repeat(20);
    let want = common::client::local_greedy_of("smollm2", &prompt, 12);
    common::client::rt().block_on(async {
        // The decode worker and the prefill worker both report; the first hears the second.
        let addr = stack.wait_workers(2).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let nats = Client::connect(&stack.nats_url()).await;
        let run = nats.run(request(&prompt, 12)).await;
        assert_eq!(
            run.tokens(),
            want,
            "the same greedy tokens as in-process generation"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        let page = client::request(&addr, "GET", "/metrics", None)
            .await
            .unwrap()
            .body;
        let sent = metric(&page, "llmq_worker_kv_bytes_sent_total");
        let received = metric(&page, "llmq_worker_kv_bytes_received_total");
        let of = |m: &[(String, f64)], role: &str| {
            m.iter()
                .filter(|(l, _)| l.contains(&format!("role=\"{role}\"")))
                .map(|(_, v)| *v)
                .sum::<f64>()
        };
        let direct = metric(&page, "llmq_worker_kv_bytes_sent_direct_total");
        assert!(of(&sent, "prefill") > 0.0, "{page}");
        assert_eq!(of(&sent, "prefill"), of(&received, "decode"), "{page}");
        // Across containers on the direct connection the decode worker's grants offer.
        assert_eq!(of(&direct, "prefill"), of(&sent, "prefill"), "{page}");
    });
}

/// What one streamed chat completion through the gateway came to.
#[derive(Debug)]
enum Outcome {
    /// Its finish reason, then `[DONE]`.
    Finished,
    /// An error chunk (its code and message), then `[DONE]`.
    Error(String),
    /// Refused before the stream began (no job accepted): its status or connection error.
    Refused(String),
    /// Neither within the client's 120 s.
    Hung(Vec<String>),
}

/// One streamed chat through the gateway, read line by line: how it ended, and the longest
/// silence between its lines.
async fn streamed_chat(addr: &str, i: usize) -> (Outcome, Duration) {
    let body = serde_json::json!({
        "model": "smollm2", "stream": true, "max_tokens": 8 + (i % 4) * 24,
        "messages": [{"role": "user", "content": format!("Tell me about the number {i}.")}],
    });
    let body = body.to_string();
    let mut lines: Vec<String> = vec![];
    let mut last = Instant::now();
    let mut gap = Duration::ZERO;
    let read = client::stream(addr, "/v1/chat/completions", &body, |at, l| {
        gap = gap.max(at.duration_since(last));
        last = at;
        lines.push(l.to_string());
    });
    let status = match tokio::time::timeout(Duration::from_secs(120), read).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return (Outcome::Refused(format!("connection: {e}")), gap),
        Err(_) => return (Outcome::Hung(lines), gap),
    };
    if status != 200 {
        return (Outcome::Refused(format!("status {status}")), gap);
    }
    let done = lines.iter().filter(|l| *l == "data: [DONE]").count();
    let finished = lines
        .iter()
        .filter(|l| l.contains("\"finish_reason\":\""))
        .count();
    let errors: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("data: {\"error\""))
        .collect();
    assert_eq!(done, 1, "one [DONE] per stream: {lines:?}");
    assert_eq!(
        lines.last().map(String::as_str),
        Some("data: [DONE]"),
        "{lines:?}"
    );
    match (finished, errors.as_slice()) {
        (1, []) => (Outcome::Finished, gap),
        (0, [e]) => {
            let v: serde_json::Value =
                serde_json::from_str(e.trim_start_matches("data: ")).unwrap();
            let (code, message) = (
                v["error"]["code"].as_str().unwrap_or("?"),
                v["error"]["message"].as_str().unwrap_or(""),
            );
            (Outcome::Error(format!("{code}: {message}")), gap)
        }
        _ => panic!("not exactly one terminal event: {lines:?}"),
    }
}

/// Faults one after another under streaming load: `faults` run at the given seconds from the
/// start while 12 clients stream chat completions through the gateway, one after another. Every
/// request ends with exactly one terminal event (a finish or a typed error), none is left
/// silent past the gateway's bound (`gateway.silent_stream_timeout_ms`, 30 s, plus the silence
/// check's period and the query's), and the stack serves again afterwards.
fn faults_in_sequence(name: &str, faults: &[(u64, &[&str])]) {
    let stack = Compose::up(name, 2);
    common::client::rt().block_on(async {
        let addr = stack.wait_workers(2).await;
        let stop = std::cell::Cell::new(false);
        let outcomes = std::cell::RefCell::new(vec![]);
        let load = |c: usize| {
            let (addr, stop, outcomes) = (&addr, &stop, &outcomes);
            async move {
                let mut i = c * 1000;
                while !stop.get() {
                    let got = streamed_chat(addr, i).await;
                    // A refused request (intake unreachable while NATS restarts) is retried
                    // after a pause, as a client would.
                    if let (Outcome::Refused(_), _) = got {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    outcomes.borrow_mut().push(got);
                    i += 1;
                }
            }
        };
        let script = async {
            let began = Instant::now();
            for (at, args) in faults {
                tokio::time::sleep_until((began + Duration::from_secs(*at)).into()).await;
                eprintln!("{:?}: docker-compose {args:?}", began.elapsed());
                if args[0] == "kill" {
                    let victim = stack.containers("worker")[0].clone();
                    docker(&["kill", &victim]);
                } else {
                    stack.ok_async(args).await;
                }
            }
            tokio::time::sleep(Duration::from_secs(20)).await;
            stop.set(true);
        };
        futures::join!(join_all((0..12).map(load)), script);
        let outcomes = outcomes.into_inner();
        let finished = outcomes.iter().filter(|(o, _)| matches!(o, Outcome::Finished)).count();
        let hung: Vec<&Vec<String>> = outcomes.iter().filter_map(|(o, _)| if let Outcome::Hung(lines) = o { Some(lines) } else { None }).collect();
        let mut errors: Vec<&str> = outcomes.iter().filter_map(|(o, _)| if let Outcome::Error(c) = o { Some(c.as_str()) } else { None }).collect();
        errors.sort_unstable();
        errors.dedup_by(|a, b| a == b);
        let gap = outcomes.iter().map(|(_, g)| *g).max().unwrap_or_default();
        let mut refusals: Vec<&str> = outcomes.iter().filter_map(|(o, _)| if let Outcome::Refused(why) = o { Some(why.as_str()) } else { None }).collect();
        let refused = refusals.len();
        refusals.sort_unstable();
        refusals.dedup();
        let accepted = outcomes.len() - refused;
        let failed = accepted - finished - hung.len();
        eprintln!(
            "{name}: {} requests, {refused} refused (kinds: {refusals:?}), {finished} finished, {failed} typed errors (kinds: {errors:?}), {} hung, longest silence {gap:?}",
            outcomes.len(),
            hung.len()
        );
        assert!(hung.is_empty(), "streams left without a terminal event, their lines so far: {hung:?}");
        assert!(gap < Duration::from_secs(45), "a stream was silent for {gap:?}");
        assert!(finished > accepted / 2, "{finished} of {accepted} streams finished");
        // Afterwards the stack serves again.
        let t = Instant::now();
        loop {
            if let (Outcome::Finished, _) = streamed_chat(&addr, 99_999).await {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(90), "the stack does not serve again");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}

#[test]
fn a_killed_worker_then_its_return_then_a_nats_restart_leave_no_stream_hanging() {
    faults_in_sequence(
        "seqwn",
        &[
            (5, &["kill"]),
            (25, &["up", "-d", "--scale", "worker=2"]),
            (50, &["restart", "nats"]),
        ],
    );
}

#[test]
fn a_nats_restart_then_a_killed_worker_and_its_return_leave_no_stream_hanging() {
    faults_in_sequence(
        "seqnw",
        &[
            (5, &["restart", "nats"]),
            (30, &["kill"]),
            (50, &["up", "-d", "--scale", "worker=2"]),
        ],
    );
}

/// Prometheus's answer to an instant query: each series' labels and value.
async fn prometheus_query(addr: &str, query: &str) -> Vec<(serde_json::Value, f64)> {
    let path = format!("/api/v1/query?query={query}");
    let Ok(r) = client::request(addr, "GET", &path, None).await else {
        return vec![];
    };
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
    v["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let value = s["value"][1].as_str().and_then(|x| x.parse().ok());
            (s["metric"].clone(), value.unwrap_or(f64::NAN))
        })
        .collect()
}

#[test]
fn prometheus_scrapes_every_worker_s_series_and_loads_the_alerting_rules() {
    let prometheus = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let stack = Compose::up_full(
        "prom",
        2,
        &["deploy/docker/prometheus.yml"],
        &[("LLMQ_PROMETHEUS_PUBLISH", &prometheus)],
    );
    common::client::rt().block_on(async {
        let addr = stack.wait_workers(2).await;
        for i in 0..4 {
            let (status, text) = chat(&addr, i).await;
            assert_eq!(status, 200, "{text}");
        }
        // Within a few scrapes: both workers' series, labelled, and the gateway's requests.
        let t = Instant::now();
        loop {
            let ended = prometheus_query(&prometheus, "llmq_worker_requests_ended_total").await;
            let ok = prometheus_query(&prometheus, "llmq_gateway_requests_total").await;
            let live = prometheus_query(&prometheus, "llmq_gateway_live_workers").await;
            let chats_ok: f64 = ok
                .iter()
                .filter(|(m, _)| m["endpoint"] == "chat" && m["outcome"] == "ok")
                .map(|(_, v)| v)
                .sum();
            let labelled = ended.len() == 2
                && ended.iter().all(|(m, _)| {
                    m["model"] == "smollm2"
                        && m["role"] == "both"
                        && m["worker"].as_str().is_some_and(|w| !w.is_empty())
                        && m["job"] == "llmq-gateway"
                });
            let ended_sum: f64 = ended.iter().map(|(_, v)| v).sum();
            if labelled
                && ended_sum >= 4.0
                && chats_ok >= 4.0
                && live.first().map(|x| x.1) == Some(2.0)
            {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(90),
                "Prometheus: ended {ended:?}, requests {ok:?}, live {live:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // The alerting rules are loaded and evaluate cleanly.
        let r = client::request(&prometheus, "GET", "/api/v1/rules", None)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        let rules: Vec<(String, String)> = v["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .map(|r| {
                (
                    r["name"].as_str().unwrap_or_default().to_string(),
                    r["health"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        let names: Vec<&str> = rules.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "LlmqNoLiveWorker",
                "LlmqQueueGrowing",
                "LlmqKvFull",
                "LlmqErrorRate"
            ],
            "{v}"
        );
        assert!(
            rules.iter().all(|(_, h)| h == "ok" || h == "unknown"),
            "{rules:?}"
        );
    });
}
