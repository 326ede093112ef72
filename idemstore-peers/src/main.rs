//! Times idemstore against the stores a user would otherwise reach for, in
//! one process run, side by side.
//!
//! ```text
//! cargo run --release -p idemstore-peers -- --threads 64 --seconds 5
//! cargo run --release -p idemstore-peers -- --threads 2 --seconds 5 --replay
//! REDIS_URL=redis://127.0.0.1:6399/ cargo run --release -p idemstore-peers -- --threads 64
//! ```
//!
//! Every peer runs the same client threads doing the same lifecycles: a claim
//! of a fresh key (insert-if-absent with the request's fingerprint and a
//! 30 s lease), then a complete (a guarded update by fencing token that
//! stores a 64-byte result and a 24 h retention), each durable before it
//! returns. The peers:
//!
//! - `idemstore`: [`Store`] with the default [`Config`] (every change
//!   fsynced before it is acknowledged); with `--buffered-ms N`, with
//!   [`Durability::Buffered`] instead (acknowledged before the fsync, which
//!   follows within N ms): not the default durability, and not durable
//!   against a power loss, so its ratios are not the targets' ratios.
//! - `sqlite`: SQLite (bundled) in WAL mode with `synchronous=FULL`, one
//!   connection per thread, one transaction per operation:
//!   `INSERT … ON CONFLICT DO NOTHING` and a guarded `UPDATE`.
//! - `redb-naive`: redb with one durable write transaction per operation
//!   from each thread.
//! - `fsync-floor`: the physical ceiling, no index at all: the same request
//!   hand-off as idemstore's writer (a bounded queue of requests with
//!   one-shot replies; a writer thread drains every waiting request, appends
//!   one frame per request to a preallocated file, overwriting it in a ring,
//!   calls fdatasync once per batch, then wakes the callers).
//! - `map`: a `Mutex<HashMap>` in memory, doing the same decisions, durable
//!   never.
//! - `redis`, only when `REDIS_URL` is set: `SET NX PX` then a guarded
//!   update (a Lua script comparing the token), one connection per thread,
//!   for a user who would otherwise run Redis with `appendfsync always`.
//! - `postgres`, only with `--postgres URL`: idemstore's PostgreSQL engine
//!   ([`Store::connect`], 16 connections, group commit over the wire) in a
//!   fresh schema per run, dropped afterwards.
//! - `postgres-naive`, only with `--postgres URL`: the per-request recipe
//!   most services write, on the same server: `INSERT … ON CONFLICT DO
//!   NOTHING` (token from a sequence) to claim, then a guarded `UPDATE` to
//!   complete, each one statement in a transaction of its own (autocommit),
//!   over a pool of 16 connections (the sync `postgres` client, statements
//!   prepared once per connection), in a fresh schema per run.
//!
//! It prints `peer=<name> threads=<n> lifecycles_per_s=<x>` per peer and ends
//! with `ratio threads=<n> idemstore/sqlite=<x> idemstore/redb-naive=<y>
//! idemstore/fsync-floor=<z>` (plus `idemstore/redis=<r>` when Redis ran).
//! With `--postgres URL` a second line follows: `ratio threads=<n>
//! postgres/postgres-naive=<x> postgres/idemstore=<y>`.
//! Built with `--features metrics`, idemstore publishes its metrics to an
//! installed Prometheus recorder, to measure what the feature costs.
//!
//! `--replay` times replay claims of finished keys against the in-memory map
//! instead and ends with `replay threads=<n> idemstore/map=<m>`. With
//! `--runs N` every peer is timed N times, in turn, and the lines give the
//! median with `min=` and `max=`. With `--warmup S` every peer first runs
//! the same lifecycle load for S seconds on its new store, untimed, so that
//! its files reach their working size (idemstore's log grows from 1 MiB to
//! 64 MiB in its first seconds, with a checkpoint at each doubling) before
//! the timed seconds; without it a run times a store from its first write.
//!
//! Files go to a temporary directory under `--dir` (the system's temporary
//! directory by default), which must be on the disk you mean to measure (not
//! a tmpfs), and are removed at the end. BENCHMARKS.md has the figures.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Barrier, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use idemstore::{
    ClaimOptions, ClaimOutcome, Config, Durability as IdemDurability, Fingerprint, Key, Lease,
    Store,
};
use redb::{Durability, ReadableTable, TableDefinition};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxResult<T> = Result<T, BoxError>;

/// The lease of every claim (ms), idemstore's default.
const LEASE_MS: u64 = 30_000;
/// The retention of every finished record (ms), idemstore's default.
const RETENTION_MS: u64 = 24 * 3600 * 1000;
/// The bytes every complete stores.
const RESULT_LEN: usize = 64;
/// The scope of every key.
const SCOPE: &str = "bench/tickets.create";

#[derive(Parser, Debug)]
#[command(about = "Times idemstore's claim + complete lifecycle against its peers")]
struct Args {
    /// Client threads; each runs lifecycles (or replays) back to back.
    #[arg(long, default_value_t = 64)]
    threads: usize,
    /// Seconds each peer is timed in each run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Seconds of the same lifecycle load each peer runs on its new store
    /// before it is timed, on keys of their own (lifecycle runs only): the
    /// files reach their working size first, as the fsync floor's ring
    /// file is written in full before timing. 0: none.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Time replay claims of finished keys (idemstore against the in-memory
    /// map) instead of lifecycles.
    #[arg(long)]
    replay: bool,
    /// Finished keys each store holds for `--replay`.
    #[arg(long, default_value_t = 100_000)]
    replay_keys: u64,
    /// How many times every peer is timed, in turn; the lines then give the
    /// median, min and max.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Only these peers of the lifecycle runs (comma-separated names); all
    /// of them by default.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// Where the peers' files go (a temporary directory is made inside);
    /// the system's temporary directory by default. Not a tmpfs.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Open the idemstore peer with `Durability::Buffered` and this
    /// `max_delay` (milliseconds, 1 to 3 600 000) instead of the default
    /// `Durability::Immediate`: calls return before the fsync. Not the
    /// default durability; the other peers are unchanged.
    #[arg(long)]
    buffered_ms: Option<u64>,
    /// A PostgreSQL server (`postgresql://user@host:port/db`, no TLS) for
    /// the peers `postgres` (idemstore's PostgreSQL engine) and
    /// `postgres-naive` (one transaction per operation over a pool of 16
    /// connections). Each run works in schemas of its own, dropped
    /// afterwards. Use a server with `fsync` on.
    #[arg(long)]
    postgres: Option<String>,
    /// Connections of the `postgres` peer (idemstore's engine,
    /// `Config::postgres_connections`); the naive recipe's pool stays at 16.
    #[arg(long, default_value_t = PG_POOL)]
    postgres_connections: usize,
}

fn main() -> BoxResult<()> {
    let args = Args::parse();
    // With the `metrics` feature, idemstore counts into a real recorder (as
    // a service exporting to Prometheus would), installed before any store
    // is opened.
    #[cfg(feature = "metrics")]
    {
        metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
        println!("idemstore metrics=prometheus-recorder");
    }
    if args.threads == 0 || args.runs == 0 || args.seconds <= 0.0 || args.replay_keys == 0 {
        return Err("--threads, --runs, --seconds and --replay-keys must be positive".into());
    }
    if let Some(ms) = args.buffered_ms {
        println!("idemstore durability=buffered max_delay_ms={ms} (not the default)");
    }
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::Builder::new()
        .prefix("idemstore-peers-")
        .tempdir_in(&base)?;
    let redis_url = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty());
    if args.replay {
        run_replay(&args, dir.path())
    } else {
        run_lifecycles(&args, dir.path(), redis_url.as_deref())
    }
}

// ---------------------------------------------------------------------------
// The harness: requests, client threads, timing, the printed lines.

/// One request as every peer receives it: the idempotency key (idemstore's
/// [`Key`] and the same key flattened for the other peers) and the
/// fingerprint of the request payload.
struct Req {
    key: Key,
    flat: String,
    fingerprint: Fingerprint,
}

impl Req {
    /// The request numbered `n`: a pseudo-random id (so keys land all over
    /// each index, as real idempotency keys do) and the SHA-256 of its
    /// payload.
    fn new(n: u64) -> BoxResult<Req> {
        let id = format!("{:016x}", splitmix64(n));
        let payload = format!(r#"{{"ticket":"{id}","title":"printer on fire"}}"#);
        Ok(Req {
            flat: format!("{SCOPE}/{id}"),
            key: Key::new(SCOPE, id)?,
            fingerprint: Fingerprint::of(payload.as_bytes()),
        })
    }

    /// The result stored for this request.
    fn result(&self) -> Vec<u8> {
        let mut r = format!("ticket {}", self.key.id()).into_bytes();
        r.resize(RESULT_LEN, b'.');
        r
    }
}

/// A bijection on u64 with good mixing (SplitMix64's finaliser): distinct
/// inputs give distinct, well-spread ids.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a peer's claim found.
#[derive(Debug)]
enum Claimed<L> {
    /// The caller holds the key under this lease.
    Acquired(L),
    /// The key's work finished: the stored result.
    Replay(Vec<u8>),
    /// Another valid lease holds the key.
    InProgress,
    /// The key is bound to another fingerprint.
    Mismatch,
}

/// A store under test. `Client` is each thread's own handle (a connection);
/// `Lease` is what a claim hands to the complete.
trait Peer: Sync {
    type Client;
    type Lease: std::fmt::Debug;
    /// Opens one thread's handle.
    fn client(&self) -> BoxResult<Self::Client>;
    /// Insert-if-absent of `req.key` with its fingerprint and a lease.
    fn claim(&self, c: &mut Self::Client, req: &Req) -> BoxResult<Claimed<Self::Lease>>;
    /// The guarded update: stores `result` if `lease` is still current.
    fn complete(
        &self,
        c: &mut Self::Client,
        req: &Req,
        lease: Self::Lease,
        result: &[u8],
    ) -> BoxResult<()>;
}

/// Runs `work(thread, client, n)` on `threads` threads, back to back, for
/// `seconds` each, started together; returns operations per second.
fn time_threads<P, F>(peer: &P, threads: usize, seconds: f64, work: F) -> BoxResult<f64>
where
    P: Peer,
    F: Fn(usize, &mut P::Client, u64) -> BoxResult<()> + Sync,
{
    let barrier = Barrier::new(threads + 1);
    let span = Duration::from_secs_f64(seconds);
    let (total, elapsed) = std::thread::scope(|s| -> BoxResult<(u64, Duration)> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, work) = (&barrier, &work);
                s.spawn(move || -> BoxResult<u64> {
                    // Wait at the barrier even when the client failed, so
                    // that nobody waits forever.
                    let client = peer.client();
                    barrier.wait();
                    let mut client = client?;
                    let deadline = Instant::now() + span;
                    let mut n = 0;
                    while Instant::now() < deadline {
                        work(t, &mut client, n)?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut total = 0;
        let mut first_err = None;
        for h in handles {
            match h.join().map_err(|_| "a client thread panicked")? {
                Ok(n) => total += n,
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok((total, start.elapsed())),
        }
    })?;
    Ok(total as f64 / elapsed.as_secs_f64())
}

/// Times full lifecycles (claim, then complete) of fresh keys.
fn time_lifecycles<P: Peer>(
    peer: &P,
    name: &str,
    threads: usize,
    seconds: f64,
    warmup: f64,
) -> BoxResult<f64> {
    if warmup > 0.0 {
        // Warm-up keys carry a thread number above every timed one.
        time_lifecycle_load(peer, name, threads, warmup, threads.saturating_add(1))?;
    }
    time_lifecycle_load(peer, name, threads, seconds, 0)
}

/// Runs lifecycles on fresh keys for `seconds` from `threads` threads, the
/// keys of thread `t` numbered from `(t + base) << 40`; returns the rate.
fn time_lifecycle_load<P: Peer>(
    peer: &P,
    name: &str,
    threads: usize,
    seconds: f64,
    base: usize,
) -> BoxResult<f64> {
    time_threads(peer, threads, seconds, |t, client, n| {
        let req = Req::new((((t + base) as u64) << 40) | n)?;
        let lease = match peer.claim(client, &req)? {
            Claimed::Acquired(lease) => lease,
            other => return Err(format!("{name}: a fresh claim answered {other:?}").into()),
        };
        peer.complete(client, &req, lease, &req.result())
    })
}

/// Fills `peer` with `keys` finished keys, numbered `0..keys`, from 16
/// threads.
fn populate<P: Peer>(peer: &P, keys: u64) -> BoxResult<()> {
    let next = AtomicU64::new(0);
    std::thread::scope(|s| -> BoxResult<()> {
        let handles: Vec<_> = (0..16)
            .map(|_| {
                s.spawn(|| -> BoxResult<()> {
                    let mut client = peer.client()?;
                    loop {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        if n >= keys {
                            return Ok(());
                        }
                        let req = Req::new(n)?;
                        match peer.claim(&mut client, &req)? {
                            Claimed::Acquired(lease) => {
                                peer.complete(&mut client, &req, lease, &req.result())?
                            }
                            other => return Err(format!("populating: {other:?}").into()),
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "a populating thread panicked")??;
        }
        Ok(())
    })
}

/// Times replay claims of the finished keys `0..table.len()`, each thread
/// visiting them in its own pseudo-random order. The requests are built
/// before timing starts.
fn time_replays<P: Peer>(
    peer: &P,
    name: &str,
    table: &[(Req, Vec<u8>)],
    threads: usize,
    seconds: f64,
) -> BoxResult<f64> {
    time_threads(peer, threads, seconds, |t, client, n| {
        let i = splitmix64(((t as u64) << 40) | n) % table.len() as u64;
        let (req, expected) = &table[i as usize];
        match peer.claim(client, req)? {
            Claimed::Replay(result) if result == *expected => Ok(()),
            other => Err(format!("{name}: a replay claim answered {other:?}").into()),
        }
    })
}

/// The figures of one peer over all runs.
struct Figures {
    name: &'static str,
    per_s: Vec<f64>,
}

impl Figures {
    fn median(&self) -> f64 {
        let mut v = self.per_s.clone();
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        if v.len() % 2 == 1 {
            v[mid]
        } else {
            (v[mid - 1] + v[mid]) / 2.0
        }
    }

    fn line(&self, threads: usize, unit: &str) -> String {
        let mut line = format!(
            "peer={} threads={threads} {unit}={:.0}",
            self.name,
            self.median()
        );
        if self.per_s.len() > 1 {
            let min = self.per_s.iter().copied().fold(f64::INFINITY, f64::min);
            let max = self.per_s.iter().copied().fold(0.0, f64::max);
            line += &format!(" min={min:.0} max={max:.0} runs={}", self.per_s.len());
        }
        line
    }
}

fn ratio(figures: &[Figures], a: &str, b: &str) -> Option<String> {
    let get = |n: &str| figures.iter().find(|f| f.name == n).map(Figures::median);
    Some(format!(" {a}/{b}={:.2}", get(a)? / get(b)?))
}

fn wanted(args: &Args, name: &str) -> bool {
    args.peers.is_empty() || args.peers.iter().any(|p| p == name)
}

fn record(figures: &mut Vec<Figures>, name: &'static str, per_s: f64) {
    match figures.iter_mut().find(|f| f.name == name) {
        Some(f) => f.per_s.push(per_s),
        None => figures.push(Figures {
            name,
            per_s: vec![per_s],
        }),
    }
}

/// The lifecycle peers, in the order of the first run.
const LIFECYCLE_PEERS: [&str; 8] = [
    "idemstore",
    "sqlite",
    "redb-naive",
    "fsync-floor",
    "map",
    "redis",
    "postgres",
    "postgres-naive",
];

/// Times the lifecycles of the peer `name` on a new, empty store in `dir`;
/// `None` for Redis without `REDIS_URL` and for the PostgreSQL peers
/// without `--postgres`.
fn time_peer(
    name: &'static str,
    args: &Args,
    dir: &Path,
    redis_url: Option<&str>,
    run: usize,
) -> BoxResult<Option<f64>> {
    let (threads, seconds) = (args.threads, args.seconds);
    Ok(Some(match name {
        "idemstore" => {
            let peer = IdemPeer::open(&dir.join("idem.redb"), args.buffered_ms)?;
            time_lifecycles(&peer, name, threads, seconds, args.warmup)?
        }
        "sqlite" => {
            let peer = SqlitePeer::open(&dir.join("peer.sqlite"))?;
            time_lifecycles(&peer, name, threads, seconds, args.warmup)?
        }
        "redb-naive" => {
            let peer = RedbPeer::open(&dir.join("naive.redb"))?;
            time_lifecycles(&peer, name, threads, seconds, args.warmup)?
        }
        "fsync-floor" => {
            let peer = FloorPeer::open(&dir.join("floor.log"))?;
            time_lifecycles(&peer, name, threads, seconds, args.warmup)?
        }
        "map" => time_lifecycles(&MapPeer::default(), name, threads, seconds, args.warmup)?,
        "redis" => match redis_url {
            Some(url) => time_lifecycles(
                &RedisPeer::new(url, run)?,
                name,
                threads,
                seconds,
                args.warmup,
            )?,
            None => return Ok(None),
        },
        "postgres" => match args.postgres.as_deref() {
            Some(url) => {
                let schema = pg_schema("idem", run);
                let peer = IdemPeer {
                    store: Store::connect(
                        url,
                        Config::new()
                            .postgres_schema(&schema)
                            .postgres_connections(args.postgres_connections),
                    )?,
                    options: ClaimOptions::new(),
                };
                let timed = time_lifecycles(&peer, name, threads, seconds, args.warmup);
                drop(peer);
                pg_drop_schema(url, &schema)?;
                timed?
            }
            None => return Ok(None),
        },
        "postgres-naive" => match args.postgres.as_deref() {
            Some(url) => {
                let peer = PgNaivePeer::open(url, pg_schema("naive", run))?;
                let timed = time_lifecycles(&peer, name, threads, seconds, args.warmup);
                let schema = peer.schema.clone();
                drop(peer);
                pg_drop_schema(url, &schema)?;
                timed?
            }
            None => return Ok(None),
        },
        other => return Err(format!("no peer named {other}").into()),
    }))
}

fn run_lifecycles(args: &Args, dir: &Path, redis_url: Option<&str>) -> BoxResult<()> {
    const UNIT: &str = "lifecycles_per_s";
    for p in &args.peers {
        if !LIFECYCLE_PEERS.contains(&p.as_str()) {
            return Err(format!("no peer named {p}; the peers are {LIFECYCLE_PEERS:?}").into());
        }
    }
    let mut figures: Vec<Figures> = Vec::new();
    for run in 1..=args.runs {
        // Each run starts with the next peer, so that no peer always runs
        // first (or right after the same neighbour) on a noisy machine.
        let mut order = LIFECYCLE_PEERS;
        order.rotate_left((run - 1) % LIFECYCLE_PEERS.len());
        for name in order.into_iter().filter(|n| wanted(args, n)) {
            // Each peer starts from an empty store in every run.
            let peer_dir = dir.join(format!("run-{run}-{name}"));
            std::fs::create_dir(&peer_dir)?;
            let timed = time_peer(name, args, &peer_dir, redis_url, run)?;
            std::fs::remove_dir_all(&peer_dir)?;
            let Some(per_s) = timed else { continue };
            if args.runs > 1 {
                println!(
                    "run={run} peer={name} threads={} {UNIT}={per_s:.0}",
                    args.threads
                );
            }
            record(&mut figures, name, per_s);
        }
    }
    // Lines in the fixed peer order, whatever order the runs took.
    figures.sort_by_key(|f| LIFECYCLE_PEERS.iter().position(|n| *n == f.name));
    for f in &figures {
        println!("{}", f.line(args.threads, UNIT));
    }
    let mut line = format!("ratio threads={}", args.threads);
    for peer in ["sqlite", "redb-naive", "fsync-floor", "redis"] {
        line += &ratio(&figures, "idemstore", peer).unwrap_or_default();
    }
    println!("{line}");
    if args.postgres.is_some() {
        let mut line = format!("ratio threads={}", args.threads);
        for peer in ["postgres-naive", "idemstore"] {
            line += &ratio(&figures, "postgres", peer).unwrap_or_default();
        }
        println!("{line}");
    }
    Ok(())
}

fn run_replay(args: &Args, dir: &Path) -> BoxResult<()> {
    const UNIT: &str = "replays_per_s";
    let table: Vec<(Req, Vec<u8>)> = (0..args.replay_keys)
        .map(|n| {
            let req = Req::new(n)?;
            let result = req.result();
            Ok((req, result))
        })
        .collect::<BoxResult<_>>()?;
    let idem = IdemPeer::open(&dir.join("idem.redb"), args.buffered_ms)?;
    let map = MapPeer::default();
    populate(&idem, args.replay_keys)?;
    populate(&map, args.replay_keys)?;
    let mut figures: Vec<Figures> = Vec::new();
    for run in 1..=args.runs {
        // Alternate which peer goes first, as the lifecycle runs rotate.
        let mut order = ["idemstore", "map"];
        order.rotate_left((run - 1) % 2);
        for name in order {
            let per_s = match name {
                "idemstore" => time_replays(&idem, name, &table, args.threads, args.seconds)?,
                _ => time_replays(&map, name, &table, args.threads, args.seconds)?,
            };
            if args.runs > 1 {
                println!(
                    "run={run} peer={name} threads={} {UNIT}={per_s:.0}",
                    args.threads
                );
            }
            record(&mut figures, name, per_s);
        }
    }
    figures.sort_by_key(|f| f.name != "idemstore");
    for f in &figures {
        println!("{}", f.line(args.threads, UNIT));
    }
    println!(
        "replay threads={}{}",
        args.threads,
        ratio(&figures, "idemstore", "map").unwrap_or_default()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// A peer's record: what idemstore keeps per key, in a plain layout, and the
// decision a claim makes on an existing record.

const PROCESSING: u8 = 0;
const SUCCEEDED: u8 = 1;

/// A record of one key as the non-idemstore peers keep it.
#[derive(Debug, Clone)]
struct PeerRecord {
    state: u8,
    token: u64,
    lease_until_ms: u64,
    expires_ms: u64,
    fingerprint: Vec<u8>,
    result: Vec<u8>,
}

impl PeerRecord {
    fn processing(req: &Req, token: u64, now: u64) -> PeerRecord {
        PeerRecord {
            state: PROCESSING,
            token,
            lease_until_ms: now + LEASE_MS,
            expires_ms: now + RETENTION_MS,
            fingerprint: req.fingerprint.as_bytes().to_vec(),
            result: Vec::new(),
        }
    }

    /// `[state u8][token u64][lease_until u64][expires u64][fp len u8][fp][result]`,
    /// little-endian. The token is at bytes 1..9 (the Redis script reads it).
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(26 + self.fingerprint.len() + self.result.len());
        b.push(self.state);
        b.extend_from_slice(&self.token.to_le_bytes());
        b.extend_from_slice(&self.lease_until_ms.to_le_bytes());
        b.extend_from_slice(&self.expires_ms.to_le_bytes());
        b.push(self.fingerprint.len() as u8);
        b.extend_from_slice(&self.fingerprint);
        b.extend_from_slice(&self.result);
        b
    }

    fn decode(b: &[u8]) -> BoxResult<PeerRecord> {
        let u64_at = |i: usize| -> BoxResult<u64> {
            Ok(u64::from_le_bytes(
                b.get(i..i + 8).ok_or("short record")?.try_into()?,
            ))
        };
        let fp_len = *b.get(25).ok_or("short record")? as usize;
        Ok(PeerRecord {
            state: b[0],
            token: u64_at(1)?,
            lease_until_ms: u64_at(9)?,
            expires_ms: u64_at(17)?,
            fingerprint: b.get(26..26 + fp_len).ok_or("short record")?.to_vec(),
            result: b[26 + fp_len..].to_vec(),
        })
    }

    /// What a claim of `req` finds in this record; `None` when the record
    /// can be taken over (past retention, or its lease lapsed).
    fn decide<L>(&self, req: &Req, now: u64) -> Option<Claimed<L>> {
        if now >= self.expires_ms {
            return None;
        }
        if self.fingerprint != req.fingerprint.as_bytes() {
            return Some(Claimed::Mismatch);
        }
        match self.state {
            SUCCEEDED => Some(Claimed::Replay(self.result.clone())),
            _ if now < self.lease_until_ms => Some(Claimed::InProgress),
            _ => None,
        }
    }

    /// The record after a complete under `token`, or `None` if the token is
    /// not the current holder's.
    fn completed(mut self, token: u64, result: &[u8], now: u64) -> Option<PeerRecord> {
        if self.state != PROCESSING || self.token != token || now >= self.expires_ms {
            return None;
        }
        self.state = SUCCEEDED;
        self.result = result.to_vec();
        self.expires_ms = now + RETENTION_MS;
        Some(self)
    }
}

// ---------------------------------------------------------------------------
// idemstore

struct IdemPeer {
    store: Store,
    options: ClaimOptions,
}

impl IdemPeer {
    /// Opens the store with the default durability, or buffered with a
    /// `max_delay` of `buffered_ms` milliseconds.
    fn open(path: &Path, buffered_ms: Option<u64>) -> BoxResult<IdemPeer> {
        let mut config = Config::new();
        if let Some(ms) = buffered_ms {
            config = config.durability(IdemDurability::Buffered {
                max_delay: Duration::from_millis(ms),
            });
        }
        Ok(IdemPeer {
            store: Store::open_with(path, config)?,
            options: ClaimOptions::new(),
        })
    }
}

impl Peer for IdemPeer {
    type Client = ();
    type Lease = Lease;

    fn client(&self) -> BoxResult<()> {
        Ok(())
    }

    fn claim(&self, _: &mut (), req: &Req) -> BoxResult<Claimed<Lease>> {
        Ok(
            match self.store.claim(&req.key, &req.fingerprint, &self.options) {
                Ok(ClaimOutcome::Acquired(lease)) => Claimed::Acquired(lease),
                Ok(ClaimOutcome::Replay(record)) => {
                    Claimed::Replay(record.result().unwrap_or_default().to_vec())
                }
                Ok(ClaimOutcome::InProgress { .. }) => Claimed::InProgress,
                Err(idemstore::Error::FingerprintMismatch { .. }) => Claimed::Mismatch,
                Err(e) => return Err(e.into()),
            },
        )
    }

    fn complete(&self, _: &mut (), _: &Req, lease: Lease, result: &[u8]) -> BoxResult<()> {
        self.store.complete(&lease, result)?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Mutex<HashMap>: the same decisions in memory, no durability.

#[derive(Default)]
struct MapPeer {
    inner: Mutex<MapState>,
}

#[derive(Default)]
struct MapState {
    records: HashMap<String, PeerRecord>,
    next_token: u64,
}

impl Peer for MapPeer {
    type Client = ();
    type Lease = u64;

    fn client(&self) -> BoxResult<()> {
        Ok(())
    }

    fn claim(&self, _: &mut (), req: &Req) -> BoxResult<Claimed<u64>> {
        let now = now_ms();
        let mut guard = self.inner.lock().map_err(|_| "map lock poisoned")?;
        let state = &mut *guard;
        if let Some(found) = state
            .records
            .get(&req.flat)
            .and_then(|r| r.decide(req, now))
        {
            return Ok(found);
        }
        let token = state.next_token;
        state.next_token += 1;
        state
            .records
            .insert(req.flat.clone(), PeerRecord::processing(req, token, now));
        Ok(Claimed::Acquired(token))
    }

    fn complete(&self, _: &mut (), req: &Req, token: u64, result: &[u8]) -> BoxResult<()> {
        let now = now_ms();
        let mut guard = self.inner.lock().map_err(|_| "map lock poisoned")?;
        let record = guard.records.get_mut(&req.flat).ok_or("map: record gone")?;
        *record = record
            .clone()
            .completed(token, result, now)
            .ok_or("map: stale lease")?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// redb used naively: one durable write transaction per operation.

const NAIVE_RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records");
const NAIVE_META: TableDefinition<&str, u64> = TableDefinition::new("meta");

struct RedbPeer {
    db: redb::Database,
}

impl RedbPeer {
    fn open(path: &Path) -> BoxResult<RedbPeer> {
        let db = redb::Database::create(path)?;
        let txn = db.begin_write()?;
        txn.open_table(NAIVE_RECORDS)?;
        txn.open_table(NAIVE_META)?.insert("next_token", 1)?;
        txn.commit()?;
        Ok(RedbPeer { db })
    }

    fn durable_write(&self) -> BoxResult<redb::WriteTransaction> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        Ok(txn)
    }
}

impl Peer for RedbPeer {
    type Client = ();
    type Lease = u64;

    fn client(&self) -> BoxResult<()> {
        Ok(())
    }

    fn claim(&self, _: &mut (), req: &Req) -> BoxResult<Claimed<u64>> {
        let now = now_ms();
        let txn = self.durable_write()?;
        let token = {
            let mut records = txn.open_table(NAIVE_RECORDS)?;
            let existing = match records.get(req.flat.as_str())? {
                Some(v) => Some(PeerRecord::decode(v.value())?),
                None => None,
            };
            if let Some(found) = existing.and_then(|r| r.decide(req, now)) {
                drop(records);
                txn.abort()?;
                return Ok(found);
            }
            let mut meta = txn.open_table(NAIVE_META)?;
            let token = meta
                .get("next_token")?
                .ok_or("redb-naive: no token")?
                .value();
            meta.insert("next_token", token + 1)?;
            let record = PeerRecord::processing(req, token, now).encode();
            records.insert(req.flat.as_str(), record.as_slice())?;
            token
        };
        txn.commit()?;
        Ok(Claimed::Acquired(token))
    }

    fn complete(&self, _: &mut (), req: &Req, token: u64, result: &[u8]) -> BoxResult<()> {
        let now = now_ms();
        let txn = self.durable_write()?;
        {
            let mut records = txn.open_table(NAIVE_RECORDS)?;
            let current = match records.get(req.flat.as_str())? {
                Some(v) => PeerRecord::decode(v.value())?,
                None => return Err("redb-naive: record gone".into()),
            };
            let done = current
                .completed(token, result, now)
                .ok_or("redb-naive: stale lease")?;
            records.insert(req.flat.as_str(), done.encode().as_slice())?;
        }
        txn.commit()?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// SQLite (bundled) in WAL mode with synchronous=FULL, a connection per
// thread, one transaction per operation.

struct SqlitePeer {
    path: PathBuf,
}

impl SqlitePeer {
    fn open(path: &Path) -> BoxResult<SqlitePeer> {
        let peer = SqlitePeer {
            path: path.to_path_buf(),
        };
        let conn = peer.connect()?;
        conn.execute_batch(
            "CREATE TABLE records (
                 key TEXT PRIMARY KEY,
                 fingerprint BLOB NOT NULL,
                 state INTEGER NOT NULL,
                 token INTEGER NOT NULL,
                 lease_until_ms INTEGER NOT NULL,
                 expires_ms INTEGER NOT NULL,
                 result BLOB
             ) WITHOUT ROWID;
             CREATE TABLE meta (next_token INTEGER NOT NULL);
             INSERT INTO meta VALUES (1);",
        )?;
        Ok(peer)
    }

    fn connect(&self) -> BoxResult<rusqlite::Connection> {
        let conn = rusqlite::Connection::open(&self.path)?;
        conn.busy_timeout(Duration::from_secs(60))?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("sqlite: journal_mode is {mode}, not wal").into());
        }
        conn.execute_batch("PRAGMA synchronous = FULL;")?;
        Ok(conn)
    }
}

impl Peer for SqlitePeer {
    type Client = rusqlite::Connection;
    type Lease = u64;

    fn client(&self) -> BoxResult<rusqlite::Connection> {
        self.connect()
    }

    fn claim(&self, conn: &mut rusqlite::Connection, req: &Req) -> BoxResult<Claimed<u64>> {
        use rusqlite::{OptionalExtension, TransactionBehavior, params};
        let now = now_ms();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let token: i64 = tx
            .prepare_cached("SELECT next_token FROM meta")?
            .query_row([], |r| r.get(0))?;
        let inserted = tx
            .prepare_cached(
                "INSERT INTO records (key, fingerprint, state, token, lease_until_ms, expires_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (key) DO NOTHING",
            )?
            .execute(params![
                req.flat,
                req.fingerprint.as_bytes(),
                PROCESSING,
                token,
                (now + LEASE_MS) as i64,
                (now + RETENTION_MS) as i64
            ])?;
        if inserted == 0 {
            // The key exists: replay, in progress, mismatch, or take over.
            let existing = tx
                .prepare_cached(
                    "SELECT fingerprint, state, token, lease_until_ms, expires_ms, result
                     FROM records WHERE key = ?1",
                )?
                .query_row([&req.flat], |r| {
                    Ok(PeerRecord {
                        fingerprint: r.get(0)?,
                        state: r.get(1)?,
                        token: r.get::<_, i64>(2)? as u64,
                        lease_until_ms: r.get::<_, i64>(3)? as u64,
                        expires_ms: r.get::<_, i64>(4)? as u64,
                        result: r.get::<_, Option<Vec<u8>>>(5)?.unwrap_or_default(),
                    })
                })
                .optional()?
                .ok_or("sqlite: conflicting row vanished")?;
            if let Some(found) = existing.decide(req, now) {
                tx.rollback()?;
                return Ok(found);
            }
            tx.prepare_cached(
                "UPDATE records SET fingerprint = ?2, state = ?3, token = ?4,
                     lease_until_ms = ?5, expires_ms = ?6, result = NULL
                 WHERE key = ?1 AND token = ?7",
            )?
            .execute(params![
                req.flat,
                req.fingerprint.as_bytes(),
                PROCESSING,
                token,
                (now + LEASE_MS) as i64,
                (now + RETENTION_MS) as i64,
                existing.token as i64
            ])?;
        }
        tx.prepare_cached("UPDATE meta SET next_token = next_token + 1")?
            .execute([])?;
        tx.commit()?;
        Ok(Claimed::Acquired(token as u64))
    }

    fn complete(
        &self,
        conn: &mut rusqlite::Connection,
        req: &Req,
        token: u64,
        result: &[u8],
    ) -> BoxResult<()> {
        let now = now_ms();
        // One statement outside an explicit transaction is one transaction.
        let changed = conn
            .prepare_cached(
                "UPDATE records SET state = ?1, result = ?2, expires_ms = ?3
                 WHERE key = ?4 AND token = ?5 AND state = ?6 AND expires_ms > ?7",
            )?
            .execute(rusqlite::params![
                SUCCEEDED,
                result,
                (now + RETENTION_MS) as i64,
                req.flat,
                token as i64,
                PROCESSING,
                now as i64
            ])?;
        if changed != 1 {
            return Err("sqlite: stale lease".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// The fsync floor: idemstore's request hand-off with no index at all.

/// The ring file's size (bytes), written in full before timing so that
/// overwrites never change the file's size or allocation.
const FLOOR_FILE_BYTES: u64 = 64 * 1024 * 1024;
/// The most requests one batch takes, as idemstore's writer.
const FLOOR_MAX_BATCH: usize = 1024;
/// The most requests waiting before callers block, as idemstore's writer.
const FLOOR_QUEUE_BOUND: usize = 4096;

struct FloorRequest {
    /// The frame body (key, fingerprint or token and result).
    body: Vec<u8>,
    reply: oneshot::Sender<u64>,
}

struct FloorPeer {
    tx: Option<SyncSender<FloorRequest>>,
    writer: Option<JoinHandle<std::io::Result<()>>>,
}

impl FloorPeer {
    fn open(path: &Path) -> BoxResult<FloorPeer> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        let zeros = vec![0u8; 1024 * 1024];
        for _ in 0..FLOOR_FILE_BYTES / zeros.len() as u64 {
            file.write_all(&zeros)?;
        }
        file.sync_all()?;
        let (tx, rx) = sync_channel(FLOOR_QUEUE_BOUND);
        let writer = std::thread::Builder::new()
            .name("fsync-floor-writer".into())
            .spawn(move || floor_writer(&file, &rx))?;
        Ok(FloorPeer {
            tx: Some(tx),
            writer: Some(writer),
        })
    }

    fn submit(&self, body: Vec<u8>) -> BoxResult<u64> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .as_ref()
            .ok_or("fsync-floor: closed")?
            .send(FloorRequest { body, reply })
            .map_err(|_| "fsync-floor: writer gone")?;
        Ok(rx
            .recv()
            .map_err(|_| "fsync-floor: writer dropped a request")?)
    }
}

impl Drop for FloorPeer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            match w.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("fsync-floor writer failed: {e}"),
                Err(_) => eprintln!("fsync-floor writer panicked"),
            }
        }
    }
}

/// Drains every waiting request (up to a batch), appends one crc32-framed
/// record per request (`[len u32][crc32 u32][seq u64][body]`) in one write
/// at the ring's offset, calls fdatasync once, then wakes the callers with
/// their sequence numbers.
fn floor_writer(file: &File, rx: &Receiver<FloorRequest>) -> std::io::Result<()> {
    let mut batch: Vec<FloorRequest> = Vec::with_capacity(FLOOR_MAX_BATCH);
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut offset = 0u64;
    let mut seq = 0u64;
    while let Ok(first) = rx.recv() {
        batch.push(first);
        while batch.len() < FLOOR_MAX_BATCH {
            match rx.try_recv() {
                Ok(req) => batch.push(req),
                Err(_) => break,
            }
        }
        buf.clear();
        for req in &batch {
            seq += 1;
            let mut crc = crc32fast::Hasher::new();
            crc.update(&seq.to_le_bytes());
            crc.update(&req.body);
            buf.extend_from_slice(&(req.body.len() as u32).to_le_bytes());
            buf.extend_from_slice(&crc.finalize().to_le_bytes());
            buf.extend_from_slice(&seq.to_le_bytes());
            buf.extend_from_slice(&req.body);
        }
        if offset + buf.len() as u64 > FLOOR_FILE_BYTES {
            offset = 0;
        }
        file.write_all_at(&buf, offset)?;
        file.sync_data()?;
        offset += buf.len() as u64;
        let last = seq;
        let first_seq = last + 1 - batch.len() as u64;
        for (i, req) in batch.drain(..).enumerate() {
            let _ = req.reply.send(first_seq + i as u64);
        }
    }
    Ok(())
}

impl Peer for FloorPeer {
    type Client = ();
    type Lease = u64;

    fn client(&self) -> BoxResult<()> {
        Ok(())
    }

    /// Logs the claim (key, fingerprint, lease deadline); there is no index
    /// to decide on, so it always acquires, with its sequence number as token.
    fn claim(&self, _: &mut (), req: &Req) -> BoxResult<Claimed<u64>> {
        let now = now_ms();
        let mut body = Vec::with_capacity(64 + req.flat.len());
        body.push(b'c');
        body.extend_from_slice(&(now + LEASE_MS).to_le_bytes());
        body.push(req.fingerprint.as_bytes().len() as u8);
        body.extend_from_slice(req.fingerprint.as_bytes());
        body.extend_from_slice(req.flat.as_bytes());
        Ok(Claimed::Acquired(self.submit(body)?))
    }

    /// Logs the complete (key, token, result).
    fn complete(&self, _: &mut (), req: &Req, token: u64, result: &[u8]) -> BoxResult<()> {
        let now = now_ms();
        let mut body = Vec::with_capacity(32 + req.flat.len() + result.len());
        body.push(b'd');
        body.extend_from_slice(&token.to_le_bytes());
        body.extend_from_slice(&(now + RETENTION_MS).to_le_bytes());
        body.extend_from_slice(&(req.flat.len() as u16).to_le_bytes());
        body.extend_from_slice(req.flat.as_bytes());
        body.extend_from_slice(result);
        self.submit(body)?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Redis: SET NX PX, then a guarded update by token in a Lua script.

/// Replaces the record at KEYS[1] with ARGV[2] (retention ARGV[3] ms) if it
/// is still processing under the token ARGV[1] (8 bytes, as encoded by
/// `PeerRecord`); answers 1 if it did, 0 if the lease is stale.
const REDIS_COMPLETE: &str = r"
local v = redis.call('GET', KEYS[1])
if not v or string.byte(v, 1) ~= 0 or string.sub(v, 2, 9) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
";

struct RedisPeer {
    client: redis::Client,
    prefix: String,
    complete: redis::Script,
    next_token: AtomicU64,
}

impl RedisPeer {
    /// Keys go under `idemstore-peers:<pid>:<run>:`, expire with the lease
    /// or the retention, and are never flushed: use a Redis of your own.
    fn new(url: &str, run: usize) -> BoxResult<RedisPeer> {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_connection()?;
        let _: String = redis::cmd("PING").query(&mut conn)?;
        Ok(RedisPeer {
            client,
            prefix: format!("idemstore-peers:{}:{run}:", std::process::id()),
            complete: redis::Script::new(REDIS_COMPLETE),
            // Tokens only need to be unique here; Redis has no store-wide
            // counter without one more round trip.
            next_token: AtomicU64::new(1),
        })
    }
}

impl Peer for RedisPeer {
    type Client = redis::Connection;
    type Lease = u64;

    fn client(&self) -> BoxResult<redis::Connection> {
        Ok(self.client.get_connection()?)
    }

    fn claim(&self, conn: &mut redis::Connection, req: &Req) -> BoxResult<Claimed<u64>> {
        let now = now_ms();
        let key = format!("{}{}", self.prefix, req.flat);
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let record = PeerRecord::processing(req, token, now).encode();
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(record)
            .arg("NX")
            .arg("PX")
            .arg(LEASE_MS)
            .query(conn)?;
        if set.is_some() {
            return Ok(Claimed::Acquired(token));
        }
        let existing: Option<Vec<u8>> = redis::cmd("GET").arg(&key).query(conn)?;
        match existing.map(|b| PeerRecord::decode(&b)).transpose()? {
            Some(r) => Ok(r.decide(req, now).unwrap_or(Claimed::InProgress)),
            // Expired between the two commands: a retry would acquire it.
            None => Ok(Claimed::InProgress),
        }
    }

    fn complete(
        &self,
        conn: &mut redis::Connection,
        req: &Req,
        token: u64,
        result: &[u8],
    ) -> BoxResult<()> {
        let now = now_ms();
        let key = format!("{}{}", self.prefix, req.flat);
        let done = PeerRecord {
            state: SUCCEEDED,
            token,
            lease_until_ms: now,
            expires_ms: now + RETENTION_MS,
            fingerprint: req.fingerprint.as_bytes().to_vec(),
            result: result.to_vec(),
        };
        let ok: i64 = self
            .complete
            .key(key)
            .arg(&token.to_le_bytes()[..])
            .arg(done.encode())
            .arg(RETENTION_MS)
            .invoke(conn)?;
        if ok != 1 {
            return Err("redis: stale lease".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// PostgreSQL: idemstore's engine (above, through `Store::connect`) and the
// naive per-request recipe, each in a schema of its own per run.

/// Connections of both PostgreSQL peers: the engine's default, and the
/// naive recipe's pool.
const PG_POOL: usize = 16;

/// A schema name for one peer and run, unique to this process.
fn pg_schema(what: &str, run: usize) -> String {
    format!("peers_{what}_{}_{run}", std::process::id())
}

/// Drops a peer's schema and everything in it.
fn pg_drop_schema(url: &str, schema: &str) -> BoxResult<()> {
    let mut client = postgres::Client::connect(url, postgres::NoTls)?;
    client.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))?;
    Ok(())
}

/// One pooled connection with its statements, prepared once.
struct PgConn {
    client: postgres::Client,
    claim: postgres::Statement,
    read: postgres::Statement,
    take_over: postgres::Statement,
    complete: postgres::Statement,
}

/// The naive recipe: one statement, one transaction, per operation, over a
/// pool of [`PG_POOL`] connections shared by every client thread (a
/// `parking_lot` Mutex + Condvar; a thread waits when all are in use).
struct PgNaivePeer {
    schema: String,
    idle: parking_lot::Mutex<Vec<PgConn>>,
    freed: parking_lot::Condvar,
}

impl PgNaivePeer {
    fn open(url: &str, schema: String) -> BoxResult<PgNaivePeer> {
        let s = format!("\"{schema}\"");
        let mut admin = postgres::Client::connect(url, postgres::NoTls)?;
        admin.batch_execute(&format!(
            "CREATE SCHEMA {s};
             CREATE TABLE {s}.records (
                 key text PRIMARY KEY,
                 fingerprint bytea NOT NULL,
                 state smallint NOT NULL,
                 token bigint NOT NULL,
                 lease_until_ms bigint NOT NULL,
                 expires_ms bigint NOT NULL,
                 result bytea);
             CREATE SEQUENCE {s}.tokens;"
        ))?;
        let mut idle = Vec::with_capacity(PG_POOL);
        for _ in 0..PG_POOL {
            let mut client = postgres::Client::connect(url, postgres::NoTls)?;
            let claim = client.prepare(&format!(
                "INSERT INTO {s}.records \
                 (key, fingerprint, state, token, lease_until_ms, expires_ms) \
                 VALUES ($1, $2, 0, nextval('{s}.tokens'), $3, $4) \
                 ON CONFLICT (key) DO NOTHING RETURNING token"
            ))?;
            let read = client.prepare(&format!(
                "SELECT fingerprint, state, token, lease_until_ms, expires_ms, result \
                 FROM {s}.records WHERE key = $1"
            ))?;
            let take_over = client.prepare(&format!(
                "UPDATE {s}.records SET fingerprint = $2, state = 0, \
                 token = nextval('{s}.tokens'), lease_until_ms = $3, expires_ms = $4, \
                 result = NULL WHERE key = $1 AND token = $5 RETURNING token"
            ))?;
            let complete = client.prepare(&format!(
                "UPDATE {s}.records SET state = 1, result = $1, expires_ms = $2 \
                 WHERE key = $3 AND token = $4 AND state = 0 AND expires_ms > $5"
            ))?;
            idle.push(PgConn {
                client,
                claim,
                read,
                take_over,
                complete,
            });
        }
        Ok(PgNaivePeer {
            schema,
            idle: parking_lot::Mutex::new(idle),
            freed: parking_lot::Condvar::new(),
        })
    }

    /// Runs `f` on a pooled connection, waiting for one if all are in use.
    fn with_conn<T>(&self, f: impl FnOnce(&mut PgConn) -> BoxResult<T>) -> BoxResult<T> {
        let mut conn = {
            let mut idle = self.idle.lock();
            loop {
                match idle.pop() {
                    Some(c) => break c,
                    None => self.freed.wait(&mut idle),
                }
            }
        };
        let out = f(&mut conn);
        self.idle.lock().push(conn);
        self.freed.notify_one();
        out
    }
}

impl Peer for PgNaivePeer {
    type Client = ();
    type Lease = i64;

    fn client(&self) -> BoxResult<()> {
        Ok(())
    }

    fn claim(&self, _: &mut (), req: &Req) -> BoxResult<Claimed<i64>> {
        let now = now_ms();
        let lease = (now + LEASE_MS) as i64;
        let expires = (now + RETENTION_MS) as i64;
        let fp = req.fingerprint.as_bytes();
        self.with_conn(|c| {
            let inserted = c
                .client
                .query_opt(&c.claim, &[&req.flat, &fp, &lease, &expires])?;
            if let Some(row) = inserted {
                return Ok(Claimed::Acquired(row.try_get(0)?));
            }
            // The key exists: replay, in progress, mismatch, or take over.
            let Some(row) = c.client.query_opt(&c.read, &[&req.flat])? else {
                // Deleted between the two statements: a retry would acquire.
                return Ok(Claimed::InProgress);
            };
            let existing = PeerRecord {
                fingerprint: row.try_get(0)?,
                state: row.try_get::<_, i16>(1)? as u8,
                token: row.try_get::<_, i64>(2)? as u64,
                lease_until_ms: row.try_get::<_, i64>(3)? as u64,
                expires_ms: row.try_get::<_, i64>(4)? as u64,
                result: row.try_get::<_, Option<Vec<u8>>>(5)?.unwrap_or_default(),
            };
            if let Some(found) = existing.decide(req, now) {
                return Ok(found);
            }
            let seen = existing.token as i64;
            Ok(
                match c
                    .client
                    .query_opt(&c.take_over, &[&req.flat, &fp, &lease, &expires, &seen])?
                {
                    Some(row) => Claimed::Acquired(row.try_get(0)?),
                    None => Claimed::InProgress,
                },
            )
        })
    }

    fn complete(&self, _: &mut (), req: &Req, token: i64, result: &[u8]) -> BoxResult<()> {
        let now = now_ms();
        let expires = (now + RETENTION_MS) as i64;
        let changed = self.with_conn(|c| {
            Ok(c.client.execute(
                &c.complete,
                &[&result, &expires, &req.flat, &token, &(now as i64)],
            )?)
        })?;
        if changed != 1 {
            return Err("postgres-naive: stale lease".into());
        }
        Ok(())
    }
}
