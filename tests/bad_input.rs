//! Bad input gets a typed error and changes nothing (DESIGN.md guarantee 7).
//!
//! A table of every public operation with each kind of bad input: the
//! expected error variant, and a snapshot of the store (`get` of every key
//! and `len()`) that must be the same before and after the call.

mod common;

use std::time::Duration;

use common::*;
use idemstore::{
    Config, Error, Fingerprint, Key, Lease, MAX_FINGERPRINT_LEN, MAX_LEASE, MAX_VALUE_LIMIT,
    Record, Store,
};

/// The value limits of the test store (in bytes), small so that the table
/// stays cheap.
const RESULT_LIMIT: usize = 64;
const FAILURE_LIMIT: usize = 48;
const RECOVERY_LIMIT: usize = 32;

/// The error a case must get.
#[derive(Debug, Clone)]
enum Expect {
    InvalidArgument(&'static str),
    TooLarge {
        what: &'static str,
        len: usize,
        limit: usize,
    },
    StaleLease {
        key: String,
        token: u64,
    },
}

impl Expect {
    fn matches(&self, err: &Error) -> bool {
        match (self, err) {
            (Expect::InvalidArgument(w), Error::InvalidArgument { what, .. }) => w == what,
            (
                Expect::TooLarge { what, len, limit },
                Error::TooLarge {
                    what: w,
                    len: l,
                    limit: m,
                },
            ) => (what, len, limit) == (w, l, m),
            (Expect::StaleLease { key, token }, Error::StaleLease { key: k, token: t }) => {
                (key, token) == (k, t)
            }
            _ => false,
        }
    }
}

/// The store's state as the public API shows it.
#[derive(Debug, PartialEq)]
struct Snapshot {
    records: Vec<(Key, Option<Record>)>,
    len: u64,
}

/// A populated store with a record in every state, and the leases that are
/// stale against it.
struct Fixture {
    t: TestDir,
    store: Store,
    keys: Vec<Key>,
    /// The current lease of a Processing record (valid).
    live: Lease,
    /// The current lease of a Processing record whose lease lapsed (nobody
    /// took it over, so it is still current).
    lapsed: Lease,
    /// Stale leases: (what, lease).
    stale: Vec<(&'static str, Lease)>,
}

impl Fixture {
    fn new() -> Fixture {
        let t = TestDir::new();
        let store = t.open_with(config(&t));
        let k = |id: &str| key(id);
        let claim = |id: &str, lease: Duration| {
            acquired(store.claim(&k(id), &fp(id), &lease_of(lease)).unwrap())
        };

        let lapsed = claim("lapsed", secs(5));
        let taken_over_old = claim("taken-over", secs(5));
        let succeeded = claim("succeeded", secs(30));
        store.complete(&succeeded, b"ok").unwrap();
        let failed = claim("failed", secs(30));
        store.fail(&failed, b"no", false).unwrap();
        let retryable = claim("failed-retryable", secs(30));
        store.fail(&retryable, b"later", true).unwrap();
        let released = claim("released", secs(30));
        store.release(released.clone()).unwrap();
        let with_point = claim("recovery-point", secs(600));
        store.set_recovery_point(&with_point, b"step 1").unwrap();

        t.clock.advance(secs(10)); // the 5 s leases lapse
        let taken_over_new = claim("taken-over", secs(600));
        let live = claim("live", secs(600));

        let stale = vec![
            ("taken over", taken_over_old.clone()),
            ("completed", succeeded.clone()),
            ("failed permanently", failed.clone()),
            ("failed retryably", retryable.clone()),
            ("released", released.clone()),
            ("token + 1", Lease::from_parts(k("live"), live.token() + 1)),
            ("token - 1", Lease::from_parts(k("live"), live.token() - 1)),
            ("token 0", Lease::from_parts(k("live"), 0)),
            ("token u64::MAX", Lease::from_parts(k("live"), u64::MAX)),
            (
                "another key's token",
                Lease::from_parts(k("live"), taken_over_new.token()),
            ),
            (
                "rebuilt from the old token of a taken-over key",
                Lease::from_parts(k("taken-over"), taken_over_old.token()),
            ),
            (
                "a key never claimed",
                Lease::from_parts(k("never"), live.token()),
            ),
        ];
        let keys = [
            "lapsed",
            "taken-over",
            "succeeded",
            "failed",
            "failed-retryable",
            "released",
            "recovery-point",
            "live",
            "never",
        ]
        .iter()
        .map(|id| k(id))
        .collect();
        Fixture {
            t,
            store,
            keys,
            live,
            lapsed,
            stale,
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            records: self
                .keys
                .iter()
                .map(|k| (k.clone(), self.store.get(k).unwrap()))
                .collect(),
            len: self.store.len().unwrap(),
        }
    }
}

fn config(t: &TestDir) -> Config {
    t.config()
        .max_result_bytes(RESULT_LIMIT)
        .max_failure_bytes(FAILURE_LIMIT)
        .max_recovery_point_bytes(RECOVERY_LIMIT)
}

type Op = Box<dyn Fn(&Store) -> Result<(), Error>>;

fn check(f: &Fixture, name: &str, op: &Op, expect: &Expect) {
    let before = f.snapshot();
    match op(&f.store) {
        Err(err) if expect.matches(&err) => {
            assert!(err.is_client_error(), "{name}: {err:?} is a client error");
        }
        Err(err) => panic!("{name}: expected {expect:?}, got {err:?}"),
        Ok(()) => panic!("{name}: expected {expect:?}, got Ok"),
    }
    assert_eq!(before, f.snapshot(), "{name} changed the store");
}

/// Every lease-taking operation with every stale lease, and with each value
/// over its limit, and every claim and extend with a bad duration.
#[test]
fn bad_input_to_store_operations_changes_nothing() {
    let f = Fixture::new();
    let mut cases: Vec<(String, Op, Expect)> = Vec::new();

    for (what, lease) in &f.stale {
        let stale = Expect::StaleLease {
            key: lease.key().to_string(),
            token: lease.token(),
        };
        let l = lease.clone();
        cases.push((
            format!("complete, {what}"),
            Box::new(move |s| s.complete(&l, b"r").map(drop)),
            stale.clone(),
        ));
        let l = lease.clone();
        cases.push((
            format!("fail permanently, {what}"),
            Box::new(move |s| s.fail(&l, b"f", false).map(drop)),
            stale.clone(),
        ));
        let l = lease.clone();
        cases.push((
            format!("fail retryably, {what}"),
            Box::new(move |s| s.fail(&l, b"f", true).map(drop)),
            stale.clone(),
        ));
        let l = lease.clone();
        cases.push((
            format!("release, {what}"),
            Box::new(move |s| s.release(l.clone())),
            stale.clone(),
        ));
        let l = lease.clone();
        cases.push((
            format!("extend, {what}"),
            Box::new(move |s| s.extend(&l, secs(60)).map(drop)),
            stale.clone(),
        ));
        let l = lease.clone();
        cases.push((
            format!("set_recovery_point, {what}"),
            Box::new(move |s| s.set_recovery_point(&l, b"p")),
            stale,
        ));
    }

    // Values over their limits, under a valid lease and under a lapsed but
    // current one.
    for (which, lease) in [("valid lease", &f.live), ("lapsed lease", &f.lapsed)] {
        for over in [1, 1000] {
            let l = lease.clone();
            let len = RESULT_LIMIT + over;
            cases.push((
                format!("complete, result of {len} bytes, {which}"),
                Box::new(move |s| s.complete(&l, &vec![7; len]).map(drop)),
                Expect::TooLarge {
                    what: "result",
                    len,
                    limit: RESULT_LIMIT,
                },
            ));
            for retryable in [false, true] {
                let l = lease.clone();
                let len = FAILURE_LIMIT + over;
                cases.push((
                    format!("fail(retryable={retryable}), failure of {len} bytes, {which}"),
                    Box::new(move |s| s.fail(&l, &vec![7; len], retryable).map(drop)),
                    Expect::TooLarge {
                        what: "failure",
                        len,
                        limit: FAILURE_LIMIT,
                    },
                ));
            }
            let l = lease.clone();
            let len = RECOVERY_LIMIT + over;
            cases.push((
                format!("set_recovery_point of {len} bytes, {which}"),
                Box::new(move |s| s.set_recovery_point(&l, &vec![7; len])),
                Expect::TooLarge {
                    what: "recovery point",
                    len,
                    limit: RECOVERY_LIMIT,
                },
            ));
        }
        for (what, d) in bad_durations() {
            let l = lease.clone();
            cases.push((
                format!("extend by {what}, {which}"),
                Box::new(move |s| s.extend(&l, d).map(drop)),
                Expect::InvalidArgument("lease"),
            ));
        }
    }
    // Too large and stale: the size is checked first, so it is TooLarge.
    let (_, stale) = &f.stale[0];
    let l = stale.clone();
    cases.push((
        "complete, too large and stale".into(),
        Box::new(move |s| s.complete(&l, &[0; RESULT_LIMIT + 1]).map(drop)),
        Expect::TooLarge {
            what: "result",
            len: RESULT_LIMIT + 1,
            limit: RESULT_LIMIT,
        },
    ));

    // Claims with a bad lease, on keys in every state, with the right and a
    // wrong fingerprint.
    for k in &f.keys {
        for (what, d) in bad_durations() {
            for payload in [k.id().to_string(), "other payload".to_string()] {
                let k2 = k.clone();
                cases.push((
                    format!("claim {k} with payload {payload:?} and lease {what}"),
                    Box::new(move |s| s.claim(&k2, &fp(&payload), &lease_of(d)).map(drop)),
                    Expect::InvalidArgument("lease"),
                ));
            }
        }
    }

    for (name, op, expect) in &cases {
        check(&f, name, op, expect);
    }
    assert!(cases.len() > 100, "{} cases", cases.len());

    // The leases the table used are still good: nothing was consumed.
    f.t.clock.advance(ms(1));
    f.store.complete(&f.live, b"finally").unwrap();
    f.store.complete(&f.lapsed, b"late but current").unwrap();
}

fn bad_durations() -> Vec<(&'static str, Duration)> {
    vec![
        ("zero", Duration::ZERO),
        ("under 1 ms", Duration::from_micros(999)),
        ("MAX_LEASE + 1 ms", MAX_LEASE + ms(1)),
        ("Duration::MAX", Duration::MAX),
    ]
}

/// Key::new refuses empty, over-long and control-character parts.
#[test]
fn bad_keys_are_invalid_key() {
    let cases: Vec<(&str, String, String)> = vec![
        ("empty scope", String::new(), "id".into()),
        ("empty id", "scope".into(), String::new()),
        ("both empty", String::new(), String::new()),
        ("scope of 129 bytes", "s".repeat(129), "id".into()),
        ("id of 256 bytes", "scope".into(), "i".repeat(256)),
        (
            "scope of 130 bytes in 65 chars",
            "é".repeat(65),
            "id".into(),
        ),
        (
            "id of 256 bytes in 128 chars",
            "scope".into(),
            "é".repeat(128),
        ),
        ("newline in id", "scope".into(), "a\nb".into()),
        ("NUL in id", "scope".into(), "a\0b".into()),
        ("tab in scope", "a\tb".into(), "id".into()),
        ("DEL in scope", "a\u{7f}b".into(), "id".into()),
        ("C1 control in id", "scope".into(), "a\u{85}b".into()),
    ];
    for (what, scope, id) in cases {
        match Key::new(scope, id) {
            Err(err @ Error::InvalidKey { .. }) => assert!(err.is_client_error()),
            other => panic!("{what}: {other:?}"),
        }
    }
    // The limits themselves are accepted.
    assert!(Key::new("s".repeat(128), "i".repeat(255)).is_ok());
}

/// Fingerprint::from_bytes refuses empty and over-long digests.
#[test]
fn bad_fingerprints_are_invalid_argument() {
    for len in [0, MAX_FINGERPRINT_LEN + 1, 1024] {
        match Fingerprint::from_bytes(vec![1; len]) {
            Err(Error::InvalidArgument {
                what: "fingerprint",
                ..
            }) => {}
            other => panic!("{len} bytes: {other:?}"),
        }
    }
    assert!(Fingerprint::from_bytes(vec![1; 1]).is_ok());
    assert!(Fingerprint::from_bytes(vec![1; MAX_FINGERPRINT_LEN]).is_ok());
}

/// Every bad Config value is refused by open_with: on a populated store the
/// file is left as it was; on a fresh path no file is created.
#[test]
fn bad_config_is_refused_and_changes_nothing() {
    let f = Fixture::new();
    let before = f.snapshot();
    let Fixture { t, store, .. } = f;
    drop(store);

    let bad: Vec<(&str, Config, &str)> = vec![
        (
            "zero retention",
            config(&t).retention(Duration::ZERO),
            "retention",
        ),
        (
            "retention under 1 ms",
            config(&t).retention(Duration::from_micros(500)),
            "retention",
        ),
        ("zero lease", config(&t).lease(Duration::ZERO), "lease"),
        (
            "lease under 1 ms",
            config(&t).lease(Duration::from_nanos(1)),
            "lease",
        ),
        (
            "lease over MAX_LEASE",
            config(&t).lease(MAX_LEASE + ms(1)),
            "lease",
        ),
        (
            "lease Duration::MAX",
            config(&t).lease(Duration::MAX),
            "lease",
        ),
        (
            "max_result_bytes over MAX_VALUE_LIMIT",
            config(&t).max_result_bytes(MAX_VALUE_LIMIT + 1),
            "max_result_bytes",
        ),
        (
            "max_failure_bytes over MAX_VALUE_LIMIT",
            config(&t).max_failure_bytes(usize::MAX),
            "max_failure_bytes",
        ),
        (
            "max_recovery_point_bytes over MAX_VALUE_LIMIT",
            config(&t).max_recovery_point_bytes(MAX_VALUE_LIMIT + 1),
            "max_recovery_point_bytes",
        ),
        ("zero sweep batch", config(&t).sweep_batch(0), "sweep_batch"),
        (
            "zero sweep interval",
            config(&t).sweep_interval(Some(Duration::ZERO)),
            "sweep_interval",
        ),
        (
            "a PostgreSQL schema on a store file",
            config(&t).postgres_schema("idem"),
            "postgres_schema",
        ),
        (
            "PostgreSQL connections on a store file",
            config(&t).postgres_connections(4),
            "postgres_connections",
        ),
    ];
    let file_before = std::fs::read(&t.path).unwrap();
    let fresh = t.dir.path().join("fresh.redb");
    for (name, config, what) in bad {
        let expect = Expect::InvalidArgument(what);
        for path in [&t.path, &fresh] {
            match Store::open_with(path, config.clone()) {
                Err(err) if expect.matches(&err) => {}
                Err(err) => panic!("{name} at {}: {err:?}", path.display()),
                Ok(_) => panic!("{name} at {}: opened", path.display()),
            }
        }
        assert!(!fresh.exists(), "{name}: a refused open created a file");
        assert_eq!(
            std::fs::read(&t.path).unwrap(),
            file_before,
            "{name}: a refused open changed the file"
        );
    }

    // The limits themselves are accepted, and the store is as it was.
    let store = t.open_with(
        config(&t)
            .lease(MAX_LEASE)
            .retention(ms(1))
            .max_result_bytes(MAX_VALUE_LIMIT)
            .sweep_batch(1),
    );
    drop(store);
    let store = t.open_with(config(&t));
    let after = Snapshot {
        records: before
            .records
            .iter()
            .map(|(k, _)| (k.clone(), store.get(k).unwrap()))
            .collect(),
        len: store.len().unwrap(),
    };
    assert_eq!(before, after);
}

/// A path that names something other than a regular file (a directory, a
/// fifo, a device), as the store or as its log, is refused at open with
/// `IncompatibleFile` naming it, before anything is created or written: no
/// open blocks on a fifo, and nothing appears beside the path.
#[cfg(target_os = "linux")]
#[test]
fn a_path_that_is_not_a_regular_file_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let subdir = dir.path().join("subdir");
    std::fs::create_dir(&subdir).unwrap();
    // A store whose log path is a directory.
    let store_with_bad_log = dir.path().join("s.redb");
    std::fs::create_dir(dir.path().join("s.redb-wal")).unwrap();
    let listing = || {
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let before = listing();
    for (path, named) in [
        (&fifo, &fifo),
        (&subdir, &subdir),
        (&store_with_bad_log, &dir.path().join("s.redb-wal")),
    ] {
        // `open_existing` of the store whose log is a directory answers
        // `Missing`: there is no store file.
        let existing_too = path != &store_with_bad_log;
        for existing in [false, true] {
            if existing && !existing_too {
                continue;
            }
            // Hang guard: an open that blocks on the fifo fails the test
            // instead of hanging it.
            let p = path.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let opened = if existing {
                    Store::open_existing(&p, Config::new())
                } else {
                    Store::open(&p)
                };
                let _ = tx.send(opened.map(|_| ()));
            });
            let err = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("opening {} blocked", path.display()))
                .expect_err("opened");
            match &err {
                Error::IncompatibleFile { path: p, detail } => {
                    assert_eq!(p, named, "{err}");
                    assert!(detail.contains("not a regular file"), "{err}");
                }
                other => panic!("{}: {other:?}", path.display()),
            }
        }
    }
    assert_eq!(listing(), before, "nothing is created beside the paths");
}

/// A write-ahead log left where its store file was deleted (or moved) is
/// refused at open, naming the log, before anything is created: a new store
/// beside it would never open (the log names the old store), and an
/// `import --create` there left such a file behind. So is one beside an
/// empty store file. The log is untouched; put back, the store opens with
/// its records.
#[test]
fn a_log_without_its_store_file_is_refused_before_a_store_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gone.redb");
    let log = dir.path().join("gone.redb-wal");
    {
        let store = Store::open(&path).unwrap();
        let lease = acquired(
            store
                .claim(&key("kept"), &fp("p"), &Default::default())
                .unwrap(),
        );
        store.complete(&lease, b"done").unwrap();
    }
    let aside = dir.path().join("aside.redb");
    std::fs::rename(&path, &aside).unwrap();
    let log_bytes = std::fs::read(&log).unwrap();
    for existing in [false, true] {
        let opened = if existing {
            Store::open_existing(&path, Config::new())
        } else {
            Store::open(&path)
        };
        match opened.map(|_| ()) {
            Err(Error::IncompatibleFile { path: p, detail }) if !existing => {
                assert_eq!(p, log);
                assert!(detail.contains("no store file beside it"), "{detail}");
            }
            // `open_existing` never creates: the store file is missing.
            Err(Error::Missing { path: p }) if existing => assert_eq!(p, path),
            other => panic!("existing {existing}: {other:?}"),
        }
        assert!(!path.exists(), "no store file was created");
        assert_eq!(
            std::fs::read(&log).unwrap(),
            log_bytes,
            "the log is untouched"
        );
    }
    // An empty file in the store's place (which an open would make a new
    // store) is refused the same way, and left empty.
    std::fs::File::create(&path).unwrap();
    match Store::open(&path).map(|_| ()) {
        Err(Error::IncompatibleFile { path: p, detail }) => {
            assert_eq!(p, log);
            assert!(detail.contains("missing or empty"), "{detail}");
        }
        other => panic!("empty store file: {other:?}"),
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    assert_eq!(std::fs::read(&log).unwrap(), log_bytes);
    std::fs::rename(&aside, &path).unwrap();
    let store = Store::open(&path).unwrap();
    assert_eq!(
        store.get(&key("kept")).unwrap().unwrap().result(),
        Some(&b"done"[..])
    );
}
