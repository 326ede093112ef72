//! Replays every checked-in fuzz corpus file (`fuzz/corpus/<target>/`)
//! through the same functions the fuzz targets call (`fuzz/bodies/`), so
//! that CI guards them on a stable toolchain without libFuzzer. The
//! `decode` replay needs the `fuzzing` feature (CI builds with
//! `--all-features`).

// Each fuzz body includes the shared operation decoder (`fuzz/bodies/ops.rs`)
// itself, so that each fuzz target builds alone; here two bodies meet.
#![allow(clippy::duplicate_mod)]

#[path = "../fuzz/bodies/import.rs"]
mod import;
#[path = "../fuzz/bodies/keys.rs"]
mod keys;
#[path = "../fuzz/bodies/transitions.rs"]
mod transitions;

#[cfg(feature = "fuzzing")]
#[path = "../fuzz/bodies/decode.rs"]
mod decode;
#[cfg(feature = "fuzzing")]
#[path = "../fuzz/bodies/pure.rs"]
mod pure;

use std::path::PathBuf;

/// Runs `body` on every file of `fuzz/corpus/<target>/`, naming the file
/// that fails.
fn replay(target: &str, body: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no corpus files", dir.display());
    for file in files {
        let data = std::fs::read(&file).expect("read a corpus file");
        let name = file.display().to_string();
        if let Err(panic) = std::panic::catch_unwind(|| body(&data)) {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default();
            panic!("{name}: {msg}");
        }
    }
}

#[test]
fn transitions_corpus() {
    replay("transitions", transitions::transitions);
}

#[test]
fn keys_corpus() {
    replay("keys", keys::keys);
}

#[test]
fn import_corpus() {
    replay("import", import::import);
}

#[cfg(feature = "fuzzing")]
#[test]
fn pure_corpus() {
    replay("pure", pure::pure);
}

#[cfg(feature = "fuzzing")]
#[test]
fn decode_corpus() {
    replay("decode", decode::decode);
}
