//! A real `redis-server` (Debian package `redis-server`) for the tests of the shared rate
//! limits: started on a free loopback port with persistence off, killed (SIGKILL, as a
//! crashed or unreachable server) and restarted on the same port, stopped when dropped.
//!
//! [`RedisServer::start_secure`] starts it the way managed Redis runs: TLS only (no plain
//! port), `requirepass`, certificates made by the test (a CA, a server certificate for
//! 127.0.0.1, a client certificate, and a second CA nobody should trust), and optionally
//! client certificates required.
//!
//! The same approach as `sidecar/tests/limits_redis.rs`; `TAILWARDEN_REDIS_SERVER` points
//! at another binary.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A `redis-server` child process on 127.0.0.1, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    secure: Option<Secure>,
}

/// What a TLS + AUTH server was started with: its password and the PEM files the test made.
pub struct Secure {
    pub password: String,
    /// Whether clients must present a certificate signed by `ca`.
    pub require_client_cert: bool,
    pub dir: std::path::PathBuf,
    /// The CA that signed the server's and the client's certificates.
    pub ca: std::path::PathBuf,
    pub server_cert: std::path::PathBuf,
    pub server_key: std::path::PathBuf,
    pub client_cert: std::path::PathBuf,
    pub client_key: std::path::PathBuf,
    /// A CA that signed nothing here: trusting only it must fail the handshake.
    pub untrusted_ca: std::path::PathBuf,
}

/// A new CA: its PEM and the issuer that signs with it.
fn make_pki(common_name: &str) -> (String, rcgen::Issuer<'static, rcgen::KeyPair>) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), rcgen::Issuer::new(params, key))
}

/// A certificate for 127.0.0.1 and localhost signed by `issuer`, for a server or a client:
/// `(cert_pem, key_pem)`.
fn leaf(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, server: bool) -> (String, String) {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, SanType};
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    params
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    params.distinguished_name.push(
        DnType::CommonName,
        if server {
            "redis"
        } else {
            "tailwarden-sidecar"
        },
    );
    params.extended_key_usages = vec![if server {
        ExtendedKeyUsagePurpose::ServerAuth
    } else {
        ExtendedKeyUsagePurpose::ClientAuth
    }];
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Secure {
    /// Makes the certificates in a new directory.
    pub fn new(password: &str, require_client_cert: bool) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tw-redis-tls-{}-{}",
            std::process::id(),
            TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca_pem, issuer) = make_pki("tailwarden test CA");
        let (untrusted_pem, _) = make_pki("nobody's CA");
        let (server_cert, server_key) = leaf(&issuer, true);
        let (client_cert, client_key) = leaf(&issuer, false);
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        Self {
            password: password.to_owned(),
            require_client_cert,
            ca: write("ca.pem", &ca_pem),
            server_cert: write("server.pem", &server_cert),
            server_key: write("server.key", &server_key),
            client_cert: write("client.pem", &client_cert),
            client_key: write("client.key", &client_key),
            untrusted_ca: write("untrusted-ca.pem", &untrusted_pem),
            dir,
        }
    }
}

/// The server binary: `TAILWARDEN_REDIS_SERVER`, else the Debian package's.
pub fn redis_server_binary() -> String {
    if let Ok(path) = std::env::var("TAILWARDEN_REDIS_SERVER") {
        return path;
    }
    for candidate in ["/usr/bin/redis-server", "/usr/local/bin/redis-server"] {
        if std::path::Path::new(candidate).exists() {
            return candidate.to_owned();
        }
    }
    panic!(
        "redis-server not found: install the Debian package (apt-get install -y --no-install-recommends redis-server, `make system-deps`) or set TAILWARDEN_REDIS_SERVER"
    );
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers `PING`.
    pub fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = Self {
            port,
            child: None,
            secure: None,
        };
        server.restart();
        server
    }

    /// Starts a server that speaks only TLS (with `secure`'s certificates) and requires
    /// `secure.password`, and waits until it answers an authenticated `PING`.
    pub fn start_secure(secure: Secure) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = Self {
            port,
            child: None,
            secure: Some(secure),
        };
        server.restart();
        server
    }

    /// `host:port` (`rediss://host:port` for a TLS server), as `rateLimit.redis.address`
    /// takes it.
    pub fn address(&self) -> String {
        match self.secure {
            Some(_) => format!("rediss://127.0.0.1:{}", self.port),
            None => format!("127.0.0.1:{}", self.port),
        }
    }

    /// The TLS and AUTH settings, for a server started with [`Self::start_secure`].
    pub fn secure(&self) -> Option<&Secure> {
        self.secure.as_ref()
    }

    fn args(&self) -> Vec<String> {
        let port = self.port.to_string();
        let mut args: Vec<String> = match &self.secure {
            None => vec!["--port".into(), port],
            Some(s) => {
                let p = |p: &std::path::Path| p.display().to_string();
                vec![
                    "--port".into(),
                    "0".into(),
                    "--tls-port".into(),
                    port,
                    "--tls-cert-file".into(),
                    p(&s.server_cert),
                    "--tls-key-file".into(),
                    p(&s.server_key),
                    "--tls-ca-cert-file".into(),
                    p(&s.ca),
                    "--tls-auth-clients".into(),
                    (if s.require_client_cert { "yes" } else { "no" }).into(),
                    "--requirepass".into(),
                    s.password.clone(),
                ]
            }
        };
        for a in [
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ] {
            args.push(a.into());
        }
        args
    }

    /// (Re)starts the server on the same port, empty, and waits until it answers `PING`.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut child = Command::new(redis_server_binary())
                .args(self.args())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            // Until it answers, or exits (the port may still be held for a moment).
            loop {
                if self.ping() {
                    self.child = Some(child);
                    return;
                }
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "redis-server did not start on port {}",
                    self.port
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(
                Instant::now() < deadline,
                "redis-server kept exiting on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs one command with the Debian package's `redis-cli` (over TLS and authenticated,
    /// with a client certificate when required, for a secure server) and returns what it
    /// printed, or `None` when it could not run. The password goes through `REDISCLI_AUTH`,
    /// never the command line.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let mut cli = Command::new("redis-cli");
        cli.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(s) = &self.secure {
            cli.args(["--tls", "--cacert"])
                .arg(&s.ca)
                .arg("--no-auth-warning")
                .env("REDISCLI_AUTH", &s.password);
            if s.require_client_cert {
                cli.arg("--cert")
                    .arg(&s.client_cert)
                    .arg("--key")
                    .arg(&s.client_key);
            }
        }
        let out = cli
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether the server answers `PING` with `PONG` (through [`Self::cli`] for a secure
    /// server).
    pub fn ping(&self) -> bool {
        if self.secure.is_some() {
            return self.cli(&["ping"]).is_some_and(|o| o.starts_with("PONG"));
        }
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        if s.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// Kills the server at once (SIGKILL) and reaps it: its port and connections close with
    /// it, as when a Redis pod dies.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for Secure {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
