//! Audit events: one `tracing` event per state transition, and the
//! counters behind [`Store::stats`](crate::Store::stats).
//!
//! The writer collects an [`Event`] for every decision it makes inside a
//! batch and publishes them when the batch's callers are answered: with the
//! default [`Durability::Immediate`](crate::Durability::Immediate) that is
//! after the batch is durable, so the audit log never shows a transition
//! that a crash could undo. With `Durability::Buffered` callers (and the
//! audit log) are answered before the fsync, so a power loss can undo a
//! transition that was already logged, exactly as it can undo the
//! acknowledgement itself. Answers that need
//! no write (a replay, "in progress", a refused fingerprint on the fast
//! path) are published at once.
//!
//! Every event has the target `idemstore::audit`, so a subscriber can route
//! it apart from other logs. Fields: `scope`, `id`, `token`, `from` and `to`
//! (a state name from [`State::name`], or `none` for an absent record), and
//! `cause` (see [`Cause`]). Levels:
//!
//! - `warn`: takeovers of lapsed leases, stale-lease rejections, corrupt
//!   records;
//! - `info`: claims, completions, failures, releases, resolves, evictions;
//! - `debug`: imported records and claims refused by a fingerprint or a
//!   business key (answers, not transitions).

use crate::error::Error;
use crate::key::Key;
use crate::record::{ClaimOutcome, Effect, ImportResult, Op, Record, Reply, State};

/// Why a record changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// A claim acquired an absent key (or one past retention, or one that
    /// failed retryably).
    Claim,
    /// A claim took over a Processing record whose lease had lapsed.
    Takeover,
    Complete,
    Fail,
    Release,
    /// An administrative finish through `Store::resolve`, or a correction
    /// of a finished outcome through `Store::amend`.
    Resolve,
    /// Eviction of a record past retention.
    Evict,
    /// A record restored from an export.
    Import,
}

impl Cause {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Cause::Claim => "claim",
            Cause::Takeover => "takeover",
            Cause::Complete => "complete",
            Cause::Fail => "fail",
            Cause::Release => "release",
            Cause::Resolve => "resolve",
            Cause::Evict => "evict",
            Cause::Import => "import",
        }
    }
}

/// Something the store decided, for the audit log and the counters.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A record changed state (or appeared, or went away).
    Transition {
        key: Key,
        token: u64,
        from: Option<State>,
        to: Option<State>,
        cause: Cause,
    },
    /// A claim answered with the stored outcome.
    Replay { key: Key },
    /// A claim answered "in progress".
    InProgress { key: Key },
    /// A claim refused: the key is bound to another fingerprint.
    FingerprintMismatch { key: Key },
    /// A claim refused: its business key is held by another key.
    BusinessKeyConflict { key: Key, existing: Key },
    /// A write refused: the presented token is not the current lease.
    StaleLease { key: Key, token: u64 },
    /// A stored record failed to decode.
    Corrupt { key: String, detail: String },
}

impl Event {
    /// The event for an error a read or transition returned, if it is one
    /// the audit log or the counters care about.
    pub(crate) fn of_error(key: &Key, err: &Error) -> Option<Event> {
        match err {
            Error::FingerprintMismatch { .. } => {
                Some(Event::FingerprintMismatch { key: key.clone() })
            }
            Error::BusinessKeyConflict { existing, .. } => Some(Event::BusinessKeyConflict {
                key: key.clone(),
                existing: existing.clone(),
            }),
            Error::StaleLease { token, .. } => Some(Event::StaleLease {
                key: key.clone(),
                token: *token,
            }),
            _ => Event::corruption(err),
        }
    }

    /// The event of a corrupt record, if `err` reports one.
    pub(crate) fn corruption(err: &Error) -> Option<Event> {
        match err {
            Error::CorruptRecord { key, detail } => Some(Event::Corrupt {
                key: key.clone(),
                detail: detail.clone(),
            }),
            _ => None,
        }
    }

    /// The event of a successful transition of `key`: `stored` is the
    /// record before (as stored, possibly past retention), `now_ms` the
    /// transition's time.
    pub(crate) fn of_transition(
        key: &Key,
        stored: Option<&Record>,
        op: &Op,
        effect: &Effect,
        reply: &Reply,
        now_ms: u64,
    ) -> Option<Event> {
        let from = stored.filter(|r| !r.is_expired_at(now_ms)).map(|r| r.state);
        let transition = |token, to: Option<State>, cause| {
            Some(Event::Transition {
                key: key.clone(),
                token,
                from,
                to,
                cause,
            })
        };
        match (op, effect, reply) {
            (Op::Claim { .. }, Effect::Put(new), _) => {
                let cause = if from == Some(State::Processing) {
                    Cause::Takeover
                } else {
                    Cause::Claim
                };
                transition(new.token, Some(new.state), cause)
            }
            (Op::Claim { .. }, _, Reply::Claim(ClaimOutcome::Replay(_))) => {
                Some(Event::Replay { key: key.clone() })
            }
            (Op::Claim { .. }, _, Reply::Claim(ClaimOutcome::InProgress { .. })) => {
                Some(Event::InProgress { key: key.clone() })
            }
            (Op::Complete { .. }, Effect::Put(new), _) => {
                transition(new.token, Some(new.state), Cause::Complete)
            }
            (Op::Fail { .. }, Effect::Put(new), _) => {
                transition(new.token, Some(new.state), Cause::Fail)
            }
            (Op::Resolve { .. } | Op::Amend { .. }, Effect::Put(new), _) => {
                transition(new.token, Some(new.state), Cause::Resolve)
            }
            (Op::Release { token } | Op::ReleaseUnlessActed { token, .. }, Effect::Delete, _) => {
                transition(*token, None, Cause::Release)
            }
            (Op::ReleaseUnlessActed { .. }, Effect::Put(new), _) => {
                transition(new.token, Some(new.state), Cause::Fail)
            }
            (Op::Import { .. }, Effect::Put(new), Reply::Imported(ImportResult::Written)) => {
                transition(new.token, Some(new.state), Cause::Import)
            }
            // Extend and recovery points keep the state: no transition.
            _ => None,
        }
    }

    /// The eviction of `record`.
    pub(crate) fn evicted(record: &Record) -> Event {
        Event::Transition {
            key: record.key.clone(),
            token: record.token,
            from: Some(record.state),
            to: None,
            cause: Cause::Evict,
        }
    }
}

fn state_name(state: Option<State>) -> &'static str {
    state.map_or("none", State::name)
}

/// Emits `event` as a `tracing` event (target `idemstore::audit`).
pub(crate) fn emit(event: &Event) {
    match event {
        Event::Transition {
            key,
            token,
            from,
            to,
            cause,
        } => {
            let kind = *cause;
            let (scope, id, from, to, cause) = (
                key.scope(),
                key.id(),
                state_name(*from),
                state_name(*to),
                cause.name(),
            );
            match kind {
                Cause::Takeover => tracing::warn!(
                    target: "idemstore::audit",
                    scope, id, token, from, to, cause,
                    "lapsed lease taken over; the new holder should ask the downstream system what happened"
                ),
                Cause::Import => tracing::debug!(
                    target: "idemstore::audit",
                    scope, id, token, from, to, cause,
                    "record imported"
                ),
                _ => tracing::info!(
                    target: "idemstore::audit",
                    scope, id, token, from, to, cause,
                    "transition"
                ),
            }
        }
        Event::StaleLease { key, token } => tracing::warn!(
            target: "idemstore::audit",
            scope = key.scope(),
            id = key.id(),
            token,
            cause = "stale-lease",
            "write refused: the lease is no longer current"
        ),
        Event::Corrupt { key, detail } => tracing::warn!(
            target: "idemstore::audit",
            key = %key,
            detail = %detail,
            cause = "corruption",
            "corrupt record"
        ),
        Event::FingerprintMismatch { key } => tracing::debug!(
            target: "idemstore::audit",
            scope = key.scope(),
            id = key.id(),
            cause = "fingerprint-mismatch",
            "claim refused: key used with another payload"
        ),
        Event::BusinessKeyConflict { key, existing } => tracing::debug!(
            target: "idemstore::audit",
            scope = key.scope(),
            id = key.id(),
            existing = existing.id(),
            cause = "business-key-conflict",
            "claim refused: business key held by another idempotency key"
        ),
        Event::Replay { key } => emit_answer(key, true),
        Event::InProgress { key } => emit_answer(key, false),
    }
}

/// Emits the event of a claim answered without a change: a replay
/// (`replay`) or "in progress".
pub(crate) fn emit_answer(key: &Key, replay: bool) {
    if replay {
        tracing::trace!(
            target: "idemstore::audit",
            scope = key.scope(),
            id = key.id(),
            "claim answered with the stored outcome"
        );
    } else {
        tracing::trace!(
            target: "idemstore::audit",
            scope = key.scope(),
            id = key.id(),
            "claim answered in progress"
        );
    }
}
