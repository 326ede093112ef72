//! The HTTP layer over a PostgreSQL store whose connections fail under it
//! (features `http` and `postgres`), on a real server behind the tests' TCP
//! proxy (`tests/pg/proxy.rs`), served by axum and called by hyper:
//!
//! - a connection gone half-open (a NAT entry dropped: the proxy stops
//!   forwarding on the connections open at that moment, new ones work)
//!   holds neither a lease renewal nor the outcome's write past its
//!   deadline: the layer tries again on another connection while the lease
//!   lasts, so another replica's retry gets 409 while the handler runs, and
//!   a retry once the response is whole is its replay (the handler runs
//!   once);
//! - a client that goes away while the outcome is written leaves the
//!   outcome recorded and no failure queued behind it (no stale-lease
//!   rejection counted for a lease nobody lost);
//! - a store fault that passes on its own is 503 with `Retry-After`, one
//!   that needs an operator 503 without it.
//!
//! The hang guards are generous bounds that only a hang reaches.
//! `IDEMSTORE_SKIP_POSTGRES=1` skips these tests.

mod pg;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idemstore::http::IdempotencyLayer;
use idemstore::{Config, Key, PostgresLimits, State, Store};
use pg::proxy::{HANG_GUARD, Proxy, upstream_of, via};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// What one replica's handler did.
#[derive(Default)]
struct Handler {
    name: String,
    runs: AtomicUsize,
    delay_ms: AtomicU64,
}

/// Answers 201 naming the replica and the run, after the handler's delay.
async fn work(AxState(handler): AxState<Arc<Handler>>, _body: Bytes) -> Response {
    let run = handler.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let delay = handler.delay_ms.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    (StatusCode::CREATED, format!("{}-run{run}", handler.name)).into_response()
}

impl Handler {
    /// Waits until the handler has run once (under the hang guard).
    async fn ran(&self) {
        let started = Instant::now();
        while self.runs.load(Ordering::SeqCst) == 0 {
            assert!(started.elapsed() < HANG_GUARD, "the handler never ran");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Waits until the record of `POST /work` key `id` in `store` has
/// succeeded (under the hang guard).
async fn landed(store: &Arc<Store>, id: &str) {
    let key = Key::new("POST /work", id).expect("key");
    let started = Instant::now();
    loop {
        let (store, key) = (store.clone(), key.clone());
        let state = tokio::task::spawn_blocking(move || store.get(&key))
            .await
            .expect("get")
            .expect("get")
            .map(|r| r.state());
        if state == Some(State::Succeeded) {
            return;
        }
        assert!(
            started.elapsed() < HANG_GUARD,
            "the outcome never landed: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A store in `schema` at `url`, each call bounded by `call_ms`.
fn connect(url: &str, schema: &str, call_ms: u64) -> Arc<Store> {
    let mut limits = PostgresLimits::default();
    limits.call_timeout = Duration::from_millis(call_ms);
    limits.connect_timeout = Duration::from_millis(call_ms.min(1000));
    let config = Config::new()
        .postgres_schema(schema)
        .sweep_interval(None)
        .postgres_limits(limits);
    Arc::new(Store::connect(url, config).expect("connect"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Serves `POST /work` behind `layer` on a loopback port.
async fn serve(layer: IdempotencyLayer, name: &str) -> (SocketAddr, Arc<Handler>) {
    let handler = Arc::new(Handler {
        name: name.to_owned(),
        ..Handler::default()
    });
    let app = Router::new()
        .route("/work", post(work))
        .with_state(handler.clone())
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (addr, handler)
}

/// A response as the client got it.
struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    body: String,
}

/// Sends `POST /work` with idempotency key `key` and reads the whole
/// response, under the hang guard.
async fn send(client: &HttpClient, addr: SocketAddr, key: &str) -> Answer {
    let request = http::Request::post(format!("http://{addr}/work"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    tokio::time::timeout(HANG_GUARD, async {
        let response = client.request(request).await.expect("response");
        let status = response.status();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        Answer {
            status,
            replayed,
            retry_after,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    })
    .await
    .expect("hang guard: no answer")
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Replica A's connections go half-open 200 ms into a handler of 7 s under
/// a lease of 3 s, while each call may wait 8 s: its renewals, each under
/// a deadline, go on over new connections, so replica B's retries of the
/// key get 409 until A has answered, then A's replay; the handler runs
/// once. (Each renewal waited out `call_timeout` on the half-open
/// connection: the lease lapsed and B ran the handler again.)
#[test]
fn a_half_open_connection_does_not_lose_the_lease_of_a_running_handler() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("http_halfopen_lease");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let a = connect(&via(&url, &proxy), &schema, 8000);
    let b = connect(&url, &schema, 8000);
    runtime().block_on(async {
        let lease = Duration::from_secs(3);
        let (addr_a, handler_a) = serve(IdempotencyLayer::new(a.clone()).lease(lease), "A").await;
        let (addr_b, handler_b) = serve(IdempotencyLayer::new(b.clone()).lease(lease), "B").await;
        handler_a.delay_ms.store(7000, Ordering::SeqCst);
        let c = client();
        let first = tokio::spawn({
            let c = c.clone();
            async move { send(&c, addr_a, "half-open-lease").await }
        });
        handler_a.ran().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.pause_existing();
        let mut conflicts = 0;
        while !first.is_finished() {
            let retry = send(&c, addr_b, "half-open-lease").await;
            if retry.status != StatusCode::CONFLICT {
                assert!(
                    first.is_finished() || retry.replayed,
                    "replica B answered {} {} while A's handler still ran",
                    retry.status,
                    retry.body
                );
                break;
            }
            conflicts += 1;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let answer = first.await.expect("first request");
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
        assert!(conflicts > 0, "B was never asked while A ran");
        let retry = send(&c, addr_b, "half-open-lease").await;
        assert!(retry.replayed, "{} {}", retry.status, retry.body);
        assert_eq!(retry.body, answer.body);
        assert_eq!(handler_a.runs.load(Ordering::SeqCst), 1);
        assert_eq!(handler_b.runs.load(Ordering::SeqCst), 0);
    });
}

/// The connection the outcome's write goes on is half-open (call timeout
/// 5 s, lease 3 s): the write's attempt is dropped at its deadline and
/// made again on another connection while the heartbeat keeps the lease,
/// so the client's immediate retry is the replay and the handler ran once.
/// (One attempt waited out `call_timeout`, the lease lapsed meanwhile, and
/// the retry ran the handler again.)
#[test]
fn a_half_open_connection_does_not_lose_the_outcome() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("http_halfopen_outcome");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let a = connect(&via(&url, &proxy), &schema, 5000);
    runtime().block_on(async {
        let layer = IdempotencyLayer::new(a.clone()).lease(Duration::from_secs(3));
        let (addr, handler) = serve(layer, "A").await;
        handler.delay_ms.store(400, Ordering::SeqCst);
        let c = client();
        let first = tokio::spawn({
            let c = c.clone();
            async move { send(&c, addr, "half-open-outcome").await }
        });
        handler.ran().await;
        proxy.pause_existing();
        let answer = first.await.expect("first request");
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
        let retry = send(&c, addr, "half-open-outcome").await;
        assert!(
            retry.replayed,
            "the retry got {} {} (the handler ran {} times)",
            retry.status,
            retry.body,
            handler.runs.load(Ordering::SeqCst)
        );
        assert_eq!(retry.body, answer.body);
        assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    });
}

/// A client that goes away while the outcome is being written (the
/// server's answers to it held back): the outcome lands, its replay
/// answers the retry, and nothing was queued behind it under the same
/// token (the layer's drop queued a retryable failure, which the store
/// refused as a stale lease and counted as one).
#[test]
fn a_client_gone_while_the_outcome_is_written_queues_no_failure_behind_it() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("http_gone_recording");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let a = connect(&via(&url, &proxy), &schema, 10_000);
    let id = "gone-while-recording";
    runtime().block_on(async {
        let layer = IdempotencyLayer::new(a.clone()).lease(Duration::from_secs(30));
        let (addr, handler) = serve(layer, "A").await;
        handler.delay_ms.store(300, Ordering::SeqCst);
        let c = client();
        let first = tokio::spawn({
            let c = c.clone();
            async move { tokio::time::timeout(Duration::from_millis(900), send(&c, addr, id)).await }
        });
        handler.ran().await;
        // Every answer from the statement naming the key on is held: the
        // outcome's write reaches the server, its answer does not come back.
        proxy.hold_answers_after(id.as_bytes());
        assert!(
            first.await.expect("first request").is_err(),
            "the client was answered before it gave up"
        );
        proxy.resume();
        landed(&a, id).await;
        let retry = send(&c, addr, id).await;
        assert!(retry.replayed, "{} {}", retry.status, retry.body);
        assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
        // A failure queued by the drop is written within moments of it
        // (the write that showed it was counted a second after, before);
        // the handler's own completion is long done.
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    assert_eq!(a.stats().expect("stats").counters.stale_lease_rejections, 0);
}

/// A client that goes away in the pause between two attempts of the
/// outcome's write (the first attempt's connection half-open, dropped at
/// its deadline): nothing of the write is out then, so the layer queues it
/// as it is, and the outcome lands. (Nothing was queued: the key stayed in
/// progress until its lease lapsed, and the retry ran the handler again.)
/// Lease 9 s: the first attempt ends 3 s into the write, the next comes a
/// second later; the client gives up half-way between.
#[test]
fn a_client_gone_between_two_attempts_of_the_outcome_leaves_it_queued() {
    let Some(url) = pg::url() else { return };
    let schema = pg::schema("http_gone_between");
    idemstore::postgres::migrate(&url, &schema).expect("migrate");
    let proxy = Proxy::start(upstream_of(&url));
    let a = connect(&via(&url, &proxy), &schema, 6000);
    let id = "gone-between-attempts";
    runtime().block_on(async {
        let layer = IdempotencyLayer::new(a.clone()).lease(Duration::from_secs(9));
        let (addr, handler) = serve(layer, "A").await;
        handler.delay_ms.store(400, Ordering::SeqCst);
        let c = client();
        let first = tokio::spawn({
            let c = c.clone();
            async move { tokio::time::timeout(Duration::from_millis(3900), send(&c, addr, id)).await }
        });
        handler.ran().await;
        proxy.pause_existing();
        assert!(
            first.await.expect("first request").is_err(),
            "the client was answered before it gave up"
        );
        landed(&a, id).await;
        let retry = send(&c, addr, id).await;
        assert!(retry.replayed, "{} {}", retry.status, retry.body);
        assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    });
    proxy.resume();
}

/// A store fault that passes on its own (the database unreachable: the
/// proxy forwards nothing before the store's first connection, so nothing
/// is sent) is 503 with the layer's `Retry-After` (1.5 s, rounded up to
/// "2"), and the handler does not run; once the database is back, the same
/// request runs it once. A store that needs an operator (its primary key
/// dropped behind its back: `Misconfigured(SchemaDamaged)`) is 503 without
/// `Retry-After`.
#[test]
fn a_passing_store_fault_is_503_with_retry_after_and_one_that_needs_an_operator_without() {
    use idemstore::postgres::tokio_postgres::{self, NoTls};
    let Some(url) = pg::url() else { return };
    let passing = pg::schema("http_retry_after");
    let damaged = pg::schema("http_no_retry_after");
    for schema in [&passing, &damaged] {
        idemstore::postgres::migrate(&url, schema).expect("migrate");
    }
    let proxy = Proxy::start(upstream_of(&url));
    let a = connect(&via(&url, &proxy), &passing, 1000);
    let b = connect(&url, &damaged, 1000);
    runtime().block_on(async {
        let layer =
            IdempotencyLayer::new(a.clone()).unavailable_retry_after(Duration::from_millis(1500));
        let (addr_a, handler_a) = serve(layer, "A").await;
        let (addr_b, handler_b) = serve(IdempotencyLayer::new(b.clone()), "B").await;
        let c = client();

        proxy.pause();
        let refused = send(&c, addr_a, "passing").await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            refused.body
        );
        assert_eq!(
            refused.retry_after.as_deref(),
            Some("2"),
            "{}",
            refused.body
        );
        assert!(
            refused.body.contains("retry with the same idempotency key"),
            "{}",
            refused.body
        );
        assert_eq!(handler_a.runs.load(Ordering::SeqCst), 0);
        proxy.resume();
        let answer = send(&c, addr_a, "passing").await;
        assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
        assert_eq!(handler_a.runs.load(Ordering::SeqCst), 1);

        let (admin, connection) = tokio_postgres::connect(&url, NoTls).await.expect("admin");
        tokio::spawn(connection);
        admin
            .batch_execute(&format!(
                "ALTER TABLE {damaged}.records DROP CONSTRAINT records_pkey"
            ))
            .await
            .expect("drop the primary key");
        let refused = send(&c, addr_b, "damaged").await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            refused.body
        );
        assert_eq!(refused.retry_after, None, "{}", refused.body);
        assert_eq!(handler_b.runs.load(Ordering::SeqCst), 0);
    });
}
