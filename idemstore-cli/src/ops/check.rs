//! `idemstore check STORE`: verify every record and redb's own integrity.

use std::io::Write;
use std::process::ExitCode;

use idemstore::{Config, Integrity, Store};
use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// What an operator can do about damage.
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
latest export into a new store: idemstore import --create NEW_STORE EXPORT."
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
    let path = &args.store.store;
    // The record count sizes the progress bar; the store is closed again
    // before the check, which needs the file to itself.
    // A file whose pages are damaged may not open: the check reports that.
    let total = match Store::open_existing(path, Config::new().sweep_interval(None)) {
        Ok(store) => Some(
            store
                .len()
                .map_err(|e| CliError::store("cannot read the store", e))?,
        ),
        Err(idemstore::Error::CorruptFile { .. }) => None,
        Err(e) => return Err(ops::open_error(path, e)),
    };
    // redb's page check comes first and reports no progress of its own.
    let bar = ops::progress(total, "checking pages (redb)", ops::Unit::Records);
    let report = idemstore::check_file(path, |p| {
        if p.records == 1 {
            bar.set_message("checking records");
        }
        bar.set_position(p.records);
    })
    .map_err(|e| ops::open_error(path, e))?;
    bar.finish_and_clear();
    let integrity = match &report.integrity {
        Integrity::Clean => "clean".to_string(),
        Integrity::Repaired => "damaged, repaired by redb".to_string(),
        Integrity::Failed(detail) => format!("damaged beyond repair: {detail}"),
        Integrity::NotRun => "not run".to_string(),
        other => format!("{other:?}"),
    };
    let next_step = (!report.is_clean()).then_some(NEXT_STEP);
    if args.json {
        let problems: Vec<_> = report
            .problems
            .iter()
            .map(|p| json!({ "key": p.key, "detail": p.detail }))
            .collect();
        ops::write_json(
            out,
            &json!({
                "path": path,
                "clean": report.is_clean(),
                "integrity": integrity,
                "records": report.records,
                "bindings": report.bindings,
                "problems": problems,
                "next_step": next_step,
            }),
        )?;
    } else {
        writeln!(out, "{:<16} {}", "store", path.display())?;
        writeln!(out, "{:<16} {integrity}", "redb integrity")?;
        writeln!(out, "{:<16} {} checked", "records", report.records)?;
        writeln!(out, "{:<16} {} checked", "business keys", report.bindings)?;
        writeln!(out, "{:<16} {}", "problems", report.problems.len())?;
        for p in &report.problems {
            writeln!(out, "  {}: {}", p.key, p.detail)?;
        }
        if let Some(step) = next_step {
            writeln!(out, "{:<16} {step}", "next step")?;
        }
        writeln!(out, "{}", if report.is_clean() { "OK" } else { "DAMAGED" })?;
    }
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
