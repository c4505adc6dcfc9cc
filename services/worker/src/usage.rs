//! What the tick log (`LLMQ_TICK_LOG`) records beside a step's host time, to tell why that
//! time jumps. Of the decode thread: its own resource use (`ThreadUsage`: `getrusage
//! (RUSAGE_THREAD)`, and the CPU's instruction and cycle counts where the machine exposes them),
//! whether it was computing (CPU time close to the wall time), descheduled (involuntary
//! switches), blocked (voluntary switches) or faulting pages in; and its CPU's speed right after
//! (`SpeedProbe`). Of the machine (`MachineSampler`, its own thread): time stolen by the
//! hypervisor, runnable threads, TLB shootdowns. None of it runs without a tick log.

/// A reading of the calling thread's counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadUsage {
    cpu_ms: f64,
    minor_faults: i64,
    voluntary: i64,
    involuntary: i64,
    /// The CPU's own counts for this thread (user mode): instructions retired and cycles, where
    /// the machine exposes them (a VM may not).
    instructions: Option<u64>,
    cycles: Option<u64>,
}

/// The calling thread's hardware counters (Linux `perf_event_open`), opened on first use.
#[cfg(target_os = "linux")]
mod counters {
    use std::cell::OnceCell;

    /// `struct perf_event_attr` up to `config1` (PERF_ATTR_SIZE_VER0, 64 bytes).
    #[repr(C)]
    #[derive(Default)]
    struct Attr {
        kind: u32,
        size: u32,
        config: u64,
        sample_period: u64,
        sample_type: u64,
        read_format: u64,
        flags: u64,
        wakeup_events: u32,
        bp_type: u32,
        config1: u64,
    }

    const PERF_TYPE_HARDWARE: u32 = 0;
    const CYCLES: u64 = 0;
    const INSTRUCTIONS: u64 = 1;
    /// `exclude_kernel` and `exclude_hv`: user-mode counts, which an unprivileged process may
    /// read for itself.
    const USER_ONLY: u64 = (1 << 5) | (1 << 6);

    fn open(config: u64) -> Option<i32> {
        let attr = Attr { kind: PERF_TYPE_HARDWARE, size: std::mem::size_of::<Attr>() as u32, config, flags: USER_ONLY, ..Default::default() };
        // SAFETY: the kernel reads `size` bytes of `attr`, which lives through the call; pid 0
        // and cpu -1 count the calling thread wherever it runs; no group, no flags.
        let fd = unsafe { libc::syscall(libc::SYS_perf_event_open, &attr as *const Attr, 0, -1, -1, 0) };
        (fd >= 0).then_some(fd as i32)
    }

    fn read(fd: i32) -> Option<u64> {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v`, a u64 on the stack.
        let n = unsafe { libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
        (n == 8).then_some(v)
    }

    thread_local! {
        // (instructions, cycles) counters of this thread; never closed (one pair per thread
        // that asks, for the thread's life).
        static FDS: OnceCell<(Option<i32>, Option<i32>)> = const { OnceCell::new() };
    }

    /// This thread's (instructions, cycles) so far.
    pub fn now() -> (Option<u64>, Option<u64>) {
        FDS.with(|c| {
            let (i, y) = *c.get_or_init(|| (open(INSTRUCTIONS), open(CYCLES)));
            (i.and_then(read), y.and_then(read))
        })
    }
}

impl ThreadUsage {
    /// The calling thread's counters now (zeros where the platform has no per-thread reading).
    pub fn now() -> Self {
        #[cfg(target_os = "linux")]
        {
            let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
            // SAFETY: getrusage writes a whole `rusage` into the pointer it is given and reads
            // nothing else; RUSAGE_THREAD concerns only the calling thread.
            let ok = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) } == 0;
            if ok {
                // SAFETY: initialised by the successful call above (and zeroed before it).
                let ru = unsafe { ru.assume_init() };
                let ms = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
                let (instructions, cycles) = counters::now();
                return ThreadUsage {
                    cpu_ms: ms(ru.ru_utime) + ms(ru.ru_stime),
                    minor_faults: ru.ru_minflt,
                    voluntary: ru.ru_nvcsw,
                    involuntary: ru.ru_nivcsw,
                    instructions,
                    cycles,
                };
            }
        }
        ThreadUsage::default()
    }

    /// What the thread used since `earlier`: CPU ms, minor page faults, voluntary and
    /// involuntary context switches, and millions of instructions and of cycles (NaN where the
    /// machine does not count them).
    pub fn since(&self, earlier: &ThreadUsage) -> [f64; 6] {
        let mega = |a: Option<u64>, b: Option<u64>| a.zip(b).map_or(f64::NAN, |(a, b)| a.saturating_sub(b) as f64 / 1e6);
        [
            self.cpu_ms - earlier.cpu_ms,
            (self.minor_faults - earlier.minor_faults) as f64,
            (self.voluntary - earlier.voluntary) as f64,
            (self.involuntary - earlier.involuntary) as f64,
            mega(self.instructions, earlier.instructions),
            mega(self.cycles, earlier.cycles),
        ]
    }
}

/// Times two fixed pieces of work on the calling thread, to tell a slower CPU from more work
/// when a step's host time grows: a chain of dependent integer operations (the core's speed:
/// its clock, a sibling thread sharing it) and a walk through a 4 MiB buffer in a random cycle
/// (the caches and memory as this thread sees them). Each takes tens of microseconds.
pub struct SpeedProbe {
    next: Vec<u32>,
}

/// Steps of each probe.
const ALU_STEPS: u32 = 10_000;
const WALK_STEPS: usize = 500;

impl SpeedProbe {
    pub fn new() -> Self {
        // One cycle through every slot, in a scrambled order (Sattolo's shuffle, xorshift).
        let n = (4 << 20) / 4;
        let mut next: Vec<u32> = (0..n as u32).collect();
        let mut x = 0x9e37_79b9u32;
        for i in (1..n).rev() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            next.swap(i, x as usize % i);
        }
        SpeedProbe { next }
    }

    /// Microseconds of (the integer chain, the buffer walk) now, and the CPU the thread ran
    /// the walk on (-1 where unknown): a thread moved to another core, or to another NUMA
    /// node's, finds its caches cold or its memory remote.
    pub fn run(&self) -> (f64, f64, f64) {
        let t = std::time::Instant::now();
        let mut x = std::hint::black_box(0x1234_5678u32);
        for _ in 0..ALU_STEPS {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
        }
        std::hint::black_box(x);
        let alu = t.elapsed();
        let t = std::time::Instant::now();
        let mut at = std::hint::black_box(0usize);
        for _ in 0..WALK_STEPS {
            at = self.next[at] as usize;
        }
        std::hint::black_box(at);
        let walk = t.elapsed();
        (alu.as_secs_f64() * 1e6, walk.as_secs_f64() * 1e6, current_cpu())
    }
}

/// The CPU the calling thread runs on now, -1 where unknown.
fn current_cpu() -> f64 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: no arguments; returns a CPU number or -1.
        unsafe { libc::sched_getcpu() as f64 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        -1.0
    }
}

/// The time now as UNIX milliseconds (0 before 1970), to line up the tick log with other logs.
pub fn unix_ms() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

impl Default for SpeedProbe {
    fn default() -> Self {
        Self::new()
    }
}

/// The whole machine's CPU time so far, from `/proc/stat` (ms, summed over CPUs, in steps of
/// the kernel's clock tick): busy (user, nice, system, irq, softirq) and stolen by the
/// hypervisor; and the threads runnable now. None where it cannot be read.
pub fn machine_cpu() -> Option<(f64, f64, f64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let (mut busy, mut steal) = (None, None);
    let mut running = None;
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        match f.next() {
            // cpu user nice system idle iowait irq softirq steal ...
            Some("cpu") => {
                let v: Vec<f64> = f.take(8).map_while(|v| v.parse::<f64>().ok()).collect();
                if v.len() == 8 {
                    busy = Some(v[0] + v[1] + v[2] + v[5] + v[6]);
                    steal = Some(v[7]);
                }
            }
            Some("procs_running") => running = f.next().and_then(|v| v.parse::<f64>().ok()),
            _ => {}
        }
    }
    #[cfg(target_os = "linux")]
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    #[cfg(not(target_os = "linux"))]
    let hz = 100.0;
    Some((busy? * 1000.0 / hz, steal? * 1000.0 / hz, running?))
}

/// TLB shootdowns the machine's CPUs have taken so far (`/proc/interrupts`, summed over CPUs):
/// each is a CPU's address translations flushed because a thread of the same process changed
/// its mappings (memory unmapped or protected), after which its next accesses walk the page
/// tables (in a VM, both levels). None where it cannot be read.
pub fn tlb_shootdowns() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/interrupts").ok()?;
    let line = text.lines().find(|l| l.trim_start().starts_with("TLB:"))?;
    Some(line.split_ascii_whitespace().skip(1).map_while(|v| v.parse::<f64>().ok()).sum())
}

/// The machine's counters (`machine_cpu`, `tlb_shootdowns`), read by a thread
/// of its own every `period`, so that whoever logs them pays nothing: reading
/// `/proc/interrupts` takes hundreds of microseconds on a 16-CPU machine, too much for a tick's
/// critical path. The thread stops when this is dropped.
pub struct MachineSampler {
    /// Busy ms so far, stolen ms so far, threads runnable, TLB shootdowns so far (f64 bits; NaN
    /// unread).
    latest: std::sync::Arc<[std::sync::atomic::AtomicU64; 4]>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl MachineSampler {
    pub fn start(period: std::time::Duration) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let nan = f64::NAN.to_bits();
        let latest = std::sync::Arc::new([(); 4].map(|_| AtomicU64::new(nan)));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (l, s) = (latest.clone(), stop.clone());
        let spawned = std::thread::Builder::new().name("llmq-machine-sampler".into()).spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let (busy, steal, runnable) = machine_cpu().unwrap_or((f64::NAN, f64::NAN, f64::NAN));
                let tlb = tlb_shootdowns().unwrap_or(f64::NAN);
                for (slot, v) in l.iter().zip([busy, steal, runnable, tlb]) {
                    slot.store(v.to_bits(), Ordering::Relaxed);
                }
                std::thread::sleep(period);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no machine sampler: the tick log goes without the machine's counters");
        }
        MachineSampler { latest, stop }
    }

    /// The latest reading: busy ms so far, stolen ms so far, threads runnable, TLB shootdowns
    /// so far (NaN where not read yet or not readable).
    pub fn latest(&self) -> [f64; 4] {
        [0, 1, 2, 3].map(|i| f64::from_bits(self.latest[i].load(std::sync::atomic::Ordering::Relaxed)))
    }
}

impl Drop for MachineSampler {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_thread_counts_its_own_cpu_time() {
        let before = ThreadUsage::now();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let used = ThreadUsage::now().since(&before);
        if cfg!(target_os = "linux") {
            // Busy for 30 ms of wall time: at least some of it on the CPU, never more than the
            // wall time allows (the tick is 1-10 ms; leave room for a loaded machine).
            assert!(used[0] > 1.0 && used[0] < 30.0 + 20.0, "{used:?}");
            assert!(used[..4].iter().all(|v| *v >= 0.0), "{used:?}");
            // Counted or not (a VM may hide the CPU's counters), never negative.
            assert!(used[4..].iter().all(|v| v.is_nan() || *v > 0.0), "{used:?}");
            eprintln!("30 ms busy: {used:?}");
            let probe = SpeedProbe::new();
            let (alu, walk, core) = probe.run();
            assert!(alu > 0.0 && walk > 0.0 && alu < 1e5 && walk < 1e5, "{alu} {walk}");
            assert!(core >= 0.0 && core < 4096.0 && core.fract() == 0.0, "the probe ran on CPU {core}");
            eprintln!("probe: {alu:.1} us integer chain, {walk:.1} us walk, on CPU {core}");
            let (busy, steal, running) = machine_cpu().expect("/proc/stat");
            assert!(busy > 0.0 && steal >= 0.0 && running >= 1.0, "{busy} {steal} {running}");
            if let Some(tlb) = tlb_shootdowns() {
                assert!(tlb >= 0.0, "{tlb}");
            }
            let sampler = MachineSampler::start(std::time::Duration::from_millis(5));
            let t = std::time::Instant::now();
            while sampler.latest()[2].is_nan() && t.elapsed() < std::time::Duration::from_secs(5) {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            let [busy, steal, running, _] = sampler.latest();
            assert!(busy > 0.0 && steal >= 0.0 && running >= 1.0, "the sampler read the machine: {busy} {steal} {running}");
        }
    }
}
