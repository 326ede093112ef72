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

/// Where the scrub stands between steps.
#[derive(Debug, Default)]
pub(crate) struct Cursor {
    /// The last key the previous step walked; `None` starts a pass.
    after: Option<Vec<u8>>,
    /// Records walked in the current pass so far.
    pass_records: u64,
    /// Problems found in the current pass so far.
    pass_problems: u64,
}

/// Walks up to `max` records (at least one) after `cursor` in the snapshot
/// `txn`, and moves the cursor past them (back to the first key once the
/// walk reaches the last). Emits the debug event `scrub` per step and the
/// info event `scrub pass finished` (target `idemstore::scrub`) at the end
/// of a pass, and an error event per problem found.
///
/// # Errors
/// [`Error::Storage`] when the snapshot cannot be read for a reason other
/// than damage; the cursor then stays where it was. Damage (redb's
/// `Corrupted`, a panic inside redb) is reported in the [`ScrubReport`] as a
/// problem, and the next step starts a new pass.
pub(crate) fn step(
    path: &Path,
    txn: &redb::ReadTransaction,
    cursor: &mut Cursor,
    max: usize,
) -> Result<ScrubReport> {
    let max = max.max(1);
    let walked = guard(path, || walk(path, txn, cursor.after.as_deref(), max));
    let mut report = ScrubReport {
        records: 0,
        problems: Vec::new(),
        damaged: false,
        pass_finished: false,
    };
    match walked {
        Ok(walk) => {
            report.records = walk.records;
            report.problems = walk.problems;
            report.damaged = walk.damaged;
            match walk.last {
                Some(last) if walk.records >= max as u64 => cursor.after = Some(last),
                _ => report.pass_finished = true,
            }
        }
        // The walk cannot go on past a page redb cannot read: report it,
        // and start the next pass from the first key.
        Err(Error::CorruptFile { detail, .. }) => {
            report.problems.push(Problem {
                key: match &cursor.after {
                    Some(after) => format!("(the index after {})", Key::describe_bytes(after)),
                    None => "(the index)".into(),
                },
                detail: format!("the walk cannot read on: {detail}"),
            });
            report.damaged = true;
            report.pass_finished = true;
        }
        Err(other) => return Err(other),
    }
    for problem in &report.problems {
        tracing::error!(
            target: "idemstore::scrub",
            path = %path.display(),
            key = %problem.key,
            detail = %problem.detail,
            "scrub found a problem"
        );
    }
    cursor.pass_records = cursor.pass_records.saturating_add(report.records);
    cursor.pass_problems = cursor
        .pass_problems
        .saturating_add(u64::try_from(report.problems.len()).unwrap_or(u64::MAX));
    tracing::debug!(
        target: "idemstore::scrub",
        path = %path.display(),
        records = report.records,
        problems = report.problems.len(),
        "scrub"
    );
    if report.pass_finished {
        tracing::info!(
            target: "idemstore::scrub",
            path = %path.display(),
            records = cursor.pass_records,
            problems = cursor.pass_problems,
            "scrub pass finished"
        );
        *cursor = Cursor::default();
    }
    Ok(report)
}

/// What one walk saw.
struct Walk {
    records: u64,
    problems: Vec<Problem>,
    damaged: bool,
    /// The last key walked.
    last: Option<Vec<u8>>,
}

fn walk(
    path: &Path,
    txn: &redb::ReadTransaction,
    after: Option<&[u8]>,
    max: usize,
) -> Result<Walk> {
    let records = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
    let expiry = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    let range = match after {
        Some(after) => records.range::<&[u8]>((Bound::Excluded(after), Bound::Unbounded)),
        None => records.iter(),
    }
    .map_err(|e| map_err(path, e))?;
    let mut walk = Walk {
        records: 0,
        problems: Vec::new(),
        damaged: false,
        last: after.map(<[u8]>::to_vec),
    };
    for entry in range.take(max) {
        let (k, v) = entry.map_err(|e| map_err(path, e))?;
        let (kb, vb) = (k.value(), v.value());
        walk.records += 1;
        let mut damage = Vec::new();
        if let Some(last) = walk.last.as_deref()
            && kb <= last
        {
            damage.push(format!(
                "the walk of the index went back, after {}: a damaged branch page",
                Key::describe_bytes(last)
            ));
        }
        let found = records.get(kb).map_err(|e| map_err(path, e))?;
        if found.as_ref().map(|g| g.value()) != Some(vb) {
            damage.push(
                "a lookup of this stored key does not find its record: a damaged branch page \
                 (the key would read as absent, and a claim of it would run the work again)"
                    .into(),
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
                    walk.problems.push(Problem {
                        key: record.key.to_string(),
                        detail: format!(
                            "no expiry index entry for its expiry {} ms: eviction would never remove it",
                            record.expires_ms
                        ),
                    });
                }
            }
            Err(Error::CorruptRecord { detail, .. }) => damage.push(detail),
            Err(other) => return Err(other),
        }
        walk.damaged |= !damage.is_empty();
        for detail in damage {
            walk.problems.push(Problem {
                key: Key::describe_bytes(kb),
                detail,
            });
        }
        walk.last = Some(kb.to_vec());
    }
    Ok(walk)
}
