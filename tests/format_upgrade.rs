//! Stores written by older builds open with nothing lost (`docs/design.md`,
//! "Format versions"). The fixtures under `tests/fixtures/` were written by
//! `examples/format_fixture.rs` built at the commit each name gives; keep
//! them for every later format change.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, ManualClock, State, Store};

/// The fixtures' clock (see `examples/format_fixture.rs`).
const T0_MS: u64 = 1_767_225_600_000;

fn fixture_key(id: &str) -> Key {
    Key::new("fixture", id).expect("key")
}

/// Copies the fixture store `name` (and its log) into a fresh directory,
/// since opening changes the files.
fn copy_fixture(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for file in [name.to_string(), format!("{name}-wal")] {
        std::fs::copy(src.join(&file), dir.join(&file)).expect("copy fixture");
    }
    dir.join(name)
}

fn config(clock: &ManualClock) -> Config {
    Config::new().clock(clock.clone()).sweep_interval(None)
}

/// Every record the fixture program wrote is there, as written.
fn check_records(store: &Store, what: &str, records: u64) -> u64 {
    let mut max_token = 0;
    for n in 0..10 {
        let r = store
            .get(&fixture_key(&format!("done-{n}")))
            .expect("get")
            .unwrap_or_else(|| panic!("{what}: done-{n} lost"));
        assert_eq!(r.state(), State::Succeeded, "{what}: done-{n}");
        assert_eq!(r.result(), Some(format!("result-{n}").as_bytes()), "{what}");
        max_token = max_token.max(r.token());
    }
    let failed = store
        .get(&fixture_key("failed"))
        .expect("get")
        .expect("failed");
    assert_eq!(failed.state(), State::Failed { retryable: false }, "{what}");
    assert_eq!(failed.failure(), Some(&b"boom"[..]), "{what}");
    let retry = store
        .get(&fixture_key("retry"))
        .expect("get")
        .expect("retry");
    assert_eq!(retry.state(), State::Failed { retryable: true }, "{what}");
    let held = store.get(&fixture_key("held")).expect("get").expect("held");
    assert_eq!(held.state(), State::Processing, "{what}");
    assert_eq!(held.lease_until_ms(), T0_MS + 3_600_000, "{what}");
    assert_eq!(store.len().expect("len"), records, "{what}");
    max_token
        .max(failed.token())
        .max(retry.token())
        .max(held.token())
}

fn opens_with_nothing_lost(name: &str) {
    let dir = TestDir::new();
    let path = copy_fixture(dir.dir.path(), name);
    let clock = ManualClock::new(T0_MS + 60_000);
    let store = Store::open_with(&path, config(&clock)).expect("open an older store");
    let max_token = check_records(&store, name, 13);
    // Migrated to format 4 at open: the state counts, the expiry slots
    // and the expiry counts that `stats` reads were built (from the
    // records, or from the index of a format 3 store: 10 succeeded,
    // 1 failed, 1 retryably failed, 1 in flight), the crashed store's log
    // replayed onto them, and `verify` finds them in step.
    let stats = store.stats().expect("stats");
    let r = &stats.records;
    assert_eq!(
        (r.succeeded, r.failed, r.failed_retryable, r.processing),
        (10, 1, 1, 1),
        "{name}: {stats:?}"
    );
    assert!(stats.oldest_processing_age_ms.is_some(), "{name}");
    let report = store.verify(|_| {}).expect("verify");
    assert!(report.is_clean(), "{name}: {report:?}");
    // The store goes on: a held key is still held, a new key gets a token
    // above every stored one.
    assert!(matches!(
        store
            .claim(
                &fixture_key("held"),
                &Fingerprint::of(b"held"),
                &ClaimOptions::new()
            )
            .expect("claim"),
        ClaimOutcome::InProgress { .. }
    ));
    let fresh = acquired(
        store
            .claim(&fixture_key("new"), &fp("new"), &ClaimOptions::new())
            .expect("claim"),
    );
    assert!(fresh.token() > max_token);
    drop(store);
    // Reopened by this build (now with its own metadata), still all there.
    clock.advance(Duration::from_secs(60));
    let store = Store::open_with(&path, config(&clock)).expect("reopen");
    check_records(&store, name, 14);
    assert_eq!(
        store.stats().expect("stats").records.processing,
        2,
        "{name}"
    );
    assert!(store.verify(|_| {}).expect("verify").is_clean(), "{name}");
    assert!(store.get(&fixture_key("new")).expect("get").is_some());
    assert!(store.now_ms() >= T0_MS + 120_000);
}

/// A store closed cleanly by the build at 6794c7c.
#[test]
fn a_clean_store_written_by_format_1_opens_with_nothing_lost() {
    opens_with_nothing_lost("v1-clean.redb");
}

/// A store whose process exited without closing, written by the build at
/// 6794c7c: its last changes are only in the log, which this build replays.
#[test]
fn a_crashed_store_written_by_format_1_is_recovered_with_nothing_lost() {
    opens_with_nothing_lost("v1-crashed.redb");
}

/// A store closed cleanly by the build at 0d5ac10 (format 2: expiry slots
/// without the record's state).
#[test]
fn a_clean_store_written_by_format_2_opens_with_nothing_lost() {
    opens_with_nothing_lost("v2-clean.redb");
}

/// A store whose process exited without closing, written by the build at
/// 0d5ac10 (format 2): its log is replayed, then the store migrated.
#[test]
fn a_crashed_store_written_by_format_2_is_recovered_with_nothing_lost() {
    opens_with_nothing_lost("v2-crashed.redb");
}

/// A store closed cleanly by the build at 0016e50 (format 3: no expiry
/// counts).
#[test]
fn a_clean_store_written_by_format_3_opens_with_nothing_lost() {
    opens_with_nothing_lost("v3-clean.redb");
}

/// A store whose process exited without closing, written by the build at
/// 0016e50 (format 3): its log is replayed, then the expiry counts built.
#[test]
fn a_crashed_store_written_by_format_3_is_recovered_with_nothing_lost() {
    opens_with_nothing_lost("v3-crashed.redb");
}

/// A format 3 store gets its expiry counts at open: past retention, every
/// finished record is counted as awaiting eviction from them (and the one
/// in flight from its entry), a sweep evicts them all, and the counts
/// follow it down to nothing.
#[test]
fn a_format_3_store_counts_its_due_records_from_the_counts_built_at_open() {
    for name in ["v3-clean.redb", "v3-crashed.redb"] {
        let dir = TestDir::new();
        let path = copy_fixture(dir.dir.path(), name);
        let clock = ManualClock::new(T0_MS + 60_000);
        let store = Store::open_with(&path, config(&clock)).expect("open");
        all_due_then_swept(&store, &clock, name);
    }
}

/// Past retention (400 days on), every record of the fixture `name`'s
/// store awaits eviction, a sweep evicts them all, and the counts and
/// `verify` follow it down to nothing.
fn all_due_then_swept(store: &Store, clock: &ManualClock, name: &str) {
    clock.advance(Duration::from_secs(400 * 24 * 3600));
    let records = store.stats().expect("stats").records;
    assert_eq!(
        (records.expired, records.live()),
        (13, 0),
        "{name}: {records:?}"
    );
    assert_eq!(store.sweep(1_000).expect("sweep"), 13, "{name}");
    assert_eq!(store.len().expect("len"), 0, "{name}");
    assert_eq!(store.stats().expect("stats").records.total(), 0, "{name}");
    let report = store.verify(|_| {}).expect("verify");
    assert!(report.is_clean(), "{name}: {report:?}");
}

/// A migrated store has no entry left under its old format's slot (which
/// format 3 would read as long due), a leftover without a record included:
/// nothing is due at first; past
/// retention, every record awaits eviction, counted by the state its new
/// slot names, and a sweep evicts them all.
#[test]
fn a_migrated_store_counts_and_evicts_by_its_new_slots() {
    for name in ["v1-clean.redb", "v2-crashed.redb"] {
        let dir = TestDir::new();
        let path = copy_fixture(dir.dir.path(), name);
        // A leftover entry without a record, under a slot of the old
        // format (an hour after the fixtures' time): the migration must
        // not keep it, format 3 would read it as long due.
        {
            let expiry: redb::TableDefinition<(u64, &[u8]), ()> =
                redb::TableDefinition::new("expiry");
            let db = redb::Database::open(&path).expect("redb");
            let txn = db.begin_write().expect("write");
            txn.open_table(expiry)
                .expect("expiry")
                .insert((T0_MS + 3_600_000, &b"\x07fixtureghost"[..]), ())
                .expect("insert");
            txn.commit().expect("commit");
        }
        let clock = ManualClock::new(T0_MS + 60_000);
        let store = Store::open_with(&path, config(&clock)).expect("open");
        let records = store.stats().expect("stats").records;
        assert_eq!(
            (records.expired, records.live()),
            (0, 13),
            "{name}: {records:?}"
        );
        all_due_then_swept(&store, &clock, name);
    }
}
