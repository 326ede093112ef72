//! Time, in milliseconds since the Unix epoch, behind a trait so tests
//! control it; and the store's time, defined once here, on [`Clock`] ("The
//! store's time").

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How far ahead of its use the store reserves time on disk: after an
/// unclean shutdown the store's time may start up to this much ahead of the
/// wall clock (see [`Clock`], "The store's time", point 4). One second: a
/// reservation is renewed half a second before it runs out, by the batch
/// being written (free: every log frame carries the bound) or, when reads run
/// without writes, by a log frame of its own (one `fdatasync`, at most about
/// two a second).
pub const TIME_RESERVATION: Duration = Duration::from_secs(1);

/// A source of time: a wall reading in milliseconds since the Unix epoch and
/// a monotonic reading that never goes back. The wall reading may step back
/// and forth (an NTP correction, a VM resume); the monotonic reading
/// measures how much time passed. The store combines the two:
///
/// # The store's time
///
/// Every decision of the store (is a lease valid, is a record past
/// retention) is taken at *the store's time*, which is built from two
/// readings of a [`Clock`]: the wall reading ([`Clock::now_ms`]) and a
/// monotonic reading ([`Clock::monotonic_ms`]).
///
/// 1. **It follows the wall clock when the wall clock is ahead.** The store's
///    time is `max(wall, floor + monotonic time elapsed since the floor was
///    set)`, where the floor is the last time adopted from the wall clock (or
///    from disk at open). After the wall clock steps forward (an NTP
///    correction, a VM resume) the store follows it at once.
/// 2. **It never stands still.** After the wall clock steps back, the store's
///    time keeps advancing from where it was at the rate of the monotonic
///    clock, so a 30 s lease lapses after 30 s even while the wall clock is
///    behind.
/// 3. **It never runs backwards, across crashes too.** No reading is ever
///    below an earlier one. Before any answer is based on a time (a write, a
///    read that reports a record expired, a claim answered "in progress"),
///    a *bound* at least that high is durable in the store: the store
///    reserves [`TIME_RESERVATION`] ahead (in the log frame of a batch, or
///    in a frame written for the reservation alone), the way fencing tokens
///    are reserved. An unclean open starts from the reserved bound. With
///    [`Durability::Buffered`](crate::Durability::Buffered) the bound is as
///    durable as any acknowledged change: a process crash keeps it, a power
///    cut may lose the last `max_delay` of it. A store that refuses writes
///    ([`Error::Poisoned`](crate::Error::Poisoned)) cannot reserve: its
///    answers use no time past the last durable bound. The exception is a
///    store opened read-only ([`Config::read_only`](crate::Config::read_only)),
///    which reserves nothing and answers at the clock's reading: it
///    changes nothing, and the next open of the store starts from the
///    bound on disk, so its readings may be above what that open returns.
/// 4. **It is ahead of the wall clock by at most [`TIME_RESERVATION`] after
///    any number of crashes**, plus whatever the wall clock itself stepped
///    back (point 2). A reservation reaches [`TIME_RESERVATION`] past the
///    larger of the wall reading and the floor-based time (point 1), never
///    past the store's time alone, so crashes in a row do not add up. After
///    an unclean open the part of the start time that may come from the
///    reservation (at most [`TIME_RESERVATION`]) is caught up at half the
///    monotonic rate, so the store's time meets the wall clock again within
///    twice [`TIME_RESERVATION`]; a lease taken in that window lapses at most
///    [`TIME_RESERVATION`] late.
pub trait Clock: Send + Sync + 'static {
    /// The wall reading: milliseconds since the Unix epoch. May step back
    /// or forward between calls.
    fn now_ms(&self) -> u64;

    /// The monotonic reading: milliseconds since an origin fixed for the
    /// life of the process, never lower than an earlier reading. The
    /// default measures [`Instant`] from the first call of any clock in the
    /// process.
    fn monotonic_ms(&self) -> u64 {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        duration_ms(ORIGIN.get_or_init(Instant::now).elapsed())
    }
}

/// The operating system's wall clock ([`SystemTime`]), with [`Instant`] as
/// its monotonic reading.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to: for tests and simulations.
///
/// It has a wall reading and a monotonic reading (which starts at 0).
/// [`ManualClock::advance`] moves both, as time passing does;
/// [`ManualClock::step_back`], [`ManualClock::step_forward`] and
/// [`ManualClock::set_ms`] move the wall reading only, as a stepped system
/// clock does. Clones share the same readings, so a test can keep one handle
/// and give another to the store.
#[derive(Debug, Clone)]
pub struct ManualClock {
    wall: Arc<AtomicU64>,
    mono: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock whose wall reading is `start_ms` milliseconds since the Unix
    /// epoch and whose monotonic reading is 0.
    pub fn new(start_ms: u64) -> ManualClock {
        ManualClock {
            wall: Arc::new(AtomicU64::new(start_ms)),
            mono: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A clock starting at the current system time.
    pub fn starting_now() -> ManualClock {
        ManualClock::new(SystemClock.now_ms())
    }

    /// Time passes: moves both readings forward by `by` (whole
    /// milliseconds; saturating).
    pub fn advance(&self, by: Duration) {
        let ms = duration_ms(by);
        // Monotonic first: a reader that sees the new wall reading then
        // sees the new monotonic one too (the store reads wall, then
        // monotonic), so one advance is never counted twice.
        add(&self.mono, ms);
        add(&self.wall, ms);
    }

    /// Steps the wall reading back by `by` (whole milliseconds, saturating
    /// at zero), as a stepped system clock would; the monotonic reading does
    /// not move.
    pub fn step_back(&self, by: Duration) {
        let ms = duration_ms(by);
        let _ = self
            .wall
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_sub(ms))
            });
    }

    /// Steps the wall reading forward by `by` (whole milliseconds,
    /// saturating), as a corrected system clock or a resumed VM would; the
    /// monotonic reading does not move.
    pub fn step_forward(&self, by: Duration) {
        add(&self.wall, duration_ms(by));
    }

    /// Sets the wall reading, in milliseconds since the Unix epoch (a step
    /// either way); the monotonic reading does not move.
    pub fn set_ms(&self, ms: u64) {
        self.wall.store(ms, Ordering::SeqCst);
    }
}

fn add(cell: &AtomicU64, ms: u64) {
    let _ = cell.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
        Some(t.saturating_add(ms))
    });
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.wall.load(Ordering::SeqCst)
    }

    fn monotonic_ms(&self) -> u64 {
        self.mono.load(Ordering::SeqCst)
    }
}

/// `a - b` as a signed offset, saturating.
fn offset(a: u64, b: u64) -> i64 {
    i64::try_from(a)
        .unwrap_or(i64::MAX)
        .saturating_sub(i64::try_from(b).unwrap_or(i64::MAX))
}

/// The store's time (see the module docs): never backwards, never still.
#[derive(Clone)]
pub(crate) struct StoreClock(Arc<StoreClockInner>);

struct StoreClockInner {
    inner: Arc<dyn Clock>,
    /// The floor-based time is `monotonic + offset`; the offset is the
    /// largest `wall - monotonic` seen (raising it is setting a new floor).
    offset: AtomicI64,
    /// The catch-up line after an open whose start time may come from a
    /// reservation: `catch_up_from + (monotonic - catch_up_mono) / 2`.
    catch_up_from: u64,
    catch_up_mono: u64,
    /// The largest time handed out.
    high_water: AtomicU64,
}

impl StoreClock {
    /// The store's time over `inner`, starting at `start_ms` (0 for a new
    /// store). The part of `start_ms` above `floor_ms` is caught up at half
    /// the monotonic rate (the reserved part after an unclean open, or what
    /// was still being caught up at a clean close); `floor_ms` itself
    /// advances at the monotonic rate.
    pub(crate) fn new(inner: Arc<dyn Clock>, start_ms: u64, floor_ms: u64) -> Self {
        let mono = inner.monotonic_ms();
        let floor_ms = floor_ms.min(start_ms);
        StoreClock(Arc::new(StoreClockInner {
            offset: AtomicI64::new(offset(floor_ms, mono)),
            catch_up_from: start_ms,
            catch_up_mono: mono,
            high_water: AtomicU64::new(start_ms),
            inner,
        }))
    }

    /// Reads the wall clock, then the monotonic clock, in that order: a
    /// stall between the two reads (preemption, a paused process) then
    /// makes the wall reading look early, never late, so no stall is ever
    /// kept as a lead over the wall clock.
    fn readings(&self) -> (u64, u64) {
        let wall = self.0.inner.now_ms();
        let mono = self.0.inner.monotonic_ms();
        (wall, mono)
    }

    /// The floor-based time: `max(wall, floor + monotonic elapsed)`.
    fn floor_time(&self, (wall, mono): (u64, u64)) -> u64 {
        let c = &self.0;
        let seen = offset(wall, mono);
        let prev = c.offset.fetch_max(seen, Ordering::SeqCst);
        mono.saturating_add_signed(prev.max(seen))
    }

    /// The current time, in ms since the epoch.
    pub(crate) fn now_ms(&self) -> u64 {
        let c = &self.0;
        let (wall, mono) = self.readings();
        let floor = self.floor_time((wall, mono));
        let catch_up = c
            .catch_up_from
            .saturating_add(mono.saturating_sub(c.catch_up_mono) / 2);
        let t = floor.max(catch_up);
        c.high_water.fetch_max(t, Ordering::SeqCst).max(t)
    }

    /// The wall clock's reading now (ms since the epoch), without the
    /// store's floor or high-water mark.
    pub(crate) fn wall_ms(&self) -> u64 {
        self.0.inner.now_ms()
    }

    /// The largest time handed out, without reading the clock.
    pub(crate) fn high_water_ms(&self) -> u64 {
        self.0.high_water.load(Ordering::SeqCst)
    }

    /// The floor-based time now (the store's time without the catch-up
    /// line), persisted at a clean close so that the next open knows which
    /// part of its start time still has to be caught up.
    pub(crate) fn floor_ms(&self) -> u64 {
        self.floor_time(self.readings())
    }

    /// The bound to reserve so that every time up to `used_ms` (and a
    /// while beyond) survives a crash: [`TIME_RESERVATION`] past the
    /// floor-based time, and never below `used_ms`. Not past the store's
    /// time plus the reservation, so crashes in a row do not add up.
    pub(crate) fn reservation(&self, used_ms: u64) -> u64 {
        self.floor_ms()
            .saturating_add(duration_ms(TIME_RESERVATION))
            .max(used_ms)
    }

    /// Raises the store's time to at least `ms` (an import of records
    /// written by a clock that was ahead), as a new floor.
    pub(crate) fn raise(&self, ms: u64) {
        let c = &self.0;
        let mono = c.inner.monotonic_ms();
        c.offset.fetch_max(offset(ms, mono), Ordering::SeqCst);
        c.high_water.fetch_max(ms, Ordering::SeqCst);
    }
}

/// Whole milliseconds of a duration, saturating at `u64::MAX`.
pub(crate) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_clock(manual: &ManualClock, start: u64, floor: u64) -> StoreClock {
        StoreClock::new(Arc::new(manual.clone()), start, floor)
    }

    #[test]
    fn a_step_back_does_not_stop_time() {
        let manual = ManualClock::new(1_000);
        let clock = store_clock(&manual, 0, 0);
        assert_eq!(clock.now_ms(), 1_000);
        manual.step_back(Duration::from_millis(500));
        assert_eq!(clock.now_ms(), 1_000);
        manual.advance(Duration::from_millis(700));
        assert_eq!(clock.now_ms(), 1_700);
    }

    #[test]
    fn a_step_forward_is_followed() {
        let manual = ManualClock::new(1_000);
        let clock = store_clock(&manual, 0, 0);
        manual.step_forward(Duration::from_millis(10_000));
        assert_eq!(clock.now_ms(), 11_000);
        manual.step_back(Duration::from_millis(10_000));
        manual.advance(Duration::from_millis(5));
        assert_eq!(clock.now_ms(), 11_005);
    }

    #[test]
    fn a_reserved_start_is_caught_up_at_half_rate() {
        let manual = ManualClock::new(10_000);
        // Started from a reservation 800 ms ahead of the wall clock.
        let clock = store_clock(&manual, 10_800, 9_800);
        assert_eq!(clock.now_ms(), 10_800);
        manual.advance(Duration::from_millis(400));
        assert_eq!(clock.now_ms(), 11_000);
        manual.advance(Duration::from_millis(1_200));
        assert_eq!(clock.now_ms(), 11_600);
        manual.advance(Duration::from_millis(100));
        assert_eq!(clock.now_ms(), 11_700);
        // The reservation is taken from the wall-based time.
        assert_eq!(clock.reservation(0), 11_700 + 1_000);
    }

    #[test]
    fn reservations_do_not_add_up() {
        let manual = ManualClock::new(10_000);
        let clock = store_clock(&manual, 0, 0);
        let mut bound = clock.reservation(clock.now_ms());
        for _ in 0..100 {
            // An unclean open from the bound, at once.
            let reopened = store_clock(&manual, bound, bound.saturating_sub(1_000));
            let t = reopened.now_ms();
            assert!(t <= manual.now_ms() + 1_000, "{t}");
            bound = reopened.reservation(t);
            manual.advance(Duration::from_millis(1));
        }
    }

    #[test]
    fn never_backwards() {
        let manual = ManualClock::new(5_000);
        let clock = store_clock(&manual, 7_000, 6_000);
        let mut last = 0;
        for i in 0..50u64 {
            if i % 3 == 0 {
                manual.step_back(Duration::from_millis(300));
            } else {
                manual.advance(Duration::from_millis(i));
            }
            let t = clock.now_ms();
            assert!(t >= last);
            last = t;
        }
    }
}
