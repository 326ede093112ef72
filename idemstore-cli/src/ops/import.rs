//! `idemstore import STORE INPUT`: restore records from an export.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore import`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Import is idempotent: a record is written only where its key is \
absent (or past retention), never over a live record, so running it twice changes nothing. \
The store's token counter and clock are raised above everything imported. A damaged frame \
stops the import with its byte offset; batches before it stay imported. The stream is \
validated: a token counter above i64::MAX, a record that breaks the store's rules (a lease \
longer than 30 days, an expiry past the longest retention, a value over the store's limits), \
or a time more than 5 minutes ahead of the store's clock is refused with the frame's offset \
and the rule; --accept-clock-ahead imports records from a clock that ran ahead without \
adopting their time."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// The export to read (`-` for stdin).
    #[arg(value_name = "INPUT")]
    input: PathBuf,
    /// Create the store if it does not exist (a restore into a new file). If
    /// the import then fails, the store file and its log are removed again
    /// (only those this command created).
    #[arg(long)]
    create: bool,
    /// Import records and a clock high-water mark more than 5 minutes ahead
    /// of the store's clock (an export from a host whose clock ran ahead).
    /// The store's clock still moves forward by at most 5 minutes.
    #[arg(long)]
    accept_clock_ahead: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore import`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let (input, len): (Box<dyn Read>, Option<u64>) = if args.input.as_os_str() == "-" {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let file = File::open(&args.input)
            .map_err(|e| CliError::io(format!("cannot open {}", args.input.display()), e))?;
        let len = file.metadata().ok().map(|m| m.len());
        (Box::new(BufReader::new(file)), len)
    };
    let path = &args.store.store;
    let creating = !path.exists();
    if creating && !args.create {
        return Err(CliError::Failed(format!(
            "{}: no such store file; give --create to restore into a new store",
            path.display()
        )));
    }
    // The library puts the log at `<file>-wal` (`Store::log_path`).
    let log_before = {
        let mut name = path.as_os_str().to_owned();
        name.push("-wal");
        PathBuf::from(name)
    };
    let log_existed = log_before.exists();
    let store = if creating {
        idemstore::Store::open_with(path, idemstore::Config::new().sweep_interval(None))
            .map_err(|e| ops::open_error(path, e))?
    } else {
        ops::open(path, None)?
    };
    // What this command created, to remove if the import fails: the store
    // file, and its log unless one was already there.
    let log = store.log_path().to_path_buf();
    let created: Vec<PathBuf> = if creating {
        let mut made = vec![path.clone()];
        if !(log_existed && log == log_before) {
            made.push(log);
        }
        made
    } else {
        Vec::new()
    };
    let bar = ops::progress(len, "importing", ops::Unit::Bytes);
    let options = idemstore::ImportOptions::new().accept_clock_ahead(args.accept_clock_ahead);
    let summary = match store.import_with(input, &options, |p| bar.set_position(p.bytes)) {
        Ok(summary) => summary,
        Err(e) => {
            bar.finish_and_clear();
            let mut err = CliError::store(format!("cannot import {}", args.input.display()), e);
            // Close the store before removing its files.
            drop(store);
            for file in &created {
                if let Err(e) = std::fs::remove_file(file)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    err = CliError::Failed(format!(
                        "{}; and cannot remove {} that this import created: {e}",
                        err.one_line(),
                        file.display()
                    ));
                }
            }
            return Err(err);
        }
    };
    bar.finish_and_clear();
    if args.json {
        ops::write_json(
            out,
            &json!({
                "records": summary.records,
                "imported": summary.imported,
                "present": summary.present,
                "expired": summary.expired,
                "business_key_taken": summary.business_key_taken,
                "next_token": summary.next_token,
            }),
        )?;
    } else {
        writeln!(
            out,
            "read {} records from {}",
            summary.records,
            args.input.display()
        )?;
        writeln!(out, "  imported            {}", summary.imported)?;
        writeln!(out, "  already present     {}", summary.present)?;
        writeln!(out, "  past retention      {}", summary.expired)?;
        writeln!(out, "  business key taken  {}", summary.business_key_taken)?;
        writeln!(out, "next fencing token    {}", summary.next_token)?;
    }
    Ok(ExitCode::SUCCESS)
}
