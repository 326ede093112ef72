//! Import is validated input (issue 10, deliverable 1): the token cap, the
//! clock tolerance and every record invariant, each refused with a typed
//! error naming the frame's offset, the rule and the records imported
//! before it; refused frames change nothing and earlier batches stay.

mod common;
#[cfg(feature = "postgres")]
mod pg;

use std::time::Duration;

use common::{
    RawRecord, TestDir, acquired, export_frame_offsets, export_stream, fp, key, lease_of, secs,
};
use idemstore::{
    AcquiredFrom, ClaimOptions, Clock, Config, DEFAULT_CLOCK_TOLERANCE, Error, Filter, Fingerprint,
    ImportOptions, ImportRule, MAX_LEASE, MAX_RETENTION, MAX_TOKEN, ManualClock, Resolution, Store,
};

const HOUR: u64 = 3_600_000;

#[track_caller]
fn refused<T: std::fmt::Debug>(result: idemstore::Result<T>) -> (u64, ImportRule, u64) {
    match result {
        Err(Error::ImportRefused {
            offset,
            rule,
            imported,
            ..
        }) => (offset, rule, imported),
        other => panic!("expected ImportRefused, got {other:?}"),
    }
}

#[test]
fn the_token_cap_is_i64_max() {
    assert_eq!(MAX_TOKEN, i64::MAX as u64);
    assert_eq!(DEFAULT_CLOCK_TOLERANCE, Duration::from_secs(300));
}

#[test]
fn well_formed_hand_made_records_import() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let mut rp = RawRecord::processing("running", 4, now, 30_000);
    rp.recovery_point = Some(b"step-1".to_vec());
    let stream = export_stream(10, now, &[RawRecord::succeeded("done", 3, now), rp]);
    let summary = store.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!((summary.records, summary.imported), (2, 2));
    // Above the stream's counter (10), raised by the clock: ms × 1,024.
    assert_eq!(summary.next_token, now * 1024);
    let r = store.get(&key("running")).unwrap().unwrap();
    assert_eq!(r.recovery_point(), Some(&b"step-1"[..]));
}

/// The counter at the cap: the import goes in, and the next claim gets
/// `TokensExhausted` instead of a wrapped token; the store is unchanged,
/// also after a reopen. Release builds wrap silently, so this runs in
/// release settings too (`cargo test --profile ci`).
#[test]
fn a_counter_at_the_cap_imports_and_the_next_claim_is_refused_without_wrapping() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let stream = export_stream(MAX_TOKEN, now, &[]);
    let summary = store.import(stream.as_slice(), |_| {}).unwrap();
    assert_eq!(summary.next_token, MAX_TOKEN);
    for _ in 0..2 {
        match store.claim(&key("k"), &fp("p"), &ClaimOptions::new()) {
            Err(Error::TokensExhausted { next_token }) => assert_eq!(next_token, MAX_TOKEN),
            other => panic!("{other:?}"),
        }
    }
    assert!(store.get(&key("k")).unwrap().is_none());
    drop(store);
    let store = t.open();
    assert!(matches!(
        store.claim(&key("k"), &fp("p"), &ClaimOptions::new()),
        Err(Error::TokensExhausted { .. })
    ));
    assert!(store.is_empty().unwrap());
}

/// Just below the cap: one more token (the last, `MAX_TOKEN - 1`), then
/// refusal; a takeover after that is refused too, and the holder stays
/// current (fencing holds).
#[test]
fn a_counter_just_below_the_cap_hands_out_its_last_token_then_refuses() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    // A record holding the token below the cap raises the counter to it.
    let stream = export_stream(5, now, &[RawRecord::succeeded("top", MAX_TOKEN - 2, now)]);
    assert_eq!(
        store.import(stream.as_slice(), |_| {}).unwrap().next_token,
        MAX_TOKEN - 1
    );
    let opts = ClaimOptions::new().lease(Duration::from_secs(1));
    let last = acquired(store.claim(&key("a"), &fp("p"), &opts).unwrap());
    assert_eq!(last.token(), MAX_TOKEN - 1);
    assert!(matches!(
        store.claim(&key("b"), &fp("p"), &opts),
        Err(Error::TokensExhausted { .. })
    ));
    t.clock.advance(Duration::from_secs(2));
    // The lapsed lease cannot be taken over (no token left), so its holder
    // is still the current one.
    assert!(matches!(
        store.claim(&key("a"), &fp("p"), &opts),
        Err(Error::TokensExhausted { .. })
    ));
    store.complete(&last, b"done").unwrap();
    // A stream whose counter is one past the cap is refused before anything.
    let stream = export_stream(MAX_TOKEN + 1, now, &[RawRecord::succeeded("x", 1, now)]);
    assert_eq!(
        refused(store.import(stream.as_slice(), |_| {})),
        (24, ImportRule::TokenCap, 0)
    );
    assert!(store.get(&key("x")).unwrap().is_none());
}

/// Every record invariant, each broken by one record after a good one in
/// the same batch: refused at its frame, nothing of the batch written.
#[test]
fn each_record_invariant_is_checked() {
    let t = TestDir::new();
    let store = t.open_with(t.config().max_result_bytes(64).max_recovery_point_bytes(64));
    let now = t.now_ms();
    let max_lease = MAX_LEASE.as_millis() as u64;
    let max_retention = MAX_RETENTION.as_millis() as u64;
    let base = || RawRecord::succeeded("bad", 3, now);
    let cases: Vec<(&str, RawRecord, ImportRule)> = vec![
        (
            "token at the cap",
            RawRecord {
                token: MAX_TOKEN,
                ..base()
            },
            ImportRule::TokenCap,
        ),
        (
            "created after updated",
            RawRecord {
                created_ms: now + 1,
                ..base()
            },
            ImportRule::TimesOutOfOrder,
        ),
        (
            "expiring at its last update",
            RawRecord {
                expires_ms: now,
                ..base()
            },
            ImportRule::TimesOutOfOrder,
        ),
        (
            "lease past the longest",
            RawRecord::processing("bad", 3, now, max_lease + 1),
            ImportRule::LeaseTooLong,
        ),
        (
            "lease at u64::MAX (beyond a bigint)",
            RawRecord {
                lease_until_ms: u64::MAX,
                ..base()
            },
            ImportRule::TimeOutOfRange,
        ),
        (
            "expiry past the longest retention",
            RawRecord {
                expires_ms: now + max_retention + 1,
                ..base()
            },
            ImportRule::RetentionTooLong,
        ),
        (
            "processing expiring before its lease",
            RawRecord {
                expires_ms: now + 10_000,
                ..RawRecord::processing("bad", 3, now, 30_000)
            },
            ImportRule::ExpiryBeforeLease,
        ),
        (
            "succeeded without output",
            RawRecord {
                output: None,
                ..base()
            },
            ImportRule::StateOutput,
        ),
        (
            "failed without output",
            RawRecord {
                state: 2,
                output: None,
                ..base()
            },
            ImportRule::StateOutput,
        ),
        (
            "never acquired",
            RawRecord {
                acquisitions: 0,
                ..base()
            },
            ImportRule::StateOutput,
        ),
        (
            "result over the limit",
            RawRecord {
                output: Some(vec![7; 65]),
                ..base()
            },
            ImportRule::TooLarge,
        ),
        (
            "recovery point over the limit",
            RawRecord {
                recovery_point: Some(vec![7; 65]),
                ..base()
            },
            ImportRule::TooLarge,
        ),
        (
            "business key with a control character",
            RawRecord {
                business_key: Some("a\nb".into()),
                ..base()
            },
            ImportRule::BusinessKey,
        ),
        (
            "updated far ahead",
            RawRecord::succeeded("bad", 3, now + HOUR),
            ImportRule::ClockAhead,
        ),
    ];
    for (what, bad, rule) in cases {
        let stream = export_stream(10, now, &[RawRecord::succeeded("good", 2, now), bad]);
        let offsets = export_frame_offsets(&stream);
        let (offset, got, imported) = refused(store.import(stream.as_slice(), |_| {}));
        assert_eq!(
            (offset, got, imported),
            (offsets[2] as u64, rule, 0),
            "{what}"
        );
        assert!(store.is_empty().unwrap(), "{what}");
    }
    // The limits are this store's: a record within them goes in.
    let ok = RawRecord {
        output: Some(vec![7; 64]),
        ..base()
    };
    store
        .import(export_stream(10, now, &[ok]).as_slice(), |_| {})
        .unwrap();
    assert_eq!(store.len().unwrap(), 1);
}

/// A refused frame after a full batch: the batch before it stays, the
/// error counts it, and the floors moved only with it.
#[test]
fn a_refused_batch_writes_nothing_and_earlier_batches_stay() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let mut records: Vec<RawRecord> = (0..1100)
        .map(|i| RawRecord::succeeded(&format!("k{i:05}"), 1 + i, now))
        .collect();
    records[1050].token = MAX_TOKEN;
    let stream = export_stream(2000, now, &records);
    let offsets = export_frame_offsets(&stream);
    let (offset, rule, imported) = refused(store.import(stream.as_slice(), |_| {}));
    assert_eq!(
        (offset, rule, imported),
        (offsets[1051] as u64, ImportRule::TokenCap, 1024)
    );
    assert_eq!(store.len().unwrap(), 1024);
    let next = acquired(
        store
            .claim(&key("new"), &fp("p"), &ClaimOptions::new())
            .unwrap(),
    );
    // The floors landed with the first batch (the meta frame's counter,
    // below the clock's: ms × 1,024), not the refused frame's token.
    assert_eq!(next.token(), now * 1024);
}

/// With the explicit option, a stream two days ahead is imported, but the
/// store's time moves by at most the tolerance: no record expires at once.
#[test]
fn accepting_a_clock_ahead_imports_without_adopting_the_time() {
    let t = TestDir::new();
    let store = t.open_with(t.config().retention(Duration::from_secs(3600)));
    let now = t.now_ms();
    let live = acquired(
        store
            .claim(&key("live"), &fp("p"), &ClaimOptions::new())
            .unwrap(),
    );
    store.complete(&live, b"kept").unwrap();
    let ahead = now + 48 * HOUR;
    let stream = export_stream(10, ahead, &[RawRecord::succeeded("future", 3, ahead)]);
    assert_eq!(
        refused(store.import(stream.as_slice(), |_| {})),
        (24, ImportRule::ClockAhead, 0)
    );
    let opts = ImportOptions::new().accept_clock_ahead(true);
    let summary = store.import_with(stream.as_slice(), &opts, |_| {}).unwrap();
    assert_eq!(summary.imported, 1);
    let tolerance = DEFAULT_CLOCK_TOLERANCE.as_millis() as u64;
    assert!(
        store.now_ms() <= t.now_ms() + tolerance,
        "{}",
        store.now_ms()
    );
    assert!(store.get(&key("live")).unwrap().is_some());
    assert!(store.get(&key("future")).unwrap().is_some());
    // A wider tolerance accepts it without the option.
    let t2 = TestDir::new();
    let other = t2.open();
    let stream = export_stream(10, t2.now_ms() + HOUR, &[]);
    let opts = ImportOptions::new().clock_tolerance(Duration::from_secs(7200));
    other.import_with(stream.as_slice(), &opts, |_| {}).unwrap();
}

#[test]
fn retention_is_capped_at_max_retention() {
    let t = TestDir::new();
    let ten_years = Duration::from_secs(10 * 365 * 24 * 3600);
    drop(t.open_with(t.config().retention(ten_years)));
    let too_long = MAX_RETENTION + Duration::from_millis(1);
    match Store::open_with(&t.path, Config::new().retention(too_long)) {
        Err(Error::InvalidArgument {
            what: "retention", ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

/// An export carries the store's time, not the bound reserved ahead of it:
/// an export then import into a store on the same clock leaves its time
/// where the clock is (review finding: each round moved it ~1 s ahead).
#[test]
fn an_export_then_import_round_does_not_move_the_time_ahead() {
    let source = TestDir::new();
    let store = source.open();
    let k = key("k");
    let lease = acquired(store.claim(&k, &fp("a"), &ClaimOptions::new()).unwrap());
    store.complete(&lease, b"done").unwrap();
    let mut stream = Vec::new();
    store.export(&mut stream, |_| {}).unwrap();

    let target = TestDir::new();
    target.clock.set_ms(source.clock.now_ms());
    let other = target.open();
    for _ in 0..3 {
        other.import(stream.as_slice(), |_| {}).unwrap();
    }
    assert_eq!(other.now_ms(), target.clock.now_ms());
}

/// With far-ahead times accepted, imports in a row still move the store's
/// time by at most one tolerance past the wall clock, never one more per
/// import; and a Processing record stamped far ahead cannot hold its key
/// for longer than the longest lease from now.
#[test]
fn accepted_far_ahead_times_do_not_creep_or_hold_a_key_for_years() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let ahead = now + 10 * 365 * 24 * HOUR;
    let stream = export_stream(5, ahead, &[RawRecord::succeeded("done", 3, ahead)]);
    let accept = ImportOptions::new().accept_clock_ahead(true);
    for _ in 0..3 {
        store
            .import_with(stream.as_slice(), &accept, |_| {})
            .unwrap();
    }
    let tolerance = u64::try_from(DEFAULT_CLOCK_TOLERANCE.as_millis()).unwrap();
    assert!(
        store.now_ms() <= now + tolerance,
        "{} > {}",
        store.now_ms(),
        now + tolerance
    );

    let held = export_stream(5, now, &[RawRecord::processing("held", 4, ahead, 30_000)]);
    let (_, rule, _) = refused(store.import_with(held.as_slice(), &accept, |_| {}));
    assert_eq!(rule, ImportRule::LeaseTooLong);
}

/// A time above `i64::MAX` ms (what a PostgreSQL `bigint` holds) is
/// refused even with far-ahead times accepted, before anything of its
/// batch is written, on the file engine as on PostgreSQL (which wrote the
/// rest of the batch and then failed with an invalid argument, while the
/// file engine took the record and exported a stream PostgreSQL refused).
/// The lease message reads as one sentence.
#[test]
fn a_time_beyond_a_bigint_is_refused_before_its_batch_is_written() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let beyond = u64::try_from(i64::MAX).unwrap() + 5;
    let stream = export_stream(
        5,
        now,
        &[
            RawRecord::succeeded("before", 3, now),
            RawRecord::succeeded("far", 4, beyond),
            RawRecord::succeeded("after", 5, now),
        ],
    );
    let offsets = export_frame_offsets(&stream);
    let accept = ImportOptions::new().accept_clock_ahead(true);
    assert_eq!(
        refused(store.import_with(stream.as_slice(), &accept, |_| {})),
        (offsets[2] as u64, ImportRule::TimeOutOfRange, 0)
    );
    assert!(store.is_empty().unwrap());

    let ahead = now + 10 * 365 * 24 * HOUR;
    let held = export_stream(5, now, &[RawRecord::processing("held", 4, ahead, 30_000)]);
    match store.import_with(held.as_slice(), &accept, |_| {}) {
        Err(Error::ImportRefused { detail, .. }) => {
            assert!(!detail.contains("  "), "{detail}");
        }
        other => panic!("expected ImportRefused, got {other:?}"),
    }
}

/// A record whose last update is within the longest retention of the
/// largest time (`i64::MAX` ms) is refused (`TimeOutOfRange`) even with
/// far-ahead times accepted, on both engines, and nothing is written. One
/// at that bound imports; a claim retries it and completes it, its times
/// still fit a `bigint`, and the store's export imports again. Before, the
/// file engine took the later record, the claim wrote a lease end and an
/// expiry above `i64::MAX`, and the store's own export was refused;
/// PostgreSQL refused the claim, so the key was blocked until its expiry.
#[test]
fn a_record_updated_too_late_for_a_later_write_to_fit_is_refused_on_both_engines() {
    let largest = u64::try_from(i64::MAX).unwrap();
    let bound = largest - u64::try_from(MAX_RETENTION.as_millis()).unwrap();
    let retryable_at = |id: &str, at: u64| RawRecord {
        state: 3,
        output: Some(b"try again".to_vec()),
        lease_until_ms: at,
        ..RawRecord::succeeded(id, 5, at)
    };
    let accept = ImportOptions::new().accept_clock_ahead(true);
    let check = |store: &Store, what: &str| {
        let late = export_stream(10, 1, &[retryable_at("late", bound + 1)]);
        let offsets = export_frame_offsets(&late);
        assert_eq!(
            refused(store.import_with(late.as_slice(), &accept, |_| {})),
            (offsets[1] as u64, ImportRule::TimeOutOfRange, 0),
            "{what}"
        );
        assert!(store.is_empty().unwrap(), "{what}");

        let edge = export_stream(10, 1, &[retryable_at("edge", bound)]);
        let summary = store.import_with(edge.as_slice(), &accept, |_| {}).unwrap();
        assert_eq!(summary.imported, 1, "{what}");
        let fingerprint = Fingerprint::from_bytes(b"fingerprint".to_vec()).unwrap();
        let lease = acquired(
            store
                .claim(&key("edge"), &fingerprint, &ClaimOptions::new())
                .unwrap(),
        );
        store.complete(&lease, b"done").unwrap();
        let r = store.get(&key("edge")).unwrap().unwrap();
        assert!(
            r.lease_until_ms() <= largest && r.expires_ms() <= largest,
            "{what}: {r:?}"
        );
        let mut export = Vec::new();
        store.export(&mut export, |_| {}).unwrap();
        let t2 = TestDir::new();
        let restored = t2
            .open()
            .import_with(export.as_slice(), &accept, |_| {})
            .unwrap();
        assert_eq!(restored.imported, 1, "{what}");
    };
    let t = TestDir::new();
    check(&t.open(), "file");
    #[cfg(feature = "postgres")]
    if let Some(url) = pg::url() {
        let config = Config::new()
            .postgres_schema(pg::schema("import_late"))
            .sweep_interval(None);
        check(&Store::connect(&url, config).unwrap(), "postgres");
    }
}

/// A record with token 0 (which no store issues) is refused with the token
/// rule, and a stream header of format version 0 (none exists) is a
/// damaged stream; both were imported. Nothing is written.
#[test]
fn token_zero_and_format_version_zero_are_refused() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let stream = export_stream(10, now, &[RawRecord::succeeded("zero", 0, now)]);
    let (_, rule, imported) = refused(store.import(stream.as_slice(), |_| {}));
    assert_eq!((rule, imported), (ImportRule::TokenCap, 0));
    let mut stream = export_stream(10, now, &[RawRecord::succeeded("one", 1, now)]);
    stream[16..20].copy_from_slice(&0u32.to_le_bytes());
    let crc = crc32fast::hash(&stream[..20]);
    stream[20..24].copy_from_slice(&crc.to_le_bytes());
    match store.import(stream.as_slice(), |_| {}) {
        Err(Error::CorruptExport { offset: 16, detail }) => {
            assert!(detail.contains("version 0"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert!(store.is_empty().unwrap());
}

/// Records imported from a clock that ran ahead keep their times, and the
/// store's later writes to them never put a record's times out of order
/// (time never runs backwards for a record, on both engines): an amended
/// and a resolved record still have created ≤ updated, and the store's
/// export imports into a new store. Before, the writes stamped the store's
/// earlier time, and that export was refused (`TimesOutOfOrder`).
#[test]
fn a_store_that_took_records_from_a_clock_ahead_exports_what_imports_again() {
    let t = TestDir::new();
    let store = t.open();
    let ahead = t.now_ms() + 2 * HOUR;
    let stream = export_stream(
        10,
        ahead,
        &[
            RawRecord::succeeded("done", 3, ahead),
            RawRecord::processing("running", 4, ahead, 30_000),
        ],
    );
    let accept = ImportOptions::new().accept_clock_ahead(true);
    store
        .import_with(stream.as_slice(), &accept, |_| {})
        .unwrap();
    store
        .amend(&key("done"), 3, Resolution::Succeeded(b"fixed".to_vec()))
        .unwrap();
    store
        .resolve(&key("running"), 4, Resolution::Succeeded(b"ran".to_vec()))
        .unwrap();
    for id in ["done", "running"] {
        let r = store.get(&key(id)).unwrap().unwrap();
        assert!(r.created_ms() <= r.updated_ms(), "{id}: {r:?}");
    }
    let mut export = Vec::new();
    store.export(&mut export, |_| {}).unwrap();
    let t2 = TestDir::new();
    let restored = t2.open();
    let summary = restored
        .import_with(export.as_slice(), &accept, |_| {})
        .unwrap();
    assert_eq!(summary.imported, 2);
    let r = restored.get(&key("done")).unwrap().unwrap();
    assert_eq!(r.result(), Some(&b"fixed"[..]));
}

/// A record that expires before its own last update (which no store
/// writes: retention counts from the update) is refused on both engines,
/// naming the rule, and nothing is written. Imported, the store would
/// disagree with itself: a read at the store's time shows a live
/// Succeeded record, while a claim, judged at the record's last update at
/// least, finds the key past retention and runs the work again.
#[test]
fn a_record_expiring_before_its_last_update_is_refused_on_both_engines() {
    let t = TestDir::new();
    let now = t.now_ms();
    let mut ghost = RawRecord::succeeded("ghost", 5, now + 240_000);
    ghost.expires_ms = now + 120_000;
    let stream = export_stream(10, now, &[ghost]);
    let offsets = export_frame_offsets(&stream);
    let check = |store: &Store, what: &str| {
        let (offset, rule, imported) = refused(store.import(stream.as_slice(), |_| {}));
        assert_eq!(
            (offset, rule, imported),
            (offsets[1] as u64, ImportRule::TimesOutOfOrder, 0),
            "{what}"
        );
        assert!(store.is_empty().unwrap(), "{what}");
    };
    check(&t.open(), "file");
    #[cfg(feature = "postgres")]
    if let Some(url) = pg::url() {
        let config = Config::new()
            .postgres_schema(pg::schema("import_expiry"))
            .sweep_interval(None);
        check(&Store::connect(&url, config).unwrap(), "postgres");
    }
}

/// A Processing record from a clock an hour ahead whose lease ended
/// before its last update (a recovery point saved after the lease lapsed,
/// as a holder may while nobody took the key over), imported with
/// `accept_clock_ahead`: the store's time stays behind both, and every
/// reader judges the lease as a claim does, at the record's last update:
/// lapsed to `get`, `list --lapsed`, the compensation scan and `stats`,
/// and a claim takes it over.
#[test]
fn a_lease_that_ended_before_its_update_is_lapsed_to_readers_as_to_claims() {
    let t = TestDir::new();
    let store = t.open();
    let now = t.now_ms();
    let mut r = RawRecord::processing("ahead", 5, now + HOUR, 0);
    r.created_ms = now;
    r.lease_until_ms = now + 20 * 60_000;
    r.recovery_point = Some(b"step-1".to_vec());
    let stream = export_stream(10, now, &[r]);
    let accept = ImportOptions::new().accept_clock_ahead(true);
    store
        .import_with(stream.as_slice(), &accept, |_| {})
        .unwrap();
    let k = key("ahead");
    let got = store.get(&k).unwrap().unwrap();
    assert!(store.now_ms() < got.lease_until_ms(), "{got:?}");
    assert!(!got.lease_valid_at(store.now_ms()), "{got:?}");
    assert_eq!(store.scan(&Filter::new().lapsed()).unwrap().count(), 1);
    assert_eq!(store.compensation(None).unwrap().count(), 1);
    assert_eq!(store.stats().unwrap().records.lapsed, 1);
    // The fingerprint `RawRecord` holds.
    let same = Fingerprint::from_bytes(b"fingerprint".to_vec()).unwrap();
    let taken = acquired(store.claim(&k, &same, &ClaimOptions::new()).unwrap());
    assert_eq!(taken.acquired_from(), Some(AcquiredFrom::LapsedLease));
}

/// A recovery point saved after the lease lapsed leaves a Processing
/// record whose lease ends before its last update: a store writes it, so
/// its export imports (no rule refuses it), on both engines. A store whose
/// time is behind that update (PostgreSQL's time is the database's, which
/// an import never raises) judges it lapsed to readers as to a claim.
#[test]
fn a_recovery_point_saved_after_the_lease_lapsed_imports_and_is_lapsed_alike() {
    let t = TestDir::new();
    let t0 = t.now_ms();
    let source = t.open();
    let k = key("late");
    let lease = acquired(source.claim(&k, &fp("p"), &lease_of(secs(1))).unwrap());
    t.clock.advance(secs(2));
    source.set_recovery_point(&lease, b"step-2").unwrap();
    let r = source.get(&k).unwrap().unwrap();
    assert!(r.lease_until_ms() < r.updated_ms(), "{r:?}");
    let mut export = Vec::new();
    source.export(&mut export, |_| {}).unwrap();
    let check = |store: &Store, what: &str| {
        let summary = store.import(export.as_slice(), |_| {}).unwrap();
        assert_eq!(summary.imported, 1, "{what}");
        let got = store.get(&k).unwrap().unwrap();
        assert!(!got.lease_valid_at(store.now_ms()), "{what}: {got:?}");
        assert_eq!(
            store.scan(&Filter::new().lapsed()).unwrap().count(),
            1,
            "{what}"
        );
        let taken = acquired(store.claim(&k, &fp("p"), &ClaimOptions::new()).unwrap());
        assert_eq!(
            taken.acquired_from(),
            Some(AcquiredFrom::LapsedLease),
            "{what}"
        );
    };
    let mut dest = TestDir::new();
    dest.clock = ManualClock::new(t0);
    check(&dest.open(), "file");
    #[cfg(feature = "postgres")]
    if let Some(url) = pg::url() {
        let config = Config::new()
            .clock(ManualClock::new(t0))
            .postgres_schema(pg::schema("import_late_point"))
            .sweep_interval(None);
        let store = Store::connect(&url, config).unwrap();
        assert!(store.now_ms() < r.lease_until_ms());
        check(&store, "postgres");
    }
}
