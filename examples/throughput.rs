//! A quick throughput check of the write path: claim + complete lifecycles
//! per second at a given number of threads, against the fsync floor (a
//! group-commit writer that only appends each batch to a preallocated file
//! and fdatasyncs it, with no index).
//!
//! ```text
//! cargo run --release --example throughput -- --threads 64 --seconds 3 store
//! cargo run --release --example throughput -- --threads 64 --seconds 3 floor
//! ```
//!
//! This is a rough gauge for development; `idemstore-peers/src/main.rs` is the full
//! benchmark against other stores.
//!
//! On an existing store (one that `examples/open_time.rs --build N` made):
//! lifecycles on fresh keys of a scope of their own, and replays of a hot
//! set of its finished keys (`key-0` up to `--hot`, in random order), to
//! compare a large store with a small one:
//!
//! ```text
//! cargo run --release --example throughput -- --threads 64 --store /tmp/open-10m/idem.redb store
//! cargo run --release --example throughput -- --threads 2 --hot 65536 --store /tmp/open-10m/idem.redb replay
//! ```
//!
//! And the cost of a sweep per evicted record: `--expire N` lifecycles
//! written with a retention of 1 ms (64 threads), their keys spread over
//! the whole store (`key-<n>-x<i>`, each next to `key-<n>`, `n` random
//! below `--hot`), then swept in steps of 10,000 until none is due; prints
//! the sweep's time per evicted record:
//!
//! ```text
//! cargo run --release --example throughput -- --expire 100000 --hot 10000000 --store /tmp/open-10m/idem.redb sweep
//! ```

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Durability, Fingerprint, Key, Store};

#[derive(Parser)]
struct Args {
    /// Client threads.
    #[arg(long, default_value_t = 64)]
    threads: usize,
    /// How long to run (seconds).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Directory under which a fresh temporary directory holds the files
    /// (the system's temporary directory when absent).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Buffered durability with this max delay in ms (store only).
    #[arg(long)]
    buffered_ms: Option<u64>,
    /// An existing store file to run on (store and replay) instead of a
    /// new one in a temporary directory.
    #[arg(long)]
    store: Option<PathBuf>,
    /// Replay: how many of the store's finished keys (`key-0` up to this)
    /// the threads claim, in random order.
    #[arg(long, default_value_t = 65_536)]
    hot: u64,
    /// Store: spread the fresh keys over an existing store's keys
    /// (`key-<n>-s<thread>-<i>`, next to a random one of `key-0` up to this)
    /// instead of a scope of the run's own, as keys that hash anywhere in
    /// the index do.
    #[arg(long)]
    spread: Option<u64>,
    /// redb's page cache in MiB (`Config::cache_bytes`; the default, 64,
    /// when absent).
    #[arg(long)]
    cache_mib: Option<usize>,
    /// Sweep: how many records to write expired and then sweep.
    #[arg(long, default_value_t = 100_000)]
    expire: u64,
    /// What to measure.
    what: What,
}

#[derive(Clone, Copy, ValueEnum)]
enum What {
    /// idemstore with its default configuration.
    Store,
    /// The fsync floor: append each batch to a preallocated file, fdatasync.
    Floor,
    /// Replays of finished keys of an existing store (`--store`).
    Replay,
    /// Sweeps of records written expired among the store's keys.
    Sweep,
}

/// The configuration of a store that `open_time --build` made: ten years of
/// retention, so that its records never expire.
fn config(buffered_ms: Option<u64>) -> Config {
    let mut config = Config::new()
        .retention(Duration::from_secs(10 * 365 * 24 * 3600))
        .sweep_interval(None);
    if let Some(ms) = buffered_ms {
        config = config.durability(Durability::Buffered {
            max_delay: Duration::from_millis(ms),
        });
    }
    config
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let tmp = match &args.dir {
        Some(parent) => tempfile::tempdir_in(parent)?,
        None => tempfile::tempdir()?,
    };
    let dir = tmp.path().to_path_buf();
    let run_for = Duration::from_secs_f64(args.seconds);
    let path = args.store.clone().unwrap_or_else(|| dir.join("bench.redb"));
    let (done, elapsed) = match args.what {
        What::Store => run_store(&path, &args, run_for)?,
        What::Floor => run_floor(&dir, args.threads, run_for)?,
        What::Replay => {
            let Some(path) = &args.store else {
                return Err("replay needs --store (a store open_time --build made)".into());
            };
            run_replay(path, args.threads, run_for, args.hot)?
        }
        What::Sweep => run_sweep(&path, args.expire, args.hot)?,
    };
    let rate = done as f64 / elapsed.as_secs_f64();
    let (name, unit) = match args.what {
        What::Store => ("store", "lifecycles"),
        What::Floor => ("floor", "lifecycles"),
        What::Replay => ("replay", "replays"),
        What::Sweep => ("sweep", "evicted"),
    };
    println!(
        "{name} threads={} {unit}={done} seconds={:.2} {unit}_per_s={rate:.0}",
        args.threads,
        elapsed.as_secs_f64(),
    );
    if let What::Sweep = args.what {
        println!(
            "sweep us_per_evicted={:.2}",
            elapsed.as_secs_f64() * 1e6 / done.max(1) as f64
        );
    }
    Ok(())
}

/// A stateless random number of (thread, step): splitmix64.
fn mix(t: usize, i: u64) -> u64 {
    let mut x = ((t as u64) << 40 ^ i).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Writes `expire` lifecycles with a retention of 1 ms, their keys spread
/// among `open_time`'s (`key-<n>-x<i>`, `n` below `spread`), then times
/// sweeps of 10,000 until none is due: (evicted, the sweeps' time).
fn run_sweep(
    path: &std::path::Path,
    expire: u64,
    spread: u64,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    let store = Store::open_with(path, config(None).retention(Duration::from_millis(1)))?;
    let fp = Fingerprint::of(b"payload");
    let opts = ClaimOptions::new();
    let next = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..64 {
            let (store, fp, opts, next) = (&store, &fp, &opts, &next);
            s.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= expire {
                        return;
                    }
                    let n = mix(t, i) % spread.max(1);
                    let key = Key::new("bench", format!("key-{n:012}-x{i}")).expect("key");
                    match store.claim(&key, fp, opts).expect("claim") {
                        ClaimOutcome::Acquired(lease) => {
                            store.complete(&lease, b"result-bytes").expect("complete");
                        }
                        other => panic!("fresh key not acquired: {other:?}"),
                    }
                }
            });
        }
    });
    std::thread::sleep(Duration::from_millis(20));
    let started = Instant::now();
    let mut evicted = 0u64;
    loop {
        let n = store.sweep(10_000)?;
        evicted += n as u64;
        if n == 0 {
            return Ok((evicted, started.elapsed()));
        }
    }
}

fn run_replay(
    path: &std::path::Path,
    threads: usize,
    run_for: Duration,
    hot: u64,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    let store = Store::open_with(path, config(None))?;
    // open_time's fingerprint and keys.
    let fp = Fingerprint::of(br#"{"title":"printer on fire"}"#);
    let opts = ClaimOptions::new();
    let keys: Vec<Key> = (0..hot)
        .map(|n| Key::new("bench", format!("key-{n:012}")).expect("key"))
        .collect();
    Ok(drive(threads, run_for, |t, i| {
        // Random order without a dependency.
        let key = &keys[(mix(t, i) % hot) as usize];
        match store.claim(key, &fp, &opts).expect("claim") {
            ClaimOutcome::Replay(_) => {}
            other => panic!("a finished key not replayed: {other:?}"),
        }
    }))
}

/// Runs `op` back to back on `threads` client threads for `run_for`;
/// `op(t, i)` is thread `t`'s `i`-th operation. Returns how many ran and
/// the time they took.
fn drive(threads: usize, run_for: Duration, op: impl Fn(usize, u64) + Sync) -> (u64, Duration) {
    let stop = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, count, op) = (&stop, &count, &op);
            s.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    op(t, i);
                    i += 1;
                    count.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        std::thread::sleep(run_for);
        stop.store(true, Ordering::Relaxed);
    });
    (count.load(Ordering::Relaxed), start.elapsed())
}

fn run_store(
    path: &std::path::Path,
    args: &Args,
    run_for: Duration,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    let mut config = config(args.buffered_ms);
    if let Some(mib) = args.cache_mib {
        let bytes = mib
            .checked_mul(1024 * 1024)
            .ok_or("--cache-mib is too large")?;
        config = config.cache_bytes(bytes);
    }
    let store = Store::open_with(path, config)?;
    // Fresh keys on an existing store too: a scope of this run's own, or
    // spread among the store's keys.
    let scope = format!(
        "bench/op-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let run = std::process::id();
    let fp = Fingerprint::of(b"payload");
    let opts = ClaimOptions::new();
    Ok(drive(args.threads, run_for, |t, i| {
        let key = match args.spread {
            Some(spread) => Key::new(
                "bench",
                format!("key-{:012}-s{run}-{t}-{i}", mix(t, i) % spread.max(1)),
            ),
            None => Key::new(scope.as_str(), format!("t{t}-{i}")),
        }
        .expect("key");
        match store.claim(&key, &fp, &opts).expect("claim") {
            ClaimOutcome::Acquired(lease) => {
                store.complete(&lease, b"result-bytes").expect("complete");
            }
            other => panic!("fresh key not acquired: {other:?}"),
        }
    }))
}

struct FloorRequest {
    bytes: Vec<u8>,
    reply: oneshot::Sender<()>,
}

fn floor_writer(rx: &Receiver<FloorRequest>, file: &std::fs::File, len: u64) {
    let mut pos = 4096u64;
    let mut batch = Vec::new();
    let mut frame = Vec::new();
    while let Ok(first) = rx.recv() {
        batch.push(first);
        while let Ok(r) = rx.try_recv() {
            batch.push(r);
        }
        frame.clear();
        frame.extend_from_slice(&[0u8; 36]);
        for r in &batch {
            frame.extend_from_slice(&r.bytes);
        }
        let crc = crc32fast::hash(&frame[36..]);
        frame[32..36].copy_from_slice(&crc.to_le_bytes());
        if pos + frame.len() as u64 > len {
            pos = 4096;
        }
        file.write_all_at(&frame, pos).expect("write");
        pos += frame.len() as u64;
        file.sync_data().expect("fdatasync");
        for r in batch.drain(..) {
            let _ = r.reply.send(());
        }
    }
}

fn run_floor(
    dir: &std::path::Path,
    threads: usize,
    run_for: Duration,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    // As large as the store's log after a few seconds of load; a much larger
    // file written just before the run leaves the disk flushing it.
    const LEN: u64 = 8 * 1024 * 1024;
    let path = dir.join("floor.log");
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)?;
    let zeros = vec![0u8; 1024 * 1024];
    for _ in 0..LEN / zeros.len() as u64 {
        file.write_all(&zeros)?;
    }
    file.sync_all()?;
    let (tx, rx) = sync_channel::<FloorRequest>(4096);
    let writer = std::thread::spawn(move || floor_writer(&rx, &file, LEN));
    let run = drive(threads, run_for, |t, i| {
        // Two durable writes per lifecycle, as claim + complete; each about
        // the size of a logged record change.
        for step in 0..2u8 {
            let mut bytes = vec![step; 200];
            bytes[..8].copy_from_slice(&(t as u64 ^ i).to_le_bytes());
            let (reply, done) = oneshot::channel();
            tx.send(FloorRequest { bytes, reply }).expect("send");
            done.recv().expect("reply");
        }
    });
    drop(tx);
    writer.join().expect("writer");
    Ok(run)
}
