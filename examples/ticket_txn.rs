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

#[path = "ticket_txn/cli.rs"]
mod cli;
#[path = "ticket_txn/recipe.rs"]
mod recipe;

use std::process::ExitCode;

use idemstore::postgres::tokio_postgres::{self, NoTls};

fn main() -> ExitCode {
    cli::main("ticket_txn", async |args, store, table, lease| {
        let (mut client, connection) = tokio_postgres::connect(&args.postgres, NoTls).await?;
        tokio::spawn(connection);
        // The table before the claim's transaction (its DDL commits apart).
        recipe::create_table(&client, &table).await?;
        recipe::create_ticket(&mut client, &store, &table, &lease, &args.title, async {}).await
    })
}
