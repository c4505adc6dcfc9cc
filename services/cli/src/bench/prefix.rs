//! `llmq bench prefix`: a long prefix, then requests resending it one at a time: time to first
//! token with the prefix cache and without it.

use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::measure::{median, random_prompt as prompt};
use super::stack::{Client, Knobs, Seen};

/// One request to fill the cache with the prefix, then `streams` requests one after another,
/// each the prefix plus its own suffix (or none): their times to first token and cached tokens.
pub(super) async fn prefix(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
) -> Result<Value> {
    let shared = prompt(k.prefix_tokens, 4242);
    let (mut ttft, mut cached) = (vec![], vec![]);
    for i in 0..=k.streams {
        let p = [&shared[..], &prompt(k.suffix_tokens, 9000 + i as u64)].concat();
        let at = Instant::now();
        let idx = c.submit(&k.model, p, 1).await?;
        let mut first = None;
        while let Some(s) = rx.recv().await {
            if s.stream != idx {
                continue;
            }
            if s.tokens > 0 {
                first.get_or_insert(s.at);
            }
            if s.terminal {
                match (first, s.cached) {
                    (Some(f), Some(n)) if i > 0 => {
                        ttft.push((f - at).as_secs_f64() * 1000.0);
                        cached.push(n as f64);
                    }
                    (Some(_), Some(_)) => {}
                    _ => bail!("prefix request {i} failed"),
                }
                break;
            }
        }
    }
    Ok(json!({ "median_ttft_ms": median(ttft), "median_cached": median(cached) }))
}
