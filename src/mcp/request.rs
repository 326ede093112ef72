//! What the layer reads from a `tools/call`: the idempotency key, the
//! store key it scopes, and the fingerprint of the call.

use rmcp::model::{CallToolRequestParams, JsonObject, RequestMetaObject};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::agent::keys::{check_numbers, digest_of_canonical};
use crate::error::Error;
use crate::key::{Fingerprint, Key, MAX_ID_LEN, MAX_SCOPE_LEN};

/// The member of a `tools/call` request's `_meta` that carries the
/// idempotency key: `"idempotencyKey"`, the name SEP-3182 gives the field.
///
/// The SEP places `idempotencyKey` in `params`, beside `arguments`; `rmcp`
/// 3.11 drops members of `params` it does not know while it parses a
/// request, so a handler cannot see it there. A client of this crate puts
/// the key in `params._meta` (see [`attach_key`](super::attach_key)); a
/// client that follows the SEP to the letter is served by the proxy
/// (`idemstore mcp-proxy`), which moves `params.idempotencyKey` into
/// `_meta` before `rmcp` parses the request
/// ([`sep_key_to_meta`](super::sep_key_to_meta)). MCP leaves unprefixed
/// `_meta` names to applications.
pub const META_KEY: &str = "idempotencyKey";

/// The idempotency key of a call, if it carries one: `params._meta`'s
/// [`META_KEY`] first, then the request's `_meta` as `rmcp` hands it to
/// handlers.
///
/// # Errors
/// [`Error::InvalidKey`] when the member is present but is not a string.
pub(crate) fn idempotency_key(
    params: &CallToolRequestParams,
    request_meta: &RequestMetaObject,
) -> Result<Option<String>, Error> {
    // `null` reads as absent, as rmcp reads `"_meta": null`: many
    // serializers write an absent optional field so.
    let found = params
        .meta
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .filter(|v| !v.is_null())
        .or_else(|| request_meta.get(META_KEY).filter(|v| !v.is_null()));
    match found {
        None => Ok(None),
        Some(Value::String(key)) => Ok(Some(key.clone())),
        Some(other) => Err(Error::InvalidKey {
            reason: format!("{META_KEY} must be a string, not {}", json_type_name(other)),
        }),
    }
}

fn json_type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The store key of a call: scope `{prefix}{tool}`, or
/// `{prefix}{client}/{tool}` when the transport names the client, where
/// `{client}` is the first 16 hex digits of the SHA-256 of the client's
/// identity (so that an identity of any length and alphabet fits the
/// scope's 128 bytes, and two clients never share a key); id the
/// idempotency key as sent (1 to 255 bytes, no control characters, as
/// Stripe and the IETF draft bound it).
///
/// A call with no client named whose tool name starts as a client's part
/// does (16 lowercase hex digits and `/`) is refused: its scope would be
/// that client's, and an anonymous request could reach (and block) the
/// keys of an identified one on a server with `client_identity`.
///
/// # Errors
/// [`Error::InvalidKey`] when the key or the scope breaks the rules of
/// [`Key::new`] (a tool name too long for the scope included), or for a
/// tool name that would pose as a client's scope, as above.
pub(crate) fn store_key(
    prefix: &str,
    client: Option<&str>,
    tool: &str,
    idempotency_key: &str,
) -> Result<Key, Error> {
    if idempotency_key.len() > MAX_ID_LEN {
        return Err(Error::InvalidKey {
            reason: format!(
                "the key is {} bytes, over the limit of {MAX_ID_LEN}",
                idempotency_key.len()
            ),
        });
    }
    let scope = match client {
        None if poses_as_client(tool) => {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the tool name {tool:?} starts as a client's part of a scope does (16 hex \
                     digits and `/`): a keyed call to it needs a client identity"
                ),
            });
        }
        None => format!("{prefix}{tool}"),
        Some(client) => {
            let digest = Sha256::digest(client.as_bytes());
            let mut hex = String::with_capacity(16);
            for b in &digest[..8] {
                hex.push_str(&format!("{b:02x}"));
            }
            format!("{prefix}{hex}/{tool}")
        }
    };
    if scope.len() > MAX_SCOPE_LEN {
        return Err(Error::InvalidKey {
            reason: format!(
                "the tool name {tool:?} makes a scope of {} bytes, over the limit of {MAX_SCOPE_LEN}",
                scope.len()
            ),
        });
    }
    Key::new(scope, idempotency_key)
}

/// Whether `tool` starts with what `store_key` puts before the tool name
/// for a named client: 16 lowercase hex digits and `/`.
fn poses_as_client(tool: &str) -> bool {
    let bytes = tool.as_bytes();
    bytes.len() > 16
        && bytes[16] == b'/'
        && bytes[..16]
            .iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

/// The fingerprint of a call: the RFC 8785 canonical form of
/// `{"name": tool, "arguments": arguments}` (what [`Fingerprint::of_json`]
/// gives for that object), so that member order never matters and any
/// other difference does. Absent arguments count as `{}`. The canonical
/// bytes are written from the request as it is: the arguments, up to the
/// transport's request limit, are not copied into another JSON tree.
///
/// # Errors
/// [`Error::InvalidArgument`] when the arguments hold an integer beyond
/// ±(2^53 − 1), which RFC 8785 cannot represent exactly.
pub(crate) fn fingerprint(
    tool: &str,
    arguments: Option<&JsonObject>,
) -> Result<Fingerprint, Error> {
    let none = JsonObject::new();
    let arguments = arguments.unwrap_or(&none);
    for value in arguments.values() {
        check_numbers(value)?;
    }
    let digest = digest_of_canonical(&ToolCall { tool, arguments })?;
    Fingerprint::from_bytes(digest.to_vec())
}

/// `{"name": tool, "arguments": arguments}`, borrowed, for the fingerprint.
struct ToolCall<'a> {
    tool: &'a str,
    arguments: &'a JsonObject,
}

impl serde::Serialize for ToolCall<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut object = serializer.serialize_map(Some(2))?;
        object.serialize_entry("name", self.tool)?;
        object.serialize_entry("arguments", self.arguments)?;
        object.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn clients_and_tools_get_their_own_scopes() {
        let a = store_key("mcp/", None, "append", "k1").unwrap();
        assert_eq!(a.scope(), "mcp/append");
        let b = store_key("mcp/", Some("alice"), "append", "k1").unwrap();
        let c = store_key("mcp/", Some("bob"), "append", "k1").unwrap();
        assert_ne!(b.scope(), c.scope());
        assert!(b.scope().starts_with("mcp/") && b.scope().ends_with("/append"));
        assert!(store_key("mcp/", None, &"t".repeat(200), "k1").is_err());
        assert!(store_key("mcp/", None, "append", &"k".repeat(256)).is_err());
        assert!(store_key("mcp/", None, "append", "").is_err());
        assert!(store_key("mcp/", None, "append", "a\nb").is_err());
        // A tool name that would make an anonymous call's scope a client's
        // is refused; an identified client may call it (its scope is its
        // own), and other names with a `/` are fine.
        let posing = format!("{}/append", &b.scope()["mcp/".len().."mcp/".len() + 16]);
        assert_eq!(format!("mcp/{posing}"), b.scope());
        assert!(matches!(
            store_key("mcp/", None, &posing, "k1"),
            Err(Error::InvalidKey { .. })
        ));
        assert!(store_key("mcp/", Some("carol"), &posing, "k1").is_ok());
        assert!(store_key("mcp/", None, "tickets/create", "k1").is_ok());
        assert!(store_key("mcp/", None, "0123456789abcdeF/x", "k1").is_ok());
    }

    #[test]
    fn fingerprints_ignore_member_order_only() {
        let one = json!({"a": 1, "b": [1, 2]});
        let two = json!({"b": [1, 2], "a": 1});
        let object = |v: serde_json::Value| v.as_object().cloned().unwrap();
        assert_eq!(
            fingerprint("t", Some(&object(one.clone()))).unwrap(),
            fingerprint("t", Some(&object(two))).unwrap()
        );
        assert_ne!(
            fingerprint("t", Some(&object(one.clone()))).unwrap(),
            fingerprint("u", Some(&object(one))).unwrap()
        );
        assert_eq!(
            fingerprint("t", None).unwrap(),
            fingerprint("t", Some(&JsonObject::new())).unwrap()
        );
        assert!(fingerprint("t", Some(&object(json!({"n": 9_007_199_254_740_993_u64})))).is_err());
        assert!(
            fingerprint(
                "t",
                Some(&object(json!({"a": [{"n": -9_007_199_254_740_993_i64}]})))
            )
            .is_err()
        );
    }

    #[test]
    fn a_fingerprint_is_that_of_the_call_as_one_json_object() {
        // Written from the borrowed request, it must equal what
        // `Fingerprint::of_json` gives for the object, which is the
        // documented rule (and what an earlier build stored).
        let calls = [
            json!({}),
            json!({"line": "x"}),
            json!({"é": 1.5, "b": [true, null, {"z": 1, "a": "\u{1F600}\n"}], "a": -0.0}),
            json!({"name": "shadow", "arguments": {"x": 1e30}}),
        ];
        for arguments in calls {
            let members = arguments.as_object().unwrap();
            for tool in ["append", "", "ünï/côde"] {
                assert_eq!(
                    fingerprint(tool, Some(members)).unwrap(),
                    Fingerprint::of_json(&json!({"name": tool, "arguments": arguments})).unwrap(),
                    "{tool} {arguments}"
                );
            }
        }
    }
}
