//! The background sweeper: a thread that evicts records past retention,
//! for any engine (as they come due, and on PostgreSQL also once per
//! interval), and runs the embedded engine's online scrub on the same
//! thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use std::time::Instant;

use crate::config::Config;
use crate::engine::Engine;
use crate::error::Result;

/// How often the background thread runs a scrub step when the scrub is on:
/// each step walks `scrub_rate` records.
const SCRUB_TICK: Duration = Duration::from_secs(1);

/// The writer's time one background sweep slice may take on the file
/// engine: a slice stops after the eviction that reaches it (see
/// `embedded::expiry::evict`), so the writes queued behind it wait at most
/// this plus one eviction (6 to 40 µs measured) and the read of its due
/// entries. A slice is answered as soon as the writer decided it (not once
/// its batch is durable), and the next one is submitted no sooner than
/// eight times its writer time after it, that time including what earlier
/// slices' evictions cost the writer since (the commits that apply them
/// and write, at a checkpoint also sync, the index pages they changed:
/// `embedded::commit::evictions_share`), so a sweep takes about an eighth
/// of the writer's time (more while it falls behind the records coming
/// due: [`SWEEP_SHARES`]; less while the disk under the log is congested
/// and it does not fall behind: [`YIELD_SHARES`]). A sweep that lasts more than a second scales its
/// slices up (see `slice_scale`), to at most 4 ms each.
pub(crate) const SWEEP_SLICE_BUDGET: Duration = Duration::from_millis(1);

/// The most records one background sweep slice reads from the expiry
/// index (and so may evict): about what the budget allows at the lowest
/// cost per eviction measured (6 µs), so that a slice reads few entries it
/// then leaves for the next.
pub(crate) const SWEEP_SLICE_RECORDS: usize = 256;

/// The shares of the writer's time a sweep may take, as (parts of the
/// writer's time from one slice to the next, parts the slice may take):
/// an eighth, a quarter, a third, half, two thirds. A slice is followed by
/// writes for the rest. A sweep starts at an eighth and moves up while it
/// falls behind the records coming due (see `next_share`). The writer's
/// time is the slices' own and what their evictions cost it afterwards
/// (charged to the next slice): counted in the slices alone, a quarter
/// took about half of the write rate where the writer's CPU bounds it (16
/// threads, 1 M due, a store in memory: 0.45× and 0.50× against 0.80× and
/// 0.79× with the later cost counted).
///
/// Why a backlog is worked off at an eighth, not a quarter: the write rate
/// of a 1-s window swings on its own (16 threads on the disk with no sweep:
/// windows from 0.57× to 1.23× of the mean), and a share costs the writes
/// more than itself (a quarter: 0.69–0.79× of the rate with no sweep, the
/// lowest windows 0.49–0.64×; an eighth: 0.71–0.87×), so at a quarter a
/// window where the machine is slow anyway falls below half the rate; an
/// eighth leaves more margin, though a half-second stall of the disk's
/// flush can still take a window below half, as one did with no sweep
/// (BENCHMARKS.md, "Sweep under load"). Records past retention
/// read as absent whether or not they are evicted, so a backlog drained at
/// half the speed costs only the disk it holds a little longer; records
/// coming due faster than that step the share up.
pub(crate) const SWEEP_SHARES: [(u32, u32); 5] = [(8, 1), (4, 1), (3, 1), (2, 1), (3, 2)];

/// How soon the next sweep runs after one that evicted records, when the
/// interval is longer: a store that churns has records coming due all the
/// time, and sweeping them every second keeps what awaits eviction near
/// one second of arrivals instead of a whole interval's (which `stats`
/// counts and the index holds). The first sweep after open runs this soon
/// too. After a sweep that evicted nothing the next waits the full
/// interval, unless a record comes due first: on the file engine the
/// sweeper reads the first deadline of the expiry index at each tick
/// meanwhile and sweeps once one has passed, and only then
/// (`due_since_idle`), so a store that starts to churn is swept as its
/// records come due, not all at once an interval later, and an idle store
/// is not swept at all; on PostgreSQL an idle store is swept once per
/// interval.
pub(crate) const SWEEP_CATCH_UP: Duration = Duration::from_secs(1);

/// The shortest tick of the background thread, whatever `sweep_interval`.
pub(crate) const MIN_TICK: Duration = Duration::from_millis(10);

/// The background thread `config` asks for over `engine`, if any: sweeps
/// [`SWEEP_CATCH_UP`] after open and after a sweep that evicted records;
/// after a sweep that found nothing due, on the file engine at the first
/// tick where a record has come due (and not before), on PostgreSQL (and
/// when the file engine's index cannot be read, or after a failed sweep)
/// once `sweep_interval` has passed (slices of
/// at most `sweep_batch` records and, on the file engine,
/// [`SWEEP_SLICE_BUDGET`] of the writer's time, paced as [`sweep_paced`]
/// says, until none is due or the store is dropped) and,
/// on the embedded engine, a scrub step of `scrub_rate` records every
/// second (at most; a slow step delays the next), until the store refuses
/// writes. Failures are logged (warn); a failed scrub step is retried at
/// the next tick, a failed sweep after the interval. The thread ticks at
/// the shortest of the periods (at least every second, at most every
/// [`MIN_TICK`]: an idle file store is looked at for a record come due at
/// each tick, which a `sweep_interval` of microseconds made a spin). A
/// sweep runs a scrub step between its slices when one is due, so that a
/// sweep that lasts while records keep coming due does not stop the scrub.
pub(crate) fn start(engine: &Arc<Engine>, config: &Config) -> Result<Option<Sweeper>> {
    // A read-only store neither sweeps nor scrubs in the background.
    if config.read_only {
        return Ok(None);
    }
    let batch = config.sweep_batch;
    let sweep_every = config.sweep_interval;
    let scrub = config
        .scrub_rate
        .filter(|_| matches!(**engine, Engine::Embedded(_)))
        .map(|rate| usize::try_from(rate).unwrap_or(usize::MAX));
    let interval = match (sweep_every, scrub) {
        (None, None) => return Ok(None),
        (Some(every), None) => every.min(SWEEP_CATCH_UP),
        (None, Some(_)) => SCRUB_TICK,
        (Some(every), Some(_)) => every.min(SCRUB_TICK).min(SWEEP_CATCH_UP),
    }
    .max(MIN_TICK);
    let mut last_sweep = Instant::now();
    // The wait before the next sweep: the interval, or `SWEEP_CATCH_UP`
    // after a sweep that evicted records and for the first one (a store
    // reopened after a while has records that came due meanwhile).
    let mut wait = sweep_every.map_or(Duration::MAX, |every| every.min(SWEEP_CATCH_UP));
    // Whether the last sweep found nothing due (and did not fail): the
    // store is then looked at every tick for a record that came due since.
    let mut idle = false;
    let mut last_scrub = Instant::now();
    let stopping = Arc::new(AtomicBool::new(false));
    let stop = stopping.clone();
    Sweeper::start(engine, interval, stopping, move |engine: &Engine| {
        // A scrub step once a `SCRUB_TICK`: at each tick, and between the
        // slices of a sweep, which lasts as long as records keep coming
        // due (the scrub stopped for as long).
        let mut scrub_when_due = |engine: &Engine| {
            if let Some(rate) = scrub
                && last_scrub.elapsed() >= SCRUB_TICK
            {
                if let Some(Err(err)) = engine.scrub(rate, false) {
                    tracing::warn!(error = %err, "background scrub step failed; retried at the next tick");
                }
                // From the step's end: a step of a second or more (a cold
                // disk, `MAX_SCRUB_RATE`) leaves a second to the sweep.
                last_scrub = Instant::now();
            }
        };
        scrub_when_due(engine);
        let Some(every) = sweep_every else { return };
        if engine.refuses_writes() {
            return;
        }
        match idle.then(|| due_since_idle(engine)).flatten() {
            // A record came due since the idle sweep: sweep now.
            Some(true) => {}
            // Nothing is due (the file engine's index says so): a sweep
            // would evict nothing and write the store's time reservation,
            // so an idle store would write its log once per interval.
            Some(false) => return,
            None if last_sweep.elapsed() < wait => return,
            None => {}
        }
        last_sweep = Instant::now();
        wait = every;
        idle = false;
        match sweep_paced_with(engine, batch, &stop, &mut scrub_when_due) {
            Ok(n) if n > 0 => {
                tracing::debug!(evicted = n, "sweep");
                wait = every.min(SWEEP_CATCH_UP);
            }
            Ok(_) => idle = true,
            Err(err) => tracing::warn!(error = %err, "background sweep failed"),
        }
    })
    .map(Some)
}

/// Whether a record of a store whose last sweep found nothing due has
/// come due since, by the file engine's expiry index (one entry read per
/// range: finished, in flight; see `Engine::any_due`): the sweeper then
/// sweeps at once instead of at the end of its interval. Without it, a
/// store that starts to churn after an idle sweep keeps every record that
/// comes due within the interval (60 s by default) and its next sweep
/// finds them all at once: under 64 threads with a retention of 30 s,
/// 0.6 M due at 61 s, whose sweep, falling behind from its first second,
/// took the writes to 1,660 lifecycles/s for 15 s. While it answers
/// `Some(false)` the sweeper does not sweep at all, so an idle file store
/// writes nothing. `None` on PostgreSQL, whose sweeps share no writer,
/// and when the index cannot be read: the sweeper then sweeps once per
/// interval (and the sweep finds out).
fn due_since_idle(engine: &Engine) -> Option<bool> {
    match engine.any_due() {
        Ok(due) => due,
        Err(err) => {
            tracing::debug!(error = %err, "sweeper: reading the first deadline failed");
            None
        }
    }
}

/// Evicts every record due now over `engine`, in slices of at most `batch`
/// records (file engine: also at most [`SWEEP_SLICE_RECORDS`] and
/// [`SWEEP_SLICE_BUDGET`] of the writer's time, both doubled for each
/// further [`SWEEP_CATCH_UP`] the sweep has lasted, up to
/// [`SWEEP_SLICE_MAX_SCALE`] times), each followed by writes for seven
/// times its writer time (its own and what earlier slices' evictions cost
/// the writer since; less while the sweep falls behind: see `next_share`;
/// more while the disk is congested: see [`yield_steps`]),
/// until none is due or `stop` is set (looked at every [`PACING_STEP`]
/// while it waits); how many were
/// evicted. Each slice is answered before it is durable; on the file
/// engine a last, empty, step waits until every slice is. Stops at the
/// first error: slices answered before it may be lost with the batch that
/// failed (the store is then poisoned; records past retention read as
/// absent either way).
pub(crate) fn sweep_paced(engine: &Engine, batch: usize, stop: &AtomicBool) -> Result<usize> {
    sweep_paced_with(engine, batch, stop, &mut |_| {})
}

/// [`sweep_paced`], calling `between` after each slice (the background
/// thread's scrub step, when one is due).
fn sweep_paced_with(
    engine: &Engine,
    batch: usize,
    stop: &AtomicBool,
    between: &mut dyn FnMut(&Engine),
) -> Result<usize> {
    let mut total = 0usize;
    let started = Instant::now();
    let mut share = 0;
    // Whether the last second's evictions fell behind what came due: a
    // sweep that falls behind does not yield to a congested disk.
    let mut behind = false;
    let paced = matches!(engine, Engine::Embedded(_));
    // The current second of the sweep: when it began (wall clock and
    // store time) and how many had been evicted by then.
    let mut second = (Instant::now(), paced.then(|| engine.now_ms()), 0usize);
    loop {
        let scale = slice_scale(started.elapsed());
        let (max, budget) = match engine {
            Engine::Embedded(_) => (
                batch.min(SWEEP_SLICE_RECORDS.saturating_mul(scale)),
                SWEEP_SLICE_BUDGET.saturating_mul(u32::try_from(scale).unwrap_or(u32::MAX)),
            ),
            #[cfg(feature = "postgres")]
            Engine::Postgres { .. } => (batch, SWEEP_SLICE_BUDGET),
        };
        let submitted = Instant::now();
        let slice = engine.sweep_slice(max, budget)?;
        total = total.saturating_add(slice.evicted);
        if !stop.load(Ordering::SeqCst) {
            between(engine);
        }
        if !slice.more || stop.load(Ordering::SeqCst) {
            if paced {
                // Durable: answered behind every slice's batch.
                engine.sweep(0)?;
            }
            return Ok(total);
        }
        if let Some(from_ms) = second.1
            && second.0.elapsed() >= SWEEP_CATCH_UP
        {
            let evicted = total.saturating_sub(second.2);
            let now_ms = engine.now_ms();
            match engine.came_due(from_ms, now_ms, enough_to_decide(evicted)) {
                Ok(Some(arrived)) => {
                    share = next_share(share, evicted, arrived);
                    behind = falling_behind(evicted, arrived);
                }
                Ok(None) => {}
                // A pacing hint only: the sweep goes on at its share.
                Err(err) => tracing::debug!(error = %err, "sweep pacing: count failed"),
            }
            second = (Instant::now(), Some(now_ms), total);
        }
        // The wait for the writer counts as the writes' time: they ran
        // meanwhile. A congested disk lowers the share (see `yield_steps`),
        // unless the sweep is falling behind what comes due.
        let (whole, part) = slice_share(share, behind, engine.log_latency());
        let next = submitted
            .checked_add(slice.spent.saturating_mul(whole) / part.max(1))
            .unwrap_or(submitted);
        // In steps, so that a store dropped meanwhile is not held up by a
        // long pause (one after a checkpoint the evictions paid for).
        loop {
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() || stop.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(left.min(PACING_STEP));
        }
    }
}

/// The shares below an eighth that a sweep yields to while the disk under
/// the log is congested: a sixteenth, a thirty-second (see
/// [`yield_steps`]).
pub(crate) const YIELD_SHARES: [(u32, u32); 2] = [(16, 1), (32, 1)];

/// How many shares a sweep steps down from the one its arrivals call for
/// (see [`paced_share`]), from the log's fsync time of the last quarter
/// second (`current`) and its lowest quarter-second mean of the last minute
/// (`base`), as LEDBAT (RFC 6817) yields to other traffic when the delay
/// rises above its base: two at twice the base and 500 µs above it, one at
/// one and a half times and 250 µs above, else none. On a disk where the
/// log's fsync bounds the write rate (callers wait for it), a sweep's
/// evictions dirty index pages whose writeback the fsync then waits
/// behind, and a disk that slows for reasons of its own (a virtual disk's
/// neighbours) halves the rate with no sweep at all; at its full share
/// the sweep would push such a stretch further down. The absolute margins keep
/// a store in memory, whose fsync takes microseconds, from yielding to
/// noise.
pub(crate) fn yield_steps(current: Duration, base: Duration) -> usize {
    let above = current.saturating_sub(base);
    if current >= base.saturating_mul(2) && above >= Duration::from_micros(500) {
        2
    } else if current >= base.saturating_mul(3) / 2 && above >= Duration::from_micros(250) {
        1
    } else {
        0
    }
}

/// The share of the writer a paced sweep's next slice takes (see
/// [`paced_share`]): its arrivals' `share` (an index in [`SWEEP_SHARES`]),
/// stepped down as [`yield_steps`] says for the log's fsync time
/// (`latency`: the last closed quarter second's and the base, when the
/// engine has them), unless the sweep is falling `behind` the records
/// coming due (see [`falling_behind`]).
fn slice_share(share: usize, behind: bool, latency: Option<(Duration, Duration)>) -> (u32, u32) {
    let down = match latency {
        Some((current, base)) if !behind => yield_steps(current, base),
        _ => 0,
    };
    paced_share(share, down)
}

/// The share of the writer a paced sweep takes, as (parts of the writer's
/// time from one slice to the next, parts the slice may take): its
/// arrivals' `share` (an index in [`SWEEP_SHARES`]) stepped `down` through
/// the shares below it, the [`YIELD_SHARES`] included.
fn paced_share(share: usize, down: usize) -> (u32, u32) {
    let share = share.min(SWEEP_SHARES.len() - 1);
    match (share + YIELD_SHARES.len()).saturating_sub(down.min(YIELD_SHARES.len())) {
        i if i >= YIELD_SHARES.len() => SWEEP_SHARES[i - YIELD_SHARES.len()],
        i => YIELD_SHARES[YIELD_SHARES.len() - 1 - i],
    }
}

/// The longest the sweeper sleeps between looks at its stop flag while it
/// paces a sweep: a store dropped meanwhile waits at most this long more.
const PACING_STEP: Duration = Duration::from_millis(50);

/// The index in [`SWEEP_SHARES`] of the share of the writer a sweep takes
/// for its next second, from its `share` so far and the records it
/// `evicted` in the last second while `arrived` others came due: one up
/// while it evicted less than one and a half times what came due (what
/// awaits eviction is growing, or shrinking too slowly to drain: under
/// many writers an eviction costs the writer about what a whole lifecycle
/// does, so at a third of the writer a store written at full speed evicts
/// about half of what arrives); one down once it evicts three times what
/// comes due. A backlog with few new arrivals (a store reopened after a
/// while, a burst of expiries) is worked off at an eighth.
fn next_share(share: usize, evicted: usize, arrived: u64) -> usize {
    if falling_behind(evicted, arrived) {
        share.saturating_add(1).min(SWEEP_SHARES.len() - 1)
    } else if u64::try_from(evicted).unwrap_or(u64::MAX).saturating_mul(2)
        >= arrived.saturating_mul(6)
    {
        share.saturating_sub(1)
    } else {
        share
    }
}

/// Whether a sweep that `evicted` records in a second while `arrived`
/// others came due is falling behind: it evicted less than one and a half
/// times that. Such a sweep steps its share up (see [`next_share`]) and
/// does not yield to a congested disk (see [`yield_steps`]): the yielding
/// is a scavenger's (LEDBAT, RFC 6817), for working off a backlog, and a
/// sweep that yields while records come due faster than it evicts never
/// catches up (measured: 64 threads of fresh keys with a retention of
/// 30 s, about a million records awaiting eviction from the second minute
/// to the end of a 4-minute run, where a sweep that does not yield while
/// behind was down to 3,045 at 240 s and held 12,880-61,938 to the end of
/// 6 minutes).
fn falling_behind(evicted: usize, arrived: u64) -> bool {
    u64::try_from(evicted).unwrap_or(u64::MAX).saturating_mul(2) < arrived.saturating_mul(3)
}

/// How many of the records that came due in a second a sweep that
/// `evicted` records in it needs counted to decide (`Engine::came_due`
/// stops there): the fewest with which it is falling behind (more than
/// two thirds of `evicted`; see [`falling_behind`]). A count below it is
/// exact, so [`next_share`]'s step down (at a third or less) is decided
/// too.
fn enough_to_decide(evicted: usize) -> u64 {
    (u64::try_from(evicted).unwrap_or(u64::MAX).saturating_mul(2) / 3).saturating_add(1)
}

/// The largest factor by which a long sweep's slices grow: a slice then
/// takes at most 4 × [`SWEEP_SLICE_BUDGET`] (4 ms) of the writer's time,
/// plus one eviction, and reads at most 4 × [`SWEEP_SLICE_RECORDS`]
/// entries. Larger slices evict faster but make the writes queued behind
/// one wait longer (measured, 16 threads, 1 M due, a third of the writer:
/// 8-ms slices evicted 16,800 records a second with claim p99 1.8× that of
/// no sweep, 4-ms slices 12,300 a second at 1.5×).
pub(crate) const SWEEP_SLICE_MAX_SCALE: usize = 4;

/// By how much the slices of a sweep that has lasted `elapsed` are scaled:
/// 1 during its first [`SWEEP_CATCH_UP`], then doubled for each further
/// one, up to [`SWEEP_SLICE_MAX_SCALE`]. A sweep that lasts seconds is
/// falling behind the records coming due: under many writers each slice
/// waits its turn in the writer's queue, so small slices evict fewer
/// records a second than arrive (measured: 64 threads, 10,000 lifecycles a
/// second, left 2.4 million awaiting eviction after 5 minutes with 1-ms
/// slices). Larger slices spread that wait over more evictions.
fn slice_scale(elapsed: Duration) -> usize {
    let steps = elapsed.as_secs() / SWEEP_CATCH_UP.as_secs().max(1);
    match steps {
        0 => 1,
        1 => 2,
        _ => SWEEP_SLICE_MAX_SCALE,
    }
}

/// The background sweeper: a thread that calls `tick` every interval until
/// the store is dropped.
pub(crate) struct Sweeper {
    stop: Option<Sender<()>>,
    /// Set when the store is dropped, so that a long sweep stops at its
    /// next slice instead of holding the drop until it ends.
    stopping: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Sweeper {
    /// Starts a sweeper over `target` that calls `tick` every `interval`;
    /// it holds only a weak reference, so dropping the store ends it (and
    /// sets `stopping`, which `tick` may watch, before waiting for it).
    pub(crate) fn start<T, F>(
        target: &Arc<T>,
        interval: Duration,
        stopping: Arc<AtomicBool>,
        mut tick: F,
    ) -> Result<Sweeper>
    where
        T: Send + Sync + 'static,
        F: FnMut(&T) + Send + 'static,
    {
        let (stop, stopped) = channel::<()>();
        let weak: Weak<T> = Arc::downgrade(target);
        let handle = std::thread::Builder::new()
            .name("idemstore-sweeper".into())
            .spawn(move || {
                loop {
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let Some(target) = weak.upgrade() else { return };
                    tick(&target);
                }
            })
            .map_err(crate::error::Error::storage)?;
        Ok(Sweeper {
            stop: Some(stop),
            stopping,
            handle: Some(handle),
        })
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.stop = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sweep's slices stay at their base size for its first second, then
    /// double each second up to the cap.
    #[test]
    fn slices_grow_with_a_sweeps_length_up_to_the_cap() {
        let ms = Duration::from_millis;
        let scales: Vec<usize> = [0, 999, 1_000, 1_999, 2_000, 3_000, 60_000]
            .into_iter()
            .map(|t| slice_scale(ms(t)))
            .collect();
        assert_eq!(scales, [1, 1, 2, 2, 4, 4, 4]);
    }

    /// A congested disk steps the sweep down: one share at one and a half
    /// times the base fsync time (and 250 µs above it), two at twice (and
    /// 500 µs above); microseconds of difference never count.
    #[test]
    fn a_sweep_yields_to_a_congested_disk() {
        let us = Duration::from_micros;
        assert_eq!(yield_steps(us(1_000), us(1_000)), 0);
        assert_eq!(yield_steps(us(1_499), us(1_000)), 0);
        assert_eq!(yield_steps(us(1_500), us(1_000)), 1);
        assert_eq!(yield_steps(us(1_999), us(1_000)), 1);
        assert_eq!(yield_steps(us(2_000), us(1_000)), 2);
        assert_eq!(yield_steps(us(9_000), us(1_000)), 2);
        // Faster than the base (a step mean can be the base itself only).
        assert_eq!(yield_steps(us(500), us(1_000)), 0);
        // In memory: ten times the base, but microseconds.
        assert_eq!(yield_steps(us(40), us(4)), 0);
        assert_eq!(yield_steps(us(300), us(40)), 1);
        assert_eq!(yield_steps(us(290), us(40)), 1);
        assert_eq!(yield_steps(us(289), us(40)), 0);
        assert_eq!(yield_steps(us(540), us(40)), 2);
        // The margins alone are not enough.
        assert_eq!(yield_steps(us(10_400), us(10_000)), 0);
        assert_eq!(yield_steps(Duration::MAX, Duration::MAX), 0);
        assert_eq!(yield_steps(Duration::MAX, us(1)), 2);
    }

    /// The shares a sweep steps down through: from an eighth to a
    /// sixteenth and a thirty-second; from a higher share as far, and
    /// never past a thirty-second.
    #[test]
    fn congestion_steps_the_share_down_to_a_thirty_second() {
        assert_eq!(paced_share(0, 0), (8, 1));
        assert_eq!(paced_share(0, 1), (16, 1));
        assert_eq!(paced_share(0, 2), (32, 1));
        assert_eq!(paced_share(0, 9), (32, 1));
        assert_eq!(paced_share(1, 0), (4, 1));
        assert_eq!(paced_share(1, 1), (8, 1));
        assert_eq!(paced_share(1, 2), (16, 1));
        assert_eq!(paced_share(2, 2), (8, 1));
        assert_eq!(paced_share(4, 0), (3, 2));
        assert_eq!(paced_share(4, 2), (3, 1));
        assert_eq!(paced_share(9, 0), (3, 2));
    }

    /// A sweep that falls behind the records coming due keeps the share
    /// its arrivals call for on a congested disk; one that keeps up, or
    /// works off a backlog, yields.
    #[test]
    fn a_sweep_falling_behind_does_not_yield() {
        let us = Duration::from_micros;
        let congested = Some((us(3_000), us(1_000)));
        let slowed = Some((us(1_600), us(1_000)));
        // Keeping up, or a backlog with nothing coming due: yields.
        assert!(!falling_behind(10_000, 0));
        assert!(!falling_behind(15_000, 10_000));
        assert_eq!(slice_share(0, false, congested), (32, 1));
        assert_eq!(slice_share(4, false, congested), (3, 1));
        assert_eq!(slice_share(4, false, slowed), (2, 1));
        // Falling behind: evicted less than one and a half times what
        // came due.
        assert!(falling_behind(14_999, 10_000));
        assert!(falling_behind(0, 1));
        assert_eq!(slice_share(0, true, congested), (8, 1));
        assert_eq!(slice_share(4, true, congested), (3, 2));
        assert_eq!(slice_share(4, true, slowed), (3, 2));
        // No figure (PostgreSQL, no busy step lately): the arrivals' share.
        assert_eq!(slice_share(2, false, None), (3, 1));
        assert_eq!(slice_share(2, true, None), (3, 1));
        // Not congested: the arrivals' share either way.
        let calm = Some((us(1_000), us(1_000)));
        assert_eq!(slice_share(1, false, calm), (4, 1));
        assert_eq!(slice_share(1, true, calm), (4, 1));
    }

    /// The count of what came due stops at the fewest records that make a
    /// sweep fall behind, and one fewer does not.
    #[test]
    fn the_count_of_arrivals_stops_where_it_decides() {
        for evicted in (0..3_000).chain([10_000, 1_000_000_007]) {
            let enough = enough_to_decide(evicted);
            assert!(falling_behind(evicted, enough), "{evicted}: {enough}");
            assert!(!falling_behind(evicted, enough - 1), "{evicted}: {enough}");
        }
        // Two thirds of 5 is 3.3: four arrivals mean behind, three do not.
        assert_eq!(enough_to_decide(5), 4);
        assert_eq!(enough_to_decide(0), 1);
    }

    /// A sweep takes an eighth of the writer while it drains what is due,
    /// one share more each second it evicts less than one and a half times
    /// what comes due, and one less once it evicts three times that.
    #[test]
    fn a_sweep_that_falls_behind_takes_more_of_the_writer() {
        // Working off a backlog with nothing new coming due.
        assert_eq!(next_share(0, 10_000, 0), 0);
        assert_eq!(next_share(0, 0, 0), 0);
        // Falling behind: one share up each second, up to two thirds.
        assert_eq!(next_share(0, 7_000, 16_000), 1);
        assert_eq!(next_share(1, 7_000, 16_000), 2);
        assert_eq!(next_share(2, 16_000, 16_000), 3);
        assert_eq!(next_share(3, 16_000, 16_000), 4);
        assert_eq!(next_share(4, 16_000, 16_000), 4);
        assert_eq!(SWEEP_SHARES[0], (8, 1));
        assert_eq!(SWEEP_SHARES[1], (4, 1));
        assert_eq!(SWEEP_SHARES[4], (3, 2));
        // Draining, but not three times as fast: the share stays.
        assert_eq!(next_share(1, 24_000, 16_000), 1);
        assert_eq!(next_share(1, 23_999, 16_000), 2);
        assert_eq!(next_share(1, 47_999, 16_000), 1);
        assert_eq!(next_share(4, 24_000, 16_000), 4);
        // Well ahead again: one share down.
        assert_eq!(next_share(4, 48_000, 16_000), 3);
        assert_eq!(next_share(0, 48_000, 16_000), 0);
    }
}
