//! What machine a measurement ran on, for the headers of the demo and benchmark tables.
//!
//! Numbers without the machine are not comparable, so every table the tools print names the
//! CPU count, the CPU model and the UTC date. Read from `/proc` and the system clock only (no
//! date crate: a civil-from-days conversion is ten lines).

use std::time::{SystemTime, UNIX_EPOCH};

/// The machine a run happened on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// Logical CPUs available to this process.
    pub cpus: usize,
    /// `model name` from `/proc/cpuinfo`, or `unknown CPU`.
    pub cpu_model: String,
    /// Total memory in MiB, when known.
    pub mem_mib: Option<u64>,
    /// Kernel release (`/proc/sys/kernel/osrelease`), when known.
    pub kernel: Option<String>,
    /// UTC time of detection, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
}

impl Machine {
    /// Reads the current machine.
    pub fn detect() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown CPU".to_owned());
        let mem_mib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .map(|kib| kib / 1024)
        });
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|s| s.trim().to_owned());
        Self {
            cpus,
            cpu_model,
            mem_mib,
            kernel,
            date: utc_now(),
        }
    }

    /// One line: `2 CPUs (AMD EPYC), 24 GiB, Linux 6.1, 2025-01-31 12:00 UTC`.
    pub fn summary(&self) -> String {
        let mut s = format!("{} CPUs ({})", self.cpus, self.cpu_model);
        if let Some(m) = self.mem_mib {
            s.push_str(&format!(", {} GiB RAM", (m + 512) / 1024));
        }
        if let Some(k) = &self.kernel {
            s.push_str(&format!(", Linux {k}"));
        }
        s.push_str(&format!(", {}", self.date));
        s
    }
}

/// The 1-minute load average (`/proc/loadavg`), to show how busy the machine was: numbers
/// measured while something else used the CPUs are not comparable with a quiet run.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPU-time counters of the whole machine and of this process (children it has reaped
/// included), to tell how much of the machine *other* processes used during a measurement.
/// A load average cannot: it counts the measurement's own load too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// All CPU time of the machine (clock ticks, every state).
    total: u64,
    /// Non-idle CPU time of the machine.
    busy: u64,
    /// utime + stime + cutime + cstime of this process.
    ours: u64,
}

impl CpuTimes {
    /// Reads `/proc/stat` and `/proc/self/stat`.
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let me = std::fs::read_to_string("/proc/self/stat").ok()?;
        Self::parse(&stat, &me)
    }

    fn parse(stat: &str, me: &str) -> Option<Self> {
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .take(8)
            .map(|v| v.parse().ok())
            .collect::<Option<_>>()?;
        let total: u64 = cpu.iter().sum();
        // idle and iowait are the 4th and 5th fields.
        let busy = total - cpu.get(3)? - cpu.get(4).copied().unwrap_or(0);
        let rest = &me[me.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ours = (11..=14)
            .map(|i| f.get(i).and_then(|v| v.parse::<u64>().ok()))
            .sum::<Option<u64>>()?;
        Some(Self { total, busy, ours })
    }

    /// Percentage of the machine's CPU time used by processes other than this one and its
    /// reaped children between `earlier` and `self`. Children still running are not counted
    /// as ours until reaped, so take `self` after stopping them.
    pub fn others_percent_since(&self, earlier: &Self) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        if total == 0 {
            return None;
        }
        let busy = self.busy.saturating_sub(earlier.busy);
        let ours = self.ours.saturating_sub(earlier.ours);
        Some(busy.saturating_sub(ours) as f64 * 100.0 / total as f64)
    }
}

/// The current UTC time as `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

/// Formats seconds since the Unix epoch as `YYYY-MM-DD HH:MM UTC`.
pub fn format_utc(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60
    )
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    // d is 1..=31 and m 1..=12 by construction.
    (
        y,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00 UTC");
        // 2000-02-29 12:34:56 UTC
        assert_eq!(format_utc(951_827_696), "2000-02-29 12:34 UTC");
        // 2024-12-31 23:59 UTC
        assert_eq!(format_utc(1_735_689_540), "2024-12-31 23:59 UTC");
    }

    #[test]
    fn others_share_subtracts_our_own_time() {
        let a = CpuTimes::parse(
            "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3\n",
            "42 (x) S 1 42 42 0 -1 0 0 0 0 0 10 10 0 0 20 0",
        )
        .expect("parsed");
        // 1000 more ticks in total, 600 of them busy, 200 of those ours.
        let b = CpuTimes::parse(
            "cpu  400 0 300 1300 0 0 0 0 0 0\n",
            "42 (x) S 1 42 42 0 -1 0 0 0 0 0 110 50 30 30 20 0",
        )
        .expect("parsed");
        let p = b.others_percent_since(&a).expect("share");
        assert!((p - 30.0).abs() < 1e-9, "{p}");
        assert!(CpuTimes::parse("garbage", "x").is_none());
    }

    #[test]
    fn detects_something() {
        let m = Machine::detect();
        assert!(m.cpus >= 1);
        assert!(m.summary().contains("CPUs"));
    }
}
