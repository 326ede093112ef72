//! The compaction of a store file that no service holds: gives back to the
//! file system the space that pages freed by eviction and churn keep.

use std::path::Path;

use crate::config::Config;
use crate::error::Result;
use crate::store::Store;

/// What [`compact_file`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Compaction {
    /// The store file's size before, in bytes (before the open: a clean
    /// close may already give back free pages at the end of the file).
    pub bytes_before: u64,
    /// The store file's size after, in bytes.
    pub bytes_after: u64,
    /// Passes of redb's compaction that moved pages (0: nothing to give
    /// back).
    pub passes: u32,
}

/// Compacts the store file at `path` offline: checks every page with
/// redb's integrity check (before the open, whose checkpoint would copy a
/// damaged page under a fresh checksum), then opens it with `config` (the
/// one the service uses: its clock above all, since an open moves the
/// store's time to the clock's; the background sweeper and scrub are
/// turned off), replaying its write-ahead log and migrating an older
/// format, writes a checkpoint and closes it cleanly, then has redb move every page in use to the front of
/// the file and truncate the rest, once redb's integrity check of every
/// page found them sound (compaction rewrites pages with fresh checksums,
/// so it must not copy a damaged one). Records, tokens and metadata are
/// unchanged; only the file shrinks.
///
/// Why: under churn (fresh keys, eviction after retention) the index file
/// grows to a plateau and keeps it; freed pages are reused but never given
/// back (`docs/operations.md`, "Sizing a file store", has the figures).
/// Run it in a maintenance window, or after a burst: the store must not be
/// open anywhere meanwhile. Its time grows with the file's size (it checks
/// every page before the open and again after the close, then reads and
/// rewrites the pages in use); its memory is
/// what `config`'s caches allow while the store is open, then 64 MiB of
/// page cache. A crash during it leaves a file that redb repairs at the next
/// open (a walk of the whole file); nothing is lost. The online
/// alternative is an export into a new store (`docs/operations.md`).
///
/// # Errors
/// - [`Error::Missing`](crate::Error::Missing): no file at `path`.
/// - [`Error::AlreadyOpen`](crate::Error::AlreadyOpen): a `Store` (a
///   running service) holds the file.
/// - [`Error::Poisoned`](crate::Error::Poisoned): the online scrub marked
///   the store damaged (`<path>-damaged`): run `idemstore check` and
///   restore instead; nothing is written. Or a durable write of the
///   compaction's checkpoint failed (its `cause` names the error).
/// - [`Error::CorruptFile`](crate::Error::CorruptFile): redb's check found
///   damaged pages (repaired or not); nothing is compacted: run
///   `idemstore check`.
/// - [`Error::IncompatibleFile`](crate::Error::IncompatibleFile),
///   [`Error::CorruptFile`](crate::Error::CorruptFile),
///   [`Error::CorruptLog`](crate::Error::CorruptLog),
///   [`Error::Storage`](crate::Error::Storage),
///   [`Error::InvalidArgument`](crate::Error::InvalidArgument): as
///   [`Store::open_with`].
pub fn compact_file(path: impl AsRef<Path>, config: Config) -> Result<Compaction> {
    let path = path.as_ref();
    crate::embedded::check_existing(path)?;
    // Refused before anything is written: the open would migrate and
    // checkpoint a store the scrub marked damaged. (Opened by a name the
    // marker is not beside, a hard link, the open finds the marker the
    // store records and opens it read-only: it writes its own checkpoint
    // and time, and the checkpoint below is refused.)
    let marker = crate::embedded::scrub::marker_of_store(path);
    if crate::embedded::scrub::is_marked(&marker) {
        return Err(crate::error::Error::Poisoned {
            cause: crate::embedded::commit::damage_cause(Some(&marker)),
        });
    }
    // Read-only: the open only takes a checkpoint, and persists no time
    // (see `Config::read_only`).
    let config = config.sweep_interval(None).scrub_rate(None).read_only(true);
    let size = |path: &Path| {
        std::fs::metadata(path)
            .map(|m| m.len())
            .map_err(crate::error::Error::storage)
    };
    let bytes_before = size(path)?;
    // Every page is checked before the open below writes a checkpoint.
    crate::embedded::compact::check_pages(path)?;
    {
        let store = Store::open_existing(path, config)?;
        // Refused on a store the scrub marked damaged (Poisoned).
        store.checkpoint()?;
    }
    let passes = crate::embedded::compact::compact(path)?;
    Ok(Compaction {
        bytes_before,
        bytes_after: size(path)?,
        passes,
    })
}
