//! The crate's imports run one way: the public face above the operations
//! written once, those above the engine boundary, the engines below it,
//! then the definitions every engine shares, and the pure core at the
//! bottom (src/lib.rs lists the layers). This test reads every source file
//! and fails on an import that points up, on an engine that imports
//! another engine, and on a module it does not know (so that a new module
//! is placed in a layer on purpose).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each top-level module of the crate and its layer (higher = nearer the
/// public face).
const LAYERS: &[(&str, u8)] = &[
    // The public face.
    ("lib", 6),
    ("store", 6),
    ("check", 6),
    ("compact", 6),
    ("salvage", 6),
    ("renewal", 6),
    ("extender", 6),
    ("agent", 6),
    ("mcp", 6),
    ("http", 6),
    ("fuzzing", 6),
    ("conformance", 6),
    ("postgres", 6),
    // Operations written once over any engine.
    ("backup", 5),
    ("scan", 5),
    ("sweeper", 5),
    ("orphans", 5),
    // The engine boundary.
    ("engine", 4),
    // The engines.
    ("embedded", 3),
    ("pg", 3),
    // Definitions every engine shares (no I/O).
    ("config", 2),
    ("codec", 2),
    ("audit", 2),
    ("stats", 2),
    ("metrics", 2),
    ("report", 2),
    // The pure core.
    ("key", 1),
    ("record", 1),
    ("clock", 1),
    ("error", 1),
];

const ENGINES: &[&str] = &["embedded", "pg"];

fn layer(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

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

/// The top-level module a source file belongs to.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str();
    first.to_str().unwrap().trim_end_matches(".rs").to_string()
}

/// The crate modules a file's code names as `crate::<module>`, outside
/// comments and outside its `#[cfg(test)]` unit tests (tests may reach
/// anywhere).
fn imports(text: &str) -> Vec<String> {
    let code = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    let mut found = Vec::new();
    for line in code.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
                found.push(name);
            }
        }
    }
    found
}

#[test]
fn imports_run_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut problems: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let Some(own) = layer(&module) else {
            problems
                .entry(file.display().to_string())
                .or_default()
                .push(format!("module `{module}` has no layer in this test"));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for target in imports(&text) {
            if target == module {
                continue;
            }
            let Some(theirs) = layer(&target) else {
                // A re-export named at the crate root (`crate::Store`) is
                // the public face.
                problems
                    .entry(file.display().to_string())
                    .or_default()
                    .push(format!(
                        "names `crate::{target}`, not a module with a layer"
                    ));
                continue;
            };
            if theirs > own {
                problems
                    .entry(file.display().to_string())
                    .or_default()
                    .push(format!(
                        "`{module}` (layer {own}) imports `{target}` (layer {theirs})"
                    ));
            }
            if ENGINES.contains(&module.as_str()) && ENGINES.contains(&target.as_str()) {
                problems
                    .entry(file.display().to_string())
                    .or_default()
                    .push(format!("engine `{module}` imports engine `{target}`"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "imports that do not run one way:\n{problems:#?}"
    );
}

#[test]
fn the_check_sees_an_upward_import() {
    let text = "use crate::store::Store;\n// use crate::engine;\n#[cfg(test)]\nmod tests { use crate::http; }\n";
    assert_eq!(imports(text), vec!["store".to_string()]);
}
