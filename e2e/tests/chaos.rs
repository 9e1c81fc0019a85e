//! The chaos suite (issue #9): the real sidecar binary between an open-loop client and
//! simulated providers over loopback HTTP, while a provider is killed, hangs after its
//! headers, resets connections or cuts bodies, rate-limits everyone, does not resolve, or
//! while the config file is deleted and corrupted, or the sidecar gets SIGTERM with 200
//! streams in flight.
//!
//! Every scenario checks the same promises (see `common/chaos.rs`): no request lost — each
//! one succeeds or fails with a clear OpenAI-shaped error, and each failure is one the fault
//! explains (a stream already relaying when its provider died cannot be retried; everything
//! before the first byte can) — every request over within the route's total deadline, the
//! in-flight gauge back to 0 (no leaked request task) and the providers' own in-flight
//! counts back to 0 (no upstream request left behind), and recovery once the fault clears.
//! Each prints a `CHAOS | …` line with its numbers (run with `--nocapture`); they are the
//! table in docs/reliability.md.
//!
//! The scenarios run one at a time (their timings are the point) and take about 60 s in
//! all. The sidecar binary comes from the same target folder (`cargo test --workspace`
//! builds it) or `TAILWARDEN_SIDECAR_BIN`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/chaos.rs"]
mod harness;

use std::{
    net::TcpStream,
    sync::Arc,
    time::{Duration, Instant},
};

use harness::*;
use tailwarden_e2e::sim::Fault;

const fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Requests per second of every scenario's open-loop load.
const RATE: f64 = 40.0;

/// Streams of 24 tokens 25 ms apart (about 0.6 s), with every third request a non-streamed
/// completion, so both the relay and the buffered path meet the fault.
fn mixed(i: usize) -> Shape {
    if i % 3 == 2 {
        Shape::whole(40)
    } else {
        Shape::stream(24, 25)
    }
}

/// The first success (any provider) that started after `clear`, measured from `clear`.
fn recovery_any(records: &[Record], clear: Duration) -> Option<Duration> {
    records
        .iter()
        .filter(|r| r.ok() && r.start >= clear)
        .map(|r| r.end.saturating_sub(clear))
        .min()
}

#[test]
fn provider_killed_mid_run() {
    scenario(async {
        let dir = Workdir::new("kill");
        let a = SimProc::start(&dir, "127.0.0.1:0", "a");
        let b = SimProc::start(&dir, "127.0.0.1:0", "b");
        let a_addr = a.addr;
        let config = dir.join("routes.yaml");
        let route = route_yaml(&[
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, route).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(7000), mixed);

        at(epoch, ms(2000)).await;
        let kill_from = epoch.elapsed();
        a.kill();
        let killed_at = epoch.elapsed();
        at(epoch, ms(4000)).await;
        // The provider comes back on the same address, as a restarted pod behind a Service.
        let a2 = SimProc::start(&dir, &a_addr.to_string(), "a-restarted");
        let back_at = epoch.elapsed();

        let records = load.await.unwrap();
        // The only failures a kill may cause: streams provider a was already relaying, ended
        // with an error event. Requests waiting for a's first byte are retried on b.
        let tally = check("provider killed", &records, |r| {
            let f = r.failure().unwrap();
            r.from("a")
                && f.mid_stream
                && f.code == "upstream_stream_error"
                && r.start < killed_at
                && r.end >= kill_from
        });
        assert!(
            tally.failed > 0,
            "the kill should have cut some streams in flight on a: {tally:?}"
        );
        for r in records
            .iter()
            .filter(|r| r.start > killed_at + ms(50) && r.start < back_at)
        {
            assert!(r.ok() && r.from("b"), "while a is dead b serves: {r:?}");
        }
        let recovery = recovery_of(&records, "a", back_at);
        assert!(
            recovery.is_some_and(|d| d < ms(3000)),
            "a serves again within 3 s of its restart (breaker open for at most 2 s): {recovery:?}"
        );
        let drained = wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
        // b's requests all ended too (a's died with it).
        let b_addr = b.addr;
        let mut b_idle = sim_proc_in_flight(b_addr);
        for _ in 0..100 {
            if b_idle == Some(0) {
                break;
            }
            tokio::time::sleep(ms(20)).await;
            b_idle = sim_proc_in_flight(b_addr);
        }
        assert_eq!(b_idle, Some(0), "provider b has no request left in flight");
        tally.print(
            "provider killed mid-run (SIGKILL, restarted on the same port 2 s later)",
            recovery,
            &format!("in-flight gauge 0 after {} ms", drained.as_millis()),
        );
        drop(a2);
        drop(b);
    });
}

#[test]
fn provider_hangs_after_headers() {
    scenario(async {
        let dir = Workdir::new("hang");
        let a = Arc::new(sim().await);
        let b = Arc::new(sim().await);
        let config = dir.join("routes.yaml");
        let route = route_yaml(&[
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, route).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        // 12 s: the last 1.5 s are after the 3.5 s recovery bound, so "all ok again" is
        // checked on real requests.
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(12_000), mixed);

        // Phase 1: a hangs (streams in flight stop, new answers are headers only); b is fine.
        at(epoch, ms(1000)).await;
        let frozen_at = epoch.elapsed();
        a.set_frozen(true);
        at(epoch, ms(3000)).await;
        let thawed_at = epoch.elapsed();
        a.set_frozen(false);
        // Phase 2: every provider hangs.
        at(epoch, ms(4000)).await;
        let all_frozen_at = epoch.elapsed();
        a.set_frozen(true);
        b.set_frozen(true);
        at(epoch, ms(7000)).await;
        a.set_frozen(false);
        b.set_frozen(false);
        let all_thawed_at = epoch.elapsed();

        let records = load.await.unwrap();
        // Phase 1: streams a was relaying when it froze end at the idle timeout with an
        // error event; requests still waiting for a's first byte hit the first-byte timeout
        // and are retried on b. Phase 2: nothing can answer, so requests end with the
        // sidecar's 504 (no first byte in time on any attempt) or, once every breaker is
        // open, its 503 — until a breaker lets probes through after the thaw and they
        // complete: up to maxOpenFor (2 s) plus a probe stream's length (0.6 s) and its
        // first byte, so 3.5 s.
        let tally = check("provider hangs", &records, |r| {
            let f = r.failure().unwrap();
            let phase1 = r.from("a")
                && f.mid_stream
                && f.code == "idle_timeout"
                && r.start < frozen_at
                && r.end >= frozen_at;
            let phase2 = (f.mid_stream && f.code == "idle_timeout"
                || !f.mid_stream
                    && (f.code == "upstream_timeout" || f.code == "no_provider_available"))
                && r.end >= all_frozen_at
                && r.start < all_thawed_at + ms(3500);
            phase1 || phase2
        });
        let during = |from: Duration, to: Duration| {
            records
                .iter()
                .filter(move |r| r.start >= from && r.start < to)
        };
        assert!(
            during(frozen_at, thawed_at).all(Record::ok),
            "requests sent while only a hangs all succeed"
        );
        let slowest_during = during(frozen_at, thawed_at)
            .map(Record::took)
            .max()
            .unwrap_or_default();
        let phase1_failed = records
            .iter()
            .filter(|r| r.end < thawed_at + ms(500) && r.failure().is_some())
            .count();
        let phase2_sent = during(all_frozen_at, all_thawed_at).count();
        let recovery = recovery_any(&records, all_thawed_at);
        assert!(during(all_thawed_at + ms(3500), ms(60_000)).count() > 0);
        assert!(
            during(all_thawed_at + ms(3500), ms(60_000)).all(Record::ok),
            "every request succeeds again from 3.5 s after the thaw"
        );
        let a_back = recovery_of(&records, "a", thawed_at);
        let drained = wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
        // The abandoned, frozen upstream requests were cancelled, not left hanging.
        wait_sim_idle(&a, "a", ms(3000)).await;
        wait_sim_idle(&b, "b", ms(3000)).await;
        tally.print(
            "provider hangs after headers: a alone for 2 s, then every provider for 3 s",
            recovery,
            &format!(
                "a alone: {phase1_failed} streams it was relaying ended with idle_timeout, every request sent meanwhile ok (slowest {} ms: first-byte timeout 1 s, then b); a back in rotation after its thaw: {}; all hang: {phase2_sent} requests sent; in-flight gauge 0 after {} ms; every abandoned upstream request cancelled",
                slowest_during.as_millis(),
                a_back.map_or_else(|| "not within the run".to_owned(), |d| format!("{} ms", d.as_millis())),
                drained.as_millis()
            ),
        );
    });
}

#[test]
fn connection_resets_and_cut_bodies() {
    scenario(async {
        let dir = Workdir::new("reset");
        let a = Arc::new(sim().await);
        let b = sim().await;
        let config = dir.join("routes.yaml");
        let route = route_yaml(&[
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, route).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(8000), mixed);

        // Phase 1: every connection to a is closed before a response.
        at(epoch, ms(1000)).await;
        a.set_fault(Some(Fault::Reset));
        at(epoch, ms(2500)).await;
        let resets_end = epoch.elapsed();
        a.set_fault(None);
        // Phase 2, once a is back in rotation: every body from a is cut part-way.
        at(epoch, ms(5000)).await;
        let cuts_from = epoch.elapsed();
        a.set_fault(Some(Fault::Drop));
        at(epoch, ms(6000)).await;
        a.set_fault(None);
        let cuts_end = epoch.elapsed();

        let records = load.await.unwrap();
        // Resets before the first byte are retried, and so are cut non-streamed bodies (the
        // sidecar holds them whole before answering). A stream cut after its first token
        // cannot be retried: it ends with an error event.
        let tally = check("resets", &records, |r| {
            let f = r.failure().unwrap();
            r.from("a")
                && r.stream
                && f.mid_stream
                && f.code == "upstream_stream_error"
                && r.start >= cuts_from - ms(100)
                && r.start < cuts_end
        });
        let during_resets = records
            .iter()
            .filter(|r| r.start >= ms(1000) && r.start < resets_end)
            .count();
        assert!(
            records
                .iter()
                .filter(|r| r.start < cuts_from - ms(100))
                .all(Record::ok),
            "every request before the cuts succeeds"
        );
        let recovery = recovery_of(&records, "a", resets_end);
        assert!(
            recovery.is_some_and(|d| d < ms(3000)),
            "a serves again within 3 s of the resets ending (breaker open for at most 2 s): {recovery:?}"
        );
        let after_cuts = recovery_of(&records, "a", cuts_end);
        assert!(after_cuts.is_some(), "a serves again after the cuts");
        let drained = wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
        wait_sim_idle(&a, "a", ms(3000)).await;
        wait_sim_idle(&b, "b", ms(3000)).await;
        let cut_streams = tally.failed;
        tally.print(
            "connection resets (1.5 s, every request to a) then bodies cut mid-way (1 s)",
            recovery,
            &format!(
                "{during_resets} requests sent during the resets, all ok; {cut_streams} streams cut after their first token; recovery after the cuts {} ms; in-flight gauge 0 after {} ms",
                after_cuts.unwrap_or_default().as_millis(),
                drained.as_millis()
            ),
        );
    });
}

#[test]
fn rate_limit_storm_with_retry_after() {
    scenario(async {
        let dir = Workdir::new("429");
        let a = Arc::new(sim().await);
        let b = Arc::new(sim().await);
        let config = dir.join("routes.yaml");
        let route = route_yaml(&[
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, route).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(8000), mixed);

        // Phase 1: a answers 429 (Retry-After: 1) to everything; b is fine.
        at(epoch, ms(1000)).await;
        a.set_fault(Some(Fault::RateLimited));
        at(epoch, ms(3000)).await;
        let a_alone_end = epoch.elapsed();
        a.set_fault(None);
        // Phase 2: both providers rate-limit everything for 1.5 s.
        at(epoch, ms(4000)).await;
        let storm_from = epoch.elapsed();
        a.set_fault(Some(Fault::RateLimited));
        b.set_fault(Some(Fault::RateLimited));
        at(epoch, ms(5500)).await;
        a.set_fault(None);
        b.set_fault(None);
        let storm_end = epoch.elapsed();

        let records = load.await.unwrap();
        // With one provider limited, the other takes the traffic. When every provider is
        // limited, a request waits out the Retry-After (never past its deadline) and then
        // gets the provider's 429 — with its Retry-After — or the sidecar's 503 naming the
        // providers' cool-downs.
        let tally = check("429 storm", &records, |r| {
            let f = r.failure().unwrap();
            let clear =
                (r.status == 429 && f.code == "rate_limit_exceeded" && f.retry_after.is_some())
                    || (r.status == 503 && f.code == "no_provider_available");
            clear && r.start >= storm_from - ms(200) && r.start < storm_end
        });
        for r in records
            .iter()
            .filter(|r| r.start >= ms(1000) && r.start < a_alone_end)
        {
            assert!(r.ok(), "with only a limited, b serves: {r:?}");
        }
        let upstream = a.stats().requests_total + b.stats().requests_total;
        let amplification = upstream as f64 / records.len() as f64;
        assert!(
            amplification <= 3.0,
            "no retry storm: {upstream} upstream requests for {} client requests",
            records.len()
        );
        let recovery = recovery_any(&records, storm_end);
        assert!(
            recovery.is_some_and(|d| d < ms(2500)),
            "requests succeed again within 2.5 s of the storm: {recovery:?}"
        );
        let drained = wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
        wait_sim_idle(&a, "a", ms(3000)).await;
        wait_sim_idle(&b, "b", ms(3000)).await;
        let in_storm = records
            .iter()
            .filter(|r| r.start >= storm_from && r.start < storm_end)
            .count();
        tally.print(
            "429 storm: a alone for 2 s, then every provider for 1.5 s (Retry-After: 1)",
            recovery,
            &format!(
                "a alone: 0 failures; {in_storm} requests sent during the full storm; upstream requests per client request {amplification:.2}; in-flight gauge 0 after {} ms",
                drained.as_millis()
            ),
        );
    });
}

#[test]
fn dns_failure_for_one_provider() {
    scenario(async {
        let dir = Workdir::new("dns");
        let fixed = sim().await;
        let b = sim().await;
        let config = dir.join("routes.yaml");
        let broken = route_yaml(&[
            Provider::new("dns", "http://no-such-host.invalid:1/v1"),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, broken).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(6000), mixed);

        at(epoch, ms(2900)).await;
        let (_, metrics) = admin_get(&client, sidecar.admin, "/metrics").await;
        let dns_failures = metric_with(
            &metrics,
            "tailwarden_upstream_attempt_duration_seconds_count",
            &[("provider", "dns"), ("outcome", "connect")],
        );
        // The fault clears: the provider's host resolves again (here: the route is fixed
        // to a name that resolves, as an operator would after a DNS incident).
        at(epoch, ms(3000)).await;
        let fixed_at = epoch.elapsed();
        let repaired = route_yaml(&[
            Provider::new(
                "dns",
                format!("http://localhost:{}/v1", fixed.addr().port()),
            ),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, repaired).unwrap();

        let records = load.await.unwrap();
        // A name that does not resolve is a connect failure before anything was sent:
        // always retried on the healthy provider, so nothing fails.
        let tally = check("dns", &records, |_| false);
        assert!(
            dns_failures > 0.0,
            "attempts to the unresolvable provider were made and counted as connect failures"
        );
        for r in records.iter().filter(|r| r.start < fixed_at) {
            assert!(r.from("b"), "b serves while dns does not resolve: {r:?}");
        }
        let recovery = recovery_of(&records, "dns", fixed_at);
        assert!(
            recovery.is_some_and(|d| d < ms(2500)),
            "the repaired provider serves within 2.5 s: {recovery:?}"
        );
        let drained = wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
        wait_sim_idle(&fixed, "dns", ms(3000)).await;
        wait_sim_idle(&b, "b", ms(3000)).await;
        tally.print(
            "DNS failure for one provider (baseUrl host no-such-host.invalid), then fixed by a config change",
            recovery,
            &format!(
                "{dns_failures} attempts to the unresolvable host, all retried on b; in-flight gauge 0 after {} ms",
                drained.as_millis()
            ),
        );
    });
}

#[test]
fn config_file_deleted_and_corrupted_under_load() {
    scenario(async {
        let dir = Workdir::new("config");
        let a = sim().await;
        let b = sim().await;
        let config = dir.join("routes.yaml");
        let original = route_yaml(&[
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ]);
        let mut only_b = vec![
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ];
        only_b[0].weight = 0;
        let changed = route_yaml(&only_b);
        std::fs::write(&config, &original).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(7000), mixed);
        // Samples of readiness and of the config-valid gauge every 25 ms.
        let monitor = {
            let (client, admin) = (client.clone(), sidecar.admin);
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while epoch.elapsed() < ms(7000) {
                    let t = epoch.elapsed();
                    let (ready, _) = admin_get(&client, admin, "/readyz").await;
                    let (_, metrics) = admin_get(&client, admin, "/metrics").await;
                    let valid = metric_sum(&metrics, "tailwarden_config_last_load_valid");
                    samples.push((t, ready, valid));
                    tokio::time::sleep(ms(25)).await;
                }
                samples
            })
        };

        at(epoch, ms(1000)).await;
        let deleted_at = epoch.elapsed();
        std::fs::remove_file(&config).unwrap();
        at(epoch, ms(2000)).await;
        std::fs::write(&config, b"\x00\xff{{{ this: is: not [yaml").unwrap();
        at(epoch, ms(3000)).await;
        // A file caught mid-write: the first 60 % of a valid route.
        std::fs::write(&config, &original.as_bytes()[..original.len() * 6 / 10]).unwrap();
        at(epoch, ms(3500)).await;
        let (_, status) = admin_get(&client, sidecar.admin, "/config").await;
        at(epoch, ms(4000)).await;
        // The fault clears: the file is back exactly as it was.
        let restored_at = epoch.elapsed();
        std::fs::write(&config, &original).unwrap();
        at(epoch, ms(4500)).await;
        let (_, status_after) = admin_get(&client, sidecar.admin, "/config").await;
        at(epoch, ms(5000)).await;
        // And a real change afterwards still applies: a out of rotation.
        let changed_at = epoch.elapsed();
        let old_hash =
            serde_json::from_str::<serde_json::Value>(&status_after).unwrap()["configHash"].clone();
        std::fs::write(&config, &changed).unwrap();
        // The moment the new routes serve: /config shows a new hash.
        let switched_at = loop {
            let (_, now) = admin_get(&client, sidecar.admin, "/config").await;
            let now: serde_json::Value = serde_json::from_str(&now).unwrap();
            if now["configHash"] != old_hash {
                break epoch.elapsed();
            }
            assert!(
                epoch.elapsed() < changed_at + ms(2000),
                "the changed config is loaded within 2 s"
            );
            tokio::time::sleep(ms(10)).await;
        };

        let records = load.await.unwrap();
        let samples = monitor.await.unwrap();
        // The last good config keeps serving through all of it: nothing may fail.
        let tally = check("config", &records, |_| false);
        for (t, ready, _) in &samples {
            assert_eq!(*ready, 200, "ready throughout, at {t:?}");
        }
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        assert!(
            status["lastError"].as_str().is_some_and(|e| !e.is_empty()),
            "/config names the reload error: {status}"
        );
        let status_after: serde_json::Value = serde_json::from_str(&status_after).unwrap();
        assert!(
            status_after["lastError"].is_null(),
            "/config clears the error once the file is good again: {status_after}"
        );
        let invalid_seen = samples
            .iter()
            .find(|(t, _, v)| *t > deleted_at && *v == Some(0.0))
            .map(|(t, ..)| *t - deleted_at);
        assert!(
            invalid_seen.is_some(),
            "tailwarden_config_last_load_valid went to 0 after the delete"
        );
        let recovered = samples
            .iter()
            .find(|(t, _, v)| *t > restored_at && *v == Some(1.0))
            .map(|(t, ..)| *t - restored_at);
        assert!(
            recovered.is_some_and(|d| d < ms(1000)),
            "the restored file is valid again within 1 s (tailwarden_config_last_load_valid back to 1): {recovered:?}; samples after the restore: {:?}",
            samples
                .iter()
                .filter(|(t, ..)| *t > restored_at)
                .take(10)
                .collect::<Vec<_>>()
        );
        for r in records.iter().filter(|r| r.start >= switched_at + ms(50)) {
            assert!(r.from("b"), "the changed config is live: {r:?}");
        }
        let drained = wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
        wait_sim_idle(&a, "a", ms(3000)).await;
        wait_sim_idle(&b, "b", ms(3000)).await;
        tally.print(
            "config file deleted, then garbage, then half-written, then restored (1 s each), then changed",
            recovered,
            &format!(
                "ready throughout; config_last_load_valid 0 within {} ms of the delete; a later change live after {} ms; in-flight gauge 0 after {} ms",
                invalid_seen.unwrap_or_default().as_millis(),
                (switched_at - changed_at).as_millis(),
                drained.as_millis()
            ),
        );
    });
}

#[test]
fn sigterm_during_200_in_flight_streams() {
    scenario(async {
        const STREAMS: usize = 200;
        let dir = Workdir::new("sigterm");
        let a = sim().await;
        let config = dir.join("routes.yaml");
        std::fs::write(&config, route_yaml(&[Provider::new("a", a.base_url())])).unwrap();
        let mut sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "15s", "first");
        let listen = sidecar.listen;
        let client = client();
        let epoch = Instant::now();
        // 200 streams of 40 tokens 50 ms apart: about 2 s each (well within the 4 s total).
        let shape = Shape {
            stream: true,
            ttft_ms: 50,
            itl_ms: 50,
            tokens: 40,
        };
        let tasks: Vec<_> = (0..STREAMS)
            .map(|i| send(&client, &sidecar.base_url(), epoch, i, shape))
            .collect();
        // Wait until every stream is relaying (the gauge counts committed responses).
        let started = Instant::now();
        loop {
            let (_, metrics) = admin_get(&client, sidecar.admin, "/metrics").await;
            if metric_sum(&metrics, IN_FLIGHT) == Some(STREAMS as f64) {
                break;
            }
            assert!(
                started.elapsed() < ms(10_000),
                "200 streams in flight: {:?}",
                metric_sum(&metrics, IN_FLIGHT)
            );
            tokio::time::sleep(ms(20)).await;
        }

        let term_at = Instant::now();
        let term_t = epoch.elapsed();
        signal(sidecar.pid(), "TERM");
        // Draining: unready at once, and no new connection accepted.
        let mut unready = None;
        let mut refused = None;
        while term_at.elapsed() < ms(1500) && (unready.is_none() || refused.is_none()) {
            if unready.is_none() && admin_get(&client, sidecar.admin, "/readyz").await.0 == 503 {
                unready = Some(term_at.elapsed());
            }
            if refused.is_none() && TcpStream::connect_timeout(&listen, ms(200)).is_err() {
                refused = Some(term_at.elapsed());
            }
            tokio::time::sleep(ms(10)).await;
        }
        assert!(unready.is_some(), "/readyz turns 503 while draining");
        assert!(refused.is_some(), "the listener closes on SIGTERM");

        let mut records = Vec::new();
        for t in tasks {
            records.push(t.await.unwrap());
        }
        let status = sidecar.wait_exit(ms(20_000));
        let exited_after = term_at.elapsed();
        assert!(
            status.is_some_and(|s| s.success()),
            "clean exit after the drain: {status:?}\n{}",
            sidecar.log_tail(20)
        );
        // Exiting before --drain-timeout (15 s) means the graceful drain completed: every
        // connection closed, so every relay (and its in-flight count) was dropped.
        assert!(
            exited_after < ms(10_000),
            "drained well before the 15 s drain timeout: {exited_after:?}"
        );
        // Every stream in flight at SIGTERM completes in full.
        let tally = check("sigterm", &records, |_| false);
        assert_eq!(tally.ok, STREAMS);
        let last_end = records.iter().map(|r| r.end).max().unwrap_or_default();
        wait_sim_idle(&a, "a", ms(3000)).await;

        // Recovery: the sidecar restarted on the same port serves at once.
        let restart_at = Instant::now();
        let restarted = SidecarProc::start(&dir, &config, &listen.to_string(), "15s", "restarted");
        let after: Vec<_> = (0..20)
            .map(|i| {
                send(
                    &client,
                    &restarted.base_url(),
                    epoch,
                    i,
                    Shape::stream(4, 10),
                )
            })
            .collect();
        let mut after_records = Vec::new();
        for t in after {
            after_records.push(t.await.unwrap());
        }
        check("after restart", &after_records, |_| false);
        let recovery = restart_at.elapsed();
        wait_in_flight_zero(&client, restarted.admin, ms(5000)).await;
        tally.print(
            "SIGTERM during 200 in-flight streams (about 2 s each, drain timeout 15 s)",
            Some(recovery),
            &format!(
                "unready after {} ms, listener closed after {} ms; last stream done {} ms after SIGTERM; clean exit {} ms after SIGTERM; recovery = restart on the same port + 20 requests ok",
                unready.unwrap_or_default().as_millis(),
                refused.unwrap_or_default().as_millis(),
                last_end.saturating_sub(term_t).as_millis(),
                exited_after.as_millis()
            ),
        );
    });
}

/// A provider that cuts every stream after its first token fails every one of those
/// requests, and nothing may retry them (the client has the first token). The breaker is
/// the only protection, but it hears only about failures before the first byte: an attempt
/// counts as a success as soon as its first event arrives, and what happens to the relay
/// afterwards (upstream_stream_error, idle_timeout) never reaches the breaker or the
/// balancer. So such a provider keeps its full share of traffic for as long as it cuts.
#[test]
fn stream_cutting_provider_is_taken_out_of_rotation() {
    scenario(async {
        let dir = Workdir::new("cutter");
        let a = Arc::new(sim().await);
        let b = sim().await;
        let config = dir.join("routes.yaml");
        let route = route_yaml(&[
            Provider::new("a", a.base_url()),
            Provider::new("b", b.base_url()),
        ]);
        std::fs::write(&config, route).unwrap();
        let sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "5s", "main");
        let client = client();
        let epoch = Instant::now();
        let load = open_loop(&client, &sidecar.base_url(), epoch, RATE, ms(5000), |_| {
            Shape::stream(24, 25)
        });
        at(epoch, ms(1000)).await;
        let cuts_from = epoch.elapsed();
        a.set_fault(Some(Fault::Drop));
        at(epoch, ms(4000)).await;
        a.set_fault(None);
        let cuts_end = epoch.elapsed();
        let records = load.await.unwrap();
        let tally = check("stream cutter", &records, |r| {
            r.from("a") && r.failure().unwrap().code == "upstream_stream_error"
        });
        // After the first second of cutting, the breaker (5 failures in a row) should have
        // taken a out of rotation: at most its half-open probes go there.
        let to_a_late = records
            .iter()
            .filter(|r| r.from("a") && r.start >= cuts_from + ms(1000) && r.start < cuts_end)
            .count();
        tally.print(
            "provider cutting every stream after its first token for 3 s",
            None,
            &format!("{to_a_late} streams sent to a in the last 2 s of the cutting"),
        );
        assert!(
            to_a_late <= 6,
            "a provider cutting every stream stays in rotation: {to_a_late} streams sent to it in the last 2 s of the cutting ({tally:?})"
        );
        wait_in_flight_zero(&client, sidecar.admin, ms(5000)).await;
    });
}

/// Streams that outlive `--drain-timeout` cannot finish; the promise is then the same as
/// for any failure after the first byte: the stream ends with an OpenAI-shaped error event,
/// never a silent cut the app cannot tell from a complete answer.
#[test]
fn sigterm_with_streams_longer_than_the_drain_timeout() {
    scenario(async {
        const STREAMS: usize = 20;
        let dir = Workdir::new("drain-timeout");
        let a = sim().await;
        let config = dir.join("routes.yaml");
        std::fs::write(&config, route_yaml(&[Provider::new("a", a.base_url())])).unwrap();
        let mut sidecar = SidecarProc::start(&dir, &config, "127.0.0.1:0", "1s", "main");
        let client = client();
        let epoch = Instant::now();
        // About 3 s each (60 tokens 50 ms apart): longer than the 1 s drain timeout.
        let shape = Shape {
            stream: true,
            ttft_ms: 20,
            itl_ms: 50,
            tokens: 60,
        };
        let tasks: Vec<_> = (0..STREAMS)
            .map(|i| send(&client, &sidecar.base_url(), epoch, i, shape))
            .collect();
        let started = Instant::now();
        loop {
            let (_, metrics) = admin_get(&client, sidecar.admin, "/metrics").await;
            if metric_sum(&metrics, IN_FLIGHT) == Some(STREAMS as f64) {
                break;
            }
            assert!(started.elapsed() < ms(10_000), "streams in flight");
            tokio::time::sleep(ms(20)).await;
        }
        let term_at = Instant::now();
        signal(sidecar.pid(), "TERM");
        let mut records = Vec::new();
        for t in tasks {
            records.push(t.await.unwrap());
        }
        let status = sidecar.wait_exit(ms(10_000));
        let exited_after = term_at.elapsed();
        assert!(
            status.is_some(),
            "the sidecar exits after the drain timeout"
        );
        let tally = Tally::of(&records);
        tally.print(
            "SIGTERM with 20 streams longer than the drain timeout (1 s)",
            None,
            &format!(
                "exit {} ms after SIGTERM ({status:?})",
                exited_after.as_millis()
            ),
        );
        check("drain timeout", &records, |r| {
            r.failure().unwrap().mid_stream
        });
    });
}
