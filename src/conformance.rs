//! The conformance suite: what every engine must do, as public test
//! functions over a small [`Harness`] (cargo feature `conformance`), in the
//! manner of `object_store`'s `integration` module. `tests/conformance.rs`
//! runs it against the embedded engine and, with the feature `postgres`,
//! against a PostgreSQL server.
//!
//! Each function covers one guarantee of DESIGN.md that does not depend on
//! a file: claim outcomes, fencing, fingerprints, retention, recovery
//! points, business keys, sweep, resolve, scan, stats, export and import,
//! `claim_many`, and what survives a reopen. Every store a test opens has a
//! [`ManualClock`] that the test drives, so nothing waits on real time.
//!
//! These are test functions: they **panic** (with the guarantee that
//! failed) when the engine breaks a guarantee, and are not meant for use
//! outside tests.
//!
//! ```
//! use idemstore::conformance::{self, Harness};
//! use idemstore::{Config, Store};
//!
//! struct Files(tempfile::TempDir);
//!
//! impl Harness for Files {
//!     fn open(&self, name: &str, config: Config) -> Store {
//!         Store::open_with(self.0.path().join(name), config).unwrap()
//!     }
//!     fn reopen(&self, store: Store, config: Config) -> Store {
//!         let path = store.path().to_path_buf();
//!         drop(store);
//!         Store::open_with(path, config).unwrap()
//!     }
//! }
//!
//! let files = Files(tempfile::tempdir().unwrap());
//! conformance::claim_outcomes(&files);
//! ```

use std::time::Duration;

use crate::{
    AcquiredFrom, ClaimOptions, ClaimOutcome, Clock, Config, Error, Filter, Fingerprint,
    ImportOptions, Key, ManualClock, Resolution, State, Store,
};

/// Opens stores of one engine for the suite.
pub trait Harness {
    /// Creates a new, empty store named `name` (unique within one run of
    /// the suite) with `config`: the open that creates it, so that
    /// [`Store::was_created`] holds.
    fn open(&self, name: &str, config: Config) -> Store;
    /// Drops `store` and opens the same store again with `config` (a
    /// restart of the process that held it).
    fn reopen(&self, store: Store, config: Config) -> Store;
}

/// One test function of the suite.
pub type Test = fn(&dyn Harness);

/// Every test function of the suite, with its name, for a runner that
/// runs them all (`for (name, test) in conformance::ALL`).
pub const ALL: &[(&str, Test)] = &[
    ("claim_outcomes", claim_outcomes),
    ("fencing", fencing),
    ("fingerprints", fingerprints),
    ("retention", retention),
    ("recovery_points", recovery_points),
    ("business_keys", business_keys),
    ("sweep", sweep),
    ("resolve", resolve),
    ("scan", scan),
    ("stats", stats),
    ("export_import", export_import),
    ("claim_many", claim_many),
    ("reopen", reopen),
    ("holder_finishes", holder_finishes),
    ("abandoned_claims", abandoned_claims),
];

/// The clock every store of the suite starts at: 2026-01-01T00:00:00Z.
const START_MS: u64 = 1_767_225_600_000;
const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn config(clock: &ManualClock) -> Config {
    Config::new()
        .clock(clock.clone())
        .lease(LEASE)
        .retention(RETENTION)
        .sweep_interval(None)
}

fn key(id: &str) -> Key {
    Key::new("conformance/tickets", id).expect("a valid key")
}

fn fp(payload: &str) -> Fingerprint {
    Fingerprint::of(payload.as_bytes())
}

fn acquire(store: &Store, key: &Key, fingerprint: &Fingerprint) -> crate::Lease {
    match store.claim(key, fingerprint, &ClaimOptions::new()) {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("{key}: expected Acquired, got {other:?}"),
    }
}

/// A fresh key is acquired; while held it is in progress; once completed
/// it replays its result; a retryable failure frees it for a new holder
/// with a higher token; a permanent failure replays.
pub fn claim_outcomes(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("claim_outcomes", config(&clock));
    let (k, f) = (key("outcomes"), fp("a"));
    let first = acquire(&store, &k, &f);
    assert!(!first.is_takeover(), "a fresh key is not a takeover");
    assert_eq!(first.acquired_from(), Some(AcquiredFrom::Absent));
    match store.claim(&k, &f, &ClaimOptions::new()) {
        Ok(ClaimOutcome::InProgress { lease_until_ms, .. }) => {
            assert_eq!(Some(lease_until_ms), first.lease_until_ms());
        }
        other => panic!("a held key answers InProgress, got {other:?}"),
    }
    let done = store.complete(&first, b"T-1").expect("complete");
    assert_eq!(done.state(), State::Succeeded);
    match store.claim(&k, &f, &ClaimOptions::new()) {
        Ok(ClaimOutcome::Replay(record)) => assert_eq!(record.result(), Some(&b"T-1"[..])),
        other => panic!("a finished key replays, got {other:?}"),
    }
    // Retryable failure: the next claim acquires with a higher token.
    let k2 = key("retryable");
    let held = acquire(&store, &k2, &f);
    store.fail(&held, b"timeout", true).expect("fail");
    let again = acquire(&store, &k2, &f);
    assert!(again.token() > held.token(), "tokens grow per key");
    assert_eq!(again.acquired_from(), Some(AcquiredFrom::RetryableFailure));
    store.fail(&again, b"card declined", false).expect("fail");
    match store.claim(&k2, &f, &ClaimOptions::new()) {
        Ok(ClaimOutcome::Replay(record)) => {
            assert_eq!(record.state(), State::Failed { retryable: false });
            assert_eq!(record.failure(), Some(&b"card declined"[..]));
        }
        other => panic!("a permanent failure replays, got {other:?}"),
    }
}

/// A lapsed lease is taken over with a higher token; the old holder's
/// complete, fail, release, extend and recovery point are refused with
/// [`Error::StaleLease`] and change nothing.
pub fn fencing(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("fencing", config(&clock));
    let (k, f) = (key("fenced"), fp("a"));
    let old = acquire(&store, &k, &f);
    clock.advance(LEASE + Duration::from_millis(1));
    let new = acquire(&store, &k, &f);
    assert!(new.token() > old.token(), "a takeover has a higher token");
    assert!(new.is_takeover(), "a lapsed lease is taken over");
    assert_eq!(new.acquired_from(), Some(AcquiredFrom::LapsedLease));
    assert!(matches!(
        store.complete(&old, b"late"),
        Err(Error::StaleLease { .. })
    ));
    assert!(matches!(
        store.fail(&old, b"late", true),
        Err(Error::StaleLease { .. })
    ));
    assert!(matches!(
        store.extend(&old, LEASE),
        Err(Error::StaleLease { .. })
    ));
    assert!(matches!(
        store.set_recovery_point(&old, b"step"),
        Err(Error::StaleLease { .. })
    ));
    assert!(matches!(
        store.release(old.clone()),
        Err(Error::StaleLease { .. })
    ));
    let record = store.get(&k).expect("get").expect("present");
    assert_eq!(record.state(), State::Processing);
    assert_eq!(record.token(), new.token());
    // Extending moves the deadline; the holder stays the holder.
    clock.advance(Duration::from_secs(10));
    let until = store.extend(&new, LEASE).expect("extend");
    assert!(until >= START_MS + 10_000 + 30_000, "extended from now");
    store.release(new).expect("release");
    assert!(store.get(&k).expect("get").is_none(), "a release forgets");
}

/// A key reused with another payload is refused in every state, and the
/// refusal changes nothing.
pub fn fingerprints(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("fingerprints", config(&clock));
    let (k, f, other) = (key("fp"), fp("a"), fp("b"));
    let lease = acquire(&store, &k, &f);
    let mismatch = |store: &Store| {
        assert!(matches!(
            store.claim(&k, &other, &ClaimOptions::new()),
            Err(Error::FingerprintMismatch { .. })
        ));
    };
    mismatch(&store);
    store.fail(&lease, b"x", true).expect("fail");
    mismatch(&store);
    let lease = acquire(&store, &k, &f);
    store.complete(&lease, b"ok").expect("complete");
    mismatch(&store);
    let record = store.get(&k).expect("get").expect("present");
    assert_eq!(record.fingerprint(), &f);
    assert_eq!(record.result(), Some(&b"ok"[..]));
}

/// A finished record is kept for the retention period and absent after
/// it: the key is acquired afresh (a new record) once it has passed.
pub fn retention(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("retention", config(&clock));
    let (k, f) = (key("kept"), fp("a"));
    let lease = acquire(&store, &k, &f);
    store.complete(&lease, b"done").expect("complete");
    clock.advance(RETENTION - Duration::from_millis(1));
    assert!(
        store.get(&k).expect("get").is_some(),
        "kept until retention"
    );
    clock.advance(Duration::from_millis(2));
    assert!(
        store.get(&k).expect("get").is_none(),
        "gone after retention"
    );
    // After retention the key is new, whatever the payload.
    let fresh = acquire(&store, &k, &fp("another payload"));
    assert!(fresh.token() > lease.token());
    assert!(!fresh.is_takeover());
}

/// A recovery point is stored under the lease and handed to the next
/// holder after a takeover.
pub fn recovery_points(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("recovery_points", config(&clock));
    let (k, f) = (key("steps"), fp("a"));
    let lease = acquire(&store, &k, &f);
    store
        .set_recovery_point(&lease, b"charged card")
        .expect("recovery point");
    let record = store.get(&k).expect("get").expect("present");
    assert_eq!(record.recovery_point(), Some(&b"charged card"[..]));
    clock.advance(LEASE + Duration::from_millis(1));
    let next = acquire(&store, &k, &f);
    assert!(next.is_takeover());
    assert_eq!(next.recovery_point(), Some(&b"charged card"[..]));
}

/// A business key held by a live record of another key refuses the claim
/// (HTTP 409) and is free again once that record is released; `verify`
/// finds the one binding, and it agrees with its record. A record past
/// retention whose business key another key takes is evicted in that
/// write: it never reads as live again beside the new holder, even after
/// the clock steps back.
pub fn business_keys(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("business_keys", config(&clock));
    let f = fp("a");
    let with_bk = ClaimOptions::new().business_key("order-77");
    let first = match store.claim(&key("bk-1"), &f, &with_bk) {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    };
    match store.claim(&key("bk-2"), &f, &with_bk) {
        Err(Error::BusinessKeyConflict { existing, .. }) => assert_eq!(existing, key("bk-1")),
        other => panic!("a held business key conflicts, got {other:?}"),
    }
    assert!(store.get(&key("bk-2")).expect("get").is_none());
    store.release(first).expect("release");
    let second = match store.claim(&key("bk-2"), &f, &with_bk) {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("a released business key is free, got {other:?}"),
    };
    let report = store.verify(|_| {}).expect("verify");
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.bindings, 1, "the business key's binding is read");

    // A record past retention whose business key another key takes is
    // evicted in that write, as a sweep would evict it, so that it never
    // reads as live again beside the new holder: not even after the clock
    // steps back (the file engine's time does not; PostgreSQL's, the
    // server's clock, does).
    store.complete(&second, b"done").expect("complete");
    clock.advance(RETENTION + Duration::from_secs(10));
    assert!(matches!(
        store.claim(&key("bk-3"), &f, &with_bk),
        Ok(ClaimOutcome::Acquired(_))
    ));
    assert_eq!(store.len().expect("len"), 1, "bk-2 is evicted, not kept");
    clock.step_back(Duration::from_secs(60));
    assert!(store.get(&key("bk-2")).expect("get").is_none());
    match store.claim(&key("bk-4"), &f, &with_bk) {
        Err(Error::BusinessKeyConflict { existing, .. }) => assert_eq!(existing, key("bk-3")),
        other => panic!("the business key is bk-3's, got {other:?}"),
    }
    let report = store.verify(|_| {}).expect("verify");
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(store.stats().expect("stats").counters.evictions, 1);
}

/// A sweep evicts exactly the records past retention.
pub fn sweep(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("sweep", config(&clock));
    let f = fp("a");
    for i in 0..10 {
        let lease = acquire(&store, &key(&format!("old-{i}")), &f);
        store.complete(&lease, b"r").expect("complete");
    }
    clock.advance(RETENTION + Duration::from_secs(1));
    for i in 0..5 {
        let lease = acquire(&store, &key(&format!("new-{i}")), &f);
        store.complete(&lease, b"r").expect("complete");
    }
    assert_eq!(store.len().expect("len"), 15);
    let mut evicted = 0;
    loop {
        let n = store.sweep(4).expect("sweep");
        assert!(n <= 4, "a sweep evicts at most its batch");
        if n == 0 {
            break;
        }
        evicted += n;
    }
    assert_eq!(evicted, 10);
    assert_eq!(store.len().expect("len"), 5);
}

/// An operator's resolve finishes a Processing record under its token;
/// a wrong token is refused. An amend corrects a finished record's outcome
/// under its token.
pub fn resolve(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("resolve", config(&clock));
    let (k, f) = (key("stuck"), fp("a"));
    let lease = acquire(&store, &k, &f);
    let wrong = lease.token().saturating_add(1000);
    assert!(matches!(
        store.resolve(&k, wrong, Resolution::Succeeded(b"x".to_vec())),
        Err(Error::StaleLease { .. })
    ));
    let record = store
        .resolve(&k, lease.token(), Resolution::Succeeded(b"T-9".to_vec()))
        .expect("resolve");
    assert_eq!(record.state(), State::Succeeded);
    assert!(matches!(
        store.complete(&lease, b"late"),
        Err(Error::StaleLease { .. })
    ));
    // An amend corrects the finished outcome under the same token, and
    // only that: a wrong token and a record in progress are refused.
    assert!(matches!(
        store.amend(&k, wrong, Resolution::Succeeded(b"x".to_vec())),
        Err(Error::StaleLease { .. })
    ));
    let amended = store
        .amend(
            &k,
            lease.token(),
            Resolution::Failed {
                failure: b"not sent".to_vec(),
                retryable: false,
            },
        )
        .expect("amend");
    assert_eq!(amended.state(), State::Failed { retryable: false });
    assert_eq!(amended.token(), lease.token());
    let got = store.get(&k).expect("get").expect("the amended record");
    assert_eq!(got.failure(), Some(&b"not sent"[..]));
    let other = acquire(&store, &key("running"), &f);
    assert!(matches!(
        store.amend(
            &key("running"),
            other.token(),
            Resolution::Succeeded(b"x".to_vec())
        ),
        Err(Error::StaleLease { .. })
    ));
}

/// A scan yields the live records that pass its filter, by scope.
pub fn scan(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("scan", config(&clock));
    let f = fp("a");
    let done = acquire(&store, &key("s-done"), &f);
    store.complete(&done, b"r").expect("complete");
    acquire(&store, &key("s-held"), &f);
    let other = Key::new("elsewhere", "x").expect("key");
    acquire(&store, &other, &f);
    let ids = |filter: &Filter| -> Vec<String> {
        let mut ids: Vec<String> = store
            .scan(filter)
            .expect("scan")
            .map(|r| r.expect("record").key().to_string())
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&Filter::new()).len(), 3);
    assert_eq!(
        ids(&Filter::new().state(State::Processing)),
        vec![
            "conformance/tickets/s-held".to_string(),
            "elsewhere/x".to_string()
        ]
    );
    assert_eq!(
        ids(&Filter::new().scope_prefix("conformance/")),
        vec![
            "conformance/tickets/s-done".to_string(),
            "conformance/tickets/s-held".to_string()
        ]
    );
    assert!(ids(&Filter::new().lapsed()).is_empty());
    clock.advance(LEASE + Duration::from_millis(1));
    assert_eq!(ids(&Filter::new().lapsed()).len(), 2);
}

/// Stats count records by state and the oldest work in flight.
pub fn stats(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("stats", config(&clock));
    let f = fp("a");
    let a = acquire(&store, &key("st-a"), &f);
    store.complete(&a, b"r").expect("complete");
    let b = acquire(&store, &key("st-b"), &f);
    store.fail(&b, b"no", false).expect("fail");
    let c = acquire(&store, &key("st-c"), &f);
    store.fail(&c, b"later", true).expect("fail");
    clock.advance(Duration::from_secs(5));
    acquire(&store, &key("st-d"), &f);
    clock.advance(Duration::from_secs(2));
    let stats = store.stats().expect("stats");
    assert_eq!(stats.records.succeeded, 1);
    assert_eq!(stats.records.failed, 1);
    assert_eq!(stats.records.failed_retryable, 1);
    assert_eq!(stats.records.processing, 1);
    assert_eq!(stats.records.total(), 4);
    assert_eq!(stats.oldest_processing_age_ms, Some(2_000));
    assert!(stats.counters.claims >= 4);
}

/// An export of one store imports into an empty one with every live
/// record as it was, and tokens there continue above the exported ones.
pub fn export_import(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let from = h.open("export_from", config(&clock));
    let f = fp("a");
    let mut tokens = Vec::new();
    for i in 0..20 {
        let lease = acquire(&from, &key(&format!("x-{i}")), &f);
        tokens.push(lease.token());
        if i % 2 == 0 {
            from.complete(&lease, format!("r{i}").as_bytes())
                .expect("complete");
        }
    }
    let mut stream = Vec::new();
    let exported = from.export(&mut stream, |_| {}).expect("export");
    assert_eq!(exported.records, 20);
    let into = h.open("export_into", config(&clock));
    let imported = into
        .import_with(stream.as_slice(), &ImportOptions::new(), |_| {})
        .expect("import");
    assert_eq!(imported.imported, 20);
    for i in 0..20 {
        let k = key(&format!("x-{i}"));
        let a = from.get(&k).expect("get").expect("exported");
        let b = into.get(&k).expect("get").expect("imported");
        assert_eq!(a, b, "{k} is imported as it was");
    }
    let max = tokens.iter().copied().max().unwrap_or(0);
    let fresh = acquire(&into, &key("after-import"), &f);
    assert!(
        fresh.token() > max,
        "tokens continue above the imported ones"
    );
    // Importing the same stream again changes nothing.
    let again = into
        .import_with(stream.as_slice(), &ImportOptions::new(), |_| {})
        .expect("import");
    assert_eq!(again.imported, 0);
    assert_eq!(again.present, 20);
}

/// `claim_many` answers each claim in input order as if claimed alone: a
/// duplicate in the batch is in progress (same payload) or refused
/// (another payload); keys already held are respected.
pub fn claim_many(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("claim_many", config(&clock));
    let held = acquire(&store, &key("m-held"), &fp("a"));
    let claims = vec![
        (key("m-1"), fp("a")),
        (key("m-2"), fp("a")),
        (key("m-1"), fp("a")),
        (key("m-2"), fp("other")),
        (key("m-held"), fp("a")),
    ];
    let outcomes = store
        .claim_many(&claims, &ClaimOptions::new())
        .expect("claim_many");
    assert_eq!(outcomes.len(), 5);
    let t1 = match &outcomes[0] {
        Ok(ClaimOutcome::Acquired(lease)) => lease.token(),
        other => panic!("m-1 first: {other:?}"),
    };
    let t2 = match &outcomes[1] {
        Ok(ClaimOutcome::Acquired(lease)) => lease.token(),
        other => panic!("m-2 first: {other:?}"),
    };
    assert!(t2 > t1, "tokens in input order");
    assert!(matches!(&outcomes[2], Ok(ClaimOutcome::InProgress { .. })));
    assert!(matches!(
        &outcomes[3],
        Err(Error::FingerprintMismatch { .. })
    ));
    assert!(matches!(&outcomes[4], Ok(ClaimOutcome::InProgress { .. })));
    assert_eq!(
        store
            .get(&key("m-held"))
            .expect("get")
            .expect("held")
            .token(),
        held.token(),
        "a key already held keeps its holder"
    );
    assert_eq!(
        store
            .get(&key("m-1"))
            .expect("get")
            .expect("claimed")
            .token(),
        t1
    );
    assert!(matches!(
        store.claim_many(&[], &ClaimOptions::new()),
        Ok(v) if v.is_empty()
    ));
    let too_many: Vec<_> = (0..=crate::MAX_CLAIM_MANY)
        .map(|i| (key(&format!("many-{i}")), fp("a")))
        .collect();
    assert!(matches!(
        store.claim_many(&too_many, &ClaimOptions::new()),
        Err(Error::InvalidArgument { .. })
    ));
}

/// Everything acknowledged survives a reopen, and tokens never go back.
/// The open that created the store says so ([`Store::was_created`]); the
/// reopen does not.
pub fn reopen(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("reopen", config(&clock));
    assert!(store.was_created(), "the first open created the store");
    let f = fp("a");
    let done = acquire(&store, &key("r-done"), &f);
    store.complete(&done, b"kept").expect("complete");
    let held = acquire(&store, &key("r-held"), &f);
    store
        .set_recovery_point(&held, b"half")
        .expect("recovery point");
    let store = h.reopen(store, config(&clock));
    assert!(!store.was_created(), "a reopen created nothing");
    let record = store.get(&key("r-done")).expect("get").expect("present");
    assert_eq!(record.result(), Some(&b"kept"[..]));
    let record = store.get(&key("r-held")).expect("get").expect("present");
    assert_eq!(record.state(), State::Processing);
    assert_eq!(record.recovery_point(), Some(&b"half"[..]));
    store
        .complete(&held, b"finished")
        .expect("the lease outlives a reopen");
    let next = acquire(&store, &key("r-new"), &f);
    assert!(next.token() > held.token(), "tokens never go back");
}

/// A holder finishes its own record, whatever the holder did to it before
/// (extended it, saved a recovery point), and also after its lease lapsed
/// while nobody took the key over; never once the record has passed
/// retention, nor after a takeover, nor after a restart took the
/// process's memory of the record away: each answer is the transition's,
/// with the finishing time and a new expiry, whichever way an engine
/// decides it (the PostgreSQL engine decides the common cases in one
/// fenced statement).
pub fn holder_finishes(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("holder_finishes", config(&clock));
    let f = fp("a");
    let retention_ms = u64::try_from(RETENTION.as_millis()).expect("retention");
    let lease_ms = u64::try_from(LEASE.as_millis()).expect("lease");
    // Extended and given a recovery point, then completed.
    let k = key("changed");
    let lease = acquire(&store, &k, &f);
    clock.advance(Duration::from_secs(5));
    store.extend(&lease, LEASE).expect("extend");
    store
        .set_recovery_point(&lease, b"step-1")
        .expect("recovery point");
    clock.advance(Duration::from_secs(1));
    let done = store.complete(&lease, b"ok").expect("complete");
    let at = START_MS + 6_000;
    assert_eq!(done.state(), State::Succeeded);
    assert_eq!(done.updated_ms(), at);
    assert_eq!(done.expires_ms(), at + retention_ms);
    assert_eq!(done.recovery_point(), Some(&b"step-1"[..]));
    assert_eq!(store.get(&k).expect("get"), Some(done));
    // Lapsed, nobody took over: the holder may still fail it.
    let k = key("lapsed");
    let lease = acquire(&store, &k, &f);
    clock.advance(LEASE + Duration::from_secs(1));
    let failed = store.fail(&lease, b"late", true).expect("fail");
    assert_eq!(failed.state(), State::Failed { retryable: true });
    assert_eq!(
        failed.created_ms(),
        lease.record().expect("record").created_ms()
    );
    assert_eq!(store.get(&k).expect("get"), Some(failed));
    // Past retention while Processing: the record is gone, the holder
    // fenced.
    let k = key("expired");
    let lease = acquire(&store, &k, &f);
    let expires = lease.record().expect("record").expires_ms();
    assert_eq!(expires, clock.now_ms() + retention_ms.max(lease_ms));
    clock.advance(Duration::from_millis(expires - clock.now_ms()));
    assert!(matches!(
        store.complete(&lease, b"too late"),
        Err(Error::StaleLease { .. })
    ));
    assert!(store.get(&k).expect("get").is_none());
    let fresh = acquire(&store, &k, &f);
    assert!(!fresh.is_takeover(), "an expired record is absent");
    assert_eq!(fresh.acquired_from(), Some(AcquiredFrom::Absent));
    assert!(fresh.token() > lease.token());
    // A takeover fences the first holder; the new one completes.
    let k = key("taken");
    let first = acquire(&store, &k, &f);
    clock.advance(LEASE);
    let second = acquire(&store, &k, &f);
    assert!(second.is_takeover());
    assert!(matches!(
        store.complete(&first, b"old"),
        Err(Error::StaleLease { .. })
    ));
    let done = store.complete(&second, b"new").expect("complete");
    assert_eq!(done.acquisitions(), 2);
    // After a restart, a lease rebuilt from its parts completes too.
    let k = key("restarted");
    let lease = acquire(&store, &k, &f);
    let store = h.reopen(store, config(&clock));
    clock.advance(Duration::from_secs(2));
    let rebuilt = crate::Lease::from_parts(k.clone(), lease.token());
    let done = store
        .complete(&rebuilt, b"after restart")
        .expect("complete");
    assert_eq!(done.updated_ms(), clock.now_ms());
    assert!(matches!(
        store.complete(&rebuilt, b"twice"),
        Err(Error::StaleLease { .. })
    ));
}

/// Polls `store.claim_async(key, …)` once, so that its claim is sent, and
/// drops it, as a server drops a request whose client hung up; returns
/// once the engine decided that claim (the key's token moved past `after`),
/// or `false` at once if the claim was answered at its first poll (nothing
/// was abandoned).
fn abandon_claim(store: &Store, key: &Key, fingerprint: &Fingerprint, after: u64) -> bool {
    let options = ClaimOptions::new();
    let mut claim = Box::pin(store.claim_async(key, fingerprint, &options));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if claim.as_mut().poll(&mut cx).is_ready() {
        return false;
    }
    drop(claim);
    wait_for_record(store, key, "the abandoned claim was never decided", |r| {
        r.is_some_and(|r| r.token() > after)
    });
    let record = store.get(key).expect("get");
    assert_eq!(record.map(|r| r.state()), Some(State::Processing));
    true
}

/// Polls `key`'s record until `done` holds, under a hang guard of 60 s
/// (not a timing assertion: it fails only if that never happens, with
/// `what`).
fn wait_for_record(
    store: &Store,
    key: &Key,
    what: &str,
    done: impl Fn(Option<&crate::Record>) -> bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !done(store.get(key).expect("get").as_ref()) {
        assert!(std::time::Instant::now() < deadline, "{key}: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A claim whose caller stopped waiting (its `claim_async` future dropped
/// after the claim was sent) acquires a lease nobody holds: the next claim
/// of the store gives it back as the claim found the key, so that the key
/// is not held for the lease's length by nobody. Found absent: released,
/// and the next claim is a first attempt. Found failed retryably: failed
/// again with the same failure, and the next claim is a takeover of that
/// failure. Found under a lapsed lease: left to lapse, so that the next
/// claim is still told an earlier holder may have acted.
pub fn abandoned_claims(h: &dyn Harness) {
    let clock = ManualClock::new(START_MS);
    let store = h.open("abandoned_claims", config(&clock));
    let f = fp("a");
    on_a_fresh_key("absent", |k| {
        if !abandon_claim(&store, k, &f, 0) {
            return false;
        }
        let lease = acquire(&store, k, &f);
        assert_eq!(lease.acquired_from(), Some(AcquiredFrom::Absent));
        assert!(
            !lease.is_takeover(),
            "nothing ran under the abandoned lease"
        );
        true
    });

    on_a_fresh_key("failed", |k| {
        let first = acquire(&store, k, &f);
        let failed = store.fail(&first, b"boom", true).expect("fail");
        if !abandon_claim(&store, k, &f, failed.token()) {
            return false;
        }
        let lease = acquire(&store, k, &f);
        assert_eq!(lease.acquired_from(), Some(AcquiredFrom::RetryableFailure));
        assert_eq!(
            lease.record().and_then(|r| r.failure()),
            Some(&b"boom"[..]),
            "the failure the abandoned claim found"
        );
        true
    });

    on_a_fresh_key("lapsed", |k| {
        let first = acquire(&store, k, &f);
        clock.advance(LEASE + Duration::from_secs(1));
        // A read first makes the store's new time durable, so that the
        // claim below is sent at its first poll (not after a time
        // reservation).
        store.get(k).expect("get");
        if !abandon_claim(&store, k, &f, first.token()) {
            return false;
        }
        assert!(
            matches!(
                store.claim(k, &f, &ClaimOptions::new()),
                Ok(ClaimOutcome::InProgress { .. })
            ),
            "a takeover of a lapsed lease is left to lapse"
        );
        clock.advance(LEASE + Duration::from_secs(1));
        let lease = acquire(&store, k, &f);
        assert_eq!(lease.acquired_from(), Some(AcquiredFrom::LapsedLease));
        true
    });

    // Two abandoned claims, given back by a third claim whose own caller
    // hangs up at once: both give-backs were sent, and both keys come free.
    on_a_fresh_key("abandoned", |x| {
        let y = key(&format!("{}-y", x.id()));
        let options = ClaimOptions::new();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Both sent before either is dropped (a claim gives back only what
        // was abandoned before it).
        let mut first = Box::pin(store.claim_async(x, &f, &options));
        let mut second = Box::pin(store.claim_async(&y, &f, &options));
        let sent = first.as_mut().poll(&mut cx).is_pending();
        let sent = second.as_mut().poll(&mut cx).is_pending() && sent;
        drop((first, second));
        if !sent {
            return false;
        }
        for k in [x, &y] {
            wait_for_record(&store, k, "the abandoned claim was never decided", |r| {
                r.is_some()
            });
        }
        let z = key(&format!("{}-z", x.id()));
        let mut giver = Box::pin(store.claim_async(&z, &f, &options));
        let _ = giver.as_mut().poll(&mut cx);
        drop(giver);
        for k in [x, &y] {
            wait_for_record(
                &store,
                k,
                "the lease of an abandoned claim was not given back",
                |r| r.is_none(),
            );
        }
        let lease = acquire(&store, &y, &f);
        assert_eq!(lease.acquired_from(), Some(AcquiredFrom::Absent));
        true
    });

    // A failure stored under a larger limit than this store's is given
    // back as it was (not checked against the limit again).
    let large = vec![b'e'; 2_000];
    let keys: Vec<Key> = (0..ATTEMPTS)
        .map(|i| key(&format!("large-failure-{i}")))
        .collect();
    let tokens: Vec<u64> = keys
        .iter()
        .map(|k| {
            let first = acquire(&store, k, &f);
            store.fail(&first, &large, true).expect("fail").token()
        })
        .collect();
    let store = h.reopen(store, config(&clock).max_failure_bytes(100));
    store.get(&keys[0]).expect("get");
    let mut attempt = keys.iter().zip(tokens);
    on_a_fresh_key("large-failure", |_| {
        let (k, token) = attempt.next().expect("a prepared key");
        if !abandon_claim(&store, k, &f, token) {
            return false;
        }
        let lease = acquire(&store, k, &f);
        assert_eq!(lease.acquired_from(), Some(AcquiredFrom::RetryableFailure));
        assert_eq!(
            lease.record().and_then(|r| r.failure()),
            Some(&large[..]),
            "the failure the abandoned claim found"
        );
        true
    });
}

/// How many fresh keys [`on_a_fresh_key`] tries.
const ATTEMPTS: usize = 20;

/// Runs `case` on fresh keys (`name-0`, `name-1`, …) until it could abandon
/// its claim in flight (it returns `false` when the claim was answered at
/// its first poll, as a loaded machine may do), at most [`ATTEMPTS`] times.
fn on_a_fresh_key(name: &str, mut case: impl FnMut(&Key) -> bool) {
    for i in 0..ATTEMPTS {
        if case(&key(&format!("{name}-{i}"))) {
            return;
        }
    }
    panic!("{name}: every claim was answered at its first poll; none could be abandoned");
}
