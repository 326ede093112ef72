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
}

/// What one walk saw.
#[derive(Default)]
struct Walk {
    records: u64,
    problems: Vec<Problem>,
    /// Problems found, reported or not.
    found: u64,
    damaged: bool,
    /// The last key walked.
    last: Option<Vec<u8>>,
}

impl Walk {
    fn problem(&mut self, key: String, detail: String, damage: bool) {
        self.found = self.found.saturating_add(1);
        self.damaged |= damage;
        if self.problems.len() < MAX_PROBLEMS_PER_STEP {
            self.problems.push(Problem { key, detail });
        }
    }
}

/// Walks up to `max` records (at least one) after `cursor` in the snapshot
/// `txn`, and moves the cursor past them (back to the first key once the
/// walk reaches the key that was last when the pass started). Emits the
/// debug events `scrub` per step and `scrub pass finished` at the end of a
/// pass (a store under `max` records ends one every step), and an error event `scrub found a problem` per
/// problem reported (target `idemstore::scrub`).
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
            let at = match &walk.last {
                Some(last) => format!("(the index after {})", Key::describe_bytes(last)),
                None => "(the index)".into(),
            };
            walk.problem(at, format!("the walk cannot read on: {detail}"), true);
            true
        }
        Err(other) => return Err(other),
    };
    if walk.records < max as u64 {
        finished = true;
    }
    for problem in &walk.problems {
        tracing::error!(
            target: "idemstore::scrub",
            path = %path.display(),
            key = %problem.key,
            detail = %problem.detail,
            "scrub found a problem"
        );
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

/// Walks up to `max` records of the pass `cursor` is in (starting one when
/// it is at the first key); whether the walk reached the pass's end.
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
        .range::<&[u8]>((start, Bound::Included(end)))
        .map_err(|e| map_err(path, e))?;
    for entry in range.take(max) {
        let (k, v) = entry.map_err(|e| map_err(path, e))?;
        let (kb, vb) = (k.value(), v.value());
        walk.records += 1;
        let name = || Key::describe_bytes(kb);
        if let Some(last) = walk.last.as_deref()
            && kb <= last
        {
            let detail = format!(
                "the walk of the index went back, after {}: a damaged branch page",
                Key::describe_bytes(last)
            );
            walk.problem(name(), detail, true);
        }
        let found = records.get(kb).map_err(|e| map_err(path, e))?;
        if found.as_ref().map(|g| g.value()) != Some(vb) {
            walk.problem(
                name(),
                "a lookup of this stored key does not find its record: a damaged branch page \
                 (the key would read as absent, and a claim of it would run the work again)"
                    .into(),
                true,
            );
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
                    walk.problem(record.key.to_string(), detail, false);
                }
            }
            // A damaged key byte moves the record under another key, and
            // the key it was written for reads as absent: damage, whatever
            // part of the record the checksum failed on.
            Err(Error::CorruptRecord { detail, .. }) => walk.problem(name(), detail, true),
            Err(other) => return Err(other),
        }
        walk.last = Some(kb.to_vec());
    }
    Ok(walk.last.as_deref() == Some(end))
}

// ---------------------------------------------------------------------------
// The damage marker

/// The `<path>-damaged` file that the scrub leaves beside a store file
/// whose index it found damaged. Its presence makes every later open of
/// the store refuse ([`refuse_if_marked`]): a damaged page rewritten by a
/// later write carries a valid checksum again, so the reopen's integrity
/// check alone would not find it, and the store would take claims of keys
/// it can no longer find until the scrub came round again.
pub(crate) fn marker_path_of(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-damaged");
    std::path::PathBuf::from(name)
}

/// Writes the marker of `path` (durably: a temporary file synced, renamed,
/// and the directory synced) with what the scrub found, for the operator.
pub(crate) fn mark_damaged(path: &Path, wall_ms: u64, problems: &[Problem]) -> std::io::Result<()> {
    use std::io::Write;
    let marker = marker_path_of(path);
    let mut temp = marker.as_os_str().to_os_string();
    temp.push(".tmp");
    let temp = std::path::PathBuf::from(temp);
    let mut text = format!(
        "idemstore: the online scrub found the index of {} damaged at {wall_ms} ms since the epoch.\n\
         The store refuses to open while this file exists. Restore from the latest export into a \
         new file (idemstore import --create NEW EXPORT); remove this file only once the store \
         file is known sound (idemstore check).\n",
        path.display()
    );
    for p in problems {
        text.push_str(&format!("{}: {}\n", p.key, p.detail));
    }
    let mut file = std::fs::File::create(&temp)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&temp, &marker)?;
    super::wal::sync_parent_dir(&marker)
}

/// Refuses the open of a store file that the scrub marked damaged, with
/// [`Error::CorruptFile`] naming the marker.
pub(crate) fn refuse_if_marked(path: &Path) -> Result<()> {
    let marker = marker_path_of(path);
    match std::fs::symlink_metadata(&marker) {
        Ok(_) => Err(Error::CorruptFile {
            path: path.to_path_buf(),
            detail: format!(
                "the online scrub found the index damaged (see {}): restore from the latest \
                 export, or remove that file once the store file is known sound",
                marker.display()
            ),
        }),
        Err(_) => Ok(()),
    }
}
