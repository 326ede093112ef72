//! Eviction of records past retention (the background sweeper that calls
//! it is [`crate::sweeper`]).
//!
//! Expiry is judged at read time from each record's own deadline
//! ([`crate::record::is_expired`]): a record past retention is absent whether
//! or not it was evicted. Eviction only reclaims space. It walks the expiry
//! index in deadline order (finished records, then the tagged range of
//! records in flight: `schema::IN_FLIGHT_TAG`) and stops at the first
//! deadline of each still in the future, so its cost grows with what it
//! evicts, not with the store's size.

use std::time::{Duration, Instant};

use super::commit::unbind;
use super::schema::{self, Tables};
use crate::audit::Event;
use crate::codec;
use crate::error::Result;
use crate::record::is_expired;

/// What one sweep step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Swept {
    /// Records removed.
    pub evicted: usize,
    /// Whether the step stopped before it ran out of due records (at its
    /// `max` or its time budget): more may be due.
    pub more: bool,
    /// The writer's time the step took (reading the due entries included);
    /// the writer adds, on its answer, what earlier steps' evictions cost
    /// it since their own steps (`commit::evictions_share`).
    pub spent: Duration,
}

/// Evicts up to `max` records whose retention ended at or before `now_ms`,
/// through the writer's `tables` (so that eviction is logged like every
/// other change), with their business-key bindings, and collects one audit
/// event per eviction. With a `budget`, stops after the eviction that
/// reaches it: a step then holds the writer for at most the budget plus
/// one eviction (6 to 40 µs measured, from 10 k to 10 M records) and the
/// read of its due entries (at most `max`). Returns what it did.
///
/// Emits the event "sweep" (debug, target `idemstore::sweep`) with the
/// store's `path`, `evicted` and `visited`, the expiry index entries read:
/// at most the due ones plus one per range (finished, in flight), whatever
/// the store's size. It is emitted when the sweep is decided, before its
/// batch is durable (a batch that then fails evicted nothing).
pub(crate) fn evict(
    tables: &mut Tables<'_>,
    now_ms: u64,
    max: usize,
    budget: Option<Duration>,
    events: &mut Vec<Event>,
) -> Result<Swept> {
    let started = Instant::now();
    let (due, visited) = tables.expiry_due(now_ms, max, is_expired)?;
    let found = due.len();
    let mut evicted = 0;
    let mut handled = 0;
    let mut kept = 0;
    for (deadline, key) in due {
        // At least one entry per step, so that a step whose read of the
        // due entries alone used up the budget (it first applies the
        // writer's buffered changes) still makes progress.
        if handled > 0 && budget.is_some_and(|b| started.elapsed() >= b) {
            break;
        }
        handled += 1;
        let Some(bytes) = tables.get_record(&key)? else {
            tables.remove_expiry(deadline, &key)?;
            continue;
        };
        // The index entry is authoritative only if the record agrees; a
        // record that fails to decode is left for `check` to report.
        let decoded = codec::decode_record(&key, &bytes);
        if let Ok(rec) = &decoded
            && schema::expiry_slot(rec.state, rec.expires_ms) == deadline
            && !is_expired(rec.expires_ms, now_ms)
        {
            // An expiry beyond the slots' range is held at the range's end
            // (`expiry_slot`): at a store time past that end (2^61 ms, a
            // custom clock's), the entry is due before its record expires.
            // The record stays, and so does its entry.
            kept += 1;
            continue;
        }
        tables.remove_expiry(deadline, &key)?;
        match decoded {
            Ok(rec) if schema::expiry_slot(rec.state, rec.expires_ms) == deadline => {
                tables.remove_record(&key)?;
                if let Some(bk) = &rec.business_key {
                    unbind(tables, &rec.key.business_binding(bk), &key)?;
                }
                events.push(Event::evicted(&rec));
                evicted += 1;
            }
            Ok(_) => {}
            Err(err) => {
                // Left for `check` to report; the audit log says so now.
                events.extend(Event::corruption(&err));
            }
        }
    }
    tracing::debug!(
        target: "idemstore::sweep",
        path = %tables.path().display(),
        evicted,
        visited,
        "sweep"
    );
    Ok(Swept {
        evicted,
        // A step whose entries were all kept found nothing to evict in
        // them, and the next would read the same ones again.
        more: handled < found || (found >= max && kept < handled),
        spent: started.elapsed(),
    })
}
