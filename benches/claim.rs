//! Criterion benchmarks of idemstore's claim path, through the public API
//! only:
//!
//! - `fresh_claim`: a claim of a key the store has never seen (acquires a
//!   lease; durable when it returns);
//! - `replay_claim`: a claim of a finished key (replays the stored result);
//! - `lifecycle`: a claim of a fresh key, then `complete` under its lease.
//!
//! Each runs from 1, 4, 16 and 64 threads sharing one store, in every
//! durability mode of [`MODES`], on a store that starts with 10 thousand
//! records, and 1 million with `IDEMSTORE_BENCH_LARGE=1`, 10 million with
//! `IDEMSTORE_BENCH_HUGE=1` (its store takes minutes to build and 3 GB of
//! disk, and each group copies it). One iteration is
//! one operation (one lifecycle for `lifecycle`), so the reported throughput
//! is operations per second of all threads together.
//!
//! The starting stores are built once through the public API and cached in
//! `<target dir>/tmp/bench-stores/records-<n>/`; each benchmark runs on a
//! fresh copy of one, so it starts from the same records (fresh claims and
//! lifecycles then add their own keys). Delete that directory to rebuild.
//! A cached store that no longer opens (after a file-format change) is
//! rebuilt. BENCHMARKS.md has the commands and figures.

use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Durability, Fingerprint, Key, Store};

/// Client thread counts.
const THREADS: [usize; 4] = [1, 4, 16, 64];

/// A durability mode: its name in benchmark ids and how it changes the
/// configuration of the store.
struct Mode {
    name: &'static str,
    configure: fn(Config) -> Config,
}

/// The durability modes measured: the default (every acknowledged write
/// fsynced) and buffered (acknowledged before the fsync, flushed within
/// 10 ms).
const MODES: &[Mode] = &[
    Mode {
        name: "immediate",
        configure: |config| config,
    },
    Mode {
        name: "buffered-10ms",
        configure: |config| {
            config.durability(Durability::Buffered {
                max_delay: Duration::from_millis(10),
            })
        },
    },
];

/// Records in the starting store, with the label used in benchmark ids.
const SIZE: (u64, &str) = (10_000, "10k");
/// The large starting store, measured with `IDEMSTORE_BENCH_LARGE=1`.
const LARGE_SIZE: (u64, &str) = (1_000_000, "1m");
/// The huge starting store, measured with `IDEMSTORE_BENCH_HUGE=1`.
const HUGE_SIZE: (u64, &str) = (10_000_000, "10m");

const SCOPE: &str = "bench/tickets.create";
/// The result every complete stores (64 bytes).
const RESULT: &[u8; 64] = b"ticket T-0000000000000000 created; 64 bytes of stored response..";
/// Fresh keys are numbered from here, far above every stored key's number.
const FRESH_BASE: u64 = 1 << 48;
/// How many stored keys a replay benchmark cycles through, in random order.
const REPLAY_KEYS: u64 = 1 << 16;

/// A bijection on u64 with good mixing (SplitMix64's finaliser): distinct
/// numbers give distinct ids, spread over the whole index as real
/// idempotency keys are.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The key numbered `n`.
fn key(n: u64) -> Key {
    Key::new(SCOPE, format!("{:016x}", splitmix64(n))).expect("a valid key")
}

/// One payload's fingerprint, shared by every key (fingerprints are per
/// key), so hashing stays out of the timed loop.
fn fingerprint() -> Fingerprint {
    Fingerprint::of(br#"{"title":"printer on fire"}"#)
}

/// The configuration of every store here: the defaults, with a retention
/// long enough that a cached store never expires.
fn base_config() -> Config {
    Config::new().retention(Duration::from_secs(10 * 365 * 24 * 3600))
}

fn cache_root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-stores")
}

/// Copies every file of directory `from` into `to` (created), each synced,
/// so that the first durable commit does not pay for writing the copy back.
fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            let dest = to.join(entry.file_name());
            std::fs::copy(entry.path(), &dest)?;
            std::fs::File::open(&dest)?.sync_all()?;
        }
    }
    Ok(())
}

/// Runs `iters` operations split over `threads` threads. `setup(thread,
/// count)` prepares a thread's inputs before the clock starts; then every
/// thread starts together and runs `op(&inputs, j)` for `j` in
/// `0..count`. Returns the time from the common start until the last thread
/// finished.
fn run_threads<S>(
    threads: usize,
    iters: u64,
    setup: &(dyn Fn(usize, u64) -> S + Sync),
    op: &(dyn Fn(&S, u64) + Sync),
) -> Duration {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                let count = iters / threads as u64 + u64::from((t as u64) < iters % threads as u64);
                s.spawn(move || {
                    let inputs = setup(t, count);
                    barrier.wait();
                    for j in 0..count {
                        op(&inputs, j);
                    }
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        for h in handles {
            h.join().expect("a benchmark thread panicked");
        }
        start.elapsed()
    })
}

/// The cached starting store of `records` records, built if it is absent
/// or no longer opens. Returns its directory.
fn base_store(records: u64) -> PathBuf {
    let dir = cache_root().join(format!("records-{records}"));
    let marker = dir.join("complete");
    if marker.exists() {
        match Store::open_with(dir.join("idem.redb"), base_config()) {
            Ok(store) if store.len().is_ok_and(|n| n >= records) => return dir,
            Ok(_) => eprintln!("cached store {} is short; rebuilding", dir.display()),
            Err(e) => eprintln!(
                "cached store {} does not open ({e}); rebuilding",
                dir.display()
            ),
        }
    }
    let building = cache_root().join(format!("records-{records}.building"));
    for d in [&dir, &building] {
        if d.exists() {
            std::fs::remove_dir_all(d).expect("remove an old store");
        }
    }
    std::fs::create_dir_all(&building).expect("create the store directory");
    eprintln!(
        "building a store of {records} records in {} (once; it is cached)",
        dir.display()
    );
    let started = Instant::now();
    {
        let store = Store::open_with(building.join("idem.redb"), base_config()).expect("open");
        let next = AtomicU64::new(0);
        let fp = fingerprint();
        std::thread::scope(|s| {
            for _ in 0..64 {
                s.spawn(|| {
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        if n >= records {
                            return;
                        }
                        if n > 0 && n.is_multiple_of((records / 10).max(1)) {
                            eprintln!("  {n} records, {:.0} s", started.elapsed().as_secs_f64());
                        }
                        let ClaimOutcome::Acquired(lease) = store
                            .claim(&key(n), &fp, &ClaimOptions::new())
                            .expect("claim")
                        else {
                            panic!("key {n} was not fresh");
                        };
                        store.complete(&lease, RESULT).expect("complete");
                    }
                });
            }
        });
    }
    std::fs::write(building.join("complete"), records.to_string()).expect("write marker");
    std::fs::rename(&building, &dir).expect("rename the built store");
    eprintln!("built in {:.1} s", started.elapsed().as_secs_f64());
    dir
}

/// A working copy of a starting store, opened in one durability mode, and
/// removed when dropped.
struct Working {
    store: Option<Store>,
    dir: PathBuf,
}

impl Working {
    fn new(base: &Path, mode: &Mode) -> Working {
        let dir = cache_root().join("work");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("remove an old working copy");
        }
        copy_dir(base, &dir).expect("copy the starting store");
        let config = (mode.configure)(base_config());
        let store = Store::open_with(dir.join("idem.redb"), config).expect("open working copy");
        Working {
            store: Some(store),
            dir,
        }
    }

    fn store(&self) -> &Store {
        self.store.as_ref().expect("open until dropped")
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        if let Some(Ok(n)) = self.store.take().map(|store| store.len()) {
            eprintln!("  (the store ended with {n} records)");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    FreshClaim,
    ReplayClaim,
    Lifecycle,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::FreshClaim => "fresh_claim",
            Op::ReplayClaim => "replay_claim",
            Op::Lifecycle => "lifecycle",
        }
    }
}

/// Times `iters` operations of kind `op` from `threads` threads on `store`.
/// `fresh` numbers fresh keys across samples; `replay` is the stored keys a
/// replay claim cycles through.
fn time_op(
    store: &Store,
    op: Op,
    threads: usize,
    iters: u64,
    fresh: &AtomicU64,
    replay: &[Key],
) -> Duration {
    let fp = fingerprint();
    let options = ClaimOptions::new();
    match op {
        Op::ReplayClaim => run_threads(
            threads,
            iters,
            &|t, _| (t as u64).wrapping_mul(7919),
            &|offset, j| {
                let key = &replay[((offset + j) % replay.len() as u64) as usize];
                match store.claim(key, &fp, &options) {
                    Ok(ClaimOutcome::Replay(record)) => {
                        assert_eq!(record.result(), Some(&RESULT[..]));
                    }
                    other => panic!("a replay claim answered {other:?}"),
                }
            },
        ),
        Op::FreshClaim | Op::Lifecycle => run_threads(
            threads,
            iters,
            &|_, count| {
                let first = fresh.fetch_add(count, Ordering::Relaxed);
                (first..first + count).map(key).collect::<Vec<Key>>()
            },
            &|keys, j| {
                let key = &keys[j as usize];
                let lease = match store.claim(key, &fp, &options) {
                    Ok(ClaimOutcome::Acquired(lease)) => lease,
                    other => panic!("a fresh claim answered {other:?}"),
                };
                if op == Op::Lifecycle {
                    store.complete(&lease, RESULT).expect("complete");
                }
            },
        ),
    }
}

fn claims(c: &mut Criterion) {
    let mut sizes = vec![SIZE];
    if std::env::var_os("IDEMSTORE_BENCH_LARGE").is_some_and(|v| v == "1") {
        sizes.push(LARGE_SIZE);
    }
    if std::env::var_os("IDEMSTORE_BENCH_HUGE").is_some_and(|v| v == "1") {
        sizes.push(HUGE_SIZE);
    }
    for (records, label) in sizes {
        let base = base_store(records);
        // Stored keys in random order, for replays.
        let replay: Vec<Key> = (0..REPLAY_KEYS)
            .map(|i| key(splitmix64(i ^ 0x5eed) % records))
            .collect();
        for mode in MODES {
            for op in [Op::FreshClaim, Op::ReplayClaim, Op::Lifecycle] {
                let mut group = c.benchmark_group(format!("{}/{}/{label}", op.name(), mode.name));
                group.throughput(Throughput::Elements(1));
                for threads in THREADS {
                    // Opened on first use, so that a filtered-out benchmark
                    // copies nothing.
                    let mut working: Option<Working> = None;
                    let fresh = AtomicU64::new(FRESH_BASE);
                    group.bench_function(BenchmarkId::new("threads", threads), |b| {
                        let store = working.get_or_insert_with(|| Working::new(&base, mode));
                        b.iter_custom(|iters| {
                            time_op(store.store(), op, threads, iters, &fresh, &replay)
                        });
                    });
                }
                group.finish();
            }
        }
    }
}

criterion_group! {
    name = benches;
    // Small samples keep the default `cargo bench` to a few minutes on a
    // 2-core machine; pass `--measurement-time` and `--sample-size` for more.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = claims
}
criterion_main!(benches);
