//! Fuzz target `keys`; the body is in `fuzz/bodies/keys.rs`, shared with
//! `tests/fuzz_corpus.rs`.
#![no_main]

#[path = "../bodies/keys.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::keys(data));
