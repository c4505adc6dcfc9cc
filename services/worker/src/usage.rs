//! The calling thread's own resource use (Linux `getrusage(RUSAGE_THREAD)`), for the tick log:
//! when a step's host time jumps, whether the device thread was computing (CPU time close to
//! the wall time), descheduled (involuntary switches, CPU time far below the wall time),
//! blocked (voluntary switches) or faulting pages in.

/// A reading of the calling thread's counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThreadUsage {
    cpu_ms: f64,
    minor_faults: i64,
    voluntary: i64,
    involuntary: i64,
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
                return ThreadUsage {
                    cpu_ms: ms(ru.ru_utime) + ms(ru.ru_stime),
                    minor_faults: ru.ru_minflt,
                    voluntary: ru.ru_nvcsw,
                    involuntary: ru.ru_nivcsw,
                };
            }
        }
        ThreadUsage::default()
    }

    /// What the thread used since `earlier`: CPU ms, minor page faults, voluntary and
    /// involuntary context switches.
    pub fn since(&self, earlier: &ThreadUsage) -> [f64; 4] {
        [
            self.cpu_ms - earlier.cpu_ms,
            (self.minor_faults - earlier.minor_faults) as f64,
            (self.voluntary - earlier.voluntary) as f64,
            (self.involuntary - earlier.involuntary) as f64,
        ]
    }
}

/// The whole machine's time stolen by the hypervisor (ms, summed over CPUs) and the threads
/// runnable now, from `/proc/stat`; None where it cannot be read.
pub fn machine_steal_and_runnable() -> Option<(f64, f64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let mut steal = None;
    let mut running = None;
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        match f.next() {
            // cpu user nice system idle iowait irq softirq steal ...
            Some("cpu") => steal = f.nth(7).and_then(|v| v.parse::<f64>().ok()),
            Some("procs_running") => running = f.next().and_then(|v| v.parse::<f64>().ok()),
            _ => {}
        }
    }
    #[cfg(target_os = "linux")]
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    #[cfg(not(target_os = "linux"))]
    let hz = 100.0;
    Some((steal? * 1000.0 / hz, running?))
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
            assert!(used.iter().all(|v| *v >= 0.0), "{used:?}");
            let (steal, running) = machine_steal_and_runnable().expect("/proc/stat");
            assert!(steal >= 0.0 && running >= 1.0, "{steal} {running}");
        }
    }
}
