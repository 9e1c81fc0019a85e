//! Which provider created each Responses object (response ids, conversation ids), so
//! follow-ups — `previous_response_id`, `conversation`, `GET`/`DELETE /v1/responses/{id}`,
//! `…/cancel`, `…/input_items` — go back to it: the state lives on that provider's account.
//!
//! One table for the sidecar, kept across config reloads (a route edit must not forget whose
//! conversations are whose). The store is `quick_cache` (as for the exact cache): bounded by
//! count, evicting inline (S3-FIFO), so the bound holds at every moment; the TTL is checked
//! on read against `tokio::time::Instant` (paused time in tests), and expired ids age out by
//! eviction.

use std::{sync::Arc, time::Duration};

use quick_cache::sync::Cache;
use tailwarden_decide::sse::SseEvent;
use tokio::time::Instant;

use crate::relay::Observer;

/// Ids remembered at most (about 150 bytes each).
pub const CAPACITY: usize = 50_000;
/// How long an id is remembered. OpenAI keeps stored responses for 30 days; a follow-up
/// to an older one is routed like a new request.
pub const TTL: Duration = Duration::from_secs(24 * 3600);

/// The provider (of a route) that created an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub route: Arc<str>,
    pub provider: Arc<str>,
}

/// The sidecar's table of owners.
pub struct Affinity {
    owners: Cache<String, (Owner, Instant)>,
    ttl: Duration,
}

impl std::fmt::Debug for Affinity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Affinity({} ids)", self.owners.len())
    }
}

impl Default for Affinity {
    fn default() -> Self {
        Self::new(CAPACITY, TTL)
    }
}

impl Affinity {
    /// At most `capacity` ids (at least 1), each remembered for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            owners: Cache::new(capacity.max(1)),
            ttl,
        }
    }

    /// Remembers that `owner` created `id` now.
    pub fn remember(&self, id: &str, owner: Owner) {
        if !id.is_empty() {
            self.owners.insert(id.to_owned(), (owner, Instant::now()));
        }
    }

    /// The owner of `id`, if it is known and not expired.
    pub fn owner(&self, id: &str) -> Option<Owner> {
        let (owner, at) = self.owners.get(id)?;
        if Instant::now().saturating_duration_since(at) < self.ttl {
            Some(owner)
        } else {
            self.owners.remove(id);
            None
        }
    }

    /// Forgets `id` (the response was deleted).
    pub fn forget(&self, id: &str) {
        self.owners.remove(id);
    }

    /// Ids remembered now (expired ones included until they are read or evicted).
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }
}

/// Watches a stream for the response id its provider gave it (in `response.created`) and
/// remembers the owner, once.
pub struct Remember {
    pub affinity: Arc<Affinity>,
    pub owner: Option<Owner>,
}

impl Observer for Remember {
    fn on_event(&mut self, event: &SseEvent) {
        if let Some(id) = event.response_id()
            && let Some(owner) = self.owner.take()
        {
            self.affinity.remember(id, owner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(p: &str) -> Owner {
        Owner {
            route: "r".into(),
            provider: p.into(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn remembers_until_the_ttl() {
        let a = Affinity::new(10, Duration::from_secs(60));
        a.remember("resp_1", owner("a"));
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(a.owner("resp_1"), Some(owner("a")));
        assert_eq!(a.owner("resp_2"), None);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(a.owner("resp_1"), None, "expired at the TTL");
        assert!(a.is_empty(), "an expired id is dropped when read");
    }

    #[tokio::test(start_paused = true)]
    async fn bounded() {
        let a = Affinity::new(100, Duration::from_secs(3600));
        for i in 0..1000 {
            a.remember(&format!("resp_{i}"), owner("a"));
        }
        assert!(a.len() <= 100, "{}", a.len());
        assert_eq!(a.owner("resp_999"), Some(owner("a")), "the newest is kept");
        a.remember("resp_999", owner("b"));
        assert_eq!(a.owner("resp_999"), Some(owner("b")));
        a.forget("resp_999");
        assert_eq!(a.owner("resp_999"), None);
    }
}
