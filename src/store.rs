//! The public face: [`Store`], the one type users hold. It validates every
//! request, opens a tracing span per call, and hands the request to its
//! engine ([`crate::engine`]); scans, stats, export and import are written
//! here once over the engine's snapshots.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::backup::{self, ExportSummary, ImportLimits, ImportOptions, ImportSummary};
use crate::config::{ClaimOptions, Config, MAX_CLAIM_MANY, check_lease};
use crate::embedded::wal::LogFile;
use crate::embedded::{self, Embedded};
use crate::engine::{Engine, all_keys};
use crate::error::{Error, Result};
use crate::key::{Fingerprint, Key, check_business_key};
use crate::orphans::{self, InFlight, Orphans};
use crate::record::{ClaimOutcome, Lease, Op, Record, Reply, Resolution, Sent};
use crate::report::Progress;
use crate::report::{CheckReport, ScrubReport};
use crate::scan::{Filter, Records};
use crate::stats::Stats;
use crate::sweeper::Sweeper;

/// A crash-safe idempotency store: embedded on one file ([`Store::open`]),
/// or one schema of a PostgreSQL database shared by every replica of a
/// service (`Store::connect`, cargo feature `postgres`). The API and the
/// guarantees are the same on both; README's "One replica or many" says
/// what differs.
///
/// `Store` is `Send + Sync`; share it between threads with an `Arc`. Every
/// method that changes state blocks until the change is durable (fsynced,
/// with the default [`Durability::Immediate`](crate::Durability::Immediate); committed, on PostgreSQL),
/// and concurrent changes share one fsync or transaction (group commit).
/// On a file, reads and claims that can only replay or answer "in
/// progress" do not wait for the writer.
///
/// Two files hold an embedded store: the redb file at the given path (the
/// index) and the write-ahead log beside it at `<path>-wal` (see
/// [`Store::log_path`]). Keep them together; the log carries the store's
/// identity and is refused by any other store.
///
/// Dropping the store stops the background sweeper, lets the writer finish
/// every queued request, makes everything durable in the index (a final
/// checkpoint), and closes both files; on PostgreSQL it lets the
/// connections finish what they hold and closes them.
pub struct Store {
    // Field order is drop order: the sweeper and the lease extender stop
    // (and are joined) before the engine, whose drop then ends the writer
    // on this thread.
    _sweeper: Option<Sweeper>,
    /// Keeps the leases of `execute` calls and of HTTP handlers in flight
    /// alive: up to four threads, the first started on first need, all
    /// stopped on drop (features `agent`, `http`).
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) extender: crate::extender::Extender,
    /// Claims whose `claim_async` future was dropped in flight (they hold
    /// the engine: dropped before it).
    orphans: Orphans,
    engine: Arc<Engine>,
    config: Config,
    /// Wakes `execute` callers waiting on a key that another `execute` of
    /// this store holds (feature `agent`).
    #[cfg(feature = "agent")]
    pub(crate) waiters: crate::agent::Waiters,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.engine.path())
            .field("config", &self.config)
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
    /// integrity check, which reads the whole file) after an unclean
    /// shutdown, and after a clean close when the last check is older than
    /// [`Config::integrity_check_interval`] (24 h by default): a file
    /// damaged while closed is then refused rather than trusted. Between
    /// checks, a page damaged while closed is found by the record checksum,
    /// the online scrub, or `idemstore check`.
    ///
    /// # Errors
    /// - [`Error::AlreadyOpen`]: another `Store` in this or another process
    ///   holds the file (the second open fails at once, it does not wait).
    /// - [`Error::IncompatibleFile`]: not an idemstore file, or a newer
    ///   format; or a log that belongs to another store, is of another
    ///   format version, or is not a log (naming the log); or a store or
    ///   log path that is not a regular file (a directory, a fifo, a
    ///   device), or a non-empty log beside a missing or empty store file (its
    ///   store was deleted or moved), refused before anything is created.
    /// - [`Error::CorruptFile`]: the file is damaged. (A file the online
    ///   scrub marked damaged, `<path>-damaged`, opens read-only instead:
    ///   see [`Config::scrub_rate`].)
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
    /// would turn into a new store) or one that is not a regular file;
    /// otherwise as [`Store::open_with`].
    pub fn open_existing(path: impl AsRef<Path>, config: Config) -> Result<Store> {
        let path = path.as_ref();
        embedded::check_existing(path)?;
        Store::open_with(path, config)
    }

    /// Opens the store at `path` with `config`.
    ///
    /// # Errors
    /// As [`Store::open`], and [`Error::InvalidArgument`] for a zero
    /// retention, a zero or over-long lease, a zero sweep batch or interval,
    /// or a value limit over [`MAX_VALUE_LIMIT`](crate::MAX_VALUE_LIMIT).
    /// With [`Config::read_only`], [`Error::Missing`] and
    /// [`Error::IncompatibleFile`] as for [`Store::open_existing`]: a
    /// read-only open never creates a store.
    pub fn open_with(path: impl AsRef<Path>, config: Config) -> Result<Store> {
        let _span = tracing::debug_span!("idemstore.open_with").entered();
        let path = path.as_ref().to_path_buf();
        if config.read_only {
            embedded::check_existing(&path)?;
        }
        let log_path = embedded::log_path_of_file(&path);
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
        let log_path = embedded::log_path_of(&path);
        Store::open_inner(path, log_path, Some(backend), Some(Arc::new(log)), config)
    }

    /// Connects to the PostgreSQL store in `config`'s schema
    /// ([`Config::postgres_schema`], default `idemstore`) of the database
    /// at `url` (cargo feature `postgres`): a `postgresql://` URL or a
    /// `key=value` connection string, as libpq takes them. The schema is
    /// created on first connect (idempotent DDL under an advisory lock, so
    /// that replicas starting together do not race) and its version
    /// checked on every connect. Every replica of a service connects to
    /// the same schema and gets the same guarantees as one process on a
    /// file: one valid lease per key across all of them, fencing tokens
    /// from one sequence, one clock (the database's).
    ///
    /// The store's time is the database's clock (`clock_timestamp()`),
    /// read after the last lock wait of each transaction; a request on a
    /// record is decided at no earlier time than that record's last write,
    /// so a server clock that steps back makes granted leases and
    /// retentions last longer by the step, never shorter, and every
    /// replica decides alike;
    /// the app's clock is never read, unless a clock is given with
    /// [`Config::clock`], which then replaces the database's (for tests).
    ///
    /// Settings of the embedded engine (`durability`, `max_log_bytes`,
    /// `cache_bytes`, `read_cache_bytes`, `integrity_check_interval`) are
    /// refused. The file methods answer as follows: [`Store::path`] gives
    /// `postgresql://host:port/db?schema=name` (no credentials),
    /// [`Store::log_path`] an empty path, [`Store::flush`] and
    /// [`Store::checkpoint`] return at once (every acknowledged change is
    /// committed on the server), and [`Store::open_with_backend`] is the
    /// embedded engine's only.
    ///
    /// The server must keep `synchronous_commit` on (its default): with it
    /// off, the server acknowledges a commit before it is durable, and a
    /// server crash can lose an acknowledged claim, so a retry runs the
    /// work again. Failover keeps the guarantees only with synchronous
    /// replication (`synchronous_standby_names`): an asynchronous standby
    /// promoted after a crash may lack the last acknowledged claims and
    /// completions, with the same effect.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`]: a bad URL or schema name, a setting of
    ///   the embedded engine, or what [`Store::open_with`] refuses in
    ///   `config`.
    /// - [`Error::Unavailable`]: the server cannot be reached (safe to
    ///   retry).
    /// - [`Error::Misconfigured`]: no such database, the role refused or
    ///   its password wrong or missing, a privilege missing, the server's
    ///   certificate refused, the schema written by a newer idemstore, or
    ///   by an older one ([`ConfigFault::SchemaNotMigrated`](crate::ConfigFault):
    ///   a connect never upgrades it, `idemstore migrate` does), or a
    ///   store's schema missing its records, bindings or token sequence
    ///   ([`ConfigFault::SchemaDamaged`](crate::ConfigFault); never retry
    ///   as is).
    /// - [`Error::IncompatibleSchema`]: the schema is not an idemstore
    ///   schema (malformed meta rows, or another program's relations
    ///   named `records`, `bindings` or `tokens` in a schema without a
    ///   store: choose another schema).
    #[cfg(feature = "postgres")]
    pub fn connect(url: &str, config: Config) -> Result<Store> {
        let _span = tracing::debug_span!("idemstore.connect").entered();
        Store::connect_inner(url, config, false)
    }

    /// Connects to the PostgreSQL store in `config`'s schema of the
    /// database at `url` if it exists; never creates the schema or its
    /// tables (cargo feature `postgres`). For tools that inspect an
    /// existing store, as [`Store::open_existing`] is for files.
    ///
    /// # Errors
    /// [`Error::Missing`] (its path the store's name,
    /// `postgresql://host:port/db?schema=name`) when the schema holds no
    /// idemstore store; otherwise as [`Store::connect`].
    #[cfg(feature = "postgres")]
    pub fn connect_existing(url: &str, config: Config) -> Result<Store> {
        let _span = tracing::debug_span!("idemstore.connect_existing").entered();
        Store::connect_inner(url, config, true)
    }

    #[cfg(feature = "postgres")]
    fn connect_inner(url: &str, config: Config, must_exist: bool) -> Result<Store> {
        config.validate()?;
        config.check_postgres()?;
        let schema = config
            .postgres_schema
            .clone()
            .unwrap_or_else(|| crate::pg::DEFAULT_SCHEMA.to_string());
        let options = crate::pg::PgOptions {
            schema: schema.clone(),
            clock: config.clock_given.then(|| config.clock.clone()),
            retention_ms: crate::clock::duration_ms(config.retention),
            connections: config
                .postgres_connections
                .unwrap_or(crate::pg::DEFAULT_CONNECTIONS),
            must_exist,
            migrate: false,
            limits: config.postgres_limits.unwrap_or_default(),
            pooler: config.postgres_pooler.unwrap_or_default(),
        };
        let name = crate::pg::store_name(url, &schema);
        let engine = crate::pg::Postgres::connect(url, options).map_err(|e| match e {
            Error::Missing { .. } => Error::Missing { path: name.clone() },
            other => other,
        })?;
        Store::over(Engine::Postgres { engine, name }, config)
    }

    fn open_inner<B: redb::StorageBackend>(
        path: PathBuf,
        log_path: PathBuf,
        backend: Option<B>,
        log: Option<Arc<dyn LogFile>>,
        config: Config,
    ) -> Result<Store> {
        config.validate()?;
        config.check_embedded()?;
        let engine = Embedded::open(path, log_path, backend, log, config.clone())?;
        Store::over(Engine::Embedded(engine), config)
    }

    /// A store over an open `engine`, with the background sweeper that
    /// `config` asks for.
    fn over(engine: Engine, config: Config) -> Result<Store> {
        let engine = Arc::new(engine);
        let sweeper = crate::sweeper::start(&engine, &config)?;
        Ok(Store {
            _sweeper: sweeper,
            // `Store::extend` for a batch, in one write.
            #[cfg(any(feature = "agent", feature = "http"))]
            extender: crate::extender::Extender::new(&engine, extend_many),
            orphans: Orphans::default(),
            engine,
            config,
            #[cfg(feature = "agent")]
            waiters: crate::agent::Waiters::default(),
        })
    }

    /// What of the write-ahead log an open with `Config::accept_log_loss`
    /// (a salvage's copy) could not replay; `None` otherwise.
    pub(crate) fn log_lost(&self) -> Option<&str> {
        match &*self.engine {
            Engine::Embedded(e) => e.log_lost(),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => None,
        }
    }

    /// The file this store holds. On a PostgreSQL store: its server and
    /// schema as `postgresql://host[:port]/db?schema=name`, without the
    /// user, the password or the TLS options.
    pub fn path(&self) -> &Path {
        self.engine.path()
    }

    /// Whether this open created the store, as `create_new` tells in
    /// `std::fs::OpenOptions`: on the embedded engine, a new file (linked
    /// into place atomically, so of several processes creating the same
    /// path at once at most one is told `true`; the others open the store
    /// it made, or get [`Error::AlreadyOpen`]; and none is, when another
    /// process opened the new file before the one whose link made it),
    /// or an empty file or custom backend this open initialised; on PostgreSQL, a schema whose store
    /// this connection's DDL created (under the DDL advisory lock, so again
    /// one connection of several). `false` for every later open.
    /// A tool that removes what it created when it fails (`idemstore
    /// import --create`) asks this instead of looking for the file first,
    /// which another process may create in between.
    pub fn was_created(&self) -> bool {
        self.engine.was_created()
    }

    /// The store's write-ahead log: `<path>-wal` beside the store file. On
    /// a PostgreSQL store, an empty path (the server keeps its own log).
    pub fn log_path(&self) -> &Path {
        self.engine.log_path()
    }

    /// The store's current time (ms since the epoch), as defined on
    /// [`Clock`](crate::Clock) ("The store's time"): the wall clock's reading when it is ahead, else the
    /// last time taken from it plus the monotonic time elapsed since; never
    /// lower than a time returned before, across crashes too (the time is
    /// reserved durably before it is returned). On a store that refuses
    /// writes ([`Error::Poisoned`]) it stays at the last durable bound.
    /// On a store opened read-only ([`Config::read_only`]) it is the clock's
    /// reading, not reserved: the next open starts from the bound on disk,
    /// and may return a lower time than this store did.
    /// On PostgreSQL it is the database's clock, read with a round trip
    /// that waits at most `PostgresLimits::call_timeout`, and it steps back
    /// when that clock does (see `Store::connect`); while the server
    /// cannot be reached, the last time this process read (the connect
    /// reads it once; with [`Config::clock`](crate::Config::clock), that
    /// clock's reading then).
    pub fn now_ms(&self) -> u64 {
        self.engine.now_ms()
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
    ///   token counter is at [`MAX_TOKEN`](crate::MAX_TOKEN); nothing is written.
    /// - [`Error::Storage`], [`Error::Poisoned`], [`Error::Closed`]: the
    ///   store could not write. After a storage error the claim may or may
    ///   not be durable; a later claim finds out.
    /// - [`Error::ReadOnly`]: the store file was opened read-only
    ///   ([`Config::read_only`]); nothing was written. Every method that
    ///   changes records answers it (among the "storage errors as for
    ///   `claim`" that their docs refer to).
    pub fn claim(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        options: &ClaimOptions,
    ) -> Result<ClaimOutcome> {
        let _span =
            tracing::debug_span!("idemstore.claim", scope = key.scope(), id = key.id()).entered();
        let op = self.claim_op(fingerprint, options)?;
        self.give_back_orphans(&[key]);
        expect_claim(self.engine.apply(key, op))
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
    /// **A future dropped in flight** (an HTTP client that hung up, a
    /// cancelled task), after its claim was sent: the engine decides the
    /// claim all the same, and when it acquires the key nobody holds the
    /// lease. The store keeps such a claim and, before each later claim on
    /// this store (`claim`, `claim_async`, `claim_many`, of any key), looks
    /// at it without waiting: once decided, the lease it acquired is given
    /// back as the claim found the key, before that claim is made (the
    /// give-back of a key being claimed is waited for; those of other keys
    /// are queued, each a write of its own, and not waited for). Released
    /// when the key was absent (the next claim is a first attempt); failed
    /// retryably with the failure it found when it had failed retryably
    /// (the next claim is a takeover of that failure, as it would have
    /// been; the record's acquisitions count the abandoned claim). A
    /// takeover of a lapsed lease is left to lapse, so that the next claim
    /// is still told that an earlier holder may have acted, and so is a
    /// claim whose answer was lost (`OutcomeUnknown`). Until the lease is
    /// given back, the key answers [`ClaimOutcome::InProgress`]: to a claim
    /// made before the abandoned one was decided, or beside its give-back.
    /// At most 4,096 such claims are kept (past that the oldest is
    /// forgotten); one still kept when the store is dropped lapses as after
    /// a crash. A future dropped before its claim was sent (waiting for a
    /// time reservation or for room in the writer's queue) sent nothing.
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
            let op = self.claim_op(fingerprint, options)?;
            self.give_back_orphans_async(key).await;
            match self.engine.send_async(key, op).await? {
                Sent::Answered(reply) => expect_claim(reply),
                Sent::Pending(answer) => {
                    let claim: orphans::Claim = Box::pin(async move { expect_claim(answer.await) });
                    InFlight::new(claim, &self.orphans).await
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Gives back the leases that claims acquired for callers who stopped
    /// waiting for them, once decided (see [`Store::claim_async`]), before
    /// a claim of `keys`: the give-backs of those keys are waited for (so
    /// that the claim finds them applied), every other one is queued
    /// without waiting, so that no claim waits on another key's write.
    fn give_back_orphans(&self, keys: &[&Key]) {
        for (key, op) in self.orphans.collect() {
            if keys.contains(&&key) {
                if let Err(error) = self.engine.apply(&key, op) {
                    tracing::debug!(%key, %error, "an abandoned claim's lease was not given back");
                }
            } else {
                self.engine.apply_detached(&key, op);
            }
        }
    }

    /// [`Store::give_back_orphans`] from async code. Every give-back is
    /// queued before any is waited for, so one dropped part-way loses none.
    async fn give_back_orphans_async(&self, claimed: &Key) {
        let mut own = None;
        for (key, op) in self.orphans.collect() {
            if &key == claimed {
                own = Some((key, op));
            } else {
                self.engine.apply_detached(&key, op);
            }
        }
        if let Some((key, op)) = own
            && let Err(error) = self.engine.apply_async(&key, op).await
        {
            tracing::debug!(%key, %error, "an abandoned claim's lease was not given back");
        }
    }

    /// Claims several keys in one write: one outcome per claim, in input
    /// order. Each claim is decided as if it were claimed alone (with
    /// [`Store::claim`]'s outcomes and errors), one after another, so this
    /// is not atomic across keys: some may be acquired while others are in
    /// progress, replay or fail. A key given twice is decided twice: the
    /// second claim with the same fingerprint answers
    /// [`ClaimOutcome::InProgress`] (the first holds the key now), with
    /// another fingerprint [`Error::FingerprintMismatch`]. Every acquired
    /// lease is durable when this returns, and all of them share one
    /// commit (one fsync; one transaction on PostgreSQL), which is what
    /// makes this faster than as many [`Store::claim`] calls.
    ///
    /// `options` apply to every claim. A business key binds one operation,
    /// so `claim_many` refuses options that carry one: claim such keys with
    /// [`Store::claim`].
    ///
    /// # Errors
    /// The outer `Err` is about the batch as a whole; what it means for the
    /// claims depends on the error:
    /// - [`Error::InvalidArgument`] for more than [`MAX_CLAIM_MANY`] claims,
    ///   options with a business key, or an invalid lease: refused before
    ///   anything was written; nothing was applied.
    /// - [`Error::Poisoned`], [`Error::Closed`], [`Error::ReadOnly`]:
    ///   refused before the batch was written; nothing was applied.
    /// - [`Error::Storage`] (a write or fsync of the log failed after the
    ///   batch was written to it) and, on PostgreSQL, [`Error::OutcomeUnknown`]
    ///   (the connection was lost after the commit was sent): the batch may
    ///   or may not be applied, as a whole (a batch is never half applied).
    ///   Where it was, its keys are held by leases whose tokens the caller
    ///   never received; they lapse after the lease duration. A later claim
    ///   of each key finds out: [`ClaimOutcome::InProgress`] while such a
    ///   lease is valid, [`ClaimOutcome::Acquired`] when the batch was not
    ///   applied or its lease lapsed. A key the batch did not acquire
    ///   answers as it did inside the batch (a replay, in progress under
    ///   another holder, a fingerprint mismatch), unless it changed since.
    ///   On the file engine, a storage error first makes the store refuse
    ///   writes ([`Error::Poisoned`]) until it is reopened: reopen it, then
    ///   retry the same batch, which finds out as above (on PostgreSQL,
    ///   retry at once). A key taken over after such a lease lapsed is
    ///   acquired as a takeover ([`Lease::is_takeover`](crate::Lease::is_takeover)
    ///   is true, since the lost batch acquired it once) though no work ran
    ///   under the lost lease: the caller that knows the batch failed may
    ///   treat it as a first attempt; `Store::execute` (feature `agent`)
    ///   treats it as in doubt.
    /// - [`Error::Unavailable`] (PostgreSQL): nothing was sent for commit;
    ///   nothing was applied.
    /// - [`Error::Misconfigured`] (PostgreSQL): the store cannot work as
    ///   configured (a refused role, a missing privilege, a schema from a
    ///   newer build: see the variant); nothing was applied, and a retry as
    ///   is gets the same answer.
    ///
    /// Each inner `Err` is that claim's own refusal, as [`Store::claim`]
    /// gives it ([`Error::FingerprintMismatch`], [`Error::CorruptRecord`],
    /// [`Error::TokensExhausted`]).
    pub fn claim_many(
        &self,
        claims: &[(Key, Fingerprint)],
        options: &ClaimOptions,
    ) -> Result<Vec<Result<ClaimOutcome>>> {
        let _span = tracing::debug_span!("idemstore.claim_many", claims = claims.len()).entered();
        if claims.len() > MAX_CLAIM_MANY {
            return Err(Error::invalid(
                "claims",
                format!(
                    "{} claims, more than MAX_CLAIM_MANY ({MAX_CLAIM_MANY})",
                    claims.len()
                ),
            ));
        }
        if options.business_key.is_some() {
            return Err(Error::invalid(
                "business_key",
                "claim_many applies its options to every key; claim a key with a business key on its own",
            ));
        }
        let mut ops = Vec::with_capacity(claims.len());
        for (key, fingerprint) in claims {
            ops.push((key.clone(), self.claim_op(fingerprint, options)?));
        }
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&Key> = claims.iter().map(|(key, _)| key).collect();
        self.give_back_orphans(&keys);
        Ok(self
            .engine
            .apply_many(ops)?
            .into_iter()
            .map(expect_claim)
            .collect())
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
    /// - [`Error::Storage`], [`Error::Poisoned`], [`Error::Closed`],
    ///   [`Error::ReadOnly`]: as for [`Store::claim`]; after a storage error
    ///   the completion may or may not be durable ([`Store::get`] after
    ///   reopening tells).
    pub fn complete(&self, lease: &Lease, result: &[u8]) -> Result<Record> {
        let _span = tracing::debug_span!(
            "idemstore.complete",
            scope = lease.key().scope(),
            id = lease.key().id()
        )
        .entered();
        let op = self.complete_op(lease, result)?;
        expect_record(self.engine.apply(lease.key(), op))
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
            let op = self.complete_op(lease, result)?;
            expect_record(self.engine.apply_async(lease.key(), op).await)
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
        let op = self.fail_op(lease, failure, retryable)?;
        expect_record(self.engine.apply(lease.key(), op))
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
            let op = self.fail_op(lease, failure, retryable)?;
            expect_record(self.engine.apply_async(lease.key(), op).await)
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
            .fail_op(lease, failure, true)
            .or_else(|_| self.fail_op(lease, &[], true));
        if let Ok(op) = op {
            self.engine.apply_detached(lease.key(), op);
        }
    }

    /// What a retryable failure that nothing replays is kept as: `failure`
    /// within `max_failure_bytes`, else `null`, else nothing, so that it
    /// is always recorded and the next call runs the work again (feature
    /// `agent`).
    #[cfg(feature = "agent")]
    pub(crate) fn kept_retryable_failure<'a>(&self, failure: &'a [u8]) -> &'a [u8] {
        let limit = self.config.max_failure_bytes;
        if failure.len() <= limit {
            failure
        } else if b"null".len() <= limit {
            b"null"
        } else {
            b""
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
        expect_released(self.engine.apply(lease.key(), op))
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
            expect_released(self.engine.apply_async(lease.key(), op).await)
        }
        .instrument(span)
        .await
    }

    /// [`Store::release_async`], unless this lease saved a recovery point
    /// (its holder acted): the record is then failed retryably with
    /// `failure` (empty when over the store's failure limit), keeping the
    /// recovery point and acquisitions for the next attempt. One
    /// transition, so a recovery point saved by a clone of the lease just
    /// before is never deleted. `Ok(true)` when released, `Ok(false)` when
    /// kept.
    ///
    /// # Errors
    /// As [`Store::release`].
    #[cfg(feature = "http")]
    pub(crate) async fn release_unless_acted_async(
        &self,
        lease: &Lease,
        failure: &[u8],
    ) -> Result<bool> {
        let failure = if failure.len() > self.config.max_failure_bytes {
            Vec::new()
        } else {
            failure.to_vec()
        };
        let op = Op::ReleaseUnlessActed {
            token: lease.token(),
            failure,
        };
        match self.engine.apply_async(lease.key(), op).await? {
            Reply::Released => Ok(true),
            Reply::Record(_) => Ok(false),
            _ => Err(Error::Storage(
                "the engine answered a release with another reply".into(),
            )),
        }
    }

    /// Extends the lease to at least `now + lease` (whole milliseconds, 1 ms
    /// to [`MAX_LEASE`](crate::MAX_LEASE)); a lease is never shortened. Retention is pushed out
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
        expect_record(self.engine.apply(lease.key(), op)).map(|r| r.lease_until_ms)
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
            expect_record(self.engine.apply_async(lease.key(), op).await).map(|r| r.lease_until_ms)
        }
        .instrument(span)
        .await
    }

    /// Writes `op`, the outcome of `lease` (a completion or a failure, built
    /// by [`Store::complete_op`] or [`Store::fail_op`]), that a PostgreSQL
    /// store ends by `deadline` (see `Engine::apply_many_by`): `execute`'s
    /// outcome, retried on another connection past it.
    #[cfg(feature = "agent")]
    pub(crate) fn write_outcome_by(
        &self,
        lease: &Lease,
        op: Op,
        deadline: std::time::Instant,
    ) -> Result<Record> {
        expect_record(self.engine.apply_by(lease.key(), op, deadline))
    }

    /// Writes `op`, the outcome of `lease`, as any write is (on PostgreSQL
    /// group-committed, on the hot path when it can be), waiting for its
    /// answer until `deadline` at most: past it, [`Error::OutcomeUnknown`]
    /// (the write may still land). The first attempt of an outcome's write
    /// (`renewal::Attempts::attempt_async`).
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) async fn write_outcome_within_async(
        &self,
        lease: &Lease,
        op: Op,
        deadline: std::time::Instant,
    ) -> Result<Record> {
        expect_record(
            self.engine
                .apply_async_within(lease.key(), op, deadline)
                .await,
        )
    }

    /// Queues `op`, the outcome of `lease`, without waiting for it: the
    /// write of a caller that went away before it was sent.
    #[cfg(feature = "http")]
    pub(crate) fn write_outcome_detached(&self, lease: &Lease, op: Op) {
        self.engine.apply_detached(lease.key(), op);
    }

    /// [`Store::write_outcome_by`] from async code.
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) async fn write_outcome_by_async(
        &self,
        lease: &Lease,
        op: Op,
        deadline: std::time::Instant,
    ) -> Result<Record> {
        expect_record(self.engine.apply_async_by(lease.key(), op, deadline).await)
    }

    /// [`Store::extend_async`] that a PostgreSQL store ends by `deadline`
    /// (see `Engine::apply_many_by`): `execute_async`'s and the HTTP
    /// layer's lease renewals.
    #[cfg(any(feature = "agent", feature = "http"))]
    pub(crate) async fn extend_by_async(
        &self,
        lease: &Lease,
        duration: Duration,
        deadline: std::time::Instant,
    ) -> Result<u64> {
        let lease_ms = check_lease("lease", duration)?;
        let op = Op::Extend {
            token: lease.token(),
            lease_ms,
        };
        expect_record(self.engine.apply_async_by(lease.key(), op, deadline).await)
            .map(|r| r.lease_until_ms)
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
        let op = self.recovery_point_op(lease, bytes)?;
        expect_record(self.engine.apply(lease.key(), op)).map(|_| ())
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
            let op = self.recovery_point_op(lease, bytes)?;
            expect_record(self.engine.apply_async(lease.key(), op).await).map(|_| ())
        }
        .instrument(span)
        .await
    }

    /// The record of `key`, or `None` when absent or past retention (whether
    /// or not it was evicted). Does not wait for the writer, except for a
    /// change of `key` that is not yet durable, and for a renewal of the
    /// store's time reservation when the time has outrun it (reads that ran
    /// for about a second without writes; see [`Clock`](crate::Clock), "The store's
    /// time").
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] when the stored record is damaged,
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read; [`Error::CorruptFile`] also for a key without a live record
    /// (absent or past retention) in a store the
    /// online scrub found damaged (see [`Config::scrub_rate`]), where the
    /// damage can hide a stored key, so absence is not an answer.
    pub fn get(&self, key: &Key) -> Result<Option<Record>> {
        let _span =
            tracing::debug_span!("idemstore.get", scope = key.scope(), id = key.id()).entered();
        self.engine.get(key)
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
        async move { self.engine.get_async(key).await }
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
        self.engine.sweep(max_records)
    }

    /// Evicts every record past retention now, as the background sweeper
    /// does, and returns how many it removed: for a service that runs its
    /// own schedule (`Config::sweep_interval(None)`). It never stalls the
    /// writes beside it: it works in slices of at most
    /// [`Config::sweep_batch`] records and, on the file engine, at most 256
    /// records and 1 ms of the writer's time each (plus one eviction, 6 to
    /// 40 µs measured; both doubled after the sweep's first second and
    /// again after its second), and leaves the writer to other writes for
    /// seven times as long as each slice took, counting what earlier
    /// slices' evictions cost the writer since (the commits that apply
    /// them and write their index pages, a checkpoint's sync included): it
    /// starts at an eighth of the writer's time however many records are
    /// due (at a quarter, a backlog's sweep took the write rate of 16
    /// threads on the disk to 0.69× of no sweep, and a slow 1-s window to
    /// below half). Each second it evicts less than one and a half times
    /// what came due meanwhile, it is falling behind and takes one share
    /// more (a quarter, a third, half, then at most two thirds), one less
    /// once it evicts three times that. On the file engine it also yields
    /// to a congested disk: while the log's fsync of the last closed
    /// quarter second takes one and a half times its best quarter-second
    /// mean of the last minute (and 250 µs more), it steps one share down
    /// (from an eighth to a sixteenth), at twice (and 500 µs more) two (a
    /// thirty-second), as LEDBAT (RFC 6817) yields to other traffic when
    /// the delay rises above its base; not while it is falling behind
    /// what comes due (a sweep that yielded then kept about a million
    /// records awaiting eviction under 64 threads of fresh keys). It
    /// returns when none is due (records that fall due meanwhile are
    /// evicted too) and every eviction is durable.
    ///
    /// # Errors
    /// Storage errors as for [`Store::claim`]. Slices are answered before
    /// they are durable, so evictions of slices before the error may be
    /// lost with the batch that failed (the store is then poisoned);
    /// records past retention read as absent either way.
    pub fn sweep_due(&self) -> Result<usize> {
        let _span = tracing::debug_span!("idemstore.sweep_due").entered();
        crate::sweeper::sweep_paced(
            &self.engine,
            self.config.sweep_batch,
            &std::sync::atomic::AtomicBool::new(false),
        )
    }

    /// Runs one step of the online scrub now: walks up to `max_records`
    /// records (at least one) after where the last step stopped, in key order, and checks each as
    /// the background scrub does (see [`Config::scrub_rate`]): the keys in
    /// order, a lookup of each key finding the same record, the record's
    /// checksum, its expiry index entry. The step that reaches the key that
    /// was last when the pass started says so
    /// ([`ScrubReport::pass_finished`]), and the next starts a new pass; the
    /// background scrub and this call share one position. The writer's
    /// open transaction is committed first, so the step sees every change
    /// acknowledged before the call.
    ///
    /// Damage found (anything but a missing expiry entry) makes the store
    /// refuse writes ([`Error::Poisoned`]) while reads, scans and exports
    /// still answer (a [`Store::get`] of a key without a live record
    /// answers [`Error::CorruptFile`]: the damage may hide it), and leaves the file `<path>-damaged` beside the store
    /// file, which makes every later open read-only too, by any name of
    /// the file (the step then asks the writer for a checkpoint, which
    /// records the marker in the store; see [`Config::scrub_rate`] for the
    /// restore). A step of `max_records`
    /// holds its snapshot, and the position the background scrub shares,
    /// for about 1.3 µs per record with the file cached.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] on a PostgreSQL store (the server
    ///   checks its own pages: enable data checksums there).
    /// - [`Error::Storage`] when the file cannot be read for a reason other
    ///   than damage (after 10 such failures in a row at one place, the
    ///   place is reported as damage), or the writer's commit fails; damage
    ///   is reported in the [`ScrubReport`], not as an error.
    /// - [`Error::Poisoned`] or [`Error::Closed`] from the writer's commit
    ///   (a store already poisoned is walked without it).
    pub fn scrub(&self, max_records: usize) -> Result<ScrubReport> {
        let _span = tracing::debug_span!("idemstore.scrub").entered();
        self.engine.scrub(max_records, true).unwrap_or_else(|| {
            Err(Error::invalid(
                "scrub",
                "the online scrub is the embedded engine's; PostgreSQL checks its own pages (data checksums)",
            ))
        })
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
        self.check_outcome_len(&outcome)?;
        expect_record(self.engine.apply(key, Op::Resolve { token, outcome }))
    }

    /// [`Error::TooLarge`] when `outcome`'s bytes are over their limit
    /// (`max_result_bytes` or `max_failure_bytes`).
    fn check_outcome_len(&self, outcome: &Resolution) -> Result<()> {
        let (what, limit) = match outcome {
            Resolution::Succeeded(_) => ("result", self.config.max_result_bytes),
            Resolution::Failed { .. } => ("failure", self.config.max_failure_bytes),
        };
        check_len(what, outcome.bytes().len(), limit)
    }

    /// Replaces the stored outcome of a *finished* record of `key`
    /// (succeeded or failed) whose fencing token is `token`: the operator's
    /// correction of an outcome recorded wrongly, for example a result that
    /// the code replaying it cannot decode (a record made by
    /// `Store::execute` (feature `agent`) replays its result as JSON). The record
    /// keeps its token and fingerprint, takes `outcome`'s state and bytes,
    /// and its retention is counted from now. What a finished record
    /// replays is the one thing retries rely on, so this is for an operator
    /// who knows what happened downstream, never for a service's own code
    /// path. Durable when this returns; audited with cause `resolve`.
    ///
    /// A `retryable` failure makes the next claim run the work again, as
    /// after any retryable failure.
    ///
    /// # Errors
    /// - [`Error::StaleLease`] when `key` has no live finished record whose
    ///   token is `token` (absent, past retention, still Processing — use
    ///   [`Store::resolve`] — or another token).
    /// - [`Error::TooLarge`] when the result is over `max_result_bytes` or
    ///   the failure over `max_failure_bytes`.
    /// - Storage errors as for [`Store::complete`].
    pub fn amend(&self, key: &Key, token: u64, outcome: Resolution) -> Result<Record> {
        let _span =
            tracing::debug_span!("idemstore.amend", scope = key.scope(), id = key.id()).entered();
        self.check_outcome_len(&outcome)?;
        expect_record(self.engine.apply(key, Op::Amend { token, outcome }))
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
    /// be opened; on PostgreSQL [`Error::Unavailable`] as for
    /// [`Store::scan`]; the iterator yields per-record errors.
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
    /// be opened; on PostgreSQL [`Error::Unavailable`] when the first page
    /// takes longer than
    /// [`PostgresLimits::call_timeout`](crate::PostgresLimits::call_timeout),
    /// the wait for a connection included: each scan holds one of its own
    /// until it ends or is dropped, at most
    /// [`PostgresLimits::scans`](crate::PostgresLimits::scans) at once.
    pub fn scan(&self, filter: &Filter) -> Result<Records> {
        let _span = tracing::debug_span!("idemstore.scan").entered();
        filter.check()?;
        let snapshot = self.engine.snapshot()?;
        let entries = snapshot.entries(filter.ranges())?;
        Ok(Records::new(entries, filter.clone(), self.engine.now_ms()))
    }

    /// The numbers an operator alerts on: records by state, the age of the
    /// oldest Processing record, the file size, and counters since open
    /// (see [`Stats`] and [`Counters`](crate::Counters)).
    ///
    /// Cost, on the file engine: the counters are free (atomics); the
    /// counts by state are kept in the store's metadata, and the records
    /// awaiting eviction (expired, not yet evicted) are counted per second
    /// of expiry in a table of their own, both written in the same
    /// transaction as the records they count. A call reads the counts by
    /// state, a 40-byte row per second past that still has records
    /// awaiting eviction, the expiry index's entries of the current second
    /// (each names its record's state, so no record is read), and the
    /// records in flight (the expiry index holds them in a range of their
    /// own): its work grows with the records in flight, one second of
    /// finished records and the seconds of backlog (at most a row per
    /// record awaiting eviction), not with how many records each of those
    /// seconds holds or with the store's size (`idemstore stats`, whole
    /// process, 5 ms with 1,000,000 records awaiting eviction). It first asks the writer to
    /// commit its open index transaction (milliseconds). Every field is exact for the read
    /// snapshot. `records.corrupt` counts only envelopes whose state cannot
    /// be read; a record damaged otherwise is counted in its state, and
    /// [`Store::verify`] (or `idemstore check`), which reads every record,
    /// names every damaged one. On PostgreSQL the counts come from one
    /// aggregate statement over the rows' state and time columns, run on
    /// one of the engine's connections after the store's time is read
    /// there, the two under one deadline: the server reads every row,
    /// O(records), and sends none (170–220 ms at 500,000–630,000 rows on
    /// an idle 2-core machine, 0.2–0.9 s there beside 16 writing threads;
    /// tens of millions of rows would reach `call_timeout`);
    /// `records.corrupt` counts the rows whose state column is none of the
    /// four, and a row damaged otherwise is counted in its state (or in
    /// `expired` past its expiry). It does not block the writer. Poll it
    /// at dashboard rates (seconds), not per request.
    ///
    /// # Errors
    /// [`Error::Poisoned`] after a failed durable write (the index may hold
    /// changes that never became durable; reopen the store);
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read (or its stored counts are malformed). On PostgreSQL,
    /// [`Error::Unavailable`] when the server cannot be reached or the
    /// statement outlasts `PostgresLimits::call_timeout` or
    /// `statement_timeout`.
    pub fn stats(&self) -> Result<Stats> {
        let _span = tracing::debug_span!("idemstore.stats").entered();
        // A poisoned store's index may hold changes that never became
        // durable: refuse, as scan, export and verify do.
        let snapshot = self.engine.snapshot()?;
        let (now_ms, records, oldest) = snapshot.counts_now(|| self.engine.now_ms())?;
        Ok(Stats {
            now_ms,
            records,
            oldest_processing_age_ms: oldest.map(|c| now_ms.saturating_sub(c)),
            file_bytes: self.engine.file_bytes(),
            counters: self.engine.counters().snapshot(),
        })
    }

    /// Reads [`stats`](Self::stats) and sets the store's gauges in the
    /// `metrics` facade from it (`idemstore_records{state}`,
    /// `idemstore_in_progress_lapsed_records`,
    /// `idemstore_oldest_in_progress_age_seconds`; see
    /// [`idemstore::metrics`](crate::metrics)). It costs what `stats` costs:
    /// call it when the exporter is scraped or on a timer of seconds, not
    /// per request. Cargo feature `metrics`.
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
    /// while it runs. `progress` is called after each record. "Live" is at
    /// the store's time; on a store opened read-only
    /// ([`Config::read_only`]), at the time bound its open found on disk,
    /// not this host's clock, so that a host whose clock is ahead leaves out
    /// no record still live for the service (and the stream's clock mark
    /// imports there).
    ///
    /// # Errors
    /// [`Error::CorruptRecord`] when a stored record fails its checksum
    /// (the export stops: run `idemstore check`); [`Error::Storage`] when
    /// `out` fails or the file cannot be read; [`Error::CorruptFile`]; on
    /// PostgreSQL [`Error::Unavailable`] as for [`Store::scan`].
    pub fn export(
        &self,
        out: impl std::io::Write,
        progress: impl FnMut(Progress),
    ) -> Result<ExportSummary> {
        let _span = tracing::debug_span!("idemstore.export").entered();
        let snapshot = self.engine.snapshot()?;
        // The entries first: on PostgreSQL the counter read after them is
        // above every token they hold.
        let entries = snapshot.entries(all_keys())?;
        let (store_id, next_token) = snapshot.meta()?;
        let now_ms = self.engine.export_ms();
        backup::export(store_id, next_token, entries, now_ms, out, progress)
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
    ///   stream twice changes no record the second time (import is
    ///   idempotent; the token counter may still move on with the clock, see
    ///   [`ImportSummary::next_token`](crate::ImportSummary::next_token)).
    ///   Records already past retention and records whose business key
    ///   another live key holds are skipped.
    /// - The stream is validated input. The meta frame is checked before
    ///   anything is written: its token counter must not be above
    ///   [`MAX_TOKEN`](crate::MAX_TOKEN), and its clock high-water mark not more than
    ///   `options`' clock tolerance (default 5 minutes) ahead of the store's
    ///   clock. Every record is checked as it is read: its token below
    ///   [`MAX_TOKEN`](crate::MAX_TOKEN), its update time within the tolerance, its lease
    ///   ending at most [`MAX_LEASE`](crate::MAX_LEASE) and its expiry at most
    ///   [`MAX_RETENTION`](crate::MAX_RETENTION) after its last update, a Processing record's
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
    /// before it stay imported. Storage errors as for [`Store::claim`]
    /// ([`Error::ReadOnly`] on a store opened read-only, before anything is
    /// written).
    pub fn import_with(
        &self,
        input: impl std::io::Read,
        options: &ImportOptions,
        progress: impl FnMut(Progress),
    ) -> Result<ImportSummary> {
        let _span = tracing::debug_span!("idemstore.import_with").entered();
        let engine = &self.engine;
        // One reading for the whole import: the tolerance is measured from
        // where the store's time and the wall clock stood when it began.
        let (started, wall_ms) = engine.import_clock()?;
        let now = move || started;
        let limits = ImportLimits {
            options: *options,
            now_ms: &now,
            wall_ms,
            max_result_bytes: self.config.max_result_bytes,
            max_failure_bytes: self.config.max_failure_bytes,
            max_recovery_point_bytes: self.config.max_recovery_point_bytes,
        };
        let mut summary = backup::import(input, &limits, progress, |batch| {
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
            engine.import_batch(ops, batch.token_floor, batch.clock_floor)
        })?;
        summary.next_token = engine.next_token()?;
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
    /// expiry index entry, and that business-key bindings and records agree;
    /// on a store file also that the counts `stats` reads (by state, and of
    /// the records awaiting eviction per second of expiry) agree with the
    /// records and the expiry index. On PostgreSQL: every row's checksum and decoding, that its query
    /// columns (token, state, creation, lease and expiry times, which
    /// eviction, `stats` and the compare-and-set read) agree with its
    /// record, as a request on that key checks, that its token is below
    /// the token sequence, that business-key bindings and records
    /// agree, that no key is held by two rows, and that the key columns
    /// of the records and bindings tables still have their unique index
    /// (a primary key dropped outside idemstore).
    /// [`CheckReport::bindings`] counts the bindings read.
    /// Reads one snapshot while the store keeps serving. redb's own page
    /// integrity check needs the file to itself: see [`check_file`](crate::check_file).
    ///
    /// # Errors
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read; on PostgreSQL [`Error::Unavailable`] when the connection
    /// breaks or a page of the scan takes longer than
    /// [`PostgresLimits::call_timeout`](crate::PostgresLimits::call_timeout),
    /// or when every one of the
    /// [`PostgresLimits::scans`](crate::PostgresLimits::scans) connections
    /// is held by another scan for that long.
    /// Damaged records and bindings are reported in the [`CheckReport`],
    /// not as errors.
    pub fn verify(&self, progress: impl FnMut(Progress)) -> Result<CheckReport> {
        let _span = tracing::debug_span!("idemstore.verify").entered();
        self.engine.verify(progress)
    }

    /// How many records the file holds, including expired records that are
    /// not yet evicted.
    ///
    /// # Errors
    /// [`Error::CorruptFile`] or [`Error::Storage`] when the file cannot be
    /// read.
    pub fn len(&self) -> Result<u64> {
        self.engine.len()
    }

    /// Makes every change acknowledged so far durable, and returns when it
    /// is. With [`Durability::Buffered`](crate::Durability::Buffered) this forces the log's fsync now
    /// instead of within `max_delay`; with [`Durability::Immediate`](crate::Durability::Immediate)
    /// acknowledged changes are durable already and this returns at once.
    ///
    /// # Errors
    /// [`Error::Poisoned`] when a durable write failed (the changes may or
    /// may not be durable; reopen the store to find out), [`Error::Closed`]
    /// when the store's syncer is gone.
    ///
    /// On a PostgreSQL store this returns at once: every acknowledged
    /// change is committed on the server.
    pub fn flush(&self) -> Result<()> {
        let _span = tracing::debug_span!("idemstore.flush").entered();
        self.engine.flush()
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
    ///
    /// On a PostgreSQL store this returns at once (the server checkpoints
    /// on its own).
    pub fn checkpoint(&self) -> Result<()> {
        let _span = tracing::debug_span!("idemstore.checkpoint").entered();
        self.engine.checkpoint()
    }

    /// Whether the file holds no record at all.
    ///
    /// # Errors
    /// As [`Store::len`].
    pub fn is_empty(&self) -> Result<bool> {
        self.len().map(|n| n == 0)
    }
}

/// [`Store::extend`] for a batch of leases, in one write (one commit):
/// each lease's new deadline or its error, in order. A PostgreSQL store
/// ends the write by `deadline` (see `Engine::apply_many_by`).
#[cfg(any(feature = "agent", feature = "http"))]
fn extend_many(
    engine: &Engine,
    leases: &[(Lease, Duration)],
    deadline: std::time::Instant,
) -> Vec<Result<u64>> {
    let mut checked = Vec::with_capacity(leases.len());
    let mut ops = Vec::with_capacity(leases.len());
    for (lease, duration) in leases {
        match check_lease("lease", *duration) {
            Ok(lease_ms) => {
                checked.push(Ok(()));
                let op = Op::Extend {
                    token: lease.token(),
                    lease_ms,
                };
                ops.push((lease.key().clone(), op));
            }
            Err(e) => checked.push(Err(e)),
        }
    }
    let mut applied = match engine.apply_many_by(ops, deadline) {
        Ok(replies) => replies.into_iter(),
        // The write failed for every lease; `Error` is not `Clone`, so
        // each gets the same kind of error, with its message.
        Err(e) => {
            return leases
                .iter()
                .map(|_| {
                    Err(match &e {
                        Error::Poisoned { cause } => Error::Poisoned {
                            cause: cause.clone(),
                        },
                        Error::Closed => Error::Closed,
                        Error::Unavailable { detail } => Error::Unavailable {
                            detail: detail.clone(),
                        },
                        Error::OutcomeUnknown { detail } => Error::OutcomeUnknown {
                            detail: detail.clone(),
                        },
                        Error::Misconfigured { fault, detail } => Error::Misconfigured {
                            fault: *fault,
                            detail: detail.clone(),
                        },
                        other => Error::Storage(other.to_string()),
                    })
                })
                .collect();
        }
    };
    checked
        .into_iter()
        .map(|c| {
            c?;
            let reply = applied
                .next()
                .unwrap_or_else(|| Err(Error::Storage("the engine answered fewer replies".into())));
            expect_record(reply).map(|r| r.lease_until_ms)
        })
        .collect()
}

fn check_len(what: &'static str, len: usize, limit: usize) -> Result<()> {
    if len > limit {
        return Err(Error::TooLarge { what, len, limit });
    }
    Ok(())
}

impl Store {
    /// The damage marker that keeps this store read-only (see
    /// [`Config::scrub_rate`]): `None` unless the scrub found the store
    /// damaged, in this process or before this open (for `check_file`).
    pub(crate) fn damage_marker(&self) -> Option<&Path> {
        self.engine.damage_marker()
    }

    /// The lease a claim takes when its options name none
    /// ([`Config::lease`]).
    #[cfg(any(feature = "agent", test))]
    pub(crate) fn default_lease(&self) -> Duration {
        self.config.lease
    }

    /// The engine underneath (for the crate's own tests, and for
    /// `idemstore::postgres::complete_in`).
    #[cfg(any(test, feature = "postgres"))]
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    fn claim_op(&self, fingerprint: &Fingerprint, options: &ClaimOptions) -> Result<Op> {
        let lease_ms = check_lease("lease", options.lease.unwrap_or(self.config.lease))?;
        if let Some(bk) = &options.business_key {
            check_business_key(bk)?;
        }
        Ok(Op::Claim {
            fingerprint: fingerprint.clone(),
            lease_ms,
            business_key: options.business_key.clone(),
        })
    }

    pub(crate) fn complete_op(&self, lease: &Lease, result: &[u8]) -> Result<Op> {
        check_len("result", result.len(), self.config.max_result_bytes)?;
        Ok(Op::Complete {
            token: lease.token(),
            result: result.to_vec(),
        })
    }

    pub(crate) fn fail_op(&self, lease: &Lease, failure: &[u8], retryable: bool) -> Result<Op> {
        check_len("failure", failure.len(), self.config.max_failure_bytes)?;
        Ok(Op::Fail {
            token: lease.token(),
            failure: failure.to_vec(),
            retryable,
        })
    }

    fn recovery_point_op(&self, lease: &Lease, bytes: &[u8]) -> Result<Op> {
        check_len(
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

fn expect_claim(reply: Result<Reply>) -> Result<ClaimOutcome> {
    match reply? {
        Reply::Claim(c) => Ok(c),
        _ => Err(Error::Storage(
            "the engine answered a claim with another reply".into(),
        )),
    }
}

fn expect_record(reply: Result<Reply>) -> Result<Record> {
    match reply? {
        Reply::Record(r) => Ok(r),
        _ => Err(Error::Storage(
            "the engine answered with another reply".into(),
        )),
    }
}

fn expect_released(reply: Result<Reply>) -> Result<()> {
    match reply? {
        Reply::Released => Ok(()),
        _ => Err(Error::Storage(
            "the engine answered a release with another reply".into(),
        )),
    }
}
