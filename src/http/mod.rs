//! Idempotency keys for HTTP services: a tower [`Layer`](tower::Layer) for
//! axum, hyper or any tower stack (cargo feature `http`).
//!
//! [`IdempotencyLayer`] reads the `Idempotency-Key` header of `POST` and
//! `PATCH` requests, claims the key in a [`Store`](crate::Store), runs the
//! handler once, stores its response, and replays that response to every
//! retry with the same key and payload, as the IETF Idempotency-Key header
//! draft and Stripe describe.
//!
//! ```
//! use std::sync::Arc;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use bytes::Bytes;
//! use idemstore::http::{IdempotencyBody, IdempotencyContext, IdempotencyLayer};
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let dir = tempfile::tempdir()?;
//! let store = Arc::new(idemstore::Store::open(dir.path().join("idem.redb"))?);
//! let tickets = service_fn(|req: Request<IdempotencyBody<Full<Bytes>>>| async move {
//!     // The layer holds the key's lease while this runs.
//!     let ctx = req.extensions().get::<IdempotencyContext>().cloned();
//!     assert!(ctx.is_some_and(|c| !c.is_takeover()));
//!     Response::builder().status(StatusCode::CREATED).body(Full::new(Bytes::from("T-1")))
//! });
//! let service = IdempotencyLayer::new(store).layer(tickets);
//! let request = || {
//!     Request::post("/tickets")
//!         .header("idempotency-key", "task-42:call-7")
//!         .body(Full::new(Bytes::from(r#"{"title":"printer on fire"}"#)))
//! };
//!
//! let first = service.clone().oneshot(request()?).await?;
//! assert_eq!(first.status(), StatusCode::CREATED);
//! // The key is held until the body's last byte is handed on (a server
//! // sends it; here it is read): then the response is stored.
//! assert_eq!(first.into_body().collect().await?.to_bytes(), "T-1");
//!
//! // A retry gets the stored response; the handler does not run again.
//! let retry = service.clone().oneshot(request()?).await?;
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.into_body().collect().await?.to_bytes(), "T-1");
//! # Ok(())
//! # }
//! ```
//!
//! # What it answers
//!
//! | situation | answer | handler runs |
//! |---|---|---|
//! | method not in [`methods`](IdempotencyLayer::methods) (default: all but `POST`, `PATCH`) | the handler's response, untouched | yes |
//! | no key, two keys, or a key that is empty, over 255 bytes or not visible ASCII | 400 | no |
//! | body over [`max_request_bytes`](IdempotencyLayer::max_request_bytes), or over the limit of a layer outside (tower-http's `RequestBodyLimitLayer`) | 413 | no |
//! | body that fails before its end (the client's connection reset) | 400 | no |
//! | key held by a live request | 409 with `Retry-After` (seconds until its lease lapses, rounded up) | no |
//! | key used before with a different payload | 422 | no |
//! | the request's [business key](IdempotencyLayer::business_key) is held by another key of the scope | 409 naming that key (`existing_idempotency_key`) and its state | no |
//! | business key empty, over 255 bytes or with a control character | 400 | no |
//! | key finished before, same payload | the stored status, stored headers and body, plus `Idempotent-Replayed: true` | no |
//! | key finished before, its response too large to keep | 410 with `original_status` and `location`, plus `Idempotent-Replayed: true` | no |
//! | store failing for a reason that passes on its own ([`Error::is_transient`](crate::Error::is_transient): the database unreachable, a claim's answer lost) | 503 with `Retry-After` ([`IdempotencyLayer::unavailable_retry_after`]) | no |
//! | store failing for a reason an operator must mend (I/O error, poisoned, misconfigured, closed) | 503, no `Retry-After` | no |
//! | stored record or response damaged, bad configuration | 500 | no |
//! | first attempt, a retry after a retryable failure or a released key, or a takeover after a lapsed lease | the handler's response | yes |
//!
//! Refusals are `application/problem+json` bodies (RFC 9457).
//!
//! # What is stored
//!
//! The key is `(scope, id)`: the scope is `METHOD route` (the route is the
//! URI path unless [`route`](IdempotencyLayer::route) names it), prefixed
//! by `tenant/` when [`tenant`](IdempotencyLayer::tenant) finds one; the id
//! is the header's value. The fingerprint is SHA-256 over the method, the
//! path and query, the [chosen request headers](IdempotencyLayer::fingerprint_headers)
//! (`content-type` by default, compared as a media type: see
//! [`DEFAULT_FINGERPRINT_HEADERS`]) and the body.
//!
//! The handler's response is stored as its status, its headers (all but
//! [`REPLAY_DENY_LIST`], unless [`replay_headers`](IdempotencyLayer::replay_headers)
//! or [`replay_all_headers_except`](IdempotencyLayer::replay_all_headers_except)
//! choose otherwise) and its body. What happens to the key:
//!
//! | handler's answer | the key | a retry |
//! |---|---|---|
//! | 2xx, 3xx | completed, response stored | replayed until retention ends (24 h by default) |
//! | 1xx, unless marked `NoEffect` on a first attempt (interim: hyper sends a 500 in place of any but 101, and a 101 upgrade cannot be replayed) | retryable failure, even if marked `Final` | runs the handler again, as a takeover |
//! | [`release_statuses`](IdempotencyLayer::release_statuses) (default 400, 401, 403, 404, 405, 413, 415, 422, 425, 429), on a first attempt | released: nothing was done | runs the handler as a first attempt |
//! | 408, unmarked (a timeout inside the layer: the handler may have acted) | retryable failure | runs the handler again, as a takeover |
//! | other 4xx | permanent failure, response stored | replayed |
//! | 5xx | retryable failure ([`store_server_errors`](IdempotencyLayer::store_server_errors) stores it) | runs the handler again, as a takeover |
//! | marked [`IdempotencyOutcome::Final`] | stored whatever the status (but a 1xx) | replayed |
//! | marked [`IdempotencyOutcome::NoEffect`], on a first attempt | released | first attempt |
//! | a release status or `NoEffect` on a takeover ([`IdempotencyContext::is_takeover`]), or after this attempt saved a recovery point | retryable failure: an attempt acted, or may have | runs the handler again, as a takeover |
//! | stored form over [`max_response_bytes`](IdempotencyLayer::max_response_bytes) or the store's limit | finished with a marker: the effect happened | `410 Gone` naming the original status and `location` |
//! | body fails halfway, or the client goes away | retryable failure | takeover: the handler looks its effect up |
//! | the client goes away while the claim is in flight, before the handler ran | given back, once decided, before the store's next claim (see [`Store::claim_async`](crate::Store::claim_async)) | as the claim found the key: a first attempt when it was absent |
//!
//! The response is returned as soon as the handler returns it and its body
//! streams to the client while a copy is kept; the lease is extended while
//! the handler runs and while the body streams, and the outcome is recorded
//! before the body's last frame is handed on (see [`IdempotencyBody`]).
//! A request whose response future is dropped while the handler runs (the
//! client went away) is recorded as a retryable failure without waiting for
//! the write.
//!
//! # The gap the handler must close
//!
//! The store cannot make the handler's effect and the stored response one
//! atomic step. A server can die after the ticket was created and before
//! the response was stored; after the [lease](IdempotencyLayer::lease)
//! lapses, a retry runs the handler again. The handler therefore:
//!
//! 1. stores the idempotency key with its effect, under a unique
//!    constraint (its own table, or the downstream's external reference);
//! 2. when [`IdempotencyContext::is_takeover`] is true, looks the effect up
//!    by key and answers from it instead of acting again.
//!
//! `examples/ticket_service.rs` does both.
//!
//! # Runtime
//!
//! The layer awaits the store's futures ([`Store::claim_async`](crate::Store::claim_async)
//! and the other `_async` methods), which are woken by the store's writer
//! thread; the lease is extended every third of its duration by the
//! store's lease extender (one per `Store`, its first thread started by
//! the first keyed request, the one `Store::execute` uses), from the claim until the
//! outcome is recorded. Neither needs a particular async runtime.
//!
//! # Limits
//!
//! - The request body is buffered (up to `max_request_bytes`) to compute
//!   the fingerprint before the handler runs; trailers are dropped.
//! - The response body streams; a copy of up to `max_response_bytes`
//!   (status and headers included) is kept to store it.
//! - The lease is extended until the outcome is recorded, whatever the
//!   handler, the body or the client does: a handler that never answers,
//!   or a client that stops reading a response that never ends, holds its
//!   key for as long as the request lives (its connection, a timeout
//!   layer).
//! - Keys are at most 255 bytes, scopes at most 128 (a longer route is
//!   replaced in the scope by a digest).
//! - A claim that finds nothing to decide from a read alone waits for a
//!   durable write (one fsync, shared by concurrent requests).

mod body;
mod future;
mod layer;
mod service;
mod stored;

pub use body::{BoxError, IdempotencyBody};
pub use future::ResponseFuture;
pub use layer::{
    DEFAULT_FINGERPRINT_HEADERS, DEFAULT_KEY_HEADER, DEFAULT_RELEASE_STATUSES, IdempotencyLayer,
    REPLAY_DENY_LIST, REPLAYED_HEADER,
};
pub use service::{Idempotency, IdempotencyContext, IdempotencyOutcome};
