//! Fuzz body `import`: arbitrary bytes as an export stream, imported into a
//! fresh store on in-memory storage (redb's `InMemoryBackend` and a
//! `MemoryLog`) whose clock is fixed at 2026-01-01. Import must never
//! panic; it answers a summary, `CorruptExport` or `ImportRefused` (nothing
//! else), and whatever it answered, the store stays sound:
//! - its clock moved forward by at most the default tolerance (5 minutes);
//! - every stored record verifies, with a token below the counter, and the
//!   counter is at most `MAX_TOKEN`;
//! - a claim of a fresh key gets a token above every stored one, or
//!   `TokensExhausted` when the counter is at the cap (never a wrapped
//!   token);
//! - a summary's counts add up to the records read.
//!
//! Included by `fuzz/fuzz_targets/import.rs` and `tests/fuzz_corpus.rs`.

use std::time::Duration;

use idemstore::{
    ClaimOptions, ClaimOutcome, Config, DEFAULT_CLOCK_TOLERANCE, Error, Filter, Fingerprint, Key,
    MAX_TOKEN, ManualClock, MemoryLog, Store,
};
use redb::backends::InMemoryBackend;

/// The store's clock: 2026-01-01T00:00:00Z, in ms since the epoch.
pub const NOW_MS: u64 = 1_767_225_600_000;

pub fn import(data: &[u8]) {
    let clock = ManualClock::new(NOW_MS);
    let config = Config::new()
        .clock(clock.clone())
        .sweep_interval(None)
        .retention(Duration::from_secs(3600));
    let store = Store::open_with_backend(
        "fuzz-import.redb",
        InMemoryBackend::new(),
        MemoryLog::new(),
        config,
    )
    .expect("an in-memory store opens");
    match store.import(data, |_| {}) {
        Ok(s) => assert_eq!(
            s.records,
            s.imported + s.present + s.expired + s.business_key_taken,
            "summary counts do not add up: {s:?}"
        ),
        Err(Error::CorruptExport { .. } | Error::ImportRefused { .. }) => {}
        Err(other) => panic!("import answered {other:?}"),
    }
    let tolerance = DEFAULT_CLOCK_TOLERANCE.as_millis() as u64;
    assert!(
        store.now_ms() <= NOW_MS + tolerance,
        "the import moved the clock to {}",
        store.now_ms()
    );
    let report = store.verify(|_| {}).expect("verify runs");
    assert!(report.is_clean(), "{report:?}");
    let highest = store
        .scan(&Filter::new())
        .expect("scan runs")
        .map(|r| r.expect("a stored record decodes").token())
        .max();
    let fresh = Key::new("fuzz/import", "fresh-key-after-import").expect("valid key");
    match store.claim(&fresh, &Fingerprint::of(b"fresh"), &ClaimOptions::new()) {
        Ok(ClaimOutcome::Acquired(lease)) => {
            assert!(
                lease.token() < MAX_TOKEN,
                "token {} at the cap",
                lease.token()
            );
            if let Some(highest) = highest {
                assert!(lease.token() > highest, "token {} reused", lease.token());
            }
        }
        // Only a stream that put the fresh key there itself could answer
        // otherwise; the fresh key's scope is not one a seed uses.
        Ok(other) => assert!(
            matches!(
                other,
                ClaimOutcome::InProgress { .. } | ClaimOutcome::Replay(_)
            ),
            "{other:?}"
        ),
        Err(Error::TokensExhausted { next_token }) => assert_eq!(next_token, MAX_TOKEN),
        Err(Error::FingerprintMismatch { .. }) => {}
        Err(other) => panic!("a claim after the import answered {other:?}"),
    }
}
