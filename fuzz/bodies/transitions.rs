//! Fuzz body `transitions`: arbitrary operation sequences run against the
//! reference model (`tests/reference/mod.rs`) and a real store on an
//! in-memory redb backend, comparing every answer. Any mismatch panics.
//!
//! Included by `fuzz/fuzz_targets/transitions.rs` and `tests/fuzz_corpus.rs`.

#[path = "../../tests/reference/mod.rs"]
pub mod reference;

use std::sync::Arc;

use idemstore::{MemoryLog, StorageBackend, Store};
use redb::backends::InMemoryBackend;

use reference::{
    FINGERPRINT_COUNT, ForgedToken, Harness, KEY_COUNT, LeaseRef, MAX_LEASE_MS, MAX_VALUE_BYTES,
    Model, Op,
};

/// The most operations one input runs.
const MAX_OPS: usize = 256;

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

/// Reads the input a byte at a time; an exhausted input reads zeros, so
/// every prefix of an input is a valid run.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn below(&mut self, n: usize) -> usize {
        usize::from(self.byte()) % n
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }
    fn value(&mut self) -> Vec<u8> {
        let len = self.below(MAX_VALUE_BYTES + 3);
        (0..len).map(|_| self.byte()).collect()
    }
    fn lease(&mut self, model: &Model) -> LeaseRef {
        let handed = model.leases.len();
        let how = self.byte();
        if handed == 0 || how % 4 == 3 {
            let key = self.below(KEY_COUNT);
            let token = match self.byte() % 3 {
                0 => ForgedToken::Ahead(self.byte() % 3 + 1),
                1 if handed > 0 => ForgedToken::Borrowed(self.below(handed)),
                _ => ForgedToken::Max,
            };
            return LeaseRef::Forged { key, token };
        }
        let index = if how % 4 == 2 {
            self.below(handed)
        } else {
            handed - 1 - self.below(handed.min(4))
        };
        LeaseRef::Handed {
            index,
            rebuilt: how & 0x80 != 0,
        }
    }
    fn op(&mut self, model: &Model) -> Op {
        match self.byte() % 16 {
            0..=3 => Op::Claim {
                key: self.below(KEY_COUNT),
                fp: self.below(FINGERPRINT_COUNT),
                lease_ms: match self.byte() % 10 {
                    0 => None,
                    1 => Some(self.pick(&[0, MAX_LEASE_MS + 1])),
                    _ => Some(self.pick(&[1, 10, 500, 5_000, 20_000, 30_000, 90_000])),
                },
            },
            4 | 5 => Op::Complete {
                lease: self.lease(model),
                result: self.value(),
            },
            6 => Op::Fail {
                lease: self.lease(model),
                failure: self.value(),
                retryable: self.byte() & 1 == 1,
            },
            7 => Op::Release {
                lease: self.lease(model),
            },
            8 => Op::Extend {
                lease: self.lease(model),
                ms: self.pick(&[0, 1, 100, 5_000, 30_000, 120_000, MAX_LEASE_MS + 1]),
            },
            9 => Op::SetRecoveryPoint {
                lease: self.lease(model),
                bytes: self.value(),
            },
            10 => Op::Get {
                key: self.below(KEY_COUNT),
            },
            11 | 12 => Op::Advance {
                ms: match self.byte() % 2 {
                    0 => u64::from(self.byte()) * 8,
                    _ => self.pick(&[1, 20_000, 30_000, 59_999, 60_000, 90_000, 150_000]),
                },
            },
            13 => Op::StepBack {
                ms: u64::from(self.byte()) * 500,
            },
            14 => Op::Sweep {
                max: self.pick(&[1, 2, 1_000]),
            },
            _ => Op::Reopen,
        }
    }
}

/// Runs the operations `data` encodes; panics on any difference between
/// the store and the model.
pub fn transitions(data: &[u8]) {
    let memory = SharedMemory(Arc::new(InMemoryBackend::new()));
    let log = MemoryLog::new();
    let mut harness = Harness::new(Box::new(move |config| {
        Store::open_with_backend("fuzz-transitions", memory.clone(), log.clone(), config)
            .expect("open the in-memory store")
    }));
    let mut model = Model::new();
    harness.check(&model);
    let mut input = Bytes(data);
    for _ in 0..MAX_OPS {
        if input.0.is_empty() {
            break;
        }
        let op = input.op(&model);
        assert!(model.admits(&op), "decoded an inadmissible {op:?}");
        model.step(&op);
        harness.apply(&op, &model);
        harness.check(&model);
    }
}
