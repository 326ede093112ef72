//! The caller's side of a remote effect: retry with one key, and ask before
//! sending again.
//!
//! A timeout is not a failure: the request may have been lost, may still be
//! running, or may have succeeded with the response lost. [`call`] therefore
//! never answers a timeout by sending again blindly. It asks the service
//! (`query(key)`) first: not found → send again with the same key; in
//! progress → wait and ask again; done → return that result. The key is
//! made once, before the first attempt, and every attempt sends the very
//! same key, so a service that is unique on it (a payment's merchant
//! reference, a ticket's external id) turns a resend that races a slow first
//! request into a no-op as well.

use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};
use rand::Rng;

use crate::error::{Error, Result};
use crate::key::Key;

/// How [`call`] and [`call_async`] retry: an attempt limit, capped
/// exponential delays with full jitter, and a total deadline.
///
/// The delay before retry `n` (counting from 0) is drawn uniformly from
/// `[0, min(max_delay, base_delay · 2^n)]`: the "full jitter" of the AWS
/// Architecture Blog's *Exponential Backoff and Jitter* (2015), which
/// spreads the retries of many callers instead of moving them in lockstep.
/// The capped exponential schedule comes from the `backon` crate; the jitter
/// is drawn here, because `backon`'s own jitter adds to the delay rather than
/// drawing below it.
///
/// # Defaults
/// - `max_attempts`: 5 requests (sends and queries together)
/// - `base_delay`: 100 ms; `max_delay`: 5 s
/// - `deadline`: 30 s for the whole call, attempts and delays included
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    max_attempts: u32,
    base_delay: Duration,
    max_delay: Duration,
    deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            deadline: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// A policy of at most `max_attempts` requests (sends and queries
    /// together, at least 1), with delays from `base_delay` doubling up to
    /// `max_delay` (full jitter below each), and the default deadline (30 s).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `max_attempts` is 0, `base_delay` is
    /// zero, or `max_delay` is below `base_delay`.
    pub fn new(max_attempts: u32, base_delay: Duration, max_delay: Duration) -> Result<Self> {
        if max_attempts == 0 {
            return Err(Error::invalid("max_attempts", "must be at least 1"));
        }
        if base_delay.is_zero() {
            return Err(Error::invalid("base_delay", "must be non-zero"));
        }
        if max_delay < base_delay {
            return Err(Error::invalid(
                "max_delay",
                format!("{max_delay:?} is below base_delay {base_delay:?}"),
            ));
        }
        Ok(RetryPolicy {
            max_attempts,
            base_delay,
            max_delay,
            ..RetryPolicy::default()
        })
    }

    /// The total time budget of one call, attempts and delays included. No
    /// attempt starts after it, and no delay is slept that would end past
    /// it. A zero deadline allows the first attempt only. An attempt itself
    /// is bounded by the `send` it runs, except in
    /// [`mcp::call_tool_once`](crate::mcp::call_tool_once) (feature `mcp`),
    /// which waits for each answer only until the deadline: there it must
    /// cover the tool's run time.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The largest number of requests one call makes.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The delay before the first retry, before jitter.
    pub fn base_delay(&self) -> Duration {
        self.base_delay
    }

    /// The cap of every delay, before jitter.
    pub fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// The total time budget of one call.
    pub fn total_deadline(&self) -> Duration {
        self.deadline
    }
}

/// Capped exponential delays from `backon`, with jitter.
pub(crate) struct Delays {
    schedule: <ExponentialBuilder as BackoffBuilder>::Backoff,
    cap: Duration,
    full_jitter: bool,
}

impl Delays {
    fn schedule(base: Duration, cap: Duration) -> ExponentialBuilder {
        ExponentialBuilder::new()
            .with_min_delay(base)
            .with_max_delay(cap)
            .with_factor(2.0)
            .without_max_times()
    }

    /// Full jitter: uniform in `[0, min(cap, base · 2^n)]`.
    pub(crate) fn full_jitter(base: Duration, cap: Duration) -> Self {
        Delays {
            schedule: Self::schedule(base, cap).build(),
            cap,
            full_jitter: true,
        }
    }

    /// `backon`'s jitter: `d` plus up to `d` more, for
    /// `d = min(cap, base · 2^n)`; never below `base`.
    pub(crate) fn added_jitter(base: Duration, cap: Duration) -> Self {
        Delays {
            schedule: Self::schedule(base, cap).with_jitter().build(),
            cap,
            full_jitter: false,
        }
    }

    /// The next delay.
    pub(crate) fn next_delay(&mut self) -> Duration {
        // The schedule has no attempt limit, so it never ends.
        let delay = self.schedule.next().unwrap_or(self.cap);
        if !self.full_jitter {
            return delay;
        }
        let nanos = u64::try_from(delay.min(self.cap).as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rand::rng().random_range(0..=nanos))
    }
}

/// What one request to the remote service reports when it did not succeed.
/// Both `send` and `query` return it. More kinds may be added: a match
/// over it needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RemoteError<E> {
    /// No answer in time: the request may have been lost, may still be
    /// running, or may have succeeded with the response lost. After a send,
    /// [`call`] queries before it sends again.
    TimedOut,
    /// The service answered that it did not act and that a retry may
    /// succeed (HTTP 429, 503). [`call`] sends again, with the same key.
    Retryable(E),
    /// The service answered as for [`RemoteError::Retryable`] and asked
    /// for a wait of at least `after` before the next request: HTTP's
    /// `Retry-After` on a 429 or 503 (RFC 9110 §10.2.3; the IETF
    /// Idempotency-Key draft's 409 carries it too), or an MCP server's
    /// `data.retryAfterMs`, which `call_tool_once` of the feature `mcp`
    /// reads. [`call`] waits the longer of `after` and its own backoff
    /// (so `after` may exceed the policy's largest delay), then sends, or
    /// queries, again. When that wait would end past the policy's
    /// deadline, it stops at once with [`CallError::Exhausted`]
    /// ([`Limit::Deadline`]) instead of sleeping until the deadline.
    RetryAfter {
        /// The service's error, kept as the call's last error.
        error: E,
        /// The least wait the service asked for.
        after: Duration,
    },
    /// The service refused the request for good (HTTP 400, 402, 422).
    /// [`call`] stops and returns [`CallError::Rejected`].
    Permanent(E),
    /// The service answered that it may have acted on this key and cannot
    /// tell whether it did: an earlier request with the key started and
    /// its outcome was never recorded (an MCP server's `IN_DOUBT`, -32042,
    /// which `call_tool_once` of the feature `mcp` sorts here), or an
    /// answer came that says the work started but not how it ended. No
    /// request with the key will learn more; a person must find out. [`call`]
    /// stops and returns [`CallError::Rejected`] with `in_doubt` set,
    /// whether or not an earlier send of this call timed out.
    InDoubt(E),
}

/// What the service knows about a key, as `query(key)` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteStatus<T> {
    /// The service has no request with this key: it never arrived. [`call`]
    /// sends again, with the same key.
    NotFound,
    /// The request with this key is still running there. [`call`] waits and
    /// queries again.
    InProgress,
    /// The request with this key took effect; this is its result.
    Done(T),
}

/// Which limit of the [`RetryPolicy`] ended a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The attempt limit.
    Attempts,
    /// The total deadline.
    Deadline,
}

/// Why [`call`] or [`call_async`] returned without a result. Both variants
/// carry the key, so that a person can follow up with the service. Its
/// message includes the service's error (`Rejected`) or the last one
/// (`Exhausted`), so that text recorded from it (for example as a
/// [`Failure`](super::Failure)) keeps the reason.
#[derive(Debug)]
#[non_exhaustive]
pub enum CallError<E> {
    /// The policy's limit ran out before the service confirmed an outcome.
    Exhausted {
        /// The idempotency key every attempt carried.
        key: Key,
        /// How many requests were made (sends and queries).
        attempts: u32,
        /// Which limit ended the call.
        limit: Limit,
        /// Whether a send may have taken effect: a send timed out and no
        /// later query found the key absent.
        in_doubt: bool,
        /// The last error the service returned, if any.
        last_error: Option<E>,
    },
    /// The service refused the request (or the query) for good.
    Rejected {
        /// The idempotency key every attempt carried.
        key: Key,
        /// Whether an earlier send may have taken effect (see
        /// [`CallError::Exhausted`]), or the service answered that it may
        /// have ([`RemoteError::InDoubt`]).
        in_doubt: bool,
        /// The service's error.
        error: E,
    },
}

impl<E: std::fmt::Display> std::fmt::Display for CallError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Exhausted {
                key,
                attempts,
                limit,
                in_doubt,
                last_error,
            } => {
                write!(
                    f,
                    "call with idempotency key {key} gave up after {attempts} attempts \
                     ({limit:?} limit); {}",
                    if *in_doubt {
                        "the service may have acted: follow up with this key"
                    } else {
                        "the service did not act"
                    }
                )?;
                match last_error {
                    Some(error) => write!(f, "; last error: {error}"),
                    None => Ok(()),
                }
            }
            CallError::Rejected {
                key,
                in_doubt,
                error,
            } => {
                write!(f, "call with idempotency key {key} was rejected: {error}")?;
                if *in_doubt {
                    write!(f, "; the service may have acted: follow up with this key")?;
                }
                Ok(())
            }
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for CallError<E> {}

impl<E> CallError<E> {
    /// The idempotency key of the call, for a person to follow up.
    pub fn key(&self) -> &Key {
        match self {
            CallError::Exhausted { key, .. } | CallError::Rejected { key, .. } => key,
        }
    }

    /// Whether the service may have acted on the key.
    pub fn is_in_doubt(&self) -> bool {
        match self {
            CallError::Exhausted { in_doubt, .. } | CallError::Rejected { in_doubt, .. } => {
                *in_doubt
            }
        }
    }
}

/// The next request of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    Send,
    Query,
}

/// The state of one call, shared by the sync and async drivers.
struct Driver<E> {
    key: Key,
    policy: RetryPolicy,
    delays: Delays,
    started: Instant,
    attempts: u32,
    next: Next,
    in_doubt: bool,
    last_error: Option<E>,
}

/// What the driver does after an answer.
enum Step<T, E> {
    Return(std::result::Result<T, CallError<E>>),
    Sleep(Duration),
}

impl<E> Driver<E> {
    fn new(key: &Key, policy: &RetryPolicy) -> Self {
        Driver {
            key: key.clone(),
            policy: *policy,
            delays: Delays::full_jitter(policy.base_delay, policy.max_delay),
            started: Instant::now(),
            attempts: 0,
            next: Next::Send,
            in_doubt: false,
            last_error: None,
        }
    }

    fn exhausted<T>(&mut self, limit: Limit) -> Step<T, E> {
        Step::Return(Err(CallError::Exhausted {
            key: self.key.clone(),
            attempts: self.attempts,
            limit,
            in_doubt: self.in_doubt,
            last_error: self.last_error.take(),
        }))
    }

    fn after_send<T>(&mut self, answer: std::result::Result<T, RemoteError<E>>) -> Step<T, E> {
        match answer {
            Ok(value) => return Step::Return(Ok(value)),
            Err(RemoteError::TimedOut) => {
                self.in_doubt = true;
                self.next = Next::Query;
            }
            Err(RemoteError::Retryable(e)) => {
                self.last_error = Some(e);
                self.next = Next::Send;
            }
            Err(RemoteError::RetryAfter { error, after }) => {
                self.last_error = Some(error);
                self.next = Next::Send;
                return self.pause(after);
            }
            Err(RemoteError::Permanent(error)) => return self.rejected(error),
            Err(RemoteError::InDoubt(error)) => {
                self.in_doubt = true;
                return self.rejected(error);
            }
        }
        self.pause(Duration::ZERO)
    }

    fn after_query<T>(
        &mut self,
        answer: std::result::Result<RemoteStatus<T>, RemoteError<E>>,
    ) -> Step<T, E> {
        match answer {
            Ok(RemoteStatus::Done(value)) => return Step::Return(Ok(value)),
            Ok(RemoteStatus::NotFound) => {
                self.in_doubt = false;
                self.next = Next::Send;
            }
            Ok(RemoteStatus::InProgress) | Err(RemoteError::TimedOut) => {
                self.next = Next::Query;
            }
            Err(RemoteError::Retryable(e)) => {
                self.last_error = Some(e);
                self.next = Next::Query;
            }
            Err(RemoteError::RetryAfter { error, after }) => {
                self.last_error = Some(error);
                self.next = Next::Query;
                return self.pause(after);
            }
            Err(RemoteError::Permanent(error)) => return self.rejected(error),
            Err(RemoteError::InDoubt(error)) => {
                self.in_doubt = true;
                return self.rejected(error);
            }
        }
        self.pause(Duration::ZERO)
    }

    fn rejected<T>(&mut self, error: E) -> Step<T, E> {
        Step::Return(Err(CallError::Rejected {
            key: self.key.clone(),
            in_doubt: self.in_doubt,
            error,
        }))
    }

    /// The delay before the next attempt, at least `asked` (the service's
    /// `Retry-After`), unless a limit ends the call.
    fn pause<T>(&mut self, asked: Duration) -> Step<T, E> {
        if self.attempts >= self.policy.max_attempts {
            return self.exhausted(Limit::Attempts);
        }
        let left = self.policy.deadline.saturating_sub(self.started.elapsed());
        let delay = self.delays.next_delay().max(asked);
        if delay >= left {
            return self.exhausted(Limit::Deadline);
        }
        Step::Sleep(delay)
    }
}

/// Calls a remote service with one idempotency key, retrying by `policy`.
///
/// `send(key)` asks the service to act; `query(key)` asks what it knows of
/// the key. Both must pass the key on (as the request's idempotency key or
/// external reference). The driver:
///
/// 1. sends; a result is returned at once;
/// 2. on [`RemoteError::TimedOut`] queries before it sends again:
///    [`RemoteStatus::NotFound`] → send again, [`RemoteStatus::InProgress`]
///    (or another timeout) → wait and query again, [`RemoteStatus::Done`] →
///    return that result;
/// 3. on [`RemoteError::Retryable`] sends again after a delay; on
///    [`RemoteError::RetryAfter`] after at least the wait the service asked
///    for, or stops at once when that wait ends past the deadline;
/// 4. on [`RemoteError::Permanent`] stops with [`CallError::Rejected`];
///    on [`RemoteError::InDoubt`] too, in doubt;
/// 5. when the attempts or the deadline run out, stops with
///    [`CallError::Exhausted`], which carries the key and says whether the
///    service may have acted.
///
/// Every attempt carries the same `key`, made by the caller before the
/// first attempt. A query that answers "not found" while the first request
/// is still on its way cannot be told apart from a lost request, so the
/// service must also be unique on the key for a resend to be safe in that
/// race; the query spares the resend in the common case. Delays are slept
/// with [`std::thread::sleep`]; use [`call_async`] on an async runtime.
///
/// ```
/// use idemstore::Key;
/// use idemstore::agent::{call, RemoteError, RemoteStatus, RetryPolicy};
/// use std::time::Duration;
///
/// let key = Key::new("acme/payments.charge", "task-42:call-7")?;
/// let policy = RetryPolicy::new(5, Duration::from_millis(1), Duration::from_millis(4))?;
/// let mut charged = 0;
/// let charge = call(
///     &key,
///     &policy,
///     |_key| {
///         charged += 1;
///         Err::<String, RemoteError<String>>(RemoteError::TimedOut) // the response is lost
///     },
///     |_key| Ok(RemoteStatus::Done("ch_1".to_string())), // the service has it
/// );
/// assert_eq!(charge.unwrap(), "ch_1");
/// assert_eq!(charged, 1);
/// # Ok::<(), idemstore::Error>(())
/// ```
///
/// # Errors
/// [`CallError::Exhausted`] and [`CallError::Rejected`] as above.
pub fn call<T, E, S, Q>(
    key: &Key,
    policy: &RetryPolicy,
    mut send: S,
    mut query: Q,
) -> std::result::Result<T, CallError<E>>
where
    S: FnMut(&Key) -> std::result::Result<T, RemoteError<E>>,
    Q: FnMut(&Key) -> std::result::Result<RemoteStatus<T>, RemoteError<E>>,
{
    let mut driver = Driver::new(key, policy);
    loop {
        driver.attempts += 1;
        let step = match driver.next {
            Next::Send => {
                let answer = send(&driver.key);
                driver.after_send(answer)
            }
            Next::Query => {
                let answer = query(&driver.key);
                driver.after_query(answer)
            }
        };
        match step {
            Step::Return(done) => return done,
            Step::Sleep(delay) => std::thread::sleep(delay),
        }
    }
}

/// [`call`] for async code: the same driver, with delays awaited on a timer
/// (the `futures-timer` crate) instead of blocking the thread. Works on any
/// runtime.
///
/// # Errors
/// As [`call`].
pub async fn call_async<T, E, S, Q>(
    key: &Key,
    policy: &RetryPolicy,
    mut send: S,
    mut query: Q,
) -> std::result::Result<T, CallError<E>>
where
    S: AsyncFnMut(&Key) -> std::result::Result<T, RemoteError<E>>,
    Q: AsyncFnMut(&Key) -> std::result::Result<RemoteStatus<T>, RemoteError<E>>,
{
    let mut driver = Driver::new(key, policy);
    loop {
        driver.attempts += 1;
        let step = match driver.next {
            Next::Send => {
                let answer = send(&driver.key).await;
                driver.after_send(answer)
            }
            Next::Query => {
                let answer = query(&driver.key).await;
                driver.after_query(answer)
            }
        };
        match step {
            Step::Return(done) => return done,
            Step::Sleep(delay) => futures_timer::Delay::new(delay).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_below_the_capped_exponential() {
        let base = Duration::from_millis(10);
        let cap = Duration::from_millis(80);
        let mut full = Delays::full_jitter(base, cap);
        let mut added = Delays::added_jitter(base, cap);
        for n in 0..12u32 {
            let ceiling = (base * 2u32.pow(n.min(10))).min(cap);
            assert!(full.next_delay() <= ceiling, "retry {n}");
            let delay = added.next_delay();
            assert!(
                delay >= ceiling && delay <= ceiling * 2,
                "retry {n}: {delay:?}"
            );
        }
    }

    #[test]
    fn a_wait_the_service_asks_for_is_kept_above_the_backoff() {
        let key = Key::new("acme/tickets", "task-1:call-1").unwrap();
        let policy = RetryPolicy::new(10, Duration::from_millis(1), Duration::from_millis(4))
            .unwrap()
            .deadline(Duration::from_secs(3600));
        let asked = Duration::from_secs(30);
        for answer in [Next::Send, Next::Query] {
            let mut driver = Driver::<&str>::new(&key, &policy);
            driver.attempts = 1;
            let error = RemoteError::RetryAfter {
                error: "503",
                after: asked,
            };
            let step: Step<(), _> = match answer {
                Next::Send => driver.after_send(Err(error)),
                Next::Query => driver.after_query(Err(error)),
            };
            match step {
                Step::Sleep(delay) => assert_eq!(delay, asked, "{answer:?}"),
                Step::Return(_) => panic!("{answer:?}: the call ended"),
            }
            assert_eq!(driver.next, answer, "the same request is made again");
            assert_eq!(driver.last_error, Some("503"));
        }
    }

    #[test]
    fn policy_is_validated() {
        let ms = Duration::from_millis;
        assert!(RetryPolicy::new(0, ms(1), ms(2)).is_err());
        assert!(RetryPolicy::new(1, ms(0), ms(2)).is_err());
        assert!(RetryPolicy::new(1, ms(3), ms(2)).is_err());
        assert!(RetryPolicy::new(1, ms(2), ms(2)).is_ok());
    }
}
