//! The access log: one line per request (JSON by default), written off the request path.
//!
//! A request's line is formatted by hand into a reused per-thread buffer and appended to one
//! shared in-memory batch under a short lock; a writer thread takes the whole batch and
//! writes it to stderr with one `write`, every [`FLUSH_INTERVAL`] or as soon as the batch
//! passes [`WAKE_AT`] bytes. So a request pays neither a `write` syscall nor a thread wake-up
//! for its line, and the formatting is plain appends of bytes rather than a `tracing` event
//! through `tracing-subscriber`'s JSON formatter.
//!
//! The batch is bounded ([`MAX_PENDING`] bytes, thousands of lines): if stderr does not
//! keep up (a blocked log pipe), further lines are dropped rather than stalling requests or
//! growing memory, and every drop is counted — in `tailwarden_access_log_dropped_total` and
//! in a warning line the writer writes as soon as it can. Under normal load nothing is
//! dropped: the writer drains a batch in microseconds. At exit [`flush`] writes what is left.
//!
//! The line's fields are the same as ever (`timestamp`, `level`, the request's fields,
//! `message`, `target`), and `TAILWARDEN_LOG` still decides whether the `tailwarden::access`
//! target is logged: [`init`] is told once, at start.

use std::{
    cell::RefCell,
    io::Write,
    sync::{
        Arc, Condvar, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// The `tracing` target the access log has always had (and `TAILWARDEN_LOG` filters on).
pub const TARGET: &str = "tailwarden::access";
/// Longest time a line waits in memory before the writer writes it.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(100);
/// A batch this large wakes the writer at once (one wake-up per few hundred lines).
pub const WAKE_AT: usize = 64 << 10;
/// Most bytes waiting to be written; a line that does not fit is dropped and counted.
pub const MAX_PENDING: usize = 4 << 20;

/// How lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line (`--log-format json`).
    Json,
    /// `timestamp  INFO tailwarden::access: request key=value …` (`--log-format text`).
    Text,
}

struct Shared {
    format: Format,
    pending: Mutex<Vec<u8>>,
    wake: Condvar,
    dropped: AtomicU64,
    /// Held from taking a batch until it is written, so a [`flush`] waits for the batch the
    /// writer thread is writing (none lost at exit) and batches reach the sink in order.
    out: Mutex<Out>,
}

struct Out {
    sink: Box<dyn Write + Send>,
    /// The previous batch's buffer, reused for the next one.
    spare: Vec<u8>,
    /// Drops already reported in a warning line.
    reported: u64,
}

impl Shared {
    fn new(format: Format, sink: Box<dyn Write + Send>) -> Self {
        Self {
            format,
            pending: Mutex::new(Vec::with_capacity(WAKE_AT)),
            wake: Condvar::new(),
            dropped: AtomicU64::new(0),
            out: Mutex::new(Out {
                sink,
                spare: Vec::with_capacity(WAKE_AT),
                reported: 0,
            }),
        }
    }
}

static LOG: OnceLock<Arc<Shared>> = OnceLock::new();

/// Starts the access log: lines go to `sink` (stderr in the sidecar) in `format`, written by
/// a thread of its own. Without a call (or with `enabled` false) no line is formatted at
/// all. A second call changes nothing.
pub fn init(format: Format, enabled: bool, sink: Box<dyn Write + Send>) {
    if !enabled {
        return;
    }
    let shared = Arc::new(Shared::new(format, sink));
    if LOG.set(shared.clone()).is_ok() {
        let spawned = std::thread::Builder::new()
            .name("access-log".to_owned())
            .spawn(move || writer(&shared));
        if let Err(e) = spawned {
            // Without the thread, lines are written by flush() only: say so once.
            eprintln!("tailwarden-sidecar: cannot start the access-log writer: {e}");
        }
    }
}

/// Access-log lines dropped so far because the writer did not keep up.
pub fn dropped() -> u64 {
    LOG.get().map_or(0, |s| s.dropped.load(Ordering::Relaxed))
}

/// Writes every line still in memory, now, including a batch the writer thread is in the
/// middle of writing (at exit, and in tests): a line queued before the call is in the sink
/// when it returns.
pub fn flush() {
    if let Some(shared) = LOG.get() {
        drain(shared);
    }
}

thread_local! {
    static LINE: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(1024));
}

/// Formats one line with `fields` and queues it. `false` when the line was dropped because
/// the queue is full (the caller counts it); `true` when queued or when the log is off.
pub fn emit(message: &str, fields: impl FnOnce(&mut Line<'_>)) -> bool {
    let Some(shared) = LOG.get() else {
        return true;
    };
    LINE.with(|cell| {
        // A line emitted while formatting one (a field's Display logging) gets a fresh buffer.
        let mut own;
        let mut borrowed = cell.try_borrow_mut();
        let buf: &mut Vec<u8> = match borrowed.as_mut() {
            Ok(b) => b,
            Err(_) => {
                own = Vec::new();
                &mut own
            }
        };
        buf.clear();
        let mut line = Line::start(buf, shared.format, message);
        fields(&mut line);
        line.end(message);
        enqueue(shared, buf)
    })
}

fn enqueue(shared: &Shared, line: &[u8]) -> bool {
    let mut pending = lock(&shared.pending);
    if pending.len() + line.len() > MAX_PENDING {
        drop(pending);
        shared.dropped.fetch_add(1, Ordering::Relaxed);
        shared.wake.notify_one();
        return false;
    }
    let before = pending.len();
    pending.extend_from_slice(line);
    let crossed = before < WAKE_AT && pending.len() >= WAKE_AT;
    drop(pending);
    if crossed {
        shared.wake.notify_one();
    }
    true
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain bytes behind: still usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn writer(shared: &Shared) {
    loop {
        {
            let pending = lock(&shared.pending);
            if pending.len() < WAKE_AT {
                // A timeout, a wake-up or a spurious return: drain whatever is there.
                drop(shared.wake.wait_timeout(pending, FLUSH_INTERVAL));
            }
        }
        drain(shared);
    }
}

/// Takes the whole pending batch and writes it, then a warning for drops not yet reported.
fn drain(shared: &Shared) {
    let mut guard = lock(&shared.out);
    let out = &mut *guard;
    let mut batch = {
        let mut pending = lock(&shared.pending);
        std::mem::replace(&mut *pending, std::mem::take(&mut out.spare))
    };
    // stderr gone (closed pipe): nothing better to do with the lines.
    if !batch.is_empty() {
        let _ = out.sink.write_all(&batch);
    }
    let dropped = shared.dropped.load(Ordering::Relaxed);
    if dropped > out.reported {
        const WARNING: &str = "access-log lines dropped: stderr did not keep up";
        let mut warning = Vec::with_capacity(256);
        let mut line = Line::start_at(
            &mut warning,
            shared.format,
            "WARN",
            WARNING,
            SystemTime::now(),
        );
        line.u64("dropped", dropped - out.reported);
        line.u64("dropped_total", dropped);
        line.end(WARNING);
        let _ = out.sink.write_all(&warning);
        out.reported = dropped;
    }
    let _ = out.sink.flush();
    // Keep the buffer for the next batch; a huge one after a burst is let go.
    batch.clear();
    if batch.capacity() <= 4 * WAKE_AT {
        out.spare = batch;
    }
}

/// One line being written: fields in the order they are added.
pub struct Line<'a> {
    out: &'a mut Vec<u8>,
    format: Format,
}

impl<'a> Line<'a> {
    fn start(out: &'a mut Vec<u8>, format: Format, message: &str) -> Self {
        Self::start_at(out, format, "INFO", message, SystemTime::now())
    }

    fn start_at(
        out: &'a mut Vec<u8>,
        format: Format,
        level: &str,
        message: &str,
        now: SystemTime,
    ) -> Self {
        match format {
            Format::Json => {
                out.extend_from_slice(b"{\"timestamp\":\"");
                timestamp(out, now);
                out.extend_from_slice(b"\",\"level\":\"");
                out.extend_from_slice(level.as_bytes());
                out.push(b'"');
            }
            Format::Text => {
                timestamp(out, now);
                out.extend_from_slice(b"  ");
                out.extend_from_slice(level.as_bytes());
                out.push(b' ');
                out.extend_from_slice(TARGET.as_bytes());
                out.extend_from_slice(b": ");
                out.extend_from_slice(message.as_bytes());
            }
        }
        Self { out, format }
    }

    fn end(self, message: &str) {
        if self.format == Format::Json {
            self.out.extend_from_slice(b",\"message\":");
            json_str(self.out, message);
            self.out.extend_from_slice(b",\"target\":\"");
            self.out.extend_from_slice(TARGET.as_bytes());
            self.out.extend_from_slice(b"\"}");
        }
        self.out.push(b'\n');
    }

    fn key(&mut self, key: &str) {
        match self.format {
            Format::Json => {
                self.out.extend_from_slice(b",\"");
                self.out.extend_from_slice(key.as_bytes());
                self.out.extend_from_slice(b"\":");
            }
            Format::Text => {
                self.out.push(b' ');
                self.out.extend_from_slice(key.as_bytes());
                self.out.push(b'=');
            }
        }
    }

    /// A string field (JSON-escaped; quoted in text too).
    pub fn str(&mut self, key: &str, value: &str) {
        self.key(key);
        json_str(self.out, value);
    }

    /// A string field, left out when `None`.
    pub fn opt_str(&mut self, key: &str, value: Option<&str>) {
        if let Some(v) = value {
            self.str(key, v);
        }
    }

    pub fn u64(&mut self, key: &str, value: u64) {
        self.key(key);
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        let mut n = value;
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.out.extend_from_slice(&digits[i..]);
    }

    pub fn opt_u64(&mut self, key: &str, value: Option<u64>) {
        if let Some(v) = value {
            self.u64(key, v);
        }
    }

    /// A number; `null` for a NaN or an infinity, which JSON cannot carry.
    pub fn f64(&mut self, key: &str, value: f64) {
        self.key(key);
        if value.is_finite() {
            let _ = write!(self.out, "{value}");
        } else {
            self.out.extend_from_slice(b"null");
        }
    }

    pub fn opt_f64(&mut self, key: &str, value: Option<f64>) {
        if let Some(v) = value {
            self.f64(key, v);
        }
    }

    pub fn bool(&mut self, key: &str, value: bool) {
        self.key(key);
        self.out
            .extend_from_slice(if value { b"true" } else { b"false" });
    }

    pub fn opt_bool(&mut self, key: &str, value: Option<bool>) {
        if let Some(v) = value {
            self.bool(key, v);
        }
    }
}

/// `"value"` with JSON escapes (RFC 8259: quote, backslash, control characters).
fn json_str(out: &mut Vec<u8>, value: &str) {
    out.push(b'"');
    let bytes = value.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// RFC 3339 in UTC with microseconds, as `tracing-subscriber` wrote it:
/// `2026-12-01T11:30:01.123456Z`.
fn timestamp(out: &mut Vec<u8>, now: SystemTime) {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    let two = |n: u64, out: &mut Vec<u8>| {
        out.push(b'0' + (n / 10) as u8);
        out.push(b'0' + (n % 10) as u8);
    };
    let y = y.clamp(0, 9999) as u64;
    two(y / 100, out);
    two(y % 100, out);
    out.push(b'-');
    two(u64::from(m), out);
    out.push(b'-');
    two(u64::from(d), out);
    out.push(b'T');
    two(rem / 3600, out);
    out.push(b':');
    two(rem % 3600 / 60, out);
    out.push(b':');
    two(rem % 60, out);
    out.push(b'.');
    let micros = u64::from(since.subsec_micros());
    two(micros / 10_000, out);
    two(micros / 100 % 100, out);
    two(micros % 100, out);
    out.push(b'Z');
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// An in-memory sink for tests: every byte written, readable while the log runs.
#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<u8>>>);

impl Capture {
    /// The text written so far (after a [`flush`]).
    pub fn text(&self) -> String {
        flush();
        String::from_utf8_lossy(&lock(&self.0)).into_owned()
    }
}

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        lock(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(format: Format, fields: impl FnOnce(&mut Line<'_>)) -> String {
        let mut buf = Vec::new();
        let at = UNIX_EPOCH + Duration::from_micros(1_764_588_601_123_456);
        let mut l = Line::start_at(&mut buf, format, "INFO", "request", at);
        fields(&mut l);
        l.end("request");
        String::from_utf8(buf).expect("utf-8")
    }

    #[test]
    fn a_json_line_is_one_object_with_every_field_and_none_left_out() {
        let text = line(Format::Json, |l| {
            l.str("request_id", "tw-1");
            l.opt_str("tier", None);
            l.u64("status", 200);
            l.u64("zero", 0);
            l.u64("max", u64::MAX);
            l.f64("total_ms", 1.25);
            l.f64("nan", f64::NAN);
            l.bool("stream", false);
            l.opt_u64("input_tokens", Some(12));
            l.opt_bool("usage_estimated", None);
        });
        assert!(text.ends_with("}\n"));
        let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["timestamp"], "2025-12-01T11:30:01.123456Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["request_id"], "tw-1");
        assert_eq!(v["status"], 200);
        assert_eq!(v["zero"], 0);
        assert_eq!(v["max"], u64::MAX);
        assert_eq!(v["total_ms"], 1.25);
        assert!(v["nan"].is_null());
        assert_eq!(v["stream"], false);
        assert_eq!(v["input_tokens"], 12);
        assert_eq!(v["message"], "request");
        assert_eq!(v["target"], TARGET);
        assert!(v.get("tier").is_none() && v.get("usage_estimated").is_none());
    }

    #[test]
    fn strings_are_escaped_so_no_value_can_break_the_line() {
        let nasty = "a\"b\\c\nd\re\tf\u{1}g\u{1f}h é ☃";
        let text = line(Format::Json, |l| l.str("model", nasty));
        assert_eq!(text.matches('\n').count(), 1, "one line: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["model"], nasty);
    }

    #[test]
    fn text_lines_read_like_the_log_subscriber_s() {
        let text = line(Format::Text, |l| {
            l.str("route", "r");
            l.u64("status", 200);
        });
        assert_eq!(
            text,
            "2025-12-01T11:30:01.123456Z  INFO tailwarden::access: request route=\"r\" status=200\n"
        );
    }

    #[test]
    fn dates_are_the_calendar_s() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_423), (2025, 12, 1));
        assert_eq!(civil_from_days(20_513), (2026, 3, 1));
        let mut out = Vec::new();
        timestamp(
            &mut out,
            UNIX_EPOCH + Duration::from_micros(951_782_400_000_007),
        );
        assert_eq!(out, b"2000-02-29T00:00:00.000007Z");
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_blocking() {
        let capture = Capture::default();
        let shared = Shared::new(Format::Json, Box::new(capture.clone()));
        let mut line = vec![b'x'; 999];
        line.push(b'\n');
        let mut queued = 0;
        while enqueue(&shared, &line) {
            queued += 1;
        }
        assert_eq!(queued, MAX_PENDING / 1000);
        assert!(!enqueue(&shared, &line));
        assert_eq!(shared.dropped.load(Ordering::Relaxed), 2);
        // Once written out, there is room again, and the drops are reported in the output.
        drain(&shared);
        let written = String::from_utf8_lossy(&lock(&capture.0)).into_owned();
        assert_eq!(written.matches('x').count(), queued * 999);
        let warning: serde_json::Value =
            serde_json::from_str(written.lines().last().expect("a warning line")).expect("JSON");
        assert_eq!(warning["level"], "WARN");
        assert_eq!(warning["dropped"], 2);
        assert_eq!(warning["dropped_total"], 2);
        assert!(enqueue(&shared, &line));
        // A drop reported once is not reported again.
        drain(&shared);
        let again = String::from_utf8_lossy(&lock(&capture.0)).into_owned();
        assert_eq!(again.matches("WARN").count(), 1);
    }
}
