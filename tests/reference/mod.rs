//! A reference model of the store, written from `DESIGN.md` (and the public
//! API docs) alone, and a harness that runs the same operations against a
//! real [`Store`] and compares every answer.
//!
//! The model is deliberately naive: a map from key to record, a clock, and
//! the rules of "States and transitions" spelled out one by one. It never
//! calls the crate's own transition code, so a bug there cannot hide by
//! agreeing with itself.
//!
//! Shared by `tests/model.rs` (proptest-state-machine drives it),
//! `fuzz/bodies.rs` (the `transitions` fuzz target) and, through it,
//! `tests/fuzz_corpus.rs`.
//!
//! Where the design is silent the model picks the reading a careful user
//! would expect and says so:
//! - input errors (a value over its limit, a zero or over-long lease) are
//!   reported before state errors (a stale lease), and change nothing;
//! - `extend` never shortens a lease (the API docs say so);
//! - a takeover keeps the recovery point and the last failure for the new
//!   holder to see; `created_ms` is the first acquisition of the record;
//! - `sweep(max)` evicts exactly `min(max, due)` records, earliest expiry
//!   first, ties in stored-key order (the `Key` docs give the encoding).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use idemstore::{
    AcquiredFrom, ClaimOptions, ClaimOutcome, Config, Error, Fingerprint, Key, Lease, ManualClock,
    Record, State, Store,
};

/// Where every model run starts its clock (ms since the epoch).
pub const T0_MS: u64 = 1_700_000_000_000;
/// The store's retention in the model runs: short, so that runs cross it.
pub const RETENTION_MS: u64 = 60_000;
/// The store's default lease in the model runs (a claim without its own).
pub const DEFAULT_LEASE_MS: u64 = 20_000;
/// The limit for results, failures and recovery points (bytes): small, so
/// that runs cross it.
pub const MAX_VALUE_BYTES: usize = 8;
/// The longest lease the API accepts (30 days, `idemstore::MAX_LEASE`).
pub const MAX_LEASE_MS: u64 = 30 * 24 * 3600 * 1000;

/// Two scopes (tenant/operation) and three ids: six keys, some sharing an
/// id across scopes, one with multi-byte UTF-8.
pub const SCOPES: [&str; 2] = ["acme/tickets.create", "acme/payments.charge"];
pub const IDS: [&str; 3] = ["a", "task-42:call-7", "ключ-ü"];
pub const KEY_COUNT: usize = SCOPES.len() * IDS.len();
pub const FINGERPRINT_COUNT: usize = 3;

/// The `i`-th model key.
pub fn key(i: usize) -> Key {
    Key::new(SCOPES[i / IDS.len()], IDS[i % IDS.len()]).expect("model keys are valid")
}

/// The stored form of the `i`-th key, as the `Key` docs describe it (one
/// length byte, the scope, then the id): the expiry index orders ties by it.
fn key_bytes(i: usize) -> Vec<u8> {
    let (scope, id) = (SCOPES[i / IDS.len()], IDS[i % IDS.len()]);
    let mut out = vec![u8::try_from(scope.len()).expect("short scope")];
    out.extend_from_slice(scope.as_bytes());
    out.extend_from_slice(id.as_bytes());
    out
}

/// The `i`-th model fingerprint: two payload digests and one caller digest.
pub fn fingerprint(i: usize) -> Fingerprint {
    match i % FINGERPRINT_COUNT {
        0 => Fingerprint::of(b"{\"title\":\"printer on fire\"}"),
        1 => Fingerprint::of(b"{\"title\":\"something else\"}"),
        _ => Fingerprint::from_bytes(vec![7u8]).expect("one byte is a valid fingerprint"),
    }
}

/// The store configuration of the model runs: short retention, small value
/// limits, no background sweeper (the model decides eviction).
pub fn config(clock: &ManualClock) -> Config {
    Config::new()
        .retention(Duration::from_millis(RETENTION_MS))
        .lease(Duration::from_millis(DEFAULT_LEASE_MS))
        .max_result_bytes(MAX_VALUE_BYTES)
        .max_failure_bytes(MAX_VALUE_BYTES)
        .max_recovery_point_bytes(MAX_VALUE_BYTES)
        .sweep_interval(None)
        .clock(clock.clone())
}

/// One operation of a run.
#[derive(Clone, Debug)]
pub enum Op {
    /// Claim key `key` with fingerprint `fp`; `lease_ms` `None` uses the
    /// configured lease.
    Claim {
        key: usize,
        fp: usize,
        lease_ms: Option<u64>,
    },
    Complete {
        lease: LeaseRef,
        result: Vec<u8>,
    },
    Fail {
        lease: LeaseRef,
        failure: Vec<u8>,
        retryable: bool,
    },
    Release {
        lease: LeaseRef,
    },
    Extend {
        lease: LeaseRef,
        ms: u64,
    },
    SetRecoveryPoint {
        lease: LeaseRef,
        bytes: Vec<u8>,
    },
    Get {
        key: usize,
    },
    /// Move the clock forward.
    Advance {
        ms: u64,
    },
    /// Move the clock back (a stepped system clock).
    StepBack {
        ms: u64,
    },
    Sweep {
        max: usize,
    },
    /// Drop the store and open the file again.
    Reopen,
}

/// Which lease an operation presents.
#[derive(Clone, Copy, Debug)]
pub enum LeaseRef {
    /// The `index`-th lease handed out by a claim (current or stale), as
    /// returned, or rebuilt with `Lease::from_parts` from its key and token.
    Handed { index: usize, rebuilt: bool },
    /// A lease rebuilt for model key `key` with a token the store never
    /// issued to that key's current record.
    Forged { key: usize, token: ForgedToken },
}

/// The token of a forged lease.
#[derive(Clone, Copy, Debug)]
pub enum ForgedToken {
    /// `n` (1 to 3) past the largest token issued so far: not issued yet.
    Ahead(u8),
    /// `u64::MAX`.
    Max,
    /// The token of the `index`-th handed lease (usually another key's).
    Borrowed(usize),
}

/// A record as the model keeps it. `token` is the index of the lease that
/// acquired it in [`Model::leases`]: the harness maps it to the real token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MRecord {
    pub state: State,
    pub token: usize,
    pub fp: usize,
    pub created_ms: u64,
    pub updated_ms: u64,
    pub lease_until_ms: u64,
    pub expires_ms: u64,
    /// Result (Succeeded), failure (Failed), or the last failure while
    /// Processing after a retryable failure.
    pub output: Option<Vec<u8>>,
    pub recovery_point: Option<Vec<u8>>,
    pub acquisitions: u32,
}

/// Error kinds the model predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrKind {
    FingerprintMismatch,
    StaleLease,
    TooLarge,
    InvalidArgument,
}

/// What the model expects the latest operation to answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Clock moves and reopen answer nothing.
    Nothing,
    /// A new lease; its index in [`Model::leases`] is `record.token`.
    Acquired(MRecord),
    InProgress {
        retry_after_ms: u64,
        lease_until_ms: u64,
    },
    Replay(MRecord),
    /// The record `complete` or `fail` returns.
    Finished(MRecord),
    /// The lease deadline `extend` returns.
    Extended(u64),
    /// `release` and `set_recovery_point` answer `()`.
    Done,
    Got(Option<MRecord>),
    Swept(usize),
    Err(ErrKind),
}

/// The reference model.
#[derive(Clone, Debug)]
pub struct Model {
    /// What the manual clock reads.
    pub clock_ms: u64,
    /// The store's time (`src/clock.rs`): the larger of the clock's wall
    /// reading and the store's earlier time plus the monotonic time elapsed
    /// since. `Advance` moves both readings, `StepBack` only the wall
    /// reading, so after a step back the store's time keeps moving with
    /// `Advance`. It never goes back, not even across a reopen.
    pub store_now_ms: u64,
    /// Stored records, including those past retention not yet evicted.
    pub records: BTreeMap<usize, MRecord>,
    /// The key of every lease handed out, in the order handed out (which
    /// is token order).
    pub leases: Vec<usize>,
    /// The answer the latest operation must give.
    pub expected: Expected,
    /// What the latest claim that acquired found the key in.
    pub acquired_from: Option<AcquiredFrom>,
}

impl Default for Model {
    fn default() -> Self {
        Model::new()
    }
}

impl Model {
    pub fn new() -> Model {
        Model {
            clock_ms: T0_MS,
            store_now_ms: T0_MS,
            records: BTreeMap::new(),
            leases: Vec::new(),
            expected: Expected::Nothing,
            acquired_from: None,
        }
    }

    /// Whether `op` refers only to leases that exist (shrinking can remove
    /// the claim that handed one out).
    pub fn admits(&self, op: &Op) -> bool {
        let ok = |l: &LeaseRef| match *l {
            LeaseRef::Handed { index, .. } => index < self.leases.len(),
            LeaseRef::Forged {
                key,
                token: ForgedToken::Borrowed(index),
            } => key < KEY_COUNT && index < self.leases.len(),
            LeaseRef::Forged { key, .. } => key < KEY_COUNT,
        };
        match op {
            Op::Claim { key, fp, .. } => *key < KEY_COUNT && *fp < FINGERPRINT_COUNT,
            Op::Get { key } => *key < KEY_COUNT,
            Op::Complete { lease, .. }
            | Op::Fail { lease, .. }
            | Op::Release { lease }
            | Op::Extend { lease, .. }
            | Op::SetRecoveryPoint { lease, .. } => ok(lease),
            Op::Advance { .. } | Op::StepBack { .. } | Op::Sweep { .. } | Op::Reopen => true,
        }
    }

    /// The store reads the clock: its time is the larger of its earlier
    /// time (moved by `Advance`) and the wall reading.
    fn tick(&mut self) -> u64 {
        self.store_now_ms = self.store_now_ms.max(self.clock_ms);
        self.store_now_ms
    }

    /// The record of `key` as readers see it at `now`: absent once past
    /// retention, whether or not it was evicted.
    pub fn visible(&self, key: usize, now: u64) -> Option<&MRecord> {
        self.records.get(&key).filter(|r| now < r.expires_ms)
    }

    /// Records visible now.
    pub fn live_count(&self) -> usize {
        (0..KEY_COUNT)
            .filter(|k| self.visible(*k, self.store_now_ms).is_some())
            .count()
    }

    /// The key a lease names and the model token it carries (`None`: a
    /// token never issued).
    fn resolve(&self, lease: LeaseRef) -> (usize, Option<usize>) {
        match lease {
            LeaseRef::Handed { index, .. } => (self.leases[index], Some(index)),
            LeaseRef::Forged {
                key,
                token: ForgedToken::Borrowed(index),
            } => (key, Some(index)),
            LeaseRef::Forged { key, .. } => (key, None),
        }
    }

    /// The key whose record `lease` may change now: the record is visible,
    /// Processing, and carries the lease's token (lapsed or not).
    fn holder(&self, lease: LeaseRef, now: u64) -> Result<usize, ErrKind> {
        let (key, token) = self.resolve(lease);
        match self.visible(key, now) {
            Some(r) if r.state == State::Processing && Some(r.token) == token => Ok(key),
            _ => Err(ErrKind::StaleLease),
        }
    }

    /// Applies `op` and sets [`Model::expected`] to what it must answer.
    pub fn step(&mut self, op: &Op) {
        let now = self.tick();
        self.expected = match op {
            Op::Claim { key, fp, lease_ms } => self.claim(*key, *fp, *lease_ms, now),
            Op::Complete { lease, result } => self.finish(*lease, State::Succeeded, result, now),
            Op::Fail {
                lease,
                failure,
                retryable,
            } => self.finish(
                *lease,
                State::Failed {
                    retryable: *retryable,
                },
                failure,
                now,
            ),
            Op::Release { lease } => match self.holder(*lease, now) {
                Ok(key) => {
                    self.records.remove(&key);
                    Expected::Done
                }
                Err(e) => Expected::Err(e),
            },
            Op::Extend { lease, ms } => {
                if *ms == 0 || *ms > MAX_LEASE_MS {
                    Expected::Err(ErrKind::InvalidArgument)
                } else {
                    match self.holder(*lease, now) {
                        Ok(key) => {
                            let r = self.records.get_mut(&key).expect("holder has a record");
                            r.lease_until_ms = r.lease_until_ms.max(now + ms);
                            r.expires_ms = (now + RETENTION_MS).max(r.lease_until_ms);
                            r.updated_ms = now;
                            Expected::Extended(r.lease_until_ms)
                        }
                        Err(e) => Expected::Err(e),
                    }
                }
            }
            Op::SetRecoveryPoint { lease, bytes } => {
                if bytes.len() > MAX_VALUE_BYTES {
                    Expected::Err(ErrKind::TooLarge)
                } else {
                    match self.holder(*lease, now) {
                        Ok(key) => {
                            let r = self.records.get_mut(&key).expect("holder has a record");
                            r.recovery_point = Some(bytes.clone());
                            r.updated_ms = now;
                            Expected::Done
                        }
                        Err(e) => Expected::Err(e),
                    }
                }
            }
            Op::Get { key } => Expected::Got(self.visible(*key, now).cloned()),
            Op::Advance { ms } => {
                // Time passes: the wall reading and the store's time both move.
                self.clock_ms = self.clock_ms.saturating_add(*ms);
                self.store_now_ms = self.store_now_ms.saturating_add(*ms);
                Expected::Nothing
            }
            Op::StepBack { ms } => {
                self.clock_ms = self.clock_ms.saturating_sub(*ms);
                Expected::Nothing
            }
            Op::Sweep { max } => {
                let mut due: Vec<(u64, Vec<u8>, usize)> = self
                    .records
                    .iter()
                    .filter(|(_, r)| r.expires_ms <= now)
                    .map(|(k, r)| (r.expires_ms, key_bytes(*k), *k))
                    .collect();
                due.sort();
                let n = due.len().min(*max);
                for (_, _, k) in &due[..n] {
                    self.records.remove(k);
                }
                Expected::Swept(n)
            }
            Op::Reopen => Expected::Nothing,
        };
        // The harness reads the store after every step.
        self.tick();
    }

    fn claim(&mut self, key: usize, fp: usize, lease_ms: Option<u64>, now: u64) -> Expected {
        let lease_ms = lease_ms.unwrap_or(DEFAULT_LEASE_MS);
        if lease_ms == 0 || lease_ms > MAX_LEASE_MS {
            return Expected::Err(ErrKind::InvalidArgument);
        }
        let lease_until = now + lease_ms;
        let expires = (now + RETENTION_MS).max(lease_until);
        let token = self.leases.len();
        let from = match self.visible(key, now) {
            None => AcquiredFrom::Absent,
            Some(r) if r.state == State::Processing => AcquiredFrom::LapsedLease,
            Some(_) => AcquiredFrom::RetryableFailure,
        };
        let acquired = match self.visible(key, now) {
            None => MRecord {
                state: State::Processing,
                token,
                fp,
                created_ms: now,
                updated_ms: now,
                lease_until_ms: lease_until,
                expires_ms: expires,
                output: None,
                recovery_point: None,
                acquisitions: 1,
            },
            Some(r) if r.fp != fp => return Expected::Err(ErrKind::FingerprintMismatch),
            Some(r) if r.state == State::Processing && now < r.lease_until_ms => {
                return Expected::InProgress {
                    retry_after_ms: r.lease_until_ms - now,
                    lease_until_ms: r.lease_until_ms,
                };
            }
            Some(r)
                if matches!(
                    r.state,
                    State::Succeeded | State::Failed { retryable: false }
                ) =>
            {
                return Expected::Replay(r.clone());
            }
            // A lapsed lease or a retryable failure: taken over with a new
            // token; the recovery point and the last failure stay.
            Some(r) => MRecord {
                state: State::Processing,
                token,
                updated_ms: now,
                lease_until_ms: lease_until,
                expires_ms: expires,
                acquisitions: r.acquisitions + 1,
                ..r.clone()
            },
        };
        self.leases.push(key);
        self.records.insert(key, acquired.clone());
        self.acquired_from = Some(from);
        Expected::Acquired(acquired)
    }

    fn finish(&mut self, lease: LeaseRef, state: State, bytes: &[u8], now: u64) -> Expected {
        if bytes.len() > MAX_VALUE_BYTES {
            return Expected::Err(ErrKind::TooLarge);
        }
        match self.holder(lease, now) {
            Ok(key) => {
                let r = self.records.get_mut(&key).expect("holder has a record");
                r.state = state;
                r.output = Some(bytes.to_vec());
                r.updated_ms = now;
                r.expires_ms = now + RETENTION_MS;
                Expected::Finished(r.clone())
            }
            Err(e) => Expected::Err(e),
        }
    }
}

/// Runs operations against a real store and checks its answers against the
/// model's. Every mismatch panics with the operation and both answers.
pub struct Harness {
    clock: ManualClock,
    store: Option<Store>,
    open: Box<dyn FnMut(Config) -> Store>,
    /// The real leases, parallel to [`Model::leases`].
    leases: Vec<Lease>,
    /// The largest token issued so far.
    max_token: u64,
    /// How far the store's time is ahead of the model's (ms): 0 for a new
    /// store, the time earlier runs moved it on for a resumed one.
    offset_ms: u64,
    keys: Vec<Key>,
    fingerprints: Vec<Fingerprint>,
}

/// What a run leaves for the next one on the same store (see
/// [`Harness::resume`]).
pub struct Resumable {
    pub clock: ManualClock,
    pub store: Store,
    pub open: Box<dyn FnMut(Config) -> Store>,
    /// The largest token the store has issued.
    pub max_token: u64,
}

impl Harness {
    /// A harness whose store `open` opens (and reopens: it must open the
    /// same storage each time) with the model's [`config`].
    pub fn new(mut open: Box<dyn FnMut(Config) -> Store>) -> Harness {
        let clock = ManualClock::new(T0_MS);
        let store = open(config(&clock));
        Harness {
            clock,
            store: Some(store),
            open,
            leases: Vec::new(),
            max_token: 0,
            offset_ms: 0,
            keys: (0..KEY_COUNT).map(key).collect(),
            fingerprints: (0..FINGERPRINT_COUNT).map(fingerprint).collect(),
        }
    }

    /// A harness on the store an earlier run left ([`Harness::end`]), so
    /// that a run costs no store to open. Its records are evicted first:
    /// the clock moves on past every record of `last` (the model of the
    /// run that left it, `None` if none did), the wall reading is set to
    /// the store's time, and a sweep must evict exactly the records
    /// `last` kept, leaving the store empty. The model's time (from
    /// [`T0_MS`]) then maps to the store's time from there on.
    pub fn resume(left: Resumable, last: Option<&Model>) -> Harness {
        let Resumable {
            clock,
            store,
            open,
            max_token,
        } = left;
        let now = store.now_ms();
        let kept = last.map_or(0, |m| m.records.len());
        // A model's times are its own; `now` is the store's time for the
        // model's `store_now_ms`.
        let due = last
            .and_then(|m| {
                m.records
                    .values()
                    .map(|r| (now + r.expires_ms).saturating_sub(m.store_now_ms))
                    .max()
            })
            .unwrap_or(now);
        let start = now.max(due).max(T0_MS);
        clock.advance(Duration::from_millis(start - now));
        clock.set_ms(start);
        assert_eq!(
            store.now_ms(),
            start,
            "store time after the move to the next run"
        );
        let swept = store
            .sweep(usize::MAX)
            .expect("sweep the earlier run's records");
        assert_eq!(swept, kept, "records of the earlier run evicted");
        assert_eq!(store.len().expect("len"), 0, "records left after the sweep");
        Harness {
            clock,
            store: Some(store),
            open,
            leases: Vec::new(),
            max_token,
            offset_ms: start - T0_MS,
            keys: (0..KEY_COUNT).map(key).collect(),
            fingerprints: (0..FINGERPRINT_COUNT).map(fingerprint).collect(),
        }
    }

    /// Ends a run, handing its store to the next ([`Harness::resume`]).
    pub fn end(mut self) -> Resumable {
        Resumable {
            store: self.store.take().expect("the store is open between steps"),
            clock: self.clock,
            open: self.open,
            max_token: self.max_token,
        }
    }

    /// The store's time for the model's time `ms`.
    fn at(&self, ms: u64) -> u64 {
        ms + self.offset_ms
    }

    fn store(&self) -> &Store {
        self.store
            .as_ref()
            .expect("the store is open between steps")
    }

    fn lease(&self, lease: LeaseRef) -> Lease {
        match lease {
            LeaseRef::Handed {
                index,
                rebuilt: false,
            } => self.leases[index].clone(),
            LeaseRef::Handed {
                index,
                rebuilt: true,
            } => {
                let l = &self.leases[index];
                Lease::from_parts(l.key().clone(), l.token())
            }
            LeaseRef::Forged { key, token } => {
                let token = match token {
                    ForgedToken::Ahead(n) => self.max_token + u64::from(n.clamp(1, 3)),
                    ForgedToken::Max => u64::MAX,
                    ForgedToken::Borrowed(index) => self.leases[index].token(),
                };
                Lease::from_parts(self.keys[key].clone(), token)
            }
        }
    }

    /// Runs `op` on the store and compares the answer with
    /// `model.expected`; `model` is the state after the step.
    pub fn apply(&mut self, op: &Op, model: &Model) {
        let expected = &model.expected;
        let ctx = |what: &str| format!("{what}: op {op:?}, expected {expected:?}");
        match op {
            Op::Claim { key, fp, lease_ms } => {
                let mut options = ClaimOptions::new();
                if let Some(ms) = lease_ms {
                    options = options.lease(Duration::from_millis(*ms));
                }
                let got = self
                    .store()
                    .claim(&self.keys[*key], &self.fingerprints[*fp], &options);
                match (got, expected) {
                    (Ok(ClaimOutcome::Acquired(lease)), Expected::Acquired(exp)) => {
                        assert_eq!(exp.token, self.leases.len(), "{}", ctx("lease index"));
                        assert!(
                            lease.token() > self.max_token,
                            "{}",
                            ctx(&format!(
                                "token {} does not grow past {}",
                                lease.token(),
                                self.max_token
                            ))
                        );
                        self.max_token = lease.token();
                        assert_eq!(lease.key(), &self.keys[*key], "{}", ctx("lease key"));
                        self.leases.push(lease.clone());
                        let rec = lease
                            .record()
                            .expect("an acquired lease carries its record");
                        self.assert_record(rec, exp, *key, &ctx("acquired record"));
                        assert_eq!(
                            lease.lease_until_ms(),
                            Some(self.at(exp.lease_until_ms)),
                            "{}",
                            ctx("lease deadline")
                        );
                        assert_eq!(
                            lease.recovery_point(),
                            exp.recovery_point.as_deref(),
                            "{}",
                            ctx("recovery point handed over")
                        );
                        assert_eq!(
                            lease.is_takeover(),
                            exp.acquisitions > 1 || exp.recovery_point.is_some(),
                            "{}",
                            ctx("takeover flag")
                        );
                        assert_eq!(
                            lease.acquired_from(),
                            model.acquired_from,
                            "{}",
                            ctx("what the claim found")
                        );
                    }
                    (
                        Ok(ClaimOutcome::InProgress {
                            retry_after,
                            lease_until_ms,
                        }),
                        Expected::InProgress {
                            retry_after_ms,
                            lease_until_ms: exp_until,
                        },
                    ) => {
                        assert_eq!(
                            (retry_after, lease_until_ms),
                            (Duration::from_millis(*retry_after_ms), self.at(*exp_until)),
                            "{}",
                            ctx("in progress")
                        );
                        assert!(!retry_after.is_zero(), "{}", ctx("retry_after > 0"));
                    }
                    (Ok(ClaimOutcome::Replay(rec)), Expected::Replay(exp)) => {
                        self.assert_record(&rec, exp, *key, &ctx("replayed record"));
                    }
                    (got, _) => self.assert_err(got, expected, &ctx("claim")),
                }
            }
            Op::Complete { lease, result } => {
                let got = self.store().complete(&self.lease(*lease), result);
                self.expect_finished(got, model, &ctx("complete"));
            }
            Op::Fail {
                lease,
                failure,
                retryable,
            } => {
                let got = self.store().fail(&self.lease(*lease), failure, *retryable);
                self.expect_finished(got, model, &ctx("fail"));
            }
            Op::Release { lease } => {
                let got = self.store().release(self.lease(*lease));
                match (got, expected) {
                    (Ok(()), Expected::Done) => {}
                    (got, _) => self.assert_err(got, expected, &ctx("release")),
                }
            }
            Op::Extend { lease, ms } => {
                let got = self
                    .store()
                    .extend(&self.lease(*lease), Duration::from_millis(*ms));
                match (got, expected) {
                    (Ok(until), Expected::Extended(exp)) => {
                        assert_eq!(until, self.at(*exp), "{}", ctx("extended deadline"));
                    }
                    (got, _) => self.assert_err(got, expected, &ctx("extend")),
                }
            }
            Op::SetRecoveryPoint { lease, bytes } => {
                let got = self.store().set_recovery_point(&self.lease(*lease), bytes);
                match (got, expected) {
                    (Ok(()), Expected::Done) => {}
                    (got, _) => self.assert_err(got, expected, &ctx("set_recovery_point")),
                }
            }
            Op::Get { key } => {
                let got = self.store().get(&self.keys[*key]);
                match (got, expected) {
                    (Ok(None), Expected::Got(None)) => {}
                    (Ok(Some(rec)), Expected::Got(Some(exp))) => {
                        self.assert_record(&rec, exp, *key, &ctx("get"));
                    }
                    (got, _) => self.assert_err(got, expected, &ctx("get")),
                }
            }
            Op::Advance { ms } => self.clock.advance(Duration::from_millis(*ms)),
            Op::StepBack { ms } => self.clock.step_back(Duration::from_millis(*ms)),
            Op::Sweep { max } => {
                let got = self.store().sweep(*max);
                match (got, expected) {
                    (Ok(n), Expected::Swept(exp)) => {
                        assert_eq!(n, *exp, "{}", ctx("evicted"));
                    }
                    (got, _) => self.assert_err(got, expected, &ctx("sweep")),
                }
            }
            Op::Reopen => {
                // Drop first: the file is locked while a store holds it.
                self.store = None;
                self.store = Some((self.open)(config(&self.clock)));
            }
        }
    }

    fn expect_finished(&self, got: Result<Record, Error>, model: &Model, what: &str) {
        match (got, &model.expected) {
            (Ok(rec), Expected::Finished(exp)) => {
                let key = model.leases[exp.token];
                self.assert_record(&rec, exp, key, what);
            }
            (got, exp) => self.assert_err(got, exp, what),
        }
    }

    /// `got` did not match the expected success: it must be the expected
    /// error.
    fn assert_err<T: std::fmt::Debug>(
        &self,
        got: Result<T, Error>,
        expected: &Expected,
        what: &str,
    ) {
        let err = match got {
            Ok(v) => panic!("{what}: got {v:?}"),
            Err(e) => e,
        };
        let kind = match &err {
            Error::FingerprintMismatch { .. } => ErrKind::FingerprintMismatch,
            Error::StaleLease { .. } => ErrKind::StaleLease,
            Error::TooLarge { .. } => ErrKind::TooLarge,
            Error::InvalidArgument { .. } => ErrKind::InvalidArgument,
            other => panic!("{what}: unexpected error {other}"),
        };
        assert_eq!(&Expected::Err(kind), expected, "{what}: got error {err}");
    }

    fn assert_record(&self, real: &Record, exp: &MRecord, key: usize, what: &str) {
        let real_token = self.leases[exp.token].token();
        assert_eq!(real.key(), &self.keys[key], "{what}: key");
        assert_eq!(real.state(), exp.state, "{what}: state");
        assert_eq!(real.token(), real_token, "{what}: fencing token");
        assert_eq!(
            real.fingerprint(),
            &self.fingerprints[exp.fp],
            "{what}: fingerprint"
        );
        assert_eq!(
            real.created_ms(),
            self.at(exp.created_ms),
            "{what}: created_ms"
        );
        assert_eq!(
            real.updated_ms(),
            self.at(exp.updated_ms),
            "{what}: updated_ms"
        );
        assert_eq!(
            real.lease_until_ms(),
            self.at(exp.lease_until_ms),
            "{what}: lease deadline"
        );
        assert_eq!(real.expires_ms(), self.at(exp.expires_ms), "{what}: expiry");
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
        assert_eq!(real.business_key(), None, "{what}: business key");
        let (result, failure) = match exp.state {
            State::Succeeded => (exp.output.as_deref(), None),
            _ => (None, exp.output.as_deref()),
        };
        assert_eq!(real.result(), result, "{what}: result");
        assert_eq!(real.failure(), failure, "{what}: failure");
    }

    /// Checks the whole store against the model after a step: the store's
    /// time, every key's record, the record count, and the invariants (one
    /// valid lease per key, every Processing record has lease deadline ≤
    /// expiry, tokens only grow).
    pub fn check(&self, model: &Model) {
        self.check_keys(model, 0..KEY_COUNT);
    }

    /// [`Harness::check`] for the records of `keys` only (the store's time
    /// and its number of stored records are always compared): after a step
    /// that can only have changed the record of the key it names, the
    /// others are as the last full check found them.
    pub fn check_keys(&self, model: &Model, keys: impl IntoIterator<Item = usize>) {
        let store = self.store();
        let now = store.now_ms();
        assert_eq!(
            now,
            self.at(model.store_now_ms),
            "store time (the clock never runs backwards, even across a reopen)"
        );
        for k in keys {
            let got = store.get(&self.keys[k]).expect("get");
            let exp = model.visible(k, model.store_now_ms);
            match (&got, exp) {
                (None, None) => {}
                (Some(real), Some(exp)) => self.assert_record(real, exp, k, &format!("key {k}")),
                _ => panic!("key {k}: store has {got:?}, model has {exp:?}"),
            }
            if let Some(real) = &got {
                if real.state() == State::Processing {
                    assert!(
                        real.lease_until_ms() <= real.expires_ms(),
                        "key {k}: lease deadline after expiry: {real:?}"
                    );
                }
                let valid = self
                    .leases
                    .iter()
                    .filter(|l| l.key() == &self.keys[k] && l.token() == real.token())
                    .filter(|_| real.lease_valid_at(now))
                    .count();
                assert!(valid <= 1, "key {k}: {valid} valid leases");
            }
        }
        let len = store.len().expect("len");
        let live = model.live_count() as u64;
        assert!(len >= live, "len {len} < live records {live}");
        assert_eq!(
            len,
            model.records.len() as u64,
            "stored records (live plus expired, not yet evicted)"
        );
    }
}
