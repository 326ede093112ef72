//! Keeping a lease while work runs, for the agent helpers
//! ([`Store::execute`]) and the HTTP layer: the renewal schedule (a third
//! of the lease, retried sooner after a renewal that did not reach the
//! store, each under a deadline of half the lease left), and the outcome's
//! write, retried under deadlines while the lease lasts. A PostgreSQL store
//! drops a connection that has not answered by a deadline (a half-open one
//! answers nothing until `call_timeout`, which may be longer than the
//! lease), so that each retry runs on another connection while the lease
//! still lasts.

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::record::{Lease, Op, Record, State};
use crate::store::Store;

/// The shortest renewal period: leases of under 3 ms are renewed every
/// millisecond.
const MIN_PERIOD: Duration = Duration::from_millis(1);

/// How long after a renewal answered `result` the lease is renewed next,
/// for a lease renewed every `period`: a period after a renewal; a third of
/// it (at least 1 ms) after one that could not reach the store or lost its
/// answer ([`Error::Unavailable`], [`Error::OutcomeUnknown`]: it says
/// nothing of the lease); `None` after any other failure (a stale lease, a
/// storage error), when it is not renewed again. The schedule of the
/// extender's thread and of `execute_async`'s renewals alike.
pub(crate) fn next_renewal<T>(period: Duration, result: &Result<T, Error>) -> Option<Duration> {
    match result {
        Ok(_) => Some(period),
        Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. }) => Some(period_of(period)),
        Err(_) => None,
    }
}

/// The deadline of a renewal sent at `now` of a lease that ends at
/// `expires` at the earliest and is renewed every `period`: half the time
/// left of the lease, at least a third of the period. A PostgreSQL store
/// drops the connection of a renewal past its deadline (a half-open
/// connection answers nothing until `call_timeout`, which may be longer
/// than the lease), so that the retry, a third of the period later, runs
/// on another connection while the lease still lasts.
pub(crate) fn renewal_deadline(now: Instant, expires: Instant, period: Duration) -> Instant {
    let left = expires.saturating_duration_since(now);
    let budget = (left / 2).max(period / 3);
    now.checked_add(budget).unwrap_or(now)
}

/// The period a lease of `length` is renewed at: a third of it, at least
/// 1 ms.
pub(crate) fn period_of(length: Duration) -> Duration {
    (length / 3).max(MIN_PERIOD)
}

/// [`next_renewal`], and the renewal's failure logged: a warning for the
/// first renewal of a run that did not reach the store (`unreachable`
/// tracks the run), a debug line for the next ones, a warning for one
/// that ends the renewals.
pub(crate) fn after_renewal<T>(
    key: &crate::key::Key,
    period: Duration,
    result: &Result<T, Error>,
    unreachable: &mut bool,
) -> Option<Duration> {
    let next = next_renewal(period, result);
    match (result, next) {
        (Ok(_), _) => *unreachable = false,
        (Err(e), Some(_)) if *unreachable => {
            tracing::debug!(key = %key, error = %e, "lease extension failed again");
        }
        (Err(e), Some(_)) => {
            tracing::warn!(key = %key, error = %e, "lease extension failed; trying again");
            *unreachable = true;
        }
        (Err(e), None) => {
            tracing::warn!(key = %key, error = %e, "lease extension failed");
        }
    }
    next
}

/// Writes `op`, the outcome of `lease` (of `length`), while the lease is
/// kept alive: each attempt must end within a third of the lease (on
/// PostgreSQL a connection that has not answered by then is dropped), and
/// one that did not reach the store or lost its answer (`Unavailable`,
/// `OutcomeUnknown`) is tried again a ninth of the lease later (at most a
/// second), on another connection, for up to the lease's length (at most a
/// minute). A retry that finds the lease
/// stale after an unknown outcome looks the record up: finished under this
/// lease, the earlier attempt was applied. The last error otherwise
/// (`OutcomeUnknown` if any attempt's outcome was unknown).
#[cfg(feature = "agent")]
pub(crate) fn write_outcome(
    store: &Store,
    lease: &Lease,
    op: Op,
    length: Duration,
) -> Result<(), Error> {
    let mut attempts = Attempts::new(length);
    loop {
        let result = store.write_outcome_by(lease, op.clone(), attempts.deadline());
        match attempts.after(store, lease, result) {
            Some(done) => return done,
            None => std::thread::sleep(attempts.pause()),
        }
    }
}

/// [`write_outcome`] from async code; the first attempt is
/// group-committed with other requests (see [`Attempts::attempt_async`]).
/// `unsent` holds `op` while no attempt of it is out (in the pause between
/// two), `None` otherwise: a caller whose future is dropped meanwhile (the
/// HTTP layer's) queues it from there.
pub(crate) async fn write_outcome_async(
    store: &Store,
    lease: &Lease,
    op: Op,
    length: Duration,
    unsent: &mut Option<Op>,
) -> Result<(), Error> {
    let mut attempts = Attempts::new(length);
    loop {
        // Sent by the attempt's first poll (a PostgreSQL store queues it at
        // once; the file engine, once its writer's queue has room).
        *unsent = None;
        let result = attempts.attempt_async(store, lease, op.clone()).await;
        match attempts.after_async(store, lease, result).await {
            Some(done) => return done,
            None => {
                *unsent = Some(op.clone());
                futures_timer::Delay::new(attempts.pause()).await;
            }
        }
    }
}

/// How long [`write_outcome`] tries at most, whatever the lease: a lease
/// of hours (`ExecuteOptions::lease` allows 30 days) must not hold
/// `execute` for as long while the store is down.
const MAX_OUTCOME_WINDOW: Duration = Duration::from_secs(60);

/// The longest wait between two attempts of [`write_outcome`].
const MAX_OUTCOME_PAUSE: Duration = Duration::from_secs(1);

/// The attempts of [`write_outcome`]: their deadlines, and what each
/// answer means.
struct Attempts {
    length: Duration,
    end: Instant,
    unknown: bool,
    /// Attempts made so far.
    made: u32,
}

impl Attempts {
    /// The attempts for a lease of `length`: for up to that long, at most
    /// [`MAX_OUTCOME_WINDOW`].
    fn new(length: Duration) -> Attempts {
        let now = Instant::now();
        Attempts {
            length,
            end: now
                .checked_add(length.min(MAX_OUTCOME_WINDOW))
                .unwrap_or(now),
            unknown: false,
            made: 0,
        }
    }

    /// Makes the next attempt from async code, by its
    /// [`deadline`](Attempts::deadline). The first is sent as any write is
    /// (on PostgreSQL group-committed with other requests, on the hot path
    /// when it can be), and no longer waited for past the deadline: its
    /// outcome is then unknown, and it may still land. Later ones run in a
    /// transaction of their own, which a PostgreSQL store ends at the
    /// deadline by dropping its connection (a half-open one), so that the
    /// one after runs on another. (A write alone takes the general
    /// transaction: only a retry pays for it.)
    async fn attempt_async(
        &mut self,
        store: &Store,
        lease: &Lease,
        op: Op,
    ) -> Result<Record, Error> {
        let deadline = self.deadline();
        self.made = self.made.saturating_add(1);
        if self.made == 1 {
            store.write_outcome_within_async(lease, op, deadline).await
        } else {
            store.write_outcome_by_async(lease, op, deadline).await
        }
    }

    /// The next attempt's deadline: a third of the lease from now, not past
    /// the end.
    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(period_of(self.length))
            .map_or(self.end, |d| d.min(self.end))
            .max(now)
    }

    /// The wait before the next attempt: a ninth of the lease, at most
    /// [`MAX_OUTCOME_PAUSE`], not past the end.
    fn pause(&self) -> Duration {
        let step = period_of(period_of(self.length));
        step.min(MAX_OUTCOME_PAUSE)
            .min(self.end.saturating_duration_since(Instant::now()))
    }

    /// `Some(answer)` once the outcome is written or cannot be; `None` to
    /// try again.
    #[cfg_attr(not(feature = "agent"), allow(dead_code))]
    fn after(
        &mut self,
        store: &Store,
        lease: &Lease,
        result: Result<Record, Error>,
    ) -> Option<Result<(), Error>> {
        match self.next(result) {
            Next::Done(done) => Some(done),
            Next::Again => None,
            Next::LookUp(error) => Some(settled(store.get(lease.key()), lease, error)),
        }
    }

    /// [`Attempts::after`] from async code: the record is looked up
    /// without blocking the thread.
    async fn after_async(
        &mut self,
        store: &Store,
        lease: &Lease,
        result: Result<Record, Error>,
    ) -> Option<Result<(), Error>> {
        match self.next(result) {
            Next::Done(done) => Some(done),
            Next::Again => None,
            Next::LookUp(error) => Some(settled(store.get_async(lease.key()).await, lease, error)),
        }
    }

    /// What an attempt's answer means: a retry that finds the lease stale
    /// after an unknown outcome must look the record up.
    fn next(&mut self, result: Result<Record, Error>) -> Next {
        let error = match result {
            Ok(_) => return Next::Done(Ok(())),
            Err(error) => error,
        };
        match error {
            Error::StaleLease { .. } if self.unknown => Next::LookUp(error),
            Error::Unavailable { .. } | Error::OutcomeUnknown { .. }
                if Instant::now() < self.end =>
            {
                self.unknown |= matches!(error, Error::OutcomeUnknown { .. });
                Next::Again
            }
            Error::Unavailable { detail } if self.unknown => {
                Next::Done(Err(Error::OutcomeUnknown { detail }))
            }
            error => Next::Done(Err(error)),
        }
    }
}

/// What [`Attempts::next`] makes of an answer.
enum Next {
    /// Written, or cannot be.
    Done(Result<(), Error>),
    /// Try again after the pause.
    Again,
    /// A stale lease after an unknown outcome: the record says whether an
    /// earlier attempt was applied.
    LookUp(Error),
}

/// The answer once the record of `lease`'s key was looked up after a
/// stale lease (`error`) that followed an unknown outcome: written when
/// the record is finished under this lease (an earlier attempt was
/// applied), else `error`. A lookup that fails leaves `error`.
fn settled(found: Result<Option<Record>, Error>, lease: &Lease, error: Error) -> Result<(), Error> {
    let applied = found
        .ok()
        .flatten()
        .is_some_and(|r| r.token() == lease.token() && r.state() != State::Processing);
    if applied { Ok(()) } else { Err(error) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClaimOptions, ClaimOutcome, Fingerprint, Key};

    /// An outcome write whose answer was lost, retried, finds the lease
    /// stale: if the record is finished under this lease, the lost attempt
    /// was applied and the outcome counts as written; otherwise (another
    /// holder's token) the stale lease is the answer. Without an unknown
    /// outcome before, a stale lease is never looked up. A lost answer is
    /// retried while the lease lasts; past it, a refusal after an unknown
    /// outcome is still unknown.
    #[test]
    fn a_retried_outcome_write_settles_a_lost_answer() {
        let dir = tempfile::tempdir().expect("dir");
        let store = Store::open(dir.path().join("s.redb")).expect("open");
        let key = Key::new("t", "written").expect("key");
        let lease = match store.claim(&key, &Fingerprint::of(b"p"), &ClaimOptions::new()) {
            Ok(ClaimOutcome::Acquired(lease)) => lease,
            other => panic!("{other:?}"),
        };
        store.complete(&lease, b"r").expect("complete");
        let stale = || Error::StaleLease {
            key: key.to_string(),
            token: lease.token(),
        };
        let lost = || Error::OutcomeUnknown {
            detail: "lost".into(),
        };
        let mut attempts = Attempts::new(Duration::from_secs(60));
        assert!(matches!(
            attempts.after(&store, &lease, Err(stale())),
            Some(Err(Error::StaleLease { .. }))
        ));
        assert!(attempts.after(&store, &lease, Err(lost())).is_none());
        assert!(matches!(
            attempts.after(&store, &lease, Err(stale())),
            Some(Ok(()))
        ));
        let other = Lease::from_parts(key.clone(), lease.token() + 1);
        assert!(matches!(
            attempts.after(&store, &other, Err(stale())),
            Some(Err(Error::StaleLease { .. }))
        ));
        // Past the lease's length, nothing is retried; a refusal after an
        // unknown outcome is still unknown.
        let mut ending = Attempts::new(Duration::from_millis(50));
        assert!(ending.after(&store, &lease, Err(lost())).is_none());
        std::thread::sleep(Duration::from_millis(60));
        let down = || Error::Unavailable {
            detail: "down".into(),
        };
        assert!(matches!(
            ending.after(&store, &lease, Err(down())),
            Some(Err(Error::OutcomeUnknown { .. }))
        ));
        assert!(matches!(
            Attempts::new(Duration::ZERO).after(&store, &lease, Err(down())),
            Some(Err(Error::Unavailable { .. }))
        ));
        // A lease of 30 days holds the write for a minute at most, with a
        // second at most between attempts.
        let long = Attempts::new(crate::MAX_LEASE);
        assert!(long.end <= Instant::now() + MAX_OUTCOME_WINDOW);
        assert!(long.pause() <= MAX_OUTCOME_PAUSE);
    }

    /// The schedule itself: a period after a renewal, a third of it after
    /// one that did not reach the store, none after a stale lease.
    #[test]
    fn a_stale_lease_ends_the_renewals() {
        let period = Duration::from_millis(300);
        let stale: Result<u64, Error> = Err(Error::StaleLease {
            key: "t/k".into(),
            token: 1,
        });
        let lost: Result<u64, Error> = Err(Error::OutcomeUnknown {
            detail: "answer lost".into(),
        });
        assert_eq!(next_renewal(period, &Ok(1)), Some(period));
        assert_eq!(
            next_renewal(period, &lost),
            Some(Duration::from_millis(100))
        );
        assert_eq!(next_renewal(period, &stale), None);
    }
}
