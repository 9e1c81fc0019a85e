//! Prometheus, for real (Debian's `prometheus` 2.42 and its `promtool`; `make
//! observability-test` installs them):
//!
//! * the chart's alert rules, rendered the way `templates/monitoring.yaml` renders them, pass
//!   `promtool check rules`, and `promtool test rules` runs `rules_test.yaml`: every alert
//!   fires on a synthetic burn and stays quiet on a healthy series;
//! * a real Prometheus scrapes the real `tailwarden-sidecar` binary (admin port `/metrics`,
//!   every second) while `tailwarden-bench` drives streaming and non-streaming load through
//!   it to two `tailwarden-sim` providers for 20 s; then every metric the docs list is there
//!   with its type and labels, every panel expression of the Grafana dashboard (with `$route`
//!   as `.*`) returns data, and every recording rule evaluates.
//!
//! Both are `#[ignore]`d in a plain `cargo test` (they need the Debian package); run them with
//! `make observability-test`. `TAILWARDEN_PROMETHEUS`, `TAILWARDEN_PROMTOOL` and
//! `TAILWARDEN_SIDECAR_BIN` override where the binaries are found.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeSet,
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use tailwarden_e2e::{fetch, proc::ChildProc, sidecar::Sidecar};

const SIM: &str = env!("CARGO_BIN_EXE_tailwarden-sim");
const BENCH: &str = env!("CARGO_BIN_EXE_tailwarden-bench");
/// The chart's default `monitoring.prometheusRule.availabilityObjective`.
const AVAILABILITY_OBJECTIVE: f64 = 99.9;
/// How long the load runs.
const LOAD: &str = "20s";

/// Every metric the sidecar exports: name, type, labels (besides Prometheus' job and instance).
const METRICS: &[(&str, &str, &[&str])] = &[
    (
        "gen_ai_client_token_usage",
        "histogram",
        &[
            "gen_ai_operation_name",
            "gen_ai_provider_name",
            "gen_ai_request_model",
            "gen_ai_token_type",
        ],
    ),
    (
        "gen_ai_client_operation_duration_seconds",
        "histogram",
        &[
            "gen_ai_operation_name",
            "gen_ai_provider_name",
            "gen_ai_request_model",
            "error_type",
        ],
    ),
    (
        "gen_ai_client_operation_time_to_first_chunk_seconds",
        "histogram",
        &[
            "gen_ai_operation_name",
            "gen_ai_provider_name",
            "gen_ai_request_model",
        ],
    ),
    (
        "tailwarden_requests_total",
        "counter",
        &["route", "provider", "model", "status_class"],
    ),
    (
        "tailwarden_request_duration_seconds",
        "histogram",
        &["route", "provider", "model", "status_class"],
    ),
    (
        "tailwarden_time_to_first_token_seconds",
        "histogram",
        &["route", "provider", "model"],
    ),
    (
        "tailwarden_time_per_output_token_seconds",
        "histogram",
        &["route", "provider", "model"],
    ),
    (
        "tailwarden_upstream_attempt_duration_seconds",
        "histogram",
        &["route", "provider", "outcome"],
    ),
    ("tailwarden_overhead_seconds", "histogram", &["route"]),
    (
        "tailwarden_retries_total",
        "counter",
        &["route", "provider", "reason"],
    ),
    ("tailwarden_hedges_total", "counter", &["route", "outcome"]),
    (
        "tailwarden_circuit_breaker_state",
        "gauge",
        &["route", "provider"],
    ),
    (
        "tailwarden_circuit_breaker_transitions_total",
        "counter",
        &["route", "provider", "to", "reason"],
    ),
    (
        "tailwarden_tokens_total",
        "counter",
        &[
            "route",
            "provider",
            "model",
            "type",
            "namespace",
            "workload",
        ],
    ),
    (
        "tailwarden_cost_total",
        "counter",
        &["route", "provider", "model", "namespace", "workload"],
    ),
    ("tailwarden_in_flight_requests", "gauge", &["route"]),
    (
        "tailwarden_slo_requests_total",
        "counter",
        &["route", "objective", "outcome"],
    ),
    (
        "tailwarden_slo_objective_ratio",
        "gauge",
        &["route", "objective"],
    ),
    (
        "tailwarden_upstream_connections_in_use",
        "gauge",
        &["route", "provider"],
    ),
    (
        "tailwarden_upstream_connections_max",
        "gauge",
        &["route", "provider"],
    ),
    ("tailwarden_config_reloads_total", "counter", &["result"]),
    ("tailwarden_config_last_load_valid", "gauge", &[]),
    (
        "tailwarden_tier_requests_total",
        "counter",
        &["route", "tier"],
    ),
    (
        "tailwarden_rate_limited_total",
        "counter",
        &["route", "limit", "scope", "status"],
    ),
    ("tailwarden_queue_wait_seconds", "histogram", &["route"]),
    (
        "tailwarden_rate_limit_backend_errors_total",
        "counter",
        &["reason"],
    ),
    (
        "tailwarden_cache_requests_total",
        "counter",
        &["route", "result"],
    ),
    ("tailwarden_cache_entries", "gauge", &["route"]),
    ("tailwarden_cache_bytes", "gauge", &["route"]),
    // tailwarden_capability_actions_total needs requests with unsupported parameters, which
    // the bench does not send: sidecar/tests/policy_proxy.rs checks it.
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("prometheus")
}

/// `prometheus` or `promtool`: `$TAILWARDEN_PROMETHEUS` / `$TAILWARDEN_PROMTOOL`, else on PATH.
fn tool(name: &str) -> PathBuf {
    let var = format!("TAILWARDEN_{}", name.to_ascii_uppercase());
    if let Some(p) = std::env::var_os(&var) {
        return p.into();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{name} not found: run `make observability-test` (installs Debian's prometheus) or set {var}")
        })
}

fn workdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tw-prometheus-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The chart's rules file as a Prometheus rule file, with `ERROR_BUDGET` replaced the way
/// templates/monitoring.yaml does it: `printf "%g" (round ((100 - objective) / 100) 8)`.
fn rendered_rules() -> String {
    let budget = ((100.0 - AVAILABILITY_OBJECTIVE) / 100.0 * 1e8).round() / 1e8;
    std::fs::read_to_string(root().join("charts/tailwarden/rules/tailwarden.rules.yaml"))
        .unwrap()
        .replace("ERROR_BUDGET", &format!("{budget}"))
}

/// The helm e2e/controlplane/build.sh builds, if it has: `$TAILWARDEN_HELM` or under .cache.
fn helm() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TAILWARDEN_HELM") {
        return Some(p.into());
    }
    std::fs::read_dir(root().join(".cache/controlplane"))
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("bin/helm"))
        .find(|p| p.is_file())
}

/// Names after `- alert:` / `- record:` in a rules file.
fn rule_names(rules: &str, kind: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix(&format!("- {kind}:")))
        .map(|n| n.trim().to_owned())
        .collect()
}

/// Runs a command to completion; panics with its output unless it succeeded.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("command runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

#[test]
#[ignore = "needs Debian's prometheus package: make observability-test"]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = workdir("rules");
    let rules = rendered_rules();
    assert!(!rules.contains("ERROR_BUDGET"));
    std::fs::write(dir.join("tailwarden.rules.rendered.yaml"), &rules).unwrap();
    let tests = std::fs::read_to_string(here().join("rules_test.yaml")).unwrap();
    std::fs::write(dir.join("rules_test.yaml"), &tests).unwrap();
    let promtool = tool("promtool");

    // The same rules as the chart's PrometheusRule, when the real helm is at hand.
    if let Some(helm) = helm() {
        let out = run(Command::new(helm)
            .args(["template", "tw", "charts/tailwarden", "--show-only"])
            .args(["templates/monitoring.yaml", "--set"])
            .arg("monitoring.prometheusRule.enabled=true")
            .current_dir(root()));
        let rule = serde_norway::Deserializer::from_str(&out)
            .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
            .find(|doc| doc["kind"] == "PrometheusRule")
            .expect("a PrometheusRule");
        let ours: Value = serde_norway::from_str(&rules).unwrap();
        assert_eq!(rule["spec"], ours, "the chart renders other rules");
    } else {
        eprintln!("helm not built (e2e/controlplane/build.sh): not comparing with the chart");
    }

    let out = run(Command::new(&promtool)
        .args(["check", "rules", "tailwarden.rules.rendered.yaml"])
        .current_dir(&dir));
    assert!(out.contains("SUCCESS"), "{out}");

    // Every alert has unit tests.
    let alerts = rule_names(&rules, "alert");
    assert!(alerts.len() >= 6, "{alerts:?}");
    for alert in &alerts {
        assert!(
            tests.contains(&format!("alertname: {alert}\n")),
            "rules_test.yaml has no test for {alert}"
        );
    }

    let out = run(Command::new(&promtool)
        .args(["test", "rules", "rules_test.yaml"])
        .current_dir(&dir));
    assert!(out.contains("SUCCESS"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Builds `tailwarden-sidecar` into the target folder of this test's binaries (a no-op when
/// it is up to date) and returns its path.
fn sidecar_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TAILWARDEN_SIDECAR_BIN") {
        return PathBuf::from(p);
    }
    let bench = Path::new(BENCH);
    let profile_dir = bench.parent().expect("binary folder");
    let target_dir = profile_dir.parent().expect("target folder");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "-q",
        "-p",
        "tailwarden-sidecar",
        "--bin",
        "tailwarden-sidecar",
    ])
    .arg("--target-dir")
    .arg(target_dir);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    assert!(cmd.status().expect("cargo runs").success(), "build failed");
    profile_dir.join("tailwarden-sidecar")
}

fn start_sim(dir: &Path, name: &str, profile: &str) -> (ChildProc, SocketAddr) {
    let mut cmd = Command::new(SIM);
    cmd.args(["--listen", "127.0.0.1:0", "--threads", "1", "--seed", "7"])
        .arg("--profile")
        .arg(here().join(profile));
    let mut sim = ChildProc::spawn(name, &cmd, &dir.join(format!("{name}.log"))).unwrap();
    let addr = sim
        .wait_for_line("listening on ADDR", Duration::from_secs(15), |l| {
            l.trim().strip_prefix("listening on ")?.parse().ok()
        })
        .unwrap();
    (sim, addr)
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Percent-encoding for a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    addr: SocketAddr,
}

impl Prometheus {
    /// GET an API path; the `data` of a successful answer.
    fn api(&self, path: &str) -> Value {
        let r = fetch::get(self.addr, path, Duration::from_secs(10)).unwrap();
        let v: Value =
            serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{path}: {e}: {}", r.text()));
        assert_eq!(v["status"], "success", "{path}: {v}");
        v["data"].clone()
    }

    /// An instant query's result vector.
    fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)));
        assert_eq!(data["resultType"], "vector", "{expr}: {data}");
        data["result"].as_array().cloned().unwrap_or_default()
    }
}

fn finite(result: &[Value]) -> bool {
    result.iter().any(|s| {
        s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    })
}

/// Every `expr` of the dashboard's panels (rows included), with its panel's title.
fn panel_exprs(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            walk(&p["panels"], out);
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push((p["title"].as_str().unwrap_or("").to_owned(), e.to_owned()));
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

#[test]
#[ignore = "needs Debian's prometheus package: make observability-test"]
fn a_real_prometheus_scraping_a_loaded_sidecar_has_every_metric_and_every_panel_has_data() {
    let dir = workdir("e2e");
    let sidecar_bin = sidecar_binary();
    let prometheus_bin = tool("prometheus");

    let (_primary, primary) = start_sim(&dir, "sim-primary", "primary.yaml");
    let (_backup, backup) = start_sim(&dir, "sim-backup", "backup.yaml");
    let route = std::fs::read_to_string(here().join("route.yaml"))
        .unwrap()
        .replace("${PRIMARY_URL}", &format!("http://{primary}/v1"))
        .replace("${BACKUP_URL}", &format!("http://{backup}/v1"));
    std::fs::write(dir.join("route.yaml"), route).unwrap();
    // With the OpenTelemetry GenAI metrics on, as OTEL_SEMCONV_STABILITY_OPT_IN asks.
    let sidecar = Sidecar::start_with_env(
        &sidecar_bin,
        &dir.join("route.yaml"),
        &dir.join("sidecar.log"),
        // ... and the workload identity the injector gives a pod of Deployment `web`.
        &[
            (
                "OTEL_SEMCONV_STABILITY_OPT_IN",
                "gen_ai_latest_experimental",
            ),
            ("TAILWARDEN_POD_NAMESPACE", "shop"),
            ("TAILWARDEN_POD_NAME", "web-7d9c-x2k4q"),
            ("TAILWARDEN_WORKLOAD_KIND", "Deployment"),
            ("TAILWARDEN_WORKLOAD_NAME", "web"),
        ],
    )
    .unwrap();

    std::fs::write(dir.join("tailwarden.rules.rendered.yaml"), rendered_rules()).unwrap();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: [tailwarden.rules.rendered.yaml]\n\
             scrape_configs:\n\
             - job_name: tailwarden-sidecar\n  \
               static_configs: [{{targets: ['{}']}}]\n",
            sidecar.admin
        ),
    )
    .unwrap();
    let web = free_port();
    let mut cmd = Command::new(&prometheus_bin);
    cmd.arg(format!(
        "--config.file={}",
        dir.join("prometheus.yml").display()
    ))
    .arg(format!(
        "--storage.tsdb.path={}",
        dir.join("data").display()
    ))
    .arg(format!("--web.listen-address={web}"))
    .arg("--log.level=warn");
    let mut prom_proc = ChildProc::spawn("prometheus", &cmd, &dir.join("prometheus.log")).unwrap();
    prom_proc
        .wait_until(
            &format!("GET http://{web}/-/ready to answer 200"),
            Duration::from_secs(30),
            || fetch::get(web, "/-/ready", Duration::from_secs(1)).is_ok_and(|r| r.status == 200),
        )
        .unwrap();
    let prom = Prometheus { addr: web };

    // Streaming and non-streaming load at once, through the sidecar.
    let bench = |stream: bool, rate: &str, model: &str, log: &str, headers: &[&str]| {
        let mut cmd = Command::new(BENCH);
        cmd.args([
            "--url",
            &sidecar.base_url(),
            "--rate",
            rate,
            "--duration",
            LOAD,
        ])
        .args(["--model", model, "--timeout", "15s", "--quiet"])
        .args(headers.iter().flat_map(|h| ["--header", h]))
        .stdout(Stdio::from(std::fs::File::create(dir.join(log)).unwrap()))
        .stderr(Stdio::inherit());
        if stream {
            cmd.arg("--stream");
        }
        cmd.spawn().expect("tailwarden-bench starts")
    };
    let started = Instant::now();
    let mut streams = bench(
        true,
        "25",
        "gpt-4.1",
        "bench-stream.txt",
        &["x-tenant: streams"],
    );
    let mut plain = bench(
        false,
        "10",
        "gpt-4.1-mini",
        "bench-plain.txt",
        &["x-tenant: plain"],
    );
    // One tenant over its 30 requests/s (rate-limited panel) and one that asks for cached
    // answers (cache panels): the same prompt every time, so all but the first are hits.
    let mut noisy = bench(
        false,
        "36",
        "gpt-4.1-mini",
        "bench-noisy.txt",
        &["x-tenant: noisy"],
    );
    let mut cached = bench(
        false,
        "5",
        "gpt-4.1-mini",
        "bench-cached.txt",
        &["x-tenant: cached", "x-tailwarden-cache: force"],
    );
    assert!(streams.wait().unwrap().success(), "streaming load failed");
    assert!(plain.wait().unwrap().success(), "non-streaming load failed");
    assert!(noisy.wait().unwrap().success(), "rate-limited load failed");
    assert!(cached.wait().unwrap().success(), "cached load failed");
    eprintln!("load ran for {:?}", started.elapsed());
    // Two more scrapes and rule evaluations after the last request.
    std::thread::sleep(Duration::from_secs(3));

    let targets = prom.api("/api/v1/targets");
    let active = targets["activeTargets"].as_array().unwrap();
    assert_eq!(active.len(), 1, "{targets}");
    assert_eq!(active[0]["health"], "up", "{targets}");

    // Every metric, with its type and exactly its labels.
    for (name, kind, labels) in METRICS {
        let meta = prom.api(&format!("/api/v1/metadata?metric={name}"));
        assert_eq!(meta[name][0]["type"], *kind, "{name}: {meta}");
        let series_name = if *kind == "histogram" {
            format!("{name}_count")
        } else {
            (*name).to_owned()
        };
        let series = prom.api(&format!("/api/v1/series?match[]={series_name}"));
        let series = series.as_array().unwrap();
        assert!(!series.is_empty(), "no series of {name}");
        let want: BTreeSet<&str> = labels
            .iter()
            .copied()
            .chain(["__name__", "job", "instance"])
            .collect();
        for s in series {
            let mut got: BTreeSet<&str> =
                s.as_object().unwrap().keys().map(String::as_str).collect();
            // As the GenAI conventions have it, error_type is there only on failures
            // (Prometheus drops the empty value of successful calls).
            if *name == "gen_ai_client_operation_duration_seconds" {
                got.insert("error_type");
            }
            assert_eq!(got, want, "{name}: {s}");
        }
        if *name == "gen_ai_client_operation_duration_seconds" {
            assert!(
                series.iter().any(|s| s.get("error_type").is_some())
                    && series.iter().any(|s| s.get("error_type").is_none()),
                "{name}: failed and successful calls both have series: {series:?}"
            );
        }
    }

    // Everything the sidecar exports is documented.
    let docs = std::fs::read_to_string(root().join("docs/observability.md")).unwrap();
    let names = prom.api("/api/v1/label/__name__/values");
    for n in names.as_array().unwrap().iter().filter_map(Value::as_str) {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| n.strip_suffix(s))
            .filter(|f| METRICS.iter().any(|(m, k, _)| m == f && *k == "histogram"))
            .unwrap_or(n);
        if family.starts_with("tailwarden_") || family.starts_with("gen_ai_") {
            assert!(
                docs.contains(&format!("`{family}`")),
                "{family} is not in docs/observability.md"
            );
        }
    }

    // Every panel of the dashboard has data.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(
            root().join("charts/tailwarden/dashboards/tailwarden-routes.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let exprs = panel_exprs(&dashboard);
    assert!(exprs.len() >= 20, "{exprs:?}");
    let mut empty = Vec::new();
    for (title, expr) in &exprs {
        let expr = expr.replace("${route}", ".*").replace("$route", ".*");
        let result = prom.query(&expr);
        if !finite(&result) {
            empty.push(format!("{title}: {expr} → {result:?}"));
        }
    }
    assert!(
        empty.is_empty(),
        "panels without data:\n{}",
        empty.join("\n")
    );
    // The route variable's query lists the route.
    let routes = prom.api(&format!(
        "/api/v1/label/route/values?match[]={}",
        encode("tailwarden_requests_total")
    ));
    assert_eq!(routes, serde_json::json!(["shop/chat"]));

    // Every rule evaluates without error; every recording rule has a value.
    let rules = prom.api("/api/v1/rules");
    let mut evaluated = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            assert_eq!(rule["health"], "ok", "{rule}");
            evaluated += 1;
        }
    }
    let rendered = rendered_rules();
    assert_eq!(
        evaluated,
        rule_names(&rendered, "record").len() + rule_names(&rendered, "alert").len()
    );
    for record in rule_names(&rendered, "record") {
        let result = prom.query(&record);
        assert!(finite(&result), "recording rule {record}: {result:?}");
    }

    // The load did what the panels show: retries, hedges, breaker trips, SLO verdicts.
    for expr in [
        "sum(tailwarden_retries_total)",
        "sum(tailwarden_hedges_total{outcome=\"started\"})",
        "sum(tailwarden_circuit_breaker_transitions_total{to=\"open\"})",
        "sum(tailwarden_slo_requests_total{objective=\"ttft\"})",
        "sum(tailwarden_cost_total)",
        "sum(tailwarden_cost_total{namespace=\"shop\",workload=\"web\"})",
        "sum(tailwarden_rate_limited_total{limit=\"requests_per_second\",scope=\"tenant\"})",
        "sum(tailwarden_cache_requests_total{result=\"hit\"})",
        "sum(tailwarden_tier_requests_total{tier=\"everyday\"})",
    ] {
        let v: f64 = prom.query(expr)[0]["value"][1]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(v > 0.0, "{expr} = {v}");
    }

    prom_proc.stop();
    drop(sidecar);
    let _ = std::fs::remove_dir_all(&dir);
}
