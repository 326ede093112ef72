//! The embedded engine's checks: redb's integrity check of a store file,
//! and the verification of every record, expiry entry and business-key
//! binding of a snapshot.

use std::path::Path;

use redb::{Database, ReadableTable};

use super::schema::{self, BUSINESS, EXPIRY, META, RECORDS, guard, map_err, open_error};
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::report::Progress;
use crate::report::{CheckReport, Integrity, Problem};

/// redb's integrity check of the store file at `path` (which no store may
/// hold open): `Integrity::Failed` when the pages are damaged beyond repair.
///
/// # Errors
/// [`Error::CorruptFile`] when the file does not open as a redb file of
/// this format; [`Error::AlreadyOpen`], [`Error::Storage`] as the open.
pub(crate) fn integrity(path: &Path) -> Result<Integrity> {
    guard(path, || {
        let mut db = Database::builder()
            .open(path)
            .map_err(|e| open_error(path, e))?;
        Ok(match db.check_integrity() {
            Ok(true) => Integrity::Clean,
            Ok(false) => Integrity::Repaired,
            Err(e) => Integrity::Failed(e.to_string()),
        })
    })
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
