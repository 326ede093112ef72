//! The background sweeper: a thread that evicts records past retention
//! every interval, for any engine, and runs the embedded engine's online
//! scrub on the same thread.

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
/// entries. After each slice the sweeper pauses as long as the slice took,
/// so a sweep takes at most half the writer's time, whatever the backlog.
/// A sweep that lasts more than a second scales its slices up (see
/// `slice_scale`), to at most 8 ms each.
pub(crate) const SWEEP_SLICE_BUDGET: Duration = Duration::from_millis(1);

/// The most records one background sweep slice reads from the expiry
/// index (and so may evict): about what the budget allows at the lowest
/// cost per eviction measured (6 µs), so that a slice reads few entries it
/// then leaves for the next.
pub(crate) const SWEEP_SLICE_RECORDS: usize = 256;

/// How soon the next sweep runs after one that evicted records, when the
/// interval is longer: a store that churns has records coming due all the
/// time, and sweeping them every second keeps what awaits eviction near
/// one second of arrivals instead of a whole interval's (which `stats`
/// counts and the index holds). The first sweep after open runs this soon
/// too. A sweep that evicted nothing waits the full interval again, so an
/// idle store is swept once per interval.
pub(crate) const SWEEP_CATCH_UP: Duration = Duration::from_secs(1);

/// The background thread `config` asks for over `engine`, if any: sweeps
/// every `sweep_interval`, or [`SWEEP_CATCH_UP`] after open and after a
/// sweep that evicted records (slices of at most `sweep_batch` records and, on
/// the file engine, [`SWEEP_SLICE_BUDGET`] of the writer's time, each
/// followed by a pause as long as it took, until none is due) and,
/// on the embedded engine, a scrub step of `scrub_rate` records every
/// second (at most; a slow step delays the next), until the store refuses
/// writes. Failures are logged (warn); a failed scrub step is retried at
/// the next tick, a failed sweep after the interval. The thread ticks at
/// the shortest of the periods (at least every second).
pub(crate) fn start(engine: &Arc<Engine>, config: &Config) -> Result<Option<Sweeper>> {
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
    };
    let mut last_sweep = Instant::now();
    // The wait before the next sweep: the interval, or `SWEEP_CATCH_UP`
    // after a sweep that evicted records and for the first one (a store
    // reopened after a while has records that came due meanwhile).
    let mut wait = sweep_every.map_or(Duration::MAX, |every| every.min(SWEEP_CATCH_UP));
    let mut last_scrub = Instant::now();
    Sweeper::start(engine, interval, move |engine: &Engine| {
        if let Some(rate) = scrub
            && last_scrub.elapsed() >= SCRUB_TICK
        {
            last_scrub = Instant::now();
            if let Some(Err(err)) = engine.scrub(rate, false) {
                tracing::warn!(error = %err, "background scrub step failed; retried at the next tick");
            }
        }
        let Some(every) = sweep_every else { return };
        if engine.refuses_writes() {
            return;
        }
        if last_sweep.elapsed() < wait {
            return;
        }
        last_sweep = Instant::now();
        wait = every;
        match sweep_paced(engine, batch) {
            Ok(n) if n > 0 => {
                tracing::debug!(evicted = n, "sweep");
                wait = every.min(SWEEP_CATCH_UP);
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "background sweep failed"),
        }
    })
    .map(Some)
}

/// Evicts every record due now over `engine`, in slices of at most `batch`
/// records (file engine: also at most [`SWEEP_SLICE_RECORDS`] and
/// [`SWEEP_SLICE_BUDGET`] of the writer's time, doubled for each further
/// [`SWEEP_CATCH_UP`] the sweep has lasted, up to [`SWEEP_SLICE_MAX_SCALE`]
/// times), each followed by a pause as long as it took; how many were
/// evicted. Stops at the first error (what was evicted before it stays
/// evicted).
pub(crate) fn sweep_paced(engine: &Engine, batch: usize) -> Result<usize> {
    let mut total = 0usize;
    let started = Instant::now();
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
        let slice = engine.sweep_slice(max, budget)?;
        total = total.saturating_add(slice.evicted);
        if !slice.more {
            return Ok(total);
        }
        // Writes get at least the other half of the writer.
        std::thread::sleep(slice.spent);
    }
}

/// The largest factor by which a long sweep's slices grow: a slice then
/// takes at most 8 × [`SWEEP_SLICE_BUDGET`] (8 ms) of the writer's time,
/// plus one eviction, and reads at most 8 × [`SWEEP_SLICE_RECORDS`]
/// entries.
pub(crate) const SWEEP_SLICE_MAX_SCALE: usize = 8;

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
        2 => 4,
        _ => SWEEP_SLICE_MAX_SCALE,
    }
}

/// The background sweeper: a thread that calls `tick` every interval until
/// the store is dropped.
pub(crate) struct Sweeper {
    stop: Option<Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl Sweeper {
    /// Starts a sweeper over `target` that calls `tick` every `interval`;
    /// it holds only a weak reference, so dropping the store ends it.
    pub(crate) fn start<T, F>(target: &Arc<T>, interval: Duration, mut tick: F) -> Result<Sweeper>
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
            handle: Some(handle),
        })
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
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
        assert_eq!(scales, [1, 1, 2, 2, 4, 8, 8]);
    }
}
