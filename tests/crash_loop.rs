//! Crash loop: a child process runs claims and completions on several
//! threads, is killed with SIGKILL at a random moment, and the parent checks
//! the reopened file against what the child acknowledged. Then the next
//! child continues on the same file.
//!
//! The child appends each acknowledgement to a side log and fsyncs it after
//! each line, so a line in the log is a change the store had returned from
//! (durable, by the store's promise) before the kill:
//!
//! - `A <key id> <token>`: `claim` returned Acquired with that token;
//! - `D <key id> <token>`: `complete` returned for that lease, with the
//!   result `r:<key id>:<token>`;
//! - `X <message>`: the child found a wrong answer and stopped.
//!
//! Leases are one hour on a clock that moves 1 ms per cycle, so no lease
//! lapses during the run: every key must be acquired exactly once across all
//! cycles, although every child also claims keys of the previous cycle again.
//!
//! 20 cycles by default; `IDEMSTORE_CRASH_CYCLES=1000` runs more,
//! `IDEMSTORE_CRASH_SEED` changes the seed (printed on failure). Run long
//! loops with release settings: `IDEMSTORE_CRASH_CYCLES=1000 cargo test --profile ci --all-features
//! --test crash_loop -- --nocapture`.

mod common;

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use idemstore::{ClaimOutcome, Config, ManualClock, State, Store};

const NAME: &str = "crash_loop_keeps_every_acknowledged_change";
/// Worker threads in each child.
const THREADS: u64 = 4;
/// The lease of every claim: far longer than any run.
const LEASE: Duration = Duration::from_secs(3600);
/// One in this many acquired keys is left unfinished (Processing).
const LEAVE_UNFINISHED: u64 = 5;
/// One in this many claims goes to a key of the previous cycle.
const RETRY_OLD: u64 = 4;

fn config(clock_ms: u64) -> Config {
    Config::new()
        .clock(ManualClock::new(clock_ms))
        .lease(LEASE)
        .retention(Duration::from_secs(24 * 3600))
        .sweep_interval(None)
}

fn key_id(cycle: u64, index: u64) -> String {
    format!("c{cycle}-k{index}")
}

fn result_of(id: &str, token: u64) -> String {
    format!("r:{id}:{token}")
}

/// Splits `c<cycle>-k<index>`.
fn parse_id(id: &str) -> (u64, u64) {
    let (c, k) = id.split_once("-k").expect("key id");
    (c[1..].parse().expect("cycle"), k.parse().expect("index"))
}

// ---------------------------------------------------------------------------
// The child
// ---------------------------------------------------------------------------

/// The side log, shared by the child's threads: one fsync per line.
struct SideLog(Mutex<std::fs::File>);

impl SideLog {
    fn append(&self, line: &str) {
        let mut file = self.0.lock().unwrap();
        file.write_all(format!("{line}\n").as_bytes()).unwrap();
        file.sync_data().unwrap();
    }
}

fn child() -> ! {
    let path = PathBuf::from(child_var("IDEM_PATH"));
    let log_path = child_var("IDEM_LOG");
    let cycle: u64 = child_var_parsed("IDEM_CYCLE");
    let clock_ms: u64 = child_var_parsed("IDEM_CLOCK_MS");
    let retry_upto: u64 = child_var_parsed("IDEM_RETRY_UPTO");
    let seed: u64 = child_var_parsed("IDEM_SEED");

    let log = Arc::new(SideLog(Mutex::new(
        OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log_path)
            .unwrap(),
    )));
    let store = match Store::open_with(&path, config(clock_ms)) {
        Ok(store) => Arc::new(store),
        Err(err) => {
            log.append(&format!("X cycle {cycle}: open failed: {err}"));
            panic!("open failed: {err}");
        }
    };
    let slots = Arc::new(AtomicU64::new(0));
    for thread in 0..THREADS {
        let store = store.clone();
        let log = log.clone();
        let slots = slots.clone();
        std::thread::spawn(move || {
            let mut rng = Rng::new(seed ^ (thread + 1).wrapping_mul(0x9e37_79b9));
            let work = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                worker(&store, &log, &slots, &mut rng, cycle, retry_upto)
            }));
            // `worker` never returns: only a panic ends it.
            let Err(panic) = work;
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default();
            log.append(&format!("X cycle {cycle} thread {thread}: {msg}").replace('\n', " "));
            std::process::exit(101);
        });
    }
    ready_and_wait()
}

fn worker(
    store: &Store,
    log: &SideLog,
    slots: &AtomicU64,
    rng: &mut Rng,
    cycle: u64,
    retry_upto: u64,
) -> ! {
    loop {
        let id = if cycle > 0 && retry_upto > 0 && rng.one_in(RETRY_OLD) {
            key_id(cycle - 1, rng.below(retry_upto))
        } else {
            // THREADS consecutive slots name the same key: contention.
            key_id(cycle, slots.fetch_add(1, Ordering::Relaxed) / THREADS)
        };
        let k = key(&id);
        match store.claim(&k, &fp(&id), &lease_of(LEASE)) {
            Ok(ClaimOutcome::Acquired(lease)) => {
                log.append(&format!("A {id} {}", lease.token()));
                if !rng.one_in(LEAVE_UNFINISHED) {
                    let result = result_of(&id, lease.token());
                    store
                        .complete(&lease, result.as_bytes())
                        .unwrap_or_else(|e| panic!("complete {id}: {e}"));
                    log.append(&format!("D {id} {}", lease.token()));
                }
            }
            Ok(ClaimOutcome::InProgress { .. }) => {}
            Ok(ClaimOutcome::Replay(rec)) => {
                let want = result_of(&id, rec.token());
                assert_eq!(
                    rec.result(),
                    Some(want.as_bytes()),
                    "replay of {id}: {rec:?}"
                );
            }
            Err(err) => panic!("claim {id}: {err}"),
        }
    }
}

// ---------------------------------------------------------------------------
// The parent
// ---------------------------------------------------------------------------

/// What the side log says was acknowledged for one key.
#[derive(Debug, Clone, Copy)]
struct Ack {
    token: u64,
    completed: bool,
}

/// The parent's model, built from the side log.
#[derive(Default)]
struct Model {
    acks: BTreeMap<String, Ack>,
    /// How far the side log has been read (bytes).
    log_pos: u64,
    /// The largest token acknowledged before the current cycle.
    max_token_before: u64,
    /// Per cycle: the keys probed (indices `0..bound`) and how many exist.
    probe_bound: Vec<u64>,
    existing: Vec<u64>,
    acquired: u64,
    completed: u64,
}

impl Model {
    /// Reads the complete lines the last child appended, checks them, and
    /// cuts a torn last line off the log so the next child starts clean.
    /// Returns the ids acknowledged in those lines.
    fn read_log(&mut self, log_path: &Path, cycle: u64) -> Vec<String> {
        let bytes = std::fs::read(log_path).unwrap_or_default();
        let new = &bytes[usize::try_from(self.log_pos).unwrap()..];
        let complete_len = new.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let text = std::str::from_utf8(&new[..complete_len]).expect("UTF-8 log");
        let mut touched = Vec::new();
        let mut max_token = self.max_token_before;
        for line in text.lines() {
            let mut parts = line.split(' ');
            match parts.next() {
                Some("X") => panic!("the child of cycle {cycle} failed: {line}"),
                Some("A") => {
                    let id = parts.next().unwrap().to_string();
                    let token: u64 = parts.next().unwrap().parse().unwrap();
                    assert!(
                        token > self.max_token_before,
                        "cycle {cycle}: token {token} of {id} is not above {} (acknowledged before)",
                        self.max_token_before
                    );
                    if let Some(prev) = self.acks.get(&id) {
                        panic!(
                            "cycle {cycle}: {id} acquired twice while its lease was valid \
                             (tokens {} and {token})",
                            prev.token
                        );
                    }
                    self.acks.insert(
                        id.clone(),
                        Ack {
                            token,
                            completed: false,
                        },
                    );
                    self.acquired += 1;
                    max_token = max_token.max(token);
                    touched.push(id);
                }
                Some("D") => {
                    let id = parts.next().unwrap().to_string();
                    let token: u64 = parts.next().unwrap().parse().unwrap();
                    let ack = self
                        .acks
                        .get_mut(&id)
                        .unwrap_or_else(|| panic!("cycle {cycle}: {id} completed, never acquired"));
                    assert_eq!(
                        ack.token, token,
                        "cycle {cycle}: {id} completed by another token"
                    );
                    ack.completed = true;
                    self.completed += 1;
                    touched.push(id);
                }
                _ => panic!("cycle {cycle}: bad log line {line:?}"),
            }
        }
        self.max_token_before = max_token;
        if complete_len < new.len() {
            let file = OpenOptions::new().write(true).open(log_path).unwrap();
            file.set_len(self.log_pos + complete_len as u64).unwrap();
            file.sync_all().unwrap();
        }
        self.log_pos += complete_len as u64;
        touched
    }
}

/// Checks one acknowledged key against the store.
fn check_ack(store: &Store, id: &str, ack: Ack, cycle: u64) {
    let k = key(id);
    let rec = store
        .get(&k)
        .unwrap_or_else(|e| panic!("cycle {cycle}: get {id}: {e}"))
        .unwrap_or_else(|| panic!("cycle {cycle}: acknowledged {id} ({ack:?}) is missing"));
    assert_eq!(rec.acquisitions(), 1, "cycle {cycle}: {id}: {rec:?}");
    assert!(
        rec.token() >= ack.token,
        "cycle {cycle}: {id}: token went back: {rec:?}, acknowledged {ack:?}"
    );
    let claim = store
        .claim(&k, &fp(id), &lease_of(LEASE))
        .unwrap_or_else(|e| panic!("cycle {cycle}: claim {id}: {e}"));
    if ack.completed {
        assert_eq!(
            rec.state(),
            State::Succeeded,
            "cycle {cycle}: {id}: {rec:?}"
        );
        assert_eq!(rec.token(), ack.token, "cycle {cycle}: {id}");
        match claim {
            ClaimOutcome::Replay(replayed) => assert_eq!(
                replayed.result(),
                Some(result_of(id, ack.token).as_bytes()),
                "cycle {cycle}: {id}"
            ),
            other => panic!("cycle {cycle}: completed {id} claimed as {other:?}"),
        }
    } else {
        match (rec.state(), claim) {
            (State::Processing, ClaimOutcome::InProgress { lease_until_ms, .. }) => {
                assert_eq!(lease_until_ms, rec.lease_until_ms());
            }
            (State::Succeeded, ClaimOutcome::Replay(replayed)) => assert_eq!(
                replayed.result(),
                Some(result_of(id, rec.token()).as_bytes()),
                "cycle {cycle}: {id}"
            ),
            (state, other) => {
                panic!("cycle {cycle}: acquired {id} is {state:?}, claimed as {other:?}")
            }
        }
    }
}

/// Checks every record among keys `0..bound` of `of_cycle`: acquired once,
/// in a state a claim and a completion can leave. Returns how many exist and
/// the highest existing index.
fn probe(store: &Store, of_cycle: u64, bound: u64, cycle: u64) -> (u64, Option<u64>) {
    let mut count = 0;
    let mut highest = None;
    for index in 0..bound {
        let id = key_id(of_cycle, index);
        let Some(rec) = store
            .get(&key(&id))
            .unwrap_or_else(|e| panic!("cycle {cycle}: get {id}: {e}"))
        else {
            continue;
        };
        count += 1;
        highest = Some(index);
        assert_eq!(
            rec.acquisitions(),
            1,
            "cycle {cycle}: {id} acquired twice: {rec:?}"
        );
        match rec.state() {
            State::Processing => {}
            State::Succeeded => assert_eq!(
                rec.result(),
                Some(result_of(&id, rec.token()).as_bytes()),
                "cycle {cycle}: {id}"
            ),
            other => panic!("cycle {cycle}: {id} is {other:?}"),
        }
    }
    (count, highest)
}

fn verify_everything(store: &Store, model: &Model, cycle: u64) {
    for (id, ack) in &model.acks {
        check_ack(store, id, *ack, cycle);
    }
}

#[test]
fn crash_loop_keeps_every_acknowledged_change() {
    if child_role(NAME) {
        child();
    }
    let cycles = count_from_env("IDEMSTORE_CRASH_CYCLES", 20) as u64;
    let seed = seed_from_env("IDEMSTORE_CRASH_SEED", 0xc0ffee);
    let t = TestDir::new();
    let log_path = t.dir.path().join("acks.log");
    let t0 = t.now_ms();
    let mut rng = Rng::new(seed);
    let mut model = Model::default();
    let started = Instant::now();
    let mut killed_before_ready = 0;

    for cycle in 0..cycles {
        let clock_ms = t0 + cycle;
        // Keys of the previous cycle this child may claim again: every
        // index that exists, and a few that do not (those it may acquire).
        let retry_upto = match cycle {
            0 => 0,
            _ => model.probe_bound[usize::try_from(cycle - 1).unwrap()],
        };
        let mut child = spawn_child(
            NAME,
            &[
                ("IDEM_PATH", path_var(&t.path)),
                ("IDEM_LOG", path_var(&log_path)),
                ("IDEM_CYCLE", cycle.to_string()),
                ("IDEM_CLOCK_MS", clock_ms.to_string()),
                ("IDEM_RETRY_UPTO", retry_upto.to_string()),
                (
                    "IDEM_SEED",
                    (seed ^ cycle.wrapping_mul(0x2545_f491)).to_string(),
                ),
            ],
        );
        if rng.one_in(5) {
            // Kill it while it starts, opens or recovers the file.
            std::thread::sleep(ms(rng.below(40)));
            if !child.is_ready() {
                killed_before_ready += 1;
            }
        } else {
            child.wait_ready();
            std::thread::sleep(ms(rng.below(150)));
        }
        child.assert_running();
        child.kill();

        let touched = model.read_log(&log_path, cycle);
        let store = match Store::open_with(&t.path, config(clock_ms)) {
            Ok(store) => store,
            Err(err) => panic!("seed {seed}, cycle {cycle}: reopen after SIGKILL failed: {err}"),
        };
        for id in &touched {
            check_ack(&store, id, model.acks[id], cycle);
        }

        // Probe the keys this child could have written: this cycle's and,
        // again, the previous cycle's.
        let max_logged = touched
            .iter()
            .map(|id| parse_id(id))
            .filter(|(c, _)| *c == cycle)
            .map(|(_, i)| i + 1)
            .max()
            .unwrap_or(0);
        // At most one acquisition per thread is in flight unlogged, so no key
        // past the highest logged one by more than THREADS exists; probe
        // further than that.
        let bound = max_logged + 2 * THREADS + 8;
        let (count, highest) = probe(&store, cycle, bound, cycle);
        model
            .probe_bound
            .push(bound.max(highest.map_or(0, |h| h + 1) + 4));
        model.existing.push(count);
        if cycle > 0 {
            let prev = usize::try_from(cycle - 1).unwrap();
            let (count, highest) = probe(&store, cycle - 1, model.probe_bound[prev], cycle);
            model.existing[prev] = count;
            model.probe_bound[prev] = model.probe_bound[prev].max(highest.map_or(0, |h| h + 1) + 4);
        }
        // No record exists outside the probed keys.
        let total: u64 = model.existing.iter().sum();
        assert_eq!(
            store.len().unwrap(),
            total,
            "seed {seed}, cycle {cycle}: records outside the probed keys"
        );
        // The state counts and the expiry entries that `stats` reads were
        // derived again by the log's replay: they agree with the records.
        let report = store.verify(|_| {}).unwrap();
        assert!(report.is_clean(), "seed {seed}, cycle {cycle}: {report:?}");
        let stats = store.stats().unwrap();
        assert_eq!(
            stats.records.total(),
            total,
            "seed {seed}, cycle {cycle}: {stats:?}"
        );
        if cycle % 50 == 49 {
            verify_everything(&store, &model, cycle);
        }
        drop(store);
    }

    let store = Store::open_with(&t.path, config(t0 + cycles)).unwrap();
    verify_everything(&store, &model, cycles);
    let total: u64 = model.existing.iter().sum();
    assert_eq!(store.len().unwrap(), total);
    // Work was done: the loop is not vacuous.
    assert!(model.completed > 0, "no completion was acknowledged");
    eprintln!(
        "seed {seed}: {cycles} cycles ({killed_before_ready} killed before ready) in {:.1?}: \
         {} acquisitions and {} completions acknowledged, {total} records, all present",
        started.elapsed(),
        model.acquired,
        model.completed
    );
}
