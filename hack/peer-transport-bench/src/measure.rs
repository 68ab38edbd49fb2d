//! CPU time of this process (getrusage) and of the server process (/proc/<pid>/stat, which
//! counts every thread), over the same window.

use anyhow::{Context, bail};

pub fn self_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes a plain struct we own.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// utime + stime of `pid`, in seconds (clock-tick resolution: 10 ms).
pub fn proc_cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("server process {pid}"))?;
    // The command name may hold spaces and parentheses: fields count from the last ')'.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        bail!("unreadable /proc/{pid}/stat");
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let (Some(utime), Some(stime)) = (fields.get(11), fields.get(12)) else {
        bail!("short /proc/{pid}/stat");
    };
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((utime.parse::<u64>()? + stime.parse::<u64>()?) as f64 / ticks)
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
