//! A plain stdio MCP server (no idemstore in it) with one tool with a side
//! effect: `append` adds a line to a file. The proxy's tests and
//! `docs/mcp.md` put `idemstore mcp-proxy` in front of it.
//!
//! ```text
//! cargo run --example mcp_append_server --features mcp -- FILE
//! ```
//!
//! `append` takes `{"line": "..."}` and answers `appended line N` (N the
//! number of lines in the file afterwards). Two optional arguments hold the
//! call open, for tests that kill a proxy during a call: `started`, a FIFO
//! the tool writes one byte to once the line is written, and `release`, a
//! FIFO it then reads from before it answers.

use std::io::Write as _;
use std::path::PathBuf;

use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock as Content,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer, ServiceExt};
use serde_json::json;

struct Append {
    file: PathBuf,
}

fn append_tool() -> Tool {
    let schema = json!({
        "type": "object",
        "properties": {
            "line": {"type": "string"},
            "started": {"type": "string"},
            "release": {"type": "string"}
        },
        "required": ["line"]
    });
    let schema = schema.as_object().cloned().unwrap_or_default();
    Tool::new("append", "Append a line to the file", schema)
}

impl Append {
    fn append(&self, line: &str) -> std::io::Result<usize> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)?;
        writeln!(file, "{line}")?;
        file.sync_all()?;
        Ok(std::fs::read_to_string(&self.file)?.lines().count())
    }
}

impl ServerHandler for Append {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::default();
        info.capabilities = ServerCapabilities::builder().enable_tools().build();
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(vec![append_tool()]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if request.name != "append" {
            return Err(ErrorData::invalid_params("no such tool", None));
        }
        let arguments = request.arguments.unwrap_or_default();
        let text = |name: &str| {
            arguments
                .get(name)
                .and_then(|v| v.as_str())
                .map(str::to_string)
        };
        let line =
            text("line").ok_or_else(|| ErrorData::invalid_params("line is required", None))?;
        let count = self
            .append(&line)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        if let (Some(started), Some(release)) = (text("started"), text("release")) {
            let hold = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(started)?
                    .write_all(b"1")?;
                let mut byte = Vec::new();
                std::io::Read::read_to_end(&mut std::fs::File::open(release)?, &mut byte)?;
                Ok(())
            });
            hold.await
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        }
        Ok(CallToolResult::success(vec![Content::text(format!("appended line {count}"))]).into())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .ok_or("usage: mcp_append_server FILE")?;
    let service = Append { file }.serve(rmcp::transport::stdio()).await?;
    service.waiting().await?;
    Ok(())
}
