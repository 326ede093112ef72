//! `idemstore check STORE`: verify every record and redb's own integrity
//! (on a PostgreSQL store, every record; there is no redb file to check).

use std::io::Write;
use std::process::ExitCode;

use idemstore::{CheckReport, Integrity, Store};
use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// What an operator can do about damage to a PostgreSQL store.
const NEXT_STEP_POSTGRES: &str = "restore the latest export into a new schema \
(idemstore import --create URL --schema NEW_SCHEMA EXPORT), then point the service at it; \
keep the damaged schema for inspection";

/// What an operator can do about damage to a store file.
const NEXT_STEP: &str = "restore the latest export into a new store \
(idemstore import --create NEW_STORE EXPORT), then put it in place of this file; \
keep the damaged file for inspection";

/// Arguments of `idemstore check`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "First redb checks every page of the file (repairing what it can), \
then every record is decoded and its checksum, token, expiry entry and business-key binding \
verified. Exits 0 when all is sound, 1 when damage was found (damaged pages included, even \
when the file no longer opens), 2 on error. For damage, the next step is to restore the \
latest export into a new store: idemstore import --create NEW_STORE EXPORT. On a \
PostgreSQL store (STORE a postgresql:// URL) there is no redb file: integrity is reported \
as not run, and every row is verified (its record, its query columns against it, its token, \
its business-key binding), and every binding against its record, while the store keeps serving."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON instead of a report.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore check`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let (name, report, next_step) = match args.store.target()? {
        ops::Target::File(path) => (path.display().to_string(), check_file(&path)?, NEXT_STEP),
        ops::Target::Postgres { url, schema, name } => {
            let store = ops::connect(&url, &schema, None, false)
                .map_err(|e| ops::connect_error(&name, &schema, e))?;
            (
                store.path().display().to_string(),
                verify(&store)?,
                NEXT_STEP_POSTGRES,
            )
        }
    };
    let integrity = match &report.integrity {
        Integrity::Clean => "clean".to_string(),
        Integrity::Repaired => "damaged, repaired by redb".to_string(),
        Integrity::Failed(detail) => format!("damaged beyond repair: {detail}"),
        Integrity::NotRun => "not run".to_string(),
        other => format!("{other:?}"),
    };
    let next_step = (!report.is_clean()).then_some(next_step);
    // A file whose pages or log keep it from opening has its records
    // unread: not "0 checked".
    let records_checked = report.records_checked;
    let mut print = || -> Result<(), CliError> {
        if args.json {
            let problems: Vec<_> = report
                .problems
                .iter()
                .map(|p| {
                    let key = p.idempotency_key.as_ref();
                    json!({
                        "key": p.key,
                        "scope": key.map(idemstore::Key::scope),
                        "id": key.map(idemstore::Key::id),
                        "detail": p.detail,
                    })
                })
                .collect();
            ops::write_json(
                out,
                &json!({
                    "path": name,
                    "clean": report.is_clean(),
                    "integrity": integrity,
                    "records": report.records,
                    "records_checked": records_checked,
                    "bindings": report.bindings,
                    "problems": problems,
                    "problems_found": report.problems_found,
                    "next_step": next_step,
                }),
            )?;
        } else {
            writeln!(out, "{:<16} {name}", "store")?;
            writeln!(out, "{:<16} {integrity}", "redb integrity")?;
            if records_checked {
                writeln!(out, "{:<16} {} checked", "records", report.records)?;
                writeln!(out, "{:<16} {} checked", "business keys", report.bindings)?;
            } else {
                let unread = if report
                    .problems
                    .iter()
                    .any(|p| p.key == idemstore::LOG_PROBLEM)
                {
                    "not checked (the store does not open)"
                } else {
                    "not checked (the damaged pages keep even the index from reading)"
                };
                writeln!(out, "{:<16} {unread}", "records")?;
                writeln!(out, "{:<16} {unread}", "business keys")?;
            }
            writeln!(out, "{:<16} {}", "problems", report.problems_found)?;
            // A record's key as `scope "…" id "…"`, which pastes into `get`
            // whatever `/` the scope or the id holds.
            for p in &report.problems {
                let key = match &p.idempotency_key {
                    Some(k) => ops::key_text(k.scope(), k.id()),
                    None => p.key.clone(),
                };
                writeln!(out, "  {key}: {}", p.detail)?;
            }
            let listed = u64::try_from(report.problems.len()).unwrap_or(u64::MAX);
            let more = report.problems_found.saturating_sub(listed);
            if more > 0 {
                writeln!(
                    out,
                    "  ... and {more} more, not listed (a check lists the first {})",
                    idemstore::MAX_LISTED_PROBLEMS
                )?;
            }
            if let Some(step) = next_step {
                writeln!(out, "{:<16} {step}", "next step")?;
            }
            writeln!(out, "{}", if report.is_clean() { "OK" } else { "DAMAGED" })?;
        }
        Ok(())
    };
    let code = if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    match print() {
        // A reader that left (`check STORE | head`) does not turn damage
        // found into success: the exit code still says what was found.
        Err(e) if e.is_broken_pipe() => Ok(code),
        Err(e) => Err(e),
        Ok(()) => Ok(code),
    }
}

/// Checks a store file: redb's page check, then every record.
fn check_file(path: &std::path::Path) -> Result<CheckReport, CliError> {
    // Nothing opens the store before redb's page check: an open writes a
    // checkpoint, which would copy a damaged page (the metadata's, say)
    // under a fresh checksum and hide it from the check. The page check
    // reports no progress of its own; the record count, read after it,
    // sizes the bar for the records' check.
    let bar = ops::progress(None, "checking pages (redb)", ops::Unit::Records);
    let report = idemstore::check_file(path, |p| {
        if p.records == 1 {
            if let Some(total) = p.total {
                ops::size_progress(&bar, total, ops::Unit::Records);
            }
            bar.set_message("checking records");
        }
        bar.set_position(p.records);
    })
    .map_err(|e| ops::open_error(path, e))?;
    bar.finish_and_clear();
    Ok(report)
}

/// Verifies every record of a PostgreSQL store (`Store::verify`); there is
/// no redb file, so the report's integrity is `NotRun`.
fn verify(store: &Store) -> Result<CheckReport, CliError> {
    let total = store
        .len()
        .map_err(|e| CliError::store("cannot read the store", e))?;
    let bar = ops::progress(Some(total), "checking records", ops::Unit::Records);
    let report = store
        .verify(|p| bar.set_position(p.records))
        .map_err(|e| CliError::store("cannot check the store", e))?;
    bar.finish_and_clear();
    Ok(report)
}
