//! `idemstore demo`: replays the incident this crate exists for.
//!
//! Agents create support tickets through a ticket service over a lossy
//! link, and retry when an answer does not come in time. A timeout is not
//! a failure: the response may have been lost after the ticket was
//! created, or the request may still be on its way. The demo runs the same
//! intents twice over the same simulated link and service ([`world`]):
//! first with naive retries, then with the service claiming each intent's
//! idempotency key in a [`Store`] on disk. It prints what each phase did
//! ([`report`]) and ends with `duplicates: naive=<n> idemstore=<m>`.
//!
//! A second run with the same `--run-id` over the same file replays every
//! intent from the file and creates no ticket: the file, not the process,
//! remembers.

mod report;
mod world;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idemstore::{Config, Fingerprint, Key, Store};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::error::CliError;
use report::{Phase, Report};
use world::{Answer, Conditions, Intent, Service};

/// The scope of every demo key: tenant `demo`, operation `tickets.create`.
pub const SCOPE: &str = "demo/tickets.create";

/// Options of `idemstore demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The store file of the idemstore phase, created if absent.
    #[arg(long, value_name = "PATH", default_value = "idemstore-demo.redb")]
    file: PathBuf,

    /// Names this run's idempotency keys, `<run-id>:agent-<n>:intent-<m>`.
    /// Defaults to a fresh time-based id, so every plain run creates new
    /// tickets; run twice with the same id and file to see every intent
    /// replayed.
    #[arg(long, value_name = "ID")]
    run_id: Option<String>,

    /// Agent threads, each with its own intents.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    agents: u32,

    /// Ticket intents per agent, run one after the other.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    intents: u32,

    /// Seed of the link's and service's random choices; the same seed gives
    /// both phases the same sequence of lost, late and crashed attempts.
    #[arg(long, default_value_t = 42)]
    seed: u64,

    /// Fraction of attempts whose response the link loses (the ticket was
    /// created; the agent never hears).
    #[arg(long, value_name = "RATE", default_value_t = 0.2, value_parser = rate)]
    drop_rate: f64,

    /// Fraction of attempts the link delays past the client timeout (by
    /// one to two timeouts, split between request and response).
    #[arg(long, value_name = "RATE", default_value_t = 0.1, value_parser = rate)]
    late_rate: f64,

    /// Fraction of attempts whose service worker dies after creating the
    /// ticket, before it answers or records the outcome.
    #[arg(long, value_name = "RATE", default_value_t = 0.02, value_parser = rate)]
    crash_rate: f64,

    /// The service's median time per request (milliseconds); each takes
    /// between half and one and a half times this.
    #[arg(long, value_name = "MS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    latency_ms: u64,

    /// How long an agent waits for an answer before it retries
    /// (milliseconds).
    #[arg(long, value_name = "MS", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    timeout_ms: u64,

    /// The lease of each claim (milliseconds): how long a claim is honoured
    /// before a retry may take it over. Keep it well above the slowest
    /// request, or a retry takes over a worker that is still working.
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    lease_ms: u64,

    /// Attempts per intent before an agent gives up on it.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    max_attempts: u32,

    /// Print one JSON object with every figure instead of the table.
    #[arg(long)]
    json: bool,
}

/// Parses a rate: a number from 0 to 1.
fn rate(text: &str) -> Result<f64, String> {
    let value: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!("{text} is not a rate from 0 to 1"))
    }
}

/// Runs the demo and writes its table (or JSON) to `out`.
///
/// Returns exit code 0 when the idemstore phase created no duplicate and
/// 1 when it did.
///
/// # Errors
/// - [`CliError::Usage`] for rates that add up to more than 1.
/// - [`CliError::Store`] for a run id that makes an invalid key, and when
///   the store cannot be opened or fails.
/// - [`CliError::Io`] when a thread cannot be started.
/// - [`CliError::Output`] when `out` cannot be written.
pub fn run(args: &Args, out: &mut dyn Write) -> Result<ExitCode, CliError> {
    // The three rates share out one draw per attempt; allow for rounding.
    if args.drop_rate + args.late_rate + args.crash_rate > 1.0 + 1e-9 {
        return Err(CliError::Usage(
            "--drop-rate, --late-rate and --crash-rate are shares of one attempt's \
             fate and add up to more than 1"
                .into(),
        ));
    }
    let run_id = match &args.run_id {
        Some(id) => id.clone(),
        None => fresh_run_id(),
    };
    let intents = intents(&run_id, args.agents, args.intents)?;
    let conditions = Conditions {
        drop_rate: args.drop_rate,
        late_rate: args.late_rate,
        crash_rate: args.crash_rate,
        latency: Duration::from_millis(args.latency_ms),
        timeout: Duration::from_millis(args.timeout_ms),
    };
    let lease = Duration::from_millis(args.lease_ms);
    let plan = Plan {
        conditions: &conditions,
        seed: args.seed,
        max_attempts: args.max_attempts,
        intents: &intents,
    };
    // Opened first, so that a bad path or a file held by another process
    // fails at once rather than after the naive phase.
    let store = Store::open_with(&args.file, Config::new().lease(lease)).map_err(|e| {
        CliError::store(format!("cannot open the store {}", args.file.display()), e)
    })?;
    let store = Arc::new(store);
    let mut report = Report::new(args, &run_id);
    if !args.json {
        report.write_header(out)?;
    }

    let naive = Arc::new(Service::new(format!("N-{run_id}-"), None, lease));
    let naive = plan.run(&naive)?;
    if !args.json {
        naive.write_progress(out, "phase 1/2  naive retries")?;
    }

    let service = Arc::new(Service::new(format!("T-{run_id}-"), Some(store), lease));
    let idem = plan.run(&service)?;
    if !args.json {
        idem.write_progress(out, "phase 2/2  idemstore")?;
    }

    let failed = idem.duplicates > 0;
    report.naive = Some(naive);
    report.idemstore = Some(idem);
    if args.json {
        report.write_json(out)?;
    } else {
        report.write_table(out)?;
    }
    out.flush()?;
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// A default run id: `run-<ms since the epoch>`, new for every run.
fn fresh_run_id() -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("run-{ms}")
}

/// Every agent's intents, keys fixed before the first attempt.
fn intents(run_id: &str, agents: u32, per_agent: u32) -> Result<Vec<Vec<Arc<Intent>>>, CliError> {
    (0..agents)
        .map(|agent| {
            (0..per_agent)
                .map(|n| {
                    let id = format!("{run_id}:agent-{agent}:intent-{n}");
                    let key = Key::new(SCOPE, id).map_err(|e| {
                        CliError::store(format!("--run-id {run_id:?} makes an invalid key"), e)
                    })?;
                    let payload = format!(
                        r#"{{"title":"Printer on fire (agent {agent}, intent {n})","requester":"agent-{agent}"}}"#
                    );
                    Ok(Arc::new(Intent {
                        key,
                        fingerprint: Fingerprint::of(payload.as_bytes()),
                    }))
                })
                .collect()
        })
        .collect()
}

/// What both phases share: the conditions, the seed and the intents.
struct Plan<'a> {
    conditions: &'a Conditions,
    seed: u64,
    max_attempts: u32,
    intents: &'a [Vec<Arc<Intent>>],
}

/// What one agent saw.
#[derive(Debug, Default)]
struct Tally {
    attempts: u64,
    timeouts: u64,
    gave_up: u64,
    replayed_intents: u64,
}

impl Plan<'_> {
    /// Runs every agent on its own thread against `service`, waits for
    /// them and for every request still in flight, and counts.
    fn run(&self, service: &Arc<Service>) -> Result<Phase, CliError> {
        let started = Instant::now();
        let tallies = thread::scope(|scope| {
            let agents: Vec<_> = self
                .intents
                .iter()
                .enumerate()
                .map(|(agent, intents)| {
                    let rng = StdRng::seed_from_u64(agent_seed(self.seed, agent));
                    thread::Builder::new()
                        .name(format!("agent-{agent}"))
                        .spawn_scoped(scope, move || self.agent(service, intents, rng))
                        .map_err(|e| CliError::io("cannot start an agent thread", e))
                })
                .collect();
            agents
                .into_iter()
                .map(|agent| {
                    agent?
                        .join()
                        .map_err(|_| CliError::Failed("an agent thread panicked".into()))?
                })
                .collect::<Result<Vec<Tally>, CliError>>()
        });
        let wall = started.elapsed();
        // Late requests may still arrive and create tickets: count them too.
        service.drain()?;
        let tallies = tallies?;
        let (tickets, duplicates) = service.tickets();
        let counts = &service.counts;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        Ok(Phase {
            intents: self.intents.iter().map(|i| i.len() as u64).sum(),
            attempts: tallies.iter().map(|t| t.attempts).sum(),
            timeouts: tallies.iter().map(|t| t.timeouts).sum(),
            gave_up: tallies.iter().map(|t| t.gave_up).sum(),
            replayed_intents: tallies.iter().map(|t| t.replayed_intents).sum(),
            tickets,
            duplicates,
            replays: load(&counts.replays),
            in_progress: load(&counts.in_progress),
            takeovers: load(&counts.takeovers),
            found_by_lookup: load(&counts.found_by_lookup),
            crashes: load(&counts.crashes),
            stale_completions: load(&counts.stale_completions),
            wall,
        })
    }

    /// One agent: for each intent, send it until an answer comes back in
    /// time, with the same key on every attempt. A timeout is followed by a
    /// short backoff; a "busy" answer by its `retry_after`.
    fn agent(
        &self,
        service: &Arc<Service>,
        intents: &[Arc<Intent>],
        mut rng: StdRng,
    ) -> Result<Tally, CliError> {
        let mut tally = Tally::default();
        for intent in intents {
            let mut attempts = 0;
            loop {
                if attempts == self.max_attempts {
                    tally.gave_up += 1;
                    break;
                }
                attempts += 1;
                tally.attempts += 1;
                let weather = self.conditions.draw(&mut rng);
                let (reply, answer) = mpsc::sync_channel(1);
                let deadline = Instant::now() + self.conditions.timeout;
                service.send(Arc::clone(intent), weather, reply)?;
                match answer.recv_timeout(self.conditions.timeout) {
                    Ok(Answer::Ticket { replayed, .. }) => {
                        tally.replayed_intents += u64::from(replayed);
                        break;
                    }
                    Ok(Answer::Busy { retry_after }) => thread::sleep(retry_after),
                    // The service kept the error; the phase reports it.
                    Ok(Answer::Failed) => return Ok(tally),
                    // A caller learns nothing before its timeout, even when
                    // the service dropped the request at once.
                    Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                        thread::sleep(deadline.saturating_duration_since(Instant::now()));
                        tally.timeouts += 1;
                        thread::sleep(weather.backoff);
                    }
                }
            }
        }
        Ok(tally)
    }
}

/// Each agent's own seed, derived from `--seed`.
fn agent_seed(seed: u64, agent: usize) -> u64 {
    seed ^ (agent as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}
