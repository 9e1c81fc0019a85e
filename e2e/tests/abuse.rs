//! Client abuse against the real `tailwarden-sidecar` binary (a child process, as users run
//! it), with a scripted upstream on loopback that records every request it receives:
//!
//! * 5 000 idle connections, three rounds: the sidecar's RSS stays bounded, it lets go of
//!   every socket, and real requests are served while they are open;
//! * slowloris: connections that send nothing, a stalled HTTP/2 preface, dribbled HTTP/1
//!   headers, an idle or dribbling HTTP/2 connection (closed at the header or idle
//!   deadline), dribbled or stalled bodies (408 at the body deadline), with the memory of
//!   600 of them held at once bounded;
//! * huge headers (431 or a close, bounded memory), over HTTP/1 and HTTP/2;
//! * request smuggling (Content-Length with Transfer-Encoding, differing Content-Lengths,
//!   obs-fold, bad chunk sizes, ...): a 400 or a close, and the upstream never sees a
//!   smuggled request;
//! * HTTP/2 rapid reset (h2c prior knowledge, thousands of streams opened and reset): the
//!   abusive connection gets a GOAWAY, the sidecar stays up with bounded memory and keeps
//!   serving other clients;
//! * the connection limit: clients beyond `--max-connections` wait, they are not refused.
//!
//! The deadlines under test are the shipped ones (10 s for headers and HTTP/2 idleness, 30 s
//! for bodies), so the slow cases run concurrently; the file takes about 40 s, most of it
//! waiting. `TAILWARDEN_SIDECAR_BIN=PATH` tests another build (e.g. a release build).
//!
//! Memory is the sidecar's `VmRSS` from `/proc/PID/status`; open sockets are the entries of
//! `/proc/PID/fd`. Every bound asserted here is printed with the measured value
//! (`-- --nocapture`), and `docs/reliability.md` quotes them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, service::service_fn};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo},
};
use tailwarden_e2e::{
    fetch,
    proc::{ChildProc, rss_kib},
    sidecar::parse_listening_line,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    runtime::Runtime,
    task::JoinSet,
};

/// The sidecar's header deadline (`server::HEADER_READ_TIMEOUT`).
const HEADER_DEADLINE: Duration = Duration::from_secs(10);
/// The sidecar's body deadline (`App::body_timeout`).
const BODY_DEADLINE: Duration = Duration::from_secs(30);
/// Slack on top of a deadline for scheduling on a busy 2-core machine.
const SLACK: Duration = Duration::from_secs(3);
const MIB: u64 = 1024;
/// The HTTP/2 connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const CHAT: &str = r#"{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}]}"#;
const UPSTREAM_REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4.1","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

/// A chat request body tagged with `marker`, so the upstream's log says which case sent it.
fn chat_body(marker: &str) -> String {
    format!(r#"{{"model":"gpt-4.1","messages":[{{"role":"user","content":"{marker}"}}]}}"#)
}

/// The sidecar under test: `TAILWARDEN_SIDECAR_BIN` (e.g. a release build), else the one
/// built next to this test.
fn sidecar_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TAILWARDEN_SIDECAR_BIN") {
        return PathBuf::from(p);
    }
    bin("tailwarden-sidecar")
}

fn bin(name: &str) -> PathBuf {
    // Workspace binaries sit next to the test's deps/ folder.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} not built (cargo build -p tailwarden-sidecar)",
        path.display()
    );
    path
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// The scripted upstream: answers every request with one chat completion and records the body.

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn bodies(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

async fn start_upstream() -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let log = log.clone();
                    async move {
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        let text = body
                            .map(|b| String::from_utf8_lossy(&b).into_owned())
                            .unwrap_or_else(|e| format!("<body error: {e}>"));
                        log.0.lock().unwrap().push(text);
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from_static(UPSTREAM_REPLY.as_bytes())))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, seen)
}

// ---------------------------------------------------------------------------------------
// The sidecar under test.

struct Rig {
    rt: Runtime,
    seen: Seen,
    sidecar: ChildProc,
    listen: SocketAddr,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Rig {
    /// A scripted upstream and a sidecar routing every model to it, with `extra` flags.
    fn start(name: &str, extra: &[&str]) -> Self {
        let rt = runtime();
        let (upstream, seen) = rt.block_on(start_upstream());
        let dir = std::env::temp_dir().join(format!("tw-abuse-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("routes.yaml");
        // One attempt per request, so "requests the upstream saw" is exactly "requests the
        // sidecar forwarded".
        std::fs::write(
            &config,
            format!(
                "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: abuse}}\n\
                 spec:\n  models: ['*']\n  providers:\n  - {{name: up, baseUrl: 'http://{upstream}/v1'}}\n  \
                 timeouts: {{firstByte: 5s, total: 30s}}\n  retries: {{maxAttempts: 1}}\n"
            ),
        )
        .unwrap();
        // The sidecar inherits this process's open-file limit.
        raise_nofile(std::process::id(), 12_000);
        let mut cmd = Command::new(sidecar_bin());
        cmd.arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--log-format", "json"])
            .args(extra)
            .env("TAILWARDEN_LOG", "warn");
        let mut sidecar = ChildProc::spawn("tailwarden-sidecar", &cmd, &dir.join("sidecar.log"))
            .expect("sidecar starts");
        let (listen, admin) = sidecar
            .wait_for_line(
                "listening line",
                Duration::from_secs(15),
                parse_listening_line,
            )
            .expect("listening");
        sidecar
            .wait_until("readyz", Duration::from_secs(15), || {
                fetch::get(admin, "/readyz", Duration::from_secs(1)).is_ok_and(|r| r.status == 200)
            })
            .expect("ready");
        Self {
            rt,
            seen,
            sidecar,
            listen,
            _dir: TempDir(dir),
        }
    }

    fn pid(&self) -> u32 {
        self.sidecar.pid()
    }

    fn rss_kib(&self) -> u64 {
        rss_kib(self.pid()).expect("sidecar is alive")
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .expect("sidecar is alive")
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listen)
    }

    /// Warms the sidecar up (connection pool to the upstream, lazily built state), so the
    /// baseline RSS is the one of a sidecar that has served traffic.
    fn warm_up(&self) {
        self.rt.block_on(async {
            let client = client();
            for _ in 0..20 {
                let (status, _) = post(&client, &self.url("/v1/chat/completions"), CHAT).await;
                assert_eq!(status, 200);
            }
        });
        std::thread::sleep(Duration::from_millis(300));
    }

    fn assert_alive(&self) {
        let (status, _) = self
            .rt
            .block_on(async { post(&client(), &self.url("/v1/chat/completions"), CHAT).await });
        assert_eq!(status, 200, "the sidecar still serves a normal request");
    }
}

/// Raises the soft open-file limit of `pid` towards `want` (never above the hard limit),
/// with util-linux `prlimit`: the workspace forbids the `unsafe` a direct `setrlimit` needs.
/// Returns the soft limit now in force.
fn raise_nofile(pid: u32, want: u64) -> u64 {
    let read = || -> (u64, u64) {
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap();
        let mut f = line["Max open files".len()..].split_whitespace();
        let parse = |v: Option<&str>| v.and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
        (parse(f.next()), parse(f.next()))
    };
    let (soft, hard) = read();
    if soft >= want {
        return soft;
    }
    let _ = Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--nofile={}:", want.min(hard)),
        ])
        .status();
    read().0
}

type TestClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

async fn post(client: &TestClient, url: &str, body: &str) -> (u16, String) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = client.request(req).await.expect("response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

// ---------------------------------------------------------------------------------------
// Raw HTTP/1.

/// What a raw exchange saw: every byte the server sent, whether it closed, and when.
#[derive(Debug)]
struct Exchange {
    received: Vec<u8>,
    closed_after: Option<Duration>,
}

impl Exchange {
    fn statuses(&self) -> Vec<u16> {
        parse_statuses(&self.received)
    }
}

/// Reads until the server closes (EOF or reset) or `wait` passes, timing from `start`.
async fn read_until_close(stream: &mut TcpStream, start: Instant, wait: Duration) -> Exchange {
    let mut received = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => {
                return Exchange {
                    received,
                    closed_after: None,
                };
            }
            Ok(Ok(0) | Err(_)) => {
                return Exchange {
                    received,
                    closed_after: Some(start.elapsed()),
                };
            }
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
        }
    }
}

/// Sends `bytes` on a fresh connection and reads until the server closes or `wait` passes.
/// A write the server refuses mid-way (it closed early) is not an error: what it answered is.
async fn raw_exchange(addr: SocketAddr, bytes: &[u8], wait: Duration) -> Exchange {
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(bytes).await;
    read_until_close(&mut stream, start, wait).await
}

/// The status codes of the HTTP/1 responses in `raw`, in order (bodies framed by
/// Content-Length or chunked; an unframed body runs to the end).
fn parse_statuses(raw: &[u8]) -> Vec<u16> {
    let mut out = Vec::new();
    let mut rest = raw;
    while let Some(end) = find(rest, b"\r\n\r\n") {
        let head = String::from_utf8_lossy(&rest[..end]).to_ascii_lowercase();
        let Some(status) = head
            .strip_prefix("http/1.1 ")
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse().ok())
        else {
            break;
        };
        out.push(status);
        rest = &rest[end + 4..];
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        if let Some(n) = length {
            rest = &rest[n.min(rest.len())..];
        } else if head.contains("transfer-encoding: chunked") {
            match find(rest, b"0\r\n\r\n") {
                Some(i) => rest = &rest[i + 5..],
                None => break,
            }
        } else {
            break;
        }
    }
    out
}

/// Whether `raw` holds one whole response framed by Content-Length.
fn response_complete(raw: &[u8]) -> bool {
    let Some(end) = find(raw, b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .expect("a Content-Length");
    raw.len() >= end + 4 + length
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn request_head(method_path: &str, extra: &str) -> String {
    format!("{method_path} HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n{extra}")
}

// ---------------------------------------------------------------------------------------
// 5 000 idle connections.

/// What one round of the idle-connection test measured.
struct IdleRound {
    open_s: f64,
    rss_kib: u64,
    fds_open: usize,
    slowest: Duration,
    rss_after_kib: u64,
    fds_after: usize,
}

/// Opens `n` idle connections (half silent, half keep-alive after one request, as a leaking
/// HTTP client pool leaves them), checks that 50 real requests are served meanwhile, reads
/// the sidecar's RSS and fds, closes them and waits for the sidecar to let go.
fn idle_round(rig: &Rig, n: usize) -> IdleRound {
    let addr = rig.listen;
    let fds0 = rig.fds();
    let opened = Instant::now();
    let conns: Vec<TcpStream> = rig.rt.block_on(async {
        let mut set = JoinSet::new();
        let gate = Arc::new(tokio::sync::Semaphore::new(200));
        for i in 0..n {
            let gate = gate.clone();
            set.spawn(async move {
                let _p = gate.acquire_owned().await.unwrap();
                let mut s = TcpStream::connect(addr).await.expect("connect");
                if i % 2 == 1 {
                    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: sidecar\r\n\r\n")
                        .await
                        .unwrap();
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !response_complete(&got) {
                        let n = s.read(&mut buf).await.unwrap();
                        assert!(n > 0, "closed before the models list");
                        got.extend_from_slice(&buf[..n]);
                    }
                    assert_eq!(parse_statuses(&got), vec![200]);
                }
                s
            });
        }
        let mut conns = Vec::with_capacity(n);
        while let Some(c) = set.join_next().await {
            conns.push(c.unwrap());
        }
        conns
    });
    let open_s = opened.elapsed().as_secs_f64();
    // Every socket is accepted (the sidecar holds an fd for each) ... give or take the
    // sidecar's pooled upstream connections from the previous round (at most one per
    // request of its 50), which its pool may close meanwhile.
    let expected = fds0 + n - 64;
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig.fds() < expected && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        rig.fds() >= expected,
        "sidecar holds {} fds, expected ≥ {expected}",
        rig.fds(),
    );
    // ... and real requests are served meanwhile, on new connections.
    let latencies: Vec<Duration> = rig.rt.block_on(async {
        let client = client();
        let mut set = JoinSet::new();
        for _ in 0..50 {
            let client = client.clone();
            let url = format!("http://{addr}/v1/chat/completions");
            set.spawn(async move {
                let t = Instant::now();
                let (status, _) = post(&client, &url, CHAT).await;
                assert_eq!(status, 200);
                t.elapsed()
            });
        }
        let mut out = Vec::new();
        while let Some(l) = set.join_next().await {
            out.push(l.unwrap());
        }
        out
    });
    let (rss_kib, fds_open) = (rig.rss_kib(), rig.fds());
    assert!(
        opened.elapsed() < HEADER_DEADLINE,
        "the measurement must happen before the sidecar closes idle connections itself"
    );
    // Closed by the clients: the sidecar lets go of every socket (the ones it keeps are
    // its pooled upstream connections and the test client's).
    drop(conns);
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig.fds() + n > fds_open + 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    IdleRound {
        open_s,
        rss_kib,
        fds_open,
        slowest: latencies.into_iter().max().unwrap(),
        rss_after_kib: rig.rss_kib(),
        fds_after: rig.fds(),
    }
}

#[test]
fn five_thousand_idle_connections_cost_bounded_memory_and_requests_still_flow() {
    const N: usize = 5_000;
    // The sidecar's RSS over its warmed-up baseline with N idle connections open, per
    // connection: a task and a socket, and for keep-alive connections hyper's read and write
    // buffers. A debug build measures 16 KiB in the first round. Later rounds start before
    // jemalloc has returned the last round's pages (1 s decay), so they measure 16-25 KiB
    // without a trend (6 rounds: 16.3, 19.1, 24.5, 19.9, 19.9, 20.1), where a leak would add
    // the same amount every round. The bound holds for every round, with room for a busy
    // machine.
    const BOUND_PER_CONN_KIB: u64 = 32;
    const ROUNDS: usize = 3;
    let limit = raise_nofile(std::process::id(), 12_000);
    assert!(
        limit >= (N + 500) as u64,
        "the open-file limit ({limit}) is below {N} connections and the hard limit does not allow more"
    );
    let rig = Rig::start("idle", &[]);
    rig.warm_up();
    let (rss0, fds0) = (rig.rss_kib(), rig.fds());
    // Several rounds: a leak per connection would grow RSS by the same amount every round.
    let rounds: Vec<IdleRound> = (0..ROUNDS).map(|_| idle_round(&rig, N)).collect();
    for (i, r) in rounds.iter().enumerate() {
        let grown = r.rss_kib.saturating_sub(rss0);
        eprintln!(
            "idle round {}: {N} connections opened in {:.1} s; sidecar RSS {rss0} KiB -> {} KiB \
             (+{grown} KiB, {:.1} KiB per connection; bound {BOUND_PER_CONN_KIB} KiB), \
             fds {fds0} -> {}; 50 requests meanwhile, slowest {} ms; after the clients closed: \
             RSS {} KiB, fds {}",
            i + 1,
            r.open_s,
            r.rss_kib,
            grown as f64 / N as f64,
            r.fds_open,
            r.slowest.as_millis(),
            r.rss_after_kib,
            r.fds_after,
        );
    }
    for r in &rounds {
        let grown = r.rss_kib.saturating_sub(rss0);
        assert!(
            grown <= BOUND_PER_CONN_KIB * N as u64,
            "RSS grew by {grown} KiB for {N} idle connections"
        );
        assert!(
            r.fds_after + N <= r.fds_open + 5,
            "sockets left open after the clients closed: {} fds, {} with the connections open",
            r.fds_after,
            r.fds_open
        );
    }
    rig.assert_alive();
}

#[test]
fn idle_http2_connections_cost_bounded_memory() {
    const N: usize = 1_000;
    // An HTTP/2 connection keeps more state than an HTTP/1 one (HPACK tables, flow-control
    // windows, frame buffers): about 22 KiB each after one request, in a debug build and in
    // a release build alike.
    const BOUND_PER_CONN_KIB: u64 = 48;
    let rig = Rig::start("idle-h2", &[]);
    rig.warm_up();
    let (rss0, fds0) = (rig.rss_kib(), rig.fds());
    let addr = rig.listen;
    let (clients, rss1, fds1) = rig.rt.block_on(async {
        let mut set = JoinSet::new();
        let gate = Arc::new(tokio::sync::Semaphore::new(100));
        for _ in 0..N {
            let gate = gate.clone();
            set.spawn(async move {
                let _p = gate.acquire_owned().await.unwrap();
                let tcp = TcpStream::connect(addr).await.unwrap();
                let (client, conn) = h2::client::handshake(tcp).await.unwrap();
                tokio::spawn(conn);
                // One request, as a pooled client makes before it goes idle.
                let mut client = client.ready().await.unwrap();
                let req = Request::get(format!("http://{addr}/v1/models"))
                    .body(())
                    .unwrap();
                let (resp, _) = client.send_request(req, true).unwrap();
                let resp = resp.await.unwrap();
                assert_eq!(resp.status(), 200);
                let mut body = resp.into_body();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk.unwrap();
                    let _ = body.flow_control().release_capacity(chunk.len());
                }
                client
            });
        }
        let mut clients = Vec::with_capacity(N);
        while let Some(c) = set.join_next().await {
            clients.push(c.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        (clients, rss_kib(rig.pid()).unwrap(), rig.fds())
    });
    rig.assert_alive();
    let grown = rss1.saturating_sub(rss0);
    eprintln!(
        "idle h2: {N} HTTP/2 connections after one request each: sidecar RSS {rss0} -> {rss1} KiB \
         (+{grown} KiB, {:.1} KiB per connection; bound {BOUND_PER_CONN_KIB} KiB), fds {fds0} -> {fds1}",
        grown as f64 / N as f64
    );
    assert!(fds1 >= fds0 + N, "not every connection was accepted");
    assert!(
        grown <= BOUND_PER_CONN_KIB * N as u64,
        "RSS grew by {grown} KiB"
    );
    drop(clients);
}

// ---------------------------------------------------------------------------------------
// Slowloris: headers and bodies, run side by side because their deadlines are long.

/// Writes `first`, then `drip` one byte every `every`, forever (until the server closes);
/// returns when the server closed (EOF or reset) and what it answered.
async fn dribble(
    addr: SocketAddr,
    first: Vec<u8>,
    drip: &'static [u8],
    every: Duration,
    wait: Duration,
) -> Exchange {
    let start = Instant::now();
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        if wr.write_all(&first).await.is_err() {
            return;
        }
        if drip.is_empty() {
            // Hold the write half: dropping it would send a FIN, which is not silence.
            std::future::pending::<()>().await;
        }
        for b in drip.iter().cycle() {
            tokio::time::sleep(every).await;
            if wr.write_all(&[*b]).await.is_err() {
                return;
            }
        }
    });
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + wait;
    let closed_after = loop {
        match tokio::time::timeout_at(deadline, rd.read(&mut buf)).await {
            Err(_) => break None,
            Ok(Ok(0) | Err(_)) => break Some(start.elapsed()),
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
        }
    };
    writer.abort();
    Exchange {
        received,
        closed_after,
    }
}

/// A slow client: (name, first bytes, then one `drip` byte per `every`, deadline for the
/// sidecar to close, the answer expected before the close).
type SlowCase = (
    &'static str,
    Vec<u8>,
    &'static [u8],
    Duration,
    Duration,
    Option<u16>,
);

#[test]
fn slowloris_headers_and_bodies_are_cut_off_at_their_deadlines() {
    // Many of each at once, to measure what they cost while they are held.
    const CROWD: usize = 300;
    const CROWD_BOUND_KIB: u64 = 48 * MIB;
    let rig = Rig::start("slowloris", &[]);
    rig.warm_up();
    let rss0 = rig.rss_kib();
    let addr = rig.listen;
    let seen_before = rig.seen.count();
    let second = Duration::from_secs(1);
    let header_wait = HEADER_DEADLINE + SLACK;
    let body_wait = BODY_DEADLINE + SLACK;
    let cl_head = request_head("POST /v1/chat/completions", "Content-Length: 1000\r\n\r\n");
    let te_head = request_head(
        "POST /v1/chat/completions",
        "Transfer-Encoding: chunked\r\n\r\n",
    );

    // An HTTP/2 client that opens a connection and sends a HEADERS frame one byte a second:
    // the preface, an empty SETTINGS frame, then a HEADERS frame header announcing 64 bytes.
    let mut h2_dribble = H2_PREFACE.to_vec();
    h2_dribble.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    h2_dribble.extend_from_slice(&[0, 0, 64, 1, 4, 0, 0, 0, 1]);
    let forever = Duration::from_secs(3600);
    let mut cl_stalled = cl_head.clone().into_bytes();
    cl_stalled.extend_from_slice(b"{\"model\":");
    let mut te_dribble = te_head.clone().into_bytes();
    te_dribble.extend_from_slice(b"1\r\n{\r\n");
    let cases: Vec<SlowCase> = vec![
        ("silent", vec![], b"", forever, HEADER_DEADLINE, None),
        (
            "stalled HTTP/2 preface",
            b"PRI * HTTP/2.0\r\n".to_vec(),
            b"",
            forever,
            HEADER_DEADLINE,
            None,
        ),
        (
            "dribbled header",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nX-Slow: ".to_vec(),
            b"a",
            second,
            HEADER_DEADLINE,
            None,
        ),
        // GOAWAY when idle, dropped one period later: this client never acknowledges.
        (
            "dribbled HTTP/2 HEADERS frame",
            h2_dribble,
            b"a",
            second,
            2 * HEADER_DEADLINE,
            None,
        ),
        (
            "dribbled body (content-length)",
            cl_head.clone().into_bytes(),
            b"a",
            second,
            BODY_DEADLINE,
            Some(408),
        ),
        (
            "dribbled body (chunked)",
            te_dribble,
            b"1\r\na\r\n",
            second,
            BODY_DEADLINE,
            Some(408),
        ),
        (
            "stalled body",
            cl_stalled,
            b"",
            forever,
            BODY_DEADLINE,
            Some(408),
        ),
    ];

    let (named, crowd_rss, crowd) = rig.rt.block_on(async {
        let mut named = JoinSet::new();
        for (name, first, drip, every, limit, want) in cases {
            named.spawn(async move {
                let ex = dribble(addr, first, drip, every, limit + SLACK).await;
                (name, limit, want, ex)
            });
        }
        // A well-behaved HTTP/2 client that connects and never sends a request: a GOAWAY
        // after the idle timeout, which it acknowledges, and the connection ends.
        named.spawn(async move {
            let start = Instant::now();
            let tcp = TcpStream::connect(addr).await.unwrap();
            let (client, conn) = h2::client::handshake(tcp).await.unwrap();
            let ended = tokio::time::timeout(HEADER_DEADLINE + SLACK, conn).await;
            drop(client);
            let ex = Exchange {
                received: Vec::new(),
                closed_after: ended.is_ok().then(|| start.elapsed()),
            };
            (
                "idle HTTP/2 connection (h2 client)",
                HEADER_DEADLINE,
                None,
                ex,
            )
        });

        // The crowd: CROWD header dribblers and CROWD body dribblers held open together.
        let mut crowd = JoinSet::new();
        for i in 0..CROWD {
            let head = cl_head.clone().into_bytes();
            crowd.spawn(async move {
                let header = dribble(
                    addr,
                    format!("POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nX-Slow-{i}: ")
                        .into_bytes(),
                    b"a",
                    second,
                    header_wait,
                );
                ("header", header.await)
            });
            crowd
                .spawn(async move { ("body", dribble(addr, head, b"a", second, body_wait).await) });
        }
        // Everything is connected and sending well before the header deadline.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let crowd_rss = rss_kib(rig.pid());
        let mut named_out = Vec::new();
        while let Some(r) = named.join_next().await {
            named_out.push(r.unwrap());
        }
        let mut crowd_out = Vec::new();
        while let Some(r) = crowd.join_next().await {
            crowd_out.push(r.unwrap());
        }
        (named_out, crowd_rss, crowd_out)
    });

    let mut failures = Vec::new();
    for (name, limit, want_status, ex) in &named {
        let (limit, want_status) = (*limit, *want_status);
        let statuses = ex.statuses();
        eprintln!(
            "slowloris: {name}: closed after {:?}, responses {statuses:?} (deadline {limit:?})",
            ex.closed_after.map(|d| format!("{:.1} s", d.as_secs_f64()))
        );
        match ex.closed_after {
            None => failures.push(format!("{name}: still open after {:?}", limit + SLACK)),
            Some(t) if t + Duration::from_millis(500) < limit => failures.push(format!(
                "{name}: closed after {t:?}, before its deadline {limit:?}"
            )),
            Some(_) => {}
        }
        if let Some(s) = want_status {
            if statuses != [s] {
                failures.push(format!("{name}: answered {statuses:?}, expected [{s}]"));
            }
        } else if !statuses.is_empty() && statuses.iter().any(|s| !matches!(s, 400 | 408)) {
            failures.push(format!("{name}: answered {statuses:?}"));
        }
    }
    let crowd_grown = crowd_rss.unwrap_or(0).saturating_sub(rss0);
    let still_open = crowd
        .iter()
        .filter(|(_, ex)| ex.closed_after.is_none())
        .count();
    let wrong = crowd
        .iter()
        .filter(|(kind, ex)| *kind == "body" && ex.statuses() != [408])
        .count();
    let slowest_close = crowd.iter().filter_map(|(_, ex)| ex.closed_after).max();
    eprintln!(
        "slowloris: {CROWD} header + {CROWD} body dribblers at once: sidecar RSS +{crowd_grown} KiB \
         (bound {CROWD_BOUND_KIB} KiB); all closed: {}, last after {slowest_close:?}; \
         body dribblers answered other than 408: {wrong}",
        still_open == 0
    );
    if still_open > 0 {
        failures.push(format!("{still_open} crowd connections were still open"));
    }
    if wrong > 0 {
        failures.push(format!("{wrong} body dribblers did not get a 408"));
    }
    if crowd_grown > CROWD_BOUND_KIB {
        failures.push(format!(
            "RSS grew by {crowd_grown} KiB with the crowd held open"
        ));
    }
    let forwarded = rig.seen.count() - seen_before;
    if forwarded != 0 {
        failures.push(format!(
            "the upstream saw {forwarded} requests from slow clients"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    rig.assert_alive();
}

// ---------------------------------------------------------------------------------------
// Huge headers.

#[test]
fn huge_headers_get_431_or_a_close_with_bounded_memory() {
    const HOLDERS: usize = 200;
    const HOLDERS_BOUND_KIB: u64 = 64 * MIB;
    let rig = Rig::start("headers", &[]);
    rig.warm_up();
    let addr = rig.listen;
    let seen_before = rig.seen.count();
    let body = chat_body("huge-headers");
    let wait = Duration::from_secs(5);
    let one_big = format!(
        "{}X-Big: {}\r\nContent-Length: {}\r\n\r\n{body}",
        request_head("POST /v1/chat/completions", ""),
        "a".repeat(100 * 1024),
        body.len()
    );
    let many = format!(
        "{}{}Content-Length: {}\r\n\r\n{body}",
        request_head("POST /v1/chat/completions", ""),
        (0..500)
            .map(|i| format!("X-H{i}: v\r\n"))
            .collect::<String>(),
        body.len()
    );
    // Headers that never end: 10 MiB of them, as fast as the socket takes them.
    let endless = format!(
        "{}X-Endless: {}",
        request_head("POST /v1/chat/completions", ""),
        "a".repeat(10 * 1024 * 1024)
    );
    let fine = format!(
        "{}X-Large-But-Fine: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        request_head("POST /v1/chat/completions", ""),
        "a".repeat(16 * 1024),
        chat_body("fine").len(),
        chat_body("fine")
    );
    let (results, held_rss) = rig.rt.block_on(async {
        let mut out = Vec::new();
        for (name, raw) in [
            ("one 100 KiB header", &one_big),
            ("500 headers", &many),
            ("10 MiB of header bytes", &endless),
            ("a 16 KiB header (allowed)", &fine),
        ] {
            out.push((name, raw_exchange(addr, raw.as_bytes(), wait).await));
        }
        // HOLDERS connections each send 60 KiB of headers (under the 64 KiB cap) and hold.
        let rss0 = rss_kib(rig.pid()).unwrap();
        let mut holders = Vec::new();
        for i in 0..HOLDERS {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\nX-Hold-{i}: {}\r\n",
                "b".repeat(60 * 1024)
            );
            s.write_all(head.as_bytes()).await.unwrap();
            holders.push(s);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rss1 = rss_kib(rig.pid()).unwrap();
        drop(holders);
        (out, (rss0, rss1))
    });
    for (name, ex) in &results {
        eprintln!(
            "huge headers: {name}: responses {:?}, closed after {:?}",
            ex.statuses(),
            ex.closed_after
        );
    }
    for (name, ex) in &results[..3] {
        let statuses = ex.statuses();
        assert!(
            statuses == [431] || (statuses.is_empty() && ex.closed_after.is_some()),
            "{name}: expected a 431 or a close, got {statuses:?} (closed: {:?})",
            ex.closed_after
        );
        assert!(
            ex.closed_after.is_some(),
            "{name}: the connection stays open"
        );
    }
    assert_eq!(
        results[3].1.statuses(),
        vec![200],
        "a 16 KiB header is served"
    );
    let grown = held_rss.1.saturating_sub(held_rss.0);
    eprintln!(
        "huge headers: {HOLDERS} connections holding 60 KiB of unfinished headers: RSS {} -> {} KiB (+{grown} KiB, bound {HOLDERS_BOUND_KIB} KiB)",
        held_rss.0, held_rss.1
    );
    assert!(grown <= HOLDERS_BOUND_KIB, "RSS grew by {grown} KiB");
    let bodies = rig.seen.bodies();
    assert_eq!(
        bodies[seen_before..],
        [chat_body("fine")],
        "only the allowed request reached the upstream"
    );

    // HTTP/2: a 100 KiB header list (the sidecar advertises 16 KiB).
    let outcome = rig.rt.block_on(async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let mut client = client.ready().await.unwrap();
        let req = Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-big", "a".repeat(100 * 1024))
            .body(())
            .unwrap();
        match client.send_request(req, true) {
            Err(e) => format!("refused by the client library: {e}"),
            Ok((resp, _)) => match tokio::time::timeout(wait, resp).await {
                Err(_) => panic!("no answer to an oversized HTTP/2 header list"),
                Ok(Ok(r)) => format!("status {}", r.status().as_u16()),
                Ok(Err(e)) => format!("stream error: {e}"),
            },
        }
    });
    eprintln!("huge headers: HTTP/2 100 KiB header list: {outcome}");
    assert!(
        outcome == "status 431" || outcome.contains("error") || outcome.contains("refused"),
        "HTTP/2 oversized headers: {outcome}"
    );
    assert_eq!(
        rig.seen.count(),
        seen_before + 1,
        "nothing else reached the upstream"
    );
    rig.assert_alive();
}

// ---------------------------------------------------------------------------------------
// Request smuggling.

#[test]
fn smuggling_attempts_get_400_or_a_close_and_never_reach_the_upstream_as_two_requests() {
    let rig = Rig::start("smuggling", &[]);
    let addr = rig.listen;
    let seen_before = rig.seen.count();
    // A request an attacker hides after the first one's framing ends.
    let smuggled_body = chat_body("SMUGGLED");
    let smuggled = format!(
        "{}Content-Length: {}\r\n\r\n{smuggled_body}",
        request_head("POST /v1/chat/completions", ""),
        smuggled_body.len()
    );
    let first = chat_body("first");
    let chunked = |body: &str| format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let post = |extra: &str, body: &str| {
        format!(
            "{}{extra}\r\n{body}",
            request_head("POST /v1/chat/completions", "")
        )
    };

    // (name, raw bytes, what the upstream may see from it)
    let cases: Vec<(&str, String, Vec<String>)> = vec![
        (
            "CL.TE: Content-Length covers the smuggled request, Transfer-Encoding ends before it",
            post(
                &format!(
                    "Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
                    chunked(&first).len() + smuggled.len()
                ),
                &format!("{}{smuggled}", chunked(&first)),
            ),
            vec![first.clone()],
        ),
        (
            "TE.CL: Transfer-Encoding first, a short Content-Length",
            post(
                "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
                &format!("{}{smuggled}", chunked(&first)),
            ),
            vec![first.clone()],
        ),
        (
            "two differing Content-Lengths",
            post(
                &format!(
                    "Content-Length: {}\r\nContent-Length: {}\r\n",
                    first.len(),
                    first.len() + smuggled.len()
                ),
                &format!("{first}{smuggled}"),
            ),
            vec![],
        ),
        (
            "Content-Length list with differing values",
            post(
                &format!(
                    "Content-Length: {}, {}\r\n",
                    first.len(),
                    first.len() + smuggled.len()
                ),
                &format!("{first}{smuggled}"),
            ),
            vec![],
        ),
        (
            "signed Content-Length",
            post(&format!("Content-Length: +{}\r\n", first.len()), &first),
            vec![],
        ),
        (
            "Transfer-Encoding not ending in chunked",
            post(
                "Transfer-Encoding: chunked, identity\r\n",
                &format!("{}{smuggled}", chunked(&first)),
            ),
            vec![],
        ),
        (
            "Transfer-Encoding: xchunked",
            post(
                &format!(
                    "Transfer-Encoding: xchunked\r\nContent-Length: {}\r\n",
                    first.len()
                ),
                &first,
            ),
            vec![],
        ),
        (
            "space before the colon",
            post(
                &format!(
                    "Transfer-Encoding : chunked\r\nContent-Length: {}\r\n",
                    first.len()
                ),
                &first,
            ),
            vec![],
        ),
        (
            "obs-fold (a header continued on the next line)",
            post(
                &format!("X-Folded: a\r\n b\r\nContent-Length: {}\r\n", first.len()),
                &first,
            ),
            vec![],
        ),
        (
            "obs-fold hiding Transfer-Encoding",
            post(
                &format!(
                    "Content-Length: {}\r\nX-Folded: a\r\n Transfer-Encoding: chunked\r\n",
                    first.len()
                ),
                &first,
            ),
            vec![],
        ),
        (
            "bare CR in a header value",
            post(
                &format!("X-Cr: a\rb\r\nContent-Length: {}\r\n", first.len()),
                &first,
            ),
            vec![],
        ),
        (
            "bad chunk size",
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("zz\r\n{first}\r\n0\r\n\r\n{smuggled}"),
            ),
            vec![],
        ),
        (
            "chunk size overflowing 64 bits",
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("1{}\r\n{first}\r\n0\r\n\r\n{smuggled}", "0".repeat(17)),
            ),
            vec![],
        ),
        (
            "chunk size shorter than the data",
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!("3\r\n{first}\r\n0\r\n\r\n{smuggled}"),
            ),
            vec![],
        ),
        (
            "chunk extension of 100 KiB",
            post(
                "Transfer-Encoding: chunked\r\n",
                &format!(
                    "{:x};ext={}\r\n{first}\r\n0\r\n\r\n",
                    first.len(),
                    "e".repeat(100 * 1024)
                ),
            ),
            vec![],
        ),
        (
            "Transfer-Encoding on HTTP/1.0",
            format!(
                "POST /v1/chat/completions HTTP/1.0\r\nHost: sidecar\r\nTransfer-Encoding: chunked\r\n\r\n{}",
                chunked(&first)
            ),
            vec![],
        ),
        (
            "Content-Length shorter than the body (the rest is a second request)",
            post(
                &format!("Content-Length: {}\r\n", first.len()),
                &format!("{first}{smuggled}"),
            ),
            // Not smuggling: the rest *is* a second request on a keep-alive connection, and
            // both are answered. The control case proving the upstream log sees pipelining.
            vec![first.clone(), smuggled_body.clone()],
        ),
    ];

    let results = rig.rt.block_on(async {
        let mut set = JoinSet::new();
        for (i, (_, raw, _)) in cases.iter().enumerate() {
            let raw = raw.clone();
            set.spawn(async move {
                (
                    i,
                    raw_exchange(addr, raw.as_bytes(), Duration::from_secs(3)).await,
                )
            });
        }
        let mut out: Vec<Option<Exchange>> = (0..cases.len()).map(|_| None).collect();
        while let Some(r) = set.join_next().await {
            let (i, ex) = r.unwrap();
            out[i] = Some(ex);
        }
        out
    });

    let mut failures = Vec::new();
    let mut expected_upstream = Vec::new();
    for ((name, _, may_forward), ex) in cases.iter().zip(&results) {
        let ex = ex.as_ref().unwrap();
        let statuses = ex.statuses();
        eprintln!(
            "smuggling: {name}: responses {statuses:?}, closed: {}",
            ex.closed_after.is_some()
        );
        expected_upstream.extend(may_forward.iter().cloned());
        if may_forward.is_empty() {
            // Rejected: a 400 (or 431/501), or a close without an answer; never a 2xx.
            let ok = match statuses.as_slice() {
                [] => ex.closed_after.is_some(),
                [s] => matches!(s, 400 | 413 | 431 | 501),
                _ => false,
            };
            if !ok {
                failures.push(format!(
                    "{name}: {statuses:?}, closed: {}",
                    ex.closed_after.is_some()
                ));
            }
        } else if statuses.len() != may_forward.len() || statuses.iter().any(|s| *s != 200) {
            failures.push(format!(
                "{name}: {statuses:?}, expected {} × 200",
                may_forward.len()
            ));
        }
        if may_forward.len() == 1 && ex.closed_after.is_none() {
            failures.push(format!(
                "{name}: ambiguous framing must close the connection"
            ));
        }
    }
    let mut seen = rig.seen.bodies()[seen_before..].to_vec();
    seen.sort();
    expected_upstream.sort();
    eprintln!(
        "smuggling: the upstream saw {} requests: {seen:?}",
        seen.len()
    );
    if seen != expected_upstream {
        failures.push(format!(
            "upstream saw {seen:?}, expected {expected_upstream:?}"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    rig.assert_alive();
}

// ---------------------------------------------------------------------------------------
// HTTP/2 rapid reset.

/// Opens `n` streams on one h2c connection, resetting each at once. Returns how many were
/// sent before the server ended the connection, and how it ended.
async fn rapid_reset(addr: SocketAddr, n: usize, complete: bool) -> (usize, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut sent = 0;
    let mut ended = String::from("still open");
    // Dropped before the connection is awaited: the connection ends with its last handle.
    let mut handle = Some(client);
    for _ in 0..n {
        let Some(client) = handle.take() else { break };
        let mut client = match tokio::time::timeout(Duration::from_secs(5), client.ready()).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                ended = format!("{e}");
                break;
            }
            Err(_) => {
                ended = "no stream capacity for 5 s".to_owned();
                break;
            }
        };
        let req = if complete {
            Request::get(format!("http://{addr}/v1/models"))
                .body(())
                .unwrap()
        } else {
            Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(())
                .unwrap()
        };
        match client.send_request(req, complete) {
            Ok((resp, mut stream)) => {
                stream.send_reset(h2::Reason::CANCEL);
                drop(resp);
                sent += 1;
            }
            Err(e) => {
                ended = format!("{e}");
                break;
            }
        }
        handle = Some(client);
    }
    drop(handle);
    if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(5), conn).await {
        ended = format!("{ended}; connection: {e}");
    }
    (sent, ended)
}

#[test]
fn http2_rapid_reset_keeps_the_sidecar_up_with_bounded_memory() {
    const STREAMS: usize = 5_000;
    const BOUND_KIB: u64 = 32 * MIB;
    let rig = Rig::start("rapid-reset", &[]);
    rig.warm_up();
    let addr = rig.listen;
    let (rss0, fds0) = (rig.rss_kib(), rig.fds());
    let seen_before = rig.seen.count();
    let (runs, others, rss1) = rig.rt.block_on(async {
        // Meanwhile a well-behaved client keeps making requests over HTTP/1.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let bystander = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let client = client();
                let url = format!("http://{addr}/v1/chat/completions");
                let mut out = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    let (status, _) = post(&client, &url, CHAT).await;
                    out.push((status, t.elapsed()));
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                out
            })
        };
        let mut runs = Vec::new();
        // Streams reset before their body: the classic rapid reset. Then complete requests
        // reset right after they are sent. Two connections of each, one after the other.
        for complete in [false, false, true, true] {
            let t = Instant::now();
            let (sent, ended) = rapid_reset(addr, STREAMS, complete).await;
            runs.push((complete, sent, ended, t.elapsed()));
        }
        let rss1 = rss_kib(rig.pid()).unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (runs, bystander.await.unwrap(), rss1)
    });
    for (complete, sent, ended, took) in &runs {
        eprintln!(
            "rapid reset ({}): {sent} streams opened and reset in {:.1} s; ended: {ended}",
            if *complete {
                "complete GET /v1/models"
            } else {
                "POST reset before its body"
            },
            took.as_secs_f64()
        );
    }
    let grown = rss1.saturating_sub(rss0);
    let ok = others.iter().filter(|(s, _)| *s == 200).count();
    let slowest = others.iter().map(|(_, d)| *d).max().unwrap_or_default();
    eprintln!(
        "rapid reset: sidecar RSS {rss0} -> {rss1} KiB (+{grown} KiB, bound {BOUND_KIB} KiB); \
         bystander: {ok}/{} requests 200, slowest {} ms; upstream saw {}",
        others.len(),
        slowest.as_millis(),
        rig.seen.count() - seen_before
    );
    assert!(grown <= BOUND_KIB, "RSS grew by {grown} KiB");
    assert!(
        !others.is_empty() && ok == others.len(),
        "the bystander was not served: {others:?}"
    );
    assert_eq!(
        rig.seen.count(),
        seen_before + ok,
        "only the bystander's requests reached the upstream"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig.fds() > fds0 + 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(rig.fds() <= fds0 + 5, "sockets left open");
    rig.assert_alive();
}

// ---------------------------------------------------------------------------------------
// The connection limit.

#[test]
fn clients_beyond_max_connections_wait_and_are_served_when_a_slot_frees() {
    const LIMIT: usize = 50;
    let rig = Rig::start("limit", &["--max-connections", "50"]);
    let addr = rig.listen;
    rig.rt.block_on(async {
        let mut hogs = Vec::new();
        for _ in 0..LIMIT {
            hogs.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Over the limit: the TCP handshake completes (the kernel's backlog) but the request
        // is not served while every slot is taken.
        let url = format!("http://{addr}/v1/chat/completions");
        let waiting = tokio::spawn(async move {
            let t = Instant::now();
            let (status, _) = post(&client(), &url, CHAT).await;
            (status, t.elapsed())
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "served beyond the connection limit");
        let t = Instant::now();
        hogs.truncate(LIMIT - 5);
        let (status, _) = waiting.await.unwrap();
        eprintln!(
            "limit: with {LIMIT} connections held the next client waited; served {} ms after 5 closed",
            t.elapsed().as_millis()
        );
        assert_eq!(status, 200);
        assert!(t.elapsed() < Duration::from_secs(2));
    });
}
