//! Connections to providers: one pooled hyper client per provider origin.
//!
//! Keep-alive pooling is the first fix of every seed document (connection set-up is a large
//! part of an LLM call's tail). Each client has TCP_NODELAY, a connect timeout, HTTP/2 when
//! the provider offers it over TLS (ALPN), an idle-connection expiry driven by a tokio timer
//! (without a pool timer hyper never expires idle connections), a caching DNS resolver, and
//! a semaphore that caps concurrent requests at `maxConnections` (for HTTP/1 that is the
//! connection count).
//! Clients are cached across config reloads, so a reload never throws warm connections away.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{Either, Full, Limited};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use tokio::sync::Semaphore;

use super::{Registry, dns::CachingResolver};

/// The request body type sent upstream: the (possibly rewritten) client body in memory, or
/// a pass-through body streamed as it arrives (bounded).
pub type UpstreamBody = Either<Full<Bytes>, Limited<Incoming>>;
/// A pooled client.
pub type HttpClient = Client<HttpsConnector<HttpConnector<CachingResolver>>, UpstreamBody>;

/// How long an unused pooled connection is kept. Providers close idle connections after
/// 60–120 s; closing ours first avoids sending on a connection the server is closing.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(50);

/// A provider's client and its concurrency cap.
#[derive(Clone)]
pub struct Pool {
    pub client: HttpClient,
    pub limit: Arc<Semaphore>,
    pub max_connections: u32,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool(max {})", self.max_connections)
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    origin: String,
    connect_timeout: Duration,
    max_connections: u32,
}

/// Clients shared across config reloads, keyed by origin and connection settings.
#[derive(Default)]
pub struct PoolCache {
    pools: Registry<PoolKey, (), Pool>,
}

impl std::fmt::Debug for PoolCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolCache")
    }
}

impl PoolCache {
    /// The pool for an origin (`scheme://host:port`), created on first use.
    pub fn get(&self, origin: &str, connect_timeout: Duration, max_connections: u32) -> Pool {
        let key = PoolKey {
            origin: origin.to_owned(),
            connect_timeout,
            max_connections,
        };
        self.pools.get_or_build(&key, &(), || Pool {
            client: build_client(connect_timeout, max_connections),
            limit: Arc::new(Semaphore::new(max_connections as usize)),
            max_connections,
        })
    }

    /// Drops pools no longer used by the current config.
    pub fn retain(&self, in_use: &[(String, Duration, u32)]) {
        self.pools.retain(|k| {
            in_use.iter().any(|(o, c, m)| {
                *o == k.origin && *c == k.connect_timeout && *m == k.max_connections
            })
        });
    }
}

fn build_client(connect_timeout: Duration, max_connections: u32) -> HttpClient {
    let mut http = HttpConnector::new_with_resolver(CachingResolver::default());
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(30)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(max_connections as usize)
        .build(https)
}
