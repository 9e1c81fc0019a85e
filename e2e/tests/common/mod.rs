//! Helpers shared by the integration tests: an in-process simulator and a plain hyper client.

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tailwarden_e2e::sim::{Profile, SimHandle, SimServer, StatsSnapshot};

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

/// Starts a simulator on a free loopback port.
pub async fn start_sim(profile: &Profile, seed: u64) -> SimHandle {
    SimServer::bind("127.0.0.1:0".parse().expect("addr"), profile, seed)
        .await
        .expect("sim binds")
        .spawn()
}

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// POSTs JSON with extra headers; returns the response without reading the body.
pub async fn post(
    client: &TestClient,
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
    let mut req = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    client.request(req).await
}

/// POSTs and reads the whole body.
pub async fn post_text(
    client: &TestClient,
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, String) {
    let resp = post(client, url, body, headers).await.expect("response");
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, h, String::from_utf8(bytes.to_vec()).expect("utf8"))
}

/// Polls the simulator's counters until `cond` holds or 3 s pass; returns the last snapshot.
pub async fn wait_stats(sim: &SimHandle, cond: impl Fn(&StatsSnapshot) -> bool) -> StatsSnapshot {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let s = sim.stats();
        if cond(&s) || tokio::time::Instant::now() >= deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The JSON payloads of an SSE body (without `[DONE]`), and whether `[DONE]` was seen.
pub fn sse_payloads(body: &str) -> (Vec<serde_json::Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        let data = frame.trim().strip_prefix("data: ").expect("data frame");
        if data == "[DONE]" {
            done = true;
        } else {
            out.push(serde_json::from_str(data).expect("chunk json"));
        }
    }
    (out, done)
}
