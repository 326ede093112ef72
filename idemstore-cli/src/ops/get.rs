//! `idemstore get STORE SCOPE ID`: the record of one idempotency key.

use std::io::Write;
use std::process::ExitCode;

use serde_json::Value;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore get`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Exits 1 when the key has no record (absent or past retention).")]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// The key's scope (tenant and operation), e.g. acme/tickets.create; or,
    /// with no ID, a whole key as the library prints it
    /// (acme/tickets.create/task-42:call-7), split at the `/` after which a
    /// record exists.
    scope: String,
    /// The idempotency key within the scope, e.g. task-42:call-7.
    id: Option<String>,
    /// Print JSON instead of a table (`null` when there is no record).
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore get`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let store = ops::open_to_read(&args.store)?;
    let key = ops::key_of(&store, &args.scope, args.id.as_deref())?;
    let shown = ops::key_text(key.scope(), key.id());
    let now = store.now_ms();
    let record = store
        .get(&key)
        .map_err(|e| CliError::store(format!("cannot read {shown}"), e))?;
    let Some(record) = record else {
        if args.json {
            ops::write_json(out, &Value::Null)?;
        } else {
            writeln!(out, "no record for {shown} (absent or past retention)")?;
        }
        return Ok(ExitCode::from(1));
    };
    if args.json {
        ops::write_json(out, &ops::record_json(&record, now))?;
        return Ok(ExitCode::SUCCESS);
    }
    let time = |ms: u64| {
        let rel = if ms >= now {
            format!("in {}", ops::age(ms - now))
        } else {
            format!("{} ago", ops::age(now - ms))
        };
        format!("{ms} ({rel})")
    };
    let rows = [
        ("scope", record.key().scope().to_string()),
        ("id", record.key().id().to_string()),
        ("state", record.state().name().to_string()),
        ("token", record.token().to_string()),
        ("fingerprint", ops::hex(record.fingerprint().as_bytes())),
        ("created_ms", time(record.created_ms())),
        ("updated_ms", time(record.updated_ms())),
        ("lease", ops::lease_text(&record, now)),
        ("lease_until_ms", record.lease_until_ms().to_string()),
        ("expires_ms", time(record.expires_ms())),
        ("acquisitions", record.acquisitions().to_string()),
        (
            "business key",
            record.business_key().unwrap_or("-").to_string(),
        ),
        ("result", ops::bytes_text(record.result())),
        ("failure", ops::bytes_text(record.failure())),
        ("recovery point", ops::bytes_text(record.recovery_point())),
    ];
    for (name, value) in rows {
        writeln!(out, "{name:<15} {value}")?;
    }
    Ok(ExitCode::SUCCESS)
}
