//! SEP-3182's wire form over a newline-delimited JSON-RPC stream (stdio):
//! `params.idempotencyKey` moved into `_meta` before `rmcp` parses a
//! request, and `capabilities.tools.idempotency` written into the
//! initialize and discover results after `rmcp` serializes them.

use std::sync::Arc;

use rmcp::service::{RoleServer, RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::request::META_KEY;

/// The longest line [`SepTransport`] reads: 16 MiB. A longer line is
/// discarded (logged), up to its newline; the stream goes on.
pub const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// Moves SEP-3182's `params.idempotencyKey` of a `tools/call` request into
/// `params._meta.idempotencyKey`, where `rmcp` keeps it and
/// [`IdempotentServer`](super::IdempotentServer) reads it. Returns whether
/// the message was changed.
///
/// A key already in `_meta` that differs from the one in `params` is
/// replaced by the one in `params` (the SEP's place wins) and the change is
/// logged. Messages of any other shape are left alone.
///
/// ```
/// use idemstore::mcp::sep_key_to_meta;
/// use serde_json::json;
///
/// let mut call = json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
///     "params": {"name": "append", "arguments": {"line": "x"}, "idempotencyKey": "task-1:call-1"}});
/// assert!(sep_key_to_meta(&mut call));
/// assert_eq!(call["params"]["_meta"]["idempotencyKey"], "task-1:call-1");
/// assert!(call["params"].get("idempotencyKey").is_none());
/// ```
pub fn sep_key_to_meta(message: &mut Value) -> bool {
    if message.get("method").and_then(Value::as_str) != Some("tools/call") {
        return false;
    }
    let Some(params) = message.get_mut("params").and_then(Value::as_object_mut) else {
        return false;
    };
    // A `null` key is no key, and never overwrites one under `_meta`.
    let key = match params.remove("idempotencyKey") {
        None | Some(Value::Null) => return false,
        Some(key) => key,
    };
    let meta = params
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    // `"_meta": null` is how many serializers write an absent field, and
    // rmcp reads it as absent: the key goes into a new object, else it
    // would be dropped and the call run on every retry.
    if meta.is_null() {
        *meta = Value::Object(Map::new());
    }
    match meta.as_object_mut() {
        Some(meta) => {
            if let Some(old) = meta.insert(META_KEY.to_string(), key)
                && Some(&old) != meta.get(META_KEY)
            {
                tracing::warn!(
                    "tools/call carried two different idempotency keys; params.idempotencyKey wins"
                );
            }
        }
        None => {
            // `_meta` is not an object: the request is malformed, and
            // rmcp cannot read it (the transport answers it -32600); keep
            // the key beside it so nothing is lost.
            params.insert("idempotencyKey".to_string(), key);
            return false;
        }
    }
    true
}

/// Writes `capabilities.tools.idempotency: {}` into an initialize or
/// discover result (a JSON-RPC response whose `result` has `capabilities`
/// and `protocolVersion` or `supportedVersions`) that announces tools.
/// Returns whether the message was changed.
pub fn announce_in_result(message: &mut Value) -> bool {
    let Some(result) = message.get_mut("result").and_then(Value::as_object_mut) else {
        return false;
    };
    if !result.contains_key("protocolVersion") && !result.contains_key("supportedVersions") {
        return false;
    }
    let Some(tools) = result
        .get_mut("capabilities")
        .and_then(|c| c.get_mut("tools"))
        .and_then(Value::as_object_mut)
    else {
        return false;
    };
    tools.insert("idempotency".to_string(), Value::Object(Map::new()));
    true
}

/// Errors of [`SepTransport`]: writing to the stream failed.
#[derive(Debug, thiserror::Error)]
#[error("writing an MCP message failed: {0}")]
pub struct SepTransportError(#[from] std::io::Error);

/// A server-side `rmcp` transport over a byte stream of newline-delimited
/// JSON-RPC messages (stdio), that speaks SEP-3182's wire form: each
/// incoming message goes through [`sep_key_to_meta`], each outgoing one
/// through [`announce_in_result`].
///
/// Every incoming line is hostile: a line over [`MAX_LINE_BYTES`], one that
/// is not JSON, or one that is not a client message is logged and
/// skipped (so its sender gets no answer, as from `rmcp`'s own stdio
/// transport).
pub struct SepTransport<R, W> {
    reader: BufReader<R>,
    /// The line being read (see [`read_line`]).
    part: PartLine,
    writer: Arc<tokio::sync::Mutex<W>>,
}

impl<R, W> std::fmt::Debug for SepTransport<R, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SepTransport").finish_non_exhaustive()
    }
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> SepTransport<R, W> {
    /// A transport reading client messages from `read` and writing server
    /// messages to `write`.
    pub fn new(read: R, write: W) -> Self {
        SepTransport {
            reader: BufReader::new(read),
            part: PartLine::default(),
            writer: Arc::new(tokio::sync::Mutex::new(write)),
        }
    }
}

/// A line being read: the bytes read so far, kept across calls of
/// [`read_line`] so that a read cancelled mid-line (`rmcp` polls
/// `receive` in a `select!` and drops it when another branch is ready)
/// loses nothing; and whether the rest of an over-long line is being
/// skipped.
#[derive(Debug, Default)]
struct PartLine {
    bytes: Vec<u8>,
    skipping: bool,
}

/// Reads one line of at most `MAX_LINE_BYTES` (plus its newline); `None`
/// at the end of the stream or on a read error; `Some(None)` for a line
/// that was too long (discarded up to its newline). Cancel-safe: what was
/// read stays in `part` (`read_until` appends to it as it reads), and the
/// next call goes on from there. Memory: at most `MAX_LINE_BYTES + 1`
/// bytes of a line, however long it is.
async fn read_line<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
    part: &mut PartLine,
) -> Option<Option<Vec<u8>>> {
    let limit = MAX_LINE_BYTES.saturating_add(1);
    loop {
        let room = u64::try_from(limit.saturating_sub(part.bytes.len())).unwrap_or(u64::MAX);
        if let Err(e) = (&mut *reader)
            .take(room)
            .read_until(b'\n', &mut part.bytes)
            .await
        {
            tracing::warn!(error = %e, "reading an MCP message failed");
            return None;
        }
        if part.bytes.ends_with(b"\n") {
            let line = std::mem::take(&mut part.bytes);
            if std::mem::take(&mut part.skipping) {
                tracing::warn!(
                    limit = MAX_LINE_BYTES,
                    "an MCP message over the line limit was skipped"
                );
                return Some(None);
            }
            return Some(Some(line));
        }
        if part.bytes.len() >= limit {
            // Too long: the rest of the line is read and dropped.
            part.bytes.clear();
            part.skipping = true;
            continue;
        }
        // The stream ended (with a last line that has no newline).
        if part.skipping || part.bytes.is_empty() {
            return None;
        }
        return Some(Some(std::mem::take(&mut part.bytes)));
    }
}

impl<R, W> Transport<RoleServer> for SepTransport<R, W>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    type Error = SepTransportError;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let writer = Arc::clone(&self.writer);
        async move {
            let mut value = serde_json::to_value(&item).map_err(std::io::Error::other)?;
            announce_in_result(&mut value);
            let mut bytes = serde_json::to_vec(&value).map_err(std::io::Error::other)?;
            bytes.push(b'\n');
            let mut writer = writer.lock().await;
            writer.write_all(&bytes).await?;
            writer.flush().await?;
            Ok(())
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            let Some(line) = read_line(&mut self.reader, &mut self.part).await? else {
                continue;
            };
            // A byte order mark is not JSON; `rmcp`'s own framing drops it too.
            let text = line.trim_ascii();
            let text = text.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(text);
            if text.is_empty() {
                continue;
            }
            let mut value: Value = match serde_json::from_slice(text) {
                Ok(value) => value,
                Err(e) => {
                    tracing::warn!(error = %e, "an MCP message that is not JSON was skipped");
                    continue;
                }
            };
            drop(line);
            // The message is read again from the tree's bytes, with no
            // tree alive beside it: `rmcp`'s message type is untagged,
            // which serde reads through a buffered copy of the whole
            // message, and `from_value` would hold the tree, that copy and
            // the message at once (three copies of a request's arguments in
            // memory). The tree's bytes, not the line: the tree is what
            // `sep_key_to_meta` read (a member given twice, the last), so
            // the layer and `rmcp` see one message.
            sep_key_to_meta(&mut value);
            // A request's id, to answer it should rmcp not read it.
            let request_id = value
                .get("method")
                .and(value.get("id"))
                .filter(|id| id.is_string() || id.is_number())
                .cloned();
            let bytes = serde_json::to_vec(&value);
            drop(value);
            let parsed = bytes.and_then(|bytes| serde_json::from_slice(&bytes));
            match parsed {
                Ok(message) => return Some(message),
                Err(e) => {
                    tracing::warn!(error = %e, "an MCP message of unknown shape was skipped");
                    // A request is answered, so that its caller does not
                    // wait for ever (JSON-RPC 2.0: -32600, Invalid Request).
                    if let Some(id) = request_id {
                        let refusal = serde_json::json!({
                            "jsonrpc": "2.0",
                            "id": id,
                            "error": {
                                "code": -32600,
                                "message": format!("invalid request: {e}"),
                            },
                        });
                        let mut bytes = refusal.to_string().into_bytes();
                        bytes.push(b'\n');
                        // Written by a task of its own, under the writer's
                        // lock as `send`'s lines are: `receive` is dropped
                        // whenever rmcp has something else to do, and must
                        // not be cut in the middle of a line, nor stop
                        // reading while the client does not read.
                        let writer = Arc::clone(&self.writer);
                        tokio::spawn(async move {
                            let mut writer = writer.lock().await;
                            if writer.write_all(&bytes).await.is_ok() {
                                let _ = writer.flush().await;
                            }
                        });
                    }
                }
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.writer.lock().await.shutdown().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_tool_calls_move_their_key() {
        let mut other = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list",
            "params": {"idempotencyKey": "k"}});
        assert!(!sep_key_to_meta(&mut other));
        assert_eq!(other["params"]["idempotencyKey"], "k");
        let mut bad_meta = json!({"method": "tools/call", "params": {"name": "t", "_meta": 3, "idempotencyKey": "k"}});
        assert!(!sep_key_to_meta(&mut bad_meta));
        assert_eq!(bad_meta["params"]["idempotencyKey"], "k");
        let mut both = json!({"method": "tools/call", "params": {"name": "t",
            "_meta": {"idempotencyKey": "old"}, "idempotencyKey": "new"}});
        assert!(sep_key_to_meta(&mut both));
        assert_eq!(both["params"]["_meta"]["idempotencyKey"], "new");
        let mut null_meta = json!({"method": "tools/call", "params": {"name": "t",
            "_meta": null, "idempotencyKey": "k"}});
        assert!(sep_key_to_meta(&mut null_meta));
        assert_eq!(null_meta["params"]["_meta"], json!({"idempotencyKey": "k"}));
    }

    #[test]
    fn the_capability_goes_where_the_sep_puts_it() {
        let mut init = json!({"jsonrpc": "2.0", "id": 0, "result": {"protocolVersion": "2025-06-18",
            "capabilities": {"tools": {"listChanged": false}}, "serverInfo": {"name": "s", "version": "1"}}});
        assert!(announce_in_result(&mut init));
        assert_eq!(
            init["result"]["capabilities"]["tools"]["idempotency"],
            json!({})
        );
        let mut no_tools =
            json!({"id": 0, "result": {"protocolVersion": "2025-06-18", "capabilities": {}}});
        assert!(!announce_in_result(&mut no_tools));
        let mut call = json!({"id": 1, "result": {"content": [], "capabilities": {"tools": {}}}});
        assert!(!announce_in_result(&mut call));
    }

    #[tokio::test]
    async fn long_lines_are_skipped_and_the_stream_goes_on() {
        let mut input = vec![b'x'; MAX_LINE_BYTES + 10];
        input.push(b'\n');
        input.extend_from_slice(b"{\"a\":1}\n");
        input.extend_from_slice(b"{\"b\":2}");
        let mut reader = BufReader::new(&input[..]);
        let mut part = PartLine::default();
        assert_eq!(read_line(&mut reader, &mut part).await, Some(None));
        assert_eq!(
            read_line(&mut reader, &mut part).await,
            Some(Some(b"{\"a\":1}\n".to_vec()))
        );
        assert_eq!(
            read_line(&mut reader, &mut part).await,
            Some(Some(b"{\"b\":2}".to_vec()))
        );
        assert_eq!(read_line(&mut reader, &mut part).await, None);
    }

    /// A transport reading what the returned client end writes.
    fn piped() -> (
        tokio::io::DuplexStream,
        SepTransport<
            tokio::io::ReadHalf<tokio::io::DuplexStream>,
            tokio::io::WriteHalf<tokio::io::DuplexStream>,
        >,
    ) {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (read, write) = tokio::io::split(server);
        (client, SepTransport::new(read, write))
    }

    /// A member given twice is read as the tree reads it (the last), by
    /// the layer and by `rmcp` alike: the message is answered, as it was
    /// before the transport read it again from bytes.
    #[tokio::test]
    async fn a_member_given_twice_is_read_once_as_the_last() {
        use tokio::io::AsyncWriteExt;
        let (mut client, mut transport) = piped();
        client
            .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"id\":2}\n")
            .await
            .unwrap();
        drop(client);
        let message = Transport::<RoleServer>::receive(&mut transport)
            .await
            .expect("the message");
        let message = serde_json::to_value(&message).unwrap();
        assert_eq!(message["id"], 2, "{message}");
    }

    /// A `receive` dropped while a line is half read (as `rmcp`'s
    /// `select!` drops it when it has an answer to send) loses nothing: the
    /// next `receive` returns the whole message. (The half read was lost,
    /// the rest skipped as not JSON, and the request never answered.) So
    /// does a message after a byte order mark.
    #[tokio::test]
    async fn a_receive_cancelled_mid_line_loses_nothing() {
        use futures_lite::future::poll_once;
        use tokio::io::AsyncWriteExt;
        let (mut client, mut transport) = piped();
        client
            .write_all(b"\xEF\xBB\xBF{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"}\n")
            .await
            .unwrap();
        client
            .write_all(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"meth")
            .await
            .unwrap();
        let first = Transport::<RoleServer>::receive(&mut transport).await;
        assert!(first.is_some(), "the message after the mark");
        // Polled once (the half line is read) and dropped.
        assert!(
            poll_once(Transport::<RoleServer>::receive(&mut transport))
                .await
                .is_none()
        );
        client.write_all(b"od\":\"ping\"}\n").await.unwrap();
        drop(client);
        let second = Transport::<RoleServer>::receive(&mut transport)
            .await
            .expect("the whole second message");
        let second = serde_json::to_value(&second).unwrap();
        assert_eq!(second["id"], 2, "{second}");
    }
}
