//! Incremental server-sent-events parsing for streamed completions.
//!
//! Chunks from the network split lines anywhere, so the parser keeps the unfinished tail of
//! the last line and hands each complete event's `data` to a callback. Work per chunk is
//! proportional to the chunk, never to the whole stream.

/// What one SSE event carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SseEvent<'a> {
    /// `data: [DONE]`.
    Done,
    /// Any other `data` payload (JSON for OpenAI streams).
    Data(&'a [u8]),
}

/// Line-buffering SSE parser.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line not yet terminated by `\n`.
    partial: Vec<u8>,
    /// `data` of the event being assembled (multi-line data is joined with `\n`).
    data: Vec<u8>,
    has_data: bool,
}

impl SseParser {
    /// Feeds a chunk; `on_event` runs once per complete event.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(SseEvent<'_>)) {
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|b| *b == b'\n') {
            let (line, tail) = rest.split_at(pos);
            rest = &tail[1..];
            if self.partial.is_empty() {
                self.line(line, &mut on_event);
            } else {
                let mut full = std::mem::take(&mut self.partial);
                full.extend_from_slice(line);
                self.line(&full, &mut on_event);
                full.clear();
                self.partial = full;
            }
        }
        self.partial.extend_from_slice(rest);
    }

    fn line(&mut self, line: &[u8], on_event: &mut impl FnMut(SseEvent<'_>)) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            if self.has_data {
                if self.data == b"[DONE]" {
                    on_event(SseEvent::Done);
                } else {
                    on_event(SseEvent::Data(&self.data));
                }
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        // Comments (`:`), `event:`, `id:` and `retry:` lines carry nothing we measure.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(chunks: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, |e| {
                out.push(match e {
                    SseEvent::Done => "DONE".to_owned(),
                    SseEvent::Data(d) => String::from_utf8_lossy(d).into_owned(),
                })
            });
        }
        out
    }

    #[test]
    fn events_split_across_chunks() {
        let whole: &[u8] =
            b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        let expected = vec!["{\"a\":1}", "{\"b\":2}", "DONE"];
        assert_eq!(collect(&[whole]), expected);
        // Every possible split point gives the same events.
        for i in 0..whole.len() {
            let (a, b) = whole.split_at(i);
            assert_eq!(collect(&[a, b]), expected, "split at {i}");
        }
    }

    #[test]
    fn incomplete_event_is_not_emitted() {
        assert!(collect(&[b"data: {\"a\":1}\n"]).is_empty());
    }
}
