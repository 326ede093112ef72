//! The expiry counts: how many expiry index entries of finished records
//! fall in each second of expiry, by the state their slot names (format 4
//! on). `stats` sums the rows of the seconds already past to count the
//! records awaiting eviction, and reads the index entries of the current
//! second only: its time grows with the seconds of backlog (a row each,
//! never more rows than records due), not with how many records each
//! second holds (a million due records of the last minute are 60 rows).
//!
//! Stored in the table [`EXPIRY_COUNTS`]: second of expiry (the slot's
//! expiry in ms ÷ [`SECOND_MS`]) → four little-endian u64s, the entries
//! under each state code of the slot (`schema::expiry_slot`: Succeeded,
//! Failed, retryably Failed, and a code 3 that only damage puts in the
//! finished range). A second with no entry has no row, so the table holds
//! a row per second of the retention period in which records finished
//! (86,400 rows of 40 bytes for a day's retention), whatever the rate.
//! Entries of records in flight (the tagged range, `schema::IN_FLIGHT_TAG`)
//! are not counted: `stats` reads every one of them anyway.
//!
//! Kept by `schema::Tables` in the same write transaction as the index:
//! each entry redb reports inserted or removed (an insert of an entry
//! already there, or a removal of one that is not, counts nothing) moves
//! its second's count, in memory ([`Delta`]); the rows of the seconds it
//! moved are written when the writer's buffer of changes has drained
//! (before every commit: `pending.rs`), once per second touched, not once
//! per entry. A count that would go below zero stops at zero (only a
//! damaged store has one wrong); `verify` recounts the index and reports
//! every second whose row differs ([`Recount`]). A store of an older format
//! gets the table built from its index at open (`schema::migrate`).

use std::collections::BTreeMap;
use std::iter::Peekable;
use std::path::Path;

use redb::{ReadableTable, Table, TableDefinition, WriteTransaction};

use super::schema::{EXPIRY, IN_FLIGHT_TAG, expiry_slot, map_err, slot_code, slot_expiry};
use crate::error::{Error, Result};
use crate::record::State;

/// The expiry counts: second of expiry → the finished entries of that
/// second by state code (see the module docs).
pub(crate) const EXPIRY_COUNTS: TableDefinition<u64, &[u8]> = TableDefinition::new("expiry_counts");

/// The width of a row (ms): `stats` reads the index entries of at most one
/// such stretch, the one `now` falls in.
pub(crate) const SECOND_MS: u64 = 1000;

/// The entries of one second, by state code.
pub(crate) type Counts = [u64; 4];

/// A row's stored length: four u64s.
const ROW_BYTES: usize = 32;

/// The second and state code an entry of `slot` is counted under; `None`
/// for an entry of a record in flight (not counted).
pub(crate) fn second_of(slot: u64) -> Option<(u64, usize)> {
    if slot & IN_FLIGHT_TAG != 0 {
        return None;
    }
    Some((slot_expiry(slot) / SECOND_MS, slot_code(slot)))
}

fn encode(counts: Counts) -> [u8; ROW_BYTES] {
    let mut out = [0u8; ROW_BYTES];
    for (chunk, n) in out.chunks_exact_mut(8).zip(counts) {
        chunk.copy_from_slice(&n.to_le_bytes());
    }
    out
}

/// The counts a row holds.
///
/// # Errors
/// [`Error::CorruptFile`] when the row is not [`ROW_BYTES`] long.
fn decode(path: &Path, second: u64, bytes: &[u8]) -> Result<Counts> {
    if bytes.len() != ROW_BYTES {
        return Err(Error::CorruptFile {
            path: path.to_path_buf(),
            detail: format!(
                "the expiry counts of second {second} are {} bytes, not {ROW_BYTES}",
                bytes.len()
            ),
        });
    }
    let mut counts = Counts::default();
    for (n, chunk) in counts.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut a = [0u8; 8];
        a.copy_from_slice(chunk);
        *n = u64::from_le_bytes(a);
    }
    Ok(counts)
}

/// Adds `b` to `a`, each count saturating.
fn add(a: &mut Counts, b: &Counts) {
    for (n, m) in a.iter_mut().zip(b) {
        *n = n.saturating_add(*m);
    }
}

/// Entries inserted and removed, by second and state code, not yet written
/// to [`EXPIRY_COUNTS`].
#[derive(Debug, Default)]
pub(crate) struct Delta {
    seconds: BTreeMap<u64, [i64; 4]>,
}

impl Delta {
    /// Counts the entry of `slot` as inserted (`inserted`) or removed; an
    /// entry of a record in flight is not counted.
    pub(crate) fn note(&mut self, slot: u64, inserted: bool) {
        let Some((second, code)) = second_of(slot) else {
            return;
        };
        let counts = self.seconds.entry(second).or_default();
        if let Some(n) = counts.get_mut(code) {
            *n = if inserted {
                n.saturating_add(1)
            } else {
                n.saturating_sub(1)
            };
        }
    }

    /// Whether no count moved since the last write.
    pub(crate) fn is_empty(&self) -> bool {
        self.seconds.is_empty()
    }

    /// Writes the moved counts into `table`, one read and one write (or
    /// removal, for a second left with no entry) per second moved, and
    /// empties the delta. A stored row of the wrong length (damage) is
    /// taken as zero and overwritten, with a warning: the counts are
    /// derived, so damage to them must not stop the writer or a recovery
    /// (the records are intact); `verify` then names the second whose count
    /// is wrong, and `stats` may count wrong until it is repaired (export
    /// and import into a new store).
    ///
    /// # Errors
    /// Those of redb.
    pub(crate) fn write(
        &mut self,
        path: &Path,
        table: &mut Table<'_, u64, &'static [u8]>,
    ) -> Result<()> {
        for (second, moved) in std::mem::take(&mut self.seconds) {
            let stored = table
                .get(second)
                .map_err(|e| map_err(path, e))?
                .map(|v| decode(path, second, v.value()));
            let mut counts = match stored {
                None => Counts::default(),
                Some(Ok(counts)) => counts,
                Some(Err(e)) => {
                    tracing::warn!(
                        path = %path.display(),
                        second,
                        error = %e,
                        "expiry counts row malformed: rewritten from this change alone; run idemstore check"
                    );
                    Counts::default()
                }
            };
            for (n, d) in counts.iter_mut().zip(moved) {
                *n = if d >= 0 {
                    n.saturating_add(d.unsigned_abs())
                } else {
                    n.saturating_sub(d.unsigned_abs())
                };
            }
            if counts == Counts::default() {
                table.remove(second).map_err(|e| map_err(path, e))?;
            } else {
                table
                    .insert(second, &encode(counts)[..])
                    .map_err(|e| map_err(path, e))?;
            }
        }
        Ok(())
    }
}

/// What [`due`] counted and what it read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Due {
    /// Finished entries due, by state code.
    pub counts: Counts,
    /// Rows of [`EXPIRY_COUNTS`] read: one per second past with entries.
    pub rows: u64,
    /// Index entries read: those of the current second, due ones and the
    /// first one past them.
    pub entries: u64,
}

/// The finished records' entries due at `now_ms` (expiry at or before it,
/// [`crate::record::is_expired`]), by state code: the rows of every second
/// before `now_ms`'s, and the index entries of its own second up to
/// `now_ms`. Time grows with the seconds past that still have entries (at
/// most one row per entry due) and with the entries of one second; not
/// with how many entries each second past holds.
///
/// # Errors
/// Those of redb, and [`Error::CorruptFile`] for a row of the wrong length.
pub(crate) fn due(
    path: &Path,
    counts: &impl ReadableTable<u64, &'static [u8]>,
    expiry: &impl ReadableTable<(u64, &'static [u8]), ()>,
    now_ms: u64,
) -> Result<Due> {
    let mut out = Due::default();
    let current = now_ms / SECOND_MS;
    for row in counts.range(..current).map_err(|e| map_err(path, e))? {
        let (second, value) = row.map_err(|e| map_err(path, e))?;
        let second = second.value();
        add(&mut out.counts, &decode(path, second, value.value())?);
        out.rows = out.rows.saturating_add(1);
    }
    // The lowest slot of the current second's first millisecond.
    let from = expiry_slot(State::Succeeded, current.saturating_mul(SECOND_MS));
    let empty: &[u8] = &[];
    for entry in expiry
        .range((from, empty)..(IN_FLIGHT_TAG, empty))
        .map_err(|e| map_err(path, e))?
    {
        let (k, _) = entry.map_err(|e| map_err(path, e))?;
        out.entries = out.entries.saturating_add(1);
        let (slot, _) = k.value();
        // Past the current second, or (once `now_ms` is past the latest
        // expiry a slot holds) an entry held at that latest expiry, whose
        // second the rows above already counted.
        if !crate::record::is_expired(slot_expiry(slot), now_ms)
            || slot_expiry(slot) / SECOND_MS != current
        {
            break;
        }
        if let Some(n) = out.counts.get_mut(slot_code(slot)) {
            *n = n.saturating_add(1);
        }
    }
    Ok(out)
}

/// Rebuilds [`EXPIRY_COUNTS`] in `txn` from the expiry index (a migration
/// from an older format): empties the table, then reads the finished
/// entries once, in order, and writes one row per second that has any.
/// Time linear in the entries; memory one row. Returns the rows written.
///
/// # Errors
/// Those of redb.
pub(crate) fn rebuild(path: &Path, txn: &WriteTransaction) -> Result<u64> {
    let expiry = txn.open_table(EXPIRY).map_err(|e| map_err(path, e))?;
    let mut table = txn
        .open_table(EXPIRY_COUNTS)
        .map_err(|e| map_err(path, e))?;
    table.retain(|_, _| false).map_err(|e| map_err(path, e))?;
    let mut rows = 0u64;
    let mut write = |(second, counts): (u64, Counts)| {
        rows = rows.saturating_add(1);
        table
            .insert(second, &encode(counts)[..])
            .map(|_| ())
            .map_err(|e| map_err(path, e))
    };
    let mut current = BySecond::default();
    let empty: &[u8] = &[];
    for entry in expiry
        .range(..(IN_FLIGHT_TAG, empty))
        .map_err(|e| map_err(path, e))?
    {
        let (k, _) = entry.map_err(|e| map_err(path, e))?;
        if let Some(done) = current.count(k.value().0) {
            write(done)?;
        }
    }
    if let Some(done) = current.finish() {
        write(done)?;
    }
    Ok(rows)
}

/// Counts entries fed in index order by second, one second at a time
/// (memory: one row): what [`rebuild`] writes and [`Recount`] compares.
#[derive(Debug, Default)]
struct BySecond {
    current: Option<(u64, Counts)>,
}

impl BySecond {
    /// Counts the entry of `slot` (an entry in flight is not counted);
    /// the second before it, done, when `slot` starts a new one.
    fn count(&mut self, slot: u64) -> Option<(u64, Counts)> {
        let (second, code) = second_of(slot)?;
        let done = match &self.current {
            Some((s, _)) if *s != second => self.current.take(),
            _ => None,
        };
        let (_, counts) = self.current.get_or_insert((second, Counts::default()));
        if let Some(n) = counts.get_mut(code) {
            *n = n.saturating_add(1);
        }
        done
    }

    /// The last second counted, if any.
    fn finish(self) -> Option<(u64, Counts)> {
        self.current
    }
}

/// A stored row as [`rows`] reads it: its second, and its counts (`None`:
/// a row of the wrong length).
pub(crate) type Row = (u64, Option<Counts>);

/// A recount of the expiry index, fed its entries in index order, compared
/// second by second with the stored rows as it goes (`verify`): memory is
/// one row, whatever the store's size.
pub(crate) struct Recount<I: Iterator<Item = Result<Row>>> {
    stored: Peekable<I>,
    current: BySecond,
    /// Seconds whose stored row differs from the recount (a malformed row
    /// always does).
    pub differ: u64,
    /// The first of them: (second, stored (`None`: malformed), recounted).
    pub first: Option<(u64, Option<Counts>, Counts)>,
}

/// The rows of `table` in order, each decoded (`None` for a row of the
/// wrong length).
///
/// # Errors
/// Those of redb, when the table cannot be read (also as items).
pub(crate) fn rows<'a>(
    path: &'a Path,
    table: &'a impl ReadableTable<u64, &'static [u8]>,
) -> Result<impl Iterator<Item = Result<Row>> + 'a> {
    let range = table.range::<u64>(..).map_err(|e| map_err(path, e))?;
    Ok(range.map(move |row| {
        let (second, value) = row.map_err(|e| map_err(path, e))?;
        let second = second.value();
        Ok((second, decode(path, second, value.value()).ok()))
    }))
}

impl<I: Iterator<Item = Result<Row>>> Recount<I> {
    /// A recount against the stored rows `stored` (see [`rows`]).
    pub(crate) fn new(stored: I) -> Self {
        Recount {
            stored: stored.peekable(),
            current: BySecond::default(),
            differ: 0,
            first: None,
        }
    }

    /// Counts one entry of the index (`slot`, in index order).
    ///
    /// # Errors
    /// redb's, reading the stored rows.
    pub(crate) fn entry(&mut self, slot: u64) -> Result<()> {
        match self.current.count(slot) {
            Some(done) => self.compare(Some(done)),
            None => Ok(()),
        }
    }

    /// Compares the last second recounted, and the stored rows left.
    ///
    /// # Errors
    /// redb's, reading the stored rows.
    pub(crate) fn finish(mut self) -> Result<Self> {
        let last = std::mem::take(&mut self.current).finish();
        self.compare(last)?;
        self.compare(None)?;
        Ok(self)
    }

    /// Compares the recounted second `done` with its stored row, after
    /// every stored row before it (each a difference: the index has no
    /// entry there); `None`: every stored row left.
    fn compare(&mut self, done: Option<(u64, Counts)>) -> Result<()> {
        let bound = done.as_ref().map_or(u64::MAX, |(s, _)| *s);
        while let Some(row) = self
            .stored
            .next_if(|r| r.as_ref().map_or(true, |(s, _)| *s < bound))
        {
            let (second, stored) = row?;
            self.differs(second, stored, Counts::default());
        }
        // `u64::MAX` itself is a second no expiry reaches (the slot holds
        // 61 bits of ms).
        if let Some(row) = self
            .stored
            .next_if(|r| r.as_ref().map_or(true, |(s, _)| *s == bound))
        {
            let (second, stored) = row?;
            let recounted = done.map_or(Counts::default(), |(_, c)| c);
            if stored != Some(recounted) {
                self.differs(second, stored, recounted);
            }
        } else if let Some((second, recounted)) = done {
            self.differs(second, Some(Counts::default()), recounted);
        }
        Ok(())
    }

    fn differs(&mut self, second: u64, stored: Option<Counts>, recounted: Counts) {
        self.differ = self.differ.saturating_add(1);
        self.first.get_or_insert((second, stored, recounted));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type First = Option<(u64, Option<Counts>, Counts)>;

    fn memory_db() -> redb::Database {
        redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .unwrap()
    }

    fn stored(path: &Path, table: &Table<'_, u64, &'static [u8]>) -> Vec<Row> {
        rows(path, table).unwrap().map(Result::unwrap).collect()
    }

    fn recount_rows(stored: &[Row], slots: &[u64]) -> (u64, First) {
        let mut r = Recount::new(stored.iter().map(|r| Ok(*r)));
        for slot in slots {
            r.entry(*slot).unwrap();
        }
        let r = r.finish().unwrap();
        (r.differ, r.first)
    }

    fn recount(stored: &[(u64, Counts)], slots: &[u64]) -> (u64, First) {
        let rows: Vec<Row> = stored.iter().map(|(s, c)| (*s, Some(*c))).collect();
        recount_rows(&rows, slots)
    }

    #[test]
    fn a_slot_is_counted_by_its_second_and_state_and_not_in_flight() {
        let done = expiry_slot(State::Succeeded, 12_345);
        assert_eq!(second_of(done), Some((12, 0)));
        let failed = expiry_slot(State::Failed { retryable: true }, 999);
        assert_eq!(second_of(failed), Some((0, 2)));
        assert_eq!(second_of(expiry_slot(State::Processing, 12_345)), None);
    }

    #[test]
    fn a_recount_names_every_second_that_differs() {
        let s = |ms| expiry_slot(State::Succeeded, ms);
        let f = |ms| expiry_slot(State::Failed { retryable: false }, ms);
        let slots = [s(1_000), f(1_500), s(3_000), s(3_999), s(7_000)];
        let right = [(1, [1, 1, 0, 0]), (3, [2, 0, 0, 0]), (7, [1, 0, 0, 0])];
        assert_eq!(recount(&right, &slots), (0, None));
        // A row too few, a row wrong, a row too many.
        let wrong = [(0, [5, 0, 0, 0]), (1, [1, 1, 0, 0]), (3, [1, 0, 0, 0])];
        assert_eq!(
            recount(&wrong, &slots),
            (3, Some((0, Some([5, 0, 0, 0]), [0; 4])))
        );
        assert_eq!(recount(&[], &slots).0, 3);
        assert_eq!(recount(&right, &[]).0, 3);
        // A malformed row differs, whatever the index holds there.
        let malformed = [(1, Some([1, 1, 0, 0])), (3, None), (7, Some([1, 0, 0, 0]))];
        assert_eq!(
            recount_rows(&malformed, &slots),
            (1, Some((3, None, [2, 0, 0, 0])))
        );
    }

    /// Once `now_ms` is past the latest expiry a slot holds, the entries
    /// held at it are counted once, from their row.
    #[test]
    fn entries_held_at_the_latest_expiry_are_counted_once() {
        let db = memory_db();
        let path = Path::new("clamp-test");
        let txn = db.begin_write().unwrap();
        {
            let mut expiry = txn.open_table(EXPIRY).unwrap();
            let mut table = txn.open_table(EXPIRY_COUNTS).unwrap();
            let mut delta = Delta::default();
            for (ms, key) in [(5_000, &b"a"[..]), (u64::MAX, b"b"), (u64::MAX, b"c")] {
                let slot = expiry_slot(State::Succeeded, ms);
                expiry.insert((slot, key), ()).unwrap();
                delta.note(slot, true);
            }
            delta.write(path, &mut table).unwrap();
            for now in [u64::MAX / 2, u64::MAX] {
                let due = due(path, &table, &expiry, now).unwrap();
                assert_eq!(due.counts, [3, 0, 0, 0], "at {now}: {due:?}");
            }
            assert_eq!(
                due(path, &table, &expiry, 5_000).unwrap().counts,
                [1, 0, 0, 0]
            );
            assert_eq!(due(path, &table, &expiry, 4_999).unwrap().counts, [0; 4]);
        }
    }

    #[test]
    fn a_delta_written_twice_nets_out_and_removes_empty_seconds() {
        let db = memory_db();
        let path = Path::new("counts-test");
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(EXPIRY_COUNTS).unwrap();
            let mut delta = Delta::default();
            let slot = expiry_slot(State::Succeeded, 2_500);
            delta.note(slot, true);
            delta.note(slot, true);
            delta.note(expiry_slot(State::Processing, 2_500), true);
            delta.write(path, &mut table).unwrap();
            assert!(delta.is_empty());
            assert_eq!(stored(path, &table), vec![(2, Some([2, 0, 0, 0]))]);
            delta.note(slot, false);
            delta.note(slot, false);
            // A removal the count cannot cover stops at zero.
            delta.note(slot, false);
            delta.write(path, &mut table).unwrap();
            assert_eq!(rows(path, &table).unwrap().count(), 0);
            // A damaged row does not stop the write: it is rewritten from
            // what the delta moved (and `stats` refuses it until then).
            table.insert(4, &[1u8; 7][..]).unwrap();
            assert!(matches!(
                due(path, &table, &txn.open_table(EXPIRY).unwrap(), 9_000),
                Err(Error::CorruptFile { .. })
            ));
            delta.note(expiry_slot(State::Succeeded, 4_000), true);
            delta.write(path, &mut table).unwrap();
            assert_eq!(stored(path, &table), vec![(4, Some([1, 0, 0, 0]))]);
        }
    }
}
