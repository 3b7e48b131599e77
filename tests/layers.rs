//! The layering of every crate's modules, checked: no module imports one that imports it back, directly or through
//! others (the gateway's crate documentation lists its layers). The test reads each crate's sources and fails on
//! an import cycle, naming it. And the one place `unsafe` code is allowed stays the only one.
//!
//! A module is a file of a crate's `src/` or a folder there (its files together: `policy/` is `policy`); it
//! imports the modules its code names by `crate::` paths (and, in a file of `src/` itself, by `super::` paths, its
//! siblings). Comments are left out: a documentation link is no import. Unit tests (an item under `#[cfg(test)]`,
//! and the file of a module declared so) are left out too: they are built into no library, and a test of one module may
//! build its inputs with a higher one (a policy's tests, policies by name from the config).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The `src/` folder of every crate of the workspace: the `dprouter` binary's and each member's.
fn crates() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs = vec![root.join("src")];
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let src = entry.unwrap().path().join("src");
        if src.is_dir() {
            dirs.push(src);
        }
    }
    dirs.sort();
    dirs
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A crate's modules (the crate's root files, `lib.rs` and `main.rs`, are not: they declare the others) and, for
/// each, the modules it names.
fn imports(src: &Path) -> Graph {
    let mut files = Vec::new();
    sources(src, &mut files);
    let texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            (path, text)
        })
        .collect();
    // The files of modules declared under `#[cfg(test)]` (`mod tests;` in `foo.rs` or `foo/mod.rs` is `foo/tests.rs`).
    let mut test_files = BTreeSet::new();
    for (path, text) in &texts {
        let dir = match path.file_stem().unwrap().to_str().unwrap() {
            "mod" | "lib" | "main" => path.parent().unwrap().to_path_buf(),
            stem => path.parent().unwrap().join(stem),
        };
        for (name, file) in test_modules(text) {
            // A `#[path]` is relative to the declaring file's folder.
            test_files.insert(match file {
                Some(file) => path.parent().unwrap().join(file),
                None => dir.join(format!("{name}.rs")),
            });
        }
    }
    let mut graph = Graph::new();
    for (path, text) in &texts {
        let relative = path.strip_prefix(src).unwrap();
        let top_level = relative.components().count() == 1;
        let first = relative.components().next().unwrap().as_os_str().to_string_lossy();
        let module = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        if top_level && (module == "lib" || module == "main") {
            continue;
        }
        let names = graph.entry(module.clone()).or_default();
        if test_files.contains(path) {
            continue;
        }
        for line in library_lines(text) {
            let code = line.split("//").next().unwrap_or_default();
            let mut prefixes = vec!["crate::"];
            if top_level {
                prefixes.push("super::");
            }
            for prefix in prefixes {
                for (at, _) in code.match_indices(prefix) {
                    // `super::` inside a longer path (`self::super::`) or a name ending so is not a sibling.
                    if at > 0 && code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                        continue;
                    }
                    let rest = &code[at + prefix.len()..];
                    if let Some(group) = rest.strip_prefix('{') {
                        // `use crate::{a, b::c}`: the group's first segments (on this line).
                        let group = group.split('}').next().unwrap_or_default();
                        names.extend(group.split(',').filter_map(|item| first_segment(item.trim())));
                    } else {
                        names.extend(first_segment(rest));
                    }
                }
            }
        }
        names.remove(&module);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for names in graph.values_mut() {
        // Re-exports at the crate's root (`crate::AppState`) are not modules.
        names.retain(|n| modules.contains(n));
    }
    graph
}

/// The modules `text` declares under `#[cfg(test)]` with a file of their own (`mod tests;`), each with the file a
/// `#[path = "..."]` attribute names for it, if one does.
fn test_modules(text: &str) -> Vec<(String, Option<String>)> {
    let mut names = Vec::new();
    let mut after_cfg_test = false;
    let mut path = None;
    for line in text.lines().map(str::trim) {
        if line == "#[cfg(test)]" {
            after_cfg_test = true;
            path = None;
        } else if after_cfg_test && line.starts_with("#[") {
            // Another attribute of the same item; a file of its own.
            if let Some(file) = line.strip_prefix("#[path = \"").and_then(|r| r.strip_suffix("\"]")) {
                path = Some(file.to_string());
            }
        } else {
            if after_cfg_test {
                let declared = line.strip_prefix("pub(crate) ").unwrap_or(line);
                if let Some(name) = declared.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                    names.push((name.trim().to_string(), path.take()));
                }
            }
            after_cfg_test = false;
        }
    }
    names
}

/// The lines of `text` outside items marked `#[cfg(test)]` (the item's braces counted from the line after the
/// attribute; a `mod tests;` declaration ends at its semicolon).
fn library_lines(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut skipping = false;
    let mut depth = 0i64;
    let mut opened = false;
    for line in text.lines() {
        if !skipping && line.trim() == "#[cfg(test)]" {
            (skipping, depth, opened) = (true, 0, false);
            continue;
        }
        if !skipping {
            lines.push(line);
            continue;
        }
        let code = line.split("//").next().unwrap_or_default();
        for c in code.chars() {
            match c {
                '{' => {
                    depth += 1;
                    opened = true;
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
        if (opened && depth <= 0) || (!opened && code.trim_end().ends_with(';')) {
            skipping = false;
        }
    }
    lines
}

fn first_segment(path: &str) -> Option<String> {
    let name: String = path.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty() && name.starts_with(|c: char| c.is_lowercase())).then_some(name)
}

/// A cycle of `graph`, as the modules along it, if there is one.
fn cycle(graph: &Graph) -> Option<Vec<String>> {
    // Depth-first, with the path being walked: an edge back into the path closes a cycle.
    fn visit(node: &str, graph: &Graph, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_of_any_crate_imports_one_that_imports_it_back() {
    let crates = crates();
    assert!(crates.len() >= 9, "the crates were not found: {crates:?}");
    let mut cycles = Vec::new();
    let mut modules = 0;
    for src in &crates {
        // A crate of one file (its `lib.rs`) has no modules to order.
        let graph = imports(src);
        modules += graph.len();
        if let Some(found) = cycle(&graph) {
            cycles.push(format!("{}: {}", src.display(), found.join(" -> ")));
        }
    }
    assert!(modules > 50, "the sources were not read: {modules} modules");
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

#[test]
fn imports_are_read_from_files_and_folders() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let gateway = imports(&root.join("gateway/src"));
    assert!(gateway["api"].contains("state"), "{gateway:?}");
    // A folder is one module: the cache-aware policy's files (under `policy/`) name the core's hashing.
    let core = imports(&root.join("core/src"));
    assert!(core["policy"].contains("hashing"), "{core:?}");
    assert!(!core.contains_key("cache_aware"), "{core:?}");
    assert!(!core.contains_key("lib"), "{core:?}");
}

/// The gateway's folders (and `state.rs`), lowest first: each may import only those before it
/// (`crates/gateway/src/lib.rs` says what each holds).
const GATEWAY_LAYERS: [&str; 13] = [
    "common",
    "config",
    "http",
    "fleet",
    "observe",
    "discovery",
    "kv_feeds",
    "admission",
    "state",
    "background",
    "pipeline",
    "disagg",
    "api",
];

#[test]
fn the_gateways_folders_import_only_those_below_them() {
    let gateway = imports(&Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/gateway/src"));
    let listed: BTreeSet<&str> = GATEWAY_LAYERS.iter().copied().collect();
    let found: BTreeSet<&str> = gateway.keys().map(String::as_str).collect();
    assert_eq!(found, listed, "crates/gateway/src's entries and GATEWAY_LAYERS differ");
    let rank = |name: &str| GATEWAY_LAYERS.iter().position(|l| *l == name).unwrap();
    let mut upward = Vec::new();
    for (module, names) in &gateway {
        for name in names.iter().filter(|n| rank(n) > rank(module)) {
            upward.push(format!("{module} imports {name}"));
        }
    }
    assert!(upward.is_empty(), "imports of a later layer:\n{}", upward.join("\n"));
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(cycle(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(
        cycle(&graph(&[("a", "b"), ("b", "c"), ("c", "a")])),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(first_segment("server::REQUEST_ID"), Some("server".into()));
    assert_eq!(first_segment("AppState"), None);
}

#[test]
fn unit_tests_are_left_out() {
    let text = "use crate::a;\n#[cfg(test)]\nmod tests {\n    use crate::b;\n    fn f() { g(); }\n}\nuse crate::c;\n\
                #[cfg(test)]\nmod more;\nuse crate::d;\n";
    assert_eq!(
        library_lines(text),
        vec!["use crate::a;", "use crate::c;", "use crate::d;"]
    );
    assert_eq!(test_modules(text), vec![("more".to_string(), None)]);
    let beside = "#[cfg(test)]\n#[path = \"foo_tests.rs\"]\nmod tests;\n";
    assert_eq!(
        test_modules(beside),
        vec![("tests".to_string(), Some("foo_tests.rs".to_string()))]
    );
    // The layering of a crate whose folder module keeps its tests in files of their own (beside their modules too:
    // `policy/peers/dynamo_kv_tests.rs` dispatches tickets).
    let core = imports(&Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/core/src"));
    assert!(!core["policy"].contains("ticket"), "{core:?}");
}

/// Every `.rs` file of the workspace: the binary's sources and tests, and each crate's.
fn workspace_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "tests", "crates"] {
        sources(&root.join(dir), &mut files);
    }
    files
}

/// `unsafe_code` is denied for the whole workspace and allowed in two places only: the allocator's option in
/// `src/alloc.rs`, and the Python module's in-place reading of a list of ints (`crates/python/src/small_ints.rs`).
/// A lint level named anywhere else (`allow` or `expect`, inner or outer) fails here.
#[test]
fn unsafe_code_is_allowed_in_two_places() {
    let files = workspace_sources();
    assert!(files.len() > 100, "the sources were not read: {}", files.len());
    let this = Path::new(file!()).file_name().unwrap();
    let mut allowed = Vec::new();
    for path in files.iter().filter(|p| p.file_name() != Some(this)) {
        let text = std::fs::read_to_string(path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            if code.contains("unsafe_code") {
                allowed.push(format!("{}:{}", path.display(), n + 1));
            }
        }
    }
    allowed.sort();
    assert_eq!(allowed.len(), 2, "unsafe code allowed at {allowed:?}");
    assert!(allowed[0].contains("crates/python/src/small_ints.rs"), "{allowed:?}");
    assert!(allowed[1].contains("src/alloc.rs"), "{allowed:?}");
}
