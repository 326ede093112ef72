//! The embedded engine: one redb file (the index) and a write-ahead log
//! beside it, a writer thread that group-commits every change, and a cache
//! of finished records for replays. `docs/design.md` has the formats and
//! the crash analysis.
//!
//! Everything here is behind the engine boundary ([`crate::engine`]):
//! validation, the pure transition, audit events, the record codec and the
//! export/import framing are not this module's; it stores and reads.

pub(crate) mod cache;
pub(crate) mod check;
pub(crate) mod commit;
pub(crate) mod compact;
pub(crate) mod congestion;
pub(crate) mod create;
pub(crate) mod expiry;
pub(crate) mod expiry_counts;
pub(crate) mod fence;
pub(crate) mod overlay;
pub(crate) mod pending;
pub(crate) mod salvage;
pub(crate) mod schema;
pub(crate) mod scrub;
pub(crate) mod wal;
#[cfg(target_os = "linux")]
pub(crate) mod writeback;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use redb::{ReadOnlyTable, ReadableDatabase};

use crate::audit::Event;
use crate::clock::{StoreClock, TIME_RESERVATION, duration_ms};
use crate::codec::{self, Entries, Entry};
use crate::config::{Config, Durability};
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::{ClaimOutcome, Ctx, Effect, ImportResult, Op, Record, Reply, Sent, transition};
use crate::report::Progress;
use crate::report::{CheckReport, ScrubReport};
use crate::stats::LiveCounters;
use cache::{Lookup, ReadCache, StoredKey};
use commit::{Answer, Command, Completion, Progress as WriteProgress, Shared, Writer, WriterState};
use fence::Fence;
use schema::{RECORDS, guard, map_err};
use wal::{FileLog, LogFile};

/// How many requests may wait for the embedded engine's writer (in
/// requests). Beyond it callers wait for room (back-pressure): the
/// blocking methods block, the `*_async` methods are pending without
/// blocking their executor.
pub const WRITER_QUEUE_BOUND: usize = commit::QUEUE_BOUND;

/// The size the write-ahead log may be configured to at least
/// ([`Config::max_log_bytes`]), in bytes.
pub(crate) use wal::MIN_LOG_BYTES;

/// The embedded engine of one open store.
pub(crate) struct Embedded {
    shared: Arc<Shared>,
    writer: Writer,
    /// Where the online scrub stands (see [`scrub`]).
    scrub: Mutex<scrub::Cursor>,
    /// Whether this open created the store (see `schema::Meta::created`).
    created: bool,
    /// Opened with `Config::accept_log_loss` only: what of the write-ahead
    /// log recovery needed could not be replayed (see `wal::Opened`).
    log_lost: Option<String>,
}

/// What a read outside the writer found.
enum Read {
    /// The record (or its absence), durable in `Immediate` mode; shared
    /// with the cache when it came from there.
    Done(Option<Arc<Record>>),
    /// The key has a change that may not be durable yet, in this batch.
    Pending(u64),
}

/// A read snapshot of the index whose changes are all acknowledged (and,
/// with [`Durability::Immediate`], durable): what scans, stats, export and
/// verify read.
pub(crate) struct Snapshot {
    path: PathBuf,
    txn: redb::ReadTransaction,
}

/// The `<path>-wal` name of a store file's write-ahead log.
pub(crate) fn log_path_of(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

/// The write-ahead log of the store file at `path`: [`log_path_of`] the
/// file's canonical path ([`identity_of`]), so that every spelling of the
/// file (a relative path from another directory, a symlink to it or to a
/// directory on its path) writes and recovers the same log. A hard link is
/// another name no canonical path leads back from: the store records the
/// log it writes (`schema::META_LOG_PATH`), and an open by another name
/// after an unclean shutdown refuses while that log holds changes
/// ([`refuse_stray_log`]).
pub(crate) fn log_path_of_file(path: &Path) -> PathBuf {
    log_path_of(&identity_of(path))
}

/// The canonical path of the file at `path` (symlinks, `.` and `..`
/// resolved). A file that does not exist yet is named by its canonical
/// directory and its file name; a path that cannot be resolved at all, by
/// its absolute spelling.
pub(crate) fn identity_of(path: &Path) -> PathBuf {
    if let Ok(canonical) = std::fs::canonicalize(path) {
        return canonical;
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent(), absolute.file_name()) {
        (Some(dir), Some(name)) => match std::fs::canonicalize(dir) {
            Ok(dir) => dir.join(name),
            Err(_) => absolute,
        },
        _ => absolute,
    }
}

/// After an unclean shutdown, refuses to open the store at `path` with
/// the log at `log_path` when that log holds none of the changes its index
/// lacks and another log of this store does: the frames written since the
/// last checkpoint are in the log the store last wrote, and an open that
/// recovered from another one would lose them (acknowledged claims and
/// completions: the work would run again), then start a new epoch that
/// hides them for good. Nothing is looked at when this open's own log
/// holds such frames (a copy or a move of the store with its log). The
/// other logs looked at are the one the store records
/// (`schema::META_LOG_PATH`: a hard link's) and the one beside `path` as
/// spelled (an older build named the log so). One that does not exist,
/// cannot be opened, is not this store's, or holds no frame past the
/// index is passed over; one whose frames past the checkpoint cannot be
/// read may hold changes, and refuses too.
///
/// A salvage's copy (`salvaged`: the original store file it was copied
/// from, whose log was copied beside it) is judged as the original: its
/// log is the original's, which may be damaged (the salvage takes that
/// loss), and every other log is looked at.
///
/// # Errors
/// [`Error::IncompatibleFile`] naming the other log and how to move it
/// into place; [`Error::CorruptFile`] or [`Error::Storage`] when the index
/// cannot be read.
fn refuse_stray_log(
    path: &Path,
    log_path: &Path,
    db: &redb::Database,
    meta: &schema::Meta,
    salvaged: Option<&Path>,
) -> Result<()> {
    if salvaged.is_none() && holds_changes(log_path, meta, false) == Some(true) {
        return Ok(());
    }
    let mut others = vec![log_path_of(path)];
    match schema::recorded_log_path(path, db)? {
        Ok(Some(recorded)) => others.push(recorded),
        Ok(None) => {}
        Err(malformed) => tracing::warn!(path = %path.display(), "{malformed}: ignored"),
    }
    // A salvage's copy stands for the original store and its log; the
    // copy's own log is passed over too (its frames are the original's).
    let copy_log = identity_of(log_path);
    let (path, ours) = match salvaged {
        Some(original) => {
            others.push(log_path_of(original));
            (original, identity_of(&log_path_of_file(original)))
        }
        None => (path, copy_log.clone()),
    };
    for other in others {
        let id = identity_of(&other);
        if id == ours || id == copy_log || holds_changes(&other, meta, true) != Some(true) {
            continue;
        }
        // The file the other log was written beside: this one by another
        // name (a hard link, a symlink an older build named the log
        // after), or another file with this store's identity (this one
        // is a copy of it, made without its log).
        let beside = other
            .to_str()
            .and_then(|s| s.strip_suffix("-wal"))
            .map(PathBuf::from);
        let detail = match beside {
            Some(file) if !same_file(&file, path) && std::fs::metadata(&file).is_ok() => format!(
                "this log, beside {file}, holds changes since the last checkpoint of the store \
                 this file is a copy of (made without its log), and this open's log, {ours}, \
                 holds none of them: open {file} itself, or copy this log to {ours} while \
                 {file} is not running (never move it: it is that store's)",
                file = file.display(),
                ours = ours.display()
            ),
            _ => format!(
                "this log holds the store's changes since its last checkpoint (the store \
                 stopped without closing while opened by another name), and this open's log, \
                 {ours}, holds none of them: recovering from it would lose them; move this \
                 log into place (`mv {} {ours}`) and open the store again",
                other.display(),
                ours = ours.display()
            ),
        };
        return Err(Error::IncompatibleFile {
            path: other.clone(),
            detail,
        });
    }
    Ok(())
}

/// Whether `a` and `b` name the same file (device and inode on Unix;
/// elsewhere, the same canonical path). Either missing: no.
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        }
    }
}

/// Whether the log at `log` holds frames of the store's current epoch
/// past what its index applied (`meta`): `None` when it does not exist,
/// is not a regular file, is empty, cannot be opened or read, or belongs
/// to another store; when its frames past the checkpoint cannot be read
/// (they may be such changes), `unreadable` (`true` for another name's
/// log, which then refuses; `false` for the open's own, so that the other
/// logs are still looked at).
fn holds_changes(log: &Path, meta: &schema::Meta, unreadable: bool) -> Option<bool> {
    if !std::fs::metadata(log).is_ok_and(|m| m.is_file() && m.len() > 0) {
        return None;
    }
    let file = FileLog::read_only(log).ok()?;
    match wal::read_header(&file) {
        Ok(wal::HeaderState::Valid { store_id }) if store_id == meta.store_id => {}
        _ => return None,
    }
    Some(
        wal::recover(
            &file,
            log,
            meta.store_id,
            meta.log_epoch,
            meta.log_base,
            false,
        )
        .map_or(unreadable, |found| found.count_after(meta.applied_seq) > 0),
    )
}

/// Refuses a missing or empty file, or one that is not a regular file
/// (for tools that must not create a store).
pub(crate) fn check_existing(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Missing {
            path: path.to_path_buf(),
        }),
        Ok(m) if !m.is_file() => Err(not_regular(path, "store", &m)),
        Ok(m) if m.len() == 0 => Err(Error::IncompatibleFile {
            path: path.to_path_buf(),
            detail: "the file is empty (not an idemstore file)".into(),
        }),
        // Other metadata errors (permissions) surface from the open itself.
        _ => Ok(()),
    }
}

/// Refuses a `path` that exists and is not a regular file (after
/// symlinks): a directory, a fifo, a socket or a device cannot hold a store
/// or its log, and writing one (a fifo, `/dev/null`) would lose it. Checked
/// before anything is created, so nothing appears beside it. A path that
/// does not exist, or whose metadata cannot be read, is left to the open.
fn require_regular(path: &Path, what: &str) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(not_regular(path, what, &m)),
        _ => Ok(()),
    }
}

/// Refuses to create a store at `path` beside a non-empty log (`log_path`:
/// any log a store has used, even after a clean close, since a log starts
/// with its header) when no store file is there, or only an empty one
/// (which the open would make a new store): a log is created only after
/// its store file, so such a log belongs to a store that was deleted or
/// moved, and a new store beside it would never open (the log names
/// another store). Checked before anything is created. A store file with
/// content, or a log that is absent or empty, passes.
fn refuse_orphan_log(path: &Path, log_path: &Path) -> Result<()> {
    let store_absent = match std::fs::symlink_metadata(path) {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        // Through a symlink, the file it names.
        Ok(_) => std::fs::metadata(path).is_ok_and(|m| m.len() == 0),
    };
    match std::fs::metadata(log_path) {
        Ok(m) if store_absent && m.len() > 0 => Err(Error::IncompatibleFile {
            path: log_path.to_path_buf(),
            detail: format!(
                "a write-ahead log with no store file beside it ({} is missing or empty): its \
                 store was deleted or moved, so no new store is created here; put the store \
                 file back, or remove the log once it is known to hold nothing needed",
                path.display()
            ),
        }),
        _ => Ok(()),
    }
}

/// The error for a `what` (`store` or `write-ahead log`) at `path` that is
/// not a regular file.
fn not_regular(path: &Path, what: &str, meta: &std::fs::Metadata) -> Error {
    let kind = if meta.is_dir() {
        "a directory"
    } else {
        "a fifo, socket or device"
    };
    Error::IncompatibleFile {
        path: path.to_path_buf(),
        detail: format!("not a regular file ({kind}); a {what} file must be one"),
    }
}

impl Embedded {
    /// Opens (or creates) the store at `path` with its log at `log_path`,
    /// on `backend` and `log` when given, else on files. `config` has been
    /// validated for what every engine shares; this checks the embedded
    /// engine's own settings.
    pub(crate) fn open<B: redb::StorageBackend>(
        path: PathBuf,
        log_path: PathBuf,
        backend: Option<B>,
        log: Option<Arc<dyn LogFile>>,
        config: Config,
    ) -> Result<Embedded> {
        if config.max_log_bytes < MIN_LOG_BYTES {
            return Err(Error::invalid(
                "max_log_bytes",
                format!("must be at least {MIN_LOG_BYTES} bytes"),
            ));
        }
        let interval_ms = match config.integrity_check_interval {
            Some(d) if duration_ms(d) == 0 => {
                return Err(Error::invalid(
                    "integrity_check_interval",
                    "must be at least 1 ms; None checks at every open",
                ));
            }
            other => other.map(duration_ms),
        };
        let policy = schema::IntegrityPolicy {
            interval_ms,
            wall_ms: config.clock.now_ms(),
        };
        let file_backed = backend.is_none();
        if file_backed {
            require_regular(&path, "store")?;
        }
        if log.is_none() {
            require_regular(&log_path, "write-ahead log")?;
        }
        if file_backed && log.is_none() {
            refuse_orphan_log(&path, &log_path)?;
        }
        // The marker applies to the file it was left beside: only to a
        // store file that exists (a new store at the path is not damaged).
        let marker = file_backed.then(|| scrub::marker_of_store(&path));
        let marked = match &marker {
            Some(marker) if std::fs::symlink_metadata(&path).is_ok() => scrub::is_marked(marker),
            Some(marker) => {
                scrub::set_aside_stale(marker, config.clock.now_ms());
                false
            }
            None => false,
        };
        let fence = Fence::default();
        let (db, meta, early_sync) = schema::open(
            &path,
            backend,
            config.cache_bytes,
            &fence,
            policy,
            config.read_only,
        )?;
        // The marker the store itself names, found by whatever path the
        // file was opened (a hard link too): see `schema::META_DAMAGE_MARKER`.
        let (marker, marked) = match schema::recorded_damage_marker(&path, &db)? {
            _ if marked => (marker, true),
            Ok(Some(recorded)) if scrub::is_present(&recorded) => (Some(recorded), true),
            Ok(_) => (marker, false),
            Err(malformed) => {
                tracing::warn!(path = %path.display(), "{malformed}: ignored");
                (marker, false)
            }
        };
        let log_is_file = log.is_none();
        if file_backed && log_is_file && !meta.clean {
            refuse_stray_log(
                &path,
                &log_path,
                &db,
                &meta,
                config.accept_log_loss.as_deref(),
            )?;
        }
        // The log file is opened (or created) only once the index is known
        // to be this store's and held by this process.
        let (log, log_fresh): (Arc<dyn LogFile>, bool) = match log {
            Some(log) => (log, true),
            None => {
                let file = FileLog::open(&log_path).map_err(|e| match e.kind() {
                    // Its store file was replaced (a copy moved over it)
                    // under the store that holds this log.
                    std::io::ErrorKind::WouldBlock => Error::AlreadyOpen {
                        path: log_path.clone(),
                    },
                    _ => {
                        Error::Storage(format!("{}: cannot open the log: {e}", log_path.display()))
                    }
                })?;
                let fresh = file.fresh();
                (Arc::new(file), fresh)
            }
        };
        // Created by this open: the metadata initialised here, or the file
        // linked into place here and no store's log beside it yet (another
        // process that opened the new file first, between the link and
        // this open's lock, wrote its log's header).
        let created = meta.created || (meta.linked && log_fresh);
        // The store's time starts from the persisted bound. After an unclean
        // shutdown up to `TIME_RESERVATION` of it may be reservation, not
        // use: that part is caught up at half rate (see `crate::clock`).
        let (opened, (clock, start, held_time)) = wal::open(
            &db,
            &path,
            &log_path,
            log.clone(),
            &meta,
            config.max_log_bytes,
            (file_backed && log_is_file).then_some(log_path.as_path()),
            config.accept_log_loss.is_some(),
            |clock_hwm| {
                let floor = if meta.clean {
                    meta.clock_floor.unwrap_or(clock_hwm)
                } else {
                    clock_hwm.saturating_sub(duration_ms(TIME_RESERVATION))
                };
                let clock = StoreClock::new(config.clock.clone(), clock_hwm, floor);
                if config.read_only {
                    // The bounds found are written back as they are.
                    return (clock_hwm, (clock, clock_hwm, Some((clock_hwm, floor))));
                }
                // A first reservation, durable (in the log's new checkpoint)
                // before the store answers anything.
                let start = clock.reservation(clock.now_ms());
                (start, (clock, start, None))
            },
        )?;
        // A store of an older format is migrated once its log is replayed
        // (the log was written in that format), before anything is answered.
        if meta.format < schema::FORMAT_VERSION {
            schema::migrate(&path, &db, meta.format)?;
        }
        if opened.replayed > 0 {
            tracing::info!(path = %path.display(), frames = opened.replayed, "replayed the write-ahead log");
        }
        let log_lost = opened.log_lost.clone();
        if let Some(lost) = &log_lost {
            tracing::warn!(path = %path.display(), log = %log_path.display(), "opened without what the write-ahead log lost: {lost}");
        }
        let shared = Arc::new(Shared {
            db: Arc::new(db),
            path,
            log_path,
            clock,
            time_durable: AtomicU64::new(start),
            held_time,
            renewing: AtomicU64::new(0),
            retention_ms: duration_ms(config.retention),
            durability: config.durability,
            poisoned: AtomicBool::new(false),
            damaged: AtomicBool::new(marked),
            counters: LiveCounters::new(),
            index_failed: AtomicBool::new(false),
            progress: WriteProgress::new(opened.last_seq),
            cache: ReadCache::new(config.read_cache_bytes),
            sync_inline: AtomicBool::new(true),
            fence,
            sweep_debt_ns: AtomicU64::new(0),
            log_latency: parking_lot::Mutex::new(congestion::LogLatency::default()),
            early_sync,
            damage_marker: marker,
        });
        if marked {
            // The marker's remedy stays the cause, whatever fails later.
            shared.note_damage();
        }
        let state = WriterState::new(
            opened.next_token,
            opened.token_reserved,
            opened.last_seq,
            start,
            opened.writer,
        );
        let writer = Writer::start(shared.clone(), state, log)?;
        if marked {
            tracing::error!(
                path = %shared.path.display(),
                marker = ?shared.damage_marker,
                "the online scrub marked this store damaged: it opens read-only (writes get Poisoned) while the marker exists"
            );
        }
        Ok(Embedded {
            shared,
            writer,
            scrub: Mutex::default(),
            created,
            log_lost,
        })
    }

    /// What of the write-ahead log recovery needed could not be replayed
    /// (an open with `Config::accept_log_loss` only; `None` otherwise and
    /// when nothing was lost).
    pub(crate) fn log_lost(&self) -> Option<&str> {
        self.log_lost.as_deref()
    }

    /// The store file.
    pub(crate) fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Whether this open created the store.
    pub(crate) fn was_created(&self) -> bool {
        self.created
    }

    /// The write-ahead log beside the store file.
    pub(crate) fn log_path(&self) -> &Path {
        &self.shared.log_path
    }

    /// The counters behind `Store::stats`.
    pub(crate) fn counters(&self) -> &LiveCounters {
        &self.shared.counters
    }

    /// The store file's size from the file system (`None` on a custom
    /// backend or when it cannot be read).
    pub(crate) fn file_bytes(&self) -> Option<u64> {
        std::fs::metadata(&self.shared.path).ok().map(|m| m.len())
    }

    fn submit(&self, cmd: Command) -> Completion {
        if let Some(err) = self.refusal_of(&cmd) {
            return Completion::Ready(Err(err));
        }
        self.writer.submit(cmd)
    }

    /// The answer to `cmd` when it is refused before reaching the writer:
    /// [`Embedded::refuses`], else a change on a read-only store.
    fn refusal_of(&self, cmd: &Command) -> Option<Error> {
        if self.refuses(cmd) {
            return Some(self.shared.refusal());
        }
        self.shared.held_time?;
        let operation = match cmd {
            Command::Op { op, .. } => op.name(),
            Command::Many { ops, .. } => ops.first().map_or("claim_many", |(_, op)| op.name()),
            Command::Sweep { .. } => "sweep",
            Command::Reserve => "a time reservation",
            Command::Commit | Command::Checkpoint => return None,
        };
        Some(self.read_only(operation))
    }

    /// [`Error::ReadOnly`] for `operation`.
    fn read_only(&self, operation: &'static str) -> Error {
        Error::ReadOnly {
            path: self.shared.path.clone(),
            operation,
        }
    }

    /// Refuses `op` on a read-only store, before a claim's fast path
    /// (which answers replays without the writer) could answer it.
    fn refuse_read_only(&self, op: &Op) -> Result<()> {
        match self.shared.held_time {
            Some(_) => Err(self.read_only(op.name())),
            None => Ok(()),
        }
    }

    /// Whether `cmd` is refused: every command after a failed durable write;
    /// the writes (changes of records, sweeps, `Store::checkpoint`) on a
    /// store the scrub found damaged, whose commits of what is already
    /// acknowledged and time reservations still run, so that it keeps
    /// answering reads, scans and exports. The writer checks the same again
    /// for requests queued before the damage was found.
    fn refuses(&self, cmd: &Command) -> bool {
        self.shared.poisoned.load(Ordering::SeqCst)
            || (self.shared.damaged.load(Ordering::SeqCst)
                && !matches!(cmd, Command::Commit | Command::Reserve))
    }

    fn submit_op(&self, key: &Key, op: Op) -> Completion {
        self.submit(Command::Op {
            key: key.clone(),
            op,
        })
    }

    /// [`Embedded::submit`] from async code: a full queue is awaited.
    async fn submit_async(&self, cmd: Command) -> Completion {
        if let Some(err) = self.refusal_of(&cmd) {
            return Completion::Ready(Err(err));
        }
        self.writer.submit_async(cmd).await
    }

    /// Applies `op` to `key`'s record: a claim that can only replay, report
    /// a valid lease or refuse a fingerprint is answered without the
    /// writer; everything else is decided by the writer, durable when this
    /// returns.
    pub(crate) fn apply(&self, key: &Key, op: Op) -> Result<Reply> {
        self.refuse_read_only(&op)?;
        let op = match op {
            Op::Claim { .. } => match self.claim_fast(key, op, self.time())? {
                Ok(reply) => return Ok(reply),
                Err(op) => op,
            },
            op => op,
        };
        expect_reply(self.submit_op(key, op).wait())
    }

    /// [`Embedded::apply`] from async code: never blocks its executor.
    pub(crate) async fn apply_async(&self, key: &Key, op: Op) -> Result<Reply> {
        match self.send_async(key, op).await? {
            Sent::Answered(reply) => reply,
            Sent::Pending(answer) => answer.await,
        }
    }

    /// The first half of [`Embedded::apply_async`]: answered at once (a
    /// claim's fast path, a refusal), or sent to the writer, whose answer
    /// the returned future owns. Dropped before it returns, nothing was
    /// sent.
    pub(crate) async fn send_async(&self, key: &Key, op: Op) -> Result<Sent> {
        self.refuse_read_only(&op)?;
        let op = match op {
            Op::Claim { .. } => match self.claim_fast(key, op, self.time_async().await)? {
                Ok(reply) => return Ok(Sent::Answered(Ok(reply))),
                Err(op) => op,
            },
            op => op,
        };
        let cmd = Command::Op {
            key: key.clone(),
            op,
        };
        let completion = self.submit_async(cmd).await;
        Ok(Sent::Pending(Box::pin(async move {
            expect_reply(completion.await)
        })))
    }

    /// Queues `op` without waiting for its answer (a best-effort write
    /// whose caller has gone).
    ///
    /// Never decided on the calling thread (it may be an async executor
    /// dropping a response): always queued for the writer thread.
    pub(crate) fn apply_detached(&self, key: &Key, op: Op) {
        let cmd = Command::Op {
            key: key.clone(),
            op,
        };
        if self.refusal_of(&cmd).is_some() {
            return;
        }
        drop(self.writer.submit_queued(cmd));
    }

    /// The store's time for an answer about to be given: the clock's
    /// reading once a bound at least that high is durable (asked of the
    /// writer when it is not yet; see [`crate::clock`]). If the store can
    /// no longer write, the last durable bound when it is lower: answers
    /// are never based on a time a crash could take back.
    pub(crate) fn time(&self) -> u64 {
        let now = self.shared.clock.now_ms();
        let durable = self.shared.time_durable.load(Ordering::SeqCst);
        // A read-only store answers at the clock's reading and persists
        // none: nothing it answers is written.
        if now <= durable || self.shared.held_time.is_some() {
            self.renew_early(now, durable);
            return now;
        }
        match self.submit(Command::Reserve).wait() {
            Ok(_) => now.min(self.shared.time_durable.load(Ordering::SeqCst)),
            Err(_) => now.min(durable),
        }
    }

    /// Asks the writer, without waiting, to renew the time reservation when
    /// `now` comes within half a reservation of the durable bound, so that
    /// later reads find it renewed. At most one such request is in flight.
    fn renew_early(&self, now: u64, durable: u64) {
        let shared = &self.shared;
        if now.saturating_add(commit::RENEW_AHEAD_MS) > durable
            && shared.held_time.is_none()
            && !shared.poisoned.load(Ordering::SeqCst)
            && shared.renewing.load(Ordering::SeqCst) < durable
        {
            shared.renewing.store(durable, Ordering::SeqCst);
            self.writer.submit_detached(Command::Reserve);
        }
    }

    /// [`Embedded::time`] from async code: the reservation is awaited.
    pub(crate) async fn time_async(&self) -> u64 {
        let now = self.shared.clock.now_ms();
        let durable = self.shared.time_durable.load(Ordering::SeqCst);
        if now <= durable || self.shared.held_time.is_some() {
            self.renew_early(now, durable);
            return now;
        }
        match self.submit_async(Command::Reserve).await.await {
            Ok(_) => now.min(self.shared.time_durable.load(Ordering::SeqCst)),
            Err(_) => now.min(durable),
        }
    }

    /// The wall clock's reading (ms since the epoch), for an import's
    /// clock tolerance.
    pub(crate) fn wall_ms(&self) -> u64 {
        self.shared.clock.wall_ms()
    }

    /// The time an export is taken at: the store's time, or on a read-only
    /// store the time bound its open found on disk (a host whose clock is
    /// ahead would leave out records still live for the service, and the
    /// stream's clock mark would be refused on import as ahead).
    pub(crate) fn export_ms(&self) -> u64 {
        match self.shared.held_time {
            Some((hwm, _)) => hwm,
            None => self.time(),
        }
    }

    /// The store's time without a reservation: an import's reference time,
    /// and the idle sweeper's look for a due record (`Engine::any_due`),
    /// which must not write.
    pub(crate) fn clock_ms(&self) -> u64 {
        self.shared.clock.now_ms()
    }

    /// Evicts up to `max_records` records past retention; durable when it
    /// returns.
    pub(crate) fn sweep(&self, max_records: usize) -> Result<usize> {
        self.sweep_step(max_records, None, false).map(|s| s.evicted)
    }

    /// Evicts up to `max_records` records past retention, stopping once
    /// `budget` of the writer's time is spent (see [`expiry::evict`]).
    /// With `early`, returns once the writer decided the slice, before it
    /// is durable (see [`Command::Sweep`]).
    pub(crate) fn sweep_step(
        &self,
        max_records: usize,
        budget: Option<std::time::Duration>,
        early: bool,
    ) -> Result<expiry::Swept> {
        let cmd = Command::Sweep {
            max: max_records,
            budget,
            early,
        };
        match self.submit(cmd).wait()? {
            Answer::Evicted(swept) => Ok(swept),
            _ => Err(Error::Storage(
                "writer answered a sweep with another answer".into(),
            )),
        }
    }

    /// The log's fsync time of the last closed step (a quarter second)
    /// and its lowest step mean of the last minute, as `(current, base)`,
    /// counting only the fsyncs callers waited for; `None` when no step
    /// with enough of them closed lately (see [`congestion`]).
    pub(crate) fn log_latency(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        let latency = self
            .shared
            .log_latency
            .lock()
            .now(std::time::Instant::now())?;
        Some((latency.current, latency.base))
    }

    /// How many records still awaiting eviction had their retention end in
    /// `(from_ms, to_ms]` (finished ones, and claims abandoned in flight),
    /// counting at most `limit`: by the expiry index as last committed
    /// (changes the writer holds in its open index transaction are not
    /// seen), one entry read per record counted. For a sweep's pacing (see
    /// [`crate::sweeper`]).
    pub(crate) fn came_due(&self, from_ms: u64, to_ms: u64, limit: u64) -> Result<u64> {
        use crate::record::State;
        let path = &self.shared.path;
        if to_ms <= from_ms {
            return Ok(0);
        }
        guard(path, || {
            let txn = self.shared.db.begin_read().map_err(|e| map_err(path, e))?;
            let expiry = txn
                .open_table(schema::EXPIRY)
                .map_err(|e| map_err(path, e))?;
            let empty: &[u8] = &[];
            let (from, to) = (from_ms.saturating_add(1), to_ms.saturating_add(1));
            let mut n = 0u64;
            // The lowest slot of an expiry is its Succeeded one among
            // finished records, its only one in flight.
            for state in [State::Succeeded, State::Processing] {
                let (lo, hi) = (
                    schema::expiry_slot(state, from),
                    schema::expiry_slot(state, to),
                );
                for entry in expiry
                    .range((lo, empty)..(hi, empty))
                    .map_err(|e| map_err(path, e))?
                {
                    if n >= limit {
                        return Ok(n);
                    }
                    entry.map_err(|e| map_err(path, e))?;
                    n = n.saturating_add(1);
                }
            }
            Ok(n)
        })
    }

    /// Answers a claim from the cache or a read transaction when it can only
    /// replay, only report a valid lease, or only refuse a fingerprint.
    /// Otherwise (including when the key has a change that is not durable
    /// yet) hands the operation back for the writer.
    fn claim_fast(&self, key: &Key, op: Op, now_ms: u64) -> Result<Result<Reply, Op>> {
        if let Read::Done(Some(current)) = self.read(key, now_ms)? {
            let ctx = Ctx {
                // As the writer judges it (`commit::apply_op`): never
                // before the record's own last update.
                now_ms: now_ms.max(current.updated_ms),
                retention_ms: self.shared.retention_ms,
                next_token: 0,
                // An existing live record keeps its own binding: the
                // business-key rule applies only to a fresh record, which
                // the writer decides.
                business_holder: None,
            };
            match transition(key, Some(&current), &op, &ctx) {
                Ok((Effect::None, Reply::Claim(outcome))) => {
                    // Counted and logged without an event to build: this
                    // is the replay path, which a hash map is the measure of.
                    let replay = matches!(outcome, ClaimOutcome::Replay(_));
                    self.shared.counters.answered(key, replay);
                    return Ok(Ok(Reply::Claim(outcome)));
                }
                Ok(_) => {}
                Err(e) => {
                    self.shared.counters.publish(Event::of_error(key, &e));
                    return Err(e);
                }
            }
        }
        Ok(Err(op))
    }

    /// A read snapshot for the operator's reads (scans, stats, export,
    /// verify): it holds every change acknowledged before this call and,
    /// with [`Durability::Immediate`], nothing that is not yet durable (the
    /// writer may commit a batch to the index while its fsync runs, so this
    /// waits for the durability of whatever the snapshot holds, as
    /// [`Embedded::len`] does).
    pub(crate) fn snapshot(&self) -> Result<Snapshot> {
        self.commit_index()?;
        let shared = &self.shared;
        let path = &shared.path;
        let txn = guard(path, || {
            let txn = shared.db.begin_read().map_err(|e| map_err(path, e))?;
            if shared.durability == Durability::Immediate {
                shared
                    .progress
                    .wait_durable(schema::applied_seq(path, &txn)?)?;
            }
            Ok(txn)
        })?;
        Ok(Snapshot {
            path: path.clone(),
            txn,
        })
    }

    /// Has the writer commit its open index transaction, so that reads see
    /// every change acknowledged before this call.
    fn commit_index(&self) -> Result<()> {
        match self.submit(Command::Commit).wait()? {
            Answer::Committed => Ok(()),
            _ => Err(Error::Storage(
                "writer answered a commit with another answer".into(),
            )),
        }
    }

    /// The record of `key` as durable (in `Immediate` mode). A change in
    /// flight is waited for: its commit to the index is asked of the
    /// writer, its fsync awaited.
    pub(crate) fn get(&self, key: &Key) -> Result<Option<Record>> {
        let now = self.time();
        loop {
            match self.read(key, now)? {
                Read::Done(None) => return self.absent(),
                Read::Done(r) => return Ok(r.map(Arc::unwrap_or_clone)),
                Read::Pending(seq) if self.shared.progress.committed() < seq => {
                    self.commit_index()?;
                }
                Read::Pending(seq) => self.shared.progress.wait_durable(seq)?,
            }
        }
    }

    /// A lookup that found no record: absent, unless the scrub found the
    /// store damaged. Damage to a B-tree branch page can hide a stored key
    /// from lookups, so on such a store an absence is not an answer: a
    /// caller that took it would run the work again elsewhere.
    fn absent(&self) -> Result<Option<Record>> {
        if !self.shared.damaged.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let marker = self.shared.damage_marker.as_deref();
        Err(Error::CorruptFile {
            path: self.shared.path.clone(),
            detail: format!(
                "the online scrub found this store damaged{}: a record it does not find may be \
                 hidden by the damage, so it cannot answer that a key is absent",
                marker.map_or_else(String::new, |m| format!(" (see {})", m.display()))
            ),
        })
    }

    /// [`Embedded::get`] from async code.
    pub(crate) async fn get_async(&self, key: &Key) -> Result<Option<Record>> {
        let now = self.time_async().await;
        loop {
            match self.read(key, now)? {
                Read::Done(None) => return self.absent(),
                Read::Done(r) => return Ok(r.map(Arc::unwrap_or_clone)),
                // The writer answers a commit once everything decided before
                // it is committed to the index and (when gated) durable.
                Read::Pending(_) => match self.submit_async(Command::Commit).await.await? {
                    Answer::Committed => {}
                    _ => {
                        return Err(Error::Storage(
                            "writer answered a commit with another answer".into(),
                        ));
                    }
                },
            }
        }
    }

    /// One read outside the writer at the store's time `now` (from
    /// [`Embedded::time`]): the cache, else a read transaction, then the
    /// durability gate (see [`cache`]).
    fn read(&self, key: &Key, now: u64) -> Result<Read> {
        let shared = &self.shared;
        let path = &shared.path;
        let gated = shared.durability == Durability::Immediate;
        let version =
            match shared
                .cache
                .lookup(StoredKey::of(key), now, shared.progress.visible_upto(gated))
            {
                Lookup::Hit(record) => return Ok(Read::Done(Some(record))),
                Lookup::Pending(seq) => return Ok(Read::Pending(seq)),
                Lookup::Miss(version) => version,
            };
        let kb = key.to_bytes();
        let bytes = guard(path, || {
            let txn = shared.db.begin_read().map_err(|e| map_err(path, e))?;
            let table = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
            let value = table.get(kb.as_slice()).map_err(|e| map_err(path, e))?;
            Ok(value.map(|v| v.value().to_vec()))
        })?;
        let record = match bytes {
            Some(bytes) => Some(codec::decode_record(&kb, &bytes).inspect_err(|e| {
                self.shared.counters.publish(Event::corruption(e));
            })?),
            None => None,
        };
        let record = record.filter(|r| !r.is_expired_at(now)).map(Arc::new);
        let visible = shared.progress.visible_upto(gated);
        match shared
            .cache
            .after_read(StoredKey::of(key), record.as_ref(), version, now, visible)
        {
            Some(seq) => Ok(Read::Pending(seq)),
            None => Ok(Read::Done(record)),
        }
    }

    /// Applies `ops` in one durable write, each decided on its own and in
    /// order, after raising the token counter to at least `token_floor`.
    /// The outer `Err` is a failure of the whole write: refused before the
    /// write (nothing applied), or a failed log write or fsync after the
    /// batch's frame was written (applied or not, as a whole; see
    /// [`Store::claim_many`](crate::Store::claim_many)). The inner ones are
    /// each op's own refusal.
    pub(crate) fn apply_many(
        &self,
        ops: Vec<(Key, Op)>,
        token_floor: u64,
    ) -> Result<Vec<Result<Reply>>> {
        match self.submit(Command::Many { ops, token_floor }).wait()? {
            Answer::Many(replies) => Ok(replies),
            _ => Err(Error::Storage(
                "writer answered a batch with another answer".into(),
            )),
        }
    }

    /// Writes one batch of imported records (each an [`Op::Import`]) in one
    /// durable write, raising the token counter to at least `token_floor`
    /// and the store's clock to at least `clock_floor` first.
    pub(crate) fn import_batch(
        &self,
        ops: Vec<(Key, Op)>,
        token_floor: u64,
        clock_floor: u64,
    ) -> Result<Vec<Result<ImportResult>>> {
        // A store that refuses writes must not have its clock raised by a
        // batch it then refuses.
        if self.shared.poisoned.load(Ordering::SeqCst) || self.shared.damaged.load(Ordering::SeqCst)
        {
            return Err(self.shared.refusal());
        }
        if self.shared.held_time.is_some() {
            return Err(self.read_only("import"));
        }
        // Raised before the write is queued, so the write that carries the
        // batch stores a clock at least this high.
        self.shared.clock.raise(clock_floor);
        Ok(self
            .apply_many(ops, token_floor)?
            .into_iter()
            .map(|r| match r? {
                Reply::Imported(result) => Ok(result),
                _ => Err(Error::Storage(
                    "writer answered an import with another reply".into(),
                )),
            })
            .collect())
    }

    /// The token counter once everything acknowledged is in the index.
    pub(crate) fn next_token(&self) -> Result<u64> {
        self.commit_index()?;
        schema::next_token(&self.shared.path, &self.shared.db)
    }

    /// Verifies every record and binding of a durable snapshot.
    pub(crate) fn verify(&self, progress: impl FnMut(Progress)) -> Result<CheckReport> {
        let snapshot = self.snapshot()?;
        check::verify(&snapshot.path, &snapshot.txn, self.time(), progress)
    }

    /// Runs one step of the online scrub over up to `max` records (see
    /// [`scrub::step`]). With `commit`, the writer's open index
    /// transaction is committed first, so that the step sees every change
    /// acknowledged before the call (the background scrub does not: the
    /// writer commits by itself within a millisecond of going idle, and a
    /// commit asked every second would make an idle store write).
    ///
    /// Damage makes the store refuse writes (reads, scans and exports are
    /// still answered; a lookup that finds no live record is an error, see
    /// `absent`) and leaves the damage marker beside a store file, so
    /// that later opens do the same until the operator acts
    /// ([`scrub::marker_path_of`]). A store without a marker (a custom
    /// backend, or a marker that cannot be written) is poisoned instead:
    /// it closes without its clean checkpoint, and the reopen runs the full
    /// integrity check.
    pub(crate) fn scrub(&self, max: usize, commit: bool) -> Result<ScrubReport> {
        let shared = &self.shared;
        if commit && !shared.poisoned.load(Ordering::SeqCst) {
            self.commit_index()?;
        }
        let mut cursor = self.scrub.lock().unwrap_or_else(PoisonError::into_inner);
        let report = match guard(&shared.path, || {
            shared.db.begin_read().map_err(|e| map_err(&shared.path, e))
        }) {
            Ok(txn) => scrub::step(&shared.path, &txn, &mut cursor, max)?,
            Err(Error::CorruptFile { detail, .. }) => {
                scrub::unreadable(&shared.path, &mut cursor, &detail)
            }
            Err(other) => return Err(other),
        };
        // The scrub's steps run one at a time (`cursor` is held).
        if report.damaged && !shared.damaged.load(Ordering::SeqCst) {
            // The cause first (naming the marker about to be written), then
            // the flag, so that no refusal goes without its cause.
            let noted = shared.note_damage();
            shared.damaged.store(true, Ordering::SeqCst);
            let marked = match &shared.damage_marker {
                Some(marker) => scrub::mark_damaged(
                    marker,
                    &shared.path,
                    shared.clock.wall_ms(),
                    &report.problems,
                )
                .map_err(|e| {
                    format!(
                        "the damage marker {} cannot be written: {e}",
                        marker.display()
                    )
                }),
                None => Err("a store on a custom backend has no damage marker".to_string()),
            };
            match marked {
                Ok(()) => {
                    tracing::error!(
                        path = %shared.path.display(),
                        marker = ?shared.damage_marker,
                        "the scrub found damage in the index; the store refuses writes, now and at every open while the marker exists"
                    );
                    // A durable checkpoint records the marker in the store
                    // itself, for an open by a name the marker is not
                    // beside (a hard link): the writer still takes it.
                    match self.writer.submit(Command::Checkpoint).wait() {
                        Ok(_) => {}
                        Err(e) => tracing::error!(
                            path = %shared.path.display(),
                            error = %e,
                            "the checkpoint that records the damage marker in the store failed"
                        ),
                    }
                }
                Err(why) => {
                    shared.poison_instead_of(
                        noted.as_deref(),
                        format!(
                            "the online scrub found the index damaged ({why}); reopen the \
                             store: the reopen runs the full integrity check"
                        ),
                    );
                    tracing::error!(
                        path = %shared.path.display(),
                        "the scrub found damage in the index; the store refuses writes until reopened ({why}; the reopen runs the full integrity check)"
                    );
                }
            }
        }
        Ok(report)
    }

    /// The damage marker that keeps this store read-only: `None` unless the
    /// scrub found it damaged, in this process or before this open.
    pub(crate) fn damage_marker(&self) -> Option<&Path> {
        if self.shared.damaged.load(Ordering::SeqCst) {
            self.shared.damage_marker.as_deref()
        } else {
            None
        }
    }

    /// Whether the store refuses writes: a failed durable write, or damage
    /// the scrub found. The background sweep and scrub then stop.
    pub(crate) fn refuses_writes(&self) -> bool {
        self.shared.poisoned.load(Ordering::SeqCst)
            || self.shared.damaged.load(Ordering::SeqCst)
            || self.shared.held_time.is_some()
    }

    /// How many records are stored (past retention or not), once durable.
    pub(crate) fn len(&self) -> Result<u64> {
        let shared = &self.shared;
        // Apply what was acknowledged to the index first. In `Immediate`
        // mode a change is acknowledged only once durable, so when the
        // index holds everything durable there is nothing to apply and no
        // need to wait for the writer (a poisoned store still asks it, and
        // answers `Poisoned`).
        let applied = shared.durability == Durability::Immediate
            && !shared.poisoned.load(Ordering::SeqCst)
            && shared.progress.committed() >= shared.progress.synced();
        if !applied {
            self.commit_index()?;
        }
        let (count, seq) = schema::record_count(&shared.path, &shared.db)?;
        if shared.durability == Durability::Immediate {
            // The snapshot may hold a batch whose fsync is still running.
            shared.progress.wait_durable(seq)?;
        }
        Ok(count)
    }

    /// Makes every acknowledged change durable now.
    pub(crate) fn flush(&self) -> Result<()> {
        self.shared.progress.flush()
    }

    /// Applies the log to the index and starts a new log.
    pub(crate) fn checkpoint(&self) -> Result<()> {
        match self.submit(Command::Checkpoint).wait()? {
            Answer::Checkpointed => Ok(()),
            _ => Err(Error::Storage(
                "writer answered a checkpoint with another answer".into(),
            )),
        }
    }
}

impl Snapshot {
    /// The store's identity and token counter as of this snapshot.
    pub(crate) fn meta(&self) -> Result<(u128, u64)> {
        let path = &self.path;
        guard(path, || {
            let table = self
                .txn
                .open_table(schema::META)
                .map_err(|e| map_err(path, e))?;
            let meta = schema::read_meta(path, &table)?;
            Ok((meta.store_id, meta.next_token))
        })
    }

    /// Records by state at `now_ms`, and the oldest live Processing
    /// record's `created_ms`, without reading every record: the stored
    /// state counts, less the finished records due at `now_ms` (from the
    /// expiry counts: a row per second past that has any, and the index
    /// entries of `now_ms`'s own second, `expiry_counts::due`; no record
    /// is read), and the records in flight (the index's tagged range,
    /// `schema::IN_FLIGHT_TAG`; each entry read, the live ones' records
    /// decoded: lapsed, oldest). Time grows with the records in flight,
    /// the finished records of one second and the seconds past with
    /// records awaiting eviction (one 40-byte row each, never more rows
    /// than such records), not with how many records each of those seconds
    /// holds or with the store's size; memory is constant.
    /// `corrupt` counts envelopes whose state
    /// cannot be read; a damaged record that still names its state is
    /// counted in it (`verify` finds every damaged record, and every record
    /// without its entry). The due entries are trusted as the index holds
    /// them: a leftover entry without its record (only damage leaves one;
    /// a migration rebuilds the index) counts as awaiting eviction until a
    /// sweep removes it.
    ///
    /// # Errors
    /// [`Error::CorruptFile`] when the counts are missing (every open
    /// store has them: written at creation or migration) or malformed.
    pub(crate) fn state_counts(
        &self,
        now_ms: u64,
    ) -> Result<(crate::stats::StateCounts, Option<u64>)> {
        self.state_counts_read(now_ms)
            .map(|(counts, oldest, _)| (counts, oldest))
    }

    /// [`Snapshot::state_counts`], and what it read of the finished
    /// records' expiry counts and entries.
    pub(crate) fn state_counts_read(
        &self,
        now_ms: u64,
    ) -> Result<(crate::stats::StateCounts, Option<u64>, expiry_counts::Due)> {
        use schema::{IN_FLIGHT_TAG, Tally, slot_expiry, slot_state};
        let path = &self.path;
        guard(path, || {
            let meta = self
                .txn
                .open_table(schema::META)
                .map_err(|e| map_err(path, e))?;
            let mut tally = Tally::read(path, &meta)?.ok_or_else(|| Error::CorruptFile {
                path: path.clone(),
                detail: format!("{} missing from the metadata", schema::META_STATE_COUNTS),
            })?;
            let records = self.txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
            let expiry = self
                .txn
                .open_table(schema::EXPIRY)
                .map_err(|e| map_err(path, e))?;
            let seconds = self
                .txn
                .open_table(expiry_counts::EXPIRY_COUNTS)
                .map_err(|e| map_err(path, e))?;
            let mut counts = crate::stats::StateCounts::default();
            let mut oldest: Option<u64> = None;
            let empty: &[u8] = &[];
            // Finished records: the due ones from the expiry counts, by
            // the state their slots name.
            let due = expiry_counts::due(path, &seconds, &expiry, now_ms)?;
            for (code, n) in (0u64..).zip(due.counts) {
                tally.sub_n(slot_state(code), n);
                counts.expired = counts.expired.saturating_add(n);
            }
            // Records in flight: every entry (the expired ones by their
            // slot; the live ones read for their lease and age).
            for entry in expiry
                .range((IN_FLIGHT_TAG, empty)..)
                .map_err(|e| map_err(path, e))?
            {
                let (k, _) = entry.map_err(|e| map_err(path, e))?;
                let (slot, kb) = k.value();
                if crate::record::is_expired(slot_expiry(slot), now_ms) {
                    tally.sub(slot_state(slot));
                    counts.expired = counts.expired.saturating_add(1);
                    continue;
                }
                let Some(v) = records.get(kb).map_err(|e| map_err(path, e))? else {
                    continue;
                };
                // A damaged record is counted in its state; `verify`
                // names it. An entry its record does not name is a
                // leftover, not work in flight.
                let Ok(record) = codec::decode_record(kb, v.value()) else {
                    continue;
                };
                if schema::expiry_slot(record.state, record.expires_ms) != slot {
                    continue;
                }
                if !record.lease_valid_at(now_ms) {
                    counts.lapsed = counts.lapsed.saturating_add(1);
                }
                oldest = Some(oldest.map_or(record.created_ms, |o| o.min(record.created_ms)));
            }
            let slots = tally.slots;
            counts.processing = slots[Tally::PROCESSING];
            counts.succeeded = slots[Tally::SUCCEEDED];
            counts.failed = slots[Tally::FAILED];
            counts.failed_retryable = slots[Tally::FAILED_RETRYABLE];
            counts.corrupt = slots[Tally::UNREADABLE];
            Ok((counts, oldest, due))
        })
    }

    /// The stored entries whose key bytes fall in one of `ranges` (start
    /// inclusive, end exclusive, `None` unbounded), in key order.
    pub(crate) fn entries(&self, ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Result<Entries> {
        let path = &self.path;
        let table = guard(path, || {
            self.txn.open_table(RECORDS).map_err(|e| map_err(path, e))
        })?;
        Ok(Box::new(RangeEntries {
            path: path.clone(),
            table,
            ranges: ranges.into_iter(),
            current: None,
            done: false,
        }))
    }
}

type RecordRange = redb::Range<'static, &'static [u8], &'static [u8]>;

/// The entries of a snapshot's records table over a list of key ranges.
struct RangeEntries {
    path: PathBuf,
    table: ReadOnlyTable<&'static [u8], &'static [u8]>,
    ranges: std::vec::IntoIter<(Vec<u8>, Option<Vec<u8>>)>,
    current: Option<RecordRange>,
    done: bool,
}

impl RangeEntries {
    /// The next stored entry, opening the next key range as needed.
    fn next_entry(&mut self) -> Result<Option<Entry>> {
        let path = self.path.clone();
        loop {
            if let Some(range) = &mut self.current {
                match range.next() {
                    Some(entry) => {
                        let (k, v) = entry.map_err(|e| map_err(&path, e))?;
                        return Ok(Some((k.value().to_vec(), v.value().to_vec())));
                    }
                    None => self.current = None,
                }
            }
            let Some((start, end)) = self.ranges.next() else {
                return Ok(None);
            };
            let range = match &end {
                Some(end) => self.table.range(start.as_slice()..end.as_slice()),
                None => self.table.range(start.as_slice()..),
            };
            self.current = Some(range.map_err(|e| map_err(&path, e))?);
        }
    }
}

impl Iterator for RangeEntries {
    type Item = Result<Entry>;

    fn next(&mut self) -> Option<Result<Entry>> {
        if self.done {
            return None;
        }
        let path = self.path.clone();
        match guard(&path, || self.next_entry()) {
            Ok(Some(entry)) => Some(Ok(entry)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

fn expect_reply(answer: Result<Answer>) -> Result<Reply> {
    match answer? {
        Answer::Reply(r) => Ok(r),
        _ => Err(Error::Storage("writer answered without a reply".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClaimOptions;

    /// `Store::was_created` is false for the open whose link made the new
    /// store file when another opener took the file first and used it (in
    /// the window between the link and this open's lock): an `import
    /// --create` that then failed would remove a store someone else wrote.
    #[test]
    fn an_open_whose_new_file_another_used_first_did_not_create_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raced.redb");
        let k = crate::key::Key::new("test/raced", "other").unwrap();
        let written = k.clone();
        create::after_link::set(move |path| {
            let path = path.to_path_buf();
            // Another thread: it finds the linked file, opens and uses it.
            std::thread::spawn(move || {
                let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
                assert!(!store.was_created(), "the other opener linked nothing");
                let outcome = store
                    .claim(&written, &Fingerprint::of(b"p"), &ClaimOptions::new())
                    .unwrap();
                assert!(matches!(outcome, ClaimOutcome::Acquired(_)), "{outcome:?}");
            })
            .join()
            .unwrap();
        });
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        assert!(
            store.get(&k).unwrap().is_some(),
            "the other opener wrote first"
        );
        assert!(!store.was_created());
        drop(store);
        // Without another opener, the link's open created the store.
        let fresh = dir.path().join("fresh.redb");
        let store = Store::open_with(&fresh, Config::new().sweep_interval(None)).unwrap();
        assert!(store.was_created());
    }
    use crate::key::Fingerprint;
    use crate::record::ClaimOutcome;
    use crate::store::Store;
    use parking_lot::{Condvar, Mutex};
    use redb::ReadableTable;
    use std::time::Duration;
    use wal::MemoryLog;

    /// A log whose fsync can be held, to look at the store while a batch is
    /// applied to the index but not yet durable.
    #[derive(Clone, Default)]
    struct HeldSync {
        log: MemoryLog,
        held: Arc<(Mutex<bool>, Condvar)>,
        /// Syncs that found the fsync held and waited.
        waited: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl LogFile for HeldSync {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.log.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.log.write_at(offset, data)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            let (lock, cv) = &*self.held;
            let mut held = lock.lock();
            if *held {
                self.waited.fetch_add(1, Ordering::SeqCst);
            }
            while *held {
                cv.wait(&mut held);
            }
            Ok(())
        }
        fn len(&self) -> std::io::Result<u64> {
            self.log.len()
        }
    }

    impl HeldSync {
        /// A store on in-memory storage whose log is this one.
        fn open(&self, name: &str) -> Arc<Store> {
            self.open_with(name, Config::new().sweep_interval(None))
        }

        /// As [`HeldSync::open`], with `config`.
        fn open_with(&self, name: &str, config: Config) -> Arc<Store> {
            Arc::new(
                Store::open_with_backend(
                    name,
                    redb::backends::InMemoryBackend::new(),
                    self.clone(),
                    config,
                )
                .unwrap(),
            )
        }

        fn hold(&self, on: bool) {
            let (lock, cv) = &*self.held;
            *lock.lock() = on;
            cv.notify_all();
        }
    }

    /// `came_due` counts the records awaiting eviction whose retention
    /// ended in a span of store time, ends included as `(from, to]`, in
    /// every state, up to its limit.
    #[test]
    fn came_due_counts_the_records_whose_retention_ended_in_a_span() {
        let t0 = 1_700_000_000_000;
        let clock = crate::clock::ManualClock::new(t0);
        let store = in_memory(
            "came-due.redb",
            manual_time(&clock).retention(Duration::from_secs(1)),
        );
        let fp = Fingerprint::of(b"p");
        let claim = |id: &str| {
            let key = Key::new("due", id).unwrap();
            match store.claim(&key, &fp, &ClaimOptions::new()).unwrap() {
                ClaimOutcome::Acquired(lease) => lease,
                other => panic!("{other:?}"),
            }
        };
        for i in 0..5 {
            store.complete(&claim(&format!("a{i}")), b"r").unwrap();
        }
        clock.advance(Duration::from_secs(10));
        store.complete(&claim("b0"), b"r").unwrap();
        store.fail(&claim("b1"), b"no", false).unwrap();
        store.fail(&claim("b2"), b"busy", true).unwrap();
        // In flight: due at the end of its lease plus retention.
        let held = claim("held");
        let held = store.get(held.key()).unwrap().unwrap().expires_ms;
        embedded(&store).commit_index().unwrap();
        let e = embedded(&store);
        let (a, b) = (t0 + 1_000, t0 + 11_000);
        assert!(held > b, "{held}");
        let all = u64::MAX;
        assert_eq!(e.came_due(a - 1, a, all).unwrap(), 5);
        assert_eq!(e.came_due(a, b - 1, all).unwrap(), 0);
        assert_eq!(e.came_due(a, b, all).unwrap(), 3);
        assert_eq!(e.came_due(held - 1, held, all).unwrap(), 1);
        assert_eq!(e.came_due(0, u64::MAX, all).unwrap(), 9);
        assert_eq!(e.came_due(0, u64::MAX, 4).unwrap(), 4);
        assert_eq!(e.came_due(b, a, all).unwrap(), 0);
    }

    /// Claims and completes `n` fresh keys `k0`, `k1`, ... in `scope`.
    fn finish_keys(store: &Store, scope: &str, n: usize) {
        let fp = Fingerprint::of(b"p");
        for i in 0..n {
            let key = Key::new(scope, format!("k{i}")).unwrap();
            let ClaimOutcome::Acquired(lease) =
                store.claim(&key, &fp, &ClaimOptions::new()).unwrap()
            else {
                panic!("fresh key");
            };
            store.complete(&lease, b"r").unwrap();
        }
    }

    /// A log whose fsync takes at least a set time longer (µs): a disk
    /// that slows.
    #[derive(Clone, Default)]
    struct SlowSync {
        log: MemoryLog,
        delay_us: Arc<AtomicU64>,
    }

    impl LogFile for SlowSync {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.log.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.log.write_at(offset, data)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            let us = self.delay_us.load(Ordering::SeqCst);
            if us > 0 {
                std::thread::sleep(Duration::from_micros(us));
            }
            self.log.sync_data()
        }
        fn len(&self) -> std::io::Result<u64> {
            self.log.len()
        }
    }

    /// The fsyncs callers wait for are timed, and a log whose fsync becomes
    /// much slower than it was is reported against its earlier best, so
    /// that a sweep yields to it by two shares (`sweeper::yield_steps`).
    /// Fails if the syncs went unrecorded or the base forgot the fast ones.
    #[test]
    fn a_log_that_slows_is_reported_against_its_best() {
        let log = SlowSync::default();
        let store = Store::open_with_backend(
            "slow-log.redb",
            redb::backends::InMemoryBackend::new(),
            log.clone(),
            Config::new().sweep_interval(None).scrub_rate(None),
        )
        .unwrap();
        let e = embedded(&store);
        assert_eq!(e.log_latency(), None, "no write waited yet");
        let fp = Fingerprint::of(b"p");
        let mut i = 0u64;
        let mut lifecycle = || {
            i += 1;
            let key = Key::new("slow", format!("k{i}")).unwrap();
            let ClaimOutcome::Acquired(lease) =
                store.claim(&key, &fp, &ClaimOptions::new()).unwrap()
            else {
                panic!("fresh key");
            };
            store.complete(&lease, b"r").unwrap();
        };
        // Hang guards: each loop ends once the figure is there.
        for _ in 0..1_000_000 {
            if e.log_latency().is_some() {
                break;
            }
            lifecycle();
        }
        let (fast, _) = e.log_latency().expect("a step of fast fsyncs");
        log.delay_us.store(15_000, Ordering::SeqCst);
        let mut slow = None;
        for _ in 0..400 {
            lifecycle();
            if let Some((current, base)) = e.log_latency()
                && current >= Duration::from_millis(15)
            {
                slow = Some((current, base));
                break;
            }
        }
        let (current, base) = slow.expect("a step of slow fsyncs reported");
        assert!(
            base <= fast,
            "the base is the best step: {base:?} > {fast:?}"
        );
        assert_eq!(crate::sweeper::yield_steps(current, base), 2);
    }

    /// A paced sweep told to stop (the store is being dropped) stops after
    /// its current slice, with what that slice evicted durable, instead of
    /// holding the drop until every due record is evicted.
    #[test]
    fn a_paced_sweep_stops_after_one_slice_when_told_to() {
        let clock = crate::clock::ManualClock::new(1_700_000_000_000);
        let store = in_memory(
            "stopping.redb",
            manual_time(&clock)
                .sweep_batch(10)
                .retention(Duration::from_secs(1)),
        );
        finish_keys(&store, "stop", 50);
        clock.advance(Duration::from_secs(60));
        let stop = std::sync::atomic::AtomicBool::new(true);
        let evicted = crate::sweeper::sweep_paced(store.engine(), 10, &stop).unwrap();
        // One slice: at most the batch (fewer if its 1-ms budget ran out).
        assert!((1..=10).contains(&evicted), "{evicted}");
        assert_eq!(store.sweep_due().unwrap(), 50 - evicted);
    }

    /// At a store time past the expiry slots' range (2^61 ms, which only a
    /// custom clock reaches), a record whose expiry lies beyond that range
    /// is due by its slot before it expires: a sweep leaves it (and its
    /// entry), so its lease stays valid and its key is not acquired again,
    /// and a sweep to the end returns, though such entries fill its steps.
    /// Before, the sweep evicted such live records.
    #[test]
    fn a_sweep_at_the_end_of_time_evicts_no_live_record() {
        let clock = crate::clock::ManualClock::new(1 << 61);
        let store = Arc::new(in_memory(
            "end_of_time.redb",
            manual_time(&clock).sweep_batch(4),
        ));
        let fp = Fingerprint::of(b"x");
        let held = Key::new("s", "held").unwrap();
        let done = Key::new("s", "done").unwrap();
        let acquire = |key: &Key| match store.claim(key, &fp, &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        let _lease = acquire(&held);
        let lease = acquire(&done);
        store.complete(&lease, b"r").unwrap();
        for i in 0..8 {
            let _ = acquire(&Key::new("s", format!("more-{i}")).unwrap());
        }
        assert_eq!(store.sweep(100).unwrap(), 0);
        // Hang guard: a sweep to the end that never returns fails here.
        let (tx, rx) = std::sync::mpsc::channel();
        let sweeping = Arc::clone(&store);
        std::thread::spawn(move || tx.send(sweeping.sweep_due().map_err(|e| e.to_string())));
        let swept = rx.recv_timeout(Duration::from_secs(60));
        assert_eq!(swept.expect("sweep_due returned"), Ok(0));
        assert!(matches!(
            store.claim(&held, &fp, &ClaimOptions::new()).unwrap(),
            ClaimOutcome::InProgress { .. }
        ));
        assert!(matches!(
            store.claim(&done, &fp, &ClaimOptions::new()).unwrap(),
            ClaimOutcome::Replay(_)
        ));
    }

    /// What a paced slice's evictions cost the writer after it (their
    /// changes applied and their pages committed, here by a checkpoint) is
    /// owed by the sweep: the next paced slice's `spent`, which paces the
    /// sweep, includes the debt, which is then cleared. A one-off
    /// `Store::sweep` neither owes nor pays.
    #[test]
    fn the_next_sweep_slice_is_charged_for_what_evictions_cost_the_commit() {
        let clock = crate::clock::ManualClock::new(1_700_000_000_000);
        let store = in_memory(
            "debt.redb",
            manual_time(&clock).retention(Duration::from_secs(1)),
        );
        finish_keys(&store, "debt", 200);
        store.checkpoint().unwrap();
        let e = embedded(&store);
        // Commits of puts alone owe nothing.
        assert_eq!(e.shared.sweep_debt_ns.load(Ordering::SeqCst), 0);
        clock.advance(Duration::from_secs(60));
        // A one-off sweep's evictions owe nothing.
        assert_eq!(store.sweep(100).unwrap(), 100);
        store.checkpoint().unwrap();
        assert_eq!(e.shared.sweep_debt_ns.load(Ordering::SeqCst), 0);
        let swept = e.sweep_step(usize::MAX, None, true).unwrap();
        assert_eq!(swept.evicted, 100);
        // The removals wait in the writer's buffer; the checkpoint applies
        // and commits them.
        store.checkpoint().unwrap();
        let owed = Duration::from_nanos(e.shared.sweep_debt_ns.load(Ordering::SeqCst));
        assert!(owed > Duration::ZERO);
        // A one-off sweep does not take it; the next paced slice does.
        assert_eq!(store.sweep(10).unwrap(), 0);
        assert_eq!(
            Duration::from_nanos(e.shared.sweep_debt_ns.load(Ordering::SeqCst)),
            owed
        );
        let slice = Some(Duration::from_millis(1));
        let next = e.sweep_step(10, slice, true).unwrap();
        assert_eq!(next.evicted, 0);
        assert!(next.spent >= owed, "{next:?} {owed:?}");
        assert_eq!(e.shared.sweep_debt_ns.load(Ordering::SeqCst), 0);
        // Whatever the debt, the slice's spent carries all of it.
        e.shared
            .sweep_debt_ns
            .store(3_600_000_000_000, Ordering::SeqCst);
        let next = e.sweep_step(10, slice, true).unwrap();
        assert!(next.spent >= Duration::from_secs(3_600), "{next:?}");
        assert_eq!(e.shared.sweep_debt_ns.load(Ordering::SeqCst), 0);
    }

    /// A slice of a paced sweep (the background sweeper's) is answered as
    /// soon as the writer decided it, while its batch's fsync is still
    /// held, so that the sweeper paces itself by the slice's own writer
    /// time rather than by the fsync of the writes beside it.
    #[test]
    fn a_paced_sweep_slice_is_answered_before_its_batch_is_durable() {
        let clock = crate::clock::ManualClock::new(1_700_000_000_000);
        let log = HeldSync::default();
        let store = log.open_with(
            "paced.redb",
            manual_time(&clock).retention(Duration::from_secs(1)),
        );
        finish_keys(&store, "paced", 40);
        clock.advance(Duration::from_secs(60));
        // Through the syncer, as under load (a lone caller syncs its own
        // batch, answer included).
        embedded(&store)
            .shared
            .sync_inline
            .store(false, Ordering::Relaxed);
        log.hold(true);
        let (tx, rx) = std::sync::mpsc::channel();
        let paced = {
            let store = store.clone();
            std::thread::spawn(move || {
                let _ =
                    tx.send(embedded(&store).sweep_step(20, Some(Duration::from_secs(10)), true));
            })
        };
        // A hang guard, not a timing bound: before the change the answer
        // waited for the held fsync, and this would wait forever.
        let answered = rx.recv_timeout(Duration::from_secs(60));
        log.hold(false);
        paced.join().unwrap();
        let swept = answered
            .expect("the paced slice waited for its fsync")
            .unwrap();
        assert_eq!((swept.evicted, swept.more), (20, true));
        // The rest, in a plain sweep (durable when it returns).
        assert_eq!(store.sweep(100).unwrap(), 20);
        assert_eq!(store.sweep(100).unwrap(), 0);
    }

    /// A redb backend that counts the calls that would change the file.
    #[derive(Debug, Clone)]
    struct Counting {
        inner: Arc<redb::backends::InMemoryBackend>,
        changes: Arc<AtomicU64>,
    }

    impl redb::StorageBackend for Counting {
        fn len(&self) -> std::io::Result<u64> {
            redb::StorageBackend::len(&*self.inner)
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            redb::StorageBackend::read(&*self.inner, offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.changes.fetch_add(1, Ordering::SeqCst);
            redb::StorageBackend::set_len(&*self.inner, len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.changes.fetch_add(1, Ordering::SeqCst);
            redb::StorageBackend::sync_data(&*self.inner)
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.changes.fetch_add(1, Ordering::SeqCst);
            redb::StorageBackend::write(&*self.inner, offset, data)
        }
    }

    /// A log whose writes panic once armed (a bug in the writer's path).
    #[derive(Clone, Default)]
    struct PanicOnWrite {
        log: MemoryLog,
        armed: Arc<AtomicBool>,
    }

    impl LogFile for PanicOnWrite {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.log.read_at(offset, buf)
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            assert!(
                !self.armed.load(Ordering::SeqCst),
                "a bug in the write path"
            );
            self.log.write_at(offset, data)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.log.sync_data()
        }
        fn len(&self) -> std::io::Result<u64> {
            self.log.len()
        }
    }

    /// Found by review: a writer that panicked skipped its closing step,
    /// so redb's close could make the index's non-durable commits durable.
    /// Now the store is poisoned and the file fenced: nothing reaches the
    /// file after the writer died.
    #[test]
    fn a_writer_that_panics_leaves_the_file_as_it_was() {
        let backend = Counting {
            inner: Arc::new(redb::backends::InMemoryBackend::new()),
            changes: Arc::default(),
        };
        let log = PanicOnWrite::default();
        let store = Store::open_with_backend(
            "panic.redb",
            backend.clone(),
            log.clone(),
            crate::config::Config::new().sweep_interval(None),
        )
        .unwrap();
        let fp = Fingerprint::of(b"p");
        // A change applied to the index with a non-durable commit.
        let first = Key::new("s", "applied").unwrap();
        assert!(matches!(
            store.claim(&first, &fp, &ClaimOptions::new()),
            Ok(ClaimOutcome::Acquired(_))
        ));
        log.armed.store(true, Ordering::SeqCst);
        let second = Key::new("s", "panics").unwrap();
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let refused = store.claim(&second, &fp, &ClaimOptions::new());
        std::panic::set_hook(hook);
        assert!(refused.is_err(), "{refused:?}");
        assert!(matches!(
            store.claim(&second, &fp, &ClaimOptions::new()),
            Err(Error::Poisoned { .. } | Error::Closed)
        ));
        let before = backend.changes.load(Ordering::SeqCst);
        drop(store);
        assert_eq!(
            backend.changes.load(Ordering::SeqCst),
            before,
            "the file changed after its writer died"
        );
    }

    fn embedded(store: &Store) -> &Embedded {
        match store.engine() {
            crate::engine::Engine::Embedded(e) => e,
            #[cfg(feature = "postgres")]
            crate::engine::Engine::Postgres { .. } => unreachable!("opened on a backend"),
        }
    }

    fn in_index(store: &Store, key: &Key) -> bool {
        let txn = embedded(store).shared.db.begin_read().unwrap();
        let table = txn.open_table(RECORDS).unwrap();
        table.get(key.to_bytes().as_slice()).unwrap().is_some()
    }

    #[test]
    fn immediate_reads_never_see_a_change_before_its_fsync() {
        let log = HeldSync::default();
        let store = log.open("held.redb");
        let key = Key::new("s", "held").unwrap();
        let fp = Fingerprint::of(b"p");
        // A time reserved before the fsync is held, so that the reads below
        // need no new reservation (which would wait for the held fsync).
        let now = store.now_ms();
        // Through the syncer: the writer applies the batch to the index
        // while the fsync runs.
        embedded(&store)
            .shared
            .sync_inline
            .store(false, Ordering::Relaxed);
        *log.held.0.lock() = true;
        let claimer = {
            let (store, key, fp) = (store.clone(), key.clone(), fp.clone());
            std::thread::spawn(move || store.claim(&key, &fp, &ClaimOptions::new()))
        };
        // The batch reaches the index (a non-durable commit) while its
        // fsync is held.
        while !in_index(&store, &key) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(matches!(
            embedded(&store).read(&key, now).unwrap(),
            Read::Pending(_)
        ));
        let claim = Op::Claim {
            fingerprint: fp.clone(),
            lease_ms: 30_000,
            business_key: None,
        };
        assert!(
            embedded(&store)
                .claim_fast(&key, claim, now)
                .unwrap()
                .is_err()
        );
        assert!(!claimer.is_finished());
        {
            let (lock, cv) = &*log.held;
            *lock.lock() = false;
            cv.notify_all();
        }
        let ClaimOutcome::Acquired(lease) = claimer.join().unwrap().unwrap() else {
            panic!("fresh key");
        };
        assert_eq!(store.get(&key).unwrap().unwrap().token(), lease.token());
    }

    #[test]
    fn len_answers_from_the_index_when_it_holds_everything_durable() {
        let log = HeldSync::default();
        let store = log.open("held-len.redb");
        let key = Key::new("s", "held-len").unwrap();
        let fp = Fingerprint::of(b"p");
        *log.held.0.lock() = true;
        let claimer = {
            let (store, key, fp) = (store.clone(), key.clone(), fp.clone());
            std::thread::spawn(move || store.claim(&key, &fp, &ClaimOptions::new()))
        };
        // The writer syncs the lone batch itself and waits in the held
        // fsync: it answers nothing until the fsync is released.
        while log.waited.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Nothing acknowledged waits to be applied to the index, so `len`
        // does not ask the writer (a call that did would not return before
        // the release below, and the test would hang): the claim is not
        // counted, as it is not acknowledged.
        assert_eq!(store.len().unwrap(), 0);
        assert!(!claimer.is_finished());
        {
            let (lock, cv) = &*log.held;
            *lock.lock() = false;
            cv.notify_all();
        }
        assert!(matches!(
            claimer.join().unwrap().unwrap(),
            ClaimOutcome::Acquired(_)
        ));
        assert_eq!(store.len().unwrap(), 1);
    }

    /// An async claim cancelled while it waits for room in a full queue
    /// takes back its count of queued requests: once every request is
    /// answered the count is zero again, so a lone caller can lead again
    /// (a count left behind would send every later request through the
    /// writer thread for good).
    #[test]
    fn a_cancelled_async_claim_leaves_no_queued_count_behind() {
        const EXTRA: usize = 16;
        let log = HeldSync::default();
        let store = log.open("cancelled.redb");
        let fp = Fingerprint::of(b"p");
        *log.held.0.lock() = true;
        // A lone caller leads its claim and waits in the held fsync,
        // holding the writer's state: the writer thread takes one request
        // and waits for the state, and the queue fills up.
        let first = {
            let (store, fp) = (store.clone(), fp.clone());
            std::thread::spawn(move || {
                store
                    .claim(&Key::new("s", "first").unwrap(), &fp, &ClaimOptions::new())
                    .map(|_| ())
            })
        };
        while log.waited.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Each claim future polled once, in order: those that find room
        // are sent and wait for their answers, the last ones wait for room.
        let key = |i: usize| Key::new("s", format!("async-{i}")).unwrap();
        let keys: Vec<Key> = (0..commit::QUEUE_BOUND + 1 + EXTRA).map(key).collect();
        let options = ClaimOptions::new();
        let mut futures: Vec<_> = keys
            .iter()
            .map(|k| Box::pin(store.claim_async(k, &fp, &options)))
            .collect();
        for f in &mut futures {
            assert!(futures_lite::future::block_on(futures_lite::future::poll_once(f)).is_none());
        }
        // Counted: at most the queue's bound, the one the writer took and
        // those waiting for room.
        assert!(embedded(&store).writer.queued() >= commit::QUEUE_BOUND);
        // Cancel the last ones (still waiting for room), then release.
        let rest = futures.split_off(futures.len() - EXTRA);
        drop(rest);
        *log.held.0.lock() = false;
        log.held.1.notify_all();
        for f in futures {
            assert!(matches!(
                futures_lite::future::block_on(f),
                Ok(ClaimOutcome::Acquired(_))
            ));
        }
        first.join().unwrap().unwrap();
        assert_eq!(embedded(&store).writer.queued(), 0);
    }

    /// A detached write (the HTTP layer's failure of an abandoned response,
    /// sent from a `Drop` on an executor thread) is never decided on the
    /// calling thread: with the log's fsync held, the call returns at once
    /// (a call that led its batch would wait in the held fsync, and this
    /// test would not finish), and the failure is recorded once the fsync
    /// is released.
    #[cfg(feature = "http")]
    #[test]
    fn a_detached_write_is_queued_never_led() {
        let log = HeldSync::default();
        let store = log.open("detached.redb");
        let key = Key::new("s", "detached").unwrap();
        let lease = match store
            .claim(&key, &Fingerprint::of(b"p"), &ClaimOptions::new())
            .unwrap()
        {
            ClaimOutcome::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        *log.held.0.lock() = true;
        store.fail_detached(&lease, b"gone");
        *log.held.0.lock() = false;
        log.held.1.notify_all();
        // The writer thread decides it in its own time.
        while store.get(&key).unwrap().unwrap().state() == crate::record::State::Processing {
            std::thread::sleep(Duration::from_millis(1));
        }
        let record = store.get(&key).unwrap().unwrap();
        assert_eq!(
            record.state(),
            crate::record::State::Failed { retryable: true }
        );
    }

    /// A configuration whose store time is `clock`'s, moved by the test,
    /// with no background thread (no sweeper, no scrub).
    fn manual_time(clock: &crate::clock::ManualClock) -> Config {
        Config::new()
            .sweep_interval(None)
            .scrub_rate(None)
            .clock(clock.clone())
    }

    /// A store on in-memory storage (index and log).
    fn in_memory(name: &str, config: Config) -> Store {
        Store::open_with_backend(
            name,
            redb::backends::InMemoryBackend::new(),
            MemoryLog::new(),
            config,
        )
        .unwrap()
    }

    /// The expiry index as committed, and the entries the committed records
    /// call for (one each, under the deadline their state gives).
    fn expiry_entries(store: &Store) -> (Vec<schema::ExpiryEntry>, Vec<schema::ExpiryEntry>) {
        let txn = embedded(store).shared.db.begin_read().unwrap();
        let records = txn.open_table(RECORDS).unwrap();
        let mut wanted: Vec<schema::ExpiryEntry> = records
            .iter()
            .unwrap()
            .map(|entry| {
                let (k, v) = entry.unwrap();
                let record = crate::codec::decode_record(k.value(), v.value()).unwrap();
                (
                    schema::expiry_slot(record.state, record.expires_ms),
                    k.value().to_vec(),
                )
            })
            .collect();
        wanted.sort();
        let expiry = txn.open_table(schema::EXPIRY).unwrap();
        let stored = expiry
            .iter()
            .unwrap()
            .map(|entry| {
                let (k, _) = entry.unwrap();
                let (deadline, key) = k.value();
                (deadline, key.to_vec())
            })
            .collect();
        (stored, wanted)
    }

    /// The writer's write buffer (`pending.rs`) holds a window's changes and
    /// applies only their net effect: after any mix of claims, completions,
    /// failures, releases, extensions and sweeps of the same keys, the
    /// committed index has exactly one expiry entry per record, under the
    /// deadline its state gives (none left behind, none missing), and the
    /// state counts agree with the records.
    #[test]
    fn the_write_buffer_leaves_one_expiry_entry_per_record() {
        let store = in_memory(
            "buffer.redb",
            Config::new()
                .sweep_interval(None)
                .retention(Duration::from_millis(30)),
        );
        let keys: Vec<Key> = (0..24)
            .map(|i| Key::new("buffer", format!("k{i}")).unwrap())
            .collect();
        let fp = Fingerprint::of(b"p");
        let mut leases: Vec<Option<crate::record::Lease>> = vec![None; keys.len()];
        // A fixed pseudo-random sequence (xorshift), so that a failure
        // repeats.
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut checked = 0;
        for step in 0..3000u32 {
            let r = next();
            let i = usize::try_from(r % keys.len() as u64).unwrap();
            match leases[i].take() {
                None => {
                    if let ClaimOutcome::Acquired(lease) =
                        store.claim(&keys[i], &fp, &ClaimOptions::new()).unwrap()
                    {
                        leases[i] = Some(lease);
                    }
                }
                Some(lease) => match (r >> 8) % 5 {
                    0 => {
                        store.complete(&lease, b"done").unwrap();
                    }
                    1 => {
                        store.fail(&lease, b"no", true).unwrap();
                    }
                    2 => store.release(lease).unwrap(),
                    3 => {
                        store.extend(&lease, Duration::from_secs(60)).unwrap();
                        leases[i] = Some(lease);
                    }
                    _ => {
                        store.fail(&lease, b"no", false).unwrap();
                    }
                },
            }
            if step % 500 == 499 {
                // Let the finished records' retention end and sweep them,
                // with the buffer full of this window's changes.
                std::thread::sleep(Duration::from_millis(40));
                store.sweep(1_000).unwrap();
                store.checkpoint().unwrap();
                let (stored, wanted) = expiry_entries(&store);
                assert_eq!(stored, wanted, "after step {step}");
                checked += 1;
            }
        }
        assert_eq!(checked, 6);
        let report = store.verify(|_| {}).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
    }

    /// The scrub records the marker in the store by a checkpoint of its
    /// own as soon as it finds damage, not only at the close: a crash
    /// after the scrub still leaves the store naming its marker, for an
    /// open by a name the marker is not beside (a hard link).
    #[test]
    fn the_scrub_records_the_damage_marker_in_the_store_before_the_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("damaged.redb");
        let store =
            Store::open_with(&path, Config::new().sweep_interval(None).scrub_rate(None)).unwrap();
        let k = Key::new("scrub", "victim").unwrap();
        match store
            .claim(&k, &Fingerprint::of(b"p"), &ClaimOptions::new())
            .unwrap()
        {
            ClaimOutcome::Acquired(lease) => {
                store.complete(&lease, b"the result").unwrap();
            }
            other => panic!("{other:?}"),
        }
        store.checkpoint().unwrap();
        let db = &embedded(&store).shared.db;
        // A byte of the stored record flipped, as damage would (the writer
        // holds no open transaction right after a checkpoint).
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(RECORDS).unwrap();
            let kb = k.to_bytes();
            let mut bytes = table.get(kb.as_slice()).unwrap().unwrap().value().to_vec();
            let last = bytes.len() - 1;
            bytes[last] ^= 0x55;
            table.insert(kb.as_slice(), bytes.as_slice()).unwrap();
        }
        txn.commit().unwrap();
        assert_eq!(schema::recorded_damage_marker(&path, db).unwrap(), Ok(None));
        assert!(store.scrub(100).unwrap().damaged);
        let marker = scrub::marker_of_store(&path);
        assert!(marker.exists());
        assert_eq!(
            schema::recorded_damage_marker(&path, db).unwrap(),
            Ok(Some(marker))
        );
    }

    /// Changes the committed expiry index directly, as damage would (the
    /// writer holds no open transaction right after a checkpoint).
    fn damage_expiry(store: &Store, change: impl FnOnce(&mut redb::Table<(u64, &[u8]), ()>)) {
        store.checkpoint().unwrap();
        let txn = embedded(store).shared.db.begin_write().unwrap();
        {
            let mut table = txn.open_table(schema::EXPIRY).unwrap();
            change(&mut table);
        }
        txn.commit().unwrap();
    }

    /// On an inconsistent index the buffer changes nothing either: with the
    /// store's time standing still (so that deadlines repeat), a missing
    /// entry comes back at the record's next change, also when the change
    /// keeps its deadline or a remove and an insert of it fall in one
    /// window, and an entry left behind under a deadline that a claim and
    /// its completion use in one window is removed, as applying each change
    /// in turn (and a replay of the log) leaves them.
    #[test]
    fn the_write_buffer_repairs_and_removes_as_direct_application_does() {
        let clock = crate::clock::ManualClock::new(1_700_000_000_000);
        let store = in_memory("inconsistent.redb", manual_time(&clock));
        let key = |id: &str| Key::new("buffer", id).unwrap();
        let fp = Fingerprint::of(b"p");
        let claim = |k: &Key| match store.claim(k, &fp, &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        let entry_of = |k: &Key| {
            let record = store.get(k).unwrap().unwrap();
            schema::expiry_slot(record.state, record.expires_ms)
        };
        // A: its entry goes missing; a recovery point keeps the deadline.
        let a = claim(&key("a"));
        let a_slot = entry_of(&key("a"));
        damage_expiry(&store, |t| {
            t.remove((a_slot, key("a").to_bytes().as_slice())).unwrap();
        });
        store.set_recovery_point(&a, b"step 1").unwrap();
        // B: its entry goes missing; a retryable failure and a new claim in
        // the same millisecond move it away and back within one window.
        let b = claim(&key("b"));
        let b_slot = entry_of(&key("b"));
        damage_expiry(&store, |t| {
            t.remove((b_slot, key("b").to_bytes().as_slice())).unwrap();
        });
        store.fail(&b, b"busy", true).unwrap();
        let _b2 = claim(&key("b"));
        // C: an entry left behind under the deadline C's claim takes.
        let c_slot = a_slot;
        damage_expiry(&store, |t| {
            t.insert((c_slot, key("c").to_bytes().as_slice()), ())
                .unwrap();
        });
        let c = claim(&key("c"));
        store.complete(&c, b"done").unwrap();
        store.checkpoint().unwrap();
        let (stored, wanted) = expiry_entries(&store);
        assert_eq!(stored, wanted);
        assert_eq!(stored.len(), 3);
    }

    /// `stats` counts the records awaiting eviction from the expiry index
    /// alone (the state is in each entry's slot): with the records of the
    /// due entries gone from the records table, as if never read, they are
    /// still counted as expired, by state, and nothing else changes.
    #[test]
    fn stats_counts_records_awaiting_eviction_without_reading_them() {
        let clock = crate::clock::ManualClock::new(1_700_000_000_000);
        let store = in_memory(
            "backlog.redb",
            manual_time(&clock).retention(std::time::Duration::from_secs(60)),
        );
        let fp = Fingerprint::of(b"p");
        let claim = |k: &Key| match store.claim(k, &fp, &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        };
        let key = |n: u32| Key::new("backlog", format!("k{n}")).unwrap();
        for n in 0..6 {
            let lease = claim(&key(n));
            match n % 3 {
                0 => store.complete(&lease, b"ok").unwrap(),
                1 => store.fail(&lease, b"no", false).unwrap(),
                _ => store.fail(&lease, b"later", true).unwrap(),
            };
        }
        clock.advance(std::time::Duration::from_secs(61));
        // Two live records: one finished, one in flight.
        store.complete(&claim(&key(10)), b"ok").unwrap();
        let _held = claim(&key(11));
        store.checkpoint().unwrap();
        let before = store.stats().unwrap().records;
        // The due records' bodies go; their index entries stay.
        let txn = embedded(&store).shared.db.begin_write().unwrap();
        {
            let mut records = txn.open_table(RECORDS).unwrap();
            for n in 0..6 {
                records.remove(key(n).to_bytes().as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
        let after = store.stats().unwrap().records;
        assert_eq!(after, before);
        assert_eq!(
            (
                after.expired,
                after.succeeded,
                after.failed,
                after.failed_retryable,
                after.processing
            ),
            (6, 1, 0, 0, 1),
            "{after:?}"
        );
    }

    /// `stats` reads no backlog: with a thousand finished records due,
    /// spread over fifty seconds of expiry, it reads one row of expiry
    /// counts per second past and only the index entries of the current
    /// second (its 20 due ones and the first past them), and counts them
    /// all. A row made wrong by hand is what `verify` then reports, and
    /// what `stats` then counts.
    #[test]
    fn stats_reads_a_row_per_second_past_not_the_records_due() {
        const T0: u64 = 1_700_000_000_000;
        let clock = crate::clock::ManualClock::new(T0);
        let store = in_memory(
            "seconds.redb",
            manual_time(&clock).retention(std::time::Duration::from_secs(60)),
        );
        let fp = Fingerprint::of(b"p");
        let finish = |id: String, n: u32| {
            let k = Key::new("seconds", id).unwrap();
            let ClaimOutcome::Acquired(lease) = store.claim(&k, &fp, &ClaimOptions::new()).unwrap()
            else {
                panic!("not acquired");
            };
            match n % 3 {
                0 => store.complete(&lease, b"ok").unwrap(),
                1 => store.fail(&lease, b"no", false).unwrap(),
                _ => store.fail(&lease, b"later", true).unwrap(),
            };
        };
        for second in 0..50 {
            for n in 0..20 {
                finish(format!("s{second}-{n}"), n);
            }
            clock.advance(std::time::Duration::from_secs(1));
        }
        // Half a second into the second the last records expire in.
        clock.set_ms(T0 + 49_500 + 60_000);
        for n in 0..3 {
            finish(format!("live-{n}"), 0);
        }
        let snapshot = embedded(&store).snapshot().unwrap();
        let (counts, _, due) = snapshot.state_counts_read(store.now_ms()).unwrap();
        assert_eq!((due.rows, due.entries), (49, 21), "{due:?}");
        assert_eq!(due.counts.iter().sum::<u64>(), 1000, "{due:?}");
        // Of each second's 20: 7 succeeded, 7 failed, 6 retryably failed.
        assert_eq!(due.counts, [350, 350, 300, 0], "{due:?}");
        assert_eq!(
            (
                counts.expired,
                counts.succeeded,
                counts.failed,
                counts.failed_retryable
            ),
            (1000, 3, 0, 0),
            "{counts:?}"
        );
        drop(snapshot);
        assert!(store.verify(|_| {}).unwrap().is_clean());

        // One second's row made wrong: `verify` names it.
        let second = (T0 + 60_000) / expiry_counts::SECOND_MS;
        let txn = embedded(&store).shared.db.begin_write().unwrap();
        {
            let mut table = txn.open_table(expiry_counts::EXPIRY_COUNTS).unwrap();
            let mut row = [0u8; 32];
            row[..8].copy_from_slice(&9u64.to_le_bytes());
            table.insert(second, &row[..]).unwrap();
        }
        txn.commit().unwrap();
        let report = store.verify(|_| {}).unwrap();
        let problem = report
            .problems
            .iter()
            .find(|p| p.key == "(expiry counts)")
            .unwrap_or_else(|| panic!("{report:?}"));
        assert!(
            problem
                .detail
                .contains(&format!("first at {} ms", T0 + 60_000)),
            "{problem:?}"
        );
        assert_eq!(
            store.stats().unwrap().records.expired,
            1000 - 20 + 9,
            "the counts are what stats reads"
        );

        // The row made malformed: `stats` refuses it, `verify` names it,
        // and the writer goes on (the counts are derived): the sweep that
        // evicts that second's records rewrites it, and all is in step.
        let txn = embedded(&store).shared.db.begin_write().unwrap();
        txn.open_table(expiry_counts::EXPIRY_COUNTS)
            .unwrap()
            .insert(second, &[7u8; 5][..])
            .unwrap();
        txn.commit().unwrap();
        assert!(matches!(store.stats(), Err(Error::CorruptFile { .. })));
        let report = store.verify(|_| {}).unwrap();
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.key == "(expiry counts)" && p.detail.contains("a malformed row")),
            "{report:?}"
        );
        assert_eq!(store.sweep(10_000).unwrap(), 1000);
        assert_eq!(store.stats().unwrap().records.expired, 0);
        assert!(store.verify(|_| {}).unwrap().is_clean());
    }
}
