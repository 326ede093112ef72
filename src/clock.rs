//! Time, in milliseconds since the Unix epoch, behind a trait so tests control it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
///
/// The store never trusts a reading that is earlier than one it has already
/// seen: it keeps (and persists) the largest reading, so a clock that steps
/// back delays expiry until it catches up and never revives an expired
/// record.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The operating system's wall clock ([`SystemTime`]).
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
/// Clones share the same time, so a test can keep one handle and give
/// another to the store.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock reading `start_ms` milliseconds since the Unix epoch.
    pub fn new(start_ms: u64) -> ManualClock {
        ManualClock(Arc::new(AtomicU64::new(start_ms)))
    }

    /// A clock starting at the current system time.
    pub fn starting_now() -> ManualClock {
        ManualClock::new(SystemClock.now_ms())
    }

    /// Moves the clock forward by `by` (whole milliseconds; saturating).
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(ms))
            });
    }

    /// Moves the clock back by `by` (saturating at zero), as a stepped
    /// system clock would.
    pub fn step_back(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_sub(ms))
            });
    }

    /// Sets the reading, in milliseconds since the Unix epoch.
    pub fn set_ms(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A clock that never runs backwards: the largest reading seen so far.
#[derive(Clone)]
pub(crate) struct MonotonicClock {
    inner: Arc<dyn Clock>,
    high_water: Arc<AtomicU64>,
}

impl MonotonicClock {
    pub(crate) fn new(inner: Arc<dyn Clock>, high_water_ms: u64) -> Self {
        MonotonicClock {
            inner,
            high_water: Arc::new(AtomicU64::new(high_water_ms)),
        }
    }

    /// The largest reading seen so far, without reading the clock.
    pub(crate) fn high_water_ms(&self) -> u64 {
        self.high_water.load(Ordering::SeqCst)
    }

    /// The current time: max(clock reading, largest reading seen).
    pub(crate) fn now_ms(&self) -> u64 {
        let reading = self.inner.now_ms();
        let prev = self.high_water.fetch_max(reading, Ordering::SeqCst);
        prev.max(reading)
    }

    /// Raises the high-water mark to at least `ms` (an import of records
    /// written by a clock that was ahead): the store's time never falls
    /// below a time it has stored.
    pub(crate) fn raise(&self, ms: u64) {
        self.high_water.fetch_max(ms, Ordering::SeqCst);
    }
}

/// Whole milliseconds of a duration, saturating at `u64::MAX`.
pub(crate) fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_ignores_steps_back() {
        let manual = ManualClock::new(1_000);
        let clock = MonotonicClock::new(Arc::new(manual.clone()), 0);
        assert_eq!(clock.now_ms(), 1_000);
        manual.step_back(Duration::from_millis(500));
        assert_eq!(clock.now_ms(), 1_000);
        manual.advance(Duration::from_millis(700));
        assert_eq!(clock.now_ms(), 1_200);
    }
}
