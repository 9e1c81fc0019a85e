//! Recording a response for the caches as it is relayed: one [`Fill`] per response, with a
//! [`Sink`] for each cache that wants it (the exact cache, the semantic cache, or both).
//!
//! The fill keeps the chunks the client receives (cheap: `Bytes` are reference-counted) and
//! stores them when the response ended cleanly — a 2xx, and for a stream a last event
//! `data: [DONE]` and no error event. A sink whose entry limit the response outgrew, a
//! response that failed, and a fill dropped without an end (the client went away) store
//! nothing and are counted as abandoned by each sink's cache. As a body observer it is fed by
//! the relay; a buffered body is pushed and committed at once.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tailwarden_decide::semantic::{Embedding, Query};

use super::{
    exact::{Entry, ExactCache},
    semantic::SemanticCache,
};
use crate::relay::{End, Observer};

/// Where a recorded response goes.
pub enum Sink {
    /// The exact cache, under this key digest.
    Exact {
        cache: Arc<ExactCache>,
        digest: [u8; 32],
    },
    /// The semantic cache, for this query and its embedding.
    Semantic {
        cache: Arc<SemanticCache>,
        query: Query,
        embedding: Embedding,
    },
}

impl Sink {
    fn max_bytes(&self) -> usize {
        match self {
            Sink::Exact { cache, .. } => cache.max_entry_bytes(),
            Sink::Semantic { cache, .. } => cache.max_entry_bytes(),
        }
    }

    fn abandon(&self) {
        match self {
            Sink::Exact { cache, .. } => cache.abandoned(),
            Sink::Semantic { cache, .. } => cache.abandoned(),
        }
    }

    /// Stores the complete response; whether it was.
    fn store(
        &self,
        status: StatusCode,
        content_type: Option<HeaderValue>,
        chunks: &[Bytes],
        stream: bool,
    ) -> bool {
        let (ttl, stream) = match self {
            Sink::Exact { cache, .. } => (cache.settings().ttl, stream),
            Sink::Semantic { cache, query, .. } => (cache.settings().ttl, query.stream),
        };
        let Some(entry) = Entry::complete(status, content_type, chunks.to_vec(), stream, ttl)
        else {
            self.abandon();
            return false;
        };
        match self {
            Sink::Exact { cache, digest } => {
                cache.put(*digest, entry);
                true
            }
            Sink::Semantic {
                cache,
                query,
                embedding,
            } => cache.insert(query, embedding, entry),
        }
    }
}

struct Recording {
    sink: Sink,
    /// The response outgrew this sink's largest entry.
    over: bool,
}

/// Records a response for one or two caches; stores it on [`commit`](Self::commit).
/// Dropped without commit (an error, a truncated stream, a client that went away) it stores
/// nothing.
pub struct Fill {
    sinks: Vec<Recording>,
    status: StatusCode,
    content_type: Option<HeaderValue>,
    /// The response streams (SSE): stored only if the stream ended cleanly.
    stream: bool,
    chunks: Vec<Bytes>,
    bytes: usize,
    /// Committed (stored or refused): nothing left to count on drop.
    done: bool,
}

impl std::fmt::Debug for Fill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fill({} sinks, {} bytes)", self.sinks.len(), self.bytes)
    }
}

impl Fill {
    /// A fill of a response with this status and headers for `sink`; `None` when it cannot
    /// be stored (not a 2xx).
    pub fn new(status: StatusCode, headers: &HeaderMap, stream: bool, sink: Sink) -> Option<Self> {
        if !status.is_success() {
            return None;
        }
        Some(Self {
            sinks: vec![Recording { sink, over: false }],
            status,
            content_type: headers.get(header::CONTENT_TYPE).cloned(),
            stream,
            chunks: Vec::new(),
            bytes: 0,
            done: false,
        })
    }

    /// One fill for both caches: the chunks are recorded once.
    pub fn join(first: Option<Fill>, second: Option<Fill>) -> Option<Fill> {
        match (first, second) {
            (Some(mut a), Some(mut b)) => {
                a.sinks.append(&mut b.sinks);
                b.done = true;
                Some(a)
            }
            (a, b) => a.or(b),
        }
    }

    /// A chunk as sent to the client.
    pub fn push(&mut self, chunk: &Bytes) {
        if chunk.is_empty() || !self.is_recording() {
            return;
        }
        self.bytes += chunk.len();
        for r in &mut self.sinks {
            r.over |= self.bytes > r.sink.max_bytes();
        }
        if self.is_recording() {
            self.chunks.push(chunk.clone());
        } else {
            self.chunks = Vec::new();
        }
    }

    /// Whether the response is still storable in some sink (not over every entry limit).
    pub fn is_recording(&self) -> bool {
        self.sinks.iter().any(|r| !r.over)
    }

    /// The response completed cleanly: store it in every sink that can take it. Returns
    /// whether every sink stored it — a stream without its final `data: [DONE]` or with an
    /// error event never is.
    pub fn commit(mut self) -> bool {
        self.done = true;
        let mut all = true;
        for r in &self.sinks {
            if r.over {
                r.sink.abandon();
                all = false;
                continue;
            }
            all &= r.sink.store(
                self.status,
                self.content_type.clone(),
                &self.chunks,
                self.stream,
            );
        }
        all
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        if !self.done {
            for r in &self.sinks {
                r.sink.abandon();
            }
        }
    }
}

impl Observer for Fill {
    fn on_chunk(&mut self, chunk: &Bytes) {
        self.push(chunk);
    }

    fn on_end(&mut self, end: End) {
        if end == End::Complete {
            let fill = std::mem::replace(
                self,
                Fill {
                    sinks: Vec::new(),
                    status: self.status,
                    content_type: None,
                    stream: self.stream,
                    chunks: Vec::new(),
                    bytes: 0,
                    done: true,
                },
            );
            fill.commit();
        }
        // A failed response is never stored: dropping the fill counts it as abandoned.
    }
}
