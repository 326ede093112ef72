//! Read-only scans over one snapshot of the records: the compensation scan
//! that a reconciler drives, and the filtered listing behind `idemstore
//! list`.
//!
//! A scan reads one snapshot that its engine opens: it sees the store as
//! it was when the scan began, however long it runs, and never blocks
//! writes. In the embedded engine the snapshot is a redb read transaction
//! (readers and the writer do not wait for each other); a long-lived scan
//! keeps the pages of its snapshot from being reused, so the file may grow
//! while it is open; drop it when done.

use std::time::Duration;

use crate::clock::duration_ms;
use crate::codec::{self, Entries};
use crate::error::{Error, Result};
use crate::key::MAX_SCOPE_LEN;
use crate::record::{Record, State};

/// Which records a scan yields. Every condition given must hold; an empty
/// filter yields every live record. Records past retention are never
/// yielded (they are absent, whether or not eviction has run).
///
/// Age is `now − created_ms`: the time since the key was first acquired,
/// in whole milliseconds of the store's clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    states: Vec<State>,
    scope_prefix: Option<String>,
    older_than_ms: Option<u64>,
    lapsed: bool,
    compensation: bool,
}

impl Filter {
    /// A filter that yields every live record.
    pub fn new() -> Filter {
        Filter::default()
    }

    /// The records a reconciler must look at: Processing records whose
    /// lease has lapsed, or (when `older_than` is given) that are at least
    /// `older_than` old even if their lease is still valid (work that is
    /// taking suspiciously long, or a lease extended again and again).
    pub fn needs_compensation(older_than: Option<Duration>) -> Filter {
        Filter {
            states: vec![State::Processing],
            older_than_ms: older_than.map(duration_ms),
            compensation: true,
            ..Filter::default()
        }
    }

    /// Only records in `state`. Repeat to allow several states.
    #[must_use]
    pub fn state(mut self, state: State) -> Filter {
        if !self.states.contains(&state) {
            self.states.push(state);
        }
        self
    }

    /// Only records whose scope starts with `prefix` (a string prefix:
    /// `"acme/"` matches `"acme/tickets.create"` and `"acme/refunds"`). The
    /// scan reads only the matching key ranges.
    #[must_use]
    pub fn scope_prefix(mut self, prefix: impl Into<String>) -> Filter {
        self.scope_prefix = Some(prefix.into());
        self
    }

    /// Only records at least `age` old (see the type's docs).
    #[must_use]
    pub fn older_than(mut self, age: Duration) -> Filter {
        self.older_than_ms = Some(duration_ms(age));
        self
    }

    /// Only Processing records whose lease has lapsed (`max(now,
    /// updated_ms) ≥ lease_until_ms`, as a claim judges it; see
    /// [`Record::lease_valid_at`]): abandoned or slow work that any claim
    /// could take over.
    #[must_use]
    pub fn lapsed(mut self) -> Filter {
        self.lapsed = true;
        self
    }

    /// Whether `record` passes at `now_ms` (the scope prefix is applied by
    /// the key ranges, and again here).
    pub(crate) fn matches(&self, record: &Record, now_ms: u64) -> bool {
        if record.is_expired_at(now_ms) {
            return false;
        }
        if !self.states.is_empty() && !self.states.contains(&record.state) {
            return false;
        }
        if let Some(prefix) = &self.scope_prefix
            && !record.key.scope().starts_with(prefix.as_str())
        {
            return false;
        }
        let is_lapsed = record.state == State::Processing && !record.lease_valid_at(now_ms);
        let is_old = self
            .older_than_ms
            .map(|min| now_ms.saturating_sub(record.created_ms) >= min);
        if self.compensation {
            return is_lapsed || is_old == Some(true);
        }
        (!self.lapsed || is_lapsed) && is_old != Some(false)
    }

    /// The key ranges to read: for a scope prefix `p`, one range of stored
    /// keys `[n][p…]` per possible scope length `n` (stored keys start with
    /// the scope's length, so no single range holds every scope that
    /// starts with `p`). Half-open `[start, end)`; `None` = unbounded.
    pub(crate) fn ranges(&self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let prefix = self.scope_prefix.as_deref().unwrap_or("");
        if prefix.is_empty() {
            return vec![(Vec::new(), None)];
        }
        let p = prefix.as_bytes();
        (p.len()..=MAX_SCOPE_LEN)
            .filter_map(|n| u8::try_from(n).ok())
            .map(|n| {
                let mut start = Vec::with_capacity(1 + p.len());
                start.push(n);
                start.extend_from_slice(p);
                // UTF-8 never contains 0xFF, so the last byte can be
                // incremented: the first key past every `[n][p…]`.
                let mut end = start.clone();
                if let Some(last) = end.last_mut() {
                    *last = last.saturating_add(1);
                }
                (start, Some(end))
            })
            .collect()
    }
}

/// An iterator over the records that pass a [`Filter`], read from one
/// snapshot: see [`Store::scan`](crate::Store::scan).
///
/// Yields `Err` for a record that fails its checksum
/// ([`Error::CorruptRecord`], naming the key; the scan goes on with the
/// next record) and for a storage error (after which it ends). Records of
/// one scope come out together, ordered by id bytes.
///
/// On PostgreSQL it holds a connection of its own (with the snapshot's
/// transaction), one of at most
/// [`PostgresLimits::scans`](crate::PostgresLimits::scans), until it is
/// read to its end, meets an error, or is dropped: drop one read in part
/// promptly. A scan started while this thread holds such an iterator,
/// with no other place free, waits `call_timeout` and fails.
pub struct Records {
    entries: Entries,
    filter: Filter,
    now_ms: u64,
    done: bool,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("filter", &self.filter)
            .field("now_ms", &self.now_ms)
            .finish_non_exhaustive()
    }
}

impl Filter {
    /// Refuses a filter no record can pass because it is malformed.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a scope prefix longer than any scope.
    pub(crate) fn check(&self) -> Result<()> {
        if let Some(prefix) = &self.scope_prefix
            && prefix.len() > MAX_SCOPE_LEN
        {
            return Err(Error::invalid(
                "scope_prefix",
                format!("{} bytes, longer than any scope", prefix.len()),
            ));
        }
        Ok(())
    }
}

impl Records {
    /// The records of `entries` (read over `filter.ranges()`) that pass
    /// `filter` at the store time `now_ms`.
    pub(crate) fn new(entries: Entries, filter: Filter, now_ms: u64) -> Records {
        Records {
            entries,
            filter,
            now_ms,
            done: false,
        }
    }

    /// The store time the scan judges leases, ages and retention by (ms
    /// since the epoch).
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }
}

impl Iterator for Records {
    type Item = Result<Record>;

    fn next(&mut self) -> Option<Result<Record>> {
        while !self.done {
            let entry = match self.entries.next() {
                Some(Ok(entry)) => entry,
                None => {
                    self.done = true;
                    return None;
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
            };
            match codec::decode_record(&entry.0, &entry.1) {
                Ok(record) if self.filter.matches(&record, self.now_ms) => {
                    return Some(Ok(record));
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(target: "idemstore::audit", error = %e, cause = "corruption", "corrupt record met by a scan");
                    return Some(Err(e));
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{Fingerprint, Key};

    fn rec(scope: &str, state: State, created: u64, lease_until: u64) -> Record {
        Record {
            key: Key::new(scope, "id").unwrap(),
            state,
            token: 1,
            fingerprint: Fingerprint::of(b"x"),
            created_ms: created,
            updated_ms: created,
            lease_until_ms: lease_until,
            expires_ms: 1_000_000,
            output: None,
            recovery_point: None,
            business_key: None,
            acquisitions: 1,
        }
    }

    #[test]
    fn compensation_is_lapsed_or_old() {
        let f = Filter::needs_compensation(Some(Duration::from_millis(500)));
        let now = 1_000;
        // Lapsed, young.
        assert!(f.matches(&rec("s", State::Processing, 900, 950), now));
        // Valid lease, old.
        assert!(f.matches(&rec("s", State::Processing, 400, 5_000), now));
        // Valid lease, young.
        assert!(!f.matches(&rec("s", State::Processing, 900, 5_000), now));
        // Finished records never need compensation.
        assert!(!f.matches(&rec("s", State::Succeeded, 0, 0), now));
        let f = Filter::needs_compensation(None);
        assert!(!f.matches(&rec("s", State::Processing, 0, 5_000), now));
    }

    #[test]
    fn plain_filters_are_a_conjunction() {
        let now = 1_000;
        let f = Filter::new()
            .lapsed()
            .older_than(Duration::from_millis(500));
        assert!(f.matches(&rec("s", State::Processing, 400, 950), now));
        assert!(!f.matches(&rec("s", State::Processing, 900, 950), now));
        assert!(!f.matches(&rec("s", State::Processing, 400, 5_000), now));
        let f = Filter::new().scope_prefix("acme/").state(State::Succeeded);
        assert!(f.matches(&rec("acme/t", State::Succeeded, 0, 0), now));
        assert!(!f.matches(&rec("acme/t", State::Processing, 0, 0), now));
        assert!(!f.matches(&rec("other/t", State::Succeeded, 0, 0), now));
    }

    #[test]
    fn prefix_ranges_cover_every_scope_length() {
        let f = Filter::new().scope_prefix("ab");
        let ranges = f.ranges();
        assert_eq!(ranges.len(), MAX_SCOPE_LEN - 1);
        for scope in ["ab", "abc", "ab/x/y"] {
            let kb = Key::new(scope, "i").unwrap().to_bytes();
            let hits = ranges
                .iter()
                .filter(|(s, e)| {
                    kb.as_slice() >= s.as_slice() && e.as_deref().is_none_or(|e| kb.as_slice() < e)
                })
                .count();
            assert_eq!(hits, 1, "{scope}");
        }
        let kb = Key::new("a", "bc").unwrap().to_bytes();
        assert!(ranges.iter().all(|(s, e)| kb.as_slice() < s.as_slice()
            || e.as_deref().is_some_and(|e| kb.as_slice() >= e)));
    }
}
