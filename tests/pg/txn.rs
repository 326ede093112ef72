//! What the tests of the effect and the completion in one transaction
//! share (`tests/pg_txn.rs` over `tokio-postgres`, `tests/pg_txn_sqlx.rs`
//! over sqlx): the store's settings, the key and the tickets table.

use std::time::Duration;

use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Lease, ManualClock, Store};

/// The test clock's start (ms since the epoch).
pub const T0: u64 = 1_700_000_000_000;
/// The stores' lease.
pub const LEASE: Duration = Duration::from_secs(10);

/// A key of the ticket endpoint.
pub fn key(id: &str) -> Key {
    Key::new("POST /tickets", id).expect("key")
}

/// The tickets' request payload fingerprint.
pub fn fp() -> Fingerprint {
    Fingerprint::of(b"{\"title\":\"printer on fire\"}")
}

/// A store of schema `schema` on the test clock `clock`.
pub fn config(schema: &str, clock: &ManualClock) -> Config {
    Config::new()
        .postgres_schema(schema)
        .postgres_connections(2)
        .clock(clock.clone())
        .lease(LEASE)
        .sweep_interval(None)
}

/// A current-thread runtime with time and I/O.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Claims `key`, which must be acquired.
pub fn acquire(store: &Store, key: &Key) -> Lease {
    match store
        .claim(key, &fp(), &ClaimOptions::new())
        .expect("claim")
    {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// A table name for one test (letters, digits and `_`).
pub fn table_of(schema: &str) -> String {
    format!("public.tickets_{schema}")
}
