//! `idemstore resolve STORE SCOPE ID --token N (--succeeded TEXT | --failed TEXT)`:
//! finish a Processing record after asking the downstream system what
//! happened.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use idemstore::{Key, Resolution};

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore resolve`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "The token fences the change: if the record was completed, \
failed, released or taken over since you read it, nothing changes and the command fails \
(stale lease). Find candidates with `idemstore list STORE --compensation`."
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
    let key = Key::new(args.scope.as_str(), args.id.as_str())
        .map_err(|e| CliError::store("invalid key", e))?;
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
    let store = ops::open(&args.store.store, Some(args.retention))?;
    let record = store
        .resolve(&key, args.token, outcome)
        .map_err(|e| CliError::store(format!("cannot resolve {key}"), e))?;
    if args.json {
        ops::write_json(out, &ops::record_json(&record, store.now_ms()))?;
    } else {
        writeln!(
            out,
            "resolved {key} (token {}) as {}",
            record.token(),
            record.state().name()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
