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
//! replays them); then the child is stopped.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idemstore::mcp::{IdempotentServer, McpOptions, SepTransport};
use idemstore::{Config, Store};
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CompleteRequestParams, CompleteResult,
    GetPromptRequestParams, GetPromptResponse, ListPromptsResult, ListResourceTemplatesResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ServerConfig,
};
use rmcp::model::{ClientNotification, ClientRequest, ProtocolVersion, ServerResult};
use rmcp::service::{
    NotificationContext, Peer, RequestContext, RoleClient, RoleServer, Service, ServiceError,
    ServiceExt,
};
use rmcp::transport::TokioChildProcess;
use tokio::sync::watch;

use crate::error::CliError;
use crate::ops::{StoreArg, Target, connect, connect_error};

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
    /// answers "in progress" until it lapses) [default: the store's, 30s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease: Option<Duration>,
    /// How long a call that finds its key in progress waits for the other
    /// call's outcome before it answers "in progress".
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, default_value = "0s")]
    wait: Duration,
    /// Run a tool again when an earlier call with the key may have acted
    /// but recorded nothing (its proxy died); without it, such a call is
    /// refused for a person to decide (`idemstore resolve`).
    #[arg(long)]
    rerun_in_doubt: bool,
    /// The prefix of every key's scope (then the tool name).
    #[arg(long, value_name = "PREFIX", default_value = "mcp/")]
    scope_prefix: String,
    /// The MCP server to run, and its arguments (after `--`).
    #[arg(required = true, last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// The child server, as a handler for the client's requests.
struct Forward {
    child: Peer<RoleClient>,
    info: ServerConfig,
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

impl ServerHandler for Forward {
    fn get_info(&self) -> ServerConfig {
        self.info.clone()
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        self.child.list_tools(request).await.map_err(forward_error)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.child
            .call_tool_once(request)
            .await
            .map_err(forward_error)
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        self.child
            .list_resources(request)
            .await
            .map_err(forward_error)
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        self.child
            .list_resource_templates(request)
            .await
            .map_err(forward_error)
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        self.child
            .read_resource_once(request)
            .await
            .map_err(forward_error)
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        self.child
            .list_prompts(request)
            .await
            .map_err(forward_error)
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        self.child
            .get_prompt_once(request)
            .await
            .map_err(forward_error)
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        self.child.complete(request).await.map_err(forward_error)
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
        context: RequestContext<RoleServer>,
    ) -> Result<ServerResult, ErrorData> {
        self.in_flight.send_modify(|n| *n = n.saturating_add(1));
        let _guard = InFlight(&self.in_flight);
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

/// Opens (or creates) the store, with the background sweeper on: the
/// proxy runs as long as its client.
fn open_store(args: &Args) -> Result<Store, CliError> {
    let arg = StoreArg {
        store: args.store.clone(),
        schema: args.schema.clone(),
    };
    match arg.target()? {
        Target::File(path) => Store::open_with(&path, Config::new()).map_err(|e| {
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
            connect(&url, &schema, None, true).map_err(|e| connect_error(&name, &schema, e))
        }
    }
}

/// Runs the proxy until the client or the child goes away. Exit code 0;
/// an error when the store cannot be opened, the child cannot be started
/// or does not complete the MCP handshake.
pub fn run(args: &Args) -> Result<std::process::ExitCode, CliError> {
    let store = Arc::new(open_store(args)?);
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::io("cannot start the proxy's runtime", e))?;
    runtime.block_on(async move {
        let child = TokioChildProcess::new(command).map_err(|e| {
            CliError::io(
                format!("cannot start the MCP server {}", program.to_string_lossy()),
                e,
            )
        })?;
        let child = ().serve(child).await.map_err(|e| {
            CliError::Failed(format!(
                "the MCP server did not complete the handshake: {e}"
            ))
        })?;
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
        };
        let (in_flight, mut watching) = watch::channel(0_usize);
        let front = Draining {
            inner: IdempotentServer::with_options(forward, store, options),
            in_flight,
        };
        let front = front
            .serve(SepTransport::new(tokio::io::stdin(), tokio::io::stdout()))
            .await
            .map_err(|e| {
                CliError::Failed(format!(
                    "the MCP client did not complete the handshake: {e}"
                ))
            })?;
        // Whichever side ends first ends the proxy. When the client goes,
        // its calls in flight are let finish first; dropping the child's
        // service then stops the child (rmcp kills it with its transport).
        let mut child = std::pin::pin!(child.waiting());
        tokio::select! {
            _ = front.waiting() => {
                tokio::select! {
                    _ = watching.wait_for(|n| *n == 0) => {}
                    _ = &mut child => {}
                }
            }
            _ = &mut child => {}
        }
        Ok(std::process::ExitCode::SUCCESS)
    })
}
