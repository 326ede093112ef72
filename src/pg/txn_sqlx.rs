//! The caller's sqlx connection as a [`Session`] (feature `sqlx`): the
//! half of `idemstore::postgres::sqlx::complete_in` and `fail_in` that
//! speaks sqlx. The decision and its statements are `txn.rs`'s, the same
//! as for a `tokio-postgres` transaction.
//!
//! Every statement is sent unnamed (`persistent(false)`): it leaves no
//! prepared statement in the caller's connection, whose statement cache is
//! the caller's, and works the same through a pooler in transaction mode.

use sqlx::postgres::{PgConnection, PgDatabaseError, PgRow, PgSeverity};
use sqlx::{Executor, Postgres as Pg, Row};

use crate::error::Result;
use crate::record::{Lease, Op, Record};

use super::decide::RowColumns;
use super::txn::{self, Binding, Param, Probe, Session};
use super::{Fail, Postgres};

/// [`txn::finish`] over a sqlx PostgreSQL connection (a
/// `Transaction<Postgres>` derefs to one).
pub(crate) async fn finish_in(
    conn: &mut PgConnection,
    prepared: Result<(&Postgres, Op)>,
    lease: &Lease,
) -> Result<Record> {
    txn::finish(&mut Sqlx(conn), prepared, lease).await
}

/// A sqlx connection of the caller's.
struct Sqlx<'a>(&'a mut PgConnection);

impl Session for Sqlx<'_> {
    async fn records(&mut self, sql: &str, keys: &[Vec<u8>]) -> Result<Vec<RowColumns>, Fail> {
        let rows = sqlx::query::<Pg>(sql)
            .bind(keys)
            .persistent(false)
            .fetch_all(&mut *self.0)
            .await
            .map_err(|e| fail(&e))?;
        rows.iter().map(row_columns).collect()
    }

    async fn bindings(&mut self, sql: &str, bindings: &[Vec<u8>]) -> Result<Vec<Binding>, Fail> {
        let rows = sqlx::query::<Pg>(sql)
            .bind(bindings)
            .persistent(false)
            .fetch_all(&mut *self.0)
            .await
            .map_err(|e| fail(&e))?;
        rows.iter()
            .map(|row| Ok((get(row, 0)?, get(row, 1)?)))
            .collect()
    }

    async fn probe(&mut self, sql: &str) -> Result<Probe, Fail> {
        let rows = sqlx::query::<Pg>(sql)
            .persistent(false)
            .fetch_all(&mut *self.0)
            .await
            .map_err(|e| fail(&e))?;
        let row = rows.first().ok_or_else(txn::no_clock)?;
        Ok(Probe {
            db_ms: get(row, 0)?,
            in_block: get(row, 1)?,
            snapshot: get(row, 2)?,
            store_id: get(row, 3)?,
        })
    }

    async fn text(&mut self, sql: &str) -> Result<Option<String>, Fail> {
        let rows = sqlx::query::<Pg>(sql)
            .persistent(false)
            .fetch_all(&mut *self.0)
            .await
            .map_err(|e| fail(&e))?;
        let row = rows.first().ok_or_else(txn::no_row)?;
        get(row, 0)
    }

    async fn write(&mut self, sql: &str, params: &[Param<'_>]) -> Result<usize, Fail> {
        let mut query = sqlx::query::<Pg>(sql).persistent(false);
        for p in params {
            query = match p {
                Param::Bytes(v) => query.bind(v.as_slice()),
                Param::Big(v) => query.bind(v.as_slice()),
                Param::Small(v) => query.bind(v.as_slice()),
            };
        }
        let rows = query.fetch_all(&mut *self.0).await.map_err(|e| fail(&e))?;
        Ok(rows.len())
    }

    async fn execute(&mut self, statement: &str) -> bool {
        // A `&str` query has no arguments: sent with the simple protocol.
        Executor::execute(&mut *self.0, statement).await.is_ok()
    }
}

/// Reads column `i` of `row`.
fn get<'r, T>(row: &'r PgRow, i: usize) -> Result<T, Fail>
where
    T: sqlx::Decode<'r, Pg> + sqlx::Type<Pg>,
{
    row.try_get(i)
        .map_err(|e| Fail::Storage(format!("reading a row: {e}")))
}

/// Reads the columns of a records row.
fn row_columns(row: &PgRow) -> Result<RowColumns, Fail> {
    Ok(RowColumns {
        key: get(row, 0)?,
        record: get(row, 1)?,
        token: get(row, 2)?,
        state: get(row, 3)?,
        created_ms: get(row, 4)?,
        lease_until_ms: get(row, 5)?,
        expires_ms: get(row, 6)?,
    })
}

/// Classifies a sqlx error as the engine classifies a `tokio-postgres`
/// one (`super::fail`): a configuration fault by its SQLSTATE, a
/// connection gone (or the server going away), a deadlock or
/// serialization failure to try again, another refusal by the server, or
/// something else.
fn fail(err: &sqlx::Error) -> Fail {
    match err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let pg = db.try_downcast_ref::<PgDatabaseError>();
            let detail = match pg {
                Some(pg) => {
                    let severity = format!("{:?}", pg.severity()).to_uppercase();
                    format!("{severity} ({code}): {}", pg.message())
                }
                None => format!("({code}): {}", db.message()),
            };
            if super::row_security_refusal(&code, db.message()) {
                return Fail::Config(
                    crate::error::ConfigFault::SchemaDamaged,
                    super::row_security_remedy(&detail),
                );
            }
            if let Some(fault) = super::sqlstate_fault(&code) {
                return Fail::Config(fault, detail);
            }
            // The end of the session (FATAL) or a restart (PANIC).
            let ended =
                pg.is_some_and(|pg| matches!(pg.severity(), PgSeverity::Fatal | PgSeverity::Panic));
            match code.as_str() {
                c if c.starts_with("08") || c.starts_with("57P") || c == "53300" || ended => {
                    Fail::Lost(detail)
                }
                "40P01" | "40001" | "2200H" => Fail::Retry(detail),
                "25006" => Fail::ReadOnly(detail),
                c => Fail::refused(
                    super::refusal(
                        c,
                        pg.and_then(|pg| pg.r#where()),
                        pg.and_then(|pg| pg.schema()),
                    ),
                    detail,
                ),
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Fail::Lost(err.to_string()),
        _ => Fail::Storage(err.to_string()),
    }
}
