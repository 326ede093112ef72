//! Bounded memory (issue 10, deliverable 5): a batch that does not fit the
//! log is checkpointed instead of growing the log past `max_log_bytes`;
//! recovery reads the log one frame at a time; an import of large records
//! goes in batches sized in bytes. Each with records near the size limit.
//! The assertions are on sizes the store controls (the log file's length,
//! the largest single read of the log, how much of a stream was read before
//! its first batch went in), never on memory measured or on time.

mod common;

use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{
    RawRecord, TestDir, acquired, child_role, child_var, export_stream, fp, key, path_var,
    spawn_child,
};
use idemstore::{ClaimOptions, Config, FileLog, LogFile, Store};

const KIB: usize = 1024;

fn log_len(t: &TestDir) -> u64 {
    std::fs::metadata(log_path(&t.path)).unwrap().len()
}

fn log_path(path: &std::path::Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-wal");
    name.into()
}

/// Completions of 1 MiB results (the default limit) into a log of at most
/// 64 KiB: each batch is checkpointed, the log never grows past its
/// maximum, and every result is there after a reopen.
#[test]
fn a_batch_larger_than_the_log_is_checkpointed_without_growing_the_log() {
    let t = TestDir::new();
    let max = 64 * KIB as u64;
    let config = || t.config().max_log_bytes(max);
    let store = t.open_with(config());
    let result = vec![b'r'; 1024 * KIB];
    for i in 0..3 {
        let lease = acquired(
            store
                .claim(&key(&format!("big-{i}")), &fp("p"), &ClaimOptions::new())
                .unwrap(),
        );
        store.complete(&lease, &result).unwrap();
        assert!(log_len(&t) <= max, "log grew to {} bytes", log_len(&t));
    }
    drop(store);
    assert!(log_len(&t) <= max, "log grew to {} bytes", log_len(&t));
    let store = t.open_with(config());
    for i in 0..3 {
        let r = store.get(&key(&format!("big-{i}"))).unwrap().unwrap();
        assert_eq!(r.result(), Some(result.as_slice()));
    }
}

/// A [`LogFile`] over the real log that notes the largest single read.
struct CountingLog {
    inner: FileLog,
    largest_read: Arc<AtomicUsize>,
}

impl LogFile for CountingLog {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.largest_read.fetch_max(buf.len(), Ordering::SeqCst);
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.write_at(offset, data)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
}

const RESULT_LEN: usize = 500_000;

fn recovery_config() -> Config {
    Config::new()
        .sweep_interval(None)
        .scrub_rate(None)
        .max_log_bytes(8 * 1024 * 1024)
        .max_result_bytes(512 * KIB)
}

/// A process completes five keys with results near the limit (512 KiB) and
/// is killed: the reopen replays the log, reading it one frame at a time
/// (no read larger than one frame), though the log holds several.
#[test]
fn recovery_reads_the_log_one_frame_at_a_time() {
    const NAME: &str = "recovery_reads_the_log_one_frame_at_a_time";
    let result = vec![b'q'; RESULT_LEN];
    if child_role(NAME) {
        let store = Store::open_with(child_var("STORE"), recovery_config()).unwrap();
        for i in 0..5 {
            let lease = acquired(
                store
                    .claim(&key(&format!("k{i}")), &fp("p"), &ClaimOptions::new())
                    .unwrap(),
            );
            store.complete(&lease, &result).unwrap();
        }
        common::ready_and_wait();
    }
    let t = TestDir::new();
    let mut child = spawn_child(NAME, &[("STORE", path_var(&t.path))]);
    child.wait_ready();
    child.kill();
    let len = log_len(&t);
    // Whole frames are at most one result and its record's other fields.
    let one_frame = RESULT_LEN + 4 * KIB;
    assert!(len > 2 * one_frame as u64, "log of {len} bytes");
    let largest_read = Arc::new(AtomicUsize::new(0));
    let log = CountingLog {
        inner: FileLog::open(log_path(&t.path)).unwrap(),
        largest_read: largest_read.clone(),
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&t.path)
        .unwrap();
    let backend = redb::backends::FileBackend::new(file).unwrap();
    let store = Store::open_with_backend(&t.path, backend, log, recovery_config()).unwrap();
    for i in 0..5 {
        let r = store.get(&key(&format!("k{i}"))).unwrap().unwrap();
        assert_eq!(r.result(), Some(result.as_slice()), "k{i}");
    }
    let largest = largest_read.load(Ordering::SeqCst);
    assert!(largest > 0, "recovery did not read the log");
    assert!(
        largest <= one_frame,
        "recovery read {largest} bytes at once from a log of {len} bytes"
    );
}

/// A reader that notes, at each read, how many bytes were read before it
/// and how many records the store held then.
struct Probe<'a> {
    input: &'a [u8],
    consumed: usize,
    store: &'a Store,
    seen: Vec<(usize, u64)>,
}

impl Read for Probe<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let held = self.store.len().unwrap();
        self.seen.push((self.consumed, held));
        let n = self.input.read(buf)?;
        self.consumed += n;
        Ok(n)
    }
}

/// An import of 24 records of 1 MiB each (the default limit) into a store
/// whose log is 64 KiB: the first records are written before a quarter of
/// the stream was read (a batch is sized in bytes, not only by count), and
/// the log stays within its maximum.
#[test]
fn an_import_of_large_records_goes_in_batches_sized_in_bytes() {
    let t = TestDir::new();
    let max = 64 * KIB as u64;
    let store = t.open_with(t.config().max_log_bytes(max));
    let now = t.now_ms();
    let records: Vec<RawRecord> = (0..24)
        .map(|i| RawRecord {
            output: Some(vec![b'i'; 1024 * KIB]),
            ..RawRecord::succeeded(&format!("big-{i:02}"), 1 + i, now)
        })
        .collect();
    let stream = export_stream(100, now, &records);
    let mut probe = Probe {
        input: &stream,
        consumed: 0,
        store: &store,
        seen: Vec::new(),
    };
    let summary = store.import(&mut probe, |_| {}).unwrap();
    assert_eq!(summary.imported, 24);
    let first_written = probe
        .seen
        .iter()
        .find(|(_, held)| *held > 0)
        .map(|(consumed, _)| *consumed);
    let first_written = first_written.expect("records were written before the stream ended");
    assert!(
        first_written < stream.len() / 4,
        "the first batch went in after {first_written} of {} bytes",
        stream.len()
    );
    assert!(log_len(&t) <= max, "log grew to {} bytes", log_len(&t));
    assert_eq!(store.len().unwrap(), 24);
}
