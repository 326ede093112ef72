//! The effect and the completion in one transaction (feature `postgres`):
//! `idemstore::postgres::complete_in` and `fail_in` inside the caller's own
//! `tokio-postgres` transaction, with a tickets table in the same database.
//!
//! - commit: the record is Succeeded and the ticket row exists;
//! - rollback: neither; the key stays Processing and is taken over once
//!   its lease lapses;
//! - a stale lease (taken over): `Error::StaleLease`, the caller's
//!   transaction is aborted (its `COMMIT` rolls back), no ticket row;
//! - a process killed between the two statements (a child that inserted
//!   the ticket, and one that also completed the key, both SIGKILLed
//!   before `COMMIT`): no ticket row, the key still Processing, then taken
//!   over after the lease;
//! - a file store is refused with a typed error;
//! - a REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates
//!   the claim: `Error::Unavailable` (run it again), not `StaleLease`;
//! - one round trip per statement (unnamed, sent whole), counted by a
//!   TCP proxy of the test's own.
//! - row-level security active for the caller's role on the store's
//!   tables: `Misconfigured(SchemaDamaged)` naming the remedy, not
//!   `StaleLease`, and the caller's transaction aborted.
//!
//! The server is the throwaway one of `tests/pg`; `IDEMSTORE_SKIP_POSTGRES=1`
//! skips these tests.

mod common;
mod pg;
#[path = "../examples/ticket_txn/recipe.rs"]
mod recipe;

use std::time::Duration;

use common::{child_role, child_var, child_var_parsed, ready_and_wait, report, spawn_child};
use idemstore::postgres::tokio_postgres::{self, Client, NoTls};
use idemstore::postgres::{complete_in, fail_in};
use idemstore::{
    ClaimOptions, ClaimOutcome, Config, ConfigFault, Error, Key, ManualClock, State, Store,
};
use pg::proxy::{Proxy, upstream_of, via};
use pg::txn::{LEASE, T0, acquire, config, fp, key, runtime, table_of};

async fn client(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

/// The tickets table of one test, unique on the idempotency key (the
/// example's DDL).
async fn create_tickets(client: &Client, table: &str) {
    recipe::create_table(client, table)
        .await
        .expect("create tickets");
}

async fn tickets_of(client: &Client, table: &str, key: &Key) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE idempotency_key = $1"),
            &[&key.reference()],
        )
        .await
        .expect("count")
        .get(0)
}

/// A transaction at `level` on `c`.
async fn begin(
    c: &mut Client,
    level: tokio_postgres::IsolationLevel,
) -> tokio_postgres::Transaction<'_> {
    c.build_transaction()
        .isolation_level(level)
        .start()
        .await
        .expect("begin")
}

async fn insert_ticket(client: &impl tokio_postgres::GenericClient, table: &str, key: &Key) -> i64 {
    client
        .query_one(
            &format!(
                "INSERT INTO {table} (idempotency_key, title) VALUES ($1, 'printer on fire') \
                 RETURNING id"
            ),
            &[&key.reference()],
        )
        .await
        .expect("insert ticket")
        .get(0)
}

#[test]
fn commit_stores_the_ticket_and_the_completion_together() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_commit");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = client(&url).await;
        create_tickets(&c, &table).await;
        let k = key("commit-1");
        let lease = acquire(&store, &k);
        clock.advance(Duration::from_millis(5));

        let tx = c.transaction().await.expect("begin");
        let id = insert_ticket(&tx, &table, &k).await;
        let record = complete_in(&tx, &store, &lease, id.to_string().as_bytes())
            .await
            .expect("complete_in");
        assert_eq!(record.state(), State::Succeeded);
        assert_eq!(record.updated_ms(), T0 + 5, "decided at the store's clock");
        // Not visible to the store before the caller commits.
        let before = store.get(&k).expect("get").expect("record");
        assert_eq!(before.state(), State::Processing);
        tx.commit().await.expect("commit");

        let after = store.get(&k).expect("get").expect("record");
        assert_eq!(after.state(), State::Succeeded);
        assert_eq!(after.result(), Some(id.to_string().as_bytes()));
        assert_eq!(after.token(), lease.token());
        assert_eq!(tickets_of(&c, &table, &k).await, 1);
        // Every later claim replays it.
        match store.claim(&k, &fp(), &ClaimOptions::new()).expect("claim") {
            ClaimOutcome::Replay(r) => assert_eq!(r.result(), Some(id.to_string().as_bytes())),
            other => panic!("expected a replay, got {other:?}"),
        }
        // The lease is finished: a second completion is stale.
        let tx = c.transaction().await.expect("begin");
        let err = complete_in(&tx, &store, &lease, b"again")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::StaleLease { .. }), "{err:?}");
        drop(tx);

        // fail_in: a permanent failure, committed with the caller's write.
        let k2 = key("fail-1");
        let lease2 = acquire(&store, &k2);
        let tx = c.transaction().await.expect("begin");
        tx.execute(
            &format!("INSERT INTO {table} (idempotency_key, title) VALUES ($1, 'refused: logged')"),
            &[&k2.reference()],
        )
        .await
        .expect("insert");
        let failed = fail_in(&tx, &store, &lease2, b"no such printer", false)
            .await
            .expect("fail_in");
        assert_eq!(failed.state(), State::Failed { retryable: false });
        tx.commit().await.expect("commit");
        let r = store.get(&k2).expect("get").expect("record");
        assert_eq!(r.failure(), Some(&b"no such printer"[..]));
        assert_eq!(tickets_of(&c, &table, &k2).await, 1);
    });
}

#[test]
fn rollback_keeps_neither_and_the_key_is_taken_over_after_its_lease() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_rollback");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = client(&url).await;
        create_tickets(&c, &table).await;
        let k = key("rollback-1");
        let lease = acquire(&store, &k);

        let tx = c.transaction().await.expect("begin");
        insert_ticket(&tx, &table, &k).await;
        complete_in(&tx, &store, &lease, b"1")
            .await
            .expect("complete_in");
        tx.rollback().await.expect("rollback");

        assert_eq!(tickets_of(&c, &table, &k).await, 0);
        let r = store.get(&k).expect("get").expect("record");
        assert_eq!(r.state(), State::Processing);
        assert_eq!(r.token(), lease.token());
        // Still held while the lease runs.
        assert!(matches!(
            store.claim(&k, &fp(), &ClaimOptions::new()).expect("claim"),
            ClaimOutcome::InProgress { .. }
        ));
        clock.advance(LEASE);
        let next = acquire(&store, &k);
        assert!(next.is_takeover());
        assert!(next.token() > lease.token());
        // The new holder finishes it in one transaction.
        let tx = c.transaction().await.expect("begin");
        let id = insert_ticket(&tx, &table, &k).await;
        complete_in(&tx, &store, &next, id.to_string().as_bytes())
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        assert_eq!(tickets_of(&c, &table, &k).await, 1);
        assert_eq!(
            store.get(&k).expect("get").expect("record").state(),
            State::Succeeded
        );
    });
}

#[test]
fn a_stale_lease_aborts_the_callers_transaction() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_stale");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = client(&url).await;
        create_tickets(&c, &table).await;
        let k = key("stale-1");
        let old = acquire(&store, &k);
        clock.advance(LEASE + Duration::from_millis(1));
        let new = acquire(&store, &k);
        assert!(new.token() > old.token());

        let tx = c.transaction().await.expect("begin");
        insert_ticket(&tx, &table, &k).await;
        let err = complete_in(&tx, &store, &old, b"1").await.unwrap_err();
        match &err {
            Error::StaleLease { token, .. } => assert_eq!(*token, old.token()),
            other => panic!("expected StaleLease, got {other:?}"),
        }
        // The transaction is aborted: nothing more runs in it, and even a
        // COMMIT of it rolls back.
        let more = tx.execute("SELECT 1", &[]).await;
        assert!(more.is_err(), "the caller's transaction must be aborted");
        let _ = tx.commit().await;

        assert_eq!(tickets_of(&c, &table, &k).await, 0);
        let r = store.get(&k).expect("get").expect("record");
        assert_eq!(r.state(), State::Processing);
        assert_eq!(r.token(), new.token(), "the new holder keeps the key");
        // A file store is refused with a typed error.
        let dir = tempfile::tempdir().expect("tempdir");
        let file = Store::open(dir.path().join("s.redb")).expect("open");
        let tx = c.transaction().await.expect("begin");
        let err = complete_in(&tx, &file, &new, b"1").await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { what: "store", .. }),
            "{err:?}"
        );
    });
}

/// The child of [`a_process_killed_between_the_statements_commits_nothing`]:
/// claims its key and runs the recipe of `examples/ticket_txn`, killed
/// between the ticket's insert and the completion (`TXN_STAGE` `inserted`);
/// or inserts the ticket and completes the key, killed before `COMMIT`
/// (`completed`).
fn killed_child() -> ! {
    let url = child_var("TXN_URL");
    let schema = child_var("TXN_SCHEMA");
    let table = child_var("TXN_TABLE");
    let id = child_var("TXN_KEY");
    let stage = child_var("TXN_STAGE");
    let clock = ManualClock::new(child_var_parsed("TXN_T0"));
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let k = key(&id);
    let lease = acquire(&store, &k);
    report("token", lease.token());
    let rt = runtime();
    let mut c = rt.block_on(client(&url));
    rt.block_on(async {
        if stage == "inserted" {
            let killed_here = async { ready_and_wait() };
            let _ = recipe::create_ticket(&mut c, &store, &table, &lease, "t", killed_here).await;
            unreachable!("killed between the statements");
        }
        // The transaction is left open: BEGIN, the ticket, the completion.
        c.batch_execute("BEGIN").await.expect("begin");
        insert_ticket(&c, &table, &k).await;
        complete_in(&c, &store, &lease, b"ticket")
            .await
            .expect("complete_in");
    });
    ready_and_wait()
}

#[test]
fn a_process_killed_between_the_statements_commits_nothing() {
    const NAME: &str = "a_process_killed_between_the_statements_commits_nothing";
    if child_role(NAME) {
        killed_child();
    }
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_killed");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    let rt = runtime();
    let mut c = rt.block_on(client(&url));
    rt.block_on(create_tickets(&c, &table));
    for stage in ["inserted", "completed"] {
        let k = key(&format!("killed-{stage}"));
        let vars = [
            ("TXN_URL", url.clone()),
            ("TXN_SCHEMA", schema.clone()),
            ("TXN_TABLE", table.clone()),
            ("TXN_KEY", format!("killed-{stage}")),
            ("TXN_STAGE", stage.to_string()),
            ("TXN_T0", clock.now_ms_for_child().to_string()),
        ];
        let mut child = spawn_child(NAME, &vars);
        let reports = child.wait_ready();
        let token: u64 = reports["token"].parse().expect("token");
        child.kill();

        // The server rolls the dead client's transaction back once it sees
        // the connection gone; nothing of it was ever visible.
        rt.block_on(async {
            assert_eq!(tickets_of(&c, &table, &k).await, 0, "{stage}");
        });
        let r = store.get(&k).expect("get").expect("record");
        assert_eq!(r.state(), State::Processing, "{stage}");
        assert_eq!(r.token(), token, "{stage}");
        clock.advance(LEASE);
        // The claim waits for the dead backend's row lock (if it took one)
        // to go with its transaction.
        let next = acquire(&store, &k);
        assert!(next.is_takeover(), "{stage}");
        rt.block_on(async {
            let tx = c.transaction().await.expect("begin");
            let id = insert_ticket(&tx, &table, &k).await;
            complete_in(&tx, &store, &next, id.to_string().as_bytes())
                .await
                .expect("complete_in");
            tx.commit().await.expect("commit");
            assert_eq!(tickets_of(&c, &table, &k).await, 1, "{stage}");
        });
        assert_eq!(
            store.get(&k).expect("get").expect("record").state(),
            State::Succeeded,
            "{stage}"
        );
    }
}

/// The test clock's reading, for a child that must start where the parent
/// is.
trait NowForChild {
    fn now_ms_for_child(&self) -> u64;
}

impl NowForChild for ManualClock {
    fn now_ms_for_child(&self) -> u64 {
        use idemstore::Clock;
        self.now_ms()
    }
}

/// A caller's REPEATABLE READ or SERIALIZABLE transaction whose snapshot
/// was taken before the key was claimed (its first statement, the ticket's
/// insert, came first) does not see the key's row. Its completion is
/// `Unavailable` (run the transaction again) and aborts it, where it was
/// `StaleLease`, which tells the current holder to give the key up (to run
/// again once the lease lapsed). The same completion in a new transaction
/// commits, ticket and record together. A lease that is stale (released,
/// past retention) is `StaleLease` under such a snapshot too, so a caller
/// who runs the transaction again is not answered `Unavailable` forever
/// (the store's own connection reads the latest record).
#[test]
fn a_snapshot_from_before_the_claim_is_unavailable_not_a_stale_lease() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_snapshot");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = client(&url).await;
        create_tickets(&c, &table).await;
        let levels = [
            tokio_postgres::IsolationLevel::RepeatableRead,
            tokio_postgres::IsolationLevel::Serializable,
        ];
        // The snapshot is taken by the transaction's first statement: the
        // ticket's insert, or a read (which leaves the transaction without
        // an id).
        for (level, writes) in levels.into_iter().flat_map(|l| [(l, true), (l, false)]) {
            let k = key(&format!("snapshot-{level:?}-{writes}"));
            let tx = begin(&mut c, level).await;
            if writes {
                insert_ticket(&tx, &table, &k).await;
            } else {
                tx.execute(&format!("SELECT count(*) FROM {table}"), &[])
                    .await
                    .expect("read");
            }
            let lease = acquire(&store, &k);
            let err = complete_in(&tx, &store, &lease, b"1").await.unwrap_err();
            assert!(
                matches!(&err, Error::Unavailable { detail } if detail.contains("snapshot")),
                "{level:?}: {err:?}"
            );
            assert!(is_aborted(&tx).await, "{level:?}");
            drop(tx);
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!((r.state(), r.token()), (State::Processing, lease.token()));
            assert_eq!(tickets_of(&c, &table, &k).await, 0);

            let tx = begin(&mut c, level).await;
            insert_ticket(&tx, &table, &k).await;
            complete_in(&tx, &store, &lease, b"1")
                .await
                .expect("complete_in");
            tx.commit().await.expect("commit");
            assert_eq!(
                store.get(&k).expect("get").expect("record").state(),
                State::Succeeded
            );
            assert_eq!(tickets_of(&c, &table, &k).await, 1);
        }
        // A released lease is stale under every level (READ UNCOMMITTED
        // runs as READ COMMITTED), and in every new transaction.
        for level in [
            tokio_postgres::IsolationLevel::RepeatableRead,
            tokio_postgres::IsolationLevel::Serializable,
            tokio_postgres::IsolationLevel::ReadUncommitted,
        ] {
            let k = key(&format!("snapshot-released-{level:?}"));
            let lease = acquire(&store, &k);
            store.release(lease.clone()).expect("release");
            let tx = begin(&mut c, level).await;
            insert_ticket(&tx, &table, &k).await;
            let err = complete_in(&tx, &store, &lease, b"1").await.unwrap_err();
            assert!(
                matches!(err, Error::StaleLease { .. }),
                "{level:?}: {err:?}"
            );
        }
        // A lease past retention is stale, whatever the snapshot shows.
        let k = key("snapshot-past-retention");
        let tx = begin(&mut c, tokio_postgres::IsolationLevel::RepeatableRead).await;
        insert_ticket(&tx, &table, &k).await;
        let lease = acquire(&store, &k);
        clock.advance(Duration::from_secs(24 * 3600));
        let err = complete_in(&tx, &store, &lease, b"1").await.unwrap_err();
        assert!(matches!(err, Error::StaleLease { .. }), "{err:?}");
    });
}

/// The store's own read that a completion under a snapshot makes is
/// bounded: queued behind a store call that waits for a row lock of the
/// caller's own transaction (one connection, busy with an extension of a
/// key the transaction completed), it gives up after a second and the
/// completion is `Unavailable`, rather than holding the caller's
/// transaction until that call's `lock_timeout` (5 s) ends it.
#[test]
fn a_snapshot_completions_store_read_does_not_wait_for_the_callers_own_locks() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_snapshot_read");
    let clock = ManualClock::new(T0);
    let store = std::sync::Arc::new(
        Store::connect(&url, config(&schema, &clock).postgres_connections(1)).expect("connect"),
    );
    runtime().block_on(async {
        let mut c = client(&url).await;
        let monitor = client(&url).await;
        let first = acquire(&store, &key("read-a"));
        let tx = begin(&mut c, tokio_postgres::IsolationLevel::RepeatableRead).await;
        tx.execute("SELECT 1", &[]).await.expect("snapshot");
        let second = acquire(&store, &key("read-b"));
        // The transaction completes the first key and holds its row.
        complete_in(&tx, &store, &first, b"1")
            .await
            .expect("complete_in");
        let (s, held) = (std::sync::Arc::clone(&store), first.clone());
        let extension = std::thread::spawn(move || s.extend(&held, LEASE));
        // This store's session, by its statement's schema: the other
        // tests of this binary run stores of their own on the server.
        wait_until(
            &monitor,
            "the extension waits for the row",
            &format!(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND application_name = 'idemstore' AND position('{schema}' in query) > 0"
            ),
        )
        .await;
        let err = complete_in(&tx, &store, &second, b"2").await.unwrap_err();
        assert!(
            matches!(&err, Error::Unavailable { detail } if detail.contains("did not answer within")),
            "{err:?}"
        );
        tx.rollback().await.expect("rollback");
        // Whatever the extension answered, the first key was not completed.
        let _ = extension.join().expect("extension thread");
        let r = store.get(&key("read-a")).expect("get").expect("record");
        assert_eq!(r.state(), State::Processing);
    });
}

/// `complete_in` sends each statement whole, unnamed with its parameters'
/// types: inside a transaction, locking and reading the row, reading the
/// clock and the update are three round trips, counted by a TCP proxy of
/// the test's own (a statement prepared by name takes one more each).
#[test]
fn a_completion_takes_one_round_trip_per_statement() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_round_trips");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let proxy = Proxy::start(upstream_of(&url));
    runtime().block_on(async {
        let mut c = client(&via(&url, &proxy)).await;
        for i in 0..3 {
            let k = key(&format!("round-trips-{i}"));
            let lease = acquire(&store, &k);
            let tx = c.transaction().await.expect("begin");
            proxy.take_round_trips();
            complete_in(&tx, &store, &lease, b"1")
                .await
                .expect("complete_in");
            assert_eq!(proxy.take_round_trips(), 3);
            tx.commit().await.expect("commit");
            assert_eq!(
                store.get(&k).expect("get").expect("record").state(),
                State::Succeeded
            );
        }
    });
}

/// Whether the caller's transaction `tx` is aborted: its next statement
/// fails.
async fn is_aborted(tx: &tokio_postgres::Transaction<'_>) -> bool {
    tx.execute("SELECT 1", &[]).await.is_err()
}

#[test]
fn every_refusal_aborts_the_callers_transaction() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_refusals");
    let clock = ManualClock::new(T0);
    let store = Store::connect(
        &url,
        config(&schema, &clock)
            .max_result_bytes(16)
            .max_failure_bytes(16),
    )
    .expect("connect");
    let table = table_of(&schema);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = Store::open(dir.path().join("s.redb")).expect("open");
    runtime().block_on(async {
        let mut c = client(&url).await;
        create_tickets(&c, &table).await;
        let k = key("refused-1");
        let lease = acquire(&store, &k);
        let long = [b'x'; 17];
        // Each refusal that is decided before anything is sent: the ticket
        // is inserted, the completion refused, and the caller's next
        // statement and its COMMIT must fail.
        for case in ["complete too large", "fail too large", "file store"] {
            let tx = c.transaction().await.expect("begin");
            insert_ticket(&tx, &table, &k).await;
            let err = match case {
                "complete too large" => complete_in(&tx, &store, &lease, &long).await,
                "fail too large" => fail_in(&tx, &store, &lease, &long, false).await,
                _ => complete_in(&tx, &file, &lease, b"1").await,
            }
            .unwrap_err();
            match case {
                "file store" => assert!(
                    matches!(err, Error::InvalidArgument { what: "store", .. }),
                    "{case}: {err:?}"
                ),
                _ => assert!(matches!(err, Error::TooLarge { .. }), "{case}: {err:?}"),
            }
            assert!(is_aborted(&tx).await, "{case}: the transaction goes on");
            let _ = tx.commit().await;
            assert_eq!(
                tickets_of(&c, &table, &k).await,
                0,
                "{case}: the effect was committed without the completion"
            );
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!(r.state(), State::Processing, "{case}");
        }
        // The lease still finishes the key.
        let tx = c.transaction().await.expect("begin");
        insert_ticket(&tx, &table, &k).await;
        complete_in(&tx, &store, &lease, b"ok")
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        assert_eq!(tickets_of(&c, &table, &k).await, 1);
    });
}

/// A stored row the driver cannot read (a column altered outside
/// idemstore) aborts the caller's transaction like any refusal: the
/// effect is never committed without its completion. Before, the error
/// was a configuration fault, taken for a server's refusal (which aborts
/// the transaction itself), and the transaction went on.
#[test]
fn an_unreadable_row_aborts_the_callers_transaction() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_unreadable");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = client(&url).await;
        create_tickets(&c, &table).await;
        let k = key("unreadable-1");
        let lease = acquire(&store, &k);
        c.batch_execute(&format!(
            "ALTER TABLE \"{schema}\".records ALTER COLUMN token TYPE numeric"
        ))
        .await
        .expect("alter");
        let tx = c.transaction().await.expect("begin");
        insert_ticket(&tx, &table, &k).await;
        let err = complete_in(&tx, &store, &lease, b"1").await.unwrap_err();
        assert!(matches!(err, Error::Storage(_)), "{err:?}");
        assert!(is_aborted(&tx).await, "the transaction goes on");
        let _ = tx.commit().await;
        assert_eq!(tickets_of(&c, &table, &k).await, 0);
    });
}

/// Row-level security active for the caller's role on the store's tables
/// (enabled outside idemstore, for an application role's tenant policies,
/// say) hides the key's row from `complete_in`, whose statements run on
/// the caller's connection. The completion is refused as a damaged schema
/// that names the remedy; it was `StaleLease`, which tells the current
/// holder to give the key up, and every attempt met it again. With the
/// caller's `row_security = off` the server refuses the read instead
/// (42501): the same answer. Either way the caller's transaction is
/// aborted, nothing is committed and the key stays the holder's; with
/// row-level security off again, the same lease completes the key.
#[test]
fn row_level_security_for_the_callers_role_is_a_damaged_schema_not_a_stale_lease() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_rls");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    let role = format!("app_{schema}");
    runtime().block_on(async {
        let admin = client(&url).await;
        create_tickets(&admin, &table).await;
        admin
            .batch_execute(&format!(
                "CREATE ROLE {role} LOGIN; \
                 GRANT USAGE ON SCHEMA \"{schema}\" TO {role}; \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" \
                 TO {role}; \
                 GRANT SELECT, INSERT ON {table} TO {role}; \
                 GRANT USAGE ON SEQUENCE {table}_id_seq TO {role}; \
                 ALTER TABLE \"{schema}\".records ENABLE ROW LEVEL SECURITY"
            ))
            .await
            .expect("the application's role");
        let k = key("rls-1");
        let lease = acquire(&store, &k);
        let mut c = client(&pg::with_user(&url, &role)).await;
        for setting in ["on", "off"] {
            let tx = c.transaction().await.expect("begin");
            tx.batch_execute(&format!("SET LOCAL row_security = {setting}"))
                .await
                .expect("set row_security");
            insert_ticket(&tx, &table, &k).await;
            match complete_in(&tx, &store, &lease, b"1").await {
                Err(Error::Misconfigured {
                    fault: ConfigFault::SchemaDamaged,
                    detail,
                }) => {
                    for words in [
                        "row-level security",
                        "DISABLE ROW LEVEL SECURITY",
                        "BYPASSRLS",
                    ] {
                        assert!(detail.contains(words), "row_security {setting}: {detail}");
                    }
                }
                other => panic!("row_security {setting}: expected SchemaDamaged, got {other:?}"),
            }
            assert!(
                is_aborted(&tx).await,
                "row_security {setting}: the transaction goes on"
            );
            let _ = tx.commit().await;
            assert_eq!(
                tickets_of(&admin, &table, &k).await,
                0,
                "row_security {setting}"
            );
        }
        let r = store.get(&k).expect("get").expect("record");
        assert_eq!(
            (r.state(), r.token()),
            (State::Processing, lease.token()),
            "the holder keeps the key"
        );
        // On `meta` alone, which hides the store's identity: the same
        // answer, naming `meta` (it was OtherStore, "no store identity").
        admin
            .batch_execute(&format!(
                "ALTER TABLE \"{schema}\".records DISABLE ROW LEVEL SECURITY; \
                 ALTER TABLE \"{schema}\".meta ENABLE ROW LEVEL SECURITY"
            ))
            .await
            .expect("row-level security on meta");
        let tx = c.transaction().await.expect("begin");
        match complete_in(&tx, &store, &lease, b"1").await {
            Err(Error::Misconfigured {
                fault: ConfigFault::SchemaDamaged,
                detail,
            }) => assert!(
                detail.contains("meta has row-level security active"),
                "{detail}"
            ),
            other => panic!("meta: expected SchemaDamaged, got {other:?}"),
        }
        assert!(is_aborted(&tx).await, "meta: the transaction goes on");
        drop(tx);
        admin
            .batch_execute(&format!(
                "ALTER TABLE \"{schema}\".meta DISABLE ROW LEVEL SECURITY"
            ))
            .await
            .expect("disable row-level security");
        let tx = c.transaction().await.expect("begin");
        insert_ticket(&tx, &table, &k).await;
        complete_in(&tx, &store, &lease, b"ok")
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        assert_eq!(tickets_of(&admin, &table, &k).await, 1);
        // A policy that hides nothing: a lease whose record is gone
        // (released) is StaleLease, as without row-level security, not the
        // policy's refusal: the store's own read shows the key not held.
        admin
            .batch_execute(&format!(
                "ALTER TABLE \"{schema}\".records ENABLE ROW LEVEL SECURITY; \
                 CREATE POLICY every_row ON \"{schema}\".records TO {role} \
                 USING (true) WITH CHECK (true)"
            ))
            .await
            .expect("a policy that hides nothing");
        let gone = key("rls-2");
        let old = acquire(&store, &gone);
        store.release(old.clone()).expect("release");
        assert!(
            store.get(&gone).expect("get").is_none(),
            "released: no record"
        );
        let tx = c.transaction().await.expect("begin");
        match complete_in(&tx, &store, &old, b"1").await {
            Err(Error::StaleLease { token, .. }) => assert_eq!(token, old.token()),
            other => panic!("a released lease: expected StaleLease, got {other:?}"),
        }
        drop(tx);
        drop(c);
        admin
            .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
            .await
            .expect("drop the role");
    });
}

/// Polls `check` on `client` until it holds (hang guard).
async fn wait_until(client: &Client, what: &str, sql: &str) {
    let deadline = std::time::Instant::now() + pg::proxy::HANG_GUARD;
    loop {
        let n: i64 = client.query_one(sql, &[]).await.expect(what).get(0);
        if n > 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The database clock, ms since the epoch.
async fn db_now(client: &Client) -> u64 {
    let ms: i64 = client
        .query_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await
        .expect("clock")
        .get(0);
    u64::try_from(ms).expect("a positive time")
}

/// A claim that waits behind an import (whose lock on the records table,
/// taken before it raises the token sequence, waits for an open
/// `complete_in` transaction) is decided at a time read after that wait:
/// its lease runs from when the claim could proceed, not from before it
/// waited.
#[test]
fn a_claim_that_waited_for_locks_gets_a_lease_from_after_the_wait() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_lapse");
    let lease = Duration::from_secs(1);
    // The database clock: the test clock is read after every wait anyway.
    let store = Store::connect(
        &url,
        Config::new()
            .postgres_schema(&schema)
            .postgres_connections(4)
            .lease(lease)
            .sweep_interval(None),
    )
    .expect("connect");
    // The import runs in another replica: this process's monotonic clock
    // must not carry the import's later reading over to the claim.
    let replica = Store::connect(
        &url,
        Config::new()
            .postgres_schema(&schema)
            .postgres_connections(2)
            .lease(lease)
            .sweep_interval(None),
    )
    .expect("connect the replica");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let held = key("lapse-held");
    let held_lease = acquire(&store, &held);
    let mut export = Vec::new();
    store.export(&mut export, |_| {}).expect("export");
    let mut c = rt.block_on(client(&url));
    let monitor = rt.block_on(client(&url));
    let tx = rt.block_on(c.transaction()).expect("begin");
    // The caller's transaction locks the held key's row.
    rt.block_on(complete_in(&tx, &store, &held_lease, b"done"))
        .expect("complete_in");
    std::thread::scope(|s| {
        // The import's lock on the records table (or, after it, on the
        // row) waits for the caller's transaction.
        let import = s.spawn(|| replica.import(&export[..], |_| {}));
        // Sessions of this test's schema only, by their statements: the
        // other tests of this binary run stores of their own on the server.
        rt.block_on(wait_until(
            &monitor,
            "the import waits for the table or the row",
            &format!(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND wait_event IN ('relation', 'transactionid', 'tuple') \
                 AND position('{schema}' in query) > 0"
            ),
        ));
        // A claim of another key waits behind the import.
        let claim = s.spawn(|| acquire(&store, &key("lapse-fresh")));
        rt.block_on(wait_until(
            &monitor,
            "the claim waits behind the import",
            &format!(
                "SELECT (count(*) >= 2)::int::bigint FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND position('{schema}' in query) > 0"
            ),
        ));
        // Longer than the lease passes while the claim waits.
        let waiting_since = rt.block_on(db_now(&monitor));
        let lapsed = waiting_since + 2 * u64::try_from(lease.as_millis()).expect("ms");
        while rt.block_on(db_now(&monitor)) <= lapsed {
            std::thread::sleep(Duration::from_millis(50));
        }
        let released = rt.block_on(db_now(&monitor));
        rt.block_on(tx.commit()).expect("commit");
        import.join().expect("import thread").expect("import");
        let fresh = claim.join().expect("claim thread");
        // The claim could not proceed before the commit above: its lease
        // runs at least a full lease from there.
        let until = fresh.lease_until_ms().expect("a lease deadline");
        assert!(
            until >= released + 1000,
            "acquired with a lease ending at {until}, but the claim waited until {released}: \
             lapsed {} ms before it was answered",
            (released + 1000).saturating_sub(until)
        );
    });
}

/// On a client outside a transaction block, the completion's `UPDATE`
/// commits on its own: when its answer is lost, the outcome is unknown
/// (and it was in fact applied). Inside a transaction block, the same loss
/// leaves nothing applied.
#[test]
fn a_lost_answer_of_an_autocommit_completion_is_outcome_unknown() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("txn_lost");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let rt = runtime();
    for in_block in [false, true] {
        let k = key(&format!("lost-{in_block}"));
        let lease = acquire(&store, &k);
        let proxy = pg::proxy::Proxy::start(pg::proxy::upstream_of(&url));
        let err = rt.block_on(async {
            let (c, connection) = tokio_postgres::connect(&pg::proxy::via(&url, &proxy), NoTls)
                .await
                .expect("connect through the proxy");
            tokio::spawn(connection);
            if in_block {
                c.batch_execute("BEGIN").await.expect("begin");
            }
            // The completion's UPDATE (not the lock's `FOR UPDATE`), sent
            // whole: Parse, Bind and Execute in one flight.
            proxy.lose_answer_to(b"UPDATE \"");
            complete_in(&c, &store, &lease, b"applied")
                .await
                .unwrap_err()
        });
        assert_eq!(
            proxy.cut_chunk_type(),
            Some(b'P'),
            "the fault must fire on the UPDATE, sent with its Parse"
        );
        if in_block {
            assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
            // The server rolls the transaction back once the connection is
            // gone; the key stays Processing under the lease.
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!(r.state(), State::Processing);
            continue;
        }
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");
        // It was applied: the caller must read the key, not retry blindly.
        let deadline = std::time::Instant::now() + pg::proxy::HANG_GUARD;
        loop {
            let r = store.get(&k).expect("get").expect("record");
            if r.state() == State::Succeeded {
                assert_eq!(r.result(), Some(&b"applied"[..]));
                break;
            }
            assert!(std::time::Instant::now() < deadline, "never applied");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
