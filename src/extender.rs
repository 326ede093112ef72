//! The lease extender of [`Store::execute`](crate::Store::execute) and of
//! the HTTP layer's requests (from the claim to the recorded outcome):
//! background threads of the `Store` that keep the lease of every call in
//! flight alive, whatever the caller's thread does meanwhile (work that
//! blocks it, an async runtime that stops polling the call's task).
//!
//! A call registers its lease while its work runs and gets a
//! [`Registration`]; dropping that deregisters it. The extender keeps the
//! registered leases ordered by their next renewal time; one of its
//! threads (the scheduling one) sleeps until the earliest is due (or a
//! registration due sooner wakes it), and renews every lease that is due
//! in one batch: all extensions are queued before any is waited for, so a
//! batch shares the writer's group commit.
//!
//! - **Threads**: before a thread waits for its batch's answer, it hands
//!   the schedule to another thread (one on standby, or a new one, at most
//!   [`MAX_THREADS`] in all), so a batch that waits long (a PostgreSQL
//!   connection gone half-open, a row lock) holds up no other lease's
//!   renewal: with one thread, a long lease's renewal waiting for its
//!   deadline (up to half its time left) let every shorter lease due
//!   meanwhile lapse. Only when all [`MAX_THREADS`] wait for answers do
//!   the leases due wait for one of them. A store renewing leases has two
//!   threads as a rule: one scheduling, one renewing or on standby.
//!
//! - **Schedule**: a lease of length `L` is renewed `L / 3` (at least 1 ms)
//!   after its registration, then `L / 3` after each renewal returned, each
//!   time to the store's `now + L` ([`Store::extend`](crate::Store::extend)).
//! - **Failure**: a renewal that fails (a stale lease: the key was taken
//!   over, released or finished by someone else; a storage error) is logged
//!   as a warning (not once the call records its outcome, when one that
//!   meets that outcome fails as a stale lease, which is no loss) and that
//!   lease is not renewed again (so is every lease of a batch whose
//!   renewal panics: the thread goes on). The call learns of it
//!   as it always has: recording its outcome fails, with
//!   [`Error::StaleLease`] when the lease is no longer current. A renewal
//!   that could not reach the store or lost its answer
//!   ([`Error::Unavailable`], [`Error::OutcomeUnknown`]: a PostgreSQL
//!   server restarting, a network blip) says nothing of the lease, which is
//!   still the call's: it is tried again a third of the period later (at
//!   least 1 ms), and so on until a renewal is answered (an extension of a
//!   lapsed lease that nobody took over succeeds, as
//!   [`Store::extend`](crate::Store::extend) says). Each renewal has a
//!   deadline, half the time left of the lease (at least a third of the
//!   period, see [`renewal_deadline`]): a PostgreSQL store drops a
//!   connection that has not answered by then (a half-open one answers
//!   nothing until `call_timeout`, longer than the lease may be), so the
//!   retry runs on another connection while the lease lasts, and the
//!   server ends the dropped one's session, releasing its row locks, once
//!   it has sat inside the transaction for half the renewal's time. A
//!   batch on PostgreSQL waits at most a quarter of its time for a row
//!   lock, then renews each lease in a transaction of its own, so a row
//!   another session holds fails its own lease's renewal and the others
//!   are renewed (several locked rows may use up the batch's time first;
//!   the leases they leave are tried again a ninth of their length later;
//!   see `pg::renewal_lock_wait`).
//! - **Deregistration** waits while a renewal of that lease is under way
//!   (until the batch it is in is answered: one group commit, as a rule)
//!   and removes it, so no lease is ever
//!   renewed after its call deregistered it; it never waits for other
//!   leases' renewals. A registration made for async code
//!   ([`Extender::register_unwaited`]) never waits: dropped while its
//!   renewal is under way, it is removed once that renewal is answered,
//!   and not renewed again (that one renewal may still land after the
//!   drop).
//! - **Lifetime**: the first thread (`idemstore-extender`) starts at the
//!   first registration, so a store that never runs work under `execute`
//!   nor serves a keyed HTTP request has none, and the others at the first
//!   batch that finds no thread on standby; all stop, and are joined, when
//!   the store drops. They hold the store only weakly (an HTTP
//!   registration may outlive the store; its renewals then fail with
//!   `Error::Closed`).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::Error;
use crate::record::Lease;
use crate::renewal::{after_renewal, next_renewal, period_of, renewal_deadline};

/// The most threads an extender runs: one scheduling, the others each
/// waiting for a batch's answer (or on standby). Each waiting batch may
/// hold a connection of a PostgreSQL store.
pub(crate) const MAX_THREADS: usize = 4;

/// Renews many leases at once, each by its duration, ending by the
/// deadline (see [`renewal_deadline`]): one answer per lease, in order (the
/// new lease deadline in ms since the epoch, or why not).
type Renew = dyn Fn(&[(Lease, Duration)], Instant) -> Vec<Result<u64, Error>> + Send + Sync;

/// One store's lease extender (see the module docs).
pub(crate) struct Extender {
    shared: Arc<Shared>,
    renew: Arc<Renew>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Extender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extender")
            .field("leases", &self.shared.state.lock().entries.len())
            .field("running", &self.thread.lock().is_some())
            .finish()
    }
}

/// What the thread and the registrations share.
struct Shared {
    state: Mutex<State>,
    /// Wakes the thread: a registration due before every other, or the
    /// stop.
    wake: Condvar,
    /// Wakes deregistrations waiting for a renewal under way to return.
    settled: Condvar,
    /// Wakes a thread on standby to take over the schedule, or the stop.
    standby: Condvar,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    /// Scheduled renewals, earliest first: (due time, entry id). An entry
    /// whose renewal is under way or failed is not in it.
    due: BTreeSet<(Instant, u64)>,
    next_id: u64,
    stop: bool,
    /// A thread is waiting for the next renewal to be due.
    scheduling: bool,
    /// Until when that thread waits (`None`: until it is woken).
    scheduled_for: Option<Instant>,
    /// Threads waiting on [`Shared::standby`].
    on_standby: usize,
    /// Threads started after the first (joined on drop), at most
    /// [`MAX_THREADS`] `- 1`.
    more: Vec<JoinHandle<()>>,
}

/// One registered lease.
struct Entry {
    /// The key and fencing token (the acquired record is not kept).
    lease: Lease,
    /// How far each renewal extends it.
    length: Duration,
    /// The time between a renewal's return and the next renewal.
    period: Duration,
    /// Its place in [`State::due`], when scheduled.
    due: Option<Instant>,
    /// A renewal of it is under way, outside the lock.
    in_flight: bool,
    /// Its last renewal did not reach the store (warned once per run).
    unreachable: bool,
    /// Its outcome is being recorded ([`Registration::recording`]): a
    /// renewal's failure is not logged, since one that meets the recorded
    /// outcome fails as a stale lease.
    recording: bool,
    /// When the lease ends at the earliest, as far as this thread knows:
    /// `length` after the registration, then after each renewal was sent.
    expires: Instant,
    /// Its registration was dropped without waiting while its renewal was
    /// under way: removed once that renewal is answered.
    dropped: bool,
}

impl Extender {
    /// An extender for the store behind `target`, which it holds weakly:
    /// `renew(target, leases)` extends each lease by its duration and
    /// answers one result per lease, in order. No thread starts until the
    /// first registration; once the target is gone every renewal
    /// fails with [`Error::Closed`].
    pub(crate) fn new<T, F>(target: &Arc<T>, renew: F) -> Extender
    where
        T: Send + Sync + 'static,
        F: Fn(&T, &[(Lease, Duration)], Instant) -> Vec<Result<u64, Error>> + Send + Sync + 'static,
    {
        let weak: Weak<T> = Arc::downgrade(target);
        let renew = move |leases: &[(Lease, Duration)], deadline: Instant| match weak.upgrade() {
            Some(target) => renew(&target, leases, deadline),
            None => leases.iter().map(|_| Err(Error::Closed)).collect(),
        };
        Extender {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
                settled: Condvar::new(),
                standby: Condvar::new(),
            }),
            renew: Arc::new(renew),
            thread: Mutex::new(None),
        }
    }

    /// Keeps `lease` alive until the returned registration is dropped: it is
    /// extended by `length` (the claim's lease length, 1 ms to
    /// [`MAX_LEASE`](crate::MAX_LEASE)) every third of `length` (at least
    /// every millisecond), the first time a third of `length` from now.
    /// Starts the extender's first thread if it is not running yet.
    ///
    /// # Errors
    /// [`Error::Storage`] when the thread cannot be started (the system is
    /// out of threads); nothing is registered then.
    #[cfg(any(feature = "agent", test))]
    pub(crate) fn register(&self, lease: &Lease, length: Duration) -> Result<Registration, Error> {
        self.enter(lease, length, true)
    }

    /// [`Extender::register`] for async code: dropping the registration
    /// never blocks the thread (see [`Registration`]'s `Drop`).
    ///
    /// # Errors
    /// As [`Extender::register`].
    #[cfg(feature = "http")]
    pub(crate) fn register_unwaited(
        &self,
        lease: &Lease,
        length: Duration,
    ) -> Result<Registration, Error> {
        self.enter(lease, length, false)
    }

    fn enter(&self, lease: &Lease, length: Duration, wait: bool) -> Result<Registration, Error> {
        self.start()?;
        let period = period_of(length);
        let now = Instant::now();
        let due = now.checked_add(period).unwrap_or(now);
        let mut state = self.shared.state.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.entries.insert(
            id,
            Entry {
                lease: Lease::from_parts(lease.key().clone(), lease.token()),
                length,
                period,
                due: Some(due),
                in_flight: false,
                unreachable: false,
                recording: false,
                expires: now.checked_add(length).unwrap_or(now),
                dropped: false,
            },
        );
        state.due.insert((due, id));
        let wake = wakes_the_schedule(&state);
        drop(state);
        if wake {
            self.shared.wake.notify_one();
        }
        Ok(Registration {
            shared: self.shared.clone(),
            id,
            wait,
        })
    }

    /// Whether the thread has been started (and not yet stopped).
    #[cfg(test)]
    fn is_running(&self) -> bool {
        self.thread.lock().is_some()
    }

    fn start(&self) -> Result<(), Error> {
        let mut thread = self.thread.lock();
        if thread.is_none() {
            let shared = self.shared.clone();
            let renew = self.renew.clone();
            let handle = std::thread::Builder::new()
                .name("idemstore-extender".into())
                .spawn(move || run(&shared, &renew))
                .map_err(|e| Error::storage(format!("cannot start the lease extender: {e}")))?;
            *thread = Some(handle);
        }
        Ok(())
    }
}

impl Drop for Extender {
    /// Stops the thread and waits for it. A store has no `execute` call in
    /// flight when it drops; an HTTP request's registration may outlive it,
    /// and there is no store left to renew it in.
    fn drop(&mut self) {
        self.shared.state.lock().stop = true;
        self.shared.wake.notify_all();
        self.shared.standby.notify_all();
        if let Some(handle) = self.thread.get_mut().take() {
            let _ = handle.join();
        }
        // A thread starts only under the lock and before the stop, so
        // every one is in the list by now.
        let more = std::mem::take(&mut self.shared.state.lock().more);
        for handle in more {
            let _ = handle.join();
        }
    }
}

/// A lease kept alive by the extender until this is dropped. Owns its
/// share of the extender (it borrows no store), so it may be held anywhere,
/// across threads and in futures.
pub(crate) struct Registration {
    shared: Arc<Shared>,
    id: u64,
    /// Whether dropping it waits for a renewal under way (see `Drop`).
    wait: bool,
}

impl Registration {
    /// The call is recording its outcome: the lease is still renewed until
    /// the registration drops, but a renewal that fails meanwhile is not
    /// logged (one that reaches the store after the outcome fails as a
    /// stale lease, which is no loss; the outcome's write reports its own
    /// failure).
    pub(crate) fn recording(&self) {
        if let Some(entry) = self.shared.state.lock().entries.get_mut(&self.id) {
            entry.recording = true;
        }
    }
}

impl Drop for Registration {
    /// Deregisters the lease: waits while a renewal of it is under way
    /// (until its batch is answered: one group commit, as a rule), then
    /// removes it, so it is never renewed again. Blocks the thread for that
    /// long. One made by [`Extender::register_unwaited`] never blocks: a
    /// renewal under way is left to be answered (it may land after this),
    /// and the thread removes the lease then.
    fn drop(&mut self) {
        let mut state = self.shared.state.lock();
        if !self.wait
            && let Some(entry) = state.entries.get_mut(&self.id)
            && entry.in_flight
        {
            entry.dropped = true;
            return;
        }
        while state.entries.get(&self.id).is_some_and(|e| e.in_flight) {
            self.shared.settled.wait(&mut state);
        }
        let Some(entry) = state.entries.remove(&self.id) else {
            return;
        };
        // The thread is not woken: asleep until this lease's time, it then
        // finds nothing due and sleeps until the next (one wake however
        // many leases were removed meanwhile, where a wake per removal
        // would cost a switch per HTTP request).
        if let Some(due) = entry.due {
            state.due.remove(&(due, self.id));
        }
    }
}

/// A thread of the extender, until the stop: renews whatever is due, and
/// hands the schedule to another thread before it waits for the answer;
/// with nothing due, it sleeps until the next renewal is due or it is
/// woken, unless another thread does so already (it waits on standby).
fn run(shared: &Arc<Shared>, renew: &Arc<Renew>) {
    let mut state = shared.state.lock();
    loop {
        if state.stop {
            return;
        }
        let batch = take_due(&mut state, Instant::now());
        if batch.is_empty() {
            if state.scheduling {
                state.on_standby += 1;
                shared.standby.wait(&mut state);
                state.on_standby -= 1;
                continue;
            }
            state.scheduling = true;
            state.scheduled_for = state.due.first().map(|&(due, _)| due);
            match state.scheduled_for {
                Some(due) => {
                    shared.wake.wait_until(&mut state, due);
                }
                None => shared.wake.wait(&mut state),
            }
            state.scheduling = false;
            continue;
        }
        hand_over(shared, renew, &mut state);
        let leases: Vec<(Lease, Duration)> = batch
            .iter()
            .map(|(_, lease, d)| (lease.clone(), *d))
            .collect();
        let sent = Instant::now();
        let deadline = batch
            .iter()
            .filter_map(|(id, _, _)| state.entries.get(id))
            .map(|e| renewal_deadline(sent, e.expires, e.period))
            .min()
            .unwrap_or(sent);
        // A renewal that panics (a defect in the engine's code) must not
        // end the thread: its leases would go unrenewed, and a waited
        // deregistration would wait for ever for the batch in flight. The
        // batch fails as a storage error instead (not renewed again).
        let results = MutexGuard::unlocked(&mut state, || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| renew(&leases, deadline)))
                .unwrap_or_else(|_| {
                    leases
                        .iter()
                        .map(|_| Err(Error::storage("the lease extension panicked")))
                        .collect()
                })
        });
        settle(&mut state, &batch, results, sent, Instant::now());
        shared.settled.notify_all();
        // The thread scheduling meanwhile sleeps until a renewal due before
        // these were put back.
        if wakes_the_schedule(&state) {
            shared.wake.notify_one();
        }
    }
}

/// Whether a renewal is due before the scheduling thread wakes (a lease
/// registered, or put back by a batch another thread renewed).
fn wakes_the_schedule(state: &State) -> bool {
    let first = state.due.first().map(|&(due, _)| due);
    state.scheduling
        && match (first, state.scheduled_for) {
            (Some(first), Some(until)) => first < until,
            (first, None) => first.is_some(),
            (None, Some(_)) => false,
        }
}

/// Before a thread waits for a batch's answer: wakes a thread on standby to
/// take over the schedule, or starts one if there are fewer than
/// [`MAX_THREADS`]. When none can be had (all wait for answers, or the
/// system is out of threads), the leases due wait for a thread to return.
fn hand_over(shared: &Arc<Shared>, renew: &Arc<Renew>, state: &mut State) {
    if state.scheduling {
        return;
    }
    if state.on_standby > 0 {
        shared.standby.notify_one();
        return;
    }
    // The first thread is not in `more`.
    if state.more.len() + 1 >= MAX_THREADS {
        return;
    }
    let (shared, renew) = (shared.clone(), renew.clone());
    let started = std::thread::Builder::new()
        .name("idemstore-extender".into())
        .spawn(move || run(&shared, &renew));
    match started {
        Ok(handle) => state.more.push(handle),
        Err(e) => tracing::warn!(
            error = %e,
            "cannot start another lease extender thread: leases due while a renewal waits \
             for its answer wait too"
        ),
    }
}

/// Takes every renewal due by `now` off the schedule and marks it under
/// way: (entry id, lease, length) each.
fn take_due(state: &mut State, now: Instant) -> Vec<(u64, Lease, Duration)> {
    let mut batch = Vec::new();
    while let Some(&(due, id)) = state.due.first() {
        if due > now {
            break;
        }
        state.due.pop_first();
        if let Some(entry) = state.entries.get_mut(&id) {
            entry.due = None;
            entry.in_flight = true;
            batch.push((id, entry.lease.clone(), entry.length));
        }
    }
    batch
}

/// Records the answers of a batch: a renewed lease is due again a period
/// after `now`; one whose renewal did not reach the store is due again a
/// third of that after `now`; a lease whose renewal failed otherwise is
/// logged and not renewed again (it stays registered until its call
/// deregisters it); a lease whose registration was dropped without waiting
/// while its renewal was under way is removed.
fn settle(
    state: &mut State,
    batch: &[(u64, Lease, Duration)],
    results: Vec<Result<u64, Error>>,
    sent: Instant,
    now: Instant,
) {
    let mut results = results.into_iter();
    for (id, lease, _) in batch {
        let result = results
            .next()
            .unwrap_or_else(|| Err(Error::Storage("no answer to a lease extension".into())));
        let Some(entry) = state.entries.get_mut(id) else {
            continue;
        };
        if entry.dropped {
            state.entries.remove(id);
            continue;
        }
        entry.in_flight = false;
        if result.is_ok() {
            entry.expires = sent.checked_add(entry.length).unwrap_or(sent);
        }
        let next = if entry.recording {
            next_renewal(entry.period, &result)
        } else {
            after_renewal(lease.key(), entry.period, &result, &mut entry.unreachable)
        };
        if let Some(after) = next {
            let due = now.checked_add(after).unwrap_or(now);
            entry.due = Some(due);
            state.due.insert((due, *id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A fake store: counts renewals per token and fails the tokens it is
    /// told to.
    #[derive(Default)]
    struct Fake {
        renewed: Mutex<HashMap<u64, usize>>,
        failing: Mutex<Vec<u64>>,
        /// How many more renewals of a token fail as unreachable.
        unreachable: Mutex<HashMap<u64, usize>>,
        slow: AtomicBool,
        /// While set, a renewal waits (after saying so in `inside`).
        hold: AtomicBool,
        inside: AtomicBool,
        /// How many more renewal batches panic.
        panics: Mutex<usize>,
        /// A batch holding this token waits while it is set.
        stuck: Mutex<Option<u64>>,
        /// Batches being renewed now.
        active: std::sync::atomic::AtomicUsize,
    }

    impl Fake {
        fn count(&self, token: u64) -> usize {
            self.renewed.lock().get(&token).copied().unwrap_or(0)
        }
    }

    fn extender(fake: &Arc<Fake>) -> Extender {
        Extender::new(
            fake,
            |fake: &Fake, leases: &[(Lease, Duration)], _: Instant| {
                if fake.slow.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                {
                    let mut panics = fake.panics.lock();
                    if *panics > 0 {
                        *panics -= 1;
                        drop(panics);
                        panic!("a renewal's defect");
                    }
                }
                fake.inside.store(true, Ordering::SeqCst);
                fake.active.fetch_add(1, Ordering::SeqCst);
                while fake.hold.load(Ordering::SeqCst)
                    || fake
                        .stuck
                        .lock()
                        .is_some_and(|t| leases.iter().any(|(l, _)| l.token() == t))
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                fake.active.fetch_sub(1, Ordering::SeqCst);
                leases
                    .iter()
                    .map(|(lease, _)| {
                        *fake.renewed.lock().entry(lease.token()).or_default() += 1;
                        if let Some(left) = fake.unreachable.lock().get_mut(&lease.token())
                            && *left > 0
                        {
                            *left -= 1;
                            return Err(Error::Unavailable {
                                detail: "the server cannot be reached".into(),
                            });
                        }
                        if fake.failing.lock().contains(&lease.token()) {
                            Err(Error::StaleLease {
                                key: lease.key().to_string(),
                                token: lease.token(),
                            })
                        } else {
                            Ok(0)
                        }
                    })
                    .collect()
            },
        )
    }

    fn lease(token: u64) -> Lease {
        Lease::from_parts(Key::new("s", format!("k{token}")).unwrap(), token)
    }

    /// Waits (without a time limit in the assertion) until `f` holds.
    fn eventually(f: impl Fn() -> bool) {
        while !f() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn no_thread_until_the_first_registration_and_none_after_the_drop() {
        let fake = Arc::new(Fake::default());
        let ext = extender(&fake);
        assert!(!ext.is_running());
        let reg = ext.register(&lease(1), Duration::from_millis(30)).unwrap();
        assert!(ext.is_running());
        eventually(|| fake.count(1) >= 2);
        drop(reg);
        drop(ext); // joins the thread
    }

    #[test]
    fn every_lease_is_renewed_until_deregistered_and_never_after() {
        let fake = Arc::new(Fake::default());
        let ext = extender(&fake);
        let regs: Vec<_> = (0..50)
            .map(|t| ext.register(&lease(t), Duration::from_millis(15)).unwrap())
            .collect();
        eventually(|| (0..50).all(|t| fake.count(t) >= 3));
        fake.slow.store(true, Ordering::SeqCst);
        for reg in regs {
            drop(reg);
        }
        let counts: Vec<_> = (0..50).map(|t| fake.count(t)).collect();
        fake.slow.store(false, Ordering::SeqCst);
        // Another lease keeps the thread busy; the dropped ones stay still.
        let other = ext.register(&lease(99), Duration::from_millis(3)).unwrap();
        eventually(|| fake.count(99) >= 20);
        assert_eq!(counts, (0..50).map(|t| fake.count(t)).collect::<Vec<_>>());
        assert!(ext.shared.state.lock().entries.len() == 1);
        drop(other);
        assert!(ext.shared.state.lock().due.is_empty());
    }

    /// A registration for async code dropped while its renewal is under
    /// way returns at once (the renewal is held until after the drop), and
    /// the lease is removed once that renewal is answered, never renewed
    /// again.
    #[cfg(feature = "http")]
    #[test]
    fn an_unwaited_registration_dropped_mid_renewal_returns_at_once() {
        let fake = Arc::new(Fake::default());
        let ext = extender(&fake);
        fake.hold.store(true, Ordering::SeqCst);
        let reg = ext
            .register_unwaited(&lease(5), Duration::from_millis(3))
            .unwrap();
        eventually(|| fake.inside.load(Ordering::SeqCst));
        drop(reg);
        assert!(ext.shared.state.lock().entries[&0].dropped);
        fake.hold.store(false, Ordering::SeqCst);
        eventually(|| ext.shared.state.lock().entries.is_empty());
        let renewed = fake.count(5);
        assert_eq!(renewed, 1);
        // Another lease keeps the thread busy; the dropped one stays still.
        let other = ext.register(&lease(6), Duration::from_millis(3)).unwrap();
        eventually(|| fake.count(6) >= 20);
        assert_eq!(fake.count(5), renewed);
        drop(other);
    }

    /// A renewal batch that panics fails its leases (not renewed again)
    /// and leaves the thread running: a waited deregistration of one of
    /// them returns, and a lease registered later is renewed.
    #[test]
    fn a_panicking_renewal_fails_its_batch_and_the_thread_goes_on() {
        let fake = Arc::new(Fake::default());
        *fake.panics.lock() = 1;
        let ext = extender(&fake);
        let hit = ext.register(&lease(1), Duration::from_millis(3)).unwrap();
        eventually(|| *fake.panics.lock() == 0);
        eventually(|| {
            let state = ext.shared.state.lock();
            state
                .entries
                .values()
                .all(|e| !e.in_flight && e.due.is_none())
        });
        drop(hit);
        let later = ext.register(&lease(2), Duration::from_millis(3)).unwrap();
        eventually(|| fake.count(2) >= 3);
        assert_eq!(fake.count(1), 0);
        drop(later);
    }

    /// A batch that waits for its answer (a half-open connection waits
    /// until the batch's deadline, half its lease's time left) holds up no
    /// other lease: a shorter lease registered meanwhile is renewed again
    /// and again while it waits (with one thread, not once until it was
    /// answered, and the shorter lease lapsed). When every thread waits,
    /// the leases due wait for one of them.
    #[test]
    fn a_renewal_waiting_for_its_answer_holds_up_no_other_lease() {
        let fake = Arc::new(Fake::default());
        // Hang guards only: with one thread this waited for ever.
        let guard = Instant::now() + Duration::from_secs(60);
        let eventually = |what: &str, f: &dyn Fn() -> bool| {
            while !f() {
                assert!(Instant::now() < guard, "never: {what}");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        *fake.stuck.lock() = Some(1);
        let ext = extender(&fake);
        let long = ext.register(&lease(1), Duration::from_millis(3)).unwrap();
        eventually("the first batch sent", &|| {
            fake.inside.load(Ordering::SeqCst)
        });
        let short = ext.register(&lease(2), Duration::from_millis(3)).unwrap();
        eventually("lease 2 renewed", &|| fake.count(2) >= 5);
        assert_eq!(fake.count(1), 0, "the first batch is still waiting");
        // Every thread held by a batch of its own: a lease registered then
        // waits for one of them to return, and no thread is added.
        fake.hold.store(true, Ordering::SeqCst);
        let in_flight = |token: u64| {
            let state = ext.shared.state.lock();
            state
                .entries
                .values()
                .any(|e| e.lease.token() == token && e.in_flight)
        };
        eventually("lease 2 in flight", &|| in_flight(2));
        let mut held = Vec::new();
        for token in 3.. {
            // Each batch in flight (leases 1, 2 and those held) inside the
            // store's call, on a thread of its own.
            let batches = 2 + held.len();
            eventually("each batch inside its renewal", &|| {
                fake.active.load(Ordering::SeqCst) == batches
            });
            if batches == MAX_THREADS {
                break;
            }
            held.push(
                ext.register(&lease(token), Duration::from_millis(3))
                    .unwrap(),
            );
            eventually("a lease in flight", &|| in_flight(token));
        }
        let waiting = ext.register(&lease(9), Duration::from_millis(3)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        {
            let state = ext.shared.state.lock();
            assert_eq!(state.more.len() + 1, MAX_THREADS);
            assert!(
                state
                    .entries
                    .values()
                    .any(|e| e.lease.token() == 9 && !e.in_flight)
            );
        }
        *fake.stuck.lock() = None;
        fake.hold.store(false, Ordering::SeqCst);
        eventually("every lease renewed", &|| {
            fake.count(1) >= 2 && fake.count(9) >= 2
        });
        drop((held, waiting));
        drop((long, short));
        drop(ext); // joins every thread
    }

    #[test]
    fn a_failed_renewal_stops_that_lease_only() {
        let fake = Arc::new(Fake::default());
        fake.failing.lock().push(7);
        let ext = extender(&fake);
        let failing = ext.register(&lease(7), Duration::from_millis(6)).unwrap();
        let fine = ext.register(&lease(8), Duration::from_millis(6)).unwrap();
        eventually(|| fake.count(8) >= 10);
        assert_eq!(fake.count(7), 1);
        drop(failing);
        drop(fine);
        assert!(ext.shared.state.lock().entries.is_empty());
    }

    /// A renewal that did not reach the store says nothing of the lease:
    /// it is tried again until one is answered, and the renewals go on
    /// (they stopped at the first, and the lease lapsed under its work).
    #[test]
    fn a_renewal_that_did_not_reach_the_store_is_tried_again() {
        let fake = Arc::new(Fake::default());
        fake.unreachable.lock().insert(5, 3);
        let ext = extender(&fake);
        let blip = ext.register(&lease(5), Duration::from_millis(6)).unwrap();
        let fine = ext.register(&lease(6), Duration::from_millis(6)).unwrap();
        eventually(|| fake.count(6) >= 20);
        assert!(fake.count(5) >= 5, "{} renewals", fake.count(5));
        assert_eq!(fake.unreachable.lock().get(&5), Some(&0));
        drop(blip);
        drop(fine);
    }

    /// A renewal ends by half the time left of its lease, and never in
    /// less than a third of the renewal period (a lapsed lease's renewal
    /// may still succeed, if nobody took the key over).
    #[test]
    fn a_renewal_ends_while_its_lease_lasts() {
        let now = Instant::now();
        let period = Duration::from_secs(10);
        let at = |d: Duration| now + d;
        assert_eq!(
            renewal_deadline(now, at(Duration::from_secs(20)), period),
            at(Duration::from_secs(10))
        );
        assert_eq!(
            renewal_deadline(now, at(Duration::from_secs(4)), period),
            at(period / 3)
        );
        assert_eq!(renewal_deadline(now, now, period), at(period / 3));
    }

    #[test]
    fn renewals_fail_closed_once_the_target_is_gone() {
        let fake = Arc::new(Fake::default());
        let ext = extender(&fake);
        drop(fake);
        let renew = ext.renew.clone();
        let answers = renew(&[(lease(1), Duration::from_millis(5))], Instant::now());
        assert!(matches!(answers.as_slice(), [Err(Error::Closed)]));
    }
}
