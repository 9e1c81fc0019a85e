//! The exact cache shared by replicas through a real `redis-server`: what one sidecar stored
//! is a hit in another (streams byte for byte), and Redis going away only costs hits.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{
    redis::{RedisServer, Secure},
    *,
};
use http::Request;
use http_body_util::BodyExt;
use tailwarden_sidecar::state::redis::RedisBackend;

async fn send(sc: &Sidecar, body: &str) -> (Reply, Bytes) {
    let req = Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        },
        bytes,
    )
}

/// `redis_yaml`: the route's `cache.exact.redis`, in YAML's flow style.
fn config(url: &str, redis_yaml: &str) -> String {
    route(
        &[("p", url, 100, 0)],
        &format!(
            "  cache:\n    exact: {{enabled: true, scope: shared, backend: redis, redis: {redis_yaml}}}\n"
        ),
    )
}

const PLAIN: &str =
    r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"shared?"}]}"#;
const STREAM: &str = r#"{"model":"m","stream":true,"temperature":0,"messages":[{"role":"user","content":"shared?"}]}"#;

fn script(n: usize, body: &str) -> Script {
    if body.contains(r#""stream":true"#) {
        Script::Stream {
            first_delay: Duration::ZERO,
            chunks: vec![
                (Duration::ZERO, sse_chunk(&format!("answer {n}"))),
                (Duration::from_millis(5), sse_chunk(" more")),
                (Duration::ZERO, DONE.to_owned()),
            ],
            end: StreamEnd::Finish,
        }
    } else {
        ok(&format!("answer {n}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_stored_by_one_replica_is_a_hit_in_another() {
    let redis = RedisServer::start();
    stored_by_one_is_a_hit_in_another(&redis, &format!("{{address: '{}'}}", redis.address())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_a_password_a_response_stored_by_one_replica_is_a_hit_in_another() {
    const PASSWORD: &str = "canary-cache-pw-6e2d91";
    let redis = RedisServer::start_secure(Secure::new(PASSWORD, false));
    let s = redis.secure().unwrap();
    let password = s.dir.join("password");
    std::fs::write(&password, format!("{PASSWORD}\n")).unwrap();
    stored_by_one_is_a_hit_in_another(
        &redis,
        &format!(
            "{{address: '{}', auth: {{password: {{file: '{}'}}}}, tls: {{ca: {{file: '{}'}}}}}}",
            redis.address(),
            password.display(),
            s.ca.display()
        ),
    )
    .await;
}

/// Two replicas of a route whose `cache.exact.redis` is `redis_yaml`: what one stored is a
/// hit in the other, plain and streamed.
async fn stored_by_one_is_a_hit_in_another(redis: &RedisServer, redis_yaml: &str) {
    let up = upstream(script).await;
    let one = sidecar(&config(&up.base_url(), redis_yaml)).await;
    let two = sidecar(&config(&up.base_url(), redis_yaml)).await;
    // A lookup has 50 ms in all and a store needs a connection: a replica whose connection
    // is still being set up (TCP, TLS, AUTH, the scripts) misses and keeps its store local,
    // by design. Each backend starts connecting when its config is loaded; sharing is
    // asserted once both replicas' connections are up.
    wait_connected(&one).await;
    wait_connected(&two).await;

    for (stored, body) in [(1, PLAIN), (2, STREAM)] {
        let (first, first_bytes) = send(&one, body).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.header("x-tailwarden-cache"), "miss");
        let calls = up.count();
        // The store to Redis happens after the response, in the background.
        wait_for_entries(redis, stored, &one).await;
        let (hit, hit_bytes) = send(&two, body).await;
        assert_eq!(hit.header("x-tailwarden-cache"), "hit", "the shared entry");
        assert_eq!(hit_bytes, first_bytes, "the same bytes, streams included");
        assert_eq!(
            up.count(),
            calls,
            "the other replica did not call the provider"
        );
        let (again, _) = send(&two, body).await;
        assert_eq!(again.header("x-tailwarden-cache"), "hit", "now a local hit");
        assert_eq!(up.count(), calls);
    }
}

/// The sidecar's shared-cache backend.
fn backend_of(sc: &Sidecar) -> std::sync::Arc<RedisBackend> {
    sc.app.table.load().routes[0]
        .cache
        .as_ref()
        .and_then(|c| c.shared())
        .expect("a shared cache")
        .backend()
        .clone()
}

/// Waits until the sidecar's shared-cache backend has a connection. A set-up that failed
/// (on a loaded machine a TLS set-up can outlast its 2 s bound) is tried again by the next
/// call once the retry interval has passed: lookups of a key nobody stores stand for the
/// requests that would come.
async fn wait_connected(sc: &Sidecar) {
    let backend = backend_of(sc);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !backend.is_connected() {
        assert!(
            std::time::Instant::now() < deadline,
            "the shared cache never connected ({} errors, last {:?})",
            backend.backend_errors(),
            backend.last_failure()
        );
        if backend.is_down() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        } else {
            let _ = backend.get_bytes("tailwarden:cache:never-stored").await;
        }
    }
}

/// Waits until Redis holds `n` cache entries, stored by `by`.
async fn wait_for_entries(redis: &RedisServer, n: usize, by: &Sidecar) {
    for _ in 0..250 {
        let keys =
            tokio::task::block_in_place(|| redis.cli(&["--raw", "KEYS", "tailwarden:cache:*"]))
                .unwrap_or_default();
        if keys.lines().filter(|l| !l.is_empty()).count() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let backend = backend_of(by);
    panic!(
        "the shared store never held {n} entries ({} backend errors, last {:?})",
        backend.backend_errors(),
        backend.last_failure()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_lookups_miss_and_requests_are_still_served() {
    let mut redis = RedisServer::start();
    let up = upstream(script).await;
    let sc = sidecar(&config(
        &up.base_url(),
        &format!("{{address: '{}'}}", redis.address()),
    ))
    .await;
    redis.kill();
    let started = std::time::Instant::now();
    for i in 0..5 {
        let body = PLAIN.replace("shared?", &format!("question {i}"));
        let (r, _) = send(&sc, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-tailwarden-cache"), "miss");
    }
    // Each lookup is bounded by the 50 ms timeout, and after a failure they fail fast.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The local cache still works.
    let (r, _) = send(&sc, &PLAIN.replace("shared?", "question 0")).await;
    assert_eq!(r.header("x-tailwarden-cache"), "hit");
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    // By reason.
    let errors = |reason: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "tailwarden_cache_backend_errors_total{{reason=\"{reason}\"}} "
                ))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
    };
    // A connection closed under a command, or refused at a reconnect.
    assert!(errors("command") + errors("connect") >= 1, "{metrics}");
    assert_eq!(errors("auth") + errors("tls"), 0, "{metrics}");
}
