//! Statements and round trips per lifecycle of a lone caller on the
//! PostgreSQL engine (feature `postgres`): a claim of an absent key and its
//! completion, counted with `pg_stat_statements` (statements, on a
//! throwaway server that loads it) and with the test's TCP proxy (round
//! trips: the turns from the client's bytes to the server's answer). A
//! count, never a timing. The hot path answers each request with one
//! autocommit statement in one round trip: the claim of an absent key (its
//! token and time drawn by the statement itself) and the completion by the
//! holder, so a lone lifecycle costs 2 statements in 2 round trips (before
//! the hot path: 12 statements in 4 round trips); a replay of a finished
//! key costs 1 statement in 1 round trip.
//! `IDEMSTORE_SKIP_POSTGRES=1` skips it.

mod common;
mod pg;

use std::time::Duration;

use idemstore::postgres::server::{ServerOptions, TestServer};
use idemstore::postgres::tokio_postgres::{self, NoTls};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};
use pg::proxy::{Proxy, upstream_of, via};

/// Statements per lone lifecycle: the hot claim (an `INSERT … ON CONFLICT
/// DO NOTHING` that draws the token and reads the clock) and the hot
/// completion (an `UPDATE` fenced by token and record), each in
/// autocommit.
const MAX_STATEMENTS: u64 = 2;
/// Round trips per lone lifecycle: one per statement.
const MAX_ROUND_TRIPS: u64 = 2;
const LIFECYCLES: u64 = 50;

#[test]
fn statements_and_round_trips_per_lone_lifecycle() {
    if std::env::var_os("IDEMSTORE_SKIP_POSTGRES").is_some_and(|v| v == "1") {
        eprintln!("skipped: IDEMSTORE_SKIP_POSTGRES=1 (the PostgreSQL engine is not tested)");
        return;
    }
    let server = TestServer::start_own(ServerOptions {
        stat_statements: true,
        ..ServerOptions::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let url = server.url().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (admin, connection) = rt
        .block_on(tokio_postgres::connect(&url, NoTls))
        .expect("connect");
    rt.spawn(connection);
    rt.block_on(admin.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        .expect("pg_stat_statements");
    let schema = pg::schema("hot_path");
    let proxy = Proxy::start(upstream_of(&url));
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(1)
        .lease(Duration::from_secs(60))
        .sweep_interval(None);
    let store = Store::connect(&via(&url, &proxy), config).expect("connect");
    let fp = Fingerprint::of(b"payload");
    let lifecycle = |id: String| {
        let k = Key::new("hot", id).expect("key");
        match store.claim(&k, &fp, &ClaimOptions::new()).expect("claim") {
            ClaimOutcome::Acquired(lease) => {
                store.complete(&lease, b"done").expect("complete");
            }
            other => panic!("{other:?}"),
        }
    };
    // Warm: the connection is open and its statements prepared.
    lifecycle("warm".into());
    rt.block_on(admin.batch_execute("SELECT pg_stat_statements_reset()"))
        .expect("reset");
    proxy.take_round_trips();
    for i in 0..LIFECYCLES {
        lifecycle(format!("k{i}"));
    }
    let round_trips = proxy.take_round_trips();
    let rows = rt
        .block_on(admin.query(
            "SELECT query, calls FROM pg_stat_statements \
             WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY calls DESC, query",
            &[],
        ))
        .expect("pg_stat_statements");
    let mut statements = 0u64;
    let mut listing = String::new();
    for row in &rows {
        let query: String = row.get(0);
        let calls: i64 = row.get(1);
        let calls = u64::try_from(calls).expect("calls");
        statements += calls;
        let short: String = query.chars().take(90).collect();
        listing.push_str(&format!("{calls:>6}  {short}\n"));
    }
    eprintln!(
        "{LIFECYCLES} lone lifecycles: {statements} statements ({:.2} per lifecycle), \
         {round_trips} round trips ({:.2} per lifecycle)\n{listing}",
        statements as f64 / LIFECYCLES as f64,
        round_trips as f64 / LIFECYCLES as f64,
    );
    assert!(
        statements <= MAX_STATEMENTS * LIFECYCLES,
        "more statements per lifecycle than {MAX_STATEMENTS}:\n{listing}"
    );
    assert!(
        round_trips <= MAX_ROUND_TRIPS * LIFECYCLES,
        "{round_trips} round trips for {LIFECYCLES} lifecycles, more than {MAX_ROUND_TRIPS} each"
    );

    // A replay of a finished key: the claim's one statement reads the row.
    rt.block_on(admin.batch_execute("SELECT pg_stat_statements_reset()"))
        .expect("reset");
    proxy.take_round_trips();
    for i in 0..LIFECYCLES {
        let k = Key::new("hot", format!("k{i}")).expect("key");
        match store.claim(&k, &fp, &ClaimOptions::new()).expect("claim") {
            ClaimOutcome::Replay(record) => assert_eq!(record.result(), Some(&b"done"[..])),
            other => panic!("{other:?}"),
        }
    }
    let round_trips = proxy.take_round_trips();
    let rows = rt
        .block_on(admin.query(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
             WHERE query NOT LIKE '%pg_stat_statements%'",
            &[],
        ))
        .expect("pg_stat_statements");
    let statements: i64 = rows[0].get(0);
    eprintln!("{LIFECYCLES} replays: {statements} statements, {round_trips} round trips");
    assert!(
        u64::try_from(statements).expect("calls") <= LIFECYCLES,
        "more than one statement per replay: {statements} for {LIFECYCLES}"
    );
    assert!(
        round_trips <= LIFECYCLES,
        "{round_trips} round trips for {LIFECYCLES} replays"
    );
}
