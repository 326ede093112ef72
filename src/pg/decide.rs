//! Deciding a batch in the app: the rows read (and locked) from the
//! database, the requests in arrival order, the pure transition for each,
//! and the writes that result.
//!
//! This mirrors the embedded writer's `apply_op` (business-key holder,
//! token cap, binding upkeep, audit events) over an in-memory overlay of
//! the rows, so that a later request of the batch sees the effect of an
//! earlier one on the same key (or on the same business key).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::audit::Event;
use crate::codec;
use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::{ClaimOutcome, Ctx, Effect, Op, Record, Reply, State, taken_from, transition};

/// One stored row as the engine knows it.
#[derive(Debug, Clone)]
pub(crate) enum Slot {
    /// No row.
    Absent,
    /// A row whose envelope decoded and agrees with its columns.
    Present(Record),
    /// A row that failed to decode, or whose columns disagree with its
    /// envelope: the key's description and what is wrong.
    Corrupt(String, String),
}

impl Slot {
    /// The error a request on a corrupt row gets.
    fn error(&self) -> Option<Error> {
        match self {
            Slot::Corrupt(key, detail) => Some(Error::CorruptRecord {
                key: key.clone(),
                detail: detail.clone(),
            }),
            _ => None,
        }
    }

    fn record(&self) -> Option<&Record> {
        match self {
            Slot::Present(r) => Some(r),
            _ => None,
        }
    }
}

/// The columns of a row, as read.
pub(crate) struct RowColumns {
    pub key: Vec<u8>,
    pub record: Vec<u8>,
    pub token: i64,
    pub state: i16,
    pub created_ms: i64,
    pub lease_until_ms: i64,
    pub expires_ms: i64,
}

/// The query columns of a record, checked to fit a `bigint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Columns {
    pub token: i64,
    pub state: i16,
    pub created_ms: i64,
    pub lease_until_ms: i64,
    pub expires_ms: i64,
}

/// The state code stored in the `state` column (the codec's codes).
pub(crate) fn state_code(state: State) -> i16 {
    match state {
        State::Processing => 0,
        State::Succeeded => 1,
        State::Failed { retryable: false } => 2,
        State::Failed { retryable: true } => 3,
    }
}

/// The query columns of `record`, or `None` when a value does not fit a
/// `bigint`.
pub(crate) fn columns(record: &Record) -> Option<Columns> {
    Some(Columns {
        token: i64::try_from(record.token).ok()?,
        state: state_code(record.state),
        created_ms: i64::try_from(record.created_ms).ok()?,
        lease_until_ms: i64::try_from(record.lease_until_ms).ok()?,
        expires_ms: i64::try_from(record.expires_ms).ok()?,
    })
}

/// Turns a row into a slot: decodes the envelope (or completes a row in
/// the hot form, [`super::hot`]) and checks the columns against it (a negative or disagreeing column is corruption).
pub(crate) fn slot_of(row: &RowColumns) -> Slot {
    let corrupt = |detail: String| Slot::Corrupt(Key::describe_bytes(&row.key), detail);
    let decoded = if row.record.first() == Some(&super::hot::FORM) {
        super::hot::decode(&row.key, &row.record, row.token, row.expires_ms)
    } else {
        codec::decode_record(&row.key, &row.record)
    };
    let rec = match decoded {
        Ok(r) => r,
        Err(Error::CorruptRecord { key, detail }) => return Slot::Corrupt(key, detail),
        Err(e) => return corrupt(e.to_string()),
    };
    let stored = Columns {
        token: row.token,
        state: row.state,
        created_ms: row.created_ms,
        lease_until_ms: row.lease_until_ms,
        expires_ms: row.expires_ms,
    };
    match columns(&rec) {
        Some(c) if c == stored => Slot::Present(rec),
        Some(c) => corrupt(format!(
            "the row's columns {stored:?} disagree with its record {c:?}"
        )),
        None => corrupt("a time or token of the record does not fit a bigint".into()),
    }
}

/// What was read for a batch: rows by key bytes (the batch's keys, locked,
/// and business-key holders) and bindings by binding bytes (locked).
#[derive(Debug, Default, Clone)]
pub(crate) struct Base {
    pub records: HashMap<Vec<u8>, Slot>,
    pub bindings: HashMap<Vec<u8>, Option<Vec<u8>>>,
    /// The rows this transaction holds locked: the batch's keys, and the
    /// holders past retention it locked without waiting. Only these are
    /// evicted when the batch takes their business key; another holder's
    /// row is its locker's to change.
    pub locked: HashSet<Vec<u8>>,
}

/// The decisions of one pass over a batch.
pub(crate) struct Decided {
    /// One answer per request, in input order.
    pub replies: Vec<Result<Reply>>,
    /// The audit events, to publish once the batch commits.
    pub events: Vec<Event>,
    /// Acquisitions that found no drawn token (draw this many more and
    /// decide again).
    pub shortage: usize,
    /// Final rows of the keys that changed.
    pub records: BTreeMap<Vec<u8>, Slot>,
    /// Final bindings that changed.
    pub bindings: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

/// The inputs of a pass besides the rows and the requests.
pub(crate) struct Pass<'a> {
    /// The batch's time (the database clock or the test clock, as read;
    /// each record is decided at no earlier time than its last update).
    pub now_ms: u64,
    /// Configured retention (ms).
    pub retention_ms: u64,
    /// Tokens drawn from the sequence after the rows were locked, ascending.
    pub tokens: &'a [u64],
    /// Whether the sequence is exhausted (no more tokens can be drawn).
    pub exhausted: bool,
}

struct Overlay<'a> {
    base: &'a Base,
    records: BTreeMap<Vec<u8>, Slot>,
    bindings: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

impl Overlay<'_> {
    fn record(&self, kb: &[u8]) -> &Slot {
        static ABSENT: Slot = Slot::Absent;
        self.records
            .get(kb)
            .or_else(|| self.base.records.get(kb))
            .unwrap_or(&ABSENT)
    }

    fn binding(&self, binding: &[u8]) -> Option<&Vec<u8>> {
        match self.bindings.get(binding) {
            Some(b) => b.as_ref(),
            None => self.base.bindings.get(binding).and_then(Option::as_ref),
        }
    }

    fn unbind(&mut self, binding: Vec<u8>, kb: &[u8]) {
        if self.binding(&binding).is_some_and(|v| v == kb) {
            self.bindings.insert(binding, None);
        }
    }

    /// The embedded writer's `rebind`, over the overlay.
    fn rebind(&mut self, key: &Key, old: Option<&Record>, new: &Record, fresh: bool) {
        let old_bk = old.and_then(|o| o.business_key.as_deref());
        let new_bk = new.business_key.as_deref();
        let kb = key.to_bytes();
        if let Some(ob) = old_bk.filter(|ob| Some(*ob) != new_bk) {
            self.unbind(key.business_binding(ob), &kb);
        }
        if let Some(nb) = new_bk.filter(|nb| fresh || old_bk != Some(*nb)) {
            self.bindings.insert(key.business_binding(nb), Some(kb));
        }
    }
}

/// The business key a request would bind, if any.
pub(crate) fn op_business_key(op: &Op) -> Option<&str> {
    match op {
        Op::Claim { business_key, .. } => business_key.as_deref(),
        Op::Import { record } => record.business_key.as_deref(),
        _ => None,
    }
}

/// Decides every request of `ops` in order over `base`.
pub(crate) fn decide(base: &Base, ops: &[(Key, Op)], pass: &Pass<'_>) -> Decided {
    let mut ov = Overlay {
        base,
        records: BTreeMap::new(),
        bindings: BTreeMap::new(),
    };
    let mut replies = Vec::with_capacity(ops.len());
    let mut events = Vec::new();
    let mut used = 0usize;
    let mut shortage = 0usize;
    for (key, op) in ops {
        let reply = decide_one(
            &mut ov,
            key,
            op,
            pass,
            &mut used,
            &mut shortage,
            &mut events,
        );
        replies.push(reply);
    }
    Decided {
        replies,
        events,
        shortage,
        records: ov.records,
        bindings: ov.bindings,
    }
}

fn rejected(key: &Key, err: Error, events: &mut Vec<Event>) -> Error {
    events.extend(Event::of_error(key, &err));
    err
}

/// One request: the embedded `apply_op`, over the overlay.
fn decide_one(
    ov: &mut Overlay<'_>,
    key: &Key,
    op: &Op,
    pass: &Pass<'_>,
    used: &mut usize,
    shortage: &mut usize,
    events: &mut Vec<Event>,
) -> Result<Reply> {
    let kb = key.to_bytes();
    let slot = ov.record(&kb);
    if let Some(err) = slot.error() {
        return Err(rejected(key, err, events));
    }
    let stored = slot.record().cloned();
    // Time never runs backwards for a record: a row written by another
    // process at a later database time is judged at that time at least.
    let now = stored
        .as_ref()
        .map_or(pass.now_ms, |r| pass.now_ms.max(r.updated_ms));
    let fresh = stored.as_ref().is_none_or(|r| r.is_expired_at(now));
    let holder = match op_business_key(op).filter(|_| fresh) {
        Some(bk) => match ov.binding(&key.business_binding(bk)) {
            Some(hkb) if *hkb != kb => {
                let hslot = ov.record(hkb);
                if let Some(err) = hslot.error() {
                    return Err(rejected(key, err, events));
                }
                hslot.record().cloned()
            }
            _ => None,
        },
        None => None,
    };
    // The token an acquisition would take: the next drawn one, or (while
    // counting how many to draw) a placeholder above the cap.
    let drawn = pass.tokens.get(*used).copied();
    let placeholder = u64::MAX - u64::try_from(*shortage).unwrap_or(0);
    let ctx = Ctx {
        now_ms: now,
        retention_ms: pass.retention_ms,
        next_token: drawn.unwrap_or(placeholder),
        business_holder: holder.as_ref(),
    };
    let (effect, reply) = match transition(key, stored.as_ref(), op, &ctx) {
        Ok(x) => x,
        Err(e) => return Err(rejected(key, e, events)),
    };
    let acquires = matches!(reply, Reply::Claim(ClaimOutcome::Acquired(_)));
    // Fencing tokens only grow per key: a drawn token not above the one
    // the key's record holds means the sequence was set back outside
    // idemstore (`ALTER SEQUENCE … RESTART`, a table restored without its
    // sequence). Handing it out would let a downstream system that
    // refuses tokens below the last it saw refuse the new holder, and
    // accept the old one.
    if acquires
        && let (Some(token), Some(old)) = (drawn, stored.as_ref())
        && token <= old.token()
    {
        let err = Error::Misconfigured {
            fault: crate::error::ConfigFault::SchemaDamaged,
            detail: format!(
                "the store's token sequence drew {token}, not above the fencing token {} of \
                 this key's record: the sequence `tokens` was set back outside idemstore; \
                 raise it above the largest token of the records table (SELECT setval on it \
                 to SELECT max(token) of the table)",
                old.token()
            ),
        };
        return Err(rejected(key, err, events));
    }
    if acquires && drawn.is_none() {
        if pass.exhausted {
            let err = Error::TokensExhausted {
                next_token: crate::MAX_TOKEN,
            };
            return Err(rejected(key, err, events));
        }
        *shortage += 1;
    }
    match &effect {
        Effect::None => {}
        Effect::Put(new) => {
            // (A counting pass holds a placeholder token that never fits:
            // it is decided again with a drawn token.)
            if columns(new).is_none() && !(acquires && drawn.is_none()) {
                let err = Error::invalid(
                    "record",
                    "a time or token does not fit a PostgreSQL bigint".to_string(),
                );
                return Err(rejected(key, err, events));
            }
            ov.records.insert(kb.clone(), Slot::Present(new.clone()));
            ov.rebind(key, stored.as_ref(), new, fresh);
            // The holder past retention whose business key this put took is
            // evicted with it (the embedded writer's rule): were its row
            // kept, a server clock stepping back would make it live again
            // beside this record. Only a row this transaction holds locked:
            // one locked elsewhere is being changed by its locker (a sweep
            // evicting it, a batch on its key).
            if let Some(h) = taken_from(holder.as_ref(), new, now)
                && ov.base.locked.contains(&h.key.to_bytes())
            {
                ov.records.insert(h.key.to_bytes(), Slot::Absent);
                events.push(Event::evicted(h));
            }
            if acquires && drawn.is_some() {
                *used += 1;
            }
        }
        Effect::Delete => {
            if let Some(old) = &stored
                && let Some(bk) = &old.business_key
            {
                ov.unbind(key.business_binding(bk), &kb);
            }
            ov.records.insert(kb.clone(), Slot::Absent);
        }
    }
    events.extend(Event::of_transition(
        key,
        stored.as_ref(),
        op,
        &effect,
        &reply,
        now,
    ));
    Ok(reply)
}

/// The writes that take `base` to the decided state, each a
/// compare-and-set against what was read.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    /// Rows to insert where absent: key, envelope, columns.
    pub inserts: Vec<(Vec<u8>, Vec<u8>, Columns)>,
    /// Rows to update where the token is still the one read: key,
    /// envelope, columns, token read.
    pub updates: Vec<(Vec<u8>, Vec<u8>, Columns, i64)>,
    /// Rows to delete where the token is still the one read.
    pub deletes: Vec<(Vec<u8>, i64)>,
    /// Bindings to insert where absent: binding, key.
    pub bind_inserts: Vec<(Vec<u8>, Vec<u8>)>,
    /// Bindings to move: binding, new key, key read.
    pub bind_updates: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)>,
    /// Bindings to delete where they still name the key read.
    pub bind_deletes: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Writes {
    /// Whether nothing is to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.inserts.is_empty()
            && self.updates.is_empty()
            && self.deletes.is_empty()
            && self.bind_inserts.is_empty()
            && self.bind_updates.is_empty()
            && self.bind_deletes.is_empty()
    }

    /// Whether a write may lose its compare-and-set (an insert of a row or
    /// binding that was absent, so not locked, when read).
    pub(crate) fn may_lose(&self) -> bool {
        !self.inserts.is_empty() || !self.bind_inserts.is_empty()
    }
}

/// The writes of `decided` against `base`, in key order.
pub(crate) fn writes(base: &Base, decided: &Decided) -> Writes {
    let mut w = Writes::default();
    for (kb, fin) in &decided.records {
        let before = base.records.get(kb).and_then(Slot::record);
        match (before, fin) {
            (None, Slot::Present(new)) => {
                if let Some(c) = columns(new) {
                    w.inserts
                        .push((kb.clone(), codec::encode_record(kb, new), c));
                }
            }
            (Some(old), Slot::Present(new)) if old != new => {
                if let (Some(c), Some(seen)) = (columns(new), columns(old)) {
                    w.updates
                        .push((kb.clone(), codec::encode_record(kb, new), c, seen.token));
                }
            }
            (Some(old), Slot::Absent) => {
                if let Some(seen) = columns(old) {
                    w.deletes.push((kb.clone(), seen.token));
                }
            }
            _ => {}
        }
    }
    for (b, fin) in &decided.bindings {
        let before = base.bindings.get(b).and_then(Option::as_ref);
        match (before, fin) {
            (None, Some(k)) => w.bind_inserts.push((b.clone(), k.clone())),
            (Some(old), Some(k)) if old != k => {
                w.bind_updates.push((b.clone(), k.clone(), old.clone()));
            }
            (Some(old), None) => w.bind_deletes.push((b.clone(), old.clone())),
            _ => {}
        }
    }
    w
}

/// The binding keys a batch needs read: those its requests would bind and
/// those of its stored records (which a change may unbind).
pub(crate) fn bindings_needed(base: &Base, ops: &[(Key, Op)]) -> BTreeSet<Vec<u8>> {
    let mut out = BTreeSet::new();
    for (key, op) in ops {
        if let Some(bk) = op_business_key(op) {
            out.insert(key.business_binding(bk));
        }
        if let Some(Slot::Present(rec)) = base.records.get(&key.to_bytes())
            && let Some(bk) = &rec.business_key
        {
            out.insert(rec.key.business_binding(bk));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Fingerprint;

    /// A claim of `new` with business key `bk`, whose binding names the
    /// record `old` past retention, over a base that holds `old`'s row
    /// locked or not: the answer is an acquisition either way, and `old` is
    /// evicted (its row deleted, an evict event) only when locked. A row
    /// locked elsewhere is its locker's to change: evicting it would take
    /// its lock after the binding's, the other order than a sweep's.
    #[test]
    fn a_holder_past_retention_is_evicted_only_when_its_row_is_locked() {
        let old = Key::new("s", "old").unwrap();
        let new = Key::new("s", "new").unwrap();
        let claim = || Op::Claim {
            fingerprint: Fingerprint::of(b"p"),
            lease_ms: 1_000,
            business_key: Some("bk".into()),
        };
        let pass = |now_ms, tokens| Pass {
            now_ms,
            retention_ms: 60_000,
            tokens,
            exhausted: false,
        };
        // The old record: claimed at 1,000, expiring at 61,000.
        let mut empty = Base::default();
        empty.records.insert(old.to_bytes(), Slot::Absent);
        empty.bindings.insert(old.business_binding("bk"), None);
        let first = decide(&empty, &[(old.clone(), claim())], &pass(1_000, &[1]));
        let Some(Slot::Present(held)) = first.records.get(&old.to_bytes()).cloned() else {
            panic!("the old record was not claimed: {:?}", first.replies);
        };
        let later = |locked: bool| {
            let mut base = Base::default();
            base.records.insert(new.to_bytes(), Slot::Absent);
            base.records
                .insert(old.to_bytes(), Slot::Present(held.clone()));
            base.bindings
                .insert(old.business_binding("bk"), Some(old.to_bytes()));
            base.locked.insert(new.to_bytes());
            if locked {
                base.locked.insert(old.to_bytes());
            }
            decide(&base, &[(new.clone(), claim())], &pass(120_000, &[2]))
        };
        for locked in [true, false] {
            let d = later(locked);
            assert!(
                matches!(d.replies[..], [Ok(Reply::Claim(ClaimOutcome::Acquired(_)))]),
                "{:?}",
                d.replies
            );
            let evicted = matches!(d.records.get(&old.to_bytes()), Some(Slot::Absent));
            assert_eq!(evicted, locked, "locked: {locked}");
            let events = d
                .events
                .iter()
                .filter(|e| {
                    matches!(
                        e,
                        Event::Transition {
                            cause: crate::audit::Cause::Evict,
                            ..
                        }
                    )
                })
                .count();
            assert_eq!(events, usize::from(locked), "locked: {locked}");
            assert_eq!(
                d.bindings.get(&old.business_binding("bk")),
                Some(&Some(new.to_bytes())),
                "the binding moves either way"
            );
        }
    }
}
