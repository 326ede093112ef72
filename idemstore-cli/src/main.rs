//! `idemstore`: the command-line tool of the idemstore crate.
//!
//! `main` calls [`run`], which returns the exit code or an error. A closed
//! pipe (`idemstore demo | head`) ends the program quietly; any other error
//! is printed as one line, `idemstore: <what failed>: <cause>: ...`, and
//! the exit code is 2. A panic is one line (exit 101 when it ends the
//! program), and a panic inside redb that the library catches prints
//! nothing (see [`quiet_storage_panics`]). Subcommands choose their own success codes (`demo`
//! exits 1 when the idemstore phase created a duplicate, `check` when it
//! found damage, `get` when there is no record).
#![forbid(unsafe_code)]

mod demo;
mod error;
#[cfg(feature = "mcp")]
mod mcp_proxy;
mod ops;

use std::io::{self, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::CliError;

/// Embedded, crash-safe idempotency store: a retried side effect runs once.
#[derive(Debug, Parser)]
#[command(name = "idemstore", version, about, arg_required_else_help = false)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One variant per subcommand; each subcommand lives in its own module
/// with its own `Args` and `run`.
#[derive(Debug, Subcommand)]
enum Command {
    /// Replay the duplicate-ticket incident: agents retrying over a lossy
    /// link, first naively, then through idemstore.
    Demo(demo::Args),
    /// Show records by state, the oldest work in flight and the file size.
    Stats(ops::stats::Args),
    /// Show the record of one idempotency key.
    Get(ops::get::Args),
    /// List records, filtered by state, scope prefix and age.
    List(ops::list::Args),
    /// Evict every record past retention.
    Sweep(ops::sweep::Args),
    /// Finish a Processing record as succeeded or failed, fenced by its token.
    Resolve(ops::resolve::Args),
    /// Verify every record's checksum and redb's integrity; exit 1 on damage.
    Check(ops::check::Args),
    /// Give the space a churning store file no longer uses back to the file
    /// system (offline: the store must not be open).
    Compact(ops::compact::Args),
    /// Write a portable backup of every live record.
    Export(ops::export::Args),
    /// Restore records from a backup (idempotent).
    Import(ops::import::Args),
    /// Create or upgrade a PostgreSQL store's schema (for deploys).
    Migrate(ops::migrate::Args),
    /// Run a stdio MCP server as a child and give its tools run-once
    /// semantics: a tools/call with an idempotency key runs once per key;
    /// served over stdio, or over streamable HTTP with --listen.
    #[cfg(feature = "mcp")]
    McpProxy(mcp_proxy::Args),
}

fn main() -> ExitCode {
    let caught = quiet_storage_panics();
    match std::panic::catch_unwind(run) {
        Ok(Ok(code)) => code,
        Ok(Err(err)) => report(&err),
        Err(_) => {
            // A panic the hook printed needs nothing more; one in redb that
            // nothing caught is printed now.
            if let Some(panic) = caught.lock().ok().and_then(|mut p| p.take()) {
                print_panic(&panic);
            }
            ExitCode::from(101)
        }
    }
}

/// A panic as the hook saw it: message with location, and a backtrace when
/// `RUST_BACKTRACE` asks for one.
struct Panic {
    what: String,
    backtrace: Option<std::backtrace::Backtrace>,
}

/// Prints `panic` as one line (and its backtrace, when captured).
fn print_panic(panic: &Panic) {
    let mut stderr = io::stderr().lock();
    let _ = writeln!(
        stderr,
        "idemstore: internal error: {} (a bug; RUST_BACKTRACE=1 shows where)",
        panic.what
    );
    if let Some(backtrace) = &panic.backtrace {
        let _ = writeln!(stderr, "{backtrace}");
    }
}

/// Installs a panic hook that prints every panic as one line, except a
/// panic inside redb, the storage engine, which it keeps quiet and
/// returns: a damaged store file can make redb panic, and the library
/// catches that panic and answers a typed error (`corrupt store file …:
/// storage engine panicked: …`), which `report` prints as the one line;
/// the default hook would first print the panic, as if the command had
/// crashed. `main` prints a redb panic that reaches it.
fn quiet_storage_panics() -> std::sync::Arc<std::sync::Mutex<Option<Panic>>> {
    let caught = std::sync::Arc::new(std::sync::Mutex::new(None));
    let keep = caught.clone();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        let file = info.location().map_or("", |l| l.file());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let backtrace = std::backtrace::Backtrace::capture();
        let panic = Panic {
            what: format!("{message}{at}"),
            backtrace: (backtrace.status() == std::backtrace::BacktraceStatus::Captured)
                .then_some(backtrace),
        };
        // The registry's `redb-4.6.0/src/…`, or a vendored `redb/src/…`.
        let in_redb = file.contains("redb-") || file.contains("/redb/");
        // The slot holds the last panic only if it was in redb: one that
        // the library caught and a later one that ends the program must
        // not both be printed.
        let mut slot = keep.lock().ok();
        if in_redb {
            if let Some(slot) = slot.as_mut() {
                **slot = Some(panic);
            }
        } else {
            if let Some(slot) = slot.as_mut() {
                **slot = None;
            }
            print_panic(&panic);
        }
    }));
    caught
}

/// Parses the command line and runs the subcommand.
fn run() -> Result<ExitCode, CliError> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version are not errors: clap prints them to stdout.
        Err(err) if !err.use_stderr() => {
            err.print()?;
            return Ok(ExitCode::SUCCESS);
        }
        Err(err) => return Err(CliError::usage(&err)),
    };
    let stdout = io::stdout();
    let mut out = stdout.lock();
    match cli.command {
        Command::Demo(args) => demo::run(&args, &mut out),
        Command::Stats(args) => ops::stats::run(&args, &mut out),
        Command::Compact(args) => ops::compact::run(&args, &mut out),
        Command::Get(args) => ops::get::run(&args, &mut out),
        Command::List(args) => ops::list::run(&args, &mut out),
        Command::Sweep(args) => ops::sweep::run(&args, &mut out),
        Command::Resolve(args) => ops::resolve::run(&args, &mut out),
        Command::Check(args) => ops::check::run(&args, &mut out),
        Command::Export(args) => ops::export::run(&args, &mut out),
        Command::Import(args) => ops::import::run(&args, &mut out),
        Command::Migrate(args) => ops::migrate::run(&args, &mut out),
        #[cfg(feature = "mcp")]
        Command::McpProxy(args) => {
            // stdout belongs to the MCP client.
            drop(out);
            mcp_proxy::run(&args)
        }
    }
}

/// Prints `err` as one line on stderr (unless it is a closed pipe) and
/// returns exit code 2.
fn report(err: &CliError) -> ExitCode {
    if err.is_broken_pipe() {
        return ExitCode::SUCCESS;
    }
    // Nothing sensible is left to do if stderr itself cannot be written.
    let _ = writeln!(io::stderr().lock(), "idemstore: {}", err.one_line());
    ExitCode::from(2)
}
