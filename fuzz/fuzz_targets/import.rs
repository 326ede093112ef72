//! Fuzz target `import`; the body is in `fuzz/bodies/import.rs`, shared with
//! `tests/fuzz_corpus.rs`.
#![no_main]

#[path = "../bodies/import.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::import(data));
