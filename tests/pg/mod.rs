//! The PostgreSQL side of the integration tests (feature `postgres`): the
//! server they run on, and a schema of its own for every store.
//!
//! The server is a throwaway one started once per test binary
//! (`idemstore::postgres::server::TestServer::shared`, PostgreSQL 15, 16
//! or 17 binaries needed: `apt-get install postgresql-15`), or the one
//! named by `IDEMSTORE_PG_URL`. `IDEMSTORE_SKIP_POSTGRES=1` skips the
//! PostgreSQL tests: they print why and pass. Without binaries, URL or
//! skip, they fail with a message saying how to install the binaries. CI
//! never skips.
#![allow(dead_code)] // Each test crate uses a different part of this module.

use std::sync::atomic::{AtomicU64, Ordering};

pub mod proxy;
pub mod txn;

use idemstore::postgres::server::TestServer;

/// The URL of the server the PostgreSQL tests run on, or `None` (after
/// saying so on stderr) when `IDEMSTORE_SKIP_POSTGRES=1` skips them.
///
/// # Panics
/// When no server can be had: the message names how to install one.
pub fn url() -> Option<String> {
    if std::env::var_os("IDEMSTORE_SKIP_POSTGRES").is_some_and(|v| v == "1") {
        eprintln!("skipped: IDEMSTORE_SKIP_POSTGRES=1 (the PostgreSQL engine is not tested)");
        return None;
    }
    let server = TestServer::shared().unwrap_or_else(|e| panic!("{e}"));
    Some(server.url().to_string())
}

/// A schema name no other store of this test run (or an earlier run on a
/// server given by `IDEMSTORE_PG_URL`) uses: `<prefix>_<run>_<n>`.
pub fn schema(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() % 1_000_000_000);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{}_{run}_{n}", std::process::id())
}

/// The schema a PostgreSQL store lives in, from its path
/// (`postgresql://host:port/db?schema=name`).
pub fn schema_of(store: &idemstore::Store) -> String {
    let path = store.path().display().to_string();
    path.rsplit_once("schema=")
        .map(|(_, s)| s.to_string())
        .expect("a PostgreSQL store's path names its schema")
}

/// `url` with its database replaced by `db` (a URL's path, or a
/// key=value string's `dbname`).
pub fn with_db(url: &str, db: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, query) = match rest.find(['/', '?']) {
                Some(at) => {
                    let (authority, tail) = rest.split_at(at);
                    (authority, tail.find('?').map_or("", |q| &tail[q..]))
                }
                None => (rest, ""),
            };
            format!("{scheme}://{authority}/{db}{query}")
        }
        None => format!("{url} dbname={db}"),
    }
}

/// `url` with its user replaced by `user` (a URL's user information, or a
/// key=value string's `user`), for a test that connects as a role of its
/// own.
pub fn with_user(url: &str, user: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            let host = match rest[..end].rsplit_once('@') {
                Some((_, host)) => host,
                None => &rest[..end],
            };
            format!("{scheme}://{user}@{host}{}", &rest[end..])
        }
        None => format!("{url} user={user}"),
    }
}
