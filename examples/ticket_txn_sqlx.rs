//! The effect and the completion in one transaction, with the caller's
//! transaction in **sqlx** (cargo feature `sqlx`): a ticket is created and
//! its idempotency key completed in one PostgreSQL transaction, so that
//! the two commit together or not at all. `examples/ticket_txn.rs` is the
//! same over `tokio-postgres`; see `ticket_txn_sqlx/recipe.rs`.
//!
//! ```text
//! cargo run --example ticket_txn_sqlx --features sqlx -- \
//!     --postgres postgresql://app@localhost/tickets --key demo-1 --title "printer on fire"
//! ```
//!
//! Run it twice with the same key: the first run creates the ticket, the
//! second replays it (`replayed ticket …`) without creating another.

#[path = "ticket_txn/cli.rs"]
mod cli;
#[path = "ticket_txn_sqlx/recipe.rs"]
mod recipe;

use std::process::ExitCode;

use sqlx::Connection;

fn main() -> ExitCode {
    cli::main("ticket_txn_sqlx", async |args, store, table, lease| {
        let mut conn = sqlx::PgConnection::connect(&args.postgres).await?;
        recipe::create_table(&mut conn, &table).await?;
        recipe::create_ticket(&mut conn, &store, &table, &lease, &args.title, async {}).await
    })
}
