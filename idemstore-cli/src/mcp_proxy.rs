//! `idemstore mcp-proxy --store PATH -- COMMAND ARGS…`: runs a stdio MCP
//! server as a child and gives its tools run-once semantics, without a
//! change to the server.
//!
//! The proxy speaks MCP on its own stdin and stdout (to the client) and on
//! the child's (to the server). Toward the client it is an
//! [`IdempotentServer`] served over [`SepTransport`], so a `tools/call`
//! carrying an idempotency key (SEP-3182's `params.idempotencyKey`, or
//! `params._meta.idempotencyKey`) runs once per key, and the initialize
//! result announces `tools.idempotency`. A call without a key passes
//! through unchanged. What it forwards to the child: `tools/list`,
//! `tools/call`, `resources/list`, `resources/templates/list`,
//! `resources/read`, `prompts/list`, `prompts/get`, `completion/complete`;
//! anything else is answered "method not found", and the child's own
//! requests and notifications (sampling, elicitation, progress, logging)
//! are not relayed. The child's stderr is the proxy's.
//!
//! The proxy ends when the client closes its stdin or the child exits.
//! Calls still running when the client leaves are let finish and their
//! outcomes recorded first (so that the client's retry on a new connection
//! replays them); then the child is stopped. Every wait for the child (its
//! handshake, its answer to a call) ends at `--call-timeout`: a call not
//! answered by then is answered IN_DOUBT, its key left in progress.
//!
//! With `--listen ADDR` the proxy serves MCP's streamable HTTP transport at
//! `http://ADDR/mcp` instead of stdio, to any number of clients at once,
//! all in front of one child: the same [`IdempotentServer`] behind rmcp's
//! HTTP service (through [`HttpFront`], which only adapts the types). Keys
//! are scoped per tool, as over stdio, and not per HTTP session: a session
//! id names one connection, and the retry that matters comes on the next
//! one (see `docs/mcp.md`). It runs until SIGINT or SIGTERM (then calls in
//! flight finish and are recorded) or until the child exits.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idemstore::mcp::{IdempotentServer, McpOptions, SepTransport};
use idemstore::{Config, Store};
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequest, ClientNotification, ClientRequest, ListToolsRequest, ProtocolVersion,
    ServerResult,
};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CompleteRequestParams, CompleteResult,
    GetPromptRequestParams, GetPromptResponse, ListPromptsResult, ListResourceTemplatesResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ServerConfig,
};
use rmcp::service::{
    NotificationContext, Peer, RequestContext, RoleClient, RoleServer, Service, ServiceError,
    ServiceExt,
};
use rmcp::transport::TokioChildProcess;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::sync::watch;

use crate::error::CliError;
use crate::ops::{StoreArg, Target, connect_error, connect_with};

/// Command-line arguments of `idemstore mcp-proxy`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The store that records the calls: a file (created if absent), or a
    /// PostgreSQL connection URL (`postgresql://…`), shared by every
    /// replica of the proxy.
    #[arg(long, value_name = "STORE")]
    store: PathBuf,
    /// The PostgreSQL schema of the store [default: idemstore].
    #[arg(long, value_name = "NAME")]
    schema: Option<String>,
    /// How long a call holds its key before another may take it over
    /// (extended while the tool runs; after a crash of the proxy, a retry
    /// answers "in progress" until it lapses; at least 100ms) [default:
    /// the store's, 30s].
    #[arg(long, value_name = "DURATION", value_parser = renewed_lease)]
    lease: Option<Duration>,
    /// How long a call that finds its key in progress waits for the other
    /// call's outcome before it answers "in progress".
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, default_value = "0s")]
    wait: Duration,
    /// How long the proxy waits for the server's answer to a forwarded
    /// call (and for its handshake). A call not answered by then is
    /// cancelled at the server and answered IN_DOUBT (-32042): the tool may
    /// have acted, so its key stays in progress and, once its lease lapses,
    /// in doubt. This bounds the wait for an answer that never comes (the
    /// server answered something that is neither a result nor an error, or
    /// a line over rmcp's 16 MiB limit, which rmcp drops), and so how long
    /// the proxy takes to end once its client left. Set it above the
    /// slowest tool's run time (at least 1ms).
    #[arg(long, value_name = "DURATION", value_parser = call_timeout, default_value = "10m")]
    call_timeout: Duration,
    /// Run a tool again when an earlier call with the key may have acted
    /// but recorded nothing (its proxy died); without it, such a call is
    /// refused for a person to decide (`idemstore resolve --while-held`,
    /// as the proxy's log names it).
    #[arg(long)]
    rerun_in_doubt: bool,
    /// The largest answer the store records, in bytes, as JSON (a tool's
    /// result, a tool error or failure, and a recovery point alike; 1 to
    /// 16 MiB; the library's default, 1 MiB, when not given). An answer
    /// over it is returned but never recorded, so its retry finds the key
    /// in doubt: raise it for tools with large answers.
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..=idemstore::MAX_VALUE_LIMIT as u64))]
    max_value_bytes: Option<u64>,
    /// The prefix of every key's scope (then the tool name).
    #[arg(long, value_name = "PREFIX", default_value = "mcp/")]
    scope_prefix: String,
    /// Serve MCP's streamable HTTP transport at http://ADDR/mcp instead of
    /// stdio (e.g. 127.0.0.1:8080; port 0 picks a free one). The bound
    /// address is printed on stderr as
    /// `idemstore mcp-proxy: listening on http://IP:PORT/mcp`. Every client
    /// shares the one child and the store; keys are scoped per tool, not
    /// per HTTP session (a retry after a reconnect comes in a new session
    /// and must find its key), so clients must pick unique keys, as the
    /// journal's task_id:tool_call_id keys are. The key is read from
    /// params._meta.idempotencyKey (the SEP's sibling field is read over
    /// stdio only). No authentication: put it behind a reverse proxy that
    /// authenticates before exposing it beyond the host. Runs until SIGINT
    /// or SIGTERM (calls in flight finish and are recorded first) or until
    /// the child exits.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// With --listen: a Host header to accept besides the loopback names
    /// (localhost, 127.0.0.1, ::1), as `name` or `name:port`; repeatable.
    /// Requests naming another host are refused with 403 (rmcp's defence
    /// against DNS rebinding).
    #[arg(long, value_name = "HOST", requires = "listen")]
    allowed_host: Vec<String>,
    /// The MCP server to run, and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// `--lease`: a human duration from [`idemstore::MIN_RENEWED_LEASE`] to
/// [`idemstore::MAX_LEASE`], refused as the flag's error.
fn renewed_lease(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < idemstore::MIN_RENEWED_LEASE || d > idemstore::MAX_LEASE {
        return Err(format!(
            "a lease is {}ms to {} days: it is renewed every third of it by a durable write",
            idemstore::MIN_RENEWED_LEASE.as_millis(),
            idemstore::MAX_LEASE.as_secs() / 86_400
        ));
    }
    Ok(d)
}

/// `--call-timeout`: a human duration of at least 1 ms.
fn call_timeout(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(1) {
        return Err("a call timeout is at least 1ms".into());
    }
    Ok(d)
}

/// The child server, as a handler for the client's requests.
struct Forward {
    child: Peer<RoleClient>,
    info: ServerConfig,
    /// `--call-timeout`: the longest wait for the child's answer to a call.
    call_timeout: Duration,
}

/// A failure to reach the child, as the JSON-RPC error the client gets.
fn forward_error(error: ServiceError) -> ErrorData {
    match error {
        ServiceError::McpError(error) => error,
        other => {
            ErrorData::internal_error(format!("the MCP server behind the proxy: {other}"), None)
        }
    }
}

/// A `tools/call` the child did not answer with a result or a JSON-RPC
/// error, as the error the client gets. The request was sent (a send that
/// failed never reached the child), so when its connection closed, its
/// answer could not be read, or the wait for it ended, the tool may have
/// acted: [`IN_DOUBT`](idemstore::mcp::IN_DOUBT), on which the layer
/// records nothing and the key stays in progress, then in doubt once its
/// lease lapses, as after a crash (recorded as a retryable failure, the
/// next call would run the tool again).
fn forward_call_error(error: ServiceError) -> ErrorData {
    match error {
        ServiceError::McpError(error) => error,
        not_sent @ ServiceError::TransportSend(_) => forward_error(not_sent),
        unknown => ErrorData::new(
            rmcp::model::ErrorCode(idemstore::mcp::IN_DOUBT),
            format!(
                "the MCP server behind the proxy gave no answer to the call ({unknown}): the tool \
                 may have acted, and is not run again"
            ),
            Some(serde_json::json!({ "reason": "outcome unknown" })),
        ),
    }
}

impl Forward {
    /// A request other than `tools/call` forwarded to the child, answered
    /// within `--call-timeout` (else an internal error: a read, nothing is
    /// in doubt).
    async fn bounded<T>(
        &self,
        forwarded: impl std::future::Future<Output = Result<T, ServiceError>>,
    ) -> Result<T, ErrorData> {
        match tokio::time::timeout(self.call_timeout, forwarded).await {
            Ok(answer) => answer.map_err(forward_error),
            Err(_) => Err(ErrorData::internal_error(
                format!(
                    "the MCP server behind the proxy gave no answer within --call-timeout ({})",
                    humantime::format_duration(self.call_timeout)
                ),
                None,
            )),
        }
    }
}

/// A `tools/call` the child did not answer within `--call-timeout`: sent,
/// so the tool may have acted ([`IN_DOUBT`](idemstore::mcp::IN_DOUBT), as
/// [`forward_call_error`] says).
fn unanswered_call(timeout: Duration) -> ErrorData {
    ErrorData::new(
        rmcp::model::ErrorCode(idemstore::mcp::IN_DOUBT),
        format!(
            "the MCP server behind the proxy gave no answer to the call within --call-timeout \
             ({}): the call was handed to the connection to the server and then cancelled, the \
             tool may have acted, and is not run again",
            humantime::format_duration(timeout)
        ),
        Some(serde_json::json!({ "reason": "outcome unknown" })),
    )
}

impl ServerHandler for Forward {
    fn get_info(&self) -> ServerConfig {
        self.info.clone()
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        self.bounded(self.child.list_tools(request)).await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // Dropped at the deadline, the request is cancelled at the child
        // (rmcp sends `notifications/cancelled`).
        match tokio::time::timeout(self.call_timeout, self.child.call_tool_once(request)).await {
            Ok(answer) => answer.map_err(forward_call_error),
            Err(_) => Err(unanswered_call(self.call_timeout)),
        }
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        self.bounded(self.child.list_resources(request)).await
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        self.bounded(self.child.list_resource_templates(request))
            .await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        self.bounded(self.child.read_resource_once(request)).await
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        self.bounded(self.child.list_prompts(request)).await
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        self.bounded(self.child.get_prompt_once(request)).await
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        self.bounded(self.child.complete(request)).await
    }
}

/// Counts the client's requests in flight, so that the proxy can let them
/// finish (and record their outcomes) after the client has gone.
struct Draining<S> {
    inner: S,
    in_flight: watch::Sender<usize>,
}

/// Decrements the count when a request ends, however it ends.
struct InFlight<'a>(&'a watch::Sender<usize>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl<S: Service<RoleServer>> Service<RoleServer> for Draining<S> {
    async fn handle_request(
        &self,
        request: ClientRequest,
        mut context: RequestContext<RoleServer>,
    ) -> Result<ServerResult, ErrorData> {
        self.in_flight.send_modify(|n| *n = n.saturating_add(1));
        let _guard = InFlight(&self.in_flight);
        // The proxy lets a call finish after its client cancelled it or
        // went away, and does not tell the child (`Forward` ignores the
        // token): the child's answer means what it says. With the client's
        // token, the run-once layer would take the child's JSON-RPC error
        // (a call that did nothing) for one answered after a cancellation,
        // which may have acted, and leave the key in doubt.
        context.ct = Default::default();
        self.inner.handle_request(request, context).await
    }

    async fn handle_notification(
        &self,
        notification: ClientNotification,
        context: NotificationContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.inner.handle_notification(notification, context).await
    }

    fn get_info(&self) -> ServerConfig {
        self.inner.get_info()
    }

    fn supported_protocol_versions(&self) -> std::borrow::Cow<'static, [ProtocolVersion]> {
        self.inner.supported_protocol_versions()
    }
}

/// The proxy's front as rmcp's streamable HTTP service wants it: a
/// [`ServerHandler`] (the HTTP service asks for one, and an
/// [`IdempotentServer`] is a [`Service`]). It adds nothing: `tools/call`
/// and `tools/list` go through the shared front (the run-once layer and its
/// count of calls in flight), and the server's description with the
/// capability comes from it; the other requests go straight to the child.
#[derive(Clone)]
struct HttpFront(Arc<Draining<IdempotentServer<Forward>>>);

impl HttpFront {
    fn forward(&self) -> &Forward {
        self.0.inner.inner()
    }
}

/// An answer of the front that is not the kind the request asks for.
fn unexpected_answer(request: &str) -> ErrorData {
    ErrorData::internal_error(
        format!("the proxy answered {request} with another kind of result"),
        None,
    )
}

impl ServerHandler for HttpFront {
    fn get_info(&self) -> ServerConfig {
        Service::get_info(&*self.0)
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let list = ListToolsRequest {
            params: request,
            ..Default::default()
        };
        match self
            .0
            .handle_request(ClientRequest::ListToolsRequest(list), context)
            .await?
        {
            ServerResult::ListToolsResult(result) => Ok(result),
            _ => Err(unexpected_answer("tools/list")),
        }
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let call = ClientRequest::CallToolRequest(CallToolRequest::new(request));
        match self.0.handle_request(call, context).await? {
            ServerResult::CallToolResult(result) => Ok(result.into()),
            ServerResult::CreateTaskResult(result) => Ok(result.into()),
            ServerResult::InputRequiredResult(result) => Ok(result.into()),
            _ => Err(unexpected_answer("tools/call")),
        }
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        self.forward().list_resources(request, context).await
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        self.forward()
            .list_resource_templates(request, context)
            .await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        self.forward().read_resource(request, context).await
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        self.forward().list_prompts(request, context).await
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        self.forward().get_prompt(request, context).await
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        self.forward().complete(request, context).await
    }
}

/// Resolves on SIGINT or SIGTERM (never, for a signal that cannot be
/// watched).
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// Opens (or creates) the store, with the background sweeper on: the
/// proxy runs as long as its client.
fn open_store(args: &Args) -> Result<Store, CliError> {
    let arg = StoreArg {
        store: args.store.clone(),
        schema: args.schema.clone(),
    };
    // Within MAX_VALUE_LIMIT (the flag's range), so it fits a usize.
    let limits = |config: Config| match args.max_value_bytes {
        Some(limit) => {
            let limit = usize::try_from(limit).unwrap_or(idemstore::MAX_VALUE_LIMIT);
            config
                .max_result_bytes(limit)
                .max_failure_bytes(limit)
                .max_recovery_point_bytes(limit)
        }
        None => config,
    };
    match arg.target()? {
        Target::File(path) => Store::open_with(&path, limits(Config::new())).map_err(|e| {
            CliError::store(
                format!(
                    "cannot open the store {} (one proxy per store file; share a store \
                     between proxies with a PostgreSQL URL)",
                    path.display()
                ),
                e,
            )
        }),
        Target::Postgres { url, schema, name } => {
            connect_with(&url, &schema, limits(crate::ops::config(None)), true)
                .map_err(|e| connect_error(&name, &schema, e))
        }
    }
}

/// Runs the proxy until the client or the child goes away (with
/// `--listen`: until SIGINT, SIGTERM or the child's exit). Exit code 0; an
/// error when the store cannot be opened, the child cannot be started or
/// does not complete the MCP handshake, the stdio client does not complete
/// it, or the address cannot be bound.
pub fn run(args: &Args) -> Result<std::process::ExitCode, CliError> {
    let store = Arc::new(open_store(args)?);
    let kept = Arc::clone(&store);
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| CliError::Usage("mcp-proxy needs the server's COMMAND after --".into()))?;
    let mut command = tokio::process::Command::new(program);
    command.args(rest);
    let mut options = McpOptions::new()
        .scope_prefix(args.scope_prefix.clone())
        .wait(args.wait);
    if let Some(lease) = args.lease {
        options = options.lease(lease);
    }
    if args.rerun_in_doubt {
        options = options.rerun_in_doubt();
    }
    let runtime = runtime().map_err(|e| CliError::io("cannot start the proxy's runtime", e))?;
    let ended = runtime.block_on(async move {
        let child = TokioChildProcess::new(command).map_err(|e| {
            CliError::io(
                format!("cannot start the MCP server {}", program.to_string_lossy()),
                e,
            )
        })?;
        let child = match tokio::time::timeout(args.call_timeout, ().serve(child)).await {
            Ok(served) => served.map_err(|e| {
                CliError::Failed(format!(
                    "the MCP server did not complete the handshake: {e}"
                ))
            })?,
            Err(_) => {
                return Err(CliError::Failed(format!(
                    "the MCP server did not complete the handshake within --call-timeout ({})",
                    humantime::format_duration(args.call_timeout)
                )));
            }
        };
        let info = match child.peer_info() {
            Some(peer) => {
                let mut info = ServerConfig::default();
                info.protocol_version = peer.protocol_version.clone();
                info.capabilities = peer.capabilities.clone();
                if let Some(server_info) = &peer.server_info {
                    info.server_info = server_info.clone();
                }
                info.instructions = peer.instructions.clone();
                info
            }
            None => ServerConfig::default(),
        };
        let forward = Forward {
            child: child.peer().clone(),
            info,
            call_timeout: args.call_timeout,
        };
        let (in_flight, mut watching) = watch::channel(0_usize);
        let front = Draining {
            inner: IdempotentServer::with_options(forward, store, options),
            in_flight,
        };
        let stop_child = child.cancellation_token();
        let mut child = std::pin::pin!(child.waiting());
        match args.listen {
            None => {
                let front = front
                    .serve(SepTransport::new(tokio::io::stdin(), tokio::io::stdout()))
                    .await
                    .map_err(|e| {
                        CliError::Failed(format!(
                            "the MCP client did not complete the handshake: {e}"
                        ))
                    })?;
                // Whichever side ends first ends the proxy. When the client
                // goes, its calls in flight are let finish first; dropping
                // the child's service then stops the child (rmcp kills it
                // with its transport).
                tokio::select! {
                    _ = front.waiting() => {}
                    _ = &mut child => return Ok(std::process::ExitCode::SUCCESS),
                }
            }
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| CliError::io(format!("cannot listen on {addr}"), e))?;
                let bound = listener
                    .local_addr()
                    .map_err(|e| CliError::io(format!("cannot listen on {addr}"), e))?;
                let mut config = StreamableHttpServerConfig::default();
                if !args.allowed_host.is_empty() {
                    let hosts = ["localhost", "127.0.0.1", "::1"]
                        .into_iter()
                        .map(String::from)
                        .chain(args.allowed_host.iter().cloned());
                    config = config.with_allowed_hosts(hosts);
                }
                let sessions = config.cancellation_token.clone();
                let front = HttpFront(Arc::new(front));
                let service = StreamableHttpService::new(
                    move || Ok(front.clone()),
                    Arc::new(LocalSessionManager::default()),
                    config,
                );
                let router = axum::Router::new().route_service("/mcp", service);
                eprintln!("idemstore mcp-proxy: listening on http://{bound}/mcp");
                tokio::select! {
                    served = axum::serve(listener, router).into_future() => {
                        served.map_err(|e| CliError::io(format!("serving http://{bound}/mcp"), e))?;
                    }
                    () = stop_signal() => {}
                    _ = &mut child => return Ok(std::process::ExitCode::SUCCESS),
                }
                // Stop the HTTP sessions; the calls they started go on.
                sessions.cancel();
            }
        }
        // Let the calls in flight finish and record their outcomes (so a
        // retry through the next proxy replays them), unless the child dies.
        tokio::select! {
            _ = watching.wait_for(|n| *n == 0) => {}
            _ = &mut child => return Ok(std::process::ExitCode::SUCCESS),
        }
        // Stop the child and wait for it: rmcp closes its stdin, then sends
        // SIGTERM, then kills it. Left to the service's drop, the kill is a
        // task the runtime's shutdown may never run, and a child still
        // running a tool (one the proxy stopped waiting for) would outlive
        // the proxy.
        stop_child.cancel();
        let _ = tokio::time::timeout(CHILD_STOP, &mut child).await;
        Ok(std::process::ExitCode::SUCCESS)
    });
    // The workers drop the tasks left (the front's, holding the store)
    // before this returns; the thread reading stdin cannot be interrupted,
    // and a client that keeps its end open (the proxy ended because the
    // child did) would hold the proxy for ever: it is waited for at most
    // `STDIN_GRACE`. The store closes cleanly when the last of its
    // handles drops, `kept` at the latest, on this thread.
    runtime.shutdown_timeout(STDIN_GRACE);
    drop(kept);
    ended
}

/// How long the proxy's end waits for its child to stop (rmcp's graceful
/// shutdown: up to 3 s after its stdin closes, then SIGTERM and up to 3 s,
/// then SIGKILL).
const CHILD_STOP: Duration = Duration::from_secs(10);

/// How long the proxy's end waits for its stdin reader (a blocking read
/// of a client that has not closed its end) once everything else stopped.
const STDIN_GRACE: Duration = Duration::from_secs(2);

/// The stack of each of the proxy's runtime threads, in bytes. A call
/// goes through rmcp's service loop, the run-once layer and the forward to
/// the child, whose futures make deep poll frames: in an unoptimized build
/// (the `dev` profile, or opt-level 0) a call over HTTP overflowed tokio's
/// default of 2 MiB and aborted the proxy. An optimized build uses a small
/// part of this; untouched pages of a stack cost no memory.
const RUNTIME_STACK_BYTES: usize = 16 << 20;

/// The proxy's runtime: two worker threads with [`RUNTIME_STACK_BYTES`] of
/// stack each, I/O and time enabled.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_stack_size(RUNTIME_STACK_BYTES)
        .enable_all()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call the child did not answer with a result or a JSON-RPC error
    /// has an unknown outcome once it was sent (IN_DOUBT: the layer records
    /// nothing); one never sent, or the child's own error, is passed on.
    #[test]
    fn a_call_without_an_answer_is_in_doubt() {
        let code = |e: ServiceError| forward_call_error(e).code.0;
        assert_eq!(
            code(ServiceError::TransportClosed),
            idemstore::mcp::IN_DOUBT
        );
        assert_eq!(
            code(ServiceError::UnexpectedResponse),
            idemstore::mcp::IN_DOUBT
        );
        assert_eq!(
            code(ServiceError::Cancelled { reason: None }),
            idemstore::mcp::IN_DOUBT
        );
        let own = ErrorData::invalid_params("no such tool", None);
        assert_eq!(forward_call_error(ServiceError::McpError(own.clone())), own);
        let unsent = ServiceError::TransportSend(rmcp::transport::DynamicTransportError::new::<
            SepTransport<tokio::io::Empty, tokio::io::Sink>,
            RoleServer,
        >(
            idemstore::mcp::SepTransportError::from(std::io::Error::other("pipe closed")),
        ));
        assert_eq!(code(unsent), rmcp::model::ErrorCode::INTERNAL_ERROR.0);
    }

    /// The child for the test below: `work` waits until told, then answers
    /// a JSON-RPC error (it did nothing); later runs answer it at once.
    struct Failing {
        runs: Arc<std::sync::atomic::AtomicUsize>,
        started: Arc<tokio::sync::Notify>,
        go: Arc<tokio::sync::Notify>,
    }

    fn tools_only() -> ServerConfig {
        let mut info = ServerConfig::default();
        info.capabilities = rmcp::model::ServerCapabilities::builder()
            .enable_tools()
            .build();
        info
    }

    impl ServerHandler for Failing {
        fn get_info(&self) -> ServerConfig {
            tools_only()
        }

        async fn call_tool(
            &self,
            _request: CallToolRequestParams,
            _context: RequestContext<RoleServer>,
        ) -> Result<CallToolResponse, ErrorData> {
            let run = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if run == 0 {
                self.started.notify_one();
                self.go.notified().await;
            }
            Err(ErrorData::internal_error("upstream unavailable", None))
        }
    }

    /// The proxy's front, which tells `cancelled` when the client's token
    /// of a request fires.
    struct Watching<S> {
        inner: S,
        cancelled: Arc<tokio::sync::Notify>,
    }

    impl<S: Service<RoleServer>> Service<RoleServer> for Watching<S> {
        async fn handle_request(
            &self,
            request: ClientRequest,
            context: RequestContext<RoleServer>,
        ) -> Result<ServerResult, ErrorData> {
            let ct = context.ct.clone();
            let cancelled = Arc::clone(&self.cancelled);
            tokio::spawn(async move {
                ct.cancelled().await;
                cancelled.notify_one();
            });
            self.inner.handle_request(request, context).await
        }

        async fn handle_notification(
            &self,
            notification: ClientNotification,
            context: NotificationContext<RoleServer>,
        ) -> Result<(), ErrorData> {
            self.inner.handle_notification(notification, context).await
        }

        fn get_info(&self) -> ServerConfig {
            self.inner.get_info()
        }
    }

    /// The proxy's stack for `test`: its runtime ([`runtime`]), and a thread
    /// of [`RUNTIME_STACK_BYTES`] for the test's own future, which serves
    /// both ends of the proxy in place (a test thread has 2 MiB).
    fn on_the_proxys_runtime(test: impl std::future::Future<Output = ()> + Send + 'static) {
        std::thread::Builder::new()
            .stack_size(RUNTIME_STACK_BYTES)
            .spawn(move || runtime().unwrap().block_on(test))
            .unwrap()
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    }

    /// A call whose client cancelled it while the child ran it, and which
    /// the child then answers with a JSON-RPC error (it did nothing), is a
    /// retryable failure, as the child means it: the next call with the key
    /// runs the tool again. The child is never told of the cancel, so the
    /// error is not one a tool gave because it was cancelled. (The layer
    /// took it for one, which may have acted, and left the key in progress,
    /// then in doubt.)
    #[test]
    fn a_child_error_to_a_call_its_client_cancelled_runs_again() {
        on_the_proxys_runtime(a_child_error_to_a_call_its_client_cancelled_runs_again_on());
    }

    async fn a_child_error_to_a_call_its_client_cancelled_runs_again_on() {
        let (runs, started, go, cancelled) = (
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Notify::new()),
            Arc::new(tokio::sync::Notify::new()),
        );
        let child = Failing {
            runs: Arc::clone(&runs),
            started: Arc::clone(&started),
            go: Arc::clone(&go),
        };
        let (child_io, proxy_io) = tokio::io::duplex(1 << 16);
        let (_child, to_child) = tokio::join!(child.serve(child_io), ().serve(proxy_io));
        let to_child = to_child.unwrap();
        let forward = Forward {
            child: to_child.peer().clone(),
            info: tools_only(),
            call_timeout: Duration::from_secs(600),
        };
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path().join("proxy.redb")).unwrap());
        let front = Watching {
            inner: Draining {
                // A short lease: were the key left in progress, it would
                // be in doubt soon after.
                inner: IdempotentServer::with_options(
                    forward,
                    store,
                    McpOptions::new().lease(Duration::from_millis(300)),
                ),
                in_flight: watch::channel(0_usize).0,
            },
            cancelled: Arc::clone(&cancelled),
        };
        let (client_io, front_io) = tokio::io::duplex(1 << 16);
        let (_front, client) = tokio::join!(front.serve(front_io), ().serve(client_io));
        let client = client.unwrap();
        let key = idemstore::Key::new("agent", "call-1").unwrap();
        let call = idemstore::mcp::attach_key(CallToolRequestParams::new("work"), &key);

        let peer = client.peer().clone();
        let sent = tokio::spawn({
            let call = call.clone();
            async move { peer.call_tool(call).await }
        });
        started.notified().await;
        sent.abort(); // the client gives up: rmcp cancels the request
        cancelled.notified().await; // the proxy has seen the cancel
        go.notify_one(); // the child answers its error

        let retry = loop {
            match client.call_tool(call.clone()).await {
                Err(ServiceError::McpError(e)) if e.code.0 == idemstore::mcp::IN_PROGRESS => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => break other,
            }
        };
        match retry {
            Err(ServiceError::McpError(e)) => {
                assert_eq!(e.message, "upstream unavailable", "{e:?}")
            }
            other => panic!("expected the child's error from a second run, got {other:?}"),
        }
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
