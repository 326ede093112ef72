//! Operating a store: compensation scans, `resolve`, business keys, stats
//! counters and audit events.

mod common;
use common::damage_record;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idemstore::{
    ClaimOptions, ClaimOutcome, Clock, Config, Error, Filter, Fingerprint, Key, Lease, ManualClock,
    Record, Resolution, State, Store,
};
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};

/// 2024-01-01T00:00:00Z, a real epoch so units are exercised.
const T0: u64 = 1_704_067_200_000;

fn config(clock: &ManualClock) -> Config {
    Config::new()
        .clock(clock.clone())
        .retention(Duration::from_secs(60))
        .lease(Duration::from_secs(10))
        .sweep_interval(None)
        .scrub_rate(None)
}

fn open(path: &Path, clock: &ManualClock) -> Store {
    Store::open_with(path, config(clock)).unwrap()
}

fn key(scope: &str, id: &str) -> Key {
    Key::new(scope, id).unwrap()
}

fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(s.as_bytes())
}

fn acquire(store: &Store, k: &Key, opts: &ClaimOptions) -> Lease {
    match store.claim(k, &fp("payload"), opts).unwrap() {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired for {k}, got {other:?}"),
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn ids(records: impl IntoIterator<Item = idemstore::Result<Record>>) -> Vec<String> {
    let mut out: Vec<String> = records
        .into_iter()
        .map(|r| r.unwrap().key().to_string())
        .collect();
    out.sort();
    out
}

// ---------------------------------------------------------------- compensation

#[test]
fn compensation_yields_lapsed_and_old_processing_records_with_their_recovery_point() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let abandoned = key("acme/pay", "abandoned");
    let slow = key("acme/pay", "slow");
    let done = key("acme/pay", "done");

    let lease = acquire(&store, &abandoned, &ClaimOptions::new());
    store.set_recovery_point(&lease, b"charged-card").unwrap();
    let slow_lease = acquire(&store, &slow, &ClaimOptions::new().lease(secs(3600)));
    let done_lease = acquire(&store, &done, &ClaimOptions::new());
    store.complete(&done_lease, b"ok").unwrap();

    // Nothing has lapsed yet.
    assert!(ids(store.compensation(None).unwrap()).is_empty());

    clock.advance(secs(11));
    let found: Vec<Record> = store
        .compensation(None)
        .unwrap()
        .collect::<idemstore::Result<_>>()
        .unwrap();
    assert_eq!(found.len(), 1);
    let rec = &found[0];
    assert_eq!(rec.key(), &abandoned);
    assert_eq!(rec.token(), lease.token());
    assert_eq!(rec.recovery_point(), Some(&b"charged-card"[..]));
    assert_eq!(rec.created_ms(), T0);
    assert_eq!(rec.lease_until_ms(), T0 + 10_000);

    // With an age limit, the slow one (valid lease, 11 s old) shows too.
    assert_eq!(
        ids(store.compensation(Some(secs(5))).unwrap()),
        vec!["acme/pay/abandoned", "acme/pay/slow"]
    );
    assert_eq!(
        ids(store.compensation(Some(secs(20))).unwrap()),
        vec!["acme/pay/abandoned"]
    );
    drop(slow_lease);
}

#[test]
fn a_scan_reads_one_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    for i in 0..3 {
        acquire(&store, &key("s", &format!("k{i}")), &ClaimOptions::new());
    }
    let scan = store.scan(&Filter::new()).unwrap();
    // Written after the scan began: not in it.
    acquire(&store, &key("s", "late"), &ClaimOptions::new());
    assert_eq!(ids(scan), vec!["s/k0", "s/k1", "s/k2"]);
    assert_eq!(ids(store.scan(&Filter::new()).unwrap()).len(), 4);
}

#[test]
fn scan_filters_by_state_scope_prefix_and_age() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    // Scopes of different lengths sharing a prefix, and one that does not.
    let old = key("acme/a", "old");
    acquire(&store, &old, &ClaimOptions::new());
    clock.advance(secs(30));
    let l = acquire(&store, &key("acme/tickets", "done"), &ClaimOptions::new());
    store.complete(&l, b"T-1").unwrap();
    let l = acquire(&store, &key("acme/tickets", "failed"), &ClaimOptions::new());
    store.fail(&l, b"boom", true).unwrap();
    acquire(&store, &key("acmeX", "other"), &ClaimOptions::new());
    acquire(&store, &key("beta/a", "x"), &ClaimOptions::new());

    let all = |f: Filter| ids(store.scan(&f).unwrap());
    assert_eq!(
        all(Filter::new().scope_prefix("acme/")),
        vec!["acme/a/old", "acme/tickets/done", "acme/tickets/failed"]
    );
    assert_eq!(all(Filter::new().scope_prefix("acme")).len(), 4);
    assert_eq!(
        all(Filter::new().state(State::Succeeded)),
        vec!["acme/tickets/done"]
    );
    assert_eq!(
        all(Filter::new()
            .state(State::Succeeded)
            .state(State::Failed { retryable: true })),
        vec!["acme/tickets/done", "acme/tickets/failed"]
    );
    assert_eq!(all(Filter::new().older_than(secs(20))), vec!["acme/a/old"]);
    assert_eq!(all(Filter::new().lapsed()), vec!["acme/a/old"]);
    assert_eq!(all(Filter::new().scope_prefix("nobody")).len(), 0);
    assert!(matches!(
        store.scan(&Filter::new().scope_prefix("x".repeat(129))),
        Err(Error::InvalidArgument { .. })
    ));
    // Past retention, records vanish from scans as from `get`.
    clock.advance(secs(120));
    assert!(all(Filter::new()).is_empty());
}

// --------------------------------------------------------------------- resolve

#[test]
fn resolve_is_fenced_by_the_token_and_durable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let k = key("acme/pay", "order-7");
    let (stale, newer) = {
        let store = open(&path, &clock);
        let first = acquire(&store, &k, &ClaimOptions::new());
        clock.advance(secs(11));
        // The reconciler sees the lapsed record with token t1...
        let seen: Vec<Record> = store
            .compensation(None)
            .unwrap()
            .collect::<idemstore::Result<_>>()
            .unwrap();
        assert_eq!(seen[0].token(), first.token());
        // ...but meanwhile a retry takes the key over.
        let second = acquire(&store, &k, &ClaimOptions::new());
        assert!(second.token() > first.token());
        // Resolving with the old token must not overwrite the new holder.
        let err = store
            .resolve(&k, first.token(), Resolution::Succeeded(b"T-1".to_vec()))
            .unwrap_err();
        assert!(matches!(err, Error::StaleLease { .. }), "{err}");
        let rec = store.get(&k).unwrap().unwrap();
        assert_eq!(
            (rec.state(), rec.token()),
            (State::Processing, second.token())
        );

        // Resolving the current token finishes the record...
        let resolved = store
            .resolve(
                &k,
                second.token(),
                Resolution::Failed {
                    failure: b"gateway says declined".to_vec(),
                    retryable: false,
                },
            )
            .unwrap();
        assert_eq!(resolved.state(), State::Failed { retryable: false });
        assert_eq!(resolved.expires_ms(), clock.now_ms() + 60_000);
        (first, second)
    };
    // ...durably: after reopen the failure replays, and the holder whose
    // lease it was can no longer complete, nor can a second resolve run.
    let store = open(&path, &clock);
    match store
        .claim(&k, &fp("payload"), &ClaimOptions::new())
        .unwrap()
    {
        ClaimOutcome::Replay(rec) => {
            assert_eq!(rec.failure(), Some(&b"gateway says declined"[..]));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        store.complete(&newer, b"late"),
        Err(Error::StaleLease { .. })
    ));
    assert!(matches!(
        store.resolve(&k, newer.token(), Resolution::Succeeded(vec![])),
        Err(Error::StaleLease { .. })
    ));
    assert!(matches!(
        store.resolve(&k, stale.token(), Resolution::Succeeded(vec![])),
        Err(Error::StaleLease { .. })
    ));
}

#[test]
fn resolve_checks_value_limits() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = Store::open_with(
        dir.path().join("s.redb"),
        config(&clock).max_result_bytes(4),
    )
    .unwrap();
    let k = key("s", "k");
    let lease = acquire(&store, &k, &ClaimOptions::new());
    assert!(matches!(
        store.resolve(&k, lease.token(), Resolution::Succeeded(b"12345".to_vec())),
        Err(Error::TooLarge { .. })
    ));
    assert_eq!(store.get(&k).unwrap().unwrap().state(), State::Processing);
    let done = store
        .resolve(&k, lease.token(), Resolution::Succeeded(b"1234".to_vec()))
        .unwrap();
    assert_eq!(done.result(), Some(&b"1234"[..]));
}

// --------------------------------------------------------------- business keys

fn conflict(store: &Store, k: &Key, bk: &str) -> (Key, State) {
    match store.claim(
        k,
        &fp(&format!("{k}")),
        &ClaimOptions::new().business_key(bk),
    ) {
        Err(Error::BusinessKeyConflict {
            business_key,
            existing,
            state,
        }) => {
            assert_eq!(business_key, bk);
            (existing, state)
        }
        other => panic!("expected a business-key conflict for {k}, got {other:?}"),
    }
}

#[test]
fn a_business_key_is_unique_per_scope_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let first = key("acme/orders", "req-1");
    let bk = ClaimOptions::new().business_key("order-42");
    {
        let store = open(&path, &clock);
        let lease = acquire(&store, &first, &bk);
        assert_eq!(
            conflict(&store, &key("acme/orders", "req-2"), "order-42"),
            (first.clone(), State::Processing)
        );
        // Nothing was written for the refused key.
        assert!(store.get(&key("acme/orders", "req-2")).unwrap().is_none());
        // Another business key, or another scope, is free.
        acquire(
            &store,
            &key("acme/orders", "req-3"),
            &ClaimOptions::new().business_key("order-43"),
        );
        acquire(&store, &key("other/orders", "req-2"), &bk);
        // The same idempotency key is answered as usual, not as a conflict.
        assert!(matches!(
            store.claim(&first, &fp("payload"), &bk).unwrap(),
            ClaimOutcome::InProgress { .. }
        ));
        store.complete(&lease, b"shipped").unwrap();
        let err = store
            .claim(&key("acme/orders", "req-2"), &fp("x"), &bk)
            .unwrap_err();
        assert!(err.is_client_error());
    }
    let store = open(&path, &clock);
    assert_eq!(
        conflict(&store, &key("acme/orders", "req-9"), "order-42"),
        (first.clone(), State::Succeeded)
    );
    let report = store.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.bindings, 3);
}

#[test]
fn a_business_key_is_freed_by_release() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let bk = ClaimOptions::new().business_key("T-100");
    let lease = acquire(&store, &key("s", "a"), &bk);
    conflict(&store, &key("s", "b"), "T-100");
    store.release(lease).unwrap();
    acquire(&store, &key("s", "b"), &bk);
    assert_eq!(conflict(&store, &key("s", "a"), "T-100").0, key("s", "b"));
    assert!(store.verify(|_| {}).unwrap().is_clean());
}

#[test]
fn a_business_key_is_held_through_takeover_and_retryable_failure() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let bk = ClaimOptions::new().business_key("B");
    let holder = key("s", "a");
    let lease = acquire(&store, &holder, &bk);
    clock.advance(secs(11));
    // A takeover keeps the binding.
    let lease2 = acquire(&store, &holder, &ClaimOptions::new());
    assert!(lease2.token() > lease.token());
    assert_eq!(conflict(&store, &key("s", "b"), "B").1, State::Processing);
    store.fail(&lease2, b"try again", true).unwrap();
    assert_eq!(
        conflict(&store, &key("s", "b"), "B").1,
        State::Failed { retryable: true }
    );
}

#[test]
fn a_business_key_is_freed_by_retention_and_its_old_record_is_evicted_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let bk = ClaimOptions::new().business_key("order-1");
    let old = key("s", "old");
    let lease = acquire(&store, &old, &bk);
    store.complete(&lease, b"done").unwrap();
    clock.advance(secs(61));
    // Past retention, before any eviction: the business key is free.
    let newer = key("s", "new");
    let new_lease = acquire(&store, &newer, &bk);
    // The claim that took the business key evicted the old record (were it
    // kept, a clock stepping back could make it live beside the new
    // holder), and kept the new holder's binding.
    assert_eq!(store.len().unwrap(), 1);
    assert_eq!(store.sweep(100).unwrap(), 0);
    assert_eq!(store.stats().unwrap().counters.evictions, 1);
    assert!(store.get(&old).unwrap().is_none());
    assert_eq!(
        conflict(&store, &key("s", "third"), "order-1"),
        (newer.clone(), State::Processing)
    );
    // The old key, now absent, is itself refused while the new holder lives.
    assert_eq!(conflict(&store, &old, "order-1").0, newer);
    // After the new record's retention and its eviction the key is free.
    store.complete(&new_lease, b"x").unwrap();
    clock.advance(secs(61));
    assert_eq!(store.sweep(100).unwrap(), 1);
    let report = store.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.bindings, 0);
    acquire(&store, &key("s", "fourth"), &bk);
}

#[test]
fn a_reclaimed_key_past_retention_rebinds_its_business_key() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let k = key("s", "k");
    let lease = acquire(&store, &k, &ClaimOptions::new().business_key("A"));
    store.complete(&lease, b"1").unwrap();
    clock.advance(secs(61));
    // The same key, past retention, claimed for another business key.
    acquire(&store, &k, &ClaimOptions::new().business_key("B"));
    acquire(
        &store,
        &key("s", "other"),
        &ClaimOptions::new().business_key("A"),
    );
    assert_eq!(conflict(&store, &key("s", "x"), "B").0, k);
    let report = store.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[test]
fn an_invalid_business_key_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    for bad in [String::new(), "x".repeat(256), "a\nb".to_string()] {
        let err = store
            .claim(
                &key("s", "k"),
                &fp("p"),
                &ClaimOptions::new().business_key(bad),
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    what: "business_key",
                    ..
                }
            ),
            "{err}"
        );
    }
    assert!(store.is_empty().unwrap());
}

// ----------------------------------------------------------------------- stats

#[test]
fn stats_count_states_and_every_kind_of_answer() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let s0 = store.stats().unwrap();
    assert_eq!(s0.counters, idemstore::Counters::default());
    assert_eq!(s0.counters.duplicate_hit_rate(), None);
    assert_eq!(s0.records.total(), 0);
    assert!(s0.file_bytes.unwrap() > 0);

    let bk = ClaimOptions::new().business_key("order-1");
    let a = acquire(&store, &key("s", "a"), &bk); // claim 1: acquired
    store.complete(&a, b"ok").unwrap();
    let _ = store.claim(&key("s", "a"), &fp("payload"), &bk).unwrap(); // 2: replay
    let _ = store.claim(&key("s", "a"), &fp("other"), &bk).unwrap_err(); // 3: mismatch
    let _ = store
        .claim(&key("s", "z"), &fp("payload"), &bk)
        .unwrap_err(); // 4: conflict
    let b = acquire(&store, &key("s", "b"), &ClaimOptions::new()); // 5: acquired
    let _ = store
        .claim(&key("s", "b"), &fp("payload"), &ClaimOptions::new())
        .unwrap(); // 6: in progress
    clock.advance(secs(11));
    let b2 = acquire(&store, &key("s", "b"), &ClaimOptions::new()); // 7: takeover
    assert!(matches!(
        store.complete(&b, b"x"),
        Err(Error::StaleLease { .. })
    ));
    let c = acquire(&store, &key("s", "c"), &ClaimOptions::new()); // 8
    store.fail(&c, b"no", true).unwrap();
    let d = acquire(&store, &key("s", "d"), &ClaimOptions::new()); // 9
    store.fail(&d, b"no", false).unwrap();
    clock.advance(secs(3));

    let s = store.stats().unwrap();
    let n = s.counters;
    assert_eq!(n.claims, 9);
    assert_eq!(n.acquired, 5);
    assert_eq!(n.replays, 1);
    assert_eq!(n.in_progress, 1);
    assert_eq!(n.fingerprint_mismatches, 1);
    assert_eq!(n.business_key_conflicts, 1);
    assert_eq!(n.stale_lease_rejections, 1);
    assert_eq!(n.takeovers, 1);
    assert_eq!(n.evictions, 0);
    assert_eq!(n.duplicate_hit_rate(), Some(3.0 / 9.0));
    let r = s.records;
    assert_eq!(
        (
            r.processing,
            r.lapsed,
            r.succeeded,
            r.failed,
            r.failed_retryable
        ),
        (1, 0, 1, 1, 1)
    );
    // "b" was first acquired at T0, 14 s ago.
    assert_eq!(s.oldest_processing_age_ms, Some(14_000));
    assert_eq!(s.now_ms, T0 + 14_000);

    clock.advance(secs(11));
    assert_eq!(store.stats().unwrap().records.lapsed, 1);
    store.complete(&b2, b"y").unwrap();
    clock.advance(secs(120));
    let s = store.stats().unwrap();
    assert_eq!(s.records.expired, 4);
    assert_eq!(s.records.live(), 0);
    assert_eq!(s.oldest_processing_age_ms, None);
    assert_eq!(store.sweep(100).unwrap(), 4);
    let s = store.stats().unwrap();
    assert_eq!(s.counters.evictions, 4);
    assert_eq!(s.records.total(), 0);
}

/// `stats` reads stored counts, not every record: a record damaged behind
/// the store's back (its state byte intact) is still counted in its state,
/// and `verify`, which reads every record, names it.
#[test]
fn stats_count_a_damaged_record_in_its_state_and_verify_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    {
        let store = open(&path, &clock);
        acquire(&store, &key("s", "good"), &ClaimOptions::new());
        acquire(&store, &key("s", "bad"), &ClaimOptions::new());
    }
    damage_record(&path, &key("s", "bad"));
    let store = open(&path, &clock);
    let s = store.stats().unwrap();
    assert_eq!((s.records.corrupt, s.records.processing), (0, 2));
    let report = store.verify(|_| {}).unwrap();
    assert!(!report.is_clean());
    assert_eq!(report.records, 2);
    assert_eq!(report.problems.len(), 1, "{report:?}");
    assert_eq!(report.problems[0].key, "s/bad");
    assert!(report.problems[0].detail.contains("checksum"));
    // Scans report it and go on.
    let results: Vec<_> = store.scan(&Filter::new()).unwrap().collect();
    assert_eq!(results.len(), 2);
    assert_eq!(results.iter().filter(|r| r.is_err()).count(), 1);
}

// ----------------------------------------------------------------------- audit

/// One captured `tracing` event: level and fields.
#[derive(Debug, Clone)]
struct Captured {
    level: tracing::Level,
    fields: BTreeMap<String, String>,
}

struct Capture(Arc<Mutex<Vec<Captured>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let targets = [
            "idemstore::audit",
            "idemstore::sweep",
            "idemstore::checkpoint",
        ];
        if !targets.contains(&event.metadata().target()) {
            return;
        }
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(Captured {
            level: *event.metadata().level(),
            fields,
        });
    }
}

/// The audit, sweep and checkpoint events of every test in this binary (the writer emits on its own
/// thread, so the subscriber must be global); each test filters by scope.
fn captured() -> Arc<Mutex<Vec<Captured>>> {
    static EVENTS: OnceLock<Arc<Mutex<Vec<Captured>>>> = OnceLock::new();
    EVENTS
        .get_or_init(|| {
            let events = Arc::new(Mutex::new(Vec::new()));
            let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
            tracing::subscriber::set_global_default(subscriber).unwrap();
            events
        })
        .clone()
}

fn events_of(scope: &str) -> Vec<Captured> {
    captured()
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.fields.get("scope").map(String::as_str) == Some(scope))
        .cloned()
        .collect()
}

fn summary(e: &Captured) -> String {
    let f = |k: &str| e.fields.get(k).cloned().unwrap_or_default();
    format!(
        "{} {} {} {}->{} t{}",
        e.level,
        f("cause"),
        f("id"),
        f("from"),
        f("to"),
        f("token")
    )
}

#[test]
fn every_transition_is_one_audit_event() {
    let events = captured();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(T0);
    let store = open(&dir.path().join("s.redb"), &clock);
    let scope = "audit/one";
    let a = acquire(&store, &key(scope, "a"), &ClaimOptions::new()); // token 1
    store.complete(&a, b"ok").unwrap();
    let b = acquire(&store, &key(scope, "b"), &ClaimOptions::new()); // 2
    store.fail(&b, b"no", true).unwrap();
    let b2 = acquire(&store, &key(scope, "b"), &ClaimOptions::new()); // 3
    store.release(b2).unwrap();
    let c = acquire(&store, &key(scope, "c"), &ClaimOptions::new()); // 4
    clock.advance(secs(11));
    let c2 = acquire(&store, &key(scope, "c"), &ClaimOptions::new()); // 5: takeover
    assert!(store.complete(&c, b"late").is_err()); // stale lease
    store
        .resolve(
            &key(scope, "c"),
            c2.token(),
            Resolution::Succeeded(b"r".to_vec()),
        )
        .unwrap();
    // Replays and extends are not transitions.
    let _ = store
        .claim(&key(scope, "a"), &fp("payload"), &ClaimOptions::new())
        .unwrap();
    clock.advance(secs(120));
    assert_eq!(store.sweep(100).unwrap(), 2);
    drop(store);

    // Answers without a write (the replay above) carry no cause.
    let got: Vec<String> = events_of(scope)
        .iter()
        .filter(|e| e.fields.contains_key("cause"))
        .map(summary)
        .collect();
    assert_eq!(
        got,
        vec![
            "INFO claim a none->processing t1",
            "INFO complete a processing->succeeded t1",
            "INFO claim b none->processing t2",
            "INFO fail b processing->failed-retryable t2",
            "INFO claim b failed-retryable->processing t3",
            "INFO release b processing->none t3",
            "INFO claim c none->processing t4",
            "WARN takeover c processing->processing t5",
            "WARN stale-lease c -> t4",
            "INFO resolve c processing->succeeded t5",
            "INFO evict a succeeded->none t1",
            "INFO evict c succeeded->none t5",
        ]
    );
    drop(events);
}

#[test]
fn a_corrupt_record_is_a_warning() {
    let events = captured();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let k = key("audit/corrupt", "k");
    {
        let store = open(&path, &clock);
        acquire(&store, &k, &ClaimOptions::new());
    }
    damage_record(&path, &k);
    let store = open(&path, &clock);
    assert!(matches!(
        store.claim(&k, &fp("payload"), &ClaimOptions::new()),
        Err(Error::CorruptRecord { .. })
    ));
    let warned = events.lock().unwrap().iter().any(|e| {
        e.level == tracing::Level::WARN
            && e.fields.get("cause").map(String::as_str) == Some("corruption")
            && e.fields
                .get("key")
                .is_some_and(|k| k.contains("audit/corrupt/k"))
    });
    assert!(warned);
}

/// Every public operation opens a `tracing` span named `idemstore.<op>`,
/// carrying the key's scope and id and never a payload (fingerprint,
/// result, failure or recovery point).
#[test]
fn each_operation_opens_a_span_without_payloads() {
    /// A span's name and its field names.
    type Seen = (String, Vec<String>);
    #[derive(Clone, Default)]
    struct Spans(Arc<Mutex<Vec<Seen>>>);
    impl<S: tracing::Subscriber> Layer<S> for Spans {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _id: &tracing::span::Id,
            _ctx: Context<'_, S>,
        ) {
            let fields = attrs.fields().iter().map(|f| f.name().to_owned()).collect();
            self.0
                .lock()
                .unwrap()
                .push((attrs.metadata().name().to_owned(), fields));
        }
    }

    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let dir = common::TestDir::new();
    let store = dir.open();
    let k = key("acme/tickets", "k");
    tracing::subscriber::with_default(subscriber, || {
        let claimed = store.claim(&k, &fp("p"), &ClaimOptions::new()).unwrap();
        let lease = common::acquired(claimed);
        store.set_recovery_point(&lease, b"step-1").unwrap();
        store.extend(&lease, common::secs(10)).unwrap();
        store.complete(&lease, b"secret result").unwrap();
        store.get(&k).unwrap();
        store.stats().unwrap();
    });
    let seen = spans.0.lock().unwrap().clone();
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    for op in [
        "idemstore.claim",
        "idemstore.set_recovery_point",
        "idemstore.extend",
        "idemstore.complete",
        "idemstore.get",
        "idemstore.stats",
    ] {
        assert!(names.contains(&op), "{op} in {names:?}");
    }
    for (name, fields) in &seen {
        for field in fields {
            assert!(
                field == "scope" || field == "id",
                "{name} carries {field}: only the key's scope and id are allowed"
            );
        }
    }
}

// ----------------------------------------------------------------------- stats

/// What `stats` must report, counted by reading every record: live records
/// by state from a scan, lapsed leases and the oldest in flight from the
/// same records, and expired ones as the stored records the scan leaves out.
fn check_stats_against_every_record(store: &Store, what: &str) {
    let stats = store.stats().unwrap();
    let now = stats.now_ms;
    let live: Vec<Record> = store
        .scan(&Filter::new())
        .unwrap()
        .map(|r| r.unwrap())
        .collect();
    let count = |want: State| live.iter().filter(|r| r.state() == want).count() as u64;
    let r = &stats.records;
    assert_eq!(r.processing, count(State::Processing), "{what}: {stats:?}");
    assert_eq!(r.succeeded, count(State::Succeeded), "{what}: {stats:?}");
    assert_eq!(
        r.failed,
        count(State::Failed { retryable: false }),
        "{what}: {stats:?}"
    );
    assert_eq!(
        r.failed_retryable,
        count(State::Failed { retryable: true }),
        "{what}: {stats:?}"
    );
    let lapsed = live
        .iter()
        .filter(|r| r.state() == State::Processing && now >= r.lease_until_ms())
        .count() as u64;
    assert_eq!(r.lapsed, lapsed, "{what}: {stats:?}");
    let oldest = live
        .iter()
        .filter(|r| r.state() == State::Processing)
        .map(|r| now - r.created_ms())
        .max();
    assert_eq!(stats.oldest_processing_age_ms, oldest, "{what}: {stats:?}");
    assert_eq!(r.corrupt, 0, "{what}: {stats:?}");
    assert_eq!(
        r.expired,
        store.len().unwrap() - live.len() as u64,
        "{what}: {stats:?}"
    );
    let report = store.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{what}: {report:?}");
}

/// `stats` reads stored state counts and an index of the records in
/// flight, not every record: after every step of a random run (claims,
/// completions, failures, releases, resolves, sweeps, clock moves, reopens,
/// an export imported into a second store) it agrees with a count made by
/// reading every record, and `verify` finds the counts in step.
#[test]
fn stats_from_stored_counts_match_a_count_of_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let mut store = Some(open(&path, &clock));
    let mut leases: Vec<Lease> = Vec::new();
    let mut rng = common::Rng::new(0x5747_a7e5);
    let mut kinds = [0u32; 10];
    for step in 0..500 {
        let s = store.as_ref().unwrap();
        let k = key("stats", &format!("k{}", rng.below(24)));
        let kind = rng.below(10) as usize;
        kinds[kind] += 1;
        match kind {
            0..=2 => {
                let lease = Duration::from_secs(1 + rng.below(20));
                if let Ok(ClaimOutcome::Acquired(l)) =
                    s.claim(&k, &fp("payload"), &ClaimOptions::new().lease(lease))
                {
                    leases.push(l);
                }
            }
            3 => {
                if let Some(l) = leases.pop() {
                    let _ = s.complete(&l, b"ok");
                }
            }
            4 => {
                if let Some(l) = leases.pop() {
                    let _ = s.fail(&l, b"no", rng.one_in(2));
                }
            }
            5 => {
                if let Some(l) = leases.pop() {
                    let _ = s.release(l);
                }
            }
            6 => {
                if let Some(l) = leases.pop() {
                    let outcome = if rng.one_in(2) {
                        Resolution::Succeeded(b"resolved".to_vec())
                    } else {
                        Resolution::Failed {
                            failure: b"resolved".to_vec(),
                            retryable: rng.one_in(2),
                        }
                    };
                    let _ = s.resolve(l.key(), l.token(), outcome);
                }
            }
            7 => clock.advance(secs(rng.below(45))),
            8 => {
                s.sweep(1 + rng.below(4) as usize).unwrap();
            }
            _ => {
                drop(store.take());
                store = Some(open(&path, &clock));
            }
        }
        check_stats_against_every_record(store.as_ref().unwrap(), &format!("step {step}"));
        if step % 100 == 99 {
            let mut stream = Vec::new();
            store.as_ref().unwrap().export(&mut stream, |_| {}).unwrap();
            let copy = open(&dir.path().join(format!("copy-{step}.redb")), &clock);
            copy.import(stream.as_slice(), |_| {}).unwrap();
            check_stats_against_every_record(&copy, &format!("import after step {step}"));
        }
    }
    // Every kind of step ran, and the store held records of every state.
    assert!(kinds.iter().all(|n| *n > 10), "{kinds:?}");
}

// ----------------------------------------------------------------- sweep cost

/// The named numeric fields of the captured events of the store at `path`
/// that carry every one of them, in the order emitted: a sweep's
/// `["visited", "evicted"]`, a checkpoint's `["epoch", "seq", "took_ms"]`.
fn u64_fields<const N: usize>(path: &Path, keys: [&str; N]) -> Vec<[u64; N]> {
    let path = path.display().to_string();
    captured()
        .lock()
        .unwrap()
        .iter()
        .filter(|e| {
            e.fields.get("path") == Some(&path) && keys.iter().all(|k| e.fields.contains_key(*k))
        })
        .map(|e| keys.map(|k| e.fields[k].parse::<u64>().unwrap()))
        .collect()
}

/// Each checkpoint emits one debug event (target `idemstore::checkpoint`)
/// with the epoch it starts, the sequence number it covers and how long it
/// held the writer (`took_ms`): what an operator correlates with a pause
/// of every write (docs/operations.md).
#[test]
fn each_checkpoint_is_one_event_with_how_long_it_held_the_writer() {
    let _events = captured();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let store = open(&path, &clock);
    let before = u64_fields(&path, ["epoch", "seq", "took_ms"]).len();
    for i in 0..3 {
        let lease = acquire(
            &store,
            &key("ck/events", &format!("k{i}")),
            &ClaimOptions::new(),
        );
        store.complete(&lease, b"ok").unwrap();
        store.checkpoint().unwrap();
    }
    // The event follows the answer on the writer's thread: the drop joins
    // it (its closing checkpoint emits none).
    drop(store);
    let got = u64_fields(&path, ["epoch", "seq", "took_ms"]);
    let got = &got[before..];
    assert_eq!(got.len(), 3, "{got:?}");
    for pair in got.windows(2) {
        let ([e0, s0, _], [e1, s1, _]) = (pair[0], pair[1]);
        assert_eq!(e1, e0 + 1, "one epoch per checkpoint: {got:?}");
        // Each covers the claim and completion written since the last.
        assert!(s1 > s0, "{got:?}");
    }
}

/// A sweep reads the expiry index entries that are due (up to its limit,
/// and the rest of that limit's millisecond) and one more per range
/// (finished records, records in flight), never the rest: the same
/// count on a store of 20 records as on one of 5,000 (DESIGN.md, retention;
/// the performance issue's "a sweep whose work grows with the entries that
/// are due").
#[test]
fn a_sweep_visits_the_due_entries_whatever_the_store_size() {
    let _events = captured();
    let mut seen = Vec::new();
    for size in [20usize, 5_000] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let clock = ManualClock::new(T0);
        let store = open(&path, &clock);
        let scope = "sweep/cost";
        // Due first: 7 finished records, then the rest 10 s later, and a
        // few in flight whose leases run past every finished expiry.
        let done = |id: String| {
            let lease = acquire(&store, &key(scope, &id), &ClaimOptions::new());
            store.complete(&lease, b"ok").unwrap();
        };
        (0..7).for_each(|i| done(format!("due-{i}")));
        clock.advance(secs(10));
        (0..size).for_each(|i| done(format!("kept-{i}")));
        let long = ClaimOptions::new().lease(secs(3_600));
        for i in 0..3 {
            acquire(&store, &key(scope, &format!("in-flight-{i}")), &long);
        }
        // Past the first records' retention (60 s), before the others'.
        clock.advance(secs(55));
        // A sweep stopped by its limit reads on to the end of that
        // millisecond's entries (the 7 share one), and one past them.
        assert_eq!(store.sweep(3).unwrap(), 3);
        assert_eq!(store.sweep(usize::MAX).unwrap(), 4);
        // And a sweep with nothing due reads one entry per range.
        assert_eq!(store.sweep(usize::MAX).unwrap(), 0);
        drop(store);
        let sweeps = u64_fields(&path, ["visited", "evicted"]);
        assert_eq!(
            sweeps,
            vec![[7 + 1 + 1, 3], [4 + 2, 4], [2, 0]],
            "store of {size} records"
        );
        seen.push(sweeps);
    }
    assert_eq!(seen[0], seen[1]);
}

/// The background sweeper does not wait its whole interval after an open:
/// a store reopened with records that came due meanwhile is swept about a
/// second later, although the interval is an hour (a store that churns is
/// then swept every second while sweeps find records due; an idle one
/// as soon as a record comes due: the next test).
#[test]
fn the_background_sweeper_catches_up_after_open_without_waiting_its_interval() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    {
        let store = open(&path, &clock);
        for i in 0..20 {
            let lease = acquire(
                &store,
                &key("sweep/open", &format!("due-{i}")),
                &ClaimOptions::new(),
            );
            store.complete(&lease, b"ok").unwrap();
        }
    }
    clock.advance(secs(61));
    let store = Store::open_with(&path, config(&clock).sweep_interval(Some(secs(3600)))).unwrap();
    assert_eq!(store.stats().unwrap().records.expired, 20);
    // A hang guard, not a timing assertion: the hourly interval would
    // leave them far longer.
    all_swept_by_the_sweeper(&store, 20, std::time::Instant::now() + secs(120));
}

/// Waits until the background sweeper of the store at `path` emitted its
/// first sweep event (a store opened with `captured()` events); fails at
/// `guard` (a hang guard).
fn first_sweep_seen(path: &Path, guard: std::time::Instant) {
    while u64_fields(path, ["evicted"]).is_empty() {
        assert!(std::time::Instant::now() < guard, "no first sweep");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until the background sweeper evicted every record past
/// retention, which are `due` in all and the store's only records; fails
/// at `guard` (a hang guard: the tests' hourly interval would leave them
/// far longer).
fn all_swept_by_the_sweeper(store: &Store, due: u64, guard: std::time::Instant) {
    while store.stats().unwrap().records.expired > 0 {
        assert!(std::time::Instant::now() < guard, "not swept");
        std::thread::sleep(Duration::from_millis(50));
    }
    let stats = store.stats().unwrap();
    assert_eq!(stats.counters.evictions, due);
    assert_eq!(stats.records.total(), 0);
}

/// The background sweeper of a store whose last sweep found nothing due
/// reads the first deadline of its expiry index at every tick (each
/// second) and sweeps as soon as a record has come due, not at the end of
/// its interval (an hour): a store that starts to churn after an idle
/// sweep has its records evicted as they come due, instead of all at once
/// an interval later. With an interval of a second, where the sweeper
/// skips the interval's sweep while nothing is due, a record coming due is
/// swept all the same.
#[test]
fn an_idle_sweeper_sweeps_as_soon_as_a_record_comes_due() {
    for interval in [secs(3600), secs(1)] {
        idle_store_swept_once_due(interval);
    }
}

/// A store swept every `interval` whose first sweep finds nothing due,
/// then holds 20 records that come due: all are evicted by the sweeper.
fn idle_store_swept_once_due(interval: Duration) {
    let _events = captured();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let store = Store::open_with(&path, config(&clock).sweep_interval(Some(interval))).unwrap();
    // Hang guards, not timing assertions: the hourly interval, or a
    // sweeper that went on skipping sweeps, would leave the records far
    // longer.
    let guard = std::time::Instant::now() + secs(120);
    // The first sweep, about a second after open, finds an empty store.
    first_sweep_seen(&path, guard);
    assert!(u64_fields(&path, ["evicted"]).iter().all(|[n]| *n == 0));
    for i in 0..20 {
        let lease = acquire(
            &store,
            &key("sweep/idle", &format!("due-{i}")),
            &ClaimOptions::new(),
        );
        store.complete(&lease, b"ok").unwrap();
    }
    // Past the retention (60 s), far short of the interval. (The sweeper
    // may evict them as soon as the clock moves.)
    clock.advance(secs(61));
    all_swept_by_the_sweeper(&store, 20, guard);
}

/// An idle sweeper writes nothing: on an idle store (the real clock,
/// nothing due) the log file is not written while the sweeper ticks every
/// second, with an hourly interval or one of a second. Reading the store's
/// time for its look at the expiry index would renew its time reservation
/// (a log frame and an fsync) at every tick, and so would a sweep that
/// finds nothing due, once per interval.
#[test]
fn an_idle_sweeper_writes_nothing() {
    for interval in [secs(3600), secs(1)] {
        idle_store_unwritten(interval);
    }
}

/// A store that holds nothing, swept every `interval`, whose log is
/// not written for three seconds once the first sweep is done.
fn idle_store_unwritten(interval: Duration) {
    let _events = captured();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let store = Store::open_with(
        &path,
        Config::new()
            .sweep_interval(Some(interval))
            .scrub_rate(None),
    )
    .unwrap();
    // A hang guard, not a timing assertion.
    let guard = std::time::Instant::now() + secs(120);
    first_sweep_seen(&path, guard);
    let mut log = path.clone().into_os_string();
    log.push("-wal");
    let written = || std::fs::metadata(&log).unwrap().modified().unwrap();
    // Past what the first sweep wrote (its event comes before its batch
    // is durable): the log unwritten for two ticks...
    let mut before = written();
    loop {
        std::thread::sleep(secs(2));
        let now = written();
        if now == before {
            break;
        }
        assert!(
            std::time::Instant::now() < guard,
            "the log is written all the time"
        );
        before = now;
    }
    // ...and three more.
    std::thread::sleep(secs(3));
    assert_eq!(
        written(),
        before,
        "the log was written while the store was idle (interval {interval:?})"
    );
    drop(store);
}

/// `sweep_due` (the background sweeper's paced sweep) evicts every due
/// record, finished or in flight, in slices of at most `sweep_batch`
/// records (here 7) however many are due, and leaves the live ones: the
/// captured sweep events show slices of at most 7 evictions, and the store
/// holds exactly the live records afterwards.
#[test]
fn sweep_due_evicts_everything_due_in_bounded_slices() {
    let _events = captured();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let store = Store::open_with(&path, config(&clock).sweep_batch(7)).unwrap();
    let scope = "sweep/paced";
    for i in 0..300 {
        let lease = acquire(
            &store,
            &key(scope, &format!("due-{i}")),
            &ClaimOptions::new(),
        );
        if i % 3 != 0 {
            store.complete(&lease, b"ok").unwrap();
        }
    }
    clock.advance(secs(61));
    for i in 0..5 {
        acquire(
            &store,
            &key(scope, &format!("live-{i}")),
            &ClaimOptions::new(),
        );
    }
    assert_eq!(store.sweep_due().unwrap(), 300);
    assert_eq!(store.sweep(usize::MAX).unwrap(), 0);
    assert_eq!(store.len().unwrap(), 5);
    drop(store);
    let slices = u64_fields(&path, ["visited", "evicted"]);
    assert!(slices.len() >= 300 / 7, "{slices:?}");
    assert!(
        slices.iter().all(|[_, evicted]| *evicted <= 7),
        "{slices:?}"
    );
    assert_eq!(slices.iter().map(|[_, e]| e).sum::<u64>(), 300);
}

// ---------------------------------------------------------------- compaction

/// `compact_file` gives back to the file system the pages churn and
/// eviction freed: the file shrinks, every live record (and its lease's
/// token) is still there, the store verifies clean and goes on. A store
/// held open is refused (and left as it was), as are a store the scrub
/// marked damaged (not written to) and a missing file.
#[test]
fn compaction_gives_back_freed_space_and_keeps_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("churn.redb");
    let clock = ManualClock::new(T0);
    let buffered = || {
        config(&clock).durability(idemstore::Durability::Buffered {
            max_delay: Duration::from_millis(10),
        })
    };
    let result = vec![7u8; 2_000];
    let held;
    {
        let store = Store::open_with(&path, buffered()).unwrap();
        for n in 0..4_000 {
            let lease = acquire(
                &store,
                &key("churn", &format!("old-{n:05}")),
                &ClaimOptions::new(),
            );
            store.complete(&lease, &result).unwrap();
        }
        clock.advance(secs(61));
        for n in 0..50 {
            let lease = acquire(
                &store,
                &key("churn", &format!("new-{n:02}")),
                &ClaimOptions::new(),
            );
            store.complete(&lease, &result).unwrap();
        }
        held = acquire(&store, &key("churn", "held"), &ClaimOptions::new());
        let mut evicted = 0;
        loop {
            let n = store.sweep(1_000).unwrap();
            evicted += n;
            if n == 0 {
                break;
            }
        }
        assert_eq!(evicted, 4_000);
    }
    // Held open: refused, nothing changed.
    {
        let service = Store::open_with(&path, config(&clock)).unwrap();
        service.checkpoint().unwrap();
        let before = std::fs::metadata(&path).unwrap().len();
        assert!(matches!(
            idemstore::compact_file(&path, config(&clock)),
            Err(Error::AlreadyOpen { .. })
        ));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), before);
        assert_eq!(service.len().unwrap(), 51);
    }
    let done = idemstore::compact_file(&path, config(&clock)).unwrap();
    assert!(done.passes >= 1, "{done:?}");
    assert!(done.bytes_after < done.bytes_before / 4, "{done:?}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), done.bytes_after);
    let store = open(&path, &clock);
    assert_eq!(store.len().unwrap(), 51);
    for n in 0..50 {
        let record = store
            .get(&key("churn", &format!("new-{n:02}")))
            .unwrap()
            .unwrap();
        assert_eq!(record.result(), Some(&result[..]));
    }
    assert!(store.verify(|_| {}).unwrap().is_clean());
    // The lease taken before compaction still completes its record.
    store.complete(&held, b"done").unwrap();
    drop(store);
    // A store the online scrub marked damaged is refused before anything
    // is written to it.
    let marker = {
        let mut name = std::fs::canonicalize(&path).unwrap().into_os_string();
        name.push("-damaged");
        std::path::PathBuf::from(name)
    };
    std::fs::write(&marker, b"damaged").unwrap();
    let untouched = std::fs::read(&path).unwrap();
    assert!(matches!(
        idemstore::compact_file(&path, config(&clock)),
        Err(Error::Poisoned { .. })
    ));
    assert!(std::fs::read(&path).unwrap() == untouched);
    std::fs::remove_file(&marker).unwrap();
    assert!(matches!(
        idemstore::compact_file(dir.path().join("absent.redb"), config(&clock)),
        Err(Error::Missing { .. })
    ));
}

const KILLED_BEFORE_COMPACTION: &str = "compaction_after_a_kill_keeps_every_record";

/// A store killed while open (SIGKILL, records in its index and more in its
/// log only) compacts: the page check that runs before the compaction's
/// open does not take the crash for damage, and every acknowledged record
/// is there afterwards.
#[test]
fn compaction_after_a_kill_keeps_every_record() {
    if common::child_role(KILLED_BEFORE_COMPACTION) {
        let clock = ManualClock::new(common::child_var_parsed("T0"));
        let store = Store::open_with(common::child_var("STORE"), config(&clock)).expect("open");
        for n in 0..400 {
            let lease = acquire(
                &store,
                &key("kill", &format!("k{n:03}")),
                &ClaimOptions::new(),
            );
            store.complete(&lease, b"done").unwrap();
            if n == 199 {
                store.checkpoint().unwrap();
            }
        }
        common::ready_and_wait();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("killed.redb");
    let mut child = common::spawn_child(
        KILLED_BEFORE_COMPACTION,
        &[("STORE", common::path_var(&path)), ("T0", T0.to_string())],
    );
    child.wait_ready();
    child.kill();
    let clock = ManualClock::new(T0);
    idemstore::compact_file(&path, config(&clock)).unwrap();
    let store = Store::open_with(&path, config(&clock)).unwrap();
    for n in 0..400 {
        let record = store.get(&key("kill", &format!("k{n:03}"))).unwrap();
        assert_eq!(
            record.and_then(|r| r.result().map(<[u8]>::to_vec)),
            Some(b"done".to_vec()),
            "k{n:03}"
        );
    }
}

fn refused_read_only<T: std::fmt::Debug>(what: &str, answer: idemstore::Result<T>) {
    match answer {
        Err(Error::ReadOnly { operation, .. }) => assert_eq!(operation, what),
        other => panic!("{what} on a read-only store: expected ReadOnly, got {other:?}"),
    }
}

/// A store opened read-only (`Config::read_only`) answers reads and
/// refuses every change with `Error::ReadOnly`, applying none: a claim
/// that would only replay included, and each refused before any write.
#[test]
fn a_read_only_store_refuses_every_change_and_applies_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    let (held, done) = {
        let store = open(&path, &clock);
        let held = acquire(&store, &key("s", "held"), &ClaimOptions::new());
        let done = acquire(&store, &key("s", "done"), &ClaimOptions::new());
        let done = store.complete(&done, b"r").unwrap();
        (held, done)
    };
    let ro = Store::open_existing(&path, config(&clock).read_only(true)).unwrap();
    let mut export = Vec::new();
    ro.export(&mut export, |_| {}).unwrap();
    let opts = ClaimOptions::new();
    refused_read_only("claim", ro.claim(&key("s", "done"), &fp("payload"), &opts));
    refused_read_only("claim", ro.claim(&key("s", "new"), &fp("payload"), &opts));
    refused_read_only(
        "claim",
        ro.claim_many(&[(key("s", "new"), fp("payload"))], &opts),
    );
    refused_read_only("complete", ro.complete(&held, b"r"));
    refused_read_only("fail", ro.fail(&held, b"f", true));
    refused_read_only("extend", ro.extend(&held, secs(5)));
    refused_read_only("set_recovery_point", ro.set_recovery_point(&held, b"p"));
    let resolved = Resolution::Succeeded(b"r".to_vec());
    refused_read_only(
        "resolve",
        ro.resolve(&key("s", "held"), held.token(), resolved.clone()),
    );
    refused_read_only("amend", ro.amend(&key("s", "done"), done.token(), resolved));
    clock.advance(secs(3600));
    refused_read_only("sweep", ro.sweep(100));
    refused_read_only("sweep", ro.sweep_due());
    refused_read_only("import", ro.import(&export[..], |_| {}));
    refused_read_only("release", ro.release(held.clone()));
    // Reads answer, as of the clock (an hour on: both past retention).
    assert_eq!(ro.get(&key("s", "done")).unwrap(), None);
    assert_eq!(ro.len().unwrap(), 2, "nothing evicted");
    ro.checkpoint().unwrap();
    drop(ro);
    // Back at the time of the writes, nothing changed.
    let store = open(&path, &ManualClock::new(T0));
    assert_eq!(store.len().unwrap(), 2);
    let record = store.get(&key("s", "held")).unwrap().expect("held");
    assert_eq!(record.state(), State::Processing);
    assert_eq!(record.token(), held.token());
    assert_eq!(record.recovery_point(), None);
    assert_eq!(store.get(&key("s", "done")).unwrap(), Some(done));
}

/// A read-only open never creates a store: a missing path is
/// `Error::Missing`, and nothing appears there.
#[test]
fn a_read_only_open_of_a_missing_store_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.redb");
    let config = Config::new().read_only(true);
    assert!(matches!(
        Store::open_with(&path, config.clone()),
        Err(Error::Missing { .. })
    ));
    drop(Store::open(&path).expect("control: a plain open creates it"));
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(idemstore_log(&path)).unwrap();
    assert!(matches!(
        Store::open_with(&path, config),
        Err(Error::Missing { .. })
    ));
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "something was created"
    );
}

fn idemstore_log(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("-wal");
    name.into()
}

/// A read-only export under a clock ahead (an operator's host whose clock
/// is wrong) is taken at the store's time as found on disk: it leaves out
/// no record still live for the service, and imports into a store at the
/// service's time.
#[test]
fn a_read_only_export_under_a_clock_ahead_keeps_live_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(T0);
    {
        let store = open(&path, &clock);
        let lease = acquire(&store, &key("s", "live"), &ClaimOptions::new());
        store.complete(&lease, b"r").unwrap();
    }
    let ahead = ManualClock::new(T0 + 7_200_000);
    let ro = Store::open_existing(&path, config(&ahead).read_only(true)).unwrap();
    assert_eq!(
        ro.get(&key("s", "live")).unwrap(),
        None,
        "read at its clock"
    );
    let mut export = Vec::new();
    let summary = ro.export(&mut export, |_| {}).unwrap();
    assert_eq!(summary.records, 1, "a live record left out of the backup");
    drop(ro);
    let restored = open(
        &dir.path().join("restored.redb"),
        &ManualClock::new(T0 + 1_000),
    );
    let imported = restored.import(&export[..], |_| {}).unwrap();
    assert_eq!(imported.imported, 1);
    assert!(restored.get(&key("s", "live")).unwrap().is_some());
}

/// A read-only open of a file that holds no store (a redb file without
/// idemstore's metadata, an empty file) initialises nothing and creates no
/// log: `IncompatibleFile`.
#[test]
fn a_read_only_open_initialises_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.redb");
    drop(redb::Database::create(&path).unwrap());
    assert!(matches!(
        Store::open_existing(&path, Config::new().read_only(true)),
        Err(Error::IncompatibleFile { .. })
    ));
    // redb's own open sets flags in its header; no table was created.
    let db = redb::Database::open(&path).unwrap();
    let read = redb::ReadableDatabase::begin_read(&db).unwrap();
    assert_eq!(
        read.list_tables().unwrap().count(),
        0,
        "a store was initialised"
    );
    drop(read);
    drop(db);
    assert!(!idemstore_log(&path).exists(), "a log was created");
    let empty = dir.path().join("empty.redb");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        Store::open_with(&empty, Config::new().read_only(true)),
        Err(Error::IncompatibleFile { .. })
    ));
    assert!(!idemstore_log(&empty).exists(), "a log was created");
}
