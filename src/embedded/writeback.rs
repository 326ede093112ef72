//! Early writeback of the index file: pages redb writes between
//! checkpoints are handed to the kernel for writing as they accumulate, so
//! that a checkpoint's `fdatasync` finds most of them on the disk already.
//!
//! Between checkpoints redb writes the pages of its non-durable commits to
//! the file (from its write buffer, when the cache it shares with reads is
//! full) without syncing; the kernel holds them as dirty pages and, with
//! Linux's defaults (`vm.dirty_background_ratio` 10 %,
//! `vm.dirty_expire_centisecs` 30 s), writes none of them back before the
//! checkpoint's `fdatasync` asks for all of them at once, with the writer
//! held (172–482 ms at 1 M records on the machine of BENCHMARKS.md).
//! PostgreSQL meets the same stall with `checkpoint_flush_after` and
//! `backend_flush_after` (`pg_flush_data`: `sync_file_range`, or
//! `posix_fadvise(POSIX_FADV_DONTNEED)` where that is missing), RocksDB
//! with `bytes_per_sync`: ask the kernel to start writing a range soon
//! after it was written, without waiting for it and without a sync.
//!
//! Here the request is `posix_fadvise(POSIX_FADV_DONTNEED)` on each range
//! written since the last request, once they add up to [`FLUSH_AFTER`]
//! bytes (`sync_file_range` has no binding without `unsafe`). On Linux it
//! starts writeback of the dirty pages in the range (`WB_SYNC_NONE`, not
//! waited for) and then drops the range's pages that are clean, which
//! pages just written are not (dirty, or being written). The requests are
//! made on a thread of their own, `idemstore-writeback`, not by the writer
//! that writes the pages: redb's pages are scattered, so it is about one
//! request per page. At most [`QUEUE`] lists of ranges wait for that
//! thread; past that a list is dropped and its pages are written by the
//! next sync, as they would be without this module. A list handed over
//! before a sync began is skipped (that sync writes its pages, and the
//! advice would only drop them, clean by then, from the page cache), and
//! so are those still queued when the store closes. Pages of a range that
//! are already clean when the advice comes are dropped from the page
//! cache; a later read of one that redb does not cache reads the disk.
//!
//! Nothing durable depends on it: only `fdatasync` makes a write durable,
//! and the store's guarantees rest on that alone. The advice is best
//! effort: an error is logged (debug, target `idemstore::writeback`) and
//! the rest of that list is skipped. Only the store's own file gets this
//! (a file descriptor is needed); a backend given to
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

/// Written bytes that make the backend ask for their writeback (1 MiB).
/// PostgreSQL's `checkpoint_flush_after` is 256 kB on Linux; a larger
/// amount here means fewer lists handed to the thread (the requests
/// themselves are one per range, whatever the amount).
pub(crate) const FLUSH_AFTER: u64 = 1024 * 1024;

/// The ranges written since the last writeback request: sorted, merged
/// where they touch, with their total length.
#[derive(Debug, Default)]
pub(crate) struct Written {
    ranges: Vec<(u64, u64)>,
    bytes: u64,
}

impl Written {
    /// Notes that `[offset, offset + len)` was written. Returns the merged
    /// ranges to hand to the kernel when they add up to [`FLUSH_AFTER`]
    /// bytes or more (and starts over), else `None`.
    pub(crate) fn note(&mut self, offset: u64, len: u64) -> Option<Vec<(u64, u64)>> {
        let end = offset.saturating_add(len);
        if len > 0 {
            self.ranges.push((offset, end));
            self.bytes = self.bytes.saturating_add(len);
        }
        if self.bytes < FLUSH_AFTER {
            return None;
        }
        let mut ranges = std::mem::take(&mut self.ranges);
        self.bytes = 0;
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (start, end) in ranges {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        Some(merged)
    }
}

/// How many handed-over lists of ranges may wait for the writeback thread;
/// past that a list is dropped (its pages are then written by the next
/// sync, as without this module).
const QUEUE: usize = 8;

/// A list of ranges for the writeback thread, with the count of syncs
/// when it was handed over.
type Request = (u64, Vec<(u64, u64)>);

/// A redb backend that asks the kernel to write back what it wrote, every
/// [`FLUSH_AFTER`] bytes, on a thread of its own (see the module
/// documentation).
#[derive(Debug)]
pub(crate) struct Writeback<B> {
    inner: B,
    written: Mutex<Written>,
    /// How many syncs began (and whether the backend is being dropped):
    /// the thread skips a list handed over before the last of them, whose
    /// pages that sync writes (and whose advice would then only drop them,
    /// clean, from the page cache).
    syncs: Arc<AtomicU64>,
    /// To the writeback thread (`None`: it could not be started, and
    /// nothing is asked); dropping it ends the thread.
    to_thread: Option<SyncSender<Request>>,
    /// Joined on drop, so that the thread's handle on the file is closed
    /// before the backend is gone.
    thread: Option<JoinHandle<u64>>,
}

impl<B> Writeback<B> {
    /// Wraps `inner`; `file` is a second handle on the same file (a
    /// clone), on which the writeback thread makes its requests. When the
    /// clone failed or the thread cannot be started, the backend asks for
    /// nothing (logged at debug, target `idemstore::writeback`): the
    /// advice is an optimisation, and its absence leaves every write to the
    /// next sync, as redb's own backend does.
    pub(crate) fn new(inner: B, file: io::Result<File>) -> Writeback<B> {
        let syncs = Arc::new(AtomicU64::new(0));
        let (to_thread, thread) = match file.and_then(|file| start_thread(file, syncs.clone())) {
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
            written: Mutex::new(Written::default()),
            syncs,
            to_thread,
            thread,
        }
    }

    /// Ends the thread once it has made the requests queued, and returns
    /// the bytes the kernel took the advice for.
    #[cfg(test)]
    fn finish(mut self) -> u64 {
        drop(self.to_thread.take());
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or(0)
    }
}

/// Starts the writeback thread on `file`.
fn start_thread(
    file: File,
    syncs: Arc<AtomicU64>,
) -> io::Result<(SyncSender<Request>, JoinHandle<u64>)> {
    let (to_thread, from_writer) = sync_channel::<Request>(QUEUE);
    let thread = std::thread::Builder::new()
        .name("idemstore-writeback".into())
        .spawn(move || {
            let mut advised = 0u64;
            for (handed_at, ranges) in from_writer {
                if handed_at == syncs.load(Ordering::Acquire) {
                    advised = advised.saturating_add(start_writeback(&file, &ranges));
                }
            }
            advised
        })?;
    Ok((to_thread, thread))
}

impl<B> Drop for Writeback<B> {
    fn drop(&mut self) {
        // The lists still queued are skipped: the thread ends at once
        // (after the request it is making, if any).
        self.syncs.fetch_add(1, Ordering::AcqRel);
        drop(self.to_thread.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Asks the kernel to start writing back each range of `file`; the bytes
/// it took the advice for.
fn start_writeback(file: &File, ranges: &[(u64, u64)]) -> u64 {
    let mut advised = 0u64;
    for &(start, end) in ranges {
        let Some(len) = std::num::NonZeroU64::new(end.saturating_sub(start)) else {
            continue;
        };
        if let Err(err) = rustix::fs::fadvise(file, start, Some(len), rustix::fs::Advice::DontNeed)
        {
            tracing::debug!(
                target: "idemstore::writeback",
                error = %err,
                "the kernel refused the advice to write back a range of the index"
            );
            break;
        }
        advised = advised.saturating_add(len.get());
    }
    advised
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
        // Everything written is about to be synced: nothing to ask for,
        // and the lists handed over are skipped.
        *self.written.lock() = Written::default();
        self.syncs.fetch_add(1, Ordering::AcqRel);
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.inner.write(offset, data)?;
        let due = self.written.lock().note(offset, data.len() as u64);
        if let Some(ranges) = due {
            let handed_at = self.syncs.load(Ordering::Acquire);
            // A full queue or a stopped thread drops the request: the
            // next sync writes these pages, as it would without it.
            if let Some(to_thread) = &self.to_thread {
                let _ = to_thread.try_send((handed_at, ranges));
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

    #[test]
    fn asks_once_the_writes_add_up_and_merges_what_touches() {
        let mut w = Written::default();
        let page = 4096;
        // Below the threshold: nothing asked, whatever the order.
        assert_eq!(w.note(10 * page, page), None);
        assert_eq!(w.note(2 * page, page), None);
        assert_eq!(w.note(3 * page, page), None);
        assert_eq!(w.note(0, 0), None, "an empty write counts nothing");
        // The write that reaches it hands every range over, sorted, with
        // adjacent and overlapping ones merged.
        let rest = FLUSH_AFTER - 3 * page;
        let due = w.note(2 * page + 100, rest).expect("reached the threshold");
        assert_eq!(due, vec![(2 * page, 2 * page + 100 + rest)]);
        // ... which starts the count over.
        assert_eq!(w.note(0, page), None);
        let due = w.note(100 * page, FLUSH_AFTER).expect("reached it again");
        assert_eq!(due, vec![(0, page), (100 * page, 100 * page + FLUSH_AFTER)]);
    }

    #[test]
    fn ranges_near_the_end_of_the_address_space_do_not_overflow() {
        let mut w = Written::default();
        let due = w
            .note(u64::MAX - 10, FLUSH_AFTER)
            .expect("one write is enough");
        assert_eq!(due, vec![(u64::MAX - 10, u64::MAX)]);
    }

    #[test]
    fn what_is_written_reads_back_across_the_advice() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("index");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        let early = file.try_clone();
        let backend = Writeback::new(
            redb::backends::FileBackend::new(file).expect("backend"),
            early,
        );
        // Three times the threshold in pages, in a scattered order, so that
        // the advice is asked for ranges with gaps between them.
        let page = 4096u64;
        let pages = 3 * FLUSH_AFTER / page;
        backend.set_len(pages * page).expect("set_len");
        let order: Vec<u64> = (0..pages).map(|i| (i * 7) % pages).collect();
        for &i in &order {
            let fill = u8::try_from(i % 251).expect("small");
            backend
                .write(i * page, &vec![fill; page as usize])
                .expect("write");
        }
        let check = |when: &str| {
            for i in 0..pages {
                let mut out = vec![0u8; page as usize];
                backend.read(i * page, &mut out).expect("read");
                let fill = u8::try_from(i % 251).expect("small");
                assert!(out.iter().all(|&b| b == fill), "page {i} {when}");
            }
        };
        check("after the advice was asked for");
        // Every full 1 MiB went to the kernel (none dropped: the queue
        // holds more than the three lists, and no sync came between), and
        // it took the advice.
        let advised = backend.finish();
        assert_eq!(advised, 3 * FLUSH_AFTER, "bytes handed for writeback");
        let bytes = std::fs::read(&path).expect("read the file");
        assert_eq!(bytes.len() as u64, pages * page);
        for (i, chunk) in bytes.chunks(page as usize).enumerate() {
            let fill = u8::try_from(i % 251).expect("small");
            assert!(chunk.iter().all(|&b| b == fill), "page {i} on reopen");
        }
    }

    #[test]
    fn a_sync_starts_the_count_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("index");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        let early = file.try_clone();
        let backend = Writeback::new(
            redb::backends::FileBackend::new(file).expect("backend"),
            early,
        );
        // Half the threshold, a sync, half again: the sync wrote the first
        // half, so nothing adds up to a request.
        let half = usize::try_from(FLUSH_AFTER / 2).expect("small");
        backend.write(0, &vec![1u8; half]).expect("write");
        backend.sync_data().expect("sync");
        backend.write(FLUSH_AFTER, &vec![2u8; half]).expect("write");
        let mut out = vec![0u8; half];
        backend.read(0, &mut out).expect("read");
        assert!(out.iter().all(|&b| b == 1), "the first half after the sync");
        backend.read(FLUSH_AFTER, &mut out).expect("read");
        assert!(out.iter().all(|&b| b == 2), "the second half");
        assert_eq!(backend.finish(), 0, "nothing was handed over");
    }
}
