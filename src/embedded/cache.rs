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

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use parking_lot::Mutex;

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

/// The bounded cache of finished records and the durability gate.
pub(crate) struct ReadCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    shard_budget: usize,
}

#[derive(Default)]
struct Shard {
    /// Record key → sequence number of its latest undurable change.
    pending: HashMap<Vec<u8>, u64>,
    entries: HashMap<Vec<u8>, Entry>,
    /// Insertion order for eviction: (key, entry id); stale ids are skipped.
    order: VecDeque<(Vec<u8>, u64)>,
    bytes: usize,
    /// Bumped by every write to a key of this shard.
    version: u64,
    next_id: u64,
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

    fn shard(&self, key: &[u8]) -> &Mutex<Shard> {
        let h = self.hasher.hash_one(key);
        &self.shards[(h as usize) % SHARDS]
    }

    /// Looks `key` up before a read of the index. `synced` is the visible
    /// sequence number.
    pub(crate) fn lookup(&self, key: &[u8], now_ms: u64, synced: u64) -> Lookup {
        let mut shard = self.shard(key).lock();
        if let Some(seq) = shard.pending_above(key, synced) {
            return Lookup::Pending(seq);
        }
        match shard.entries.get(key) {
            Some(e) if !e.record.is_expired_at(now_ms) => {
                return Lookup::Hit(Arc::clone(&e.record));
            }
            Some(_) => shard.remove(key),
            None => {}
        }
        Lookup::Miss(shard.version)
    }

    /// Checks the gate after a read of the index, and caches a finished
    /// record. Returns the pending sequence number when what was read may
    /// not be durable yet.
    pub(crate) fn after_read(
        &self,
        key: &[u8],
        record: Option<&Arc<Record>>,
        version: u64,
        now_ms: u64,
        synced: u64,
    ) -> Option<u64> {
        let mut shard = self.shard(key).lock();
        if let Some(seq) = shard.pending_above(key, synced) {
            return Some(seq);
        }
        if let Some(rec) = record {
            let finished = matches!(
                rec.state,
                State::Succeeded | State::Failed { retryable: false }
            );
            if finished && shard.version == version && !rec.is_expired_at(now_ms) {
                shard.insert(key, rec, self.shard_budget);
            }
        }
        None
    }

    /// Called by the writer before it applies a batch to the index: drops
    /// the cached entries of `keys` and, with `Some(seq)`, marks them pending
    /// until `seq` is visible.
    pub(crate) fn begin_write(&self, keys: &[Vec<u8>], seq: Option<u64>) {
        for key in keys {
            let mut shard = self.shard(key).lock();
            shard.version += 1;
            shard.remove(key);
            if let Some(seq) = seq {
                shard.pending.insert(key.clone(), seq);
            }
        }
    }

    /// Called once everything up to `seq` is visible: forgets those pending
    /// marks (a later batch's mark on the same key stays).
    pub(crate) fn end_write(&self, keys: &[Vec<u8>], seq: u64) {
        for key in keys {
            let mut shard = self.shard(key).lock();
            if shard.pending.get(key).is_some_and(|&s| s <= seq) {
                shard.pending.remove(key);
            }
        }
    }
}

impl Shard {
    fn pending_above(&mut self, key: &[u8], synced: u64) -> Option<u64> {
        match self.pending.get(key) {
            Some(&seq) if seq > synced => Some(seq),
            Some(_) => {
                self.pending.remove(key);
                None
            }
            None => None,
        }
    }

    fn remove(&mut self, key: &[u8]) {
        if let Some(e) = self.entries.remove(key) {
            self.bytes -= e.size;
        }
    }

    fn insert(&mut self, key: &[u8], rec: &Arc<Record>, budget: usize) {
        let size = entry_size(key, rec);
        if size > budget {
            return;
        }
        self.remove(key);
        while self.bytes + size > budget {
            let Some((old, id)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&old).is_some_and(|e| e.id == id) {
                self.remove(&old);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(
            key.to_vec(),
            Entry {
                record: Arc::clone(rec),
                size,
                id,
            },
        );
        self.bytes += size;
        self.order.push_back((key.to_vec(), id));
        // Invalidations leave stale order entries; keep them bounded.
        if self.order.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.order
                .retain(|(k, id)| entries.get(k).is_some_and(|e| e.id == *id));
        }
    }
}

/// Roughly what an entry costs in memory (in bytes).
fn entry_size(key: &[u8], rec: &Record) -> usize {
    2 * key.len()
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
        let v = miss(c.lookup(b"a", 10, 0));
        assert!(
            c.after_read(b"a", Some(&rec(State::Processing, 100)), v, 10, 0)
                .is_none()
        );
        let v = miss(c.lookup(b"a", 10, 0));
        c.after_read(
            b"a",
            Some(&rec(State::Failed { retryable: true }, 100)),
            v,
            10,
            0,
        );
        let v = miss(c.lookup(b"a", 10, 0));
        c.after_read(b"a", Some(&rec(State::Succeeded, 100)), v, 10, 0);
        assert!(matches!(c.lookup(b"a", 99, 0), Lookup::Hit(_)));
        // Expired: no longer served.
        miss(c.lookup(b"a", 100, 0));
    }

    #[test]
    fn a_write_drops_the_entry_and_blocks_a_racing_insert() {
        let c = ReadCache::new(1 << 20);
        let v = miss(c.lookup(b"a", 10, 0));
        c.after_read(b"a", Some(&rec(State::Succeeded, 100)), v, 10, 0);
        let v = miss(c.lookup(b"b", 10, 0));
        c.begin_write(&[b"a".to_vec()], Some(5));
        assert!(matches!(c.lookup(b"a", 10, 4), Lookup::Pending(5)));
        // Durable now: not pending, and not cached any more.
        miss(c.lookup(b"a", 10, 5));
        // A reader that looked up before a write to the same key does not
        // insert what it read.
        c.begin_write(&[b"b".to_vec()], None);
        c.after_read(b"b", Some(&rec(State::Succeeded, 100)), v, 10, 5);
        miss(c.lookup(b"b", 10, 5));
    }

    #[test]
    fn gate_after_read() {
        let c = ReadCache::new(0);
        let v = miss(c.lookup(b"a", 10, 0));
        c.begin_write(&[b"a".to_vec()], Some(3));
        assert_eq!(c.after_read(b"a", None, v, 10, 2), Some(3));
        c.end_write(&[b"a".to_vec()], 3);
        assert_eq!(c.after_read(b"a", None, v, 10, 2), None);
    }

    #[test]
    fn stays_within_budget() {
        let c = ReadCache::new(SHARDS * 1000);
        for i in 0..10_000u32 {
            let k = i.to_le_bytes();
            let v = miss(c.lookup(&k, 10, 0));
            c.after_read(&k, Some(&rec(State::Succeeded, 100)), v, 10, 0);
        }
        for s in c.shards.iter() {
            let s = s.lock();
            assert!(s.bytes <= 1000);
            assert!(s.order.len() <= 2 * s.entries.len() + 65);
        }
    }
}
