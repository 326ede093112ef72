//! The lease extender of `Store::execute`: one thread per store serves every
//! call in flight (feature `agent`).
//!
//! The tests count the process's threads (`/proc/self/task`), so they run
//! one at a time (`SERIAL`) in a binary of their own.
#![cfg(feature = "agent")]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use idemstore::agent::{ExecuteError, ExecuteOptions, Failure, Origin};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, Key, Lease, ManualClock};
use idemstore::{Resolution, State, Store};
use serde_json::json;
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};

/// Threads a run may add besides its callers: the extender, and room for
/// a store thread (writer, syncer, sweeper) or a test-harness thread that
/// starts while the run is on.
const SLACK_THREADS: usize = 8;

/// Concurrent callers in the many-calls test.
const CALLERS: usize = 500;

/// The name of the extender thread as `/proc` shows it (15 bytes at most).
const EXTENDER_COMM: &str = "idemstore-exten";

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The names of this process's threads.
fn threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|entry| {
            let path = entry.ok()?.path().join("comm");
            // A thread may end between the listing and the read.
            std::fs::read_to_string(path)
                .ok()
                .map(|s| s.trim_end().to_string())
        })
        .collect()
}

fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn extenders() -> usize {
    threads().iter().filter(|n| *n == EXTENDER_COMM).count()
}

/// Captured events: the fields of each warning.
type Events = Arc<Mutex<Vec<BTreeMap<String, String>>>>;

/// Warnings of the extender, by key (the extender emits on its own thread,
/// so the subscriber is global).
fn warnings() -> Events {
    static EVENTS: OnceLock<Events> = OnceLock::new();
    EVENTS
        .get_or_init(|| {
            let events = Arc::new(Mutex::new(Vec::new()));
            let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
            tracing::subscriber::set_global_default(subscriber).unwrap();
            events
        })
        .clone()
}

fn extension_failures(key: &Key) -> usize {
    let key = key.to_string();
    warnings()
        .lock()
        .unwrap()
        .iter()
        .filter(|e| {
            e.get("message").map(String::as_str) == Some("lease extension failed")
                && e.get("key") == Some(&key)
        })
        .count()
}

struct Capture(Events);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() != tracing::Level::WARN {
            return;
        }
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(fields);
    }
}

/// Sleeps in short steps until `f` holds (no time limit: a hang is the
/// failure).
fn wait_for(f: impl Fn() -> bool) {
    while !f() {
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn five_hundred_concurrent_calls_share_one_extender() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("many.redb")).unwrap();
    let lease = Duration::from_millis(200);
    let work = Duration::from_millis(600);
    let keys: Vec<Key> = (0..CALLERS)
        .map(|i| Key::new("acme/many", format!("call-{i}")).unwrap())
        .collect();
    let fingerprint = Fingerprint::of_json(&json!({"n": 1})).unwrap();
    let started = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let before = thread_count();
    let (max_seen, extender_seen, outcomes) = std::thread::scope(|s| {
        let callers: Vec<_> = keys
            .iter()
            .map(|key| {
                let (store, fingerprint) = (&store, &fingerprint);
                let (started, finished) = (&started, &finished);
                s.spawn(move || {
                    let out = store.execute(
                        key,
                        fingerprint,
                        ExecuteOptions::new().lease(lease),
                        |held: &Lease| {
                            started.fetch_add(1, Ordering::SeqCst);
                            let acquired_until = held.lease_until_ms().unwrap();
                            std::thread::sleep(work);
                            // The work outlived its lease three times over:
                            // the record's deadline moved on meanwhile.
                            let now = store.get(key).unwrap().unwrap();
                            Ok::<_, Failure<String>>((
                                held.token(),
                                now.lease_until_ms() > acquired_until,
                            ))
                        },
                    );
                    finished.fetch_add(1, Ordering::SeqCst);
                    out
                })
            })
            .collect();
        // Sample while the callers run; every one of them is inside its
        // work once `started` reaches CALLERS.
        let mut max_seen = thread_count();
        let mut extender_seen = 0;
        wait_for(|| started.load(Ordering::SeqCst) == CALLERS);
        while finished.load(Ordering::SeqCst) < CALLERS {
            max_seen = max_seen.max(thread_count());
            extender_seen = extender_seen.max(extenders());
            std::thread::sleep(Duration::from_millis(10));
        }
        let outcomes: Vec<_> = callers.into_iter().map(|c| c.join().unwrap()).collect();
        (max_seen, extender_seen, outcomes)
    });
    assert!(
        max_seen <= CALLERS + before + SLACK_THREADS,
        "{max_seen} threads with {CALLERS} callers and {before} before the run"
    );
    // One extender for the store: its threads take turns scheduling and
    // waiting for a batch's answer, at most four of them.
    assert!(
        (1..=4).contains(&extender_seen),
        "{extender_seen} extender threads for the store"
    );
    for (key, out) in keys.iter().zip(outcomes) {
        let out = out.unwrap();
        assert_eq!(out.origin(), Origin::Ran);
        let (token, extended) = *out.value();
        assert!(extended, "{key}: the lease was not extended");
        let record = store.get(key).unwrap().unwrap();
        assert_eq!(record.state(), State::Succeeded);
        assert_eq!(record.token(), token, "{key} was taken over");
        assert_eq!(record.acquisitions(), 1);
    }
    drop(store);
    assert_eq!(extenders(), 0);
}

#[test]
fn a_release_by_someone_else_reaches_the_call_as_a_stale_lease() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("released.redb")).unwrap();
    let key = Key::new("acme/released", "k").unwrap();
    let fingerprint = Fingerprint::of_json(&json!({"n": 1})).unwrap();
    let out = store.execute(
        &key,
        &fingerprint,
        ExecuteOptions::new().lease(Duration::from_millis(100)),
        |held: &Lease| {
            // An operator who holds the token releases the key.
            store
                .release(Lease::from_parts(held.key().clone(), held.token()))
                .unwrap();
            wait_for(|| extension_failures(&key) > 0);
            Ok::<_, Failure<String>>("done".to_string())
        },
    );
    assert!(
        matches!(
            &out,
            Err(ExecuteError::NotRecorded {
                error: Error::StaleLease { .. },
                outcome: Resolution::Succeeded(value),
                ..
            }) if value == br#""done""#
        ),
        "{out:?}"
    );
    assert!(store.get(&key).unwrap().is_none());
    // The failed lease is renewed no more.
    assert_eq!(extension_failures(&key), 1);
}

#[test]
fn a_takeover_reaches_the_call_as_a_stale_lease() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::starting_now();
    let config = Config::new().clock(clock.clone()).sweep_interval(None);
    let store = Store::open_with(dir.path().join("taken.redb"), config).unwrap();
    let key = Key::new("acme/taken", "k").unwrap();
    let fingerprint = Fingerprint::of_json(&json!({"n": 1})).unwrap();
    let mut taker = None;
    let out = store.execute(
        &key,
        &fingerprint,
        ExecuteOptions::new().lease(Duration::from_millis(100)),
        |_held: &Lease| {
            // The store's clock jumps past the lease; another caller takes
            // the key over (again, should a renewal land in between).
            let lease = loop {
                clock.advance(Duration::from_secs(1));
                let options = ClaimOptions::new().lease(Duration::from_secs(60));
                if let ClaimOutcome::Acquired(lease) =
                    store.claim(&key, &fingerprint, &options).unwrap()
                {
                    break lease;
                }
            };
            taker = Some(lease.token());
            wait_for(|| extension_failures(&key) > 0);
            Ok::<_, Failure<String>>("done".to_string())
        },
    );
    assert!(
        matches!(
            &out,
            Err(ExecuteError::NotRecorded {
                error: Error::StaleLease { .. },
                outcome: Resolution::Succeeded(value),
                ..
            }) if value == br#""done""#
        ),
        "{out:?}"
    );
    let record = store.get(&key).unwrap().unwrap();
    assert_eq!(record.state(), State::Processing);
    assert_eq!(Some(record.token()), taker);
    assert_eq!(record.acquisitions(), 2);
}

#[test]
fn the_extender_starts_on_first_need_and_stops_with_the_store() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lifetime.redb");
    let key = Key::new("acme/lifetime", "k").unwrap();
    let fingerprint = Fingerprint::of_json(&json!({"n": 1})).unwrap();
    let run = |store: &Store| {
        store
            .execute(
                &key,
                &fingerprint,
                ExecuteOptions::new().lease(Duration::from_millis(100)),
                |_held: &Lease| {
                    std::thread::sleep(Duration::from_millis(150));
                    Ok::<_, Failure<String>>(7)
                },
            )
            .unwrap()
    };
    assert_eq!(extenders(), 0);
    let store = Store::open(&path).unwrap();
    assert_eq!(extenders(), 0, "no extender before the first call");
    assert_eq!(run(&store).origin(), Origin::Ran);
    assert!((1..=4).contains(&extenders()), "{}", extenders());
    let before_drop = thread_count();
    drop(store);
    assert_eq!(extenders(), 0, "the drop stops the extender");
    assert!(thread_count() < before_drop);

    // A store whose calls only replay never starts one.
    let store = Store::open_with(&path, Config::new()).unwrap();
    assert!(run(&store).is_replayed());
    assert_eq!(extenders(), 0);
}

/// A renewal that reaches the store just after the call's own outcome
/// (the record is finished: it fails as a stale lease) is no loss and logs
/// no warning. Each call's work lasts about one renewal period, so that a
/// renewal is under way while the outcome is written; across the calls,
/// some renewals meet the finished record (each logged a "lease extension
/// failed" warning after a successful call), on the sync and the async
/// forms alike.
#[test]
fn a_renewal_that_meets_the_calls_own_outcome_logs_nothing() {
    let _serial = serial();
    let _ = warnings();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("quiet.redb")).unwrap();
    let fingerprint = Fingerprint::of_json(&json!({"n": 1})).unwrap();
    let lease = Duration::from_millis(100);
    let keys: Vec<Key> = (0..120)
        .map(|i| Key::new("acme/quiet", format!("call-{i}")).unwrap())
        .collect();
    std::thread::scope(|s| {
        for (n, chunk) in keys.chunks(12).enumerate() {
            let (store, fingerprint) = (&store, &fingerprint);
            s.spawn(move || {
                for (i, key) in chunk.iter().enumerate() {
                    // A period and a few milliseconds: the first renewal is
                    // sent about when the outcome is.
                    let work = Duration::from_millis(33 + ((n + i) % 4) as u64);
                    let options = ExecuteOptions::new().lease(lease);
                    let value = if (n + i) % 2 == 0 {
                        store
                            .execute(key, fingerprint, options, |_: &Lease| {
                                std::thread::sleep(work);
                                Ok::<_, Failure<String>>("done".to_string())
                            })
                            .unwrap()
                    } else {
                        futures_lite::future::block_on(store.execute_async(
                            key,
                            fingerprint,
                            options,
                            async move |_: &Lease| {
                                futures_timer::Delay::new(work).await;
                                Ok::<_, Failure<String>>("done".to_string())
                            },
                        ))
                        .unwrap()
                    };
                    assert_eq!(value.into_value(), "done");
                }
            });
        }
    });
    // Renewals under way at the end have been answered once the store
    // drops (the extender thread is joined).
    drop(store);
    let warned: Vec<_> = warnings()
        .lock()
        .unwrap()
        .iter()
        .filter(|e| {
            e.get("key").is_some_and(|k| k.starts_with("acme/quiet"))
                && e.get("message")
                    .is_some_and(|m| m.starts_with("lease extension failed"))
        })
        .cloned()
        .collect();
    assert!(warned.is_empty(), "{} warnings: {warned:?}", warned.len());
}
