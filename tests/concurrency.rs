//! Concurrency property test: proptest generates a plan, std threads run it
//! against one store.
//!
//! 8 to 32 threads claim overlapping keys and end what they acquire
//! (complete, fail retryably or permanently, release), some after saving a
//! recovery point or extending. The clock is a fixed [`ManualClock`] and the
//! lease is an hour, so no lease lapses inside a run: every acquisition
//! starts a lease period that its holder ends. Checked:
//!
//! - at most one holder per key at any moment (a per-key flag that each
//!   winner sets and clears before it ends its lease);
//! - exactly one `Acquired` per key per lease period: acquisitions equal
//!   the ends acknowledged on that key (each retryable failure or release
//!   opens a new period), with at most one final end;
//! - fencing tokens are unique;
//! - every acknowledged completion or permanent failure is replayed
//!   afterwards, and again after a reopen; every replay seen during the run
//!   is that outcome;
//! - no call returned an unexpected error.
//!
//! A few cases by default (it is heavier than the model test);
//! `IDEMSTORE_CONCURRENCY_CASES=N` runs N.
//!
//! With the feature `postgres` the same plans run against a PostgreSQL
//! store too (a schema of its own per case, on the throwaway server of
//! `tests/pg`): there the threads' requests are group-committed into shared
//! transactions over several connections.

#[cfg(all(feature = "postgres", feature = "conformance"))]
mod pg;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::Duration;

use idemstore::{
    ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, Key, ManualClock, Record, State, Store,
};
use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use tempfile::TempDir;

const T0_MS: u64 = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(3600);
/// How often a thread claims a key that is in progress before moving on.
const RETRIES: usize = 50;

/// How a thread ends a lease it acquired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Complete,
    FailRetryable,
    FailPermanent,
    Release,
}

#[derive(Clone, Debug)]
struct Action {
    key: usize,
    /// 0: the key's usual payload; 1: another payload (a client reusing a
    /// key for a different request).
    fp: usize,
    end: End,
    recovery_point: bool,
    extend: bool,
}

#[derive(Clone, Debug)]
struct Plan {
    keys: usize,
    threads: Vec<Vec<Action>>,
}

fn plan() -> impl Strategy<Value = Plan> {
    (8usize..=32, 1usize..=12).prop_flat_map(|(threads, keys)| {
        let end = prop_oneof![
            1 => Just(End::Complete),
            5 => Just(End::FailRetryable),
            1 => Just(End::FailPermanent),
            4 => Just(End::Release),
        ];
        let action = (
            0..keys,
            prop::bool::weighted(0.1),
            end,
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.2),
        )
            .prop_map(|(key, other, end, recovery_point, extend)| Action {
                key,
                fp: usize::from(other),
                end,
                recovery_point,
                extend,
            });
        prop::collection::vec(prop::collection::vec(action, 1..=16), threads)
            .prop_map(move |threads| Plan { keys, threads })
    })
}

fn key(i: usize) -> Key {
    Key::new(format!("scope-{}", i % 2), format!("key-{i}")).expect("valid key")
}

fn fingerprint(key: usize, fp: usize) -> Fingerprint {
    Fingerprint::of(format!("payload of key {key}, variant {fp}").as_bytes())
}

/// A temporary directory for the store file: `IDEMSTORE_TEST_DIR` when set,
/// else `/dev/shm` when present (fsyncs cost microseconds there), else the
/// system temporary directory.
fn test_dir() -> TempDir {
    let base = std::env::var_os("IDEMSTORE_TEST_DIR")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from("/dev/shm")).filter(|p| p.is_dir()));
    match base {
        Some(base) => tempfile::tempdir_in(base),
        None => tempfile::tempdir(),
    }
    .expect("temporary directory")
}

fn config(clock: &ManualClock) -> Config {
    Config::new()
        .lease(LEASE)
        .sweep_interval(None)
        .clock(clock.clone())
}

/// Where a plan's store lives: a file, or a schema of a PostgreSQL server.
enum Place {
    File(PathBuf),
    #[cfg(all(feature = "postgres", feature = "conformance"))]
    Postgres {
        url: String,
        schema: String,
    },
}

fn open(place: &Place, clock: &ManualClock) -> Store {
    match place {
        Place::File(path) => Store::open_with(path, config(clock)).expect("open the store"),
        #[cfg(all(feature = "postgres", feature = "conformance"))]
        Place::Postgres { url, schema } => Store::connect(
            url,
            config(clock)
                .postgres_schema(schema.clone())
                .postgres_connections(4),
        )
        .expect("connect the store"),
    }
}

/// What the threads saw, per key.
#[derive(Default)]
struct Seen {
    acquired: u64,
    retryable: u64,
    released: u64,
    /// Acknowledged completions and permanent failures: (state, output).
    finals: Vec<(State, Vec<u8>)>,
    /// Replays answered to claims: (state, output).
    replays: Vec<(State, Vec<u8>)>,
}

#[derive(Default)]
struct Log {
    per_key: HashMap<usize, Seen>,
    tokens: Vec<u64>,
    unexpected: Vec<String>,
}

fn outcome_of(record: &Record) -> (State, Vec<u8>) {
    let bytes = match record.state() {
        State::Succeeded => record.result(),
        _ => record.failure(),
    };
    (record.state(), bytes.unwrap_or_default().to_vec())
}

fn run_thread(store: &Store, plan: &Plan, thread: usize, holding: &[AtomicBool], log: &Mutex<Log>) {
    let unexpected = |what: String| log.lock().expect("log").unexpected.push(what);
    for (n, action) in plan.threads[thread].iter().enumerate() {
        let k = key(action.key);
        let fp = fingerprint(action.key, action.fp);
        // A caller that is told "in progress" retries a few times.
        let mut attempts = 0;
        let claimed = loop {
            attempts += 1;
            match store.claim(&k, &fp, &ClaimOptions::new()) {
                Ok(ClaimOutcome::InProgress { retry_after, .. }) if attempts < RETRIES => {
                    if retry_after.is_zero() || retry_after > LEASE {
                        unexpected(format!("thread {thread}: retry_after {retry_after:?}"));
                    }
                    std::thread::yield_now();
                }
                other => break other,
            }
        };
        let outcome = match claimed {
            Ok(o) => o,
            Err(Error::FingerprintMismatch { .. }) if uses_both_payloads(plan, action.key) => {
                continue;
            }
            Err(e) => {
                unexpected(format!("thread {thread} claim {k}: {e}"));
                continue;
            }
        };
        let lease = match outcome {
            ClaimOutcome::Acquired(lease) => lease,
            ClaimOutcome::InProgress { retry_after, .. } => {
                if retry_after.is_zero() || retry_after > LEASE {
                    unexpected(format!("thread {thread}: retry_after {retry_after:?}"));
                }
                continue;
            }
            ClaimOutcome::Replay(record) => {
                let mut log = log.lock().expect("log");
                let seen = log.per_key.entry(action.key).or_default();
                seen.replays.push(outcome_of(&record));
                continue;
            }
        };
        if holding[action.key].swap(true, Ordering::SeqCst) {
            unexpected(format!(
                "thread {thread}: {k} acquired while another holds it"
            ));
        }
        {
            let mut log = log.lock().expect("log");
            log.tokens.push(lease.token());
            log.per_key.entry(action.key).or_default().acquired += 1;
        }
        // The work: leave room for another thread to (wrongly) acquire too.
        std::thread::yield_now();
        if action.recovery_point
            && let Err(e) = store.set_recovery_point(&lease, b"step-1")
        {
            unexpected(format!("thread {thread} recovery point {k}: {e}"));
        }
        if action.extend
            && let Err(e) = store.extend(&lease, LEASE)
        {
            unexpected(format!("thread {thread} extend {k}: {e}"));
        }
        let bytes = format!("thread {thread} action {n}").into_bytes();
        // Clear the flag before ending: the next holder can only acquire
        // once the end is committed, which is after this.
        holding[action.key].store(false, Ordering::SeqCst);
        let ended = match action.end {
            End::Complete => store.complete(&lease, &bytes).map(|_| ()),
            End::FailRetryable => store.fail(&lease, &bytes, true).map(|_| ()),
            End::FailPermanent => store.fail(&lease, &bytes, false).map(|_| ()),
            End::Release => store.release(lease),
        };
        let mut log = log.lock().expect("log");
        match ended {
            Ok(()) => {
                let seen = log.per_key.entry(action.key).or_default();
                match action.end {
                    End::Complete => seen.finals.push((State::Succeeded, bytes)),
                    End::FailPermanent => seen
                        .finals
                        .push((State::Failed { retryable: false }, bytes)),
                    End::FailRetryable => seen.retryable += 1,
                    End::Release => seen.released += 1,
                }
            }
            Err(e) => log
                .unexpected
                .push(format!("thread {thread} {:?} {k}: {e}", action.end)),
        }
    }
}

fn uses_both_payloads(plan: &Plan, key: usize) -> bool {
    let fps: HashSet<usize> = plan
        .threads
        .iter()
        .flatten()
        .filter(|a| a.key == key)
        .map(|a| a.fp)
        .collect();
    fps.len() > 1
}

/// Every acknowledged final outcome is what the store replays, to `get`
/// and to a claim with the payload that finished it.
fn check_replays(store: &Store, plan: &Plan, log: &Log, when: &str) -> Vec<Option<Record>> {
    let mut records = Vec::new();
    for k in 0..plan.keys {
        let record = store.get(&key(k)).expect("get");
        let seen = log.per_key.get(&k);
        let finals = seen.map_or(&[][..], |s| &s.finals[..]);
        if let Some(expected) = finals.first() {
            let record = record
                .as_ref()
                .unwrap_or_else(|| panic!("{when}: key {k}: acknowledged {expected:?} is gone"));
            assert_eq!(&outcome_of(record), expected, "{when}: key {k}");
            let fp = record.fingerprint().clone();
            match store.claim(&key(k), &fp, &ClaimOptions::new()) {
                Ok(ClaimOutcome::Replay(replayed)) => {
                    assert_eq!(&replayed, record, "{when}: key {k}: replay");
                }
                other => panic!("{when}: key {k}: a claim after {expected:?} got {other:?}"),
            }
        } else if let Some(record) = &record {
            assert!(
                !matches!(
                    record.state(),
                    State::Succeeded | State::Failed { retryable: false }
                ),
                "{when}: key {k}: final state {record:?} that nobody was told of"
            );
        }
        records.push(record);
    }
    records
}

fn run_plan(plan: &Plan) {
    let dir = test_dir();
    run_plan_at(plan, &Place::File(dir.path().join("concurrency.redb")));
}

fn run_plan_at(plan: &Plan, place: &Place) {
    let clock = ManualClock::new(T0_MS);
    let store = open(place, &clock);
    let holding: Vec<AtomicBool> = (0..plan.keys).map(|_| AtomicBool::new(false)).collect();
    let log = Mutex::new(Log::default());
    let barrier = Barrier::new(plan.threads.len());
    std::thread::scope(|s| {
        for t in 0..plan.threads.len() {
            let (store, holding, log, barrier) = (&store, &holding, &log, &barrier);
            s.spawn(move || {
                barrier.wait();
                run_thread(store, plan, t, holding, log);
            });
        }
    });
    let log = log.into_inner().expect("log");
    assert!(
        log.unexpected.is_empty(),
        "unexpected answers: {:#?}",
        log.unexpected
    );
    let unique: HashSet<u64> = log.tokens.iter().copied().collect();
    assert_eq!(unique.len(), log.tokens.len(), "a fencing token was reused");

    for (k, seen) in &log.per_key {
        assert!(
            seen.finals.len() <= 1,
            "key {k}: {} final outcomes acknowledged",
            seen.finals.len()
        );
        // Each acquisition opened a lease period that its holder ended.
        let ends = seen.retryable + seen.released + seen.finals.len() as u64;
        assert_eq!(
            seen.acquired,
            ends,
            "key {k}: acquisitions vs ended lease periods (retryable {}, released {}, final {})",
            seen.retryable,
            seen.released,
            seen.finals.len()
        );
        for replay in &seen.replays {
            assert_eq!(
                Some(replay),
                seen.finals.first(),
                "key {k}: a replay of something never acknowledged"
            );
        }
    }
    let before = check_replays(&store, plan, &log, "after the run");
    for (k, record) in before.iter().enumerate() {
        let Some(record) = record else { continue };
        let seen = &log.per_key[&k];
        if seen.released == 0 {
            assert_eq!(
                u64::from(record.acquisitions()),
                seen.acquired,
                "key {k}: the record's acquisition count"
            );
        }
    }
    drop(store);
    let store = open(place, &clock);
    let after = check_replays(&store, plan, &log, "after a reopen");
    assert_eq!(before, after, "records changed across a reopen");
}

fn cases() -> u32 {
    std::env::var("IDEMSTORE_CONCURRENCY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    /// Many threads on overlapping keys: one holder per key at a time, one
    /// acquisition per lease period, every acknowledged outcome replayed.
    #[test]
    fn threads_on_overlapping_keys(plan in plan()) {
        run_plan(&plan);
    }
}

#[cfg(all(feature = "postgres", feature = "conformance"))]
proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]

    /// The same on a PostgreSQL store.
    #[test]
    fn postgres_threads_on_overlapping_keys(plan in plan()) {
        if let Some(url) = pg::url() {
            let schema = pg::schema("concurrency");
            run_plan_at(&plan, &Place::Postgres { url, schema });
        }
    }
}
