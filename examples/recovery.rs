//! How long a store takes to reopen after a crash.
//!
//! For each run, a child process (this program again) loads a fresh store
//! with claim + complete lifecycles from several threads and reports its
//! progress; once it has acknowledged `--records` lifecycles it is killed
//! with SIGKILL, mid-load. The parent then reopens the store, timing the
//! open (redb's own recovery, which quick-repair keeps short, then the
//! replay of the write-ahead log after the last checkpoint), checks that
//! every acknowledged record is there, and times a clean reopen for
//! comparison. It prints each run and the medians.
//!
//! ```text
//! cargo run --release --example recovery -- --records 10000 --runs 5
//! cargo run --release --example recovery -- --records 1000000 --runs 3
//! ```

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use idemstore::{ClaimOptions, ClaimOutcome, Config, Durability, Fingerprint, Key, Store};

#[derive(Parser)]
struct Args {
    /// Acknowledged records after which the loading child is killed.
    #[arg(long, default_value_t = 10_000)]
    records: u64,
    /// How many crash-and-reopen runs (the medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Loading threads in the child.
    #[arg(long, default_value_t = 16)]
    threads: u64,
    /// Load with buffered durability (this max delay in ms) instead of the
    /// default immediate mode, to build large stores faster. Either way a
    /// SIGKILL loses nothing acknowledged (the OS keeps the log's writes).
    #[arg(long)]
    buffered_ms: Option<u64>,
    /// Directory under which each run's store is made (the system's
    /// temporary directory when absent).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Internal: run as the loading child on this store file.
    #[arg(long, hide = true)]
    child: Option<PathBuf>,
}

fn config(buffered_ms: Option<u64>) -> Config {
    let config = Config::new().sweep_interval(None);
    match buffered_ms {
        Some(ms) => config.durability(Durability::Buffered {
            max_delay: Duration::from_millis(ms),
        }),
        None => config,
    }
}

fn key(n: u64) -> Key {
    Key::new("bench/recovery", format!("record-{n:010}")).expect("valid key")
}

/// The child: load until killed, printing the number of acknowledged
/// lifecycles after each thousand.
fn child(path: &Path, args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(Store::open_with(path, config(args.buffered_ms))?);
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..args.threads)
        .map(|_| {
            let (store, next, done) = (store.clone(), next.clone(), done.clone());
            std::thread::spawn(move || {
                let fp = Fingerprint::of(b"payload");
                let opts = ClaimOptions::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let ClaimOutcome::Acquired(lease) =
                        store.claim(&key(n), &fp, &opts).expect("claim")
                    else {
                        panic!("fresh key not acquired");
                    };
                    store
                        .complete(&lease, format!("result-{n}").as_bytes())
                        .expect("complete");
                    // Lifecycles are acknowledged out of order across
                    // threads; report a count below which all are done.
                    let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                    if d % 1000 == 0 {
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "PROGRESS {d}");
                        let _ = out.flush();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

struct RunResult {
    crash_reopen: Duration,
    clean_reopen: Duration,
    records: u64,
    log_bytes: u64,
}

fn run_once(args: &Args, parent: &Path) -> Result<RunResult, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir_in(parent)?;
    let path = dir.path().join("recovery.redb");
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--child")
        .arg(&path)
        .arg("--threads")
        .arg(args.threads.to_string());
    if let Some(ms) = args.buffered_ms {
        cmd.arg("--buffered-ms").arg(ms.to_string());
    }
    let mut child = cmd.stdout(Stdio::piped()).spawn()?;
    let stdout = child.stdout.take().ok_or("no child stdout")?;
    let mut acked = 0u64;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(n) = line.strip_prefix("PROGRESS ") {
            acked = n.parse()?;
            if acked >= args.records {
                break;
            }
        }
    }
    child.kill()?; // SIGKILL, mid-load
    child.wait()?;
    if acked < args.records {
        return Err(format!("child stopped after {acked} records").into());
    }
    let log_bytes = std::fs::metadata(format!("{}-wal", path.display()))?.len();

    let start = Instant::now();
    let store = Store::open_with(&path, config(None))?;
    let crash_reopen = start.elapsed();
    let records = store.len()?;
    if records < acked {
        return Err(format!("{records} records after reopening, {acked} acknowledged").into());
    }
    drop(store);
    let start = Instant::now();
    let store = Store::open_with(&path, config(None))?;
    let clean_reopen = start.elapsed();
    drop(store);
    Ok(RunResult {
        crash_reopen,
        clean_reopen,
        records,
        log_bytes,
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(path) = &args.child {
        return child(path, &args);
    }
    let parent = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut crash = Vec::new();
    let mut clean = Vec::new();
    for run in 0..args.runs {
        let r = run_once(&args, &parent)?;
        println!(
            "run {run}: records={} log_bytes={} reopen_after_crash_ms={:.1} clean_reopen_ms={:.1}",
            r.records,
            r.log_bytes,
            r.crash_reopen.as_secs_f64() * 1e3,
            r.clean_reopen.as_secs_f64() * 1e3
        );
        crash.push(r.crash_reopen);
        clean.push(r.clean_reopen);
    }
    println!(
        "median of {} runs at {} records: reopen_after_crash_ms={:.1} clean_reopen_ms={:.1}",
        args.runs,
        args.records,
        median(crash).as_secs_f64() * 1e3,
        median(clean).as_secs_f64() * 1e3
    );
    Ok(())
}
