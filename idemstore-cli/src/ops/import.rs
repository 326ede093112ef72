//! `idemstore import STORE INPUT`: restore records from an export.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

use idemstore::Store;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore import`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Import is idempotent: a record is written only where its key is \
absent (or past retention), never over a live record, so running it twice changes no record \
(only the token counter may move on with the clock). The store's token counter and clock are \
raised above everything imported. A damaged frame \
stops the import with its byte offset; batches before it stay imported (and, when the store's \
own record of a key is damaged, the rest of that record's batch). The stream is \
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
    /// Create the store if it does not exist (a restore into a new file, or
    /// into a schema that holds no store). The input's header and meta
    /// frame are checked first: input that is not an export (an empty or
    /// cut one, another file) creates nothing. If the import then fails, a
    /// store file and its log that this command created are removed again
    /// (not when the open itself failed: remove them by hand); a
    /// PostgreSQL store this command created stays, with the records
    /// imported before the failure (the error says so). An existing store
    /// is imported into as without --create.
    #[arg(long)]
    create: bool,
    /// Import records and a clock high-water mark more than 5 minutes ahead
    /// of the store's clock (an export from a host whose clock ran ahead).
    /// The store's clock still moves forward by at most 5 minutes.
    #[arg(long)]
    accept_clock_ahead: bool,
    /// The largest result, failure and recovery point the store takes, in
    /// bytes (1 to 16 MiB; the library's default, 1 MiB, when not given).
    /// Give the service's own limits (`Config::max_result_bytes` and the
    /// others) when it raised them: an export of such a store holds larger
    /// values, which the default refuses (rule `too-large`).
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..=idemstore::MAX_VALUE_LIMIT as u64))]
    max_value_bytes: Option<u64>,
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
        let meta = file.metadata().ok();
        // Opening a directory succeeds on Unix; reading it does not.
        if meta.as_ref().is_some_and(std::fs::Metadata::is_dir) {
            return Err(CliError::Failed(format!(
                "{} is a directory, not an export stream; nothing was imported",
                args.input.display()
            )));
        }
        let len = meta.map(|m| m.len());
        (Box::new(BufReader::new(file)), len)
    };
    let target = args.store.target()?;
    // Before anything is created: input that is not an export (an empty
    // or cut one, another file) creates no store.
    let input: Box<dyn Read> = if args.create {
        match idemstore::check_export_start(input) {
            Ok(input) => Box::new(input),
            Err(e) => {
                return Err(CliError::Failed(format!(
                    "{}; nothing was created",
                    CliError::store(format!("cannot import {}", args.input.display()), e)
                        .one_line()
                )));
            }
        }
    } else {
        input
    };
    let mut config = ops::config(None);
    if let Some(limit) = args.max_value_bytes {
        // Within MAX_VALUE_LIMIT (the flag's range), so it fits a usize.
        let limit = usize::try_from(limit).unwrap_or(idemstore::MAX_VALUE_LIMIT);
        config = config
            .max_result_bytes(limit)
            .max_failure_bytes(limit)
            .max_recovery_point_bytes(limit);
    }
    let (store, created) = match target {
        ops::Target::File(path) => open_file(&path, args.create, config)?,
        ops::Target::Postgres { url, schema, name } => {
            open_postgres(&url, &schema, &name, args.create, config)?
        }
    };
    let bar = ops::progress(len, "importing", ops::Unit::Bytes);
    let options = idemstore::ImportOptions::new().accept_clock_ahead(args.accept_clock_ahead);
    let mut read = 0u64;
    let summary = match store.import_with(input, &options, |p| {
        read = p.records;
        bar.set_position(p.bytes);
    }) {
        Ok(summary) => summary,
        Err(e) => {
            bar.finish_and_clear();
            let hint = matches!(
                e,
                idemstore::Error::ImportRefused {
                    rule: idemstore::ImportRule::TooLarge,
                    ..
                }
            ) && args.max_value_bytes.is_none();
            // An I/O failure (a full disk, say) or a lost server: what was
            // imported is not known here (`ImportRefused` counts it).
            let unknown = matches!(
                e,
                idemstore::Error::Storage(_)
                    | idemstore::Error::Poisoned { .. }
                    | idemstore::Error::Unavailable { .. }
                    | idemstore::Error::OutcomeUnknown { .. }
            );
            // A damaged stream: the batches before the damage stay, and
            // the error does not count them (`ImportRefused` does).
            let damaged = matches!(e, idemstore::Error::CorruptExport { .. });
            let mut err = CliError::store(format!("cannot import {}", args.input.display()), e);
            if hint {
                err = CliError::Failed(format!(
                    "{}; if the store's service raised its value limits, give them with \
                     --max-value-bytes BYTES",
                    err.one_line()
                ));
            }
            match created {
                // Removed while this process still holds the store, so
                // that no other process opens it in between and then
                // imports into a file that is gone (Unix removes an open
                // file's name; its data goes once the store is closed).
                // The log first: an opener racing in meanwhile then gets
                // "already open", where a log without its store file would
                // be refused as an orphan. (A crash between the two leaves
                // the store file, whose open then reports its missing log:
                // remove it by hand.) A file that cannot be removed while
                // open (Windows) is reported, not removed after the close,
                // when another process may already be using it.
                Created::Files(files) => {
                    let mut removed = true;
                    for file in &files {
                        if let Err(e) = std::fs::remove_file(file)
                            && e.kind() != std::io::ErrorKind::NotFound
                        {
                            removed = false;
                            err = CliError::Failed(format!(
                                "{}; and cannot remove {} that this import created: {e} \
                                 (remove it once no process uses it)",
                                err.one_line(),
                                file.display()
                            ));
                        }
                    }
                    // The library's words count what was imported, or say
                    // that the batches before the damage stay: not so here.
                    if removed {
                        err = CliError::Failed(format!(
                            "{}; the store this import created was removed, with whatever \
                             it had imported: nothing of the stream is kept",
                            err.one_line()
                        ));
                    }
                }
                // The library has no way to drop a schema, and the batches
                // before the failure are committed: say so.
                Created::Schema(name) => {
                    err = CliError::Failed(format!(
                        "{}; the store {name} was created by this import and keeps the \
                         records imported before the failure (import is idempotent: import \
                         again once the input is fixed, or drop the schema)",
                        err.one_line()
                    ));
                }
                Created::Nothing if unknown => {
                    err = CliError::Failed(format!(
                        "{}; {read} records of the stream were read before the failure, and \
                         the batches written before it may stay (import is idempotent: import \
                         again once that is fixed)",
                        err.one_line()
                    ));
                }
                Created::Nothing if damaged && read > 0 => {
                    err = CliError::Failed(format!(
                        "{}; {read} records of the stream were read before the damage, and \
                         any batches written before it stay (import is idempotent: import a \
                         sound copy of the stream again)",
                        err.one_line()
                    ));
                }
                Created::Nothing => {}
            }
            drop(store);
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

/// What this command created, to remove (or report) if the import fails.
enum Created {
    /// Nothing: the store existed.
    Nothing,
    /// A store file and its log.
    Files(Vec<PathBuf>),
    /// A PostgreSQL store in a new schema (named without credentials).
    Schema(String),
}

/// Opens the store file at `path`, creating it when absent and `create`.
/// What this command created is what the library says this open created
/// (`Store::was_created`), not a look for the file beforehand: of two
/// imports creating the same path at once, only the one whose open
/// created the store may remove it.
fn open_file(
    path: &std::path::Path,
    create: bool,
    config: idemstore::Config,
) -> Result<(Store, Created), CliError> {
    // Only for not removing: a file that was here (an empty one the open
    // initialises, or a symlink) is not this command's to remove, even
    // when this open initialised it.
    let was_here = std::fs::symlink_metadata(path).is_ok();
    let opened = if create {
        Store::open_with(path, config)
    } else {
        Store::open_existing(path, config)
    };
    let store = opened.map_err(|e| match e {
        idemstore::Error::Missing { .. } => CliError::Failed(format!(
            "{}: no such store file; give --create to restore into a new store",
            path.display()
        )),
        other => ops::open_error(path, other),
    })?;
    // A store this open created has a log this open created too, or an
    // empty one it found (a log with frames beside a missing or empty
    // store file is refused before anything is created).
    let created = if store.was_created() && !was_here {
        Created::Files(vec![store.log_path().to_path_buf(), path.to_path_buf()])
    } else {
        Created::Nothing
    };
    Ok((store, created))
}

/// Connects to the PostgreSQL store in `schema`; with `create`, creates it
/// when the schema holds none (as `--create` creates an absent file).
fn open_postgres(
    url: &str,
    schema: &str,
    name: &str,
    create: bool,
    config: idemstore::Config,
) -> Result<(Store, Created), CliError> {
    match ops::connect_with(url, schema, config.clone(), false) {
        Ok(store) => Ok((store, Created::Nothing)),
        Err(idemstore::Error::Missing { .. }) if create => {
            let store = ops::connect_with(url, schema, config, true)
                .map_err(|e| ops::connect_error(name, schema, e))?;
            // Another import may have created it in between.
            if !store.was_created() {
                return Ok((store, Created::Nothing));
            }
            let shown = store.path().display().to_string();
            Ok((store, Created::Schema(shown)))
        }
        Err(idemstore::Error::Missing { .. }) => Err(CliError::Failed(format!(
            "{name}: no idemstore store in schema {schema:?}; give --create to restore into \
             a new store"
        ))),
        Err(e) => Err(ops::connect_error(name, schema, e)),
    }
}
