//! Integrity checks: every record's checksum and invariants, and redb's own
//! page-level check (DESIGN.md guarantee 5).

use std::path::Path;

use redb::{Database, ReadableTable};

use crate::backup::Progress;
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::schema::{self, BUSINESS, EXPIRY, META, RECORDS, guard, map_err};
use crate::store::{Config, Store};

/// The outcome of redb's own integrity check of the file's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Integrity {
    /// Not run: [`Store::verify`] on an open store checks records only.
    NotRun,
    /// Every page and checksum of the file is sound.
    Clean,
    /// redb found damage and repaired the file; records lost with the
    /// damaged pages are gone (the record check that follows sees the
    /// repaired file).
    Repaired,
    /// The file's pages are damaged: redb found damage it could not repair,
    /// or the file does not open at all because of it (redb's message, such
    /// as "Primary is corrupted despite 2-phase commit", names what
    /// failed). Records were not checked. The next step is a restore from
    /// the latest export into a new file (`idemstore import --create NEW
    /// EXPORT`).
    Failed(String),
}

/// One problem found by a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The key concerned, as `scope/id` (escaped bytes when the key itself
    /// is damaged), or a business-key binding.
    pub key: String,
    /// What is wrong.
    pub detail: String,
}

/// What a check found: see [`Store::verify`] and [`check_file`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckReport {
    /// redb's page-level check.
    pub integrity: Integrity,
    /// Stored records read (live, expired and damaged).
    pub records: u64,
    /// Business-key bindings read.
    pub bindings: u64,
    /// Every problem found, in key order.
    pub problems: Vec<Problem>,
}

impl CheckReport {
    /// Whether nothing is damaged: no problem, and redb's check (if it ran)
    /// neither failed nor had to repair the file.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty() && matches!(self.integrity, Integrity::NotRun | Integrity::Clean)
    }
}

/// Checks the store file at `path`: first redb's own integrity check of
/// every page (which needs the file to itself, and repairs what it can),
/// then every record as [`Store::verify`] does. `progress` is called after
/// each record. Opens the file only if it exists and no one else holds it.
///
/// This reads the whole file; its cost grows with the file's size.
///
/// Damage is reported in the [`CheckReport`], not as an error: a damaged
/// record as a [`Problem`], and damaged pages, including a file that does
/// not open because of them (redb's "Primary is corrupted despite 2-phase
/// commit", or a panic inside redb), as [`Integrity::Failed`] with what
/// failed. [`CheckReport::is_clean`] is then `false`.
///
/// # Errors
/// - [`Error::Missing`]: no file at `path`.
/// - [`Error::IncompatibleFile`]: the file is empty, not an idemstore
///   file, or of a newer format.
/// - [`Error::AlreadyOpen`]: a `Store` (a running service) holds the file.
/// - [`Error::CorruptLog`]: the write-ahead log beside the file is damaged
///   where recovery needs it (see [`Store::open`]).
/// - [`Error::Storage`]: the file cannot be read.
pub fn check_file(path: impl AsRef<Path>, progress: impl FnMut(Progress)) -> Result<CheckReport> {
    let path = path.as_ref();
    crate::store::check_existing(path)?;
    let damaged = |integrity| CheckReport {
        integrity,
        records: 0,
        bindings: 0,
        problems: Vec::new(),
    };
    let checked = guard(path, || {
        let mut db = Database::builder()
            .open(path)
            .map_err(|e| open_error(path, e))?;
        Ok(match db.check_integrity() {
            Ok(true) => Integrity::Clean,
            Ok(false) => Integrity::Repaired,
            Err(e) => Integrity::Failed(e.to_string()),
        })
    });
    let integrity = match checked {
        Ok(Integrity::Failed(detail)) => return Ok(damaged(Integrity::Failed(detail))),
        Ok(integrity) => integrity,
        Err(Error::CorruptFile { detail, .. }) => {
            return Ok(damaged(Integrity::Failed(format!(
                "the file does not open: {detail}"
            ))));
        }
        Err(e) => return Err(e),
    };
    let store = match Store::open_existing(path, Config::new().sweep_interval(None)) {
        Ok(store) => store,
        Err(Error::CorruptFile { detail, .. }) => {
            return Ok(damaged(Integrity::Failed(format!(
                "the store does not open: {detail}"
            ))));
        }
        Err(e) => return Err(e),
    };
    let mut report = store.verify(progress)?;
    report.integrity = integrity;
    Ok(report)
}

/// Maps an error of opening the redb file for the check.
fn open_error(path: &Path, err: redb::DatabaseError) -> Error {
    match err {
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::WouldBlock =>
        {
            Error::AlreadyOpen {
                path: path.to_path_buf(),
            }
        }
        // redb's answer to a file without its magic number.
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::InvalidData =>
        {
            Error::IncompatibleFile {
                path: path.to_path_buf(),
                detail: format!("not a redb file, so not an idemstore file ({io})"),
            }
        }
        other => map_err(path, other),
    }
}

/// Verifies every record and binding of the read snapshot `txn`.
pub(crate) fn verify(
    path: &Path,
    txn: &redb::ReadTransaction,
    now_ms: u64,
    mut progress: impl FnMut(Progress),
) -> Result<CheckReport> {
    guard(path, || {
        let meta = {
            let table = txn.open_table(META).map_err(|e| map_err(path, e))?;
            schema::read_meta(path, &table)?
        };
        let records = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
        let expiry = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
        let business = txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
        let mut report = CheckReport {
            integrity: Integrity::NotRun,
            records: 0,
            bindings: 0,
            problems: Vec::new(),
        };
        for entry in records.iter().map_err(|e| map_err(path, e))? {
            let (k, v) = entry.map_err(|e| map_err(path, e))?;
            let kb = k.value();
            report.records += 1;
            progress(Progress {
                records: report.records,
                bytes: 0,
            });
            let record = match codec::decode_record(kb, v.value()) {
                Ok(r) => r,
                Err(Error::CorruptRecord { key, detail }) => {
                    report.problems.push(Problem { key, detail });
                    continue;
                }
                Err(other) => return Err(other),
            };
            let mut problem = |detail: String| {
                report.problems.push(Problem {
                    key: record.key.to_string(),
                    detail,
                });
            };
            if record.token >= meta.next_token {
                problem(format!(
                    "fencing token {} is not below the store's token counter {}: it could be handed out again",
                    record.token, meta.next_token
                ));
            }
            let indexed = expiry
                .get((record.expires_ms, kb))
                .map_err(|e| map_err(path, e))?
                .is_some();
            if !indexed {
                problem(format!(
                    "no expiry index entry for its expiry {} ms: eviction would never remove it",
                    record.expires_ms
                ));
            }
            if let Some(bk) = record.business_key.as_deref()
                && !record.is_expired_at(now_ms)
            {
                let bound = business
                    .get(record.key.business_binding(bk).as_slice())
                    .map_err(|e| map_err(path, e))?
                    .map(|v| v.value().to_vec());
                match bound {
                    Some(holder) if holder == kb => {}
                    Some(holder) => problem(format!(
                        "business key {bk:?} is bound to another key, {}",
                        Key::describe_bytes(&holder)
                    )),
                    None => problem(format!("business key {bk:?} has no binding")),
                }
            }
        }
        for entry in business.iter().map_err(|e| map_err(path, e))? {
            let (b, target) = entry.map_err(|e| map_err(path, e))?;
            report.bindings += 1;
            let binding = Key::from_bytes(b.value());
            let name = match &binding {
                Ok(k) => format!("business key {:?} in scope {}", k.id(), k.scope()),
                Err(_) => format!("business key binding {}", b.value().escape_ascii()),
            };
            let target = target.value();
            let stored = records
                .get(target)
                .map_err(|e| map_err(path, e))?
                .map(|v| v.value().to_vec());
            let detail = match (stored, &binding) {
                (None, _) => Some(format!(
                    "names {}, which has no record",
                    Key::describe_bytes(target)
                )),
                (_, Err(e)) => Some(format!("binding key does not parse: {e}")),
                (Some(bytes), Ok(bk)) => match codec::decode_record(target, &bytes) {
                    // The damaged record is reported above.
                    Err(_) => None,
                    Ok(rec)
                        if rec.key.scope() != bk.scope()
                            || rec.business_key.as_deref() != Some(bk.id()) =>
                    {
                        Some(format!("names {}, whose record does not carry it", rec.key))
                    }
                    Ok(_) => None,
                },
            };
            if let Some(detail) = detail {
                report.problems.push(Problem { key: name, detail });
            }
        }
        Ok(report)
    })
}
