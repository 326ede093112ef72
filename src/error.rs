//! The one error type of the crate.

use std::path::PathBuf;

use crate::key::Key;
use crate::record::State;

/// A specialized `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `idemstore`.
///
/// Errors are typed so that a caller can map each one to an answer: an HTTP
/// layer answers [`Error::InvalidKey`] with 400, [`Error::FingerprintMismatch`]
/// with 422 (as the IETF Idempotency-Key draft asks),
/// [`Error::BusinessKeyConflict`] with 409, [`Error::TooLarge`] by
/// recording the response as a failure, and everything about storage with
/// 503 (with `Retry-After` when [`Error::is_transient`] holds).
///
/// Every variant that rejects input ([`InvalidKey`](Error::InvalidKey),
/// [`InvalidArgument`](Error::InvalidArgument), [`TooLarge`](Error::TooLarge),
/// [`FingerprintMismatch`](Error::FingerprintMismatch),
/// [`StaleLease`](Error::StaleLease),
/// [`BusinessKeyConflict`](Error::BusinessKeyConflict)) is returned before
/// anything is written:
/// the store is unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The scope or id of a key is empty, too long (scope over 128 bytes, id
    /// over 255 bytes) or contains a control character. Maps to HTTP 400.
    #[error("invalid idempotency key: {reason}")]
    InvalidKey {
        /// What is wrong with it, for a person.
        reason: String,
    },

    /// An argument is out of its range: a zero or over-long lease, a zero
    /// retention, an empty or over-long fingerprint.
    #[error("invalid argument {what}: {reason}")]
    InvalidArgument {
        /// The argument's name.
        what: &'static str,
        /// Why it was refused.
        reason: String,
    },

    /// A result, failure or recovery point is longer than its configured
    /// limit (in bytes). The record is unchanged.
    #[error("{what} is {len} bytes, over its limit of {limit} bytes")]
    TooLarge {
        /// Which value: `"result"`, `"failure"` or `"recovery point"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The configured limit in bytes.
        limit: usize,
    },

    /// A record exists for the key with another fingerprint: the key was
    /// reused for a different request payload. Never a replay. Maps to HTTP
    /// 422 (IETF Idempotency-Key draft; Stripe answers the same way).
    #[error("idempotency key {key} was already used with a different request payload")]
    FingerprintMismatch {
        /// The key, as `scope/id` for display.
        key: String,
    },

    /// The lease is not the current one: its token no longer names the
    /// record (it was taken over after the lease lapsed, completed, failed,
    /// released, or is past retention). Nothing was changed.
    #[error("lease with fencing token {token} on {key} is no longer current")]
    StaleLease {
        /// The key, as `scope/id` for display.
        key: String,
        /// The fencing token the caller presented.
        token: u64,
    },

    /// A claim carried a business key (an order or ticket number, see
    /// [`ClaimOptions::business_key`](crate::ClaimOptions::business_key))
    /// that a live record of *another* idempotency key in the same scope
    /// already holds: the same business operation was requested under a
    /// new idempotency key. Nothing was acquired or written. Maps to HTTP
    /// 409 Conflict, answered with the existing key (so the client can
    /// look up or retry the original request) and its state.
    #[error(
        "business key {business_key:?} is already held by idempotency key {existing} ({})",
        state.name()
    )]
    BusinessKeyConflict {
        /// The business key of the claim.
        business_key: String,
        /// The idempotency key whose record holds the business key.
        existing: Key,
        /// That record's state when the claim was decided.
        state: State,
    },

    /// An export stream (see [`Store::export`](crate::Store::export)) is
    /// damaged, truncated, or not an export: a frame failed its crc32, its
    /// length is out of range, a frame is missing or out of order, or the
    /// stream was written by a newer format. Frames before `offset` that
    /// were already imported stay imported (import is idempotent: run it
    /// again once the stream is repaired).
    #[error("export stream damaged at byte offset {offset}: {detail}")]
    CorruptExport {
        /// Byte offset of the bad frame (or of the point where the stream
        /// ended) from the start of the stream.
        offset: u64,
        /// What is wrong.
        detail: String,
    },

    /// An export stream was read without damage, but a frame holds a value
    /// the store refuses (see [`ImportRule`]): a token at or above
    /// [`MAX_TOKEN`](crate::MAX_TOKEN), a time too far ahead of the store's
    /// clock, a lease or retention longer than the store allows, a record
    /// whose state and fields disagree, or a value over the store's limits.
    /// The meta frame is checked before anything is written, and every
    /// record before its batch is written: nothing of the refused frame's
    /// batch is written, batches before it stay imported (`imported`
    /// records), and the store's token counter and clock are raised only by
    /// those batches. The one exception is
    /// [`ImportRule::StoredRecordDamaged`], found as the batch is written:
    /// the rest of that batch was written, and `imported` counts it.
    #[error(
        "import refused at byte offset {offset} ({rule}): {detail}; \
         {imported} records were imported"
    )]
    ImportRefused {
        /// Byte offset of the refused frame from the start of the stream.
        offset: u64,
        /// The rule the frame broke.
        rule: ImportRule,
        /// What the frame holds, for a person.
        detail: String,
        /// Records written: those of the batches before the refused one
        /// (for [`ImportRule::StoredRecordDamaged`], the rest of the
        /// refused frame's batch too).
        imported: u64,
    },

    /// The store's fencing-token counter has reached
    /// [`MAX_TOKEN`](crate::MAX_TOKEN) (`i64::MAX`): no further
    /// acquisition can get a token that is unique and fits a PostgreSQL
    /// `bigint`. The claim acquired nothing and changed nothing; the counter
    /// never wraps. A store gets here after about 9.2 × 10^18 acquisitions,
    /// or after an import whose counter is at (not above) the cap. Maps to
    /// HTTP 503.
    #[error("the fencing-token counter is exhausted at {next_token} (the cap is i64::MAX)")]
    TokensExhausted {
        /// The counter's value: the token the claim would have taken.
        next_token: u64,
    },

    /// The store does not exist: no file at the path given to
    /// [`Store::open_existing`](crate::Store::open_existing), or no store in
    /// the schema given to `Store::connect_existing` (feature `postgres`,
    /// `path` naming the server and schema). Neither creates one.
    #[error("{}: no such store file", path.display())]
    Missing {
        /// The path that was looked for.
        path: PathBuf,
    },

    /// A stored record failed its checksum or could not be decoded. Other
    /// keys keep working.
    #[error("corrupt record for key {key}: {detail}")]
    CorruptRecord {
        /// The key as far as it could be read (its bytes escaped).
        key: String,
        /// What failed.
        detail: String,
    },

    /// The store file itself is damaged (redb's integrity check failed, a
    /// table or metadata entry is unreadable, or redb panicked on it).
    #[error("corrupt store file {}: {detail}", path.display())]
    CorruptFile {
        /// The store file.
        path: PathBuf,
        /// What failed.
        detail: String,
    },

    /// The write-ahead log beside the store file is damaged where recovery
    /// needs it: a frame that was already durable fails its checksum while
    /// later frames are intact, or, after an unclean shutdown, the log is
    /// missing, empty, its header unreadable, or shorter than the length
    /// its header records (cut: a crash never shortens it). A torn last frame (a write
    /// cut by a crash) is not corruption: recovery ends before it. Nothing
    /// is replayed and the store does not open; acknowledged changes may be
    /// in the damaged or missing part. [`check_file`](crate::check_file)
    /// reports it as damage in its report, not as this error;
    /// [`salvage_file`](crate::salvage_file) exports what the index and the
    /// log's intact frames hold, taking that loss.
    #[error("corrupt write-ahead log {} at offset {offset}: {detail}", path.display())]
    CorruptLog {
        /// The log file (`<store file>-wal`).
        path: PathBuf,
        /// The byte offset in the log where the damage was found.
        offset: u64,
        /// What failed.
        detail: String,
    },

    /// The file is not an idemstore file, or was written by a newer format
    /// version than this build reads.
    #[error("{} is not a store this version can open: {detail}", path.display())]
    IncompatibleFile {
        /// The store file.
        path: PathBuf,
        /// What was found.
        detail: String,
    },

    /// The file is already open, by this process or another one. redb locks
    /// the store file, and a store locks its write-ahead log; a second open
    /// is refused rather than waiting. `path` is the write-ahead log when
    /// the store file is free but its log is held: the file at the store's
    /// path was replaced (a copy moved over it) under a running store, or
    /// this process holds a [`FileLog`](crate::FileLog) of that log.
    #[error(
        "{} is already open by another Store (in this or another process); \
         only one Store may hold a file at a time",
        path.display()
    )]
    AlreadyOpen {
        /// The store file (or its write-ahead log, as above).
        path: PathBuf,
    },

    /// An I/O or storage error from the file or from redb. For a write,
    /// the change may or may not be durable: after reopening, `get` tells.
    /// The store refuses further writes (see [`Error::Poisoned`]). On
    /// PostgreSQL: a row or an answer the engine cannot read (a request
    /// that wrote may have been applied: `get` tells); or a statement the
    /// server refused for a reason that the same statement meets again, by
    /// its SQLSTATE class (a data exception `22`, a program limit `54`, the
    /// server's internal errors `XX`: `XX001` a page of its data found
    /// corrupted, `XX002` an index), which applied nothing and needs an
    /// operator (the detail holds the server's words); the store goes on,
    /// and requests that do not meet the fault are answered.
    #[error("storage error: {0}")]
    Storage(String),

    /// An earlier durable write failed (an fsync above all), so the store
    /// refuses writes until it is reopened: after a failed fsync the page
    /// cache cannot be trusted (the lesson PostgreSQL learned in 2018), and
    /// only a reopen recovers from what is really on disk. Also the answer
    /// to every write on a store whose online scrub found the index damaged
    /// ([`Config::scrub_rate`](crate::Config::scrub_rate)): a damaged index
    /// may not find a key it holds, and a claim would run the work again.
    /// Reopening does not clear that while the marker `<path>-damaged`
    /// exists: restore from an export.
    #[error("store refuses writes: {cause}")]
    Poisoned {
        /// Why, and what to do: the first failed durable write's own error
        /// (for example the operating system's "No space left on device"),
        /// with "reopen the store once that is fixed"; the damage the
        /// online scrub found, with the marker's path and "restore it from
        /// an export" (or, when the marker cannot be written, "reopen the
        /// store: the reopen runs the full integrity check"); or a panic of
        /// the store's writer or of a caller deciding a batch, with
        /// "reopen the store". Text for people: match on the variant, not
        /// on this.
        cause: String,
    },

    /// The store was opened read-only ([`Config::read_only`](crate::Config::read_only)):
    /// it refuses every change to a record (a claim, even one that would
    /// only replay, a completion, failure, release, lease extension,
    /// recovery point, `resolve`, `amend`, `import`, a sweep). Nothing was
    /// applied. Open the store without `read_only` to write.
    #[error("store {path} is open read-only: {operation} changes records; nothing was applied")]
    ReadOnly {
        /// The store file.
        path: PathBuf,
        /// What was refused (`claim`, `sweep`, …).
        operation: &'static str,
    },

    /// The store's writer has stopped (the store is shutting down).
    #[error("store is closed")]
    Closed,

    /// The PostgreSQL server could not be reached, the connection was
    /// lost before the request's transaction was committed, or the server
    /// refused a statement or the commit for a reason that passes (by its
    /// SQLSTATE class: a deadlock or serialization failure, a lock wait
    /// past `lock_timeout`, a statement cancelled by `statement_timeout`,
    /// too few resources such as memory or connections, a host turned
    /// read-only), or a request of a group commit was not run because the
    /// keys before it were refused (sent again, it is decided): the
    /// request was **not applied**. It is safe to
    /// retry it as it is; the engine opens a new connection for the next
    /// request once the server is back. Maps to HTTP 503.
    #[error("the database is unavailable; the request was not applied: {detail}")]
    Unavailable {
        /// What failed, for a person.
        detail: String,
    },

    /// The request's transaction was sent to the PostgreSQL server with its
    /// `COMMIT`, and the answer was lost (the connection broke while the
    /// commit was in flight): the change **may or may not** have been
    /// applied. The caller reads the key to find out (`get`): a claim whose
    /// answer was lost shows as in progress, held by a lease nobody knows,
    /// until that lease lapses, after which the next claim takes it over; a
    /// completion either shows as succeeded or can be sent again with the
    /// same lease. Maps to HTTP 503.
    #[error(
        "the outcome of the request is unknown (the commit was sent, the answer lost): {detail}"
    )]
    OutcomeUnknown {
        /// What failed, for a person.
        detail: String,
    },

    /// The PostgreSQL store cannot work as configured, and will not until
    /// an operator changes something (the URL, a role, a grant, a
    /// certificate, the schema, or this build): the server named no such
    /// database, refused the role or its password (or none was given),
    /// denied a privilege the store needs, the server's certificate failed
    /// verification, the schema was created by a newer idemstore, or its
    /// objects were dropped or altered. Nothing was applied.
    /// **Never retry it as is** (the same request gets the same answer):
    /// report it, page someone, and fail the request; an HTTP layer answers
    /// it with 503 like any other fault of the store. [`ConfigFault`] says
    /// which; `detail` holds the server's words (SQLSTATE and message) or
    /// the TLS library's.
    #[error("the store is misconfigured ({fault}): {detail}")]
    Misconfigured {
        /// Which configuration fault.
        fault: ConfigFault,
        /// What the server or the TLS library said, for a person.
        detail: String,
    },

    /// The database schema does not look like an idemstore schema: its
    /// version or identity row is malformed, or it holds no store (no
    /// version row) but relations of another program under the names a
    /// store uses (`records` or `bindings` that is not a table of the
    /// store's columns, `tokens` that is not a sequence): choose another
    /// schema for the store. Nothing was changed. (A schema created by a
    /// newer idemstore is [`Error::Misconfigured`] with
    /// [`ConfigFault::SchemaTooNew`]; a store's own relations without its
    /// version row are [`ConfigFault::SchemaDamaged`].)
    #[error("schema {schema} is not a store this version can open: {detail}")]
    IncompatibleSchema {
        /// The schema name.
        schema: String,
        /// What was found.
        detail: String,
    },
}

impl Error {
    pub(crate) fn storage(err: impl std::fmt::Display) -> Self {
        Error::Storage(err.to_string())
    }

    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            what,
            reason: reason.into(),
        }
    }

    /// Whether this error rejects the caller's input (400/422-style) rather
    /// than reporting a fault of the store or its file.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            Error::InvalidKey { .. }
                | Error::InvalidArgument { .. }
                | Error::TooLarge { .. }
                | Error::FingerprintMismatch { .. }
                | Error::StaleLease { .. }
                | Error::BusinessKeyConflict { .. }
        )
    }

    /// Whether the same request, sent again unchanged with the same key
    /// after a short wait, may succeed without an operator: the PostgreSQL
    /// engine's [`Error::Unavailable`] (nothing was applied; the engine
    /// reconnects once the server is back) and [`Error::OutcomeUnknown`]
    /// (the commit's answer was lost: read the key first, as README's
    /// retry table says; a retry finds the outcome and replays it, or
    /// finds the key in progress until the lost claim's lease lapses, and
    /// then takes it over: the HTTP layer runs the handler, `execute` and
    /// the MCP layer apply their in-doubt policy, which by default refuses).
    ///
    /// `false` for every other error: a client error
    /// ([`Error::is_client_error`]) gets the same answer however often it
    /// is sent; [`Error::Misconfigured`] and [`Error::IncompatibleSchema`]
    /// need an operator; [`Error::Poisoned`] and the corruption errors
    /// need a reopen, a repair or a restore, and so does
    /// [`Error::Storage`] on the file engine (an I/O error); on PostgreSQL
    /// (a row or answer the engine cannot read, or a statement its server
    /// refused for a reason met again, such as a page of its data found
    /// corrupted) it needs an operator while the store goes on; [`Error::Closed`] is a store whose writer stopped (a
    /// panic of the file engine's writer or syncer thread, which only a
    /// reopen mends, or a store being dropped); [`Error::ReadOnly`] a store
    /// opened not to write.
    ///
    /// The HTTP layer answers a transient error with 503 and `Retry-After`
    /// (any other store fault with 503 alone), the MCP layer with
    /// `data.transient: true` and `data.retryAfterMs`.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. } | Error::OutcomeUnknown { .. }
        )
    }
}

/// The configuration fault behind [`Error::Misconfigured`] (feature
/// `postgres`). None of them goes away by retrying (a retry after
/// [`ConfigFault::TransactionPooling`] may pass the probe, which can miss:
/// the pool is as wrong as before).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConfigFault {
    /// The database named in the URL does not exist (SQLSTATE `3D000`).
    DatabaseMissing,
    /// The server refused the role: it does not exist, may not log in, or
    /// `pg_hba.conf` has no entry for this host, role and database
    /// (SQLSTATE `28000`).
    RoleRefused,
    /// The password (or other credential) was wrong (SQLSTATE `28P01`), or
    /// the server asked for one and the connection string holds none
    /// (tokio-postgres's "password missing"; `PGPASSWORD` and `.pgpass` are
    /// not read), or the authentication exchange cannot succeed as
    /// configured (`channel_binding=require` against a server that does
    /// not bind, an authentication method the driver does not speak).
    AuthenticationFailed,
    /// The role lacks a privilege the store needs: `USAGE` on the schema,
    /// `SELECT`, `INSERT`, `UPDATE` or `DELETE` on its tables, `USAGE` on
    /// its sequence, or `CREATE` where the schema must be created or
    /// upgraded (SQLSTATE `42501`; see `docs/operations.md` for the grants
    /// of a runtime role).
    PermissionDenied,
    /// TLS failed for a reason of configuration: the server's certificate
    /// failed verification under `sslmode=verify-ca` or `verify-full` (an
    /// unknown issuer, a name mismatch, an expired certificate), or the
    /// server does not offer TLS where `sslmode=require` (or stricter)
    /// asks for it.
    Tls,
    /// The schema was created or upgraded by a newer idemstore than this
    /// build reads: deploy the newer build (a schema is never downgraded).
    SchemaTooNew,
    /// The schema holds a store of an older schema version, which a
    /// connect never upgrades (replicas of the older build may still be
    /// running, and would read this build's rows as corrupt); or it holds
    /// no store, and the role that connected may not create one. Run
    /// `idemstore migrate` (or `idemstore::postgres::migrate`) once with a
    /// role that may, after stopping the older build's replicas.
    SchemaNotMigrated,
    /// An object the store needs is missing or of another form: its
    /// schema, a table (`records`, `bindings`, `meta`), a column, or the
    /// token sequence was dropped or altered outside idemstore (SQLSTATE
    /// `3F000`, `42P01`, `42703` or `42804` on a request; `0A000` "cached
    /// plan must not change result type" when a column's type was altered
    /// under a running store). Or something
    /// added or taken away outside idemstore refuses the store's statements
    /// or voids a guarantee: the unique index of `records.key` or
    /// `bindings.binding` dropped (without it two replicas could both
    /// acquire one key; `42P10` on a request, and found by a connect, whose
    /// message gives the query that finds keys held by two rows and the
    /// `ALTER TABLE … ADD PRIMARY KEY` that restores it), a column's `NOT
    /// NULL` dropped (a NULL read), a `CHECK`, a foreign key, a column `NOT
    /// NULL` without a default, a unique index on another column or an
    /// exclusion constraint added (`23514`, `23503`, `23502`, `23505`, any
    /// other of class `23` outside the system catalogs; also another
    /// table's foreign key to the store's rows, which eviction and release
    /// delete), a trigger added whose function raises (`P0001`) or fails
    /// with any error that a retry meets again (a division by zero,
    /// `22012`, say; a trigger only slow enough for `statement_timeout` to
    /// cancel it is [`Error::Unavailable`], and the server's own faults,
    /// classes `XX` and `58`, are [`Error::Storage`] wherever raised, or
    /// [`Error::Unavailable`] for `58000` and `58030`; a
    /// group commit or a lease renewal batch refused so runs again a key
    /// at a time, so that the requests of other keys are decided (once two
    /// keys of a group commit in a row are refused with the same words,
    /// the keys after them are not run and are answered
    /// [`Error::Unavailable`]); `claim_many` and an import batch are one
    /// transaction, refused whole; a statement of the store's that cannot
    /// be prepared against the schema, `42883` after a column's type was
    /// changed say, is this fault too), the sequence replaced (`42809`) or set
    /// back below a key's fencing token (a takeover is refused: raise it
    /// with `setval` to the records table's largest token), or row-level
    /// security made active for the store's role on its tables (a policy
    /// that hides a row makes a held key or business key look free: a
    /// connect refuses it, and a running store's sessions, which set
    /// `row_security = off`, have their statements refused, `42501` "query
    /// would be affected by row-level security policy"; through
    /// `complete_in`, row-level security active for the caller's role,
    /// whose statements a policy would filter). (Or found by a
    /// connect or a migration: a version row without `records`, `bindings`
    /// or `tokens`, or those without a version row; it refuses rather than
    /// create the missing objects empty, or a new store over old rows; or
    /// a column of another type than the store's, found by a connect, or
    /// on a request by the driver before anything was applied; the
    /// exceptions: a hot statement, which commits on its own, whose answer
    /// cannot be read so is [`Error::OutcomeUnknown`] naming this fault,
    /// and `complete_in`/`fail_in` answer [`Error::Storage`] and abort the
    /// caller's transaction). What was added (a constraint, a trigger) is
    /// undone by dropping it: nothing was applied. When objects were
    /// dropped, the records they held may be gone, and with
    /// them the outcomes that stop a key's work from running twice:
    /// restore the schema from a database backup or an export
    /// (`idemstore import`), or drop it so that a migration creates an
    /// empty store. Through `complete_in` or `fail_in`, a caller's
    /// connection to another database than the store's, without such a
    /// schema, gets the same codes: check which connection answered
    /// before restoring anything (one with another store there is
    /// [`ConfigFault::OtherStore`]).
    /// No command of idemstore reads such a schema (every connection
    /// prepares statements over all of its objects): save what is left
    /// with PostgreSQL's own tools (`pg_dump --schema`).
    SchemaDamaged,
    /// The connection string cannot reach a server as written, found when
    /// connecting (the driver's "invalid configuration", or a setting it
    /// cannot send): no host or `hostaddr` (`postgresql:///db`, libpq's
    /// default Unix socket, which `tokio-postgres` does not look for: name
    /// the socket's directory, `host=/var/run/postgresql`), or a value
    /// holding a NUL byte. Or a setting in its `options` the server refuses
    /// (at the session's start, or behind a session pooler when the
    /// engine sets it): a parameter it does not know (SQLSTATE `42704`), a
    /// value it refuses (`22023`), or one only the server's own start may
    /// set (`55P02`), or a name it cannot take (`42602`, behind a session
    /// pooler).
    ConnectionString,
    /// A store set for a pooler in session mode (`PostgresPooler::Session`)
    /// reached a pool that hands one client's server session to another
    /// between transactions (PgBouncer's `pool_mode = transaction` or
    /// `statement`), found by a probe at connect. There the engine's named
    /// prepared statements would run another client's statements of the
    /// same name (another store's schema, another program's SQL) and its
    /// session limits would apply to other clients: point the store at an
    /// entry in session mode (docs/operations.md, "Behind PgBouncer"). The
    /// probe can miss such a pool (a pooler that picks server sessions
    /// round robin), so the entry's mode is the operator's to check.
    TransactionPooling,
    /// The store's [`PostgresPooler`](crate::PostgresPooler) setting does
    /// not fit what its URL reaches: the default `Direct`, which sends the
    /// engine's session settings (its limits, and `row_security = off`) as
    /// the startup parameter `options`, reached a pooler that refuses that
    /// parameter (PgBouncer: "unsupported startup parameter: options",
    /// SQLSTATE `08P01`) or drops it (PgBouncer's
    /// `ignore_startup_parameters = options`: found at connect, where the
    /// session's `row_security` is not `off` as the client set it; the
    /// limits would not hold). Set
    /// `Config::postgres_pooler(PostgresPooler::Session)` and point the
    /// URL at a session-mode entry (docs/operations.md, "Behind
    /// PgBouncer"). Also a store set so (`Session`) whose URL has its own
    /// `options`, which the pooler refuses: remove them from the URL, or
    /// let the pooler ignore the parameter (with `Session`, and only then,
    /// that loses nothing: the store sets the URL's settings with
    /// `set_config` after connecting). Run a migration (always direct) and
    /// the `idemstore` commands against the server itself, not the pooler.
    PoolerMismatch,
    /// `complete_in` or `fail_in` was given a connection whose schema of
    /// the store's name holds another store (another identity: the
    /// caller's connection is to another database, a staging copy say),
    /// found before anything was written; the caller's transaction is
    /// aborted. Without this check the other store's row would be judged
    /// instead: a lease it does not hold there answered
    /// [`Error::StaleLease`], and a transaction reading one snapshot was
    /// told to run again, every time. Give them a connection to the
    /// store's own database.
    OtherStore,
}

impl ConfigFault {
    /// A short name of the fault, for messages, metrics and JSON
    /// (`"database-missing"`, `"role-refused"`, …).
    pub fn name(self) -> &'static str {
        match self {
            ConfigFault::DatabaseMissing => "database-missing",
            ConfigFault::RoleRefused => "role-refused",
            ConfigFault::AuthenticationFailed => "authentication-failed",
            ConfigFault::PermissionDenied => "permission-denied",
            ConfigFault::Tls => "tls",
            ConfigFault::SchemaTooNew => "schema-too-new",
            ConfigFault::SchemaNotMigrated => "schema-not-migrated",
            ConfigFault::SchemaDamaged => "schema-damaged",
            ConfigFault::ConnectionString => "connection-string",
            ConfigFault::TransactionPooling => "transaction-pooling",
            ConfigFault::PoolerMismatch => "pooler-mismatch",
            ConfigFault::OtherStore => "other-store",
        }
    }
}

impl std::fmt::Display for ConfigFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The rule an imported frame broke (see [`Error::ImportRefused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ImportRule {
    /// The stream's token counter is above [`MAX_TOKEN`](crate::MAX_TOKEN),
    /// or a record's token is not below it: importing it would leave no
    /// token for the next acquisition, or wrap the counter. Also a record's
    /// token 0, which no store issues (tokens start at 1).
    TokenCap,
    /// The stream's clock high-water mark, or a record's update time, is
    /// further ahead of the store's clock than the import's tolerance
    /// ([`ImportOptions::clock_tolerance`](crate::ImportOptions::clock_tolerance),
    /// 5 minutes by default).
    ClockAhead,
    /// A record's times contradict each other: it was created after its
    /// last update, or it expires at or before its last update (retention
    /// counts from the update, so no store writes such a record, and a
    /// claim, judged at the record's last update at least, would find it
    /// absent while a read found it live).
    TimesOutOfOrder,
    /// A record's time (creation, update, lease end or expiry) is above
    /// `i64::MAX` milliseconds, the largest a PostgreSQL `bigint` column
    /// holds: refused by both engines, so that a stream one engine takes
    /// the other takes too (about 292 million years ahead, so no clock
    /// ever made it); or its last update is later than that less
    /// [`MAX_RETENTION`](crate::MAX_RETENTION), so that a later write to it
    /// (stamped at its last update at least, plus a lease or a retention)
    /// could not fit.
    TimeOutOfRange,
    /// A record's lease ends more than [`MAX_LEASE`](crate::MAX_LEASE)
    /// after its last update.
    LeaseTooLong,
    /// A record expires more than [`MAX_RETENTION`](crate::MAX_RETENTION)
    /// after its last update.
    RetentionTooLong,
    /// A Processing record expires before its lease ends.
    ExpiryBeforeLease,
    /// A record's state and its other fields disagree: a Succeeded or
    /// Failed record without its output, or a record with no acquisition.
    StateOutput,
    /// A record's output or recovery point is over the store's configured
    /// limit (in bytes).
    TooLarge,
    /// A record's business key is empty, too long or malformed.
    BusinessKey,
    /// The store's own record of a frame's key is damaged (it fails its
    /// checksum), so the import cannot tell whether it is live and never
    /// writes over it. Found while the frame's batch is written, so unlike
    /// the other rules the rest of that batch was written, and `imported`
    /// counts it. Run `idemstore check`; restore the store from an export
    /// (`idemstore import --create`) into a new file.
    StoredRecordDamaged,
}

impl ImportRule {
    /// A short name of the rule, for messages and JSON (`"token-cap"`,
    /// `"clock-ahead"`, …).
    pub fn name(self) -> &'static str {
        match self {
            ImportRule::TokenCap => "token-cap",
            ImportRule::ClockAhead => "clock-ahead",
            ImportRule::TimesOutOfOrder => "times-out-of-order",
            ImportRule::TimeOutOfRange => "time-out-of-range",
            ImportRule::LeaseTooLong => "lease-too-long",
            ImportRule::RetentionTooLong => "retention-too-long",
            ImportRule::ExpiryBeforeLease => "expiry-before-lease",
            ImportRule::StateOutput => "state-output",
            ImportRule::TooLarge => "too-large",
            ImportRule::BusinessKey => "business-key",
            ImportRule::StoredRecordDamaged => "stored-record-damaged",
        }
    }
}

impl std::fmt::Display for ImportRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The errors that pass on their own: the PostgreSQL engine's
    /// unreachable server and lost answer; none that needs an operator or a
    /// reopen, or rejects the input.
    #[test]
    fn transient_errors_are_those_that_pass_on_their_own() {
        let detail = || "x".to_owned();
        for e in [
            Error::Unavailable { detail: detail() },
            Error::OutcomeUnknown { detail: detail() },
        ] {
            assert!(e.is_transient(), "{e:?}");
            assert!(!e.is_client_error(), "{e:?}");
        }
        for e in [
            Error::InvalidKey { reason: detail() },
            Error::invalid("lease", detail()),
            Error::Storage(detail()),
            Error::Poisoned { cause: detail() },
            Error::Closed,
            Error::Misconfigured {
                fault: ConfigFault::SchemaDamaged,
                detail: detail(),
            },
            Error::IncompatibleSchema {
                schema: detail(),
                detail: detail(),
            },
            Error::ReadOnly {
                path: PathBuf::from("s.redb"),
                operation: "claim",
            },
        ] {
            assert!(!e.is_transient(), "{e:?}");
        }
    }
}
