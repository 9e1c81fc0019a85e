//! Hot reload: valid changes apply without failing a request; invalid ones keep the last
//! good config and say why.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;

fn write_atomically(path: &std::path::Path, text: &str) {
    // ConfigMap volumes swap content atomically; do the same.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_fails_no_request() {
    let a = upstream(|_, _| ok("a")).await;
    let b = upstream(|_, _| ok("b")).await;
    let variants: Vec<String> = (0..2)
        .map(|i| {
            route(
                &[
                    ("a", &a.base_url(), 100 - i * 90, 0),
                    ("b", &b.base_url(), 10 + i * 80, 0),
                ],
                &format!("  timeouts: {{firstByte: {}s}}\n", 10 + i),
            )
        })
        .collect();
    let sc = sidecar(&variants[0]).await;
    let rate = 200u64;
    let seconds = 20u64;
    let total = rate * seconds;
    let failures = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let client = client();
    let url = sc.url("/v1/chat/completions");

    let config = sc.config.clone();
    let rewriter = tokio::spawn(async move {
        for i in 0..20 {
            tokio::time::sleep(Duration::from_millis(950)).await;
            write_atomically(&config, &variants[(i + 1) % 2]);
        }
    });

    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    let mut tasks = Vec::with_capacity(total as usize);
    for _ in 0..total {
        ticker.tick().await;
        let (client, url, failures, done) =
            (client.clone(), url.clone(), failures.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let req = http::Request::post(url)
                .body(http_body_util::Full::new(Bytes::from_static(
                    br#"{"model":"m","messages":[]}"#,
                )))
                .unwrap();
            let ok = match client.request(req).await {
                Ok(resp) => resp.status() == 200 && resp.into_body().collect().await.is_ok(),
                Err(_) => false,
            };
            if !ok {
                failures.fetch_add(1, Ordering::SeqCst);
            }
            done.fetch_add(1, Ordering::SeqCst);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    rewriter.await.unwrap();
    assert_eq!(done.load(Ordering::SeqCst), total as usize);
    assert_eq!(
        failures.load(Ordering::SeqCst),
        0,
        "requests failed during reloads"
    );
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    let reloads: f64 = metrics
        .lines()
        .find(|l| l.starts_with("tailwarden_config_reloads_total{result=\"ok\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        reloads >= 21.0,
        "expected the initial load and 20 reloads, got {reloads}"
    );
    // Both variants served traffic: the weights really changed.
    assert!(
        a.count() > 500 && b.count() > 500,
        "a={} b={}",
        a.count(),
        b.count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_config_keeps_the_last_good_one_and_says_why() {
    let a = upstream(|_, _| ok("a")).await;
    let good = route(&[("a", &a.base_url(), 100, 0)], "");
    let sc = sidecar(&good).await;
    write_atomically(&sc.config, &good.replace("weight: 100", "weight: 500"));
    let app = sc.app.clone();
    assert!(
        wait_until(Duration::from_secs(10), || app
            .config_status()
            .last_error
            .is_some())
        .await
    );
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 200, "still serving the last good config");
    let status = sc.app.config_status();
    let err = status.last_error.expect("the rejection is recorded");
    assert!(
        err.ends_with(
            "document 1 (route t/test): spec.providers[0].weight: weight must be between 0 and 100"
        ),
        "{err}"
    );
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains("tailwarden_config_last_load_valid 0"),
        "{metrics}"
    );

    // An emptied file (an editor caught mid-write) is refused too.
    std::fs::write(&sc.config, "").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || app
            .config_status()
            .last_error
            .is_some_and(|e| e.ends_with("holds no InferenceRoute documents")))
        .await
    );
    assert_eq!(chat(&sc, false).await.status, 200);

    // Deleting the file is also survived.
    std::fs::remove_file(&sc.config).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(chat(&sc, false).await.status, 200);

    // A fixed file is picked up and clears the error.
    write_atomically(&sc.config, &good.replace("weight: 100", "weight: 50"));
    assert!(
        wait_until(Duration::from_secs(10), || app
            .config_status()
            .last_error
            .is_none())
        .await
    );
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains("tailwarden_config_last_load_valid 1"),
        "{metrics}"
    );
}

/// Rewrites the route file and waits until the sidecar serves the new routes.
async fn reload_to(sc: &Sidecar, yaml: &str) {
    let before = sc.app.config_status().hash;
    write_atomically(&sc.config, yaml);
    let app = sc.app.clone();
    assert!(
        wait_until(Duration::from_secs(10), || app.config_status().hash
            != before)
        .await,
        "the new routes were loaded"
    );
}

fn primary_and_backup(primary: &str, backup: &str, spec: &str) -> String {
    route(
        &[("primary", primary, 100, 0), ("backup", backup, 100, 1)],
        spec,
    )
}

/// A circuit breaker opened during an outage stays open when the route file changes in
/// ways that do not concern the provider: traffic keeps avoiding it. Disabling the breaker
/// closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_stays_open_across_an_unrelated_reload_and_closes_when_disabled() {
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = healthy.clone();
    let primary = upstream(move |_, _| {
        if h.load(Ordering::SeqCst) {
            ok("primary")
        } else {
            status(500)
        }
    })
    .await;
    let backup = upstream(|_, _| ok("backup")).await;
    let spec = |first_byte: &str| {
        format!(
            "  retries: {{backoff: {{base: 1ms, max: 2ms}}, budgetPercent: 100}}\n  circuitBreaker: {{consecutiveFailures: 3, openFor: 60s}}\n  timeouts: {{firstByte: {first_byte}}}\n"
        )
    };
    let sc = sidecar(&primary_and_backup(
        &primary.base_url(),
        &backup.base_url(),
        &spec("10s"),
    ))
    .await;
    for _ in 0..5 {
        assert_eq!(chat(&sc, false).await.status, 200);
    }
    assert_eq!(primary.count(), 3, "the breaker opened after 3 failures");

    // The provider recovers, but its breaker is open for another minute: an unrelated edit
    // to the route (a timeout) must not close it.
    healthy.store(true, Ordering::SeqCst);
    reload_to(
        &sc,
        &primary_and_backup(&primary.base_url(), &backup.base_url(), &spec("11s")),
    )
    .await;
    for _ in 0..5 {
        let r = chat(&sc, false).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-tailwarden-provider"), "backup");
    }
    assert_eq!(primary.count(), 3, "no request reached the open provider");
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics
            .contains("tailwarden_circuit_breaker_state{provider=\"primary\",route=\"t/test\"} 2"),
        "{metrics}"
    );

    // Turning the breaker off is not an unrelated edit: nothing could ever close the
    // circuit again, so it closes now and the primary serves again.
    reload_to(
        &sc,
        &primary_and_backup(
            &primary.base_url(),
            &backup.base_url(),
            "  retries: {backoff: {base: 1ms, max: 2ms}, budgetPercent: 100}\n  circuitBreaker: {enabled: false}\n  timeouts: {firstByte: 11s}\n",
        ),
    )
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tailwarden-provider"), "primary");
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics
            .contains("tailwarden_circuit_breaker_state{provider=\"primary\",route=\"t/test\"} 0"),
        "{metrics}"
    );
}

/// A provider cooling down after a 429 `Retry-After` stays out of rotation until the
/// cool-down ends, whatever else changed in the route file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_cooldown_survives_an_unrelated_reload() {
    let primary = upstream(|n, _| {
        if n == 0 {
            Script::Respond {
                delay: Duration::ZERO,
                status: 429,
                headers: vec![("retry-after", "30".into())],
                body: "{}".into(),
            }
        } else {
            ok("primary")
        }
    })
    .await;
    let backup = upstream(|_, _| ok("backup")).await;
    let spec = |total: &str| {
        format!("  retries: {{backoff: {{base: 1ms, max: 2ms}}}}\n  timeouts: {{total: {total}}}\n")
    };
    let sc = sidecar(&primary_and_backup(
        &primary.base_url(),
        &backup.base_url(),
        &spec("60s"),
    ))
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    assert_eq!(primary.count(), 1);
    reload_to(
        &sc,
        &primary_and_backup(&primary.base_url(), &backup.base_url(), &spec("61s")),
    )
    .await;
    for _ in 0..5 {
        let r = chat(&sc, false).await;
        assert_eq!(r.header("x-tailwarden-provider"), "backup");
    }
    assert_eq!(primary.count(), 1, "the cooling provider got no request");
}

/// The hedge delay `auto` learns from a provider's time to first token is kept across a
/// reload: after it, a stalled first attempt is hedged at the learned ~30 ms, not at the
/// 1 s a provider without samples gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learned_hedge_delay_survives_an_unrelated_reload() {
    let stall = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stall.clone();
    let primary = upstream(move |_, _| {
        if s.load(Ordering::SeqCst) {
            Script::Stall
        } else {
            Script::Respond {
                delay: Duration::from_millis(30),
                status: 200,
                headers: vec![("content-type", "application/json".into())],
                body: completion("m", "primary"),
            }
        }
    })
    .await;
    let backup = upstream(|_, _| ok("backup")).await;
    let spec = |first_byte: &str| {
        format!(
            "  hedging: {{enabled: true, delay: auto, maxPercent: 100}}\n  timeouts: {{firstByte: {first_byte}}}\n"
        )
    };
    let sc = sidecar(&primary_and_backup(
        &primary.base_url(),
        &backup.base_url(),
        &spec("10s"),
    ))
    .await;
    // Enough answers for the TTFT quantiles (20 samples at least).
    for _ in 0..40 {
        assert_eq!(chat(&sc, false).await.status, 200);
    }
    reload_to(
        &sc,
        &primary_and_backup(&primary.base_url(), &backup.base_url(), &spec("11s")),
    )
    .await;
    stall.store(true, Ordering::SeqCst);
    let started = std::time::Instant::now();
    let r = chat(&sc, false).await;
    let took = started.elapsed();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-tailwarden-provider"), "backup");
    assert!(
        took < Duration::from_millis(500),
        "hedged after the learned delay, not the 1 s default: {took:?}"
    );
}

/// A provider whose baseUrl changed is another service: it starts with fresh state (a
/// closed breaker), and traffic reaches it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_base_url_starts_with_fresh_state() {
    let broken = upstream(|_, _| status(500)).await;
    let replacement = upstream(|_, _| ok("replacement")).await;
    let backup = upstream(|_, _| ok("backup")).await;
    let spec = "  retries: {backoff: {base: 1ms, max: 2ms}, budgetPercent: 100}\n  circuitBreaker: {consecutiveFailures: 3, openFor: 60s}\n";
    let sc = sidecar(&primary_and_backup(
        &broken.base_url(),
        &backup.base_url(),
        spec,
    ))
    .await;
    for _ in 0..5 {
        assert_eq!(chat(&sc, false).await.status, 200);
    }
    assert_eq!(broken.count(), 3, "the breaker opened");
    reload_to(
        &sc,
        &primary_and_backup(&replacement.base_url(), &backup.base_url(), spec),
    )
    .await;
    let r = chat(&sc, false).await;
    assert_eq!(r.header("x-tailwarden-provider"), "primary");
    assert_eq!(replacement.count(), 1);
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics
            .contains("tailwarden_circuit_breaker_state{provider=\"primary\",route=\"t/test\"} 0"),
        "{metrics}"
    );
}
