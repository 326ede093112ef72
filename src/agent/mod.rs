//! Agent tool calls that take effect once (feature `agent`).
//!
//! An agent duplicates side effects in more ways than a web client does: the
//! model client retries a model request and the provider mints new
//! tool-call ids, a task resumed after a crash asks the model again, the
//! model re-plans a call it already made under a new id, a network loses the
//! response of a call that succeeded. Each way has a layer that stops it,
//! and they stack:
//!
//! | duplicate | layer that stops it |
//! |---|---|
//! | a model request retried, a task resumed after a crash (new tool-call ids) | the **model-turn journal**: each turn runs once through [`Store::execute`] under [`Key::for_model_turn`], so a resumed task replays the recorded response and gets the same tool-call ids |
//! | the same tool call run again (resume, redelivery) | the **tool-call key** [`Key::for_tool_call`] (`task_id:tool_call_id`) with [`Store::execute`]: the recorded result is replayed |
//! | a tool call whose holder crashed mid-effect | the **in-doubt policy** of [`Store::execute`]: ask the downstream ([`InDoubt::Probe`]), re-run, or refuse for a person |
//! | the model re-plans the same call with a new tool-call id | the **intent key** [`Key::for_intent`] (`task_id:tool:digest(params)`), for tools where two equal calls in one task are always a duplicate |
//! | a response lost on the network, a flaky service | the **call driver** [`call`]: one key for every attempt, query before sending again |
//!
//! # Stable tool-call ids first
//!
//! A tool-call key is only as stable as the tool-call id in it, and a
//! provider mints new ids whenever a model request is retried. So record the
//! model's response before any tool runs: run the model turn itself through
//! [`Store::execute`], once per (task, turn). Temporal, Restate and DBOS
//! journal their steps the same way.
//!
//! ```
//! use idemstore::{Fingerprint, Key, Lease, Store};
//! use idemstore::agent::{ExecuteOptions, Failure, Origin};
//! use serde_json::{Value, json};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("agent.redb");
//! // A model that mints a new tool-call id on every request, as providers do.
//! let mut minted = 0;
//! let mut ask_model = |_history: &Value| {
//!     minted += 1;
//!     json!({"tool_calls": [{"id": format!("call_{minted}"), "name": "tickets.create",
//!                            "params": {"title": "printer on fire"}}]})
//! };
//! let history = json!([{"role": "user", "content": "my printer is on fire"}]);
//!
//! let mut run_turn = |store: &Store| -> Result<Value, Box<dyn std::error::Error>> {
//!     let turn = Key::for_model_turn("acme/agent.turns", "task-42", 0)?;
//!     let asked = store.execute(
//!         &turn,
//!         &Fingerprint::of_json(&history)?,
//!         // Asking the model again is harmless: re-run a turn left in doubt.
//!         ExecuteOptions::new().rerun_in_doubt(),
//!         |_lease: &Lease| Ok::<_, Failure<String>>(ask_model(&history)),
//!     )?;
//!     Ok(asked.into_value())
//! };
//!
//! let store = Store::open(&path)?;
//! let first = run_turn(&store)?;
//! drop(store); // the agent restarts...
//! let store = Store::open(&path)?;
//! let resumed = run_turn(&store)?; // ...and replays the recorded turn
//! assert_eq!(first["tool_calls"][0]["id"], "call_1");
//! assert_eq!(resumed["tool_calls"][0]["id"], "call_1"); // the same id
//!
//! // Now the tool-call key is stable: run the tool once per tool call.
//! let call = &resumed["tool_calls"][0];
//! let params = &call["params"];
//! let key = Key::for_tool_call("acme/tickets.create", "task-42", call["id"].as_str().unwrap())?;
//! let ticket = store.execute(&key, &Fingerprint::of_json(params)?, ExecuteOptions::new(), |_lease| {
//!     Ok::<_, Failure<String>>("T-1001".to_string()) // create the ticket here
//! })?;
//! assert_eq!(ticket.origin(), Origin::Ran);
//! # Ok(())
//! # }
//! ```
//!
//! # Which key stops what
//!
//! - [`Key::for_tool_call`] stops the same tool call run twice. It never
//!   merges two calls the model made on purpose, so it suits every tool.
//! - [`Key::for_intent`] also stops a call the model re-planned under a new
//!   tool-call id with the same parameters (member order inside objects does
//!   not matter, array order and types do). It merges *every* equal call in
//!   one task, so use it only where that is always right: a charge for the
//!   same order, a ticket with the same title. Nest it inside the tool-call
//!   execution, as `examples/agent_tools.rs` does, to see which layer
//!   stopped what.
//! - [`Fingerprint::of_json`] binds a key to its parameters (RFC 8785
//!   canonical JSON), so a key reused with other parameters is refused
//!   ([`Error::FingerprintMismatch`](crate::Error::FingerprintMismatch))
//!   rather than replayed.
//!
//! # The other end of the network
//!
//! The store cannot make a remote effect and its record one atomic step.
//! Pass the key on (as the request's idempotency key or external
//! reference), call the service with [`call`], which queries before it
//! sends again after a timeout, and give [`Store::execute`] a probe that
//! asks the service what happened when a takeover is in doubt:
//!
//! ```
//! use std::collections::HashMap;
//! use std::time::Duration;
//! use idemstore::{Fingerprint, Key, Lease, Store};
//! use idemstore::agent::{call, CallError, ExecuteOptions, Failure, RemoteError, RemoteStatus, RetryPolicy};
//! use serde_json::json;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let store = Store::open(dir.path().join("pay.redb"))?;
//! // A gateway that charges, then loses the first response.
//! let charges = std::cell::RefCell::new(HashMap::<String, String>::new());
//! let mut lose_next = true;
//! let mut charge = |key: &Key| {
//!     let id = format!("ch_{}", charges.borrow().len() + 1);
//!     charges.borrow_mut().insert(key.reference(), id.clone());
//!     if std::mem::take(&mut lose_next) { Err(RemoteError::TimedOut) } else { Ok(id) }
//! };
//! let lookup = |key: &Key| -> Result<RemoteStatus<String>, RemoteError<String>> {
//!     Ok(match charges.borrow().get(&key.reference()) {
//!         Some(id) => RemoteStatus::Done(id.clone()),
//!         None => RemoteStatus::NotFound,
//!     })
//! };
//!
//! let params = json!({"order": "A-17", "amount_cents": 4200});
//! let key = Key::for_intent("acme/payments.charge", "task-42", "charge", &params)?;
//! let policy = RetryPolicy::new(5, Duration::from_millis(1), Duration::from_millis(8))?;
//! let options = ExecuteOptions::new().probe_in_doubt(|lease: &Lease| match lookup(lease.key()) {
//!     Ok(RemoteStatus::Done(id)) => Ok(Some(id)),
//!     Ok(_) => Ok(None),
//!     Err(_) => Err("gateway unreachable".to_string()),
//! });
//! let charged = store.execute(&key, &Fingerprint::of_json(&params)?, options, |lease| {
//!     call(lease.key(), &policy, &mut charge, lookup).map_err(|e| match e {
//!         // Refused for good, and the service did not act: replayed.
//!         CallError::Rejected { in_doubt: false, .. } => Failure::permanent(e.to_string()),
//!         // It may have acted, or its limits ran out (five 503s): the
//!         // next call sends again with the key, which it deduplicates.
//!         _ => Failure::retryable(e.to_string()),
//!     })
//! })?;
//! assert_eq!(charged.value(), "ch_1");
//! assert_eq!(charges.borrow().len(), 1); // charged once, though the response was lost
//! # Ok(())
//! # }
//! ```
//!
//! # Waiting for another holder
//!
//! When [`Store::execute`] finds the key held by a valid lease, it waits for
//! the outcome up to [`ExecuteOptions::wait`]. A holder that is an `execute`
//! of the same [`Store`] wakes its waiters directly after it records the
//! outcome: the store keeps a small registry of waited-on keys for that. A
//! holder in another process is seen by polling, with delays that double
//! between [`ExecuteOptions::poll_delays`] bounds, with jitter.

mod call;
mod execute;
mod finite;
pub(crate) mod keys;
mod notify;

pub use call::{CallError, Limit, RemoteError, RemoteStatus, RetryPolicy, call, call_async};
pub use execute::{
    AsyncProbe, ExecuteError, ExecuteOptions, Executed, Failure, InDoubt, NoProbe, Origin, Probe,
};
pub(crate) use notify::Waiters;

#[cfg(doc)]
use crate::{Fingerprint, Key, Store};
