//! Offline compaction of a store file: redb moves the pages in use to the
//! front of the file and truncates the rest (the public face is
//! [`crate::compact_file`]).

use std::path::Path;

use redb::Database;

use super::check::CHECK_CACHE_BYTES;
use super::schema::{guard, map_err, open_error};
use crate::error::{Error, Result};
use crate::report::Integrity;

/// How many compaction passes are run at most: redb's `compact` answers
/// whether it moved anything, and a pass after one that did may move more
/// (pages freed by the first). Each pass walks the file; the bound keeps a
/// file that never settles from holding the command forever.
const MAX_PASSES: u32 = 4;

/// redb's integrity check of every page of the file at `path`, which no
/// store may hold open, before anything opens it as a store: the open
/// writes a checkpoint, which would copy a damaged page (the metadata's,
/// with the token counter, say) under a fresh checksum, after which no
/// check could find it.
///
/// # Errors
/// As [`compact`], for the same findings.
pub(crate) fn check_pages(path: &Path) -> Result<()> {
    let checked = guard(path, || {
        let mut db = Database::builder()
            .set_cache_size(CHECK_CACHE_BYTES)
            .open(path)
            .map_err(|e| open_error(path, e))?;
        // A store the scrub marked damaged, found by the marker it records
        // (opened by a name the marker is not beside, a hard link): refused
        // before redb's check, which may repair (write) the file.
        if let Ok(Some(recorded)) = super::schema::recorded_damage_marker(path, &db)?
            && super::scrub::is_present(&recorded)
        {
            return Err(Error::Poisoned {
                cause: super::commit::damage_cause(Some(&recorded)),
            });
        }
        Ok(super::check::integrity_of(&mut db))
    });
    match checked {
        Ok(integrity) => sound(path, integrity),
        Err(Error::CorruptFile { detail, .. }) => sound(path, Integrity::Failed(detail)),
        Err(e) => Err(e),
    }
}

/// `Ok` for a file whose pages are sound; the error that refuses a
/// compaction otherwise.
fn sound(path: &Path, integrity: Integrity) -> Result<()> {
    match integrity {
        Integrity::Clean => Ok(()),
        Integrity::Repaired => Err(Error::CorruptFile {
            path: path.to_path_buf(),
            detail: "redb repaired damaged pages: not compacted; run idemstore check".into(),
        }),
        Integrity::Failed(detail) => Err(Error::CorruptFile {
            path: path.to_path_buf(),
            detail: format!("damaged pages, not compacted: {detail}"),
        }),
        Integrity::NotRun => Err(Error::Storage(format!(
            "{}: the integrity check did not run; not compacted",
            path.display()
        ))),
    }
}

/// Compacts the redb file at `path`, which no store may hold open (redb
/// locks the file) and whose store was closed cleanly (the caller opens
/// and closes it first, so that the log holds nothing the index needs).
/// First runs redb's integrity check of every page, and compacts only a
/// file it found sound. Returns how many passes moved pages.
///
/// # Errors
/// [`Error::AlreadyOpen`](crate::Error::AlreadyOpen) when a process holds
/// the file; [`Error::CorruptFile`](crate::Error::CorruptFile) when redb
/// finds damaged pages (repaired or not: nothing is compacted); [`Error::Storage`](crate::Error::Storage) when it
/// cannot be read or written.
pub(crate) fn compact(path: &Path) -> Result<u32> {
    guard(path, || {
        let mut db = Database::builder()
            .set_cache_size(CHECK_CACHE_BYTES)
            .open(path)
            .map_err(|e| open_error(path, e))?;
        // Never copy a damaged page under a fresh checksum.
        sound(path, super::check::integrity_of(&mut db))?;
        let mut passes = 0;
        while passes < MAX_PASSES && db.compact().map_err(|e| map_err(path, e))? {
            passes += 1;
        }
        Ok(passes)
    })
}
