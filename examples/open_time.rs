//! How long a clean open of a large store takes, with redb's full
//! integrity check (`integrity_check_interval(None)`, what every open did
//! before issue 13 deliverable 4) and without it (the default period, the
//! last check recorded by the previous open), and the resident memory
//! right after the open.
//!
//! ```text
//! # once: a store of 1 000 000 finished records (64 threads of claim +
//! # complete, as benches/claim.rs builds its large store)
//! cargo run --release --example open_time -- --dir /tmp/open-1m --build 1000000
//! # then: 5 clean opens of each mode, alternating, page cache warm
//! cargo run --release --example open_time -- --dir /tmp/open-1m --runs 5
//! # cold: the page cache dropped (as root) before every open
//! cargo run --release --example open_time -- --dir /tmp/open-1m --runs 5 --drop-caches
//! ```
//!
//! `--scrub` adds a third mode: a clean open (no check), then one pass of
//! the online scrub at full speed, in steps of `DEFAULT_SCRUB_RATE`
//! records (what the background scrub walks per second), reported as the
//! pass's time and records per second: how far below full speed the
//! default rate keeps it.
//!
//! Each open runs in a child process (this program again), so that the
//! resident memory it reports (`VmRSS` of `/proc/self/status` after the
//! open) is that of one open alone; the child closes the store cleanly.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use idemstore::{ClaimOptions, ClaimOutcome, Config, DEFAULT_SCRUB_RATE, Fingerprint, Key, Store};

#[derive(Parser)]
struct Args {
    /// The directory of the store (`idem.redb` in it).
    #[arg(long)]
    dir: PathBuf,
    /// Build a store of this many finished records first (the directory
    /// must not hold one).
    #[arg(long)]
    build: Option<u64>,
    /// Clean opens of each mode.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Drop the page cache (`/proc/sys/vm/drop_caches`, root) before every
    /// open.
    #[arg(long)]
    drop_caches: bool,
    /// Also time a full pass of the online scrub after a clean open.
    #[arg(long)]
    scrub: bool,
    /// Internal: open once in this mode (`check`, `skip` or `scrub`) and
    /// report.
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn key(n: u64) -> Key {
    Key::new("bench", format!("key-{n:012}")).expect("valid key")
}

/// Ten years of retention, so that the store never expires (as the
/// benchmark's stores).
fn base_config() -> Config {
    Config::new()
        .retention(Duration::from_secs(10 * 365 * 24 * 3600))
        .sweep_interval(None)
        .scrub_rate(None)
}

fn build(path: &Path, records: u64) {
    let started = Instant::now();
    // The default (immediate) durability, as benches/claim.rs builds: the
    // batches, and so the file's layout and size, depend on it.
    let store = Store::open_with(path, base_config()).expect("open");
    let next = AtomicU64::new(0);
    let fp = Fingerprint::of(br#"{"title":"printer on fire"}"#);
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
                    store
                        .complete(&lease, br#"{"ticket":"T-1","status":"open"}"#)
                        .expect("complete");
                }
            });
        }
    });
    drop(store);
    eprintln!(
        "built {records} records in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn child(path: &Path, mode: &str) {
    let config = match mode {
        "check" => base_config().integrity_check_interval(None),
        _ => base_config(),
    };
    let started = Instant::now();
    let store = Store::open_with(path, config).expect("open");
    let open_ms = started.elapsed().as_secs_f64() * 1000.0;
    let rss = rss_kib();
    if mode == "scrub" {
        let started = Instant::now();
        let mut records = 0u64;
        loop {
            let step = store.scrub(DEFAULT_SCRUB_RATE as usize).expect("scrub");
            assert!(step.problems.is_empty(), "{:?}", step.problems);
            records += step.records;
            if step.pass_finished {
                break;
            }
        }
        let secs = started.elapsed().as_secs_f64();
        drop(store);
        println!(
            "open_ms={open_ms:.2} rss_kib={rss} scrub_s={secs:.2} scrub_per_s={:.0} records={records}",
            records as f64 / secs
        );
        return;
    }
    drop(store);
    println!("open_ms={open_ms:.2} rss_kib={rss}");
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = Args::parse();
    let path = args.dir.join("idem.redb");
    if let Some(mode) = &args.child {
        child(&path, mode);
        return;
    }
    if let Some(records) = args.build {
        std::fs::create_dir_all(&args.dir).expect("create the directory");
        assert!(!path.exists(), "{} exists", path.display());
        build(&path, records);
    }
    let size = std::fs::metadata(&path).expect("the store file").len();
    println!(
        "store {} ({:.0} MB), {} runs per mode{}",
        path.display(),
        size as f64 / 1e6,
        args.runs,
        if args.drop_caches {
            ", page cache dropped before each open"
        } else {
            ", page cache warm"
        }
    );
    let exe = std::env::current_exe().expect("this program");
    let mut results: Vec<(&str, Vec<f64>, Vec<f64>)> = vec![
        ("check", Vec::new(), Vec::new()),
        ("skip", Vec::new(), Vec::new()),
    ];
    if args.scrub {
        results.push(("scrub", Vec::new(), Vec::new()));
    }
    // One unmeasured open of each mode first: it warms the page cache (when
    // not dropped) and records a passed check for `skip`.
    for round in 0..=args.runs {
        for (mode, times, rss) in &mut results {
            if args.drop_caches {
                std::process::Command::new("sync").status().expect("sync");
                std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (root)");
            }
            let out = Command::new(&exe)
                .args([
                    "--dir",
                    args.dir.to_str().expect("utf-8 dir"),
                    "--child",
                    mode,
                ])
                .output()
                .expect("run the child");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let line = String::from_utf8(out.stdout).expect("utf-8");
            let field = |name: &str| -> f64 {
                line.split_whitespace()
                    .find_map(|f| f.strip_prefix(name))
                    .and_then(|v| v.parse().ok())
                    .expect("a field")
            };
            if round == 0 {
                continue;
            }
            println!("run {round} {mode}: {}", line.trim());
            times.push(field("open_ms="));
            rss.push(field("rss_kib=") / 1024.0);
        }
    }
    for (mode, times, rss) in &mut results {
        let (lo, hi) = (
            times.iter().copied().fold(f64::MAX, f64::min),
            times.iter().copied().fold(0.0, f64::max),
        );
        println!(
            "{mode}: open median {:.1} ms (min {lo:.1}, max {hi:.1}), RSS after open median {:.1} MiB",
            median(times),
            median(rss)
        );
    }
}
