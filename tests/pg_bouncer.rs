//! The PostgreSQL engine behind PgBouncer (Debian's `pgbouncer`, 1.18),
//! started by the test in front of the throwaway server of `tests/pg`:
//!
//! - the whole conformance suite through PgBouncer on a session-mode
//!   entry, with `Config::postgres_pooler(PostgresPooler::Session)` (the
//!   session settings sent with `SET`, since PgBouncer refuses the startup
//!   parameter `options`): what the engine needs, and all it needs;
//! - without that setting, connecting through PgBouncer fails, naming the
//!   refused parameter; `PostgresPooler::Transaction` is refused with a
//!   typed error (the engine's named statements and session settings do
//!   not survive transaction pooling);
//! - a caller's own connection to a **transaction-mode** entry (what most
//!   services use) completes a key in its transaction: `complete_in` over
//!   `tokio-postgres` (inside a transaction, and outside one while other
//!   clients move it between server sessions) and, with the feature
//!   `sqlx`, over sqlx.
//!
//! Skipped, saying so, when `pgbouncer` is not installed (`apt-get install
//! pgbouncer`; `.ci/run` installs it) or `IDEMSTORE_SKIP_POSTGRES=1`.

mod common;
mod pg;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemstore::conformance::{self, Harness};
use idemstore::postgres::tokio_postgres::{self, NoTls};
use idemstore::{Config, ConfigFault, Error, PostgresPooler, State, Store};
use pg::txn::{acquire, key, runtime};

/// Where Debian installs it, else the `PATH`.
fn pgbouncer_binary() -> Option<PathBuf> {
    let debian = PathBuf::from("/usr/sbin/pgbouncer");
    if debian.is_file() {
        return Some(debian);
    }
    let found = Command::new("sh")
        .args(["-c", "command -v pgbouncer"])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&found.stdout).trim().to_string();
    (found.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A PgBouncer in front of the test server, with two entries for its
/// database: `session` (`pool_mode = session`) and `txn` (transaction
/// pooling, the default of this PgBouncer). `ignore_startup_parameters =
/// extra_float_digits` is for sqlx, which sends that parameter (PgBouncer
/// 1.18 refuses it otherwise); the store needs no such setting
/// ([`Bouncer::start_ignoring`] sets another list). Stopped when dropped.
struct Bouncer {
    child: Child,
    port: u16,
    user: String,
    _dir: tempfile::TempDir,
}

impl Bouncer {
    /// Starts one, or `None` (after saying why on stderr) when the tests
    /// are skipped.
    fn start() -> Option<Bouncer> {
        Bouncer::start_ignoring("extra_float_digits")
    }

    /// [`Bouncer::start`] with `ignore_startup_parameters = {ignored}`.
    fn start_ignoring(ignored: &str) -> Option<Bouncer> {
        let url = pg::url()?;
        let Some(binary) = pgbouncer_binary() else {
            eprintln!(
                "skipped: pgbouncer is not installed (apt-get install pgbouncer); \
                 the engine is not tested behind it"
            );
            return None;
        };
        let upstream: tokio_postgres::Config = url.parse().expect("the test server's URL");
        let host = match upstream.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            other => panic!("the test server must be on TCP: {other:?}"),
        };
        let server_port = upstream.get_ports().first().copied().unwrap_or(5432);
        let user = upstream.get_user().unwrap_or("postgres").to_string();
        let dbname = upstream.get_dbname().unwrap_or("postgres").to_string();
        let dir = tempfile::tempdir().expect("tempdir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let userlist = dir.path().join("userlist.txt");
        std::fs::write(&userlist, format!("\"{user}\" \"\"\n")).expect("userlist");
        let server = format!("host={host} port={server_port} dbname={dbname}");
        let ini = dir.path().join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 session = {server} pool_mode=session\n\
                 txn = {server}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {}\n\
                 pool_mode = transaction\n\
                 ignore_startup_parameters = {ignored}\n\
                 max_client_conn = 1000\n\
                 default_pool_size = 100\n",
                userlist.display()
            ),
        )
        .expect("pgbouncer.ini");
        let log = dir.path().join("pgbouncer.log");
        let mut command = Command::new(&binary);
        // PgBouncer refuses to run as root: as root, it drops to the
        // `postgres` user (which the test server runs as) once configured.
        if running_as_root() {
            command.args(["-u", "postgres"]);
            let _ = Command::new("chmod").args(["755"]).arg(dir.path()).status();
        }
        let child = command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("starting pgbouncer");
        let mut bouncer = Bouncer {
            child,
            port,
            user,
            _dir: dir,
        };
        // Ready once it accepts connections (or dead, with its log).
        let deadline = Instant::now() + pg::proxy::HANG_GUARD;
        loop {
            if let Ok(Some(status)) = bouncer.child.try_wait() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("pgbouncer exited ({status}): {text}");
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(bouncer);
            }
            assert!(Instant::now() < deadline, "pgbouncer never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The URL of entry `entry` (`session` or `txn`).
    fn url(&self, entry: &str) -> String {
        format!("postgresql://{}@127.0.0.1:{}/{entry}", self.user, self.port)
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Stores behind PgBouncer's session-mode entry, each in a schema of its
/// own.
struct Pooled {
    url: String,
}

impl Pooled {
    fn config(config: Config, schema: String) -> Config {
        config
            .postgres_schema(schema)
            .postgres_pooler(PostgresPooler::Session)
            .postgres_connections(4)
    }
}

impl Harness for Pooled {
    fn open(&self, name: &str, config: Config) -> Store {
        let schema = pg::schema(&format!("b_{name}"));
        Store::connect(&self.url, Pooled::config(config, schema)).unwrap()
    }

    fn reopen(&self, store: Store, config: Config) -> Store {
        let schema = pg::schema_of(&store);
        drop(store);
        Store::connect(&self.url, Pooled::config(config, schema)).unwrap()
    }
}

#[test]
fn the_conformance_suite_passes_through_pgbouncer() {
    let Some(bouncer) = Bouncer::start() else {
        return;
    };
    let h = Pooled {
        url: bouncer.url("session"),
    };
    for (name, test) in conformance::ALL {
        eprintln!("conformance through pgbouncer: {name}");
        test(&h);
    }
}

#[test]
fn pgbouncer_refuses_the_startup_options_and_transaction_pooling_is_refused() {
    let Some(bouncer) = Bouncer::start() else {
        return;
    };
    // The limits as startup `options`: PgBouncer refuses the parameter.
    let direct = Config::new()
        .postgres_schema(pg::schema("b_direct"))
        .postgres_connections(1);
    // Every connection is refused the same way: not transient (it was
    // `Unavailable`, retried for ever), and the message says what to set.
    match Store::connect(&bouncer.url("session"), direct) {
        Err(Error::Misconfigured {
            fault: ConfigFault::PoolerMismatch,
            detail,
        }) => {
            assert!(detail.contains("unsupported startup parameter"), "{detail}");
            assert!(detail.contains("PostgresPooler::Session"), "{detail}");
        }
        other => panic!("expected PgBouncer to refuse `options`, got {other:?}"),
    }
    // A store set for the pooler, whose URL has options of its own: the
    // pooler refuses them the same way.
    let with_options = format!(
        "{}?options=-c%20statement_timeout%3D5s",
        bouncer.url("session")
    );
    let config = Pooled::config(Config::new(), pg::schema("b_url_options"));
    match Store::connect(&with_options, config) {
        Err(Error::Misconfigured {
            fault: ConfigFault::PoolerMismatch,
            detail,
        }) => assert!(detail.contains("remove them from the URL"), "{detail}"),
        other => panic!("expected the URL's options to be refused, got {other:?}"),
    }
    let txn = Config::new()
        .postgres_schema(pg::schema("b_txn"))
        .postgres_pooler(PostgresPooler::Transaction);
    match Store::connect(&bouncer.url("txn"), txn) {
        Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "postgres_pooler"),
        other => panic!("expected transaction pooling to be refused, got {other:?}"),
    }
    // The embedded engine has no pooler.
    let dir = tempfile::tempdir().expect("tempdir");
    match Store::open_with(
        dir.path().join("s.redb"),
        Config::new().postgres_pooler(PostgresPooler::Session),
    ) {
        Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "postgres_pooler"),
        other => panic!("expected postgres_pooler to be refused, got {other:?}"),
    }
}

/// A PgBouncer told to drop the startup parameter `options`
/// (`ignore_startup_parameters = options`): a direct store's limits and
/// `row_security = off` would be dropped with it, so its connect is
/// refused (it connected, and ran without them). A store set for the
/// pooler sets them after connecting, and the URL's own settings with
/// `set_config`: one the server does not know is the connection string's
/// fault there too.
#[test]
fn a_pooler_that_drops_the_startup_options_is_found() {
    let Some(bouncer) = Bouncer::start_ignoring("extra_float_digits, options") else {
        return;
    };
    let direct = || {
        Config::new()
            .postgres_schema(pg::schema("b_dropped"))
            .postgres_connections(1)
    };
    let refused = |url: &str, what: &str| match Store::connect(url, direct()) {
        Err(Error::Misconfigured {
            fault: ConfigFault::PoolerMismatch,
            detail,
        }) => {
            assert!(
                detail.contains("ignore_startup_parameters"),
                "{what}: {detail}"
            );
            assert!(
                detail.contains("PostgresPooler::Session"),
                "{what}: {detail}"
            );
        }
        other => panic!("{what}: expected the dropped options to be found, got {other:?}"),
    };
    refused(&bouncer.url("session"), "a direct store");
    // The role's own `row_security = off` gives the value the options
    // would have set, but not as the client set it: found all the same.
    // (A pooler of its own, whose server sessions start after the change.)
    let url = pg::url().expect("the server");
    let rt = runtime();
    let (client, connection) = rt
        .block_on(tokio_postgres::connect(&url, NoTls))
        .expect("a connection to the server");
    rt.spawn(connection);
    let role = || format!("ALTER ROLE \"{}\"", bouncer.user);
    rt.block_on(client.batch_execute(&format!("{} SET row_security = off", role())))
        .expect("set the role's row_security");
    let outcome = std::panic::catch_unwind(|| {
        let fresh = Bouncer::start_ignoring("extra_float_digits, options").expect("a pooler");
        refused(&fresh.url("session"), "a role with row_security off");
    });
    rt.block_on(client.batch_execute(&format!("{} RESET row_security", role())))
        .expect("reset the role's row_security");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    let unknown = format!(
        "{}?options=-c%20no_such_setting%3D1",
        bouncer.url("session")
    );
    let config = Pooled::config(Config::new(), pg::schema("b_unknown_setting"));
    match Store::connect(&unknown, config) {
        Err(Error::Misconfigured {
            fault: ConfigFault::ConnectionString,
            detail,
        }) => assert!(detail.contains("no_such_setting"), "{detail}"),
        other => panic!("expected the unknown setting to be refused, got {other:?}"),
    }
    let config = Pooled::config(Config::new(), pg::schema("b_pooled"));
    let store = Store::connect(&bouncer.url("session"), config).expect("a pooled store");
    let k = idemstore::Key::new("bouncer", "k").unwrap();
    let fp = idemstore::Fingerprint::of(b"p");
    assert!(matches!(
        store.claim(&k, &fp, &idemstore::ClaimOptions::new()),
        Ok(idemstore::ClaimOutcome::Acquired(_))
    ));
}

/// A store set for a session-mode pooler, pointed at a transaction-mode
/// entry by mistake, is refused at connect: the probe's marker, set in
/// one connection's session, is read from another. Before, it connected
/// and served, and two such stores on different schemas ran each other's
/// prepared statements (one store's claims replayed the other's results).
/// The session-mode entry passes the probe on every connect of the
/// conformance suite above.
#[test]
fn a_session_store_at_a_transaction_mode_entry_is_refused() {
    let Some(bouncer) = Bouncer::start() else {
        return;
    };
    for attempt in 0..3 {
        let config = Pooled::config(Config::new(), pg::schema(&format!("b_probe{attempt}")));
        match Store::connect(&bouncer.url("txn"), config) {
            Err(Error::Misconfigured {
                fault: ConfigFault::TransactionPooling,
                detail,
            }) => assert!(detail.contains("pool_mode = session"), "{detail}"),
            other => panic!("expected transaction pooling to be found, got {other:?}"),
        }
    }
}

#[test]
fn a_callers_transaction_mode_connection_completes_in_its_transaction() {
    let Some(bouncer) = Bouncer::start() else {
        return;
    };
    let schema = pg::schema("b_caller");
    let store = Store::connect(
        &bouncer.url("session"),
        Pooled::config(Config::new().sweep_interval(None), schema.clone()),
    )
    .expect("connect");
    let table = format!("public.tickets_{schema}");
    let rt = runtime();
    rt.block_on(async {
        let (mut c, connection) = tokio_postgres::connect(&bouncer.url("txn"), NoTls)
            .await
            .expect("connect through pgbouncer");
        tokio::spawn(connection);
        c.batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, \
             idempotency_key text NOT NULL UNIQUE)"
        ))
        .await
        .expect("create tickets");
        // Many transactions, so that PgBouncer's pool moves the client
        // between server sessions.
        for i in 0..20 {
            let k = key(&format!("tp-{i}"));
            let lease = acquire(&store, &k);
            let tx = c.transaction().await.expect("begin");
            let row = tx
                .query_one(
                    &format!("INSERT INTO {table} (idempotency_key) VALUES ($1) RETURNING id"),
                    &[&k.to_string()],
                )
                .await
                .expect("insert");
            let id: i64 = row.get(0);
            idemstore::postgres::complete_in(&tx, &store, &lease, id.to_string().as_bytes())
                .await
                .expect("complete_in");
            tx.commit().await.expect("commit");
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!(r.state(), State::Succeeded);
        }
        // A client outside a transaction block: each statement is a
        // transaction of its own, which PgBouncer may give to another
        // server session (here, while three other clients keep the pool
        // busy), so every statement must be whole in one flight (a named
        // statement prepared in one and executed in the next is not found:
        // 26000). The completion commits on its own.
        let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let mut others = Vec::new();
        for _ in 0..3 {
            let (other, connection) = tokio_postgres::connect(&bouncer.url("txn"), NoTls)
                .await
                .expect("connect through pgbouncer");
            tokio::spawn(connection);
            let busy = std::sync::Arc::clone(&busy);
            others.push(tokio::spawn(async move {
                while busy.load(std::sync::atomic::Ordering::Relaxed) {
                    other.batch_execute("SELECT 1").await.expect("select");
                }
            }));
        }
        for i in 0..50 {
            let k = key(&format!("autocommit-{i}"));
            let lease = acquire(&store, &k);
            idemstore::postgres::complete_in(&c, &store, &lease, b"done")
                .await
                .unwrap_or_else(|e| panic!("completion {i}: {e:?}"));
            let r = store.get(&k).expect("get").expect("record");
            assert_eq!(r.state(), State::Succeeded);
        }
        busy.store(false, std::sync::atomic::Ordering::Relaxed);
        for other in others {
            other.await.expect("other client");
        }
        #[cfg(feature = "sqlx")]
        {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&bouncer.url("txn"))
                .await
                .expect("connect sqlx through pgbouncer");
            for i in 0..20 {
                let k = key(&format!("sqlx-{i}"));
                let lease = acquire(&store, &k);
                let mut tx = conn.begin().await.expect("begin");
                // Unnamed, as the caller's own statements must be behind
                // transaction pooling.
                let id: i64 = sqlx::query_scalar(&format!(
                    "INSERT INTO {table} (idempotency_key) VALUES ($1) RETURNING id"
                ))
                .bind(k.to_string())
                .persistent(false)
                .fetch_one(&mut *tx)
                .await
                .expect("insert");
                idemstore::postgres::sqlx::complete_in(
                    &mut tx,
                    &store,
                    &lease,
                    id.to_string().as_bytes(),
                )
                .await
                .expect("complete_in over sqlx");
                tx.commit().await.expect("commit");
                let r = store.get(&k).expect("get").expect("record");
                assert_eq!(r.state(), State::Succeeded);
            }
        }
    });
}
