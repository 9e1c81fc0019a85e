//! Graceful shutdown of the real binary: on SIGTERM readiness goes false, no new connections
//! are accepted, and an in-flight stream finishes before the process exits.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_streams() {
    let up = upstream(|_, _| Script::Stream {
        first_delay: Duration::ZERO,
        chunks: (0..15)
            .map(|i| (Duration::from_millis(100), sse_chunk(&i.to_string())))
            .chain([(Duration::ZERO, DONE.to_string())])
            .collect(),
        end: StreamEnd::Finish,
    })
    .await;
    let dir = TempDir::new();
    let config = dir.0.join("routes.yaml");
    std::fs::write(&config, route(&[("p", &up.base_url(), 100, 0)], "")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tailwarden-sidecar"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ])
        .args(["--drain-timeout", "10s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "listening on ADDR admin ADDR"
    let words: Vec<&str> = line.split_whitespace().collect();
    let (listen, admin) = (words[2].to_owned(), words[4].to_owned());

    let client = client();
    let stream_req = http::Request::post(format!("http://{listen}/v1/chat/completions"))
        .body(http_body_util::Full::new(Bytes::from_static(
            br#"{"model":"m","stream":true,"messages":[]}"#,
        )))
        .unwrap();
    let resp = client.request(stream_req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let reader =
        tokio::spawn(async move { resp.into_body().collect().await.map(|b| b.to_bytes()) });

    tokio::time::sleep(Duration::from_millis(300)).await;
    let term_at = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());

    // Readiness goes false while the stream drains.
    let mut not_ready = false;
    while term_at.elapsed() < Duration::from_millis(800) {
        let req = http::Request::get(format!("http://{admin}/readyz"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        if let Ok(r) = client.request(req).await
            && r.status() == 503
        {
            not_ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(not_ready, "readyz must report draining");
    // New connections are refused.
    assert!(
        tokio::net::TcpStream::connect(&listen).await.is_err(),
        "listener closed"
    );

    // The in-flight stream completes in full.
    let body = reader.await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&body);
    assert!(text.ends_with(DONE), "stream finished: {text}");
    assert_eq!(text.matches("chat.completion.chunk").count(), 15);

    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "clean exit: {status:?}");
    assert!(term_at.elapsed() < Duration::from_secs(5));
}
