//! Every wait of the PostgreSQL engine is bounded (feature `postgres`),
//! on a real server behind a TCP proxy of the test's own
//! (`tests/pg/proxy.rs`):
//!
//! - a half-open connection (the proxy stops forwarding, closing nothing):
//!   every call returns by its deadline, `Unavailable` when its `COMMIT`
//!   was not sent (and nothing was applied) and `OutcomeUnknown` when it
//!   was (and it was applied); the store serves again once forwarding
//!   resumes, and dropping it does not wait for the proxy (a claim of an
//!   absent key is one autocommit statement, its own COMMIT: once sent, it
//!   is `OutcomeUnknown`);
//! - a server that accepts a connection and then says nothing holds its
//!   opening no longer than `connect_timeout`;
//! - a caller's `complete_in` transaction that holds a row longer than
//!   `lock_timeout` holds a batch that includes that row no longer than
//!   that, and no other key at all; a claim of another key group-committed
//!   with a claim of the held key is decided, and only the held key's is
//!   refused;
//! - the worker connections follow the load (counted in
//!   `pg_stat_activity` by an application name of the test's own): none
//!   before the first call, one for a lone sequential caller, more (never
//!   above `postgres_connections`) for concurrent callers, and none again
//!   once `connection_idle_timeout` has passed unused; a sync caller's
//!   direct connection closes after that time unused too (as a client
//!   should: not counted abandoned by the server), and its next call
//!   opens it again.
//!
//! The hang guards are generous bounds that only a hang reaches.
//! `IDEMSTORE_SKIP_POSTGRES=1` skips these tests.

mod common;
mod pg;

use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use idemstore::postgres::complete_in;
use idemstore::postgres::tokio_postgres::{self, NoTls};
use idemstore::{
    ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, ImportOptions, Key, ManualClock,
    PostgresLimits, PostgresPooler, State, Store,
};
use pg::proxy::{HANG_GUARD, Proxy, upstream_of, via};

fn key(id: &str) -> Key {
    Key::new("limits", id).expect("key")
}

fn fp() -> Fingerprint {
    Fingerprint::of(b"payload")
}

/// A runtime of its own and a client connected to `url` on it (the
/// connection driven by the runtime), for the test's own statements.
fn client_of(url: &str) -> (tokio::runtime::Runtime, tokio_postgres::Client) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (client, connection) = rt
        .block_on(tokio_postgres::connect(url, NoTls))
        .expect("connect");
    rt.spawn(connection);
    (rt, client)
}

/// Runs `call` on a thread of its own and returns its answer, failing the
/// test if it has not returned within the hang guard.
fn guarded<T: Send + 'static>(what: &str, call: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let _ = tx.send(call());
    });
    rx.recv_timeout(HANG_GUARD)
        .unwrap_or_else(|_| panic!("{what} did not return: a wait is unbounded"))
}

fn claim(store: &Arc<Store>, id: &str) -> idemstore::Result<ClaimOutcome> {
    let store = Arc::clone(store);
    let k = key(id);
    guarded(&format!("claim {id}"), move || {
        store.claim(&k, &fp(), &ClaimOptions::new())
    })
}

/// A claim with a business key (`bk-<id>`): the general path, a
/// transaction whose COMMIT is sent last.
fn claim_bk(store: &Arc<Store>, id: &str) -> idemstore::Result<ClaimOutcome> {
    let store = Arc::clone(store);
    let k = key(id);
    let bk = format!("bk-{id}");
    guarded(&format!("claim {id}"), move || {
        store.claim(&k, &fp(), &ClaimOptions::new().business_key(bk))
    })
}

#[test]
fn a_half_open_connection_bounds_every_call_and_the_store_recovers() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_half_open");
    // Created directly; the store under test goes through the proxy.
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(2);
    limits.connect_timeout = Duration::from_secs(1);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(2)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&via(&url, &proxy), config).expect("connect"));
    assert!(matches!(
        claim(&store, "warm"),
        Ok(ClaimOutcome::Acquired(_))
    ));

    // Half-open: nothing forwarded either way, nothing closed. A claim of
    // an absent key is one autocommit statement (the hot path): once sent,
    // its outcome is unknown. A claim with a business key goes the general
    // way, whose COMMIT is never sent here: nothing applied.
    proxy.pause();
    let err = claim(&store, "hot").unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");
    let err = claim_bk(&store, "paused").unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let s = Arc::clone(&store);
    let err = guarded("get", move || s.get(&key("warm"))).unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let s = Arc::clone(&store);
    let err = guarded("sweep", move || s.sweep(10)).unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");

    // Forwarding resumes: the store serves again, and the claim answered
    // Unavailable was not applied.
    proxy.resume();
    match claim_bk(&store, "paused") {
        Ok(ClaimOutcome::Acquired(lease)) => assert!(!lease.is_takeover()),
        other => panic!("expected a first acquisition, got {other:?}"),
    }
    // The hot claim was applied or not: either answer is consistent.
    assert!(matches!(
        claim(&store, "hot"),
        Ok(ClaimOutcome::Acquired(_) | ClaimOutcome::InProgress { .. })
    ));

    // The answers are held from the COMMIT on: the outcome is unknown, and
    // the claim was in fact applied.
    proxy.hold_answers_after(b"COMMIT\0");
    let err = claim_bk(&store, "unknown").unwrap_err();
    assert!(proxy.holding(), "the COMMIT was never sent");
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");
    proxy.resume();
    let s = Arc::clone(&store);
    let r = guarded("get", move || s.get(&key("unknown")))
        .expect("get")
        .expect("the claim was applied");
    assert_eq!(r.state(), State::Processing);

    // Dropping the store does not wait for a half-open connection: an
    // async claim is left in flight (its future dropped), then the store.
    proxy.pause();
    let s = Arc::clone(&store);
    guarded("a dropped async claim", move || {
        let k = key("in-flight");
        let f = fp();
        let options = ClaimOptions::new();
        let mut call = std::pin::pin!(s.claim_async(&k, &f, &options));
        // One poll sends the request; the future is then dropped.
        let _ = futures_lite::future::block_on(futures_lite::future::poll_once(&mut call));
    });
    guarded("dropping the store", move || drop(store));
    proxy.resume();
}

/// A store in `schema` under `limits` (a 60-s lease, no sweeper), its
/// key `held` claimed, and a client of the test's own (with the runtime
/// that drives it) to hold the key's row from a transaction. The store
/// connects to `store_url` (`url` with options of its own, say).
fn held_key(
    url: &str,
    store_url: &str,
    schema: &str,
    limits: PostgresLimits,
    pooler: PostgresPooler,
) -> (
    Arc<Store>,
    idemstore::Lease,
    tokio::runtime::Runtime,
    tokio_postgres::Client,
) {
    let config = Config::new()
        .postgres_schema(schema)
        .postgres_connections(2)
        .postgres_limits(limits)
        .postgres_pooler(pooler)
        .lease(Duration::from_secs(60))
        .sweep_interval(None);
    let store = Arc::new(Store::connect(store_url, config).expect("connect"));
    let lease = match claim(&store, "held") {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    let (rt, client) = client_of(url);
    (store, lease, rt, client)
}

/// The answer of `held_key`'s store (at `store_url`, under `limits` and
/// `pooler`) to a completion of its key, made from a thread of its own
/// outside any runtime (the direct path first) while a transaction of the
/// test's own holds the key's row locked; the transaction is rolled back
/// once the completion has answered.
fn completion_of_a_locked_row(
    url: &str,
    store_url: &str,
    schema: &str,
    limits: PostgresLimits,
    pooler: PostgresPooler,
) -> idemstore::Result<idemstore::Record> {
    let (store, lease, rt, mut client) = held_key(url, store_url, schema, limits, pooler);
    let tx = rt.block_on(client.transaction()).expect("begin");
    rt.block_on(tx.execute(
        &format!("SELECT 1 FROM \"{schema}\".records FOR UPDATE"),
        &[],
    ))
    .expect("lock the row");
    let s = Arc::clone(&store);
    let answer = guarded("a completion of the locked row", move || {
        s.complete(&lease, b"done")
    });
    rt.block_on(tx.rollback()).expect("rollback");
    answer
}

#[test]
fn a_row_held_past_lock_timeout_holds_no_batch_longer() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_lock");
    let mut limits = PostgresLimits::default();
    limits.lock_timeout = Duration::from_millis(500);
    let (store, lease, rt, mut client) =
        held_key(&url, &url, &schema, limits, PostgresPooler::Direct);
    // The caller's transaction locks the row and stays open.
    let tx = rt.block_on(client.transaction()).expect("begin");
    rt.block_on(complete_in(&tx, &store, &lease, b"done"))
        .expect("complete_in");

    // A batch that includes the held row fails after lock_timeout, while
    // the transaction is still open (without the bound it would wait for
    // the transaction's end).
    let s = Arc::clone(&store);
    let answer = guarded("a batch with the held row", move || {
        s.claim_many(
            &[(key("held"), fp()), (key("beside"), fp())],
            &ClaimOptions::new(),
        )
    });
    match answer {
        Err(Error::Unavailable { detail }) => assert!(detail.contains("55P03"), "{detail}"),
        Ok(each) => assert!(
            each.iter()
                .all(|r| matches!(r, Err(Error::Unavailable { .. }))),
            "{each:?}"
        ),
        Err(other) => panic!("expected Unavailable, got {other:?}"),
    }
    // Other keys do not wait at all.
    assert!(matches!(
        claim(&store, "free"),
        Ok(ClaimOutcome::Acquired(_))
    ));
    // Nothing of the refused batch was applied.
    let s = Arc::clone(&store);
    assert!(
        guarded("get", move || s.get(&key("beside")))
            .expect("get")
            .is_none()
    );
    rt.block_on(tx.commit()).expect("commit");
    let s = Arc::clone(&store);
    let r = guarded("get", move || s.get(&key("held")))
        .expect("get")
        .expect("record");
    assert_eq!(r.state(), State::Succeeded);
}

/// A claim that takes a business key from a record past retention whose
/// row another transaction holds locked (a sweep about to evict it, a batch
/// on its key) does not wait for that row: it takes the key and leaves the
/// record to its locker (here, to the sweep after it). Were it to evict the
/// record itself, it would lock that row after the binding's lock, the
/// other order than every other transaction: it waited for the locker, and
/// deadlocked with a sweep, which locks the row and then the binding.
#[test]
fn a_claim_taking_a_business_key_waits_for_no_row_it_does_not_name() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_holder");
    let clock = ManualClock::new(1_700_000_000_000);
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(2);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_limits(limits)
        .clock(clock.clone())
        .retention(Duration::from_secs(60))
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&url, config).expect("connect"));
    let lease = match claim_bk(&store, "old") {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    store.complete(&lease, b"done").expect("complete");
    clock.advance(Duration::from_secs(120));

    // Another transaction locks the old record's row and stays open.
    let (rt, mut client) = client_of(&url);
    let tx = rt.block_on(client.transaction()).expect("begin");
    let locked = rt
        .block_on(tx.query(
            &format!("SELECT key FROM \"{schema}\".records FOR UPDATE"),
            &[],
        ))
        .expect("lock");
    assert_eq!(locked.len(), 1);
    let s = Arc::clone(&store);
    let answer = guarded("the claim", move || {
        s.claim(
            &key("new"),
            &fp(),
            &ClaimOptions::new().business_key("bk-old"),
        )
    });
    assert!(
        matches!(answer, Ok(ClaimOutcome::Acquired(_))),
        "the claim waited for a row it does not name: {answer:?}"
    );
    rt.block_on(tx.rollback()).expect("rollback");

    // The old record was left to its locker; the sweep evicts it, and the
    // business key stays the new record's.
    assert_eq!(store.len().expect("len"), 2);
    assert_eq!(store.sweep(100).expect("sweep"), 1);
    match claim_bk(&store, "old") {
        Err(Error::BusinessKeyConflict { existing, .. }) => assert_eq!(existing, key("new")),
        other => panic!("the business key is the new record's, got {other:?}"),
    }
    let report = store.verify(|_| {}).expect("verify");
    assert!(report.is_clean(), "{report:?}");
}

/// A server that accepts the connection and then says nothing (the proxy,
/// paused) holds opening a connection no longer than `connect_timeout`,
/// which bounds TCP, TLS and the server's start-up (`tokio-postgres`'s own
/// bounds the TCP connect only): the store's connect, and then a call that
/// must open its first connection, answer `Unavailable` naming
/// `connect_timeout`, not the call's deadline; once the server answers
/// again, the store serves.
#[test]
fn a_server_that_accepts_and_says_nothing_is_bounded_by_connect_timeout() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_silent_server");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(10);
    limits.connect_timeout = Duration::from_secs(1);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(1)
        .postgres_limits(limits)
        .sweep_interval(None);
    let names_connect_timeout = |err: &Error| matches!(err, Error::Unavailable { detail } if detail.contains("connect_timeout"));

    proxy.pause();
    let (to, cfg) = (via(&url, &proxy), config.clone());
    let err = guarded("connect", move || Store::connect(&to, cfg).map(drop)).unwrap_err();
    assert!(names_connect_timeout(&err), "{err:?}");

    proxy.resume();
    let store = Arc::new(Store::connect(&via(&url, &proxy), config).expect("connect"));
    proxy.pause();
    // No worker or direct connection is open before the first call.
    for result in [claim(&store, "hot"), claim_bk(&store, "general")] {
        let err = result.unwrap_err();
        assert!(names_connect_timeout(&err), "{err:?}");
    }
    proxy.resume();
    assert!(matches!(
        claim_bk(&store, "general"),
        Ok(ClaimOutcome::Acquired(_))
    ));
}

#[test]
fn a_full_queue_is_waited_on_until_the_deadline() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_queue");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(1);
    limits.connect_timeout = Duration::from_secs(1);
    limits.queue = 1;
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(1)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&via(&url, &proxy), config).expect("connect"));
    assert!(matches!(
        claim(&store, "warm"),
        Ok(ClaimOutcome::Acquired(_))
    ));
    proxy.pause();
    // One call holds the only place in the queue on a stalled connection;
    // the others wait for room, each until its own deadline. (Claims with
    // a business key go the general way, whose COMMIT is never sent here.)
    let callers: Vec<_> = (0..4)
        .map(|i| {
            let s = Arc::clone(&store);
            std::thread::spawn(move || claim_bk(&s, &format!("queued-{i}")))
        })
        .collect();
    for caller in callers {
        let err = caller.join().expect("caller").unwrap_err();
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    }
    proxy.resume();
    for i in 0..4 {
        assert!(matches!(
            claim_bk(&store, &format!("queued-{i}")),
            Ok(ClaimOutcome::Acquired(_))
        ));
    }
}

/// A sync completion the hot path tried first and the server refused
/// (its row is locked past `lock_timeout`) goes the general way with what
/// is left of the call's deadline, not a fresh `call_timeout`: here the
/// row stays locked, so the call ends at its deadline (the error names
/// `call_timeout`), where a fresh deadline would let the general path wait
/// out a second `lock_timeout` and answer that (55P03). The limits leave
/// the hot path a second before its own deadline, and the general path a
/// second where it would need three.
#[test]
fn a_call_the_hot_path_left_undecided_keeps_its_deadline() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_one_deadline");
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(4);
    limits.lock_timeout = Duration::from_secs(3);
    let answer = completion_of_a_locked_row(&url, &url, &schema, limits, PostgresPooler::Direct);
    match answer {
        // Not sent: the transaction's COMMIT. (The hot statement is its
        // own commit: at its deadline the answer would be OutcomeUnknown.)
        Err(Error::Unavailable { detail }) => {
            assert!(detail.contains("call_timeout"), "{detail}");
            assert!(detail.contains("before its COMMIT was sent"), "{detail}");
        }
        other => panic!("expected the deadline's error, got {other:?}"),
    }
}

/// A setting the URL gives (`options=-c lock_timeout=…`) wins over the
/// limits behind a session-mode pooler too, where the limits are sent with
/// `SET` after connecting (and would override what the startup set): with
/// the URL's 60-s `lock_timeout`, a completion of a row that a caller's
/// transaction holds waits until the call's deadline (the error names
/// `call_timeout`), where the limits' 500 ms would end it with the
/// server's 55P03. (A server stands in for the pooler: PgBouncer refuses
/// `options`.)
#[test]
fn a_setting_in_the_url_wins_over_the_limits_behind_a_session_pooler() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_url_wins");
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(2);
    limits.lock_timeout = Duration::from_millis(500);
    let joint = if url.contains('?') { '&' } else { '?' };
    // And a setting only a session's start can set, which the pooler's
    // settings leave as the start left it (set again, it failed every
    // connect with 55P02).
    let store_url =
        format!("{url}{joint}options=-c%20lock_timeout%3D60000%20-c%20log_disconnections%3Don");
    let answer =
        completion_of_a_locked_row(&url, &store_url, &schema, limits, PostgresPooler::Session);
    match answer {
        Err(Error::Unavailable { detail } | Error::OutcomeUnknown { detail }) => {
            assert!(detail.contains("call_timeout"), "{detail}");
            assert!(!detail.contains("55P03"), "{detail}");
        }
        other => panic!("expected the deadline's error, got {other:?}"),
    }
}

/// While the server cannot be reached, `Store::now_ms` answers the highest
/// time this process has seen, which the connect read: never 0 (the
/// epoch), and not below the database clock before the connect. An
/// import is refused as `Unavailable` rather than judged at the time last
/// seen: with no tolerance, a stream exported after the connect would be
/// refused as ahead of that time instead. `stats` is `Unavailable` too.
#[test]
fn the_time_of_an_unreachable_server_is_the_last_seen() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_now");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let before: i64 = rt.block_on(async {
        let (client, connection) = tokio_postgres::connect(&url, NoTls).await.expect("connect");
        tokio::spawn(connection);
        client
            .query_one(
                "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
                &[],
            )
            .await
            .expect("clock")
            .get(0)
    });
    let proxy = Proxy::start(upstream_of(&url));
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_secs(1);
    limits.connect_timeout = Duration::from_secs(1);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&via(&url, &proxy), config).expect("connect"));
    // An export whose clock is an hour past the connect's reading.
    let ahead = u64::try_from(before).expect("a time after the epoch") + 3_600_000;
    let mut stream = Vec::new();
    let dir = tempfile::tempdir().expect("dir");
    let source = Store::open_with(
        dir.path().join("s.redb"),
        Config::new()
            .sweep_interval(None)
            .clock(ManualClock::new(ahead)),
    )
    .expect("open");
    source.export(&mut stream, |_| {}).expect("export");
    proxy.pause();
    let s = Arc::clone(&store);
    let now = guarded("now_ms", move || s.now_ms());
    assert!(
        now >= u64::try_from(before).expect("a time after the epoch"),
        "{now} < {before}"
    );
    let s = Arc::clone(&store);
    let err = guarded("stats", move || s.stats()).unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let s = Arc::clone(&store);
    let err = guarded("import", move || {
        let exact = ImportOptions::new().clock_tolerance(Duration::ZERO);
        s.import_with(stream.as_slice(), &exact, |_| {})
    })
    .unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    proxy.resume();
}

/// `url` with an application name of its own, so that the store's
/// sessions can be counted.
fn with_app(url: &str, app: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={app}")
}

/// Counts a server's sessions by application name.
struct Sessions {
    rt: tokio::runtime::Runtime,
    client: tokio_postgres::Client,
    app: String,
}

impl Sessions {
    fn new(url: &str, app: &str) -> Sessions {
        let (rt, client) = client_of(url);
        Sessions {
            rt,
            client,
            app: app.to_string(),
        }
    }

    /// The sessions open now under the application name.
    fn count(&self) -> i64 {
        self.rt.block_on(async {
            // Activity statistics are a snapshot per transaction: refresh it.
            self.client
                .batch_execute("SELECT pg_stat_clear_snapshot()")
                .await
                .expect("clear snapshot");
            let row = self
                .client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                    &[&self.app],
                )
                .await
                .expect("count sessions");
            row.get(0)
        })
    }

    /// Polls until `done` holds for the count (returned), failing the test
    /// at the hang guard.
    fn wait_for(&self, what: &str, done: impl Fn(i64) -> bool) -> i64 {
        let start = std::time::Instant::now();
        loop {
            let n = self.count();
            if done(n) {
                return n;
            }
            assert!(
                start.elapsed() < HANG_GUARD,
                "{what}: still {n} sessions of {} at the hang guard",
                self.app
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One lifecycle through the async API (the queue and its workers only:
/// no direct connection of a sync caller).
fn lifecycle_async(store: &Store, id: &str) {
    futures_lite::future::block_on(async {
        let k = key(id);
        let lease = match store.claim_async(&k, &fp(), &ClaimOptions::new()).await {
            Ok(ClaimOutcome::Acquired(lease)) => lease,
            other => panic!("claim {id}: {other:?}"),
        };
        store
            .complete_async(&lease, b"done")
            .await
            .expect("complete");
        let r = store.get_async(&k).await.expect("get").expect("record");
        assert_eq!(r.state(), State::Succeeded);
    });
}

/// Each scan holds a connection of its own (one snapshot) until it is read
/// to its end or dropped, at most `PostgresLimits::scans` of them: one more
/// waits for a scan to end until its deadline and is refused `Unavailable`
/// naming the limit, and starts once one ends. The store never holds more than
/// `postgres_connections` + 1 + `scans` sessions.
#[test]
fn scans_hold_at_most_their_limit_of_connections() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_scans");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let app = schema.clone();
    let sessions = Sessions::new(&url, &app);
    let mut limits = PostgresLimits::default();
    limits.scans = 2;
    limits.call_timeout = Duration::from_secs(5);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(1)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Store::connect(&with_app(&url, &app), config).expect("connect");
    for i in 0..3 {
        let k = key(&format!("scan-{i}"));
        assert!(matches!(
            store.claim(&k, &fp(), &ClaimOptions::new()),
            Ok(ClaimOutcome::Acquired(_))
        ));
    }
    let filter = idemstore::Filter::new();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut records = store.scan(&filter).expect("scan");
        assert!(records.next().is_some());
        held.push(records);
    }
    match store.scan(&filter) {
        Err(Error::Unavailable { detail }) => {
            assert!(detail.contains("PostgresLimits::scans"), "{detail}")
        }
        other => panic!("a third scan while two are held: {:?}", other.map(|_| ())),
    }
    // One worker, one sync caller's direct connection, two scans.
    let open = sessions.count();
    assert!(open <= 1 + 1 + 2, "{open} sessions");
    // A scan read to its end gives its connection back at once, while
    // the caller still holds the iterator.
    drop(held.pop());
    let mut used = store.scan(&filter).expect("a scan once one was dropped");
    assert_eq!(used.by_ref().count(), 3);
    // Its session ends too: a worker, the direct connection, one held scan.
    sessions.wait_for("a scan read to its end", |n| n <= 3);
    let records = store
        .scan(&filter)
        .expect("a scan beside one read to its end");
    assert_eq!(records.count(), 3);
    drop(used);
}

#[test]
fn a_lone_sequential_caller_is_served_by_one_connection() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_lone");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let app = schema.clone();
    let sessions = Sessions::new(&url, &app);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(8)
        .sweep_interval(None);
    let store = Store::connect(&with_app(&url, &app), config).expect("connect");
    // Connecting's own session ends; no worker connection is open yet.
    sessions.wait_for("after connecting", |n| n == 0);
    for i in 0..40 {
        lifecycle_async(&store, &format!("lone-{i}"));
    }
    // 120 calls one after the other, each on the worker freed last: one
    // connection (with a fixed pool they went round all 8).
    assert_eq!(sessions.count(), 1);
    // A sync caller outside a runtime also takes the store's direct
    // connection (its claims and completions run on its own thread); its
    // reads go through the same worker.
    for i in 0..40 {
        let k = key(&format!("sync-{i}"));
        let lease = match store.claim(&k, &fp(), &ClaimOptions::new()) {
            Ok(ClaimOutcome::Acquired(lease)) => lease,
            other => panic!("{other:?}"),
        };
        store.complete(&lease, b"done").expect("complete");
        assert!(store.get(&k).expect("get").is_some());
    }
    assert_eq!(sessions.count(), 2);
}

#[test]
fn concurrent_callers_open_connections_up_to_the_max_and_idle_ones_close() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_pool");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let app = schema.clone();
    let sessions = Sessions::new(&url, &app);
    const MAX: i64 = 4;
    let mut limits = PostgresLimits::default();
    limits.connection_idle_timeout = Duration::from_millis(300);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(MAX as usize)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&with_app(&url, &app), config).expect("connect"));
    sessions.wait_for("after connecting", |n| n == 0);

    // Concurrent callers until told to stop: more than one connection
    // opens, and never more than the max.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..16)
        .map(|t| {
            let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    lifecycle_async(&store, &format!("pool-{t}-{i}"));
                    i += 1;
                }
            })
        })
        .collect();
    let start = std::time::Instant::now();
    let mut most = 0;
    while most < 2 {
        let n = sessions.count();
        assert!(n <= MAX, "{n} sessions, above the max of {MAX}");
        most = most.max(n);
        assert!(
            start.elapsed() < HANG_GUARD,
            "16 concurrent callers never opened a second connection"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Sampled a while longer: still within the max.
    for _ in 0..25 {
        let n = sessions.count();
        assert!(n <= MAX, "{n} sessions, above the max of {MAX}");
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for caller in callers {
        caller.join().expect("caller");
    }
    // Unused, every worker connection closes.
    sessions.wait_for("after the load", |n| n == 0);
    // And the next call opens one again (none was open).
    lifecycle_async(&store, "after");
}

/// A sync caller's direct connection (its claims and completions run on
/// its own thread) is closed once `connection_idle_timeout` has passed
/// unused, as a worker's is, although no call drives it meanwhile, and
/// closed as a client should close it (a `Terminate` message, not a
/// dropped socket: the database's `sessions_abandoned` does not grow; a
/// database of the test's own, so that no other test's sessions count);
/// the next call opens it again, and dropping the store closes it so too.
#[test]
fn a_sync_callers_direct_connection_closes_when_idle_too() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_direct");
    let app = schema.clone();
    let admin = Sessions::new(&url, &app);
    admin.rt.block_on(async {
        admin
            .client
            .batch_execute(&format!("CREATE DATABASE \"{app}\""))
            .await
            .expect("create the test's database");
    });
    let db_url = pg::with_db(&url, &app);
    idemstore::postgres::migrate(&db_url, &schema).expect("migrate");
    let sessions = Sessions::new(&url, &app);
    // Sessions to the test's database: all, and those ended by a lost
    // client (pg_stat_database, PostgreSQL 14 and later).
    let ended = || {
        sessions.rt.block_on(async {
            sessions
                .client
                .batch_execute("SELECT pg_stat_clear_snapshot()")
                .await
                .expect("clear snapshot");
            let row = sessions
                .client
                .query_one(
                    "SELECT sessions, sessions_abandoned FROM pg_stat_database WHERE datname = $1",
                    &[&app],
                )
                .await
                .expect("database stats");
            (row.get::<_, i64>(0), row.get::<_, i64>(1))
        })
    };
    let mut limits = PostgresLimits::default();
    // Long enough that the counts right after the calls below see the
    // connection still open on a loaded machine.
    limits.connection_idle_timeout = Duration::from_secs(2);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Store::connect(&with_app(&db_url, &app), config).expect("connect");
    sessions.wait_for("after connecting", |n| n == 0);
    let lifecycle = |id: &str| {
        let k = key(id);
        let lease = match store.claim(&k, &fp(), &ClaimOptions::new()) {
            Ok(ClaimOutcome::Acquired(lease)) => lease,
            other => panic!("claim {id}: {other:?}"),
        };
        store.complete(&lease, b"done").expect("complete");
    };
    // Polls until the database has counted `n` more ended sessions than
    // `before`, and returns how many of them were abandoned.
    let abandoned_since = |before: (i64, i64), n: i64| {
        let start = std::time::Instant::now();
        loop {
            let now = ended();
            if now.0 >= before.0 + n {
                return now.1 - before.1;
            }
            assert!(start.elapsed() < HANG_GUARD, "{before:?} -> {now:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let before = ended();
    for i in 0..10 {
        lifecycle(&format!("direct-{i}"));
    }
    // Claims and completions only: the direct connection alone.
    assert_eq!(sessions.count(), 1);
    sessions.wait_for("the direct connection unused", |n| n == 0);
    assert_eq!(
        abandoned_since(before, 1),
        0,
        "closed by dropping its socket"
    );
    // The next call opens it again, and the record written before is there.
    let before = ended();
    lifecycle("direct-after");
    assert_eq!(sessions.count(), 1);
    match store.claim(&key("direct-0"), &fp(), &ClaimOptions::new()) {
        Ok(ClaimOutcome::Replay(record)) => assert_eq!(record.state(), State::Succeeded),
        other => panic!("{other:?}"),
    }
    drop(store);
    sessions.wait_for("the store dropped", |n| n == 0);
    assert_eq!(
        abandoned_since(before, 1),
        0,
        "dropped by dropping its socket"
    );
    admin.rt.block_on(async {
        // Leaves nothing behind on a server given by IDEMSTORE_PG_URL.
        let _ = admin
            .client
            .batch_execute(&format!("DROP DATABASE \"{app}\" WITH (FORCE)"))
            .await;
    });
}

/// A lease renewal sent on a connection that went half-open (a NAT or
/// load-balancer entry dropped: new connections work) ends while the
/// lease lasts, and is retried on another connection: `execute`'s work,
/// longer than its lease, keeps the key (another caller never takes it
/// over), sync and async, while the work runs and while its outcome is
/// written, and the outcome is recorded: each write ends by a deadline
/// within the lease and is retried on another connection. (The renewal
/// waited `call_timeout`, longer than the lease; another caller took the
/// key over while the work ran, and the completion answered
/// `OutcomeUnknown` after `call_timeout`.)
#[cfg(feature = "agent")]
#[test]
fn a_renewal_on_a_half_open_connection_is_retried_while_the_lease_lasts() {
    for asynchronous in [false, true] {
        renew_past_a_half_open_connection(asynchronous);
    }
}

#[cfg(feature = "agent")]
fn renew_past_a_half_open_connection(asynchronous: bool) {
    use idemstore::agent::{ExecuteOptions, Failure, Origin};
    use std::sync::atomic::{AtomicBool, Ordering};

    const LEASE: Duration = Duration::from_secs(3);
    const WORK: Duration = Duration::from_secs(5);
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_renewal");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let mut limits = PostgresLimits::default();
    // Longer than the lease, as the defaults are (30 s each).
    limits.call_timeout = Duration::from_secs(5);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_limits(limits)
        .lease(LEASE)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&via(&url, &proxy), config.clone()).expect("connect"));
    let other = Store::connect(&url, config).expect("connect");
    let key = key(if asynchronous {
        "renew-async"
    } else {
        "renew-sync"
    });
    let started = Arc::new(AtomicBool::new(false));
    let runner = {
        let (store, key, started) = (store.clone(), key.clone(), started.clone());
        std::thread::spawn(move || {
            let options = ExecuteOptions::new();
            let work = |_: &idemstore::Lease| {
                started.store(true, Ordering::SeqCst);
                std::thread::sleep(WORK);
                Ok::<_, Failure<String>>("done".to_string())
            };
            let executed = if asynchronous {
                // Work that awaits (never blocks its thread, whose task
                // renews the lease too).
                futures_lite::future::block_on(store.execute_async(
                    &key,
                    &fp(),
                    options,
                    async |_: &idemstore::Lease| {
                        started.store(true, Ordering::SeqCst);
                        futures_timer::Delay::new(WORK).await;
                        Ok::<_, Failure<String>>("done".to_string())
                    },
                ))
            } else {
                store.execute(&key, &fp(), options, work)
            };
            executed.map(|e| e.origin()).map_err(|e| e.to_string())
        })
    };
    while !started.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(5));
    }
    // After the first renewal (a third of the lease), every connection the
    // store has goes half-open.
    std::thread::sleep(LEASE / 3 + LEASE / 10);
    proxy.pause_existing();
    let mut taken_over = false;
    while !runner.is_finished() {
        if let Ok(ClaimOutcome::Acquired(_)) = other.claim(&key, &fp(), &ClaimOptions::new()) {
            taken_over = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let executed = runner.join().expect("runner");
    assert!(
        !taken_over,
        "async {asynchronous}: the key was taken over while the work ran ({executed:?})"
    );
    // The work ran once, and its outcome is recorded: a completion sent on
    // a connection gone half-open (the sync caller's direct one) ends by
    // its deadline and is sent again on another.
    assert_eq!(executed, Ok(Origin::Ran), "async {asynchronous}");
    let record = other.get(&key).expect("get").expect("recorded");
    assert_eq!(record.state(), State::Succeeded);
}

/// Runs `execute` of each of `ids` on `store` at once, each doing `work`
/// long (sync, so that the store's extender renews their leases, due
/// together, in one batch). Returns once every work has begun (or the
/// calls have all returned), with the thread that answers each one's
/// origin or error once all have returned.
#[cfg(feature = "agent")]
fn execute_each(
    store: &Arc<Store>,
    ids: &[String],
    work: Duration,
) -> std::thread::JoinHandle<Vec<(String, Result<idemstore::agent::Origin, String>)>> {
    use idemstore::agent::{ExecuteOptions, Failure};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let started = Arc::new(AtomicUsize::new(0));
    let count = ids.len();
    let (store, ids, begun) = (Arc::clone(store), ids.to_vec(), Arc::clone(&started));
    let runner = std::thread::spawn(move || {
        let started = begun;
        let barrier = Arc::new(std::sync::Barrier::new(ids.len()));
        let runners: Vec<_> = ids
            .into_iter()
            .map(|id| {
                let (store, started, barrier) = (store.clone(), started.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let executed = store.execute(&key(&id), &fp(), ExecuteOptions::new(), |_| {
                        started.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(work);
                        Ok::<_, Failure<String>>("done".to_string())
                    });
                    (id, executed.map(|e| e.origin()).map_err(|e| e.to_string()))
                })
            })
            .collect();
        runners
            .into_iter()
            .map(|r| r.join().expect("runner"))
            .collect()
    });
    while started.load(Ordering::SeqCst) < count && !runner.is_finished() {
        std::thread::sleep(Duration::from_millis(1));
    }
    runner
}

/// While `runner` runs, tries to claim each of `ids` on `other` (another
/// replica), and returns those it acquired: leases that lapsed while their
/// work still ran.
#[cfg(feature = "agent")]
fn taken_over_while<T>(
    other: &Store,
    ids: &[String],
    runner: &std::thread::JoinHandle<T>,
) -> Vec<String> {
    let mut taken = Vec::new();
    while !runner.is_finished() {
        for id in ids {
            if !taken.contains(id)
                && let Ok(ClaimOutcome::Acquired(_)) =
                    other.claim(&key(id), &fp(), &ClaimOptions::new())
            {
                taken.push(id.clone());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    taken
}

/// A row locked by another session (any `SELECT … FOR UPDATE`, a caller's
/// open transaction) fails the renewal of its own lease only: the leases of
/// the `execute` calls renewed in the same batch are renewed (the batch
/// waits for the lock a quarter of the renewal's time, then runs each
/// key's renewal on its own), so none lapses while its work runs and no
/// other replica takes one over. (The batch waited for the lock until its
/// deadline and failed every lease in it, at each retry, until they
/// lapsed: other replicas took them over, and the work ran twice.)
#[cfg(feature = "agent")]
#[test]
fn a_row_locked_by_another_session_fails_only_its_own_renewal() {
    const LEASE: Duration = Duration::from_millis(900);
    const WORK: Duration = Duration::from_secs(3);
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_locked_renewal");
    let config = Config::new()
        .postgres_schema(&schema)
        .lease(LEASE)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&url, config.clone()).expect("connect"));
    let other = Store::connect(&url, config).expect("connect");
    let victims: Vec<String> = (0..8).map(|i| format!("renewed-{i}")).collect();
    let mut ids = victims.clone();
    ids.push("locked".to_string());
    let runner = execute_each(&store, &ids, WORK);
    // The row of `locked` held until the works end, before its first
    // renewal (a third of the lease).
    let (rt, mut client) = client_of(&url);
    let tx = rt.block_on(client.transaction()).expect("begin");
    let locked = rt
        .block_on(tx.query(
            &format!(
                "SELECT 1 FROM \"{schema}\".records WHERE position('locked'::bytea in key) > 0 \
                 FOR UPDATE"
            ),
            &[],
        ))
        .expect("lock the row");
    assert_eq!(locked.len(), 1);
    let taken = taken_over_while(&other, &victims, &runner);
    let executed = runner.join().expect("runner");
    rt.block_on(tx.rollback()).expect("rollback");
    assert!(
        taken.is_empty(),
        "taken over while their work ran: {taken:?}; {executed:?}"
    );
    for (id, origin) in &executed {
        if victims.contains(id) {
            assert_eq!(
                origin,
                &Ok(idemstore::agent::Origin::Ran),
                "{id}: {executed:?}"
            );
        }
    }
}

/// A lease renewal whose connection went half-open once its locking read
/// had reached the server (the server is never told: the session sits
/// inside the transaction, holding the rows it locked) holds those rows
/// about half the time the renewal had left, not the session's
/// `idle_in_transaction_timeout` (60 s by default): the renewal's retry on
/// another connection renews the leases while they last, no other replica
/// takes a key over while its work runs, and each outcome is recorded.
/// (The rows stayed locked for a minute: the retries and then the
/// outcome's write waited for them, the outcome was answered
/// `OutcomeUnknown`, and once the lock went another replica could run the
/// work again.)
#[cfg(feature = "agent")]
#[test]
fn a_renewal_whose_session_keeps_its_row_locks_is_retried_while_the_lease_lasts() {
    const LEASE: Duration = Duration::from_secs(3);
    const WORK: Duration = Duration::from_secs(5);
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_kept_locks");
    let proxy = Proxy::start(upstream_of(&url));
    let config = Config::new()
        .postgres_schema(&schema)
        .lease(LEASE)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&via(&url, &proxy), config.clone()).expect("connect"));
    let other = Store::connect(&url, config).expect("connect");
    let ids: Vec<String> = (0..3).map(|i| format!("kept-{i}")).collect();
    let runner = execute_each(&store, &ids, WORK);
    // The next message that names `kept-0` is the renewal's locking read.
    proxy.half_open_after(b"kept-0");
    let taken = taken_over_while(&other, &ids, &runner);
    let executed = runner.join().expect("runner");
    assert!(proxy.went_half_open(), "the renewal never went half-open");
    assert!(
        taken.is_empty(),
        "taken over while their work ran: {taken:?}; {executed:?}"
    );
    for (id, origin) in &executed {
        assert_eq!(
            origin,
            &Ok(idemstore::agent::Origin::Ran),
            "{id}: {executed:?}"
        );
        let record = other.get(&key(id)).expect("get").expect("recorded");
        assert_eq!(record.state(), State::Succeeded, "{id}");
    }
}

/// A claim abandoned while it waits on a row lock (a caller's
/// `complete_in` transaction) holds no claim of another key: the store
/// keeps it without waiting for it (a later claim gives its lease back
/// once it is decided).
#[test]
fn an_abandoned_claim_on_a_locked_row_holds_no_claim_of_another_key() {
    use std::future::Future;
    use std::task::{Context, Waker};

    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_abandoned");
    // The abandoned claim may wait on the lock for 10 minutes, far past
    // the hang guard (60 s) that bounds the claim of another key.
    let mut limits = PostgresLimits::default();
    limits.lock_timeout = Duration::from_secs(600);
    limits.statement_timeout = Duration::from_secs(660);
    limits.call_timeout = Duration::from_secs(660);
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(4)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&url, config).expect("connect"));
    // `held` failed retryably: its next claim writes its row.
    let lease = match claim(&store, "held") {
        Ok(ClaimOutcome::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    store.fail(&lease, b"boom", true).expect("fail");
    let (rt, mut client) = client_of(&url);
    let tx = rt.block_on(client.transaction()).expect("begin");
    rt.block_on(tx.execute(
        &format!("SELECT 1 FROM \"{schema}\".records FOR UPDATE"),
        &[],
    ))
    .expect("lock the rows");
    // The retry of `held` is sent, waits on the lock, and its client
    // hangs up.
    {
        let (k, f, options) = (key("held"), fp(), ClaimOptions::new());
        let mut abandoned = Box::pin(store.claim_async(&k, &f, &options));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(abandoned.as_mut().poll(&mut cx).is_pending());
    }
    let answer = guarded("a claim of another key", {
        let store = Arc::clone(&store);
        move || claim(&store, "free")
    });
    rt.block_on(tx.rollback()).expect("rollback");
    assert!(
        matches!(answer, Ok(ClaimOutcome::Acquired(_))),
        "{answer:?}"
    );
}

/// A row held by another session (a caller's open `complete_in`
/// transaction, any `SELECT … FOR UPDATE`) fails only the requests that
/// need it: the claim of another key, group-committed with a claim of the
/// held key, is decided (the batch, refused the lock past `lock_timeout`,
/// runs again a key at a time), and the claim of the held key gets the
/// lock wait's `Unavailable`. Both claims are takeovers (of a retryable
/// failure), which the hot path leaves to the general transaction.
#[test]
fn a_locked_row_fails_no_claim_of_another_key_in_its_batch() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("limits_neighbour");
    let mut limits = PostgresLimits::default();
    limits.lock_timeout = Duration::from_secs(2);
    // One worker, so that claims queued while it is busy are taken as one
    // batch.
    let config = Config::new()
        .postgres_schema(&schema)
        .postgres_connections(1)
        .postgres_limits(limits)
        .sweep_interval(None);
    let store = Arc::new(Store::connect(&url, config).expect("connect"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // A round holds the worker on a row of its own until both claims are
    // queued; should a loaded machine take longer than `lock_timeout` to
    // queue them, the worker was freed meanwhile and the round proves
    // nothing: the next one runs on fresh keys.
    for round in 0..5 {
        if let Some((locked, free)) = neighbours_of_a_locked_row(&store, &rt, &url, &schema, round)
        {
            assert!(matches!(free, Ok(ClaimOutcome::Acquired(_))), "{free:?}");
            match locked {
                Err(Error::Unavailable { detail }) => {
                    assert!(detail.contains("55P03"), "{detail}");
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
            // The refused claim applied nothing: the key is claimed now
            // that its row is free.
            assert!(matches!(
                claim(&store, &format!("locked{round}")),
                Ok(ClaimOutcome::Acquired(_))
            ));
            return;
        }
    }
    panic!("the worker was never held until both claims were queued");
}

/// One round of `a_locked_row_fails_no_claim_of_another_key_in_its_batch`:
/// the answers to the claims of `locked<round>` (its row locked by a
/// transaction of the test's own, rolled back once they answered) and of
/// `free<round>`, made by two callers and taken as one batch by the
/// store's one worker, which a claim of `gate<round>` holds (waiting for
/// its row, locked by another transaction of the test's) until both are
/// queued. `None` if the worker was freed before that (the gate's claim
/// was refused its lock).
fn neighbours_of_a_locked_row(
    store: &Arc<Store>,
    rt: &tokio::runtime::Runtime,
    url: &str,
    schema: &str,
    round: usize,
) -> Option<(
    idemstore::Result<ClaimOutcome>,
    idemstore::Result<ClaimOutcome>,
)> {
    use std::future::Future;
    use std::task::{Context, Waker};

    let [locked, free, gate] = ["locked", "free", "gate"].map(|id| format!("{id}{round}"));
    // Each key failed retryably: its next claim takes it over, a write of
    // its row.
    let mut tokens = Vec::new();
    for id in [&locked, &free, &gate] {
        let lease = match claim(store, id) {
            Ok(ClaimOutcome::Acquired(lease)) => lease,
            other => panic!("{other:?}"),
        };
        store.fail(&lease, b"boom", true).expect("fail");
        tokens.push(i64::try_from(lease.token()).expect("token"));
    }
    let open = || {
        let (client, connection) = rt
            .block_on(tokio_postgres::connect(url, NoTls))
            .expect("connect");
        rt.spawn(connection);
        client
    };
    let (mut holder, mut gatekeeper) = (open(), open());
    let lock_row = |tx: &tokio_postgres::Transaction<'_>, token: i64| {
        let n = rt
            .block_on(tx.execute(
                &format!("SELECT 1 FROM \"{schema}\".records WHERE token = $1 FOR UPDATE"),
                &[&token],
            ))
            .expect("lock the row");
        assert_eq!(n, 1);
    };
    let held = rt.block_on(holder.transaction()).expect("begin");
    lock_row(&held, tokens[0]);
    let gatekeeper_pid: i32 = rt
        .block_on(gatekeeper.query_one("SELECT pg_backend_pid()", &[]))
        .expect("pid")
        .get(0);
    let gate_tx = rt.block_on(gatekeeper.transaction()).expect("begin");
    lock_row(&gate_tx, tokens[2]);
    // The gate's claim holds the one worker while it waits for its row.
    let (gate_answer, gate_rx) = channel();
    {
        let (store, k) = (Arc::clone(store), key(&gate));
        std::thread::spawn(move || {
            let answer =
                futures_lite::future::block_on(store.claim_async(&k, &fp(), &ClaimOptions::new()));
            let _ = gate_answer.send(answer);
        });
    }
    let since = std::time::Instant::now();
    loop {
        let waiting: i64 = rt
            .block_on(held.query_one(
                "SELECT count(*) FROM pg_locks WHERE NOT granted \
                 AND $1 = ANY(pg_blocking_pids(pid))",
                &[&gatekeeper_pid],
            ))
            .expect("pg_locks")
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            since.elapsed() < HANG_GUARD,
            "the gate's claim never waited"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Both claims are queued (a first poll sends each), then the worker
    // is freed: it takes them as one batch.
    let (k1, k2, f, o) = (key(&locked), key(&free), fp(), ClaimOptions::new());
    let mut first = Box::pin(store.claim_async(&k1, &f, &o));
    let mut second = Box::pin(store.claim_async(&k2, &f, &o));
    let mut cx = Context::from_waker(Waker::noop());
    assert!(first.as_mut().poll(&mut cx).is_pending());
    assert!(second.as_mut().poll(&mut cx).is_pending());
    rt.block_on(gate_tx.rollback()).expect("rollback");
    let gate_answer = gate_rx.recv_timeout(HANG_GUARD).expect("the gate's claim");
    let answers = futures_lite::future::block_on(futures_lite::future::zip(first, second));
    rt.block_on(held.rollback()).expect("rollback");
    // Held until the gate's row was released: the claims were queued
    // while the worker was busy.
    matches!(gate_answer, Ok(ClaimOutcome::Acquired(_))).then_some(answers)
}
