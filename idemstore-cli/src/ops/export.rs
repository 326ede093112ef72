//! `idemstore export STORE [--output FILE]`: a portable backup of every
//! live record.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use idemstore::ExportSummary;
use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore export`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "The stream is versioned, each record a length-prefixed, \
crc32-framed copy of the stored record; `idemstore import` reads it. Without --output \
the stream goes to stdout (never to a terminal) and the summary to stderr."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Write to this file (written beside it under a temporary name,
    /// synced, then renamed and its directory synced, so a failed export
    /// leaves no partial file and one reported written survives a power
    /// cut).
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// Replace the output file if it exists (a regular file only: a
    /// device, a fifo or a symbolic link is refused, since the rename
    /// would replace it; redirect stdout to write to one).
    #[arg(long, requires = "output")]
    force: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Export what can be saved of a store file that does not open because
    /// its write-ahead log is lost or damaged (`check` reports
    /// "(write-ahead log)"): the records of its last checkpoint and the
    /// log's frames before the damage, read from a copy made beside the
    /// store (as much free disk as the store and its log take); the
    /// original is not written. Changes acknowledged after the damage are
    /// lost: once the export is imported, their keys run again. Look for
    /// a moved `-wal` first. A store file only.
    #[arg(long)]
    accept_log_loss: bool,
}

/// Runs `idemstore export`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    if args.output.is_none() && std::io::stdout().is_terminal() {
        return Err(CliError::Usage(
            "refusing to write a binary export to a terminal: give --output FILE or redirect stdout"
                .into(),
        ));
    }
    if let Some(target) = &args.output
        && target.exists()
        && !args.force
    {
        return Err(CliError::Failed(format!(
            "{} exists; give --force to replace it",
            target.display()
        )));
    }
    if let Some(target) = &args.output {
        refuse_special_files(target)?;
    }
    if args.accept_log_loss {
        return salvage(args, out);
    }
    let store = ops::open_to_read(&args.store)?;
    if let Some(target) = &args.output {
        refuse_store_files(target, store.path(), store.log_path())?;
    }
    let total = store
        .len()
        .map_err(|e| CliError::store("cannot read the store", e))?;
    let bar = ops::progress(Some(total), "exporting", ops::Unit::Records);
    let tick = |p: idemstore::Progress| bar.set_position(p.records);
    let summary = match &args.output {
        Some(target) => export_to_file(target, |w| {
            store
                .export(w, tick)
                .map_err(|e| CliError::store("export failed", e))
        })?,
        None => {
            let mut watched = ops::PipeWatch::new(&mut *out);
            match store.export(&mut watched, tick) {
                Ok(summary) => summary,
                // The reader went away (`export | head`): end quietly.
                Err(_) if watched.closed() => {
                    bar.finish_and_clear();
                    return Err(CliError::Output(std::io::ErrorKind::BrokenPipe.into()));
                }
                Err(e) => return Err(CliError::store("export failed", e)),
            }
        }
    };
    bar.finish_and_clear();
    report(args, out, &summary, None)?;
    Ok(ExitCode::SUCCESS)
}

/// `export --accept-log-loss`: the salvage of a store file whose log
/// recovery cannot use ([`idemstore::salvage_file`]).
fn salvage(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let path = match args.store.target()? {
        ops::Target::File(path) => path,
        ops::Target::Postgres { .. } => {
            return Err(CliError::Usage(
                "--accept-log-loss salvages a store file whose write-ahead log is lost or \
                 damaged; a PostgreSQL store has no such log: export it without the flag"
                    .into(),
            ));
        }
    };
    if let Some(target) = &args.output {
        let mut log = std::fs::canonicalize(&path)
            .unwrap_or_else(|_| path.clone())
            .into_os_string();
        log.push("-wal");
        refuse_store_files(target, &path, Path::new(&log))?;
    }
    let bar = ops::progress(None, "salvaging", ops::Unit::Records);
    let tick = |p: idemstore::Progress| bar.set_position(p.records);
    let salvaged = |w: &mut dyn Write| {
        idemstore::salvage_file(&path, w, tick).map_err(|e| match e {
            idemstore::Error::AlreadyOpen { .. } => ops::open_error(&path, e),
            e => CliError::store("salvage failed", e),
        })
    };
    let salvage = match &args.output {
        Some(target) => export_to_file(target, salvaged)?,
        None => {
            let mut watched = ops::PipeWatch::new(&mut *out);
            match salvaged(&mut watched) {
                Ok(salvage) => salvage,
                Err(_) if watched.closed() => {
                    bar.finish_and_clear();
                    return Err(CliError::Output(std::io::ErrorKind::BrokenPipe.into()));
                }
                Err(e) => return Err(e),
            }
        }
    };
    bar.finish_and_clear();
    if let Some(lost) = &salvage.lost {
        eprintln!(
            "warning: the write-ahead log of {} could not be replayed in full ({lost}); \
             keys claimed or finished in the changes lost are missing from this export, or \
             in an earlier state, and run again once it is imported",
            path.display()
        );
    }
    report(args, out, &salvage.export, Some(salvage.lost.as_deref()))?;
    Ok(ExitCode::SUCCESS)
}

/// The summary of an export: to `out` when the stream went to a file, to
/// stderr when it went to stdout. `lost` (a salvage only) is what the
/// write-ahead log could not give back, `Some(None)` for nothing.
fn report(
    args: &Args,
    out: &mut impl Write,
    summary: &ExportSummary,
    lost: Option<Option<&str>>,
) -> Result<(), CliError> {
    let mut report = json!({
        "records": summary.records,
        "bytes": summary.bytes,
        "next_token": summary.next_token,
    });
    if let Some(lost) = lost {
        report["log_lost"] = json!(lost);
    }
    let text = format!(
        "{} {} records ({}) to {}",
        if lost.is_some() {
            "salvaged"
        } else {
            "exported"
        },
        summary.records,
        ops::size(summary.bytes),
        args.output
            .as_ref()
            .map_or("stdout".into(), |p| p.display().to_string())
    );
    match (&args.output, args.json) {
        (Some(_), true) => ops::write_json(out, &report)?,
        (Some(_), false) => writeln!(out, "{text}")?,
        (None, true) => eprintln!("{report}"),
        (None, false) => eprintln!("{text}"),
    }
    Ok(())
}

/// Refuses an output (or its temporary name) that exists and is not a
/// regular file: the export is renamed over the target, which would
/// replace a device, a pipe or a symbolic link with a file (as root,
/// `/dev/full` became one), and opening a pipe to compare it with the
/// store's files would wait for a writer for ever.
fn refuse_special_files(target: &Path) -> Result<(), CliError> {
    for written in [target.to_path_buf(), partial_of(target)] {
        // Not followed: a symbolic link is itself what the rename replaces.
        match std::fs::symlink_metadata(&written) {
            Ok(meta) if !meta.file_type().is_file() => {
                return Err(CliError::Usage(format!(
                    "{} is not a regular file (a device, pipe, directory or symbolic link), \
                     which the export's rename would replace; nothing was written: write to \
                     stdout and redirect it there, or give --output a regular file",
                    written.display()
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Refuses an output that is (or whose temporary name is) the store file
/// or its write-ahead log, by whatever name (a symlink, a hard link, another
/// spelling): the export would replace the store it reads.
fn refuse_store_files(target: &Path, store: &Path, log: &Path) -> Result<(), CliError> {
    for written in [target.to_path_buf(), partial_of(target)] {
        for (what, file) in [("store file", store), ("write-ahead log", log)] {
            // A name that does not exist (or cannot be compared) is no
            // file of the store's.
            if same_file::is_same_file(&written, file).unwrap_or(false) {
                return Err(CliError::Usage(format!(
                    "{} is the {what} of the store being exported; nothing was written: \
                     give --output another file",
                    written.display()
                )));
            }
        }
    }
    Ok(())
}

/// The temporary name an export to `target` is written under.
fn partial_of(target: &Path) -> PathBuf {
    let mut partial = target.as_os_str().to_owned();
    partial.push(".partial");
    PathBuf::from(partial)
}

/// Writes `export`'s stream to `target`: under a temporary name, synced,
/// renamed into place, its directory synced; nothing is left at either
/// name when `export` fails.
fn export_to_file<T>(
    target: &Path,
    export: impl FnOnce(&mut dyn Write) -> Result<T, CliError>,
) -> Result<T, CliError> {
    let partial = partial_of(target);
    let write = || -> Result<T, CliError> {
        let file = File::create(&partial)
            .map_err(|e| CliError::io(format!("cannot create {}", partial.display()), e))?;
        let mut writer = BufWriter::new(file);
        let summary = export(&mut writer)?;
        let file = writer.into_inner().map_err(|e| {
            CliError::io(
                format!("cannot write {}", partial.display()),
                e.into_error(),
            )
        })?;
        file.sync_all()
            .map_err(|e| CliError::io(format!("cannot sync {}", partial.display()), e))?;
        std::fs::rename(&partial, target)
            .map_err(|e| CliError::io(format!("cannot rename to {}", target.display()), e))?;
        Ok(summary)
    };
    let summary = write().inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
    })?;
    sync_directory_of(target)?;
    Ok(summary)
}

/// Makes the rename of an export durable: a file's name lives in its
/// directory, so until the directory is synced a power cut can leave the
/// export's contents on disk under no name (or under the old one), while
/// the command already said it was written. An error here leaves the
/// export in place, complete, and says its name may not survive a power
/// cut.
#[cfg(unix)]
fn sync_directory_of(target: &Path) -> Result<(), CliError> {
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| {
        CliError::io(
            format!(
                "{} is written in full and in place, but its directory {} could not be \
                 synced, so its name may not survive a power cut: export again to another \
                 directory before relying on it",
                target.display(),
                dir.display()
            ),
            e,
        )
    })
}

/// Elsewhere a directory is not opened to be synced (as the store's own
/// files are not: `wal::sync_parent_dir`).
#[cfg(not(unix))]
fn sync_directory_of(_target: &Path) -> Result<(), CliError> {
    Ok(())
}
