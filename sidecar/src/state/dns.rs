//! A caching DNS resolver for upstream connections.
//!
//! hyper's default resolver calls `getaddrinfo` on a blocking thread for every new
//! connection. New connections are exactly what a burst or a pool refill needs fast, so
//! answers are cached for [`TTL`]; when a lookup fails, a stale answer (up to
//! [`STALE_FOR`]) is used rather than failing connections during a resolver outage.

use std::{
    collections::HashMap,
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use hyper_util::client::legacy::connect::dns::Name;

/// How long an answer is used without asking again.
pub const TTL: Duration = Duration::from_secs(30);
/// How long a stale answer may stand in when the resolver fails.
pub const STALE_FOR: Duration = Duration::from_secs(300);

/// Host → (addresses, when they were looked up).
type Cache = HashMap<String, (Vec<SocketAddr>, Instant)>;

#[derive(Clone, Default)]
pub struct CachingResolver {
    cache: Arc<Mutex<Cache>>,
}

impl std::fmt::Debug for CachingResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CachingResolver")
    }
}

impl CachingResolver {
    fn cached(&self, host: &str, max_age: Duration) -> Option<Vec<SocketAddr>> {
        let cache = self.cache.lock().ok()?;
        let (addrs, at) = cache.get(host)?;
        (at.elapsed() < max_age).then(|| addrs.clone())
    }
}

type Lookup =
    Pin<Box<dyn Future<Output = Result<std::vec::IntoIter<SocketAddr>, io::Error>> + Send>>;

impl tower_service::Service<Name> for CachingResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = io::Error;
    type Future = Lookup;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let host = name.as_str().to_owned();
        if let Some(addrs) = self.cached(&host, TTL) {
            return Box::pin(async move { Ok(addrs.into_iter()) });
        }
        let this = self.clone();
        Box::pin(async move {
            let looked_up = tokio::net::lookup_host((host.as_str(), 0))
                .await
                .map(|found| found.collect::<Vec<SocketAddr>>());
            match looked_up {
                Ok(addrs) => {
                    if let Ok(mut cache) = this.cache.lock() {
                        cache.insert(host, (addrs.clone(), Instant::now()));
                    }
                    Ok(addrs.into_iter())
                }
                Err(e) => match this.cached(&host, STALE_FOR) {
                    Some(addrs) => {
                        tracing::warn!(host = %host, error = %e, "DNS lookup failed; using the last answer");
                        Ok(addrs.into_iter())
                    }
                    None => Err(e),
                },
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;
    use tower_service::Service;

    #[tokio::test]
    async fn answers_are_cached_and_reused() {
        let mut r = CachingResolver::default();
        let first: Vec<_> = r
            .call(Name::from_str("localhost").unwrap())
            .await
            .unwrap()
            .collect();
        assert!(!first.is_empty());
        assert!(r.cached("localhost", TTL).is_some());
        let second: Vec<_> = r
            .call(Name::from_str("localhost").unwrap())
            .await
            .unwrap()
            .collect();
        assert_eq!(first, second);
    }

    #[tokio::test]
    async fn a_failed_lookup_falls_back_to_a_stale_answer() {
        let mut r = CachingResolver::default();
        let stale = vec![SocketAddr::from(([127, 0, 0, 1], 0))];
        let old = Instant::now() - Duration::from_secs(60);
        r.cache
            .lock()
            .unwrap()
            .insert("no-such-host.invalid".into(), (stale.clone(), old));
        let got: Vec<_> = r
            .call(Name::from_str("no-such-host.invalid").unwrap())
            .await
            .unwrap()
            .collect();
        assert_eq!(got, stale);
        let mut fresh = CachingResolver::default();
        assert!(
            fresh
                .call(Name::from_str("no-such-host.invalid").unwrap())
                .await
                .is_err()
        );
    }
}
