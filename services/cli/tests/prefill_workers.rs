//! Prefill workers, end to end through a real nats-server: a decode worker
//! (`worker.role = decode`) has its prompts prefilled by a prefill worker (`prefill`), chunk by
//! chunk, and decodes them with the same greedy tokens as one worker alone; a cancelled request
//! frees both sides; a prefill worker that dies leaves its requests to be prefilled by the decode
//! worker itself, never hanging. And `llmq up --prefill-workers 1` starts such a stack.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use llmq_protocol::*;

mod common;

use common::client::*;
use common::*;

const LONG: &str = "Streams of tokens flow through queues, schedulers and caches. ";

/// Small whole chunks (not in shares of layers): a prompt takes many grants.
const CHUNKS: [(&str, &str); 3] = [
    ("LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS", "16"),
    ("LLMQ__SCHEDULER__IDLE_PREFILL_CHUNK_TOKENS", "16"),
    ("LLMQ__SCHEDULER__PREFILL_CHUNK_STAGES", "1"),
];

/// The latest heartbeat of each worker, once every role in `roles` has been heard.
async fn statuses(c: &Client, roles: &[WorkerRole]) -> HashMap<WorkerRole, WorkerStatus> {
    let mut sub = c.nc.subscribe(subjects::WORKER_STATUS_ALL).await.unwrap();
    let mut seen = HashMap::new();
    let until = Instant::now() + Duration::from_secs(120);
    while !roles.iter().all(|r| seen.contains_key(r)) {
        assert!(
            Instant::now() < until,
            "heartbeats of {roles:?} within 120 s: {seen:?}"
        );
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
            let s: WorkerStatus = decode(&m.payload).unwrap();
            seen.insert(s.role, s);
        }
    }
    seen
}

/// A stack whose one job-taking worker decodes and has a prefill worker; returns it with the
/// prefill worker's index.
fn split_stack(extra: &[(&str, &str)]) -> (Stack, usize) {
    split_stack_of(&fixture(), extra)
}

/// `split_stack` serving `model` (a path).
fn split_stack_of(model: &str, extra: &[(&str, &str)]) -> (Stack, usize) {
    let mut stack = Stack::nats_for(model);
    stack.spawn("intake", &[]);
    let with = |role: &'static str| -> Vec<(&str, &str)> {
        CHUNKS
            .iter()
            .copied()
            .chain(extra.iter().copied())
            .chain([("LLMQ__WORKER__ROLE", role)])
            .collect()
    };
    stack.spawn("worker", &with("decode"));
    let prefill = stack.spawn("worker", &with("prefill"));
    (stack, prefill)
}

#[test]
fn a_prompt_prefilled_by_a_prefill_worker_decodes_as_on_one_worker() {
    prefilled_remotely_decodes_as_on_one_worker(&fixture(), &[], true);
}

#[test]
fn the_kv_comes_over_nats_where_the_decoder_offers_no_direct_connection() {
    prefilled_remotely_decodes_as_on_one_worker(
        &fixture(),
        &[("LLMQ__WORKER__KV_LISTEN", "off")],
        false,
    );
}

/// The hybrid families' chunks carry their recurrent layers' states after the chunk beside the
/// attention layers' keys and values, on the direct connection and in NATS pieces.
#[test]
fn hybrid_models_prefilled_by_a_prefill_worker_decode_as_on_one_worker() {
    for name in ["tiny-qwen35", "tiny-lfm2"] {
        let model = fixture_path(name);
        prefilled_remotely_decodes_as_on_one_worker(&model, &[], true);
    }
    prefilled_remotely_decodes_as_on_one_worker(
        &fixture_path("tiny-qwen35"),
        &[("LLMQ__WORKER__KV_LISTEN", "off")],
        false,
    );
}

fn fixture_path(name: &str) -> String {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .canonicalize()
        .unwrap()
        .display()
        .to_string()
}

/// Prompts prefilled by the prefill worker get the same greedy tokens as in one process; the
/// KV comes on the direct connection (`direct`: no piece of it on NATS) or in NATS pieces.
fn prefilled_remotely_decodes_as_on_one_worker(model: &str, extra: &[(&str, &str)], direct: bool) {
    let prompts: Vec<String> = (1..=3)
        .map(|i| format!("{i}: {}", LONG.repeat(3 + 2 * i)))
        .collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| local_greedy_of(model, p, 12))
        .collect();
    let req = |p: &str, n| GenerateRequest {
        model: model.to_string(),
        ..req(p, n)
    };
    let (stack, _) = split_stack_of(model, extra);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let s = statuses(&c, &[WorkerRole::Decode, WorkerRole::Prefill]).await;
        let mut pieces =
            c.nc.subscribe(subjects::prefill_kv(&s[&WorkerRole::Decode].worker_id))
                .await
                .unwrap();
        let on_nats = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = on_nats.clone();
        tokio::spawn(async move {
            while let Some(m) = pieces.next().await {
                if matches!(
                    decode::<prefill::PrefillReply>(&m.payload),
                    Ok(prefill::PrefillReply::Kv(_))
                ) {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        // The decode worker hears the prefill worker's heartbeats (200 ms apart).
        tokio::time::sleep(Duration::from_millis(600)).await;
        let one = c.run(req(&prompts[0], 12)).await;
        assert_eq!(
            one.tokens(),
            want[0],
            "the same greedy tokens as in-process generation"
        );
        let progress = one
            .events
            .iter()
            .filter(|e| matches!(e.event, Event::PrefillProgress { .. }))
            .count();
        assert!(progress >= 3, "prefilled in many chunks: {:?}", one.events);
        // Three at once: their chunks are granted one at a time and interleave.
        let runs = futures::future::join_all(prompts.iter().map(|p| c.run(req(p, 12)))).await;
        for (run, want) in runs.iter().zip(&want) {
            assert_eq!(&run.tokens(), want);
            assert!(matches!(run.last(), Event::Done { .. }), "{:?}", run.last());
        }
        // The KV came from the prefill worker.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let s = statuses(&c, &[WorkerRole::Decode, WorkerRole::Prefill]).await;
        let (sent, received) = (
            s[&WorkerRole::Prefill].kv_bytes_sent,
            s[&WorkerRole::Decode].kv_bytes_received,
        );
        assert!(
            received > 0 && received == sent,
            "KV sent {sent}, received {received}"
        );
        let on_nats = on_nats.load(std::sync::atomic::Ordering::Relaxed);
        if direct {
            assert_eq!(on_nats, 0, "the KV took the direct connection, not NATS");
        } else {
            assert!(on_nats > 0, "the KV came in NATS pieces");
        }
    });
}

#[test]
fn a_cancelled_request_frees_both_workers() {
    // A slow prefill (one token a chunk), so the cancel lands mid-prompt.
    let (stack, _) = split_stack(&[
        ("LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS", "1"),
        ("LLMQ__SCHEDULER__IDLE_PREFILL_CHUNK_TOKENS", "1"),
    ]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        statuses(&c, &[WorkerRole::Decode, WorkerRole::Prefill]).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (id, sub) = c.start(req(&LONG.repeat(20), 50)).await;
        let on = cancel_when(
            id.clone(),
            c.nc.clone(),
            |e, _| matches!(e, Event::PrefillProgress { done, .. } if *done >= 20),
        );
        let run = Client::finish(id, sub, on).await;
        assert!(
            matches!(run.last(), Event::Error { error } if error.class == ErrorClass::Cancelled),
            "{:?}",
            run.last()
        );
        assert!(run.tokens().is_empty(), "cancelled mid-prefill");
        // Both sides let it go: no sequence on the decode worker, no session on the prefill one.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let s = statuses(&c, &[WorkerRole::Decode, WorkerRole::Prefill]).await;
        let (d, p) = (&s[&WorkerRole::Decode], &s[&WorkerRole::Prefill]);
        assert_eq!(
            (d.active_streams, d.kv_bytes_used - d.prefix_bytes),
            (0, 0),
            "{d:?}"
        );
        assert!(p.kv_bytes_sent > 0, "it was prefilled remotely: {p:?}");
        assert_eq!(
            p.active_streams, 0,
            "the prefill worker dropped its session: {p:?}"
        );
    });
}

#[test]
fn a_dead_prefill_worker_leaves_its_prompts_to_the_decode_worker() {
    let prompt = LONG.repeat(8);
    let want = local_greedy(&prompt, 12);
    let (mut stack, prefill) = split_stack(&[("LLMQ__WORKER__REMOTE_PREFILL_TIMEOUT_MS", "3000")]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        statuses(&c, &[WorkerRole::Decode, WorkerRole::Prefill]).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        // Killed just before the request: the decode worker still counts it as live, grants it
        // a chunk that nobody answers, then sees it silent and prefills the prompt itself.
        stack.kill(prefill);
        let t = Instant::now();
        let run = c.run(req(&prompt, 12)).await;
        assert_eq!(run.tokens(), want, "the same tokens, prefilled locally");
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no hang: {:?}",
            t.elapsed()
        );
        // With no prefill worker left, the next prompt is prefilled here from the start.
        let again = c.run(req(&format!("again {prompt}"), 12)).await;
        assert_eq!(again.tokens(), local_greedy(&format!("again {prompt}"), 12));
        let s = statuses(&c, &[WorkerRole::Decode]).await;
        assert_eq!(
            s[&WorkerRole::Decode].kv_bytes_received,
            0,
            "nothing came from the dead worker"
        );
    });
}

#[test]
fn llmq_up_starts_prefill_workers() {
    let dir = std::env::temp_dir().join(format!("llmq-up-prefill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = std::fs::File::create(dir.join("out")).unwrap();
    let mut up = std::process::Command::new(env!("CARGO_BIN_EXE_llmq"))
        .args(["up", "--model", &fixture(), "--prefill-workers", "1"])
        .env("LLMQ__WORKER__HEARTBEAT_MS", "200")
        .env("LLMQ_LOG", "warn")
        .stdout(out)
        .spawn()
        .unwrap();
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            extern "C" {
                fn kill(pid: i32, sig: i32) -> i32;
            }
            // SAFETY: kill(2) on our own child's pid; `up` then stops what it started.
            unsafe { kill(self.0.id() as i32, 2) };
            let _ = self.0.wait();
        }
    }
    let until = Instant::now() + Duration::from_secs(120);
    let url = loop {
        let text = std::fs::read_to_string(dir.join("out")).unwrap_or_default();
        if let Some(url) = text.lines().find_map(|l| l.strip_prefix("LLMQ_NATS_URL=")) {
            break url.to_string();
        }
        assert!(matches!(up.try_wait(), Ok(None)), "llmq up exited");
        assert!(Instant::now() < until, "llmq up did not start within 120 s");
        std::thread::sleep(Duration::from_millis(100));
    };
    let up = Stop(up);
    rt().block_on(async {
        let c = Client::connect(&url).await;
        let s = statuses(&c, &[WorkerRole::Decode, WorkerRole::Prefill]).await;
        assert_eq!(s[&WorkerRole::Decode].model, s[&WorkerRole::Prefill].model);
        tokio::time::sleep(Duration::from_millis(600)).await;
        let prompt = LONG.repeat(4);
        let run = c.run(req(&prompt, 8)).await;
        assert_eq!(run.tokens(), local_greedy(&prompt, 8));
        let s = statuses(&c, &[WorkerRole::Prefill]).await;
        assert!(
            s[&WorkerRole::Prefill].kv_bytes_sent > 0,
            "{:?}",
            s[&WorkerRole::Prefill]
        );
    });
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
}
