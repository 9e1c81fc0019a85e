//! OpenTelemetry traces of the data plane, exported over OTLP/HTTP (protobuf), and the
//! process's log subscriber (and, beside it, the access log: [`super::access_log`]).
//!
//! Tracing is off unless `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`
//! is set (and `OTEL_SDK_DISABLED` is not `true`, `OTEL_TRACES_EXPORTER` is not `none`). Off,
//! the request path reads one relaxed atomic ([`enabled`]) and creates no span at all.
//!
//! On, every client request gets a SERVER span and every upstream attempt a CLIENT span,
//! named and attributed after the OpenTelemetry GenAI semantic conventions
//! (`chat gpt-4.1`, `gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model`,
//! `gen_ai.response.model`, `gen_ai.usage.*`, `server.address`, `http.response.status_code`,
//! `error.type`) plus `tailwarden.route`, `tailwarden.attempt` and `tailwarden.hedge`.
//! Retry, hedge and circuit-breaker decisions are span events. The SERVER span is a child of
//! the client's W3C `traceparent`; the CLIENT span's context replaces it on the upstream
//! request, so the provider sees our attempt as its parent.
//!
//! The spans are `tracing` spans (target [`TARGET`]) turned into OpenTelemetry spans by
//! `tracing-opentelemetry`; only that layer sees them (the log layer filters the target out).
//! They are never entered: parents are explicit, and a span ends when its last handle is
//! dropped — for a request, when its [`Recorder`](crate::record::recorder::Recorder)
//! is dropped after the last byte of the body, a failure or a client disconnect.
//! (`tracing-opentelemetry` stamps a span's end at its last exit when it was ever entered,
//! which would end a streamed request's span at its headers.)
//!
//! Spans carry no header values, prompts or completions: the API key and the client's
//! `Authorization` header never become attributes.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full, Limited};
pub use opentelemetry::KeyValue;
use opentelemetry::{
    propagation::TextMapPropagator,
    trace::{Status, TraceContextExt as _, TracerProvider as _},
};
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing::{Span, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::{
    EnvFilter, Layer, filter::Targets, layer::SubscriberExt as _, registry::LookupSpan,
    util::SubscriberInitExt as _,
};

/// The `tracing` target of the sidecar's OpenTelemetry spans.
pub const TARGET: &str = "tailwarden::otel";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether OpenTelemetry tracing is on. One relaxed load: the request path checks it before
/// doing any tracing work.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// How to export traces.
#[derive(Debug, Clone)]
pub struct Config {
    /// The full URL of the traces endpoint (`http://collector:4318/v1/traces`). `None` lets
    /// the exporter resolve `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is) or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (with `/v1/traces` appended).
    pub endpoint: Option<String>,
    /// How long one export may take.
    pub timeout: Duration,
    /// OTLP over gRPC or HTTP (protobuf).
    pub protocol: Protocol,
}

/// The OTLP transport (`OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// OTLP/gRPC: a collector's port 4317; the endpoint is used as is.
    Grpc,
    /// OTLP/HTTP with protobuf bodies: a collector's port 4318; `/v1/traces` is appended to
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`. The default, as the OpenTelemetry specification has it.
    #[default]
    HttpProtobuf,
}

impl Protocol {
    /// The protocol named by the variable's value; `None` for one the sidecar does not speak
    /// (`http/json`).
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim() {
            "grpc" => Some(Self::Grpc),
            "http/protobuf" => Some(Self::HttpProtobuf),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::HttpProtobuf => "http/protobuf",
        }
    }
}

pub(crate) fn env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

impl Config {
    /// The configuration from the standard `OTEL_*` variables; `None` when tracing is off.
    pub fn from_env() -> Option<Self> {
        if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return None;
        }
        if env("OTEL_TRACES_EXPORTER")
            .is_some_and(|v| v.split(',').all(|e| e.trim().eq_ignore_ascii_case("none")))
        {
            return None;
        }
        let traces_endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        let endpoint = traces_endpoint
            .clone()
            .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))?;
        let timeout = env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| env("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .and_then(|ms| ms.parse::<u64>().ok())
            .map_or(Duration::from_secs(10), Duration::from_millis);
        let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .map_or(Some(Protocol::default()), |p| Protocol::parse(&p))
            .unwrap_or_default();
        Some(Self {
            // gRPC uses the endpoint as it is; OTLP/HTTP's exporter resolves it itself.
            endpoint: (protocol == Protocol::Grpc).then_some(endpoint),
            timeout,
            protocol,
        })
    }
}

/// The running trace pipeline. Keep it alive; [`Telemetry::shutdown`] flushes what is queued.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Exports every finished span now (blocking).
    pub fn flush(&self) {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "flushing traces failed");
        }
    }

    /// Stops tracing and exports what is queued (blocking, bounded by the export timeout).
    pub fn shutdown(&self) {
        ENABLED.store(false, Ordering::Relaxed);
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "shutting down the trace exporter failed");
        }
    }
}

/// Builds the exporter and the `tracing` layer that turns the sidecar's spans into
/// OpenTelemetry spans, and turns tracing on. Install the layer in the global subscriber.
pub fn layer<S>(config: &Config) -> Result<(Telemetry, impl Layer<S>), String>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let mut resource = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    let named = env("OTEL_SERVICE_NAME").is_some()
        || env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| {
            a.split(',')
                .any(|kv| kv.trim_start().starts_with("service.name="))
        });
    if !named {
        resource = resource.with_service_name("tailwarden-sidecar");
    }
    // The sampler comes from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (the SDK reads
    // them; default parentbased_always_on), the batch settings from OTEL_BSP_*.
    let builder = SdkTracerProvider::builder().with_resource(resource.build());
    let provider = match config.protocol {
        Protocol::Grpc => {
            let endpoint = config
                .endpoint
                .clone()
                .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
                .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
                .ok_or("no OTLP endpoint")?;
            let exporter = super::otlp_grpc::GrpcExporter::new(&endpoint, config.timeout)?;
            builder.with_batch_exporter(exporter).build()
        }
        Protocol::HttpProtobuf => {
            let mut exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(ExportClient::new(config.timeout, false)?)
                .with_timeout(config.timeout);
            if let Some(endpoint) = &config.endpoint {
                exporter = exporter.with_endpoint(endpoint.clone());
            }
            let exporter = exporter.build().map_err(|e| e.to_string())?;
            builder.with_batch_exporter(exporter).build()
        }
    };
    let tracer = provider.tracer("tailwarden-sidecar");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_level(false)
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE));
    ENABLED.store(true, Ordering::Relaxed);
    Ok((Telemetry { provider }, layer))
}

/// Installs the process's subscriber: log lines on stderr (`json` or `text`, filtered by
/// `TAILWARDEN_LOG`, default `info`) and, when the `OTEL_*` variables ask for it, the trace
/// exporter. Returns the trace pipeline to shut down at exit.
pub fn init(log_format: &str) -> Option<Telemetry> {
    let filter = EnvFilter::try_from_env("TAILWARDEN_LOG")
        .unwrap_or_else(|_| EnvFilter::new("info"))
        // The spans are for the exporter only, never log lines.
        .add_directive(
            format!("{TARGET}=off")
                .parse()
                .unwrap_or_else(|_| tracing::Level::INFO.into()),
        );
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if log_format == "json" {
        fmt.json()
            .flatten_event(true)
            .with_current_span(false)
            .boxed()
    } else {
        fmt.boxed()
    };
    let registry = tracing_subscriber::registry().with(fmt.with_filter(filter));
    let Some(config) = Config::from_env() else {
        registry.init();
        init_access_log(log_format);
        return None;
    };
    match layer(&config) {
        Ok((telemetry, otel)) => {
            registry.with(otel).init();
            init_access_log(log_format);
            if let Some(p) = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
                .filter(|p| Protocol::parse(p).is_none())
            {
                tracing::warn!(protocol = %p, "the sidecar exports traces over OTLP grpc or http/protobuf, not {p}; using http/protobuf");
            }
            tracing::info!(
                protocol = config.protocol.as_str(),
                "OpenTelemetry tracing on (OTLP {})",
                config.protocol.as_str()
            );
            Some(telemetry)
        }
        Err(e) => {
            registry.init();
            init_access_log(log_format);
            tracing::error!(error = %e, "OpenTelemetry tracing off: the OTLP exporter could not be built");
            None
        }
    }
}

/// The access log on stderr, in the log format, when `TAILWARDEN_LOG` lets its target through
/// (asked of the subscriber just installed, so the filter's rules are the same as ever).
fn init_access_log(log_format: &str) {
    let enabled = tracing::enabled!(target: super::access_log::TARGET, tracing::Level::INFO);
    let format = if log_format == "json" {
        super::access_log::Format::Json
    } else {
        super::access_log::Format::Text
    };
    super::access_log::init(format, enabled, Box::new(std::io::stderr()));
}

/// The SERVER span of a client request, a child of the client's `traceparent` if it sent
/// one. Named after the operation until [`name_server_span`] adds the model.
pub fn server_span(operation: &'static str, path: &str, headers: &HeaderMap) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "request",
        otel.name = operation,
        otel.kind = "server",
        gen_ai.operation.name = operation,
        http.request.method = "POST",
        url.path = path,
        gen_ai.request.model = Empty,
        tailwarden.route = Empty,
    );
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let _ = span.set_parent(parent);
    span
}

/// Names the SERVER span `{operation} {model}` once the body is parsed. Must come before the
/// span's first child, which starts it.
pub fn name_server_span(span: &Span, operation: &str, model: &str, route: &str) {
    if span.is_none() {
        return;
    }
    span.record("otel.name", format!("{operation} {model}"));
    span.record("gen_ai.request.model", model);
    span.record("tailwarden.route", route);
}

/// Marks a span failed with an `error.type`.
pub fn fail(span: &Span, error_type: &str) {
    if span.is_none() {
        return;
    }
    span.set_attribute("error.type", error_type.to_owned());
    span.set_status(Status::error(error_type.to_owned()));
}

/// Ends a request the sidecar refused before choosing a provider (400, 404, 413, …).
pub fn refused(span: &Span, status: u16, error_type: &str) {
    if span.is_none() {
        return;
    }
    span.set_attribute("http.response.status_code", i64::from(status));
    if status >= 500 {
        fail(span, error_type);
    } else {
        span.set_attribute("error.type", error_type.to_owned());
    }
}

/// What a CLIENT span describes.
#[derive(Debug, Clone, Copy)]
pub struct AttemptInfo<'a> {
    pub operation: &'static str,
    pub provider: &'a str,
    pub provider_model: &'a str,
    pub authority: &'a http::uri::Authority,
    pub https: bool,
    pub route: &'a str,
    pub attempt: u32,
    pub hedge: bool,
}

/// The CLIENT span of one upstream attempt, a child of the request's SERVER span.
pub fn attempt_span(parent: &Span, a: &AttemptInfo<'_>) -> Span {
    if parent.is_none() {
        return Span::none();
    }
    let port = a
        .authority
        .port_u16()
        .unwrap_or(if a.https { 443 } else { 80 });
    tracing::info_span!(
        target: TARGET,
        parent: parent,
        "attempt",
        otel.name = %format_args!("{} {}", a.operation, a.provider_model),
        otel.kind = "client",
        gen_ai.operation.name = a.operation,
        gen_ai.provider.name = a.provider,
        gen_ai.request.model = a.provider_model,
        server.address = a.authority.host(),
        server.port = i64::from(port),
        tailwarden.route = a.route,
        tailwarden.attempt = i64::from(a.attempt),
        tailwarden.hedge = a.hedge,
    )
}

/// Puts the span's context on an upstream request as W3C `traceparent`/`tracestate`,
/// replacing what the client sent.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    if span.is_none() {
        return;
    }
    headers.remove("traceparent");
    headers.remove("tracestate");
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
}

/// Records how an attempt that did not answer ended.
pub fn attempt_failed(span: &Span, status: Option<u16>, error_type: &str) {
    if span.is_none() {
        return;
    }
    if let Some(status) = status {
        span.set_attribute("http.response.status_code", i64::from(status));
    }
    fail(span, error_type);
}

/// A span event; its attributes are built only when the span is traced.
pub fn event_with(span: &Span, name: &'static str, attributes: impl FnOnce() -> Vec<KeyValue>) {
    if span.is_none() {
        return;
    }
    span.add_event(name, attributes());
}

/// Holds an attempt's CLIENT span while the attempt runs; if the attempt is dropped before it
/// finishes (the losing side of a hedge, or the request's deadline), the span says so.
#[derive(Debug)]
pub struct AttemptGuard {
    span: Span,
    armed: bool,
}

impl AttemptGuard {
    pub fn new(span: Span) -> Self {
        let armed = !span.is_none();
        Self { span, armed }
    }

    pub fn span(&self) -> &Span {
        &self.span
    }

    /// The attempt finished: hands the span on, still open.
    pub fn finish(mut self) -> Span {
        self.armed = false;
        std::mem::replace(&mut self.span, Span::none())
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        if self.armed {
            self.span.set_attribute("error.type", "cancelled");
        }
    }
}

/// What a finished request records on its spans.
#[derive(Debug, Clone, Copy)]
pub struct Finish<'a> {
    pub status: u16,
    pub provider: &'a str,
    pub response_model: Option<&'a str>,
    pub usage: Option<tailwarden_decide::usage::Usage>,
    pub ttft: Option<Duration>,
    pub attempts: u32,
    pub hedged: bool,
    /// `error.type` of a failed request (`upstream_stream_error`, `client_closed`, …).
    pub error_type: Option<&'a str>,
    /// The failure is the sidecar's or a provider's (span status ERROR), not the client's.
    pub failed: bool,
}

/// Sets many attributes (and the status) with one trip through the subscriber.
fn set_all(span: &Span, attributes: Vec<KeyValue>, error: Option<&str>) {
    let cx = span.context();
    let otel = cx.span();
    otel.set_attributes(attributes);
    if let Some(e) = error {
        otel.set_status(Status::error(e.to_owned()));
    }
}

fn outcome_attributes(f: &Finish<'_>, out: &mut Vec<KeyValue>) {
    if let Some(model) = f.response_model.filter(|m| !m.is_empty()) {
        out.push(KeyValue::new("gen_ai.response.model", model.to_owned()));
    }
    if let Some(u) = f.usage {
        out.push(KeyValue::new("gen_ai.usage.input_tokens", u.input as i64));
        out.push(KeyValue::new("gen_ai.usage.output_tokens", u.output as i64));
        if u.cached_input > 0 {
            out.push(KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                u.cached_input as i64,
            ));
        }
        if u.reasoning > 0 {
            out.push(KeyValue::new(
                "gen_ai.usage.reasoning.output_tokens",
                u.reasoning as i64,
            ));
        }
        if u.estimated {
            out.push(KeyValue::new("tailwarden.usage_estimated", true));
        }
    }
    out.push(KeyValue::new(
        "http.response.status_code",
        i64::from(f.status),
    ));
    if let Some(e) = f.error_type {
        out.push(KeyValue::new("error.type", e.to_owned()));
    }
}

/// Records the outcome on the SERVER span and on the CLIENT span of the attempt that
/// answered (if any). The spans end when their handles are dropped.
pub fn finish(server: &Span, attempt: &Span, f: &Finish<'_>) {
    if server.is_none() {
        return;
    }
    let error = f.error_type.filter(|_| f.failed);
    if !attempt.is_none() {
        let mut attributes = Vec::with_capacity(8);
        outcome_attributes(f, &mut attributes);
        set_all(attempt, attributes, error);
    }
    let mut attributes = Vec::with_capacity(12);
    if !f.provider.is_empty() {
        attributes.push(KeyValue::new("gen_ai.provider.name", f.provider.to_owned()));
    }
    if let Some(ttft) = f.ttft {
        attributes.push(KeyValue::new(
            "gen_ai.response.time_to_first_chunk",
            ttft.as_secs_f64(),
        ));
    }
    attributes.push(KeyValue::new("tailwarden.attempts", i64::from(f.attempts)));
    attributes.push(KeyValue::new("tailwarden.hedged", f.hedged));
    outcome_attributes(f, &mut attributes);
    set_all(server, attributes, error);
}

/// The `model` of a non-stream response body, for `gen_ai.response.model`.
pub fn body_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Body {
        model: Option<String>,
    }
    serde_json::from_slice::<Body>(body).ok()?.model
}

/// The exporters' HTTP client: hyper on a one-thread runtime of its own, so exports work from
/// the batch processor's thread and never compete with the request path's workers.
pub(crate) struct ExportClient {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
    runtime: OwnedRuntime,
    timeout: Duration,
}

impl std::fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExportClient")
    }
}

/// A runtime that may be dropped anywhere, async contexts included.
struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Largest export response read (collectors answer with a small protobuf).
const EXPORT_RESPONSE_LIMIT: usize = 1 << 20;

impl ExportClient {
    /// `http2_only`: HTTP/2 also over plain `http://` (prior knowledge), as gRPC needs.
    pub(crate) fn new(timeout: Duration, http2_only: bool) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the export runtime: {e}"))?;
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http();
        let https = if http2_only {
            https.enable_http2().wrap_connector(http)
        } else {
            https.enable_http1().enable_http2().wrap_connector(http)
        };
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_timer(hyper_util::rt::TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(30))
                .http2_only(http2_only)
                .build(https);
        Ok(Self {
            client,
            runtime: OwnedRuntime(Some(runtime)),
            timeout,
        })
    }

    /// Sends `request` on the export runtime and hands the response to `read`, all within
    /// the export timeout.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        request: Request<Full<Bytes>>,
        read: F,
    ) -> Result<T, String>
    where
        F: FnOnce(Response<hyper::body::Incoming>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, String>> + Send,
        T: Send + 'static,
    {
        let Some(runtime) = self.runtime.0.as_ref() else {
            return Err("the export runtime is gone".into());
        };
        let client = self.client.clone();
        let timeout = self.timeout;
        let task = runtime.spawn(async move {
            let exchange = async {
                let response = client.request(request).await.map_err(|e| {
                    // The source says why (connection refused, TLS, …).
                    let source = std::error::Error::source(&e)
                        .map(|s| format!(": {s}"))
                        .unwrap_or_default();
                    format!("{e}{source}")
                })?;
                read(response).await
            };
            tokio::time::timeout(timeout, exchange)
                .await
                .map_err(|_| "the OTLP export timed out".to_owned())?
        });
        task.await.map_err(|e| e.to_string())?
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        self.call(
            Request::from_parts(parts, Full::new(body)),
            |response| async move {
                let (parts, body) = response.into_parts();
                let body = Limited::new(body, EXPORT_RESPONSE_LIMIT)
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok(Response::from_parts(parts, body))
            },
        )
        .await
        .map_err(HttpError::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_variable_names_grpc_or_http_protobuf_only() {
        assert_eq!(Protocol::parse("grpc"), Some(Protocol::Grpc));
        assert_eq!(
            Protocol::parse(" http/protobuf "),
            Some(Protocol::HttpProtobuf)
        );
        assert_eq!(Protocol::parse("http/json"), None);
        assert_eq!(Protocol::default(), Protocol::HttpProtobuf);
        for p in [Protocol::Grpc, Protocol::HttpProtobuf] {
            assert_eq!(Protocol::parse(p.as_str()), Some(p));
        }
    }
}
