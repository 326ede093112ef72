//! `idemstore migrate URL [--schema S]`: create or upgrade a PostgreSQL
//! store's schema, for deploy pipelines (the service then connects under a
//! runtime role that may not run DDL).

use std::io::Write;
use std::process::ExitCode;

use serde_json::json;

use crate::error::CliError;
use crate::ops::{StoreArg, Target};

/// Arguments of `idemstore migrate`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "STORE is a PostgreSQL connection URL or key=value connection string; a store \
file is refused (a file store's format is upgraded by its open). Run it with a role that may create the schema (CREATE on the database, or the \
schema's owner), before the service starts; idempotent, and safe to run from several deploys at \
once. The service's runtime role then needs only USAGE on the schema, SELECT, INSERT, UPDATE \
and DELETE on its tables, and USAGE on its sequence (docs/operations.md)."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `idemstore migrate`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let (url, schema, name) = match args.store.target()? {
        Target::Postgres { url, schema, name } => (url, schema, name),
        Target::File(_) => {
            return Err(CliError::Usage(
                "migrate is for a PostgreSQL store: give a postgresql:// or postgres:// URL \
                 (a store file needs no migration)"
                    .into(),
            ));
        }
    };
    let (created, upgraded_from, version) = migrate(&url, &schema)
        .map_err(|e| CliError::store(format!("cannot migrate the store {name}"), e))?;
    if args.json {
        crate::ops::write_json(
            out,
            &json!({
                "store": name,
                "created": created,
                "upgraded_from": upgraded_from,
                "schema_version": version,
            }),
        )?;
    } else if created {
        writeln!(out, "{name}: created at schema version {version}")?;
    } else if let Some(from) = upgraded_from {
        writeln!(
            out,
            "{name}: upgraded from schema version {from} to {version} (older builds now refuse it)"
        )?;
    } else {
        writeln!(out, "{name}: already at schema version {version}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether the schema was created, the version it was upgraded from (if
/// it was), and its version now.
#[cfg(feature = "postgres")]
fn migrate(url: &str, schema: &str) -> Result<(bool, Option<u32>, u32), idemstore::Error> {
    let done = idemstore::postgres::migrate(url, schema)?;
    let from = match done {
        idemstore::postgres::Migration::Upgraded { from, .. } => Some(from),
        _ => None,
    };
    Ok((done.created(), from, done.version()))
}

/// Without the `postgres` feature there is no PostgreSQL engine.
#[cfg(not(feature = "postgres"))]
fn migrate(_url: &str, _schema: &str) -> Result<(bool, Option<u32>, u32), idemstore::Error> {
    Err(idemstore::Error::InvalidArgument {
        what: "STORE",
        reason: "this build of idemstore has no PostgreSQL engine (cargo feature `postgres`)"
            .into(),
    })
}
