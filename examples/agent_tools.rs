//! A simulated agent whose tool calls take effect once.
//!
//! Each task asks a model what to do; the model calls a flaky ticket tool
//! and a payment tool. Everything that duplicates effects in real agents
//! happens here, from one seeded random source:
//!
//! - the model client retries model requests, and the provider mints new
//!   tool-call ids each time;
//! - the model sometimes re-plans a call it already made, under a new
//!   tool-call id;
//! - the network loses responses of calls that took effect, and the ticket
//!   service sometimes answers 503;
//! - the process dies mid-task, after a tool's effect and before its
//!   record, and the task is resumed from the start.
//!
//! The same world runs twice: once with a naive agent (retry on timeout,
//! re-ask the model on restart) and once with idemstore's layers. The run
//! prints how many duplicates each layer stopped, and ends with
//! `duplicates: tickets=0 charges=0`.
//!
//! Run it with `cargo run --release --example agent_tools --features agent`
//! (optionally with a seed: `-- 42`).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::path::Path;
use std::time::Duration;

use idemstore::agent::{
    ExecuteOptions, Executed, Failure, Origin, RemoteError, RemoteStatus, RetryPolicy, call,
};
use idemstore::{Config, Fingerprint, Key, Lease, ManualClock, Store};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const TASKS: u32 = 40;
const LEASE: Duration = Duration::from_secs(10);

/// How often each fault happens.
const MODEL_REQUEST_LOST: f64 = 0.2;
const MODEL_REPLANS: f64 = 0.35;
const SERVICE_BUSY: f64 = 0.15;
const RESPONSE_LOST: f64 = 0.25;
const CRASH_AFTER_EFFECT: f64 = 0.08;

/// What happened, counted.
#[derive(Default)]
struct Counts {
    model_retries: Cell<u32>,
    replans: Cell<u32>,
    busy: Cell<u32>,
    lost: Cell<u32>,
    restarts: Cell<u32>,
    // Which layer stopped which duplicate.
    turns_replayed: Cell<u32>,
    tool_calls_replayed: Cell<u32>,
    intents_replayed: Cell<u32>,
    probes_recovered: Cell<u32>,
    lost_found_by_query: Cell<u32>,
}

fn bump(c: &Cell<u32>) {
    c.set(c.get() + 1);
}

/// The remote services and the faults of the network between.
struct World {
    rng: RefCell<StdRng>,
    /// Each ticket created: for which task.
    tickets: RefCell<Vec<Effect>>,
    /// Each charge made: for which task.
    charges: RefCell<Vec<Effect>>,
    minted_ids: Cell<u32>,
    counts: Counts,
}

/// One effect a service performed: the task it was for (the ground truth)
/// and the reference it was sent with (the idempotency key, if any).
struct Effect {
    task: u32,
    reference: Option<String>,
}

/// The process died (simulated); unwinding carries it to the supervisor.
struct Crash;

impl World {
    fn new(seed: u64) -> Self {
        World {
            rng: RefCell::new(StdRng::seed_from_u64(seed)),
            tickets: RefCell::default(),
            charges: RefCell::default(),
            minted_ids: Cell::new(0),
            counts: Counts::default(),
        }
    }

    fn chance(&self, p: f64) -> bool {
        self.rng.borrow_mut().random_bool(p)
    }

    fn ledger(&self, tool: &str) -> &RefCell<Vec<Effect>> {
        if tool == "tickets.create" {
            &self.tickets
        } else {
            &self.charges
        }
    }

    /// Performs `tool`'s effect, recorded under `reference` (the idempotency
    /// key, or nothing for the naive agent). The ticket service is busy at
    /// times; both services lose responses. Neither deduplicates on its own.
    fn send(
        &self,
        task: u32,
        tool: &str,
        reference: Option<&Key>,
    ) -> Result<String, RemoteError<String>> {
        if tool == "tickets.create" && self.chance(SERVICE_BUSY) {
            bump(&self.counts.busy);
            return Err(RemoteError::Retryable("503 busy".into()));
        }
        let mut ledger = self.ledger(tool).borrow_mut();
        ledger.push(Effect {
            task,
            reference: reference.map(Key::reference),
        });
        let id = format!("{}-{}", &tool[..1].to_uppercase(), ledger.len());
        if self.chance(RESPONSE_LOST) {
            bump(&self.counts.lost);
            return Err(RemoteError::TimedOut);
        }
        Ok(id)
    }

    /// What the service knows of `reference`.
    fn query(
        &self,
        tool: &str,
        reference: &Key,
    ) -> Result<RemoteStatus<String>, RemoteError<String>> {
        let wanted = reference.reference();
        let ledger = self.ledger(tool).borrow();
        Ok(
            match ledger
                .iter()
                .position(|e| e.reference.as_deref() == Some(&wanted))
            {
                Some(i) => RemoteStatus::Done(format!("{}-{}", &tool[..1].to_uppercase(), i + 1)),
                None => RemoteStatus::NotFound,
            },
        )
    }

    /// The model: creates a ticket, charges the order, sometimes re-plans
    /// one of the two with a new tool-call id, then answers. Every request
    /// mints new tool-call ids, as providers do.
    fn model(&self, task: u32, history: &[Value]) -> Value {
        let results = history.iter().filter(|m| m["role"] == "tool").count();
        let ticket = (
            "tickets.create",
            json!({"title": format!("Refund order A-{task}"), "priority": "high"}),
        );
        let charge = (
            "payments.charge",
            json!({"order": format!("A-{task}"), "amount_cents": 1000 + task}),
        );
        let planned = match results {
            0 => Some(ticket),
            1 => Some(charge),
            2 if self.chance(MODEL_REPLANS) => Some(if self.chance(0.5) { ticket } else { charge }),
            _ => None,
        };
        match planned {
            Some((name, params)) => {
                self.minted_ids.set(self.minted_ids.get() + 1);
                let id = format!("call_{:04}", self.minted_ids.get());
                json!({"role": "assistant", "tool_calls": [{"id": id, "name": name, "params": params}]})
            }
            None => json!({"role": "assistant", "content": "Refunded and ticketed."}),
        }
    }

    /// The model client: a request whose response is lost is retried, and
    /// the provider answers the retry with new tool-call ids.
    fn ask_model(&self, task: u32, history: &[Value]) -> Value {
        loop {
            let reply = self.model(task, history);
            if !self.chance(MODEL_REQUEST_LOST) {
                let results = history.iter().filter(|m| m["role"] == "tool").count();
                if results >= 2 && reply.get("tool_calls").is_some() {
                    bump(&self.counts.replans);
                }
                return reply;
            }
            bump(&self.counts.model_retries);
        }
    }

    /// Dies after an effect, before its record, now and then.
    fn maybe_crash(&self) {
        if self.chance(CRASH_AFTER_EFFECT) {
            resume_unwind(Box::new(Crash));
        }
    }

    /// Effects beyond the one each task wants, per service; panics if a
    /// task got none.
    fn duplicates(&self) -> (u32, u32) {
        let extra = |ledger: &RefCell<Vec<Effect>>| {
            let mut per_task = vec![0_u32; TASKS as usize];
            for effect in ledger.borrow().iter() {
                per_task[effect.task as usize] += 1;
            }
            assert!(per_task.iter().all(|n| *n > 0), "a task lost its effect");
            per_task.iter().map(|n| n - 1).sum()
        };
        (extra(&self.tickets), extra(&self.charges))
    }
}

// ------------------------------------------------------------ naive agent --

/// Retries on timeout by sending again, re-asks the model after a restart.
fn naive_task(world: &World, task: u32) {
    let mut history = vec![json!({"role": "user", "content": format!("Refund order A-{task}")})];
    loop {
        let reply = world.ask_model(task, &history);
        let Some(calls) = reply["tool_calls"].as_array().cloned() else {
            return;
        };
        history.push(reply);
        for call in calls {
            let name = call["name"].as_str().unwrap_or_default();
            let result = loop {
                match world.send(task, name, None) {
                    Ok(id) => break id,
                    Err(_) => continue,
                }
            };
            world.maybe_crash();
            history.push(json!({"role": "tool", "tool_call_id": call["id"], "content": result}));
        }
    }
}

// ------------------------------------------------------ idemstore's agent --

fn fingerprint(value: &Value) -> Fingerprint {
    Fingerprint::of_json(value).expect("the simulation's JSON has no unsafe integers")
}

/// One task: each model turn runs once through `execute` (the journal),
/// each tool call once per tool-call key, each intent once per intent key.
fn task_with_store(store: &Store, world: &World, task: u32) -> Result<(), String> {
    let task_id = format!("task-{task}");
    let mut history = vec![json!({"role": "user", "content": format!("Refund order A-{task}")})];
    for turn in 0.. {
        let key =
            Key::for_model_turn("acme/agent.turns", &task_id, turn).map_err(|e| e.to_string())?;
        let reply = store
            .execute(
                &key,
                &fingerprint(&Value::Array(history.clone())),
                // Asking the model again is harmless: re-run a turn in doubt.
                ExecuteOptions::new().rerun_in_doubt(),
                |_lease| Ok::<_, Failure<String>>(world.ask_model(task, &history)),
            )
            .map_err(|e| e.to_string())?;
        if reply.is_replayed() {
            bump(&world.counts.turns_replayed);
        }
        let reply = reply.into_value();
        let Some(calls) = reply["tool_calls"].as_array().cloned() else {
            return Ok(());
        };
        history.push(reply);
        for call in calls {
            let result = run_tool(store, world, task, &call)?;
            history.push(json!({"role": "tool", "tool_call_id": call["id"], "content": result}));
        }
    }
    Ok(())
}

/// Runs one tool call: once per tool-call id, and inside that once per
/// intent (tool and parameters) of the task.
fn run_tool(store: &Store, world: &World, task: u32, call_: &Value) -> Result<String, String> {
    let task_id = format!("task-{task}");
    let task_id = task_id.as_str();
    let name = call_["name"].as_str().unwrap_or_default();
    let params = &call_["params"];
    let id = call_["id"].as_str().unwrap_or_default();
    let tool_key =
        Key::for_tool_call(format!("acme/{name}"), task_id, id).map_err(|e| e.to_string())?;
    let outer = store
        .execute(
            &tool_key,
            &fingerprint(params),
            // The work below is itself run-once: re-running it is safe.
            ExecuteOptions::new().rerun_in_doubt(),
            |_lease| {
                let intent = Key::for_intent(format!("acme/{name}.intents"), task_id, name, params)
                    .map_err(|e| Failure::permanent(e.to_string()))?;
                // An inner error is no final answer for the tool call (the
                // intent key decides): the next call of this key asks again.
                let inner = run_intent(store, world, task, name, &intent, params)
                    .map_err(Failure::retryable)?;
                match inner.origin() {
                    Origin::Replayed => bump(&world.counts.intents_replayed),
                    Origin::Recovered => bump(&world.counts.probes_recovered),
                    Origin::Ran | Origin::Reran => {}
                }
                Ok(inner.into_value())
            },
        )
        .map_err(|e| e.to_string())?;
    if outer.is_replayed() {
        bump(&world.counts.tool_calls_replayed);
    }
    Ok(outer.into_value())
}

/// The effect itself: the call driver sends with the intent key as the
/// external reference, and a takeover in doubt asks the service first.
fn run_intent(
    store: &Store,
    world: &World,
    task: u32,
    tool: &str,
    intent: &Key,
    params: &Value,
) -> Result<Executed<String>, String> {
    let policy = RetryPolicy::new(20, Duration::from_micros(100), Duration::from_millis(2))
        .map_err(|e| e.to_string())?;
    let probe = |lease: &Lease| match world.query(tool, lease.key()) {
        Ok(RemoteStatus::Done(id)) => Ok(Some(id)),
        Ok(RemoteStatus::NotFound | RemoteStatus::InProgress) => Ok(None),
        Err(_) => Err("service unreachable".to_string()),
    };
    store
        .execute(
            intent,
            &fingerprint(params),
            ExecuteOptions::new().probe_in_doubt(probe),
            |lease| {
                let result = call(
                    lease.key(),
                    &policy,
                    |key| world.send(task, tool, Some(key)),
                    |key| {
                        let status = world.query(tool, key);
                        if matches!(status, Ok(RemoteStatus::Done(_))) {
                            bump(&world.counts.lost_found_by_query);
                        }
                        status
                    },
                )
                .map_err(|e| Failure::retryable(e.to_string()))?;
                world.maybe_crash();
                Ok(result)
            },
        )
        .map_err(|e| e.to_string())
}

fn open(path: &Path, clock: &ManualClock) -> Store {
    let config = Config::new()
        .clock(clock.clone())
        .lease(LEASE)
        .sweep_interval(None);
    Store::open_with(path, config).expect("open the store")
}

/// Runs `task` until it finishes; a crash restarts the process (a new
/// `Store` on the same file) once the dead holder's lease has lapsed.
fn supervise(
    world: &World,
    mut run: impl FnMut() -> Result<(), String>,
    mut restart: impl FnMut(),
) {
    loop {
        match catch_unwind(AssertUnwindSafe(&mut run)) {
            Ok(Ok(())) => return,
            Ok(Err(e)) => panic!("task failed: {e}"),
            Err(payload) if payload.is::<Crash>() => {
                bump(&world.counts.restarts);
                restart();
            }
            Err(payload) => resume_unwind(payload),
        }
    }
}

fn main() {
    let seed = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(7_u64);
    println!(
        "agent_tools: {TASKS} tasks, seed {seed}; tools tickets.create (flaky) and payments.charge"
    );

    let naive = World::new(seed);
    for task in 0..TASKS {
        supervise(
            &naive,
            || {
                naive_task(&naive, task);
                Ok(())
            },
            || {},
        );
    }
    let (tickets, charges) = naive.duplicates();
    println!(
        "naive agent (resend on timeout, re-ask the model on restart): duplicates: tickets={tickets} charges={charges}"
    );

    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("agent.redb");
    let clock = ManualClock::starting_now();
    let world = World::new(seed);
    let store = RefCell::new(Some(open(&path, &clock)));
    for task in 0..TASKS {
        supervise(
            &world,
            || {
                let store = store.borrow();
                task_with_store(store.as_ref().expect("the store is open"), &world, task)
            },
            || {
                drop(store.borrow_mut().take()); // the process died
                clock.advance(LEASE + Duration::from_millis(1));
                *store.borrow_mut() = Some(open(&path, &clock));
            },
        );
    }

    let c = &world.counts;
    let faults: [(&str, &Cell<u32>); 4] = [
        (
            "model requests retried (the provider minted new ids)",
            &c.model_retries,
        ),
        (
            "calls the model re-planned under a new tool-call id",
            &c.replans,
        ),
        ("responses lost on the network", &c.lost),
        (
            "restarts mid-task (after an effect, before its record)",
            &c.restarts,
        ),
    ];
    let layers: [(&str, &Cell<u32>); 6] = [
        (
            "model-turn journal: turns replayed on resume",
            &c.turns_replayed,
        ),
        (
            "tool-call key: tool calls replayed on resume",
            &c.tool_calls_replayed,
        ),
        (
            "in-doubt probe: effects found after a restart",
            &c.probes_recovered,
        ),
        (
            "intent key: re-planned calls collapsed",
            &c.intents_replayed,
        ),
        (
            "call driver: lost responses found by query, not resent",
            &c.lost_found_by_query,
        ),
        (
            "call driver: 503 answers retried with the same key",
            &c.busy,
        ),
    ];
    println!("idemstore agent, faults injected:");
    for (what, n) in faults {
        println!("  {what:<56} {:>4}", n.get());
    }
    println!("which layer stopped which duplicate:");
    for (what, n) in layers {
        println!("  {what:<56} {:>4}", n.get());
    }
    let by_key = |ledger: &RefCell<Vec<Effect>>| {
        let mut seen: HashMap<&str, u32> = HashMap::new();
        let ledger = ledger.borrow();
        for reference in ledger.iter().filter_map(|e| e.reference.as_deref()) {
            *seen.entry(reference).or_default() += 1;
        }
        seen.values().filter(|n| **n > 1).count()
    };
    println!(
        "  effects: tickets={} charges={} for {TASKS} tasks; references used twice: {}",
        world.tickets.borrow().len(),
        world.charges.borrow().len(),
        by_key(&world.tickets) + by_key(&world.charges),
    );
    let (tickets, charges) = world.duplicates();
    println!("duplicates: tickets={tickets} charges={charges}");
    if tickets + charges > 0 {
        std::process::exit(1);
    }
}
