//! `llmq bench batch` and `llmq bench static`: requests submitted together, their output rate
//! while all decode; and arrivals spread over the first ones' decode, with continuous and with
//! static batching.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Result;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::measure::{random_prompt as prompt, round};
use super::stack::{kv_room, overhead, Client, Knobs, Seen};

/// `seed`: the first stream's prompt seed (the others follow it), so that a second batch in the
/// same stack can have prompts of its own (none of them found in the prefix cache).
pub(super) async fn batch(
    c: &mut Client,
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    k: &Knobs,
    seed: u64,
) -> Result<Value> {
    let t0 = Instant::now();
    let status0 = c.status().await?;
    for i in 0..k.streams {
        c.submit(
            &k.model,
            prompt(k.prompt_tokens, seed + i as u64),
            k.output_tokens,
        )
        .await?;
    }
    let (mut produced, mut ended) = (0usize, 0usize);
    let mut started: HashMap<usize, Instant> = HashMap::new();
    let mut events: Vec<(Instant, usize)> = vec![];
    let mut first_end = None;
    while let Some(s) = rx.recv().await {
        if s.tokens > 0 {
            produced += s.tokens;
            started.entry(s.stream).or_insert(s.at);
            events.push((s.at, s.tokens));
        }
        if s.terminal {
            ended += 1;
            first_end.get_or_insert(s.at);
            if ended == k.streams {
                break;
            }
        }
    }
    let total = t0.elapsed().as_secs_f64();
    let status1 = c.status().await?;
    // Steady state: every stream has started and none has ended.
    let all_started = started.values().max().copied();
    let steady = match (all_started, first_end) {
        (Some(a), Some(e)) if e > a => {
            let n: usize = events
                .iter()
                .filter(|(t, _)| *t > a && *t <= e)
                .map(|x| x.1)
                .sum();
            n as f64 / (e - a).as_secs_f64()
        }
        _ => f64::NAN,
    };
    let mut v = json!({
        "scenario": "batch", "streams": k.streams, "prompt_tokens": k.prompt_tokens,
        "output_tokens": k.output_tokens, "wall_s": round(total, 3),
        "overall_output_tokens_per_s": round(produced as f64 / total, 1),
        "steady_output_tokens_per_s": round(steady, 1),
    });
    // Heartbeats are per worker: the overhead split is only meaningful with one.
    if k.workers == 1 {
        v.as_object_mut()
            .unwrap()
            .extend(overhead(&status0, &status1).as_object().unwrap().clone());
        v.as_object_mut()
            .unwrap()
            .extend(kv_room(&status0, k).as_object().unwrap().clone());
    }
    v.as_object_mut()
        .unwrap()
        .insert("workers".into(), k.workers.into());
    v.as_object_mut().unwrap().insert(
        "requests_per_worker".into(),
        json!(c.ended_per_worker(k.workers).await?),
    );
    Ok(v)
}

/// Half the requests at once, the other half one by one while the first half decodes.
pub(super) async fn arrivals(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
) -> Result<Value> {
    let n = k.streams.max(2);
    let mut submitted: HashMap<usize, Instant> = HashMap::new();
    for i in 0..n / 2 {
        let at = Instant::now();
        submitted.insert(
            c.submit(
                &k.model,
                prompt(k.prompt_tokens, 50 + i as u64),
                k.output_tokens,
            )
            .await?,
            at,
        );
    }
    let mut next = n / 2;
    let mut ttft: HashMap<usize, f64> = HashMap::new();
    let mut ended = 0;
    let mut tokens_seen = 0usize;
    while let Some(s) = rx.recv().await {
        if s.tokens > 0 && !ttft.contains_key(&s.stream) {
            ttft.insert(
                s.stream,
                (s.at - submitted[&s.stream]).as_secs_f64() * 1000.0,
            );
        }
        tokens_seen += s.tokens;
        // A late arrival every output_tokens/4 tokens of the first wave.
        if next < n && tokens_seen >= (next - n / 2 + 1) * (k.output_tokens / 4).max(1) {
            let at = Instant::now();
            submitted.insert(
                c.submit(
                    &k.model,
                    prompt(k.prompt_tokens, 50 + next as u64),
                    k.output_tokens,
                )
                .await?,
                at,
            );
            next += 1;
        }
        if s.terminal {
            ended += 1;
            if ended == n {
                break;
            }
        }
    }
    let mean = ttft.values().sum::<f64>() / ttft.len().max(1) as f64;
    Ok(json!({ "mean_ttft_ms": mean }))
}
