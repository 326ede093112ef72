//! The simulated world both phases share: a lossy link and a ticket
//! service that does its work on its own threads.
//!
//! Every attempt's fate is drawn by the calling agent from its seeded
//! random generator before it sends ([`Conditions::draw`]), so that with
//! the same `--seed` both phases meet the same sequence of lost, late and
//! crashed attempts. What the service does with a request that arrives is
//! the only thing that differs between the phases.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use idemstore::{ClaimOptions, ClaimOutcome, Fingerprint, Key, Lease, Store};
use parking_lot::Mutex;
use rand::Rng;
use rand::rngs::StdRng;

use crate::error::CliError;

/// One ticket an agent wants created. Its key is fixed before the first
/// attempt and sent, unchanged, with every retry.
#[derive(Debug)]
pub struct Intent {
    /// `(demo/tickets.create, <run-id>:agent-<n>:intent-<m>)`.
    pub key: Key,
    /// `Fingerprint::of(payload)`.
    pub fingerprint: Fingerprint,
}

/// The rates and times of the simulation.
#[derive(Debug, Clone)]
pub struct Conditions {
    /// Fraction of attempts whose response the link loses.
    pub drop_rate: f64,
    /// Fraction of attempts the link delays past the client timeout.
    pub late_rate: f64,
    /// Fraction of attempts whose service worker dies after creating the
    /// ticket, before it answers or records the outcome.
    pub crash_rate: f64,
    /// The service's median time per request; each request takes between
    /// half and one and a half times this.
    pub latency: Duration,
    /// How long an agent waits for an answer before it retries.
    pub timeout: Duration,
}

/// What the link and the service will do to one attempt.
#[derive(Debug, Clone, Copy)]
pub struct Weather {
    /// How long the link holds the request before the service sees it.
    request_delay: Duration,
    /// How long the service works on the request.
    work: Duration,
    /// The service's worker dies after creating the ticket.
    crash: bool,
    /// What the link does with the response.
    response: Delivery,
    /// How long the agent waits before retrying if this attempt times out.
    pub backoff: Duration,
}

#[derive(Debug, Clone, Copy)]
enum Delivery {
    OnTime,
    Lost,
    Late(Duration),
}

impl Conditions {
    /// Draws the fate of one attempt. Always draws the same number of
    /// values, so one attempt's fate never shifts the fates after it.
    ///
    /// A late attempt is held by the link for one to two client timeouts
    /// in all, split at random between the request and the response: a
    /// request held long can reach the service after the agent's retry,
    /// which is where duplicates and in-progress answers come from.
    pub fn draw(&self, rng: &mut StdRng) -> Weather {
        let fate: f64 = rng.random();
        let work = self.latency.mul_f64(rng.random_range(0.5..1.5));
        let late = self.timeout.mul_f64(rng.random_range(1.0..2.0));
        let split: f64 = rng.random();
        let backoff = self.latency.mul_f64(rng.random());

        let mut weather = Weather {
            request_delay: Duration::ZERO,
            work,
            crash: false,
            response: Delivery::OnTime,
            backoff,
        };
        if fate < self.drop_rate {
            weather.response = Delivery::Lost;
        } else if fate < self.drop_rate + self.late_rate {
            weather.request_delay = late.mul_f64(split);
            weather.response = Delivery::Late(late.mul_f64(1.0 - split));
        } else if fate < self.drop_rate + self.late_rate + self.crash_rate {
            weather.crash = true;
        }
        weather
    }
}

/// The service's answer to one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The ticket id: newly created, or found or replayed for this key.
    Ticket {
        /// The ticket id.
        id: String,
        /// The answer came from the store's record, not from this attempt's work.
        replayed: bool,
    },
    /// Another attempt holds the key: retry after this long (HTTP 409 with
    /// `Retry-After`).
    Busy {
        /// From [`ClaimOutcome::InProgress`].
        retry_after: Duration,
    },
    /// The service failed (HTTP 500); the error is kept by the service.
    Failed,
}

/// What the service did, counted as it answered.
#[derive(Debug, Default)]
pub struct ServiceCounts {
    /// Answers replayed from the store.
    pub replays: AtomicU64,
    /// "Busy, retry after" answers.
    pub in_progress: AtomicU64,
    /// Claims that took over a lapsed lease.
    pub takeovers: AtomicU64,
    /// Takeovers that found the earlier holder's ticket by key.
    pub found_by_lookup: AtomicU64,
    /// Workers that died after creating a ticket.
    pub crashes: AtomicU64,
    /// Completions refused because the lease had been taken over.
    pub stale_completions: AtomicU64,
}

/// The service's database: tickets, each carrying the idempotency key
/// that asked for it as its external reference. Nothing here refuses a
/// second ticket for the same reference.
#[derive(Debug)]
struct TicketTable {
    prefix: String,
    created: u64,
    by_reference: HashMap<String, Vec<String>>,
}

impl TicketTable {
    fn create(&mut self, reference: &str) -> String {
        self.created += 1;
        let id = format!("{}{:05}", self.prefix, self.created);
        self.by_reference
            .entry(reference.to_owned())
            .or_default()
            .push(id.clone());
        id
    }

    fn find(&self, reference: &str) -> Option<String> {
        self.by_reference
            .get(reference)
            .and_then(|ids| ids.first().cloned())
    }
}

/// The ticket service. With a store it is the idemstore phase's service;
/// without one it creates a ticket for every request it receives.
pub struct Service {
    store: Option<Arc<Store>>,
    claim: ClaimOptions,
    tickets: Mutex<TicketTable>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    error: Mutex<Option<CliError>>,
    /// What the service answered.
    pub counts: ServiceCounts,
}

impl Service {
    /// A service whose ticket ids start with `prefix`; `store` turns the
    /// idemstore handler on, claiming every key with a lease of `lease`.
    pub fn new(prefix: String, store: Option<Arc<Store>>, lease: Duration) -> Service {
        Service {
            store,
            claim: ClaimOptions::new().lease(lease),
            tickets: Mutex::new(TicketTable {
                prefix,
                created: 0,
                by_reference: HashMap::new(),
            }),
            workers: Mutex::new(Vec::new()),
            error: Mutex::new(None),
            counts: ServiceCounts::default(),
        }
    }

    /// Sends one attempt through the link: the service handles it on a
    /// thread of its own, and the answer (if the link delivers it) goes to
    /// `reply`, late or not. The caller waits for it no longer than its
    /// timeout.
    ///
    /// # Errors
    /// [`CliError::Io`] when the thread cannot be started.
    pub fn send(
        self: &Arc<Self>,
        intent: Arc<Intent>,
        weather: Weather,
        reply: SyncSender<Answer>,
    ) -> Result<(), CliError> {
        let service = Arc::clone(self);
        let worker = thread::Builder::new()
            .name("ticket-service".into())
            .spawn(move || {
                thread::sleep(weather.request_delay);
                let Some(answer) = service.handle(&intent, &weather) else {
                    return;
                };
                match weather.response {
                    Delivery::OnTime => {}
                    Delivery::Lost => return,
                    Delivery::Late(delay) => thread::sleep(delay),
                }
                // A caller that gave up has dropped its receiver; a late
                // answer then goes nowhere, as on a real network.
                let _ = reply.send(answer);
            })
            .map_err(|e| CliError::io("cannot start a ticket-service thread", e))?;
        // The threads that have ended are joined now: one never joined
        // keeps its stack mapped until the end, and a long run (64 agents,
        // 400 intents) ran out of memory maps before `drain`.
        let ended = {
            let mut workers = self.workers.lock();
            let (ended, running) = std::mem::take(&mut *workers)
                .into_iter()
                .partition::<Vec<_>, _>(|w| w.is_finished());
            *workers = running;
            workers.push(worker);
            ended
        };
        for done in ended {
            if done.join().is_err() {
                self.error
                    .lock()
                    .get_or_insert(CliError::Failed("a ticket-service thread panicked".into()));
            }
        }
        Ok(())
    }

    /// Waits for every request still in flight (late requests may still
    /// create tickets after the agents are done), then returns the first
    /// error the service met, if any.
    pub fn drain(&self) -> Result<(), CliError> {
        loop {
            let workers = std::mem::take(&mut *self.workers.lock());
            if workers.is_empty() {
                break;
            }
            for worker in workers {
                worker
                    .join()
                    .map_err(|_| CliError::Failed("a ticket-service thread panicked".into()))?;
            }
        }
        match self.error.lock().take() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Tickets created, and duplicates among them: tickets created minus
    /// distinct intents that got one.
    pub fn tickets(&self) -> (u64, u64) {
        let table = self.tickets.lock();
        let distinct = table.by_reference.len() as u64;
        (table.created, table.created - distinct)
    }

    /// Handles a request that reached the service; `None` when the worker
    /// died and nobody answers.
    fn handle(&self, intent: &Intent, weather: &Weather) -> Option<Answer> {
        match &self.store {
            None => self.create_naively(intent, weather),
            Some(store) => self.create_once(store, intent, weather),
        }
    }

    /// The naive handler: every request that arrives creates a ticket.
    fn create_naively(&self, intent: &Intent, weather: &Weather) -> Option<Answer> {
        thread::sleep(weather.work);
        let id = self.tickets.lock().create(intent.key.id());
        if weather.crash {
            self.counts.crashes.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Answer::Ticket {
            id,
            replayed: false,
        })
    }

    /// The idemstore handler: claim the key; run the work only when the
    /// claim is acquired; record the ticket id as the outcome.
    fn create_once(&self, store: &Store, intent: &Intent, weather: &Weather) -> Option<Answer> {
        let lease = match store.claim(&intent.key, &intent.fingerprint, &self.claim) {
            Ok(ClaimOutcome::Acquired(lease)) => lease,
            Ok(ClaimOutcome::Replay(record)) => {
                self.counts.replays.fetch_add(1, Ordering::Relaxed);
                return Some(match record.result() {
                    Some(id) => Answer::Ticket {
                        id: String::from_utf8_lossy(id).into_owned(),
                        replayed: true,
                    },
                    None => self.failed(CliError::Failed(format!(
                        "the store replayed {} without a ticket id (state {})",
                        intent.key,
                        record.state().name()
                    ))),
                });
            }
            Ok(ClaimOutcome::InProgress { retry_after, .. }) => {
                self.counts.in_progress.fetch_add(1, Ordering::Relaxed);
                return Some(Answer::Busy { retry_after });
            }
            Err(err) => {
                return Some(
                    self.failed(CliError::store(format!("cannot claim {}", intent.key), err)),
                );
            }
        };

        thread::sleep(weather.work);
        let id = self.create_or_find(&lease, intent);
        if weather.crash {
            // The worker dies holding the lease: no answer, no outcome. The
            // lease lapses and the next claim is a takeover.
            self.counts.crashes.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        match store.complete(&lease, id.as_bytes()) {
            Ok(_) => Some(Answer::Ticket {
                id,
                replayed: false,
            }),
            // Our lease lapsed and another worker took the key over; the
            // ticket exists, so answer it.
            Err(idemstore::Error::StaleLease { .. }) => {
                self.counts
                    .stale_completions
                    .fetch_add(1, Ordering::Relaxed);
                Some(Answer::Ticket {
                    id,
                    replayed: false,
                })
            }
            Err(err) => Some(self.failed(CliError::store(
                format!("cannot complete {}", intent.key),
                err,
            ))),
        }
    }

    /// Creates the ticket, unless the lease is a takeover and the earlier
    /// holder already created it: then the ticket is looked up by the key
    /// ("query instead of replay", DESIGN.md "The store and the effect").
    fn create_or_find(&self, lease: &Lease, intent: &Intent) -> String {
        let mut table = self.tickets.lock();
        if lease.is_takeover() {
            self.counts.takeovers.fetch_add(1, Ordering::Relaxed);
            if let Some(id) = table.find(intent.key.id()) {
                self.counts.found_by_lookup.fetch_add(1, Ordering::Relaxed);
                return id;
            }
        }
        table.create(intent.key.id())
    }

    /// Keeps the first error for the end of the phase and answers 500.
    fn failed(&self, err: CliError) -> Answer {
        self.error.lock().get_or_insert(err);
        Answer::Failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threads of attempts that have ended are joined as new ones
    /// start, so a long run holds only the threads still running (a run of
    /// 64 agents and 400 intents held every one, and aborted when the
    /// process ran out of memory maps).
    #[test]
    fn ended_service_threads_are_joined_as_new_ones_start() {
        let service = Arc::new(Service::new("t".into(), None, Duration::from_secs(1)));
        let weather = Weather {
            request_delay: Duration::ZERO,
            work: Duration::ZERO,
            crash: false,
            response: Delivery::OnTime,
            backoff: Duration::ZERO,
        };
        let intent = |i: usize| {
            Arc::new(Intent {
                key: Key::new("demo/tickets.create", format!("t:intent-{i}")).unwrap(),
                fingerprint: Fingerprint::of(b"payload"),
            })
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(256);
        for i in 0..200 {
            service.send(intent(i), weather, tx.clone()).unwrap();
        }
        for _ in 0..200 {
            rx.recv().unwrap();
        }
        // Every thread has answered; once they have ended, a send joins
        // them (hang guard: a thread that never ends fails the test).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut i = 200;
        loop {
            service.send(intent(i), weather, tx.clone()).unwrap();
            rx.recv().unwrap();
            if service.workers.lock().len() <= 2 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} threads held",
                service.workers.lock().len()
            );
            thread::sleep(Duration::from_millis(10));
            i += 1;
        }
        service.drain().unwrap();
    }
}
