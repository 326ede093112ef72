//! Fuzz body `transitions`: arbitrary operation sequences run against the
//! reference model (`tests/reference/mod.rs`) and a real store on an
//! in-memory redb backend, comparing every answer. Any mismatch panics.
//!
//! Included by `fuzz/fuzz_targets/transitions.rs` and `tests/fuzz_corpus.rs`.

#[path = "ops.rs"]
mod ops;

use std::sync::Arc;

use idemstore::{MemoryLog, StorageBackend, Store};
use redb::backends::InMemoryBackend;

use ops::reference::{Harness, Model};

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

/// Runs the operations `data` encodes; panics on any difference between
/// the store and the model.
pub fn transitions(data: &[u8]) {
    let memory = SharedMemory(Arc::new(InMemoryBackend::new()));
    let log = MemoryLog::new();
    let mut harness = Harness::new(Box::new(move |config| {
        // A small log: the default preallocates 64 MiB at every open.
        let config = config.max_log_bytes(LOG_BYTES);
        Store::open_with_backend("fuzz-transitions", memory.clone(), log.clone(), config)
            .expect("open the in-memory store")
    }));
    harness.check(&Model::new());
    ops::run(data, |op, model| {
        harness.apply(op, model);
        harness.check(model);
    });
}
