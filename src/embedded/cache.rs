//! The read path's shared state: a bounded cache of finished records, and
//! the gate that keeps reads outside the writer from seeing a change before
//! it is durable.
//!
//! The writer applies batches to the redb index with non-durable commits,
//! each covering one or several batches, while the log's fsync for them may
//! still be running. Before it applies a batch it marks every record key the
//! batch changes as *pending* with the batch's sequence number; a key is
//! pending while that number is above the *visible* sequence number: the
//! last one both committed to the index and, in `Immediate` mode, durable.
//! A reader reads redb and then checks the gate: if the key is pending, what
//! it read may be older than an acknowledged change or not durable yet, and
//! it waits (a `get`) or goes through the writer (a claim). A read that saw
//! the new value found the key pending at its check, since the mark was set
//! before the commit and is cleared only once the change is visible; a read
//! that saw an older value while the key was not pending read the latest
//! visible state. In `Buffered` mode a mark lasts only until the commit.
//!
//! The cache holds only finished records (succeeded, or failed permanently):
//! never an in-progress or retryably failed one, whose answer depends on the
//! time and on other claimers (AWS Powertools' rule). An entry carries its
//! record's expiry and is ignored from then on; any write to its key drops
//! it. An entry is inserted only if no write touched its shard between the
//! reader's lookup and its insert (a version per shard), so a reader that
//! raced a writer never caches what it read before the write.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;

use hashbrown::HashTable;
use parking_lot::Mutex;

use crate::key::Key;
use crate::record::{Record, State};

const SHARDS: usize = 64;

/// The answer of [`ReadCache::lookup`].
pub(crate) enum Lookup {
    /// A finished, unexpired record, shared with the cache (a replay clones
    /// it once, for its answer).
    Hit(Arc<Record>),
    /// The key has a change that is not yet durable, in the batch with this
    /// sequence number.
    Pending(u64),
    /// Read the index; pass this version to [`ReadCache::after_read`].
    Miss(u64),
}

/// A stored key (`[scope length u8][scope][id]`, or a business binding of
/// the same layout) in two parts, so that a [`Key`] is looked up without
/// building its stored form.
#[derive(Clone, Copy)]
pub(crate) struct StoredKey<'a> {
    head: u8,
    rest: &'a [u8],
}

impl<'a> StoredKey<'a> {
    /// The stored form of `key`, borrowed.
    pub(crate) fn of(key: &'a Key) -> StoredKey<'a> {
        let (head, rest) = key.stored_parts();
        StoredKey { head, rest }
    }

    /// Stored key bytes as the writer holds them.
    pub(crate) fn bytes(bytes: &'a [u8]) -> StoredKey<'a> {
        match bytes.split_first() {
            Some((&head, rest)) => StoredKey { head, rest },
            // No stored key is empty; an empty one gets a form of its own.
            None => StoredKey { head: 0, rest: &[] },
        }
    }

    fn matches(self, stored: &[u8]) -> bool {
        stored.split_first() == Some((&self.head, self.rest))
            || (stored.is_empty() && self.head == 0 && self.rest.is_empty())
    }

    fn to_vec(self) -> Box<[u8]> {
        let mut out = Vec::with_capacity(1 + self.rest.len());
        out.push(self.head);
        out.extend_from_slice(self.rest);
        out.into_boxed_slice()
    }
}

/// The bounded cache of finished records and the durability gate.
pub(crate) struct ReadCache {
    shards: Box<[Mutex<Shard>]>,
    /// SipHash with a random key per cache: stored keys come from callers,
    /// and a predictable hash would let them collide on purpose.
    hasher: RandomState,
    shard_budget: usize,
}

#[derive(Default)]
struct Shard {
    /// A slot per key that is pending or cached (or both); found by the
    /// key's one hash, computed once per call.
    slots: HashTable<Slot>,
    /// Insertion order for eviction: (hash, key, entry id); stale ids are
    /// skipped.
    order: VecDeque<(u64, Box<[u8]>, u64)>,
    /// Cached entries (slots with an entry).
    entries: usize,
    bytes: usize,
    /// Bumped by every write to a key of this shard.
    version: u64,
    next_id: u64,
}

struct Slot {
    key: Box<[u8]>,
    hash: u64,
    /// Sequence number of the key's latest undurable change.
    pending: Option<u64>,
    entry: Option<Entry>,
}

struct Entry {
    record: Arc<Record>,
    size: usize,
    id: u64,
}

impl ReadCache {
    /// A cache holding at most about `budget_bytes` of records (0 disables
    /// caching; the gate still works).
    pub(crate) fn new(budget_bytes: usize) -> ReadCache {
        ReadCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            shard_budget: budget_bytes / SHARDS,
        }
    }

    /// The key's hash (the same for both forms of a stored key) and its
    /// shard, chosen by bits the table itself does not use first.
    fn locate(&self, key: StoredKey<'_>) -> (u64, &Mutex<Shard>) {
        let mut h = self.hasher.build_hasher();
        h.write_u8(key.head);
        h.write(key.rest);
        let hash = h.finish();
        (hash, &self.shards[((hash >> 32) as usize) % SHARDS])
    }

    /// Looks `key` up before a read of the index. `synced` is the visible
    /// sequence number.
    pub(crate) fn lookup(&self, key: StoredKey<'_>, now_ms: u64, synced: u64) -> Lookup {
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        if let Some(seq) = shard.pending_above(hash, key, synced) {
            return Lookup::Pending(seq);
        }
        let expired = match shard.find(hash, key).and_then(|slot| slot.entry.as_ref()) {
            Some(e) if !e.record.is_expired_at(now_ms) => {
                return Lookup::Hit(Arc::clone(&e.record));
            }
            Some(_) => true,
            None => false,
        };
        if expired {
            shard.remove_entry(hash, key);
        }
        Lookup::Miss(shard.version)
    }

    /// Checks the gate after a read of the index, and caches a finished
    /// record. Returns the pending sequence number when what was read may
    /// not be durable yet.
    pub(crate) fn after_read(
        &self,
        key: StoredKey<'_>,
        record: Option<&Arc<Record>>,
        version: u64,
        now_ms: u64,
        synced: u64,
    ) -> Option<u64> {
        let (hash, shard) = self.locate(key);
        let mut shard = shard.lock();
        if let Some(seq) = shard.pending_above(hash, key, synced) {
            return Some(seq);
        }
        if let Some(rec) = record {
            let finished = matches!(
                rec.state,
                State::Succeeded | State::Failed { retryable: false }
            );
            if finished && shard.version == version && !rec.is_expired_at(now_ms) {
                shard.insert(hash, key, rec, self.shard_budget);
            }
        }
        None
    }

    /// Called by the writer before it applies a batch to the index: drops
    /// the cached entries of `keys` and, with `Some(seq)`, marks them pending
    /// until `seq` is visible.
    pub(crate) fn begin_write(&self, keys: &[Vec<u8>], seq: Option<u64>) {
        for key in keys {
            let key = StoredKey::bytes(key);
            let (hash, shard) = self.locate(key);
            let mut shard = shard.lock();
            shard.version += 1;
            shard.remove_entry(hash, key);
            if let Some(seq) = seq {
                shard.slot_mut(hash, key).pending = Some(seq);
            }
        }
    }

    /// Called once everything up to `seq` is visible: forgets those pending
    /// marks (a later batch's mark on the same key stays).
    pub(crate) fn end_write(&self, keys: &[Vec<u8>], seq: u64) {
        for key in keys {
            let key = StoredKey::bytes(key);
            let (hash, shard) = self.locate(key);
            let mut shard = shard.lock();
            if let Some(slot) = shard.find_mut(hash, key)
                && slot.pending.is_some_and(|s| s <= seq)
            {
                slot.pending = None;
                shard.drop_if_empty(hash, key);
            }
        }
    }
}

impl Shard {
    fn find(&self, hash: u64, key: StoredKey<'_>) -> Option<&Slot> {
        self.slots.find(hash, |s| key.matches(&s.key))
    }

    fn find_mut(&mut self, hash: u64, key: StoredKey<'_>) -> Option<&mut Slot> {
        self.slots.find_mut(hash, |s| key.matches(&s.key))
    }

    /// The key's slot, made empty if it had none.
    fn slot_mut(&mut self, hash: u64, key: StoredKey<'_>) -> &mut Slot {
        self.slots
            .entry(hash, |s| key.matches(&s.key), |s| s.hash)
            .or_insert_with(|| Slot {
                key: key.to_vec(),
                hash,
                pending: None,
                entry: None,
            })
            .into_mut()
    }

    /// Drops the key's slot once it is neither pending nor cached.
    fn drop_if_empty(&mut self, hash: u64, key: StoredKey<'_>) {
        if let Ok(slot) = self.slots.find_entry(hash, |s| key.matches(&s.key))
            && slot.get().pending.is_none()
            && slot.get().entry.is_none()
        {
            slot.remove();
        }
    }

    fn pending_above(&mut self, hash: u64, key: StoredKey<'_>, synced: u64) -> Option<u64> {
        let slot = self.find_mut(hash, key)?;
        match slot.pending {
            Some(seq) if seq > synced => Some(seq),
            Some(_) => {
                slot.pending = None;
                self.drop_if_empty(hash, key);
                None
            }
            None => None,
        }
    }

    fn remove_entry(&mut self, hash: u64, key: StoredKey<'_>) {
        if let Some(e) = self.find_mut(hash, key).and_then(|s| s.entry.take()) {
            self.bytes -= e.size;
            self.entries -= 1;
            self.drop_if_empty(hash, key);
        }
    }

    fn insert(&mut self, hash: u64, key: StoredKey<'_>, rec: &Arc<Record>, budget: usize) {
        let size = entry_size(1 + key.rest.len(), rec);
        if size > budget {
            return;
        }
        self.remove_entry(hash, key);
        while self.bytes + size > budget {
            let Some((old_hash, old, id)) = self.order.pop_front() else {
                break;
            };
            let old = StoredKey::bytes(&old);
            if self
                .find(old_hash, old)
                .and_then(|s| s.entry.as_ref())
                .is_some_and(|e| e.id == id)
            {
                self.remove_entry(old_hash, old);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let slot = self.slot_mut(hash, key);
        slot.entry = Some(Entry {
            record: Arc::clone(rec),
            size,
            id,
        });
        let stored = slot.key.clone();
        self.entries += 1;
        self.bytes += size;
        self.order.push_back((hash, stored, id));
        // Invalidations leave stale order entries; keep them bounded.
        if self.order.len() > 2 * self.entries + 64 {
            let slots = &self.slots;
            self.order.retain(|(h, k, id)| {
                let k = StoredKey::bytes(k);
                slots
                    .find(*h, |s| k.matches(&s.key))
                    .and_then(|s| s.entry.as_ref())
                    .is_some_and(|e| e.id == *id)
            });
        }
    }
}

/// Roughly what an entry costs in memory (in bytes).
fn entry_size(key_len: usize, rec: &Record) -> usize {
    2 * key_len
        + rec.fingerprint.as_bytes().len()
        + rec.output.as_ref().map_or(0, Vec::len)
        + rec.recovery_point.as_ref().map_or(0, Vec::len)
        + rec.business_key.as_ref().map_or(0, String::len)
        + 200
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{Fingerprint, Key};

    fn rec(state: State, expires_ms: u64) -> Arc<Record> {
        Arc::new(Record {
            key: Key::new("s", "k").unwrap(),
            state,
            token: 1,
            fingerprint: Fingerprint::of(b"p"),
            created_ms: 0,
            updated_ms: 0,
            lease_until_ms: 0,
            expires_ms,
            output: Some(vec![1; 100]),
            recovery_point: None,
            business_key: None,
            acquisitions: 1,
        })
    }

    fn miss(l: Lookup) -> u64 {
        match l {
            Lookup::Miss(v) => v,
            _ => panic!("expected a miss"),
        }
    }

    #[test]
    fn caches_only_finished_unexpired_records() {
        let c = ReadCache::new(1 << 20);
        let v = miss(c.lookup(StoredKey::bytes(b"a"), 10, 0));
        assert!(
            c.after_read(
                StoredKey::bytes(b"a"),
                Some(&rec(State::Processing, 100)),
                v,
                10,
                0
            )
            .is_none()
        );
        let v = miss(c.lookup(StoredKey::bytes(b"a"), 10, 0));
        c.after_read(
            StoredKey::bytes(b"a"),
            Some(&rec(State::Failed { retryable: true }, 100)),
            v,
            10,
            0,
        );
        let v = miss(c.lookup(StoredKey::bytes(b"a"), 10, 0));
        c.after_read(
            StoredKey::bytes(b"a"),
            Some(&rec(State::Succeeded, 100)),
            v,
            10,
            0,
        );
        assert!(matches!(
            c.lookup(StoredKey::bytes(b"a"), 99, 0),
            Lookup::Hit(_)
        ));
        // Expired: no longer served.
        miss(c.lookup(StoredKey::bytes(b"a"), 100, 0));
    }

    #[test]
    fn a_write_drops_the_entry_and_blocks_a_racing_insert() {
        let c = ReadCache::new(1 << 20);
        let v = miss(c.lookup(StoredKey::bytes(b"a"), 10, 0));
        c.after_read(
            StoredKey::bytes(b"a"),
            Some(&rec(State::Succeeded, 100)),
            v,
            10,
            0,
        );
        let v = miss(c.lookup(StoredKey::bytes(b"b"), 10, 0));
        c.begin_write(&[b"a".to_vec()], Some(5));
        assert!(matches!(
            c.lookup(StoredKey::bytes(b"a"), 10, 4),
            Lookup::Pending(5)
        ));
        // Durable now: not pending, and not cached any more.
        miss(c.lookup(StoredKey::bytes(b"a"), 10, 5));
        // A reader that looked up before a write to the same key does not
        // insert what it read.
        c.begin_write(&[b"b".to_vec()], None);
        c.after_read(
            StoredKey::bytes(b"b"),
            Some(&rec(State::Succeeded, 100)),
            v,
            10,
            5,
        );
        miss(c.lookup(StoredKey::bytes(b"b"), 10, 5));
    }

    #[test]
    fn gate_after_read() {
        let c = ReadCache::new(0);
        let v = miss(c.lookup(StoredKey::bytes(b"a"), 10, 0));
        c.begin_write(&[b"a".to_vec()], Some(3));
        assert_eq!(
            c.after_read(StoredKey::bytes(b"a"), None, v, 10, 2),
            Some(3)
        );
        c.end_write(&[b"a".to_vec()], 3);
        assert_eq!(c.after_read(StoredKey::bytes(b"a"), None, v, 10, 2), None);
    }

    #[test]
    fn a_key_and_its_stored_bytes_are_one_entry() {
        let c = ReadCache::new(1 << 20);
        let key = Key::new("scope", "id-1").unwrap();
        let bytes = key.to_bytes();
        // A write marked through the stored bytes gates a lookup by key.
        c.begin_write(std::slice::from_ref(&bytes), Some(2));
        assert!(matches!(
            c.lookup(StoredKey::of(&key), 10, 1),
            Lookup::Pending(2)
        ));
        c.end_write(std::slice::from_ref(&bytes), 2);
        let v = miss(c.lookup(StoredKey::of(&key), 10, 2));
        c.after_read(
            StoredKey::of(&key),
            Some(&rec(State::Succeeded, 100)),
            v,
            10,
            2,
        );
        assert!(matches!(
            c.lookup(StoredKey::bytes(&bytes), 10, 2),
            Lookup::Hit(_)
        ));
        // Another split of the same text is another key.
        let other = Key::new("scop", "eid-1").unwrap();
        miss(c.lookup(StoredKey::of(&other), 10, 2));
        // A write drops the entry; once durable, no slot is left behind.
        c.begin_write(std::slice::from_ref(&bytes), Some(3));
        c.end_write(std::slice::from_ref(&bytes), 3);
        let slots: usize = c.shards.iter().map(|s| s.lock().slots.len()).sum();
        assert_eq!(slots, 0);
    }

    #[test]
    fn stays_within_budget() {
        let c = ReadCache::new(SHARDS * 1000);
        for i in 0..10_000u32 {
            let k = i.to_le_bytes();
            let v = miss(c.lookup(StoredKey::bytes(&k), 10, 0));
            c.after_read(
                StoredKey::bytes(&k),
                Some(&rec(State::Succeeded, 100)),
                v,
                10,
                0,
            );
        }
        for s in c.shards.iter() {
            let s = s.lock();
            assert!(s.bytes <= 1000);
            assert!(s.order.len() <= 2 * s.entries + 65);
        }
    }
}
