//! The soak's short form: a steady arrival of lifecycles with a retention
//! of 3 s and the background sweeper every second, for 36 s. Once the live
//! set is steady (after the first 12 s), the index file and resident
//! memory must stop growing: over the last 12 s each may rise at most by a
//! stated bound above its peak of the 12 s before (index: half of that peak
//! plus 2 MiB, for redb's allocation steps; resident memory: 32 MiB, for
//! caches still filling; heap bytes allocated: half of that peak plus
//! 4 MiB, which a leak of 500 bytes per lifecycle would pass). The write-ahead log stays within its configured
//! size, and every claim is timed in one sample. Sizes and counts are
//! asserted, never times.
//!
//! The long form (`--ignored`, `IDEMSTORE_SOAK_MINUTES`, default 30) runs
//! 16 threads as fast as the store goes with a retention of 30 s and the
//! default sweep interval, and prints every sample; `examples/soak.rs`
//! runs the same with any settings.

#[path = "../examples/soak/driver.rs"]
mod driver;

use std::time::Duration;

use driver::{Sample, Soak};
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

/// Counts the heap bytes held, for the samples' allocated bytes.
#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

fn allocated() -> u64 {
    driver::allocated_bytes(GLOBAL)
}

/// `Config::max_log_bytes`'s default: the size the log grows to.
const MAX_LOG_BYTES: u64 = 64 << 20;

/// The peak of `field` over the samples taken in `[from_s, to_s)`.
fn peak(samples: &[Sample], from_s: f64, to_s: f64, field: impl Fn(&Sample) -> u64) -> u64 {
    samples
        .iter()
        .filter(|s| s.at_s >= from_s && s.at_s < to_s)
        .map(field)
        .max()
        .unwrap_or_else(|| panic!("no sample in [{from_s}, {to_s}) s"))
}

#[test]
fn index_log_and_memory_reach_a_plateau_under_churn() {
    let dir = tempfile::tempdir().unwrap();
    let soak = Soak {
        threads: 4,
        rate_per_s: Some(800),
        retention: Duration::from_secs(3),
        sweep_interval: Duration::from_secs(1),
        run_for: Duration::from_secs(36),
        sample_every: Duration::from_secs(2),
        result_bytes: 64,
        max_log_bytes: None,
        cache_bytes: None,
        allocated: Some(allocated),
    };
    let samples = driver::run(&dir.path().join("soak.redb"), &soak, |s| {
        eprintln!("{}", s.line())
    })
    .unwrap();
    let last = samples.last().unwrap();
    assert!(last.lifecycles > 0);
    let mid = |f: fn(&Sample) -> u64| peak(&samples, 12.0, 24.0, f);
    let late = |f: fn(&Sample) -> u64| peak(&samples, 24.0, f64::INFINITY, f);
    let (index_mid, index_late) = (mid(|s| s.index_bytes), late(|s| s.index_bytes));
    assert!(
        index_late <= index_mid + index_mid / 2 + (2 << 20),
        "the index kept growing: peak {index_mid} B, then {index_late} B"
    );
    // The log grows in steps up to its configured size (64 MiB by
    // default), then is reused after each checkpoint.
    let log_peak = peak(&samples, 0.0, f64::INFINITY, |s| s.log_bytes);
    assert!(
        log_peak <= MAX_LOG_BYTES + (1 << 20),
        "the log passed its bound: {log_peak} B"
    );
    let heap = |s: &Sample| s.allocated_bytes.unwrap_or(0);
    let (heap_mid, heap_late) = (
        peak(&samples, 12.0, 24.0, heap),
        peak(&samples, 24.0, f64::INFINITY, heap),
    );
    assert!(heap_mid > 0, "allocated bytes were not counted");
    assert!(
        heap_late <= heap_mid + heap_mid / 2 + (4 << 20),
        "allocated bytes kept growing: peak {heap_mid} B, then {heap_late} B"
    );
    if last.rss_bytes.is_some() {
        let rss = |s: &Sample| s.rss_bytes.unwrap_or(0);
        let (rss_mid, rss_late) = (
            peak(&samples, 12.0, 24.0, rss),
            peak(&samples, 24.0, f64::INFINITY, rss),
        );
        assert!(
            rss_late <= rss_mid + (32 << 20),
            "resident memory kept growing: peak {rss_mid} B, then {rss_late} B"
        );
    }
    // Every claim is timed once, in the sample that counts its lifecycle
    // (a worker records both under one lock).
    let timed: u64 = samples.iter().map(|s| s.claim_us.count).sum();
    assert_eq!(timed, last.lifecycles, "claims timed against lifecycles");
    for s in samples.iter().filter(|s| s.claim_us.count > 0) {
        let l = s.claim_us;
        assert!(l.p50 <= l.p99 && l.p99 <= l.max, "at {} s: {l:?}", s.at_s);
    }
    // The sweeper keeps up: what awaits eviction is at most a few seconds
    // of arrivals, never the whole history.
    assert!(
        last.expired < last.lifecycles / 2,
        "{} of {} records await eviction",
        last.expired,
        last.lifecycles
    );
}

/// A worker whose write fails ends the run with that error before the
/// first sample: the other workers are stopped, not left to run out the
/// two minutes (each lifecycle's result is a byte over the store's
/// default `max_result_bytes`, so the first completion fails).
#[test]
fn a_failing_worker_ends_the_run_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let soak = Soak {
        threads: 4,
        rate_per_s: None,
        retention: Duration::from_secs(3),
        sweep_interval: Duration::from_secs(1),
        run_for: Duration::from_secs(120),
        sample_every: Duration::from_secs(10),
        result_bytes: (1 << 20) + 1,
        max_log_bytes: None,
        cache_bytes: None,
        allocated: None,
    };
    let mut sampled = 0u32;
    let err = driver::run(&dir.path().join("soak.redb"), &soak, |_| sampled += 1).unwrap_err();
    assert!(
        err.to_string().contains("over its limit"),
        "not the worker's error: {err}"
    );
    assert_eq!(sampled, 0, "the run went on after a worker failed");
}

/// The long form: `IDEMSTORE_SOAK_MINUTES` (default 30, at least 0.5) of
/// 16 threads as fast as the store goes, a retention of 30 s, the default
/// sweep interval (60 s); prints every sample and asserts that the index
/// (by half its peak plus 2 MiB) and the heap (by 32 MiB) stop growing
/// over the last third against the middle third.
#[test]
#[ignore = "a long soak: cargo test --release --test soak -- --ignored --nocapture"]
fn long_soak() {
    let minutes: f64 = std::env::var("IDEMSTORE_SOAK_MINUTES").map_or(30.0, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("IDEMSTORE_SOAK_MINUTES={v:?}: not a number of minutes"))
    });
    let dir = tempfile::tempdir().unwrap();
    let run_for = Duration::try_from_secs_f64(minutes * 60.0)
        .ok()
        .filter(|d| *d >= Duration::from_secs(30))
        .unwrap_or_else(|| {
            panic!("IDEMSTORE_SOAK_MINUTES={minutes}: at least 0.5 (three 10-s samples), finite")
        });
    let soak = Soak {
        threads: 16,
        rate_per_s: None,
        retention: Duration::from_secs(30),
        sweep_interval: Duration::from_secs(60),
        run_for,
        sample_every: Duration::from_secs(10),
        result_bytes: 64,
        max_log_bytes: None,
        cache_bytes: None,
        allocated: Some(allocated),
    };
    let samples = driver::run(&dir.path().join("soak.redb"), &soak, |s| {
        println!("{}", s.line())
    })
    .unwrap();
    let third = run_for.as_secs_f64() / 3.0;
    let mid = peak(&samples, third, 2.0 * third, |s| s.index_bytes);
    let late = peak(&samples, 2.0 * third, f64::INFINITY, |s| s.index_bytes);
    assert!(
        late <= mid + mid / 2 + (2 << 20),
        "index {mid} B then {late} B"
    );
    let heap = |s: &Sample| s.allocated_bytes.unwrap_or(0);
    let heap_mid = peak(&samples, third, 2.0 * third, heap);
    let heap_late = peak(&samples, 2.0 * third, f64::INFINITY, heap);
    assert!(
        heap_late <= heap_mid + (32 << 20),
        "allocated {heap_mid} B then {heap_late} B"
    );
}
