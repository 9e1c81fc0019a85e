//! The proxies `make bench` measures and how each one is started, configured and called.
//!
//! Every proxy gets the same two upstreams (the `instant` simulator for non-streaming runs,
//! the paced one for streaming runs) and its plain production configuration: nginx as a
//! keep-alive reverse proxy with buffering off, LiteLLM's proxy from a config file with a
//! master key, Portkey's gateway with the custom-host header, and tailwarden-sidecar with the
//! default route settings. Peers are installed by `e2e/bench/install-peers.sh`, which records
//! what it installed (or why it could not) in `CACHE/peers/manifest.tsv`.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::fetch;
use crate::proc::ChildProc;
use crate::sidecar::Sidecar;

/// The sidecar's route template for the overhead runs.
pub const SIDECAR_ROUTE: &str = include_str!("../../bench/sidecar-route.yaml");

/// Model name requests use for the instant upstream.
pub const MODEL_INSTANT: &str = "gpt-4.1-mini";

/// Model name requests use for the paced upstream where a proxy routes by model.
pub const MODEL_PACED: &str = "paced";

/// Something the benchmark sends load to.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TargetKind {
    /// Straight at the simulator: the baseline every "added" number subtracts.
    Direct,
    /// tailwarden-sidecar.
    Sidecar,
    /// nginx as a plain reverse proxy: the floor of what proxying costs.
    Nginx,
    /// LiteLLM proxy.
    Litellm,
    /// Portkey gateway.
    Portkey,
}

impl TargetKind {
    /// All, in the order they run and print.
    pub const ALL: [Self; 5] = [
        Self::Direct,
        Self::Sidecar,
        Self::Nginx,
        Self::Litellm,
        Self::Portkey,
    ];

    /// Name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Sidecar => "tailwarden-sidecar",
            Self::Nginx => "nginx",
            Self::Litellm => "litellm",
            Self::Portkey => "portkey",
        }
    }

    /// Parses a command-line name (`sidecar` is accepted for `tailwarden-sidecar`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "sidecar" => Some(Self::Sidecar),
            other => Self::ALL.into_iter().find(|k| k.name() == other),
        }
    }

    /// The manifest name of installed peers.
    fn manifest_name(self) -> Option<&'static str> {
        match self {
            Self::Nginx => Some("nginx"),
            Self::Litellm => Some("litellm"),
            Self::Portkey => Some("portkey"),
            Self::Direct | Self::Sidecar => None,
        }
    }
}

/// Where and how to send one kind of request to a target.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Base URL (`.../v1`).
    pub url: String,
    /// Extra headers.
    pub headers: Vec<(String, String)>,
    /// `model` of the requests.
    pub model: String,
}

/// One line of `manifest.tsv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    /// Version installed (or attempted).
    pub version: String,
    /// Binary / entry point when installed, the reason when not.
    pub result: Result<PathBuf, String>,
}

/// Reads `CACHE/peers/manifest.tsv`; missing file means nothing was installed.
pub fn read_manifest(cache: &Path) -> BTreeMap<String, Installed> {
    let path = cache.join("peers").join("manifest.tsv");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return BTreeMap::new();
    };
    parse_manifest(&text)
}

fn parse_manifest(text: &str) -> BTreeMap<String, Installed> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(4, '\t');
            let (name, version, status, rest) = (f.next()?, f.next()?, f.next()?, f.next()?);
            let result = if status == "ok" {
                Ok(PathBuf::from(rest))
            } else {
                Err(rest.to_owned())
            };
            Some((
                name.to_owned(),
                Installed {
                    version: version.to_owned(),
                    result,
                },
            ))
        })
        .collect()
}

/// What a target needs to start.
#[derive(Debug)]
pub struct LaunchContext<'a> {
    /// The instant simulator.
    pub instant: SocketAddr,
    /// The paced simulator.
    pub paced: SocketAddr,
    /// Work folder for configs and logs (one sub-folder per target).
    pub workdir: &'a Path,
    /// The sidecar binary.
    pub sidecar_bin: &'a Path,
    /// What install-peers.sh installed.
    pub manifest: &'a BTreeMap<String, Installed>,
    /// Worker processes / threads to give a proxy that asks (the machine's CPU count).
    pub workers: usize,
}

/// The process behind a target.
#[derive(Debug)]
pub enum TargetProcess {
    /// No process of its own (direct).
    None,
    /// tailwarden-sidecar.
    Sidecar(Sidecar),
    /// A peer.
    Child(ChildProc),
}

impl TargetProcess {
    /// Process group id, when there is a process.
    pub fn pgid(&self) -> Option<u32> {
        match self {
            Self::None => None,
            Self::Sidecar(s) => Some(s.process().pid()),
            Self::Child(c) => Some(c.pid()),
        }
    }

    /// Processes in the group.
    pub fn group_size(&self) -> usize {
        match self {
            Self::None => 0,
            Self::Sidecar(s) => s.process().group_size(),
            Self::Child(c) => c.group_size(),
        }
    }

    /// Stops it.
    pub fn stop(&mut self) {
        match self {
            Self::None => {}
            Self::Sidecar(s) => s.stop(),
            Self::Child(c) => c.stop(),
        }
    }
}

/// A started target.
#[derive(Debug)]
pub struct Launched {
    /// Its process.
    pub process: TargetProcess,
    /// Non-streaming endpoint (instant upstream).
    pub instant: Endpoint,
    /// Streaming endpoint (paced upstream).
    pub paced: Endpoint,
    /// Version string.
    pub version: String,
    /// How it was configured, one line.
    pub how: String,
}

/// A free loopback port (bound then released; the tiny race is acceptable here).
fn free_port() -> Result<u16, String> {
    TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port: {e}"))
}

fn installed<'a>(ctx: &'a LaunchContext<'_>, kind: TargetKind) -> Result<&'a Installed, String> {
    let name = kind.manifest_name().unwrap_or("?");
    ctx.manifest.get(name).ok_or_else(|| {
        format!("not installed: e2e/bench/install-peers.sh did not record {name} (run `make bench`, which installs it)")
    })
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Starts `kind`; `Err` is the reason it cannot be measured.
pub fn launch(kind: TargetKind, ctx: &LaunchContext<'_>) -> Result<Launched, String> {
    let dir = ctx.workdir.join(kind.name());
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    match kind {
        TargetKind::Direct => Ok(Launched {
            process: TargetProcess::None,
            instant: endpoint(format!("http://{}/v1", ctx.instant), vec![], MODEL_INSTANT),
            paced: endpoint(format!("http://{}/v1", ctx.paced), vec![], MODEL_INSTANT),
            version: "-".to_owned(),
            how: "the simulator itself, no proxy".to_owned(),
        }),
        TargetKind::Sidecar => launch_sidecar(ctx, &dir),
        TargetKind::Nginx => launch_nginx(ctx, &dir),
        TargetKind::Litellm => launch_litellm(ctx, &dir),
        TargetKind::Portkey => launch_portkey(ctx, &dir),
    }
}

fn endpoint(url: String, headers: Vec<(String, String)>, model: &str) -> Endpoint {
    Endpoint {
        url,
        headers,
        model: model.to_owned(),
    }
}

fn launch_sidecar(ctx: &LaunchContext<'_>, dir: &Path) -> Result<Launched, String> {
    let route = SIDECAR_ROUTE
        .replace("${INSTANT_URL}", &format!("http://{}/v1", ctx.instant))
        .replace("${PACED_URL}", &format!("http://{}/v1", ctx.paced));
    let config = dir.join("route.yaml");
    write(&config, &route)?;
    let sidecar = Sidecar::start(ctx.sidecar_bin, &config, &dir.join("sidecar.log"))
        .map_err(|e| e.to_string())?;
    let base = sidecar.base_url();
    Ok(Launched {
        instant: endpoint(base.clone(), vec![], MODEL_INSTANT),
        paced: endpoint(base, vec![], MODEL_PACED),
        process: TargetProcess::Sidecar(sidecar),
        version: format!("{} ({})", env!("CARGO_PKG_VERSION"), git_commit()),
        how: "release build, e2e/bench/sidecar-route.yaml (route defaults: retries on, hedging off), JSON logs".to_owned(),
    })
}

/// Short commit of the working tree, for the sidecar's version.
fn git_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown commit".to_owned())
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next().map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// nginx.conf for a plain keep-alive reverse proxy with response buffering off (so SSE
/// streams pass through as they arrive), no access log, all paths inside `dir`.
pub fn nginx_conf(
    dir: &Path,
    workers: usize,
    instant: SocketAddr,
    paced: SocketAddr,
    port_instant: u16,
    port_paced: u16,
) -> String {
    let d = dir.display();
    // As root, workers would switch to the compiled-in user, who may not own `dir`.
    let user = if running_as_root() {
        "user root;\n"
    } else {
        ""
    };
    let server = |port: u16, upstream: &str| {
        format!(
            "    server {{\n        listen 127.0.0.1:{port};\n        location / {{\n            proxy_pass http://{upstream};\n            proxy_http_version 1.1;\n            proxy_set_header Connection \"\";\n            proxy_buffering off;\n            proxy_read_timeout 60s;\n        }}\n    }}\n"
        )
    };
    format!(
        "# Generated by tailwarden-benchmark: nginx as a plain reverse proxy.\n{user}worker_processes {workers};\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\nworker_rlimit_nofile 16384;\nevents {{ worker_connections 8192; }}\nhttp {{\n    access_log off;\n    client_body_temp_path {d}/client_body;\n    proxy_temp_path {d}/proxy;\n    fastcgi_temp_path {d}/fastcgi;\n    uwsgi_temp_path {d}/uwsgi;\n    scgi_temp_path {d}/scgi;\n    upstream instant {{ server {instant}; keepalive 512; }}\n    upstream paced {{ server {paced}; keepalive 512; }}\n{}{}}}\n",
        server(port_instant, "instant"),
        server(port_paced, "paced"),
    )
}

fn launch_nginx(ctx: &LaunchContext<'_>, dir: &Path) -> Result<Launched, String> {
    let inst = installed(ctx, TargetKind::Nginx)?;
    let bin = inst.result.clone()?;
    let (pi, pp) = (free_port()?, free_port()?);
    let conf = dir.join("nginx.conf");
    write(
        &conf,
        &nginx_conf(dir, ctx.workers, ctx.instant, ctx.paced, pi, pp),
    )?;
    let mut cmd = Command::new(&bin);
    cmd.arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&conf)
        .arg("-e")
        .arg(dir.join("error.log"));
    let mut child =
        ChildProc::spawn("nginx", &cmd, &dir.join("stderr.log")).map_err(|e| e.to_string())?;
    for port in [pi, pp] {
        child
            .wait_for_port(
                SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_secs(15),
            )
            .map_err(|e| e.to_string())?;
    }
    Ok(Launched {
        process: TargetProcess::Child(child),
        instant: endpoint(format!("http://127.0.0.1:{pi}/v1"), vec![], MODEL_INSTANT),
        paced: endpoint(format!("http://127.0.0.1:{pp}/v1"), vec![], MODEL_INSTANT),
        version: inst.version.clone(),
        how: format!(
            "Debian package, {} workers, keep-alive upstream, proxy_buffering off, access_log off",
            ctx.workers
        ),
    })
}

/// LiteLLM proxy config: both upstreams as OpenAI-compatible models, telemetry off.
pub fn litellm_config(instant: SocketAddr, paced: SocketAddr) -> String {
    format!(
        "# Generated by tailwarden-benchmark.\nmodel_list:\n  - model_name: {MODEL_INSTANT}\n    litellm_params: {{model: openai/{MODEL_INSTANT}, api_base: \"http://{instant}/v1\", api_key: dummy}}\n  - model_name: {MODEL_PACED}\n    litellm_params: {{model: openai/{MODEL_INSTANT}, api_base: \"http://{paced}/v1\", api_key: dummy}}\nlitellm_settings: {{telemetry: false}}\n"
    )
}

/// A master key for LiteLLM (it refuses to start without one); random per run.
fn master_key() -> String {
    use rand::Rng as _;
    let mut rng = rand::rng();
    let hex: String = (0..32)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect();
    format!("sk-{hex}")
}

fn launch_litellm(ctx: &LaunchContext<'_>, dir: &Path) -> Result<Launched, String> {
    let inst = installed(ctx, TargetKind::Litellm)?;
    let bin = inst.result.clone()?;
    let port = free_port()?;
    let conf = dir.join("litellm.yaml");
    write(&conf, &litellm_config(ctx.instant, ctx.paced))?;
    let key = master_key();
    let mut cmd = Command::new(&bin);
    cmd.arg("--config")
        .arg(&conf)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--num_workers", &ctx.workers.to_string()])
        .env("LITELLM_MASTER_KEY", &key)
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .current_dir(dir);
    let mut child =
        ChildProc::spawn("litellm", &cmd, &dir.join("litellm.log")).map_err(|e| e.to_string())?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    child
        .wait_until(
            "GET /health/liveliness to answer 200",
            Duration::from_secs(120),
            || {
                fetch::get(addr, "/health/liveliness", Duration::from_secs(2))
                    .is_ok_and(|r| r.status == 200)
            },
        )
        .map_err(|e| e.to_string())?;
    let auth = vec![("Authorization".to_owned(), format!("Bearer {key}"))];
    Ok(Launched {
        process: TargetProcess::Child(child),
        instant: endpoint(format!("http://{addr}/v1"), auth.clone(), MODEL_INSTANT),
        paced: endpoint(format!("http://{addr}/v1"), auth, MODEL_PACED),
        version: inst.version.clone(),
        how: format!(
            "`litellm --config` (uvicorn, {} workers), master key, local cost map, default logging",
            ctx.workers
        ),
    })
}

fn launch_portkey(ctx: &LaunchContext<'_>, dir: &Path) -> Result<Launched, String> {
    let inst = installed(ctx, TargetKind::Portkey)?;
    let entry = inst.result.clone()?;
    // install-peers.sh puts the preload next to node_modules: <dir>/node_modules/@portkey-ai/gateway/build/start-server.js
    let wrapper = entry
        .ancestors()
        .nth(5)
        .map(|root| root.join("portkey-fetch-wrapper.cjs"))
        .filter(|p| p.is_file())
        .ok_or_else(|| "portkey-fetch-wrapper.cjs missing next to node_modules".to_owned())?;
    let port = free_port()?;
    let mut cmd = Command::new("node");
    cmd.arg("-r")
        .arg(&wrapper)
        .arg(&entry)
        .arg(format!("--port={port}"))
        .arg("--headless")
        .current_dir(dir);
    let mut child =
        ChildProc::spawn("portkey", &cmd, &dir.join("portkey.log")).map_err(|e| e.to_string())?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    child
        .wait_for_port(addr, Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let headers = |up: SocketAddr| {
        vec![
            ("x-portkey-provider".to_owned(), "openai".to_owned()),
            (
                "x-portkey-custom-host".to_owned(),
                format!("http://{up}/v1"),
            ),
            ("Authorization".to_owned(), "Bearer dummy".to_owned()),
        ]
    };
    Ok(Launched {
        process: TargetProcess::Child(child),
        instant: endpoint(format!("http://{addr}/v1"), headers(ctx.instant), MODEL_INSTANT),
        paced: endpoint(format!("http://{addr}/v1"), headers(ctx.paced), MODEL_INSTANT),
        version: inst.version.clone(),
        how: "`node build/start-server.js --headless` (Node 20, one process) with the fetch-wrapper preload, x-portkey-custom-host".to_owned(),
    })
}

/// One non-streaming and one streaming request through `l`; `Err` says what went wrong.
/// Retried for up to `timeout`, since some servers accept connections before they can serve.
pub fn smoke(l: &Launched, timeout: Duration) -> Result<(), String> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match smoke_once(l, Duration::from_secs(10)) {
            Ok(()) => return Ok(()),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// Both smoke requests, each within `per_request`.
pub fn smoke_once(l: &Launched, per_request: Duration) -> Result<(), String> {
    for (ep, stream) in [(&l.instant, false), (&l.paced, true)] {
        let (addr, path) = split_url(&ep.url)?;
        let body = serde_json::json!({
            "model": ep.model,
            "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
            "stream": stream,
        })
        .to_string();
        let r = fetch::post_json(
            addr,
            &format!("{path}/chat/completions"),
            &ep.headers,
            &body,
            per_request,
        )
        .map_err(|e| e.to_string())?;
        let text = r.text();
        if r.status != 200 {
            return Err(format!(
                "{} request answered {}: {}",
                if stream { "streaming" } else { "non-streaming" },
                r.status,
                text.chars().take(300).collect::<String>()
            ));
        }
        if stream && !(text.contains("data:") && text.contains("[DONE]")) {
            return Err(format!(
                "streaming request did not return an SSE stream ending in [DONE]: {}",
                text.chars().take(300).collect::<String>()
            ));
        }
    }
    Ok(())
}

/// `http://127.0.0.1:1234/v1` → (addr, `/v1`).
fn split_url(url: &str) -> Result<(SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("not an http URL: {url}"))?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let addr = host
        .parse()
        .map_err(|_| format!("not a loopback address URL: {url}"))?;
    Ok((addr, format!("/{}", path.trim_end_matches('/'))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_lines() {
        let m = parse_manifest(
            "nginx\t1.22\tok\t/c/nginx\nlitellm\t1.106.12\tfailed\tpip install failed: boom\n",
        );
        assert_eq!(m["nginx"].result, Ok(PathBuf::from("/c/nginx")));
        assert_eq!(
            m["litellm"].result,
            Err("pip install failed: boom".to_owned())
        );
        assert!(!m.contains_key("portkey"));
    }

    #[test]
    fn nginx_config_points_at_both_upstreams() {
        let conf = nginx_conf(
            Path::new("/w"),
            2,
            "127.0.0.1:1000".parse().expect("addr"),
            "127.0.0.1:2000".parse().expect("addr"),
            3000,
            4000,
        );
        assert!(conf.contains("upstream instant { server 127.0.0.1:1000; keepalive 512; }"));
        assert!(conf.contains("listen 127.0.0.1:4000;"));
        assert!(conf.contains("proxy_buffering off;"));
        assert_eq!(conf.matches('{').count(), conf.matches('}').count());
    }

    #[test]
    fn urls_split_and_names_parse() {
        let (a, p) = split_url("http://127.0.0.1:8080/v1").expect("ok");
        assert_eq!((a.port(), p.as_str()), (8080, "/v1"));
        assert!(split_url("https://x/v1").is_err());
        assert_eq!(TargetKind::parse("sidecar"), Some(TargetKind::Sidecar));
        assert_eq!(TargetKind::parse("litellm"), Some(TargetKind::Litellm));
        assert_eq!(TargetKind::parse("envoy"), None);
        assert!(
            litellm_config(
                "127.0.0.1:1".parse().expect("a"),
                "127.0.0.1:2".parse().expect("a")
            )
            .contains("model_name: paced")
        );
    }
}
