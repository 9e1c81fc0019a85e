//! The semantic cache with real embeddings calls over loopback: a scripted embeddings
//! provider returns deterministic bag-of-words vectors, under which a question and its
//! negation are closer than the 0.92 threshold — so only the guards stand between the
//! negated question and the wrong cached answer. Also: `embed()`'s request (path, key,
//! body) and its errors (status, timeout, malformed JSON, missing key, refused connection),
//! and, ignored, the measured cost of a lookup.
//!
//! ```sh
//! cargo test --release -p tailwarden-sidecar --test semantic_cache -- --ignored --nocapture
//! ```
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::{Script, TempDir, ok, post, route, sidecar, upstream};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};
use tailwarden_decide::request::RequestBody;
use tailwarden_sidecar::{
    attempts::embed::{SemanticError, embed},
    config::{Registries, Route, RouteTable},
    state::{
        exact::Entry,
        semantic::{
            Embedding, GuardRefusal, Lookup, SemanticCache, SemanticCaches, SemanticSettings,
            cosine,
        },
    },
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KEY: &str = "sk-test-semantic-4f1c9a";
const DIMS: usize = 1536;

/// Bag-of-words vector: each lowercase word hashed (FNV-1a) into one of 1536 dimensions.
fn bag_of_words(text: &str) -> Vec<f32> {
    let mut v = vec![0f32; DIMS];
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in word.to_lowercase().bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        v[(h % DIMS as u64) as usize] += 1.0;
    }
    v
}

fn respond(status: u16, body: String) -> Script {
    Script::Respond {
        delay: Duration::ZERO,
        status,
        headers: vec![],
        body,
    }
}

/// An OpenAI-compatible embeddings answer for the request's `input`.
fn embeddings_answer(request: &str) -> Script {
    let Ok(req) = serde_json::from_str::<Value>(request) else {
        return respond(
            400,
            r#"{"error":{"message":"bad json","type":"invalid_request_error","code":null}}"#.into(),
        );
    };
    let input = req["input"].as_str().unwrap_or_default();
    let body = json!({
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": bag_of_words(input)}],
        "model": req["model"],
        "usage": {"prompt_tokens": 8, "total_tokens": 8}
    });
    respond(200, body.to_string())
}

/// A compiled route whose provider `emb` is at `base_url`, with a key file, and a semantic
/// cache using it.
struct Fixture {
    route: Arc<Route>,
    _dir: TempDir,
}

fn fixture(base_url: &str, key: Option<&str>, semantic: &str) -> Fixture {
    let dir = TempDir::new();
    let key_file = dir.0.join("key");
    if let Some(k) = key {
        std::fs::write(&key_file, k).unwrap();
    }
    let yaml = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: shop}}\nspec:\n  models: ['*']\n  providers:\n  - name: emb\n    baseUrl: '{base_url}'\n    auth: {{file: '{}'}}\n  cache:\n    semantic: {semantic}\n",
        key_file.display()
    );
    let routes = tailwarden_crds::load_str("route.yaml", &yaml).unwrap();
    let table = RouteTable::compile(routes, &Registries::default()).unwrap();
    Fixture {
        route: table.routes[0].clone(),
        _dir: dir,
    }
}

const SEMANTIC_ON: &str =
    "{enabled: true, embeddingsProvider: emb, embeddingsModel: text-embedding-3-small}";

fn chat(question: &str) -> String {
    json!({"model": "gpt-4.1", "temperature": 0, "messages": [
        {"role": "system", "content": "Answer yes or no."},
        {"role": "user", "content": question}]})
    .to_string()
}

/// What the request path does before going upstream: prepare, embed, look up.
async fn ask(
    cache: &Arc<SemanticCache>,
    route: &Route,
    question: &str,
) -> (
    tailwarden_sidecar::state::semantic::Query,
    Embedding,
    Lookup,
) {
    let body = chat(question);
    let parsed = RequestBody::parse(body.as_bytes()).unwrap();
    let query = cache
        .query(&parsed, "/chat/completions", "gpt-4.1", &HeaderMap::new())
        .unwrap();
    let upstream = route.provider(&cache.settings().provider).unwrap();
    let settings = cache.settings();
    let vector = embed(upstream, &settings.model, &query.text, settings.timeout)
        .await
        .unwrap();
    let embedding = Embedding::new(vector).unwrap();
    let lookup = cache.lookup(&query, &embedding);
    (query, embedding, lookup)
}

#[tokio::test]
async fn a_semantic_pair_differing_only_by_not_is_not_served_from_cache() {
    let provider = upstream(|_, body| embeddings_answer(body)).await;
    let f = fixture(&provider.base_url(), Some(KEY), SEMANTIC_ON);
    let caches = SemanticCaches::default();
    let cache = caches.for_route("shop/chat", &f.route.spec).unwrap();
    assert_eq!(cache.settings().threshold, 0.92);

    // A miss, answered upstream and stored after a clean completion.
    let (query, embedding, lookup) = ask(&cache, &f.route, "Is Paris the capital of France?").await;
    assert!(matches!(lookup, Lookup::Miss), "{lookup:?}");
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let mut fill = cache
        .fill(&query, &embedding, StatusCode::OK, &headers)
        .unwrap();
    fill.push(&Bytes::from_static(
        br#"{"choices":[{"message":{"content":"Yes."}}]}"#,
    ));
    assert!(fill.commit());

    // The same question written differently is served from the cache.
    let (_, _, lookup) = ask(&cache, &f.route, "is paris the capital of france").await;
    match &lookup {
        Lookup::Hit { similarity, entry } => {
            assert!(*similarity >= 0.92, "{similarity}");
            assert_eq!(
                entry.body(),
                Bytes::from_static(br#"{"choices":[{"message":{"content":"Yes."}}]}"#)
            );
        }
        other => panic!("wanted a semantic hit, got {other:?}"),
    }

    // Its negation is above the threshold by the embeddings alone, and still refused.
    let (_, negated, lookup) = ask(&cache, &f.route, "Is Paris not the capital of France?").await;
    let similarity = negated.similarity(&embedding);
    assert!(
        similarity > 0.92,
        "the pair must be a near match for this test to mean anything: {similarity}"
    );
    match lookup {
        Lookup::Refused {
            similarity: s,
            reason,
        } => {
            assert_eq!(reason, GuardRefusal::Negation);
            assert!((s - similarity).abs() < 1e-6);
        }
        other => panic!("the negated question must not be served from cache: {other:?}"),
    }
    let stats = cache.stats();
    assert_eq!(stats.hits.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(stats.refused.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(provider.count(), 3, "one embeddings call per request");
}

#[tokio::test]
async fn embed_sends_the_model_and_input_with_the_provider_key() {
    let provider = upstream(|_, body| embeddings_answer(body)).await;
    let f = fixture(&provider.base_url(), Some(KEY), SEMANTIC_ON);
    let up = &f.route.upstreams[0];
    let v = embed(
        up,
        "text-embedding-3-small",
        "Hello there",
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    assert_eq!(v.len(), DIMS);
    assert!((cosine(&v, &bag_of_words("hello THERE")) - 1.0).abs() < 1e-6);
    let seen = provider.seen.lock().unwrap()[0].clone();
    assert_eq!(
        seen.headers.get("authorization").unwrap(),
        &format!("Bearer {KEY}")
    );
    assert_eq!(
        serde_json::from_str::<Value>(&seen.body).unwrap(),
        json!({"model": "text-embedding-3-small", "input": "Hello there"})
    );
}

/// A one-shot raw HTTP/1.1 server: returns the request head it got.
async fn raw_server(response: &'static str) -> (String, tokio::task::JoinHandle<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = sock.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        sock.write_all(response.as_bytes()).await.unwrap();
        sock.flush().await.unwrap();
        String::from_utf8_lossy(&buf).into_owned()
    });
    (format!("http://{addr}/openai/v1/"), task)
}

#[tokio::test]
async fn embed_posts_to_the_base_path_embeddings() {
    let (url, head) = raw_server(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 44\r\n\r\n{\"data\":[{\"embedding\":[0.5,0.5],\"index\":0}]}",
    )
    .await;
    let f = fixture(&url, Some(KEY), SEMANTIC_ON);
    let v = embed(&f.route.upstreams[0], "e", "hi", Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(v, vec![0.5, 0.5]);
    let head = head.await.unwrap();
    assert!(
        head.starts_with("POST /openai/v1/embeddings HTTP/1.1\r\n"),
        "{head}"
    );
}

fn assert_no_key(e: &SemanticError) {
    for text in [e.to_string(), format!("{e:?}")] {
        assert!(!text.contains(KEY), "{text}");
        assert!(!text.contains("sk-test"), "{text}");
    }
}

#[tokio::test]
async fn embed_errors_are_clear_and_never_show_the_key() {
    let cases: Vec<(Script, &str, &str)> = vec![
        (
            respond(
                500,
                r#"{"error":{"message":"boom","type":"server_error","code":null}}"#.into(),
            ),
            "status",
            "embeddings provider emb answered 500 (server_error)",
        ),
        (
            // Providers echo part of a wrong key in the message: only the code is kept.
            respond(
                401,
                format!(
                    r#"{{"error":{{"message":"Incorrect API key provided: {KEY}","type":"invalid_request_error","code":"invalid_api_key"}}}}"#
                ),
            ),
            "status",
            "embeddings provider emb answered 401 (invalid_api_key)",
        ),
        (
            respond(502, "<html>bad gateway</html>".into()),
            "status",
            "embeddings provider emb answered 502",
        ),
        (
            respond(200, "{not json".into()),
            "bad_response",
            "embeddings provider emb sent a bad response: not an OpenAI embeddings response",
        ),
        (
            respond(200, r#"{"data":[]}"#.into()),
            "bad_response",
            "embeddings provider emb sent a bad response: `data` is empty",
        ),
        (
            respond(
                200,
                r#"{"data":[{"embedding":"AAAAAA==","index":0}]}"#.into(),
            ),
            "bad_response",
            "embeddings provider emb sent a bad response: not an OpenAI embeddings response",
        ),
        (
            respond(200, r#"{"data":[{"embedding":[],"index":0}]}"#.into()),
            "bad_response",
            "embeddings provider emb sent a bad response: the embedding has 0 dimensions",
        ),
    ];
    for (script, kind, message) in cases {
        let s = script.clone();
        let provider = upstream(move |_, _| s.clone()).await;
        let f = fixture(&provider.base_url(), Some(KEY), SEMANTIC_ON);
        let e = embed(&f.route.upstreams[0], "e", "hi", Duration::from_secs(2))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), kind, "{e}");
        assert!(e.to_string().starts_with(message), "{e}");
        assert_no_key(&e);
    }
}

#[tokio::test]
async fn a_stalled_provider_times_out_at_the_configured_timeout() {
    let provider = upstream(|_, _| Script::Stall).await;
    let f = fixture(
        &provider.base_url(),
        Some(KEY),
        "{enabled: true, embeddingsProvider: emb, embeddingsModel: e, timeout: 200ms}",
    );
    let cache = SemanticCaches::default()
        .for_route("shop/chat", &f.route.spec)
        .unwrap();
    let timeout = cache.settings().timeout;
    assert_eq!(timeout, Duration::from_millis(200));
    let start = Instant::now();
    let e = embed(
        f.route.provider(&cache.settings().provider).unwrap(),
        "e",
        "hi",
        timeout,
    )
    .await
    .unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, SemanticError::Timeout { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "embeddings call to emb timed out after 200ms"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_millis(1500),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_missing_key_or_a_refused_connection_fails_without_waiting() {
    let provider = upstream(|_, body| embeddings_answer(body)).await;
    let f = fixture(&provider.base_url(), None, SEMANTIC_ON);
    let e = embed(&f.route.upstreams[0], "e", "hi", Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), "unusable", "{e}");
    assert!(e.to_string().contains("cannot read key file"), "{e}");
    assert_eq!(provider.count(), 0, "nothing is sent without the key");

    // A port nobody listens on.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", closed.local_addr().unwrap());
    drop(closed);
    let f = fixture(&url, Some(KEY), SEMANTIC_ON);
    let e = embed(&f.route.upstreams[0], "e", "hi", Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), "transport", "{e}");
    assert_no_key(&e);
}

/// A deterministic pseudo-random unit vector.
fn random_unit(seed: u64, dims: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..dims)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "measurement; run in release"]
async fn lookup_cost() {
    const ENTRIES: usize = 1000;
    const LOOKUPS: u32 = 2000;
    let settings = SemanticSettings {
        threshold: 0.92,
        ttl: Duration::from_secs(3600),
        max_entries: ENTRIES,
        max_bytes: 1 << 30,
        scope: tailwarden_crds::CacheScope::Shared,
        deterministic_only: true,
        tenant_header: None,
        provider: "emb".into(),
        provider_url: "http://127.0.0.1:1/v1".into(),
        model: "e".into(),
        timeout: Duration::from_secs(2),
    };
    let cache = SemanticCache::new("shop/chat", settings);
    let answer = Entry::complete(
        StatusCode::OK,
        None,
        vec![Bytes::from_static(b"{\"answer\":\"x\"}")],
        false,
        Duration::from_secs(3600),
    )
    .unwrap();
    // Every entry in one partition: the worst case, a lookup compares with all of them.
    for i in 0..ENTRIES {
        let body = chat(&format!("What is question {i} about?"));
        let parsed = RequestBody::parse(body.as_bytes()).unwrap();
        let q = cache
            .query(&parsed, "/chat/completions", "gpt-4.1", &HeaderMap::new())
            .unwrap();
        let e = Embedding::new(random_unit(i as u64, DIMS)).unwrap();
        assert!(cache.insert(&q, &e, answer.clone()));
    }
    assert_eq!(cache.usage().0, ENTRIES);
    let body = chat("What is the question about?");
    let parsed = RequestBody::parse(body.as_bytes()).unwrap();
    let query = cache
        .query(&parsed, "/chat/completions", "gpt-4.1", &HeaderMap::new())
        .unwrap();
    let probes: Vec<Embedding> = (0..16)
        .map(|i| Embedding::new(random_unit(1_000_000 + i, DIMS)).unwrap())
        .collect();

    let start = Instant::now();
    for i in 0..LOOKUPS {
        let l = cache.lookup(&query, &probes[i as usize % probes.len()]);
        assert!(matches!(std::hint::black_box(l), Lookup::Miss));
    }
    let per_lookup = start.elapsed() / LOOKUPS;
    println!("lookup, {ENTRIES} entries x {DIMS} dims in one partition: {per_lookup:?}");

    let start = Instant::now();
    for _ in 0..LOOKUPS {
        std::hint::black_box(
            cache
                .query(&parsed, "/chat/completions", "gpt-4.1", &HeaderMap::new())
                .unwrap(),
        );
    }
    println!(
        "query (text, partition key, guard features): {:?}",
        start.elapsed() / LOOKUPS
    );
    println!("memory: {} bytes for {ENTRIES} entries", cache.usage().1);

    // One dot product on vectors already in cache: the compute bound, without the memory
    // traffic of 1000 × 6 KiB embeddings.
    let (a, b) = (&probes[0], &probes[1]);
    let n = 200_000u32;
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(std::hint::black_box(a).similarity(std::hint::black_box(b)));
    }
    println!("one {DIMS}-dim similarity, hot: {:?}", start.elapsed() / n);
}

/// Through the request path: a paraphrase is served from the semantic cache with its
/// similarity; the same question with "not" inserted goes to the provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_proxy_a_paraphrase_hits_and_a_negation_goes_upstream() {
    let chats = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = chats.clone();
    let up = upstream(move |_, body| {
        if body.contains("\"input\"") {
            embeddings_answer(body)
        } else {
            let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            ok(&format!("answer {n}"))
        }
    })
    .await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  cache:\n    semantic: {enabled: true, embeddingsProvider: p, embeddingsModel: e, scope: shared}\n",
    ))
    .await;
    let ask = |q: &str| {
        serde_json::json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": q}]})
            .to_string()
    };
    let first = post(
        &sc,
        "/v1/chat/completions",
        &ask("Is Paris the capital of France?"),
    )
    .await;
    assert_eq!(first.status, 200);
    assert_ne!(first.header("x-tailwarden-cache"), "semantic-hit");
    let again = post(
        &sc,
        "/v1/chat/completions",
        &ask("is paris the capital of france"),
    )
    .await;
    assert_eq!(
        again.header("x-tailwarden-cache"),
        "semantic-hit",
        "{}",
        again.body
    );
    let similarity: f32 = again
        .header("x-tailwarden-cache-similarity")
        .parse()
        .unwrap();
    assert!(similarity >= 0.92, "{similarity}");
    assert_eq!(again.body, first.body, "the stored answer");
    assert_eq!(chats.load(std::sync::atomic::Ordering::SeqCst), 1);

    let negated = post(
        &sc,
        "/v1/chat/completions",
        &ask("Is Paris not the capital of France?"),
    )
    .await;
    assert_eq!(negated.status, 200);
    assert_ne!(negated.header("x-tailwarden-cache"), "semantic-hit");
    assert_eq!(
        chats.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the provider answered it"
    );
    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    for (result, n) in [("hit", 1), ("miss", 1), ("refused", 1)] {
        assert!(
            metrics.contains(&format!(
                "tailwarden_semantic_cache_requests_total{{result=\"{result}\",route=\"t/test\"}} {n}"
            )),
            "{result}: {metrics}"
        );
    }
}
