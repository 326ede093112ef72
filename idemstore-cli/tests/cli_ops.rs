//! The operator subcommands of the `idemstore` binary, run as a user would:
//! the built binary on a store file written through the library.

#[path = "../../tests/common/mod.rs"]
mod common;
use common::damage_record;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

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

/// A store written a minute ago (the binary reads the system clock): one
/// record whose 10 s lease has lapsed, with a recovery point and a
/// business key; one succeeded; one failed; one in another scope.
/// Returns the lapsed record's token.
fn populate(path: &Path) -> u64 {
    let clock = ManualClock::new(SystemClock.now_ms() - 60_000);
    let store = Store::open_with(
        path,
        Config::new()
            .clock(clock)
            .lease(Duration::from_secs(10))
            .sweep_interval(None),
    )
    .unwrap();
    let lapsed = acquire(
        &store,
        &key("lapsed"),
        &ClaimOptions::new().business_key("T-9"),
    );
    store.set_recovery_point(&lapsed, b"step-2").unwrap();
    let l = acquire(&store, &key("done"), &ClaimOptions::new());
    store.complete(&l, b"ticket T-1").unwrap();
    let l = acquire(&store, &key("failed"), &ClaimOptions::new());
    store.fail(&l, &[0xff, 0x00], false).unwrap();
    let other = Key::new("beta/refunds", "r-1").unwrap();
    let l = acquire(&store, &other, &ClaimOptions::new());
    store.complete(&l, b"ok").unwrap();
    lapsed.token()
}

#[test]
fn stats_shows_records_by_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    populate(&path);
    let out = idemstore(&["stats", p(&path), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["records"]["processing"], 1);
    assert_eq!(v["records"]["lapsed"], 1);
    assert_eq!(v["records"]["succeeded"], 2);
    assert_eq!(v["records"]["failed"], 1);
    assert_eq!(v["records"]["total"], 4);
    assert!(v["oldest_processing_age_ms"].as_u64().unwrap() >= 60_000);
    assert!(v["file_bytes"].as_u64().unwrap() > 0);

    let out = idemstore(&["stats", p(&path)]);
    assert_eq!(code(&out), 0);
    let text = stdout(&out);
    assert!(text.contains("processing         1 (1 lapsed)"), "{text}");
    assert!(text.contains("oldest processing    1m"), "{text}");
}

#[test]
fn get_shows_one_record_and_exits_1_when_absent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let token = populate(&path);
    let out = idemstore(&["get", p(&path), "acme/tickets", "lapsed", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["state"], "processing");
    assert_eq!(v["token"], token);
    assert_eq!(v["lease_lapsed"], true);
    assert_eq!(v["business_key"], "T-9");
    assert_eq!(v["recovery_point"]["text"], "step-2");

    let out = idemstore(&["get", p(&path), "acme/tickets", "failed", "--json"]);
    assert_eq!(json(&out)["failure"]["hex"], "ff00");

    let out = idemstore(&["get", p(&path), "acme/tickets", "done"]);
    assert!(stdout(&out).contains("\"ticket T-1\""), "{}", stdout(&out));

    let out = idemstore(&["get", p(&path), "acme/tickets", "nope", "--json"]);
    assert_eq!(code(&out), 1);
    assert_eq!(json(&out), Value::Null);
    let out = idemstore(&["get", p(&path), "", "x"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).starts_with("idemstore: invalid key"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn list_filters_and_finds_work_to_compensate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    populate(&path);
    let ids = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["list", p(&path), "--json"];
        all.extend_from_slice(args);
        let out = idemstore(&all);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        json(&out)
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "{}/{}",
                    r["scope"].as_str().unwrap(),
                    r["id"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(ids(&[]).len(), 4);
    assert_eq!(ids(&["--compensation"]), vec!["acme/tickets/lapsed"]);
    assert_eq!(ids(&["--lapsed"]), vec!["acme/tickets/lapsed"]);
    assert_eq!(
        ids(&["--state", "succeeded"]),
        vec!["acme/tickets/done", "beta/refunds/r-1"]
    );
    assert_eq!(ids(&["--scope-prefix", "beta/"]), vec!["beta/refunds/r-1"]);
    assert_eq!(ids(&["--older-than", "1h"]).len(), 0);
    assert_eq!(ids(&["--older-than", "30s"]).len(), 4);
    assert_eq!(ids(&["--limit", "2"]).len(), 2);

    let out = idemstore(&["list", p(&path), "--state", "processing"]);
    let text = stdout(&out);
    assert!(text.starts_with("SCOPE\tID\tSTATE"), "{text}");
    assert!(
        text.contains("acme/tickets\tlapsed\tprocessing\t"),
        "{text}"
    );
    assert!(text.contains("\tlapsed "), "the lease column: {text}");
    assert_eq!(text.lines().count(), 2, "{text}");
}

/// Scopes hold `/` and spaces, so `list` prints scope and id as columns of
/// their own (tab-separated; `--json` as fields) and they paste into `get`
/// and `resolve` as two arguments.
#[test]
fn list_columns_paste_into_get_and_resolve() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
    // A scope/id split that the joined form `a/b c/d/e` would hide.
    let tricky = Key::new("acme corp/tickets", "run 1/call:7").unwrap();
    let lease = acquire(&store, &tricky, &ClaimOptions::new());
    let decoy = Key::new("acme corp", "tickets/run 1/call:7").unwrap();
    let l = acquire(&store, &decoy, &ClaimOptions::new());
    store.complete(&l, b"other").unwrap();
    drop(store);

    let out = idemstore(&["list", p(&path), "--state", "processing"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    let mut lines = text.lines();
    assert_eq!(
        lines.next().unwrap().split('\t').collect::<Vec<_>>(),
        [
            "SCOPE",
            "ID",
            "STATE",
            "TOKEN",
            "AGE",
            "LEASE",
            "BUSINESS KEY"
        ]
    );
    let row: Vec<&str> = lines.next().unwrap().split('\t').collect();
    assert_eq!(row.len(), 7, "{text}");
    assert_eq!(
        row[..4],
        [
            "acme corp/tickets",
            "run 1/call:7",
            "processing",
            &lease.token().to_string()
        ]
    );
    assert_eq!(lines.next(), None);

    let out = idemstore(&["get", p(&path), row[0], row[1], "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["token"], lease.token());
    let out = idemstore(&["get", p(&path), row[0], row[1]]);
    let text = stdout(&out);
    assert!(
        text.contains("scope           acme corp/tickets\n"),
        "{text}"
    );
    assert!(text.contains("id              run 1/call:7\n"), "{text}");
    let out = idemstore(&[
        "resolve",
        p(&path),
        row[0],
        row[1],
        "--token",
        row[3],
        "--while-held",
        "--raw",
        "--succeeded",
        "T-1",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stdout(&out).contains(r#"resolved scope "acme corp/tickets" id "run 1/call:7""#),
        "{}",
        stdout(&out)
    );

    let out = idemstore(&["list", p(&path), "--json"]);
    let rows = json(&out);
    let mut keys: Vec<(&str, &str)> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["scope"].as_str().unwrap(), r["id"].as_str().unwrap()))
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            ("acme corp", "tickets/run 1/call:7"),
            ("acme corp/tickets", "run 1/call:7")
        ]
    );

    // An empty listing is the header alone on stdout.
    let out = idemstore(&["list", p(&path), "--state", "processing"]);
    assert_eq!(
        stdout(&out),
        "SCOPE\tID\tSTATE\tTOKEN\tAGE\tLEASE\tBUSINESS KEY\n"
    );
    assert!(stderr(&out).contains("(no records)"), "{}", stderr(&out));
}

/// A wrong split of a key is answered with the scope and id as they were
/// received, so the operator sees which part is wrong.
#[test]
fn no_record_answers_show_scope_and_id_as_received() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    populate(&path);
    let out = idemstore(&["get", p(&path), "acme", "tickets/lapsed"]);
    assert_eq!(code(&out), 1);
    assert_eq!(
        stdout(&out),
        "no record for scope \"acme\" id \"tickets/lapsed\" (absent or past retention)\n"
    );
    let out = idemstore(&["get", p(&path), "acme tickets", " lapsed"]);
    assert_eq!(code(&out), 1);
    assert!(
        stdout(&out).contains(r#"scope "acme tickets" id " lapsed""#),
        "{}",
        stdout(&out)
    );
    let out = idemstore(&["get", p(&path), "", "x"]);
    assert!(
        stderr(&out).contains(r#"scope "" id "x""#),
        "{}",
        stderr(&out)
    );
}

/// `resolve` refuses in three different ways, each saying which, and
/// changes nothing in any of them.
#[test]
fn resolve_tells_an_absent_key_an_unknown_token_and_a_finished_record_apart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let token = populate(&path);
    let resolve = |id: &str, token: u64| {
        let t = token.to_string();
        idemstore(&[
            "resolve",
            p(&path),
            "acme/tickets",
            id,
            "--token",
            &t,
            "--raw",
            "--succeeded",
            "x",
        ])
    };
    let records = || {
        let mut all = json(&idemstore(&["list", p(&path), "--json"]));
        for r in all.as_array_mut().unwrap() {
            r.as_object_mut().unwrap().remove("age_ms");
        }
        all
    };
    let before = records();

    let out = resolve("absent", token);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains(r#"no record for scope "acme/tickets" id "absent""#),
        "{err}"
    );

    let out = resolve("lapsed", token + 100);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains(&format!("token {} was never issued", token + 100))
            && err.contains(&format!("current holder has token {token}")),
        "{err}"
    );
    let out = resolve("lapsed", token - 1);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains(&format!("token {} is not the current holder", token - 1)),
        "{err}"
    );

    let done = json(&idemstore(&[
        "get",
        p(&path),
        "acme/tickets",
        "done",
        "--json",
    ]));
    let done_token = done["token"].as_u64().unwrap();
    let out = resolve("done", done_token);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "is already finished as succeeded (token {done_token})"
        )),
        "{err}"
    );

    assert_eq!(records(), before);
}

/// `import` into a missing store names `--create`; a failed `import
/// --create` removes the store and log it made, and only those.
#[test]
fn import_names_create_and_a_failed_create_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    populate(&path);
    let backup = dir.path().join("backup.idem");
    assert_eq!(code(&idemstore(&["export", p(&path), "-o", p(&backup)])), 0);
    let mut damaged = std::fs::read(&backup).unwrap();
    damaged.truncate(damaged.len() - 10);
    let damaged_path = dir.path().join("damaged.idem");
    std::fs::write(&damaged_path, &damaged).unwrap();

    let fresh = dir.path().join("fresh.redb");
    let fresh_log = dir.path().join("fresh.redb-wal");
    let out = idemstore(&["import", p(&fresh), p(&backup)]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains("fresh.redb: no such store file") && err.contains("give --create"),
        "{err}"
    );
    assert!(!fresh.exists() && !fresh_log.exists());

    let out = idemstore(&["import", p(&fresh), p(&damaged_path), "--create"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("damaged.idem"), "{}", stderr(&out));
    // It says so, whatever the library's words said of batches that stay.
    assert!(
        stderr(&out).contains("the store this import created was removed"),
        "{}",
        stderr(&out)
    );
    assert!(
        !fresh.exists(),
        "the store a failed import created is removed"
    );
    assert!(!fresh_log.exists(), "and its log");

    // An existing store that fails an import keeps its files and records,
    // and the error says that the batches before the damage stay.
    let out = idemstore(&["import", p(&path), p(&damaged_path), "--create"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains("records of the stream were read before the damage, and any batches written before it stay"),
        "{err}"
    );
    assert!(path.exists() && dir.path().join("s.redb-wal").exists());
    assert_eq!(
        code(&idemstore(&["get", p(&path), "acme/tickets", "done"])),
        0
    );

    // A directory as the input is named as such before anything opens
    // (it read as a storage error after the store was opened, saying that
    // batches written before the failure may stay).
    let out = idemstore(&["import", p(&fresh), p(dir.path()), "--create"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains("is a directory, not an export stream; nothing was imported"),
        "{err}"
    );
    assert!(!fresh.exists() && !fresh_log.exists());

    // And a successful one keeps what it made.
    let out = idemstore(&["import", p(&fresh), p(&backup), "--create"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(fresh.exists() && fresh_log.exists());
}

/// A reader that goes away (`export | head`, `list | head`) ends the
/// command quietly with exit 0, as ripgrep does.
#[test]
fn a_closed_pipe_ends_quietly_with_exit_0() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    {
        let store = Store::open_with(
            &path,
            Config::new()
                .sweep_interval(None)
                .durability(idemstore::Durability::Buffered {
                    max_delay: Duration::from_millis(100),
                }),
        )
        .unwrap();
        // Far more output than a pipe buffers (64 KiB), so that a command
        // whose reader is gone must meet the closed pipe.
        let result = vec![b'r'; 1024];
        for n in 0..400 {
            let k = key(&format!("{n:0>200}"));
            let l = acquire(&store, &k, &ClaimOptions::new());
            store.complete(&l, &result).unwrap();
        }
    }
    for args in [
        vec!["export", p(&path)],
        vec!["list", p(&path)],
        vec!["list", p(&path), "--json"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemstore"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Read one byte, then close the pipe as `head -c 1` would.
        let mut first = [0u8; 1];
        std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(!err.contains("idemstore:"), "{args:?}: {err}");
        assert!(
            !err.to_lowercase().contains("broken pipe"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn resolve_finishes_a_record_fenced_by_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let token = populate(&path);
    let t = token.to_string();
    // A wrong token changes nothing.
    let wrong = (token + 100).to_string();
    let out = idemstore(&[
        "resolve",
        p(&path),
        "acme/tickets",
        "lapsed",
        "--token",
        &wrong,
        "--raw",
        "--succeeded",
        "T-9",
    ]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("was never issued"),
        "{}",
        stderr(&out)
    );

    let out = idemstore(&[
        "resolve",
        p(&path),
        "acme/tickets",
        "lapsed",
        "--token",
        &t,
        "--raw",
        "--succeeded",
        "T-9",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["state"], "succeeded");
    assert_eq!(json(&out)["result"]["text"], "T-9");
    // Done once: the same token is now stale.
    let out = idemstore(&[
        "resolve",
        p(&path),
        "acme/tickets",
        "lapsed",
        "--token",
        &t,
        "--raw",
        "--failed",
        "x",
    ]);
    assert_eq!(code(&out), 2);
    let out = idemstore(&["get", p(&path), "acme/tickets", "lapsed", "--json"]);
    assert_eq!(json(&out)["result"]["text"], "T-9");
    // --succeeded or --failed is required.
    let out = idemstore(&["resolve", p(&path), "acme/tickets", "lapsed", "--token", &t]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("--succeeded RESULT or --failed FAILURE"),
        "{}",
        stderr(&out)
    );
}

/// Writes `n` records finished an hour ago with `result`, in a store whose
/// retention is 60 s: all of them past retention, none evicted.
fn write_expired(path: &Path, n: usize, result: &[u8]) {
    let clock = ManualClock::new(SystemClock.now_ms() - 3_600_000);
    let store = Store::open_with(
        path,
        Config::new()
            .clock(clock)
            .retention(Duration::from_secs(60))
            .sweep_interval(None),
    )
    .unwrap();
    for i in 0..n {
        let l = acquire(&store, &key(&format!("k{i}")), &ClaimOptions::new());
        store.complete(&l, result).unwrap();
    }
}

#[test]
fn sweep_evicts_records_past_retention() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    write_expired(&path, 25, b"ok");
    let out = idemstore(&["stats", p(&path), "--json"]);
    assert_eq!(json(&out)["records"]["expired"], 25);
    let out = idemstore(&["sweep", p(&path), "--batch", "10", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["evicted"], 25);
    let out = idemstore(&["stats", p(&path), "--json"]);
    assert_eq!(json(&out)["records"]["total"], 0);
    let out = idemstore(&["sweep", p(&path)]);
    assert_eq!(stdout(&out).trim(), "evicted 0 records past retention");
}

/// `compact` shrinks a store file that eviction emptied, keeps what is
/// live, refuses a store a process holds and a PostgreSQL store.
#[test]
fn compact_gives_back_space_and_keeps_live_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.redb");
    write_expired(&path, 1_000, &[b'x'; 4_000]);
    populate(&path);
    let out = idemstore(&["sweep", p(&path), "--json"]);
    assert_eq!(json(&out)["evicted"], 1_000);
    let out = idemstore(&["compact", p(&path), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let done = json(&out);
    let (before, after) = (
        done["bytes_before"].as_u64().unwrap(),
        done["bytes_after"].as_u64().unwrap(),
    );
    assert!(after < before / 4, "{done}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), after);
    let out = idemstore(&["stats", p(&path), "--json"]);
    assert_eq!(json(&out)["records"]["total"], 4, "{}", stdout(&out));
    let out = idemstore(&["compact", p(&path)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stdout(&out).starts_with("compacted "), "{}", stdout(&out));
    {
        let _service = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        let out = idemstore(&["compact", p(&path)]);
        assert_ne!(code(&out), 0);
        assert!(stderr(&out).contains("is in use"), "{}", stderr(&out));
    }
    let out = idemstore(&["compact", "postgresql://127.0.0.1:1/none"]);
    assert_ne!(code(&out), 0);
    assert!(stderr(&out).contains("VACUUM"), "{}", stderr(&out));
}

/// Flips a bit of the value stored under `name` in every copy of the
/// store's metadata leaf page in the file at `path` (redb's leaf layout:
/// at byte 2 the entry count `n`, from byte 4 the `n` key ends, then the
/// `n` value ends, each a u32 from the page's start; keys, then values).
/// Returns how many copies were changed.
fn damage_meta_value(path: &Path, name: &[u8]) -> usize {
    const PAGE: usize = 4096;
    let mut bytes = std::fs::read(path).unwrap();
    let u16_at = |b: &[u8], at: usize| usize::from(u16::from_le_bytes([b[at], b[at + 1]]));
    let u32_at = |b: &[u8], at: usize| {
        usize::try_from(u32::from_le_bytes(b[at..at + 4].try_into().unwrap())).unwrap()
    };
    let mut flips = Vec::new();
    for at in common::find_all(&bytes, name) {
        let page = at - at % PAGE;
        let n = u16_at(&bytes, page + 2);
        if n == 0 || page + 4 + 8 * n > bytes.len() {
            continue;
        }
        let key_end = |j: usize| u32_at(&bytes, page + 4 + 4 * j);
        let value_end = |j: usize| u32_at(&bytes, page + 4 + 4 * n + 4 * j);
        let mut key_start = 4 + 8 * n;
        let mut value_start = key_end(n - 1);
        for j in 0..n {
            let (k, v) = ((key_start, key_end(j)), (value_start, value_end(j)));
            if k.0 < k.1 && page + k.1 <= bytes.len() && &bytes[page + k.0..page + k.1] == name {
                assert!(v.1 > v.0 + 1, "a value of at least two bytes");
                flips.push(page + v.0 + 1);
            }
            (key_start, value_start) = (k.1, v.1);
        }
    }
    flips.sort_unstable();
    flips.dedup();
    for &at in &flips {
        bytes[at] ^= 0x02;
    }
    let changed = flips.len();
    std::fs::write(path, bytes).unwrap();
    changed
}

/// A store closed cleanly whose metadata page was damaged on disk (a bit of
/// the token counter): `check` reports the damaged page, `compact` refuses,
/// and neither hides the damage from the next check. Both checked pages
/// after an open had written a checkpoint, which copied the damaged page
/// under a fresh checksum: `check` said clean, `compact` compacted, and the
/// token counter had dropped (tokens already handed out could be issued
/// again).
#[test]
fn a_damaged_metadata_page_is_found_by_check_and_refused_by_compact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.redb");
    {
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        for i in 0..50 {
            let lease = acquire(&store, &key(&format!("k{i}")), &ClaimOptions::new());
            store.complete(&lease, b"\"ok\"").unwrap();
        }
        store.checkpoint().unwrap();
    }
    assert!(damage_meta_value(&path, b"next_token") > 0);
    // A copy for `compact` alone, before any check has run on it.
    let copy = dir.path().join("copy.redb");
    std::fs::copy(&path, &copy).unwrap();
    std::fs::copy(
        dir.path().join("meta.redb-wal"),
        dir.path().join("copy.redb-wal"),
    )
    .unwrap();
    let out = idemstore(&["compact", p(&copy)]);
    assert_ne!(code(&out), 0, "{}", stdout(&out));
    assert!(stderr(&out).contains("not compacted"), "{}", stderr(&out));
    let out = idemstore(&["check", p(&copy)]);
    assert_eq!(code(&out), 1, "{}", stdout(&out));
    let out = idemstore(&["check", p(&path), "--json"]);
    assert_eq!(code(&out), 1, "{}\n{}", stdout(&out), stderr(&out));
    let report = json(&out);
    assert!(
        report["integrity"].to_string().contains("corrupt"),
        "{report}"
    );
    let out = idemstore(&["compact", p(&path)]);
    assert_ne!(code(&out), 0, "{}", stdout(&out));
    assert!(stderr(&out).contains("not compacted"), "{}", stderr(&out));
    // Neither hid the damage (redb's open may set its header's repair flag,
    // nothing more).
    let out = idemstore(&["check", p(&path)]);
    assert_eq!(code(&out), 1, "{}", stdout(&out));
}

/// A command whose standard output is the store file or its log (`export
/// S >> S`, by another name too) is refused before anything is written:
/// the export was written into the store and destroyed it, exit 0.
#[test]
fn output_into_the_store_or_its_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("o.redb");
    populate(&path);
    let log = dir.path().join("o.redb-wal");
    let link = dir.path().join("link.redb");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    // The last: the store named by the symlink, whose log is the one
    // beside the real file (the check looked beside the symlink's name).
    for (command, store, into) in [
        ("export", &path, &path),
        ("list", &path, &path),
        ("export", &path, &log),
        ("stats", &path, &link),
        ("export", &link, &log),
    ] {
        let (store_len, log_len) = (size(&path), size(&log));
        let sink = std::fs::OpenOptions::new().append(true).open(into).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_idemstore"))
            .args([command, p(store)])
            .stdout(sink)
            .output()
            .unwrap();
        assert_eq!(
            code(&out),
            2,
            "{command} into {}: {}",
            into.display(),
            stderr(&out)
        );
        assert!(
            stderr(&out).contains("standard output is the"),
            "{}",
            stderr(&out)
        );
        assert_eq!((size(&path), size(&log)), (store_len, log_len), "{command}");
    }
    let out = idemstore(&["check", p(&path)]);
    assert_eq!(code(&out), 0, "{}", stdout(&out));
}

/// A fifo given as the store, or beside it as its log, is refused with a
/// one-line error and no command blocks opening it (the check for output
/// into the store opens only regular files).
#[test]
fn a_fifo_as_the_store_or_its_log_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.redb");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let store = dir.path().join("s.redb");
    populate(&store);
    let log = dir.path().join("s.redb-wal");
    std::fs::remove_file(&log).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&log)
        .status()
        .unwrap();
    assert!(made.success());
    for (command, path) in [("stats", &fifo), ("export", &fifo), ("stats", &store)] {
        let (status, err) = unblocked(&[command, p(path)]);
        assert_eq!(
            status.code(),
            Some(2),
            "{command} {}: {err}",
            path.display()
        );
        assert!(err.contains("not a regular file"), "{err}");
    }
}

/// Runs the CLI with `args` (stdout discarded) and returns its exit
/// status and stderr, failing the test if it has not exited within a
/// hang guard (a command that blocks opening a fifo).
fn unblocked(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("{args:?} blocked");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status, err)
}

/// An export's output that exists and is not a regular file (a fifo, a
/// symbolic link, or such a file at the temporary name the export writes
/// first) is refused even with --force, without blocking on a fifo, and is
/// left as it was: the export's rename would have replaced it with a file.
#[cfg(unix)]
#[test]
fn export_refuses_an_output_that_is_not_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s.redb");
    populate(&store);
    let fifo = dir.path().join("out.fifo");
    let partial_fifo = dir.path().join("beside.idem.partial");
    for made in [&fifo, &partial_fifo] {
        let status = std::process::Command::new("mkfifo")
            .arg(made)
            .status()
            .unwrap();
        assert!(status.success());
    }
    let target = dir.path().join("target.idem");
    std::fs::write(&target, b"kept").unwrap();
    let link = dir.path().join("link.idem");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for (output, refused) in [
        (&fifo, &fifo),
        (&link, &link),
        (&dir.path().join("beside.idem"), &partial_fifo),
    ] {
        let (status, err) = unblocked(&["export", p(&store), "--output", p(output), "--force"]);
        assert_eq!(status.code(), Some(2), "{}: {err}", output.display());
        assert!(
            err.contains(&format!("{} is not a regular file", refused.display())),
            "{err}"
        );
    }
    let kind = |path: &Path| std::fs::symlink_metadata(path).unwrap().file_type();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&kind(&fifo)));
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&kind(
        &partial_fifo
    )));
    assert!(kind(&link).is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"kept");
    assert!(!dir.path().join("beside.idem").exists());
}

/// An import that a failing disk cuts short (a file size limit, `ulimit
/// -f`: the write fails with the operating system's error, as on a full
/// disk, without needing one) names that error and how much of the stream
/// it read, and the same import runs again once the cause is gone: every
/// record is there once, and the store checks clean.
#[test]
fn an_import_cut_by_a_failing_disk_names_the_cause_and_runs_again() {
    const RECORDS: usize = 3000;
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.redb");
    let result = vec![b'r'; 1024];
    {
        let config =
            Config::new()
                .sweep_interval(None)
                .durability(idemstore::Durability::Buffered {
                    max_delay: Duration::from_millis(10),
                });
        let store = Store::open_with(&source, config).unwrap();
        for i in 0..RECORDS {
            let lease = acquire(&store, &key(&format!("k{i}")), &ClaimOptions::new());
            store.complete(&lease, &result).unwrap();
        }
    }
    let export = dir.path().join("source.export");
    let out = idemstore(&["export", p(&source), "--output", p(&export)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let target = dir.path().join("target.redb");
    drop(Store::open_with(&target, Config::new().sweep_interval(None)).unwrap());
    // 2048 blocks of 512 bytes: 1 MiB a file, against an export of over
    // 3 MiB. SIGXFSZ ignored, so that the write fails instead of killing.
    let cut = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 2048; exec \"$0\" import \"$1\" \"$2\"")
        .args([env!("CARGO_BIN_EXE_idemstore"), p(&target), p(&export)])
        .output()
        .unwrap();
    let err = stderr(&cut);
    assert_eq!(code(&cut), 2, "{err}");
    // EFBIG, "File too large" in the C locale.
    assert!(err.contains("(os error 27)"), "{err}");
    assert!(
        err.contains("records of the stream were read before the failure")
            && err.contains("import again once that is fixed"),
        "{err}"
    );
    let out = idemstore(&["import", p(&target), p(&export), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let summary = json(&out);
    let counted = summary["imported"].as_u64().unwrap() + summary["present"].as_u64().unwrap();
    assert_eq!(counted, RECORDS as u64, "{summary}");
    let out = idemstore(&["check", p(&target)]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    let store = Store::open_with(&target, Config::new().sweep_interval(None)).unwrap();
    assert_eq!(store.len().unwrap(), RECORDS as u64);
    for i in [0, RECORDS / 2, RECORDS - 1] {
        let record = store.get(&key(&format!("k{i}"))).unwrap().unwrap();
        assert_eq!(record.result(), Some(&result[..]));
    }
}

/// An export of a store whose service raised its value limits restores
/// with `import --max-value-bytes`; without it the import is refused with
/// the rule and a hint naming the flag, and nothing is left behind.
#[test]
fn import_takes_the_services_value_limits() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("big.redb");
    let big = format!("\"{}\"", "x".repeat(2 << 20));
    {
        let config = Config::new().max_result_bytes(4 << 20).sweep_interval(None);
        let store = Store::open_with(&source, config).unwrap();
        let lease = acquire(&store, &key("big"), &ClaimOptions::new());
        store.complete(&lease, big.as_bytes()).unwrap();
    }
    let export = dir.path().join("big.export");
    let out = idemstore(&["export", p(&source), "--output", p(&export)]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let target = dir.path().join("restored.redb");
    let out = idemstore(&["import", p(&target), p(&export), "--create"]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    assert!(stderr(&out).contains("too-large"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--max-value-bytes"),
        "{}",
        stderr(&out)
    );
    assert!(!target.exists());
    let out = idemstore(&[
        "import",
        p(&target),
        p(&export),
        "--create",
        "--max-value-bytes",
        "0",
    ]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    assert!(!target.exists());
    let limit = (4 << 20).to_string();
    let out = idemstore(&[
        "import",
        p(&target),
        p(&export),
        "--create",
        "--max-value-bytes",
        &limit,
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let store = Store::open_with(&target, Config::new().sweep_interval(None)).unwrap();
    let record = store.get(&key("big")).unwrap().unwrap();
    assert_eq!(record.result(), Some(big.as_bytes()));
}

/// XORs the byte at `offset` of the file at `path` with `mask`.
fn flip(path: &Path, offset: usize, mask: u8) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset] ^= mask;
    std::fs::write(path, bytes).unwrap();
}

/// A page-level failure to open (the byte flips of `tests/corruption.rs`:
/// a byte of a stored result, every copy of a key, or a byte of the commit
/// slot in redb's header) is reported as
/// damage: exit 1, the report naming the file and what failed, the same
/// shape in `--json`, and the next step (issue 10, point 7).
#[test]
fn check_reports_a_damaged_page_as_damage_with_exit_1_and_json() {
    const MARKER: &[u8] = b"MARKER-check-9f3e-result-of-the-victim";
    for what in ["result", "key", "header"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        populate(&path);
        {
            let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
            let l = acquire(&store, &key("victim-key-7c1d"), &ClaimOptions::new());
            store.complete(&l, MARKER).unwrap();
        }
        let bytes = std::fs::read(&path).unwrap();
        let find = |needle: &[u8]| -> Vec<usize> {
            bytes
                .windows(needle.len())
                .enumerate()
                .filter(|(_, w)| *w == needle)
                .map(|(i, _)| i)
                .collect()
        };
        match what {
            "result" => flip(&path, find(MARKER)[0] + 9, 0x01),
            "key" => {
                for at in find(b"victim-key-7c1d") {
                    flip(&path, at, 0x20);
                }
            }
            // A byte of the primary commit slot of redb's header (the god
            // byte at offset 9 says which of the slots at 64 and 192): the
            // open itself fails.
            _ => flip(&path, 64 + 128 * usize::from(bytes[9] & 1) + 6, 0x10),
        }
        let out = idemstore(&["check", p(&path)]);
        assert_eq!(code(&out), 1, "{what}: {}{}", stdout(&out), stderr(&out));
        let text = stdout(&out);
        assert!(text.contains(p(&path)), "{what}: {text}");
        assert!(text.contains("damaged"), "{what}: {text}");
        assert!(text.contains("import --create"), "{what}: {text}");
        assert!(text.trim_end().ends_with("DAMAGED"), "{what}: {text}");

        let out = idemstore(&["check", p(&path), "--json"]);
        assert_eq!(code(&out), 1, "{what}: {}", stderr(&out));
        let v = json(&out);
        assert_eq!(v["path"], p(&path), "{what}");
        assert_eq!(v["clean"], false, "{what}");
        assert!(
            v["integrity"].as_str().unwrap().starts_with("damaged"),
            "{what}: {v}"
        );
        assert!(
            v["next_step"].as_str().unwrap().contains("import --create"),
            "{what}: {v}"
        );
    }
}

const LOST_LOG: &str = "check_reports_a_lost_write_ahead_log_as_damage_with_exit_1";

/// A write-ahead log lost after a crash (the service SIGKILLed with
/// completions acknowledged since its last checkpoint, then its `-wal`
/// removed) is damage: the store no longer opens (`CorruptLog`), and
/// `check` reports it as it reports damaged pages, exit 1 with a report,
/// `--json` and the next step, not as an error (exit 2, no report).
#[test]
fn check_reports_a_lost_write_ahead_log_as_damage_with_exit_1() {
    if common::child_role(LOST_LOG) {
        let store = Store::open_with(
            common::child_var("STORE"),
            Config::new().sweep_interval(None).scrub_rate(None),
        )
        .unwrap();
        for i in 0..20 {
            let l = acquire(&store, &key(&format!("k{i}")), &ClaimOptions::new());
            store.complete(&l, b"done").unwrap();
            if i == 9 {
                store.checkpoint().unwrap();
            }
        }
        common::ready_and_wait();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let mut child = common::spawn_child(LOST_LOG, &[("STORE", common::path_var(&path))]);
    child.wait_ready();
    child.kill();
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::remove_file(&wal).unwrap();

    let report = idemstore::check_file(&path, |_| {}).expect("damage is a report");
    assert!(!report.is_clean());
    assert_eq!(report.problems[0].key, idemstore::LOG_PROBLEM);

    let out = idemstore(&["check", p(&path)]);
    assert_eq!(code(&out), 1, "{}{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("(write-ahead log)"), "{text}");
    assert!(
        text.contains("not checked (the store does not open)"),
        "{text}"
    );
    assert!(text.contains("import --create"), "{text}");
    assert!(text.trim_end().ends_with("DAMAGED"), "{text}");

    let out = idemstore(&["check", p(&path), "--json"]);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["clean"], false);
    assert_eq!(v["records_checked"], false, "{v}");
    assert_eq!(v["problems"][0]["key"], idemstore::LOG_PROBLEM, "{v}");
    assert!(
        v["problems"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("empty or missing"),
        "{v}"
    );
    assert!(
        v["next_step"].as_str().unwrap().contains("import --create"),
        "{v}"
    );
    assert!(
        v["problems"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("export --accept-log-loss"),
        "{v}"
    );

    // A plain export cannot open the store, and says what salvages it.
    let export = dir.path().join("salvage.export");
    let out = idemstore(&["export", p(&path), "--output", p(&export)]);
    assert_eq!(code(&out), 2, "{}{}", stdout(&out), stderr(&out));
    assert!(
        stderr(&out).contains("--accept-log-loss"),
        "{}",
        stderr(&out)
    );
    assert!(!export.exists());
    // The salvage: the ten keys finished before the checkpoint, the loss
    // said on stderr and in the JSON summary.
    let out = idemstore(&[
        "export",
        "--accept-log-loss",
        p(&path),
        "--output",
        p(&export),
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    assert!(
        stderr(&out).contains("run again once it is imported"),
        "{}",
        stderr(&out)
    );
    let v = json(&out);
    assert_eq!(v["records"], 10, "{v}");
    assert!(
        v["log_lost"].as_str().unwrap().contains("empty or missing"),
        "{v}"
    );
    let restored = dir.path().join("restored.redb");
    let out = idemstore(&["import", "--create", p(&restored), p(&export)]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    let store = Store::open_with(&restored, Config::new().sweep_interval(None)).unwrap();
    for i in 0..20 {
        let record = store.get(&key(&format!("k{i}"))).unwrap();
        assert_eq!(record.is_some(), i < 10, "k{i}: {record:?}");
    }
}

/// A damaged page that makes the storage engine (redb) panic is answered
/// with the library's typed error as one line: the caught panic is not
/// printed, and nothing else is. Each 4 KiB page of a small store in turn
/// has its first 64 bytes garbled; at least one of them must reach redb's
/// panic for the test to count.
#[test]
fn a_storage_engine_panic_on_a_damaged_file_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean.redb");
    populate(&clean);
    let bytes = std::fs::read(&clean).unwrap();
    let path = dir.path().join("s.redb");
    let mut engine_panics = 0;
    for page in (4096..bytes.len()).step_by(4096) {
        let mut damaged = bytes.clone();
        for b in &mut damaged[page..(page + 64).min(bytes.len())] {
            *b ^= 0xA5;
        }
        std::fs::write(&path, &damaged).unwrap();
        for args in [vec!["stats", p(&path)], vec!["list", p(&path)]] {
            let out = idemstore(&args);
            let err = stderr(&out);
            assert!(!err.contains("panicked at"), "page {page} {args:?}: {err}");
            assert!(err.lines().count() <= 1, "page {page} {args:?}: {err}");
            if err.contains("storage engine panicked") {
                assert_eq!(code(&out), 2, "page {page} {args:?}: {err}");
                engine_panics += 1;
            }
        }
    }
    assert!(engine_panics > 0, "no damaged page reached redb's panic");
}

/// Two keys that print the same joined (`a/b/c`): `check` names the
/// damaged one as scope and id apart, and that name pastes into `get`.
#[test]
fn check_names_a_damaged_record_that_a_joined_key_leaves_ambiguous() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    {
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        for (scope, id) in [("a", "b/c"), ("a/b", "c")] {
            let k = Key::new(scope, id).unwrap();
            let l = acquire(&store, &k, &ClaimOptions::new());
            store.complete(&l, b"\"done\"").unwrap();
        }
    }
    damage_record(&path, &Key::new("a", "b/c").unwrap());
    let out = idemstore(&["check", p(&path)]);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains(r#"  scope "a" id "b/c": "#), "{text}");
    assert!(!text.contains(r#"scope "a/b""#), "{text}");
    let v = json(&idemstore(&["check", p(&path), "--json"]));
    assert_eq!(
        (&v["problems"][0]["scope"], &v["problems"][0]["id"]),
        (&"a".into(), &"b/c".into())
    );
    // As printed, scope then id: `get` reads that record (and finds it
    // damaged).
    let out = idemstore(&["get", p(&path), "a", "b/c"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("corrupt record"), "{}", stderr(&out));
}

/// An export from a host whose clock ran an hour ahead is refused (the
/// error names the frame's offset and the rule); `--accept-clock-ahead`
/// imports it.
#[test]
fn import_refuses_a_clock_far_ahead_unless_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("ahead.redb");
    let backup = dir.path().join("ahead.export");
    {
        let clock = ManualClock::new(SystemClock.now_ms() + 3_600_000);
        let store =
            Store::open_with(&source, Config::new().clock(clock).sweep_interval(None)).unwrap();
        let l = acquire(&store, &key("ahead"), &ClaimOptions::new());
        store.complete(&l, b"ok").unwrap();
        let mut out = std::fs::File::create(&backup).unwrap();
        store.export(&mut out, |_| {}).unwrap();
    }
    let restored = dir.path().join("restored.redb");
    let out = idemstore(&["import", p(&restored), p(&backup), "--create"]);
    assert_eq!(code(&out), 2, "{}{}", stdout(&out), stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("byte offset 24"), "{err}");
    assert!(err.contains("clock-ahead"), "{err}");
    assert!(
        !restored.exists(),
        "the refused import removed the store it made"
    );
    let out = idemstore(&[
        "import",
        p(&restored),
        p(&backup),
        "--create",
        "--accept-clock-ahead",
        "--json",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["imported"].as_u64(), Some(1));
}

#[test]
fn check_exits_0_when_sound_and_1_naming_a_damaged_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    populate(&path);
    let out = idemstore(&["check", p(&path)]);
    assert_eq!(code(&out), 0, "{}{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("redb integrity   clean"), "{text}");
    assert!(text.contains("records          4 checked"), "{text}");
    assert!(text.trim_end().ends_with("OK"), "{text}");

    damage_record(&path, &key("done"));
    let out = idemstore(&["check", p(&path), "--json"]);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(v["clean"], false);
    assert_eq!(v["records_checked"], true);
    assert_eq!(v["problems_found"], 1);
    assert_eq!(v["problems"][0]["key"], "acme/tickets/done");
    assert_eq!(v["problems"][0]["scope"], "acme/tickets");
    assert_eq!(v["problems"][0]["id"], "done");
    assert!(
        v["problems"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("checksum")
    );
    // The text names the key as scope and id apart.
    let out = idemstore(&["check", p(&path)]);
    assert!(
        stdout(&out).contains(r#"  scope "acme/tickets" id "done": "#),
        "{}",
        stdout(&out)
    );
    // list reports it on stderr, goes on, and exits 1.
    let out = idemstore(&["list", p(&path)]);
    assert_eq!(code(&out), 1);
    assert!(stderr(&out).contains("corrupt record for key acme/tickets/done"));
    assert_eq!(stdout(&out).lines().count(), 4);
}

/// An export never replaces the store it reads: an output that is the
/// store file or its log, by its own name, a hard link or the temporary
/// name the export writes first, is refused even with --force, and the
/// store keeps every record.
#[test]
fn export_refuses_the_store_files_as_its_output() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    populate(&path);
    let log = dir.path().join("s.redb-wal");
    let link = dir.path().join("other-name.redb");
    std::fs::hard_link(&path, &link).unwrap();
    // The export is written as `<output>.partial` first.
    let partial_link = dir.path().join("x.partial");
    std::fs::hard_link(&path, &partial_link).unwrap();
    for (output, what) in [
        (path.clone(), "store file"),
        (log.clone(), "write-ahead log"),
        (link.clone(), "store file"),
        (dir.path().join("x"), "store file"),
    ] {
        let out = idemstore(&["export", p(&path), "--output", p(&output), "--force"]);
        assert_eq!(code(&out), 2, "{}: {}", output.display(), stdout(&out));
        assert!(
            stderr(&out).contains(&format!("is the {what} of the store being exported")),
            "{}",
            stderr(&out)
        );
    }
    // The store still opens with every record.
    let backup = dir.path().join("backup.idem");
    let out = idemstore(&["export", p(&path), "--output", p(&backup), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["records"], 4);
}

#[test]
fn export_then_import_restores_and_a_second_import_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let token = populate(&path);
    let backup = dir.path().join("backup.idem");
    let out = idemstore(&["export", p(&path), "--output", p(&backup), "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["records"], 4);
    assert!(!dir.path().join("backup.idem.partial").exists());
    // No silent overwrite.
    let out = idemstore(&["export", p(&path), "--output", p(&backup)]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));

    let restored = dir.path().join("restored.redb");
    let out = idemstore(&["import", p(&restored), p(&backup)]);
    assert_eq!(
        code(&out),
        2,
        "a missing store is not created without --create"
    );
    let out = idemstore(&["import", p(&restored), p(&backup), "--create", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v = json(&out);
    assert_eq!(
        (v["imported"].as_u64(), v["present"].as_u64()),
        (Some(4), Some(0))
    );
    assert!(v["next_token"].as_u64().unwrap() > token);
    let out = idemstore(&["import", p(&restored), p(&backup), "--json"]);
    let v = json(&out);
    assert_eq!(
        (v["imported"].as_u64(), v["present"].as_u64()),
        (Some(0), Some(4))
    );
    let out = idemstore(&["get", p(&restored), "acme/tickets", "lapsed", "--json"]);
    assert_eq!(json(&out)["recovery_point"]["text"], "step-2");

    // Export to stdout when it is a pipe; import from stdin.
    let out = idemstore(&["export", p(&path)]);
    assert_eq!(code(&out), 0);
    assert!(out.stdout.starts_with(b"IDEMSTORE-EXPORT"));
    assert!(
        stderr(&out).contains("exported 4 records"),
        "{}",
        stderr(&out)
    );

    // A damaged frame is refused with its offset.
    let mut bytes = std::fs::read(&backup).unwrap();
    let at = bytes.len() - 30;
    bytes[at] ^= 0x10;
    let damaged = dir.path().join("damaged.idem");
    std::fs::write(&damaged, &bytes).unwrap();
    let other = dir.path().join("other.redb");
    let out = idemstore(&["import", p(&other), p(&damaged), "--create"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(err.contains("damaged.idem"), "{err}");
    assert!(err.contains("at byte offset"), "{err}");
    assert!(
        !other.exists(),
        "a failed import --create removes the store it made"
    );
}

#[test]
fn usage_errors_are_one_line_naming_what_is_missing() {
    let out = idemstore(&["get"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("<STORE> <SCOPE>"), "{err}");
    let err = stderr(&idemstore(&["list", "x.redb", "--state", "bogus"]));
    assert!(err.contains("possible values: processing"), "{err}");
    // A retention the store would refuse is the flag's error, not the
    // store's.
    let out = idemstore(&[
        "resolve",
        "x.redb",
        "a",
        "b",
        "--token",
        "1",
        "--succeeded",
        "1",
        "--retention",
        "0s",
    ]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(
        err.contains("--retention") && err.contains("1ms to"),
        "{err}"
    );
}

#[test]
fn errors_name_the_file_and_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.redb");
    let out = idemstore(&["stats", p(&missing)]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    assert!(err.starts_with("idemstore: "), "{err}");
    assert!(err.contains("missing.redb: no such store file"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        !missing.exists(),
        "an operator command never creates a store"
    );

    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello").unwrap();
    let err = stderr(&idemstore(&["check", p(&text)]));
    assert!(
        err.contains("notes.txt") && err.contains("not an idemstore file"),
        "{err}"
    );

    let plain = dir.path().join("plain.redb");
    {
        let db = redb::Database::create(&plain).unwrap();
        let txn = db.begin_write().unwrap();
        let t: redb::TableDefinition<u64, u64> = redb::TableDefinition::new("other");
        txn.open_table(t).unwrap();
        txn.commit().unwrap();
    }
    let err = stderr(&idemstore(&["stats", p(&plain)]));
    assert!(
        err.contains("plain.redb") && err.contains("not an idemstore file"),
        "{err}"
    );

    // A newer format version.
    let newer = dir.path().join("newer.redb");
    drop(Store::open(&newer).unwrap());
    {
        let meta: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
        let db = redb::Database::open(&newer).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(meta)
            .unwrap()
            .insert("format_version", &99u64.to_le_bytes()[..])
            .unwrap();
        txn.commit().unwrap();
    }
    let err = stderr(&idemstore(&["stats", p(&newer)]));
    assert!(
        err.contains("newer.redb") && err.contains("format version 99 is newer"),
        "{err}"
    );
}

#[test]
fn a_store_held_by_a_service_is_reported_as_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let service = Store::open(&path).unwrap();
    for cmd in ["stats", "check", "list"] {
        let out = idemstore(&[cmd, p(&path)]);
        assert_eq!(code(&out), 2, "{cmd}");
        let err = stderr(&out);
        assert!(err.contains("s.redb is in use"), "{cmd}: {err}");
        assert!(err.contains("Store::stats()"), "{cmd}: {err}");
    }
    drop(service);
    assert_eq!(code(&idemstore(&["stats", p(&path)])), 0);
}

/// A copy of the store file moved into place under a running service (a
/// restore or copy-back while it runs): the commands are refused, naming
/// the log the service holds and saying that the file was replaced,
/// instead of opening the copy and writing the service's log.
#[test]
fn a_store_file_replaced_under_a_service_is_refused_naming_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let service = Store::open(&path).unwrap();
    let moved = dir.path().join("moved.redb");
    std::fs::rename(&path, &moved).unwrap();
    std::fs::copy(&moved, &path).unwrap();
    for cmd in ["stats", "check", "list"] {
        let out = idemstore(&[cmd, p(&path)]);
        assert_eq!(code(&out), 2, "{cmd}");
        let err = stderr(&out);
        assert!(
            err.contains("s.redb-wal is held by a running store") && err.contains("replaced"),
            "{cmd}: {err}"
        );
    }
    drop(service);
}

/// Removes every expiry entry of the store file at `path`, through redb
/// directly: damage `check` finds (records no sweep would evict).
fn remove_expiry_entries(path: &Path) {
    let expiry: redb::TableDefinition<(u64, &[u8]), ()> = redb::TableDefinition::new("expiry");
    let db = redb::Database::open(path).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(expiry)
        .unwrap()
        .retain(|_, _| false)
        .unwrap();
    txn.commit().unwrap();
}

/// A reader that left before `check` printed (`check STORE | head` on a
/// long report) does not turn damage found into success: the exit code
/// is still 1 (it was 0, as for any closed pipe).
#[test]
fn a_reader_that_left_does_not_hide_damage_from_checks_exit_code() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    {
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        let l = acquire(&store, &key("k-1"), &ClaimOptions::new());
        store.complete(&l, b"done").unwrap();
    }
    // The expiry entry removed: damage `check` finds.
    remove_expiry_entries(&path);
    assert_eq!(code(&idemstore(&["check", p(&path)])), 1);
    for args in [vec!["check", p(&path)], vec!["check", p(&path), "--json"]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemstore"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before the report is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(code(&out), 1, "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).contains("idemstore:"), "{}", stderr(&out));
    }
}

/// A store damaged throughout: `check` lists the first
/// `MAX_LISTED_PROBLEMS` problems and says how many more it found.
#[test]
fn check_lists_the_first_problems_and_counts_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let total = idemstore::MAX_LISTED_PROBLEMS + 7;
    {
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        let fingerprint = Fingerprint::of(b"a");
        let keys: Vec<_> = (0..total)
            .map(|i| (key(&format!("k-{i:06}")), fingerprint.clone()))
            .collect();
        for chunk in keys.chunks(idemstore::MAX_CLAIM_MANY) {
            store.claim_many(chunk, &ClaimOptions::new()).unwrap();
        }
    }
    remove_expiry_entries(&path);
    let out = idemstore(&["check", p(&path)]);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(&format!("problems         {total}")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "... and 7 more, not listed (a check lists the first {})",
            idemstore::MAX_LISTED_PROBLEMS
        )),
        "{}",
        &text[text.len().saturating_sub(400)..]
    );
    let out = idemstore(&["check", p(&path), "--json"]);
    let v = json(&out);
    assert_eq!(v["problems_found"].as_u64(), Some(total as u64));
    assert_eq!(
        v["problems"].as_array().map(Vec::len),
        Some(idemstore::MAX_LISTED_PROBLEMS)
    );
}

/// A tool call's key left in doubt (its lease lapsed, no outcome), as
/// `Store::execute` leaves it after a crash; returns its token.
fn in_doubt_tool_call(path: &Path, id: &str) -> u64 {
    let clock = ManualClock::new(SystemClock.now_ms() - 60_000);
    let store = Store::open_with(
        path,
        Config::new()
            .clock(clock)
            .lease(Duration::from_secs(10))
            .sweep_interval(None),
    )
    .unwrap();
    let k = Key::new("acme/tools", id).unwrap();
    match store
        .claim(&k, &tool_fingerprint(), &ClaimOptions::new())
        .unwrap()
    {
        ClaimOutcome::Acquired(lease) => lease.token(),
        other => panic!("{other:?}"),
    }
}

/// `resolve` refuses a record whose lease is still valid (its holder may
/// still be running the work: a retryable failure let a second run start
/// beside it), names the time left, and changes nothing; `--while-held`
/// resolves it.
#[test]
fn resolve_refuses_a_record_whose_lease_is_still_valid() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let t = {
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        let options = ClaimOptions::new().lease(Duration::from_secs(3600));
        acquire(&store, &key("live"), &options).token().to_string()
    };
    let resolve = |extra: &[&str]| {
        let mut args = vec!["resolve", p(&path), "acme/tickets", "live", "--token", &t];
        args.extend_from_slice(extra);
        idemstore(&args)
    };
    let out = resolve(&["--failed", r#""gone""#, "--retryable"]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("is held"), "{}", stderr(&out));
    assert!(stderr(&out).contains("--while-held"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("left, and its holder"),
        "{}",
        stderr(&out)
    );
    let out = idemstore(&["get", p(&path), "acme/tickets", "live", "--json"]);
    assert_eq!(json(&out)["state"], "processing");
    let out = resolve(&["--failed", r#""gone""#, "--retryable", "--while-held"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = idemstore(&["get", p(&path), "acme/tickets", "live", "--json"]);
    assert_eq!(json(&out)["state"], "failed-retryable");
}

/// `resolve` refuses an outcome that a key of the HTTP layer cannot replay
/// (`[tenant/]METHOD route`: a stored HTTP response, which it cannot
/// write; the layer answered every retry 500 until retention ended), and
/// changes nothing; a retryable failure, which lets the client's retry
/// run the handler again, is taken, and `--not-http-layer` overrules the
/// check.
#[test]
fn resolve_refuses_an_outcome_an_http_key_cannot_replay() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let claim = |scope: &str, id: &str| {
        let store = Store::open_with(&path, Config::new().sweep_interval(None)).unwrap();
        let k = Key::new(scope, id).unwrap();
        match store
            .claim(&k, &tool_fingerprint(), &ClaimOptions::new())
            .unwrap()
        {
            ClaimOutcome::Acquired(lease) => lease.token().to_string(),
            other => panic!("{other:?}"),
        }
    };
    for scope in [
        "POST /tickets",
        "acme/PATCH /tickets/{id}",
        "POST #0123abcd",
    ] {
        let t = claim(scope, "k-1");
        for outcome in [
            &["--succeeded", r#"{"id":1}"#][..],
            &["--failed", r#""declined""#][..],
        ] {
            let mut args = vec!["resolve", p(&path), scope, "k-1", "--token", &t];
            args.extend_from_slice(outcome);
            let out = idemstore(&args);
            assert_eq!(code(&out), 2, "{scope} {outcome:?}");
            assert!(
                stderr(&out).contains("has the form of the HTTP layer's keys"),
                "{}",
                stderr(&out)
            );
        }
        let out = idemstore(&["get", p(&path), scope, "k-1", "--json"]);
        assert_eq!(json(&out)["state"], "processing", "{scope}");
        let out = idemstore(&[
            "resolve",
            p(&path),
            scope,
            "k-1",
            "--token",
            &t,
            "--failed",
            r#""resolved""#,
            "--retryable",
            "--while-held",
        ]);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
    }
    // --not-http-layer overrules it (a scope that only looks like the
    // layer's); the outcome is still checked as JSON.
    let t = claim("POST /not-http", "k-2");
    let resolve = |extra: &[&str]| {
        let mut args = vec!["resolve", p(&path), "POST /not-http", "k-2", "--token", &t];
        args.extend_from_slice(extra);
        idemstore(&args)
    };
    let out = resolve(&["--not-http-layer", "--succeeded", "done"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("is not a JSON value"),
        "{}",
        stderr(&out)
    );
    let out = resolve(&[
        "--not-http-layer",
        "--while-held",
        "--succeeded",
        r#""done""#,
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    // Other scopes are not refused.
    let t = claim("acme/tickets POST", "k-3");
    let out = idemstore(&[
        "resolve",
        p(&path),
        "acme/tickets POST",
        "k-3",
        "--token",
        &t,
        "--while-held",
        "--succeeded",
        "1",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

fn tool_fingerprint() -> Fingerprint {
    Fingerprint::of_json(&serde_json::json!({"title": "printer on fire"})).unwrap()
}

/// `execute` on an agent key: the value it replays, or the error's text.
fn execute_again(path: &Path, id: &str) -> Result<String, String> {
    use idemstore::agent::{ExecuteOptions, Failure};
    let store = Store::open(path).unwrap();
    let k = Key::new("acme/tools", id).unwrap();
    store
        .execute(
            &k,
            &tool_fingerprint(),
            ExecuteOptions::new(),
            |_lease| -> Result<String, Failure<String>> { panic!("the tool ran again") },
        )
        .map(|out| out.value().clone())
        .map_err(|e| e.to_string())
}

/// `resolve` takes a JSON value by default, so that an operator cannot
/// make an agent key unusable: text that is not JSON is refused and
/// changes nothing; the quoted value is replayed by `execute`. A value
/// stored with --raw makes `execute` fail with an error that names the
/// repair (`resolve --amend`), which then works.
#[test]
fn resolve_keeps_agent_keys_usable_and_amend_repairs_a_bad_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let token = in_doubt_tool_call(&path, "task-1:call_2");
    let t = token.to_string();
    let resolve = |id: &str, extra: &[&str]| {
        let mut args = vec!["resolve", p(&path), "acme/tools", id, "--token", &t];
        args.extend_from_slice(extra);
        idemstore(&args)
    };
    let out = resolve("task-1:call_2", &["--succeeded", "T-call_2"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("is not a JSON value"),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains(r#"'"T-call_2"'"#), "{}", stderr(&out));
    // The suggested flag pastes into a shell as one JSON word, a quote in
    // the value included.
    let out = resolve("task-1:call_2", &["--succeeded", "it's"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    let (_, after) = err.split_once("quote a string as JSON (").expect(&err);
    let (suggested, _) = after.split_once("), or give").expect(&err);
    assert_eq!(
        shlex::split(suggested).expect(&err),
        ["--succeeded", r#""it's""#]
    );
    let out = idemstore(&["get", p(&path), "acme/tools", "task-1:call_2", "--json"]);
    assert_eq!(json(&out)["state"], "processing");
    let out = resolve("task-1:call_2", &["--succeeded", r#""T-call_2""#]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(execute_again(&path, "task-1:call_2").unwrap(), "T-call_2");

    // Bytes stored with --raw: execute names the repair; --amend makes it.
    let token = in_doubt_tool_call(&path, "task-1:call_3");
    let t = token.to_string();
    let resolve = |extra: &[&str]| {
        let mut args = vec![
            "resolve",
            p(&path),
            "acme/tools",
            "task-1:call_3",
            "--token",
            &t,
        ];
        args.extend_from_slice(extra);
        idemstore(&args)
    };
    // Claimed at the store's time, which an earlier open moved on: the
    // lease is valid.
    let out = resolve(&["--while-held", "--raw", "--succeeded", "T-call_3"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let err = execute_again(&path, "task-1:call_3").unwrap_err();
    assert!(
        err.contains(&format!(
            "idemstore resolve STORE --token {token} --retention 86400000ms --amend \
             --succeeded JSON -- acme/tools task-1:call_3 (STORE and JSON filled in;"
        )),
        "{err}"
    );
    // Without --amend a finished record is refused, and says how.
    let out = resolve(&["--succeeded", r#""T-call_3""#]);
    assert_eq!(code(&out), 2);
    assert!(stderr(&out).contains("give --amend"), "{}", stderr(&out));
    let out = resolve(&["--amend", "--succeeded", r#""T-call_3""#]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(stdout(&out).contains("amended"), "{}", stdout(&out));
    assert_eq!(execute_again(&path, "task-1:call_3").unwrap(), "T-call_3");
    // An id a shell would split (a space, a quote) and that starts with
    // `-`: the repair the error names is quoted and placed after `--`, and
    // runs as printed.
    let id = "-task 1:call_'5'";
    let t = in_doubt_tool_call(&path, id).to_string();
    let raw = [
        "resolve",
        p(&path),
        "--token",
        &t,
        "--while-held",
        "--raw",
        "--succeeded",
        "T-5",
        "--",
        "acme/tools",
        id,
    ];
    assert_eq!(code(&idemstore(&raw)), 0);
    let err = execute_again(&path, id).unwrap_err();
    let at = err.find("idemstore resolve STORE").expect(&err);
    let words = shlex::split(&err[at..]).expect(&err);
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    assert_eq!(
        &words[..8],
        [
            "idemstore",
            "resolve",
            "STORE",
            "--token",
            &t,
            "--retention",
            "86400000ms",
            "--amend"
        ]
    );
    let dashes = words.iter().position(|w| *w == "--").expect(&err);
    assert_eq!(&words[dashes + 1..dashes + 3], ["acme/tools", id]);
    // The command as printed, with the store and an outcome filled in.
    let mut args = vec!["resolve", p(&path)];
    args.extend_from_slice(&words[3..8]);
    args.extend_from_slice(&["--succeeded", r#""T-5""#]);
    args.extend_from_slice(&words[dashes..dashes + 3]);
    let out = idemstore(&args);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(execute_again(&path, id).unwrap(), "T-5");
    // --retryable belongs to --failed: with --succeeded it is refused.
    let t = in_doubt_tool_call(&path, "task-1:call_6").to_string();
    let out = idemstore(&[
        "resolve",
        p(&path),
        "acme/tools",
        "task-1:call_6",
        "--token",
        &t,
        "--retryable",
        "--succeeded",
        r#""T-6""#,
    ]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    assert!(
        stderr(&out).contains("cannot be used with"),
        "{}",
        stderr(&out)
    );
    let out = idemstore(&["get", p(&path), "acme/tools", "task-1:call_6", "--json"]);
    assert_eq!(json(&out)["state"], "processing");
    // --amend never finishes a record in progress.
    let token = in_doubt_tool_call(&path, "task-1:call_4");
    let out = idemstore(&[
        "resolve",
        p(&path),
        "acme/tools",
        "task-1:call_4",
        "--token",
        &token.to_string(),
        "--amend",
        "--succeeded",
        "1",
    ]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("still in progress"),
        "{}",
        stderr(&out)
    );
}

/// `execute` refusing a key in doubt names the `resolve` that records what
/// happened, with the token of the lease it acquired, quoted for a shell;
/// run as printed (STORE and JSON filled in), the next `execute` replays
/// the recorded result, and `--failed JSON --retryable` lets it run again.
#[test]
fn an_in_doubt_execute_names_the_resolve_that_records_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let id = "-task 1:call_'7'";
    in_doubt_tool_call(&path, id);
    let err = execute_again(&path, id).unwrap_err();
    assert!(err.contains("is in doubt"), "{err}");
    let at = err.find("idemstore resolve STORE").expect(&err);
    let words = shlex::split(&err[at..]).expect(&err);
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    assert_eq!(&words[..4], ["idemstore", "resolve", "STORE", "--token"]);
    // The store's retention (24 h here), so that the resolved record is
    // kept as long as the service's own.
    // --while-held: the lease named is the refusing call's own, under
    // which nothing runs.
    assert_eq!(
        &words[5..10],
        [
            "--retention",
            "86400000ms",
            "--while-held",
            "--succeeded",
            "JSON"
        ],
        "{err}"
    );
    let dashes = words.iter().position(|w| *w == "--").expect(&err);
    assert_eq!(&words[dashes + 1..dashes + 3], ["acme/tools", id]);
    // The token is the one the refusing call holds: the record's.
    let out = idemstore(&["get", p(&path), "--json", "--", "acme/tools", id]);
    assert_eq!(json(&out)["state"], "processing");
    assert_eq!(json(&out)["token"].to_string(), words[4]);
    let mut args = vec!["resolve", p(&path)];
    args.extend_from_slice(&words[3..8]);
    args.extend_from_slice(&["--succeeded", r#""T-7""#]);
    args.extend_from_slice(&words[dashes..dashes + 3]);
    let out = idemstore(&args);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = idemstore(&["get", p(&path), "--json", "--", "acme/tools", id]);
    let record = json(&out);
    let kept = record["expires_ms"].as_u64().unwrap() - record["updated_ms"].as_u64().unwrap();
    assert_eq!(kept, 86_400_000);
    assert_eq!(execute_again(&path, id).unwrap(), "T-7");

    // "It did not take effect": a retryable failure lets the next call run.
    in_doubt_tool_call(&path, "task-1:call_8");
    let err = execute_again(&path, "task-1:call_8").unwrap_err();
    let at = err.find("idemstore resolve STORE").expect(&err);
    let words = shlex::split(&err[at..]).expect(&err);
    assert!(
        err.contains("with --retryable to let the next call run it"),
        "{err}"
    );
    let out = idemstore(&[
        "resolve",
        p(&path),
        "--token",
        &words[4],
        "--failed",
        r#""not sent""#,
        "--retryable",
        "--while-held",
        "--",
        "acme/tools",
        "task-1:call_8",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = idemstore(&["get", p(&path), "acme/tools", "task-1:call_8", "--json"]);
    assert_eq!(json(&out)["state"], "failed-retryable", "{}", stdout(&out));
    // The next call runs the tool.
    let store = Store::open(&path).unwrap();
    let ran = store
        .execute(
            &Key::new("acme/tools", "task-1:call_8").unwrap(),
            &tool_fingerprint(),
            idemstore::agent::ExecuteOptions::new(),
            |_lease| -> Result<String, idemstore::agent::Failure<String>> { Ok("T-8".into()) },
        )
        .unwrap();
    assert_eq!(ran.value(), "T-8");
    assert!(!ran.is_replayed(), "{ran:?}");
}

/// On a store the scrub found damaged (its marker beside it), `get` of a
/// key it does not find is an error, not "absent", since the damage can
/// hide a record; so a key given as one argument is not split by lookups
/// there: the message says why and lists the two-argument forms, and the
/// two-argument form reads the record.
#[test]
fn a_joined_key_on_a_damaged_store_lists_its_splits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    in_doubt_tool_call(&path, "task-1:call_1");
    let mut marker = std::fs::canonicalize(&path).unwrap().into_os_string();
    marker.push("-damaged");
    std::fs::write(&marker, "found by a test\n").unwrap();
    let out = idemstore(&["get", p(&path), "acme/tools/task-1:call_1"]);
    assert_eq!(code(&out), 2, "{}", stdout(&out));
    let err = stderr(&out);
    assert!(err.contains("cannot tell which way of splitting"), "{err}");
    assert!(err.contains("-- acme/tools task-1:call_1"), "{err}");
    let out = idemstore(&["get", p(&path), "acme/tools", "task-1:call_1", "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["state"], "processing");
    // A key that is not found is not answered as absent.
    let out = idemstore(&["get", p(&path), "acme/tools", "task-1:call_9"]);
    assert_ne!(code(&out), 0, "{}", stdout(&out));
    assert!(
        stderr(&out).contains("cannot answer that a key is absent"),
        "{}",
        stderr(&out)
    );
}

/// A key as the library prints it (`scope/id`, one argument) pastes into
/// `get` and `resolve`: split at the `/` after which a record exists. When
/// no split names a record, the message lists each way to split it.
#[test]
fn a_key_as_the_library_prints_it_pastes_into_get_and_resolve() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let token = in_doubt_tool_call(&path, "task/1:call_2");
    let printed = Key::new("acme/tools", "task/1:call_2").unwrap().to_string();
    assert_eq!(printed, "acme/tools/task/1:call_2");
    let out = idemstore(&["get", p(&path), &printed, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(json(&out)["id"], "task/1:call_2");
    let out = idemstore(&[
        "resolve",
        p(&path),
        &printed,
        "--token",
        &token.to_string(),
        "--succeeded",
        "7",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = idemstore(&["get", p(&path), "acme/tools/task/9:call_9"]);
    assert_eq!(code(&out), 2);
    let err = stderr(&out);
    // Each split as a shell takes it, after `--`.
    for split in [
        "-- acme tools/task/9:call_9",
        "-- acme/tools task/9:call_9",
        "-- acme/tools/task 9:call_9",
    ] {
        assert!(err.contains(split), "{split} not in: {err}");
    }
    // A part a shell would expand or split is quoted, and pastes as is.
    let out = idemstore(&["get", p(&path), "acme $x/tools/-t 1"]);
    let err = stderr(&out);
    let (_, listed) = err
        .split_once("(each pasted at the end of the command, after its options): ")
        .expect(&err);
    let line = listed
        .split("; ")
        .find(|l| l.starts_with("-- 'acme $x/tools'"))
        .unwrap_or_else(|| panic!("{err}"));
    let words = shlex::split(line.trim()).unwrap();
    assert_eq!(words, ["--", "acme $x/tools", "-t 1"]);
    let mut args = vec!["get", p(&path)];
    args.extend(words.iter().map(String::as_str));
    let out = idemstore(&args);
    assert_eq!(code(&out), 1, "{}", stderr(&out));
    assert!(
        stdout(&out).contains(r#"scope "acme $x/tools" id "-t 1""#),
        "{}",
        stdout(&out)
    );
    let out = idemstore(&["get", p(&path), "no-slash-at-all"]);
    assert_eq!(code(&out), 2);
    assert!(
        stderr(&out).contains("SCOPE ID, two arguments"),
        "{}",
        stderr(&out)
    );
}

/// The commands that only read a store file (`get`, `list`, `stats`,
/// `export`, `check`, `compact`) run on a host whose wall clock is ahead of
/// the service's (here the service's clock runs ten days behind the
/// binary's): they answer as of that clock, and leave the store's time
/// alone, so the service, back on its own clock, finds its records live.
#[test]
fn commands_that_read_under_a_clock_ahead_leave_the_stores_time_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let backup = dir.path().join("backup.idemx");
    let t0 = SystemClock.now_ms() - 10 * 24 * 3_600_000;
    let service = |at: u64| {
        Store::open_with(
            &path,
            Config::new()
                .clock(ManualClock::new(at))
                .retention(Duration::from_secs(3600))
                .sweep_interval(None),
        )
        .unwrap()
    };
    let kept = {
        let store = service(t0);
        let lease = acquire(&store, &key("kept"), &ClaimOptions::new());
        store.complete(&lease, b"\"ticket T-1\"").unwrap()
    };
    let out = idemstore(&["get", p(&path), "acme/tickets", "kept", "--json"]);
    assert_eq!(code(&out), 1, "past retention by the binary's clock");
    for args in [
        vec!["list", p(&path)],
        vec!["stats", p(&path)],
        vec!["export", p(&path), "-o", p(&backup)],
        vec!["check", p(&path)],
        vec!["compact", p(&path)],
    ] {
        let out = idemstore(&args);
        assert_eq!(code(&out), 0, "{args:?}: {}", stderr(&out));
    }
    let store = service(t0 + 60_000);
    assert!(
        store.now_ms() < t0 + 3_600_000,
        "the commands moved the store's time {} s past the service's clock",
        (store.now_ms() - t0) / 1000
    );
    assert_eq!(store.get(&key("kept")).unwrap(), Some(kept));
}
