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
//! held (300–480 ms at 1 M records on the machine of BENCHMARKS.md).
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
//! next sync, as they would be without this module.
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
use std::sync::mpsc::{SyncSender, sync_channel};
use std::thread::JoinHandle;

use parking_lot::Mutex;
use redb::{BackendError, StorageBackend};

/// Written bytes that make the backend ask for their writeback (1 MiB).
/// PostgreSQL's `checkpoint_flush_after` is 256 kB on Linux; a larger
/// amount here means fewer calls for redb's scattered pages.
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

/// A redb backend that asks the kernel to write back what it wrote, every
/// [`FLUSH_AFTER`] bytes, on a thread of its own (see the module
/// documentation).
#[derive(Debug)]
pub(crate) struct Writeback<B> {
    inner: B,
    written: Mutex<Written>,
    /// To the writeback thread; dropping it ends the thread.
    to_thread: Option<SyncSender<Vec<(u64, u64)>>>,
    /// Joined on drop: the thread's handle on the file (a clone, sharing
    /// the open file and so redb's lock on it) is closed before the
    /// backend is gone, so that the store can be opened again at once.
    thread: Option<JoinHandle<u64>>,
}

impl<B> Writeback<B> {
    /// Wraps `inner`; `file` is a handle on the same open file (a clone),
    /// on which the writeback thread makes its requests.
    ///
    /// # Errors
    /// The thread could not be started.
    pub(crate) fn new(inner: B, file: File) -> io::Result<Writeback<B>> {
        let (to_thread, from_writer) = sync_channel::<Vec<(u64, u64)>>(QUEUE);
        let thread = std::thread::Builder::new()
            .name("idemstore-writeback".into())
            .spawn(move || {
                let mut advised = 0u64;
                for ranges in from_writer {
                    advised = advised.saturating_add(start_writeback(&file, &ranges));
                }
                advised
            })?;
        Ok(Writeback {
            inner,
            written: Mutex::new(Written::default()),
            to_thread: Some(to_thread),
            thread: Some(thread),
        })
    }
}

impl<B> Writeback<B> {
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

impl<B> Drop for Writeback<B> {
    fn drop(&mut self) {
        // The thread ends once the requests already queued are made (at
        // most `QUEUE` lists, a few milliseconds).
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
        // Everything written is about to be synced: nothing to ask for.
        *self.written.lock() = Written::default();
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.inner.write(offset, data)?;
        let due = self.written.lock().note(offset, data.len() as u64);
        if let Some(ranges) = due {
            // A full queue or a stopped thread drops the request: the
            // next sync writes these pages, as it would without it.
            if let Some(to_thread) = &self.to_thread {
                let _ = to_thread.try_send(ranges);
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
    fn what_is_written_reads_back_across_the_advice_and_a_sync() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("index");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        let early = file.try_clone().expect("clone");
        let backend = Writeback::new(
            redb::backends::FileBackend::new(file).expect("backend"),
            early,
        )
        .expect("writeback thread");
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
        check("before the sync");
        backend.sync_data().expect("sync");
        check("after the sync");
        // Every full 1 MiB went to the kernel (none dropped: the queue
        // holds more than the three lists), and it took the advice.
        let advised = backend.finish();
        assert_eq!(advised, 3 * FLUSH_AFTER, "bytes handed for writeback");
        let bytes = std::fs::read(&path).expect("read the file");
        assert_eq!(bytes.len() as u64, pages * page);
        for (i, chunk) in bytes.chunks(page as usize).enumerate() {
            let fill = u8::try_from(i % 251).expect("small");
            assert!(chunk.iter().all(|&b| b == fill), "page {i} on reopen");
        }
    }
}
