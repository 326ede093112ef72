//! Keys for model turns, tool calls and intents, and canonical JSON
//! fingerprints (RFC 8785).
//!
//! Every helper builds an ordinary [`Key`] and validates it as
//! [`Key::new`] does. The parts are joined with `:`, and the task id may not
//! contain `:`, so a key of one helper splits back into its parts in
//! exactly one way: `("a:b", "c")` is refused and `("a", "b:c")` gives
//! `a:b:c`, so the two never share a key. Ids of different helpers can
//! coincide (`for_tool_call(s, "t", "turn-3")` is `for_model_turn(s, "t",
//! 3)`, and a tool-call id `charge:<digest>` is `for_intent`'s id for
//! `charge`): give each helper a scope of its own (`acme/agent.turns`,
//! `acme/payments.calls`, `acme/payments.intents`), and never take a
//! tool-call id from anywhere but the model provider's response.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::key::{Fingerprint, Key};

/// The separator between the parts of a helper-built id.
const SEPARATOR: char = ':';

/// The largest magnitude an integer may have in a JSON fingerprint:
/// 2^53 − 1, the largest integer an IEEE 754 double holds exactly (I-JSON,
/// RFC 7493 §2.2).
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

impl Key {
    /// The key of one model turn of an agent task: id `task_id:turn-N`.
    ///
    /// Run the model request for turn `turn` through
    /// [`Store::execute`](crate::Store::execute) under this key, so that the
    /// model's response (and the tool-call ids in it) is recorded before any
    /// tool runs; a task resumed after a crash replays the recorded response
    /// and gets the same tool-call ids. Use a scope of its own for turns
    /// (such as `"acme/agent.turns"`).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when `task_id` is empty, contains `:` or a
    /// control character, or the id is over 255 bytes; or the scope breaks
    /// the rules of [`Key::new`].
    pub fn for_model_turn(scope: impl Into<String>, task_id: &str, turn: u64) -> Result<Key> {
        check_task(task_id)?;
        Key::new(scope, format!("{task_id}{SEPARATOR}turn-{turn}"))
    }

    /// The key of one tool call: id `task_id:tool_call_id`.
    ///
    /// It stops a repeat of the *same* tool call: the agent loop re-running a
    /// call after a crash, a resumed task replaying its recorded model turns,
    /// at-least-once delivery of the call to a worker. It does not stop a
    /// call the model re-planned with a new tool-call id (see
    /// [`Key::for_intent`]), and it is only stable if the model's response is
    /// recorded before any tool runs (see [`Key::for_model_turn`]): a
    /// provider mints new tool-call ids whenever a model request is retried.
    ///
    /// `task_id` may not contain `:`; `tool_call_id` is taken whole (it may
    /// contain `:`). Both must be non-empty, without control characters, and
    /// the id is at most 255 bytes ([`MAX_ID_LEN`](crate::MAX_ID_LEN)).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when a rule above or of [`Key::new`] is broken.
    pub fn for_tool_call(
        scope: impl Into<String>,
        task_id: &str,
        tool_call_id: &str,
    ) -> Result<Key> {
        check_task(task_id)?;
        check_nonempty("tool call id", tool_call_id)?;
        Key::new(scope, format!("{task_id}{SEPARATOR}{tool_call_id}"))
    }

    /// The key of an intent: id `task_id:tool_name:<sha256 of params>`, the
    /// digest being 64 lowercase hex digits of the SHA-256 of the RFC 8785
    /// canonical form of `params` (the same bytes [`Fingerprint::of_json`]
    /// digests).
    ///
    /// It collapses a re-planned duplicate inside one task: the model asks
    /// for the same tool with the same parameters again under a new
    /// tool-call id, and the call replays the first one's result. Member
    /// order inside `params` never matters; array order and value types do.
    /// Use it only for tools where two equal calls in one task are always a
    /// duplicate (a payment of the same order, a ticket with the same
    /// title); a tool that may legitimately be called twice with equal
    /// parameters needs [`Key::for_tool_call`] alone.
    ///
    /// Use a scope of its own for intents, not the tool calls' scope (see
    /// the module's docs: a tool-call id could spell an intent's id).
    ///
    /// `task_id` may not contain `:`; `tool_name` is non-empty. With the
    /// 64-digit digest, `task_id` and `tool_name` together may use at most
    /// 189 bytes.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when a rule above or of [`Key::new`] is broken;
    /// [`Error::InvalidArgument`] when `params` holds an integer beyond
    /// ±(2^53 − 1) (see [`Fingerprint::of_json`]).
    pub fn for_intent(
        scope: impl Into<String>,
        task_id: &str,
        tool_name: &str,
        params: &serde_json::Value,
    ) -> Result<Key> {
        check_task(task_id)?;
        check_nonempty("tool name", tool_name)?;
        let digest = canonical_digest(params)?;
        let mut id = String::with_capacity(task_id.len() + tool_name.len() + 66);
        id.push_str(task_id);
        id.push(SEPARATOR);
        id.push_str(tool_name);
        id.push(SEPARATOR);
        for b in digest {
            // Writing to a String cannot fail.
            let _ = write!(id, "{b:02x}");
        }
        Key::new(scope, id)
    }
}

impl Fingerprint {
    /// The SHA-256 digest (32 bytes) of the RFC 8785 (JSON Canonicalization
    /// Scheme) form of `value`: object members sorted by their UTF-16 code
    /// units, no insignificant whitespace, numbers in their shortest
    /// ECMAScript form, strings with minimal escaping.
    ///
    /// So the order of object members never changes the fingerprint, while
    /// the order of array elements and the type of every value always does
    /// (`1` and `"1"` differ, so do `1` and `1.5`; `1` and `1.0` are the same
    /// JSON number and fingerprint alike). Equal to
    /// [`Fingerprint::of`] over the canonical bytes, so any RFC 8785
    /// implementation can recompute it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `value` holds an integer beyond
    /// ±(2^53 − 1). RFC 8785 reads every number as an IEEE 754 double, so two
    /// such integers that differ could share a fingerprint; pass large ids
    /// as strings (I-JSON, RFC 7493 §2.2, says the same). Only integers that
    /// fit 64 bits are seen as integers: serde_json holds a longer one, or
    /// one written with a fraction or an exponent, as a double, which is
    /// taken like any float (RFC 8785's own examples hold `1E30`), so
    /// `18446744073709551617` and `18446744073709551616` share a
    /// fingerprint.
    pub fn of_json(value: &serde_json::Value) -> Result<Fingerprint> {
        Fingerprint::from_bytes(canonical_digest(value)?.to_vec())
    }
}

/// SHA-256 of the RFC 8785 canonical bytes of `value`.
fn canonical_digest(value: &serde_json::Value) -> Result<[u8; 32]> {
    check_numbers(value)?;
    digest_of_canonical(value)
}

/// SHA-256 of the RFC 8785 canonical bytes of what `value` serializes to,
/// written straight from it (no `serde_json::Value` is built). Numbers are
/// not checked: the caller runs [`check_numbers`] on every value it holds.
pub(crate) fn digest_of_canonical<T: serde::Serialize>(value: &T) -> Result<[u8; 32]> {
    let bytes = serde_json_canonicalizer::to_vec(value)
        .map_err(|e| Error::invalid("json", format!("cannot canonicalize: {e}")))?;
    Ok(Sha256::digest(&bytes).into())
}

/// Refuses integers that an IEEE 754 double cannot hold exactly.
pub(crate) fn check_numbers(value: &serde_json::Value) -> Result<()> {
    use serde_json::Value;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::Number(n) => {
                let too_big = match (n.as_u64(), n.as_i64()) {
                    (Some(u), _) => u > MAX_SAFE_INTEGER,
                    (None, Some(i)) => i.unsigned_abs() > MAX_SAFE_INTEGER,
                    (None, None) => false,
                };
                if too_big {
                    return Err(Error::invalid(
                        "json",
                        format!(
                            "integer {n} is beyond ±(2^53 - 1), which RFC 8785 cannot \
                             represent exactly; send it as a string"
                        ),
                    ));
                }
            }
            Value::Array(items) => stack.extend(items),
            Value::Object(members) => stack.extend(members.values()),
            Value::Null | Value::Bool(_) | Value::String(_) => {}
        }
    }
    Ok(())
}

fn check_task(task_id: &str) -> Result<()> {
    check_nonempty("task id", task_id)?;
    if task_id.contains(SEPARATOR) {
        return Err(Error::InvalidKey {
            reason: format!("task id contains the separator '{SEPARATOR}'"),
        });
    }
    Ok(())
}

fn check_nonempty(what: &str, part: &str) -> Result<()> {
    if part.is_empty() {
        return Err(Error::InvalidKey {
            reason: format!("{what} is empty"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_bytes_follow_rfc_8785() {
        // The example of RFC 8785 §3.2.2, numbers and escapes included.
        let v: serde_json::Value = serde_json::from_str(
            r#"{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],
               "string":"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
               "literals":[null,true,false]}"#,
        )
        .unwrap();
        let canonical = serde_json_canonicalizer::to_string(&v).unwrap();
        assert_eq!(
            canonical,
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
        assert_eq!(
            Fingerprint::of_json(&v).unwrap(),
            Fingerprint::of(canonical.as_bytes())
        );
    }

    #[test]
    fn unsafe_integers_are_refused() {
        assert!(Fingerprint::of_json(&json!({"id": 9_007_199_254_740_991_u64})).is_ok());
        assert!(Fingerprint::of_json(&json!({"id": 9_007_199_254_740_992_u64})).is_err());
        assert!(Fingerprint::of_json(&json!([-9_007_199_254_740_992_i64])).is_err());
        // Beyond 64 bits serde_json holds a double: compared as one, as
        // documented, like RFC 8785's `1E30`.
        let parse = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
        assert_eq!(
            Fingerprint::of_json(&parse(r#"{"id": 18446744073709551617}"#)).unwrap(),
            Fingerprint::of_json(&parse(r#"{"id": 18446744073709551616}"#)).unwrap()
        );
        assert!(Fingerprint::of_json(&parse(r#"{"x": 1E30}"#)).is_ok());
    }
}
