//! The durable write path: group commit over the write-ahead log, durability
//! modes, checkpoints, recovery, and failures of the log.
//!
//! Crashes are real where they can be: `sigkill_recovery_keeps_every_acknowledged_change`
//! runs this test binary again as a child process that holds a store on
//! files and is killed with SIGKILL. Power loss is simulated with storage
//! that keeps only what was synced (`SimDisk` under redb, `SimLog` under
//! the log): a crash image is what a power cut would leave.
//!
//! A longer crash loop runs with `IDEMSTORE_SOAK=1` (more children, more
//! operations each).

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader};
use std::path::Path;
use std::pin::pin;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use futures_lite::future::{block_on, poll_once};
use idemstore::{
    ClaimOptions, ClaimOutcome, Config, Durability, Error, Fingerprint, Key, Lease, LogFile,
    ManualClock, Record, State, StorageBackend, Store,
};

// ---------------------------------------------------------------------------
// Simulated storage: what a power cut leaves is what was synced.

/// Writes not yet synced, applied to the durable image on sync.
#[derive(Default)]
struct Image {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// (offset, bytes) written since the last sync; `None` offset = set_len.
    unsynced: Vec<(u64, Vec<u8>, Option<u64>)>,
}

impl Image {
    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if self.live.len() < end {
            self.live.resize(end, 0);
        }
        self.live[offset as usize..end].copy_from_slice(data);
        self.unsynced.push((offset, data.to_vec(), None));
    }
    fn set_len(&mut self, len: u64) {
        self.live.resize(len as usize, 0);
        self.unsynced.push((0, Vec::new(), Some(len)));
    }
    fn sync(&mut self) {
        for (offset, data, len) in self.unsynced.drain(..) {
            match len {
                Some(len) => self.durable.resize(len as usize, 0),
                None => {
                    let end = offset as usize + data.len();
                    if self.durable.len() < end {
                        self.durable.resize(end, 0);
                    }
                    self.durable[offset as usize..end].copy_from_slice(&data);
                }
            }
        }
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
}

/// A redb backend whose power-cut image is its last synced state.
#[derive(Clone, Default)]
struct SimDisk(Arc<Mutex<Image>>);

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimDisk")
    }
}

impl SimDisk {
    fn from_bytes(bytes: Vec<u8>) -> SimDisk {
        SimDisk(Arc::new(Mutex::new(Image {
            live: bytes.clone(),
            durable: bytes,
            unsynced: Vec::new(),
        })))
    }
    /// What survives a power cut now.
    fn power_cut(&self) -> SimDisk {
        SimDisk::from_bytes(self.0.lock().unwrap().durable.clone())
    }
}

impl StorageBackend for SimDisk {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.0.lock().unwrap().live.len() as u64)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.0.lock().unwrap().read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.0.lock().unwrap().set_len(len);
        Ok(())
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.0.lock().unwrap().sync();
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.0.lock().unwrap().write(offset, data);
        Ok(())
    }
}

/// Faults a [`SimLog`] can be told to produce.
#[derive(Default)]
struct Faults {
    /// While set, `write_at` blocks (to hold the writer inside a batch).
    hold_writes: Mutex<bool>,
    released: Condvar,
    /// How many `write_at` calls are blocked right now.
    blocked: AtomicUsize,
    /// Frame writes so far (writes at or after the first frame position).
    frame_writes: AtomicUsize,
    fail_sync: AtomicBool,
    panic_sync: AtomicBool,
    panic_write: AtomicBool,
}

/// The write-ahead log on simulated storage, with fault injection.
#[derive(Clone, Default)]
struct SimLog {
    image: Arc<Mutex<Image>>,
    faults: Arc<Faults>,
}

impl SimLog {
    fn from_bytes(bytes: Vec<u8>) -> SimLog {
        SimLog {
            image: Arc::new(Mutex::new(Image {
                live: bytes.clone(),
                durable: bytes,
                unsynced: Vec::new(),
            })),
            faults: Arc::default(),
        }
    }
    fn power_cut(&self) -> SimLog {
        SimLog::from_bytes(self.durable())
    }
    fn durable(&self) -> Vec<u8> {
        self.image.lock().unwrap().durable.clone()
    }
    fn hold(&self, on: bool) {
        *self.faults.hold_writes.lock().unwrap() = on;
        self.faults.released.notify_all();
    }
    /// Waits until the writer is blocked in `write_at`.
    fn wait_blocked(&self) {
        while self.faults.blocked.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl LogFile for SimLog {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.image.lock().unwrap().read(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if offset >= 4096 && data.starts_with(b"IWF\x01") {
            self.faults.frame_writes.fetch_add(1, Ordering::SeqCst);
            let mut held = self.faults.hold_writes.lock().unwrap();
            if *held {
                self.faults.blocked.fetch_add(1, Ordering::SeqCst);
                while *held {
                    held = self.faults.released.wait(held).unwrap();
                }
                self.faults.blocked.fetch_sub(1, Ordering::SeqCst);
            }
            drop(held);
            assert!(
                !self.faults.panic_write.load(Ordering::SeqCst),
                "injected panic in write_at"
            );
        }
        self.image.lock().unwrap().write(offset, data);
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        assert!(
            !self.faults.panic_sync.load(Ordering::SeqCst),
            "injected panic in sync_data"
        );
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fsync failure"));
        }
        self.image.lock().unwrap().sync();
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.image.lock().unwrap().live.len() as u64)
    }
}

fn config() -> Config {
    Config::new().sweep_interval(None).scrub_rate(None)
}

fn open_sim(disk: &SimDisk, log: &SimLog, config: Config) -> Result<Store, Error> {
    Store::open_with_backend("sim.redb", disk.clone(), log.clone(), config)
}

fn key(id: impl Into<String>) -> Key {
    Key::new("test/write-path", id).unwrap()
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

// ---------------------------------------------------------------------------
// Sync and async forms

#[test]
fn async_forms_match_the_sync_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_with(dir.path().join("s.redb"), config()).unwrap();
    let opts = ClaimOptions::new();
    block_on(async {
        let k = key("async-1");
        let ClaimOutcome::Acquired(lease) = store.claim_async(&k, &fp(), &opts).await.unwrap()
        else {
            panic!("fresh key")
        };
        store
            .set_recovery_point_async(&lease, b"step-1")
            .await
            .unwrap();
        let until = store
            .extend_async(&lease, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(until >= lease.lease_until_ms().unwrap());
        let rec = store.complete_async(&lease, b"done").await.unwrap();
        assert_eq!(rec.result(), Some(&b"done"[..]));
        // A replay through the async form, then through the sync one.
        match store.claim_async(&k, &fp(), &opts).await.unwrap() {
            ClaimOutcome::Replay(r) => assert_eq!(r.result(), Some(&b"done"[..])),
            other => panic!("{other:?}"),
        }

        let k2 = key("async-2");
        let ClaimOutcome::Acquired(l2) = store.claim_async(&k2, &fp(), &opts).await.unwrap() else {
            panic!("fresh key")
        };
        store.fail_async(&l2, b"boom", true).await.unwrap();
        let ClaimOutcome::Acquired(l3) = store.claim_async(&k2, &fp(), &opts).await.unwrap() else {
            panic!("retryable failure is acquired again")
        };
        assert!(l3.token() > l2.token());
        store.release_async(l3).await.unwrap();
        assert!(store.get(&k2).unwrap().is_none());
    });
    match store.claim(&key("async-1"), &fp(), &opts).unwrap() {
        ClaimOutcome::Replay(r) => assert_eq!(r.recovery_point(), Some(&b"step-1"[..])),
        other => panic!("{other:?}"),
    }
}

#[test]
fn many_async_callers_on_one_thread_share_batches() {
    // 32 claims are started on one thread before any is awaited to its end:
    // they are queued together and all answered, each with its own token.
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    let opts = ClaimOptions::new();
    let keys: Vec<Key> = (0..32).map(|i| key(format!("many-{i}"))).collect();
    let fp = fp();
    log.hold(true);
    let first = key("many-first");
    std::thread::scope(|s| {
        s.spawn(|| acquire(&store, &first));
        log.wait_blocked();
        let mut futs: Vec<_> = keys
            .iter()
            .map(|k| Box::pin(store.claim_async(k, &fp, &opts)))
            .collect();
        for f in &mut futs {
            assert!(
                block_on(poll_once(f.as_mut())).is_none(),
                "answered before durable"
            );
        }
        let before = log.faults.frame_writes.load(Ordering::SeqCst);
        log.hold(false);
        let mut tokens = Vec::new();
        for f in futs {
            match block_on(f).unwrap() {
                ClaimOutcome::Acquired(l) => tokens.push(l.token()),
                other => panic!("{other:?}"),
            }
        }
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 32);
        // The 32 queued claims were decided as one batch: one frame.
        assert_eq!(log.faults.frame_writes.load(Ordering::SeqCst), before + 1);
    });
}

#[test]
fn a_batch_is_decided_in_arrival_order() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    let opts = ClaimOptions::new();
    let k = key("ordered");
    let other = key("ordered-other");
    let fp1 = fp();
    log.hold(true);
    std::thread::scope(|s| {
        // Hold the writer inside a first batch so that the next requests
        // queue up and form one batch.
        s.spawn(|| acquire(&store, &key("ordered-first")));
        log.wait_blocked();
        let mut a = pin!(store.claim_async(&k, &fp1, &opts));
        let mut b = pin!(store.claim_async(&k, &fp1, &opts));
        let fp2 = Fingerprint::of(b"another payload");
        let mut c = pin!(store.claim_async(&k, &fp2, &opts));
        let mut d = pin!(store.claim_async(&other, &fp1, &opts));
        assert!(block_on(poll_once(a.as_mut())).is_none());
        assert!(block_on(poll_once(b.as_mut())).is_none());
        assert!(block_on(poll_once(c.as_mut())).is_none());
        assert!(block_on(poll_once(d.as_mut())).is_none());
        let before = log.faults.frame_writes.load(Ordering::SeqCst);
        log.hold(false);
        let a = block_on(a).unwrap();
        let b = block_on(b).unwrap();
        let c = block_on(c);
        let d = block_on(d).unwrap();
        // The later requests saw the earlier one of the same batch.
        let ClaimOutcome::Acquired(lease) = a else {
            panic!("first claim: {a:?}")
        };
        match b {
            ClaimOutcome::InProgress { lease_until_ms, .. } => {
                assert_eq!(Some(lease_until_ms), lease.lease_until_ms());
            }
            other => panic!("second claim of the batch: {other:?}"),
        }
        assert!(matches!(c, Err(Error::FingerprintMismatch { .. })), "{c:?}");
        assert!(matches!(d, ClaimOutcome::Acquired(_)));
        // One batch, one frame, holding both acquisitions.
        assert_eq!(log.faults.frame_writes.load(Ordering::SeqCst), before + 1);
    });
}

// ---------------------------------------------------------------------------
// Crashes and power loss

const CHILD_ENV: &str = "IDEMSTORE_WAL_CHILD_DIR";

fn soak() -> bool {
    std::env::var_os("IDEMSTORE_SOAK").is_some()
}

/// The child of `sigkill_recovery_keeps_every_acknowledged_change`: claims
/// and completes keys from several threads and prints each acknowledged
/// change, until it is killed.
#[test]
#[ignore = "runs only as the child process of sigkill_recovery_keeps_every_acknowledged_change"]
fn sigkill_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let store = Arc::new(
        Store::open_with(
            Path::new(&dir).join("crash.redb"),
            config().max_log_bytes(256 * 1024),
        )
        .unwrap(),
    );
    let round = std::env::var("IDEMSTORE_WAL_CHILD_ROUND").unwrap_or_default();
    let out = Arc::new(Mutex::new(io::stdout()));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (store, out, round) = (store.clone(), out.clone(), round.clone());
            std::thread::spawn(move || {
                use std::io::Write;
                for i in 0.. {
                    let id = format!("r{round}-t{t}-{i}");
                    let k = key(&id);
                    let lease = acquire(&store, &k);
                    writeln!(out.lock().unwrap(), "ACK claim {id} {}", lease.token()).unwrap();
                    if i % 3 != 2 {
                        store.complete(&lease, id.as_bytes()).unwrap();
                        writeln!(out.lock().unwrap(), "ACK complete {id}").unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn sigkill_recovery_keeps_every_acknowledged_change() {
    let dir = tempfile::tempdir().unwrap();
    let rounds = if soak() { 20 } else { 3 };
    let acks_per_round = if soak() { 20_000 } else { 1_500 };
    let mut claimed: HashMap<String, u64> = HashMap::new();
    let mut completed: Vec<String> = Vec::new();
    for round in 0..rounds {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sigkill_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .env("IDEMSTORE_WAL_CHILD_ROUND", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut acks = 0;
        while acks < acks_per_round {
            let Some(line) = lines.next() else {
                panic!("child ended early: {:?}", child.wait());
            };
            let line = line.unwrap();
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["ACK", "claim", id, token] => {
                    claimed.insert((*id).to_string(), token.parse().unwrap());
                }
                ["ACK", "complete", id] => completed.push((*id).to_string()),
                _ => continue,
            }
            acks += 1;
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Lines the child printed before it died were acknowledged too.
        for line in lines {
            let line = line.unwrap();
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["ACK", "claim", id, token] => {
                    claimed.insert((*id).to_string(), token.parse().unwrap());
                }
                ["ACK", "complete", id] => completed.push((*id).to_string()),
                _ => {}
            }
        }

        let store = Store::open_with(dir.path().join("crash.redb"), config()).unwrap();
        for id in &completed {
            let rec = store
                .get(&key(id))
                .unwrap()
                .unwrap_or_else(|| panic!("{id} lost"));
            assert_eq!(rec.state(), State::Succeeded, "{id}");
            assert_eq!(rec.result(), Some(id.as_bytes()));
        }
        let max_token = claimed.values().copied().max().unwrap_or(0);
        for (id, token) in &claimed {
            let rec = store
                .get(&key(id))
                .unwrap()
                .unwrap_or_else(|| panic!("{id} lost"));
            assert_eq!(rec.token(), *token, "{id}");
        }
        // The token counter never goes back.
        let fresh = acquire(&store, &key(format!("after-round-{round}")));
        assert!(fresh.token() > max_token);
        drop(store);
    }
}

#[test]
fn power_loss_keeps_every_acknowledged_change_in_immediate_mode() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    // A small log: the run wraps it many times (checkpoint, then reuse).
    let store = open_sim(&disk, &log, config().max_log_bytes(64 * 1024)).unwrap();
    let mut leases = Vec::new();
    for i in 0..600 {
        let k = key(format!("pl-{i}"));
        let lease = acquire(&store, &k);
        if i % 2 == 0 {
            store.complete(&lease, format!("r{i}").as_bytes()).unwrap();
        } else {
            leases.push(lease);
        }
    }
    let (disk2, log2) = (disk.power_cut(), log.power_cut());
    drop(store);
    let store = open_sim(&disk2, &log2, config()).unwrap();
    for i in (0..600).step_by(2) {
        let rec = store.get(&key(format!("pl-{i}"))).unwrap().unwrap();
        assert_eq!(rec.result(), Some(format!("r{i}").as_bytes()));
    }
    for lease in &leases {
        let rec = store.get(lease.key()).unwrap().unwrap();
        assert_eq!(
            (rec.state(), rec.token()),
            (State::Processing, lease.token())
        );
    }
    // The lease holders can still finish after the crash.
    store.complete(&leases[0], b"late").unwrap();
}

/// Bytes of the frames of one epoch from the first frame position: the
/// chain a reopen replays (older frames past its end have another epoch).
fn chain_bytes(log: &[u8]) -> usize {
    let epoch_of = |at: usize| &log[at + 16..at + 24];
    let mut total = 0;
    for (at, len) in common::log_frames(log) {
        if epoch_of(at) != epoch_of(4096) {
            break;
        }
        total += len;
    }
    total
}

/// A replay after a power cut whose changes pass the write buffer's 8 MiB
/// bound: recovery applies the buffer part way (when it fills) and at the
/// end, and every acknowledged change is there after it, with state
/// counts that `verify` finds consistent with the records.
#[test]
fn a_replay_larger_than_the_write_buffer_keeps_every_change() {
    const RESULT: usize = 256 * 1024;
    let disk = SimDisk::default();
    let log = SimLog::default();
    let config = || config().max_result_bytes(RESULT);
    let store = open_sim(&disk, &log, config()).unwrap();
    let result = |i: usize| vec![u8::try_from(i % 251).unwrap(); RESULT];
    // First the log grows (a full log is checkpointed and doubled) to at
    // least 32 MiB, then a checkpoint empties it.
    for i in 0..150 {
        let lease = acquire(&store, &key(format!("grow-{i}")));
        store.complete(&lease, &result(i)).unwrap();
    }
    store.checkpoint().unwrap();
    // About 10 MiB of changes after the checkpoint, some left in flight.
    let mut leases = Vec::new();
    for i in 0..50 {
        let lease = acquire(&store, &key(format!("replay-{i}")));
        if i % 5 == 4 {
            leases.push(lease);
        } else {
            store.complete(&lease, &result(i)).unwrap();
        }
    }
    let (disk2, log2) = (disk.power_cut(), log.power_cut());
    drop(store);
    let replayed = chain_bytes(&log2.durable());
    assert!(
        replayed > 9 * 1024 * 1024,
        "the replay holds {replayed} bytes of frames, not more than the buffer"
    );
    let store = open_sim(&disk2, &log2, config()).unwrap();
    for i in (0..50).filter(|i| i % 5 != 4) {
        let rec = store.get(&key(format!("replay-{i}"))).unwrap().unwrap();
        assert_eq!(rec.result(), Some(&result(i)[..]), "replay-{i}");
    }
    for lease in &leases {
        let rec = store.get(lease.key()).unwrap().unwrap();
        assert_eq!(
            (rec.state(), rec.token()),
            (State::Processing, lease.token())
        );
    }
    for i in 0..150 {
        let rec = store.get(&key(format!("grow-{i}"))).unwrap().unwrap();
        assert_eq!(rec.result(), Some(&result(i)[..]), "grow-{i}");
    }
    let report = store.verify(|_| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let stats = store.stats().unwrap();
    assert_eq!(stats.records.total(), 200, "{stats:?}");
}

#[test]
fn buffered_mode_loses_at_most_unflushed_changes_and_drop_flushes() {
    let buffered = config().durability(Durability::Buffered {
        max_delay: Duration::from_secs(3600),
    });
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, buffered.clone()).unwrap();
    let a = key("buffered-a");
    let lease = acquire(&store, &a);
    store.complete(&lease, b"A").unwrap();
    store.flush().unwrap();
    // Acknowledged, visible, but not yet durable.
    let b = key("buffered-b");
    let b_lease = acquire(&store, &b);
    assert_eq!(store.get(&b).unwrap().unwrap().token(), b_lease.token());

    let (disk2, log2) = (disk.power_cut(), log.power_cut());
    drop(store);
    let store = open_sim(&disk2, &log2, buffered.clone()).unwrap();
    match store.claim(&a, &fp(), &ClaimOptions::new()).unwrap() {
        ClaimOutcome::Replay(r) => assert_eq!(r.result(), Some(&b"A"[..])),
        other => panic!("flushed change lost: {other:?}"),
    }
    // The unflushed claim was lost: a retry acquires the key again, which
    // is the duplicate the docs warn about.
    assert!(store.get(&b).unwrap().is_none());
    let again = acquire(&store, &b);
    // The lost claim's fencing token is never handed out again.
    assert!(again.token() > b_lease.token());

    // Dropping the store flushes: after a clean drop a power cut loses
    // nothing.
    let c = key("buffered-c");
    let c_lease = acquire(&store, &c);
    drop(store);
    let (disk3, log3) = (disk2.power_cut(), log2.power_cut());
    let store = open_sim(&disk3, &log3, buffered).unwrap();
    assert_eq!(store.get(&c).unwrap().unwrap().token(), c_lease.token());
    assert_eq!(store.get(&b).unwrap().unwrap().token(), again.token());
}

#[test]
fn a_torn_last_frame_is_cut_and_recovery_keeps_the_frames_before_it() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    for i in 0..10 {
        acquire(&store, &key(format!("torn-{i}")));
    }
    let disk2 = disk.power_cut();
    let mut image = log.durable();
    drop(store);
    let fr = common::log_frames(&image);
    assert_eq!(fr.len(), 10, "one frame per lone claim");
    // The last write was cut in the middle.
    let (at, len) = fr[9];
    for b in &mut image[at + len / 2..at + len] {
        *b = 0;
    }
    let store = open_sim(&disk2, &SimLog::from_bytes(image), config()).unwrap();
    for i in 0..9 {
        assert!(
            store.get(&key(format!("torn-{i}"))).unwrap().is_some(),
            "torn-{i}"
        );
    }
    assert!(store.get(&key("torn-9")).unwrap().is_none());
}

#[test]
fn a_damaged_frame_followed_by_valid_ones_is_corruption() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    for i in 0..10 {
        acquire(&store, &key(format!("damaged-{i}")));
    }
    let disk2 = disk.power_cut();
    let mut image = log.durable();
    drop(store);
    let fr = common::log_frames(&image);
    let (at, len) = fr[4];
    image[at + len - 3] ^= 0x40;
    match open_sim(&disk2, &SimLog::from_bytes(image), config()) {
        Err(Error::CorruptLog { path, offset, .. }) => {
            assert_eq!(offset, at as u64);
            assert_eq!(path, Path::new("sim.redb-wal"));
        }
        other => panic!("expected CorruptLog, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_log_from_another_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.redb"), dir.path().join("b.redb"));
    let sa = Store::open_with(&a, config()).unwrap();
    let a_log = sa.log_path().to_path_buf();
    assert_eq!(a_log, dir.path().join("a.redb-wal"));
    drop(sa);
    let sb = Store::open_with(&b, config()).unwrap();
    let b_log = sb.log_path().to_path_buf();
    drop(sb);
    std::fs::copy(&a_log, &b_log).unwrap();
    match Store::open_with(&b, config()) {
        Err(Error::IncompatibleFile { path, .. }) => assert_eq!(path, b_log),
        other => panic!("expected IncompatibleFile, got {other:?}"),
    }
}

/// A store file replaced by a copy of itself under a running store (a
/// restore or copy-back: `mv s.redb moved.redb; cp moved.redb s.redb`) is
/// a new file redb's lock does not cover, beside the running store's log:
/// an open of it is refused (`AlreadyOpen`, naming the log) instead of
/// replaying and writing the log the running store writes, which made two
/// live stores that each acquired the same key.
#[test]
fn a_copy_put_in_place_of_a_held_store_is_refused_while_its_log_is_held() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.redb");
    let log = dir.path().join("s.redb-wal");
    let running = Store::open_with(&path, config()).unwrap();
    let lease = acquire(&running, &key("k-1"));
    running.complete(&lease, b"first").unwrap();
    let moved = dir.path().join("moved.redb");
    std::fs::rename(&path, &moved).unwrap();
    std::fs::copy(&moved, &path).unwrap();
    match Store::open_with(&path, config()) {
        Err(Error::AlreadyOpen { path: held }) => assert_eq!(held, log),
        other => panic!(
            "expected AlreadyOpen naming the log, got {:?}",
            other.map(|_| ())
        ),
    }
    // The running store goes on, and once it is closed its file opens by
    // its new name with everything, its log put back beside it.
    let lease = acquire(&running, &key("k-2"));
    running.complete(&lease, b"second").unwrap();
    drop(running);
    std::fs::remove_file(&path).unwrap();
    std::fs::rename(&log, dir.path().join("moved.redb-wal")).unwrap();
    let reopened = Store::open_with(&moved, config()).unwrap();
    for id in ["k-1", "k-2"] {
        let record = reopened.get(&key(id)).unwrap();
        assert_eq!(record.map(|r| r.state()), Some(State::Succeeded), "{id}");
    }
}

/// The child of [`an_open_racing_a_close_is_refused_by_the_file_never_by_its_log`].
const RACING_OPENS: &str = "an_open_racing_a_close_is_refused_by_the_file_never_by_its_log";
/// The processes and the rounds of that test.
const RACERS: usize = 6;
const ROUNDS: usize = 20;

/// Processes opening one new store at once, each round, and closing it in
/// turn (as a restarting service's old and new process do): an open that
/// takes the file's lock finds its log free too, since a closing store
/// releases its log before its file. So every refusal names the store
/// file (a refusal naming the log says the file was replaced under a
/// running store), and each key is acquired once.
#[test]
fn an_open_racing_a_close_is_refused_by_the_file_never_by_its_log() {
    if common::child_role(RACING_OPENS) {
        let dir = std::path::PathBuf::from(common::child_var("DIR"));
        let id = common::child_var("ID");
        let (mut by_log, mut acquired) = (0, 0);
        for round in 0..ROUNDS {
            // All start the round together (a hang guard, not a bound).
            std::fs::write(dir.join(format!("ready-{round}-{id}")), b"").unwrap();
            let started = std::time::Instant::now();
            while (0..RACERS).any(|i| !dir.join(format!("ready-{round}-{i}")).exists()) {
                assert!(started.elapsed() < Duration::from_secs(60), "round {round}");
                std::thread::yield_now();
            }
            let path = dir.join(format!("s{round}.redb"));
            let store = loop {
                match Store::open_with(&path, config()) {
                    Ok(store) => break store,
                    Err(Error::AlreadyOpen { path: refused }) => {
                        by_log += usize::from(refused != path);
                    }
                    Err(other) => panic!("child {id}: {other:?}"),
                }
            };
            for k in 0..4 {
                if let ClaimOutcome::Acquired(lease) = store
                    .claim(&key(format!("{round}-{k}")), &fp(), &ClaimOptions::new())
                    .unwrap()
                {
                    store.complete(&lease, b"once").unwrap();
                    acquired += 1;
                }
            }
        }
        common::report("BY_LOG", by_log);
        common::report("ACQUIRED", acquired);
        common::ready_and_wait();
    }
    let dir = tempfile::tempdir().unwrap();
    let mut children: Vec<_> = (0..RACERS)
        .map(|id| {
            common::spawn_child(
                RACING_OPENS,
                &[
                    ("DIR", common::path_var(dir.path())),
                    ("ID", id.to_string()),
                ],
            )
        })
        .collect();
    let (mut by_log, mut acquired) = (0, 0);
    for child in &mut children {
        let said = child.wait_ready();
        by_log += said["BY_LOG"].parse::<usize>().unwrap();
        acquired += said["ACQUIRED"].parse::<usize>().unwrap();
    }
    children.into_iter().for_each(|c| c.kill());
    assert_eq!(by_log, 0, "opens refused by the log of a closing store");
    assert_eq!(acquired, ROUNDS * 4, "each key acquired once");
}

#[test]
fn a_missing_log_is_recreated_after_a_clean_close_and_refused_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.redb");
    let store = Store::open_with(&path, config()).unwrap();
    acquire(&store, &key("m-1"));
    let log_path = store.log_path().to_path_buf();
    drop(store);
    std::fs::remove_file(&log_path).unwrap();
    let store = Store::open_with(&path, config()).unwrap();
    assert!(store.get(&key("m-1")).unwrap().is_some());
    drop(store);

    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    acquire(&store, &key("m-2"));
    let disk2 = disk.power_cut();
    drop(store);
    match open_sim(&disk2, &SimLog::default(), config()) {
        Err(Error::CorruptLog { offset: 0, .. }) => {}
        other => panic!("expected CorruptLog, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_checkpoint_leaves_nothing_to_replay() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    for i in 0..5 {
        acquire(&store, &key(format!("ck-{i}")));
    }
    store.checkpoint().unwrap();
    let disk2 = disk.power_cut();
    drop(store);
    // The index alone holds everything: a log whose frames are all gone
    // loses nothing once the log header is there (a blank log after a
    // crash is refused, so keep the header; a log cut shorter than its
    // header records is refused too, so keep its length).
    let mut image = log.durable();
    image[4096..].fill(0);
    let store = open_sim(&disk2, &SimLog::from_bytes(image), config()).unwrap();
    for i in 0..5 {
        assert!(store.get(&key(format!("ck-{i}"))).unwrap().is_some());
    }
}

// ---------------------------------------------------------------------------
// Failures of the log

#[test]
fn a_failed_fsync_fails_the_whole_batch_and_poisons_until_reopen() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    let kept = key("kept");
    let kept_lease = acquire(&store, &kept);
    store.complete(&kept_lease, b"kept").unwrap();

    log.hold(true);
    let keys: Vec<Key> = (0..6).map(|i| key(format!("failing-{i}"))).collect();
    let results: Vec<Result<ClaimOutcome, Error>> = std::thread::scope(|s| {
        let first = s.spawn(|| store.claim(&key("failing-first"), &fp(), &ClaimOptions::new()));
        log.wait_blocked();
        let handles: Vec<_> = keys
            .iter()
            .map(|k| s.spawn(|| store.claim(k, &fp(), &ClaimOptions::new())))
            .collect();
        // Let the six queue up behind the held batch.
        std::thread::sleep(Duration::from_millis(50));
        log.faults.fail_sync.store(true, Ordering::SeqCst);
        log.hold(false);
        let mut all = vec![first.join().unwrap()];
        all.extend(handles.into_iter().map(|h| h.join().unwrap()));
        all
    });
    for r in &results {
        assert!(
            matches!(r, Err(Error::Storage(_) | Error::Poisoned { .. })),
            "a request was reported done: {r:?}"
        );
    }
    assert!(results.iter().any(|r| matches!(r, Err(Error::Storage(_)))));
    // Poisoned: writes are refused, reads of unaffected keys still work, a
    // key whose change never became durable is not shown.
    assert!(matches!(
        store.claim(&key("later"), &fp(), &ClaimOptions::new()),
        Err(Error::Poisoned { .. })
    ));
    assert_eq!(
        store.get(&kept).unwrap().unwrap().result(),
        Some(&b"kept"[..])
    );
    assert!(matches!(
        store.get(&key("failing-first")),
        Err(Error::Poisoned { .. }) | Ok(None)
    ));
    assert!(matches!(store.flush(), Err(Error::Poisoned { .. })));

    // Reopen recovers from what is on disk (here: a power cut right after).
    let (disk2, log2) = (disk.power_cut(), log.power_cut());
    drop(store);
    let store = open_sim(&disk2, &log2, config()).unwrap();
    assert_eq!(
        store.get(&kept).unwrap().unwrap().result(),
        Some(&b"kept"[..])
    );
    for k in keys.iter().chain([&key("failing-first")]) {
        // Each failed claim either never happened or is whole.
        match store.claim(k, &fp(), &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Acquired(_) | ClaimOutcome::InProgress { .. } => {}
            other => panic!("{k}: {other:?}"),
        }
    }
    acquire(&store, &key("after-reopen"));
    drop(store);

    // The poisoned store itself was dropped cleanly above: its closing
    // checkpoint made what its index held durable. With the log's fsync
    // working again, that storage opens whole too.
    log.faults.fail_sync.store(false, Ordering::SeqCst);
    let store = open_sim(&disk, &log, config()).unwrap();
    assert_eq!(
        store.get(&kept).unwrap().unwrap().result(),
        Some(&b"kept"[..])
    );
    for k in keys.iter().chain([&key("failing-first")]) {
        match store.claim(k, &fp(), &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Acquired(_) | ClaimOutcome::InProgress { .. } => {}
            other => panic!("{k}: {other:?}"),
        }
    }
}

fn calls_all_fail_without_hanging(store: &Store) {
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        for i in 0..8 {
            let tx = tx.clone();
            s.spawn(move || {
                let r = store.claim(&key(format!("dead-{i}")), &fp(), &ClaimOptions::new());
                tx.send(r.map(|_| ())).unwrap();
            });
        }
        for _ in 0..8 {
            let r = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("a call hung after the store's thread died");
            assert!(
                matches!(
                    r,
                    Err(Error::Closed | Error::Poisoned { .. } | Error::Storage(_))
                ),
                "{r:?}"
            );
        }
    });
}

#[test]
fn syncer_death_fails_every_call_and_nothing_hangs() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    acquire(&store, &key("before"));
    log.faults.panic_sync.store(true, Ordering::SeqCst);
    calls_all_fail_without_hanging(&store);
    calls_all_fail_without_hanging(&store);
    // The fsync that panicked ran on the syncer (which then stops: Closed)
    // or on a lone caller that led its own batch (which poisons the store).
    let flushed = store.flush();
    assert!(
        matches!(flushed, Err(Error::Closed | Error::Poisoned { .. })),
        "{flushed:?}"
    );
    drop(store);
}

#[test]
fn writer_death_fails_every_call_and_nothing_hangs() {
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(&disk, &log, config()).unwrap();
    acquire(&store, &key("before"));
    log.faults.panic_write.store(true, Ordering::SeqCst);
    calls_all_fail_without_hanging(&store);
    calls_all_fail_without_hanging(&store);
    // A writer that panicked poisons the store (and fences its file).
    assert!(matches!(
        store.checkpoint(),
        Err(Error::Closed | Error::Poisoned { .. })
    ));
    drop(store);
    // What was acknowledged before is still there after reopening.
    log.faults.panic_write.store(false, Ordering::SeqCst);
    let store = open_sim(&disk.power_cut(), &log.power_cut(), config()).unwrap();
    assert!(store.get(&key("before")).unwrap().is_some());
}

// ---------------------------------------------------------------------------
// The read path

#[test]
fn replays_come_from_the_cache_until_retention_ends() {
    let clock = ManualClock::starting_now();
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open_with(
        dir.path().join("c.redb"),
        config()
            .clock(clock.clone())
            .retention(Duration::from_secs(60)),
    )
    .unwrap();
    let k = key("cached");
    let lease = acquire(&store, &k);
    let done: Record = store.complete(&lease, b"R").unwrap();
    for _ in 0..3 {
        match store.claim(&k, &fp(), &ClaimOptions::new()).unwrap() {
            ClaimOutcome::Replay(r) => assert_eq!(r, done),
            other => panic!("{other:?}"),
        }
    }
    clock.advance(Duration::from_secs(60));
    assert!(store.get(&k).unwrap().is_none());
    let again = acquire(&store, &k);
    assert!(again.token() > lease.token());
    // The new in-progress record is never served from the cache.
    assert_eq!(store.get(&k).unwrap().unwrap().state(), State::Processing);
    store.release(again).unwrap();
    assert!(store.get(&k).unwrap().is_none());
}

#[test]
fn in_buffered_mode_reads_see_acknowledged_changes_before_the_fsync() {
    // (That Immediate-mode reads wait for the fsync is tested inside the
    // crate, where the test can see the index before the fsync ends.)
    let disk = SimDisk::default();
    let log = SimLog::default();
    let store = open_sim(
        &disk,
        &log,
        config().durability(Durability::Buffered {
            max_delay: Duration::from_secs(3600),
        }),
    )
    .unwrap();
    let k = key("visible");
    let lease = acquire(&store, &k);
    assert_eq!(store.get(&k).unwrap().unwrap().token(), lease.token());
    assert!(common::log_frames(&log.durable()).is_empty());
    store.flush().unwrap();
    assert_eq!(common::log_frames(&log.durable()).len(), 1);
}

// ---------------------------------------------------------------------------
// The async API never blocks its executor.

/// What happened, in order, on the single thread of a current-thread
/// runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Tick,
    Got,
    Claimed(u64),
}

/// Releases a held log if the test has not done so by itself: on a store
/// whose async API blocked its executor the test would otherwise hang,
/// never reaching its own release. Not a timing assertion: the assertions
/// that follow fail in that case, whenever the release came.
fn release_if_stuck(log: &SimLog) -> mpsc::Sender<()> {
    let (done, stuck) = mpsc::channel::<()>();
    let log = log.clone();
    std::thread::spawn(move || {
        if stuck.recv_timeout(Duration::from_secs(30)).is_err() {
            log.hold(false);
        }
    });
    done
}

/// Holds the writer inside a frame write (so it takes nothing more from its
/// queue), after finishing a key that `get_async` can read.
fn held_store(log: &SimLog) -> (Arc<Store>, Key, std::thread::JoinHandle<()>) {
    let disk = SimDisk::default();
    // A manual clock: no time passes, so no time reservation is needed.
    let clock = ManualClock::starting_now();
    let store = Arc::new(open_sim(&disk, log, config().clock(clock)).unwrap());
    let done = key("async-done");
    let lease = acquire(&store, &done);
    store.complete(&lease, b"result").unwrap();
    // Committed to the index, so that reading it needs no writer.
    assert!(store.get(&done).unwrap().is_some());
    log.hold(true);
    let first = {
        let store = store.clone();
        std::thread::spawn(move || drop(acquire(&store, &key("async-first"))))
    };
    log.wait_blocked();
    (store, done, first)
}

/// Spawns one claim task per key on the current runtime; each records its
/// answer in `steps`.
fn spawn_claims(
    store: &Arc<Store>,
    keys: std::ops::Range<usize>,
    steps: &Arc<Mutex<Vec<Step>>>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    keys.map(|i| {
        let (store, steps) = (store.clone(), steps.clone());
        tokio::spawn(async move {
            let k = key(format!("async-{i}"));
            let outcome = store.claim_async(&k, &fp(), &ClaimOptions::new()).await;
            let token = match outcome {
                Ok(ClaimOutcome::Acquired(lease)) => lease.token(),
                other => panic!("claim {i}: {other:?}"),
            };
            steps.lock().unwrap().push(Step::Claimed(token));
            token
        })
    })
    .collect()
}

/// With the writer held and its queue full, claim futures that wait for
/// room stay pending while another task on the same (single) executor
/// thread completes K steps and a `get_async` of a finished key completes;
/// then the writer is released and every claim is answered once.
#[test]
fn an_async_claim_waiting_for_a_full_queue_does_not_block_its_executor() {
    const K: usize = 200;
    let log = SimLog::default();
    let (store, done, first) = held_store(&log);
    let stuck = release_if_stuck(&log);
    let steps = Arc::new(Mutex::new(Vec::new()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let n = idemstore::WRITER_QUEUE_BOUND + 64;
    rt.block_on(async {
        // More claims than the queue holds: the last ones wait for room.
        let claims = spawn_claims(&store, 0..n, &steps);
        let ticker = {
            let steps = steps.clone();
            tokio::spawn(async move {
                for _ in 0..K {
                    steps.lock().unwrap().push(Step::Tick);
                    tokio::task::yield_now().await;
                }
            })
        };
        let reader = {
            let (store, steps) = (store.clone(), steps.clone());
            tokio::spawn(async move {
                let got = store.get_async(&done).await.unwrap();
                assert_eq!(
                    got.and_then(|r| r.result().map(<[u8]>::to_vec)),
                    Some(b"result".to_vec())
                );
                steps.lock().unwrap().push(Step::Got);
            })
        };
        ticker.await.unwrap();
        reader.await.unwrap();
        {
            let seen = steps.lock().unwrap();
            let ticks = seen.iter().filter(|s| **s == Step::Tick).count();
            assert_eq!(ticks, K);
            assert!(seen.contains(&Step::Got));
            assert!(
                !seen.iter().any(|s| matches!(s, Step::Claimed(_))),
                "a claim was answered while the writer was held: {:?}",
                seen.iter()
                    .filter(|s| matches!(s, Step::Claimed(_)))
                    .take(5)
                    .collect::<Vec<_>>()
            );
        }
        log.hold(false);
        let mut tokens = Vec::new();
        for c in claims {
            tokens.push(c.await.unwrap());
        }
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(
            tokens.len(),
            n,
            "every claim answered once, each its own token"
        );
    });
    let _ = stuck.send(());
    first.join().unwrap();
    let seen = steps.lock().unwrap();
    // Every tick and the read came before any claim's answer.
    let first_claim = seen
        .iter()
        .position(|s| matches!(s, Step::Claimed(_)))
        .unwrap();
    assert_eq!(first_claim, K + 1, "{:?}", &seen[..first_claim.min(8)]);
    assert_eq!(seen.len(), K + 1 + n);
}

/// Back-pressure reaches the async caller: with the writer held, claims up
/// to the queue's bound are queued, later ones wait for room (pending,
/// without blocking the executor). Once the writer is released every
/// request is answered exactly once, and in queue order: each claim that
/// had to wait for room got a later token than every claim queued before
/// the queue filled.
#[test]
fn back_pressure_reaches_async_callers_and_every_request_is_answered_after_the_release() {
    let log = SimLog::default();
    let (store, _, first) = held_store(&log);
    let stuck = release_if_stuck(&log);
    let steps = Arc::new(Mutex::new(Vec::new()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let bound = idemstore::WRITER_QUEUE_BOUND;
    let (queued, waited) = rt.block_on(async {
        let queued = spawn_claims(&store, 0..bound, &steps);
        let waited = spawn_claims(&store, bound..2 * bound, &steps);
        // Every task has run up to its first wait.
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        assert!(steps.lock().unwrap().is_empty(), "answered while held");
        assert!(queued.iter().chain(&waited).all(|h| !h.is_finished()));
        log.hold(false);
        let mut q = Vec::new();
        for h in queued {
            q.push(h.await.unwrap());
        }
        let mut w = Vec::new();
        for h in waited {
            w.push(h.await.unwrap());
        }
        (q, w)
    });
    let _ = stuck.send(());
    first.join().unwrap();
    assert_eq!(steps.lock().unwrap().len(), 2 * bound, "each answered once");
    let last_queued = queued.iter().max().unwrap();
    let first_waited = waited.iter().min().unwrap();
    assert!(
        first_waited > last_queued,
        "a claim that waited for room overtook one queued before it"
    );
    let mut all: Vec<u64> = queued.into_iter().chain(waited).collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 2 * bound);
}

/// A log that records which thread made each fsync.
#[derive(Clone, Default)]
struct ThreadLog {
    inner: SimLog,
    syncs: Arc<Mutex<Vec<String>>>,
}

impl LogFile for ThreadLog {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.write_at(offset, data)
    }
    fn sync_data(&self) -> io::Result<()> {
        let name = std::thread::current().name().unwrap_or("?").to_owned();
        self.syncs.lock().unwrap().push(name);
        self.inner.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
}

/// A lone caller that finds the writer idle decides, writes and syncs its
/// own batch on its own thread (LevelDB's leader): no hand-off to the
/// writer thread and no wake-up back. When the writer thread still holds
/// its state (woken to apply a led batch to the index), the request is
/// the writer thread's, a batch of one that it syncs itself: a lone batch
/// never waits for the syncer. Its changes are durable either way: a
/// power cut right after keeps them.
#[test]
fn a_lone_caller_commits_its_own_batch_on_its_own_thread() {
    let disk = SimDisk::default();
    let log = ThreadLog::default();
    let store = Store::open_with_backend("lone.redb", disk.clone(), log.clone(), config()).unwrap();
    log.syncs.lock().unwrap().clear();
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("lone-caller".into())
            .spawn_scoped(s, || {
                for i in 0..20 {
                    let lease = acquire(&store, &key(format!("lone-{i}")));
                    store.complete(&lease, b"done").unwrap();
                }
            })
            .unwrap();
    });
    let syncs = log.syncs.lock().unwrap().clone();
    // The caller leads whenever it finds the writer's state free. The
    // writer thread, woken to apply led batches to the index, may still
    // hold it when the next request comes (how often depends on the
    // machine's load): that request's batch is then the writer thread's,
    // also a batch of one that it syncs itself. Either way no lone batch
    // waits for the syncer thread.
    let own = syncs.iter().filter(|n| *n == "lone-caller").count();
    assert!(own >= 1, "no batch synced by its caller: {syncs:?}");
    assert!(
        syncs
            .iter()
            .all(|n| n == "lone-caller" || n == "idemstore-writer"),
        "a lone batch was handed to another thread: {syncs:?}"
    );
    assert!(syncs.len() >= 40, "40 writes, {} syncs", syncs.len());
    // Durable: a power cut now loses none of them.
    let cut = disk.power_cut();
    let cut_log = log.inner.power_cut();
    drop(store);
    let reopened = open_sim(&cut, &cut_log, config()).unwrap();
    for i in 0..20 {
        let record = reopened.get(&key(format!("lone-{i}"))).unwrap().unwrap();
        assert_eq!(record.state(), State::Succeeded);
    }
}

mod common;

/// The child of [`a_crashed_store_recovers_its_changes_by_any_name_of_its_file`].
const CRASHED_BY_NAME: &str = "a_crashed_store_recovers_its_changes_by_any_name_of_its_file";

/// A store killed while open (SIGKILL) keeps what it acknowledged whatever
/// name its file is opened by next. Through a symlink, or a path with `..`,
/// the open finds the log the store wrote (both logs are the canonical
/// file's), even when an earlier open through the symlink had left a log
/// beside the symlink's name (as an older build did). Through a hard link,
/// another name whose log is another file, the open is refused while the
/// store's log holds changes the index lacks, naming the name to open by;
/// once opened so, every name opens the store with nothing lost.
#[test]
fn a_crashed_store_recovers_its_changes_by_any_name_of_its_file() {
    if common::child_role(CRASHED_BY_NAME) {
        let store = Store::open_with(common::child_var("STORE"), config()).expect("open");
        let k = key(common::child_var("KEY"));
        let lease = acquire(&store, &k);
        store.complete(&lease, b"done").expect("complete");
        common::ready_and_wait();
    }
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.redb");
    let alias = dir.path().join("alias.redb");
    let hard = dir.path().join("hard.redb");
    drop(Store::open_with(&real, config()).unwrap());
    std::os::unix::fs::symlink(&real, &alias).unwrap();
    std::fs::hard_link(&real, &hard).unwrap();
    // A log of this store beside the symlink's name, of an earlier epoch:
    // what an open through the symlink left before logs were named by the
    // canonical file.
    drop(Store::open_with(&real, config()).unwrap());
    std::fs::copy(
        dir.path().join("real.redb-wal"),
        dir.path().join("alias.redb-wal"),
    )
    .unwrap();
    let crash = |name: &Path, id: &str| {
        let mut child = common::spawn_child(
            CRASHED_BY_NAME,
            &[("STORE", common::path_var(name)), ("KEY", id.to_string())],
        );
        child.wait_ready();
        child.kill();
    };
    let done = |store: &Store, id: &str| {
        let rec = store.get(&key(id)).unwrap();
        assert_eq!(
            rec.as_ref().map(|r| (r.state(), r.result())),
            Some((State::Succeeded, Some(&b"done"[..]))),
            "{id}"
        );
    };

    crash(&real, "by-symlink");
    let store = Store::open_with(&alias, config()).unwrap();
    done(&store, "by-symlink");
    drop(store);

    crash(&real, "by-dotted-path");
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let dotted = dir.path().join("sub").join("..").join("real.redb");
    let store = Store::open_with(dotted, config()).unwrap();
    done(&store, "by-dotted-path");
    drop(store);

    crash(&real, "by-hard-link");
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap();
    let refused = Store::open_with(&hard, config()).err();
    match &refused {
        Some(Error::IncompatibleFile { path, detail }) => {
            assert_eq!(
                canonical(path),
                canonical(&dir.path().join("real.redb-wal"))
            );
            assert!(detail.contains("mv "), "{detail}");
        }
        other => panic!("expected the refusal naming the store's log, got {other:?}"),
    }
    drop(Store::open_with(&real, config()).unwrap());
    let store = Store::open_with(&hard, config()).unwrap();
    for id in ["by-symlink", "by-dotted-path", "by-hard-link"] {
        done(&store, id);
    }
    drop(store);

    // A copy of the crashed store with its log, in another directory,
    // recovers from its own log (the recorded log, the original's, is not
    // looked at).
    crash(&real, "copied");
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::copy(&real, elsewhere.join("copy.redb")).unwrap();
    std::fs::copy(
        dir.path().join("real.redb-wal"),
        elsewhere.join("copy.redb-wal"),
    )
    .unwrap();
    let store = Store::open_with(elsewhere.join("copy.redb"), config()).unwrap();
    done(&store, "copied");
    drop(store);

    // A crash under an older build that named the log after the symlink:
    // the log beside the symlink holds the changes, and the refusal says
    // which move puts it into place; after the move, nothing is lost.
    crash(&real, "old-layout");
    std::fs::rename(
        dir.path().join("real.redb-wal"),
        dir.path().join("alias.redb-wal"),
    )
    .unwrap();
    let refused = Store::open_with(&alias, config()).err();
    let Some(Error::IncompatibleFile { path, detail }) = &refused else {
        panic!("expected the refusal naming the symlink's log, got {refused:?}");
    };
    assert_eq!(path, &dir.path().join("alias.redb-wal"));
    assert!(detail.contains("mv "), "{detail}");
    std::fs::rename(path, dir.path().join("real.redb-wal")).unwrap();
    let store = Store::open_with(&alias, config()).unwrap();
    done(&store, "old-layout");
    drop(store);

    // A copy of the crashed index alone: the recorded log is another
    // file's (the original's), so the refusal says to open that file or
    // copy its log, never to move it (a move would take the original's
    // log away, or share it with a running original).
    crash(&real, "index-copy");
    let lone = dir.path().join("lone");
    std::fs::create_dir(&lone).unwrap();
    std::fs::copy(&real, lone.join("copy.redb")).unwrap();
    let refused = Store::open_with(lone.join("copy.redb"), config()).err();
    let Some(Error::IncompatibleFile { detail, .. }) = &refused else {
        panic!("expected the refusal naming the original's log, got {refused:?}");
    };
    assert!(detail.contains("never move it"), "{detail}");
    assert!(!detail.contains("mv "), "{detail}");
    let store = Store::open_with(&real, config()).unwrap();
    done(&store, "index-copy");
}
