//! The salvage of a store file whose write-ahead log recovery needs and
//! cannot use: an export of what the index and the log's intact frames
//! hold, read from a copy, the original left as it was.

use std::path::Path;

use crate::backup::ExportSummary;
use crate::config::Config;
use crate::error::Result;
use crate::report::Progress;
use crate::store::Store;

/// What [`salvage_file`] wrote, and what it could not give back.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Salvage {
    /// The export written: a stream [`Store::import`] reads like any
    /// other.
    pub export: ExportSummary,
    /// What of the write-ahead log could not be replayed, as
    /// [`Error::CorruptLog`](crate::Error::CorruptLog) would have said it (the log lost, blank or
    /// with a damaged header after an unclean shutdown; or the offset
    /// where a durable frame is damaged, every frame from there on left
    /// out). `None` when the log gave back everything recovery needed:
    /// the export is then what [`Store::export`] would have written.
    pub lost: Option<String>,
}

/// Exports what can be saved of the store file at `path` when its
/// write-ahead log is unusable, which [`Store::open`] refuses with
/// [`Error::CorruptLog`](crate::Error::CorruptLog) (and `idemstore check` reports as a problem keyed
/// [`LOG_PROBLEM`](crate::LOG_PROBLEM)): every record of the index as of
/// its last checkpoint, plus the changes of the log's frames up to the
/// damage. Changes acknowledged after that are lost: a key claimed or
/// finished since is absent from the export (or in an earlier state), so
/// once the export is imported into a new store
/// (`idemstore import --create`) its next claim runs the work again. That
/// is the loss the open refuses to take silently; take it only when the
/// log cannot be found (a `-wal` file moved or renamed: put it back and
/// open the store instead) and the latest export is older than what the
/// index holds.
///
/// The original files are not written: the store file and its log
/// (`<path>-wal`) are copied into a hidden directory
/// (`.idemstore-salvage-XXXXXX`) beside the file `path` leads to, opened
/// there read-only (no time persisted, as [`Config::read_only`]),
/// exported from the copy with `progress` called after each record, and
/// the copy removed (a copy that cannot be removed is logged as a warning,
/// and the salvage still succeeds). So the salvage needs about as much free
/// disk beside the store as the store file and its log take (plus a
/// megabyte or so for the copy's new log), and time to copy them; the
/// original can still be opened, checked or salvaged again afterwards. The
/// store file is held (a shared lock) while it is copied; a running store
/// holds it exclusively, which refuses the salvage on Linux, but not on a
/// file system that does not keep such locks (NFS): stop the service first.
/// A log of the store's found by another name (one the store records, a
/// hard link's) that holds its changes is not given up: the salvage
/// refuses, naming it, as [`Store::open`] does. No token in the export is
/// one the lost changes may have handed out: the export's token counter is
/// the copy's, raised past the reservation the store made before its
/// unclean shutdown; for a store file older than its log (refused by an
/// open with [`Error::CorruptFile`](crate::Error::CorruptFile)), raised
/// too past a reservation beyond the highest counter the log's frames
/// record, and its clock to the latest time they record, though their
/// changes are lost.
///
/// A log whose header is blank or damaged still gives back the frames
/// after it (their checksums are keyed by the store's identity); since the
/// header no longer says what the log held, a loss is reported all the
/// same.
///
/// # Errors
/// - [`Error::Missing`](crate::Error::Missing): no file at `path`.
/// - [`Error::AlreadyOpen`](crate::Error::AlreadyOpen): a `Store` (a running service) holds the file.
/// - [`Error::IncompatibleFile`](crate::Error::IncompatibleFile): not a regular file, not an idemstore
///   file, of a newer format, its log belongs to another store, or
///   another log of the store's holds its changes (move it into place and
///   open the store instead).
/// - [`Error::CorruptLog`](crate::Error::CorruptLog): a frame of the log passed its checksum but
///   does not decode (not damage a crash leaves: a bug, or a log written
///   on purpose); nothing is exported.
/// - [`Error::CorruptFile`](crate::Error::CorruptFile): the index itself is damaged (run
///   `idemstore check`).
/// - [`Error::CorruptRecord`](crate::Error::CorruptRecord): a stored record fails its checksum; the
///   export stops.
/// - [`Error::Storage`](crate::Error::Storage): the directory beside the store cannot hold the
///   copy (read-only, full), a file cannot be read, or `out` fails.
pub fn salvage_file(
    path: impl AsRef<Path>,
    out: impl std::io::Write,
    progress: impl FnMut(Progress),
) -> Result<Salvage> {
    let path = path.as_ref();
    crate::embedded::check_existing(path)?;
    let copy = crate::embedded::salvage::copy_for_salvage(path)?;
    let config = Config {
        accept_log_loss: Some(path.to_path_buf()),
        ..Config::new()
    }
    .sweep_interval(None)
    .scrub_rate(None)
    .read_only(true);
    let store = Store::open_existing(copy.store(), config)?;
    let lost = store.log_lost().map(str::to_owned);
    let export = store.export(out, progress)?;
    drop(store);
    // The export is whole: a copy left behind is said, not an error.
    copy.remove();
    Ok(Salvage { export, lost })
}
