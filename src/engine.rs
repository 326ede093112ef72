//! The engine boundary: what [`Store`](crate::Store) asks of the storage
//! underneath it. Everything above (validation, the public API, scans,
//! stats, export and import framing) is written once; each engine below
//! stores records and decides each change with the pure transition
//! function ([`crate::record::transition`]).
//!
//! The boundary is an enum, not a trait object, so that its async methods
//! need no boxing and the set of engines is closed: the embedded engine
//! (one file and its write-ahead log, [`crate::embedded`]) and, with the
//! cargo feature `postgres`, the PostgreSQL engine.
//!
//! Every method takes requests that the layer above has validated
//! (sizes, lease bounds, business keys); the engine checks what only it
//! can see (the stored record, the token counter, its storage).

use std::path::Path;

use crate::codec::Entries;
use crate::embedded::{self, Embedded};
use crate::error::Result;
use crate::key::Key;
use crate::record::{ImportResult, Op, Record, Reply};
use crate::report::CheckReport;
use crate::report::Progress;
use crate::stats::LiveCounters;

/// The storage of one open store.
pub(crate) enum Engine {
    /// One file and its write-ahead log.
    Embedded(Embedded),
}

/// A consistent view of every stored record, for the operator's reads.
pub(crate) enum Snapshot {
    /// A redb read transaction of the embedded engine.
    Embedded(embedded::Snapshot),
}

impl Engine {
    /// The store's time (ms since the epoch) for an answer about to be
    /// given: never lower than a time returned before.
    pub(crate) fn now_ms(&self) -> u64 {
        match self {
            Engine::Embedded(e) => e.time(),
        }
    }

    /// Applies `op` to the record of `key` and answers as the transition
    /// does; a change is durable (as configured) when this returns.
    ///
    /// # Errors
    /// What the transition refuses (stale lease, fingerprint mismatch,
    /// business-key conflict), [`Error::TokensExhausted`](crate::Error),
    /// and the engine's storage errors.
    pub(crate) fn apply(&self, key: &Key, op: Op) -> Result<Reply> {
        match self {
            Engine::Embedded(e) => e.apply(key, op),
        }
    }

    /// [`Engine::apply`] from async code: never blocks its executor.
    pub(crate) async fn apply_async(&self, key: &Key, op: Op) -> Result<Reply> {
        match self {
            Engine::Embedded(e) => e.apply_async(key, op).await,
        }
    }

    /// Applies `ops` in one write (one commit), each decided on its own and
    /// in order, as if applied alone: a later op of the same key sees the
    /// earlier one. The outer `Err` is a failure of the whole write, which
    /// then applied none of them.
    pub(crate) fn apply_many(&self, ops: Vec<(Key, Op)>) -> Result<Vec<Result<Reply>>> {
        match self {
            Engine::Embedded(e) => e.apply_many(ops, 0),
        }
    }

    /// Queues `op` without waiting for its answer (a best-effort write
    /// whose caller has gone).
    pub(crate) fn apply_detached(&self, key: &Key, op: Op) {
        match self {
            Engine::Embedded(e) => e.apply_detached(key, op),
        }
    }

    /// The record of `key`, `None` when absent or past retention.
    pub(crate) fn get(&self, key: &Key) -> Result<Option<Record>> {
        match self {
            Engine::Embedded(e) => e.get(key),
        }
    }

    /// [`Engine::get`] from async code.
    pub(crate) async fn get_async(&self, key: &Key) -> Result<Option<Record>> {
        match self {
            Engine::Embedded(e) => e.get_async(key).await,
        }
    }

    /// Evicts up to `max` records past retention; how many it removed.
    pub(crate) fn sweep(&self, max: usize) -> Result<usize> {
        match self {
            Engine::Embedded(e) => e.sweep(max),
        }
    }

    /// A snapshot holding every acknowledged change (durable ones only,
    /// where durability is awaited).
    pub(crate) fn snapshot(&self) -> Result<Snapshot> {
        match self {
            Engine::Embedded(e) => e.snapshot().map(Snapshot::Embedded),
        }
    }

    /// The store's time and the wall clock (ms since the epoch) at the
    /// start of an import, which the stream's times are judged against.
    pub(crate) fn import_clock(&self) -> (u64, u64) {
        match self {
            Engine::Embedded(e) => (e.clock_ms(), e.wall_ms()),
        }
    }

    /// Writes one batch of imported records atomically, raising the token
    /// counter to at least `token_floor` and the store's clock to at least
    /// `clock_floor`.
    pub(crate) fn import_batch(
        &self,
        ops: Vec<(Key, Op)>,
        token_floor: u64,
        clock_floor: u64,
    ) -> Result<Vec<Result<ImportResult>>> {
        match self {
            Engine::Embedded(e) => e.import_batch(ops, token_floor, clock_floor),
        }
    }

    /// The token counter: every token handed out so far is below it.
    pub(crate) fn next_token(&self) -> Result<u64> {
        match self {
            Engine::Embedded(e) => e.next_token(),
        }
    }

    /// Verifies every stored record (and what the engine keeps beside it).
    pub(crate) fn verify(&self, progress: impl FnMut(Progress)) -> Result<CheckReport> {
        match self {
            Engine::Embedded(e) => e.verify(progress),
        }
    }

    /// How many records are stored, past retention or not.
    pub(crate) fn len(&self) -> Result<u64> {
        match self {
            Engine::Embedded(e) => e.len(),
        }
    }

    /// The counters behind `Store::stats`.
    pub(crate) fn counters(&self) -> &LiveCounters {
        match self {
            Engine::Embedded(e) => e.counters(),
        }
    }

    /// The size of the store's storage in bytes, when the engine knows it.
    pub(crate) fn file_bytes(&self) -> Option<u64> {
        match self {
            Engine::Embedded(e) => e.file_bytes(),
        }
    }

    /// The store file, for the engines that have one.
    pub(crate) fn path(&self) -> &Path {
        match self {
            Engine::Embedded(e) => e.path(),
        }
    }

    /// The write-ahead log, for the engines that have one.
    pub(crate) fn log_path(&self) -> &Path {
        match self {
            Engine::Embedded(e) => e.log_path(),
        }
    }

    /// Makes every acknowledged change durable now.
    pub(crate) fn flush(&self) -> Result<()> {
        match self {
            Engine::Embedded(e) => e.flush(),
        }
    }

    /// Moves the write-ahead log's changes into the index.
    pub(crate) fn checkpoint(&self) -> Result<()> {
        match self {
            Engine::Embedded(e) => e.checkpoint(),
        }
    }
}

impl Snapshot {
    /// The store's identity and token counter as of the snapshot.
    pub(crate) fn meta(&self) -> Result<(u128, u64)> {
        match self {
            Snapshot::Embedded(s) => s.meta(),
        }
    }

    /// The stored entries whose key bytes fall in one of `ranges` (start
    /// inclusive, end exclusive, `None` unbounded), in key order.
    pub(crate) fn entries(&self, ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Result<Entries> {
        match self {
            Snapshot::Embedded(s) => s.entries(ranges),
        }
    }
}
