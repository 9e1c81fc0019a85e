//! The real binary: graceful shutdown (on SIGTERM readiness goes false, no new connections
//! are accepted, an in-flight stream finishes before the process exits) and the operator's
//! way of running it (a directory of route files, a probe port on the pod IP).
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

/// Kills the child when dropped, so a failing assertion leaves no sidecar running.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_sidecar(args: &[&str]) -> (KillOnDrop, String, String, Option<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tailwarden-sidecar"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    (
        KillOnDrop(child),
        words[2].to_owned(),
        words[4].to_owned(),
        words.get(6).map(|s| (*s).to_owned()),
    )
}

async fn get(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<Bytes>,
    >,
    url: String,
) -> (u16, String) {
    let req = http::Request::get(url)
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    match client.request(req).await {
        Ok(r) => {
            let status = r.status().as_u16();
            let body = r
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
        Err(e) => (0, e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_unready_on_an_empty_route_directory_and_picks_routes_up() {
    let up = upstream(|_, _| ok("from dir")).await;
    let dir = TempDir::new();
    let routes = dir.0.join("routes");
    std::fs::create_dir_all(&routes).unwrap();
    let probe = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (_child, listen, admin, _) = spawn_sidecar(&[
        "--config",
        routes.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--probe-listen",
        &probe,
        "--reload-interval",
        "100ms",
    ]);
    let client = client();
    let (status, body) = get(&client, format!("http://{probe}/readyz")).await;
    assert_eq!((status, body.as_str()), (503, "no routes loaded\n"));
    // The probe port never shows the config; the loopback admin port does.
    assert_eq!(get(&client, format!("http://{probe}/config")).await.0, 404);
    assert_eq!(get(&client, format!("http://{admin}/config")).await.0, 200);
    assert_eq!(get(&client, format!("http://{probe}/metrics")).await.0, 200);

    // The operator's projected volume adds one file per route.
    std::fs::write(
        routes.join("chat.yaml"),
        route(&[("p", &up.base_url(), 100, 0)], ""),
    )
    .unwrap();
    let mut ready = false;
    for _ in 0..250 {
        if get(&client, format!("http://{probe}/readyz")).await.0 == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ready, "ready once a route arrived");
    let req = http::Request::post(format!("http://{listen}/v1/chat/completions"))
        .body(http_body_util::Full::new(Bytes::from_static(
            br#"{"model":"m","messages":[]}"#,
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_config_file_stops_the_binary_with_one_clear_message() {
    let dir = TempDir::new();
    let config = dir.0.join("bad.yaml");
    std::fs::write(&config, "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {name: x}\nspec:\n  models: [m]\n  providers: []\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tailwarden-sidecar"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim_end(),
        format!(
            "tailwarden-sidecar: invalid config: {}: document 1 (route default/x): spec.providers: at least one provider is required",
            config.display()
        )
    );
}

/// The access log is written off the request path, in batches; on SIGTERM the sidecar
/// writes what is still queued before it exits, so the line of a request answered just
/// before the signal is on stderr. The drop counter is exposed (and zero under this load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_lines_written_just_before_sigterm_are_on_stderr() {
    let up = upstream(|_, _| ok("logged")).await;
    let dir = TempDir::new();
    let config = dir.0.join("routes.yaml");
    std::fs::write(&config, route(&[("p", &up.base_url(), 100, 0)], "")).unwrap();
    let log_path = dir.0.join("stderr.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tailwarden-sidecar"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .env("TAILWARDEN_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let (listen, admin) = (words[2].to_owned(), words[4].to_owned());
    let child = KillOnDrop(child);

    let client = client();
    let (status, metrics) = get(&client, format!("http://{admin}/metrics")).await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("\ntailwarden_access_log_dropped_total 0\n"),
        "the drop counter is exposed: {metrics}"
    );
    let ids: Vec<String> = (0..50).map(|i| format!("before-term-{i}")).collect();
    for id in &ids {
        let req = http::Request::post(format!("http://{listen}/v1/chat/completions"))
            .header("x-request-id", id.as_str())
            .body(http_body_util::Full::new(Bytes::from_static(
                br#"{"model":"m","messages":[]}"#,
            )))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.into_body().collect().await.unwrap();
    }
    // At once: well inside the writer's batching interval, so only the exit flush can
    // have written the last lines.
    let killed = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut child = child;
    let status = tokio::task::spawn_blocking(move || child.0.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "clean exit: {status:?}");

    let text = std::fs::read_to_string(&log_path).unwrap();
    let logged: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "tailwarden::access")
        .collect();
    for id in &ids {
        let lines: Vec<_> = logged.iter().filter(|v| v["request_id"] == *id).collect();
        assert_eq!(lines.len(), 1, "one access line for {id} in: {text}");
        assert_eq!(lines[0]["status"], 200);
        assert_eq!(lines[0]["message"], "request");
    }
    // The exit flush comes before the last log line, not after it.
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["message"], "stopped", "last line: {last}");
}
