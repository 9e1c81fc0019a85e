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
    let mut crd = serde_json::to_value(InferenceRoute::crd())
        .map_err(<serde_norway::Error as serde::ser::Error>::custom)?;
    tidy_descriptions(&mut crd);
    let body = serde_norway::to_string(&crd)?;
    Ok(format!(
        "# Generated from crds/src/route.rs by `make crds` (tailwarden-operator crd). Do not edit.\n{body}"
    ))
}

/// Doc comments wrap at 100 columns; `kubectl explain` re-wraps text itself, so single
/// line breaks inside a paragraph become spaces (blank lines still separate paragraphs).
fn tidy_descriptions(node: &mut serde_json::Value) {
    match node {
        serde_json::Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                if key == "description" {
                    if let Some(text) = value.as_str() {
                        let joined = text
                            .split("\n\n")
                            .map(|para| {
                                para.split('\n')
                                    .map(str::trim)
                                    .collect::<Vec<_>>()
                                    .join(" ")
                            })
                            .collect::<Vec<_>>()
                            .join("\n\n");
                        *value = serde_json::Value::String(joined);
                    }
                } else {
                    tidy_descriptions(value);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(tidy_descriptions),
        _ => {}
    }
}

/// Path of the generated field reference, relative to the workspace root.
pub const REFERENCE_PATH: &str = "docs/inferenceroute-reference.md";

/// A Markdown reference of every field (path, type, default, description) and every
/// validation rule, generated from the same schema as the CRD so the two cannot disagree.
pub fn reference_markdown() -> Result<String, serde_json::Error> {
    let crd = InferenceRoute::crd();
    let schema = serde_json::to_value(
        crd.spec
            .versions
            .first()
            .and_then(|v| v.schema.as_ref())
            .and_then(|s| s.open_api_v3_schema.as_ref()),
    )?;
    let mut fields = String::new();
    let mut rules = String::new();
    walk(
        &schema["properties"]["spec"],
        "spec",
        &mut fields,
        &mut rules,
    );
    Ok(format!(
        "<!-- Generated from crds/src/route.rs by `make crds`. Do not edit. -->\n\
         # InferenceRoute field reference\n\n\
         `tailwarden.io/v1alpha1`, kind `InferenceRoute`, namespaced, short name `ir`. \
         Durations are strings such as `800ms`, `2s`, `5m`; prices and percentages are decimal \
         strings or integers, never floats.\n\n\
         ## Fields\n\n| field | type | default | description |\n|---|---|---|---|\n{fields}\n\
         ## Validation rules\n\nChecked by the API server (CEL) and, with the same messages, by the \
         standalone sidecar's config loader.\n\n| field | rule | message |\n|---|---|---|\n{rules}"
    ))
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

fn type_of(node: &serde_json::Value) -> String {
    if node.get("x-kubernetes-int-or-string").is_some() {
        return "int or string".into();
    }
    let base = node["type"].as_str().unwrap_or("object");
    match base {
        "array" => format!("[]{}", type_of(&node["items"])),
        "object" if node.get("additionalProperties").is_some() => "map[string]string".into(),
        "string" => match node.get("enum").and_then(|e| e.as_array()) {
            Some(values) => values
                .iter()
                .filter_map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(" \\| "),
            None => "string".into(),
        },
        other => other.into(),
    }
}

fn walk(node: &serde_json::Value, path: &str, fields: &mut String, rules: &mut String) {
    if let Some(list) = node
        .get("x-kubernetes-validations")
        .and_then(|v| v.as_array())
    {
        for rule in list {
            let at = match rule["fieldPath"].as_str() {
                Some(fp) => format!("{path}{fp}"),
                None => path.to_owned(),
            };
            rules.push_str(&format!(
                "| `{at}` | `{}` | {} |\n",
                cell(rule["rule"].as_str().unwrap_or_default()),
                cell(rule["message"].as_str().unwrap_or_default())
            ));
        }
    }
    let (props, prefix) = match node.get("properties") {
        Some(p) => (p, path.to_owned()),
        None => match node["items"].get("properties") {
            Some(p) => {
                walk_rules_only(&node["items"], &format!("{path}[]"), rules);
                (p, format!("{path}[]"))
            }
            None => return,
        },
    };
    let Some(props) = props.as_object() else {
        return;
    };
    for (name, child) in props {
        let child_path = format!("{prefix}.{name}");
        let default = child
            .get("default")
            .filter(|d| !d.is_object())
            .map(|d| format!("`{d}`"))
            .unwrap_or_default();
        fields.push_str(&format!(
            "| `{child_path}` | {} | {} | {} |\n",
            type_of(child),
            cell(&default),
            cell(child["description"].as_str().unwrap_or_default())
        ));
        walk(child, &child_path, fields, rules);
    }
}

fn walk_rules_only(node: &serde_json::Value, path: &str, rules: &mut String) {
    if let Some(list) = node
        .get("x-kubernetes-validations")
        .and_then(|v| v.as_array())
    {
        for rule in list {
            let at = match rule["fieldPath"].as_str() {
                Some(fp) => format!("{path}{fp}"),
                None => path.to_owned(),
            };
            rules.push_str(&format!(
                "| `{at}` | `{}` | {} |\n",
                cell(rule["rule"].as_str().unwrap_or_default()),
                cell(rule["message"].as_str().unwrap_or_default())
            ));
        }
    }
}

thread_local! {
    /// The CRD's CEL rules, compiled once per thread: compiling them is far more work than
    /// evaluating them, and the operator validates on every reconcile.
    static COMPILED: kube::core::cel::CompiledSchema = {
        let schema = InferenceRoute::crd()
            .spec
            .versions
            .first()
            .and_then(|v| v.schema.as_ref())
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .and_then(|s| serde_json::to_value(s).ok())
            .unwrap_or_default();
        kube::core::cel::compile_schema(&schema)
    };
}

/// Checks a route against the CRD's CEL rules offline — what the API server checks, with the
/// same messages and field paths. Equivalent to `InferenceRoute::validate_cel`, without
/// recompiling the rules on every call.
pub fn validate(route: &InferenceRoute) -> Result<(), kube::core::cel::ValidationErrors> {
    let object = serde_json::to_value(route).unwrap_or_default();
    COMPILED.with(|compiled| kube::core::cel::validate_compiled(compiled, &object, None))
}
