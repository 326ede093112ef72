//! The client side: attach the stable tool-call key to a `tools/call`, and
//! retry it with the `agent` feature's query-before-retry policy.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ErrorCode, ErrorData, RequestMetaObject,
    ServerCapabilities,
};
use rmcp::service::{Peer, RoleClient, RunningService, Service, ServiceError};
use serde_json::Value;

use super::codes;
use super::request::META_KEY;
use super::server::CAPABILITY;
use crate::agent::{CallError, RemoteError, RemoteStatus, RetryPolicy, call_async};
use crate::key::Key;

/// Puts the id of `key` (for an agent, [`Key::for_tool_call`]'s
/// `task_id:tool_call_id`) into `params._meta.idempotencyKey`
/// ([`META_KEY`]), replacing any key already there. The key's scope stays
/// on the client: the server scopes keys by tool (and client) itself.
///
/// ```
/// use idemstore::Key;
/// use idemstore::mcp::attach_key;
/// use rmcp::model::CallToolRequestParams;
///
/// let key = Key::for_tool_call("acme/agent", "task-42", "call_7")?;
/// let params = attach_key(CallToolRequestParams::new("tickets.create"), &key);
/// assert_eq!(params.meta.unwrap()["idempotencyKey"], "task-42:call_7");
/// # Ok::<(), idemstore::Error>(())
/// ```
pub fn attach_key(mut params: CallToolRequestParams, key: &Key) -> CallToolRequestParams {
    params
        .meta
        .get_or_insert_with(RequestMetaObject::default)
        .insert(META_KEY.to_string(), Value::String(key.id().to_string()));
    params
}

/// Whether a server announced run-once tool calls ([`CAPABILITY`], under
/// `capabilities.experimental`, where [`IdempotentServer`](super::IdempotentServer)
/// and the proxy put it for `rmcp` peers). `rmcp` 3.11 does not keep the
/// SEP's `capabilities.tools.idempotency` when it parses a server's
/// capabilities, so a server that announces it only there is not seen.
pub fn announces_idempotency(capabilities: &ServerCapabilities) -> bool {
    capabilities
        .experimental
        .as_ref()
        .is_some_and(|e| e.contains_key(CAPABILITY))
}

/// Why [`call_tool_once`] got no result from one request. Carried by
/// [`CallError`].
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ToolCallError {
    /// `connect` failed (the message is its error).
    #[error("cannot connect to the MCP server: {0}")]
    Connect(String),
    /// The server answered with a JSON-RPC error.
    #[error("the MCP server answered error {}: {}", .0.code.0, .0.message)]
    Rpc(ErrorData),
    /// A request after a lost answer would have gone to a server that does
    /// not announce [`CAPABILITY`]: it could run the tool twice, so the
    /// call stops instead (in doubt).
    #[error("the MCP server does not announce {CAPABILITY}: a retry could run the tool twice")]
    NotAnnounced,
    /// The server's answer was not a tool result, or the client failed in
    /// a way that is not a lost connection.
    #[error("unexpected answer from the MCP server: {0}")]
    Unexpected(String),
}

/// One request of the call, waiting for its answer at most until `budget`
/// has passed since `started` (the policy's deadline): no answer by then
/// is a lost answer (the connection is dropped), so a server that never
/// answers cannot hold the call past its deadline. A timeout before the
/// request went out (still connecting, or in `initialize`) sent nothing:
/// it is a failed connection, not a call in doubt.
async fn bounded_attempt<S, C, F>(
    connection: &Mutex<Option<RunningService<RoleClient, S>>>,
    connect: &C,
    params: &CallToolRequestParams,
    sent: Sent<'_>,
    (started, budget): (Instant, Duration),
) -> Result<CallToolResult, Sorted>
where
    S: Service<RoleClient>,
    C: Fn() -> F,
    F: Future<Output = Result<RunningService<RoleClient, S>, String>>,
{
    let sending = AtomicBool::new(false);
    let timer = async {
        futures_timer::Delay::new(budget.saturating_sub(started.elapsed())).await;
        *connection.lock() = None;
        if sending.load(Ordering::SeqCst) {
            Err(Sorted::Lost)
        } else {
            Err(Sorted::Retry(ToolCallError::Connect(
                "no connection before the call's deadline".into(),
            )))
        }
    };
    futures_lite::future::or(attempt(connection, connect, params, sent, &sending), timer).await
}

/// Whether a request of the call went out before this one: a request
/// after one that was sent goes only to a server that announces the
/// capability.
#[derive(Clone, Copy)]
enum Sent<'a> {
    /// The call's query: a request was sent.
    Before,
    /// A send: `flag` says whether one went out before, and is set once
    /// this one goes out (after `connect` succeeded).
    Track(&'a AtomicBool),
}

/// One request of the call: sends `params` on the current connection
/// (connecting first if there is none) and sorts the answer.
async fn attempt<S, C, F>(
    connection: &Mutex<Option<RunningService<RoleClient, S>>>,
    connect: &C,
    params: &CallToolRequestParams,
    sent: Sent<'_>,
    sending: &AtomicBool,
) -> Result<CallToolResult, Sorted>
where
    S: Service<RoleClient>,
    C: Fn() -> F,
    F: Future<Output = Result<RunningService<RoleClient, S>, String>>,
{
    let current: Option<Peer<RoleClient>> = connection.lock().as_ref().map(|s| s.peer().clone());
    let peer = match current {
        Some(peer) => peer,
        None => {
            let service = connect()
                .await
                .map_err(|e| Sorted::Retry(ToolCallError::Connect(e)))?;
            let peer = service.peer().clone();
            *connection.lock() = Some(service);
            peer
        }
    };
    // A failed `connect` sent nothing: only a request that goes out counts.
    let later = match sent {
        Sent::Before => true,
        Sent::Track(flag) => flag.swap(true, Ordering::Relaxed),
    };
    if later {
        let announced = peer
            .peer_info()
            .is_some_and(|info| announces_idempotency(&info.capabilities));
        if !announced {
            return Err(Sorted::Stop(ToolCallError::NotAnnounced));
        }
    }
    sending.store(true, Ordering::SeqCst);
    match peer.call_tool(params.clone()).await {
        Ok(result) => Ok(result),
        Err(ServiceError::McpError(error)) => Err(sort_rpc(error)),
        Err(
            ServiceError::TransportClosed
            | ServiceError::TransportSend(_)
            | ServiceError::Timeout { .. }
            | ServiceError::Cancelled { .. },
        ) => {
            // The connection is gone or the answer lost: the next request
            // connects again.
            *connection.lock() = None;
            Err(Sorted::Lost)
        }
        // The request went out and something other than its result came
        // back (a task handle, or an input-required continuation, which
        // rmcp's `call_tool` does not take): the tool may have started.
        Err(other) => Err(Sorted::Doubt(ToolCallError::Unexpected(other.to_string()))),
    }
}

/// How one request ended without a result.
enum Sorted {
    /// No answer: the call may have run.
    Lost,
    /// The key is held by a call still running.
    Busy,
    /// Another request may succeed.
    Retry(ToolCallError),
    /// No request with this key will succeed.
    Stop(ToolCallError),
    /// No request with this key will learn more, and the tool may have
    /// acted: the server said so ([`IN_DOUBT`](super::IN_DOUBT)), or its
    /// answer was not a result.
    Doubt(ToolCallError),
}

fn sort_rpc(error: ErrorData) -> Sorted {
    match error.code {
        ErrorCode(codes::IN_PROGRESS) => Sorted::Busy,
        ErrorCode(codes::IN_DOUBT) => Sorted::Doubt(ToolCallError::Rpc(error)),
        ErrorCode(codes::KEY_CONFLICT)
        | ErrorCode::INVALID_PARAMS
        | ErrorCode::METHOD_NOT_FOUND
        | ErrorCode::INVALID_REQUEST => Sorted::Stop(ToolCallError::Rpc(error)),
        // The store needs an operator: every request gets this answer
        // until then, so the driver stops rather than send until its
        // deadline. (Without `data.transient`, as from an older server,
        // it is sent again.)
        ErrorCode(codes::STORE_FAILED) if says_not_transient(&error) => {
            Sorted::Stop(ToolCallError::Rpc(error))
        }
        // The layer's own fault (its options, a read-only store): no
        // request succeeds until an operator acts. (Another server's
        // Internal error, without `data.transient: false`, is sent again.)
        ErrorCode::INTERNAL_ERROR if says_not_transient(&error) => {
            Sorted::Stop(ToolCallError::Rpc(error))
        }
        _ => Sorted::Retry(ToolCallError::Rpc(error)),
    }
}

/// A request to make again: after at least the server's
/// `data.retryAfterMs` (a whole number of milliseconds, as
/// [`STORE_FAILED`](super::STORE_FAILED) carries it) when its error has
/// one; any other value of that member is not a wait, and is ignored.
fn retryable(error: ToolCallError) -> RemoteError<ToolCallError> {
    let asked = match &error {
        ToolCallError::Rpc(rpc) => rpc
            .data
            .as_ref()
            .and_then(|data| data.get("retryAfterMs"))
            .and_then(Value::as_u64),
        _ => None,
    };
    match asked {
        Some(ms) => RemoteError::RetryAfter {
            error,
            after: Duration::from_millis(ms),
        },
        None => RemoteError::Retryable(error),
    }
}

/// Whether a [`STORE_FAILED`](super::STORE_FAILED) says `data.transient:
/// false`.
fn says_not_transient(error: &ErrorData) -> bool {
    error
        .data
        .as_ref()
        .and_then(|data| data.get("transient"))
        .and_then(Value::as_bool)
        == Some(false)
}

/// Calls a tool once per `key`, across lost answers and new connections:
/// every request carries `key` ([`attach_key`]), and the agent feature's
/// [`call_async`] driver retries by `policy`.
///
/// `connect` opens a connection (an initialized `rmcp` client); it is
/// called before the first request and again after a connection is lost.
/// Each request is sorted as [`call_async`] expects:
///
/// - a result (`isError` or not) → returned;
/// - the connection lost, or no answer by the policy's deadline (each
///   request waits for its answer at most until then, so the deadline must
///   cover the tool's run time; the connection is then dropped) → *in
///   doubt*: the driver
///   asks before it sends again. Over MCP the question is the same request
///   with the same key: a server that announces [`CAPABILITY`] answers it
///   with the recorded result, [`IN_PROGRESS`](super::IN_PROGRESS) (the
///   driver waits and asks again) or, if the first request never arrived,
///   by running the tool. A server that does not announce it is never
///   asked: the call stops with [`ToolCallError::NotAnnounced`], in doubt;
/// - [`IN_PROGRESS`](super::IN_PROGRESS) to a send → treated as in doubt
///   too (another request with the key is running);
/// - [`KEY_CONFLICT`](super::KEY_CONFLICT), Invalid params, Method not
///   found, Invalid request, and [`STORE_FAILED`](super::STORE_FAILED) or
///   Internal error with `data.transient: false` (a store or a layer that
///   needs an operator) → stop ([`CallError::Rejected`]);
/// - [`IN_DOUBT`](super::IN_DOUBT) (an earlier request with the key started
///   and its outcome was never recorded), or an answer that is neither a
///   result nor a JSON-RPC error (a task handle or an input-required
///   continuation, which `rmcp`'s `call_tool` does not take) → stop, in
///   doubt
///   ([`CallError::Rejected`] whose [`is_in_doubt`](CallError::is_in_doubt)
///   is true, on the first request too): the tool may have acted, and no
///   request with the key will say whether;
/// - any other JSON-RPC error, or a failed `connect` (or one still under
///   way at the deadline, which a zero deadline always is) → send again
///   after a delay, or end not in doubt at the deadline: a failed
///   `connect` sent nothing, so the next request is still the call's
///   first. An error with `data.retryAfterMs` (a transient
///   [`STORE_FAILED`](super::STORE_FAILED)) is sent again after at least
///   that many milliseconds ([`RemoteError::RetryAfter`]); when that wait
///   ends past the deadline the call ends at once.
///
/// # Errors
/// [`CallError::Exhausted`] when the policy's attempts or deadline run out
/// (with `in_doubt` saying whether the tool may have run),
/// [`CallError::Rejected`] as above; both carry the key.
pub async fn call_tool_once<S, C, F>(
    key: &Key,
    params: CallToolRequestParams,
    policy: &RetryPolicy,
    connect: C,
) -> Result<CallToolResult, CallError<ToolCallError>>
where
    S: Service<RoleClient>,
    C: Fn() -> F,
    F: Future<Output = Result<RunningService<RoleClient, S>, String>>,
{
    let budget = (Instant::now(), policy.total_deadline());
    let params = attach_key(params, key);
    let connection = Mutex::new(None);
    let sent = AtomicBool::new(false);
    let (connection, connect, params, sent) = (&connection, &connect, &params, &sent);
    call_async(
        key,
        policy,
        async |_key: &Key| {
            bounded_attempt(connection, connect, params, Sent::Track(sent), budget)
                .await
                .map_err(|sorted| match sorted {
                    Sorted::Lost | Sorted::Busy => RemoteError::TimedOut,
                    Sorted::Retry(e) => retryable(e),
                    Sorted::Stop(e) => RemoteError::Permanent(e),
                    Sorted::Doubt(e) => RemoteError::InDoubt(e),
                })
        },
        async |_key: &Key| match bounded_attempt(connection, connect, params, Sent::Before, budget)
            .await
        {
            Ok(result) => Ok(RemoteStatus::Done(result)),
            Err(Sorted::Busy) => Ok(RemoteStatus::InProgress),
            Err(Sorted::Lost) => Err(RemoteError::TimedOut),
            Err(Sorted::Retry(e)) => Err(retryable(e)),
            Err(Sorted::Stop(e)) => Err(RemoteError::Permanent(e)),
            Err(Sorted::Doubt(e)) => Err(RemoteError::InDoubt(e)),
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sorted(error: ErrorData) -> &'static str {
        match sort_rpc(error) {
            Sorted::Lost => "lost",
            Sorted::Busy => "busy",
            Sorted::Retry(_) => "retry",
            Sorted::Stop(_) => "stop",
            Sorted::Doubt(_) => "doubt",
        }
    }

    /// The layer's own Internal error stops the call; another server's,
    /// without `data.transient: false`, is sent again.
    #[test]
    fn the_layers_own_fault_stops_the_call() {
        assert_eq!(sorted(codes::layer_failed("k", "read-only".into())), "stop");
        assert_eq!(sorted(ErrorData::internal_error("oops", None)), "retry");
    }

    /// An answer of unknown outcome stops the call in doubt; a conflict
    /// with the key stops it, not in doubt.
    #[test]
    fn in_doubt_is_told_from_a_refusal() {
        let doubt = ErrorData::new(ErrorCode(codes::IN_DOUBT), "gone mid-call", None);
        assert_eq!(sorted(doubt), "doubt");
        let conflict = ErrorData::new(ErrorCode(codes::KEY_CONFLICT), "reused", None);
        assert_eq!(sorted(conflict), "stop");
    }

    /// A store failure is sent again unless the server says it needs an
    /// operator (`data.transient: false`); one without the member, as from
    /// an older server, is sent again as before.
    #[test]
    fn a_store_failure_is_retried_unless_it_needs_an_operator() {
        let transient = codes::store_failed("k", Some(Duration::from_secs(1)));
        assert_eq!(sorted(transient), "retry");
        assert_eq!(sorted(codes::store_failed("k", None)), "stop");
        let older = ErrorData::new(
            ErrorCode(codes::STORE_FAILED),
            "the idempotency store failed; retry with the same key",
            Some(serde_json::json!({ "reason": "idempotency store failed" })),
        );
        assert_eq!(sorted(older), "retry");
        assert_eq!(
            sorted(codes::in_progress("k", Duration::from_secs(1))),
            "busy"
        );
    }

    /// A store failure's `retryAfterMs` is the least wait before the call
    /// is sent again; a member that is not a whole number of milliseconds
    /// is no wait at all.
    #[test]
    fn a_retry_waits_as_the_server_asks() {
        let asked = |error: ErrorData| match retryable(ToolCallError::Rpc(error)) {
            RemoteError::RetryAfter { after, .. } => Some(after),
            RemoteError::Retryable(_) => None,
            other => panic!("{other:?}"),
        };
        let transient = codes::store_failed("k", Some(Duration::from_millis(1500)));
        assert_eq!(asked(transient), Some(Duration::from_millis(1500)));
        let far = serde_json::json!({ "retryAfterMs": u64::MAX });
        assert_eq!(
            asked(ErrorData::internal_error("busy", Some(far))),
            Some(Duration::from_millis(u64::MAX))
        );
        for hostile in [
            serde_json::json!({ "retryAfterMs": -1 }),
            serde_json::json!({ "retryAfterMs": 1.5 }),
            serde_json::json!({ "retryAfterMs": "1000" }),
            serde_json::json!({ "retryAfterMs": null }),
            serde_json::json!([1000]),
        ] {
            let error = ErrorData::internal_error("busy", Some(hostile.clone()));
            assert_eq!(asked(error), None, "{hostile}");
        }
        assert!(matches!(
            retryable(ToolCallError::Connect("refused".into())),
            RemoteError::Retryable(_)
        ));
    }
}
