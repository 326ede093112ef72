//! The store: opening a file, claiming keys, finishing work, reading records.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redb::ReadableDatabase;
use tracing::Instrument;

use crate::audit::{self, Event};
use crate::backup::{self, ExportSummary, ImportLimits, ImportOptions, ImportSummary, Progress};
use crate::cache::{Lookup, ReadCache};
use crate::check::{self, CheckReport};
use crate::clock::{Clock, StoreClock, SystemClock, TIME_RESERVATION, duration_ms};
use crate::codec;
use crate::commit::{
    Answer, Command, Completion, Progress as WriteProgress, Shared, Writer, WriterState,
};
use crate::error::{Error, Result};
use crate::expiry::Sweeper;
use crate::fence::Fence;
use crate::key::{Fingerprint, Key, check_business_key};
use crate::record::{ClaimOutcome, Ctx, Effect, Lease, Op, Record, Reply, Resolution, transition};
use crate::scan::{Filter, Records};
use crate::schema::{self, RECORDS, guard, map_err};
use crate::stats::{self, LiveCounters, Stats};
use crate::wal::{self, FileLog, LogFile};

/// The largest value limit [`Config`] accepts for results, failures and
/// recovery points: 16 MiB (in bytes).
pub const MAX_VALUE_LIMIT: usize = 16 * 1024 * 1024;
/// How many requests may wait for the store's writer (in requests). Beyond
/// it callers wait for room (back-pressure): the blocking methods block,
/// the `*_async` methods are pending without blocking their executor.
pub const WRITER_QUEUE_BOUND: usize = crate::commit::QUEUE_BOUND;
/// The longest lease a claim or extend accepts: 30 days.
pub const MAX_LEASE: Duration = Duration::from_secs(30 * 24 * 3600);
/// The longest retention [`Config::retention`] accepts, and the furthest
/// an imported record's expiry may be after its last update: 100 years
/// (36,500 days), room for the 10-year retention of the benchmarks.
pub const MAX_RETENTION: Duration = Duration::from_secs(36_500 * 24 * 3600);
/// The cap on fencing tokens: `i64::MAX` (9,223,372,036,854,775,807), the
/// largest PostgreSQL `bigint`, so that every token and token counter of
/// this engine fits the PostgreSQL engine. The store's token counter never
/// exceeds it and every token handed out is below it; a claim that would
/// need a token at the cap gets [`Error::TokensExhausted`], and an import
/// whose counter or tokens break the cap is refused
/// ([`Error::ImportRefused`]). Token arithmetic never wraps.
pub const MAX_TOKEN: u64 = i64::MAX as u64;

/// When a change is acknowledged, relative to the fsync of the write-ahead
/// log.
///
/// Whatever the mode, a batch is all or nothing after a crash (a frame of the
/// log is whole or ignored), a caller's own later reads see its acknowledged
/// change, and dropping the store makes everything acknowledged durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Acknowledged = durable: every call that changes state returns only
    /// after the log holding its change was fsynced (`fdatasync`), and no
    /// reader sees a change before it is durable (DESIGN.md guarantees 2
    /// and 3). A crash or power loss loses no acknowledged change; a change
    /// whose call had not returned may or may not survive (the call failed
    /// or never answered, so the caller cannot have relied on it).
    #[default]
    Immediate,
    /// Acknowledged before durable: a call returns as soon as its change is
    /// decided and applied to the index, and the log is fsynced at most
    /// `max_delay` after the change was written (plus the time the fsync
    /// takes). Readers see acknowledged changes at once. [`Store::flush`]
    /// forces the fsync; dropping the store flushes.
    ///
    /// What a crash can lose: a process crash (the process killed, the OS
    /// still up) loses nothing that was acknowledged, since the log's writes
    /// are in the OS's page cache. A power loss or OS crash loses the
    /// changes acknowledged in the last `max_delay` (and those of the fsync
    /// in progress), as whole batches: the store reopens as it was at an
    /// earlier moment. In idempotency terms: a lost claim means the key is
    /// free again, so a retry acquires it and the work runs a second time
    /// (a duplicate); a lost completion means a retry finds the claim in
    /// progress and, after its lease lapses, takes it over and runs the work
    /// again; a lost release or failure is harmless (the key is claimable
    /// again once the lease lapses). Use this mode only when the downstream
    /// system also deduplicates on the key, or a rare duplicate is
    /// acceptable.
    Buffered {
        /// The longest an acknowledged change waits for the fsync (1 ms to
        /// 1 hour).
        max_delay: Duration,
    },
}

/// Store configuration.
///
/// # Defaults
/// - `retention`: 24 hours (Stripe keeps idempotency keys for 24 hours)
/// - `lease`: 30 seconds
/// - `max_result_bytes`, `max_failure_bytes`, `max_recovery_point_bytes`:
///   1 MiB each (in bytes)
/// - `sweep_interval`: 60 seconds (a background sweeper evicts expired
///   records); `None` disables it
/// - `sweep_batch`: 10 000 records per sweep step
/// - `clock`: [`SystemClock`]
/// - `cache_bytes`: 64 MiB, redb's page cache (in bytes)
/// - `durability`: [`Durability::Immediate`], every acknowledged write is
///   durable (fsynced) before the call returns
/// - `max_log_bytes`: 64 MiB, the size the write-ahead log grows to (in
///   bytes)
/// - `read_cache_bytes`: 16 MiB, the cache of finished records that answers
///   replays without reading the index (in bytes)
#[derive(Clone)]
pub struct Config {
    retention: Duration,
    lease: Duration,
    max_result_bytes: usize,
    max_failure_bytes: usize,
    max_recovery_point_bytes: usize,
    sweep_interval: Option<Duration>,
    sweep_batch: usize,
    clock: Arc<dyn Clock>,
    cache_bytes: usize,
    durability: Durability,
    max_log_bytes: u64,
    read_cache_bytes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            max_result_bytes: 1024 * 1024,
            max_failure_bytes: 1024 * 1024,
            max_recovery_point_bytes: 1024 * 1024,
            sweep_interval: Some(Duration::from_secs(60)),
            sweep_batch: 10_000,
            clock: Arc::new(SystemClock),
            cache_bytes: 64 * 1024 * 1024,
            durability: Durability::Immediate,
            max_log_bytes: 64 * 1024 * 1024,
            read_cache_bytes: 16 * 1024 * 1024,
        }
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("retention", &self.retention)
            .field("lease", &self.lease)
            .field("max_result_bytes", &self.max_result_bytes)
            .field("max_failure_bytes", &self.max_failure_bytes)
            .field("max_recovery_point_bytes", &self.max_recovery_point_bytes)
            .field("sweep_interval", &self.sweep_interval)
            .field("sweep_batch", &self.sweep_batch)
            .field("cache_bytes", &self.cache_bytes)
            .field("durability", &self.durability)
            .field("max_log_bytes", &self.max_log_bytes)
            .field("read_cache_bytes", &self.read_cache_bytes)
            .finish_non_exhaustive()
    }
}

impl Config {
    /// The defaults (see the type's docs).
    pub fn new() -> Config {
        Config::default()
    }

    /// How long a finished record is kept for replays, counted from when it
    /// finished (whole milliseconds, > 0, at most [`MAX_RETENTION`]: a
    /// longer one makes the open fail with [`Error::InvalidArgument`]). A
    /// change applies to later writes only: each record stores its own
    /// expiry.
    pub fn retention(mut self, retention: Duration) -> Config {
        self.retention = retention;
        self
    }

    /// The default lease duration of a claim (whole milliseconds, 1 ms to
    /// [`MAX_LEASE`]): how long an in-progress claim is honoured before
    /// another caller may take it over.
    pub fn lease(mut self, lease: Duration) -> Config {
        self.lease = lease;
        self
    }

    /// The largest result [`Store::complete`] accepts (in bytes, at most
    /// [`MAX_VALUE_LIMIT`]).
    pub fn max_result_bytes(mut self, bytes: usize) -> Config {
        self.max_result_bytes = bytes;
        self
    }

    /// The largest failure [`Store::fail`] accepts (in bytes, at most
    /// [`MAX_VALUE_LIMIT`]).
    pub fn max_failure_bytes(mut self, bytes: usize) -> Config {
        self.max_failure_bytes = bytes;
        self
    }

    /// The largest recovery point [`Store::set_recovery_point`] accepts (in
    /// bytes, at most [`MAX_VALUE_LIMIT`]).
    pub fn max_recovery_point_bytes(mut self, bytes: usize) -> Config {
        self.max_recovery_point_bytes = bytes;
        self
    }

    /// How often the background sweeper evicts expired records; `None`
    /// runs no sweeper (call [`Store::sweep`] yourself). The sweeper stops
    /// when the store is dropped.
    pub fn sweep_interval(mut self, interval: Option<Duration>) -> Config {
        self.sweep_interval = interval;
        self
    }

    /// How many records one background sweep step evicts at most (> 0); the
    /// sweeper repeats steps until fewer are due.
    pub fn sweep_batch(mut self, records: usize) -> Config {
        self.sweep_batch = records;
        self
    }

    /// The clock the store reads time from (milliseconds since the epoch).
    pub fn clock(mut self, clock: impl Clock) -> Config {
        self.clock = Arc::new(clock);
        self
    }

    /// The size of redb's page cache (in bytes).
    pub fn cache_bytes(mut self, bytes: usize) -> Config {
        self.cache_bytes = bytes;
        self
    }

    /// When changes are acknowledged relative to the log's fsync (see
    /// [`Durability`]).
    pub fn durability(mut self, durability: Durability) -> Config {
        self.durability = durability;
        self
    }

    /// The size the write-ahead log may grow to (in bytes, at least 64 KiB).
    /// The log starts at 1 MiB (or this, if smaller) and doubles each time it
    /// fills, up to this size; a full log forces a checkpoint (a durable
    /// commit of the index) and is then reused from its start. A larger log
    /// means fewer checkpoints and a longer replay after a crash (replay
    /// reads the whole log). A single batch larger than the log grows it
    /// beyond this size.
    pub fn max_log_bytes(mut self, bytes: u64) -> Config {
        self.max_log_bytes = bytes;
        self
    }

    /// The size of the cache of finished records (succeeded, or failed
    /// permanently) that answers replays without reading the index (in
    /// bytes; 0 disables it). In-progress records are never cached.
    pub fn read_cache_bytes(mut self, bytes: usize) -> Config {
        self.read_cache_bytes = bytes;
        self
    }

    fn validate(&self) -> Result<()> {
        if duration_ms(self.retention) == 0 {
            return Err(Error::invalid("retention", "must be at least 1 ms"));
        }
        if self.retention > MAX_RETENTION {
            return Err(Error::invalid(
                "retention",
                format!(
                    "{} s is over the longest retention, {} s (MAX_RETENTION)",
                    self.retention.as_secs(),
                    MAX_RETENTION.as_secs()
                ),
            ));
        }
        check_lease("lease", self.lease)?;
        for (what, v) in [
            ("max_result_bytes", self.max_result_bytes),
            ("max_failure_bytes", self.max_failure_bytes),
            ("max_recovery_point_bytes", self.max_recovery_point_bytes),
        ] {
            if v > MAX_VALUE_LIMIT {
                return Err(Error::invalid(
                    what,
                    format!("{v} bytes is over the largest limit, {MAX_VALUE_LIMIT} bytes"),
                ));
            }
        }
        if self.sweep_batch == 0 {
            return Err(Error::invalid("sweep_batch", "must be at least 1"));
        }
        if self.sweep_interval.is_some_and(|d| d.is_zero()) {
            return Err(Error::invalid("sweep_interval", "must be non-zero"));
        }
        if let Durability::Buffered { max_delay } = self.durability
            && (max_delay < Duration::from_millis(1) || max_delay > Duration::from_secs(3600))
        {
            return Err(Error::invalid(
                "durability",
                "a buffered max_delay must be between 1 ms and 1 hour",
            ));
        }
        if self.max_log_bytes < wal::MIN_LOG_BYTES {
            return Err(Error::invalid(
                "max_log_bytes",
                format!("must be at least {} bytes", wal::MIN_LOG_BYTES),
            ));
        }
        Ok(())
    }
}

/// Refuses a missing or empty file (for tools that must not create a store).
pub(crate) fn check_existing(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Missing {
            path: path.to_path_buf(),
        }),
        Ok(m) if m.len() == 0 => Err(Error::IncompatibleFile {
            path: path.to_path_buf(),
            detail: "the file is empty (not an idemstore file)".into(),
        }),
        // Other metadata errors (permissions) surface from the open itself.
        _ => Ok(()),
    }
}

fn check_lease(what: &'static str, lease: Duration) -> Result<u64> {
    let ms = duration_ms(lease);
    if ms == 0 {
        return Err(Error::invalid(
            what,
            "a lease must be at least 1 ms; a lease is never unset",
        ));
    }
    if lease > MAX_LEASE {
        return Err(Error::invalid(what, "longer than MAX_LEASE (30 days)"));
    }
    Ok(ms)
}

/// Options of one claim.
#[derive(Debug, Clone, Default)]
pub struct ClaimOptions {
    lease: Option<Duration>,
    business_key: Option<String>,
}

impl ClaimOptions {
    /// Options with every default from [`Config`].
    pub fn new() -> ClaimOptions {
        ClaimOptions::default()
    }

    /// The lease duration of this claim (whole milliseconds, 1 ms to
    /// [`MAX_LEASE`]); the store's configured lease when unset.
    pub fn lease(mut self, lease: Duration) -> ClaimOptions {
        self.lease = Some(lease);
        self
    }

    /// A business key for the second layer of dedup: the identity of the
    /// business operation itself (an order number, a ticket's external
    /// reference), unique per scope. It catches the same operation
    /// requested under a *new* idempotency key, which the idempotency key
    /// alone cannot (a client that generated a fresh key on retry, two
    /// agents planning the same action).
    ///
    /// While a record that holds the business key exists (not released,
    /// not past retention), a claim of another idempotency key in the same
    /// scope with the same business key never acquires: it gets
    /// [`Error::BusinessKeyConflict`] naming the existing key and its state
    /// (HTTP 409). The binding is written in the same write as the
    /// acquiring claim and removed with the record (release, eviction, or
    /// replacement after retention).
    ///
    /// The business key is bound when a key is first acquired; later claims
    /// of the same idempotency key (retries, takeovers) keep the record's
    /// binding whatever business key they carry.
    ///
    /// Non-empty UTF-8 without control characters, at most
    /// [`MAX_BUSINESS_KEY_LEN`](crate::MAX_BUSINESS_KEY_LEN) (255) bytes;
    /// otherwise the claim fails with [`Error::InvalidArgument`].
    pub fn business_key(mut self, business_key: impl Into<String>) -> ClaimOptions {
        self.business_key = Some(business_key.into());
        self
    }
}

struct Inner {
    shared: Arc<Shared>,
    config: Config,
    writer: Writer,
}

/// An embedded, crash-safe idempotency store on one file.
///
/// `Store` is `Send + Sync`; share it between threads with an `Arc`. Every
/// method that changes state blocks until the change is durable (fsynced,
/// with the default [`Durability::Immediate`]), and concurrent changes share
/// one fsync (group commit). Reads and claims that can only replay or answer
/// "in progress" do not wait for the writer.
///
/// Two files hold a store: the redb file at the given path (the index) and
/// the write-ahead log beside it at `<path>-wal` (see [`Store::log_path`]).
/// Keep them together; the log carries the store's identity and is refused
/// by any other store.
///
/// Dropping the store stops the background sweeper, lets the writer finish
/// every queued request, makes everything durable in the index (a final
/// checkpoint), and closes both files.
pub struct Store {
    // Field order is drop order: the sweeper stops before the writer.
    _sweeper: Option<Sweeper>,
    inner: Arc<Inner>,
    /// Wakes `execute` callers waiting on a key that another `execute` of
    /// this store holds (feature `agent`).
    #[cfg(feature = "agent")]
    pub(crate) waiters: crate::agent::Waiters,
    /// Keeps the leases of `execute` calls in flight alive: one thread,
    /// started on first need, stopped on drop (feature `agent`).
    #[cfg(feature = "agent")]
    pub(crate) extender: crate::agent::Extender,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.shared.path)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens the store at `path`, creating it if absent, with the default
    /// [`Config`] (retention 24 h, lease 30 s, every write fsynced). The
    /// write-ahead log is `<path>-wal`, created beside it if absent. After an
    /// unclean shutdown (a crash, a power cut) the open replays the log, so
    /// every acknowledged change is there again; it then ends with a
    /// checkpoint (`docs/design.md` describes the recovery).
    ///
    /// Opening verifies the checksum of every page of the file (redb's
    /// integrity check), so it reads the whole file, as recovery after a
    /// crash does: a file damaged while closed is refused rather than
    /// trusted.
    ///
    /// # Errors
    /// - [`Error::AlreadyOpen`]: another `Store` in this or another process
    ///   holds the file (the second open fails at once, it does not wait).
    /// - [`Error::IncompatibleFile`]: not an idemstore file, or a newer
    ///   format; or a log that belongs to another store, is of another
    ///   format version, or is not a log (naming the log).
    /// - [`Error::CorruptFile`]: the file is damaged.
    /// - [`Error::CorruptLog`]: after an unclean shutdown, a log frame that
    ///   was durable is damaged while later frames are intact, or the log is
    ///   missing or its header damaged (naming the log and the offset).
    ///   A torn last frame is not an error: recovery ends before it.
    /// - [`Error::Storage`]: a file cannot be read or created.
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        Store::open_with(path, Config::default())
    }

    /// Opens the store at `path` with `config` if the file exists; never
    /// creates one. For tools that inspect an existing store.
    ///
    /// # Errors
    /// [`Error::Missing`] when there is no file at `path`;
    /// [`Error::IncompatibleFile`] for an empty file (which [`Store::open`]
    /// would turn into a new store); otherwise as [`Store::open_with`].
    pub fn open_existing(path: impl AsRef<Path>, config: Config) -> Result<Store> {
        let path = path.as_ref();
        check_existing(path)?;
        Store::open_with(path, config)
    }

    /// Opens the store at `path` with `config`.
    ///
    /// # Errors
    /// As [`Store::open`], and [`Error::InvalidArgument`] for a zero
    /// retention, a zero or over-long lease, a zero sweep batch or interval,
    /// or a value limit over [`MAX_VALUE_LIMIT`].
    pub fn open_with(path: impl AsRef<Path>, config: Config) -> Result<Store> {
        let _span = tracing::debug_span!("idemstore.open_with").entered();
        let path = path.as_ref().to_path_buf();
        let log_path = log_path_of(&path);
        Store::open_inner::<redb::backends::FileBackend>(path, log_path, None, None, config)
    }

    /// Opens a store on a caller-supplied redb
    /// [`StorageBackend`](redb::StorageBackend) and write-ahead [`LogFile`]
    /// instead of files: for fault injection and simulated power loss in
    /// tests (of the index, of the log, or both), or for storage of your
    /// own. [`MemoryLog`](crate::MemoryLog) pairs with redb's
    /// `InMemoryBackend`. `name` only names the store in errors and logs
    /// (the log as `<name>-wal`). The backend must implement redb's
    /// file-lock methods for [`Error::AlreadyOpen`] to be detected.
    ///
    /// **Creation rule.** A store file ([`Store::open_with`]) is created
    /// atomically (under a temporary name, made durable, then linked into
    /// place), so a crash while creating it leaves no store or one that
    /// opens. A backend has no names, so an empty backend is created in
    /// place: a crash or I/O error during that first open may leave storage
    /// that never opens ([`Error::IncompatibleFile`], "not a redb file").
    /// Nothing was acknowledged on such storage (the first open did not
    /// return a store), so it may be discarded and created again; a backend
    /// that must survive its own creation should be prepared the same way
    /// the store prepares files: created elsewhere, then put in place.
    ///
    /// # Errors
    /// As [`Store::open_with`].
    pub fn open_with_backend(
        name: impl AsRef<Path>,
        backend: impl redb::StorageBackend,
        log: impl LogFile,
        config: Config,
    ) -> Result<Store> {
        let _span = tracing::debug_span!("idemstore.open_with_backend").entered();
        let path = name.as_ref().to_path_buf();
        let log_path = log_path_of(&path);
        Store::open_inner(path, log_path, Some(backend), Some(Arc::new(log)), config)
    }

    fn open_inner<B: redb::StorageBackend>(
        path: PathBuf,
        log_path: PathBuf,
        backend: Option<B>,
        log: Option<Arc<dyn LogFile>>,
        config: Config,
    ) -> Result<Store> {
        config.validate()?;
        let fence = Fence::default();
        let (db, meta) = schema::open(&path, backend, config.cache_bytes, &fence)?;
        // The log file is opened (or created) only once the index is known
        // to be this store's and held by this process.
        let log = match log {
            Some(log) => log,
            None => Arc::new(FileLog::open(&log_path).map_err(|e| {
                Error::Storage(format!("{}: cannot open the log: {e}", log_path.display()))
            })?),
        };
        let opened = wal::open(
            &db,
            &path,
            &log_path,
            log.clone(),
            &meta,
            config.max_log_bytes,
        )?;
        // The store's time starts from the persisted bound. After an unclean
        // shutdown up to `TIME_RESERVATION` of it may be reservation, not
        // use: that part is caught up at half rate (see `crate::clock`).
        let floor = if meta.clean {
            meta.clock_floor.unwrap_or(opened.clock_hwm)
        } else {
            opened
                .clock_hwm
                .saturating_sub(duration_ms(TIME_RESERVATION))
        };
        let clock = StoreClock::new(config.clock.clone(), opened.clock_hwm, floor);
        // A first reservation, durable before the store answers anything.
        let start = clock.reservation(clock.now_ms());
        schema::reserve_time(&path, &db, start)?;
        if opened.replayed > 0 {
            tracing::info!(path = %path.display(), frames = opened.replayed, "replayed the write-ahead log");
        }
        let shared = Arc::new(Shared {
            db: Arc::new(db),
            path,
            log_path,
            clock,
            time_durable: std::sync::atomic::AtomicU64::new(start),
            renewing: std::sync::atomic::AtomicU64::new(0),
            retention_ms: duration_ms(config.retention),
            durability: config.durability,
            poisoned: AtomicBool::new(false),
            counters: LiveCounters::new(),
            index_failed: AtomicBool::new(false),
            progress: WriteProgress::new(opened.last_seq),
            cache: ReadCache::new(config.read_cache_bytes),
            sync_inline: AtomicBool::new(true),
            fence,
        });
        let state = WriterState::new(
            opened.next_token,
            opened.token_reserved,
            opened.last_seq,
            start,
            opened.writer,
        );
        let writer = Writer::start(shared.clone(), state, log)?;
        let inner = Arc::new(Inner {
            shared,
            config,
            writer,
        });
        let sweeper = match inner.config.sweep_interval {
            Some(interval) => Some(Sweeper::start(&inner, interval, |inner: &Inner| {
                let mut total = 0;
                loop {
                    let n = inner.sweep(inner.config.sweep_batch)?;
                    total += n;
                    if n < inner.config.sweep_batch {
                        return Ok(total);
                    }
                }
            })?),
            None => None,
        };
        Ok(Store {
            _sweeper: sweeper,
            // `Store::extend` for a batch: every extension is queued before
            // any is waited for, so the batch shares a commit.
            #[cfg(feature = "agent")]
            extender: crate::agent::Extender::new(
                &inner,
                |inner: &Inner, leases: &[(Lease, Duration)]| {
                    let queued: Vec<_> = leases
                        .iter()
                        .map(|(lease, duration)| {
                            let lease_ms = check_lease("lease", *duration)?;
                            let op = Op::Extend {
                                token: lease.token(),
                                lease_ms,
                            };
                            Ok(inner.submit_op(lease.key(), op))
                        })
                        .collect();
                    queued
                        .into_iter()
                        .map(|q| {
                            q.and_then(|done| expect_record(done.wait()))
                                .map(|r| r.lease_until_ms)
                        })
                        .collect()
                },
            ),
            inner,
            #[cfg(feature = "agent")]
            waiters: crate::agent::Waiters::default(),
        })
    }

    /// The file this store holds.
    pub fn path(&self) -> &Path {
        &self.inner.shared.path
    }

    /// The store's write-ahead log: `<path>-wal` beside the store file.
    pub fn log_path(&self) -> &Path {
        &self.inner.shared.log_path
    }

    /// The store's current time (ms since the epoch), as defined on
    /// [`Clock`] ("The store's time"): the wall clock's reading when it is ahead, else the
    /// last time taken from it plus the monotonic time elapsed since; never
    /// lower than a time returned before, across crashes too (the time is
    /// reserved durably before it is returned). On a store that refuses
    /// writes ([`Error::Poisoned`]) it stays at the last durable bound.
    pub fn now_ms(&self) -> u64 {
        self.inner.time()
    }

    /// Claims `key` for a request whose payload has `fingerprint`: the
    /// atomic "insert if absent (or reclaimable)".
    ///
    /// - [`ClaimOutcome::Acquired`]: the key was absent, past retention, its
    ///   lease lapsed, or it failed retryably; the caller holds a new lease
    ///   with a fresh fencing token (durable when this returns).
    /// - [`ClaimOutcome::InProgress`]: another valid lease holds the key.
    /// - [`ClaimOutcome::Replay`]: the work finished (succeeded, or failed
    ///   permanently); replay the stored outcome.
    ///
    /// The outcomes map to HTTP as in the IETF Idempotency-Key draft.
    ///
    /// # Errors
    /// - [`Error::FingerprintMismatch`] when a record of `key` exists with
    ///   another fingerprint, in any state (HTTP 422).
    /// - [`Error::BusinessKeyConflict`] when the claim carries a business
    ///   key ([`ClaimOptions::business_key`]) that a live record of another
    ///   key in the scope holds (HTTP 409).
    /// - [`Error::InvalidArgument`] for a zero or over-long lease or an
    ///   invalid business key.
    /// - [`Error::CorruptRecord`] when the stored record is damaged.
    /// - [`Error::TokensExhausted`] when the claim would acquire but the
    ///   token counter is at [`MAX_TOKEN`]; nothing is written.
    /// - [`Error::Storage`], [`Error::Poisoned`], [`Error::Closed`]: the
    ///   store could not write. After a storage error the claim may or may
    ///   not be durable; a later claim finds out.
    pub fn claim(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        options: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        let _span =
            tracing::debug_span!("idemstore.claim", scope = key.scope(), id = key.id()).entered();
        let now = self.inner.time();
        match self.inner.claim_fast(key, fingerprint, options, now)? {
            Ok(outcome) => Ok(outcome),
            Err(op) => expect_claim(self.inner.submit_op(key, op).wait()),
        }
    }

    /// [`Store::claim`] as a future: the same semantics, awaiting the
    /// durable commit instead of blocking the thread. No runtime is needed.
    ///
    /// The `*_async` methods never block the thread that polls them on the
    /// writer: a full writer queue (4,096 waiting requests) is awaited, as
    /// are the durable commit and a time reservation. What they still do on
    /// the calling thread is short: validating the request and, for
    /// `claim_async` and [`Store::get_async`], one read of the index (a redb
    /// read transaction, usually from its page cache).
    ///
    /// # Errors
    /// As [`Store::claim`].
    pub async fn claim_async(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        options: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        let span = tracing::debug_span!("idemstore.claim", scope = key.scope(), id = key.id());
        async move {
            let now = self.inner.time_async().await;
            match self.inner.claim_fast(key, fingerprint, options, now)? {
                Ok(outcome) => Ok(outcome),
                Err(op) => expect_claim(self.inner.submit_op_async(key, op).await),
            }
        }
        .instrument(span)
        .await
    }

    /// Records the work's result under `lease` and ends it: the record
    /// becomes [`State::Succeeded`](crate::State::Succeeded) and is
    /// replayed to every later claim until retention ends (counted from
    /// now). Durable when this returns.
    ///
    /// # Errors
    /// - [`Error::TooLarge`] when `result` is over `max_result_bytes`.
    /// - [`Error::StaleLease`] when the lease is not current (taken over,
    ///   already finished, released, or past retention).
    /// - [`Error::Storage`], [`Error::Poisoned`], [`Error::Closed`]: as for
    ///   [`Store::claim`]; after a storage error the completion may or may
    ///   not be durable ([`Store::get`] after reopening tells).
    pub fn complete(&self, lease: &Lease, result: &[u8]) -> Result<Record> {
        let _span = tracing::debug_span!(
            "idemstore.complete",
            scope = lease.key().scope(),
            id = lease.key().id()
        )
        .entered();
        let op = self.inner.complete_op(lease, result)?;
        expect_record(self.inner.submit_op(lease.key(), op).wait())
    }

    /// [`Store::complete`] as a future.
    ///
    /// # Errors
    /// As [`Store::complete`].
    pub async fn complete_async(&self, lease: &Lease, result: &[u8]) -> Result<Record> {
        let span = tracing::debug_span!(
            "idemstore.complete",
            scope = lease.key().scope(),
            id = lease.key().id()
        );
        async move {
            let op = self.inner.complete_op(lease, result)?;
            expect_record(self.inner.submit_op_async(lease.key(), op).await)
        }
        .instrument(span)
        .await
    }

    /// Records a failure under `lease` and ends it. A permanent failure
    /// (`retryable == false`) is replayed until retention ends; a retryable
    /// one lets the next claim acquire the key (with a new token) and see
    /// this failure. Durable when this returns.
    ///
    /// # Errors
    /// As [`Store::complete`], with `max_failure_bytes` as the limit.
    pub fn fail(&self, lease: &Lease, failure: &[u8], retryable: bool) -> Result<Record> {
        let _span = tracing::debug_span!(
            "idemstore.fail",
            scope = lease.key().scope(),
            id = lease.key().id()
        )
        .entered();
        let op = self.inner.fail_op(lease, failure, retryable)?;
        expect_record(self.inner.submit_op(lease.key(), op).wait())
    }

    /// [`Store::fail`] as a future.
    ///
    /// # Errors
    /// As [`Store::fail`].
    pub async fn fail_async(
        &self,
        lease: &Lease,
        failure: &[u8],
        retryable: bool,
    ) -> Result<Record> {
        let span = tracing::debug_span!(
            "idemstore.fail",
            scope = lease.key().scope(),
            id = lease.key().id()
        );
        async move {
            let op = self.inner.fail_op(lease, failure, retryable)?;
            expect_record(self.inner.submit_op_async(lease.key(), op).await)
        }
        .instrument(span)
        .await
    }

    /// Queues a retryable failure under `lease` without waiting for it, for
    /// a caller that is being dropped and cannot await: the HTTP layer when
    /// a client goes away while its handler runs. The outcome is not
    /// reported; a stale lease changes nothing, as always.
    #[cfg(feature = "http")]
    pub(crate) fn fail_detached(&self, lease: &Lease, failure: &[u8]) {
        // A reason over the store's failure limit is dropped rather than
        // the failure: the retry must be able to take over.
        let op = self
            .inner
            .fail_op(lease, failure, true)
            .or_else(|_| self.inner.fail_op(lease, &[], true));
        if let Ok(op) = op {
            drop(self.inner.submit_op(lease.key(), op));
        }
    }

    /// Deletes the record and its recovery point: "nothing happened". The key
    /// is free again, for any payload. Durable when this returns.
    ///
    /// # Errors
    /// [`Error::StaleLease`] when the lease is not current; storage errors as
    /// for [`Store::claim`].
    pub fn release(&self, lease: Lease) -> Result<()> {
        let _span = tracing::debug_span!(
            "idemstore.release",
            scope = lease.key().scope(),
            id = lease.key().id()
        )
        .entered();
        let op = Op::Release {
            token: lease.token(),
        };
        expect_released(self.inner.submit_op(lease.key(), op).wait())
    }

    /// [`Store::release`] as a future.
    ///
    /// # Errors
    /// As [`Store::release`].
    pub async fn release_async(&self, lease: Lease) -> Result<()> {
        let span = tracing::debug_span!(
            "idemstore.release",
            scope = lease.key().scope(),
            id = lease.key().id()
        );
        async move {
            let op = Op::Release {
                token: lease.token(),
            };
            expect_released(self.inner.submit_op_async(lease.key(), op).await)
        }
        .instrument(span)
        .await
    }

    /// Extends the lease to at least `now + lease` (whole milliseconds, 1 ms
    /// to [`MAX_LEASE`]); a lease is never shortened. Retention is pushed out
    /// so that it never ends before the lease. Returns the new lease
    /// deadline in ms since the epoch. Durable when this returns.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero or over-long duration,
    /// [`Error::StaleLease`] when the lease is not current; storage errors as
    /// for [`Store::claim`].
    pub fn extend(&self, lease: &Lease, duration: Duration) -> Result<u64> {
        let _span = tracing::debug_span!(
            "idemstore.extend",
            scope = lease.key().scope(),
            id = lease.key().id()
        )
        .entered();
        let lease_ms = check_lease("lease", duration)?;
        let op = Op::Extend {
            token: lease.token(),
            lease_ms,
        };
        expect_record(self.inner.submit_op(lease.key(), op).wait()).map(|r| r.lease_until_ms)
    }

    /// [`Store::extend`] as a future.
    ///
    /// # Errors
    /// As [`Store::extend`].
    pub async fn extend_async(&self, lease: &Lease, duration: Duration) -> Result<u64> {
        let span = tracing::debug_span!(
            "idemstore.extend",
            scope = lease.key().scope(),
            id = lease.key().id()
        );
        async move {
            let lease_ms = check_lease("lease", duration)?;
            let op = Op::Extend {
                token: lease.token(),
                lease_ms,
            };
            expect_record(self.inner.submit_op_async(lease.key(), op).await)
                .map(|r| r.lease_until_ms)
        }
        .instrument(span)
        .await
    }

    /// Saves progress of multi-step work under `lease` (the "recovery point"
    /// of the well-known Postgres idempotency recipe). A holder that takes the
    /// key over after this lease lapses receives it in
    /// [`Lease::recovery_point`]. Replaces any earlier recovery point.
    /// Durable when this returns.
    ///
    /// # Errors
    /// [`Error::TooLarge`] over `max_recovery_point_bytes`,
    /// [`Error::StaleLease`] when the lease is not current; storage errors as
    /// for [`Store::claim`].
    pub fn set_recovery_point(&self, lease: &Lease, bytes: &[u8]) -> Result<()> {
        let _span = tracing::debug_span!(
            "idemstore.set_recovery_point",
            scope = lease.key().scope(),
            id = lease.key().id()
        )
        .entered();
        let op = self.inner.recovery_point_op(lease, bytes)?;
        expect_record(self.inner.submit_op(lease.key(), op).wait()).map(|_| ())
    }

    /// [`Store::set_recovery_point`] as a future.
    ///
    /// # Errors
    /// As [`Store::set_recovery_point`].
    pub async fn set_recovery_point_async(&self, lease: &Lease, bytes: &[u8]) -> Result<()> {
        let span = tracing::debug_span!(
            "idemstore.set_recovery_point",
            scope = lease.key().scope(),
            id = lease.key().id()
        );
        async move {
            let op = self.inner.recovery_point_op(lease, bytes)?;
            expect_record(self.inner.submit_op_async(lease.key(), op).await).map(|_| ())
        }
        .instrument(span)
        .await
    }

    /// The record of `key`, or `None` when absent or past retention (whether
    /// or not it was evicted). Does not wait for the writer, except for a
    /// change of `key` that is not yet durable, and for a renewal of the
    /// store's time reservation when the time has outrun it (reads that ran
    /// for about a second without writes; see [`Clock`], "The store's
    /// time").
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] when the stored record is damaged,
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read.
    pub fn get(&self, key: &Key) -> Result<Option<Record>> {
        let _span =
            tracing::debug_span!("idemstore.get", scope = key.scope(), id = key.id()).entered();
        self.inner.get(key)
    }

    /// [`Store::get`] as a future: the same answer, awaiting (instead of
    /// blocking on) a change of `key` that is not yet durable and a time
    /// reservation. No runtime is needed.
    ///
    /// # Errors
    /// As [`Store::get`], and [`Error::Poisoned`] or [`Error::Closed`] when
    /// a change of `key` in flight can no longer become durable.
    pub async fn get_async(&self, key: &Key) -> Result<Option<Record>> {
        let span = tracing::debug_span!("idemstore.get", scope = key.scope(), id = key.id());
        async move {
            let now = self.inner.time_async().await;
            loop {
                match self.inner.read(key, now)? {
                    Read::Done(r) => return Ok(r),
                    // The writer answers a commit once everything decided before
                    // it is committed to the index and (when gated) durable.
                    Read::Pending(_) => match self.inner.submit_async(Command::Commit).await.await?
                    {
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
        .instrument(span)
        .await
    }

    /// Evicts up to `max_records` records past retention and returns how
    /// many it removed. Its cost grows with the number it evicts, not with
    /// the size of the store. Expired records are already invisible; this
    /// only reclaims space. Goes through the writer; durable when it returns.
    ///
    /// # Errors
    /// Storage errors as for [`Store::claim`].
    pub fn sweep(&self, max_records: usize) -> Result<usize> {
        let _span = tracing::debug_span!("idemstore.sweep").entered();
        self.inner.sweep(max_records)
    }

    /// Finishes a Processing record administratively, as succeeded or
    /// failed: for a reconciler that found the record with
    /// [`Store::compensation`] and asked the downstream system what really
    /// happened. Fenced by `token` (the record's fencing token, as the scan
    /// reported it) exactly as [`Store::complete`] is: if the record has
    /// since been completed, failed, released or taken over by a newer
    /// holder, nothing changes and the call fails. Retention is counted
    /// from now. The holder whose lease this was gets
    /// [`Error::StaleLease`] on any later write. Durable when this returns;
    /// audited with cause `resolve`.
    ///
    /// # Errors
    /// - [`Error::StaleLease`] when `token` is not the current lease of a
    ///   Processing record of `key`.
    /// - [`Error::TooLarge`] when the result is over `max_result_bytes` or
    ///   the failure over `max_failure_bytes`.
    /// - Storage errors as for [`Store::complete`].
    pub fn resolve(&self, key: &Key, token: u64, outcome: Resolution) -> Result<Record> {
        let _span =
            tracing::debug_span!("idemstore.resolve", scope = key.scope(), id = key.id()).entered();
        let (what, limit) = match &outcome {
            Resolution::Succeeded(_) => ("result", self.inner.config.max_result_bytes),
            Resolution::Failed { .. } => ("failure", self.inner.config.max_failure_bytes),
        };
        Inner::check_len(what, outcome.bytes().len(), limit)?;
        expect_record(
            self.inner
                .submit_op(key, Op::Resolve { token, outcome })
                .wait(),
        )
    }

    /// The records a reconciler must look at: Processing records whose
    /// lease has lapsed, or, when `older_than` is given, that were first
    /// acquired at least `older_than` ago. Each record carries its key,
    /// fencing token ([`Record::token`]), recovery point and times; ask the
    /// downstream system what happened, then finish the record with
    /// [`Store::resolve`] (or leave it for the next claim to take over).
    ///
    /// Reads one snapshot (see [`Records`]); the cost grows with the number
    /// of stored records, since state is not indexed. Shorthand for
    /// `scan(&Filter::needs_compensation(older_than))`.
    ///
    /// # Errors
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the snapshot cannot
    /// be opened; the iterator yields per-record errors.
    pub fn compensation(&self, older_than: Option<Duration>) -> Result<Records> {
        let _span = tracing::debug_span!("idemstore.compensation").entered();
        self.scan(&Filter::needs_compensation(older_than))
    }

    /// The live records that pass `filter`, read from one snapshot taken
    /// now (see [`Filter`] and [`Records`]). A scope prefix limits the read
    /// to the matching key ranges; other conditions are checked record by
    /// record.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a scope prefix longer than any scope;
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the snapshot cannot
    /// be opened.
    pub fn scan(&self, filter: &Filter) -> Result<Records> {
        let _span = tracing::debug_span!("idemstore.scan").entered();
        let txn = self.inner.durable_snapshot()?;
        let shared = &self.inner.shared;
        Records::open(&shared.path, &txn, filter.clone(), self.inner.time())
    }

    /// The numbers an operator alerts on: records by state, the age of the
    /// oldest Processing record, the file size, and counters since open
    /// (see [`Stats`] and [`Counters`](crate::Counters)).
    ///
    /// Cost: the counters are free (atomics), but the counts by state come
    /// from a scan that reads and decodes every stored record in one read
    /// snapshot, so a call costs about as much as reading the whole table:
    /// O(records), about 0.5 s for 200,000 records (a 71 MB file) on a
    /// 2-core VM in a release build (`docs/operations.md`). It does not block
    /// the writer. Poll it at dashboard rates (seconds to minutes), not per
    /// request.
    ///
    /// # Errors
    /// [`Error::Poisoned`] after a failed durable write (the index may hold
    /// changes that never became durable; reopen the store);
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read. Corrupt records are counted, not returned as errors.
    pub fn stats(&self) -> Result<Stats> {
        let _span = tracing::debug_span!("idemstore.stats").entered();
        let shared = &self.inner.shared;
        // A poisoned store's index may hold changes that never became
        // durable: refuse, as scan, export and verify do.
        let txn = self.inner.durable_snapshot()?;
        let now_ms = self.inner.time();
        let (records, oldest) = stats::count_states(&shared.path, &txn, now_ms)?;
        Ok(Stats {
            now_ms,
            records,
            oldest_processing_age_ms: oldest.map(|c| now_ms.saturating_sub(c)),
            file_bytes: std::fs::metadata(&shared.path).ok().map(|m| m.len()),
            counters: shared.counters.snapshot(),
        })
    }

    /// Reads [`stats`](Self::stats) and sets the store's gauges in the
    /// `metrics` facade from it (`idemstore_records{state}`,
    /// `idemstore_in_progress_lapsed_records`,
    /// `idemstore_oldest_in_progress_age_seconds`; see
    /// [`idemstore::metrics`](crate::metrics)). It reads every record, as
    /// `stats` does: call it when the exporter is scraped or on a timer of
    /// seconds, not per request. Cargo feature `metrics`.
    ///
    /// # Errors
    /// Those of [`stats`](Self::stats); the gauges are left as they were.
    #[cfg(feature = "metrics")]
    pub fn publish_gauges(&self) -> Result<Stats> {
        let _span = tracing::debug_span!("idemstore.publish_gauges").entered();
        let stats = self.stats()?;
        crate::metrics::set_gauges(&stats);
        Ok(stats)
    }

    /// Writes a portable backup of every live record to `out`, from one
    /// snapshot: a versioned stream of length-prefixed, crc32-framed
    /// records (format in `docs/operations.md`). The store keeps serving
    /// while it runs. `progress` is called after each record.
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] when a stored record fails its checksum
    /// (the export stops: run `idemstore check`); [`Error::Storage`] when
    /// `out` fails or the file cannot be read; [`Error::CorruptFile`].
    pub fn export(
        &self,
        out: impl std::io::Write,
        progress: impl FnMut(Progress),
    ) -> Result<ExportSummary> {
        let _span = tracing::debug_span!("idemstore.export").entered();
        let txn = self.inner.durable_snapshot()?;
        let shared = &self.inner.shared;
        backup::export(&shared.path, &txn, self.inner.time(), out, progress)
    }

    /// Restores records from a stream written by [`Store::export`], with the
    /// default [`ImportOptions`] (times at most 5 minutes ahead of the
    /// store's clock). See [`Store::import_with`].
    ///
    /// # Errors
    /// As [`Store::import_with`].
    pub fn import(
        &self,
        input: impl std::io::Read,
        progress: impl FnMut(Progress),
    ) -> Result<ImportSummary> {
        let _span = tracing::debug_span!("idemstore.import").entered();
        self.import_with(input, &ImportOptions::default(), progress)
    }

    /// Restores records from a stream written by [`Store::export`].
    ///
    /// - A record is written only where its key is absent or past
    ///   retention; a live record is never overwritten, so importing the same
    ///   stream twice changes nothing the second time (import is
    ///   idempotent). Records already past retention and records whose
    ///   business key another live key holds are skipped.
    /// - The stream is validated input. The meta frame is checked before
    ///   anything is written: its token counter must not be above
    ///   [`MAX_TOKEN`], and its clock high-water mark not more than
    ///   `options`' clock tolerance (default 5 minutes) ahead of the store's
    ///   clock. Every record is checked as it is read: its token below
    ///   [`MAX_TOKEN`], its update time within the tolerance, its lease
    ///   ending at most [`MAX_LEASE`] and its expiry at most
    ///   [`MAX_RETENTION`] after its last update, a Processing record's
    ///   expiry not before its lease's end, a finished record's output
    ///   present, and its values within this store's configured limits.
    /// - The store's token counter is raised above every token in the
    ///   stream (and the source's counter), so no token is ever handed out
    ///   twice; its clock is raised to the latest time in the stream, but by
    ///   at most the tolerance (even when `options` accepts times further
    ///   ahead), so an import never makes every record expire at once.
    /// - Records go in batches of up to 1,024 records and 4 MiB of record
    ///   frames (plus the one record that crosses the line), each one atomic
    ///   and durable write; a batch is written only once all its frames
    ///   passed their checks, so memory stays bounded for a stream of any
    ///   length (stdin included).
    ///
    /// # Errors
    /// - [`Error::CorruptExport`] with the byte offset of a damaged,
    ///   truncated or out-of-place frame, or for a stream that is not an
    ///   export or is of a newer format;
    /// - [`Error::ImportRefused`] with the byte offset of a frame that breaks
    ///   a rule above, the rule, and how many records went in before it.
    ///
    /// In both cases nothing of the frame's batch is written, and batches
    /// before it stay imported. Storage errors as for [`Store::claim`].
    pub fn import_with(
        &self,
        input: impl std::io::Read,
        options: &ImportOptions,
        progress: impl FnMut(Progress),
    ) -> Result<ImportSummary> {
        let _span = tracing::debug_span!("idemstore.import_with").entered();
        let inner = &self.inner;
        // One reading for the whole import: the tolerance is measured from
        // where the store's time and the wall clock stood when it began.
        let started = inner.shared.clock.now_ms();
        let now = move || started;
        let limits = ImportLimits {
            options: *options,
            now_ms: &now,
            wall_ms: inner.shared.clock.wall_ms(),
            max_result_bytes: inner.config.max_result_bytes,
            max_failure_bytes: inner.config.max_failure_bytes,
            max_recovery_point_bytes: inner.config.max_recovery_point_bytes,
        };
        let mut summary = backup::import(input, &limits, progress, |batch| {
            // Raised before the write is queued, so the write that carries
            // the batch stores a clock at least this high.
            inner.shared.clock.raise(batch.clock_floor);
            let ops = batch
                .records
                .into_iter()
                .map(|record| {
                    let key = record.key.clone();
                    (
                        key,
                        Op::Import {
                            record: Box::new(record),
                        },
                    )
                })
                .collect();
            let cmd = Command::Import {
                ops,
                token_floor: batch.token_floor,
            };
            match inner.submit(cmd).wait()? {
                Answer::Imported(replies) => Ok(replies
                    .into_iter()
                    .map(|r| match r? {
                        Reply::Imported(result) => Ok(result),
                        _ => Err(Error::Storage(
                            "writer answered an import with another reply".into(),
                        )),
                    })
                    .collect()),
                _ => Err(Error::Storage(
                    "writer answered an import with another answer".into(),
                )),
            }
        })?;
        inner.commit_index()?;
        summary.next_token = schema::next_token(&inner.shared.path, &inner.shared.db)?;
        tracing::info!(
            target: "idemstore::audit",
            records = summary.records,
            imported = summary.imported,
            present = summary.present,
            expired = summary.expired,
            business_key_taken = summary.business_key_taken,
            next_token = summary.next_token,
            cause = "import",
            "import finished"
        );
        Ok(summary)
    }

    /// Verifies every stored record: its checksum and decoding, that its
    /// fencing token is below the store's token counter, that it has its
    /// expiry index entry, and that business-key bindings and records agree.
    /// Reads one snapshot while the store keeps serving. redb's own page
    /// integrity check needs the file to itself: see [`check_file`](crate::check_file).
    ///
    /// # Errors
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read; damaged records are reported in the [`CheckReport`], not as
    /// errors.
    pub fn verify(&self, progress: impl FnMut(Progress)) -> Result<CheckReport> {
        let _span = tracing::debug_span!("idemstore.verify").entered();
        let txn = self.inner.durable_snapshot()?;
        let shared = &self.inner.shared;
        check::verify(&shared.path, &txn, self.inner.time(), progress)
    }

    /// How many records the file holds, including expired records that are
    /// not yet evicted.
    ///
    /// # Errors
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read.
    pub fn len(&self) -> Result<u64> {
        let shared = &self.inner.shared;
        // Apply what was acknowledged to the index first.
        self.inner.commit_index()?;
        let (count, seq) = schema::record_count(&shared.path, &shared.db)?;
        if shared.durability == Durability::Immediate {
            // The snapshot may hold a batch whose fsync is still running.
            shared.progress.wait_durable(seq)?;
        }
        Ok(count)
    }

    /// Makes every change acknowledged so far durable, and returns when it
    /// is. With [`Durability::Buffered`] this forces the log's fsync now
    /// instead of within `max_delay`; with [`Durability::Immediate`]
    /// acknowledged changes are durable already and this returns at once.
    ///
    /// # Errors
    /// [`Error::Poisoned`] when a durable write failed (the changes may or
    /// may not be durable; reopen the store to find out), [`Error::Closed`]
    /// when the store's syncer is gone.
    pub fn flush(&self) -> Result<()> {
        let _span = tracing::debug_span!("idemstore.flush").entered();
        self.inner.shared.progress.flush()
    }

    /// Commits the index durably (a checkpoint) and starts the write-ahead
    /// log over, so that a reopen after a crash has nothing to replay. The
    /// store checkpoints by itself whenever the log fills and when it is
    /// dropped; call this to bound recovery time before a planned risk, or
    /// in tests. Goes through the writer; every change acknowledged before
    /// it is durable when it returns, whatever the durability mode.
    ///
    /// # Errors
    /// Storage errors as for [`Store::claim`].
    pub fn checkpoint(&self) -> Result<()> {
        let _span = tracing::debug_span!("idemstore.checkpoint").entered();
        match self.inner.submit(Command::Checkpoint).wait()? {
            Answer::Checkpointed => Ok(()),
            _ => Err(Error::Storage(
                "writer answered a checkpoint with another answer".into(),
            )),
        }
    }

    /// Whether the file holds no record at all.
    ///
    /// # Errors
    /// As [`Store::len`].
    pub fn is_empty(&self) -> Result<bool> {
        self.len().map(|n| n == 0)
    }
}

/// The log's path for the store file at `path`: `<path>-wal`.
fn log_path_of(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

/// What a read outside the writer found.
enum Read {
    /// The record (or its absence), durable in `Immediate` mode.
    Done(Option<Record>),
    /// The key has a change that may not be durable yet, in this batch.
    Pending(u64),
}

impl Inner {
    fn submit(&self, cmd: Command) -> Completion {
        if self.shared.poisoned.load(Ordering::SeqCst) {
            return Completion::Ready(Err(Error::Poisoned));
        }
        self.writer.submit(cmd)
    }

    fn submit_op(&self, key: &Key, op: Op) -> Completion {
        self.submit(Command::Op {
            key: key.clone(),
            op,
        })
    }

    /// [`Inner::submit`] from async code: a full queue is awaited.
    async fn submit_async(&self, cmd: Command) -> Completion {
        if self.shared.poisoned.load(Ordering::SeqCst) {
            return Completion::Ready(Err(Error::Poisoned));
        }
        self.writer.submit_async(cmd).await
    }

    async fn submit_op_async(&self, key: &Key, op: Op) -> Result<Answer> {
        let cmd = Command::Op {
            key: key.clone(),
            op,
        };
        self.submit_async(cmd).await.await
    }

    /// The store's time for an answer about to be given: the clock's
    /// reading once a bound at least that high is durable (asked of the
    /// writer when it is not yet; see [`crate::clock`]). If the store can
    /// no longer write, the last durable bound when it is lower: answers
    /// are never based on a time a crash could take back.
    fn time(&self) -> u64 {
        let now = self.shared.clock.now_ms();
        let durable = self.shared.time_durable.load(Ordering::SeqCst);
        if now <= durable {
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
        if now.saturating_add(crate::commit::RENEW_AHEAD_MS) > durable
            && !shared.poisoned.load(Ordering::SeqCst)
            && shared.renewing.load(Ordering::SeqCst) < durable
        {
            shared.renewing.store(durable, Ordering::SeqCst);
            self.writer.submit_detached(Command::Reserve);
        }
    }

    /// [`Inner::time`] from async code: the reservation is awaited.
    async fn time_async(&self) -> u64 {
        let now = self.shared.clock.now_ms();
        let durable = self.shared.time_durable.load(Ordering::SeqCst);
        if now <= durable {
            self.renew_early(now, durable);
            return now;
        }
        match self.submit_async(Command::Reserve).await.await {
            Ok(_) => now.min(self.shared.time_durable.load(Ordering::SeqCst)),
            Err(_) => now.min(durable),
        }
    }

    fn sweep(&self, max_records: usize) -> Result<usize> {
        match self.submit(Command::Sweep { max: max_records }).wait()? {
            Answer::Evicted(n) => Ok(n),
            _ => Err(Error::Storage(
                "writer answered a sweep with another answer".into(),
            )),
        }
    }

    /// Answers a claim from the cache or a read transaction when it can only
    /// replay, only report a valid lease, or only refuse a fingerprint.
    /// Otherwise (including when the key has a change that is not durable
    /// yet) returns the operation for the writer.
    fn claim_fast(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        options: &ClaimOptions,
        now_ms: u64,
    ) -> Result<Result<ClaimOutcome, Op>> {
        let lease_ms = check_lease("lease", options.lease.unwrap_or(self.config.lease))?;
        if let Some(bk) = &options.business_key {
            check_business_key(bk)?;
        }
        let op = Op::Claim {
            fingerprint: fingerprint.clone(),
            lease_ms,
            business_key: options.business_key.clone(),
        };
        if let Read::Done(Some(current)) = self.read(key, now_ms)? {
            let ctx = Ctx {
                now_ms,
                retention_ms: self.shared.retention_ms,
                next_token: 0,
                // An existing live record keeps its own binding: the
                // business-key rule applies only to a fresh record, which
                // the writer decides.
                business_holder: None,
            };
            match transition(key, Some(&current), &op, &ctx) {
                Ok((effect @ Effect::None, reply)) => {
                    let event =
                        Event::of_transition(key, Some(&current), &op, &effect, &reply, now_ms);
                    audit::publish(&self.shared.counters, event);
                    if let Reply::Claim(outcome) = reply {
                        return Ok(Ok(outcome));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    audit::publish(&self.shared.counters, Event::of_error(key, &e));
                    return Err(e);
                }
            }
        }
        Ok(Err(op))
    }

    /// A read snapshot of the index for the operator's reads (scans, stats,
    /// export, verify): it holds every change acknowledged before this call
    /// and, with [`Durability::Immediate`], nothing that is not yet durable
    /// (the writer may commit a batch to the index while its fsync runs, so
    /// this waits for the durability of whatever the snapshot holds, as
    /// [`Store::len`] does).
    fn durable_snapshot(&self) -> Result<redb::ReadTransaction> {
        self.commit_index()?;
        let shared = &self.shared;
        let path = &shared.path;
        guard(path, || {
            let txn = shared.db.begin_read().map_err(|e| map_err(path, e))?;
            if shared.durability == Durability::Immediate {
                shared
                    .progress
                    .wait_durable(schema::applied_seq(path, &txn)?)?;
            }
            Ok(txn)
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
    fn get(&self, key: &Key) -> Result<Option<Record>> {
        let now = self.time();
        loop {
            match self.read(key, now)? {
                Read::Done(r) => return Ok(r),
                Read::Pending(seq) if self.shared.progress.committed() < seq => {
                    self.commit_index()?;
                }
                Read::Pending(seq) => self.shared.progress.wait_durable(seq)?,
            }
        }
    }

    /// One read outside the writer at the store's time `now` (from
    /// [`Inner::time`]): the cache, else a read transaction, then the
    /// durability gate (see [`crate::cache`]).
    fn read(&self, key: &Key, now: u64) -> Result<Read> {
        let shared = &self.shared;
        let path = &shared.path;
        let kb = key.to_bytes();
        let gated = shared.durability == Durability::Immediate;
        let version = match shared
            .cache
            .lookup(&kb, now, shared.progress.visible_upto(gated))
        {
            Lookup::Hit(record) => return Ok(Read::Done(Some(record))),
            Lookup::Pending(seq) => return Ok(Read::Pending(seq)),
            Lookup::Miss(version) => version,
        };
        let bytes = guard(path, || {
            let txn = shared.db.begin_read().map_err(|e| map_err(path, e))?;
            let table = txn.open_table(RECORDS).map_err(|e| map_err(path, e))?;
            let value = table.get(kb.as_slice()).map_err(|e| map_err(path, e))?;
            Ok(value.map(|v| v.value().to_vec()))
        })?;
        let record = match bytes {
            Some(bytes) => Some(codec::decode_record(&kb, &bytes).inspect_err(|e| {
                audit::publish(&self.shared.counters, Event::corruption(e));
            })?),
            None => None,
        };
        let record = record.filter(|r| !r.is_expired_at(now));
        let visible = shared.progress.visible_upto(gated);
        match shared
            .cache
            .after_read(&kb, record.as_ref(), version, now, visible)
        {
            Some(seq) => Ok(Read::Pending(seq)),
            None => Ok(Read::Done(record)),
        }
    }

    fn check_len(what: &'static str, len: usize, limit: usize) -> Result<()> {
        if len > limit {
            return Err(Error::TooLarge { what, len, limit });
        }
        Ok(())
    }

    fn complete_op(&self, lease: &Lease, result: &[u8]) -> Result<Op> {
        Self::check_len("result", result.len(), self.config.max_result_bytes)?;
        Ok(Op::Complete {
            token: lease.token(),
            result: result.to_vec(),
        })
    }

    fn fail_op(&self, lease: &Lease, failure: &[u8], retryable: bool) -> Result<Op> {
        Self::check_len("failure", failure.len(), self.config.max_failure_bytes)?;
        Ok(Op::Fail {
            token: lease.token(),
            failure: failure.to_vec(),
            retryable,
        })
    }

    fn recovery_point_op(&self, lease: &Lease, bytes: &[u8]) -> Result<Op> {
        Self::check_len(
            "recovery point",
            bytes.len(),
            self.config.max_recovery_point_bytes,
        )?;
        Ok(Op::SetRecoveryPoint {
            token: lease.token(),
            bytes: bytes.to_vec(),
        })
    }
}

fn expect_reply(answer: Result<Answer>) -> Result<Reply> {
    match answer? {
        Answer::Reply(r) => Ok(r),
        _ => Err(Error::Storage("writer answered without a reply".into())),
    }
}

fn expect_claim(answer: Result<Answer>) -> Result<ClaimOutcome> {
    match expect_reply(answer)? {
        Reply::Claim(c) => Ok(c),
        _ => Err(Error::Storage(
            "writer answered a claim with another reply".into(),
        )),
    }
}

fn expect_record(answer: Result<Answer>) -> Result<Record> {
    match expect_reply(answer)? {
        Reply::Record(r) => Ok(r),
        _ => Err(Error::Storage("writer answered with another reply".into())),
    }
}

fn expect_released(answer: Result<Answer>) -> Result<()> {
    match expect_reply(answer)? {
        Reply::Released => Ok(()),
        _ => Err(Error::Storage(
            "writer answered a release with another reply".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::MemoryLog;
    use parking_lot::{Condvar, Mutex};

    /// A log whose fsync can be held, to look at the store while a batch is
    /// applied to the index but not yet durable.
    #[derive(Clone, Default)]
    struct HeldSync {
        log: MemoryLog,
        held: Arc<(Mutex<bool>, Condvar)>,
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
            while *held {
                cv.wait(&mut held);
            }
            Ok(())
        }
        fn len(&self) -> std::io::Result<u64> {
            self.log.len()
        }
    }

    fn in_index(store: &Store, key: &Key) -> bool {
        let txn = store.inner.shared.db.begin_read().unwrap();
        let table = txn.open_table(RECORDS).unwrap();
        table.get(key.to_bytes().as_slice()).unwrap().is_some()
    }

    #[test]
    fn immediate_reads_never_see_a_change_before_its_fsync() {
        let log = HeldSync::default();
        let store = Arc::new(
            Store::open_with_backend(
                "held.redb",
                redb::backends::InMemoryBackend::new(),
                log.clone(),
                Config::new().sweep_interval(None),
            )
            .unwrap(),
        );
        let key = Key::new("s", "held").unwrap();
        let fp = Fingerprint::of(b"p");
        // A time reserved before the fsync is held, so that the reads below
        // need no new reservation (which would wait for the held fsync).
        let now = store.now_ms();
        // Through the syncer: the writer applies the batch to the index
        // while the fsync runs.
        store
            .inner
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
            store.inner.read(&key, now).unwrap(),
            Read::Pending(_)
        ));
        assert!(
            store
                .inner
                .claim_fast(&key, &fp, &ClaimOptions::new(), now)
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
}
