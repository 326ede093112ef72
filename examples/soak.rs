//! A soak of the store as an operator runs it for months: a steady arrival
//! of claim + complete lifecycles on fresh random keys, a retention, the
//! background sweeper, and one line every `--sample-secs` with the index
//! file's size, the log's, resident memory, heap bytes allocated, live
//! records, records awaiting eviction, how long `Store::stats()` took,
//! and the latency of the claims since the sample before (p50, p99, max;
//! only `Store::claim` is timed, so a stall of the writer shows in `max`
//! more than in p99); at the end, what an
//! offline compaction (`idemstore::compact_file`) gives back. What to
//! provision from these figures: docs/operations.md, "Sizing a file store".
//!
//! ```text
//! cargo run --release --example soak -- --threads 16 --minutes 30 --retention-secs 30
//! cargo run --release --example soak -- --threads 16 --rate 5000 --minutes 10
//! ```
//!
//! The short form of the same run is `tests/soak.rs`.

#[path = "soak/driver.rs"]
mod driver;

use std::time::Duration;

use clap::Parser;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

/// Counts the heap bytes held, for the samples' `allocated_mib`.
#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

#[derive(Parser)]
struct Args {
    /// Client threads (1-1024).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: u64,
    /// Lifecycles per second across all threads (as fast as the store goes
    /// when absent).
    #[arg(long)]
    rate: Option<u64>,
    /// How long the store keeps a finished record (seconds).
    #[arg(long, default_value_t = 30)]
    retention_secs: u64,
    /// How often the background sweeper runs (seconds).
    #[arg(long, default_value_t = 60)]
    sweep_secs: u64,
    /// How long to run (minutes; fractions allowed).
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10)]
    sample_secs: u64,
    /// Bytes of each stored result (at most 1 MiB, the store's default
    /// `Config::max_result_bytes`).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    result_bytes: u64,
    /// The write-ahead log's size before a checkpoint, in MiB
    /// (`Config::max_log_bytes`; the default when absent).
    #[arg(long)]
    max_log_mib: Option<u64>,
    /// redb's page cache, in MiB, 1 to 16384 (`Config::cache_bytes`; the
    /// default, 64 MiB, when absent).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16384))]
    cache_mib: Option<u64>,
    /// Directory under which a fresh temporary directory holds the store
    /// (the system's temporary directory when absent).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // Refused before anything runs: a negative, NaN or infinite length.
    let run_for = Duration::try_from_secs_f64(args.minutes * 60.0)
        .map_err(|e| format!("--minutes {}: {e}", args.minutes))?;
    let tmp = match &args.dir {
        Some(parent) => tempfile::tempdir_in(parent)?,
        None => tempfile::tempdir()?,
    };
    let soak = driver::Soak {
        threads: usize::try_from(args.threads)?,
        rate_per_s: args.rate,
        retention: Duration::from_secs(args.retention_secs),
        sweep_interval: Duration::from_secs(args.sweep_secs.max(1)),
        run_for,
        sample_every: Duration::from_secs(args.sample_secs.max(1)),
        result_bytes: usize::try_from(args.result_bytes)?,
        max_log_bytes: args.max_log_mib.map(|m| m.saturating_mul(1024 * 1024)),
        cache_bytes: args
            .cache_mib
            .map(|m| usize::try_from(m.saturating_mul(1024 * 1024)))
            .transpose()?,
        allocated: Some(|| driver::allocated_bytes(GLOBAL)),
    };
    println!("{soak:?}");
    let path = tmp.path().join("soak.redb");
    let samples = driver::run(&path, &soak, |s| {
        println!("{}", s.line());
    })?;
    if let Some(last) = samples.last() {
        let peak_live = samples.iter().map(|s| s.live).max().unwrap_or(0);
        let peak_index = samples.iter().map(|s| s.index_bytes).max().unwrap_or(0);
        println!(
            "summary: lifecycles_per_s={:.0} peak_live={peak_live} peak_index_mib={:.1} index_bytes_per_peak_live={:.0} stats_ms_max={:.1} claim_us_max={}",
            last.lifecycles as f64 / last.at_s,
            peak_index as f64 / (1024.0 * 1024.0),
            peak_index as f64 / peak_live.max(1) as f64,
            samples.iter().map(|s| s.stats_us).max().unwrap_or(0) as f64 / 1000.0,
            samples.iter().map(|s| s.claim_us.max).max().unwrap_or(0),
        );
        // What an offline compaction gives back once the load stops.
        let took = std::time::Instant::now();
        let done = idemstore::compact_file(&path, idemstore::Config::new())?;
        println!(
            "compacted: index_mib {:.1} -> {:.1} in {:.1}s (live at the end {}: {:.0} bytes each after)",
            done.bytes_before as f64 / (1024.0 * 1024.0),
            done.bytes_after as f64 / (1024.0 * 1024.0),
            took.elapsed().as_secs_f64(),
            last.live,
            done.bytes_after as f64 / last.live.max(1) as f64,
        );
    }
    Ok(())
}
