//! Engine tests on a real server: one throwaway server per test binary
//! (or `IDEMSTORE_PG_URL`), one schema per test.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use super::server::TestServer;
use super::{PgOptions, Postgres};
use crate::clock::ManualClock;
use crate::error::{ConfigFault, Error};
use crate::key::{Fingerprint, Key};
use crate::record::{ClaimOutcome, ImportResult, Lease, Op, Record, Reply, State};
use crate::stats::StateCounts;

const T0: u64 = 1_700_000_000_000;
const RETENTION: u64 = 60_000;

/// Whether `IDEMSTORE_SKIP_POSTGRES=1` skips the PostgreSQL tests (said on
/// stderr), as in `tests/pg`.
fn skipped() -> bool {
    let skip = std::env::var_os("IDEMSTORE_SKIP_POSTGRES").is_some_and(|v| v == "1");
    if skip {
        eprintln!("skipped: IDEMSTORE_SKIP_POSTGRES=1 (the PostgreSQL engine is not tested)");
    }
    skip
}

fn server() -> &'static TestServer {
    match TestServer::shared() {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

/// A schema name no other test (or earlier run) uses.
fn schema(name: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "t_{name}_{}_{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

fn open_with(schema: &str, clock: Option<&ManualClock>) -> Postgres {
    open_at(server().url(), schema, clock)
}

fn open_at(url: &str, schema: &str, clock: Option<&ManualClock>) -> Postgres {
    Postgres::connect(url, options(schema, clock)).unwrap()
}

/// The tests' options: `schema`, `clock`, RETENTION, four connections.
fn options(schema: &str, clock: Option<&ManualClock>) -> PgOptions {
    PgOptions {
        schema: schema.to_string(),
        clock: clock.map(|c| Arc::new(c.clone()) as Arc<dyn crate::clock::Clock>),
        retention_ms: RETENTION,
        connections: 4,
        must_exist: false,
        migrate: false,
        limits: crate::config::PostgresLimits::default(),
        pooler: crate::config::PostgresPooler::Direct,
    }
}

/// A store on a schema of its own with a manual clock.
fn open(name: &str) -> (Postgres, ManualClock) {
    let clock = ManualClock::new(T0);
    (open_with(&schema(name), Some(&clock)), clock)
}

fn key(id: &str) -> Key {
    Key::new("acme/tickets.create", id).unwrap()
}

fn claim(fp: &[u8]) -> Op {
    Op::Claim {
        fingerprint: Fingerprint::of(fp),
        lease_ms: 1_000,
        business_key: None,
    }
}

fn claim_bk(fp: &[u8], bk: &str) -> Op {
    Op::Claim {
        fingerprint: Fingerprint::of(fp),
        lease_ms: 1_000,
        business_key: Some(bk.into()),
    }
}

/// Completes `lease` on `k` with `result`; panics unless it lands.
fn complete(pg: &Postgres, k: &Key, lease: &Lease, result: &[u8]) -> Reply {
    pg.apply(
        k,
        Op::Complete {
            token: lease.token(),
            result: result.to_vec(),
        },
    )
    .unwrap()
}

fn acquired(reply: Reply) -> Lease {
    match reply {
        Reply::Claim(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn record(reply: Reply) -> Record {
    match reply {
        Reply::Record(r) => r,
        other => panic!("expected a record, got {other:?}"),
    }
}

/// `bytes` in lowercase hex, for a `'\x…'::bytea` literal.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `sql` on its own connection to the test server.
fn raw_sql(sql: &str) -> Vec<tokio_postgres::Row> {
    sql_at(server().url(), sql)
}

/// Panics unless `answer` is `Misconfigured` with `SchemaDamaged` whose
/// detail holds every one of `words` (`what` names the request).
fn assert_schema_damaged<T: std::fmt::Debug>(what: &str, answer: Result<T, Error>, words: &[&str]) {
    match answer {
        Err(Error::Misconfigured {
            fault: ConfigFault::SchemaDamaged,
            detail,
        }) => assert!(words.iter().all(|w| detail.contains(w)), "{what}: {detail}"),
        other => panic!("{what}: expected SchemaDamaged, got {other:?}"),
    }
}

/// What the engine keeps of a hot claim for its holder's completion
/// (`Shared::held`) is the row as the claim's statement wrote it, byte for
/// byte, also when statements running at the same time on the engine's
/// other connections raised the store's time above that statement's own
/// reading (so that the holder's completion, a compare-and-set on those
/// bytes, lands in one statement instead of going the general way); and
/// the lease answered to the caller ends when the row's does, never later.
#[test]
fn held_records_are_their_rows_under_concurrent_claims() {
    if skipped() {
        return;
    }
    let name = schema("held_rows");
    // The server's clock: each statement reads its own time.
    let pg = Arc::new(open_with(&name, None));
    let (threads, each) = (16, 25);
    let callers: Vec<_> = (0..threads)
        .map(|t| {
            let pg = Arc::clone(&pg);
            std::thread::spawn(move || {
                (0..each)
                    .map(|i| {
                        let id = format!("held-{t}-{i}");
                        let lease = acquired(pg.apply(&key(&id), claim(b"a")).unwrap());
                        (id, lease.lease_until_ms().expect("an acquired lease"))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answered: std::collections::BTreeMap<String, u64> = callers
        .into_iter()
        .flat_map(|caller| caller.join().unwrap())
        .collect();
    let held = pg.shared.held.lock().clone();
    let rows = raw_sql(&format!(
        "SELECT key, record, lease_until_ms FROM \"{name}\".records"
    ));
    assert_eq!(rows.len(), threads * each);
    let mut differ = Vec::new();
    let mut longer = Vec::new();
    for row in &rows {
        let kb: Vec<u8> = row.get(0);
        let stored: Vec<u8> = row.get(1);
        let lease_until: i64 = row.get(2);
        let h = held
            .get(&kb)
            .unwrap_or_else(|| panic!("no held record for {kb:?}"));
        if h.stored != stored {
            differ.push(String::from_utf8_lossy(&kb).into_owned());
        }
        // The lease answered is the row's, never longer.
        let id = answered
            .keys()
            .find(|id| kb.ends_with(id.as_bytes()))
            .unwrap_or_else(|| panic!("no answer for {kb:?}"));
        if i64::try_from(answered[id]).ok() != Some(lease_until) {
            longer.push((id.clone(), answered[id], lease_until));
        }
    }
    assert!(
        differ.is_empty(),
        "{} of {} held records differ from their rows, among them {:?}",
        differ.len(),
        rows.len(),
        &differ[..differ.len().min(5)]
    );
    assert!(
        longer.is_empty(),
        "{} of {} answered leases differ from their rows' (id, answered, row): {:?}",
        longer.len(),
        rows.len(),
        &longer[..longer.len().min(5)]
    );
}

#[test]
fn claim_complete_replay_and_fingerprints() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("lifecycle");
    let k = key("k1");
    let lease = acquired(pg.apply(&k, claim(b"a")).unwrap());
    // A new schema's tokens start at its creation's milliseconds × 1,024.
    let wall = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    let created_ms = lease.token() >> 10;
    assert!(
        created_ms.abs_diff(wall) < 600_000,
        "{created_ms} vs {wall}"
    );
    assert!(lease.token() < 1 << 53, "exact as a JSON number");
    assert_eq!(lease.lease_until_ms(), Some(T0 + 1_000));
    match pg.apply(&k, claim(b"a")).unwrap() {
        Reply::Claim(ClaimOutcome::InProgress {
            retry_after,
            lease_until_ms,
        }) => {
            assert_eq!(lease_until_ms, T0 + 1_000);
            assert_eq!(retry_after, Duration::from_millis(1_000));
        }
        other => panic!("{other:?}"),
    }
    let err = pg.apply(&k, claim(b"b")).unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { .. }), "{err}");
    clock.advance(Duration::from_millis(10));
    let done = record(complete(&pg, &k, &lease, b"ticket-1"));
    assert_eq!(done.state, State::Succeeded);
    assert_eq!(done.expires_ms, T0 + 10 + RETENTION);
    match pg.apply(&k, claim(b"a")).unwrap() {
        Reply::Claim(ClaimOutcome::Replay(r)) => assert_eq!(r.result(), Some(&b"ticket-1"[..])),
        other => panic!("{other:?}"),
    }
    let err = pg.apply(&k, claim(b"b")).unwrap_err();
    assert!(matches!(err, Error::FingerprintMismatch { .. }), "{err}");
    // A finished record is never completed again.
    let err = pg
        .apply(
            &k,
            Op::Complete {
                token: lease.token(),
                result: b"again".to_vec(),
            },
        )
        .unwrap_err();
    assert!(matches!(err, Error::StaleLease { .. }), "{err}");
    assert_eq!(pg.get(&k).unwrap().unwrap(), done);
    assert_eq!(pg.len().unwrap(), 1);
    assert_eq!(pg.next_token().unwrap(), lease.token() + 1);
    let c = pg.counters().snapshot();
    assert_eq!((c.claims, c.acquired, c.replays), (5, 1, 1));
    assert_eq!((c.in_progress, c.fingerprint_mismatches), (1, 2));
    assert_eq!(c.stale_lease_rejections, 1);
}

#[test]
fn a_lapsed_lease_is_taken_over_and_the_old_holder_fenced() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("stale");
    let k = key("k");
    let first = acquired(pg.apply(&k, claim(b"a")).unwrap());
    pg.apply(
        &k,
        Op::SetRecoveryPoint {
            token: first.token(),
            bytes: b"step-2".to_vec(),
        },
    )
    .unwrap();
    clock.advance(Duration::from_millis(1_000));
    let second = acquired(pg.apply(&k, claim(b"a")).unwrap());
    assert!(second.token() > first.token());
    assert!(second.is_takeover());
    assert_eq!(second.recovery_point(), Some(&b"step-2"[..]));
    assert_eq!(second.record().unwrap().acquisitions, 2);
    for op in [
        Op::Complete {
            token: first.token(),
            result: b"late".to_vec(),
        },
        Op::Release {
            token: first.token(),
        },
        Op::Extend {
            token: first.token(),
            lease_ms: 5_000,
        },
    ] {
        let err = pg.apply(&k, op).unwrap_err();
        assert!(matches!(err, Error::StaleLease { .. }), "{err}");
    }
    assert_eq!(pg.counters().snapshot().takeovers, 1);
    // A lapsed holder nobody took over may still finish.
    let k2 = key("k2");
    let l2 = acquired(pg.apply(&k2, claim(b"a")).unwrap());
    clock.advance(Duration::from_millis(5_000));
    let done = record(
        pg.apply(
            &k2,
            Op::Fail {
                token: l2.token(),
                failure: b"no".to_vec(),
                retryable: false,
            },
        )
        .unwrap(),
    );
    assert_eq!(done.state, State::Failed { retryable: false });
}

#[test]
fn release_extend_and_retryable_failure() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("release");
    let k = key("k");
    let l1 = acquired(pg.apply(&k, claim(b"a")).unwrap());
    assert!(matches!(
        pg.apply(&k, Op::Release { token: l1.token() }).unwrap(),
        Reply::Released
    ));
    assert!(pg.get(&k).unwrap().is_none());
    // Released: the key is free for another payload, with a new token.
    let l2 = acquired(pg.apply(&k, claim(b"b")).unwrap());
    assert!(l2.token() > l1.token());
    clock.advance(Duration::from_millis(900));
    let ext = record(
        pg.apply(
            &k,
            Op::Extend {
                token: l2.token(),
                lease_ms: 5_000,
            },
        )
        .unwrap(),
    );
    assert_eq!(ext.lease_until_ms, T0 + 900 + 5_000);
    clock.advance(Duration::from_millis(1_000));
    assert!(matches!(
        pg.apply(&k, claim(b"b")).unwrap(),
        Reply::Claim(ClaimOutcome::InProgress { .. })
    ));
    pg.apply(
        &k,
        Op::Fail {
            token: l2.token(),
            failure: b"timeout".to_vec(),
            retryable: true,
        },
    )
    .unwrap();
    let l3 = acquired(pg.apply(&k, claim(b"b")).unwrap());
    assert!(l3.token() > l2.token());
    assert_eq!(l3.record().unwrap().failure(), Some(&b"timeout"[..]));
}

/// `ReleaseUnlessActed` (the HTTP layer's release) deletes a row whose
/// holder saved no recovery point, and keeps one that holds a recovery
/// point as a retryable failure, which the next claim acquires with it.
#[test]
fn release_unless_acted_keeps_a_row_with_a_recovery_point() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("release_unless_acted");
    let release = |token| Op::ReleaseUnlessActed {
        token,
        failure: b"refused".to_vec(),
    };
    let k = key("plain");
    let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
    assert!(matches!(
        pg.apply(&k, release(l.token())).unwrap(),
        Reply::Released
    ));
    assert!(pg.get(&k).unwrap().is_none());

    let k = key("acted");
    let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
    let point = Op::SetRecoveryPoint {
        token: l.token(),
        bytes: b"charged".to_vec(),
    };
    record(pg.apply(&k, point).unwrap());
    let kept = record(pg.apply(&k, release(l.token())).unwrap());
    assert_eq!(kept.state, State::Failed { retryable: true });
    assert_eq!(pg.get(&k).unwrap().unwrap(), kept);
    let next = acquired(pg.apply(&k, claim(b"a")).unwrap());
    assert_eq!(next.recovery_point(), Some(&b"charged"[..]));
    assert_eq!(next.record().unwrap().failure(), Some(&b"refused"[..]));
    // A stale token changes nothing.
    assert!(matches!(
        pg.apply(&k, release(l.token())),
        Err(Error::StaleLease { .. })
    ));
}

#[test]
fn business_keys_conflict_until_released() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("business");
    let (k1, k2) = (key("k1"), key("k2"));
    let l1 = acquired(pg.apply(&k1, claim_bk(b"a", "order-1")).unwrap());
    match pg.apply(&k2, claim_bk(b"a", "order-1")) {
        Err(Error::BusinessKeyConflict {
            existing, state, ..
        }) => {
            assert_eq!(existing, k1);
            assert_eq!(state, State::Processing);
        }
        other => panic!("{other:?}"),
    }
    // Another business key is fine.
    acquired(pg.apply(&k2, claim_bk(b"a", "order-2")).unwrap());
    pg.apply(&k1, Op::Release { token: l1.token() }).unwrap();
    let k3 = key("k3");
    acquired(pg.apply(&k3, claim_bk(b"a", "order-1")).unwrap());
    // In one batch: the second claim sees the first's binding.
    let (k4, k5) = (key("k4"), key("k5"));
    let replies = pg
        .apply_many(vec![
            (k4.clone(), claim_bk(b"x", "order-9")),
            (k5.clone(), claim_bk(b"x", "order-9")),
        ])
        .unwrap();
    assert!(matches!(
        replies[0],
        Ok(Reply::Claim(ClaimOutcome::Acquired(_)))
    ));
    assert!(matches!(replies[1], Err(Error::BusinessKeyConflict { .. })));
    assert_eq!(pg.counters().snapshot().business_key_conflicts, 2);
}

#[test]
fn retention_and_sweep() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("retention");
    let mut leases = Vec::new();
    for i in 0..5 {
        let k = key(&format!("k{i}"));
        let l = acquired(pg.apply(&k, claim_bk(b"a", &format!("bk{i}"))).unwrap());
        complete(&pg, &k, &l, b"r");
        leases.push((k, l));
    }
    clock.advance(Duration::from_millis(RETENTION - 1));
    assert!(pg.get(&leases[0].0).unwrap().is_some());
    assert_eq!(pg.sweep(100).unwrap(), 0);
    clock.advance(Duration::from_millis(1));
    // Past retention: absent to get and claim, whether or not swept.
    assert!(pg.get(&leases[0].0).unwrap().is_none());
    let again = acquired(pg.apply(&leases[0].0, claim(b"other")).unwrap());
    assert!(again.token() > leases[0].1.token());
    assert_eq!(pg.len().unwrap(), 5);
    assert_eq!(pg.sweep(2).unwrap(), 2);
    assert_eq!(pg.sweep(100).unwrap(), 2);
    assert_eq!(pg.len().unwrap(), 1);
    assert_eq!(pg.counters().snapshot().evictions, 4);
    // The business keys of evicted records are free for other keys.
    acquired(pg.apply(&key("other"), claim_bk(b"a", "bk3")).unwrap());
    let rows = raw_sql(&format!(
        "SELECT count(*) FROM \"{}\".bindings",
        pg.shared.sql.schema
    ));
    let n: i64 = rows[0].get(0);
    assert_eq!(n, 1, "only the new binding is left");
}

#[test]
fn apply_many_decides_duplicates_in_order() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("many");
    let (k, other) = (key("dup"), key("other"));
    let replies = pg
        .apply_many(vec![
            (k.clone(), claim(b"a")),
            (other.clone(), claim(b"a")),
            (k.clone(), claim(b"a")),
            (k.clone(), claim(b"b")),
        ])
        .unwrap();
    let t1 = match &replies[0] {
        Ok(Reply::Claim(ClaimOutcome::Acquired(l))) => l.token(),
        other => panic!("{other:?}"),
    };
    let t2 = match &replies[1] {
        Ok(Reply::Claim(ClaimOutcome::Acquired(l))) => l.token(),
        other => panic!("{other:?}"),
    };
    assert!(t2 > t1);
    assert!(matches!(
        replies[2],
        Ok(Reply::Claim(ClaimOutcome::InProgress { .. }))
    ));
    assert!(matches!(replies[3], Err(Error::FingerprintMismatch { .. })));
    // Keys already held are respected; a release then a claim in one batch
    // take a new token.
    let replies = pg
        .apply_many(vec![
            (k.clone(), claim(b"a")),
            (k.clone(), Op::Release { token: t1 }),
            (k.clone(), claim(b"c")),
        ])
        .unwrap();
    assert!(matches!(
        replies[0],
        Ok(Reply::Claim(ClaimOutcome::InProgress { .. }))
    ));
    assert!(matches!(replies[1], Ok(Reply::Released)));
    match &replies[2] {
        Ok(Reply::Claim(ClaimOutcome::Acquired(l))) => assert!(l.token() > t2),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        pg.get(&k).unwrap().unwrap().fingerprint,
        Fingerprint::of(b"c")
    );
}

#[test]
fn import_fills_absent_keys_and_raises_the_token_floor() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("import");
    let live = key("present");
    acquired(pg.apply(&live, claim(b"a")).unwrap());
    let rec = |k: &Key, token: u64, expires_ms: u64| Record {
        key: k.clone(),
        state: State::Succeeded,
        token,
        fingerprint: Fingerprint::of(b"a"),
        created_ms: T0 - 10,
        updated_ms: T0 - 5,
        lease_until_ms: T0 - 1,
        expires_ms,
        output: Some(b"out".to_vec()),
        recovery_point: None,
        business_key: None,
        acquisitions: 1,
    };
    let fresh = key("fresh");
    let old = key("old");
    let ops = vec![
        (
            fresh.clone(),
            Op::Import {
                record: Box::new(rec(&fresh, 500, T0 + 1_000)),
            },
        ),
        (
            live.clone(),
            Op::Import {
                record: Box::new(rec(&live, 400, T0 + 1_000)),
            },
        ),
        (
            old.clone(),
            Op::Import {
                record: Box::new(rec(&old, 300, T0)),
            },
        ),
    ];
    // Above the sequence's start (the schema's creation time × 2^20).
    let floor = pg.next_token().unwrap() + 1_000;
    let replies = pg.import(ops, floor).unwrap();
    let results: Vec<ImportResult> = replies
        .into_iter()
        .map(|r| match r.unwrap() {
            Reply::Imported(x) => x,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        results,
        [
            ImportResult::Written,
            ImportResult::Present,
            ImportResult::Expired
        ]
    );
    assert_eq!(pg.next_token().unwrap(), floor);
    assert_eq!(
        pg.get(&fresh).unwrap().unwrap(),
        rec(&fresh, 500, T0 + 1_000)
    );
    match pg.apply(&fresh, claim(b"a")).unwrap() {
        Reply::Claim(ClaimOutcome::Replay(_)) => {}
        other => panic!("{other:?}"),
    }
    // A lower floor never lowers the sequence.
    pg.import(Vec::new(), 10).unwrap();
    assert_eq!(pg.next_token().unwrap(), floor);
    clock.advance(Duration::from_millis(1_000));
    let l = acquired(pg.apply(&fresh, claim(b"a")).unwrap());
    assert_eq!(l.token(), floor);
}

#[test]
fn entries_read_one_snapshot_in_key_order() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("entries");
    let a = |i: usize| Key::new("a", format!("{i:05}")).unwrap();
    let b = |i: usize| Key::new("b", format!("{i:05}")).unwrap();
    let mut ops = Vec::new();
    for i in 0..1_200 {
        ops.push((a(i), claim(b"x")));
        ops.push((b(i), claim(b"x")));
    }
    for r in pg.apply_many(ops).unwrap() {
        r.unwrap();
    }
    let prefix_a = Key::scope_prefix("a").unwrap();
    let mut end_a = prefix_a.clone();
    if let Some(last) = end_a.last_mut() {
        *last += 1;
    }
    let iter = pg.entries(vec![(prefix_a.clone(), Some(end_a))]).unwrap();
    // Written after the snapshot: not seen.
    acquired(pg.apply(&a(99_999), claim(b"x")).unwrap());
    let got: Vec<(Vec<u8>, Vec<u8>)> = iter.map(Result::unwrap).collect();
    assert_eq!(got.len(), 1_200);
    for (i, (kb, env)) in got.iter().enumerate() {
        assert_eq!(*kb, a(i).to_bytes());
        let rec = crate::codec::decode_record(kb, env).unwrap();
        assert_eq!(rec.key, a(i));
    }
    // Overlapping and unbounded ranges: every key once, in order.
    let all: Vec<Vec<u8>> = pg
        .entries(vec![
            (b(1_000).to_bytes(), None),
            (Vec::new(), Some(a(10).to_bytes())),
            (a(5).to_bytes(), Some(a(20).to_bytes())),
        ])
        .unwrap()
        .map(|r| r.unwrap().0)
        .collect();
    let mut want: Vec<Vec<u8>> = (0..20).map(|i| a(i).to_bytes()).collect();
    want.extend((1_000..1_200).map(|i| b(i).to_bytes()));
    assert_eq!(all, want);
    assert_eq!(pg.entries(Vec::new()).unwrap().count(), 0);
}

#[test]
fn tokens_are_capped_without_aborting_the_batch() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("cap");
    let max = crate::MAX_TOKEN;
    raw_sql(&format!(
        "ALTER SEQUENCE \"{}\".tokens RESTART WITH {}",
        pg.shared.sql.schema,
        max - 1
    ));
    let replies = pg
        .apply_many(vec![
            (key("a"), claim(b"a")),
            (key("b"), claim(b"a")),
            (key("a"), claim(b"a")),
        ])
        .unwrap();
    match &replies[0] {
        Ok(Reply::Claim(ClaimOutcome::Acquired(l))) => assert_eq!(l.token(), max - 1),
        other => panic!("{other:?}"),
    }
    assert!(matches!(replies[1], Err(Error::TokensExhausted { .. })));
    assert!(matches!(
        replies[2],
        Ok(Reply::Claim(ClaimOutcome::InProgress { .. }))
    ));
    assert_eq!(pg.next_token().unwrap(), max);
    let err = pg.apply(&key("c"), claim(b"a")).unwrap_err();
    assert!(matches!(err, Error::TokensExhausted { .. }), "{err}");
    assert!(pg.get(&key("a")).unwrap().is_some());
}

#[test]
fn the_async_api_needs_no_runtime() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("async");
    let k = key("k");
    let reply = futures_lite::future::block_on(pg.apply_async(&k, claim(b"a"))).unwrap();
    let lease = acquired(reply);
    let done = futures_lite::future::block_on(pg.apply_async(
        &k,
        Op::Complete {
            token: lease.token(),
            result: b"r".to_vec(),
        },
    ))
    .unwrap();
    assert_eq!(record(done).state, State::Succeeded);
}

/// A claim whose lease (a minute) outlasts any stall of a loaded test
/// machine between an acquisition and its holder's answer: `race` checks
/// fencing among holders, and a lease that lapsed before its holder's
/// failure landed would make that failure stale (the server's clock runs
/// on).
fn long_claim() -> Op {
    Op::Claim {
        fingerprint: Fingerprint::of(b"a"),
        lease_ms: 60_000,
        business_key: None,
    }
}

/// Threads claim the same keys: exactly one acquisition per key at a time,
/// tokens strictly increasing per key.
fn race(stores: &[Arc<Postgres>], threads: usize, keys: usize, rounds: usize) {
    let keys: Arc<Vec<Key>> = Arc::new((0..keys).map(|i| key(&format!("r{i}"))).collect());
    let barrier = Arc::new(Barrier::new(threads));
    let first: Arc<Mutex<HashMap<Key, usize>>> = Arc::default();
    // Phase 1: everyone claims every key once; one winner per key.
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let pg = Arc::clone(&stores[t % stores.len()]);
            let (keys, barrier, first) = (keys.clone(), barrier.clone(), first.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..keys.len() {
                    let k = &keys[(i + t * 7) % keys.len()];
                    match pg.apply(k, long_claim()).unwrap() {
                        Reply::Claim(ClaimOutcome::Acquired(l)) => {
                            *first.lock().unwrap().entry(k.clone()).or_default() += 1;
                            pg.apply(
                                k,
                                Op::Fail {
                                    token: l.token(),
                                    failure: b"retry".to_vec(),
                                    retryable: true,
                                },
                            )
                            .unwrap();
                        }
                        Reply::Claim(ClaimOutcome::InProgress { .. }) => {}
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    // Phase 1 again from scratch is not possible (retryable failures let
    // later claims acquire), so it checks at least one acquisition per key
    // and phase 2 checks fencing under contention.
    assert_eq!(first.lock().unwrap().len(), keys.len());
    type Seen = BTreeMap<Key, Vec<(u32, u64)>>;
    let acquisitions: Arc<Mutex<Seen>> = Arc::default();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let pg = Arc::clone(&stores[t % stores.len()]);
            let (keys, barrier, acq) = (keys.clone(), barrier.clone(), acquisitions.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for r in 0..rounds {
                    for i in 0..keys.len() {
                        let k = &keys[(i + t * 13 + r) % keys.len()];
                        if let Reply::Claim(ClaimOutcome::Acquired(l)) =
                            pg.apply(k, long_claim()).unwrap()
                        {
                            let n = l.record().unwrap().acquisitions;
                            acq.lock()
                                .unwrap()
                                .entry(k.clone())
                                .or_default()
                                .push((n, l.token()));
                            // The only valid lease: the failure lands.
                            pg.apply(
                                k,
                                Op::Fail {
                                    token: l.token(),
                                    failure: b"retry".to_vec(),
                                    retryable: true,
                                },
                            )
                            .unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let acq = acquisitions.lock().unwrap();
    let first = first.lock().unwrap();
    for k in keys.iter() {
        let mut seen = acq.get(k).cloned().unwrap_or_default();
        seen.sort_unstable();
        let stored = stores[0].get(k).unwrap().unwrap();
        let before = u32::try_from(first[k]).unwrap();
        // Every acquisition is counted once, in order, with a larger token.
        assert_eq!(
            stored.acquisitions,
            before + u32::try_from(seen.len()).unwrap(),
            "{k}"
        );
        for (i, w) in seen.windows(2).enumerate() {
            assert_eq!(w[0].0 + 1, w[1].0, "{k} acquisition {i}");
            assert!(w[0].1 < w[1].1, "{k}: tokens {w:?}");
        }
    }
}

#[test]
fn threads_race_on_the_same_keys() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("race");
    // Phase 1's exact count: with a fresh store and claims only.
    let keys: Vec<Key> = (0..200).map(|i| key(&format!("once{i}"))).collect();
    let keys = Arc::new(keys);
    let pg = Arc::new(pg);
    let barrier = Arc::new(Barrier::new(32));
    let wins: Arc<Mutex<HashMap<Key, Vec<u64>>>> = Arc::default();
    let handles: Vec<_> = (0..32)
        .map(|t| {
            let (pg, keys, barrier, wins) =
                (pg.clone(), keys.clone(), barrier.clone(), wins.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..keys.len() {
                    let k = &keys[(i + t * 7) % keys.len()];
                    if let Reply::Claim(ClaimOutcome::Acquired(l)) =
                        pg.apply(k, claim(b"a")).unwrap()
                    {
                        wins.lock()
                            .unwrap()
                            .entry(k.clone())
                            .or_default()
                            .push(l.token());
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let wins = wins.lock().unwrap();
    assert_eq!(wins.len(), 200);
    assert!(
        wins.values().all(|v| v.len() == 1),
        "one acquisition per key"
    );
    let c = pg.counters().snapshot();
    assert_eq!((c.claims, c.acquired), (32 * 200, 200));
    race(&[pg], 32, 200, 3);
}

#[test]
fn two_replicas_on_one_schema_race() {
    if skipped() {
        return;
    }
    let name = schema("replicas");
    let a = Arc::new(open_with(&name, None));
    let b = Arc::new(open_with(&name, None));
    assert_eq!(a.store_id(), b.store_id());
    race(&[a, b], 16, 100, 3);
}

#[test]
fn a_killed_connection_is_a_typed_error_and_the_engine_recovers() {
    if skipped() {
        return;
    }
    // An application name of its own, so that only this engine's
    // backends are terminated.
    let app = schema("killed");
    let url = format!("{}?application_name={app}", server().url());
    let clock = ManualClock::new(T0);
    let pg = open_at(&url, &schema("killed"), Some(&clock));
    let k = key("k");
    let lease = acquired(pg.apply(&k, claim(b"a")).unwrap());
    let schema_name = pg.shared.sql.schema.clone();
    let kb = k.to_bytes();
    // Another session holds the row, so the engine's batch waits inside
    // its transaction; then every idemstore backend is terminated.
    let (rt, client) = client_at(server().url());
    rt.block_on(async {
        client.batch_execute("BEGIN").await.unwrap();
        client
            .query(
                &format!("SELECT 1 FROM \"{schema_name}\".records WHERE key = $1 FOR UPDATE"),
                &[&kb],
            )
            .await
            .unwrap();
    });
    let pg = Arc::new(pg);
    let waiting = {
        let (pg, k, token) = (pg.clone(), k.clone(), lease.token());
        std::thread::spawn(move || {
            pg.apply(
                &k,
                Op::Complete {
                    token,
                    result: b"r".to_vec(),
                },
            )
        })
    };
    // Wait until the engine's backend waits for the lock.
    let mut waited = false;
    for _ in 0..200 {
        // Activity statistics are a snapshot per transaction: refresh it.
        rt.block_on(client.query("SELECT pg_stat_clear_snapshot()", &[]))
            .unwrap();
        let rows = rt
            .block_on(client.query(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&app],
            ))
            .unwrap();
        let n: i64 = rows[0].get(0);
        if n > 0 {
            waited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    if !waited {
        let rows = rt
            .block_on(client.query(
                "SELECT application_name || ' ' || coalesce(state, '') || ' ' || \
                 coalesce(wait_event_type, '') || ' ' || coalesce(query, '') FROM pg_stat_activity",
                &[],
            ))
            .unwrap();
        let act: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        panic!(
            "the engine never waited for the row lock: {:?} {act:#?}",
            waiting.is_finished()
        );
    }
    rt.block_on(client.query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()",
        &[&app],
    ))
    .unwrap();
    // The completion by this process's holder is one autocommit statement
    // (the hot path): a connection ended before its answer leaves the
    // outcome unknown (a FATAL may follow a commit), even though here it
    // was not applied, which the rest shows.
    let err = waiting.join().unwrap().unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    rt.block_on(client.batch_execute("ROLLBACK")).unwrap();
    // Not applied; the engine reconnects and the same request lands.
    assert_eq!(pg.get(&k).unwrap().unwrap().state, State::Processing);
    let done = record(complete(&pg, &k, &lease, b"r"));
    assert_eq!(done.state, State::Succeeded);
}

/// A schema at version 1 (before rows in the hot form) is brought to this
/// build's version by a migration, its records kept; the version row then
/// says 2, so a version-1 build refuses it as too new instead of reading a
/// hot row as corrupt.
#[test]
fn a_version_1_schema_is_upgraded_in_place() {
    if skipped() {
        return;
    }
    let name = schema("upgrade");
    let pg = open_with(&name, None);
    let id = pg.store_id();
    let lease = acquired(pg.apply(&key("up-1"), claim(b"a")).unwrap());
    drop(lease);
    drop(pg);
    raw_sql(&format!(
        "UPDATE \"{name}\".meta SET value = '\\x00000001'::bytea WHERE name = 'version'"
    ));
    // A connect (a replica of this build, an operator command) does not
    // upgrade it: replicas of the older build may still be running.
    let plain = PgOptions {
        schema: name.clone(),
        connections: 1,
        ..PgOptions::default()
    };
    for must_exist in [false, true] {
        let err = Postgres::connect(
            server().url(),
            PgOptions {
                must_exist,
                ..plain.clone()
            },
        )
        .unwrap_err();
        match &err {
            Error::Misconfigured {
                fault: ConfigFault::SchemaNotMigrated,
                detail,
            } => assert!(
                detail.contains("schema version 1") && detail.contains("idemstore migrate"),
                "{detail}"
            ),
            other => panic!("expected SchemaNotMigrated, got {other:?}"),
        }
    }
    let rows = raw_sql(&format!(
        "SELECT encode(value, 'hex') FROM \"{name}\".meta WHERE name = 'version'"
    ));
    let version: String = rows[0].get(0);
    assert_eq!(version, "00000001", "a connect upgraded the schema");
    let migrate = PgOptions {
        schema: name.clone(),
        connections: 1,
        migrate: true,
        ..PgOptions::default()
    };
    let up = Postgres::connect(server().url(), migrate.clone()).unwrap();
    assert_eq!(up.found(), super::Found::Upgraded { from: 1 });
    assert_eq!(up.store_id(), id);
    assert_eq!(up.len().unwrap(), 1);
    drop(up);
    let again = Postgres::connect(server().url(), migrate).unwrap();
    assert_eq!(again.found(), super::Found::Current);
}

#[test]
fn a_newer_schema_version_is_refused() {
    if skipped() {
        return;
    }
    let name = schema("version");
    let pg = open_with(&name, None);
    let id = pg.store_id();
    drop(pg);
    // Reopening the same schema keeps its identity.
    assert_eq!(open_with(&name, None).store_id(), id);
    raw_sql(&format!(
        "UPDATE \"{name}\".meta SET value = '\\x00000003'::bytea WHERE name = 'version'"
    ));
    let options = PgOptions {
        schema: name.clone(),
        ..PgOptions::default()
    };
    let err = Postgres::connect(server().url(), options).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Misconfigured {
                fault: ConfigFault::SchemaTooNew,
                ..
            }
        ),
        "{err}"
    );
    let bad = PgOptions {
        schema: "no-dashes".into(),
        ..PgOptions::default()
    };
    assert!(matches!(
        Postgres::connect(server().url(), bad).unwrap_err(),
        Error::InvalidArgument { .. }
    ));
}

#[test]
fn an_unreachable_server_is_unavailable() {
    if skipped() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgresql://postgres@127.0.0.1:{port}/postgres");
    let err = Postgres::connect(&url, PgOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
}

#[test]
fn the_store_time_is_the_database_clock() {
    if skipped() {
        return;
    }
    let pg = open_with(&schema("clock"), None);
    let a = pg.now_ms().unwrap();
    let b = pg.now_ms().unwrap();
    assert!(b >= a);
    let wall = crate::clock::SystemClock;
    let diff = crate::clock::Clock::now_ms(&wall).abs_diff(a);
    assert!(diff < 60_000, "the server clock is {diff} ms off");
}

#[test]
fn a_server_that_goes_away_is_unavailable_until_it_is_back() {
    if skipped() {
        return;
    }
    let own = match TestServer::start_own(super::server::ServerOptions {
        fsync: true,
        ..super::server::ServerOptions::default()
    }) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let clock = ManualClock::new(T0);
    let pg = open_at(own.url(), &schema("restart"), Some(&clock));
    let k = key("k");
    let lease = acquired(pg.apply(&k, claim(b"a")).unwrap());
    own.kill().unwrap();
    let complete = Op::Complete {
        token: lease.token(),
        result: b"r".to_vec(),
    };
    let err = pg.apply(&k, complete.clone()).unwrap_err();
    assert!(
        matches!(err, Error::Unavailable { .. }),
        "nothing was in flight, so nothing is unknown: {err}"
    );
    assert!(matches!(pg.get(&k).unwrap_err(), Error::Unavailable { .. }));
    own.restart().unwrap();
    // The acknowledged claim survived the crash; the completion lands now.
    assert_eq!(pg.get(&k).unwrap().unwrap().state, State::Processing);
    assert_eq!(
        record(pg.apply(&k, complete).unwrap()).state,
        State::Succeeded
    );
}

#[test]
fn a_key_inserted_meanwhile_is_decided_again_in_the_same_batch() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("cas");
    let schema_name = pg.shared.sql.schema.clone();
    let (k, k2) = (key("raced"), key("bystander"));
    let theirs = Record {
        key: k.clone(),
        state: State::Processing,
        token: 1_000,
        fingerprint: Fingerprint::of(b"a"),
        created_ms: T0,
        updated_ms: T0,
        lease_until_ms: T0 + 1_000,
        expires_ms: T0 + RETENTION,
        output: None,
        recovery_point: None,
        business_key: None,
        acquisitions: 1,
    };
    let kb = k.to_bytes();
    let env = crate::codec::encode_record(&kb, &theirs);
    // "Another process" inserts the key and has not committed yet.
    let (rt, client) = client_at(server().url());
    rt.block_on(async {
        client.batch_execute("BEGIN").await.unwrap();
        client
            .execute(
                &format!(
                    "INSERT INTO \"{schema_name}\".records \
                     (key, record, token, state, created_ms, lease_until_ms, expires_ms) \
                     VALUES ($1, $2, 1000, 0, $3, $4, $5)"
                ),
                &[
                    &kb,
                    &env,
                    &i64::try_from(T0).unwrap(),
                    &i64::try_from(T0 + 1_000).unwrap(),
                    &i64::try_from(T0 + RETENTION).unwrap(),
                ],
            )
            .await
            .unwrap();
    });
    let pg = Arc::new(pg);
    let batch = {
        let (pg, k, k2) = (pg.clone(), k.clone(), k2.clone());
        std::thread::spawn(move || pg.apply_many(vec![(k2, claim(b"a")), (k, claim(b"a"))]))
    };
    // The engine's insert waits for the other transaction.
    let mut waited = false;
    for _ in 0..200 {
        rt.block_on(client.query("SELECT pg_stat_clear_snapshot()", &[]))
            .unwrap();
        let rows = rt
            .block_on(client.query(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE (query LIKE 'INSERT INTO%' OR query LIKE 'WITH guard AS (INSERT%') \
                 AND wait_event_type = 'Lock' \
                 AND pid <> pg_backend_pid()",
                &[],
            ))
            .unwrap();
        let n: i64 = rows[0].get(0);
        if n > 0 {
            waited = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(waited, "the engine's insert never waited");
    rt.block_on(client.batch_execute("COMMIT")).unwrap();
    let replies = batch.join().unwrap().unwrap();
    assert!(matches!(
        replies[0],
        Ok(Reply::Claim(ClaimOutcome::Acquired(_)))
    ));
    match &replies[1] {
        Ok(Reply::Claim(ClaimOutcome::InProgress { lease_until_ms, .. })) => {
            assert_eq!(*lease_until_ms, T0 + 1_000);
        }
        other => panic!("the raced key was not decided again: {other:?}"),
    }
    assert_eq!(pg.get(&k).unwrap().unwrap(), theirs);
    assert!(pg.get(&k2).unwrap().is_some());
}

#[test]
fn a_record_is_never_judged_before_its_own_time() {
    if skipped() {
        return;
    }
    let name = schema("record_time");
    let ahead = ManualClock::new(T0 + 10_000);
    let behind = ManualClock::new(T0);
    let a = open_with(&name, Some(&ahead));
    let b = open_with(&name, Some(&behind));
    let k = key("k");
    let lease = acquired(a.apply(&k, claim(b"a")).unwrap());
    assert_eq!(lease.lease_until_ms(), Some(T0 + 11_000));
    match b.apply(&k, claim(b"a")).unwrap() {
        Reply::Claim(ClaimOutcome::InProgress { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::from_millis(1_000));
        }
        other => panic!("{other:?}"),
    }
    let done = record(complete(&b, &k, &lease, b"r"));
    assert_eq!(done.updated_ms, T0 + 10_000);
    assert_eq!(done.expires_ms, T0 + 10_000 + RETENTION);
}

/// Lifecycles per second (claim + complete) on a server of its own with
/// fsync on, at 1 and 64 threads. Run with `--ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a test"]
fn lifecycles_per_second() {
    if skipped() {
        return;
    }
    let fsync = std::env::var("IDEMSTORE_BENCH_FSYNC").as_deref() != Ok("off");
    let connections = std::env::var("IDEMSTORE_BENCH_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let own = match TestServer::start_own(super::server::ServerOptions {
        fsync,
        tls: false,
        stat_statements: false,
    }) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    for threads in [1usize, 64] {
        let options = PgOptions {
            schema: schema("bench"),
            connections,
            ..PgOptions::default()
        };
        let pg = Arc::new(Postgres::connect(own.url(), options).unwrap());
        let run = Duration::from_secs(3);
        let done = Arc::new(AtomicU64::new(0));
        let start = std::time::Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (pg, done) = (pg.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while start.elapsed() < run {
                        let k = key(&format!("t{t}-{i}"));
                        i += 1;
                        let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
                        complete(&pg, &k, &l, b"r");
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let n = done.load(Ordering::Relaxed);
        #[allow(clippy::cast_precision_loss)]
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let commits = pg.counters().snapshot();
        eprintln!(
            "peer=postgres-engine threads={threads} connections={connections} fsync={fsync} \
             lifecycles/s={rate:.0} ({commits:?})"
        );
    }
}

#[test]
fn the_engine_and_its_futures_cross_threads() {
    if skipped() {
        return;
    }
    fn send_sync<T: Send + Sync>(_: &T) {}
    fn send<T: Send>(_: &T) {}
    let (pg, _clock) = open("send");
    send_sync(&pg);
    let k = key("k");
    let fut = pg.apply_async(&k, claim(b"a"));
    send(&fut);
    acquired(futures_lite::future::block_on(fut).unwrap());
    let iter = pg.entries(vec![(Vec::new(), None)]).unwrap();
    send(&iter);
    assert_eq!(iter.count(), 1);
}

#[test]
fn replicas_racing_for_one_business_key_bind_it_once() {
    if skipped() {
        return;
    }
    let name = schema("bk_race");
    let stores: Vec<Arc<Postgres>> = (0..2).map(|_| Arc::new(open_with(&name, None))).collect();
    for round in 0..20 {
        let barrier = Arc::new(Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let pg = stores[t % 2].clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let k = key(&format!("bk{round}-{t}"));
                    barrier.wait();
                    pg.apply(&k, claim_bk(b"a", &format!("order-{round}")))
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let won = results
            .iter()
            .filter(|r| matches!(r, Ok(Reply::Claim(ClaimOutcome::Acquired(_)))))
            .count();
        let conflicts = results
            .iter()
            .filter(|r| matches!(r, Err(Error::BusinessKeyConflict { .. })))
            .count();
        assert_eq!((won, conflicts), (1, 7), "round {round}: {results:?}");
    }
}

/// Whether the backends of application `app` on the server at `url` use
/// TLS.
fn uses_tls(url: &str, app: &str) -> Vec<bool> {
    let (rt, client) = client_at(url);
    rt.block_on(async {
        client
            .query(
                "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
                 WHERE a.application_name = $1",
                &[&app],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    })
}

#[test]
fn tls_follows_sslmode() {
    if skipped() {
        return;
    }
    let own = match TestServer::start_own(super::server::ServerOptions {
        tls: true,
        ..super::server::ServerOptions::default()
    }) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let root = own.root_cert().unwrap();
    let plain = format!("{}?sslmode=disable", own.url());
    let root = root.display().to_string();
    let cases = [
        ("disable", String::new(), false),
        ("require", String::new(), true),
        ("prefer", String::new(), true),
        ("verify-full", format!("&sslrootcert={root}"), true),
        ("verify-ca", format!("&sslrootcert={root}"), true),
    ];
    for (mode, extra, encrypted) in cases {
        let app = format!("tls_{}", mode.replace('-', "_"));
        let url = format!("{}?sslmode={mode}&application_name={app}{extra}", own.url());
        let pg = open_at(&url, &schema(&app), None);
        acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
        let seen = uses_tls(&plain, &app);
        assert!(!seen.is_empty(), "{mode}");
        assert!(seen.iter().all(|s| *s == encrypted), "{mode}: {seen:?}");
    }
    // A certificate from an unknown CA is refused under verify-full.
    let url = format!("{}?sslmode=verify-full", own.url());
    let err = Postgres::connect(&url, PgOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Misconfigured {
                fault: ConfigFault::Tls,
                ..
            }
        ),
        "{err}"
    );
    // A throwaway server without TLS: require cannot connect.
    if std::env::var(super::server::URL_ENV).is_err() {
        let url = format!("{}?sslmode=require", server().url());
        let err = Postgres::connect(&url, PgOptions::default()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Misconfigured {
                    fault: ConfigFault::Tls,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn a_store_is_named_without_credentials_or_tls_options() {
    let name = |url: &str| super::store_name(url, "s").display().to_string();
    assert_eq!(
        name(
            "postgresql://app:secret@db.internal:5433/orders?sslmode=verify-full&sslrootcert=/etc/ca.pem"
        ),
        "postgresql://db.internal:5433/orders?schema=s"
    );
    assert_eq!(
        name("host=db user=app password=secret dbname=orders sslmode=require"),
        "postgresql://db/orders?schema=s"
    );
    // A database name that is itself a connection string is not shown.
    let shown = name("host=db dbname='postgresql://app:secret@db2/orders'");
    assert!(!shown.contains("secret"), "{shown}");
    assert_eq!(shown, "postgresql://db/…?schema=s");
}

/// Found by review: rows a sweep cannot evict (corrupt ones, reported and
/// left for `check`) held back every due row after them, for good.
#[test]
fn corrupt_rows_do_not_hold_a_sweep_back() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("sweep_corrupt");
    for i in 0..4 {
        let k = key(&format!("k{i}"));
        let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
        complete(&pg, &k, &l, b"r");
        clock.advance(Duration::from_millis(10));
    }
    // The two rows due first are damaged (their envelopes no longer match).
    for i in 0..2 {
        raw_sql(&format!(
            "UPDATE \"{}\".records SET record = '\\x00'::bytea WHERE key = '\\x{}'::bytea",
            pg.shared.sql.schema,
            hex(&key(&format!("k{i}")).to_bytes())
        ));
    }
    clock.advance(Duration::from_millis(RETENTION));
    assert_eq!(pg.sweep(2).unwrap(), 2, "the two sound rows behind them");
    assert_eq!(pg.sweep(2).unwrap(), 0);
    assert_eq!(pg.len().unwrap(), 2, "the damaged rows stay for check");
}

/// `stats` counts the rows by state from their columns in one statement
/// (no envelope is read): live rows by state and lapsed leases (from the
/// lease's end on), rows past retention (from their expiry on), a row
/// whose `state` column is none of the four as corrupt whether or not it
/// is past retention, a row damaged only in its envelope in its state;
/// and the oldest live Processing row's creation time (a negative one,
/// damage, left out rather than failing the call).
#[test]
fn state_counts_come_from_the_rows_columns() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("state_counts");
    let finish = |id: &str, op: &dyn Fn(u64) -> Op| {
        let k = key(id);
        let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
        pg.apply(&k, op(l.token())).unwrap();
    };
    let complete = |token| Op::Complete {
        token,
        result: b"r".to_vec(),
    };
    let at = |now: u64| pg.state_counts(now).unwrap();
    assert_eq!(at(T0), (StateCounts::default(), None));
    // Expires at T0 + RETENTION.
    finish("old", &complete);
    clock.advance(Duration::from_secs(10));
    // These expire at T0 + 10 s + RETENTION.
    finish("done", &complete);
    finish("bad-state", &complete);
    finish("bad-envelope", &complete);
    finish("failed", &|token| Op::Fail {
        token,
        failure: b"no".to_vec(),
        retryable: false,
    });
    finish("retry", &|token| Op::Fail {
        token,
        failure: b"later".to_vec(),
        retryable: true,
    });
    // In flight: leases of 1 s, each record expiring retention after its
    // claim (T0 + 10 s + RETENTION, and 500 ms later).
    acquired(pg.apply(&key("held"), claim(b"a")).unwrap());
    clock.advance(Duration::from_millis(500));
    acquired(pg.apply(&key("held-later"), claim(b"a")).unwrap());
    let hex = |id: &str| hex(&key(id).to_bytes());
    let table = format!("\"{}\".records", pg.shared.sql.schema);
    let damage = |set: &str, id: &str| {
        raw_sql(&format!(
            "UPDATE {table} SET {set} WHERE key = '\\x{}'::bytea",
            hex(id)
        ));
    };
    damage("state = 9", "bad-state");
    damage("record = '\\x00'::bytea", "bad-envelope");
    let live = StateCounts {
        processing: 2,
        lapsed: 0,
        succeeded: 3,
        failed: 1,
        failed_retryable: 1,
        expired: 0,
        corrupt: 1,
    };
    let (before, oldest) = at(T0 + 10_999);
    assert_eq!(before, live);
    assert_eq!(before.total(), pg.len().unwrap());
    assert_eq!(oldest, Some(T0 + 10_000), "the oldest, not the latest");
    // A lease lapses at its end.
    assert_eq!(at(T0 + 11_000).0.lapsed, 1);
    assert_eq!(at(T0 + 11_500).0.lapsed, 2);
    // A record is past retention from its expiry on.
    assert_eq!(at(T0 + RETENTION - 1).0.expired, 0);
    assert_eq!(at(T0 + RETENTION).0.expired, 1);
    // Past the 10-s records' retention, the first Processing row's
    // included (exactly at its expiry): the damaged state stays corrupt;
    // the expired Processing row is no longer the oldest.
    let (after, oldest) = at(T0 + 10_000 + RETENTION);
    let expected = StateCounts {
        processing: 1,
        lapsed: 1,
        succeeded: 0,
        failed: 0,
        failed_retryable: 0,
        expired: 6,
        corrupt: 1,
    };
    assert_eq!(after, expected);
    assert_eq!(oldest, Some(T0 + 10_500));
    // A negative creation time is left out of the oldest, not an error.
    damage("created_ms = -1", "held-later");
    assert_eq!(at(T0 + 10_000 + RETENTION), (expected, None));
}

/// `url` (its host and port) as a key=value connection string for `user`
/// (with `password`, if any) and database `db`.
fn url_as(url: &str, user: &str, password: Option<&str>, db: &str) -> String {
    let config: tokio_postgres::Config = url.parse().unwrap();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".into(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let mut out = format!("host={host} port={port} user={user} dbname={db}");
    if let Some(pw) = password {
        out.push_str(&format!(" password={pw}"));
    }
    out
}

/// The fault of a refused connect, or a panic naming what came instead.
fn fault_of(url: &str, schema: &str) -> ConfigFault {
    let options = PgOptions {
        schema: schema.to_string(),
        ..PgOptions::default()
    };
    match Postgres::connect(url, options) {
        Err(Error::Misconfigured { fault, detail }) => {
            assert!(!detail.is_empty());
            fault
        }
        Err(other) => panic!("expected Misconfigured, got {other:?}"),
        Ok(_) => panic!("connected"),
    }
}

#[test]
fn configuration_faults_are_misconfigured_not_unavailable() {
    if skipped() {
        return;
    }
    let url = server().url();
    let name = schema("faults");
    drop(open_with(&name, None));
    let current: tokio_postgres::Config = url.parse().unwrap();
    let user = current.get_user().unwrap_or("postgres").to_string();
    let db = current.get_dbname().unwrap_or("postgres").to_string();
    let tag = format!("{}_{}", std::process::id(), name.len());
    // No such database.
    let missing_db = url_as(url, &user, None, &format!("no_such_db_{tag}"));
    assert_eq!(fault_of(&missing_db, &name), ConfigFault::DatabaseMissing);
    // No such role, and a role that may not log in.
    let ghost = url_as(url, &format!("no_such_role_{tag}"), None, &db);
    assert_eq!(fault_of(&ghost, &name), ConfigFault::RoleRefused);
    let nologin = format!("nologin_{tag}");
    raw_sql(&format!("CREATE ROLE {nologin} NOLOGIN"));
    assert_eq!(
        fault_of(&url_as(url, &nologin, None, &db), &name),
        ConfigFault::RoleRefused
    );
    // A role without any privilege on the store's schema.
    let bare = format!("bare_{tag}");
    raw_sql(&format!("CREATE ROLE {bare} LOGIN"));
    assert_eq!(
        fault_of(&url_as(url, &bare, None, &db), &name),
        ConfigFault::PermissionDenied
    );
    // A string that names no server (libpq's default socket, which the
    // driver does not look for), a NUL byte in a setting, and an
    // authentication exchange that cannot succeed (channel binding asked
    // of a server that trusts): no retry helps (they were Unavailable).
    assert_eq!(
        fault_of("postgresql:///postgres", &name),
        ConfigFault::ConnectionString
    );
    let nul = format!(
        "{} application_name='a\u{0}b'",
        url_as(url, &user, None, &db)
    );
    assert_eq!(fault_of(&nul, &name), ConfigFault::ConnectionString);
    let bound = format!("{} channel_binding=require", url_as(url, &user, None, &db));
    assert_eq!(fault_of(&bound, &name), ConfigFault::AuthenticationFailed);
    // A setting in the string's options the server does not know, a value
    // it refuses, and one only its own start may set: FATAL at start-up
    // (they were Unavailable, which a service retries for ever).
    for setting in [
        "no_such_setting=1",
        "statement_timeout=soon",
        "shared_buffers=10MB",
    ] {
        let set = format!("{} options='-c {setting}'", url_as(url, &user, None, &db));
        assert_eq!(
            fault_of(&set, &name),
            ConfigFault::ConnectionString,
            "{setting}"
        );
    }
    // An unreachable server stays Unavailable (retry as is).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = Postgres::connect(
        &format!("postgresql://postgres@127.0.0.1:{port}/postgres"),
        PgOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err}");
}

/// A string tokio-postgres refuses for an unknown option is refused
/// without the option's name: in `password=correct horse=staple` it is
/// the second word of a password that needed quotes. (No server: the
/// string is refused before any connection.)
#[test]
fn an_unknown_option_is_refused_without_its_name() {
    let options = PgOptions {
        schema: "unknown_option".into(),
        ..PgOptions::default()
    };
    match Postgres::connect("host=127.0.0.1 password=correct horse=staple", options) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(!reason.contains("horse"), "{reason}");
            assert!(reason.contains("quotes"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {:?}", other.map(drop)),
    }
}

#[test]
fn a_wrong_password_is_misconfigured() {
    if skipped() {
        return;
    }
    // A server of its own: its pg_hba.conf is rewritten to ask one role
    // for a password.
    let own = match TestServer::start_own(super::server::ServerOptions::default()) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let (rt, client) = client_at(own.url());
    rt.block_on(async {
        client
            .batch_execute(
                "CREATE ROLE pw_user LOGIN PASSWORD 'right'; \
                 CREATE ROLE sp_user LOGIN PASSWORD 'two  spaces'",
            )
            .await
            .unwrap();
        let hba: String = client.query_one("SHOW hba_file", &[]).await.unwrap().get(0);
        client
            .batch_execute(&format!(
                "COPY (VALUES ('local all all trust'), \
                 ('host all pw_user,sp_user 0.0.0.0/0 scram-sha-256'), \
                 ('host all all 0.0.0.0/0 trust')) TO '{hba}'; SELECT pg_reload_conf()"
            ))
            .await
            .unwrap();
    });
    let right = url_as(own.url(), "pw_user", Some("right"), "postgres");
    let wrong = url_as(own.url(), "pw_user", Some("wrong"), "postgres");
    // The reload takes effect for connections after it: wait until the
    // password is asked for (hang guard).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let asked = rt.block_on(async {
            tokio_postgres::connect(&wrong, tokio_postgres::NoTls)
                .await
                .is_err()
        });
        if asked {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pg_hba.conf never reloaded"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        fault_of(&wrong, "pw_store"),
        ConfigFault::AuthenticationFailed
    );
    // The right password gets as far as the schema, which pw_user may not
    // create.
    assert_eq!(fault_of(&right, "pw_store"), ConfigFault::SchemaNotMigrated);
    // No password where the server asks for one (PGPASSWORD and .pgpass
    // are not read): a fault of configuration, in both forms.
    let none = url_as(own.url(), "pw_user", None, "postgres");
    assert_eq!(
        fault_of(&none, "pw_store"),
        ConfigFault::AuthenticationFailed
    );
    let config: tokio_postgres::Config = own.url().parse().unwrap();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let none_url = format!("postgresql://pw_user@127.0.0.1:{port}/postgres");
    assert_eq!(
        fault_of(&none_url, "pw_store"),
        ConfigFault::AuthenticationFailed
    );
    // A quoted password with spaces, and spaces around '=', are read as
    // tokio-postgres reads them: the password is right.
    let quoted = format!(
        "host=127.0.0.1 port = {port} user=sp_user password='two  spaces' \
         sslmode = 'disable' dbname=postgres"
    );
    assert_eq!(
        fault_of(&quoted, "pw_store"),
        ConfigFault::SchemaNotMigrated
    );
}

/// A store whose schema objects are dropped under it answers
/// `Misconfigured` with `SchemaDamaged` (never `Unavailable`, which a
/// service would retry for ever), and a connect or a migration refuses
/// such a schema instead of creating the missing objects empty.
#[test]
fn objects_dropped_under_a_store_are_schema_damaged() {
    if skipped() {
        return;
    }
    let name = schema("dropped");
    let pg = open_with(&name, None);
    let l = acquired(pg.apply(&key("before"), claim(b"a")).unwrap());
    complete(&pg, &key("before"), &l, b"r");
    let damaged = |what: &str, answer: Result<(), Error>| match answer {
        Err(Error::Misconfigured {
            fault: ConfigFault::SchemaDamaged,
            ..
        }) => {}
        other => panic!("{what}: expected SchemaDamaged, got {other:?}"),
    };
    let connect = |migrate: bool| {
        let options = PgOptions {
            schema: name.clone(),
            connections: 1,
            migrate,
            ..PgOptions::default()
        };
        Postgres::connect(server().url(), options).map(drop)
    };
    let exists = |relation: &str| -> bool {
        raw_sql(&format!(
            "SELECT to_regclass('\"{name}\".{relation}') IS NOT NULL"
        ))[0]
            .get(0)
    };
    // The token sequence: a claim of a new key draws from it.
    raw_sql(&format!("DROP SEQUENCE \"{name}\".tokens"));
    damaged("a claim", pg.apply(&key("after"), claim(b"a")).map(drop));
    damaged("a connect", connect(false));
    damaged("a migration", connect(true));
    assert!(!exists("tokens"), "the migration created the sequence");
    // The records table: a read.
    raw_sql(&format!("DROP TABLE \"{name}\".records"));
    damaged("a get", pg.get(&key("before")).map(drop));
    damaged("stats", pg.state_counts(T0).map(drop));
    match connect(true) {
        Err(Error::Misconfigured { detail, .. }) => {
            assert!(detail.contains("records, tokens"), "{detail}");
        }
        other => panic!("expected SchemaDamaged, got {other:?}"),
    }
    assert!(
        !exists("records"),
        "the migration created the records table"
    );
    // The whole schema: the running store's requests.
    raw_sql(&format!("DROP SCHEMA \"{name}\" CASCADE"));
    damaged(
        "a claim with no schema",
        pg.apply(&key("again"), claim(b"a")).map(drop),
    );
    // The meta table: a connect that may create would otherwise make a
    // new store (a new identity) over the old rows.
    drop(open_with(&name, None));
    raw_sql(&format!("DROP TABLE \"{name}\".meta"));
    damaged("a connect without meta", connect(false));
    damaged("a migration without meta", connect(true));
    assert!(!exists("meta"), "a connect created the meta table");
}

/// A key column that lost its unique index (a primary key dropped by a
/// migration or by hand) is a damaged schema: without it two replicas
/// claiming one key at once both insert it and both run its work. A
/// running store's claim answers `SchemaDamaged`, alone (its hot
/// statement's `ON CONFLICT` finds no index) or in a batch (the general
/// way's insert carries a guard with the same `ON CONFLICT`),
/// `verify` names the schema and a key held by two rows, and a connect or
/// a migration refuses the schema, saying how to restore the index; once
/// restored, the store runs again.
#[test]
fn a_key_column_without_its_unique_index_is_a_damaged_schema() {
    if skipped() {
        return;
    }
    let name = schema("unkeyed");
    let pg = open_with(&name, None);
    let l = acquired(pg.apply(&key("before"), claim(b"a")).unwrap());
    complete(&pg, &key("before"), &l, b"r");
    let records = format!("\"{name}\".records");
    raw_sql(&format!(
        "ALTER TABLE {records} DROP CONSTRAINT records_pkey"
    ));
    assert_schema_damaged(
        "a claim without the unique index",
        pg.apply(&key("after"), claim(b"a")),
        &[],
    );
    // A batch goes the general way, whose first insert carries no `ON
    // CONFLICT` of its own.
    let batch = pg.apply_many(vec![
        (key("batch-1"), claim(b"a")),
        (key("batch-2"), claim(b"a")),
    ]);
    let refused = match &batch {
        Err(e) => vec![e],
        Ok(answers) => answers.iter().filter_map(|a| a.as_ref().err()).collect(),
    };
    assert!(
        refused.len() == 2 || batch.is_err(),
        "a batch without the unique index: {batch:?}"
    );
    for e in refused {
        assert!(
            matches!(
                e,
                Error::Misconfigured {
                    fault: ConfigFault::SchemaDamaged,
                    ..
                }
            ),
            "a batch without the unique index: {batch:?}"
        );
    }
    let rows: i64 = raw_sql(&format!("SELECT count(*) FROM {records}"))[0].get(0);
    assert_eq!(rows, 1, "the refused claim inserted a row");
    // A second row of one key, as two claims racing would leave.
    raw_sql(&format!(
        "INSERT INTO {records} SELECT * FROM {records} WHERE key = '\\x{}'::bytea",
        hex(&key("before").to_bytes())
    ));
    let report = pg.verify(|_| {}).unwrap();
    let details: Vec<String> = report
        .problems
        .iter()
        .map(|p| format!("{}: {}", p.key, p.detail))
        .collect();
    assert_eq!(report.problems.len(), 2, "{details:#?}");
    assert!(
        details[0].starts_with(&format!("(schema {name})"))
            && details[0].contains("records.key lost its unique index"),
        "{details:#?}"
    );
    assert_eq!(report.problems[1].idempotency_key, Some(key("before")));
    assert!(
        details[1].contains("two rows hold this key"),
        "{details:#?}"
    );
    for migrate in [false, true] {
        let options = PgOptions {
            schema: name.clone(),
            connections: 1,
            migrate,
            ..PgOptions::default()
        };
        assert_schema_damaged(
            &format!("a connect, migrate {migrate}"),
            Postgres::connect(server().url(), options).map(drop),
            &["records.key lost its unique index", "ADD PRIMARY KEY (key)"],
        );
    }
    // Restored as the message says: the duplicate removed, the key added.
    raw_sql(&format!(
        "DELETE FROM {records} a USING {records} b WHERE a.ctid > b.ctid AND a.key = b.key"
    ));
    raw_sql(&format!("ALTER TABLE {records} ADD PRIMARY KEY (key)"));
    drop(pg);
    let pg = open_with(&name, None);
    acquired(pg.apply(&key("after"), claim(b"a")).unwrap());
    // The bindings' key too.
    raw_sql(&format!(
        "ALTER TABLE \"{name}\".bindings DROP CONSTRAINT bindings_pkey"
    ));
    assert_schema_damaged(
        "a connect without the bindings' key",
        Postgres::connect(server().url(), options(&name, None)).map(drop),
        &["bindings.binding lost"],
    );
}

/// What was added to or taken from the store's tables outside idemstore
/// and refuses its statements is a damaged schema, not `Unavailable`
/// (which a service retries as is, for ever): a `CHECK` constraint, a
/// trigger that raises, a `NOT NULL` dropped and a NULL written, a
/// column's type altered under a running store. A connect names a column
/// that allows NULL.
#[test]
fn constraints_and_triggers_added_outside_idemstore_are_a_damaged_schema() {
    if skipped() {
        return;
    }
    // A CHECK that no completed row passes: the completion is refused.
    let (pg, _clock) = open("check_added");
    let records = format!("\"{}\".records", pg.shared.sql.schema);
    let l = acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
    raw_sql(&format!(
        "ALTER TABLE {records} ADD CONSTRAINT no_done CHECK (state = 0)"
    ));
    let done = Op::Complete {
        token: l.token(),
        result: b"r".to_vec(),
    };
    assert_schema_damaged("a completion under a CHECK", pg.apply(&key("k"), done), &[]);
    // A trigger that raises on every insert: the claim is refused.
    let (pg, _clock) = open("trigger_added");
    let name = pg.shared.sql.schema.clone();
    raw_sql(&format!(
        "CREATE FUNCTION \"{name}\".refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN RAISE EXCEPTION 'refused'; END$$"
    ));
    raw_sql(&format!(
        "CREATE TRIGGER refuse BEFORE INSERT ON \"{name}\".records \
         FOR EACH ROW EXECUTE FUNCTION \"{name}\".refuse()"
    ));
    assert_schema_damaged(
        "a claim under a raising trigger",
        pg.apply(&key("k"), claim(b"a")),
        &[],
    );
    // A deferred constraint trigger that raises at the commit: the general
    // way's `COMMIT` is refused (was `Unavailable`), as is the hot way's
    // statement.
    let (pg, _clock) = open("deferred_trigger_added");
    let name = pg.shared.sql.schema.clone();
    raw_sql(&format!(
        "CREATE FUNCTION \"{name}\".refuse_late() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN RAISE EXCEPTION 'refused at commit'; END$$"
    ));
    raw_sql(&format!(
        "CREATE CONSTRAINT TRIGGER refuse_late AFTER INSERT ON \"{name}\".records \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{name}\".refuse_late()"
    ));
    assert_schema_damaged(
        "a business-key claim refused at its commit",
        pg.apply(&key("k"), claim_bk(b"a", "T-1")),
        &["refused at commit"],
    );
    assert_schema_damaged(
        "a hot claim refused at its statement's end",
        pg.apply(&key("h"), claim(b"a")),
        &["refused at commit"],
    );
    // A unique index on a column other than the key: a second claim's
    // insert is refused (23505 on that index, was `Unavailable`, which a
    // service retries for ever).
    let (pg, _clock) = open("unique_added");
    let name = pg.shared.sql.schema.clone();
    acquired(pg.apply(&key("a"), claim(b"a")).unwrap());
    raw_sql(&format!(
        "CREATE UNIQUE INDEX one_per_state ON \"{name}\".records (state)"
    ));
    assert_schema_damaged(
        "a claim under a unique index of another column",
        pg.apply(&key("b"), claim(b"a")),
        &["23505", "one_per_state"],
    );
    // A trigger whose function fails with an error of its own (a division
    // by zero, 22012; was `Unavailable`): refused as what was added.
    // A trigger that is only slow still answers `Unavailable` when
    // `statement_timeout` cancels it (57014: that passes).
    let clock = ManualClock::new(T0);
    let name = schema("routine_added");
    let mut slow = options(&name, Some(&clock));
    slow.limits.statement_timeout = Duration::from_secs(2);
    let pg = Postgres::connect(server().url(), slow).unwrap();
    let l = acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
    raw_sql(&format!(
        "CREATE FUNCTION \"{name}\".audit() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN PERFORM 1 / 0; \
         RETURN NEW; END$$"
    ));
    raw_sql(&format!(
        "CREATE TRIGGER audit BEFORE UPDATE ON \"{name}\".records \
         FOR EACH ROW EXECUTE FUNCTION \"{name}\".audit()"
    ));
    let done = Op::Complete {
        token: l.token(),
        result: b"r".to_vec(),
    };
    assert_schema_damaged(
        "a completion under a trigger that divides by zero",
        pg.apply(&key("k"), done.clone()),
        &["22012"],
    );
    raw_sql(&format!(
        "CREATE OR REPLACE FUNCTION \"{name}\".audit() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN PERFORM pg_sleep(60); RETURN NEW; END$$"
    ));
    match pg.apply(&key("k"), done) {
        Err(e @ Error::Unavailable { .. }) => {
            assert!(e.to_string().contains("57014"), "{e}");
            assert!(e.is_transient());
        }
        other => panic!("a completion cancelled by statement_timeout: {other:?}"),
    }
    // A NULL where the store keeps a value: a read is refused, and so is
    // a connect, naming the column.
    let (pg, _clock) = open("null_allowed");
    let name = pg.shared.sql.schema.clone();
    let l = acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
    complete(&pg, &key("k"), &l, b"r");
    raw_sql(&format!(
        "ALTER TABLE \"{name}\".records ALTER COLUMN created_ms DROP NOT NULL"
    ));
    raw_sql(&format!("UPDATE \"{name}\".records SET created_ms = NULL"));
    assert_schema_damaged("a read of a NULL", pg.get(&key("k")), &[]);
    assert_schema_damaged(
        "a connect",
        Postgres::connect(server().url(), options(&name, None)).map(drop),
        &["records.created_ms allows NULL"],
    );
    // A column's type altered under a running store: the statements its
    // connection prepared no longer fit ("cached plan must not change
    // result type", 0A000, on every later run; was `Unavailable`).
    let (pg, _clock) = open("type_altered");
    let name = pg.shared.sql.schema.clone();
    let l = acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
    complete(&pg, &key("k"), &l, b"r");
    assert!(pg.get(&key("k")).unwrap().is_some());
    raw_sql(&format!(
        "ALTER TABLE \"{name}\".records ALTER COLUMN created_ms TYPE numeric"
    ));
    for attempt in 1..=2 {
        assert_schema_damaged(
            &format!("a read after a type change, attempt {attempt}"),
            pg.get(&key("k")),
            &[],
        );
    }
}

/// A page of the records table the server finds corrupted (XX001, its
/// header overwritten while the server was down) is `Storage`, which is
/// not transient: every retry meets it again, so a service must not be
/// told to retry (it was `Unavailable`, answered with HTTP 503 and
/// `Retry-After`). Nothing is applied, and the engine goes on: a read
/// that needs no page of the damaged ones is answered.
#[test]
fn a_page_the_server_finds_corrupted_is_storage_not_transient() {
    if skipped() {
        return;
    }
    let own = match TestServer::start_own(super::server::ServerOptions::default()) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let clock = ManualClock::new(T0);
    let name = schema("corrupted_page");
    let pg = open_at(own.url(), &name, Some(&clock));
    let k = key("k");
    let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
    complete(&pg, &k, &l, b"r");
    let file: String = sql_at(
        own.url(),
        &format!(
            "SELECT current_setting('data_directory') || '/' || \
             pg_relation_filepath('\"{name}\".records')"
        ),
    )[0]
    .get(0);
    // Written to the file, so that the restart replays nothing over it
    // (no autovacuum logs a new image of the page meanwhile).
    sql_at(
        own.url(),
        &format!("ALTER TABLE \"{name}\".records SET (autovacuum_enabled = false)"),
    );
    sql_at(own.url(), "CHECKPOINT");
    own.kill().unwrap();
    let mut page = std::fs::read(&file).unwrap();
    assert!(page.len() >= 8192, "{} bytes in {file}", page.len());
    page[..24].fill(0xde);
    std::fs::write(&file, &page).unwrap();
    own.restart().unwrap();
    // The first requests may meet the connections the restart broke
    // (`Unavailable` without the server's verdict); a bounded number of
    // tries (hang guard).
    let mut answer = pg.get(&k);
    for _ in 0..50 {
        match &answer {
            Err(Error::Unavailable { detail }) if !detail.contains("XX001") => {
                std::thread::sleep(Duration::from_millis(100));
                answer = pg.get(&k);
            }
            _ => break,
        }
    }
    for (what, answer) in [
        ("a read", answer.map(drop)),
        ("a claim", pg.apply(&k, claim(b"a")).map(drop)),
    ] {
        match answer {
            Err(e @ Error::Storage(_)) => {
                assert!(e.to_string().contains("XX001"), "{what}: {e}");
                assert!(!e.is_transient(), "{what}: {e}");
            }
            other => panic!("{what} of a key on a corrupted page: {other:?}"),
        }
    }
    assert!(pg.get(&key("never-claimed")).unwrap().is_none());
}

/// A trigger that refuses one key's row (a division by zero for key `b`
/// alone, 22012: met again) fails only that key's requests, not those of
/// other keys batched with them: the batch, refused, runs again a key at
/// a time. Before, every request of the batch got the refusal, which a
/// caller must not retry (`Misconfigured`): the other leases of a renewal
/// batch stopped being renewed and lapsed, and another caller could take
/// their keys over while their work ran.
#[test]
fn one_keys_refusal_fails_no_other_request_in_its_batch() {
    if skipped() {
        return;
    }
    let clock = ManualClock::new(T0);
    let name = schema("one_key_refused");
    let mut one = options(&name, Some(&clock));
    // One worker, so that requests queued while it is busy are one batch.
    one.connections = 1;
    let pg = Arc::new(Postgres::connect(server().url(), one).unwrap());
    let ids = [
        "a", "b", "c", "gate1", "gate2", "d1", "d2", "d3", "d4", "gate3", "gate4", "f1", "f2",
        "f3", "gate5", "gate6",
    ];
    let leases: HashMap<&str, Lease> = ids
        .iter()
        .map(|id| (*id, acquired(pg.apply(&key(id), claim(b"x")).unwrap())))
        .collect();
    // The trigger: the gates' rows sleep, the rows `refused` names are
    // refused (a division by zero, 22012).
    let picky = |refused: &str, gates: [&str; 2]| {
        let bytes = |id: &str| format!("'\\x{}'::bytea", hex(&key(id).to_bytes()));
        raw_sql(&format!(
            "CREATE OR REPLACE FUNCTION \"{name}\".picky() RETURNS trigger LANGUAGE plpgsql AS \
             $$BEGIN \
             IF NEW.key IN ({}, {}) THEN PERFORM pg_sleep(2); \
             ELSIF {refused} THEN PERFORM 1 / 0; END IF; \
             RETURN NEW; END$$",
            bytes(gates[0]),
            bytes(gates[1]),
            refused = ["b", "f1", "f2", "f3"]
                .iter()
                .fold(refused.to_string(), |sql, id| sql
                    .replace(&format!("{{{id}}}"), &bytes(id))),
        ));
    };
    picky("NEW.key = {b}", ["gate1", "gate2"]);
    raw_sql(&format!(
        "CREATE TRIGGER picky BEFORE UPDATE ON \"{name}\".records \
         FOR EACH ROW EXECUTE FUNCTION \"{name}\".picky()"
    ));
    // A lease renewal batch.
    let renewals: Vec<(Key, Op)> = ["a", "b", "c"]
        .iter()
        .map(|id| {
            let l = &leases[id];
            let op = Op::Extend {
                token: l.token(),
                lease_ms: 5_000,
            };
            (l.key().clone(), op)
        })
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let renewed = pg.apply_many_by(renewals, deadline).expect("the batch");
    let [a, b, c]: [Result<Reply, Error>; 3] = renewed.try_into().expect("three answers");
    assert!(a.is_ok(), "a: {a:?}");
    assert_schema_damaged("b's renewal", b, &["22012"]);
    assert!(c.is_ok(), "c: {c:?}");
    // A group commit: the completions of `b` and `c`, queued while the
    // sync callers' direct connection and the one worker complete the
    // gates (their trigger sleeps), are one batch.
    let [b, c]: [Result<Reply, Error>; 2] = completed_behind_gates(
        &pg,
        &name,
        [&leases["gate1"], &leases["gate2"]],
        &[&leases["b"], &leases["c"]],
    )
    .try_into()
    .expect("two answers");
    assert_schema_damaged("b's completion", b, &["22012"]);
    assert_eq!(record(c.expect("c's completion")).state, State::Succeeded);
    // Every row refused: once two keys in a row are refused with the same
    // words, the keys after them are not run, and answered `Unavailable`
    // (the refusal may not be theirs: sent again, each is decided).
    picky("true", ["gate3", "gate4"]);
    let queued: Vec<&Lease> = ["d1", "d2", "d3", "d4"]
        .iter()
        .map(|id| &leases[id])
        .collect();
    let answers = completed_behind_gates(&pg, &name, [&leases["gate3"], &leases["gate4"]], &queued);
    let mut not_run = Vec::new();
    let mut refused = 0;
    for (id, answer) in ["d1", "d2", "d3", "d4"].into_iter().zip(answers) {
        match answer {
            Err(Error::Misconfigured {
                fault: ConfigFault::SchemaDamaged,
                detail,
            }) => {
                assert!(detail.contains("22012"), "{detail}");
                refused += 1;
            }
            Err(e @ Error::Unavailable { .. }) => {
                assert!(e.to_string().contains("not run"), "{e}");
                assert!(e.is_transient());
                not_run.push(id);
            }
            other => panic!("{id}: expected SchemaDamaged or not run, got {other:?}"),
        }
    }
    assert_eq!(
        (refused, not_run.len()),
        (2, 2),
        "the first two run, the two after not"
    );
    // The keys not run, sent again behind three other keys refused with the
    // same words (the `d` rows are sound now): they run first, and are
    // decided, however many refused requests come before them.
    picky("NEW.key IN ({f1}, {f2}, {f3})", ["gate5", "gate6"]);
    let again: Vec<&Lease> = ["f1", "f2", "f3"]
        .into_iter()
        .chain(not_run.iter().copied())
        .map(|id| &leases[id])
        .collect();
    let answers = completed_behind_gates(&pg, &name, [&leases["gate5"], &leases["gate6"]], &again);
    for (id, answer) in ["f1", "f2", "f3"].iter().chain(&not_run).zip(answers) {
        if id.starts_with('d') {
            assert_eq!(record(answer.expect(id)).state, State::Succeeded, "{id}");
        } else {
            assert!(
                matches!(
                    answer,
                    Err(Error::Misconfigured { .. } | Error::Unavailable { .. })
                ),
                "{id}: {answer:?}"
            );
        }
    }
}

/// Completes `queued` (each on a thread of its own) while the completions
/// of `gates`, whose rows the test's trigger holds in `pg_sleep`, hold the
/// direct connection and the one worker of `pg` (a store on schema
/// `name`): the queued requests are then one batch. Their answers, in
/// order.
fn completed_behind_gates(
    pg: &Arc<Postgres>,
    name: &str,
    gates: [&Lease; 2],
    queued: &[&Lease],
) -> Vec<Result<Reply, Error>> {
    let finish = |lease: &Lease| {
        let (pg, lease) = (Arc::clone(pg), lease.clone());
        std::thread::spawn(move || {
            pg.apply(
                lease.key(),
                Op::Complete {
                    token: lease.token(),
                    result: b"r".to_vec(),
                },
            )
        })
    };
    let held: Vec<_> = gates.iter().map(|l| finish(l)).collect();
    let sleeping = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' \
         AND query LIKE '%{name}%'"
    );
    // A bounded number of looks (hang guard).
    let mut looks = 0;
    while raw_sql(&sleeping)[0].get::<_, i64>(0) < 2 {
        looks += 1;
        assert!(
            looks < 1_000,
            "the gates' completions never both reached their trigger"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let waiting: Vec<_> = queued.iter().map(|l| finish(l)).collect();
    let answers = waiting.into_iter().map(|t| t.join().unwrap()).collect();
    for gate in held {
        assert!(gate.join().unwrap().is_ok(), "a gate's completion");
    }
    answers
}

/// A pooler's refusal of the startup options, in the words of PgBouncer
/// 1.18, 1.20 and RDS Proxy (Debian's PgBouncer speaks only the first);
/// a server's own refusals are not a pooler's.
#[test]
fn a_poolers_refusal_of_the_startup_options_is_told_by_its_words() {
    for pooler in [
        "unsupported startup parameter: options",
        "unsupported startup parameter in options: statement_timeout",
        "unsupported options startup parameter: only '-c config=val' is allowed",
        "Feature not supported: RDS Proxy currently doesn't support command-line options.",
    ] {
        assert!(super::pooler_refused(pooler), "{pooler}");
    }
    for server in [
        "unrecognized configuration parameter \"no_such_setting\"",
        "invalid value for parameter \"statement_timeout\": \"soon\"",
        "no more connections allowed (max_client_conn)",
    ] {
        assert!(!super::pooler_refused(server), "{server}");
    }
}

/// Which refusals pass and which are met again, and which name a
/// configuration fault, by SQLSTATE and where they were raised.
#[test]
fn refusals_are_sorted_by_their_sqlstate_class_and_where_they_were_raised() {
    use super::{Refusal, in_routine, refusal};
    let trigger = Some("PL/pgSQL function app.audit() line 1 at PERFORM");
    for passes in [
        "40001", "40P01", "53100", "53200", "53400", "55P03", "55006", "57014", "57P01", "58030",
        "08006", "72000", "25006", "25P03", "2200H",
    ] {
        assert_eq!(refusal(passes, None, None), Refusal::Passes, "{passes}");
        // Also when raised inside a trigger's function: a slow trigger
        // cancelled by statement_timeout is not an object added.
        assert_eq!(
            refusal(passes, trigger, Some("app")),
            Refusal::Passes,
            "{passes}"
        );
    }
    for lasts in [
        "22012", "22001", "54000", "42883", "0A000", "21000", "55000", "XX001", "XX002", "58P01",
    ] {
        assert_eq!(refusal(lasts, None, None), Refusal::Lasts, "{lasts}");
    }
    for added in ["22012", "22001", "54000", "42883"] {
        assert_eq!(
            refusal(added, trigger, None),
            Refusal::Added,
            "{added} in a function"
        );
    }
    // The server's own faults stay its own wherever they are raised.
    for own in ["XX001", "XX002", "XX000", "58P01"] {
        assert_eq!(
            refusal(own, trigger, None),
            Refusal::Lasts,
            "{own} in a function"
        );
    }
    for added in [
        "23505", "23P01", "23502", "23503", "23514", "23001", "P0001",
    ] {
        assert_eq!(refusal(added, None, Some("app")), Refusal::Added, "{added}");
    }
    // Two sessions creating one object at once: passes.
    assert_eq!(refusal("23505", None, Some("pg_catalog")), Refusal::Passes);
    assert!(in_routine(
        "PL/pgSQL function app.audit() line 1 at PERFORM"
    ));
    assert!(in_routine("SQL function \"f\" statement 1"));
    assert!(in_routine(
        "PL/pgSQL-Funktion app.audit() Zeile 1 bei PERFORM"
    ));
    // The engine's own migration runs a `DO` block.
    assert!(!in_routine(
        "PL/pgSQL function inline_code_block line 3 at EXECUTE"
    ));
    assert!(!in_routine("parallel worker"));
    assert!(!in_routine(
        "while locking tuple (0,1) in relation \"records\""
    ));
}

/// Fencing tokens only grow per key: a takeover whose drawn token is not
/// above the record's (the token sequence set back outside idemstore) is
/// refused as a damaged schema, and the record keeps its holder's token.
#[test]
fn a_token_sequence_set_back_is_refused_not_handed_out() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("sequence_back");
    let first = acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
    assert!(first.token() > 1, "{first:?}");
    raw_sql(&format!(
        "ALTER SEQUENCE \"{}\".tokens RESTART WITH 1",
        pg.shared.sql.schema
    ));
    // The lease (1 s) lapses: the next claim is a takeover.
    clock.advance(Duration::from_secs(2));
    assert_schema_damaged(
        "a takeover with a token set back",
        pg.apply(&key("k"), claim(b"a")),
        &["set back"],
    );
    let kept = pg.get(&key("k")).unwrap().expect("the record");
    assert_eq!(kept.token, first.token());
    // Raised again as the message says, the takeover runs.
    raw_sql(&format!(
        "SELECT setval('\"{0}\".tokens', (SELECT max(token) FROM \"{0}\".records))",
        pg.shared.sql.schema
    ));
    let second = acquired(pg.apply(&key("k"), claim(b"a")).unwrap());
    assert!(second.token() > first.token(), "{second:?} after {first:?}");
}

/// A schema without a store that holds another program's table named
/// `records` (not a store's: other columns) is not called a store's
/// damaged schema: a connect or a migration answers `IncompatibleSchema`
/// telling to choose another schema, never to drop it, and changes
/// nothing (the table and its row stay, no meta table is made). A store's
/// own objects without the version row are still `SchemaDamaged`.
#[test]
fn another_programs_table_named_records_is_not_a_stores() {
    if skipped() {
        return;
    }
    let name = schema("app_tables");
    for sql in [
        format!("CREATE SCHEMA \"{name}\""),
        format!("CREATE TABLE \"{name}\".records (id bigint PRIMARY KEY, body text)"),
        format!("INSERT INTO \"{name}\".records VALUES (1, 'customer data')"),
    ] {
        raw_sql(&sql);
    }
    for migrate in [false, true] {
        let options = PgOptions {
            schema: name.clone(),
            connections: 1,
            migrate,
            ..PgOptions::default()
        };
        match Postgres::connect(server().url(), options).map(drop) {
            Err(Error::IncompatibleSchema { detail, .. }) => {
                assert!(
                    detail.contains("records (a table of other columns)"),
                    "{detail}"
                );
                assert!(detail.contains("choose another schema"), "{detail}");
                assert!(!detail.contains("drop"), "{detail}");
            }
            other => panic!("migrate {migrate}: expected IncompatibleSchema, got {other:?}"),
        }
    }
    let rows = raw_sql(&format!("SELECT body FROM \"{name}\".records"));
    assert_eq!(rows.len(), 1);
    let meta: bool = raw_sql(&format!(
        "SELECT to_regclass('\"{name}\".meta') IS NOT NULL"
    ))[0]
        .get(0);
    assert!(!meta, "a connect created the meta table");
    // A store's own tables without their meta table: damaged.
    raw_sql(&format!("DROP SCHEMA \"{name}\" CASCADE"));
    drop(open_with(&name, None));
    raw_sql(&format!("DROP TABLE \"{name}\".meta"));
    match Postgres::connect(server().url(), options(&name, None)).map(drop) {
        Err(Error::Misconfigured {
            fault: ConfigFault::SchemaDamaged,
            detail,
        }) => assert!(detail.contains("holds a store's"), "{detail}"),
        other => panic!("expected SchemaDamaged, got {other:?}"),
    }
}

/// A holder's completion of its row damaged in a column the completion
/// does not rewrite (state, creation time, lease, expiry) or in the hot
/// form's mask byte answers `CorruptRecord`,
/// as every other request on the key does, instead of writing over the
/// damage.
#[test]
fn a_completion_of_a_row_damaged_in_its_columns_is_corrupt_record() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("complete_damaged");
    let table = format!("\"{}\".records", pg.shared.sql.schema);
    let hex = |k: &Key| hex(&k.to_bytes());
    for (what, set) in [
        ("state", "state = 9"),
        ("created", "created_ms = created_ms - 1"),
        ("lease", "lease_until_ms = lease_until_ms + 1"),
        // Later: the hot completion checked only that the row was not
        // past retention, and wrote over the digest's mismatch.
        ("expiry", "expires_ms = expires_ms + 1000"),
        // The hot form's mask byte, which no checksum covers: the update
        // time's bit cleared.
        (
            "mask",
            "record = set_byte(record, 1, get_byte(record, 1) # 4)",
        ),
    ] {
        let k = key(&format!("held-{what}"));
        let l = acquired(pg.apply(&k, claim(b"a")).unwrap());
        raw_sql(&format!(
            "UPDATE {table} SET {set} WHERE key = '\\x{}'::bytea",
            hex(&k)
        ));
        let answer = pg.apply(
            &k,
            Op::Complete {
                token: l.token(),
                result: b"r".to_vec(),
            },
        );
        assert!(
            matches!(answer, Err(Error::CorruptRecord { .. })),
            "{what}: {answer:?}"
        );
        assert!(
            matches!(pg.get(&k), Err(Error::CorruptRecord { .. })),
            "{what}: the damage was written over"
        );
    }
    // An unchecked scan (export, list) names what is wrong with each
    // damaged hot row, not that its form byte is an unknown version.
    let errors: Vec<String> = pg
        .entries(vec![(Vec::new(), None)])
        .unwrap()
        .filter_map(|item| item.err().map(|e| e.to_string()))
        .collect();
    assert_eq!(errors.len(), 5, "{errors:#?}");
    assert!(
        errors.iter().all(|e| !e.contains("unknown record version")),
        "{errors:#?}"
    );
}

#[test]
fn a_runtime_role_without_create_runs_a_migrated_store() {
    if skipped() {
        return;
    }
    let url = server().url();
    let name = schema("runtime");
    let current: tokio_postgres::Config = url.parse().unwrap();
    let db = current.get_dbname().unwrap_or("postgres").to_string();
    let role = format!("rt_{}_{}", std::process::id(), name.len());
    raw_sql(&format!("CREATE ROLE {role} LOGIN"));
    let as_role = url_as(url, &role, None, &db);
    let options = |schema: &str| PgOptions {
        schema: schema.to_string(),
        connections: 2,
        ..PgOptions::default()
    };
    // Before the migration the runtime role cannot create the store.
    match Postgres::connect(&as_role, options(&name)) {
        Err(Error::Misconfigured {
            fault: ConfigFault::SchemaNotMigrated,
            detail,
        }) => assert!(detail.contains("idemstore migrate"), "{detail}"),
        other => panic!("expected SchemaNotMigrated, got {other:?}"),
    }
    // The deploy's migration (what idemstore::postgres::migrate runs), by
    // a role that may create; idempotent.
    let migrate = || PgOptions {
        schema: name.clone(),
        connections: 1,
        migrate: true,
        ..PgOptions::default()
    };
    let done = Postgres::connect(url, migrate()).unwrap();
    assert_eq!(done.found(), super::Found::Created);
    drop(done);
    let again = Postgres::connect(url, migrate()).unwrap();
    assert_eq!(again.found(), super::Found::Current);
    drop(again);
    // Exactly the runtime grants: no CREATE anywhere, so a connect that
    // sent any DDL would fail.
    raw_sql(&format!("GRANT USAGE ON SCHEMA \"{name}\" TO {role}"));
    raw_sql(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{name}\" TO {role}"
    ));
    raw_sql(&format!(
        "GRANT USAGE ON SEQUENCE \"{name}\".tokens TO {role}"
    ));
    let pg = Postgres::connect(&as_role, options(&name)).unwrap();
    assert_eq!(pg.found(), super::Found::Current);
    let first = pg.next_token().unwrap();
    let lease = acquired(pg.apply(&key("rt-1"), claim_bk(b"a", "T-1")).unwrap());
    assert_eq!(lease.token(), first);
    let done = record(complete(&pg, &key("rt-1"), &lease, b"r"));
    assert_eq!(done.state, State::Succeeded);
    assert!(matches!(
        pg.apply(&key("rt-1"), claim_bk(b"a", "T-1")).unwrap(),
        Reply::Claim(ClaimOutcome::Replay(_))
    ));
    let other = acquired(pg.apply(&key("rt-2"), claim(b"b")).unwrap());
    assert!(other.token() > lease.token());
    let released = pg
        .apply(
            &key("rt-2"),
            Op::Release {
                token: other.token(),
            },
        )
        .unwrap();
    assert!(matches!(released, Reply::Released), "{released:?}");
    assert_eq!(
        pg.get(&key("rt-1")).unwrap().unwrap().state,
        State::Succeeded
    );
    assert_eq!(pg.len().unwrap(), 1);
    assert_eq!(pg.entries(vec![(Vec::new(), None)]).unwrap().count(), 1);
    assert_eq!(pg.sweep(10).unwrap(), 0);
    // A limit past a bigint is "at most" all of them, not an error.
    assert_eq!(pg.sweep(usize::MAX).unwrap(), 0);
    assert!(pg.next_token().unwrap() > other.token());
    // Without USAGE on the sequence, a claim that draws a token is refused
    // as the missing privilege, not as the aborted transaction's later
    // statements (25P02) nor as the server being unavailable.
    raw_sql(&format!(
        "REVOKE USAGE ON SEQUENCE \"{name}\".tokens FROM {role}"
    ));
    for id in ["rt-3", "rt-4"] {
        match pg.apply(&key(id), claim(b"c")) {
            Err(Error::Misconfigured {
                fault: ConfigFault::PermissionDenied,
                detail,
            }) => assert!(detail.contains("42501"), "{detail}"),
            other => panic!("expected PermissionDenied, got {other:?}"),
        }
    }
    raw_sql(&format!(
        "GRANT USAGE ON SEQUENCE \"{name}\".tokens TO {role}"
    ));
    acquired(pg.apply(&key("rt-3"), claim(b"c")).unwrap());
    drop(pg);
    // The same role's store in a schema of a newer version is refused as
    // too new, without DDL.
    raw_sql(&format!(
        "UPDATE \"{name}\".meta SET value = '\\x00000003'::bytea WHERE name = 'version'"
    ));
    assert_eq!(fault_of(&as_role, &name), ConfigFault::SchemaTooNew);
}

/// Row-level security enabled on the store's tables outside idemstore, with
/// a policy that hides finished records from the store's role, so that a
/// key or business key another record holds looks free (a second key took
/// a finished record's business key, and its work ran twice; a claim of
/// the hidden key answered `Unavailable`, which a retry never mends): a
/// store connected before it was enabled has every statement refused
/// (its sessions' `row_security = off`), `verify` too, and a connect
/// refuses the schema, saying how to turn it off. Turned off, the store
/// runs again and replays the hidden key. On `meta`, hiding the version
/// row, a connect or a migration says the same (the store was taken for
/// absent).
#[test]
fn row_level_security_active_for_the_store_is_a_damaged_schema() {
    if skipped() {
        return;
    }
    let url = server().url();
    let name = schema("rls");
    let current: tokio_postgres::Config = url.parse().unwrap();
    let db = current.get_dbname().unwrap_or("postgres").to_string();
    let role = format!("rls_{}_{}", std::process::id(), name.len());
    raw_sql(&format!("CREATE ROLE {role} LOGIN"));
    let as_role = url_as(url, &role, None, &db);
    let options = |migrate: bool| PgOptions {
        schema: name.clone(),
        connections: 2,
        migrate,
        ..PgOptions::default()
    };
    drop(Postgres::connect(url, options(true)).unwrap());
    raw_sql(&format!("GRANT USAGE ON SCHEMA \"{name}\" TO {role}"));
    raw_sql(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{name}\" TO {role}"
    ));
    raw_sql(&format!(
        "GRANT USAGE ON SEQUENCE \"{name}\".tokens TO {role}"
    ));
    // The URL's options cannot turn `row_security` back on.
    let pg = Postgres::connect(
        &format!("{as_role} options='-c row_security=on'"),
        options(false),
    )
    .unwrap();
    let lease = acquired(pg.apply(&key("order"), claim_bk(b"a", "order-1")).unwrap());
    complete(&pg, &key("order"), &lease, b"r");
    let records = format!("\"{name}\".records");
    raw_sql(&format!("ALTER TABLE {records} ENABLE ROW LEVEL SECURITY"));
    for (policy, command, rule) in [
        ("sel", "SELECT", "USING (state = 0)"),
        ("ins", "INSERT", "WITH CHECK (true)"),
        ("upd", "UPDATE", "USING (true) WITH CHECK (true)"),
        ("del", "DELETE", "USING (true)"),
    ] {
        raw_sql(&format!(
            "CREATE POLICY {policy} ON {records} FOR {command} TO {role} {rule}"
        ));
    }
    let remedy = [
        "records has row-level security active",
        "DISABLE ROW LEVEL SECURITY",
        "BYPASSRLS",
    ];
    // The running store's sessions have `row_security = off`, whatever
    // the URL says: every statement on the table is refused rather than
    // filtered. (A second key acquired the hidden record's business key.)
    let refused = [
        "row-level security",
        "DISABLE ROW LEVEL SECURITY",
        "BYPASSRLS",
    ];
    assert_schema_damaged(
        "a claim of the business key of a record the policy hides",
        pg.apply(&key("order-dup"), claim_bk(b"a", "order-1")),
        &refused,
    );
    assert_schema_damaged(
        "a claim of a key the policy hides",
        pg.apply(&key("order"), claim_bk(b"a", "order-1")),
        &refused,
    );
    assert_schema_damaged("a read of a hidden key", pg.get(&key("order")), &refused);
    assert_schema_damaged("a verify", pg.verify(|_| {}).map(drop), &refused);
    drop(pg);
    assert_schema_damaged(
        "a connect",
        Postgres::connect(&as_role, options(false)).map(drop),
        &remedy,
    );
    raw_sql(&format!("ALTER TABLE {records} DISABLE ROW LEVEL SECURITY"));
    let pg = Postgres::connect(&as_role, options(false)).unwrap();
    assert!(matches!(
        pg.apply(&key("order"), claim_bk(b"a", "order-1")).unwrap(),
        Reply::Claim(ClaimOutcome::Replay(_))
    ));
    drop(pg);
    // Row-level security on `meta` with no policy hides the version row:
    // the store is not taken for absent (was SchemaNotMigrated, and a
    // migration called the schema damaged and told to drop it).
    raw_sql(&format!(
        "ALTER TABLE \"{name}\".meta ENABLE ROW LEVEL SECURITY"
    ));
    for migrate in [false, true] {
        assert_schema_damaged(
            &format!("a connect with the version row hidden, migrate {migrate}"),
            Postgres::connect(&as_role, options(migrate)).map(drop),
            &[
                "meta has row-level security active",
                "DISABLE ROW LEVEL SECURITY",
            ],
        );
    }
}

/// Imports that raise the sequence while hot claims draw from it (one
/// statement each, no advisory lock): every token is handed out once, each
/// thread's tokens grow, and a claim made after an import returned has a
/// token at or above its floor. (An import's raise takes the records
/// table's EXCLUSIVE lock, which a hot claim's INSERT waits for.)
#[test]
fn imports_and_hot_claims_never_share_a_token() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("import_race");
    let pg = Arc::new(pg);
    let stop = Arc::new(AtomicBool::new(false));
    let floor = Arc::new(AtomicU64::new(0));
    let claimers: Vec<_> = (0..4)
        .map(|t| {
            let (pg, stop, floor) = (pg.clone(), stop.clone(), floor.clone());
            std::thread::spawn(move || {
                let mut tokens = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) || i < 20 {
                    let at_least = floor.load(Ordering::SeqCst);
                    let l = acquired(pg.apply(&key(&format!("t{t}-{i}")), claim(b"a")).unwrap());
                    assert!(l.token() >= at_least, "{} below {at_least}", l.token());
                    if let Some(&last) = tokens.last() {
                        assert!(l.token() > last, "{} after {last}", l.token());
                    }
                    tokens.push(l.token());
                    i += 1;
                }
                tokens
            })
        })
        .collect();
    for _ in 0..40 {
        // Just above the position: the raise races the draws.
        let f = pg.next_token().unwrap() + 2;
        pg.import(Vec::new(), f).unwrap();
        floor.fetch_max(f, Ordering::SeqCst);
    }
    stop.store(true, Ordering::SeqCst);
    let mut all: Vec<u64> = claimers
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a token was handed out twice");
    assert!(pg.next_token().unwrap() > *all.last().unwrap());
}

/// Through a pooler in session mode (settings as `SET` statements, since
/// PgBouncer refuses startup `options`) the engine's sessions carry every
/// setting a direct connection gets as startup options, the planner's
/// included (`session_settings`): on a records table of one page, which a
/// planner left to itself reads in full, the engine's claims, completions
/// and reads find their rows by index only. The server (15 and later)
/// adds each session's scans to `pg_stat_user_tables` before the session
/// leaves `pg_stat_activity` (and, while it is idle, about once a second);
/// the schema is made by a first engine, whose index builds count as
/// scans. Skipped on an older server, whose counts arrive later.
#[test]
fn a_session_pooler_connection_scans_the_records_by_index_only() {
    if skipped() {
        return;
    }
    let version: i32 = raw_sql("SELECT current_setting('server_version_num')::int")[0].get(0);
    if version < 150_000 {
        eprintln!("skipped: PostgreSQL {version} reports a session's scans late");
        return;
    }
    let name = schema("session_set");
    let url = format!("{}?application_name={name}", server().url());
    let options = |pooler| PgOptions {
        schema: name.clone(),
        clock: None,
        retention_ms: RETENTION,
        connections: 2,
        must_exist: false,
        migrate: false,
        limits: crate::config::PostgresLimits::default(),
        pooler,
    };
    // A hang guard, not a timing assertion: sessions end as their engine
    // is dropped, and report their counts as they do.
    let guard = std::time::Instant::now() + Duration::from_secs(60);
    let ended = || {
        let sessions =
            format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}'");
        while raw_sql(&sessions)[0].get::<_, i64>(0) > 0 {
            assert!(
                std::time::Instant::now() < guard,
                "the sessions did not end"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let scans = |least_by_index: i64| loop {
        let sql = format!(
            "SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0) FROM pg_stat_user_tables \
             WHERE schemaname = '{name}' AND relname = 'records'"
        );
        let row = &raw_sql(&sql)[0];
        let counts: (i64, i64) = (row.get(0), row.get(1));
        if counts.1 >= least_by_index {
            return counts;
        }
        assert!(std::time::Instant::now() < guard, "no scans reported");
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(Postgres::connect(&url, options(crate::config::PostgresPooler::Direct)).unwrap());
    ended();
    let (seq_before, idx_before) = scans(0);
    let pg = Postgres::connect(&url, options(crate::config::PostgresPooler::Session)).unwrap();
    for i in 0..20 {
        if i == 5 {
            // Statistics of a table of one page, on which a sequential
            // scan is the cheapest plan (plans cached before are made
            // again).
            raw_sql(&format!("ANALYZE \"{name}\".records"));
        }
        let k = key(&format!("k{i}"));
        let lease = acquired(pg.apply(&k, claim(b"a")).unwrap());
        record(complete(&pg, &k, &lease, b"done"));
        assert!(pg.get(&k).unwrap().is_some());
    }
    drop(pg);
    ended();
    let (seq, idx) = scans(idx_before + 1);
    assert_eq!(
        seq - seq_before,
        0,
        "sequential scans of the records table ({} by index)",
        idx - idx_before
    );
}

/// `verify` (`Store::verify`, `idemstore check`) reports a row whose query
/// columns disagree with its envelope, as a request on that key would
/// (`decide::slot_of`), besides one whose envelope does not decode: each
/// damaged row is named, the scan goes on past it, the sound rows are not
/// reported; for rows in the hot form (a lone claim and its completion,
/// one statement each) and in the ordinary form (a claim with a business
/// key goes the general way; left in flight, as its completion would
/// write the hot form). Eviction, `stats` and the compare-and-set read
/// those columns, so such a row is evicted early or never, or counted
/// wrong.
#[test]
fn verify_reports_rows_whose_columns_disagree_with_their_envelope() {
    if skipped() {
        return;
    }
    let (pg, _clock) = open("verify_columns");
    let damage = [
        ("expiry", "expires_ms = expires_ms + 1"),
        ("token", "token = token + 100"),
        ("state", "state = 2"),
        ("lease", "lease_until_ms = lease_until_ms - 1"),
        ("envelope", "record = '\\x00'::bytea"),
    ];
    let id = |form: &str, what: &str| format!("{form}-{what}");
    for form in ["hot", "general"] {
        for what in ["sound"].into_iter().chain(damage.iter().map(|(w, _)| *w)) {
            let k = key(&id(form, what));
            let op = if form == "hot" {
                claim(b"a")
            } else {
                claim_bk(b"a", &id(form, what))
            };
            let l = acquired(pg.apply(&k, op).unwrap());
            if form == "hot" && what != "lease" {
                complete(&pg, &k, &l, b"r");
            }
        }
    }
    let report = pg.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let table = format!("\"{}\".records", pg.shared.sql.schema);
    let hex = |k: &Key| hex(&k.to_bytes());
    // Each row is in the form its name says.
    for form in ["hot", "general"] {
        for what in ["sound"].into_iter().chain(damage.iter().map(|(w, _)| *w)) {
            let first: i32 = raw_sql(&format!(
                "SELECT get_byte(record, 0) FROM {table} WHERE key = '\\x{}'::bytea",
                hex(&key(&id(form, what)))
            ))[0]
                .get(0);
            assert_eq!(first == 0xA1, form == "hot", "{form}-{what}: {first:#x}");
        }
    }
    let mut damaged = Vec::new();
    for form in ["hot", "general"] {
        for (what, set) in damage {
            let k = key(&id(form, what));
            raw_sql(&format!(
                "UPDATE {table} SET {set} WHERE key = '\\x{}'::bytea",
                hex(&k)
            ));
            damaged.push(k.to_string());
        }
    }
    let report = pg.verify(|_| {}).unwrap();
    assert_eq!(report.records, 12);
    let mut named: Vec<String> = report.problems.iter().map(|p| p.key.clone()).collect();
    named.sort();
    damaged.sort();
    assert_eq!(named, damaged, "{:?}", report.problems);
    // Each names its key with scope and id apart too.
    for p in &report.problems {
        let k = p.idempotency_key.as_ref().expect(&p.key);
        assert_eq!(k.to_string(), p.key);
    }
    // Each says what is wrong with it: a row in the hot form carries a
    // digest of its token and expiry columns.
    for p in &report.problems {
        let said: &[&str] = if p.key.ends_with("-envelope") {
            &["envelope is 1 bytes"]
        } else {
            &[
                "disagree with its record",
                "digest of the token and expiry columns does not match",
            ]
        };
        assert!(said.iter().any(|s| p.detail.contains(s)), "{p:?}");
    }
}

/// `verify` checks the business-key bindings against the records, in the
/// snapshot it reads the rows from, as the file engine's check does: a
/// live record whose business key has no binding, or whose binding names
/// another key, is reported by its key; a binding that names a key with
/// no record, a record that does not carry it, or that does not parse, is
/// reported by its business key; a record past retention needs no
/// binding. Each binding is counted. A binding lost or moved makes a
/// second holder of the business key possible, or frees it while it is
/// held.
#[test]
fn verify_reports_bindings_that_disagree_with_the_records() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("verify_bindings");
    // Past retention before the others are made: its binding may go.
    let gone = key("gone");
    let l = acquired(pg.apply(&gone, claim_bk(b"a", "bk-gone")).unwrap());
    complete(&pg, &gone, &l, b"r");
    clock.advance(Duration::from_millis(RETENTION + 1));
    // More rows and bindings than two pages hold (`PAGE_ROWS`), before
    // the damaged ones in key and binding order (the unparsable binding
    // sorts first): both checks span pages, and the bindings' has one
    // with no problem between two with problems.
    let bulk: Vec<String> = (0..1100).map(|i| format!("bulk-{i:04}")).collect();
    for id in bulk
        .iter()
        .map(String::as_str)
        .chain(["held", "done", "unbound", "moved", "other"])
    {
        let k = key(id);
        let l = acquired(pg.apply(&k, claim_bk(b"a", &format!("bk-{id}"))).unwrap());
        if id == "done" {
            // A completion writes the hot form.
            complete(&pg, &k, &l, b"r");
        }
    }
    let report = pg.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.records, report.bindings), (1106, 1106));

    let s = &pg.shared.sql.schema;
    let binding = |id: &str| hex(&key(id).business_binding(&format!("bk-{id}")));
    let sql = |q: String| {
        raw_sql(&q);
    };
    sql(format!(
        "DELETE FROM \"{s}\".bindings WHERE binding IN ('\\x{}'::bytea, '\\x{}'::bytea)",
        binding("gone"),
        binding("unbound")
    ));
    sql(format!(
        "UPDATE \"{s}\".bindings SET key = '\\x{}'::bytea WHERE binding = '\\x{}'::bytea",
        hex(&key("other").to_bytes()),
        binding("moved")
    ));
    sql(format!(
        "INSERT INTO \"{s}\".bindings VALUES ('\\x{}'::bytea, '\\x{}'::bytea), \
         ('\\x00ff'::bytea, '\\x{}'::bytea)",
        binding("orphan"),
        hex(&key("orphan").to_bytes()),
        hex(&key("held").to_bytes())
    ));
    let report = pg.verify(|_| {}).unwrap();
    assert_eq!(
        (report.records, report.bindings),
        (1106, 1106),
        "{report:?}"
    );
    let found = report
        .problems
        .iter()
        .map(|p| (p.key.clone(), p.detail.clone()))
        .collect();
    crate::report::binding_damage::assert_reported(found, key("x").scope(), |id| {
        key(id).to_string()
    });
}

/// `verify` reads the bindings in the snapshot it reads the rows from,
/// while the store keeps serving: a record evicted after the check began,
/// its business key then claimed by another key, is checked as the
/// snapshot holds it: live and bound (no problem); the next check finds
/// the new holder and its binding. Read outside the snapshot, the record
/// would read as bound to another key; were only the bindings pages read
/// outside it, a binding would name a key the snapshot has no row for.
#[test]
fn verify_reads_the_bindings_in_the_snapshot_of_its_rows() {
    if skipped() {
        return;
    }
    let (pg, clock) = open("verify_snapshot");
    // The record that moves is made first, so that it is due first; its
    // key sorts last, so it is read in the third page (`PAGE_ROWS`), after
    // the check has begun: the scan reads a page only when the iterator
    // asks for it (a read-ahead past the second page would make this test
    // pass whatever the snapshot).
    let mover = key("bulk-1099");
    let l = acquired(pg.apply(&mover, claim_bk(b"a", "bk-bulk-1099")).unwrap());
    complete(&pg, &mover, &l, b"r");
    clock.advance(Duration::from_millis(RETENTION / 2));
    for id in (0..1099).map(|i| format!("bulk-{i:04}")) {
        let k = key(&id);
        let l = acquired(pg.apply(&k, claim_bk(b"a", &format!("bk-{id}"))).unwrap());
        complete(&pg, &k, &l, b"r");
    }

    // Live at the check's time, so it needs its binding: a record past
    // retention is not checked against one.
    let held = pg.get(&mover).unwrap().expect("the mover is stored");
    assert!(held.expires_ms > T0 + RETENTION / 2, "{held:?}");
    let mut moved = false;
    let during = pg
        .verify(|progress| {
            if progress.records == 1 {
                // The first page is read; the mover's is not.
                clock.advance(Duration::from_millis(RETENTION / 2 + 1));
                assert_eq!(pg.sweep(100).unwrap(), 1, "only the mover is due");
                let newer = pg.apply(&key("newer"), claim_bk(b"b", "bk-bulk-1099"));
                acquired(newer.unwrap());
                moved = true;
            }
        })
        .unwrap();
    assert!(moved);
    assert!(during.is_clean(), "{during:?}");
    assert_eq!((during.records, during.bindings), (1100, 1100));

    let after = pg.verify(|_| {}).unwrap();
    assert!(after.is_clean(), "{after:?}");
    assert_eq!((after.records, after.bindings), (1100, 1100));
    assert!(pg.get(&mover).unwrap().is_none());
    assert!(pg.get(&key("newer")).unwrap().is_some());
}

/// The settings a URL's `options` gives are read as the server reads them
/// (`-c name=value`, `-cname=value`, `--name=value`, `-` as `_`, any case,
/// `\` escaping a space), so that behind a session-mode pooler they are
/// set again after the limits; and each is sent as a literal that reads
/// the same whatever `standard_conforming_strings` is.
#[test]
fn the_settings_a_urls_options_gives_are_read_as_the_server_reads_them() {
    let settings = super::option_settings(concat!(
        "-c lock_timeout=100 -cStatement_Timeout=5s ",
        "--idle-in-transaction-session-timeout=1 ",
        r"-c search_path=a\ b -c -x plain -c",
    ));
    let settings: Vec<(&str, &str)> = settings
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        settings,
        [
            ("lock_timeout", "100"),
            ("statement_timeout", "5s"),
            ("idle_in_transaction_session_timeout", "1"),
            ("search_path", "a b"),
        ]
    );
    assert!(super::option_settings("").is_empty());
    // One word, "-c lock_timeout=1": the server reads the name
    // " lock_timeout", which sets nothing.
    assert!(
        !super::option_settings(r"-c\ lock_timeout=1")
            .iter()
            .any(|(n, _)| n == "lock_timeout")
    );
    assert_eq!(super::sql_literal(r"it's a\b"), r"E'it''s a\\b'");
}

/// Opening a connection is bounded by `connect_timeout` for each address
/// `tokio-postgres` may try: one per IP literal, `hostaddr` and Unix
/// socket (a name counts the addresses it resolves to).
#[test]
fn a_connection_may_take_connect_timeout_for_each_address() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let per = Duration::from_secs(1);
    for (conn, attempts) in [
        ("postgresql://u@127.0.0.1/db", 1),
        ("postgresql://u@127.0.0.1:5432,127.0.0.2:5433/db", 2),
        ("host=/tmp,127.0.0.1,10.0.0.1 port=5432 user=u", 3),
        ("host=a,b hostaddr=127.0.0.1,127.0.0.2 user=u", 2),
    ] {
        let config: tokio_postgres::Config = conn.parse().unwrap();
        assert_eq!(
            rt.block_on(super::connect_attempts(&config, per)),
            attempts,
            "{conn}"
        );
    }
}

/// After the clock steps back, a replica that read the clock before the
/// step decides by the clock as it is (floored by the record's own last
/// write), as a replica started after the step does: it sees the other's
/// fresh lease as live, and its sweep evicts nothing the other holds.
/// Before, each process floored the time by its own highest reading, so
/// the first replica took over the second's live lease (the work ran
/// twice) and swept its live records.
#[test]
fn after_the_clock_steps_back_replicas_still_agree_on_a_lease() {
    if skipped() {
        return;
    }
    // One clock for both, as the database's is: ten minutes ahead first.
    let clock = ManualClock::new(T0 + 600_000);
    let sc = schema("step_back");
    let early = open_with(&sc, Some(&clock));
    let _ = acquired(early.apply(&key("before"), claim(b"b")).unwrap());
    clock.set_ms(T0);
    let late = open_with(&sc, Some(&clock));
    let job = key("job");
    let lease = acquired(late.apply(&job, claim(b"j")).unwrap());
    let done = key("done");
    let finished = acquired(late.apply(&done, claim(b"d")).unwrap());
    complete(&late, &done, &finished, b"answer");
    for (name, pg) in [("early", &early), ("late", &late)] {
        match pg.apply(&job, claim(b"j")) {
            Ok(Reply::Claim(ClaimOutcome::InProgress { .. })) => {}
            other => panic!("{name}: the live lease was not seen as live: {other:?}"),
        }
        assert_eq!(pg.now_ms().unwrap(), T0, "{name}");
    }
    assert_eq!(early.sweep(100).unwrap(), 0);
    assert_eq!(
        record(complete(&late, &job, &lease, b"r")).state,
        State::Succeeded
    );
    assert_eq!(late.get(&done).unwrap().unwrap().state, State::Succeeded);
}

/// A row whose times lie far ahead (written by hand, or while the server's
/// clock ran ahead) moves the time of its own record's requests only:
/// completing it does not move the store's time, so the process's later
/// sweeps and claims are decided by the clock. Before, the completion's
/// time (floored by the row's) became the process's floor: `now_ms`
/// jumped a century, the next sweep evicted finished and in-flight
/// records, and new leases ran for a century.
#[test]
fn a_row_from_the_future_moves_only_its_own_time() {
    if skipped() {
        return;
    }
    let clock = ManualClock::new(T0);
    let sc = schema("future_row");
    let pg = open_with(&sc, Some(&clock));
    let done = key("done");
    let finished = acquired(pg.apply(&done, claim(b"d")).unwrap());
    complete(&pg, &done, &finished, b"answer");
    let live = key("live");
    let _held = acquired(pg.apply(&live, claim(b"l")).unwrap());
    let k = key("k");
    let lease = acquired(pg.apply(&k, claim(b"k")).unwrap());
    let failure = Op::Fail {
        token: lease.token(),
        failure: b"try again".to_vec(),
        retryable: true,
    };
    pg.apply(&k, failure).unwrap();
    // The failed row (in the hot form: its times are N plus offsets, N
    // read from `expires_ms`) moved a century ahead, its digest redone.
    let century: i64 = 100 * 365 * 24 * 3_600_000;
    let hex = hex(&k.to_bytes());
    let moved = raw_sql(&format!(
        "UPDATE \"{sc}\".records SET expires_ms = expires_ms + {century}, \
         record = substring(record FROM 1 FOR 2) || substring(sha256(key || int8send(token) || \
         int8send(expires_ms + {century})) FROM 1 FOR 8) || substring(record FROM 11) \
         WHERE key = '\\x{hex}'::bytea AND get_byte(record, 0) = 161 RETURNING key"
    ));
    assert_eq!(moved.len(), 1, "the row is in the hot form");
    let again = acquired(pg.apply(&k, claim(b"k")).unwrap());
    assert!(
        again.lease_until_ms() > Some(T0 + 1_000),
        "its own time moved"
    );
    assert_eq!(
        record(complete(&pg, &k, &again, b"r")).state,
        State::Succeeded
    );
    clock.advance(Duration::from_millis(500));
    assert_eq!(pg.now_ms().unwrap(), T0 + 500);
    assert_eq!(pg.sweep(100).unwrap(), 0, "nothing is due");
    assert_eq!(pg.get(&done).unwrap().unwrap().state, State::Succeeded);
    assert_eq!(pg.get(&live).unwrap().unwrap().state, State::Processing);
    let fresh = acquired(pg.apply(&key("fresh"), claim(b"f")).unwrap());
    assert_eq!(fresh.lease_until_ms(), Some(T0 + 500 + 1_000));
}

/// A connection of its own to `url`, and the runtime that drives it.
fn client_at(url: &str) -> (tokio::runtime::Runtime, tokio_postgres::Client) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (client, conn) = rt
        .block_on(tokio_postgres::connect(url, tokio_postgres::NoTls))
        .unwrap();
    rt.spawn(conn);
    (rt, client)
}

/// Runs `sql` on its own connection to `url`.
fn sql_at(url: &str, sql: &str) -> Vec<tokio_postgres::Row> {
    let (rt, client) = client_at(url);
    rt.block_on(async {
        client.simple_query("SELECT 1").await.unwrap();
        client.query(sql, &[]).await.unwrap()
    })
}

/// Runs each of `statements` on its own connection to `url`, one at a
/// time (`ALTER SYSTEM` refuses the implicit transaction of several).
fn batch_at(url: &str, statements: &[&str]) {
    let (rt, client) = client_at(url);
    rt.block_on(async {
        for sql in statements {
            client.batch_execute(sql).await.unwrap();
        }
    })
}

/// With several hosts and `target_session_attrs=read-write`, a host that
/// turns read-only under a running store (a primary demoted, or set
/// read-only) is left for one that takes writes: a refused write drops
/// its connection (a hot claim then goes on the general way on a new
/// one), so each connection opened before the change answers at most one
/// request `Unavailable`, and then every claim lands on the other host.
/// Before, the store kept its connections and answered every write
/// `Unavailable` (SQLSTATE 25006), though a retry as is could never
/// succeed. (The two servers here do not replicate, so only claims of
/// fresh keys are sent.)
#[test]
fn a_host_that_turns_read_only_is_left_for_one_that_takes_writes() {
    if skipped() {
        return;
    }
    let own = || TestServer::start_own(super::server::ServerOptions::default()).unwrap();
    let (first, second) = (own(), own());
    let sc = schema("read_only");
    for server in [&first, &second] {
        drop(open_at(server.url(), &sc, None));
    }
    let port = |s: &TestServer| {
        let after_host = s.url().rsplit(':').next().unwrap();
        after_host.split('/').next().unwrap().to_string()
    };
    let both = format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres dbname=postgres \
         target_session_attrs=read-write",
        port(&first),
        port(&second)
    );
    let pg = open_at(&both, &sc, None);
    // Warm: the sync caller's own connection and a worker's, both on the
    // first host.
    let _ = acquired(pg.apply(&key("before"), claim(b"b")).unwrap());
    let _ = acquired(
        futures_lite::future::block_on(pg.apply_async(&key("before-async"), claim(b"b"))).unwrap(),
    );
    batch_at(
        first.url(),
        &[
            "ALTER SYSTEM SET default_transaction_read_only = on",
            "SELECT pg_reload_conf()",
        ],
    );
    // `pg_reload_conf` only signals the server: wait until a new session
    // reads the setting (the server then has signalled every session).
    let mut waited = 0;
    while sql_at(first.url(), "SHOW default_transaction_read_only")[0].get::<_, String>(0) != "on" {
        waited += 1;
        assert!(waited < 600, "the reload never took effect");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Each connection opened before the change answers one request
    // `Unavailable` at most (and is dropped); then every claim lands.
    let answers: Vec<bool> = (0..12)
        .map(|i| {
            let k = key(&format!("after-{i}"));
            let sync = pg.apply(&k, claim(b"a"));
            let k = key(&format!("after-async-{i}"));
            let queued = futures_lite::future::block_on(pg.apply_async(&k, claim(b"a")));
            match (sync, queued) {
                (
                    Ok(Reply::Claim(ClaimOutcome::Acquired(_))),
                    Ok(Reply::Claim(ClaimOutcome::Acquired(_))),
                ) => true,
                (
                    Ok(_) | Err(Error::Unavailable { .. }),
                    Ok(_) | Err(Error::Unavailable { .. }),
                ) => false,
                other => panic!("{other:?}"),
            }
        })
        .collect();
    assert!(answers[8..].iter().all(|&ok| ok), "{answers:?}");
    let on_second = sql_at(
        second.url(),
        &format!("SELECT count(*) FROM \"{sc}\".records"),
    );
    let count: i64 = on_second[0].get(0);
    assert!(count > 0, "no claim reached the host that takes writes");
    batch_at(
        first.url(),
        &[
            "ALTER SYSTEM RESET default_transaction_read_only",
            "SELECT pg_reload_conf()",
        ],
    );
}

/// A schema dropped and created again under a store still running (an
/// operator starting an empty store, a server that came back empty) hands
/// out tokens above the ones of its earlier life: the old holder's
/// completion is refused as stale, and the new holder's lands. Before,
/// both lives started their tokens at 1, so the old lease matched the new
/// holder's and completed its claim with the old work's result.
#[test]
fn a_schema_created_again_never_hands_out_an_earlier_token() {
    if skipped() {
        return;
    }
    let sc = schema("recreated");
    let old = open_with(&sc, None);
    let k = key("k");
    let stale = acquired(old.apply(&k, claim(b"k")).unwrap());
    raw_sql(&format!("DROP SCHEMA \"{sc}\" CASCADE"));
    // The new life's first millisecond is after the old one's.
    std::thread::sleep(Duration::from_millis(2));
    let new = open_with(&sc, None);
    let lease = acquired(new.apply(&k, claim(b"k")).unwrap());
    assert!(lease.token() > stale.token());
    let err = old
        .apply(
            &k,
            Op::Complete {
                token: stale.token(),
                result: b"old".to_vec(),
            },
        )
        .unwrap_err();
    assert!(matches!(err, Error::StaleLease { .. }), "{err}");
    assert_eq!(
        record(complete(&new, &k, &lease, b"new")).result(),
        Some(&b"new"[..])
    );
}

/// A column altered outside idemstore (here `records.token` to `numeric`)
/// is a damaged schema, not a storage error that a retry might mend: a
/// running store's requests that read it answer
/// `Misconfigured(SchemaDamaged)`, and a connect refuses the schema,
/// naming the column (in a message without runs of spaces). Before, those
/// requests answered `Storage("error deserializing column …")` and a
/// connect succeeded.
#[test]
fn a_column_altered_outside_idemstore_is_a_damaged_schema() {
    if skipped() {
        return;
    }
    let sc = schema("altered");
    let pg = open_with(&sc, None);
    let k = key("k");
    let lease = acquired(pg.apply(&k, claim(b"k")).unwrap());
    // Connected before the change, its first request after it.
    let idle = open_with(&sc, None);
    raw_sql(&format!(
        "ALTER TABLE \"{sc}\".records ALTER COLUMN token TYPE numeric"
    ));
    // A hot claim commits on its own before its answer is read: it may
    // have been applied (here it was), so its outcome is unknown.
    let fresh = key("fresh");
    let err = idle.apply(&fresh, claim(b"f")).unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert!(err.to_string().contains("schema-damaged"), "{err}");
    let hex = hex(&fresh.to_bytes());
    let rows = raw_sql(&format!(
        "SELECT count(*) FROM \"{sc}\".records WHERE key = '\\x{hex}'::bytea"
    ));
    assert_eq!(rows[0].get::<_, i64>(0), 1);
    let damaged = |e: Error| {
        assert!(
            matches!(
                e,
                Error::Misconfigured {
                    fault: ConfigFault::SchemaDamaged,
                    ..
                }
            ),
            "{e}"
        );
    };
    damaged(pg.get(&k).unwrap_err());
    // The holder's completion reads no altered column, and lands.
    assert_eq!(
        record(complete(&pg, &k, &lease, b"r")).state,
        State::Succeeded
    );
    let refused = Postgres::connect(server().url(), options(&sc, None)).unwrap_err();
    assert!(
        refused.to_string().contains("records.token is numeric"),
        "{refused}"
    );
    // One sentence, without the indentation of its source lines.
    assert!(!refused.to_string().contains("  "), "{refused}");
    damaged(refused);
}
