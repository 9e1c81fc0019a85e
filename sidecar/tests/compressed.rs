//! Compressed request bodies over real loopback HTTP: each `Content-Encoding` the sidecar
//! decodes is routed and answered with the upstream seeing plain JSON, a decompression bomb
//! is a 413 before anything is sent, an unknown coding is a 415 naming it, a corrupt stream
//! a 400 saying so, and a pass-through call is routed by its decoded `model` but forwarded
//! byte for byte with its header.
#![allow(clippy::unwrap_used)]

mod common;

use std::{io::Write, time::Instant};

use bytes::Bytes;
use common::*;

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn encode(coding: &str, data: &[u8]) -> Vec<u8> {
    match coding {
        "gzip" => gzip(data),
        "deflate" => {
            let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(data).unwrap();
            e.finish().unwrap()
        }
        "br" => {
            let mut out = Vec::new();
            let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
            w.write_all(data).unwrap();
            drop(w);
            out
        }
        "zstd" => zstd::stream::encode_all(data, 3).unwrap(),
        other => panic!("no encoder for {other}"),
    }
}

async fn post_encoded(sc: &Sidecar, path: &str, encoding: &str, body: Vec<u8>) -> Reply {
    post_with(
        sc,
        path,
        &[("content-encoding", encoding)],
        Bytes::from(body),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_coding_is_decoded_routed_and_forwarded_as_plain_json() {
    let up = upstream(|_, _| ok("decoded")).await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    for (i, coding) in ["gzip", "deflate", "br", "zstd"].into_iter().enumerate() {
        let r = post_encoded(
            &sc,
            "/v1/chat/completions",
            coding,
            encode(coding, CHAT.as_bytes()),
        )
        .await;
        assert_eq!(r.status, 200, "{coding}: {}", r.body);
        assert_eq!(r.json()["choices"][0]["message"]["content"], "decoded");
        let seen = up.seen.lock().unwrap()[i].clone();
        let sent: serde_json::Value = serde_json::from_str(&seen.body)
            .unwrap_or_else(|e| panic!("{coding}: upstream got no JSON ({e}): {}", seen.body));
        assert_eq!(sent["model"], "m", "{coding}");
        assert_eq!(sent["messages"][0]["content"], "hi", "{coding}");
        assert!(
            seen.headers.get("content-encoding").is_none(),
            "{coding}: the decoded body went on with the client's Content-Encoding"
        );
    }
    assert_eq!(up.count(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gzip_stream_request_is_routed_by_its_decoded_model() {
    let up = upstream(|_, _| Script::Stream {
        first_delay: std::time::Duration::ZERO,
        chunks: vec![(std::time::Duration::ZERO, sse_chunk("zipped"))],
        end: StreamEnd::Finish,
    })
    .await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = post_encoded(&sc, "/v1/chat/completions", "gzip", gzip(body.as_bytes())).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("zipped"), "{}", r.body);
    let seen = up.seen.lock().unwrap()[0].clone();
    let sent: serde_json::Value = serde_json::from_str(&seen.body).unwrap();
    assert_eq!(sent["stream"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decompression_bomb_is_413_and_never_sent() {
    let up = upstream(|_, _| ok("never")).await;
    let sc = sidecar(&route(
        &[("p", &up.base_url(), 100, 0)],
        "  limits: {maxBodyBytes: 1Mi}\n",
    ))
    .await;
    // 10 MB of zeros: about 10 KB gzipped, well under the limit as sent.
    let bomb = gzip(&vec![0u8; 10_000_000]);
    assert!(bomb.len() < 1 << 20, "{}", bomb.len());
    let started = Instant::now();
    let r = post_encoded(&sc, "/v1/chat/completions", "gzip", bomb.clone()).await;
    eprintln!(
        "bomb: {} bytes gzipped, answered {} in {:?}",
        bomb.len(),
        r.status,
        started.elapsed()
    );
    assert_eq!(r.status, 413, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(e["error"]["code"], "request_too_large");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("decoded from gzip"), "{message}");
    assert!(message.contains("1048576"), "{message}");
    assert_eq!(up.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_coding_is_415_naming_it() {
    let up = upstream(|_, _| ok("never")).await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    for (coding, named) in [("compress", "`compress`"), ("gzip, br", "`gzip, br`")] {
        let r = post_encoded(
            &sc,
            "/v1/embeddings",
            coding,
            b"\x1f\x9d\x90garbage".to_vec(),
        )
        .await;
        assert_eq!(r.status, 415, "{coding}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["code"], "unsupported_content_encoding");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{message}");
        assert!(!message.contains("UTF-8"), "{message}");
    }
    assert_eq!(up.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_gzip_body_is_400_saying_so() {
    let up = upstream(|_, _| ok("never")).await;
    let sc = sidecar(&route(&[("p", &up.base_url(), 100, 0)], "")).await;
    let mut broken = gzip(CHAT.as_bytes());
    let half = broken.len() / 2;
    broken.truncate(half);
    let r = post_encoded(&sc, "/v1/responses", "gzip", broken).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["code"], "invalid_content_encoding");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("not valid gzip data"), "{message}");
    assert!(!message.contains("UTF-8"), "{message}");
    assert_eq!(up.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_body_is_routed_by_its_decoded_model_and_forwarded_untouched() {
    let home = upstream(|_, _| ok("home")).await;
    let safety = upstream(|_, _| ok("safety")).await;
    let sc = sidecar(&format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: home, namespace: t}}\nspec:\n  models: ['*']\n  providers:\n  - {{name: other, baseUrl: '{}'}}\n---\napiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: safety, namespace: t}}\nspec:\n  models: [moderation]\n  providers:\n  - {{name: a, baseUrl: '{}'}}\n",
        home.base_url(),
        safety.base_url()
    ))
    .await;
    let body = gzip(br#"{"model":"moderation","input":"hello"}"#);
    let r = post_encoded(&sc, "/v1/moderations", "gzip", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(home.count(), 0, "routed by the decoded model, not to home");
    assert_eq!(safety.count(), 1);
    let seen = safety.seen.lock().unwrap()[0].clone();
    assert_eq!(seen.headers.get("content-encoding").unwrap(), "gzip");
    assert_eq!(
        seen.body,
        String::from_utf8_lossy(&body),
        "the client's compressed bytes, byte for byte"
    );
}
