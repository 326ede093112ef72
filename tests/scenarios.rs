//! The acceptance scenarios of `/work/shared/scenarios.md` (DESIGN.md), one
//! test each, driving only the public API. Time moves by a `ManualClock` at
//! a real epoch time; a crash is a real one (a child process holding the
//! store is killed with SIGKILL).
//!
//! Scenarios 4 and 12 (crash at every storage failure point) belong to the
//! fault-injection tests; scenario 7 (canonical JSON fingerprints) to the
//! fingerprint helpers.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Barrier, Mutex};

use common::*;
use idemstore::{ClaimOutcome, Error, Key, Lease, ManualClock, State, Store};

// ---------------------------------------------------------------------------
// 1. Crash while processing
// ---------------------------------------------------------------------------

/// `claim(k, fpA, 30 s)` → Acquired(t1); crash; reopen. At +29 s a claim is
/// InProgress; at +31 s it acquires t2 > t1; completing with a lease rebuilt
/// from t1 is StaleLease and the record still belongs to t2.
#[test]
fn scenario_01_crash_while_processing() {
    const NAME: &str = "scenario_01_crash_while_processing";
    if child_role(NAME) {
        let path = child_var("IDEM_PATH");
        let clock = ManualClock::new(child_var_parsed("IDEM_CLOCK_MS"));
        let store = Store::open_with(&path, idemstore::Config::new().clock(clock)).unwrap();
        let lease = acquired(
            store
                .claim(&key("k"), &fp("A"), &lease_of(secs(30)))
                .unwrap(),
        );
        report("TOKEN", lease.token());
        let _held = store;
        ready_and_wait();
    }

    let t = TestDir::new();
    let t0 = t.now_ms();
    let mut child = spawn_child(
        NAME,
        &[
            ("IDEM_PATH", path_var(&t.path)),
            ("IDEM_CLOCK_MS", t0.to_string()),
        ],
    );
    let reports = child.wait_ready();
    let t1: u64 = reports["TOKEN"].parse().unwrap();
    child.kill();

    let store = t.open();
    let rec = store
        .get(&key("k"))
        .unwrap()
        .expect("the acknowledged claim survived the crash");
    assert_eq!(rec.state(), State::Processing);
    assert_eq!(rec.token(), t1);
    assert_eq!(rec.lease_until_ms(), t0 + 30_000);

    t.clock.advance(secs(29));
    match store
        .claim(&key("k"), &fp("A"), &lease_of(secs(30)))
        .unwrap()
    {
        ClaimOutcome::InProgress {
            retry_after,
            lease_until_ms,
        } => {
            assert_eq!(lease_until_ms, t0 + 30_000);
            assert_eq!(retry_after, secs(1));
        }
        other => panic!("at +29 s: {other:?}"),
    }

    t.clock.advance(secs(2));
    let lease2 = acquired(
        store
            .claim(&key("k"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    let t2 = lease2.token();
    assert!(t2 > t1, "t2 {t2} must exceed t1 {t1}");
    assert!(lease2.is_takeover());

    let stale = Lease::from_parts(key("k"), t1);
    match store.complete(&stale, b"late result") {
        Err(Error::StaleLease { token, .. }) => assert_eq!(token, t1),
        other => panic!("complete with t1: {other:?}"),
    }
    let rec = store.get(&key("k")).unwrap().unwrap();
    assert_eq!(rec.state(), State::Processing);
    assert_eq!(rec.token(), t2);
    assert_eq!(rec.result(), None);
    assert_eq!(rec.acquisitions(), 2);
}

// ---------------------------------------------------------------------------
// 2. A zero lease
// ---------------------------------------------------------------------------

/// A claim with a zero lease is a typed error and creates nothing; a store
/// configured with a zero default lease does not open.
#[test]
fn scenario_02_zero_lease() {
    let t = TestDir::new();
    let store = t.open();
    let err = store
        .claim(&key("k"), &fp("A"), &lease_of(ms(0)))
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { what: "lease", .. }),
        "{err:?}"
    );
    assert_eq!(store.get(&key("k")).unwrap(), None);
    assert_eq!(store.len().unwrap(), 0);
    // Less than a millisecond is zero whole milliseconds: also refused.
    assert!(matches!(
        store.claim(
            &key("k"),
            &fp("A"),
            &lease_of(std::time::Duration::from_micros(999))
        ),
        Err(Error::InvalidArgument { what: "lease", .. })
    ));
    assert_eq!(store.len().unwrap(), 0);

    // The next claim acquires with the default lease: nothing was left behind.
    let lease = acquired(
        store
            .claim(&key("k"), &fp("A"), &idemstore::ClaimOptions::new())
            .unwrap(),
    );
    assert_eq!(lease.lease_until_ms(), Some(t.now_ms() + 30_000));
    drop(store);

    let other = TestDir::new();
    let err = Store::open_with(&other.path, other.config().lease(ms(0))).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { what: "lease", .. }),
        "{err:?}"
    );
    assert!(!other.path.exists(), "a refused open created the file");
}

// ---------------------------------------------------------------------------
// 3. Units at a real epoch
// ---------------------------------------------------------------------------

fn assert_in_progress(store: &Store, k: &Key, expect_retry_ms: u64) {
    match store.claim(k, &fp("A"), &lease_of(secs(30))).unwrap() {
        ClaimOutcome::InProgress { retry_after, .. } => {
            assert_eq!(retry_after, ms(expect_retry_ms));
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
}

/// With the clock at the current time, a 30 s lease is in progress at
/// +29.999 s and acquirable at +30.001 s, before and after a reopen.
#[test]
fn scenario_03_units_at_a_real_epoch() {
    let t = TestDir::new();
    let t0 = t.now_ms();
    assert!(t0 > 1_600_000_000_000, "the clock reads a real epoch time");

    let store = t.open();
    let live = acquired(
        store
            .claim(&key("live"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert_eq!(live.lease_until_ms(), Some(t0 + 30_000));
    t.clock.advance(ms(29_999));
    assert_in_progress(&store, &key("live"), 1);
    t.clock.advance(ms(2));
    let again = acquired(
        store
            .claim(&key("live"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert!(again.token() > live.token());

    // The same, across a reopen: claim, shut down, reopen, then move time.
    let t1 = t.now_ms();
    let before = acquired(
        store
            .claim(&key("reopened"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    drop(store);
    let store = t.open();
    let rec = store.get(&key("reopened")).unwrap().unwrap();
    assert_eq!(rec.lease_until_ms(), t1 + 30_000);
    t.clock.advance(ms(29_999));
    assert_in_progress(&store, &key("reopened"), 1);
    t.clock.advance(ms(2));
    let after = acquired(
        store
            .claim(&key("reopened"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert!(after.token() > before.token());
    assert_eq!(after.lease_until_ms(), Some(t1 + 30_001 + 30_000));
}

// ---------------------------------------------------------------------------
// 5. The token names the record
// ---------------------------------------------------------------------------

/// A lease rebuilt from k2 and k's token is stale for k2; both records keep
/// their own tokens.
#[test]
fn scenario_05_token_names_the_record() {
    let t = TestDir::new();
    let store = t.open();
    let k = key("k");
    let k2 = key("k2");
    let lk = acquired(store.claim(&k, &fp("A"), &lease_of(secs(30))).unwrap());
    let lk2 = acquired(store.claim(&k2, &fp("A"), &lease_of(secs(30))).unwrap());
    assert_ne!(lk.token(), lk2.token());

    let forged = Lease::from_parts(k2.clone(), lk.token());
    match store.complete(&forged, b"wrong record") {
        Err(Error::StaleLease { key, token }) => {
            assert_eq!(key, k2.to_string());
            assert_eq!(token, lk.token());
        }
        other => panic!("{other:?}"),
    }
    let rk = store.get(&k).unwrap().unwrap();
    let rk2 = store.get(&k2).unwrap().unwrap();
    assert_eq!((rk.state(), rk.token()), (State::Processing, lk.token()));
    assert_eq!((rk2.state(), rk2.token()), (State::Processing, lk2.token()));
    assert_eq!(rk2.result(), None);
}

// ---------------------------------------------------------------------------
// 6. Many claimers, one winner
// ---------------------------------------------------------------------------

const CLAIMERS: usize = 64;
const CONTENDED_KEYS: usize = 1_000;
/// Per key: the (thread, token) of every claim that acquired it.
type Winners = Vec<Vec<(usize, u64)>>;

/// 64 threads claim the same fresh key at once, over 1,000 keys: exactly one
/// Acquired per key, every other claim InProgress or a Replay of the
/// winner's result, no error.
#[test]
fn scenario_06_many_claimers_one_winner() {
    let t = TestDir::new();
    let store = Arc::new(t.open());
    let barrier = Arc::new(Barrier::new(CLAIMERS));
    // Per key: the winners' tokens and results, and the other outcomes.
    let winners: Arc<Mutex<Winners>> = Arc::new(Mutex::new(vec![Vec::new(); CONTENDED_KEYS]));

    let handles: Vec<_> = (0..CLAIMERS)
        .map(|thread| {
            let store = store.clone();
            let barrier = barrier.clone();
            let winners = winners.clone();
            std::thread::spawn(move || {
                let mut seen = (0usize, 0usize); // (in progress, replay)
                for i in 0..CONTENDED_KEYS {
                    let k = key(&format!("contended-{i}"));
                    barrier.wait();
                    match store.claim(&k, &fp("same payload"), &lease_of(secs(30))) {
                        Ok(ClaimOutcome::Acquired(lease)) => {
                            winners.lock().unwrap()[i].push((thread, lease.token()));
                            store
                                .complete(&lease, format!("winner-{thread}").as_bytes())
                                .unwrap();
                        }
                        Ok(ClaimOutcome::InProgress { retry_after, .. }) => {
                            assert!(retry_after > ms(0) && retry_after <= secs(30));
                            seen.0 += 1;
                        }
                        Ok(ClaimOutcome::Replay(rec)) => {
                            assert_eq!(rec.state(), State::Succeeded);
                            assert!(rec.result().unwrap().starts_with(b"winner-"));
                            seen.1 += 1;
                        }
                        Err(err) => panic!("thread {thread}, key {i}: {err}"),
                    }
                }
                seen
            })
        })
        .collect();
    let mut others = 0;
    for h in handles {
        let (in_progress, replay) = h.join().expect("claimer thread");
        others += in_progress + replay;
    }
    assert_eq!(others, CONTENDED_KEYS * (CLAIMERS - 1));

    let winners = winners.lock().unwrap();
    let mut tokens = HashSet::new();
    for (i, w) in winners.iter().enumerate() {
        assert_eq!(w.len(), 1, "key {i} had winners {w:?}");
        let (thread, token) = w[0];
        assert!(tokens.insert(token), "token {token} given twice");
        let rec = store.get(&key(&format!("contended-{i}"))).unwrap().unwrap();
        assert_eq!(rec.state(), State::Succeeded);
        assert_eq!(rec.token(), token);
        assert_eq!(rec.acquisitions(), 1);
        assert_eq!(rec.result(), Some(format!("winner-{thread}").as_bytes()));
    }
    assert_eq!(store.len().unwrap(), CONTENDED_KEYS as u64);
}

// ---------------------------------------------------------------------------
// 8. The fingerprint survives
// ---------------------------------------------------------------------------

/// `claim(k, fpA)`, complete, reopen: `claim(k, fpA)` replays and
/// `claim(k, fpB)` is a FingerprintMismatch.
#[test]
fn scenario_08_fingerprint_survives() {
    let t = TestDir::new();
    let store = t.open();
    let lease = acquired(
        store
            .claim(&key("k"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    store.complete(&lease, b"result A").unwrap();
    drop(store);

    let store = t.open();
    match store
        .claim(&key("k"), &fp("A"), &lease_of(secs(30)))
        .unwrap()
    {
        ClaimOutcome::Replay(rec) => {
            assert_eq!(rec.result(), Some(&b"result A"[..]));
            assert_eq!(rec.fingerprint(), &fp("A"));
            assert_eq!(rec.token(), lease.token());
        }
        other => panic!("{other:?}"),
    }
    match store.claim(&key("k"), &fp("B"), &lease_of(secs(30))) {
        Err(Error::FingerprintMismatch { key: k }) => assert_eq!(k, key("k").to_string()),
        other => panic!("{other:?}"),
    }
    // The mismatch changed nothing.
    assert_eq!(
        store.get(&key("k")).unwrap().unwrap().result(),
        Some(&b"result A"[..])
    );
}

// ---------------------------------------------------------------------------
// 9. A missing key
// ---------------------------------------------------------------------------

/// An empty id or scope, an id over 255 bytes or a scope over 128 bytes is
/// InvalidKey, so no claim can be made with it and nothing is written.
#[test]
fn scenario_09_missing_key() {
    let t = TestDir::new();
    let store = t.open();
    let cases = [
        ("empty id", SCOPE.to_string(), String::new()),
        ("empty scope", String::new(), "id".to_string()),
        ("id of 256 bytes", SCOPE.to_string(), "i".repeat(256)),
        (
            "id of 256 bytes in 128 chars",
            SCOPE.to_string(),
            "é".repeat(128),
        ),
        ("scope of 129 bytes", "s".repeat(129), "id".to_string()),
    ];
    for (what, scope, id) in cases {
        match Key::new(scope, id) {
            Err(Error::InvalidKey { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(store.len().unwrap(), 0);
    // The limits themselves are accepted.
    let longest = Key::new("s".repeat(128), "i".repeat(255)).unwrap();
    acquired(
        store
            .claim(&longest, &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert_eq!(store.len().unwrap(), 1);
}

// ---------------------------------------------------------------------------
// 10. One retention rule
// ---------------------------------------------------------------------------

/// Retention 60 s; claim at t0, complete at +59 s. At +118 s the record
/// replays; at +120 s it is absent and a claim acquires, whether or not
/// eviction has run.
#[test]
fn scenario_10_one_retention_rule() {
    let t = TestDir::new();
    let store = t.open_with(t.config().retention(secs(60)));
    let t0 = t.now_ms();
    let swept = key("swept");
    let unswept = key("unswept");
    let mut tokens = Vec::new();
    for k in [&swept, &unswept] {
        tokens.push(acquired(
            store.claim(k, &fp("A"), &lease_of(secs(30))).unwrap(),
        ));
    }
    t.clock.advance(secs(59));
    for lease in &tokens {
        let rec = store.complete(lease, b"done").unwrap();
        assert_eq!(rec.expires_ms(), t0 + 59_000 + 60_000);
    }

    t.clock.advance(secs(59)); // +118 s
    for k in [&swept, &unswept] {
        match store.claim(k, &fp("A"), &lease_of(secs(30))).unwrap() {
            ClaimOutcome::Replay(rec) => assert_eq!(rec.result(), Some(&b"done"[..])),
            other => panic!("{k:?} at +118 s: {other:?}"),
        }
    }
    // The edge: retention ends at +119 s exactly.
    t.clock.advance(ms(999));
    assert!(
        store.get(&swept).unwrap().is_some(),
        "present at +118.999 s"
    );
    t.clock.advance(ms(1));
    assert_eq!(store.get(&swept).unwrap(), None, "absent at +119 s");

    t.clock.advance(secs(1)); // +120 s
    // Not evicted: absent all the same.
    assert_eq!(store.len().unwrap(), 2, "nothing was evicted yet");
    assert_eq!(store.get(&unswept).unwrap(), None);
    let again = acquired(
        store
            .claim(&unswept, &fp("B"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert!(again.token() > tokens[1].token());
    assert_eq!(again.record().unwrap().acquisitions(), 1, "a new record");

    // Evicted: the same answers.
    assert_eq!(store.sweep(100).unwrap(), 1);
    assert_eq!(store.len().unwrap(), 1);
    assert_eq!(store.get(&swept).unwrap(), None);
    let again = acquired(store.claim(&swept, &fp("B"), &lease_of(secs(30))).unwrap());
    assert!(again.token() > tokens[0].token());
}

// ---------------------------------------------------------------------------
// 11. Failing late
// ---------------------------------------------------------------------------

/// Lease 10 s, retention R. At +15 s (nobody took the key over) the holder
/// fails permanently; the failure replays until +15 s + R and is gone after.
#[test]
fn scenario_11_failing_late() {
    const R_MS: u64 = 90_000;
    let t = TestDir::new();
    let store = t.open_with(t.config().retention(ms(R_MS)));
    let lease = acquired(
        store
            .claim(&key("k"), &fp("A"), &lease_of(secs(10)))
            .unwrap(),
    );

    t.clock.advance(secs(15));
    let t_fail = t.now_ms();
    let rec = store.fail(&lease, b"card declined", false).unwrap();
    assert_eq!(rec.state(), State::Failed { retryable: false });
    assert_eq!(rec.expires_ms(), t_fail + R_MS);

    t.clock.advance(ms(R_MS - 1));
    match store
        .claim(&key("k"), &fp("A"), &lease_of(secs(10)))
        .unwrap()
    {
        ClaimOutcome::Replay(rec) => {
            assert_eq!(rec.state(), State::Failed { retryable: false });
            assert_eq!(rec.failure(), Some(&b"card declined"[..]));
            assert_eq!(rec.result(), None);
        }
        other => panic!("at +15 s + R - 1 ms: {other:?}"),
    }

    t.clock.advance(ms(2));
    assert_eq!(store.get(&key("k")).unwrap(), None);
    let again = acquired(
        store
            .claim(&key("k"), &fp("A"), &lease_of(secs(10)))
            .unwrap(),
    );
    assert!(again.token() > lease.token());
    assert!(
        !again.is_takeover(),
        "the old record is gone, not taken over"
    );
}

// ---------------------------------------------------------------------------
// 13. Retryable versus permanent failure
// ---------------------------------------------------------------------------

/// A retryable failure lets the next claim acquire (new token, the failure
/// visible); a permanent one replays until retention ends.
#[test]
fn scenario_13_retryable_versus_permanent_failure() {
    const R_MS: u64 = 60_000;
    let t = TestDir::new();
    let store = t.open_with(t.config().retention(ms(R_MS)));

    let first = acquired(
        store
            .claim(&key("retry"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    store.fail(&first, b"timeout upstream", true).unwrap();
    let second = acquired(
        store
            .claim(&key("retry"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert!(second.token() > first.token());
    assert!(second.is_takeover());
    let rec = second.record().unwrap();
    assert_eq!(rec.acquisitions(), 2);
    assert_eq!(rec.failure(), Some(&b"timeout upstream"[..]));
    // The old lease is dead.
    assert!(matches!(
        store.complete(&first, b"x"),
        Err(Error::StaleLease { .. })
    ));
    store.complete(&second, b"ok").unwrap();

    let perm = acquired(
        store
            .claim(&key("perm"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    store.fail(&perm, b"invalid card", false).unwrap();
    for step in [0, 1_000, R_MS - 1_001] {
        t.clock.advance(ms(step));
        match store
            .claim(&key("perm"), &fp("A"), &lease_of(secs(30)))
            .unwrap()
        {
            ClaimOutcome::Replay(rec) => {
                assert_eq!(rec.failure(), Some(&b"invalid card"[..]));
                assert_eq!(rec.token(), perm.token());
            }
            other => panic!("permanent failure after {step} ms: {other:?}"),
        }
    }
    t.clock.advance(ms(1)); // retention ends
    let after = acquired(
        store
            .claim(&key("perm"), &fp("A"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert!(after.token() > perm.token());
}

// ---------------------------------------------------------------------------
// 14. Scopes isolate
// ---------------------------------------------------------------------------

/// The same id under (tenant A, create), (tenant B, create) and (tenant A,
/// refund) gives three separate records.
#[test]
fn scenario_14_scopes_isolate() {
    let t = TestDir::new();
    let store = t.open();
    let keys = [
        key_in("tenant-a/create", "req-1"),
        key_in("tenant-b/create", "req-1"),
        key_in("tenant-a/refund", "req-1"),
    ];
    // Different payloads too: a record in one scope binds nothing in another.
    let leases: Vec<Lease> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            acquired(
                store
                    .claim(k, &fp(&format!("payload {i}")), &lease_of(secs(30)))
                    .unwrap(),
            )
        })
        .collect();
    let tokens: HashSet<u64> = leases.iter().map(Lease::token).collect();
    assert_eq!(tokens.len(), 3);
    assert_eq!(store.len().unwrap(), 3);

    store.complete(&leases[0], b"a-create").unwrap();
    store.fail(&leases[2], b"a-refund", false).unwrap();
    let got: Vec<_> = keys
        .iter()
        .map(|k| store.get(k).unwrap().unwrap())
        .collect();
    assert_eq!(got[0].result(), Some(&b"a-create"[..]));
    assert_eq!(got[1].state(), State::Processing);
    assert_eq!(got[1].token(), leases[1].token());
    assert_eq!(got[2].failure(), Some(&b"a-refund"[..]));
    for (k, rec) in keys.iter().zip(&got) {
        assert_eq!(rec.key(), k);
    }
    // Scope and id concatenated alike ("tenant-a/createreq-1") are still
    // two keys: the stored form is length-prefixed.
    let shifted = key_in("tenant-a/creater", "eq-1");
    acquired(
        store
            .claim(&shifted, &fp("x"), &lease_of(secs(30)))
            .unwrap(),
    );
    assert_eq!(store.len().unwrap(), 4);
    assert_eq!(
        store.get(&keys[0]).unwrap().unwrap().result(),
        Some(&b"a-create"[..])
    );
}
