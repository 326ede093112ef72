//! The soak driver shared by `examples/soak.rs` and `tests/soak.rs`: a
//! steady arrival of claim + complete lifecycles on fresh random keys, with
//! a retention and the background sweeper, sampling what an operator
//! provisions for: the index file's size, the log's, the process's
//! resident memory and allocated bytes, how long `Store::stats()` takes,
//! and the latency of the claims made since the sample before (p50, p99,
//! max). Only `Store::claim` is timed, from the call to its answer (not
//! from a paced arrival), so a stall of the writer shows as about one slow
//! claim per thread: in `max` more than in p99.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};

/// What a soak runs.
#[derive(Debug, Clone)]
pub struct Soak {
    /// Client threads.
    pub threads: usize,
    /// Lifecycles per second across all threads (each thread paces itself
    /// to its share); `None`: as fast as the store goes.
    pub rate_per_s: Option<u64>,
    /// The store's retention.
    pub retention: Duration,
    /// The background sweeper's interval.
    pub sweep_interval: Duration,
    /// How long to run.
    pub run_for: Duration,
    /// How often to sample.
    pub sample_every: Duration,
    /// Bytes of each stored result.
    pub result_bytes: usize,
    /// The write-ahead log's size before a checkpoint
    /// (`Config::max_log_bytes`); `None`: the default.
    pub max_log_bytes: Option<u64>,
    /// redb's page cache, in bytes (`Config::cache_bytes`); `None`: the
    /// default.
    pub cache_bytes: Option<usize>,
    /// The bytes the process holds allocated, when its global allocator
    /// counts them (see [`allocated_bytes`]).
    pub allocated: Option<fn() -> u64>,
}

/// The bytes allocated and not freed, as the counting allocator `alloc`
/// saw them since the process started.
pub fn allocated_bytes(alloc: &stats_alloc::StatsAlloc<std::alloc::System>) -> u64 {
    // A reallocation's growth or shrinkage is already in these two.
    let s = alloc.stats();
    u64::try_from(s.bytes_allocated.saturating_sub(s.bytes_deallocated)).unwrap_or(u64::MAX)
}

/// One sample.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Seconds since the start.
    pub at_s: f64,
    /// Lifecycles finished so far.
    pub lifecycles: u64,
    /// The index file's size (bytes).
    pub index_bytes: u64,
    /// The write-ahead log's size (bytes).
    pub log_bytes: u64,
    /// The process's resident memory (bytes), where `/proc` tells it.
    pub rss_bytes: Option<u64>,
    /// The bytes allocated and not freed (heap), when counted.
    pub allocated_bytes: Option<u64>,
    /// Live records (`Store::stats`).
    pub live: u64,
    /// Records past retention not evicted yet (`Store::stats`).
    pub expired: u64,
    /// How long the `Store::stats()` call took (µs).
    pub stats_us: u64,
    /// The latency of each `Store::claim` made since the sample before,
    /// as the client saw it: p50, p99 and max by nearest rank; all 0 when
    /// none was made.
    pub claim_us: Latency,
}

/// Claim latency over one sample's period: whole microseconds
/// (truncated, at most `u32::MAX`, about 71 minutes).
#[derive(Debug, Clone, Copy, Default)]
pub struct Latency {
    /// Claims timed (a count, not µs): one per lifecycle counted in the
    /// period.
    pub count: u64,
    /// Median (µs).
    pub p50: u64,
    /// 99th percentile (µs).
    pub p99: u64,
    /// The slowest (µs).
    pub max: u64,
}

impl Latency {
    /// The latency of `times` (µs, in any order; sorted here).
    fn of(times: &mut [u32]) -> Latency {
        times.sort_unstable();
        let rank = |p: f64| -> u64 {
            if times.is_empty() {
                return 0;
            }
            // Nearest rank: the smallest value with at least p of the
            // timings at or below it.
            let i = ((p * times.len() as f64).ceil() as usize).clamp(1, times.len()) - 1;
            u64::from(times[i])
        };
        Latency {
            count: times.len() as u64,
            p50: rank(0.50),
            p99: rank(0.99),
            max: times.last().map_or(0, |&t| u64::from(t)),
        }
    }
}

/// What one worker did since the sampler last looked: its claims' times
/// (µs) and its lifecycles in all, under one lock so that a sample reads
/// both at one point of the worker's loop.
#[derive(Default)]
struct Tally {
    times: Vec<u32>,
    lifecycles: u64,
}

impl Sample {
    /// One line for a person.
    pub fn line(&self) -> String {
        format!(
            "t={:>7.1}s lifecycles={:>10} index_mib={:>8.1} log_mib={:>6.1} rss_mib={:>7.1} allocated_mib={:>7.1} live={:>9} awaiting_eviction={:>8} stats_ms={:>8.1} claims={:>8} claim_us p50={:>6} p99={:>7} max={:>8}",
            self.at_s,
            self.lifecycles,
            mib(self.index_bytes),
            mib(self.log_bytes),
            self.rss_bytes.map_or(f64::NAN, mib),
            self.allocated_bytes.map_or(f64::NAN, mib),
            self.live,
            self.expired,
            self.stats_us as f64 / 1000.0,
            self.claim_us.count,
            self.claim_us.p50,
            self.claim_us.p99,
            self.claim_us.max,
        )
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The resident memory of this process (`VmRSS`), in bytes.
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// A stateless random number of (thread, step): splitmix64.
fn mix(t: u64, i: u64) -> u64 {
    let mut x = (t << 40 ^ i).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Runs `soak` on a new store at `path`, calling `on_sample` with each
/// sample as it is taken; returns every sample. Each claim's time is kept
/// until the next sample reads it, 4 bytes a claim (up to twice that in
/// vector capacity) for the claims of one sample period (about 0.5-1 MiB
/// at 13,000 claims/s and 10-s samples), counted in the samples' allocated
/// and resident bytes.
///
/// # Errors
/// The store's, when it cannot be opened, a worker's claim or completion
/// fails (the other workers are stopped within about 50 ms, not left to
/// run to the end), or `stats` fails; the operating system's when it
/// refuses a worker thread (the workers already running are stopped
/// first).
pub fn run(
    path: &Path,
    soak: &Soak,
    mut on_sample: impl FnMut(&Sample),
) -> Result<Vec<Sample>, Box<dyn std::error::Error>> {
    let mut config = Config::new()
        .retention(soak.retention)
        .sweep_interval(Some(soak.sweep_interval));
    if let Some(bytes) = soak.max_log_bytes {
        config = config.max_log_bytes(bytes);
    }
    if let Some(bytes) = soak.cache_bytes {
        config = config.cache_bytes(bytes);
    }
    let store = Store::open_with(path, config)?;
    let log_path: PathBuf = store.log_path().to_path_buf();
    let fp = Fingerprint::of(b"payload");
    let opts = ClaimOptions::new();
    let result = vec![b'r'; soak.result_bytes];
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let per_thread = soak.rate_per_s.map(|rate| {
        let share = (rate as f64 / soak.threads.max(1) as f64).max(1e-3);
        Duration::from_secs_f64(1.0 / share)
    });
    let mut samples = Vec::new();
    // A lock per worker, taken by the worker once a lifecycle and by the
    // sampler once a period.
    let tallies: Vec<Mutex<Tally>> = (0..soak.threads).map(|_| Mutex::default()).collect();
    std::thread::scope(|s| -> Result<(), Box<dyn std::error::Error>> {
        let mut workers = Vec::with_capacity(tallies.len());
        for (tally, t) in tallies.iter().zip(0u64..) {
            let (store, fp, opts, result, stop) = (&store, &fp, &opts, &result, &stop);
            let spawned = std::thread::Builder::new()
                .name(format!("soak-{t}"))
                .spawn_scoped(s, move || -> Result<(), idemstore::Error> {
                    // A worker that fails stops the run: the sampler ends at
                    // its next look at `stop` and the join returns the error.
                    let stopping = |e: idemstore::Error| {
                        stop.store(true, Ordering::Relaxed);
                        e
                    };
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let key =
                            Key::new("soak", format!("{:016x}", mix(t, i))).map_err(stopping)?;
                        let asked = Instant::now();
                        let outcome = store.claim(&key, fp, opts).map_err(stopping)?;
                        let took = u32::try_from(asked.elapsed().as_micros()).unwrap_or(u32::MAX);
                        if let ClaimOutcome::Acquired(lease) = outcome {
                            store.complete(&lease, result).map_err(stopping)?;
                        }
                        {
                            let mut tally = tally.lock().unwrap_or_else(PoisonError::into_inner);
                            tally.times.push(took);
                            tally.lifecycles = tally.lifecycles.saturating_add(1);
                        }
                        i += 1;
                        if let Some(every) = per_thread {
                            let due = every.saturating_mul(u32::try_from(i).unwrap_or(u32::MAX));
                            if let Some(wait) = due.checked_sub(started.elapsed()) {
                                std::thread::sleep(wait);
                            }
                        }
                    }
                    Ok(())
                });
            match spawned {
                Ok(worker) => workers.push(worker),
                Err(e) => {
                    // The scope joins the workers already running: stop them.
                    stop.store(true, Ordering::Relaxed);
                    return Err(e.into());
                }
            }
        }
        let mut next = soak.sample_every;
        let sampled = loop {
            // Waits for the next sample in steps of at most 50 ms, so that
            // a failed worker ends the run within one step.
            while let Some(wait) = next.checked_sub(started.elapsed()) {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(wait.min(Duration::from_millis(50)));
            }
            if stop.load(Ordering::Relaxed) {
                break Ok(());
            }
            let asked = Instant::now();
            let stats = match store.stats() {
                Ok(stats) => stats,
                Err(e) => break Err(e),
            };
            let stats_us = u64::try_from(asked.elapsed().as_micros()).unwrap_or(u64::MAX);
            let (mut times, mut lifecycles) = (Vec::<u32>::new(), 0u64);
            for tally in &tallies {
                let mut taken = {
                    let mut tally = tally.lock().unwrap_or_else(PoisonError::into_inner);
                    lifecycles = lifecycles.saturating_add(tally.lifecycles);
                    std::mem::take(&mut tally.times)
                };
                times.append(&mut taken);
            }
            let sample = Sample {
                at_s: started.elapsed().as_secs_f64(),
                lifecycles,
                stats_us,
                index_bytes: stats.file_bytes.unwrap_or(0),
                log_bytes: std::fs::metadata(&log_path).map_or(0, |m| m.len()),
                rss_bytes: rss_bytes(),
                allocated_bytes: soak.allocated.map(|f| f()),
                live: stats.records.live(),
                expired: stats.records.expired,
                claim_us: Latency::of(&mut times),
            };
            on_sample(&sample);
            samples.push(sample);
            next = next.saturating_add(soak.sample_every);
            if started.elapsed() >= soak.run_for {
                break Ok(());
            }
        };
        stop.store(true, Ordering::Relaxed);
        for worker in workers {
            worker.join().map_err(|_| "a soak worker panicked")??;
        }
        sampled.map_err(Into::into)
    })?;
    Ok(samples)
}
