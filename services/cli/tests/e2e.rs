//! End to end through a real nats-server (started here on a free loopback port and stopped
//! whatever happens), real intake and worker processes, and the tiny Llama fixture.

use std::time::{Duration, Instant};

use futures::StreamExt;
use llmq_protocol::*;

mod common;

use common::client::*;
use common::*;

const LONG: &str = "Streams of tokens flow through queues, schedulers and caches. ";

#[test]
fn events_arrive_in_order_and_chunked_prefill_gives_the_same_tokens() {
    let prompt = LONG.repeat(6);
    let want = local_greedy(&prompt, 12);
    // Tiny chunks: the prompt takes many ticks to prefill.
    let stack = Stack::up(&[
        ("LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS", "5"),
        ("LLMQ__SCHEDULER__IDLE_PREFILL_CHUNK_TOKENS", "7"),
    ]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let run = c.run(req(&prompt, 12)).await;
        for (i, e) in run.events.iter().enumerate() {
            assert_eq!(e.seq, i as u64, "sequence numbers");
            assert_eq!(e.request_id, run.id);
        }
        assert!(matches!(run.events[0].event, Event::Queued { .. }));
        let progress: Vec<(u32, u32)> = run
            .events
            .iter()
            .filter_map(|e| {
                if let Event::PrefillProgress { done, total } = e.event {
                    Some((done, total))
                } else {
                    None
                }
            })
            .collect();
        assert!(progress.len() > 3, "{progress:?}");
        assert!(
            progress.windows(2).all(|w| w[0].0 < w[1].0),
            "monotonic: {progress:?}"
        );
        let (done, total) = *progress.last().unwrap();
        assert_eq!(done, total);
        assert_eq!(
            run.tokens(),
            want,
            "same greedy tokens as unchunked in-process generation"
        );
        match run.last() {
            Event::Done { usage, timings, .. } => {
                assert_eq!(usage.completion, 12);
                assert_eq!(usage.prompt, total);
                assert!(timings.total_ms >= timings.ttft_ms);
            }
            e => panic!("{e:?}"),
        }
        let s = c.status().await;
        assert!(
            s.prefix_bytes > 0,
            "the prompt and output are cached: {s:?}"
        );
        assert_eq!(
            s.kv_bytes_used, s.prefix_bytes,
            "only the prefix cache holds KV: {s:?}"
        );

        // The same prompt again reuses all of it but the last token, with the same tokens.
        let again = c.run(req(&prompt, 12)).await;
        assert_eq!(again.tokens(), want);
        match again.last() {
            Event::Done { usage, .. } => assert_eq!(usage.cached, usage.prompt - 1, "{usage:?}"),
            e => panic!("{e:?}"),
        }
        // `llm.v1.cache.clear` frees it all.
        let m =
            c.nc.request(
                subjects::CACHE_CLEAR,
                encode(&ClearCache::default()).unwrap().into(),
            )
            .await
            .unwrap();
        let cleared: CacheCleared = decode(&m.payload).unwrap();
        assert!(cleared.freed_bytes > 0);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let s = c.status().await;
        assert_eq!(
            (s.kv_bytes_used, s.prefix_bytes, s.prefix_entries),
            (0, 0, 0),
            "{s:?}"
        );
        assert!(s.prefix_hit_rate > 0.4, "{s:?}");
    });
}

#[test]
fn bad_input_gets_typed_errors_and_disturbs_nothing() {
    let stack = Stack::up(&[]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let mut long = req("x", 8);
        long.max_tokens = Some(100);
        long.ignore_eos = true;
        let (good_id, good_sub) = c.start(long).await;
        let nan = GenerateRequest {
            temperature: Some(f64::NAN),
            ..req("hi", 4)
        };
        let neg = GenerateRequest {
            temperature: Some(-1.0),
            ..req("hi", 4)
        };
        let cases: Vec<(Vec<u8>, ErrorClass)> = vec![
            (
                b"\xc1 definitely not msgpack".to_vec(),
                ErrorClass::InvalidRequest,
            ),
            (
                encode(&GenerateRequest {
                    model: "no-such-model".into(),
                    ..req("hi", 4)
                })
                .unwrap(),
                ErrorClass::UnknownModel,
            ),
            (encode(&req("", 4)).unwrap(), ErrorClass::InvalidRequest),
            (
                encode(&req(&"word ".repeat(600), 4)).unwrap(),
                ErrorClass::PromptTooLong,
            ),
            (encode(&req("hi", 0)).unwrap(), ErrorClass::InvalidRequest),
            (encode(&nan).unwrap(), ErrorClass::InvalidRequest),
            (encode(&neg).unwrap(), ErrorClass::InvalidRequest),
            (rmp_oversized(), ErrorClass::InvalidRequest),
            // Constraints that cannot be compiled, or that ignore_eos would run past.
            (
                encode(&GenerateRequest {
                    constraint: Some(Constraint::Regex {
                        pattern: "(".into(),
                    }),
                    ..req("hi", 4)
                })
                .unwrap(),
                ErrorClass::InvalidRequest,
            ),
            (
                encode(&GenerateRequest {
                    constraint: Some(Constraint::JsonObject),
                    ignore_eos: true,
                    ..req("hi", 4)
                })
                .unwrap(),
                ErrorClass::InvalidRequest,
            ),
            // A newer client's field that changes the output, named in `requires`.
            (
                encode(&GenerateRequest {
                    requires: vec!["response_format".into()],
                    ..req("hi", 4)
                })
                .unwrap(),
                ErrorClass::InvalidRequest,
            ),
        ];
        for (payload, class) in cases {
            match c.submit_raw(payload).await {
                GenerateReply::Rejected { error } => assert_eq!(error.class, class, "{error}"),
                r => panic!("accepted: {r:?}"),
            }
        }
        // A newer client's field that it does not require is ignored, as MessagePack maps allow.
        #[derive(serde::Serialize)]
        struct Newer {
            #[serde(flatten)]
            r: GenerateRequest,
            trace_note: String,
        }
        let newer = rmp_serde::to_vec_named(&Newer {
            r: req("hi", 4),
            trace_note: "x".into(),
        })
        .unwrap();
        assert!(
            matches!(c.submit_raw(newer).await, GenerateReply::Accepted { .. }),
            "a field not required is ignored"
        );
        let run = Client::finish(good_id, good_sub, |_| {}).await;
        assert!(
            matches!(run.last(), Event::Done { .. }),
            "the good request finished: {:?}",
            run.last()
        );
        assert_eq!(run.tokens().len(), 100);
    });
}

/// Constraints on NATS: a regular expression, a Lark grammar and a JSON schema hold even the
/// random-weight fixture's output to their language, streamed token by token.
#[test]
fn constrained_requests_through_nats_match_their_constraints() {
    let stack = Stack::up(&[]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let constrained = |constraint| GenerateRequest { constraint: Some(constraint), requires: vec!["constraint".into()], temperature: Some(1.0), seed: Some(3), ..req("Answer:", 64) };
        let run = c.run(constrained(Constraint::Regex { pattern: "[0-9]{3}-[0-9]{4}".into() })).await;
        let text = run.text();
        assert!(matches!(run.last(), Event::Done { finish_reason: FinishReason::Stop, .. }), "{text:?}: {:?}", run.last());
        assert!(text.len() == 8 && text.char_indices().all(|(i, ch)| if i == 3 { ch == '-' } else { ch.is_ascii_digit() }), "{text:?}");
        let run = c.run(constrained(Constraint::Lark { grammar: "start: (\"yes\" | \"no\") \".\"".into() })).await;
        assert!(["yes.", "no."].contains(&run.text().as_str()), "{:?}", run.text());
        let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
        let run = c.run(constrained(Constraint::JsonSchema { schema: schema.to_string() })).await;
        let doc: serde_json::Value = serde_json::from_str(&run.text()).unwrap_or_else(|e| panic!("{:?}: {e}", run.text()));
        assert!(doc["ok"].is_boolean() && doc.as_object().unwrap().len() == 1, "{doc}");
    });
}

/// n samples of one prompt: one request, its events tagged with their choice and counted by one
/// `seq`; each choice ends once; the samples after the first find its prompt's KV cached;
/// seeded samples differ from each other and repeat.
#[test]
fn samples_of_one_prompt_share_its_prefill() {
    let stack = Stack::up(&[]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let r = GenerateRequest {
            n: Some(3),
            requires: vec!["n".into()],
            temperature: Some(1.0),
            seed: Some(42),
            ..req(&LONG.repeat(3), 12)
        };
        let run = |r: GenerateRequest| async {
            let (id, sub) = c.start(r).await;
            Client::finish_choices(id, sub, 3, |_| {}).await
        };
        let first = run(r.clone()).await;
        assert!(
            first.events.windows(2).all(|w| w[1].seq == w[0].seq + 1),
            "one seq for the request"
        );
        let mut texts = vec![];
        for choice in 0..3 {
            let evs: Vec<&Event> = first
                .events
                .iter()
                .filter(|e| e.choice == choice)
                .map(|e| &e.event)
                .collect();
            assert_eq!(
                evs.iter().filter(|e| e.is_terminal()).count(),
                1,
                "choice {choice}"
            );
            match evs.last() {
                Some(Event::Done { usage, .. }) => {
                    assert_eq!(usage.completion, 12, "choice {choice}");
                    if choice > 0 {
                        assert!(
                            usage.cached > 0,
                            "choice {choice} prefilled the prompt again: {usage:?}"
                        );
                    }
                }
                e => panic!("choice {choice} ended with {e:?}"),
            }
            let ids: Vec<u32> = evs
                .iter()
                .flat_map(|e| {
                    if let Event::Tokens { ids, .. } = e {
                        ids.clone()
                    } else {
                        vec![]
                    }
                })
                .collect();
            texts.push(ids);
        }
        assert!(
            texts[0] != texts[1] || texts[1] != texts[2],
            "the samples are all the same: {texts:?}"
        );
        let again = run(r).await;
        for choice in 0..3u32 {
            let ids: Vec<u32> = again
                .events
                .iter()
                .filter(|e| e.choice == choice)
                .flat_map(|e| {
                    if let Event::Tokens { ids, .. } = &e.event {
                        ids.clone()
                    } else {
                        vec![]
                    }
                })
                .collect();
            assert_eq!(
                ids, texts[choice as usize],
                "seeded choice {choice} repeats"
            );
        }
        // Out of range.
        match c
            .submit_raw(
                encode(&GenerateRequest {
                    n: Some(17),
                    ..req("hi", 4)
                })
                .unwrap(),
            )
            .await
        {
            GenerateReply::Rejected { error } => {
                assert_eq!(error.class, ErrorClass::InvalidRequest)
            }
            r => panic!("accepted: {r:?}"),
        }
    });
}

/// A request larger than the protocol's limit but within the server's payload limit
/// (`encode` refuses to make one, as it should).
fn rmp_oversized() -> Vec<u8> {
    let r = GenerateRequest {
        model: fixture(),
        prompt: Some("y".repeat(MAX_MESSAGE_BYTES + 100)),
        ..Default::default()
    };
    rmp_serde::to_vec_named(&r).unwrap()
}

#[test]
fn cancel_while_queued_mid_prefill_and_decoding() {
    // One sequence at a time and tiny prefill chunks, whole (not in shares of layers), so each
    // stage lasts long enough to hit.
    let stack = Stack::up(&[
        ("LLMQ__SCHEDULER__MAX_BATCH", "2"),
        ("LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS", "2"),
        ("LLMQ__SCHEDULER__PREFILL_CHUNK_STAGES", "1"),
        ("LLMQ__SCHEDULER__IDLE_PREFILL_CHUNK_TOKENS", "2"),
    ]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let endless = |p: &str| GenerateRequest { ignore_eos: true, ..req(p, 400) };
        // A decodes for a long time; B prefills a long prompt in 2-token chunks; C waits (batch full).
        let (a, a_sub) = c.start(endless("a")).await;
        let (b, b_sub) = c.start(GenerateRequest { max_tokens: Some(60), ..endless(&LONG.repeat(18)) }).await;
        let (cc, c_sub) = c.start(endless("c")).await;
        let (d, d_sub) = c.start(req("d", 5)).await;

        // C is cancelled while queued, B once it has prefilled 4 tokens, A once it has streamed 5
        // tokens; the streams are read at the same time, so each cancel goes out as its trigger
        // arrives.
        let mut on_b_cancel = cancel_when(b.clone(), c.nc.clone(), |e, _| matches!(e, Event::PrefillProgress { done: 4, .. }));
        // C waits (in the worker's queue or still in the jobs stream: both slots are taken) from
        // B's first chunk on; it is cancelled then.
        let mut on_b_cancel_c = cancel_when(cc.clone(), c.nc.clone(), |e, _| matches!(e, Event::PrefillProgress { .. }));
        let on_b = move |e: &StreamEvent| {
            on_b_cancel_c(e);
            on_b_cancel(e);
        };
        let on_a = cancel_when(a.clone(), c.nc.clone(), |e, n| {
            if matches!(e, Event::Tokens { .. }) {
                *n += 1;
            }
            *n == 5
        });
        let on_c = |_: &StreamEvent| {};
        let (b_run, a_run, c_run) = tokio::join!(
            Client::finish(b.clone(), b_sub, on_b),
            Client::finish(a.clone(), a_sub, on_a),
            Client::finish(cc.clone(), c_sub, on_c)
        );
        assert!(c_run.tokens().is_empty(), "cancelled while queued");
        assert!(!c_run.events.iter().any(|e| matches!(e.event, Event::PrefillProgress { .. })), "C never started");
        assert!(b_run.tokens().is_empty(), "cancelled mid-prefill");
        for run in [&a_run, &b_run, &c_run] {
            assert!(matches!(run.last(), Event::Error { error } if error.class == ErrorClass::Cancelled), "{}: {:?}", run.id, run.last());
        }
        assert!(a_run.tokens().len() < 400, "cancelled while decoding");
        let d_run = Client::finish(d, d_sub, |_| {}).await;
        assert!(matches!(d_run.last(), Event::Done { .. }), "the other request finished");
        // Every cache is freed.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let s = c.status().await;
        assert_eq!((s.kv_bytes_used - s.prefix_bytes, s.active_streams, s.queued_requests), (0, 0, 0), "{s:?}");
    });
}

#[test]
fn a_job_accepted_before_any_worker_runs_completes_when_one_starts() {
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &[("LLMQ__INTAKE__MAX_QUEUED_REQUESTS", "2")]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let (id, sub) = c.start(req("Paris is", 6)).await;
        let (id2, sub2) = c.start(req("Rome is", 3)).await;
        // Jobs wait in the stream with no worker to take them: intake counts them (polling the
        // stream every 250 ms) and, once it has seen two, refuses more with queue_full.
        let t = std::time::Instant::now();
        let mut early = vec![];
        loop {
            match c.submit_raw(encode(&req("Oslo is", 2)).unwrap()).await {
                GenerateReply::Rejected { error } => {
                    assert_eq!(error.class, ErrorClass::QueueFull, "{error}");
                    break;
                }
                // Accepted before intake's next poll of the stream.
                GenerateReply::Accepted { request_id, .. } => early.push(request_id),
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "never refused: {} accepted",
                early.len() + 2
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stack.spawn("worker", &[]);
        let run = Client::finish(id, sub, |_| {}).await;
        assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
        assert_eq!(run.tokens(), local_greedy("Paris is", 6));
        let run2 = Client::finish(id2, sub2, |_| {}).await;
        assert_eq!(run2.tokens(), local_greedy("Rome is", 3));
    });
}

#[test]
fn a_job_cancelled_before_any_worker_runs_is_never_run() {
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &[]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let (id, sub) = c
            .start(GenerateRequest {
                ignore_eos: true,
                ..req("Never run me", 50)
            })
            .await;
        c.nc.publish(
            subjects::CANCEL,
            encode(&Cancel {
                request_id: id.clone(),
            })
            .unwrap()
            .into(),
        )
        .await
        .unwrap();
        c.nc.flush().await.unwrap();
        let (other, other_sub) = c.start(req("Paris is", 3)).await;
        // The worker starts after the cancel went out: it learns it from the cancels stream.
        stack.spawn("worker", &[]);
        let run = Client::finish(id, sub, |_| {}).await;
        assert!(
            matches!(run.last(), Event::Error { error } if error.class == ErrorClass::Cancelled),
            "{:?}",
            run.last()
        );
        assert!(
            run.tokens().is_empty() && run.events.len() == 1,
            "it never started: {:?}",
            run.events
        );
        let run = Client::finish(other, other_sub, |_| {}).await;
        assert_eq!(
            run.tokens(),
            local_greedy("Paris is", 3),
            "the other job ran"
        );
    });
}

#[test]
fn a_job_whose_worker_dies_ends_with_worker_lost_on_another_worker() {
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &[]);
    let fast_ack = [
        ("LLMQ__WORKER__ACK_WAIT_MS", "1500"),
        ("LLMQ__SCHEDULER__MAX_BATCH", "1"),
    ];
    let doomed = stack.spawn("worker", &fast_ack);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let (id, mut sub) = c
            .start(GenerateRequest {
                ignore_eos: true,
                ..req("a long one", 400)
            })
            .await;
        // Wait for its first tokens, then kill its worker mid-stream.
        loop {
            let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
                .await
                .unwrap()
                .unwrap();
            if matches!(
                decode::<StreamEvent>(&m.payload).unwrap().event,
                Event::Tokens { .. }
            ) {
                break;
            }
        }
        stack.kill(doomed);
        stack.spawn("worker", &fast_ack);
        let run = Client::finish(id, sub, |_| {}).await;
        match run.last() {
            Event::Error { error } => assert_eq!(error.class, ErrorClass::WorkerLost, "{error}"),
            e => panic!("{e:?}"),
        }
        assert_eq!(
            run.events.iter().filter(|e| e.event.is_terminal()).count(),
            1
        );
        // The surviving worker serves new requests.
        let next = c.run(req("Paris is", 4)).await;
        assert!(matches!(next.last(), Event::Done { .. }));
    });
}

/// The latest heartbeat of each worker, gathered for `window`.
async fn statuses(c: &Client, window: Duration) -> std::collections::HashMap<String, WorkerStatus> {
    let mut sub = c.nc.subscribe(subjects::WORKER_STATUS_ALL).await.unwrap();
    let mut seen = std::collections::HashMap::new();
    let end = tokio::time::Instant::now() + window;
    while let Ok(Some(m)) = tokio::time::timeout_at(end, sub.next()).await {
        let s: WorkerStatus = decode(&m.payload).unwrap();
        seen.insert(s.worker_id.clone(), s);
    }
    seen
}

/// Two workers behind one intake: a uniform load is shared between them; then one is killed
/// mid-run: its in-flight requests end with `worker_lost`, the others complete, nothing hangs.
#[test]
fn two_workers_share_the_load_and_a_killed_one_loses_only_its_own_requests() {
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &[]);
    // Three slots each: six long jobs must split 3/3 (a worker takes no job it cannot start
    // while its peer has a free slot).
    let env = |id| {
        [
            ("LLMQ__WORKER__ACK_WAIT_MS", "1500"),
            ("LLMQ__WORKER__ID", id),
            ("LLMQ__SCHEDULER__MAX_BATCH", "3"),
        ]
    };
    let doomed = stack.spawn("worker", &env("wa"));
    stack.spawn("worker", &env("wb"));
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let t = Instant::now();
        while statuses(&c, Duration::from_millis(500)).await.len() < 2 {
            assert!(t.elapsed() < Duration::from_secs(60), "both workers up");
        }
        let run_all = |n: usize, max_tokens: i64| {
            let c = &c;
            async move {
                let mut started = vec![];
                for i in 0..n {
                    started.push(c.start(GenerateRequest { ignore_eos: true, ..req(&format!("Request number {i}"), max_tokens) }).await);
                }
                started
            }
        };
        let runs = futures::future::join_all(run_all(8, 24).await.into_iter().map(|(id, sub)| Client::finish(id, sub, |_| {}))).await;
        assert!(runs.iter().all(|r| matches!(r.last(), Event::Done { .. })));
        tokio::time::sleep(Duration::from_millis(400)).await;
        let ended: std::collections::HashMap<String, u64> =
            statuses(&c, Duration::from_millis(600)).await.into_iter().map(|(k, s)| (k, s.ended_requests)).collect();
        assert_eq!(ended.values().sum::<u64>(), 8, "{ended:?}");
        assert!(ended.values().all(|&n| n >= 2), "both workers took a share of the 8: {ended:?}");

        // Long requests on both; kill one worker once every stream has produced tokens.
        let started = run_all(6, 450).await;
        let (tx, mut first_tokens) = tokio::sync::mpsc::unbounded_channel();
        let finishing: Vec<_> = started
            .into_iter()
            .map(|(id, sub)| {
                let tx = tx.clone();
                let mut told = false;
                Client::finish(id, sub, move |e| {
                    if matches!(e.event, Event::Tokens { .. }) && !told {
                        told = true;
                        let _ = tx.send(());
                    }
                })
            })
            .collect();
        let all = tokio::spawn(futures::future::join_all(finishing));
        for _ in 0..6 {
            tokio::time::timeout(Duration::from_secs(30), first_tokens.recv()).await.expect("every stream starts").unwrap();
        }
        stack.kill(doomed);
        let runs = tokio::time::timeout(Duration::from_secs(60), all).await.expect("nothing hangs").unwrap();
        let lost = runs.iter().filter(|r| matches!(r.last(), Event::Error { error } if error.class == ErrorClass::WorkerLost)).count();
        let done = runs.iter().filter(|r| matches!(r.last(), Event::Done { .. })).count();
        assert_eq!((lost, done), (3, 3), "the killed worker held exactly its three; the survivor completed its own");
        for r in &runs {
            assert_eq!(r.events.iter().filter(|e| e.event.is_terminal()).count(), 1, "{}", r.id);
        }
    });
}

/// A worker busy in one long tick (a whole 1800-token prompt prefilled at once by SmolLM2 on a
/// CPU) keeps sending heartbeats, with the request counted: intake, the gateway and its peers
/// must not take a busy worker for a gone one.
#[test]
fn heartbeats_continue_through_a_long_tick() {
    let mut stack = Stack::nats_for("smollm2");
    stack.spawn("intake", &[]);
    stack.spawn(
        "worker",
        &[("LLMQ__SCHEDULER__IDLE_PREFILL_CHUNK_TOKENS", "4096")],
    );
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let t = Instant::now();
        while statuses(&c, Duration::from_millis(500)).await.is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "the worker never came up"
            );
        }
        let mut beats = c.nc.subscribe(subjects::WORKER_STATUS_ALL).await.unwrap();
        let ids: Vec<u32> = (0..1800u32).map(|i| 100 + (i * 37) % 20000).collect();
        let long = GenerateRequest {
            model: "smollm2".into(),
            prompt_ids: Some(ids),
            max_tokens: Some(2),
            ..Default::default()
        };
        let submitted = Instant::now();
        let (id, sub) = c.start(long).await;
        let finishing = tokio::spawn(Client::finish(id, sub, |_| {}));
        let mut gaps = vec![];
        let mut busy_seen = false;
        let mut last = submitted;
        while !finishing.is_finished() {
            let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(100), beats.next()).await
            else {
                continue;
            };
            let s: WorkerStatus = decode(&m.payload).unwrap();
            busy_seen |= s.queued_requests + s.active_streams == 1;
            gaps.push(last.elapsed());
            last = Instant::now();
        }
        let run = finishing.await.unwrap();
        let took = submitted.elapsed();
        assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
        // Meaningful only when the prefill tick was long: it is, on this model and a CPU.
        assert!(
            took > Duration::from_millis(1500),
            "the prefill took only {took:?}"
        );
        let worst = gaps.iter().max().copied().unwrap_or(took);
        assert!(
            worst < Duration::from_millis(1000),
            "a heartbeat gap of {worst:?} (heartbeat every 200 ms) during a {took:?} request"
        );
        assert!(busy_seen, "heartbeats during the tick count the request");
    });
}

/// The hybrid families through NATS (tiny-qwen35: gated DeltaNet and gated attention): seeded
/// samples of one prompt each end once and repeat, a JSON schema holds its output, and a request
/// cancelled while it decodes ends with `Cancelled` beside the others.
#[test]
fn a_hybrid_model_serves_samples_constraints_and_cancels() {
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-qwen35")
        .canonicalize()
        .unwrap()
        .display()
        .to_string();
    let mut stack = Stack::nats_for(&model);
    stack.spawn("intake", &[]);
    stack.spawn("worker", &[]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let of = |prompt: &str, n: i64| GenerateRequest {
            model: model.clone(),
            ..req(prompt, n)
        };
        let samples = GenerateRequest {
            n: Some(3),
            requires: vec!["n".into()],
            temperature: Some(1.0),
            seed: Some(42),
            ..of(&LONG.repeat(3), 12)
        };
        let mut runs = vec![];
        for _ in 0..2 {
            let (id, sub) = c.start(samples.clone()).await;
            runs.push(Client::finish_choices(id, sub, 3, |_| {}).await);
        }
        for choice in 0..3u32 {
            let of_choice = |run: &Run| -> (Vec<u32>, Vec<Event>) {
                let evs: Vec<Event> = run
                    .events
                    .iter()
                    .filter(|e| e.choice == choice)
                    .map(|e| e.event.clone())
                    .collect();
                let ids = evs
                    .iter()
                    .flat_map(|e| match e {
                        Event::Tokens { ids, .. } => ids.clone(),
                        _ => vec![],
                    })
                    .collect();
                (ids, evs)
            };
            let (first, evs) = of_choice(&runs[0]);
            assert_eq!(evs.iter().filter(|e| e.is_terminal()).count(), 1);
            assert!(matches!(evs.last(), Some(Event::Done { .. })), "{evs:?}");
            assert_eq!(first.len(), 12, "choice {choice}");
            assert_eq!(of_choice(&runs[1]).0, first, "seeded choice {choice} repeats");
        }
        let schema = serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
        let run = c
            .run(GenerateRequest {
                constraint: Some(Constraint::JsonSchema {
                    schema: schema.to_string(),
                }),
                requires: vec!["constraint".into()],
                temperature: Some(1.0),
                seed: Some(3),
                ..of("Answer:", 64)
            })
            .await;
        let doc: serde_json::Value = serde_json::from_str(&run.text())
            .unwrap_or_else(|e| panic!("{:?}: {e}", run.text()));
        assert!(doc["ok"].is_boolean(), "{doc}");
        // A long request cancelled once it decodes, beside a short one that finishes.
        let (id, sub) = c.start(of("Count:", 400)).await;
        let short = c.run(of("Hello", 8));
        let on = cancel_when(id.clone(), c.nc.clone(), |e, _| {
            matches!(e, Event::Tokens { .. })
        });
        let cancelled = Client::finish(id, sub, on);
        let (cancelled, short) = futures::join!(cancelled, short);
        assert!(
            matches!(cancelled.last(), Event::Error { error } if error.class == ErrorClass::Cancelled),
            "{:?}",
            cancelled.last()
        );
        assert!(cancelled.tokens().len() < 400);
        assert!(matches!(short.last(), Event::Done { .. }), "{:?}", short.last());
    });
}
