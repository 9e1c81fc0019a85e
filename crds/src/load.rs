//! Reads a file of one or more `InferenceRoute` YAML documents — the same schema users
//! `kubectl apply` — and validates it the way the API server would: types and unknown fields
//! by the schema, cross-field rules by the CRD's own CEL expressions (evaluated offline).
//!
//! Every problem is reported with the file, the document number and the field path, and all
//! problems of a file are reported at once, so one edit-and-reload fixes them all.

use std::{collections::BTreeMap, fmt, path::Path};

use serde::Deserialize;

use crate::route::InferenceRoute;

/// The `apiVersion` routes must declare.
pub const API_VERSION: &str = "tailwarden.io/v1alpha1";
/// The `kind` routes must declare.
pub const KIND: &str = "InferenceRoute";

/// One problem in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// 1-based index of the YAML document in the file.
    pub document: usize,
    /// `namespace/name` of the route, when it could be read.
    pub route: Option<String>,
    /// Dotted path of the field at fault (`spec.providers[0].weight`), empty for the document.
    pub field: String,
    /// What is wrong, for a human.
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}", self.document)?;
        if let Some(route) = &self.route {
            write!(f, " (route {route})")?;
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// The file was read but holds invalid routes.
    #[error("{file}: {}", render_issues(.issues))]
    Invalid {
        file: String,
        issues: Vec<ConfigIssue>,
    },
}

impl LoadError {
    /// The individual problems (empty for read errors).
    pub fn issues(&self) -> &[ConfigIssue] {
        match self {
            LoadError::Read { .. } => &[],
            LoadError::Invalid { issues, .. } => issues,
        }
    }
}

fn render_issues(issues: &[ConfigIssue]) -> String {
    match issues {
        [one] => one.to_string(),
        many => {
            let mut out = format!("{} problems:", many.len());
            for issue in many {
                out.push_str("\n  ");
                out.push_str(&issue.to_string());
            }
            out
        }
    }
}

/// Reads and validates a config file.
pub fn load_file(path: &Path) -> Result<Vec<InferenceRoute>, LoadError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        file: file.clone(),
        source,
    })?;
    load_str(&file, &text)
}

/// Validates config text; `file` names it in messages.
pub fn load_str(file: &str, text: &str) -> Result<Vec<InferenceRoute>, LoadError> {
    let mut issues = Vec::new();
    let mut routes: Vec<(usize, InferenceRoute)> = Vec::new();

    for (index, document) in serde_norway::Deserializer::from_str(text).enumerate() {
        let number = index + 1;
        // First as a generic value: skips empty documents, reads the route's name for
        // messages, and checks apiVersion/kind before the typed parse complains about fields.
        let value = match serde_norway::Value::deserialize(document) {
            Ok(serde_norway::Value::Null) => continue,
            Ok(value) => value,
            Err(e) => {
                issues.push(issue(number, None, "", e.to_string()));
                // A syntax error leaves the rest of the stream unreadable.
                break;
            }
        };
        let route_name = route_name(&value);
        if !value.is_mapping() {
            issues.push(issue(
                number,
                None,
                "",
                "expected an InferenceRoute object (a YAML mapping)".into(),
            ));
            continue;
        }
        let mut header_ok = true;
        for (field, want) in [("apiVersion", API_VERSION), ("kind", KIND)] {
            match value.get(field).and_then(|v| v.as_str()) {
                Some(got) if got == want => {}
                Some(got) => {
                    header_ok = false;
                    issues.push(issue(
                        number,
                        route_name.clone(),
                        field,
                        format!("must be {want:?}, found {got:?}"),
                    ));
                }
                None => {
                    header_ok = false;
                    issues.push(issue(
                        number,
                        route_name.clone(),
                        field,
                        format!("required: must be {want:?}"),
                    ));
                }
            }
        }
        if !header_ok {
            continue;
        }
        if route_name.is_none() {
            issues.push(issue(
                number,
                None,
                "metadata.name",
                "required: every route needs a name".into(),
            ));
            continue;
        }
        let route: InferenceRoute = match serde_path_to_error::deserialize(value) {
            Ok(route) => route,
            Err(e) => {
                let field = e.path().to_string();
                let field = if field == "." { String::new() } else { field };
                issues.push(issue(
                    number,
                    route_name,
                    &field,
                    e.into_inner().to_string(),
                ));
                continue;
            }
        };
        if let Err(errors) = route.validate_cel() {
            for error in errors.iter() {
                issues.push(issue(
                    number,
                    route_name.clone(),
                    &error.field_path,
                    error.message.clone(),
                ));
            }
            continue;
        }
        routes.push((number, route));
    }

    check_across_routes(&routes, &mut issues);

    if issues.is_empty() {
        Ok(routes.into_iter().map(|(_, r)| r).collect())
    } else {
        Err(LoadError::Invalid {
            file: file.to_owned(),
            issues,
        })
    }
}

/// Rules no single object can check: names and models must not be claimed twice.
fn check_across_routes(routes: &[(usize, InferenceRoute)], issues: &mut Vec<ConfigIssue>) {
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    let mut models: BTreeMap<&str, (usize, String)> = BTreeMap::new();
    for (number, route) in routes {
        let name = qualified_name(route);
        if let Some(first) = names.insert(name.clone(), *number) {
            issues.push(issue(
                *number,
                Some(name.clone()),
                "metadata.name",
                format!("route {name} is already defined in document {first}"),
            ));
            continue;
        }
        for (i, model) in route.spec.models.iter().enumerate() {
            match models.get(model.as_str()) {
                Some((first, other)) => issues.push(issue(
                    *number,
                    Some(name.clone()),
                    &format!("spec.models[{i}]"),
                    format!(
                        "model {model:?} is already served by route {other} (document {first})"
                    ),
                )),
                None => {
                    models.insert(model, (*number, name.clone()));
                }
            }
        }
    }
}

/// `namespace/name`, with `default` for routes that name no namespace.
pub fn qualified_name(route: &InferenceRoute) -> String {
    format!(
        "{}/{}",
        route.metadata.namespace.as_deref().unwrap_or("default"),
        route.metadata.name.as_deref().unwrap_or("")
    )
}

fn route_name(value: &serde_norway::Value) -> Option<String> {
    let metadata = value.get("metadata")?;
    let name = metadata.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let namespace = metadata
        .get("namespace")
        .and_then(|n| n.as_str())
        .unwrap_or("default");
    Some(format!("{namespace}/{name}"))
}

fn issue(document: usize, route: Option<String>, field: &str, message: String) -> ConfigIssue {
    ConfigIssue {
        document,
        route,
        field: field.to_owned(),
        message,
    }
}
