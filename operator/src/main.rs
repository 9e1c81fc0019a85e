//! `tailwarden-operator`: the control plane binary.
//!
//! - `run`: the controller, the admission webhook, certificates and leader election.
//! - `crd`: prints the InferenceRoute CRD, generated from the Rust types.
//! - `reference`: prints the field reference generated from the same schema.

use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::ResourceRequirements;
use tailwarden_operator::{
    controller::SecretAccess,
    inject::InjectConfig,
    run::{self, CertMode, Settings},
    sidecar_env::{self, OtelConfig, OtlpProtocol},
};

#[derive(Parser)]
#[command(
    name = "tailwarden-operator",
    version,
    about = "The tailwarden control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller and the sidecar injection webhook.
    Run(Box<RunArgs>),
    /// Print the InferenceRoute CustomResourceDefinition as YAML.
    Crd,
    /// Print the Markdown field reference generated from the same schema.
    Reference,
}

#[derive(Clone, Copy, ValueEnum)]
enum CertModeArg {
    /// Make and renew a CA and serving certificate; patch the webhook caBundle.
    #[value(name = "self")]
    SelfSigned,
    /// Use the certificate someone else (cert-manager) writes into the TLS Secret.
    External,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The operator's namespace (its Lease and webhook Secret live there).
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: String,
    /// This replica's identity for leader election (the pod name).
    #[arg(long, env = "POD_NAME")]
    identity: String,
    /// Namespaces whose routes are reconciled, comma-separated; empty: all namespaces.
    #[arg(
        long,
        env = "TAILWARDEN_WATCH_NAMESPACES",
        value_delimiter = ',',
        default_value = ""
    )]
    watch_namespaces: Vec<String>,
    /// Namespaces where the operator may read Secrets to check that the keys routes reference
    /// exist (`ResolvedRefs`), comma-separated. Empty (the default): nowhere — the operator
    /// reads no Secret outside its own namespace and reports `ResolvedRefs=Unknown`. Each
    /// namespace listed needs a RoleBinding granting get/list/watch on secrets there (the
    /// chart's `operator.secretAccess.namespaces` makes them).
    #[arg(
        long,
        env = "TAILWARDEN_SECRET_NAMESPACES",
        value_delimiter = ',',
        default_value = ""
    )]
    secret_namespaces: Vec<String>,
    /// Webhook HTTPS listener.
    #[arg(long, default_value = "0.0.0.0:9443")]
    webhook_listen: SocketAddr,
    /// Metrics and health listener (/metrics, /healthz, /readyz).
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_listen: SocketAddr,
    /// Name of the MutatingWebhookConfiguration whose caBundle the operator keeps current.
    #[arg(long, default_value = "tailwarden")]
    webhook_config_name: String,
    /// Name of the webhook Service (its DNS names go into the serving certificate).
    #[arg(long, default_value = "tailwarden-webhook")]
    webhook_service: String,
    /// Extra IP addresses for the serving certificate, comma-separated.
    #[arg(long, value_delimiter = ',')]
    webhook_ip_san: Vec<IpAddr>,
    /// Secret holding the webhook's TLS certificate.
    #[arg(long, default_value = "tailwarden-webhook-tls")]
    tls_secret: String,
    /// Who makes the webhook certificate.
    #[arg(long, value_enum, default_value = "self")]
    cert_mode: CertModeArg,
    /// Leader election over a Lease, so only one replica reconciles.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Sidecar image injected into pods.
    #[arg(long, env = "TAILWARDEN_SIDECAR_IMAGE")]
    sidecar_image: String,
    /// Sidecar image pull policy.
    #[arg(long)]
    sidecar_image_pull_policy: Option<String>,
    /// Sidecar resources as JSON, e.g. {"requests":{"cpu":"50m","memory":"32Mi"}}.
    #[arg(long)]
    sidecar_resources: Option<String>,
    /// Sidecar log filter (TAILWARDEN_LOG), e.g. info.
    #[arg(long)]
    sidecar_log_level: Option<String>,
    /// Client connections one sidecar serves at once (its --max-connections); the sidecar's
    /// default, 10 000, when not given.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    sidecar_max_connections: Option<u32>,
    /// OTLP collector the injected sidecars export traces to, e.g.
    /// http://otel-collector.monitoring:4318; tracing stays off without it.
    #[arg(long)]
    sidecar_otel_endpoint: Option<String>,
    /// OTLP protocol of the sidecars' exporter.
    #[arg(long, value_enum, default_value = "http/protobuf")]
    sidecar_otel_protocol: OtlpProtocolArg,
    /// Secret, in each injected pod's own namespace, whose key --sidecar-otel-headers-key holds
    /// the exporter's headers (OTEL_EXPORTER_OTLP_HEADERS, `key=value,…`). A pod whose
    /// namespace lacks it exports without headers.
    #[arg(long)]
    sidecar_otel_headers_secret: Option<String>,
    /// Key of --sidecar-otel-headers-secret.
    #[arg(long, default_value = "headers")]
    sidecar_otel_headers_key: String,
    /// Share of new traces the sidecars keep, 0 to 1 (parent-based: a sampled client trace is
    /// always continued); all when not given.
    #[arg(long, value_parser = sidecar_env::parse_sampling_ratio)]
    sidecar_otel_sampling_ratio: Option<String>,
    /// Extra resource attribute key=value for the sidecars' spans; repeat or comma-separate.
    #[arg(long, value_delimiter = ',', value_parser = sidecar_env::parse_resource_attribute)]
    sidecar_otel_resource_attribute: Vec<(String, String)>,
    /// Sidecars export the OpenTelemetry GenAI client metrics (gen_ai_client_*) beside
    /// tailwarden_* (OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    sidecar_gen_ai_metrics: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum OtlpProtocolArg {
    /// OTLP/gRPC (a collector's port 4317).
    #[value(name = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (a collector's port 4318).
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

fn settings(args: RunArgs) -> anyhow::Result<Settings> {
    let resources: Option<ResourceRequirements> = args
        .sidecar_resources
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .context("--sidecar-resources must be a ResourceRequirements JSON object")?;
    let mut inject = InjectConfig::new(args.sidecar_image);
    inject.image_pull_policy = args.sidecar_image_pull_policy;
    inject.resources = resources;
    inject.log_filter = args.sidecar_log_level;
    inject.max_connections = args.sidecar_max_connections;
    inject.gen_ai_metrics = args.sidecar_gen_ai_metrics;
    if let Some(endpoint) = args.sidecar_otel_endpoint.filter(|e| !e.trim().is_empty()) {
        let protocol = match args.sidecar_otel_protocol {
            OtlpProtocolArg::Grpc => OtlpProtocol::Grpc,
            OtlpProtocolArg::HttpProtobuf => OtlpProtocol::HttpProtobuf,
        };
        let mut otel = OtelConfig::new(endpoint.trim(), protocol);
        otel.headers_secret = args
            .sidecar_otel_headers_secret
            .filter(|s| !s.is_empty())
            .map(|s| (s, args.sidecar_otel_headers_key));
        otel.sampling_ratio = args.sidecar_otel_sampling_ratio;
        otel.resource_attributes = args.sidecar_otel_resource_attribute;
        inject.otel = Some(otel);
    }
    Ok(Settings {
        namespace: args.namespace,
        identity: args.identity,
        watch_namespaces: args
            .watch_namespaces
            .into_iter()
            .filter(|n| !n.is_empty())
            .collect(),
        webhook_listen: args.webhook_listen,
        metrics_listen: args.metrics_listen,
        webhook_config_name: args.webhook_config_name,
        webhook_service: args.webhook_service,
        webhook_ip_sans: args.webhook_ip_san,
        tls_secret: args.tls_secret,
        cert_mode: match args.cert_mode {
            CertModeArg::SelfSigned => CertMode::SelfSigned,
            CertModeArg::External => CertMode::External,
        },
        leader_elect: args.leader_elect,
        inject,
        secret_access: SecretAccess::new(
            args.secret_namespaces.into_iter().filter(|n| !n.is_empty()),
        ),
    })
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crd => print!("{}", tailwarden_crds::crd::crd_yaml()?),
        Command::Reference => print!("{}", tailwarden_crds::crd::reference_markdown()?),
        Command::Run(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_env("TAILWARDEN_LOG")
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .json()
                .flatten_event(true)
                .with_writer(std::io::stderr)
                .init();
            let settings = settings(*args)?;
            // rustls needs a process-wide crypto provider; ring is the one compiled in.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(run::run(settings, shutdown_signal()))?;
        }
    }
    Ok(())
}
