//! Helpers shared by the integration tests: a store in a temporary directory
//! with a [`ManualClock`] at a real epoch time, key and fingerprint
//! shorthands, and real crashes (a child process that holds the store and is
//! killed with SIGKILL).
//!
//! # Child processes
//!
//! A test that needs a crash re-runs its own test binary as the child:
//! `current_exe() --exact <test name> --nocapture --test-threads=1`, with
//! [`CHILD_ENV`] set to the test's name. The test function asks
//! [`child_role`] first; in the child it does its part, reports values with
//! [`report`], calls [`ready_and_wait`] and is killed there by the parent.
//! The same command line works under `cargo test` and `cargo nextest` (both
//! run libtest binaries). Dropping a store is a clean shutdown, never a
//! crash: the child is always killed while it holds the store.
#![allow(dead_code)] // Each test crate uses a different part of this module.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Lease, ManualClock, Store};

/// The environment variable that makes a test act as the child of the test
/// named by its value.
pub const CHILD_ENV: &str = "IDEMSTORE_TEST_CHILD";
/// The prefix of every line the child reports on stdout (libtest prints its
/// own lines there too).
const REPORT_PREFIX: &str = "@@idemstore-child@@ ";
/// The line a child prints when it is ready to be killed.
const READY: &str = "READY";
/// How long a parent waits for a child to report before giving up: only a
/// guard against a hung child, never a measurement.
pub const CHILD_REPORT_TIMEOUT: Duration = Duration::from_secs(120);

/// The scope used by [`key`].
pub const SCOPE: &str = "test/op";

/// A key in [`SCOPE`].
pub fn key(id: &str) -> Key {
    Key::new(SCOPE, id).expect("valid test key")
}

/// A key in `scope`.
pub fn key_in(scope: &str, id: &str) -> Key {
    Key::new(scope, id).expect("valid test key")
}

/// The fingerprint of a payload given as text.
pub fn fp(payload: &str) -> Fingerprint {
    Fingerprint::of(payload.as_bytes())
}

/// A duration in milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A duration in seconds.
pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Claim options with a lease of `lease`.
pub fn lease_of(lease: Duration) -> ClaimOptions {
    ClaimOptions::new().lease(lease)
}

/// The lease of an `Acquired` outcome; panics with the outcome otherwise.
#[track_caller]
pub fn acquired(outcome: ClaimOutcome) -> Lease {
    match outcome {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// A temporary directory holding one store file, and the manual clock the
/// store reads. The clock starts at the current system time (a real epoch
/// time, so unit mistakes such as seconds for milliseconds show).
pub struct TestDir {
    /// The directory; removed on drop.
    pub dir: tempfile::TempDir,
    /// The store file inside it.
    pub path: PathBuf,
    /// The clock; clones share its time.
    pub clock: ManualClock,
}

impl TestDir {
    /// A fresh directory, no store file yet, clock at the current time.
    pub fn new() -> TestDir {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idem.redb");
        TestDir {
            dir,
            path,
            clock: ManualClock::starting_now(),
        }
    }

    /// A configuration reading this clock, with no background sweeper and
    /// no background scrub (so a test decides when eviction and the scrub
    /// run).
    pub fn config(&self) -> Config {
        Config::new()
            .clock(self.clock.clone())
            .sweep_interval(None)
            .scrub_rate(None)
    }

    /// Opens the store with [`TestDir::config`].
    #[track_caller]
    pub fn open(&self) -> Store {
        self.open_with(self.config())
    }

    /// Opens the store with `config`.
    #[track_caller]
    pub fn open_with(&self, config: Config) -> Store {
        match Store::open_with(&self.path, config) {
            Ok(store) => store,
            Err(err) => panic!("open {}: {err}", self.path.display()),
        }
    }

    /// The clock's reading (ms since the epoch).
    pub fn now_ms(&self) -> u64 {
        idemstore::Clock::now_ms(&self.clock)
    }
}

impl Default for TestDir {
    fn default() -> Self {
        TestDir::new()
    }
}

// ---------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------

/// In a child started by [`spawn_child`] for `test_name`: `true`. In the
/// parent (or in a child of another test): `false`.
pub fn child_role(test_name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == test_name)
}

/// A variable the parent passed to the child; panics when absent.
#[track_caller]
pub fn child_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child variable {name} is not set"))
}

/// A variable the parent passed to the child, parsed.
#[track_caller]
pub fn child_var_parsed<T: std::str::FromStr>(name: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    child_var(name)
        .parse()
        .unwrap_or_else(|e| panic!("child variable {name}: {e:?}"))
}

/// In the child: reports `name=value` to the parent.
pub fn report(name: &str, value: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{REPORT_PREFIX}{name}={value}");
    let _ = out.flush();
}

/// In the child: tells the parent it is ready to be killed, then blocks
/// (holding everything it opened) until it is killed. If the parent dies
/// first, its end of the child's stdin closes and the child exits without
/// any clean-up.
pub fn ready_and_wait() -> ! {
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{REPORT_PREFIX}{READY}");
        let _ = out.flush();
    }
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin().lock();
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    // No destructor runs: this is not a clean shutdown either.
    std::process::exit(3)
}

/// A running child process: the test binary re-run as the child of one test.
/// Dropping it kills the child (SIGKILL) so that a failing parent never
/// leaves one behind.
pub struct ChildProc {
    child: std::process::Child,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    test_name: String,
}

/// Starts the test binary as the child of `test_name`, with `vars` in its
/// environment.
pub fn spawn_child(test_name: &str, vars: &[(&str, String)]) -> ChildProc {
    let exe = std::env::current_exe().expect("current test binary");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, test_name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in vars {
        cmd.env(name, value);
    }
    let mut child = cmd.spawn().expect("spawn child test process");
    let stdout = child.stdout.take().expect("child stdout");
    let stderr = child.stderr.take().expect("child stderr");
    let (tx, lines) = channel();
    let out_reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may have printed "test <name> ... " on the same line.
            if let Some(at) = line.find(REPORT_PREFIX) {
                let report = &line[at + REPORT_PREFIX.len()..];
                if tx.send(report.to_string()).is_err() {
                    break;
                }
            }
        }
    });
    let collected = Arc::new(Mutex::new(String::new()));
    let sink = collected.clone();
    let err_reader = std::thread::spawn(move || {
        let mut reader = BufReader::new(stderr);
        let mut buf = String::new();
        while matches!(reader.read_line(&mut buf), Ok(n) if n > 0) {
            sink.lock().expect("stderr sink").push_str(&buf);
            buf.clear();
        }
    });
    ChildProc {
        child,
        lines,
        stderr: collected,
        readers: vec![out_reader, err_reader],
        test_name: test_name.to_string(),
    }
}

impl ChildProc {
    /// Waits until the child is ready and returns everything it reported.
    /// Panics, with the child's stderr, if it exits or hangs first.
    #[track_caller]
    pub fn wait_ready(&mut self) -> HashMap<String, String> {
        let mut reports = HashMap::new();
        let deadline = Instant::now() + CHILD_REPORT_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line == READY => return reports,
                Ok(line) => {
                    let (name, value) = line.split_once('=').unwrap_or((line.as_str(), ""));
                    reports.insert(name.to_string(), value.to_string());
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.fail("did not report READY in time");
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.fail("exited before reporting READY");
                }
            }
        }
    }

    /// Whether the child already reported READY (without waiting).
    pub fn is_ready(&mut self) -> bool {
        while let Ok(line) = self.lines.try_recv() {
            if line == READY {
                return true;
            }
        }
        false
    }

    /// Panics if the child has already exited: a child that fails an
    /// assertion exits early, and its failure must not pass unnoticed.
    #[track_caller]
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            self.fail(&format!("exited early with {status}"));
        }
    }

    /// Kills the child with SIGKILL (a real crash: no destructor, no flush,
    /// no unlock but the kernel's) and reaps it.
    pub fn kill(mut self) {
        self.kill_and_reap();
    }

    fn kill_and_reap(&mut self) {
        // `Child::kill` sends SIGKILL on Unix.
        let _ = self.child.kill();
        let _ = self.child.wait();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }

    #[track_caller]
    fn fail(&mut self, what: &str) -> ! {
        self.kill_and_reap();
        let stderr = self.stderr.lock().expect("stderr sink").clone();
        panic!("child of {} {what}; its stderr:\n{stderr}", self.test_name);
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// The path of a file as the child should receive it.
pub fn path_var(path: &Path) -> String {
    path.to_str().expect("UTF-8 temp path").to_string()
}

// ---------------------------------------------------------------------------
// Seeded randomness
// ---------------------------------------------------------------------------

/// A small seeded generator (SplitMix64): reproducible runs without a
/// dependency. Tests print their seed so a failure can be replayed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `true` with probability `1 / n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

/// A seed from the environment variable `var` (decimal), or `default`.
pub fn seed_from_env(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A count from the environment variable `var` (decimal), or `default`.
pub fn count_from_env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Every offset of `needle` in `haystack`.
pub fn find_all(haystack: &[u8], needle: &[u8]) -> Vec<usize> {
    haystack
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// XORs the byte at `offset` of the file with `mask`, in place (the file
/// may be open by a store), and syncs it.
pub fn flip(path: &Path, offset: usize, mask: u8) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, offset as u64).unwrap();
    byte[0] ^= mask;
    file.write_all_at(&byte, offset as u64).unwrap();
    file.sync_all().unwrap();
}

/// Flips a byte in the stored body of `k`'s record, through redb directly.
pub fn damage_record(path: &Path, k: &Key) {
    use redb::ReadableTable;
    let records: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("records");
    let db = redb::Database::open(path).unwrap();
    let mut kb = vec![u8::try_from(k.scope().len()).unwrap()];
    kb.extend_from_slice(k.scope().as_bytes());
    kb.extend_from_slice(k.id().as_bytes());
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(records).unwrap();
        let mut bytes = table.get(kb.as_slice()).unwrap().unwrap().value().to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x55;
        table.insert(kb.as_slice(), bytes.as_slice()).unwrap();
    }
    txn.commit().unwrap();
}

// ---------------------------------------------------------------------------
// Hand-made export streams
// ---------------------------------------------------------------------------

/// A record as an export stream carries it, with every field chosen by the
/// test (so that a stream can hold what no store would write).
#[derive(Debug, Clone)]
pub struct RawRecord {
    /// Scope and id of the key.
    pub scope: String,
    /// The id.
    pub id: String,
    /// 0 Processing, 1 Succeeded, 2 Failed, 3 Failed retryably.
    pub state: u8,
    /// The fencing token.
    pub token: u64,
    /// The fingerprint bytes.
    pub fingerprint: Vec<u8>,
    /// Times in ms since the epoch.
    pub created_ms: u64,
    /// Last update.
    pub updated_ms: u64,
    /// Lease deadline.
    pub lease_until_ms: u64,
    /// Expiry.
    pub expires_ms: u64,
    /// Result or failure.
    pub output: Option<Vec<u8>>,
    /// Recovery point.
    pub recovery_point: Option<Vec<u8>>,
    /// Business key.
    pub business_key: Option<String>,
    /// Number of acquisitions.
    pub acquisitions: u32,
}

impl RawRecord {
    /// A Succeeded record of `SCOPE`/`id` written at `at_ms`, kept an hour.
    pub fn succeeded(id: &str, token: u64, at_ms: u64) -> RawRecord {
        RawRecord {
            scope: SCOPE.into(),
            id: id.into(),
            state: 1,
            token,
            fingerprint: b"fingerprint".to_vec(),
            created_ms: at_ms,
            updated_ms: at_ms,
            lease_until_ms: at_ms + 30_000,
            expires_ms: at_ms + 3_600_000,
            output: Some(b"ok".to_vec()),
            recovery_point: None,
            business_key: None,
            acquisitions: 1,
        }
    }

    /// A Processing record of `SCOPE`/`id` acquired at `at_ms` with a lease
    /// of `lease_ms`, kept an hour (or until the lease ends, if later).
    pub fn processing(id: &str, token: u64, at_ms: u64, lease_ms: u64) -> RawRecord {
        RawRecord {
            state: 0,
            output: None,
            lease_until_ms: at_ms.saturating_add(lease_ms),
            expires_ms: (at_ms + 3_600_000).max(at_ms.saturating_add(lease_ms)),
            ..RawRecord::succeeded(id, token, at_ms)
        }
    }

    /// The key bytes as stored: scope length, scope, id.
    pub fn key_bytes(&self) -> Vec<u8> {
        let mut kb = vec![u8::try_from(self.scope.len()).unwrap()];
        kb.extend_from_slice(self.scope.as_bytes());
        kb.extend_from_slice(self.id.as_bytes());
        kb
    }

    /// The record envelope (version 1, crc32 over key and body, body in
    /// bincode 2's standard encoding), as `src/codec.rs` writes it.
    pub fn envelope(&self) -> Vec<u8> {
        fn varint(out: &mut Vec<u8>, v: u64) {
            if v < 251 {
                out.push(v as u8);
            } else if v <= u64::from(u16::MAX) {
                out.push(251);
                out.extend_from_slice(&(v as u16).to_le_bytes());
            } else if v <= u64::from(u32::MAX) {
                out.push(252);
                out.extend_from_slice(&(v as u32).to_le_bytes());
            } else {
                out.push(253);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        fn bytes(out: &mut Vec<u8>, b: &[u8]) {
            varint(out, b.len() as u64);
            out.extend_from_slice(b);
        }
        fn opt(out: &mut Vec<u8>, b: Option<&[u8]>) {
            match b {
                None => out.push(0),
                Some(b) => {
                    out.push(1);
                    bytes(out, b);
                }
            }
        }
        let mut body = vec![self.state];
        varint(&mut body, self.token);
        bytes(&mut body, &self.fingerprint);
        for t in [
            self.created_ms,
            self.updated_ms,
            self.lease_until_ms,
            self.expires_ms,
        ] {
            varint(&mut body, t);
        }
        opt(&mut body, self.output.as_deref());
        opt(&mut body, self.recovery_point.as_deref());
        opt(&mut body, self.business_key.as_deref().map(str::as_bytes));
        varint(&mut body, u64::from(self.acquisitions));
        let kb = self.key_bytes();
        let mut out = vec![1u8];
        out.extend_from_slice(&crc32(&[&kb, &body]).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }
}

/// CRC-32 (IEEE, as `crc32fast` computes it) over the concatenation of
/// `parts`; bitwise, so the helpers need no dependency of their own.
pub fn crc32(parts: &[&[u8]]) -> u32 {
    let mut crc = !0u32;
    for part in parts {
        for &byte in *part {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                let mask = (crc & 1).wrapping_neg();
                crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
            }
        }
    }
    !crc
}

/// One frame of an export stream: length, crc32 over kind and payload,
/// kind, payload.
pub fn export_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&u32::try_from(payload.len() + 1).unwrap().to_le_bytes());
    out.extend_from_slice(&crc32(&[&[kind], payload]).to_le_bytes());
    out.push(kind);
    out.extend_from_slice(payload);
    out
}

/// An export stream (format 1 of `src/backup.rs`) holding a meta frame
/// with `next_token` and `clock_hwm`, then `records`, then the end frame.
pub fn export_stream(next_token: u64, clock_hwm: u64, records: &[RawRecord]) -> Vec<u8> {
    let mut out = b"IDEMSTORE-EXPORT".to_vec();
    out.extend_from_slice(&1u32.to_le_bytes());
    let crc = crc32(&[&out]);
    out.extend_from_slice(&crc.to_le_bytes());
    let mut meta = 7u128.to_le_bytes().to_vec();
    meta.extend_from_slice(&next_token.to_le_bytes());
    meta.extend_from_slice(&clock_hwm.to_le_bytes());
    meta.push(1);
    out.extend_from_slice(&export_frame(1, &meta));
    for r in records {
        let kb = r.key_bytes();
        let mut p = u16::try_from(kb.len()).unwrap().to_le_bytes().to_vec();
        p.extend_from_slice(&kb);
        p.extend_from_slice(&r.envelope());
        out.extend_from_slice(&export_frame(2, &p));
    }
    out.extend_from_slice(&export_frame(3, &(records.len() as u64).to_le_bytes()));
    out
}

/// Byte offsets of the frames of an export stream (after its 24-byte
/// header).
pub fn export_frame_offsets(stream: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = 24;
    while at < stream.len() {
        out.push(at);
        let len = u32::from_le_bytes(stream[at..at + 4].try_into().unwrap()) as usize;
        at += 8 + len;
    }
    out
}

/// The frames of a write-ahead log's chain from its first frame position
/// (4096, the layout of docs/design.md): (offset, total length) each,
/// until a position holds no frame.
pub fn log_frames(log: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 4096;
    while log.len() >= at + 36 && log[at..at + 4] == *b"IWF\x01" {
        let len = u32::from_le_bytes(log[at + 4..at + 8].try_into().unwrap()) as usize;
        out.push((at, 36 + len));
        at += 36 + len;
    }
    out
}
