//! Bad client input gets the right status and an OpenAI-shaped JSON error, and the sidecar
//! stays healthy afterwards.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn setup() -> (Upstream, Sidecar) {
    let up = upstream(|_, _| ok("fine")).await;
    let sc = sidecar_with(
        &route(
            &[("p", &up.base_url(), 100, 0)],
            "  limits: {maxBodyBytes: 1Mi}\n",
        ),
        |app| app.body_timeout = Duration::from_millis(500),
    )
    .await;
    (up, sc)
}

fn assert_openai_error(r: &Reply, status: u16, message_start: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    assert_eq!(r.header("content-type"), "application/json");
    let e = &r.json()["error"];
    assert!(e.is_object(), "OpenAI error shape: {}", r.body);
    assert!(e["type"].is_string(), "{}", r.body);
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(
        msg.starts_with(message_start),
        "message {msg:?} should start with {message_start:?}"
    );
}

async fn still_healthy(sc: &Sidecar, up: &Upstream) {
    let before = up.count();
    let r = chat(sc, false).await;
    assert_eq!(r.status, 200, "sidecar still serves: {}", r.body);
    assert_eq!(up.count(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_400s() {
    let (up, sc) = setup().await;
    let cases: [(&[u8], &str); 7] = [
        (b"{\"model\": \"m\", ", "The request body is not valid JSON"),
        (b"not json at all", "The request body is not valid JSON"),
        (b"{\"messages\": []}", "You must provide a model parameter."),
        (b"{\"model\": 42}", "`model` must be a non-empty string."),
        (
            b"{\"model\": \"m\", \"stream\": \"yes\"}",
            "`stream` must be a boolean.",
        ),
        (
            b"{\"model\": \"m\xff\xfe\"}",
            "The request body is not valid UTF-8",
        ),
        (b"[]", "The request body is not valid JSON"),
    ];
    for (body, msg) in cases {
        let req = http::Request::post(sc.url("/v1/chat/completions"))
            .body(http_body_util::Full::new(Bytes::copy_from_slice(body)))
            .unwrap();
        let resp = client().request(req).await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let reply = Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        };
        assert_openai_error(&reply, 400, msg);
    }
    assert_eq!(up.count(), 0, "nothing malformed went upstream");
    still_healthy(&sc, &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_and_methods() {
    let (up, sc) = setup().await;
    // Below /v1 everything is passed through (tests/passthrough.rs); outside it, a 404.
    let r = post(&sc, "/v2/images/generations", "{}").await;
    assert_openai_error(&r, 404, "Unknown path /v2/images/generations");
    let req = http::Request::get(sc.url("/v1/chat/completions"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 405);
    let r = post(
        &sc,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[]}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    // GET /v1/models lists nothing for a default-only route but answers in OpenAI's shape.
    let req = http::Request::get(sc.url("/v1/models"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "list");
    still_healthy(&sc, &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_are_413_with_or_without_content_length() {
    let (up, sc) = setup().await;
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(20 << 20)
    );
    // With Content-Length: refused before reading. The sidecar answers and closes without
    // draining the body, so write and read concurrently (a client that only reads after
    // writing everything would see a broken pipe instead).
    let text = send_raw(
        sc.addr,
        format!("content-length: {}\r\n", big.len()),
        big.clone(),
        false,
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(
        text.contains("The request body is larger than the route's limit of 1048576 bytes"),
        "{text}"
    );

    // Chunked, no Content-Length: cut off at the limit while reading.
    let text = send_raw(sc.addr, "transfer-encoding: chunked\r\n".into(), big, true).await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("maxBodyBytes"), "{text}");
    assert_eq!(up.count(), 0);
    still_healthy(&sc, &up).await;
}

/// Posts `body` over a raw connection, writing and reading at once; returns the response.
async fn send_raw(
    addr: std::net::SocketAddr,
    framing: String,
    body: String,
    chunked: bool,
) -> String {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        let head = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{framing}\r\n");
        if wr.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        for chunk in body.as_bytes().chunks(64 << 10) {
            let ok = if chunked {
                wr.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                    .await
                    .is_ok()
                    && wr.write_all(chunk).await.is_ok()
                    && wr.write_all(b"\r\n").await.is_ok()
            } else {
                wr.write_all(chunk).await.is_ok()
            };
            if !ok {
                return;
            }
        }
        if chunked {
            let _ = wr.write_all(b"0\r\n\r\n").await;
        }
    });
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut response)).await;
    writer.abort();
    String::from_utf8_lossy(&response).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_body_gets_408() {
    let (up, sc) = setup().await;
    let mut stream = tokio::net::TcpStream::connect(sc.addr).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":")
        .await
        .unwrap();
    let t = Instant::now();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut response)).await;
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"error\""), "{text}");
    assert!(t.elapsed() < Duration::from_secs(3));
    still_healthy(&sc, &up).await;
}
