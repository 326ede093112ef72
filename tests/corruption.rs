//! Corruption of the redb file is detected and reported, never turned into a
//! wrong answer or a panic (DESIGN.md guarantee 5).
//!
//! Two layers catch it: the record envelope's crc32 over key and body, which
//! every read checks ([`Error::CorruptRecord`] naming the key, other keys keep
//! working), and redb's page checksums, which the store verifies when an
//! open runs the full integrity check ([`Error::CorruptFile`] naming the
//! file).
//!
//! Every reopen of a damaged file here runs the check
//! (`integrity_check_interval(None)`, see [`checked`]): after a clean close
//! the default period would skip it, and these tests are about what the
//! check finds. When an open runs it, and what the period changes, is in
//! tests/integrity_on_open.rs.
//!
//! `IDEMSTORE_CORRUPTION_SAMPLES` raises the number of random offsets the
//! sampled test flips (default 60) and `IDEMSTORE_CORRUPTION_SEED` changes
//! its seed.

mod common;

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;

use idemstore::{ClaimOptions, ClaimOutcome, Config, Error, Key, Record, State, Store};

/// What `verify` must report for the tests' binding damage, one list for
/// both engines.
#[path = "../src/report/binding_damage.rs"]
mod binding_damage;

/// The result stored under [`victim`]: a byte string found nowhere else in
/// the file.
const MARKER: &[u8] = b"MARKER-5c0ffee-7d1e-a11c-result-of-the-victim";
const VICTIM_ID: &str = "victim-record";

fn victim() -> Key {
    key(VICTIM_ID)
}

/// A store with records in every state and the victim completed with
/// [`MARKER`]; returns every record as written.
fn populate(store: &Store) -> BTreeMap<Key, Record> {
    for i in 0..24 {
        let k = key(&format!("other-{i:02}"));
        let lease = acquired(store.claim(&k, &fp(k.id()), &lease_of(secs(600))).unwrap());
        let filler = "f".repeat(i * 37);
        match i % 3 {
            0 => {}
            1 => {
                store
                    .complete(&lease, format!("result-{i}-{filler}").as_bytes())
                    .unwrap();
            }
            _ => {
                store
                    .fail(&lease, format!("failure-{i}-{filler}").as_bytes(), false)
                    .unwrap();
            }
        }
    }
    let lease = acquired(
        store
            .claim(&victim(), &fp(VICTIM_ID), &lease_of(secs(600)))
            .unwrap(),
    );
    store.complete(&lease, MARKER).unwrap();
    let mut expected = BTreeMap::new();
    for i in 0..24 {
        let k = key(&format!("other-{i:02}"));
        expected.insert(k.clone(), store.get(&k).unwrap().unwrap());
    }
    expected.insert(victim(), store.get(&victim()).unwrap().unwrap());
    expected
}

/// Whether `err` reports damage (or a storage failure) rather than being an
/// answer about the input.
fn is_damage_report(err: &Error) -> bool {
    matches!(
        err,
        Error::CorruptRecord { .. }
            | Error::CorruptFile { .. }
            | Error::IncompatibleFile { .. }
            | Error::Storage(_)
            | Error::Poisoned { .. }
    )
}

/// What a store said about a damaged file.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone, Copy)]
enum Verdict {
    /// Every answer was the one written.
    Correct,
    /// The open failed with a damage report.
    OpenError,
    /// Some reads or writes failed with a damage report; every other answer
    /// was the one written.
    ReadError,
}

/// Numbers the fresh keys that [`interrogate`] claims.
static FRESH: AtomicUsize = AtomicUsize::new(0);

/// Asks the store everything it knows: `get` and `claim` of every key, and a
/// claim of a fresh key (whose fencing token must exceed every stored one).
/// `Err` describes a wrong answer.
fn interrogate(store: &Store, expected: &BTreeMap<Key, Record>) -> Result<Verdict, String> {
    let mut verdict = Verdict::Correct;
    let mut saw = |err: Error, what: &str| -> Result<(), String> {
        if is_damage_report(&err) {
            verdict = Verdict::ReadError;
            Ok(())
        } else {
            Err(format!("{what}: unexpected error {err:?}"))
        }
    };
    for (k, rec) in expected {
        match store.get(k) {
            Ok(Some(got)) if &got == rec => {}
            Ok(got) => return Err(format!("get {k}: {got:?}, written {rec:?}")),
            Err(err) => saw(err, &format!("get {k}"))?,
        }
        match store.claim(k, rec.fingerprint(), &lease_of(secs(600))) {
            Ok(ClaimOutcome::InProgress { lease_until_ms, .. })
                if rec.state() == State::Processing && lease_until_ms == rec.lease_until_ms() => {}
            Ok(ClaimOutcome::Replay(got)) if rec.state() != State::Processing && &got == rec => {}
            Ok(other) => return Err(format!("claim {k}: {other:?}, written {rec:?}")),
            Err(err) => saw(err, &format!("claim {k}"))?,
        }
    }
    let highest = expected.values().map(Record::token).max().unwrap_or(0);
    let fresh = key(&format!("fresh-{}", FRESH.fetch_add(1, Ordering::Relaxed)));
    match store.claim(&fresh, &fp("fresh"), &lease_of(secs(600))) {
        Ok(ClaimOutcome::Acquired(lease)) if lease.token() > highest => {}
        Ok(other) => {
            return Err(format!(
                "claim of a fresh key: {other:?}, tokens up to {highest}"
            ));
        }
        Err(err) => saw(err, "claim of a fresh key")?,
    }
    Ok(verdict)
}

/// `t`'s configuration with the full integrity check at every open, as
/// every open ran it before `Config::integrity_check_interval` existed.
fn checked(t: &TestDir) -> Config {
    t.config().integrity_check_interval(None)
}

/// Opens `t`'s file (running the full check) and interrogates it; panics
/// on a wrong answer.
fn open_and_interrogate(t: &TestDir, expected: &BTreeMap<Key, Record>) -> Result<Verdict, String> {
    let store = match Store::open_with(&t.path, checked(t)) {
        Ok(store) => store,
        Err(err) if is_damage_report(&err) => return Ok(Verdict::OpenError),
        Err(err) => return Err(format!("open: unexpected error {err:?}")),
    };
    interrogate(&store, expected)
}

/// A byte of a stored result, flipped in the closed file, is refused: the
/// open fails naming the file (redb's page checksum), instead of the store
/// replaying a damaged outcome.
#[test]
fn flipped_result_byte_in_a_closed_file_fails_the_open() {
    let t = TestDir::new();
    let store = t.open();
    populate(&store);
    drop(store);
    let bytes = std::fs::read(&t.path).unwrap();
    let at = find_all(&bytes, MARKER);
    assert_eq!(at.len(), 1, "the marker is written once");
    flip(&t.path, at[0] + 9, 0x01);

    match Store::open_with(&t.path, checked(&t)) {
        Err(Error::CorruptFile { path, .. }) => assert_eq!(path, t.path),
        Err(err) => panic!("expected CorruptFile, got {err:?}"),
        Ok(store) => panic!(
            "a damaged file opened; victim reads {:?}",
            store.get(&victim())
        ),
    }
}

/// A byte of a stored key, flipped in the closed file, is refused too. The
/// record checksum alone cannot catch this: a lookup of the original key no
/// longer finds the record, so without redb's page checksums the key would
/// read as absent and be acquired a second time.
#[test]
fn flipped_key_byte_in_a_closed_file_fails_the_open() {
    let t = TestDir::new();
    let store = t.open();
    let expected = populate(&store);
    drop(store);
    let bytes = std::fs::read(&t.path).unwrap();
    // The key is stored in the records table and in the expiry index.
    let at = find_all(&bytes, VICTIM_ID.as_bytes());
    assert!(!at.is_empty());
    for offset in &at {
        // 'v' → 'V': the damaged key is still a valid key.
        flip(&t.path, *offset, 0x20);
    }

    match open_and_interrogate(&t, &expected) {
        Ok(Verdict::OpenError) => {}
        Ok(verdict) => panic!("a file with a damaged key gave {verdict:?}"),
        Err(wrong) => panic!("wrong answer: {wrong}"),
    }
}

/// `check_file` on a file with a damaged page (the byte flips of the two
/// tests above, and one in the commit slot of redb's header, which makes
/// the open itself fail with "Primary is corrupted despite 2-phase
/// commit") reports the damage instead of failing, and writes nothing to
/// the file (redb's check marked it for repair): a report that is not
/// clean, whose integrity names what failed, and, for a file whose index
/// still reads, whose records were read from it, naming the victim, the
/// same at a second check.
#[test]
fn check_file_reports_a_damaged_page_as_damage() {
    for what in ["result", "key", "header"] {
        let t = TestDir::new();
        let store = t.open();
        populate(&store);
        drop(store);
        let bytes = std::fs::read(&t.path).unwrap();
        match what {
            "result" => flip(&t.path, find_all(&bytes, MARKER)[0] + 9, 0x01),
            "key" => {
                for offset in find_all(&bytes, VICTIM_ID.as_bytes()) {
                    flip(&t.path, offset, 0x20);
                }
            }
            // A byte of the primary commit slot of redb's header (the god
            // byte at offset 9 says which of the two 128-byte slots at 64
            // and 192 is primary).
            _ => flip(&t.path, 64 + 128 * usize::from(bytes[9] & 1) + 6, 0x10),
        }
        let damaged = std::fs::read(&t.path).unwrap();
        let report = match idemstore::check_file(&t.path, |_| {}) {
            Ok(report) => report,
            Err(err) => panic!("{what}: check_file failed instead of reporting: {err}"),
        };
        assert!(!report.is_clean(), "{what}: {report:?}");
        // Nothing of the damaged file changed: redb's check, which marks a
        // file it finds damaged for repair, ran over an overlay.
        assert!(
            std::fs::read(&t.path).unwrap() == damaged,
            "{what}: the check wrote to the damaged file"
        );
        match &report.integrity {
            idemstore::Integrity::Failed(detail) => {
                assert!(!detail.is_empty(), "{what}");
                if what == "header" {
                    assert!(detail.contains("does not open"), "{detail}");
                    assert!(detail.contains("Primary is corrupted"), "{detail}");
                }
            }
            other => panic!("{what}: {other:?}"),
        }
        // The records of the damaged page are still read, from the index
        // alone (the store is not opened over damaged pages), and the
        // damaged one is named; a file that does not open has none read.
        let named: Vec<_> = report
            .problems
            .iter()
            .filter(|p| p.key.to_ascii_lowercase().contains(VICTIM_ID))
            .collect();
        if what == "header" {
            assert!(!report.records_checked, "{report:?}");
            assert_eq!(report.records, 0);
        } else {
            assert!(report.records_checked, "{what}: {report:?}");
            assert!(
                !named.is_empty(),
                "{what}: the victim is not named: {report:?}"
            );
            // A second check reads the records again, and finds the same.
            let again = idemstore::check_file(&t.path, |_| {}).unwrap();
            assert_eq!(
                (again.records_checked, again.records, &again.problems),
                (true, report.records, &report.problems),
                "{what}: a second check differs"
            );
        }
    }
}

/// A store file older than its write-ahead log (an older copy of the file
/// put back beside the newer log, as a restore of the file alone does; or
/// redb falling back to its older commit slot when a byte of its header is
/// damaged) is refused by an open and reported by `check` as damage: its
/// last commit names an earlier epoch than the log's first frame, and the
/// changes committed since are in neither. (The older copy, closed
/// cleanly, opened without them, and `check` said clean: a completed key
/// read as absent, and its work would run again.)
#[test]
fn a_store_file_older_than_its_log_is_refused_not_opened_without_the_changes_since() {
    let t = TestDir::new();
    let complete = |store: &Store, id: &str| {
        let lease = acquired(
            store
                .claim(&key(id), &fp("p"), &ClaimOptions::new())
                .unwrap(),
        );
        store.complete(&lease, b"done").unwrap();
    };
    let store = t.open();
    complete(&store, "before-the-copy");
    drop(store);
    let older = std::fs::read(&t.path).unwrap();
    let store = t.open();
    complete(&store, "after-the-copy");
    drop(store);
    std::fs::write(&t.path, &older).unwrap();
    match Store::open_with(&t.path, checked(&t)) {
        Err(Error::CorruptFile { path, detail }) => {
            assert_eq!(path, t.path);
            assert!(
                detail.contains("older than its write-ahead log"),
                "{detail}"
            );
        }
        Ok(store) => panic!(
            "opened; after-the-copy reads {:?}",
            store
                .get(&key("after-the-copy"))
                .map(|r| r.map(|r| r.state()))
        ),
        Err(other) => panic!("expected CorruptFile, got {other}"),
    }
    let report = idemstore::check_file(&t.path, |_| {}).unwrap();
    assert!(!report.is_clean(), "{report:?}");
}

/// A salvage of a store file older than its log (the open refuses it:
/// above) reports the loss; its export's token counter is past a token
/// reservation beyond every token the store handed out after the copy, and
/// its clock mark is not behind the times they were handed out at: the lost
/// changes' tokens are never handed out again, and time does not run back.
/// (The counter was the older file's: 2, with tokens up to 51 handed out;
/// the clock was the older file's too.)
#[test]
fn a_salvage_of_a_store_file_older_than_its_log_stays_past_the_tokens_since() {
    let t = TestDir::new();
    let store = t.open();
    let first = acquired(
        store
            .claim(&key("before-the-copy"), &fp("p"), &ClaimOptions::new())
            .unwrap(),
    );
    store.complete(&first, b"done").unwrap();
    drop(store);
    let older = std::fs::read(&t.path).unwrap();
    // Later than the salvage's own clock (the host's) will read.
    t.clock.advance(Duration::from_secs(3600));
    let store = t.open();
    let mut handed_out = 0;
    for i in 0..50 {
        let lease = acquired(
            store
                .claim(&key(&format!("after-{i}")), &fp("p"), &ClaimOptions::new())
                .unwrap(),
        );
        handed_out = handed_out.max(lease.token());
        store.complete(&lease, b"done").unwrap();
    }
    let latest_ms = t.now_ms();
    drop(store);
    std::fs::write(&t.path, &older).unwrap();
    let mut out = Vec::new();
    let salvage = idemstore::salvage_file(&t.path, &mut out, |_| {}).unwrap();
    assert!(
        salvage
            .lost
            .as_deref()
            .is_some_and(|l| l.contains("older than its write-ahead log")),
        "{salvage:?}"
    );
    // A reservation (2^20 tokens) past them: tokens of frames lost past
    // the log's chain are skipped too.
    assert!(
        salvage.export.next_token > handed_out + (1 << 20),
        "the export's counter {} is not a reservation past token {handed_out}, handed out \
         after the copy",
        salvage.export.next_token
    );
    // The meta frame after the stream's 24-byte header: length, crc32,
    // kind, store id (16 bytes), token counter, clock mark.
    let clock_mark = u64::from_le_bytes(out[57..65].try_into().unwrap());
    assert!(
        clock_mark >= latest_ms,
        "the export's clock mark {clock_mark} is behind {latest_ms}, a time handed out after \
         the copy"
    );
}

/// A crash image (the store file and its log copied while the store ran)
/// with a damaged page: the records are read from the index as of its last
/// checkpoint, the damaged one named, and a problem says that the changes
/// since, in the write-ahead log, were not read.
#[test]
fn a_crash_image_with_a_damaged_page_names_the_record_and_the_unread_log() {
    let t = TestDir::new();
    let store = t.open();
    populate(&store);
    store.checkpoint().unwrap();
    let after = key("after-the-checkpoint");
    let lease = acquired(
        store
            .claim(&after, &fp("after"), &lease_of(secs(600)))
            .unwrap(),
    );
    store.complete(&lease, b"in the log only").unwrap();
    let image = t.dir.path().join("image.redb");
    std::fs::copy(&t.path, &image).unwrap();
    let mut log = t.path.as_os_str().to_owned();
    log.push("-wal");
    std::fs::copy(&log, t.dir.path().join("image.redb-wal")).unwrap();
    drop(store);
    let bytes = std::fs::read(&image).unwrap();
    flip(&image, find_all(&bytes, MARKER)[0] + 9, 0x01);
    let report = idemstore::check_file(&image, |_| {}).unwrap();
    assert!(
        matches!(report.integrity, idemstore::Integrity::Failed(_)),
        "{report:?}"
    );
    assert!(report.records_checked, "{report:?}");
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.key.to_ascii_lowercase().contains(VICTIM_ID)),
        "the victim is not named: {report:?}"
    );
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.key == idemstore::UNREAD_PROBLEM && p.detail.contains("write-ahead log")),
        "the unread log is not said: {report:?}"
    );
}

/// Damage that reaches a record while the store is open (redb verifies page
/// checksums only in its integrity check, which runs at open) is caught by the record checksum:
/// `get` and `claim` of that key fail with CorruptRecord naming it, and every
/// other key keeps working. After a reopen it is still reported, by redb's
/// page checksum or, if a later write rewrote the page, by the record's.
#[test]
fn record_damaged_while_open_is_corrupt_record_naming_the_key() {
    let t = TestDir::new();
    // No page cache and no read cache, so that every read goes to the file.
    let store = t.open_with(t.config().cache_bytes(0).read_cache_bytes(0));
    let expected = populate(&store);
    let bytes = std::fs::read(&t.path).unwrap();
    let at = find_all(&bytes, MARKER);
    assert_eq!(at.len(), 1, "the marker is written once");
    flip(&t.path, at[0] + 9, 0x01);

    let is_victim_corrupt = |r: Result<_, Error>| match r {
        Err(Error::CorruptRecord { key, .. }) => assert_eq!(key, victim().to_string()),
        other => panic!("expected CorruptRecord naming the victim, got {other:?}"),
    };
    is_victim_corrupt(store.get(&victim()).map(drop));
    is_victim_corrupt(
        store
            .claim(&victim(), &fp(VICTIM_ID), &lease_of(secs(600)))
            .map(drop),
    );

    let others: BTreeMap<Key, Record> = expected
        .iter()
        .filter(|(k, _)| **k != victim())
        .map(|(k, r)| (k.clone(), r.clone()))
        .collect();
    assert_eq!(interrogate(&store, &others), Ok(Verdict::Correct));
    // Writes to other keys still work (they may rewrite the damaged page).
    for i in 0..8 {
        let k = key(&format!("after-{i}"));
        let lease = acquired(store.claim(&k, &fp("after"), &lease_of(secs(600))).unwrap());
        store.complete(&lease, b"written after the damage").unwrap();
    }
    is_victim_corrupt(store.get(&victim()).map(drop));
    drop(store);

    match Store::open_with(&t.path, checked(&t)) {
        Err(Error::CorruptFile { path, .. }) => {
            assert_eq!(path, t.path);
            eprintln!("reopen refused by redb's page checksums");
        }
        Err(err) => panic!("expected CorruptFile, got {err:?}"),
        Ok(store) => {
            eprintln!("reopened; the record checksum still reports the victim");
            is_victim_corrupt(store.get(&victim()).map(drop));
            is_victim_corrupt(
                store
                    .claim(&victim(), &fp(VICTIM_ID), &lease_of(secs(600)))
                    .map(drop),
            );
            assert_eq!(interrogate(&store, &others), Ok(Verdict::Correct));
        }
    }
}

/// A key damaged while the store is open: the record now sits under a key
/// it was not written for, and the checksum over key and body reports it
/// under the damaged key. The original key reads as absent: the record
/// checksum cannot see a lookup that misses, and redb verifies page
/// checksums only in its integrity check (which, run at the reopen, refuses
/// it, unless a later write rewrote the page first).
#[test]
fn key_damaged_while_open_is_corrupt_record_and_refused_at_reopen() {
    let t = TestDir::new();
    let store = t.open_with(t.config().cache_bytes(0).read_cache_bytes(0));
    let expected = populate(&store);
    let bytes = std::fs::read(&t.path).unwrap();
    let at = find_all(&bytes, VICTIM_ID.as_bytes());
    assert!(!at.is_empty());
    // The victim's key sorts last, so changing its last byte upward keeps
    // the B-tree in order and a lookup of the damaged key finds the record.
    for offset in &at {
        flip(&t.path, offset + VICTIM_ID.len() - 1, 0x01); // 'd' → 'e'
    }
    let damaged = key("victim-recore");
    match store.get(&damaged) {
        Err(Error::CorruptRecord { key, .. }) => assert_eq!(key, damaged.to_string()),
        other => panic!("expected CorruptRecord naming {damaged}, got {other:?}"),
    }
    let others: BTreeMap<Key, Record> = expected
        .into_iter()
        .filter(|(k, _)| *k != victim())
        .collect();
    assert_eq!(interrogate(&store, &others), Ok(Verdict::Correct));
    drop(store);

    match Store::open_with(&t.path, checked(&t)) {
        Err(Error::CorruptFile { path, .. }) => assert_eq!(path, t.path),
        Err(err) => panic!("expected CorruptFile, got {err:?}"),
        // A later write rewrote the page, so redb's checksums cover the
        // damage: the record checksum still reports it.
        Ok(store) => match store.get(&damaged) {
            Err(Error::CorruptRecord { key, .. }) => assert_eq!(key, damaged.to_string()),
            other => panic!("expected CorruptRecord naming {damaged}, got {other:?}"),
        },
    }
}

/// Flipping a byte anywhere in the closed file (the header region of every
/// 4 KiB page, and a seeded sample of offsets) gives an error at open or at
/// read, or the unchanged correct answers: never a wrong answer, never a
/// panic out of the store.
#[test]
fn flipped_bytes_anywhere_never_give_a_wrong_answer() {
    let seed = seed_from_env("IDEMSTORE_CORRUPTION_SEED", 0x5eed_c0de);
    let samples = count_from_env("IDEMSTORE_CORRUPTION_SAMPLES", 60);
    let t = TestDir::new();
    let store = t.open();
    let expected = populate(&store);
    drop(store);
    let pristine = std::fs::read(&t.path).unwrap();
    // The pristine file answers correctly (this also checks the checker).
    assert_eq!(open_and_interrogate(&t, &expected), Ok(Verdict::Correct));
    std::fs::write(&t.path, &pristine).unwrap();

    let mut rng = Rng::new(seed);
    let mut offsets = Vec::new();
    for page in (0..pristine.len()).step_by(4096) {
        for _ in 0..3 {
            offsets.push(page + rng.below(64) as usize);
        }
    }
    for _ in 0..samples {
        offsets.push(rng.below(pristine.len() as u64) as usize);
    }

    let mut tally: BTreeMap<Verdict, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for &offset in &offsets {
        let mask = 1u8 << rng.below(8);
        let mut damaged = pristine.clone();
        damaged[offset] ^= mask;
        std::fs::write(&t.path, &damaged).unwrap();
        match catch_unwind(AssertUnwindSafe(|| open_and_interrogate(&t, &expected))) {
            Ok(Ok(verdict)) => *tally.entry(verdict).or_default() += 1,
            Ok(Err(wrong)) => failures.push(format!("offset {offset} mask {mask:#04x}: {wrong}")),
            Err(_) => failures.push(format!("offset {offset} mask {mask:#04x}: panicked")),
        }
    }
    assert!(
        failures.is_empty(),
        "seed {seed}, {} of {} flips went wrong:\n{}",
        failures.len(),
        offsets.len(),
        failures.join("\n")
    );
    // Some flips hit live pages: the test must have seen damage reported.
    assert!(
        tally.get(&Verdict::OpenError).copied().unwrap_or(0)
            + tally.get(&Verdict::ReadError).copied().unwrap_or(0)
            > 0,
        "no flip was detected: {tally:?}"
    );
    eprintln!("seed {seed}: {} flips: {tally:?}", offsets.len());
}

/// Moves the expiry count of the second and state code of a finished
/// entry's `slot` by `delta`, as `docs/design.md` (1.7) lays the
/// `expiry_counts` table out: what the store's writer does with each entry
/// it inserts or removes (an entry in flight is not counted).
fn move_expiry_count(txn: &redb::WriteTransaction, slot: u64, delta: i64) {
    use redb::ReadableTable;
    let counts: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("expiry_counts");
    if slot >> 63 == 1 {
        return;
    }
    let (second, code) = (((slot & !(1 << 63)) >> 2) / 1000, (slot & 3) as usize);
    let mut table = txn.open_table(counts).unwrap();
    let mut row = table
        .get(second)
        .unwrap()
        .map_or(vec![0u8; 32], |v| v.value().to_vec());
    let field = &mut row[code * 8..code * 8 + 8];
    let n = u64::from_le_bytes(field.try_into().unwrap());
    field.copy_from_slice(&n.checked_add_signed(delta).unwrap().to_le_bytes());
    table.insert(second, row.as_slice()).unwrap();
}

/// Edits the expiry index of the closed store file through redb directly:
/// removes the entry `(deadline, key)` of `remove`, inserts `orphan`, and
/// moves the expiry counts with them, as the store's writer would.
fn edit_expiry_index(path: &Path, remove: Option<&Record>, orphan: Option<(u64, &[u8])>) {
    let expiry: redb::TableDefinition<(u64, &[u8]), ()> = redb::TableDefinition::new("expiry");
    let db = redb::Database::open(path).unwrap();
    let txn = db.begin_write().unwrap();
    let mut moved = Vec::new();
    {
        let mut table = txn.open_table(expiry).unwrap();
        if let Some(rec) = remove {
            let (len, rest) = (rec.key().scope().len() as u8, rec.key());
            let stored = [&[len][..], rest.scope().as_bytes(), rest.id().as_bytes()].concat();
            // The slot as `docs/design.md` ("Format 3") lays it out.
            let (tag, code) = match rec.state() {
                State::Succeeded => (0, 0),
                State::Failed { retryable: false } => (0, 1),
                State::Failed { retryable: true } => (0, 2),
                State::Processing => (1 << 63, 3),
            };
            let deadline = tag | (rec.expires_ms() << 2) | code;
            assert!(
                table
                    .remove((deadline, stored.as_slice()))
                    .unwrap()
                    .is_some(),
                "the record's expiry entry was where verify looks for it"
            );
            moved.push((deadline, -1));
        }
        if let Some(entry) = orphan {
            table.insert(entry, ()).unwrap();
            moved.push((entry.0, 1));
        }
    }
    for (slot, delta) in moved {
        move_expiry_count(&txn, slot, delta);
    }
    txn.commit().unwrap();
}

/// `verify` reads the records and the expiry index each once, in their own
/// order, and compares them by digest: a record whose expiry entry is gone
/// is still named, and an entry without a record (harmless: eviction checks
/// the record) is not reported.
#[test]
fn verify_names_a_record_without_its_expiry_entry_and_ignores_an_orphan_entry() {
    let t = TestDir::new();
    let expected = {
        let store = Store::open_with(&t.path, t.config()).unwrap();
        populate(&store)
    };
    let verified = |t: &TestDir| {
        let store = Store::open_with(&t.path, checked(t)).unwrap();
        store.verify(|_| {}).unwrap()
    };
    let clean = verified(&t);
    assert!(clean.problems.is_empty(), "{:?}", clean.problems);
    assert_eq!(clean.records, expected.len() as u64);

    // An entry for a key that has no record, far in the future.
    edit_expiry_index(&t.path, None, Some((u64::MAX / 2, b"\x01sghost")));
    let orphan = verified(&t);
    assert!(orphan.problems.is_empty(), "{:?}", orphan.problems);

    // The victim's entry removed: exactly the victim is named.
    edit_expiry_index(&t.path, Some(&expected[&victim()]), None);
    let missing = verified(&t);
    assert_eq!(missing.problems.len(), 1, "{:?}", missing.problems);
    assert_eq!(missing.problems[0].key, victim().to_string());
    assert!(
        missing.problems[0].detail.contains("no expiry index entry"),
        "{}",
        missing.problems[0].detail
    );

    // The online scrub names it too, as a problem but not as damage: the
    // store keeps taking writes.
    let store = Store::open_with(&t.path, t.config()).unwrap();
    let scrubbed = store.scrub(1000).unwrap();
    assert!(scrubbed.pass_finished, "{scrubbed:?}");
    assert!(!scrubbed.damaged, "{scrubbed:?}");
    assert_eq!(scrubbed.records, expected.len() as u64);
    assert_eq!(scrubbed.problems.len(), 1, "{:?}", scrubbed.problems);
    assert_eq!(scrubbed.problems[0].key, victim().to_string());
    assert!(matches!(
        store.claim(&key("after-the-scrub"), &fp("a"), &lease_of(secs(60))),
        Ok(ClaimOutcome::Acquired(_))
    ));
}

/// A check of a store damaged throughout lists the first
/// `MAX_LISTED_PROBLEMS` problems, in key order, and counts every one, so
/// that its memory stays bounded: here every record's expiry entry is gone.
#[test]
fn verify_lists_at_most_max_listed_problems_and_counts_them_all() {
    use idemstore::MAX_LISTED_PROBLEMS;
    let t = TestDir::new();
    let total = MAX_LISTED_PROBLEMS + 25;
    {
        let store = Store::open_with(&t.path, t.config()).unwrap();
        let keys: Vec<_> = (0..total)
            .map(|i| (key(&format!("k-{i:06}")), fp("a")))
            .collect();
        for chunk in keys.chunks(idemstore::MAX_CLAIM_MANY) {
            let outcomes = store.claim_many(chunk, &lease_of(secs(600))).unwrap();
            assert!(
                outcomes
                    .iter()
                    .all(|o| matches!(o, Ok(ClaimOutcome::Acquired(_))))
            );
        }
    }
    // Every expiry entry removed, through redb directly.
    {
        let expiry: redb::TableDefinition<(u64, &[u8]), ()> = redb::TableDefinition::new("expiry");
        let db = redb::Database::open(&t.path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(expiry).unwrap();
            table.retain(|_, _| false).unwrap();
        }
        txn.commit().unwrap();
    }
    let store = Store::open_with(&t.path, checked(&t)).unwrap();
    let report = store.verify(|_| {}).unwrap();
    assert_eq!(report.records, total as u64);
    assert_eq!(report.problems_found, total as u64, "every record counted");
    assert_eq!(
        report.problems.len(),
        MAX_LISTED_PROBLEMS,
        "the first listed"
    );
    assert!(!report.is_clean());
    let listed: Vec<&str> = report.problems.iter().map(|p| p.key.as_str()).collect();
    let mut sorted = listed.clone();
    sorted.sort_unstable();
    assert_eq!(listed, sorted, "in key order");
    assert!(
        report
            .problems
            .iter()
            .all(|p| p.detail.contains("no expiry index entry")),
        "{:?}",
        report.problems.first()
    );
    // The check of the file says the same.
    drop(store);
    let checked_file = idemstore::check_file(&t.path, |_| {}).unwrap();
    assert_eq!(checked_file.problems_found, total as u64);
    assert_eq!(checked_file.problems.len(), MAX_LISTED_PROBLEMS);
}

/// A key's stored form (`[scope length] scope id`), and the stored form of
/// its scope's business key `bk` (`[scope length] scope bk`), as
/// `docs/design.md` lays them out.
fn stored_key(k: &Key) -> Vec<u8> {
    [
        &[k.scope().len() as u8][..],
        k.scope().as_bytes(),
        k.id().as_bytes(),
    ]
    .concat()
}

fn stored_binding(k: &Key, bk: &str) -> Vec<u8> {
    [
        &[k.scope().len() as u8][..],
        k.scope().as_bytes(),
        bk.as_bytes(),
    ]
    .concat()
}

/// Edits the business-key table of the closed store file through redb
/// directly: each `(binding, Some(key))` is written, each `(binding,
/// None)` removed.
fn edit_bindings(path: &Path, edits: &[(Vec<u8>, Option<Vec<u8>>)]) {
    let table: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("business_keys");
    let db = redb::Database::open(path).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(table).unwrap();
        for (binding, key) in edits {
            match key {
                Some(key) => {
                    table.insert(binding.as_slice(), key.as_slice()).unwrap();
                }
                None => assert!(
                    table.remove(binding.as_slice()).unwrap().is_some(),
                    "the binding was where verify looks for it"
                ),
            }
        }
    }
    txn.commit().unwrap();
}

/// `verify` checks the business-key bindings against the records: a live
/// record whose business key has no binding, or whose binding names
/// another key, is reported by its key; a binding that names a key with no
/// record, a record that does not carry it, or that does not parse, is
/// reported by its business key; a record past retention needs no
/// binding; each binding is counted. (PostgreSQL's check is held to the
/// same cases in `pg::tests`.)
#[test]
fn verify_reports_bindings_that_disagree_with_the_records() {
    let t = TestDir::new();
    let config = || checked(&t).retention(secs(60));
    let bk = |id: &str| format!("bk-{id}");
    {
        let store = Store::open_with(&t.path, config()).unwrap();
        let claim = |id: &str| {
            let options = ClaimOptions::new().business_key(bk(id));
            acquired(store.claim(&key(id), &fp("a"), &options).unwrap())
        };
        // Past retention before the others are made: its binding may go.
        store.complete(&claim("gone"), b"r").unwrap();
        t.clock.advance(secs(61));
        for id in ["held", "done", "unbound", "moved", "other"] {
            let lease = claim(id);
            if id == "done" {
                store.complete(&lease, b"r").unwrap();
            }
        }
        let report = store.verify(|_| {}).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!((report.records, report.bindings), (6, 6));
    }
    let binding = |id: &str| stored_binding(&key(id), &bk(id));
    edit_bindings(
        &t.path,
        &[
            (binding("gone"), None),
            (binding("unbound"), None),
            (binding("moved"), Some(stored_key(&key("other")))),
            (binding("orphan"), Some(stored_key(&key("orphan")))),
            (b"\x00\xff".to_vec(), Some(stored_key(&key("held")))),
        ],
    );
    let store = Store::open_with(&t.path, config()).unwrap();
    let report = store.verify(|_| {}).unwrap();
    assert_eq!((report.records, report.bindings), (6, 6), "{report:?}");
    let found = report
        .problems
        .iter()
        .map(|p| (p.key.clone(), p.detail.clone()))
        .collect();
    binding_damage::assert_reported(found, key("x").scope(), |id| key(id).to_string());
}
