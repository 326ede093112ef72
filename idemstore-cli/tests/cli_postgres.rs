//! The operator subcommands of the `idemstore` binary on a PostgreSQL store
//! (STORE a `postgresql://` URL, `--schema NAME`), and the migration of a
//! store between the engines through `export` and `import`.
//!
//! The tests that need a server start one throwaway server per test process
//! with the PostgreSQL 15 binaries (`apt-get install postgresql`; as root
//! they run as the `postgres` user), or use the server named by
//! `IDEMSTORE_PG_URL`; each test works in a schema of its own. Without
//! either they fail, naming how to install them, unless
//! `IDEMSTORE_SKIP_POSTGRES=1` says to skip them (they then print why and
//! pass). CI never skips them. The refusals (`--schema` on a file, a bad
//! URL, an unreachable server) need no server and always run.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use idemstore::postgres::server::TestServer;
use idemstore::{
    ClaimOptions, ClaimOutcome, Clock, Config, Fingerprint, Key, Lease, ManualClock, Store,
    SystemClock,
};
use serde_json::Value;

fn idemstore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args(args)
        .output()
        .expect("the idemstore binary runs")
}

fn code(out: &Output) -> i32 {
    out.status.code().expect("exited normally")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(out), stderr(out)))
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The server's URL, or `None` when the PostgreSQL tests are to be skipped.
fn server() -> Option<String> {
    if std::env::var_os("IDEMSTORE_SKIP_POSTGRES").is_some_and(|v| v == "1") {
        eprintln!("skipped: IDEMSTORE_SKIP_POSTGRES=1 (the PostgreSQL engine is not tested)");
        return None;
    }
    let server = TestServer::shared().unwrap_or_else(|e| panic!("{e}"));
    Some(server.url().to_string())
}

/// A schema name of this test's own, unique across runs on one server.
fn schema(name: &str) -> String {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() % 1_000_000_000);
    format!("cli_{run}_{name}")
}

fn key(id: &str) -> Key {
    Key::new("acme/tickets", id).unwrap()
}

fn acquire(store: &Store, k: &Key, opts: &ClaimOptions) -> Lease {
    match store
        .claim(k, &Fingerprint::of(k.id().as_bytes()), opts)
        .unwrap()
    {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("{other:?}"),
    }
}

/// The settings of a store written a minute ago (the binary reads the
/// server's clock, this machine's): 10 s leases, no sweeper.
fn minute_ago() -> Config {
    let clock = ManualClock::new(SystemClock.now_ms() - 60_000);
    Config::new()
        .clock(clock)
        .lease(Duration::from_secs(10))
        .sweep_interval(None)
}

/// One record whose 10 s lease has lapsed, with a recovery point and a
/// business key; one succeeded; one failed; one in another scope. Returns
/// the lapsed record's token.
fn populate(store: &Store) -> u64 {
    let lapsed = acquire(
        store,
        &key("lapsed"),
        &ClaimOptions::new().business_key("T-9"),
    );
    store.set_recovery_point(&lapsed, b"step-2").unwrap();
    let l = acquire(store, &key("done"), &ClaimOptions::new());
    store.complete(&l, b"ticket T-1").unwrap();
    let l = acquire(store, &key("failed"), &ClaimOptions::new());
    store.fail(&l, &[0xff, 0x00], false).unwrap();
    let other = Key::new("beta/refunds", "r-1").unwrap();
    let l = acquire(store, &other, &ClaimOptions::new());
    store.complete(&l, b"ok").unwrap();
    lapsed.token()
}

/// A populated PostgreSQL store in a new schema; returns the schema and
/// the lapsed record's token.
fn populated_schema(url: &str, name: &str) -> (String, u64) {
    let schema = schema(name);
    let store = Store::connect(url, minute_ago().postgres_schema(schema.clone())).unwrap();
    let token = populate(&store);
    (schema, token)
}

/// `list --json` without the fields judged at the time of the listing
/// (`age_ms`), in key order: what must survive a migration unchanged.
fn listing(store: &str, schema: Option<&str>) -> Vec<Value> {
    let mut args = vec!["list", store, "--json"];
    if let Some(s) = schema {
        args.extend(["--schema", s]);
    }
    let out = idemstore(&args);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let Value::Array(mut records) = json(&out) else {
        panic!("not an array: {}", stdout(&out))
    };
    for r in &mut records {
        r.as_object_mut().unwrap().remove("age_ms");
    }
    records.sort_by_key(|r| (r["scope"].to_string(), r["id"].to_string()));
    records
}

#[test]
fn stats_list_and_get_on_postgres() {
    let Some(url) = server() else { return };
    let (schema, token) = populated_schema(&url, "read");

    let out = idemstore(&["stats", &url, "--schema", &schema, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["records"]["total"], 4);
    assert_eq!(v["records"]["processing"], 1);
    assert_eq!(v["records"]["lapsed"], 1);
    assert_eq!(v["records"]["succeeded"], 2);
    assert_eq!(v["records"]["failed"], 1);
    let path = v["path"].as_str().unwrap();
    assert!(path.starts_with("postgresql://"), "{path}");
    assert!(path.ends_with(&format!("?schema={schema}")), "{path}");
    let out = idemstore(&["stats", &url, "--schema", &schema]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stdout(&out).contains("processing         1 (1 lapsed)"));

    let out = idemstore(&["list", &url, "--schema", &schema, "--lapsed", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["id"], "lapsed");
    let out = idemstore(&["list", &url, "--schema", &schema]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 5, "{}", stdout(&out));

    let out = idemstore(&[
        "get",
        &url,
        "--schema",
        &schema,
        "acme/tickets",
        "lapsed",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["state"], "processing");
    assert_eq!(v["token"], token);
    assert_eq!(v["lease_lapsed"], true);
    assert_eq!(v["business_key"], "T-9");
    assert_eq!(v["recovery_point"]["text"], "step-2");
    let out = idemstore(&["get", &url, "--schema", &schema, "acme/tickets", "nope"]);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
}

#[test]
fn resolve_sweep_and_check_on_postgres() {
    let Some(url) = server() else { return };
    let (schema, token) = populated_schema(&url, "write");
    // A record finished two minutes ago with a one-minute retention: past
    // retention now, for `sweep` to evict.
    {
        let clock = ManualClock::new(SystemClock.now_ms() - 120_000);
        let config = Config::new()
            .clock(clock)
            .retention(Duration::from_secs(60))
            .sweep_interval(None)
            .postgres_schema(schema.clone());
        let store = Store::connect(&url, config).unwrap();
        let l = acquire(&store, &key("old"), &ClaimOptions::new());
        store.complete(&l, b"gone").unwrap();
    }

    // Fenced by the token: a wrong one changes nothing.
    let wrong = (token + 100).to_string();
    let out = idemstore(&[
        "resolve",
        &url,
        "--schema",
        &schema,
        "acme/tickets",
        "lapsed",
        "--token",
        &wrong,
        "--raw",
        "--succeeded",
        "T-9",
    ]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    assert!(stderr(&out).contains("never issued"), "{}", stderr(&out));
    let out = idemstore(&[
        "resolve",
        &url,
        "--schema",
        &schema,
        "acme/tickets",
        "lapsed",
        "--token",
        &token.to_string(),
        "--raw",
        "--succeeded",
        "T-9",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["state"], "succeeded");
    assert_eq!(json(&out)["result"]["text"], "T-9");

    let out = idemstore(&["sweep", &url, "--schema", &schema, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["evicted"], 1);
    let out = idemstore(&["sweep", &url, "--schema", &schema, "--json"]);
    assert_eq!(json(&out)["evicted"], 0);

    let out = idemstore(&["check", &url, "--schema", &schema, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["clean"], true, "{v}");
    assert_eq!(v["integrity"], "not run", "{v}");
    assert_eq!(v["records"], 4, "{v}");
    assert!(v["path"].as_str().unwrap().ends_with(&schema), "{v}");
    let out = idemstore(&["check", &url, "--schema", &schema]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stdout(&out).ends_with("OK\n"), "{}", stdout(&out));
}

/// A file store exports, imports into a new PostgreSQL schema, exports
/// again and imports into a new file: `list` and `get` show the same
/// records at every step.
#[test]
fn migration_file_to_postgres_to_file() {
    let Some(url) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.redb");
    {
        let store = Store::open_with(&first, minute_ago()).unwrap();
        populate(&store);
    }
    let before = listing(p(&first), None);
    assert_eq!(before.len(), 4);

    let export1 = dir.path().join("first.export");
    let out = idemstore(&["export", p(&first), "--output", p(&export1)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let schema = schema("migrate");
    // Without --create, a schema that holds no store is refused.
    let out = idemstore(&["import", &url, "--schema", &schema, p(&export1)]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    assert!(stderr(&out).contains("--create"), "{}", stderr(&out));
    let out = idemstore(&[
        "import",
        &url,
        "--schema",
        &schema,
        "--create",
        p(&export1),
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["imported"], 4);
    assert_eq!(listing(&url, Some(&schema)), before);
    // Idempotent: again, nothing changes.
    let out = idemstore(&["import", &url, "--schema", &schema, p(&export1), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["imported"], 0);
    assert_eq!(json(&out)["present"], 4);
    let get = |store: &str, schema: Option<&str>| {
        let mut args = vec!["get", store, "acme/tickets", "lapsed", "--json"];
        if let Some(s) = schema {
            args.extend(["--schema", s]);
        }
        let mut v = json(&idemstore(&args));
        v.as_object_mut().unwrap().remove("age_ms");
        v
    };
    assert_eq!(get(&url, Some(&schema)), get(p(&first), None));

    let export2 = dir.path().join("pg.export");
    let out = idemstore(&["export", &url, "--schema", &schema, "--output", p(&export2)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains("exported 4 records"),
        "{}",
        stdout(&out)
    );
    let second = dir.path().join("second.redb");
    let out = idemstore(&["import", "--create", p(&second), p(&export2)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(listing(p(&second), None), before);
    assert_eq!(get(p(&second), None), get(p(&first), None));
}

/// The store's name as the commands print it
/// (`postgresql://host:port/db?schema=NAME`) names that store again when
/// given back as STORE: its `schema` parameter names the schema (the
/// driver gets the URL without it), a message names that schema, and
/// `--schema` naming another is refused on one line.
#[test]
fn the_stores_printed_name_names_its_schema() {
    let Some(url) = server() else { return };
    let (schema, _) = populated_schema(&url, "pasted");
    let out = idemstore(&["stats", &url, "--schema", &schema, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let path = json(&out)["path"].as_str().unwrap().to_owned();
    let sep = if url.contains('?') { '&' } else { '?' };
    let named = format!("{url}{sep}schema={schema}");
    for extra in [None, Some(schema.as_str())] {
        let mut args = vec!["stats", named.as_str(), "--json"];
        args.extend(extra.map(|s| ["--schema", s]).into_iter().flatten());
        let out = idemstore(&args);
        assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
        let v = json(&out);
        assert_eq!(v["path"], path.as_str());
        assert_eq!(v["records"]["total"], 4);
    }
    // The name itself holds no user: where that cannot connect, the
    // message names this store's schema.
    let out = idemstore(&["stats", &path]);
    if code(&out) != 0 {
        let err = stderr(&out);
        assert!(err.contains(&format!("?schema={schema}")), "{err}");
        assert!(!err.contains("schema=idemstore"), "{err}");
    }
    let out = idemstore(&["stats", &named, "--schema", "other"]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains("different schemas"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_schema_without_a_store_is_refused_and_not_created() {
    let Some(url) = server() else { return };
    let schema = schema("absent");
    for _ in 0..2 {
        let out = idemstore(&["stats", &url, "--schema", &schema]);
        assert_eq!(code(&out), 2, "{}", stdout(&out));
        let err = stderr(&out);
        assert!(err.contains("no idemstore store in schema"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // An invalid schema name is refused with the rule.
    let out = idemstore(&["stats", &url, "--schema", "no-dashes"]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    assert!(stderr(&out).contains("schema name"), "{}", stderr(&out));
}

#[test]
fn schema_on_a_file_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    drop(Store::open(&path).unwrap());
    for cmd in ["stats", "list", "sweep", "check"] {
        let out = idemstore(&[cmd, p(&path), "--schema", "other"]);
        assert_eq!(code(&out), 2, "{cmd}: {}", stdout(&out));
        let err = stderr(&out);
        assert!(err.contains("--schema is for a PostgreSQL store"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // A path that merely mentions a URL scheme is a file.
    let out = idemstore(&["stats", "./postgresql://x"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("no such store file"),
        "{}",
        stderr(&out)
    );
}

/// The export of an empty file store, written in `dir` (as `export`).
fn sound_export(dir: &Path) -> std::path::PathBuf {
    let export = dir.join("export");
    let source = Store::open(dir.join("source.redb")).unwrap();
    source
        .export(std::fs::File::create(&export).unwrap(), |_| {})
        .unwrap();
    export
}

/// An unreachable server and a bad URL: exit 2, one line naming the cause,
/// and never the password of the URL.
#[test]
fn unreachable_server_and_bad_url_never_show_the_password() {
    // A sound export for `import --create`, which checks its input's start
    // before it connects.
    let dir = tempfile::tempdir().unwrap();
    let export = sound_export(dir.path());
    let cases = [
        ("postgresql://admin:s3cret-pw@127.0.0.1:1/x", "unavailable"),
        (
            "postgres://admin:s3cret-pw@127.0.0.1:1/x?sslmode=disable",
            "unavailable",
        ),
        ("postgresql://admin:s3cret-pw@127.0.0.1:notaport/x", "url"),
        ("postgresql://admin:s3cret/pw@127.0.0.1:1/x", "s3cret"),
        // A password with an unescaped `?` or `#` cuts the authority short.
        ("postgresql://admin:s3cret?pw@127.0.0.1:1/x", "s3cret"),
        ("postgresql://admin:s3cret#pw@127.0.0.1:1/x", "s3cret"),
        // Any case of the scheme; any libpq keyword first.
        ("PostgreSQL://admin:s3cret-pw@127.0.0.1:1/x", "unavailable"),
        (
            "connect_timeout=5 host=127.0.0.1 port=1 user=admin password=s3cret-pw dbname=x",
            "unavailable",
        ),
        // Not a string this command reads: refused, not echoed.
        ("mysql://admin:s3cret-pw@127.0.0.1:1/x", "connection string"),
    ];
    for (url, cause) in cases {
        for args in [
            vec!["stats", url],
            vec!["check", url, "--json"],
            vec!["list", url, "--schema", "s1"],
            vec!["import", url, "--create", p(&export)],
        ] {
            let out = idemstore(&args);
            assert_eq!(code(&out), 2, "{args:?}: {}", stdout(&out));
            let err = stderr(&out);
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
            if cause != "s3cret" {
                assert!(err.contains(cause), "{args:?}: {err}");
            }
            assert!(!err.contains("s3cret"), "{args:?}: {err}");
            assert!(!stdout(&out).contains("s3cret-pw"), "{args:?}");
        }
    }
}

/// A key=value connection string (`host=… port=… dbname=… user=…`) names a
/// PostgreSQL store, as `Store::connect` takes it: the command reaches the
/// server instead of looking for a file of that name, and messages show
/// neither the user nor the password.
#[test]
fn a_key_value_connection_string_names_a_postgres_store() {
    use idemstore::postgres::tokio_postgres;
    let conn = "host=127.0.0.1 port=1 dbname=x user=admin password=s3cret-pw";
    let out = idemstore(&["stats", conn]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains("unavailable"), "{err}");
    assert!(!err.contains("no such store file"), "{err}");
    assert!(err.contains("postgresql://127.0.0.1:1/x"), "{err}");
    assert!(!err.contains("s3cret") && !err.contains("admin"), "{err}");
    let Some(url) = server() else { return };
    // The shared server's URL, spelled as key=value.
    let parsed: tokio_postgres::Config = url.parse().unwrap();
    let host = match &parsed.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
    };
    let mut conn = format!(
        "host={host} port={} dbname={} user={}",
        parsed.get_ports()[0],
        parsed.get_dbname().unwrap(),
        parsed.get_user().unwrap()
    );
    if let Some(pw) = parsed.get_password() {
        conn.push_str(&format!(" password={}", String::from_utf8_lossy(pw)));
    }
    let schema = schema("kv");
    {
        let store = Store::connect(&url, Config::new().postgres_schema(&schema)).unwrap();
        let l = acquire(&store, &key("kv"), &ClaimOptions::new());
        store.complete(&l, b"\"T-1\"").unwrap();
    }
    let out = idemstore(&[
        "get",
        &conn,
        "--schema",
        &schema,
        "acme/tickets",
        "kv",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["state"], "succeeded");
}

#[test]
fn migrate_creates_the_schema_once_for_a_deploy() {
    let Some(url) = server() else { return };
    let schema = schema("migrate");
    let out = idemstore(&["migrate", &url, "--schema", &schema]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains("created at schema version 2"),
        "{}",
        stdout(&out)
    );
    // Idempotent; JSON says what it found.
    let out = idemstore(&["migrate", &url, "--schema", &schema, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["created"], false);
    assert_eq!(v["schema_version"], 2);
    // The store is there: the other commands open it.
    let out = idemstore(&["stats", &url, "--schema", &schema, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    // A file store needs no migration: a usage error.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.redb");
    let out = idemstore(&["migrate", p(&file)]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("PostgreSQL"), "{}", stderr(&out));
    assert!(!file.exists());
}

/// `import --create` of input that is not an export (an empty file, one
/// cut in its header, a text file, one whose first frame is cut) into a
/// schema that holds no store creates nothing: exit 2 naming the fault and
/// saying so, and the schema still holds no store. (The schema was created,
/// empty, before the input was read.)
#[test]
fn import_create_of_input_that_is_not_an_export_creates_nothing() {
    let Some(url) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let export = sound_export(dir.path());
    let sound = std::fs::read(&export).unwrap();
    let schema = schema("not_an_export");
    let inputs: [(&str, &[u8]); 4] = [
        ("empty", b""),
        ("cut", &sound[..10]),
        ("text", b"ticket,amount\nT-1,10\n"),
        ("cut-meta", &sound[..30]),
    ];
    for (name, bytes) in inputs {
        let input = dir.path().join(name);
        std::fs::write(&input, bytes).unwrap();
        let out = idemstore(&["import", &url, "--schema", &schema, p(&input), "--create"]);
        assert_eq!(code(&out), 2, "{name}: {}", stdout(&out));
        let err = stderr(&out);
        assert!(
            err.contains("export") && err.contains("nothing was created"),
            "{name}: {err}"
        );
        let out = idemstore(&["stats", &url, "--schema", &schema]);
        assert_eq!(code(&out), 2, "{name}: {}", stdout(&out));
        assert!(
            stderr(&out).contains("no idemstore store in schema"),
            "{name}: {}",
            stderr(&out)
        );
        // A file store is not created either.
        let file = dir.path().join(format!("{name}.redb"));
        let out = idemstore(&["import", p(&file), p(&input), "--create"]);
        assert_eq!(code(&out), 2, "{name}: {}", stdout(&out));
        assert!(stderr(&out).contains("nothing was created"), "{name}");
        assert!(!file.exists(), "{name}");
    }
    // The sound export creates the store.
    let out = idemstore(&["import", &url, "--schema", &schema, p(&export), "--create"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}
