//! The CustomResourceDefinition generated from the Rust types.
//!
//! `crds/inferenceroute.yaml` is this output, committed so that users can `kubectl apply` it
//! and the Helm chart can ship it; a test fails when the two drift (`make crds` regenerates).

use kube::CustomResourceExt;

use crate::route::InferenceRoute;

/// Path of the committed CRD manifest, relative to the workspace root.
pub const CRD_PATH: &str = "crds/inferenceroute.yaml";

/// The CRD as a YAML document, with a header saying where it comes from.
pub fn crd_yaml() -> Result<String, serde_norway::Error> {
    let body = serde_norway::to_string(&InferenceRoute::crd())?;
    Ok(format!(
        "# Generated from crds/src/route.rs by `make crds` (tailwarden-operator crd). Do not edit.\n{body}"
    ))
}
