//! The effect and the completion in one transaction over **sqlx** (feature
//! `sqlx`): `idemstore::postgres::sqlx::complete_in` and `fail_in` inside
//! the caller's own sqlx transaction, with a tickets table in the same
//! database; the cases of `tests/pg_txn.rs` for the `tokio-postgres` form:
//!
//! - commit: the record is Succeeded and the ticket row exists (the
//!   future is `Send`: it runs on a multi-thread runtime's task);
//! - rollback: neither; the key stays Processing and is taken over once
//!   its lease lapses;
//! - a stale lease (taken over): `Error::StaleLease`, the caller's
//!   transaction is aborted (its `COMMIT` rolls back), no ticket row;
//! - every refusal decided before anything is sent (a result or failure
//!   over its limit, a file store) aborts the caller's transaction too;
//! - a process killed between the two statements (a child that inserted
//!   the ticket, and one that also completed the key, both SIGKILLed
//!   before `COMMIT`): no ticket row, the key still Processing, then taken
//!   over after the lease;
//! - a REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates
//!   the claim: `Error::Unavailable`, not `StaleLease`;
//! - a lost answer (a TCP proxy of the test's own cuts the connection once
//!   the completion's `UPDATE` is sent): outside a transaction block the
//!   `UPDATE` commits on its own, so the error is `Error::OutcomeUnknown`
//!   (and it was applied); inside one, `Error::Unavailable` (and nothing
//!   was).
//! - row-level security active for the caller's role on the store's
//!   tables: `Misconfigured(SchemaDamaged)` naming the remedy, not
//!   `StaleLease`, and the caller's transaction aborted.
//!
//! The server is the throwaway one of `tests/pg`; `IDEMSTORE_SKIP_POSTGRES=1`
//! skips these tests.

mod common;
mod pg;
#[path = "../examples/ticket_txn_sqlx/recipe.rs"]
mod recipe;

use std::time::Duration;

use common::{child_role, child_var, child_var_parsed, ready_and_wait, report, spawn_child};
use idemstore::postgres::sqlx::{complete_in, fail_in};
use idemstore::{ClaimOptions, ClaimOutcome, Clock, Error, Key, ManualClock, State, Store};
use pg::txn::{LEASE, T0, acquire, config, fp, key, runtime, table_of};
use sqlx::{Connection, PgConnection};

async fn connect(url: &str) -> PgConnection {
    PgConnection::connect(url).await.expect("connect")
}

async fn tickets_of(conn: &mut PgConnection, table: &str, key: &Key) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE idempotency_key = $1"
    ))
    .bind(key.reference())
    .fetch_one(conn)
    .await
    .expect("count")
}

async fn insert_ticket(conn: &mut PgConnection, table: &str, key: &Key) -> i64 {
    recipe::insert_ticket(conn, table, &key.reference(), "printer on fire")
        .await
        .expect("insert ticket")
}

/// Whether the caller's transaction on `conn` is aborted: its next
/// statement fails.
async fn is_aborted(conn: &mut PgConnection) -> bool {
    sqlx::query("SELECT 1").execute(conn).await.is_err()
}

#[test]
fn commit_stores_the_ticket_and_the_completion_together() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_commit");
    let clock = ManualClock::new(T0);
    let store =
        std::sync::Arc::new(Store::connect(&url, config(&schema, &clock)).expect("connect"));
    let table = table_of(&schema);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let k = key("commit-1");
    let lease = acquire(&store, &k);
    clock.advance(Duration::from_millis(5));
    // On a task of a multi-thread runtime: the futures are Send, as an
    // axum handler needs.
    let task = {
        let (store, url, table, k, lease) = (
            store.clone(),
            url.clone(),
            table.clone(),
            k.clone(),
            lease.clone(),
        );
        rt.spawn(async move {
            let mut c = connect(&url).await;
            recipe::create_table(&mut c, &table)
                .await
                .expect("create tickets");
            let mut tx = c.begin().await.expect("begin");
            let id = insert_ticket(&mut tx, &table, &k).await;
            let record = complete_in(&mut tx, &store, &lease, id.to_string().as_bytes())
                .await
                .expect("complete_in");
            assert_eq!(record.state(), State::Succeeded);
            assert_eq!(record.updated_ms(), T0 + 5, "decided at the store's clock");
            // Not visible to the store before the caller commits.
            let before = store.get_async(&k).await.expect("get").expect("record");
            assert_eq!(before.state(), State::Processing);
            tx.commit().await.expect("commit");
            id
        })
    };
    let id = rt.block_on(task).expect("the task");
    let after = store.get(&k).expect("get").expect("record");
    assert_eq!(after.state(), State::Succeeded);
    assert_eq!(after.result(), Some(id.to_string().as_bytes()));
    assert_eq!(after.token(), lease.token());
    // Every later claim replays it.
    match store.claim(&k, &fp(), &ClaimOptions::new()).expect("claim") {
        ClaimOutcome::Replay(r) => assert_eq!(r.result(), Some(id.to_string().as_bytes())),
        other => panic!("expected a replay, got {other:?}"),
    }
    rt.block_on(async {
        let mut c = connect(&url).await;
        assert_eq!(tickets_of(&mut c, &table, &k).await, 1);
        // The lease is finished: a second completion is stale.
        let mut tx = c.begin().await.expect("begin");
        let err = complete_in(&mut tx, &store, &lease, b"again")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::StaleLease { .. }), "{err:?}");
        drop(tx);

        // fail_in: a permanent failure, committed with the caller's write.
        let k2 = key("fail-1");
        let lease2 = acquire(&store, &k2);
        let mut tx = c.begin().await.expect("begin");
        sqlx::query(&format!(
            "INSERT INTO {table} (idempotency_key, title) VALUES ($1, 'refused: logged')"
        ))
        .bind(k2.reference())
        .execute(&mut *tx)
        .await
        .expect("insert");
        let failed = fail_in(&mut tx, &store, &lease2, b"no such printer", false)
            .await
            .expect("fail_in");
        assert_eq!(failed.state(), State::Failed { retryable: false });
        tx.commit().await.expect("commit");
        let r = store.get(&k2).expect("get").expect("record");
        assert_eq!(r.failure(), Some(&b"no such printer"[..]));
        assert_eq!(tickets_of(&mut c, &table, &k2).await, 1);
    });
}

#[test]
fn rollback_keeps_neither_and_the_key_is_taken_over_after_its_lease() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_rollback");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = connect(&url).await;
        recipe::create_table(&mut c, &table)
            .await
            .expect("create tickets");
        let k = key("rollback-1");
        let lease = acquire(&store, &k);

        let mut tx = c.begin().await.expect("begin");
        insert_ticket(&mut tx, &table, &k).await;
        complete_in(&mut tx, &store, &lease, b"1")
            .await
            .expect("complete_in");
        tx.rollback().await.expect("rollback");

        assert_eq!(tickets_of(&mut c, &table, &k).await, 0);
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
        // The new holder finishes it in one transaction (the recipe).
        let id = recipe::create_ticket(&mut c, &store, &table, &next, "printer on fire", async {})
            .await
            .expect("create_ticket");
        assert_eq!(tickets_of(&mut c, &table, &k).await, 1);
        let r = store.get(&k).expect("get").expect("record");
        assert_eq!(r.state(), State::Succeeded);
        assert_eq!(r.result(), Some(id.to_string().as_bytes()));
    });
}

#[test]
fn a_stale_lease_aborts_the_callers_transaction() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_stale");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = connect(&url).await;
        recipe::create_table(&mut c, &table)
            .await
            .expect("create tickets");
        let k = key("stale-1");
        let old = acquire(&store, &k);
        clock.advance(LEASE + Duration::from_millis(1));
        let new = acquire(&store, &k);
        assert!(new.token() > old.token());

        let mut tx = c.begin().await.expect("begin");
        insert_ticket(&mut tx, &table, &k).await;
        let err = complete_in(&mut tx, &store, &old, b"1").await.unwrap_err();
        match &err {
            Error::StaleLease { token, .. } => assert_eq!(*token, old.token()),
            other => panic!("expected StaleLease, got {other:?}"),
        }
        // The transaction is aborted: nothing more runs in it, and even a
        // COMMIT of it rolls back.
        assert!(
            is_aborted(&mut tx).await,
            "the caller's transaction must be aborted"
        );
        let _ = tx.commit().await;

        assert_eq!(tickets_of(&mut c, &table, &k).await, 0);
        let r = store.get(&k).expect("get").expect("record");
        assert_eq!(r.state(), State::Processing);
        assert_eq!(r.token(), new.token(), "the new holder keeps the key");
        // The recipe answers StaleLease and creates no ticket.
        let err = recipe::create_ticket(&mut c, &store, &table, &old, "t", async {})
            .await
            .unwrap_err();
        assert!(
            matches!(err.downcast_ref::<Error>(), Some(Error::StaleLease { .. })),
            "{err:?}"
        );
        assert_eq!(tickets_of(&mut c, &table, &k).await, 0);
    });
}

/// A caller's REPEATABLE READ or SERIALIZABLE transaction whose snapshot
/// was taken before the key was claimed does not see the key's row: its
/// completion is `Unavailable` and aborts it (it was `StaleLease` for the
/// current holder); in a new transaction the same completion commits.
#[test]
fn a_snapshot_from_before_the_claim_is_unavailable_not_a_stale_lease() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_snapshot");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    runtime().block_on(async {
        let mut c = connect(&url).await;
        recipe::create_table(&mut c, &table)
            .await
            .expect("create tickets");
        for level in ["REPEATABLE READ", "SERIALIZABLE"] {
            let k = key(&format!("snapshot-{level}"));
            let mut tx = c.begin().await.expect("begin");
            sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
                .execute(&mut *tx)
                .await
                .expect("isolation");
            insert_ticket(&mut tx, &table, &k).await;
            let lease = acquire(&store, &k);
            let err = complete_in(&mut tx, &store, &lease, b"1")
                .await
                .unwrap_err();
            assert!(
                matches!(&err, Error::Unavailable { detail } if detail.contains("snapshot")),
                "{level}: {err:?}"
            );
            assert!(is_aborted(&mut tx).await, "{level}");
            drop(tx);
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!((r.state(), r.token()), (State::Processing, lease.token()));

            let mut tx = c.begin().await.expect("begin");
            sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
                .execute(&mut *tx)
                .await
                .expect("isolation");
            insert_ticket(&mut tx, &table, &k).await;
            complete_in(&mut tx, &store, &lease, b"1")
                .await
                .expect("complete_in");
            tx.commit().await.expect("commit");
            assert_eq!(
                store.get(&k).expect("get").expect("record").state(),
                State::Succeeded
            );
            assert_eq!(tickets_of(&mut c, &table, &k).await, 1);
        }
    });
}

#[test]
fn every_refusal_aborts_the_callers_transaction() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_refusals");
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
        let mut c = connect(&url).await;
        recipe::create_table(&mut c, &table)
            .await
            .expect("create tickets");
        let k = key("refused-1");
        let lease = acquire(&store, &k);
        let long = [b'x'; 17];
        // Each refusal that is decided before anything is sent: the ticket
        // is inserted, the completion refused, and the caller's next
        // statement and its COMMIT must fail.
        for case in ["complete too large", "fail too large", "file store"] {
            let mut tx = c.begin().await.expect("begin");
            insert_ticket(&mut tx, &table, &k).await;
            let err = match case {
                "complete too large" => complete_in(&mut tx, &store, &lease, &long).await,
                "fail too large" => fail_in(&mut tx, &store, &lease, &long, false).await,
                _ => complete_in(&mut tx, &file, &lease, b"1").await,
            }
            .unwrap_err();
            match case {
                "file store" => assert!(
                    matches!(err, Error::InvalidArgument { what: "store", .. }),
                    "{case}: {err:?}"
                ),
                _ => assert!(matches!(err, Error::TooLarge { .. }), "{case}: {err:?}"),
            }
            assert!(is_aborted(&mut tx).await, "{case}: the transaction goes on");
            let _ = tx.commit().await;
            assert_eq!(
                tickets_of(&mut c, &table, &k).await,
                0,
                "{case}: the effect was committed without the completion"
            );
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!(r.state(), State::Processing, "{case}");
        }
        // A trigger added outside idemstore whose function fails (a
        // division by zero, 22012): a damaged schema, which no retry mends
        // (it was `Unavailable`); the caller's transaction is aborted.
        for sql in [
            format!(
                "CREATE FUNCTION \"{schema}\".audit() RETURNS trigger LANGUAGE plpgsql AS \
                 $$BEGIN PERFORM 1 / 0; RETURN NEW; END$$"
            ),
            format!(
                "CREATE TRIGGER audit BEFORE UPDATE ON \"{schema}\".records \
                 FOR EACH ROW EXECUTE FUNCTION \"{schema}\".audit()"
            ),
        ] {
            sqlx::raw_sql(&sql)
                .execute(&mut c)
                .await
                .expect("add the trigger");
        }
        let mut tx = c.begin().await.expect("begin");
        insert_ticket(&mut tx, &table, &k).await;
        match complete_in(&mut tx, &store, &lease, b"ok").await {
            Err(Error::Misconfigured { fault, detail }) => {
                assert_eq!(fault, idemstore::ConfigFault::SchemaDamaged, "{detail}");
                assert!(detail.contains("22012"), "{detail}");
            }
            other => panic!("a completion under a failing trigger: {other:?}"),
        }
        assert!(is_aborted(&mut tx).await, "the transaction goes on");
        drop(tx);
        sqlx::raw_sql(&format!("DROP TRIGGER audit ON \"{schema}\".records"))
            .execute(&mut c)
            .await
            .expect("drop the trigger");
        // The lease still finishes the key.
        let mut tx = c.begin().await.expect("begin");
        insert_ticket(&mut tx, &table, &k).await;
        complete_in(&mut tx, &store, &lease, b"ok")
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        assert_eq!(tickets_of(&mut c, &table, &k).await, 1);
    });
}

/// The child of [`a_process_killed_between_the_statements_commits_nothing`]:
/// claims its key and runs the recipe of `examples/ticket_txn_sqlx`,
/// killed between the ticket's insert and the completion (`TXN_STAGE`
/// `inserted`); or inserts the ticket and completes the key, killed before
/// `COMMIT` (`completed`).
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
    let mut c = rt.block_on(connect(&url));
    rt.block_on(async {
        if stage == "inserted" {
            let killed_here = async { ready_and_wait() };
            let _ = recipe::create_ticket(&mut c, &store, &table, &lease, "t", killed_here).await;
            unreachable!("killed between the statements");
        }
        // The transaction is left open: BEGIN, the ticket, the completion.
        let mut tx = c.begin().await.expect("begin");
        insert_ticket(&mut tx, &table, &k).await;
        complete_in(&mut tx, &store, &lease, b"ticket")
            .await
            .expect("complete_in");
        ready_and_wait()
    })
}

#[test]
fn a_process_killed_between_the_statements_commits_nothing() {
    const NAME: &str = "a_process_killed_between_the_statements_commits_nothing";
    if child_role(NAME) {
        killed_child();
    }
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_killed");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    let rt = runtime();
    let mut c = rt.block_on(connect(&url));
    rt.block_on(recipe::create_table(&mut c, &table))
        .expect("create tickets");
    for stage in ["inserted", "completed"] {
        let k = key(&format!("killed-{stage}"));
        let vars = [
            ("TXN_URL", url.clone()),
            ("TXN_SCHEMA", schema.clone()),
            ("TXN_TABLE", table.clone()),
            ("TXN_KEY", format!("killed-{stage}")),
            ("TXN_STAGE", stage.to_string()),
            ("TXN_T0", clock.now_ms().to_string()),
        ];
        let mut child = spawn_child(NAME, &vars);
        let reports = child.wait_ready();
        let token: u64 = reports["token"].parse().expect("token");
        child.kill();

        // The server rolls the dead client's transaction back once it sees
        // the connection gone; nothing of it was ever visible.
        rt.block_on(async {
            assert_eq!(tickets_of(&mut c, &table, &k).await, 0, "{stage}");
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
            recipe::create_ticket(&mut c, &store, &table, &next, "t", async {})
                .await
                .expect("create_ticket");
            assert_eq!(tickets_of(&mut c, &table, &k).await, 1, "{stage}");
        });
        assert_eq!(
            store.get(&k).expect("get").expect("record").state(),
            State::Succeeded,
            "{stage}"
        );
    }
}

/// On a connection outside a transaction block, the completion's `UPDATE`
/// commits on its own: when its answer is lost, the outcome is unknown
/// (and it was in fact applied). Inside a transaction block, the same loss
/// leaves nothing applied.
#[test]
fn a_lost_answer_of_an_autocommit_completion_is_outcome_unknown() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_lost");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let rt = runtime();
    for in_block in [false, true] {
        let k = key(&format!("lost-{in_block}"));
        let lease = acquire(&store, &k);
        let proxy = pg::proxy::Proxy::start(pg::proxy::upstream_of(&url));
        let err = rt.block_on(async {
            // The server's URL with the proxy's host and port.
            let options: sqlx::postgres::PgConnectOptions = url.parse().expect("a URL");
            let options = options.host("127.0.0.1").port(proxy.port());
            let mut c = PgConnection::connect_with(&options)
                .await
                .expect("connect through the proxy");
            if in_block {
                sqlx::Executor::execute(&mut c, "BEGIN")
                    .await
                    .expect("begin");
            }
            // The completion's UPDATE (not the lock's `FOR UPDATE`).
            proxy.lose_answer_after(b"UPDATE \"");
            complete_in(&mut c, &store, &lease, b"applied")
                .await
                .unwrap_err()
        });
        // sqlx parses an unnamed statement in a round trip of its own,
        // then binds and runs it: the fault fires on that Bind.
        assert_eq!(
            proxy.cut_chunk_type(),
            Some(b'B'),
            "the fault must fire on the UPDATE's Bind"
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

/// `complete_in` given a connection to another database, whose schema of
/// the store's name holds another store (a staging copy, say), is refused
/// with `Misconfigured` (`ConfigFault::OtherStore`) under READ COMMITTED
/// and REPEATABLE READ alike, aborts the caller's transaction, and writes
/// nothing: the key is still Processing under its lease in the store's own
/// database, and a connection to it completes it. (The other store's row
/// was judged instead: `StaleLease` for the current lease under READ
/// COMMITTED, and "run the transaction again" at every try under
/// REPEATABLE READ.)
#[test]
fn a_connection_to_another_store_is_refused_as_such() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_other_store");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let rt = runtime();
    let db = schema.clone();
    rt.block_on(async {
        let mut admin = connect(&url).await;
        sqlx::query(&format!("CREATE DATABASE \"{db}\""))
            .execute(&mut admin)
            .await
            .expect("create the other database");
    });
    let other_url = pg::with_db(&url, &db);
    idemstore::postgres::migrate(&other_url, &schema).expect("a store of the same schema there");
    let k = key("other-store");
    let lease = acquire(&store, &k);
    for isolation in ["READ COMMITTED", "REPEATABLE READ"] {
        rt.block_on(async {
            let mut conn = connect(&other_url).await;
            let mut tx = conn.begin().await.expect("begin");
            sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {isolation}"))
                .execute(&mut *tx)
                .await
                .expect("isolation");
            match complete_in(&mut tx, &store, &lease, b"1").await {
                Err(Error::Misconfigured {
                    fault: idemstore::ConfigFault::OtherStore,
                    detail,
                }) => assert!(detail.contains("another store"), "{detail}"),
                other => panic!("{isolation}: expected OtherStore, got {other:?}"),
            }
            assert!(is_aborted(&mut tx).await, "{isolation}: not aborted");
            tx.rollback().await.expect("rollback");
        });
    }
    let record = store.get(&k).expect("get").expect("record");
    assert_eq!(
        (record.state(), record.token()),
        (State::Processing, lease.token())
    );
    rt.block_on(async {
        let mut conn = connect(&url).await;
        let mut tx = conn.begin().await.expect("begin");
        complete_in(&mut tx, &store, &lease, b"1")
            .await
            .expect("the store's own database");
        tx.commit().await.expect("commit");
        let mut admin = connect(&url).await;
        sqlx::query(&format!("DROP DATABASE \"{db}\" WITH (FORCE)"))
            .execute(&mut admin)
            .await
            .expect("drop the other database");
    });
    assert_eq!(store.get(&k).unwrap().unwrap().state(), State::Succeeded);
}

/// Row-level security active for the caller's role on the store's tables
/// hides the key's row from `complete_in` on the caller's connection: a
/// damaged schema that names the remedy (it was `StaleLease`), and with
/// the caller's `row_security = off`, the server's refusal (42501) is the
/// same answer (it was `PermissionDenied`, where `tokio-postgres` said
/// `SchemaDamaged`). The caller's transaction is aborted, nothing is
/// committed, the key stays the holder's; with row-level security off
/// again, the same lease completes it (`tests/pg_txn.rs` has the same
/// case over `tokio-postgres`).
#[test]
fn row_level_security_for_the_callers_role_is_a_damaged_schema_not_a_stale_lease() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("sqlx_rls");
    let clock = ManualClock::new(T0);
    let store = Store::connect(&url, config(&schema, &clock)).expect("connect");
    let table = table_of(&schema);
    let role = format!("app_{schema}");
    runtime().block_on(async {
        let mut admin = connect(&url).await;
        recipe::create_table(&mut admin, &table)
            .await
            .expect("create tickets");
        sqlx::raw_sql(&format!(
            "CREATE ROLE {role} LOGIN; \
             GRANT USAGE ON SCHEMA \"{schema}\" TO {role}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" \
             TO {role}; \
             GRANT SELECT, INSERT ON {table} TO {role}; \
             GRANT USAGE ON SEQUENCE {table}_id_seq TO {role}; \
             ALTER TABLE \"{schema}\".records ENABLE ROW LEVEL SECURITY"
        ))
        .execute(&mut admin)
        .await
        .expect("the application's role");
        let k = key("rls-1");
        let lease = acquire(&store, &k);
        let mut c = connect(&pg::with_user(&url, &role)).await;
        for setting in ["on", "off"] {
            let mut tx = c.begin().await.expect("begin");
            sqlx::query(&format!("SET LOCAL row_security = {setting}"))
                .execute(&mut *tx)
                .await
                .expect("set row_security");
            insert_ticket(&mut tx, &table, &k).await;
            match complete_in(&mut tx, &store, &lease, b"1").await {
                Err(Error::Misconfigured {
                    fault: idemstore::ConfigFault::SchemaDamaged,
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
                is_aborted(&mut tx).await,
                "row_security {setting}: the transaction goes on"
            );
            let _ = tx.commit().await;
            assert_eq!(
                tickets_of(&mut admin, &table, &k).await,
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
        sqlx::raw_sql(&format!(
            "ALTER TABLE \"{schema}\".records DISABLE ROW LEVEL SECURITY"
        ))
        .execute(&mut admin)
        .await
        .expect("disable row-level security");
        let mut tx = c.begin().await.expect("begin");
        insert_ticket(&mut tx, &table, &k).await;
        complete_in(&mut tx, &store, &lease, b"ok")
            .await
            .expect("complete_in");
        tx.commit().await.expect("commit");
        assert_eq!(tickets_of(&mut admin, &table, &k).await, 1);
        c.close().await.expect("close");
        sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
            .execute(&mut admin)
            .await
            .expect("drop the role");
    });
}
