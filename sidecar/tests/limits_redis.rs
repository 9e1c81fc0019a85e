//! The shared rate-limit backend against a real `redis-server` (Debian package
//! `redis-server`), started by each test on a free loopback port and stopped at the end.
//!
//! Two limiters, each with its own Redis connection, stand for two sidecar replicas of one
//! route. They must enforce a single tokens-per-minute limit together (within 5 %), keep
//! Redis off the hot path (lease round trips are counted), and follow the route's
//! `failMode` when Redis is killed mid-test.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use common::redis::RedisServer;
use serde_json::json;
use tailwarden_crds::RateLimit;
use tailwarden_sidecar::state::{
    limits::{LimitKind, LimiterOptions, Rejection, RouteLimiter, admit},
    redis::{BackendSettings, RedisBackend},
};
use tokio::time::Instant;

fn settings() -> BackendSettings {
    BackendSettings {
        op_timeout: Duration::from_millis(100),
        connect_timeout: Duration::from_secs(2),
        retry_interval: Duration::from_millis(200),
    }
}

/// One "sidecar": a limiter with its own backend connection.
fn replica(spec: &serde_json::Value) -> (Arc<RouteLimiter>, Arc<RedisBackend>) {
    let spec: RateLimit = serde_json::from_value(spec.clone()).unwrap();
    let address = spec.redis.as_ref().unwrap().address.clone();
    let backend = Arc::new(RedisBackend::new(&address, settings(), None).unwrap());
    let limiter = RouteLimiter::new(
        "shop/chat",
        &spec,
        LimiterOptions {
            backend: Some(backend.clone()),
            max_tenants: None,
        },
    )
    .unwrap();
    (Arc::new(limiter), backend)
}

#[derive(Default)]
struct Counts {
    admitted: AtomicU64,
    tokens: AtomicU64,
    rate_rejections: AtomicU64,
    backend_rejections: AtomicU64,
}

/// Switches shared by the load loops and the test.
#[derive(Default)]
struct Flags {
    stop: AtomicBool,
    /// Count settled tokens only while set.
    measuring: AtomicBool,
    /// Set by the first rate rejection: the burst is spent.
    saturated: AtomicBool,
}

/// Runs `workers` loops of admit → settle on a limiter until `flags.stop`.
async fn load(
    limiter: Arc<RouteLimiter>,
    workers: usize,
    (estimate, actual): (u64, u64),
    flags: Arc<Flags>,
    counts: Arc<Counts>,
) {
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (limiter, flags, counts) = (limiter.clone(), flags.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            while !flags.stop.load(Ordering::Relaxed) {
                match admit(&limiter, None, estimate).await {
                    Ok(guard) => {
                        guard.settle(actual);
                        if flags.measuring.load(Ordering::Relaxed) {
                            counts.admitted.fetch_add(1, Ordering::Relaxed);
                            counts.tokens.fetch_add(actual, Ordering::Relaxed);
                        }
                        tokio::task::yield_now().await;
                    }
                    Err(Rejection::BackendDown { .. }) => {
                        counts.backend_rejections.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(r) => {
                        assert_eq!(r.limit(), LimitKind::TokensPerMinute, "{r}");
                        flags.saturated.store(true, Ordering::Relaxed);
                        if flags.measuring.load(Ordering::Relaxed) {
                            counts.rate_rejections.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(r.retry_after().min(Duration::from_millis(5))).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_enforce_one_tokens_per_minute_limit() {
    let redis = RedisServer::start();
    // 600 000 tokens/min = 10 000 tokens/s. Requests reserve 150 and use 100, so
    // settlement gives tokens back on every request.
    let spec = json!({"tokensPerMinute": 600_000, "backend": "redis",
                      "redis": {"address": redis.address(), "failMode": "closed"}});
    let (a, backend_a) = replica(&spec);
    let (b, backend_b) = replica(&spec);
    let flags = Arc::new(Flags::default());
    let (counts_a, counts_b) = (Arc::new(Counts::default()), Arc::new(Counts::default()));
    let run_a = tokio::spawn(load(a, 4, (150, 100), flags.clone(), counts_a.clone()));
    let run_b = tokio::spawn(load(b, 4, (150, 100), flags.clone(), counts_b.clone()));
    // Drain the minute's burst first, then measure the steady rate.
    let drain_deadline = Instant::now() + Duration::from_secs(20);
    while !flags.saturated.load(Ordering::Relaxed) {
        assert!(Instant::now() < drain_deadline, "the burst never drained");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let trips_before = backend_a.round_trips() + backend_b.round_trips();
    flags.measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    flags.measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    flags.stop.store(true, Ordering::Relaxed);
    run_a.await.unwrap();
    run_b.await.unwrap();
    let trips = backend_a.round_trips() + backend_b.round_trips() - trips_before;

    let used = counts_a.tokens.load(Ordering::Relaxed) + counts_b.tokens.load(Ordering::Relaxed);
    let requests =
        counts_a.admitted.load(Ordering::Relaxed) + counts_b.admitted.load(Ordering::Relaxed);
    let decisions = requests
        + counts_a.rate_rejections.load(Ordering::Relaxed)
        + counts_b.rate_rejections.load(Ordering::Relaxed);
    let expected = 10_000.0 * elapsed.as_secs_f64();
    let error = (used as f64 - expected) / expected;
    println!(
        "saturated: {used} tokens used in {elapsed:?} (limit rate {expected:.0}): error {:+.2} %; \
         replica a {} / b {} requests admitted; {trips} Redis round trips for {requests} admitted \
         requests ({:.1} per admitted request) and {decisions} decisions ({:.0} per 1000)",
        error * 100.0,
        counts_a.admitted.load(Ordering::Relaxed),
        counts_b.admitted.load(Ordering::Relaxed),
        trips as f64 / requests.max(1) as f64,
        trips as f64 * 1000.0 / decisions.max(1) as f64
    );
    assert!(
        error.abs() <= 0.05,
        "two replicas used {used} tokens, expected {expected:.0} ± 5 %"
    );
    assert!(
        counts_a.admitted.load(Ordering::Relaxed) > 0
            && counts_b.admitted.load(Ordering::Relaxed) > 0
    );
    assert_eq!(backend_a.backend_errors() + backend_b.backend_errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_limit_most_requests_never_wait_on_redis() {
    let redis = RedisServer::start();
    // 2 000 000 tokens/min; 2 × 1 000 requests of 500 tokens stay well inside the burst.
    let spec = json!({"tokensPerMinute": 2_000_000, "backend": "redis",
                      "redis": {"address": redis.address()}});
    let (a, backend_a) = replica(&spec);
    let (b, backend_b) = replica(&spec);
    let started = std::time::Instant::now();
    for _ in 0..1_000 {
        admit(&a, None, 500).await.unwrap().settle(450);
        admit(&b, None, 500).await.unwrap().settle(450);
    }
    let per_call = started.elapsed() / 2_000;
    let trips = backend_a.round_trips() + backend_b.round_trips();
    println!(
        "unsaturated: {trips} Redis round trips for 2000 requests ({:.1} per 1000); {per_call:?} per admit+settle (debug build)",
        trips as f64 / 2.0
    );
    // Each replica leases 1/20 of a minute's tokens (100 000) at a time: 2 × 1 000 × 500
    // tokens need about a dozen leases, plus returns of settlement refunds.
    assert!(trips <= 60, "{trips} round trips for 2000 requests");
}

/// Kills Redis while two replicas are under load and returns what happened after.
async fn kill_mid_test(fail_mode: &str) -> (Counts, u64, RedisServer, Arc<RouteLimiter>) {
    let mut redis = RedisServer::start();
    let spec = json!({"tokensPerMinute": 60_000, "backend": "redis",
                      "redis": {"address": redis.address(), "failMode": fail_mode}});
    let (a, backend_a) = replica(&spec);
    let (b, backend_b) = replica(&spec);
    // Warm up: leases taken, connections open (2 000 of the 60 000 tokens).
    for _ in 0..10 {
        admit(&a, None, 100).await.unwrap().settle(100);
        admit(&b, None, 100).await.unwrap().settle(100);
    }
    redis.kill();
    let after = Counts::default();
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        for l in [&a, &b] {
            match admit(l, None, 100).await {
                Ok(g) => {
                    g.settle(100);
                    after.admitted.fetch_add(1, Ordering::Relaxed);
                    after.tokens.fetch_add(100, Ordering::Relaxed);
                }
                Err(Rejection::BackendDown { .. }) => {
                    after.backend_rejections.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    after.rate_rejections.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let errors = backend_a.backend_errors() + backend_b.backend_errors();
    (after, errors, redis, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_fail_open_keeps_admitting_on_local_limits() {
    let (after, errors, _redis, _) = kill_mid_test("open").await;
    let admitted = after.admitted.load(Ordering::Relaxed);
    println!(
        "fail open: {admitted} admitted, {} backend rejections, {errors} backend errors counted",
        after.backend_rejections.load(Ordering::Relaxed)
    );
    assert_eq!(after.backend_rejections.load(Ordering::Relaxed), 0);
    assert!(admitted >= 100, "only {admitted} admitted with Redis down");
    assert!(errors > 0, "the outage must be counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_fail_closed_rejects_with_503_once_leases_are_spent_then_recovers() {
    let (after, errors, mut redis, a) = kill_mid_test("closed").await;
    let admitted = after.admitted.load(Ordering::Relaxed);
    let down = after.backend_rejections.load(Ordering::Relaxed);
    println!(
        "fail closed: {admitted} admitted from leases already held, {down} rejected with 503, {errors} backend errors counted"
    );
    assert!(down > 100, "only {down} BackendDown rejections");
    // Only tokens already leased (at most 2 × 1/20 of 600 000 plus refunds kept) can be
    // spent while Redis is away.
    assert!(
        admitted * 100 <= 2 * 2 * 30_000,
        "{admitted} admitted with Redis down"
    );
    assert!(errors > 0);
    let r = loop {
        match admit(&a, None, 100).await {
            Err(r @ Rejection::BackendDown { .. }) => break r,
            Ok(g) => g.settle(100),
            Err(_) => {}
        }
    };
    assert_eq!(r.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.limit(), LimitKind::Backend);
    assert!(r.to_string().contains("failMode: closed"), "{r}");

    // Redis is back: after the retry interval the replica reconnects and admits again.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if admit(&a, None, 100).await.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A take that Redis answers only after the request gave up waiting (the server holds
/// every command past the operation timeout): the request follows the fail mode, but the
/// tokens Redis granted are not lost to the limit — they land in the replica's lease, and
/// the next request is served from it without asking Redis again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_answered_after_the_request_gave_up_keeps_its_tokens_in_the_lease() {
    let redis = RedisServer::start();
    // 60 000 tokens/min: a request of 1 000 on an empty lease takes 1 000 plus up to a
    // lease (3 000).
    let spec = json!({"tokensPerMinute": 60_000, "backend": "redis",
                      "redis": {"address": redis.address(), "failMode": "closed"}});
    let (a, backend) = replica(&spec);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !backend.is_connected() {
        assert!(Instant::now() < deadline, "{:?}", backend.last_failure());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Redis holds every client's commands for 700 ms; the request waits 100 ms.
    let paused = Instant::now();
    let ok = tokio::task::block_in_place(|| redis.cli(&["CLIENT", "PAUSE", "700", "ALL"]));
    assert_eq!(ok.as_deref().map(str::trim), Some("OK"));
    let refused = admit(&a, None, 1_000).await;
    let waited = paused.elapsed();
    assert!(
        matches!(refused, Err(Rejection::BackendDown { .. })),
        "a take not answered within the operation timeout fails closed: {refused:?}"
    );
    assert!(
        waited < Duration::from_millis(600),
        "the request waited {waited:?}, not the operation timeout"
    );
    assert_eq!(backend.backend_errors(), 1, "the timeout is counted once");
    let trips = backend.round_trips();
    // The pause ends; Redis runs the take and its answer arrives after the request left.
    // Calls no longer fail fast once that answer is in (before retry_interval is over).
    let deadline = Instant::now() + Duration::from_secs(5);
    while backend.is_down() || paused.elapsed() < Duration::from_millis(700) {
        assert!(Instant::now() < deadline, "the late answer never came");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t =
        tokio::task::block_in_place(|| redis.cli(&["HGET", "tailwarden:rl:shop/chat:tpm", "t"]));
    let left: f64 = t
        .as_deref()
        .map(str::trim)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("the shared bucket: {t:?}"));
    assert!(
        left <= 60_000.0 - 1_000.0,
        "Redis granted the late take: {left} tokens left"
    );
    let admitted = admit(&a, None, 1_000).await;
    assert!(
        admitted.is_ok(),
        "the late grant serves the next request: {:?}",
        admitted.err()
    );
    assert_eq!(
        backend.round_trips(),
        trips,
        "the next request was served from the lease the late answer filled, without a call"
    );
    assert_eq!(backend.backend_errors(), 1);
}
