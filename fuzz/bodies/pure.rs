//! Fuzz body `pure`: the same operation runs as `transitions`, decided by
//! the pure transition function alone (`idemstore::fuzzing::Machine`: no
//! storage, no threads, no timers) and compared with the reference model
//! (`tests/reference/mod.rs`) after every step. Fast enough (no store to
//! open) for over a hundred thousand runs a second.
//!
//! What is compared after each step is what the step can have changed:
//! every answer, the record of the key it named (as a reader sees it) and
//! the number of kept records; every key's record after a sweep (which
//! evicts several) and whenever the store's time moved (which hides
//! records past retention); and every key's record at the end of the run.
//! That is the comparison of every key after every step: a machine's
//! records change only under the key an operation names (or by eviction),
//! and a reader's view of the others only with the time.
//!
//! Input checks (value sizes, lease bounds) happen in the store before the
//! transition, so an operation the model refuses for its input is not
//! given to the machine. Eviction (`sweep`) is the store's, not the
//! transition's: the machine forgets what the model evicted. Reopen and
//! clock moves change nothing the machine keeps (the model gives the
//! store's time).
//!
//! Included by `fuzz/fuzz_targets/pure.rs` and `tests/fuzz_corpus.rs`
//! (feature `fuzzing`).

#[path = "ops.rs"]
mod ops;

use std::sync::OnceLock;

use idemstore::fuzzing::Machine;
use idemstore::{ClaimOutcome, Error, Fingerprint, Key, Record, State};

use ops::reference::{
    DEFAULT_LEASE_MS, ErrKind, Expected, FINGERPRINT_COUNT, ForgedToken, KEY_COUNT, LeaseRef,
    MRecord, Model, Op, RETENTION_MS, fingerprint, key,
};

/// A description formatted only when an assertion fails and prints it.
struct Lazy<F: Fn() -> String>(F);

impl<F: Fn() -> String> std::fmt::Display for Lazy<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&(self.0)())
    }
}

/// The machine's token of the model's `index`-th lease: tokens start at 1
/// and the machine never skips one.
fn token_of(index: usize) -> u64 {
    u64::try_from(index).expect("few leases") + 1
}

/// The model's keys and fingerprints, built once per process (a key is
/// validated and a payload fingerprint hashed when built).
fn shared() -> &'static (Vec<Key>, Vec<Fingerprint>) {
    static SHARED: OnceLock<(Vec<Key>, Vec<Fingerprint>)> = OnceLock::new();
    SHARED.get_or_init(|| {
        (
            (0..KEY_COUNT).map(key).collect(),
            (0..FINGERPRINT_COUNT).map(fingerprint).collect(),
        )
    })
}

/// Which records a step can have changed, as a reader sees them.
enum Touched {
    /// None (a clock step back, a reopen, an input the store refuses).
    Nothing,
    /// The record of this model key.
    Key(usize),
    /// Any (a sweep).
    All,
}

struct Pure {
    machine: Machine,
    keys: &'static [Key],
    fingerprints: &'static [Fingerprint],
}

impl Pure {
    /// The key and token a lease reference presents.
    fn lease(&self, lease: LeaseRef, model: &Model) -> (usize, u64) {
        match lease {
            LeaseRef::Handed { index, .. } => (model.leases[index], token_of(index)),
            LeaseRef::Forged { key, token } => {
                let token = match token {
                    ForgedToken::Ahead(n) => {
                        token_of(model.leases.len()) + u64::from(n.clamp(1, 3)) - 1
                    }
                    ForgedToken::Max => u64::MAX,
                    ForgedToken::Borrowed(index) => token_of(index),
                };
                (key, token)
            }
        }
    }

    fn assert_record(
        &self,
        real: &Record,
        exp: &MRecord,
        key: usize,
        what: &dyn std::fmt::Display,
    ) {
        assert_eq!(real.key(), &self.keys[key], "{what}: key");
        assert_eq!(real.state(), exp.state, "{what}: state");
        assert_eq!(real.token(), token_of(exp.token), "{what}: fencing token");
        assert_eq!(
            real.fingerprint(),
            &self.fingerprints[exp.fp],
            "{what}: fingerprint"
        );
        assert_eq!(real.created_ms(), exp.created_ms, "{what}: created_ms");
        assert_eq!(real.updated_ms(), exp.updated_ms, "{what}: updated_ms");
        assert_eq!(
            real.lease_until_ms(),
            exp.lease_until_ms,
            "{what}: lease deadline"
        );
        assert_eq!(real.expires_ms(), exp.expires_ms, "{what}: expiry");
        assert_eq!(
            real.acquisitions(),
            exp.acquisitions,
            "{what}: acquisitions"
        );
        assert_eq!(
            real.recovery_point(),
            exp.recovery_point.as_deref(),
            "{what}: recovery point"
        );
        let (result, failure) = match exp.state {
            State::Succeeded => (exp.output.as_deref(), None),
            _ => (None, exp.output.as_deref()),
        };
        assert_eq!(real.result(), result, "{what}: result");
        assert_eq!(real.failure(), failure, "{what}: failure");
    }

    fn assert_err<T: std::fmt::Debug>(
        got: Result<T, Error>,
        expected: &Expected,
        what: &dyn std::fmt::Display,
    ) {
        let kind = match got {
            Ok(v) => panic!("{what}: got {v:?}, expected {expected:?}"),
            Err(Error::FingerprintMismatch { .. }) => ErrKind::FingerprintMismatch,
            Err(Error::StaleLease { .. }) => ErrKind::StaleLease,
            Err(other) => panic!("{what}: unexpected error {other}"),
        };
        assert_eq!(&Expected::Err(kind), expected, "{what}");
    }

    /// Runs `op` on the machine and compares its answer with the model's;
    /// returns which records it can have changed.
    fn apply(&mut self, op: &Op, model: &Model) -> Touched {
        let expected = &model.expected;
        // Refused for its input before any transition: not the machine's.
        if matches!(
            expected,
            Expected::Err(ErrKind::TooLarge | ErrKind::InvalidArgument)
        ) {
            return Touched::Nothing;
        }
        let now = model.store_now_ms;
        let what = Lazy(|| format!("op {op:?}, expected {expected:?}"));
        match op {
            Op::Claim { key, fp, lease_ms } => {
                let got = self.machine.claim(
                    &self.keys[*key],
                    &self.fingerprints[*fp],
                    lease_ms.unwrap_or(DEFAULT_LEASE_MS),
                    now,
                );
                match (got, expected) {
                    (Ok(ClaimOutcome::Acquired(lease)), Expected::Acquired(exp)) => {
                        assert_eq!(lease.token(), token_of(exp.token), "{what}: token");
                        let rec = lease
                            .record()
                            .expect("an acquired lease carries its record");
                        self.assert_record(rec, exp, *key, &what);
                        assert_eq!(
                            lease.is_takeover(),
                            exp.acquisitions > 1 || exp.recovery_point.is_some(),
                            "{what}: takeover flag"
                        );
                    }
                    (
                        Ok(ClaimOutcome::InProgress {
                            retry_after,
                            lease_until_ms,
                        }),
                        Expected::InProgress {
                            retry_after_ms,
                            lease_until_ms: until,
                        },
                    ) => {
                        assert_eq!(
                            (retry_after.as_millis(), lease_until_ms),
                            (u128::from(*retry_after_ms), *until),
                            "{what}"
                        );
                    }
                    (Ok(ClaimOutcome::Replay(rec)), Expected::Replay(exp)) => {
                        self.assert_record(&rec, exp, *key, &what);
                    }
                    (got, _) => Self::assert_err(got, expected, &what),
                }
                Touched::Key(*key)
            }
            Op::Complete { lease, result } => {
                let (k, token) = self.lease(*lease, model);
                let got = self.machine.finish(&self.keys[k], token, result, None, now);
                self.expect_finished(got, model, &what);
                Touched::Key(k)
            }
            Op::Fail {
                lease,
                failure,
                retryable,
            } => {
                let (k, token) = self.lease(*lease, model);
                let got = self
                    .machine
                    .finish(&self.keys[k], token, failure, Some(*retryable), now);
                self.expect_finished(got, model, &what);
                Touched::Key(k)
            }
            Op::Release { lease } => {
                let (k, token) = self.lease(*lease, model);
                match (self.machine.release(&self.keys[k], token, now), expected) {
                    (Ok(()), Expected::Done) => {}
                    (got, _) => Self::assert_err(got, expected, &what),
                }
                Touched::Key(k)
            }
            Op::Extend { lease, ms } => {
                let (k, token) = self.lease(*lease, model);
                match (
                    self.machine.extend(&self.keys[k], token, *ms, now),
                    expected,
                ) {
                    (Ok(until), Expected::Extended(exp)) => assert_eq!(until, *exp, "{what}"),
                    (got, _) => Self::assert_err(got, expected, &what),
                }
                Touched::Key(k)
            }
            Op::SetRecoveryPoint { lease, bytes } => {
                let (k, token) = self.lease(*lease, model);
                let got = self
                    .machine
                    .set_recovery_point(&self.keys[k], token, bytes, now);
                match (got, expected) {
                    (Ok(()), Expected::Done) => {}
                    (got, _) => Self::assert_err(got, expected, &what),
                }
                Touched::Key(k)
            }
            Op::Sweep { .. } => {
                for k in 0..KEY_COUNT {
                    if !model.records.contains_key(&k) {
                        self.machine.evict(&self.keys[k]);
                    }
                }
                Touched::All
            }
            // A read: the record it names is compared as a reader sees it.
            Op::Get { key } => Touched::Key(*key),
            // The store's time: compared with every record when it moved.
            Op::Advance { .. } | Op::StepBack { .. } | Op::Reopen => Touched::Nothing,
        }
    }

    fn expect_finished(
        &self,
        got: Result<Record, Error>,
        model: &Model,
        what: &dyn std::fmt::Display,
    ) {
        match (got, &model.expected) {
            (Ok(rec), Expected::Finished(exp)) => {
                self.assert_record(&rec, exp, model.leases[exp.token], what);
            }
            (got, exp) => Self::assert_err(got, exp, what),
        }
    }

    /// The record of model key `k` as a reader sees it now.
    fn check_key(&self, k: usize, model: &Model) {
        let now = model.store_now_ms;
        match (self.machine.get(&self.keys[k], now), model.visible(k, now)) {
            (None, None) => {}
            (Some(real), Some(exp)) => {
                self.assert_record(real, exp, k, &Lazy(|| format!("key {k}")))
            }
            (got, exp) => panic!("key {k}: machine has {got:?}, model has {exp:?}"),
        }
    }

    /// Every key's record as a reader sees it, and the kept count.
    fn check(&self, model: &Model) {
        for k in 0..KEY_COUNT {
            self.check_key(k, model);
        }
        assert_eq!(self.machine.len(), model.records.len(), "kept records");
    }
}

/// Runs the operations `data` encodes on the pure machine; panics on any
/// difference from the model.
pub fn pure(data: &[u8]) {
    let (keys, fingerprints) = shared();
    let mut pure = Pure {
        machine: Machine::new(RETENTION_MS),
        keys,
        fingerprints,
    };
    // The store's time at the last comparison of every record.
    let mut checked_at = None;
    let model = ops::run(data, |op, model| {
        match pure.apply(op, model) {
            Touched::All => checked_at = None,
            Touched::Key(k) => pure.check_key(k, model),
            Touched::Nothing => {}
        }
        if checked_at == Some(model.store_now_ms) {
            assert_eq!(pure.machine.len(), model.records.len(), "kept records");
        } else {
            pure.check(model);
            checked_at = Some(model.store_now_ms);
        }
    });
    pure.check(&model);
}
