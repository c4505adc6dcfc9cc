//! `llmq worker`, `llmq intake`, `llmq gateway` and `llmq up` (a whole local stack: nats-server,
//! intake, workers and optionally the HTTP gateway as child processes, NATS on a free loopback
//! port, stopped together).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use futures::StreamExt;
use llmq_protocol::WorkerRole;

#[derive(clap::Args)]
pub struct ServiceArgs {
    /// A TOML configuration file (also $LLMQ_CONFIG); LLMQ__SECTION__KEY variables override it.
    #[arg(long)]
    config: Option<PathBuf>,
}

fn settings(a: &ServiceArgs) -> Result<llmq_config::Settings> {
    Ok(llmq_config::load(a.config.as_deref())?)
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    service: ServiceArgs,
    /// both: take jobs, prefill and decode them; decode: take jobs and have their prompts
    /// prefilled by a live prefill worker; prefill: compute prompt chunks for decode workers
    /// (`worker.role`; default: the configuration's, `both`).
    #[arg(long)]
    role: Option<WorkerRole>,
}

pub fn worker(a: WorkerArgs) -> Result<()> {
    let mut s = settings(&a.service)?;
    if let Some(role) = a.role {
        s.worker.role = role;
    }
    if let Some(d) = s.worker.device {
        // Before MLX initialises (the model loads later, on the device thread).
        std::env::set_var("CUDA_VISIBLE_DEVICES", d.to_string());
    }
    actix::System::new().block_on(llmq_worker::service::run(s, stop_signal()))?;
    Ok(())
}

pub fn intake(a: ServiceArgs) -> Result<()> {
    let s = settings(&a)?;
    actix::System::new().block_on(llmq_intake::run(s, stop_signal()))?;
    Ok(())
}

/// SIGTERM or SIGINT: a service then stops taking work, finishes what it holds and exits (the
/// gateway's HTTP server handles both itself, the same way).
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            eprintln!("llmq: no SIGTERM handler ({e}); stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

pub fn gateway(a: ServiceArgs) -> Result<()> {
    let s = settings(&a)?;
    actix_web::rt::System::new().block_on(llmq_gateway::run(s))?;
    Ok(())
}

#[derive(clap::Args)]
pub struct UpArgs {
    /// Engine workers to start (they take the jobs).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Prefill workers to start besides: the engine workers then have their prompts
    /// prefilled by them (roles `decode` and `prefill`).
    #[arg(long, default_value_t = 0)]
    prefill_workers: usize,
    /// The model the workers serve (a known name or a path).
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// NATS port on 127.0.0.1 (default: a free one).
    #[arg(long)]
    port: Option<u16>,
    /// Also start the OpenAI-compatible HTTP gateway, listening on this address
    /// (e.g. 127.0.0.1:8000).
    #[arg(long)]
    gateway: Option<String>,
    /// GPUs to spread the workers over, one each in turn (e.g. 0,1): worker i owns
    /// GPU gpus[i % len] (`worker.device`), the prefill workers counted after the others.
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<u32>,
    #[arg(long)]
    config: Option<PathBuf>,
}

/// Child processes that are stopped (TERM, then KILL) when this is dropped, whatever happens.
#[derive(Default)]
pub struct Children(Vec<(String, Child)>);

impl Children {
    pub fn push(&mut self, name: &str, c: Child) {
        self.0.push((name.to_string(), c));
    }
    /// The first child that has exited, if any.
    pub fn exited(&mut self) -> Option<String> {
        self.0
            .iter_mut()
            .find_map(|(n, c)| matches!(c.try_wait(), Ok(Some(_))).then(|| n.clone()))
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        // Services first, the server last.
        for (_, c) in self.0.iter_mut().rev() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc_kill(c.id() as i32, 15) };
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for (_, c) in self.0.iter_mut().rev() {
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// A running local stack: nats-server, intake and workers, stopped when dropped.
pub struct Stack {
    pub url: String,
    /// The gateway's address, when it runs.
    pub gateway: Option<String>,
    pub children: Children,
    dir: PathBuf,
}

impl Drop for Stack {
    fn drop(&mut self) {
        std::mem::take(&mut self.children);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What `start_stack` starts besides nats-server and intake.
#[derive(Default)]
pub struct StackSpec<'a> {
    pub model: &'a str,
    /// Workers that take jobs, and prefill workers besides (with any, the others decode only).
    pub workers: usize,
    pub prefill_workers: usize,
    /// NATS port on 127.0.0.1 (default: a free one).
    pub port: Option<u16>,
    pub config: Option<&'a std::path::Path>,
    /// Extra environment for the workers (LLMQ__SCHEDULER__..., say).
    pub worker_env: &'a [(String, String)],
    /// The gateway's listening address, when it runs.
    pub gateway: Option<&'a str>,
    /// GPUs the workers take in turn.
    pub gpus: &'a [u32],
}

/// Starts nats-server, intake, the workers and optionally the gateway.
pub fn start_stack(spec: StackSpec) -> Result<Stack> {
    let StackSpec {
        model,
        workers,
        prefill_workers,
        port,
        config,
        worker_env,
        gateway,
        gpus,
    } = spec;
    static STACKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("llmq-stack-{}-{n}", std::process::id()));
    let (nats, url) = crate::nats_server::start(port, &dir)?;
    let mut stack = Stack {
        url: url.clone(),
        gateway: None,
        children: Children::default(),
        dir: dir.clone(),
    };
    stack.children.push("nats-server", nats);
    let exe = std::env::current_exe()?;
    let spawn = |what: &str, env: &[(String, String)]| -> Result<Child> {
        let mut c = Command::new(&exe);
        c.arg(what)
            .env("LLMQ__NATS__URL", &url)
            .env("LLMQ__WORKER__MODEL", model)
            .env("LLMQ__INTAKE__MODELS", model);
        for (k, v) in env {
            c.env(k, v);
        }
        if let Some(cfg) = config {
            c.arg("--config").arg(cfg);
        }
        Ok(c.stdin(Stdio::null()).stdout(Stdio::null()).spawn()?)
    };
    stack.children.push("intake", spawn("intake", &[])?);
    for i in 0..workers + prefill_workers {
        let mut env = worker_env.to_vec();
        if !gpus.is_empty() {
            env.push((
                "LLMQ__WORKER__DEVICE".into(),
                gpus[i % gpus.len()].to_string(),
            ));
        }
        if prefill_workers > 0 {
            let role = if i < workers { "decode" } else { "prefill" };
            env.push(("LLMQ__WORKER__ROLE".into(), role.into()));
        }
        stack
            .children
            .push(&format!("worker {i}"), spawn("worker", &env)?);
    }
    if let Some(listen) = gateway {
        // The address it listens on comes back in a file (with port 0, the port it was given).
        let file = dir.join("gateway.addr");
        let env = [
            ("LLMQ__GATEWAY__LISTEN".into(), listen.into()),
            (
                "LLMQ__GATEWAY__ADDRESS_FILE".into(),
                file.display().to_string(),
            ),
        ];
        let mut child = spawn("gateway", &env)?;
        let listening =
            crate::nats_server::wait_listening(&mut child, Duration::from_secs(120), || {
                std::fs::read_to_string(&file).ok()
            });
        stack.children.push("gateway", child);
        match listening? {
            crate::nats_server::Listening::At(addr) => stack.gateway = Some(addr),
            crate::nats_server::Listening::Exited(status) => {
                bail!("the gateway exited ({status}) before listening")
            }
            crate::nats_server::Listening::TimedOut => {
                bail!("the gateway did not listen within 120 s")
            }
        }
    }
    Ok(stack)
}

/// Waits until `workers` distinct workers have sent a heartbeat.
pub async fn wait_for_workers(
    client: &async_nats::Client,
    workers: usize,
    children: &mut Children,
) -> Result<()> {
    let mut hb = client
        .subscribe(llmq_protocol::subjects::WORKER_STATUS_ALL)
        .await?;
    let mut seen = std::collections::HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    while seen.len() < workers {
        tokio::select! {
            m = hb.next() => {
                if let Some(m) = m {
                    if let Ok(s) = llmq_protocol::decode::<llmq_protocol::WorkerStatus>(&m.payload) {
                        seen.insert(s.worker_id);
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => bail!("workers did not report within 600 s"),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if let Some(n) = children.exited() { bail!("{n} exited during start-up"); }
            }
        }
    }
    Ok(())
}

pub fn up(a: UpArgs) -> Result<()> {
    let spec = StackSpec {
        model: &a.model,
        workers: a.workers,
        prefill_workers: a.prefill_workers,
        port: a.port,
        config: a.config.as_deref(),
        gateway: a.gateway.as_deref(),
        gpus: &a.gpus,
        ..Default::default()
    };
    let mut stack = start_stack(spec)?;
    let (url, gateway) = (stack.url.clone(), stack.gateway.clone());
    let children = &mut stack.children;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let client = async_nats::connect(&url).await?;
        wait_for_workers(&client, a.workers + a.prefill_workers, children).await?;
        println!("LLMQ_NATS_URL={url}");
        if let Some(g) = &gateway {
            println!("LLMQ_GATEWAY_URL=http://{g}");
        }
        let prefill = if a.prefill_workers > 0 {
            format!(" and {} prefill worker(s)", a.prefill_workers)
        } else {
            String::new()
        };
        eprintln!(
            "llmq: up: nats-server, intake and {} worker(s){prefill} for {}; Ctrl-C stops them",
            a.workers, a.model
        );
        let stop = stop_signal();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    if let Some(n) = children.exited() { bail!("{n} exited"); }
                }
            }
        }
        Ok(())
    });
    drop(stack);
    result
}
