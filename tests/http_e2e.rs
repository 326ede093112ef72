//! End to end: the ticket service of `examples/ticket_service` runs as a
//! child process (this test binary re-run as the child, see
//! `tests/common/mod.rs`),
//! many HTTP clients create tickets with idempotency keys, time out early
//! and retry with the same key, and the server is killed with SIGKILL at
//! random moments and restarted on the same files. At the end there is
//! exactly one ticket per key, and every client got the same ticket id for
//! the same key.
//!
//! Defaults keep the run to seconds. Environment:
//! - `IDEMSTORE_E2E_ROUNDS`: how many times the server is killed (default 6);
//!   the number of keys grows with it
//! - `IDEMSTORE_E2E_SEED`: the seed of every random choice (default 7)

mod common;
#[path = "../examples/ticket_service/service.rs"]
mod service;
mod ticket_child;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstore::{Key, State, Store};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use ticket_child::{HttpClient, Server, request};

const TEST_NAME: &str = "one_ticket_per_key_across_sigkills_and_retries";
/// The server's lease: how long a key of a killed server stays held.
const LEASE_MS: u64 = 1_000;
/// Simulated work per ticket, half before and half after it is written.
const WORK_MS: u64 = 40;
/// How many clients send each key.
const CLIENTS_PER_KEY: usize = 3;
const CLIENTS: usize = 12;
/// The longest the whole run may take before the test gives up.
const DEADLINE: Duration = Duration::from_secs(240);

/// In the child: serve on the address the parent chose, report READY once
/// the port accepts connections, and serve until killed.
fn run_server() -> ! {
    let options = service::Options {
        addr: common::child_var_parsed("E2E_ADDR"),
        store: PathBuf::from(common::child_var("E2E_STORE")),
        tickets: PathBuf::from(common::child_var("E2E_TICKETS")),
        lease: Duration::from_millis(LEASE_MS),
        work: Duration::from_millis(WORK_MS),
        stream_interval: Duration::from_millis(10),
        metrics: None,
        postgres: None,
    };
    ticket_child::serve(options)
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Ticket ids each key was answered with, one entry per client answer.
    ids: BTreeMap<String, Vec<u64>>,
    attempts: u64,
    replays: u64,
    conflicts: u64,
    failures: u64,
}

/// Sends `key` until a 201 arrives, retrying with the same key after a
/// timeout, a refused connection, a 409 or a 503.
async fn create_ticket(
    client: &HttpClient,
    addr: SocketAddr,
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
        let req = http::Request::post(format!("http://{addr}/tickets"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap();
        // Short timeouts, often shorter than the work: the client gives up
        // while the ticket is being written.
        let timeout = Duration::from_millis(rng.random_range(15..300));
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
                // Honour Retry-After, capped so the run stays short.
                let wait = Duration::from_secs(after).min(Duration::from_millis(300));
                tokio::time::sleep(wait).await;
            }
            Ok((status, _, bytes)) if status == http::StatusCode::SERVICE_UNAVAILABLE => {
                seen.lock().unwrap().failures += 1;
                eprintln!("503: {}", String::from_utf8_lossy(&bytes));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok((status, _, bytes)) => {
                return Err(format!(
                    "key {key}: unexpected {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ));
            }
            Err(_) => {
                // Timed out, refused (server down) or reset (killed).
                seen.lock().unwrap().failures += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(10..60))).await;
            }
        }
    }
}

/// A free loopback port below the ephemeral range, so that no client
/// connection is given it as its own port while the server is down between
/// a kill and a restart (which would make the restart fail to bind).
fn free_port(rng: &mut StdRng) -> SocketAddr {
    let ephemeral_low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    for _ in 0..1_000 {
        let port = rng.random_range(10_000..ephemeral_low.max(10_001));
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        if std::net::TcpListener::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free loopback port below {ephemeral_low}");
}

#[test]
fn one_ticket_per_key_across_sigkills_and_retries() {
    if common::child_role(TEST_NAME) {
        run_server();
    }
    let rounds = common::seed_from_env("IDEMSTORE_E2E_ROUNDS", 6);
    let seed = common::seed_from_env("IDEMSTORE_E2E_SEED", 7);
    let keys_total = usize::try_from(16 * rounds.max(1)).unwrap();
    eprintln!("http_e2e: seed {seed}, {rounds} kills, {keys_total} keys, {CLIENTS} clients");

    let dir = tempfile::tempdir().unwrap();
    let store_path = dir.path().join("idempotency.redb");
    let tickets_path = dir.path().join("tickets.redb");
    let mut rng = StdRng::seed_from_u64(seed);
    let addr = free_port(&mut rng);
    let mut server = Server {
        test: TEST_NAME,
        vars: vec![
            ("E2E_ADDR", addr.to_string()),
            ("E2E_STORE", common::path_var(&store_path)),
            ("E2E_TICKETS", common::path_var(&tickets_path)),
        ],
        child: None,
    };
    server.start();

    let keys: Vec<String> = (0..keys_total).map(|i| format!("e2e-{seed}-{i}")).collect();
    // Each key goes to CLIENTS_PER_KEY different clients, in a shuffled order.
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
    let kills = runtime.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

        let mut tasks = Vec::new();
        for (c, plan) in plans.into_iter().enumerate() {
            let (client, seen) = (client.clone(), seen.clone());
            let mut rng = StdRng::seed_from_u64(seed ^ ((c as u64 + 1) << 32));
            tasks.push(tokio::spawn(async move {
                for key in plan {
                    create_ticket(&client, addr, &key, &mut rng, &seen).await?;
                }
                Ok::<(), String>(())
            }));
        }

        // Kill the server at random moments while the clients run.
        let mut kills = 0;
        while kills < rounds && !tasks.iter().all(|t| t.is_finished()) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..600))).await;
            // This blocks the test's own thread (the one in `block_on`), not
            // a runtime worker: the clients keep retrying meanwhile.
            server.kill();
            server.start();
            kills += 1;
        }
        for task in tasks {
            if let Err(e) = task.await.unwrap() {
                panic!("seed {seed}: {e}");
            }
        }
        let req = http::Request::get(format!("http://{addr}/tickets/count"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (_, _, body) = request(&client, req, Duration::from_secs(10))
            .await
            .expect("count");
        let count: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            count["count"].as_u64(),
            Some(keys_total as u64),
            "seed {seed}: GET /tickets/count"
        );
        let req = http::Request::get(format!("http://{addr}/idempotency/stats"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (_, _, body) = request(&client, req, Duration::from_secs(10))
            .await
            .expect("stats");
        let stats: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let records = &stats["records"];
        assert_eq!(
            (records["succeeded"].as_u64(), records["total"].as_u64()),
            (Some(keys_total as u64), Some(keys_total as u64)),
            "seed {seed}: GET /idempotency/stats: {stats}"
        );
        kills
    });
    server.kill();

    let seen = seen.lock().unwrap();
    eprintln!(
        "http_e2e: {kills} kills, {} attempts, {} replays, {} 409s, {} timeouts/refusals/503s",
        seen.attempts, seen.replays, seen.conflicts, seen.failures
    );
    assert!(
        kills > 0,
        "seed {seed}: the clients finished before any kill"
    );
    check_files(&store_path, &tickets_path, &keys, &seen, seed);
}

/// One ticket per key in the ticket file, with the id every client got, and
/// every key completed in the idempotency store.
fn check_files(store: &Path, tickets: &Path, keys: &[String], seen: &Seen, seed: u64) {
    let all = service::Tickets::open(tickets).unwrap().all().unwrap();
    assert_eq!(all.len(), keys.len(), "seed {seed}: one ticket per key");
    let by_key: BTreeMap<&str, u64> = all
        .iter()
        .map(|t| (t.idempotency_key.as_str(), t.id))
        .collect();
    assert_eq!(by_key.len(), keys.len(), "seed {seed}: keys are unique");
    let ids: BTreeSet<u64> = all.iter().map(|t| t.id).collect();
    assert_eq!(ids.len(), keys.len(), "seed {seed}: ids are unique");

    let idem = Store::open(store).unwrap();
    for key in keys {
        let scoped = Key::new("POST /tickets", key.as_str()).unwrap();
        let answers = &seen.ids[key.as_str()];
        assert_eq!(answers.len(), CLIENTS_PER_KEY, "seed {seed}: {key}");
        let stored = by_key[scoped.reference().as_str()];
        assert!(
            answers.iter().all(|&id| id == stored),
            "seed {seed}: {key} answered {answers:?}, stored ticket {stored}"
        );
        let record = idem.get(&scoped).unwrap().expect("a record per key");
        assert_eq!(record.state(), State::Succeeded, "seed {seed}: {key}");
    }
}

/// `POST /tickets/triage` streams its body for several leases (1 s lease,
/// six events 600 ms apart): retries sent by another client while
/// it streams get 409, the ticket is created once, and a retry after the
/// last event gets the whole stream replayed. A real server on loopback and
/// a real HTTP client.
#[test]
fn a_streaming_response_retried_while_it_streams_is_409_then_replayed_whole() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // A port of its own, bound here and handed to the server (the other
    // test of this binary picks its port from the seed).
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let options = service::Options {
        addr,
        store: dir.path().join("idempotency.redb"),
        tickets: dir.path().join("tickets.redb"),
        lease: Duration::from_millis(1_000),
        work: Duration::ZERO,
        stream_interval: Duration::from_millis(600),
        metrics: None,
        postgres: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(service::serve_on(listener, options, async {
        let _ = stopped.await;
    }));
    runtime.block_on(async {
        let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
        let triage = || {
            http::Request::post(format!("http://{addr}/tickets/triage"))
                .header("idempotency-key", "triage-1")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(br#"{"title":"disk full"}"#)))
                .unwrap()
        };
        let mut first = loop {
            match client.request(triage()).await {
                Ok(resp) => break resp,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        assert_eq!(first.status(), http::StatusCode::CREATED);
        let mut streamed = Vec::new();
        let mut retries = Vec::new();
        while let Some(frame) = first.body_mut().frame().await {
            let data = frame.unwrap().into_data().unwrap();
            streamed.extend_from_slice(&data);
            let events = streamed.windows(2).filter(|w| w == b"\n\n").count();
            // After the first and the fourth event: the stream is under way.
            if events == 1 || events == 4 {
                let (status, headers, _) = request(&client, triage(), Duration::from_secs(30))
                    .await
                    .unwrap();
                retries.push((status, headers.contains_key("retry-after")));
            }
        }
        let events = u32::try_from(streamed.windows(2).filter(|w| w == b"\n\n").count()).unwrap();
        assert_eq!(events, service::TRIAGE_STEPS + 1);
        assert!(String::from_utf8_lossy(&streamed).contains("event: ticket"));
        assert_eq!(
            retries,
            [
                (http::StatusCode::CONFLICT, true),
                (http::StatusCode::CONFLICT, true)
            ]
        );

        let (status, headers, body) = request(&client, triage(), Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(status, http::StatusCode::CREATED);
        assert_eq!(headers["idempotent-replayed"], "true");
        assert_eq!(headers["content-type"], "text/event-stream");
        assert_eq!(body, streamed);

        let count = http::Request::get(format!("http://{addr}/tickets/count"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (_, _, body) = request(&client, count, Duration::from_secs(30))
            .await
            .unwrap();
        let count: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(count["count"], 1);

        // `POST /tickets` with key `triage/triage-1` prints as the triage
        // request's key: the service keys its tickets by the reference,
        // so this one is a ticket of its own (by the printed key it was
        // answered the triage ticket, and never made).
        let alike = http::Request::post(format!("http://{addr}/tickets"))
            .header("idempotency-key", "triage/triage-1")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"title":"printer on fire"}"#,
            )))
            .unwrap();
        let (status, _, body) = request(&client, alike, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(status, http::StatusCode::CREATED);
        let ticket: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(ticket["id"], 2);
        assert_eq!(ticket["title"], "printer on fire");
    });
    let _ = stop.send(());
    runtime.block_on(server).unwrap().unwrap();
}
