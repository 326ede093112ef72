//! The check of a store file that no service holds: redb's own page-level
//! check, then every record's checksum and invariants (DESIGN.md
//! guarantee 5). The report's shape is [`crate::report`].

use std::path::Path;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::report::{CheckReport, Integrity, Problem, Progress};
use crate::store::Store;

/// Checks the store file at `path`: first redb's own integrity check of
/// every page (which needs the file to itself, and repairs what it can),
/// then every record as [`Store::verify`] does. `progress` is called after
/// each record. Opens the file only if it exists and no one else holds it.
/// A file the online scrub marked damaged (`<path>-damaged`, see
/// [`Config::scrub_rate`](crate::Config::scrub_rate)) is checked too, and
/// the marker is reported as a problem: a check is how an operator decides
/// whether to restore or to remove the marker.
///
/// This reads the whole file: its time grows linearly with the file's
/// size (about 1 s for a million records, a 310 MB file, warm; each pass
/// reads each table in its own order). Its memory does not: each pass
/// holds at most 64 MiB of redb's page cache (the store's default
/// `cache_bytes`), plus one record at a time and the report's list of
/// problems (at most [`MAX_LISTED_PROBLEMS`](crate::MAX_LISTED_PROBLEMS)
/// lines, about 2 MB): about 75 MiB at most in all, whatever the file's
/// size or its damage (BENCHMARKS.md).
///
/// Damage is reported in the [`CheckReport`], not as an error: a damaged
/// record as a [`Problem`](crate::Problem), and damaged pages, including a file that does
/// not open because of them (redb's "Primary is corrupted despite 2-phase
/// commit", or a panic inside redb), as [`Integrity::Failed`] with what
/// failed. The records of such a file are still checked as far as its
/// pages give them, read from its index as of its last checkpoint through
/// a view that keeps redb's writes in memory (the file is not written by
/// this read), and each damaged one is named. The write-ahead log is not
/// read then: a cleanly closed store has nothing in it; for another, a
/// problem keyed [`UNREAD_PROBLEM`] says so. When even the index does not
/// read, no record is checked ([`CheckReport::records_checked`] is
/// `false`) and that problem says why. A write-ahead log that recovery
/// needs and cannot use (damaged where a durable frame was, cut short of
/// the length its header records, or missing or blank after an unclean
/// shutdown: what [`Store::open`] refuses with [`Error::CorruptLog`]) is a
/// [`Problem`](crate::Problem) keyed `(write-ahead log)` naming the log,
/// the offset and what failed; its records are not checked then, since the
/// store does not open. [`CheckReport::is_clean`] is then `false`.
///
/// # Errors
/// - [`Error::Missing`]: no file at `path`.
/// - [`Error::IncompatibleFile`]: the file is empty, not a regular file
///   (a directory, a fifo, a device), not an idemstore file, or of a
///   newer format.
/// - [`Error::AlreadyOpen`]: a `Store` (a running service) holds the file.
/// - [`Error::Storage`]: the file cannot be read.
pub fn check_file(
    path: impl AsRef<Path>,
    mut progress: impl FnMut(Progress),
) -> Result<CheckReport> {
    let path = path.as_ref();
    crate::embedded::check_existing(path)?;
    let marker = crate::embedded::scrub::marker_of_store(path);
    // Reported in every outcome: the store opens read-only while it exists.
    let marked: Vec<Problem> = crate::embedded::scrub::is_marked(&marker)
        .then(|| marker_problem(&marker))
        .into_iter()
        .collect();
    // The report with its integrity and the markers: the one beside the
    // path, and the one the store names when the file was opened by a name
    // it is not beside (a hard link).
    let finish = |mut report: CheckReport, integrity, named: Option<&Path>| {
        report.integrity = integrity;
        marked.iter().cloned().for_each(|p| report.found_listed(p));
        if let Some(named) = named
            && named != marker
        {
            report.found_listed(marker_problem(named));
        }
        report
    };
    let unread = |integrity| {
        let mut report = finish(CheckReport::new(Integrity::NotRun), integrity, None);
        report.records_checked = false;
        report
    };
    // Damaged pages: the store is not opened (its opening checkpoint could
    // copy a damaged page under a fresh checksum), but its index is read as
    // it is, through a view that keeps redb's writes in memory, and the
    // records its pages still give are checked; none when even that fails,
    // and the problems say why.
    let damaged = |progress: &mut dyn FnMut(Progress), detail| -> Result<CheckReport> {
        let read = crate::embedded::check::verify_index(path, progress);
        Ok(match read {
            Ok((report, recorded, clean)) => {
                let mut report = finish(report, Integrity::Failed(detail), recorded.as_deref());
                if !clean {
                    report.found_listed(Problem::other(
                        UNREAD_PROBLEM.into(),
                        "the store was not closed cleanly: the changes since its last \
                         checkpoint are in its write-ahead log, which was not read (the \
                         records above are the index's, as of that checkpoint)"
                            .into(),
                    ));
                }
                report
            }
            // A store took the file meanwhile.
            Err(e @ Error::AlreadyOpen { .. }) => return Err(e),
            Err(e) => {
                let mut report = unread(Integrity::Failed(detail));
                report.found_listed(Problem::other(
                    UNREAD_PROBLEM.into(),
                    format!("the records were not read: {e}"),
                ));
                report
            }
        })
    };
    let integrity = match crate::embedded::check::integrity(path) {
        Ok(Integrity::Failed(detail)) => return damaged(&mut progress, detail),
        Ok(integrity) => integrity,
        Err(Error::CorruptFile { detail, .. }) => {
            return damaged(&mut progress, format!("the file does not open: {detail}"));
        }
        Err(e) => return Err(e),
    };
    // A file the scrub marked damaged opens read-only: the check reads it,
    // and reports the marker.
    // Read-only: the check persists no time (see `Config::read_only`).
    let config = Config::new()
        .sweep_interval(None)
        .scrub_rate(None)
        .read_only(true);
    let store = match Store::open_existing(path, config) {
        Ok(store) => store,
        Err(Error::CorruptFile { detail, .. }) => {
            return damaged(&mut progress, format!("the store does not open: {detail}"));
        }
        // The pages are sound (checked above), but the log recovery needs
        // is not: the store does not open, records are not checked.
        Err(Error::CorruptLog {
            path: log,
            offset,
            detail,
        }) => {
            let mut report = unread(integrity);
            report.found_listed(log_problem(&log, offset, &detail));
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
    // Counted once the pages are known sound (the count reads the store's
    // metadata), for a progress display's total.
    let total = store.len().ok();
    let report = store.verify(|p| progress(Progress { total, ..p }))?;
    Ok(finish(report, integrity, store.damage_marker()))
}

/// The [`Problem::key`](crate::Problem::key) of what [`check_file`] could
/// not read of a file whose pages are damaged: the records, when not even
/// the index reads (the detail says why), or the write-ahead log of a
/// store that was not closed cleanly.
pub const UNREAD_PROBLEM: &str = "(not checked)";

/// The [`Problem::key`](crate::Problem::key) of the problem
/// [`check_file`] reports for a write-ahead log that recovery needs and
/// cannot use: the store does not open, so its records were not checked.
pub const LOG_PROBLEM: &str = "(write-ahead log)";

/// What `check_file` reports for a write-ahead log at `log` that recovery
/// needs and cannot use ([`Error::CorruptLog`]).
fn log_problem(log: &Path, offset: u64, detail: &str) -> Problem {
    Problem::other(
        LOG_PROBLEM.into(),
        format!(
            "{} at offset {offset}: {detail}; the store does not open, and its records \
             were not checked: if the log was moved or renamed, put it back (in place of \
             the empty one an open leaves); else restore the latest export into a new store, \
             or, when it is older than what this file holds, salvage this file's records \
             (`idemstore export --accept-log-loss`, `salvage_file`: the changes past the \
             damage are lost, and their keys run again once imported)",
            log.display()
        ),
    )
}

/// What `check_file` reports for the damage marker at `marker`.
fn marker_problem(marker: &Path) -> Problem {
    Problem::other(
        "(damage marker)".into(),
        format!(
            "the online scrub marked this store damaged ({}): it opens read-only while \
             that file exists; restore from an export, or remove the file once the store \
             is known sound",
            marker.display()
        ),
    )
}
