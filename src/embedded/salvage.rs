//! The copy a salvage opens (`crate::salvage`): the store file and its
//! write-ahead log copied into a directory beside the store, so that
//! opening them, which repairs and checkpoints, writes nothing of the
//! original.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A store file and its log copied for a salvage; removed with
/// [`SalvageCopy::remove`] (or, failing that, when dropped).
pub(crate) struct SalvageCopy {
    dir: tempfile::TempDir,
    store: PathBuf,
}

impl SalvageCopy {
    /// The copy of the store file (its log is `<store>-wal` beside it).
    pub(crate) fn store(&self) -> &Path {
        &self.store
    }

    /// Removes the copy.
    ///
    /// # Errors
    /// [`Error::Storage`] naming the directory left behind.
    pub(crate) fn remove(self) -> Result<()> {
        let dir = self.dir.path().to_path_buf();
        self.dir.close().map_err(|e| {
            Error::Storage(format!(
                "{}: cannot remove the salvage's copy of the store: {e}",
                dir.display()
            ))
        })
    }
}

/// Copies the store file at `path` (which exists: `check_existing`) and
/// its log, when there is one, into a new hidden directory beside it
/// (`.<name>.salvage-XXXXXX`), holding a shared lock on the store file
/// meanwhile: a store open on it holds it exclusively, so a running
/// service is refused and none opens it during the copy.
///
/// # Errors
/// - [`Error::AlreadyOpen`]: a store holds the file.
/// - [`Error::IncompatibleFile`]: the log is not a regular file.
/// - [`Error::Storage`]: the directory cannot be made (read-only, full) or
///   a file cannot be read or copied; the partial copy is removed.
pub(crate) fn copy_for_salvage(path: &Path) -> Result<SalvageCopy> {
    let log = super::log_path_of_file(path);
    super::require_regular(&log, "write-ahead log")?;
    let io = |what: &str, p: &Path, e: std::io::Error| {
        Error::Storage(format!("{}: cannot {what}: {e}", p.display()))
    };
    let held = File::open(path).map_err(|e| io("open the store file", path, e))?;
    match held.try_lock_shared() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            return Err(Error::AlreadyOpen {
                path: path.to_path_buf(),
            });
        }
        Err(TryLockError::Error(e)) => return Err(io("lock the store file", path, e)),
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "store".into(), |n| n.to_string_lossy().into_owned());
    let dir = tempfile::Builder::new()
        .prefix(&format!(".{name}.salvage-"))
        .tempdir_in(parent)
        .map_err(|e| io("make a directory for the salvage's copy", parent, e))?;
    let store = dir.path().join("store");
    std::fs::copy(path, &store).map_err(|e| io("copy the store file", path, e))?;
    if std::fs::symlink_metadata(&log).is_ok() {
        let copied = super::log_path_of_file(&store);
        std::fs::copy(&log, &copied).map_err(|e| io("copy the write-ahead log", &log, e))?;
    }
    drop(held);
    Ok(SalvageCopy { dir, store })
}
