//! How congested the disk under the write-ahead log is: the log's recent
//! `fdatasync` time against the best it has had in the last minute.
//!
//! Every write a caller waits for ends in a log fsync, so the fsync's time
//! is what a burst of other disk traffic (the index pages a sweep's
//! evictions dirty, a neighbour on a shared virtual disk) costs the
//! service: under a closed loop of callers the write rate is about
//! callers ÷ fsync time. A background sweep uses this as LEDBAT (RFC 6817,
//! the delay-based "scavenger" congestion control of background transfers)
//! uses the queueing delay above its base delay: it takes a smaller share
//! of the writer while the fsync takes much longer than its base, whatever
//! the cause, so that it adds less to a slow stretch
//! (`crate::sweeper::yield_steps`). Like LEDBAT's, the yielding is a
//! scavenger's: a sweep that falls behind the records coming due does not
//! yield (`crate::sweeper::falling_behind`), or a store written at full
//! speed would never work off what awaits eviction.
//!
//! Only fsyncs that made some caller's write durable are counted: a store
//! with no callers waiting has nothing to protect, and a sweep's own
//! slices are answered before their fsync.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The length of one step: fsyncs are averaged per step, and the current
/// time is the last closed step's mean.
pub(crate) const STEP: Duration = Duration::from_millis(250);

/// How far back the base reaches: the lowest step mean of the last minute
/// (LEDBAT keeps the minimum delay of the last ten minutes; a sweep lasts
/// minutes, so a shorter memory follows a disk whose speed changed for
/// good).
pub(crate) const BASE_SPAN: Duration = Duration::from_secs(60);

/// The fewest fsyncs a step needs for its mean to count, unless they took
/// half of the step or more: fewer, shorter ones say little about the
/// disk (an idle store, a lone caller), while a disk so slow that few
/// fsyncs fit in a step (more than 31 ms each) is the most congested.
pub(crate) const MIN_SYNCS: u32 = 8;

/// The log's fsync times, averaged per [`STEP`], with the step means of
/// the last [`BASE_SPAN`] (at most `BASE_SPAN / STEP` of them: 240).
#[derive(Debug, Default)]
pub(crate) struct LogLatency {
    /// The step being filled: when it began, its fsyncs and their time.
    open: Option<(Instant, u32, Duration)>,
    /// Closed steps with enough fsyncs: when each began and its mean.
    steps: VecDeque<(Instant, Duration)>,
}

/// What [`LogLatency::now`] reports: the last closed step's mean fsync
/// time and the base it is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Latency {
    /// The mean fsync time of the last closed step.
    pub current: Duration,
    /// The lowest step mean of the last [`BASE_SPAN`].
    pub base: Duration,
}

impl LogLatency {
    /// Notes one fsync that ended at `at` after `took`.
    pub(crate) fn observe(&mut self, at: Instant, took: Duration) {
        let (began, n, sum) = match self.open {
            Some((began, n, sum)) if at.saturating_duration_since(began) < STEP => (began, n, sum),
            Some((began, n, sum)) => {
                self.close(began, n, sum);
                (at, 0, Duration::ZERO)
            }
            None => (at, 0, Duration::ZERO),
        };
        self.open = Some((began, n.saturating_add(1), sum.saturating_add(took)));
        while let Some(&(oldest, _)) = self.steps.front() {
            if at.saturating_duration_since(oldest) <= BASE_SPAN {
                break;
            }
            self.steps.pop_front();
        }
    }

    fn close(&mut self, began: Instant, n: u32, sum: Duration) {
        if n > 0 && (n >= MIN_SYNCS || sum >= STEP / 2) {
            self.steps.push_back((began, sum / n));
        }
    }

    /// The last closed step's mean against the base, as of `now`; `None`
    /// when no counted step began within the last three steps (callers
    /// have not waited on the log enough lately for the figure to mean
    /// anything). A step closes at the first fsync after it, so the last
    /// closed step is up to three quarter seconds old.
    pub(crate) fn now(&self, now: Instant) -> Option<Latency> {
        let &(began, current) = self.steps.back()?;
        // The last step closed when a later fsync came; it is current only
        // if it began within the last three steps.
        if now.saturating_duration_since(began) > STEP.saturating_mul(3) {
            return None;
        }
        let base = self
            .steps
            .iter()
            .filter(|(at, _)| now.saturating_duration_since(*at) <= BASE_SPAN)
            .map(|&(_, mean)| mean)
            .min()?;
        Some(Latency { current, base })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// `n` fsyncs of `took` each, evenly over one step from `from`.
    fn step(l: &mut LogLatency, from: Instant, n: u32, took: Duration) {
        for i in 0..n {
            l.observe(from + STEP / n * i, took);
        }
    }

    /// A step is closed by the first fsync after it, and its mean is the
    /// current time; the base is the lowest mean of the last minute.
    #[test]
    fn the_current_step_is_compared_with_the_best_of_the_last_minute() {
        let t0 = Instant::now();
        let mut l = LogLatency::default();
        assert_eq!(l.now(t0), None);
        step(&mut l, t0, 10, MS);
        // Not closed yet: nothing to report.
        assert_eq!(l.now(t0 + STEP), None);
        step(&mut l, t0 + STEP, 10, 3 * MS);
        let at = t0 + STEP * 2;
        assert_eq!(
            l.now(at),
            Some(Latency {
                current: MS,
                base: MS
            })
        );
        step(&mut l, t0 + STEP * 2, 10, 2 * MS);
        assert_eq!(
            l.now(t0 + STEP * 3),
            Some(Latency {
                current: 3 * MS,
                base: MS
            })
        );
    }

    /// A step with fewer than `MIN_SYNCS` short fsyncs is not counted (it
    /// would be the base here), and a figure older than three steps is not
    /// reported.
    #[test]
    fn few_fsyncs_and_old_figures_say_nothing() {
        let t0 = Instant::now();
        let mut l = LogLatency::default();
        step(&mut l, t0, MIN_SYNCS - 1, MS);
        step(&mut l, t0 + STEP, MIN_SYNCS, 2 * MS);
        step(&mut l, t0 + STEP * 2, 1, MS);
        let got = l.now(t0 + STEP * 2).unwrap();
        assert_eq!(
            got,
            Latency {
                current: 2 * MS,
                base: 2 * MS
            }
        );
        assert_eq!(l.now(t0 + STEP * 4), Some(got));
        assert_eq!(l.now(t0 + STEP * 4 + MS), None);
    }

    /// A disk so slow that few fsyncs fit in a step still reports: fsyncs
    /// that took half of the step count however few they are.
    #[test]
    fn a_few_long_fsyncs_count() {
        let t0 = Instant::now();
        let mut l = LogLatency::default();
        step(&mut l, t0, 10, MS);
        // Three fsyncs of 50 ms: 150 ms of a 250-ms step.
        step(&mut l, t0 + STEP, 3, 50 * MS);
        step(&mut l, t0 + STEP * 2, 1, MS);
        assert_eq!(
            l.now(t0 + STEP * 2),
            Some(Latency {
                current: 50 * MS,
                base: MS
            })
        );
        // Two of 60 ms (120 ms, less than half) do not.
        step(&mut l, t0 + STEP * 3, 2, 60 * MS);
        step(&mut l, t0 + STEP * 4, 1, MS);
        assert_eq!(l.now(t0 + STEP * 4).map(|x| x.current), Some(50 * MS));
    }

    /// The base forgets steps older than `BASE_SPAN`: a disk that became
    /// slower for good is its own base a minute later.
    #[test]
    fn the_base_forgets_after_a_minute() {
        let t0 = Instant::now();
        let mut l = LogLatency::default();
        step(&mut l, t0, 10, MS);
        let mut at = t0 + STEP;
        while at < t0 + BASE_SPAN + STEP * 2 {
            step(&mut l, at, 10, 4 * MS);
            at += STEP;
        }
        step(&mut l, at, 1, 4 * MS);
        let got = l.now(at).unwrap();
        assert_eq!(got.current, 4 * MS);
        assert_eq!(got.base, 4 * MS);
        // At most a minute of steps is kept.
        assert!(l.steps.len() <= (BASE_SPAN.as_millis() / STEP.as_millis()) as usize + 1);
    }

    /// Times and gaps at the ends of their range neither panic nor wrap.
    #[test]
    fn extreme_times_saturate() {
        let t0 = Instant::now();
        let mut l = LogLatency::default();
        for _ in 0..MIN_SYNCS {
            l.observe(t0, Duration::MAX);
        }
        l.observe(t0 + STEP, Duration::ZERO);
        let got = l.now(t0 + STEP).unwrap();
        assert_eq!(got.base, got.current);
        assert!(got.current >= Duration::from_secs(1 << 40));
    }
}
