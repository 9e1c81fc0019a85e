//! The battery's foundations against real sockets: both upstream stacks — `tailwarden-sim`
//! (hyper) and `e2e/pyupstream/sim.py` (aiohttp) — give every request the fate the model in
//! `sim::fate` draws for it, count attempts across the providers of a group, and send the
//! account limit's `x-ratelimit-*` headers; and the never-worse check over a short battery
//! subset, with the cells where current main is known to lose named.
//!
//! The Python upstream needs `make pyupstream-deps` (part of `make test`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tailwarden_e2e::battery::{self, CellSpec, Topology, Upstream};
use tailwarden_e2e::bench::{self, BenchConfig};
use tailwarden_e2e::fetch;
use tailwarden_e2e::oracle;
use tailwarden_e2e::proc::ChildProc;
use tailwarden_e2e::sim::{FateLedger, Profile, SimOptions, SimServer};

const SIM_BIN: &str = env!("CARGO_BIN_EXE_tailwarden-sim");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

fn python() -> PathBuf {
    let p = root().join(".cache/pyupstream/bin/python");
    assert!(
        p.is_file(),
        "{} is missing: run `make pyupstream-deps` (make test does)",
        p.display()
    );
    p
}

fn workdir(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tw-battery-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("workdir");
    p
}

/// Starts the Python upstream with `profiles` (file paths); returns it and its addresses.
fn start_python(profiles: &[PathBuf], seed: u64, dir: &Path) -> (ChildProc, Vec<SocketAddr>) {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("e2e/pyupstream/sim.py"))
        .args(["--seed", &seed.to_string()]);
    for p in profiles {
        cmd.arg("--profile").arg(p);
    }
    let mut proc = ChildProc::spawn("aiohttp upstream", &cmd, &dir.join("py.log")).expect("spawn");
    let addrs = profiles
        .iter()
        .map(|_| {
            proc.wait_for_line("listening on", Duration::from_secs(20), |l| {
                l.strip_prefix("listening on ")
                    .and_then(|a| a.trim().parse().ok())
            })
            .expect("listening line")
        })
        .collect();
    (proc, addrs)
}

fn profile_file(dir: &Path, name: &str) -> (PathBuf, Profile) {
    let text = std::fs::read_to_string(root().join(format!("e2e/profiles/battery/{name}.yaml")))
        .expect("profile file");
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, &text).expect("write");
    (path, Profile::from_yaml(&text, name).expect("parses"))
}

/// Runs `requests` streamed requests with ids `r0…` at `url` and compares each with the
/// fate the model gives it.
fn assert_follows_model(rt: &tokio::runtime::Runtime, url: String, profile: &Profile, seed: u64) {
    let rate = 40.0;
    let mut cfg = BenchConfig::new(url.clone());
    cfg.rate = Some(rate);
    cfg.duration = Duration::from_secs(3);
    cfg.stream = true;
    cfg.request_ids = Some("r".to_owned());
    cfg.record_requests = true;
    cfg.timeout = Duration::from_secs(20);
    let report = rt.block_on(bench::run(cfg)).expect("bench run");
    let n = report.records.len();
    assert_eq!(n, 120, "{url}");
    let measured = battery::analysis::outcomes(&report.records, n);
    let providers = [oracle::Provider {
        name: "a".to_owned(),
        profile: profile.compile("t").expect("valid"),
        tier: 0,
    }];
    let workload = oracle::Workload {
        seed,
        prefix: "r".to_owned(),
        requests: n,
        rate,
    };
    let predicted = oracle::direct(&providers, &workload, 20_000.0);
    let f = battery::analysis::fidelity(&measured, &predicted.outcomes);
    // Every success or failure is the predicted one, and no answer comes earlier than its
    // fate says (timers fire late, never early). How late depends on how busy the two cores
    // are, so only a gross bound is checked: a wrong draw is off by the spread of the
    // distribution, hundreds of ms.
    assert_eq!(f.same_outcome_percent, 100.0, "{url}: {f:?}");
    assert_eq!(f.early, 0, "{url}: {f:?}");
    let excess = f.median_excess_ms.expect("some successes");
    assert!(excess < 60.0, "{url}: {f:?}");
    assert!(
        predicted.summary().errors >= 3,
        "the profile should fail a few of 120 requests: {:?}",
        predicted.summary()
    );
}

#[test]
fn both_upstreams_follow_the_fate_model() {
    let dir = workdir("model");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let seed = 3;
    let (path, profile) = profile_file(&dir, "independent");

    let sim = rt.block_on(async {
        SimServer::bind_with(
            "127.0.0.1:0".parse().expect("addr"),
            &profile,
            seed,
            SimOptions {
                ledger: Some(FateLedger::new()),
                epoch: None,
            },
        )
        .await
        .expect("bind")
        .spawn()
    });
    assert_follows_model(&rt, sim.base_url(), &profile, seed);

    let (_py, addrs) = start_python(&[path], seed, &dir);
    assert_follows_model(&rt, format!("http://{}/v1", addrs[0]), &profile, seed);
    let _ = std::fs::remove_dir_all(&dir);
}

fn chat(addr: SocketAddr, id: &str) -> fetch::Response {
    fetch::post_json(
        addr,
        "/v1/chat/completions",
        &[("x-request-id".to_owned(), id.to_owned())],
        r#"{"model":"gpt-4.1-mini","messages":[{"role":"user","content":"hi"}]}"#,
        Duration::from_secs(10),
    )
    .expect("request")
}

#[test]
fn attempts_are_counted_across_a_group_and_accounts_run_out() {
    let dir = workdir("ledger");
    let (path, _) = profile_file(&dir, "account-limit");
    let (_py, addrs) = start_python(&[path.clone(), path.clone()], 1, &dir);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let profile =
        Profile::from_yaml(&std::fs::read_to_string(&path).expect("read"), "a").expect("parses");
    let ledger = FateLedger::new();
    let sims: Vec<_> = (0..2)
        .map(|_| {
            rt.block_on(async {
                SimServer::bind_with(
                    "127.0.0.1:0".parse().expect("addr"),
                    &profile,
                    1,
                    SimOptions {
                        ledger: Some(ledger.clone()),
                        epoch: None,
                    },
                )
                .await
                .expect("bind")
                .spawn()
            })
        })
        .collect();
    let hyper: Vec<SocketAddr> = sims.iter().map(|s| s.addr()).collect();
    for group in [&addrs, &hyper] {
        // The second attempt of a request is attempt 2 on the other provider too.
        assert_eq!(chat(group[0], "same").header("x-sim-attempt"), Some("1"));
        assert_eq!(chat(group[1], "same").header("x-sim-attempt"), Some("2"));
        assert_eq!(chat(group[1], "other").header("x-sim-attempt"), Some("1"));
        // 24 requests per 1 s window: 60 at once (a window may turn over once while they
        // arrive, so up to 48 are answered) leave the account out, with its headers.
        let replies: Vec<fetch::Response> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..60)
                .map(|i| scope.spawn(move || chat(group[0], &format!("k{i}"))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        let ok = replies.iter().filter(|r| r.status == 200).count();
        assert!((24..=48).contains(&ok), "{ok} answered");
        assert!(
            replies
                .iter()
                .filter(|r| r.status == 200)
                .all(|r| r.header("x-ratelimit-limit-requests") == Some("24"))
        );
        let refused = replies.into_iter().find(|r| r.status == 429);
        let r = refused.expect("the account ran out");
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
        let ra: u64 = r
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After");
        assert_eq!(ra, 1);
        assert!(r.header("x-ratelimit-reset-requests").is_some());
        // The other provider is another account: not out.
        assert_eq!(chat(group[1], "z").status, 200);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One provider, where main before #15 phase B lost to a direct call by a wide margin: with
/// independent 429s every request waited out the provider's 1 s cool-downs (P50 ~270 → ~400
/// ms in `make bench`), and with an exhausted account it waited for every reset (P50 ~300 ms
/// → ~1.2 s). Since lone 429s no longer cool a provider and a first attempt never waits
/// (`docs/reliability.md`, resilience policies) both must hold; a cell that loses again goes
/// on `KNOWN_LOSSES` with its reason. The verdict is on what the policy did, with the hop
/// reported beside it and 0.5 % of requests free to swap places (`docs/battery.md`, the
/// verdicts): judged as measured, `account-limit/one/aiohttp` broke P50 by 0.05–5 ms on the
/// hop alone — once on CI — where the sidecar has nothing to cut. Cells that lose by a few ms only
/// (`independent/two-equal`) are left to `make bench`: 15 s of a small margin could flip.
const SUBSET: [(&str, Topology, Upstream); 2] = [
    ("independent", Topology::One, Upstream::Hyper),
    ("account-limit", Topology::One, Upstream::Aiohttp),
];
const KNOWN_LOSSES: [&str; 0] = [];

#[test]
fn never_worse_subset() {
    let sidecar = std::env::var_os("TAILWARDEN_BATTERY_SIDECAR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(SIM_BIN).with_file_name("tailwarden-sidecar"));
    assert!(sidecar.is_file(), "{} is not built", sidecar.display());
    let opts = battery::BatteryOptions {
        sidecar,
        python: Some(python()),
        script: root().join("e2e/pyupstream/sim.py"),
        workdir: workdir("subset"),
        rate: 30.0,
        duration: Duration::from_secs(15),
        seed: 7,
        client_timeout: Duration::from_secs(60),
        cells: SUBSET
            .iter()
            .map(|(p, t, u)| CellSpec {
                profile: (*p).to_owned(),
                topology: *t,
                upstream: *u,
            })
            .collect(),
        progress: true,
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (_tx, stop) = tokio::sync::watch::channel(false);
    let result = battery::run(&opts, &rt, &stop);
    assert!(result.failed.is_empty(), "{:?}", result.failed);
    eprintln!("{}", battery::render_markdown(&result));
    for cell in &result.cells {
        let id = cell.spec.id();
        // The upstream met the model: the pairing (and so the verdict) is sound.
        assert_eq!(
            cell.fidelity.same_outcome_percent, 100.0,
            "{id}: {:?}",
            cell.fidelity
        );
        if KNOWN_LOSSES.contains(&id.as_str()) {
            assert!(
                !cell.invariant.holds(),
                "{id} no longer loses to direct: take it off KNOWN_LOSSES so it must hold"
            );
        } else {
            assert!(
                cell.invariant.holds(),
                "{id}: worse than direct: {:?}",
                cell.invariant.violations()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&opts.workdir);
}
