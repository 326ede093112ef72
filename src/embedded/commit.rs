//! The group-commit writer, over the write-ahead log.
//!
//! One thread owns every state change. Callers queue a request on a bounded
//! channel (a full queue makes them wait: backpressure) and receive a
//! one-shot completion that they block on or `.await`. The writer takes
//! everything waiting and decides it in arrival order inside its open redb
//! write transaction (a later request sees the earlier ones), then seals the
//! batch: its effects become one frame of the write-ahead log. A second
//! thread, the syncer, makes the log durable with `fdatasync`, and only then
//! are the batch's callers woken (in `Immediate` mode; a third thread does
//! the waking when there are many; the one exception is a paced sweep
//! slice, answered once decided: see [`Command::Sweep`]). One fsync covers
//! every frame written
//! before it started. While an fsync runs, the writer keeps deciding the
//! requests that arrive into the next batch and seals it when the syncer
//! reports the disk free; a lone caller is never held back (nothing waits
//! for a batch to fill when the disk is idle).
//!
//! A caller that finds the writer idle (nothing queued, no fsync running,
//! the writer's state free, the last batch a batch of one) does not hand
//! its request over: it decides,
//! seals and syncs its own batch on its own thread, as LevelDB's writer
//! queue lets the first waiting writer commit the group itself
//! (`DBImpl::Write`). A lone caller so pays no thread hop at all; under load
//! the queue is never empty and requests go to the writer thread, which
//! batches them.
//!
//! The open transaction is committed to the index with `Durability::None`
//! when the writer is idle, every [`COMMIT_EVERY`] batches, when a reader
//! asks ([`Command::Commit`]) and at checkpoints; the log, not redb, makes
//! changes durable. Reads outside the writer (`get`, a claim that can only
//! replay) read the index; the gate in [`super::cache`] keeps them from
//! returning a change that is not yet committed there and, in `Immediate`
//! mode, durable.
//!
//! In `Buffered` mode callers are woken as soon as their batch is sealed,
//! and the syncer syncs the log within the configured delay.
//!
//! When the log is full, or on request, the writer commits the open
//! transaction to redb durably instead (a checkpoint: the index then holds
//! everything up to that batch on disk, with quick-repair so that reopening
//! after a crash is fast) and starts the log over from its beginning, in a
//! new epoch. Dropping the store drains the queue and ends with such a
//! checkpoint.
//!
//! A failed log write, fsync or index commit fails every request of the
//! batches it concerns with the storage error (none is reported as done,
//! but for a paced sweep slice already answered) and poisons the store: no later write is attempted until reopen, which
//! recovers from what is on disk (DESIGN.md guarantee 6). If the writer or
//! the syncer thread dies, every waiting and later call gets
//! [`Error::Closed`]; nothing hangs.
//!
//! Every change to the index goes through [`Tables`], which logs it: a new
//! kind of write (a table, an operation) must be added there, or it would be
//! lost in a crash.

use std::collections::VecDeque;
use std::future::{Future, IntoFuture};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{
    Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError, sync_channel,
};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::expiry::Swept;

use parking_lot::{Condvar, Mutex, MutexGuard};
use redb::{Database, WriteTransaction};

use super::cache::ReadCache;
use super::congestion::LogLatency;
use super::expiry;
use super::fence::Fence;
use super::pending::Pending;
use super::schema::{self, Checkpoint, Tables, Tally, guard, map_err};
use super::wal::{self, BodyWriter, FRAME_HEADER_LEN, LogFile, LogWriter};
use crate::audit::Event;
use crate::clock::StoreClock;
use crate::codec;
use crate::config::{Durability, MAX_TOKEN};
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::{ClaimOutcome, Ctx, Effect, Op, Record, Reply, taken_from, transition};
use crate::stats::LiveCounters;

/// A batch renews the time reservation when its time comes this close to
/// the reserved bound (half of [`crate::clock::TIME_RESERVATION`], in ms).
pub(crate) const RENEW_AHEAD_MS: u64 = 500;

/// The most requests decided in one batch.
const MAX_BATCH: usize = 1024;
/// A batch stops taking requests once their payloads add up to this many
/// bytes, so that one frame stays a small part of the log.
const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;
/// The most requests waiting for the writer before callers block.
pub(crate) const QUEUE_BOUND: usize = 4096;

/// A state change for the writer.
pub(crate) enum Command {
    /// A transition of one key.
    Op { key: Key, op: Op },
    /// Evict up to `max` expired records, stopping once `budget` of the
    /// writer's time is spent (a slice of the background sweeper). With
    /// `early`, answered as soon as it is decided, before its batch is
    /// durable: a paced sweep times its next slice from this one's writer
    /// time, not from the fsync of the writes beside it (a slice the log
    /// then fails to write evicted nothing, and the store is poisoned).
    /// With `early`, the answer's `spent` also carries what earlier such
    /// slices' evictions cost the writer's commits since
    /// ([`evictions_share`]).
    Sweep {
        max: usize,
        budget: Option<std::time::Duration>,
        early: bool,
    },
    /// Several transitions in one write, each decided on its own and in
    /// order (a later one of the same key sees the earlier one), after the
    /// token counter is raised to at least `token_floor` (an import's
    /// floor; 0 otherwise): `Store::claim_many`, an import batch, a batch
    /// of lease extensions.
    Many {
        ops: Vec<(Key, Op)>,
        token_floor: u64,
    },
    /// Commit the index durably and start the log over.
    Checkpoint,
    /// Commit the writer's open index transaction (non-durably), so that
    /// reads outside the writer see what was acknowledged.
    Commit,
    /// Make the store's time durable up to at least the writer's reading
    /// (a reservation, see [`crate::clock`]): for a read about to answer at
    /// a time beyond [`Shared::time_durable`].
    Reserve,
}

/// The writer's answer to one command.
pub(crate) enum Answer {
    Reply(Reply),
    Evicted(Swept),
    Checkpointed,
    Committed,
    /// The store's time is durable up to at least the time the request was
    /// decided at.
    Reserved,
    /// One reply per transition of a [`Command::Many`], in order.
    Many(Vec<Result<Reply>>),
}

struct Request {
    cmd: Command,
    reply: oneshot::Sender<Result<Answer>>,
}

/// What the writer's queue carries.
enum Msg {
    /// A caller's request.
    Req(Request),
    /// From the syncer: an fsync ended (or the syncer stopped); a batch held
    /// open while the disk was busy can be sealed.
    Nudge,
    /// From the store's drop: finish what is queued, checkpoint, stop.
    Close,
}

/// A pending answer: block on it with [`Completion::wait`] or `.await` it.
pub(crate) enum Completion {
    Ready(Result<Answer>),
    Pending(oneshot::Receiver<Result<Answer>>),
}

impl Completion {
    /// Blocks the calling thread until the writer answers.
    pub(crate) fn wait(self) -> Result<Answer> {
        match self {
            Completion::Ready(r) => r,
            Completion::Pending(rx) => rx.recv().unwrap_or(Err(Error::Closed)),
        }
    }
}

/// The future of a [`Completion`]: no runtime needed, woken by the writer.
pub(crate) enum CompletionFuture {
    Ready(Option<Result<Answer>>),
    Pending(oneshot::AsyncReceiver<Result<Answer>>),
}

impl IntoFuture for Completion {
    type Output = Result<Answer>;
    type IntoFuture = CompletionFuture;

    fn into_future(self) -> CompletionFuture {
        match self {
            Completion::Ready(r) => CompletionFuture::Ready(Some(r)),
            Completion::Pending(rx) => CompletionFuture::Pending(rx.into_future()),
        }
    }
}

impl Future for CompletionFuture {
    type Output = Result<Answer>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            CompletionFuture::Ready(r) => Poll::Ready(r.take().unwrap_or(Err(Error::Closed))),
            CompletionFuture::Pending(rx) => match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(r)) => Poll::Ready(r),
                Poll::Ready(Err(_)) => Poll::Ready(Err(Error::Closed)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

/// State shared by the writer, the syncer and the store.
pub(crate) struct Shared {
    pub db: Arc<Database>,
    pub path: PathBuf,
    pub log_path: PathBuf,
    pub clock: StoreClock,
    /// The store's time up to which answers may be given without a new
    /// reservation: the bound carried by a durable frame or checkpoint (in
    /// `Buffered` mode, an acknowledged one).
    pub time_durable: AtomicU64,
    /// On a read-only store (`Config::read_only`), the time bounds its open
    /// found, `(high-water mark, floor)`: written back at checkpoints and
    /// at the close instead of the clock's, and no reservation is made, so
    /// that the open persists no time. `None` on a store that writes.
    pub held_time: Option<(u64, u64)>,
    /// The durable bound an early renewal was last asked for (see
    /// `Inner::renew_early`).
    pub renewing: AtomicU64,
    pub retention_ms: u64,
    pub durability: Durability,
    /// Set after any failed durable write: the store refuses writes.
    pub poisoned: AtomicBool,
    /// Raised when the online scrub found the index damaged (or the store
    /// was opened with its damage marker): the writer refuses every change
    /// (`Poisoned`) and still commits what is acknowledged, renews the
    /// time reservation and takes checkpoints, so that reads keep their
    /// answers.
    pub damaged: AtomicBool,
    /// The damage marker of this store file (absolute): beside the path it
    /// was opened by, or the one the store names when that one is in place
    /// (see `schema::META_DAMAGE_MARKER`); `None` on a custom backend.
    /// Recorded in the store at every checkpoint and close while `damaged`.
    pub damage_marker: Option<PathBuf>,
    /// Set when the failure was the index's (redb latched an error): no
    /// closing checkpoint is attempted.
    pub index_failed: AtomicBool,
    pub progress: Progress,
    pub cache: ReadCache,
    /// Whether the writer may fsync a lone batch itself instead of handing
    /// it to the syncer (always on; the crate's tests turn it off to look
    /// at a batch applied to the index before its fsync ended).
    pub sync_inline: AtomicBool,
    /// Counters behind `Store::stats`, bumped as audit events are published.
    pub counters: LiveCounters,
    /// Raised when the writer stops on a poisoned store, so that redb's
    /// close cannot make a non-durable commit durable (see `fence.rs`).
    pub fence: Fence,
    /// The writer's time (ns) owed by paced sweep slices for what their
    /// evictions cost it outside them (see [`evictions_share`]): added to
    /// the next paced slice's `spent`, which paces the sweep. Changed only
    /// by whoever holds the writer's state. A debt left when a sweep ends
    /// (its last commits' share, a checkpoint's after them) is paid by the
    /// next sweep's first slice.
    pub sweep_debt_ns: AtomicU64,
    /// The log's fsync times of the batches callers waited for, against
    /// their recent best: how congested the disk is, for a sweep's pacing
    /// (see [`super::congestion`]).
    pub log_latency: Mutex<LogLatency>,
    /// Asked at the start of each checkpoint to sync the index file off
    /// the writer (the store's own file on Linux; see `writeback.rs`).
    pub early_sync: Option<schema::EarlySync>,
}

impl Shared {
    /// Notes one group commit that made the writes of `writes` requests
    /// durable in `took` (see [`writes`]), of which its `fdatasync` of the
    /// log took `fsync`, and woke `callers` callers (a commit that woke no
    /// caller is not counted as the disk's).
    fn synced(&self, took: Duration, fsync: Duration, callers: usize, writes: usize) {
        self.counters.group_commit(took, writes);
        if callers > 0 {
            self.log_latency.lock().observe(Instant::now(), fsync);
        }
    }

    /// Adds `owed` to what sweep slices owe the writer.
    fn owe_sweep(&self, owed: Duration) {
        let ns = u64::try_from(owed.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .sweep_debt_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |was| {
                Some(was.saturating_add(ns))
            });
    }

    /// What sweep slices owe the writer, cleared.
    fn take_sweep_debt(&self) -> Duration {
        Duration::from_nanos(self.sweep_debt_ns.swap(0, Ordering::Relaxed))
    }

    /// Marks the store poisoned, for `cause` unless it was poisoned
    /// already (the first cause is the one reported).
    pub(crate) fn poison_for(&self, cause: String) {
        self.progress.cause.lock().get_or_insert(cause);
        self.poisoned.store(true, Ordering::SeqCst);
    }

    /// The error for a write the store refuses ([`Error::Poisoned`]), with
    /// why: the first recorded cause, else the damage the scrub found (or
    /// the marker found at open).
    pub(crate) fn refusal(&self) -> Error {
        if let Some(cause) = self.progress.cause.lock().clone() {
            return Error::Poisoned { cause };
        }
        if self.damaged.load(Ordering::SeqCst) {
            return Error::Poisoned {
                cause: damage_cause(self.damage_marker.as_deref()),
            };
        }
        // Not reached: every path that poisons records its cause first.
        Error::Poisoned {
            cause: "an earlier failure; reopen the store".to_string(),
        }
    }

    /// Records damage found in the index (by the scrub, or its marker at
    /// open) as the cause of later refusals unless one is recorded already
    /// (the store is not poisoned: it keeps committing what was
    /// acknowledged); returns the cause it recorded, if it did.
    pub(crate) fn note_damage(&self) -> Option<String> {
        let cause = damage_cause(self.damage_marker.as_deref());
        let mut recorded = self.progress.cause.lock();
        if recorded.is_some() {
            return None;
        }
        *recorded = Some(cause.clone());
        Some(cause)
    }

    /// Replaces the cause `noted` (recorded by [`Shared::note_damage`]) by
    /// `cause`, and poisons the store: the damage marker `noted` names was
    /// not written after all.
    pub(crate) fn poison_instead_of(&self, noted: Option<&str>, cause: String) {
        {
            let mut recorded = self.progress.cause.lock();
            if noted.is_some() && recorded.as_deref() == noted {
                *recorded = None;
            }
        }
        self.poison_for(cause);
    }

    /// Poisons the store after a panic inside a batch (`what` panicked),
    /// and fails every batch still waiting for durability.
    fn poison_panicked(&self, what: &str) {
        self.poison_for(panicked_cause(what));
        self.index_failed.store(true, Ordering::SeqCst);
        tracing::error!(path = %self.path.display(), "{what} panicked inside a batch; store refuses writes until reopened");
        self.progress
            .fail(format!("{what} panicked inside a batch"));
    }

    /// Marks the store poisoned after a failed durable write, and fails
    /// every batch still waiting for durability.
    fn poison(&self, err: &Error, index: bool) {
        // The failure's own text, without a second "storage error: ".
        let failure = match err {
            Error::Storage(detail) => detail.clone(),
            other => other.to_string(),
        };
        self.poison_for(write_failed_cause(&failure));
        if index {
            self.index_failed.store(true, Ordering::SeqCst);
        }
        tracing::error!(path = %self.path.display(), error = %err, "durable write failed; store refuses writes until reopened");
        self.progress.fail(failure);
    }
}

/// Why a store refuses writes after the durable write that failed with
/// `failure` (that write's error as text).
fn write_failed_cause(failure: &str) -> String {
    format!(
        "a durable write failed ({failure}); reopen the store once that is fixed \
         (the reopen recovers from what is on disk)"
    )
}

/// Why a store refuses writes after `what` (the store's writer, or a
/// caller deciding a batch) panicked inside a batch.
fn panicked_cause(what: &str) -> String {
    format!(
        "{what} panicked inside a batch; reopen the store (the reopen recovers from what is \
         on disk)"
    )
}

/// Why a store the online scrub found damaged refuses writes, with
/// `marker` its damage marker (`None` on a custom backend).
pub(crate) fn damage_cause(marker: Option<&Path>) -> String {
    match marker {
        Some(marker) => format!(
            "the online scrub found the index damaged (marker {}); the store refuses \
             writes while the marker exists: restore it from an export into a new file",
            marker.display()
        ),
        None => "the online scrub found the index damaged; restore the store from an \
                 export"
            .to_string(),
    }
}

// ---------------------------------------------------------------------------
// Durability progress, shared by the writer, the syncer and readers.

type Replier = (oneshot::Sender<Result<Answer>>, Result<Answer>);

/// How many requests of `replies` wrote a change to a record
/// ([`crate::record::writes`]): each transition of a [`Command::Many`] (an
/// import batch, `claim_many`) on its own; a sweep, a checkpoint or a
/// commit, none.
fn writes(replies: &[Replier]) -> usize {
    replies
        .iter()
        .map(|(_, answer)| match answer {
            Ok(Answer::Reply(reply)) => usize::from(reply.wrote()),
            Ok(Answer::Many(replies)) => crate::record::writes(replies),
            _ => 0,
        })
        .sum()
}

/// Answers of one batch, waiting until the log is durable up to `dep`.
struct Parked {
    dep: u64,
    /// The batch's own sequence number and changed keys, to clear its gate.
    seq: u64,
    keys: Vec<Vec<u8>>,
    replies: Vec<Replier>,
    /// Audit events of the batch, published once it is durable (never for
    /// a change a crash could undo).
    events: Vec<Event>,
    /// The time bound that is durable once the batch is.
    bound: u64,
}

#[derive(Default)]
struct ProgressState {
    /// The highest sequence number whose frame is written (or checkpointed).
    written: u64,
    /// The highest sequence number that is durable.
    synced: u64,
    /// Batches waiting for durability, in sequence order.
    parked: VecDeque<Parked>,
    /// Why the store failed, once a durable write failed.
    failed: Option<String>,
    writer_done: bool,
    syncer_gone: bool,
    /// A caller asked for an fsync now (buffered mode).
    flush_now: bool,
    /// The writer is syncing a frame itself (the syncer keeps off).
    writer_syncing: bool,
    /// When the oldest frame not yet synced was written.
    unsynced_since: Option<Instant>,
    /// Buffered mode: the frames answered before they were durable, by
    /// sequence number, and how many requests of each wrote; counted by
    /// the commit that makes them durable.
    answered_early: VecDeque<(u64, usize)>,
    /// Of `answered_early`, the writes made durable and not yet counted.
    durable_writes: usize,
}

/// How far the log is written and durable, and who waits for it.
pub(crate) struct Progress {
    state: Mutex<ProgressState>,
    /// Signalled when durability moves (`synced`), fails, or the syncer is
    /// gone (and when the writer is done): what callers of
    /// [`Progress::wait_durable`] wait for.
    changed: Condvar,
    /// Signalled when the syncer may have work (a frame written, a flush
    /// asked for, the writer done, a failure): the only thing the syncer
    /// waits on, so that a batch the writer synced itself does not wake
    /// it for nothing (a futex wake and a context switch per batch).
    work: Condvar,
    synced: AtomicU64,
    /// The highest sequence number applied to the index by a commit (the
    /// writer keeps one index transaction open across a few batches).
    committed: AtomicU64,
    /// Why the store refuses writes, once it does: the first cause
    /// recorded (see [`Shared::refusal`]). Locked last: nothing else is
    /// locked while it is held.
    pub(crate) cause: Mutex<Option<String>>,
}

impl Progress {
    /// Progress after recovery: everything up to `seq` is durable.
    pub(crate) fn new(seq: u64) -> Progress {
        Progress {
            state: Mutex::new(ProgressState {
                written: seq,
                synced: seq,
                ..ProgressState::default()
            }),
            changed: Condvar::new(),
            work: Condvar::new(),
            synced: AtomicU64::new(seq),
            committed: AtomicU64::new(seq),
            cause: Mutex::new(None),
        }
    }

    /// The highest sequence number committed to the index.
    pub(crate) fn committed(&self) -> u64 {
        self.committed.load(Ordering::SeqCst)
    }

    /// Changes up to this sequence number may be shown to readers outside
    /// the writer: committed to the index, and durable when `gated`.
    pub(crate) fn visible_upto(&self, gated: bool) -> u64 {
        let committed = self.committed();
        if gated {
            committed.min(self.synced())
        } else {
            committed
        }
    }

    /// The highest durable sequence number.
    pub(crate) fn synced(&self) -> u64 {
        self.synced.load(Ordering::SeqCst)
    }

    /// Waits until sequence number `seq` is durable.
    ///
    /// # Errors
    /// [`Error::Poisoned`] when a durable write failed first,
    /// [`Error::Closed`] when the syncer is gone.
    pub(crate) fn wait_durable(&self, seq: u64) -> Result<()> {
        let mut st = self.state.lock();
        loop {
            if st.synced >= seq {
                return Ok(());
            }
            if let Some(failure) = &st.failed {
                // The store's first cause: every refusal names the same.
                let cause = self.cause.lock().clone();
                return Err(Error::Poisoned {
                    cause: cause.unwrap_or_else(|| write_failed_cause(failure)),
                });
            }
            if st.syncer_gone {
                return Err(Error::Closed);
            }
            self.changed.wait(&mut st);
        }
    }

    /// Whether an fsync of written frames is pending or running (and the
    /// syncer is there to finish it).
    fn busy(&self) -> bool {
        let st = self.state.lock();
        (st.written > st.synced || st.writer_syncing) && !st.syncer_gone && st.failed.is_none()
    }

    /// Claims the fsync of frame `seq` for the writer itself, when nothing
    /// else is written or being synced (so the syncer is idle).
    fn take_inline_sync(&self, seq: u64) -> bool {
        let mut st = self.state.lock();
        if st.written != st.synced || st.writer_syncing || st.failed.is_some() {
            return false;
        }
        st.written = seq;
        st.writer_syncing = true;
        true
    }

    /// The writer's own fsync of frame `seq` succeeded.
    fn inline_synced(&self, seq: u64) -> Vec<Parked> {
        let mut st = self.state.lock();
        st.writer_syncing = false;
        let ready = self.advance(&mut st, seq);
        if st.written <= st.synced {
            st.unsynced_since = None;
        } else {
            // Not reached today (only the holder of the writer's state
            // writes frames, and it is the one syncing): kept so that a
            // frame written meanwhile could never wait for a syncer that
            // kept off while the writer synced.
            self.work.notify_all();
        }
        ready
    }

    fn syncer_gone(&self) -> bool {
        self.state.lock().syncer_gone
    }

    /// Makes every frame written so far durable now, and waits for it.
    ///
    /// # Errors
    /// As [`Progress::wait_durable`].
    pub(crate) fn flush(&self) -> Result<()> {
        let target = {
            let mut st = self.state.lock();
            if st.written > st.synced {
                st.flush_now = true;
                self.work.notify_all();
            }
            st.written
        };
        self.wait_durable(target)
    }

    /// Frame `seq` is written; `early_writes` of its requests wrote and
    /// are answered before it is durable (buffered mode).
    fn wrote(&self, seq: u64, early_writes: usize) {
        let mut st = self.state.lock();
        if early_writes > 0 {
            st.answered_early.push_back((seq, early_writes));
        }
        st.written = st.written.max(seq);
        st.unsynced_since.get_or_insert_with(Instant::now);
        self.work.notify_all();
    }

    /// Records that everything up to `seq` is durable and takes the parked
    /// batches that may now be answered.
    fn advance(&self, st: &mut ProgressState, seq: u64) -> Vec<Parked> {
        if seq > st.synced {
            st.synced = seq;
            self.synced.store(seq, Ordering::SeqCst);
        }
        st.written = st.written.max(seq);
        while let Some(&(early, n)) = st.answered_early.front() {
            if early > st.synced {
                break;
            }
            st.answered_early.pop_front();
            st.durable_writes = st.durable_writes.saturating_add(n);
        }
        let mut ready = Vec::new();
        while st.parked.front().is_some_and(|p| p.dep <= st.synced) {
            ready.extend(st.parked.pop_front());
        }
        self.changed.notify_all();
        ready
    }

    /// A checkpoint made everything up to `seq` durable. Returns how many
    /// requests answered before their frames were durable (buffered mode)
    /// it made durable.
    fn checkpointed(&self, seq: u64, shared: &Shared) -> usize {
        let (ready, early) = {
            let mut st = self.state.lock();
            let ready = self.advance(&mut st, seq);
            if st.written <= st.synced {
                st.unsynced_since = None;
            }
            (ready, std::mem::take(&mut st.durable_writes))
        };
        let writes = early.saturating_add(ready.iter().map(|p| writes(&p.replies)).sum());
        answer(shared, ready);
        writes
    }

    /// Answers `replies` once `dep` is durable (at once if it is).
    fn park(&self, shared: &Shared, parked: Parked) {
        let mut st = self.state.lock();
        if let Some(msg) = &st.failed {
            let msg = msg.clone();
            drop(st);
            fail_all(parked.replies, &Error::Storage(msg));
            return;
        }
        if st.syncer_gone && parked.dep > st.synced {
            return; // Dropping the senders answers Closed.
        }
        if parked.dep <= st.synced {
            drop(st);
            answer(shared, vec![parked]);
            return;
        }
        st.parked.push_back(parked);
    }

    /// A durable write failed: fail every parked batch.
    fn fail(&self, msg: String) {
        let parked = {
            let mut st = self.state.lock();
            if st.failed.is_none() {
                st.failed = Some(msg.clone());
            }
            self.changed.notify_all();
            self.work.notify_all();
            std::mem::take(&mut st.parked)
        };
        let err = Error::Storage(msg);
        for p in parked {
            fail_all(p.replies, &err);
        }
    }
}

/// Wakes the callers of `ready`, and forgets their read-gate marks as far
/// as the changes are visible (a mark stays until the change is committed to
/// the index too; the commit clears it then).
fn answer(shared: &Shared, ready: Vec<Parked>) {
    let gated = shared.durability == Durability::Immediate;
    for p in ready {
        shared.time_durable.fetch_max(p.bound, Ordering::SeqCst);
        shared.counters.publish(p.events);
        for (tx, r) in p.replies {
            let _ = tx.send(r);
        }
        let visible = shared.progress.visible_upto(gated);
        shared.cache.end_write(&p.keys, p.seq.min(visible));
    }
}

fn fail_all(replies: Vec<Replier>, err: &Error) {
    for (tx, _) in replies {
        let _ = tx.send(Err(copy_err(err)));
    }
}

/// Answers `req` now, before its batch is durable; the batch's own answer
/// later goes to a receiver that is gone.
fn answer_early(req: &mut Request, answer: Answer) {
    let (unheard, _) = oneshot::channel();
    let _ = std::mem::replace(&mut req.reply, unheard).send(Ok(answer));
}

fn fail_requests(batch: &mut Vec<Request>, err: &Error) {
    for req in batch.drain(..) {
        let _ = req.reply.send(Err(copy_err(err)));
    }
}

/// The same error for every request of a batch (errors are not `Clone`).
fn copy_err(err: &Error) -> Error {
    match err {
        Error::CorruptFile { path, detail } => Error::CorruptFile {
            path: path.clone(),
            detail: detail.clone(),
        },
        Error::Poisoned { cause } => Error::Poisoned {
            cause: cause.clone(),
        },
        Error::Closed => Error::Closed,
        Error::Storage(detail) => Error::Storage(detail.clone()),
        other => Error::Storage(other.to_string()),
    }
}

// ---------------------------------------------------------------------------
// The writer and the syncer.

/// What the writer owns besides the shared state.
pub(crate) struct WriterState {
    /// The token the next acquisition takes.
    pub next_token: u64,
    /// The sequence number of the last batch applied to the index.
    pub last_seq: u64,
    /// Tokens below this may be handed out before the next checkpoint
    /// (the last checkpoint recorded it durably).
    pub token_reserved: u64,
    /// The time bound the last frame or checkpoint written carries: answers
    /// may be based on times up to it once that write is durable.
    pub time_reserved: u64,
    pub log: LogWriter,
    /// The state counts as of the open transaction (`None` until a batch
    /// first reads them): kept here across batches and written to the
    /// index once per commit instead of once per batch.
    tally: Option<Tally>,
    /// Requests in the last batch decided: a caller leads only after a
    /// batch of one (see [`Writer::submit`]).
    last_batch: usize,
    /// The index transaction batches are being applied to, not yet
    /// committed.
    open: Option<OpenTxn>,
    /// The record changes committed since the last checkpoint, and how many
    /// of them were evictions: what a checkpoint's share owed by
    /// evictions is reckoned from (its sync writes the pages they changed).
    since_checkpoint: Changes,
}

/// Record changes an index commit applied, and the evictions among them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Changes {
    /// Record puts and removals applied.
    all: u64,
    /// Records evicted by paced sweep slices (at most `all` counts; an
    /// evicted key claimed again before the buffer is applied is a put, so
    /// this is an estimate).
    evicted: u64,
}

impl Changes {
    /// The changes `open` applied: its buffer's taken puts and removals,
    /// and its sweeps' evictions (a removal is an eviction only if a sweep
    /// made it: a released claim removes its record too).
    fn of(open: &OpenTxn) -> Changes {
        let (puts, removals) = open.pending.taken();
        Changes {
            all: puts.saturating_add(removals),
            evicted: open.evicted.min(removals),
        }
    }

    fn add(self, other: Changes) -> Changes {
        Changes {
            all: self.all.saturating_add(other.all),
            evicted: self.evicted.saturating_add(other.evicted),
        }
    }
}

impl WriterState {
    pub(crate) fn new(
        next_token: u64,
        token_reserved: u64,
        last_seq: u64,
        time_reserved: u64,
        log: LogWriter,
    ) -> Self {
        WriterState {
            next_token,
            last_seq,
            token_reserved,
            time_reserved,
            log,
            tally: None,
            last_batch: 0,
            open: None,
            since_checkpoint: Changes::default(),
        }
    }
}

/// Commit the open index transaction after this many sealed batches (or as
/// soon as the writer is idle, or a reader asks): one commit then covers
/// several batches, and a page changed by several of them is copied once.
const COMMIT_EVERY: usize = 64;

/// Buffered changes the writer applies at a time while it would block
/// waiting for the syncer's fsync (see `process`): few, so that it sees a
/// new request or the end of the fsync soon (a few microseconds for small
/// records; a change carries one record, so at most 16 records' bytes).
const IDLE_APPLY_CHUNK: usize = 16;

/// How long the writer waits for more requests before it commits the open
/// index transaction when idle. Readers never wait for it: a read of a key
/// with an uncommitted change asks for the commit.
const IDLE_COMMIT_DELAY: std::time::Duration = std::time::Duration::from_millis(1);

/// The writer's open index transaction.
struct OpenTxn {
    txn: WriteTransaction,
    /// Batches sealed into it.
    batches: usize,
    /// Record keys those batches changed (to clear their read-gate marks).
    keys: Vec<Vec<u8>>,
    /// Their changes to records and expiry entries not yet applied to
    /// `txn` (see `pending.rs`): applied before `txn` commits.
    pending: Pending,
    /// The counters as of the last batch sealed into it, not yet written:
    /// written once, before `txn` commits, instead of at every batch (a
    /// lone caller's batch then opens no metadata table).
    counters: Option<Counters>,
    /// Records evicted by paced sweep slices decided into it.
    evicted: u64,
}

/// The counters the index holds beside its tables (`schema::Tables::set_counters`).
#[derive(Debug, Clone, Copy)]
struct Counters {
    next_token: u64,
    clock_hwm: u64,
    /// The last frame whose effects the index holds with these counters
    /// (for a batch that moved only the token counter and wrote no frame,
    /// the frame before it).
    applied_seq: u64,
}

impl OpenTxn {
    /// Brings the transaction's tables up to date before it commits:
    /// applies the buffered changes (counting their records' states into
    /// `tally`) and writes the last batch's counters.
    fn apply_pending(&mut self, path: &Path, tally: &mut Option<Tally>) -> Result<()> {
        if self.pending.is_empty() && self.counters.is_none() {
            return Ok(());
        }
        guard(path, || {
            let mut tables =
                Tables::buffered(path, &self.txn, &mut self.pending).with_tally(*tally);
            tables.apply_pending()?;
            if let Some(c) = self.counters.take() {
                tables.set_counters(c.next_token, c.clock_hwm, c.applied_seq)?;
            }
            *tally = tables.finish().tally;
            Ok(())
        })
    }
}

/// Async callers waiting for room in the writer's full queue.
#[derive(Default)]
struct Space {
    waiting: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
    /// Requests sent and not yet taken by the writer (counted before the
    /// send, so never below the true number).
    queued: AtomicUsize,
}

impl Space {
    /// Registers `waker` to be woken when the writer next takes a message.
    fn register(&self, waker: &Waker) {
        let mut wakers = self.wakers.lock();
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
        self.waiting.store(true, Ordering::SeqCst);
    }

    /// The writer took a message: there is room; wake whoever waits.
    fn notify(&self) {
        if self.waiting.load(Ordering::SeqCst) {
            let wakers = {
                let mut wakers = self.wakers.lock();
                self.waiting.store(false, Ordering::SeqCst);
                std::mem::take(&mut *wakers)
            };
            for w in wakers {
                w.wake();
            }
        }
    }
}

/// The writer's end of the queue: every message taken makes room, which
/// async senders waiting on a full queue are told of.
struct Queue {
    rx: Receiver<Msg>,
    space: Arc<Space>,
}

impl Queue {
    fn took<E>(&self, r: std::result::Result<Msg, E>) -> std::result::Result<Msg, E> {
        if let Ok(msg) = &r {
            if matches!(msg, Msg::Req(_)) {
                self.space.queued.fetch_sub(1, Ordering::SeqCst);
            }
            self.space.notify();
        }
        r
    }

    fn try_recv(&self) -> std::result::Result<Msg, TryRecvError> {
        self.took(self.rx.try_recv())
    }

    fn recv(&self) -> std::result::Result<Msg, std::sync::mpsc::RecvError> {
        self.took(self.rx.recv())
    }

    fn recv_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> std::result::Result<Msg, RecvTimeoutError> {
        self.took(self.rx.recv_timeout(timeout))
    }
}

/// The writer's state, shared by the writer thread and a caller that leads
/// its own request (see the module docs).
struct Lead {
    state: Mutex<WriterState>,
    /// Set while the writer thread waits for a message with no idle commit
    /// to make: a caller that led a batch then nudges it, so that the batch
    /// is committed to the index once the store is idle.
    asleep: AtomicBool,
    /// Batches led by callers: the writer waits for the store to be idle
    /// (no led batch for [`IDLE_COMMIT_DELAY`]) before its idle commit.
    led: AtomicU64,
}

/// The handle to the writer, syncer and waker threads.
pub(crate) struct Writer {
    tx: Option<SyncSender<Msg>>,
    space: Arc<Space>,
    /// Dropped before `shared` (fields drop in order): the writer's state
    /// holds the log, whose lock goes before the index's (held by `db` in
    /// `shared`), so that an open that takes the index's lock next finds
    /// the log free too, not held by a store that is closing.
    lead: Arc<Lead>,
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
    syncer: Option<JoinHandle<()>>,
    waker: Option<JoinHandle<()>>,
}

/// Above this many callers made durable by one fsync, the syncer hands the
/// wake-ups to the waker thread and starts the next fsync at once; below
/// it, it wakes them itself (a lone caller pays no extra thread hop).
const WAKE_INLINE: usize = 4;

impl Writer {
    pub(crate) fn start(
        shared: Arc<Shared>,
        state: WriterState,
        log: Arc<dyn LogFile>,
    ) -> Result<Writer> {
        let (tx, rx) = sync_channel(QUEUE_BOUND);
        let space = Arc::new(Space::default());
        let rx = Queue {
            rx,
            space: space.clone(),
        };
        let (wake_tx, wake_rx) = std::sync::mpsc::channel::<Vec<Parked>>();
        let for_waker = shared.clone();
        let waker = std::thread::Builder::new()
            .name("idemstore-waker".into())
            .spawn(move || {
                for ready in wake_rx {
                    answer(&for_waker, ready);
                }
            })
            .map_err(Error::storage)?;
        let for_syncer = shared.clone();
        let nudge = tx.clone();
        let syncer = std::thread::Builder::new()
            .name("idemstore-syncer".into())
            .spawn(move || sync_loop(&for_syncer, log.as_ref(), &wake_tx, &nudge))
            .map_err(Error::storage)?;
        let lead = Arc::new(Lead {
            state: Mutex::new(state),
            asleep: AtomicBool::new(false),
            led: AtomicU64::new(0),
        });
        let (for_writer, lead_of_writer) = (shared.clone(), lead.clone());
        let handle = std::thread::Builder::new()
            .name("idemstore-writer".into())
            .spawn(move || run(&for_writer, &lead_of_writer, &rx))
            .map_err(Error::storage)?;
        Ok(Writer {
            tx: Some(tx),
            space,
            shared,
            lead,
            handle: Some(handle),
            syncer: Some(syncer),
            waker: Some(waker),
        })
    }

    /// Decides `cmd` on the calling thread when the writer is idle (see the
    /// module docs), else queues it, waiting while the queue is full.
    pub(crate) fn submit(&self, cmd: Command) -> Completion {
        self.submit_with(cmd, true)
    }

    /// Requests counted as queued (sent, or about to be, and not yet taken
    /// by the writer).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.space.queued.load(Ordering::SeqCst)
    }

    /// Queues `cmd` for the writer thread, never deciding it on the calling
    /// thread (for a caller that must not run a batch and its fsync: a
    /// best-effort write from a `Drop` on an async executor); waits while
    /// the queue is full.
    pub(crate) fn submit_queued(&self, cmd: Command) -> Completion {
        self.submit_with(cmd, false)
    }

    fn submit_with(&self, cmd: Command, may_lead: bool) -> Completion {
        let Some(tx) = &self.tx else {
            return Completion::Ready(Err(Error::Closed));
        };
        let (reply, rx) = oneshot::channel();
        let request = Request { cmd, reply };
        let request = if may_lead {
            match self.lead(request) {
                Ok(()) => {
                    if self.lead.asleep.swap(false, Ordering::SeqCst) {
                        let _ = tx.try_send(Msg::Nudge);
                    }
                    return Completion::Pending(rx);
                }
                Err(request) => request,
            }
        } else {
            request
        };
        self.space.queued.fetch_add(1, Ordering::SeqCst);
        let sent = match tx.try_send(Msg::Req(request)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(msg)) => tx.send(msg).map_err(|_| ()),
            Err(TrySendError::Disconnected(_)) => Err(()),
        };
        match sent {
            Ok(()) => Completion::Pending(rx),
            Err(()) => {
                self.space.queued.fetch_sub(1, Ordering::SeqCst);
                Completion::Ready(Err(Error::Closed))
            }
        }
    }

    /// Decides `request` on the calling thread if nothing is queued, no
    /// fsync is pending or running, the writer's state is free and the last
    /// batch was a batch of one (a lone caller); hands it back otherwise. The answer goes to the request's reply as from the
    /// writer thread (at once when this thread synced the batch itself).
    fn lead(&self, request: Request) -> std::result::Result<(), Request> {
        if self.space.queued.load(Ordering::SeqCst) != 0 || self.shared.progress.busy() {
            return Err(request);
        }
        let Some(mut state) = self.lead.state.try_lock() else {
            return Err(request);
        };
        // Under load (the last batch had company) the writer thread
        // batches: a caller that led now would seal a batch of one and
        // make the rest wait for its fsync.
        if state.last_batch > 1 {
            return Err(request);
        }
        let shared = &*self.shared;
        let led = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            process(shared, &mut state, request, None)
        }));
        self.lead.led.fetch_add(1, Ordering::SeqCst);
        if led.is_err() {
            // A panic inside the batch (a storage backend's, say): the open
            // index transaction may hold part of it, so the store is
            // poisoned and its file fenced, as when the writer thread dies
            // (`WriterDone`). The request's reply was dropped: its caller
            // gets `Closed` (a paced sweep slice may have been answered already), later callers `Poisoned`.
            shared.fence.raise();
            shared.poison_panicked("a caller deciding a batch");
        }
        Ok(())
    }

    /// Queues `cmd` if the queue has room, without waiting for the answer
    /// (which is dropped). Returns whether it was queued.
    pub(crate) fn submit_detached(&self, cmd: Command) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        let (reply, _rx) = oneshot::channel();
        self.space.queued.fetch_add(1, Ordering::SeqCst);
        let sent = tx.try_send(Msg::Req(Request { cmd, reply })).is_ok();
        if !sent {
            self.space.queued.fetch_sub(1, Ordering::SeqCst);
        }
        sent
    }

    /// Queues `cmd` from async code: while the queue is full the future
    /// waits (woken when the writer takes a message), never blocking the
    /// thread that polls it.
    pub(crate) async fn submit_async(&self, cmd: Command) -> Completion {
        let Some(tx) = &self.tx else {
            return Completion::Ready(Err(Error::Closed));
        };
        let (reply, rx) = oneshot::channel();
        let mut msg = Some(Msg::Req(Request { cmd, reply }));
        // Counted before the send (never below the true number); a future
        // dropped before its message went out takes its count back.
        self.space.queued.fetch_add(1, Ordering::SeqCst);
        let mut counted = Counted {
            queued: &self.space.queued,
            armed: true,
        };
        let sent = std::future::poll_fn(|cx| {
            let Some(m) = msg.take() else {
                return Poll::Ready(false);
            };
            match tx.try_send(m) {
                Ok(()) => Poll::Ready(true),
                Err(TrySendError::Disconnected(_)) => Poll::Ready(false),
                Err(TrySendError::Full(m)) => {
                    // Registered before the second try: room made after it
                    // wakes this task.
                    self.space.register(cx.waker());
                    match tx.try_send(m) {
                        Ok(()) => Poll::Ready(true),
                        Err(TrySendError::Disconnected(_)) => Poll::Ready(false),
                        Err(TrySendError::Full(m)) => {
                            msg = Some(m);
                            Poll::Pending
                        }
                    }
                }
            }
        })
        .await;
        if sent {
            // The writer takes the count back when it takes the message.
            counted.disarm();
            Completion::Pending(rx)
        } else {
            Completion::Ready(Err(Error::Closed))
        }
    }
}

/// A request counted in [`Space::queued`] that has not been sent yet: the
/// count is taken back on drop (an async sender cancelled while the queue
/// was full), unless disarmed once the message is sent.
struct Counted<'a> {
    queued: &'a AtomicUsize,
    armed: bool,
}

impl Counted<'_> {
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // The writer decides everything queued before `Close`, ends with a
        // checkpoint and stops; the syncer and the waker stop after it.
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Msg::Close);
        }
        let threads = [self.handle.take(), self.syncer.take(), self.waker.take()];
        for handle in threads.into_iter().flatten() {
            let _ = handle.join();
        }
    }
}

/// Tells the syncer and waiting readers when the writer thread ends, by
/// return or by panic.
struct WriterDone<'a>(&'a Shared);

impl Drop for WriterDone<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The writer died inside a batch, without its closing step:
            // the index may hold non-durable commits of batches whose log
            // frames never became durable. Nothing may make them durable
            // now, redb's close included, so the store is poisoned and its
            // file fenced, as after a failed durable write (`close`).
            self.0.poison_for(panicked_cause("the store's writer"));
            self.0.fence.raise();
            tracing::error!(path = %self.0.path.display(), "the store's writer panicked; the store refuses writes until reopened");
        }
        let mut st = self.0.progress.state.lock();
        st.writer_done = true;
        self.0.progress.changed.notify_all();
        self.0.progress.work.notify_all();
    }
}

/// Tells everyone when the syncer thread ends, by return or by panic; the
/// batches it still held are dropped, so their callers get `Closed`.
struct SyncerGone<'a>(&'a Shared, &'a SyncSender<Msg>);

impl Drop for SyncerGone<'_> {
    fn drop(&mut self) {
        let parked = {
            let mut st = self.0.progress.state.lock();
            st.syncer_gone = true;
            self.0.progress.changed.notify_all();
            std::mem::take(&mut st.parked)
        };
        drop(parked);
        let _ = self.1.try_send(Msg::Nudge);
    }
}

fn payload_bytes(cmd: &Command) -> usize {
    256 + match cmd {
        Command::Op { op, .. } => match op {
            Op::Complete { result, .. } => result.len(),
            Op::Fail { failure, .. } | Op::ReleaseUnlessActed { failure, .. } => failure.len(),
            Op::SetRecoveryPoint { bytes, .. } => bytes.len(),
            _ => 0,
        },
        Command::Many { ops, .. } => ops
            .iter()
            .map(|(key, op)| match op {
                Op::Import { record } => {
                    512 + key.id().len()
                        + record.output.as_ref().map_or(0, Vec::len)
                        + record.recovery_point.as_ref().map_or(0, Vec::len)
                }
                Op::Complete { result: b, .. }
                | Op::Fail { failure: b, .. }
                | Op::ReleaseUnlessActed { failure: b, .. }
                | Op::SetRecoveryPoint { bytes: b, .. } => 512 + key.id().len() + b.len(),
                _ => 512 + key.id().len(),
            })
            .fold(0, usize::saturating_add),
        Command::Sweep { .. } | Command::Checkpoint | Command::Commit | Command::Reserve => 0,
    }
}

fn run(shared: &Shared, lead: &Lead, rx: &Queue) {
    let done = WriterDone(shared);
    loop {
        let msg = match rx.try_recv() {
            Ok(msg) => msg,
            Err(TryRecvError::Empty) => match (
                lead.led.load(Ordering::SeqCst),
                rx.recv_timeout(IDLE_COMMIT_DELAY),
            ) {
                (_, Ok(msg)) => msg,
                (_, Err(RecvTimeoutError::Disconnected)) => break,
                // A caller led a batch meanwhile: the store is not idle
                // (committing now would hold the state from its next one).
                (led, Err(RecvTimeoutError::Timeout)) if lead.led.load(Ordering::SeqCst) != led => {
                    continue;
                }
                (_, Err(RecvTimeoutError::Timeout)) => {
                    // Idle: apply what was acknowledged to the index
                    // before waiting (a caller's next request, which
                    // usually follows its answer at once, goes first).
                    // A caller that leads a batch meanwhile nudges.
                    // `asleep` is set before the state is released, so
                    // that a caller who leads next sees it and nudges.
                    {
                        let mut held = Held::new(shared, lead);
                        commit_open(shared, &mut held.state);
                        lead.asleep.store(true, Ordering::SeqCst);
                    }
                    let msg = rx.recv();
                    lead.asleep.store(false, Ordering::SeqCst);
                    match msg {
                        Ok(msg) => msg,
                        Err(_) => break,
                    }
                }
            },
            Err(TryRecvError::Disconnected) => break,
        };
        let first = match msg {
            Msg::Req(req) => req,
            Msg::Nudge => continue,
            Msg::Close => break,
        };
        if process(shared, &mut Held::new(shared, lead).state, first, Some(rx)) {
            break;
        }
    }
    close(shared, &mut Held::new(shared, lead).state);
    drop(done);
}

/// The writer's state as the writer thread holds it. Should the thread
/// panic while holding it, the store is poisoned and its file fenced
/// before the state is released, so that no caller can lead a batch on a
/// state the panic left half-changed (`WriterDone` does the same, but only
/// after the state's lock is gone).
struct Held<'a> {
    shared: &'a Shared,
    state: MutexGuard<'a, WriterState>,
}

impl<'a> Held<'a> {
    fn new(shared: &'a Shared, lead: &'a Lead) -> Held<'a> {
        Held {
            shared,
            state: lead.state.lock(),
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.poison_for(panicked_cause("the store's writer"));
            self.shared.fence.raise();
        }
    }
}

/// Takes what is queued (without waiting) into `batch`. Returns whether the
/// store is closing.
fn take_queued(rx: &Queue, batch: &mut Vec<Request>) -> bool {
    loop {
        match rx.try_recv() {
            Ok(Msg::Req(req)) => batch.push(req),
            Ok(Msg::Nudge) => {}
            Ok(Msg::Close) | Err(TryRecvError::Disconnected) => return true,
            Err(TryRecvError::Empty) => return false,
        }
    }
}

/// Drops the open index transaction after a failure. Batches in it may have
/// been acknowledged (their frames are durable), so the closing checkpoint
/// must not run: the next open replays them from the log.
fn abandon_open(shared: &Shared, state: &mut WriterState) {
    if state.open.take().is_some_and(|o| o.batches > 0) {
        shared.index_failed.store(true, Ordering::SeqCst);
    }
}

/// After the log failed: the open transaction's batches are committed to
/// the index all the same (those not durable stay gated: their marks are
/// above the durable sequence number for good, and readers of them get
/// `Poisoned`), so that acknowledged changes stay readable until reopen. If
/// the index itself failed, the transaction is dropped instead.
fn settle_open(shared: &Shared, state: &mut WriterState) {
    if shared.index_failed.load(Ordering::SeqCst) {
        abandon_open(shared, state);
    } else {
        commit_open(shared, state);
    }
}

/// Commits the open index transaction (non-durably: the log holds its
/// batches) and clears the read-gate marks that are now visible.
fn commit_open(shared: &Shared, state: &mut WriterState) {
    let Some(open) = state.open.take() else {
        return;
    };
    if open.batches == 0 {
        return; // Nothing changed: dropping it aborts nothing of value.
    }
    let path = &shared.path;
    let started = Instant::now();
    let mut open = open;
    let applied = open.apply_pending(path, &mut state.tally);
    let changes = Changes::of(&open);
    let OpenTxn { txn, keys, .. } = open;
    let tally = state.tally;
    let committed = applied.and_then(|()| {
        guard(path, || {
            schema::write_tally(path, &txn, tally)?;
            txn.commit().map_err(|e| map_err(path, e))
        })
    });
    if let Err(err) = committed {
        shared.index_failed.store(true, Ordering::SeqCst);
        shared.poison(&err, true);
        return;
    }
    shared.owe_sweep(evictions_share(started.elapsed(), changes));
    state.since_checkpoint = state.since_checkpoint.add(changes);
    shared
        .progress
        .committed
        .store(state.last_seq, Ordering::SeqCst);
    let gated = shared.durability == Durability::Immediate;
    shared
        .cache
        .end_write(&keys, shared.progress.visible_upto(gated));
}

/// Forms, decides and seals one batch, starting with `first`. Returns
/// whether the store is closing.
///
/// Requests are decided as they arrive, inside the writer's open index
/// transaction. The batch is sealed (its frame written) as soon as nothing
/// more is queued — unless, in `Immediate` mode, an earlier frame's fsync is
/// still running: the new frame could not be synced before it ends anyway,
/// so the writer keeps taking requests into the batch until the syncer
/// reports the disk free, and while none arrives it applies buffered
/// changes to the index (`pending.rs`), 16 at a time, blocking only once
/// none is left. A lone caller is never held back.
///
/// Without `rx`, a caller leads its own request (see [`Writer::submit`]):
/// the batch is that request alone, sealed at once, and synced here when
/// the disk is free (else by the syncer, which answers it).
fn process(shared: &Shared, state: &mut WriterState, first: Request, rx: Option<&Queue>) -> bool {
    let mut batch = vec![first];
    let gated = shared.durability == Durability::Immediate;
    // Without the syncer nothing would become durable, in either mode.
    if shared.poisoned.load(Ordering::SeqCst) || shared.progress.syncer_gone() {
        settle_open(shared, state);
        let closing = rx.is_some_and(|rx| take_queued(rx, &mut batch));
        let err = if shared.poisoned.load(Ordering::SeqCst) {
            shared.refusal()
        } else {
            Error::Closed
        };
        fail_requests(&mut batch, &err);
        return closing;
    }
    let path = &shared.path;
    let mut now = shared.clock.now_ms();
    let open = match state.open.take() {
        Some(open) => Ok(open),
        None => guard(path, || {
            let mut txn = shared.db.begin_write().map_err(|e| map_err(path, e))?;
            txn.set_durability(redb::Durability::None)
                .map_err(|e| map_err(path, e))?;
            Ok(OpenTxn {
                txn,
                batches: 0,
                keys: Vec::new(),
                pending: Pending::default(),
                counters: None,
                evicted: 0,
            })
        }),
    };
    let mut open = match open {
        Ok(open) => open,
        Err(err) => {
            shared.poison(&err, true);
            let closing = rx.is_some_and(|rx| take_queued(rx, &mut batch));
            fail_requests(&mut batch, &err);
            return closing;
        }
    };
    let mut token = state.next_token;
    let mut bound = state.time_reserved;
    let mut answers: Vec<Result<Answer>> = Vec::new();
    let mut events: Vec<Event> = Vec::new();
    let mut closing = false;
    let mut checkpoint = false;
    let mut commit = false;
    // Whether the batch was sealed because nothing more was queued and the
    // disk was free: then the writer syncs it itself (one thread hop fewer
    // for a lone caller).
    let mut alone = false;
    let mut evicted = 0u64;
    let decided = guard(path, || {
        let mut tables =
            Tables::buffered(path, &open.txn, &mut open.pending).with_tally(state.tally);
        let mut bytes = 0;
        loop {
            while answers.len() < batch.len() {
                // A batch may stay open for an fsync's duration: each
                // request is decided at its own time (never earlier).
                now = shared.clock.now_ms();
                let cmd = &batch[answers.len()].cmd;
                bytes += payload_bytes(cmd);
                checkpoint |= matches!(cmd, Command::Checkpoint);
                commit |= matches!(cmd, Command::Commit);
                let early = matches!(cmd, Command::Sweep { early: true, .. });
                let mut answer = decide(shared, &mut tables, cmd, now, &mut token, &mut events)?;
                // A paced slice's evictions are owed for, and it pays what
                // earlier ones cost the writer since; a one-off
                // `Store::sweep` neither owes nor pays.
                if early && let Ok(Answer::Evicted(swept)) = &mut answer {
                    evicted =
                        evicted.saturating_add(u64::try_from(swept.evicted).unwrap_or(u64::MAX));
                    swept.spent = swept.spent.saturating_add(shared.take_sweep_debt());
                }
                if let (true, Ok(Answer::Evicted(swept))) = (early, &answer) {
                    answer_early(&mut batch[answers.len()], Answer::Evicted(*swept));
                }
                answers.push(answer);
                if tables.pending_full() {
                    tables.apply_pending()?;
                }
            }
            if closing || checkpoint || batch.len() >= MAX_BATCH || bytes >= MAX_BATCH_BYTES {
                break;
            }
            let Some(rx) = rx else {
                // A leading caller takes no one else's request and never
                // waits for the disk.
                alone = !gated || !shared.progress.busy();
                break;
            };
            match rx.try_recv() {
                Ok(Msg::Req(req)) => {
                    batch.push(req);
                    continue;
                }
                Ok(Msg::Nudge) => continue,
                Ok(Msg::Close) | Err(TryRecvError::Disconnected) => {
                    closing = true;
                    break;
                }
                Err(TryRecvError::Empty) => {}
            }
            if !gated || !shared.progress.busy() {
                alone = true;
                break;
            }
            // Waiting for the disk: apply some buffered changes meanwhile,
            // a few at a time so that a request or the end of the fsync
            // is seen soon, and block only once nothing is left to apply.
            if tables.apply_pending_some(IDLE_APPLY_CHUNK)? {
                continue;
            }
            match rx.recv() {
                Ok(Msg::Req(req)) => batch.push(req),
                Ok(Msg::Nudge) => {}
                Ok(Msg::Close) | Err(_) => closing = true,
            }
        }
        // Every answer of the batch is based on a time up to `now` (the
        // last, hence largest, reading): the frame must carry a bound at
        // least that high, so that the time survives a crash.
        // Renewed half a reservation early, so that while batches flow
        // readers never wait for one.
        if now.saturating_add(RENEW_AHEAD_MS) > state.time_reserved && shared.held_time.is_none() {
            bound = shared.clock.reservation(now);
        }
        // The counters the index must hold with this batch, written before
        // the transaction commits (`OpenTxn::apply_pending`).
        let applied_seq = if tables.is_changed() || bound != state.time_reserved {
            Some(state.last_seq + 1)
        } else if token != state.next_token {
            // Only the token counter moved (an import whose records were all
            // present or skipped still raises it): no frame is written, so
            // the checkpoint below makes the counter durable.
            Some(state.last_seq)
        } else {
            None
        };
        let counters = applied_seq.map(|applied_seq| Counters {
            next_token: token,
            clock_hwm: bound,
            applied_seq,
        });
        Ok((tables.finish(), counters))
    });
    open.evicted = open.evicted.saturating_add(evicted);
    let (body, touched) = match decided {
        Ok((finished, counters)) => {
            state.tally = finished.tally;
            if let Some(c) = counters {
                open.counters = Some(c);
            }
            (finished.body, finished.touched)
        }
        Err(err) => {
            // The transaction may hold half of this batch: drop all of it.
            state.open = Some(open);
            abandon_open(shared, state);
            shared.poison(&err, true);
            fail_requests(&mut batch, &err);
            return closing;
        }
    };
    if shared.poisoned.load(Ordering::SeqCst) {
        // The log failed meanwhile. This batch's changes are in the open
        // transaction: gate them for good, then keep the rest.
        shared.cache.begin_write(&touched, Some(state.last_seq + 1));
        state.open = Some(open);
        settle_open(shared, state);
        fail_requests(&mut batch, &shared.refusal());
        return closing;
    }
    state.last_batch = batch.len();
    let replies: Vec<Replier> = batch.drain(..).map(|r| r.reply).zip(answers).collect();
    // A batch that changed nothing but needs a new time bound still writes
    // a frame (with no change) to carry it.
    let body = body.or_else(|| (bound != state.time_reserved).then(BodyWriter::new));
    let Some(body) = body else {
        let counter_moved = token != state.next_token;
        if counter_moved {
            state.next_token = token;
        }
        if checkpoint || counter_moved {
            let seq = state.last_seq;
            commit_checkpoint(
                shared,
                state,
                open,
                seq,
                Vec::new(),
                (replies, events),
                false,
            );
            return closing;
        }
        state.open = Some(open);
        if commit {
            commit_open(shared, state);
        }
        // Nothing changed: answer once the state these answers saw is
        // durable.
        let parked = Parked {
            dep: state.last_seq,
            seq: state.last_seq,
            keys: Vec::new(),
            replies,
            events,
            bound: state.time_reserved,
        };
        if gated {
            shared.progress.park(shared, parked);
        } else {
            answer(shared, vec![parked]);
        }
        return closing;
    };
    let body = body.finish(token, bound);
    state.next_token = token;
    state.time_reserved = bound;
    let seq = state.last_seq + 1;
    let frame_len = FRAME_HEADER_LEN + body.len();
    let full = !state.log.fits(frame_len);
    // A token beyond the durable reservation must not be acknowledged before
    // a checkpoint has moved the reservation past it.
    if checkpoint || full || state.next_token > state.token_reserved {
        commit_checkpoint(shared, state, open, seq, touched, (replies, events), full);
        return closing;
    }
    // Readers must not see these changes before they are committed to the
    // index (and, when gated, durable): mark them before anything else.
    shared.cache.begin_write(&touched, Some(seq));
    if let Err(err) = state.log.append(seq, shared.progress.synced(), &body) {
        shared.poison(&err, false);
        state.open = Some(open);
        settle_open(shared, state);
        fail_all(replies, &err);
        return closing;
    }
    let inline = gated
        && alone
        && shared.sync_inline.load(Ordering::Relaxed)
        && shared.progress.take_inline_sync(seq);
    if !inline {
        // Buffered: answered before the frame is durable; the commit that
        // makes it durable counts its writes.
        let early = if gated { 0 } else { writes(&replies) };
        shared.progress.wrote(seq, early);
    }
    state.last_seq = seq;
    open.batches += 1;
    open.keys.extend(touched.iter().cloned());
    let due = commit || open.batches >= COMMIT_EVERY;
    state.open = Some(open);
    if due {
        commit_open(shared, state);
    }
    let parked = Parked {
        dep: seq,
        seq,
        keys: touched,
        replies,
        events,
        bound,
    };
    if inline {
        let started = Instant::now();
        let synced = state.log.sync();
        let fsync = started.elapsed();
        match synced {
            Ok(()) => {
                let mut ready = shared.progress.inline_synced(seq);
                ready.push(parked);
                let callers: usize = ready.iter().map(|p| p.replies.len()).sum();
                let writes = ready.iter().map(|p| writes(&p.replies)).sum();
                shared.synced(started.elapsed(), fsync, callers, writes);
                answer(shared, ready);
            }
            Err(err) => {
                fail_all(parked.replies, &err);
                shared.poison(&err, false);
                settle_open(shared, state);
            }
        }
    } else if gated {
        shared.progress.park(shared, parked);
    } else {
        answer(shared, vec![parked]);
    }
    closing
}

/// The part of `took`, the writer's time applying and committing an index
/// transaction (or checkpointing: the changes since the last checkpoint),
/// that its evictions caused: in proportion to the evictions among the
/// record changes it applied, each a change to a leaf of the records
/// table. A slice is charged for its own time; this is what its evictions
/// cost the writer afterwards (their pages copied, written and, at a
/// checkpoint, synced), which would otherwise fall on the writes beside
/// the sweep. Charged to the next slice (`Shared::sweep_debt_ns`).
fn evictions_share(took: Duration, changes: Changes) -> Duration {
    let (all, removals) = (u128::from(changes.all), changes.evicted.min(changes.all));
    if all == 0 || removals == 0 {
        return Duration::ZERO;
    }
    // At most 2^64 - 1 ns (584 years) each: the product fits in a u128.
    let took = u128::from(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
    let nanos = took.saturating_mul(u128::from(removals)) / all;
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Commits `open` (with the batch of sequence number `seq`, possibly empty)
/// durably as a checkpoint, answers the batch's callers and starts the log
/// over.
#[allow(clippy::too_many_arguments)]
fn commit_checkpoint(
    shared: &Shared,
    state: &mut WriterState,
    open: OpenTxn,
    seq: u64,
    touched: Vec<Vec<u8>>,
    (replies, events): (Vec<Replier>, Vec<Event>),
    full: bool,
) {
    let epoch = state.log.epoch() + 1;
    let token_reserved = wal::reserve_tokens(state.next_token);
    shared.cache.begin_write(&touched, Some(seq));
    let paused = Instant::now();
    // What is written to the index file so far is synced on another
    // thread while this one applies its buffer and redb prepares the
    // commit (part of the early writeback measured in `writeback.rs`).
    if let Some(early_sync) = &shared.early_sync {
        early_sync();
    }
    let mut open = open;
    let applied = open.apply_pending(&shared.path, &mut state.tally);
    let changes = state.since_checkpoint.add(Changes::of(&open));
    let OpenTxn { mut txn, keys, .. } = open;
    let started = Instant::now();
    let committed = applied.and_then(|()| {
        guard(&shared.path, || {
            let path = &shared.path;
            txn.set_durability(redb::Durability::Immediate)
                .map_err(|e| map_err(path, e))?;
            txn.set_quick_repair(true);
            let ck = Checkpoint {
                epoch,
                base: seq,
                clean: false,
                token_reserved,
            };
            schema::write_checkpoint(path, &txn, ck)?;
            let hwm = match shared.held_time {
                Some((hwm, _)) => hwm,
                None => shared.clock.high_water_ms().max(state.time_reserved),
            };
            schema::write_clock_hwm(path, &txn, hwm)?;
            schema::write_tally(path, &txn, state.tally)?;
            record_damage(shared, &txn)?;
            txn.commit().map_err(|e| map_err(path, e))
        })
    });
    if let Err(err) = committed {
        shared.index_failed.store(true, Ordering::SeqCst);
        shared.poison(&err, true);
        fail_all(replies, &err);
        return;
    }
    state.last_seq = seq;
    state.token_reserved = token_reserved;
    shared.owe_sweep(evictions_share(paused.elapsed(), changes));
    state.since_checkpoint = Changes::default();
    shared.progress.committed.store(seq, Ordering::SeqCst);
    let early = shared.progress.checkpointed(seq, shared);
    shared.cache.end_write(&keys, seq);
    // This batch was made durable by the checkpoint itself, with the
    // earlier ones it covered.
    let writes = writes(&replies).saturating_add(early);
    shared.counters.group_commit(started.elapsed(), writes);
    answer(
        shared,
        vec![Parked {
            dep: seq,
            seq,
            keys: touched,
            replies,
            events,
            bound: state.time_reserved,
        }],
    );
    if let Err(err) = state.log.wrap(epoch, full) {
        shared.poison(&err, false);
    }
    // The writer's whole pause: applying its buffered changes, the durable
    // commit with its syncs of the index, answering the batch's callers and
    // starting the log over (growing it when it was full).
    tracing::debug!(
        target: "idemstore::checkpoint",
        path = %shared.path.display(),
        seq,
        epoch,
        full,
        took_ms = u64::try_from(paused.elapsed().as_millis()).unwrap_or(u64::MAX),
        "checkpoint"
    );
}

/// Records the damage marker in `txn` while the store is damaged (see
/// `schema::META_DAMAGE_MARKER`).
fn record_damage(shared: &Shared, txn: &redb::WriteTransaction) -> Result<()> {
    match &shared.damage_marker {
        Some(marker) if shared.damaged.load(Ordering::SeqCst) => {
            schema::record_damage_marker(&shared.path, txn, marker)
        }
        _ => Ok(()),
    }
}

/// The closing checkpoint, when the queue is drained: the index then holds
/// everything on disk and the log is not needed to open the store again.
///
/// A poisoned store (or one whose last frames cannot be made durable) gets
/// no closing checkpoint, and its index file is fenced: the index may hold
/// changes whose callers got an error, and neither this checkpoint nor
/// redb's own close may make them durable (DESIGN.md guarantee 6). The next
/// open recovers from the last checkpoint and the log.
///
/// A store the scrub found damaged gets its closing checkpoint without its
/// last verification, so that every later open runs the full check.
fn close(shared: &Shared, state: &mut WriterState) {
    // Every frame written must be durable before a checkpoint may cover it:
    // a frame whose fsync fails now poisons the store here.
    let synced = shared.progress.flush();
    if shared.index_failed.load(Ordering::SeqCst)
        || shared.poisoned.load(Ordering::SeqCst)
        || synced.is_err()
    {
        state.open = None;
        shared.fence.raise();
        return;
    }
    let path = &shared.path;
    let open = state.open.take();
    let started = Instant::now();
    let done = guard(path, || {
        let mut txn = match open {
            Some(mut open) => {
                open.apply_pending(path, &mut state.tally)?;
                open.txn
            }
            None => shared.db.begin_write().map_err(|e| map_err(path, e))?,
        };
        txn.set_durability(redb::Durability::Immediate)
            .map_err(|e| map_err(path, e))?;
        txn.set_quick_repair(true);
        let ck = Checkpoint {
            epoch: state.log.epoch() + 1,
            base: state.last_seq,
            clean: true,
            token_reserved: state.next_token,
        };
        schema::write_checkpoint(path, &txn, ck)?;
        schema::write_tally(path, &txn, state.tally)?;
        // A store the scrub found damaged forgets its last verification,
        // so that every later open, by whatever path, runs the full
        // integrity check (a clean close lets a recent one skip it).
        if shared.damaged.load(Ordering::SeqCst) {
            schema::forget_verification(path, &txn)?;
        }
        record_damage(shared, &txn)?;
        // Every time an answer was based on is at most the high-water mark
        // (reads reserve time through the writer, so it is within the last
        // bound); the floor-based time tells the next open which part of
        // its start time is still being caught up (see `crate::clock`).
        // A read-only store writes back the bounds its open found.
        let (hwm, floor) = shared
            .held_time
            .unwrap_or_else(|| (shared.clock.high_water_ms(), shared.clock.floor_ms()));
        schema::write_clean_clock(path, &txn, hwm, floor)?;
        txn.commit().map_err(|e| map_err(path, e))
    });
    match done {
        Ok(()) => {
            shared
                .progress
                .committed
                .store(state.last_seq, Ordering::SeqCst);
            // Buffered writes made durable by the closing checkpoint.
            let writes = shared.progress.checkpointed(state.last_seq, shared);
            shared.counters.group_commit(started.elapsed(), writes);
        }
        Err(err) => {
            tracing::error!(path = %path.display(), error = %err, "closing checkpoint failed; the log will be replayed at the next open");
        }
    }
}

/// Decides one command through `tables`. The outer `Err` is a storage
/// failure of the whole batch; inner errors are per request and change
/// nothing.
fn decide(
    shared: &Shared,
    tables: &mut Tables<'_>,
    cmd: &Command,
    now: u64,
    token: &mut u64,
    events: &mut Vec<Event>,
) -> Result<Result<Answer>> {
    // Checked here too, not only when a request is submitted: changes
    // already queued (or waiting for room) when the scrub found the damage
    // are refused as well. A checkpoint changes no record and runs, one
    // queued before the damage too: the scrub asks for one to record the
    // damage marker in the store (`Store::checkpoint` submitted after the
    // damage is refused at submission).
    if shared.damaged.load(Ordering::SeqCst)
        && !matches!(
            cmd,
            Command::Commit | Command::Reserve | Command::Checkpoint
        )
    {
        return Ok(Err(shared.refusal()));
    }
    match cmd {
        Command::Op { key, op } => apply_op(shared, tables, key, op, now, token, events),
        Command::Sweep { max, budget, .. } => Ok(Ok(Answer::Evicted(expiry::evict(
            tables, now, *max, *budget, events,
        )?))),
        Command::Many { ops, token_floor } => {
            apply_many(shared, tables, ops, *token_floor, now, token, events)
        }
        Command::Checkpoint => Ok(Ok(Answer::Checkpointed)),
        Command::Commit => Ok(Ok(Answer::Committed)),
        Command::Reserve => Ok(Ok(Answer::Reserved)),
    }
}

/// Raises the token counter to `token_floor` and applies every transition
/// through `tables`, each on its own and in order. Outer `Err`: storage
/// failure.
fn apply_many(
    shared: &Shared,
    tables: &mut Tables<'_>,
    ops: &[(Key, Op)],
    token_floor: u64,
    now: u64,
    next_token: &mut u64,
    events: &mut Vec<Event>,
) -> Result<Result<Answer>> {
    *next_token = (*next_token).max(token_floor);
    let mut replies = Vec::with_capacity(ops.len());
    for (key, op) in ops {
        let reply = match apply_op(shared, tables, key, op, now, next_token, events)? {
            Ok(Answer::Reply(reply)) => Ok(reply),
            Ok(_) => Err(Error::Storage(
                "a transition answered with another reply".into(),
            )),
            Err(e) => Err(e),
        };
        replies.push(reply);
    }
    Ok(Ok(Answer::Many(replies)))
}

/// Applies one transition through `tables`, with its business-key binding
/// and expiry index entry in the same write, and collects its audit event.
/// Outer `Err`: storage failure.
fn apply_op(
    shared: &Shared,
    tables: &mut Tables<'_>,
    key: &Key,
    op: &Op,
    now: u64,
    next_token: &mut u64,
    events: &mut Vec<Event>,
) -> Result<Result<Answer>> {
    let kb = key.to_bytes();
    let stored = match read_record(tables, &kb)? {
        Ok(r) => r,
        Err(e) => return Ok(Err(rejected(key, e, events))),
    };
    // Time never runs backwards for a record, as in the PostgreSQL engine:
    // a record imported from a clock that ran ahead is judged and written
    // at its own last update at least, so its times stay in order
    // (created ≤ updated) and the store's export imports again.
    let now = stored.as_ref().map_or(now, |r| now.max(r.updated_ms));
    // The business-key rule needs the binding's holder, read in this write.
    let fresh = stored.as_ref().is_none_or(|r| r.is_expired_at(now));
    let holder = match op_business_key(op).filter(|_| fresh) {
        Some(bk) => match business_holder(tables, key, bk)? {
            Ok(h) => h,
            Err(e) => return Ok(Err(rejected(key, e, events))),
        },
        None => None,
    };
    let ctx = Ctx {
        now_ms: now,
        retention_ms: shared.retention_ms,
        next_token: *next_token,
        business_holder: holder.as_ref(),
    };
    let (effect, reply) = match transition(key, stored.as_ref(), op, &ctx) {
        Ok(x) => x,
        Err(e) => return Ok(Err(rejected(key, e, events))),
    };
    // A new token must stay below the cap: refused before anything is
    // applied, so the counter never wraps.
    let acquires = matches!(reply, Reply::Claim(ClaimOutcome::Acquired(_)));
    let after = next_token.checked_add(1).filter(|t| *t <= MAX_TOKEN);
    if acquires && after.is_none() {
        let err = Error::TokensExhausted {
            next_token: *next_token,
        };
        return Ok(Err(rejected(key, err, events)));
    }
    match &effect {
        Effect::None => {}
        Effect::Put(new) => {
            // Records in flight are indexed under a tagged deadline
            // (`schema::expiry_slot`).
            let slot = schema::expiry_slot(new.state, new.expires_ms);
            if let Some(old) = &stored {
                let old_slot = schema::expiry_slot(old.state, old.expires_ms);
                if old_slot != slot {
                    tables.remove_expiry(old_slot, &kb)?;
                }
            }
            // Written even when the deadline is unchanged: a missing entry
            // (which the scrub warns of) comes back at the next change.
            tables.insert_expiry(slot, &kb)?;
            tables.put_record(&kb, &codec::encode_record(&kb, new))?;
            rebind(tables, key, stored.as_ref(), new, fresh)?;
            if let Some(h) = taken_from(holder.as_ref(), new, now) {
                let hkb = h.key.to_bytes();
                tables.remove_expiry(schema::expiry_slot(h.state, h.expires_ms), &hkb)?;
                tables.remove_record(&hkb)?;
                events.push(Event::evicted(h));
            }
            if let (true, Some(after)) = (acquires, after) {
                *next_token = after;
            }
        }
        Effect::Delete => {
            if let Some(old) = &stored {
                tables.remove_expiry(schema::expiry_slot(old.state, old.expires_ms), &kb)?;
                if let Some(bk) = &old.business_key {
                    unbind(tables, &key.business_binding(bk), &kb)?;
                }
            }
            tables.remove_record(&kb)?;
        }
    }
    events.extend(Event::of_transition(
        key,
        stored.as_ref(),
        op,
        &effect,
        &reply,
        now,
    ));
    Ok(Ok(Answer::Reply(reply)))
}

/// Notes the audit event of a refused request and hands the error back.
fn rejected(key: &Key, err: Error, events: &mut Vec<Event>) -> Error {
    events.extend(Event::of_error(key, &err));
    err
}

/// Reads and decodes the record stored under `kb`. Outer `Err`: storage
/// failure; inner: a corrupt record.
fn read_record(tables: &Tables<'_>, kb: &[u8]) -> Result<Result<Option<Record>>> {
    Ok(match tables.get_record(kb)? {
        Some(v) => codec::decode_record(kb, &v).map(Some),
        None => Ok(None),
    })
}

/// The business key a request would bind, if any.
fn op_business_key(op: &Op) -> Option<&str> {
    match op {
        Op::Claim { business_key, .. } => business_key.as_deref(),
        Op::Import { record } => record.business_key.as_deref(),
        _ => None,
    }
}

/// The record that the binding of `business_key` in `key`'s scope names,
/// if any (live or not: the transition judges). Outer `Err`: storage
/// failure; inner: the holder's record is corrupt.
fn business_holder(
    tables: &Tables<'_>,
    key: &Key,
    business_key: &str,
) -> Result<Result<Option<Record>>> {
    match tables.get_business(&key.business_binding(business_key))? {
        Some(hkb) if hkb != key.to_bytes() => read_record(tables, &hkb),
        _ => Ok(Ok(None)),
    }
}

/// Keeps the business-key binding in step with a put of `new` over `old`:
/// a record that appears (or replaces one past retention) binds its
/// business key; a replaced record's other business key is unbound.
fn rebind(
    tables: &mut Tables<'_>,
    key: &Key,
    old: Option<&Record>,
    new: &Record,
    fresh: bool,
) -> Result<()> {
    let old_bk = old.and_then(|o| o.business_key.as_deref());
    let new_bk = new.business_key.as_deref();
    let kb = key.to_bytes();
    if let Some(ob) = old_bk.filter(|ob| Some(*ob) != new_bk) {
        unbind(tables, &key.business_binding(ob), &kb)?;
    }
    if let Some(nb) = new_bk.filter(|nb| fresh || old_bk != Some(*nb)) {
        tables.put_business(&key.business_binding(nb), &kb)?;
    }
    Ok(())
}

/// Removes the binding `binding` if it still names the record `kb` (a
/// binding taken over by another key after this record's retention ended
/// is left alone).
pub(crate) fn unbind(tables: &mut Tables<'_>, binding: &[u8], kb: &[u8]) -> Result<()> {
    if tables.get_business(binding)?.is_some_and(|v| v == kb) {
        tables.remove_business(binding)?;
    }
    Ok(())
}

/// The syncer: makes written frames durable and answers the batches that
/// waited for them (through the waker when there are many).
fn sync_loop(
    shared: &Shared,
    log: &dyn LogFile,
    waker: &std::sync::mpsc::Sender<Vec<Parked>>,
    nudge: &SyncSender<Msg>,
) {
    let _gone = SyncerGone(shared, nudge);
    let p = &shared.progress;
    loop {
        let target = {
            let mut st = p.state.lock();
            loop {
                if st.failed.is_some() {
                    return;
                }
                if st.written > st.synced && !st.writer_syncing {
                    if let Durability::Buffered { max_delay } = shared.durability
                        && !st.flush_now
                        && !st.writer_done
                    {
                        let since = *st.unsynced_since.get_or_insert_with(Instant::now);
                        let deadline = since + max_delay;
                        if Instant::now() < deadline {
                            p.work.wait_until(&mut st, deadline);
                            continue;
                        }
                    }
                    break;
                }
                if st.writer_done {
                    return;
                }
                p.work.wait(&mut st);
            }
            st.flush_now = false;
            st.written
        };
        let started = Instant::now();
        let result = log.sync_data();
        let fsync = started.elapsed();

        match result {
            Ok(()) => {
                let (ready, early) = {
                    let mut st = p.state.lock();
                    let ready = p.advance(&mut st, target);
                    st.unsynced_since = (st.written > st.synced).then_some(started);
                    (ready, std::mem::take(&mut st.durable_writes))
                };
                // The writer may be holding a batch open until the disk is
                // free; if the queue is full it has work anyway.
                let _ = nudge.try_send(Msg::Nudge);
                let callers: usize = ready.iter().map(|p| p.replies.len()).sum();
                let writes = ready.iter().map(|p| writes(&p.replies)).sum::<usize>();
                shared.synced(
                    started.elapsed(),
                    fsync,
                    callers,
                    writes.saturating_add(early),
                );
                if callers <= WAKE_INLINE {
                    answer(shared, ready);
                } else if let Err(unsent) = waker.send(ready) {
                    answer(shared, unsent.0);
                }
            }
            Err(e) => {
                let err = Error::Storage(format!(
                    "{}: log fsync failed: {e}",
                    shared.log_path.display()
                ));
                shared.poison(&err, false);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(all: u64, evicted: u64) -> Changes {
        Changes { all, evicted }
    }

    /// A commit's time is owed by its evictions in proportion to the
    /// evictions among its record changes; none when it evicted nothing,
    /// all of it when it only evicted; never more than all of it, never
    /// overflowing.
    #[test]
    fn evictions_owe_their_share_of_a_commit() {
        let ms = Duration::from_millis;
        assert_eq!(evictions_share(ms(100), changes(0, 0)), Duration::ZERO);
        assert_eq!(evictions_share(ms(100), changes(7, 0)), Duration::ZERO);
        assert_eq!(evictions_share(ms(100), changes(7, 7)), ms(100));
        assert_eq!(evictions_share(ms(100), changes(4, 1)), ms(25));
        assert_eq!(evictions_share(ms(100), changes(4, 9)), ms(100));
        assert_eq!(evictions_share(ms(100), changes(0, 9)), Duration::ZERO);
        assert_eq!(
            evictions_share(Duration::ZERO, changes(4, 1)),
            Duration::ZERO
        );
        assert_eq!(
            evictions_share(Duration::MAX, changes(u64::MAX, u64::MAX / 2)),
            Duration::from_nanos(u64::MAX / 2)
        );
    }
}
