//! The embedded engine's checks: redb's integrity check of a store file,
//! and the verification of every record, expiry entry and business-key
//! binding of a snapshot.

use std::hash::RandomState;
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata};

use super::overlay::Overlay;

use super::expiry_counts;
use super::schema::{
    self, BUSINESS, EXPIRY, META, RECORDS, Tally, expiry_slot, guard, map_err, open_error,
};
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::report::Progress;
use crate::report::{CheckReport, Integrity, PairDigest, Problem};

/// redb's page cache during the integrity check (bytes): the store's
/// default `cache_bytes`. The check reads every page once, so a larger
/// cache only holds pages it will not read again (redb's default, 1 GiB,
/// made the check's memory grow with the file up to that size).
pub(crate) const CHECK_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// redb's integrity check of the store file at `path` (which no store may
/// hold open): `Integrity::Failed` when the pages are damaged beyond repair.
/// The file is opened through an [`Overlay`], so nothing redb writes while
/// it checks (the mark a damaged file gets for repair, the repair of its
/// allocator state or of a header field) reaches the file: a damaged file
/// is left as it was found, for a later repair or forensic look. Its
/// memory is bounded by [`CHECK_CACHE_BYTES`] of page cache, plus the
/// pages redb writes.
///
/// # Errors
/// [`Error::CorruptFile`] when the file does not open as a redb file of
/// this format; [`Error::AlreadyOpen`], [`Error::Storage`] as the open.
pub(crate) fn integrity(path: &Path) -> Result<Integrity> {
    let view = Overlay::open(path)?;
    guard(path, || {
        let mut db = open_view(path, view)?;
        Ok(integrity_of(&mut db))
    })
}

/// redb's database over `view`, the overlay of the store file at `path`,
/// with [`CHECK_CACHE_BYTES`] of page cache: what redb writes stays in
/// memory. Call it inside [`guard`] (redb may panic on a damaged file).
///
/// # Errors
/// As [`open_error`] says for the file.
fn open_view(path: &Path, view: Overlay) -> Result<Database> {
    Database::builder()
        .set_cache_size(CHECK_CACHE_BYTES)
        .create_with_backend(view)
        .map_err(|e| open_error(path, e))
}

/// Verifies the records and bindings of the store file at `path` from its
/// index alone, without writing the file: redb opens it through an
/// [`Overlay`], which keeps in memory what redb writes (its repair of a
/// file marked for repair, as redb's integrity check leaves a file it
/// finds damaged), so no damaged page is copied under a fresh checksum, as
/// an open of the store, which writes a checkpoint, could. For a file
/// whose pages redb's check found damaged: the records its pages still
/// give, as of the index's last checkpoint (the write-ahead log is not
/// read; a cleanly closed store's index holds every change). Leases, ages
/// and bindings are judged at the store's time as the file records it.
/// Returns the report, the damage marker the store records, when that
/// file exists (found so by whatever name the store was opened), and
/// whether the store was closed cleanly (else its log may hold changes
/// this read did not see). Its memory: [`CHECK_CACHE_BYTES`] of page
/// cache, and the pages redb's repair writes.
///
/// # Errors
/// [`Error::AlreadyOpen`] when a store holds the file; [`Error::CorruptFile`]
/// when redb does not open it (its repair fails on the damage), its
/// metadata does not read, or it is of an older format (whose records
/// this build reads only once an open has migrated them);
/// [`Error::Storage`] when it cannot be read; those of [`verify`].
pub(crate) fn verify_index(
    path: &Path,
    mut progress: impl FnMut(Progress),
) -> Result<(CheckReport, Option<PathBuf>, bool)> {
    let view = Overlay::open(path)?;
    guard(path, || {
        let db = open_view(path, view)?;
        let marker = match schema::recorded_damage_marker(path, &db)? {
            Ok(Some(recorded)) if super::scrub::is_present(&recorded) => Some(recorded),
            _ => None,
        };
        let txn = db.begin_read().map_err(|e| map_err(path, e))?;
        let meta = {
            let table = txn.open_table(META).map_err(|e| map_err(path, e))?;
            schema::read_meta(path, &table)?
        };
        if meta.format != schema::FORMAT_VERSION {
            return Err(Error::CorruptFile {
                path: path.to_path_buf(),
                detail: format!(
                    "the file is of format {}, whose records this build reads once an open \
                     has migrated them",
                    meta.format
                ),
            });
        }
        // For a progress display's total: redb keeps each table's length.
        let total = txn.open_table(RECORDS).and_then(|t| Ok(t.len()?)).ok();
        let report = verify(path, &txn, meta.clock_hwm, |p| {
            progress(Progress { total, ..p });
        })?;
        Ok((report, marker, meta.clean))
    })
}

/// redb's integrity check of every page of `db`, which this process holds
/// alone (used by the check and before a compaction).
pub(crate) fn integrity_of(db: &mut Database) -> Integrity {
    match db.check_integrity() {
        Ok(true) => Integrity::Clean,
        Ok(false) => Integrity::Repaired,
        Err(e) => Integrity::Failed(e.to_string()),
    }
}

/// Verifies every record and binding of the read snapshot `txn`.
///
/// Time is linear in the number of records and index entries: the records
/// and the expiry index are each read once in key order and compared by
/// digest (each record is also looked up by its key, which finds a damaged
/// branch page that hides it from lookups; the expiry counts are recounted
/// on the way through the index, second by second); only when the digests
/// differ is each record's expiry entry looked up, to name the records that lack one. Each business-key binding
/// is looked up from its record and back. Memory is bounded, not by the
/// store's size: two digests, and at most
/// [`MAX_LISTED_PROBLEMS`](crate::MAX_LISTED_PROBLEMS) listed
/// problems (the rest are counted).
pub(crate) fn verify(
    path: &Path,
    txn: &redb::ReadTransaction,
    now_ms: u64,
    mut progress: impl FnMut(Progress),
) -> Result<CheckReport> {
    guard(path, || {
        let (meta, stored_tally) = {
            let table = txn.open_table(META).map_err(|e| map_err(path, e))?;
            (schema::read_meta(path, &table)?, Tally::read(path, &table)?)
        };
        let records = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
        let expiry = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
        let business = txn.open_table(BUSINESS).map_err(|e| map_err(path, e))?;
        let mut report = CheckReport::new(Integrity::NotRun);
        let hashers = [RandomState::new(), RandomState::new()];
        // What the decoded records say the expiry index holds.
        let mut wanted = PairDigest::new(&hashers);
        // What the records say the state counts hold.
        let mut tally = Tally::default();
        for entry in records.iter().map_err(|e| map_err(path, e))? {
            let (k, v) = entry.map_err(|e| map_err(path, e))?;
            let kb = k.value();
            report.records += 1;
            tally.add(Tally::slot_of(v.value()));
            progress(Progress {
                records: report.records,
                bytes: 0,
                total: None,
            });
            // The walk follows child pointers, a lookup separator keys: a
            // damaged separator hides a stored key from lookups (see
            // `super::scrub`).
            let found = records.get(kb).map_err(|e| map_err(path, e))?;
            if found.as_ref().map(|g| g.value()) != Some(v.value()) {
                report.found(Problem::of_record(
                    kb,
                    Key::describe_bytes(kb),
                    "a lookup of this stored key does not find its record: a damaged branch \
                     page (the key would read as absent, and a claim of it would run the work \
                     again)"
                        .into(),
                ));
            }
            let record = match codec::decode_record(kb, v.value()) {
                Ok(r) => r,
                Err(Error::CorruptRecord { key, detail }) => {
                    report.found(Problem::of_record(kb, key, detail));
                    continue;
                }
                Err(other) => return Err(other),
            };
            let mut problem = |detail: String| {
                report.found(Problem::of_key(&record.key, detail));
            };
            if record.token >= meta.next_token {
                problem(format!(
                    "fencing token {} is not below the store's token counter {}: it could be handed out again",
                    record.token, meta.next_token
                ));
            }
            wanted.add(
                &expiry_slot(record.state, record.expires_ms).to_be_bytes(),
                kb,
            );
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
        // The expiry index in its own order. A record without its entry is
        // a problem; an entry without its record (of a damaged record, or
        // left behind: eviction checks the record) is harmless, but makes
        // the digests differ too, so the slow pass below tells them apart.
        // The expiry counts (format 4 on) are recounted on the way, in the
        // index's order, against the stored rows.
        let mut indexed = PairDigest::new(&hashers);
        let seconds = txn
            .open_table(expiry_counts::EXPIRY_COUNTS)
            .map_err(|e| map_err(path, e))?;
        let mut recount = expiry_counts::Recount::new(expiry_counts::rows(path, &seconds)?);
        for entry in expiry.iter().map_err(|e| map_err(path, e))? {
            let (k, _) = entry.map_err(|e| map_err(path, e))?;
            let (deadline, kb) = k.value();
            indexed.add(&deadline.to_be_bytes(), kb);
            recount.entry(deadline)?;
        }
        let recount = recount.finish()?;
        if !wanted.matches(&indexed) {
            missing_expiry_entries(path, &records, &expiry, &mut report)?;
            // The records' problems stay in key order.
            report.problems.sort_by(|a, b| a.key.cmp(&b.key));
        }
        // The state counts (format 2 on): `stats` reads them.
        if let Some(stored) = stored_tally
            && stored != tally
        {
            report.found(Problem::other(
                "(state counts)".into(),
                format!(
                    "the stored state counts {:?} differ from the records' {:?} (processing, succeeded, failed, retryably failed, unreadable): stats would report wrong counts",
                    stored.slots, tally.slots
                ),
            ));
        }
        // The expiry counts (format 4 on): `stats` reads them too.
        if let Some((second, stored, recounted)) = recount.first {
            report.found(Problem::other(
                "(expiry counts)".into(),
                format!(
                    "the expiry counts of {} second(s) differ from the expiry index, first at {} ms: stored {}, index {recounted:?} (succeeded, failed, retryably failed, other): stats would report wrong counts of records awaiting eviction (repair: export, then import into a new store)",
                    recount.differ,
                    second.saturating_mul(expiry_counts::SECOND_MS),
                    stored.map_or_else(|| "a malformed row".to_string(), |c| format!("{c:?}"))
                ),
            ));
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
                report.found(Problem::other(name, detail));
            }
        }
        Ok(report)
    })
}

/// The slow pass, run only when the digests differ: looks up each decodable
/// record's expiry entry and reports the records without one.
fn missing_expiry_entries(
    path: &Path,
    records: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    expiry: &redb::ReadOnlyTable<(u64, &'static [u8]), ()>,
    report: &mut CheckReport,
) -> Result<()> {
    for entry in records.iter().map_err(|e| map_err(path, e))? {
        let (k, v) = entry.map_err(|e| map_err(path, e))?;
        let kb = k.value();
        let Ok(record) = codec::decode_record(kb, v.value()) else {
            // Reported by the first pass.
            continue;
        };
        let found = expiry
            .get((expiry_slot(record.state, record.expires_ms), kb))
            .map_err(|e| map_err(path, e))?
            .is_some();
        if !found {
            report.found(Problem::of_key(
                &record.key,
                format!(
                    "no expiry index entry for its expiry {} ms: eviction would never remove it",
                    record.expires_ms
                ),
            ));
        }
    }
    Ok(())
}
