//! The operation decoder shared by the `transitions` and `pure` fuzz
//! bodies: input bytes become a run of reference-model operations
//! (`tests/reference/mod.rs`), each admissible for the model as it stands.
//!
//! Included by `fuzz/bodies/transitions.rs` and `fuzz/bodies/pure.rs`.

#[path = "../../tests/reference/mod.rs"]
pub mod reference;

use reference::{
    FINGERPRINT_COUNT, ForgedToken, KEY_COUNT, LeaseRef, MAX_LEASE_MS, MAX_VALUE_BYTES, Model, Op,
};

/// The most operations one input runs.
pub const MAX_OPS: usize = 256;

/// The most `Reopen` operations one input runs; a later one decodes as a
/// `Get`. A reopen costs the store-level target (`transitions`) as much as
/// a hundred other operations, and coverage counters reward an input for
/// every further reopen (inputs of 16 reopens filled the corpus, at a
/// sixteenth of the rate), while a second reopen in a run checks the same
/// close and open as the first, at another state.
pub const MAX_REOPENS: usize = 1;

/// Decodes `data` into operations, steps a fresh model through each, and
/// calls `each` with the operation and the model after it. Returns the
/// model after the last operation.
pub fn run(data: &[u8], mut each: impl FnMut(&Op, &Model)) -> Model {
    let mut model = Model::new();
    let mut input = Bytes {
        rest: data,
        reopens: 0,
    };
    for _ in 0..MAX_OPS {
        if input.rest.is_empty() {
            break;
        }
        let op = input.op(&model);
        assert!(model.admits(&op), "decoded an inadmissible {op:?}");
        model.step(&op);
        each(&op, &model);
    }
    model
}

/// Reads the input a byte at a time; an exhausted input reads zeros, so
/// every prefix of an input is a valid run. Counts the reopens decoded.
struct Bytes<'a> {
    rest: &'a [u8],
    reopens: usize,
}

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.rest.split_first() {
            Some((&b, rest)) => {
                self.rest = rest;
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
            _ if self.reopens < MAX_REOPENS => {
                self.reopens += 1;
                Op::Reopen
            }
            _ => Op::Get {
                key: self.below(KEY_COUNT),
            },
        }
    }
}
