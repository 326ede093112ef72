//! Run-once MCP tool calls (feature `mcp`), on `rmcp`, the official Rust
//! SDK of the Model Context Protocol.
//!
//! An MCP client whose `tools/call` timed out cannot tell "never arrived"
//! from "ran, answer lost", and retries. SEP-3182 ("Request Idempotency")
//! proposes an optional `idempotencyKey` on `tools/call`, a
//! `tools.idempotency` capability, and a conflict error for a key reused
//! with other arguments. This module gives both ends of that:
//!
//! - [`IdempotentServer`] wraps an `rmcp` server: a `tools/call` carrying
//!   a key runs the tool once per key, over any [`Store`](crate::Store);
//!   finished calls replay the recorded `CallToolResult`;
//! - [`SepTransport`] serves it over stdio in the SEP's wire form (the key
//!   beside `arguments`, the capability under `tools`);
//! - [`call_tool_once`] is the client's side: it attaches the stable
//!   tool-call key ([`Key::for_tool_call`](crate::Key::for_tool_call)) to
//!   every request and retries with the agent feature's query-before-retry
//!   driver;
//! - `idemstore mcp-proxy --store PATH -- COMMAND ARGS…` (the CLI's
//!   feature `mcp`) puts all of it in front of any stdio MCP server.
//!
//! `docs/mcp.md` says how this follows the SEP point by point, where it
//! differs, and what is and is not safe.
//!
//! ```
//! use std::sync::Arc;
//! use idemstore::Store;
//! use idemstore::mcp::{IdempotentServer, McpOptions};
//! use rmcp::handler::server::ServerHandler;
//!
//! struct Tools; // any rmcp server
//! impl ServerHandler for Tools {}
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let store = Arc::new(Store::open(dir.path().join("mcp.redb"))?);
//! let server = IdempotentServer::with_options(Tools, store, McpOptions::new().scope_prefix("acme/"));
//! // serve it as the wrapped server would be: `server.serve(transport).await`
//! # drop(server);
//! # Ok(())
//! # }
//! ```

mod client;
mod codes;
mod options;
mod outcome;
mod request;
mod server;
mod wire;

pub use client::{ToolCallError, announces_idempotency, attach_key, call_tool_once};
pub use codes::{IN_DOUBT, IN_PROGRESS, KEY_CONFLICT, STORE_FAILED};
pub use options::McpOptions;
pub use request::META_KEY;
pub use server::{CAPABILITY, IdempotentServer, announce};
pub use wire::{
    MAX_LINE_BYTES, SepTransport, SepTransportError, announce_in_result, sep_key_to_meta,
};
