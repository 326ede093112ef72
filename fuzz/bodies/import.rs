//! Fuzz body `import`: arbitrary bytes as an export stream, imported into a
//! store on in-memory storage (redb's `InMemoryBackend` and a `MemoryLog`)
//! whose clock starts at 2026-01-01. Import must never panic; it answers a
//! summary, `CorruptExport` or `ImportRefused` (nothing else), and whatever
//! it answered, the store stays sound:
//! - its clock moved forward by at most the default tolerance (5 minutes)
//!   past its time before the import;
//! - every stored record verifies, with a token below the counter, and the
//!   counter is at most `MAX_TOKEN`;
//! - a claim of a fresh key gets a token above every stored one, or
//!   `TokensExhausted` when the counter is at the cap (never a wrapped
//!   token);
//! - a summary's counts add up to the records read.
//!
//! The inputs of a thread share one store while they leave it as they
//! found it (most inputs are refused before a batch is written): a store
//! that an input changed (a summary, records or time added, the token
//! counter raised, the fresh key taken or the counter at the cap) is
//! replaced by a new one for the next input. So every input starts on an
//! empty store at 2026-01-01 whose counter only the fresh claims of the
//! earlier inputs on it advanced, one each. Opening a store per input cost
//! most of a run.
//!
//! Included by `fuzz/fuzz_targets/import.rs` and `tests/fuzz_corpus.rs`.

use std::cell::RefCell;
use std::time::Duration;

use idemstore::{
    ClaimOptions, ClaimOutcome, Config, DEFAULT_CLOCK_TOLERANCE, Error, Filter, Fingerprint, Key,
    MAX_TOKEN, ManualClock, MemoryLog, Store,
};
use redb::backends::InMemoryBackend;

/// The store's clock: 2026-01-01T00:00:00Z, in ms since the epoch.
pub const NOW_MS: u64 = 1_767_225_600_000;

thread_local! {
    /// The store the inputs of this thread share, and the token of the
    /// last fresh claim on it (0: none yet); `None` after an input changed
    /// it (or panicked), and the next input opens a new one.
    static SHARED: RefCell<Option<(Store, u64)>> = const { RefCell::new(None) };
}

fn open() -> Store {
    let config = Config::new()
        .clock(ManualClock::new(NOW_MS))
        .sweep_interval(None)
        .retention(Duration::from_secs(3600));
    Store::open_with_backend(
        "fuzz-import.redb",
        InMemoryBackend::new(),
        MemoryLog::new(),
        config,
    )
    .expect("an in-memory store opens")
}

pub fn import(data: &[u8]) {
    let (store, last_token) = SHARED
        .with(|s| s.borrow_mut().take())
        .unwrap_or_else(|| (open(), 0));
    let before_ms = store.now_ms();
    let before_len = store.len().expect("len");
    let answered_summary = match store.import(data, |_| {}) {
        Ok(s) => {
            assert_eq!(
                s.records,
                s.imported + s.present + s.expired + s.business_key_taken,
                "summary counts do not add up: {s:?}"
            );
            true
        }
        Err(Error::CorruptExport { .. } | Error::ImportRefused { .. }) => false,
        Err(other) => panic!("import answered {other:?}"),
    };
    let tolerance = DEFAULT_CLOCK_TOLERANCE.as_millis() as u64;
    let after_ms = store.now_ms();
    assert!(
        after_ms >= before_ms && after_ms <= before_ms + tolerance,
        "the import moved the clock from {before_ms} to {after_ms}"
    );
    let report = store.verify(|_| {}).expect("verify runs");
    assert!(report.is_clean(), "{report:?}");
    let highest = store
        .scan(&Filter::new())
        .expect("scan runs")
        .map(|r| r.expect("a stored record decodes").token())
        .max();
    let fresh = Key::new("fuzz/import", "fresh-key-after-import").expect("valid key");
    // The token of the fresh claim when it acquired and released the key.
    let fresh_token = match store.claim(&fresh, &Fingerprint::of(b"fresh"), &ClaimOptions::new()) {
        Ok(ClaimOutcome::Acquired(lease)) => {
            assert!(
                lease.token() < MAX_TOKEN,
                "token {} at the cap",
                lease.token()
            );
            if let Some(highest) = highest {
                assert!(lease.token() > highest, "token {} reused", lease.token());
            }
            // A new key's release removes its record.
            let token = lease.token();
            store.release(lease).expect("release the fresh key");
            Some(token)
        }
        // Only a stream that put the fresh key there itself could answer
        // otherwise; the fresh key's scope is not one a seed uses.
        Ok(other) => {
            assert!(
                matches!(
                    other,
                    ClaimOutcome::InProgress { .. } | ClaimOutcome::Replay(_)
                ),
                "{other:?}"
            );
            None
        }
        Err(Error::TokensExhausted { next_token }) => {
            assert_eq!(next_token, MAX_TOKEN);
            None
        }
        Err(Error::FingerprintMismatch { .. }) => None,
        Err(other) => panic!("a claim after the import answered {other:?}"),
    };
    // The counter is unchanged when the fresh claim took the token after
    // the last one (a new store's counter starts at 1).
    let unchanged = !answered_summary
        && fresh_token == Some(last_token + 1)
        && after_ms == before_ms
        && store.len().expect("len") == before_len;
    if let (true, Some(token)) = (unchanged, fresh_token) {
        SHARED.with(|s| *s.borrow_mut() = Some((store, token)));
    }
}
