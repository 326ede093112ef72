//! Fuzz target `pure`: the pure transition function against the reference
//! model; the body is in `fuzz/bodies/pure.rs`, shared with
//! `tests/fuzz_corpus.rs`.
#![no_main]

#[path = "../bodies/pure.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::pure(data));
