//! Fuzz target `transitions`; the body is in `fuzz/bodies/transitions.rs`, shared with
//! `tests/fuzz_corpus.rs`.
#![no_main]

#[path = "../bodies/transitions.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::transitions(data));
