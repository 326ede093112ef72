//! What a sweep of many due records does to the writes beside it: claim
//! latency (p50, p99, max) and lifecycles per window, first with no sweep,
//! then while a sweep evicts `--due` records, in one run on one store.
//!
//! ```text
//! cargo run --release --example sweep_stall -- --due 1000000 --threads 16 --seconds 20
//! ```
//!
//! The store is filled with `--due` finished records on random keys (spread
//! over the whole index, as fresh random keys are) under a retention of
//! 1 ms, so that all are due; it is then reopened with the default
//! retention and `--threads` client threads run claim + complete lifecycles
//! on fresh random keys: `--seconds` with no sweep, then until the sweep
//! ends (and at least `--seconds`), while one thread sweeps: as the
//! background sweeper does (`Store::sweep_due`: slices bounded in records
//! and writer time, paced to a share of the writer's time),
//! or with `--mode steps` in back-to-back `Store::sweep(--batch)` calls
//! until one returns fewer than the batch (what the background sweeper did
//! before it was paced). Once per window the driving thread also times
//! `Store::stats()` (which counts the expiry index entries of the records
//! past retention that are not evicted yet). Prints one line per phase
//! (with the checkpoints the writer made in it and how long each held it,
//! from the store's `idemstore::checkpoint` events) and the lifecycles per
//! second of each window of the sweep phase.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The writer's pause (ms) of each checkpoint since the last phase began.
static CHECKPOINTS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Collects the `took_ms` of the store's checkpoint events, and nothing
/// else (every other event is disabled at its call site).
struct Checkpoints;

struct TookMs(Option<u64>);

impl Visit for TookMs {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "took_ms" {
            self.0 = Some(value);
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> Layer<S> for Checkpoints {
    fn enabled(&self, metadata: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        metadata.target() == "idemstore::checkpoint"
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut took = TookMs(None);
        event.record(&mut took);
        if let Some(ms) = took.0 {
            CHECKPOINTS.lock().expect("checkpoints").push(ms);
        }
    }
}

#[derive(Parser)]
struct Args {
    /// Records written due before the run.
    #[arg(long, default_value_t = 1_000_000)]
    due: u64,
    /// Client threads running lifecycles.
    #[arg(long, default_value_t = 16)]
    threads: usize,
    /// Seconds of the phase with no sweep (and the least of the other).
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Records per sweep step (`Store::sweep`'s `max_records`; the
    /// background sweeper's `Config::sweep_batch`).
    #[arg(long, default_value_t = idemstore::DEFAULT_SWEEP_BATCH)]
    batch: usize,
    /// Window length for the per-window rates, in ms.
    #[arg(long, default_value_t = 1000)]
    window_ms: u64,
    /// How the sweep runs.
    #[arg(long, value_enum, default_value = "paced")]
    mode: Mode,
    /// Directory under which a fresh temporary directory holds the store
    /// (the system's temporary directory when absent).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Mode {
    /// `Store::sweep_due`, as the background sweeper sweeps.
    Paced,
    /// Back-to-back `Store::sweep(--batch)` steps.
    Steps,
}

/// A stateless random number of (thread, step): splitmix64.
fn mix(t: u64, i: u64) -> u64 {
    let mut x = (t << 40 ^ i).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One lifecycle on a fresh random key; the claim's latency in µs.
fn lifecycle(
    store: &Store,
    fp: &Fingerprint,
    opts: &ClaimOptions,
    tag: u64,
    t: u64,
    i: u64,
) -> u64 {
    let key = Key::new("sweep-stall", format!("{:016x}-{tag}", mix(t, i))).expect("key");
    let started = Instant::now();
    let outcome = store.claim(&key, fp, opts).expect("claim");
    let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    match outcome {
        ClaimOutcome::Acquired(lease) => {
            store.complete(&lease, b"result-bytes").expect("complete");
        }
        other => panic!("a fresh key was not acquired: {other:?}"),
    }
    micros
}

/// What one phase measured.
struct Phase {
    lifecycles: u64,
    elapsed: Duration,
    latencies: Vec<u64>,
    /// Lifecycles per second of each window (a window lasts at least
    /// `--window-ms`, longer when a `stats()` call took longer).
    windows: Vec<f64>,
    /// How long each `Store::stats()` call took (ms), one per window.
    stats_ms: Vec<u64>,
    /// How long each checkpoint held the writer (ms), sorted.
    checkpoint_ms: Vec<u64>,
}

/// Runs lifecycles on `threads` threads until `done` says so (checked
/// after `least` has passed), counting them per window of `window`.
fn run_phase(
    store: &Store,
    threads: usize,
    tag: u64,
    least: Duration,
    window: Duration,
    done: &(dyn Fn() -> bool + Sync),
) -> Phase {
    let fp = Fingerprint::of(b"payload");
    let opts = ClaimOptions::new();
    let stop = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let latencies = Mutex::new(Vec::new());
    let started = Instant::now();
    let mut windows = Vec::new();
    let mut stats_ms = Vec::new();
    CHECKPOINTS.lock().expect("checkpoints").clear();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, count, latencies, fp, opts) = (&stop, &count, &latencies, &fp, &opts);
            s.spawn(move || {
                let mut mine = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    mine.push(lifecycle(store, fp, opts, tag, t as u64, i));
                    i += 1;
                    count.fetch_add(1, Ordering::Relaxed);
                }
                latencies.lock().expect("latencies").extend(mine);
            });
        }
        let mut last = 0;
        loop {
            let opened = Instant::now();
            let asked = Instant::now();
            store.stats().expect("stats");
            let took = asked.elapsed();
            stats_ms.push(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
            std::thread::sleep(window.saturating_sub(took));
            let now = count.load(Ordering::Relaxed);
            windows.push((now - last) as f64 / opened.elapsed().as_secs_f64());
            last = now;
            if started.elapsed() >= least && done() {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let mut latencies = latencies.into_inner().expect("latencies");
    latencies.sort_unstable();
    let mut checkpoint_ms = std::mem::take(&mut *CHECKPOINTS.lock().expect("checkpoints"));
    checkpoint_ms.sort_unstable();
    Phase {
        lifecycles: count.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
        latencies,
        windows,
        stats_ms,
        checkpoint_ms,
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

fn report(name: &str, phase: &Phase) {
    let rate = phase.lifecycles as f64 / phase.elapsed.as_secs_f64();
    let lowest = phase.windows.iter().copied().fold(f64::INFINITY, f64::min);
    let mut stats_ms = phase.stats_ms.clone();
    stats_ms.sort_unstable();
    println!(
        "{name}: lifecycles_per_s={rate:.0} claim_us p50={} p99={} max={} windows={} lowest_window_per_s={:.0} stats_ms p50={} max={} checkpoints={} checkpoint_ms min={} p50={} max={}",
        percentile(&phase.latencies, 0.5),
        percentile(&phase.latencies, 0.99),
        phase.latencies.last().copied().unwrap_or(0),
        phase.windows.len(),
        lowest,
        percentile(&stats_ms, 0.5),
        stats_ms.last().copied().unwrap_or(0),
        phase.checkpoint_ms.len(),
        phase.checkpoint_ms.first().copied().unwrap_or(0),
        percentile(&phase.checkpoint_ms, 0.5),
        phase.checkpoint_ms.last().copied().unwrap_or(0),
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Checkpoints))?;
    let tmp = match &args.dir {
        Some(parent) => tempfile::tempdir_in(parent)?,
        None => tempfile::tempdir()?,
    };
    let path = tmp.path().join("sweep-stall.redb");
    let quiet = Config::new().sweep_interval(None).scrub_rate(None);
    let window = Duration::from_millis(args.window_ms.max(1));
    {
        let store = Store::open_with(&path, quiet.clone().retention(Duration::from_millis(1)))?;
        let fp = Fingerprint::of(b"payload");
        let opts = ClaimOptions::new();
        let next = AtomicU64::new(0);
        let started = Instant::now();
        std::thread::scope(|s| {
            for t in 0..64u64 {
                let (store, fp, opts, next) = (&store, &fp, &opts, &next);
                s.spawn(move || {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= args.due {
                            return;
                        }
                        lifecycle(store, fp, opts, 0, t, i);
                    }
                });
            }
        });
        println!(
            "filled: due={} seconds={:.1}",
            args.due,
            started.elapsed().as_secs_f64()
        );
    }
    let store = Store::open_with(&path, quiet.sweep_batch(args.batch))?;
    let least = Duration::from_secs_f64(args.seconds);
    let quiet_phase = run_phase(&store, args.threads, 1, least, window, &|| true);
    report("no sweep", &quiet_phase);
    let swept = AtomicBool::new(false);
    let evicted = AtomicU64::new(0);
    let sweep_time = Mutex::new(Duration::ZERO);
    let sweeping = std::thread::scope(|s| {
        s.spawn(|| {
            let started = Instant::now();
            match args.mode {
                Mode::Paced => {
                    let n = store.sweep_due().expect("sweep");
                    evicted.fetch_add(n as u64, Ordering::Relaxed);
                }
                Mode::Steps => loop {
                    let n = store.sweep(args.batch).expect("sweep");
                    evicted.fetch_add(n as u64, Ordering::Relaxed);
                    if n < args.batch {
                        break;
                    }
                },
            }
            *sweep_time.lock().expect("sweep time") = started.elapsed();
            swept.store(true, Ordering::SeqCst);
        });
        run_phase(&store, args.threads, 2, least, window, &|| {
            swept.load(Ordering::SeqCst)
        })
    });
    report("sweeping", &sweeping);
    let sweep_time = *sweep_time.lock().expect("sweep time");
    println!(
        "sweep: mode={} evicted={} seconds={:.2} evicted_per_s={:.0} batch={}",
        match args.mode {
            Mode::Paced => "paced",
            Mode::Steps => "steps",
        },
        evicted.load(Ordering::Relaxed),
        sweep_time.as_secs_f64(),
        evicted.load(Ordering::Relaxed) as f64 / sweep_time.as_secs_f64().max(1e-9),
        args.batch,
    );
    let windows: Vec<String> = sweeping.windows.iter().map(|r| format!("{r:.0}")).collect();
    println!("sweeping windows_per_s: {}", windows.join(" "));
    Ok(())
}
