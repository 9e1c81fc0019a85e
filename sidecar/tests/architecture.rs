//! The sidecar's top-level modules import each other in one direction only: the request
//! path's stages call the stages after them, and everything may use the layers below, but no
//! import goes back up. Read from the source (`use crate::…` and `crate::…` paths), so a new
//! import that closes a cycle fails here with the cycle named.
#![allow(clippy::unwrap_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/attempts/upstream.rs` → `attempts`).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_owned())
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Top-level modules named after `crate::` in `text`: `crate::a::…` and the groups of
/// `use crate::{a::…, b, c::{…}}`.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group: split on commas outside nested braces.
            let mut depth = 0;
            let mut start = 0;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        let name = ident_at(group[start..j].trim_start());
                        if !name.is_empty() {
                            out.insert(name.to_owned());
                        }
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        let name = ident_at(group[start..j].trim_start());
                        if !name.is_empty() {
                            out.insert(name.to_owned());
                        }
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident_at(rest);
            if !name.is_empty() {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(&src, f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(from) = module_of(&src, file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let deps = graph.entry(from.clone()).or_default();
        for to in crate_refs(&text) {
            if to != from && modules.contains(&to) {
                deps.insert(to);
            }
        }
    }
    graph
}

/// A cycle through `node`, if any (depth-first, colouring nodes on the current path).
fn find_cycle(
    graph: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(pos) = path.iter().position(|n| n == node) {
        let mut cycle = path[pos..].to_vec();
        cycle.push(node.to_owned());
        return Some(cycle);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_owned());
    for next in graph.get(node).into_iter().flatten() {
        if let Some(c) = find_cycle(graph, next, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(node.to_owned());
    None
}

#[test]
fn the_parser_reads_imports() {
    let refs = crate_refs(
        "use crate::{a::B, c, d::{e::F, G}};\n// crate::commented\nlet x = crate::h::i();\n",
    );
    assert_eq!(refs.into_iter().collect::<Vec<_>>(), ["a", "c", "d", "h"]);
}

/// The request path's stages in the order a request walks them, then the layers beside it:
/// a module may import only modules after it here.
const ORDER: &[&str] = &[
    "server", "ingress", "policy", "attempts", "app", "config", "record", "state", "relay",
];

#[test]
fn imports_follow_the_request_path_downwards() {
    let graph = graph();
    let rank = |m: &str| ORDER.iter().position(|o| *o == m);
    for (from, deps) in &graph {
        let Some(f) = rank(from) else {
            panic!("top-level module {from} is not in ORDER: place it in the layering");
        };
        for to in deps {
            let t = rank(to).unwrap_or(usize::MAX);
            assert!(
                t > f,
                "{from} imports {to}, which comes before it in {ORDER:?}"
            );
        }
    }
}

#[test]
fn top_level_modules_import_each_other_without_a_cycle() {
    let graph = graph();
    assert!(graph.len() >= 5, "modules found: {graph:?}");
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = find_cycle(&graph, node, &mut Vec::new(), &mut done) {
            panic!(
                "import cycle between top-level modules: {}\nall imports: {graph:#?}",
                cycle.join(" → ")
            );
        }
    }
}
