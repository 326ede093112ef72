//! [`Idempotency`]: the service that claims a key before the handler runs,
//! and what it tells the handler ([`IdempotencyContext`]) and hears back
//! from it ([`IdempotencyOutcome`]).

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use sha2::{Digest, Sha256};
use tower::Service;

use crate::config::ClaimOptions;
use crate::error::Error;
use crate::key::{Key, MAX_SCOPE_LEN};
use crate::record::{ClaimOutcome, Lease, Record};
use crate::store::Store;

use super::body::{BoxError, Collected, IdempotencyBody, collect_limited};
use super::future::{Heartbeat, Held, ResponseFuture};
use super::layer::{REPLAYED_HEADER, Settings};
use super::stored::{Stored, fingerprint};

/// What the layer puts in the extensions of a request it lets through to
/// the handler: the lease it holds on the request's key.
///
/// The store cannot make the handler's side effect and the stored outcome
/// one atomic step: a server can die after the ticket was created and
/// before the response was stored. After the lease lapses, a retry runs the
/// handler again. When [`is_takeover`](Self::is_takeover) is true, an
/// earlier attempt may have acted, so the handler must look its effect up
/// by [`key`](Self::key) (a unique column in its own table, a merchant
/// reference at a payment gateway) before acting again: "query instead of
/// replay".
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    lease: Lease,
    store: Arc<Store>,
}

impl IdempotencyContext {
    /// The idempotency key: scope (`[tenant/]METHOD route`) and the id the
    /// client sent. Store [`Key::reference`] (`key().reference()`) with the
    /// effect, uniquely: its printed form (`key().to_string()`) can be
    /// another route's key too (`POST /tickets` with `triage/k1`, and
    /// `POST /tickets/triage` with `k1`).
    pub fn key(&self) -> &Key {
        self.lease.key()
    }

    /// The lease the layer holds while the handler runs. Its fencing token
    /// can be passed to downstream systems that accept one.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Whether an earlier attempt may have acted: the key was acquired
    /// before (a lease that lapsed, a server that died, a 5xx recorded as a
    /// retryable failure, a client that went away) or carries a recovery
    /// point. See [`Lease::is_takeover`].
    pub fn is_takeover(&self) -> bool {
        self.lease.is_takeover()
    }

    /// How many times the key was acquired, this time included (1 for a
    /// first attempt).
    pub fn acquisitions(&self) -> u32 {
        self.lease.record().map_or(1, Record::acquisitions)
    }

    /// The recovery point an earlier attempt saved, if any.
    pub fn recovery_point(&self) -> Option<&[u8]> {
        self.lease.recovery_point()
    }

    /// The store, for [`Store::set_recovery_point_async`] under
    /// [`lease`](Self::lease) in multi-step work.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
}

/// What a handler tells the layer about one response, by putting it in the
/// response's extensions. Only the handler knows whether its effect
/// happened, so only it can overrule the layer's default (2xx, 3xx and 4xx
/// stored, but the [release statuses](super::IdempotencyLayer::release_statuses),
/// [`DEFAULT_RELEASE_STATUSES`](super::DEFAULT_RELEASE_STATUSES) by default,
/// which release the key; 5xx recorded as a
/// retryable failure). A 1xx (an interim status: hyper sends a 500 in
/// place of any but 101, and a 101 upgrade cannot be replayed) is a
/// retryable failure even when marked `Final`.
///
/// With axum: `(Extension(IdempotencyOutcome::NoEffect), StatusCode::SERVICE_UNAVAILABLE)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IdempotencyOutcome {
    /// Store this response and replay it to every retry until retention
    /// ends, whatever its status (a 5xx too: "the charge was declined for
    /// good"), but a 1xx, which cannot be replayed.
    Final,
    /// Nothing happened: release the key, so that a retry runs the handler
    /// as a first attempt, with any payload. Use it for a refusal before
    /// any effect (rate limited, a dependency down before the write). On a
    /// takeover ([`IdempotencyContext::is_takeover`]) it means only that
    /// this attempt did nothing: an earlier one may have acted, so the key
    /// is kept as a retryable failure (acquisitions, recovery point and
    /// payload with it) and the next retry is a takeover too. So it is
    /// after this attempt saved a recovery point.
    NoEffect,
}

/// The service made by [`IdempotencyLayer`](super::IdempotencyLayer).
///
/// For a request whose method requires a key it reads the key and the body
/// (up to the limit), claims the key in the store, and then either runs the
/// inner service under the lease or answers at once without running it (a
/// replay, or one of the refusals in the [module docs](crate::http)).
/// Other requests pass through untouched.
///
/// The inner service receives the body as an [`IdempotencyBody`] (buffered
/// for keyed requests, streamed for the others) and a keyed request carries
/// an [`IdempotencyContext`] in its extensions. Request and response bodies
/// must be `Unpin`, as axum's and hyper's are.
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>) -> Idempotency<S> {
        Idempotency { inner, settings }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    ReqBody: Body + Send + Unpin + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + Send + Unpin + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let settings = &self.settings;
        if !settings.methods.contains(req.method()) {
            return ResponseFuture::passthrough(self.inner.call(req.map(IdempotencyBody::stream)));
        }
        let (parts, body) = req.into_parts();
        let id = match key_id(&parts.headers, &settings.key_header) {
            Ok(Some(id)) => id,
            Ok(None) => {
                return ResponseFuture::reply(problem(
                    StatusCode::BAD_REQUEST,
                    "Idempotency key missing",
                    &format!(
                        "{} {} requires an `{}` header",
                        parts.method,
                        parts.uri.path(),
                        settings.key_header
                    ),
                ));
            }
            Err(reason) => {
                return ResponseFuture::reply(problem(
                    StatusCode::BAD_REQUEST,
                    "Invalid idempotency key",
                    &reason,
                ));
            }
        };
        if content_length(&parts.headers).is_some_and(|n| n > settings.max_request_bytes as u64) {
            return ResponseFuture::reply(too_large(settings.max_request_bytes));
        }
        let key = match request_key(settings, &parts, id) {
            Ok(key) => key,
            Err(response) => return ResponseFuture::reply(response),
        };
        // The service that was polled ready goes with this request; the
        // clone stays for the next one (tower's usual hand-off).
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::prepare(Box::pin(prepare(
            settings.clone(),
            key,
            parts,
            body,
            service,
        )))
    }
}

/// Reads the body, claims the key, and either calls the service under the
/// lease (renewed from before the call: the returned heartbeat) or answers
/// without calling it.
async fn prepare<S, ReqBody, ResBody>(
    settings: Arc<Settings>,
    key: Key,
    mut parts: Parts,
    body: ReqBody,
    mut service: S,
) -> Result<(S::Future, Held, Heartbeat), Response<IdempotencyBody<ResBody>>>
where
    S: Service<Request<IdempotencyBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body + Unpin,
    ReqBody::Error: Into<BoxError>,
{
    let bytes = match collect_limited(body, settings.max_request_bytes).await {
        Collected::Complete(bytes) => bytes,
        Collected::Over => return Err(too_large(settings.max_request_bytes)),
        // A limit of a layer outside this one (tower-http's
        // `RequestBodyLimitLayer` on a body without `content-length`) is
        // the same refusal as this layer's own.
        Collected::Failed { error } if over_a_length_limit(&*error) => {
            return Err(problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Request body too large",
                &error.to_string(),
            ));
        }
        Collected::Failed { error } => {
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "Request body could not be read",
                &error.to_string(),
            ));
        }
    };
    let fp = fingerprint(
        &parts.method,
        &parts.uri,
        &parts.headers,
        &settings.fingerprint_headers,
        &bytes,
    );
    if let Err(error) = crate::config::check_renewed_lease(settings.lease) {
        return Err(claim_error(&key, &error, settings.unavailable_retry_after));
    }
    let mut options = ClaimOptions::new().lease(settings.lease);
    if let Some(business_key) = settings
        .business_key
        .as_ref()
        .and_then(|f| f(&parts, &bytes))
    {
        options = options.business_key(business_key);
    }
    match settings.store.claim_async(&key, &fp, &options).await {
        Ok(ClaimOutcome::Acquired(lease)) => {
            let held = Held::new(settings.clone(), lease.clone());
            // Before the call: work a service does in `call` itself, not
            // in its future, runs under the renewed lease too.
            let heartbeat = Heartbeat::running(&held);
            parts.extensions.insert(IdempotencyContext {
                lease,
                store: settings.store.clone(),
            });
            let request = Request::from_parts(parts, IdempotencyBody::full(bytes));
            Ok((service.call(request), held, heartbeat))
        }
        Ok(ClaimOutcome::InProgress { retry_after, .. }) => Err(in_progress(&key, retry_after)),
        Ok(ClaimOutcome::Replay(record)) => Err(replay(&record)),
        Err(error) => Err(claim_error(&key, &error, settings.unavailable_retry_after)),
    }
}

/// The key's id from the request: `Ok(None)` when the header is absent.
fn key_id(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, String> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!("more than one `{name}` header"));
    }
    let text = value
        .to_str()
        .map_err(|_| format!("`{name}` is not visible ASCII"))?
        .trim();
    let visible = |id: &str| {
        if id.bytes().all(|b| b.is_ascii_graphic()) {
            Ok(())
        } else {
            Err(format!(
                "`{name}` holds a space or a tab: a key is visible ASCII (`!` to `~`)"
            ))
        }
    };
    // The IETF draft writes the key as a structured-field string ("...").
    let Some(quoted) = text
        .strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .filter(|_| text.len() >= 2)
    else {
        visible(text)?;
        return Ok(Some(text.to_owned()));
    };
    let mut out = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('\\' | '"')) => out.push(e),
                _ => return Err(format!("`{name}` has a bad escape in its quoted string")),
            },
            '"' => return Err(format!("`{name}` has an unescaped quote")),
            c => out.push(c),
        }
    }
    visible(&out)?;
    Ok(Some(out))
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The key of a request: scope `[tenant/]METHOD route`, and the client's id.
#[allow(clippy::result_large_err)]
fn request_key<B>(
    settings: &Settings,
    parts: &Parts,
    id: String,
) -> Result<Key, Response<IdempotencyBody<B>>> {
    let route = match &settings.route {
        Some(route) => route(parts),
        None => parts.uri.path().to_owned(),
    };
    let tenant = settings.tenant.as_ref().and_then(|tenant| tenant(parts));
    let scope = scope_of(tenant.as_deref(), parts.method.as_str(), &route);
    match Key::new(scope.clone(), id) {
        Ok(key) => Ok(key),
        // With a valid scope, only the client's id can be at fault.
        Err(e) if Key::new(scope, "-").is_ok() => Err(problem(
            StatusCode::BAD_REQUEST,
            "Invalid idempotency key",
            &e.to_string(),
        )),
        Err(e) => {
            tracing::error!(error = %e, "the configured tenant or route gives an invalid scope");
            Err(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Invalid idempotency scope",
                "the server's tenant or route gives an invalid scope",
            ))
        }
    }
}

/// `[tenant/]METHOD route`, with the route replaced by `#` and 32 hex digits
/// of its SHA-256 when the whole would be over [`MAX_SCOPE_LEN`], or when
/// the route holds a control character (a scope may not; the `http` crate
/// takes a raw path's UTF-8, so a client can send U+0085 in one).
fn scope_of(tenant: Option<&str>, method: &str, route: &str) -> String {
    let prefix = tenant.map(|t| format!("{t}/")).unwrap_or_default();
    let scope = format!("{prefix}{method} {route}");
    if scope.len() <= MAX_SCOPE_LEN && !route.chars().any(char::is_control) {
        return scope;
    }
    let digest = Sha256::digest(route.as_bytes());
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("{prefix}{method} #{hex}")
}

/// An `application/problem+json` response (RFC 9457).
pub(crate) fn problem<B>(
    status: StatusCode,
    title: &str,
    detail: &str,
) -> Response<IdempotencyBody<B>> {
    problem_with(status, title, detail, serde_json::Map::new())
}

fn problem_with<B>(
    status: StatusCode,
    title: &str,
    detail: &str,
    mut extra: serde_json::Map<String, serde_json::Value>,
) -> Response<IdempotencyBody<B>> {
    extra.insert("title".into(), title.into());
    extra.insert("status".into(), status.as_u16().into());
    extra.insert("detail".into(), detail.into());
    let body = serde_json::Value::Object(extra).to_string();
    let mut response = Response::new(IdempotencyBody::full(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// Whether a request body's error, or one of its causes, is
/// `http-body-util`'s `LengthLimitError` (what a `Limited` body, such as
/// tower-http's `RequestBodyLimitLayer` wraps the body in, fails with once
/// more bytes arrive than its limit).
fn over_a_length_limit(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

fn too_large<B>(limit: usize) -> Response<IdempotencyBody<B>> {
    problem(
        StatusCode::PAYLOAD_TOO_LARGE,
        "Request body too large",
        &format!("an idempotent request body may be at most {limit} bytes"),
    )
}

/// `wait` in whole seconds, rounded up, at least 1: a `Retry-After` value.
fn retry_after_seconds(wait: Duration) -> u64 {
    u64::try_from(wait.as_millis().div_ceil(1000).max(1)).unwrap_or(u64::MAX)
}

/// `response` with `Retry-After: seconds`.
fn with_retry_after<B>(
    mut response: Response<IdempotencyBody<B>>,
    seconds: u64,
) -> Response<IdempotencyBody<B>> {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    response
}

/// 409 with `Retry-After` in whole seconds, rounded up (at least 1).
fn in_progress<B>(key: &Key, retry_after: Duration) -> Response<IdempotencyBody<B>> {
    let seconds = retry_after_seconds(retry_after);
    let response = problem(
        StatusCode::CONFLICT,
        "Request in progress",
        &format!(
            "a request with idempotency key {:?} is still being processed; retry after {seconds} s",
            key.id()
        ),
    );
    with_retry_after(response, seconds)
}

/// The stored response with `Idempotent-Replayed: true`; for a response
/// that was too large to keep, `410 Gone` saying so.
fn replay<B>(record: &Record) -> Response<IdempotencyBody<B>> {
    let stored = record
        .result()
        .or_else(|| record.failure())
        .ok_or_else(|| "the record has no stored outcome".to_owned())
        .and_then(Stored::decode);
    let mut response = match stored {
        Ok(Stored::Kept(stored)) => {
            let mut response = Response::new(IdempotencyBody::full(stored.body));
            *response.status_mut() = stored.status;
            let headers = response.headers_mut();
            for (name, value) in stored.headers {
                headers.append(name, value);
            }
            response
        }
        Ok(Stored::NotKept { status, location }) => not_kept(record.key(), status, location),
        Err(detail) => {
            // Not a response this layer recorded: an operator's `resolve`
            // (which refuses this unless told `--not-http-layer`), or damage.
            // Scope and id are the client's bytes: logged as fields, each
            // quoted for a POSIX shell (`$(…)` in an id stays a word when
            // pasted), never spliced into a command line.
            let word =
                |w: &str| shlex::try_quote(w).map_or_else(|_| format!("{w:?}"), |q| q.into_owned());
            tracing::error!(
                scope = %word(record.key().scope()),
                id = %word(record.key().id()),
                token = record.token(),
                %detail,
                "stored response cannot be replayed: every retry of the key is answered 500 \
                 until retention ends, unless an operator records a retryable failure over it \
                 (`idemstore resolve STORE --token TOKEN --amend --failed JSON --retryable -- \
                 SCOPE ID`), so that the next request runs the handler, which finds its effect \
                 by the key's reference"
            );
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Stored response unreadable",
                "the outcome stored for this idempotency key cannot be read",
            );
        }
    };
    response
        .headers_mut()
        .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}

/// 410 Gone for a key whose request ran and whose response was too large to
/// keep: the effect happened, the handler will not run again, and the
/// client looks the result up another way (the `location` the first
/// response gave, when it gave one) or sends a new request with a new key.
fn not_kept<B>(
    key: &Key,
    status: StatusCode,
    location: Option<HeaderValue>,
) -> Response<IdempotencyBody<B>> {
    let mut extra = serde_json::Map::new();
    extra.insert("original_status".into(), status.as_u16().into());
    if let Some(location) = location.as_ref().and_then(|l| l.to_str().ok()) {
        extra.insert("location".into(), location.into());
    }
    problem_with(
        StatusCode::GONE,
        "Response not kept",
        &format!(
            "the request with idempotency key {:?} was answered with status {} and will not run again, \
             but that response was too large to keep; look the result up (see `location` when given) \
             or send a new request with a new idempotency key",
            key.id(),
            status.as_u16()
        ),
        extra,
    )
}

/// The answer to a claim that failed: 400, 409 or 422 for the request's
/// own faults, 500 for what no retry mends, 503 for the store's faults,
/// with `Retry-After` (`unavailable_retry_after`, in whole seconds rounded
/// up, at least 1) when the fault passes on its own ([`Error::is_transient`]).
fn claim_error<B>(
    key: &Key,
    error: &Error,
    unavailable_retry_after: Duration,
) -> Response<IdempotencyBody<B>> {
    match error {
        Error::FingerprintMismatch { .. } => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Idempotency key reused",
            &format!(
                "idempotency key {:?} was already used with a different request payload",
                key.id()
            ),
        ),
        Error::BusinessKeyConflict {
            business_key,
            existing,
            state,
        } => {
            let mut extra = serde_json::Map::new();
            extra.insert("business_key".into(), business_key.as_str().into());
            extra.insert("existing_idempotency_key".into(), existing.id().into());
            extra.insert("existing_state".into(), state.name().into());
            problem_with(
                StatusCode::CONFLICT,
                "Business key in use",
                &format!(
                    "business key {business_key:?} is already held by idempotency key {:?} ({})",
                    existing.id(),
                    state.name()
                ),
                extra,
            )
        }
        Error::InvalidKey { reason } => {
            problem(StatusCode::BAD_REQUEST, "Invalid idempotency key", reason)
        }
        Error::InvalidArgument {
            what: "business_key",
            reason,
        } => problem(StatusCode::BAD_REQUEST, "Invalid business key", reason),
        Error::InvalidArgument { .. } | Error::CorruptRecord { .. } => {
            tracing::error!(%key, %error, "claim failed");
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Idempotency store error",
                "the request was not processed",
            )
        }
        Error::Misconfigured { .. } | Error::ReadOnly { .. } => {
            // Not passing: an operator must change the configuration.
            tracing::error!(%key, %error, "idempotency store misconfigured");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
                "the request was not processed",
            )
        }
        _ if error.is_transient() => {
            tracing::warn!(%key, %error, "idempotency store unavailable");
            let seconds = retry_after_seconds(unavailable_retry_after);
            let response = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
                &format!(
                    "the request was not processed; retry with the same idempotency key after {seconds} s"
                ),
            );
            with_retry_after(response, seconds)
        }
        _ => {
            // Not passing on its own: the store must be reopened, repaired
            // or restored, so no `Retry-After`.
            tracing::error!(%key, %error, "idempotency store failed");
            problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Idempotency store unavailable",
                "the request was not processed",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_header_forms() {
        let name = HeaderName::from_static("idempotency-key");
        let one = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(&name, HeaderValue::from_static(v));
            key_id(&h, &name)
        };
        assert_eq!(one("abc").unwrap().as_deref(), Some("abc"));
        assert_eq!(one("\"abc\"").unwrap().as_deref(), Some("abc"));
        assert_eq!(one(r#""a\"b\\c""#).unwrap().as_deref(), Some(r#"a"b\c"#));
        assert!(one(r#""a\xb""#).is_err());
        assert!(one(r#""a"b""#).is_err());
        assert_eq!(one("\"").unwrap().as_deref(), Some("\""));
        assert_eq!(key_id(&HeaderMap::new(), &name).unwrap(), None);
        let mut two = HeaderMap::new();
        two.append(&name, HeaderValue::from_static("a"));
        two.append(&name, HeaderValue::from_static("b"));
        assert!(key_id(&two, &name).is_err());
    }

    #[test]
    fn long_routes_become_a_digest() {
        assert_eq!(scope_of(None, "POST", "/tickets"), "POST /tickets");
        assert_eq!(scope_of(Some("acme"), "POST", "/t"), "acme/POST /t");
        let long = format!("/{}", "x".repeat(200));
        let a = scope_of(Some("acme"), "POST", &long);
        assert!(a.len() <= MAX_SCOPE_LEN);
        assert!(a.starts_with("acme/POST #"));
        assert_ne!(a, scope_of(Some("acme"), "POST", &format!("{long}y")));
    }
}
