//! The exact cache shared by replicas through a real `redis-server`: what one sidecar stored
//! is a hit in another (streams byte for byte), and Redis going away only costs hits.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{redis::RedisServer, *};
use http::Request;
use http_body_util::BodyExt;

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

fn config(url: &str, redis: &str) -> String {
    route(
        &[("p", url, 100, 0)],
        &format!(
            "  cache:\n    exact: {{enabled: true, scope: shared, backend: redis, redis: {{address: '{redis}'}}}}\n"
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
    let up = upstream(script).await;
    let one = sidecar(&config(&up.base_url(), &redis.address())).await;
    let two = sidecar(&config(&up.base_url(), &redis.address())).await;

    for (stored, body) in [(1, PLAIN), (2, STREAM)] {
        let (first, first_bytes) = send(&one, body).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.header("x-tailwarden-cache"), "miss");
        let calls = up.count();
        // The store to Redis happens after the response, in the background.
        wait_for_entries(&redis.address(), stored).await;
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

/// Waits until Redis holds `n` cache entries.
async fn wait_for_entries(address: &str, n: usize) {
    let client = ::redis::Client::open(format!("redis://{address}/")).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for _ in 0..250 {
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg("tailwarden:cache:*")
            .query_async(&mut conn)
            .await
            .unwrap();
        if keys.len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the shared store never held {n} entries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_lookups_miss_and_requests_are_still_served() {
    let mut redis = RedisServer::start();
    let up = upstream(script).await;
    let sc = sidecar(&config(&up.base_url(), &redis.address())).await;
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
    let errors = metrics
        .lines()
        .find(|l| l.starts_with("tailwarden_cache_backend_errors_total "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap();
    assert!(errors >= 1, "{metrics}");
}
