//! The PostgreSQL engine (cargo feature `postgres`): one database shared by
//! every replica of a service.
//!
//! Everything here is behind the engine boundary ([`crate::engine`]); the
//! public face of the feature is [`crate::postgres`] (the effect and the
//! completion in one transaction) and `Store::connect`.
//!
//! # How it works
//!
//! - **One driver thread** owns a tokio current-thread runtime, on which
//!   `tokio-postgres` runs up to `PgOptions::connections` connections. The
//!   sync API (`Postgres::apply` and the rest) sends a job to that thread
//!   and blocks on a one-shot answer; `Postgres::apply_async` awaits the
//!   same answer as a runtime-free future.
//! - **A pool that follows the load** ([`pool`]). Every connection has a
//!   worker task; a dispatcher hands the queued jobs to a free worker (the
//!   one freed last, whose connection is warm) and starts a new worker,
//!   whose connection opens on its first job, only while jobs are queued
//!   and every worker is busy, up to `PgOptions::connections`. A worker
//!   left unused for `PostgresLimits::connection_idle_timeout` ends and
//!   closes its connection. A lone sequential caller is served by one
//!   connection; a burst opens more, which close once it has passed. A
//!   sync caller's direct connection (`Postgres::apply_direct`) is closed
//!   by the driver thread after the same time unused.
//! - **Group commit over the wire.** A free worker is handed everything
//!   queued (up to `MAX_BATCH` requests, never waiting for more to
//!   arrive, so a lone caller is never held back)
//!   and runs it as one transaction: one multi-row read that locks the
//!   batch's rows in key order (`SELECT … WHERE key = ANY($1) ORDER BY key
//!   FOR UPDATE`), tokens drawn from the sequence only after the rows are
//!   locked, the database clock read after the last lock wait, every
//!   request decided in
//!   arrival order by the pure `record::transition`
//!   over an in-memory overlay (so a later request sees an earlier one), and
//!   one multi-row write per kind (`UNNEST` arrays) that is a compare-and-set
//!   against what was read: `INSERT … ON CONFLICT DO NOTHING` for keys
//!   that were absent, `UPDATE`/`DELETE … WHERE token = $seen` for rows that
//!   were read. A key whose insert loses (another process inserted it
//!   meanwhile) is read again and the batch decided again inside the same
//!   transaction (the writes roll back to a savepoint first): never an error,
//!   never an answer lost for the other keys. To save a round trip, a
//!   batch's first attempt sends its writes and the `COMMIT` in one flight
//!   when the only writes that may lose are record inserts, with an insert
//!   that fails on a present key; that failure rolls the transaction back
//!   and the batch runs again at once in a new one, the savepoint's way
//!   (its callers see no difference but the time).
//! - **The hot path** ([`hot`]): before a batch is run the general way, a
//!   claim of a key that may be absent, a completion or failure by a
//!   holder of this process, and a claim that the key's row decides
//!   without a write (a replay, a lease in progress, a fingerprint
//!   mismatch) are sent as one autocommit statement per kind, the time
//!   and the token read by the statement itself; only what it cannot
//!   decide goes on to the general transaction. A sync caller outside an
//!   async runtime runs its hot request on a direct connection that its
//!   own thread drives (no hand-off to the driver thread) while that
//!   connection is free, and through the queue otherwise.
//! - **One clock.** The store's time is the database's `clock_timestamp()`,
//!   read after every lock the decision waits for (rows, the shared token
//!   lock, business-key bindings; again after a lost compare-and-set's
//!   new locks), so that a lease is never granted from a reading taken
//!   before a wait (or, for tests, the reading of the
//!   [`Clock`] given at connect, which replaces the server clock entirely),
//!   and kept monotonic per record (a request on a record is decided at no
//!   earlier time than the record's last update), never per process: after
//!   the clock steps back, a process whose time stood still at its highest
//!   reading would see another replica's fresh lease as lapsed and take it
//!   over. So a step back makes granted leases and retentions last longer
//!   by the step, never shorter, and every replica decides alike.
//! - **Tokens** come from one sequence, capped below `i64::MAX` like the
//!   embedded counter; a sequence value is never handed out twice, also
//!   after a row is deleted. An import raises the sequence under the
//!   records table's `EXCLUSIVE` lock, which every draw's statement
//!   conflicts with (see [`hot`]).
//! - **Failures**: a request that was not applied (the server unreachable,
//!   the connection lost before the commit) gets
//!   [`Error::Unavailable`]; a request whose `COMMIT` was sent and whose
//!   answer was lost gets [`Error::OutcomeUnknown`]. The next batch opens a
//!   new connection. A statement the server refuses (a deadlock is tried
//!   again first) also leaves the batch unapplied. The refusal's SQLSTATE
//!   class says what the request is answered ([`Refusal`]): one that
//!   passes (a lock wait, `statement_timeout`, too few resources) is
//!   [`Error::Unavailable`]; one that a retry meets again is
//!   [`Error::Misconfigured`] when something added to the schema outside
//!   idemstore raised it (a constraint, a trigger's function) and
//!   [`Error::Storage`] otherwise (a data exception, the server's data
//!   found corrupted). A lock wait past `lock_timeout` (SQLSTATE 55P03),
//!   or a refusal met again, in a group commit or a lease renewal batch of
//!   several keys runs its requests again, each key's in a transaction of
//!   its own ([`run_apart`]), so that only the requests of the key that
//!   meets it (a row held by another session, a trigger that refuses one
//!   row, a damaged page) are refused; once two keys in a row are refused
//!   with the same words, the rest of a group commit is answered
//!   [`Error::Unavailable`] without running (sent again, each is decided).
//!   A direct store whose startup `options` a pooler refuses or drops is
//!   refused at connect ([`ConfigFault::PoolerMismatch`]).
//! - **Bounded waits** ([`PostgresLimits`]): every call carries a
//!   deadline (`call_timeout` from when it is made) that covers the wait
//!   for room in the bounded queue, for a worker, for a connection and
//!   for the server; a worker runs a job under its deadline and, past it,
//!   drops the connection and answers [`Error::Unavailable`] if the
//!   `COMMIT` was not sent yet and [`Error::OutcomeUnknown`] if it was.
//!   The engine's sessions carry `statement_timeout`, `lock_timeout` and
//!   `idle_in_transaction_session_timeout` (so the server ends a session
//!   left half-open inside a transaction, releasing its row locks), the
//!   planner settings `plan_cache_mode = force_generic_plan` and
//!   `enable_seqscan = off` (see `session_settings`), `row_security = off`
//!   after the URL's own options (so that a row-level security policy
//!   refuses the store's statements instead of hiding rows from them; see
//!   `ENFORCED_SETTINGS`), the same through a pooler in session mode, and
//!   TCP keepalives. `Drop` waits for the
//!   jobs in flight, so for at most one `call_timeout`.
//! - **Durability** is the server's: an answer is given only after the
//!   `COMMIT` returned, so `synchronous_commit` must stay `on` (with `off`
//!   a crash of the server loses acknowledged claims, and a lost claim lets
//!   a duplicate run), and a failover keeps the guarantee only with
//!   synchronous replication (an asynchronous standby may lack the last
//!   acknowledged claims and completions).

mod decide;
mod hot;
mod schema;
#[cfg(any(test, feature = "conformance"))]
pub mod server;
#[cfg(test)]
mod tests;
mod tls;
pub(crate) mod txn;
#[cfg(feature = "sqlx")]
pub(crate) mod txn_sqlx;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::error::Error as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Row, Statement};

use crate::audit::Event;
use crate::clock::Clock;
use crate::config::{PostgresLimits, PostgresPooler};
use crate::error::{ConfigFault, Error, Result};
use crate::key::Key;
use crate::record::{Op, Record, Reply, Sent};
use crate::report::{CheckReport, Integrity, PairDigest, Problem, Progress};
use crate::stats::{LiveCounters, StateCounts};

use decide::{Base, Pass, RowColumns, Slot};
pub(crate) use schema::SCHEMA_VERSION;
use schema::Sql;

/// The most requests one group commit takes from the queue.
pub(crate) const MAX_BATCH: usize = 512;
/// How often a batch is tried again after a deadlock or serialization
/// failure before its callers get [`Error::Unavailable`].
const MAX_ATTEMPTS: usize = 8;
/// How often a batch is decided again after losing a compare-and-set.
const MAX_ROUNDS: usize = 64;
/// Rows per page of [`Postgres::entries`].
const PAGE_ROWS: i32 = 512;
/// The interval of TCP keepalive probes after the first, and how many
/// unanswered ones end a connection.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;

/// How a PostgreSQL store is opened.
#[derive(Clone)]
pub(crate) struct PgOptions {
    /// The schema that holds the store's tables (several stores can share
    /// one database under different schemas): 1 to 63 ASCII letters, digits
    /// or underscores, not starting with a digit, not `pg_…` or
    /// `information_schema`. Default `"idemstore"`.
    pub schema: String,
    /// A test clock that replaces the server clock entirely: its wall
    /// reading is the store's time, sent as a parameter.
    /// `None` (the default and the only production setting) reads the
    /// database's `clock_timestamp()`.
    pub clock: Option<Arc<dyn Clock>>,
    /// How long a finished record is kept for replays (ms, > 0). Default
    /// 24 hours.
    pub retention_ms: u64,
    /// The most worker connections that run batches concurrently (> 0),
    /// opened on demand and closed after
    /// `limits.connection_idle_timeout` unused (see [`pool`]). Default 16.
    pub connections: usize,
    /// Refuse a schema that holds no store with [`Error::Missing`] instead
    /// of creating it (for tools that inspect an existing store). Default
    /// `false`.
    pub must_exist: bool,
    /// Run the schema's DDL (create or upgrade it, idempotent) under the
    /// DDL advisory lock whatever its version, instead of a version check
    /// that sends no DDL when the schema is current (for
    /// `idemstore::postgres::migrate`). Default `false`.
    pub migrate: bool,
    /// Time limits and the queue's bound. Default
    /// [`PostgresLimits::default`](crate::PostgresLimits).
    pub limits: PostgresLimits,
    /// The pooler between the store and the server: with one, the session
    /// settings are sent with `SET` on each connection opened (a pooler
    /// refuses the startup `options`). Default `Direct`.
    /// `PostgresPooler::Transaction` is refused at connect (in
    /// `Postgres::connect`) until the engine sends no named statements and
    /// relies on no session settings.
    pub pooler: PostgresPooler,
}

/// The schema a store lives in when none is configured.
pub(crate) const DEFAULT_SCHEMA: &str = "idemstore";
/// How many connections run transactions at once when not configured.
pub(crate) const DEFAULT_CONNECTIONS: usize = 16;

impl Default for PgOptions {
    fn default() -> PgOptions {
        PgOptions {
            schema: DEFAULT_SCHEMA.into(),
            clock: None,
            retention_ms: 24 * 3600 * 1000,
            connections: DEFAULT_CONNECTIONS,
            must_exist: false,
            migrate: false,
            limits: PostgresLimits::default(),
            pooler: PostgresPooler::Direct,
        }
    }
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("schema", &self.schema)
            .field("test_clock", &self.clock.is_some())
            .field("retention_ms", &self.retention_ms)
            .field("connections", &self.connections)
            .finish()
    }
}

/// A request to the driver thread.
enum Job {
    /// One request, group-committed with whatever else is queued.
    Apply {
        key: Key,
        op: Op,
        /// Whether the hot path may take it (false once it was tried).
        hot: bool,
        reply: oneshot::Sender<Result<Reply>>,
    },
    /// Requests in one transaction of their own; with a token floor, an
    /// import.
    Many {
        ops: Vec<(Key, Op)>,
        token_floor: Option<u64>,
        /// The transaction's own `lock_timeout` (a renewal batch's: see
        /// [`renewal_lock_wait`]); refused a lock past it while it held
        /// requests of several keys, they run again a key at a time
        /// ([`run_apart`]). `None`: the session's, and the batch fails as
        /// a whole.
        lock_wait: Option<Duration>,
        /// Whether the job's deadline is its own, shorter than
        /// `call_timeout` (a lease renewal, a write that must end while a
        /// lease lasts): its transaction then sets its
        /// `idle_in_transaction_session_timeout` from it ([`idle_wait`]).
        own_deadline: bool,
        reply: oneshot::Sender<Result<Vec<Result<Reply>>>>,
    },
    /// Reads one record at the store's time.
    Get {
        key: Key,
        reply: oneshot::Sender<Result<Option<Record>>>,
    },
    /// Evicts up to `max` records past retention.
    Sweep {
        max: usize,
        reply: oneshot::Sender<Result<usize>>,
    },
    /// Reads the store's time.
    Now { reply: oneshot::Sender<Result<u64>> },
    /// Reads the token the next acquisition would take.
    NextToken { reply: oneshot::Sender<Result<u64>> },
    /// Counts the stored rows.
    Len { reply: oneshot::Sender<Result<u64>> },
    /// Counts the stored rows by state at a store time (ms; `None`: the
    /// store's time, read in the same job, under the same deadline).
    Counts {
        now_ms: Option<u64>,
        reply: oneshot::Sender<Result<(u64, StateCounts, Option<u64>)>>,
    },
}

impl Job {
    /// Answers the job with `error` (its deadline passed before it ran, or
    /// the engine is closing).
    fn fail(self, error: Error) {
        match self {
            Job::Apply { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Job::Many { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Job::Get { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Job::Sweep { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Job::Now { reply } | Job::NextToken { reply } | Job::Len { reply } => {
                let _ = reply.send(Err(error));
            }
            Job::Counts { reply, .. } => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

/// A job in the queue: its deadline (the call's), and its place in the
/// bounded queue (given back when the job is answered).
struct Queued {
    job: Job,
    deadline: Instant,
    permit: tokio::sync::OwnedSemaphorePermit,
}

/// The error of a job whose deadline passed before it was sent to the
/// server.
fn expired_in_queue() -> Error {
    Error::Unavailable {
        detail: "the call's deadline (PostgresLimits::call_timeout) passed before it could run"
            .into(),
    }
}

/// One request in a transaction of its own (a request with a deadline
/// shorter than `call_timeout`: group-committed with others, it would hold
/// them to that deadline).
fn alone(key: &Key, op: Op, reply: oneshot::Sender<Result<Vec<Result<Reply>>>>) -> Job {
    Job::Many {
        ops: vec![(key.clone(), op)],
        token_floor: None,
        lock_wait: None,
        own_deadline: true,
        reply,
    }
}

/// The answer to the one request of [`alone`].
fn only_reply(mut replies: Vec<Result<Reply>>) -> Result<Reply> {
    replies
        .pop()
        .unwrap_or_else(|| Err(Error::Storage("no answer to a request".into())))
}

/// After a call's deadline passed mid-transaction: drops the connection
/// (its state is unknown) and says whether the `COMMIT` had been sent.
fn expire(slot: &mut Option<Conn>) -> Fail {
    let sent = slot
        .as_ref()
        .is_some_and(|c| c.commit_sent.load(Ordering::SeqCst));
    *slot = None;
    let what = "the call's deadline (PostgresLimits::call_timeout) passed";
    if sent {
        Fail::Unknown(format!("{what} after its COMMIT was sent"))
    } else {
        Fail::Lost(format!("{what} before its COMMIT was sent"))
    }
}

/// What the driver thread's tasks share.
struct Shared {
    /// The statements, for the configured schema.
    sql: Sql,
    /// How to connect (application name and connect timeout filled in).
    config: tokio_postgres::Config,
    /// The TLS connector (`None`: `sslmode=disable`).
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
    /// The test clock, if one replaces the database clock.
    clock: Option<Arc<dyn Clock>>,
    /// Configured retention (ms).
    retention_ms: u64,
    /// Refuse a schema without a store instead of creating it.
    must_exist: bool,
    /// Run the DDL whatever the schema's version.
    migrate: bool,
    /// Time limits and the queue's bound.
    limits: PostgresLimits,
    /// The session settings to send with `SET` once a connection is open
    /// (behind a pooler, which refuses them as startup `options`).
    session_set: Option<String>,
    /// The last reading of the database clock (or the test clock) this
    /// process took (ms): what `last_now_ms` answers while the server
    /// cannot be reached. Never a floor for a decision: replicas agree on
    /// a lease only if each decides by the clock they share (floored by
    /// the record's own last write, which they share too), and a floor of
    /// one process's own (its highest reading, say) would run ahead of the
    /// others' after the clock steps back.
    last_reading: AtomicU64,
    /// The counters behind `stats`, counted as the audit log publishes.
    counters: LiveCounters,
    /// The Processing records this process wrote last (by key bytes), with
    /// their `record` column: what a completion by the holder is decided
    /// on by the hot path, whose `UPDATE` lands only while the row still
    /// holds these bytes (so a stale entry only sends the request the
    /// general way). At most [`HELD_MAX`] entries of at most
    /// [`HELD_MAX_BYTES`] each.
    held: parking_lot::Mutex<HashMap<Vec<u8>, Held>>,
    /// The keys a group commit's cut-off answered "not run" ([`run_apart`])
    /// and no later split has decided yet: sent again into a batch that is
    /// split, each runs first and is never cut off, so that it is decided
    /// however many refused requests arrive before it. At most
    /// [`NOT_RUN_MAX`] (when full, the cut-off runs keys instead).
    not_run: parking_lot::Mutex<std::collections::HashSet<Key>>,
}

/// The most keys [`Shared::not_run`] holds.
const NOT_RUN_MAX: usize = 4_096;

/// The most records [`Shared::held`] keeps (it is emptied when full).
const HELD_MAX: usize = 16_384;
/// The largest stored record [`Shared::held`] keeps (in bytes; a larger
/// one, with a large recovery point or failure history, is completed the
/// general way), so that it holds at most about 32 MiB.
const HELD_MAX_BYTES: usize = 1024;

/// A record this process wrote, as stored.
#[derive(Debug, Clone)]
struct Held {
    /// The record.
    record: Record,
    /// Its `record` column.
    stored: Vec<u8>,
}

impl Shared {
    /// Notes a reading of the clock (see `last_reading`) and returns it as
    /// it is. Only clock readings are noted: a time floored by a row's
    /// (a hot completion's) could come from a row written by hand.
    fn seen(&self, reading: u64) -> u64 {
        self.last_reading.store(reading, Ordering::SeqCst);
        reading
    }

    /// Keeps `record` (written as `stored`) for a completion by its holder
    /// while it is Processing; forgets the key otherwise.
    fn hold(&self, kb: &[u8], record: &Record, stored: Vec<u8>) {
        let mut held = self.held.lock();
        if record.state == crate::record::State::Processing && stored.len() <= HELD_MAX_BYTES {
            if held.len() >= HELD_MAX && !held.contains_key(kb) {
                held.clear();
            }
            held.insert(
                kb.to_vec(),
                Held {
                    record: record.clone(),
                    stored,
                },
            );
        } else {
            held.remove(kb);
        }
    }

    /// Keeps what the general path's answers say of the keys' records.
    fn remember(&self, ops: &[(Key, Op)], answers: &[Result<Reply>]) {
        for ((key, _), answer) in ops.iter().zip(answers) {
            let record = match answer {
                Ok(Reply::Claim(crate::record::ClaimOutcome::Acquired(lease))) => lease.record(),
                Ok(Reply::Record(r)) => Some(r),
                Ok(Reply::Released) => {
                    self.held.lock().remove(&key.to_bytes());
                    None
                }
                _ => None,
            };
            if let Some(r) = record {
                let kb = key.to_bytes();
                let stored = crate::codec::encode_record(&kb, r);
                self.hold(&kb, r, stored);
            }
        }
    }
}

/// The PostgreSQL engine: see the [module documentation](self).
pub(crate) struct Postgres {
    /// What the driver thread shares.
    shared: Arc<Shared>,
    /// The queue to the workers (`None` once dropping).
    jobs: Option<UnboundedSender<Queued>>,
    /// Room in the queue: one permit per call queued or running.
    room: Arc<tokio::sync::Semaphore>,
    /// The driver thread's runtime, for scans.
    handle: tokio::runtime::Handle,
    /// The scans that may hold a connection of their own at once
    /// ([`PostgresLimits::scans`]).
    scans: Arc<ScanRoom>,
    /// The store's identity, from the meta table.
    store_id: u128,
    /// What connecting found the schema to be.
    found: Found,
    /// The driver thread.
    thread: Option<JoinHandle<()>>,
    /// Connections a sync caller drives on its own thread for the hot
    /// path ([`Postgres::apply_direct`]); the driver thread closes one left
    /// unused for `connection_idle_timeout` ([`close_idle_direct`]).
    direct: Arc<[parking_lot::Mutex<DirectConn>]>,
    /// Wakes [`close_idle_direct`] when a call opened a direct connection
    /// (it sleeps while none is open).
    direct_opened: Arc<tokio::sync::Notify>,
}

/// How many direct connections a store keeps (besides its workers').
const DIRECT_CONNECTIONS: usize = 1;

/// A connection that the calling thread drives: its own current-thread
/// runtime (whose I/O the caller polls in `block_on`) and the connection,
/// opened on first use.
struct DirectConn {
    /// The runtime (`None` before the first call and once closed: the
    /// next call builds one).
    runtime: Option<tokio::runtime::Runtime>,
    /// The connection.
    conn: Option<Conn>,
    /// When a call last used it (`None` before the first call and once
    /// closed).
    used: Option<Instant>,
}

/// How long a closed direct connection's runtime is still driven, on a
/// short-lived thread of its own, so that the connection's task sees its
/// client gone and ends the session as a client should (a `Terminate`
/// message, and TLS's close_notify) before the runtime is shut down:
/// writes to a local socket buffer, so well under this on any network.
const DIRECT_CLOSE_GRACE: Duration = Duration::from_millis(100);

/// A runtime shut down without blocking when dropped (`shutdown_background`:
/// dropping a runtime inside another's context would panic).
struct Background(Option<tokio::runtime::Runtime>);

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl DirectConn {
    fn new() -> DirectConn {
        DirectConn {
            runtime: None,
            conn: None,
            used: None,
        }
    }

    /// Closes the connection, never blocking (a store may be dropped
    /// inside an async runtime, and the driver thread closes idle ones
    /// from its own). The connection's task lives in the runtime, which
    /// no caller drives while it is idle, so dropping the client alone
    /// would leave the session open until the next call: the runtime is
    /// driven for [`DIRECT_CLOSE_GRACE`] on a thread of its own, where the
    /// task ends the session, then shut down (at once, dropping the task
    /// and its socket, if no thread can be started).
    fn close(&mut self) {
        let conn = self.conn.take();
        self.used = None;
        let runtime = Background(self.runtime.take());
        if conn.is_none() || runtime.0.is_none() {
            return;
        }
        drop(conn);
        // On failure the closure, and with it the runtime, is dropped.
        let _ = std::thread::Builder::new()
            .name("idemstore-postgres-close".into())
            .spawn(move || {
                if let Some(rt) = &runtime.0 {
                    // The timer is made inside the runtime's context.
                    rt.block_on(async { tokio::time::sleep(DIRECT_CLOSE_GRACE).await });
                }
            });
    }
}

impl Drop for DirectConn {
    fn drop(&mut self) {
        self.close();
    }
}

/// Closes each direct connection left unused for `idle` (as the pool
/// retires an idle worker's): sleeps until the least recently used open
/// one comes due, or, while none is open, until a call opens one
/// (`opened`); one in use is looked at again `idle` later (its call marks
/// it used). Runs on the driver thread until the store is dropped.
async fn close_idle_direct(
    direct: std::sync::Weak<[parking_lot::Mutex<DirectConn>]>,
    opened: Arc<tokio::sync::Notify>,
    idle: Duration,
) {
    let mut wait: Option<Duration> = None;
    loop {
        match wait {
            Some(wait) => tokio::time::sleep(wait).await,
            None => opened.notified().await,
        }
        let Some(direct) = direct.upgrade() else {
            return;
        };
        wait = None;
        let now = Instant::now();
        for d in direct.iter() {
            let Some(mut d) = d.try_lock() else {
                wait = Some(wait.map_or(idle, |w| w.min(idle)));
                continue;
            };
            let Some(due) = d.used.and_then(|used| used.checked_add(idle)) else {
                continue;
            };
            match due.checked_duration_since(now) {
                Some(left) if !left.is_zero() => wait = Some(wait.map_or(left, |w| w.min(left))),
                _ => d.close(),
            }
        }
        // A timer of at least a millisecond, whatever the clock did.
        wait = wait.map(|w| w.max(Duration::from_millis(1)));
    }
}

/// What [`Postgres::apply_direct`] did.
enum Direct {
    /// The hot path answered.
    Answered(Result<Reply>),
    /// The hot path sent nothing it could decide: the general path.
    Undecided,
    /// The hot statement was refused for a reason met again
    /// ([`Fail::Rejected`]), which may be this key's own: the general path,
    /// in a transaction of its own ([`alone`]), so that a group commit
    /// does not meet it for other callers' requests.
    Rejected,
    /// Not tried (no free direct connection, not a hot request, called
    /// inside a runtime, or no runtime could be built for a closed
    /// connection): the queue, where the hot path may still take it.
    Busy,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres")
            .field("schema", &self.shared.sql.schema)
            .field("store_id", &format_args!("{:032x}", self.store_id))
            .finish()
    }
}

/// The failure of one transaction attempt.
#[derive(Debug)]
enum Fail {
    /// A deadlock or serialization failure: nothing applied, try again.
    Retry(String),
    /// A strict insert sent with the `COMMIT` lost to a concurrent insert
    /// of the same key: the transaction was rolled back, nothing applied;
    /// try again with a savepoint, so that the lost key is read and decided
    /// again inside the transaction.
    Contended(String),
    /// The connection is gone (or the server going away) before the commit
    /// was sent: nothing applied.
    Lost(String),
    /// The commit was sent and its answer lost.
    Unknown(String),
    /// The server refused a statement or the commit for a reason that
    /// passes ([`Refusal::Passes`]): nothing applied, try again later.
    Refused(String),
    /// The server refused a statement or the commit for a reason that the
    /// same statement meets again ([`Refusal::Lasts`], or
    /// [`Refusal::Added`] when the `bool` is true): nothing applied, and a
    /// retry as is gets the same answer. It may be the rows' own (a
    /// trigger that refuses one key's row, a page of the table corrupted),
    /// so a batch of several keys refused so is run again a key at a time
    /// ([`run_apart`]), as a lock wait's is.
    Rejected(String, bool),
    /// A wait for a lock (a row held by another session, a business key's
    /// binding, the token lock) passed `lock_timeout` (SQLSTATE 55P03):
    /// nothing applied. A batch of several keys refused so is run again a
    /// key at a time ([`run_apart`]), so that only the requests that wait
    /// for the lock are refused.
    Locked(String),
    /// The server refused a write as read-only (SQLSTATE 25006): nothing
    /// applied, and the connection is dropped, since only a new one can
    /// reach a host that takes writes (see [`read_only`]).
    ReadOnly(String),
    /// Something else went wrong (a bad row, an unexpected answer).
    Storage(String),
    /// A configuration fault (no such database, a role refused, a
    /// privilege missing, TLS verification): nothing applied, and a retry
    /// as is gets the same answer.
    Config(ConfigFault, String),
}

impl Fail {
    /// The failure of a server's refusal sorted as `refusal`.
    fn refused(refusal: Refusal, detail: String) -> Fail {
        match refusal {
            Refusal::Passes => Fail::Refused(detail),
            Refusal::Added => Fail::Rejected(detail, true),
            Refusal::Lasts => Fail::Rejected(detail, false),
        }
    }

    /// The error a caller gets for this failure.
    fn error(&self) -> Error {
        match self {
            Fail::Retry(d)
            | Fail::Contended(d)
            | Fail::Lost(d)
            | Fail::Refused(d)
            | Fail::Locked(d)
            | Fail::ReadOnly(d) => Error::Unavailable { detail: d.clone() },
            Fail::Unknown(d) => Error::OutcomeUnknown { detail: d.clone() },
            Fail::Storage(d) | Fail::Rejected(d, false) => Error::Storage(d.clone()),
            Fail::Rejected(d, true) => Error::Misconfigured {
                fault: ConfigFault::SchemaDamaged,
                detail: d.clone(),
            },
            Fail::Config(fault, d) => Error::Misconfigured {
                fault: *fault,
                detail: d.clone(),
            },
        }
    }
}

/// The configuration fault `err` reports, if any: a server error whose
/// SQLSTATE names one, or a TLS failure of verification (or a server
/// without TLS where TLS is required).
fn config_fault(err: &tokio_postgres::Error) -> Option<ConfigFault> {
    if password_missing(err) {
        return Some(ConfigFault::AuthenticationFailed);
    }
    if err.as_db_error().is_none() {
        // The driver's own kinds (its `Display` is its kind's words, the
        // cause is in `source`): a setting it refuses when connecting, or
        // an authentication exchange that cannot succeed as configured.
        let said = err.to_string();
        if said.starts_with("invalid configuration") {
            return Some(ConfigFault::ConnectionString);
        }
        if said.starts_with("authentication error") {
            return Some(ConfigFault::AuthenticationFailed);
        }
    }
    if row_security_refused(err) {
        return Some(ConfigFault::SchemaDamaged);
    }
    if let Some(db) = err.as_db_error()
        && db.code() == &SqlState::FEATURE_NOT_SUPPORTED
        && db.message() == "cached plan must not change result type"
    {
        // A statement this connection prepared reads a column whose type
        // was altered since (outside idemstore): every later run of it
        // meets this again.
        return Some(ConfigFault::SchemaDamaged);
    }
    if let Some(code) = err.code() {
        return sqlstate_fault(code.code());
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = err.source();
    while let Some(s) = source {
        // A column (or a parameter's column) of another type than the
        // store's, found by the driver: altered outside idemstore.
        if s.is::<tokio_postgres::types::WrongType>() {
            return Some(ConfigFault::SchemaDamaged);
        }
        // A NULL in a column the store made `NOT NULL`: the constraint
        // dropped outside idemstore.
        if s.is::<tokio_postgres::types::WasNull>() {
            return Some(ConfigFault::SchemaDamaged);
        }
        if tls_refused(s) {
            return Some(ConfigFault::Tls);
        }
        // An I/O error hides the error it wraps from `source`.
        if let Some(inner) = s
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            && tls_refused(inner)
        {
            return Some(ConfigFault::Tls);
        }
        source = s.source();
    }
    None
}

/// The configuration fault a server error's SQLSTATE names, if any (for
/// the tokio-postgres and the sqlx forms alike).
pub(crate) fn sqlstate_fault(code: &str) -> Option<ConfigFault> {
    match code {
        "3D000" => Some(ConfigFault::DatabaseMissing),
        "28000" => Some(ConfigFault::RoleRefused),
        "28P01" => Some(ConfigFault::AuthenticationFailed),
        "42501" => Some(ConfigFault::PermissionDenied),
        // invalid_schema_name, undefined_table (a sequence too),
        // undefined_column, datatype_mismatch: the schema's objects were
        // dropped or altered under the store.
        "3F000" | "42P01" | "42703" | "42804" => Some(ConfigFault::SchemaDamaged),
        // invalid_column_reference (an `ON CONFLICT (key)` with no unique
        // index to infer: the primary key dropped) and wrong_object_type
        // (the token sequence replaced by a table). (The refusals of what
        // was added to the store's tables, which may be one row's, are
        // [`Refusal::Added`].)
        "42P10" | "42809" => Some(ConfigFault::SchemaDamaged),
        _ => None,
    }
}

/// What a server's refusal of one of the engine's statements (an error
/// with a SQLSTATE that names no configuration fault, [`sqlstate_fault`])
/// means for the request, by the SQLSTATE's class (PostgreSQL's, Appendix
/// A of its manual) and where it was raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// It may pass if the same statement is sent again later: the classes
    /// of a connection (`08`), a transaction rolled back (`40`: a deadlock,
    /// a serialization failure, a hot standby's conflict), too few
    /// resources (`53`: memory, disk, connections, `temp_file_limit`), an
    /// object locked or in use (`55P03`, `55006`; not the rest of class
    /// `55`, such as a table without the replica identity its publication
    /// needs, `55000`), an operator's intervention (`57`: a
    /// statement cancelled by `statement_timeout`, a shutdown), a snapshot
    /// too old (`72`); the server's system and I/O errors (`58000`,
    /// `58030`), a host turned read-only (`25006`), a session ended idle
    /// in a transaction (`25P03`), a sequence at its limit (`2200H`, which
    /// the engine meets only as it raises the token floor), and a unique
    /// violation in the system catalogs (two sessions creating one object
    /// at once). [`Error::Unavailable`].
    Passes,
    /// Raised by what was added to the store's tables outside idemstore,
    /// which the same statement meets again: an integrity constraint's
    /// refusal (class `23`: a `CHECK`, a foreign key, a column `NOT NULL`
    /// without a default, a unique index on another column; the store's
    /// own statements meet none on its schema), a trigger's `RAISE`
    /// (`P0001`), or any refusal that does not pass raised inside a
    /// function (its context names one: a trigger's), except the server's
    /// own faults (classes `XX` and `58`), which are [`Refusal::Lasts`]
    /// wherever they are raised. [`ConfigFault::SchemaDamaged`].
    Added,
    /// Met again, and nothing added explains it: a data exception (`22`),
    /// a program limit (`54`), a syntax or access rule (`42`), the
    /// server's internal errors (`XX001`: a page of its data found
    /// corrupted; `XX002`: an index). [`Error::Storage`].
    Lasts,
}

/// Sorts a server's refusal with SQLSTATE `code`, its error's context
/// (the `where` field), and the schema it names (for the tokio-postgres
/// and the sqlx forms alike): see [`Refusal`].
pub(crate) fn refusal(code: &str, context: Option<&str>, schema: Option<&str>) -> Refusal {
    let class = code.get(..2).unwrap_or(code);
    let passes = matches!(class, "08" | "40" | "53" | "57" | "72")
        || matches!(
            code,
            "55P03" | "55006" | "58000" | "58030" | "25006" | "25P03" | "2200H"
        )
        || (class == "23" && schema == Some("pg_catalog"));
    if passes {
        Refusal::Passes
    } else if class == "23"
        || code == "P0001"
        || (context.is_some_and(in_routine) && !matches!(class, "XX" | "58"))
    {
        Refusal::Added
    } else {
        Refusal::Lasts
    }
}

/// Whether an error's context (its `where` field, a line per frame) says
/// it was raised inside a function (PL/pgSQL, SQL or another language's),
/// as a trigger's is: a line that names a function (in English, or
/// `PL/pgSQL`, which the server's translations keep), other than the
/// anonymous block of a `DO` (the engine's own migration runs one). The
/// other contexts the server gives (a parallel worker, a lock wait's row,
/// a foreign key's check) name none. Under another `lc_messages` a SQL
/// function's context may be missed: its refusal is then
/// [`Refusal::Lasts`], not transient either.
pub(crate) fn in_routine(context: &str) -> bool {
    context.lines().any(|line| {
        (line.contains("function") || line.contains("PL/pgSQL"))
            && !line.contains("inline_code_block")
    })
}

/// The failure of a server's refusal, sorted by [`refusal`].
fn refused(db: &tokio_postgres::error::DbError, detail: String) -> Fail {
    Fail::refused(refusal(db.code().code(), db.where_(), db.schema()), detail)
}

/// Whether a server error's severity says its session ended (`FATAL`) or
/// the server is restarting (`PANIC`): what was in flight is lost, and a
/// `COMMIT` answered so may have been written first.
fn session_ended(db: &tokio_postgres::error::DbError) -> bool {
    matches!(db.severity(), "FATAL" | "PANIC")
}

/// Whether the server's refusal of a session's settings with SQLSTATE
/// `code` (the URL's `options`, sent at its start or, behind a session
/// pooler, with `set_config`) is one of the connection string: a parameter
/// the server does not know (`42704`), a value it refuses (`22023`), or
/// one only the server's own start may set (`55P02`), or a name it cannot
/// take (`42602`).
fn setting_refused(code: &str) -> bool {
    matches!(code, "42704" | "42602" | "22023" | "55P02")
}

/// Whether a server's (a pooler's) refusal at start-up says it does not
/// take a startup parameter the driver sent (`options`, in which a direct
/// store sends its session settings): PgBouncer's "unsupported startup
/// parameter: options" (1.18; "… in options: NAME" and "unsupported
/// options startup parameter: …" from 1.20), and RDS Proxy's "doesn't
/// support command-line options". Poolers answer in English only.
fn pooler_refused(message: &str) -> bool {
    message.starts_with("unsupported startup parameter")
        || message.starts_with("unsupported options startup parameter")
        || message.contains("support command-line options")
}

/// Refuses a session without the settings a direct store sends in the
/// startup parameter `options` (one round trip, once per connect, not per
/// connection): one whose `row_security`, which those settings set to
/// `off` last, is not `off` as the client set it (`pg_settings.source`
/// is `client` for a startup option, which wins over a role's or a
/// database's setting) had them dropped on the way (a pooler's
/// `ignore_startup_parameters = options`; a role's `row_security = off`
/// or a `SET` left by a pooler's previous client would hide that from the
/// value alone), and its limits would not hold either.
///
/// # Errors
/// [`Error::Misconfigured`] ([`ConfigFault::PoolerMismatch`]); what the
/// read meets, as any statement's.
async fn settings_arrived(client: &Client) -> Result<()> {
    let row = client
        .query_one(
            "SELECT setting, source FROM pg_catalog.pg_settings WHERE name = 'row_security'",
            &[],
        )
        .await
        .map_err(|e| fail(&e).error())?;
    let (value, source): (String, String) =
        row.try_get(0)
            .and_then(|v| Ok((v, row.try_get(1)?)))
            .map_err(|e| storage("reading row_security", e).error())?;
    if value == "off" && source == "client" {
        return Ok(());
    }
    Err(Error::Misconfigured {
        fault: ConfigFault::PoolerMismatch,
        detail: format!(
            "the session's settings, sent in the startup parameter `options`, did not arrive \
             (row_security is {value:?} from {source:?}, where they set it off as the \
             client): a pooler between dropped them \
             (PgBouncer's ignore_startup_parameters = options), and the store's limits would \
             not hold; set Config::postgres_pooler(PostgresPooler::Session), which sets them \
             after connecting, and point the URL at a session-mode entry (a migration and the \
             idemstore commands: give them the server's own address)"
        ),
    })
}

/// Whether `err` is the server's refusal of a statement that a row-level
/// security policy would filter, under the engine's `row_security = off`
/// ([`row_security_refusal`]).
fn row_security_refused(err: &tokio_postgres::Error) -> bool {
    err.as_db_error()
        .is_some_and(|db| row_security_refusal(db.code().code(), db.message()))
}

/// Whether a server's refusal (SQLSTATE `code`, `message`) is of a
/// statement that a row-level security policy would filter, under
/// `row_security = off` (the engine's sessions set it; a caller of
/// `complete_in` may): 42501 with these words (a missing privilege is 42501
/// too). For the tokio-postgres and the sqlx forms alike.
pub(crate) fn row_security_refusal(code: &str, message: &str) -> bool {
    code == "42501" && message.starts_with("query would be affected by row-level security policy")
}

/// `detail` of a [`row_security_refusal`], with what mends it.
pub(crate) fn row_security_remedy(detail: &str) -> String {
    format!(
        "{detail}: row-level security was made active for the session's role on the store's \
         tables outside idemstore; turn it off (ALTER TABLE … DISABLE ROW LEVEL SECURITY, NO \
         FORCE ROW LEVEL SECURITY) or give the role BYPASSRLS"
    )
}

/// Whether `err` is tokio-postgres's refusal to connect because the
/// server asked for a password the connection string does not hold (its
/// configuration error "password missing"; `PGPASSWORD` and `.pgpass` are
/// not read). tokio-postgres gives the kind no accessor: the words are
/// matched.
fn password_missing(err: &tokio_postgres::Error) -> bool {
    err.as_db_error().is_none()
        && err.to_string().starts_with("invalid configuration")
        && err
            .source()
            .is_some_and(|s| s.to_string() == "password missing")
}

/// Whether `e` is a TLS failure that configuration causes: a certificate
/// refused by verification, or no TLS where it is required.
fn tls_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    match e.downcast_ref::<rustls::Error>() {
        Some(
            rustls::Error::InvalidCertificate(_)
            | rustls::Error::NoCertificatesPresented
            | rustls::Error::UnsupportedNameType,
        ) => true,
        Some(_) => false,
        // tokio-postgres's own words when the server answers 'N' to the
        // TLS request under sslmode=require.
        None => e.to_string() == "server does not support TLS",
    }
}

/// Whether `err` says the connection is gone or the server is going away.
fn connection_lost(err: &tokio_postgres::Error) -> bool {
    if err.is_closed() {
        return true;
    }
    if let Some(code) = err.code() {
        let c = code.code();
        // 25P03: the server ended a session idle inside a transaction
        // past its `idle_in_transaction_session_timeout`.
        return c.starts_with("08") || c.starts_with("57P") || c == "53300" || c == "25P03";
    }
    let mut source = err.source();
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// Whether the server refused a write as read-only (SQLSTATE 25006): a
/// standby, or a primary demoted or set read-only since the connection
/// was opened. Nothing was applied; only a new connection can reach a
/// host that takes writes (`target_session_attrs=read-write` is checked
/// when a connection is opened), so the connection is dropped.
fn read_only(err: &tokio_postgres::Error) -> bool {
    err.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION)
}

/// Classifies an error of a statement sent before the commit.
fn fail(err: &tokio_postgres::Error) -> Fail {
    let detail = describe(err);
    if let Some(fault) = config_fault(err) {
        let detail = if row_security_refused(err) {
            row_security_remedy(&detail)
        } else {
            detail
        };
        Fail::Config(fault, detail)
    } else if connection_lost(err) {
        Fail::Lost(detail)
    } else if read_only(err) {
        Fail::ReadOnly(detail)
    } else if err.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED)
        || err.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
        || err.code() == Some(&SqlState::SEQUENCE_GENERATOR_LIMIT_EXCEEDED)
    {
        Fail::Retry(detail)
    } else if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
        Fail::Locked(detail)
    } else if let Some(db) = err.as_db_error() {
        if session_ended(db) {
            Fail::Lost(detail)
        } else {
            refused(db, detail)
        }
    } else {
        Fail::Storage(detail)
    }
}

/// Classifies an error of the `COMMIT` itself.
fn fail_commit(err: &tokio_postgres::Error) -> Fail {
    let detail = describe(err);
    match err.as_db_error() {
        // The server answered the commit with an error (not a shutdown,
        // not the end of its session or a restart, after which the commit
        // may have been written): the transaction was rolled back. A
        // refusal no retry mends (a deferred constraint or trigger added
        // outside idemstore) is a configuration fault or `Rejected`.
        Some(db)
            if !db.code().code().starts_with("57P")
                && !db.code().code().starts_with("08")
                && !session_ended(db) =>
        {
            match config_fault(err) {
                Some(fault) => Fail::Config(fault, detail),
                None => refused(db, detail),
            }
        }
        _ => Fail::Unknown(detail),
    }
}

/// An error with its server detail, for a person.
fn describe(err: &tokio_postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => format!("{} ({}): {}", db.severity(), db.code().code(), db.message()),
        None => match err.source() {
            Some(s) => format!("{err}: {s}"),
            None => err.to_string(),
        },
    }
}

fn storage(what: &str, err: impl std::fmt::Display + std::any::Any) -> Fail {
    let detail = format!("{what}: {err}");
    // A value of another type than the store's columns hold: a column
    // altered outside idemstore.
    match (&err as &dyn std::any::Any).downcast_ref::<tokio_postgres::Error>() {
        Some(e) if config_fault(e) == Some(ConfigFault::SchemaDamaged) => {
            Fail::Config(ConfigFault::SchemaDamaged, detail)
        }
        _ => Fail::Storage(detail),
    }
}

/// The prepared statements of one connection.
struct Stmts {
    lock_records: Statement,
    read_records: Statement,
    lock_expired_holders: Statement,
    lock_bindings: Statement,
    clock: Statement,
    draw_tokens: Statement,
    draw_estimate: Statement,
    insert_records: Statement,
    insert_records_strict: Statement,
    update_records: Statement,
    delete_records: Statement,
    insert_bindings: Statement,
    update_bindings: Statement,
    delete_bindings: Statement,
    due_records: Statement,
    next_token: Statement,
    raise_tokens: Statement,
    count: Statement,
    xact_lock: Statement,
    xact_lock_shared: Statement,
    hot_claim: Statement,
    hot_finish: Statement,
}

/// One connection and its statements.
struct Conn {
    /// The client half of the connection.
    client: Client,
    /// Whether the `COMMIT` of the transaction under way was sent: a call
    /// whose deadline passes after that has an unknown outcome.
    commit_sent: AtomicBool,
    /// Its prepared statements.
    st: Stmts,
}

/// Opens a connection (its driver spawned on the current runtime), with
/// TLS as `sslmode` asks, within `connect_timeout` for each address
/// [`connect_attempts`] counts: `tokio-postgres`'s own `connect_timeout`
/// bounds each TCP connect only, so a server (or a middlebox) that accepts
/// the connection and then says nothing would hold the call until its
/// deadline. (Such a server uses up the whole bound, so addresses after
/// it are not tried, where libpq would move on to the next.)
async fn open_client(shared: &Shared) -> Result<Client, Fail> {
    let client = open_bare(shared).await?;
    apply_session_settings(shared, &client).await?;
    Ok(client)
}

/// [`open_client`] without the session settings.
async fn open_bare(shared: &Shared) -> Result<Client, Fail> {
    let per_attempt = shared
        .config
        .get_connect_timeout()
        .copied()
        .unwrap_or(PostgresLimits::default().connect_timeout);
    let attempts = connect_attempts(&shared.config, per_attempt).await;
    let bound = per_attempt.checked_mul(attempts).unwrap_or(Duration::MAX);
    tokio::time::timeout(bound, connect_client(shared))
        .await
        .unwrap_or_else(|_| {
            Err(Fail::Lost(format!(
                "no connection within connect_timeout ({} ms for each of {attempts} \
                 address(es)): no server answered, or one accepted the connection and did not \
                 finish its start-up",
                per_attempt.as_millis()
            )))
        })
}

/// How many addresses `tokio-postgres` may try in turn, each within
/// `connect_timeout` as libpq's: one per `hostaddr` and per Unix socket,
/// and one per address a host name resolves to (resolved here as well,
/// within `per_attempt`; one when it does not resolve).
async fn connect_attempts(config: &tokio_postgres::Config, per_attempt: Duration) -> u32 {
    use tokio_postgres::config::Host;
    let (hosts, addrs, ports) = (
        config.get_hosts(),
        config.get_hostaddrs(),
        config.get_ports(),
    );
    let mut attempts: u32 = 0;
    for i in 0..hosts.len().max(addrs.len()).max(1) {
        let count = match (addrs.get(i), hosts.get(i)) {
            (None, Some(Host::Tcp(name))) => {
                let port = ports
                    .get(i)
                    .or_else(|| ports.first())
                    .copied()
                    .unwrap_or(5432);
                let lookup = tokio::net::lookup_host((name.as_str(), port));
                match tokio::time::timeout(per_attempt, lookup).await {
                    Ok(Ok(found)) => found.count().max(1),
                    _ => 1,
                }
            }
            _ => 1,
        };
        attempts = attempts.saturating_add(u32::try_from(count).unwrap_or(u32::MAX));
    }
    attempts.max(1)
}

/// [`open_client`] without its bound.
async fn connect_client(shared: &Shared) -> Result<Client, Fail> {
    let classify = |e: tokio_postgres::Error| {
        // A start-up message the driver cannot encode (a NUL byte in a
        // setting) fails the same way at every try.
        let unsendable = e.as_db_error().is_none()
            && e.to_string()
                .starts_with("error encoding message to server");
        if unsendable {
            Fail::Config(ConfigFault::ConnectionString, describe(&e))
        } else if e
            .as_db_error()
            .is_some_and(|db| pooler_refused(db.message()))
        {
            // A pooler: every connection is refused the same way.
            let remedy = if shared.session_set.is_some() {
                "a store set for a pooler sends no startup parameter `options` of its own, so \
                 the pooler refused the URL's (or another parameter, as its words say): remove \
                 them from the URL, or add `options` to the pooler's \
                 ignore_startup_parameters (with PostgresPooler::Session the store sets the \
                 URL's settings with set_config after connecting)"
            } else {
                "the store (PostgresPooler::Direct, the default) sends its session settings in \
                 the startup parameter `options`, which a pooler such as PgBouncer refuses: set \
                 Config::postgres_pooler(PostgresPooler::Session) and point the URL at a \
                 session-mode entry (docs/operations.md, \"Behind PgBouncer\"); a migration \
                 (`idemstore migrate`, `idemstore::postgres::migrate`) and the idemstore \
                 commands: give them the server's own address"
            };
            Fail::Config(
                ConfigFault::PoolerMismatch,
                format!("{}: {remedy}", describe(&e)),
            )
        } else if let Some(fault) = config_fault(&e) {
            Fail::Config(fault, describe(&e))
        } else if let Some(db) = e.as_db_error().filter(|_| !connection_lost(&e)) {
            if setting_refused(db.code().code()) {
                Fail::Config(ConfigFault::ConnectionString, describe(&e))
            } else {
                refused(db, describe(&e))
            }
        } else {
            Fail::Lost(describe(&e))
        }
    };
    let done = |err: Option<tokio_postgres::Error>| {
        if let Some(err) = err {
            tracing::debug!(error = %err, "idemstore: postgres connection ended");
        }
    };
    let client = match &shared.tls {
        None => {
            let (client, connection) = shared.config.connect(NoTls).await.map_err(classify)?;
            tokio::spawn(async move { done(connection.await.err()) });
            client
        }
        Some(tls) => {
            let (client, connection) =
                shared.config.connect(tls.clone()).await.map_err(classify)?;
            tokio::spawn(async move { done(connection.await.err()) });
            client
        }
    };
    Ok(client)
}

/// Behind a pooler: sends the session settings that `options` carries
/// otherwise (see `Postgres::connect`).
async fn apply_session_settings(shared: &Shared, client: &Client) -> Result<(), Fail> {
    if let Some(set) = &shared.session_set {
        client
            .batch_execute(set)
            .await
            .map_err(|e| match e.code() {
                Some(code) if setting_refused(code.code()) => {
                    Fail::Config(ConfigFault::ConnectionString, describe(&e))
                }
                _ => fail(&e),
            })?;
    }
    Ok(())
}

/// Opens a connection and prepares every statement (pipelined).
async fn open_conn(shared: &Shared) -> Result<Conn, Fail> {
    let client = open_client(shared).await?;
    let q = &shared.sql;
    let c = &client;
    // A statement of the store's that cannot be prepared (met again: an
    // operator missing for a column's new type, 42883, say) is the
    // schema's fault; the server's own (classes XX and 58, a catalog page
    // corrupted) stays its own.
    let p = |sql: &str| {
        let sql = sql.to_string();
        async move {
            c.prepare(&sql).await.map_err(|e| {
                let own = e
                    .code()
                    .is_some_and(|c| c.code().starts_with("XX") || c.code().starts_with("58"));
                match fail(&e) {
                    Fail::Rejected(detail, _) if !own => {
                        Fail::Config(ConfigFault::SchemaDamaged, detail)
                    }
                    other => other,
                }
            })
        }
    };
    let (a, b, cc, d, e, f, g, h) = tokio::try_join!(
        p(&q.lock_records),
        p(&q.read_records),
        p(&q.lock_bindings),
        p(&q.clock),
        p(&q.draw_tokens),
        p(&q.insert_records),
        p(&q.update_records),
        p(&q.delete_records),
    )?;
    let (i, j, k, l, m, n, o, r, s) = tokio::try_join!(
        p(&q.insert_bindings),
        p(&q.update_bindings),
        p(&q.delete_bindings),
        p(&q.due_records),
        p(&q.next_token),
        p(&q.raise_tokens),
        p(&q.count),
        p("SELECT pg_advisory_xact_lock($1::bigint)"),
        p("SELECT pg_advisory_xact_lock_shared($1::bigint)"),
    )?;
    let (draw_estimate, insert_records_strict, hot_claim, hot_finish, lock_expired_holders) = tokio::try_join!(
        p(&q.draw_estimate),
        p(&q.insert_records_strict),
        p(&q.hot_claim),
        p(&q.hot_finish),
        p(&q.lock_expired_holders)
    )?;
    let st = Stmts {
        lock_records: a,
        read_records: b,
        lock_expired_holders,
        lock_bindings: cc,
        clock: d,
        draw_tokens: e,
        insert_records: f,
        insert_records_strict,
        update_records: g,
        delete_records: h,
        insert_bindings: i,
        update_bindings: j,
        delete_bindings: k,
        due_records: l,
        next_token: m,
        raise_tokens: n,
        count: o,
        xact_lock: r,
        xact_lock_shared: s,
        draw_estimate,
        hot_claim,
        hot_finish,
    };
    Ok(Conn {
        client,
        commit_sent: AtomicBool::new(false),
        st,
    })
}

/// What connecting found the schema to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// At this build's version: no DDL was sent.
    Current,
    /// Created (or completed) by this connection's DDL.
    Created,
    /// Found at the older version `from` and brought to this build's.
    Upgraded {
        /// The version found.
        from: u32,
    },
}

/// Checks the schema's version with one read and no DDL; when it is not
/// current (absent, or `migrate` asked for), creates or checks it under
/// the DDL advisory lock. Returns the store's identity.
async fn setup(shared: &Shared) -> Result<(u128, Found)> {
    let client = open_bare(shared).await.map_err(|f| f.error())?;
    // The probe runs before the settings are sent, so that a
    // transaction-mode pool it refuses keeps none of them.
    if shared.session_set.is_some() {
        refuse_shared_sessions(shared, &client).await?;
    }
    apply_session_settings(shared, &client)
        .await
        .map_err(|f| f.error())?;
    // A migration too: its DDL waits for the tables' locks under the same
    // `lock_timeout` (without it, a `CREATE INDEX` behind an open write
    // would hold up every write of the service).
    if shared.session_set.is_none() {
        settings_arrived(&client).await?;
    }
    // A first reading of the store's time, so that what is answered while
    // the server cannot be reached (`Postgres::last_now_ms`) is the time
    // of the connect at least, never 0.
    let rows = match shared.clock {
        Some(_) => None,
        None => Some(
            client
                .query(shared.sql.clock.as_str(), &[])
                .await
                .map_err(|e| fail(&e).error())?,
        ),
    };
    time_from(shared, rows.as_deref()).map_err(|f| f.error())?;
    // Before the schema is read: a policy may hide its version row, which
    // would make a store look absent (and a migration call it damaged).
    let secured = row_secured_tables(&shared.sql.schema, &client)
        .await
        .map_err(|e| fail(&e).error())?;
    if !secured.is_empty() {
        return Err(Error::Misconfigured {
            fault: ConfigFault::SchemaDamaged,
            detail: format!(
                "schema {}: {}",
                shared.sql.schema,
                row_secured_remedy(&shared.sql.schema, &secured)
            ),
        });
    }
    if !shared.migrate {
        match read_current(shared, &client).await? {
            Current::Store(id) => {
                check_objects(shared, &client).await?;
                return Ok((id, Found::Current));
            }
            // Upgraded only by `migrate`: replicas of the older build may
            // still be running, and would read this build's rows as
            // corrupt (docs/operations.md, "Schema changes apart from the
            // service").
            Current::Older(version) => {
                let schema = &shared.sql.schema;
                return Err(Error::Misconfigured {
                    fault: ConfigFault::SchemaNotMigrated,
                    detail: format!(
                        "schema {schema} holds a store at schema version {version}, written \
                         by an older idemstore; this build reads and writes version \
                         {SCHEMA_VERSION}, which builds of version {version} read as corrupt: \
                         stop the replicas of the older build, then run `idemstore migrate \
                         URL --schema {schema}` (or idemstore::postgres::migrate)"
                    ),
                });
            }
            Current::Absent if shared.must_exist => {
                return Err(Error::Missing {
                    path: std::path::PathBuf::new(),
                });
            }
            Current::Absent => {}
        }
    }
    match create_or_check(shared, &client).await {
        // Connecting (not migrating) found no store at this version and
        // may not create one: the schema must be migrated first.
        Err(Error::Misconfigured {
            fault: ConfigFault::PermissionDenied,
            detail,
        }) if !shared.migrate => Err(Error::Misconfigured {
            fault: ConfigFault::SchemaNotMigrated,
            detail: format!(
                "schema {} holds no store at version {SCHEMA_VERSION} and this role may not \
                 create it ({detail}): run `idemstore migrate URL --schema {}` (or \
                 idemstore::postgres::migrate) with a role that may",
                shared.sql.schema, shared.sql.schema
            ),
        }),
        other => other,
    }
}

/// What [`read_current`] found in a schema.
enum Current {
    /// A store at this build's version, with its identity.
    Store(u128),
    /// No store: no schema, meta table or version row.
    Absent,
    /// A store at this older schema version.
    Older(u32),
}

/// The store's identity when the schema is at this build's version, with
/// one read and no lock, or what else the schema holds.
///
/// # Errors
/// [`Error::Misconfigured`] for a newer version or a missing privilege,
/// [`Error::IncompatibleSchema`] for malformed meta rows, and the errors of
/// the connection.
async fn read_current(shared: &Shared, client: &Client) -> Result<Current> {
    let sql = &shared.sql;
    let rows = match client.query(&sql.read_meta_all(), &[]).await {
        Ok(rows) => rows,
        Err(e)
            if e.code() == Some(&SqlState::UNDEFINED_TABLE)
                || e.code() == Some(&SqlState::INVALID_SCHEMA_NAME) =>
        {
            return Ok(Current::Absent);
        }
        Err(e) => return Err(fail(&e).error()),
    };
    let incompatible = |detail: String| Error::IncompatibleSchema {
        schema: sql.schema.clone(),
        detail,
    };
    let mut version = None;
    let mut id = None;
    for row in &rows {
        let name: String = row.try_get(0).map_err(|e| fail(&e).error())?;
        let value: Vec<u8> = row.try_get(1).map_err(|e| fail(&e).error())?;
        match name.as_str() {
            "version" => version = Some(value),
            "store_id" => id = Some(value),
            _ => {}
        }
    }
    let Some(v) = version else {
        return Ok(Current::Absent);
    };
    let version = meta_version(&sql.schema, &v)?;
    if version < SCHEMA_VERSION {
        return Ok(Current::Older(version));
    }
    let id = id.ok_or_else(|| incompatible("the store_id row is missing".into()))?;
    Ok(Current::Store(meta_store_id(&sql.schema, &id)?))
}

/// The relations every store's schema holds beside its meta table.
const OBJECTS: [&str; 3] = ["records", "bindings", "tokens"];

/// Which of [`OBJECTS`] the schema holds (one catalog read).
async fn present_objects(shared: &Shared, client: &Client) -> Result<Vec<String>> {
    let rows = client
        .query(
            "SELECT c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = ANY($2)",
            &[&shared.sql.schema, &OBJECTS.as_slice()],
        )
        .await
        .map_err(|e| fail(&e).error())?;
    let mut present = Vec::with_capacity(rows.len());
    for row in &rows {
        present.push(row.try_get(0).map_err(|e| fail(&e).error())?);
    }
    Ok(present)
}

/// Behind a pooler (`PostgresPooler::Session`): refuses a pool that hands
/// one client's server session to another between transactions
/// (PgBouncer's transaction or statement pooling). There the engine's
/// named prepared statements, which the driver names `s0`, `s1`, … in
/// every process alike, would run another client's statement of the same
/// name: another store's schema, or another program's SQL, with this
/// store's parameters. The probe sets a random marker in `client`'s
/// session (autocommit, so a transaction pool then frees that server
/// session) and reads it from a second connection: a session pool never
/// shows one client's session to another, and PgBouncer's transaction
/// pooling hands the server session freed last to the next client (most
/// often; it can miss with `server_round_robin` or many idle sessions).
/// Both connections are probed before the store's session settings are
/// sent, and with simple queries (no prepared statement), so a pool it
/// refuses keeps nothing of the store but the random marker. Costs one
/// more connection (a second server session at once, which a full
/// session pool makes wait until `call_timeout`) and two round trips at
/// connect.
///
/// # Errors
/// [`Error::Misconfigured`] with [`ConfigFault::TransactionPooling`] when
/// the second connection reads the marker; the errors of connecting.
async fn refuse_shared_sessions(shared: &Shared, client: &Client) -> Result<()> {
    let marker = format!("{:032x}", rand::random::<u128>());
    client
        .batch_execute(&format!("SET idemstore.session_probe = '{marker}'"))
        .await
        .map_err(|e| fail(&e).error())?;
    let other = open_bare(shared).await.map_err(|f| f.error())?;
    let answer = other
        .simple_query("SELECT current_setting('idemstore.session_probe', true)")
        .await
        .map_err(|e| fail(&e).error())?;
    let seen = answer.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
        _ => None,
    });
    if seen.as_deref() == Some(marker.as_str()) {
        return Err(Error::Misconfigured {
            fault: ConfigFault::TransactionPooling,
            detail: "the pooler gave this connection's server session to another connection \
                     between two transactions (PgBouncer's transaction or statement pooling): \
                     the engine's prepared statements would run other clients' statements \
                     there; point the store at an entry in session mode (pool_mode = session)"
                .into(),
        });
    }
    Ok(())
}

/// The columns of the store's tables and their types, as the DDL
/// ([`schema::Sql::create`]) makes them.
const COLUMNS: [(&str, &str, &str); 9] = [
    ("records", "key", "bytea"),
    ("records", "record", "bytea"),
    ("records", "token", "bigint"),
    ("records", "state", "smallint"),
    ("records", "created_ms", "bigint"),
    ("records", "lease_until_ms", "bigint"),
    ("records", "expires_ms", "bigint"),
    ("bindings", "binding", "bytea"),
    ("bindings", "key", "bytea"),
];

/// The store's columns that are missing, of another type than [`COLUMNS`]
/// gives, or that allow NULL (every column of the DDL is `NOT NULL`), as
/// `table.column …` (one catalog read).
async fn altered_columns(shared: &Shared, client: &Client) -> Result<Vec<String>> {
    let rows = client
        .query(
            "SELECT c.relname::text, a.attname::text, format_type(a.atttypid, a.atttypmod), \
             a.attnotnull FROM pg_catalog.pg_attribute a \
             JOIN pg_catalog.pg_class c ON c.oid = a.attrelid \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname IN ('records', 'bindings') \
             AND a.attnum > 0 AND NOT a.attisdropped",
            &[&shared.sql.schema],
        )
        .await
        .map_err(|e| fail(&e).error())?;
    let mut found = Vec::with_capacity(rows.len());
    for row in &rows {
        let get = |i: usize| row.try_get::<_, String>(i).map_err(|e| fail(&e).error());
        let not_null = row.try_get::<_, bool>(3).map_err(|e| fail(&e).error())?;
        found.push((get(0)?, get(1)?, get(2)?, not_null));
    }
    Ok(COLUMNS
        .iter()
        .filter_map(|&(table, column, ty)| {
            match found.iter().find(|(t, c, _, _)| t == table && c == column) {
                Some((_, _, found_ty, _)) if found_ty != ty => {
                    Some(format!("{table}.{column} is {found_ty}, not {ty}"))
                }
                Some((_, _, _, false)) => Some(format!("{table}.{column} allows NULL")),
                Some(_) => None,
                None => Some(format!("{table}.{column} is missing")),
            }
        })
        .collect())
}

/// The columns whose values the store's correctness needs unique, with
/// the table that holds each: a key is claimed by inserting its row, and
/// only a unique index makes the second of two concurrent inserts fail (a
/// batch's `INSERT` that carries the `COMMIT` has no `ON CONFLICT`).
const UNIQUE_COLUMNS: [(&str, &str); 2] = [("records", "key"), ("bindings", "binding")];

/// Of [`UNIQUE_COLUMNS`], those with no valid, immediate, unique index on
/// that column alone (the `PRIMARY KEY` of the DDL, dropped outside
/// idemstore), as `table.column` (one catalog read). On such a table two
/// replicas claiming one key at once would both insert it, and both run
/// its work.
async fn unkeyed_columns(
    schema: &str,
    client: &impl tokio_postgres::GenericClient,
) -> std::result::Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT c.relname::text, a.attname::text FROM pg_catalog.pg_index i \
             JOIN pg_catalog.pg_class c ON c.oid = i.indrelid \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum = i.indkey[0] \
             WHERE n.nspname = $1 AND i.indisunique AND i.indisvalid AND i.indimmediate \
             AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL",
            &[&schema],
        )
        .await?;
    let mut keyed = Vec::with_capacity(rows.len());
    for row in &rows {
        keyed.push((row.try_get::<_, String>(0)?, row.try_get::<_, String>(1)?));
    }
    Ok(UNIQUE_COLUMNS
        .iter()
        .filter(|&&(table, column)| !keyed.iter().any(|(t, c)| t == table && c == column))
        .map(|(table, column)| format!("{table}.{column}"))
        .collect())
}

/// What a schema whose `unkeyed` columns ([`unkeyed_columns`]) lost their
/// unique index needs, for a message: the rows to look at, and the
/// statements that restore the indexes.
fn unkeyed_remedy(schema: &str, unkeyed: &[String]) -> String {
    let restore: Vec<String> = unkeyed
        .iter()
        .filter_map(|tc| tc.split_once('.'))
        .map(|(table, column)| {
            let twice = if table == "records" {
                "keys held by two rows: their work may have run twice; keep the row to replay \
                 and delete the other"
            } else {
                "business keys bound twice: keep the binding that names the record carrying \
                 it and delete the other"
            };
            format!(
                "SELECT {column} FROM \"{schema}\".{table} GROUP BY {column} HAVING count(*) > \
                 1 ({twice}), then ALTER TABLE \"{schema}\".{table} ADD PRIMARY KEY ({column})"
            )
        })
        .collect();
    format!(
        "{} lost its unique index outside idemstore (or a restore has not yet reached its \
         indexes: let pg_restore finish), and with it the guarantee that two claims of one key \
         cannot both acquire it; the store refuses to run on it until it is restored: {}",
        unkeyed.join(" and "),
        restore.join("; ")
    )
}

/// Of the store's tables, those on which row-level security is active
/// for the session's role (`row_security_active`: enabled on the table, and
/// the role neither a superuser nor `BYPASSRLS`, nor its owner unless the
/// table forces it), by name (one catalog read). A policy that hides a row
/// from the store makes a key or a business key another record holds
/// look free: a claim acquires it, and its work runs twice.
async fn row_secured_tables(
    schema: &str,
    client: &Client,
) -> std::result::Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname IN ('records', 'bindings', 'meta') \
             AND c.relkind IN ('r', 'p') AND pg_catalog.row_security_active(c.oid) \
             ORDER BY c.relname",
            &[&schema],
        )
        .await?;
    rows.iter().map(|row| row.try_get::<_, String>(0)).collect()
}

/// What a schema whose `tables` have row-level security active for the
/// store's role ([`row_secured_tables`]) needs, for a message.
fn row_secured_remedy(schema: &str, tables: &[String]) -> String {
    let disable = row_security_disabled(schema, tables);
    format!(
        "{} {} row-level security active for this role (enabled outside idemstore): a policy \
         that hides a row from the store makes a key or business key that another record holds \
         look free, and a claim would then acquire it and run its work twice; the store \
         refuses to run on it until it is off: {} (or give the role BYPASSRLS)",
        tables.join(" and "),
        if tables.len() == 1 { "has" } else { "have" },
        disable
    )
}

/// The statements that turn row-level security off on the store's
/// `tables` of `schema`, `; `-separated, for a message.
fn row_security_disabled(schema: &str, tables: &[String]) -> String {
    let disable: Vec<String> = tables
        .iter()
        .map(|table| {
            format!(
                "ALTER TABLE \"{schema}\".{table} DISABLE ROW LEVEL SECURITY, NO FORCE ROW LEVEL \
                 SECURITY"
            )
        })
        .collect();
    disable.join("; ")
}

/// Of the relations named as [`OBJECTS`] that the schema holds, those not
/// of a store's form, described for a message: `records` or `bindings`
/// that is not a table with the columns [`COLUMNS`] gives (another
/// program's table of that name), `tokens` that is not a sequence (two
/// catalog reads).
async fn foreign_objects(shared: &Shared, client: &Client) -> Result<Vec<String>> {
    let rows = client
        .query(
            "SELECT c.relname::text, c.relkind::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = ANY($2) ORDER BY c.relname",
            &[&shared.sql.schema, &OBJECTS.as_slice()],
        )
        .await
        .map_err(|e| fail(&e).error())?;
    let altered = altered_columns(shared, client).await?;
    let mut foreign = Vec::new();
    for row in &rows {
        let get = |i: usize| row.try_get::<_, String>(i).map_err(|e| fail(&e).error());
        let (name, kind) = (get(0)?, get(1)?);
        let what = match (name.as_str(), kind.as_str()) {
            ("tokens", "S") => continue,
            ("tokens", _) => "not a sequence",
            (_, "r" | "p") => {
                let prefix = format!("{name}.");
                if !altered.iter().any(|a| a.starts_with(&prefix)) {
                    continue;
                }
                "a table of other columns"
            }
            _ => "not a table",
        };
        foreign.push(format!("{name} ({what})"));
    }
    Ok(foreign)
}

/// Checks that a schema whose version row says it holds a store still has
/// every object of one, with the columns its statements read and write
/// (two catalog reads).
///
/// # Errors
/// [`Error::Misconfigured`] with [`ConfigFault::SchemaDamaged`] naming the
/// missing objects, and the errors of the connection.
async fn check_objects(shared: &Shared, client: &Client) -> Result<()> {
    let present = present_objects(shared, client).await?;
    let missing: Vec<&str> = OBJECTS
        .iter()
        .copied()
        .filter(|o| !present.iter().any(|p| p == o))
        .collect();
    let schema = &shared.sql.schema;
    if missing.is_empty() {
        let altered = altered_columns(shared, client).await?;
        if altered.is_empty() {
            let unkeyed = unkeyed_columns(schema, client)
                .await
                .map_err(|e| fail(&e).error())?;
            if unkeyed.is_empty() {
                return Ok(());
            }
            return Err(Error::Misconfigured {
                fault: ConfigFault::SchemaDamaged,
                detail: format!(
                    "schema {schema} holds a store whose {}",
                    unkeyed_remedy(schema, &unkeyed)
                ),
            });
        }
        return Err(Error::Misconfigured {
            fault: ConfigFault::SchemaDamaged,
            detail: format!(
                "schema {schema} holds a store whose columns were altered outside idemstore \
                 ({}); restore the schema from a backup or an export (idemstore import), or \
                 drop schema {schema} to start an empty store",
                altered.join(", ")
            ),
        });
    }
    Err(Error::Misconfigured {
        fault: ConfigFault::SchemaDamaged,
        detail: format!(
            "schema {schema} holds a store (its version row is present) but not its {}: \
             dropped outside idemstore, with the records it held; restore the schema from a \
             backup or an export (idemstore import), or drop schema {schema} to start an \
             empty store",
            missing.join(", ")
        ),
    })
}

/// The schema version a meta row holds.
///
/// # Errors
/// [`Error::IncompatibleSchema`] for a row that is not 4 bytes, and
/// [`Error::Misconfigured`] for a version above this build's.
fn meta_version(schema: &str, value: &[u8]) -> Result<u32> {
    let bytes: [u8; 4] = value.try_into().map_err(|_| Error::IncompatibleSchema {
        schema: schema.to_string(),
        detail: format!("version row holds {} bytes", value.len()),
    })?;
    let version = u32::from_be_bytes(bytes);
    if version > SCHEMA_VERSION {
        return Err(too_new(schema, version));
    }
    Ok(version)
}

/// The store's identity a meta row holds.
///
/// # Errors
/// [`Error::IncompatibleSchema`] for a row that is not 16 bytes.
fn meta_store_id(schema: &str, value: &[u8]) -> Result<u128> {
    let bytes: [u8; 16] = value.try_into().map_err(|_| Error::IncompatibleSchema {
        schema: schema.to_string(),
        detail: format!("store_id row holds {} bytes", value.len()),
    })?;
    Ok(u128::from_be_bytes(bytes))
}

/// The error for a schema at `version`, above this build's.
fn too_new(schema: &str, version: u32) -> Error {
    Error::Misconfigured {
        fault: ConfigFault::SchemaTooNew,
        detail: format!(
            "schema {schema} is at version {version}, written by a newer idemstore \
             (this build reads version {SCHEMA_VERSION})"
        ),
    }
}

/// Creates the schema's objects (idempotent) or checks them under the
/// DDL advisory lock, and returns the store's identity.
async fn create_or_check(shared: &Shared, client: &Client) -> Result<(u128, Found)> {
    let sql = &shared.sql;
    let pg = |e: tokio_postgres::Error| fail(&e).error();
    client
        .batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .map_err(pg)?;
    client
        .query("SELECT pg_advisory_xact_lock($1::bigint)", &[&sql.ddl_lock])
        .await
        .map_err(pg)?;
    // A store exists where its schema has a meta table with a version row;
    // the transaction is rolled back (the client dropped) if it has none.
    // `Store::connect_existing` names the store in the error.
    let missing = || Error::Missing {
        path: std::path::PathBuf::new(),
    };
    if shared.must_exist {
        let rows = client
            .query(
                "SELECT 1 FROM pg_catalog.pg_class c \
                 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = 'meta'",
                &[&sql.schema],
            )
            .await
            .map_err(pg)?;
        if rows.is_empty() {
            return Err(missing());
        }
    }
    client.batch_execute(&sql.create_meta()).await.map_err(pg)?;
    let incompatible = |detail: String| Error::IncompatibleSchema {
        schema: sql.schema.clone(),
        detail,
    };
    let read = |name: &'static str| {
        let client = &client;
        async move {
            let rows = client.query(&sql.read_meta(), &[&name]).await.map_err(pg)?;
            match rows.first() {
                Some(row) => row.try_get::<_, Vec<u8>>(0).map(Some).map_err(pg),
                None => Ok(None),
            }
        }
    };
    let found = match read("version").await? {
        Some(v) => {
            let version = meta_version(&sql.schema, &v)?;
            if version == 0 {
                return Err(incompatible("schema version 0".into()));
            }
            // The version row is written in the transaction that creates
            // the objects: one missing now was dropped, with the records
            // it held, and creating it empty would forget them.
            check_objects(shared, client).await?;
            // Idempotent: an older schema has every object already; from
            // version 1 to 2 only the version row changes.
            client.batch_execute(&sql.create()).await.map_err(pg)?;
            if version < SCHEMA_VERSION {
                let current = SCHEMA_VERSION.to_be_bytes().to_vec();
                client
                    .execute(&sql.write_version(), &[&current])
                    .await
                    .map_err(pg)?;
                Found::Upgraded { from: version }
            } else {
                Found::Current
            }
        }
        None if shared.must_exist => return Err(missing()),
        None => {
            // The objects are created in the transaction that writes the
            // version row: found without it, the meta table (or its rows)
            // was dropped, and a new store over the old rows would take
            // them with a new identity.
            let present = present_objects(shared, client).await?;
            if !present.is_empty() {
                let schema = &sql.schema;
                // Another program's relations under the names a store
                // uses are not a store's: nothing of them is the store's
                // to restore or drop. One of them in a store's form beside
                // them says a store was there (damaged twice over: its
                // version row lost and a column altered): restore it.
                let foreign = foreign_objects(shared, client).await?;
                if !foreign.is_empty() && foreign.len() == present.len() {
                    return Err(incompatible(format!(
                        "it holds no store (no version row) but relations of another \
                         program under a store's names: {}; nothing was changed: choose \
                         another schema for the store (`--schema`, `Config::postgres_schema`)",
                        foreign.join(", ")
                    )));
                }
                return Err(Error::Misconfigured {
                    fault: ConfigFault::SchemaDamaged,
                    detail: format!(
                        "schema {schema} holds a store's {} but no version row: its meta \
                         table or rows were dropped outside idemstore; restore the schema \
                         from a backup, or drop schema {schema} to start an empty store",
                        present.join(", ")
                    ),
                });
            }
            client.batch_execute(&sql.create()).await.map_err(pg)?;
            let id: u128 = rand::random();
            let version = SCHEMA_VERSION.to_be_bytes().to_vec();
            let id_bytes = id.to_be_bytes().to_vec();
            client
                .execute(&sql.write_meta(), &[&"version", &version])
                .await
                .map_err(pg)?;
            client
                .execute(&sql.write_meta(), &[&"store_id", &id_bytes])
                .await
                .map_err(pg)?;
            Found::Created
        }
    };
    let id = read("store_id")
        .await?
        .ok_or_else(|| incompatible("the store_id row is missing".into()))?;
    let id = meta_store_id(&sql.schema, &id)?;
    client
        .batch_execute("COMMIT")
        .await
        .map_err(|e| fail_commit(&e).error())?;
    Ok((id, found))
}

/// Reads the columns of a records row.
fn row_columns(row: &Row) -> Result<RowColumns, Fail> {
    let get = |e: tokio_postgres::Error| storage("reading a records row", e);
    Ok(RowColumns {
        key: row.try_get(0).map_err(get)?,
        record: row.try_get(1).map_err(get)?,
        token: row.try_get(2).map_err(get)?,
        state: row.try_get(3).map_err(get)?,
        created_ms: row.try_get(4).map_err(get)?,
        lease_until_ms: row.try_get(5).map_err(get)?,
        expires_ms: row.try_get(6).map_err(get)?,
    })
}

/// Converts a non-negative `bigint` from the server.
fn to_u64(what: &str, v: i64) -> Result<u64, Fail> {
    u64::try_from(v).map_err(|_| Fail::Storage(format!("{what} is negative: {v}")))
}

/// Converts a count or time for a `bigint` parameter.
fn to_i64(what: &str, v: u64) -> Result<i64, Fail> {
    i64::try_from(v).map_err(|_| Fail::Storage(format!("{what} {v} does not fit a bigint")))
}

/// The store's time from the clock query's rows (`None`: the test clock).
fn time_from(shared: &Shared, rows: Option<&[Row]>) -> Result<u64, Fail> {
    let reading = match (&shared.clock, rows) {
        (Some(clock), _) => clock.now_ms(),
        (None, Some(rows)) => {
            let ms: i64 = rows
                .first()
                .ok_or_else(|| Fail::Storage("the clock query returned no row".into()))?
                .try_get(0)
                .map_err(|e| storage("reading the clock", e))?;
            to_u64("the database clock", ms)?
        }
        (None, None) => return Err(Fail::Storage("the clock was not read".into())),
    };
    Ok(shared.seen(reading))
}

/// The time of a transaction: the test clock's reading, or the database's
/// (read on `conn`).
async fn read_time(shared: &Shared, conn: &Conn) -> Result<u64, Fail> {
    let rows = match &shared.clock {
        Some(_) => None,
        None => Some(
            conn.client
                .query(&conn.st.clock, &[])
                .await
                .map_err(|e| fail(&e))?,
        ),
    };
    time_from(shared, rows.as_deref())
}

/// Fills `base` with the rows read, locked, for `keys` (sorted, distinct);
/// absent keys are `Absent`.
fn fill_records(keys: &[Vec<u8>], rows: &[Row], base: &mut Base) -> Result<(), Fail> {
    for k in keys {
        base.records.insert(k.clone(), Slot::Absent);
        base.locked.insert(k.clone());
    }
    for row in rows {
        let rc = row_columns(row)?;
        base.records.insert(rc.key.clone(), decide::slot_of(&rc));
    }
    Ok(())
}

/// Locks and reads the rows of `keys` (sorted, distinct) into `base`.
async fn load_records(conn: &Conn, keys: &[Vec<u8>], base: &mut Base) -> Result<(), Fail> {
    let rows = conn
        .client
        .query(&conn.st.lock_records, &[&keys])
        .await
        .map_err(|e| fail(&e))?;
    fill_records(keys, &rows, base)
}

/// Locks and reads the bindings the batch needs, then reads (without
/// locking) the records they name that are not loaded yet. When it locked
/// bindings, returns the store's time read after those locks (in the same
/// flight), since waiting for them may have taken any time.
async fn load_bindings(
    shared: &Shared,
    conn: &Conn,
    ops: &[(Key, Op)],
    base: &mut Base,
) -> Result<Option<u64>, Fail> {
    let needed: Vec<Vec<u8>> = decide::bindings_needed(base, ops)
        .into_iter()
        .filter(|b| !base.bindings.contains_key(b))
        .collect();
    if needed.is_empty() {
        return Ok(None);
    }
    let params: [&(dyn ToSql + Sync); 1] = [&needed];
    let (rows, now) = tokio::join!(
        conn.client.query(&conn.st.lock_bindings, &params),
        read_time(shared, conn)
    );
    let rows = rows.map_err(|e| fail(&e))?;
    let now = now?;
    for b in &needed {
        base.bindings.insert(b.clone(), None);
    }
    for row in &rows {
        let get = |e: tokio_postgres::Error| storage("reading a bindings row", e);
        let b: Vec<u8> = row.try_get(0).map_err(get)?;
        let k: Vec<u8> = row.try_get(1).map_err(get)?;
        base.bindings.insert(b, Some(k));
    }
    let holders: BTreeSet<Vec<u8>> = base
        .bindings
        .values()
        .flatten()
        .filter(|k| !base.records.contains_key(*k))
        .cloned()
        .collect();
    if holders.is_empty() {
        return Ok(Some(now));
    }
    let holders: Vec<Vec<u8>> = holders.into_iter().collect();
    // The holders past retention are locked first, where no other
    // transaction holds them (never waiting: these locks come after the
    // bindings'), so that one whose business key the batch takes can be
    // evicted with it; then every holder is read (pipelined, in that
    // order), the locked ones as they stay until the commit. The order
    // matters: `join!` polls the lock first, and a query on a prepared
    // statement sends its messages at its first poll, so the server runs
    // the lock before the read, whose snapshot then sees the locked rows
    // as they stay (no test can tell a read taken before the lock).
    let at = i64::try_from(now).unwrap_or(i64::MAX);
    let lock_params: [&(dyn ToSql + Sync); 2] = [&holders, &at];
    let read_params: [&(dyn ToSql + Sync); 1] = [&holders];
    let (locked, rows) = tokio::join!(
        conn.client
            .query(&conn.st.lock_expired_holders, &lock_params),
        conn.client.query(&conn.st.read_records, &read_params)
    );
    let locked = locked.map_err(|e| fail(&e))?;
    let rows = rows.map_err(|e| fail(&e))?;
    for row in &locked {
        let k: Vec<u8> = row
            .try_get(0)
            .map_err(|e| storage("reading a locked holder's key", e))?;
        base.locked.insert(k);
    }
    for k in &holders {
        base.records.insert(k.clone(), Slot::Absent);
    }
    for row in &rows {
        let rc = row_columns(row)?;
        base.records.insert(rc.key.clone(), decide::slot_of(&rc));
    }
    Ok(Some(now))
}

/// How many tokens to draw.
enum Draw<'a> {
    /// Exactly this many (fewer near the end of the sequence).
    Exactly(usize),
    /// One per claimed key (distinct key bytes) that an estimate at the
    /// time given (`None`: the database clock) says a claim would acquire.
    Estimate(&'a [Vec<u8>], Option<i64>),
}

/// Draws tokens (ascending; fewer near the end of the sequence, none when
/// it is exhausted) under the shared token lock.
async fn draw_tokens(shared: &Shared, conn: &Conn, draw: Draw<'_>) -> Result<Vec<u64>, Fail> {
    let c = &conn.client;
    let lock = shared.sql.token_lock;
    let lock_params: [&(dyn ToSql + Sync); 1] = [&lock];
    let n;
    let (stmt, draw_params): (&Statement, Vec<&(dyn ToSql + Sync)>) = match &draw {
        Draw::Exactly(count) => {
            n = to_i64("a token count", u64::try_from(*count).unwrap_or(u64::MAX))?;
            (&conn.st.draw_tokens, vec![&n])
        }
        Draw::Estimate(keys, now) => (&conn.st.draw_estimate, vec![keys, now]),
    };
    // One flight: the shared lock, then the draw.
    let lk = c.query(&conn.st.xact_lock_shared, &lock_params);
    let draw = c.query(stmt, &draw_params);
    let (lk, draw) = tokio::join!(lk, draw);
    lk.map_err(|e| fail(&e))?;
    // The draw stops at the end of the sequence; should another process
    // take the last tokens between the bound and the draw, the sequence
    // errs, the transaction is aborted and the batch tried again (it then
    // finds the sequence exhausted).
    let rows = draw.map_err(|e| fail(&e))?;
    let mut tokens = Vec::with_capacity(rows.len());
    for row in &rows {
        let t: i64 = row.try_get(0).map_err(|e| storage("reading a token", e))?;
        tokens.push(to_u64("a drawn token", t)?);
    }
    tokens.sort_unstable();
    Ok(tokens)
}

/// How many rows a write statement returned (0 when it was not sent).
async fn run_write(
    conn: &Conn,
    stmt: &Statement,
    params: &[&(dyn ToSql + Sync)],
    skip: bool,
) -> Result<usize, tokio_postgres::Error> {
    if skip {
        return Ok(0);
    }
    Ok(conn.client.query(stmt, params).await?.len())
}

/// Sends the writes (pipelined); whether every compare-and-set landed.
/// With `strict`, records are inserted by a statement that fails (with
/// [`Fail::Contended`]) instead of skipping a key that is present.
async fn send_writes(conn: &Conn, w: &decide::Writes, strict: bool) -> Result<bool, Fail> {
    let st = &conn.st;
    let col = |f: fn(&decide::Columns) -> i64, v: &[(Vec<u8>, Vec<u8>, decide::Columns)]| {
        v.iter().map(|x| f(&x.2)).collect::<Vec<i64>>()
    };
    let ik: Vec<&[u8]> = w.inserts.iter().map(|x| x.0.as_slice()).collect();
    let ir: Vec<&[u8]> = w.inserts.iter().map(|x| x.1.as_slice()).collect();
    let it = col(|c| c.token, &w.inserts);
    let is: Vec<i16> = w.inserts.iter().map(|x| x.2.state).collect();
    let ic = col(|c| c.created_ms, &w.inserts);
    let il = col(|c| c.lease_until_ms, &w.inserts);
    let ie = col(|c| c.expires_ms, &w.inserts);

    let uk: Vec<&[u8]> = w.updates.iter().map(|x| x.0.as_slice()).collect();
    let ur: Vec<&[u8]> = w.updates.iter().map(|x| x.1.as_slice()).collect();
    let ut: Vec<i64> = w.updates.iter().map(|x| x.2.token).collect();
    let us: Vec<i16> = w.updates.iter().map(|x| x.2.state).collect();
    let uc: Vec<i64> = w.updates.iter().map(|x| x.2.created_ms).collect();
    let ul: Vec<i64> = w.updates.iter().map(|x| x.2.lease_until_ms).collect();
    let ue: Vec<i64> = w.updates.iter().map(|x| x.2.expires_ms).collect();
    let useen: Vec<i64> = w.updates.iter().map(|x| x.3).collect();

    let dk: Vec<&[u8]> = w.deletes.iter().map(|x| x.0.as_slice()).collect();
    let dseen: Vec<i64> = w.deletes.iter().map(|x| x.1).collect();

    let bib: Vec<&[u8]> = w.bind_inserts.iter().map(|x| x.0.as_slice()).collect();
    let bik: Vec<&[u8]> = w.bind_inserts.iter().map(|x| x.1.as_slice()).collect();
    let bub: Vec<&[u8]> = w.bind_updates.iter().map(|x| x.0.as_slice()).collect();
    let buk: Vec<&[u8]> = w.bind_updates.iter().map(|x| x.1.as_slice()).collect();
    let bus: Vec<&[u8]> = w.bind_updates.iter().map(|x| x.2.as_slice()).collect();
    let bdb: Vec<&[u8]> = w.bind_deletes.iter().map(|x| x.0.as_slice()).collect();
    let bds: Vec<&[u8]> = w.bind_deletes.iter().map(|x| x.1.as_slice()).collect();

    // Records first (inserts in key order), then bindings (in binding
    // order), in every batch, so that concurrent batches wait for each
    // other in one order.
    let p_ins: [&(dyn ToSql + Sync); 7] = [&ik, &ir, &it, &is, &ic, &il, &ie];
    let p_upd: [&(dyn ToSql + Sync); 8] = [&uk, &ur, &ut, &us, &uc, &ul, &ue, &useen];
    let p_del: [&(dyn ToSql + Sync); 2] = [&dk, &dseen];
    let p_bins: [&(dyn ToSql + Sync); 2] = [&bib, &bik];
    let p_bupd: [&(dyn ToSql + Sync); 3] = [&bub, &buk, &bus];
    let p_bdel: [&(dyn ToSql + Sync); 2] = [&bdb, &bds];
    let insert = if strict {
        &st.insert_records_strict
    } else {
        &st.insert_records
    };
    let (a, b, c, d, e, f) = tokio::join!(
        run_write(conn, insert, &p_ins, ik.is_empty()),
        run_write(conn, &st.update_records, &p_upd, uk.is_empty()),
        run_write(conn, &st.delete_records, &p_del, dk.is_empty()),
        run_write(conn, &st.insert_bindings, &p_bins, bib.is_empty()),
        run_write(conn, &st.update_bindings, &p_bupd, bub.is_empty()),
        run_write(conn, &st.delete_bindings, &p_bdel, bdb.is_empty()),
    );
    let a = a.map_err(|e| {
        if strict && e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
            Fail::Contended(describe(&e))
        } else {
            fail(&e)
        }
    });
    let counts = [
        (a?, ik.len()),
        (b.map_err(|e| fail(&e))?, uk.len()),
        (c.map_err(|e| fail(&e))?, dk.len()),
        (d.map_err(|e| fail(&e))?, bib.len()),
        (e.map_err(|e| fail(&e))?, bub.len()),
        (f.map_err(|e| fail(&e))?, bdb.len()),
    ];
    Ok(counts.iter().all(|(got, want)| got == want))
}

/// The answers of a committed batch and its audit events.
type Decisions = (Vec<Result<Reply>>, Vec<Event>);

/// One attempt at a batch: one transaction.
///
/// With `optimistic`, a first round whose only writes that may lose are
/// record inserts sends them with the `COMMIT` in one flight, the insert
/// strict (a present key fails it, which rolls the whole transaction back
/// and answers [`Fail::Contended`]); without, such writes go after a
/// savepoint and the `COMMIT` waits for their row counts.
async fn attempt(
    shared: &Shared,
    conn: &Conn,
    ops: &[(Key, Op)],
    (token_floor, waits): (Option<u64>, Waits),
    optimistic: bool,
) -> Result<Decisions, Fail> {
    let c = &conn.client;
    let keys: Vec<Vec<u8>> = ops
        .iter()
        .map(|(k, _)| k.to_bytes())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    // Tokens are drawn in the first flight, after the lock (the server
    // runs the flight in order), as many as the claimed keys' rows suggest
    // (an absent, expired, lapsed or retryably failed key); the decisions
    // draw more when the estimate falls short, and the few tokens an
    // estimate draws too many are skipped, never reused.
    let claimed: Vec<Vec<u8>> = ops
        .iter()
        .filter(|(_, op)| matches!(op, Op::Claim { .. }))
        .map(|(k, _)| k.to_bytes())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let test_now = match &shared.clock {
        Some(clock) => Some(to_i64("the test clock", clock.now_ms())?),
        None => None,
    };
    let floor = match token_floor {
        Some(f) => Some(to_i64("the token floor", f.min(crate::MAX_TOKEN))?),
        None => None,
    };
    let lock_key = shared.sql.token_lock;
    // The first flight: begin; for an import, raise the sequence under the
    // records table's EXCLUSIVE lock (no hot claim's INSERT and no locking
    // read runs meanwhile, and both draw only after taking their lock, so
    // no draw overtakes the raise: see `hot`) and the exclusive token lock
    // (for processes of earlier versions, whose draws take it shared),
    // taken in that order, the order of a general batch; lock and read
    // the rows; draw tokens under the shared token lock; read the clock
    // last (after every lock of the flight, so that a wait for a row or
    // for the token lock, which an import holds while it waits for rows of
    // its own, never ages the batch's time: a claim is never answered with
    // a lease that lapsed while it waited).
    conn.commit_sent.store(false, Ordering::SeqCst);
    //
    // Each statement is its own future, polled first in the order written
    // (`tokio::join!`), and tokio-postgres sends a statement when its
    // future is first polled: the order on the wire is the order below,
    // and the results are checked in that order, so the first failure is
    // the one reported (the statements after it answer 25P02, which names
    // nothing).
    let mut begin_sql = String::from("BEGIN ISOLATION LEVEL READ COMMITTED");
    for (name, wait) in [
        ("lock_timeout", waits.lock),
        ("idle_in_transaction_session_timeout", waits.idle),
    ] {
        // The shorter of `wait` and the session's own (the limits', or the
        // URL's `-c` setting, which wins), in whole milliseconds, at least
        // one; for this transaction only. Read with `current_setting` (the
        // value with its unit, as an interval), not from `pg_settings`, a
        // view over every setting that took a minimal transaction (begin,
        // a locking read, commit) to 0.42× its rate (pgbench, 2 clients,
        // median of 5 alternated runs; this form 0.92×).
        if let Some(wait) = wait {
            begin_sql.push_str(&format!(
                "; SELECT pg_catalog.set_config('{name}', (extract(epoch FROM \
                 LEAST(NULLIF(pg_catalog.current_setting('{name}')::interval, interval '0'), \
                 interval '{} ms')) * 1000)::bigint::text, true)",
                wait.as_millis().max(1)
            ));
        }
    }
    let begin = c.batch_execute(&begin_sql);
    let lock_table = async {
        match floor {
            Some(_) => c.batch_execute(&shared.sql.lock_for_raise).await,
            None => Ok(()),
        }
    };
    let token_lock = async {
        match floor {
            Some(_) => c.query(&conn.st.xact_lock, &[&lock_key]).await.map(drop),
            None => Ok(()),
        }
    };
    let raise = async {
        match &floor {
            Some(floor) => c.query(&conn.st.raise_tokens, &[floor]).await.map(drop),
            None => Ok(()),
        }
    };
    let key_params: [&(dyn ToSql + Sync); 1] = [&keys];
    let rows = c.query(&conn.st.lock_records, &key_params);
    let clock = async {
        match shared.clock {
            Some(_) => Ok(None),
            None => c.query(&conn.st.clock, &[]).await.map(Some),
        }
    };
    let draw = async {
        if !claimed.is_empty() {
            draw_tokens(shared, conn, Draw::Estimate(&claimed, test_now)).await
        } else {
            Ok(Vec::new())
        }
    };
    let (begin, lock_table, token_lock, raise, rows, draw, clock) =
        tokio::join!(begin, lock_table, token_lock, raise, rows, draw, clock);
    begin.map_err(|e| fail(&e))?;
    lock_table.map_err(|e| fail(&e))?;
    token_lock.map_err(|e| fail(&e))?;
    raise.map_err(|e| fail(&e))?;
    let rows = rows.map_err(|e| fail(&e))?;
    // The draw (its shared lock, then the draw) before the clock: a draw
    // refused for want of USAGE on the sequence, or a deadlock on the
    // token lock, is the error, not the clock's 25P02 after it.
    let first_draw = draw?;
    let clock = clock.map_err(|e| fail(&e))?;
    let mut base = Base::default();
    fill_records(&keys, &rows, &mut base)?;
    let mut now = time_from(shared, clock.as_deref())?;
    let mut first_draw = Some(first_draw);
    for round in 0..MAX_ROUNDS {
        if let Some(later) = load_bindings(shared, conn, ops, &mut base).await? {
            // The bindings' locks may have been waited for.
            now = later;
        }
        let mut tokens = first_draw.take().unwrap_or_default();
        let mut exhausted = false;
        let decided = loop {
            let pass = Pass {
                now_ms: now,
                retention_ms: shared.retention_ms,
                tokens: &tokens,
                exhausted,
            };
            let d = decide::decide(&base, ops, &pass);
            if d.shortage == 0 {
                break d;
            }
            let more = draw_tokens(shared, conn, Draw::Exactly(d.shortage)).await?;
            if more.is_empty() {
                exhausted = true;
            }
            tokens.extend(more);
        };
        let w = decide::writes(&base, &decided);
        if w.is_empty() {
            commit(conn).await?;
            return Ok((decided.replies, decided.events));
        }
        let strict = optimistic && round == 0 && w.may_lose() && w.bind_inserts.is_empty();
        if !w.may_lose() || strict {
            // Every row written is locked (or a binding read under lock):
            // no compare-and-set can lose, so the commit goes in the same
            // flight as the writes. Or the only writes that may lose are
            // record inserts, sent strict: a key inserted meanwhile by
            // another transaction fails the insert, and the COMMIT behind
            // it then rolls the whole transaction back (Fail::Contended).
            conn.commit_sent.store(true, Ordering::SeqCst);
            let (written, committed) =
                tokio::join!(send_writes(conn, &w, strict), c.batch_execute("COMMIT"));
            match written {
                // A write the server refused made the COMMIT a rollback.
                Err(Fail::Lost(d)) => return Err(Fail::Unknown(d)),
                Err(f) => return Err(f),
                Ok(landed) => {
                    committed.map_err(|e| fail_commit(&e))?;
                    if !landed {
                        return Err(Fail::Storage(
                            "a compare-and-set on a locked row did not land; the rest of \
                             the batch was committed"
                                .into(),
                        ));
                    }
                    return Ok((decided.replies, decided.events));
                }
            }
        }
        let (sp, landed) = tokio::join!(
            c.batch_execute("SAVEPOINT idemstore_writes"),
            send_writes(conn, &w, false)
        );
        sp.map_err(|e| fail(&e))?;
        if landed? {
            commit(conn).await?;
            return Ok((decided.replies, decided.events));
        }
        // Another transaction inserted a key (or binding) this batch found
        // absent: undo this round's writes, read and lock everything again,
        // and decide again with tokens drawn after the new locks.
        c.batch_execute("ROLLBACK TO SAVEPOINT idemstore_writes")
            .await
            .map_err(|e| fail(&e))?;
        base = Base::default();
        // The clock again after the new locks (one flight).
        let (loaded, later) = tokio::join!(
            load_records(conn, &keys, &mut base),
            read_time(shared, conn)
        );
        loaded?;
        now = later?;
    }
    Err(Fail::Retry(format!(
        "the batch lost its compare-and-set {MAX_ROUNDS} times in a row"
    )))
}

/// Commits the open transaction.
async fn commit(conn: &Conn) -> Result<(), Fail> {
    conn.commit_sent.store(true, Ordering::SeqCst);
    conn.client
        .batch_execute("COMMIT")
        .await
        .map_err(|e| fail_commit(&e))
}

/// Makes sure `slot` holds an open connection.
async fn ensure<'a>(shared: &Shared, slot: &'a mut Option<Conn>) -> Result<&'a Conn, Fail> {
    if slot.as_ref().is_some_and(|c| c.client.is_closed()) {
        *slot = None;
    }
    if slot.is_none() {
        // A refusal met again while a connection opens is no key's own: a
        // batch must not run again a key at a time for it (each key would
        // open a connection of its own).
        let opened = open_conn(shared).await.map_err(|f| match f {
            Fail::Rejected(detail, true) => Fail::Config(ConfigFault::SchemaDamaged, detail),
            Fail::Rejected(detail, false) => Fail::Storage(detail),
            other => other,
        })?;
        *slot = Some(opened);
    }
    slot.as_ref()
        .ok_or_else(|| Fail::Storage("no connection".into()))
}

/// After a failed transaction: roll back, or drop a connection whose state
/// is unknown.
async fn recover(slot: &mut Option<Conn>, failure: &Fail) {
    let keep = match (slot.as_ref(), failure) {
        (
            Some(conn),
            Fail::Retry(_)
            | Fail::Contended(_)
            | Fail::Refused(_)
            | Fail::Rejected(..)
            | Fail::Locked(_)
            | Fail::Storage(_)
            | Fail::Config(..),
        ) => !conn.client.is_closed() && conn.client.batch_execute("ROLLBACK").await.is_ok(),
        _ => false,
    };
    if !keep {
        *slot = None;
    }
}

/// Bounds a transaction sets for itself below its session's settings
/// (each the shorter of the two), for that transaction only.
#[derive(Debug, Clone, Copy, Default)]
struct Waits {
    /// Its `lock_timeout`: each wait for a lock ([`run_apart`], a renewal
    /// batch).
    lock: Option<Duration>,
    /// Its `idle_in_transaction_session_timeout`: how long the server lets
    /// it sit open between statements, holding its row locks. A job with a
    /// deadline of its own, shorter than `call_timeout` (a renewal, a write
    /// under a lease: `Job::Many`'s `own_deadline`), sets it from that
    /// deadline ([`idle_wait`]): past the deadline the worker drops the
    /// connection, and a connection gone half-open (its client's packets
    /// lost, the server never told) would hold the rows it locked until the
    /// session's setting (60 s by default), while a renewal's retry on
    /// another connection waits for them and the lease lapses.
    idle: Option<Duration>,
}

/// The `idle_in_transaction_session_timeout` of a transaction run by
/// `due`, at `now`: half the time left (at least [`MIN_IDLE_WAIT`]), so
/// that the server ends a session left half-open inside it, and releases
/// its row locks, about half the time left after its last statement: a
/// renewal's retry on another connection still finds the lease current.
/// The engine's own transactions sit idle only for a round trip and the
/// decisions between their statements.
fn idle_wait(due: Instant, now: Instant) -> Duration {
    (due.saturating_duration_since(now) / 2).max(MIN_IDLE_WAIT)
}

/// The shortest `idle_in_transaction_session_timeout` [`idle_wait`] sets.
const MIN_IDLE_WAIT: Duration = Duration::from_millis(20);

/// The `lock_timeout` of a lease renewal batch that must end by
/// `deadline`, at `now`: a quarter of the time left, at most
/// [`SPLIT_LOCK_WAIT`] (at least 1 ms). A row locked by another session (a
/// caller's open transaction, any `SELECT … FOR UPDATE`) then refuses the
/// batch early enough for each key's renewal to run again on its own
/// ([`run_apart`]) before the deadline: the other leases of the batch are
/// renewed, and only the locked one is answered `Unavailable` (its
/// extender tries again later). Waiting for the lock until the deadline
/// instead failed every lease of the batch, at each retry, until they
/// lapsed and were taken over while their work still ran.
fn renewal_lock_wait(deadline: Instant, now: Instant) -> Duration {
    (deadline.saturating_duration_since(now) / 4)
        .min(SPLIT_LOCK_WAIT)
        .max(Duration::from_millis(1))
}

/// Runs a batch as one transaction, trying again after deadlocks, under
/// `waits`.
async fn run_batch(
    shared: &Shared,
    slot: &mut Option<Conn>,
    ops: &[(Key, Op)],
    token_floor: Option<u64>,
    waits: Waits,
) -> Result<Decisions, Fail> {
    let mut last = Fail::Storage("no attempt".into());
    let mut optimistic = true;
    for _ in 0..MAX_ATTEMPTS {
        let conn = ensure(shared, slot).await?;
        match attempt(shared, conn, ops, (token_floor, waits), optimistic).await {
            Ok(done) => return Ok(done),
            Err(f) => {
                recover(slot, &f).await;
                match f {
                    Fail::Retry(_) => last = f,
                    // Once contended, the batch goes the savepoint's way.
                    Fail::Contended(_) => {
                        optimistic = false;
                        last = f;
                    }
                    other => return Err(other),
                }
            }
        }
    }
    Err(last)
}

/// One request of a batch that the hot path may decide.
struct HotOp<'a> {
    /// Its place in the batch.
    at: usize,
    key: &'a Key,
    op: &'a Op,
    kb: Vec<u8>,
    template: hot::Template,
    /// For a completion or failure: the record as held.
    held: Option<Held>,
}

/// The answers of the hot path, by place in the batch (`None`: not
/// decided there, for the general path).
type HotAnswers = Vec<Option<Result<Reply>>>;

/// What the hot path gives the general path: its answers, and whether a
/// hot statement was refused a lock past `lock_timeout` (its requests then
/// go straight to [`run_apart`] when they are of several keys: a general
/// transaction would wait for the same lock again).
struct HotRun {
    answers: HotAnswers,
    /// The refusal's detail, when a hot statement was refused a lock.
    locked: Option<String>,
    /// The refusal's detail, when a hot statement was refused for a
    /// reason met again ([`Fail::Rejected`]): the request it refused may be
    /// one key's alone, so the batch runs again a key at a time.
    rejected: Option<String>,
}

/// Runs the hot path's part of a batch ([`hot`]): the claims of keys that
/// may be absent in one autocommit statement, the completions and failures
/// by a holder of this process in another, pipelined. A request whose key
/// appears more than once in the batch, and any other kind, is left to the
/// general path (the batch's requests are concurrent, so deciding some
/// before the others is a valid order).
///
/// # Errors
/// The connection could not be opened (nothing sent).
async fn run_hot(
    shared: &Shared,
    slot: &mut Option<Conn>,
    ops: &[(Key, Op)],
    hot_ok: &[bool],
) -> Result<HotRun, Fail> {
    let mut answers: HotAnswers = ops.iter().map(|_| None).collect();
    let mut locked = None;
    let mut rejected = None;
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::with_capacity(ops.len());
    for (key, _) in ops {
        *seen.entry(key.to_bytes()).or_default() += 1;
    }
    // The templates' placeholder time (any time works; the last reading
    // keeps the offsets small).
    let p = shared.last_reading.load(Ordering::SeqCst);
    let retention = shared.retention_ms;
    let mut claims = Vec::new();
    let mut finishes = Vec::new();
    for (at, (key, op)) in ops.iter().enumerate() {
        let kb = key.to_bytes();
        if seen.get(&kb) != Some(&1) || !hot_ok.get(at).copied().unwrap_or(false) {
            continue;
        }
        match op {
            Op::Claim { .. } => {
                if let Some(template) = hot::claim_template(key, op, retention, p) {
                    claims.push(HotOp {
                        at,
                        key,
                        op,
                        kb,
                        template,
                        held: None,
                    });
                }
            }
            Op::Complete { token, .. } | Op::Fail { token, .. } => {
                let held = shared.held.lock().get(&kb).cloned();
                let Some(held) = held.filter(|h| h.record.token == *token) else {
                    continue;
                };
                let at_least = p.max(held.record.updated_ms);
                if let Some(template) =
                    hot::finish_template(key, &held.record, op, retention, at_least)
                {
                    finishes.push(HotOp {
                        at,
                        key,
                        op,
                        kb,
                        template,
                        held: Some(held),
                    });
                }
            }
            _ => {}
        }
    }
    if claims.is_empty() && finishes.is_empty() {
        return Ok(HotRun {
            answers,
            locked,
            rejected,
        });
    }
    let conn = ensure(shared, slot).await?;
    let c = &conn.client;
    let test_now = match &shared.clock {
        Some(clock) => Some(to_i64("the test clock", shared.seen(clock.now_ms()))?),
        None => None,
    };
    let ck: Vec<&[u8]> = claims.iter().map(|h| h.kb.as_slice()).collect();
    let ch: Vec<Vec<u8>> = claims.iter().map(|h| h.template.head()).collect();
    let ct: Vec<&[u8]> = claims
        .iter()
        .map(|h| h.template.envelope.as_slice())
        .collect();
    let cl: Vec<i64> = claims.iter().map(|h| h.template.lease_offset()).collect();
    let ce: Vec<i64> = claims.iter().map(|h| h.template.expires_offset()).collect();
    let fk: Vec<&[u8]> = finishes.iter().map(|h| h.kb.as_slice()).collect();
    let mut ft = Vec::with_capacity(finishes.len());
    let mut fseen: Vec<&[u8]> = Vec::with_capacity(finishes.len());
    let mut ffloor = Vec::with_capacity(finishes.len());
    let mut fcreated = Vec::with_capacity(finishes.len());
    let mut flease = Vec::with_capacity(finishes.len());
    let mut fexpires = Vec::with_capacity(finishes.len());
    for h in &finishes {
        let held = h
            .held
            .as_ref()
            .ok_or_else(|| Fail::Storage("a hot completion without its record".into()))?;
        ft.push(to_i64("a token", held.record.token)?);
        fseen.push(held.stored.as_slice());
        ffloor.push(to_i64("a record's time", held.record.updated_ms)?);
        fcreated.push(to_i64("a record's time", held.record.created_ms)?);
        flease.push(to_i64("a record's time", held.record.lease_until_ms)?);
        fexpires.push(to_i64("a record's time", held.record.expires_ms)?);
    }
    let fh: Vec<Vec<u8>> = finishes.iter().map(|h| h.template.head()).collect();
    let fe: Vec<&[u8]> = finishes
        .iter()
        .map(|h| h.template.envelope.as_slice())
        .collect();
    let fs: Vec<i16> = finishes
        .iter()
        .map(|h| decide::state_code(h.template.record.state))
        .collect();
    let fx: Vec<i64> = finishes
        .iter()
        .map(|h| h.template.expires_offset())
        .collect();
    let p_claim: [&(dyn ToSql + Sync); 6] = [&test_now, &ck, &ch, &ct, &cl, &ce];
    let p_finish: [&(dyn ToSql + Sync); 12] = [
        &test_now, &fk, &ft, &fseen, &fh, &fe, &fs, &fx, &ffloor, &fcreated, &flease, &fexpires,
    ];
    // Each statement commits on its own: once sent, a lost answer leaves
    // its outcome unknown.
    conn.commit_sent.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let (claimed, finished) = tokio::join!(
        async {
            if claims.is_empty() {
                Ok(Vec::new())
            } else {
                c.query(&conn.st.hot_claim, &p_claim).await
            }
        },
        async {
            if finishes.is_empty() {
                Ok(Vec::new())
            } else {
                c.query(&conn.st.hot_finish, &p_finish).await
            }
        }
    );
    let mut events = Vec::new();
    let mut lost = false;
    match claimed {
        Ok(rows) => {
            for row in &rows {
                let Some(h) = claim_row(&claims, row) else {
                    continue;
                };
                match claim_answer(shared, h, row) {
                    Ok(Some((answer, evs))) => {
                        answers[h.at] = Some(answer);
                        events.extend(evs);
                    }
                    Ok(None) => {}
                    Err(f) => answers[h.at] = Some(Err(f.error())),
                }
            }
        }
        Err(e) => lost |= hot_failed(&e, &claims, &mut answers, (&mut locked, &mut rejected)),
    }
    match finished {
        Ok(rows) => {
            for row in &rows {
                let Ok(kb) = row.try_get::<_, Vec<u8>>(0) else {
                    continue;
                };
                let Some(h) = finishes.iter().find(|h| h.kb == kb) else {
                    continue;
                };
                let answer = match row.try_get::<_, i64>(1) {
                    Ok(at) => to_u64("the time", at)
                        .map_err(|f| f.error())
                        .and_then(|at| finish_answer(shared, h, at)),
                    Err(e) => Err(hot_row(e).error()),
                };
                if let Ok((_, evs)) = &answer {
                    events.extend(evs.iter().cloned());
                }
                answers[h.at] = Some(answer.map(|(reply, _)| reply));
            }
        }
        Err(e) => lost |= hot_failed(&e, &finishes, &mut answers, (&mut locked, &mut rejected)),
    }
    if lost {
        *slot = None;
    }
    let decided = answers.iter().filter(|a| a.is_some()).count();
    if decided > 0 {
        shared.counters.publish(events);
        // Only the requests that wrote, and never one whose statement's
        // answer was lost (its answer is `OutcomeUnknown`).
        let writes = crate::record::writes(answers.iter().flatten());
        shared.counters.group_commit(started.elapsed(), writes);
    }
    Ok(HotRun {
        answers,
        locked,
        rejected,
    })
}

/// After a hot statement failed: a lost connection leaves its requests'
/// outcome unknown (answered so); a configuration fault (a schema altered
/// outside idemstore) applied nothing and is their answer; any other
/// refusal applied nothing, so they go the general way (`locked` holds
/// the refusal when it was a lock wait past `lock_timeout`, `rejected`
/// when it is met again: either may be one key's, so the batch then runs
/// a key at a time). Returns whether the connection is to be dropped:
/// lost, or on a host that turned read-only (the general way then opens a
/// new one).
fn hot_failed(
    e: &tokio_postgres::Error,
    hots: &[HotOp<'_>],
    answers: &mut HotAnswers,
    (locked, rejected): (&mut Option<String>, &mut Option<String>),
) -> bool {
    match fail(e) {
        Fail::ReadOnly(_) => true,
        Fail::Lost(detail) | Fail::Unknown(detail) => {
            for h in hots {
                answers[h.at] = Some(Err(Error::OutcomeUnknown {
                    detail: detail.clone(),
                }));
            }
            true
        }
        Fail::Locked(detail) => {
            *locked = Some(detail);
            false
        }
        Fail::Rejected(detail, _) => {
            *rejected = Some(detail);
            false
        }
        // Nothing was applied, and the general way would meet the same
        // fault, or worse: with the primary key dropped (42P10 here), its
        // `INSERT` without `ON CONFLICT` would let a second claim of a key
        // acquire it too.
        Fail::Config(fault, detail) => {
            for h in hots {
                answers[h.at] = Some(Err(Fail::Config(fault, detail.clone()).error()));
            }
            false
        }
        _ => false,
    }
}

/// A request's answer with its audit events.
type Answered = (Result<Reply>, Vec<Event>);

/// A row of a hot statement that cannot be read. The statement committed
/// on its own (it may have written), so a column of another type than the
/// store's (`SchemaDamaged` before anything is sent) leaves the outcome
/// unknown here; the detail names the damage, which the next request that
/// reads the column reports as `SchemaDamaged`.
fn hot_row(e: tokio_postgres::Error) -> Fail {
    match storage("a hot row", e) {
        Fail::Config(fault, detail) => Fail::Unknown(format!(
            "{detail}: the statement committed and its answer cannot be read ({}: a column \
             altered outside idemstore)",
            fault.name()
        )),
        other => other,
    }
}

/// The hot claim a row of the claim statement answers.
fn claim_row<'a, 'b>(claims: &'a [HotOp<'b>], row: &Row) -> Option<&'a HotOp<'b>> {
    let kb: Vec<u8> = row.try_get(1).ok()?;
    claims.iter().find(|h| h.kb == kb)
}

/// The answer (and its events) of a hot claim from its row: a fresh
/// record, or a row decided without a write; `None` for the general path
/// (a write to decide, or a fresh lease that lapsed while the insert
/// waited: the general path then decides the key again).
fn claim_answer(shared: &Shared, h: &HotOp<'_>, row: &Row) -> Result<Option<Answered>, Fail> {
    let get = hot_row;
    let fresh: bool = row.try_get(0).map_err(get)?;
    let at: i64 = row.try_get(8).map_err(get)?;
    let at_u = to_u64("the time", at)?;
    let n = shared.seen(at_u);
    let retention = shared.retention_ms;
    if fresh {
        let token: i64 = row.try_get(3).map_err(get)?;
        let t = &h.template;
        let token_u = to_u64("a token", token)?;
        // The answer is the row exactly as the statement wrote it, at its
        // own reading `at`, and so is what `held` keeps for the holder's
        // completion (whose compare-and-set is on the row's bytes).
        let overflow = || Fail::Storage("a hot claim's time overflows".into());
        let written = hot::complete(&t.record, t.mask, at_u, token_u).ok_or_else(overflow)?;
        let (effect, reply) = hot::confirm(h.key, None, h.op, retention, at_u, token_u, &written)
            .map_err(Fail::Storage)?;
        let expires = to_i64("an expiry", written.expires_ms)?;
        shared.hold(&h.kb, &written, hot::stored_bytes(&h.kb, t, token, expires));
        // A lease that lapsed while the insert waited is never granted:
        // the general path decides the key again (a takeover then).
        let after: i64 = row.try_get(9).map_err(get)?;
        if shared.seen(to_u64("the time", after)?) >= written.lease_until_ms {
            return Ok(None);
        }
        let events: Vec<Event> = Event::of_transition(h.key, None, h.op, &effect, &reply, at_u)
            .into_iter()
            .collect();
        return Ok(Some((Ok(reply), events)));
    }
    let rc = RowColumns {
        key: h.kb.clone(),
        record: row.try_get(2).map_err(get)?,
        token: row.try_get(3).map_err(get)?,
        state: row.try_get(4).map_err(get)?,
        created_ms: row.try_get(5).map_err(get)?,
        lease_until_ms: row.try_get(6).map_err(get)?,
        expires_ms: row.try_get(7).map_err(get)?,
    };
    let mut base = Base::default();
    base.records.insert(h.kb.clone(), decide::slot_of(&rc));
    let ops = [(h.key.clone(), h.op.clone())];
    let pass = Pass {
        now_ms: n,
        retention_ms: retention,
        tokens: &[],
        exhausted: false,
    };
    let mut d = decide::decide(&base, &ops, &pass);
    if d.shortage > 0 || !d.records.is_empty() || !d.bindings.is_empty() {
        return Ok(None);
    }
    Ok(d.replies.pop().map(|reply| (reply, d.events)))
}

/// The answer (and its events) of a hot completion or failure that
/// landed at time `n`.
fn finish_answer(shared: &Shared, h: &HotOp<'_>, n: u64) -> Result<(Reply, Vec<Event>)> {
    let held = h
        .held
        .as_ref()
        .ok_or_else(|| Error::Storage("a hot completion without its record".into()))?;
    let t = &h.template;
    let written = hot::complete(&t.record, t.mask, n, held.record.token)
        .ok_or_else(|| Error::Storage("a hot completion's time overflows".into()))?;
    let (effect, reply) = hot::confirm(
        h.key,
        Some(&held.record),
        h.op,
        shared.retention_ms,
        n,
        held.record.token,
        &written,
    )
    .map_err(Error::Storage)?;
    shared.held.lock().remove(&h.kb);
    let events = Event::of_transition(h.key, Some(&held.record), h.op, &effect, &reply, n)
        .into_iter()
        .collect();
    Ok((reply, events))
}

/// Reads one record at the store's time (no transaction: one statement).
async fn run_get(shared: &Shared, slot: &mut Option<Conn>, key: &Key) -> Result<Option<Record>> {
    let done = async {
        let conn = ensure(shared, slot).await?;
        let kb = vec![key.to_bytes()];
        let rows = conn
            .client
            .query(&conn.st.read_records, &[&kb])
            .await
            .map_err(|e| fail(&e))?;
        let now = read_time(shared, conn).await?;
        match rows.first() {
            Some(row) => Ok((Some(decide::slot_of(&row_columns(row)?)), now)),
            None => Ok((None, now)),
        }
    }
    .await;
    let (slot_read, now) = match done {
        Ok(x) => x,
        Err(f) => {
            recover(slot, &f).await;
            return Err(f.error());
        }
    };
    match slot_read {
        Some(Slot::Present(rec)) => Ok((!rec.is_expired_at(now)).then_some(rec)),
        Some(Slot::Corrupt(key, detail)) => {
            let err = Error::CorruptRecord { key, detail };
            shared.counters.publish(Event::corruption(&err));
            Err(err)
        }
        Some(Slot::Absent) | None => Ok(None),
    }
}

/// Evicts up to `max` records past retention, with their bindings.
async fn run_sweep(shared: &Shared, slot: &mut Option<Conn>, max: usize) -> Result<usize> {
    if max == 0 {
        return Ok(0);
    }
    let done = async {
        let conn = ensure(shared, slot).await?;
        let c = &conn.client;
        conn.commit_sent.store(false, Ordering::SeqCst);
        c.batch_execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(|e| fail(&e))?;
        let now = read_time(shared, conn).await?;
        let now_param = to_i64("the time", now)?;
        let mut events = Vec::new();
        let mut gone = Vec::new();
        // Pages in deadline order past the last row seen, so that rows it
        // cannot evict (corrupt ones, reported and left for `check`) never
        // hold back the ones after them.
        let mut after: (i64, Vec<u8>) = (-1, Vec::new());
        while gone.len() < max {
            let want = max - gone.len();
            // A limit is "at most": one past a bigint is the same as the
            // largest bigint (no table holds more rows).
            let limit = i64::try_from(want).unwrap_or(i64::MAX);
            let rows = c
                .query(
                    &conn.st.due_records,
                    &[&now_param, &limit, &after.0, &after.1],
                )
                .await
                .map_err(|e| fail(&e))?;
            for row in &rows {
                let columns = row_columns(row)?;
                after = (columns.expires_ms, columns.key.clone());
                match decide::slot_of(&columns) {
                    Slot::Present(rec) if rec.is_expired_at(now) => gone.push(rec),
                    Slot::Corrupt(key, detail) => {
                        events.extend(Event::corruption(&Error::CorruptRecord { key, detail }));
                    }
                    _ => {}
                }
            }
            if rows.len() < want {
                break;
            }
        }
        let dk: Vec<Vec<u8>> = gone.iter().map(|r| r.key.to_bytes()).collect();
        let dt: Vec<i64> = gone
            .iter()
            .map(|r| to_i64("a token", r.token))
            .collect::<Result<_, _>>()?;
        let (bb, bk): (Vec<Vec<u8>>, Vec<Vec<u8>>) = gone
            .iter()
            .filter_map(|r| {
                r.business_key
                    .as_deref()
                    .map(|bk| (r.key.business_binding(bk), r.key.to_bytes()))
            })
            .unzip();
        let p_del: [&(dyn ToSql + Sync); 2] = [&dk, &dt];
        let p_unbind: [&(dyn ToSql + Sync); 2] = [&bb, &bk];
        let (deleted, unbound) = tokio::join!(
            c.query(&conn.st.delete_records, &p_del),
            c.query(&conn.st.delete_bindings, &p_unbind),
        );
        let deleted = deleted.map_err(|e| fail(&e))?;
        unbound.map_err(|e| fail(&e))?;
        commit(conn).await?;
        let deleted: BTreeSet<Vec<u8>> = deleted
            .iter()
            .filter_map(|r| r.try_get::<_, Vec<u8>>(0).ok())
            .collect();
        let evicted: Vec<&Record> = gone
            .iter()
            .filter(|r| deleted.contains(&r.key.to_bytes()))
            .collect();
        events.extend(evicted.iter().map(|r| Event::evicted(r)));
        Ok::<_, Fail>((evicted.len(), events))
    }
    .await;
    match done {
        Ok((n, events)) => {
            shared.counters.publish(events);
            Ok(n)
        }
        Err(f) => {
            recover(slot, &f).await;
            Err(f.error())
        }
    }
}

/// Runs a one-statement read.
async fn run_read<T>(
    shared: &Shared,
    slot: &mut Option<Conn>,
    read: impl AsyncFnOnce(&Shared, &Conn) -> Result<T, Fail>,
) -> Result<T> {
    let done = match ensure(shared, slot).await {
        Ok(conn) => read(shared, conn).await,
        Err(f) => Err(f),
    };
    match done {
        Ok(v) => Ok(v),
        Err(f) => {
            recover(slot, &f).await;
            Err(f.error())
        }
    }
}

/// The token the next acquisition would take.
async fn read_next_token(_: &Shared, conn: &Conn) -> Result<u64, Fail> {
    let rows = conn
        .client
        .query(&conn.st.next_token, &[])
        .await
        .map_err(|e| fail(&e))?;
    let row = rows
        .first()
        .ok_or_else(|| Fail::Storage("the token sequence has no row".into()))?;
    let last: i64 = row
        .try_get(0)
        .map_err(|e| storage("reading the sequence", e))?;
    let called: bool = row
        .try_get(1)
        .map_err(|e| storage("reading the sequence", e))?;
    let last = to_u64("the token sequence", last)?;
    if called {
        last.checked_add(1)
            .ok_or_else(|| Fail::Storage("the token sequence overflows".into()))
    } else {
        Ok(last)
    }
}

/// The number of stored rows.
async fn read_len(_: &Shared, conn: &Conn) -> Result<u64, Fail> {
    let rows = conn
        .client
        .query(&conn.st.count, &[])
        .await
        .map_err(|e| fail(&e))?;
    let n: i64 = rows
        .first()
        .ok_or_else(|| Fail::Storage("count returned no row".into()))?
        .try_get(0)
        .map_err(|e| storage("reading the count", e))?;
    to_u64("the row count", n)
}

/// The rows by state at `now_ms` and the oldest live Processing row's
/// creation time, from one aggregate statement over the records' columns
/// ([`Sql::state_counts`]): the server reads every row, the client none.
/// A row whose `state` is none of the four is counted corrupt; one damaged
/// elsewhere is counted in its state, or as expired past its
/// `expires_ms` (reads answer `CorruptRecord` for it; `check` names a
/// damaged record). The statement runs on a worker under the call's
/// deadline (`call_timeout`) and `statement_timeout`.
async fn read_counts(
    shared: &Shared,
    conn: &Conn,
    now_ms: u64,
) -> Result<(StateCounts, Option<u64>), Fail> {
    let now = to_i64("the store's time", now_ms)?;
    let row = conn
        .client
        .query_one(shared.sql.state_counts.as_str(), &[&now])
        .await
        .map_err(|e| fail(&e))?;
    let count = |i: usize, what: &str| -> Result<u64, Fail> {
        let n: i64 = row
            .try_get(i)
            .map_err(|e| storage("reading the counts by state", e))?;
        to_u64(what, n)
    };
    let all = count(0, "the row count")?;
    let corrupt = count(1, "the corrupt row count")?;
    let counts = StateCounts {
        processing: count(2, "the Processing count")?,
        lapsed: count(3, "the lapsed count")?,
        succeeded: count(4, "the Succeeded count")?,
        failed: count(5, "the Failed count")?,
        failed_retryable: count(6, "the retryably Failed count")?,
        expired: 0,
        corrupt,
    };
    let counted = [
        counts.processing,
        counts.succeeded,
        counts.failed,
        counts.failed_retryable,
        corrupt,
    ]
    .iter()
    .try_fold(0u64, |sum, n| sum.checked_add(*n))
    .ok_or_else(|| Fail::Storage("the counts by state overflow".into()))?;
    let expired = all
        .checked_sub(counted)
        .ok_or_else(|| Fail::Storage("the counts by state exceed the row count".into()))?;
    let oldest: Option<i64> = row
        .try_get(7)
        .map_err(|e| storage("reading the oldest Processing row", e))?;
    let oldest = oldest
        .map(|ms| to_u64("the oldest Processing row's creation time", ms))
        .transpose()?;
    Ok((StateCounts { expired, ..counts }, oldest))
}

/// Answers a batch's callers (and publishes its events) or hands each the
/// batch's error.
fn answer_batch(
    shared: &Shared,
    replies: Vec<oneshot::Sender<Result<Reply>>>,
    result: Result<Decisions, Fail>,
    started: Instant,
) {
    match result {
        Ok((answers, events)) => {
            shared.counters.publish(events);
            shared
                .counters
                .group_commit(started.elapsed(), crate::record::writes(&answers));
            for (tx, answer) in replies.into_iter().zip(answers) {
                let _ = tx.send(answer);
            }
        }
        Err(f) => {
            for tx in replies {
                let _ = tx.send(Err(f.error()));
            }
        }
    }
}

/// What a worker is handed: a group-committed batch of requests, or one
/// job of another kind.
enum Work {
    /// Requests decided together (the hot path, then one transaction).
    Batch {
        /// The requests, in arrival order.
        ops: Vec<(Key, Op)>,
        /// Whether the hot path may take each.
        hot_ok: Vec<bool>,
        /// Each request's answer channel.
        replies: Vec<oneshot::Sender<Result<Reply>>>,
        /// Their places in the bounded queue, given back once answered.
        permits: Vec<tokio::sync::OwnedSemaphorePermit>,
        /// Each request's deadline (its call's).
        deadlines: Vec<Instant>,
        /// The earliest of their deadlines.
        due: Instant,
    },
    /// A job run on its own.
    One(Queued),
}

/// Takes what is queued, starting from `first`, into one piece of work:
/// every request queued (up to [`MAX_BATCH`], never waiting for more), or
/// one job of another kind when that comes first. A job of another kind
/// met after some requests is kept in `held`, to be handed out next. A
/// job whose deadline has passed is answered `Unavailable` here. `None`
/// when every job taken had expired.
fn take_work(
    first: Queued,
    queue: &mut UnboundedReceiver<Queued>,
    held: &mut Option<Queued>,
) -> Option<Work> {
    let mut ops: Vec<(Key, Op)> = Vec::new();
    let mut hot_ok = Vec::new();
    let mut replies = Vec::new();
    let mut permits = Vec::new();
    let mut deadlines = Vec::new();
    let mut due: Option<Instant> = None;
    let mut next = Some(first);
    while let Some(queued) = next.take() {
        let Queued {
            job,
            deadline,
            permit,
        } = queued;
        if deadline <= Instant::now() {
            job.fail(expired_in_queue());
            drop(permit);
            next = queue.try_recv().ok();
            continue;
        }
        match job {
            Job::Apply {
                key,
                op,
                hot,
                reply,
            } => {
                ops.push((key, op));
                hot_ok.push(hot);
                replies.push(reply);
                permits.push(permit);
                deadlines.push(deadline);
                due = Some(due.map_or(deadline, |d| d.min(deadline)));
                if ops.len() < MAX_BATCH {
                    next = queue.try_recv().ok();
                }
            }
            job => {
                let queued = Queued {
                    job,
                    deadline,
                    permit,
                };
                if ops.is_empty() {
                    return Some(Work::One(queued));
                }
                *held = Some(queued);
            }
        }
    }
    due.map(|due| Work::Batch {
        ops,
        hot_ok,
        replies,
        permits,
        deadlines,
        due,
    })
}

/// A worker the pool runs: its task and where its work is sent.
struct Worker {
    /// Where its work is sent; dropping it ends the worker (and closes its
    /// connection) once its work in hand is done.
    work: UnboundedSender<Work>,
    /// Its task, to tell an unexpected end apart from a retirement.
    task: tokio::task::Id,
}

/// What the pool's dispatcher waits for.
enum PoolEvent {
    /// The worker in this slot finished its work and is free.
    Free(usize),
    /// The next job (`None`: the queue is closed and empty).
    Job(Option<Queued>),
    /// The worker free the longest has been so for `connection_idle_timeout`.
    Retire,
    /// A worker's task ended.
    Ended(tokio::task::Id),
}

/// The worker pool: sizes itself to the load, between no worker and
/// `max`, each worker with at most one connection.
///
/// One dispatcher (this task) takes the jobs from the queue only when it
/// has a worker for them: the free worker that finished last (its
/// connection warm), or else a new one while fewer than `max` run. With
/// every worker busy and `max` running, jobs stay queued, and the next
/// worker to finish takes everything queued as one batch. A worker free
/// for `PostgresLimits::connection_idle_timeout` is ended, which closes its
/// connection; so a lone sequential caller is served by one connection,
/// and a burst opens up to `max`, which shrink back once it passes.
///
/// Returns once the queue is closed (the engine dropped) and every worker
/// has finished its work in hand.
async fn pool(shared: Arc<Shared>, mut queue: UnboundedReceiver<Queued>, max: usize) {
    let idle_timeout = shared.limits.connection_idle_timeout;
    let mut tasks = tokio::task::JoinSet::new();
    let (free_tx, mut free_rx) = unbounded_channel::<usize>();
    let mut slots: Vec<Option<Worker>> = Vec::new();
    // Free workers (slot, since when), the most recently freed last.
    let mut free: Vec<(usize, Instant)> = Vec::new();
    let mut running: usize = 0;
    let mut held: Option<Queued> = None;
    loop {
        let can_take = !free.is_empty() || running < max;
        let retire_at = free
            .first()
            .and_then(|(_, since)| since.checked_add(idle_timeout));
        let event: PoolEvent = {
            let next_job = async {
                match held.take() {
                    Some(queued) => Some(queued),
                    None => queue.recv().await,
                }
            };
            let retire = async {
                match retire_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                Some(slot) = free_rx.recv() => PoolEvent::Free(slot),
                Some(Err(e)) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    PoolEvent::Ended(e.id())
                }
                job = next_job, if can_take => PoolEvent::Job(job),
                () = retire, if retire_at.is_some() => PoolEvent::Retire,
            }
        };
        match event {
            PoolEvent::Free(slot) => {
                if slots.get(slot).is_some_and(Option::is_some) {
                    free.push((slot, Instant::now()));
                }
            }
            PoolEvent::Retire => {
                if !free.is_empty() {
                    let (slot, _) = free.remove(0);
                    if let Some(s) = slots.get_mut(slot) {
                        *s = None;
                        running = running.saturating_sub(1);
                    }
                }
            }
            PoolEvent::Ended(task) => {
                // A worker ends on its own only if it panicked: its slot
                // is freed so that another can be opened in its place.
                if let Some(slot) = slots
                    .iter()
                    .position(|s| s.as_ref().is_some_and(|s| s.task == task))
                {
                    slots[slot] = None;
                    free.retain(|(s, _)| *s != slot);
                    running = running.saturating_sub(1);
                }
            }
            PoolEvent::Job(None) => break,
            PoolEvent::Job(Some(first)) => {
                let Some(mut work) = take_work(first, &mut queue, &mut held) else {
                    continue;
                };
                // A free worker, the most recently freed first; else a new
                // one (room for it was checked before taking the job).
                loop {
                    let Some(slot) = free.pop().map(|(slot, _)| slot).or_else(|| {
                        (running < max).then(|| {
                            let (tx, rx) = unbounded_channel();
                            let at = slots.iter().position(Option::is_none);
                            let slot = at.unwrap_or(slots.len());
                            let handle =
                                tasks.spawn(worker(Arc::clone(&shared), slot, rx, free_tx.clone()));
                            let new = Some(Worker {
                                work: tx,
                                task: handle.id(),
                            });
                            match at {
                                Some(i) => slots[i] = new,
                                None => slots.push(new),
                            }
                            running = running.saturating_add(1);
                            slot
                        })
                    }) else {
                        // Unreachable while `can_take` holds; answered
                        // rather than lost.
                        fail_work(work, || Error::Unavailable {
                            detail: "no worker of the PostgreSQL engine could take the call".into(),
                        });
                        break;
                    };
                    let Some(s) = slots.get(slot).and_then(Option::as_ref) else {
                        continue;
                    };
                    match s.work.send(work) {
                        Ok(()) => break,
                        // The worker is gone (its end not yet seen): its
                        // slot is freed and the work handed to another.
                        Err(back) => {
                            work = back.0;
                            slots[slot] = None;
                            running = running.saturating_sub(1);
                        }
                    }
                }
            }
        }
    }
    // Closing: the free workers end at once, the busy ones after their
    // work in hand.
    drop(slots);
    while tasks.join_next().await.is_some() {}
}

/// Answers every call of `work` with the error `error` makes.
fn fail_work(work: Work, error: impl Fn() -> Error) {
    match work {
        Work::Batch { replies, .. } => {
            for tx in replies {
                let _ = tx.send(Err(error()));
            }
        }
        Work::One(queued) => queued.job.fail(error()),
    }
}

/// One worker of the [`pool`]: runs the work it is handed on its
/// connection (opened on first use, and again after a failure) and says
/// when it is free. Every job runs under its call's deadline: one whose
/// deadline passes while it runs has its connection dropped and is
/// answered `Unavailable` before its `COMMIT` was sent, `OutcomeUnknown`
/// after. Ends, closing its connection, when the pool drops its sender.
async fn worker(
    shared: Arc<Shared>,
    slot: usize,
    mut work: UnboundedReceiver<Work>,
    free: UnboundedSender<usize>,
) {
    let mut conn: Option<Conn> = None;
    while let Some(w) = work.recv().await {
        match w {
            Work::Batch {
                ops,
                hot_ok,
                replies,
                permits,
                deadlines,
                due,
            } => {
                let calls = Calls { replies, deadlines };
                run_apply(&shared, &mut conn, due, (ops, hot_ok), calls).await;
                drop(permits);
            }
            Work::One(queued) => run_job(&shared, &mut conn, queued).await,
        }
        if free.send(slot).is_err() {
            return;
        }
    }
}

/// The callers of a batch's requests, in the requests' order.
struct Calls {
    /// Each request's answer channel.
    replies: Vec<oneshot::Sender<Result<Reply>>>,
    /// Each request's deadline (its call's).
    deadlines: Vec<Instant>,
}

/// Runs a batch of requests under its deadline: the hot path first (its
/// answers given at once), then the rest in one general transaction; if
/// that transaction is refused a lock it waited for past `lock_timeout`
/// while it held requests of more than one key, those requests are run
/// again a key at a time ([`run_apart`]).
async fn run_apply(
    shared: &Shared,
    conn: &mut Option<Conn>,
    due: Instant,
    (batch, hot_ok): (Vec<(Key, Op)>, Vec<bool>),
    Calls { replies, deadlines }: Calls,
) {
    not_committing(conn);
    let run = run_hot(shared, conn, &batch, &hot_ok);
    let HotRun {
        answers: hot,
        locked,
        rejected,
    } = match tokio::time::timeout_at(due.into(), run).await {
        Ok(Ok(hot)) => hot,
        Ok(Err(f)) => {
            recover(conn, &f).await;
            for tx in replies {
                let _ = tx.send(Err(f.error()));
            }
            return;
        }
        Err(_) => {
            let f = expire(conn);
            for tx in replies {
                let _ = tx.send(Err(f.error()));
            }
            return;
        }
    };
    let mut rest = Vec::new();
    let mut rest_calls = Calls {
        replies: Vec::new(),
        deadlines: Vec::new(),
    };
    for (((op, tx), deadline), answer) in batch.into_iter().zip(replies).zip(deadlines).zip(hot) {
        match answer {
            Some(answer) => {
                let _ = tx.send(answer);
            }
            None => {
                rest.push(op);
                rest_calls.replies.push(tx);
                rest_calls.deadlines.push(deadline);
            }
        }
    }
    if rest.is_empty() {
        return;
    }
    // A hot statement refused a lock applied nothing: its requests (and
    // the others left) would wait for that lock again in one transaction.
    if let Some(first) = locked.filter(|_| !one_key(&rest)) {
        let why = waited_for_a_lock(&first);
        split_group_commit(shared, conn, (rest, rest_calls), &why, SPLIT_WAITS).await;
        return;
    }
    // A hot statement refused for a reason met again: the general
    // transaction of the whole batch would be refused too.
    if let Some(first) = rejected.filter(|_| !one_key(&rest)) {
        let why = was_refused(&first);
        split_group_commit(shared, conn, (rest, rest_calls), &why, Waits::default()).await;
        return;
    }
    let started = Instant::now();
    let result = until(due, conn, async |c| {
        run_batch(shared, c, &rest, None, Waits::default()).await
    })
    .await;
    match result {
        // Nothing was applied (the transaction was rolled back), so every
        // request can run again, a pure read too; the tokens the attempt
        // drew are skipped (a sequence value is never handed out twice).
        // A refusal met again may be one key's own (a trigger that refuses
        // one row, a damaged page): the other keys must not be answered
        // with it, which would tell their callers not to retry.
        Err(Fail::Locked(first)) if !one_key(&rest) => {
            let why = waited_for_a_lock(&first);
            split_group_commit(shared, conn, (rest, rest_calls), &why, SPLIT_WAITS).await;
        }
        Err(Fail::Rejected(first, _)) if !one_key(&rest) => {
            let why = was_refused(&first);
            split_group_commit(shared, conn, (rest, rest_calls), &why, Waits::default()).await;
        }
        result => answer_general(shared, &rest, rest_calls.replies, result, started),
    }
}

/// Answers the requests `ops` of a general transaction, remembering the
/// records it wrote for the hot path.
fn answer_general(
    shared: &Shared,
    ops: &[(Key, Op)],
    replies: Vec<oneshot::Sender<Result<Reply>>>,
    result: Result<Decisions, Fail>,
    started: Instant,
) {
    if let Ok((answers, _)) = &result {
        shared.remember(ops, answers);
    }
    answer_batch(shared, replies, result, started);
}

/// A request of a batch with its caller: the request, its answer channel
/// and its deadline (the call's).
type Call = ((Key, Op), oneshot::Sender<Result<Reply>>, Instant);

/// The longest a transaction of [`run_apart`] waits for a lock: long enough
/// for another batch of the engine's own to commit on a loaded server,
/// short against `lock_timeout`.
const SPLIT_LOCK_WAIT: Duration = Duration::from_millis(500);

/// The bounds of a transaction of [`run_apart`] for a group commit.
const SPLIT_WAITS: Waits = Waits {
    lock: Some(SPLIT_LOCK_WAIT),
    idle: None,
};

/// [`run_apart`] for a group commit refused a lock (each transaction under
/// [`SPLIT_WAITS`]: the locked requests already waited `lock_timeout`) or
/// refused for a reason met again (under the session's own bounds), with
/// the cut-offs.
async fn split_group_commit(
    shared: &Shared,
    conn: &mut Option<Conn>,
    batch: (Vec<(Key, Op)>, Calls),
    why: &str,
    waits: Waits,
) {
    run_apart(shared, conn, batch, why, (waits, true)).await;
}

/// Why a batch runs again a key at a time: a lock wait past
/// `lock_timeout` (`first`, the server's words), for [`run_apart`].
fn waited_for_a_lock(first: &str) -> String {
    format!("its batch waited for a lock held by another session ({first})")
}

/// Why a batch runs again a key at a time: a refusal met again (`first`,
/// the server's words), for [`run_apart`].
fn was_refused(first: &str) -> String {
    format!("its batch was refused ({first}) and run again a key at a time")
}

/// Runs the requests of a [`Job::Many`] that was refused a lock (or
/// refused for a reason met again) again, a key at a time ([`run_apart`],
/// each transaction under `waits` and `due`), and gathers their answers in
/// order; `why` as [`run_apart`]'s.
async fn apart_answers(
    shared: &Shared,
    conn: &mut Option<Conn>,
    ops: Vec<(Key, Op)>,
    due: Instant,
    waits: Waits,
    why: &str,
) -> Vec<Result<Reply>> {
    let (senders, receivers): (Vec<_>, Vec<_>) = ops.iter().map(|_| oneshot::channel()).unzip();
    let calls = Calls {
        replies: senders,
        deadlines: vec![due; ops.len()],
    };
    run_apart(shared, conn, (ops, calls), why, (waits, false)).await;
    let mut answers = Vec::with_capacity(receivers.len());
    for rx in receivers {
        answers.push(rx.await.unwrap_or_else(|_| {
            Err(Error::Storage(
                "no answer to a request run on its own".into(),
            ))
        }));
    }
    answers
}

/// Whether every request of `ops` is on one key (a batch of one, say).
fn one_key(ops: &[(Key, Op)]) -> bool {
    ops.split_first()
        .is_none_or(|((first, _), others)| others.iter().all(|(k, _)| k == first))
}

/// Runs the requests of a batch that was refused a lock past
/// `lock_timeout`, or refused for a reason met again ([`Fail::Rejected`]),
/// (nothing of it applied) again, those of each key in a transaction of
/// their own, so that a row held by another session (a caller's open
/// `complete_in` transaction, any `SELECT … FOR UPDATE`) fails only the
/// requests that need it, with the lock wait's `Unavailable`, and a
/// refusal that is one key's own (a trigger that refuses its row, a
/// damaged page) only that key's, and not those of other keys that were
/// group-committed with them. `why` says why the batch runs again, for
/// the requests whose deadline passes meanwhile.
///
/// The keys run one after another in the order of their first request,
/// each key's requests in arrival order (a later request on a key sees an
/// earlier one, as in the batch), each transaction under the earliest
/// deadline of its requests: a request whose deadline passed before its
/// key's turn is answered `Unavailable` (its deadline passed, with
/// `why`; left out), those of a transaction whose deadline passes while it
/// runs as a batch whose deadline passed.
///
/// Each of these transactions runs under `waits`: a group commit's wait
/// for a lock, after a lock wait, at most [`SPLIT_LOCK_WAIT`] or the
/// session's `lock_timeout`, the shorter (the locked requests already
/// waited `lock_timeout`), after a refusal met again the session's own; a
/// lease renewal batch's as long as its batch waited
/// ([`renewal_lock_wait`]). With `cut_off` (a group commit), once two
/// keys in a row are refused a lock, the sign of a lock every key waits
/// for (a lock on the whole table, or the token lock an import holds), or
/// the refused keys' waits add up to `lock_timeout`, the keys after them
/// are answered as refused (the last lock refusal's words say why)
/// without running: such locks hold the worker at most about one
/// `lock_timeout` more, not one short wait per key. Likewise once two
/// keys in a row are refused with the same words for a reason met again
/// (a trigger that refuses every row, a constraint no row passes): the
/// keys after them are not run (rather than one transaction per key of
/// every batch) and answered `Unavailable`, not that refusal, which may
/// not be theirs (the words name a trigger or a page, not a row): sent
/// again, each is decided in a batch of its own time. A renewal batch
/// has no cut-off: its deadline bounds it, and each key's renewal that
/// runs before the deadline is decided (each locked row costs a quarter
/// of the batch's time, so behind several the later leases miss the
/// deadline and are tried again; a lease whose renewal was answered with
/// another key's refusal would lapse while its work runs).
async fn run_apart(
    shared: &Shared,
    conn: &mut Option<Conn>,
    (ops, calls): (Vec<(Key, Op)>, Calls),
    why: &str,
    (waits, cut_off): (Waits, bool),
) {
    let mut refused_in_a_row = 0u32;
    // The last lock refusal's words, for the keys the cut-off answers.
    let mut last_refusal = String::new();
    // The last refusal met again (its words) and how many keys in a row
    // met it.
    let mut rejected: Option<(String, u32)> = None;
    let mut refused_wait = Duration::ZERO;
    let lock_timeout = shared.limits.lock_timeout;
    // Each key's requests (places in `ops`), keys in the order of their
    // first request.
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of: HashMap<&Key, usize> = HashMap::new();
    for (at, (key, _)) in ops.iter().enumerate() {
        match group_of.get(key) {
            Some(&g) => {
                if let Some(group) = groups.get_mut(g) {
                    group.push(at);
                }
            }
            None => {
                group_of.insert(key, groups.len());
                groups.push(vec![at]);
            }
        }
    }
    drop(group_of);
    // The keys a cut-off left not run before go first (a stable sort: the
    // others keep their order), so that each is decided.
    let mut groups: Vec<(bool, Vec<usize>)> = {
        let not_run = shared.not_run.lock();
        groups
            .into_iter()
            .map(|group| {
                let owed = group
                    .first()
                    .and_then(|&at| ops.get(at))
                    .is_some_and(|(key, _)| not_run.contains(key));
                (owed, group)
            })
            .collect()
    };
    groups.sort_by_key(|(owed, _)| !owed);
    // Each request once, taken by its key's turn.
    let mut pending: Vec<Option<Call>> = ops
        .into_iter()
        .zip(calls.replies)
        .zip(calls.deadlines)
        .map(|((op, tx), deadline)| Some((op, tx, deadline)))
        .collect();
    for (owed, group) in groups {
        let mut group_ops = Vec::with_capacity(group.len());
        let mut group_replies = Vec::with_capacity(group.len());
        let mut due: Option<Instant> = None;
        let now = Instant::now();
        for at in group {
            let Some((op, tx, deadline)) = pending.get_mut(at).and_then(Option::take) else {
                continue;
            };
            if deadline <= now {
                let _ = tx.send(Err(Error::Unavailable {
                    detail: format!("the call's deadline passed while {why}"),
                }));
                continue;
            }
            group_ops.push(op);
            group_replies.push(tx);
            due = Some(due.map_or(deadline, |d| d.min(deadline)));
        }
        let Some(due) = due else { continue };
        let started = Instant::now();
        if cut_off && (refused_in_a_row >= 2 || refused_wait >= lock_timeout) {
            let refused = Fail::Locked(format!(
                "{last_refusal}; run again a key at a time, other keys were refused a lock too \
                 (two in a row, or lock_timeout in all), so this key's requests were not run \
                 again"
            ));
            answer_batch(shared, group_replies, Err(refused), started);
            continue;
        }
        let key = group_ops.first().map(|(key, _)| key.clone());
        let cut = rejected
            .as_ref()
            .filter(|(_, n)| cut_off && !owed && *n >= 2)
            .and_then(|r| {
                let mut not_run = shared.not_run.lock();
                let room = not_run.len() < NOT_RUN_MAX;
                if room && let Some(key) = &key {
                    not_run.insert(key.clone());
                }
                room.then_some(r)
            });
        if let Some((detail, _)) = cut {
            // Not this key's refusal (its row may be sound): answered as
            // one that passes, so that its caller sends it again; in a
            // batch that is split, it then runs first (`not_run`).
            let refused = Fail::Refused(format!(
                "not run: its batch was refused, and run again a key at a time the two keys \
                 before this one were refused with the same words ({detail}), so the rest \
                 were not run again; send it again"
            ));
            answer_batch(shared, group_replies, Err(refused), started);
            continue;
        }
        let result = until(due, conn, async |c| {
            run_batch(shared, c, &group_ops, None, waits).await
        })
        .await;
        refused_in_a_row = match &result {
            Err(Fail::Locked(detail)) => {
                refused_wait = refused_wait.saturating_add(started.elapsed());
                last_refusal.clone_from(detail);
                refused_in_a_row.saturating_add(1)
            }
            _ => 0,
        };
        rejected = match (&result, rejected.take()) {
            (Err(Fail::Rejected(detail, _)), Some((last, n))) if *detail == last => {
                Some((last, n.saturating_add(1)))
            }
            (Err(Fail::Rejected(detail, _)), _) => Some((detail.clone(), 1)),
            _ => None,
        };
        if owed && let Some(key) = &key {
            shared.not_run.lock().remove(key);
        }
        answer_general(shared, &group_ops, group_replies, result, started);
    }
}

/// Marks the connection as not committing, before a job starts on it.
fn not_committing(slot: &Option<Conn>) {
    if let Some(c) = slot {
        c.commit_sent.store(false, Ordering::SeqCst);
    }
}

/// Runs `work` on the worker's connection until `due`; past it, the
/// connection is dropped and the failure says whether the commit was sent.
async fn until<T>(
    due: Instant,
    conn: &mut Option<Conn>,
    work: impl AsyncFnOnce(&mut Option<Conn>) -> Result<T, Fail>,
) -> Result<T, Fail> {
    not_committing(conn);
    match tokio::time::timeout_at(due.into(), work(conn)).await {
        Ok(result) => result,
        Err(_) => Err(expire(conn)),
    }
}

/// Runs a job other than a group-committed request, under its deadline.
async fn run_job(shared: &Shared, conn: &mut Option<Conn>, queued: Queued) {
    let Queued {
        job,
        deadline: due,
        permit,
    } = queued;
    if due <= Instant::now() {
        job.fail(expired_in_queue());
        return;
    }
    match job {
        Job::Apply { key, op, reply, .. } => {
            let started = Instant::now();
            let ops = [(key, op)];
            let result = until(due, conn, async |c| {
                run_batch(shared, c, &ops, None, Waits::default()).await
            })
            .await;
            answer_general(shared, &ops, vec![reply], result, started);
        }
        Job::Many {
            ops,
            token_floor,
            lock_wait,
            own_deadline,
            reply,
        } => {
            let started = Instant::now();
            let waits = Waits {
                lock: lock_wait,
                idle: own_deadline.then(|| idle_wait(due, started)),
            };
            let result = until(due, conn, async |c| {
                run_batch(shared, c, &ops, token_floor, waits).await
            })
            .await;
            let answer = match result {
                // Nothing was applied: each key's requests run again on
                // their own, so that a row held by another session fails
                // only the renewal that needs it.
                Err(Fail::Locked(first)) if lock_wait.is_some() && !one_key(&ops) => {
                    let why = waited_for_a_lock(&first);
                    Ok(apart_answers(shared, conn, ops, due, waits, &why).await)
                }
                // A refusal met again may be one key's own: the renewals of
                // the other leases must go on (a lease not renewed lapses,
                // and another caller may take its key over).
                Err(Fail::Rejected(first, _)) if lock_wait.is_some() && !one_key(&ops) => {
                    let why = was_refused(&first);
                    Ok(apart_answers(shared, conn, ops, due, waits, &why).await)
                }
                Ok((answers, events)) => {
                    shared.remember(&ops, &answers);
                    shared.counters.publish(events);
                    let writes = crate::record::writes(&answers);
                    shared.counters.group_commit(started.elapsed(), writes);
                    Ok(answers)
                }
                Err(f) => Err(f.error()),
            };
            let _ = reply.send(answer);
        }
        Job::Get { key, reply } => {
            let got = until(due, conn, async |c| Ok(run_get(shared, c, &key).await)).await;
            let _ = reply.send(got.unwrap_or_else(|f| Err(f.error())));
        }
        Job::Sweep { max, reply } => {
            let swept = until(due, conn, async |c| Ok(run_sweep(shared, c, max).await)).await;
            let _ = reply.send(swept.unwrap_or_else(|f| Err(f.error())));
        }
        Job::Now { reply } => {
            let read = until(
                due,
                conn,
                async |c| Ok(run_read(shared, c, read_time).await),
            )
            .await;
            let _ = reply.send(read.unwrap_or_else(|f| Err(f.error())));
        }
        Job::NextToken { reply } => {
            let read = until(due, conn, async |c| {
                Ok(run_read(shared, c, read_next_token).await)
            })
            .await;
            let _ = reply.send(read.unwrap_or_else(|f| Err(f.error())));
        }
        Job::Len { reply } => {
            let read = until(due, conn, async |c| Ok(run_read(shared, c, read_len).await)).await;
            let _ = reply.send(read.unwrap_or_else(|f| Err(f.error())));
        }
        Job::Counts { now_ms, reply } => {
            let read = until(due, conn, async |c| {
                Ok(run_read(shared, c, async |s, c| {
                    let now = match now_ms {
                        Some(now) => now,
                        None => read_time(s, c).await?,
                    };
                    let (counts, oldest) = read_counts(s, c, now).await?;
                    Ok((now, counts, oldest))
                })
                .await)
            })
            .await;
            let _ = reply.send(read.unwrap_or_else(|f| Err(f.error())));
        }
    }
    drop(permit);
}

/// The settings of every session the engine opens, as (name, value), given
/// as startup `options` on a direct connection and as `SET` statements
/// after connecting through a pooler in session mode (PgBouncer refuses
/// `options`), from this one list so that the two cannot differ:
/// - `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout`
///   (ms): the limits (see `PostgresLimits`), so that the server ends what a
///   caller gave up on.
/// - `plan_cache_mode = force_generic_plan`: the statements' array
///   parameters would otherwise be planned again on every call (a custom
///   plan looks cheaper for a one-element array than the generic plan's
///   estimate).
/// - `enable_seqscan = off`: every statement of the engine finds its rows
///   through an index (the key, a binding, the expiry); a generic plan made
///   while a table is new and small would otherwise scan it in full for as
///   long as the connection lives.
fn session_settings(limits: &PostgresLimits) -> [(&'static str, String); 5] {
    let ms = |d: Duration| d.as_millis().to_string();
    [
        ("statement_timeout", ms(limits.statement_timeout)),
        ("lock_timeout", ms(limits.lock_timeout)),
        (
            "idle_in_transaction_session_timeout",
            ms(limits.idle_in_transaction_timeout),
        ),
        ("plan_cache_mode", "force_generic_plan".to_owned()),
        ("enable_seqscan", "off".to_owned()),
    ]
}

/// The settings of every session the engine opens that the URL's `options`
/// cannot change: sent after them (a later setting wins).
/// - `row_security = off`: a statement that a row-level security policy
///   would filter fails instead (42501, "query would be affected by
///   row-level security policy"), answered as a damaged schema: a row
///   hidden from the store would make a held key or business key look
///   free, and a claim would acquire it again (a connect refuses such a
///   schema; this covers a policy enabled while the store runs). A role
///   the policy does not apply to (a superuser, `BYPASSRLS`, the tables'
///   owner without `FORCE`) runs as before.
const ENFORCED_SETTINGS: [(&str, &str); 1] = [("row_security", "off")];

/// The settings that `options` (libpq's `options` parameter) gives, with
/// `-c name=value`, `-cname=value` or `--name=value`, in order, as the
/// server reads them: words split at spaces that no `\` escapes, names
/// in lower case with `-` read as `_`, values as written. Other words are
/// skipped.
fn option_settings(options: &str) -> Vec<(String, String)> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => word.extend(chars.next()),
            // The server splits at `isspace`, vertical tab included.
            c if c.is_ascii_whitespace() || c == '\x0b' => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut settings = Vec::new();
    let mut words = words.into_iter();
    while let Some(w) = words.next() {
        let setting = match w.as_str() {
            "-c" => words.next(),
            _ => w
                .strip_prefix("-c")
                .or_else(|| w.strip_prefix("--"))
                .map(str::to_owned),
        };
        if let Some((name, value)) = setting.as_deref().and_then(|s| s.split_once('=')) {
            settings.push((
                name.to_ascii_lowercase().replace('-', "_"),
                value.to_owned(),
            ));
        }
    }
    settings
}

/// `text` as an SQL string literal that reads the same whatever
/// `standard_conforming_strings` is: `E'…'` with `\` and `'` doubled.
fn sql_literal(text: &str) -> String {
    format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

impl Postgres {
    /// Connects to the database at `url` (a `postgresql://` URL or a
    /// `key=value` connection string), checks the schema's version with one
    /// read (no DDL when it is current), creates the schema when it holds
    /// no store (or runs the DDL whatever its version with
    /// `options.migrate`), and starts the driver thread.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad URL, schema name, retention or
    /// connection count; [`Error::Unavailable`] when the server cannot be
    /// reached; [`Error::Misconfigured`] for a configuration fault (a
    /// schema written by a newer version, a schema to create that this
    /// role may not create, a missing grant, …);
    /// [`Error::IncompatibleSchema`] for malformed meta rows.
    pub(crate) fn connect(url: &str, options: PgOptions) -> Result<Postgres> {
        let sql = Sql::new(&options.schema)?;
        if options.retention_ms == 0 {
            return Err(Error::invalid("retention", "must be > 0"));
        }
        if options.connections == 0 {
            return Err(Error::invalid("connections", "must be > 0"));
        }
        let parsed = tls::parse(url)?;
        let mut config: tokio_postgres::Config =
            parsed.rest.parse().map_err(|e: tokio_postgres::Error| {
                // tokio-postgres names an unknown option by its keyword, which
                // may be a word of an unquoted password: not shown.
                let said = e.source().map(|s| s.to_string()).unwrap_or_default();
                let reason = if said.starts_with("unknown option") {
                    "an option tokio-postgres does not know (its name is not shown: it may be \
                 part of a password that holds a space and needs quotes)"
                        .to_string()
                } else {
                    e.to_string()
                };
                Error::invalid(
                    "url",
                    format!("not a PostgreSQL connection string: {reason}"),
                )
            })?;
        config.ssl_mode(tls::pg_mode(parsed.mode));
        let tls = tls::connector(&parsed)?;
        if config.get_application_name().is_none() {
            config.application_name("idemstore");
        }
        options.limits.check()?;
        let limits = options.limits;
        // What the URL sets wins; the limits fill in the rest.
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(limits.connect_timeout);
        }
        // tokio-postgres's default idle time (2 hours) stands for unset.
        if config.get_keepalives() && config.get_keepalives_idle() == Duration::from_secs(2 * 3600)
        {
            config.keepalives_idle(limits.keepalive_idle);
            config.keepalives_interval(KEEPALIVE_INTERVAL);
            config.keepalives_retries(KEEPALIVE_RETRIES);
        }
        let settings = session_settings(&limits);
        let session_set = match options.pooler {
            PostgresPooler::Direct => {
                let words: Vec<String> = settings
                    .iter()
                    .map(|(name, value)| format!("-c {name}={value}"))
                    .chain(config.get_options().map(str::to_owned))
                    .chain(
                        ENFORCED_SETTINGS
                            .iter()
                            .map(|(name, value)| format!("-c {name}={value}")),
                    )
                    .collect();
                config.options(words.join(" "));
                None
            }
            // PgBouncer refuses the startup parameter `options` (or, told
            // to ignore it, drops it): the limits are set after connecting,
            // and then each setting the URL's `options` gives, again, so
            // that the URL wins here too whether or not the pooler passed
            // the startup parameter on; the enforced settings last.
            PostgresPooler::Session => {
                let mut set: Vec<String> = settings
                    .iter()
                    .map(|(name, value)| format!("SET {name} = {value}"))
                    .collect();
                // A setting only a session's start can set (`log_connections`,
                // `ignore_system_indexes`) is left as the start left it:
                // `set_config` would refuse it (55P02) on every connect.
                for (name, value) in config
                    .get_options()
                    .map(option_settings)
                    .unwrap_or_default()
                {
                    let (name, value) = (sql_literal(&name), sql_literal(&value));
                    set.push(format!(
                        "SELECT pg_catalog.set_config({name}, {value}, false) WHERE NOT EXISTS \
                         (SELECT 1 FROM pg_catalog.pg_settings WHERE name = {name} \
                         AND context NOT IN ('user', 'superuser'))"
                    ));
                }
                set.extend(
                    ENFORCED_SETTINGS
                        .iter()
                        .map(|(name, value)| format!("SET {name} = {value}")),
                );
                Some(set.join("; "))
            }
            PostgresPooler::Transaction => {
                return Err(Error::invalid(
                    "postgres_pooler",
                    "transaction pooling is not supported by this build: the engine prepares \
                     its statements once per connection and sets session limits, which a \
                     pooler in transaction mode does not keep; point the store at a pool in \
                     session mode (PostgresPooler::Session)",
                ));
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::storage)?;
        let handle = runtime.handle().clone();
        let shared = Arc::new(Shared {
            sql,
            config,
            tls,
            clock: options.clock,
            retention_ms: options.retention_ms,
            must_exist: options.must_exist,
            migrate: options.migrate,
            limits: options.limits,
            session_set,
            last_reading: AtomicU64::new(0),
            counters: LiveCounters::new(),
            held: parking_lot::Mutex::new(HashMap::new()),
            not_run: parking_lot::Mutex::new(std::collections::HashSet::new()),
        });
        let (jobs, queue) = unbounded_channel();
        let max = options.connections;
        let driver_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("idemstore-postgres".into())
            .spawn(move || runtime.block_on(pool(driver_shared, queue, max)))
            .map_err(Error::storage)?;
        let mut pg = Postgres {
            shared: Arc::clone(&shared),
            jobs: Some(jobs),
            room: Arc::new(tokio::sync::Semaphore::new(limits.queue)),
            handle,
            scans: Arc::new(ScanRoom::new(limits.scans)),
            store_id: 0,
            found: Found::Current,
            thread: Some(thread),
            direct: (0..DIRECT_CONNECTIONS)
                .map(|_| parking_lot::Mutex::new(DirectConn::new()))
                .collect(),
            direct_opened: Arc::new(tokio::sync::Notify::new()),
        };
        pg.handle.spawn(close_idle_direct(
            Arc::downgrade(&pg.direct),
            Arc::clone(&pg.direct_opened),
            limits.connection_idle_timeout,
        ));
        let (tx, rx) = oneshot::channel();
        let due = tokio::time::Instant::now() + limits.call_timeout;
        pg.handle.spawn(async move {
            let done = match tokio::time::timeout_at(due, setup(&shared)).await {
                Ok(done) => done,
                Err(_) => Err(Error::Unavailable {
                    detail: "connecting took longer than PostgresLimits::call_timeout".into(),
                }),
            };
            let _ = tx.send(done);
        });
        let (id, found) = rx.recv().map_err(|_| Error::Closed)??;
        pg.store_id = id;
        pg.found = found;
        Ok(pg)
    }

    /// What connecting found the schema to be (current, or created by
    /// this connection).
    pub(crate) fn found(&self) -> Found {
        self.found
    }

    /// Sends `job` to the driver thread, with the call's deadline
    /// (`call_timeout` from now). When the queue is full, a task on the
    /// driver thread waits for room until the deadline, then answers the
    /// job [`Error::Unavailable`]; the caller waits on the job's answer
    /// either way.
    fn send(&self, job: Job) -> Result<()> {
        self.send_by(job, self.deadline())
    }

    /// The deadline of a call made now: `call_timeout` from now.
    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.shared.limits.call_timeout)
            .unwrap_or(now)
    }

    /// [`Postgres::send`] under a deadline the call already has (a call
    /// the hot path tried first keeps the deadline it was made with).
    fn send_by(&self, job: Job, deadline: Instant) -> Result<()> {
        let jobs = self.jobs.as_ref().ok_or(Error::Closed)?;
        match Arc::clone(&self.room).try_acquire_owned() {
            Ok(permit) => jobs
                .send(Queued {
                    job,
                    deadline,
                    permit,
                })
                .map_err(|_| Error::Closed),
            Err(tokio::sync::TryAcquireError::Closed) => Err(Error::Closed),
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                let jobs = jobs.clone();
                let room = Arc::clone(&self.room);
                self.handle.spawn(async move {
                    let waited = tokio::time::timeout_at(deadline.into(), room.acquire_owned());
                    match waited.await {
                        Ok(Ok(permit)) => {
                            let queued = Queued {
                                job,
                                deadline,
                                permit,
                            };
                            if let Err(back) = jobs.send(queued) {
                                back.0.job.fail(Error::Closed);
                            }
                        }
                        Ok(Err(_)) => job.fail(Error::Closed),
                        Err(_) => job.fail(Error::Unavailable {
                            detail: "the engine's queue stayed full until the call's deadline \
                                     (PostgresLimits::queue, call_timeout)"
                                .into(),
                        }),
                    }
                });
                Ok(())
            }
        }
    }

    /// Sends a job built around a reply channel and waits for the answer.
    fn ask<T>(&self, job: impl FnOnce(oneshot::Sender<Result<T>>) -> Job) -> Result<T> {
        self.ask_by(self.deadline(), job)
    }

    /// [`Postgres::ask`] under a deadline the call already has.
    fn ask_by<T>(
        &self,
        deadline: Instant,
        job: impl FnOnce(oneshot::Sender<Result<T>>) -> Job,
    ) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.send_by(job(tx), deadline)?;
        rx.recv().map_err(|_| Error::Closed)?
    }

    /// The store's time: the database's `clock_timestamp()` (or the test
    /// clock), as read (it steps back with that clock).
    pub(crate) fn now_ms(&self) -> Result<u64> {
        self.ask(|reply| Job::Now { reply })
    }

    /// Applies one request, group-committed with the requests of other
    /// threads; blocks until its transaction commits.
    ///
    /// # Errors
    /// The transition's own errors (per request), [`Error::Unavailable`],
    /// [`Error::OutcomeUnknown`], [`Error::Storage`].
    pub(crate) fn apply(&self, key: &Key, op: Op) -> Result<Reply> {
        self.apply_within(key, op, self.deadline(), false)
    }

    /// [`Postgres::apply`] under `deadline` when it comes before
    /// `call_timeout` from now (see [`Postgres::apply_many_by`]); then, past
    /// the hot path, in a transaction of its own ([`alone`]).
    pub(crate) fn apply_by(&self, key: &Key, op: Op, deadline: Instant) -> Result<Reply> {
        let full = self.deadline();
        self.apply_within(key, op, deadline.min(full), deadline < full)
    }

    /// [`Postgres::apply`] under `deadline`: group-committed past the hot
    /// path, or with `shortened` (a deadline the caller set before
    /// `call_timeout`) in a transaction of its own, which holds no other
    /// caller's request to that deadline. (A plain call's deadline is
    /// `call_timeout` from when it was made, never read again here: read
    /// again, it would be a little later, and every call would look
    /// shortened and lose its group commit.)
    fn apply_within(&self, key: &Key, op: Op, deadline: Instant, shortened: bool) -> Result<Reply> {
        // One deadline for the whole call: a request the hot path left
        // undecided (a lock or statement timeout refused it) is queued
        // with what is left of it, not a fresh `call_timeout`.
        let hot = match self.apply_direct(key, &op, deadline) {
            Direct::Answered(answer) => return answer,
            Direct::Undecided => false,
            Direct::Busy => true,
            Direct::Rejected => {
                return only_reply(self.ask_by(deadline, |reply| alone(key, op, reply))?);
            }
        };
        if shortened {
            return only_reply(self.ask_by(deadline, |reply| alone(key, op, reply))?);
        }
        self.ask_by(deadline, |reply| Job::Apply {
            key: key.clone(),
            op,
            hot,
            reply,
        })
    }

    /// Runs a request the hot path may decide on the calling thread, over
    /// a free direct connection, with no hand-off to the driver thread (a
    /// lone caller then waits on its own socket, as a hand-written client
    /// does). Not from inside an async runtime (its thread must not
    /// block), nor when every direct connection is in use.
    fn apply_direct(&self, key: &Key, op: &Op, due: Instant) -> Direct {
        if !matches!(op, Op::Claim { .. } | Op::Complete { .. } | Op::Fail { .. })
            || tokio::runtime::Handle::try_current().is_ok()
        {
            return Direct::Busy;
        }
        let Some(mut guard) = self.direct.iter().find_map(|d| d.try_lock()) else {
            return Direct::Busy;
        };
        let DirectConn {
            runtime,
            conn,
            used,
        } = &mut *guard;
        if runtime.is_none() {
            // Built here, on the caller's thread, outside any runtime.
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => *runtime = Some(rt),
                Err(_) => return Direct::Busy,
            }
        }
        let Some(runtime) = runtime.as_ref() else {
            return Direct::Busy;
        };
        let shared = &*self.shared;
        let ops = [(key.clone(), op.clone())];
        let answer = runtime.block_on(async {
            // Lets the connection's task see a connection closed while it
            // was idle, so that it is opened again instead of used (a
            // statement sent on it would have an unknown outcome): the
            // first yield polls the I/O driver, which wakes the task; the
            // second lets it run.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            not_committing(conn);
            match tokio::time::timeout_at(due.into(), run_hot(shared, conn, &ops, &[true])).await {
                Ok(Ok(mut hot)) => match hot.answers.pop().flatten() {
                    Some(answer) => Direct::Answered(answer),
                    None if hot.rejected.is_some() => Direct::Rejected,
                    None => Direct::Undecided,
                },
                Ok(Err(f)) => {
                    recover(conn, &f).await;
                    Direct::Answered(Err(f.error()))
                }
                Err(_) => Direct::Answered(Err(expire(conn).error())),
            }
        });
        let first = used.replace(Instant::now()).is_none();
        // Unlocked first, so that the closer finds it free.
        drop(guard);
        if first {
            self.direct_opened.notify_one();
        }
        answer
    }

    /// [`Postgres::apply`] as a future that needs no runtime: it completes
    /// when the driver thread answers.
    pub(crate) async fn apply_async(&self, key: &Key, op: Op) -> Result<Reply> {
        match self.send_async(key, op)? {
            Sent::Answered(reply) => reply,
            Sent::Pending(answer) => answer.await,
        }
    }

    /// The first half of [`Postgres::apply_async`]: the request sent to a
    /// connection, its answer to come from the returned future.
    pub(crate) fn send_async(&self, key: &Key, op: Op) -> Result<Sent> {
        let (tx, rx) = oneshot::channel();
        self.send(Job::Apply {
            key: key.clone(),
            op,
            hot: true,
            reply: tx,
        })?;
        Ok(Sent::Pending(Box::pin(async move {
            rx.await.map_err(|_| Error::Closed)?
        })))
    }

    /// [`Postgres::send_async`] under `deadline` when it comes before
    /// `call_timeout` from now (see [`Postgres::apply_many_by`]), in a
    /// transaction of its own: a request group-committed with others would
    /// hold them to its shorter deadline.
    pub(crate) fn send_async_by(&self, key: &Key, op: Op, deadline: Instant) -> Result<Sent> {
        let (tx, rx) = oneshot::channel();
        self.send_by(alone(key, op, tx), deadline.min(self.deadline()))?;
        Ok(Sent::Pending(Box::pin(async move {
            only_reply(rx.await.map_err(|_| Error::Closed)??)
        })))
    }

    /// Applies `ops` in one transaction of their own, each decided on its
    /// own in input order (a later request on a key sees an earlier one).
    /// Refused a lock past `lock_timeout`, the transaction fails as a
    /// whole (`claim_many` is one transaction).
    pub(crate) fn apply_many(&self, ops: Vec<(Key, Op)>) -> Result<Vec<Result<Reply>>> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        self.ask(|reply| Job::Many {
            ops,
            token_floor: None,
            lock_wait: None,
            own_deadline: false,
            reply,
        })
    }

    /// [`Postgres::apply_many`] for a batch of lease renewals, under
    /// `deadline` when it comes before `call_timeout` from now (a renewal
    /// must end while the lease lasts): past it the connection is dropped,
    /// so that a retry runs on another. Unlike `apply_many`, the batch
    /// waits for a row lock at most [`renewal_lock_wait`], then renews
    /// each key apart ([`run_apart`]).
    pub(crate) fn apply_many_by(
        &self,
        ops: Vec<(Key, Op)>,
        deadline: Instant,
    ) -> Result<Vec<Result<Reply>>> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let deadline = deadline.min(self.deadline());
        self.ask_by(deadline, |reply| Job::Many {
            ops,
            token_floor: None,
            lock_wait: Some(renewal_lock_wait(deadline, Instant::now())),
            own_deadline: true,
            reply,
        })
    }

    /// Raises the token sequence so that the next token is at least
    /// `token_floor`, then applies the import requests in one transaction.
    pub(crate) fn import(
        &self,
        ops: Vec<(Key, Op)>,
        token_floor: u64,
    ) -> Result<Vec<Result<Reply>>> {
        self.ask(|reply| Job::Many {
            ops,
            token_floor: Some(token_floor),
            lock_wait: None,
            own_deadline: false,
            reply,
        })
    }

    /// The record of `key`; `None` when absent or past retention at the
    /// store's time.
    pub(crate) fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.ask(|reply| Job::Get {
            key: key.clone(),
            reply,
        })
    }

    /// Evicts up to `max` records past retention (and their business-key
    /// bindings), oldest deadline first; returns how many.
    pub(crate) fn sweep(&self, max: usize) -> Result<usize> {
        self.ask(|reply| Job::Sweep { max, reply })
    }

    /// Every stored row (key bytes, codec envelope) whose key falls in one
    /// of the half-open `ranges` (`end` `None` = unbounded), in key order,
    /// from one REPEATABLE READ snapshot taken before this returns, read in
    /// pages of [`PAGE_ROWS`] through a portal on a connection of its own.
    /// The iterator ends with an error if the connection breaks or the
    /// store is dropped.
    pub(crate) fn entries(&self, ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Result<EntryIter> {
        let scan = self.scan(ranges, false)?;
        // An unchecked scan hands out rows alone.
        Ok(Box::new(scan.filter_map(|item| match item {
            Ok(Scanned::Row(key, envelope)) => Some(Ok((key, envelope))),
            Ok(Scanned::Problem(_) | Scanned::Damaged(_) | Scanned::Binding) => None,
            Err(e) => Some(Err(e)),
        })))
    }

    /// Every stored row as [`Postgres::entries`] reads them, each checked
    /// as a request on its key would check it, then every business-key
    /// binding, all from one snapshot (see [`Scanned`]): a row whose
    /// record does not decode, or whose query columns disagree with it, is
    /// an `Err(`[`Error::CorruptRecord`]`)` naming its key, and the
    /// iteration goes on with the next row (any other error ends it).
    fn checked_entries(&self) -> Result<Entries> {
        self.scan(vec![(Vec::new(), None)], true)
    }

    /// Verifies every row and business-key binding of one snapshot: each
    /// record decodes under its key and its query columns agree with it
    /// (as a request on its key checks), each token is below the token
    /// sequence, each live record's business key is bound to it, and each
    /// binding names a record that carries it (as the file engine's check
    /// does); no key is held by two rows, and the key columns still have
    /// their unique index ([`unkeyed_columns`]); `progress` is called once
    /// per row. Pages are not checked (the server's `data_checksums`).
    ///
    /// # Errors
    /// As a scan's: [`Error::Unavailable`] when the connection breaks or
    /// a page takes longer than `call_timeout`; damaged rows and bindings
    /// are reported in the [`CheckReport`], not as errors.
    pub(crate) fn verify(&self, mut progress: impl FnMut(Progress)) -> Result<CheckReport> {
        let entries = self.checked_entries()?;
        let next_token = self.next_token()?;
        let mut report = CheckReport::new(Integrity::NotRun);
        let mut row = |report: &mut CheckReport| {
            report.records = report.records.saturating_add(1);
            progress(Progress {
                records: report.records,
                bytes: 0,
                total: None,
            });
        };
        for item in entries {
            match item {
                Ok(Scanned::Row(key, envelope)) => {
                    row(&mut report);
                    match crate::codec::decode_record(&key, &envelope) {
                        Ok(record) if record.token() >= next_token => {
                            report.found(Problem::of_key(
                                record.key(),
                                format!(
                                    "fencing token {} is not below the store's token counter {next_token}: it could be handed out again",
                                    record.token()
                                ),
                            ));
                        }
                        Ok(_) => {}
                        Err(Error::CorruptRecord { key: name, detail }) => {
                            report.found(Problem::of_record(&key, name, detail));
                        }
                        Err(other) => return Err(other),
                    }
                }
                Ok(Scanned::Problem(problem)) => report.found(problem),
                Ok(Scanned::Damaged(problem)) => {
                    row(&mut report);
                    report.found(problem);
                }
                Ok(Scanned::Binding) => report.bindings = report.bindings.saturating_add(1),
                Err(Error::CorruptRecord { key, detail }) => {
                    row(&mut report);
                    report.found(Problem::other(key, detail));
                }
                Err(other) => return Err(other),
            }
        }
        Ok(report)
    }

    /// The scan behind [`Postgres::entries`] and
    /// [`Postgres::checked_entries`].
    /// Each scan holds a connection of its own until it ends or is
    /// dropped, one of at most [`PostgresLimits::scans`]: a scan that finds
    /// them all in use waits for one until its first page's deadline
    /// (`call_timeout`), then fails with [`Error::Unavailable`] naming the
    /// limit.
    fn scan(&self, ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>, checked: bool) -> Result<Entries> {
        let timeout = self.shared.limits.call_timeout;
        let started = Instant::now();
        let deadline = started.checked_add(timeout).unwrap_or(started);
        let permit = ScanRoom::take(&self.scans, deadline).ok_or_else(|| Error::Unavailable {
            detail: format!(
                "every one of the {} connections scans may hold (PostgresLimits::scans) was in \
                 use for call_timeout ({} ms): scans, exports, checks and compensation listings \
                 hold one each until they end or are dropped",
                self.shared.limits.scans,
                timeout.as_millis()
            ),
        })?;
        // A permit had at the deadline leaves the first page no time.
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Unavailable {
                detail: format!(
                    "a connection for the scan was free only at its deadline (call_timeout, {} \
                     ms): PostgresLimits::scans ({}) were all in use until then",
                    timeout.as_millis(),
                    self.shared.limits.scans
                ),
            });
        }
        let ranges = merge_ranges(ranges);
        let (req_tx, req_rx) = unbounded_channel::<PageRequest>();
        let shared = Arc::clone(&self.shared);
        let task = self
            .handle
            .spawn(async move { scan_task(&shared, ranges, checked, req_rx, permit).await })
            .abort_handle();
        let mut entries = Entries {
            requests: req_tx,
            buffered: VecDeque::new(),
            done: false,
            // The first page within what is left of the call's deadline.
            timeout: left,
            task,
        };
        // The snapshot is taken with the first page, before returning.
        entries.fill()?;
        entries.timeout = timeout;
        Ok(entries)
    }

    /// The store's random identity, fixed when the schema was created.
    pub(crate) fn store_id(&self) -> u128 {
        self.store_id
    }

    /// The token the next acquisition would take.
    pub(crate) fn next_token(&self) -> Result<u64> {
        self.ask(|reply| Job::NextToken { reply })
    }

    /// How many rows are stored (live, past retention or corrupt).
    pub(crate) fn len(&self) -> Result<u64> {
        self.ask(|reply| Job::Len { reply })
    }

    /// The rows by state at `now_ms` (store time, ms) and the oldest live
    /// Processing row's `created_ms`, counted by the server from the rows'
    /// columns in one statement (see [`read_counts`]): O(rows) on the
    /// server, nothing per row on the wire. (The store reads its time in
    /// the same call, [`Postgres::counts_now`]; a given time is for tests.)
    #[cfg(test)]
    pub(crate) fn state_counts(&self, now_ms: u64) -> Result<(StateCounts, Option<u64>)> {
        let (_, counts, oldest) = self.ask(|reply| Job::Counts {
            now_ms: Some(now_ms),
            reply,
        })?;
        Ok((counts, oldest))
    }

    /// The store's time and the rows by state at it (as
    /// [`Postgres::state_counts`]), read in one call under one deadline
    /// (`call_timeout`).
    pub(crate) fn counts_now(&self) -> Result<(u64, StateCounts, Option<u64>)> {
        self.ask(|reply| Job::Counts {
            now_ms: None,
            reply,
        })
    }

    /// The counters since this engine was connected.
    pub(crate) fn counters(&self) -> &LiveCounters {
        &self.shared.counters
    }

    /// The last store time this process read (ms since the epoch; 0
    /// before the first reading): what `Store::now_ms` answers while the
    /// server cannot be reached.
    pub(crate) fn last_now_ms(&self) -> u64 {
        self.shared.last_reading.load(Ordering::SeqCst)
    }

    /// [`Postgres::get`] as a future that needs no runtime.
    pub(crate) async fn get_async(&self, key: &Key) -> Result<Option<Record>> {
        self.get_async_by(key, self.deadline()).await
    }

    /// [`Postgres::get_async`] under `deadline` instead of the call's,
    /// answered `Unavailable` once it passes. A job waits in the queue for
    /// the jobs before it (whose deadlines, the calls', are as a rule
    /// earlier), so an earlier deadline than theirs is kept here, on the
    /// driver thread's timer (the caller's runtime may have none).
    pub(crate) async fn get_async_by(
        &self,
        key: &Key,
        deadline: Instant,
    ) -> Result<Option<Record>> {
        let (tx, rx) = oneshot::channel();
        self.send_by(
            Job::Get {
                key: key.clone(),
                reply: tx,
            },
            deadline,
        )?;
        let answer = self
            .handle
            .spawn(async move { tokio::time::timeout_at(deadline.into(), rx).await });
        match answer.await {
            Ok(Ok(Ok(answer))) => answer,
            Ok(Ok(Err(_))) | Err(_) => Err(Error::Closed),
            Ok(Err(_)) => Err(Error::Unavailable {
                detail: "no answer by the read's deadline (the calls queued or running before \
                         it were not done)"
                    .into(),
            }),
        }
    }

    /// Queues `op` without waiting for its answer (a best-effort write
    /// whose caller has gone, or a lease given back).
    pub(crate) fn apply_detached(&self, key: &Key, op: Op) {
        let (tx, _answer) = oneshot::channel();
        // A closed engine has nothing to apply it to: dropped, as the
        // embedded engine drops it on a closed writer.
        let _ = self.send(Job::Apply {
            key: key.clone(),
            op,
            hot: true,
            reply: tx,
        });
    }
}

/// How a PostgreSQL store names itself where a file store gives its path:
/// `postgresql://host[:port][,host…]/dbname?schema=name`, without the user
/// or the password of the connection string.
pub(crate) fn store_name(url: &str, schema: &str) -> std::path::PathBuf {
    // The TLS options this crate reads itself (`sslmode=verify-*`,
    // `sslrootcert`) are taken out first: tokio-postgres refuses them.
    let rest = tls::parse(url).map(|p| p.rest);
    let Ok(config) = rest
        .as_deref()
        .unwrap_or(url)
        .parse::<tokio_postgres::Config>()
    else {
        return std::path::PathBuf::from(format!("postgresql://?schema={schema}"));
    };
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                tokio_postgres::config::Host::Tcp(name) => shown_part(name).to_owned(),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(path) => {
                    shown_part(&path.display().to_string()).to_owned()
                }
            };
            match ports.get(i).or(ports.first()) {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
        .collect();
    let db = shown_part(config.get_dbname().unwrap_or(""));
    std::path::PathBuf::from(format!(
        "postgresql://{}/{db}?schema={schema}",
        hosts.join(",")
    ))
}

/// A host or database name as [`store_name`] shows it: itself when it
/// holds only letters, digits and `.-_:/[]%,` with no `://` (a database
/// name can be given as a whole connection string, password included),
/// else `…`.
fn shown_part(v: &str) -> &str {
    let plain = v
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b".-_:/[]%,".contains(&b))
        && !v.contains("://");
    if plain { v } else { "…" }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // Closing the queue ends the workers once they finish what they
        // hold; the runtime (and any scan still open) ends with them.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sorts `ranges`, drops empty ones and merges overlapping ones, so that
/// scanning them in order yields every key once, in key order.
fn merge_ranges(mut ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    ranges.retain(|(s, e)| e.as_ref().is_none_or(|e| e > s));
    ranges.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        if let Some(last) = out.last_mut() {
            let overlaps = last.1.as_ref().is_none_or(|le| s <= *le);
            if overlaps {
                last.1 = match (last.1.take(), e) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
                continue;
            }
        }
        out.push((s, e));
    }
    out
}

/// The iterator [`Postgres::entries`] returns: (key bytes, codec envelope)
/// in key order.
pub(crate) type EntryIter = crate::codec::Entries;

/// One item of a scan.
enum Scanned {
    /// A records row: (key bytes, codec envelope).
    Row(Vec<u8>, Vec<u8>),
    /// What a checked scan found besides a row's own damage: a live
    /// record's business key without its binding, or bound to another key
    /// (after that record's row), or a binding whose record is missing or
    /// does not carry it.
    Problem(Problem),
    /// A row of a checked scan whose record is damaged: it counts as a
    /// row, and the problem names it (by its key bytes, when they decode).
    Damaged(Problem),
    /// A business-key binding a checked scan read (after every row).
    Binding,
}

/// A scanned item, or why a row is corrupt.
type ScanItem = Result<Scanned>;
/// A page of a scan, or its error.
type Page = Result<Vec<ScanItem>>;
/// A request for the next page.
type PageRequest = oneshot::Sender<Page>;

/// The scan's side on the driver thread: one connection, one REPEATABLE
/// READ transaction, one portal per range; a page per request; each row
/// as [`scanned`] hands it out (`checked` or not). When `checked`, each
/// page of rows is followed by what [`checked_bindings`] finds, and the
/// rows by the business-key bindings in keyset pages, as
/// [`bindings_checked`] checks them.
///
/// The connection and `permit` (the scan's place among
/// [`PostgresLimits::scans`]) are given back as soon as the scan ends: after
/// its last (empty) page, or after an error, before the error is handed
/// to the next request (the request being answered when it happened is
/// dropped unanswered; [`Entries::fill`] asks again for the error).
async fn scan_task(
    shared: &Shared,
    ranges: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    checked: bool,
    mut requests: UnboundedReceiver<PageRequest>,
    permit: ScanPermit,
) {
    let mut client = match open_client(shared).await {
        Ok(c) => c,
        Err(f) => {
            drop(permit);
            if let Some(tx) = requests.recv().await {
                let _ = tx.send(Err(f.error()));
            }
            return;
        }
    };
    let run = async {
        let txn = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| fail(&e))?;
        // Take the snapshot now, with the store's time for the check (a
        // record past retention needs no binding).
        let clock = txn
            .query(&shared.sql.clock, &[])
            .await
            .map_err(|e| fail(&e))?;
        let now = if checked {
            time_from(shared, Some(&clock))?
        } else {
            0
        };
        let bounded = txn.prepare(&shared.sql.range).await.map_err(|e| fail(&e))?;
        let open = txn
            .prepare(&shared.sql.range_open)
            .await
            .map_err(|e| fail(&e))?;
        let read_bindings = match checked {
            true => Some(
                txn.prepare(&shared.sql.read_bindings)
                    .await
                    .map_err(|e| fail(&e))?,
            ),
            false => None,
        };
        // The bindings the rows found naming them, against the bindings
        // table's own (see `PairDigest`).
        let hashers = [std::hash::RandomState::new(), std::hash::RandomState::new()];
        let mut confirmed = PairDigest::new(&hashers);
        let mut pending: Option<PageRequest> = None;
        // The checks of the schema's objects that the rows cannot show: a
        // key column that lost its unique index (found by a connect, but
        // not by a store connected before it was dropped).
        if checked {
            let unkeyed = unkeyed_columns(&shared.sql.schema, &txn)
                .await
                .map_err(|e| fail(&e))?;
            if !unkeyed.is_empty() {
                let Some(tx) = next_request(&mut pending, &mut requests).await else {
                    return Ok(());
                };
                let problem = Problem::other(
                    format!("(schema {})", shared.sql.schema),
                    unkeyed_remedy(&shared.sql.schema, &unkeyed),
                );
                let _ = tx.send(Ok(vec![Ok(Scanned::Problem(problem))]));
            }
        }
        // The last row's key: rows come in key order, so a key held by
        // two rows (possible only without the unique index) is two rows
        // in a row.
        let mut last_key: Option<Vec<u8>> = None;
        for (start, end) in &ranges {
            let portal = match end {
                Some(end) => txn.bind(&bounded, &[start, end]).await,
                None => txn.bind(&open, &[start]).await,
            }
            .map_err(|e| fail(&e))?;
            loop {
                let Some(tx) = next_request(&mut pending, &mut requests).await else {
                    return Ok(());
                };
                let rows = txn
                    .query_portal(&portal, PAGE_ROWS)
                    .await
                    .map_err(|e| fail(&e))?;
                if rows.is_empty() {
                    pending = Some(tx);
                    break;
                }
                let mut page = match &read_bindings {
                    Some(read) => checked_bindings(&txn, read, &rows, now, &mut confirmed).await?,
                    None => rows
                        .iter()
                        .map(|row| scanned(row, false).map(|item| item.map(|(row, _)| row)))
                        .collect::<Result<_, Fail>>()?,
                };
                if checked {
                    for row in &rows {
                        let Ok(kb) = row.try_get::<_, Vec<u8>>(0) else {
                            continue;
                        };
                        if last_key.as_deref() == Some(kb.as_slice()) {
                            page.push(Ok(Scanned::Problem(Problem::of_record(
                                &kb,
                                Key::describe_bytes(&kb),
                                "two rows hold this key (the records table lost its unique \
                                 index): two claims of it may both have acquired it, and its \
                                 work run twice"
                                    .into(),
                            ))));
                        }
                        last_key = Some(kb);
                    }
                }
                let _ = tx.send(Ok(page));
            }
        }
        if checked {
            binding_pages(
                shared,
                &txn,
                &hashers,
                &confirmed,
                &mut pending,
                &mut requests,
            )
            .await?;
        }
        // Every source is done: the empty page ends the iterator, which
        // asks for no more.
        let last = match pending {
            Some(tx) => Some(tx),
            None => requests.recv().await,
        };
        if let Some(tx) = last {
            let _ = tx.send(Ok(Vec::new()));
        }
        Ok::<(), Fail>(())
    };
    let ended = run.await;
    // The snapshot's transaction ended with `run`; the connection and the
    // scan's place go now, whatever the iterator does next.
    drop(client);
    drop(permit);
    if let Err(f) = ended {
        // The error goes to the next request (the one that waited, if any,
        // was dropped with its sender: the iterator asks again).
        if let Some(tx) = requests.recv().await {
            let _ = tx.send(Err(f.error()));
        }
    }
}

/// The page request to answer next: the one held back, or the next one
/// to arrive (`None` once the iterator is gone).
async fn next_request(
    pending: &mut Option<PageRequest>,
    requests: &mut UnboundedReceiver<PageRequest>,
) -> Option<PageRequest> {
    match pending.take() {
        Some(tx) => Some(tx),
        None => requests.recv().await,
    }
}

/// The bindings of a checked scan, after its rows, a keyset page per
/// request: each counted and digested; when that digest differs from
/// what the rows `confirmed`, again, each checked against the row it
/// names. A request left unanswered when they are done stays in
/// `pending`; returns early once the iterator is gone.
async fn binding_pages(
    shared: &Shared,
    txn: &tokio_postgres::Transaction<'_>,
    hashers: &[std::hash::RandomState; 2],
    confirmed: &PairDigest,
    pending: &mut Option<PageRequest>,
    requests: &mut UnboundedReceiver<PageRequest>,
) -> Result<(), Fail> {
    let page_of = txn
        .prepare(&shared.sql.check_bindings)
        .await
        .map_err(|e| fail(&e))?;
    let read = txn
        .prepare(&shared.sql.read_records)
        .await
        .map_err(|e| fail(&e))?;
    let mut stored = PairDigest::new(hashers);
    for pass in [BindingPass::Count, BindingPass::Check] {
        if pass == BindingPass::Check && confirmed.matches(&stored) {
            return Ok(());
        }
        let mut from: Vec<u8> = Vec::new();
        let mut done = false;
        while !done {
            let Some(tx) = next_request(pending, requests).await else {
                return Ok(());
            };
            // A page sent is never empty (that ends the scan): the
            // checking pass reads on until it finds a problem.
            let mut page = Vec::new();
            while page.is_empty() {
                let rows = txn
                    .query(&page_of, &[&from, &i64::from(PAGE_ROWS)])
                    .await
                    .map_err(|e| fail(&e))?;
                let Some(last) = rows.last() else {
                    done = true;
                    break;
                };
                // The least binding after the last one read.
                from = last
                    .try_get(0)
                    .map_err(|e| storage("reading a bindings row", e))?;
                from.push(0);
                page = match pass {
                    BindingPass::Count => bindings_counted(&rows, &mut stored)?,
                    BindingPass::Check => bindings_checked(txn, &read, &rows).await?,
                };
            }
            if page.is_empty() {
                *pending = Some(tx);
            } else {
                let _ = tx.send(Ok(page));
            }
        }
    }
    Ok(())
}

/// A scanned row as [`Scanned::Row`] (key bytes, envelope), with its
/// record when `checked` found one: a row in the hot form is completed
/// and handed out as the completed record's envelope, any other row as
/// stored (whoever reads it checks it). With `checked`, every row is
/// first checked as a request would check it (`decide::slot_of`): a row
/// whose record does not decode, or whose columns (token, state, times:
/// what eviction, `stats` and the compare-and-set read) disagree with it,
/// is [`Scanned::Damaged`] naming its key, an answer for that row alone
/// (the scan goes on). `Fail` when the row's columns cannot be read
/// at all.
fn scanned(row: &Row, checked: bool) -> Result<Result<(Scanned, Option<Record>)>, Fail> {
    let rc = row_columns(row)?;
    let hot = rc.record.first() == Some(&hot::FORM);
    if !hot && !checked {
        return Ok(Ok((Scanned::Row(rc.key, rc.record), None)));
    }
    Ok(match decide::slot_of(&rc) {
        Slot::Present(rec) if !hot => Ok((Scanned::Row(rc.key, rc.record), Some(rec))),
        Slot::Present(rec) => {
            let envelope = crate::codec::encode_record(&rc.key, &rec);
            Ok((Scanned::Row(rc.key, envelope), Some(rec)))
        }
        Slot::Corrupt(name, detail) if checked => Ok((
            Scanned::Damaged(Problem::of_record(&rc.key, name, detail)),
            None,
        )),
        // An unchecked scan's damaged hot row: its bytes are no envelope,
        // so its reader is told what `slot_of` found, not that the form
        // byte is an unknown version.
        Slot::Corrupt(key, detail) => Err(Error::CorruptRecord { key, detail }),
        // `slot_of` gives no `Absent` for a row.
        Slot::Absent => Ok((Scanned::Row(rc.key, rc.record), None)),
    })
}

/// A record with a business key, and the binding it calls for.
struct NeedsBinding {
    /// The binding's bytes (`Key::business_binding`).
    binding: Vec<u8>,
    /// The business key.
    business_key: String,
    /// Whether the record is live (not past retention at the check's
    /// time): only a live record needs its binding.
    live: bool,
    /// The record.
    record: Record,
}

/// A page of records rows checked as [`scanned`] checks them, each live
/// record with a business key followed by what is wrong with its binding
/// (none, or bound to another key), read for the whole page in one
/// statement (`read`, [`Sql::read_bindings`]) of the scan's snapshot
/// `txn`, at the store's time `now_ms` (a record past retention needs no
/// binding: its business key is free). Each binding found naming the
/// record that calls for it, live or not, is added to `confirmed`.
async fn checked_bindings(
    txn: &tokio_postgres::Transaction<'_>,
    read: &Statement,
    rows: &[Row],
    now_ms: u64,
    confirmed: &mut PairDigest,
) -> Result<Vec<ScanItem>, Fail> {
    // Each row, and the binding its record's business key calls for.
    let mut checked: Vec<(ScanItem, Option<NeedsBinding>)> = Vec::with_capacity(rows.len());
    for row in rows {
        checked.push(match scanned(row, true)? {
            Ok((Scanned::Row(key, envelope), Some(rec))) => {
                let needs = rec.business_key.clone().map(|bk| NeedsBinding {
                    binding: rec.key.business_binding(&bk),
                    business_key: bk,
                    live: !rec.is_expired_at(now_ms),
                    record: rec,
                });
                (Ok(Scanned::Row(key, envelope)), needs)
            }
            Ok((item, _)) => (Ok(item), None),
            Err(e) => (Err(e), None),
        });
    }
    let wanted: Vec<&[u8]> = checked
        .iter()
        .filter_map(|(_, needs)| needs.as_ref().map(|n| n.binding.as_slice()))
        .collect();
    let mut bound: HashMap<Vec<u8>, Vec<u8>> = HashMap::with_capacity(wanted.len());
    if !wanted.is_empty() {
        for row in txn.query(read, &[&wanted]).await.map_err(|e| fail(&e))? {
            let get = |e: tokio_postgres::Error| storage("reading a bindings row", e);
            bound.insert(row.try_get(0).map_err(get)?, row.try_get(1).map_err(get)?);
        }
    }
    let mut page = Vec::with_capacity(checked.len());
    for (item, needs) in checked {
        page.push(item);
        let Some(NeedsBinding {
            binding,
            business_key: bk,
            live,
            record: rec,
        }) = needs
        else {
            continue;
        };
        let kb = rec.key.to_bytes();
        let detail = match bound.get(&binding) {
            Some(holder) if *holder == kb => {
                confirmed.add(&binding, &kb);
                continue;
            }
            // Past retention its business key is free: a binding
            // elsewhere, or none, is as it should be.
            _ if !live => continue,
            Some(holder) => format!(
                "business key {bk:?} is bound to another key, {}",
                Key::describe_bytes(holder)
            ),
            None => format!("business key {bk:?} has no binding"),
        };
        page.push(Ok(Scanned::Problem(Problem::of_key(&rec.key, detail))));
    }
    Ok(page)
}

/// A page of [`Sql::check_bindings`] rows (binding, key), each checked
/// against the row of the key it names, read for the whole page in one
/// statement (`read`, [`Sql::read_records`]) of the scan's snapshot `txn`:
/// what is wrong with each, as the file engine's check words it: the key
/// has no record, the binding does not parse as a key, or the record does
/// not carry the business key (a record that does not decode is reported
/// with its row, not here). Run only when the bindings' digest differs
/// from what the rows confirmed.
async fn bindings_checked(
    txn: &tokio_postgres::Transaction<'_>,
    read: &Statement,
    rows: &[Row],
) -> Result<Vec<ScanItem>, Fail> {
    let get = |e: tokio_postgres::Error| storage("reading a bindings row", e);
    let mut bindings: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(rows.len());
    for row in rows {
        bindings.push((row.try_get(0).map_err(get)?, row.try_get(1).map_err(get)?));
    }
    let mut targets: Vec<&[u8]> = bindings.iter().map(|(_, k)| k.as_slice()).collect();
    targets.sort_unstable();
    targets.dedup();
    let mut records: HashMap<Vec<u8>, RowColumns> = HashMap::with_capacity(targets.len());
    for row in txn.query(read, &[&targets]).await.map_err(|e| fail(&e))? {
        let rc = row_columns(&row)?;
        records.insert(rc.key.clone(), rc);
    }
    let mut page = Vec::new();
    for (binding, target) in bindings {
        let parsed = Key::from_bytes(&binding);
        let name = match &parsed {
            Ok(k) => format!("business key {:?} in scope {}", k.id(), k.scope()),
            Err(_) => format!("business key binding {}", binding.escape_ascii()),
        };
        let detail = match (records.get(&target), &parsed) {
            (None, _) => Some(format!(
                "names {}, which has no record",
                Key::describe_bytes(&target)
            )),
            (_, Err(e)) => Some(format!("binding key does not parse: {e}")),
            (Some(rc), Ok(bk)) => match decide::slot_of(rc) {
                Slot::Present(rec)
                    if rec.key.scope() != bk.scope()
                        || rec.business_key.as_deref() != Some(bk.id()) =>
                {
                    Some(format!("names {}, whose record does not carry it", rec.key))
                }
                Slot::Present(_) | Slot::Corrupt(..) | Slot::Absent => None,
            },
        };
        if let Some(detail) = detail {
            page.push(Ok(Scanned::Problem(Problem::other(name, detail))));
        }
    }
    Ok(page)
}

/// The two passes over the bindings of a checked scan.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BindingPass {
    /// Each binding counted ([`Scanned::Binding`]) and digested.
    Count,
    /// Each binding checked against the row of the key it names
    /// ([`bindings_checked`]).
    Check,
}

/// A page of [`Sql::check_bindings`] rows (binding, key): a
/// [`Scanned::Binding`] for each, each pair added to `stored`.
fn bindings_counted(rows: &[Row], stored: &mut PairDigest) -> Result<Vec<ScanItem>, Fail> {
    let get = |e: tokio_postgres::Error| storage("reading a bindings row", e);
    let mut page = Vec::with_capacity(rows.len());
    for row in rows {
        let binding: Vec<u8> = row.try_get(0).map_err(get)?;
        let key: Vec<u8> = row.try_get(1).map_err(get)?;
        stored.add(&binding, &key);
        page.push(Ok(Scanned::Binding));
    }
    Ok(page)
}

/// The room for scans' own connections ([`PostgresLimits::scans`]): a
/// counting semaphore a sync caller waits on with a deadline.
struct ScanRoom {
    /// How many more scans may start.
    free: parking_lot::Mutex<usize>,
    /// Wakes a waiting scan when a permit is given back.
    freed: parking_lot::Condvar,
}

/// One scan's place in a [`ScanRoom`], given back when dropped.
struct ScanPermit(Arc<ScanRoom>);

impl ScanRoom {
    fn new(scans: usize) -> ScanRoom {
        ScanRoom {
            free: parking_lot::Mutex::new(scans),
            freed: parking_lot::Condvar::new(),
        }
    }

    /// A permit, waiting for one until `deadline`; `None` past it.
    fn take(room: &Arc<ScanRoom>, deadline: Instant) -> Option<ScanPermit> {
        let mut free = room.free.lock();
        while *free == 0 {
            if room.freed.wait_until(&mut free, deadline).timed_out() && *free == 0 {
                return None;
            }
        }
        *free -= 1;
        Some(ScanPermit(Arc::clone(room)))
    }
}

impl Drop for ScanPermit {
    fn drop(&mut self) {
        *self.0.free.lock() += 1;
        self.0.freed.notify_one();
    }
}

/// The iterator of [`Postgres::entries`].
struct Entries {
    /// Page requests to the scan's task.
    requests: UnboundedSender<PageRequest>,
    /// The rest of the last page.
    buffered: VecDeque<ScanItem>,
    /// Whether the scan ended (an empty page or an error).
    done: bool,
    /// How long one page may take.
    timeout: Duration,
    /// The scan's task, aborted when the iterator is dropped or a page
    /// times out: its connection and its place among
    /// [`PostgresLimits::scans`] are not held past the caller's interest.
    task: tokio::task::AbortHandle,
}

impl Drop for Entries {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Entries {
    /// Fetches the next page into the buffer; an empty page ends the scan.
    /// A page that takes longer than the call timeout ends the scan with
    /// [`Error::Unavailable`].
    fn fill(&mut self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        if self.requests.send(tx).is_err() {
            self.done = true;
            return Err(Error::Unavailable {
                detail: "the scan's connection ended".into(),
            });
        }
        let answer = match rx.recv_timeout(self.timeout) {
            Ok(answer) => Ok(answer),
            Err(oneshot::RecvTimeoutError::Timeout) => {
                self.done = true;
                self.task.abort();
                return Err(Error::Unavailable {
                    detail: "a page of the scan took longer than PostgresLimits::call_timeout"
                        .into(),
                });
            }
            Err(oneshot::RecvTimeoutError::Disconnected) => Err(()),
        };
        match answer {
            Ok(Ok(page)) => {
                if page.is_empty() {
                    self.done = true;
                }
                self.buffered.extend(page);
                Ok(())
            }
            Ok(Err(e)) => {
                self.done = true;
                Err(e)
            }
            Err(_) => {
                self.done = true;
                Err(self.dropped_request())
            }
        }
    }

    /// Why the scan's task dropped a request unanswered: on an error, which
    /// it hands to the next request (see [`scan_task`]); asked for once,
    /// within the page's time.
    fn dropped_request(&mut self) -> Error {
        let ended = || Error::Unavailable {
            detail: "the scan's connection ended".into(),
        };
        let (tx, rx) = oneshot::channel();
        if self.requests.send(tx).is_err() {
            return ended();
        }
        match rx.recv_timeout(self.timeout) {
            Ok(Err(e)) => e,
            _ => ended(),
        }
    }
}

impl Iterator for Entries {
    type Item = ScanItem;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(entry) = self.buffered.pop_front() {
                return Some(entry);
            }
            if self.done {
                return None;
            }
            if let Err(e) = self.fill() {
                return Some(Err(e));
            }
        }
    }
}
