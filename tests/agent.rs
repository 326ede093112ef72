//! Agent tool calls: keys, canonical fingerprints, run-once execution and the
//! call driver (feature `agent`).

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use idemstore::agent::{
    CallError, ExecuteError, ExecuteOptions, Executed, Failure, Limit, Origin, RemoteError,
    RemoteStatus, RetryPolicy, call, call_async,
};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, Key, Lease, ManualClock};
use idemstore::{Resolution, State, Store};
use serde_json::{Value, json};

const LEASE: Duration = Duration::from_secs(10);

fn manual_store(path: &Path, clock: &ManualClock) -> Store {
    let config = Config::new()
        .clock(clock.clone())
        .lease(LEASE)
        .sweep_interval(None);
    Store::open_with(path, config).unwrap()
}

fn fixture() -> (tempfile::TempDir, PathBuf, ManualClock, Store) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.redb");
    let clock = ManualClock::starting_now();
    let store = manual_store(&path, &clock);
    (dir, path, clock, store)
}

fn fp(v: &Value) -> Fingerprint {
    Fingerprint::of_json(v).unwrap()
}

/// Work that counts its runs and returns `value`.
fn counted(
    runs: &AtomicU32,
    value: &str,
) -> impl FnOnce(&Lease) -> Result<String, Failure<String>> {
    let value = value.to_string();
    move |_lease| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok(value)
    }
}

// ---------------------------------------------------------------- keys ----

#[test]
fn scenario_07_canonical_fingerprints() {
    let a: Value = serde_json::from_str(r#"{"a":1,"b":{"x":1,"y":2}}"#).unwrap();
    let b: Value = serde_json::from_str(r#"{"b":{"y":2,"x":1},"a":1}"#).unwrap();
    assert_eq!(fp(&a), fp(&b));
    assert_ne!(fp(&json!([1, 2])), fp(&json!([2, 1])));
    assert_ne!(fp(&json!(1)), fp(&json!("1")));
}

#[test]
fn tool_call_keys_are_unambiguous() {
    // ("a:b", "c") is refused; ("a", "b:c") is a key of its own.
    assert!(matches!(
        Key::for_tool_call("s", "a:b", "c"),
        Err(Error::InvalidKey { .. })
    ));
    let k = Key::for_tool_call("s", "a", "b:c").unwrap();
    assert_eq!(k.id(), "a:b:c");
    assert_eq!(
        Key::for_tool_call("acme/tickets.create", "task-42", "call_7")
            .unwrap()
            .id(),
        "task-42:call_7"
    );
    // Validated like any key.
    for (task, call) in [("", "c"), ("t", ""), ("t\n", "c"), ("t", "c\u{7}")] {
        assert!(
            matches!(
                Key::for_tool_call("s", task, call),
                Err(Error::InvalidKey { .. })
            ),
            "{task:?} {call:?}"
        );
    }
    assert!(Key::for_tool_call("s", "t", &"c".repeat(253)).is_ok());
    assert!(Key::for_tool_call("s", "t", &"c".repeat(254)).is_err());
    assert!(Key::for_tool_call("", "t", "c").is_err());
}

#[test]
fn intent_keys_collapse_equal_calls_only() {
    let params = json!({"order": "A-17", "amount_cents": 4200, "items": [1, 2]});
    let reordered: Value =
        serde_json::from_str(r#"{"items":[1,2],"amount_cents":4200,"order":"A-17"}"#).unwrap();
    let k = Key::for_intent("acme/payments", "task-1", "charge", &params).unwrap();
    assert_eq!(
        k,
        Key::for_intent("acme/payments", "task-1", "charge", &reordered).unwrap()
    );
    // The digest is the hex of the canonical JSON fingerprint.
    let hex: String = fp(&params)
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(k.id(), format!("task-1:charge:{hex}"));

    let other = |task: &str, tool: &str, p: &Value| Key::for_intent("acme/payments", task, tool, p);
    assert_ne!(k, other("task-2", "charge", &params).unwrap());
    assert_ne!(k, other("task-1", "refund", &params).unwrap());
    assert_ne!(
        k,
        other(
            "task-1",
            "charge",
            &json!({"order": "A-17", "amount_cents": 4200, "items": [2, 1]})
        )
        .unwrap()
    );
    assert_ne!(
        k,
        other(
            "task-1",
            "charge",
            &json!({"order": "A-17", "amount_cents": "4200", "items": [1, 2]})
        )
        .unwrap()
    );
    // Unambiguous: the task id may not hold the separator, the tool may.
    assert!(other("a:b", "c", &params).is_err());
    assert_ne!(
        other("a", "b:c", &params).unwrap(),
        other("a", "b", &params).unwrap()
    );
    assert!(matches!(
        other("t", "", &params),
        Err(Error::InvalidKey { .. })
    ));
    // 64 hex digits and two separators leave 189 bytes for task and tool.
    assert!(other("t", &"x".repeat(188), &params).is_ok());
    assert!(other("t", &"x".repeat(189), &params).is_err());
    // Integers RFC 8785 cannot hold exactly are refused, not merged.
    assert!(matches!(
        other("t", "charge", &json!({"id": 9_007_199_254_740_993_u64})),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn model_turn_keys() {
    let k = Key::for_model_turn("acme/agent.turns", "task-42", 3).unwrap();
    assert_eq!(k.id(), "task-42:turn-3");
    assert_ne!(
        k,
        Key::for_model_turn("acme/agent.turns", "task-42", 4).unwrap()
    );
    assert!(Key::for_model_turn("acme/agent.turns", "a:b", 0).is_err());
}

// ------------------------------------------------------------- execute ----

#[test]
fn execute_runs_once_and_replays_across_a_reopen() {
    let (_dir, path, clock, store) = fixture();
    let key = Key::for_tool_call("acme/tickets.create", "task-1", "call_1").unwrap();
    let params = json!({"title": "printer on fire"});
    let runs = AtomicU32::new(0);

    let first = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "T-1"),
        )
        .unwrap();
    assert_eq!(first.value(), "T-1");
    assert_eq!(first.origin(), Origin::Ran);
    assert!(!first.is_replayed());

    let again = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "T-2"),
        )
        .unwrap();
    assert_eq!(again.value(), "T-1");
    assert!(again.is_replayed());

    drop(store);
    let store = manual_store(&path, &clock);
    let reopened = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "T-3"),
        )
        .unwrap();
    assert_eq!(reopened.value(), "T-1");
    assert_eq!(reopened.origin(), Origin::Replayed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Another payload under the same key is refused, not replayed.
    let err = store
        .execute(
            &key,
            &fp(&json!({"title": "other"})),
            ExecuteOptions::new(),
            counted(&runs, "T-4"),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        ExecuteError::Store(Error::FingerprintMismatch { .. })
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn execute_records_failures() {
    let (_dir, _path, _clock, store) = fixture();
    let params = json!({"amount_cents": 100});

    // A permanent failure is recorded and replayed; the work runs once.
    let key = Key::new("acme/payments", "declined").unwrap();
    let runs = AtomicU32::new(0);
    for attempt in 0..3 {
        let err = store
            .execute(&key, &fp(&params), ExecuteOptions::new(), |_lease| {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<String, _>(Failure::permanent("card declined".to_string()))
            })
            .unwrap_err();
        match err {
            ExecuteError::Failed {
                error,
                retryable,
                replayed,
                ..
            } => {
                assert_eq!(error, "card declined");
                assert!(!retryable);
                assert_eq!(replayed, attempt > 0);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A retryable failure lets the next call run the work again, and that
    // is not a takeover in doubt: the default policy (refuse) lets it run.
    let key = Key::new("acme/payments", "flaky").unwrap();
    let err = store
        .execute(&key, &fp(&params), ExecuteOptions::new(), |_lease| {
            Err::<String, _>(Failure::retryable("gateway 503".to_string()))
        })
        .unwrap_err();
    assert!(matches!(
        err,
        ExecuteError::Failed {
            retryable: true,
            replayed: false,
            ..
        }
    ));
    let ok = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "ch_1"),
        )
        .unwrap();
    assert_eq!(ok.origin(), Origin::Ran);
    assert_eq!(store.get(&key).unwrap().unwrap().acquisitions(), 2);
}

#[test]
fn still_in_progress_after_the_wait() {
    let (_dir, _path, _clock, store) = fixture();
    let key = Key::new("acme/tickets", "busy").unwrap();
    let params = json!({"title": "t"});
    // Another holder (not an `execute`, so it never wakes anyone).
    let ClaimOutcome::Acquired(held) = store
        .claim(&key, &fp(&params), &ClaimOptions::new())
        .unwrap()
    else {
        panic!("fresh key");
    };
    let runs = AtomicU32::new(0);
    for wait in [Duration::ZERO, Duration::from_millis(50)] {
        let err = store
            .execute(
                &key,
                &fp(&params),
                ExecuteOptions::new()
                    .wait(wait)
                    .poll_delays(Duration::from_millis(1), Duration::from_millis(8)),
                counted(&runs, "T-1"),
            )
            .unwrap_err();
        match err {
            ExecuteError::StillInProgress {
                key: k,
                lease_until_ms,
            } => {
                assert_eq!(k, key);
                assert_eq!(Some(lease_until_ms), held.lease_until_ms());
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // Once the holder finishes, a waiter that polls sees its result.
    store.complete(&held, br#""T-0""#).unwrap();
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "T-1"),
        )
        .unwrap();
    assert_eq!(out.value(), "T-0");
    assert!(out.is_replayed());
}

/// Waiters never poll here (the first poll would come after an hour, past
/// the 20 s wait), so only a direct wake-up from the holder ends their wait
/// before the wait does.
fn no_polling() -> ExecuteOptions {
    let hour = Duration::from_secs(3600);
    ExecuteOptions::new()
        .wait(Duration::from_secs(20))
        .poll_delays(hour, hour)
}

#[test]
fn a_waiter_in_this_process_is_woken_directly() {
    let (_dir, _path, _clock, store) = fixture();
    let store = Arc::new(store);
    let params = json!({"title": "t"});
    // The waiter must reach its wait before the holder finishes; if it comes
    // late it replays without waiting, and the round is tried again with
    // more time.
    for round in 1..=3u32 {
        let key = Key::new("acme/tickets", format!("shared-{round}")).unwrap();
        let (acquired_tx, acquired) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let holder = {
            let (store, key, params) = (store.clone(), key.clone(), params.clone());
            std::thread::spawn(move || {
                store.execute(&key, &fp(&params), ExecuteOptions::new(), |_lease| {
                    acquired_tx.send(()).unwrap();
                    released.recv().unwrap();
                    Ok::<_, Failure<String>>("T-1".to_string())
                })
            })
        };
        acquired.recv().unwrap();
        let waiter = {
            let (store, key, params) = (store.clone(), key.clone(), params.clone());
            std::thread::spawn(move || {
                store.execute(&key, &fp(&params), no_polling(), |_lease| {
                    Ok::<_, Failure<String>>("must not run".to_string())
                })
            })
        };
        std::thread::sleep(Duration::from_millis(20) * round.pow(2));
        release.send(()).unwrap();
        assert_eq!(holder.join().unwrap().unwrap().origin(), Origin::Ran);
        let out = waiter.join().unwrap().unwrap();
        assert_eq!(out.value(), "T-1");
        assert!(out.is_replayed());
        if out.was_woken() {
            return;
        }
    }
    panic!("the waiter was never woken directly: it came late every round, or no wake-up came");
}

#[test]
fn an_async_waiter_is_woken_directly() {
    let (_dir, _path, _clock, store) = fixture();
    let key = Key::new("acme/tickets", "shared").unwrap();
    let params = json!({"title": "t"});
    let (acquired_tx, acquired) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let (store, key, params) = (&store, &key, &params);
        let holder = s.spawn(move || {
            store.execute(key, &fp(params), ExecuteOptions::new(), |_lease| {
                acquired_tx.send(()).unwrap();
                released.recv().unwrap();
                Ok::<_, Failure<String>>("T-1".to_string())
            })
        });
        acquired.recv().unwrap();
        // The holder's claim committed to the index, so that the waiter's
        // `get_async` answers at once instead of awaiting that commit (which
        // it awaits, without blocking, where the sync `get` blocked).
        assert!(store.get(key).unwrap().is_some());
        let fingerprint = fp(params);
        let mut waiter = pin!(store.execute_async(
            key,
            &fingerprint,
            no_polling(),
            async |_lease: &Lease| Ok::<_, Failure<String>>("must not run".to_string()),
        ));
        // Polled once, the waiter has looked, seen the holder, and waits.
        let first = futures_lite::future::block_on(futures_lite::future::poll_once(&mut waiter));
        assert!(first.is_none(), "the waiter should wait: {first:?}");
        release.send(()).unwrap();
        assert_eq!(holder.join().unwrap().unwrap().origin(), Origin::Ran);
        let out = futures_lite::future::block_on(waiter).unwrap();
        assert_eq!(out.value(), "T-1");
        assert!(out.is_replayed());
        assert!(out.was_woken());
    });
}

/// Leaves `key` in progress as a holder that crashed would: acquired, with
/// its lease lapsed and no outcome.
fn crashed_holder(store: &Store, clock: &ManualClock, key: &Key, params: &Value) {
    let outcome = store.claim(key, &fp(params), &ClaimOptions::new()).unwrap();
    assert!(matches!(outcome, ClaimOutcome::Acquired(_)));
    clock.advance(LEASE + Duration::from_millis(1));
}

#[test]
fn in_doubt_refuse_is_the_default() {
    let (_dir, _path, clock, store) = fixture();
    let key = Key::new("acme/payments", "crashed").unwrap();
    let params = json!({"amount_cents": 100});
    crashed_holder(&store, &clock, &key, &params);
    let runs = AtomicU32::new(0);
    let err = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "ch_2"),
        )
        .unwrap_err();
    let ExecuteError::InDoubt { lease } = err else {
        panic!("{err:?}");
    };
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(lease.key(), &key);
    // Until somebody records what happened, the key stays in progress...
    let err = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new().wait(Duration::ZERO),
            counted(&runs, "ch_2"),
        )
        .unwrap_err();
    assert!(matches!(err, ExecuteError::StillInProgress { .. }));
    // ...and a person who found the charge records it with the lease.
    store.complete(&lease, br#""ch_1""#).unwrap();
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "ch_2"),
        )
        .unwrap();
    assert_eq!(
        (out.value().as_str(), out.origin()),
        ("ch_1", Origin::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[test]
fn in_doubt_rerun_runs_again() {
    let (_dir, _path, clock, store) = fixture();
    let key = Key::new("acme/agent.turns", "task-1:turn-0").unwrap();
    let params = json!([{"role": "user", "content": "hi"}]);
    crashed_holder(&store, &clock, &key, &params);
    let runs = AtomicU32::new(0);
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new().rerun_in_doubt(),
            counted(&runs, "reply"),
        )
        .unwrap();
    assert_eq!(out.origin(), Origin::Reran);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[test]
fn in_doubt_probe_decides() {
    let (_dir, _path, clock, store) = fixture();
    let params = json!({"amount_cents": 100});
    let runs = AtomicU32::new(0);

    // The probe finds the effect: its result is recorded, nothing runs.
    let key = Key::new("acme/payments", "charged").unwrap();
    crashed_holder(&store, &clock, &key, &params);
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new().probe_in_doubt(|lease: &Lease| {
                assert_eq!(lease.key().id(), "charged");
                Ok::<_, String>(Some("ch_1".to_string()))
            }),
            counted(&runs, "ch_2"),
        )
        .unwrap();
    assert_eq!(
        (out.value().as_str(), out.origin()),
        ("ch_1", Origin::Recovered)
    );
    let replay = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "ch_2"),
        )
        .unwrap();
    assert_eq!(
        (replay.value().as_str(), replay.origin()),
        ("ch_1", Origin::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // The probe finds nothing: the work runs.
    let key = Key::new("acme/payments", "not-charged").unwrap();
    crashed_holder(&store, &clock, &key, &params);
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new().probe_in_doubt(|_: &Lease| Ok::<_, String>(None)),
            counted(&runs, "ch_3"),
        )
        .unwrap();
    assert_eq!(
        (out.value().as_str(), out.origin()),
        ("ch_3", Origin::Reran)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The probe fails: nothing runs, the lease comes back.
    let key = Key::new("acme/payments", "unknown").unwrap();
    crashed_holder(&store, &clock, &key, &params);
    let err = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new()
                .probe_in_doubt(|_: &Lease| Err::<Option<String>, _>("gateway down".to_string())),
            counted(&runs, "ch_4"),
        )
        .unwrap_err();
    match err {
        ExecuteError::ProbeFailed { lease, error } => {
            assert_eq!(error, "gateway down");
            assert_eq!(lease.key(), &key);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A fresh key is never in doubt: the probe is not asked.
    let key = Key::new("acme/payments", "fresh").unwrap();
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new()
                .probe_in_doubt(|_: &Lease| Err::<Option<String>, _>("not asked".to_string())),
            counted(&runs, "ch_5"),
        )
        .unwrap();
    assert_eq!(out.origin(), Origin::Ran);
}

#[test]
fn a_panic_in_the_work_leaves_the_key_in_doubt() {
    let (_dir, _path, clock, store) = fixture();
    let key = Key::new("acme/payments", "panicked").unwrap();
    let params = json!({"amount_cents": 100});
    let crashed = catch_unwind(AssertUnwindSafe(|| {
        store.execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            |_lease| -> Result<String, Failure<String>> {
                resume_unwind(Box::new("crash after the charge"))
            },
        )
    }));
    assert!(crashed.is_err());
    let record = store.get(&key).unwrap().unwrap();
    assert_eq!(record.state(), State::Processing);
    clock.advance(LEASE + Duration::from_millis(1));
    let err = store
        .execute(&key, &fp(&params), ExecuteOptions::new(), |_lease| {
            Ok::<_, Failure<String>>("must not run".to_string())
        })
        .unwrap_err();
    assert!(matches!(err, ExecuteError::InDoubt { .. }));
}

/// A contender that, once the work has started, claims `key` over and over
/// until the work is done (or the test gave up), and counts how often it
/// acquired the key: a takeover.
fn contend(
    store: &Store,
    key: &Key,
    params: &Value,
    started: &mpsc::Receiver<()>,
    done: &mpsc::Receiver<()>,
) -> u32 {
    if started.recv().is_err() {
        return 0;
    }
    let mut takeovers = 0;
    while let Err(mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(Duration::from_millis(20)) {
        match store.claim(key, &fp(params), &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Acquired(_) => takeovers += 1,
            ClaimOutcome::InProgress { .. } | ClaimOutcome::Replay(_) => {}
        }
    }
    takeovers
}

/// The lease of the real-clock extension tests, and how long their work
/// runs: longer than the lease, so the key is kept only if the lease is
/// renewed (every third of it). The slack before a lapse (two thirds of
/// the lease) is wide, so a loaded machine that delays one renewal does
/// not make the test fail; this is no timing assertion, only a margin.
const REAL_LEASE: Duration = Duration::from_secs(3);
const REAL_WORK: Duration = Duration::from_secs(4);

fn real_clock_store(dir: &tempfile::TempDir) -> Store {
    Store::open_with(
        dir.path().join("agent.redb"),
        Config::new().sweep_interval(None),
    )
    .unwrap()
}

#[test]
fn the_lease_is_extended_while_the_work_runs_longer() {
    let dir = tempfile::tempdir().unwrap();
    let store = real_clock_store(&dir);
    let key = Key::new("acme/reports", "slow").unwrap();
    let params = json!({"report": "q3"});
    std::thread::scope(|s| {
        let (started_tx, started) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let (store, key, params) = (&store, &key, &params);
        let contender = s.spawn(move || contend(store, key, params, &started, &done));
        let out = store
            .execute(
                key,
                &fp(params),
                ExecuteOptions::new().lease(REAL_LEASE),
                |_lease| {
                    started_tx.send(()).unwrap();
                    std::thread::sleep(REAL_WORK);
                    Ok::<_, Failure<String>>("report".to_string())
                },
            )
            .unwrap();
        done_tx.send(()).unwrap();
        assert_eq!(out.origin(), Origin::Ran);
        assert_eq!(contender.join().unwrap(), 0, "the key was taken over");
    });
    let record = store.get(&key).unwrap().unwrap();
    assert_eq!(record.state(), State::Succeeded);
    assert_eq!(record.acquisitions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_extended_while_async_work_runs_longer() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(real_clock_store(&dir));
    let key = Key::new("acme/reports", "slow").unwrap();
    let params = json!({"report": "q3"});
    let (started_tx, started) = mpsc::channel();
    let (done_tx, done) = mpsc::channel();
    let contender = {
        let (store, key, params) = (store.clone(), key.clone(), params.clone());
        std::thread::spawn(move || contend(&store, &key, &params, &started, &done))
    };
    // Spawned, so the future must be Send.
    let out = tokio::spawn({
        let (store, key, params) = (store.clone(), key.clone(), params.clone());
        async move {
            store
                .execute_async(
                    &key,
                    &fp(&params),
                    ExecuteOptions::new().lease(REAL_LEASE),
                    async |_lease: &Lease| {
                        started_tx.send(()).unwrap();
                        tokio::time::sleep(REAL_WORK).await;
                        Ok::<_, Failure<String>>("report".to_string())
                    },
                )
                .await
        }
    })
    .await;
    drop(done_tx);
    let out = out.unwrap().unwrap();
    assert_eq!(out.origin(), Origin::Ran);
    assert_eq!(contender.join().unwrap(), 0, "the key was taken over");
    assert_eq!(store.get(&key).unwrap().unwrap().acquisitions(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execute_async_replays_and_probes() {
    let (_dir, _path, clock, store) = fixture();
    let key = Key::new("acme/payments", "async").unwrap();
    let params = json!({"amount_cents": 100});
    crashed_holder(&store, &clock, &key, &params);
    let runs = AtomicU32::new(0);
    let work = async |_lease: &Lease| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, Failure<String>>("ch_2".to_string())
    };
    let out = store
        .execute_async(
            &key,
            &fp(&params),
            ExecuteOptions::new().probe_in_doubt(async |_lease: &Lease| {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Ok::<_, String>(Some("ch_1".to_string()))
            }),
            work,
        )
        .await
        .unwrap();
    assert_eq!(
        (out.value().as_str(), out.origin()),
        ("ch_1", Origin::Recovered)
    );
    let again = store
        .execute_async(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            async |_: &Lease| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Failure<String>>("ch_3".to_string())
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (again.value().as_str(), again.origin()),
        ("ch_1", Origin::Replayed)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let refused = Key::new("acme/payments", "async-refused").unwrap();
    crashed_holder(&store, &clock, &refused, &params);
    let err = store
        .execute_async(
            &refused,
            &fp(&params),
            ExecuteOptions::new(),
            async |_: &Lease| Ok::<_, Failure<String>>("must not run".to_string()),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ExecuteError::InDoubt { .. }));
}

/// Work that ran while another caller took its key over (its lease lapsed
/// on the store's clock) is NotRecorded, with the outcome to record: it was
/// `Store(StaleLease)`, the error a claim refused before anything ran
/// gives, and the outcome was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_not_recorded_after_the_work_ran_says_so_and_keeps_it() {
    let (_d, _p, clock, store) = fixture();
    let key = Key::new("acme/tickets", "taken-over").unwrap();
    let params = json!({"title": "disk full"});
    let mut taker = None;
    let err = store
        .execute_async(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            async |_: &Lease| {
                clock.advance(LEASE + Duration::from_millis(1));
                match store
                    .claim(&key, &fp(&params), &ClaimOptions::new())
                    .unwrap()
                {
                    ClaimOutcome::Acquired(lease) => taker = Some(lease.token()),
                    other => panic!("expected a takeover, got {other:?}"),
                }
                Ok::<_, Failure<String>>("T-1001".to_string())
            },
        )
        .await
        .unwrap_err();
    match &err {
        ExecuteError::NotRecorded {
            key: k,
            error: Error::StaleLease { .. },
            outcome,
            ..
        } => {
            assert_eq!(k, &key);
            assert_eq!(outcome, &Resolution::Succeeded(br#""T-1001""#.to_vec()));
        }
        other => panic!("expected NotRecorded, got {other:?}"),
    }
    assert!(err.to_string().contains("do not run it again"), "{err}");
    let record = store.get(&key).unwrap().unwrap();
    assert_eq!(record.state(), State::Processing);
    assert_eq!(Some(record.token()), taker);
}

// --------------------------------------------------------- call driver ----

fn fast_policy(attempts: u32) -> RetryPolicy {
    RetryPolicy::new(attempts, Duration::from_millis(1), Duration::from_millis(4)).unwrap()
}

#[test]
fn every_attempt_sends_the_same_key() {
    let key = Key::for_intent("acme/payments", "task-9", "charge", &json!({"cents": 5})).unwrap();
    let mut sent = Vec::new();
    let mut queried = Vec::new();
    let mut sends = vec![
        Err(RemoteError::Retryable("503")),
        Err(RemoteError::TimedOut),
        Err(RemoteError::TimedOut),
    ]
    .into_iter();
    let mut queries = vec![
        Err(RemoteError::TimedOut),
        Ok(RemoteStatus::InProgress),
        Ok(RemoteStatus::NotFound),
        Ok(RemoteStatus::Done("ch_1")),
    ]
    .into_iter();
    let out = call(
        &key,
        &fast_policy(10),
        |k| {
            sent.push(k.clone());
            sends.next().unwrap()
        },
        |k| {
            queried.push(k.clone());
            queries.next().unwrap()
        },
    );
    assert_eq!(out.unwrap(), "ch_1");
    // send (503) → send (timeout) → query (timeout) → query (in progress)
    // → query (not found) → send (timeout) → query (done).
    assert_eq!(sent.len(), 3);
    assert_eq!(queried.len(), 4);
    assert!(sent.iter().chain(&queried).all(|k| *k == key));
}

#[test]
fn the_driver_gives_up_with_the_key() {
    let key = Key::new("acme/payments", "stuck").unwrap();
    let mut sent = Vec::new();
    let err = call(
        &key,
        &fast_policy(4),
        |k| {
            sent.push(k.clone());
            Err::<&str, RemoteError<&str>>(RemoteError::TimedOut)
        },
        |_| Ok(RemoteStatus::InProgress),
    )
    .unwrap_err();
    match &err {
        CallError::Exhausted {
            key: k,
            attempts,
            limit,
            in_doubt,
            ..
        } => {
            assert_eq!(k, &key);
            assert_eq!((*attempts, *limit, *in_doubt), (4, Limit::Attempts, true));
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("acme/payments/stuck"));
    // Never sent twice: every later attempt asked instead.
    assert_eq!(sent, vec![key.clone()]);

    // A rejection stops at once; not in doubt when the service never acted.
    let err = call(
        &key,
        &fast_policy(4),
        |_| Err::<&str, _>(RemoteError::Permanent("card declined")),
        |_| Ok(RemoteStatus::NotFound),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        CallError::Rejected {
            in_doubt: false,
            error: "card declined",
            ..
        }
    ));
    // The message keeps the service's reason (text recorded from it, as a
    // failure, would lose it otherwise).
    assert!(
        err.to_string().ends_with("was rejected: card declined"),
        "{err}"
    );

    // A service that says it may have acted (an earlier request with the
    // key started and its outcome was never recorded) stops the call at
    // once, in doubt on its first send too.
    let mut asked = 0;
    let err = call(
        &key,
        &fast_policy(4),
        |_| Err::<&str, _>(RemoteError::InDoubt("outcome unknown")),
        |_| {
            asked += 1;
            Ok(RemoteStatus::NotFound)
        },
    )
    .unwrap_err();
    assert!(matches!(
        err,
        CallError::Rejected {
            in_doubt: true,
            error: "outcome unknown",
            ..
        }
    ));
    assert!(err.is_in_doubt());
    assert!(
        err.to_string().ends_with(
            "rejected: outcome unknown; the service may have acted: follow up with this key"
        ),
        "{err}"
    );
    assert_eq!(asked, 0, "nothing is asked after such an answer");

    // The deadline bounds the whole call: zero allows the first attempt only.
    let mut attempts = 0;
    let err = call(
        &key,
        &fast_policy(10).deadline(Duration::ZERO),
        |_| {
            attempts += 1;
            Err::<&str, _>(RemoteError::Retryable("503"))
        },
        |_| Ok(RemoteStatus::NotFound),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        CallError::Exhausted {
            attempts: 1,
            limit: Limit::Deadline,
            in_doubt: false,
            last_error: Some("503"),
            ..
        }
    ));
    assert!(err.to_string().ends_with("; last error: 503"), "{err}");
    assert_eq!(attempts, 1);

    // A service that asks for a wait (Retry-After) ending past the deadline
    // stops the call at once, where backoff alone would send again.
    let mut attempts = 0;
    let err = call(
        &key,
        &fast_policy(10).deadline(Duration::from_secs(60)),
        |_| {
            attempts += 1;
            Err::<&str, _>(RemoteError::RetryAfter {
                error: "503",
                after: Duration::from_secs(3600),
            })
        },
        |_| Ok(RemoteStatus::NotFound),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Exhausted {
                attempts: 1,
                limit: Limit::Deadline,
                in_doubt: false,
                last_error: Some("503"),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(attempts, 1);

    // One that fits is waited for, and the same request is made again.
    let mut answers = vec![Err(RemoteError::RetryAfter {
        error: "429",
        after: Duration::from_millis(5),
    })]
    .into_iter();
    let out = call(
        &key,
        &fast_policy(10),
        |_| answers.next().unwrap_or(Ok("T-1")),
        |_| Ok(RemoteStatus::NotFound),
    );
    assert_eq!(out.unwrap(), "T-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_async_attempt_sends_the_same_key() {
    let key = Key::new("acme/tickets", "task-3:call_1").unwrap();
    let sent = Mutex::new(Vec::new());
    let mut answers = vec![
        Err(RemoteError::Retryable("429")),
        Err(RemoteError::TimedOut),
    ]
    .into_iter();
    let out = call_async(
        &key,
        &fast_policy(10),
        async |k: &Key| {
            sent.lock().unwrap().push(k.clone());
            tokio::time::sleep(Duration::from_millis(1)).await;
            answers.next().unwrap_or(Ok("T-1"))
        },
        async |k: &Key| {
            sent.lock().unwrap().push(k.clone());
            Ok(RemoteStatus::NotFound)
        },
    )
    .await;
    assert_eq!(out.unwrap(), "T-1");
    let sent = sent.into_inner().unwrap();
    assert_eq!(sent.len(), 4); // send, send, query, send
    assert!(sent.iter().all(|k| *k == key));
}

// ------------------------------------------------- a lost payment response --

/// A payment gateway that acts on every request it receives (no
/// deduplication of its own), records the merchant reference (the key) of
/// each charge, and can be told to lose responses.
#[derive(Default)]
struct Gateway {
    charges: Mutex<Vec<String>>,
    lose: Mutex<Vec<bool>>,
}

impl Gateway {
    /// `lose` says, send by send, whether the response is lost.
    fn losing(lose: &[bool]) -> Self {
        Gateway {
            charges: Mutex::default(),
            lose: Mutex::new(lose.iter().rev().copied().collect()),
        }
    }

    fn charge(&self, key: &Key) -> Result<String, RemoteError<String>> {
        let mut charges = self.charges.lock().unwrap();
        charges.push(key.to_string());
        let id = format!("ch_{}", charges.len());
        if self.lose.lock().unwrap().pop().unwrap_or(false) {
            Err(RemoteError::TimedOut)
        } else {
            Ok(id)
        }
    }

    fn lookup(&self, key: &Key) -> Result<RemoteStatus<String>, RemoteError<String>> {
        let charges = self.charges.lock().unwrap();
        Ok(match charges.iter().position(|k| *k == key.to_string()) {
            Some(i) => RemoteStatus::Done(format!("ch_{}", i + 1)),
            None => RemoteStatus::NotFound,
        })
    }

    fn count(&self, key: &Key) -> usize {
        let key = key.to_string();
        self.charges
            .lock()
            .unwrap()
            .iter()
            .filter(|k| **k == key)
            .count()
    }
}

fn pay(
    store: &Store,
    gateway: &Gateway,
    key: &Key,
    params: &Value,
    crash_after_charge: bool,
) -> Result<String, ExecuteError<String>> {
    let options = ExecuteOptions::new()
        .wait(Duration::ZERO)
        .probe_in_doubt(|lease: &Lease| match gateway.lookup(lease.key()) {
            Ok(RemoteStatus::Done(id)) => Ok(Some(id)),
            Ok(RemoteStatus::NotFound) => Ok(None),
            _ => Err("gateway unreachable".to_string()),
        });
    store
        .execute(key, &fp(params), options, |lease| {
            let charged = call(
                lease.key(),
                &fast_policy(6),
                |k| gateway.charge(k),
                |k| gateway.lookup(k),
            )
            .map_err(|e| Failure::permanent(e.to_string()))?;
            if crash_after_charge {
                resume_unwind(Box::new("the process dies before recording the charge"));
            }
            Ok(charged)
        })
        .map(idemstore::agent::Executed::into_value)
}

#[test]
fn a_payment_whose_response_is_lost_is_charged_once() {
    let (_dir, path, clock, store) = fixture();
    let mut store = Some(store);
    let params = json!({"order": "A-17", "amount_cents": 4200});
    // Which of the gateway's responses are lost, send by send.
    let patterns: [&[bool]; 4] = [&[true], &[true, true], &[false], &[true, false, true]];
    for (i, lose) in patterns.iter().enumerate() {
        for crash in [false, true] {
            let gateway = Gateway::losing(lose);
            let task = format!("task-{i}-{crash}");
            let key = Key::for_intent("acme/payments", &task, "charge", &params).unwrap();
            let mut answers = HashMap::new();
            // The caller retries five times, whatever happened before.
            for _ in 0..5 {
                let s = store.as_ref().unwrap();
                let answer = catch_unwind(AssertUnwindSafe(|| {
                    pay(s, &gateway, &key, &params, crash && answers.is_empty())
                }));
                match answer {
                    Ok(Ok(id)) => *answers.entry(id).or_insert(0) += 1,
                    Ok(Err(e)) => panic!("{e}"),
                    Err(_) => {
                        // The process died: restart it once the lease lapsed.
                        drop(store.take());
                        clock.advance(LEASE + Duration::from_millis(1));
                        store = Some(manual_store(&path, &clock));
                        answers.insert("crashed".to_string(), 0);
                    }
                }
            }
            assert_eq!(gateway.count(&key), 1, "{task}: charged more than once");
            answers.remove("crashed");
            assert_eq!(answers.len(), 1, "{task}: every retry gets the one charge");
            assert_eq!(answers.values().sum::<u32>(), 5 - u32::from(crash));
        }
    }
}

/// A lease under `MIN_RENEWED_LEASE` (100 ms), set on the call or taken
/// from the store's configuration, is refused before anything is claimed
/// or run: a renewal that lands after such a lease lapsed lets a retry run
/// the work a second time under a live holder.
#[test]
fn execute_refuses_a_lease_too_short_to_renew() {
    use idemstore::MIN_RENEWED_LEASE;
    let dir = tempfile::tempdir().unwrap();
    let key = Key::new("acme/tools", "short").unwrap();
    let fp = Fingerprint::of_json(&json!({"n": 1})).unwrap();
    let short = MIN_RENEWED_LEASE - Duration::from_millis(1);
    let run = |store: &Store, options: ExecuteOptions| {
        store.execute(
            &key,
            &fp,
            options,
            |_lease| -> Result<u32, Failure<String>> { panic!("the work ran") },
        )
    };
    let store = Store::open(dir.path().join("a.redb")).unwrap();
    let err = run(&store, ExecuteOptions::new().lease(short)).unwrap_err();
    assert!(
        matches!(
            &err,
            ExecuteError::Store(Error::InvalidArgument { what: "lease", .. })
        ),
        "{err:?}"
    );
    assert!(store.get(&key).unwrap().is_none());
    drop(store);
    let config = Config::new().lease(short);
    let store = Store::open_with(dir.path().join("b.redb"), config).unwrap();
    let err = run(&store, ExecuteOptions::new()).unwrap_err();
    assert!(
        matches!(
            &err,
            ExecuteError::Store(Error::InvalidArgument { what: "lease", .. })
        ),
        "{err:?}"
    );
    assert!(store.get(&key).unwrap().is_none());
    // The bound itself is taken, from the call over the store's.
    let out = store
        .execute(
            &key,
            &fp,
            ExecuteOptions::new().lease(MIN_RENEWED_LEASE),
            |_lease| Ok::<u32, Failure<String>>(7),
        )
        .unwrap();
    assert_eq!(*out.value(), 7);
}

/// A value over the store's result limit cannot be recorded after the work
/// ran: the call says so (`TooLargeToRecord`, not a bare `TooLarge` that
/// reads as "nothing happened"), the record stays in progress, and once
/// its lease lapses the next call finds the key in doubt instead of
/// running the work again.
#[test]
fn an_outcome_too_large_to_record_leaves_the_key_in_doubt() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::starting_now();
    let config = Config::new()
        .clock(clock.clone())
        .lease(LEASE)
        .max_result_bytes(64)
        .sweep_interval(None);
    let store = Store::open_with(dir.path().join("big.redb"), config).unwrap();
    let key = Key::new("acme/tools", "big").unwrap();
    let params = json!({"n": 1});
    let runs = AtomicU32::new(0);
    let big = "x".repeat(100);
    let err = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, &big),
        )
        .unwrap_err();
    match &err {
        ExecuteError::TooLargeToRecord {
            key: k,
            what: "result",
            len: 102,
            limit: 64,
        } => assert_eq!(k, &key),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("ran"), "{err}");
    assert_eq!(store.get(&key).unwrap().unwrap().state(), State::Processing);
    clock.advance(LEASE + Duration::from_millis(1));
    let again = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "small"),
        )
        .unwrap_err();
    assert!(matches!(again, ExecuteError::InDoubt { .. }), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An outcome that would not replay as itself is not recorded: a NaN or
/// infinite float at any depth (serde_json writes it as `null`, so a bare
/// `f64` would fail every replay until retention ends and a `Some(inf)`
/// would replay as `None`), or a permanent failure whose JSON does not
/// decode as its type (a field skipped when serialized). The call answers
/// `Codec` ("record"), the record stays in progress, and the next call
/// after the lease finds the key in doubt; the work ran once per key.
#[test]
fn an_outcome_that_would_not_replay_is_not_recorded() {
    #[derive(serde::Serialize, serde::Deserialize, Debug)]
    struct Refusal {
        #[serde(skip_serializing)]
        #[allow(dead_code)]
        code: u32,
    }
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::starting_now();
    let config = Config::new()
        .clock(clock.clone())
        .lease(LEASE)
        .sweep_interval(None);
    let store = Store::open_with(dir.path().join("nan.redb"), config).unwrap();
    let params = json!({"n": 1});
    let runs = AtomicU32::new(0);
    let measure = |_lease: &Lease| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<f64, Failure<String>>(f64::NAN)
    };
    let refuse = |_lease: &Lease| {
        runs.fetch_add(1, Ordering::SeqCst);
        Err::<String, _>(Failure::permanent(Refusal { code: 7 }))
    };
    let optional = |_lease: &Lease| {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, Failure<String>>(vec![Some(1.5), Some(f64::INFINITY)])
    };
    let nan = Key::new("acme/tools", "nan").unwrap();
    let skipped = Key::new("acme/tools", "skipped").unwrap();
    let inf = Key::new("acme/tools", "inf").unwrap();
    let errors = [
        format!(
            "{:?}",
            store
                .execute(&nan, &fp(&params), ExecuteOptions::new(), measure)
                .unwrap_err()
        ),
        format!(
            "{:?}",
            store
                .execute(&skipped, &fp(&params), ExecuteOptions::new(), refuse)
                .unwrap_err()
        ),
        format!(
            "{:?}",
            store
                .execute(&inf, &fp(&params), ExecuteOptions::new(), optional)
                .unwrap_err()
        ),
    ];
    assert!(errors[0].contains("no JSON form"), "{}", errors[0]);
    assert!(errors[1].contains("missing field"), "{}", errors[1]);
    assert!(errors[2].contains("no JSON form"), "{}", errors[2]);
    for (key, err) in [&nan, &skipped, &inf].into_iter().zip(&errors) {
        assert!(
            err.starts_with("Codec") && err.contains("\"record\"") && err.contains("in doubt"),
            "{err}"
        );
        assert_eq!(store.get(key).unwrap().unwrap().state(), State::Processing);
    }
    clock.advance(LEASE + Duration::from_millis(1));
    let again = store
        .execute(&nan, &fp(&params), ExecuteOptions::new(), measure)
        .unwrap_err();
    assert!(matches!(again, ExecuteError::InDoubt { .. }), "{again:?}");
    let again = store
        .execute(&skipped, &fp(&params), ExecuteOptions::new(), refuse)
        .unwrap_err();
    assert!(matches!(again, ExecuteError::InDoubt { .. }), "{again:?}");
    let again = store
        .execute(&inf, &fp(&params), ExecuteOptions::new(), optional)
        .unwrap_err();
    assert!(matches!(again, ExecuteError::InDoubt { .. }), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// A retryable failure over the store's failure limit is kept as `null`:
/// the call answers `Failed { retryable: true }`, and the next call runs
/// the work again instead of finding the key in doubt.
#[test]
fn a_retryable_failure_too_large_to_keep_still_lets_the_next_call_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new().max_failure_bytes(64).sweep_interval(None);
    let store = Store::open_with(dir.path().join("fail.redb"), config).unwrap();
    let key = Key::new("acme/tools", "flaky").unwrap();
    let params = json!({"n": 1});
    let err = store
        .execute(&key, &fp(&params), ExecuteOptions::new(), |_lease| {
            Err::<String, _>(Failure::retryable("x".repeat(100)))
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            ExecuteError::Failed {
                retryable: true,
                replayed: false,
                ..
            }
        ),
        "{err:?}"
    );
    let record = store.get(&key).unwrap().unwrap();
    assert_eq!(record.state(), State::Failed { retryable: true });
    assert_eq!(record.failure(), Some(&b"null"[..]));
    let runs = AtomicU32::new(0);
    let out = store
        .execute(
            &key,
            &fp(&params),
            ExecuteOptions::new(),
            counted(&runs, "ok"),
        )
        .unwrap();
    assert_eq!(out.value(), "ok");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

thread_local! {
    /// The pause of this thread, if [`paused_at`] set one: the span to
    /// pause at, the signal that it got there, and the signal to go on.
    static PAUSE: std::cell::RefCell<Option<Pause>> = const { std::cell::RefCell::new(None) };
}

/// A pause [`PauseAt`] takes once: the span, "reached", "go".
type Pause = (&'static str, mpsc::Sender<()>, mpsc::Receiver<()>);

/// A tracing layer that pauses a thread once, when the thread is about to
/// create the span its [`PAUSE`] names (`idemstore.claim`: after `execute`
/// looked the key up, before its claim), until the test lets it go:
/// another caller acts exactly in between. Installed as the global
/// subscriber of this test binary, once, and the callsites' interest
/// rebuilt before each pause: with a subscriber per thread
/// (`with_default`) beside the other tests' threads, a CI run once saw
/// the thread never pause.
struct PauseAt;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for PauseAt {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _id: &tracing::span::Id,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let name = attrs.metadata().name();
        let pause = PAUSE.with(|p| {
            let mut p = p.borrow_mut();
            match p.as_ref() {
                Some((span, ..)) if *span == name => p.take(),
                _ => None,
            }
        });
        if let Some((_, reached, go)) = pause {
            reached.send(()).unwrap();
            go.recv().unwrap();
        }
    }
}

/// Runs `f` on a thread of its own that pauses at its first `span`;
/// returns the thread, the signal that it reached the pause, and the
/// sender that lets it go on.
fn paused_at<R: Send + 'static>(
    span: &'static str,
    f: impl FnOnce() -> R + Send + 'static,
) -> (
    std::thread::JoinHandle<R>,
    mpsc::Receiver<()>,
    mpsc::Sender<()>,
) {
    use tracing_subscriber::layer::SubscriberExt;
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(PauseAt))
            .expect("the pause layer is this binary's only subscriber");
    });
    // A span registered before the install keeps no stale interest.
    tracing::callsite::rebuild_interest_cache();
    let (reached_tx, reached_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        PAUSE.with(|p| *p.borrow_mut() = Some((span, reached_tx, go_rx)));
        f()
    });
    (handle, reached_rx, go_tx)
}

/// The thread of a [`paused_execute`] and its answer.
type PausedCall = std::thread::JoinHandle<Result<Executed<String>, ExecuteError<String>>>;

/// An `execute` of `key` on a thread of its own, paused after its look-up
/// and before its claim (returned once it got there); its work counts its
/// runs and returns `value`. Sending on the returned sender lets it go on.
fn paused_execute(
    store: &Arc<Store>,
    key: &Key,
    params: &Value,
    value: &'static str,
) -> (PausedCall, Arc<AtomicU32>, mpsc::Sender<()>) {
    let runs = Arc::new(AtomicU32::new(0));
    let (store, key, params, counted) = (store.clone(), key.clone(), params.clone(), runs.clone());
    let (caller, reached, go) = paused_at("idemstore.claim", move || {
        store.execute(&key, &fp(&params), ExecuteOptions::new(), |_: &Lease| {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Failure<String>>(value.to_string())
        })
    });
    reached.recv().unwrap();
    (caller, runs, go)
}

/// Whether a takeover is in doubt is what the claim itself found, not a
/// record read before it. A retryable failure recorded between a caller's
/// look-up (the key absent, or in progress) and its claim is a retry, not
/// in doubt: the caller runs the work (it answered `InDoubt`, and every
/// later call did too, until an operator resolved the key). And a lapsed
/// lease after a release and a new holder that crashed is in doubt, even
/// when the look-up saw a retryable failure one acquisition earlier (it
/// ran the work).
#[test]
fn in_doubt_is_what_the_claim_found_not_an_earlier_read() {
    let (_dir, _path, clock, store) = fixture();
    let store = Arc::new(store);
    let params = json!({"title": "printer on fire"});

    // A retryable failure between the look-up and the claim.
    let key = Key::for_tool_call("acme/tickets.create", "task-1", "call_1").unwrap();
    let (caller, runs, go) = paused_execute(&store, &key, &params, "T-2");
    let ClaimOutcome::Acquired(first) = store
        .claim(&key, &fp(&params), &ClaimOptions::new())
        .unwrap()
    else {
        panic!("the key was absent");
    };
    store.fail(&first, br#""503""#, true).unwrap();
    go.send(()).unwrap();
    let reply = caller.join().unwrap().expect("a retry runs the work");
    assert_eq!(reply.origin(), Origin::Ran);
    assert_eq!(reply.value(), "T-2");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A lapsed lease of a holder that claimed after a release.
    let key = Key::for_intent("acme/payments", "task-9", "charge", &json!({"amount": 1})).unwrap();
    let ClaimOutcome::Acquired(failed) = store
        .claim(&key, &fp(&params), &ClaimOptions::new())
        .unwrap()
    else {
        panic!("the key was absent");
    };
    store.fail(&failed, br#""503""#, true).unwrap();
    let (caller, runs, go) = paused_execute(&store, &key, &params, "ch_2");
    let ClaimOutcome::Acquired(released) = store
        .claim(&key, &fp(&params), &ClaimOptions::new())
        .unwrap()
    else {
        panic!("a retryable failure is acquired again");
    };
    store.release(released).unwrap();
    let ClaimOutcome::Acquired(crashed) = store
        .claim(&key, &fp(&params), &ClaimOptions::new())
        .unwrap()
    else {
        panic!("a released key is acquired again");
    };
    clock.advance(LEASE + Duration::from_millis(1));
    go.send(()).unwrap();
    match caller.join().unwrap() {
        Err(ExecuteError::InDoubt { lease }) => assert!(lease.token() > crashed.token()),
        other => panic!("a lapsed lease is in doubt, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A retryable failure is always recorded, so that the next call runs the
/// work again rather than finding the key in doubt: one that serde_json
/// cannot write (a map with keys that are not strings) is kept as `null`,
/// and under a `max_failure_bytes` below the four bytes of `null`, as
/// nothing. (It answered `Codec`, and under that limit any failure too
/// large answered `TooLargeToRecord`; both left the key in doubt.)
#[test]
fn a_retryable_failure_that_cannot_be_kept_as_is_is_still_recorded() {
    type Unwritable = std::collections::BTreeMap<(u8, u8), u8>;
    let dir = tempfile::tempdir().unwrap();
    let params = json!({"title": "printer on fire"});
    for (name, limit) in [("unwritable", None), ("tiny limit", Some(3))] {
        let mut config = Config::new().sweep_interval(None);
        if let Some(limit) = limit {
            config = config.max_failure_bytes(limit);
        }
        let store = Store::open_with(dir.path().join(format!("{name}.redb")), config).unwrap();
        let key = Key::for_tool_call("acme/tickets.create", "task-3", "call_1").unwrap();
        let first = store.execute(&key, &fp(&params), ExecuteOptions::new(), |_: &Lease| {
            Err::<String, _>(Failure::retryable(Unwritable::from([((1, 2), 3)])))
        });
        assert!(
            matches!(
                first,
                Err(ExecuteError::Failed {
                    retryable: true,
                    ..
                })
            ),
            "{name}: {first:?}"
        );
        let kept = store.get(&key).unwrap().unwrap();
        assert_eq!(kept.state(), State::Failed { retryable: true }, "{name}");
        let expected: &[u8] = if limit.is_some() { b"" } else { b"null" };
        assert_eq!(kept.failure(), Some(expected), "{name}");
        let again = store
            .execute(&key, &fp(&params), ExecuteOptions::new(), |_: &Lease| {
                Ok::<_, Failure<Unwritable>>("T-1".to_string())
            })
            .expect("the next call runs the work");
        assert_eq!(again.origin(), Origin::Ran, "{name}");
    }
}

/// The recipe of docs/agents.md ("The other end of the network"): a call
/// whose sends all timed out while the gateway charged (its queries
/// failing too) ends in doubt, and is recorded as a retryable failure, so
/// that the next `execute`, once the gateway answers again, sends with the
/// same key and gets the charge made the first time: one charge, returned.
/// (Recorded as a permanent failure, as the recipe once did, the failure
/// was replayed to every later call, though the card was charged.)
#[test]
fn a_call_that_may_have_charged_is_recorded_retryable_and_found_by_the_next() {
    let (_dir, _path, _clock, store) = fixture();
    let params = json!({"order": "A-17", "amount_cents": 4200});
    let key = Key::for_intent("acme/payments.charge", "task-42", "charge", &params).unwrap();
    // The gateway: charges per key (a repeated key returns the first
    // charge, as Stripe's idempotency keys do); while `down`, every answer
    // is lost after the charge is made, and every query fails.
    let charges: Mutex<HashMap<String, String>> = Mutex::new(HashMap::new());
    let down = std::sync::atomic::AtomicBool::new(true);
    let charge = |k: &Key| -> Result<String, RemoteError<String>> {
        let mut charges = charges.lock().unwrap();
        let next = format!("ch_{}", charges.len() + 1);
        let id = charges.entry(k.to_string()).or_insert(next).clone();
        if down.load(Ordering::SeqCst) {
            Err(RemoteError::TimedOut)
        } else {
            Ok(id)
        }
    };
    let status = |k: &Key| -> Result<RemoteStatus<String>, RemoteError<String>> {
        if down.load(Ordering::SeqCst) {
            return Err(RemoteError::TimedOut);
        }
        Ok(match charges.lock().unwrap().get(&k.to_string()) {
            Some(id) => RemoteStatus::Done(id.clone()),
            None => RemoteStatus::NotFound,
        })
    };
    let charge_once = || {
        store.execute(&key, &fp(&params), ExecuteOptions::new(), |lease| {
            call(lease.key(), &fast_policy(3), charge, status).map_err(|e| {
                if e.is_in_doubt() {
                    Failure::retryable(e.to_string())
                } else {
                    Failure::permanent(e.to_string())
                }
            })
        })
    };
    match charge_once() {
        Err(ExecuteError::Failed {
            error, retryable, ..
        }) => {
            assert!(retryable, "{error}");
            assert!(error.contains("may have acted"), "{error}");
        }
        other => panic!("expected a retryable failure, got {other:?}"),
    }
    down.store(false, Ordering::SeqCst);
    let charged = charge_once().expect("the next call");
    assert_eq!(charged.value(), "ch_1");
    assert_eq!(charges.lock().unwrap().len(), 1, "charged twice");
    // Recorded now: replayed, no call made.
    down.store(true, Ordering::SeqCst);
    let replayed = charge_once().expect("replayed");
    assert_eq!(
        (replayed.value().as_str(), replayed.origin()),
        ("ch_1", Origin::Replayed)
    );
}
