//! The demo's side-by-side table and the lines that say how it was measured.
//!
//! One metric per row, the two phases as columns and a "change" column that states the
//! factor in words, so the table can be pasted into the README as it is. Missing numbers
//! (an interrupted run, no successful request) print as `-` rather than as zero.

use std::fmt::Write as _;

use super::{DemoOptions, DemoOutcome, Phase, SidecarCounters};
use crate::bench::{ErrorCounts, Percentiles, Report};
use crate::machine::Machine;
use crate::oracle::Summary;

/// Within this relative difference two numbers are "about the same".
const SAME: f64 = 0.05;

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0} ms"))
}

/// "4.8x lower", "1.3x higher", "about the same" for a lower-is-better metric.
fn change_lower_better(before: Option<f64>, after: Option<f64>) -> String {
    match (before, after) {
        (Some(b), Some(a)) if b > 0.0 && a > 0.0 => {
            if (a - b).abs() <= SAME * b {
                "about the same".to_owned()
            } else if a < b {
                format!("{:.1}x lower", b / a)
            } else {
                format!("{:.2}x higher", a / b)
            }
        }
        (Some(b), Some(a)) if b > 0.0 && a == 0.0 => "none left".to_owned(),
        (Some(b), Some(a)) if b == 0.0 && a == 0.0 => "-".to_owned(),
        _ => "-".to_owned(),
    }
}

fn pick(p: Option<&Phase>, f: impl Fn(&Report) -> Option<f64>) -> Option<f64> {
    p.and_then(|p| f(&p.report))
}

fn lat(r: &Report, f: fn(&Percentiles) -> f64) -> Option<f64> {
    r.latency_ms.as_ref().map(f)
}

/// Non-zero error classes, e.g. `5xx 48, 429 24, reset 30, timeout 12`.
pub fn error_classes(e: &ErrorCounts, timeout_s: f64) -> String {
    let parts: Vec<String> = [
        ("5xx", e.http_5xx),
        ("429", e.http_429),
        ("other 4xx", e.http_4xx),
        ("reset/cut", e.reset),
        ("connect", e.connect),
        ("bad response", e.bad_response),
    ]
    .iter()
    .filter(|(_, n)| *n > 0)
    .map(|(k, n)| format!("{k} {n}"))
    .chain((e.timeout > 0).then(|| format!("timeout ({timeout_s:.0} s) {}", e.timeout)))
    .collect();
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(", ")
    }
}

/// The whole demo output: header, table, notes.
pub fn render(outcome: &DemoOutcome, opts: &DemoOptions, command: &str, m: &Machine) -> String {
    let a = outcome.direct.as_ref();
    let b = outcome.sidecar.as_ref();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tailwarden demo{}: the same open-loop load, {} req/s for {} s of streaming chat completions each, seed {}",
        if outcome.interrupted {
            " (INTERRUPTED: partial results)"
        } else {
            ""
        },
        opts.rate,
        opts.duration.as_secs_f64(),
        opts.seed
    );
    let _ = writeln!(
        out,
        "  (a) direct:  straight at the primary, as a default client calls it (one attempt, {} s timeout, no retries)",
        opts.client_timeout.as_secs_f64()
    );
    let _ = writeln!(
        out,
        "  (b) sidecar: through tailwarden-sidecar with e2e/demo/route.yaml (primary, backup at priority 1, hedging, retries with a budget, breaker)"
    );
    let _ = writeln!(
        out,
        "  primary: {}   backup: {}",
        opts.primary.label, opts.backup.label
    );
    let _ = writeln!(out, "  machine: {}", m.summary());
    let _ = writeln!(out, "  command: {command}");
    out.push('\n');

    type Row<'a> = (&'a str, String, String, String, String);
    let mut rows: Vec<Row<'_>> = Vec::new();
    let l = outcome.limit.as_ref();
    type Pick = fn(&Percentiles) -> f64;
    type LimitPick = fn(&Summary) -> Option<f64>;
    let lat_rows: [(&str, Pick, LimitPick); 4] = [
        ("latency P50", |p| p.p50, |s| s.p50),
        ("latency P95", |p| p.p95, |s| s.p95),
        ("latency P99", |p| p.p99, |s| s.p99),
        ("latency P99.9", |p| p.p999, |s| s.p999),
    ];
    for (name, f, g) in lat_rows {
        let (x, y) = (pick(a, |r| lat(r, f)), pick(b, |r| lat(r, f)));
        rows.push((
            name,
            ms(x),
            ms(y),
            ms(l.and_then(g)),
            change_lower_better(x, y),
        ));
    }
    let ttft = |r: &Report| r.ttft_ms.as_ref().map(|p| p.p99);
    let (x, y) = (pick(a, ttft), pick(b, ttft));
    rows.push((
        "TTFT P99",
        ms(x),
        ms(y),
        ms(l.and_then(|s| s.ttft_p99)),
        change_lower_better(x, y),
    ));
    let err = |r: &Report| Some(r.error_rate_percent);
    let (x, y) = (pick(a, err), pick(b, err));
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2} %"));
    rows.push((
        "error rate",
        pct(x),
        pct(y),
        pct(l.map(|s| s.error_percent)),
        change_lower_better(x, y),
    ));
    let thr = |r: &Report| Some(r.throughput_rps);
    let (x, y) = (pick(a, thr), pick(b, thr));
    let rps = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1} req/s"));
    rows.push((
        "throughput (ok)",
        rps(x),
        rps(y),
        "-".to_owned(),
        String::new(),
    ));
    let (x, y) = (
        a.and_then(Phase::amplification),
        b.and_then(Phase::amplification),
    );
    let amp = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
    rows.push((
        "upstream amplification",
        amp(x),
        amp(y),
        amp(l.map(|s| s.amplification)),
        "upstream requests per client request".to_owned(),
    ));

    let _ = writeln!(
        out,
        "{:<24}{:>16}{:>16}{:>16}   change (a) to (b)",
        "", "(a) direct", "(b) sidecar", "limit"
    );
    for (name, x, y, z, c) in &rows {
        let _ = writeln!(out, "{name:<24}{x:>16}{y:>16}{z:>16}   {c}");
    }
    out.push('\n');

    let timeout_s = opts.client_timeout.as_secs_f64();
    for (label, p) in [("(a)", a), ("(b)", b)] {
        if let Some(p) = p {
            let r = &p.report;
            let _ = writeln!(
                out,
                "{label} {} requests, {} ok, {} failed: {}",
                r.requests.sent,
                r.requests.ok,
                r.requests.errors,
                error_classes(&r.errors, timeout_s)
            );
        }
    }
    if let Some(p) = b {
        let served: Vec<String> = p
            .report
            .upstream
            .providers
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let upstream: Vec<String> = p.upstream.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            out,
            "(b) responses served by: {}; requests the simulators received: {}",
            if served.is_empty() {
                "-".to_owned()
            } else {
                served.join(", ")
            },
            upstream.join(", ")
        );
    }
    if let Some(c) = &outcome.counters {
        let _ = writeln!(out, "(b) sidecar counters: {}", counters_line(c));
    }
    let _ = writeln!(
        out,
        "Latency is measured from each request's scheduled start (open loop); failed requests are counted in the error rate, not in the percentiles."
    );
    let _ = writeln!(
        out,
        "Amplification = chat requests received by the simulated providers / client requests. A stream cut after its first token cannot be retried by anyone."
    );
    let _ = writeln!(
        out,
        "Limit = the best any proxy could do on these very requests (the simulators give request r<i> the same fate on its first attempt in both phases): the oracle of e2e/src/oracle.rs, the best online policy with hindsight about hedge delays and provider health within the route's limits (3 attempts, hedges <= 15 % of requests, Retry-After <= 2 s). No proxy beats a stream's own generation time."
    );
    out
}

fn counters_line(c: &SidecarCounters) -> String {
    let n = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    format!(
        "retries {} (refused by the budget {}), hedges started {} (won {})",
        n(c.retries),
        n(c.retries_refused),
        n(c.hedges_started),
        n(c.hedges_won)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn change_words() {
        assert_eq!(
            change_lower_better(Some(1000.0), Some(100.0)),
            "10.0x lower"
        );
        assert_eq!(
            change_lower_better(Some(100.0), Some(102.0)),
            "about the same"
        );
        assert_eq!(
            change_lower_better(Some(100.0), Some(150.0)),
            "1.50x higher"
        );
        assert_eq!(change_lower_better(Some(4.8), Some(0.0)), "none left");
        assert_eq!(change_lower_better(None, Some(1.0)), "-");
    }

    #[test]
    fn error_class_list() {
        let e = ErrorCounts {
            http_5xx: 3,
            timeout: 2,
            ..ErrorCounts::default()
        };
        assert_eq!(error_classes(&e, 60.0), "5xx 3, timeout (60 s) 2");
        assert_eq!(error_classes(&ErrorCounts::default(), 60.0), "none");
    }
}
