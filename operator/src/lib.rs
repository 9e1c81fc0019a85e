//! tailwarden-operator: the control plane. Reconciles `InferenceRoute`s into sidecar config
//! ConfigMaps with status, and injects the sidecar into pods through a mutating webhook.
//!
//! Decisions are pure (`render`, `status`, `inject`, `sidecar_env`, `triggers`); I/O lives in `controller`,
//! `webhook`, `certs` and `leader`.

pub mod certs;
pub mod consts;
pub mod controller;
pub mod inject;
pub mod leader;
pub mod render;
pub mod run;
pub mod sidecar_env;
pub mod status;
pub mod triggers;
pub mod webhook;
