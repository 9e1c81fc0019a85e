//! `tailwarden-bench`: open-loop scheduling (latency from the schedule), stream metrics and
//! error classes against the simulator, interruption, and bad-input messages of the binary.

mod common;

use std::convert::Infallible;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::start_sim;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tailwarden_e2e::bench::{self, BenchConfig, LoadMode};
use tailwarden_e2e::sim::Profile;
use tokio::net::TcpListener;
use tokio::time::Instant;

const BENCH: &str = env!("CARGO_BIN_EXE_tailwarden-bench");

/// A tiny provider that answers at once, except that the first request arriving after
/// 500 ms stalls for 1 s. It also sets the sidecar's attempt/provider headers.
async fn stalling_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let start = Instant::now();
    let stalled = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let stalled = stalled.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |_req: Request<Incoming>| {
                    let stalled = stalled.clone();
                    async move {
                        if start.elapsed() >= Duration::from_millis(500)
                            && !stalled.swap(true, Ordering::SeqCst)
                        {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        let body = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
                        let resp = Response::builder()
                            .header("content-type", "application/json")
                            .header("x-tailwarden-attempts", "2")
                            .header("x-tailwarden-provider", "p1")
                            .body(Full::new(Bytes::from_static(body.as_bytes())))
                            .expect("response");
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}/v1")
}

fn config(url: &str, rate: f64, duration_ms: u64) -> BenchConfig {
    let mut cfg = BenchConfig::new(url);
    cfg.rate = Some(rate);
    cfg.duration = Duration::from_millis(duration_ms);
    cfg
}

/// With one slot in flight, a 1 s stall delays every request scheduled during it. Timed
/// from the actual send only the stalled request would look slow; timed from the schedule
/// (as it must be) about half the requests show the stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_latency_counts_from_the_schedule() {
    let url = stalling_server().await;
    let mut cfg = config(&url, 50.0, 2000);
    cfg.concurrency = Some(1);
    let r = bench::run(cfg).await.expect("run");
    assert_eq!(r.mode, LoadMode::OpenLoop);
    assert_eq!(r.requests.sent, 100);
    assert_eq!(r.requests.ok, 100);
    let lat = r.latency_ms.as_ref().expect("latencies");
    assert!(lat.max >= 1000.0, "stall visible in max: {lat:?}");
    assert!(
        lat.p95 >= 500.0,
        "stall visible in p95, not hidden: {lat:?}"
    );
    assert!(lat.p99 >= 800.0, "stall visible in p99: {lat:?}");
    assert!(lat.p50 < lat.p95);
    assert!(
        r.requests.late >= 30,
        "requests queued behind the stall are late: {}",
        r.requests.late
    );
    assert_eq!(r.upstream.amplification, Some(2.0));
    assert_eq!(r.upstream.attempts_total, 200);
    assert_eq!(r.upstream.providers.get("p1"), Some(&100));
}

/// Without a cap the open loop keeps sending on schedule during the stall, so only the
/// stalled request is slow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncapped_open_loop_keeps_sending_during_a_stall() {
    let url = stalling_server().await;
    let r = bench::run(config(&url, 50.0, 2000)).await.expect("run");
    assert_eq!(r.requests.ok, 100);
    let lat = r.latency_ms.as_ref().expect("latencies");
    assert!(lat.max >= 1000.0, "{lat:?}");
    assert!(lat.p50 < 100.0, "{lat:?}");
    // Contrast with the capped run (>= 30 late); loose because CI machines are busy.
    assert!(r.requests.late < 30, "late {}", r.requests.late);
    assert!(
        (r.throughput_rps - 50.0).abs() < 5.0,
        "throughput {}",
        r.throughput_rps
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_mode_measures_ttft_and_inter_token_gaps() {
    let sim = start_sim(&Profile::default(), 42).await;
    let mut cfg = config(&sim.base_url(), 40.0, 1000);
    cfg.stream = true;
    cfg.headers = vec![
        ("x-sim-ttft-ms".into(), "40".into()),
        ("x-sim-itl-ms".into(), "5".into()),
        ("x-sim-tokens".into(), "5".into()),
    ];
    let r = bench::run(cfg).await.expect("run");
    assert_eq!(r.requests.ok, 40, "{r:?}");
    let ttft = r.ttft_ms.as_ref().expect("ttft");
    assert!(ttft.p50 >= 40.0 && ttft.p50 < 200.0, "{ttft:?}");
    let itl = r.inter_token_ms.as_ref().expect("itl");
    assert_eq!(itl.count, 40 * 4);
    assert!(itl.p50 >= 4.0, "{itl:?}");
    let lat = r.latency_ms.as_ref().expect("latency");
    assert!(lat.p50 >= 60.0, "ttft + 4 gaps: {lat:?}");
    let json = serde_json::to_value(&r).expect("json");
    assert!(json["ttft_ms"]["p99"].is_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_classified() {
    let sim = start_sim(&Profile::default(), 42).await;
    for (fault, stream, check) in [
        (
            "429",
            false,
            (|e: &bench::ErrorCounts| e.http_429) as fn(&bench::ErrorCounts) -> u64,
        ),
        ("500", false, |e| e.http_5xx),
        ("reset", false, |e| e.reset),
        ("drop", true, |e| e.reset),
        ("stall", true, |e| e.timeout),
    ] {
        let mut cfg = config(&sim.base_url(), 50.0, 200);
        cfg.stream = stream;
        cfg.timeout = Duration::from_millis(300);
        cfg.headers = vec![("x-sim-fault".into(), fault.into())];
        let r = bench::run(cfg).await.expect("run");
        assert_eq!(r.requests.sent, 10, "{fault}");
        assert_eq!(check(&r.errors), 10, "{fault}: {:?}", r.errors);
        assert_eq!(r.errors.total(), 10, "{fault}: {:?}", r.errors);
        assert_eq!(r.error_rate_percent, 100.0);
        assert!(r.latency_ms.is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_run_returns_a_partial_report() {
    let sim = start_sim(&Profile::default(), 42).await;
    let mut cfg = config(&sim.base_url(), 20.0, 30_000);
    cfg.headers = vec![("x-sim-fault".into(), "stall".into())];
    let began = std::time::Instant::now();
    let r = bench::run_until(cfg, tokio::time::sleep(Duration::from_millis(300)))
        .await
        .expect("run");
    let took = began.elapsed();
    assert!(r.partial);
    assert!(took < Duration::from_secs(5), "stopped promptly: {took:?}");
    assert!(r.duration_s < 1.0, "{}", r.duration_s);
    assert!(
        r.requests.unfinished >= 5,
        "stalled requests unfinished: {:?}",
        r.requests
    );
    assert!(r.to_table().contains("PARTIAL"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_saturates() {
    let sim = start_sim(&Profile::default(), 42).await;
    let mut cfg = BenchConfig::new(sim.base_url());
    cfg.concurrency = Some(4);
    cfg.duration = Duration::from_millis(500);
    cfg.warmup = Duration::from_millis(100);
    let r = bench::run(cfg).await.expect("run");
    assert_eq!(r.mode, LoadMode::ClosedLoop);
    assert!(r.requests.ok > 100, "{:?}", r.requests);
    assert_eq!(r.requests.errors, 0);
    assert!(r.throughput_rps > 200.0);
    // Warm-up requests are sent but not counted.
    assert!(sim.stats().requests_total > r.requests.sent);
}

fn bench_cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BENCH).args(args).output().expect("run bench");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_input_gives_one_clear_message() {
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "--url",
                "http://127.0.0.1:1/v1",
                "--rate",
                "0",
                "--duration",
                "1s",
            ],
            "--rate must be a number > 0",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:1/v1",
                "--rate",
                "-5",
                "--duration",
                "1s",
            ],
            "--rate must be a number > 0",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:1/v1",
                "--rate",
                "10",
                "--duration",
                "0s",
            ],
            "--duration must be > 0",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:1/v1",
                "--rate",
                "10",
                "--duration",
                "10x",
            ],
            "invalid duration '10x'",
        ),
        (
            &["--url", "::not a url::", "--rate", "10", "--duration", "1s"],
            "invalid --url '::not a url::'",
        ),
        (
            &[
                "--url",
                "http://127.0.0.1:1/v1",
                "--rate",
                "10",
                "--duration",
                "1s",
            ],
            "cannot connect to 127.0.0.1:1: Connection refused",
        ),
    ];
    for (args, needle) in cases {
        let (code, stdout, stderr) = bench_cli(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr:?}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
    }
    let (_, _, stderr) = bench_cli(&[
        "--url",
        "http://127.0.0.1:1/v1",
        "--rate",
        "10",
        "--duration",
        "1s",
    ]);
    assert_eq!(
        stderr.trim(),
        "tailwarden-bench: cannot connect to 127.0.0.1:1: Connection refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_writes_table_and_json() {
    let sim = start_sim(&Profile::default(), 42).await;
    let json = std::env::temp_dir().join(format!("tw-bench-{}.json", std::process::id()));
    let url = sim.base_url();
    let json_arg = json.to_string_lossy().into_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(BENCH)
            .args([
                "--url",
                &url,
                "--rate",
                "100",
                "--duration",
                "500ms",
                "--stream",
                "--quiet",
            ])
            .args([
                "--json",
                &json_arg,
                "--header",
                "Authorization: Bearer sk-bench",
            ])
            .output()
            .expect("run bench")
    })
    .await
    .expect("join");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("p99.9") && stdout.contains("ttft"),
        "{stdout}"
    );
    let text = std::fs::read_to_string(&json).expect("json written");
    let _ = std::fs::remove_file(&json);
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid json");
    assert_eq!(v["requests"]["ok"], 50);
    assert_eq!(v["partial"], false);
    assert!(v["latency_ms"]["p50"].is_number());
    assert_eq!(
        sim.stats().last_authorization.as_deref(),
        Some("Bearer sk-bench")
    );
}
