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
    fn detects_something() {
        let m = Machine::detect();
        assert!(m.cpus >= 1);
        assert!(m.summary().contains("CPUs"));
    }
}
