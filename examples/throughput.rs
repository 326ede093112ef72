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

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
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
    /// What to measure.
    what: What,
}

#[derive(Clone, Copy, ValueEnum)]
enum What {
    /// idemstore with its default configuration.
    Store,
    /// The fsync floor: append each batch to a preallocated file, fdatasync.
    Floor,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let tmp = match &args.dir {
        Some(parent) => tempfile::tempdir_in(parent)?,
        None => tempfile::tempdir()?,
    };
    let dir = tmp.path().to_path_buf();
    let run_for = Duration::from_secs_f64(args.seconds);
    let (done, elapsed) = match args.what {
        What::Store => run_store(&dir, args.threads, run_for, args.buffered_ms)?,
        What::Floor => run_floor(&dir, args.threads, run_for)?,
    };
    let rate = done as f64 / elapsed.as_secs_f64();
    println!(
        "{} threads={} lifecycles={} seconds={:.2} lifecycles_per_s={:.0}",
        match args.what {
            What::Store => "store",
            What::Floor => "floor",
        },
        args.threads,
        done,
        elapsed.as_secs_f64(),
        rate
    );
    Ok(())
}

fn run_store(
    dir: &std::path::Path,
    threads: usize,
    run_for: Duration,
    buffered_ms: Option<u64>,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    let mut config = Config::new().sweep_interval(None);
    if let Some(ms) = buffered_ms {
        config = config.durability(Durability::Buffered {
            max_delay: Duration::from_millis(ms),
        });
    }
    let store = Arc::new(Store::open_with(dir.join("bench.redb"), config)?);
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (store, stop, count) = (store.clone(), stop.clone(), count.clone());
            std::thread::spawn(move || {
                let fp = Fingerprint::of(b"payload");
                let opts = ClaimOptions::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = Key::new("bench/op", format!("t{t}-{i}")).expect("key");
                    i += 1;
                    match store.claim(&key, &fp, &opts).expect("claim") {
                        ClaimOutcome::Acquired(lease) => {
                            store.complete(&lease, b"result-bytes").expect("complete");
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("fresh key not acquired: {other:?}"),
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("client thread");
    }
    let elapsed = start.elapsed();
    Ok((count.load(Ordering::Relaxed), elapsed))
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
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (tx, stop, count) = (tx.clone(), stop.clone(), count.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Two durable writes per lifecycle, as claim + complete;
                    // each about the size of a logged record change.
                    for step in 0..2u8 {
                        let mut bytes = vec![step; 200];
                        bytes[..8].copy_from_slice(&(t as u64 ^ i).to_le_bytes());
                        let (reply, done) = oneshot::channel();
                        tx.send(FloorRequest { bytes, reply }).expect("send");
                        done.recv().expect("reply");
                    }
                    i += 1;
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    drop(tx);
    std::thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("client thread");
    }
    let elapsed = start.elapsed();
    writer.join().expect("writer");
    Ok((count.load(Ordering::Relaxed), elapsed))
}
