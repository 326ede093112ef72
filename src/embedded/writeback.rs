//! Early writeback of the index file: pages redb writes between
//! checkpoints are synced on a thread of their own as they accumulate, so
//! that the kernel writes them in steady batches instead of holding them
//! dirty until a checkpoint's `fdatasync` asks for all of them at once,
//! with the writer held.
//!
//! Between checkpoints redb writes the pages of its non-durable commits to
//! the file (from its write buffer, when the cache it shares with reads is
//! full) without syncing; with Linux's defaults
//! (`vm.dirty_background_ratio` 10 %, `vm.dirty_expire_centisecs` 30 s)
//! the kernel writes none of them back before the checkpoint's
//! `fdatasync` (172–482 ms at 1 M records on the machine of
//! BENCHMARKS.md). PostgreSQL meets the same stall with
//! `checkpoint_flush_after` and `backend_flush_after`, RocksDB with
//! `bytes_per_sync`: have the kernel write a range soon after it was
//! written.
//!
//! Here, once the bytes redb wrote since the last request add up to
//! [`SYNC_AFTER`], the thread `idemstore-writeback` is asked to
//! `fdatasync` the file; the writer that wrote them does not wait for it.
//! A checkpoint also asks for one as it begins ([`EarlySync`]), made while
//! the writer applies its buffered changes and redb prepares the durable
//! commit. One sync writes every dirty page of the file in one pass, where
//! the advice this module gave before (`posix_fadvise(POSIX_FADV_DONTNEED)`
//! per range written, about one system call per 4-KiB page, since redb's
//! pages are scattered) cost the thread CPU beside a CPU-bound writer:
//! against it, claim p99 was 0.77–0.92× in seven paired runs (16 threads,
//! a 1 M-record store, 60 s each), the lowest 1-s window 0.98–1.32×, the
//! rate the same, and no consistent change in the checkpoints' pauses
//! (docs/benchmarks-history.md). The early sync alone changed nothing
//! measurable; it is kept as part of what was measured. At most [`QUEUE`]
//! requests wait for the thread; past that a request is dropped (the next
//! one, or the checkpoint's own sync, writes the same pages). A request
//! handed over before one of redb's syncs began is skipped (that sync
//! wrote its pages), and so are those still queued when the store closes.
//!
//! **A failed sync is never lost.** The thread works on an open file
//! description of its own (the file reopened through `/proc/self/fd`, see
//! [`reopen`]), not a duplicate of redb's descriptor: Linux (4.13 on,
//! `errseq_t`) reports a failed writeback to the next `fsync` of each open
//! file description, so redb's own sync is told of an error the thread's
//! met. And whatever the kernel or file system does, an error of the
//! thread's sync is latched: every later `sync_data` of redb's fails with
//! it, so the next checkpoint (or redb's sync when it grows the file)
//! fails and the store is poisoned, never taken as durable over pages
//! that were lost. The error is logged at warn (target
//! `idemstore::writeback`).
//!
//! Nothing durable depends on the thread: only redb's own `fdatasync` (at
//! checkpoints, and when it grows the file) makes the index durable, and
//! the store's guarantees rest on that and on the log. Only the store's
//! own file gets this (a file descriptor is needed); a backend given to
//! `Store::open_with_backend` is used as it is.

use std::fs::File;
use std::io;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::thread::JoinHandle;

use parking_lot::Mutex;
use redb::{BackendError, StorageBackend};

/// Written bytes that make the backend ask the thread for a sync (8 MiB):
/// at the 60 MiB/s a churning 1 M-record store writes, a handful of syncs
/// a second, each writing what accumulated since the last.
pub(crate) const SYNC_AFTER: u64 = 8 * 1024 * 1024;

/// How many requests may wait for the writeback thread; past that a
/// request is dropped (its pages are written by the next sync, as without
/// this module).
const QUEUE: usize = 8;

/// A sync request for the writeback thread: the count of redb's syncs when
/// it was handed over (skipped if one began since, or the backend is being
/// dropped).
type Request = u64;

/// The sending side of the writeback thread's queue, shared by the backend
/// and every [`EarlySync`]: `None` once the backend is dropped (or when
/// the thread could not be started), which ends the thread.
type ToThread = Arc<Mutex<Option<SyncSender<Request>>>>;

/// The first error a sync of the writeback thread met: its kind and text.
type Failed = Arc<Mutex<Option<(io::ErrorKind, String)>>>;

/// Asks the writeback thread to sync the index file now, off the writer
/// (see the module documentation): a checkpoint calls it as it begins.
/// Does nothing once the store's backend is dropped, when the thread could
/// not be started, or when its queue is full.
#[derive(Debug, Clone)]
pub(crate) struct EarlySync {
    to_thread: ToThread,
    syncs: Arc<AtomicU64>,
}

impl EarlySync {
    /// Queues an early sync; `false` when it was not queued (no thread, or
    /// a full queue: the checkpoint's own sync then writes everything, as
    /// without it). Skipped, like any request, if redb's own sync begins
    /// before the thread reaches it.
    pub(crate) fn start(&self) -> bool {
        match self.to_thread.lock().as_ref() {
            Some(to_thread) => to_thread
                .try_send(self.syncs.load(Ordering::Acquire))
                .is_ok(),
            None => false,
        }
    }
}

/// A redb backend that asks for the file to be synced on a thread of its
/// own every [`SYNC_AFTER`] bytes written (see the module documentation).
#[derive(Debug)]
pub(crate) struct Writeback<B> {
    inner: B,
    /// Bytes written since the last request (or redb's last sync).
    written: AtomicU64,
    /// How many of redb's syncs began (and whether the backend is being
    /// dropped): the thread skips a request handed over before the last
    /// of them, whose pages that sync wrote.
    syncs: Arc<AtomicU64>,
    /// The first error a sync of the thread's met, latched: every later
    /// `sync_data` fails with it (see the module documentation).
    failed: Failed,
    /// To the writeback thread (`None`: it could not be started, and
    /// nothing is asked); emptied on drop, which ends the thread.
    to_thread: ToThread,
    /// Joined on drop, so that the thread's handle on the file is closed
    /// before the backend is gone.
    thread: Option<JoinHandle<u64>>,
}

impl<B> Writeback<B> {
    /// Wraps `inner`; `file` is the same file opened again ([`reopen`]),
    /// which the writeback thread syncs. When the reopen failed or the
    /// thread cannot be started, the backend asks for nothing (logged at
    /// debug, target `idemstore::writeback`): the early writeback is an
    /// optimisation, and its absence leaves every write to the next
    /// checkpoint's sync, as redb's own backend does.
    pub(crate) fn new(inner: B, file: io::Result<File>) -> Writeback<B> {
        let syncs = Arc::new(AtomicU64::new(0));
        let failed = Failed::default();
        let started = file.and_then(|file| start_thread(file, syncs.clone(), failed.clone()));
        let (to_thread, thread) = match started {
            Ok((to_thread, thread)) => (Some(to_thread), Some(thread)),
            Err(err) => {
                tracing::debug!(
                    target: "idemstore::writeback",
                    error = %err,
                    "no early writeback of the index: its thread could not be started"
                );
                (None, None)
            }
        };
        Writeback {
            inner,
            written: AtomicU64::new(0),
            syncs,
            failed,
            to_thread: Arc::new(Mutex::new(to_thread)),
            thread,
        }
    }

    /// The handle a checkpoint asks for an early sync through.
    pub(crate) fn early_sync(&self) -> EarlySync {
        EarlySync {
            to_thread: self.to_thread.clone(),
            syncs: self.syncs.clone(),
        }
    }

    /// Ends the thread once it has made the syncs queued, and returns how
    /// many it made.
    #[cfg(test)]
    fn finish(mut self) -> u64 {
        drop(self.to_thread.lock().take());
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or(0)
    }
}

/// `file`'s file opened again, read-only, as a new open file description
/// (through `/proc/self/fd`, which names the open file itself, whatever
/// its path has become): the writeback thread's own, so that an error its
/// sync meets is still reported to redb's (see the module documentation).
/// An error when `/proc` is not mounted, or when what it opened is not the
/// same file (device and inode).
pub(crate) fn reopen(file: &File) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let reopened = File::open(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    let (a, b) = (file.metadata()?, reopened.metadata()?);
    if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
        return Err(io::Error::other("/proc/self/fd opened another file"));
    }
    Ok(reopened)
}

/// Starts the writeback thread on `file`; it returns the syncs it made. A
/// failed sync is latched in `failed`.
fn start_thread(
    file: File,
    syncs: Arc<AtomicU64>,
    failed: Failed,
) -> io::Result<(SyncSender<Request>, JoinHandle<u64>)> {
    let (to_thread, from_writer) = sync_channel::<Request>(QUEUE);
    let thread = std::thread::Builder::new()
        .name("idemstore-writeback".into())
        .spawn(move || {
            let mut made = 0u64;
            for handed_at in from_writer {
                if handed_at != syncs.load(Ordering::Acquire) {
                    continue;
                }
                if let Err(err) = file.sync_data() {
                    tracing::warn!(
                        target: "idemstore::writeback",
                        error = %err,
                        "a sync of the index failed: the next checkpoint fails with it"
                    );
                    failed
                        .lock()
                        .get_or_insert_with(|| (err.kind(), err.to_string()));
                }
                made = made.saturating_add(1);
            }
            made
        })?;
    Ok((to_thread, thread))
}

impl<B> Drop for Writeback<B> {
    fn drop(&mut self) {
        // The requests still queued are skipped (early syncs too): the
        // thread ends at once, after the sync it is making, if any.
        self.syncs.fetch_add(1, Ordering::AcqRel);
        drop(self.to_thread.lock().take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl<B: StorageBackend> StorageBackend for Writeback<B> {
    fn len(&self) -> Result<u64, io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        // Everything written is about to be synced: the count starts
        // over, and the requests handed over are skipped.
        self.written.store(0, Ordering::Release);
        self.syncs.fetch_add(1, Ordering::AcqRel);
        let synced = self.inner.sync_data();
        // Checked after redb's own sync, so that a failure of a sync of
        // the thread's made meanwhile is not missed.
        if let Some((kind, detail)) = self.failed.lock().clone() {
            return Err(io::Error::new(
                kind,
                format!("an early sync of the index failed: {detail}"),
            ));
        }
        synced
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.inner.write(offset, data)?;
        let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
        let before = self.written.fetch_add(len, Ordering::AcqRel);
        if before.saturating_add(len) >= SYNC_AFTER {
            // Whoever reaches the threshold asks, once: the count starts
            // over. A full queue or a stopped thread drops the request:
            // the next one, or the checkpoint's sync, writes these pages.
            self.written.store(0, Ordering::Release);
            let handed_at = self.syncs.load(Ordering::Acquire);
            if let Some(to_thread) = self.to_thread.lock().as_ref() {
                let _ = to_thread.try_send(handed_at);
            }
        }
        Ok(())
    }
    fn close(&self) -> Result<(), io::Error> {
        self.inner.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh file in `dir` behind a `Writeback`.
    fn backend(
        dir: &tempfile::TempDir,
    ) -> (std::path::PathBuf, Writeback<redb::backends::FileBackend>) {
        let path = dir.path().join("index");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        let early = reopen(&file);
        let backend = Writeback::new(
            redb::backends::FileBackend::new(file).expect("backend"),
            early,
        );
        (path, backend)
    }

    #[test]
    fn asks_for_a_sync_once_the_writes_add_up_and_what_is_written_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, backend) = backend(&dir);
        // Three times the threshold in pages, in a scattered order.
        let page = 4096u64;
        let pages = 3 * SYNC_AFTER / page;
        backend.set_len(pages * page).expect("set_len");
        for i in (0..pages).map(|i| (i * 7) % pages) {
            let fill = u8::try_from(i % 251).expect("small");
            backend
                .write(i * page, &vec![fill; page as usize])
                .expect("write");
        }
        for i in 0..pages {
            let mut out = vec![0u8; page as usize];
            backend.read(i * page, &mut out).expect("read");
            let fill = u8::try_from(i % 251).expect("small");
            assert!(out.iter().all(|&b| b == fill), "page {i}");
        }
        // Each full 8 MiB asked for one sync (none dropped: the queue
        // holds more than three, and no sync of redb's came between).
        assert_eq!(backend.finish(), 3, "syncs made");
        let bytes = std::fs::read(&path).expect("read the file");
        assert_eq!(bytes.len() as u64, pages * page);
        for (i, chunk) in bytes.chunks(page as usize).enumerate() {
            let fill = u8::try_from(i % 251).expect("small");
            assert!(chunk.iter().all(|&b| b == fill), "page {i} on reopen");
        }
    }

    #[test]
    fn a_sync_of_redb_starts_the_count_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (_, backend) = backend(&dir);
        // Half the threshold, a sync, half again: nothing adds up.
        let half = usize::try_from(SYNC_AFTER / 2).expect("small");
        backend.write(0, &vec![1u8; half]).expect("write");
        backend.sync_data().expect("sync");
        backend.write(SYNC_AFTER, &vec![2u8; half]).expect("write");
        let mut out = vec![0u8; half];
        backend.read(0, &mut out).expect("read");
        assert!(out.iter().all(|&b| b == 1), "the first half after the sync");
        backend.read(SYNC_AFTER, &mut out).expect("read");
        assert!(out.iter().all(|&b| b == 2), "the second half");
        // The thread runs (an early sync is made), and was asked for
        // nothing else.
        assert!(backend.early_sync().start(), "queued");
        assert_eq!(backend.finish(), 1, "only the early sync was made");
    }

    #[test]
    fn a_failed_sync_of_the_threads_fails_every_later_sync_of_redbs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (_, backend) = backend(&dir);
        backend.sync_data().expect("no failure yet");
        // What the thread latches when its `fdatasync` fails (a real one
        // cannot be made to fail here).
        *backend.failed.lock() = Some((io::ErrorKind::Other, "Input/output error".into()));
        for _ in 0..2 {
            let err = backend.sync_data().expect_err("the failure is reported");
            assert!(err.to_string().contains("Input/output error"), "{err}");
        }
    }

    #[test]
    fn an_early_sync_is_made_on_the_thread_and_ends_with_the_backend() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, backend) = backend(&dir);
        let sync = backend.early_sync();
        let page = vec![7u8; 4096];
        backend.write(0, &page).expect("write");
        backend.sync_data().expect("sync");
        assert!(sync.start(), "queued");
        assert_eq!(backend.finish(), 1, "the thread made the early sync");
        assert_eq!(
            std::fs::read(&path).expect("read").get(..4096),
            Some(&page[..]),
            "what was written is in the file"
        );
        // The backend is gone: its thread with it, and the handle asks
        // for nothing.
        assert!(!sync.start(), "no thread to ask");
    }

    #[test]
    fn the_thread_opens_the_same_file_as_a_description_of_its_own() {
        use std::io::{Seek, Write};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("index");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        file.write_all(b"one").expect("write");
        // Renamed away and replaced at its path: the reopen still finds
        // the open file, not what the path names now.
        std::fs::rename(&path, dir.path().join("moved")).expect("rename");
        std::fs::write(&path, b"another file").expect("write another");
        let mut reopened = reopen(&file).expect("reopen");
        let mut read = String::new();
        std::io::Read::read_to_string(&mut reopened, &mut read).expect("read");
        assert_eq!(read, "one");
        // Its own description: its offset is not the original's (a
        // duplicated descriptor shares one).
        file.seek(std::io::SeekFrom::Start(1)).expect("seek");
        assert_eq!(reopened.stream_position().expect("position"), 3);
        assert_eq!(file.stream_position().expect("position"), 1);
    }
}
