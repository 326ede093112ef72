//! The effect and the completion in one transaction: the engine's half of
//! `idemstore::postgres::complete_in` and `fail_in` (`src/postgres.rs`),
//! which finish a key inside the caller's own `tokio-postgres`
//! transaction, so that the caller's write (a ticket row, an order, a
//! ledger entry) and the idempotency record commit together or not at all.
//!
//! This is the recipe of Stripe's rocket-rides example ("Implementing
//! Stripe-like Idempotency Keys in Postgres", Brandur Leach): the effect
//! on the same database as the keys is made atomic with the key's
//! recorded outcome, so that no crash can fall between them.

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use crate::error::{Error, Result};
use crate::record::{Lease, Op, Record, Reply};

use super::decide::{self, Base, Pass};
use super::{Fail, Shared, describe, fail, fill_records, time_from};

/// Decides `op` on `lease`'s key inside the caller's transaction and
/// writes the result; after an error, the caller's transaction is aborted.
pub(crate) async fn finish_in<C>(
    client: &C,
    engine: &super::Postgres,
    lease: &Lease,
    op: Op,
) -> Result<Record>
where
    C: GenericClient + Sync,
{
    let shared = &engine.shared;
    match decide_and_write(client, shared, lease, op).await {
        Ok(record) => Ok(record),
        Err(Refusal::Server(f)) => Err(f.error()),
        Err(Refusal::Decision(error)) => Err(refuse(client, error).await),
    }
}

/// Aborts the caller's transaction for `error` (refused before anything
/// was sent, or by the decision) and gives the error back: every error of
/// `complete_in` and `fail_in` leaves the caller's transaction unable to
/// commit.
pub(crate) async fn refuse<C>(client: &C, error: Error) -> Error
where
    C: GenericClient + Sync,
{
    abort(client, &error).await;
    error
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
    // The clock after the last lock wait, as the engine reads it, and
    // whether the client is inside a transaction block: the row was locked
    // above, which assigned this transaction an id if it is one; outside a
    // block this statement runs in a fresh transaction that has none.
    let probe = client
        .query(sql.txn_probe.as_str(), &[])
        .await
        .map_err(|e| fail(&e))?;
    let now = time_from(shared, Some(&probe))?;
    let in_block: bool = probe
        .first()
        .ok_or_else(|| Fail::Storage("the clock query returned no row".into()))?
        .try_get(1)
        .map_err(|e| read_error(&e))?;
    // Outside a transaction block each write commits on its own: once the
    // update is sent, a lost answer leaves the outcome unknown.
    let sent = |e: tokio_postgres::Error| match fail(&e) {
        Fail::Lost(detail) if !in_block => Fail::Unknown(detail),
        other => other,
    };
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
        .query(sql.update_processing_records.as_str(), &params)
        .await
        .map_err(sent)?;
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
            .map_err(sent)?;
    }
    for (b, seen) in &w.bind_deletes {
        let params: [&(dyn ToSql + Sync); 2] = [&vec![b], &vec![seen]];
        client
            .query(sql.delete_bindings.as_str(), &params)
            .await
            .map_err(sent)?;
    }
    Ok(record)
}

fn read_error(e: &tokio_postgres::Error) -> Fail {
    Fail::Storage(format!("reading a row: {}", describe(e)))
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
