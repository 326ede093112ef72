//! Fuzz target `decode`; the body is in `fuzz/bodies/decode.rs`, shared with
//! `tests/fuzz_corpus.rs`.
#![no_main]

#[path = "../bodies/decode.rs"]
mod body;

libfuzzer_sys::fuzz_target!(|data: &[u8]| body::decode(data));
