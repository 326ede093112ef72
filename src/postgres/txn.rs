//! The effect and the completion in one transaction: [`complete_in`] and
//! [`fail_in`] finish a key inside the caller's own `tokio-postgres`
//! transaction, so that the caller's write (a ticket row, an order, a
//! ledger entry) and the idempotency record commit together or not at all.
//!
//! This is the recipe of Stripe's rocket-rides example ("Implementing
//! Stripe-like Idempotency Keys in Postgres", Brandur Leach): the effect
//! on the same database as the keys is made atomic with the key's
//! recorded outcome, so that no crash can fall between them.

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::record::{Lease, Op, Record, Reply};
use crate::store::Store;

use super::decide::{self, Base, Pass};
use super::{Fail, Shared, describe, fail, fill_records, time_from};

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
/// let key = lease.key().to_string();
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
/// `clock_timestamp()`, or the test clock given at connect, kept monotonic
/// by the store's process and never below the record's own last update),
/// decides with the store's pure transition function, and writes the new
/// record with a compare-and-set (`UPDATE … WHERE key = $k AND token =
/// $seen`). The row stays locked until the caller's transaction ends:
/// keep the transaction short and call this last, just before `COMMIT`.
/// Requests of the store for the same key (a retry's claim, an extension)
/// wait for that lock, and so does the store's group commit that carries
/// them: do not call the store for this key from the same task while the
/// transaction is open (it would wait for itself), and extend the lease
/// before the transaction rather than inside it.
///
/// # Errors
///
/// After **any** error the caller's transaction is aborted (a stale lease
/// or a refused record is turned into a failed statement, so that the
/// transaction cannot commit the effect without the completion): roll it
/// back. A `COMMIT` of it rolls back, too.
///
/// - [`Error::StaleLease`]: the record is no longer Processing under the
///   lease's token (it was taken over after the lease lapsed, finished,
///   released, or is past retention). The effect must not commit: the
///   key's current holder answers for it.
/// - [`Error::TooLarge`]: `result` is over the store's `max_result_bytes`.
/// - [`Error::InvalidArgument`]: `store` is not a PostgreSQL store
///   ([`Store::connect`]), or a time does not fit a `bigint`.
/// - [`Error::CorruptRecord`]: the stored row cannot be decoded.
/// - [`Error::Unavailable`]: a statement failed (the connection broke, the
///   server refused it): nothing of the caller's transaction is applied.
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
    let op = store.complete_op(lease, result)?;
    finish_in(client, store, lease, op).await
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
    let op = store.fail_op(lease, failure, retryable)?;
    finish_in(client, store, lease, op).await
}

/// The PostgreSQL engine under `store`, or the error for another engine.
fn shared_of(store: &Store) -> Result<&Shared> {
    match store.engine() {
        Engine::Postgres { engine, .. } => Ok(&engine.shared),
        Engine::Embedded(_) => Err(Error::invalid(
            "store",
            "not a PostgreSQL store: completing in the caller's transaction needs a store \
             opened with Store::connect",
        )),
    }
}

/// Decides `op` on `lease`'s key inside the caller's transaction and
/// writes the result; after an error, the caller's transaction is aborted.
async fn finish_in<C>(client: &C, store: &Store, lease: &Lease, op: Op) -> Result<Record>
where
    C: GenericClient + Sync,
{
    let shared = shared_of(store)?;
    match decide_and_write(client, shared, lease, op).await {
        Ok(record) => Ok(record),
        Err(Refusal::Server(f)) => Err(f.error()),
        Err(Refusal::Decision(error)) => {
            abort(client, &error).await;
            Err(error)
        }
    }
}

/// Why a completion did not happen.
enum Refusal {
    /// A statement failed on the server: the caller's transaction is
    /// aborted already.
    Server(Fail),
    /// The transition refused the request, or something read was wrong:
    /// the transaction must still be aborted.
    Decision(Error),
}

impl From<Fail> for Refusal {
    fn from(f: Fail) -> Refusal {
        match f {
            // A row that cannot be read, or an unexpected answer: the
            // server did not fail a statement, so abort the transaction.
            Fail::Storage(detail) => Refusal::Decision(Error::Storage(detail)),
            other => Refusal::Server(other),
        }
    }
}

async fn decide_and_write<C>(
    client: &C,
    shared: &Shared,
    lease: &Lease,
    op: Op,
) -> Result<Record, Refusal>
where
    C: GenericClient + Sync,
{
    let sql = &shared.sql;
    let key = lease.key();
    let keys = vec![key.to_bytes()];
    // The engine's order: the record row, then its business-key binding.
    let rows = client
        .query(sql.lock_records.as_str(), &[&keys])
        .await
        .map_err(|e| fail(&e))?;
    let mut base = Base::default();
    fill_records(&keys, &rows, &mut base)?;
    let ops = [(key.clone(), op)];
    let needed: Vec<Vec<u8>> = decide::bindings_needed(&base, &ops).into_iter().collect();
    if !needed.is_empty() {
        let rows = client
            .query(sql.lock_bindings.as_str(), &[&needed])
            .await
            .map_err(|e| fail(&e))?;
        for b in &needed {
            base.bindings.insert(b.clone(), None);
        }
        for row in &rows {
            let b: Vec<u8> = row.try_get(0).map_err(|e| read_error(&e))?;
            let k: Vec<u8> = row.try_get(1).map_err(|e| read_error(&e))?;
            base.bindings.insert(b, Some(k));
        }
    }
    // The clock after the lock, as the engine reads it.
    let clock = match shared.clock {
        Some(_) => None,
        None => Some(
            client
                .query(sql.clock.as_str(), &[])
                .await
                .map_err(|e| fail(&e))?,
        ),
    };
    let now = time_from(shared, clock.as_deref())?;
    let pass = Pass {
        now_ms: now,
        retention_ms: shared.retention_ms,
        tokens: &[],
        exhausted: false,
    };
    let decided = decide::decide(&base, &ops, &pass);
    let w = decide::writes(&base, &decided);
    let record = match decided.replies.into_iter().next() {
        Some(Ok(Reply::Record(record))) => record,
        Some(Err(error)) => {
            // A refusal changes nothing, whatever the caller does next.
            shared.counters.publish(decided.events);
            return Err(Refusal::Decision(error));
        }
        _ => {
            return Err(Refusal::Decision(Error::Storage(
                "a completion answered with something other than a record".into(),
            )));
        }
    };
    if !w.inserts.is_empty() || !w.deletes.is_empty() || !w.bind_inserts.is_empty() {
        return Err(Refusal::Decision(Error::Storage(
            "a completion would insert or delete a row".into(),
        )));
    }
    let uk: Vec<&[u8]> = w.updates.iter().map(|x| x.0.as_slice()).collect();
    let ur: Vec<&[u8]> = w.updates.iter().map(|x| x.1.as_slice()).collect();
    let ut: Vec<i64> = w.updates.iter().map(|x| x.2.token).collect();
    let us: Vec<i16> = w.updates.iter().map(|x| x.2.state).collect();
    let uc: Vec<i64> = w.updates.iter().map(|x| x.2.created_ms).collect();
    let ul: Vec<i64> = w.updates.iter().map(|x| x.2.lease_until_ms).collect();
    let ue: Vec<i64> = w.updates.iter().map(|x| x.2.expires_ms).collect();
    let useen: Vec<i64> = w.updates.iter().map(|x| x.3).collect();
    let params: [&(dyn ToSql + Sync); 8] = [&uk, &ur, &ut, &us, &uc, &ul, &ue, &useen];
    let updated = client
        .query(sql.update_records.as_str(), &params)
        .await
        .map_err(|e| fail(&e))?;
    if updated.len() != uk.len() {
        // The row is locked by this transaction: a compare-and-set that
        // misses means the row is not what was read.
        return Err(Refusal::Decision(Error::StaleLease {
            key: key.to_string(),
            token: lease.token(),
        }));
    }
    for (b, k, seen) in &w.bind_updates {
        let params: [&(dyn ToSql + Sync); 3] = [&vec![b], &vec![k], &vec![seen]];
        client
            .query(sql.update_bindings.as_str(), &params)
            .await
            .map_err(|e| fail(&e))?;
    }
    for (b, seen) in &w.bind_deletes {
        let params: [&(dyn ToSql + Sync); 2] = [&vec![b], &vec![seen]];
        client
            .query(sql.delete_bindings.as_str(), &params)
            .await
            .map_err(|e| fail(&e))?;
    }
    Ok(record)
}

fn read_error(e: &tokio_postgres::Error) -> Fail {
    Fail::Storage(format!("reading a bindings row: {}", describe(e)))
}

/// Makes the caller's transaction fail, so that it cannot commit the
/// effect without the completion: a statement that raises an error. (On a
/// client outside a transaction it fails alone and changes nothing.)
async fn abort<C>(client: &C, error: &Error)
where
    C: GenericClient + Sync,
{
    let statement = match error {
        Error::StaleLease { .. } => {
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'P0001', \
             MESSAGE = 'idemstore: the lease is stale; this transaction must roll back'; END $$"
        }
        _ => {
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'P0001', \
             MESSAGE = 'idemstore: the completion was refused; this transaction must roll back'; \
             END $$"
        }
    };
    if client.batch_execute(statement).await.is_ok() {
        tracing::error!(%error, "idemstore: could not abort the caller's transaction");
    }
}
