//! Judging one battery cell: the never-worse invariant, request by request, and the share of
//! the possible cut, against the oracle's limit. Pure functions of the two runs' records.
//!
//! "Never worse" is checked on the *answered-within-x* curve: a failed request counts as
//! slower than any answer, and through the sidecar every percentile from P50 to P99.9 must be
//! at most direct's plus [`TOLERANCE_MS`], with no more errors. This is the right order for a
//! proxy whose job includes turning errors into answers: percentiles over successes alone
//! would call it worse for every slow answer it saved (direct never had to count those).
//! Because the upstream gives the sidecar's first attempt of request *i* the very fate the
//! direct call of request *i* met, the check is about policy, not about sampling luck.
//!
//! On real sockets one more thing separates the two runs: the hop itself — two more loopback
//! hops and four more process wake-ups on machines whose 2 cores the upstreams, the load
//! generator and the sidecar share. Measured at 0.4–1.3 ms median and ~9 ms at P99 of the
//! paired difference (load average 1–3), it is larger than [`TOLERANCE_MS`] at times, and one
//! request pushed across a gap between two order statistics moves a percentile by the gap
//! (5 ms at P50 in one 450-request run). That is the proxy's cost, which `make bench`
//! measures against a direct connection; it is not a policy making requests slower. So the
//! real-socket verdict judges [`policy_outcomes`]: a request the sidecar only relayed (its
//! access log shows one attempt, no hedge, and less than [`TOLERANCE_MS`] inside the sidecar
//! before that attempt) met direct's fate by construction and counts as direct's outcome; every
//! request the policy acted on (retried, hedged, held before its first attempt) counts as
//! measured, hop included. The hop is reported beside the verdict ([`Hop`]). The virtual-time
//! battery (`crate::vtime`) has no hop and judges every request as it is.

use serde::{Deserialize, Serialize};

use crate::bench::RequestRecord;
use crate::oracle::{Outcome, Summary, percentile};

/// How much slower than direct any percentile may be through the sidecar (issue #15).
pub const TOLERANCE_MS: f64 = 1.0;

/// On real sockets, how many percent of requests may swap places between the two runs' curves
/// (0.5 %: 2 of a 15 s subset cell's 450). The hop delays each request's arrival at the
/// upstream by about a millisecond, and against a windowed account limit that moves a request
/// at a window's edge into the next window: direct answers it and the sidecar's first attempt
/// meets the 429 while another request swaps the other way (seen in
/// `account-limit/one/aiohttp`: 1 of 450 each way). A policy that really makes requests slower
/// moves far more than that (the 429 cool-downs before #15 phase B: a fifth of them).
pub const SOCKET_RANK_SLACK_PERCENT: f64 = 0.5;

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

/// What the sidecar's access log says it did with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handling {
    /// Upstream attempts, hedges included.
    pub attempts: u64,
    /// Whether a hedge was sent.
    pub hedged: bool,
    /// Time inside the sidecar before its first attempt, µs.
    pub overhead_us: u64,
}

impl Handling {
    /// One attempt, no hedge, started at once: the policy did nothing to this request but pass
    /// it on, so its first (and only) attempt met the fate the direct call met.
    pub fn relayed_only(&self) -> bool {
        self.attempts == 1 && !self.hedged && (self.overhead_us as f64) < TOLERANCE_MS * 1000.0
    }
}

/// Per request index, what the sidecar did, from its JSON access log (`--log-format json`):
/// lines with `request_id` = `prefix` + index. Requests without a line (a dropped log line, a
/// request that never reached the sidecar) are `None` and are judged as measured.
pub fn handlings(log: &str, prefix: &str, requests: usize) -> Vec<Option<Handling>> {
    let mut out = vec![None; requests];
    for line in log.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let index = v
            .get("request_id")
            .and_then(serde_json::Value::as_str)
            .and_then(|id| id.strip_prefix(prefix))
            .and_then(|i| i.parse::<usize>().ok());
        let (Some(i), Some(attempts), Some(hedged), Some(overhead_us)) = (
            index,
            v.get("attempts").and_then(serde_json::Value::as_u64),
            v.get("hedged").and_then(serde_json::Value::as_bool),
            v.get("overhead_us").and_then(serde_json::Value::as_u64),
        ) else {
            continue;
        };
        if let Some(slot) = out.get_mut(i) {
            *slot = Some(Handling {
                attempts,
                hedged,
                overhead_us,
            });
        }
    }
    out
}

/// The hop: through the sidecar minus direct, over the requests it only relayed that both
/// answered. Reported, not judged (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hop {
    /// Requests the sidecar only relayed.
    pub relayed: u64,
    /// Median of the paired difference, ms.
    pub median_ms: Option<f64>,
    /// P99 of the paired difference, ms.
    pub p99_ms: Option<f64>,
}

/// The sidecar's outcomes as its policy made them: a request it only relayed (see
/// [`Handling::relayed_only`]) and both runs answered takes direct's outcome; every other
/// request keeps its measured one. Also returns the [`Hop`] those relayed requests measured.
pub fn policy_outcomes(
    direct: &[Outcome],
    sidecar: &[Outcome],
    handled: &[Option<Handling>],
) -> (Vec<Outcome>, Hop) {
    let mut hops = Vec::new();
    let mut relayed = 0u64;
    let out = sidecar
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let only_relayed = handled
                .get(i)
                .copied()
                .flatten()
                .is_some_and(|h| h.relayed_only());
            match (direct.get(i), s) {
                (
                    Some(d @ Outcome::Ok { latency_ms: a, .. }),
                    Outcome::Ok { latency_ms: b, .. },
                ) if only_relayed => {
                    relayed += 1;
                    hops.push(b - a);
                    *d
                }
                _ => *s,
            }
        })
        .collect();
    hops.sort_by(f64::total_cmp);
    let hop = Hop {
        relayed,
        median_ms: percentile(&hops, 50.0),
        p99_ms: percentile(&hops, 99.0),
    };
    (out, hop)
}

fn sorted_with_failures(o: &[Outcome]) -> Vec<f64> {
    let mut v: Vec<f64> = o.iter().map(Outcome::latency_or_inf).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Checks the invariant on two runs of the same requests: through the sidecar each checked
/// percentile *p* is compared with direct's at *p* + `rank_slack_percent` (0 in virtual time;
/// [`SOCKET_RANK_SLACK_PERCENT`] on real sockets).
pub fn never_worse(direct: &[Outcome], sidecar: &[Outcome], rank_slack_percent: f64) -> Invariant {
    let (d, s) = (sorted_with_failures(direct), sorted_with_failures(sidecar));
    let finite = |v: Option<f64>| v.filter(|x| x.is_finite());
    let checks = CHECKED
        .iter()
        .map(|&p| {
            let (dp, sp) = (
                finite(percentile(&d, (p + rank_slack_percent).min(100.0))),
                finite(percentile(&s, p)),
            );
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
        let inv = never_worse(&run(&direct), &run(&sidecar), 0.0);
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
        let inv = never_worse(&run(&direct), &run(&sidecar), 0.0);
        assert!(!inv.holds());
        assert!(
            inv.violations()[0].starts_with("P50 "),
            "{:?}",
            inv.violations()
        );
        assert_eq!(inv.slower_requests, 200);
    }

    fn relayed() -> Option<Handling> {
        Some(Handling {
            attempts: 1,
            hedged: false,
            overhead_us: 5,
        })
    }

    #[test]
    fn the_hop_of_requests_only_relayed_is_reported_not_judged() {
        // A sparse middle: two requests pushed 70 ms by scheduling land across a gap and move
        // the measured P50 by the gap.
        let direct: Vec<Option<f64>> = (0..101)
            .map(|i| {
                Some(if i < 50 {
                    100.0 + f64::from(i)
                } else {
                    160.0 + f64::from(i)
                })
            })
            .collect();
        let sidecar: Vec<Option<f64>> = direct
            .iter()
            .enumerate()
            .map(|(i, d)| {
                d.map(|v| {
                    if i == 48 || i == 49 {
                        v + 70.0
                    } else {
                        v + 0.8
                    }
                })
            })
            .collect();
        let (d, s) = (run(&direct), run(&sidecar));
        assert!(
            !never_worse(&d, &s, 0.0).holds(),
            "measured as is, the hop breaks P50"
        );
        let handled = vec![relayed(); 101];
        let (policy, hop) = policy_outcomes(&d, &s, &handled);
        assert_eq!(policy, d);
        let inv = never_worse(&d, &policy, 0.0);
        assert!(inv.holds(), "{:?}", inv.violations());
        assert_eq!(hop.relayed, 101);
        assert!((hop.median_ms.unwrap_or(0.0) - 0.8).abs() < 1e-9, "{hop:?}");
        assert!((hop.p99_ms.unwrap_or(0.0) - 70.0).abs() < 1e-9, "{hop:?}");
    }

    #[test]
    fn requests_the_policy_acted_on_are_judged_as_measured() {
        let direct: Vec<Option<f64>> = (0..1000).map(|i| Some(100.0 + f64::from(i))).collect();
        // A fifth wait 300 ms before their first attempt; the rest are relayed.
        let sidecar: Vec<Option<f64>> = direct
            .iter()
            .enumerate()
            .map(|(i, d)| d.map(|v| if i % 5 == 0 { v + 300.0 } else { v + 0.5 }))
            .collect();
        let handled: Vec<Option<Handling>> = (0..1000)
            .map(|i| {
                if i % 5 == 0 {
                    Some(Handling {
                        attempts: 1,
                        hedged: false,
                        overhead_us: 300_000,
                    })
                } else {
                    relayed()
                }
            })
            .collect();
        let (d, s) = (run(&direct), run(&sidecar));
        let (policy, hop) = policy_outcomes(&d, &s, &handled);
        assert_eq!(hop.relayed, 800);
        assert!(!never_worse(&d, &policy, 0.0).holds());
        assert!(!never_worse(&d, &policy, SOCKET_RANK_SLACK_PERCENT).holds());
        // Retried, hedged or unlogged requests are not relayed either; a failure stays one.
        for h in [
            Some(Handling {
                attempts: 2,
                hedged: false,
                overhead_us: 5,
            }),
            Some(Handling {
                attempts: 1,
                hedged: true,
                overhead_us: 5,
            }),
            None,
        ] {
            let (p, hop) = policy_outcomes(&[ok(100.0)], &[ok(150.0)], &[h]);
            assert_eq!((p, hop.relayed), (vec![ok(150.0)], 0));
        }
        let (p, _) = policy_outcomes(&[ok(100.0)], &[Outcome::Failed], &[relayed()]);
        assert_eq!(p, vec![Outcome::Failed]);
    }

    #[test]
    fn on_sockets_two_requests_in_450_may_swap_places_at_a_window_edge() {
        // A sparse middle again; direct answers request 200 and fails request 300, the
        // sidecar the other way round (the hop moved both across an account window's edge).
        let direct: Vec<Option<f64>> = (0..450)
            .map(|i| match i {
                300 => None,
                i if i < 225 => Some(100.0 + f64::from(i)),
                i => Some(400.0 + f64::from(i)),
            })
            .collect();
        let sidecar: Vec<Option<f64>> = direct
            .iter()
            .enumerate()
            .map(|(i, d)| match i {
                200 => None,
                300 => Some(700.0),
                _ => *d,
            })
            .collect();
        let (d, s) = (run(&direct), run(&sidecar));
        assert!(!never_worse(&d, &s, 0.0).holds());
        let inv = never_worse(&d, &s, SOCKET_RANK_SLACK_PERCENT);
        assert!(inv.holds(), "{:?}", inv.violations());
        // Ten such swaps are a policy, not a window's edge.
        let sidecar: Vec<Option<f64>> = direct
            .iter()
            .enumerate()
            .map(|(i, d)| {
                if (200..210).contains(&i) {
                    Some(2000.0)
                } else {
                    *d
                }
            })
            .collect();
        assert!(!never_worse(&d, &run(&sidecar), SOCKET_RANK_SLACK_PERCENT).holds());
    }

    #[test]
    fn handlings_come_from_the_json_access_log_by_request_index() {
        let log = concat!(
            "listening on 127.0.0.1:1 admin 127.0.0.1:2\n",
            r#"{"level":"INFO","request_id":"r1","attempts":2,"hedged":true,"overhead_us":12,"target":"tailwarden::access"}"#,
            "\n",
            r#"{"level":"INFO","request_id":"r0","attempts":1,"hedged":false,"overhead_us":3}"#,
            "\n",
            r#"{"level":"INFO","request_id":"r9","attempts":1,"hedged":false,"overhead_us":3}"#,
            "\n",
            r#"{"level":"WARN","message":"no request id"}"#,
            "\n",
        );
        let h = handlings(log, "r", 3);
        assert_eq!(
            h[0],
            relayed().map(|r| Handling {
                overhead_us: 3,
                ..r
            })
        );
        assert_eq!(
            h[1],
            Some(Handling {
                attempts: 2,
                hedged: true,
                overhead_us: 12
            })
        );
        assert_eq!(h[2], None);
    }

    #[test]
    fn failing_fast_where_direct_answered_fails_on_errors() {
        let direct: Vec<Option<f64>> = (0..1000).map(|i| (i % 20 != 0).then_some(100.0)).collect();
        let sidecar: Vec<Option<f64>> = (0..1000).map(|i| (i % 2 == 0).then_some(90.0)).collect();
        let inv = never_worse(&run(&direct), &run(&sidecar), 0.0);
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
