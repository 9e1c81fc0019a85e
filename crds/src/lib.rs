//! The tailwarden API: the `InferenceRoute` custom resource (`tailwarden.io/v1alpha1`).
//!
//! - [`route`]: the Rust types, the single source of truth for the CRD schema.
//! - [`units`]: durations, decimals and byte sizes written as strings.
//! - [`crd`]: the generated CustomResourceDefinition, as YAML.
//! - [`load`]: reading a file of `InferenceRoute` documents (the sidecar's `--config`) and
//!   validating it exactly as the API server would.

pub mod crd;
pub mod load;
pub mod route;
pub mod units;

pub use load::{ConfigIssue, LoadError, load_file, load_sources, load_str};
pub use route::*;
pub use units::{ByteSize, Decimal, DurationString, UnitError};
