//! `idemstore stats STORE`: records by state, the oldest work in flight and
//! the file size.

use std::io::Write;
use std::process::ExitCode;

use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore stats`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "On a store file, counts by state come from the store's metadata (kept in \
the same transaction as the records), less the records past retention that eviction has not \
removed yet (counted per second of expiry in a table of their own: a row per second past) and \
plus the records in flight, which are read from the expiry index: the cost grows with the \
records in flight and the seconds of backlog, not with the store's size. On PostgreSQL, counts come from one aggregate \
statement over the rows' state and time columns: the server reads every row, none is sent. Counters of answers (claims, replays, takeovers, ...) live in the process that holds the \
store: a service reads them from Store::stats()."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore stats`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let store = ops::open_to_read(&args.store)?;
    // The file's path, or `postgresql://host:port/db?schema=name`.
    let path = store.path().display().to_string();
    let stats = store
        .stats()
        .map_err(|e| CliError::store("cannot read the store", e))?;
    let r = stats.records;
    if args.json {
        ops::write_json(
            out,
            &json!({
                "path": path,
                "now_ms": stats.now_ms,
                "file_bytes": stats.file_bytes,
                "records": {
                    "total": r.total(),
                    "live": r.live(),
                    "processing": r.processing,
                    "lapsed": r.lapsed,
                    "succeeded": r.succeeded,
                    "failed": r.failed,
                    "failed_retryable": r.failed_retryable,
                    "expired": r.expired,
                    "corrupt": r.corrupt,
                },
                "oldest_processing_age_ms": stats.oldest_processing_age_ms,
            }),
        )?;
    } else {
        let rows = [
            ("store", path.clone()),
            (
                "file size",
                stats
                    .file_bytes
                    .map_or("-".into(), |b| format!("{} ({b} bytes)", ops::size(b))),
            ),
            ("records", r.total().to_string()),
            (
                "  processing",
                format!("{} ({} lapsed)", r.processing, r.lapsed),
            ),
            ("  succeeded", r.succeeded.to_string()),
            ("  failed", r.failed.to_string()),
            ("  failed-retryable", r.failed_retryable.to_string()),
            ("  expired", format!("{} (awaiting eviction)", r.expired)),
            ("  corrupt", r.corrupt.to_string()),
            (
                "oldest processing",
                stats.oldest_processing_age_ms.map_or("-".into(), ops::age),
            ),
        ];
        for (name, value) in rows {
            writeln!(out, "{name:<20} {value}")?;
        }
        if r.corrupt > 0 {
            writeln!(
                out,
                "\n{} corrupt records: run `idemstore check`",
                r.corrupt
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
