//! `idemstore compact STORE`: give the space a churning store file no
//! longer uses back to the file system (offline).

use std::io::Write;
use std::process::ExitCode;

use serde_json::json;

use crate::error::CliError;
use crate::ops::{self, StoreArg};

/// Arguments of `idemstore compact`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Under churn the store file grows to a plateau and keeps it: freed pages \
are reused but never given back. compact checks every page (a damaged file is refused, never \
copied under fresh checksums: run idemstore check), opens the store (replaying its log), \
closes it cleanly, checks every page again, then has redb move the pages in use to the front \
of the file and truncate the rest. Records are unchanged. The store must not be open anywhere meanwhile (stop the service). \
A crash during it leaves a file that redb repairs at the next open. On PostgreSQL the \
server's VACUUM gives space back; this command takes a store file only."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore compact`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let path = match args.store.target()? {
        ops::Target::File(path) => path,
        ops::Target::Postgres { name, .. } => {
            return Err(CliError::Failed(format!(
                "{name}: compact works on a store file; a PostgreSQL store's space is given \
                 back by the server's VACUUM (autovacuum)"
            )));
        }
    };
    let done = idemstore::compact_file(&path, idemstore::Config::new()).map_err(|e| match e {
        idemstore::Error::Poisoned { cause } => CliError::Failed(format!(
            "{}: nothing was compacted: {cause}. Run idemstore check first",
            path.display()
        )),
        other => ops::open_error(&path, other),
    })?;
    if args.json {
        ops::write_json(
            out,
            &json!({
                "path": path.display().to_string(),
                "bytes_before": done.bytes_before,
                "bytes_after": done.bytes_after,
                "passes": done.passes,
            }),
        )?;
    } else {
        writeln!(
            out,
            "compacted {}: {} -> {}",
            path.display(),
            ops::size(done.bytes_before),
            ops::size(done.bytes_after)
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
