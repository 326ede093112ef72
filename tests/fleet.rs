//! A fleet on one PostgreSQL database (feature `postgres`): several
//! processes, a server that dies, connections that are cut.
//!
//! - **Several nodes, one database**: 3 processes × 32 threads claim the
//!   same 1,000 keys, each process with its wall clock skewed (-5 s, 0,
//!   +5 s, through `faketime` when it is installed: the store reads the
//!   database's clock, so the skew must change nothing). Each node's wall
//!   clock is checked against the database's: the test fails if faketime
//!   is installed and a node's skew is not the one intended. Every key
//!   ends with exactly one acquisition per lease period and tokens that
//!   grow per key.
//! - **The server killed**: an immediate shutdown (SIGQUIT to the
//!   postmaster, `pg_ctl stop -m immediate`) of a server with fsync on,
//!   while 64 threads run lifecycles, then a restart: every acknowledged
//!   claim and completion is there, nothing was acknowledged twice, and
//!   every call in flight got `Unavailable` or `OutcomeUnknown`.
//! - **Connections cut mid-transaction** (`pg_terminate_backend`): a
//!   `claim_many` batch is applied whole or not at all.
//!
//! The servers are throwaway ones (`tests/pg`); `IDEMSTORE_SKIP_POSTGRES=1`
//! skips these tests.

mod common;
mod pg;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{child_role, child_var, child_var_parsed, ready_and_wait, report, spawn_child};
use idemstore::postgres::server::{ServerOptions, TestServer};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, Key, State, Store};

const NODES: usize = 3;
const THREADS: usize = 32;
const KEYS: usize = 1_000;
/// The wall-clock skew of each node, applied with `faketime` (its
/// `FAKETIME` spec, and the same in ms).
const SKEWS: [(&str, i64); NODES] = [("-5s", -5_000), ("+0s", 0), ("+5s", 5_000)];

fn key(i: usize) -> Key {
    Key::new("fleet/tickets", format!("k{i}")).expect("key")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of(b"the same request")
}

fn fleet_config(schema: &str) -> Config {
    Config::new()
        .postgres_schema(schema)
        .postgres_connections(8)
        // Long enough that no lease lapses inside the run: every
        // acquisition after the first follows a retryable failure.
        .lease(Duration::from_secs(300))
        .sweep_interval(None)
}

/// Whether `faketime` (libfaketime) is on this machine. The spec goes
/// through `-f` (libfaketime's own `FAKETIME` format, as the nodes get
/// it): faketime 0.9.10 refuses a bare `+0s`, which it hands to `date`.
fn faketime() -> bool {
    std::process::Command::new("faketime")
        .args(["-f", "+0s", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The wall clock, ms since the epoch.
fn wall_ms() -> i64 {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_millis();
    i64::try_from(ms).expect("fits")
}

/// In a node: its wall clock read just before and just after one reading
/// of the database's clock (which no skew touches), reported as
/// `wall_before`, `db_now` and `wall_after`.
fn report_clocks(url: &str) {
    use idemstore::postgres::tokio_postgres::{self, NoTls};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
        tokio::spawn(connection);
        let clock = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
        client.query_one(clock, &[]).await.expect("warm up");
        let before = wall_ms();
        let db: i64 = client.query_one(clock, &[]).await.expect("clock").get(0);
        let after = wall_ms();
        report("wall_before", before);
        report("db_now", db);
        report("wall_after", after);
    });
}

/// One node: 32 threads walk the 1,000 keys in orders of their own until
/// each thread has seen every key finished; an acquisition fails
/// retryably one time in four, else completes. Reports each acquisition
/// as `acq<n>=<key>:<token>:<c|f>`.
fn run_node(url: &str, schema: &str, node: usize) {
    let store = Store::connect(url, fleet_config(schema)).expect("connect");
    let reported = AtomicU64::new(0);
    let unexpected = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (store, reported, unexpected) = (&store, &reported, &unexpected);
            s.spawn(move || {
                let mut rng = common::Rng::new((node * 1_000 + t) as u64 + 1);
                let mut todo: Vec<usize> = (0..KEYS).collect();
                // A shuffle of the thread's own.
                for i in (1..todo.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    todo.swap(i, j);
                }
                while let Some(k) = todo.pop() {
                    match store.claim(&key(k), &fingerprint(), &ClaimOptions::new()) {
                        Ok(ClaimOutcome::Acquired(lease)) => {
                            let fail = rng.one_in(4);
                            let ended = if fail {
                                store.fail(&lease, b"try again", true).map(drop)
                            } else {
                                store
                                    .complete(&lease, lease.token().to_string().as_bytes())
                                    .map(drop)
                            };
                            match ended {
                                Ok(()) => {
                                    let n = reported.fetch_add(1, Ordering::Relaxed);
                                    let how = if fail { 'f' } else { 'c' };
                                    report(
                                        &format!("acq{n}"),
                                        format!("{k}:{}:{how}", lease.token()),
                                    );
                                }
                                Err(e) => unexpected.lock().unwrap().push(format!("{k}: end: {e}")),
                            }
                            if fail {
                                todo.insert(0, k);
                            }
                        }
                        Ok(ClaimOutcome::InProgress { .. }) => todo.insert(0, k),
                        Ok(ClaimOutcome::Replay(_)) => {}
                        Err(e) => unexpected.lock().unwrap().push(format!("{k}: claim: {e}")),
                    }
                }
            });
        }
    });
    let unexpected = unexpected.into_inner().unwrap();
    report("unexpected", unexpected.len());
    for (i, u) in unexpected.iter().take(10).enumerate() {
        report(&format!("unexpected{i}"), u);
    }
}

#[test]
fn several_nodes_one_database() {
    if child_role("several_nodes_one_database") {
        let node: usize = child_var_parsed("FLEET_NODE");
        report_clocks(&child_var("FLEET_URL"));
        run_node(&child_var("FLEET_URL"), &child_var("FLEET_SCHEMA"), node);
        ready_and_wait();
    }
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("fleet");
    // The schema is created once, before the nodes race for their keys.
    drop(Store::connect(&url, fleet_config(&schema)).expect("connect"));
    let skewed = faketime();
    if !skewed {
        eprintln!(
            "faketime is not installed (or refuses `faketime -f +0s true`): the nodes run \
             with the machine's clock"
        );
    }
    let mut children: Vec<_> = (0..NODES)
        .map(|node| {
            let mut vars = vec![
                ("FLEET_URL", url.clone()),
                ("FLEET_SCHEMA", schema.clone()),
                ("FLEET_NODE", node.to_string()),
            ];
            if skewed {
                // libfaketime moves the wall clock only: timers keep the
                // real monotonic clock.
                let lib = faketime_lib();
                vars.push(("LD_PRELOAD", lib));
                vars.push(("FAKETIME", SKEWS[node].0.to_string()));
                vars.push(("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()));
            }
            spawn_child("several_nodes_one_database", &vars)
        })
        .collect();
    // key -> [(token, ended with a retryable failure)]
    let mut acquisitions: BTreeMap<usize, Vec<(u64, bool)>> = BTreeMap::new();
    for (node, child) in children.iter_mut().enumerate() {
        let reports = child.wait_ready();
        // The node's wall clock is skewed as intended: the database's
        // reading (unskewed, on this machine's clock) falls between the
        // node's two wall readings less the skew (1 ms either way for the
        // truncation to ms).
        let get = |name: &str| -> i64 {
            reports
                .get(name)
                .unwrap_or_else(|| panic!("node {node} did not report {name}"))
                .parse()
                .expect("a time")
        };
        let (before, db, after) = (get("wall_before"), get("db_now"), get("wall_after"));
        let skew = if skewed { SKEWS[node].1 } else { 0 };
        assert!(
            before - skew - 1 <= db && db <= after - skew + 1,
            "node {node}: its wall clock read {before}..{after} around the database's {db}: \
             a skew of {} ms, not the {skew} ms intended",
            (before + after) / 2 - db
        );
        assert_eq!(
            reports.get("unexpected").map(String::as_str),
            Some("0"),
            "a node got unexpected answers: {reports:?}"
        );
        for (name, value) in &reports {
            if !name.starts_with("acq") {
                continue;
            }
            let mut parts = value.split(':');
            let k: usize = parts.next().unwrap().parse().unwrap();
            let token: u64 = parts.next().unwrap().parse().unwrap();
            let failed = parts.next() == Some("f");
            acquisitions.entry(k).or_default().push((token, failed));
        }
    }
    drop(children);
    let store = Store::connect(&url, fleet_config(&schema)).expect("connect");
    let mut all_tokens = HashSet::new();
    for k in 0..KEYS {
        let mut acq = acquisitions.remove(&k).unwrap_or_default();
        acq.sort();
        for (token, _) in &acq {
            assert!(all_tokens.insert(*token), "token {token} handed out twice");
        }
        // One acquisition per lease period: each but the last ended with a
        // retryable failure, which opened the next period; the last
        // completed. Tokens grow with each.
        let (last, earlier) = acq
            .split_last()
            .unwrap_or_else(|| panic!("key {k} never acquired"));
        assert!(
            !last.1,
            "key {k}: the last acquisition must be the completion"
        );
        assert!(
            earlier.iter().all(|(_, failed)| *failed),
            "key {k}: two completions: {acq:?}"
        );
        let record = store.get(&key(k)).expect("get").expect("present");
        assert_eq!(record.state(), State::Succeeded, "key {k}");
        assert_eq!(
            record.token(),
            last.0,
            "key {k}: the completing holder's token"
        );
        assert_eq!(record.result(), Some(last.0.to_string().as_bytes()));
        assert_eq!(
            u64::from(record.acquisitions()),
            acq.len() as u64,
            "key {k}: acquisitions recorded vs acknowledged"
        );
    }
}

/// Where libfaketime's preload library is (Debian's path first).
fn faketime_lib() -> String {
    for dir in [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ] {
        let lib = format!("{dir}/libfaketime.so.1");
        if std::path::Path::new(&lib).exists() {
            return lib;
        }
    }
    panic!("faketime is installed but libfaketime.so.1 was not found");
}

/// What the lifecycle threads saw while the server died and came back.
#[derive(Default)]
struct Seen {
    /// key -> token of an acknowledged claim.
    claimed: HashMap<usize, u64>,
    /// key -> token of an acknowledged completion.
    completed: HashMap<usize, u64>,
    /// Calls that failed with one of the two errors a lost server gives.
    lost: u64,
    unexpected: Vec<String>,
}

/// Counts a thread as finished when it ends, however it ends.
struct Finished<'a>(&'a AtomicU64);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_killed_server_loses_nothing_acknowledged() {
    if pg::url().is_none() {
        return;
    }
    let server = TestServer::start_own(ServerOptions {
        fsync: true,
        ..ServerOptions::default()
    })
    .expect("a server");
    let schema = pg::schema("killed");
    let config = || fleet_config(&schema).postgres_connections(16);
    let store = Store::connect(server.url(), config()).expect("connect");
    let seen = Mutex::new(Seen::default());
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let restarted = AtomicBool::new(false);
    let finished = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..64 {
            let (store, seen, next, stop, restarted, finished) =
                (&store, &seen, &next, &stop, &restarted, &finished);
            s.spawn(move || {
                let _done = Finished(finished);
                let mut after_restart = 0;
                while !stop.load(Ordering::SeqCst) {
                    let k = next.fetch_add(1, Ordering::SeqCst) as usize;
                    let outcome = store.claim(&key(k), &fingerprint(), &ClaimOptions::new());
                    let lease = match outcome {
                        Ok(ClaimOutcome::Acquired(lease)) => lease,
                        Ok(other) => {
                            seen.lock()
                                .unwrap()
                                .unexpected
                                .push(format!("{k}: {other:?}"));
                            continue;
                        }
                        Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. }) => {
                            seen.lock().unwrap().lost += 1;
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        Err(e) => {
                            seen.lock()
                                .unwrap()
                                .unexpected
                                .push(format!("{k}: claim: {e}"));
                            continue;
                        }
                    };
                    seen.lock().unwrap().claimed.insert(k, lease.token());
                    match store.complete(&lease, b"done") {
                        Ok(_) => {
                            seen.lock().unwrap().completed.insert(k, lease.token());
                        }
                        Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. }) => {
                            seen.lock().unwrap().lost += 1;
                        }
                        Err(e) => seen
                            .lock()
                            .unwrap()
                            .unexpected
                            .push(format!("{k}: complete: {e}")),
                    }
                    if restarted.load(Ordering::SeqCst) {
                        after_restart += 1;
                        if after_restart >= 20 {
                            return;
                        }
                    }
                }
            });
        }
        // Let lifecycles run, kill the server in the middle of them, and
        // bring it back.
        while next.load(Ordering::SeqCst) < 2_000 {
            std::thread::sleep(Duration::from_millis(10));
        }
        server.kill().expect("kill the server");
        std::thread::sleep(Duration::from_millis(500));
        server.restart().expect("restart the server");
        restarted.store(true, Ordering::SeqCst);
        // The threads end once each has done 20 lifecycles after the
        // restart; a minute is the most they get.
        let started = std::time::Instant::now();
        while finished.load(Ordering::SeqCst) < 64 && started.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::SeqCst);
    });
    drop(store);
    let seen = seen.into_inner().unwrap();
    assert!(
        seen.unexpected.is_empty(),
        "unexpected answers: {:?}",
        &seen.unexpected[..seen.unexpected.len().min(10)]
    );
    assert!(seen.lost > 0, "no call was in flight when the server died");
    assert_eq!(
        finished.load(Ordering::SeqCst),
        64,
        "every thread ran 20 lifecycles after the restart (the engine reconnects)"
    );
    let store = Store::connect(server.url(), config()).expect("connect after the restart");
    let tokens: HashSet<u64> = seen.claimed.values().copied().collect();
    assert_eq!(
        tokens.len(),
        seen.claimed.len(),
        "a token was acknowledged twice"
    );
    for (k, token) in &seen.claimed {
        let record = store
            .get(&key(*k))
            .expect("get")
            .unwrap_or_else(|| panic!("key {k}: an acknowledged claim is gone"));
        assert_eq!(record.token(), *token, "key {k}");
        if seen.completed.contains_key(k) {
            assert_eq!(
                record.state(),
                State::Succeeded,
                "key {k}: an acknowledged completion is gone"
            );
        }
    }
    assert!(
        seen.completed.len() > 2_000,
        "too few lifecycles completed: {}",
        seen.completed.len()
    );
}

#[test]
fn a_cut_connection_applies_a_batch_whole_or_not_at_all() {
    if pg::url().is_none() {
        return;
    }
    // A server of its own: the cuts must not reach other tests' stores.
    let server = TestServer::start_own(ServerOptions::default()).expect("a server");
    let url = server.url().to_string();
    let schema = pg::schema("cut");
    let store =
        Store::connect(&url, fleet_config(&schema).postgres_connections(2)).expect("connect");
    let stop = AtomicBool::new(false);
    let batches: Mutex<Vec<(usize, Result<(), String>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        // Cut every connection of this store's application name again and
        // again from another connection.
        s.spawn(|| {
            let mut cut = 0;
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(15));
                cut += terminate_backends(&url);
            }
            assert!(cut > 0, "no connection was cut");
        });
        for b in 0..60 {
            let claims: Vec<(Key, Fingerprint)> = (0..400)
                .map(|i| (key(b * 1_000 + i), fingerprint()))
                .collect();
            let result = match store.claim_many(&claims, &ClaimOptions::new()) {
                Ok(outcomes) => {
                    assert!(
                        outcomes
                            .iter()
                            .all(|o| matches!(o, Ok(ClaimOutcome::Acquired(_)))),
                        "batch {b}: {:?}",
                        outcomes
                            .iter()
                            .find(|o| !matches!(o, Ok(ClaimOutcome::Acquired(_))))
                    );
                    Ok(())
                }
                Err(e @ (Error::Unavailable { .. } | Error::OutcomeUnknown { .. })) => {
                    Err(format!("{e:?}"))
                }
                Err(e) => panic!("batch {b}: unexpected error {e}"),
            };
            batches.lock().unwrap().push((b, result));
        }
        stop.store(true, Ordering::SeqCst);
    });
    let batches = batches.into_inner().unwrap();
    let mut failed = 0;
    for (b, result) in &batches {
        let present = (0..400)
            .filter(|i| store_has(&url, &schema, &key(b * 1_000 + i)))
            .count();
        match result {
            Ok(()) => assert_eq!(present, 400, "batch {b}: acknowledged but not all there"),
            Err(e) if e.starts_with("Unavailable") => {
                failed += 1;
                assert_eq!(
                    present, 0,
                    "batch {b}: not applied, yet {present} keys are there"
                );
            }
            Err(_) => {
                failed += 1;
                assert!(
                    present == 0 || present == 400,
                    "batch {b}: half applied ({present} of 400)"
                );
            }
        }
    }
    assert!(failed > 0, "no batch met a cut connection");
}

/// Whether `key` has a record, read through a store of its own (the
/// store under test may be between connections).
fn store_has(url: &str, schema: &str, key: &Key) -> bool {
    static READER: Mutex<Option<(String, Store)>> = Mutex::new(None);
    let mut reader = READER.lock().unwrap();
    if reader.as_ref().is_none_or(|(s, _)| s != schema) {
        let store =
            Store::connect(url, fleet_config(schema).postgres_connections(1)).expect("connect");
        *reader = Some((schema.to_string(), store));
    }
    let (_, store) = reader.as_ref().unwrap();
    store.get(key).expect("get").is_some()
}

/// Terminates every backend of an idemstore connection (application name
/// `idemstore`) but the caller's; returns how many.
fn terminate_backends(url: &str) -> usize {
    let out = std::process::Command::new("psql")
        .args([
            url,
            "-qAtc",
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'idemstore' AND pid <> pg_backend_pid()",
        ])
        .output()
        .expect("psql");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}
