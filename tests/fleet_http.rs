//! The ticket service as a fleet: two replicas of `examples/ticket_service`
//! (this test binary re-run as two children, see `tests/common/mod.rs`)
//! on two ports share one PostgreSQL database, its idempotency store
//! (`Store::connect`) and its `tickets` table (`UNIQUE` on the idempotency
//! key). Real HTTP clients send ~200 distinct keys, each from several
//! clients, with short timeouts, and every attempt (a retry too) goes to a
//! replica chosen at random; replicas are SIGKILLed at random moments and
//! restarted on the same port. At the end the table holds exactly one
//! ticket per key, every client got the same ticket id for the same key,
//! and every key is completed in the store.
//!
//! Environment:
//! - `IDEMSTORE_FLEET_KILLS`: how many times a replica is killed (default 3)
//! - `IDEMSTORE_FLEET_KEYS`: how many distinct keys (default 200)
//! - `IDEMSTORE_FLEET_SEED`: the seed of every random choice (default 11)
//!
//! The server is the throwaway one of `tests/pg`; `IDEMSTORE_SKIP_POSTGRES=1`
//! skips this test.

mod common;
mod pg;
#[path = "../examples/ticket_service/service.rs"]
mod service;
mod ticket_child;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstore::{Config, Key, State, Store};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use ticket_child::{HttpClient, Server, request};

const TEST_NAME: &str = "two_replicas_one_database_one_ticket_per_key";
/// The replicas' lease: how long a key of a killed replica stays held.
const LEASE_MS: u64 = 1_000;
/// Simulated work per ticket, half before and half after it is written.
const WORK_MS: u64 = 30;
const REPLICAS: usize = 2;
const CLIENTS: usize = 16;
/// How many clients send each key.
const CLIENTS_PER_KEY: usize = 2;
/// The longest the whole run may take before the test gives up.
const DEADLINE: Duration = Duration::from_secs(240);

/// In the child: one replica, serving on the address the parent chose;
/// READY once the port accepts connections.
fn run_replica() -> ! {
    let options = service::Options {
        addr: common::child_var_parsed("FLEET_ADDR"),
        store: "unused-store.redb".into(),
        tickets: "unused-tickets.redb".into(),
        lease: Duration::from_millis(LEASE_MS),
        work: Duration::from_millis(WORK_MS),
        stream_interval: Duration::from_millis(10),
        metrics: None,
        postgres: Some(service::PgTarget {
            url: common::child_var("FLEET_URL"),
            schema: common::child_var("FLEET_SCHEMA"),
        }),
    };
    ticket_child::serve(options)
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Ticket ids each key was answered with, one per successful answer.
    ids: BTreeMap<String, Vec<u64>>,
    /// Successful answers per replica.
    per_replica: [u64; REPLICAS],
    attempts: u64,
    replays: u64,
    conflicts: u64,
    failures: u64,
}

/// Sends `key` until a 201 arrives, each attempt to a replica chosen at
/// random, retrying with the same key after a timeout, a refused
/// connection, a 409 or a 503.
async fn create_ticket(
    client: &HttpClient,
    addrs: &[SocketAddr; REPLICAS],
    key: &str,
    rng: &mut StdRng,
    seen: &Mutex<Seen>,
) -> Result<u64, String> {
    let body = format!(r#"{{"title":"ticket for {key}"}}"#);
    let start = Instant::now();
    loop {
        if start.elapsed() > DEADLINE {
            return Err(format!("key {key}: no ticket after {DEADLINE:?}"));
        }
        let replica = rng.random_range(0..REPLICAS);
        let req = http::Request::post(format!("http://{}/tickets", addrs[replica]))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        let timeout = Duration::from_millis(rng.random_range(20..400));
        seen.lock().unwrap().attempts += 1;
        match request(client, req, timeout).await {
            Ok((status, headers, bytes)) if status == http::StatusCode::CREATED => {
                let v: serde_json::Value =
                    serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
                let id = v["id"].as_u64().ok_or_else(|| format!("no id in {v}"))?;
                let mut s = seen.lock().unwrap();
                if headers.contains_key("idempotent-replayed") {
                    s.replays += 1;
                }
                s.per_replica[replica] += 1;
                s.ids.entry(key.to_owned()).or_default().push(id);
                return Ok(id);
            }
            Ok((status, headers, _)) if status == http::StatusCode::CONFLICT => {
                seen.lock().unwrap().conflicts += 1;
                let after: u64 = headers
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .ok_or("a 409 without Retry-After")?;
                let wait = Duration::from_secs(after).min(Duration::from_millis(300));
                tokio::time::sleep(wait).await;
            }
            Ok((status, _, _)) if status == http::StatusCode::SERVICE_UNAVAILABLE => {
                seen.lock().unwrap().failures += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok((status, _, bytes)) => {
                return Err(format!(
                    "key {key}: unexpected {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ));
            }
            Err(_) => {
                seen.lock().unwrap().failures += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(10..60))).await;
            }
        }
    }
}

/// A free loopback port below the ephemeral range (see `tests/http_e2e.rs`).
fn free_port(rng: &mut StdRng, taken: &[SocketAddr]) -> SocketAddr {
    let ephemeral_low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    for _ in 0..1_000 {
        let port = rng.random_range(10_000..ephemeral_low.max(10_001));
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if !taken.contains(&addr) && std::net::TcpListener::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free loopback port below {ephemeral_low}");
}

#[test]
fn two_replicas_one_database_one_ticket_per_key() {
    if common::child_role(TEST_NAME) {
        run_replica();
    }
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("fleet_http");
    let kills = common::seed_from_env("IDEMSTORE_FLEET_KILLS", 3);
    let keys_total = common::count_from_env("IDEMSTORE_FLEET_KEYS", 200);
    let seed = common::seed_from_env("IDEMSTORE_FLEET_SEED", 11);
    eprintln!(
        "fleet_http: seed {seed}, {kills} kills, {keys_total} keys, {CLIENTS} clients, \
         {REPLICAS} replicas, schema {schema}"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let a = free_port(&mut rng, &[]);
    let b = free_port(&mut rng, &[a]);
    let addrs = [a, b];
    let mut replicas: Vec<Server> = addrs
        .iter()
        .map(|addr| Server {
            test: TEST_NAME,
            vars: vec![
                ("FLEET_ADDR", addr.to_string()),
                ("FLEET_URL", url.clone()),
                ("FLEET_SCHEMA", schema.clone()),
            ],
            child: None,
        })
        .collect();
    for r in &mut replicas {
        r.start();
    }

    let keys: Vec<String> = (0..keys_total)
        .map(|i| format!("fleet-{seed}-{i}"))
        .collect();
    let mut plans: Vec<Vec<String>> = vec![Vec::new(); CLIENTS];
    for (i, key) in keys.iter().enumerate() {
        for c in 0..CLIENTS_PER_KEY {
            plans[(i + c * CLIENTS / CLIENTS_PER_KEY) % CLIENTS].push(key.clone());
        }
    }
    for plan in &mut plans {
        plan.shuffle(&mut rng);
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let done_kills = runtime.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
        let mut tasks = Vec::new();
        for (c, plan) in plans.into_iter().enumerate() {
            let (client, seen) = (client.clone(), seen.clone());
            let mut rng = StdRng::seed_from_u64(seed ^ ((c as u64 + 1) << 32));
            tasks.push(tokio::spawn(async move {
                for key in plan {
                    create_ticket(&client, &addrs, &key, &mut rng, &seen).await?;
                }
                Ok::<(), String>(())
            }));
        }
        let mut done = 0;
        while done < kills && !tasks.iter().all(|t| t.is_finished()) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
            let victim = rng.random_range(0..REPLICAS);
            eprintln!("fleet_http: SIGKILL replica {victim} ({})", addrs[victim]);
            replicas[victim].kill();
            // Down for a moment: its share of the retries goes to the other.
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..300))).await;
            replicas[victim].start();
            done += 1;
        }
        for task in tasks {
            if let Err(e) = task.await.unwrap() {
                panic!("seed {seed}: {e}");
            }
        }
        done
    });
    for r in &mut replicas {
        r.kill();
    }
    let seen = seen.lock().unwrap();
    eprintln!(
        "fleet_http: {done_kills} kills, {} attempts, {} replays, {} 409s, \
         {} timeouts/refusals/503s, answers per replica {:?}",
        seen.attempts, seen.replays, seen.conflicts, seen.failures, seen.per_replica
    );
    assert!(
        done_kills > 0,
        "seed {seed}: the clients finished before any kill"
    );
    assert!(
        seen.per_replica.iter().all(|&n| n > 0),
        "seed {seed}: both replicas answered: {:?}",
        seen.per_replica
    );

    // The table: one ticket per key, with the id every client got.
    let all = runtime.block_on(async {
        let target = service::PgTarget {
            url: url.clone(),
            schema: schema.clone(),
        };
        service::PgTickets::connect(&target)
            .await
            .expect("tickets")
            .all()
            .await
            .expect("all tickets")
    });
    assert_eq!(all.len(), keys.len(), "seed {seed}: one ticket per key");
    let by_key: BTreeMap<&str, u64> = all
        .iter()
        .map(|t| (t.idempotency_key.as_str(), t.id))
        .collect();
    assert_eq!(by_key.len(), keys.len(), "seed {seed}: keys are unique");
    let ids: BTreeSet<u64> = all.iter().map(|t| t.id).collect();
    assert_eq!(ids.len(), keys.len(), "seed {seed}: ids are unique");
    let store = Store::connect(
        &url,
        Config::new()
            .postgres_schema(schema.as_str())
            .sweep_interval(None),
    )
    .expect("connect");
    for key in &keys {
        let scoped = Key::new("POST /tickets", key.as_str()).unwrap();
        let answers = &seen.ids[key.as_str()];
        assert_eq!(answers.len(), CLIENTS_PER_KEY, "seed {seed}: {key}");
        let stored = by_key[scoped.reference().as_str()];
        assert!(
            answers.iter().all(|&id| id == stored),
            "seed {seed}: {key} answered {answers:?}, stored ticket {stored}"
        );
        let record = store.get(&scoped).unwrap().expect("a record per key");
        assert_eq!(record.state(), State::Succeeded, "seed {seed}: {key}");
    }
}
