//! Writes the format fixtures under `tests/fixtures/` that
//! `tests/format_upgrade.rs` opens: stores written by an older build, kept
//! so that every later format change is tested against them.
//!
//! The `v1-*` fixtures were written by this program built at commit
//! 6794c7c (store format 1, log format 1, before the reserved time bound),
//! the `v2-*` ones built at 0d5ac10 (store format 2, log format 1), the
//! `v3-*` ones built at 0016e50 (store format 3):
//!
//! ```text
//! git worktree add /tmp/base 6794c7c
//! cp examples/format_fixture.rs /tmp/base/examples/
//! cd /tmp/base && cargo run --release --example format_fixture -- <repo>/tests/fixtures v1
//! ```
//!
//! It writes two stores with the same records, on a fixed clock
//! (`T0_MS`, see below), named by the prefix given (`v1` when absent):
//! - `v1-clean.redb` (+ `-wal`): closed cleanly (the index holds everything);
//! - `v1-crashed.redb` (+ `-wal`): the process exits without closing after
//!   a checkpoint, so the changes after it are only in the log and the next
//!   open must replay them.
//!
//! Records, in scope `fixture` (fingerprint = the id's bytes): `done-0` …
//! `done-9` succeeded with result `result-<n>`; `failed` failed permanently
//! with `boom`; `retry` failed retryably with `again`; `held` Processing with
//! a 1-hour lease (acquired by 1 claim). In `v1-crashed`, `done-5` …
//! `done-9`, `failed`, `retry` and `held` are written after the last
//! checkpoint.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, ManualClock, Store};

/// The fixtures' clock: 2026-01-01T00:00:00Z.
const T0_MS: u64 = 1_767_225_600_000;

fn config() -> Config {
    Config::new()
        .clock(ManualClock::new(T0_MS))
        .sweep_interval(None)
        .max_log_bytes(64 * 1024)
        .lease(Duration::from_secs(3600))
}

fn acquire(store: &Store, id: &str) -> idemstore::Lease {
    let key = Key::new("fixture", id).expect("key");
    match store
        .claim(&key, &Fingerprint::of(id.as_bytes()), &ClaimOptions::new())
        .expect("claim")
    {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("{id}: {other:?}"),
    }
}

fn write(store: &Store, ids: std::ops::Range<u32>, rest: bool) {
    for n in ids {
        let lease = acquire(store, &format!("done-{n}"));
        store
            .complete(&lease, format!("result-{n}").as_bytes())
            .expect("complete");
    }
    if rest {
        let lease = acquire(store, "failed");
        store.fail(&lease, b"boom", false).expect("fail");
        let lease = acquire(store, "retry");
        store.fail(&lease, b"again", true).expect("fail");
        acquire(store, "held");
    }
}

fn fresh(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let _ = std::fs::remove_file(PathBuf::from(wal));
    path
}

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "tests/fixtures".into()),
    );
    let prefix = std::env::args().nth(2).unwrap_or_else(|| "v1".into());
    std::fs::create_dir_all(&dir).expect("fixture directory");

    let clean = format!("{prefix}-clean.redb");
    let store = Store::open_with(fresh(&dir, &clean), config()).expect("open");
    write(&store, 0..10, true);
    drop(store);

    let crashed = format!("{prefix}-crashed.redb");
    let store = Store::open_with(fresh(&dir, &crashed), config()).expect("open");
    write(&store, 0..5, false);
    store.checkpoint().expect("checkpoint");
    write(&store, 5..10, true);
    // Exit without closing: the last changes are only in the log.
    std::process::exit(0);
}
