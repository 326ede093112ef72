//! The effect and the completion in one transaction: the engine's half of
//! `idemstore::postgres::complete_in` and `fail_in` (`src/postgres.rs`),
//! which finish a key inside the caller's own transaction, so that the
//! caller's write (a ticket row, an order, a ledger entry) and the
//! idempotency record commit together or not at all.
//!
//! This is the recipe of Stripe's rocket-rides example ("Implementing
//! Stripe-like Idempotency Keys in Postgres", Brandur Leach): the effect
//! on the same database as the keys is made atomic with the key's
//! recorded outcome, so that no crash can fall between them.
//!
//! The decision and its statements are written once, over [`Session`]:
//! the caller's connection, whichever driver holds it (`tokio-postgres`
//! here, sqlx in `txn_sqlx.rs` with the feature `sqlx`).

use std::future::Future;

use tokio_postgres::GenericClient;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, Result};
use crate::record::{Lease, Op, Record, Reply, State};

use super::decide::{self, Base, Pass, RowColumns, Slot};
use super::schema::Sql;
use super::{Fail, describe, fail, row_columns, to_u64};

/// The caller's connection, whichever driver holds it: the few statements
/// a completion sends, each failure classified as the engine classifies
/// its own ([`Fail`]).
pub(super) trait Session: Send {
    /// Locks and reads the record rows of `keys` (`sql`:
    /// `Sql::lock_records`, one `bytea[]` parameter).
    fn records(
        &mut self,
        sql: &str,
        keys: &[Vec<u8>],
    ) -> impl Future<Output = Result<Vec<RowColumns>, Fail>> + Send;
    /// Locks and reads business-key bindings (`sql`: `Sql::lock_bindings`,
    /// one `bytea[]` parameter): (binding, key) pairs.
    fn bindings(
        &mut self,
        sql: &str,
        bindings: &[Vec<u8>],
    ) -> impl Future<Output = Result<Vec<Binding>, Fail>> + Send;
    /// Runs `sql` (`Sql::txn_probe`): what [`Probe`] holds.
    fn probe(&mut self, sql: &str) -> impl Future<Output = Result<Probe, Fail>> + Send;
    /// Runs `sql`, which answers one row of one nullable text column.
    fn text(&mut self, sql: &str) -> impl Future<Output = Result<Option<String>, Fail>> + Send;
    /// Runs a write whose parameters are arrays; how many rows it returned.
    fn write(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<usize, Fail>> + Send;
    /// Runs `statement` with the simple protocol; whether it succeeded.
    fn execute(&mut self, statement: &str) -> impl Future<Output = bool> + Send;
}

/// What the caller's session is, read after the row locks
/// (`Sql::txn_probe`).
pub(super) struct Probe {
    /// The database clock, in ms since the Unix epoch.
    pub db_ms: i64,
    /// Whether the session's transaction has an id: the row lock assigns
    /// one inside a transaction block; outside a block the probe runs in a
    /// fresh transaction that has none.
    pub in_block: bool,
    /// Whether the transaction reads one snapshot throughout (REPEATABLE
    /// READ or SERIALIZABLE; READ UNCOMMITTED runs as READ COMMITTED), so
    /// that a row written after its first statement may not be seen.
    pub snapshot: bool,
    /// The identity of the store in the schema the session reaches (its
    /// `meta` row `store_id`), `None` without that row.
    pub store_id: Option<Vec<u8>>,
}

/// How long a completion under a snapshot that shows no row waits for the
/// store's own read of the key. That read is queued with the store's
/// calls, some of which may wait for locks of the caller's own open
/// transaction (a retry's claim of a key it completed), so it is bounded
/// well below `lock_timeout` (5 s by default); without an answer the
/// completion is refused as `Unavailable`, which never tells a current
/// holder that its lease is stale.
const SNAPSHOT_READ_BOUND: std::time::Duration = std::time::Duration::from_secs(1);

/// A business-key binding read: (binding, key).
pub(super) type Binding = (Vec<u8>, Vec<u8>);

/// A record update of `decide::Writes`: key, envelope, columns, the token
/// read.
type Update = (Vec<u8>, Vec<u8>, decide::Columns, i64);

/// One array parameter of a write.
pub(super) enum Param<'a> {
    /// `bytea[]`.
    Bytes(Vec<&'a [u8]>),
    /// `bigint[]`.
    Big(Vec<i64>),
    /// `smallint[]`.
    Small(Vec<i16>),
}

/// Decides `op` on `lease`'s key inside the caller's transaction and
/// writes the result (`prepared`: the store's engine and the operation, or
/// the error found before anything was sent); after an error, the caller's
/// transaction is aborted.
pub(super) async fn finish<S: Session>(
    session: &mut S,
    prepared: Result<(&super::Postgres, Op)>,
    lease: &Lease,
) -> Result<Record> {
    let (engine, op) = match prepared {
        Ok(prepared) => prepared,
        Err(error) => {
            abort(session, &error).await;
            return Err(error);
        }
    };
    match decide_and_write(session, engine, lease, op).await {
        Ok(record) => Ok(record),
        Err(Refusal::Server(f)) => Err(f.error()),
        Err(Refusal::Decision(error)) => {
            abort(session, &error).await;
            Err(error)
        }
    }
}

/// [`finish`] over a `tokio-postgres` client or transaction.
pub(crate) async fn finish_in<C>(
    client: &C,
    prepared: Result<(&super::Postgres, Op)>,
    lease: &Lease,
) -> Result<Record>
where
    C: GenericClient + Sync,
{
    finish(&mut TokioPostgres(client), prepared, lease).await
}

/// A `tokio-postgres` client or transaction of the caller's. Every
/// statement is sent unnamed with its parameters' types
/// (`query_typed`): one round trip each (a named statement is prepared in
/// one and closed after), nothing left in the session, and each statement
/// whole in one flight, so that a pooler in transaction mode keeps it on
/// one server session even outside a transaction block.
struct TokioPostgres<'a, C>(&'a C);

impl<C: GenericClient + Sync> Session for TokioPostgres<'_, C> {
    async fn records(&mut self, sql: &str, keys: &[Vec<u8>]) -> Result<Vec<RowColumns>, Fail> {
        let rows = self
            .0
            .query_typed(sql, &[(&keys, Type::BYTEA_ARRAY)])
            .await
            .map_err(|e| fail(&e))?;
        // A row the driver cannot decode (a column of another type than
        // the store's) failed on this side, so the caller's transaction
        // goes on: the error must abort it, as `read_error`'s do.
        rows.iter()
            .map(|row| {
                row_columns(row).map_err(|f| match f {
                    Fail::Config(fault, detail) => Fail::Storage(format!(
                        "{detail} ({}: a column altered outside idemstore)",
                        fault.name()
                    )),
                    other => other,
                })
            })
            .collect()
    }

    async fn bindings(&mut self, sql: &str, bindings: &[Vec<u8>]) -> Result<Vec<Binding>, Fail> {
        let rows = self
            .0
            .query_typed(sql, &[(&bindings, Type::BYTEA_ARRAY)])
            .await
            .map_err(|e| fail(&e))?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get(0).map_err(read_error)?,
                    row.try_get(1).map_err(read_error)?,
                ))
            })
            .collect()
    }

    async fn probe(&mut self, sql: &str) -> Result<Probe, Fail> {
        let rows = self.0.query_typed(sql, &[]).await.map_err(|e| fail(&e))?;
        let row = rows.first().ok_or_else(no_clock)?;
        Ok(Probe {
            db_ms: row.try_get(0).map_err(read_error)?,
            in_block: row.try_get(1).map_err(read_error)?,
            snapshot: row.try_get(2).map_err(read_error)?,
            store_id: row.try_get(3).map_err(read_error)?,
        })
    }

    async fn text(&mut self, sql: &str) -> Result<Option<String>, Fail> {
        let rows = self.0.query_typed(sql, &[]).await.map_err(|e| fail(&e))?;
        let row = rows.first().ok_or_else(no_row)?;
        row.try_get(0).map_err(read_error)
    }

    async fn write(&mut self, sql: &str, params: &[Param<'_>]) -> Result<usize, Fail> {
        let params: Vec<(&(dyn ToSql + Sync), Type)> = params
            .iter()
            .map(|p| match p {
                Param::Bytes(v) => (v as &(dyn ToSql + Sync), Type::BYTEA_ARRAY),
                Param::Big(v) => (v as &(dyn ToSql + Sync), Type::INT8_ARRAY),
                Param::Small(v) => (v as &(dyn ToSql + Sync), Type::INT2_ARRAY),
            })
            .collect();
        let rows = self
            .0
            .query_typed(sql, &params)
            .await
            .map_err(|e| fail(&e))?;
        Ok(rows.len())
    }

    async fn execute(&mut self, statement: &str) -> bool {
        self.0.batch_execute(statement).await.is_ok()
    }
}

fn read_error(e: tokio_postgres::Error) -> Fail {
    Fail::Storage(format!("reading a row: {}", describe(&e)))
}

/// The answer of a clock query without a row.
pub(super) fn no_clock() -> Fail {
    Fail::Storage("the clock query returned no row".into())
}

/// The answer of a one-row query without a row.
pub(super) fn no_row() -> Fail {
    Fail::Storage("a one-row query returned no row".into())
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

async fn decide_and_write<S: Session>(
    session: &mut S,
    engine: &super::Postgres,
    lease: &Lease,
    op: Op,
) -> Result<Record, Refusal> {
    let shared = &engine.shared;
    let sql = &shared.sql;
    let key = lease.key();
    let keys = vec![key.to_bytes()];
    // The engine's order: the record row, then its business-key binding.
    let rows = session.records(&sql.lock_records, &keys).await?;
    let mut base = Base::default();
    for k in &keys {
        base.records.insert(k.clone(), Slot::Absent);
    }
    for rc in &rows {
        base.records.insert(rc.key.clone(), decide::slot_of(rc));
    }
    let ops = [(key.clone(), op)];
    let needed: Vec<Vec<u8>> = decide::bindings_needed(&base, &ops).into_iter().collect();
    if !needed.is_empty() {
        let rows = session.bindings(&sql.lock_bindings, &needed).await?;
        for b in &needed {
            base.bindings.insert(b.clone(), None);
        }
        for (b, k) in rows {
            base.bindings.insert(b, Some(k));
        }
    }
    // The clock after the last lock wait, as the engine reads it, and
    // whether the client is inside a transaction block: the row was locked
    // above, which assigned this transaction an id if it is one; outside a
    // block this statement runs in a fresh transaction that has none.
    let Probe {
        db_ms,
        in_block,
        snapshot,
        store_id,
    } = session.probe(&sql.txn_probe).await?;
    // The caller's connection may reach another database whose schema of
    // the same name holds another store: its row is not this store's. No
    // identity at all may also be a policy of the caller's role hiding
    // `meta`'s row (row-level security, which the engine's own sessions are
    // checked for when it connects): asked then, one more round trip.
    let ours = engine.store_id().to_be_bytes();
    if store_id.as_deref() != Some(ours.as_slice()) {
        if store_id.is_none()
            && let Some(tables) = row_secured(session, sql).await
        {
            return Err(row_secured_refusal(sql, &tables, false));
        }
        let theirs = match store_id {
            Some(id) => format!(
                "store {}",
                id.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
            None => "no store identity".to_string(),
        };
        return Err(Refusal::Decision(Error::Misconfigured {
            fault: crate::error::ConfigFault::OtherStore,
            detail: format!(
                "the transaction's connection reaches another store than this Store's \
                 ({:032x}): its schema \"{}\" holds {theirs}; give complete_in / fail_in \
                 a connection to the store's own database (nothing was written, and the \
                 transaction is aborted)",
                engine.store_id(),
                sql.schema,
            ),
        }));
    }
    let reading = match &shared.clock {
        Some(clock) => clock.now_ms(),
        None => to_u64("the database clock", db_ms)?,
    };
    let now = shared.seen(reading);
    // The key's row not seen by the caller's transaction is not known to be
    // absent, and deciding on it would answer StaleLease to the current
    // holder (who would give the key up, to be run again once the lease
    // lapses), at every attempt if the row stays hidden. Two things hide
    // it:
    // - a transaction that reads one snapshot does not see a row written
    //   after its snapshot was taken: the claim's, when the caller's first
    //   statement came before the claim;
    // - a policy of the caller's role (row-level security active for it on
    //   the store's tables: asked, one more round trip).
    // Then the store's own connection reads the latest committed record:
    // still Processing under this lease, the row was hidden, and the answer
    // is the policy's remedy, or the refusal the server gives a row changed
    // after the snapshot (40001, when locked above): run the transaction
    // again. Otherwise (absent, past retention, finished, or another
    // holder's) the lease is stale, as decided below, whatever hid the row.
    // The read goes through the store's queue, where it may wait behind
    // calls that wait for this very transaction's locks: it gets
    // SNAPSHOT_READ_BOUND, and without an answer the refusal stands: the
    // policy's, or run the transaction again.
    let secured = if rows.is_empty() {
        row_secured(session, sql).await
    } else {
        None
    };
    if rows.is_empty() && (snapshot || secured.is_some()) {
        let due = std::time::Instant::now()
            .checked_add(SNAPSHOT_READ_BOUND)
            .unwrap_or_else(std::time::Instant::now);
        let held = match engine.get_async_by(key, due).await {
            Ok(Some(r)) => r.state() == State::Processing && r.token() == lease.token(),
            Ok(None) => false,
            Err(error) => {
                if let Some(tables) = &secured {
                    return Err(row_secured_refusal(sql, tables, snapshot));
                }
                return Err(Refusal::Decision(Error::Unavailable {
                    detail: format!(
                        "the key {key} has no record in this transaction's snapshot \
                         (REPEATABLE READ or SERIALIZABLE), which may have been taken before \
                         the claim was written, and the store's own read of it did not answer \
                         within {} ms ({error}): nothing was applied; run the transaction \
                         again",
                        SNAPSHOT_READ_BOUND.as_millis()
                    ),
                }));
            }
        };
        if held {
            if let Some(tables) = &secured {
                return Err(row_secured_refusal(sql, tables, snapshot));
            }
            return Err(Refusal::Decision(Error::Unavailable {
                detail: format!(
                    "the key {key} is held by this lease, but this transaction's snapshot \
                     (REPEATABLE READ or SERIALIZABLE) was taken before the claim was written \
                     and does not show it: nothing was applied; run the transaction again"
                ),
            }));
        }
    }
    // Outside a transaction block each write commits on its own: once the
    // update is sent, a lost answer leaves the outcome unknown.
    let sent = |f: Fail| match f {
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
    let bytes = |f: fn(&Update) -> &[u8]| Param::Bytes(w.updates.iter().map(f).collect());
    let big = |f: fn(&Update) -> i64| Param::Big(w.updates.iter().map(f).collect());
    let params = [
        bytes(|x| x.0.as_slice()),
        bytes(|x| x.1.as_slice()),
        big(|x| x.2.token),
        Param::Small(w.updates.iter().map(|x| x.2.state).collect()),
        big(|x| x.2.created_ms),
        big(|x| x.2.lease_until_ms),
        big(|x| x.2.expires_ms),
        big(|x| x.3),
    ];
    let updated = session
        .write(&sql.update_processing_records, &params)
        .await
        .map_err(sent)?;
    if updated != w.updates.len() {
        // The row is locked by this transaction: a compare-and-set that
        // misses means the row is not what was read.
        return Err(Refusal::Decision(Error::StaleLease {
            key: key.to_string(),
            token: lease.token(),
        }));
    }
    for (b, k, seen) in &w.bind_updates {
        let params = [
            Param::Bytes(vec![b.as_slice()]),
            Param::Bytes(vec![k.as_slice()]),
            Param::Bytes(vec![seen.as_slice()]),
        ];
        session
            .write(&sql.update_bindings, &params)
            .await
            .map_err(sent)?;
    }
    for (b, seen) in &w.bind_deletes {
        let params = [
            Param::Bytes(vec![b.as_slice()]),
            Param::Bytes(vec![seen.as_slice()]),
        ];
        session
            .write(&sql.delete_bindings, &params)
            .await
            .map_err(sent)?;
    }
    Ok(record)
}

/// Those of the store's tables on which row-level security is active for
/// the caller's session's role (`Sql::txn_row_secured`), or `None`. A
/// failure of the question is not an answer (`None`): the caller gets the
/// refusal it would have had without it, and its transaction is aborted
/// either way.
async fn row_secured<S: Session>(session: &mut S, sql: &Sql) -> Option<Vec<String>> {
    let tables = session.text(&sql.txn_row_secured).await.ok().flatten()?;
    Some(tables.split(' ').map(str::to_string).collect())
}

/// The refusal of a caller's session whose role has row-level security
/// active on the store's `tables` and did not see what it should have, as
/// a damaged schema that names the remedy. `snapshot`: the transaction
/// reads one snapshot, which may hide the key's row too (a policy that
/// hides nothing leaves that cause).
fn row_secured_refusal(sql: &Sql, tables: &[String], snapshot: bool) -> Refusal {
    let also = if snapshot {
        "; if no policy hides the key's row, this transaction's snapshot (REPEATABLE READ or \
         SERIALIZABLE) was taken before the claim was written: run it again"
    } else {
        ""
    };
    Refusal::Decision(Error::Misconfigured {
        fault: crate::error::ConfigFault::SchemaDamaged,
        detail: format!(
            "{} {} row-level security active for the role of the transaction's connection, \
             where complete_in / fail_in run (enabled outside idemstore), and that connection \
             does not see what the store holds for this key: a policy would hide the key's row \
             at every attempt (nothing was written, and the transaction is aborted); turn it \
             off: {} (or give the role BYPASSRLS){also}",
            tables.join(" and "),
            if tables.len() == 1 { "has" } else { "have" },
            super::row_security_disabled(&sql.schema, tables)
        ),
    })
}

/// Makes the caller's transaction fail, so that it cannot commit the
/// effect without the completion: a statement that raises an error. (On a
/// client outside a transaction it fails alone and changes nothing.)
async fn abort<S: Session>(session: &mut S, error: &Error) {
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
    if session.execute(statement).await {
        tracing::error!(%error, "idemstore: could not abort the caller's transaction");
    }
}
