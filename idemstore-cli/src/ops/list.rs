//! `idemstore list STORE`: records filtered by state, scope prefix and age.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use idemstore::Filter;

use crate::error::CliError;
use crate::ops::{self, StateArg, StoreArg};

/// Arguments of `idemstore list`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "The table is tab-separated, one record a line after a header: \
SCOPE, ID, STATE, TOKEN, AGE, LEASE, BUSINESS KEY. Scopes and ids never contain a tab, so \
the first two columns paste into `idemstore get STORE SCOPE ID` and `idemstore resolve` \
(e.g. `cut -f1,2`); --json gives `scope` and `id` as separate fields. Age is the time since \
a key was first acquired. Records past retention are never listed. Exits 1 if a record is \
corrupt (reported on stderr; the listing goes on)."
)]
pub struct Args {
    #[command(flatten)]
    store: StoreArg,
    /// Only records in this state (repeat for several).
    #[arg(long = "state", value_enum, value_name = "STATE")]
    states: Vec<StateArg>,
    /// Only scopes that start with this prefix, e.g. `acme/`.
    #[arg(long)]
    scope_prefix: Option<String>,
    /// Only records at least this old, e.g. `90s`, `15m`, `2h`.
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
    /// Only Processing records whose lease has lapsed.
    #[arg(long)]
    lapsed: bool,
    /// The records a reconciler must look at: Processing records whose lease
    /// lapsed, or (with --older-than) that are at least that old.
    #[arg(long, conflicts_with_all = ["states", "lapsed"])]
    compensation: bool,
    /// Stop after this many records.
    #[arg(long)]
    limit: Option<usize>,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

impl Args {
    fn filter(&self) -> Filter {
        let mut filter = if self.compensation {
            Filter::needs_compensation(self.older_than)
        } else {
            let mut f = Filter::new();
            for s in &self.states {
                f = f.state((*s).into());
            }
            if let Some(age) = self.older_than {
                f = f.older_than(age);
            }
            if self.lapsed {
                f = f.lapsed();
            }
            f
        };
        if let Some(prefix) = &self.scope_prefix {
            filter = filter.scope_prefix(prefix.clone());
        }
        filter
    }
}

/// Runs `idemstore list`.
pub fn run(args: &Args, out: &mut impl Write) -> Result<ExitCode, CliError> {
    let store = ops::open_to_read(&args.store)?;
    let records = store
        .scan(&args.filter())
        .map_err(|e| CliError::store("cannot read the store", e))?;
    let now = records.now_ms();
    let limit = args.limit.unwrap_or(usize::MAX);
    let mut shown = 0usize;
    let mut corrupt = 0usize;
    if args.json {
        write!(out, "[")?;
    } else {
        writeln!(out, "SCOPE\tID\tSTATE\tTOKEN\tAGE\tLEASE\tBUSINESS KEY")?;
    }
    for record in records {
        if shown >= limit {
            break;
        }
        let record = match record {
            Ok(r) => r,
            Err(e @ idemstore::Error::CorruptRecord { .. }) => {
                corrupt += 1;
                eprintln!("idemstore: warning: {e}");
                continue;
            }
            Err(e) => return Err(CliError::store("cannot read the store", e)),
        };
        if args.json {
            let sep = if shown == 0 { "\n" } else { ",\n" };
            write!(out, "{sep}")?;
            serde_json::to_writer(&mut *out, &ops::record_json(&record, now))
                .map_err(ops::json_error)?;
        } else {
            // Keys hold no control characters (`Key::new` refuses them), so
            // a tab ends each column unambiguously.
            writeln!(
                out,
                "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                record.key().scope(),
                record.key().id(),
                record.state().name(),
                record.token(),
                ops::age(now.saturating_sub(record.created_ms())),
                ops::lease_text(&record, now),
                record.business_key().unwrap_or("-"),
            )?;
        }
        shown += 1;
    }
    if args.json {
        writeln!(out, "{}]", if shown == 0 { "" } else { "\n" })?;
    } else if shown == 0 {
        // On stderr, so that a script reading the columns sees only the header.
        eprintln!("(no records)");
    }
    Ok(if corrupt > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
