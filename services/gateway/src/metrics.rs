//! The gateway's Prometheus metrics: what it saw itself (requests by outcome, time to first
//! token, inter-token latency) and what the workers' heartbeats say (queue depth, active
//! streams, KV bytes, prefix-cache hit rate, bytes, reused tokens and evictions, requests
//! ended), rendered in the text exposition format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Instant;

use llmq_protocol::workers::WorkerTable;

/// Upper bounds of the latency buckets, seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if let Some(i) = BUCKETS.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in BUCKETS.iter().zip(self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(String, &'static str), u64>,
    ttft: Histogram,
    itl: Histogram,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

/// Escapes a label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// A request ended: `outcome` is `ok`, `cancelled` (the client went away) or an error code.
    pub fn request(&self, endpoint: &str, outcome: &'static str) {
        *self
            .inner
            .lock()
            .unwrap()
            .requests
            .entry((endpoint.to_string(), outcome))
            .or_default() += 1;
    }

    pub fn first_token(&self, seconds: f64) {
        self.inner.lock().unwrap().ttft.observe(seconds);
    }

    pub fn inter_token(&self, seconds: f64) {
        self.inner.lock().unwrap().itl.observe(seconds);
    }

    pub fn render(&self, workers: &WorkerTable) -> String {
        let mut out = String::new();
        {
            let m = self.inner.lock().unwrap();
            out.push_str("# HELP llmq_gateway_requests_total Requests by endpoint and outcome.\n# TYPE llmq_gateway_requests_total counter\n");
            for ((endpoint, outcome), n) in &m.requests {
                let _ = writeln!(
                    out,
                    "llmq_gateway_requests_total{{endpoint=\"{}\",outcome=\"{outcome}\"}} {n}",
                    label(endpoint)
                );
            }
            m.ttft.render(
                &mut out,
                "llmq_gateway_time_to_first_token_seconds",
                "From the HTTP request to its first token.",
            );
            m.itl.render(
                &mut out,
                "llmq_gateway_inter_token_latency_seconds",
                "Between consecutive token chunks of a stream.",
            );
        }
        let gauges = [
            WorkerSeries::new(
                "llmq_worker_queued_requests",
                "Requests waiting for admission or prefill.",
                |s| s.queued_requests as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_queued_prefill_tokens",
                "Prompt tokens still to prefill.",
                |s| s.queued_prefill_tokens as f64,
            ),
            WorkerSeries::new("llmq_worker_active_streams", "Sequences decoding.", |s| {
                s.active_streams as f64
            }),
            WorkerSeries::new(
                "llmq_worker_kv_bytes_used",
                "KV cache bytes held (prefix cache included).",
                |s| s.kv_bytes_used as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_kv_bytes_free",
                "KV budget not reserved by running requests.",
                |s| s.kv_bytes_free as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_prefix_cache_hit_rate",
                "Prompt tokens reused over prompt tokens looked up.",
                |s| s.prefix_hit_rate,
            ),
            WorkerSeries::new(
                "llmq_worker_prefix_cache_bytes",
                "Bytes the prefix cache holds.",
                |s| s.prefix_bytes as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_kv_blocks",
                "Blocks of the worker's KV pool.",
                |s| s.kv_blocks_total as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_kv_blocks_used",
                "Blocks of the KV pool running requests hold.",
                |s| s.kv_blocks_used as f64,
            ),
        ];
        let counters = [
            WorkerSeries::new(
                "llmq_worker_requests_ended_total",
                "Requests the worker has ended (done or error).",
                |s| s.ended_requests as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_prefix_cache_reused_tokens_total",
                "Prompt tokens served from the prefix cache.",
                |s| s.prefix_reused_tokens as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_preemptions_total",
                "Requests preempted because the KV pool ran out (prefilled again later).",
                |s| s.preemptions as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_prefix_cache_evictions_total",
                "Prefix-cache entries evicted.",
                |s| s.prefix_evictions as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_kv_bytes_sent_total",
                "Prompt KV bytes a prefill worker sent to decode workers.",
                |s| s.kv_bytes_sent as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_kv_bytes_sent_direct_total",
                "Of those, bytes sent on direct connections (worker.kv_listen), not over NATS.",
                |s| s.kv_bytes_sent_direct as f64,
            ),
            WorkerSeries::new(
                "llmq_worker_kv_bytes_received_total",
                "Prompt KV bytes a decode worker received from prefill workers.",
                |s| s.kv_bytes_received as f64,
            ),
        ];
        let mut live: Vec<&llmq_protocol::WorkerStatus> = workers.live().collect();
        live.sort_by(|a, b| a.worker_id.cmp(&b.worker_id));
        // Always present, so that an alert can fire on zero (the per-worker series vanish with
        // their workers).
        let _ = writeln!(
            out,
            "# HELP llmq_gateway_live_workers Workers heard from lately (any model, any role).\n# TYPE llmq_gateway_live_workers gauge\nllmq_gateway_live_workers {}",
            live.len()
        );
        let kinds = gauges
            .iter()
            .map(|g| (g, "gauge"))
            .chain(counters.iter().map(|c| (c, "counter")));
        for (series, kind) in kinds {
            let (name, help) = (series.name, series.help);
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for s in &live {
                let role = match s.role {
                    llmq_protocol::WorkerRole::Both => "both",
                    llmq_protocol::WorkerRole::Prefill => "prefill",
                    llmq_protocol::WorkerRole::Decode => "decode",
                };
                let _ = writeln!(
                    out,
                    "{name}{{worker=\"{}\",model=\"{}\",role=\"{role}\"}} {}",
                    label(&s.worker_id),
                    label(&s.model),
                    (series.value)(s)
                );
            }
        }
        out
    }
}

/// Tracks first-token and inter-token times of one request into the metrics.
pub struct Clock {
    pub started: Instant,
    pub last: Option<Instant>,
}

impl Clock {
    pub fn tokens(&mut self, m: &Metrics) {
        let now = Instant::now();
        match self.last {
            None => m.first_token((now - self.started).as_secs_f64()),
            Some(prev) => m.inter_token((now - prev).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

/// One per-worker series of /metrics: its name, help text, and its value in a heartbeat.
struct WorkerSeries {
    name: &'static str,
    help: &'static str,
    value: fn(&llmq_protocol::WorkerStatus) -> f64,
}

impl WorkerSeries {
    const fn new(
        name: &'static str,
        help: &'static str,
        value: fn(&llmq_protocol::WorkerStatus) -> f64,
    ) -> Self {
        WorkerSeries { name, help, value }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_worker_gauges() {
        let m = Metrics::default();
        m.request("chat", "ok");
        m.request("chat", "ok");
        m.request("completions", "model_not_found");
        m.first_token(0.003);
        m.inter_token(0.02);
        let mut t = WorkerTable::new(std::time::Duration::from_secs(5));
        t.update(llmq_protocol::WorkerStatus {
            worker_id: "w1".into(),
            model: "m".into(),
            queued_requests: 3,
            prefix_hit_rate: 0.5,
            ..Default::default()
        });
        let text = m.render(&t);
        assert!(
            text.contains("llmq_gateway_requests_total{endpoint=\"chat\",outcome=\"ok\"} 2"),
            "{text}"
        );
        assert!(text.contains("outcome=\"model_not_found\"} 1"));
        assert!(text.contains("llmq_gateway_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(text.contains("llmq_gateway_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("llmq_gateway_inter_token_latency_seconds_count 1"));
        assert!(text.contains("llmq_gateway_live_workers 1"), "{text}");
        assert!(
            text.contains("llmq_worker_queued_requests{worker=\"w1\",model=\"m\",role=\"both\"} 3")
        );
        assert!(text.contains(
            "llmq_worker_prefix_cache_hit_rate{worker=\"w1\",model=\"m\",role=\"both\"} 0.5"
        ));
        assert!(text.contains("# TYPE llmq_worker_prefix_cache_evictions_total counter"));
    }
}
