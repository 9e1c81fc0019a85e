//! Renders a [`BenchmarkResult`] as the Markdown of `docs/benchmarks.md` (also printed to
//! the terminal, where Markdown tables read fine as text).
//!
//! "Added" latency is the proxy's percentile minus the direct run's percentile at the same
//! rate in the same run; ratios compare a peer's added latency with the sidecar's. The
//! project's own goals are checked at the end and every miss is stated with its size, since
//! a benchmark page that only lists wins is not worth reading.

use std::fmt::Write as _;

use super::{BenchmarkResult, TailCut, TargetKind, TargetResult};
use crate::bench::Report;
use crate::demo::Phase;

fn f3(v: f64) -> String {
    format!("{v:.3}")
}

fn opt(v: Option<f64>, f: fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_owned(), f)
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or_else(|| "-".to_owned(), |k| format!("{:.1}", k as f64 / 1024.0))
}

fn p50(r: &Report) -> Option<f64> {
    r.latency_ms.as_ref().map(|p| p.p50)
}

fn p99(r: &Report) -> Option<f64> {
    r.latency_ms.as_ref().map(|p| p.p99)
}

fn diff(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? - b?)
}

/// `peer / sidecar` of two added latencies, when the sidecar's is measurably positive.
fn ratio(peer: Option<f64>, sidecar: Option<f64>) -> Option<f64> {
    match (peer, sidecar) {
        (Some(p), Some(s)) if s > 0.0005 && p > 0.0005 => Some(p / s),
        _ => None,
    }
}

fn x(v: f64) -> String {
    format!("{v:.1}x")
}

/// A Markdown table with padded columns.
struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
    /// Leading columns that are text (left-aligned); the rest are numbers.
    text_cols: usize,
}

impl Table {
    fn new(head: &[&str]) -> Self {
        Self {
            head: head.iter().map(|s| (*s).to_owned()).collect(),
            rows: Vec::new(),
            text_cols: 1,
        }
    }

    fn text_cols(mut self, n: usize) -> Self {
        self.text_cols = n;
        self
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self, out: &mut String) {
        let n = self.head.len();
        let mut w: Vec<usize> = self.head.iter().map(|h| h.chars().count().max(3)).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String], out: &mut String| {
            out.push('|');
            for (i, width) in w.iter().enumerate() {
                let c = cells.get(i).map_or("", String::as_str);
                let pad = width.saturating_sub(c.chars().count());
                if i < self.text_cols {
                    let _ = write!(out, " {c}{} |", " ".repeat(pad));
                } else {
                    let _ = write!(out, " {}{c} |", " ".repeat(pad));
                }
            }
            out.push('\n');
        };
        line(&self.head, out);
        out.push('|');
        for (i, width) in w.iter().enumerate() {
            let dashes = "-".repeat(*width);
            if i < self.text_cols {
                let _ = write!(out, " {dashes} |");
            } else {
                let _ = write!(out, " {}: |", &dashes[1..]);
            }
        }
        out.push('\n');
        for r in &self.rows {
            line(r, out);
        }
        out.push('\n');
    }
}

/// Mean of `f` over the direct runs (before and after the proxies): the baseline that every
/// "added" number subtracts. Averaging the two halves the effect of a disturbance in one.
fn baseline(res: &BenchmarkResult, f: impl Fn(&TargetResult) -> Option<f64>) -> Option<f64> {
    let v: Vec<f64> = res
        .targets
        .iter()
        .filter(|t| t.kind == TargetKind::Direct && t.unavailable.is_none())
        .filter_map(f)
        .collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// How far apart the two direct runs' P99 are at `rate`: differences smaller than this
/// are run-to-run noise, not proxy overhead.
fn noise99(res: &BenchmarkResult, rate: f64) -> f64 {
    let v: Vec<f64> = res
        .targets
        .iter()
        .filter(|t| t.kind == TargetKind::Direct)
        .filter_map(|t| t.at_rate(rate).and_then(p99))
        .collect();
    match v.as_slice() {
        [a, b, ..] => (a - b).abs(),
        _ => 0.0,
    }
}

fn measured(res: &BenchmarkResult) -> impl Iterator<Item = &TargetResult> {
    res.targets.iter().filter(|t| t.unavailable.is_none())
}

/// The first line of a failure reason, at most 200 characters (the full text is in the
/// run's stderr and the target's log).
fn short_reason(why: &str) -> String {
    let first = why.lines().next().unwrap_or("").trim_end_matches(':');
    let mut s: String = first.chars().take(200).collect();
    if first.chars().count() > 200 {
        s.push_str(" ...");
    }
    s
}

/// The full Markdown page.
pub fn render_markdown(res: &BenchmarkResult) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Benchmarks\n");
    let _ = writeln!(
        out,
        "Generated by `make bench` — every number below was measured in one run of it, on the machine named here; nothing is copied from elsewhere. Re-run `make bench` to regenerate this file.\n"
    );
    if res.interrupted {
        let _ = writeln!(
            out,
            "**This run was interrupted: the results are partial.**\n"
        );
    }
    let _ = writeln!(out, "- command: `{}`", res.command);
    let la = |v: Option<f64>| opt(v, |v| format!("{v:.2}"));
    let _ = writeln!(
        out,
        "- machine: {} (1-minute load average {} at the start, {} at the end)",
        res.machine,
        la(res.load_average.0),
        la(res.load_average.1)
    );
    let _ = writeln!(
        out,
        "- wall time of the run: {:.0} s (plus peer installation and the release build)",
        res.wall_s
    );
    let _ = writeln!(
        out,
        "- upstream: `tailwarden-sim --profile instant` for non-streaming runs; a paced profile (`e2e/bench/paced-profile.yaml`: 20 tokens 5 ms apart) for streaming runs; both separate processes on loopback"
    );
    let _ = writeln!(
        out,
        "- load: the in-process `tailwarden-bench` library, open loop (latency from each request's scheduled start), {} s warm-up + {} s measured per run, client timeout {} s; the load generator, the simulators and the proxy under test share the machine's CPUs\n",
        res.warmup_s, res.duration_s, res.timeout_s
    );

    // A busy machine makes millisecond-level P99 differences meaningless; say so up front.
    // The CPU share of other processes is the measure; results without it fall back to the
    // load average at the start (which includes whatever ran just before, e.g. the build).
    let cpus = res
        .machine
        .split_whitespace()
        .next()
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or(1.0);
    match res.others_cpu_percent {
        Some(p) => {
            let _ = writeln!(
                out,
                "- other processes on the machine used {p:.1} % of its CPU time during the run\n"
            );
            if p > 10.0 {
                let _ = writeln!(
                    out,
                    "**The machine was busy during this run**: other processes used {p:.1} % of its CPU time, so P99 differences of a few milliseconds between targets are not meaningful here; the large differences are. Re-run `make bench` on a quiet machine for the small ones.\n"
                );
            }
        }
        None => {
            if let Some(la) = res.load_average.0.filter(|la| *la > cpus * 0.5) {
                let _ = writeln!(
                    out,
                    "**The machine was busy when this run started** (1-minute load average {la:.2} on {cpus:.0} CPUs, which includes the release build `make bench` runs just before and any other work on the machine), so P99 differences of a few milliseconds between targets are not meaningful here; the large differences are. Re-run `make bench` on a quiet machine for the small ones.\n"
                );
            }
        }
    }
    let noise = res
        .rates
        .iter()
        .map(|&r| noise99(res, r))
        .fold(0.0_f64, f64::max);

    let _ = writeln!(out, "## Goals\n");
    for l in targets_summary(res) {
        let _ = writeln!(out, "- {l}");
    }
    out.push('\n');

    let _ = writeln!(out, "## What ran\n");
    let mut t = Table::new(&["target", "version", "configuration", "status"]).text_cols(4);
    for r in &res.targets {
        t.row(vec![
            r.label.clone(),
            r.version.clone(),
            r.how.clone(),
            match &r.unavailable {
                None if r.notes.is_empty() => "measured".to_owned(),
                None => format!("measured; {}", r.notes.join("; ")),
                Some(why) => format!("**not measured**: {}", short_reason(why)),
            },
        ]);
    }
    t.render(&mut out);

    let sidecar = res.target(TargetKind::Sidecar);

    let _ = writeln!(out, "## Added latency, non-streaming\n");
    let _ = writeln!(
        out,
        "Latency in ms. *Added* = the target's percentile minus the baseline: the mean of the two direct runs at that rate (one before all proxies, one after them; their difference is the run-to-run noise). *vs sidecar* = the target's added P99 divided by the sidecar's.\n"
    );
    let mut t = Table::new(&[
        "rate req/s",
        "target",
        "p50",
        "p99",
        "added p50",
        "added p99",
        "added p99 vs sidecar",
        "errors %",
        "throughput req/s",
    ])
    .text_cols(2);
    for &rate in &res.rates {
        let b50 = baseline(res, |t| t.at_rate(rate).and_then(p50));
        let b99 = baseline(res, |t| t.at_rate(rate).and_then(p99));
        let s_added = diff(sidecar.and_then(|s| s.at_rate(rate)).and_then(p99), b99);
        for target in measured(res) {
            let run = target.rates.iter().find(|r| (r.rate - rate).abs() < 1e-9);
            match run.and_then(|r| r.report.as_ref()) {
                Some(r) => {
                    let is_direct = target.kind == TargetKind::Direct;
                    let a50 = diff(p50(r), b50).filter(|_| !is_direct);
                    let a99 = diff(p99(r), b99).filter(|_| !is_direct);
                    t.row(vec![
                        format!("{rate}"),
                        target.label.clone(),
                        opt(p50(r), f3),
                        opt(p99(r), f3),
                        opt(a50, f3),
                        opt(a99, f3),
                        if is_direct || target.kind == TargetKind::Sidecar {
                            "-".to_owned()
                        } else {
                            opt(ratio(a99, s_added), x)
                        },
                        format!("{:.2}", r.error_rate_percent),
                        format!("{:.1}", r.throughput_rps),
                    ]);
                }
                None => {
                    let why = run
                        .and_then(|r| r.skipped.clone())
                        .unwrap_or_else(|| "not run".to_owned());
                    t.row(vec![format!("{rate}"), target.label.clone(), why]);
                }
            }
        }
    }
    t.render(&mut out);

    if let Some(rate) = res
        .targets
        .iter()
        .find_map(|t| t.stream.as_ref().and_then(|r| r.offered_rate_rps))
    {
        let _ = writeln!(
            out,
            "## Streaming: time to first token and inter-token gaps\n"
        );
        let _ = writeln!(
            out,
            "{rate} req/s of streamed chat completions from the paced upstream (20 tokens, 5 ms apart). ms; added = minus the mean of the two direct runs. A proxy that re-buffers a stream shows a TTFT near the whole stream's length (~100 ms) and gaps near zero.\n"
        );
        type Pick = fn(&crate::bench::Percentiles) -> f64;
        let ttft = |r: &Report, f: Pick| r.ttft_ms.as_ref().map(f);
        let gap = |r: &Report, f: Pick| r.inter_token_ms.as_ref().map(f);
        let base_ttft = |f: Pick| baseline(res, |t| t.stream.as_ref().and_then(|r| ttft(r, f)));
        let base_gap = |f: Pick| baseline(res, |t| t.stream.as_ref().and_then(|r| gap(r, f)));
        let s_added = diff(
            sidecar
                .and_then(|s| s.stream.as_ref())
                .and_then(|r| ttft(r, |p| p.p99)),
            base_ttft(|p| p.p99),
        );
        let mut t = Table::new(&[
            "target",
            "TTFT p50",
            "TTFT p99",
            "added TTFT p50",
            "added TTFT p99",
            "added TTFT p99 vs sidecar",
            "gap p50",
            "gap p99",
            "added gap p99",
            "errors %",
        ]);
        for target in measured(res) {
            let Some(r) = target.stream.as_ref() else {
                t.row(vec![target.label.clone(), "not run".to_owned()]);
                continue;
            };
            let is_direct = target.kind == TargetKind::Direct;
            let added = |v: Option<f64>, base: Option<f64>| diff(v, base).filter(|_| !is_direct);
            let a99 = added(ttft(r, |p| p.p99), base_ttft(|p| p.p99));
            t.row(vec![
                target.label.clone(),
                opt(ttft(r, |p| p.p50), f3),
                opt(ttft(r, |p| p.p99), f3),
                opt(added(ttft(r, |p| p.p50), base_ttft(|p| p.p50)), f3),
                opt(a99, f3),
                if is_direct || target.kind == TargetKind::Sidecar {
                    "-".to_owned()
                } else {
                    opt(ratio(a99, s_added), x)
                },
                opt(gap(r, |p| p.p50), f3),
                opt(gap(r, |p| p.p99), f3),
                opt(added(gap(r, |p| p.p99), base_gap(|p| p.p99)), f3),
                format!("{:.2}", r.error_rate_percent),
            ]);
        }
        t.render(&mut out);
    }

    let _ = writeln!(out, "## Saturation throughput\n");
    let _ = writeln!(
        out,
        "Closed loop, {} connections sending back to back for {} s, non-streaming; the load generator and the simulator share the CPUs with the proxy, so this is the throughput of the whole loop on this machine, not of the proxy alone.\n",
        res.saturation_workers, res.saturation_duration_s
    );
    let s_thr = sidecar
        .and_then(|s| s.saturation.as_ref())
        .map(|r| r.throughput_rps);
    let mut t = Table::new(&[
        "target",
        "req/s",
        "vs sidecar",
        "p50 ms",
        "p99 ms",
        "errors %",
    ]);
    for target in measured(res) {
        let Some(r) = target.saturation.as_ref() else {
            t.row(vec![target.label.clone(), "not run".to_owned()]);
            continue;
        };
        t.row(vec![
            target.label.clone(),
            format!("{:.0}", r.throughput_rps),
            match s_thr {
                Some(s) if s > 0.0 && target.kind != TargetKind::Sidecar => {
                    format!("{:.2}x", r.throughput_rps / s)
                }
                _ => "-".to_owned(),
            },
            opt(p50(r), f3),
            opt(p99(r), f3),
            format!("{:.2}", r.error_rate_percent),
        ]);
    }
    t.render(&mut out);

    let _ = writeln!(out, "## Memory\n");
    let _ = writeln!(
        out,
        "Resident set size (`VmRSS` from `/proc/PID/status`, summed over the proxy's process group: nginx's workers and LiteLLM's uvicorn workers count). Idle = after start-up and two smoke requests; peak = highest of samples every 200 ms during all its runs. *Idle private* is the anonymous part of idle (`RssAnon`: heap, stacks): the rest is pages of the binary and its libraries, which every copy started from the same file (every sidecar on a node using the same image) shares through the page cache.\n"
    );
    let mut t = Table::new(&[
        "target",
        "idle MiB",
        "idle private MiB",
        "peak under load MiB",
        "processes",
    ]);
    for target in measured(res).filter(|t| t.kind != TargetKind::Direct) {
        t.row(vec![
            target.label.clone(),
            mib(target.rss_idle_kib),
            mib(target.rss_idle_anon_kib),
            mib(target.rss_peak_kib),
            target.processes.to_string(),
        ]);
    }
    t.render(&mut out);

    if !res.tailcut.is_empty() {
        let _ = writeln!(out, "## Tail cut: flaky and brownout providers\n");
        let _ = writeln!(
            out,
            "The same open-loop streaming load (a) straight at a primary with the named simulator profile, one attempt and a 60 s timeout like a default client, and (b) through tailwarden-sidecar with `e2e/demo/route.yaml` and a backup provider (`realistic` profile). Amplification = chat requests the simulators received per client request. Same seed for both primaries.\n"
        );
        for tc in &res.tailcut {
            render_tailcut(tc, &mut out);
        }
    }

    if let Some(b) = &res.battery {
        let _ = writeln!(
            out,
            "## Never worse than direct, and how close to the limit: the battery\n"
        );
        let _ = writeln!(out, "{}", crate::battery::render_markdown(b));
    }

    let _ = writeln!(out, "## Method notes\n");
    let _ = writeln!(
        out,
        "- One target runs at a time; its process is started before its runs and stopped after them. Each fixed-rate run has its own warm-up. A target that could not keep up at a rate (≥ 20 % errors or < 80 % of the offered throughput) is not run at the higher rates.\n\
         - Open-loop runs cap in-flight requests at a safety limit; a request that had to wait for a slot still counts from its scheduled start, so an overloaded proxy shows up in P99 rather than vanishing.\n\
         - Every proxy runs its plain production setup for this machine's core count (see *What ran*); none is tuned beyond that. Peers are installed pinned by `e2e/bench/install-peers.sh` into `.cache/peers/`.\n\
         - Noise: the two direct runs' non-streaming P99 differ by up to {noise:.3} ms in this run; differences between targets smaller than that are run-to-run noise, and ratios of such small numbers mean little."
    );
    out
}

fn render_tailcut(tc: &TailCut, out: &mut String) {
    let _ = writeln!(
        out,
        "### `{}` ({} s per phase)\n",
        tc.profile, tc.duration_s
    );
    let o = match &tc.outcome {
        Ok(o) => o,
        Err(e) => {
            let _ = writeln!(out, "**Did not run**: {e}\n");
            return;
        }
    };
    let (Some(a), Some(b)) = (&o.direct, &o.sidecar) else {
        let _ = writeln!(out, "**Incomplete** (interrupted).\n");
        return;
    };
    let mut t = Table::new(&["", "(a) direct", "(b) sidecar", "change"]);
    let ms0 = |v: Option<f64>| opt(v, |v| format!("{v:.0} ms"));
    let lower = |d: Option<f64>, s: Option<f64>| match (d, s) {
        (Some(d), Some(s)) if s > 0.0 => format!("{:.1}x lower", d / s),
        (Some(d), Some(s)) if d > 0.0 && s == 0.0 => "none left".to_owned(),
        _ => "-".to_owned(),
    };
    type Metric = fn(&Report) -> Option<f64>;
    let rows: [(&str, Metric); 5] = [
        ("latency P50", |r| r.latency_ms.as_ref().map(|p| p.p50)),
        ("latency P95", |r| r.latency_ms.as_ref().map(|p| p.p95)),
        ("latency P99", |r| r.latency_ms.as_ref().map(|p| p.p99)),
        ("latency P99.9", |r| r.latency_ms.as_ref().map(|p| p.p999)),
        ("TTFT P99", |r| r.ttft_ms.as_ref().map(|p| p.p99)),
    ];
    for (name, f) in rows {
        let (d, s) = (f(&a.report), f(&b.report));
        t.row(vec![name.to_owned(), ms0(d), ms0(s), lower(d, s)]);
    }
    t.row(vec![
        "error rate".to_owned(),
        format!("{:.3} %", a.report.error_rate_percent),
        format!("{:.3} %", b.report.error_rate_percent),
        lower(
            Some(a.report.error_rate_percent),
            Some(b.report.error_rate_percent),
        ),
    ]);
    let amp = |p: &Phase| opt(p.amplification(), |v| format!("{v:.3}"));
    t.row(vec![
        "upstream amplification".to_owned(),
        amp(a),
        amp(b),
        String::new(),
    ]);
    t.row(vec![
        "requests (failed)".to_owned(),
        format!("{} ({})", a.report.requests.sent, a.report.requests.errors),
        format!("{} ({})", b.report.requests.sent, b.report.requests.errors),
        String::new(),
    ]);
    t.render(out);
    let _ = writeln!(
        out,
        "Errors (a): {}. Errors (b): {}.",
        crate::demo::error_classes(&a.report.errors, 60.0),
        crate::demo::error_classes(&b.report.errors, 60.0)
    );
    if let Some(c) = &o.counters {
        let n = |v: Option<f64>| opt(v, |v| format!("{v:.0}"));
        let _ = writeln!(
            out,
            "Sidecar: retries {}, refused by the retry budget {}, hedges started {} (won {}); upstream requests {}.",
            n(c.retries),
            n(c.retries_refused),
            n(c.hedges_started),
            n(c.hedges_won),
            b.upstream
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    out.push('\n');
}

/// "met" / "MISSED ..." lines for the project's goals, computed from this run.
pub fn targets_summary(res: &BenchmarkResult) -> Vec<String> {
    let mut lines = Vec::new();
    let sidecar = res.target(TargetKind::Sidecar);
    let added99 = |t: Option<&TargetResult>, rate: f64| {
        diff(
            t.and_then(|t| t.at_rate(rate)).and_then(p99),
            baseline(res, |d| d.at_rate(rate).and_then(p99)),
        )
    };
    // (peer, the sidecar's added P99 must be at most this fraction of the peer's)
    let goals = [
        (TargetKind::Nginx, 2.0, "≤ 2× nginx's"),
        (TargetKind::Portkey, 0.2, "≤ 1/5 of Portkey's"),
        (TargetKind::Litellm, 0.05, "≤ 1/20 of LiteLLM's"),
    ];
    for (peer, factor, label) in goals {
        let pt = res.target(peer);
        if pt.is_none() {
            lines.push(format!(
                "sidecar added P99 {label}: not checked, {} was not among the targets of this run",
                peer.name()
            ));
            continue;
        }
        if let Some(why) = pt.and_then(|p| p.unavailable.as_ref()) {
            lines.push(format!(
                "sidecar added P99 {label}: not checked, {} was not measured ({})",
                peer.name(),
                short_reason(why)
            ));
            continue;
        }
        let mut parts = Vec::new();
        let (mut missed, mut unsure, mut any) = (false, false, false);
        for &rate in &res.rates {
            let (Some(s), Some(p)) = (added99(sidecar, rate), added99(pt, rate)) else {
                continue;
            };
            any = true;
            let noise = noise99(res, rate);
            let limit = (p * factor).max(0.0);
            if s <= limit {
                parts.push(format!("{rate} req/s: {s:.3} vs {p:.3} ms, met"));
            } else if s <= noise {
                unsure = true;
                parts.push(format!(
                    "{rate} req/s: {s:.3} vs {p:.3} ms, inconclusive (both within the ±{noise:.3} ms the two direct runs differ by)"
                ));
            } else {
                missed = true;
                parts.push(format!(
                    "{rate} req/s: {s:.3} vs {p:.3} ms, MISSED by {:.3} ms (noise ±{noise:.3} ms)",
                    s - limit
                ));
            }
        }
        if any {
            lines.push(format!(
                "sidecar added P99 {label} — {}: {}",
                if missed {
                    "MISSED"
                } else if unsure {
                    "not decided by this run"
                } else {
                    "met"
                },
                parts.join("; ")
            ));
        } else {
            lines.push(format!(
                "sidecar added P99 {label}: not checked (no rate with both results)"
            ));
        }
    }
    match sidecar.and_then(|s| s.rss_idle_kib) {
        Some(kib) => {
            let mb = kib as f64 / 1024.0;
            let private = sidecar
                .and_then(|s| s.rss_idle_anon_kib)
                .map(|anon| {
                    format!(
                        " (private {:.1} MiB, the rest is shared code pages)",
                        anon as f64 / 1024.0
                    )
                })
                .unwrap_or_default();
            lines.push(if mb <= 15.0 {
                format!("sidecar idle RSS ≤ 15 MiB — met: {mb:.1} MiB{private}")
            } else {
                format!(
                    "sidecar idle RSS ≤ 15 MiB — MISSED: {mb:.1} MiB ({:.0} % over){private}",
                    (mb / 15.0 - 1.0) * 100.0
                )
            });
        }
        None => lines.push("sidecar idle RSS ≤ 15 MiB: not measured".to_owned()),
    }
    // The tail cut is judged against each cell's physical limit (the battery), not against a
    // fixed factor: no proxy can cut total latency below the stream's own generation time.
    if let Some(b) = &res.battery {
        let broken: Vec<String> = b
            .cells
            .iter()
            .filter(|c| !c.invariant.holds())
            .map(|c| format!("`{}`", c.spec.id()))
            .collect();
        lines.push(if broken.is_empty() {
            format!(
                "never worse than direct — met in all {} battery cells",
                b.cells.len()
            )
        } else {
            format!(
                "never worse than direct — MISSED in {} of {} battery cells: {}",
                broken.len(),
                b.cells.len(),
                broken.join(", ")
            )
        });
        let cuttable: Vec<_> = b.cells.iter().filter(|c| c.goal.is_some()).collect();
        let missed: Vec<String> = cuttable
            .iter()
            .filter(|c| c.goal == Some(false))
            .map(|c| {
                format!(
                    "`{}` {}",
                    c.spec.id(),
                    c.share_p99
                        .map_or_else(|| "-".to_owned(), |s| format!("{:.0} %", s * 100.0))
                )
            })
            .collect();
        lines.push(if missed.is_empty() {
            format!(
                "≥ 85 % of the possible P99 cut at ≤ the limit's amplification + 0.05 — met in all {} cells with something to cut",
                cuttable.len()
            )
        } else {
            format!(
                "≥ 85 % of the possible P99 cut at ≤ the limit's amplification + 0.05 — MISSED in {} of {} cells with something to cut: {}",
                missed.len(),
                cuttable.len(),
                missed.join(", ")
            )
        });
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_aligned_markdown() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["long cell".to_owned(), "1".to_owned()]);
        let mut out = String::new();
        t.render(&mut out);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "| a         |  bb |");
        assert_eq!(lines[1], "| --------- | --: |");
        assert_eq!(lines[2], "| long cell |   1 |");
    }

    #[test]
    fn ratio_needs_a_positive_sidecar_number() {
        assert_eq!(ratio(Some(10.0), Some(2.0)), Some(5.0));
        assert_eq!(ratio(Some(10.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }
}
