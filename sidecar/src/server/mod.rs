//! Accepting client connections: HTTP/1.1 and h2c on one loopback port, with graceful drain.
//!
//! On shutdown the listener stops accepting, idle connections close, and in-flight requests
//! (streams included) get up to the grace period to finish before the process exits.
//!
//! Hostile or broken clients are bounded here, before any request reaches the proxy:
//!
//! * a connection must show which protocol it speaks (its first bytes: an HTTP/1 request
//!   line, or the HTTP/2 preface) within [`HEADER_READ_TIMEOUT`]. hyper-util's protocol
//!   detection has no deadline of its own, so without this a connection that sends nothing
//!   (or part of the HTTP/2 preface) would hold a socket and its task forever;
//! * HTTP/1 request headers must then arrive within [`HEADER_READ_TIMEOUT`] (slowloris), and
//!   fit in [`MAX_HEADER_BUFFER`] bytes (else 431). hyper rejects ambiguous framing
//!   (differing `Content-Length`s, obs-fold, bad chunk sizes, ...) with a 400, and frames a
//!   request with both `Content-Length` and `Transfer-Encoding` by the latter and then
//!   closes the connection, so no smuggled request behind it is ever parsed;
//! * HTTP/2 connections get a stream limit and hyper's rapid-reset defences (a GOAWAY when a
//!   client resets too many streams before they are served). hyper has no header deadline
//!   and no idle timeout for HTTP/2, so a connection with no request in flight for
//!   [`HTTP2_IDLE_TIMEOUT`] gets a GOAWAY, and is dropped if it is still open and idle one
//!   period later (a client that never acknowledges the GOAWAY's PING);
//! * at most `max_connections` client connections are served at once; further clients wait
//!   in the listen backlog rather than being served with memory the sidecar does not have.
//!
//! Request bodies are bounded by the proxy (`limits.maxBodyBytes`, and a 30 s body timeout).

pub mod admin;

use std::{
    convert::Infallible,
    future::Future,
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::{Request, body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulConnection},
};
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{Notify, Semaphore, watch},
};

use crate::{app::App, ingress::handle};

/// Longest time a client may take to send request headers (slowloris protection). A new
/// connection gets this long for its first bytes too (see [`sniff`]).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest HTTP/1 read buffer: bounds the size of request headers.
pub const MAX_HEADER_BUFFER: usize = 64 * 1024;
/// How long an HTTP/2 connection may stay open without a request in flight (idle, or a
/// client dribbling a HEADERS frame). The same as HTTP/1, where hyper starts the header
/// deadline again after each response.
pub const HTTP2_IDLE_TIMEOUT: Duration = HEADER_READ_TIMEOUT;
/// Default for `--max-connections`: far above what one app opens to a loopback proxy (the
/// OpenAI Python SDK pools at most 1 000), low enough to bound the memory of leaked
/// connections (about 14–22 KiB each when idle).
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Concurrent streams per HTTP/2 connection.
const MAX_CONCURRENT_STREAMS: u32 = 1024;
/// Streams an HTTP/2 client may reset before the server has accepted them; beyond it the
/// connection gets a GOAWAY (the "rapid reset" attack, CVE-2023-44487).
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 64;
/// The HTTP/2 connection preface; what hyper-util's protocol detection compares against.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves client connections until `shutdown` completes, then drains for up to `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    serve_with_limit(listener, app, shutdown, grace, DEFAULT_MAX_CONNECTIONS).await;
}

/// [`serve`] with at most `max_connections` client connections open at once.
pub async fn serve_with_limit(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    max_connections: usize,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEADER_BUFFER);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS));
    // Drain signal: every connection task holds a receiver until it ends, so the drain is
    // over when the sender sees no receiver left.
    let (drain_tx, drain_rx) = watch::channel(false);
    // A permit per open connection, released when its task ends. While none is free the
    // loop does not accept: new clients queue in the kernel's backlog and are served as
    // soon as a connection closes (idle connections close after HEADER_READ_TIMEOUT).
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break, // never closed
            },
            () = &mut shutdown => break,
        };
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // EMFILE and friends: back off briefly instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                let builder = builder.clone();
                let drain = drain_rx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let Some(io) = sniff(stream, HEADER_READ_TIMEOUT).await else {
                        tracing::debug!("client connection closed: no request line or HTTP/2 preface in time");
                        return;
                    };
                    let h2 = io.prefix.starts_with(H2_PREFACE);
                    let in_flight = Arc::new(InFlight::default());
                    let service = {
                        let in_flight = in_flight.clone();
                        service_fn(move |req: Request<Incoming>| {
                            let app = app.clone();
                            // Held by the response body: a stream is in flight until hyper
                            // has sent its last byte (or dropped it on a reset).
                            let guard = InFlight::enter(&in_flight);
                            async move {
                                let response = handle(app, req).await;
                                Ok::<_, Infallible>(response.map(|body| Tracked { body, _guard: guard }))
                            }
                        })
                    };
                    let conn = builder.serve_connection(TokioIo::new(io), service);
                    drive(conn, drain, h2.then_some(in_flight)).await;
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    drop(drain_rx);
    let _ = drain_tx.send(true);
    tokio::select! {
        () = drain_tx.closed() => tracing::info!("all connections drained"),
        () = tokio::time::sleep(grace) => tracing::warn!(grace_s = grace.as_secs(), "drain grace period over; closing remaining connections"),
    }
}

/// Runs one client connection to its end: a graceful close (GOAWAY for HTTP/2, close after
/// the current response for HTTP/1) when the drain starts or, for HTTP/2 (`idle` given),
/// after [`HTTP2_IDLE_TIMEOUT`] without a request in flight; dropped when still idle one
/// period after that.
async fn drive<C>(conn: C, mut drain: watch::Receiver<bool>, idle: Option<Arc<InFlight>>)
where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "client connection ended with an error");
                }
                return;
            }
            changed = drain.changed(), if !closing => {
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
                closing = true;
            }
            () = idle_for(idle.as_deref(), HTTP2_IDLE_TIMEOUT), if idle.is_some() => {
                if closing {
                    tracing::debug!("closing an HTTP/2 connection still idle after its GOAWAY");
                    return;
                }
                tracing::debug!("HTTP/2 connection idle: GOAWAY");
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
}

/// Requests in flight on one connection.
#[derive(Default)]
struct InFlight {
    count: AtomicUsize,
    changed: Notify,
}

impl InFlight {
    fn enter(this: &Arc<Self>) -> InFlightGuard {
        this.count.fetch_add(1, Ordering::SeqCst);
        this.changed.notify_waiters();
        InFlightGuard(this.clone())
    }
}

struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// Resolves once nothing has been in flight for `period` in a row (never when `None`).
async fn idle_for(in_flight: Option<&InFlight>, period: Duration) {
    let Some(in_flight) = in_flight else {
        return std::future::pending().await;
    };
    loop {
        let changed = in_flight.changed.notified();
        tokio::pin!(changed);
        // Registered before the count is read, so a change in between is not missed.
        changed.as_mut().enable();
        if in_flight.count.load(Ordering::SeqCst) == 0 {
            tokio::select! {
                () = tokio::time::sleep(period) => return,
                () = changed => {}
            }
        } else {
            changed.await;
        }
    }
}

/// A response body that keeps its request counted as in flight until hyper drops it.
struct Tracked<B> {
    body: B,
    _guard: InFlightGuard,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Reads a new connection's first bytes, until they either are the whole HTTP/2 preface or
/// differ from it (HTTP/1), within `limit`. `None` when the client sent nothing useful in
/// time or closed: the connection is then dropped. The bytes read are handed back to hyper,
/// whose own detection then completes at once.
async fn sniff(mut stream: TcpStream, limit: Duration) -> Option<Rewound> {
    let mut buf = BytesMut::with_capacity(H2_PREFACE.len());
    let detect = async {
        while buf.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(&buf) {
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        true
    };
    match tokio::time::timeout(limit, detect).await {
        Ok(true) => Some(Rewound {
            prefix: buf.freeze(),
            inner: stream,
        }),
        _ => None,
    }
}

/// A client connection whose first bytes were already read by [`sniff`]: reads return them
/// first, then read the socket. Writes go straight to the socket.
struct Rewound {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Rewound {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = TcpStream::connect(addr).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        (client, server)
    }

    #[tokio::test]
    async fn http1_is_detected_from_its_first_differing_byte_and_replayed() {
        let (mut client, server) = pair().await;
        client
            .write_all(b"GET /v1/models HTTP/1.1\r\n")
            .await
            .expect("write");
        let mut io = sniff(server, Duration::from_secs(2))
            .await
            .expect("detected");
        let mut got = vec![0u8; 25];
        io.read_exact(&mut got).await.expect("replayed then read");
        assert_eq!(got, b"GET /v1/models HTTP/1.1\r\n");
    }

    #[tokio::test]
    async fn the_whole_http2_preface_is_waited_for() {
        let (mut client, server) = pair().await;
        client.write_all(&H2_PREFACE[..10]).await.expect("write");
        let sniffing = tokio::spawn(sniff(server, Duration::from_secs(2)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&H2_PREFACE[10..]).await.expect("write");
        let mut io = sniffing.await.expect("join").expect("detected");
        let mut got = vec![0u8; H2_PREFACE.len()];
        io.read_exact(&mut got).await.expect("replayed");
        assert_eq!(got, H2_PREFACE);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_means_nothing_in_flight_for_a_whole_period() {
        let in_flight = Arc::new(InFlight::default());
        let request = InFlight::enter(&in_flight);
        let idle = tokio::spawn({
            let in_flight = in_flight.clone();
            async move {
                idle_for(Some(&in_flight), Duration::from_secs(10)).await;
                tokio::time::Instant::now()
            }
        });
        // A long stream is not idleness.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!idle.is_finished());
        let finished = tokio::time::Instant::now();
        drop(request);
        // A second request shortly after restarts the period.
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(InFlight::enter(&in_flight));
        let at = idle.await.expect("join");
        assert_eq!(at - finished, Duration::from_secs(15));
    }

    #[tokio::test]
    async fn silence_or_a_stalled_preface_is_dropped_at_the_deadline() {
        let (_silent, server) = pair().await;
        assert!(sniff(server, Duration::from_millis(100)).await.is_none());
        let (mut partial, server) = pair().await;
        partial.write_all(b"PRI * HTTP").await.expect("write");
        assert!(sniff(server, Duration::from_millis(100)).await.is_none());
        let (closed, server) = pair().await;
        drop(closed);
        assert!(sniff(server, Duration::from_secs(2)).await.is_none());
    }
}
