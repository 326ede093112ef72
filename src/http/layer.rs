//! [`IdempotencyLayer`]: the settings, and the tower `Layer` that applies them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};
use tower::Layer;

use crate::store::Store;

use super::service::Idempotency;

/// Picks a tenant (or any other partition) out of a request.
pub(crate) type TenantFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
/// Names the route of a request.
pub(crate) type RouteFn = dyn Fn(&Parts) -> String + Send + Sync;
/// Picks a business key out of a request and its body.
pub(crate) type BusinessKeyFn = dyn Fn(&Parts, &[u8]) -> Option<String> + Send + Sync;

/// The default request header that carries the idempotency key, as named by
/// the IETF Idempotency-Key header draft (and used by Stripe).
pub const DEFAULT_KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");

/// The header a replayed response carries, set to `true` (the name Stripe
/// uses).
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Response headers that are never stored for a replay by default: they
/// describe one delivery, one connection or one client, not the outcome.
///
/// - hop-by-hop and per-connection headers (RFC 9110 §7.6.1): `connection`,
///   `keep-alive`, `proxy-connection`, `te`, `trailer`, `transfer-encoding`,
///   `upgrade`; `content-length` too, which the replay computes anew (the
///   fields a response's `connection` header names are never stored
///   either, whatever the layer's header choice);
/// - cookies and credentials, which belong to the client that got them:
///   `set-cookie`, `www-authenticate`, `proxy-authenticate`,
///   `authentication-info`, `proxy-authentication-info`, and
///   `authorization`, `proxy-authorization` (request headers that a
///   service may echo, never to be handed to whoever retries);
/// - `date`, the time of one delivery (a replay gets its own);
/// - [`REPLAYED_HEADER`], which the replay sets itself.
///
/// Every other header (`location`, `etag`, `last-modified`, `cache-control`,
/// `link`, `content-type`, `content-encoding`, application headers) is
/// stored and replayed, so that a retry gets the response the first client
/// saw, as the IETF Idempotency-Key draft asks ("the same response").
pub const REPLAY_DENY_LIST: [HeaderName; 17] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::CONTENT_LENGTH,
    header::SET_COOKIE,
    header::WWW_AUTHENTICATE,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("authentication-info"),
    HeaderName::from_static("proxy-authentication-info"),
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::DATE,
    REPLAYED_HEADER,
];

/// The statuses that release the key by default instead of storing the
/// response: refusals given before the handler acted (by routing, an
/// extractor such as axum's `Json`, authentication or validation), so a
/// corrected retry must be able to run the handler. Stripe saves a result
/// only once the endpoint started executing: "if incoming parameters
/// failed validation … no idempotent result is saved"; the IETF
/// Idempotency-Key draft leaves to the server which responses it keeps.
///
/// - 400 Bad Request, 422 Unprocessable Content: the request failed
///   parsing or validation (axum's `Json` rejections).
/// - 401 Unauthorized, 403 Forbidden: refused before any work; a retry with
///   credentials must not get the refusal replayed.
/// - 404 Not Found, 405 Method Not Allowed: no handler took the request.
/// - 413 Content Too Large, 415 Unsupported Media Type: the body was
///   refused unread (a missing `content-type` is axum's 415).
/// - 425 Too Early (RFC 8470): not processed, retry later.
/// - 429 Too Many Requests: rate limited before any work.
///
/// 408 Request Timeout is not among them: the layer reads the whole
/// request body before the handler runs, so a 408 from inside the layer
/// is a timeout of the handler (tower-http's `TimeoutLayer` answers 408),
/// which may have acted; unless marked, it is a retryable failure, and the
/// retry runs as a takeover. Every other 4xx (409 Conflict, 402 Payment
/// Required for a declined charge, 410, …) is a judgement of the request
/// and is stored. A handler
/// that acted and still answers a listed status marks its response
/// [`IdempotencyOutcome::Final`](super::IdempotencyOutcome::Final), which
/// stores it.
pub const DEFAULT_RELEASE_STATUSES: [StatusCode; 10] = [
    StatusCode::BAD_REQUEST,
    StatusCode::UNAUTHORIZED,
    StatusCode::FORBIDDEN,
    StatusCode::NOT_FOUND,
    StatusCode::METHOD_NOT_ALLOWED,
    StatusCode::PAYLOAD_TOO_LARGE,
    StatusCode::UNSUPPORTED_MEDIA_TYPE,
    StatusCode::UNPROCESSABLE_ENTITY,
    StatusCode::TOO_EARLY,
    StatusCode::TOO_MANY_REQUESTS,
];

/// The request headers the fingerprint covers by default: `content-type`,
/// so that the same bytes sent with another media type are another
/// payload, never answered with the response stored for the first (a 422
/// instead). `content-type` is compared as a media type (RFC 9110 §8.3.1):
/// type, subtype and parameter names in any case, `charset` in any case,
/// no `charset` for JSON types (RFC 8259 §11), a space after `;` ignored;
/// `APPLICATION/JSON` and `application/json; charset=utf-8` are the same
/// payload as `application/json`. (A value that does not parse as a media
/// type, such as one with a space before `;`, is compared as its bytes.
/// The common spelling `application/json` has the fingerprint it had
/// before this rule; a request first sent with another spelling by an
/// older build and retried after an upgrade is answered 422.) (What makes a request refused for its
/// media type, then sent again with the right one, a first attempt is that
/// 415 is among the [`DEFAULT_RELEASE_STATUSES`].)
pub const DEFAULT_FINGERPRINT_HEADERS: [HeaderName; 1] = [header::CONTENT_TYPE];

/// Which response headers are stored for a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ReplayHeaders {
    /// Every header but these.
    AllExcept(Vec<HeaderName>),
    /// These headers only, in this order.
    Only(Vec<HeaderName>),
}

impl ReplayHeaders {
    /// Whether a header of this name is stored.
    pub(crate) fn keeps(&self, name: &HeaderName) -> bool {
        match self {
            ReplayHeaders::AllExcept(deny) => !deny.contains(name),
            ReplayHeaders::Only(allow) => allow.contains(name),
        }
    }
}

/// Everything an [`Idempotency`] service needs, shared by all its clones.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) store: Arc<Store>,
    pub(crate) key_header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) tenant: Option<Arc<TenantFn>>,
    pub(crate) route: Option<Arc<RouteFn>>,
    pub(crate) business_key: Option<Arc<BusinessKeyFn>>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) replay_headers: ReplayHeaders,
    pub(crate) release_statuses: Vec<StatusCode>,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) lease: Duration,
    pub(crate) store_server_errors: bool,
    pub(crate) unavailable_retry_after: Duration,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("store", &self.store.path())
            .field("key_header", &self.key_header)
            .field("methods", &self.methods)
            .field("tenant", &self.tenant.is_some())
            .field("route", &self.route.is_some())
            .field("business_key", &self.business_key.is_some())
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("replay_headers", &self.replay_headers)
            .field("release_statuses", &self.release_statuses)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("lease", &self.lease)
            .field("store_server_errors", &self.store_server_errors)
            .field("unavailable_retry_after", &self.unavailable_retry_after)
            .finish()
    }
}

/// A tower [`Layer`] that makes the requests of an HTTP service idempotent,
/// backed by a [`Store`]. It wraps a service in [`Idempotency`].
///
/// See the [module docs](crate::http) for what it answers and when.
///
/// # Defaults
/// - key header: `Idempotency-Key` ([`DEFAULT_KEY_HEADER`])
/// - methods that require a key: `POST` and `PATCH` (the methods that are
///   not idempotent by definition, RFC 9110 §9.2.2); every other method
///   passes through untouched
/// - scope: `METHOD path` (the request's URI path); no tenant
/// - no business key
/// - fingerprint: method, path and query, body, and the headers of
///   [`DEFAULT_FINGERPRINT_HEADERS`] (`content-type`)
/// - replayed headers: every response header but [`REPLAY_DENY_LIST`]
/// - statuses that release the key: [`DEFAULT_RELEASE_STATUSES`] (400, 401,
///   403, 404, 405, 413, 415, 422, 425, 429)
/// - `max_request_bytes`: 1 MiB (in bytes)
/// - `max_response_bytes`: 1 MiB (in bytes, status and headers included)
/// - `lease`: 30 seconds, extended every third of it while the handler runs
///   and while the response body is sent, until the outcome is recorded
/// - a 5xx response is recorded as a retryable failure, not stored
/// - `unavailable_retry_after`: 1 second
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    settings: Settings,
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults above.
    pub fn new(store: Arc<Store>) -> IdempotencyLayer {
        IdempotencyLayer {
            settings: Settings {
                store,
                key_header: DEFAULT_KEY_HEADER,
                methods: vec![Method::POST, Method::PATCH],
                tenant: None,
                route: None,
                business_key: None,
                fingerprint_headers: DEFAULT_FINGERPRINT_HEADERS.to_vec(),
                replay_headers: ReplayHeaders::AllExcept(REPLAY_DENY_LIST.to_vec()),
                release_statuses: DEFAULT_RELEASE_STATUSES.to_vec(),
                max_request_bytes: 1024 * 1024,
                max_response_bytes: 1024 * 1024,
                lease: Duration::from_secs(30),
                store_server_errors: false,
                unavailable_retry_after: Duration::from_secs(1),
            },
        }
    }

    /// The request header that carries the idempotency key (default
    /// `Idempotency-Key`). Its value is the key's id: 1 to 255 bytes of
    /// visible ASCII (`!` to `~`: no space, no tab), either bare (as Stripe
    /// sends it) or as a quoted structured-field string (as the IETF draft
    /// writes it, `"abc"`, whose content obeys the same rule). Anything else
    /// is answered 400 and runs nothing.
    pub fn key_header(mut self, name: HeaderName) -> IdempotencyLayer {
        self.settings.key_header = name;
        self
    }

    /// The methods whose requests require a key (default `POST` and
    /// `PATCH`). A request with one of them and no key is answered 400;
    /// requests with any other method pass through untouched, with or
    /// without a key.
    ///
    /// `HEAD` is ignored (with a `tracing` warning): a server sends no body
    /// for it (RFC 9110 §9.3.2), so its response is never read to its end
    /// and never recorded, and every retry would run the handler again;
    /// HEAD is safe by definition anyway. (With axum, a `get` route answers
    /// HEAD too: with `GET` listed, a HEAD request to it passes through
    /// untouched.)
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> IdempotencyLayer {
        self.settings.methods = methods
            .into_iter()
            .filter(|method| {
                let head = method == Method::HEAD;
                if head {
                    tracing::warn!("HEAD ignored in methods: its response has no body to record");
                }
                !head
            })
            .collect();
        self
    }

    /// Takes a tenant out of each request (for example from an
    /// authenticated principal that an earlier layer put in the
    /// extensions). Keys of different tenants never meet: the tenant
    /// prefixes the scope, `tenant/METHOD route`. `None` means no tenant.
    ///
    /// A tenant with a control character, or one that makes the scope
    /// longer than [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN) even with the
    /// route shortened to a digest, is a server error (500).
    pub fn tenant(
        mut self,
        tenant: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.settings.tenant = Some(Arc::new(tenant));
        self
    }

    /// Names the route of each request, for the scope (default: the URI
    /// path). With axum, the route template is a better name, so that the
    /// same key sent to `/tickets/1/comments` and `/tickets/2/comments` is
    /// one key whose payloads differ (422) rather than two keys:
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idemstore::http::IdempotencyLayer;
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let store = Arc::new(idemstore::Store::open(dir.path().join("i.redb")).unwrap());
    /// let layer = IdempotencyLayer::new(store).route(|parts| {
    ///     match parts.extensions.get::<axum::extract::MatchedPath>() {
    ///         Some(path) => path.as_str().to_owned(),
    ///         None => parts.uri.path().to_owned(),
    ///     }
    /// });
    /// ```
    ///
    /// A route that would make the scope longer than
    /// [`MAX_SCOPE_LEN`](crate::MAX_SCOPE_LEN) (128 bytes), or that holds a
    /// control character (a raw path's U+0085, say, which a scope may not),
    /// is replaced in the scope by `#` and the first 32 hex digits of its
    /// SHA-256 digest.
    ///
    /// Under axum's `Router::nest`, a layer applied to the nested router
    /// sees the URI path without the nest's prefix, so the default route
    /// (and the fingerprint's path) of `/v1/tickets` and `/v2/tickets` are
    /// both `/tickets`: a key sent to one is replayed from the other. Apply
    /// the layer to the outer router, or name the route with `MatchedPath`
    /// as above (axum keeps the prefix in it).
    pub fn route(
        mut self,
        route: impl Fn(&Parts) -> String + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.settings.route = Some(Arc::new(route));
        self
    }

    /// Takes a business key out of each request and its body (an order
    /// number, the alert a ticket is opened for): the same business
    /// operation requested under a *new* idempotency key, while a record of
    /// another key in the same scope holds it, is answered 409 naming that
    /// key and its state, and the handler does not run
    /// ([`ClaimOptions::business_key`](crate::ClaimOptions::business_key)).
    /// `None` means no business key. A business key that is empty, over 255
    /// bytes or holds a control character is answered 400.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use idemstore::http::IdempotencyLayer;
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let store = Arc::new(idemstore::Store::open(dir.path().join("i.redb")).unwrap());
    /// let layer = IdempotencyLayer::new(store).business_key(|_parts, body| {
    ///     let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    ///     v.get("order_id")?.as_str().map(str::to_owned)
    /// });
    /// ```
    pub fn business_key(
        mut self,
        business_key: impl Fn(&Parts, &[u8]) -> Option<String> + Send + Sync + 'static,
    ) -> IdempotencyLayer {
        self.settings.business_key = Some(Arc::new(business_key));
        self
    }

    /// Request headers that the fingerprint covers besides the method, the
    /// path and query, and the body (default [`DEFAULT_FINGERPRINT_HEADERS`]:
    /// `content-type`). Replaces the default: keep `content-type` in the
    /// list unless the service reads one media type only. A retry that
    /// changes one of them is a different payload (422).
    pub fn fingerprint_headers(
        mut self,
        names: impl IntoIterator<Item = HeaderName>,
    ) -> IdempotencyLayer {
        self.settings.fingerprint_headers = names.into_iter().collect();
        self
    }

    /// Stores and replays only these response headers, in this order (every
    /// value of each): the narrowest choice. The default is every header
    /// but [`REPLAY_DENY_LIST`]; see [`replay_all_headers_except`](Self::replay_all_headers_except)
    /// to widen or extend that. Naming a header of the deny-list here
    /// stores it: a `set-cookie` named here is replayed to every retry,
    /// whoever sends it.
    pub fn replay_headers(
        mut self,
        names: impl IntoIterator<Item = HeaderName>,
    ) -> IdempotencyLayer {
        self.settings.replay_headers = ReplayHeaders::Only(names.into_iter().collect());
        self
    }

    /// Stores and replays every response header except `deny` (default
    /// [`REPLAY_DENY_LIST`]). To keep one more header out, pass the default
    /// list and that header:
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use http::HeaderName;
    /// # use idemstore::http::{IdempotencyLayer, REPLAY_DENY_LIST};
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let store = Arc::new(idemstore::Store::open(dir.path().join("i.redb")).unwrap());
    /// let layer = IdempotencyLayer::new(store).replay_all_headers_except(
    ///     REPLAY_DENY_LIST.into_iter().chain([HeaderName::from_static("x-request-id")]),
    /// );
    /// ```
    pub fn replay_all_headers_except(
        mut self,
        deny: impl IntoIterator<Item = HeaderName>,
    ) -> IdempotencyLayer {
        self.settings.replay_headers = ReplayHeaders::AllExcept(deny.into_iter().collect());
        self
    }

    /// The response statuses that release the key instead of storing the
    /// response, as [`IdempotencyOutcome::NoEffect`](super::IdempotencyOutcome::NoEffect)
    /// does: a retry then runs the handler as a first attempt. Replaces the
    /// default [`DEFAULT_RELEASE_STATUSES`]; pass those
    /// and more to add a status (for example a 503 the service gives
    /// before doing any work). Use it only for statuses that mean "nothing
    /// was done": a released key protects nothing. A handler's
    /// `IdempotencyOutcome::Final` overrules it for one response.
    ///
    /// Only 4xx and 5xx statuses are taken; a status below 400 in
    /// `statuses` is ignored (with a `tracing` warning), since a success
    /// released would run the handler again on every retry. A takeover
    /// (an earlier attempt may have acted), or an attempt that saved a
    /// recovery point, is never released: its answer is recorded as a
    /// retryable failure, so that the next retry is a takeover and can look
    /// the earlier effect up.
    pub fn release_statuses(
        mut self,
        statuses: impl IntoIterator<Item = StatusCode>,
    ) -> IdempotencyLayer {
        self.settings.release_statuses = statuses
            .into_iter()
            .filter(|status| {
                let refusal = status.is_client_error() || status.is_server_error();
                if !refusal {
                    tracing::warn!(%status, "ignored in release_statuses: only 4xx and 5xx release a key");
                }
                refusal
            })
            .collect();
        self
    }

    /// The largest request body read for the fingerprint (in bytes, default
    /// 1 MiB). A larger body is answered 413 and the handler does not run;
    /// a `Content-Length` over the limit is refused before reading.
    pub fn max_request_bytes(mut self, bytes: usize) -> IdempotencyLayer {
        self.settings.max_request_bytes = bytes;
        self
    }

    /// The largest stored response (in bytes, default 1 MiB): the status,
    /// the stored headers (names and values) and the body together. A
    /// longer response still streams to the client whole, and its key is
    /// still finished, so a retry never runs the handler again: the store
    /// keeps a marker instead of the response, and a retry is answered
    /// `410 Gone` (see the [module docs](crate::http)). So is a response
    /// whose stored form is over the store's `max_result_bytes` or
    /// `max_failure_bytes`.
    pub fn max_response_bytes(mut self, bytes: usize) -> IdempotencyLayer {
        self.settings.max_response_bytes = bytes;
        self
    }

    /// The lease of each claim (whole milliseconds,
    /// [`MIN_RENEWED_LEASE`](crate::MIN_RENEWED_LEASE), 100 ms, to
    /// [`MAX_LEASE`](crate::MAX_LEASE); default 30 s): how long a request
    /// whose server died holds its key before a retry may take it over.
    /// While the handler runs, and then while its response body is sent,
    /// the store's lease extender (one per `Store`, as for
    /// `Store::execute`) extends the lease every third of this duration,
    /// so a slow handler, a long stream, a handler or a body that blocks
    /// its thread, and a client that stops reading keep the key until its
    /// outcome is recorded (a request that never ends holds it until its
    /// future is dropped: put a timeout outside this layer). A wall clock stepping forward by more
    /// than what is left of the lease ends it at once (the store's time follows it ahead), and a retry
    /// then runs the handler a second time: choose a lease longer than the
    /// steps the hosts' clocks may take. An out-of-range lease makes every
    /// keyed request fail with 500.
    pub fn lease(mut self, lease: Duration) -> IdempotencyLayer {
        self.settings.lease = lease;
        self
    }

    /// Whether a 5xx response is stored and replayed like any other
    /// (`true`), or recorded as a retryable failure so that a retry runs
    /// the handler again (`false`, the default). A handler can decide for
    /// one response with [`IdempotencyOutcome`](super::IdempotencyOutcome).
    pub fn store_server_errors(mut self, store: bool) -> IdempotencyLayer {
        self.settings.store_server_errors = store;
        self
    }

    /// The `Retry-After` of the 503 answered when the store fails for a
    /// reason that passes on its own ([`Error::is_transient`](crate::Error::is_transient):
    /// the PostgreSQL server unreachable, or a claim's answer lost), in
    /// whole seconds, rounded up, at least 1 (default 1 s, a hint: the
    /// layer cannot know when the server is back). RFC 9110 §10.2.3 lets a
    /// 503 say how long the client should wait. The retry must carry the
    /// same key: a claim whose answer was lost holds the key until its
    /// lease lapses (409 with the lease's own `Retry-After` meanwhile).
    /// A 503 for a fault that needs an operator (a misconfigured or
    /// damaged store, one refusing writes after a failed fsync, a closed
    /// store) has no `Retry-After`.
    pub fn unavailable_retry_after(mut self, wait: Duration) -> IdempotencyLayer {
        self.settings.unavailable_retry_after = wait;
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency::new(inner, Arc::new(self.settings.clone()))
    }
}
