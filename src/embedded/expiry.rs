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

use super::commit::unbind;
use super::schema::{self, Tables};
use crate::audit::Event;
use crate::codec;
use crate::error::Result;
use crate::record::is_expired;

/// Evicts up to `max` records whose retention ended at or before `now_ms`,
/// through the writer's `tables` (so that eviction is logged like every
/// other change), with their business-key bindings, and collects one audit
/// event per eviction. Returns how many records were removed.
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
    events: &mut Vec<Event>,
) -> Result<usize> {
    let (due, visited) = tables.expiry_due(now_ms, max, is_expired)?;
    let mut evicted = 0;
    for (deadline, key) in due {
        tables.remove_expiry(deadline, &key)?;
        let Some(bytes) = tables.get_record(&key)? else {
            continue;
        };
        // The index entry is authoritative only if the record agrees; a
        // record that fails to decode is left for `check` to report.
        match codec::decode_record(&key, &bytes) {
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
    Ok(evicted)
}
