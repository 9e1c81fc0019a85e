//! The rest of `/v1` passed through over real loopback HTTP: files, batches, uploads and
//! anything without a `model` go to the home provider with its key (never the client's),
//! the path and query as sent, the body streamed as it arrives (a large upload reaches the
//! provider before the client has finished sending it); the stateless families go by their
//! JSON body's `model`; `GET /v1/models/{id}` is answered for the routes' models; paths that
//! could leave the provider's base URL are refused.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use common::*;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::{body::Frame, body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;

fn json_reply(body: Value) -> Script {
    Script::Respond {
        delay: Duration::ZERO,
        status: 200,
        headers: vec![],
        body: body.to_string(),
    }
}

fn keyed_route(providers: &[(&str, &str)], models: &str, key_file: &std::path::Path) -> String {
    let mut out = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: main, namespace: t}}\nspec:\n  models: {models}\n  providers:\n"
    );
    for (name, url) in providers {
        out.push_str(&format!(
            "  - {{name: {name}, baseUrl: '{url}', auth: {{file: '{}'}}}}\n",
            key_file.display()
        ));
    }
    out
}

async fn request(
    sc: &Sidecar,
    method: &str,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
) -> Reply {
    let req = Request::builder()
        .method(method)
        .uri(sc.url(path))
        .header("content-type", content_type)
        .header("authorization", "Bearer client-key-never-forwarded")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = client().request(req).await.expect("sidecar answers");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Files and batches (no `model`) go to the home provider — the first provider of the `*`
/// route — with the provider's key, the client's content type (multipart boundary and all)
/// and the body byte for byte; the client's own key never leaves the sidecar.
#[tokio::test]
async fn files_and_batches_go_to_the_home_provider_with_its_key() {
    let dir = TempDir::new();
    let key = dir.0.join("key");
    std::fs::write(&key, "sk-provider-key\n").unwrap();
    let a = upstream(|_, _| json_reply(json!({"id": "file-1", "object": "file"}))).await;
    let b = upstream(|_, _| json_reply(json!({"id": "never"}))).await;
    let sc = sidecar(&keyed_route(
        &[("a", &a.base_url()), ("b", &b.base_url())],
        "['*']",
        &key,
    ))
    .await;
    let boundary = "----tailwarden-test";
    let multipart = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{{\"custom_id\":\"1\"}}\n\r\n--{boundary}--\r\n"
    );
    let content_type = format!("multipart/form-data; boundary={boundary}");
    let r = request(
        &sc,
        "POST",
        "/v1/files",
        &content_type,
        multipart.clone().into_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], "file-1");
    assert_eq!(r.header("x-tailwarden-provider"), "a");
    let batch = json!({"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"});
    let r = request(
        &sc,
        "POST",
        "/v1/batches",
        "application/json",
        batch.to_string().into_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(
        &sc,
        "GET",
        "/v1/files?purpose=batch&limit=2",
        "application/json",
        vec![],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request(
        &sc,
        "DELETE",
        "/v1/files/file-1",
        "application/json",
        vec![],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);

    assert_eq!(
        b.count(),
        0,
        "one home provider for all of an account's objects"
    );
    let seen = a.seen.lock().unwrap().clone();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "POST /v1/files",
            "POST /v1/batches",
            "GET /v1/files",
            "DELETE /v1/files/file-1"
        ]
    );
    assert_eq!(
        seen[0].body, multipart,
        "the multipart body arrives byte for byte"
    );
    assert_eq!(seen[0].headers["content-type"], content_type.as_str());
    assert_eq!(seen[1].body, batch.to_string());
    for s in &seen {
        assert_eq!(
            s.headers["authorization"], "Bearer sk-provider-key",
            "{}",
            s.path
        );
    }
}

/// The query string reaches the provider as sent.
#[tokio::test]
async fn the_query_string_is_passed_on() {
    let queries = Arc::new(Mutex::new(Vec::new()));
    let q = queries.clone();
    let addr = serve(move |req| {
        q.lock().unwrap().push(req.uri().to_string());
        async { Response::new(Full::new(Bytes::from_static(b"{\"data\":[]}"))) }
    })
    .await;
    let sc = sidecar(&route(&[("a", &format!("http://{addr}/v1"), 1, 0)], "")).await;
    let r = request(
        &sc,
        "GET",
        "/v1/files?purpose=batch&after=file-9",
        "application/json",
        vec![],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        queries.lock().unwrap().as_slice(),
        ["/v1/files?purpose=batch&after=file-9"]
    );
}

/// A hyper server answering each request with `answer`.
async fn serve<F, Fut>(answer: F) -> std::net::SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = Response<Full<Bytes>>> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let answer = answer.clone();
                    async move { Ok::<_, std::convert::Infallible>(answer(req).await) }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// A 24 MiB upload (over the route's 16 MiB `maxBodyBytes`, which bounds only bodies the
/// sidecar reads) is streamed: the provider has its first bytes while the client still
/// holds back the rest, which it sends only once the provider has seen them. A sidecar that
/// buffered the body would wait forever here.
#[tokio::test]
async fn an_upload_streams_through_without_being_buffered() {
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 24;
    let received = Arc::new(AtomicU64::new(0));
    let first = Arc::new(tokio::sync::Notify::new());
    let (r, f) = (received.clone(), first.clone());
    let addr = serve(move |req: Request<Incoming>| {
        let (r, f) = (r.clone(), f.clone());
        async move {
            let mut body = req.into_body();
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    r.fetch_add(data.len() as u64, Ordering::SeqCst);
                    f.notify_one();
                }
            }
            let n = r.load(Ordering::SeqCst);
            Response::new(Full::new(Bytes::from(json!({"bytes": n}).to_string())))
        }
    })
    .await;
    let sc = sidecar(&route(&[("a", &format!("http://{addr}/v1"), 1, 0)], "")).await;

    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
    let waiter = first.clone();
    let sender = tokio::spawn(async move {
        tx.send(Ok(Frame::data(Bytes::from(vec![b'x'; CHUNK]))))
            .await
            .unwrap();
        // The rest only once the provider has bytes in hand.
        waiter.notified().await;
        for _ in 1..CHUNKS {
            tx.send(Ok(Frame::data(Bytes::from(vec![b'x'; CHUNK]))))
                .await
                .unwrap();
        }
    });
    let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let req = Request::post(sc.url("/v1/uploads/upload_1/parts"))
        .header("content-type", "application/octet-stream")
        .header("content-length", (CHUNK * CHUNKS).to_string())
        .body(body)
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("the upload was streamed, not buffered")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let reply: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(reply["bytes"], (CHUNK * CHUNKS) as u64);
    sender.await.unwrap();
}

/// A body declared larger than the pass-through limit is a 413 before anything is sent.
#[tokio::test]
async fn an_upload_over_the_limit_is_refused_up_front() {
    let a = upstream(|_, _| json_reply(json!({}))).await;
    let sc = sidecar(&route(&[("a", &a.base_url(), 1, 0)], "")).await;
    let mut stream = tokio::net::TcpStream::connect(sc.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(
            format!(
                "POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\n\r\nabc",
                1u64 << 40
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("request_too_large"), "{text}");
    assert_eq!(a.count(), 0);
}

/// Moderations, images and audio with a JSON body go by their `model`: the route that
/// serves it, its model map applied.
#[tokio::test]
async fn stateless_families_go_by_model() {
    let a = upstream(|_, _| json_reply(json!({"id": "modr-1", "results": []}))).await;
    let other = upstream(|_, _| json_reply(json!({}))).await;
    let config = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: home, namespace: t}}\nspec:\n  models: ['*']\n  providers:\n  - {{name: other, baseUrl: '{}'}}\n---\napiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: safety, namespace: t}}\nspec:\n  models: [moderation]\n  providers:\n  - {{name: a, baseUrl: '{}', modelMap: {{moderation: omni-moderation-latest}}}}\n",
        other.base_url(),
        a.base_url()
    );
    let sc = sidecar(&config).await;
    let r = request(
        &sc,
        "POST",
        "/v1/moderations",
        "application/json",
        json!({"model": "moderation", "input": "hello"})
            .to_string()
            .into_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-tailwarden-provider"), "a");
    let seen = a.seen.lock().unwrap().clone();
    assert_eq!(seen[0].path, "POST /v1/moderations");
    let sent: Value = serde_json::from_str(&seen[0].body).unwrap();
    assert_eq!(sent["model"], "omni-moderation-latest");
    assert_eq!(sent["input"], "hello");
    assert_eq!(other.count(), 0);
}

/// `GET /v1/models/{id}` answers for a model a route lists (and 404s for others); the
/// list names every model.
#[tokio::test]
async fn models_by_id() {
    let a = upstream(|_, _| json_reply(json!({}))).await;
    let config = format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: r, namespace: t}}\nspec:\n  models: [gpt-4.1, 'ft:gpt-4o:acme:1']\n  providers:\n  - {{name: a, baseUrl: '{}'}}\n",
        a.base_url()
    );
    let sc = sidecar(&config).await;
    let r = request(&sc, "GET", "/v1/models/gpt-4.1", "application/json", vec![]).await;
    assert_eq!((r.status, r.json()["id"].clone()), (200, json!("gpt-4.1")));
    assert_eq!(r.json()["object"], "model");
    let r = request(
        &sc,
        "GET",
        "/v1/models/ft%3Agpt-4o%3Aacme%3A1",
        "application/json",
        vec![],
    )
    .await;
    assert_eq!(
        (r.status, r.json()["id"].clone()),
        (200, json!("ft:gpt-4o:acme:1"))
    );
    let r = request(&sc, "GET", "/v1/models/nope", "application/json", vec![]).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let r = request(&sc, "GET", "/v1/models", "application/json", vec![]).await;
    let ids: Vec<Value> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(ids, [json!("ft:gpt-4o:acme:1"), json!("gpt-4.1")]);
    assert_eq!(a.count(), 0, "answered by the sidecar");
}

/// The client chooses only the path below `/v1`: dot segments, encoded slashes and dots
/// are a 400 and never reach a provider; a path outside `/v1` is a 404.
#[tokio::test]
async fn paths_cannot_leave_the_providers_base_url() {
    let a = upstream(|_, _| json_reply(json!({}))).await;
    let sc = sidecar(&route(&[("a", &a.base_url(), 1, 0)], "")).await;
    for path in [
        "/v1/files/../../admin",
        "/v1/files/%2e%2e/%2e%2e/admin",
        "/v1/files%2F..%2Fadmin",
        "/v1//files",
    ] {
        let r = request(&sc, "GET", path, "application/json", vec![]).await;
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        assert_eq!(r.json()["error"]["type"], "invalid_request_error", "{path}");
    }
    let r = request(&sc, "GET", "/admin", "application/json", vec![]).await;
    assert_eq!(r.status, 404);
    assert_eq!(a.count(), 0);
}

/// A `GET` may be resent after the provider answers 503; a `POST` with a body is not
/// (the provider may have acted on it).
#[tokio::test]
async fn only_safe_requests_are_resent() {
    let a = upstream(|n, _| {
        if n == 0 {
            status(503)
        } else {
            json_reply(json!({"ok": true}))
        }
    })
    .await;
    let sc = sidecar(&route(
        &[("a", &a.base_url(), 1, 0)],
        "  retries: {maxAttempts: 3, backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let r = request(
        &sc,
        "GET",
        "/v1/batches/batch_1",
        "application/json",
        vec![],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(a.count(), 2);
    let b = upstream(|n, _| {
        if n == 0 {
            status(503)
        } else {
            json_reply(json!({"ok": true}))
        }
    })
    .await;
    let sc = sidecar(&route(
        &[("b", &b.base_url(), 1, 0)],
        "  retries: {maxAttempts: 3, backoff: {base: 1ms, max: 2ms}}\n",
    ))
    .await;
    let r = request(
        &sc,
        "POST",
        "/v1/batches",
        "application/json",
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(r.status, 503);
    assert_eq!(b.count(), 1);
}
