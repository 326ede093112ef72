//! The JSON-RPC errors the layer answers, and their codes.
//!
//! JSON-RPC 2.0 (§5.1) leaves −32000 to −32099 to the implementation for
//! server errors. The layer uses −32040 to −32043, none of which MCP or
//! `rmcp` assigns. Every such error the layer makes carries a `data`
//! object whose `reason` member names the case in words, so that a client
//! can tell them apart without knowing the codes, and whose
//! `idempotencyKey` member repeats the key, for a person to follow up
//! with. (An [`IN_DOUBT`] answered by the wrapped server itself is passed
//! on with that server's `data`.)

use std::time::Duration;

use rmcp::model::{ErrorCode, ErrorData};
use serde_json::json;

/// A call with this key is still running under a valid lease (the IETF
/// Idempotency-Key draft's HTTP 409). `data.retryAfterMs` (whole
/// milliseconds, at least 1) is when the current lease ends: retry then,
/// with the same key and arguments.
pub const IN_PROGRESS: i32 = -32040;

/// The key was used before for the same tool with other arguments (keys
/// are scoped per tool: the same key on another tool is another call) (the
/// SEP's conflict on a reused key; the draft's HTTP 422). Nothing ran.
/// Retrying with the same key never succeeds: the key is bound to the first
/// call's arguments until its record is forgotten (retention, 24 h by
/// default).
pub const KEY_CONFLICT: i32 = -32041;

/// An earlier call with this key started and its holder disappeared before
/// recording an outcome (a crash, a cut connection to the store), so the
/// tool may or may not have acted; the policy is to refuse rather than run
/// it again. Nothing ran. A person decides (the `idemstore resolve
/// --while-held` command the layer logs records what happened: the lease
/// it names is this refusal's own); until then every retry answers this, or
/// [`IN_PROGRESS`] while this refusal's own lease lasts.
///
/// A wrapped server may answer a `tools/call` with this code to say that
/// it does not know whether its tool acted (its own backend died
/// mid-call, say): [`IdempotentServer`](super::IdempotentServer) then
/// records nothing, and the key stays in progress until its lease lapses,
/// then in doubt, as after a crash (`idemstore mcp-proxy` answers so when
/// the server behind it dies or answers garbage after the call was sent).
pub const IN_DOUBT: i32 = -32042;

/// The idempotency store failed (I/O, corruption, an unreachable
/// database) before the tool ran. Retry with the same key once the store is
/// back. `data.transient` says whether it comes back on its own
/// ([`Error::is_transient`](crate::Error::is_transient): the database
/// unreachable, or a claim's answer lost), in which case `data.retryAfterMs` (whole milliseconds, at least 1;
/// [`McpOptions::unavailable_retry_after`](super::McpOptions::unavailable_retry_after))
/// is a hint of when to retry; `false` means that an operator must act
/// first (a misconfigured or damaged store, or one that refuses writes
/// until it is reopened), and a retry before then gets this error again.
/// If the claim was applied but its answer lost (on PostgreSQL, a failure
/// after its `COMMIT` was sent), the retry finds the key in progress
/// ([`IN_PROGRESS`]) until the claim's lease lapses, then in doubt
/// ([`IN_DOUBT`]): the store cannot tell a lost answer from a crash mid-call
/// (`docs/mcp.md`, "What is and is not safe").
pub const STORE_FAILED: i32 = -32043;

/// The `data.reason` of each error, in words.
pub(crate) mod reason {
    pub(crate) const IN_PROGRESS: &str = "idempotency key in progress";
    pub(crate) const KEY_CONFLICT: &str = "idempotency key reused with different arguments";
    pub(crate) const IN_DOUBT: &str = "idempotency key in doubt";
    pub(crate) const STORE_FAILED: &str = "idempotency store failed";
    pub(crate) const INVALID_KEY: &str = "invalid idempotency key";
    pub(crate) const LAYER_FAILED: &str = "idempotency layer misconfigured";
}

pub(crate) fn in_progress(key: &str, retry_after: Duration) -> ErrorData {
    let ms = whole_ms(retry_after);
    ErrorData::new(
        ErrorCode(IN_PROGRESS),
        "a call with this idempotency key is in progress; retry later with the same key",
        Some(json!({
            "reason": reason::IN_PROGRESS,
            "idempotencyKey": key,
            "retryAfterMs": ms,
        })),
    )
}

pub(crate) fn key_conflict(key: &str, tool: &str) -> ErrorData {
    ErrorData::new(
        ErrorCode(KEY_CONFLICT),
        "this idempotency key was used with different arguments",
        Some(json!({
            "reason": reason::KEY_CONFLICT,
            "idempotencyKey": key,
            "tool": tool,
        })),
    )
}

pub(crate) fn in_doubt(key: &str) -> ErrorData {
    ErrorData::new(
        ErrorCode(IN_DOUBT),
        "an earlier call with this idempotency key may have acted; it is not run again",
        Some(json!({
            "reason": reason::IN_DOUBT,
            "idempotencyKey": key,
        })),
    )
}

/// [`STORE_FAILED`]; `retry_after` is `Some` for a transient fault.
pub(crate) fn store_failed(key: &str, retry_after: Option<Duration>) -> ErrorData {
    match retry_after {
        Some(retry_after) => ErrorData::new(
            ErrorCode(STORE_FAILED),
            "the idempotency store is unavailable; retry later with the same key",
            Some(json!({
                "reason": reason::STORE_FAILED,
                "idempotencyKey": key,
                "transient": true,
                "retryAfterMs": whole_ms(retry_after),
            })),
        ),
        None => ErrorData::new(
            ErrorCode(STORE_FAILED),
            "the idempotency store failed and needs an operator; retry with the same key once it is repaired",
            Some(json!({
                "reason": reason::STORE_FAILED,
                "idempotencyKey": key,
                "transient": false,
            })),
        ),
    }
}

/// The layer's own fault (its options invalid, or a store opened
/// read-only): JSON-RPC's Internal error (−32603), not
/// [`STORE_FAILED`] ("retry with the same key"), since no request
/// succeeds until an operator changes the configuration. `data.transient:
/// false` says so, and `call_tool_once` stops on it.
pub(crate) fn layer_failed(key: &str, message: String) -> ErrorData {
    ErrorData::internal_error(
        message,
        Some(json!({
            "reason": reason::LAYER_FAILED,
            "idempotencyKey": key,
            "transient": false,
        })),
    )
}

/// A duration in whole milliseconds, at least 1.
fn whole_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A malformed key: JSON-RPC's own Invalid params (−32602), as the draft
/// answers a malformed `Idempotency-Key` with HTTP 400.
pub(crate) fn invalid_key(detail: String) -> ErrorData {
    ErrorData::invalid_params(
        format!("invalid idempotency key: {detail}"),
        Some(json!({ "reason": reason::INVALID_KEY })),
    )
}
