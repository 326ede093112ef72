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

    /// Removes the copy; one that cannot be removed is logged (a warning
    /// naming the directory left behind).
    pub(crate) fn remove(self) {
        let dir = self.dir.path().to_path_buf();
        if let Err(e) = self.dir.close() {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the salvage's copy of the store: remove it by hand");
        }
    }
}

/// Copies the store file at `path` (which exists: `check_existing`) and
/// its log, when there is one, into a new hidden directory beside the file
/// the path leads to (`.idemstore-salvage-XXXXXX`, symlinks followed),
/// holding a shared lock on the store file meanwhile. A store open on the
/// file holds an exclusive lock that conflicts with it on Linux (redb's
/// whole-file `flock`), so a running service is refused and none opens
/// the file during the copy; where the file system does not keep such
/// locks (NFS), the service must be stopped first. The copies are made
/// writable by their owner (the open repairs and checkpoints them), whatever
/// the originals' modes.
///
/// # Errors
/// - [`Error::AlreadyOpen`]: a store holds the file.
/// - [`Error::IncompatibleFile`]: the log is not a regular file.
/// - [`Error::Storage`]: the directory cannot be made (read-only, full) or
///   a file cannot be read or copied; the partial copy is removed.
pub(crate) fn copy_for_salvage(path: &Path) -> Result<SalvageCopy> {
    let log = super::log_path_of_file(path);
    super::require_regular(&log, "write-ahead log")?;
    let fail = |what: String, e: std::io::Error| Error::Storage(format!("{what}: {e}"));
    let held = File::open(path)
        .map_err(|e| fail(format!("cannot open {} to copy it", path.display()), e))?;
    match held.try_lock_shared() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            return Err(Error::AlreadyOpen {
                path: path.to_path_buf(),
            });
        }
        Err(TryLockError::Error(e)) => {
            return Err(fail(format!("cannot lock {}", path.display()), e));
        }
    }
    let file = super::identity_of(path);
    let parent = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = tempfile::Builder::new()
        .prefix(".idemstore-salvage-")
        .tempdir_in(parent)
        .map_err(|e| {
            fail(
                format!(
                    "cannot make a directory in {} for the salvage's copy of the store",
                    parent.display()
                ),
                e,
            )
        })?;
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to).map_err(|e| {
            fail(
                format!("cannot copy {} to {}", from.display(), to.display()),
                e,
            )
        })?;
        writable(to).map_err(|e| fail(format!("cannot make {} writable", to.display()), e))
    };
    let store = dir.path().join("store");
    copy(path, &store)?;
    if std::fs::symlink_metadata(&log).is_ok() {
        copy(&log, &super::log_path_of_file(&store))?;
    }
    drop(held);
    Ok(SalvageCopy { dir, store })
}

/// Makes the file at `path` readable and writable by its owner only.
#[cfg(unix)]
fn writable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// Elsewhere the copy keeps the original's permissions.
#[cfg(not(unix))]
fn writable(_path: &Path) -> std::io::Result<()> {
    Ok(())
}
