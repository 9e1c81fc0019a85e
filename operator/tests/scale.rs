//! Scale measurement (not part of `make test`; `make operator-scale` runs it): 500 routes
//! applied to a real kube-apiserver — time from create to the route's ConfigMap being
//! written (p50/p99) and the operator's RSS. Prints a table for the closing notes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::HashMap,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::{
    Api, Client, Config,
    api::PostParams,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt, watcher},
};
use tailwarden_crds::InferenceRoute;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run with `make operator-scale`"]
async fn five_hundred_routes() {
    let n: usize = std::env::var("ROUTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let cp = tailwarden_e2e::controlplane::ControlPlane::up("op-scale").unwrap();
    let kubeconfig = Kubeconfig::read_from(cp.var("KUBECONFIG")).unwrap();
    let client = Client::try_from(
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap(),
    )
    .unwrap();
    let out = cp.kubectl(
        &["apply", "--server-side", "-f", "crds/inferenceroute.yaml"],
        None,
    );
    assert!(out.ok, "{}", out.text);
    cp.kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "crd/inferenceroutes.tailwarden.io",
        ],
        None,
    );
    for ns in ["scale", "tailwarden-system"] {
        let obj: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &obj)
            .await
            .unwrap();
    }
    let mut operator = Command::new(env!("CARGO_BIN_EXE_tailwarden-operator"))
        .args([
            "run",
            "--leader-elect=false",
            "--webhook-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--sidecar-image", "x"])
        .env("KUBECONFIG", cp.var("KUBECONFIG"))
        .env("POD_NAMESPACE", "tailwarden-system")
        .env("POD_NAME", "scale")
        .env("TAILWARDEN_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_rss = rss_kib(operator.id());

    // Watch ConfigMaps and note when each route's first appears.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "scale");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
    let watch = tokio::spawn(async move {
        let mut stream = watcher(cms, watcher::Config::default())
            .applied_objects()
            .boxed();
        while let Some(Ok(cm)) = stream.next().await {
            if let Some(name) = cm
                .metadata
                .name
                .as_deref()
                .and_then(|n| n.strip_prefix("tailwarden-route-"))
            {
                let _ = tx.send((name.to_owned(), Instant::now()));
            }
        }
    });

    let routes: Api<InferenceRoute> = Api::namespaced(client.clone(), "scale");
    let started = Instant::now();
    let mut created = HashMap::new();
    for i in 0..n {
        let route: InferenceRoute = serde_json::from_value(serde_json::json!({
            "apiVersion": "tailwarden.io/v1alpha1", "kind": "InferenceRoute",
            "metadata": {"name": format!("r{i}"), "namespace": "scale"},
            "spec": {"models": [format!("model-{i}")], "providers": [{"name": "p", "baseUrl": "http://127.0.0.1:1/v1"}]}
        }))
        .unwrap();
        routes.create(&PostParams::default(), &route).await.unwrap();
        created.insert(format!("r{i}"), Instant::now());
    }
    let applied = started.elapsed();
    let mut latencies = Vec::with_capacity(n);
    let mut peak_rss = 0;
    let deadline = Instant::now() + Duration::from_secs(300);
    while latencies.len() < n && Instant::now() < deadline {
        if let Ok(Some((name, at))) = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await
            && let Some(t0) = created.remove(&name)
        {
            latencies.push(at.duration_since(t0));
        }
        peak_rss = peak_rss.max(rss_kib(operator.id()));
    }
    let total = started.elapsed();
    watch.abort();
    let _ = operator.kill();
    let _ = operator.wait();
    assert_eq!(latencies.len(), n, "every route got its ConfigMap");
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p).ceil() as usize).saturating_sub(1)];
    println!(
        "\n| routes | applied in | all ConfigMaps in | create→ConfigMap p50 | p99 | max | operator RSS idle | peak |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {n} | {:.1} s | {:.1} s | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} MiB | {:.1} MiB |",
        applied.as_secs_f64(),
        total.as_secs_f64(),
        pct(0.50).as_secs_f64() * 1000.0,
        pct(0.99).as_secs_f64() * 1000.0,
        latencies[latencies.len() - 1].as_secs_f64() * 1000.0,
        idle_rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0
    );
}
