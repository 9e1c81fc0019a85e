//! Local admission limits on tokio's paused clock (no sleeps): requests per second, tokens per
//! minute with reserve and settle, concurrency with a bounded FIFO queue and queue timeout,
//! per-tenant limits and the bounded tenant table, priorities in the concurrency queue
//! (most important first, the lowest shed first, the starvation bound), and what each
//! rejection says.
#![allow(clippy::unwrap_used)]

use std::{sync::Arc, time::Duration};

use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::json;
use tailwarden_crds::RateLimit;
use tailwarden_decide::request::RequestBody;
use tailwarden_sidecar::state::limits::{
    AdmissionGuard, LimitKind, LimiterOptions, Limiters, Rejection, RouteLimiter, Scope, admit,
    admit_with_priority, estimate_tokens, retry_after_secs,
};
use tokio::time::{Instant, advance};

fn limiter(spec: serde_json::Value) -> Arc<RouteLimiter> {
    limiter_with(spec, LimiterOptions::default())
}

fn limiter_with(spec: serde_json::Value, options: LimiterOptions) -> Arc<RouteLimiter> {
    let spec: RateLimit = serde_json::from_value(spec).unwrap();
    Arc::new(RouteLimiter::new("shop/chat", &spec, options).unwrap())
}

async fn ok(l: &Arc<RouteLimiter>, tenant: Option<&str>, estimate: u64) -> AdmissionGuard {
    match admit(l, tenant, estimate).await {
        Ok(g) => g,
        Err(e) => panic!("expected admission, got {e}"),
    }
}

async fn rejected(l: &Arc<RouteLimiter>, tenant: Option<&str>, estimate: u64) -> Rejection {
    match admit(l, tenant, estimate).await {
        Ok(g) => panic!("expected a rejection, got {g:?}"),
        Err(e) => e,
    }
}

#[tokio::test(start_paused = true)]
async fn requests_per_second_burst_then_rate_with_retry_after() {
    let l = limiter(json!({"requestsPerSecond": 5}));
    for _ in 0..5 {
        ok(&l, None, 0).await.settle(0);
    }
    let r = rejected(&l, None, 0).await;
    assert_eq!(r.limit(), LimitKind::RequestsPerSecond);
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.retry_after(), Duration::from_millis(200));
    assert_eq!(
        r.to_string(),
        "Rate limit reached for route shop/chat: requests per second (limit 5; this request needs 1). Retry after 1 s."
    );
    let e = r.to_api_error();
    assert_eq!(e.retry_after, Some(1));
    assert_eq!(e.code, Some("rate_limit_exceeded"));
    assert_eq!(e.kind, "rate_limit_error");

    advance(Duration::from_millis(200)).await;
    ok(&l, None, 0).await;
    assert!(admit(&l, None, 0).await.is_err());
    // A full second refills the whole burst, never more.
    advance(Duration::from_secs(10)).await;
    for _ in 0..5 {
        ok(&l, None, 0).await;
    }
    assert!(admit(&l, None, 0).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn tokens_per_minute_reserve_and_settle() {
    let l = limiter(json!({"tokensPerMinute": 10_000}));
    let a = ok(&l, None, 4_000).await;
    let b = ok(&l, None, 4_000).await;
    assert_eq!(a.reserved_tokens(), 4_000);
    let r = rejected(&l, None, 4_000).await;
    assert_eq!(r.limit(), LimitKind::TokensPerMinute);
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    // 2 000 left, 4 000 needed: 2 000 tokens at 10 000/min = 12 s.
    assert_eq!(r.retry_after(), Duration::from_secs(12));
    assert!(
        r.to_string()
            .contains("tokens per minute (limit 10000; this request needs 4000)")
    );

    // Settling with less than reserved gives the difference back at once.
    a.settle(1_000);
    let c = ok(&l, None, 4_000).await;
    // 10 000 - 1 000 - 4 000 - 4 000 = 1 000 left.
    assert!(admit(&l, None, 1_001).await.is_err());
    // A guard dropped without settlement keeps its estimate charged.
    drop(b);
    assert!(admit(&l, None, 1_001).await.is_err());
    // Using more than reserved puts the bucket in debt: 1 000 left - 3 000 more = -2 000.
    c.settle(7_000);
    let r = rejected(&l, None, 1).await;
    // 2 000 of debt + 1 token at 10 000/min = 12.006 s → Retry-After 13.
    assert_eq!(r.retry_after(), Duration::from_millis(12_006));
    assert_eq!(r.to_api_error().retry_after, Some(13));
    advance(Duration::from_millis(12_006)).await;
    ok(&l, None, 1).await;
}

#[tokio::test(start_paused = true)]
async fn oversized_estimate_passes_from_a_full_bucket_only() {
    let l = limiter(json!({"tokensPerMinute": 1_000}));
    ok(&l, None, 5_000).await.settle(5_000);
    let r = rejected(&l, None, 10).await;
    // 5 000 taken from a full bucket of 1 000: 4 000 of debt. 10 more tokens need
    // 4 010 tokens of refill at 1 000/min = 240.6 s.
    assert_eq!(r.retry_after(), Duration::from_millis(240_600));
}

#[tokio::test(start_paused = true)]
async fn a_rejection_gives_back_what_earlier_checks_took() {
    let l = limiter(json!({"requestsPerSecond": 2, "tokensPerMinute": 100}));
    let g = ok(&l, None, 60).await;
    // The token check fails five times; each time the request-per-second token it took
    // first must be returned.
    for _ in 0..5 {
        assert_eq!(
            rejected(&l, None, 50).await.limit(),
            LimitKind::TokensPerMinute
        );
    }
    // So one request-per-second token is still there.
    ok(&l, None, 40).await;
    assert_eq!(
        rejected(&l, None, 0).await.limit(),
        LimitKind::RequestsPerSecond
    );
    drop(g);
}

#[tokio::test(start_paused = true)]
async fn concurrency_queue_is_fifo_bounded_and_times_out() {
    let l = limiter(json!({"maxConcurrent": 2, "maxQueued": 2, "queueTimeout": "500ms"}));
    let a = ok(&l, None, 0).await;
    let b = ok(&l, None, 0).await;

    // Two waiters queue in order; a third finds the queue full and is shed at once.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for i in 0..2 {
        let (l, tx) = (l.clone(), tx.clone());
        waiters.push(tokio::spawn(async move {
            let g = admit(&l, None, 0).await;
            tx.send((i, g.is_ok(), Instant::now())).unwrap();
            g
        }));
        tokio::task::yield_now().await;
    }
    let started = Instant::now();
    let full = rejected(&l, None, 0).await;
    assert!(
        matches!(full, Rejection::QueueFull { queued: 2, .. }),
        "{full:?}"
    );
    assert_eq!(full.limit(), LimitKind::Concurrency);
    assert_eq!(full.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(started.elapsed(), Duration::ZERO, "shed without waiting");
    assert_eq!(full.to_api_error().code, Some("overloaded"));
    assert!(
        full.to_string()
            .contains("concurrency (limit 2, and 2 already waiting)")
    );

    // Releasing slots admits the waiters first-in, first-out.
    advance(Duration::from_millis(100)).await;
    drop(a);
    let (first, admitted, _) = rx.recv().await.unwrap();
    assert_eq!((first, admitted), (0, true));
    drop(b);
    let (second, admitted, _) = rx.recv().await.unwrap();
    assert_eq!((second, admitted), (1, true));
    let held: Vec<_> = futures_util::future::join_all(waiters)
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    assert_eq!(held[0].waited(), Duration::from_millis(100));

    // With both slots held, a waiter is shed when queueTimeout passes.
    let started = Instant::now();
    let timed_out = rejected(&l, None, 0).await;
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    assert!(
        matches!(timed_out, Rejection::QueueTimeout { .. }),
        "{timed_out:?}"
    );
    assert_eq!(timed_out.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(timed_out.to_api_error().retry_after, Some(1));
    assert_eq!(
        timed_out.to_string(),
        "Too many requests in flight for route shop/chat: concurrency (limit 2); no slot freed within the queue timeout of 500 ms. Retry after 1 s."
    );
    drop(held);
    ok(&l, None, 0).await;
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_waiter_leaves_the_queue() {
    let l = limiter(json!({"maxConcurrent": 1, "maxQueued": 1, "queueTimeout": "10s"}));
    let _a = ok(&l, None, 0).await;
    let waiter = {
        let l = l.clone();
        tokio::spawn(async move { admit(&l, None, 0).await.map(|_| ()) })
    };
    tokio::task::yield_now().await;
    assert!(matches!(
        rejected(&l, None, 0).await,
        Rejection::QueueFull { .. }
    ));
    waiter.abort();
    let _ = waiter.await;
    // The aborted waiter's place is free again: this one queues (and times out) instead
    // of being shed at once.
    let started = Instant::now();
    assert!(matches!(
        rejected(&l, None, 0).await,
        Rejection::QueueTimeout { .. }
    ));
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

fn tenant_headers(value: &'static str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("x-tenant-id", HeaderValue::from_static(value));
    h
}

#[tokio::test(start_paused = true)]
async fn tenants_have_their_own_limits_under_the_routes() {
    let l = limiter(json!({
        "requestsPerSecond": 5,
        "tenantHeader": "X-Tenant-Id",
        "perTenant": {"requestsPerSecond": 2, "maxConcurrent": 1},
        "queueTimeout": "100ms"
    }));
    let acme = l.tenant_of(&tenant_headers("acme")).unwrap();
    assert_eq!(acme, "acme");
    assert_eq!(l.tenant_of(&HeaderMap::new()).as_deref(), Some(""));

    let g = ok(&l, Some(&acme), 0).await;
    // acme's own concurrency limit: a 429 for acme, not an overload 503.
    let r = rejected(&l, Some(&acme), 0).await;
    assert_eq!(r.limit(), LimitKind::Concurrency);
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        r.scope(),
        &Scope::Tenant {
            route: "shop/chat".into(),
            tenant: "acme".into()
        }
    );
    assert!(r.to_string().contains("tenant \"acme\" of route shop/chat"));
    drop(g);
    // Its rate: 2 per second, and the request shed above gave its token back.
    ok(&l, Some(&acme), 0).await;
    let r = rejected(&l, Some(&acme), 0).await;
    assert_eq!(r.limit(), LimitKind::RequestsPerSecond);
    assert!(matches!(r.scope(), Scope::Tenant { .. }));

    // Others are not affected by acme, but the route's own 5/s caps them all together.
    ok(&l, Some("globex"), 0).await;
    ok(&l, Some("initech"), 0).await;
    let anonymous = ok(&l, Some(""), 0).await;
    let r = rejected(&l, Some("umbrella"), 0).await;
    assert_eq!(r.scope(), &Scope::Route("shop/chat".into()));
    assert_eq!(r.limit(), LimitKind::RequestsPerSecond);
    drop(anonymous);
    assert_eq!(
        Scope::Tenant {
            route: "shop/chat".into(),
            tenant: "".into()
        }
        .to_string(),
        "requests without a tenant header on route shop/chat"
    );
}

#[tokio::test(start_paused = true)]
async fn the_tenant_table_is_bounded_and_never_forgets_a_busy_tenant() {
    let l = limiter_with(
        json!({"tenantHeader": "x-tenant-id", "queueTimeout": "1ms",
               "perTenant": {"requestsPerSecond": 1, "maxConcurrent": 1}}),
        LimiterOptions {
            max_tenants: Some(100),
            ..LimiterOptions::default()
        },
    );
    // "hog" holds its one concurrency slot for the whole test.
    let hog = ok(&l, Some("hog"), 0).await;
    for i in 0..5_000 {
        let t = format!("tenant-{i}");
        ok(&l, Some(&t), 0).await.settle(0);
        if i % 100 == 99 {
            // Let buckets refill so that idle tenants become evictable.
            advance(Duration::from_secs(1)).await;
        }
    }
    let tracked = l.tenants_tracked();
    assert!(tracked <= 250, "tenant table grew to {tracked}");
    // Had "hog" been forgotten, a fresh entry would hand it a second slot.
    let r = rejected(&l, Some("hog"), 0).await;
    assert_eq!(r.limit(), LimitKind::Concurrency);
    drop(hog);
    ok(&l, Some("hog"), 0).await;
}

#[test]
fn token_estimates() {
    let body = |s: &str| s.to_owned();
    let cases = [
        // 40 bytes of messages / 4 + default output.
        (
            body(r#"{"model":"m","messages":[{"content":"0123456789abcdefghij"}]}"#),
            9 + 1000,
        ),
        (body(r#"{"model":"m","messages":[],"max_tokens":50}"#), 50),
        (
            body(r#"{"model":"m","messages":[],"max_tokens":50,"max_completion_tokens":70,"n":3}"#),
            210,
        ),
        (
            body(r#"{"model":"m","prompt":"abcdefgh","max_tokens":0}"#),
            2,
        ),
        (
            body(r#"{"model":"m","input":"abcdefgh","max_tokens":1}"#),
            3,
        ),
    ];
    for (text, want) in cases {
        let parsed = RequestBody::parse(text.as_bytes()).unwrap();
        assert_eq!(estimate_tokens(&parsed), want, "{text}");
    }
}

#[test]
fn retry_after_rounds_up_to_whole_seconds() {
    assert_eq!(retry_after_secs(Duration::ZERO), 1);
    assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
    assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
    assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
    assert_eq!(retry_after_secs(Duration::from_secs(60)), 60);
}

#[tokio::test(start_paused = true)]
async fn limiters_survive_reloads_when_unchanged() {
    let limiters = Limiters::new(None);
    let spec: RateLimit = serde_json::from_value(json!({"requestsPerSecond": 1})).unwrap();
    let a = limiters
        .for_route("shop/chat", Some(&spec))
        .unwrap()
        .unwrap();
    ok(&a, None, 0).await;
    let again = limiters
        .for_route("shop/chat", Some(&spec))
        .unwrap()
        .unwrap();
    assert!(Arc::ptr_eq(&a, &again), "same spec, same buckets");
    assert!(
        admit(&again, None, 0).await.is_err(),
        "a reload is no fresh burst"
    );
    let changed: RateLimit = serde_json::from_value(json!({"requestsPerSecond": 2})).unwrap();
    let b = limiters
        .for_route("shop/chat", Some(&changed))
        .unwrap()
        .unwrap();
    assert!(!Arc::ptr_eq(&a, &b));
    assert!(limiters.for_route("shop/chat", None).unwrap().is_none());
    limiters.retain(&[]);
}

/// Outcomes of queued admissions, by label.
type Outcomes =
    tokio::sync::mpsc::UnboundedReceiver<(&'static str, Result<AdmissionGuard, Rejection>)>;

/// Queues `admit_with_priority` at each priority in turn (each parked before the next
/// arrives); every outcome is sent with its label.
fn queue_up(
    l: &Arc<RouteLimiter>,
    waiters: &[(&'static str, u8)],
) -> (Outcomes, Vec<tokio::task::JoinHandle<()>>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let tasks = waiters
        .iter()
        .map(|&(name, priority)| {
            let (l, tx) = (l.clone(), tx.clone());
            tokio::spawn(async move {
                let r = admit_with_priority(&l, None, 0, priority).await;
                tx.send((name, r)).unwrap();
            })
        })
        .collect();
    (rx, tasks)
}

#[tokio::test(start_paused = true)]
async fn a_freed_slot_goes_to_the_most_important_waiter() {
    let l = limiter(
        json!({"maxConcurrent": 1, "maxQueued": 10, "queueTimeout": "10s",
                           "priority": {"header": "x-priority"}}),
    );
    let held = ok(&l, None, 0).await;
    let (mut rx, _tasks) = queue_up(
        &l,
        &[("batch", 1), ("core", 9), ("normal", 5), ("core-2", 9)],
    );
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    assert_eq!(l.concurrency(), (1, 4));
    assert_eq!(l.queued_by_priority(), [0, 1, 0, 0, 0, 1, 0, 0, 0, 2]);
    advance(Duration::from_millis(50)).await;
    let mut order = Vec::new();
    let mut slot = held;
    for _ in 0..4 {
        drop(slot);
        let (name, r) = rx.recv().await.unwrap();
        let g = r.unwrap();
        assert_eq!(g.waited(), Duration::from_millis(50), "{name}");
        order.push(name);
        slot = g;
    }
    assert_eq!(order, ["core", "core-2", "normal", "batch"]);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_sheds_the_least_important_first() {
    let l = limiter(
        json!({"maxConcurrent": 1, "maxQueued": 2, "queueTimeout": "10s",
                           "priority": {}}),
    );
    let held = ok(&l, None, 0).await;
    let (mut rx, _tasks) = queue_up(&l, &[("batch", 0), ("normal", 5)]);
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
    // A core request finds the queue full: the batch request gives it its place, at once.
    let (mut core_rx, _core) = queue_up(&l, &[("core", 9)]);
    let (name, r) = rx.recv().await.unwrap();
    assert_eq!(name, "batch");
    let shed = r.unwrap_err();
    assert!(
        matches!(shed, Rejection::Shed { priority: 0, .. }),
        "{shed:?}"
    );
    assert_eq!(shed.limit(), LimitKind::Concurrency);
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(shed.shed_reason(), Some("displaced"));
    assert_eq!(
        shed.to_string(),
        "Too many requests in flight for route shop/chat: concurrency (limit 1); this request (priority 0) gave its place in the full queue to a more important one. Retry after 10 s."
    );
    assert_eq!(shed.to_api_error().code, Some("overloaded"));
    // A newcomer no more important than anyone waiting is shed itself, without waiting.
    let started = Instant::now();
    let full = admit_with_priority(&l, None, 0, 5).await.unwrap_err();
    assert!(
        matches!(full, Rejection::QueueFull { queued: 2, .. }),
        "{full:?}"
    );
    assert_eq!(full.shed_reason(), Some("full"));
    assert_eq!(started.elapsed(), Duration::ZERO);
    // The core request is served first, then the normal one.
    drop(held);
    let (name, r) = core_rx.recv().await.unwrap();
    assert_eq!(name, "core");
    drop(r.unwrap());
    let (name, r) = rx.recv().await.unwrap();
    assert_eq!(name, "normal");
    assert!(r.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_low_priority_waiter_is_served_once_it_waited_the_starvation_bound() {
    // One slot, a core request every 50 ms each holding it 100 ms (twice what the slot
    // serves): without the bound the batch request would wait until its queue timeout.
    let l = limiter(
        json!({"maxConcurrent": 1, "maxQueued": 100, "queueTimeout": "5s",
                           "priority": {"starvationBound": "1s"}}),
    );
    let first = ok(&l, None, 0).await;
    let started = Instant::now();
    let batch = {
        let l = l.clone();
        tokio::spawn(async move {
            let g = admit_with_priority(&l, None, 0, 0).await.unwrap();
            (Instant::now(), g.waited())
        })
    };
    let holder = {
        let l = l.clone();
        tokio::spawn(async move {
            // Each core request holds its slot for 100 ms once admitted.
            let mut tasks = Vec::new();
            for _ in 0..60 {
                let l = l.clone();
                tasks.push(tokio::spawn(async move {
                    if let Ok(g) = admit_with_priority(&l, None, 0, 9).await {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        drop(g);
                    }
                }));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            futures_util::future::join_all(tasks).await;
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(first);
    let (served_at, waited) = batch.await.unwrap();
    let waited_since_start = served_at - started;
    // Served at the first slot freed after 1 s of waiting, not before, not at 5 s.
    assert!(
        waited >= Duration::from_secs(1) && waited <= Duration::from_millis(1100),
        "{waited:?} ({waited_since_start:?})"
    );
    holder.abort();
}

#[tokio::test(start_paused = true)]
async fn without_priorities_every_request_is_equal_and_the_queue_is_fifo() {
    let l = limiter(json!({"maxConcurrent": 1, "maxQueued": 3, "queueTimeout": "10s"}));
    assert_eq!(l.priority_of(&HeaderMap::new(), Some(9)), Ok(None));
    let held = ok(&l, None, 0).await;
    // admit() queues at one priority: arrival order is served.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for name in ["a", "b", "c"] {
        let (l, tx) = (l.clone(), tx.clone());
        tokio::spawn(async move {
            let g = admit(&l, None, 0).await;
            tx.send((name, g)).unwrap();
        });
        tokio::task::yield_now().await;
    }
    let mut slot = held;
    let mut order = Vec::new();
    for _ in 0..3 {
        drop(slot);
        let (name, g) = rx.recv().await.unwrap();
        order.push(name);
        slot = g.unwrap();
    }
    assert_eq!(order, ["a", "b", "c"]);
}

#[test]
fn priority_comes_from_the_header_then_the_tier_then_the_default() {
    let l = limiter(json!({"maxConcurrent": 1,
                           "priority": {"header": "X-Priority", "defaultPriority": 3}}));
    let mut h = HeaderMap::new();
    assert_eq!(l.priority_of(&h, None), Ok(Some(3)));
    assert_eq!(l.priority_of(&h, Some(7)), Ok(Some(7)));
    h.insert("x-priority", HeaderValue::from_static("8"));
    assert_eq!(l.priority_of(&h, Some(1)), Ok(Some(8)));
    h.insert("x-priority", HeaderValue::from_static("urgent"));
    let e = l.priority_of(&h, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the x-priority header must be one digit, 0 (least important) to 9; got \"urgent\""
    );
    // Without a header name only tiers and the default count.
    let l = limiter(json!({"maxConcurrent": 1, "priority": {}}));
    assert_eq!(l.priority_of(&h, None), Ok(Some(5)));
}
