//! The operator under churn, on a real kube-apiserver + etcd + controller-manager (issue #9):
//! 1 000 route create → update → delete cycles, 20 in flight, with the kube-apiserver
//! restarted half-way (stopped, down for a few seconds, started again with the same flags
//! against the same etcd). Meanwhile long-lived routes are updated and routes whose models
//! conflict are resolved by deleting or editing the route that held the model first.
//!
//! Then: the end state is right (every surviving route has its ConfigMap with the latest
//! spec, `Ready` and `observedGeneration` current; deleted routes left no ConfigMap), the
//! operator recovered from the restart (a route created right after it is reconciled within
//! a bound), and there is no hot loop: reconciles per route write stay bounded and the
//! reconcile counter stays flat once the churn stops.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeSet,
    future::Future,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::{
    Api, Client, Config, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::{Value, json};
use tailwarden_crds::InferenceRoute;
use tailwarden_operator::render::{self, SecretKeys};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Create → update → delete cycles.
const CYCLES: usize = 1000;
/// Cycles in flight at once (one worker each).
const WORKERS: usize = 20;
const _: () = assert!(CYCLES.is_multiple_of(WORKERS));
/// Route names each worker cycles through: a name comes back (as a new object, with a new
/// uid) while the ConfigMap of its previous incarnation may still be being collected.
const NAMES_PER_WORKER: usize = 4;
/// Every this many cycles a worker also updates its long-lived route `keep-<worker>`.
const KEEP_EVERY: usize = 5;
/// Pairs of routes per model-conflict scenario.
const PAIRS: usize = 3;
/// How long the kube-apiserver stays down during the restart.
const APISERVER_DOWN: Duration = Duration::from_secs(3);
/// A route created after the restart must be Ready within this.
const RECOVERY_BOUND: Duration = Duration::from_secs(45);
/// How long the reconcile counter must stay flat after the churn.
const QUIET: Duration = Duration::from_secs(8);
/// Reconciles per route write (create or spec update), on average. Each write causes one
/// reconcile from the route's own watch event and usually one more from the event of the
/// ConfigMap that reconcile wrote (the `owns` watch; unchanged ConfigMaps cause none).
/// Deletes cause none: the deleted route is gone from the cache. The restart adds a bounded
/// burst (the watches re-list: one reconcile per live route per watch) and the requeues of
/// reconciles that failed while the API server was away. So about 2; 3 leaves room for the
/// restart and catches any feedback loop, which would grow without bound.
const MAX_RECONCILES_PER_WRITE: f64 = 3.0;
const NS: &str = "churn";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The operator binary, killed on drop.
struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spec(models: &[&str], version: u32) -> Value {
    json!({
        "models": models,
        "providers": [{"name": "p", "baseUrl": "http://127.0.0.1:1/v1"}],
        "timeouts": {"firstByte": "10s", "total": format!("{}s", 30 + version)},
    })
}

fn route(name: &str, spec: Value) -> InferenceRoute {
    serde_json::from_value(json!({
        "apiVersion": "tailwarden.io/v1alpha1", "kind": "InferenceRoute",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }))
    .unwrap()
}

/// How long a single write may keep failing (the API server restart included) before the
/// test gives up.
const WRITE_DEADLINE: Duration = Duration::from_secs(90);

/// Runs `op` until it succeeds; `done` says which errors mean the write already happened
/// (an earlier attempt whose response was lost to the restart). Returns the failed attempts.
async fn write<F, Fut, T>(what: &str, done: impl Fn(u16) -> bool, mut op: F) -> usize
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let deadline = Instant::now() + WRITE_DEADLINE;
    let mut failed = 0;
    loop {
        match op().await {
            Ok(_) => return failed,
            Err(kube::Error::Api(s)) if done(s.code) => return failed,
            Err(e) => {
                failed += 1;
                assert!(Instant::now() < deadline, "{what}: still failing: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn create(api: &Api<InferenceRoute>, name: &str, spec: Value) -> usize {
    let (obj, params) = (route(name, spec), PostParams::default());
    write(
        &format!("create {name}"),
        |c| c == 409,
        || api.create(&params, &obj),
    )
    .await
}

async fn update(api: &Api<InferenceRoute>, name: &str, patch: Value) -> usize {
    let (patch, params) = (Patch::Merge(&patch), PatchParams::default());
    write(
        &format!("update {name}"),
        |_| false,
        || api.patch(name, &params, &patch),
    )
    .await
}

async fn delete(api: &Api<InferenceRoute>, name: &str) -> usize {
    let params = DeleteParams::default();
    write(
        &format!("delete {name}"),
        |c| c == 404,
        || api.delete(name, &params),
    )
    .await
}

/// What the test did, for the reconciles-per-write ratio.
#[derive(Default)]
struct Counts {
    cycles: AtomicUsize,
    creates: AtomicUsize,
    updates: AtomicUsize,
    deletes: AtomicUsize,
    /// Writes that failed and were retried (the API server restart).
    retried: AtomicUsize,
}

impl Counts {
    fn writes(&self) -> usize {
        self.creates.load(Ordering::Relaxed) + self.updates.load(Ordering::Relaxed)
    }
}

/// One worker: `cycles` create → update → delete cycles over its own route names, and every
/// [`KEEP_EVERY`] cycles a spec update of its long-lived route. Returns the last version
/// of that route's spec.
async fn worker(w: usize, cycles: usize, api: Api<InferenceRoute>, counts: Arc<Counts>) -> u32 {
    let keep = format!("keep-{w}");
    let mut keep_version = 0;
    for j in 0..cycles {
        let name = format!("c{w}-{}", j % NAMES_PER_WORKER);
        let model = format!("m-{name}");
        let r = create(&api, &name, spec(&[&model], 0)).await;
        counts.creates.fetch_add(1, Ordering::Relaxed);
        counts.retried.fetch_add(r, Ordering::Relaxed);
        let r = update(&api, &name, json!({"spec": spec(&[&model], 1)})).await;
        counts.updates.fetch_add(1, Ordering::Relaxed);
        counts.retried.fetch_add(r, Ordering::Relaxed);
        let r = delete(&api, &name).await;
        counts.deletes.fetch_add(1, Ordering::Relaxed);
        counts.retried.fetch_add(r, Ordering::Relaxed);
        if j % KEEP_EVERY == KEEP_EVERY - 1 {
            keep_version += 1;
            let model = format!("m-{keep}");
            let r = update(&api, &keep, json!({"spec": spec(&[&model], keep_version)})).await;
            counts.updates.fetch_add(1, Ordering::Relaxed);
            counts.retried.fetch_add(r, Ordering::Relaxed);
        }
        counts.cycles.fetch_add(1, Ordering::Relaxed);
    }
    keep_version
}

/// The operator's Prometheus text, fetched over plain HTTP/1.0.
async fn scrape(port: u16) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: operator\r\n\r\n")
        .await
        .ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).await.ok()?;
    out.starts_with("HTTP/1.0 200").then_some(out)
}

/// Sum of the samples of `metric` whose labels contain `labels` (`""`: all).
fn sample(text: &str, metric: &str, labels: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| l.contains(labels))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

async fn reconciles(port: u16) -> u64 {
    let text = scrape(port).await.expect("operator metrics");
    sample(&text, "tailwarden_operator_reconciles_total", "")
}

fn condition(route: &InferenceRoute, kind: &str) -> Option<(String, String)> {
    route
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == kind)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// What a route should look like at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Accepted and Ready for its current generation; its ConfigMap holds its current spec.
    Ready,
    /// Not accepted (ModelConflict) for its current generation; its ConfigMap still holds
    /// the last good config, which is this (unchanged) spec.
    Conflict,
}

/// Problems with the end state (empty: correct).
async fn end_state_problems(
    routes: &Api<InferenceRoute>,
    cms: &Api<ConfigMap>,
    expected: &[(String, Expect)],
    keep_versions: &[(String, u32)],
) -> Vec<String> {
    let mut problems = Vec::new();
    let Ok(all_routes) = routes.list(&ListParams::default()).await else {
        return vec!["cannot list routes".into()];
    };
    let Ok(all_cms) = cms
        .list(&ListParams::default().labels("tailwarden.io/route"))
        .await
    else {
        return vec!["cannot list ConfigMaps".into()];
    };
    let names: BTreeSet<String> = all_routes.items.iter().map(ResourceExt::name_any).collect();
    let want: BTreeSet<String> = expected.iter().map(|(n, _)| n.clone()).collect();
    if names != want {
        problems.push(format!(
            "routes: unexpected {:?}, missing {:?}",
            names.difference(&want).collect::<Vec<_>>(),
            want.difference(&names).collect::<Vec<_>>()
        ));
    }
    let cm_names: BTreeSet<String> = all_cms.items.iter().map(ResourceExt::name_any).collect();
    let want_cms: BTreeSet<String> = want
        .iter()
        .map(|n| format!("tailwarden-route-{n}"))
        .collect();
    if cm_names != want_cms {
        problems.push(format!(
            "ConfigMaps: left behind {:?}, missing {:?}",
            cm_names.difference(&want_cms).collect::<Vec<_>>(),
            want_cms.difference(&cm_names).collect::<Vec<_>>()
        ));
    }
    for (name, expect) in expected {
        let Some(r) = all_routes.items.iter().find(|r| r.name_any() == *name) else {
            continue;
        };
        let Some(cm) = all_cms
            .items
            .iter()
            .find(|c| c.name_any() == format!("tailwarden-route-{name}"))
        else {
            continue;
        };
        let generation = r.metadata.generation;
        let status = r.status.clone().unwrap_or_default();
        if status.observed_generation != generation {
            problems.push(format!(
                "{name}: observedGeneration {:?}, generation {generation:?}",
                status.observed_generation
            ));
        }
        if let Some(stale) = status
            .conditions
            .iter()
            .find(|c| c.observed_generation != generation)
        {
            problems.push(format!(
                "{name}: condition {} observedGeneration {:?}, generation {generation:?}",
                stale.type_, stale.observed_generation
            ));
        }
        let desired = render::desired(r, &SecretKeys::new()).unwrap();
        let published = cm
            .data
            .as_ref()
            .and_then(|d| d.get("route.yaml"))
            .cloned()
            .unwrap_or_default();
        let owner = cm.owner_references().first().map(|o| o.uid.clone());
        if owner != r.metadata.uid {
            problems.push(format!(
                "{name}: ConfigMap owned by {owner:?}, not this route"
            ));
        }
        let (accepted, ready) = (condition(r, "Accepted"), condition(r, "Ready"));
        match expect {
            Expect::Ready => {
                if accepted != Some(("True".into(), "Valid".into()))
                    || ready != Some(("True".into(), "Published".into()))
                {
                    problems.push(format!(
                        "{name}: Accepted {accepted:?}, Ready {ready:?}; want both True"
                    ));
                }
                if published != desired.config_yaml {
                    problems.push(format!(
                        "{name}: ConfigMap holds\n{published}\nnot the latest spec\n{}",
                        desired.config_yaml
                    ));
                }
                if status.config_hash.as_ref() != Some(&desired.config_hash) {
                    problems.push(format!(
                        "{name}: configHash {:?}, want {}",
                        status.config_hash, desired.config_hash
                    ));
                }
            }
            Expect::Conflict => {
                if accepted.as_ref().map(|a| a.1.as_str()) != Some("ModelConflict")
                    || ready != Some(("False".into(), "NotAccepted".into()))
                {
                    problems.push(format!(
                        "{name}: Accepted {accepted:?}, Ready {ready:?}; want ModelConflict"
                    ));
                }
                if published != desired.config_yaml {
                    problems.push(format!("{name}: ConfigMap lost its last good config"));
                }
            }
        }
    }
    for (name, version) in keep_versions {
        let want = format!("{}s", 30 + version);
        if let Some(r) = all_routes.items.iter().find(|r| r.name_any() == *name)
            && r.spec.timeouts.total.to_string() != want
        {
            problems.push(format!(
                "{name}: spec total {}, the last update wrote {want}",
                r.spec.timeouts.total
            ));
        }
    }
    problems
}

async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_under_churn_with_an_api_server_restart() {
    let started = Instant::now();
    let mut cp = tailwarden_e2e::controlplane::ControlPlane::up("op-churn")
        .unwrap_or_else(|e| panic!("{e}"));
    let kubeconfig = Kubeconfig::read_from(cp.var("KUBECONFIG")).unwrap();
    let client = Client::try_from(
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap(),
    )
    .unwrap();
    let crd = root().join("crds/inferenceroute.yaml");
    let out = cp.kubectl(
        &["apply", "--server-side", "-f", crd.to_str().unwrap()],
        None,
    );
    assert!(out.ok, "{}", out.text);
    let out = cp.kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "crd/inferenceroutes.tailwarden.io",
            "--timeout=60s",
        ],
        None,
    );
    assert!(out.ok, "{}", out.text);
    for ns in [NS, "tailwarden-system"] {
        let obj: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &obj)
            .await
            .unwrap();
    }

    let log_dir = std::env::temp_dir().join(format!("tw-op-churn-logs-{}", std::process::id()));
    std::fs::create_dir_all(&log_dir).unwrap();
    let log_path = log_dir.join("operator.log");
    let metrics_port = free_port();
    let mut operator = Operator(
        Command::new(env!("CARGO_BIN_EXE_tailwarden-operator"))
            .args([
                "run",
                "--leader-elect=false",
                "--webhook-listen",
                &format!("127.0.0.1:{}", free_port()),
                "--metrics-listen",
                &format!("127.0.0.1:{metrics_port}"),
                "--sidecar-image",
                "tailwarden/sidecar:test",
            ])
            .env("KUBECONFIG", cp.var("KUBECONFIG"))
            .env("POD_NAMESPACE", "tailwarden-system")
            .env("POD_NAME", "churn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap(),
    );
    let baseline = eventually("operator metrics", Duration::from_secs(60), || async {
        let text = scrape(metrics_port).await?;
        Some(sample(&text, "tailwarden_operator_reconciles_total", ""))
    })
    .await;

    let routes: Api<InferenceRoute> = Api::namespaced(client.clone(), NS);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let counts = Arc::new(Counts::default());
    let count_create = |n: usize| counts.creates.fetch_add(n, Ordering::Relaxed);

    // Long-lived routes (updated during the churn) and three model-conflict scenarios, each
    // resolved during the churn by a change to *another* route than the one whose state
    // must change:
    //  - older-d<k> holds a model, younger-d<k> claims it too (ModelConflict); older-d<k>
    //    is deleted → younger-d<k> must become Ready;
    //  - the same with older-u<k>, which instead drops the model from its spec;
    //  - thief-s<k> (older) later claims the model of victim-s<k> → victim-s<k> must lose
    //    Accepted, its ConfigMap keeping the last good config.
    // The younger routes are created after the older ones; a tie in creationTimestamp (whole
    // seconds) goes to the name that sorts first, which is the older one too.
    for w in 0..WORKERS {
        let name = format!("keep-{w}");
        create(&routes, &name, spec(&[&format!("m-{name}")], 0)).await;
        count_create(1);
    }
    for k in 0..PAIRS {
        for (name, model) in [
            (format!("older-d{k}"), format!("shared-d{k}")),
            (format!("older-u{k}"), format!("shared-u{k}")),
            (format!("thief-s{k}"), format!("own-s{k}")),
        ] {
            create(&routes, &name, spec(&[&model], 0)).await;
            count_create(1);
        }
    }
    for k in 0..PAIRS {
        for (name, model) in [
            (format!("younger-d{k}"), format!("shared-d{k}")),
            (format!("younger-u{k}"), format!("shared-u{k}")),
            (format!("victim-s{k}"), format!("shared-s{k}")),
        ] {
            create(&routes, &name, spec(&[&model], 0)).await;
            count_create(1);
        }
    }
    eventually(
        "the conflict scenarios settle before the churn",
        Duration::from_secs(60),
        || async {
            for k in 0..PAIRS {
                for (name, want) in [
                    (format!("younger-d{k}"), "ModelConflict"),
                    (format!("younger-u{k}"), "ModelConflict"),
                    (format!("victim-s{k}"), "Valid"),
                ] {
                    let r = routes.get(&name).await.ok()?;
                    (condition(&r, "Accepted")?.1 == want).then_some(())?;
                }
            }
            Some(())
        },
    )
    .await;

    // The churn.
    let churn_started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(worker(w, CYCLES / WORKERS, routes.clone(), counts.clone())))
        .collect();
    let cycles_done = || counts.cycles.load(Ordering::Relaxed);

    // A quarter in: resolve the conflicts.
    eventually(
        "a quarter of the cycles",
        Duration::from_secs(300),
        || async { (cycles_done() >= CYCLES / 4).then_some(()) },
    )
    .await;
    for k in 0..PAIRS {
        delete(&routes, &format!("older-d{k}")).await;
        counts.deletes.fetch_add(1, Ordering::Relaxed);
        let patch = json!({"spec": {"models": [format!("elsewhere-u{k}")]}});
        update(&routes, &format!("older-u{k}"), patch).await;
        let patch = json!({"spec": {"models": [format!("own-s{k}"), format!("shared-s{k}")]}});
        update(&routes, &format!("thief-s{k}"), patch).await;
        counts.updates.fetch_add(2, Ordering::Relaxed);
    }

    // Half-way: restart the kube-apiserver while the workers keep writing.
    eventually("half of the cycles", Duration::from_secs(300), || async {
        (cycles_done() >= CYCLES / 2).then_some(())
    })
    .await;
    let at_restart = cycles_done();
    let restart = tokio::task::block_in_place(|| {
        cp.restart_apiserver(APISERVER_DOWN, Duration::from_secs(120))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let back = Instant::now();
    println!(
        "kube-apiserver restarted after {at_restart} cycles ({:.1} s into the churn): stop {:.1} s, \
         down {:.1} s, start→ready {:.1} s",
        churn_started.elapsed().as_secs_f64(),
        restart.stop.as_secs_f64(),
        restart.down.as_secs_f64(),
        restart.start.as_secs_f64()
    );
    // Recovery: a route created now is reconciled within a bound.
    create(&routes, "after-restart", spec(&["m-after-restart"], 0)).await;
    count_create(1);
    eventually(
        "a route created after the restart is Ready",
        RECOVERY_BOUND,
        || async {
            let r = routes.get("after-restart").await.ok()?;
            (condition(&r, "Ready")? == ("True".into(), "Published".into())
                && r.status?.observed_generation == Some(1))
            .then_some(())
        },
    )
    .await;
    let recovery = back.elapsed();

    let mut keep_versions = Vec::new();
    for (w, handle) in workers.into_iter().enumerate() {
        keep_versions.push((format!("keep-{w}"), handle.await.unwrap()));
    }
    let churn = churn_started.elapsed();

    // The end state.
    let mut expected: Vec<(String, Expect)> = (0..WORKERS)
        .map(|w| (format!("keep-{w}"), Expect::Ready))
        .collect();
    expected.push(("after-restart".into(), Expect::Ready));
    for k in 0..PAIRS {
        expected.push((format!("younger-d{k}"), Expect::Ready));
        expected.push((format!("older-u{k}"), Expect::Ready));
        expected.push((format!("younger-u{k}"), Expect::Ready));
        expected.push((format!("thief-s{k}"), Expect::Ready));
        expected.push((format!("victim-s{k}"), Expect::Conflict));
    }
    let settle_started = Instant::now();
    let deadline = settle_started + Duration::from_secs(90);
    loop {
        let problems = end_state_problems(&routes, &cms, &expected, &keep_versions).await;
        if problems.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the end state is wrong 90 s after the churn (operator log: {}):\n{}",
            log_path.display(),
            problems.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settled = settle_started.elapsed();

    // No hot loop: bounded reconciles per write, and none at all once nothing changes.
    let after_churn = reconciles(metrics_port).await - baseline;
    tokio::time::sleep(QUIET).await;
    let text = scrape(metrics_port).await.expect("operator metrics");
    let after_quiet = sample(&text, "tailwarden_operator_reconciles_total", "") - baseline;
    let errors = sample(
        &text,
        "tailwarden_operator_reconciles_total",
        "result=\"error\"",
    );
    let failures: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("tailwarden_operator_reconcile_failures_total{"))
        .map(str::to_owned)
        .collect();
    assert!(
        operator.0.try_wait().unwrap().is_none(),
        "the operator exited (log: {})",
        log_path.display()
    );

    let writes = counts.writes();
    let per_write = after_churn as f64 / writes as f64;
    println!(
        "\nchurn: {CYCLES} create/update/delete cycles, {WORKERS} in flight, in {:.1} s; \
         kube-apiserver restarted after {at_restart} cycles (stop {:.1} s, down {:.1} s, \
         start→ready {:.1} s); a route created after it was Ready in {:.1} s; end state \
         correct {:.1} s after the last write",
        churn.as_secs_f64(),
        restart.stop.as_secs_f64(),
        restart.down.as_secs_f64(),
        restart.start.as_secs_f64(),
        recovery.as_secs_f64(),
        settled.as_secs_f64(),
    );
    println!(
        "writes: {} creates, {} updates, {} deletes ({} attempts failed and were retried); \
         reconciles: {after_churn} ({errors} failed) = {per_write:.2} per create/update, \
         {:.2} per write of any kind; {} more in the {} s quiet period",
        counts.creates.load(Ordering::Relaxed),
        counts.updates.load(Ordering::Relaxed),
        counts.deletes.load(Ordering::Relaxed),
        counts.retried.load(Ordering::Relaxed),
        after_churn as f64 / (writes + counts.deletes.load(Ordering::Relaxed)) as f64,
        after_quiet - after_churn,
        QUIET.as_secs(),
    );
    println!("{}", failures.join("\n"));
    println!("whole test: {:.1} s", started.elapsed().as_secs_f64());
    assert_eq!(cycles_done(), CYCLES);
    assert!(
        per_write <= MAX_RECONCILES_PER_WRITE,
        "{after_churn} reconciles for {writes} creates/updates: {per_write:.2} per write, \
         more than {MAX_RECONCILES_PER_WRITE}"
    );
    assert_eq!(
        after_quiet, after_churn,
        "the operator kept reconciling with nothing changing (a hot loop)"
    );
}
