//! `streaming.fallback` around the attempts: which way an attempt asks its provider (a
//! stream, or a plain call replayed as one), and what stream attempts teach the provider's
//! [`StreamHealth`](tailwarden_decide::stream_fallback::StreamHealth) — decided in
//! `tailwarden_decide::stream_fallback`, logged and metered here.

use tailwarden_decide::stream_fallback::Mode;

use super::{Call, std_now};

/// How the attempt to provider `idx` asks: a plain call when the route opts in, the
/// request is a chat stream and the provider's streams keep failing before content.
pub(crate) fn mode(call: &Call<'_>, idx: usize) -> Mode {
    let Some(settings) = &call.fallback else {
        return Mode::Stream;
    };
    call.route.upstreams[idx]
        .state
        .stream
        .lock()
        .map_or(Mode::Stream, |mut h| h.choose(settings, std_now()))
}

/// A stream attempt to provider `idx` failed before its first content.
pub(crate) fn stream_failed(call: &Call<'_>, idx: usize) {
    let Some(settings) = &call.fallback else {
        return;
    };
    let upstream = &call.route.upstreams[idx];
    let started = upstream
        .state
        .stream
        .lock()
        .is_ok_and(|mut h| h.stream_failed(settings, std_now()));
    if started {
        tracing::warn!(
            route = %call.route.name,
            provider = %upstream.name,
            after_failures = settings.after_failures,
            "the provider's streams fail before their first content; its stream requests are served by plain calls"
        );
    }
}

/// A stream attempt to provider `idx` reached its first content.
pub(crate) fn stream_started(call: &Call<'_>, idx: usize) {
    let Some(settings) = &call.fallback else {
        return;
    };
    let upstream = &call.route.upstreams[idx];
    let ended = upstream
        .state
        .stream
        .lock()
        .is_ok_and(|mut h| h.stream_started(settings));
    if ended {
        tracing::info!(
            route = %call.route.name,
            provider = %upstream.name,
            "the provider streams again; the stream fallback ends"
        );
    }
}

/// A stream request was answered by a plain call to provider `idx`.
pub(crate) fn served(call: &Call<'_>, idx: usize) {
    call.ex
        .app
        .metrics
        .stream_fallbacks
        .with_label_values(&[&*call.route.name, &*call.route.upstreams[idx].name])
        .inc();
}
