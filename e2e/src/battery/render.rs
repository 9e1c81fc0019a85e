//! The battery's tables: one row per cell with direct / sidecar / limit side by side.

use std::fmt::Write as _;

use super::analysis::{GOAL_AMPLIFICATION_SLACK, GOAL_SHARE, TOLERANCE_MS};
use super::{BatteryResult, CellResult};

fn ms(v: Option<f64>) -> String {
    match v {
        None => "-".to_owned(),
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.1}"),
    }
}

fn triple(d: Option<f64>, s: Option<f64>, l: Option<f64>) -> String {
    format!("{} / {} / {}", ms(d), ms(s), ms(l))
}

fn pct(v: f64) -> String {
    if v == 0.0 {
        "0".to_owned()
    } else if v < 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

fn verdict(c: &CellResult) -> String {
    if c.invariant.holds() {
        "holds".to_owned()
    } else {
        format!("**broken**: {}", c.invariant.violations().join("; "))
    }
}

fn share(c: &CellResult) -> String {
    match (c.share_p99, c.goal) {
        // Saving the failed requests (waiting out a storm's Retry-After) costs the limit
        // latency: its P99 of successes is not below direct's, the errors are.
        (None, _) if c.limit.p99 > c.direct.p99 => {
            "none on P99 (the limit saves errors)".to_owned()
        }
        (None, _) => "nothing to cut".to_owned(),
        (Some(s), Some(true)) => format!("{:.0} % (met)", s * 100.0),
        (Some(s), _) => format!("{:.0} %", s * 100.0),
    }
}

/// One progress line per cell.
pub(crate) fn cell_line(c: &CellResult) -> String {
    format!(
        "   P99 {} ms (direct / sidecar / limit), errors {} / {} / {} %, amplification {:.3} / {:.3}, cut {}, median added {} ms, hop P99 {} ms over {} relayed, never worse: {}",
        triple(c.direct.p99, c.sidecar.p99, c.limit.p99),
        pct(c.direct.error_percent),
        pct(c.sidecar.error_percent),
        pct(c.limit.error_percent),
        c.sidecar.amplification,
        c.limit.amplification,
        share(c),
        ms(c.invariant.median_added_ms),
        ms(c.hop.p99_ms),
        c.hop.relayed,
        verdict(c)
    )
}

/// The battery section of `docs/benchmarks.md`.
pub fn render_markdown(r: &BatteryResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Each cell runs the same open-loop streaming schedule ({} req/s for {} s, requests `r0`, `r1`, …) twice at the same time: straight at the topology's first provider (one attempt, {} s client timeout) and through tailwarden-sidecar (`e2e/battery/route.yaml`), against two identical upstream groups with keyed fates (seed {}), so the sidecar's first attempt of every request meets the fate its direct call met. *Limit* is the oracle (`e2e/src/oracle.rs`) on the very same fates: the best online policy with hindsight about hedge delays and provider health, within the route's limits (3 attempts, hedges ≤ 15 % of requests, Retry-After ≤ 2 s, 30 s deadline), plus the median that the cell's direct requests took over their fates (loopback, timers, load generator). Latencies are of successful requests, ms, direct / sidecar / limit. *Cut* = (direct − sidecar) / (direct − limit) on P99; goal ≥ {:.0} % at ≤ the limit's amplification + {GOAL_AMPLIFICATION_SLACK}. *Median added*: the sidecar's latency minus direct's for the same request, over requests both answered; *hop P99*: the same difference at P99 over the requests the sidecar only relayed (one attempt, no hedge, started at once) — loopback and scheduling on shared cores, the proxy's cost that `make bench` measures. *Never worse* judges what the policy did: on the answered-within-x curve (a failure counts as slower than any answer) every percentile P50…P99.9 through the sidecar ≤ direct + {TOLERANCE_MS} ms, and errors ≤ direct's, where a request the sidecar only relayed met direct's fate and counts as direct's outcome, and every request the policy acted on counts as measured (`e2e/src/battery/analysis.rs`).",
        r.rate,
        r.duration_s,
        60,
        r.seed,
        GOAL_SHARE * 100.0
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "| profile | topology | upstream | P50 | P99 | P99.9 | errors % | amplification (sidecar / limit) | cut | median added ms (hop P99) | never worse |"
    );
    let _ = writeln!(out, "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|");
    for c in &r.cells {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} / {} / {} | {:.3} / {:.3} | {} | {} ({}) | {} |",
            c.spec.profile,
            c.spec.topology.name(),
            c.spec.upstream.name(),
            triple(c.direct.p50, c.sidecar.p50, c.limit.p50),
            triple(c.direct.p99, c.sidecar.p99, c.limit.p99),
            triple(c.direct.p999, c.sidecar.p999, c.limit.p999),
            pct(c.direct.error_percent),
            pct(c.sidecar.error_percent),
            pct(c.limit.error_percent),
            c.sidecar.amplification,
            c.limit.amplification,
            share(c),
            ms(c.invariant.median_added_ms),
            ms(c.hop.p99_ms),
            verdict(c),
        );
    }
    for f in &r.failed {
        let _ = writeln!(out, "\nNot measured: `{}`: {}", f.spec.id(), f.error);
    }
    let holds = r.cells.iter().filter(|c| c.invariant.holds()).count();
    let met = r.cells.iter().filter(|c| c.goal == Some(true)).count();
    let cuttable = r.cells.iter().filter(|c| c.goal.is_some()).count();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Never worse holds in {holds} of {} cells; the goal is met in {met} of the {cuttable} cells with something to cut.",
        r.cells.len()
    );
    let fid: Vec<String> = r
        .cells
        .iter()
        .filter(|c| c.fidelity.within_10ms_percent < 99.0 || c.fidelity.same_outcome_percent < 99.0)
        .map(|c| {
            format!(
                "`{}` ({:.1} % same outcome, {:.1} % within 10 ms)",
                c.spec.id(),
                c.fidelity.same_outcome_percent,
                c.fidelity.within_10ms_percent
            )
        })
        .collect();
    let _ = writeln!(out);
    if fid.is_empty() {
        let _ = writeln!(
            out,
            "Model check: in every cell at least 99 % of direct requests ended as the fate model predicts (same success or failure, latency within 10 ms), so the limit column is computed on the fates the runs really met."
        );
    } else {
        let _ = writeln!(
            out,
            "Model check: direct requests that did not end as the fate model predicts in: {} (machine noise or an upstream that drifted from the model; the limit of those rows is less exact).",
            fid.join(", ")
        );
    }
    out
}
