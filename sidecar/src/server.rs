//! Accepting client connections: HTTP/1.1 and h2c on one loopback port, with graceful drain.
//!
//! On shutdown the listener stops accepting, idle connections close, and in-flight requests
//! (streams included) get up to the grace period to finish before the process exits.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use hyper::{Request, body::Incoming, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
};
use tokio::net::TcpListener;

use crate::proxy::{App, handle};

/// Longest time a client may take to send request headers (slowloris protection).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest HTTP/1 read buffer: bounds the size of request headers.
pub const MAX_HEADER_BUFFER: usize = 64 * 1024;

/// Serves client connections until `shutdown` completes, then drains for up to `grace`.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
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
        .max_concurrent_streams(1024)
        .max_pending_accept_reset_streams(Some(64));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
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
                let service = service_fn(move |req: Request<Incoming>| {
                    let app = app.clone();
                    async move { Ok::<_, Infallible>(handle(app, req).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "client connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections drained"),
        () = tokio::time::sleep(grace) => tracing::warn!(grace_s = grace.as_secs(), "drain grace period over; closing remaining connections"),
    }
}
