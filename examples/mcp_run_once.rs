//! Run-once MCP tool calls in one command:
//!
//! ```text
//! cargo run --example mcp_run_once --features mcp
//! ```
//!
//! An `rmcp` server with a `send_email` tool (it appends to an outbox
//! file) runs behind [`IdempotentServer`]; an agent calls the tool with
//! its stable tool-call key through [`call_tool_once`]. The first
//! connection is cut after the call arrived and before its answer went
//! back (the timeout the SEP is about), so the client retries on a new
//! connection: the email goes out once, and the retry gets the recorded
//! result. Then the same key with another recipient is refused as a
//! conflict.

use std::sync::Arc;
use std::time::Duration;

use idemstore::agent::RetryPolicy;
use idemstore::mcp::{IdempotentServer, KEY_CONFLICT, attach_key, call_tool_once};
use idemstore::{Key, Store};
use parking_lot::Mutex;
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer, RunningService, ServiceError, ServiceExt};
use serde_json::json;
use tokio::sync::oneshot;

/// The tool server: `send_email` appends `to: subject` to the outbox. The
/// first call tells `arrived` once it has sent, then waits for `go_on`
/// before it answers, so that `main` can cut the connection in between.
struct Mailer {
    outbox: std::path::PathBuf,
    hold: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
}

impl ServerHandler for Mailer {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::default();
        info.capabilities = ServerCapabilities::builder().enable_tools().build();
        info
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let field = |name: &str| {
            args.get(name)
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string()
        };
        let line = format!("{}: {}\n", field("to"), field("subject"));
        let mut outbox = std::fs::read_to_string(&self.outbox).unwrap_or_default();
        outbox.push_str(&line);
        std::fs::write(&self.outbox, &outbox)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let sent = outbox.lines().count();
        let hold = self.hold.lock().take();
        if let Some((arrived, go_on)) = hold {
            let _ = arrived.send(());
            let _ = go_on.await;
        }
        Ok(
            CallToolResult::success(vec![ContentBlock::text(format!("message #{sent} sent"))])
                .into(),
        )
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = Arc::new(Store::open(dir.path().join("mcp.redb"))?);
    let (arrived_tx, arrived) = oneshot::channel();
    let (go_on, go_on_rx) = oneshot::channel();
    let mailer = Arc::new(Mailer {
        outbox: dir.path().join("outbox.txt"),
        hold: Mutex::new(Some((arrived_tx, go_on_rx))),
    });

    // Each connection: an in-memory pipe, the wrapped server on one end.
    let servers: Arc<Mutex<Vec<RunningService<RoleServer, _>>>> = Arc::default();
    let connect = {
        let (store, mailer, servers) = (store.clone(), mailer.clone(), servers.clone());
        move || {
            let (store, mailer, servers) = (store.clone(), mailer.clone(), servers.clone());
            async move {
                let (client_io, server_io) = tokio::io::duplex(1 << 16);
                let server = IdempotentServer::new(SharedMailer(mailer), store);
                let (server, client) = tokio::join!(server.serve(server_io), ().serve(client_io));
                servers.lock().push(server.map_err(|e| e.to_string())?);
                client.map_err(|e| e.to_string())
            }
        }
    };
    // The network: once the email is out, the connection drops.
    let cut = {
        let servers = servers.clone();
        tokio::spawn(async move {
            let _ = arrived.await;
            let first = servers.lock().pop();
            if let Some(first) = first {
                let _ = first.cancel().await;
            }
            println!("connection lost after the email was sent; the agent retries");
            let _ = go_on.send(());
        })
    };

    let key = Key::for_tool_call("acme/agent", "task-42", "call_7")?;
    let params = CallToolRequestParams::new("send_email").with_arguments(
        json!({"to": "ops@example.com", "subject": "printer on fire"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
    );
    let policy = RetryPolicy::new(20, Duration::from_millis(5), Duration::from_millis(100))?;
    let result = call_tool_once(&key, params, &policy, &connect).await?;
    cut.await?;
    let text: String = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect();
    println!("the agent got: {text}");
    let outbox = std::fs::read_to_string(dir.path().join("outbox.txt"))?;
    println!("outbox ({} message):\n{outbox}", outbox.lines().count());

    // The same tool-call key with other arguments is a conflict.
    let client = connect().await?;
    let other = attach_key(
        CallToolRequestParams::new("send_email").with_arguments(
            json!({"to": "ceo@example.com", "subject": "printer on fire"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        ),
        &key,
    );
    match client.call_tool(other).await {
        Err(ServiceError::McpError(e)) if e.code.0 == KEY_CONFLICT => {
            println!("same key, other recipient: refused ({})", e.message);
        }
        other => return Err(format!("expected a conflict, got {other:?}").into()),
    }
    Ok(())
}

/// The mailer shared by every connection.
struct SharedMailer(Arc<Mailer>);

impl ServerHandler for SharedMailer {
    fn get_info(&self) -> ServerConfig {
        self.0.get_info()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.0.call_tool(request, context).await
    }
}
