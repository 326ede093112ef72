//! The command line of `examples/ticket_txn.rs` and
//! `examples/ticket_txn_sqlx.rs`, which differ only in the driver of the
//! caller's transaction: the arguments, the store, the key, and how the
//! claim's outcome is reported.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Lease, Store};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Creates a ticket once per idempotency key, in one transaction with the
/// key's completion.
#[derive(Debug, Parser)]
pub struct Args {
    /// The database (`postgresql://…`) of both the idempotency store and
    /// the tickets table.
    #[arg(long, value_name = "URL")]
    pub postgres: String,
    /// The schema of the idempotency store and of its `tickets` table.
    #[arg(long, default_value = "ticket_txn")]
    pub schema: String,
    /// The idempotency key (its scope is `POST /tickets`).
    #[arg(long)]
    pub key: String,
    /// The ticket's title (the request payload: the key's fingerprint).
    #[arg(long, default_value = "printer on fire")]
    pub title: String,
}

/// Parses the arguments, connects the store, claims the key and, when the
/// claim is acquired, runs `create` (which makes the tickets table and the
/// ticket, and completes the key in the same transaction) with the
/// arguments, the store, the tickets table's name and the lease; prints
/// what happened. `name` prefixes an error.
pub fn main<F, C>(name: &str, create: C) -> ExitCode
where
    C: FnOnce(Args, Store, String, Lease) -> F,
    F: Future<Output = Result<i64, BoxError>>,
{
    match run(create) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::from(2)
        }
    }
}

fn run<F, C>(create: C) -> Result<(), BoxError>
where
    C: FnOnce(Args, Store, String, Lease) -> F,
    F: Future<Output = Result<i64, BoxError>>,
{
    let args = Args::parse();
    let store = Store::connect(
        &args.postgres,
        Config::new()
            .postgres_schema(args.schema.as_str())
            .lease(Duration::from_secs(30)),
    )?;
    let key = Key::new("POST /tickets", args.key.as_str())?;
    let table = format!("\"{}\".tickets", args.schema);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let fingerprint = Fingerprint::of(args.title.as_bytes());
        match store
            .claim_async(&key, &fingerprint, &ClaimOptions::new())
            .await?
        {
            ClaimOutcome::Acquired(lease) => {
                let id = create(args, store, table, lease).await?;
                println!("created ticket {id} for {key}");
            }
            ClaimOutcome::Replay(record) => {
                let id = String::from_utf8_lossy(record.result().unwrap_or_default());
                println!("replayed ticket {id} for {key}");
            }
            ClaimOutcome::InProgress { retry_after, .. } => {
                println!("{key} is being created elsewhere; retry in {retry_after:?}");
            }
        }
        Ok(())
    })
}
