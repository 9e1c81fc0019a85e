//! A real `redis-server` (Debian package `redis-server`) for the tests of the shared rate
//! limits: started on a free loopback port with persistence off, killed (SIGKILL, as a
//! crashed or unreachable server) and restarted on the same port, stopped when dropped.
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
        let mut server = Self { port, child: None };
        server.restart();
        server
    }

    /// `host:port`, as `rateLimit.redis.address` takes it.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port, empty, and waits until it answers `PING`.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut child = Command::new(redis_server_binary())
                .args([
                    "--port",
                    &self.port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                ])
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

    /// Whether the server answers `PING` with `+PONG`.
    pub fn ping(&self) -> bool {
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

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
