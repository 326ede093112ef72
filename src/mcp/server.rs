//! The server side: [`IdempotentServer`], a wrapper around an `rmcp`
//! server that runs each keyed `tools/call` once per key.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rmcp::ErrorData as McpError;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequest, ClientNotification, ClientRequest, ErrorData, JsonObject, ProtocolVersion,
    ServerCapabilities, ServerConfig, ServerResult,
};
use rmcp::service::{NotificationContext, RequestContext, RoleServer, Service};

use super::codes;
use super::options::McpOptions;
use super::outcome::classify;
use super::request;
use crate::agent::{ExecuteError, ExecuteOptions, Origin};
use crate::error::Error;
use crate::record::Lease;
use crate::store::Store;

/// The capability the layer announces: `"tools.idempotency"`, SEP-3182's
/// name for it.
///
/// The SEP puts it at `capabilities.tools.idempotency`; `rmcp` 3.11's
/// `ToolsCapability` has no room for other members, so this wrapper
/// announces it as `capabilities.experimental["tools.idempotency"]` (an
/// empty object), in the initialize and discover results and in
/// [`Service::get_info`]. The proxy (`idemstore mcp-proxy`), which sees the
/// raw messages, also writes it where the SEP says
/// ([`sep_key_to_meta`](super::sep_key_to_meta)). A client checks either
/// place with [`announces_idempotency`](super::announces_idempotency).
pub const CAPABILITY: &str = "tools.idempotency";

/// Adds [`CAPABILITY`] to `capabilities` (under `experimental`).
pub fn announce(capabilities: &mut ServerCapabilities) {
    capabilities
        .experimental
        .get_or_insert_with(Default::default)
        .insert(CAPABILITY.to_string(), JsonObject::new());
}

/// An `rmcp` server whose `tools/call` requests that carry an idempotency
/// key run the tool at most once per key, over any [`Store`] (embedded or
/// PostgreSQL).
///
/// Serve it where the wrapped server would be served
/// (`IdempotentServer::new(server, store).serve(transport)`). For each
/// `tools/call`:
///
/// 1. **No key** (no `_meta.idempotencyKey`, see
///    [`META_KEY`](super::META_KEY)): passed through unchanged, as SEP-3182
///    makes the key optional. So are calls to tools annotated
///    `readOnlyHint: true` (by [`ServerHandler::get_tool`] or the last
///    `tools/list` answer), and multi-round-trip continuations (calls
///    carrying `inputResponses` or `requestState`, which the SEP leaves
///    out of its scope).
/// 2. **Key**: the call claims the store key (scope `mcp/{tool}`, see
///    [`McpOptions`]) with the fingerprint of the tool name and the
///    RFC 8785 canonical arguments, and runs
///    [`Store::execute_async`] around the wrapped server's handling of the
///    call:
///    - first call: the tool runs; its answer is recorded (see below) and
///      returned;
///    - finished call with the same arguments: the recorded
///      `CallToolResult` (or task handle) is replayed; nothing runs;
///    - the same key with other arguments:
///      [`KEY_CONFLICT`](super::KEY_CONFLICT) (the scope holds the tool
///      name, so the same key on another tool is another call);
///    - the key is held by a call still running:
///      [`IN_PROGRESS`](super::IN_PROGRESS) with `data.retryAfterMs`;
///    - the holder disappeared without an outcome:
///      [`IN_DOUBT`](super::IN_DOUBT), or a rerun with
///      [`McpOptions::rerun_in_doubt`];
///    - a malformed key: Invalid params (−32602);
///    - the store failed before the tool ran:
///      [`STORE_FAILED`](super::STORE_FAILED);
///    - the layer's options are invalid (a lease out of range), or the
///      store was opened read-only ([`Config::read_only`](crate::Config::read_only)):
///      Internal error (−32603), which no retry helps.
///
/// What is recorded follows the split of [`Store::execute`]: a result is
/// recorded and replayed; a result with `isError: true` is a permanent
/// failure, replayed as it was (unless
/// [`McpOptions::retryable_tool_error`] says it may run again); a JSON-RPC
/// error of the wrapped server is a retryable failure: recorded, not
/// replayed, and the next call with the key runs the tool again. The
/// exception is a JSON-RPC error with the code [`IN_DOUBT`](super::IN_DOUBT):
/// the wrapped server says it does not know whether the tool acted (a
/// proxy whose server died or answered garbage mid-call, say). Nothing is
/// recorded and that error is answered: the key stays in progress until
/// its lease lapses, and is then in doubt, as after a crash. A JSON-RPC
/// error answered after the call was cancelled (the client sent
/// `notifications/cancelled`, or its connection closed and `rmcp`
/// cancelled its calls, 5 s after the close; or this server's own
/// `RunningService::cancel`) is taken the same way, whatever its code: a
/// tool that stops when cancelled may have acted first, and this layer
/// cannot tell it from a tool that ignores cancellation, whose error after
/// a cancel is left in doubt too. A tool that knows it did not act can
/// answer a tool error that [`McpOptions::retryable_tool_error`] marks
/// retryable instead. (`idemstore mcp-proxy` lets a call finish after a
/// cancel and does not tell its server, so its server's errors keep their
/// meaning there.) When the
/// tool ran in this call, its own answer is returned even if recording it
/// failed (the failure is logged; later calls then find the key in progress
/// and, after the lease, in doubt).
///
/// Everything else (initialize, `tools/list`, resources, prompts,
/// notifications) goes to the wrapped server unchanged, except that the
/// initialize and discover results announce [`CAPABILITY`].
pub struct IdempotentServer<S> {
    inner: S,
    store: Arc<Store>,
    options: McpOptions,
    /// Tool name → `readOnlyHint`, from the last `tools/list` answer.
    read_only: Mutex<HashMap<String, bool>>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for IdempotentServer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentServer")
            .field("inner", &self.inner)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: ServerHandler> IdempotentServer<S> {
    /// Wraps `inner`, recording calls in `store`, with the default
    /// [`McpOptions`].
    pub fn new(inner: S, store: Arc<Store>) -> Self {
        Self::with_options(inner, store, McpOptions::new())
    }

    /// Wraps `inner` with `options`.
    pub fn with_options(inner: S, store: Arc<Store>, options: McpOptions) -> Self {
        IdempotentServer {
            inner,
            store,
            options,
            read_only: Mutex::new(HashMap::new()),
        }
    }

    /// The wrapped server.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn is_read_only(&self, tool: &str) -> bool {
        if let Some(hint) = self
            .inner
            .get_tool(tool)
            .and_then(|t| t.annotations)
            .and_then(|a| a.read_only_hint)
        {
            return hint;
        }
        self.read_only.lock().get(tool).copied().unwrap_or(false)
    }

    async fn call_tool(
        &self,
        call: CallToolRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<ServerResult, McpError> {
        let params = &call.params;
        let idempotency_key = match request::idempotency_key(params, &context.meta) {
            Ok(Some(key)) => key,
            Ok(None) => return self.pass(call, context).await,
            Err(e) => return Err(codes::invalid_key(key_problem(e))),
        };
        if params.input_responses.is_some() || params.request_state.is_some() {
            tracing::debug!(tool = %params.name, "a multi-round-trip continuation passes through");
            return self.pass(call, context).await;
        }
        if self.is_read_only(&params.name) {
            return self.pass(call, context).await;
        }
        let tool = params.name.to_string();
        let client = self
            .options
            .client_identity
            .as_ref()
            .and_then(|identify| identify(&context));
        let key = request::store_key(
            &self.options.scope_prefix,
            client.as_deref(),
            &tool,
            &idempotency_key,
        )
        .map_err(|e| codes::invalid_key(key_problem(e)))?;
        let fingerprint = request::fingerprint(&tool, params.arguments.as_ref())
            .map_err(|e| ErrorData::invalid_params(e.to_string(), None))?;

        let mut options = ExecuteOptions::new().wait(self.options.wait);
        if let Some(lease) = self.options.lease {
            options = options.lease(lease);
        }
        if self.options.rerun_in_doubt {
            options = options.rerun_in_doubt();
        }
        let retryable = self.options.retryable_tool_error.clone();
        let mut fresh: Option<Result<ServerResult, ErrorData>> = None;
        let inner = &self.inner;
        let slot = &mut fresh;
        // An answer of unknown outcome (IN_DOUBT from the wrapped server)
        // leaves the run: dropping `execute_async` while its work runs
        // records nothing, and the key stays in progress under its lease.
        let (doubt_tx, doubt_rx) = tokio::sync::oneshot::channel::<ErrorData>();
        let run =
            self.store
                .execute_async(&key, &fingerprint, options, async move |_lease: &Lease| {
                    let cancelled = context.ct.clone();
                    let answer = Service::handle_request(
                        inner,
                        ClientRequest::CallToolRequest(call),
                        context,
                    )
                    .await;
                    // A JSON-RPC error is a retryable failure, but not one
                    // answered after the call was cancelled (the client's
                    // notifications/cancelled, or its connection closed): a
                    // tool that stops when cancelled may have acted first.
                    if let Err(error) = &answer
                        && (error.code.0 == codes::IN_DOUBT || cancelled.is_cancelled())
                    {
                        let _ = doubt_tx.send(error.clone());
                        return std::future::pending().await;
                    }
                    let recorded = classify(&answer, |r| retryable.as_ref().is_some_and(|f| f(r)));
                    *slot = Some(answer);
                    recorded
                });
        let doubt = async {
            match doubt_rx.await {
                Ok(error) => Err(error),
                // The work finished (or never ran): the run answers.
                Err(_) => std::future::pending().await,
            }
        };
        let outcome = match futures_lite::future::or(async { Ok(run.await) }, doubt).await {
            Ok(outcome) => outcome,
            Err(error) => {
                tracing::warn!(
                    key = %key,
                    code = error.code.0,
                    "the tool may have acted (an answer of unknown outcome, or an error after \
                     the call was cancelled): nothing is recorded, and the key is in doubt once \
                     its lease lapses"
                );
                return Err(error);
            }
        };

        // When the tool ran in this call, its own answer goes back.
        if let Some(answer) = fresh {
            if let Err(e) = &outcome
                && !matches!(e, ExecuteError::Failed { .. })
            {
                tracing::error!(key = %key, error = %e, "the tool ran but its outcome was not recorded");
            }
            return answer;
        }
        match outcome {
            Ok(executed) => {
                if executed.origin() != Origin::Replayed {
                    tracing::warn!(key = %key, origin = ?executed.origin(), "an outcome without an answer");
                }
                Ok(executed.into_value().into_answer())
            }
            Err(ExecuteError::Failed { error, .. }) => error.into_answer(),
            Err(ExecuteError::StillInProgress { lease_until_ms, .. }) => Err(codes::in_progress(
                &idempotency_key,
                retry_after(lease_until_ms),
            )),
            // NotRecorded comes only from a run in this call, whose own
            // answer went back above; matched here so that any other path
            // to it is in doubt, never "retry with the same key".
            Err(e @ (ExecuteError::InDoubt { .. } | ExecuteError::NotRecorded { .. })) => {
                // Its message names the `idemstore resolve` that records
                // what happened (with the refusing call's own token): for
                // the operator, in the log.
                tracing::warn!(key = %key, error = %e, "the call is in doubt; a person decides");
                Err(codes::in_doubt(&idempotency_key))
            }
            Err(ExecuteError::Store(Error::FingerprintMismatch { .. })) => {
                Err(codes::key_conflict(&idempotency_key, &tool))
            }
            Err(ExecuteError::Store(Error::InvalidKey { reason })) => {
                Err(codes::invalid_key(reason))
            }
            // The layer's own options (a lease out of range): no retry
            // helps, so not STORE_FAILED ("retry with the same key").
            Err(ExecuteError::Store(e @ Error::InvalidArgument { .. })) => {
                tracing::error!(key = %key, error = %e, "the idempotency layer's options are invalid");
                Err(codes::layer_failed(
                    &idempotency_key,
                    format!("the idempotency layer's options are invalid: {e}"),
                ))
            }
            // A store opened read-only: nothing can be recorded until it is
            // opened to write, so not STORE_FAILED either.
            Err(ExecuteError::Store(e @ Error::ReadOnly { .. })) => {
                tracing::error!(key = %key, error = %e, "the idempotency store is read-only");
                Err(codes::layer_failed(
                    &idempotency_key,
                    format!("the idempotency store cannot record calls: {e}"),
                ))
            }
            Err(e) => {
                tracing::error!(key = %key, error = %e, "idempotency store failed");
                let transient = matches!(&e, ExecuteError::Store(s) if s.is_transient());
                let retry_after = transient.then_some(self.options.unavailable_retry_after);
                Err(codes::store_failed(&idempotency_key, retry_after))
            }
        }
    }

    async fn pass(
        &self,
        call: CallToolRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<ServerResult, McpError> {
        Service::handle_request(&self.inner, ClientRequest::CallToolRequest(call), context).await
    }
}

/// The time from now until `lease_until_ms` (ms since the epoch), at least
/// 1 ms: a hint, read on this machine's wall clock.
fn retry_after(lease_until_ms: u64) -> Duration {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Duration::from_millis(lease_until_ms.saturating_sub(now_ms).max(1))
}

impl<S: ServerHandler> Service<RoleServer> for IdempotentServer<S> {
    async fn handle_request(
        &self,
        request: ClientRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<ServerResult, McpError> {
        match request {
            ClientRequest::CallToolRequest(call) => self.call_tool(call, context).await,
            other => {
                let mut answer = Service::handle_request(&self.inner, other, context).await?;
                match &mut answer {
                    ServerResult::InitializeResult(result) => announce(&mut result.capabilities),
                    ServerResult::DiscoverResult(result) => announce(&mut result.capabilities),
                    ServerResult::ListToolsResult(list) => {
                        let mut read_only = self.read_only.lock();
                        for tool in &list.tools {
                            let hint = tool
                                .annotations
                                .as_ref()
                                .and_then(|a| a.read_only_hint)
                                .unwrap_or(false);
                            read_only.insert(tool.name.to_string(), hint);
                        }
                    }
                    _ => {}
                }
                Ok(answer)
            }
        }
    }

    async fn handle_notification(
        &self,
        notification: ClientNotification,
        context: NotificationContext<RoleServer>,
    ) -> Result<(), McpError> {
        Service::handle_notification(&self.inner, notification, context).await
    }

    fn get_info(&self) -> ServerConfig {
        let mut info = ServerHandler::get_info(&self.inner);
        announce(&mut info.capabilities);
        info
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Service::supported_protocol_versions(&self.inner)
    }
}

/// What is wrong with a request's idempotency key, without the error's
/// own "invalid idempotency key" prefix, which [`codes::invalid_key`] adds.
fn key_problem(error: crate::Error) -> String {
    match error {
        crate::Error::InvalidKey { reason } => reason,
        other => other.to_string(),
    }
}
