//! The PostgreSQL schema of a store: its tables, its version, and the SQL
//! text of every statement the engine sends.
//!
//! ```sql
//! CREATE SCHEMA IF NOT EXISTS "<schema>";
//! CREATE TABLE "<schema>".meta (name text PRIMARY KEY, value bytea NOT NULL);
//!   -- 'version' -> 4-byte big-endian schema version, 'store_id' -> 16 bytes
//! CREATE TABLE "<schema>".records (
//!   key bytea PRIMARY KEY,          -- Key::to_bytes
//!   record bytea NOT NULL,          -- the codec envelope (crate::codec)
//!   token bigint NOT NULL,          -- the record's fencing token
//!   state smallint NOT NULL,        -- 0 processing, 1 succeeded, 2 failed, 3 failed-retryable
//!   created_ms bigint NOT NULL,
//!   lease_until_ms bigint NOT NULL,
//!   expires_ms bigint NOT NULL);
//! CREATE INDEX records_expires ON "<schema>".records (expires_ms);
//! CREATE TABLE "<schema>".bindings (binding bytea PRIMARY KEY, key bytea NOT NULL);
//! CREATE SEQUENCE "<schema>".tokens AS bigint MINVALUE 1 MAXVALUE 9223372036854775806 NO CYCLE;
//! ```
//!
//! The envelope is the record; the other columns are copies for queries
//! (eviction by `expires_ms`, the compare-and-set on `token`). A row whose
//! columns disagree with its envelope is reported as a corrupt record.

use crate::error::{Error, Result};

/// The schema version this build creates and reads. Version 2 (the
/// one-statement hot path) keeps version 1's objects and adds rows in the
/// hot form, which a version-1 build would read as corrupt: an upgrade
/// from 1 only rewrites the version row, and a version-1 build then
/// refuses the schema as too new instead of misreading it.
pub(crate) const SCHEMA_VERSION: u32 = 2;

/// The longest schema name PostgreSQL keeps (NAMEDATALEN − 1).
const MAX_SCHEMA_LEN: usize = 63;

/// Checks a schema name: 1 to 63 bytes of ASCII letters, digits and `_`,
/// not starting with a digit. The name is quoted in every statement, so
/// this only keeps it to characters that need no escaping.
pub(crate) fn check_schema_name(name: &str) -> Result<()> {
    let ok_chars = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    let starts_ok = name.bytes().next().is_some_and(|b| !b.is_ascii_digit());
    if name.is_empty() || name.len() > MAX_SCHEMA_LEN || !ok_chars || !starts_ok {
        return Err(Error::invalid(
            "schema",
            format!(
                "{name:?}: a schema name is 1 to {MAX_SCHEMA_LEN} ASCII letters, digits or \
                 underscores, not starting with a digit"
            ),
        ));
    }
    // PostgreSQL's own schemas (names are compared as quoted, so case
    // matters): `pg_*` is reserved (the server refuses to create one),
    // and `information_schema` is the catalog's, which pg_dump leaves out
    // of a backup.
    if name.starts_with("pg_") || name == "information_schema" {
        return Err(Error::invalid(
            "schema",
            format!("{name:?} is reserved for PostgreSQL's own schemas (pg_*, information_schema)"),
        ));
    }
    Ok(())
}

/// A stable 64-bit number from `text` (FNV-1a), for advisory lock keys
/// that must be the same in every process.
fn stable_hash(text: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(h.to_ne_bytes())
}

/// Every statement of the engine, with the schema name filled in.
#[derive(Debug, Clone)]
pub(crate) struct Sql {
    /// The schema name (validated).
    pub schema: String,
    /// Advisory lock key held while the schema is created or checked.
    pub ddl_lock: i64,
    /// Advisory lock key: shared while tokens are drawn, exclusive while an
    /// import raises the sequence (so no draw overtakes the raise).
    pub token_lock: i64,
    /// Locks and reads the rows of a batch's keys, in key order.
    pub lock_records: String,
    /// Reads rows without locking them (business-key holders, `get`).
    pub read_records: String,
    /// Locks, in key order and without waiting, the rows among `$1` past
    /// retention at `$2` (ms) that no other transaction holds, and returns
    /// their keys: the business-key holders a batch may evict. A row
    /// locked elsewhere is skipped: its locker (a sweep, a batch on that
    /// key) changes it, and waiting for it here, after the bindings' locks,
    /// would take locks in the other order than every other transaction.
    pub lock_expired_holders: String,
    /// Locks and reads business-key bindings, in binding order.
    pub lock_bindings: String,
    /// The database clock, ms since the epoch.
    pub clock: String,
    /// The database clock (ms since the epoch), whether the session's
    /// transaction has an id (`complete_in`: after locking a row, true
    /// only inside a transaction block), and whether its isolation level
    /// reads one snapshot (REPEATABLE READ or SERIALIZABLE).
    pub txn_probe: String,
    /// Those of the store's tables on which row-level security is active
    /// for the session's role (`row_security_active`), their names
    /// space-separated, or NULL: sent by `complete_in` when the caller's
    /// session did not see what it should have (the key's row, the
    /// store's identity), which a policy of the caller's role would hide.
    pub txn_row_secured: String,
    /// Draws up to `$1` tokens from the sequence (fewer when it nears its
    /// end).
    pub draw_tokens: String,
    /// Draws as many tokens as the batch's claims are likely to need:
    /// one per distinct claimed key (`$1`) that is absent, past retention
    /// at `$2` (the test clock, or NULL for the database clock), failed
    /// retryably, or whose lease has lapsed; never past the end.
    pub draw_estimate: String,
    /// Inserts fresh records (compare-and-set: absent).
    pub insert_records: String,
    /// Inserts fresh records, failing the transaction with a unique
    /// violation when one is present (for the flight that carries the
    /// `COMMIT`: a lost compare-and-set must abort, not commit the rest),
    /// and with 42P10 when the key's unique index is gone.
    pub insert_records_strict: String,
    /// Updates records (compare-and-set: same token as read).
    pub update_records: String,
    /// `update_records` for `complete_in`/`fail_in`, which may run on a
    /// client outside a transaction (its row lock then ends with the
    /// read): the write also requires the row to be still Processing, so
    /// that a record finished meanwhile under the same token is never
    /// overwritten.
    pub update_processing_records: String,
    /// Deletes records (compare-and-set: same token as read).
    pub delete_records: String,
    /// Inserts fresh bindings (compare-and-set: absent).
    pub insert_bindings: String,
    /// Moves bindings from one key to another (compare-and-set: old key).
    pub update_bindings: String,
    /// Deletes bindings (compare-and-set: still naming the key).
    pub delete_bindings: String,
    /// Records past retention, oldest deadline first, locked.
    pub due_records: String,
    /// The token the next acquisition would take.
    pub next_token: String,
    /// Raises the sequence so that the next token is at least `$1`.
    pub raise_tokens: String,
    /// Taken by an import before it raises the sequence: conflicts with
    /// the `ROW EXCLUSIVE` of a hot claim's `INSERT` and the `ROW SHARE` of
    /// the general path's locking read, both taken before their draws.
    pub lock_for_raise: String,
    /// The hot path's claims (one autocommit statement, [`super::hot`]):
    /// at the store's time (`$1` the test clock, else the database clock
    /// but no earlier than `$2`), inserts a record in the hot form with a
    /// token from the sequence for each key (`$3`, distinct) that has no
    /// row, and answers the rows of the keys that have one. Rows: fresh,
    /// key, record, token, state, created, lease until, expires, time, and
    /// for an inserted row the time again after its insert (which may have
    /// waited for a concurrent insert of the key that then rolled back).
    pub hot_claim: String,
    /// The hot path's completions and failures: at the store's time (as
    /// `hot_claim`, and no earlier than the row's floor), rewrites each row
    /// (`$3`) whose token and record are still the ones the holder wrote,
    /// whose state, creation, lease and expiry columns still agree with
    /// that record (a row damaged there goes the general way, which answers
    /// `CorruptRecord`), and that is not past retention. Rows: key, time.
    pub hot_finish: String,
    /// Number of stored rows.
    pub count: String,
    /// The rows by state at the store's time `$1` (ms), from their columns
    /// alone (no envelope is read or sent): every row, rows whose `state`
    /// is none of the four, live rows in each state (Processing, of them
    /// those whose lease has lapsed, Succeeded, Failed, Failed
    /// retryably), and the oldest live Processing row's `created_ms`
    /// (NULL when none; a negative one, damage, is left out). One pass
    /// over the table; a row past retention is one that is none of these.
    pub state_counts: String,
    /// Rows in `[$1, $2)` in key order (every column: a row in the hot
    /// form is completed before a scan hands it out).
    pub range: String,
    /// Rows from `$1` on in key order (every column).
    pub range_open: String,
    /// Reads business-key bindings (`binding = ANY($1)`) without locking
    /// them: the check of a snapshot (`verify`).
    pub read_bindings: String,
    /// A page of business-key bindings (binding, key) in binding order:
    /// those from `$1` on, at most `$2` (a keyset page: an index range
    /// scan whatever the table's statistics); the check of a snapshot
    /// (`verify`).
    pub check_bindings: String,
}

impl Sql {
    /// The statements for schema `schema` (validated here).
    pub(crate) fn new(schema: &str) -> Result<Sql> {
        check_schema_name(schema)?;
        let s = format!("\"{schema}\"");
        let cols = "key, record, token, state, created_ms, lease_until_ms, expires_ms";
        let clock_ms = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";
        // The sequence's last value, read through a function that needs
        // only USAGE on the sequence, so that a runtime role needs no
        // SELECT on it. It is NULL while nothing was drawn since the
        // sequence was created (or restarted by hand), when the position is
        // unknown without SELECT: then a draw takes one token (always
        // possible), and a read of the position draws one to learn it (a
        // token skipped, never handed out twice).
        let lv = format!("pg_sequence_last_value('{s}.tokens'::regclass)");
        let room = format!(
            "CASE WHEN {lv} IS NULL THEN 1 ELSE {max} - {lv} END",
            max = crate::MAX_TOKEN - 1
        );
        let last = format!("COALESCE({lv}, nextval('{s}.tokens'))");
        Ok(Sql {
            schema: schema.to_string(),
            ddl_lock: stable_hash(&format!("idemstore.ddl.{schema}")),
            token_lock: stable_hash(&format!("idemstore.tokens.{schema}")),
            lock_records: format!(
                "SELECT {cols} FROM {s}.records WHERE key = ANY($1) ORDER BY key FOR UPDATE"
            ),
            read_records: format!("SELECT {cols} FROM {s}.records WHERE key = ANY($1)"),
            lock_expired_holders: format!(
                "SELECT key FROM {s}.records WHERE key = ANY($1) AND expires_ms <= $2 \
                 ORDER BY key FOR UPDATE SKIP LOCKED"
            ),
            lock_bindings: format!(
                "SELECT binding, key FROM {s}.bindings WHERE binding = ANY($1) \
                 ORDER BY binding FOR UPDATE"
            ),
            clock: "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint".into(),
            txn_probe: format!(
                "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                 pg_current_xact_id_if_assigned() IS NOT NULL, \
                 current_setting('transaction_isolation') IN ('repeatable read', \
                 'serializable'), \
                 (SELECT value FROM {s}.meta WHERE name = 'store_id')"
            ),
            // `regclass` constants, resolved once when the statement is
            // parsed: a catalog join cost the statement twice as much.
            txn_row_secured: format!(
                "SELECT NULLIF(concat_ws(' ', \
                 CASE WHEN pg_catalog.row_security_active('{s}.bindings'::regclass) \
                 THEN 'bindings' END, \
                 CASE WHEN pg_catalog.row_security_active('{s}.meta'::regclass) THEN 'meta' END, \
                 CASE WHEN pg_catalog.row_security_active('{s}.records'::regclass) \
                 THEN 'records' END), '')"
            ),
            // Never past the end in one statement: a draw that fails half
            // way would lose the tokens it already took.
            draw_tokens: format!(
                "SELECT nextval('{s}.tokens') FROM generate_series(1, LEAST($1::bigint, \
                 {room}))"
            ),
            draw_estimate: format!(
                "WITH t AS (SELECT COALESCE($2::bigint, \
                   floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now), \
                 c AS (SELECT DISTINCT k FROM unnest($1::bytea[]) AS u(k)) \
                 SELECT nextval('{s}.tokens') FROM generate_series(1, LEAST( \
                 (SELECT count(*) FROM c CROSS JOIN t LEFT JOIN {s}.records r ON r.key = c.k \
                  WHERE r.key IS NULL OR r.expires_ms <= t.now OR r.state = 3 \
                  OR (r.state = 0 AND r.lease_until_ms <= t.now)), \
                 {room}))"
            ),
            insert_records: format!(
                "INSERT INTO {s}.records ({cols}) \
                 SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::smallint[], \
                 $5::bigint[], $6::bigint[], $7::bigint[]) ORDER BY 1 \
                 ON CONFLICT (key) DO NOTHING RETURNING key"
            ),
            // The guard inserts nothing, but its `ON CONFLICT (key)` must
            // find the key's unique index when the statement is planned
            // (42P10 otherwise, a damaged schema): the insert itself relies
            // on that index to fail a second insert of a key.
            insert_records_strict: format!(
                "WITH guard AS (INSERT INTO {s}.records ({cols}) \
                 SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::smallint[], \
                 $5::bigint[], $6::bigint[], $7::bigint[]) WHERE false \
                 ON CONFLICT (key) DO NOTHING) \
                 INSERT INTO {s}.records ({cols}) \
                 SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::smallint[], \
                 $5::bigint[], $6::bigint[], $7::bigint[]) ORDER BY 1 RETURNING key"
            ),
            update_records: format!(
                "UPDATE {s}.records AS r SET record = u.record, token = u.token, \
                 state = u.state, created_ms = u.created_ms, lease_until_ms = u.lease_until_ms, \
                 expires_ms = u.expires_ms \
                 FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::smallint[], \
                 $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[]) \
                 AS u(key, record, token, state, created_ms, lease_until_ms, expires_ms, seen) \
                 WHERE r.key = u.key AND r.token = u.seen RETURNING r.key"
            ),
            update_processing_records: format!(
                "UPDATE {s}.records AS r SET record = u.record, token = u.token, \
                 state = u.state, created_ms = u.created_ms, lease_until_ms = u.lease_until_ms, \
                 expires_ms = u.expires_ms \
                 FROM unnest($1::bytea[], $2::bytea[], $3::bigint[], $4::smallint[], \
                 $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[]) \
                 AS u(key, record, token, state, created_ms, lease_until_ms, expires_ms, seen) \
                 WHERE r.key = u.key AND r.token = u.seen AND r.state = {processing} \
                 RETURNING r.key",
                processing = super::decide::state_code(crate::record::State::Processing)
            ),
            delete_records: format!(
                "DELETE FROM {s}.records AS r USING unnest($1::bytea[], $2::bigint[]) \
                 AS u(key, seen) WHERE r.key = u.key AND r.token = u.seen RETURNING r.key"
            ),
            insert_bindings: format!(
                "INSERT INTO {s}.bindings (binding, key) \
                 SELECT * FROM unnest($1::bytea[], $2::bytea[]) ORDER BY 1 \
                 ON CONFLICT (binding) DO NOTHING RETURNING binding"
            ),
            update_bindings: format!(
                "UPDATE {s}.bindings AS b SET key = u.key \
                 FROM unnest($1::bytea[], $2::bytea[], $3::bytea[]) AS u(binding, key, seen) \
                 WHERE b.binding = u.binding AND b.key = u.seen RETURNING b.binding"
            ),
            delete_bindings: format!(
                "DELETE FROM {s}.bindings AS b USING unnest($1::bytea[], $2::bytea[]) \
                 AS u(binding, seen) WHERE b.binding = u.binding AND b.key = u.seen \
                 RETURNING b.binding"
            ),
            due_records: format!(
                "SELECT {cols} FROM {s}.records WHERE expires_ms <= $1 \
                 AND (expires_ms, key) > ($3, $4) \
                 ORDER BY expires_ms, key LIMIT $2 FOR UPDATE SKIP LOCKED"
            ),
            next_token: format!("SELECT {last}, true"),
            raise_tokens: format!(
                "SELECT setval('{s}.tokens', $1::bigint - 1, true) \
                 FROM (SELECT {last} AS last) AS c WHERE c.last + 1 < $1::bigint"
            ),
            lock_for_raise: format!("LOCK TABLE {s}.records IN EXCLUSIVE MODE"),
            hot_claim: format!(
                "WITH v AS (SELECT COALESCE($1::bigint, {clock_ms}) AS now), \
                 c AS (SELECT * FROM unnest($2::bytea[], $3::bytea[], $4::bytea[], $5::bigint[], \
                 $6::bigint[]) AS c(key, head, tmpl, lease_off, exp_off)), \
                 ins AS (INSERT INTO {s}.records ({cols}) \
                 SELECT f.key, f.head || substring(sha256(f.key || int8send(f.tok) || \
                 int8send(f.now + f.exp_off)) FROM 1 FOR 8) || f.tmpl, f.tok, 0::smallint, f.now, \
                 f.now + f.lease_off, f.now + f.exp_off \
                 FROM (SELECT c.*, v.now, nextval('{s}.tokens') AS tok FROM c CROSS JOIN v \
                 LEFT JOIN LATERAL (SELECT true AS hit FROM {s}.records r WHERE r.key = c.key \
                 LIMIT 1) AS e ON true WHERE e.hit IS NULL) AS f \
                 ORDER BY f.key ON CONFLICT (key) DO NOTHING RETURNING key, token, \
                 COALESCE($1::bigint, {clock_ms}) AS after) \
                 SELECT true, i.key, NULL::bytea, i.token, NULL::smallint, NULL::bigint, \
                 NULL::bigint, NULL::bigint, v.now, i.after FROM ins i CROSS JOIN v \
                 UNION ALL \
                 SELECT false, r.key, r.record, r.token, r.state, r.created_ms, r.lease_until_ms, \
                 r.expires_ms, v.now, NULL::bigint FROM c CROSS JOIN v CROSS JOIN LATERAL \
                 (SELECT * FROM {s}.records q WHERE q.key = c.key LIMIT 1) AS r \
                 WHERE NOT EXISTS (SELECT 1 FROM ins i WHERE i.key = r.key)"
            ),
            hot_finish: format!(
                "WITH v AS (SELECT COALESCE($1::bigint, {clock_ms}) AS now), \
                 u AS (SELECT u.*, GREATEST(v.now, u.floor) AS at FROM unnest($2::bytea[], \
                 $3::bigint[], $4::bytea[], $5::bytea[], $6::bytea[], $7::smallint[], \
                 $8::bigint[], $9::bigint[], $10::bigint[], $11::bigint[], $12::bigint[]) \
                 AS u(key, token, seen, head, tmpl, state, exp_off, floor, created, lease, \
                 expires) \
                 CROSS JOIN v) \
                 UPDATE {s}.records AS r SET record = u.head || substring(sha256(u.key || \
                 int8send(u.token) || int8send(u.at + u.exp_off)) FROM 1 FOR 8) || u.tmpl, \
                 state = u.state, expires_ms = u.at + u.exp_off \
                 FROM u WHERE r.key = u.key AND r.token = u.token AND r.record = u.seen \
                 AND r.state = 0 AND r.created_ms = u.created AND r.lease_until_ms = u.lease \
                 AND r.expires_ms = u.expires AND r.expires_ms > u.at RETURNING r.key, u.at"
            ),
            count: format!("SELECT count(*) FROM {s}.records"),
            // Each aggregate's filter is a comparison or two: cheaper than
            // grouping (a generic plan sorts the whole table to group it).
            state_counts: format!(
                "SELECT count(*),
                    count(*) FILTER (WHERE state NOT IN (0, 1, 2, 3)),
                    count(*) FILTER (WHERE state = 0 AND expires_ms > $1),
                    count(*) FILTER (WHERE state = 0 AND expires_ms > $1 AND lease_until_ms <= $1),
                    count(*) FILTER (WHERE state = 1 AND expires_ms > $1),
                    count(*) FILTER (WHERE state = 2 AND expires_ms > $1),
                    count(*) FILTER (WHERE state = 3 AND expires_ms > $1),
                    min(created_ms) FILTER (WHERE state = 0 AND expires_ms > $1 AND created_ms >= 0)
                 FROM {s}.records"
            ),
            range: format!(
                "SELECT {cols} FROM {s}.records WHERE key >= $1 AND key < $2 ORDER BY key"
            ),
            range_open: format!("SELECT {cols} FROM {s}.records WHERE key >= $1 ORDER BY key"),
            read_bindings: format!("SELECT binding, key FROM {s}.bindings WHERE binding = ANY($1)"),
            check_bindings: format!(
                "SELECT binding, key FROM {s}.bindings WHERE binding >= $1 \
                 ORDER BY binding LIMIT $2"
            ),
        })
    }

    /// The DDL that creates the schema's objects, idempotent.
    ///
    /// The token sequence of a new schema starts at the database clock's
    /// milliseconds times 1,024 (the milliseconds capped at 2^42, the year
    /// 2109), not at 1: a schema dropped and created again under a replica
    /// still running (an operator starting an empty store, a server that
    /// came back empty) hands out tokens above every token of its earlier
    /// life, unless that life drew more than 1,024 tokens a millisecond on
    /// average (a million a second; an import that raised the sequence
    /// counts as draws) or the clock went back. So a lease of the earlier
    /// life never matches a lease of the new one, and its holder's
    /// completion is refused as stale instead of finishing another
    /// holder's claim. Tokens stay below 2^53 for thousands of years of
    /// draws at a million a second, so JSON readers that take numbers as
    /// doubles (JavaScript, jq 1.6) read them exactly.
    pub(crate) fn create(&self) -> String {
        let s = format!("\"{}\"", self.schema);
        format!(
            "CREATE TABLE IF NOT EXISTS {s}.records (
                key bytea PRIMARY KEY,
                record bytea NOT NULL,
                token bigint NOT NULL,
                state smallint NOT NULL,
                created_ms bigint NOT NULL,
                lease_until_ms bigint NOT NULL,
                expires_ms bigint NOT NULL);
             CREATE INDEX IF NOT EXISTS records_expires ON {s}.records (expires_ms);
             CREATE TABLE IF NOT EXISTS {s}.bindings (
                binding bytea PRIMARY KEY,
                key bytea NOT NULL);
             DO $ddl$ BEGIN
                IF to_regclass('{s}.tokens') IS NULL THEN
                    EXECUTE 'CREATE SEQUENCE {s}.tokens AS bigint MINVALUE 1 MAXVALUE {max} \
                        NO CYCLE START ' || (LEAST(floor(extract(epoch FROM clock_timestamp()) \
                        * 1000)::bigint, {cap}) * {per_ms})::text;
                END IF;
             END $ddl$;",
            max = crate::MAX_TOKEN - 1,
            cap = crate::config::TOKEN_CLOCK_CAP_MS,
            per_ms = crate::config::TOKENS_PER_MS
        )
    }

    /// Creates the schema and its meta table if missing (run under the DDL
    /// advisory lock).
    pub(crate) fn create_meta(&self) -> String {
        let s = format!("\"{}\"", self.schema);
        format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.meta (name text PRIMARY KEY, value bytea NOT NULL);"
        )
    }

    /// Reads one meta value by name.
    pub(crate) fn read_meta(&self) -> String {
        format!("SELECT value FROM \"{}\".meta WHERE name = $1", self.schema)
    }

    /// Reads every meta row (name, value): the version check of a
    /// connect, which sends no DDL.
    pub(crate) fn read_meta_all(&self) -> String {
        format!("SELECT name, value FROM \"{}\".meta", self.schema)
    }

    /// Writes one meta value (first writer wins).
    pub(crate) fn write_meta(&self) -> String {
        format!(
            "INSERT INTO \"{}\".meta (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            self.schema
        )
    }

    /// Rewrites the version row to `$1` (an upgrade; under the DDL lock).
    pub(crate) fn write_version(&self) -> String {
        format!(
            "UPDATE \"{}\".meta SET value = $1 WHERE name = 'version'",
            self.schema
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_identifiers() {
        for ok in [
            "idemstore",
            "a",
            "_x1",
            "Tenant_42",
            "Pg_x",
            "pgx",
            "my_pg_store",
        ] {
            assert!(check_schema_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "a-b",
            "a\"b",
            "a b",
            "é",
            &"x".repeat(64),
            "pg_catalog",
            "pg_temp_1",
            "pg_x",
            "information_schema",
        ] {
            assert!(check_schema_name(bad).is_err(), "{bad}");
        }
    }
}
