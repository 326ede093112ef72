//! The effect and the completion in one transaction (cargo feature
//! `postgres`): a ticket is created and its idempotency key completed in
//! one PostgreSQL transaction, so that the two commit together or not at
//! all, as in Stripe's rocket-rides recipe. See `ticket_txn/recipe.rs`.
//!
//! ```text
//! cargo run --example ticket_txn --features postgres -- \
//!     --postgres postgresql://app@localhost/tickets --key demo-1 --title "printer on fire"
//! ```
//!
//! Run it twice with the same key: the first run creates the ticket, the
//! second replays it (`replayed ticket …`) without creating another.

#[path = "ticket_txn/recipe.rs"]
mod recipe;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idemstore::postgres::tokio_postgres::{self, NoTls};
use idemstore::{ClaimOptions, ClaimOutcome, Config, Fingerprint, Key, Store};

/// Creates a ticket once per idempotency key, in one transaction with the
/// key's completion.
#[derive(Debug, Parser)]
struct Args {
    /// The database (`postgresql://…`) of both the idempotency store and
    /// the tickets table.
    #[arg(long, value_name = "URL")]
    postgres: String,
    /// The schema of the idempotency store and of its `tickets` table.
    #[arg(long, default_value = "ticket_txn")]
    schema: String,
    /// The idempotency key (its scope is `POST /tickets`).
    #[arg(long)]
    key: String,
    /// The ticket's title (the request payload: the key's fingerprint).
    #[arg(long, default_value = "printer on fire")]
    title: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ticket_txn: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<(), recipe::BoxError> {
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
        let (mut client, connection) = tokio_postgres::connect(&args.postgres, NoTls).await?;
        tokio::spawn(connection);
        recipe::create_table(&client, &table).await?;
        let fingerprint = Fingerprint::of(args.title.as_bytes());
        match store
            .claim_async(&key, &fingerprint, &ClaimOptions::new())
            .await?
        {
            ClaimOutcome::Acquired(lease) => {
                let id = recipe::create_ticket(
                    &mut client,
                    &store,
                    &table,
                    &lease,
                    &args.title,
                    async {},
                )
                .await?;
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
