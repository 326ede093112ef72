//! Store configuration and the limits every engine enforces: [`Config`],
//! [`Durability`], [`ClaimOptions`], and the caps on leases, retention,
//! value sizes and tokens.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock, duration_ms};
use crate::error::{Error, Result};

/// The largest value limit [`Config`] accepts for results, failures and
/// recovery points: 16 MiB (in bytes).
pub const MAX_VALUE_LIMIT: usize = 16 * 1024 * 1024;
/// The most claims one [`Store::claim_many`](crate::Store::claim_many)
/// call takes: 1,024 (the size of one import batch).
pub const MAX_CLAIM_MANY: usize = 1024;
/// The longest lease a claim or extend accepts: 30 days.
pub const MAX_LEASE: Duration = Duration::from_secs(30 * 24 * 3600);
/// The shortest lease that [`Store::execute`](crate::Store::execute) (and
/// so the MCP server) and the HTTP layer accept: 100 ms. They renew a lease
/// every third of it while the work runs, and each renewal is a durable
/// write that must land before the lease lapses; a lease of a few
/// milliseconds lapses under a live holder whenever a write takes longer,
/// and a retry then runs the work a second time. A plain
/// [`Store::claim`](crate::Store::claim), whose holder extends its own
/// lease, accepts 1 ms.
pub const MIN_RENEWED_LEASE: Duration = Duration::from_millis(100);
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

/// Tokens per millisecond of the clock that a token counter is started or
/// raised at: a new PostgreSQL schema's sequence starts at the database
/// clock's milliseconds times this, and an import raises a store's counter
/// to the latest of the stream's times and the store's clock, in
/// milliseconds, times this. A store created or filled again (over a
/// schema dropped under running replicas, or from an export whose source
/// kept serving) then never hands out a token of the other life, unless
/// that life drew more than this many tokens a millisecond on average.
pub(crate) const TOKENS_PER_MS: u64 = 1 << 10;

/// The latest clock reading (ms since the epoch, 2^42: in the year 2109)
/// that [`TOKENS_PER_MS`] counts; later readings count as this one, so
/// that a counter from the clock stays below 2^52 (exact in any JSON
/// reader, with room for 2^52 more tokens).
pub(crate) const TOKEN_CLOCK_CAP_MS: u64 = 1 << 42;

/// The token counter a clock reading of `ms` (ms since the epoch) gives:
/// `min(ms, TOKEN_CLOCK_CAP_MS) × TOKENS_PER_MS`, at most 2^52.
pub(crate) fn clock_tokens(ms: u64) -> u64 {
    ms.min(TOKEN_CLOCK_CAP_MS) * TOKENS_PER_MS
}

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
    /// takes). Readers see acknowledged changes at once. [`Store::flush`](crate::Store::flush)
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

/// The connection pooler between a PostgreSQL store and its server
/// ([`Config::postgres_pooler`]): what the engine may rely on of a session.
/// PgBouncer (1.18, Debian's) is the one tested (`tests/pg_bouncer.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PostgresPooler {
    /// No pooler (the default): the store's connections are server
    /// sessions of their own. Its session settings (`statement_timeout`,
    /// `lock_timeout`, `idle_in_transaction_session_timeout`, and the
    /// planner's `plan_cache_mode = force_generic_plan` and `enable_seqscan
    /// = off`, so that every statement finds its rows by index, and, after
    /// the URL's own `options`, which cannot change it, `row_security =
    /// off`, so that a row-level security policy refuses the store's
    /// statements rather than hide rows from them) travel as the startup
    /// parameter `options`. A connect through a pooler that refuses that
    /// parameter (PgBouncer), or drops it (found by reading the session's
    /// `row_security` back, one round trip at connect), is refused with
    /// [`Error::Misconfigured`](crate::Error::Misconfigured)
    /// (`ConfigFault::PoolerMismatch`): use `Session` there.
    #[default]
    Direct,
    /// A pooler that gives each of the store's connections one server
    /// session for as long as it is open: PgBouncer with `pool_mode =
    /// session` (set for the store's database entry alone, if the rest of
    /// the service uses transaction pooling). PgBouncer refuses the startup
    /// parameter `options` ("unsupported startup parameter"), so the store
    /// sends the same session settings as [`PostgresPooler::Direct`] with
    /// `SET` once each connection is open instead, one round trip per
    /// connection opened; and then each `-c name=value` of the URL's
    /// `options` with `set_config`, so that the URL still wins where the
    /// pooler dropped the startup parameter (except settings only a
    /// session's start can set, such as `log_connections`), and last
    /// `row_security = off`. The connect
    /// also probes that the entry is in session mode (a marker set in one
    /// connection's session must not show in a second connection's):
    /// a transaction-mode entry found so is refused with
    /// [`Error::Misconfigured`](crate::Error::Misconfigured)
    /// (`ConfigFault::TransactionPooling`), since the engine's prepared
    /// statements would run other clients' statements there. One more
    /// connection and two round trips at connect; the probe can miss.
    Session,
    /// A pooler that may move a connection to another server session
    /// between transactions: PgBouncer with `pool_mode = transaction`.
    /// Not supported by this build: the engine prepares its statements
    /// once per connection (PgBouncer 1.18 keeps no prepared statement
    /// across server sessions) and relies on session settings, neither of
    /// which survives a change of server session. [`Store::connect`]
    /// refuses it with [`Error::InvalidArgument`] naming `postgres_pooler`:
    /// point the store at a session-mode entry ([`PostgresPooler::Session`]).
    /// A caller's own transaction-mode connection works for
    /// `idemstore::postgres::complete_in` and its sqlx form (their
    /// statements live inside the caller's transaction).
    ///
    /// [`Store::connect`]: crate::Store
    Transaction,
}

/// The default of [`Config::integrity_check_interval`]: 24 hours. A store
/// reopened cleanly many times a day (deploys, restarts) pays the full
/// check of its file at most once a day, and a page damaged on disk while
/// the store was closed goes unchecked at open for at most a day; an
/// unclean shutdown is always checked.
pub const DEFAULT_INTEGRITY_CHECK_INTERVAL: Duration = Duration::from_secs(24 * 3600);

/// The default of [`Config::scrub_rate`]: 10,000 records per second. At
/// that rate a pass over a million records takes about 100 s and over ten
/// million about 17 minutes; each record costs a walk step and two
/// lookups of the index, about 1.3 µs with the file cached (BENCHMARKS.md,
/// "Online scrub").
pub const DEFAULT_SCRUB_RATE: u32 = 10_000;

/// The default [`Config::sweep_batch`]: records one sweep step evicts at
/// most.
pub const DEFAULT_SWEEP_BATCH: usize = 10_000;

/// The highest [`Config::scrub_rate`] accepted: 1,000,000 records per
/// second, about what one core walks (BENCHMARKS.md, "Online scrub"); a
/// step of that many records holds its read snapshot for about 1.3 s.
pub const MAX_SCRUB_RATE: u32 = 1_000_000;

/// How long the PostgreSQL engine waits for anything (feature `postgres`;
/// [`Config::postgres_limits`]): every wait of a call is bounded, and each
/// expiry is answered as [`Error::Unavailable`] when nothing of the call
/// was sent for commit (it was not applied) and [`Error::OutcomeUnknown`]
/// once its `COMMIT` was sent.
///
/// Build it from [`PostgresLimits::default`] and change the fields you
/// need. Every duration must be at least 1 ms and at most 24 hours, and
/// `queue` and `scans` at least 1; [`Store::connect`](crate::Store) refuses others with
/// [`Error::InvalidArgument`] naming `postgres_limits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresLimits {
    /// The overall deadline of one call (claim, complete, get, a sweep
    /// step, an import batch, …), from when it is made: the wait for room
    /// in the queue, for a connection, for its turn and for the server all
    /// count. Default 30 s.
    pub call_timeout: Duration,
    /// How long opening a connection may take: TCP, TLS, authentication
    /// and the server's start-up, for each address the connection string's
    /// hosts give (tried in turn, as libpq's `connect_timeout`), all of it
    /// within the call's `call_timeout`. A URL's `connect_timeout` wins
    /// (`0`, libpq's "wait forever", is read as not given). A server that
    /// accepts the connection and then says nothing is answered
    /// `Unavailable` once this has passed for every address, and uses
    /// the time of the addresses after it (libpq would try them). Default
    /// 10 s.
    pub connect_timeout: Duration,
    /// The server's `statement_timeout` on the engine's own sessions: a
    /// statement running longer is cancelled. Default 30 s.
    pub statement_timeout: Duration,
    /// The server's `lock_timeout` on the engine's own sessions: a wait for
    /// a row (one held by a caller's open `complete_in` transaction, say)
    /// or for the token lock longer than this fails the requests that
    /// need the lock with [`Error::Unavailable`] (SQLSTATE `55P03`)
    /// instead of holding them. A group commit (or its one-statement hot
    /// path) that waited so while it carried requests of several keys
    /// applied nothing and runs them again, each key's in a transaction of
    /// its own, one key after another, each within its requests' deadlines
    /// (`call_timeout`) and waiting at most 500 ms for a lock: the
    /// requests of other keys are decided (after that wait, and the short
    /// ones of the keys before them), and only those of a locked key are
    /// refused, with those whose turn comes after two keys in a row were
    /// refused, or after the refused keys' waits add up to this limit (a
    /// lock every key waits for). A batch of lease renewals (`execute`'s
    /// extender) waits a quarter of its time at most (at most 500 ms),
    /// then renews each key apart the same way, with no cut-off but its
    /// deadline. A `claim_many` is one transaction and fails as a whole;
    /// an `import` is one transaction per batch (up to 1,024 records), and
    /// the batches before a refused one stay. Default 5 s.
    pub lock_timeout: Duration,
    /// The server's `idle_in_transaction_session_timeout` on the engine's
    /// own sessions: the server ends a session of the engine that sits in
    /// an open transaction this long (a client gone half-open), so that
    /// its row locks are released. A transaction with a deadline of its
    /// own, shorter than `call_timeout` (a lease renewal; a write that
    /// must end while a lease lasts, such as `execute`'s outcome) sets half
    /// the time left of its call for itself when that is shorter (at least
    /// 20 ms),
    /// so that a renewal whose connection went half-open holds its rows no
    /// longer than the lease allows a retry. Default 60 s.
    pub idle_in_transaction_timeout: Duration,
    /// TCP keepalive: idle time before the first probe (probes then every
    /// 10 s, 3 unanswered ones end the connection). Default 30 s.
    pub keepalive_idle: Duration,
    /// How many calls may wait in the engine's queue or run at once. A call
    /// that finds it full waits for room until its deadline
    /// (`call_timeout`), then gets [`Error::Unavailable`]. Default 16,384.
    pub queue: usize,
    /// How long a worker connection may stay unused before it is closed.
    /// The engine opens its worker connections on demand (a new one only
    /// while calls are queued and every open one is busy, up to
    /// [`Config::postgres_connections`]) and closes each after this much
    /// idle time, so that the count follows the load: a lone sequential
    /// caller keeps one open, a burst opens more, which close once it has
    /// passed. A sync caller's direct connection (see
    /// [`Config::postgres_connections`]) is closed after this much idle
    /// time too, and opened again by the next call. Default 60 s.
    pub connection_idle_timeout: Duration,
    /// How many scans may each hold a connection of their own at once.
    /// A scan ([`Store::scan`](crate::Store::scan),
    /// [`Store::compensation`](crate::Store::compensation),
    /// [`Store::export`](crate::Store::export),
    /// [`Store::verify`](crate::Store::verify), the `list`, `export` and
    /// `check` commands) reads one snapshot, so it holds one connection,
    /// beside the workers' and the sync caller's, from its first page until
    /// it is read to its end, meets an error or is dropped. One that finds them all in use waits for one
    /// to be given back until its deadline (`call_timeout`), then gets
    /// [`Error::Unavailable`] naming this limit. A store holds at most
    /// [`Config::postgres_connections`] + 1 + `scans` server sessions:
    /// size a pooler's pool for that (a scan whose page timed out gives its
    /// place back at once, but its session lasts until the statement in
    /// flight ends, at most `statement_timeout`). At least 1, no upper
    /// bound. Default 2.
    pub scans: usize,
}

impl Default for PostgresLimits {
    fn default() -> PostgresLimits {
        PostgresLimits {
            call_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(30),
            lock_timeout: Duration::from_secs(5),
            idle_in_transaction_timeout: Duration::from_secs(60),
            keepalive_idle: Duration::from_secs(30),
            queue: 16_384,
            connection_idle_timeout: Duration::from_secs(60),
            scans: 2,
        }
    }
}

impl PostgresLimits {
    /// Checks every field's range.
    #[cfg(feature = "postgres")]
    pub(crate) fn check(&self) -> Result<()> {
        let day = Duration::from_secs(24 * 3600);
        let durations = [
            ("call_timeout", self.call_timeout),
            ("connect_timeout", self.connect_timeout),
            ("statement_timeout", self.statement_timeout),
            ("lock_timeout", self.lock_timeout),
            (
                "idle_in_transaction_timeout",
                self.idle_in_transaction_timeout,
            ),
            ("keepalive_idle", self.keepalive_idle),
            ("connection_idle_timeout", self.connection_idle_timeout),
        ];
        for (name, d) in durations {
            if d < Duration::from_millis(1) || d > day {
                return Err(Error::invalid(
                    "postgres_limits",
                    format!("{name} must be between 1 ms and 24 hours, not {d:?}"),
                ));
            }
        }
        if self.queue == 0 {
            return Err(Error::invalid(
                "postgres_limits",
                "queue must be at least 1",
            ));
        }
        if self.scans == 0 {
            return Err(Error::invalid(
                "postgres_limits",
                "scans must be at least 1",
            ));
        }
        Ok(())
    }
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
/// - `read_cache_bytes`: 64 MiB, the cache of finished records that answers
///   replays without reading the index (in bytes; about 190,000 records
///   with 64-byte results)
/// - `integrity_check_interval`: 24 hours, how old the last full check of
///   the store file's pages may be before a clean open runs it again
/// - `scrub_rate`: 10,000 records per second, the online scrub of the open
///   store's index ([`DEFAULT_SCRUB_RATE`]); `None` disables it
/// - `read_only`: `false`, every change allowed (see [`Config::read_only`])
/// - `postgres_schema`: `idemstore`; `postgres_connections`: 16;
///   `postgres_limits`: [`PostgresLimits::default`]; `postgres_pooler`:
///   [`PostgresPooler::Direct`] (the PostgreSQL engine's only)
///
/// # Engines
/// Most settings apply to both engines. `durability`, `max_log_bytes`,
/// `cache_bytes`, `read_cache_bytes`, `integrity_check_interval`,
/// `scrub_rate` and `read_only` belong to the embedded engine (a store file): [`Store::connect`](crate::Store) refuses them, when set
/// to anything but their defaults, with [`Error::InvalidArgument`] naming
/// the setting. `postgres_schema`, `postgres_connections`,
/// `postgres_limits` and `postgres_pooler` belong to the PostgreSQL
/// engine: the `open` methods refuse them the same way.
#[derive(Clone)]
pub struct Config {
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_result_bytes: usize,
    pub(crate) max_failure_bytes: usize,
    pub(crate) max_recovery_point_bytes: usize,
    pub(crate) sweep_interval: Option<Duration>,
    pub(crate) sweep_batch: usize,
    pub(crate) clock: Arc<dyn Clock>,
    /// Whether [`Config::clock`] was called: a PostgreSQL store then uses
    /// that clock instead of the database's.
    pub(crate) clock_given: bool,
    pub(crate) postgres_schema: Option<String>,
    pub(crate) postgres_connections: Option<usize>,
    pub(crate) postgres_limits: Option<PostgresLimits>,
    pub(crate) postgres_pooler: Option<PostgresPooler>,
    pub(crate) cache_bytes: usize,
    pub(crate) durability: Durability,
    pub(crate) max_log_bytes: u64,
    pub(crate) read_cache_bytes: usize,
    pub(crate) integrity_check_interval: Option<Duration>,
    pub(crate) scrub_rate: Option<u32>,
    pub(crate) read_only: bool,
    /// Opens a store whose write-ahead log recovery needs and cannot use
    /// (lost, blank, or damaged where a durable frame was) with what its
    /// index and the log's intact frames hold, instead of refusing with
    /// `CorruptLog`. Set only by `crate::salvage`, on a copy, read-only:
    /// the original store file the copy was made from.
    pub(crate) accept_log_loss: Option<std::path::PathBuf>,
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
            sweep_batch: DEFAULT_SWEEP_BATCH,
            clock: Arc::new(SystemClock),
            cache_bytes: 64 * 1024 * 1024,
            durability: Durability::Immediate,
            max_log_bytes: 64 * 1024 * 1024,
            read_cache_bytes: 64 * 1024 * 1024,
            integrity_check_interval: Some(DEFAULT_INTEGRITY_CHECK_INTERVAL),
            scrub_rate: Some(DEFAULT_SCRUB_RATE),
            read_only: false,
            accept_log_loss: None,
            clock_given: false,
            postgres_schema: None,
            postgres_connections: None,
            postgres_limits: None,
            postgres_pooler: None,
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
            .field("integrity_check_interval", &self.integrity_check_interval)
            .field("scrub_rate", &self.scrub_rate)
            .field("read_only", &self.read_only)
            .field("clock_given", &self.clock_given)
            .field("postgres_schema", &self.postgres_schema)
            .field("postgres_connections", &self.postgres_connections)
            .field("postgres_limits", &self.postgres_limits)
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
    /// another caller may take it over. Keep it (and every
    /// [`ClaimOptions::lease`]) shorter than the retention, or an abandoned
    /// claim is forgotten when its lease lapses instead of taken over (see
    /// [`ClaimOptions::lease`]). `Store::execute` (and the MCP
    /// server), which renew the lease themselves, refuse a lease under
    /// [`MIN_RENEWED_LEASE`] (100 ms), this default included; they check it
    /// before the key is looked up, so with a shorter default even their
    /// replays of finished keys are refused.
    pub fn lease(mut self, lease: Duration) -> Config {
        self.lease = lease;
        self
    }

    /// The largest result [`Store::complete`](crate::Store::complete) accepts (in bytes, at most
    /// [`MAX_VALUE_LIMIT`]).
    pub fn max_result_bytes(mut self, bytes: usize) -> Config {
        self.max_result_bytes = bytes;
        self
    }

    /// The largest failure [`Store::fail`](crate::Store::fail) accepts (in bytes, at most
    /// [`MAX_VALUE_LIMIT`]).
    pub fn max_failure_bytes(mut self, bytes: usize) -> Config {
        self.max_failure_bytes = bytes;
        self
    }

    /// The largest recovery point [`Store::set_recovery_point`](crate::Store::set_recovery_point) accepts (in
    /// bytes, at most [`MAX_VALUE_LIMIT`]).
    pub fn max_recovery_point_bytes(mut self, bytes: usize) -> Config {
        self.max_recovery_point_bytes = bytes;
        self
    }

    /// Whether a background sweeper evicts expired records, and how long
    /// it waits after a sweep that found nothing due (or failed) on
    /// PostgreSQL; `None` runs no sweeper (call
    /// [`Store::sweep`](crate::Store::sweep) yourself). On the file engine
    /// an idle sweeper sweeps when its expiry index has a record due, so
    /// the interval matters there only after a failed sweep or when the
    /// index cannot be read.
    /// The sweeper's thread ticks at least every second and at most every
    /// 10 ms, at the interval when it is between the two. The first sweep
    /// runs at the first tick after open, and after a sweep that evicted
    /// records the next one runs at the next tick, so that under steady
    /// churn what awaits eviction stays near one second of arrivals; after
    /// a sweep that found nothing due (or failed) the next waits for the
    /// first tick after the interval has passed (an interval of 1.5 s then
    /// sweeps every 2 s), except that on the file engine, after a sweep
    /// that found nothing due, the sweeper reads the first deadline of the
    /// expiry index at each tick (one entry per range, finished and in
    /// flight) and sweeps at the first tick after one has passed, and not
    /// before: a sweep starts within about a second of a record coming due
    /// whatever the interval, a store that starts to churn after an idle
    /// sweep does not collect an interval's worth of due records for one
    /// sweep, and an idle file store is not swept (nor its log written).
    /// On PostgreSQL an idle store is swept once per interval. The sweeper
    /// stops when the store is dropped, or when the store refuses writes. Its thread also runs the online
    /// scrub ([`Config::scrub_rate`]): a sweep waits for a scrub step in
    /// progress, and runs one between its slices when one is due, so that
    /// a sweep that lasts while records keep coming due does not hold the
    /// scrub back.
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
    ///
    /// On a PostgreSQL store the store's time is the database's clock
    /// (`clock_timestamp()`, read by each hot statement, or after a
    /// transaction's last lock wait) and the app's
    /// clock is never read; a clock given here replaces the database's
    /// entirely, its reading sent with each transaction. That is for tests
    /// (a [`ManualClock`](crate::ManualClock)); in production leave it
    /// unset, since replicas with clocks of their own would disagree on
    /// when a lease lapses.
    pub fn clock(mut self, clock: impl Clock) -> Config {
        self.clock = Arc::new(clock);
        self.clock_given = true;
        self
    }

    /// The size of redb's page cache, in bytes (default 64 MiB). Any value
    /// is accepted (0 caches nothing; the cache takes memory as it fills,
    /// up to this). The file engine's setting: [`Store::connect`](crate::Store)
    /// refuses anything but the default.
    ///
    /// The cache holds the index pages read and, in at most half of it,
    /// pages redb wrote and has not yet written out to the file; each
    /// checkpoint (a durable commit of the index: every 15–20 s under load
    /// with the default `max_log_bytes`) writes those out and syncs them
    /// with the writer held, and writes submitted meanwhile wait. So a
    /// larger cache answers more of the writer's lookups from memory and
    /// makes each checkpoint's pause longer. Measured with
    /// `examples/sweep_stall.rs` (16 threads of claim + complete on fresh
    /// random keys, a store of 1 M records, the project's 2-core machine,
    /// two 60-s runs of each size, docs/benchmarks-history.md):
    ///
    /// | `cache_bytes` | lifecycles/s | claim p99 | checkpoint pause, median |
    /// |---|---|---|---|
    /// | 16 MiB | 9,140–9,152 | 18.4–19.6 ms | 52–70 ms |
    /// | 64 MiB (default) | 10,569–10,745 | 11.0–12.6 ms | 109–186 ms |
    /// | 256 MiB | 12,681–13,049 | 10.5–10.6 ms | 569–574 ms |
    ///
    /// Every write submitted during a checkpoint waits out the rest of its
    /// pause; take a larger cache for throughput where that wait is
    /// acceptable.
    ///
    /// The cache also sets where claim p99 rises under steady writes: once
    /// the index outgrows it, the disk takes writes beside the write-ahead
    /// log's (most likely the index's pages) and every write request,
    /// the log's among them, takes longer. Paced runs of 16 threads on
    /// this project's machine: p99 per 5-s sample mostly 0.5–3 ms before
    /// (4.2–6.6 ms in three samples of one run at 256 MiB, the first with
    /// a 350-ms maximum); after, medians of 2.8–3.9 ms per run in one
    /// session and samples of 5.0–6.4 ms in another, on a slower disk
    /// (single samples up to 13 ms). The rise began at about 180,000
    /// records with 64 MiB (at 3,000 and 6,000 lifecycles/s), at about
    /// 390,000 with 128 MiB and at 570,000–630,000 with 256 MiB: size it
    /// at about 0.5 KB per record held, with 64-byte results
    /// (docs/operations.md, "Sizing a file store"). In those runs a larger
    /// cache put the rise off without making it smaller.
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
    /// bytes; 0 disables it; default 64 MiB). In-progress records are never
    /// cached.
    ///
    /// A record counts about 200 bytes plus twice its stored key and its
    /// fingerprint, output, recovery point and business key: the default
    /// holds about 190,000 records with 64-byte results. The cache has 64
    /// shards of an equal share of the budget; a full shard evicts its
    /// oldest entry first, and a record larger than a shard's share is not
    /// cached. Size it for the finished keys that are retried
    /// (the working set, not the store): a replay whose record is not
    /// cached reads the index, at a third or less of the rate at two
    /// threads (100,000 keys replayed with 16 MiB, half of them cached,
    /// against all of them with 64 MiB: BENCHMARKS.md). The memory is
    /// taken as records are cached, not at open.
    pub fn read_cache_bytes(mut self, bytes: usize) -> Config {
        self.read_cache_bytes = bytes;
        self
    }

    /// How old the last full check of the store file may be before a
    /// clean open runs it again (embedded engine only; whole milliseconds,
    /// at least 1 ms; `None` checks at every open). Default 24 hours
    /// ([`DEFAULT_INTEGRITY_CHECK_INTERVAL`]).
    ///
    /// The full check is redb's integrity check: it reads every page of
    /// the file and verifies its checksum, which redb does nowhere else (a
    /// plain read trusts the page), so it is what finds a page damaged on
    /// disk, such as a flipped byte in a branch page that would make a
    /// stored key read as absent (a claim would then run the work twice).
    /// It costs a read of the whole file: about 0.4 s warm at a million
    /// records, seconds to tens of seconds at ten million (BENCHMARKS.md).
    ///
    /// - After an unclean shutdown (a crash, a kill, a power cut, a store
    ///   that could not write its closing checkpoint) the check always
    ///   runs, whatever this setting.
    /// - After a clean close it runs when the last full check is older
    ///   than this period, or was never recorded (a store written before
    ///   this setting existed, a new store), or is recorded more than a
    ///   minute ahead of the clock (a file that cannot be trusted about
    ///   it). The time is the wall reading of [`Config::clock`], recorded
    ///   in the store file when a check passes.
    /// - `None` checks at every open, as every open did before this
    ///   setting.
    ///
    /// Between two full checks, damage is found by the record checksum
    /// (every read of a record) and by [`Store::verify`](crate::Store::verify),
    /// [`check_file`](crate::check_file) and `idemstore check`, which an
    /// operator runs; see README, "What it guarantees", point 5.
    ///
    /// `Some(Duration::ZERO)` (or under 1 ms) makes the open fail with
    /// [`Error::InvalidArgument`] naming `integrity_check_interval`; use
    /// `None`. A very long period (up to [`Duration::MAX`]) is accepted: the
    /// check then runs on a store never verified and after unclean
    /// shutdowns only. On a PostgreSQL store anything but the default is
    /// refused the same way.
    pub fn integrity_check_interval(mut self, interval: Option<Duration>) -> Config {
        self.integrity_check_interval = interval;
        self
    }

    /// How many records per second the online scrub verifies while the
    /// store is open (1 to [`MAX_SCRUB_RATE`]; default
    /// [`DEFAULT_SCRUB_RATE`]); `None` runs no background scrub
    /// ([`Store::scrub`](crate::Store::scrub) still runs a step on demand).
    ///
    /// The scrub covers what the checks at open leave open in a store that
    /// stays open for weeks: redb verifies page checksums only in its full
    /// integrity check, so a page damaged on disk after the open (bit rot,
    /// a stray write) is read as it is. Once a second the store's
    /// background thread walks the next `rate` records of the index in key
    /// order, in a read snapshot of its own, and for each one checks that
    /// the keys come in order, that a lookup of the key finds the same
    /// record (a damaged branch page routes a lookup elsewhere, and the key
    /// would read as absent), the record's checksum, and its expiry index
    /// entry. A pass ends at the key that was last when it started; the
    /// next starts again at the first key. At the default rate a pass over
    /// a million records takes about 100 s, over ten million about 17
    /// minutes; walking runs at about 750,000–820,000 records per second
    /// here with the file cached, so the default costs about 1.2 % of a
    /// core (BENCHMARKS.md, "Online scrub").
    ///
    /// Damage (anything but a missing expiry entry, which is reported and
    /// changes nothing) makes the store refuse writes: claims and every
    /// other change get [`Error::Poisoned`](crate::Error::Poisoned), so
    /// that a key the index can no longer find is not claimed a second
    /// time, while reads, scans, stats and exports still answer (for the
    /// restore; a [`Store::get`](crate::Store::get) of a key without a live
    /// record answers [`Error::CorruptFile`](crate::Error::CorruptFile), not
    /// absent, since the damage may hide it). The scrub also leaves a file `<path>-damaged` beside the
    /// store file, naming what it found, and every later open opens the
    /// store read-only in the same way while that file (or its temporary
    /// `-damaged.tmp`) exists, by whatever name it opens the file (the
    /// marker is found beside the file's canonical path, and the store
    /// records where it is, for a hard link): a damaged page that a later write rewrote
    /// carries a valid checksum again, and the open's integrity check alone
    /// would not see it. Export, restore into a new file, and move the
    /// marker away with the damaged file; [`check_file`](crate::check_file)
    /// reports it. A marker left beside a path whose store file is gone is
    /// renamed aside (`-damaged.before-<ms>`) when a new store is created
    /// there. A store on a custom backend, or one whose marker cannot be
    /// written, is poisoned instead: it closes without its clean checkpoint
    /// and the reopen runs the full integrity check. See README, "What it
    /// guarantees", point 5.
    ///
    /// The thread is the background sweeper's (one thread for both, started
    /// when either is on). A step waits for the writer only once, for the
    /// checkpoint that records the marker when it finds damage; it reads
    /// through redb's page cache. An I/O error is logged (warn) and the
    /// step retried at the next tick; ten failures in a row at one place
    /// count as damage there. The rate is an upper bound: a step
    /// that takes longer than a second (a cold disk) delays the next.
    /// `Some(0)` or a rate over [`MAX_SCRUB_RATE`] makes the open fail with
    /// [`Error::InvalidArgument`] naming `scrub_rate`; on a PostgreSQL
    /// store (whose pages the server checks) a rate other than the default
    /// is refused the same way, and `None` is accepted (a configuration
    /// shared by both engines can turn the scrub off).
    pub fn scrub_rate(mut self, records_per_second: Option<u32>) -> Config {
        self.scrub_rate = records_per_second;
        self
    }

    /// Opens a store file to read it (embedded engine only; default
    /// `false`): for tools that inspect a store (`idemstore get`, `list`,
    /// `stats`, `export`, [`check_file`](crate::check_file)) and readers
    /// beside a stopped service.
    ///
    /// A read-only store answers `get`, `scan`, `stats`, `len`, `export`,
    /// `verify` and `scrub` (which looks for damage and records what it
    /// finds), and refuses every change to a record with
    /// [`Error::ReadOnly`], nothing applied: claims (even one that would
    /// only replay or report a lease), completions, failures, releases,
    /// lease extensions, recovery points, `resolve`, `amend`, `import` and
    /// sweeps. No background sweeper or scrub runs, whatever
    /// `sweep_interval` and `scrub_rate` say.
    ///
    /// **It persists no time.** A store adopts a wall clock that is ahead,
    /// and never goes back ("The store's time" on [`Clock`]): an open
    /// reserves time, and a clean close records the time reached, so that
    /// one process run under a clock ahead (a container or VM with a wrong
    /// clock, `faketime`) would move the store's time forward for good,
    /// and records whose retention ends within that lead would read as
    /// past retention for the service too. A read-only open reads the
    /// clock as any open does (its answers are as of the clock's reading,
    /// so under a clock ahead a live record may read as past retention;
    /// `export` alone takes the time bound found on disk, so that a backup
    /// leaves out no record live for the service), and writes back the
    /// time bounds it found, recording no verification time either: the
    /// next open starts where it would have without this one.
    ///
    /// It is still an open of the file, not a mount of it: it takes the
    /// store's exclusive lock ([`Error::AlreadyOpen`] while a service has
    /// it) and needs write access. Recovery runs: an open after a crash
    /// replays the write-ahead log into the index and takes a checkpoint,
    /// and a missing log (a store copied without it) is created, as any
    /// open does. A store of an older format is migrated to this version's
    /// (its layout, not its time), after which an older idemstore no
    /// longer opens it.
    ///
    /// The store must exist: [`Store::open_with`](crate::Store::open_with)
    /// answers [`Error::Missing`] for a missing file rather than create
    /// one, and [`Error::IncompatibleFile`] for a file (or a custom
    /// backend) that holds no store rather than initialise it. On PostgreSQL (whose
    /// time is the server's) [`Store::connect`](crate::Store) refuses it
    /// with [`Error::InvalidArgument`] naming `read_only`: give the role
    /// `default_transaction_read_only` instead.
    pub fn read_only(mut self, read_only: bool) -> Config {
        self.read_only = read_only;
        self
    }

    /// The PostgreSQL schema that holds the store's tables (PostgreSQL
    /// engine only): 1 to 63 ASCII letters, digits or underscores, not
    /// starting with a digit, not `pg_…` or `information_schema`
    /// (PostgreSQL's own); default `idemstore`. Several stores share one
    /// database under different schemas. On the embedded engine, opening
    /// fails with [`Error::InvalidArgument`] naming `postgres_schema`.
    pub fn postgres_schema(mut self, schema: impl Into<String>) -> Config {
        self.postgres_schema = Some(schema.into());
        self
    }

    /// The most connections the PostgreSQL engine runs transactions on at
    /// once (PostgreSQL engine only; 1 to 1,024, default 16). They are
    /// opened on demand, a new one only while calls are queued and every
    /// open one is busy, and each is closed after
    /// [`PostgresLimits::connection_idle_timeout`] unused (default 60 s);
    /// a sync caller's statements may also take one direct connection of
    /// the store's besides these (closed the same way), and each scan one
    /// of its own while it lasts (at most [`PostgresLimits::scans`]). Concurrent
    /// requests are batched into one transaction per connection (group
    /// commit over the wire). On the embedded engine, opening fails with
    /// [`Error::InvalidArgument`] naming `postgres_connections`.
    pub fn postgres_connections(mut self, connections: usize) -> Config {
        self.postgres_connections = Some(connections);
        self
    }

    /// The PostgreSQL engine's time limits and queue bound (PostgreSQL
    /// engine only; default [`PostgresLimits::default`]): see
    /// [`PostgresLimits`] for each and its range. On the embedded engine,
    /// opening fails with [`Error::InvalidArgument`] naming
    /// `postgres_limits`.
    pub fn postgres_limits(mut self, limits: PostgresLimits) -> Config {
        self.postgres_limits = Some(limits);
        self
    }

    /// The connection pooler between the PostgreSQL store and its server
    /// (PostgreSQL engine only; default [`PostgresPooler::Direct`]): see
    /// [`PostgresPooler`] for what each needs and changes. On the embedded
    /// engine, opening fails with [`Error::InvalidArgument`] naming
    /// `postgres_pooler`.
    pub fn postgres_pooler(mut self, pooler: PostgresPooler) -> Config {
        self.postgres_pooler = Some(pooler);
        self
    }

    /// Refuses the settings of the PostgreSQL engine on the embedded one.
    pub(crate) fn check_embedded(&self) -> Result<()> {
        let postgres_only =
            "a setting of the PostgreSQL engine (Store::connect), not of a store file";
        if self.postgres_schema.is_some() {
            return Err(Error::invalid("postgres_schema", postgres_only));
        }
        if self.postgres_connections.is_some() {
            return Err(Error::invalid("postgres_connections", postgres_only));
        }
        if self.postgres_limits.is_some() {
            return Err(Error::invalid("postgres_limits", postgres_only));
        }
        if self.postgres_pooler.is_some() {
            return Err(Error::invalid("postgres_pooler", postgres_only));
        }
        Ok(())
    }

    /// Refuses the settings of the embedded engine on the PostgreSQL one:
    /// a durability mode, the log size, the two caches and the integrity
    /// check's period, when set to anything but their defaults.
    #[cfg(feature = "postgres")]
    pub(crate) fn check_postgres(&self) -> Result<()> {
        let defaults = Config::default();
        let embedded_only = |what: &'static str| {
            Err(Error::invalid(
                what,
                "a setting of the embedded engine (a store file); a PostgreSQL store commits every change durably on the server",
            ))
        };
        if self.durability != defaults.durability {
            return embedded_only("durability");
        }
        if self.max_log_bytes != defaults.max_log_bytes {
            return embedded_only("max_log_bytes");
        }
        if self.cache_bytes != defaults.cache_bytes {
            return embedded_only("cache_bytes");
        }
        if self.read_cache_bytes != defaults.read_cache_bytes {
            return embedded_only("read_cache_bytes");
        }
        if self.integrity_check_interval != defaults.integrity_check_interval {
            return embedded_only("integrity_check_interval");
        }
        if self.read_only {
            return Err(Error::invalid(
                "read_only",
                "a setting of the embedded engine (a store file), whose time an open persists; a PostgreSQL store's time is the server's: give the role default_transaction_read_only to refuse writes",
            ));
        }
        // `None` says "no background scrub", true of every PostgreSQL store.
        if self.scrub_rate.is_some() && self.scrub_rate != defaults.scrub_rate {
            return embedded_only("scrub_rate");
        }
        if self
            .postgres_connections
            .is_some_and(|n| n == 0 || n > 1024)
        {
            return Err(Error::invalid(
                "postgres_connections",
                "must be between 1 and 1,024",
            ));
        }
        if let Some(limits) = &self.postgres_limits {
            limits.check()?;
        }
        Ok(())
    }

    /// Checks the settings every engine shares.
    pub(crate) fn validate(&self) -> Result<()> {
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
        if self
            .scrub_rate
            .is_some_and(|r| r == 0 || r > MAX_SCRUB_RATE)
        {
            return Err(Error::invalid(
                "scrub_rate",
                format!(
                    "must be 1 to {MAX_SCRUB_RATE} records per second; None disables the scrub"
                ),
            ));
        }
        if let Durability::Buffered { max_delay } = self.durability
            && (max_delay < Duration::from_millis(1) || max_delay > Duration::from_secs(3600))
        {
            return Err(Error::invalid(
                "durability",
                "a buffered max_delay must be between 1 ms and 1 hour",
            ));
        }
        Ok(())
    }
}

/// A lease duration in whole ms, checked against 1 ms ..= [`MAX_LEASE`].
pub(crate) fn check_lease(what: &'static str, lease: Duration) -> Result<u64> {
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

/// Refuses a lease that its holder renews (`Store::execute`, the HTTP
/// layer) when it is under [`MIN_RENEWED_LEASE`].
#[cfg(any(feature = "agent", feature = "http"))]
pub(crate) fn check_renewed_lease(lease: Duration) -> Result<()> {
    if lease < MIN_RENEWED_LEASE {
        return Err(Error::invalid(
            "lease",
            format!(
                "{lease:?} is under {MIN_RENEWED_LEASE:?}, the shortest lease renewed safely: \
                 each renewal is a durable write that must land within the lease"
            ),
        ));
    }
    Ok(())
}

/// Options of one claim.
#[derive(Debug, Clone, Default)]
pub struct ClaimOptions {
    pub(crate) lease: Option<Duration>,
    pub(crate) business_key: Option<String>,
}

impl ClaimOptions {
    /// Options with every default from [`Config`].
    pub fn new() -> ClaimOptions {
        ClaimOptions::default()
    }

    /// The lease duration of this claim (whole milliseconds, 1 ms to
    /// [`MAX_LEASE`]); the store's configured lease when unset.
    ///
    /// Keep it shorter than the store's retention. A claimed record
    /// expires at `max(now + retention, lease_until)` (`docs/design.md`):
    /// with a lease shorter than the retention, an abandoned claim stays
    /// for the compensation scan and is taken over (in doubt, with its
    /// recovery point) once its lease lapses; with one as long or longer,
    /// it expires the moment its lease lapses, the next claim finds the
    /// key absent (a first attempt: no recovery point, no in-doubt check),
    /// and the late holder's completion is refused as a stale lease. Not
    /// refused: a retention shorter than a lease is how a test or a
    /// benchmark makes records due at once.
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

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    #[test]
    fn postgres_refuses_the_integrity_check_interval() {
        assert!(Config::new().check_postgres().is_ok());
        for interval in [None, Some(Duration::from_secs(60))] {
            match Config::new()
                .integrity_check_interval(interval)
                .check_postgres()
            {
                Err(Error::InvalidArgument { what, .. }) => {
                    assert_eq!(what, "integrity_check_interval");
                }
                other => panic!("{interval:?}: {other:?}"),
            }
        }
        let default = Some(DEFAULT_INTEGRITY_CHECK_INTERVAL);
        assert!(
            Config::new()
                .integrity_check_interval(default)
                .check_postgres()
                .is_ok()
        );
    }

    #[test]
    fn postgres_refuses_read_only() {
        assert!(Config::new().read_only(false).check_postgres().is_ok());
        match Config::new().read_only(true).check_postgres() {
            Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "read_only"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn postgres_limits_are_checked_and_refused_on_a_file() {
        let limits = PostgresLimits::default();
        assert!(
            Config::new()
                .postgres_limits(limits)
                .check_postgres()
                .is_ok()
        );
        match Config::new().postgres_limits(limits).check_embedded() {
            Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "postgres_limits"),
            other => panic!("{other:?}"),
        }
        let mut zero = limits;
        zero.lock_timeout = Duration::ZERO;
        let mut no_queue = limits;
        no_queue.queue = 0;
        let mut too_long = limits;
        too_long.call_timeout = Duration::from_secs(2 * 24 * 3600);
        let mut no_idle = limits;
        no_idle.connection_idle_timeout = Duration::ZERO;
        let mut no_scans = limits;
        no_scans.scans = 0;
        for bad in [zero, no_queue, too_long, no_idle, no_scans] {
            match Config::new().postgres_limits(bad).check_postgres() {
                Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "postgres_limits"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
