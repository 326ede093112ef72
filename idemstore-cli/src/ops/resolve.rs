//! `idemstore resolve STORE SCOPE ID --token N (--succeeded VALUE | --failed VALUE) [--amend] [--raw] [--not-http-layer] [--while-held]`:
//! finish a Processing record after asking the downstream system what
//! happened, or (`--amend`) correct the outcome of a finished one.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use idemstore::{Error, Key, Resolution, State, Store};

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore resolve`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "The outcome is a JSON value by default (a string is quoted: --succeeded '\"T-42\"'), because a record made by Store::execute (the agent feature: tool calls, intents) replays its result and failure as JSON: bytes that are not JSON would make every later retry of the key fail until retention ends. Give --raw to store other bytes, for a record whose service reads its outcome as plain bytes.\n\n\
A record of the HTTP layer (scope [tenant/]METHOD route) replays a stored HTTP response, which resolve cannot write: give it --failed VALUE --retryable, so that the client's retry runs the handler again, which finds its effect by the key's reference. Any other outcome is refused for a scope of that form (a standard method, a space, then / or #); --not-http-layer takes it for a scope that only looks so. The check reads the scope only: a layer with a custom method or route form is not recognized.\n\n\
The token fences the change: if the record was completed, \
failed, released or taken over since you read it, nothing changes and the command fails \
(exit 2), saying which: no record for the key (absent or past retention), the record is \
already finished (its state and token; --amend corrects a finished record), or the token \
is not its current holder's (never issued for it, or taken over since; the current token \
is shown). A record whose lease is still valid is refused unless --while-held: its holder may still be running the work. Find candidates with `idemstore list STORE --compensation` (or `--lapsed`)."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// The key's scope (tenant and operation), e.g. acme/tickets.create; or,
    /// with no ID, a whole key as the library prints it
    /// (acme/tickets.create/task-1:call-1), split at the `/` after which a
    /// record exists.
    scope: String,
    /// The idempotency key within the scope. Without it, SCOPE is a whole
    /// key as the library prints it, split as `get` splits it.
    id: Option<String>,
    /// The record's fencing token, as `get` or `list` showed it.
    #[arg(long)]
    token: u64,
    /// The work took effect: store this result (a JSON value unless --raw),
    /// replayed to every retry.
    #[arg(long, value_name = "VALUE", group = "outcome")]
    succeeded: Option<String>,
    /// The work did not take effect: store this failure (a JSON value
    /// unless --raw).
    #[arg(long, value_name = "VALUE", group = "outcome")]
    failed: Option<String>,
    /// With --failed: let the next claim run the work again.
    #[arg(long, requires = "failed", conflicts_with = "succeeded")]
    retryable: bool,
    /// Store the outcome's bytes as given, not checked as JSON.
    #[arg(long)]
    raw: bool,
    /// The scope only looks like the HTTP layer's ([tenant/]METHOD route):
    /// take an outcome the layer could not replay.
    #[arg(long)]
    not_http_layer: bool,
    /// Resolve a record whose lease is still valid: its holder may still be
    /// running the work (a retryable failure then lets a second run start
    /// beside it). Only when you know the holder is gone.
    #[arg(long)]
    while_held: bool,
    /// Correct the outcome of a finished record (succeeded or failed) whose
    /// token is --token, instead of finishing a Processing record: the
    /// repair for an outcome recorded wrongly.
    #[arg(long)]
    amend: bool,
    /// How long the finished record is kept for replays, e.g. `24h` (at
    /// least 1 ms; a retry after it runs the work again). Use the service's
    /// configured retention.
    #[arg(long, default_value = "24h", value_parser = retention)]
    retention: Duration,
    /// Print the resolved record as JSON.
    #[arg(long)]
    json: bool,
}

/// `--retention`: a human duration of at least 1 ms and at most
/// [`idemstore::MAX_RETENTION`], refused as the flag's error (not as the
/// store's at open).
fn retention(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(1) || d > idemstore::MAX_RETENTION {
        return Err(format!(
            "a retention is 1ms to {} days",
            idemstore::MAX_RETENTION.as_secs() / 86_400
        ));
    }
    Ok(d)
}

/// The outcome's bytes: `text` itself, checked to be one JSON value unless
/// `raw` (see the command's help for why).
fn outcome_bytes(flag: &str, text: &str, raw: bool) -> Result<Vec<u8>, CliError> {
    if !raw && let Err(e) = serde_json::from_str::<serde_json::Value>(text) {
        return Err(CliError::Usage(format!(
            "--{flag} {text:?} is not a JSON value ({e}); nothing changed. A record made by \
             Store::execute replays its outcome as JSON, so other bytes would make every \
             retry of the key fail: quote a string as JSON (--{flag} {quoted}), or give \
             --raw if this key's service reads its outcome as plain bytes",
            // As JSON, then for a POSIX shell: pasted, it is one word.
            quoted = shlex::try_quote(&serde_json::Value::String(text.to_string()).to_string())
                .map_or_else(|_| "JSON".into(), |q| q.into_owned()),
        )));
    }
    Ok(text.as_bytes().to_vec())
}

/// Whether `scope` (or a whole key) has the HTTP layer's form,
/// `[tenant/]METHOD route`, the route a path or `#` and a digest.
fn http_layer_scope(scope: &str) -> bool {
    const METHODS: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
    ];
    scope.match_indices(' ').any(|(at, _)| {
        let (before, route) = scope.split_at(at);
        let method = before.rsplit('/').next().unwrap_or(before);
        METHODS.contains(&method) && (route.starts_with(" /") || route.starts_with(" #"))
    })
}

/// Runs `idemstore resolve`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let retryable_failure = args.failed.is_some() && args.retryable;
    if !args.not_http_layer && !retryable_failure && http_layer_scope(&args.scope) {
        return Err(CliError::Usage(format!(
            "{:?} has the form of the HTTP layer's keys ([tenant/]METHOD route), whose records \
             replay a stored HTTP response that resolve cannot write: this outcome would answer \
             every retry of the key 500 until retention ends; nothing changed. Record --failed \
             VALUE --retryable: the client's retry then runs the handler again, which finds its \
             effect by the key's reference. Give --not-http-layer if this key is not the HTTP \
             layer's",
            args.scope
        )));
    }
    let outcome = match (&args.succeeded, &args.failed) {
        (Some(result), _) => Resolution::Succeeded(outcome_bytes("succeeded", result, args.raw)?),
        (None, Some(failure)) => Resolution::Failed {
            failure: outcome_bytes("failed", failure, args.raw)?,
            retryable: args.retryable,
        },
        (None, None) => {
            return Err(CliError::Usage(
                "give the outcome: --succeeded RESULT or --failed FAILURE (see --help)".into(),
            ));
        }
    };
    let store = ops::open(&args.store, Some(args.retention))?;
    let key = ops::key_of(&store, &args.scope, args.id.as_deref())?;
    let shown = ops::key_text(key.scope(), key.id());
    if !args.amend && !args.while_held {
        let record = store
            .get(&key)
            .map_err(|e| CliError::store(format!("cannot read {shown}"), e))?;
        let now = store.now_ms();
        if let Some(record) = record.filter(|r| r.token() == args.token && r.lease_valid_at(now)) {
            return Err(CliError::Usage(format!(
                "{shown} is held: the lease of token {} has {} left, and its holder may still \
                 be running the work (a retryable failure would let a second run start beside \
                 it); nothing changed. Resolve it once the lease has lapsed (`idemstore list \
                 STORE --lapsed` lists those), or give --while-held if you know the holder is \
                 gone",
                args.token,
                ops::lease_text(&record, now).trim_end_matches(" left"),
            )));
        }
    }
    let done = if args.amend {
        store.amend(&key, args.token, outcome)
    } else {
        store.resolve(&key, args.token, outcome)
    };
    let record = match done {
        Ok(record) => record,
        Err(Error::StaleLease { .. }) => {
            return Err(refusal(&store, &key, &shown, args.token, args.amend));
        }
        Err(e) => return Err(CliError::store(format!("cannot resolve {shown}"), e)),
    };
    if args.json {
        ops::write_json(out, &ops::record_json(&record, store.now_ms()))?;
    } else {
        writeln!(
            out,
            "{} {shown} (token {}) as {}",
            if args.amend { "amended" } else { "resolved" },
            record.token(),
            record.state().name()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Why `resolve` changed nothing, read back from the record (the command
/// has the store to itself, so the record is what the refusal saw): no
/// record, a finished record (a Processing one with `amend`), or a token
/// that is not the current holder's.
fn refusal(store: &Store, key: &Key, shown: &str, token: u64, amend: bool) -> CliError {
    let record = match store.get(key) {
        Ok(record) => record,
        Err(e) => return CliError::store(format!("cannot resolve {shown}"), e),
    };
    let why = match record {
        None => format!(
            "no record for {shown} (absent or past retention); nothing changed. \
             Check the scope and id (`idemstore list STORE` prints them as columns)"
        ),
        Some(r) if amend && r.state() == State::Processing => format!(
            "{shown} is still in progress (token {}); nothing changed. Finish it without \
             --amend",
            r.token()
        ),
        Some(r) if !amend && r.state() != State::Processing => format!(
            "{shown} is already finished as {} (token {}); nothing changed. To correct its \
             outcome, give --amend",
            r.state().name(),
            r.token()
        ),
        Some(r) if token > r.token() => format!(
            "token {token} was never issued for {shown}: its current holder has token {}; \
             nothing changed",
            r.token()
        ),
        Some(r) => format!(
            "token {token} is not the current holder of {shown} (an earlier holder's, or \
             never issued for this key): the current holder has token {}; nothing changed",
            r.token()
        ),
    };
    let verb = if amend { "amend" } else { "resolve" };
    CliError::Failed(format!("cannot {verb}: {why}"))
}
