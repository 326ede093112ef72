//! The online scrub: a walk over the records in key order, a bounded step
//! at a time, that finds what redb's page checksums would find but redb
//! verifies only in its full integrity check (at open, or on a closed
//! file): a damaged page read while the store stays open.
//!
//! A walk follows each branch page's child pointers; a lookup follows its
//! separator keys. A flipped byte in a separator makes a lookup of a stored
//! key miss (the key reads as absent, and a claim would run the work a
//! second time) while the walk still finds the record, so each record the
//! walk yields is looked up again and must come back the same. A damaged
//! child pointer shows as keys out of order, a record whose checksum fails,
//! or an error or panic from redb. Each step reads one snapshot of its own,
//! held for that step only (a long-held read transaction would keep redb
//! from reusing the pages that writes free meanwhile).

use std::ops::Bound;
use std::path::Path;

use redb::ReadableTable;

use super::schema::{self, EXPIRY, RECORDS, guard, map_err};
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::report::{Problem, ScrubReport};

/// The most problems one step reports ([`ScrubReport::problems`]); the
/// pass's count in the event `scrub pass finished` counts them all.
pub(crate) const MAX_PROBLEMS_PER_STEP: usize = 100;

/// Where the scrub stands between steps.
#[derive(Debug, Default)]
pub(crate) struct Cursor {
    /// The last key the previous step walked; `None` starts a pass.
    after: Option<Vec<u8>>,
    /// The last key of the index when the pass started: the pass ends
    /// there, so that keys inserted past it cannot keep a pass from ending.
    end: Option<Vec<u8>>,
    /// Records walked in the current pass so far.
    pass_records: u64,
    /// Problems found in the current pass so far.
    pass_problems: u64,
    /// Steps in a row that failed to read (an I/O error) where the cursor
    /// stands.
    failures: u32,
}

/// After this many steps in a row fail to read at the same place, the
/// place counts as damage (a sector that no longer reads), so that a pass
/// neither stalls there forever nor ends without a word.
pub(crate) const MAX_READ_FAILURES: u32 = 10;

/// What one walk saw.
#[derive(Default)]
struct Walk {
    records: u64,
    problems: Vec<Problem>,
    /// Whether each reported problem is damage.
    damage: Vec<bool>,
    /// Problems found, reported or not.
    found: u64,
    damaged: bool,
    /// The last key walked.
    last: Option<Vec<u8>>,
}

impl Walk {
    fn problem(&mut self, problem: Problem, damage: bool) {
        self.found = self.found.saturating_add(1);
        self.damaged |= damage;
        if self.problems.len() < MAX_PROBLEMS_PER_STEP {
            self.problems.push(problem);
            self.damage.push(damage);
        }
    }
}

/// Walks up to `max` records (at least one) after `cursor` in the snapshot
/// `txn`, and moves the cursor past them (back to the first key once the
/// walk reaches the key that was last when the pass started). Emits the
/// debug events `scrub` per step and `scrub pass finished` at the end of a
/// pass (a store under `max` records ends one every step), an error event
/// `scrub found damage` per damage and a warn event `scrub found a
/// problem` per missing expiry entry reported (target `idemstore::scrub`).
///
/// # Errors
/// [`Error::Storage`] when the snapshot cannot be read for a reason other
/// than damage (an I/O error); the cursor then stays where it was, and the
/// next step tries the same records again. Damage (redb's `Corrupted`, a
/// panic inside the walk) is reported in the [`ScrubReport`] as a problem,
/// and the next step starts a new pass.
pub(crate) fn step(
    path: &Path,
    txn: &redb::ReadTransaction,
    cursor: &mut Cursor,
    max: usize,
) -> Result<ScrubReport> {
    let max = max.max(1);
    let mut walk = Walk {
        last: cursor.after.clone(),
        ..Walk::default()
    };
    let walked = guard(path, || walk_records(path, txn, cursor, &mut walk, max));
    let mut finished = match walked {
        Ok(finished) => finished,
        // The walk cannot go on past a page redb cannot read: report it
        // where the walk stopped, and start the next pass from the first
        // key.
        Err(Error::CorruptFile { detail, .. }) => {
            let at = place(walk.last.as_deref());
            let detail = format!("the walk cannot read on: {detail}");
            walk.problem(Problem::other(at, detail), true);
            true
        }
        Err(other) => {
            cursor.failures = cursor.failures.saturating_add(1);
            if cursor.failures < MAX_READ_FAILURES {
                return Err(other);
            }
            let at = place(cursor.after.as_deref());
            let detail = format!(
                "the walk failed to read {} times in a row here: {other}",
                cursor.failures
            );
            walk.problem(Problem::other(at, detail), true);
            true
        }
    };
    cursor.failures = 0;
    if walk.records < max as u64 {
        finished = true;
    }
    for (problem, damage) in walk.problems.iter().zip(&walk.damage) {
        log_problem(path, problem, *damage);
    }
    cursor.pass_records = cursor.pass_records.saturating_add(walk.records);
    cursor.pass_problems = cursor.pass_problems.saturating_add(walk.found);
    tracing::debug!(
        target: "idemstore::scrub",
        path = %path.display(),
        records = walk.records,
        problems = walk.found,
        "scrub"
    );
    if finished {
        tracing::debug!(
            target: "idemstore::scrub",
            path = %path.display(),
            records = cursor.pass_records,
            problems = cursor.pass_problems,
            "scrub pass finished"
        );
        *cursor = Cursor::default();
    } else {
        cursor.after = walk.last;
    }
    Ok(ScrubReport {
        records: walk.records,
        problems: walk.problems,
        damaged: walk.damaged,
        pass_finished: finished,
    })
}

/// The event of one problem found: error `scrub found damage`, or warn
/// `scrub found a problem` (a missing expiry entry).
fn log_problem(path: &Path, problem: &Problem, damage: bool) {
    if damage {
        tracing::error!(
            target: "idemstore::scrub",
            path = %path.display(),
            key = %problem.key,
            detail = %problem.detail,
            "scrub found damage"
        );
    } else {
        tracing::warn!(
            target: "idemstore::scrub",
            path = %path.display(),
            key = %problem.key,
            detail = %problem.detail,
            "scrub found a problem"
        );
    }
}

/// How a problem names the place where the walk stopped: after the last
/// key walked, or at the start.
fn place(after: Option<&[u8]>) -> String {
    match after {
        Some(after) => format!("(the index after {})", Key::describe_bytes(after)),
        None => "(the index)".into(),
    }
}

/// The report of a step that could not even open its snapshot (redb
/// reports the file corrupted): damage, and the pass ends.
pub(crate) fn unreadable(path: &Path, cursor: &mut Cursor, detail: &str) -> ScrubReport {
    let problem = Problem::other(
        place(None),
        format!("the scrub's snapshot cannot be read: {detail}"),
    );
    log_problem(path, &problem, true);
    *cursor = Cursor::default();
    ScrubReport {
        records: 0,
        problems: vec![problem],
        damaged: true,
        pass_finished: true,
    }
}

/// Walks up to `max` records of the pass `cursor` is in (starting one when
/// it is at the first key); whether the walk reached the pass's end. The
/// walk is not bounded by the pass's last key: a key that sorts past it,
/// met before it while it is still stored (or the table's end met so), is
/// keys out of order, which a bounded range would take for the pass's end
/// (a damaged key byte that moves a record past the last key hid every
/// record after it from every pass).
fn walk_records(
    path: &Path,
    txn: &redb::ReadTransaction,
    cursor: &mut Cursor,
    walk: &mut Walk,
    max: usize,
) -> Result<bool> {
    let records = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
    let expiry = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    if cursor.after.is_none() {
        match records.last().map_err(|e| map_err(path, e))? {
            Some((k, _)) => cursor.end = Some(k.value().to_vec()),
            None => return Ok(true),
        }
    }
    let Some(end) = cursor.end.as_deref() else {
        return Ok(true);
    };
    let start = match cursor.after.as_deref() {
        Some(after) => Bound::Excluded(after),
        None => Bound::Unbounded,
    };
    let range = records
        .range::<&[u8]>((start, Bound::Unbounded))
        .map_err(|e| map_err(path, e))?;
    // The pass's last key, when still stored, must be met before any key
    // past it.
    let end_stored =
        || -> Result<bool> { Ok(records.get(end).map_err(|e| map_err(path, e))?.is_some()) };
    let mut walked = 0usize;
    for entry in range.take(max) {
        let (k, v) = entry.map_err(|e| map_err(path, e))?;
        let (kb, vb) = (k.value(), v.value());
        walked += 1;
        if kb > end {
            // A key past the last one is a key stored after the pass began,
            // unless its lookup misses (a damaged key byte moved it here)
            // or the last key, still stored, was not met before it.
            let found = records.get(kb).map_err(|e| map_err(path, e))?;
            if found.as_ref().map(|g| g.value()) != Some(vb) {
                walk.records += 1;
                let detail = "a lookup of this stored key, past the last key when the pass \
                              began, does not find its record: a damaged page (a record moved \
                              past the last key by a damaged key byte hides every record after \
                              it)";
                walk.problem(
                    Problem::of_record(kb, Key::describe_bytes(kb), detail.into()),
                    true,
                );
            } else if end_stored()? {
                walk.records += 1;
                let detail = format!(
                    "the walk of the index met this key before {}, the last key when the pass \
                     began, which is still stored: keys out of order, a damaged page (a record \
                     moved past the last key by a damaged key byte hides every record after \
                     it)",
                    Key::describe_bytes(end)
                );
                walk.problem(
                    Problem::of_record(kb, Key::describe_bytes(kb), detail),
                    true,
                );
            }
            // Keys past it were stored after the pass began: the next one
            // walks them.
            return Ok(true);
        }
        walk.records += 1;
        let name = || Key::describe_bytes(kb);
        if let Some(last) = walk.last.as_deref()
            && kb <= last
        {
            let detail = format!(
                "the walk of the index went back, after {}: a damaged branch page",
                Key::describe_bytes(last)
            );
            walk.problem(Problem::of_record(kb, name(), detail), true);
        }
        let found = records.get(kb).map_err(|e| map_err(path, e))?;
        if found.as_ref().map(|g| g.value()) != Some(vb) {
            let detail = "a lookup of this stored key does not find its record: a damaged \
                          branch page (the key would read as absent, and a claim of it would \
                          run the work again)";
            walk.problem(Problem::of_record(kb, name(), detail.into()), true);
        }
        match codec::decode_record(kb, vb) {
            Ok(record) => {
                let slot = schema::expiry_slot(record.state, record.expires_ms);
                if expiry
                    .get((slot, kb))
                    .map_err(|e| map_err(path, e))?
                    .is_none()
                {
                    let detail = format!(
                        "no expiry index entry for its expiry {} ms: eviction would never remove it",
                        record.expires_ms
                    );
                    walk.problem(Problem::of_key(&record.key, detail), false);
                }
            }
            // A damaged key byte moves the record under another key, and
            // the key it was written for reads as absent: damage, whatever
            // part of the record the checksum failed on.
            Err(Error::CorruptRecord { detail, .. }) => {
                walk.problem(Problem::of_record(kb, name(), detail), true);
            }
            Err(other) => return Err(other),
        }
        walk.last = Some(kb.to_vec());
        if kb == end {
            return Ok(true);
        }
    }
    if walked < max && end_stored()? {
        // The table ended before the pass's last key, which is stored.
        let detail = format!(
            "the walk of the index ended before {}, the last key when the pass began, which \
             is still stored: a damaged page",
            Key::describe_bytes(end)
        );
        walk.problem(Problem::other(place(walk.last.as_deref()), detail), true);
        return Ok(true);
    }
    Ok(walked < max)
}

// ---------------------------------------------------------------------------
// The damage marker

/// The `<path>-damaged` file that the scrub leaves beside a store file
/// whose index it found damaged (`path` made absolute at the open, so
/// that a later change of the working directory does not move it). While
/// it exists, every open of the store opens it read-only: a damaged page
/// rewritten by a later write carries a valid checksum again, so the
/// reopen's integrity check alone would not find it, and the store would
/// take claims of keys it can no longer find until the scrub came round
/// again. Reads, scans and exports still work, for the restore.
pub(crate) fn marker_path_of(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-damaged");
    std::path::PathBuf::from(name)
}

/// The damage marker of the store file at `path`, as given to an open:
/// [`marker_path_of`] the file's canonical path, so that every spelling of
/// the same file (a relative path from another directory, a symlink to it
/// or to a directory on its path) finds the same marker. A file that does
/// not exist yet is named by its canonical directory and its file name; a
/// path that cannot be resolved at all, by its absolute spelling. A hard
/// link is another name of the same file that no canonical path leads back
/// from: the store names its marker itself (`schema::META_DAMAGE_MARKER`,
/// recorded by the checkpoint the scrub asks for once the marker is
/// written, and at every later checkpoint and close), and an open by any
/// name finds it there. A damaged store's close also forgets its last
/// verification, so every later open runs the full integrity check.
pub(crate) fn marker_of_store(path: &Path) -> std::path::PathBuf {
    marker_path_of(&super::identity_of(path))
}

/// The temporary name the marker is written under before its rename.
fn marker_temp_of(marker: &Path) -> std::path::PathBuf {
    let mut name = marker.as_os_str().to_os_string();
    name.push(".tmp");
    std::path::PathBuf::from(name)
}

/// Writes `marker` (durably: a temporary file synced, renamed, and the
/// directory synced) with what the scrub found in the store at `path`, for
/// the operator.
pub(crate) fn mark_damaged(
    marker: &Path,
    path: &Path,
    wall_ms: u64,
    problems: &[Problem],
) -> std::io::Result<()> {
    use std::io::Write;
    let temp = marker_temp_of(marker);
    let mut text = format!(
        "idemstore: the online scrub found the index of {} damaged at {wall_ms} ms since the epoch.\n\
         The store opens read-only while this file exists: export it (idemstore export), restore \
         the export into a new file (idemstore import --create NEW EXPORT), and move this file \
         away with the damaged one. Remove it only once idemstore check reports no other problem.\n",
        path.display()
    );
    for p in problems {
        text.push_str(&format!("{}: {}\n", p.key, p.detail));
    }
    let mut file = std::fs::File::create(&temp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&temp, marker)?;
    super::wal::sync_parent_dir(marker)
}

/// Whether `marker` (or its temporary name, left by a crash during the
/// write) exists. A name that cannot be looked up for another reason
/// (permissions) counts as marked: the safe side.
pub(crate) fn is_marked(marker: &Path) -> bool {
    marker_exists(marker, |_, _| true)
}

/// Whether the marker a store records (`schema::META_DAMAGE_MARKER`), or
/// its temporary name, exists. Unlike [`is_marked`], a name that cannot be
/// looked up counts as absent (logged, warn): the path came from the file,
/// and a lookup that fails for it (a component that is not a directory, a
/// directory this process may not read) must not leave the store read-only
/// with no marker the operator could remove. The marker beside the file's
/// own canonical path keeps [`is_marked`]'s safe side.
pub(crate) fn is_present(marker: &Path) -> bool {
    marker_exists(marker, |p, e| {
        tracing::warn!(marker = %p.display(), error = %e, "the recorded damage marker cannot be looked up: taken as absent");
        false
    })
}

/// Whether `marker` or its temporary name exists; a lookup that fails
/// other than as absent answers what `failed` says.
fn marker_exists(marker: &Path, failed: impl Fn(&Path, std::io::Error) -> bool) -> bool {
    let exists = |p: &Path| match std::fs::symlink_metadata(p) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => failed(p, e),
    };
    exists(marker) || exists(&marker_temp_of(marker))
}

/// Renames a marker (and its temporary name) left beside a store file that
/// no longer exists to `<marker>.before-<wall_ms>`, so that the new store
/// created at the path is not taken for the damaged one; logged (warn).
/// A rename that fails is logged and the marker left.
pub(crate) fn set_aside_stale(marker: &Path, wall_ms: u64) {
    for name in [marker.to_path_buf(), marker_temp_of(marker)] {
        if std::fs::symlink_metadata(&name).is_err() {
            continue;
        }
        let mut aside = name.as_os_str().to_os_string();
        aside.push(format!(".before-{wall_ms}"));
        match std::fs::rename(&name, &aside) {
            Ok(()) => tracing::warn!(
                marker = %name.display(),
                moved_to = ?aside,
                "a damage marker without its store file was set aside: the store at this path is new"
            ),
            Err(e) => tracing::warn!(
                marker = %name.display(),
                error = %e,
                "a damage marker without its store file could not be set aside"
            ),
        }
    }
}
