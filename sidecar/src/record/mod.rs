//! The last stage: what a request leaves behind. The [`recorder::Recorder`] watches the
//! response body and, when it ends (or is dropped), writes the request's metrics, tokens,
//! cost, span outcome and one JSON access-log line, exactly once. [`metrics`] is the
//! Prometheus registry, [`telemetry`] the OpenTelemetry spans and the log subscriber,
//! [`otlp_grpc`] their OTLP/gRPC exporter, [`identity`] the workload the sidecar
//! serves, on every access-log line; [`access_log`] writes those lines off the request path.

pub mod access_log;
pub mod identity;
pub mod metrics;
pub mod otlp_grpc;
pub mod recorder;
pub mod telemetry;
