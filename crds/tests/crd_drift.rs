//! The committed CRD manifest must be exactly what the Rust types generate.

#[test]
fn committed_crd_matches_the_rust_types() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("inferenceroute.yaml");
    let committed = std::fs::read_to_string(&path).expect("crds/inferenceroute.yaml exists");
    let generated = tailwarden_crds::crd::crd_yaml().expect("CRD renders");
    assert!(
        committed == generated,
        "crds/inferenceroute.yaml is out of date with crds/src/route.rs: run `make crds` and commit the result"
    );
}

#[test]
fn committed_reference_matches_the_rust_types() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/inferenceroute-reference.md");
    let committed =
        std::fs::read_to_string(&path).expect("docs/inferenceroute-reference.md exists");
    let generated = tailwarden_crds::crd::reference_markdown().expect("reference renders");
    assert!(
        committed == generated,
        "docs/inferenceroute-reference.md is out of date with crds/src/route.rs: run `make crds` and commit the result"
    );
}

#[test]
fn crd_has_the_api_surface_users_rely_on() {
    use kube::CustomResourceExt;
    let crd = tailwarden_crds::InferenceRoute::crd();
    assert_eq!(
        crd.metadata.name.as_deref(),
        Some("inferenceroutes.tailwarden.io")
    );
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.short_names, Some(vec!["ir".to_string()]));
    let version = &crd.spec.versions[0];
    assert_eq!(version.name, "v1alpha1");
    assert!(
        version
            .subresources
            .as_ref()
            .and_then(|s| s.status.as_ref())
            .is_some()
    );
    let columns: Vec<_> = version
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(columns, ["Ready", "Providers", "TTFT SLO", "Age"]);

    // Every property in the schema has a description, so `kubectl explain` teaches.
    let schema = serde_json::to_value(
        version
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref()),
    )
    .expect("schema");
    let spec = &schema["properties"]["spec"];
    let mut missing = Vec::new();
    walk(spec, "spec", &mut missing);
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:?}"
    );
}

fn walk(node: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
    if node
        .get("description")
        .and_then(|d| d.as_str())
        .is_none_or(str::is_empty)
    {
        missing.push(path.to_owned());
    }
    if let Some(props) = node.get("properties").and_then(|p| p.as_object()) {
        for (name, child) in props {
            walk(child, &format!("{path}.{name}"), missing);
        }
    }
    if let Some(items) = node.get("items")
        && items.get("properties").is_some()
    {
        walk(items, &format!("{path}[]"), missing);
    }
}
