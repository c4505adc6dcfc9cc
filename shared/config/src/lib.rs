//! Typed configuration for every llmq service, loaded in layers: built-in defaults, then a TOML
//! file (`--config FILE` or `LLMQ_CONFIG`), then environment variables named after the keys:
//! `LLMQ__SCHEDULER__PREFILL_CHUNK_TOKENS=512`, `LLMQ__NATS__URL=nats://host:4222`.
//! `load` validates the result; a bad value is an error naming the key.

use std::path::Path;

use llmq_protocol::WorkerRole;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("configuration: {key} = {value}: {why}")]
    Invalid {
        key: &'static str,
        value: String,
        why: &'static str,
    },
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub nats: NatsSettings,
    pub worker: WorkerSettings,
    pub scheduler: SchedulerSettings,
    pub intake: IntakeSettings,
    pub prefix_cache: PrefixCacheSettings,
    pub gateway: GatewaySettings,
}

/// The OpenAI-compatible HTTP gateway.
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewaySettings {
    /// Address to listen on (port 0: one the system picks).
    pub listen: String,
    /// A worker silent for this long no longer counts for /health and /v1/models.
    pub worker_timeout_ms: u64,
    /// Once listening, the gateway writes the address it listens on here (the port the system
    /// picked, with port 0): how a harness finds it without racing for a free port.
    pub address_file: Option<std::path::PathBuf>,
    /// With keys set, every /v1 request needs `Authorization: Bearer <one of them>` (401
    /// otherwise). From the environment: LLMQ__GATEWAY__API_KEYS=key1,key2. Never printed.
    pub api_keys: Vec<String>,
    /// Whether /health and /metrics need a key too (when keys are set).
    pub keys_for_health_and_metrics: bool,
    /// A request's stream that nothing has shown alive for this long (no event, and intake
    /// could not say its job is still waiting or running) ends with `worker_lost`.
    pub silent_stream_timeout_ms: u64,
}

impl std::fmt::Debug for GatewaySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewaySettings")
            .field("listen", &self.listen)
            .field("worker_timeout_ms", &self.worker_timeout_ms)
            .field("address_file", &self.address_file)
            .field("api_keys", &format_args!("{} keys", self.api_keys.len()))
            .field(
                "keys_for_health_and_metrics",
                &self.keys_for_health_and_metrics,
            )
            .field("silent_stream_timeout_ms", &self.silent_stream_timeout_ms)
            .finish()
    }
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            listen: "127.0.0.1:8000".into(),
            worker_timeout_ms: 3000,
            address_file: None,
            api_keys: vec![],
            keys_for_health_and_metrics: false,
            silent_stream_timeout_ms: 30_000,
        }
    }
}

#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsSettings {
    /// May carry credentials (nats://user:pass@host): never printed in full. A user's replies
    /// and streams go to its own inboxes, `_INBOX.<user>`; `tls://` requires TLS.
    pub url: String,
    /// A CA certificate (PEM) to check the server's against; requires TLS.
    pub ca_file: Option<std::path::PathBuf>,
}

impl Default for NatsSettings {
    fn default() -> Self {
        NatsSettings {
            url: "nats://127.0.0.1:4222".into(),
            ca_file: None,
        }
    }
}

impl std::fmt::Debug for NatsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = match self.url.split_once('@') {
            Some((scheme_creds, host)) => {
                let scheme = scheme_creds.split("://").next().unwrap_or("nats");
                format!("{scheme}://***@{host}")
            }
            None => self.url.clone(),
        };
        f.debug_struct("NatsSettings")
            .field("url", &shown)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerSettings {
    /// Defaults to a random id at start.
    pub id: Option<String>,
    /// A known model name or a path.
    pub model: String,
    /// f32, f16 or bf16; default: f32 on CPU, bf16 on GPU.
    pub dtype: Option<String>,
    /// Quantize full-precision weights at load to this many bits (2, 3, 4, 5, 6 or 8).
    pub quantize: Option<i32>,
    /// Elements per scale and bias when quantizing at load (32, 64 or 128).
    pub quantize_group_size: i32,
    /// Keep quantized weights (a quantized checkpoint's, or `quantize`'s) quantized on the
    /// device. Default: yes on a GPU or with `quantize`; no on a CPU, where dense f32 is faster.
    pub keep_quantized: Option<bool>,
    /// The GPU this worker owns (its index, exported as CUDA_VISIBLE_DEVICES before MLX starts);
    /// default: whatever the environment gives.
    pub device: Option<u32>,
    pub heartbeat_ms: u64,
    /// Jobs a worker holds (running and queued) before it stops fetching more.
    pub max_queued: usize,
    /// A job not acknowledged for this long (its worker died) is handed to another worker,
    /// which ends it with `worker_lost` (so a dead worker's streams end within about this time);
    /// running jobs are kept alive with progress acks six times per period.
    pub ack_wait_ms: u64,
    /// Prompt length of the warm-up's long dummy requests (run before taking jobs, so that MLX
    /// has planned its kernels for the cache sizes up to this); default: 8192 on a GPU,
    /// `prefill_chunk_tokens` and a few on a CPU; 0: no warm-up.
    pub warm_up_tokens: Option<usize>,
    /// MLX's memory limit in bytes: past it (device memory in use plus MLX's cache of freed
    /// buffers), a new buffer first frees cached ones. Default: MLX's own (80% of the GPU's).
    pub mlx_memory_limit_bytes: Option<u64>,
    /// Most bytes MLX keeps in its cache of freed buffers for reuse. Default: MLX's own (the
    /// memory limit); 0 frees every buffer as soon as it is dropped.
    pub mlx_cache_limit_bytes: Option<u64>,
    /// On a CPU: host memory faulted in at start and kept for MLX's buffers (freed buffers are
    /// then reused for any size, and MLX's own cache is off unless `mlx_cache_limit_bytes` is
    /// set), so that a long prompt's KV does not page-fault on the cores the streams decode on.
    /// Default: one sequence of the model's whole context and its prefix-cache copy, at most
    /// the KV budget; 0: off (MLX's cache of freed buffers, as on a GPU). Ignored on a GPU.
    pub host_memory_reserve_bytes: Option<u64>,
    /// Writes one line per scheduler tick to `<tick_log>.<worker id>`, for tuning (see the
    /// worker's `tick_log` module). Default: none.
    pub tick_log: Option<std::path::PathBuf>,
    /// On SIGTERM a worker stops fetching jobs and finishes those it holds for up to this long;
    /// what is left then ends with `worker_lost`.
    pub drain_timeout_s: u64,
    /// A worker whose scheduler has work but has finished no tick for this long is stuck in a
    /// call that does not return: it exits with an error, its jobs unacknowledged, so that other
    /// workers end them with `worker_lost` and the orchestrator restarts it. Longer than any
    /// tick can take (a whole idle prefill chunk of a large model on a CPU); 0: never.
    pub stall_exit_s: u64,
    /// `both`: takes jobs, prefills and decodes them; `decode`: takes jobs, and has their
    /// prompts prefilled by a live prefill worker of its model (itself when none is live);
    /// `prefill`: takes no jobs, computes prompt chunks for decode workers.
    pub role: WorkerRole,
    /// A decode worker prefills a prompt itself when a prefill worker has not computed a
    /// granted chunk, or its KV has not arrived, within this long.
    pub remote_prefill_timeout_ms: u64,
    /// Where a decode worker takes prompt KV from prefill workers directly (TCP `host:port`,
    /// port 0: any free one), beside NATS; `off`: over NATS only. The default listens on the
    /// loopback only (prefill workers on the same host); the connection is not encrypted, and a
    /// frame must carry the token the worker's grants give.
    pub kv_listen: String,
    /// The host (name or address) prefill workers connect to for `kv_listen`'s port, as grants
    /// offer it. Default (None): the address `kv_listen` binds; where that is a wildcard
    /// (`0.0.0.0`, `[::]`), this host's own address on its route to the NATS server.
    pub kv_advertise: Option<String>,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings {
            id: None,
            model: "smollm2".into(),
            dtype: None,
            quantize: None,
            quantize_group_size: 64,
            keep_quantized: None,
            device: None,
            heartbeat_ms: 1000,
            max_queued: 256,
            ack_wait_ms: 6_000,
            warm_up_tokens: None,
            mlx_memory_limit_bytes: None,
            mlx_cache_limit_bytes: None,
            host_memory_reserve_bytes: None,
            tick_log: None,
            drain_timeout_s: 30,
            stall_exit_s: 300,
            role: WorkerRole::Both,
            remote_prefill_timeout_ms: 10_000,
            kv_listen: "127.0.0.1:0".into(),
            kv_advertise: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSettings {
    /// Prefill tokens' worth of work a tick carries beside decoding streams (a staged chunk is
    /// this times `prefill_chunk_stages`). Default (None): 256 on a GPU, 32 on a CPU.
    pub prefill_chunk_tokens: Option<usize>,
    /// Prefill tokens a tick takes when nothing decodes. Default (None): 4096 on a GPU, 512 on
    /// a CPU (where a prompt's chunk is seconds: shorter ones let a short prompt arriving
    /// meanwhile in soon).
    pub idle_prefill_chunk_tokens: Option<usize>,
    pub max_batch: usize,
    /// KV memory of the block pool (requests hold blocks for what they have, not for what they
    /// might generate). Default: from what the device's memory leaves beside the weights (the
    /// worker's `auto_kv_budget`).
    pub kv_budget_bytes: Option<u64>,
    /// Positions per KV block.
    pub kv_block_tokens: usize,
    /// Positions a running sequence holds beyond its tokens (the next step's, and a step
    /// queued ahead).
    pub kv_lookahead_tokens: usize,
    pub aging_tokens_per_s: f64,
    /// false: whole prompts are prefilled at once (the synchronous baseline).
    pub interleave: bool,
    /// false: static batching (a new batch only when the last one has finished).
    pub continuous: bool,
    /// Queue each greedy decode step on the device before the previous one's tokens are read
    /// (hides the host's share of a step).
    pub decode_ahead: bool,
    /// Ticks a prefill chunk's layers are spread over while streams decode: a chunk granted
    /// beside decoding streams is `prefill_chunk_tokens` times this many tokens, and each tick
    /// carries about `prefill_chunk_tokens` tokens' worth of its work (a share of its layers);
    /// a shorter chunk takes fewer ticks. Default (None): 4 on a GPU, where a chunk's per-layer
    /// host costs are then paid for four times as many tokens; 8 on a CPU, where a chunk's
    /// share is then as little as one layer's (a whole chunk's smallest, 8 tokens through every
    /// layer, costs a full pass over the weights).
    pub prefill_chunk_stages: Option<usize>,
    /// Time a tick carrying prefill work may take, as a multiple of a decode-only tick
    /// (measured). With chunks in stages, each tick's share of a chunk is sized to it, between
    /// `min_prefill_chunk_tokens` and `prefill_chunk_tokens` tokens' worth; with chunks in one
    /// tick, the chunks themselves are. 0: off (every tick carries `prefill_chunk_tokens`'
    /// worth). Default (None): 1.3 on a GPU with stages, 2.0 on a CPU, off otherwise.
    pub tick_budget: Option<f64>,
    /// The least prefill work (tokens' worth) the tick budget sizes a tick's down to. Default
    /// (None): 128 on a GPU, 8 on a CPU (where a token late in a long prompt costs
    /// milliseconds).
    pub min_prefill_chunk_tokens: Option<usize>,
}

/// `scheduler.prefill_chunk_stages` when not set, on a GPU.
pub const GPU_PREFILL_CHUNK_STAGES: usize = 4;

/// `scheduler.tick_budget` when not set, on a GPU whose chunks run in stages.
pub const GPU_TICK_BUDGET: f64 = 1.3;

/// `scheduler.prefill_chunk_tokens` when not set, on a GPU and on a CPU.
pub const GPU_PREFILL_CHUNK_TOKENS: usize = 256;
pub const CPU_PREFILL_CHUNK_TOKENS: usize = 32;

/// `scheduler.prefill_chunk_stages` when not set, on a CPU.
pub const CPU_PREFILL_CHUNK_STAGES: usize = 8;

/// `scheduler.tick_budget` when not set, on a CPU.
pub const CPU_TICK_BUDGET: f64 = 2.0;

impl SchedulerSettings {
    /// Ticks a full prefill chunk is spread over: `prefill_chunk_stages`, or its device default
    /// (on a GPU no more than keeps the chunk within `idle_prefill_chunk_tokens`).
    pub fn chunk_stages(&self, gpu: bool) -> usize {
        let fits = (self.idle_tokens(gpu) / self.chunk_tokens(gpu)).max(1);
        self.prefill_chunk_stages.unwrap_or(if gpu {
            GPU_PREFILL_CHUNK_STAGES.min(fits)
        } else {
            CPU_PREFILL_CHUNK_STAGES
        })
    }

    /// `prefill_chunk_tokens` or its device default.
    pub fn chunk_tokens(&self, gpu: bool) -> usize {
        self.prefill_chunk_tokens
            .unwrap_or(if gpu {
                GPU_PREFILL_CHUNK_TOKENS
            } else {
                CPU_PREFILL_CHUNK_TOKENS
            })
            .max(1)
    }

    /// `idle_prefill_chunk_tokens` or its device default.
    fn idle_tokens(&self, gpu: bool) -> usize {
        self.idle_prefill_chunk_tokens
            .unwrap_or(if gpu { 4096 } else { 512 })
    }

    /// Prefill tokens a tick takes when nothing decodes: `idle_prefill_chunk_tokens` or its
    /// device default, and at least a chunk's tokens over its stages.
    pub fn idle_chunk(&self, gpu: bool) -> usize {
        self.idle_tokens(gpu).max(
            self.chunk_tokens(gpu)
                .saturating_mul(self.chunk_stages(gpu)),
        )
    }

    /// The tick budget: `tick_budget`, or its device default (0: off).
    pub fn tick_budget(&self, gpu: bool) -> f64 {
        let default = if !gpu {
            CPU_TICK_BUDGET
        } else if self.chunk_stages(gpu) > 1 {
            GPU_TICK_BUDGET
        } else {
            0.0
        };
        self.tick_budget.unwrap_or(default)
    }

    /// The least prefill work the tick budget gives a tick: `min_prefill_chunk_tokens` or its
    /// device default.
    pub fn min_chunk(&self, gpu: bool) -> usize {
        self.min_prefill_chunk_tokens
            .unwrap_or(if gpu { 128 } else { 8 })
    }
}

impl Default for SchedulerSettings {
    fn default() -> Self {
        SchedulerSettings {
            prefill_chunk_tokens: None,
            idle_prefill_chunk_tokens: None,
            max_batch: 64,
            kv_budget_bytes: None,
            kv_block_tokens: 64,
            kv_lookahead_tokens: 2,
            aging_tokens_per_s: 1000.0,
            interleave: true,
            continuous: true,
            decode_ahead: true,
            prefill_chunk_stages: None,
            tick_budget: None,
            min_prefill_chunk_tokens: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IntakeSettings {
    /// Models this intake accepts jobs for (names or paths; their tokenizers are loaded).
    pub models: Vec<String>,
    /// A worker silent for this long is considered gone.
    pub worker_timeout_ms: u64,
    /// A request that requires a live worker (the gateway's) is refused with `no_worker` only
    /// when no worker of its model has been heard from for this long; until then it waits in
    /// the jobs stream, so restarting every worker fails no request.
    pub no_worker_grace_ms: u64,
    /// The most tokens a request that gives no `max_tokens` may generate. Default (None): the
    /// rest of the model's context, as OpenAI's API.
    pub default_max_tokens: Option<u32>,
    /// Requests waiting in the live workers of a model (their heartbeats' queued requests)
    /// beyond which new ones are refused with `queue_full`.
    pub max_queued_requests: u64,
    /// How a JSON schema's (or a tool's parameters') objects that do not give
    /// `additionalProperties` are read, where the request does not ask for strict mode.
    pub schema_objects: SchemaObjects,
}

/// Objects of a JSON schema that do not say whether other properties may follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemaObjects {
    /// Only the properties the schema names (as OpenAI's strict mode, and xgrammar's default).
    #[default]
    Closed,
    /// Any other property may follow the named ones (JSON Schema's own reading).
    Open,
}

impl Default for IntakeSettings {
    fn default() -> Self {
        IntakeSettings {
            models: vec!["smollm2".into()],
            worker_timeout_ms: 3000,
            no_worker_grace_ms: 60_000,
            default_max_tokens: None,
            max_queued_requests: 4096,
            schema_objects: SchemaObjects::Closed,
        }
    }
}

/// The workers' prefix cache (KV of earlier prompts, reused by requests that resend them).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixCacheSettings {
    pub enabled: bool,
    /// Tokens per index block: the shortest prefix that can be reused.
    pub block_tokens: usize,
    /// Most bytes it holds; 0: whatever the KV budget leaves over (it is always trimmed to that).
    pub max_bytes: u64,
}

impl Default for PrefixCacheSettings {
    fn default() -> Self {
        PrefixCacheSettings {
            enabled: true,
            block_tokens: 16,
            max_bytes: 0,
        }
    }
}

impl Settings {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key, value: String, why| Err(ConfigError::Invalid { key, value, why });
        let s = &self.scheduler;
        if s.prefill_chunk_tokens == Some(0) {
            return bad(
                "scheduler.prefill_chunk_tokens",
                "0".into(),
                "must be at least 1",
            );
        }
        if let Some(n) = s.prefill_chunk_stages.filter(|n| !(1..=64).contains(n)) {
            return bad(
                "scheduler.prefill_chunk_stages",
                n.to_string(),
                "must be 1 to 64",
            );
        }
        if let Some(b) = s
            .tick_budget
            .filter(|&b| !(b == 0.0 || (b > 1.0 && b.is_finite())))
        {
            return bad(
                "scheduler.tick_budget",
                b.to_string(),
                "must be 0 (off) or a finite number above 1",
            );
        }
        if s.min_prefill_chunk_tokens == Some(0) {
            return bad(
                "scheduler.min_prefill_chunk_tokens",
                "0".into(),
                "must be at least 1",
            );
        }
        if let Some(idle) = s.idle_prefill_chunk_tokens.filter(|&i| {
            i < s
                .prefill_chunk_tokens
                .unwrap_or(CPU_PREFILL_CHUNK_TOKENS)
                .saturating_mul(s.prefill_chunk_stages.unwrap_or(1))
        }) {
            return bad(
                "scheduler.idle_prefill_chunk_tokens",
                idle.to_string(),
                "must be at least prefill_chunk_tokens (times prefill_chunk_stages)",
            );
        }
        if s.max_batch == 0 {
            return bad("scheduler.max_batch", "0".into(), "must be at least 1");
        }
        if s.kv_budget_bytes == Some(0) {
            return bad("scheduler.kv_budget_bytes", "0".into(), "must be positive");
        }
        if s.kv_block_tokens == 0 {
            return bad(
                "scheduler.kv_block_tokens",
                "0".into(),
                "must be at least 1",
            );
        }
        if !(s.aging_tokens_per_s.is_finite() && s.aging_tokens_per_s >= 0.0) {
            return bad(
                "scheduler.aging_tokens_per_s",
                s.aging_tokens_per_s.to_string(),
                "must be a finite number >= 0",
            );
        }
        if self.prefix_cache.block_tokens == 0 {
            return bad(
                "prefix_cache.block_tokens",
                "0".into(),
                "must be at least 1",
            );
        }
        if self.worker.remote_prefill_timeout_ms == 0 {
            return bad(
                "worker.remote_prefill_timeout_ms",
                "0".into(),
                "must be positive",
            );
        }
        if self.worker.heartbeat_ms == 0 {
            return bad("worker.heartbeat_ms", "0".into(), "must be positive");
        }
        if self.worker.ack_wait_ms < 600 {
            return bad(
                "worker.ack_wait_ms",
                self.worker.ack_wait_ms.to_string(),
                "must be at least 600",
            );
        }
        if self.worker.max_queued == 0 {
            return bad("worker.max_queued", "0".into(), "must be at least 1");
        }
        if self.intake.models.is_empty() {
            return bad("intake.models", "[]".into(), "must name at least one model");
        }
        if self.intake.max_queued_requests == 0 {
            return bad(
                "intake.max_queued_requests",
                "0".into(),
                "must be at least 1",
            );
        }
        if self.gateway.listen.parse::<std::net::SocketAddr>().is_err() {
            return bad(
                "gateway.listen",
                self.gateway.listen.clone(),
                "must be an address like 127.0.0.1:8000",
            );
        }
        if self.gateway.silent_stream_timeout_ms < 1000 {
            return bad(
                "gateway.silent_stream_timeout_ms",
                self.gateway.silent_stream_timeout_ms.to_string(),
                "must be at least 1000",
            );
        }
        if self.gateway.worker_timeout_ms <= self.worker.heartbeat_ms {
            return bad(
                "gateway.worker_timeout_ms",
                self.gateway.worker_timeout_ms.to_string(),
                "must exceed worker.heartbeat_ms",
            );
        }
        if self.intake.worker_timeout_ms <= self.worker.heartbeat_ms {
            return bad(
                "intake.worker_timeout_ms",
                self.intake.worker_timeout_ms.to_string(),
                "must exceed worker.heartbeat_ms",
            );
        }
        if self.intake.no_worker_grace_ms < self.intake.worker_timeout_ms {
            return bad(
                "intake.no_worker_grace_ms",
                self.intake.no_worker_grace_ms.to_string(),
                "must be at least intake.worker_timeout_ms",
            );
        }
        if !self.nats.url.contains("://") && !self.nats.url.contains(':') {
            return bad(
                "nats.url",
                self.nats.url.clone(),
                "must look like nats://host:port",
            );
        }
        Ok(())
    }
}

/// Defaults, then `file` (or $LLMQ_CONFIG), then LLMQ__SECTION__KEY environment variables.
pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
    let mut b = config::Config::builder();
    let env_file = std::env::var_os("LLMQ_CONFIG");
    if let Some(f) = file.map(Path::to_path_buf).or(env_file.map(Into::into)) {
        b = b.add_source(config::File::from(f).required(true));
    }
    b = b.add_source(
        config::Environment::with_prefix("LLMQ")
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("intake.models")
            .with_list_parse_key("gateway.api_keys"),
    );
    let s: Settings = b.build()?.try_deserialize()?;
    s.validate()?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_layers_apply_in_order() {
        let d = Settings::default();
        d.validate().unwrap();
        assert_eq!(
            (
                d.scheduler.chunk_tokens(true),
                d.scheduler.chunk_tokens(false)
            ),
            (256, 32)
        );

        let dir = std::env::temp_dir().join(format!("llmq-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("llmq.toml");
        std::fs::write(&f, "[scheduler]\nprefill_chunk_tokens = 128\nmax_batch = 8\n[nats]\nurl = \"nats://u:secret@h:4222\"\n").unwrap();
        // The environment overrides the file (this test owns these variable names).
        std::env::set_var("LLMQ__SCHEDULER__MAX_BATCH", "16");
        let s = load(Some(&f)).unwrap();
        std::env::remove_var("LLMQ__SCHEDULER__MAX_BATCH");
        assert_eq!(s.scheduler.prefill_chunk_tokens, Some(128));
        assert_eq!(s.scheduler.max_batch, 16);
        assert!(
            !format!("{s:?}").contains("secret"),
            "credentials redacted in Debug"
        );

        std::fs::write(&f, "[scheduler]\nprefill_chunk_tokens = 0\n").unwrap();
        let err = load(Some(&f)).unwrap_err().to_string();
        assert!(err.contains("scheduler.prefill_chunk_tokens"), "{err}");
        std::fs::write(&f, "[scheduler]\nprefill_chunk_stages = 0\n").unwrap();
        let err = load(Some(&f)).unwrap_err().to_string();
        assert!(err.contains("scheduler.prefill_chunk_stages"), "{err}");
        // Stages: 4 on a GPU and 8 on a CPU unless set (chunks of 1024 and 256 tokens); a staged
        // chunk fits the idle chunk.
        assert_eq!(
            (
                d.scheduler.chunk_stages(true),
                d.scheduler.chunk_stages(false)
            ),
            (4, 8)
        );
        assert_eq!(
            (
                d.scheduler.tick_budget(true),
                d.scheduler.tick_budget(false)
            ),
            (GPU_TICK_BUDGET, CPU_TICK_BUDGET),
            "a budget by default on a GPU's stages and on a CPU"
        );
        assert_eq!(
            (d.scheduler.min_chunk(true), d.scheduler.min_chunk(false)),
            (128, 8)
        );
        assert_eq!(
            (d.scheduler.idle_chunk(true), d.scheduler.idle_chunk(false)),
            (4096, 512)
        );
        std::fs::write(&f, "[scheduler]\nidle_prefill_chunk_tokens = 512\n").unwrap();
        assert_eq!(load(Some(&f)).unwrap().scheduler.chunk_stages(true), 2);
        std::fs::write(&f, "[scheduler]\nprefill_chunk_stages = 3\n").unwrap();
        let s = load(Some(&f)).unwrap();
        assert_eq!(
            (
                s.scheduler.chunk_stages(true),
                s.scheduler.chunk_stages(false)
            ),
            (3, 3),
            "an explicit setting holds on a CPU too"
        );
        assert_eq!(
            s.scheduler.idle_chunk(false),
            512,
            "three 32-token shares fit the CPU's idle chunk"
        );
        std::fs::write(
            &f,
            "[scheduler]\nprefill_chunk_tokens = 256\nprefill_chunk_stages = 3\n",
        )
        .unwrap();
        assert_eq!(
            load(Some(&f)).unwrap().scheduler.idle_chunk(false),
            768,
            "an idle chunk takes at least a staged chunk"
        );
        std::fs::write(&f, "[scheduler]\nprefill_chunk_stages = 1\n").unwrap();
        assert_eq!(
            load(Some(&f)).unwrap().scheduler.tick_budget(true),
            0.0,
            "no stages, no default budget"
        );
        std::fs::write(&f, "[scheduler]\nprefill_chunk_stages = 32\n").unwrap();
        assert_eq!(
            load(Some(&f)).unwrap().scheduler.idle_chunk(true),
            8192,
            "the default idle chunk grows to a staged chunk"
        );
        std::fs::write(&f, "[scheduler]\nprefill_chunk_tokens = 256\nprefill_chunk_stages = 32\nidle_prefill_chunk_tokens = 4096\n").unwrap();
        let err = load(Some(&f)).unwrap_err().to_string();
        assert!(err.contains("scheduler.idle_prefill_chunk_tokens"), "{err}");
        for bad_budget in ["1.0", "-2.0", "nan"] {
            std::fs::write(&f, format!("[scheduler]\ntick_budget = {bad_budget}\n")).unwrap();
            let err = load(Some(&f)).unwrap_err().to_string();
            assert!(err.contains("scheduler.tick_budget"), "{bad_budget}: {err}");
        }
        std::fs::write(
            &f,
            "[scheduler]\ntick_budget = 0.0\nmin_prefill_chunk_tokens = 64\n",
        )
        .unwrap();
        let s = load(Some(&f)).unwrap();
        assert_eq!(
            (
                s.scheduler.tick_budget(true),
                s.scheduler.tick_budget(false),
                s.scheduler.min_chunk(false)
            ),
            (0.0, 0.0, 64)
        );
        std::fs::write(
            &f,
            "[worker]\nmlx_cache_limit_bytes = 0\nmlx_memory_limit_bytes = 100000000000\n",
        )
        .unwrap();
        let s = load(Some(&f)).unwrap();
        assert_eq!(
            (
                s.worker.mlx_cache_limit_bytes,
                s.worker.mlx_memory_limit_bytes
            ),
            (Some(0), Some(100_000_000_000))
        );
        assert_eq!(
            (
                d.worker.mlx_cache_limit_bytes,
                d.worker.mlx_memory_limit_bytes
            ),
            (None, None),
            "MLX's own limits by default"
        );
        std::fs::write(&f, "[scheduler]\nprefil_chunk_tokens = 5\n").unwrap();
        let err = load(Some(&f)).unwrap_err().to_string();
        assert!(
            err.contains("prefil_chunk_tokens"),
            "unknown keys are named: {err}"
        );
    }
}
