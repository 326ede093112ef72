//! The PostgreSQL engine's public face (cargo feature `postgres`): one
//! database shared by every replica of a service.
//!
//! A store on PostgreSQL is opened with [`Store::connect`] and used
//! through [`Store`] like a file store (README, "One replica or many").
//! What this module adds is the effect and the completion in one
//! transaction, when the effect is a write to the same database (the
//! Stripe/rocket-rides recipe): [`complete_in`] and [`fail_in`] finish a
//! key inside the caller's own `tokio-postgres` transaction, so that, for
//! example, the ticket row and the idempotency record commit together or
//! not at all. Through them, `tokio-postgres` types are part of this
//! feature's public API (re-exported as [`tokio_postgres`]).
//!
//! The engine itself (its group commit over the wire, its clock, its
//! tokens and failure modes) is described in `src/pg/mod.rs`.

use tokio_postgres::GenericClient;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::record::{Lease, Op, Record};
use crate::store::Store;

/// The `tokio-postgres` this crate is built with: its types
/// ([`GenericClient`], `Client`,
/// `Transaction`) are part of the public API of [`complete_in`] and
/// [`fail_in`].
pub use tokio_postgres;

#[cfg(feature = "sqlx")]
pub mod sqlx;

/// The throwaway PostgreSQL server of the crate's tests and of the
/// conformance suite (feature `conformance`). Not part of the API.
#[cfg(feature = "conformance")]
#[doc(hidden)]
pub use crate::pg::server;

/// Records `result` as the outcome of `lease`'s key inside the caller's
/// transaction `client`: the record becomes [`State::Succeeded`](crate::State)
/// when (and only when) the caller's transaction commits.
///
/// ```no_run
/// # async fn demo(
/// #     client: &mut tokio_postgres::Client,
/// #     store: &idemstore::Store,
/// #     lease: &idemstore::Lease,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// let key = lease.key().reference();
/// let tx = client.transaction().await?;
/// let row = tx
///     .query_one(
///         "INSERT INTO tickets (idempotency_key, title) VALUES ($1, $2) RETURNING id",
///         &[&key, &"printer on fire"],
///     )
///     .await?;
/// let id: i64 = row.get(0);
/// idemstore::postgres::complete_in(&tx, store, lease, id.to_string().as_bytes()).await?;
/// tx.commit().await?; // the ticket and the completion, or neither
/// # Ok(())
/// # }
/// ```
///
/// # How it decides
///
/// Exactly as the engine does for [`Store::complete`]: it reads and locks
/// the key's row (`SELECT … FOR UPDATE`, and its business-key binding, in
/// the engine's lock order), reads the store's time (the database's
/// `clock_timestamp()`, or the test clock given at connect, never below the
/// record's own last update),
/// decides with the store's pure transition function, and writes the new
/// record with a compare-and-set (`UPDATE … WHERE key = $k AND token =
/// $seen`). Each statement is sent whole and unnamed with its parameters'
/// types, one round trip each: three (the lock, the clock, the update),
/// one more for a business-key binding; nothing stays prepared in
/// `client`'s session, so a connection to a pooler in transaction mode
/// works, inside a transaction block or outside one. The row stays locked
/// until the caller's transaction ends:
/// keep the transaction short and call this last, just before `COMMIT`.
/// Requests of the store for the same key (a retry's claim, an extension)
/// wait for that lock, and so does the store's group commit that carries
/// them: do not call the store for this key from the same task while the
/// transaction is open (it would wait for itself), and extend the lease
/// before the transaction rather than inside it.
///
/// # Errors
///
/// After **any** error the caller's transaction is aborted (a stale lease,
/// a result over its limit, a store of the wrong kind or a refused record
/// is turned into a failed statement, so that the transaction cannot
/// commit the effect without the completion): roll it back. A `COMMIT` of
/// it rolls back, too.
///
/// - [`Error::StaleLease`]: the record is no longer Processing under the
///   lease's token (it was taken over after the lease lapsed, finished,
///   released, or is past retention). The effect must not commit: the
///   key's current holder answers for it.
/// - [`Error::TooLarge`]: `result` is over the store's `max_result_bytes`.
/// - [`Error::InvalidArgument`]: `store` is not a PostgreSQL store
///   ([`Store::connect`]), or a time does not fit a `bigint`.
/// - [`Error::CorruptRecord`]: the stored row cannot be decoded.
/// - [`Error::Storage`]: the driver cannot read a stored row's column (a
///   column altered outside idemstore: a connect of the store then
///   refuses the schema as [`ConfigFault::SchemaDamaged`](crate::ConfigFault)),
///   or the server refused a statement for a reason that a retry meets
///   again (a page of its data found corrupted, `XX001`; see
///   [`Error::Storage`]): nothing of the caller's transaction is applied.
/// - [`Error::Misconfigured`]: the role of `client` lacks a privilege on
///   the store's schema ([`ConfigFault::PermissionDenied`](crate::ConfigFault)),
///   or does not see the store's objects
///   ([`ConfigFault::SchemaDamaged`](crate::ConfigFault)): check first that
///   `client` is connected to the store's database; or something added
///   to the store's tables outside idemstore refused the completion (a
///   constraint, a trigger's function: `SchemaDamaged` too); nothing is
///   applied. Also `SchemaDamaged` when row-level security is active for
///   `client`'s role on the store's tables (enabled outside idemstore, for
///   the application's tenant policies, say): a policy would hide the
///   key's row from these statements, which run as that role, and the
///   lease would be judged stale at every attempt while its record
///   stands. The message names the tables and the remedy: disable it on
///   them, or give the role `BYPASSRLS`. (Asked only when the key's row or
///   the store's identity is not seen: one more round trip then.) (The store's own sessions are
///   checked when it connects; see [`ConfigFault::SchemaDamaged`](crate::ConfigFault).)
/// - [`Error::Unavailable`]: a statement failed (the connection broke, the
///   server refused it for a reason that passes, such as a lock wait or
///   `statement_timeout`): nothing of the caller's transaction is applied.
///   In a REPEATABLE READ or SERIALIZABLE transaction, also when its
///   snapshot was taken before the claim was written (its first statement
///   came first) and does not show the key's row, which the store's own
///   connection reads as still held by this lease; or when the row
///   changed after the snapshot (the server's `40001`): run the
///   transaction again, begun after the claim. A row absent from the
///   snapshot that the store's read shows stale (released, past
///   retention, finished or another holder's) is [`Error::StaleLease`],
///   as at READ COMMITTED. That read is one more round trip, on the
///   store's own connection, in this case only; it is given a second (it
///   may queue behind store calls that wait for this transaction's own
///   locks), and without its answer the completion is `Unavailable`.
/// - [`Error::OutcomeUnknown`]: only for a `client` outside a transaction
///   block (autocommit, where the completion's `UPDATE` commits on its
///   own): the `UPDATE` was sent and its answer lost, so the completion
///   may or may not be applied; read the key ([`Store::get`]) to learn it.
///
/// **Savepoints.** Inside a savepoint (a nested `Transaction::transaction`)
/// an error aborts the savepoint only, as any failed statement does in
/// PostgreSQL: rolling back to the savepoint and committing the outer
/// transaction commits what it wrote before without the completion. Call
/// this in the transaction itself, or treat its error as the whole
/// transaction's and roll that back.
///
/// The commit is the caller's, and so is its failure: if `COMMIT` fails
/// with the connection lost, the outcome is unknown, as it is for
/// [`Error::OutcomeUnknown`]; read the key ([`Store::get`]) to learn it.
///
/// # What the store sees
///
/// The PostgreSQL engine keeps no cache, so [`Store::get`] and every claim
/// see the completion as soon as the caller's transaction commits, in any
/// replica. The store's counters ([`Store::stats`]) do not count a
/// completion made here: whether the caller commits is not known to the
/// store. A rejection (stale lease, corrupt record) changes nothing,
/// whatever the caller does next, and is counted as it happens.
///
/// `tokio-postgres` types ([`GenericClient`], and so `Client` and
/// `Transaction`) are part of the public API of the feature `postgres`
/// through this function; the crate re-exports the version it uses as
/// [`idemstore::postgres::tokio_postgres`](crate::postgres::tokio_postgres).
pub async fn complete_in<C>(
    client: &C,
    store: &Store,
    lease: &Lease,
    result: &[u8],
) -> Result<Record>
where
    C: GenericClient + Sync,
{
    let prepared = prepare(store, store.complete_op(lease, result));
    crate::pg::txn::finish_in(client, prepared, lease).await
}

/// Records `failure` as the outcome of `lease`'s key inside the caller's
/// transaction `client`, as [`Store::fail`] does, committed with the
/// caller's transaction or not at all: for an effect that was refused in
/// the same transaction (a permanent failure, replayed to every retry), or
/// undone (`retryable`: the next claim runs the work again).
///
/// Decided as [`complete_in`] decides.
///
/// # Errors
///
/// As [`complete_in`], with [`Error::TooLarge`] for a `failure` over the
/// store's `max_failure_bytes`. After any error the caller's transaction
/// is aborted: roll it back.
pub async fn fail_in<C>(
    client: &C,
    store: &Store,
    lease: &Lease,
    failure: &[u8],
    retryable: bool,
) -> Result<Record>
where
    C: GenericClient + Sync,
{
    let prepared = prepare(store, store.fail_op(lease, failure, retryable));
    crate::pg::txn::finish_in(client, prepared, lease).await
}

/// What [`migrate`] did to the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Migration {
    /// The schema held no store: its objects were created at `version`.
    Created {
        /// The schema version now stored (this build's).
        version: u32,
    },
    /// The schema was at `version` already; its objects were checked (the
    /// idempotent DDL ran and found everything in place).
    Current {
        /// The schema version stored (this build's).
        version: u32,
    },
    /// The schema held a store at the older version `from`; it is now at
    /// `version`, its records kept. Builds older than `version` refuse it
    /// from then on ([`ConfigFault::SchemaTooNew`](crate::ConfigFault)):
    /// stop them before migrating.
    Upgraded {
        /// The version found.
        from: u32,
        /// The schema version now stored (this build's).
        version: u32,
    },
}

impl Migration {
    /// The schema version stored once the migration is done.
    pub fn version(&self) -> u32 {
        match self {
            Migration::Created { version }
            | Migration::Current { version }
            | Migration::Upgraded { version, .. } => *version,
        }
    }

    /// Whether this migration created the store (the schema held none).
    pub fn created(&self) -> bool {
        matches!(self, Migration::Created { .. })
    }
}

/// Creates the store's schema and objects in `schema` of the database at
/// `url`, or upgrades them to this build's schema version, under the
/// schema's DDL advisory lock (so deploys that run it at once create it
/// once); idempotent. For deploy pipelines: run it with a role that may
/// create the schema (`CREATE` on the database, or the schema's owner),
/// then run the service under a runtime role that holds only the grants
/// `docs/operations.md` lists, since [`Store::connect`] sends no DDL when
/// the schema is current. `idemstore migrate URL [--schema S]` does the
/// same from the command line.
///
/// `url` is as for [`Store::connect`] (TLS options included); `schema` is
/// 1 to 63 ASCII letters, digits or underscores, not starting with a
/// digit, not `pg_…` or `information_schema` (PostgreSQL's own; the
/// default schema of [`Store::connect`] is `"idemstore"`).
///
/// # Errors
/// - [`Error::InvalidArgument`]: a bad URL or schema name.
/// - [`Error::Unavailable`]: the server cannot be reached (retry).
/// - [`Error::Misconfigured`]: no such database, the role refused or its
///   password wrong or missing, [`ConfigFault::PermissionDenied`](crate::ConfigFault)
///   when the role may not create the schema or its objects, TLS refused,
///   [`ConfigFault::SchemaTooNew`](crate::ConfigFault) for a schema
///   written by a newer idemstore (never downgraded), or
///   [`ConfigFault::SchemaDamaged`](crate::ConfigFault) for a store's
///   schema missing its records, bindings or token sequence (never created
///   again empty).
/// - [`Error::IncompatibleSchema`]: the schema's meta rows are malformed,
///   or the schema holds no store but another program's relations named
///   `records`, `bindings` or `tokens` (choose another schema).
pub fn migrate(url: &str, schema: &str) -> Result<Migration> {
    let _span = tracing::debug_span!("idemstore.migrate").entered();
    let options = crate::pg::PgOptions {
        schema: schema.to_string(),
        connections: 1,
        migrate: true,
        ..crate::pg::PgOptions::default()
    };
    let engine = crate::pg::Postgres::connect(url, options)?;
    let version = crate::pg::SCHEMA_VERSION;
    Ok(match engine.found() {
        crate::pg::Found::Created => Migration::Created { version },
        crate::pg::Found::Current => Migration::Current { version },
        crate::pg::Found::Upgraded { from } => Migration::Upgraded { from, version },
    })
}

/// The PostgreSQL engine under `store` and the operation `op` to decide
/// in the caller's transaction, or the first error of the two (found
/// before anything is sent: the caller's transaction is then aborted all
/// the same).
fn prepare(store: &Store, op: Result<Op>) -> Result<(&crate::pg::Postgres, Op)> {
    op.and_then(|op| Ok((engine_of(store)?, op)))
}

/// The PostgreSQL engine under `store`, or the error for another engine.
fn engine_of(store: &Store) -> Result<&crate::pg::Postgres> {
    match store.engine() {
        Engine::Postgres { engine, .. } => Ok(engine),
        Engine::Embedded(_) => Err(Error::invalid(
            "store",
            "not a PostgreSQL store: completing in the caller's transaction needs a store \
             opened with Store::connect",
        )),
    }
}
