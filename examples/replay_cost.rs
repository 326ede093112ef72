//! What one replay claim costs: a store of finished records, then a loop of
//! replay claims of them in a pseudo-random order, on one thread. The loop
//! is its own function (`replay_loop`), so an instruction count can be taken
//! of it alone, whatever else the machine is doing:
//!
//! ```text
//! cargo build --release --example replay_cost
//! valgrind --tool=callgrind --toggle-collect='replay_cost::replay_loop' \
//!     target/release/examples/replay_cost --keys 2000 --replays 24000
//! ```
//!
//! Without valgrind it prints the wall-clock nanoseconds per replay (noisy
//! on a shared machine; the instruction count is the figure to compare).

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::Parser;
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};

#[derive(Parser)]
struct Args {
    /// Finished records in the store (all of them replayed).
    #[arg(long, default_value_t = 2_000)]
    keys: u64,
    /// Replay claims in the timed loop.
    #[arg(long, default_value_t = 24_000)]
    replays: u64,
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The replays, in the order `splitmix64` picks; returns the result bytes
/// seen, so that nothing is optimised away.
#[inline(never)]
fn replay_loop(store: &Store, keys: &[Key], fingerprint: &Fingerprint, replays: u64) -> usize {
    let options = ClaimOptions::default();
    let mut seen = 0;
    for n in 0..replays {
        let key = &keys[(splitmix64(n) % keys.len() as u64) as usize];
        match store.claim(key, fingerprint, &options) {
            Ok(ClaimOutcome::Replay(record)) => seen += record.result().map_or(0, <[u8]>::len),
            other => panic!("a replay claim answered {other:?}"),
        }
    }
    seen
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.keys == 0 {
        return Err("--keys must be positive".into());
    }
    let dir = tempfile::tempdir()?;
    let store = Store::open_with(
        dir.path().join("idem.redb"),
        Config::new()
            .retention(Duration::from_secs(10 * 365 * 24 * 3600))
            .sweep_interval(None),
    )?;
    let fingerprint = Fingerprint::of(b"replay-cost");
    let keys: Vec<Key> = (0..args.keys)
        .map(|n| Key::new("bench", format!("key-{n:012}")))
        .collect::<Result<_, _>>()?;
    for key in &keys {
        match store.claim(key, &fingerprint, &ClaimOptions::default())? {
            ClaimOutcome::Acquired(lease) => {
                store.complete(&lease, b"{\"ticket\":\"T-1\"}")?;
            }
            other => return Err(format!("a fresh key answered {other:?}").into()),
        }
    }
    // One replay of every key, to fill the read cache, outside the measured
    // loop.
    for key in &keys {
        let _ = black_box(store.claim(key, &fingerprint, &ClaimOptions::default())?);
    }
    let start = Instant::now();
    let seen = black_box(replay_loop(&store, &keys, &fingerprint, args.replays));
    let elapsed = start.elapsed();
    println!(
        "replays={} ns_per_replay={:.0} result_bytes={seen}",
        args.replays,
        elapsed.as_nanos() as f64 / args.replays as f64
    );
    drop(store);
    Ok(())
}
