//! A view of a store file through which redb may write without the file
//! being written: every write, resize and sync lands in memory, over the
//! file's bytes.
//!
//! The check reads the records of a file whose pages redb's own check
//! found damaged through it. redb opens a file for writing only, and an
//! open of a file marked for repair (after a crash, or after redb's check
//! failed on it) repairs the allocation state first: through this view the
//! repair happens in memory, and no damaged page is ever copied under a
//! fresh checksum in the file.

use std::fs::{File, TryLockError};
use std::io;
use std::path::Path;

use parking_lot::Mutex;
use redb::StorageBackend;

use crate::error::{Error, Result};

/// Bytes of a page of the view's memory: a write is kept by whole pages of
/// this size, each first filled with the bytes it covers.
const PAGE: u64 = 4096;

/// A store file seen with the writes made through the view laid over it.
/// Holds a shared lock on the file (`flock`), which the exclusive lock of
/// an open store conflicts with on Linux (where redb takes a whole-file
/// `flock`; elsewhere redb locks byte ranges, and the service must be
/// stopped, as `check` needs anyway). Its memory grows with the distinct pages
/// written (redb's repair writes its allocation state: a small part of
/// the file).
#[derive(Debug)]
pub(crate) struct Overlay {
    file: File,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The view's length in bytes.
    len: u64,
    /// The file's bytes below this offset show through; above it, the
    /// view holds zeros where it holds no page (a resize cut them off).
    base: u64,
    /// Pages written through the view, by page number.
    pages: std::collections::BTreeMap<u64, Box<[u8]>>,
}

impl Overlay {
    /// A view of the file at `path`.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] when a store holds the file;
    /// [`Error::Storage`] when it cannot be opened, locked or measured.
    pub(crate) fn open(path: &Path) -> Result<Overlay> {
        let fail = |what: &str, e: io::Error| {
            Error::Storage(format!("{}: cannot {what}: {e}", path.display()))
        };
        let file = File::open(path).map_err(|e| fail("open it to read", e))?;
        match file.try_lock_shared() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(Error::AlreadyOpen {
                    path: path.to_path_buf(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(fail("lock it", e)),
        }
        let len = file.metadata().map_err(|e| fail("read its size", e))?.len();
        Ok(Overlay {
            file,
            state: Mutex::new(State {
                len,
                base: len,
                pages: std::collections::BTreeMap::new(),
            }),
        })
    }

    /// Reads the file's own bytes at `offset` into `out`.
    #[cfg(unix)]
    fn read_file(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.file, out, offset)
    }

    /// Reads the file's own bytes at `offset` into `out` (callers hold the
    /// state's lock, which keeps the cursor theirs).
    #[cfg(not(unix))]
    fn read_file(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = &self.file;
        f.seek(SeekFrom::Start(offset))?;
        f.read_exact(out)
    }

    /// The view's bytes at `offset` into `out`, which must lie inside it.
    fn read_in(&self, st: &State, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let n = u64::try_from(out.len()).map_err(|_| past_end())?;
        let end = offset.checked_add(n).ok_or_else(past_end)?;
        if end > st.len {
            return Err(past_end());
        }
        out.fill(0);
        if offset < st.base {
            let from_file = usize::try_from(st.base.min(end) - offset).map_err(|_| past_end())?;
            self.read_file(offset, &mut out[..from_file])?;
        }
        if n == 0 {
            return Ok(());
        }
        for (&page, bytes) in st.pages.range(offset / PAGE..=(end - 1) / PAGE) {
            let start = page * PAGE;
            let (from, to) = (start.max(offset), start.saturating_add(PAGE).min(end));
            let src = &bytes[usize::try_from(from - start).map_err(|_| past_end())?
                ..usize::try_from(to - start).map_err(|_| past_end())?];
            let dst = usize::try_from(from - offset).map_err(|_| past_end())?;
            out[dst..dst + src.len()].copy_from_slice(src);
        }
        Ok(())
    }
}

fn past_end() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past the end of the file",
    )
}

impl StorageBackend for Overlay {
    fn len(&self) -> io::Result<u64> {
        Ok(self.state.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let st = self.state.lock();
        self.read_in(&st, offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.state.lock();
        if len < st.len {
            st.base = st.base.min(len);
            // Pages wholly past the end go; the one the end cuts keeps
            // zeros past it, as a file cut and extended again would.
            let first_gone = len.div_ceil(PAGE);
            st.pages.split_off(&first_gone);
            if !len.is_multiple_of(PAGE)
                && let Some(cut) = st.pages.get_mut(&(len / PAGE))
            {
                let keep = usize::try_from(len % PAGE).map_err(|_| past_end())?;
                cut[keep..].fill(0);
            }
        }
        st.len = len;
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut st = self.state.lock();
        let n = u64::try_from(data.len()).map_err(|_| past_end())?;
        let end = offset.checked_add(n).ok_or_else(past_end)?;
        if n == 0 {
            return Ok(());
        }
        for page in offset / PAGE..=(end - 1) / PAGE {
            let start = page * PAGE;
            let page_end = start.saturating_add(PAGE);
            if !st.pages.contains_key(&page) {
                // A new page starts as what the view shows there (zeros
                // past the view's end).
                let mut bytes = vec![0u8; PAGE as usize].into_boxed_slice();
                let shown = st.len.min(page_end).saturating_sub(start);
                let shown = usize::try_from(shown).map_err(|_| past_end())?;
                self.read_in(&st, start, &mut bytes[..shown])?;
                st.pages.insert(page, bytes);
            }
            let (from, to) = (start.max(offset), page_end.min(end));
            let dst = usize::try_from(from - start).map_err(|_| past_end())?;
            let src = usize::try_from(from - offset).map_err(|_| past_end())?;
            let len = usize::try_from(to - from).map_err(|_| past_end())?;
            if let Some(bytes) = st.pages.get_mut(&page) {
                bytes[dst..dst + len].copy_from_slice(&data[src..src + len]);
            }
        }
        st.len = st.len.max(end);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_stay_in_memory_and_reads_see_them_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let original: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &original).unwrap();
        let view = Overlay::open(&path).unwrap();
        view.write(4090, &[0xAA; 20]).unwrap();
        view.write(9_995, &[0xBB; 10]).unwrap();
        assert_eq!(view.len().unwrap(), 10_005);
        let mut all = vec![0u8; 10_005];
        view.read(0, &mut all).unwrap();
        let mut expected = original.clone();
        expected[4090..4110].fill(0xAA);
        expected.resize(10_005, 0);
        expected[9_995..].fill(0xBB);
        assert_eq!(all, expected);
        // Cut and extended again: zeros past the cut, not the file's bytes.
        view.set_len(4_100).unwrap();
        view.set_len(6_000).unwrap();
        let mut tail = vec![1u8; 1_900];
        view.read(4_100, &mut tail).unwrap();
        assert!(tail.iter().all(|&b| b == 0));
        let mut head = vec![0u8; 10];
        view.read(4_090, &mut head).unwrap();
        assert_eq!(head, [0xAA; 10]);
        assert!(view.read(5_999, &mut [0u8; 2]).is_err());
        drop(view);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            original,
            "the file was written"
        );
    }
}
