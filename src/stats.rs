//! The numbers an operator watches: records by state, the oldest work in
//! flight, the file's size, and counters of what the store answered since
//! it was opened.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::audit::{self, Cause, Event};

/// Counters since the store was opened, as seen by
/// [`Store::stats`](crate::Store::stats). They are kept in memory (atomics)
/// and start at zero on every open.
///
/// Every claim the store answers counts once in `claims` and once in exactly
/// one of `acquired`, `replays`, `in_progress`, `fingerprint_mismatches` or
/// `business_key_conflicts` (a claim that fails on storage or a corrupt
/// record counts nowhere). Writes are counted once they are durable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counters {
    /// Claims answered.
    pub claims: u64,
    /// Claims that acquired a lease (including takeovers).
    pub acquired: u64,
    /// Claims answered with a stored outcome (duplicates prevented).
    pub replays: u64,
    /// Claims answered "in progress" (HTTP 409 + Retry-After; concurrent
    /// duplicates prevented).
    pub in_progress: u64,
    /// Claims refused because the key was used with another payload (422).
    pub fingerprint_mismatches: u64,
    /// Claims refused because another key holds their business key (409).
    pub business_key_conflicts: u64,
    /// Writes (complete, fail, release, extend, recovery point, resolve)
    /// refused because the lease was no longer current.
    pub stale_lease_rejections: u64,
    /// Acquisitions that took over a Processing record whose lease had
    /// lapsed: each is work that may have run twice unless the new holder
    /// asks the downstream system first.
    pub takeovers: u64,
    /// Records removed by eviction after retention.
    pub evictions: u64,
}

impl Counters {
    /// The duplicate-prevention hit rate: the share of answered claims that
    /// were duplicates the store stopped (replays, "in progress" answers and
    /// business-key conflicts), from 0.0 to 1.0; `None` before any claim.
    pub fn duplicate_hit_rate(&self) -> Option<f64> {
        if self.claims == 0 {
            return None;
        }
        let hits = self.replays + self.in_progress + self.business_key_conflicts;
        #[allow(clippy::cast_precision_loss)] // counts far below 2^52
        Some(hits as f64 / self.claims as f64)
    }
}

/// The live counters behind [`Counters`], and (feature `metrics`) the
/// metrics handles that count the same events.
#[derive(Debug, Default)]
pub(crate) struct LiveCounters {
    #[cfg(feature = "metrics")]
    handles: Option<crate::metrics::Handles>,
    claims: AtomicU64,
    acquired: AtomicU64,
    replays: AtomicU64,
    in_progress: AtomicU64,
    fingerprint_mismatches: AtomicU64,
    business_key_conflicts: AtomicU64,
    stale_lease_rejections: AtomicU64,
    takeovers: AtomicU64,
    evictions: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl LiveCounters {
    /// Counters at zero; with the `metrics` feature, the metrics handles
    /// registered with the recorder installed now.
    pub(crate) fn new() -> LiveCounters {
        LiveCounters {
            #[cfg(feature = "metrics")]
            handles: Some(crate::metrics::Handles::register()),
            ..LiveCounters::default()
        }
    }

    /// One group commit made the writes of `requests` requests durable in
    /// `took` ([`crate::record::writes`]). A commit that made no request's
    /// write durable (only answers that wrote nothing, evictions, a
    /// checkpoint) is not observed.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn group_commit(&self, took: std::time::Duration, requests: usize) {
        #[cfg(feature = "metrics")]
        if let Some(h) = self.handles.as_ref().filter(|_| requests > 0) {
            h.group_commit(took, requests);
        }
    }

    /// Counts `events` and emits them as `tracing` events. Call only once
    /// what they describe is durable (or, for answers, decided).
    pub(crate) fn publish(&self, events: impl IntoIterator<Item = Event>) {
        for event in events {
            self.count(&event);
            audit::emit(&event);
        }
    }

    /// Counts and logs a claim answered without a change: a replay
    /// (`replay`) or "in progress". The same as publishing
    /// `Event::Replay`/`Event::InProgress` for `key`, without building one.
    pub(crate) fn answered(&self, key: &crate::key::Key, replay: bool) {
        bump(&self.claims);
        bump(if replay {
            &self.replays
        } else {
            &self.in_progress
        });
        #[cfg(feature = "metrics")]
        if let Some(h) = &self.handles {
            if replay { &h.replay } else { &h.in_progress }.increment(1);
        }
        audit::emit_answer(key, replay);
    }

    /// Counts one published event.
    pub(crate) fn count(&self, event: &Event) {
        #[cfg(feature = "metrics")]
        if let Some(h) = &self.handles {
            count_metric(h, event);
        }
        match event {
            Event::Transition { cause, .. } => match cause {
                Cause::Claim => {
                    bump(&self.claims);
                    bump(&self.acquired);
                }
                Cause::Takeover => {
                    bump(&self.claims);
                    bump(&self.acquired);
                    bump(&self.takeovers);
                }
                Cause::Evict => bump(&self.evictions),
                Cause::Complete | Cause::Fail | Cause::Release | Cause::Resolve | Cause::Import => {
                }
            },
            Event::Replay { .. } => {
                bump(&self.claims);
                bump(&self.replays);
            }
            Event::InProgress { .. } => {
                bump(&self.claims);
                bump(&self.in_progress);
            }
            Event::FingerprintMismatch { .. } => {
                bump(&self.claims);
                bump(&self.fingerprint_mismatches);
            }
            Event::BusinessKeyConflict { .. } => {
                bump(&self.claims);
                bump(&self.business_key_conflicts);
            }
            Event::StaleLease { .. } => bump(&self.stale_lease_rejections),
            Event::Corrupt { .. } => {}
        }
    }

    /// The counters now.
    pub(crate) fn snapshot(&self) -> Counters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            claims: get(&self.claims),
            acquired: get(&self.acquired),
            replays: get(&self.replays),
            in_progress: get(&self.in_progress),
            fingerprint_mismatches: get(&self.fingerprint_mismatches),
            business_key_conflicts: get(&self.business_key_conflicts),
            stale_lease_rejections: get(&self.stale_lease_rejections),
            takeovers: get(&self.takeovers),
            evictions: get(&self.evictions),
        }
    }
}

/// Counts `event` in the metrics handles, as [`LiveCounters::count`] does
/// in the atomics.
#[cfg(feature = "metrics")]
fn count_metric(h: &crate::metrics::Handles, event: &Event) {
    let counter = match event {
        Event::Transition { cause, .. } => match cause {
            Cause::Claim => &h.acquired,
            Cause::Takeover => &h.takeover,
            Cause::Evict => &h.evictions,
            Cause::Complete | Cause::Fail | Cause::Release | Cause::Resolve | Cause::Import => {
                return;
            }
        },
        Event::Replay { .. } => &h.replay,
        Event::InProgress { .. } => &h.in_progress,
        Event::FingerprintMismatch { .. } => &h.fingerprint_mismatch,
        Event::BusinessKeyConflict { .. } => &h.business_key_conflict,
        Event::StaleLease { .. } => &h.stale_lease,
        Event::Corrupt { .. } => return,
    };
    counter.increment(1);
}

/// How many stored records are in each state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCounts {
    /// Live Processing records (work in flight, or abandoned with a lapsed
    /// lease: see [`Store::compensation`](crate::Store::compensation)).
    pub processing: u64,
    /// Of `processing`, those whose lease has lapsed: on the file engine
    /// judged as a claim judges it ([`Record::lease_valid_at`](crate::Record::lease_valid_at)),
    /// on PostgreSQL from the rows' lease column at the database's time
    /// (a row updated later than that time, whose lease ended before its
    /// update, is counted as not lapsed).
    pub lapsed: u64,
    /// Live Succeeded records.
    pub succeeded: u64,
    /// Live permanently Failed records.
    pub failed: u64,
    /// Live retryably Failed records.
    pub failed_retryable: u64,
    /// Records past retention that eviction has not removed yet (absent to
    /// every read; they only take space).
    pub expired: u64,
    /// Records whose state cannot be read. On the file engine, `stats` does
    /// not read every record: a record damaged elsewhere in its envelope is
    /// counted in its state, and only `verify` / `idemstore check` names
    /// every damaged record. On PostgreSQL: rows whose `state` column is
    /// none of the four (`stats` reads no record there either: a row
    /// damaged otherwise is counted in its state, or in `expired` past its
    /// expiry, where it stays, since a sweep leaves damaged rows to
    /// `check`; reads answer [`Error::CorruptRecord`](crate::Error::CorruptRecord)
    /// for it).
    pub corrupt: u64,
}

impl StateCounts {
    /// Every stored record, live, expired or corrupt.
    pub fn total(&self) -> u64 {
        self.processing
            + self.succeeded
            + self.failed
            + self.failed_retryable
            + self.expired
            + self.corrupt
    }

    /// Live records (not past retention, not corrupt).
    pub fn live(&self) -> u64 {
        self.processing + self.succeeded + self.failed + self.failed_retryable
    }
}

/// A snapshot of the store for a dashboard: see
/// [`Store::stats`](crate::Store::stats).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Stats {
    /// The store's time when the snapshot was taken (ms since the epoch).
    pub now_ms: u64,
    /// Records by state in one read snapshot (kept counts on the file
    /// engine, one aggregate statement on PostgreSQL: see
    /// [`Store::stats`](crate::Store::stats)).
    pub records: StateCounts,
    /// Age of the oldest live Processing record, `now − created_ms`
    /// (milliseconds since its key was first acquired); `None` when nothing
    /// is in flight.
    pub oldest_processing_age_ms: Option<u64>,
    /// Size of the store file (in bytes), from the file system; `None` for
    /// a store opened on a custom backend or when the size cannot be read.
    pub file_bytes: Option<u64>,
    /// Counters since the store was opened.
    pub counters: Counters,
}
