//! A tiny blocking HTTP/1.1 client for control-plane calls of the orchestrators: readiness
//! probes, `/metrics` scrapes and one-off smoke requests to the peers.
//!
//! These calls happen between measured runs, from the main thread, so a blocking
//! `std::net::TcpStream` with `Connection: close` is simpler than entering an async runtime,
//! and it cannot disturb the runtime that carries the load. Only loopback targets are used.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Largest response body read (metrics pages are a few KiB).
const MAX_BODY: usize = 8 * 1024 * 1024;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Connecting, writing or reading failed.
    #[error("{addr}: {source}")]
    Io {
        /// Target.
        addr: SocketAddr,
        /// OS error.
        source: std::io::Error,
    },
    /// The response was not parseable HTTP/1.x.
    #[error("{addr}: malformed HTTP response: {reason}")]
    Malformed {
        /// Target.
        addr: SocketAddr,
        /// What was wrong.
        reason: String,
    },
}

/// A complete response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Header lines as `(lower-case name, value)`.
    pub headers: Vec<(String, String)>,
    /// Body (de-chunked).
    pub body: Vec<u8>,
}

impl Response {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// First header value by lower-case name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` on `addr`.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<Response, FetchError> {
    request(addr, "GET", path, &[], None, timeout)
}

/// `POST path` with a JSON body.
pub fn post_json(
    addr: SocketAddr,
    path: &str,
    headers: &[(String, String)],
    body: &str,
    timeout: Duration,
) -> Result<Response, FetchError> {
    request(addr, "POST", path, headers, Some(body), timeout)
}

/// One request on a fresh connection; reads until the server closes it.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response, FetchError> {
    let io = |source| FetchError::Io { addr, source };
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "content-type: application/json\r\ncontent-length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    s.write_all(req.as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    s.take(MAX_BODY as u64 + 64 * 1024)
        .read_to_end(&mut raw)
        .map_err(io)?;
    parse_response(&raw).map_err(|reason| FetchError::Malformed { addr, reason })
}

fn parse_response(raw: &[u8]) -> Result<Response, String> {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..head_end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or("empty response")?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &raw[head_end + 4..];
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        dechunk(rest)?
    } else {
        match headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok())
        {
            Some(len) => rest[..len.min(rest.len())].to_vec(),
            None => rest.to_vec(),
        }
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk size")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size_hex = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| format!("bad chunk size {size_hex:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size {
            // The server closed mid-chunk; keep what arrived.
            out.extend_from_slice(rest);
            return Ok(out);
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or(&[]);
        if out.len() > MAX_BODY {
            return Err("body too large".to_owned());
        }
    }
}

/// Sum of every sample of Prometheus metric `name` whose label set contains all of `labels`
/// (given as `key="value"` fragments); `None` when the metric is absent.
pub fn prometheus_sum(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_part, value) = if let Some(r) = rest.strip_prefix('{') {
            match r.split_once('}') {
                Some((l, v)) => (l, v),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            // A longer metric name sharing the prefix.
            continue;
        };
        if !labels.iter().all(|l| label_part.contains(l)) {
            continue;
        }
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            found = true;
            sum += v;
        }
    }
    found.then_some(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_bodies() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").expect("ok");
        assert_eq!((r.status, r.text().as_str()), (200, "hello"));
        let r = parse_response(
            b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .expect("ok");
        assert_eq!((r.status, r.text().as_str()), (503, "abcde"));
        assert_eq!(r.header("x-a"), Some("b"));
        assert!(parse_response(b"garbage").is_err());
    }

    #[test]
    fn sums_prometheus_samples_by_label() {
        let text = "# HELP x\n\
            tailwarden_hedges_total{route=\"demo\",outcome=\"started\"} 12\n\
            tailwarden_hedges_total{route=\"demo\",outcome=\"won\"} 5\n\
            tailwarden_hedges_total_other 99\n\
            tailwarden_retries_total{route=\"demo\",provider=\"p\",reason=\"5xx\"} 3\n\
            tailwarden_retries_total{route=\"demo\",provider=\"p\",reason=\"429\"} 4\n";
        assert_eq!(
            prometheus_sum(text, "tailwarden_hedges_total", &["\"started\""]),
            Some(12.0)
        );
        assert_eq!(
            prometheus_sum(text, "tailwarden_retries_total", &[]),
            Some(7.0)
        );
        assert_eq!(prometheus_sum(text, "absent_total", &[]), None);
    }
}
