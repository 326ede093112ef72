//! Export and import: round trip, idempotence, damaged streams, and the
//! token counter and clock raised above everything imported.

use std::path::Path;
use std::time::Duration;

use idemstore::{
    ClaimOptions, ClaimOutcome, Config, Error, Filter, Fingerprint, Key, Lease, ManualClock,
    Record, State, Store,
};

mod common;
use common::{RawRecord, export_stream};

const T0: u64 = 1_704_067_200_000;

fn open(path: &Path, clock: &ManualClock) -> Store {
    Store::open_with(
        path,
        Config::new()
            .clock(clock.clone())
            .retention(Duration::from_secs(3600))
            .lease(Duration::from_secs(10))
            .sweep_interval(None),
    )
    .unwrap()
}

fn key(id: &str) -> Key {
    Key::new("acme/tickets", id).unwrap()
}

fn acquire(store: &Store, k: &Key, opts: &ClaimOptions) -> Lease {
    match store
        .claim(k, &Fingerprint::of(k.id().as_bytes()), opts)
        .unwrap()
    {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("{other:?}"),
    }
}

fn all(store: &Store) -> Vec<Record> {
    store
        .scan(&Filter::new())
        .unwrap()
        .collect::<idemstore::Result<_>>()
        .unwrap()
}

/// A store with one record in every state, a recovery point and a
/// business key. Returns the export of it.
fn populated(path: &Path, clock: &ManualClock) -> (Vec<Record>, Vec<u8>) {
    let store = open(path, clock);
    let l = acquire(
        &store,
        &key("done"),
        &ClaimOptions::new().business_key("T-1"),
    );
    store.complete(&l, b"ticket T-1").unwrap();
    let l = acquire(&store, &key("failed"), &ClaimOptions::new());
    store.fail(&l, b"declined", false).unwrap();
    let l = acquire(&store, &key("retry"), &ClaimOptions::new());
    store.fail(&l, b"timeout", true).unwrap();
    let l = acquire(&store, &key("running"), &ClaimOptions::new());
    store.set_recovery_point(&l, b"step-2").unwrap();
    let records = all(&store);
    assert_eq!(records.len(), 4);
    let mut out = Vec::new();
    let summary = store.export(&mut out, |_| {}).unwrap();
    assert_eq!(summary.records, 4);
    assert_eq!(summary.bytes, out.len() as u64);
    (records, out)
}

#[test]
fn export_then_import_restores_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let (records, stream) = populated(&dir.path().join("a.redb"), &clock);

    let b_path = dir.path().join("b.redb");
    let b = open(&b_path, &clock);
    let mut seen = Vec::new();
    let summary = b
        .import(stream.as_slice(), |p| seen.push(p.records))
        .unwrap();
    assert_eq!(
        (summary.records, summary.imported, summary.present),
        (4, 4, 0)
    );
    assert_eq!(seen, vec![1, 2, 3, 4]);
    assert_eq!(all(&b), records);
    // The restored store behaves as the original: replay, business key,
    // the in-flight record with its recovery point, retryable failure.
    match b
        .claim(
            &key("done"),
            &Fingerprint::of(b"done"),
            &ClaimOptions::new(),
        )
        .unwrap()
    {
        ClaimOutcome::Replay(r) => assert_eq!(r.result(), Some(&b"ticket T-1"[..])),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        b.claim(
            &key("other"),
            &Fingerprint::of(b"x"),
            &ClaimOptions::new().business_key("T-1")
        ),
        Err(Error::BusinessKeyConflict { .. })
    ));
    clock.advance(Duration::from_secs(11));
    let taken = acquire(&b, &key("running"), &ClaimOptions::new());
    assert_eq!(taken.recovery_point(), Some(&b"step-2"[..]));
    assert!(taken.is_takeover());
    let report = b.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    drop(b);
    // And it is durable.
    let b = open(&b_path, &clock);
    assert_eq!(b.len().unwrap(), 4);
}

#[test]
fn import_is_idempotent_and_never_overwrites_a_live_record() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let a_path = dir.path().join("a.redb");
    let (_, stream) = populated(&a_path, &clock);
    let b = open(&dir.path().join("b.redb"), &clock);
    b.import(stream.as_slice(), |_| {}).unwrap();
    let before = all(&b);
    let again = b.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!((again.imported, again.present), (0, 4));
    assert_eq!(all(&b), before);

    // A record that moved on since the export is kept as it is now.
    let a = open(&a_path, &clock);
    clock.advance(Duration::from_secs(11));
    let l = acquire(&a, &key("running"), &ClaimOptions::new());
    let now = a.complete(&l, b"finished later").unwrap();
    let summary = a.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!(summary.present, 4);
    assert_eq!(a.get(&key("running")).unwrap().unwrap(), now);
}

#[test]
fn import_skips_expired_records_and_taken_business_keys() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let (_, stream) = populated(&dir.path().join("a.redb"), &clock);
    let b = open(&dir.path().join("b.redb"), &clock);
    // In the target, another key already holds business key T-1.
    acquire(&b, &key("mine"), &ClaimOptions::new().business_key("T-1"));
    let summary = b.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!((summary.imported, summary.business_key_taken), (3, 1));
    assert!(b.get(&key("done")).unwrap().is_none());

    let c = open(&dir.path().join("c.redb"), &clock);
    clock.advance(Duration::from_secs(3601));
    let summary = c.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!((summary.imported, summary.expired), (0, 4));
    assert!(c.is_empty().unwrap());
}

#[test]
fn import_raises_the_token_counter_above_everything_it_imports() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let a = open(&dir.path().join("a.redb"), &clock);
    let kept = acquire(&a, &key("kept"), &ClaimOptions::new());
    a.complete(&kept, b"ok").unwrap();
    // Tokens handed out and then released leave no record, but the export
    // still carries the counter.
    for i in 0..20 {
        let l = acquire(&a, &key(&format!("gone-{i}")), &ClaimOptions::new());
        a.release(l).unwrap();
    }
    let last = acquire(&a, &key("last"), &ClaimOptions::new());
    let highest = last.token();
    let mut stream = Vec::new();
    let exported = a.export(&mut stream, |_| {}).unwrap();
    assert_eq!(exported.next_token, highest + 1);

    let b_path = dir.path().join("b.redb");
    let b = open(&b_path, &clock);
    let summary = b.import(stream.as_slice(), |_| {}).unwrap();
    // Raised by the clock too: the store's time in ms × 1,024.
    assert_eq!(summary.next_token, (highest + 1).max(T0 * 1024));
    let fresh = acquire(&b, &key("fresh"), &ClaimOptions::new());
    assert!(fresh.token() > highest, "{} <= {highest}", fresh.token());
    drop(b);
    // The counter is durable.
    let b = open(&b_path, &clock);
    let again = acquire(&b, &key("fresh-2"), &ClaimOptions::new());
    assert!(again.token() > fresh.token());
}

#[test]
fn import_raises_the_clock_high_water_mark() {
    // Four minutes ahead: within the default tolerance of five.
    let dir = tempfile::tempdir().unwrap();
    let ahead = ManualClock::new(T0 + 240_000);
    let (_, stream) = populated(&dir.path().join("a.redb"), &ahead);
    let behind = ManualClock::new(T0);
    let b_path = dir.path().join("b.redb");
    let b = open(&b_path, &behind);
    assert_eq!(b.now_ms(), T0);
    b.import(stream.as_slice(), |_| {}).unwrap();
    assert!(b.now_ms() >= T0 + 240_000);
    drop(b);
    let b = open(&b_path, &behind);
    assert!(b.now_ms() >= T0 + 240_000, "the raised clock is persisted");
}

/// Offsets of the frames in a stream: header 24 bytes, then
/// `[len u32][crc u32][len bytes]`.
fn frame_offsets(stream: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = 24;
    while at < stream.len() {
        out.push(at);
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap()) as usize;
        at += 8 + len;
    }
    assert_eq!(at, stream.len());
    out
}

#[test]
fn a_damaged_frame_is_refused_with_its_offset_and_nothing_of_its_batch_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let (_, stream) = populated(&dir.path().join("a.redb"), &clock);
    let frames = frame_offsets(&stream);
    // meta, 4 records, end
    assert_eq!(frames.len(), 6);
    let b = open(&dir.path().join("b.redb"), &clock);
    for (i, &at) in frames.iter().enumerate() {
        let mut damaged = stream.clone();
        damaged[at + 12] ^= 0x01;
        match b.import(damaged.as_slice(), |_| {}) {
            Err(Error::CorruptExport { offset, detail }) => {
                assert_eq!(offset, at as u64, "frame {i}: {detail}");
            }
            other => panic!("frame {i}: {other:?}"),
        }
        assert!(b.is_empty().unwrap(), "frame {i}");
    }
    // Truncated: the offset is where the stream ended.
    let cut = frames[5];
    match b.import(&stream[..cut], |_| {}) {
        Err(Error::CorruptExport { offset, detail }) => {
            assert_eq!(offset, cut as u64);
            assert!(detail.contains("truncated"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    // Not an export at all.
    match b.import(&b"SQLite format 3\0 and more bytes"[..], |_| {}) {
        Err(Error::CorruptExport { offset: 0, .. }) => {}
        other => panic!("{other:?}"),
    }
    // A newer format version.
    let mut newer = stream.clone();
    newer[16..20].copy_from_slice(&2u32.to_le_bytes());
    let crc = crc32fast::hash(&newer[..20]);
    newer[20..24].copy_from_slice(&crc.to_le_bytes());
    match b.import(newer.as_slice(), |_| {}) {
        Err(Error::CorruptExport { detail, .. }) => assert!(detail.contains("newer"), "{detail}"),
        other => panic!("{other:?}"),
    }
    assert!(b.is_empty().unwrap());
}

#[test]
fn a_large_import_goes_in_atomic_batches() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let a = std::sync::Arc::new(open(&dir.path().join("a.redb"), &clock));
    // 1,100 records (two import batches), claimed from 16 threads so that
    // group commit keeps this quick.
    std::thread::scope(|s| {
        for t in 0..16 {
            let a = a.clone();
            s.spawn(move || {
                for i in (t..1100).step_by(16) {
                    let l = acquire(&a, &key(&format!("k{i:05}")), &ClaimOptions::new());
                    if i % 2 == 0 {
                        a.complete(&l, b"ok").unwrap();
                    }
                }
            });
        }
    });
    let mut stream = Vec::new();
    a.export(&mut stream, |_| {}).unwrap();
    let frames = frame_offsets(&stream);
    // Damage record 1,050: the first batch (1,024 records) is imported, the
    // second is refused whole.
    let at = frames[1 + 1050];
    let mut damaged = stream.clone();
    damaged[at + 20] ^= 0xFF;
    let b = open(&dir.path().join("b.redb"), &clock);
    match b.import(damaged.as_slice(), |_| {}) {
        Err(Error::CorruptExport { offset, .. }) => assert_eq!(offset, at as u64),
        other => panic!("{other:?}"),
    }
    assert_eq!(b.len().unwrap(), 1024);
    // Running the repaired stream again completes the import.
    let summary = b.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!(
        (summary.records, summary.imported, summary.present),
        (1100, 76, 1024)
    );
    assert_eq!(all(&b), all(&a));
    let s = b.stats().unwrap();
    assert_eq!((s.records.processing, s.records.succeeded), (550, 550));
    assert_eq!(
        b.scan(&Filter::new().state(State::Processing))
            .unwrap()
            .count(),
        550
    );
}

/// A source that keeps serving after its export (a replica until the
/// cutover) hands out tokens the export does not carry. The destination's
/// counter is raised by the clock as well (the latest of the stream's
/// times and its own, in ms, × 1,024), so the source's later holder cannot
/// complete the destination's claim of the same key: its token was never
/// handed out there.
#[test]
fn a_holder_of_the_source_after_the_export_cannot_complete_a_destination_claim() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let a = open(&dir.path().join("a.redb"), &clock);
    let l = acquire(&a, &key("k1"), &ClaimOptions::new());
    a.complete(&l, b"ok").unwrap();
    let mut stream = Vec::new();
    a.export(&mut stream, |_| {}).unwrap();
    let zombie = acquire(&a, &key("k2"), &ClaimOptions::new());
    let b = open(&dir.path().join("b.redb"), &clock);
    let summary = b.import(stream.as_slice(), |_| {}).unwrap();
    let fresh = acquire(&b, &key("k2"), &ClaimOptions::new());
    let late = b.complete(&zombie, b"zombie");
    assert!(
        matches!(late, Err(Error::StaleLease { .. })),
        "the source's holder (token {}) completed the destination's claim (token {}): {late:?}",
        zombie.token(),
        fresh.token()
    );
    assert_eq!(summary.next_token, T0 * 1024);
    assert_eq!(fresh.token(), T0 * 1024);
    let done = b.complete(&fresh, b"new").unwrap();
    assert_eq!(done.result(), Some(&b"new"[..]));
}

/// An export whose records are all gone (claimed, then released) still
/// carries the token counter, and importing it raises the counter even
/// though no record is written: a token is never handed out twice.
#[test]
fn importing_only_a_token_counter_still_raises_it_durably() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let a = open(&dir.path().join("a.redb"), &clock);
    let mut highest = 0;
    for i in 0..10 {
        let l = acquire(&a, &key(&format!("gone-{i}")), &ClaimOptions::new());
        highest = l.token();
        a.release(l).unwrap();
    }
    let mut stream = Vec::new();
    let exported = a.export(&mut stream, |_| {}).unwrap();
    assert_eq!(exported.records, 0);
    assert_eq!(exported.next_token, highest + 1);

    let b_path = dir.path().join("b.redb");
    let b = open(&b_path, &clock);
    let summary = b.import(stream.as_slice(), |_| {}).unwrap();
    // Raised by the clock too: the store's time in ms × 1,024.
    assert_eq!(summary.next_token, (highest + 1).max(T0 * 1024));
    let fresh = acquire(&b, &key("fresh"), &ClaimOptions::new());
    assert!(fresh.token() > highest, "{} <= {highest}", fresh.token());
    drop(b);
    let b = open(&b_path, &clock);
    let again = acquire(&b, &key("fresh-2"), &ClaimOptions::new());
    assert!(again.token() > fresh.token());
}

// ---------------------------------------------------------------------------
// Hostile streams (issue 10): each is refused with the frame's offset, the
// rule it broke and how many records went in, and changes nothing.

const CAP: u64 = i64::MAX as u64;

/// The store `open` makes, on the clock of a test helper stream.
fn store_at(dir: &tempfile::TempDir, name: &str, clock: &ManualClock) -> Store {
    open(&dir.path().join(name), clock)
}

/// `import` refused the stream at `offset` for `rule`, with `imported`
/// records in before it (the error's message says all three).
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(
    result: idemstore::Result<T>,
    offset: usize,
    rule: &str,
    imported: u64,
) {
    let err = match result {
        Err(e) => e,
        Ok(v) => panic!("the hostile stream was imported: {v:?}"),
    };
    let text = err.to_string();
    assert!(
        text.contains(&format!("byte offset {offset}")),
        "offset {offset}: {text}"
    );
    assert!(text.contains(rule), "rule {rule}: {text}");
    assert!(
        text.contains(&format!("{imported} records were imported")),
        "{imported} imported: {text}"
    );
}

/// Issue 10, reproduction 1: an export whose token counter is `u64::MAX`
/// was imported, the next two acquisitions got `u64::MAX` and `0`, and a
/// holder whose lease had been taken over could complete the key.
#[test]
fn an_export_whose_token_counter_is_u64_max_is_refused_and_fencing_holds() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let b = store_at(&dir, "b.redb", &clock);
    let stream = export_stream(u64::MAX, T0, &[RawRecord::succeeded("r", 5, T0)]);
    assert_refused(b.import(stream.as_slice(), |_| {}), 24, "token-cap", 0);
    assert!(b.is_empty().unwrap());
    // The counter did not move: fencing works as before.
    let k = key("k");
    let first = acquire(&b, &k, &ClaimOptions::new().lease(Duration::from_secs(1)));
    clock.advance(Duration::from_secs(2));
    let second = acquire(&b, &k, &ClaimOptions::new());
    assert!(second.token() > first.token());
    assert!(second.token() < 1 << 40, "{}", second.token());
    assert!(matches!(
        b.complete(&first, b"stale"),
        Err(Error::StaleLease { .. })
    ));
    b.complete(&second, b"current").unwrap();
    // A record whose token is at the cap is refused too (the counter above
    // it would be past the cap), at its own frame, and nothing of its
    // batch goes in.
    let stream = export_stream(
        10,
        T0,
        &[
            RawRecord::succeeded("ok", 3, T0),
            RawRecord::succeeded("capped", CAP, T0),
        ],
    );
    let offsets = common::export_frame_offsets(&stream);
    assert_refused(
        b.import(stream.as_slice(), |_| {}),
        offsets[2],
        "token-cap",
        0,
    );
    assert!(b.get(&common::key("ok")).unwrap().is_none());
}

/// Issue 10, reproduction 2: an export whose clock high-water mark is
/// `u64::MAX`, or two days ahead, raised the store's time for good, so
/// every record expired at once.
#[test]
fn an_export_whose_clock_is_far_ahead_is_refused_and_records_stay_live() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let b = store_at(&dir, "b.redb", &clock);
    let live = acquire(&b, &key("live"), &ClaimOptions::new());
    b.complete(&live, b"kept").unwrap();
    let two_days = 2 * 24 * 3_600_000;
    for hwm in [u64::MAX, T0 + two_days] {
        let stream = export_stream(10, hwm, &[]);
        assert_refused(b.import(stream.as_slice(), |_| {}), 24, "clock-ahead", 0);
        assert!(
            b.now_ms() < T0 + 60_000,
            "the store's time moved: {}",
            b.now_ms()
        );
    }
    // A record updated two days ahead is refused as well.
    let stream = export_stream(10, T0, &[RawRecord::succeeded("future", 3, T0 + two_days)]);
    let offsets = common::export_frame_offsets(&stream);
    assert_refused(
        b.import(stream.as_slice(), |_| {}),
        offsets[1],
        "clock-ahead",
        0,
    );
    assert!(b.now_ms() < T0 + 60_000);
    match b.claim(
        &key("live"),
        &Fingerprint::of(b"live"),
        &ClaimOptions::new(),
    ) {
        Ok(ClaimOutcome::Replay(r)) => assert_eq!(r.result(), Some(&b"kept"[..])),
        other => panic!("the live record expired: {other:?}"),
    }
}

/// Issue 10, reproduction 3: an imported Processing record with a lease
/// far in the future held its key for centuries.
#[test]
fn an_imported_processing_record_with_an_unbounded_lease_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let b = store_at(&dir, "b.redb", &clock);
    let century = 100 * 365 * 24 * 3_600_000;
    let stream = export_stream(
        10,
        T0,
        &[
            RawRecord::succeeded("before", 2, T0),
            RawRecord::processing("held", 3, T0, century),
        ],
    );
    let offsets = common::export_frame_offsets(&stream);
    assert_refused(
        b.import(stream.as_slice(), |_| {}),
        offsets[2],
        "lease-too-long",
        0,
    );
    assert!(b.is_empty().unwrap());
    // The key is free.
    acquire(&b, &common::key("held"), &ClaimOptions::new());
}

/// A stored record that fails its checksum, met by an import of its key,
/// stops the import as `ImportRefused` (`StoredRecordDamaged`) at that
/// record's frame, with every record its batch wrote counted: the error
/// was a bare `CorruptRecord`, and the rest of the batch was written
/// without being counted.
#[test]
fn a_damaged_stored_record_stops_an_import_with_what_it_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let fill = |path: &Path, n: usize| {
        let store = open(path, &clock);
        for i in 0..n {
            let lease = acquire(&store, &key(&format!("k{i:03}")), &ClaimOptions::new());
            store.complete(&lease, b"\"ok\"").unwrap();
        }
    };
    let source = dir.path().join("source.redb");
    fill(&source, 250);
    let mut stream = Vec::new();
    open(&source, &clock).export(&mut stream, |_| {}).unwrap();
    let target = dir.path().join("target.redb");
    fill(&target, 200);
    common::damage_record(&target, &key("k000"));
    let store = open(&target, &clock);
    match store.import(stream.as_slice(), |_| {}) {
        Err(Error::ImportRefused {
            rule: idemstore::ImportRule::StoredRecordDamaged,
            imported,
            offset,
            detail,
        }) => {
            assert_eq!(imported, 50, "{detail}");
            // The frame of k000, the first record after the meta frame.
            let frames = common::export_frame_offsets(&stream);
            assert_eq!(offset, u64::try_from(frames[1]).unwrap());
            assert!(detail.contains("acme/tickets"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(store.len().unwrap(), 250);
}

// ---------------------------------------------------------------------------
// Salvage of a store whose write-ahead log recovery cannot use

const SALVAGED: &str = "a_store_whose_log_is_lost_or_damaged_is_salvaged_from_a_copy";

/// A new store `name` in `dir` with `export` imported into it.
fn imported(dir: &Path, name: &str, export: &[u8]) -> Store {
    let store = Store::open_with(
        dir.join(name),
        Config::new().sweep_interval(None).scrub_rate(None),
    )
    .unwrap();
    store.import(export, |_| {}).unwrap();
    store
}

/// A service SIGKILLed with completions acknowledged since its last
/// checkpoint (in the write-ahead log only), whose log is then lost,
/// damaged in a durable frame or in its header's magic number, or cut
/// short before one: the store refuses to open (`CorruptLog`, not a
/// foreign file for a damaged magic number);
/// `salvage_file` exports what the index and the log's intact frames hold
/// (with a blank header, the frames after it), says what was lost, and
/// writes neither original file; of a crashed store whose log is sound it
/// loses nothing; a copy made without its log, while the original's log
/// holds the changes, is refused as an open refuses it. The export
/// imports into a new store, where the keys finished before the checkpoint
/// (and, with a damaged frame, the frames before it) replay, the lost keys
/// are absent, and a new claim of a lost key gets a token above every token
/// the crashed store handed out.
#[test]
fn a_store_whose_log_is_lost_or_damaged_is_salvaged_from_a_copy() {
    if common::child_role(SALVAGED) {
        let store = Store::open_with(
            common::child_var("STORE"),
            Config::new().sweep_interval(None).scrub_rate(None),
        )
        .unwrap();
        for i in 0..10 {
            let l = acquire(&store, &key(&format!("before-{i}")), &ClaimOptions::new());
            store.complete(&l, b"kept").unwrap();
        }
        store.checkpoint().unwrap();
        let mut last = 0;
        for i in 0..20 {
            let l = acquire(&store, &key(&format!("after-{i}")), &ClaimOptions::new());
            store.complete(&l, b"logged").unwrap();
            last = l.token();
        }
        common::report("LAST_TOKEN", last);
        common::ready_and_wait();
    }
    let dir = tempfile::tempdir().unwrap();
    let crashed = dir.path().join("crashed.redb");
    let mut child = common::spawn_child(SALVAGED, &[("STORE", common::path_var(&crashed))]);
    let last_token: u64 = child.wait_ready()["LAST_TOKEN"].parse().unwrap();
    child.kill();
    let wal = |p: &Path| {
        let mut w = p.as_os_str().to_owned();
        w.push("-wal");
        std::path::PathBuf::from(w)
    };
    let index = std::fs::read(&crashed).unwrap();
    let log = std::fs::read(wal(&crashed)).unwrap();
    let copy = |name: &str, log: Option<&[u8]>| {
        let path = dir.path().join(name);
        std::fs::write(&path, &index).unwrap();
        if let Some(log) = log {
            std::fs::write(wal(&path), log).unwrap();
        }
        path
    };

    // A copy made without its log, while the original's log holds the
    // changes: refused, naming that log, as an open is.
    let without = copy("without.redb", None);
    match idemstore::salvage_file(&without, &mut Vec::new(), |_| {}) {
        Err(Error::IncompatibleFile { path, detail }) => {
            assert!(path.ends_with("crashed.redb-wal"), "{path:?}: {detail}");
        }
        other => panic!("expected IncompatibleFile, got {other:?}"),
    }
    // Damaged: a byte of after-10's claim frame flipped; later frames
    // record that it was durable.
    let frames = common::log_frames(&log);
    assert!(frames.len() >= 40, "{} frames", frames.len());
    let (at, _) = frames[frames.len() - 20];
    let mut bad_frame = log.clone();
    bad_frame[at + 36 + 2] ^= 0x40;
    let damaged = copy("damaged.redb", Some(&bad_frame));
    // A blank header: the frames after it are still replayed.
    let mut bad_header = log.clone();
    bad_header[..4096].fill(0);
    let blank = copy("blank.redb", Some(&bad_header));
    // A flipped bit in the header's magic number: this store's log,
    // damaged (the header still names the store), not a foreign file.
    let mut bad_magic = log.clone();
    bad_magic[0] ^= 0x01;
    let magic = copy("magic.redb", Some(&bad_magic));
    // Cut short (a copy that stopped early) at the start of that same
    // frame: a crash never shortens the log, whose header records its
    // length.
    let cut = copy("cut.redb", Some(&log[..at]));
    // The log as the crash left it: nothing lost.
    let sound = copy("sound.redb", Some(&log));
    // Lost: the crashed store's own log removed.
    let lost = crashed;
    std::fs::remove_file(wal(&lost)).unwrap();

    let cases = [
        (&lost, Some("empty or missing"), 0),
        (&damaged, Some("missing or damaged"), 10),
        (&blank, Some("empty or missing"), 20),
        (&magic, Some("header is damaged"), 20),
        (&cut, Some("cut short"), 10),
        (&sound, None, 20),
    ];
    for (path, loss, kept_after) in cases {
        let what = path.file_name().unwrap().to_string_lossy().into_owned();
        let before_index = std::fs::read(path).unwrap();
        let before_log = std::fs::read(wal(path)).ok();
        if loss.is_some() {
            match Store::open_existing(
                path,
                Config::new()
                    .sweep_interval(None)
                    .scrub_rate(None)
                    .read_only(true),
            ) {
                Err(Error::CorruptLog { .. }) => {}
                other => panic!("{what}: expected CorruptLog, got {:?}", other.map(|_| ())),
            }
            // Start the salvage from the files as the crash left them (the
            // refused open leaves an empty log where there was none).
            std::fs::write(path, &before_index).unwrap();
            match &before_log {
                Some(bytes) => std::fs::write(wal(path), bytes).unwrap(),
                None => {
                    let _ = std::fs::remove_file(wal(path));
                }
            }
        }

        let mut export = Vec::new();
        let salvage = idemstore::salvage_file(path, &mut export, |_| {}).unwrap();
        match (loss, salvage.lost.as_deref()) {
            (Some(loss), Some(said)) => assert!(said.contains(loss), "{what}: {said}"),
            (None, None) => {}
            (loss, said) => panic!("{what}: expected a loss {loss:?}, said {said:?}"),
        }
        assert_eq!(
            std::fs::read(path).unwrap(),
            before_index,
            "{what}: store file written"
        );
        assert_eq!(
            std::fs::read(wal(path)).ok(),
            before_log,
            "{what}: log written"
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("salvage"))
            .collect();
        assert!(leftovers.is_empty(), "{what}: copy left: {leftovers:?}");

        let restored = imported(dir.path(), &format!("restored-{what}"), &export);
        for i in 0..10 {
            let r = restored.get(&key(&format!("before-{i}"))).unwrap();
            assert_eq!(
                r.map(|r| r.state()),
                Some(State::Succeeded),
                "{what}: before-{i}"
            );
        }
        for i in 0..20 {
            let r = restored.get(&key(&format!("after-{i}"))).unwrap();
            if i < kept_after {
                assert_eq!(
                    r.map(|r| r.state()),
                    Some(State::Succeeded),
                    "{what}: after-{i}"
                );
            } else {
                assert!(r.is_none(), "{what}: after-{i} survived the loss: {r:?}");
            }
        }
        if kept_after < 20 {
            let again = acquire(&restored, &key("after-19"), &ClaimOptions::new());
            assert!(
                again.token() > last_token,
                "{what}: token {} handed out again (the crashed store reached {last_token})",
                again.token()
            );
        }
    }
}

/// `salvage_file` refuses a store a service holds (the copy would not be
/// consistent), and on a store whose log is sound reports no loss and
/// exports what `Store::export` does.
#[test]
fn a_salvage_refuses_a_held_store_and_loses_nothing_of_a_sound_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
    for i in 0..5 {
        let l = acquire(&store, &key(&format!("k{i}")), &ClaimOptions::new());
        store.complete(&l, b"done").unwrap();
    }
    let mut sink = Vec::new();
    match idemstore::salvage_file(&path, &mut sink, |_| {}) {
        Err(Error::AlreadyOpen { .. }) => {}
        other => panic!("expected AlreadyOpen, got {other:?}"),
    }
    assert!(sink.is_empty());
    drop(store);
    let mut export = Vec::new();
    let salvage = idemstore::salvage_file(&path, &mut export, |_| {}).unwrap();
    assert_eq!(salvage.lost, None);
    assert_eq!(salvage.export.records, 5);
    let restored = imported(dir.path(), "restored.redb", &export);
    assert_eq!(restored.len().unwrap(), 5);
}
