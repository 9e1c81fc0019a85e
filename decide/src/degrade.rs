//! Degraded tiers (seed 002: "degrade from the large model to a small one"; its breaker
//! goes Healthy → Degraded → … → Healthy): when a route's normal tier cannot keep its
//! objectives, requests are served by a declared degraded target (a smaller model, maybe
//! on another provider) until the normal tier is well again.
//!
//! Pure: [`SloWindow`] counts the normal tier's requests that met or missed the route's
//! P99 objectives over a rolling window, [`Degrader`] is the route's state machine with
//! hysteresis (time passed in), and [`serve_degraded`] says whether one request goes to
//! the degraded target. The sidecar feeds them and does the routing.

use std::time::{Duration, Instant};

/// A P99 objective allows 1 % of requests to miss it: the error budget the burn rate is
/// measured against.
const P99_BUDGET: f64 = 0.01;
/// Buckets of the rolling window: old samples leave it in steps of a tenth.
const BUCKETS: usize = 10;

/// When and how a route degrades.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DegradeSettings {
    /// Whether the SLO burn rate is a trigger at all.
    pub slo_burn: bool,
    /// The span the burn rate is measured over.
    pub window: Duration,
    /// Normal-tier requests needed in the window before its burn rate counts.
    pub min_requests: u32,
    /// Degrade when the normal tier misses its P99 objectives this many times faster than
    /// the 1 % budget allows (2: 2 % of requests miss). Recovery needs half of it, so a
    /// burn rate near the threshold cannot make the route flap.
    pub burn_rate: f64,
    /// Degrade when every provider of the normal tier is open or cooling down.
    pub on_unavailable: bool,
    /// Shortest stay in `Degraded`.
    pub hold_for: Duration,
    /// How long `Recovering` must stay clean before the route is `Healthy`.
    pub recover_after: Duration,
    /// Percentage of requests still sent to the normal tier while degraded, so the sidecar
    /// sees when it is well again.
    pub probe_percent: f64,
}

impl DegradeSettings {
    /// A route's `degradation`, read.
    pub fn from_spec(d: &tailwarden_crds::Degradation) -> Self {
        let burn = d.slo_burn.as_ref();
        Self {
            slo_burn: burn.is_some(),
            window: burn.map_or(Duration::from_secs(30), |b| b.window.get()),
            min_requests: burn.map_or(1, |b| b.min_requests),
            burn_rate: burn.map_or(1.0, |b| f64::from(b.burn_rate)),
            on_unavailable: d.on_unavailable,
            hold_for: d.hold_for.get(),
            recover_after: d.recover_after.get(),
            probe_percent: f64::from(d.probe_percent.min(100)),
        }
    }
}

/// The route's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// The normal tier serves.
    Healthy,
    /// The degraded target serves (all but the probes and the opted-out requests).
    Degraded,
    /// The normal tier serves again, watched: any trigger sends the route straight back to
    /// `Degraded`.
    Recovering,
}

impl State {
    /// The name in metrics, logs and the header (`healthy`, `degraded`, `recovering`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Degraded => "degraded",
            Self::Recovering => "recovering",
        }
    }
}

/// Why the route degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The normal tier burned its P99 budget too fast.
    SloBurn,
    /// Every provider of the normal tier was open or cooling down.
    Unavailable,
    /// The route's manual switch.
    Manual,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SloBurn => "slo_burn",
            Self::Unavailable => "unavailable",
            Self::Manual => "manual",
        }
    }
}

/// Met and missed counts of the normal tier's requests over a rolling window.
#[derive(Debug, Clone)]
pub struct SloWindow {
    /// `(bucket start, met, missed)`, oldest first.
    buckets: [(Option<Instant>, u32, u32); BUCKETS],
    width: Duration,
}

impl SloWindow {
    pub fn new(window: Duration) -> Self {
        Self {
            buckets: [(None, 0, 0); BUCKETS],
            width: (window / BUCKETS as u32).max(Duration::from_millis(1)),
        }
    }

    /// One normal-tier request finished at `now`: `met` when it kept every P99 objective
    /// of the route.
    pub fn record(&mut self, now: Instant, met: bool) {
        let slot = self.slot(now);
        if met {
            slot.1 = slot.1.saturating_add(1);
        } else {
            slot.2 = slot.2.saturating_add(1);
        }
    }

    fn slot(&mut self, now: Instant) -> &mut (Option<Instant>, u32, u32) {
        let width = self.width;
        let last = BUCKETS - 1;
        match self.buckets[last].0 {
            Some(start) if now.saturating_duration_since(start) < width => {}
            _ => {
                self.buckets.rotate_left(1);
                self.buckets[last] = (Some(now), 0, 0);
            }
        }
        &mut self.buckets[last]
    }

    /// `(met, missed)` of the samples no older than the window.
    pub fn counts(&self, now: Instant) -> (u32, u32) {
        let span = self.width * BUCKETS as u32;
        self.buckets
            .iter()
            .filter(|(start, _, _)| start.is_some_and(|s| now.saturating_duration_since(s) < span))
            .fold((0, 0), |(m, x), (_, met, missed)| {
                (m.saturating_add(*met), x.saturating_add(*missed))
            })
    }

    /// The burn rate (missed share over the 1 % budget), or `None` below `min_requests`.
    pub fn burn_rate(&self, now: Instant, min_requests: u32) -> Option<f64> {
        let (met, missed) = self.counts(now);
        let total = met.saturating_add(missed);
        (total >= min_requests.max(1)).then(|| f64::from(missed) / f64::from(total) / P99_BUDGET)
    }

    /// Forgets every sample (the route just degraded: from now on only the probes say how
    /// the normal tier does).
    pub fn clear(&mut self) {
        self.buckets = [(None, 0, 0); BUCKETS];
    }
}

/// What the sidecar knows about the normal tier when it asks for the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Signals {
    /// Every provider of the normal tier is open or cooling down.
    pub unavailable: bool,
    /// The route's manual switch is on.
    pub manual: bool,
}

/// A change of the route's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub from: State,
    pub to: State,
    /// Why, when the route degraded.
    pub reason: Option<Reason>,
}

/// The route's state machine: Healthy → Degraded (a trigger) → Recovering (after
/// `hold_for`, every trigger gone and the burn rate under half the threshold) → Healthy
/// (after `recover_after` with no trigger); a trigger while recovering degrades at once.
#[derive(Debug, Clone)]
pub struct Degrader {
    state: State,
    since: Instant,
    window: SloWindow,
}

impl Degrader {
    pub fn new(settings: &DegradeSettings, now: Instant) -> Self {
        Self {
            state: State::Healthy,
            since: now,
            window: SloWindow::new(settings.window),
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// A normal-tier request finished (degraded requests are not counted: they say nothing
    /// about the normal tier).
    pub fn record(&mut self, now: Instant, met: bool) {
        self.window.record(now, met);
    }

    /// The trigger that holds now, if any.
    fn trigger(
        &self,
        s: &DegradeSettings,
        signals: Signals,
        now: Instant,
        threshold: f64,
    ) -> Option<Reason> {
        if signals.manual {
            Some(Reason::Manual)
        } else if s.on_unavailable && signals.unavailable {
            Some(Reason::Unavailable)
        } else if s.slo_burn
            && self
                .window
                .burn_rate(now, s.min_requests)
                .is_some_and(|b| b >= threshold)
        {
            Some(Reason::SloBurn)
        } else {
            None
        }
    }

    /// The state at `now` given the signals, and the change if there was one.
    pub fn update(
        &mut self,
        s: &DegradeSettings,
        signals: Signals,
        now: Instant,
    ) -> Option<Change> {
        let from = self.state;
        let held = now.saturating_duration_since(self.since);
        let (to, reason) = match self.state {
            State::Healthy | State::Recovering => {
                match self.trigger(s, signals, now, s.burn_rate) {
                    Some(reason) => (State::Degraded, Some(reason)),
                    None if self.state == State::Recovering && held >= s.recover_after => {
                        (State::Healthy, None)
                    }
                    None => return None,
                }
            }
            State::Degraded => {
                // Leaving needs the burn rate well under the threshold that entered.
                if held < s.hold_for || self.trigger(s, signals, now, s.burn_rate / 2.0).is_some() {
                    return None;
                }
                (State::Recovering, None)
            }
        };
        if to == State::Degraded {
            self.window.clear();
        }
        self.state = to;
        self.since = now;
        Some(Change { from, to, reason })
    }
}

/// Whether one request goes to the degraded target: only while `Degraded`, never for a
/// request that opted out, and not for the probes (`draw` uniform in [0, 1): the lowest
/// `probe_percent` go to the normal tier).
pub fn serve_degraded(state: State, opted_out: bool, probe_percent: f64, draw: f64) -> bool {
    state == State::Degraded && !opted_out && draw * 100.0 >= probe_percent
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> DegradeSettings {
        DegradeSettings {
            slo_burn: true,
            window: Duration::from_secs(10),
            min_requests: 20,
            burn_rate: 10.0,
            on_unavailable: true,
            hold_for: Duration::from_secs(30),
            recover_after: Duration::from_secs(20),
            probe_percent: 10.0,
        }
    }

    const S: Duration = Duration::from_secs(1);

    /// `n` requests at `at`, `missed` of them missing the objective.
    fn feed(d: &mut Degrader, at: Instant, n: u32, missed: u32) {
        for i in 0..n {
            d.record(at, i >= missed);
        }
    }

    #[test]
    fn the_window_forgets_old_samples() {
        let t0 = Instant::now();
        let mut w = SloWindow::new(Duration::from_secs(10));
        w.record(t0, false);
        w.record(t0 + 5 * S, true);
        assert_eq!(w.counts(t0 + 5 * S), (1, 1));
        assert_eq!(w.counts(t0 + 10 * S + Duration::from_millis(1)), (1, 0));
        assert_eq!(w.counts(t0 + 20 * S), (0, 0));
        assert_eq!(w.burn_rate(t0 + 5 * S, 3), None, "too few requests");
        assert_eq!(
            w.burn_rate(t0 + 5 * S, 2),
            Some(50.0),
            "half missed: 50× the 1 % budget"
        );
    }

    #[test]
    fn a_burning_slo_degrades_and_too_few_requests_do_not() {
        let s = settings();
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        feed(&mut d, t0, 10, 10);
        assert_eq!(
            d.update(&s, Signals::default(), t0),
            None,
            "10 < minRequests"
        );
        feed(&mut d, t0, 90, 5);
        // 15 of 100 missed: burn rate 15 ≥ 10.
        let change = d.update(&s, Signals::default(), t0).unwrap();
        assert_eq!(change.to, State::Degraded);
        assert_eq!(change.reason, Some(Reason::SloBurn));
    }

    #[test]
    fn a_burn_under_the_threshold_keeps_the_route_healthy() {
        let s = settings();
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        feed(&mut d, t0, 100, 9);
        assert_eq!(d.update(&s, Signals::default(), t0), None);
        assert_eq!(d.state(), State::Healthy);
    }

    #[test]
    fn the_whole_cycle_with_hysteresis() {
        let s = settings();
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        feed(&mut d, t0, 100, 50);
        assert_eq!(
            d.update(&s, Signals::default(), t0).unwrap().to,
            State::Degraded
        );
        // Held for 30 s even though the probes look fine at once.
        feed(&mut d, t0 + S, 30, 0);
        assert_eq!(d.update(&s, Signals::default(), t0 + 29 * S), None);
        // Probes missing at burn rate 6: under the entry threshold (10), over half of it:
        // still degraded — no flapping around the threshold.
        let t1 = t0 + 31 * S;
        feed(&mut d, t1, 100, 6);
        assert_eq!(d.update(&s, Signals::default(), t1), None);
        assert_eq!(d.state(), State::Degraded);
        // The window moves on; the probes are clean now.
        let t2 = t1 + 11 * S;
        feed(&mut d, t2, 50, 1);
        let c = d.update(&s, Signals::default(), t2).unwrap();
        assert_eq!((c.from, c.to), (State::Degraded, State::Recovering));
        // Recovering for 20 s with no trigger, then Healthy.
        feed(&mut d, t2 + 10 * S, 50, 0);
        assert_eq!(d.update(&s, Signals::default(), t2 + 19 * S), None);
        let c = d.update(&s, Signals::default(), t2 + 20 * S).unwrap();
        assert_eq!((c.from, c.to), (State::Recovering, State::Healthy));
    }

    #[test]
    fn a_trigger_while_recovering_degrades_at_once() {
        let s = settings();
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        let unavailable = Signals {
            unavailable: true,
            manual: false,
        };
        assert_eq!(
            d.update(&s, unavailable, t0).unwrap().reason,
            Some(Reason::Unavailable)
        );
        assert_eq!(
            d.update(&s, unavailable, t0 + 40 * S),
            None,
            "still unavailable"
        );
        assert_eq!(
            d.update(&s, Signals::default(), t0 + 41 * S).unwrap().to,
            State::Recovering,
            "no samples at all: nothing says the normal tier is bad"
        );
        let c = d.update(&s, unavailable, t0 + 42 * S).unwrap();
        assert_eq!((c.from, c.to), (State::Recovering, State::Degraded));
        // A fresh hold.
        assert_eq!(d.update(&s, Signals::default(), t0 + 71 * S), None);
        assert!(d.update(&s, Signals::default(), t0 + 72 * S).is_some());
    }

    #[test]
    fn the_manual_switch_holds_the_route_degraded() {
        let s = settings();
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        let manual = Signals {
            unavailable: false,
            manual: true,
        };
        assert_eq!(
            d.update(&s, manual, t0).unwrap().reason,
            Some(Reason::Manual)
        );
        assert_eq!(d.update(&s, manual, t0 + 3600 * S), None);
        assert_eq!(d.state(), State::Degraded);
    }

    #[test]
    fn without_slo_burn_the_misses_do_not_count() {
        let mut s = settings();
        s.slo_burn = false;
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        feed(&mut d, t0, 100, 100);
        assert_eq!(d.update(&s, Signals::default(), t0), None);
    }

    #[test]
    fn unavailability_is_a_trigger_only_when_asked() {
        let mut s = settings();
        s.on_unavailable = false;
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        let signals = Signals {
            unavailable: true,
            manual: false,
        };
        assert_eq!(d.update(&s, signals, t0), None);
    }

    #[test]
    fn degrading_forgets_the_samples_that_caused_it() {
        let s = settings();
        let t0 = Instant::now();
        let mut d = Degrader::new(&s, t0);
        feed(&mut d, t0, 100, 100);
        d.update(&s, Signals::default(), t0);
        // Past the hold, within the window of those samples: only the probes count, and
        // there are none yet.
        assert_eq!(
            d.update(&s, Signals::default(), t0 + 30 * S).unwrap().to,
            State::Recovering
        );
    }

    #[test]
    fn who_is_served_degraded() {
        assert!(serve_degraded(State::Degraded, false, 10.0, 0.5));
        assert!(
            !serve_degraded(State::Degraded, false, 10.0, 0.05),
            "a probe"
        );
        assert!(
            !serve_degraded(State::Degraded, true, 10.0, 0.5),
            "opted out"
        );
        assert!(!serve_degraded(State::Healthy, false, 10.0, 0.5));
        assert!(!serve_degraded(State::Recovering, false, 10.0, 0.5));
        assert!(
            serve_degraded(State::Degraded, false, 0.0, 0.0),
            "no probes"
        );
    }
}
