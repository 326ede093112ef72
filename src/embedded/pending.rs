//! The writer's write buffer: changes to the records table and the expiry
//! index that the writer has decided (and logged) but not yet applied to
//! its open redb transaction.
//!
//! Each change in redb copies the B-tree pages on its path, so applying a
//! change as soon as it is decided costs one B-tree operation per change:
//! a lifecycle makes seven (two record reads, two record writes, the
//! lease's expiry entry inserted and removed, the retention's inserted).
//! Buffered, the changes of the open transaction (up to `COMMIT_EVERY`
//! batches, see `commit.rs`) are applied sorted by key, each key with its
//! last change when it is applied: a few at a time while the writer would
//! block waiting for the syncer's fsync of an earlier batch, and the rest
//! just before the transaction commits, when the writer scans the expiry
//! index (a sweep) or when the buffer is full. A key changed again after
//! it was applied is applied again. A claim whose completion comes while its
//! changes are still buffered so makes, with it, one record read
//! (the claim's, which finds the key absent), one record write and two
//! expiry index writes (the retention's entry inserted; the lease's
//! removed, which finds nothing) instead of seven; and each application
//! writes its keys in order, so that successive ones may land in pages the
//! transaction has already copied. LevelDB's memtable and fjall's are the
//! same idea in front of a sorted table.
//!
//! **The result is the same as applying every change in turn**, whatever
//! the tables held before: for a key of a table, inserts and removes in
//! sequence leave what the last of them says, and that is what is applied.
//! No invariant of the index is relied on, so a store whose index is
//! inconsistent (a record whose expiry entry is missing, an entry left
//! behind) ends each window as it would have without the buffer, and as a
//! replay of the log after a crash leaves it.
//!
//! Recovery's replay (`wal::open`) goes through a buffer too: a record or
//! expiry entry that several frames change (a claim, then its completion)
//! reaches the index once per application of the buffer, in key order; the
//! buffer is applied whenever its estimate reaches [`MAX_PENDING_BYTES`]
//! (checked after each frame) and once the last frame is read.
//!
//! The state counts (`schema::Tally`) move by each key's net change when
//! the buffer is applied. They end as applying every change in turn would
//! whenever they were consistent with the records before; counts already
//! wrong (which `verify` reports) may end otherwise, as a count that would
//! go below zero stops at zero.
//!
//! Nothing here is durable and nothing needs to be: every change is in the
//! batch's log frame before its caller is answered. The buffer belongs to
//! the open transaction: dropped with it when the index fails, and applied
//! before every commit of it, including the one that keeps acknowledged
//! changes readable after a log failure (`settle_open`). Readers outside
//! the writer read committed redb only, through the read gate
//! (`cache.rs`), which already keeps them off every key the open
//! transaction changed until it commits.

use std::collections::BTreeMap;

use super::expiry_counts::Delta;

/// Applied as soon as the buffer's estimate reaches this many bytes
/// (8 MiB), whatever the commit schedule: checked after each request, so
/// the buffer holds at most this plus one request's changes (recovery's
/// replay: after each frame, so plus one frame's changes).
pub(crate) const MAX_PENDING_BYTES: usize = 8 * 1024 * 1024;

/// What a buffered change costs in the estimate besides its key and value:
/// the map's node share and the vectors' headers (an over-estimate for
/// large values, about right for small ones).
const ENTRY_OVERHEAD: usize = 96;

/// What the last change did to an expiry index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryChange {
    Insert,
    Remove,
}

/// A buffered record change: the stored key and its envelope (`None`:
/// removed).
pub(crate) type RecordChange = (Vec<u8>, Option<Vec<u8>>);

/// A buffered expiry entry change: (tagged deadline, stored key) and what
/// happens to it.
pub(crate) type ExpiryChange = ((u64, Vec<u8>), EntryChange);

/// Changes not yet applied to the open transaction's tables, by key.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// Stored key → the record envelope it now holds (`None`: removed).
    records: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// (Tagged deadline, stored key) → the change to that expiry entry.
    expiry: BTreeMap<(u64, Vec<u8>), EntryChange>,
    /// Bytes held, estimated: keys, values and [`ENTRY_OVERHEAD`] per
    /// change made (not per entry held, so it over-counts a key changed
    /// twice), less what was taken out; saturating.
    bytes: usize,
    /// Record changes taken out so far (to be applied): puts, removals.
    taken: (u64, u64),
    /// The expiry counts that the entries applied from the buffer moved,
    /// not yet written: `schema::Tables::apply_pending` writes them, as
    /// the transaction is about to commit or to be scanned (see
    /// `expiry_counts.rs`).
    counts: Delta,
}

impl Pending {
    /// Whether nothing is buffered: no change to apply, and no expiry
    /// count to write.
    pub(crate) fn is_empty(&self) -> bool {
        self.has_no_changes() && self.counts.is_empty()
    }

    /// Whether no change is left to apply (expiry counts may still be
    /// waiting to be written).
    pub(crate) fn has_no_changes(&self) -> bool {
        self.records.is_empty() && self.expiry.is_empty()
    }

    /// The expiry counts moved by applied entries and not yet written.
    pub(crate) fn counts_mut(&mut self) -> &mut Delta {
        &mut self.counts
    }

    /// Whether the buffer should be applied now (see [`MAX_PENDING_BYTES`]).
    pub(crate) fn is_full(&self) -> bool {
        self.bytes >= MAX_PENDING_BYTES
    }

    /// The buffered state of the record under `key`: `None` when the buffer
    /// does not know it (read the table), `Some(None)` when it was removed.
    pub(crate) fn record(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.records.get(key).map(|v| v.as_deref())
    }

    /// Buffers a put (`Some`) or a removal (`None`) of the record `key`.
    pub(crate) fn set_record(&mut self, key: &[u8], envelope: Option<&[u8]>) {
        self.bytes = self.bytes.saturating_add(record_len(key, envelope));
        match self.records.get_mut(key) {
            Some(slot) => *slot = envelope.map(<[u8]>::to_vec),
            None => {
                self.records
                    .insert(key.to_vec(), envelope.map(<[u8]>::to_vec));
            }
        }
    }

    /// Buffers a change of the expiry entry `(deadline, key)`: the last
    /// change of an entry is the one applied.
    pub(crate) fn set_expiry(&mut self, deadline: u64, key: &[u8], change: EntryChange) {
        self.bytes = self.bytes.saturating_add(entry_len(key));
        self.expiry.insert((deadline, key.to_vec()), change);
    }

    /// The record changes taken out since the buffer was made, as (puts,
    /// removals): each key's last change counts once per take.
    pub(crate) fn taken(&self) -> (u64, u64) {
        self.taken
    }

    /// Counts taken record changes by kind (see [`Pending::taken`]).
    fn count_taken(&mut self, records: &[RecordChange]) {
        for (_, envelope) in records {
            let slot = if envelope.is_some() {
                &mut self.taken.0
            } else {
                &mut self.taken.1
            };
            *slot = slot.saturating_add(1);
        }
    }

    /// Takes up to `max` changes in key order (records first, then expiry
    /// entries), leaving the rest buffered (`usize::MAX`: all of them).
    pub(crate) fn take_some(&mut self, max: usize) -> (Vec<RecordChange>, Vec<ExpiryChange>) {
        if max >= self.records.len().saturating_add(self.expiry.len()) {
            self.bytes = 0;
            let records: Vec<RecordChange> =
                std::mem::take(&mut self.records).into_iter().collect();
            let expiry = std::mem::take(&mut self.expiry).into_iter().collect();
            self.count_taken(&records);
            return (records, expiry);
        }
        let mut records = Vec::new();
        while records.len() < max {
            let Some(change) = self.records.pop_first() else {
                break;
            };
            self.bytes = self
                .bytes
                .saturating_sub(record_len(&change.0, change.1.as_deref()));
            records.push(change);
        }
        let mut expiry = Vec::new();
        while records.len() + expiry.len() < max {
            let Some(change) = self.expiry.pop_first() else {
                break;
            };
            self.bytes = self.bytes.saturating_sub(entry_len(&(change.0).1));
            expiry.push(change);
        }
        if self.has_no_changes() {
            self.bytes = 0;
        }
        self.count_taken(&records);
        (records, expiry)
    }
}

/// The estimate of a buffered record change.
fn record_len(key: &[u8], envelope: Option<&[u8]>) -> usize {
    key.len()
        .saturating_add(envelope.map_or(0, <[u8]>::len))
        .saturating_add(ENTRY_OVERHEAD)
}

/// The estimate of a buffered expiry entry change.
fn entry_len(key: &[u8]) -> usize {
    key.len().saturating_add(8).saturating_add(ENTRY_OVERHEAD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_record_change_wins() {
        let mut p = Pending::default();
        assert_eq!(p.record(b"k"), None);
        p.set_record(b"k", Some(b"one"));
        p.set_record(b"k", Some(b"two"));
        assert_eq!(p.record(b"k"), Some(Some(&b"two"[..])));
        p.set_record(b"k", None);
        assert_eq!(p.record(b"k"), Some(None));
        p.set_record(b"a", Some(b"x"));
        let (records, expiry) = p.take_some(usize::MAX);
        assert_eq!(
            records,
            vec![(b"a".to_vec(), Some(b"x".to_vec())), (b"k".to_vec(), None)]
        );
        assert!(expiry.is_empty());
        assert!(p.is_empty());
        assert_eq!(p.record(b"k"), None);
    }

    #[test]
    fn last_entry_change_wins() {
        let mut p = Pending::default();
        // A claim's lease entry, then its completion: the lease entry is to
        // go (whether or not the table holds one), the retention's to come.
        p.set_expiry(5, b"k", EntryChange::Insert);
        p.set_expiry(5, b"k", EntryChange::Remove);
        p.set_expiry(9, b"k", EntryChange::Insert);
        // Removed and put back: put back (a missing entry is restored).
        p.set_expiry(3, b"j", EntryChange::Remove);
        p.set_expiry(3, b"j", EntryChange::Insert);
        p.set_expiry(1, b"z", EntryChange::Remove);
        let (records, expiry) = p.take_some(usize::MAX);
        assert!(records.is_empty());
        assert_eq!(
            expiry,
            vec![
                ((1, b"z".to_vec()), EntryChange::Remove),
                ((3, b"j".to_vec()), EntryChange::Insert),
                ((5, b"k".to_vec()), EntryChange::Remove),
                ((9, b"k".to_vec()), EntryChange::Insert),
            ]
        );
    }

    #[test]
    fn takes_some_in_key_order() {
        let mut p = Pending::default();
        p.set_record(b"b", Some(b"2"));
        p.set_record(b"a", Some(b"1"));
        p.set_expiry(7, b"a", EntryChange::Insert);
        p.set_expiry(2, b"b", EntryChange::Remove);
        let (records, expiry) = p.take_some(3);
        assert_eq!(
            records,
            vec![
                (b"a".to_vec(), Some(b"1".to_vec())),
                (b"b".to_vec(), Some(b"2".to_vec()))
            ]
        );
        assert_eq!(expiry, vec![((2, b"b".to_vec()), EntryChange::Remove)]);
        assert!(!p.is_empty());
        let (records, expiry) = p.take_some(3);
        assert!(records.is_empty());
        assert_eq!(expiry, vec![((7, b"a".to_vec()), EntryChange::Insert)]);
        assert!(p.is_empty());
        assert_eq!(p.take_some(3), (Vec::new(), Vec::new()));
    }

    /// Each take counts the record changes it hands out, by kind, once per
    /// key: what a commit's share owed by evictions is reckoned from.
    #[test]
    fn counts_the_record_changes_taken_by_kind() {
        let mut p = Pending::default();
        p.set_record(b"a", Some(b"1"));
        p.set_record(b"a", None);
        p.set_record(b"b", Some(b"2"));
        p.set_record(b"c", None);
        p.set_expiry(1, b"c", EntryChange::Remove);
        assert_eq!(p.taken(), (0, 0));
        let _ = p.take_some(1);
        assert_eq!(p.taken(), (0, 1));
        let _ = p.take_some(usize::MAX);
        assert_eq!(p.taken(), (1, 2));
        p.set_record(b"a", Some(b"3"));
        let _ = p.take_some(usize::MAX);
        assert_eq!(p.taken(), (2, 2));
    }

    #[test]
    fn fills_at_the_byte_bound() {
        let mut p = Pending::default();
        let value = vec![0u8; 1024 * 1024];
        for i in 0..7u8 {
            p.set_record(&[i], Some(&value));
            assert!(!p.is_full());
        }
        p.set_record(&[7], Some(&value));
        assert!(p.is_full());
        let _ = p.take_some(usize::MAX);
        assert!(!p.is_full());
    }
}
