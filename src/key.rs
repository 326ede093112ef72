//! Idempotency keys and request fingerprints.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Longest scope, in bytes.
pub const MAX_SCOPE_LEN: usize = 128;
/// Longest id, in bytes (Stripe allows idempotency keys of up to 255 characters).
pub const MAX_ID_LEN: usize = 255;
/// Longest fingerprint, in bytes.
pub const MAX_FINGERPRINT_LEN: usize = 64;
/// Longest business key, in bytes (the same limit as an id).
pub const MAX_BUSINESS_KEY_LEN: usize = 255;

/// Checks a business key: non-empty UTF-8 without control characters, at
/// most [`MAX_BUSINESS_KEY_LEN`] bytes.
pub(crate) fn check_business_key(business_key: &str) -> Result<()> {
    check_part("business key", business_key, MAX_BUSINESS_KEY_LEN).map_err(|e| match e {
        Error::InvalidKey { reason } => Error::invalid("business_key", reason),
        other => other,
    })
}

/// An idempotency key: a `scope` (tenant and operation, such as
/// `"acme/tickets.create"`) and an `id` (the caller's idempotency key, such as
/// `"task-42:call-7"`).
///
/// The same id in two scopes names two independent records. Keys are stored
/// as an unambiguous byte string (one length byte, the scope, then the id),
/// so no two `(scope, id)` pairs share an encoding and a scope can be scanned
/// as a prefix.
///
/// The id must be fixed by the caller's orchestrator *before the first
/// attempt* and reused on every retry; a key generated inside a retry loop,
/// or by a language model, deduplicates nothing.
///
/// A `Key` is cheap to clone: the scope and id are one shared allocation, so
/// a replayed [`Record`](crate::Record) copies a reference count, not the
/// text. Keys order by scope, then id.
#[derive(Clone)]
pub struct Key {
    /// The scope followed by the id.
    text: Arc<str>,
    /// The scope's length in bytes (at most [`MAX_SCOPE_LEN`], so one byte).
    scope_len: u8,
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.scope_len == other.scope_len && self.text == other.text
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.scope().hash(state);
        self.id().hash(state);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> Ordering {
        (self.scope(), self.id()).cmp(&(other.scope(), other.id()))
    }
}

impl Key {
    /// Builds a key from a scope and an id.
    ///
    /// Both must be non-empty UTF-8 without control characters; the scope is
    /// at most [`MAX_SCOPE_LEN`] (128) bytes, the id at most [`MAX_ID_LEN`]
    /// (255) bytes.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when a rule above is broken.
    pub fn new(scope: impl Into<String>, id: impl Into<String>) -> Result<Key> {
        let scope = scope.into();
        let id = id.into();
        Key::from_parts(&scope, &id)
    }

    fn from_parts(scope: &str, id: &str) -> Result<Key> {
        check_part("scope", scope, MAX_SCOPE_LEN)?;
        check_part("id", id, MAX_ID_LEN)?;
        let scope_len = u8::try_from(scope.len()).map_err(|_| Error::InvalidKey {
            reason: format!("scope is over the limit of {MAX_SCOPE_LEN} bytes"),
        })?;
        let mut text = String::with_capacity(scope.len() + id.len());
        text.push_str(scope);
        text.push_str(id);
        Ok(Key {
            text: Arc::from(text),
            scope_len,
        })
    }

    /// The scope: tenant and operation.
    pub fn scope(&self) -> &str {
        // `scope_len` is the scope's length, a char boundary of `text`.
        self.text
            .get(..usize::from(self.scope_len))
            .unwrap_or_default()
    }

    /// The caller's idempotency key within the scope.
    pub fn id(&self) -> &str {
        self.text
            .get(usize::from(self.scope_len)..)
            .unwrap_or_default()
    }

    /// The key as a reference for another system: the unique column kept
    /// beside a side effect (a ticket's row), a payment's merchant
    /// reference, a ticket's external id. 64 lowercase hex digits, the
    /// SHA-256 of the key's stored form (`[scope length][scope][id]`, the
    /// store's own unambiguous encoding), so no two keys share one. The
    /// [`Display`](fmt::Display) form does not do for this: scope and id
    /// may both hold `/`, so `POST /tickets` with `triage/k1` and
    /// `POST /tickets/triage` with `k1` both print
    /// `POST /tickets/triage/k1`, and a lookup by it finds the other
    /// key's effect. Fixed length, letters and digits only, so it fits
    /// where a key may not; the same for a key in every version of the
    /// store, since the stored form is part of the file format. A service
    /// that kept the printed key with its effects until now finds those
    /// rows by the printed key only: look up both forms until the records
    /// made before the switch are past their retention.
    ///
    /// ```
    /// use idemstore::Key;
    ///
    /// let a = Key::new("POST /tickets", "triage/k1")?;
    /// let b = Key::new("POST /tickets/triage", "k1")?;
    /// assert_eq!(a.to_string(), b.to_string());
    /// assert_ne!(a.reference(), b.reference());
    /// assert_eq!(a.reference().len(), 64);
    /// # Ok::<(), idemstore::Error>(())
    /// ```
    pub fn reference(&self) -> String {
        let mut digest = Sha256::new();
        digest.update([self.scope_len]);
        digest.update(self.text.as_bytes());
        digest
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The stored form: `[scope length u8][scope][id]`.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.text.len());
        out.push(self.scope_len);
        out.extend_from_slice(self.text.as_bytes());
        out
    }

    /// The stored form in two parts, without a copy: the scope length byte,
    /// then the scope and id ([`Key::to_bytes`] is their concatenation).
    pub(crate) fn stored_parts(&self) -> (u8, &[u8]) {
        (self.scope_len, self.text.as_bytes())
    }

    /// The stored prefix shared by every key of `scope`.
    pub(crate) fn scope_prefix(scope: &str) -> Result<Vec<u8>> {
        check_part("scope", scope, MAX_SCOPE_LEN)?;
        let mut out = Vec::with_capacity(1 + scope.len());
        out.push(u8::try_from(scope.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(scope.as_bytes());
        Ok(out)
    }

    /// The key of a business-key binding in this key's scope:
    /// `[scope length u8][scope][business key]`, the same unambiguous layout
    /// as a stored key, so bindings are unique per scope.
    pub(crate) fn business_binding(&self, business_key: &str) -> Vec<u8> {
        // The scope of a `Key` was validated when it was built, so its
        // prefix always encodes.
        let mut out = Key::scope_prefix(self.scope()).unwrap_or_default();
        out.extend_from_slice(business_key.as_bytes());
        out
    }

    /// Parses the stored form, validating it as [`Key::new`] does.
    pub(crate) fn from_bytes(bytes: &[u8]) -> Result<Key> {
        let (&len, rest) = bytes.split_first().ok_or_else(|| Error::InvalidKey {
            reason: "stored key is empty".into(),
        })?;
        let len = usize::from(len);
        if rest.len() < len {
            return Err(Error::InvalidKey {
                reason: "stored key is shorter than its scope length".into(),
            });
        }
        let (scope, id) = rest.split_at(len);
        let scope = std::str::from_utf8(scope).map_err(|_| Error::InvalidKey {
            reason: "stored scope is not UTF-8".into(),
        })?;
        let id = std::str::from_utf8(id).map_err(|_| Error::InvalidKey {
            reason: "stored id is not UTF-8".into(),
        })?;
        Key::from_parts(scope, id)
    }

    /// A printable rendering of stored key bytes that may be damaged.
    pub(crate) fn describe_bytes(bytes: &[u8]) -> String {
        match Key::from_bytes(bytes) {
            Ok(key) => key.to_string(),
            Err(_) => bytes.escape_ascii().to_string(),
        }
    }
}

fn check_part(what: &str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() {
        return Err(Error::InvalidKey {
            reason: format!("{what} is empty"),
        });
    }
    if value.len() > max {
        return Err(Error::InvalidKey {
            reason: format!("{what} is {} bytes, over the limit of {max}", value.len()),
        });
    }
    if value.chars().any(char::is_control) {
        return Err(Error::InvalidKey {
            reason: format!("{what} contains a control character"),
        });
    }
    Ok(())
}

/// For people: the scope and the id joined with `/`
/// (`acme/tickets.create/task-42:call-7`), the form the CLI's `get` and
/// `resolve` take. A scope and an id may both contain `/`, so two keys can
/// print alike (`acme/payments` with `t:c`, `acme` with `payments/t:c`):
/// the CLI then lists every split it finds. As a reference for another
/// system (a payment's merchant reference, a ticket's external id), use
/// [`Key::reference`], which no two keys share.
impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope(), self.id())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("scope", &self.scope())
            .field("id", &self.id())
            .finish()
    }
}

/// A digest of the request payload, opaque to the store: 1 to
/// [`MAX_FINGERPRINT_LEN`] (64) bytes.
///
/// A key reused with a different fingerprint is a client error
/// ([`Error::FingerprintMismatch`], HTTP 422), never a replay, for as long as
/// the record exists.
///
/// Cheap to clone: the bytes are shared (a reference count), so a claim
/// and a replayed [`Record`](crate::Record) do not copy them.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(Arc<[u8]>);

impl Fingerprint {
    /// The SHA-256 digest (32 bytes) of `payload`.
    pub fn of(payload: &[u8]) -> Fingerprint {
        Fingerprint(Arc::from(&Sha256::digest(payload)[..]))
    }

    /// A fingerprint computed by the caller (any digest of 1 to 64 bytes).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `bytes` is empty or longer than 64 bytes.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Fingerprint> {
        let bytes = bytes.into();
        if bytes.is_empty() || bytes.len() > MAX_FINGERPRINT_LEN {
            return Err(Error::invalid(
                "fingerprint",
                format!(
                    "{} bytes; a fingerprint is 1 to {MAX_FINGERPRINT_LEN} bytes",
                    bytes.len()
                ),
            ));
        }
        Ok(Fingerprint(Arc::from(bytes)))
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for b in self.as_bytes().iter().take(8) {
            write!(f, "{b:02x}")?;
        }
        if self.as_bytes().len() > 8 {
            write!(f, "…")?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_is_unambiguous_and_round_trips() {
        let a = Key::new("ab", "c").unwrap();
        let b = Key::new("a", "bc").unwrap();
        assert_ne!(a.to_bytes(), b.to_bytes());
        assert_eq!(Key::from_bytes(&a.to_bytes()).unwrap(), a);
        assert!(a.to_bytes().starts_with(&Key::scope_prefix("ab").unwrap()));
    }

    /// The reference is the stored form's SHA-256 in hex: pinned, since a
    /// service keeps it in its own tables.
    #[test]
    fn the_reference_is_the_stored_forms_digest() {
        let key = Key::new("POST /tickets", "a-1").unwrap();
        let expected: String = Sha256::digest(b"\x0dPOST /ticketsa-1")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(key.reference(), expected);
        assert_eq!(
            key.reference(),
            "399a16dee1c38ab1da999e19347e985ce70774a18dda6e3278a9e214931ad97d"
        );
    }

    #[test]
    fn limits_are_in_bytes() {
        assert!(Key::new("s".repeat(128), "i".repeat(255)).is_ok());
        assert!(Key::new("s".repeat(129), "i").is_err());
        assert!(Key::new("s", "i".repeat(256)).is_err());
        // 'é' is two bytes: 128 of them exceed 255 bytes.
        assert!(Key::new("s", "é".repeat(128)).is_err());
        assert!(Key::new("s", "a\nb").is_err());
        assert!(Key::new("", "a").is_err());
    }

    #[test]
    fn keys_order_by_scope_then_id() {
        let mut keys = [
            Key::new("b", "a").unwrap(),
            Key::new("ab", "z").unwrap(),
            Key::new("a", "zz").unwrap(),
            Key::new("a", "b").unwrap(),
        ];
        keys.sort();
        let pairs: Vec<(&str, &str)> = keys.iter().map(|k| (k.scope(), k.id())).collect();
        assert_eq!(pairs, [("a", "b"), ("a", "zz"), ("ab", "z"), ("b", "a")]);
        // The same text split differently is another key.
        assert_ne!(Key::new("ab", "c").unwrap(), Key::new("a", "bc").unwrap());
        let (len, rest) = keys[1].stored_parts();
        assert_eq!([&[len][..], rest].concat(), keys[1].to_bytes());
    }

    #[test]
    fn fingerprints_compare_by_their_bytes() {
        let a = Fingerprint::from_bytes(vec![1, 2]).unwrap();
        assert_eq!(a.as_bytes(), [1, 2]);
        assert_ne!(a, Fingerprint::from_bytes(vec![1, 2, 0]).unwrap());
        assert_eq!(Fingerprint::of(b"x").as_bytes().len(), 32);
        assert_eq!(
            Fingerprint::from_bytes(vec![7; 64]).unwrap().as_bytes(),
            [7; 64]
        );
        assert!(Fingerprint::from_bytes(vec![7; 65]).is_err());
        assert!(Fingerprint::from_bytes(Vec::new()).is_err());
    }
}
