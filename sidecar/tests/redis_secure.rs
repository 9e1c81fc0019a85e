//! The shared backend the way managed Redis runs: Debian's `redis-server` started by each
//! test TLS-only with `requirepass` (and, where a test says so, client certificates
//! required), with certificates the test makes (a CA, server and client certificates, and a
//! CA nobody should trust).
//!
//! Over TLS with AUTH the buckets work and the connection comes back after a restart; a
//! wrong password, an untrusted CA, a certificate for another name, a missing client
//! certificate or a plain port each give one clear error, logged once, counted under its
//! `reason`, and the route's `failMode`. Every password used here is a canary: it must never
//! appear in what the sidecar logs (every level, redis-rs's own records included) or in an
//! error.
#![allow(clippy::unwrap_used)]

mod common;

use std::{
    io::Write,
    path::Path,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use common::redis::{RedisServer, Secure};
use serde_json::{Value, json};
use tailwarden_crds::{RateLimit, Redis};
use tailwarden_sidecar::state::{
    limits::{LimitKind, LimiterOptions, Rejection, RouteLimiter, admit},
    redis::{BackendError, BackendSettings, BucketSpec, RedisBackend, RedisTarget},
};
use tokio::time::Instant;

/// Everything logged by this test binary, at every level.
fn logs() -> String {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    let buf = BUF.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = buf.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || LogWriter(writer.clone()))
            .try_init();
        buf
    });
    String::from_utf8_lossy(&buf.lock().unwrap()).into_owned()
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Asserts that no canary appears in the logs or in `errors`.
fn assert_never_shown(canaries: &[&str], errors: &[&BackendError]) {
    let logs = logs();
    for canary in canaries {
        assert!(!logs.contains(canary), "a password was logged:\n{logs}");
        for e in errors {
            assert!(!e.to_string().contains(canary) && !format!("{e:?}").contains(canary));
        }
    }
}

/// Generous bounds: these tests are about what happens, not how fast (TLS handshakes of a
/// debug build on a busy machine).
fn settings() -> BackendSettings {
    BackendSettings {
        op_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(5),
        retry_interval: Duration::from_millis(200),
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// `spec.rateLimit.redis` from JSON, turned into a target.
fn target(redis: &Value) -> RedisTarget {
    let redis: Redis = serde_json::from_value(redis.clone()).unwrap();
    RedisTarget::of_limit(&redis).unwrap()
}

/// The server's password in a file (with the newline a Secret file often has), and the
/// `redis` part of a route trusting `ca`, with the client certificate when the server
/// requires one.
fn secure_spec(server: &RedisServer, password_file: &str, ca: &Path) -> Value {
    let s = server.secure().unwrap();
    let mut tls = json!({"ca": {"file": path(ca)}});
    if s.require_client_cert {
        tls["clientCertificate"] =
            json!({"certFile": path(&s.client_cert), "keyFile": path(&s.client_key)});
    }
    json!({"address": server.address(), "auth": {"password": {"file": password_file}}, "tls": tls})
}

fn counter() -> prometheus::IntCounterVec {
    prometheus::IntCounterVec::new(prometheus::Opts::new("errors", "errors"), &["reason"]).unwrap()
}

fn bucket(key: &str) -> BucketSpec {
    BucketSpec {
        key: format!("tailwarden:test:{key}"),
        amount: 60_000,
        period: Duration::from_secs(60),
    }
}

/// The first call: it waits for the set-up the backend started when built.
async fn first_failure(backend: &RedisBackend) -> BackendError {
    backend
        .take(&bucket("x"), 10, 100, |_| {})
        .await
        .unwrap_err()
}

fn count_of(logs: &str, needle: &str) -> usize {
    logs.matches(needle).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_a_password_and_a_client_certificate_buckets_work() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-1f9c2e";
    let server = RedisServer::start_secure(Secure::new(PASSWORD, true));
    let s = server.secure().unwrap();
    let password = write(&s.dir, "password", &format!("{PASSWORD}\n"));
    let mut spec = secure_spec(&server, &password, &s.ca);
    // The ACL user of a server configured with requirepass.
    spec["auth"]["username"] = json!("default");
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    assert!(backend.target().is_tls());

    let b = bucket("tls");
    let grant = backend.take(&b, 100, 1_000, |_| {}).await.unwrap();
    assert!(
        (100..=1_000).contains(&grant.granted),
        "{grant:?}: a full bucket grants a lease"
    );
    backend.give(&b, grant.granted).await.unwrap();
    let again = backend.take(&b, 100, 1_000, |_| {}).await.unwrap();
    assert!(again.granted >= 100, "{again:?}");
    assert!(backend.is_connected());
    assert_eq!(backend.backend_errors(), 0);
    // Shared state really is on the server: another replica's connection sees the bucket.
    let other = RedisBackend::with_target(target(&spec), settings(), None);
    let seen = other.take(&b, 1, 1, |_| {}).await.unwrap();
    assert!(seen.remaining < 60_000, "{seen:?}");
    // And the cache's commands, over the same kind of connection.
    backend
        .set_bytes("tailwarden:test:v", b"value", Duration::from_secs(10))
        .await
        .unwrap();
    let (value, ttl) = other.get_bytes("tailwarden:test:v").await.unwrap().unwrap();
    assert_eq!(value, b"value");
    assert!(ttl > Duration::ZERO && ttl <= Duration::from_secs(10));
    assert!(errors.with_label_values(&["auth"]).get() == 0);
    assert_never_shown(&[PASSWORD], &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_one_clear_error_counted_as_auth_and_never_shown() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-7d41aa";
    const WRONG: &str = "canary-wrong-52be0c";
    let server = RedisServer::start_secure(Secure::new(PASSWORD, false));
    let s = server.secure().unwrap();
    let wrong = write(&s.dir, "wrong", WRONG);
    let spec = secure_spec(&server, &wrong, &s.ca);
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    let e = first_failure(&backend).await;
    // The caller is told the backend is down; the set-up's own error says why.
    assert!(matches!(e, BackendError::Down { .. }), "{e}");
    assert_eq!(errors.with_label_values(&["auth"]).get(), 1);
    assert!(backend.is_down());
    // Once the retry interval passed, the next call tries again: the same failure is
    // counted again but not logged again.
    tokio::time::sleep(settings().retry_interval).await;
    let e2 = first_failure(&backend).await;
    assert_eq!(errors.with_label_values(&["auth"]).get(), 2);
    let logs = logs();
    let line = logs
        .lines()
        .find(|l| l.contains(&server.address()) && l.contains("refused the password"))
        .unwrap_or_else(|| panic!("no clear error in the log:\n{logs}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("check auth.password"), "{line}");
    assert_eq!(
        count_of(
            &logs,
            &format!("{}: the server refused the password", server.address())
        ),
        1,
        "the same failure is logged once:\n{logs}"
    );
    assert_never_shown(&[PASSWORD, WRONG], &[&e, &e2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_password_the_server_says_one_is_required() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-0c77d3";
    let server = RedisServer::start_secure(Secure::new(PASSWORD, false));
    let s = server.secure().unwrap();
    let spec = json!({"address": server.address(), "tls": {"ca": {"file": path(&s.ca)}}});
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    // Found at the connection's set-up, before any request's command.
    let e = first_failure(&backend).await;
    assert!(matches!(e, BackendError::Down { .. }), "{e}");
    assert_eq!(errors.with_label_values(&["auth"]).get(), 1, "{}", logs());
    let logs = logs();
    assert!(
        logs.lines().any(|l| l.contains(&server.address())
            && l.contains("the server requires a password")
            && l.contains("set auth.password")),
        "{logs}"
    );
    assert_never_shown(&[PASSWORD], &[&e]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_ca_fails_the_handshake_with_one_clear_error() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-a3e9f0";
    let server = RedisServer::start_secure(Secure::new(PASSWORD, false));
    let s = server.secure().unwrap();
    let password = write(&s.dir, "password", PASSWORD);
    let spec = secure_spec(&server, &password, &s.untrusted_ca);
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    let e = first_failure(&backend).await;
    assert!(matches!(e, BackendError::Down { .. }), "{e}");
    assert_eq!(errors.with_label_values(&["tls"]).get(), 1);
    let logs = logs();
    assert!(
        logs.lines().any(|l| l.contains(&server.address())
            && l.contains("the server's certificate is not trusted")
            && l.contains("set tls.ca")),
        "{logs}"
    );
    assert_never_shown(&[PASSWORD], &[&e]);
    // The right CA, same server: it works (the failure was the trust, nothing else).
    let good = RedisBackend::with_target(
        target(&secure_spec(&server, &password, &s.ca)),
        settings(),
        None,
    );
    good.take(&bucket("trusted"), 1, 1, |_| {}).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_certificate_must_carry_the_name_unless_server_name_names_one_it_carries() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-5b0d18";
    let server = RedisServer::start_secure(Secure::new(PASSWORD, false));
    let s = server.secure().unwrap();
    let password = write(&s.dir, "password", PASSWORD);
    let mut spec = secure_spec(&server, &password, &s.ca);
    spec["tls"]["serverName"] = json!("redis.example.internal");
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    first_failure(&backend).await;
    assert_eq!(errors.with_label_values(&["tls"]).get(), 1);
    let logs = logs();
    assert!(
        logs.contains("is not valid for redis.example.internal")
            && logs.contains("set tls.serverName"),
        "{logs}"
    );
    // The certificate is for localhost (and 127.0.0.1).
    spec["tls"]["serverName"] = json!("localhost");
    let named = RedisBackend::with_target(target(&spec), settings(), None);
    named.take(&bucket("named"), 1, 1, |_| {}).await.unwrap();
    assert_never_shown(&[PASSWORD], &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_requires_client_certificates_refuses_a_sidecar_without_one() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-e6612b";
    let server = RedisServer::start_secure(Secure::new(PASSWORD, true));
    let s = server.secure().unwrap();
    let password = write(&s.dir, "password", PASSWORD);
    let mut spec = secure_spec(&server, &password, &s.ca);
    spec["tls"]
        .as_object_mut()
        .unwrap()
        .remove("clientCertificate");
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    let e = first_failure(&backend).await;
    assert_eq!(errors.with_label_values(&["tls"]).get(), 1, "{e}");
    let logs = logs();
    assert!(
        logs.lines()
            .any(|l| l.contains(&server.address()) && l.contains("tls.clientCertificate")),
        "{logs}"
    );
    assert_never_shown(&[PASSWORD], &[&e]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_to_a_plain_port_says_the_server_does_not_speak_tls() {
    logs(); // captures from here on
    let server = RedisServer::start();
    let spec = json!({"address": format!("rediss://{}", server.address())});
    let errors = counter();
    // A plain port reads the ClientHello as the start of a command and waits for the rest:
    // the handshake ends with the set-up's timeout, shortened here.
    let settings = BackendSettings {
        connect_timeout: Duration::from_millis(500),
        ..settings()
    };
    let backend = RedisBackend::with_target(target(&spec), settings, Some(errors.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while errors.with_label_values(&["timeout"]).get() == 0 {
        assert!(Instant::now() < deadline, "{}", logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!backend.is_connected());
    let logs = logs();
    assert!(
        logs.lines().any(|l| l.contains(&server.address())
            && (l.contains("does not speak TLS") || l.contains("is this a TLS port"))),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_password_file_is_a_secret_error() {
    logs(); // captures from here on
    let server = RedisServer::start_secure(Secure::new("canary-pw-98a1c4", false));
    let s = server.secure().unwrap();
    let spec = secure_spec(&server, "/nonexistent/tailwarden/password", &s.ca);
    let errors = counter();
    let backend = RedisBackend::with_target(target(&spec), settings(), Some(errors.clone()));
    first_failure(&backend).await;
    assert_eq!(errors.with_label_values(&["secret"]).get(), 1);
    assert!(
        logs().contains("cannot read auth.password: file /nonexistent/tailwarden/password"),
        "{}",
        logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_connection_comes_back_after_a_restart_and_reads_a_rotated_password() {
    logs(); // captures from here on
    const PASSWORD: &str = "canary-pw-3c5e77";
    let mut server = RedisServer::start_secure(Secure::new(PASSWORD, false));
    let s = server.secure().unwrap();
    let password = write(&s.dir, "password", PASSWORD);
    let spec = secure_spec(&server, &password, &s.ca);
    let backend = RedisBackend::with_target(target(&spec), settings(), None);
    let b = bucket("restart");
    backend.take(&b, 1, 1, |_| {}).await.unwrap();
    server.kill();
    assert!(backend.take(&b, 1, 1, |_| {}).await.is_err());
    assert!(backend.is_down());
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.take(&b, 1, 1, |_| {}).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "no recovery after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The password file is read at every connect: a rotated Secret applies at the next one.
    std::fs::write(&password, "canary-rotated-wrong").unwrap();
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = logs();
        if logs
            .lines()
            .any(|l| l.contains(&server.address()) && l.contains("refused the password"))
        {
            break;
        }
        let _ = backend.take(&b, 1, 1, |_| {}).await;
        assert!(
            Instant::now() < deadline,
            "the rotated password was not used"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_never_shown(&[PASSWORD, "canary-rotated-wrong"], &[]);
}

/// A route's limiter whose backend's password is refused.
fn refused_limiter(
    server: &RedisServer,
    fail_mode: &str,
) -> (Arc<RouteLimiter>, Arc<RedisBackend>) {
    let s = server.secure().unwrap();
    let wrong = write(
        &s.dir,
        &format!("wrong-{fail_mode}"),
        "canary-wrong-failmode",
    );
    let mut redis = secure_spec(server, &wrong, &s.ca);
    redis["failMode"] = json!(fail_mode);
    let spec: RateLimit = serde_json::from_value(
        json!({"tokensPerMinute": 60_000, "backend": "redis", "redis": redis}),
    )
    .unwrap();
    let backend = Arc::new(RedisBackend::with_target(
        RedisTarget::of_limit(spec.redis.as_ref().unwrap()).unwrap(),
        settings(),
        None,
    ));
    let limiter = RouteLimiter::new(
        "shop/chat",
        &spec,
        LimiterOptions {
            backend: Some(backend.clone()),
            max_tenants: None,
        },
    )
    .unwrap();
    (Arc::new(limiter), backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_refused_password_the_route_follows_its_fail_mode() {
    logs(); // captures from here on
    let server = RedisServer::start_secure(Secure::new("canary-pw-44f0b9", false));
    let (closed, closed_backend) = refused_limiter(&server, "closed");
    let (open, open_backend) = refused_limiter(&server, "open");
    // Until both set-ups failed, a request may also be refused for a set-up still running.
    let deadline = Instant::now() + Duration::from_secs(10);
    while closed_backend.backend_errors() == 0 || open_backend.backend_errors() == 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused = admit(&closed, None, 100).await.map(|_| ()).unwrap_err();
    assert!(
        matches!(refused, Rejection::BackendDown { .. }),
        "{refused}"
    );
    assert_eq!(refused.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.limit(), LimitKind::Backend);
    // failMode open: admitted under the local limit, never refused for the backend.
    for _ in 0..20 {
        admit(&open, None, 100).await.unwrap().settle(100);
    }
    assert_never_shown(&["canary-pw-44f0b9", "canary-wrong-failmode"], &[]);
}
