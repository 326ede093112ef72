//! The effect and the completion in one transaction over **sqlx** (cargo
//! feature `sqlx`): [`complete_in`] and [`fail_in`] are
//! [`idemstore::postgres::complete_in`](crate::postgres::complete_in) and
//! [`fail_in`](crate::postgres::fail_in) for a service whose transaction
//! is a sqlx one, with the same contract: the completion is written in
//! the caller's transaction, fenced by the lease's token, and any error
//! aborts that transaction.
//!
//! They take a `&mut sqlx::PgConnection`, which a
//! `sqlx::Transaction<'_, sqlx::Postgres>` (from `PgPool::begin`) and a
//! `PoolConnection<Postgres>` deref to: pass `&mut tx` (or `&mut *tx`).
//! The store itself still runs on its own `tokio-postgres` connections
//! ([`Store::connect`]); only the caller's transaction is sqlx's. The crate
//! is built against sqlx 0.8 (PostgreSQL and the tokio runtime): the
//! caller's sqlx must be a 0.8 release too, so that cargo unifies the two.
//!
//! ```no_run
//! # async fn demo(
//! #     pool: &sqlx::PgPool,
//! #     store: &idemstore::Store,
//! #     lease: &idemstore::Lease,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! let id: i64 = sqlx::query_scalar(
//!     "INSERT INTO tickets (idempotency_key, title) VALUES ($1, $2) RETURNING id",
//! )
//! .bind(lease.key().reference())
//! .bind("printer on fire")
//! .fetch_one(&mut *tx)
//! .await?;
//! idemstore::postgres::sqlx::complete_in(&mut tx, store, lease, id.to_string().as_bytes())
//!     .await?;
//! tx.commit().await?; // the ticket and the completion, or neither
//! # Ok(())
//! # }
//! ```
//!
//! Its statements are sent unnamed (sqlx's `persistent(false)`): they add
//! nothing to the connection's statement cache and work through a pooler
//! in transaction mode inside a transaction (outside one, sqlx prepares a
//! statement in one round trip and runs it in the next, which such a
//! pooler may send to another server session).

use sqlx::PgConnection;

use crate::error::Result;
use crate::record::{Lease, Record};
use crate::store::Store;

/// Records `result` as the outcome of `lease`'s key inside the caller's
/// sqlx transaction `conn`: the record becomes
/// [`State::Succeeded`](crate::State) when (and only when) the caller's
/// transaction commits.
///
/// Decided and written exactly as
/// [`idemstore::postgres::complete_in`](crate::postgres::complete_in)
/// does (the same statements and the same decision, shared by both): the
/// key's row stays locked until the caller's transaction ends, so call it
/// last, just before `COMMIT`.
///
/// # Errors
///
/// Those of [`crate::postgres::complete_in`], and after **any** of them the
/// caller's transaction is aborted: roll it back (`rollback().await`); its
/// `commit` rolls back, too. Dropping a sqlx `Transaction` only queues its
/// `ROLLBACK`, which sqlx sends with the connection's next use (a pooled
/// connection's, when it goes back to its `PgPool`): on a `PgConnection`
/// of your own left idle, the transaction stays open until then, and so
/// does its lock on the key's row, which every later claim or write of the
/// key waits for (up to `lock_timeout`, then
/// [`Error::Unavailable`](crate::Error::Unavailable)). The same holds for
/// a transaction dropped after this returned `Ok` without its `commit`. Inside a savepoint
/// (a sqlx transaction begun inside another) only the savepoint is
/// aborted, as [`crate::postgres::complete_in`] says: committing the outer
/// transaction then commits its effect without the completion.
///
/// - [`Error::StaleLease`](crate::Error::StaleLease): the lease is no
///   longer current; the effect must not commit.
/// - [`Error::TooLarge`](crate::Error::TooLarge): `result` is over the
///   store's `max_result_bytes`.
/// - [`Error::InvalidArgument`](crate::Error::InvalidArgument): `store` is
///   not a PostgreSQL store ([`Store::connect`]).
/// - [`Error::CorruptRecord`](crate::Error::CorruptRecord): the stored row
///   cannot be decoded.
/// - [`Error::Storage`](crate::Error::Storage): the driver cannot read a
///   stored row's column (a column altered outside idemstore), or the
///   server refused a statement for a reason that a retry meets again (a
///   page of its data found corrupted, `XX001`): nothing of the caller's
///   transaction is applied.
/// - [`Error::Unavailable`](crate::Error::Unavailable): a statement failed
///   (the connection broke, the server refused it for a reason that
///   passes, such as a lock wait or `statement_timeout`): nothing of the
///   caller's transaction is applied. In a REPEATABLE READ or SERIALIZABLE
///   transaction, also when its snapshot does not show the key's row or
///   the row changed after it: run the transaction again.
/// - [`Error::Misconfigured`](crate::Error::Misconfigured): the caller's
///   role lacks a grant on the store's tables (`permission-denied`), or
///   something added to them outside idemstore refused the completion (a
///   constraint, a trigger's function: `schema-damaged`), or row-level
///   security is active for the caller's role on the store's tables
///   (`schema-damaged`; a policy would hide the key's row).
/// - [`Error::OutcomeUnknown`](crate::Error::OutcomeUnknown): only for a
///   connection outside a transaction block, whose completion `UPDATE`
///   was sent and its answer lost; read the key ([`Store::get`]).
pub async fn complete_in(
    conn: &mut PgConnection,
    store: &Store,
    lease: &Lease,
    result: &[u8],
) -> Result<Record> {
    let prepared = super::prepare(store, store.complete_op(lease, result));
    crate::pg::txn_sqlx::finish_in(conn, prepared, lease).await
}

/// Records `failure` as the outcome of `lease`'s key inside the caller's
/// sqlx transaction `conn`, as [`Store::fail`] does, committed with the
/// caller's transaction or not at all (`retryable`: the next claim runs
/// the work again).
///
/// Decided as [`complete_in`] decides.
///
/// # Errors
///
/// As [`complete_in`], with [`Error::TooLarge`](crate::Error::TooLarge)
/// for a `failure` over the store's `max_failure_bytes`. After any error
/// the caller's transaction is aborted: roll it back.
pub async fn fail_in(
    conn: &mut PgConnection,
    store: &Store,
    lease: &Lease,
    failure: &[u8],
    retryable: bool,
) -> Result<Record> {
    let prepared = super::prepare(store, store.fail_op(lease, failure, retryable));
    crate::pg::txn_sqlx::finish_in(conn, prepared, lease).await
}
