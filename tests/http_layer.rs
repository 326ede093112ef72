//! The HTTP layer's answers, one test per row of the status-code table,
//! driven through tower's `oneshot` with a handler that counts its runs.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Context;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idemstore::http::{
    BoxError, Idempotency, IdempotencyBody, IdempotencyContext, IdempotencyLayer,
    IdempotencyOutcome,
};
use idemstore::{Config, Key, ManualClock, Resolution, State, Store};
use tower::{Layer, Service, ServiceExt};

type Req = Request<IdempotencyBody<Full<Bytes>>>;
type Resp = Response<Full<Bytes>>;

/// What the handler saw on each run.
#[derive(Default)]
struct Runs {
    count: AtomicUsize,
    takeovers: AtomicUsize,
    last_acquisitions: AtomicUsize,
}

impl Runs {
    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// A store on a fresh file with a manual clock.
fn store_with(config: Config) -> (tempfile::TempDir, Arc<Store>) {
    let dir = tempfile::tempdir().unwrap();
    let store =
        Store::open_with(dir.path().join("idem.redb"), config.sweep_interval(None)).unwrap();
    (dir, Arc::new(store))
}

fn manual_store() -> (tempfile::TempDir, Arc<Store>, ManualClock) {
    let clock = ManualClock::starting_now();
    let (dir, store) = store_with(Config::new().clock(clock.clone()));
    (dir, store, clock)
}

/// A service whose handler records its run and answers `respond(request)`.
fn service<R, Fut>(
    layer: IdempotencyLayer,
    respond: R,
) -> (
    Idempotency<impl Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone>,
    Arc<Runs>,
)
where
    R: Fn(Req) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Resp> + Send + 'static,
{
    let runs = Arc::new(Runs::default());
    let seen = runs.clone();
    let handler = tower::service_fn(move |req: Req| {
        let seen = seen.clone();
        let respond = respond.clone();
        async move {
            seen.count.fetch_add(1, Ordering::SeqCst);
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .expect("a keyed request carries its context");
            if ctx.is_takeover() {
                seen.takeovers.fetch_add(1, Ordering::SeqCst);
            }
            seen.last_acquisitions
                .store(ctx.acquisitions() as usize, Ordering::SeqCst);
            Ok::<_, Infallible>(respond(req).await)
        }
    });
    (layer.layer(handler), runs)
}

fn created(body: &'static str) -> Resp {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", "/tickets/1")
        .header("x-request-id", "not-replayed")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

fn status(code: u16) -> Resp {
    Response::builder()
        .status(code)
        .body(Full::new(Bytes::from(format!("status {code}"))))
        .unwrap()
}

fn post(key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    let mut b = Request::post("/tickets");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

async fn send<S, B>(svc: &S, req: Request<Full<Bytes>>) -> (StatusCode, http::HeaderMap, Bytes)
where
    S: Service<Request<Full<Bytes>>, Response = Response<IdempotencyBody<B>>, Error = Infallible>
        + Clone,
    B: http_body::Body,
    B::Error: Into<BoxError>,
{
    let resp = svc.clone().oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, bytes)
}

fn replayed(headers: &http::HeaderMap) -> bool {
    headers.get("idempotent-replayed") == Some(&HeaderValue::from_static("true"))
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_400_and_the_handler_does_not_run() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async { created("{}") });

    let (code, headers, _) = send(&svc, post(None, "{}")).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    assert_eq!(headers["content-type"], "application/problem+json");

    let long = "k".repeat(256);
    assert_eq!(send(&svc, post(Some(&long), "{}")).await.0, 400);

    let two = Request::post("/tickets")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(&svc, two).await.0, 400);
    assert_eq!(runs.count(), 0);
}

#[tokio::test]
async fn a_retry_replays_status_chosen_headers_and_body() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store)
        .replay_headers([http::header::CONTENT_TYPE, http::header::LOCATION]);
    let (svc, runs) = service(layer, |_| async { created(r#"{"id":1}"#) });

    let (code, headers, body) = send(&svc, post(Some("k1"), r#"{"t":1}"#)).await;
    assert_eq!(code, StatusCode::CREATED);
    assert!(!replayed(&headers));
    assert_eq!(headers["x-request-id"], "not-replayed");

    // The quoted structured-field form of the IETF draft names the same key.
    let (code2, headers2, body2) = send(&svc, post(Some("\"k1\""), r#"{"t":1}"#)).await;
    assert_eq!(code2, StatusCode::CREATED);
    assert_eq!(body2, body);
    assert!(replayed(&headers2));
    assert_eq!(headers2["content-type"], "application/json");
    assert_eq!(headers2["location"], "/tickets/1");
    // Narrowed to two headers: the others are not replayed.
    assert!(headers2.get("x-request-id").is_none());
    assert_eq!(runs.count(), 1);
}

/// A 201 with the headers a client relies on next, and two that belong to
/// one delivery.
fn created_with_headers() -> Resp {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", "/tickets/7")
        .header("etag", "\"v1\"")
        .header("last-modified", "Tue, 01 Dec 2026 02:00:00 GMT")
        .header("cache-control", "no-store")
        .header("link", "</tickets/7/comments>; rel=\"comments\"")
        .header("x-ticket-shard", "eu-3")
        .header("set-cookie", "session=first-client; HttpOnly")
        .header("date", "Tue, 01 Dec 2026 02:00:01 GMT")
        .body(Full::new(Bytes::from_static(br#"{"id":7}"#)))
        .unwrap()
}

#[tokio::test]
async fn a_replay_returns_every_header_but_the_deny_list() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async {
        created_with_headers()
    });
    let (code, first, body) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!(code, StatusCode::CREATED);
    assert_eq!(first["set-cookie"], "session=first-client; HttpOnly");

    let (code, replay, replay_body) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code, replayed(&replay)), (StatusCode::CREATED, true));
    assert_eq!(replay_body, body);
    for name in [
        "content-type",
        "location",
        "etag",
        "last-modified",
        "cache-control",
        "link",
        "x-ticket-shard",
    ] {
        assert_eq!(replay.get(name), first.get(name), "{name} is replayed");
    }
    // A cookie belongs to the client that got it; a date to one delivery.
    assert!(replay.get("set-cookie").is_none());
    assert!(replay.get("date").is_none());
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn the_deny_list_can_be_widened_or_extended() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store.clone()).replay_all_headers_except([]);
    let (svc, _) = service(layer, |_| async { created_with_headers() });
    send(&svc, post(Some("k"), "x")).await;
    let replay = send(&svc, post(Some("k"), "x")).await.1;
    assert_eq!(replay["set-cookie"], "session=first-client; HttpOnly");

    let layer = IdempotencyLayer::new(store).replay_all_headers_except(
        idemstore::http::REPLAY_DENY_LIST
            .into_iter()
            .chain([http::HeaderName::from_static("x-ticket-shard")]),
    );
    let (svc, _) = service(layer, |_| async { created_with_headers() });
    send(&svc, post(Some("k2"), "x")).await;
    let replay = send(&svc, post(Some("k2"), "x")).await.1;
    assert!(replay.get("x-ticket-shard").is_none());
    assert!(replay.get("set-cookie").is_none());
    assert_eq!(replay["etag"], "\"v1\"");
}

#[tokio::test]
async fn the_same_key_with_another_payload_is_422() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async { created("{}") });
    assert_eq!(send(&svc, post(Some("k"), "a")).await.0, 201);
    let (code, _, body) = send(&svc, post(Some("k"), "b")).await;
    assert_eq!(code, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(String::from_utf8_lossy(&body).contains("different request payload"));
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn the_fingerprint_covers_chosen_headers_only() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store).fingerprint_headers([http::header::CONTENT_TYPE]);
    let (svc, runs) = service(layer, |_| async { created("{}") });
    let with = |ct: &'static str, other: &'static str| {
        Request::post("/tickets")
            .header("idempotency-key", "k")
            .header("content-type", ct)
            .header("x-trace", other)
            .body(Full::new(Bytes::from_static(b"same")))
            .unwrap()
    };
    assert_eq!(send(&svc, with("text/plain", "1")).await.0, 201);
    let (code, headers, _) = send(&svc, with("text/plain", "2")).await;
    assert_eq!(code, 201);
    assert!(replayed(&headers));
    assert_eq!(send(&svc, with("application/json", "1")).await.0, 422);
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_key_held_by_a_live_request_is_409_with_retry_after() {
    let (_d, store, clock) = manual_store();
    // A 60-s lease: its first renewal (20 s on, in real time) never comes
    // before the retry, and the lease's end stays where the claim put it.
    let layer = IdempotencyLayer::new(store).lease(Duration::from_secs(60));
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let (g, s) = (gate.clone(), started.clone());
    let (svc, runs) = service(layer, move |_| {
        let (g, s) = (g.clone(), s.clone());
        async move {
            s.notify_one();
            g.notified().await;
            created("{}")
        }
    });

    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post(Some("k"), "x")).await }
    });
    started.notified().await;
    clock.advance(Duration::from_millis(2_500));
    let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!(code, StatusCode::CONFLICT);
    // 57.5 s left on the lease, rounded up to whole seconds.
    assert_eq!(headers["retry-after"], "58");

    gate.notify_one();
    assert_eq!(first.await.unwrap().0, 201);
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_the_handler_does_not_run() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store).max_request_bytes(8);
    let (svc, runs) = service(layer, |_| async { created("{}") });

    // Refused from its Content-Length, before reading.
    let declared = Request::post("/tickets")
        .header("idempotency-key", "k")
        .header("content-length", "9")
        .body(Full::new(Bytes::from_static(b"123456789")))
        .unwrap();
    assert_eq!(send(&svc, declared).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    // Refused while reading a body that declares no length.
    assert_eq!(send(&svc, post(Some("k"), "123456789")).await.0, 413);
    // At the limit it runs.
    assert_eq!(send(&svc, post(Some("k"), "12345678")).await.0, 201);
    assert_eq!(runs.count(), 1);
}

/// An in-memory redb backend whose writes and syncs fail once `broken` is set.
#[derive(Debug)]
struct Breakable {
    inner: redb::backends::InMemoryBackend,
    broken: Arc<AtomicBool>,
}

impl Breakable {
    fn check(&self) -> std::io::Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected I/O error"));
        }
        Ok(())
    }
}

impl redb::StorageBackend for Breakable {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}

/// A write-ahead log in memory whose writes and syncs fail once `broken` is
/// set (with the write-ahead log, a claim's durable write is the log's).
struct BreakableLog {
    inner: idemstore::MemoryLog,
    broken: Arc<AtomicBool>,
}

impl BreakableLog {
    fn check(&self) -> std::io::Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected I/O error"));
        }
        Ok(())
    }
}

impl idemstore::LogFile for BreakableLog {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write_at(offset, data)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.check()?;
        self.inner.sync_data()
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
}

#[tokio::test]
async fn an_unavailable_store_is_503_and_the_handler_does_not_run() {
    let broken = Arc::new(AtomicBool::new(false));
    let backend = Breakable {
        inner: redb::backends::InMemoryBackend::new(),
        broken: broken.clone(),
    };
    let log = BreakableLog {
        inner: idemstore::MemoryLog::new(),
        broken: broken.clone(),
    };
    let store = Store::open_with_backend(
        "breakable",
        backend,
        log,
        Config::new().sweep_interval(None),
    )
    .unwrap();
    let (svc, runs) = service(IdempotencyLayer::new(Arc::new(store)), |_| async {
        created("{}")
    });
    assert_eq!(send(&svc, post(Some("before"), "x")).await.0, 201);

    broken.store(true, Ordering::SeqCst);
    // The failing commit, then the poisoned store: 503 both times.
    assert_eq!(send(&svc, post(Some("k1"), "x")).await.0, 503);
    assert_eq!(send(&svc, post(Some("k2"), "x")).await.0, 503);
    assert_eq!(runs.count(), 1);
}

/// A lease under `MIN_RENEWED_LEASE` (too short for the layer to renew by
/// durable writes) makes keyed requests 500 before anything is claimed or
/// run; the bound itself serves.
#[tokio::test]
async fn a_lease_too_short_to_renew_is_500_and_claims_nothing() {
    let (_d, store, _clock) = manual_store();
    let short = idemstore::MIN_RENEWED_LEASE - Duration::from_millis(1);
    let layer = IdempotencyLayer::new(store.clone()).lease(short);
    let (svc, runs) = service(layer, |_| async { created("{}") });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 500);
    assert_eq!(runs.count(), 0);
    assert_eq!(store.len().unwrap(), 0, "nothing was claimed");
    let layer = IdempotencyLayer::new(store.clone()).lease(idemstore::MIN_RENEWED_LEASE);
    let (svc, runs) = service(layer, |_| async { created("{}") });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 201);
    assert_eq!(runs.count(), 1);
}

/// A 5xx is a retryable failure and the retry a takeover; so is a 408
/// from inside the layer, a timeout of the handler (the layer read the
/// whole request first; tower-http's `TimeoutLayer` answers 408), which
/// may have acted: its retry never runs as a first attempt.
#[tokio::test]
async fn a_5xx_or_a_408_is_a_retryable_failure_and_the_retry_is_a_takeover() {
    for first in [500u16, 408] {
        let (_d, store, _c) = manual_store();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let (svc, runs) = service(IdempotencyLayer::new(store.clone()), move |_| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move { if n == 0 { status(first) } else { created("{}") } }
        });
        let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!(code, first);
        assert!(!replayed(&headers));
        let key = Key::new("POST /tickets", "k").unwrap();
        assert_eq!(
            store.get(&key).unwrap().unwrap().state(),
            State::Failed { retryable: true },
            "{first}"
        );

        assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 201);
        assert_eq!(runs.count(), 2);
        assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1, "{first}");
        assert_eq!(runs.last_acquisitions.load(Ordering::SeqCst), 2);
        let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!((code, replayed(&headers)), (StatusCode::CREATED, true));
    }
}

/// A 1xx is an interim status (RFC 9110 §15.2; hyper sends a 500 in place
/// of a 103): it is a retryable failure whether or not the handler marked
/// it `Final`, never a completion replayed for a day.
#[tokio::test]
async fn an_interim_status_as_the_answer_is_a_retryable_failure() {
    for marked in [false, true] {
        let (_d, store, _c) = manual_store();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let (svc, runs) = service(IdempotencyLayer::new(store.clone()), move |_| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move {
                if n > 0 {
                    return created("{}");
                }
                let mut r = status(103);
                if marked {
                    r.extensions_mut().insert(IdempotencyOutcome::Final);
                }
                r
            }
        });
        assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 103);
        let key = Key::new("POST /tickets", "k").unwrap();
        assert_eq!(
            store.get(&key).unwrap().unwrap().state(),
            State::Failed { retryable: true },
            "marked {marked}"
        );
        let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!((code, replayed(&headers)), (StatusCode::CREATED, false));
        assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1, "marked {marked}");
        let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!((code, replayed(&headers)), (StatusCode::CREATED, true));
        assert_eq!(runs.count(), 2);
    }
}

/// `HEAD` in `methods` is ignored: its response has no body a server
/// sends, so it could never be recorded, and a keyed HEAD would run its
/// handler on every retry. A HEAD request passes through untouched (no
/// 400 without a key, no record with one); the other methods listed keep
/// requiring a key.
#[tokio::test]
async fn head_in_methods_is_ignored() {
    let (_d, store, _c) = manual_store();
    let runs = Arc::new(AtomicUsize::new(0));
    let seen = runs.clone();
    let handler = tower::service_fn(move |_req: Req| {
        seen.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(created("{}")) }
    });
    let layer = IdempotencyLayer::new(store.clone()).methods([Method::POST, Method::HEAD]);
    let svc = layer.layer(handler);
    let head = |key: Option<&str>| {
        let mut b = Request::head("/tickets");
        if let Some(key) = key {
            b = b.header("idempotency-key", key);
        }
        b.body(Full::new(Bytes::new())).unwrap()
    };
    assert_eq!(send(&svc, head(None)).await.0, StatusCode::CREATED);
    assert_eq!(send(&svc, head(Some("h"))).await.0, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let key = Key::new("HEAD /tickets", "h").unwrap();
    assert!(store.get(&key).unwrap().is_none());
    assert_eq!(send(&svc, post(None, "x")).await.0, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_5xx_is_stored_when_configured() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store).store_server_errors(true);
    let (svc, runs) = service(layer, |_| async { status(502) });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 502);
    let (code, headers, body) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code.as_u16(), replayed(&headers)), (502, true));
    assert_eq!(body, "status 502");
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_4xx_is_stored_and_replayed() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async { status(409) });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 409);
    let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code.as_u16(), replayed(&headers)), (409, true));
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn the_handler_can_mark_a_5xx_final() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async {
        let mut r = status(503);
        r.extensions_mut().insert(IdempotencyOutcome::Final);
        r
    });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 503);
    let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code.as_u16(), replayed(&headers)), (503, true));
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn no_effect_releases_the_key_for_any_payload() {
    let (_d, store, _c) = manual_store();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let (svc, runs) = service(IdempotencyLayer::new(store.clone()), move |_| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                let mut r = status(429);
                r.extensions_mut().insert(IdempotencyOutcome::NoEffect);
                r
            } else {
                created("{}")
            }
        }
    });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 429);
    let key = Key::new("POST /tickets", "k").unwrap();
    assert!(store.get(&key).unwrap().is_none());
    // Released: another payload is a first attempt, not a 422.
    assert_eq!(send(&svc, post(Some("k"), "other")).await.0, 201);
    assert_eq!(runs.count(), 2);
    assert_eq!(runs.takeovers.load(Ordering::SeqCst), 0);
}

/// An attempt that may have acted is never released, whether by status or
/// by `NoEffect`: a takeover (an earlier attempt may have acted), or an
/// attempt that saved a recovery point. Releasing would delete the
/// acquisitions and the recovery point that tell the next attempt to look
/// its effect up. The key is kept as a retryable failure, with the payload
/// still bound to it. Each case: the first attempt saves a recovery point
/// and answers `first`; a second answers `then`, if any; the last one
/// succeeds and sees the recovery point.
#[tokio::test]
async fn an_attempt_that_may_have_acted_is_never_released() {
    /// A second attempt's status, and how its response is marked.
    type Then = Option<(u16, Option<IdempotencyOutcome>)>;
    let cases: [(u16, Then); 3] = [
        // A takeover answered with a release status, or marked NoEffect.
        (500, Some((429, None))),
        (500, Some((429, Some(IdempotencyOutcome::NoEffect)))),
        // A first attempt that passed on a downstream 429 after step 1.
        (429, None),
    ];
    for (first, then) in cases {
        let (_d, store, _c) = manual_store();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let (svc, runs) = service(IdempotencyLayer::new(store.clone()), move |req: Req| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move {
                let ctx = req
                    .extensions()
                    .get::<IdempotencyContext>()
                    .cloned()
                    .unwrap();
                match (n, then) {
                    (0, _) => {
                        ctx.store()
                            .set_recovery_point_async(ctx.lease(), b"step-1-done")
                            .await
                            .unwrap();
                        status(first)
                    }
                    (1, Some((code, mark))) => {
                        let mut r = status(code);
                        if let Some(mark) = mark {
                            r.extensions_mut().insert(mark);
                        }
                        r
                    }
                    _ => {
                        assert_eq!(ctx.recovery_point(), Some(&b"step-1-done"[..]));
                        created("{}")
                    }
                }
            }
        });
        let case = format!("{first} then {then:?}");
        let attempts = 1 + usize::from(then.is_some());
        for _ in 0..attempts {
            send(&svc, post(Some("k"), "x")).await;
        }
        let key = Key::new("POST /tickets", "k").unwrap();
        let record = store.get(&key).unwrap().expect(&case);
        assert_eq!(record.state(), State::Failed { retryable: true }, "{case}");
        assert_eq!(record.recovery_point(), Some(&b"step-1-done"[..]), "{case}");
        // Still bound to its payload.
        assert_eq!(send(&svc, post(Some("k"), "other")).await.0, 422, "{case}");
        assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 201, "{case}");
        assert_eq!(runs.count(), attempts + 1, "{case}");
        assert_eq!(runs.takeovers.load(Ordering::SeqCst), attempts, "{case}");
        assert_eq!(
            runs.last_acquisitions.load(Ordering::SeqCst),
            attempts + 1,
            "{case}"
        );
    }
}

/// A success among the release statuses is ignored: releasing it would run
/// the handler again on every retry.
#[tokio::test]
async fn only_refusals_can_be_release_statuses() {
    let (_d, store, _c) = manual_store();
    let layer =
        IdempotencyLayer::new(store).release_statuses([StatusCode::OK, StatusCode::CONFLICT]);
    let (svc, runs) = service(layer.clone(), |_| async { status(200) });
    assert_eq!(send(&svc, post(Some("a"), "x")).await.0, 200);
    assert!(replayed(&send(&svc, post(Some("a"), "x")).await.1));
    assert_eq!(runs.count(), 1);
    let (svc, runs) = service(layer, |_| async { status(409) });
    send(&svc, post(Some("b"), "x")).await;
    send(&svc, post(Some("b"), "x")).await;
    assert_eq!(runs.count(), 2, "409 is released");
}

/// The answer to a retry of a response that was too large to keep.
async fn assert_not_kept<S, B>(svc: &S, original: u16, location: Option<&str>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<IdempotencyBody<B>>, Error = Infallible>
        + Clone,
    B: http_body::Body,
    B::Error: Into<BoxError>,
{
    let (code, headers, body) = send(svc, post(Some("k"), "x")).await;
    assert_eq!((code, replayed(&headers)), (StatusCode::GONE, true));
    assert_eq!(headers["content-type"], "application/problem+json");
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["original_status"], original);
    assert_eq!(problem["location"].as_str(), location);
}

#[tokio::test]
async fn a_response_too_large_to_keep_finishes_the_key_and_a_retry_gets_410() {
    let (_d, store, _c) = manual_store();
    let big = "x".repeat(100);
    let layer = IdempotencyLayer::new(store.clone()).max_response_bytes(64);
    let (svc, runs) = service(layer, move |_| {
        let big = big.clone();
        async move {
            Response::builder()
                .status(StatusCode::CREATED)
                .header("location", "/tickets/1")
                .body(Full::new(Bytes::from(big)))
                .unwrap()
        }
    });
    let (code, _, body) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code, body.len()), (StatusCode::CREATED, 100));
    let key = Key::new("POST /tickets", "k").unwrap();
    assert_eq!(store.get(&key).unwrap().unwrap().state(), State::Succeeded);
    assert_not_kept(&svc, 201, Some("/tickets/1")).await;
    assert_not_kept(&svc, 201, Some("/tickets/1")).await;
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn the_stored_size_counts_headers_too() {
    let (_d, store, _c) = manual_store();
    // A 2-byte body under headers of 200 bytes does not fit 128 bytes.
    let layer = IdempotencyLayer::new(store.clone()).max_response_bytes(128);
    let (svc, runs) = service(layer, |_| async {
        Response::builder()
            .status(StatusCode::OK)
            .header("x-large", "h".repeat(200))
            .body(Full::new(Bytes::from_static(b"ok")))
            .unwrap()
    });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.2, "ok");
    assert_not_kept(&svc, 200, None).await;
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_response_over_the_stores_limit_finishes_the_key_and_a_retry_gets_410() {
    let (_d, store) = store_with(Config::new().max_result_bytes(64));
    let (svc, runs) = service(IdempotencyLayer::new(store.clone()), |_| async {
        Response::new(Full::new(Bytes::from("y".repeat(200))))
    });
    assert_eq!(send(&svc, post(Some("k"), "x")).await.2.len(), 200);
    let key = Key::new("POST /tickets", "k").unwrap();
    assert_eq!(store.get(&key).unwrap().unwrap().state(), State::Succeeded);
    assert_not_kept(&svc, 200, None).await;
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn refusals_that_did_nothing_release_the_key() {
    let (_d, store, _c) = manual_store();
    let first = Arc::new(AtomicUsize::new(0));
    for refusal in [425u16, 429] {
        first.store(0, Ordering::SeqCst);
        let seen = first.clone();
        let (svc, runs) = service(IdempotencyLayer::new(store.clone()), move |_| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    status(refusal)
                } else {
                    created("{}")
                }
            }
        });
        let id = format!("k{refusal}");
        assert_eq!(send(&svc, post(Some(&id), "a")).await.0, refusal);
        let key = Key::new("POST /tickets", id.as_str()).unwrap();
        assert!(store.get(&key).unwrap().is_none(), "{refusal} released");
        // Released: the retry, even with another payload, is a first attempt.
        assert_eq!(send(&svc, post(Some(&id), "b")).await.0, 201);
        assert_eq!(runs.count(), 2);
        assert_eq!(runs.takeovers.load(Ordering::SeqCst), 0);
    }
}

#[tokio::test]
async fn a_configured_status_releases_and_final_overrules_a_release() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store.clone()).release_statuses([
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::SERVICE_UNAVAILABLE,
    ]);
    let (svc, runs) = service(layer.clone(), |_| async { status(503) });
    assert_eq!(send(&svc, post(Some("a"), "x")).await.0, 503);
    let key = |id: &str| Key::new("POST /tickets", id).unwrap();
    assert!(store.get(&key("a")).unwrap().is_none());
    assert_eq!(send(&svc, post(Some("a"), "x")).await.0, 503);
    assert_eq!(runs.count(), 2);

    // 404, a default, is no longer in the list: stored and replayed like
    // any 4xx.
    let (svc, runs) = service(layer.clone(), |_| async { status(404) });
    send(&svc, post(Some("b"), "x")).await;
    assert!(replayed(&send(&svc, post(Some("b"), "x")).await.1));
    assert_eq!(runs.count(), 1);

    let (svc, runs) = service(layer, |_| async {
        let mut r = status(429);
        r.extensions_mut().insert(IdempotencyOutcome::Final);
        r
    });
    send(&svc, post(Some("c"), "x")).await;
    assert_eq!(
        store.get(&key("c")).unwrap().unwrap().state(),
        State::Failed { retryable: false }
    );
    assert!(replayed(&send(&svc, post(Some("c"), "x")).await.1));
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn other_methods_pass_through_untouched() {
    let (_d, store, _c) = manual_store();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let handler = tower::service_fn(move |req: Req| {
        let r = r.clone();
        async move {
            assert!(req.extensions().get::<IdempotencyContext>().is_none());
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Infallible>(status(200))
        }
    });
    let svc = IdempotencyLayer::new(store).layer(handler);
    for _ in 0..2 {
        let get = Request::get("/tickets")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (code, headers, _) = send(&svc, get).await;
        assert_eq!((code, replayed(&headers)), (StatusCode::OK, false));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn tenants_scope_keys() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store.clone()).tenant(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let (svc, runs) = service(layer, |_| async { created("{}") });
    let as_tenant = |tenant: &'static str| {
        Request::post("/tickets")
            .header("idempotency-key", "k")
            .header("x-tenant", tenant)
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap()
    };
    assert!(!replayed(&send(&svc, as_tenant("acme")).await.1));
    assert!(!replayed(&send(&svc, as_tenant("globex")).await.1));
    assert!(replayed(&send(&svc, as_tenant("acme")).await.1));
    assert_eq!(runs.count(), 2);
    assert!(
        store
            .get(&Key::new("acme/POST /tickets", "k").unwrap())
            .unwrap()
            .is_some()
    );
}

/// The reference a handler stores with its effect tells apart two keys
/// that print alike (`POST /tickets` with `triage/k1`, `POST
/// /tickets/triage` with `k1`): a handler that looked its effect up by the
/// printed key (as the docs said) found the other route's ticket and never
/// made its own.
#[tokio::test]
async fn the_reference_of_a_request_tells_keys_that_print_alike_apart() {
    let (_d, store, _c) = manual_store();
    let tickets = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let made = tickets.clone();
    let (svc, runs) = service(IdempotencyLayer::new(store), move |req: Req| {
        let made = made.clone();
        async move {
            let ctx = req.extensions().get::<IdempotencyContext>().unwrap();
            let reference = ctx.key().reference();
            let mut made = made.lock().unwrap();
            if !made.contains(&reference) {
                made.push(reference);
            }
            created("{}")
        }
    });
    let to = |path: &str, key: &str| {
        Request::post(path)
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    assert_eq!(send(&svc, to("/tickets", "triage/k1")).await.0, 201);
    assert_eq!(send(&svc, to("/tickets/triage", "k1")).await.0, 201);
    assert_eq!(runs.count(), 2);
    assert_eq!(tickets.lock().unwrap().len(), 2, "one ticket per key");
}

/// A path holding a control character (the `http` crate takes a raw
/// path's UTF-8: U+0085 here) is a scope like any long route's, by its
/// digest: the request runs and replays, where the scope was refused with
/// 500 and an error logged for the server's configuration.
#[tokio::test]
async fn a_path_with_a_control_character_is_keyed_by_its_digest() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async { created("{}") });
    let to = || {
        Request::post("/tickets\u{85}")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let (status, headers, _) = send(&svc, to()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed(&headers));
    let (status, headers, _) = send(&svc, to()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed(&headers));
    assert_eq!(runs.count(), 1);
}

/// An outcome the layer did not write (an operator's `resolve --succeeded`
/// with a JSON value, which the CLI now refuses for such a scope) answers
/// every retry 500; the repair the log names, a retryable failure recorded
/// over it, lets the next request run the handler again, as a takeover.
#[tokio::test]
async fn an_outcome_the_layer_did_not_write_is_repaired_by_a_retryable_failure() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store.clone()), |_| async {
        created("{}")
    });
    assert_eq!(
        send(&svc, post(Some("k"), "x")).await.0,
        StatusCode::CREATED
    );
    let key = Key::new("POST /tickets", "k").unwrap();
    let token = store.get(&key).unwrap().unwrap().token();
    store
        .amend(&key, token, Resolution::Succeeded(br#"{"id":1}"#.to_vec()))
        .unwrap();
    for _ in 0..2 {
        let (status, _, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(runs.count(), 1);
    store
        .amend(
            &key,
            token,
            Resolution::Failed {
                failure: br#""resolved""#.to_vec(),
                retryable: true,
            },
        )
        .unwrap();
    let (status, headers, _) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed(&headers));
    assert_eq!(runs.count(), 2);
    assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1);
}

/// Retries `POST /tickets` with key `k` until the answer is not 409 (a
/// failure queued without waiting may land after the first retry reads the
/// record), at most 500 times 10 ms apart (a hang guard); the last answer.
async fn retry_until_not_409<S, B>(svc: &S) -> StatusCode
where
    S: Service<Request<Full<Bytes>>, Response = Response<IdempotencyBody<B>>, Error = Infallible>
        + Clone,
    B: http_body::Body,
    B::Error: Into<BoxError>,
{
    let mut answer = StatusCode::CONFLICT;
    for _ in 0..500 {
        answer = send(svc, post(Some("k"), "x")).await.0;
        if answer != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    answer
}

/// Polls `fut` until `started` fires, then returns it, still pending.
async fn start<F: Future + Unpin>(mut fut: F, started: &tokio::sync::Notify) -> F {
    let notified = started.notified();
    tokio::pin!(notified);
    std::future::poll_fn(|cx: &mut Context<'_>| {
        if std::pin::Pin::new(&mut fut).poll(cx).is_ready() {
            panic!("the request finished before the handler was held");
        }
        notified.as_mut().poll(cx)
    })
    .await;
    fut
}

/// A handler that signals `started` and then waits for `gate`, forever if
/// the gate never opens.
#[allow(clippy::type_complexity)]
fn held_handler(
    layer: IdempotencyLayer,
) -> (
    Idempotency<impl Service<Req, Response = Resp, Error = Infallible, Future: Send> + Clone>,
    Arc<Runs>,
    Arc<tokio::sync::Notify>,
    Arc<tokio::sync::Notify>,
) {
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let (g, s) = (gate.clone(), started.clone());
    let first = Arc::new(AtomicBool::new(true));
    let (svc, runs) = service(layer, move |_| {
        let (g, s) = (g.clone(), s.clone());
        let hold = first.swap(false, Ordering::SeqCst);
        async move {
            if hold {
                s.notify_one();
                g.notified().await;
            }
            created("{}")
        }
    });
    (svc, runs, gate, started)
}

#[tokio::test]
async fn a_request_dropped_while_its_handler_runs_frees_the_key_for_a_takeover() {
    // The clock never moves, so the lease cannot lapse: only the recorded
    // failure lets the retry in.
    let (_d, store, _c) = manual_store();
    let (svc, runs, _gate, started) = held_handler(IdempotencyLayer::new(store));
    let fut = Box::pin(svc.clone().oneshot(post(Some("k"), "x")));
    let fut = start(fut, &started).await;
    drop(fut);

    // The failure is queued when the future is dropped; a claim that reads
    // the record before the write lands still sees the live lease (409).
    assert_eq!(retry_until_not_409(&svc).await, StatusCode::CREATED);
    assert_eq!(runs.count(), 2);
    assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_crashed_request_is_taken_over_after_its_lease_lapses() {
    let (_d, store, clock) = manual_store();
    let layer = IdempotencyLayer::new(store).lease(Duration::from_secs(60));
    let (svc, runs, _gate, started) = held_handler(layer);
    let fut = Box::pin(svc.clone().oneshot(post(Some("k"), "x")));
    let fut = start(fut, &started).await;
    // Forgetting the future runs no destructor, as a process that died
    // runs none. (Unlike a dead process, its registration with the
    // extender thread lives on: the first renewal, a third of the lease
    // on in real time, 20 s, comes long after this test's end.)
    std::mem::forget(fut);

    clock.advance(Duration::from_millis(59_999));
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 409);
    clock.advance(Duration::from_millis(2));
    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 201);
    assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1);
    assert_eq!(runs.last_acquisitions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_slow_handler_keeps_its_key_while_the_lease_is_extended() {
    // Real time: the lease is 2 s and the handler runs for three leases;
    // the layer extends it every 667 ms, so an extension may come 1.3 s
    // late (a loaded 2-core machine, a disk in a slow stretch) before the
    // lease lapses.
    let (_d, store) = store_with(Config::new());
    let layer = IdempotencyLayer::new(store.clone()).lease(Duration::from_secs(2));
    let (svc, runs, gate, started) = held_handler(layer);
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post(Some("k"), "x")).await }
    });
    started.notified().await;
    tokio::time::sleep(Duration::from_secs(6)).await;

    assert_eq!(send(&svc, post(Some("k"), "x")).await.0, 409);
    let key = Key::new("POST /tickets", "k").unwrap();
    let record = store.get(&key).unwrap().unwrap();
    assert_eq!(
        (record.state(), record.acquisitions()),
        (State::Processing, 1)
    );

    gate.notify_one();
    assert_eq!(first.await.unwrap().0, 201);
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_business_key_held_by_another_key_is_409_naming_it() {
    let (_d, store, _c) = manual_store();
    let layer = IdempotencyLayer::new(store).business_key(|_, body| {
        std::str::from_utf8(body)
            .ok()?
            .strip_prefix("order:")
            .map(str::to_owned)
    });
    let (svc, runs) = service(layer, |_| async { created("{}") });
    assert_eq!(send(&svc, post(Some("k1"), "order:9")).await.0, 201);

    let (code, headers, body) = send(&svc, post(Some("k2"), "order:9")).await;
    assert_eq!(code, StatusCode::CONFLICT);
    assert!(headers.get("retry-after").is_none());
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["existing_idempotency_key"], "k1");
    assert_eq!(problem["existing_state"], "succeeded");
    assert_eq!(problem["business_key"], "9");

    // The original key still replays; another business key still runs.
    assert!(replayed(&send(&svc, post(Some("k1"), "order:9")).await.1));
    assert_eq!(send(&svc, post(Some("k3"), "order:10")).await.0, 201);
    // A business key the store refuses is the client's fault.
    assert_eq!(send(&svc, post(Some("k4"), "order:\u{1}")).await.0, 400);
    assert_eq!(runs.count(), 2);
}

/// A response body fed through a channel, as a handler that returns at once
/// and streams its body (server-sent events, model tokens, a download)
/// gives it.
struct ChannelBody(tokio::sync::mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|item| item.map(|r| r.map(http_body::Frame::data)))
    }
}

type Chunks = tokio::sync::mpsc::UnboundedSender<Result<Bytes, std::io::Error>>;

/// A service whose first run answers 201 at once with a body the test feeds
/// (its sender arrives on the returned channel, with `headers` on the
/// response); later runs answer 201 with the body `again`.
#[allow(clippy::type_complexity)]
fn streaming(
    layer: IdempotencyLayer,
    headers: &'static [(&'static str, &'static str)],
) -> (
    Idempotency<
        impl Service<Req, Response = Response<ChannelBody>, Error = Infallible, Future: Send> + Clone,
    >,
    Arc<Runs>,
    tokio::sync::mpsc::UnboundedReceiver<Chunks>,
) {
    let runs = Arc::new(Runs::default());
    let (senders_tx, senders) = tokio::sync::mpsc::unbounded_channel();
    let seen = runs.clone();
    let handler = tower::service_fn(move |req: Req| {
        let seen = seen.clone();
        let senders_tx = senders_tx.clone();
        async move {
            let n = seen.count.fetch_add(1, Ordering::SeqCst);
            let ctx = req
                .extensions()
                .get::<IdempotencyContext>()
                .cloned()
                .unwrap();
            if ctx.is_takeover() {
                seen.takeovers.fetch_add(1, Ordering::SeqCst);
            }
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let mut builder = Response::builder().status(StatusCode::CREATED);
            if n == 0 {
                for (name, value) in headers {
                    builder = builder.header(*name, *value);
                }
                senders_tx.send(tx).unwrap();
            } else {
                tx.send(Ok(Bytes::from_static(b"again"))).unwrap();
            }
            Ok::<_, Infallible>(builder.body(ChannelBody(rx)).unwrap())
        }
    });
    (layer.layer(handler), runs, senders)
}

fn chunk(i: usize) -> Result<Bytes, std::io::Error> {
    Ok(Bytes::from(format!("event {i}\n")))
}

#[tokio::test]
async fn a_body_streaming_for_several_leases_keeps_its_key_until_the_last_byte() {
    // Real time: a 1 s lease (extended every 333 ms), and a body of six
    // chunks 600 ms apart that streams for over three leases; a retry while
    // it streams must get 409.
    let (_d, store) = store_with(Config::new());
    let layer = IdempotencyLayer::new(store.clone()).lease(Duration::from_millis(1_000));
    let (svc, runs, mut senders) = streaming(layer, &[]);
    let first = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post(Some("k"), "x")).await }
    });
    let tx = senders.recv().await.unwrap();
    let mut during = Vec::new();
    for i in 0..6 {
        tx.send(chunk(i)).unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        if i == 2 || i == 5 {
            during.push(send(&svc, post(Some("k"), "x")).await.0);
        }
    }
    drop(tx);
    let (code, _, body) = first.await.unwrap();
    assert_eq!(code, StatusCode::CREATED);
    let expected: String = (0..6).map(|i| format!("event {i}\n")).collect();
    assert_eq!(body, expected);
    assert_eq!(during, [StatusCode::CONFLICT, StatusCode::CONFLICT]);

    let (code, headers, replay) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code, replayed(&headers)), (StatusCode::CREATED, true));
    assert_eq!(replay, expected);
    assert_eq!(runs.count(), 1);
    let key = Key::new("POST /tickets", "k").unwrap();
    assert_eq!(store.get(&key).unwrap().unwrap().acquisitions(), 1);
}

/// A client that stops reading the body keeps the key: nothing polls the
/// response body, and the store's extender thread renews the lease all the
/// same. The store's time (a manual clock) moves three times by nine
/// tenths of the 1-s lease, each time followed by a renewal; a retry then
/// gets 409, not a takeover. (Renewed only when the body was polled, the
/// lease was never renewed and this test waited for it in vain.) Once the
/// body is read to its end, a retry replays it.
#[tokio::test]
async fn a_client_that_stops_reading_keeps_its_key() {
    let (_d, store, clock) = manual_store();
    let layer = IdempotencyLayer::new(store.clone()).lease(Duration::from_millis(1_000));
    let (svc, runs, mut senders) = streaming(layer, &[]);
    let response = svc.clone().oneshot(post(Some("k"), "x")).await.unwrap();
    let tx = senders.recv().await.unwrap();
    tx.send(chunk(0)).unwrap();
    let key = Key::new("POST /tickets", "k").unwrap();
    let lease_until = || store.get(&key).unwrap().unwrap().lease_until_ms();
    for _ in 0..3 {
        let before = lease_until();
        clock.advance(Duration::from_millis(900));
        // Hang guard only: a renewal comes a third of a lease (333 ms) on,
        // and extends the lease from the store's time just moved.
        let mut waited = 0;
        while lease_until() == before {
            assert!(waited < 3_000, "the lease was not renewed");
            tokio::time::sleep(Duration::from_millis(10)).await;
            waited += 1;
        }
    }
    assert_eq!(
        send(&svc, post(Some("k"), "x")).await.0,
        StatusCode::CONFLICT
    );
    drop(tx);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "event 0\n");
    let (code, headers, replay) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!((code, replayed(&headers)), (StatusCode::CREATED, true));
    assert_eq!(replay, "event 0\n");
    assert_eq!(runs.count(), 1);
}

#[tokio::test]
async fn a_body_that_fails_halfway_records_a_retryable_failure() {
    let (_d, store, _c) = manual_store();
    let (svc, runs, mut senders) = streaming(IdempotencyLayer::new(store.clone()), &[]);
    let first = tokio::spawn({
        let svc = svc.clone();
        async move {
            let resp = svc.oneshot(post(Some("k"), "x")).await.unwrap();
            resp.into_body().collect().await.map(|c| c.to_bytes())
        }
    });
    let tx = senders.recv().await.unwrap();
    tx.send(chunk(0)).unwrap();
    tx.send(Err(std::io::Error::other("upstream reset")))
        .unwrap();
    let error = first.await.unwrap().unwrap_err();
    assert!(error.to_string().contains("upstream reset"), "{error}");

    // Recorded before the error reached the client: a retry at once is a
    // takeover that the handler answers by looking its effect up.
    let key = Key::new("POST /tickets", "k").unwrap();
    assert_eq!(
        store.get(&key).unwrap().unwrap().state(),
        State::Failed { retryable: true }
    );
    let (code, headers, body) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!(
        (code, replayed(&headers), &body[..]),
        (StatusCode::CREATED, false, &b"again"[..])
    );
    assert_eq!(runs.count(), 2);
    assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_client_that_drops_the_response_mid_body_frees_the_key_for_a_takeover() {
    // The clock never moves: only the recorded failure lets the retry in.
    let (_d, store, _c) = manual_store();
    let (svc, runs, mut senders) = streaming(IdempotencyLayer::new(store.clone()), &[]);
    let resp = svc.clone().oneshot(post(Some("k"), "x")).await.unwrap();
    let tx = senders.recv().await.unwrap();
    tx.send(chunk(0)).unwrap();
    let mut body = resp.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "event 0\n");
    let key = Key::new("POST /tickets", "k").unwrap();
    assert_eq!(store.get(&key).unwrap().unwrap().state(), State::Processing);
    drop(body);

    // The failure is queued when the body is dropped; a claim that reads
    // the record before the write lands still sees the live lease (409).
    assert_eq!(retry_until_not_409(&svc).await, StatusCode::CREATED);
    assert_eq!(runs.count(), 2);
    assert_eq!(runs.takeovers.load(Ordering::SeqCst), 1);
    drop(tx);
}

#[tokio::test]
async fn the_outcome_is_recorded_before_the_last_byte_is_handed_on() {
    let (_d, store, _c) = manual_store();
    let state = |id: &str| {
        store
            .get(&Key::new("POST /tickets", id).unwrap())
            .unwrap()
            .unwrap()
            .state()
    };

    // A body of known length: its only frame is its last.
    let (svc, _) = service(IdempotencyLayer::new(store.clone()), |_| async {
        created("{}")
    });
    let mut body = svc
        .clone()
        .oneshot(post(Some("full"), "x"))
        .await
        .unwrap()
        .into_body();
    assert!(body.frame().await.unwrap().unwrap().is_data());
    assert_eq!(state("full"), State::Succeeded);
    assert!(body.frame().await.is_none());

    // A stream that declares its length: the frame that completes it.
    let (svc, _, mut senders) = streaming(
        IdempotencyLayer::new(store.clone()),
        &[("content-length", "16")],
    );
    let mut body = svc
        .clone()
        .oneshot(post(Some("declared"), "x"))
        .await
        .unwrap()
        .into_body();
    let tx = senders.recv().await.unwrap();
    tx.send(chunk(0)).unwrap();
    body.frame().await.unwrap().unwrap();
    assert_eq!(state("declared"), State::Processing);
    tx.send(chunk(1)).unwrap();
    body.frame().await.unwrap().unwrap();
    assert_eq!(state("declared"), State::Succeeded);
    drop(tx);

    // A chunked stream: its end, before the end is handed on.
    let (svc, _, mut senders) = streaming(IdempotencyLayer::new(store.clone()), &[]);
    let mut body = svc
        .clone()
        .oneshot(post(Some("chunked"), "x"))
        .await
        .unwrap()
        .into_body();
    let tx = senders.recv().await.unwrap();
    tx.send(chunk(0)).unwrap();
    body.frame().await.unwrap().unwrap();
    assert_eq!(state("chunked"), State::Processing);
    drop(tx);
    assert!(body.frame().await.is_none());
    assert_eq!(state("chunked"), State::Succeeded);
}

#[test]
fn the_bodies_the_layer_hands_on_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    // `http_body_util::combinators::BoxBody` needs both.
    send_sync::<IdempotencyBody<Full<Bytes>>>();
}

/// Serves `app` on a loopback port of its own; the address.
async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A real HTTP/1.1 client: status, headers and body of a POST with `key`.
async fn post_to(
    addr: std::net::SocketAddr,
    path: &str,
    key: &str,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = Request::post(format!("http://{addr}{path}"))
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"x")))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

/// A handler that blocks its thread (a synchronous call inside an `async`
/// handler) for longer than its lease keeps its key: the store's extender
/// thread renews the lease while the runtime cannot poll the request, so a
/// retry meanwhile gets 409, and once the handler has answered, a replay.
/// (Renewed by the request's task alone, the lease lapsed under the
/// blocked thread and the retry ran the handler a second time.) A real
/// server on two worker threads, the store on the system clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_blocks_its_thread_keeps_its_key() {
    use axum::routing::post;
    let (_d, store) = store_with(Config::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if run == 1 {
                    // Two and a half leases with the thread blocked.
                    std::thread::sleep(Duration::from_millis(2_500));
                }
                (StatusCode::CREATED, format!("run {run}"))
            }
        }
    };
    let app = axum::Router::new()
        .route("/blocking", post(handler))
        .layer(IdempotencyLayer::new(store).lease(Duration::from_secs(1)));
    let addr = serve(app).await;
    let first = tokio::spawn(async move { post_to(addr, "/blocking", "b-1").await });
    // Past the first lease's end, while the handler still blocks.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let (retry, headers, _) = post_to(addr, "/blocking", "b-1").await;
    assert_eq!(retry, StatusCode::CONFLICT, "the retry ran: {headers:?}");
    let (status, _, body) = first.await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"run 1"[..]));
    let (again, headers, body) = post_to(addr, "/blocking", "b-1").await;
    assert_eq!((again, &body[..]), (StatusCode::CREATED, &b"run 1"[..]));
    assert!(replayed(&headers));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body over the limit of a layer outside this one (tower-http's
/// `RequestBodyLimitLayer`), sent without `content-length` (chunked, so
/// that the outer layer cannot refuse it from its head), is 413 as one over
/// the layer's own limit, not 400: the handler does not run and the key is
/// not claimed.
#[tokio::test]
async fn a_chunked_body_over_an_outer_limit_is_413() {
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_d, store, _c) = manual_store();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = {
        let runs = runs.clone();
        move || {
            runs.fetch_add(1, Ordering::SeqCst);
            async { StatusCode::CREATED }
        }
    };
    let app = axum::Router::new()
        .route("/big", post(counted))
        .layer(IdempotencyLayer::new(store.clone()))
        .layer(tower_http::limit::RequestBodyLimitLayer::new(16));
    let addr = serve(app).await;
    let chunk = "x".repeat(40);
    let request = format!(
        "POST /big HTTP/1.1\r\nhost: test\r\nidempotency-key: over\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        store.get(&Key::new("POST /big", "over").unwrap()).unwrap(),
        None
    );
}

#[tokio::test]
async fn responses_sent_without_a_body_are_recorded_over_a_real_connection() {
    use axum::routing::post;
    let (_d, store, _c) = manual_store();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = |status: StatusCode| {
        let runs = runs.clone();
        move || {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { status }
        }
    };
    let unit = {
        let runs = runs.clone();
        move || {
            runs.fetch_add(1, Ordering::SeqCst);
            async {}
        }
    };
    let app = axum::Router::new()
        .route("/no-content", post(counted(StatusCode::NO_CONTENT)))
        .route("/created", post(counted(StatusCode::CREATED)))
        .route("/unit", post(unit))
        .layer(IdempotencyLayer::new(store.clone()));
    let addr = serve(app).await;
    for (path, status) in [
        ("/no-content", StatusCode::NO_CONTENT),
        ("/created", StatusCode::CREATED),
        ("/unit", StatusCode::OK),
    ] {
        let (code, headers, body) = post_to(addr, path, "k").await;
        assert_eq!(
            (code, replayed(&headers), body.len()),
            (status, false, 0),
            "{path}"
        );
        // Recorded before the head was sent: a server reads no body here.
        let key = Key::new(format!("POST {path}"), "k").unwrap();
        assert_eq!(
            store.get(&key).unwrap().unwrap().state(),
            State::Succeeded,
            "{path}"
        );
        let (code, headers, _) = post_to(addr, path, "k").await;
        assert_eq!((code, replayed(&headers)), (status, true), "{path}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// A body of one data frame and trailers that then never ends: a server
/// hands the trailers on and polls no more.
struct TrailersThenPending(std::collections::VecDeque<http_body::Frame<Bytes>>);

impl http_body::Body for TrailersThenPending {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        match self.0.pop_front() {
            Some(frame) => std::task::Poll::Ready(Some(Ok(frame))),
            None => std::task::Poll::Pending,
        }
    }
}

#[tokio::test]
async fn trailers_end_a_recorded_body_over_a_real_connection() {
    use axum::routing::post;
    let (_d, store, _c) = manual_store();
    let app = axum::Router::new()
        .route(
            "/trailers",
            post(|| async {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-checksum", HeaderValue::from_static("abc"));
                let frames = [
                    http_body::Frame::data(Bytes::from_static(b"payload")),
                    http_body::Frame::trailers(trailers),
                ];
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("trailer", "x-checksum")
                    .body(axum::body::Body::new(TrailersThenPending(frames.into())))
                    .unwrap()
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()));
    let addr = serve(app).await;
    let (code, _, body) = post_to(addr, "/trailers", "k").await;
    assert_eq!((code, &body[..]), (StatusCode::CREATED, &b"payload"[..]));
    let key = Key::new("POST /trailers", "k").unwrap();
    assert_eq!(store.get(&key).unwrap().unwrap().state(), State::Succeeded);
    let (code, headers, replay) = post_to(addr, "/trailers", "k").await;
    assert_eq!(
        (code, replayed(&headers), replay),
        (StatusCode::CREATED, true, body)
    );
}

#[tokio::test]
async fn a_body_that_disagrees_with_its_content_length_is_recorded_as_sent() {
    let (_d, store, _c) = manual_store();
    // Longer than declared: a server sends the declared bytes, and those
    // are what a retry gets.
    let (svc, runs) = service(IdempotencyLayer::new(store.clone()), |_| async {
        Response::builder()
            .status(StatusCode::CREATED)
            .header("content-length", "4")
            .body(Full::new(Bytes::from_static(b"ticket-42")))
            .unwrap()
    });
    send(&svc, post(Some("long"), "x")).await;
    let (code, headers, body) = send(&svc, post(Some("long"), "x")).await;
    assert_eq!(
        (code, replayed(&headers), &body[..]),
        (StatusCode::CREATED, true, &b"tick"[..])
    );
    assert_eq!(runs.count(), 1);

    // Shorter than declared: the server aborts the response, so the client
    // never got it whole: a failed body.
    let (svc, runs) = service(IdempotencyLayer::new(store.clone()), |_| async {
        Response::builder()
            .status(StatusCode::CREATED)
            .header("content-length", "10")
            .body(Full::new(Bytes::from_static(b"tick")))
            .unwrap()
    });
    let resp = svc.clone().oneshot(post(Some("short"), "x")).await.unwrap();
    assert!(resp.into_body().collect().await.is_err());
    let key = Key::new("POST /tickets", "short").unwrap();
    assert_eq!(
        store.get(&key).unwrap().unwrap().state(),
        State::Failed { retryable: true }
    );
    assert_eq!(runs.count(), 1);
}

/// A request axum's `Json` extractor refused before the handler ran (415
/// without `content-type`, 422 for a body of the wrong shape, 400 for one
/// that is not JSON) stores nothing: the same key, sent again as it should
/// have been, runs the handler once and is then replayed. Over a real
/// connection with a real client.
#[tokio::test]
async fn a_request_the_json_extractor_refused_is_not_pinned() {
    use axum::routing::post;
    #[derive(serde::Deserialize)]
    struct Ticket {
        title: String,
    }
    let (_d, store, _c) = manual_store();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |axum::Json(ticket): axum::Json<Ticket>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { (StatusCode::CREATED, ticket.title) }
        }
    };
    let app = axum::Router::new()
        .route("/tickets", post(handler))
        .layer(IdempotencyLayer::new(store.clone()));
    let addr = serve(app).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let send = |id: &'static str, content_type: Option<&'static str>, body: &'static str| {
        let client = client.clone();
        async move {
            let mut req =
                Request::post(format!("http://{addr}/tickets")).header("idempotency-key", id);
            if let Some(ct) = content_type {
                req = req.header("content-type", ct);
            }
            let resp = client
                .request(
                    req.body(Full::new(Bytes::from_static(body.as_bytes())))
                        .unwrap(),
                )
                .await
                .unwrap();
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (parts.status, replayed(&parts.headers), body)
        }
    };
    let good = r#"{"title":"printer on fire"}"#;
    for (id, ct, bad_body, refused) in [
        (
            "no-media-type",
            None,
            good,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            "wrong-shape",
            Some("application/json"),
            r#"{"name":1}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "not-json",
            Some("application/json"),
            "{",
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let (code, again, _) = send(id, ct, bad_body).await;
        assert_eq!((code, again), (refused, false), "{id}");
        let key = Key::new("POST /tickets", id).unwrap();
        assert!(
            store.get(&key).unwrap().is_none(),
            "{id}: the refusal was stored"
        );
        let (code, again, body) = send(id, Some("application/json"), good).await;
        assert_eq!(
            (code, again, &body[..]),
            (StatusCode::CREATED, false, &b"printer on fire"[..]),
            "{id}"
        );
        let (code, again, body) = send(id, Some("application/json"), good).await;
        assert_eq!(
            (code, again, &body[..]),
            (StatusCode::CREATED, true, &b"printer on fire"[..]),
            "{id}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// `content-type` is in the default fingerprint: the same bytes sent with
/// another media type under the same key are another payload (422). It is
/// compared as a media type: a retry that spells it otherwise (case, a
/// `charset` JSON ignores) is the same payload and gets the replay.
#[tokio::test]
async fn the_default_fingerprint_covers_the_media_type() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async { created("{}") });
    let with = |ct: &'static str| {
        Request::post("/tickets")
            .header("idempotency-key", "k")
            .header("content-type", ct)
            .body(Full::new(Bytes::from_static(b"same")))
            .unwrap()
    };
    assert_eq!(send(&svc, with("application/json")).await.0, 201);
    for same in [
        "application/json",
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
    ] {
        let (code, headers, _) = send(&svc, with(same)).await;
        assert_eq!(
            (code, replayed(&headers)),
            (StatusCode::CREATED, true),
            "{same}"
        );
    }
    assert_eq!(send(&svc, with("text/plain")).await.0, 422);
    assert_eq!(runs.count(), 1);
}

/// A response that echoes `authorization` or `proxy-authorization` is
/// replayed without them (they belong to the client that sent them).
#[tokio::test]
async fn a_replay_never_carries_credentials() {
    let (_d, store, _c) = manual_store();
    let (svc, _runs) = service(IdempotencyLayer::new(store), |_| async {
        let mut r = created("{}");
        r.headers_mut().insert(
            "authorization",
            HeaderValue::from_static("Bearer first-client"),
        );
        r.headers_mut().insert(
            "proxy-authorization",
            HeaderValue::from_static("Basic Zmlyc3Q="),
        );
        r.headers_mut()
            .insert("x-ticket", HeaderValue::from_static("7"));
        r
    });
    let (_, first, _) = send(&svc, post(Some("k"), "x")).await;
    assert!(first.contains_key("authorization"));
    let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
    assert_eq!(code, 201);
    assert!(replayed(&headers));
    assert_eq!(headers.get("x-ticket").unwrap(), "7");
    assert!(!headers.contains_key("authorization"), "{headers:?}");
    assert!(!headers.contains_key("proxy-authorization"), "{headers:?}");
}

/// A key is visible ASCII: a space or a tab in it, bare or quoted, is 400
/// and runs nothing.
#[tokio::test]
async fn a_key_with_a_space_is_400() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store), |_| async { created("{}") });
    for bad in ["k 5", "\"k 5\"", "k\t5"] {
        let (code, _, body) = send(&svc, post(Some(bad), "x")).await;
        assert_eq!(code, 400, "{bad:?}: {body:?}");
    }
    assert_eq!(send(&svc, post(Some("\"k-5\""), "x")).await.0, 201);
    assert_eq!(runs.count(), 1);
}

/// The fields a response's `connection` header names are per-connection
/// (RFC 9110 §7.6.1): a replay never carries them, whether every header
/// but a deny-list is stored or only named ones.
#[tokio::test]
async fn a_replay_drops_the_fields_connection_names() {
    let layers: [fn(Arc<Store>) -> IdempotencyLayer; 2] = [IdempotencyLayer::new, |store| {
        IdempotencyLayer::new(store).replay_headers([
            HeaderName::from_static("x-hop"),
            HeaderName::from_static("x-ticket"),
        ])
    }];
    for layer in layers {
        let (_d, store, _c) = manual_store();
        let (svc, runs) = service(layer(store), |_| async {
            let mut r = created("{}");
            let h = r.headers_mut();
            h.insert("connection", HeaderValue::from_static("keep-alive, X-Hop"));
            h.insert("x-hop", HeaderValue::from_static("per-connection"));
            h.insert("x-ticket", HeaderValue::from_static("7"));
            r
        });
        let (_, first, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!(first.get("x-hop").unwrap(), "per-connection");
        let (code, headers, _) = send(&svc, post(Some("k"), "x")).await;
        assert_eq!(code, 201);
        assert!(replayed(&headers));
        assert_eq!(runs.count(), 1);
        assert_eq!(headers.get("x-ticket").unwrap(), "7");
        assert!(!headers.contains_key("x-hop"), "{headers:?}");
    }
}

/// A request dropped while its claim is in flight (the client hung up;
/// hyper drops the response future) leaves no key held by nobody: once
/// that claim is decided, the retry runs the handler at once, as a first
/// attempt, not 409 for the lease's length and then a takeover.
#[tokio::test]
async fn a_request_dropped_during_its_claim_leaves_the_key_free() {
    let (_d, store, _c) = manual_store();
    let (svc, runs) = service(IdempotencyLayer::new(store.clone()), |_| async {
        created("{}")
    });
    // A loaded machine may decide the claim (and run the handler) within
    // the first poll: such a request was not abandoned in its claim, and
    // the next key is tried.
    for i in 0..20 {
        let id = format!("k{i}");
        let ran_before = runs.count();
        let mut first = Box::pin(svc.clone().oneshot(post(Some(&id), "x")));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let in_claim = first.as_mut().poll(&mut cx).is_pending() && runs.count() == ran_before;
        drop(first);
        if !in_claim {
            continue;
        }
        // The abandoned claim is decided (the key shows as held); a hang
        // guard, not a timing assertion.
        let key = Key::new("POST /tickets", id.as_str()).unwrap();
        let guard = std::time::Instant::now() + Duration::from_secs(60);
        while store.get(&key).unwrap().is_none() {
            assert!(
                std::time::Instant::now() < guard,
                "the claim was never decided"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let takeovers_before = runs.takeovers.load(Ordering::SeqCst);
        let (code, headers, _) = send(&svc, post(Some(&id), "x")).await;
        assert_eq!(code, 201, "{headers:?}");
        assert_eq!(runs.count(), ran_before + 1);
        assert_eq!(
            runs.takeovers.load(Ordering::SeqCst),
            takeovers_before,
            "nothing ran before"
        );
        return;
    }
    panic!("every claim was decided within its first poll; none could be abandoned");
}
