//! A ticket service whose `POST /tickets` is idempotent.
//!
//! ```text
//! cargo run --example ticket_service --features http,metrics -- --addr 127.0.0.1:3000
//! curl -sS --retry 5 --retry-all-errors -H 'Idempotency-Key: demo-1' \
//!      -H 'content-type: application/json' -d '{"title":"printer on fire"}' \
//!      http://127.0.0.1:3000/tickets
//! ```
//!
//! Routes:
//! - `POST /tickets` `{"title": "...", "alert_id": "..."}` (`alert_id`
//!   optional) with an `Idempotency-Key` header: creates a ticket once per
//!   key (201, `Location: /tickets/{id}`); a retry gets the same ticket with
//!   `Idempotent-Replayed: true`. `alert_id` is a business key: a second
//!   idempotency key for the same alert is answered 409 naming the first.
//! - `POST /tickets/triage`, the same body and header: creates the ticket
//!   as `POST /tickets` does, then streams `text/event-stream` progress
//!   events `--stream-ms` apart and the ticket last; a retry while it
//!   streams gets 409, a retry after it gets the whole stream replayed.
//! - `GET /tickets/count`: `{"count": n}`.
//! - `GET /tickets/{id}`: one ticket.
//! - `GET /idempotency/stats`: the store's `Store::stats()` as JSON.
//! - `GET /metrics`: the store's metrics (`idemstore::metrics`) in
//!   Prometheus text format.
//!
//! The ticket table lives in its own redb file, unique on the idempotency
//! key; a handler that takes a key over (an earlier attempt died, or its
//! client went away) looks the ticket up by key before creating one. See
//! `ticket_service/service.rs`.
//!
//! As a fleet (built with `--features http,metrics,postgres`), every
//! replica is given the same database and schema:
//!
//! ```text
//! cargo run --example ticket_service --features http,metrics,postgres -- \
//!     --addr 127.0.0.1:3001 --postgres postgresql://app@db/tickets --schema tickets
//! ```
//!
//! The idempotency store is then `Store::connect(url, …postgres_schema(schema))`
//! and the tickets a table `"<schema>".tickets` of the same database,
//! `UNIQUE` on the idempotency key; a retry may land on any replica.

#[path = "ticket_service/service.rs"]
mod service;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// An idempotent ticket service over an idemstore file.
#[derive(Debug, Parser)]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000")]
    addr: SocketAddr,
    /// The idempotency store's file.
    #[arg(long, default_value = "tickets-idempotency.redb")]
    store: PathBuf,
    /// The ticket table's file.
    #[arg(long, default_value = "tickets.redb")]
    tickets: PathBuf,
    /// The lease of each claim, in milliseconds: how long a key whose
    /// server died stays held before a retry may take it over.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Simulated work per ticket, in milliseconds (half before the ticket
    /// is written, half after).
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// The pause between two events of `POST /tickets/triage`, in
    /// milliseconds.
    #[arg(long, default_value_t = 500)]
    stream_ms: u64,
    /// Run as a replica of a fleet on this PostgreSQL database (a
    /// `postgresql://` URL): the idempotency keys and the tickets are kept
    /// there, and `--store` and `--tickets` are not used. Needs the cargo
    /// feature `postgres`.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// With `--postgres`: the schema of the idempotency store and of the
    /// `tickets` table.
    #[arg(long, default_value = "ticket_service", requires = "postgres")]
    schema: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut options = service::Options {
        addr: args.addr,
        store: args.store,
        tickets: args.tickets,
        lease: Duration::from_millis(args.lease_ms),
        work: Duration::from_millis(args.work_ms),
        stream_interval: Duration::from_millis(args.stream_ms),
        metrics: None,
        postgres: args.postgres.map(|url| service::PgTarget {
            url,
            schema: args.schema,
        }),
    };
    // The recorder goes in before the store opens: the store registers its
    // metrics handles with the recorder installed at open.
    match metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder() {
        Ok(handle) => options.metrics = Some(handle),
        Err(e) => {
            eprintln!("ticket_service: {e}");
            return ExitCode::from(2);
        }
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ticket_service: {e}");
            return ExitCode::from(2);
        }
    };
    println!("ticket_service: listening on http://{}", options.addr);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    match runtime.block_on(service::serve(options, shutdown)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ticket_service: {e}");
            ExitCode::from(2)
        }
    }
}
