//! `degradation` at the door: the route's state (moved on by the current signals), and
//! whether this request is served by the degraded target — never for a request that opted
//! out (the route's `optOutHeader`, or a tier with `neverDegrade`), and not for the probes
//! that keep watching the normal tier. Decided in `tailwarden_decide::degrade`.

use http::HeaderMap;
use tailwarden_decide::degrade::serve_degraded;

use crate::{
    app::{App, exchange::DegradeChoice},
    config::Route,
};

/// The route's state and whether the degraded target serves the request; `None` on
/// routes without a `degradation`.
pub fn choose(
    app: &App,
    route: &Route,
    tier: Option<usize>,
    headers: &HeaderMap,
) -> Option<DegradeChoice> {
    let d = route.degrade.as_ref()?;
    let state = route.degrade_state(&app.metrics, std::time::Instant::now())?;
    let opted_out = tier
        .and_then(|i| route.tiers.get(i))
        .is_some_and(|t| t.never_degrade)
        || headers.get(&d.opt_out).is_some_and(|v| {
            let v = v.as_bytes().trim_ascii();
            !(v.eq_ignore_ascii_case(b"false") || v == b"0")
        });
    let served = serve_degraded(
        state,
        opted_out,
        d.settings.probe_percent,
        rand::random::<f64>(),
    );
    Some(DegradeChoice {
        state,
        served,
        opted_out,
        switched: Default::default(),
    })
}
