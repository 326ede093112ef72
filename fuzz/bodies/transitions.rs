//! Fuzz body `transitions`: arbitrary operation sequences run against the
//! reference model (`tests/reference/mod.rs`) and a real store on an
//! in-memory redb backend, comparing every answer. Any mismatch panics.
//!
//! Included by `fuzz/fuzz_targets/transitions.rs` and `tests/fuzz_corpus.rs`.

#[path = "ops.rs"]
mod ops;

use std::cell::RefCell;
use std::sync::Arc;

use idemstore::{MemoryLog, StorageBackend, Store};
use redb::backends::InMemoryBackend;

use ops::reference::{ForgedToken, Harness, LeaseRef, Model, Op, Resumable};

/// The write-ahead log's size in the fuzz runs (bytes): big enough for the
/// largest batch a run makes, small enough to allocate at every open.
const LOG_BYTES: u64 = 256 * 1024;

/// An in-memory redb backend that outlives the store, so the harness can
/// drop and reopen it.
#[derive(Debug, Clone)]
struct SharedMemory(Arc<InMemoryBackend>);

impl StorageBackend for SharedMemory {
    fn len(&self) -> std::io::Result<u64> {
        StorageBackend::len(&*self.0)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        StorageBackend::read(&*self.0, offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        StorageBackend::set_len(&*self.0, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        StorageBackend::sync_data(&*self.0)
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        StorageBackend::write(&*self.0, offset, data)
    }
}

/// The store the runs of one thread share, and the model of the last run
/// (whose records the next run evicts first).
struct Shared {
    left: Resumable,
    last: Model,
}

thread_local! {
    /// Taken for a run and put back when it ends; a run that panics leaves
    /// `None`, and the next opens a new store.
    static SHARED: RefCell<Option<Shared>> = const { RefCell::new(None) };
}

/// A harness on a new store on in-memory storage.
fn open_new() -> Harness {
    let memory = SharedMemory(Arc::new(InMemoryBackend::new()));
    let log = MemoryLog::new();
    Harness::new(Box::new(move |config| {
        // A small log: the default preallocates 64 MiB at every open.
        let config = config.max_log_bytes(LOG_BYTES);
        Store::open_with_backend("fuzz-transitions", memory.clone(), log.clone(), config)
            .expect("open the in-memory store")
    }))
}

/// The model keys whose records `op` can have changed, as a reader sees
/// them: the key it names, and for a forged lease that borrows another
/// key's token, that key too (a store that matched the lease by token
/// would write it); `None` when it can have changed any (the time moved, a
/// sweep, a reopen) or none (a clock step back: the store's time stands,
/// so it is checked in full too, which is cheap as it is rare).
fn touched(op: &Op, model: &Model) -> Option<Vec<usize>> {
    let lease_keys = |lease: &LeaseRef| match *lease {
        LeaseRef::Handed { index, .. } => vec![model.leases[index]],
        LeaseRef::Forged {
            key,
            token: ForgedToken::Borrowed(index),
        } => vec![key, model.leases[index]],
        LeaseRef::Forged { key, .. } => vec![key],
    };
    match op {
        Op::Claim { key, .. } | Op::Get { key } => Some(vec![*key]),
        Op::Complete { lease, .. }
        | Op::Fail { lease, .. }
        | Op::Release { lease }
        | Op::Extend { lease, .. }
        | Op::SetRecoveryPoint { lease, .. } => Some(lease_keys(lease)),
        Op::Advance { .. } | Op::StepBack { .. } | Op::Sweep { .. } | Op::Reopen => None,
    }
}

/// Runs the operations `data` encodes; panics on any difference between
/// the store and the model.
///
/// After each step the store's time, its number of stored records and the
/// records the step can have changed ([`touched`]) are compared; after a
/// step that moves the time, sweeps or reopens, and at the end of the run,
/// every key's record. A correct store changes records only under the keys
/// an operation names (or by eviction, or at a reopen), and a reader's view
/// of the others only with the time. A store that wrongly changed another
/// key's record is found at the next full comparison (at the end of the
/// run at the latest), unless an operation on that key overwrites the
/// change first without its own answer, which is compared, showing it.
///
/// The runs of a thread share one store (opening one per run cost most of
/// a run): each run starts by moving the clock past every record the last
/// run left and sweeping them (the sweep must evict exactly those), so it
/// starts on an empty store, with its model's time mapped to the store's
/// from there on and its forged tokens above every token issued before.
/// `Reopen` drops and reopens it as before, on the same storage.
pub fn transitions(data: &[u8]) {
    let mut harness = match SHARED.with(|s| s.borrow_mut().take()) {
        Some(Shared { left, last }) => Harness::resume(left, Some(&last)),
        None => open_new(),
    };
    harness.check(&Model::new());
    let last = ops::run(data, |op, model| {
        harness.apply(op, model);
        match touched(op, model) {
            Some(keys) => harness.check_keys(model, keys),
            None => harness.check(model),
        }
    });
    harness.check(&last);
    let left = harness.end();
    SHARED.with(|s| *s.borrow_mut() = Some(Shared { left, last }));
}
