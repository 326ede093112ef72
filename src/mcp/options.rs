//! How the server-side layer decides: scope, lease, wait, the in-doubt
//! policy, which tool errors may run again, and who the client is.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::CallToolResult;
use rmcp::service::{RequestContext, RoleServer};

/// Tells a retryable tool error from a permanent one.
type ToolErrorRule = Arc<dyn Fn(&CallToolResult) -> bool + Send + Sync>;
/// Names the client of a request, where the transport knows it.
type ClientIdentity = Arc<dyn Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync>;

/// Options of [`IdempotentServer`](super::IdempotentServer).
///
/// # Defaults
/// - `scope_prefix`: `"mcp/"`; a call's scope is the prefix and the tool
///   name (and the client, see [`McpOptions::client_identity`])
/// - `lease`: the store's lease (30 s unless configured); extended while
///   the tool runs, so it only bounds how long a crashed holder blocks the
///   key
/// - `wait`: zero: a call that finds its key in progress is answered at
///   once with [`IN_PROGRESS`](super::IN_PROGRESS) and a retry hint, rather
///   than holding the client's request open
/// - in doubt: refuse ([`IN_DOUBT`](super::IN_DOUBT)), the at-most-once
///   choice of [`InDoubt::Refuse`](crate::agent::InDoubt::Refuse)
/// - tool errors (`isError: true` results): permanent, recorded and
///   replayed like a result
/// - client identity: none (the scope is per tool only)
/// - `unavailable_retry_after`: 1 second
#[derive(Clone)]
pub struct McpOptions {
    pub(crate) scope_prefix: String,
    pub(crate) lease: Option<Duration>,
    pub(crate) wait: Duration,
    pub(crate) rerun_in_doubt: bool,
    pub(crate) retryable_tool_error: Option<ToolErrorRule>,
    pub(crate) client_identity: Option<ClientIdentity>,
    pub(crate) unavailable_retry_after: Duration,
}

impl fmt::Debug for McpOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpOptions")
            .field("scope_prefix", &self.scope_prefix)
            .field("lease", &self.lease)
            .field("wait", &self.wait)
            .field("rerun_in_doubt", &self.rerun_in_doubt)
            .field("retryable_tool_error", &self.retryable_tool_error.is_some())
            .field("client_identity", &self.client_identity.is_some())
            .field("unavailable_retry_after", &self.unavailable_retry_after)
            .finish()
    }
}

impl Default for McpOptions {
    fn default() -> Self {
        McpOptions {
            scope_prefix: "mcp/".to_string(),
            lease: None,
            wait: Duration::ZERO,
            rerun_in_doubt: false,
            retryable_tool_error: None,
            client_identity: None,
            unavailable_retry_after: Duration::from_secs(1),
        }
    }
}

impl McpOptions {
    /// The defaults (see the type's docs).
    pub fn new() -> Self {
        Self::default()
    }

    /// The prefix of every scope, such as `"acme/mcp/"`, so that one store
    /// can serve several servers. With the tool name (and the client's
    /// 16-digit digest) the scope must fit in
    /// [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN) (128) bytes; a call whose
    /// scope would not fit is answered with Invalid params (−32602).
    #[must_use]
    pub fn scope_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.scope_prefix = prefix.into();
        self
    }

    /// The lease of a call (whole milliseconds,
    /// [`MIN_RENEWED_LEASE`](crate::MIN_RENEWED_LEASE), 100 ms, to
    /// [`MAX_LEASE`](crate::MAX_LEASE); out of that range every keyed call
    /// fails with an internal error), extended every third of it while
    /// the tool runs. The extensions run in the same task as the wrapped
    /// server's handling of the call: a tool that blocks its thread
    /// (synchronous I/O, `std::thread::sleep`) holds them up, and past the
    /// lease another call may find the key in doubt (or, with
    /// [`McpOptions::rerun_in_doubt`], run it again). Run blocking work with
    /// `tokio::task::spawn_blocking`. After a crash, the key answers
    /// [`IN_PROGRESS`](super::IN_PROGRESS) until the lease lapses, then the
    /// in-doubt policy.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How long a call that finds its key in progress waits for the other
    /// call's outcome (and replays it) before it answers
    /// [`IN_PROGRESS`](super::IN_PROGRESS). Zero, the default, answers at
    /// once.
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// When an earlier call's holder disappeared without an outcome, run the
    /// tool again ([`InDoubt::Rerun`](crate::agent::InDoubt::Rerun)) instead
    /// of answering [`IN_DOUBT`](super::IN_DOUBT). Right only for tools
    /// whose downstream is itself unique on the key or harmless to repeat.
    #[must_use]
    pub fn rerun_in_doubt(mut self) -> Self {
        self.rerun_in_doubt = true;
        self
    }

    /// Which tool errors (results with `isError: true`) may run again:
    /// those for which `rule` returns `true` are recorded as retryable
    /// failures, so the next call with the key runs the tool again (a
    /// timeout of the tool's own downstream, say); the others are permanent
    /// and replayed. JSON-RPC errors are always retryable (see the module
    /// docs).
    #[must_use]
    pub fn retryable_tool_error(
        mut self,
        rule: impl Fn(&CallToolResult) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.retryable_tool_error = Some(Arc::new(rule));
        self
    }

    /// Who the client of a request is, where the transport knows it (an
    /// authenticated principal that an HTTP server put in the request's
    /// extensions, say). Keys are then scoped per client as well as per
    /// tool, so that two clients that pick the same key never share a
    /// record. `None` leaves the scope per tool. Over stdio there is one
    /// client per connection and no identity: leave this unset.
    #[must_use]
    pub fn client_identity(
        mut self,
        identity: impl Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.client_identity = Some(Arc::new(identity));
        self
    }

    /// The `data.retryAfterMs` of a [`STORE_FAILED`](super::STORE_FAILED)
    /// answered for a fault that passes on its own
    /// ([`Error::is_transient`](crate::Error::is_transient): the database
    /// unreachable, or a claim's answer lost), in whole milliseconds, at
    /// least 1 (default 1 s): a hint, since the layer cannot know when the
    /// database is back.
    #[must_use]
    pub fn unavailable_retry_after(mut self, wait: Duration) -> Self {
        self.unavailable_retry_after = wait;
        self
    }
}
