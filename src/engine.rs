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
#[cfg(feature = "postgres")]
use std::path::PathBuf;
use std::time::Duration;

use crate::codec::Entries;
use crate::embedded::expiry::Swept;
use crate::embedded::{self, Embedded};
use crate::error::Result;
use crate::key::Key;
#[cfg(feature = "postgres")]
use crate::pg::Postgres;
use crate::record::{ImportResult, Op, Record, Reply, Sent};
use crate::report::Progress;
use crate::report::{CheckReport, ScrubReport};
use crate::stats::{LiveCounters, StateCounts};

/// The storage of one open store.
pub(crate) enum Engine {
    /// One file and its write-ahead log.
    Embedded(Embedded),
    /// A PostgreSQL database shared by every replica; `name` is what
    /// `Store::path` shows for it (see [`crate::pg::store_name`]).
    #[cfg(feature = "postgres")]
    Postgres {
        /// The engine.
        engine: Postgres,
        /// The server and schema, without credentials.
        name: PathBuf,
    },
}

/// A consistent view of every stored record, for the operator's reads.
pub(crate) enum Snapshot<'a> {
    /// A redb read transaction of the embedded engine.
    Embedded(embedded::Snapshot),
    /// The PostgreSQL engine: each scan of it opens a REPEATABLE READ
    /// snapshot of its own; its counts by state are one statement.
    #[cfg(feature = "postgres")]
    Postgres(&'a Postgres),
    /// Holds the lifetime when no engine borrows it.
    #[cfg(not(feature = "postgres"))]
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
}

impl Engine {
    /// The store's time (ms since the epoch) for an answer about to be
    /// given: on the file engine never lower than a time returned before;
    /// on PostgreSQL the database clock as read.
    pub(crate) fn now_ms(&self) -> u64 {
        match self {
            Engine::Embedded(e) => e.time(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => {
                engine.now_ms().unwrap_or_else(|_| engine.last_now_ms())
            }
        }
    }

    /// The time an export is taken at: [`Engine::now_ms`], but on a
    /// read-only file store the time bound found on disk.
    pub(crate) fn export_ms(&self) -> u64 {
        match self {
            Engine::Embedded(e) => e.export_ms(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => self.now_ms(),
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
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.apply(key, op),
        }
    }

    /// [`Engine::apply`] from async code: never blocks its executor.
    pub(crate) async fn apply_async(&self, key: &Key, op: Op) -> Result<Reply> {
        match self {
            Engine::Embedded(e) => e.apply_async(key, op).await,
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.apply_async(key, op).await,
        }
    }

    /// The first half of [`Engine::apply_async`]: the request answered at
    /// once or sent, its answer to come from a future that owns what it
    /// needs. Dropped before it returns, nothing was sent.
    pub(crate) async fn send_async(&self, key: &Key, op: Op) -> Result<Sent> {
        match self {
            Engine::Embedded(e) => e.send_async(key, op).await,
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.send_async(key, op),
        }
    }

    /// Applies `ops` in one write (one commit), each decided on its own and
    /// in order, as if applied alone: a later op of the same key sees the
    /// earlier one. The outer `Err` is a failure of the whole write, which
    /// then applied none of them.
    pub(crate) fn apply_many(&self, ops: Vec<(Key, Op)>) -> Result<Vec<Result<Reply>>> {
        match self {
            Engine::Embedded(e) => e.apply_many(ops, 0),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.apply_many(ops),
        }
    }

    /// [`Engine::apply_many`] that a PostgreSQL store ends by `deadline`
    /// (when before its `call_timeout`), dropping the connection past it: a
    /// lease renewal, which must end while the lease lasts so that a retry
    /// on another connection still can. The file engine has no network to
    /// wait on, and no deadline.
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) fn apply_many_by(
        &self,
        ops: Vec<(Key, Op)>,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
        deadline: std::time::Instant,
    ) -> Result<Vec<Result<Reply>>> {
        match self {
            Engine::Embedded(e) => e.apply_many(ops, 0),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.apply_many_by(ops, deadline),
        }
    }

    /// [`Engine::apply`] under `deadline`, as [`Engine::apply_many_by`].
    #[cfg(feature = "agent")]
    pub(crate) fn apply_by(
        &self,
        key: &Key,
        op: Op,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
        deadline: std::time::Instant,
    ) -> Result<Reply> {
        match self {
            Engine::Embedded(e) => e.apply(key, op),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.apply_by(key, op, deadline),
        }
    }

    /// [`Engine::apply_async`] under `deadline`, as [`Engine::apply_many_by`].
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) async fn apply_async_by(
        &self,
        key: &Key,
        op: Op,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
        deadline: std::time::Instant,
    ) -> Result<Reply> {
        match self {
            Engine::Embedded(e) => e.apply_async(key, op).await,
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => match engine.send_async_by(key, op, deadline)? {
                Sent::Answered(reply) => reply,
                Sent::Pending(answer) => answer.await,
            },
        }
    }

    /// [`Engine::apply_async`], waited for until `deadline` at most: past
    /// it, [`Error::OutcomeUnknown`], the request left to the engine (on
    /// PostgreSQL it may still be applied; its connection is not dropped,
    /// since others' requests may share its transaction). The file engine
    /// has no network to wait on, and is waited for.
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) async fn apply_async_within(
        &self,
        key: &Key,
        op: Op,
        #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
        deadline: std::time::Instant,
    ) -> Result<Reply> {
        match self {
            Engine::Embedded(e) => e.apply_async(key, op).await,
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => {
                let mut answer = std::pin::pin!(engine.apply_async(key, op));
                let wait = deadline.saturating_duration_since(std::time::Instant::now());
                let mut timer = futures_timer::Delay::new(wait);
                std::future::poll_fn(|cx| {
                    if let std::task::Poll::Ready(reply) = answer.as_mut().poll(cx) {
                        return std::task::Poll::Ready(reply);
                    }
                    std::pin::Pin::new(&mut timer).poll(cx).map(|()| {
                        Err(crate::error::Error::OutcomeUnknown {
                            detail: format!(
                                "no answer within {wait:?} (the attempt's deadline): the write \
                                 may still be applied"
                            ),
                        })
                    })
                })
                .await
            }
        }
    }

    /// Queues `op` without waiting for its answer (a best-effort write
    /// whose caller has gone, or a lease given back).
    pub(crate) fn apply_detached(&self, key: &Key, op: Op) {
        match self {
            Engine::Embedded(e) => e.apply_detached(key, op),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.apply_detached(key, op),
        }
    }

    /// The record of `key`, `None` when absent or past retention.
    pub(crate) fn get(&self, key: &Key) -> Result<Option<Record>> {
        match self {
            Engine::Embedded(e) => e.get(key),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.get(key),
        }
    }

    /// [`Engine::get`] from async code.
    pub(crate) async fn get_async(&self, key: &Key) -> Result<Option<Record>> {
        match self {
            Engine::Embedded(e) => e.get_async(key).await,
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.get_async(key).await,
        }
    }

    /// Evicts up to `max` records past retention; how many it removed.
    pub(crate) fn sweep(&self, max: usize) -> Result<usize> {
        match self {
            Engine::Embedded(e) => e.sweep(max),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.sweep(max),
        }
    }

    /// One slice of the background sweeper: up to `max` evictions, on the
    /// file engine also stopped once `budget` of the writer's time is spent
    /// (the writer is shared with every write; PostgreSQL's sweep is a
    /// statement of its own that holds no other request up, and ends at
    /// `max`).
    pub(crate) fn sweep_slice(&self, max: usize, budget: Duration) -> Result<Swept> {
        match self {
            Engine::Embedded(e) => e.sweep_step(max, Some(budget), true),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => {
                let evicted = engine.sweep(max)?;
                // No writer shared with other requests: nothing to pace.
                Ok(Swept {
                    evicted,
                    more: evicted >= max,
                    spent: Duration::ZERO,
                })
            }
        }
    }

    /// How many records awaiting eviction had their retention end in
    /// `(from_ms, to_ms]` (store time), counting at most `limit`, in the
    /// file engine's expiry index (one entry read per record counted):
    /// what came due beside a sweep, for its pacing. `None` on PostgreSQL,
    /// whose sweeps share no writer.
    pub(crate) fn came_due(&self, from_ms: u64, to_ms: u64, limit: u64) -> Result<Option<u64>> {
        match self {
            Engine::Embedded(e) => e.came_due(from_ms, to_ms, limit).map(Some),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => Ok(None),
        }
    }

    /// Whether a record awaiting eviction is due now, by the file engine's
    /// expiry index as last committed (at most one entry read per range:
    /// finished records, claims in flight): what makes its background
    /// sweeper sweep before the end of its interval. `None` on PostgreSQL,
    /// whose sweeps share no writer and run every interval.
    pub(crate) fn any_due(&self) -> Result<Option<bool>> {
        match self {
            // The clock without a reservation: reserving time writes and
            // syncs a log frame once a reservation runs out, which on an
            // idle store would be every tick. The sweep itself decides at
            // the writer's time.
            Engine::Embedded(e) => e.came_due(0, e.clock_ms(), 1).map(|n| Some(n > 0)),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => Ok(None),
        }
    }

    /// The file engine's log fsync time of the last closed quarter second and its
    /// lowest quarter-second mean of the last minute, as `(current, base)`:
    /// how congested the disk under the log is, for a sweep's pacing (see
    /// `embedded::congestion`). `None` when too few writes waited on the
    /// log in the last three quarter seconds to say, and on PostgreSQL, whose sweeps share no writer.
    pub(crate) fn log_latency(&self) -> Option<(Duration, Duration)> {
        match self {
            Engine::Embedded(e) => e.log_latency(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => None,
        }
    }

    /// A snapshot holding every acknowledged change (durable ones only,
    /// where durability is awaited).
    pub(crate) fn snapshot(&self) -> Result<Snapshot<'_>> {
        match self {
            Engine::Embedded(e) => e.snapshot().map(Snapshot::Embedded),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => Ok(Snapshot::Postgres(engine)),
        }
    }

    /// The store's time and the wall clock (ms since the epoch) at the
    /// start of an import, which the stream's times are judged against.
    ///
    /// # Errors
    /// On PostgreSQL, those of reading the database clock
    /// ([`Error::Unavailable`](crate::Error) when it cannot be reached):
    /// an import is not judged against a time this process saw earlier.
    pub(crate) fn import_clock(&self) -> Result<(u64, u64)> {
        match self {
            Engine::Embedded(e) => Ok((e.clock_ms(), e.wall_ms())),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => {
                // The database clock is both: the store's time, and the
                // wall clock the stream's times are judged against.
                let now = engine.now_ms()?;
                Ok((now, now))
            }
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
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => {
                // The store's time is the database's: an import cannot
                // raise it; no write sets a time below a record's own.
                let _ = clock_floor;
                import_results(engine.import(ops, token_floor)?)
            }
        }
    }

    /// The token counter: every token handed out so far is below it.
    pub(crate) fn next_token(&self) -> Result<u64> {
        match self {
            Engine::Embedded(e) => e.next_token(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.next_token(),
        }
    }

    /// Verifies every stored record (and what the engine keeps beside it).
    pub(crate) fn verify(&self, progress: impl FnMut(Progress)) -> Result<CheckReport> {
        match self {
            Engine::Embedded(e) => e.verify(progress),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.verify(progress),
        }
    }

    /// One step of the embedded engine's online scrub over up to `max`
    /// records, after committing the writer's open transaction when
    /// `commit`; `None` on an engine that checks its own pages
    /// (PostgreSQL), and for the background scrub (`commit` false) on a
    /// store that already refuses writes.
    pub(crate) fn scrub(&self, max: usize, commit: bool) -> Option<Result<ScrubReport>> {
        match self {
            Engine::Embedded(e) if !commit && e.refuses_writes() => None,
            Engine::Embedded(e) => Some(e.scrub(max, commit)),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => None,
        }
    }

    /// The damage marker that keeps the store read-only (the embedded
    /// engine, when its scrub found the index damaged in this process or
    /// before this open); `None` otherwise.
    pub(crate) fn damage_marker(&self) -> Option<&Path> {
        match self {
            Engine::Embedded(e) => e.damage_marker(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => None,
        }
    }

    /// Whether opening this store created it (see [`crate::Store::was_created`]).
    pub(crate) fn was_created(&self) -> bool {
        match self {
            Engine::Embedded(e) => e.was_created(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.found() == crate::pg::Found::Created,
        }
    }

    /// Whether the store refuses writes (the embedded engine after a failed
    /// durable write or damage found by its scrub): the background sweep
    /// then stops.
    pub(crate) fn refuses_writes(&self) -> bool {
        match self {
            Engine::Embedded(e) => e.refuses_writes(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => false,
        }
    }

    /// How many records are stored, past retention or not.
    pub(crate) fn len(&self) -> Result<u64> {
        match self {
            Engine::Embedded(e) => e.len(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.len(),
        }
    }

    /// The counters behind `Store::stats`.
    pub(crate) fn counters(&self) -> &LiveCounters {
        match self {
            Engine::Embedded(e) => e.counters(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { engine, .. } => engine.counters(),
        }
    }

    /// The size of the store's storage in bytes, when the engine knows it.
    pub(crate) fn file_bytes(&self) -> Option<u64> {
        match self {
            Engine::Embedded(e) => e.file_bytes(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => None,
        }
    }

    /// The store file, for the engines that have one.
    pub(crate) fn path(&self) -> &Path {
        match self {
            Engine::Embedded(e) => e.path(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { name, .. } => name,
        }
    }

    /// The write-ahead log, for the engines that have one.
    pub(crate) fn log_path(&self) -> &Path {
        match self {
            Engine::Embedded(e) => e.log_path(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => Path::new(""),
        }
    }

    /// Makes every acknowledged change durable now.
    pub(crate) fn flush(&self) -> Result<()> {
        match self {
            Engine::Embedded(e) => e.flush(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => Ok(()),
        }
    }

    /// Moves the write-ahead log's changes into the index.
    pub(crate) fn checkpoint(&self) -> Result<()> {
        match self {
            Engine::Embedded(e) => e.checkpoint(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => Ok(()),
        }
    }
}

impl Snapshot<'_> {
    /// The store's identity and token counter as of the snapshot (on
    /// PostgreSQL, read when this is called: call it after
    /// [`Snapshot::entries`], so that the counter is above every token of
    /// the entries).
    pub(crate) fn meta(&self) -> Result<(u128, u64)> {
        match self {
            Snapshot::Embedded(s) => s.meta(),
            #[cfg(feature = "postgres")]
            Snapshot::Postgres(pg) => Ok((pg.store_id(), pg.next_token()?)),
            #[cfg(not(feature = "postgres"))]
            Snapshot::Never(never, _) => match *never {},
        }
    }

    /// The store's time and the records by state at it, with the oldest
    /// live Processing record's `created_ms`: on the file engine at
    /// `now()`, from its state counts and the expiry index's range of
    /// records in flight (work that grows with the records in flight and
    /// those due for eviction); on PostgreSQL the database's time and one
    /// aggregate statement over the rows' columns, in one call under one
    /// deadline (the server reads every row; no record is sent or
    /// decoded).
    pub(crate) fn counts_now(
        &self,
        now: impl FnOnce() -> u64,
    ) -> Result<(u64, StateCounts, Option<u64>)> {
        match self {
            Snapshot::Embedded(s) => {
                let now = now();
                let (counts, oldest) = s.state_counts(now)?;
                Ok((now, counts, oldest))
            }
            #[cfg(feature = "postgres")]
            Snapshot::Postgres(pg) => pg.counts_now(),
            #[cfg(not(feature = "postgres"))]
            Snapshot::Never(never, _) => match *never {},
        }
    }

    /// The stored entries whose key bytes fall in one of `ranges` (start
    /// inclusive, end exclusive, `None` unbounded), in key order.
    pub(crate) fn entries(&self, ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Result<Entries> {
        match self {
            Snapshot::Embedded(s) => s.entries(ranges),
            #[cfg(feature = "postgres")]
            Snapshot::Postgres(pg) => pg.entries(ranges),
            #[cfg(not(feature = "postgres"))]
            Snapshot::Never(never, _) => match *never {},
        }
    }
}

/// The import results of an engine's replies.
#[cfg(feature = "postgres")]
fn import_results(replies: Vec<Result<Reply>>) -> Result<Vec<Result<ImportResult>>> {
    Ok(replies
        .into_iter()
        .map(|r| match r? {
            Reply::Imported(result) => Ok(result),
            _ => Err(crate::error::Error::Storage(
                "the engine answered an import with another reply".into(),
            )),
        })
        .collect())
}

/// Every key: one range from the first key on.
pub(crate) fn all_keys() -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    vec![(Vec::new(), None)]
}
