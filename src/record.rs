//! Records, their states, and the pure transition function at the centre of
//! the store: `(record, request, now) -> (new record, outcome)`.
//!
//! Nothing here does I/O. The writer feeds every state change through
//! [`transition`] inside one write, so each change is a compare-and-set of
//! state and fencing token (DESIGN.md, "States and transitions").

use std::time::Duration;

use crate::error::{Error, Result};
use crate::key::{Fingerprint, Key};

/// The state of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// A lease holder is running the work.
    Processing,
    /// The work finished; the result is stored and replayed until retention ends.
    Succeeded,
    /// The work failed. A permanent failure is replayed until retention
    /// ends; a retryable one is kept only so that the next claim acquires
    /// it (with a new token) and sees the failure.
    Failed {
        /// Whether the next claim may run the work again.
        retryable: bool,
    },
}

impl State {
    /// A short lowercase name: `processing`, `succeeded`, `failed`,
    /// `failed-retryable`.
    pub fn name(self) -> &'static str {
        match self {
            State::Processing => "processing",
            State::Succeeded => "succeeded",
            State::Failed { retryable: false } => "failed",
            State::Failed { retryable: true } => "failed-retryable",
        }
    }
}

/// What the store keeps per key.
///
/// All times are milliseconds since the Unix epoch, as read from the store's
/// [`Clock`](crate::Clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub(crate) key: Key,
    pub(crate) state: State,
    pub(crate) token: u64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) created_ms: u64,
    pub(crate) updated_ms: u64,
    pub(crate) lease_until_ms: u64,
    pub(crate) expires_ms: u64,
    /// The result (Succeeded), the failure (Failed), or, while Processing
    /// after a retryable failure, that earlier failure.
    pub(crate) output: Option<Vec<u8>>,
    pub(crate) recovery_point: Option<Vec<u8>>,
    pub(crate) business_key: Option<String>,
    pub(crate) acquisitions: u32,
}

impl Record {
    /// The idempotency key.
    pub fn key(&self) -> &Key {
        &self.key
    }
    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }
    /// The fencing token of the latest acquisition.
    pub fn token(&self) -> u64 {
        self.token
    }
    /// The fingerprint that binds the key.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
    /// When the key was first acquired (ms since the epoch).
    pub fn created_ms(&self) -> u64 {
        self.created_ms
    }
    /// When the record last changed (ms since the epoch).
    pub fn updated_ms(&self) -> u64 {
        self.updated_ms
    }
    /// The deadline of the latest lease (ms since the epoch); the lease is
    /// valid while `now < lease_until_ms`.
    pub fn lease_until_ms(&self) -> u64 {
        self.lease_until_ms
    }
    /// When retention ends (ms since the epoch): from then on the record is
    /// absent to every read and claim, whether or not eviction has run.
    pub fn expires_ms(&self) -> u64 {
        self.expires_ms
    }
    /// The stored result, when the state is [`State::Succeeded`].
    pub fn result(&self) -> Option<&[u8]> {
        match self.state {
            State::Succeeded => self.output.as_deref(),
            _ => None,
        }
    }
    /// The stored failure when the state is [`State::Failed`], or, while
    /// [`State::Processing`] after a retryable failure, that earlier failure.
    pub fn failure(&self) -> Option<&[u8]> {
        match self.state {
            State::Succeeded => None,
            _ => self.output.as_deref(),
        }
    }
    /// The latest recovery point saved under a lease, if any.
    pub fn recovery_point(&self) -> Option<&[u8]> {
        self.recovery_point.as_deref()
    }
    /// The business key bound with the record, if the claim carried one.
    pub fn business_key(&self) -> Option<&str> {
        self.business_key.as_deref()
    }
    /// How many times the key was acquired (1 for the first claim; more
    /// after takeovers of lapsed leases and retries of retryable failures).
    pub fn acquisitions(&self) -> u32 {
        self.acquisitions
    }
    /// Whether the lease is valid at `now_ms` (ms since the epoch), judged
    /// as a claim judges it: at `now_ms` or the record's last update,
    /// whichever is later. A record updated later than `now_ms` (imported
    /// from a clock ahead, or written by another replica at a later
    /// database time) whose lease ended before that update, as after a
    /// recovery point saved once the lease had lapsed, is lapsed: a claim
    /// takes it over.
    pub fn lease_valid_at(&self, now_ms: u64) -> bool {
        self.state == State::Processing && now_ms.max(self.updated_ms) < self.lease_until_ms
    }
    /// Whether retention has ended at `now_ms` (the record is then absent).
    pub fn is_expired_at(&self, now_ms: u64) -> bool {
        is_expired(self.expires_ms, now_ms)
    }
}

/// The retention rule, in one place: a record is absent from its expiry on.
pub(crate) fn is_expired(expires_ms: u64, now_ms: u64) -> bool {
    now_ms >= expires_ms
}

/// The right to run the work for a key, and to finish it: key plus fencing
/// token.
///
/// Only the current lease may complete, fail, release, extend or set a
/// recovery point. A holder whose lease lapsed may still do so while nobody
/// has taken the key over; after a takeover its calls get
/// [`Error::StaleLease`] and change nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    key: Key,
    token: u64,
    acquired: Option<Box<Record>>,
    from: Option<AcquiredFrom>,
}

/// What the claim that made a lease found the key in: decided by the claim
/// itself, in the same step as the acquisition, so that no write between a
/// read and the claim can change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AcquiredFrom {
    /// No live record: the first acquisition (or the first after
    /// retention ended).
    Absent,
    /// Processing under a lease that lapsed without an outcome: the
    /// earlier holder may have acted (it crashed mid-effect, or is still
    /// running), so running again is in doubt. (On PostgreSQL, a claim
    /// whose new lease lapsed while its insert waited for a lock, a lease
    /// shorter than `lock_timeout` behind an import, say, is decided again
    /// and takes its own row over: this, though nobody held that lease.)
    LapsedLease,
    /// Failed with a retryable failure. What that says of the earlier
    /// attempt is its recorder's: `Store::execute` (feature `agent`)
    /// records one when the work returned a retryable failure (it may run
    /// again, as Powertools and Stripe retry such a failure), while the
    /// HTTP layer records one where an attempt acted or may have (a client
    /// gone mid-handler, a release refused on a takeover: docs/http.md).
    /// Check [`Lease::is_takeover`] and [`Lease::recovery_point`] before
    /// acting again.
    RetryableFailure,
}

impl Lease {
    pub(crate) fn acquired(record: Record, from: AcquiredFrom) -> Lease {
        Lease {
            key: record.key.clone(),
            token: record.token,
            acquired: Some(Box::new(record)),
            from: Some(from),
        }
    }

    /// Rebuilds a lease from its key and fencing token, saved by an
    /// orchestrator that restarted. Knowing the token gives no more power
    /// than holding the lease: the store checks it against the record on
    /// every write. A rebuilt lease knows nothing of the record as acquired
    /// ([`Lease::record`] is `None`); use [`Store::get`](crate::Store::get).
    pub fn from_parts(key: Key, token: u64) -> Lease {
        Lease {
            key,
            token,
            acquired: None,
            from: None,
        }
    }

    /// The key the lease holds.
    pub fn key(&self) -> &Key {
        &self.key
    }
    /// The fencing token: unique across the store, never reused.
    pub fn token(&self) -> u64 {
        self.token
    }
    /// The record as it was acquired (`None` for a rebuilt lease).
    pub fn record(&self) -> Option<&Record> {
        self.acquired.as_deref()
    }
    /// The lease deadline at acquisition (ms since the epoch); `None` for a
    /// rebuilt lease.
    pub fn lease_until_ms(&self) -> Option<u64> {
        self.record().map(Record::lease_until_ms)
    }
    /// What the claim found the key in: absent, a lapsed lease, or a
    /// retryable failure (`None` for a rebuilt lease). A lapsed lease is
    /// the takeover whose earlier holder may have acted without recording
    /// it: `Store::execute`'s in-doubt policy applies to it alone.
    pub fn acquired_from(&self) -> Option<AcquiredFrom> {
        self.from
    }
    /// The recovery point left by an earlier holder, if any.
    pub fn recovery_point(&self) -> Option<&[u8]> {
        self.record().and_then(Record::recovery_point)
    }
    /// Whether an earlier holder may have acted: the key was acquired
    /// before (a takeover of a lapsed lease or a retry after a retryable
    /// failure) or carries a recovery point. The executing side should then
    /// ask the downstream system what happened before acting again
    /// ("query instead of replay", DESIGN.md).
    pub fn is_takeover(&self) -> bool {
        self.record()
            .is_some_and(|r| r.acquisitions > 1 || r.recovery_point.is_some())
    }
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum ClaimOutcome {
    /// The caller holds the key: run the work, then complete, fail or
    /// release. HTTP: run the handler.
    Acquired(Lease),
    /// Another valid lease holds the key. HTTP 409 with `Retry-After`.
    InProgress {
        /// How long until that lease lapses: `0 < retry_after ≤ lease`.
        retry_after: Duration,
        /// The holder's lease deadline (ms since the epoch).
        lease_until_ms: u64,
    },
    /// The work already finished (succeeded, or failed permanently) with
    /// the same fingerprint: replay the stored outcome. HTTP: the stored
    /// response with `Idempotent-Replayed: true`.
    Replay(Record),
}

/// How an operator (or a reconciler that asked the downstream system what
/// happened) finishes a Processing record with [`Store::resolve`](crate::Store::resolve).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// The work took effect: the record becomes [`State::Succeeded`] with
    /// this result, replayed to every later claim until retention ends.
    Succeeded(Vec<u8>),
    /// The work did not take effect: the record becomes [`State::Failed`]
    /// with this failure; a `retryable` failure lets the next claim run the
    /// work again, a permanent one is replayed until retention ends.
    Failed {
        /// The stored failure.
        failure: Vec<u8>,
        /// Whether the next claim may run the work again.
        retryable: bool,
    },
}

impl Resolution {
    /// The state the record takes.
    pub fn state(&self) -> State {
        match self {
            Resolution::Succeeded(_) => State::Succeeded,
            Resolution::Failed { retryable, .. } => State::Failed {
                retryable: *retryable,
            },
        }
    }

    /// The stored bytes: the result or the failure.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Resolution::Succeeded(b) | Resolution::Failed { failure: b, .. } => b,
        }
    }
}

/// A request to change one key's record.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Claim {
        fingerprint: Fingerprint,
        lease_ms: u64,
        business_key: Option<String>,
    },
    Complete {
        token: u64,
        result: Vec<u8>,
    },
    Fail {
        token: u64,
        failure: Vec<u8>,
        retryable: bool,
    },
    Release {
        token: u64,
    },
    /// A release, unless the holder saved a recovery point (it acted): the
    /// record is then failed retryably with `failure`, keeping its
    /// recovery point and acquisitions for the next attempt. One
    /// transition, so that no recovery point saved meanwhile is deleted.
    /// Sent by the HTTP layer only.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    ReleaseUnlessActed {
        token: u64,
        failure: Vec<u8>,
    },
    Extend {
        token: u64,
        lease_ms: u64,
    },
    SetRecoveryPoint {
        token: u64,
        bytes: Vec<u8>,
    },
    /// An administrative finish of a Processing record, fenced by its token.
    Resolve {
        token: u64,
        outcome: Resolution,
    },
    /// An administrative correction of a finished record's outcome, fenced
    /// by its token (the finished record's own).
    Amend {
        token: u64,
        outcome: Resolution,
    },
    /// A record restored from a backup: fills an absent key only.
    Import {
        record: Box<Record>,
    },
}

impl Op {
    /// The name of the `Store` method that sends this op, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::Claim { .. } => "claim",
            Op::Complete { .. } => "complete",
            Op::Fail { .. } => "fail",
            Op::Release { .. } | Op::ReleaseUnlessActed { .. } => "release",
            Op::Extend { .. } => "extend",
            Op::SetRecoveryPoint { .. } => "set_recovery_point",
            Op::Resolve { .. } => "resolve",
            Op::Amend { .. } => "amend",
            Op::Import { .. } => "import",
        }
    }
}

/// What a transition answers.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    Claim(ClaimOutcome),
    Record(Record),
    Released,
    /// The answer to an import: whether the record was written.
    Imported(ImportResult),
}

impl Reply {
    /// Whether the transition that gave this answer wrote a change to its
    /// record (an acquisition, a completion, a failure, a release, an
    /// extension, a recovery point, a resolve or amend, a written import):
    /// every answer but a replay, "in progress", and an import that kept
    /// the stored record or skipped its own.
    pub(crate) fn wrote(&self) -> bool {
        match self {
            Reply::Claim(ClaimOutcome::Acquired(_)) | Reply::Record(_) | Reply::Released => true,
            Reply::Claim(ClaimOutcome::InProgress { .. } | ClaimOutcome::Replay(_)) => false,
            Reply::Imported(result) => *result == ImportResult::Written,
        }
    }
}

/// How many of `answers` wrote a change ([`Reply::wrote`]; a refusal
/// wrote nothing): what a group commit that made them durable counts in
/// `idemstore_commit_batch_size`.
pub(crate) fn writes<'a>(answers: impl IntoIterator<Item = &'a Result<Reply>>) -> usize {
    answers
        .into_iter()
        .filter(|answer| answer.as_ref().is_ok_and(Reply::wrote))
        .count()
}

/// A request as an engine took it: answered at once (a claim's fast path,
/// a refusal), or sent, its answer to come from a future that owns what it
/// needs (the engine's reply channel), so that it can outlive its caller
/// (see `crate::orphans`).
pub(crate) enum Sent {
    Answered(Result<Reply>),
    Pending(std::pin::Pin<Box<dyn std::future::Future<Output = Result<Reply>> + Send>>),
}

/// What an [`Op::Import`] did with one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ImportResult {
    /// The key was absent (or past retention): the record was written.
    Written,
    /// A live record of the key exists: it was kept as it is.
    Present,
    /// The imported record is already past retention: nothing was written.
    Expired,
    /// A live record of another key holds the record's business key.
    BusinessKeyTaken,
}

/// What a transition does to the stored record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    None,
    Put(Record),
    Delete,
}

/// The inputs a transition needs besides the record and the request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ctx<'a> {
    /// The store's time (never backwards), ms since the epoch.
    pub now_ms: u64,
    /// Configured retention in ms (> 0).
    pub retention_ms: u64,
    /// The token an acquisition would take; consumed only when the
    /// transition acquires.
    pub next_token: u64,
    /// For a claim (or import) that carries a business key: the record the
    /// business-key binding names, as stored (the writer looks it up in the
    /// same write). `None` when nothing is bound. The transition judges
    /// whether it is live.
    pub business_holder: Option<&'a Record>,
}

/// The pure transition function.
///
/// `current` is the stored record, `None` when absent; a record past
/// retention is treated as absent here, whatever eviction has done. Returns
/// the effect on storage and the reply; an `Err` changes nothing.
pub(crate) fn transition(
    key: &Key,
    current: Option<&Record>,
    op: &Op,
    ctx: &Ctx,
) -> Result<(Effect, Reply)> {
    let now = ctx.now_ms;
    let current = current.filter(|r| !r.is_expired_at(now));
    match op {
        Op::Claim {
            fingerprint,
            lease_ms,
            business_key,
        } => claim(key, current, fingerprint, *lease_ms, business_key, ctx),
        Op::Complete { token, result } => {
            let rec = current_lease(key, current, *token)?;
            Ok(finish(rec, State::Succeeded, result, ctx))
        }
        Op::Fail {
            token,
            failure,
            retryable,
        } => {
            let rec = current_lease(key, current, *token)?;
            let state = State::Failed {
                retryable: *retryable,
            };
            Ok(finish(rec, state, failure, ctx))
        }
        Op::Release { token } => {
            current_lease(key, current, *token)?;
            Ok((Effect::Delete, Reply::Released))
        }
        Op::ReleaseUnlessActed { token, failure } => {
            let rec = current_lease(key, current, *token)?;
            if rec.recovery_point.is_some() {
                let state = State::Failed { retryable: true };
                Ok(finish(rec, state, failure, ctx))
            } else {
                Ok((Effect::Delete, Reply::Released))
            }
        }
        Op::Extend { token, lease_ms } => {
            let rec = current_lease(key, current, *token)?;
            let mut next = rec.clone();
            next.lease_until_ms = rec.lease_until_ms.max(now.saturating_add(*lease_ms));
            next.expires_ms = rec
                .expires_ms
                .max(now.saturating_add(ctx.retention_ms))
                .max(next.lease_until_ms);
            next.updated_ms = now;
            Ok((Effect::Put(next.clone()), Reply::Record(next)))
        }
        Op::SetRecoveryPoint { token, bytes } => {
            let rec = current_lease(key, current, *token)?;
            let mut next = rec.clone();
            next.recovery_point = Some(bytes.clone());
            next.updated_ms = now;
            Ok((Effect::Put(next.clone()), Reply::Record(next)))
        }
        Op::Resolve { token, outcome } => {
            // The same fence as complete and fail: the record must still be
            // Processing under this token, so a resolve can never overwrite
            // a holder that has since finished, or a newer holder.
            let rec = current_lease(key, current, *token)?;
            Ok(finish(rec, outcome.state(), outcome.bytes(), ctx))
        }
        Op::Amend { token, outcome } => {
            // Only a finished, live record whose token is `token`: an amend
            // never finishes a Processing record (that is a resolve, fenced
            // by the holder's lease) and never reaches a newer holder's.
            match current {
                Some(rec)
                    if rec.state != State::Processing
                        && rec.token == *token
                        && !rec.is_expired_at(ctx.now_ms) =>
                {
                    Ok(finish(rec, outcome.state(), outcome.bytes(), ctx))
                }
                _ => Err(Error::StaleLease {
                    key: key.to_string(),
                    token: *token,
                }),
            }
        }
        Op::Import { record } => Ok(import(key, current, record, ctx)),
    }
}

/// The business-key rule (the second layer of dedup): a fresh record may
/// bind business key `business_key` only if no live record of another key
/// holds it.
fn business_key_free(key: &Key, business_key: &str, ctx: &Ctx) -> Result<()> {
    match ctx.business_holder {
        Some(holder) if holder.key != *key && !holder.is_expired_at(ctx.now_ms) => {
            Err(Error::BusinessKeyConflict {
                business_key: business_key.to_string(),
                existing: holder.key.clone(),
                state: holder.state,
            })
        }
        _ => Ok(()),
    }
}

/// The record past retention whose business key a put of `new` takes from
/// it: `holder`, the binding's holder read with the request, when `new`
/// binds its business key. Both engines evict it in the same write, as a
/// sweep would: a record whose binding has moved to another key must never
/// read as live again beside that key (on PostgreSQL a server clock that
/// steps back would bring it back, two live records then holding one
/// business key).
pub(crate) fn taken_from<'a>(
    holder: Option<&'a Record>,
    new: &Record,
    now_ms: u64,
) -> Option<&'a Record> {
    holder.filter(|h| {
        h.key != new.key
            && h.is_expired_at(now_ms)
            && new.business_key.is_some()
            && h.business_key == new.business_key
    })
}

fn import(key: &Key, current: Option<&Record>, record: &Record, ctx: &Ctx) -> (Effect, Reply) {
    let result = if current.is_some() {
        ImportResult::Present
    } else if record.is_expired_at(ctx.now_ms) {
        ImportResult::Expired
    } else if record
        .business_key
        .as_deref()
        .is_some_and(|bk| business_key_free(key, bk, ctx).is_err())
    {
        ImportResult::BusinessKeyTaken
    } else {
        return (
            Effect::Put(record.clone()),
            Reply::Imported(ImportResult::Written),
        );
    };
    (Effect::None, Reply::Imported(result))
}

fn claim(
    key: &Key,
    current: Option<&Record>,
    fingerprint: &Fingerprint,
    lease_ms: u64,
    business_key: &Option<String>,
    ctx: &Ctx,
) -> Result<(Effect, Reply)> {
    let now = ctx.now_ms;
    let lease_until = now.saturating_add(lease_ms);
    let expires = now.saturating_add(ctx.retention_ms).max(lease_until);
    let Some(rec) = current else {
        if let Some(bk) = business_key {
            business_key_free(key, bk, ctx)?;
        }
        let rec = Record {
            key: key.clone(),
            state: State::Processing,
            token: ctx.next_token,
            fingerprint: fingerprint.clone(),
            created_ms: now,
            updated_ms: now,
            lease_until_ms: lease_until,
            expires_ms: expires,
            output: None,
            recovery_point: None,
            business_key: business_key.clone(),
            acquisitions: 1,
        };
        return Ok(acquire(rec, AcquiredFrom::Absent));
    };
    if rec.fingerprint != *fingerprint {
        return Err(Error::FingerprintMismatch {
            key: key.to_string(),
        });
    }
    match rec.state {
        State::Processing if rec.lease_valid_at(now) => {
            let left = rec.lease_until_ms - now;
            Ok((
                Effect::None,
                Reply::Claim(ClaimOutcome::InProgress {
                    retry_after: Duration::from_millis(left),
                    lease_until_ms: rec.lease_until_ms,
                }),
            ))
        }
        State::Processing | State::Failed { retryable: true } => {
            // A takeover of a lapsed lease, or a retry after a retryable
            // failure: a new token; the recovery point and the last
            // failure stay for the new holder to see.
            let mut next = rec.clone();
            next.state = State::Processing;
            next.token = ctx.next_token;
            next.updated_ms = now;
            next.lease_until_ms = lease_until;
            next.expires_ms = expires;
            next.acquisitions = rec.acquisitions.saturating_add(1);
            let from = if rec.state == State::Processing {
                AcquiredFrom::LapsedLease
            } else {
                AcquiredFrom::RetryableFailure
            };
            Ok(acquire(next, from))
        }
        State::Succeeded | State::Failed { retryable: false } => Ok((
            Effect::None,
            Reply::Claim(ClaimOutcome::Replay(rec.clone())),
        )),
    }
}

fn acquire(rec: Record, from: AcquiredFrom) -> (Effect, Reply) {
    (
        Effect::Put(rec.clone()),
        Reply::Claim(ClaimOutcome::Acquired(Lease::acquired(rec, from))),
    )
}

fn finish(rec: &Record, state: State, output: &[u8], ctx: &Ctx) -> (Effect, Reply) {
    let mut next = rec.clone();
    next.state = state;
    next.output = Some(output.to_vec());
    next.updated_ms = ctx.now_ms;
    next.expires_ms = ctx.now_ms.saturating_add(ctx.retention_ms);
    (Effect::Put(next.clone()), Reply::Record(next))
}

/// The record, if `token` is its current lease: Processing, same token.
fn current_lease<'a>(key: &Key, current: Option<&'a Record>, token: u64) -> Result<&'a Record> {
    match current {
        Some(rec) if rec.state == State::Processing && rec.token == token => Ok(rec),
        _ => Err(Error::StaleLease {
            key: key.to_string(),
            token,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(now_ms: u64, next_token: u64) -> Ctx<'static> {
        Ctx {
            now_ms,
            retention_ms: 60_000,
            next_token,
            business_holder: None,
        }
    }

    fn claim_op(fp: &[u8], lease_ms: u64) -> Op {
        Op::Claim {
            fingerprint: Fingerprint::of(fp),
            lease_ms,
            business_key: None,
        }
    }

    fn put(effect: Effect) -> Record {
        match effect {
            Effect::Put(r) => r,
            other => panic!("expected a put, got {other:?}"),
        }
    }

    #[test]
    fn lifecycle() {
        let k = Key::new("s", "k").unwrap();
        let (e, r) = transition(&k, None, &claim_op(b"a", 1_000), &ctx(10, 1)).unwrap();
        let rec = put(e);
        assert!(matches!(r, Reply::Claim(ClaimOutcome::Acquired(_))));
        assert_eq!(
            (rec.token, rec.lease_until_ms, rec.expires_ms),
            (1, 1_010, 60_010)
        );

        let (e, _) = transition(&k, Some(&rec), &claim_op(b"a", 1_000), &ctx(500, 2)).unwrap();
        assert_eq!(e, Effect::None);
        assert!(transition(&k, Some(&rec), &claim_op(b"b", 1_000), &ctx(500, 2)).is_err());

        let done = put(transition(
            &k,
            Some(&rec),
            &Op::Complete {
                token: 1,
                result: b"r".to_vec(),
            },
            &ctx(2_000, 2),
        )
        .unwrap()
        .0);
        assert_eq!(done.result(), Some(&b"r"[..]));
        assert_eq!(done.expires_ms, 62_000);
        let (_, r) = transition(&k, Some(&done), &claim_op(b"a", 1_000), &ctx(61_999, 2)).unwrap();
        assert!(matches!(r, Reply::Claim(ClaimOutcome::Replay(_))));
        let (_, r) = transition(&k, Some(&done), &claim_op(b"b", 1_000), &ctx(62_000, 2)).unwrap();
        assert!(matches!(r, Reply::Claim(ClaimOutcome::Acquired(_))));
    }

    /// `ReleaseUnlessActed` deletes a record its holder saved no recovery
    /// point in, and fails retryably (keeping the recovery point and the
    /// acquisitions) one that holds a recovery point; fenced by the token.
    #[test]
    fn release_unless_acted_keeps_a_record_with_a_recovery_point() {
        let k = Key::new("s", "k").unwrap();
        let rec = put(transition(&k, None, &claim_op(b"a", 1_000), &ctx(10, 5))
            .unwrap()
            .0);
        let op = |token| Op::ReleaseUnlessActed {
            token,
            failure: b"refused".to_vec(),
        };
        let err = transition(&k, Some(&rec), &op(4), &ctx(20, 6)).unwrap_err();
        assert!(matches!(err, Error::StaleLease { .. }), "{err}");
        let (e, r) = transition(&k, Some(&rec), &op(5), &ctx(20, 6)).unwrap();
        assert_eq!(e, Effect::Delete);
        assert!(matches!(r, Reply::Released));

        let saved = put(transition(
            &k,
            Some(&rec),
            &Op::SetRecoveryPoint {
                token: 5,
                bytes: b"charged".to_vec(),
            },
            &ctx(20, 6),
        )
        .unwrap()
        .0);
        let (e, r) = transition(&k, Some(&saved), &op(5), &ctx(30, 6)).unwrap();
        let kept = put(e);
        assert!(matches!(r, Reply::Record(_)));
        assert_eq!(kept.state, State::Failed { retryable: true });
        assert_eq!(kept.failure(), Some(&b"refused"[..]));
        assert_eq!(kept.recovery_point(), Some(&b"charged"[..]));
        assert_eq!(kept.acquisitions, saved.acquisitions);
        assert_eq!(kept.expires_ms, 60_030);
    }

    #[test]
    fn resolve_is_fenced_by_the_token() {
        let k = Key::new("s", "k").unwrap();
        let rec = put(transition(&k, None, &claim_op(b"a", 1_000), &ctx(10, 5))
            .unwrap()
            .0);
        let resolve = |token| Op::Resolve {
            token,
            outcome: Resolution::Failed {
                failure: b"downstream says no".to_vec(),
                retryable: false,
            },
        };
        // An older or newer token changes nothing.
        for token in [4, 6] {
            let err = transition(&k, Some(&rec), &resolve(token), &ctx(5_000, 7)).unwrap_err();
            assert!(matches!(err, Error::StaleLease { .. }), "{err}");
        }
        let done = put(transition(&k, Some(&rec), &resolve(5), &ctx(5_000, 7))
            .unwrap()
            .0);
        assert_eq!(done.state, State::Failed { retryable: false });
        assert_eq!(done.expires_ms, 65_000);
        // A finished record is never resolved again, nor completed.
        assert!(transition(&k, Some(&done), &resolve(5), &ctx(5_001, 7)).is_err());
        let complete = Op::Complete {
            token: 5,
            result: b"late".to_vec(),
        };
        assert!(transition(&k, Some(&done), &complete, &ctx(5_001, 7)).is_err());
    }

    #[test]
    fn amend_replaces_a_finished_outcome_fenced_by_its_token() {
        let k = Key::new("s", "k").unwrap();
        let rec = put(transition(&k, None, &claim_op(b"a", 1_000), &ctx(10, 5))
            .unwrap()
            .0);
        let amend = |token| Op::Amend {
            token,
            outcome: Resolution::Succeeded(b"\"T-2\"".to_vec()),
        };
        // A Processing record is resolved, never amended.
        assert!(matches!(
            transition(&k, Some(&rec), &amend(5), &ctx(20, 7)),
            Err(Error::StaleLease { .. })
        ));
        let complete = Op::Complete {
            token: 5,
            result: b"T-2".to_vec(),
        };
        let done = put(transition(&k, Some(&rec), &complete, &ctx(20, 7))
            .unwrap()
            .0);
        for token in [4, 6] {
            assert!(transition(&k, Some(&done), &amend(token), &ctx(30, 7)).is_err());
        }
        let amended = put(transition(&k, Some(&done), &amend(5), &ctx(30, 7))
            .unwrap()
            .0);
        assert_eq!(amended.state, State::Succeeded);
        assert_eq!(amended.result(), Some(&b"\"T-2\""[..]));
        assert_eq!(amended.token, 5);
        assert_eq!(amended.expires_ms, 60_030);
        // Past retention the record is absent: nothing to amend.
        assert!(transition(&k, Some(&amended), &amend(5), &ctx(60_030, 7)).is_err());
    }

    #[test]
    fn a_live_business_key_holder_blocks_a_fresh_claim() {
        let k1 = Key::new("s", "k1").unwrap();
        let k2 = Key::new("s", "k2").unwrap();
        let with_bk = Op::Claim {
            fingerprint: Fingerprint::of(b"a"),
            lease_ms: 1_000,
            business_key: Some("order-1".into()),
        };
        let holder = put(transition(&k1, None, &with_bk, &ctx(10, 1)).unwrap().0);
        assert_eq!(holder.business_key(), Some("order-1"));
        let mut c = ctx(20, 2);
        c.business_holder = Some(&holder);
        match transition(&k2, None, &with_bk, &c) {
            Err(Error::BusinessKeyConflict {
                existing, state, ..
            }) => {
                assert_eq!(existing, k1);
                assert_eq!(state, State::Processing);
            }
            other => panic!("{other:?}"),
        }
        // The holder's own key is not a conflict.
        assert!(transition(&k1, None, &with_bk, &c).is_ok());
        // Past retention the holder no longer counts.
        let mut late = ctx(holder.expires_ms, 2);
        late.business_holder = Some(&holder);
        assert!(transition(&k2, None, &with_bk, &late).is_ok());
    }
}
