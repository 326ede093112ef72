//! Fuzz body `keys`: arbitrary scope, id and fingerprint bytes through the
//! public API. `Key::new` and `Fingerprint::from_bytes` must accept exactly
//! what their docs allow; a valid key must round-trip, claim, refuse another
//! fingerprint, stay apart from a key that only moves the scope/id
//! boundary, and release, on a store shared by every input (in memory).
//!
//! Input: `[scope length][id length][fingerprint length][bytes...]`; the
//! lengths are taken modulo what is left.
//!
//! Included by `fuzz/fuzz_targets/keys.rs` and `tests/fuzz_corpus.rs`.

use std::sync::OnceLock;

use idemstore::{
    ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, Key, MAX_FINGERPRINT_LEN, MAX_ID_LEN,
    MAX_SCOPE_LEN, ManualClock, State, Store,
};
use redb::backends::InMemoryBackend;

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| {
        let config = Config::new()
            .sweep_interval(None)
            .clock(ManualClock::new(1_700_000_000_000));
        Store::open_with_backend(
            "fuzz-keys",
            InMemoryBackend::new(),
            idemstore::MemoryLog::new(),
            config,
        )
        .expect("open the in-memory store")
    })
}

/// The rule the docs state, written independently of `Key::new`.
fn valid_part(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && !s.chars().any(char::is_control)
}

fn split<'a>(data: &mut &'a [u8], len: u8) -> &'a [u8] {
    let (head, tail) = data.split_at(usize::from(len).min(data.len()));
    *data = tail;
    head
}

pub fn keys(data: &[u8]) {
    let [scope_len, id_len, fp_len, rest @ ..] = data else {
        return;
    };
    let mut rest = rest;
    let scope = String::from_utf8_lossy(split(&mut rest, *scope_len)).into_owned();
    let id = String::from_utf8_lossy(split(&mut rest, *id_len)).into_owned();
    let fp_bytes = split(&mut rest, *fp_len).to_vec();

    let key = Key::new(scope.clone(), id.clone());
    let expect_valid = valid_part(&scope, MAX_SCOPE_LEN) && valid_part(&id, MAX_ID_LEN);
    match &key {
        Ok(k) => {
            assert!(expect_valid, "accepted an invalid key {scope:?} / {id:?}");
            assert_eq!((k.scope(), k.id()), (scope.as_str(), id.as_str()));
        }
        Err(Error::InvalidKey { .. }) => {
            assert!(!expect_valid, "refused a valid key {scope:?} / {id:?}");
        }
        Err(other) => panic!("Key::new answered {other:?}"),
    }
    let fingerprint = Fingerprint::from_bytes(fp_bytes.clone());
    let fp_valid = !fp_bytes.is_empty() && fp_bytes.len() <= MAX_FINGERPRINT_LEN;
    match &fingerprint {
        Ok(f) => {
            assert!(fp_valid, "accepted a {}-byte fingerprint", fp_bytes.len());
            assert_eq!(f.as_bytes(), &fp_bytes[..]);
        }
        Err(Error::InvalidArgument { .. }) => assert!(!fp_valid, "refused a valid fingerprint"),
        Err(other) => panic!("Fingerprint::from_bytes answered {other:?}"),
    }
    let (Ok(key), Ok(fingerprint)) = (key, fingerprint) else {
        return;
    };

    let store = store();
    let lease = match store.claim(&key, &fingerprint, &ClaimOptions::new()) {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("{key:?}: a claim on an empty store answered {other:?}"),
    };
    let record = store.get(&key).expect("get").expect("the claimed record");
    assert_eq!(record.key(), &key);
    assert_eq!(record.state(), State::Processing);
    assert_eq!(record.fingerprint(), &fingerprint);
    let other = Fingerprint::of(fingerprint.as_bytes());
    if other != fingerprint {
        assert!(
            matches!(
                store.claim(&key, &other, &ClaimOptions::new()),
                Err(Error::FingerprintMismatch { .. })
            ),
            "{key:?}: another fingerprint was not refused"
        );
    }
    // Moving the boundary between scope and id names another key.
    let mut chars = id.chars();
    if let Some(first) = chars.next() {
        let moved = Key::new(format!("{scope}{first}"), chars.as_str());
        if let Ok(moved) = moved {
            assert_eq!(
                store.get(&moved).expect("get"),
                None,
                "{moved:?} collides with {key:?}"
            );
        }
    }
    store.release(lease).expect("release the only lease");
    assert_eq!(store.get(&key).expect("get"), None);
}
