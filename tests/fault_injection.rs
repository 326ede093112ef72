//! Fault injection at every storage call, and power loss after each fault.
//!
//! Two wrappers sit between the store and its storage: [`FaultyBackend`]
//! around a redb `StorageBackend` (forwarding the file-lock methods too) and
//! [`FaultyLog`] around a write-ahead [`LogFile`]. Both consult one
//! [`FaultPlan`] that fails the Nth call of one kind (write, sync, length,
//! resize) on one file, once, counting from when it was armed; a failed
//! write writes its first half. Under them, [`SimDisk`] and [`SimLog`] keep
//! each file in memory twice: as written, and as of its last sync; a power
//! cut keeps only the synced bytes.
//!
//! For each operation (claim, complete, fail, release, extend, set recovery
//! point, sweep, checkpoint, the checkpoint of a full log, close, open) and
//! each fault kind, N runs over every call of that kind the operation makes
//! (until the operation completes without reaching the fault). At each N
//! the operation must return or fail with a typed error within a deadline
//! (no panic, no hang); after the fault the store must refuse writes until
//! reopened (DESIGN.md guarantee 6); after a power cut and reopen every
//! acknowledged change must be there, and scenarios 4 and 12 of
//! `scenarios.md` must hold for the operation's key (12 for every key: a
//! sweep past retention empties the store only if each record has its
//! expiry index entry).
//!
//! `a_power_cut_after_any_log_write_keeps_whole_batches` runs many threads
//! whose requests share group-commit batches, then reopens the image a
//! power cut would leave after every log write (whole, or with the next
//! write torn), paired with the index as durable then: every acknowledged
//! change is there, no batch is half there, and the batches there are a
//! prefix of those written.
//!
//! `Store::resolve` is not on this branch, so it is not covered here. The
//! helpers live in this file: `tests/common/mod.rs` does not exist on it.
//!
//! `IDEMSTORE_FAULTS_REPEAT=<n>` runs every fault point n times and the
//! batch workload n times as long (default 1): the writer's idle index
//! commit runs on its own timer, so repeated runs meet a fault at different
//! moments. `FAULTS_TRACE=1` prints every storage call while a fault is
//! armed.

use std::collections::HashMap;
use std::io;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemstore::{
    BackendError, ClaimOptions, ClaimOutcome, Clock, Config, Error, Fingerprint, Key, Lease,
    LogFile, ManualClock, Resolution, State, StorageBackend, Store,
};

// ---------------------------------------------------------------------------
// Simulated storage: a file as written, and as of its last sync.

#[derive(Default)]
struct Image {
    live: Vec<u8>,
    /// The bytes as of the last successful sync: what a power cut leaves.
    durable: Vec<u8>,
}

impl Image {
    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if self.live.len() < end {
            self.live.resize(end, 0);
        }
        self.live[offset as usize..end].copy_from_slice(data);
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let start = offset as usize;
        let src = self
            .live
            .get(start..start + out.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "past the end"))?;
        out.copy_from_slice(src);
        Ok(())
    }
    fn sync(&mut self) {
        self.durable.clone_from(&self.live);
    }
}

/// One simulated file, shared by every handle (`Arc`), so that a test keeps
/// a handle while the store owns another.
#[derive(Clone, Default)]
struct SimFile(Arc<Mutex<Image>>);

impl SimFile {
    fn from_bytes(bytes: Vec<u8>) -> SimFile {
        SimFile(Arc::new(Mutex::new(Image {
            live: bytes.clone(),
            durable: bytes,
        })))
    }
    /// A new file holding what a power cut now would leave.
    fn power_cut(&self) -> SimFile {
        SimFile::from_bytes(self.0.lock().unwrap().durable.clone())
    }
    fn image(&self) -> std::sync::MutexGuard<'_, Image> {
        self.0.lock().unwrap()
    }
}

/// The redb index file on simulated storage.
#[derive(Clone, Default)]
struct SimDisk(SimFile);

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimDisk")
    }
}

impl StorageBackend for SimDisk {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.0.image().live.len() as u64)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.0.image().read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.0.image().live.resize(len as usize, 0);
        Ok(())
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.0.image().sync();
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.0.image().write(offset, data);
        Ok(())
    }
}

/// One write to a file: (offset, bytes).
type LogWrite = (u64, Vec<u8>);

/// The write-ahead log on simulated storage. Every write is also kept in a
/// journal, in order, for the batch test's cut images.
#[derive(Clone, Default)]
struct SimLog {
    file: SimFile,
    journal: Arc<Mutex<Vec<LogWrite>>>,
    /// While set, a sync takes a millisecond, so that requests queue up
    /// behind it and share batches (group commit).
    slow_sync: Arc<AtomicBool>,
}

impl SimLog {
    fn power_cut(&self) -> SimLog {
        SimLog {
            file: self.file.power_cut(),
            ..SimLog::default()
        }
    }
}

impl LogFile for SimLog {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.image().read(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.journal.lock().unwrap().push((offset, data.to_vec()));
        self.file.image().write(offset, data);
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        if self.slow_sync.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.file.image().sync();
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.image().live.len() as u64)
    }
}

// ---------------------------------------------------------------------------
// Fault injection.

/// Which file a fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Target {
    Index,
    Log,
}

/// Which kind of storage call a fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Call {
    Write,
    Sync,
    Len,
    SetLen,
}

/// Every (file, call) pair a fault can hit. The log has no resize call (it
/// is extended by writing zeros).
const FAULT_KINDS: [(Target, Call); 7] = [
    (Target::Index, Call::Write),
    (Target::Index, Call::Sync),
    (Target::Index, Call::Len),
    (Target::Index, Call::SetLen),
    (Target::Log, Call::Write),
    (Target::Log, Call::Sync),
    (Target::Log, Call::Len),
];

/// Fails the Nth call of one kind on one file, once, counting from
/// [`FaultPlan::arm`].
#[derive(Default)]
struct FaultPlan {
    armed: Mutex<Option<(Target, Call, u64)>>,
    /// The fault fired (and which call it hit).
    fired: Mutex<Option<(Target, Call)>>,
}

impl FaultPlan {
    fn arm(&self, target: Target, call: Call, n: u64) {
        *self.fired.lock().unwrap() = None;
        *self.armed.lock().unwrap() = Some((target, call, n));
    }
    /// Disarms; returns what fired since [`FaultPlan::arm`].
    fn disarm(&self) -> Option<(Target, Call)> {
        *self.armed.lock().unwrap() = None;
        *self.fired.lock().unwrap()
    }
    fn check(&self, target: Target, call: Call) -> io::Result<()> {
        let mut armed = self.armed.lock().unwrap();
        if armed.is_some() && std::env::var_os("FAULTS_TRACE").is_some() {
            eprintln!(
                "  call {target:?} {call:?} {}",
                std::thread::current().name().unwrap_or("?")
            );
        }
        if let Some((t, c, n)) = armed.as_mut()
            && *t == target
            && *c == call
        {
            if *n == 0 {
                *armed = None;
                *self.fired.lock().unwrap() = Some((target, call));
                return Err(io::Error::other(format!(
                    "injected {call:?} failure on the {target:?} file"
                )));
            }
            *n -= 1;
        }
        Ok(())
    }
}

/// A redb `StorageBackend` that forwards every call, the file-lock methods
/// included, to `inner`, failing the call its [`FaultPlan`] names. A failed
/// write writes its first half (a torn write), as a real disk may.
struct FaultyBackend<B> {
    inner: B,
    plan: Arc<FaultPlan>,
}

impl<B: std::fmt::Debug> std::fmt::Debug for FaultyBackend<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyBackend")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<B: StorageBackend> StorageBackend for FaultyBackend<B> {
    fn len(&self) -> Result<u64, io::Error> {
        self.plan.check(Target::Index, Call::Len)?;
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.plan.check(Target::Index, Call::SetLen)?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.plan.check(Target::Index, Call::Sync)?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        if let Err(e) = self.plan.check(Target::Index, Call::Write) {
            self.inner.write(offset, &data[..data.len() / 2])?;
            return Err(e);
        }
        self.inner.write(offset, data)
    }
    fn close(&self) -> Result<(), io::Error> {
        self.inner.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

/// A [`LogFile`] that forwards to `inner`, failing the call its
/// [`FaultPlan`] names. A failed write writes its first half.
struct FaultyLog<L> {
    inner: L,
    plan: Arc<FaultPlan>,
}

impl<L: LogFile> LogFile for FaultyLog<L> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if let Err(e) = self.plan.check(Target::Log, Call::Write) {
            self.inner.write_at(offset, &data[..data.len() / 2])?;
            return Err(e);
        }
        self.inner.write_at(offset, data)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.plan.check(Target::Log, Call::Sync)?;
        self.inner.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        self.plan.check(Target::Log, Call::Len)?;
        self.inner.len()
    }
}

// ---------------------------------------------------------------------------
// Harness.

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(600);
/// How long any one call may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(60);
/// A start time at a real epoch (2026-01-01), not 0.
const START_MS: u64 = 1_767_225_600_000;

fn repeat() -> usize {
    std::env::var("IDEMSTORE_FAULTS_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn config(clock: &ManualClock) -> Config {
    Config::new()
        .sweep_interval(None)
        .scrub_rate(None)
        .lease(LEASE)
        .retention(RETENTION)
        .clock(clock.clone())
        .max_log_bytes(64 * 1024)
}

/// Both files of one store, the fault plan in front of them, and the clock.
struct Rig {
    disk: SimDisk,
    log: SimLog,
    plan: Arc<FaultPlan>,
    clock: ManualClock,
}

impl Rig {
    fn new() -> Rig {
        Rig {
            disk: SimDisk::default(),
            log: SimLog::default(),
            plan: Arc::default(),
            clock: ManualClock::new(START_MS),
        }
    }
    fn open(&self) -> Result<Store, Error> {
        Store::open_with_backend(
            "faults.redb",
            FaultyBackend {
                inner: self.disk.clone(),
                plan: self.plan.clone(),
            },
            FaultyLog {
                inner: self.log.clone(),
                plan: self.plan.clone(),
            },
            config(&self.clock),
        )
    }
    /// The storage a power cut now would leave, with a fresh fault plan
    /// and a clock of its own at the same time.
    fn power_cut(&self) -> Rig {
        Rig {
            disk: SimDisk(self.disk.0.power_cut()),
            log: self.log.power_cut(),
            plan: Arc::default(),
            clock: ManualClock::new(self.clock.now_ms()),
        }
    }
}

/// Runs `f` on its own thread; fails the test if it panics or takes longer
/// than [`HANG`].
fn timed<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(HANG) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung for {HANG:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// A storage failure must surface as one of these, never as a wrong answer.
/// `IncompatibleFile` appears only when a fault cut the creation of a store
/// before redb's header was written: the file then has no redb magic number
/// (see `a_store_whose_creation_was_cut_opens_again`).
fn assert_typed(what: &str, e: &Error) {
    assert!(
        matches!(
            e,
            Error::Storage(_)
                | Error::Poisoned { .. }
                | Error::Closed
                | Error::CorruptFile { .. }
                | Error::CorruptLog { .. }
        ) || matches!(e, Error::IncompatibleFile { detail, .. } if detail.contains("magic number")),
        "{what}: a storage fault surfaced as {e:?}"
    );
}

fn key(id: &str) -> Key {
    Key::new("test/faults", id).unwrap()
}

fn fp() -> Fingerprint {
    Fingerprint::of(b"payload")
}

fn acquire(store: &Store, k: &Key) -> Lease {
    match store.claim(k, &fp(), &ClaimOptions::new()).unwrap() {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("{k}: expected Acquired, got {other:?}"),
    }
}

/// The operations under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Claim,
    Complete,
    Fail,
    Release,
    Extend,
    SetRecoveryPoint,
    /// A reconciler finishing the target with `Store::resolve`, fenced by
    /// its token.
    Resolve,
    Sweep,
    Checkpoint,
    /// A completion whose frame does not fit in the log: the writer commits
    /// it to the index in a checkpoint and starts the log over.
    CompleteWhenLogFull,
    /// Dropping the store: its closing checkpoint.
    Close,
}

/// The result the operation under test completes with.
fn result_of(op: Op) -> Vec<u8> {
    match op {
        Op::CompleteWhenLogFull => vec![b'r'; BIG],
        _ => b"result".to_vec(),
    }
}

/// A result of this many bytes takes a third of the smallest log (64 KiB).
const BIG: usize = 20_000;

/// Records evicted by the sweep under test.
const OLD: usize = 5;

/// What the setup left, all acknowledged.
struct Setup {
    done: Key,
    held: Lease,
    target: Key,
    /// The target's lease (every op but claim starts from a held target).
    lease: Option<Lease>,
    lease_until_ms: u64,
}

fn setup(store: &Store, clock: &ManualClock, op: Op) -> Setup {
    if op == Op::Sweep {
        for i in 0..OLD {
            let l = acquire(store, &key(&format!("old-{i}")));
            store.complete(&l, b"old").unwrap();
        }
        clock.advance(RETENTION + Duration::from_secs(1));
    }
    if op == Op::CompleteWhenLogFull {
        // Two frames of a third of the log each: the next one does not fit.
        for i in 0..2 {
            let l = acquire(store, &key(&format!("filler-{i}")));
            store.complete(&l, &vec![b'f'; BIG]).unwrap();
        }
    }
    let done = key("done");
    let l = acquire(store, &done);
    store.complete(&l, b"done").unwrap();
    let held = acquire(store, &key("held"));
    let target = key("target");
    let (lease, lease_until_ms) = if op == Op::Claim {
        (None, 0)
    } else {
        let l = acquire(store, &target);
        let until = l.lease_until_ms().unwrap();
        (Some(l), until)
    };
    Setup {
        done,
        held,
        target,
        lease,
        lease_until_ms,
    }
}

/// What an operation answered.
#[derive(Debug)]
enum Answer {
    Claimed(ClaimOutcome),
    Done,
    Extended(u64),
    Swept(usize),
}

fn run(store: &Store, s: &Setup, op: Op) -> Result<Answer, Error> {
    let lease = || s.lease.clone().unwrap();
    match op {
        Op::Claim => store
            .claim(&s.target, &fp(), &ClaimOptions::new())
            .map(Answer::Claimed),
        Op::Complete | Op::CompleteWhenLogFull => store
            .complete(&lease(), &result_of(op))
            .map(|_| Answer::Done),
        Op::Resolve => store
            .resolve(
                &s.target,
                lease().token(),
                Resolution::Succeeded(result_of(op)),
            )
            .map(|_| Answer::Done),
        Op::Fail => store
            .fail(&lease(), b"failure", false)
            .map(|_| Answer::Done),
        Op::Release => store.release(lease()).map(|_| Answer::Done),
        Op::Extend => store
            .extend(&lease(), Duration::from_secs(50))
            .map(Answer::Extended),
        Op::SetRecoveryPoint => store
            .set_recovery_point(&lease(), b"step-2")
            .map(|_| Answer::Done),
        Op::Sweep => store.sweep(100).map(Answer::Swept),
        Op::Checkpoint => store.checkpoint().map(|_| Answer::Done),
        Op::Close => unreachable!("closing is run by one_point"),
    }
}

/// After reopen: the operation's own change is there if it was
/// acknowledged, and whole either way.
fn check_target(
    store: &Store,
    s: &Setup,
    op: Op,
    acked: Option<&Answer>,
    probe: Option<&Lease>,
    at: &str,
) {
    let rec = store.get(&s.target).unwrap();
    let token = s.lease.as_ref().map(Lease::token);
    let processing_as_before = |r: &idemstore::Record| {
        r.state() == State::Processing && Some(r.token()) == token && r.recovery_point().is_none()
    };
    match op {
        Op::Claim => match (acked, &rec) {
            (Some(Answer::Claimed(ClaimOutcome::Acquired(l))), Some(r)) => {
                assert_eq!(r.state(), State::Processing, "{at}");
                assert_eq!(r.token(), l.token(), "{at}");
            }
            (Some(a), _) => panic!("{at}: acknowledged claim {a:?} lost: {rec:?}"),
            (None, None) => {}
            (None, Some(r)) => assert_eq!(r.state(), State::Processing, "{at}"),
        },
        Op::Complete | Op::CompleteWhenLogFull | Op::Resolve => {
            let r = rec.unwrap_or_else(|| panic!("{at}: record lost"));
            let whole = r.state() == State::Succeeded && r.result() == Some(&result_of(op)[..]);
            assert!(
                whole || (acked.is_none() && processing_as_before(&r)),
                "{at}: acked={acked:?} {r:?}"
            );
        }
        Op::Fail => {
            let r = rec.unwrap_or_else(|| panic!("{at}: record lost"));
            let whole = matches!(r.state(), State::Failed { retryable: false })
                && r.failure() == Some(&b"failure"[..]);
            assert!(
                whole || (acked.is_none() && processing_as_before(&r)),
                "{at}: acked={acked:?} {r:?}"
            );
        }
        Op::Release => match &rec {
            None => {}
            Some(r) => assert!(
                acked.is_none() && processing_as_before(r),
                "{at}: acked={acked:?} {r:?}"
            ),
        },
        Op::Extend => {
            let r = rec.unwrap_or_else(|| panic!("{at}: record lost"));
            assert_eq!(r.state(), State::Processing, "{at}");
            assert_eq!(Some(r.token()), token, "{at}");
            match acked {
                Some(Answer::Extended(until)) => assert_eq!(r.lease_until_ms(), *until, "{at}"),
                Some(a) => panic!("{at}: {a:?}"),
                None => assert!(r.lease_until_ms() >= s.lease_until_ms, "{at}: {r:?}"),
            }
            assert!(r.expires_ms() >= r.lease_until_ms(), "{at}: {r:?}");
        }
        Op::SetRecoveryPoint => {
            let r = rec.unwrap_or_else(|| panic!("{at}: record lost"));
            assert_eq!(r.state(), State::Processing, "{at}");
            assert_eq!(Some(r.token()), token, "{at}");
            match r.recovery_point() {
                Some(rp) => assert_eq!(rp, b"step-2", "{at}"),
                None => assert!(acked.is_none(), "{at}: acknowledged recovery point lost"),
            }
        }
        Op::Sweep | Op::Checkpoint | Op::Close => {
            let r = rec.unwrap_or_else(|| panic!("{at}: record lost"));
            assert!(processing_as_before(&r), "{at}: {r:?}");
        }
    }
    if op == Op::Sweep {
        // The setup's records are done, held and target (and the probe's if
        // it was acknowledged); the sweep's batch is all there or not at all.
        let kept = 3 + u64::from(probe.is_some());
        let len = store.len().unwrap();
        match acked {
            Some(Answer::Swept(n)) => {
                assert_eq!(*n, OLD, "{at}");
                assert_eq!(len, kept, "{at}");
            }
            Some(a) => panic!("{at}: {a:?}"),
            None => assert!(
                len == kept || len == kept + OLD as u64,
                "{at}: {len} records"
            ),
        }
    }
}

/// Scenarios 4 and 12 on the reopened store: a claim on the operation's key
/// replays a whole outcome, or answers InProgress until the lease lapses and
/// then Acquired; and every record, whatever the crash left, has an expiry
/// index entry (a sweep past retention evicts every one of them).
fn check_scenarios(store: &Store, clock: &ManualClock, s: &Setup, op: Op, at: &str) {
    if let Some(r) = store.get(&s.target).unwrap() {
        if r.state() == State::Succeeded {
            assert!(r.result().is_some(), "{at}: Succeeded without its result");
        }
        assert!(r.lease_until_ms() > 0, "{at}: no lease deadline: {r:?}");
        assert!(r.expires_ms() >= r.lease_until_ms(), "{at}: {r:?}");
    }
    match store.claim(&s.target, &fp(), &ClaimOptions::new()).unwrap() {
        ClaimOutcome::Replay(r) => assert!(
            r.result() == Some(&result_of(op)[..]) || r.failure() == Some(&b"failure"[..]),
            "{at}: replayed {r:?}"
        ),
        ClaimOutcome::InProgress { lease_until_ms, .. } => {
            clock.set_ms(lease_until_ms + 1);
            match store.claim(&s.target, &fp(), &ClaimOptions::new()).unwrap() {
                ClaimOutcome::Acquired(_) => {}
                other => panic!("{at}: after the lease lapsed: {other:?}"),
            }
        }
        ClaimOutcome::Acquired(_) => {}
    }
    // Scenario 12 for every key.
    check_all_expire(store, clock, at);
}

/// After a failed sync the store refuses writes until reopened
/// (guarantee 6); the store does so after any failed storage call (as
/// `LogFile` documents), and so does this check. Returns the probe's lease
/// if a write was acknowledged.
fn probe_writes(store: &Store, fired: Option<(Target, Call)>, at: &str) -> Option<Lease> {
    let r = store.claim(&key("probe"), &fp(), &ClaimOptions::new());
    if fired.is_some() {
        assert!(
            matches!(r, Err(Error::Poisoned { .. } | Error::Storage(_))),
            "{at}: a write after a failed storage call answered {r:?}"
        );
        let again = store.claim(&key("probe-2"), &fp(), &ClaimOptions::new());
        assert!(
            matches!(again, Err(Error::Poisoned { .. })),
            "{at}: a second write after a failed storage call answered {again:?}"
        );
        return None;
    }
    match r {
        Ok(ClaimOutcome::Acquired(l)) => Some(l),
        Ok(other) => panic!("{at}: probe {other:?}"),
        Err(e) => {
            assert_typed(at, &e);
            None
        }
    }
}

/// Acknowledged before the operation, or by it: must survive any crash.
fn check_setup(store: &Store, s: &Setup, probe: Option<&Lease>, at: &str) {
    let done = store.get(&s.done).unwrap();
    assert_eq!(
        done.as_ref().and_then(|r| r.result()),
        Some(&b"done"[..]),
        "{at}: {done:?}"
    );
    let held = store.get(s.held.key()).unwrap();
    assert_eq!(held.map(|r| r.token()), Some(s.held.token()), "{at}");
    if let Some(p) = probe {
        let r = store.get(p.key()).unwrap();
        assert_eq!(r.map(|r| r.token()), Some(p.token()), "{at}: probe lost");
    }
}

/// One fault point of one operation. Returns whether the fault fired.
fn one_point(op: Op, target: Target, call: Call, n: u64) -> bool {
    let at = format!("{op:?} with {target:?} {call:?} #{n} failing");
    let rig = Rig::new();
    let store = Arc::new(rig.open().unwrap());
    let s = Arc::new(setup(&store, &rig.clock, op));

    rig.plan.arm(target, call, n);
    if op == Op::Close {
        return close_point(rig, store, &s, &at);
    }
    let answer = {
        let (store, s) = (store.clone(), s.clone());
        timed(&at, move || run(&store, &s, op))
    };
    // Let the writer's idle index commit and the syncer run while armed.
    std::thread::sleep(Duration::from_millis(3));
    if let Err(e) = &answer {
        assert_typed(&at, e);
    }
    let fired = rig.plan.disarm();
    let probe = {
        let (store, at2) = (store.clone(), at.clone());
        timed(&at, move || probe_writes(&store, fired, &at2))
    };

    // The power cut: only what was synced survives. The old store is then
    // dropped (its closing checkpoint writes to storage nobody reads).
    let cut = rig.power_cut();
    timed(&at, move || drop(store));
    let reopened = cut.open().unwrap_or_else(|e| panic!("{at}: reopen: {e}"));
    let acked = answer.ok();
    check_setup(&reopened, &s, probe.as_ref(), &at);
    check_target(&reopened, &s, op, acked.as_ref(), probe.as_ref(), &at);
    check_scenarios(&reopened, &cut.clock, &s, op, &at);
    fired.is_some()
}

/// The fault point of one_point for closing: the store is dropped (no
/// answer to check); then both what the storage holds as the process left
/// it and what a power cut leaves must reopen with everything acknowledged.
fn close_point(rig: Rig, store: Arc<Store>, s: &Setup, at: &str) -> bool {
    timed(at, move || drop(store));
    let fired = rig.plan.disarm();
    let cut = rig.power_cut();
    let as_left = Rig {
        plan: Arc::default(),
        ..rig
    };
    for (what, rig) in [("as left", as_left), ("power cut", cut)] {
        let at = format!("{at}, reopened {what}");
        let reopened = rig.open().unwrap_or_else(|e| panic!("{at}: {e}"));
        check_setup(&reopened, s, None, &at);
        check_target(&reopened, s, Op::Close, None, None, &at);
        check_scenarios(&reopened, &rig.clock, s, Op::Close, &at);
    }
    fired.is_some()
}

/// Runs `op` with each fault kind at every N until the operation runs past
/// all its calls of that kind; returns the fault points per kind.
fn every_point(op: Op) -> HashMap<(Target, Call), u64> {
    let mut points = HashMap::new();
    for (target, call) in FAULT_KINDS {
        let mut n = 0;
        loop {
            let mut fired = false;
            for _ in 0..repeat() {
                fired |= one_point(op, target, call, n);
            }
            if !fired {
                break;
            }
            n += 1;
            assert!(n < 10_000, "{op:?}: no end to {target:?} {call:?} calls");
        }
        points.insert((target, call), n);
    }
    eprintln!("{op:?}: fault points {points:?}");
    points
}

macro_rules! op_test {
    ($name:ident, $op:expr) => {
        #[test]
        fn $name() {
            let points = every_point($op);
            // Every operation here makes a durable write: it must reach a
            // write and a sync of some file.
            let of = |call| points[&(Target::Index, call)] + points[&(Target::Log, call)];
            assert!(of(Call::Write) > 0, "{points:?}");
            assert!(of(Call::Sync) > 0, "{points:?}");
        }
    };
}

op_test!(claim_survives_a_fault_at_every_storage_call, Op::Claim);
op_test!(
    complete_survives_a_fault_at_every_storage_call,
    Op::Complete
);
op_test!(fail_survives_a_fault_at_every_storage_call, Op::Fail);
op_test!(release_survives_a_fault_at_every_storage_call, Op::Release);
op_test!(extend_survives_a_fault_at_every_storage_call, Op::Extend);
op_test!(
    set_recovery_point_survives_a_fault_at_every_storage_call,
    Op::SetRecoveryPoint
);
op_test!(resolve_survives_a_fault_at_every_storage_call, Op::Resolve);
op_test!(sweep_survives_a_fault_at_every_storage_call, Op::Sweep);
op_test!(
    checkpoint_survives_a_fault_at_every_storage_call,
    Op::Checkpoint
);
op_test!(close_survives_a_fault_at_every_storage_call, Op::Close);

/// The checkpoint the writer makes by itself when the log is full.
#[test]
fn a_completion_into_a_full_log_survives_a_fault_at_every_storage_call() {
    let points = every_point(Op::CompleteWhenLogFull);
    // The completion went to the index in a checkpoint.
    assert!(points[&(Target::Index, Call::Write)] > 0, "{points:?}");
    assert!(points[&(Target::Index, Call::Sync)] > 0, "{points:?}");
}

/// DESIGN.md guarantee 6 at close (issue 10, point 7): after a failed log
/// fsync, dropping the store writes no checkpoint (and lets redb make no
/// commit durable) holding the change whose caller got the error. After a
/// power cut the acknowledged change is there and the failed one is not;
/// reopening the files as the process left them recovers from the log.
#[test]
fn a_poisoned_store_closes_without_checkpointing_the_failed_change() {
    let rig = Rig::new();
    let store = rig.open().unwrap();
    let acked = acquire(&store, &key("acked"));
    rig.plan.arm(Target::Log, Call::Sync, 0);
    let failed = store.claim(&key("failed"), &fp(), &ClaimOptions::new());
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(rig.plan.disarm(), Some((Target::Log, Call::Sync)));
    assert!(matches!(
        store.claim(&key("later"), &fp(), &ClaimOptions::new()),
        Err(Error::Poisoned { .. })
    ));
    let cut_before_close = rig.power_cut();
    drop(store);
    let cut = rig.power_cut();
    for (what, rig) in [
        ("power cut before close", cut_before_close),
        ("power cut after close", cut),
    ] {
        let reopened = rig.open().unwrap_or_else(|e| panic!("{what}: {e}"));
        let got = reopened.get(&key("acked")).unwrap();
        assert_eq!(got.map(|r| r.token()), Some(acked.token()), "{what}");
        assert!(
            reopened.get(&key("failed")).unwrap().is_none(),
            "{what}: the change whose caller got an error was made durable"
        );
        assert!(reopened.get(&key("later")).unwrap().is_none(), "{what}");
        // The reopened store works.
        acquire(&reopened, &key("after"));
    }
    let as_left = Rig {
        plan: Arc::default(),
        ..rig
    };
    let reopened = as_left.open().unwrap();
    let got = reopened.get(&key("acked")).unwrap();
    assert_eq!(got.map(|r| r.token()), Some(acked.token()));
    acquire(&reopened, &key("after"));
}

/// `claim_many`'s outer `Storage` error after the log's fsync failed: the
/// batch was written to the log, so it may be applied, as a whole. Reopened
/// from the file as the failed fsync left it (the page cache wrote it out
/// after all), every key of the batch is held by a lease whose token the
/// caller never received, and a later claim finds that out: in progress
/// until the lease lapses, acquired after. After a power cut that kept
/// only synced bytes, none is there, and a claim acquires each at once.
#[test]
fn claim_many_after_a_failed_fsync_may_be_applied_and_a_later_claim_finds_out() {
    let rig = Rig::new();
    let store = rig.open().unwrap();
    acquire(&store, &key("before"));
    let batch: Vec<(Key, Fingerprint)> = (0..3).map(|i| (key(&format!("b{i}")), fp())).collect();
    rig.plan.arm(Target::Log, Call::Sync, 0);
    match store.claim_many(&batch, &ClaimOptions::new()) {
        Err(Error::Storage(_)) => {}
        other => panic!("expected the batch's Storage error, got {other:?}"),
    }
    assert_eq!(rig.plan.disarm(), Some((Target::Log, Call::Sync)));
    assert!(matches!(
        store.claim(&key("later"), &fp(), &ClaimOptions::new()),
        Err(Error::Poisoned { .. })
    ));
    let cut = rig.power_cut();
    drop(store);
    let as_left = Rig {
        plan: Arc::default(),
        ..rig
    };
    let reopened = as_left.open().unwrap();
    for (k, _) in &batch {
        let record = reopened.get(k).unwrap();
        assert_eq!(
            record.as_ref().map(|r| r.state()),
            Some(State::Processing),
            "{k}: the written batch was not applied"
        );
        match reopened.claim(k, &fp(), &ClaimOptions::new()).unwrap() {
            ClaimOutcome::InProgress { .. } => {}
            other => panic!("{k}: expected InProgress, got {other:?}"),
        }
    }
    as_left.clock.advance(LEASE);
    for (k, _) in &batch {
        acquire(&reopened, k);
    }
    drop(reopened);
    let reopened = cut.open().unwrap();
    for (k, _) in &batch {
        assert!(reopened.get(k).unwrap().is_none(), "{k}");
        acquire(&reopened, k);
    }
}

/// `stats` on a poisoned store refuses, as `scan`, `export` and `verify`
/// do: its index may hold a change that never became durable.
#[test]
fn stats_on_a_poisoned_store_is_refused() {
    let rig = Rig::new();
    let store = rig.open().unwrap();
    acquire(&store, &key("acked"));
    rig.plan.arm(Target::Log, Call::Sync, 0);
    assert!(
        store
            .claim(&key("failed"), &fp(), &ClaimOptions::new())
            .is_err()
    );
    rig.plan.disarm();
    let stats = store.stats();
    assert!(matches!(stats, Err(Error::Poisoned { .. })), "{stats:?}");
    assert!(matches!(
        store.scan(&idemstore::Filter::new()),
        Err(Error::Poisoned { .. })
    ));
    drop(store);
    let reopened = rig.power_cut().open().unwrap();
    let stats = reopened.stats().unwrap();
    assert_eq!(stats.records.processing, 1);
}

/// Every refusal of a poisoned store names the failure that poisoned it
/// (the first failed durable write's own error: on a full disk, the
/// operating system's "No space left on device"; here the injected one),
/// not only the call that met it: an operator reading a later caller's
/// error, or an import's, learns the cause and what to do.
#[test]
fn every_refusal_names_the_failure_that_poisoned_the_store() {
    let rig = Rig::new();
    let store = rig.open().unwrap();
    acquire(&store, &key("acked"));
    rig.plan.arm(Target::Log, Call::Sync, 0);
    let failed = store.claim(&key("failed"), &fp(), &ClaimOptions::new());
    assert_eq!(rig.plan.disarm(), Some((Target::Log, Call::Sync)));
    let injected = "injected Sync failure on the Log file";
    match &failed {
        Err(Error::Storage(detail)) => assert!(detail.contains(injected), "{detail}"),
        other => panic!("expected the failed write's Storage error, got {other:?}"),
    }
    let refusals = [
        (
            "claim",
            store
                .claim(&key("later"), &fp(), &ClaimOptions::new())
                .err(),
        ),
        ("stats", store.stats().err()),
        ("flush", store.flush().err()),
        ("checkpoint", store.checkpoint().err()),
    ];
    for (what, refused) in refusals {
        match refused {
            Some(Error::Poisoned { cause }) => {
                assert!(cause.contains(injected), "{what}: {cause}");
                assert!(cause.contains("reopen the store"), "{what}: {cause}");
            }
            other => panic!("{what}: expected Poisoned, got {other:?}"),
        }
    }
    let shown = store
        .claim(&key("later"), &fp(), &ClaimOptions::new())
        .unwrap_err()
        .to_string();
    assert!(
        shown.starts_with("store refuses writes: a durable write failed")
            && shown.contains(injected),
        "{shown}"
    );
}

/// What one fault point of `open` found.
struct OpenPoint {
    fired: bool,
    /// The store was being created, its creation failed, and after the
    /// power cut the storage left does not open again (the error).
    unopenable: Option<String>,
}

/// One fault point of `open`: on storage a crash left (`crashed`, with log
/// frames to replay), or on empty storage (creating the store).
fn one_open_point(crashed: bool, target: Target, call: Call, n: u64) -> OpenPoint {
    let at = format!("open (crashed: {crashed}) with {target:?} {call:?} #{n} failing");
    let first = Rig::new();
    let (before, rig) = if crashed {
        let store = first.open().unwrap();
        let mut s = setup(&store, &first.clock, Op::Complete);
        store
            .complete(s.lease.as_ref().unwrap(), b"result")
            .unwrap();
        s.lease = None;
        // The crash: the log holds frames the index has not checkpointed.
        let cut = first.power_cut();
        drop(store);
        (Some(s), cut)
    } else {
        (None, first)
    };

    rig.plan.arm(target, call, n);
    let opened = {
        let (disk, log, plan, clock) = (
            rig.disk.clone(),
            rig.log.clone(),
            rig.plan.clone(),
            rig.clock.clone(),
        );
        timed(&at, move || {
            Rig {
                disk,
                log,
                plan,
                clock,
            }
            .open()
        })
    };
    std::thread::sleep(Duration::from_millis(3));
    let fired = rig.plan.disarm();
    let first_failed = opened.is_err();
    let probe = match opened {
        Ok(store) => {
            let store = Arc::new(store);
            let probe = {
                let (store, at2) = (store.clone(), at.clone());
                timed(&at, move || probe_writes(&store, fired, &at2))
            };
            let cut = rig.power_cut();
            timed(&at, move || drop(store));
            (probe, cut)
        }
        Err(e) => {
            assert_typed(&at, &e);
            (None, rig.power_cut())
        }
    };
    let (probe, cut) = probe;
    let reopened = match cut.open() {
        Ok(store) => store,
        Err(e) if !crashed && first_failed => {
            // Nothing was ever acknowledged on this storage.
            assert_typed(&at, &e);
            return OpenPoint {
                fired: fired.is_some(),
                unopenable: Some(format!("{at}: {e}")),
            };
        }
        Err(e) => panic!("{at}: reopen: {e}"),
    };
    if let Some(p) = &probe {
        let r = reopened.get(p.key()).unwrap();
        assert_eq!(r.map(|r| r.token()), Some(p.token()), "{at}: probe lost");
    }
    if let Some(s) = &before {
        check_setup(&reopened, s, probe.as_ref(), &at);
        let r = reopened.get(&s.target).unwrap();
        assert_eq!(
            r.as_ref().and_then(|r| r.result()),
            Some(&b"result"[..]),
            "{at}: {r:?}"
        );
        check_scenarios(&reopened, &cut.clock, s, Op::Complete, &at);
    }
    OpenPoint {
        fired: fired.is_some(),
        unopenable: None,
    }
}

/// Every fault point of `open`, and the points after which the storage a
/// power cut left does not open again.
fn every_open_point(crashed: bool) -> (HashMap<(Target, Call), u64>, Vec<String>) {
    let mut points = HashMap::new();
    let mut unopenable = Vec::new();
    for (target, call) in FAULT_KINDS {
        let mut n = 0;
        loop {
            let mut fired = false;
            for _ in 0..repeat() {
                let point = one_open_point(crashed, target, call, n);
                fired |= point.fired;
                unopenable.extend(point.unopenable);
            }
            if !fired {
                break;
            }
            n += 1;
            assert!(n < 10_000, "open: no end to {target:?} {call:?} calls");
        }
        points.insert((target, call), n);
    }
    eprintln!("open (crashed: {crashed}): fault points {points:?}");
    for u in &unopenable {
        eprintln!("does not open again: {u}");
    }
    (points, unopenable)
}

#[test]
fn open_after_a_crash_survives_a_fault_at_every_storage_call() {
    let (points, unopenable) = every_open_point(true);
    assert!(points[&(Target::Index, Call::Write)] > 0, "{points:?}");
    assert!(points[&(Target::Log, Call::Len)] > 0, "{points:?}");
    assert!(unopenable.is_empty());
}

/// A fault while creating a store: the open fails with a typed error or
/// succeeds, and what it acknowledged survives a power cut. Storage whose
/// creation failed may refuse to open again (with a typed error): see
/// `a_store_whose_creation_was_cut_opens_again`.
#[test]
fn creating_a_store_survives_a_fault_at_every_storage_call() {
    let (points, _) = every_open_point(false);
    assert!(points[&(Target::Index, Call::Write)] > 0, "{points:?}");
    assert!(points[&(Target::Log, Call::Write)] > 0, "{points:?}");
}

/// Fails by design on custom backends: a power cut while redb creates the
/// database in a backend, after its first sync and before its magic number
/// is durable (here: the second write or sync of the creation fails, then
/// the power is cut), leaves storage without redb's magic number, which
/// redb (and so the store) refuses for good ("Not a redb database")
/// although the store never acknowledged anything on it. A store *file* is
/// created atomically under a temporary name and linked into place
/// (`tests/creation.rs`), but a backend has no names to link:
/// `Store::open_with_backend` documents the rule backends get (create in
/// place; storage whose first open failed may be discarded, since nothing
/// was acknowledged on it). Run with `--ignored`.
#[test]
#[ignore = "custom backends are created in place: a cut creation may leave storage that never opens (Store::open_with_backend)"]
fn a_store_whose_creation_was_cut_opens_again() {
    let (_, unopenable) = every_open_point(false);
    assert!(unopenable.is_empty(), "{unopenable:#?}");
}

// ---------------------------------------------------------------------------
// Group commit under power loss at every point of the log.

/// The index under the batch test: each sync snapshots its durable image
/// with the number of log writes made by then, so that a cut after any log
/// write can be paired with the index as it was durable at that moment.
#[derive(Clone)]
struct TimelineDisk {
    inner: SimDisk,
    log: SimLog,
    snapshots: Arc<Mutex<Vec<Snapshot>>>,
}

/// The index's durable bytes at one of its syncs, with the number of log
/// writes made by then.
type Snapshot = (usize, Vec<u8>);

/// A point in the batch test's history: (log writes, index syncs) by then.
type Moment = (usize, usize);

impl TimelineDisk {
    /// Now, as (log writes, index syncs) so far. The index's snapshots are
    /// taken under their lock, so a sync is either counted with its
    /// snapshot or not at all.
    fn moment(&self) -> Moment {
        let snapshots = self.snapshots.lock().unwrap();
        (self.log.journal.lock().unwrap().len(), snapshots.len())
    }
}

impl std::fmt::Debug for TimelineDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TimelineDisk")
    }
}

impl StorageBackend for TimelineDisk {
    fn len(&self) -> Result<u64, io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        let mut snapshots = self.snapshots.lock().unwrap();
        self.inner.sync_data()?;
        let writes = self.log.journal.lock().unwrap().len();
        let durable = self.inner.0.image().durable.clone();
        snapshots.push((writes, durable));
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.inner.write(offset, data)
    }
}

const THREADS: usize = 16;
const ROUNDS: usize = 3;

fn batch_key(round: usize, thread: usize) -> Key {
    key(&format!("bk-{round}-{thread:02}"))
}

/// The result a batch test key is completed with: it names the key, so a
/// log frame holding it is the key's completion, and is long enough that
/// the workload fills the log and makes it wrap (a checkpoint).
fn batch_result(k: &Key) -> Vec<u8> {
    let mut r = format!("result:{}:", k.id()).into_bytes();
    r.resize(2000, b'x');
    r
}

/// Many threads claim and complete keys at once, so that requests share
/// group-commit batches (one log frame each). Then for every prefix of the
/// log's writes, and every prefix plus the first half of the next write (a
/// torn frame), with the index as it was durable then: the store reopens;
/// every change acknowledged by then is there; each batch is all there or
/// not at all; and the batches there are a prefix of those written.
#[test]
fn a_power_cut_after_any_log_write_keeps_whole_batches() {
    let log = SimLog::default();
    let disk = TimelineDisk {
        inner: SimDisk::default(),
        log: log.clone(),
        snapshots: Arc::default(),
    };
    let clock = ManualClock::new(START_MS);
    let store =
        Store::open_with_backend("batch.redb", disk.clone(), log.clone(), config(&clock)).unwrap();
    let start = log.journal.lock().unwrap().len();
    disk.snapshots
        .lock()
        .unwrap()
        .push((start, disk.inner.0.image().durable.clone()));

    // (key, token, the moment the claim / the completion returned)
    let mut acks: Vec<(Key, u64, Moment, Moment)> = Vec::new();
    log.slow_sync.store(true, Ordering::SeqCst);
    for round in 0..ROUNDS * repeat() {
        let barrier = std::sync::Barrier::new(THREADS);
        let acked: Vec<(Key, u64, Moment, Moment)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (store, disk, barrier) = (&store, &disk, &barrier);
                    s.spawn(move || {
                        let k = batch_key(round, t);
                        barrier.wait();
                        let lease = acquire(store, &k);
                        let claimed = disk.moment();
                        barrier.wait();
                        store.complete(&lease, &batch_result(&k)).unwrap();
                        let completed = disk.moment();
                        (k, lease.token(), claimed, completed)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        acks.extend(acked);
    }
    log.slow_sync.store(false, Ordering::SeqCst);
    let journal = log.journal.lock().unwrap().clone();
    let snapshots = disk.snapshots.lock().unwrap().clone();
    let now = clock.now_ms();
    drop(store);

    // Each frame: the log write holding it, and (key, level) for the changes
    // in it: level 1 a claim, level 2 a completion. A batch that did not fit
    // in the log went to the index in a checkpoint instead.
    let contains = |data: &[u8], what: &[u8]| data.windows(what.len()).any(|w| w == what);
    let mut frames: Vec<(usize, Vec<(Key, usize)>)> = Vec::new();
    let mut wrapped = false;
    let mut last_offset = 0;
    for (i, (offset, data)) in journal.iter().enumerate().skip(start) {
        let mut changes = Vec::new();
        for (k, ..) in &acks {
            if contains(data, format!("result:{}:", k.id()).as_bytes()) {
                changes.push((k.clone(), 2));
            } else if contains(data, k.id().as_bytes()) {
                changes.push((k.clone(), 1));
            }
        }
        if !changes.is_empty() {
            wrapped |= *offset < last_offset;
            last_offset = *offset;
            frames.push((i, changes));
        }
    }
    assert!(
        wrapped,
        "the log never wrapped: the test misses checkpoints"
    );
    let widest = frames.iter().map(|(_, c)| c.len()).max().unwrap();
    assert!(
        widest > 1,
        "no two requests shared a batch: the test shows nothing"
    );

    if std::env::var_os("FAULTS_DUMP").is_some() {
        for (i, (o, d)) in journal.iter().enumerate() {
            eprintln!(
                "write {i}: offset {o} len {} head {:?}",
                d.len(),
                &d[..d.len().min(12)]
            );
        }
        for (j, (w, _)) in snapshots.iter().enumerate() {
            eprintln!("sync {j} at {w} writes");
        }
        for (k, t, c, d) in &acks {
            eprintln!("{k} token {t} claimed {c:?} completed {d:?}");
        }
    }
    let mut cuts = 0;
    for cut in start..=journal.len() {
        for torn in [false, true] {
            if torn && cut == journal.len() {
                continue;
            }
            let at = format!("cut after log write {cut} (torn next: {torn})");
            let mut image = Image::default();
            for (offset, data) in &journal[..cut] {
                image.write(*offset, data);
            }
            if torn {
                let (offset, data) = &journal[cut];
                image.write(*offset, &data[..data.len() / 2]);
            }
            // The index as durable then: each sync made at this point of
            // the log (a checkpoint syncs more than once), else the last one
            // before it.
            // A torn write started after every sync made before it.
            let mut indexes: Vec<usize> = (0..snapshots.len())
                .filter(|&j| snapshots[j].0 == cut && !torn)
                .collect();
            if indexes.is_empty() {
                indexes.extend((0..snapshots.len()).rev().find(|&j| snapshots[j].0 <= cut));
            }
            for j in indexes {
                cuts += 1;
                let index = &snapshots[j].1;
                // Acknowledged by now: before this log write and this sync.
                let by_now = |(writes, syncs): Moment| writes <= cut && syncs <= j + 1;
                let at = format!("{at}, index as of its sync {j}");
                let rig = Rig {
                    disk: SimDisk(SimFile::from_bytes(index.clone())),
                    log: SimLog {
                        file: SimFile::from_bytes(image.live.clone()),
                        ..SimLog::default()
                    },
                    plan: Arc::default(),
                    clock: ManualClock::new(now),
                };
                let store = rig.open().unwrap_or_else(|e| panic!("{at}: reopen: {e}"));
                let level = |k: &Key| match store.get(k).unwrap() {
                    None => 0,
                    Some(r) if r.state() == State::Processing => 1,
                    Some(r) => {
                        assert_eq!(r.state(), State::Succeeded, "{at}: {r:?}");
                        assert_eq!(r.result(), Some(&batch_result(k)[..]), "{at}");
                        2
                    }
                };
                for (k, token, claimed, completed) in &acks {
                    let l = level(k);
                    if by_now(*claimed) {
                        assert!(l >= 1, "{at}: acknowledged claim of {k} lost");
                        assert_eq!(store.get(k).unwrap().unwrap().token(), *token, "{at}");
                    }
                    if by_now(*completed) {
                        assert_eq!(l, 2, "{at}: acknowledged completion of {k} lost");
                    }
                }
                let applied: Vec<bool> = frames
                    .iter()
                    .map(|(i, changes)| {
                        let there: Vec<bool> =
                            changes.iter().map(|(k, lv)| level(k) >= *lv).collect();
                        assert!(
                            there.iter().all(|&t| t == there[0]),
                            "{at}: the batch in log write {i} is half there: {changes:?} {there:?}"
                        );
                        there[0]
                    })
                    .collect();
                assert!(
                    applied.windows(2).all(|w| w[0] || !w[1]),
                    "{at}: a batch is there while an earlier one is not: {applied:?}"
                );
                if cut == journal.len() {
                    check_all_expire(&store, &rig.clock, &at);
                }
            }
        }
    }
    eprintln!(
        "batches: {} frames, up to {widest} changes in one, {cuts} cut images",
        frames.len()
    );
}

/// Scenario 12 for every record: past every retention, a sweep evicts them
/// all, which it can only do through their expiry index entries.
fn check_all_expire(store: &Store, clock: &ManualClock, at: &str) {
    clock.advance(RETENTION * 2);
    loop {
        if store.sweep(1000).unwrap() == 0 {
            break;
        }
    }
    assert_eq!(
        store.len().unwrap(),
        0,
        "{at}: a record without an expiry index entry"
    );
}

/// The index wrapper forwards redb's file-lock methods: two stores on one
/// real file through it are refused as they are without it.
#[test]
fn the_index_wrapper_forwards_the_file_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locked.redb");
    let backend = || {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .unwrap();
        FaultyBackend {
            inner: redb::backends::FileBackend::new(file).unwrap(),
            plan: Arc::default(),
        }
    };
    let clock = ManualClock::new(START_MS);
    let first =
        Store::open_with_backend(&path, backend(), SimLog::default(), config(&clock)).unwrap();
    let second = Store::open_with_backend(&path, backend(), SimLog::default(), config(&clock));
    assert!(
        matches!(second, Err(Error::AlreadyOpen { .. })),
        "{second:?}"
    );
    drop(first);
    Store::open_with_backend(&path, backend(), SimLog::default(), config(&clock)).unwrap();
}
