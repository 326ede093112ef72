//! A fence in front of the index's storage: once raised, every write, resize
//! and sync of the redb file fails.
//!
//! redb makes its pending non-durable commits durable when the database is
//! closed. After a failed durable write (a failed fsync of the log above
//! all), those commits may hold changes whose callers got an error and that
//! never became durable in the log; the closing writer raises the fence so
//! that redb's close writes nothing, and the file stays as of its last
//! durable commit (a checkpoint). The next open recovers from there and the
//! log (DESIGN.md guarantee 6).

use std::io;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redb::{BackendError, StorageBackend};

/// The switch of a [`Fenced`] backend, shared with the writer.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fence(Arc<AtomicBool>);

impl Fence {
    /// From now on, the backend refuses every write, resize and sync.
    pub(crate) fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn check(&self) -> io::Result<()> {
        if self.0.load(Ordering::SeqCst) {
            return Err(io::Error::other(
                "the store file is fenced after a failed durable write; reopen the store to recover",
            ));
        }
        Ok(())
    }
}

/// A redb backend that forwards every call to `inner` until its [`Fence`]
/// is raised.
#[derive(Debug)]
pub(crate) struct Fenced<B> {
    inner: B,
    fence: Fence,
}

impl<B> Fenced<B> {
    pub(crate) fn new(inner: B, fence: Fence) -> Fenced<B> {
        Fenced { inner, fence }
    }
}

impl<B: StorageBackend> StorageBackend for Fenced<B> {
    fn len(&self) -> Result<u64, io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.fence.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.fence.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.fence.check()?;
        self.inner.write(offset, data)
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
