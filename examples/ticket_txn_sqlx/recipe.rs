//! The effect and the completion in one sqlx transaction: the ticket row
//! and the idempotency record commit together or not at all (the Stripe
//! rocket-rides recipe, with `idemstore::postgres::sqlx::complete_in`).
//!
//! Shared by `examples/ticket_txn_sqlx.rs` and `tests/pg_txn_sqlx.rs`
//! (which kills a process between the insert and the commit).

use std::future::Future;

use idemstore::{Lease, Store};
use sqlx::{Connection, Executor, PgConnection};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Creates the tickets table `table` if missing: unique on the
/// idempotency key, so that a ticket exists at most once per key whatever
/// the store says.
pub async fn create_table(conn: &mut PgConnection, table: &str) -> Result<(), BoxError> {
    // Several statements in one simple query (a `&str` has no arguments).
    let ddl = format!(
        "BEGIN; SELECT pg_advisory_xact_lock(hashtext('ticket_txn.ddl')); \
         CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, \
         idempotency_key text NOT NULL UNIQUE, title text NOT NULL); COMMIT;"
    );
    conn.execute(ddl.as_str()).await?;
    Ok(())
}

/// Creates the ticket of `lease`'s key and completes the key with the
/// ticket's id, in one sqlx transaction on `conn`; `between` runs after
/// the insert and before the completion (a crash there commits nothing).
///
/// # Errors
/// `idemstore::Error::StaleLease` (boxed) when the lease was taken over
/// meanwhile: the transaction is rolled back and no ticket is created; a
/// database error rolls back too.
pub async fn create_ticket(
    conn: &mut PgConnection,
    store: &Store,
    table: &str,
    lease: &Lease,
    title: &str,
    between: impl Future<Output = ()>,
) -> Result<i64, BoxError> {
    let mut tx = conn.begin().await?;
    let written = async {
        let id = insert_ticket(&mut tx, table, &lease.key().reference(), title).await?;
        between.await;
        // Fails the transaction (and returns StaleLease) if the lease is
        // no longer current.
        idemstore::postgres::sqlx::complete_in(&mut tx, store, lease, id.to_string().as_bytes())
            .await?;
        Ok::<_, BoxError>(id)
    }
    .await;
    match written {
        Ok(id) => {
            tx.commit().await?;
            Ok(id)
        }
        // Rolled back now: a dropped sqlx transaction is rolled back only
        // at the connection's next use, and until then it keeps the key's
        // row locked (a connection of one's own may sit idle for long).
        Err(e) => {
            tx.rollback().await?;
            Err(e)
        }
    }
}

/// Inserts the ticket row and returns its id.
pub async fn insert_ticket(
    conn: &mut PgConnection,
    table: &str,
    key: &str,
    title: &str,
) -> Result<i64, BoxError> {
    let id = sqlx::query_scalar(&format!(
        "INSERT INTO {table} (idempotency_key, title) VALUES ($1, $2) RETURNING id"
    ))
    .bind(key)
    .bind(title)
    .fetch_one(conn)
    .await?;
    Ok(id)
}
