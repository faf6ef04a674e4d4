//! The agent's folders are layers (see the table in `src/lib.rs`): a module
//! uses modules of its own folder or of a lower layer, never a higher one,
//! and no chain of `crate::` paths between files comes back to where it
//! started. This reads the sources as text, so it also holds for code behind
//! `cfg(test)`.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// Rank of each layer; a module may use a strictly lower rank or its own
/// folder. `serve` and `datapath` share a rank, so neither uses the other.
fn rank(layer: &str) -> Option<u8> {
    Some(match layer {
        "base" => 0,
        "input" => 1,
        "semantics" => 2,
        "datapath" | "serve" => 3,
        "check" | "cli" | "inspect" | "run" => 4,
        _ => return None,
    })
}

/// `src/datapath/tc.rs` → `["datapath", "tc"]`; `mod.rs` names its folder.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every module path a file names through `crate::`, with `use crate::{a::b,
/// c}` groups expanded (two levels: folder and file).
fn crate_paths(text: &str) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        expand(rest, &[], &mut out);
    }
    out
}

fn expand(text: &str, prefix: &[String], out: &mut BTreeSet<Vec<String>>) {
    let mut path = prefix.to_vec();
    let mut s = text;
    loop {
        if let Some(group) = s.strip_prefix('{') {
            for item in top_level_items(group) {
                expand(item.trim(), &path, out);
            }
            return;
        }
        let ident: String = s
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !ident.is_empty() && ident != "self" {
            path.push(ident.clone());
        }
        s = &s[ident.len()..];
        match s.strip_prefix("::") {
            Some(after) => s = after,
            None => break,
        }
    }
    if !path.is_empty() {
        out.insert(path.into_iter().take(2).collect());
    }
}

/// The comma-separated items of a `{...}` group (text after the `{`).
fn top_level_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items
}

/// The file-level module a path names: the longest known prefix.
fn resolve(path: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

fn graph() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .filter(|f| !f.ends_with("lib.rs") && !f.ends_with("main.rs"))
        .map(|f| (module_path(&src, f), f.clone()))
        .collect();
    let known: BTreeSet<Vec<String>> = modules.keys().cloned().collect();
    modules
        .iter()
        .map(|(module, file)| {
            let text = fs::read_to_string(file).unwrap();
            let uses = crate_paths(&text)
                .iter()
                .filter_map(|p| resolve(p, &known))
                .filter(|m| m != module && !module.starts_with(m))
                .collect();
            (module.clone(), uses)
        })
        .collect()
}

#[test]
fn no_module_uses_a_higher_layer() {
    let mut wrong = Vec::new();
    for (module, uses) in graph() {
        let from = &module[0];
        let from_rank = rank(from).unwrap_or_else(|| panic!("{module:?} is in no layer"));
        for used in uses {
            let to = &used[0];
            let to_rank = rank(to).unwrap_or_else(|| panic!("{used:?} is in no layer"));
            if from != to && to_rank >= from_rank && !(from_rank == 4 && to_rank == 4) {
                wrong.push(format!("{} uses {}", module.join("::"), used.join("::")));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_import_circles() {
    let graph = graph();
    // Depth-first search; a back edge closes a circle.
    fn visit(
        node: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            return Some(stack[at..].to_vec());
        }
        if !done.insert(node.clone()) {
            return None;
        }
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(circle) = visit(next, graph, stack, done) {
                return Some(circle);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(circle) = visit(node, &graph, &mut Vec::new(), &mut done) {
            let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
            panic!("import circle: {} → back", names.join(" → "));
        }
    }
}

#[test]
fn the_parser_sees_groups_and_inline_paths() {
    let paths = crate_paths(
        "use crate::{base::addr::ip_from_bytes, datapath::{loader::PinnedMaps, tc}};\n\
         let x = crate::semantics::maglev::build(&n, 7);",
    );
    let want: BTreeSet<Vec<String>> = [
        ["base", "addr"],
        ["datapath", "loader"],
        ["datapath", "tc"],
        ["semantics", "maglev"],
    ]
    .iter()
    .map(|p| p.iter().map(|s| s.to_string()).collect())
    .collect();
    assert_eq!(paths, want);
}
