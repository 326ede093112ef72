//! `idemstore sweep STORE`: evict every record past retention.

use std::io::Write;
use std::process::ExitCode;

use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore sweep`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Records past retention are already absent to every read; \
eviction only reclaims their space. Each batch is one durable write."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Records evicted per write.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore sweep`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let store = ops::open(&args.store, None)?;
    let batch = usize::try_from(args.batch).unwrap_or(usize::MAX);
    let bar = ops::progress(None, "evicting", ops::Unit::Records);
    let mut total = 0u64;
    loop {
        let n = store
            .sweep(batch)
            .map_err(|e| CliError::store("sweep failed", e))?;
        total += n as u64;
        bar.inc(n as u64);
        if n < batch {
            break;
        }
    }
    bar.finish_and_clear();
    if args.json {
        ops::write_json(out, &json!({ "evicted": total }))?;
    } else {
        writeln!(out, "evicted {total} records past retention")?;
    }
    Ok(ExitCode::SUCCESS)
}
