//! When an open runs redb's full integrity check (issue 13, deliverable 4):
//! after every unclean shutdown; after a clean close only when the last
//! check is older than `Config::integrity_check_interval` (default 24
//! hours), was never recorded, or is recorded in the future; at every open
//! with `integrity_check_interval(None)`.
//!
//! Whether the check ran is observed through the store's events ("integrity
//! check ran", info, with a `reason`; "integrity check skipped", debug),
//! never through timing. Time is driven by a `ManualClock` (the wall reading
//! of the store's clock is what the store records).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::*;
use idemstore::{Config, DEFAULT_INTEGRITY_CHECK_INTERVAL, Error, ManualClock, Store};
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};

const RAN: &str = "integrity check ran";
const SKIPPED: &str = "integrity check skipped";
/// The meta key the store records the last passed check under.
const META_VERIFIED: &str = "integrity_verified_ms";
const MARKER: &[u8] = b"MARKER-integrity-on-open-3f1c-result-bytes";

#[derive(Debug, Clone)]
struct Captured {
    message: String,
    fields: BTreeMap<String, String>,
}

struct Capture(Arc<Mutex<Vec<Captured>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let message = fields.remove("message").unwrap_or_default();
        if message == RAN || message.starts_with(SKIPPED) {
            self.0.lock().unwrap().push(Captured { message, fields });
        }
    }
}

/// Every check event of this binary (tests run on several threads, so the
/// subscriber is global); each test filters by its store's path.
fn captured() -> Arc<Mutex<Vec<Captured>>> {
    static EVENTS: OnceLock<Arc<Mutex<Vec<Captured>>>> = OnceLock::new();
    EVENTS
        .get_or_init(|| {
            let events = Arc::new(Mutex::new(Vec::new()));
            let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
            tracing::subscriber::set_global_default(subscriber).unwrap();
            events
        })
        .clone()
}

/// What the opens of the store at `path` did, in order: `Some(reason)`
/// when the check ran, `None` when it was skipped.
fn checks_of(path: &Path) -> Vec<Option<String>> {
    let path = path.display().to_string();
    captured()
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.fields.get("path") == Some(&path))
        .map(|e| (e.message == RAN).then(|| e.fields.get("reason").cloned().unwrap_or_default()))
        .collect()
}

/// Opens the store at `t.path` with `config` and returns what the open did
/// about the check.
#[track_caller]
fn open_and_see(t: &TestDir, config: Config) -> (Store, Option<String>) {
    let before = checks_of(&t.path).len();
    let store = t.open_with(config);
    let after = checks_of(&t.path);
    assert_eq!(
        after.len(),
        before + 1,
        "one check decision per open: {after:?}"
    );
    (store, after[before].clone())
}

/// Opens, then closes cleanly; returns what the open did.
#[track_caller]
fn reopen(t: &TestDir, config: Config) -> Option<String> {
    let (store, seen) = open_and_see(t, config);
    drop(store);
    seen
}

/// Sets (or with `None` removes) a meta value in the closed store file,
/// through redb directly (as a hostile or old file would hold it).
fn set_meta(path: &Path, name: &str, value: Option<&[u8]>) {
    let meta: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    let db = redb::Database::open(path).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(meta).unwrap();
        match value {
            Some(v) => {
                table.insert(name, v).unwrap();
            }
            None => {
                table.remove(name).unwrap();
            }
        }
    }
    txn.commit().unwrap();
}

fn get_meta(path: &Path, name: &str) -> Option<Vec<u8>> {
    use redb::ReadableDatabase;
    let meta: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    let db = redb::Database::open(path).unwrap();
    let txn = db.begin_read().unwrap();
    let table = txn.open_table(meta).unwrap();
    table.get(name).unwrap().map(|v| v.value().to_vec())
}

fn complete_one(store: &Store, id: &str, result: &[u8]) {
    let k = key(id);
    let lease = acquired(store.claim(&k, &fp(id), &lease_of(secs(600))).unwrap());
    store.complete(&lease, result).unwrap();
}

fn reason(s: &str) -> Option<String> {
    Some(s.to_string())
}

#[test]
fn a_clean_reopen_skips_the_check_within_the_period_and_runs_it_after() {
    let t = TestDir::new();
    let (store, first) = open_and_see(&t, t.config());
    assert_eq!(
        first,
        reason("never verified"),
        "a new store is checked once"
    );
    complete_one(&store, "a", b"done");
    drop(store);
    let recorded = get_meta(&t.path, META_VERIFIED).expect("the passed check is recorded");
    assert_eq!(
        u64::from_le_bytes(recorded.try_into().unwrap()),
        t.now_ms(),
        "the wall reading of the store's clock"
    );

    let (store, seen) = open_and_see(&t, t.config());
    assert_eq!(seen, None, "just verified: skipped");
    assert!(store.get(&key("a")).unwrap().is_some());
    drop(store);
    let period = DEFAULT_INTEGRITY_CHECK_INTERVAL;
    t.clock.advance(period - ms(1));
    assert_eq!(reopen(&t, t.config()), None, "one ms short of the period");
    t.clock.advance(ms(1));
    assert_eq!(
        reopen(&t, t.config()),
        reason("last verification older than the period")
    );
    // That check is recorded: the next clean open skips again.
    assert_eq!(reopen(&t, t.config()), None);

    // A period of its own.
    let hourly = t.config().integrity_check_interval(Some(secs(3600)));
    t.clock.advance(secs(3599));
    assert_eq!(reopen(&t, hourly.clone()), None);
    t.clock.advance(secs(1));
    assert_eq!(
        reopen(&t, hourly),
        reason("last verification older than the period")
    );
}

#[test]
fn none_checks_at_every_open() {
    let t = TestDir::new();
    let every = t.config().integrity_check_interval(None);
    for _ in 0..3 {
        assert_eq!(
            reopen(&t, every.clone()),
            reason("every open (integrity_check_interval None)")
        );
    }
    // And it records the check: a default open right after skips it.
    assert_eq!(reopen(&t, t.config()), None);
}

const KILLED: &str = "an_unclean_shutdown_always_runs_the_check";

/// A store killed while open (SIGKILL) is checked at the next open, within
/// the period and whatever the period is; the next clean reopen skips.
#[test]
fn an_unclean_shutdown_always_runs_the_check() {
    if child_role(KILLED) {
        let clock = ManualClock::new(child_var_parsed("T0"));
        let config = Config::new().clock(clock).sweep_interval(None);
        let store = Store::open_with(child_var("STORE"), config).expect("open");
        complete_one(&store, &child_var("KEY"), b"done");
        ready_and_wait();
    }
    let t = TestDir::new();
    assert_eq!(reopen(&t, t.config()), reason("never verified"));
    assert_eq!(reopen(&t, t.config()), None);
    for round in 0..2 {
        let mut child = spawn_child(
            KILLED,
            &[
                ("STORE", path_var(&t.path)),
                ("T0", t.now_ms().to_string()),
                ("KEY", format!("before-kill-{round}")),
            ],
        );
        child.wait_ready();
        child.kill();
        // The longest period there is: only the unclean shutdown can make
        // this open check.
        let config = t.config().integrity_check_interval(Some(Duration::MAX));
        let (store, seen) = open_and_see(&t, config.clone());
        assert_eq!(seen, reason("unclean shutdown"), "round {round}");
        let k = key(&format!("before-kill-{round}"));
        assert!(store.get(&k).unwrap().is_some());
        drop(store);
        assert_eq!(reopen(&t, config), None, "round {round}: clean again");
    }
}

/// A page damaged while the store is closed: within the period the open
/// skips the check and the damaged record is still caught by its own
/// checksum on read; once the check runs (the period passed, or `None`) the
/// open is refused naming the file.
#[test]
fn a_page_damaged_while_closed_is_refused_once_the_check_runs() {
    let t = TestDir::new();
    let store = t.open();
    for i in 0..16 {
        complete_one(&store, &format!("other-{i}"), b"other result");
    }
    complete_one(&store, "victim", MARKER);
    drop(store);
    assert_eq!(reopen(&t, t.config()), None);
    let bytes = std::fs::read(&t.path).unwrap();
    let at: Vec<usize> = bytes
        .windows(MARKER.len())
        .enumerate()
        .filter(|(_, w)| *w == MARKER)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "the marker is written once");
    flip(&t.path, at[0] + 9, 0x01);

    // Within the period: skipped, and the record checksum reports the
    // damaged result instead of replaying it.
    let (store, seen) = open_and_see(&t, t.config());
    assert_eq!(seen, None);
    match store.get(&key("victim")) {
        Err(Error::CorruptRecord { key: k, .. }) => assert_eq!(k, key("victim").to_string()),
        other => panic!("expected CorruptRecord, got {other:?}"),
    }
    drop(store);

    let refused = |config: Config| match Store::open_with(&t.path, config) {
        Err(Error::CorruptFile { path, .. }) => assert_eq!(path, t.path),
        Err(err) => panic!("expected CorruptFile, got {err:?}"),
        Ok(_) => panic!("a damaged file opened with the check"),
    };
    refused(t.config().integrity_check_interval(None));
    // The refusal recorded nothing: still refused at every check after.
    t.clock.advance(DEFAULT_INTEGRITY_CHECK_INTERVAL);
    refused(t.config());
    refused(t.config());
    let ran = checks_of(&t.path);
    assert_eq!(ran.iter().filter(|r| r.is_none()).count(), 2, "{ran:?}");
}

/// A recorded check more than a minute ahead of the clock (a hostile file,
/// or a clock stepped back) counts as never verified; within a minute it
/// counts as just verified. A malformed or missing value (a store written
/// before the value existed) is never verified, checked once and then
/// recorded.
#[test]
fn a_recorded_check_in_the_future_or_missing_counts_as_never_verified() {
    let t = TestDir::new();
    assert_eq!(reopen(&t, t.config()), reason("never verified"));
    let now = t.now_ms();

    set_meta(&t.path, META_VERIFIED, Some(&(now + 61_000).to_le_bytes()));
    assert_eq!(
        reopen(&t, t.config()),
        reason("last verification recorded in the future")
    );
    assert_eq!(
        get_meta(&t.path, META_VERIFIED),
        Some(now.to_le_bytes().to_vec()),
        "replaced by the check's own time"
    );

    set_meta(&t.path, META_VERIFIED, Some(&u64::MAX.to_le_bytes()));
    assert_eq!(
        reopen(&t, t.config()),
        reason("last verification recorded in the future")
    );

    set_meta(&t.path, META_VERIFIED, Some(&(now + 60_000).to_le_bytes()));
    assert_eq!(reopen(&t, t.config()), None, "within the tolerance");

    set_meta(&t.path, META_VERIFIED, Some(&[1, 2, 3]));
    assert_eq!(reopen(&t, t.config()), reason("never verified"));

    // An old store: no value at all.
    set_meta(&t.path, META_VERIFIED, None);
    assert_eq!(reopen(&t, t.config()), reason("never verified"));
    assert_eq!(reopen(&t, t.config()), None, "then recorded");

    // A recorded time of 0 (the epoch) is simply old.
    set_meta(&t.path, META_VERIFIED, Some(&0u64.to_le_bytes()));
    assert_eq!(
        reopen(&t, t.config()),
        reason("last verification older than the period")
    );
}

#[test]
fn a_period_under_one_millisecond_is_refused() {
    let t = TestDir::new();
    for period in [Duration::ZERO, Duration::from_micros(999)] {
        match Store::open_with(&t.path, t.config().integrity_check_interval(Some(period))) {
            Err(Error::InvalidArgument { what, .. }) => {
                assert_eq!(what, "integrity_check_interval");
            }
            Err(err) => panic!("expected InvalidArgument, got {err:?}"),
            Ok(_) => panic!("{period:?} accepted"),
        }
    }
    assert!(!t.path.exists(), "refused before the file is created");
}

/// The checked-in fixtures (format 1, written before the last check was
/// recorded) are never verified: the clean one is checked at its first
/// open and skipped at the next; the crashed one is checked as unclean.
#[test]
fn fixtures_written_before_the_record_are_checked_once() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (name, first) in [
        ("v1-clean.redb", "never verified"),
        ("v1-crashed.redb", "unclean shutdown"),
    ] {
        let t = TestDir::new();
        for (from, to) in [
            (name.to_string(), t.path.clone()),
            (format!("{name}-wal"), log_of(&t.path)),
        ] {
            std::fs::copy(src.join(from), to).unwrap();
        }
        assert_eq!(reopen(&t, t.config()), reason(first), "{name}");
        assert_eq!(reopen(&t, t.config()), None, "{name}");
    }
}

/// The log beside a store file (`<path>-wal`).
fn log_of(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("-wal");
    name.into()
}
