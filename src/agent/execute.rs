//! Run-once execution: [`Store::execute`] and [`Store::execute_async`].
//!
//! One call claims the key, runs the work only when it acquired it (keeping
//! the lease alive while the work runs), records the outcome, and replays
//! that outcome to every later call with the same key and fingerprint.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::call::Delays;
use crate::config::ClaimOptions;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{AcquiredFrom, ClaimOutcome, Lease, Op, Record, Resolution, State};
use crate::store::Store;

/// What [`Store::execute`] does when it acquires a key whose previous holder
/// may have acted: that holder's lease lapsed before it recorded an outcome
/// (it crashed, hung, or lost its connection to the store), so its side
/// effect may or may not have happened.
///
/// A retry after a *recorded* retryable failure is not in doubt: its holder
/// said it may run again. Which of the two a takeover is, is what the claim
/// found ([`Lease::acquired_from`]), never a record read before it.
pub enum InDoubt<P = NoProbe> {
    /// Run the work again. Right for work that is harmless to repeat or that
    /// the downstream deduplicates on the key (a model request, a payment
    /// API that is unique on the idempotency key).
    Rerun,
    /// Ask the downstream first, with the probe (see
    /// [`ExecuteOptions::probe_in_doubt`]): `Ok(Some(value))` means the
    /// effect happened and `value` is its result, which is recorded without
    /// running the work ([`Origin::Recovered`]); `Ok(None)` means it did not
    /// happen, so the work runs ([`Origin::Reran`]). "Query instead of
    /// replay" (DESIGN.md).
    Probe(P),
    /// Run nothing and return [`ExecuteError::InDoubt`] with the lease, for a
    /// person (or a reconciliation job) to decide: the at-most-once choice,
    /// right for payments without a way to ask. The default.
    Refuse,
}

impl<P> std::fmt::Debug for InDoubt<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InDoubt::Rerun => "Rerun",
            InDoubt::Probe(_) => "Probe(..)",
            InDoubt::Refuse => "Refuse",
        })
    }
}

/// The probe type of options that have none. It has no values, so
/// [`InDoubt::Probe`] cannot be built with it.
#[derive(Debug, Clone, Copy)]
pub enum NoProbe {}

/// A probe for [`InDoubt::Probe`] in [`Store::execute`]: asks the
/// downstream whether the effect of `lease.key()` happened. Implemented for
/// every `FnOnce(&Lease) -> Result<Option<T>, E>`.
pub trait Probe<T, E> {
    /// `Ok(Some(result))`: the effect happened, with this result.
    /// `Ok(None)`: it did not happen. `Err`: the probe itself failed.
    ///
    /// # Errors
    /// Whatever the downstream returns; [`Store::execute`] then returns
    /// [`ExecuteError::ProbeFailed`].
    fn probe(self, lease: &Lease) -> Result<Option<T>, E>;
}

impl<T, E, F> Probe<T, E> for F
where
    F: FnOnce(&Lease) -> Result<Option<T>, E>,
{
    fn probe(self, lease: &Lease) -> Result<Option<T>, E> {
        self(lease)
    }
}

impl<T, E> Probe<T, E> for NoProbe {
    fn probe(self, _lease: &Lease) -> Result<Option<T>, E> {
        match self {}
    }
}

/// A probe for [`InDoubt::Probe`] in [`Store::execute_async`]. Implemented
/// for every `AsyncFnOnce(&Lease) -> Result<Option<T>, E>`.
pub trait AsyncProbe<T, E> {
    /// As [`Probe::probe`], awaited.
    fn probe(self, lease: &Lease) -> impl Future<Output = Result<Option<T>, E>>;
}

impl<T, E, F> AsyncProbe<T, E> for F
where
    F: AsyncFnOnce(&Lease) -> Result<Option<T>, E>,
{
    fn probe(self, lease: &Lease) -> impl Future<Output = Result<Option<T>, E>> {
        self(lease)
    }
}

impl<T, E> AsyncProbe<T, E> for NoProbe {
    #[allow(clippy::manual_async_fn)]
    fn probe(self, _lease: &Lease) -> impl Future<Output = Result<Option<T>, E>> {
        async move { match self {} }
    }
}

/// Options of one [`Store::execute`] call.
///
/// # Defaults
/// - `lease`: the store's configured lease (30 s unless configured)
/// - `wait`: 30 s, how long to wait for another holder of the key
/// - `poll_delays`: 10 ms doubling to 1 s, plus jitter
/// - `in_doubt`: [`InDoubt::Refuse`]
pub struct ExecuteOptions<P = NoProbe> {
    lease: Option<Duration>,
    wait: Duration,
    poll_min: Duration,
    poll_max: Duration,
    in_doubt: InDoubt<P>,
}

impl<P> std::fmt::Debug for ExecuteOptions<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecuteOptions")
            .field("lease", &self.lease)
            .field("wait", &self.wait)
            .field("poll_min", &self.poll_min)
            .field("poll_max", &self.poll_max)
            .field("in_doubt", &self.in_doubt)
            .finish()
    }
}

impl Default for ExecuteOptions<NoProbe> {
    fn default() -> Self {
        ExecuteOptions {
            lease: None,
            wait: Duration::from_secs(30),
            poll_min: Duration::from_millis(10),
            poll_max: Duration::from_secs(1),
            in_doubt: InDoubt::Refuse,
        }
    }
}

impl ExecuteOptions<NoProbe> {
    /// The defaults (see the type's docs).
    pub fn new() -> Self {
        Self::default()
    }
}

impl<P> ExecuteOptions<P> {
    /// The lease of the claim (whole milliseconds,
    /// [`MIN_RENEWED_LEASE`](crate::MIN_RENEWED_LEASE), 100 ms, to
    /// [`MAX_LEASE`](crate::MAX_LEASE); without it, the store's
    /// [`Config::lease`](crate::Config::lease), which must be as long). While
    /// the work runs, the lease is extended by this much every third of it,
    /// so work may run longer than the lease; the lease only bounds how long
    /// a crashed holder blocks the key. The extensions are scheduled on the
    /// monotonic clock while leases are judged at the store's time, which
    /// follows a wall clock stepped forward at once (docs/store.md): a step
    /// forward by more than the lease has left lapses it, and a call in the
    /// window before the next extension takes the key over (in doubt) while
    /// the work still runs. Choose a lease longer than the steps the hosts'
    /// clocks may take.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How long to wait while another holder runs the work (its lease is
    /// valid), before [`ExecuteError::StillInProgress`]. Zero answers at
    /// once.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The bounds of the delays between two looks at a key another holder
    /// runs, when no wake-up comes (the holder is in another process, or
    /// finished without `execute`): the delay doubles from `min` up to
    /// `max`, plus a random jitter of up to as much again (so waiters do not
    /// look in lockstep), and never runs past the holder's lease deadline or
    /// the end of the wait. `min` must be non-zero and at most `max`.
    #[must_use]
    pub fn poll_delays(mut self, min: Duration, max: Duration) -> Self {
        self.poll_min = min;
        self.poll_max = max;
        self
    }

    /// In doubt, run the work again ([`InDoubt::Rerun`]).
    #[must_use]
    pub fn rerun_in_doubt(self) -> ExecuteOptions<P> {
        self.with_in_doubt(InDoubt::Rerun)
    }

    /// In doubt, run nothing and return [`ExecuteError::InDoubt`]
    /// ([`InDoubt::Refuse`], the default).
    #[must_use]
    pub fn refuse_in_doubt(self) -> ExecuteOptions<P> {
        self.with_in_doubt(InDoubt::Refuse)
    }

    /// In doubt, ask `probe` first ([`InDoubt::Probe`]): a
    /// `FnOnce(&Lease) -> Result<Option<T>, E>` for [`Store::execute`], an
    /// `AsyncFnOnce` of the same shape for [`Store::execute_async`].
    #[must_use]
    pub fn probe_in_doubt<Q>(self, probe: Q) -> ExecuteOptions<Q> {
        ExecuteOptions {
            lease: self.lease,
            wait: self.wait,
            poll_min: self.poll_min,
            poll_max: self.poll_max,
            in_doubt: InDoubt::Probe(probe),
        }
    }

    fn with_in_doubt(mut self, in_doubt: InDoubt<P>) -> Self {
        self.in_doubt = in_doubt;
        self
    }

    /// The claim options, once the options are checked; `default_lease`
    /// is the store's, taken when no lease is set.
    fn check(&self, default_lease: Duration) -> Result<ClaimOptions, Error> {
        crate::config::check_renewed_lease(self.lease.unwrap_or(default_lease))?;
        if self.poll_min.is_zero() {
            return Err(Error::invalid(
                "poll_delays",
                "the minimum must be non-zero",
            ));
        }
        if self.poll_max < self.poll_min {
            return Err(Error::invalid(
                "poll_delays",
                "the maximum is below the minimum",
            ));
        }
        Ok(match self.lease {
            Some(lease) => ClaimOptions::new().lease(lease),
            None => ClaimOptions::new(),
        })
    }
}

/// The outcome of failed work, as the work reports it: the error and
/// whether running the work again may succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure<E> {
    error: E,
    retryable: bool,
}

impl<E> Failure<E> {
    /// A failure after which the work may run again: it is recorded, and the
    /// next call with the key acquires it and runs the work (the stored
    /// failure is not replayed).
    pub fn retryable(error: E) -> Self {
        Failure {
            error,
            retryable: true,
        }
    }

    /// A failure that is final: it is recorded and replayed to every later
    /// call with the key until retention ends, as a stored response is.
    pub fn permanent(error: E) -> Self {
        Failure {
            error,
            retryable: false,
        }
    }

    /// The error.
    pub fn error(&self) -> &E {
        &self.error
    }

    /// Whether the work may run again.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }
}

/// How [`Store::execute`] came by its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// This call ran the work.
    Ran,
    /// This call ran the work after a takeover in doubt ([`InDoubt::Rerun`],
    /// or the probe found that the effect had not happened).
    Reran,
    /// The probe found that an earlier holder's effect happened; its result
    /// was recorded and returned without running the work.
    Recovered,
    /// The value was recorded by an earlier call and replayed; nothing ran.
    Replayed,
}

/// A value returned by [`Store::execute`], with how it came about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executed<T> {
    value: T,
    origin: Origin,
    woken: bool,
}

impl<T> Executed<T> {
    /// The value.
    pub fn value(&self) -> &T {
        &self.value
    }

    /// The value, by move.
    pub fn into_value(self) -> T {
        self.value
    }

    /// How the value came about.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// Whether the value was recorded earlier and replayed (the
    /// `Idempotent-Replayed` flag of an HTTP answer).
    pub fn is_replayed(&self) -> bool {
        self.origin == Origin::Replayed
    }

    /// Whether this call waited for another holder in this process and was
    /// woken by it when it finished (rather than by polling).
    pub fn was_woken(&self) -> bool {
        self.woken
    }
}

/// Why [`Store::execute`] returned no value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecuteError<E> {
    /// The work failed: now (recorded with `fail`), or earlier and
    /// permanently (`replayed`: the stored failure, replayed).
    #[error(
        "work for {key} failed ({}{}): {error}",
        if *retryable { "retryable" } else { "permanent" },
        if *replayed { ", replayed" } else { "" }
    )]
    Failed {
        /// The key.
        key: Key,
        /// The work's error.
        error: E,
        /// Whether the next call runs the work again.
        retryable: bool,
        /// Whether this is a stored failure replayed, not a new one.
        replayed: bool,
    },

    /// Another holder still ran the work when the wait ended (HTTP 409 with
    /// `Retry-After`). Nothing ran here; call again later.
    #[error("{key} is still in progress under another lease (until {lease_until_ms} ms)")]
    StillInProgress {
        /// The key.
        key: Key,
        /// The other holder's lease deadline (ms since the epoch).
        lease_until_ms: u64,
    },

    /// The previous holder's lease lapsed without an outcome, so its effect
    /// may or may not have happened, and the policy is
    /// [`InDoubt::Refuse`]. Nothing ran. The record stays in progress under
    /// `lease` (which is not extended): a person who has found out what
    /// happened records it with [`Store::complete`], [`Store::fail`] or
    /// [`Store::release`] ("nothing happened"), or an operator with
    /// `idemstore resolve`, which the message names with this lease's
    /// token; until then every call finds the key in progress and, once the
    /// lease lapses, in doubt again (under a new token).
    #[error(
        "{} is in doubt: an earlier holder's lease lapsed without an outcome; \
         find out what happened before acting again, then record it: {}; the token is the lease \
         this call took, which is not extended: once it lapses, a later call takes the key \
         over under a new token, which idemstore get shows",
        lease.key(),
        repair_command(lease.key(), lease.token(), lease.record().map(kept_ms), false)
    )]
    InDoubt {
        /// The lease this call acquired; use it to record what happened.
        lease: Lease,
    },

    /// The in-doubt probe failed. Nothing ran; the record stays in
    /// progress under `lease`, as for [`ExecuteError::InDoubt`].
    #[error("probe for {} failed: {error}", lease.key())]
    ProbeFailed {
        /// The lease this call acquired.
        lease: Lease,
        /// The probe's error.
        error: E,
    },

    /// A value or permanent failure could not be turned into JSON (to
    /// record it) or back (to replay it); a retryable failure that cannot
    /// be is recorded as `null` (nothing replays it). Recording also
    /// refuses a value or permanent failure that would not replay: a NaN
    /// or infinite float at any depth (serde_json writes it as `null`), or
    /// JSON that does not decode as its own type (a field skipped when
    /// serialized but required when deserialized). JSON that decodes as
    /// another value of the type (`Some(None)` as `None`) cannot be told
    /// and is recorded. When recording failed, the work's effect may have
    /// happened: the record stays in progress and is in doubt once its
    /// lease lapses.
    #[error("cannot {action} the outcome of {key} as JSON: {detail}")]
    Codec {
        /// The key.
        key: Key,
        /// `"record"` or `"replay"`.
        action: &'static str,
        /// The serde error.
        detail: String,
    },

    /// The work ran, but its value or permanent failure, as JSON, is over
    /// the store's limit ([`Config::max_result_bytes`](crate::Config::max_result_bytes)
    /// or [`Config::max_failure_bytes`](crate::Config::max_failure_bytes),
    /// 1 MiB each by default, at most 16 MiB): nothing was recorded. The
    /// record stays in progress and is in doubt once its lease lapses, as
    /// after a crash, because the work may have acted. Raise the limit or
    /// return less (a replay needs the whole value). A retryable failure
    /// too large to keep is recorded as `null` instead (nothing replays
    /// it; as nothing at all under a `max_failure_bytes` below 4 bytes),
    /// and the call returns [`ExecuteError::Failed`].
    #[error(
        "the work for {key} ran, but its {what} is {len} bytes as JSON, over the store's \
         limit of {limit} bytes, so it was not recorded; the key is in doubt once its lease \
         lapses (raise the store's limit or return less)"
    )]
    TooLargeToRecord {
        /// The key.
        key: Key,
        /// `"result"` or `"failure"`.
        what: &'static str,
        /// The outcome's length as JSON, in bytes.
        len: usize,
        /// The store's limit, in bytes.
        limit: usize,
    },

    /// The work ran, but its outcome was not recorded (or, after
    /// [`Error::OutcomeUnknown`], is not known to be); `error` says why:
    /// [`Error::StaleLease`] (the work outlived its lease and another
    /// caller took the key over, or someone released or resolved it
    /// meanwhile), [`Error::Unavailable`] or [`Error::OutcomeUnknown`] at
    /// every attempt of the outcome's write (tried for the lease's length,
    /// at most 60 s), [`Error::Poisoned`], a storage error. Unlike
    /// [`ExecuteError::Store`], never "nothing ran": after a value or a
    /// permanent failure the effect may have happened, so whatever `error`
    /// says of retries, do not run the work again on it. The record stays
    /// as the store has it: in progress under this call's lease, and in
    /// doubt once that lapses, unless another caller took it over.
    /// `outcome` is what was to be recorded, the value or the failure as
    /// JSON, in the form [`Store::resolve`] takes (`idemstore resolve
    /// --succeeded JSON`, or `--failed JSON` with `--retryable` for a
    /// retryable failure; with `--while-held` while the call's own lease,
    /// under which nothing runs any more, is still valid: `idemstore get`
    /// shows its token).
    #[error("{}", not_recorded(key, error, outcome))]
    #[non_exhaustive]
    NotRecorded {
        /// The key.
        key: Key,
        /// Why the store did not record it.
        error: Error,
        /// The outcome as it was to be recorded.
        outcome: Resolution,
    },

    /// The store refused or failed before the work ran (nothing ran):
    /// [`Error::FingerprintMismatch`] (the key was used with another
    /// payload), [`Error::InvalidArgument`], [`Error::Unavailable`],
    /// storage errors. An outcome that could not be recorded after the
    /// work ran is [`ExecuteError::NotRecorded`].
    #[error(transparent)]
    Store(#[from] Error),
}

/// The message of [`ExecuteError::NotRecorded`].
fn not_recorded(key: &Key, error: &Error, outcome: &Resolution) -> String {
    let what = match outcome {
        Resolution::Succeeded(_) => "its value",
        Resolution::Failed {
            retryable: false, ..
        } => "its permanent failure",
        Resolution::Failed {
            retryable: true, ..
        } => {
            return format!(
                "the work for {key} failed (retryable), but its failure was not recorded: the \
                 key stays in progress, unless another caller took it over, and is in doubt \
                 once its lease lapses: {error}"
            );
        }
    };
    format!(
        "the work for {key} ran, but {what} was not recorded, so its effect may have happened \
         (do not run it again; record what happened once the store answers): {error}"
    )
}

type ExecResult<T, E> = Result<Executed<T>, ExecuteError<E>>;

/// What happened under an acquired lease.
enum Stage<T, E> {
    Recovered(T),
    ProbeFailed(E),
    Ran(Result<T, Failure<E>>),
}

impl Store {
    /// Runs `work` at most once per key and fingerprint, and returns its
    /// value to every call: the run-once primitive for side effects and
    /// for recording a model turn.
    ///
    /// It claims `key` with `fingerprint`, then:
    /// - **Acquired**: runs `work(&lease)` (after the in-doubt policy, when
    ///   the previous holder's lease lapsed without an outcome), extends the
    ///   lease every third of its length while the work runs (from the
    ///   store's extender thread), and records the outcome: the value,
    ///   serialized with `serde_json`, with [`Store::complete`]; a [`Failure`] with
    ///   [`Store::fail`], retryable or not as it says. Returns the value
    ///   ([`Origin::Ran`]) or [`ExecuteError::Failed`].
    /// - **Replay**: returns the recorded value marked
    ///   [`Origin::Replayed`], or the recorded permanent failure as
    ///   [`ExecuteError::Failed`] with `replayed` set. Nothing runs.
    /// - **In progress** (another valid lease holds the key): waits, woken
    ///   directly when the holder is an `execute` of this `Store`, otherwise
    ///   looking again after a delay with backoff and jitter, until the
    ///   holder finishes, its lease lapses (then this call acquires the key
    ///   in doubt), or [`ExecuteOptions::wait`] ends
    ///   ([`ExecuteError::StillInProgress`]).
    ///
    /// The lease is extended by the claim's lease length (whole
    /// milliseconds) each time. One extender per `Store` serves every call
    /// in flight: its first thread starts with the first acquired call (a
    /// store that only replays has none), and it stops when the store
    /// drops; it renews the leases due at the same time in one batch, so
    /// they share a commit, and a batch that waits long for its answer
    /// holds up no other lease's renewal (another thread takes over the
    /// schedule, at most four in all). A
    /// renewal that fails (another caller took the key over, or someone
    /// released or finished it) is logged and not retried; the outcome is
    /// then refused: [`ExecuteError::NotRecorded`] with
    /// [`Error::StaleLease`]. A renewal that could not
    /// reach the store or lost its answer ([`Error::Unavailable`],
    /// [`Error::OutcomeUnknown`]) is tried again a third of the period
    /// later, until one is answered. Renewals go on until the outcome is
    /// recorded, and each must end by half the time left of the lease (at
    /// least a third of the period): on PostgreSQL a connection that has
    /// not answered by then is dropped, so that the retry runs on another
    /// (a half-open connection answers nothing until `call_timeout`). The
    /// outcome is written the same way: each attempt ends within a third
    /// of the lease, and one that did not reach the store or lost its
    /// answer is tried again a ninth of the lease later (at most a second),
    /// for up to the lease's length (at most a minute; a retry after a lost
    /// answer that finds the record finished under this lease counts it as
    /// written); past that, the last error (`OutcomeUnknown` if an answer
    /// was lost). The
    /// value must serialize to at most the store's `max_result_bytes`, a
    /// failure to `max_failure_bytes`.
    ///
    /// A panic in `work` leaves the record in progress; once its lease
    /// lapses the next call finds it in doubt. So does a crash of the
    /// process.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Key, Store};
    /// use idemstore::agent::{ExecuteOptions, Failure, Origin};
    /// use serde_json::json;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// let store = Store::open(dir.path().join("idem.redb"))?;
    /// let params = json!({"title": "printer on fire"});
    /// let key = Key::for_tool_call("acme/tickets.create", "task-42", "call_7")?;
    /// let fingerprint = Fingerprint::of_json(&params)?;
    ///
    /// let create = |_lease: &idemstore::Lease| Ok::<_, Failure<String>>("T-1001".to_string());
    /// let first = store.execute(&key, &fingerprint, ExecuteOptions::new(), create)?;
    /// assert_eq!((first.value().as_str(), first.origin()), ("T-1001", Origin::Ran));
    ///
    /// // The same tool call again: replayed, nothing runs.
    /// let again = store.execute(&key, &fingerprint, ExecuteOptions::new(), |_lease| {
    ///     Err::<String, _>(Failure::permanent("must not run".to_string()))
    /// })?;
    /// assert_eq!(again.value(), "T-1001");
    /// assert!(again.is_replayed());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`ExecuteError`]: `Failed`, `StillInProgress`, `InDoubt`,
    /// `ProbeFailed`, `Codec` (after the work ran, an outcome that cannot
    /// be written as JSON or would not replay, such as a NaN; or
    /// a stored one that does not decode), `TooLargeToRecord` (an outcome
    /// over the store's size limit after the work ran), `NotRecorded` (after
    /// the work ran, an outcome the store did not record: a stale lease,
    /// the store unreachable through the write's attempts), and `Store` for
    /// everything else, before the work runs: what [`Store::claim`] returns
    /// (a fingerprint mismatch above all), for poll delays with a zero
    /// minimum or a maximum below it, and for a lease (the call's, or the
    /// store's [`Config::lease`](crate::Config::lease)) under
    /// [`MIN_RENEWED_LEASE`](crate::MIN_RENEWED_LEASE), checked before the
    /// key is looked up ([`Error::InvalidArgument`]), and
    /// [`Error::Storage`] when the extender thread cannot be started (the
    /// work does not run; the record stays in progress, as after a crash),
    /// and what [`Store::get`] returns (it looks the key up first; on a
    /// store the scrub found damaged, [`Error::CorruptFile`] for a key
    /// without a live record).
    pub fn execute<T, E, P, F>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        options: ExecuteOptions<P>,
        work: F,
    ) -> ExecResult<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        P: Probe<T, E>,
        F: FnOnce(&Lease) -> Result<T, Failure<E>>,
    {
        use event_listener::Listener as _;

        let claim_options = options.check(self.default_lease())?;
        let mut wait = Wait::new(&options);
        let mut watch = None;
        let lease = loop {
            let listener = watch.as_ref().map(super::notify::Watch::listen);
            // Looked up first for what `get` refuses (a key without a live
            // record on a store the scrub found damaged).
            self.get(key)?;
            match self.claim(key, fingerprint, &claim_options)? {
                ClaimOutcome::Replay(record) => return replay(&record, wait.woken),
                ClaimOutcome::Acquired(lease) => break lease,
                ClaimOutcome::InProgress {
                    retry_after,
                    lease_until_ms,
                } => {
                    let left = wait.left(key, lease_until_ms)?;
                    match listener {
                        // First sight of another holder: register for its
                        // wake-up, then look again before sleeping.
                        None => watch = Some(self.waiters.watch(key)),
                        Some(listener) => {
                            let delay = wait.delay(retry_after, left);
                            wait.woken = listener.wait_timeout(delay).is_some();
                        }
                    }
                }
            }
        };
        drop(watch);

        let in_doubt = is_in_doubt(&lease);
        let policy = if in_doubt {
            options.in_doubt
        } else {
            InDoubt::Rerun
        };
        // The lease is kept alive until the outcome is recorded: a write
        // that waits (a connection gone half-open) must not let another
        // caller take the key over meanwhile.
        let (stage, kept) = match policy {
            InDoubt::Refuse => return Err(ExecuteError::InDoubt { lease }),
            InDoubt::Rerun => keep_alive(self, &lease, || Stage::Ran(work(&lease)))?,
            InDoubt::Probe(probe) => keep_alive(self, &lease, || match probe.probe(&lease) {
                Ok(Some(value)) => Stage::Recovered(value),
                Ok(None) => Stage::Ran(work(&lease)),
                Err(error) => Stage::ProbeFailed(error),
            })?,
        };
        let record = Recorder::new(lease, in_doubt, stage)?;
        let length = lease_length(&record.lease);
        kept.recording();
        let done = match self.outcome_op(&record) {
            Ok(Some(op)) => crate::renewal::write_outcome(self, &record.lease, op, length),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        drop(kept);
        record.finish(self, done)
    }

    /// [`Store::execute`] as a future, on any runtime: waits, polls and
    /// lease extensions are awaited (on the `futures-timer` crate's timer
    /// thread) instead of blocking the thread, and the lease is extended by
    /// a future that runs beside `work` in the same task, on the same
    /// schedule (a renewal that did not reach the store is tried again).
    /// So `work` must
    /// not block the thread for long, or the extensions wait too. Dropping
    /// the future while `work` runs (a timeout around it, a cancelled
    /// task) stops the extensions and records nothing: the key stays in
    /// progress, as after a crash, and is in doubt once its lease lapses.
    ///
    /// ```
    /// use idemstore::{Fingerprint, Key, Lease, Store};
    /// use idemstore::agent::{ExecuteOptions, Failure};
    /// use serde_json::json;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// let store = Store::open(dir.path().join("idem.redb"))?;
    /// let key = Key::for_model_turn("acme/agent.turns", "task-42", 0)?;
    /// let history = json!([{"role": "user", "content": "my printer is on fire"}]);
    /// let fingerprint = Fingerprint::of_json(&history)?;
    /// let reply = futures_lite::future::block_on(store.execute_async(
    ///     &key,
    ///     &fingerprint,
    ///     ExecuteOptions::new().rerun_in_doubt(),
    ///     async |_lease: &Lease| Ok::<_, Failure<String>>(json!({"tool_calls": [{"id": "call_1"}]})),
    /// ))?;
    /// assert_eq!(reply.value()["tool_calls"][0]["id"], "call_1");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`Store::execute`].
    pub async fn execute_async<T, E, P, F>(
        &self,
        key: &Key,
        fingerprint: &Fingerprint,
        options: ExecuteOptions<P>,
        work: F,
    ) -> ExecResult<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Serialize + DeserializeOwned,
        P: AsyncProbe<T, E>,
        F: AsyncFnOnce(&Lease) -> Result<T, Failure<E>>,
    {
        let claim_options = options.check(self.default_lease())?;
        let mut wait = Wait::new(&options);
        let mut watch = None;
        let lease = loop {
            let listener = watch.as_ref().map(super::notify::Watch::listen);
            self.get_async(key).await?;
            match self.claim_async(key, fingerprint, &claim_options).await? {
                ClaimOutcome::Replay(record) => return replay(&record, wait.woken),
                ClaimOutcome::Acquired(lease) => break lease,
                ClaimOutcome::InProgress {
                    retry_after,
                    lease_until_ms,
                } => {
                    let left = wait.left(key, lease_until_ms)?;
                    match listener {
                        None => watch = Some(self.waiters.watch(key)),
                        Some(listener) => {
                            let delay = wait.delay(retry_after, left);
                            wait.woken = futures_lite::future::or(
                                async {
                                    listener.await;
                                    true
                                },
                                async {
                                    futures_timer::Delay::new(delay).await;
                                    false
                                },
                            )
                            .await;
                        }
                    }
                }
            }
        };
        drop(watch);

        let in_doubt = is_in_doubt(&lease);
        let policy = if in_doubt {
            options.in_doubt
        } else {
            InDoubt::Rerun
        };
        if matches!(policy, InDoubt::Refuse) {
            return Err(ExecuteError::InDoubt { lease });
        }
        // The lease is kept alive until the outcome is recorded (a write
        // that waits on a connection gone half-open must not let another
        // caller take the key over meanwhile), by renewals of a copy of
        // it: the lease itself goes into the record.
        let renewed = Lease::from_parts(lease.key().clone(), lease.token());
        let length = lease_length(&lease);
        // Set once the outcome is being written: renewals go on, their
        // failures unlogged (see `renewing`).
        let recording = &AtomicBool::new(false);
        let run_and_record = async move {
            let stage = match policy {
                InDoubt::Probe(probe) => match probe.probe(&lease).await {
                    Ok(Some(value)) => Stage::Recovered(value),
                    Ok(None) => Stage::Ran(work(&lease).await),
                    Err(error) => Stage::ProbeFailed(error),
                },
                _ => Stage::Ran(work(&lease).await),
            };
            let record = Recorder::new(lease, in_doubt, stage)?;
            recording.store(true, Ordering::Relaxed);
            let done = match self.outcome_op(&record) {
                Ok(Some(op)) => {
                    crate::renewal::write_outcome_async(self, &record.lease, op, length, &mut None)
                        .await
                }
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            record.finish(self, done)
        };
        keep_alive_async(self, &renewed, length, recording, run_and_record).await
    }
}

/// Whether a lease `execute` acquired is in doubt: the claim took over a
/// lapsed lease, as the claim itself reports it (a record read before the
/// claim could change in between: a retryable failure recorded meanwhile,
/// or a release and a new holder that crashed).
fn is_in_doubt(lease: &Lease) -> bool {
    !matches!(
        lease.acquired_from(),
        Some(AcquiredFrom::Absent | AcquiredFrom::RetryableFailure)
    )
}

/// The waiting side of a call that found the key in progress.
struct Wait {
    deadline: Option<Instant>,
    delays: Delays,
    woken: bool,
}

impl Wait {
    fn new<P>(options: &ExecuteOptions<P>) -> Self {
        Wait {
            deadline: Instant::now().checked_add(options.wait),
            delays: Delays::added_jitter(options.poll_min, options.poll_max),
            woken: false,
        }
    }

    /// The time left to wait, or the still-in-progress error once the wait
    /// is over.
    fn left<E>(&self, key: &Key, lease_until_ms: u64) -> Result<Duration, ExecuteError<E>> {
        let left = self.deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if left.is_zero() {
            return Err(ExecuteError::StillInProgress {
                key: key.clone(),
                lease_until_ms,
            });
        }
        Ok(left)
    }

    /// How long to sleep before looking again: the next jittered delay, but
    /// never past the holder's lease deadline or the end of the wait.
    fn delay(&mut self, retry_after: Duration, left: Duration) -> Duration {
        self.delays.next_delay().min(retry_after).min(left)
    }
}

/// The record write that ends an acquired lease.
enum Write {
    Complete(Vec<u8>),
    Fail(Vec<u8>, bool),
    None,
}

/// `value` as the JSON to record, when every replay can return it: what
/// is recorded is what every later call decodes, so a value that would not
/// come back as itself would answer those calls wrongly, or fail each of
/// them until retention ends. Refused, with what to fix: a NaN or infinite
/// float at any depth (serde_json writes it as `null`), and JSON that does
/// not decode as `V` (a field skipped when serialized but required when
/// deserialized); a serialization error as serde_json gives it.
fn replayable<V: Serialize + DeserializeOwned>(value: &V) -> Result<Vec<u8>, String> {
    const UNRECORDED: &str = "it was not recorded; the work ran (or the probe found its \
                              effect): the key is in doubt once its lease lapses";
    super::finite::check(value).map_err(|e| format!("{e}; {UNRECORDED}"))?;
    let bytes = serde_json::to_vec(value).map_err(|e| format!("{e}; {UNRECORDED}"))?;
    serde_json::from_slice::<V>(&bytes).map_err(|e| {
        format!(
            "its JSON does not decode as its own type ({e}), so no replay could return it; \
             {UNRECORDED}"
        )
    })?;
    Ok(bytes)
}

/// The outcome of the work, encoded and ready to be recorded.
struct Recorder<T, E> {
    lease: Lease,
    write: Write,
    answer: ExecResult<T, E>,
}

impl<T: Serialize + DeserializeOwned, E: Serialize + DeserializeOwned> Recorder<T, E> {
    fn new(lease: Lease, in_doubt: bool, stage: Stage<T, E>) -> Result<Self, ExecuteError<E>> {
        let key = lease.key().clone();
        let codec = |detail: String| ExecuteError::Codec {
            key: key.clone(),
            action: "record",
            detail,
        };
        let ran = if in_doubt { Origin::Reran } else { Origin::Ran };
        let (write, answer) = match stage {
            Stage::Recovered(value) => (
                Write::Complete(replayable(&value).map_err(codec)?),
                Ok(Executed {
                    value,
                    origin: Origin::Recovered,
                    woken: false,
                }),
            ),
            Stage::Ran(Ok(value)) => (
                Write::Complete(replayable(&value).map_err(codec)?),
                Ok(Executed {
                    value,
                    origin: ran,
                    woken: false,
                }),
            ),
            Stage::Ran(Err(Failure { error, retryable })) => (
                Write::Fail(
                    if retryable {
                        // Never replayed: the next call runs the work again.
                        // One that serde_json cannot write is kept as
                        // `null`, as one too large to keep is.
                        serde_json::to_vec(&error).unwrap_or_else(|_| b"null".to_vec())
                    } else {
                        replayable(&error).map_err(codec)?
                    },
                    retryable,
                ),
                Err(ExecuteError::Failed {
                    key: key.clone(),
                    error,
                    retryable,
                    replayed: false,
                }),
            ),
            Stage::ProbeFailed(error) => (
                Write::None,
                Err(ExecuteError::ProbeFailed {
                    lease: lease.clone(),
                    error,
                }),
            ),
        };
        Ok(Recorder {
            lease,
            write,
            answer,
        })
    }

    /// Wakes this process's waiters once the outcome is recorded.
    fn finish(self, store: &Store, done: Result<(), Error>) -> ExecResult<T, E> {
        match done {
            Ok(()) => {}
            Err(Error::TooLarge { what, len, limit }) => {
                return Err(ExecuteError::TooLargeToRecord {
                    key: self.lease.key().clone(),
                    what,
                    len,
                    limit,
                });
            }
            Err(error) => {
                let outcome = match self.write {
                    Write::Complete(bytes) => Resolution::Succeeded(bytes),
                    Write::Fail(failure, retryable) => Resolution::Failed { failure, retryable },
                    // Nothing to write was written: the store's error
                    // stands as it is.
                    Write::None => return Err(error.into()),
                };
                return Err(ExecuteError::NotRecorded {
                    key: self.lease.key().clone(),
                    error,
                    outcome,
                });
            }
        }
        if !matches!(self.write, Write::None) {
            store.waiters.notify(self.lease.key());
        }
        self.answer
    }
}

impl Store {
    /// The write that records `record`'s outcome (`None` when nothing is
    /// written), or why it cannot be written (too large).
    fn outcome_op<T, E>(&self, record: &Recorder<T, E>) -> Result<Option<Op>, Error> {
        let lease = &record.lease;
        match &record.write {
            Write::Complete(bytes) => self.complete_op(lease, bytes).map(Some),
            Write::Fail(bytes, true) => self
                .fail_op(lease, self.kept_retryable_failure(bytes), true)
                .map(Some),
            Write::Fail(bytes, false) => self.fail_op(lease, bytes, false).map(Some),
            Write::None => Ok(None),
        }
    }
}

/// How long `record` is kept past its last change, in ms: the store's
/// retention for a finished record, and at least the retention for one
/// just acquired (its retention ends no earlier than its lease).
fn kept_ms(record: &Record) -> u64 {
    record.expires_ms().saturating_sub(record.updated_ms())
}

/// The `idemstore resolve` command that records (or, with `amend`,
/// corrects) the outcome of `key` held under `token`, as one line a shell
/// runs once STORE and JSON are filled in, with `--retention` when known
/// (`retention_ms`: the command's default is 24 h, and a resolved record
/// kept for less than the store's retention would let a retry run the work
/// again). The scope and id are quoted for a POSIX shell where needed
/// (they may hold spaces or quotes) and come after `--`, so that one
/// starting with `-` is not read as an option.
fn repair_command(key: &Key, token: u64, retention_ms: Option<u64>, amend: bool) -> String {
    let retention = retention_ms.map_or_else(String::new, |ms| format!(" --retention {ms}ms"));
    let (amend, failed) = if amend {
        (
            " --amend",
            "--failed JSON in place of --succeeded JSON for a failure",
        )
    } else {
        // The lease named is the refusing call's own, under which nothing
        // runs: resolve may take it while it is valid.
        (
            " --while-held",
            "--failed JSON in place of --succeeded JSON if it did not take effect, with \
             --retryable to let the next call run it",
        )
    };
    format!(
        "idemstore resolve STORE --token {token}{retention}{amend} --succeeded JSON -- {scope} \
         {id} \
         (STORE and JSON filled in; {failed}; --schema NAME after STORE for a PostgreSQL \
         schema other than idemstore)",
        scope = shell_word(key.scope()),
        id = shell_word(key.id()),
    )
}

/// `word` quoted for a POSIX shell when it needs quoting (a key holds no
/// NUL byte, which no quoting could carry; it is then given as is).
fn shell_word(word: &str) -> std::borrow::Cow<'_, str> {
    shlex::try_quote(word).unwrap_or(std::borrow::Cow::Borrowed(word))
}

/// The stored outcome of a replayed record, decoded.
fn replay<T: DeserializeOwned, E: DeserializeOwned>(
    record: &Record,
    woken: bool,
) -> ExecResult<T, E> {
    let key = record.key();
    // The record is final until retention ends: name the command that
    // corrects it (an outcome written by hand, or by an older build whose
    // types differ), so that the key is not unusable until then.
    let decode_error = |detail: String| ExecuteError::Codec {
        key: key.clone(),
        action: "replay",
        detail: format!(
            "{detail}; the stored outcome is not the JSON this call reads. If it was recorded \
             by hand, correct it: {}",
            repair_command(key, record.token(), Some(kept_ms(record)), true)
        ),
    };
    match record.state() {
        State::Succeeded => {
            let bytes = record
                .result()
                .ok_or_else(|| decode_error("the record holds no result".into()))?;
            let value = serde_json::from_slice(bytes).map_err(|e| decode_error(e.to_string()))?;
            Ok(Executed {
                value,
                origin: Origin::Replayed,
                woken,
            })
        }
        State::Failed { retryable } => {
            let bytes = record
                .failure()
                .ok_or_else(|| decode_error("the record holds no failure".into()))?;
            let error = serde_json::from_slice(bytes).map_err(|e| decode_error(e.to_string()))?;
            Err(ExecuteError::Failed {
                key: key.clone(),
                error,
                retryable,
                replayed: true,
            })
        }
        State::Processing => Err(decode_error("the record is still in progress".into())),
    }
}

/// The lease length of an acquired lease: its deadline minus its
/// acquisition time (whole milliseconds, at least 1).
fn lease_length(lease: &Lease) -> Duration {
    let ms = lease.record().map_or(1, |r| {
        r.lease_until_ms().saturating_sub(r.updated_ms()).max(1)
    });
    Duration::from_millis(ms)
}

/// Runs `f` while the store's extender (one per `Store`, shared by every
/// call in flight) extends `lease` every third of its length, and
/// returns the registration that goes on extending it: dropped once the
/// outcome is recorded (or when `f` unwinds), it waits for a renewal under
/// way, and none follows.
///
/// # Errors
/// [`Error::Storage`] when the extender's thread cannot be started; `f`
/// does not run then, and the record stays in progress under `lease` (as
/// after a crash: in doubt once the lease lapses).
fn keep_alive<R>(
    store: &Store,
    lease: &Lease,
    f: impl FnOnce() -> R,
) -> Result<(R, crate::extender::Registration), Error> {
    let registration = store.extender.register(lease, lease_length(lease))?;
    let out = f();
    Ok((out, registration))
}

/// Runs `work` beside a future that extends `lease` every third of its
/// length, until `work` is done, on the extender's schedule
/// ([`next_renewal`](crate::renewal::next_renewal)): a renewal that could
/// not reach the store is tried again a third of the period later, until
/// one is answered; after any other failure the lease is not renewed
/// again (recording the outcome then fails as the docs of
/// [`Store::execute_async`] say).
async fn keep_alive_async<R>(
    store: &Store,
    lease: &Lease,
    length: Duration,
    recording: &AtomicBool,
    work: impl Future<Output = R>,
) -> R {
    renewing(lease.key(), length, recording, work, |deadline| {
        store.extend_by_async(lease, length, deadline)
    })
    .await
}

/// Runs `work` beside a loop that calls `renew` every third of `length` on
/// the extender's schedule, until `work` is done (see
/// [`keep_alive_async`]); each renewal is given the extender's deadline
/// ([`renewal_deadline`](crate::renewal::renewal_deadline)). Once
/// `recording` is set (the outcome is being written), a renewal's failure
/// is not logged: one that meets the recorded outcome fails as a stale
/// lease, which is no loss.
async fn renewing<R, T, F: Future<Output = Result<T, Error>>>(
    key: &Key,
    length: Duration,
    recording: &AtomicBool,
    work: impl Future<Output = R>,
    mut renew: impl FnMut(Instant) -> F,
) -> R {
    let period = crate::renewal::period_of(length);
    let keep = async {
        let mut wait = period;
        let mut unreachable = false;
        let start = Instant::now();
        let mut expires = start.checked_add(length).unwrap_or(start);
        loop {
            futures_timer::Delay::new(wait).await;
            let sent = Instant::now();
            let deadline = crate::renewal::renewal_deadline(sent, expires, period);
            let result = renew(deadline).await;
            if result.is_ok() {
                expires = sent.checked_add(length).unwrap_or(sent);
            }
            let next = if recording.load(Ordering::Relaxed) {
                crate::renewal::next_renewal(period, &result)
            } else {
                crate::renewal::after_renewal(key, period, &result, &mut unreachable)
            };
            match next {
                Some(after) => wait = after,
                None => break,
            }
        }
        futures_lite::future::pending::<R>().await
    };
    futures_lite::future::or(work, keep).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// `execute_async`'s renewals follow the extender's schedule: a renewal
    /// that could not reach the store (a PostgreSQL restart) is tried again
    /// until one is answered, and the renewals go on after it. (They
    /// stopped at the first failure: the lease lapsed under running work
    /// and a retry ran it again.) The work ends once the fourth renewal was
    /// asked for; without it, the guard fails the test.
    #[test]
    fn an_async_renewal_that_did_not_reach_the_store_is_tried_again() {
        let tries = AtomicUsize::new(0);
        let key = Key::new("t", "renewals").expect("key");
        let renew = |_deadline: Instant| {
            let n = tries.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n <= 2 {
                    Err(Error::Unavailable {
                        detail: "the server restarts".into(),
                    })
                } else {
                    Ok(n)
                }
            }
        };
        let work = async {
            while tries.load(Ordering::SeqCst) < 4 {
                futures_timer::Delay::new(Duration::from_millis(1)).await;
            }
        };
        let guard = async {
            futures_timer::Delay::new(Duration::from_secs(60)).await;
            panic!(
                "renewed {} times, then never again",
                tries.load(Ordering::SeqCst)
            );
        };
        futures_lite::future::block_on(futures_lite::future::or(
            // A lease of 9 ms: renewed every 3 ms.
            renewing(
                &key,
                Duration::from_millis(9),
                &AtomicBool::new(false),
                work,
                renew,
            ),
            guard,
        ));
    }
}
