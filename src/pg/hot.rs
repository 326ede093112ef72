//! The hot path: the common requests in one autocommit statement each.
//!
//! A claim of an absent key, a completion or failure by the holder this
//! process acquired, and a claim of a key whose row decides it without a
//! write (a replay, a lease in progress, a fingerprint mismatch) each take
//! one statement, with the database clock and the token read by the
//! statement itself. What the statement cannot decide (a row to take over,
//! a business key, a key seen twice in a batch, a completion whose row
//! changed) goes the general, locking way ([`super::attempt`]); a statement
//! that decides nothing writes nothing.
//!
//! # The decision stays the pure transition
//!
//! A written row's record depends on the statement's time `N` (and, for a
//! claim, its token `T`), which the app learns only from the answer. So
//! the app decides the request by [`transition`] at a placeholder time `P`
//! (and token `K`) and again at `P + 1` (and `K + 1`), and keeps the result
//! as a **template**: every time field that moved by one is stored as its
//! offset from `N`, a token that moved by one is taken from the `token`
//! column; anything else must not move, or the request goes the general
//! way. The statement fills in `N` and `T`; after it answered, the app
//! decides the request again by [`transition`] at `N` and `T` and checks
//! that the row holds exactly that record (the engines' conformance and
//! model tests run every request through this path).
//!
//! # The row's form
//!
//! ```text
//! record = [0xA1][mask u8][digest: 8 bytes][the template's envelope (crate::codec)]
//! digest = sha256(key ‖ int8send(token) ‖ int8send(expires_ms))[0..8]
//! N      = expires_ms − the template's expires_ms (an offset)
//! ```
//!
//! The envelope's checksum covers the template under its key; the digest,
//! computed by the server in the same statement, covers the two columns the
//! record is completed from; the mask, covered by neither, must be one of
//! the two the templates use (a claim's, a completion's); the other columns
//! must agree with the completed record as for any row. Reads complete the
//! record in the app ([`decode`]); a scan hands out the completed record's
//! ordinary envelope.
//!
//! # Tokens above imported ones
//!
//! A hot claim draws its token with `nextval` inside an `INSERT`, which
//! holds `ROW EXCLUSIVE` on the records table (taken before the statement
//! runs, held to its commit). An import takes `EXCLUSIVE` on that table
//! before it raises the sequence with `setval`: that mode conflicts with
//! `ROW EXCLUSIVE` (and with the `ROW SHARE` of the general path's
//! `SELECT … FOR UPDATE`, taken before its draws), so no draw runs between
//! the import's reading of the sequence and its raise, and the raise never
//! lowers the sequence below a token handed out.

use sha2::{Digest, Sha256};

use crate::codec;
use crate::key::Key;
use crate::record::{Ctx, Effect, Op, Record, Reply, transition};

/// The first byte of a row in the hot form (a codec envelope starts with
/// its version, 1).
pub(crate) const FORM: u8 = 0xA1;
/// The token comes from the `token` column.
const TOKEN: u8 = 1;
/// `created_ms` is `N` plus the template's.
const CREATED: u8 = 2;
/// `updated_ms` is `N` plus the template's.
const UPDATED: u8 = 4;
/// `lease_until_ms` is `N` plus the template's.
const LEASE: u8 = 8;
/// `expires_ms` is `N` plus the template's (always set: `N` is read from it).
const EXPIRES: u8 = 16;
/// The mask of a fresh claim: every time and the token from the statement.
pub(crate) const CLAIM_MASK: u8 = TOKEN | CREATED | UPDATED | LEASE | EXPIRES;
/// The mask of a completion or failure: the update time and the expiry.
pub(crate) const FINISH_MASK: u8 = UPDATED | EXPIRES;
/// The largest time or offset the hot path handles (the rest goes the
/// general way), so that `N` plus an offset always fits a `bigint`.
const LIMIT: u64 = 1 << 61;

/// A request decided at a placeholder time, to be completed by the
/// statement.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    /// Which fields the statement fills in.
    pub mask: u8,
    /// The record with offsets in the masked fields (token 0 if masked).
    pub record: Record,
    /// The template's codec envelope under its key.
    pub envelope: Vec<u8>,
}

impl Template {
    /// The first two bytes of the row's `record` column.
    pub(crate) fn head(&self) -> Vec<u8> {
        vec![FORM, self.mask]
    }

    /// The offset of `lease_until_ms` from `N`, as a `bigint`.
    pub(crate) fn lease_offset(&self) -> i64 {
        i64::try_from(self.record.lease_until_ms).unwrap_or(i64::MAX)
    }

    /// The offset of `expires_ms` from `N`, as a `bigint`.
    pub(crate) fn expires_offset(&self) -> i64 {
        i64::try_from(self.record.expires_ms).unwrap_or(i64::MAX)
    }
}

/// Reads a record field by number (0 created, 1 updated, 2 lease, 3
/// expires).
fn time(r: &Record, field: usize) -> u64 {
    match field {
        0 => r.created_ms,
        1 => r.updated_ms,
        2 => r.lease_until_ms,
        _ => r.expires_ms,
    }
}

fn set_time(r: &mut Record, field: usize, v: u64) {
    match field {
        0 => r.created_ms = v,
        1 => r.updated_ms = v,
        2 => r.lease_until_ms = v,
        _ => r.expires_ms = v,
    }
}

const TIME_BITS: [u8; 4] = [CREATED, UPDATED, LEASE, EXPIRES];

/// The record a template becomes at time `n` with token `token` (`None`
/// when a value overflows).
pub(crate) fn complete(t: &Record, mask: u8, n: u64, token: u64) -> Option<Record> {
    let mut r = t.clone();
    if mask & TOKEN != 0 {
        r.token = token;
    }
    for (field, bit) in TIME_BITS.iter().enumerate() {
        if mask & bit != 0 {
            set_time(&mut r, field, n.checked_add(time(t, field))?);
        }
    }
    Some(r)
}

/// The record `decide` writes at time `n` with token `k`, if it writes one.
fn put_at(decide: &dyn Fn(u64, u64) -> Option<Record>, n: u64, k: u64) -> Option<Record> {
    let r = decide(n, k)?;
    super::decide::columns(&r)?;
    Some(r)
}

/// Derives the template of a request that `decide` (the transition at a
/// time and a token) answers with a write, from placeholder time `p` and
/// token `k`: `None` when the write is not a shift of its time and token.
pub(crate) fn derive(
    key_bytes: &[u8],
    p: u64,
    k: u64,
    decide: &dyn Fn(u64, u64) -> Option<Record>,
) -> Option<Template> {
    if p >= LIMIT || k >= LIMIT {
        return None;
    }
    let a = put_at(decide, p, k)?;
    let b = put_at(decide, p + 1, k + 1)?;
    let mut t = a.clone();
    let mut mask = 0;
    if b.token == a.token.checked_add(1)? && a.token == k {
        mask |= TOKEN;
        t.token = 0;
    } else if b.token != a.token {
        return None;
    }
    for (field, bit) in TIME_BITS.iter().enumerate() {
        let (va, vb) = (time(&a, field), time(&b, field));
        if vb == va.checked_add(1)? && va >= p && va - p < LIMIT {
            mask |= bit;
            set_time(&mut t, field, va - p);
        } else if vb != va {
            return None;
        }
    }
    if mask & EXPIRES == 0 {
        return None;
    }
    // Everything else is the same at both points.
    if complete(&t, mask, p, k).as_ref() != Some(&a)
        || complete(&t, mask, p + 1, k + 1).as_ref() != Some(&b)
    {
        return None;
    }
    let envelope = codec::encode_record(key_bytes, &t);
    Some(Template {
        mask,
        record: t,
        envelope,
    })
}

/// The template of a claim of an absent key: `None` when the claim does
/// not acquire a fresh record by a shift (a business key, a value too
/// large, …).
pub(crate) fn claim_template(key: &Key, op: &Op, retention_ms: u64, p: u64) -> Option<Template> {
    if !matches!(
        op,
        Op::Claim {
            business_key: None,
            ..
        }
    ) {
        return None;
    }
    let decide = |n: u64, k: u64| put_of(key, None, op, retention_ms, n, k);
    let t = derive(&key.to_bytes(), p, 1, &decide)?;
    (t.mask == CLAIM_MASK && t.record.created_ms == 0 && t.record.updated_ms == 0).then_some(t)
}

/// The template of a completion or failure of `held` (the record as this
/// process last wrote it): `None` unless the transition finishes it by a
/// shift that keeps its token, creation and lease.
pub(crate) fn finish_template(
    key: &Key,
    held: &Record,
    op: &Op,
    retention_ms: u64,
    p: u64,
) -> Option<Template> {
    if !matches!(op, Op::Complete { .. } | Op::Fail { .. }) {
        return None;
    }
    let decide = |n: u64, k: u64| put_of(key, Some(held), op, retention_ms, n, k);
    let t = derive(&key.to_bytes(), p, 1, &decide)?;
    let r = &t.record;
    (t.mask == FINISH_MASK
        && r.updated_ms == 0
        && r.token == held.token
        && r.created_ms == held.created_ms
        && r.lease_until_ms == held.lease_until_ms)
        .then_some(t)
}

/// The record the transition writes for `op` on `stored` at `n` with the
/// token `k` (`None`: an error or no write).
fn put_of(
    key: &Key,
    stored: Option<&Record>,
    op: &Op,
    retention_ms: u64,
    n: u64,
    k: u64,
) -> Option<Record> {
    let ctx = Ctx {
        now_ms: n,
        retention_ms,
        next_token: k,
        business_holder: None,
    };
    match transition(key, stored, op, &ctx) {
        Ok((Effect::Put(r), _)) => Some(r),
        _ => None,
    }
}

/// The transition's answer for `op` on `stored` at `n` with token `k`,
/// checked to write exactly `written`: the proof, after the statement,
/// that the row holds what the pure decision makes of the request.
///
/// # Errors
/// A description when the transition decides anything else.
pub(crate) fn confirm(
    key: &Key,
    stored: Option<&Record>,
    op: &Op,
    retention_ms: u64,
    n: u64,
    k: u64,
    written: &Record,
) -> Result<(Effect, Reply), String> {
    let ctx = Ctx {
        now_ms: n,
        retention_ms,
        next_token: k,
        business_holder: None,
    };
    match transition(key, stored, op, &ctx) {
        Ok((Effect::Put(r), reply)) if r == *written => Ok((Effect::Put(r), reply)),
        other => Err(format!(
            "the hot path wrote {written:?} where the transition decides {other:?}"
        )),
    }
}

/// The first 8 bytes of sha256(key ‖ token ‖ expires), both big-endian:
/// what the statement computes with `sha256` and `int8send`.
pub(crate) fn digest(key_bytes: &[u8], token: i64, expires_ms: i64) -> [u8; 8] {
    let mut h = Sha256::new();
    h.update(key_bytes);
    h.update(token.to_be_bytes());
    h.update(expires_ms.to_be_bytes());
    let d = h.finalize();
    let mut out = [0u8; 8];
    out.copy_from_slice(&d[..8]);
    out
}

/// The `record` column the statement writes for `t` with these columns.
pub(crate) fn stored_bytes(key_bytes: &[u8], t: &Template, token: i64, expires_ms: i64) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + t.envelope.len());
    out.extend_from_slice(&t.head());
    out.extend_from_slice(&digest(key_bytes, token, expires_ms));
    out.extend_from_slice(&t.envelope);
    out
}

/// Completes a row in the hot form from its `token` and `expires_ms`
/// columns (the caller checks the other columns against the result).
///
/// # Errors
/// A description of what is wrong (the row is then corrupt).
pub(crate) fn decode(
    key_bytes: &[u8],
    bytes: &[u8],
    token: i64,
    expires_ms: i64,
) -> Result<Record, crate::error::Error> {
    let corrupt = |detail: String| crate::error::Error::CorruptRecord {
        key: Key::describe_bytes(key_bytes),
        detail,
    };
    let [FORM, mask, rest @ ..] = bytes else {
        return Err(corrupt("not a row in the hot form".into()));
    };
    let (stored_digest, envelope) = rest
        .split_at_checked(8)
        .ok_or_else(|| corrupt(format!("a hot-form row of {} bytes", bytes.len())))?;
    if stored_digest != digest(key_bytes, token, expires_ms) {
        return Err(corrupt(
            "the digest of the token and expiry columns does not match".into(),
        ));
    }
    // Only the two templates' masks are ever written; neither the
    // envelope's checksum nor the digest covers this byte, so any other
    // value (a byte changed outside idemstore) is damage, not a form.
    if *mask != CLAIM_MASK && *mask != FINISH_MASK {
        return Err(corrupt(format!("hot-form mask {mask:#04x}")));
    }
    let t = codec::decode_record(key_bytes, envelope)?;
    let n = u64::try_from(expires_ms)
        .ok()
        .and_then(|e| e.checked_sub(t.expires_ms))
        .ok_or_else(|| corrupt(format!("expires_ms {expires_ms} below its offset")))?;
    let token = u64::try_from(token).map_err(|_| corrupt(format!("token {token}")))?;
    complete(&t, *mask, n, token).ok_or_else(|| corrupt("a completed time overflows".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Fingerprint;

    fn claim(lease_ms: u64) -> Op {
        Op::Claim {
            fingerprint: Fingerprint::of(b"x"),
            lease_ms,
            business_key: None,
        }
    }

    #[test]
    fn a_claim_template_completes_to_the_transition_at_any_time() {
        let key = Key::new("s", "k").expect("key");
        let kb = key.to_bytes();
        let op = claim(30_000);
        let t = claim_template(&key, &op, 86_400_000, 1_700_000_000_000).expect("template");
        for (n, tok) in [(1_700_000_000_000, 7), (1_800_000_123_456, 1 << 40)] {
            let r = complete(&t.record, t.mask, n, tok).expect("complete");
            confirm(&key, None, &op, 86_400_000, n, tok, &r).expect("same");
            let c = crate::pg::decide::columns(&r).expect("columns");
            let bytes = stored_bytes(&kb, &t, c.token, c.expires_ms);
            let back = decode(&kb, &bytes, c.token, c.expires_ms).expect("decode");
            assert_eq!(back, r);
            // Another token or expiry fails the digest.
            assert!(decode(&kb, &bytes, c.token + 1, c.expires_ms).is_err());
            assert!(decode(&kb, &bytes, c.token, c.expires_ms + 1).is_err());
            // The mask byte, covered by no checksum: any bit flipped in it
            // is damage.
            for bit in 0..8 {
                let mut flipped = bytes.clone();
                flipped[1] ^= 1 << bit;
                assert!(
                    decode(&kb, &flipped, c.token, c.expires_ms).is_err(),
                    "mask bit {bit}"
                );
            }
        }
    }

    #[test]
    fn a_finish_template_keeps_the_token_and_moves_the_times() {
        let key = Key::new("s", "k").expect("key");
        let op = claim(1_000);
        let t = claim_template(&key, &op, 60_000, 1_000_000).expect("template");
        let held = complete(&t.record, t.mask, 1_000_000, 5).expect("held");
        let done = Op::Complete {
            token: 5,
            result: b"ok".to_vec(),
        };
        let f = finish_template(&key, &held, &done, 60_000, 1_000_000).expect("finish");
        let r = complete(&f.record, f.mask, 1_000_500, 0).expect("complete");
        confirm(&key, Some(&held), &done, 60_000, 1_000_500, 0, &r).expect("same");
        // A stale token is no write: the general path answers it.
        let stale = Op::Complete {
            token: 4,
            result: b"ok".to_vec(),
        };
        assert!(finish_template(&key, &held, &stale, 60_000, 1_000_000).is_none());
        // A claim with a business key goes the general way.
        let bk = Op::Claim {
            fingerprint: Fingerprint::of(b"x"),
            lease_ms: 1,
            business_key: Some("b".into()),
        };
        assert!(claim_template(&key, &bk, 60_000, 1_000_000).is_none());
    }
}
