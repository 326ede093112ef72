//! The metrics a store publishes agree with its own [`Store::stats`]: a
//! Prometheus recorder, installed as the thread-local recorder while the
//! store opens (its handles are registered then), sees every claim outcome,
//! a stale-lease write, an eviction and records in every state, driven by a
//! [`ManualClock`](idemstore::ManualClock) (no sleeps, no timing). Each
//! counter must equal its `Counters` field (`acquired + takeover` =
//! `Counters::acquired`), and each gauge, after `publish_gauges`, its
//! `Stats` value.

mod common;
#[cfg(feature = "postgres")]
mod pg;

use std::collections::BTreeMap;

use common::{TestDir, acquired, fp, key, lease_of, secs};
use idemstore::{ClaimOptions, ClaimOutcome, Error, Store};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The samples of a Prometheus text exposition: `name{labels}` → value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn metrics_counters_and_gauges_agree_with_stats() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let t = TestDir::new();
    let retention = secs(3600);
    let store =
        metrics::with_local_recorder(&recorder, || t.open_with(t.config().retention(retention)));
    let lease = lease_of(secs(10));

    // An eviction: a record completed, past retention, swept.
    let l = acquired(store.claim(&key("evicted"), &fp("p"), &lease).unwrap());
    store.complete(&l, b"ok").unwrap();
    t.clock.advance(retention + secs(1));
    assert_eq!(store.sweep(100).unwrap(), 1);

    // An expired record: completed, past retention, not swept.
    let l = acquired(store.claim(&key("expired"), &fp("p"), &lease).unwrap());
    store.complete(&l, b"ok").unwrap();
    t.clock.advance(retention + secs(1));

    // Succeeded, replayed twice; another payload for the same key.
    let l = acquired(store.claim(&key("a"), &fp("p"), &lease).unwrap());
    store.complete(&l, b"ok").unwrap();
    for _ in 0..2 {
        let out = store.claim(&key("a"), &fp("p"), &lease).unwrap();
        assert!(matches!(out, ClaimOutcome::Replay(_)), "{out:?}");
    }
    let err = store.claim(&key("a"), &fp("other"), &lease).unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { .. }), "{err:?}");

    // Failed permanently, replayed once.
    let l = acquired(store.claim(&key("b"), &fp("p"), &lease).unwrap());
    store.fail(&l, b"no", false).unwrap();
    let out = store.claim(&key("b"), &fp("p"), &lease).unwrap();
    assert!(matches!(out, ClaimOutcome::Replay(_)), "{out:?}");

    // Failed retryably, re-acquired (flagged by `is_takeover`, counted as
    // an acquisition, not a takeover), failed retryably again.
    let l = acquired(store.claim(&key("r"), &fp("p"), &lease).unwrap());
    store.fail(&l, b"later", true).unwrap();
    let l = acquired(store.claim(&key("r"), &fp("p"), &lease).unwrap());
    assert!(l.is_takeover());
    store.fail(&l, b"later", true).unwrap();

    // A business key held by another key.
    let bk = ClaimOptions::new().lease(secs(10)).business_key("order-1");
    let l = acquired(store.claim(&key("f"), &fp("p"), &bk).unwrap());
    store.complete(&l, b"ok").unwrap();
    let err = store.claim(&key("g"), &fp("p"), &bk).unwrap_err();
    assert!(matches!(err, Error::BusinessKeyConflict { .. }), "{err:?}");

    // In progress, then a takeover of the lapsed lease, then the first
    // holder's late `complete` is refused.
    let first = acquired(store.claim(&key("d"), &fp("p"), &lease).unwrap());
    let out = store.claim(&key("d"), &fp("p"), &lease).unwrap();
    assert!(matches!(out, ClaimOutcome::InProgress { .. }), "{out:?}");
    t.clock.advance(secs(11));
    let _second = acquired(store.claim(&key("d"), &fp("p"), &lease).unwrap());
    let err = store.complete(&first, b"late").unwrap_err();
    assert!(matches!(err, Error::StaleLease { .. }), "{err:?}");

    // Processing with a lapsed lease.
    let _e = acquired(
        store
            .claim(&key("e"), &fp("p"), &lease_of(secs(1)))
            .unwrap(),
    );
    t.clock.advance(secs(2));

    let stats = metrics::with_local_recorder(&recorder, || store.publish_gauges()).unwrap();
    assert_eq!(store.stats().unwrap(), stats, "nothing happened in between");
    let c = stats.counters;
    let r = stats.records;
    // What the run above did, so that no comparison below is 0 = 0.
    assert_eq!(c.acquired, 10);
    assert_eq!(c.takeovers, 1);
    assert_eq!(c.replays, 3);
    assert_eq!(c.in_progress, 1);
    assert_eq!(c.fingerprint_mismatches, 1);
    assert_eq!(c.business_key_conflicts, 1);
    assert_eq!(c.stale_lease_rejections, 1);
    assert_eq!(c.evictions, 1);
    assert_eq!(c.claims, 16);
    assert_eq!((r.processing, r.lapsed), (2, 1));
    assert_eq!((r.succeeded, r.failed, r.failed_retryable), (2, 1, 1));
    assert_eq!((r.expired, r.corrupt), (1, 0));
    // `d` was first acquired 13 s ago and taken over 2 s ago: the age runs
    // from the first acquisition.
    assert_eq!(stats.oldest_processing_age_ms, Some(13_000));

    let text = handle.render();
    let got = samples(&text);
    let value = |name: &str| -> u64 {
        let v = got
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("no {name} in\n{text}"));
        assert!(v >= 0.0 && v.fract() == 0.0, "{name} = {v}");
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = v as u64;
        n
    };
    let claims = |outcome: &str| value(&format!("idemstore_claims_total{{outcome=\"{outcome}\"}}"));

    assert_eq!(claims("acquired") + claims("takeover"), c.acquired);
    assert_eq!(claims("takeover"), c.takeovers);
    assert_eq!(claims("replay"), c.replays);
    assert_eq!(claims("in_progress"), c.in_progress);
    assert_eq!(claims("fingerprint_mismatch"), c.fingerprint_mismatches);
    assert_eq!(claims("business_key_conflict"), c.business_key_conflicts);
    let outcomes = [
        "acquired",
        "takeover",
        "replay",
        "in_progress",
        "fingerprint_mismatch",
        "business_key_conflict",
    ];
    assert_eq!(outcomes.iter().map(|o| claims(o)).sum::<u64>(), c.claims);
    assert_eq!(
        value("idemstore_stale_lease_rejections_total"),
        c.stale_lease_rejections
    );
    assert_eq!(value("idemstore_evictions_total"), c.evictions);

    let records = |state: &str| value(&format!("idemstore_records{{state=\"{state}\"}}"));
    assert_eq!(records("processing"), r.processing);
    assert_eq!(records("succeeded"), r.succeeded);
    assert_eq!(records("failed"), r.failed);
    assert_eq!(records("failed_retryable"), r.failed_retryable);
    assert_eq!(records("expired"), r.expired);
    assert_eq!(records("corrupt"), r.corrupt);
    assert_eq!(value("idemstore_in_progress_lapsed_records"), r.lapsed);
    assert_eq!(
        value("idemstore_oldest_in_progress_age_seconds") * 1000,
        stats.oldest_processing_age_ms.unwrap()
    );
}

/// `idemstore_commit_batch_size`: its sum and its number of observations.
fn batch_size(handle: &PrometheusHandle) -> (f64, f64) {
    let s = samples(&handle.render());
    let get = |name: &str| s.get(name).copied().unwrap_or(0.0);
    (
        get("idemstore_commit_batch_size_sum"),
        get("idemstore_commit_batch_size_count"),
    )
}

/// Requests that write, and requests answered without a write, on
/// `store`: `idemstore_commit_batch_size` ("requests made durable by one
/// group commit") counts each of the first (an acquisition, an extension,
/// a completion) and none of the second (a replay, a fingerprint refused,
/// a stale completion, release and extension); a commit that made no
/// write durable is not observed at all.
fn only_writes_are_counted(store: &Store, handle: &PrometheusHandle) {
    let before = batch_size(handle);
    let k = key("written");
    let l = acquired(store.claim(&k, &fp("p"), &lease_of(secs(10))).unwrap());
    store.extend(&l, secs(20)).unwrap();
    store.complete(&l, b"ok").unwrap();
    let (sum, count) = batch_size(handle);
    assert_eq!(sum - before.0, 3.0, "three requests wrote");
    assert!(count > before.1);
    for _ in 0..5 {
        let out = store.claim(&k, &fp("p"), &ClaimOptions::new()).unwrap();
        assert!(matches!(out, ClaimOutcome::Replay(_)), "{out:?}");
    }
    let err = store.claim(&k, &fp("other"), &ClaimOptions::new());
    assert!(
        matches!(err, Err(Error::FingerprintMismatch { .. })),
        "{err:?}"
    );
    let stale = [
        store.complete(&l, b"again").map(drop),
        store.extend(&l, secs(5)).map(drop),
        store.release(l.clone()),
    ];
    for answer in stale {
        assert!(
            matches!(answer, Err(Error::StaleLease { .. })),
            "{answer:?}"
        );
    }
    assert_eq!(
        batch_size(handle),
        (sum, count),
        "answers that wrote nothing were counted as made durable"
    );
}

#[test]
fn the_commit_batch_size_counts_only_requests_that_wrote() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let t = TestDir::new();
    let store = metrics::with_local_recorder(&recorder, || t.open());
    only_writes_are_counted(&store, &handle);
    // An import batch counts each record it wrote, not the one it kept.
    let source = TestDir::new();
    let other = source.open();
    for id in ["written", "new-1", "new-2"] {
        let l = acquired(
            other
                .claim(&key(id), &fp("p"), &ClaimOptions::new())
                .unwrap(),
        );
        other.complete(&l, b"ok").unwrap();
    }
    let mut export = Vec::new();
    other.export(&mut export, |_| {}).unwrap();
    let (sum, _) = batch_size(&handle);
    let summary = store.import(export.as_slice(), |_| {}).unwrap();
    assert_eq!((summary.imported, summary.present), (2, 1));
    assert_eq!(batch_size(&handle).0 - sum, 2.0);
}

/// With `Durability::Buffered` a request is answered before its write is
/// durable: the fsync (or checkpoint) that makes it durable counts it.
#[test]
fn buffered_writes_count_in_the_commit_that_makes_them_durable() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let t = TestDir::new();
    let config = t.config().durability(idemstore::Durability::Buffered {
        max_delay: secs(3600),
    });
    let store = metrics::with_local_recorder(&recorder, || t.open_with(config));
    let k = key("buffered");
    let l = acquired(store.claim(&k, &fp("p"), &ClaimOptions::new()).unwrap());
    store.complete(&l, b"ok").unwrap();
    let out = store.claim(&k, &fp("p"), &ClaimOptions::new()).unwrap();
    assert!(matches!(out, ClaimOutcome::Replay(_)), "{out:?}");
    store.flush().unwrap();
    // `flush` returns once the fsync is done; the syncer observes the
    // commit just after it wakes the waiters (a liveness bound, not a
    // timing figure).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while batch_size(&handle).0 < 2.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(batch_size(&handle).0, 2.0);
}

/// The same on PostgreSQL (the hot path and the general transaction), and
/// a claim whose statement's answer was lost (`OutcomeUnknown`): not a
/// group commit made durable, so nothing is observed.
#[cfg(feature = "postgres")]
#[test]
fn the_commit_batch_size_counts_only_requests_that_wrote_on_postgres() {
    use pg::proxy::{Proxy, upstream_of, via};
    let Some(url) = pg::url() else { return };
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let proxy = Proxy::start(upstream_of(&url));
    let config = idemstore::Config::new()
        .postgres_schema(pg::schema("metrics_writes"))
        .sweep_interval(None);
    let store =
        metrics::with_local_recorder(&recorder, || Store::connect(&via(&url, &proxy), config))
            .unwrap();
    only_writes_are_counted(&store, &handle);
    let before = batch_size(&handle);
    proxy.lose_answer_to(b"lost-claim-key");
    let lost = store.claim(&key("lost-claim-key"), &fp("p"), &ClaimOptions::new());
    assert!(
        matches!(lost, Err(Error::OutcomeUnknown { .. })),
        "{lost:?}"
    );
    assert_eq!(
        batch_size(&handle),
        before,
        "a commit whose answer was lost was counted as made durable"
    );
}

/// Sync callers whose requests queue while the store's connections are
/// busy (the direct connection and its one worker, each held by a
/// completion whose trigger sleeps) are group-committed: the six queued
/// completions take fewer commits than requests. Before, a plain sync
/// call read its deadline a second time, a little later, took it for a
/// deadline its caller had shortened, and ran in a transaction of its own:
/// every call the direct connection could not take lost its group commit.
#[cfg(feature = "postgres")]
#[test]
fn sync_calls_queued_behind_busy_connections_are_group_committed() {
    use idemstore::postgres::tokio_postgres::{self, NoTls};
    let Some(url) = pg::url() else { return };
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let schema = pg::schema("metrics_group");
    let config = idemstore::Config::new()
        .postgres_schema(&schema)
        .postgres_connections(1)
        .sweep_interval(None);
    let store = std::sync::Arc::new(
        metrics::with_local_recorder(&recorder, || Store::connect(&url, config)).unwrap(),
    );
    let lease = |id: &str| {
        acquired(
            store
                .claim(&key(id), &fp("p"), &ClaimOptions::new())
                .unwrap(),
        )
    };
    let gates = [lease("gate-1"), lease("gate-2")];
    let queued: Vec<_> = (0..6).map(|i| lease(&format!("queued-{i}"))).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (client, connection) = rt.block_on(tokio_postgres::connect(&url, NoTls)).unwrap();
    rt.spawn(connection);
    let tokens = format!("{}, {}", gates[0].token(), gates[1].token());
    rt.block_on(client.batch_execute(&format!(
        "CREATE FUNCTION \"{schema}\".gate() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN IF NEW.token IN ({tokens}) THEN PERFORM pg_sleep(2); END IF; \
         RETURN NEW; END$$; \
         CREATE TRIGGER gate BEFORE UPDATE ON \"{schema}\".records \
         FOR EACH ROW EXECUTE FUNCTION \"{schema}\".gate()"
    )))
    .unwrap();
    let before = batch_size(&handle);
    let complete = |l: &idemstore::Lease| {
        let (store, l) = (std::sync::Arc::clone(&store), l.clone());
        std::thread::spawn(move || store.complete(&l, b"ok").map(drop))
    };
    let held: Vec<_> = gates.iter().map(complete).collect();
    // Both gates' completions sleep in their trigger (hang guard: a
    // bounded number of looks).
    let sleeping = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' \
         AND query LIKE '%{schema}%'"
    );
    let mut looks = 0;
    while rt
        .block_on(client.query_one(&sleeping, &[]))
        .unwrap()
        .get::<_, i64>(0)
        < 2
    {
        looks += 1;
        assert!(looks < 1_000, "the gates never both reached their trigger");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let waiting: Vec<_> = queued.iter().map(complete).collect();
    for done in held.into_iter().chain(waiting) {
        done.join().unwrap().expect("a completion");
    }
    let (sum, count) = batch_size(&handle);
    let (requests, commits) = (sum - before.0, count - before.1);
    assert_eq!(requests, 8.0, "eight completions wrote");
    assert!(
        commits < requests,
        "{requests} requests in {commits} commits: none was group-committed"
    );
}
