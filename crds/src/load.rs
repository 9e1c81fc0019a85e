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
    /// The file the problem is in.
    pub file: String,
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
    /// The file (or directory of files) was read but holds invalid routes.
    #[error("{file}: {}", render_issues(.file, .issues))]
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

/// Issues of the named file print as before; issues of files inside a directory are
/// prefixed with their file.
fn render_issues(file: &str, issues: &[ConfigIssue]) -> String {
    let one = |issue: &ConfigIssue| {
        if issue.file == file {
            issue.to_string()
        } else {
            format!("{}: {issue}", issue.file)
        }
    };
    match issues {
        [single] => one(single),
        many => {
            let mut out = format!("{} problems:", many.len());
            for issue in many {
                out.push_str("\n  ");
                out.push_str(&one(issue));
            }
            out
        }
    }
}

/// Reads and validates a config file, or every `*.yaml`/`*.yml` file of a directory (as the
/// operator's projected ConfigMap volume provides, one file per route), in name order.
pub fn load_file(path: &Path) -> Result<Vec<InferenceRoute>, LoadError> {
    let file = path.display().to_string();
    let read_err = |source| LoadError::Read {
        file: file.clone(),
        source,
    };
    if path.is_dir() {
        let mut names: Vec<_> = std::fs::read_dir(path)
            .map_err(read_err)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                !name.starts_with('.')
                    && (name.ends_with(".yaml") || name.ends_with(".yml"))
                    && p.is_file()
            })
            .collect();
        names.sort();
        let mut sources = Vec::with_capacity(names.len());
        for name in names {
            let text = std::fs::read_to_string(&name).map_err(|source| LoadError::Read {
                file: name.display().to_string(),
                source,
            })?;
            sources.push((name.display().to_string(), text));
        }
        return load_sources(&file, &sources);
    }
    let text = std::fs::read_to_string(path).map_err(read_err)?;
    load_str(&file, &text)
}

/// Validates config text; `file` names it in messages.
pub fn load_str(file: &str, text: &str) -> Result<Vec<InferenceRoute>, LoadError> {
    load_sources(file, &[(file.to_owned(), text.to_owned())])
}

/// Validates several files as one config (`label` names the whole in messages): each file
/// on its own, then the rules across all routes (a model served twice, a route twice).
pub fn load_sources(
    label: &str,
    sources: &[(String, String)],
) -> Result<Vec<InferenceRoute>, LoadError> {
    let mut issues = Vec::new();
    let mut routes: Vec<(String, usize, InferenceRoute)> = Vec::new();
    for (file, text) in sources {
        load_one(file, text, &mut routes, &mut issues);
    }
    check_across_routes(&routes, &mut issues);
    if issues.is_empty() {
        Ok(routes.into_iter().map(|(_, _, r)| r).collect())
    } else {
        Err(LoadError::Invalid {
            file: label.to_owned(),
            issues,
        })
    }
}

fn load_one(
    file: &str,
    text: &str,
    routes: &mut Vec<(String, usize, InferenceRoute)>,
    issues: &mut Vec<ConfigIssue>,
) {
    let issue =
        |document: usize, route: Option<String>, field: &str, message: String| ConfigIssue {
            file: file.to_owned(),
            document,
            route,
            field: field.to_owned(),
            message,
        };
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
        if let Err(errors) = crate::crd::validate(&route) {
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
        routes.push((file.to_owned(), number, route));
    }
}

/// Rules no single object can check: names and models must not be claimed twice.
fn check_across_routes(routes: &[(String, usize, InferenceRoute)], issues: &mut Vec<ConfigIssue>) {
    let mut names: BTreeMap<String, (&str, usize)> = BTreeMap::new();
    let mut models: BTreeMap<&str, (&str, usize, String)> = BTreeMap::new();
    let here = |other_file: &str, file: &str, doc: usize| {
        if other_file == file {
            format!("document {doc}")
        } else {
            format!("{other_file} document {doc}")
        }
    };
    for (file, number, route) in routes {
        let name = qualified_name(route);
        let issue = |field: &str, message: String| ConfigIssue {
            file: file.clone(),
            document: *number,
            route: Some(name.clone()),
            field: field.to_owned(),
            message,
        };
        if let Some((first_file, first)) = names.get(&name) {
            issues.push(issue(
                "metadata.name",
                format!(
                    "route {name} is already defined in {}",
                    here(first_file, file, *first)
                ),
            ));
            continue;
        }
        names.insert(name.clone(), (file, *number));
        for (i, model) in route.spec.models.iter().enumerate() {
            match models.get(model.as_str()) {
                Some((first_file, first, other)) => issues.push(issue(
                    &format!("spec.models[{i}]"),
                    format!(
                        "model {model:?} is already served by route {other} ({})",
                        here(first_file, file, *first)
                    ),
                )),
                None => {
                    models.insert(model, (file, *number, name.clone()));
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
