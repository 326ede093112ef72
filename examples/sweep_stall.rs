//! What a sweep of many due records does to the writes beside it: claim
//! latency (p50, p99, max) and lifecycles per window, first with no sweep,
//! then while a sweep evicts `--due` records, then with no sweep again, in
//! one run on one store.
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
//! ends (and at least `--seconds`), while one thread sweeps, then
//! `--seconds` with no sweep again (the store has grown meanwhile: the
//! writes add more records than the sweep evicts). The sweep runs as the
//! background sweeper does (`Store::sweep_due`: slices bounded in records
//! and writer time, paced to a share of the writer's time, a smaller one
//! while the disk under the log is congested),
//! or with `--mode steps` in back-to-back `Store::sweep(--batch)` calls
//! until one returns fewer than the batch (what the background sweeper did
//! before it was paced), or with `--mode none` not at all: the middle phase
//! then lasts `--control-seconds` (and at least `--seconds`) with the
//! records left due, a control for the windows the disk and the machine
//! take below half on their own. Once per window the driving thread also
//! times `Store::stats()` (which reads a kept count per second of the
//! records past retention that are not evicted yet, and the index entries
//! of the current second). Prints one line per phase
//! (with the checkpoints the writer made in it and how long each held it,
//! from the store's `idemstore::checkpoint` events), the lifecycles per
//! second of each window of every phase, and the checkpoint time that
//! ended in each window; `below_half` counts a phase's windows below half
//! the first no-sweep phase's rate, and how many of them had a checkpoint
//! end in them; the middle phase's windows are also counted against
//! half the rate of the no-sweep phase after it. With `--device` (Linux) each
//! window also gets the disk's traffic and the CPU time the hypervisor
//! stole, to tell a slow window of the disk or the machine from one of the
//! store; with `--filled` rounds of runs share one filled store.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// When each checkpoint since the last phase began was reported (as it
/// ended), and the writer's pause (ms).
static CHECKPOINTS: Mutex<Vec<(Instant, u64)>> = Mutex::new(Vec::new());

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
            CHECKPOINTS
                .lock()
                .expect("checkpoints")
                .push((Instant::now(), ms));
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
    /// A block device (as named in Linux's `/proc/diskstats`, e.g. `vda`)
    /// whose traffic is printed for each window of both phases (MiB
    /// written and read, write requests, flushes, the mean time of a flush
    /// and of a write, and the share of CPU time the hypervisor stole), so
    /// that a slow window can be told apart as the disk's, the machine's or
    /// the store's.
    #[arg(long)]
    device: Option<String>,
    /// A copy of the filled store: when the file exists it (and its
    /// `-wal` beside it) is copied in instead of filling the store again,
    /// which at 1 M records takes 40-90 s; when it does not, the store is
    /// filled and then copied there. For rounds of runs of two builds of
    /// one store format with the same `--due`.
    #[arg(long)]
    filled: Option<std::path::PathBuf>,
    /// redb's page cache for the runs, in MiB (`Config::cache_bytes`; the
    /// default when absent).
    #[arg(long)]
    cache_mib: Option<usize>,
    /// How long the middle phase of `--mode none` lasts, in seconds (and at
    /// least `--seconds`): about as long as the sweep of the same `--due`
    /// takes (211-268 s at 1 M due under 16 threads on the machine of
    /// BENCHMARKS.md). Checked in every mode, used only by `none`.
    #[arg(long, default_value_t = 215.0)]
    control_seconds: f64,
}

/// `from` and its write-ahead log (`<from>-wal`) copied to `to`, and
/// synced: otherwise the kernel writes the copy back while the run
/// measures (30 s later, with Linux's default `vm.dirty_expire_centisecs`).
fn copy_store(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    let wal = |p: &std::path::Path| {
        let mut s = p.as_os_str().to_owned();
        s.push("-wal");
        std::path::PathBuf::from(s)
    };
    for (from, to) in [(from.to_path_buf(), to.to_path_buf()), (wal(from), wal(to))] {
        std::fs::copy(&from, &to)?;
        std::fs::File::open(&to)?.sync_all()?;
    }
    Ok(())
}

/// One device's counters in `/proc/diskstats` and the machine's CPU time
/// in `/proc/stat` (Linux, `Documentation/admin-guide/iostats.rst` and
/// `proc(5)`): what a window of the run asked of the disk and the CPUs.
#[derive(Clone, Copy, Default)]
struct MachineSample {
    sectors_read: u64,
    writes: u64,
    sectors_written: u64,
    write_ms: u64,
    flushes: u64,
    flush_ms: u64,
    /// CPU time in clock ticks: all of it, and the part stolen by the
    /// hypervisor (the `steal` column).
    cpu_ticks: u64,
    steal_ticks: u64,
}

impl MachineSample {
    /// The counters of `device` now; `None` when a file cannot be read or
    /// has no line for it, or a field is missing or not a number (kernels
    /// before 5.5 have no flush fields).
    fn read(device: &str) -> Option<MachineSample> {
        let disks = std::fs::read_to_string("/proc/diskstats").ok()?;
        let line = disks
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.get(2) == Some(&device))?;
        let field = |i: usize| line.get(i)?.parse::<u64>().ok();
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse::<u64>().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal (guest time is
        // counted in user already).
        let cpu_ticks = cpu.iter().take(8).fold(0u64, |a, &b| a.saturating_add(b));
        Some(MachineSample {
            sectors_read: field(5)?,
            writes: field(7)?,
            sectors_written: field(9)?,
            write_ms: field(10)?,
            flushes: field(18)?,
            flush_ms: field(19)?,
            cpu_ticks,
            steal_ticks: *cpu.get(7)?,
        })
    }

    /// What happened between `earlier` and `self`, as printed for a window:
    /// `MiB written/MiB read/writes/flushes/flush ms/write ms/steal %` (the
    /// two times are means per request).
    fn since(&self, earlier: &MachineSample) -> String {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let per = |x: u64, n: u64| if n == 0 { 0.0 } else { x as f64 / n as f64 };
        let mib = |sectors: u64| sectors as f64 * 512.0 / (1024.0 * 1024.0);
        let writes = d(self.writes, earlier.writes);
        let flushes = d(self.flushes, earlier.flushes);
        format!(
            "{:.0}/{:.1}/{writes}/{flushes}/{:.2}/{:.2}/{:.0}",
            mib(d(self.sectors_written, earlier.sectors_written)),
            mib(d(self.sectors_read, earlier.sectors_read)),
            per(d(self.flush_ms, earlier.flush_ms), flushes),
            per(d(self.write_ms, earlier.write_ms), writes),
            100.0
                * per(
                    d(self.steal_ticks, earlier.steal_ticks),
                    d(self.cpu_ticks, earlier.cpu_ticks)
                ),
        )
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Mode {
    /// `Store::sweep_due`, as the background sweeper sweeps.
    Paced,
    /// Back-to-back `Store::sweep(--batch)` steps.
    Steps,
    /// No sweep at all: the middle phase runs `--control-seconds` (and at
    /// least `--seconds`) on the same store with nothing evicted, a control that shows how many
    /// windows the disk and the machine take below half on their own over
    /// as long as a sweep lasts.
    None,
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
    /// The checkpoint time (ms) that ended in each window.
    window_checkpoint_ms: Vec<u64>,
    /// Records awaiting eviction and the index file's size (MiB) at the
    /// start of each window, from its `stats()` call.
    backlog: Vec<(u64, u64)>,
    /// The device's traffic and the stolen CPU of each window (see `MachineSample::since`), when
    /// `--device` names one.
    disk: Vec<String>,
}

/// Runs lifecycles on `threads` threads until `done` says so (checked
/// after `least` has passed), counting them per window of `window`.
fn run_phase(
    store: &Store,
    threads: usize,
    tag: u64,
    least: Duration,
    window: Duration,
    device: Option<&str>,
    done: &(dyn Fn() -> bool + Sync),
) -> Phase {
    let fp = Fingerprint::of(b"payload");
    let opts = ClaimOptions::new();
    let stop = AtomicBool::new(false);
    let count = AtomicU64::new(0);
    let latencies = Mutex::new(Vec::new());
    let started = Instant::now();
    let mut windows = Vec::new();
    let mut window_spans = Vec::new();
    let mut stats_ms = Vec::new();
    let mut disk = Vec::new();
    let mut backlog = Vec::new();
    let mut disk_last = device.and_then(MachineSample::read);
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
            let stats = store.stats().expect("stats");
            let took = asked.elapsed();
            backlog.push((stats.records.expired, stats.file_bytes.unwrap_or(0) >> 20));
            stats_ms.push(u64::try_from(took.as_millis()).unwrap_or(u64::MAX));
            std::thread::sleep(window.saturating_sub(took));
            let now = count.load(Ordering::Relaxed);
            windows.push((now - last) as f64 / opened.elapsed().as_secs_f64());
            window_spans.push((opened, Instant::now()));
            last = now;
            if let (Some(device), Some(before)) = (device, disk_last) {
                let after = MachineSample::read(device).unwrap_or(before);
                disk.push(after.since(&before));
                disk_last = Some(after);
            }
            if started.elapsed() >= least && done() {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let mut latencies = latencies.into_inner().expect("latencies");
    latencies.sort_unstable();
    let checkpoints = std::mem::take(&mut *CHECKPOINTS.lock().expect("checkpoints"));
    let window_checkpoint_ms = window_spans
        .iter()
        .map(|&(from, to)| {
            checkpoints
                .iter()
                .filter(|&&(at, _)| at >= from && at < to)
                .map(|&(_, ms)| ms)
                .sum()
        })
        .collect();
    let mut checkpoint_ms: Vec<u64> = checkpoints.iter().map(|&(_, ms)| ms).collect();
    checkpoint_ms.sort_unstable();
    Phase {
        lifecycles: count.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
        latencies,
        windows,
        stats_ms,
        checkpoint_ms,
        window_checkpoint_ms,
        backlog,
        disk,
    }
}

/// The `p` quantile (0 to 1) of `sorted` by nearest rank, as the soak
/// driver (`examples/soak/driver.rs`) takes it: the smallest value with at
/// least `p` of the values at or below it; 0 when there is none.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn rate(phase: &Phase) -> f64 {
    phase.lifecycles as f64 / phase.elapsed.as_secs_f64()
}

/// The windows of `phase` below half of `rate`, and how many of them had a
/// checkpoint end in them.
fn below_half(phase: &Phase, rate: f64) -> (usize, usize) {
    let below = |w: &f64| *w < rate / 2.0;
    let with_checkpoint = phase
        .windows
        .iter()
        .zip(&phase.window_checkpoint_ms)
        .filter(|&(w, &ms)| below(w) && ms > 0)
        .count();
    (
        phase.windows.iter().filter(|w| below(w)).count(),
        with_checkpoint,
    )
}

fn report(name: &str, phase: &Phase, half_of: f64) {
    let rate = rate(phase);
    let (below, with_checkpoint) = below_half(phase, half_of);
    let lowest = phase.windows.iter().copied().fold(f64::INFINITY, f64::min);
    let mut stats_ms = phase.stats_ms.clone();
    stats_ms.sort_unstable();
    println!(
        "{name}: lifecycles_per_s={rate:.0} claim_us p50={} p99={} max={} windows={} below_half={below} below_half_with_checkpoint={with_checkpoint} lowest_window_per_s={:.0} stats_ms p50={} max={} checkpoints={} checkpoint_ms min={} p50={} max={}",
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
    // Negative, infinite or not a number: refused before anything runs.
    let least = Duration::try_from_secs_f64(args.seconds)?;
    let control = Duration::try_from_secs_f64(args.control_seconds)?;
    if args.batch == 0 {
        // `--mode steps` stops at the first step short of the batch.
        return Err("--batch must be at least 1".into());
    }
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Checkpoints))?;
    let tmp = match &args.dir {
        Some(parent) => tempfile::tempdir_in(parent)?,
        None => tempfile::tempdir()?,
    };
    let path = tmp.path().join("sweep-stall.redb");
    let quiet = Config::new().sweep_interval(None).scrub_rate(None);
    let window = Duration::from_millis(args.window_ms.max(1));
    match &args.filled {
        Some(filled) if filled.exists() => {
            copy_store(filled, &path)?;
            println!("filled: due={} copied from {}", args.due, filled.display());
        }
        _ => {
            {
                let store =
                    Store::open_with(&path, quiet.clone().retention(Duration::from_millis(1)))?;
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
            if let Some(filled) = &args.filled {
                copy_store(&path, filled)?;
            }
        }
    }
    let mut config = quiet.sweep_batch(args.batch);
    if let Some(mib) = args.cache_mib {
        config = config.cache_bytes(mib.saturating_mul(1 << 20));
    }
    let store = Store::open_with(&path, config)?;
    let device = args.device.as_deref();
    let quiet_phase = run_phase(&store, args.threads, 1, least, window, device, &|| true);
    let quiet_rate = rate(&quiet_phase);
    report("no sweep", &quiet_phase, quiet_rate);
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
                Mode::None => std::thread::sleep(control),
            }
            *sweep_time.lock().expect("sweep time") = started.elapsed();
            swept.store(true, Ordering::SeqCst);
        });
        run_phase(&store, args.threads, 2, least, window, device, &|| {
            swept.load(Ordering::SeqCst)
        })
    });
    // The middle phase's name: "control" when nothing sweeps in it.
    let middle = match args.mode {
        Mode::None => "control",
        Mode::Paced | Mode::Steps => "sweeping",
    };
    report(middle, &sweeping, quiet_rate);
    let sweep_time = *sweep_time.lock().expect("sweep time");
    println!(
        "sweep: mode={} evicted={} seconds={:.2} evicted_per_s={:.0} batch={}",
        match args.mode {
            Mode::Paced => "paced",
            Mode::Steps => "steps",
            Mode::None => "none",
        },
        evicted.load(Ordering::Relaxed),
        sweep_time.as_secs_f64(),
        evicted.load(Ordering::Relaxed) as f64 / sweep_time.as_secs_f64().max(1e-9),
        args.batch,
    );
    let after = run_phase(&store, args.threads, 3, least, window, device, &|| true);
    report("no sweep after", &after, quiet_rate);
    let (below_after, with_checkpoint) = below_half(&sweeping, rate(&after));
    println!(
        "{middle} against no sweep after: during_over_after={:.2} below_half={below_after} below_half_with_checkpoint={with_checkpoint}",
        rate(&sweeping) / rate(&after)
    );
    for (name, phase) in [
        ("no sweep", &quiet_phase),
        (middle, &sweeping),
        ("no sweep after", &after),
    ] {
        let windows: Vec<String> = phase.windows.iter().map(|r| format!("{r:.0}")).collect();
        println!("{name} windows_per_s: {}", windows.join(" "));
        let checkpoints: Vec<String> = phase
            .window_checkpoint_ms
            .iter()
            .map(u64::to_string)
            .collect();
        println!("{name} checkpoint_ms: {}", checkpoints.join(" "));
        let backlog: Vec<String> = phase
            .backlog
            .iter()
            .map(|(due, mib)| format!("{due}/{mib}"))
            .collect();
        println!("{name} awaiting_eviction/index_MiB: {}", backlog.join(" "));
        if !phase.disk.is_empty() {
            println!(
                "{name} disk MiB_written/MiB_read/writes/flushes/flush_ms/write_ms/steal_pct: {}",
                phase.disk.join(" ")
            );
        }
    }
    Ok(())
}
