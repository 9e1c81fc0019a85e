//! Issue #17's brownout: the real `tailwarden-sidecar` binary in front of a large model's
//! provider and a small model's provider (in-process simulators over loopback HTTP), under
//! `make demo`-style open-loop streaming load. Four seconds in, the large model's provider
//! browns out — every first token twelve times slower — for six seconds.
//!
//! What must hold: the route degrades to the small model within its `sloBurn.window`; the
//! P99 of the served requests stays within `slo.latencyP99` all along (no request fails);
//! nothing is degraded before the brownout; the route recovers to Healthy after it, within
//! `holdFor` + `recoverAfter` and a margin; most requests during the brownout are served
//! degraded. One request in ten sends `x-tailwarden-no-degrade: true`: none of them is
//! ever degraded (they are left out of the numbers above). The sidecar's own state is sampled from `/metrics` ten times a second, and the
//! timeline (per second: requests, degraded share, P99, the states) is printed with a
//! `DEGRADE | …` summary (run with `--nocapture`). About 20 s.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tailwarden_e2e::{
    fetch,
    sidecar::Sidecar,
    sim::{Profile, SimHandle, SimServer},
};
use tokio::time::Instant;

/// The simulator binary of this build; the sidecar sits next to it.
const SIM_BIN: &str = env!("CARGO_BIN_EXE_tailwarden-sim");

const RATE: f64 = 40.0;
const RUN: Duration = Duration::from_secs(18);
const BROWNOUT_START: Duration = Duration::from_secs(4);
const BROWNOUT_LEN: Duration = Duration::from_secs(6);
const WINDOW: Duration = Duration::from_secs(2);
const HOLD: Duration = Duration::from_secs(2);
const RECOVER: Duration = Duration::from_secs(2);
const SLO_LATENCY: Duration = Duration::from_millis(1500);

fn sidecar_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TAILWARDEN_SIDECAR_BIN") {
        return PathBuf::from(p);
    }
    let dir = std::path::Path::new(SIM_BIN).parent().unwrap();
    dir.join("tailwarden-sidecar")
}

fn profile(ttft: &str, brownout: bool) -> Profile {
    let mut yaml = format!(
        "ttft: {ttft}\nitl: {{constant: {{ms: 5}}}}\noutputTokens: {{uniform: {{min: 8, max: 16}}}}\n"
    );
    if brownout {
        yaml.push_str(&format!(
            "brownouts: [{{startS: {}, durationS: {}, latencyMultiplier: 12}}]\n",
            BROWNOUT_START.as_secs_f64(),
            BROWNOUT_LEN.as_secs_f64()
        ));
    }
    Profile::from_yaml(&yaml, "degrade test").unwrap()
}

async fn sim(profile: &Profile, seed: u64) -> SimHandle {
    SimServer::bind("127.0.0.1:0".parse().unwrap(), profile, seed)
        .await
        .unwrap()
        .spawn()
}

/// One request as the client saw it.
#[derive(Debug, Clone)]
struct Shot {
    /// Scheduled start, from the epoch.
    at: Duration,
    /// From the scheduled start to the last byte.
    latency: Duration,
    status: u16,
    /// `x-tailwarden-degraded`.
    degraded: String,
    /// `x-tailwarden-provider`.
    provider: String,
    done: bool,
    /// Sent `x-tailwarden-no-degrade: true` (one request in ten).
    opted_out: bool,
}

async fn stream_chat(
    client: &Client<HttpConnector, Full<Bytes>>,
    base: &str,
    i: u64,
    opt_out: bool,
) -> (u16, String, String, bool) {
    let body = serde_json::json!({
        "model": "chat", "stream": true,
        "messages": [{"role": "user", "content": format!("Say hello to visitor {i} in one sentence.")}],
    });
    let mut req = Request::post(format!("{base}/chat/completions"))
        .header("content-type", "application/json");
    if opt_out {
        req = req.header("x-tailwarden-no-degrade", "true");
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(10), client.request(req)).await
    else {
        return (0, String::new(), String::new(), false);
    };
    let status = resp.status().as_u16();
    let header = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (degraded, provider) = (
        header("x-tailwarden-degraded"),
        header("x-tailwarden-provider"),
    );
    let bytes =
        match tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect()).await {
            Ok(Ok(b)) => b.to_bytes(),
            _ => Bytes::new(),
        };
    let done = String::from_utf8_lossy(&bytes).contains("data: [DONE]");
    (status, degraded, provider, done)
}

fn pct(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// The route's state from the sidecar's metrics.
fn route_state(admin: SocketAddr) -> Option<&'static str> {
    let text = fetch::get(admin, "/metrics", Duration::from_secs(1))
        .ok()?
        .text();
    ["healthy", "degraded", "recovering"].into_iter().find(|s| {
        text.lines().any(|l| {
            l.starts_with("tailwarden_route_state{")
                && l.contains(&format!("state=\"{s}\""))
                && l.ends_with(" 1")
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brownout_of_the_large_model_degrades_within_the_window_and_recovers() {
    let dir = std::env::temp_dir().join(format!("tw-degrade-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let large = sim(
        &profile("{lognormal: {medianMs: 120, p99Ms: 300}}", true),
        1,
    )
    .await;
    let small = sim(
        &profile("{lognormal: {medianMs: 60, p99Ms: 150}}", false),
        2,
    )
    .await;
    // The brownout clock is the large simulator's: it started just now.
    let sim_started = Instant::now();
    let route = format!(
        r#"apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {{name: brownout, namespace: shop}}
spec:
  models: [chat, chat-small]
  providers:
  - {{name: large, baseUrl: "{}", modelMap: {{chat: gpt-large}}}}
  - {{name: small, baseUrl: "{}", modelMap: {{chat-small: gpt-small}}}}
  degradation:
    model: chat-small
    providers: [small]
    sloBurn: {{window: {}ms, minRequests: 10, burnRate: 2}}
    holdFor: {}ms
    recoverAfter: {}ms
    probePercent: 20
  slo: {{ttftP99: 500ms, latencyP99: {}ms}}
  timeouts: {{connect: 1s, firstByte: 600ms, idle: 2s, total: 5s}}
  retries: {{maxAttempts: 3, backoff: {{base: 10ms, max: 50ms}}}}
  circuitBreaker: {{enabled: false}}
"#,
        large.base_url(),
        small.base_url(),
        WINDOW.as_millis(),
        HOLD.as_millis(),
        RECOVER.as_millis(),
        SLO_LATENCY.as_millis()
    );
    let config = dir.join("route.yaml");
    std::fs::write(&config, route).unwrap();
    let sidecar = tokio::task::block_in_place(|| {
        Sidecar::start(&sidecar_bin(), &config, &dir.join("sidecar.log"))
    })
    .expect("sidecar starts");
    let admin = sidecar.admin;
    let base = sidecar.base_url();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(connector);

    let epoch = Instant::now();
    // The brownout relative to the load's epoch.
    let brown_from = (sim_started + BROWNOUT_START).saturating_duration_since(epoch);
    let brown_to = brown_from + BROWNOUT_LEN;

    // The sidecar's state, ten times a second.
    let states: Arc<Mutex<Vec<(Duration, &'static str)>>> = Arc::default();
    let sampler = {
        let states = states.clone();
        tokio::task::spawn_blocking(move || {
            while epoch.elapsed() < RUN + Duration::from_secs(1) {
                if let Some(s) = route_state(admin) {
                    states.lock().unwrap().push((epoch.elapsed(), s));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    let total = (RATE * RUN.as_secs_f64()) as u64;
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let at = epoch + Duration::from_secs_f64(i as f64 / RATE);
        tokio::time::sleep_until(at).await;
        let (client, base) = (client.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            let opted_out = i % 10 == 5;
            let (status, degraded, provider, done) =
                stream_chat(&client, &base, i, opted_out).await;
            Shot {
                at: at - epoch,
                latency: at.elapsed(),
                status,
                degraded,
                provider,
                done,
                opted_out,
            }
        }));
    }
    let mut all = Vec::with_capacity(tasks.len());
    for t in tasks {
        all.push(t.await.unwrap());
    }
    // The opted-out requests must never be degraded: they are judged apart (the large
    // model's brownout is theirs to bear).
    let (opted, shots): (Vec<Shot>, Vec<Shot>) = all.into_iter().partition(|s| s.opted_out);
    assert!(
        !opted.is_empty()
            && opted
                .iter()
                .all(|s| s.degraded == "no" && s.provider == "large"),
        "an opted-out request was degraded: {:?}",
        opted
            .iter()
            .find(|s| s.degraded != "no" || s.provider != "large")
    );
    println!(
        "DEGRADE | {} opted-out requests (x-tailwarden-no-degrade), all on the large model: {} served, P99 {:.0} ms",
        opted.len(),
        opted.iter().filter(|s| s.status == 200 && s.done).count(),
        pct(
            opted
                .iter()
                .map(|s| s.latency.as_secs_f64() * 1000.0)
                .collect(),
            0.99
        )
    );
    sampler.await.unwrap();
    let states = states.lock().unwrap().clone();

    // The timeline, per second.
    println!(
        "DEGRADE | timeline (brownout of the large model from {:.1} s to {:.1} s):",
        brown_from.as_secs_f64(),
        brown_to.as_secs_f64()
    );
    println!("DEGRADE |   s  requests  degraded  P99 ms  route states sampled");
    for sec in 0..RUN.as_secs() {
        let inside: Vec<&Shot> = shots.iter().filter(|s| s.at.as_secs() == sec).collect();
        let degraded = inside.iter().filter(|s| s.degraded == "yes").count();
        let p99 = pct(
            inside
                .iter()
                .map(|s| s.latency.as_secs_f64() * 1000.0)
                .collect(),
            0.99,
        );
        let mut seen: Vec<&str> = states
            .iter()
            .filter(|(t, _)| t.as_secs() == sec)
            .map(|(_, s)| *s)
            .collect();
        seen.dedup();
        println!(
            "DEGRADE | {sec:3}  {:8}  {:7.0} %  {p99:6.0}  {}",
            inside.len(),
            100.0 * degraded as f64 / inside.len().max(1) as f64,
            seen.join(" → ")
        );
    }

    let failed: Vec<&Shot> = shots
        .iter()
        .filter(|s| s.status != 200 || !s.done)
        .collect();
    assert!(
        failed.is_empty(),
        "every request is served: {:?}",
        &failed[..failed.len().min(5)]
    );
    let p99 = pct(
        shots
            .iter()
            .map(|s| s.latency.as_secs_f64() * 1000.0)
            .collect(),
        0.99,
    );
    let degraded_at = states
        .iter()
        .find(|(t, s)| *t >= brown_from && *s == "degraded")
        .map(|(t, _)| *t)
        .expect("the route degraded");
    let healthy_again = states
        .iter()
        .find(|(t, s)| *t >= brown_to && *s == "healthy")
        .map(|(t, _)| *t);
    let during: Vec<&Shot> = shots
        .iter()
        .filter(|s| s.at >= degraded_at && s.at < brown_to)
        .collect();
    let share =
        during.iter().filter(|s| s.degraded == "yes").count() as f64 / during.len().max(1) as f64;
    let overall = shots.iter().filter(|s| s.degraded == "yes").count() as f64 / shots.len() as f64;
    println!(
        "DEGRADE | {} requests at {RATE} req/s, all served; P99 {p99:.0} ms (slo.latencyP99 {} ms); \
         degraded {:.2} s after the brownout began (window {} ms); {:.0} % of requests served \
         degraded while it lasted, {:.0} % overall; healthy again {} after it ended (holdFor {} ms \
         + recoverAfter {} ms)",
        shots.len(),
        SLO_LATENCY.as_millis(),
        (degraded_at - brown_from).as_secs_f64(),
        WINDOW.as_millis(),
        share * 100.0,
        overall * 100.0,
        healthy_again.map_or("never".to_owned(), |t| format!(
            "{:.2} s",
            (t - brown_to).as_secs_f64()
        )),
        HOLD.as_millis(),
        RECOVER.as_millis(),
    );

    assert!(
        shots
            .iter()
            .filter(|s| s.at + Duration::from_millis(200) < brown_from)
            .all(|s| s.degraded == "no" && s.provider == "large"),
        "nothing is degraded before the brownout"
    );
    assert!(
        degraded_at - brown_from <= WINDOW,
        "degraded {:?} after the brownout began, over the window {WINDOW:?}",
        degraded_at - brown_from
    );
    assert!(
        p99 <= SLO_LATENCY.as_secs_f64() * 1000.0,
        "served P99 {p99:.0} ms over the SLO {SLO_LATENCY:?}"
    );
    assert!(share >= 0.7, "degraded share while browned out: {share:.2}");
    let healthy_again = healthy_again.expect("the route recovered to Healthy");
    assert!(
        healthy_again - brown_to <= HOLD + RECOVER + Duration::from_secs(2),
        "healthy again {:?} after the brownout",
        healthy_again - brown_to
    );
    let last = shots
        .iter()
        .filter(|s| s.at >= healthy_again + Duration::from_millis(200));
    assert!(
        last.clone().count() > 0 && last.clone().all(|s| s.degraded == "no"),
        "back on the large model once healthy"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
