//! The access log of a test binary: every line the in-process sidecars write, captured once
//! (the access log is process-global), and a wait for one request's line.

use std::{sync::OnceLock, time::Duration};

use serde_json::Value;
use tailwarden_sidecar::record::access_log;

use super::wait_until;

/// Every access-log line of this test binary (JSON), captured once for all tests.
pub fn log_lines() -> &'static access_log::Capture {
    static LOG: OnceLock<access_log::Capture> = OnceLock::new();
    LOG.get_or_init(|| {
        let capture = access_log::Capture::default();
        access_log::init(access_log::Format::Json, true, Box::new(capture.clone()));
        capture
    })
}

/// The access log line of request `id`, once written (the line is written when the response
/// body is dropped, which may be just after the client saw its end).
pub async fn access_line(id: &str) -> Value {
    let find = || {
        let text = log_lines().text();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["request_id"] == id)
    };
    assert!(
        wait_until(Duration::from_secs(5), || find().is_some()).await,
        "no access log line for {id}"
    );
    find().expect("the line was found above")
}
