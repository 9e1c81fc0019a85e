//! Judging one battery cell: the never-worse invariant, request by request, and the share of
//! the possible cut, against the oracle's limit. Pure functions of the two runs' records.
//!
//! "Never worse" is checked on the *answered-within-x* curve: a failed request counts as
//! slower than any answer, and through the sidecar every percentile from P50 to P99.9 must be
//! at most direct's plus [`TOLERANCE_MS`], with no more errors. This is the right order for a
//! proxy whose job includes turning errors into answers: percentiles over successes alone
//! would call it worse for every slow answer it saved (direct never had to count those).
//! Because the upstream gives the sidecar's first attempt of request *i* the very fate the
//! direct call of request *i* met, a proxy that never makes a request slower passes with
//! certainty; the check is about policy, not about sampling luck.

use serde::{Deserialize, Serialize};

use crate::bench::RequestRecord;
use crate::oracle::{Outcome, Summary, percentile};

/// How much slower than direct any percentile may be through the sidecar (issue #15).
pub const TOLERANCE_MS: f64 = 1.0;

/// The percentiles the invariant checks.
pub const CHECKED: [f64; 6] = [50.0, 90.0, 95.0, 99.0, 99.5, 99.9];

/// Below this gap between direct and the limit (ms, or 2 % of direct) there is nothing to cut
/// and the share of the cut is not reported.
pub const NOTHING_TO_CUT_MS: f64 = 5.0;

/// The goal: this share of the way from direct to the limit on P99.
pub const GOAL_SHARE: f64 = 0.85;

/// ... at no more than the limit's amplification plus this.
pub const GOAL_AMPLIFICATION_SLACK: f64 = 0.05;

/// Outcomes by request index from a run's records; a request without a record (unfinished)
/// counts as failed.
pub fn outcomes(records: &[RequestRecord], requests: usize) -> Vec<Outcome> {
    let mut out = vec![Outcome::Failed; requests];
    for r in records {
        if let Some(slot) = usize::try_from(r.index).ok().and_then(|i| out.get_mut(i))
            && r.ok
        {
            *slot = Outcome::Ok {
                latency_ms: r.latency_ms,
                ttft_ms: r.ttft_ms.unwrap_or(r.latency_ms),
            };
        }
    }
    out
}

/// One percentile of the answered-within-x curve; `None` where the percentile falls among
/// failed requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// Percentile.
    pub p: f64,
    /// Direct, ms.
    pub direct: Option<f64>,
    /// Through the sidecar, ms.
    pub sidecar: Option<f64>,
    /// Sidecar ≤ direct + tolerance (a failed direct percentile is beaten by anything).
    pub ok: bool,
}

/// The never-worse verdict of one cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Invariant {
    /// Per percentile.
    pub checks: Vec<Check>,
    /// Failed requests, direct.
    pub errors_direct: u64,
    /// Failed requests, through the sidecar.
    pub errors_sidecar: u64,
    /// Requests the sidecar made slower by more than the tolerance (or failed where direct
    /// answered), for reading what went wrong; not part of the verdict.
    pub slower_requests: u64,
    /// The worst of them: (index, direct ms, sidecar ms), `None` for a failure.
    pub worst: Vec<(u64, Option<f64>, Option<f64>)>,
    /// Median of sidecar minus direct latency over requests both answered, ms: what the
    /// sidecar typically adds to (or saves on) one request.
    pub median_added_ms: Option<f64>,
}

impl Invariant {
    /// Every percentile within tolerance and no more errors.
    pub fn holds(&self) -> bool {
        self.checks.iter().all(|c| c.ok) && self.errors_sidecar <= self.errors_direct
    }

    /// What broke, for a test message or a table cell.
    pub fn violations(&self) -> Vec<String> {
        let fmt = |v: Option<f64>| v.map_or_else(|| "failed".to_owned(), |v| format!("{v:.1}"));
        let mut out: Vec<String> = self
            .checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| {
                format!(
                    "P{} {} > {} ms",
                    c.p,
                    fmt(c.sidecar),
                    fmt(c.direct.map(|d| d + TOLERANCE_MS))
                )
            })
            .collect();
        if self.errors_sidecar > self.errors_direct {
            out.push(format!(
                "errors {} > {}",
                self.errors_sidecar, self.errors_direct
            ));
        }
        out
    }
}

fn sorted_with_failures(o: &[Outcome]) -> Vec<f64> {
    let mut v: Vec<f64> = o.iter().map(Outcome::latency_or_inf).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Checks the invariant on two runs of the same requests.
pub fn never_worse(direct: &[Outcome], sidecar: &[Outcome]) -> Invariant {
    let (d, s) = (sorted_with_failures(direct), sorted_with_failures(sidecar));
    let finite = |v: Option<f64>| v.filter(|x| x.is_finite());
    let checks = CHECKED
        .iter()
        .map(|&p| {
            let (dp, sp) = (finite(percentile(&d, p)), finite(percentile(&s, p)));
            let ok = match (dp, sp) {
                (None, _) => true,
                (Some(_), None) => false,
                (Some(a), Some(b)) => b <= a + TOLERANCE_MS,
            };
            Check {
                p,
                direct: dp,
                sidecar: sp,
                ok,
            }
        })
        .collect();
    let errors = |o: &[Outcome]| o.iter().filter(|o| matches!(o, Outcome::Failed)).count() as u64;
    let mut slower: Vec<(u64, f64, f64)> = direct
        .iter()
        .zip(sidecar)
        .enumerate()
        .map(|(i, (a, b))| (i as u64, a.latency_or_inf(), b.latency_or_inf()))
        .filter(|(_, a, b)| *b > *a + TOLERANCE_MS)
        .collect();
    // Worst first: failures where direct answered, then the largest slow-downs.
    slower.sort_by(|x, y| {
        let gap = |(_, a, b): &(u64, f64, f64)| if b.is_infinite() { f64::MAX } else { b - a };
        gap(y).total_cmp(&gap(x))
    });
    let mut added: Vec<f64> = direct
        .iter()
        .zip(sidecar)
        .map(|(a, b)| b.latency_or_inf() - a.latency_or_inf())
        .filter(|x| x.is_finite())
        .collect();
    added.sort_by(f64::total_cmp);
    Invariant {
        checks,
        median_added_ms: percentile(&added, 50.0),
        errors_direct: errors(direct),
        errors_sidecar: errors(sidecar),
        slower_requests: slower.len() as u64,
        worst: slower
            .iter()
            .take(5)
            .map(|&(i, a, b)| (i, finite(Some(a)), finite(Some(b))))
            .collect(),
    }
}

/// (direct − sidecar) / (direct − limit) on the given percentile; `None` when the limit is
/// within [`NOTHING_TO_CUT_MS`] (or 2 %) of direct, i.e. there is nothing to cut.
pub fn share_of_cut(direct: Option<f64>, sidecar: Option<f64>, limit: Option<f64>) -> Option<f64> {
    let (d, s, l) = (direct?, sidecar?, limit?);
    let room = d - l;
    (room > NOTHING_TO_CUT_MS.max(0.02 * d)).then(|| (d - s) / room)
}

/// How closely a measured run followed the fates the oracle predicts for it: the check that
/// the upstream really implements the fate model (a Python server that drifted would make
/// every limit in its rows meaningless).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fidelity {
    /// Requests whose success or failure matched the prediction, percent.
    pub same_outcome_percent: f64,
    /// Of the requests that succeeded in both, those within 10 ms of the predicted latency,
    /// percent.
    pub within_10ms_percent: f64,
    /// Median of measured minus predicted latency, ms (the loopback and timer cost).
    pub median_excess_ms: Option<f64>,
    /// Successes that came more than 1 ms *earlier* than predicted: timers only ever fire
    /// late, so any of these means the upstream does not implement the model.
    pub early: u64,
}

/// Compares a measured run with its predicted outcomes.
pub fn fidelity(measured: &[Outcome], predicted: &[Outcome]) -> Fidelity {
    let n = measured.len().min(predicted.len());
    let mut same = 0usize;
    let mut diffs = Vec::new();
    for (m, p) in measured.iter().zip(predicted) {
        match (m, p) {
            (Outcome::Ok { latency_ms: a, .. }, Outcome::Ok { latency_ms: b, .. }) => {
                same += 1;
                diffs.push(a - b);
            }
            (Outcome::Failed, Outcome::Failed) => same += 1,
            _ => {}
        }
    }
    let within = diffs.iter().filter(|d| d.abs() <= 10.0).count();
    let early = diffs.iter().filter(|d| **d < -1.0).count() as u64;
    diffs.sort_by(f64::total_cmp);
    Fidelity {
        same_outcome_percent: if n == 0 {
            0.0
        } else {
            same as f64 * 100.0 / n as f64
        },
        within_10ms_percent: if diffs.is_empty() {
            0.0
        } else {
            within as f64 * 100.0 / diffs.len() as f64
        },
        median_excess_ms: percentile(&diffs, 50.0),
        early,
    }
}

/// Whether a cell meets the goal: never worse than direct, and at least [`GOAL_SHARE`] of the
/// possible P99 cut at no more than the limit's amplification plus
/// [`GOAL_AMPLIFICATION_SLACK`]. `None` when there is nothing to cut (then only the invariant
/// applies). The invariant is part of it because a proxy that fails its slow requests gets a
/// fine P99 of what is left.
pub fn goal_met(
    share: Option<f64>,
    invariant: &Invariant,
    sidecar: &Summary,
    limit: &Summary,
) -> Option<bool> {
    share.map(|s| {
        invariant.holds()
            && s >= GOAL_SHARE
            && sidecar.amplification <= limit.amplification + GOAL_AMPLIFICATION_SLACK
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ms: f64) -> Outcome {
        Outcome::Ok {
            latency_ms: ms,
            ttft_ms: ms,
        }
    }

    fn run(v: &[Option<f64>]) -> Vec<Outcome> {
        v.iter().map(|x| x.map_or(Outcome::Failed, ok)).collect()
    }

    #[test]
    fn a_proxy_that_never_slows_a_request_passes() {
        let direct: Vec<Option<f64>> = (0..1000)
            .map(|i| (i % 20 != 0).then(|| 100.0 + f64::from(i)))
            .collect();
        // Saves every failure (slowly) and shaves the tail.
        let sidecar: Vec<Option<f64>> = direct
            .iter()
            .map(|d| Some(d.map_or(5000.0, |v| if v > 900.0 { 400.0 } else { v + 0.5 })))
            .collect();
        let inv = never_worse(&run(&direct), &run(&sidecar));
        assert!(inv.holds(), "{:?}", inv.violations());
        assert_eq!(inv.errors_sidecar, 0);
        assert_eq!(inv.slower_requests, 0);
    }

    #[test]
    fn waiting_before_the_first_attempt_fails_at_p50() {
        let direct: Vec<Option<f64>> = (0..1000).map(|i| Some(100.0 + f64::from(i))).collect();
        // A fifth of requests wait 300 ms for a cool-down: the median moves.
        let sidecar: Vec<Option<f64>> = direct
            .iter()
            .enumerate()
            .map(|(i, d)| d.map(|v| if i % 5 == 0 { v + 300.0 } else { v }))
            .collect();
        let inv = never_worse(&run(&direct), &run(&sidecar));
        assert!(!inv.holds());
        assert!(
            inv.violations()[0].starts_with("P50 "),
            "{:?}",
            inv.violations()
        );
        assert_eq!(inv.slower_requests, 200);
    }

    #[test]
    fn failing_fast_where_direct_answered_fails_on_errors() {
        let direct: Vec<Option<f64>> = (0..1000).map(|i| (i % 20 != 0).then_some(100.0)).collect();
        let sidecar: Vec<Option<f64>> = (0..1000).map(|i| (i % 2 == 0).then_some(90.0)).collect();
        let inv = never_worse(&run(&direct), &run(&sidecar));
        assert!(!inv.holds());
        assert!(inv.violations().iter().any(|v| v.starts_with("errors")));
        assert_eq!(inv.worst[0].2, None);
    }

    #[test]
    fn the_share_of_the_cut() {
        assert_eq!(
            share_of_cut(Some(2000.0), Some(1000.0), Some(500.0)),
            Some(1000.0 / 1500.0)
        );
        assert_eq!(
            share_of_cut(Some(2000.0), Some(2100.0), Some(1000.0)),
            Some(-0.1)
        );
        // Nothing to cut: limit within 2 % of direct.
        assert_eq!(share_of_cut(Some(2000.0), Some(1990.0), Some(1970.0)), None);
        assert_eq!(share_of_cut(None, Some(1.0), Some(1.0)), None);
    }

    #[test]
    fn records_become_outcomes_by_index() {
        let rec = |index, ok, latency_ms| RequestRecord {
            index,
            ok,
            latency_ms,
            ttft_ms: None,
            error: None,
            attempts: None,
            provider: None,
        };
        let o = outcomes(&[rec(2, true, 5.0), rec(0, false, 1.0)], 4);
        assert_eq!(o[0], Outcome::Failed);
        assert_eq!(o[1], Outcome::Failed); // no record: unfinished
        assert_eq!(o[2].latency_or_inf(), 5.0);
    }

    #[test]
    fn fidelity_compares_request_by_request() {
        let measured = run(&[Some(101.0), Some(250.0), None, Some(80.0)]);
        // Within 10 ms: the first, not the second (50 ms late).
        let predicted = run(&[Some(100.0), Some(200.0), None, None]);
        let f = fidelity(&measured, &predicted);
        assert_eq!(f.same_outcome_percent, 75.0);
        assert_eq!(f.within_10ms_percent, 50.0);
        assert_eq!(f.median_excess_ms, Some(1.0));
        assert_eq!(f.early, 0);
    }
}
