//! The layering of the gateway's modules (the crate documentation lists the layers), checked: the test reads
//! the crate's sources and fails on an import cycle, naming it.

mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    /// The crate's modules (files of `src/`) and, for each, the modules its code names by `crate::` paths
    /// (comments left out: a documentation link is no import).
    fn imports() -> BTreeMap<String, BTreeSet<String>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut graph = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let module = path.file_stem().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).unwrap();
            let mut names = BTreeSet::new();
            for line in text.lines() {
                let code = line.split("//").next().unwrap_or_default();
                for (at, _) in code.match_indices("crate::") {
                    let rest = &code[at + "crate::".len()..];
                    if let Some(group) = rest.strip_prefix('{') {
                        // `use crate::{a, b::c}`: the group's first segments (on this line).
                        let group = group.split('}').next().unwrap_or_default();
                        names.extend(group.split(',').filter_map(|item| first_segment(item.trim())));
                    } else {
                        names.extend(first_segment(rest));
                    }
                }
            }
            names.remove(&module);
            graph.insert(module, names);
        }
        let modules: BTreeSet<String> = graph.keys().cloned().collect();
        for names in graph.values_mut() {
            // Re-exports at the crate's root (`crate::AppState`) are not modules.
            names.retain(|n| modules.contains(n));
        }
        graph
    }

    fn first_segment(path: &str) -> Option<String> {
        let name: String = path.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        (!name.is_empty() && name.starts_with(|c: char| c.is_lowercase())).then_some(name)
    }

    /// A cycle of `graph`, as the modules along it, if there is one.
    fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
        // Depth-first, with the path being walked: an edge back into the path closes a cycle.
        fn visit(
            node: &str,
            graph: &BTreeMap<String, BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut BTreeSet<String>,
        ) -> Option<Vec<String>> {
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
    fn no_module_imports_one_that_imports_it_back() {
        let graph = imports();
        assert!(graph.len() > 10, "the sources were not found: {graph:?}");
        assert!(graph["server"].contains("state"), "imports are read: {graph:?}");
        if let Some(found) = cycle(&graph) {
            panic!("import cycle: {}", found.join(" -> "));
        }
    }

    #[test]
    fn the_cycle_finder_finds_cycles() {
        let graph = |edges: &[(&str, &str)]| {
            let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
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
}
