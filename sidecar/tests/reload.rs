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
