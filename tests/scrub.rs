//! The online scrub (`Store::scrub`, `Config::scrub_rate`): a walk of the
//! open store's records in bounded steps that finds a page damaged after
//! the open, which redb's page checksums would find only at the next full
//! integrity check (README, "What it guarantees", point 5).
//!
//! Damage is made the way it happens: bytes of the store file flipped on
//! disk, with no page cache between the file and the store where the store
//! is open.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use idemstore::{ClaimOutcome, Config, Error, Integrity, MAX_SCRUB_RATE, Store, check_file};

/// A result found nowhere else in the file.
const MARKER: &[u8] = b"MARKER-scrub-5c0ffee-result-of-the-victim";

fn id(i: usize) -> String {
    format!("k-{i:05}")
}

/// `n` records, every third one left Processing, the others completed with
/// a result of 40 bytes; the record `victim` (if below `n`) completed with
/// [`MARKER`].
fn populate(store: &Store, n: usize, victim: Option<usize>) {
    for i in 0..n {
        let k = key(&id(i));
        let lease = acquired(store.claim(&k, &fp(k.id()), &lease_of(secs(600))).unwrap());
        if Some(i) == victim {
            store.complete(&lease, MARKER).unwrap();
        } else if i % 3 != 0 {
            store
                .complete(
                    &lease,
                    format!("result {i:05} {}", "r".repeat(28)).as_bytes(),
                )
                .unwrap();
        }
    }
}

/// Flips a byte of every copy of [`MARKER`] in the store file at `path`.
fn damage_the_marked_result(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let at = find_all(&bytes, MARKER);
    assert!(!at.is_empty());
    for offset in at {
        flip(path, offset + 3, 0x20);
    }
}

/// A fresh key's claim: `Err(Poisoned)` once the scrub found damage.
fn claim_fresh(store: &Store, n: usize) -> Result<ClaimOutcome, Error> {
    store.claim(
        &key(&format!("fresh-{n}")),
        &fp("fresh"),
        &lease_of(secs(60)),
    )
}

/// The records walked by each step of one pass in steps of `max`.
fn pass_steps(store: &Store, max: usize) -> Vec<u64> {
    let mut steps = Vec::new();
    loop {
        let step = store.scrub(max).unwrap();
        assert!(step.problems.is_empty(), "{:?}", step.problems);
        assert!(!step.damaged);
        steps.push(step.records);
        if step.pass_finished {
            return steps;
        }
        assert!(steps.len() < 10_000, "the pass never finished: {steps:?}");
    }
}

/// A pass walks every record once, in steps of at most the number asked
/// for; the step that reaches the last key says so (also when the count is
/// a multiple of the step), and the next step starts the next pass from
/// the first key. A sound store has nothing to report and keeps taking
/// writes.
#[test]
fn a_scrub_pass_walks_every_record_once_in_bounded_steps() {
    let t = TestDir::new();
    let store = t.open();
    // An empty store: one step ends the pass.
    assert_eq!(pass_steps(&store, 7), [0]);
    populate(&store, 49, None);
    assert_eq!(pass_steps(&store, 7), [7; 7]);
    acquired(
        store
            .claim(&key(&id(49)), &fp("k"), &lease_of(secs(60)))
            .unwrap(),
    );
    assert_eq!(pass_steps(&store, 7), [7, 7, 7, 7, 7, 7, 7, 1]);
    // 0 walks one record at a time; usize::MAX the whole store in one step.
    assert_eq!(pass_steps(&store, 0), [1; 50]);
    assert_eq!(pass_steps(&store, usize::MAX), [50]);
    // Keys written after a pass started, past its last key, are left to the
    // next pass: a pass ends even while keys keep arriving past its end.
    assert_eq!(store.scrub(20).unwrap().records, 20);
    for i in 0..10 {
        let k = key(&format!("later-{i}"));
        acquired(store.claim(&k, &fp("later"), &lease_of(secs(60))).unwrap());
    }
    let rest = store.scrub(1000).unwrap();
    assert_eq!((rest.records, rest.pass_finished), (30, true));
    assert_eq!(pass_steps(&store, 1000), [60]);
    assert!(matches!(
        claim_fresh(&store, 0),
        Ok(ClaimOutcome::Acquired(_))
    ));
}

/// A stored result damaged on disk while the store is open: the scrub
/// names the record, makes the store refuse writes (a fresh claim gets
/// `Poisoned`) and leaves the damage marker, so that the reopen is read-only
/// too; `check_file` finds redb's page checksum failing. (The records are
/// checkpointed first, so that the damaged page is the one on disk.)
#[test]
fn a_record_damaged_while_open_is_found_by_the_scrub_and_poisons_the_store() {
    let t = TestDir::new();
    let store = t.open_with(t.config().cache_bytes(0).read_cache_bytes(0));
    populate(&store, 30, Some(17));
    store.checkpoint().unwrap();
    damage_the_marked_result(&t.path);
    let report = store.scrub(1000).unwrap();
    assert!(report.damaged, "{report:?}");
    assert!(report.pass_finished);
    assert_eq!(report.records, 30);
    let named: Vec<&str> = report.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(named, [key(&id(17)).to_string()], "{:?}", report.problems);
    let marker = marker_of(&t.path);
    match claim_fresh(&store, 1) {
        // The refusal names the marker and what to do.
        Err(Error::Poisoned { cause }) => assert!(
            cause.contains(&marker.display().to_string()) && cause.contains("restore"),
            "{cause}"
        ),
        other => panic!("expected Poisoned, got {other:?}"),
    }
    drop(store);
    let text = std::fs::read_to_string(&marker).unwrap();
    assert!(text.contains(&key(&id(17)).to_string()), "{text}");
    // The close forgot the last verification: the reopen runs the full
    // check, which finds the page checksum failing.
    assert_refused_with_marker(&t);
    let checked = check_file(&t.path, |_| {}).unwrap();
    assert!(!checked.is_clean(), "{checked:?}");
    // Without the marker, an open that runs the full check refuses it.
    std::fs::remove_file(&marker).unwrap();
    match Store::open_with(&t.path, t.config().integrity_check_interval(None)) {
        Err(Error::CorruptFile { path, .. }) => assert_eq!(path, t.path),
        Err(other) => panic!("expected CorruptFile, got {other:?}"),
        Ok(_) => panic!("the integrity check did not refuse the file"),
    }
}

/// Damage that redb's page checksums do not see (a record rewritten with a
/// bad checksum, as a damaged page rewritten by a later write would be):
/// the reopen's integrity check passes, so only the marker keeps the store
/// from taking claims again. `check_file` names the record and the marker;
/// once the marker is removed, the store takes writes again.
#[test]
fn damage_with_valid_page_checksums_keeps_the_store_read_only_until_the_marker_is_removed() {
    let t = TestDir::new();
    drop({
        let store = t.open();
        populate(&store, 30, Some(17));
        store
    });
    damage_record(&t.path, &key(&id(17)));
    let store = t.open();
    let report = store.scrub(1000).unwrap();
    assert!(report.damaged, "{report:?}");
    assert!(matches!(
        claim_fresh(&store, 4),
        Err(Error::Poisoned { .. })
    ));
    drop(store);
    assert_read_only_by_marker(&t);
    let checked = check_file(&t.path, |_| {}).unwrap();
    assert_eq!(checked.integrity, Integrity::Clean);
    let named: Vec<&str> = checked.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        named,
        [key(&id(17)).to_string().as_str(), "(damage marker)"],
        "{:?}",
        checked.problems
    );
    // The operator's decision: the file takes writes again, and the damaged
    // record is refused as on every read.
    std::fs::remove_file(marker_of(&t.path)).unwrap();
    let store = t.open();
    assert!(matches!(
        claim_fresh(&store, 5),
        Ok(ClaimOutcome::Acquired(_))
    ));
    assert!(matches!(
        store.get(&key(&id(17))),
        Err(Error::CorruptRecord { .. })
    ));
}

/// The marker's temporary name, left by a crash during its write, counts
/// as the marker; a marker beside a store file that does not exist (the
/// damaged file moved away) is set aside when a new store is created
/// there, which then takes writes, also after a reopen.
#[test]
fn a_leftover_marker_write_counts_and_a_new_store_ignores_a_stale_marker() {
    let t = TestDir::new();
    drop({
        let store = t.open();
        populate(&store, 3, None);
        store
    });
    let mut temp = marker_of(&t.path).into_os_string();
    temp.push(".tmp");
    std::fs::write(&temp, "partial").unwrap();
    let store = t.open();
    assert!(matches!(
        claim_fresh(&store, 6),
        Err(Error::Poisoned { .. })
    ));
    drop(store);
    std::fs::remove_file(&temp).unwrap();
    std::fs::write(marker_of(&t.path), "stale").unwrap();
    std::fs::remove_file(&t.path).unwrap();
    let _ = std::fs::remove_file(t.dir.path().join("idem.redb-wal"));
    let store = t.open();
    assert!(matches!(
        claim_fresh(&store, 7),
        Ok(ClaimOutcome::Acquired(_))
    ));
    drop(store);
    // Set aside, not deleted: what it said is kept for the operator.
    assert!(!marker_of(&t.path).exists());
    let aside: Vec<_> = std::fs::read_dir(t.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("-damaged.before-"))
        .collect();
    assert_eq!(aside.len(), 1);
    let store = t.open();
    assert!(matches!(
        claim_fresh(&store, 8),
        Ok(ClaimOutcome::Acquired(_))
    ));
}

fn marker_of(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-damaged");
    name.into()
}

/// The open of `t`'s store succeeds read-only: a fresh claim gets
/// `Poisoned`, reads and an export still run (for the restore), and
/// `check_file` reports the marker.
fn assert_read_only_by_marker(t: &TestDir) {
    let store = t.open();
    assert!(matches!(
        claim_fresh(&store, 99),
        Err(Error::Poisoned { .. })
    ));
    assert!(store.get(&key(&id(0))).is_ok());
    // Not refused for the marker; a damaged record itself stops an export
    // (it cannot be exported faithfully), as on any store.
    match store.export(&mut Vec::new(), |_| {}) {
        Ok(summary) => assert!(summary.records > 0, "{summary:?}"),
        Err(Error::CorruptRecord { .. }) => {}
        Err(other) => panic!("the export of a marked store failed: {other:?}"),
    }
    drop(store);
    let checked = check_file(&t.path, |_| {}).unwrap();
    assert!(
        checked.problems.iter().any(|p| p.key == "(damage marker)"),
        "{:?}",
        checked.problems
    );
}

/// The open of `t`'s store, whose last close forgot its verification
/// because the scrub found it damaged, runs the full check, which refuses
/// the file (its page checksums fail); `check_file` reports the marker.
fn assert_refused_with_marker(t: &TestDir) {
    match Store::open_with(&t.path, t.config()) {
        Err(Error::CorruptFile { .. }) => {}
        Err(other) => panic!("expected CorruptFile, got {other:?}"),
        Ok(_) => panic!("a store found damaged opened without the full check"),
    }
    let checked = check_file(&t.path, |_| {}).unwrap();
    assert!(
        checked.problems.iter().any(|p| p.key == "(damage marker)"),
        "{:?}",
        checked.problems
    );
}

/// A flipped byte in a separator key of a B-tree branch page, in a closed
/// file whose clean reopen skips the full check (verified recently): a
/// lookup of a stored key misses, so the key reads as absent and a claim
/// would run its work a second time. The walk still finds the record, and
/// the scrub names every key whose lookup misses, and poisons the store
/// before such a claim.
#[test]
fn a_branch_page_damaged_on_disk_is_found_by_the_scrub_before_a_second_claim() {
    let t = TestDir::new();
    let n = 3000;
    {
        let store = t.open();
        populate(&store, n, None);
    }
    // A clean open that runs no check: the last one is recent.
    drop(t.open());
    damage_branch_pages(&t.path);
    let store = t.open();
    let hidden: Vec<String> = (0..n)
        .filter(|&i| matches!(store.get(&key(&id(i))), Ok(None)))
        .map(|i| key(&id(i)).to_string())
        .collect();
    assert!(!hidden.is_empty(), "the damage hid no key from lookups");
    // `verify` (and so `idemstore check`) looks each record up too.
    let verified = store.verify(|_| {}).unwrap();
    let reported: Vec<&str> = verified.problems.iter().map(|p| p.key.as_str()).collect();
    for k in &hidden {
        assert!(reported.contains(&k.as_str()), "verify did not name {k}");
    }
    let mut named = Vec::new();
    let mut damaged = false;
    let mut walked = 0;
    loop {
        // Steps small enough that no step reaches the cap of 100 problems
        // (a record can have two).
        let step = store.scrub(40).unwrap();
        walked += step.records;
        damaged |= step.damaged;
        named.extend(step.problems.into_iter().map(|p| p.key));
        if step.pass_finished {
            break;
        }
    }
    assert_eq!(walked, n as u64);
    assert!(damaged);
    for k in &hidden {
        assert!(
            named.contains(k),
            "{k} reads as absent but the scrub did not name it"
        );
    }
    // A claim of a hidden key is refused, not acquired a second time.
    let hidden_key = key(hidden[0].trim_start_matches(&format!("{SCOPE}/")));
    assert!(matches!(
        store.claim(&hidden_key, &fp(hidden_key.id()), &lease_of(secs(60))),
        Err(Error::Poisoned { .. })
    ));
    // Nor is it answered as absent: on a store found damaged an absence is
    // not an answer. A key that is found is still read.
    assert!(
        matches!(store.get(&hidden_key), Err(Error::CorruptFile { .. })),
        "{:?}",
        store.get(&hidden_key)
    );
    let found = (0..n)
        .map(|i| key(&id(i)))
        .find(|k| !hidden.contains(&k.to_string()))
        .unwrap();
    assert!(store.get(&found).unwrap().is_some());
    drop(store);
    assert_refused_with_marker(&t);
}

/// A stored key damaged on disk so that it sorts past every other key (the
/// first byte of its id flipped, in a closed file whose clean reopen runs
/// no check): the walk meets it before the pass's last key, and reports it
/// (its lookup misses; had it not, the last key, still stored, not met
/// first), which poisons the store before a claim of a key the damage
/// hides. (The walk's range ended at the pass's
/// last key: it stopped at the damaged key, and the pass finished having
/// walked half the records and found nothing, every pass alike.)
#[test]
fn a_key_damaged_to_sort_past_the_last_is_found_by_the_scrub() {
    let (t, victim) = moved_past_the_last(300);
    let store = t.open();
    let (damaged, named) = pass_problems(&store, usize::MAX);
    assert!(damaged, "the pass found nothing: {named:?}");
    assert!(
        named.iter().any(|d| d.contains("past the last key")),
        "{named:?}"
    );
    assert!(matches!(
        store.claim(&key(&victim), &fp(&victim), &lease_of(secs(60))),
        Err(Error::Poisoned { .. })
    ));
}

/// The same damage, with the pass's last key released while the pass runs
/// (its steps of 100 records end before the damaged key): the key past the
/// last one can no longer be told from a key stored since by the last key's
/// presence, and is told by its lookup, which misses. (Taken for a key
/// stored since, it ended the pass with nothing found.)
#[test]
fn a_key_damaged_past_the_last_is_found_when_the_last_is_gone() {
    // The last key, k-00300, stays in flight (every third record does).
    let n = 301;
    let (t, _) = moved_past_the_last(n);
    let store = t.open();
    let first = store.scrub(100).unwrap();
    assert!(
        !first.pass_finished && !first.damaged,
        "{:?}",
        first.problems
    );
    // The last key's lease lapses; a takeover releases it, so it is gone.
    t.clock.advance(secs(601));
    let last = key(&id(n - 1));
    let taken = acquired(
        store
            .claim(&last, &fp(last.id()), &lease_of(secs(60)))
            .unwrap(),
    );
    store.release(taken).unwrap();
    assert!(store.get(&last).unwrap().is_none());
    let (damaged, named) = pass_problems(&store, 100);
    assert!(damaged, "the pass found nothing: {named:?}");
    assert!(
        named.iter().any(|d| d.contains("does not find its record")),
        "{named:?}"
    );
}

/// A closed store of `n` records (see [`populate`]) whose record `k-00150`
/// has the first byte of its stored id flipped on disk ('k' becomes '{'),
/// so that it sorts past every other key; the store's last open was clean
/// and recent, so the next one runs no check. Returns the victim's id.
fn moved_past_the_last(n: usize) -> (TestDir, String) {
    let t = TestDir::new();
    {
        let store = t.open();
        populate(&store, n, None);
    }
    drop(t.open());
    let victim = id(150);
    let bytes = std::fs::read(&t.path).unwrap();
    let at = find_all(&bytes, victim.as_bytes());
    assert!(!at.is_empty());
    for offset in at {
        flip(&t.path, offset, 0x10);
    }
    (t, victim)
}

/// Scrub steps of `max` records to the end of the pass under way: whether
/// any found damage, and the details of the problems found.
fn pass_problems(store: &Store, max: usize) -> (bool, Vec<String>) {
    let mut damaged = false;
    let mut named = Vec::new();
    loop {
        let step = store.scrub(max).unwrap();
        damaged |= step.damaged;
        named.extend(step.problems.into_iter().map(|p| p.detail));
        if step.pass_finished {
            return (damaged, named);
        }
    }
}

/// Flips a bit in every stored id on a branch page of the closed store
/// file at `path` (redb's page type 2, 4 KiB pages) whose last digit is
/// odd: clearing its lowest bit makes the separator sort lower, which
/// routes a lookup of the keys between the two versions to the wrong
/// child. Panics when it found no such id.
fn damage_branch_pages(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let mut flipped = 0;
    for page in bytes.chunks(4096).enumerate().filter(|(_, p)| p[0] == 2) {
        let (number, page) = page;
        for at in find_all(page, b"k-") {
            let Some(digits) = page.get(at + 2..at + 7) else {
                continue;
            };
            if digits.iter().all(u8::is_ascii_digit) && digits[4] % 2 == 1 {
                flip(path, number * 4096 + at + 6, 0x01);
                flipped += 1;
            }
        }
    }
    assert!(flipped > 0, "no separator key found on a branch page");
}

/// Runs scrub steps of 40 records over one whole pass; whether any step
/// found damage.
fn scrub_pass(store: &Store) -> bool {
    let mut damaged = false;
    loop {
        let step = store.scrub(40).unwrap();
        damaged |= step.damaged;
        if step.pass_finished {
            return damaged;
        }
    }
}

/// A store the scrub found damaged is never closed as clean: every later
/// open runs the full integrity check, whatever path names the file (here
/// a symlink in another directory and a relative path, neither of which
/// spells the path the marker was written beside), and the marker is found
/// through each of them. Branch-page damage on disk: the full check
/// refuses the file, so a hidden key is never acquired a second time.
#[test]
fn a_store_found_damaged_is_checked_at_every_later_open_by_any_path() {
    let t = TestDir::new();
    {
        let store = t.open();
        populate(&store, 3000, None);
    }
    // A clean open that runs no check: the last one is recent.
    drop(t.open());
    damage_branch_pages(&t.path);
    let store = t.open();
    assert!(scrub_pass(&store), "the scrub found no damage");
    drop(store);
    let other = tempfile::tempdir().unwrap();
    let link = other.path().join("through-a-link.redb");
    std::os::unix::fs::symlink(&t.path, &link).unwrap();
    let refused = |path: &Path| match Store::open_with(path, t.config()) {
        Err(Error::CorruptFile { .. }) => {}
        Err(other) => panic!("{}: expected CorruptFile, got {other:?}", path.display()),
        Ok(_) => panic!("{}: opened without the full check", path.display()),
    };
    refused(&link);
    // Without the marker too: the close forgot the last verification.
    let marker = marker_of(&t.path);
    assert!(marker.exists());
    std::fs::remove_file(&marker).unwrap();
    refused(&link);
    refused(&t.path);
}

/// A store of 30 records whose record 17 was damaged on disk with page
/// checksums that pass (so that only the marker keeps it read-only), open,
/// and found damaged by a scrub step.
fn found_damaged_with_valid_checksums() -> (TestDir, Store) {
    let t = TestDir::new();
    drop({
        let store = t.open();
        populate(&store, 30, Some(17));
        store
    });
    damage_record(&t.path, &key(&id(17)));
    let store = t.open();
    assert!(store.scrub(1000).unwrap().damaged);
    (t, store)
}

/// The damage marker belongs to the file, not to the spelling of its path:
/// a store found damaged (with page checksums that pass, so that only the
/// marker keeps it read-only) opens read-only through a symlink and through
/// a path relative to another directory.
#[test]
fn the_damage_marker_is_found_through_a_symlink_and_a_relative_path() {
    let (t, store) = found_damaged_with_valid_checksums();
    drop(store);
    let other = tempfile::tempdir().unwrap();
    let link = other.path().join("link.redb");
    std::os::unix::fs::symlink(&t.path, &link).unwrap();
    let dir_link = other.path().join("dir");
    std::os::unix::fs::symlink(t.dir.path(), &dir_link).unwrap();
    for path in [link, dir_link.join("idem.redb")] {
        let store = Store::open_with(&path, t.config()).unwrap();
        assert!(
            matches!(claim_fresh(&store, 9), Err(Error::Poisoned { .. })),
            "{} took a claim",
            path.display()
        );
    }
    // A relative path from the store's directory's parent: the working
    // directory of this test process is not changed (tests run in
    // parallel); the path is spelled through `..` instead.
    let dotted = t
        .dir
        .path()
        .join("..")
        .join(t.dir.path().file_name().unwrap())
        .join("idem.redb");
    let store = Store::open_with(&dotted, t.config()).unwrap();
    match claim_fresh(&store, 10) {
        // Opened with its marker: the refusal names the marker and says
        // to restore (a reopen would not help).
        Err(Error::Poisoned { cause }) => {
            assert!(
                cause.contains("-damaged") && cause.contains("restore"),
                "{cause}"
            );
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
}

/// A hard link is another name of the same file, from which no canonical
/// path leads to the marker: the store names its marker itself, so a store
/// found damaged (with page checksums that pass, so that only the marker
/// keeps it read-only) opens read-only through a hard link in another
/// directory too, and `check_file` reports the marker there. Once the
/// marker is removed, the store takes claims again by every name.
#[test]
fn the_damage_marker_is_found_through_a_hard_link() {
    let (t, store) = found_damaged_with_valid_checksums();
    // The scrub's own checkpoint runs; one asked by the caller is refused.
    assert!(matches!(store.checkpoint(), Err(Error::Poisoned { .. })));
    drop(store);
    let other = tempfile::tempdir().unwrap();
    let link = other.path().join("hard.redb");
    std::fs::hard_link(&t.path, &link).unwrap();
    let store = Store::open_with(&link, t.config()).unwrap();
    assert!(matches!(
        claim_fresh(&store, 11),
        Err(Error::Poisoned { .. })
    ));
    assert!(store.get(&key(&id(0))).unwrap().is_some());
    drop(store);
    let checked = check_file(&link, |_| {}).unwrap();
    let marker = marker_of(&std::fs::canonicalize(&t.path).unwrap());
    assert!(
        checked
            .problems
            .iter()
            .any(|p| p.key == "(damage marker)" && p.detail.contains(&*marker.to_string_lossy())),
        "{:?}",
        checked.problems
    );
    std::fs::remove_file(&marker).unwrap();
    let store = Store::open_with(&link, t.config()).unwrap();
    assert!(matches!(
        claim_fresh(&store, 12),
        Ok(ClaimOutcome::Acquired(_))
    ));
}

/// With `scrub_rate` set, the store's background thread finds damage
/// without being asked (no background sweeper configured): the store is
/// poisoned within a few passes.
#[test]
fn the_background_scrub_finds_damage_without_being_asked() {
    let t = TestDir::new();
    let store = t.open_with(
        t.config()
            .cache_bytes(0)
            .read_cache_bytes(0)
            .scrub_rate(Some(1000)),
    );
    populate(&store, 30, Some(5));
    assert!(matches!(
        claim_fresh(&store, 2),
        Ok(ClaimOutcome::Acquired(_))
    ));
    store.checkpoint().unwrap();
    damage_the_marked_result(&t.path);
    // A liveness bound, not a timing figure: a pass of 30 records runs
    // every second.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut n = 3;
    loop {
        match claim_fresh(&store, n) {
            Err(Error::Poisoned { .. }) => break,
            Ok(ClaimOutcome::Acquired(_)) => {}
            other => panic!("unexpected answer {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the background scrub never found the damage"
        );
        n += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The background scrub keeps its pace while a sweep lasts: records come
/// due faster than a sweep of one-record slices evicts them (two threads of
/// churn, retention 50 ms), so the sweep never ends, and a record in flight
/// damaged on disk meanwhile is found while the churn goes on. (The sweep ran on
/// the scrub's thread until nothing was due: the scrub stopped for as long
/// as records kept coming due, and the store kept taking writes over the
/// damage.)
#[test]
fn the_background_scrub_keeps_its_pace_during_a_sweep_that_lasts() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let t = TestDir::new();
    let store = Arc::new(
        t.open_with(
            t.config()
                .cache_bytes(0)
                .read_cache_bytes(0)
                .retention(Duration::from_millis(50))
                .sweep_interval(Some(Duration::from_secs(1)))
                .sweep_batch(1)
                .scrub_rate(Some(100_000)),
        ),
    );
    // The victim stays in flight (a finished record would be evicted),
    // its recovery point the bytes damaged below.
    // Scopes apart, so that the churn's inserts and evictions rewrite no
    // page of the victim's (which would write its damaged bytes over, or
    // read them first and refuse writes before the scrub comes by): pages
    // of records in flight that never change lie between the two, so that
    // no leaf holds both a churn key and the victim, and none is a
    // neighbour the churn's splits and merges touch.
    for i in 0..64 {
        let pad = acquired(
            store
                .claim(
                    &key_in("mm/pad", &format!("{i}")),
                    &fp("pad"),
                    &lease_of(secs(7200)),
                )
                .unwrap(),
        );
        store.set_recovery_point(&pad, &[b'p'; 1024]).unwrap();
    }
    let victim = key_in("zz/victim", "v");
    let held = acquired(
        store
            .claim(&victim, &fp("victim"), &lease_of(secs(7200)))
            .unwrap(),
    );
    store.set_recovery_point(&held, MARKER).unwrap();
    store.checkpoint().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churn: Vec<_> = (0..2)
        .map(|thread| {
            let (store, stop, clock) = (store.clone(), stop.clone(), t.clock.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let k = key_in("aa/churn", &format!("{thread}-{i}"));
                    i += 1;
                    let Ok(ClaimOutcome::Acquired(lease)) =
                        store.claim(&k, &fp("c"), &lease_of(secs(30)))
                    else {
                        break;
                    };
                    if store.complete(&lease, b"c").is_err() {
                        break;
                    }
                    clock.advance(Duration::from_millis(1));
                }
            })
        })
        .collect();
    // The first sweep starts a second after the open, and lasts.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        churn.iter().all(|h| !h.is_finished()),
        "the churn ended before the damage was made"
    );
    damage_the_marked_result(&t.path);
    // A liveness bound, not a timing figure: a scrub step runs every
    // second.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !marker_of(&t.path).exists() {
        assert!(
            Instant::now() < deadline,
            "the background scrub never found the damage while records kept coming due"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    for handle in churn {
        handle.join().unwrap();
    }
}

/// A rate of zero or over the limit is refused at open, naming the
/// setting, and creates nothing; `None` and the limit itself are accepted.
#[test]
fn a_scrub_rate_out_of_range_is_refused_at_open() {
    let t = TestDir::new();
    for rate in [0, MAX_SCRUB_RATE + 1, u32::MAX] {
        match Store::open_with(&t.path, t.config().scrub_rate(Some(rate))) {
            Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "scrub_rate"),
            Err(other) => panic!("rate {rate}: expected InvalidArgument, got {other:?}"),
            Ok(_) => panic!("rate {rate} was accepted"),
        }
        assert!(!t.path.exists());
    }
    drop(t.open_with(t.config().scrub_rate(Some(MAX_SCRUB_RATE))));
    drop(t.open_with(Config::new().sweep_interval(None).scrub_rate(None)));
}

/// The scrub is the embedded engine's: a PostgreSQL store refuses a rate
/// other than the default before connecting (the server checks its own
/// pages), naming the setting; `None` (no scrub) passes the check, and the
/// connection to a port nobody listens on then fails.
#[cfg(feature = "postgres")]
#[test]
fn a_postgres_store_refuses_a_scrub_rate() {
    let url = "postgresql://127.0.0.1:9/none?connect_timeout=2";
    match Store::connect(url, Config::new().scrub_rate(Some(5))) {
        Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "scrub_rate"),
        Err(other) => panic!("expected InvalidArgument, got {other:?}"),
        Ok(_) => panic!("a scrub rate was accepted"),
    }
    match Store::connect(url, Config::new().scrub_rate(None)) {
        Err(Error::InvalidArgument { what, .. }) => panic!("{what} refused"),
        Err(_) => {}
        Ok(_) => panic!("connected to port 9"),
    }
}
