//! The effect and the completion in one transaction: the ticket row and the
//! idempotency record commit together or not at all (the Stripe
//! rocket-rides recipe, with `idemstore::postgres::complete_in`).
//!
//! Shared by `examples/ticket_txn.rs` and `tests/pg_txn.rs` (which kills a
//! process between the insert and the commit).

use std::future::Future;

use idemstore::postgres::tokio_postgres::{Client, GenericClient};
use idemstore::{Lease, Store};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Creates the tickets table `table` if missing: unique on the
/// idempotency key, so that a ticket exists at most once per key whatever
/// the store says.
pub async fn create_table(client: &Client, table: &str) -> Result<(), BoxError> {
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock(hashtext('ticket_txn.ddl')); \
             CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, \
             idempotency_key text NOT NULL UNIQUE, title text NOT NULL); COMMIT;"
        ))
        .await?;
    Ok(())
}

/// Creates the ticket of `lease`'s key and completes the key with the
/// ticket's id, in one transaction of `client`; `between` runs after the
/// insert and before the completion (a crash there commits nothing).
///
/// No lookup is needed on a takeover: the earlier holder's ticket and its
/// completion committed together, so a key whose ticket exists is
/// completed and a claim replays it; a key that is still Processing has no
/// ticket.
///
/// # Errors
/// `idemstore::Error::StaleLease` (boxed) when the lease was taken over
/// meanwhile: the transaction rolls back and no ticket is created; a
/// database error rolls back too.
pub async fn create_ticket(
    client: &mut Client,
    store: &Store,
    table: &str,
    lease: &Lease,
    title: &str,
    between: impl Future<Output = ()>,
) -> Result<i64, BoxError> {
    let tx = client.transaction().await?;
    let id = insert_ticket(&tx, table, &lease.key().reference(), title).await?;
    between.await;
    // Fails the transaction (and returns StaleLease) if the lease is no
    // longer current; dropping `tx` on `?` rolls it back.
    idemstore::postgres::complete_in(&tx, store, lease, id.to_string().as_bytes()).await?;
    tx.commit().await?;
    Ok(id)
}

/// Inserts the ticket row and returns its id.
pub async fn insert_ticket(
    client: &impl GenericClient,
    table: &str,
    key: &str,
    title: &str,
) -> Result<i64, BoxError> {
    let row = client
        .query_one(
            &format!("INSERT INTO {table} (idempotency_key, title) VALUES ($1, $2) RETURNING id"),
            &[&key, &title],
        )
        .await?;
    Ok(row.try_get(0)?)
}
