//! Opens a store once and prints the store's events of level info and
//! above as they come, each with the time since the start: what an open
//! spends its time on (redb's integrity check with its `elapsed_ms`, the
//! replay of the write-ahead log with its frame count), for example after
//! a crash. The store is then closed cleanly.
//!
//! ```text
//! cargo run --release --example open_events -- /tmp/open-10m/idem.redb
//! ```
//!
//! The store is opened with the default configuration, without the
//! background sweeper and scrub (so that nothing but the open runs).

use std::fmt::Write as _;
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Prints each event of level info and above with its fields.
struct Print(Instant);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Print {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() > tracing::Level::INFO {
            return;
        }
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        println!(
            "{:9.3} s {}{}",
            self.0.elapsed().as_secs_f64(),
            event.metadata().target(),
            fields.0
        );
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(path) = std::env::args_os().nth(1) else {
        return Err("usage: open_events STORE_FILE".into());
    };
    let started = Instant::now();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Print(started)))?;
    let config = idemstore::Config::new()
        .sweep_interval(None)
        .scrub_rate(None);
    let store = idemstore::Store::open_existing(&path, config)?;
    println!("{:9.3} s opened", started.elapsed().as_secs_f64());
    drop(store);
    println!("{:9.3} s closed", started.elapsed().as_secs_f64());
    Ok(())
}
