//! The gateway scenario: requests alternately through NATS and through the HTTP gateway
//! (streamed completions), alone and then all at once: what the gateway adds to the time to
//! first token and to the gap between tokens.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::measure::{median, random_prompt as prompt, round};
use super::stack::{Client, Knobs, Seen};

/// Streams of the gateway scenario that go through HTTP are numbered from here.
const HTTP_STREAMS: usize = 1 << 20;

/// Submits one request through the gateway; its token chunks feed the channel as stream `stream`.
fn http_submit(
    c: &Client,
    addr: &str,
    stream: usize,
    model: &str,
    ids: Vec<u32>,
    max_tokens: usize,
) {
    use llmq_gateway::client as http;
    let body = json!({ "model": model, "prompt": ids, "max_tokens": max_tokens, "stream": true, "ignore_eos": true }).to_string();
    let (tx, addr) = (c.tx.clone(), addr.to_string());
    tokio::spawn(async move {
        let sent = http::stream(&addr, "/v1/completions", &body, |at, line| {
            let terminal = line == "data: [DONE]";
            let token = line.strip_prefix("data: {").is_some()
                && serde_json::from_str::<Value>(&line[6..]).is_ok_and(|v| {
                    v["choices"][0]["text"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
                });
            if terminal || token {
                let _ = tx.send(Seen {
                    stream,
                    at,
                    tokens: usize::from(!terminal),
                    terminal,
                    cached: None,
                    prompt: None,
                });
            }
        })
        .await;
        if !matches!(sent, Ok(200)) {
            eprintln!("llmq bench: HTTP stream {stream} failed: {sent:?}");
            let _ = tx.send(Seen {
                stream,
                at: Instant::now(),
                tokens: 0,
                terminal: true,
                cached: None,
                prompt: None,
            });
        }
    });
}

/// Time to first token of requests run one at a time, alternately through NATS and the gateway
/// (nothing else running: the difference is what the gateway adds); then the inter-token gaps
/// of `streams` concurrent streams, half through each path.
pub(super) async fn gateway(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
) -> Result<Value> {
    let addr = c
        .gateway
        .clone()
        .ok_or_else(|| anyhow::anyhow!("no gateway in this stack"))?;
    let t = Instant::now();
    while llmq_gateway::client::request(&addr, "GET", "/health", None)
        .await
        .map(|r| r.status)
        .unwrap_or(0)
        != 200
    {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("the gateway did not become healthy");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    // 1. one at a time
    const ALONE: usize = 10;
    let mut ttft: [Vec<f64>; 2] = Default::default();
    for i in 0..2 * ALONE {
        let (via, ids) = (i % 2, prompt(k.prompt_tokens, 200 + i as u64));
        let at = Instant::now();
        let stream = if via == 0 {
            c.submit(&k.model, ids, 2).await?
        } else {
            http_submit(&c, &addr, HTTP_STREAMS + i, &k.model, ids, 2);
            HTTP_STREAMS + i
        };
        let mut first = None;
        while let Some(s) = rx.recv().await {
            if s.stream == stream && s.tokens > 0 {
                first.get_or_insert(s.at);
            }
            if s.stream == stream && s.terminal {
                break;
            }
        }
        // The first pair warms up both paths.
        if let (Some(f), true) = (first, i >= 2) {
            ttft[via].push((f - at).as_secs_f64() * 1000.0);
        }
    }
    // 2. all at once
    let mut last: HashMap<usize, Instant> = HashMap::new();
    let mut gaps: [Vec<f64>; 2] = Default::default();
    for i in 0..k.streams {
        let ids = prompt(k.prompt_tokens, 300 + i as u64);
        if i % 2 == 0 {
            c.submit(&k.model, ids, k.output_tokens).await?;
        } else {
            http_submit(
                &c,
                &addr,
                2 * HTTP_STREAMS + i,
                &k.model,
                ids,
                k.output_tokens,
            );
        }
    }
    let mut ended = 0;
    while let Some(s) = rx.recv().await {
        if s.tokens > 0 {
            if let Some(p) = last.insert(s.stream, s.at) {
                gaps[usize::from(s.stream >= HTTP_STREAMS)].push((s.at - p).as_secs_f64() * 1000.0);
            }
        }
        if s.terminal {
            ended += 1;
            if ended == k.streams {
                break;
            }
        }
    }
    let (nt, gt, ni, gi) = (
        median(ttft[0].clone()),
        median(ttft[1].clone()),
        median(gaps[0].clone()),
        median(gaps[1].clone()),
    );
    Ok(json!({
        "scenario": "gateway", "streams": k.streams, "prompt_tokens": k.prompt_tokens, "output_tokens": k.output_tokens,
        "alone_requests_per_path": ALONE - 1,
        "nats_median_ttft_ms": round(nt, 2), "gateway_median_ttft_ms": round(gt, 2), "gateway_added_ttft_ms": round(gt - nt, 2),
        "nats_median_itl_ms": round(ni, 3), "gateway_median_itl_ms": round(gi, 3), "gateway_added_itl_ms": round(gi - ni, 3),
        "nats_mean_itl_ms": round(mean(&gaps[0]), 3), "gateway_mean_itl_ms": round(mean(&gaps[1]), 3),
        "token_gaps": [gaps[0].len(), gaps[1].len()],
    }))
}
