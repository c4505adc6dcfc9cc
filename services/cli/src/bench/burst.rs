//! The burst scenario: streams decode at a steady pace, then long prompts arrive at once (and,
//! with `--short`, a few short ones half a second later); reports the streams' worst gap
//! against their steady one and when the newcomers got their first tokens.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::measure::{median, random_prompt as prompt, round};
use super::stack::{overhead, Client, Knobs, Seen};

pub(super) async fn burst(
    (mut c, mut rx): (Client, mpsc::UnboundedReceiver<Seen>),
    k: &Knobs,
) -> Result<Value> {
    // Active streams run until cancelled (2048 tokens outlast any burst measured here; a
    // larger cap would only inflate their KV reservations).
    let long = (c.status().await?.context_tokens as usize)
        .saturating_sub(129)
        .clamp(1, 2048);
    let mut active = vec![];
    for i in 0..k.active {
        active.push(c.submit(&k.model, prompt(128, 3 + i as u64), long).await?);
    }
    // Warm up, then measure the steady gap over 40 tokens of every active stream; after the
    // burst, 40 more (the pace then tells whether the machine's own speed changed meanwhile:
    // a shared host's CPUs can run this work at different speeds from one second to the next).
    let mut seen = BurstSeen::new(k.active);
    let (mut status0, mut status1, mut after_from) = (None, None, 0);
    while let Some(s) = rx.recv().await {
        if s.terminal && s.stream < k.active {
            if seen.phase == Phase::After {
                break; // its token cap reached after the burst: the pace after is what was seen
            }
            bail!("an active stream ended early");
        }
        seen.record(&s);
        if seen.phase == Phase::Burst
            && seen.short_at.is_none()
            && k.short > 0
            && seen.burst_at.elapsed() >= Duration::from_millis(500)
        {
            seen.short_at = Some(Instant::now());
            for j in 0..k.short {
                seen.short_ids
                    .push(c.submit(&k.model, prompt(64, 500 + j as u64), 8).await?);
            }
        }
        let min = active
            .iter()
            .map(|i| seen.count.get(i).copied().unwrap_or(0))
            .min()
            .unwrap_or(0);
        if seen.phase == Phase::Burst
            && seen.first.len() == k.burst
            && seen.short_first.len() == k.short
        {
            seen.phase = Phase::After;
            after_from = min;
            status1 = Some(c.status().await?);
        } else if seen.phase == Phase::After && min >= after_from + 40 {
            break;
        } else if seen.phase == Phase::Warm && min >= 20 {
            seen.phase = Phase::Steady;
        } else if seen.phase == Phase::Steady && min >= 60 {
            seen.phase = Phase::Burst;
            status0 = Some(c.status().await?);
            seen.burst_at = Instant::now();
            for j in 0..k.burst {
                seen.burst_ids.push(
                    c.submit(&k.model, prompt(k.burst_tokens, 100 + j as u64), 8)
                        .await?,
                );
            }
        }
    }
    let status1 = match status1 {
        Some(s) => s,
        None => c.status().await?,
    };
    c.cancel_all().await?;
    let mut v = seen.report(k);
    if let Some(s0) = status0 {
        v.as_object_mut()
            .unwrap()
            .extend(overhead(&s0, &status1).as_object().unwrap().clone());
    }
    Ok(v)
}

/// The burst scenario's phases: warming up, the steady gap, the burst, the pace after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Warm,
    Steady,
    Burst,
    After,
}

/// What the burst scenario has seen: the active streams' gaps in each phase, and when the
/// burst's prompts and the short ones sent during it got their first tokens.
struct BurstSeen {
    active: usize,
    phase: Phase,
    last: HashMap<usize, Instant>,
    count: HashMap<usize, usize>,
    /// The active streams' gaps (ms) in the steady phase, during the burst, and after it.
    steady: Vec<f64>,
    during: Vec<f64>,
    after: Vec<f64>,
    burst_at: Instant,
    burst_ids: Vec<usize>,
    first: HashMap<usize, f64>,
    short_at: Option<Instant>,
    short_ids: Vec<usize>,
    short_first: HashMap<usize, f64>,
}

impl BurstSeen {
    fn new(active: usize) -> Self {
        BurstSeen {
            active,
            phase: Phase::Warm,
            last: HashMap::new(),
            count: HashMap::new(),
            steady: vec![],
            during: vec![],
            after: vec![],
            burst_at: Instant::now(),
            burst_ids: vec![],
            first: HashMap::new(),
            short_at: None,
            short_ids: vec![],
            short_first: HashMap::new(),
        }
    }

    fn record(&mut self, s: &Seen) {
        if s.stream < self.active && s.tokens > 0 {
            if let Some(p) = self.last.insert(s.stream, s.at) {
                let gap = (s.at - p).as_secs_f64() * 1000.0;
                match self.phase {
                    Phase::Warm => {}
                    Phase::Steady => self.steady.push(gap),
                    Phase::Burst => self.during.push(gap),
                    Phase::After => self.after.push(gap),
                }
            }
            *self.count.entry(s.stream).or_default() += 1;
        } else if self.burst_ids.contains(&s.stream)
            && s.tokens > 0
            && !self.first.contains_key(&s.stream)
        {
            self.first
                .insert(s.stream, (s.at - self.burst_at).as_secs_f64());
        } else if let Some(at) = self
            .short_at
            .filter(|_| self.short_ids.contains(&s.stream) && s.tokens > 0)
        {
            self.short_first
                .entry(s.stream)
                .or_insert((s.at - at).as_secs_f64());
        }
    }

    fn report(&self, k: &Knobs) -> Value {
        let steady = median(self.steady.clone());
        let worst = self.during.iter().copied().fold(0.0, f64::max);
        let mut v = json!({
            "scenario": "burst", "active_streams": k.active, "burst_prompts": k.burst,
            "burst_tokens": k.burst_tokens, "prefill_step": k.chunk.map_or_else(|| "worker default".into(), Value::from), "interleave": k.interleave,
            "steady_gap_ms": round(steady, 2), "worst_gap_ms": round(worst, 2),
            "worst_over_steady": round(worst / steady, 1),
            "last_burst_first_token_s": round(self.first.values().copied().fold(0.0, f64::max), 3),
            "steady_gap_after_ms": round(median(self.after.clone()), 2),
        });
        if k.short > 0 {
            v["short_prompts"] = k.short.into();
            v["last_short_first_token_s"] =
                round(self.short_first.values().copied().fold(0.0, f64::max), 3).into();
        }
        v
    }
}
