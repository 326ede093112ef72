//! What the layer records of a tool call, and how it is split into
//! results, retryable failures and permanent failures.

use rmcp::model::{CallToolResult, CreateTaskResult, ErrorData, ServerResult};
use serde::{Deserialize, Serialize};

use crate::agent::Failure;

/// A final answer, recorded and replayed to every retry.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", content = "answer", rename_all = "camelCase")]
pub(crate) enum Recorded {
    /// The tool's result.
    Complete(CallToolResult),
    /// A task handle (the tasks extension): a retry gets the same task.
    Task(CreateTaskResult),
}

/// A failed answer. Only permanent ones are replayed.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", content = "answer", rename_all = "camelCase")]
pub(crate) enum Failed {
    /// A result with `isError: true`.
    ToolError(Box<CallToolResult>),
    /// A JSON-RPC error of the wrapped server.
    Error(Box<ErrorData>),
    /// An answer that is not an outcome (`InputRequiredResult`, or any
    /// other result type).
    NotFinal,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::ToolError(_) => f.write_str("the tool answered an error"),
            Failed::Error(error) => write!(f, "JSON-RPC error {}: {}", error.code.0, error.message),
            Failed::NotFinal => f.write_str("the answer was not a final outcome"),
        }
    }
}

impl Recorded {
    /// The answer to send.
    pub(crate) fn into_answer(self) -> ServerResult {
        match self {
            Recorded::Complete(result) => ServerResult::CallToolResult(result),
            Recorded::Task(task) => ServerResult::CreateTaskResult(task),
        }
    }
}

impl Failed {
    /// The answer to send when the failure is replayed.
    pub(crate) fn into_answer(self) -> Result<ServerResult, ErrorData> {
        match self {
            Failed::ToolError(result) => Ok(ServerResult::CallToolResult(*result)),
            Failed::Error(error) => Err(*error),
            Failed::NotFinal => Err(ErrorData::internal_error(
                "the recorded answer of this key is not a final outcome",
                None,
            )),
        }
    }
}

/// Splits the wrapped server's answer:
/// - a result without `isError` → recorded;
/// - a task handle → recorded;
/// - a result with `isError: true` → a failure, retryable when `retryable`
///   says so, permanent otherwise;
/// - a JSON-RPC error → a retryable failure: under MCP's split between
///   protocol errors and tool errors (SEP-1303), a JSON-RPC error means
///   the tool did not produce a result (an unknown tool, malformed
///   arguments, a server fault), so running it again is the retry the
///   client asks for;
/// - anything else (an `InputRequiredResult`) → a retryable failure, since
///   the call has not finished.
///
/// Two JSON-RPC errors never reach it: `IN_DOUBT`, and any error answered
/// after the call was cancelled; the server records nothing for them
/// (`IdempotentServer`).
pub(crate) fn classify(
    answer: &Result<ServerResult, ErrorData>,
    retryable: impl Fn(&CallToolResult) -> bool,
) -> Result<Recorded, Failure<Failed>> {
    match answer {
        Ok(ServerResult::CallToolResult(result)) if result.is_error == Some(true) => {
            let failed = Failed::ToolError(Box::new(result.clone()));
            if retryable(result) {
                Err(Failure::retryable(failed))
            } else {
                Err(Failure::permanent(failed))
            }
        }
        Ok(ServerResult::CallToolResult(result)) => Ok(Recorded::Complete(result.clone())),
        Ok(ServerResult::CreateTaskResult(task)) => Ok(Recorded::Task(task.clone())),
        Ok(_) => Err(Failure::retryable(Failed::NotFinal)),
        Err(error) => Err(Failure::retryable(Failed::Error(Box::new(error.clone())))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::ContentBlock as Content;

    #[test]
    fn errors_split_as_documented() {
        let ok = Ok(ServerResult::CallToolResult(CallToolResult::success(vec![
            Content::text("done"),
        ])));
        assert!(matches!(classify(&ok, |_| true), Ok(Recorded::Complete(_))));
        let tool_error = Ok(ServerResult::CallToolResult(CallToolResult::error(vec![
            Content::text("no such order"),
        ])));
        assert!(!classify(&tool_error, |_| false).unwrap_err().is_retryable());
        assert!(classify(&tool_error, |_| true).unwrap_err().is_retryable());
        let rpc = Err(ErrorData::invalid_params("bad", None));
        assert!(classify(&rpc, |_| false).unwrap_err().is_retryable());
    }

    #[test]
    fn recorded_answers_survive_json() {
        let result = CallToolResult::success(vec![Content::text("line 1")]);
        let bytes = serde_json::to_vec(&Recorded::Complete(result.clone())).unwrap();
        match serde_json::from_slice::<Recorded>(&bytes).unwrap() {
            Recorded::Complete(back) => assert_eq!(back, result),
            Recorded::Task(_) => panic!("a result came back as a task"),
        }
    }
}
