//! `idemstore resolve STORE SCOPE ID --token N (--succeeded TEXT | --failed TEXT)`:
//! finish a Processing record after asking the downstream system what
//! happened.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use idemstore::{Error, Key, Resolution, State, Store};

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore resolve`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "The token fences the change: if the record was completed, \
failed, released or taken over since you read it, nothing changes and the command fails \
(exit 2), saying which: no record for the key (absent or past retention), the record is \
already finished (its state and token), or the token is not its current holder's (never \
issued for it, or taken over since; the current token is shown). Find candidates with \
`idemstore list STORE --compensation`."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// The key's scope.
    scope: String,
    /// The idempotency key within the scope.
    id: String,
    /// The record's fencing token, as `get` or `list` showed it.
    #[arg(long)]
    token: u64,
    /// The work took effect: store this result (replayed to every retry).
    #[arg(long, value_name = "RESULT", group = "outcome")]
    succeeded: Option<String>,
    /// The work did not take effect: store this failure.
    #[arg(long, value_name = "FAILURE", group = "outcome")]
    failed: Option<String>,
    /// With --failed: let the next claim run the work again.
    #[arg(long, requires = "failed")]
    retryable: bool,
    /// How long the finished record is kept for replays, e.g. `24h`. Use the
    /// service's configured retention.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// Print the resolved record as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore resolve`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let shown = ops::key_text(&args.scope, &args.id);
    let key = Key::new(args.scope.as_str(), args.id.as_str())
        .map_err(|e| CliError::store(format!("invalid key ({shown})"), e))?;
    let outcome = match (&args.succeeded, &args.failed) {
        (Some(result), _) => Resolution::Succeeded(result.clone().into_bytes()),
        (None, Some(failure)) => Resolution::Failed {
            failure: failure.clone().into_bytes(),
            retryable: args.retryable,
        },
        (None, None) => {
            return Err(CliError::Usage(
                "give the outcome: --succeeded RESULT or --failed FAILURE (see --help)".into(),
            ));
        }
    };
    let store = ops::open(&args.store, Some(args.retention))?;
    let record = match store.resolve(&key, args.token, outcome) {
        Ok(record) => record,
        Err(Error::StaleLease { .. }) => return Err(refusal(&store, &key, &shown, args.token)),
        Err(e) => return Err(CliError::store(format!("cannot resolve {shown}"), e)),
    };
    if args.json {
        ops::write_json(out, &ops::record_json(&record, store.now_ms()))?;
    } else {
        writeln!(
            out,
            "resolved {shown} (token {}) as {}",
            record.token(),
            record.state().name()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Why `resolve` changed nothing, read back from the record (the command
/// has the store to itself, so the record is what the refusal saw): no
/// record, a finished record, or a token that is not the current holder's.
fn refusal(store: &Store, key: &Key, shown: &str, token: u64) -> CliError {
    let record = match store.get(key) {
        Ok(record) => record,
        Err(e) => return CliError::store(format!("cannot resolve {shown}"), e),
    };
    let why = match record {
        None => format!(
            "no record for {shown} (absent or past retention); nothing changed. \
             Check the scope and id (`idemstore list STORE` prints them as columns)"
        ),
        Some(r) if r.state() != State::Processing => format!(
            "{shown} is already finished as {} (token {}); nothing changed",
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
    CliError::Failed(format!("cannot resolve: {why}"))
}
