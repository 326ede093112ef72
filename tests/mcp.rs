//! Run-once MCP tool calls with real `rmcp` peers: a server whose tool
//! appends a line to a file, behind [`IdempotentServer`], and the `rmcp`
//! client, over in-memory pipes that a test cuts at will. Every wait is on
//! a channel or on the store's own wake-up; no test sleeps to order events.
//! With the `postgres` and `conformance` features, two tests put the layer
//! over a PostgreSQL store (`IDEMSTORE_SKIP_POSTGRES=1` skips them): a
//! store fault that passes on its own, and one that needs an operator.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemstore::agent::{CallError, Limit, RetryPolicy};
use idemstore::mcp::{
    CAPABILITY, IN_DOUBT, IN_PROGRESS, IdempotentServer, KEY_CONFLICT, McpOptions, STORE_FAILED,
    SepTransport, ToolCallError, announces_idempotency, attach_key, call_tool_once,
};
use idemstore::{Config, Key, Store};
use parking_lot::Mutex;
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock as Content,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::{RequestContext, RoleClient, RoleServer, RunningService, ServiceExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

#[cfg(all(feature = "postgres", feature = "conformance"))]
mod pg;

/// Holds one call of `append` open: the tool reports that its line is
/// written on `started`, then waits for `release`.
struct Gate {
    started: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

/// The tools' side effects and counters, shared by every connection.
struct Tools {
    file: std::path::PathBuf,
    gate: Mutex<Option<Gate>>,
    /// How often each tool body ran.
    runs: AtomicUsize,
    flaky_failures_left: AtomicUsize,
}

/// The server: `append` (writes a line), `count` (read-only), `reject`
/// (a tool error), `flaky` (a JSON-RPC error, then a result), `lost` (an
/// answer of unknown outcome, `IN_DOUBT`), `careful` (writes a line, then
/// answers a JSON-RPC error once its call is cancelled; a later run
/// answers at once).
#[derive(Clone)]
struct AppendServer(Arc<Tools>);

fn schema() -> Arc<rmcp::model::JsonObject> {
    Arc::new(
        json!({"type": "object"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
    )
}

fn tools() -> Vec<Tool> {
    let mut count = Tool::new("count", "Count the lines", schema());
    count.annotations = Some(ToolAnnotations::new().read_only(true));
    vec![
        Tool::new("append", "Append a line", schema()),
        count,
        Tool::new("reject", "Always a tool error", schema()),
        Tool::new("flaky", "A JSON-RPC error, then a result", schema()),
        Tool::new("lost", "Does not know whether it acted", schema()),
        Tool::new("careful", "Acts, then stops when cancelled", schema()),
    ]
}

impl Tools {
    fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.file)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

impl ServerHandler for AppendServer {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::default();
        info.capabilities = ServerCapabilities::builder().enable_tools().build();
        info
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools().into_iter().find(|t| t.name == name)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let tools = &self.0;
        tools.runs.fetch_add(1, Ordering::SeqCst);
        let text = |r: String| Ok(CallToolResult::success(vec![Content::text(r)]).into());
        match &*request.name {
            "append" => {
                let line = request
                    .arguments
                    .as_ref()
                    .and_then(|a| a.get("line"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| ErrorData::invalid_params("line is required", None))?
                    .to_string();
                let mut lines = tools.lines();
                lines.push(line);
                std::fs::write(&tools.file, lines.join("\n") + "\n")
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                let gate = tools.gate.lock().take();
                if let Some(gate) = gate {
                    let _ = gate.started.send(());
                    let _ = gate.release.await;
                }
                text(format!("appended line {}", lines.len()))
            }
            "count" => text(format!("{} lines", tools.lines().len())),
            "reject" => Ok(CallToolResult::error(vec![Content::text("order not found")]).into()),
            "flaky" => {
                let left = tools.flaky_failures_left.load(Ordering::SeqCst);
                if left > 0 {
                    tools.flaky_failures_left.store(left - 1, Ordering::SeqCst);
                    return Err(ErrorData::internal_error("upstream unavailable", None));
                }
                text("flaky worked".to_string())
            }
            "careful" => {
                let mut lines = tools.lines();
                let again = lines.iter().any(|l| l == "careful");
                lines.push("careful".to_string());
                std::fs::write(&tools.file, lines.join("\n") + "\n")
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                let gate = tools.gate.lock().take();
                if let Some(gate) = gate {
                    let _ = gate.started.send(());
                }
                if again {
                    return text("careful ran again".to_string());
                }
                context.ct.cancelled().await;
                Err(ErrorData::internal_error("cancelled", None))
            }
            "lost" => Err(ErrorData::new(
                rmcp::model::ErrorCode(IN_DOUBT),
                "the backend went away mid-call",
                None,
            )),
            _ => Err(ErrorData::invalid_params("no such tool", None)),
        }
    }
}

/// A store, the tools, and the server options, from which connections are
/// made.
struct Harness {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    tools: Arc<Tools>,
    options: McpOptions,
    /// The server ends of the connections [`connector`] opened.
    servers: Mutex<Vec<Server>>,
}

type Client = RunningService<RoleClient, ()>;
type Server = RunningService<RoleServer, IdempotentServer<AppendServer>>;

impl Harness {
    fn new(options: McpOptions) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path().join("mcp.redb")).unwrap());
        let tools = Arc::new(Tools {
            file: dir.path().join("lines.txt"),
            gate: Mutex::new(None),
            runs: AtomicUsize::new(0),
            flaky_failures_left: AtomicUsize::new(1),
        });
        Harness {
            _dir: dir,
            store,
            tools,
            options,
            servers: Mutex::default(),
        }
    }

    /// A new connection: the wrapped server on one end of an in-memory
    /// pipe, an initialized `rmcp` client on the other.
    async fn connect(&self) -> (Client, Server) {
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let server = IdempotentServer::with_options(
            AppendServer(Arc::clone(&self.tools)),
            Arc::clone(&self.store),
            self.options.clone(),
        );
        let (server, client) = tokio::join!(server.serve(server_io), ().serve(client_io));
        (client.unwrap(), server.unwrap())
    }

    /// Holds the next `append` call open; the receiver fires once its line
    /// is written, the sender lets it answer.
    fn hold_next(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (started_tx, started_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        *self.tools.gate.lock() = Some(Gate {
            started: started_tx,
            release: release_rx,
        });
        (started_rx, release_tx)
    }
}

fn call(tool: &str, arguments: Value, key: &str) -> CallToolRequestParams {
    let key = Key::new("client", key).unwrap();
    attach_key(
        CallToolRequestParams::new(tool.to_string())
            .with_arguments(arguments.as_object().cloned().unwrap_or_default()),
        &key,
    )
}

/// A call of the harness's `append` tool with `line`.
fn append(line: &str) -> CallToolRequestParams {
    CallToolRequestParams::new("append")
        .with_arguments(json!({ "line": line }).as_object().cloned().unwrap())
}

fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

fn rpc_error(error: rmcp::service::ServiceError) -> ErrorData {
    match error {
        rmcp::service::ServiceError::McpError(e) => e,
        other => panic!("expected a JSON-RPC error, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_cut_connection_runs_the_tool_once_and_gets_the_same_result() {
    // The retry waits for a call still running and replays its outcome.
    let h = Harness::new(McpOptions::new().wait(Duration::from_secs(30)));
    let (first, _server1) = h.connect().await;
    assert!(announces_idempotency(
        &first.peer_info().unwrap().capabilities
    ));

    let (started, release) = h.hold_next();
    let peer = first.peer().clone();
    let sent = tokio::spawn(async move {
        peer.call_tool(call("append", json!({"line": "hello"}), "task-1:call-1"))
            .await
    });
    started.await.unwrap(); // the call arrived and the line is written
    first.cancel().await.unwrap(); // the connection is cut
    assert!(sent.await.unwrap().is_err(), "the first answer is lost");
    release.send(()).unwrap();

    let (second, _server2) = h.connect().await;
    let retry = second
        .call_tool(call("append", json!({"line": "hello"}), "task-1:call-1"))
        .await
        .unwrap();
    assert_eq!(text_of(&retry), "appended line 1");
    assert_eq!(h.tools.lines(), vec!["hello"]);
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1);

    // Member order of the arguments does not matter; the replay is equal.
    let again = second
        .call_tool(call("append", json!({"line": "hello"}), "task-1:call-1"))
        .await
        .unwrap();
    assert_eq!(again, retry);
    assert_eq!(h.tools.lines(), vec!["hello"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_other_arguments_is_a_conflict() {
    let h = Harness::new(McpOptions::new());
    let (client, _server) = h.connect().await;
    client
        .call_tool(call("append", json!({"line": "one"}), "k-1"))
        .await
        .unwrap();
    let error = rpc_error(
        client
            .call_tool(call("append", json!({"line": "two"}), "k-1"))
            .await
            .unwrap_err(),
    );
    assert_eq!(error.code.0, KEY_CONFLICT);
    let data = error.data.unwrap();
    assert_eq!(data["idempotencyKey"], "k-1");
    assert_eq!(data["tool"], "append");
    assert_eq!(h.tools.lines(), vec!["one"]);
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_progress_is_answered_as_such() {
    let h = Harness::new(McpOptions::new());
    let (client, _server) = h.connect().await;
    let (started, release) = h.hold_next();
    let peer = client.peer().clone();
    let first = tokio::spawn(async move {
        peer.call_tool(call("append", json!({"line": "slow"}), "k-2"))
            .await
    });
    started.await.unwrap();

    let error = rpc_error(
        client
            .call_tool(call("append", json!({"line": "slow"}), "k-2"))
            .await
            .unwrap_err(),
    );
    assert_eq!(error.code.0, IN_PROGRESS);
    let data = error.data.unwrap();
    assert!(data["retryAfterMs"].as_u64().unwrap() >= 1);
    assert_eq!(data["idempotencyKey"], "k-2");

    release.send(()).unwrap();
    let done = first.await.unwrap().unwrap();
    let replay = client
        .call_tool(call("append", json!({"line": "slow"}), "k-2"))
        .await
        .unwrap();
    assert_eq!(replay, done);
    assert_eq!(h.tools.lines(), vec!["slow"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_a_key_and_read_only_tools_pass_through() {
    let h = Harness::new(McpOptions::new());
    let (client, _server) = h.connect().await;
    client.call_tool(append("x")).await.unwrap();
    client.call_tool(append("x")).await.unwrap();
    assert_eq!(h.tools.lines(), vec!["x", "x"]);

    // A read-only tool runs every time, whatever key and arguments it gets.
    let before = h.tools.runs.load(Ordering::SeqCst);
    let one = client
        .call_tool(call("count", json!({}), "k-3"))
        .await
        .unwrap();
    let two = client
        .call_tool(call("count", json!({"other": true}), "k-3"))
        .await
        .unwrap();
    assert_eq!(text_of(&one), "2 lines");
    assert_eq!(text_of(&two), "2 lines");
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), before + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_errors_are_replayed_and_json_rpc_errors_run_again() {
    let h = Harness::new(McpOptions::new());
    let (client, _server) = h.connect().await;

    let first = client
        .call_tool(call("reject", json!({}), "k-4"))
        .await
        .unwrap();
    let again = client
        .call_tool(call("reject", json!({}), "k-4"))
        .await
        .unwrap();
    assert_eq!(first.is_error, Some(true));
    assert_eq!(again, first);
    assert_eq!(
        h.tools.runs.load(Ordering::SeqCst),
        1,
        "a permanent tool error is replayed"
    );

    let failed = rpc_error(
        client
            .call_tool(call("flaky", json!({}), "k-5"))
            .await
            .unwrap_err(),
    );
    assert_eq!(failed.message, "upstream unavailable");
    let worked = client
        .call_tool(call("flaky", json!({}), "k-5"))
        .await
        .unwrap();
    assert_eq!(text_of(&worked), "flaky worked");
    assert_eq!(
        h.tools.runs.load(Ordering::SeqCst),
        3,
        "a JSON-RPC error runs again"
    );

    // A tool error the options call retryable runs again too.
    let h = Harness::new(McpOptions::new().retryable_tool_error(|_| true));
    let (client, _server) = h.connect().await;
    client
        .call_tool(call("reject", json!({}), "k-6"))
        .await
        .unwrap();
    client
        .call_tool(call("reject", json!({}), "k-6"))
        .await
        .unwrap();
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 2);
}

/// A wrapped server that answers `IN_DOUBT` does not know whether its
/// tool acted: nothing is recorded, that error goes back, and the key
/// stays in progress under its lease, then in doubt once it lapses; the
/// tool does not run again. (It was recorded as a retryable failure, and
/// the next call ran the tool again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_of_unknown_outcome_leaves_the_key_in_doubt() {
    let h = Harness::new(McpOptions::new().lease(Duration::from_millis(300)));
    let (client, _server) = h.connect().await;
    let first = rpc_error(
        client
            .call_tool(call("lost", json!({}), "k-lost"))
            .await
            .unwrap_err(),
    );
    assert_eq!(first.code.0, IN_DOUBT);
    assert_eq!(first.message, "the backend went away mid-call");
    let busy = rpc_error(
        client
            .call_tool(call("lost", json!({}), "k-lost"))
            .await
            .unwrap_err(),
    );
    assert_eq!(busy.code.0, IN_PROGRESS, "{busy:?}");
    // Past the lease: in doubt, as after a crash.
    let doubt = loop {
        let answer = rpc_error(
            client
                .call_tool(call("lost", json!({}), "k-lost"))
                .await
                .unwrap_err(),
        );
        if answer.code.0 != IN_PROGRESS {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(doubt.code.0, IN_DOUBT);
    assert_eq!(doubt.data.unwrap()["idempotencyKey"], "k-lost");
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1, "the tool ran once");
}

/// A call cancelled while its tool runs (the client gave up on it, and
/// `rmcp` sent `notifications/cancelled`), whose tool then stops with a
/// JSON-RPC error after it acted, may have acted: nothing is recorded, the
/// key stays in progress under its lease and is then in doubt; the retry
/// does not run the tool again. (The error was recorded as a retryable
/// failure, and the retry ran the tool a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cancelled_while_its_tool_runs_is_in_doubt_not_run_again() {
    let h = Harness::new(McpOptions::new().lease(Duration::from_millis(300)));
    let (client, _server) = h.connect().await;
    let (started, _release) = h.hold_next();
    let peer = client.peer().clone();
    let sent =
        tokio::spawn(async move { peer.call_tool(call("careful", json!({}), "k-cancel")).await });
    started.await.unwrap(); // the tool acted
    sent.abort(); // the client gives up: rmcp cancels the request
    assert!(sent.await.unwrap_err().is_cancelled());
    // A hang guard: were the cancel never to reach the server, its lease
    // would be renewed and the key stay in progress for good.
    let guard = std::time::Instant::now();
    let doubt = loop {
        assert!(
            guard.elapsed() < Duration::from_secs(60),
            "HANG: the key stayed in progress for a minute"
        );
        let answer = match client
            .call_tool(call("careful", json!({}), "k-cancel"))
            .await
        {
            Ok(result) => panic!("the retry ran the tool again: {}", text_of(&result)),
            Err(e) => rpc_error(e),
        };
        if answer.code.0 != IN_PROGRESS {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(doubt.code.0, IN_DOUBT, "{doubt:?}");
    assert_eq!(h.tools.lines(), vec!["careful"], "the tool acted once");
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1, "the tool ran once");
}

/// A `connect` for `call_tool_once`: each call opens a new connection to
/// `h`'s server, whose end is kept with the harness's others (dropping it
/// would end the connection).
fn connector(
    h: &Arc<Harness>,
) -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Client, String>>>> {
    let h = Arc::clone(h);
    move || {
        let h = Arc::clone(&h);
        Box::pin(async move {
            let (client, server) = h.connect().await;
            h.servers.lock().push(server);
            Ok(client)
        })
    }
}

/// Calls the `append` tool with `key` and asserts the server's fault: an
/// internal error (no retry helps; not STORE_FAILED, "retry with the same
/// key", which `call_tool_once` does until its deadline) whose message
/// says `says`, and the tool did not run.
async fn assert_internal_error(h: &Harness, key: &str, says: &str) {
    let (client, _server) = h.connect().await;
    let refused = rpc_error(
        client
            .call_tool(call("append", json!({"line": "x"}), key))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        refused.code,
        rmcp::model::ErrorCode::INTERNAL_ERROR,
        "{refused:?}"
    );
    assert!(refused.message.contains(says), "{refused:?}");
    let data = refused.data.expect("data");
    assert_eq!(
        (&data["transient"], &data["idempotencyKey"]),
        (&json!(false), &json!(key)),
        "{data}"
    );
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 0);
}

/// `call_tool_once` stops at the layer's own fault (its first answer),
/// rather than send until its attempts run out: no request succeeds until
/// an operator acts.
async fn assert_the_client_helper_stops(h: Arc<Harness>) {
    let connect = connector(&h);
    let key = Key::for_tool_call("acme/agent", "task-10", "call_1").unwrap();
    let policy = RetryPolicy::new(4, Duration::from_millis(1), Duration::from_millis(1)).unwrap();
    match call_tool_once(&key, append("x"), &policy, connect).await {
        Err(CallError::Rejected {
            error: ToolCallError::Rpc(e),
            in_doubt: false,
            ..
        }) => assert_eq!(e.code, rmcp::model::ErrorCode::INTERNAL_ERROR),
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 0);
}

/// A lease out of range in the layer's options is the server's fault: an
/// internal error that nothing retries; nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_out_of_range_is_an_internal_error() {
    let h = Harness::new(McpOptions::new().lease(Duration::from_millis(50)));
    assert_internal_error(&h, "k-lease", "options are invalid").await;
    assert_the_client_helper_stops(Arc::new(h)).await;
}

/// A store opened read-only records nothing: an internal error that no
/// retry helps; nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_store_is_an_internal_error() {
    let mut h = Harness::new(McpOptions::new());
    let path = h._dir.path().join("read-only.redb");
    drop(Store::open(&path).unwrap());
    h.store = Arc::new(Store::open_existing(&path, Config::new().read_only(true)).unwrap());
    assert_internal_error(&h, "k-ro", "read-only").await;
    assert_the_client_helper_stops(Arc::new(h)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_invalid_params() {
    let h = Harness::new(McpOptions::new());
    let (client, _server) = h.connect().await;
    let mut params = append("x");
    params.meta = Some(rmcp::model::RequestMetaObject::default());
    if let Some(meta) = params.meta.as_mut() {
        meta.insert("idempotencyKey".into(), json!(17));
    }
    let error = rpc_error(client.call_tool(params.clone()).await.unwrap_err());
    assert_eq!(error.code, rmcp::model::ErrorCode::INVALID_PARAMS);
    if let Some(meta) = params.meta.as_mut() {
        meta.insert("idempotencyKey".into(), json!("k".repeat(256)));
    }
    let error = rpc_error(client.call_tool(params).await.unwrap_err());
    assert_eq!(error.code, rmcp::model::ErrorCode::INVALID_PARAMS);
    assert!(h.tools.lines().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_helper_retries_on_a_new_connection_and_the_tool_runs_once() {
    let h = Arc::new(Harness::new(McpOptions::new()));
    let (started, release) = h.hold_next();
    let servers: Arc<Mutex<Vec<Server>>> = Arc::default();
    let connections = Arc::new(AtomicUsize::new(0));
    let connect = {
        let (h, servers, connections) = (h.clone(), servers.clone(), connections.clone());
        move || {
            let (h, servers, connections) = (h.clone(), servers.clone(), connections.clone());
            async move {
                connections.fetch_add(1, Ordering::SeqCst);
                let (client, server) = h.connect().await;
                servers.lock().push(server);
                Ok::<_, String>(client)
            }
        }
    };
    // The call is in flight; once its line is written, the server drops
    // the connection, then the tool is let go.
    let cutter = {
        let servers = servers.clone();
        tokio::spawn(async move {
            started.await.unwrap();
            let server = servers.lock().pop().unwrap();
            server.cancel().await.unwrap();
            release.send(()).unwrap();
        })
    };
    let key = Key::for_tool_call("acme/agent", "task-7", "call_1").unwrap();
    let policy = RetryPolicy::new(20, Duration::from_millis(1), Duration::from_millis(20))
        .unwrap()
        .deadline(Duration::from_secs(60));
    let params = append("once");
    let result = call_tool_once(&key, params, &policy, connect)
        .await
        .unwrap();
    cutter.await.unwrap();
    assert_eq!(text_of(&result), "appended line 1");
    assert_eq!(h.tools.lines(), vec!["once"]);
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1);
    assert!(
        connections.load(Ordering::SeqCst) >= 2,
        "the retry used a new connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_helper_stops_on_a_conflict_with_the_key() {
    let h = Arc::new(Harness::new(McpOptions::new()));
    let (client, _server) = h.connect().await;
    client
        .call_tool(call("append", json!({"line": "first"}), "task-8:call_1"))
        .await
        .unwrap();
    let connect = connector(&h);
    let key = Key::for_tool_call("acme/agent", "task-8", "call_1").unwrap();
    let params = append("second");
    let error = call_tool_once(&key, params, &RetryPolicy::default(), connect)
        .await
        .unwrap_err();
    match error {
        CallError::Rejected {
            error: ToolCallError::Rpc(e),
            in_doubt,
            ..
        } => {
            assert_eq!(e.code.0, KEY_CONFLICT);
            assert!(!in_doubt);
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(h.tools.lines(), vec!["first"]);
}

/// A server's `IN_DOUBT` (its tool's backend went away mid-call) stops
/// `call_tool_once` in doubt on its first request: the tool may have
/// acted. It was a rejection that said the tool had not acted, since no
/// earlier request of the call had timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_helper_stops_in_doubt_on_an_answer_of_unknown_outcome() {
    let h = Arc::new(Harness::new(McpOptions::new()));
    let connect = connector(&h);
    let key = Key::for_tool_call("acme/agent", "task-9", "call_1").unwrap();
    let params = CallToolRequestParams::new("lost");
    let error = call_tool_once(&key, params, &RetryPolicy::default(), connect)
        .await
        .unwrap_err();
    assert!(error.is_in_doubt(), "{error:?}");
    match error {
        CallError::Rejected {
            error: ToolCallError::Rpc(e),
            ..
        } => assert_eq!(e.code.0, IN_DOUBT),
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1, "the tool ran once");
}

/// The SEP's wire form, byte for byte: the key beside `arguments`, the
/// capability under `tools`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sep_wire_form_over_stdio_framing() {
    let h = Harness::new(McpOptions::new());
    let (client_io, server_io) = tokio::io::duplex(1 << 16);
    let (server_read, server_write) = tokio::io::split(server_io);
    let server = IdempotentServer::new(AppendServer(Arc::clone(&h.tools)), Arc::clone(&h.store));
    let serving = tokio::spawn(async move {
        let running = server
            .serve(SepTransport::new(server_read, server_write))
            .await
            .unwrap();
        running.waiting().await.unwrap();
    });
    let (read, mut write) = tokio::io::split(client_io);
    let mut lines = BufReader::new(read).lines();
    let mut send = async |message: Value| {
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(b'\n');
        write.write_all(&bytes).await.unwrap();
    };
    send(
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"}}}),
    )
    .await;
    let init: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
    let capabilities = &init["result"]["capabilities"];
    assert_eq!(capabilities["tools"]["idempotency"], json!({}), "{init}");
    assert_eq!(
        capabilities["experimental"][CAPABILITY],
        json!({}),
        "{init}"
    );
    send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
    // A line that is not JSON is skipped; the stream goes on.
    send(json!("not a message")).await;
    let mut answers = Vec::new();
    for id in 1..=2 {
        send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "append", "arguments": {"line": "wire"}, "idempotencyKey": "sep-1"}}),
        )
        .await;
        let answer: Value =
            serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        answers.push(answer["result"].clone());
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(answers[0]["content"][0]["text"], "appended line 1");
    assert_eq!(h.tools.lines(), vec!["wire"]);
    // `"_meta": null` (a serializer's absent field) beside the key: the
    // key still counts, and the retry replays.
    let mut answers = Vec::new();
    for id in 3..=4 {
        send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "append", "arguments": {"line": "null meta"}, "idempotencyKey": "sep-2",
            "_meta": null}}),
        )
        .await;
        let answer: Value =
            serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
        answers.push(answer["result"].clone());
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(h.tools.lines(), vec!["wire", "null meta"]);
    // Each answer below within a hang guard: a request left unanswered
    // fails the test rather than hanging it.
    let mut next = async || -> Value {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("no answer")
            .unwrap()
            .unwrap();
        serde_json::from_str(&line).unwrap()
    };
    // `"idempotencyKey": null` is no key, as `"_meta": null` is no meta:
    // the call passes through, not refused, and a null key never hides one
    // under `_meta` (which replays).
    send(
        json!({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
        "name": "append", "arguments": {"line": "no key"}, "idempotencyKey": null}}),
    )
    .await;
    let answer = next().await;
    assert!(answer["result"].is_object(), "{answer}");
    // A request rmcp cannot read (`_meta` not an object) is answered, by
    // its id, not skipped; nothing runs.
    send(
        json!({"jsonrpc": "2.0", "id": 6, "method": "tools/call", "params": {
        "name": "append", "arguments": {"line": "malformed"}, "_meta": 5,
        "idempotencyKey": "sep-3"}}),
    )
    .await;
    let answer = next().await;
    assert_eq!(answer["id"], 6, "{answer}");
    assert_eq!(answer["error"]["code"], -32600, "{answer}");
    // An invalid key's message names the problem once.
    send(
        json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "append", "arguments": {"line": "bad key"}, "idempotencyKey": "bad\u{1}"}}),
    )
    .await;
    let answer = next().await;
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(
        message.matches("invalid idempotency key").count(),
        1,
        "{answer}"
    );
    // A null SEP key beside a key under `_meta`: the `_meta` key counts.
    let mut answers = Vec::new();
    for id in 8..=9 {
        send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "append", "arguments": {"line": "meta key"}, "idempotencyKey": null,
            "_meta": {"idempotencyKey": "sep-4"}}}),
        )
        .await;
        answers.push(next().await["result"].clone());
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(
        h.tools.lines(),
        vec!["wire", "null meta", "no key", "meta key"]
    );
    serving.abort();
}

/// A server that never answers cannot hold `call_tool_once` past its
/// policy's deadline: each request waits for its answer at most until
/// then, and the call ends as `Exhausted`, in doubt (the tool did run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_helper_ends_at_its_deadline_when_no_answer_comes() {
    let h = Arc::new(Harness::new(McpOptions::new()));
    let (started, release) = h.hold_next();
    let connect = connector(&h);
    let key = Key::for_tool_call("acme/agent", "task-9", "call_1").unwrap();
    let policy = RetryPolicy::new(3, Duration::from_millis(1), Duration::from_millis(5))
        .unwrap()
        .deadline(Duration::from_millis(300));
    let params = append("held");
    // Hang guard only: the call must end by itself at its deadline.
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        call_tool_once(&key, params, &policy, connect),
    )
    .await
    .expect("call_tool_once outlived its deadline");
    match ended {
        Err(error @ CallError::Exhausted { .. }) => assert!(error.is_in_doubt(), "{error:?}"),
        other => panic!("expected Exhausted, got {other:?}"),
    }
    started.await.unwrap();
    assert_eq!(h.tools.lines(), vec!["held"]);
    let _ = release.send(());
}

/// A failed `connect` sends nothing, so the next request is still the
/// call's first: it goes to a server that does not announce run-once
/// calls (a plain `rmcp` server here) instead of stopping as
/// `NotAnnounced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_does_not_count_as_a_request_sent() {
    let h = Arc::new(Harness::new(McpOptions::new()));
    let servers: Arc<Mutex<Vec<RunningService<RoleServer, AppendServer>>>> = Arc::default();
    let connects = Arc::new(AtomicUsize::new(0));
    let connect = {
        let (h, servers, connects) = (h.clone(), servers.clone(), connects.clone());
        move || {
            let (h, servers, connects) = (h.clone(), servers.clone(), connects.clone());
            async move {
                if connects.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err("connection refused".to_string());
                }
                let (client_io, server_io) = tokio::io::duplex(1 << 16);
                let plain = AppendServer(Arc::clone(&h.tools));
                let (server, client) = tokio::join!(plain.serve(server_io), ().serve(client_io));
                servers.lock().push(server.unwrap());
                Ok::<_, String>(client.unwrap())
            }
        }
    };
    let key = Key::for_tool_call("acme/agent", "task-10", "call_1").unwrap();
    let policy = RetryPolicy::new(5, Duration::from_millis(1), Duration::from_millis(5)).unwrap();
    let params = append("plain");
    let result = call_tool_once(&key, params, &policy, connect)
        .await
        .unwrap();
    assert_eq!(text_of(&result), "appended line 1");
    assert_eq!(connects.load(Ordering::SeqCst), 2);
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1);
}

/// A `connect` that never finishes (a server that hangs before
/// `initialize` is answered) ends the call at its deadline, and not in
/// doubt: no `tools/call` went out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_opens_ends_at_the_deadline_not_in_doubt() {
    let connect =
        || async { std::future::pending::<Result<RunningService<RoleClient, ()>, String>>().await };
    let key = Key::for_tool_call("acme/agent", "task-11", "call_1").unwrap();
    let policy = RetryPolicy::new(3, Duration::from_millis(1), Duration::from_millis(5))
        .unwrap()
        .deadline(Duration::from_millis(200));
    let params = append("never");
    // Hang guard only.
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        call_tool_once(&key, params, &policy, connect),
    )
    .await
    .expect("call_tool_once outlived its deadline");
    match ended {
        Err(error @ CallError::Exhausted { .. }) => assert!(!error.is_in_doubt(), "{error:?}"),
        other => panic!("expected Exhausted, got {other:?}"),
    }
}

/// A store over PostgreSQL at `url` in `schema` (migrated here), each call
/// bounded by 1 s, made off the runtime's threads (connecting blocks).
#[cfg(all(feature = "postgres", feature = "conformance"))]
async fn pg_store(url: String, schema: String) -> Arc<Store> {
    tokio::task::spawn_blocking(move || {
        idemstore::postgres::migrate(&url, &schema).expect("migrate");
        let mut limits = idemstore::PostgresLimits::default();
        limits.call_timeout = Duration::from_secs(1);
        limits.connect_timeout = Duration::from_secs(1);
        let config = Config::new()
            .postgres_schema(&schema)
            .sweep_interval(None)
            .postgres_limits(limits);
        Arc::new(Store::connect(&url, config).expect("connect"))
    })
    .await
    .expect("connecting")
}

/// The database unreachable (the tests' TCP proxy stops forwarding before
/// the store's first connection, so nothing is sent) is a store failure
/// that passes on its own: STORE_FAILED with
/// `data.transient: true` and the options' `retryAfterMs`; nothing ran,
/// and the same call once the database is back runs the tool once.
#[cfg(all(feature = "postgres", feature = "conformance"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_a_transient_store_failure() {
    use pg::proxy::{Proxy, upstream_of, via};
    let Some(url) = pg::url() else { return };
    let proxy = Proxy::start(upstream_of(&url));
    let mut h =
        Harness::new(McpOptions::new().unavailable_retry_after(Duration::from_millis(1500)));
    h.store = pg_store(via(&url, &proxy), pg::schema("mcp_transient")).await;
    let (client, _server) = h.connect().await;
    proxy.pause();
    let refused = rpc_error(
        client
            .call_tool(call("append", json!({"line": "x"}), "k-transient"))
            .await
            .unwrap_err(),
    );
    assert_eq!(refused.code.0, STORE_FAILED, "{refused:?}");
    let data = refused.data.as_ref().expect("data");
    assert_eq!(data["transient"], json!(true), "{refused:?}");
    assert_eq!(data["retryAfterMs"], json!(1500), "{refused:?}");
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 0);
    proxy.resume();
    let done = client
        .call_tool(call("append", json!({"line": "x"}), "k-transient"))
        .await
        .unwrap();
    assert_eq!(text_of(&done), "appended line 1");
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 1);
}

/// `call_tool_once` waits as a transient store failure asks
/// (`data.retryAfterMs`): a wait that ends past the policy's deadline ends
/// the call at its first answer, not in doubt, instead of sending it again
/// on the policy's millisecond backoff until the deadline.
#[cfg(all(feature = "postgres", feature = "conformance"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_helper_waits_as_a_transient_store_failure_asks() {
    use pg::proxy::{Proxy, upstream_of, via};
    let Some(url) = pg::url() else { return };
    let proxy = Proxy::start(upstream_of(&url));
    let mut h = Harness::new(McpOptions::new().unavailable_retry_after(Duration::from_secs(3600)));
    h.store = pg_store(via(&url, &proxy), pg::schema("mcp_retry_after")).await;
    proxy.pause();
    let h = Arc::new(h);
    let key = Key::for_tool_call("acme/agent", "task-10", "call_1").unwrap();
    let policy = RetryPolicy::new(1000, Duration::from_millis(1), Duration::from_millis(10))
        .unwrap()
        .deadline(Duration::from_secs(20));
    let error = call_tool_once(&key, append("later"), &policy, connector(&h))
        .await
        .unwrap_err();
    match error {
        CallError::Exhausted {
            attempts,
            limit,
            in_doubt,
            last_error: Some(ToolCallError::Rpc(e)),
            ..
        } => {
            assert_eq!(e.code.0, STORE_FAILED, "{e:?}");
            assert_eq!((attempts, limit, in_doubt), (1, Limit::Deadline, false));
        }
        other => panic!("expected the deadline after one answer, got {other:?}"),
    }
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 0);
}

/// A store that needs an operator (its primary key dropped behind its
/// back: `Misconfigured(SchemaDamaged)`) is STORE_FAILED with
/// `data.transient: false` and no `retryAfterMs`, and `call_tool_once`
/// stops at that answer (`Rejected`, not in doubt) instead of sending
/// the call again until its deadline; the tool never ran.
#[cfg(all(feature = "postgres", feature = "conformance"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_needs_an_operator_stops_the_client_helper() {
    use idemstore::postgres::tokio_postgres::{self, NoTls};
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("mcp_operator");
    let mut h = Harness::new(McpOptions::new());
    h.store = pg_store(url.clone(), schema.clone()).await;
    let (admin, connection) = tokio_postgres::connect(&url, NoTls).await.expect("admin");
    tokio::spawn(connection);
    admin
        .batch_execute(&format!(
            "ALTER TABLE {schema}.records DROP CONSTRAINT records_pkey"
        ))
        .await
        .expect("drop the primary key");
    let h = Arc::new(h);
    let connect = connector(&h);
    let key = Key::for_tool_call("acme/agent", "task-9", "call_1").unwrap();
    let policy = RetryPolicy::new(1000, Duration::from_millis(1), Duration::from_millis(10))
        .unwrap()
        .deadline(Duration::from_secs(5));
    let params = append("never");
    let error = call_tool_once(&key, params, &policy, connect)
        .await
        .unwrap_err();
    match error {
        CallError::Rejected {
            error: ToolCallError::Rpc(e),
            in_doubt,
            ..
        } => {
            assert_eq!(e.code.0, STORE_FAILED, "{e:?}");
            let data = e.data.as_ref().expect("data");
            assert_eq!(data["transient"], json!(false), "{e:?}");
            assert!(data.get("retryAfterMs").is_none(), "{e:?}");
            assert!(!in_doubt);
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(h.tools.runs.load(Ordering::SeqCst), 0);
}
