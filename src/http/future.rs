//! [`ResponseFuture`]: the life of one request, from claim to stored outcome.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_timer::Delay;
use http::Response;
use http_body::{Body, Frame};
use pin_project_lite::pin_project;

use crate::error::{Error, Result};
use crate::record::Lease;

use super::body::{BoxError, IdempotencyBody};
use super::layer::Settings;
use super::service::IdempotencyOutcome;
use super::stored::{Stored, StoredResponse};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A boxed future that is `Sync` as well as `Send`, so that the body that
/// holds it stays `Sync` (as `http_body_util::combinators::BoxBody`
/// requires): the mutex is only ever reached through `&mut`, never locked
/// by two threads.
pub(crate) struct SyncFuture<T>(std::sync::Mutex<BoxFuture<T>>);

impl<T> SyncFuture<T> {
    fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        SyncFuture(std::sync::Mutex::new(Box::pin(future)))
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<T> {
        self.0
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_mut()
            .poll(cx)
    }
}

/// Whether a server sends (and so reads) the body of this response: not for
/// 1xx, 204 and 304 (RFC 9110 §6.4.1), nor for a body already at its end or
/// of length zero, declared or exact.
fn body_is_sent<B: Body>(parts: &http::response::Parts, body: &B) -> bool {
    let status = parts.status;
    let no_body = status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED;
    !(no_body
        || body.is_end_stream()
        || body.size_hint().exact() == Some(0)
        || declared_length(&parts.headers) == Some(0))
}

/// The `Content-Length` a response declares, if any.
fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What the claim step yields: the inner service's future under a held
/// lease, or a response given without calling the inner service.
type Prepared<F, B> = std::result::Result<(F, Held, Heartbeat), Response<IdempotencyBody<B>>>;

pin_project! {
    /// The response future of [`Idempotency`](super::Idempotency).
    ///
    /// A refusal decided from the headers alone (missing key, body too
    /// large by its `Content-Length`), a replay, and every other refusal
    /// after the claim (409, 422, 503) are answered without calling the
    /// inner service. When the key is acquired, the inner service runs
    /// while the store's extender thread extends the lease every third of
    /// its duration. Its response is then returned at once, with a body
    /// that streams to the client while it is kept for storage, the lease
    /// extended until the outcome is recorded; the outcome is recorded
    /// before the body's last byte is handed on (see [`IdempotencyBody`]). A response whose status
    /// releases the key ([`DEFAULT_RELEASE_STATUSES`](super::DEFAULT_RELEASE_STATUSES) by default) or that the handler
    /// marked `NoEffect` is returned once the key is released.
    ///
    /// Dropping the future while the handler runs (the client went away)
    /// records a retryable failure without waiting for it, so that a retry
    /// takes the key over at once instead of waiting for the lease to lapse.
    ///
    /// # Panics
    /// When polled again after it returned `Ready`, as futures may.
    pub struct ResponseFuture<F, B> {
        #[pin]
        state: State<F, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B> {
        // Answered without calling the inner service.
        Reply { response: Option<Response<IdempotencyBody<B>>> },
        // A method that takes no key: the inner service, untouched.
        Passthrough { #[pin] future: F },
        // Reading the body and claiming the key; may answer without
        // calling the inner service (a replay, 409, 413, 422, 503).
        Claim { future: BoxFuture<Prepared<F, B>> },
        // The handler runs under the lease.
        // (`heartbeat` first: dropped first, so the renewals stop before a
        // dropped `held` queues its failure.)
        Run { heartbeat: Heartbeat, #[pin] future: F, held: Option<Held> },
        // Releasing the key, or recording a response whose body will not
        // be read, before the response is returned; the lease is extended
        // until then.
        Settle { future: SyncFuture<Response<IdempotencyBody<B>>>, heartbeat: Heartbeat },
        Done,
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(crate) fn reply(response: Response<IdempotencyBody<B>>) -> Self {
        ResponseFuture {
            state: State::Reply {
                response: Some(response),
            },
        }
    }

    pub(crate) fn passthrough(future: F) -> Self {
        ResponseFuture {
            state: State::Passthrough { future },
        }
    }

    pub(crate) fn prepare(future: BoxFuture<Prepared<F, B>>) -> Self {
        ResponseFuture {
            state: State::Claim { future },
        }
    }
}

impl<F, B> std::fmt::Debug for ResponseFuture<F, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Reply { .. } => "reply",
            State::Passthrough { .. } => "passthrough",
            State::Claim { .. } => "claim",
            State::Run { .. } => "run",
            State::Settle { .. } => "settle",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = std::result::Result<Response<B>, E>>,
    B: Body + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    type Output = std::result::Result<Response<IdempotencyBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Reply { response } => {
                    let response = response.take();
                    state.set(State::Done);
                    match response {
                        Some(response) => return Poll::Ready(Ok(response)),
                        None => panic!("ResponseFuture polled after completion"),
                    }
                }
                StateProj::Passthrough { future } => {
                    let result = ready!(future.poll(cx));
                    state.set(State::Done);
                    return Poll::Ready(result.map(|r| r.map(IdempotencyBody::stream)));
                }
                StateProj::Claim { future } => match ready!(future.as_mut().poll(cx)) {
                    Ok((future, held, heartbeat)) => {
                        state.set(State::Run {
                            future,
                            held: Some(held),
                            heartbeat,
                        });
                    }
                    Err(response) => {
                        state.set(State::Done);
                        return Poll::Ready(Ok(response));
                    }
                },
                StateProj::Run {
                    future,
                    held,
                    heartbeat,
                } => {
                    heartbeat.poll(cx);
                    let result = ready!(future.poll(cx));
                    let Some(held) = held.take() else {
                        panic!("ResponseFuture polled after completion")
                    };
                    match result {
                        Ok(response) => {
                            let (mut parts, body) = response.into_parts();
                            let outcome = parts.extensions.remove::<IdempotencyOutcome>();
                            // A takeover is never released: an earlier
                            // attempt may have acted, and a release would
                            // delete the record that says so (its
                            // acquisitions and recovery point). `finish`
                            // records a retryable failure instead.
                            if held.releases(outcome, parts.status) && !held.lease.is_takeover() {
                                let mut heartbeat = heartbeat.take();
                                heartbeat.set_recording();
                                state.set(State::Settle {
                                    future: SyncFuture::new(async move {
                                        held.release().await;
                                        Response::from_parts(parts, IdempotencyBody::stream(body))
                                    }),
                                    heartbeat,
                                });
                                continue;
                            }
                            if !body_is_sent(&parts, &body) {
                                // A server sends no body for this response
                                // (204, 304, 1xx, an empty or zero-length
                                // body) and may never poll it: record the
                                // outcome before the head is handed on.
                                let stored = StoredResponse::new(
                                    parts.status,
                                    &parts.headers,
                                    &held.settings.replay_headers,
                                );
                                let kept =
                                    stored.len_without_body() <= held.settings.max_response_bytes;
                                let mut heartbeat = heartbeat.take();
                                heartbeat.set_recording();
                                state.set(State::Settle {
                                    future: SyncFuture::new(async move {
                                        held.finish(outcome, stored, kept).await;
                                        Response::from_parts(parts, IdempotencyBody::stream(body))
                                    }),
                                    heartbeat,
                                });
                                continue;
                            }
                            let heartbeat = heartbeat.take();
                            let recorder = Recorder::new(held, heartbeat, outcome, &parts, &body);
                            state.set(State::Done);
                            return Poll::Ready(Ok(Response::from_parts(
                                parts,
                                IdempotencyBody::recording(body, recorder),
                            )));
                        }
                        Err(error) => {
                            heartbeat.stop();
                            held.abandon("the service returned an error instead of a response");
                            state.set(State::Done);
                            return Poll::Ready(Err(error));
                        }
                    }
                }
                StateProj::Settle { future, heartbeat } => {
                    let Poll::Ready(response) = future.poll(cx) else {
                        heartbeat.poll(cx);
                        return Poll::Pending;
                    };
                    state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// A lease the layer holds for a running request. Dropped before it is
/// finished, it queues a retryable failure (see [`ResponseFuture`]).
pub(crate) struct Held {
    settings: Arc<Settings>,
    lease: Lease,
    finished: bool,
    /// The outcome's write while no attempt of it is out (before the
    /// first, between two): dropped then, the write is queued as it is.
    unsent: Option<crate::record::Op>,
    /// What a retryable failure recorded on drop says.
    dropped: &'static str,
}

impl Held {
    /// How far each renewal extends the lease: the layer's lease (at least
    /// 1 ms).
    fn lease_length(&self) -> Duration {
        self.settings.lease.max(Duration::from_millis(1))
    }

    pub(crate) fn new(settings: Arc<Settings>, lease: Lease) -> Held {
        Held {
            settings,
            lease,
            finished: false,
            unsent: None,
            dropped: "the request was dropped while its handler ran",
        }
    }

    /// Whether the handler's answer says nothing was done: marked
    /// [`IdempotencyOutcome::NoEffect`], or unmarked with one of the
    /// release statuses.
    fn releases(&self, outcome: Option<IdempotencyOutcome>, status: http::StatusCode) -> bool {
        match outcome {
            Some(IdempotencyOutcome::NoEffect) => true,
            Some(IdempotencyOutcome::Final) => false,
            None => self.settings.release_statuses.contains(&status),
        }
    }

    /// Queues a retryable failure without waiting for it.
    fn abandon(mut self, reason: &str) {
        self.finished = true;
        tracing::warn!(key = %self.lease.key(), reason, "recording a retryable failure");
        self.settings
            .store
            .fail_detached(&self.lease, reason.as_bytes());
    }

    /// Releases the key, waiting for it to be durable; unless this attempt
    /// saved a recovery point, which says it acted: the key is then kept
    /// as a retryable failure, as for a takeover, so that the next attempt
    /// sees the recovery point. The store decides both in one transition,
    /// so a recovery point saved by a task the handler spawned, up to the
    /// release, is kept too.
    async fn release(mut self) {
        // Handed to the store from here on (see `fail_retryable`).
        self.finished = true;
        let reason = "the handler answered a releasing status after saving a recovery point; \
                      a retry runs it again as a takeover";
        let result = self
            .settings
            .store
            .release_unless_acted_async(&self.lease, reason.as_bytes())
            .await;
        if let Ok(false) = result {
            tracing::warn!(key = %self.lease.key(), reason, "recorded a retryable failure");
        }
        self.report(result.map(drop));
    }

    /// Records a retryable failure, waiting for it to be durable.
    async fn fail_retryable(mut self, reason: String) {
        // Handed to `write` from here on: dropped while it writes (the
        // client went away), no failure is queued (see `write`).
        self.finished = true;
        tracing::warn!(key = %self.lease.key(), reason, "recording a retryable failure");
        let store = self.settings.store.clone();
        let result = match self
            .write(store.fail_op(&self.lease, reason.as_bytes(), true))
            .await
        {
            // The reason is over the store's failure limit: the failure
            // matters, not its text.
            Err(Error::TooLarge { .. }) => self.write(store.fail_op(&self.lease, &[], true)).await,
            other => other,
        };
        self.report(result);
    }

    /// Writes `op`, the outcome, as [`Store::execute`](crate::Store::execute)
    /// does ([`crate::renewal::write_outcome_async`]): each attempt under a
    /// deadline of a third of the lease, one that did not reach the store
    /// or lost its answer tried again (on PostgreSQL on another connection)
    /// while the lease lasts, at most a minute; the heartbeat extends the
    /// lease meanwhile. `op` is the error when it could not be built (a
    /// value over the store's limit).
    ///
    /// Dropped while an attempt is out (the client went away), the attempt
    /// is left to land; dropped while none is (in the pause between two),
    /// the write is queued as it is (see `Drop`).
    async fn write(&mut self, op: Result<crate::record::Op>) -> Result<()> {
        let store = self.settings.store.clone();
        crate::renewal::write_outcome_async(
            &store,
            &self.lease,
            op?,
            self.settings.lease,
            &mut self.unsent,
        )
        .await
    }

    /// Records the response the client got: a retryable failure for a 1xx
    /// (never a final answer), for a 5xx (unless stored by the settings or
    /// marked `Final`) and for a takeover's releasing answer, else stored
    /// as a completion (2xx, 3xx) or a permanent failure (4xx, 5xx). A response
    /// that is over `max_response_bytes` (`kept` false) or the store's
    /// limit is stored as the not-kept marker, so that the key is finished
    /// all the same and a retry never runs the handler again.
    async fn finish(
        mut self,
        outcome: Option<IdempotencyOutcome>,
        stored: StoredResponse,
        kept: bool,
    ) {
        // Handed to the store from here on (see `fail_retryable`).
        self.finished = true;
        let status = stored.status;
        // Only a takeover reaches here with a releasing answer (see the
        // `Run` state): it keeps its record, as a retryable failure.
        // A 1xx is an interim status (RFC 9110 §15.2): hyper sends a 500 in
        // place of any but 101, and a 101 hands the connection over to
        // another protocol, which no replay can repeat. Never stored,
        // whatever the handler marked `Final` (`NoEffect` on a first
        // attempt still releases).
        let interim = status.is_informational();
        // A 408 from inside the layer (which read the whole request before
        // the handler ran) is a timeout of the handler, which may have
        // acted: retried as a takeover, like a 5xx, unless marked.
        let timed_out = status == http::StatusCode::REQUEST_TIMEOUT;
        let retryable = interim
            || self.releases(outcome, status)
            || (outcome.is_none() && timed_out)
            || (outcome.is_none()
                && status.is_server_error()
                && !self.settings.store_server_errors);
        if retryable {
            let reason = if interim {
                format!(
                    "the handler answered {status}, an interim status that cannot be replayed \
                     (hyper sends a 500 in place of any but 101); a retry runs it again"
                )
            } else {
                format!("the handler answered {status}; a retry runs it again")
            };
            let bytes = stored.encode().filter(|_| kept);
            let failure = bytes.as_deref().unwrap_or(reason.as_bytes());
            let store = self.settings.store.clone();
            let result = match self.write(store.fail_op(&self.lease, failure, true)).await {
                Err(Error::TooLarge { .. }) => {
                    self.write(store.fail_op(&self.lease, reason.as_bytes(), true))
                        .await
                }
                other => other,
            };
            return self.report(result);
        }
        let location = stored
            .headers
            .iter()
            .find(|(n, _)| n == http::header::LOCATION)
            .map(|(_, v)| v.clone());
        let limit = self.settings.max_response_bytes;
        let marker = || Stored::not_kept(status, location.as_ref(), limit);
        let (bytes, is_marker) = match stored.encode().filter(|_| kept) {
            Some(bytes) => (bytes, false),
            None => (marker(), true),
        };
        let mut result = self.store_outcome(status, &bytes).await;
        if let (Err(Error::TooLarge { len, limit, .. }), false) = (&result, is_marker) {
            tracing::warn!(key = %self.lease.key(), len, limit, "the response is over the store's limit; keeping a marker instead");
            result = self.store_outcome(status, &marker()).await;
        }
        if let Err(Error::TooLarge { .. }) = &result {
            // Even the marker's location is over the store's limit.
            result = self
                .store_outcome(status, &Stored::not_kept(status, None, 0))
                .await;
        }
        if is_marker {
            tracing::warn!(key = %self.lease.key(), %status, "the response was too large to keep; a retry is answered 410");
        }
        self.report(result);
    }

    /// Completes the key (status below 400) or fails it for good.
    async fn store_outcome(&mut self, status: http::StatusCode, bytes: &[u8]) -> Result<()> {
        let store = self.settings.store.clone();
        if status.is_client_error() || status.is_server_error() {
            self.write(store.fail_op(&self.lease, bytes, false)).await
        } else {
            self.write(store.complete_op(&self.lease, bytes)).await
        }
    }

    /// Logs what went wrong; the client gets the handler's response anyway,
    /// since its effect may have happened.
    fn report(&self, result: Result<()>) {
        if let Err(error) = result {
            tracing::warn!(
                key = %self.lease.key(),
                %error,
                "the outcome was not recorded; a retry takes the key over after the lease lapses"
            );
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.finished {
            tracing::warn!(key = %self.lease.key(), reason = self.dropped, "recording a retryable failure");
            self.settings
                .store
                .fail_detached(&self.lease, self.dropped.as_bytes());
        } else if let Some(op) = self.unsent.take() {
            // The outcome's write, between two attempts: queued as it is.
            self.settings.store.write_outcome_detached(&self.lease, op);
        }
    }
}

/// A frame as the layer hands it on.
pub(crate) type OutFrame = Option<std::result::Result<Frame<Bytes>, BoxError>>;

/// The part of a response body that records the outcome: it keeps the
/// body (up to the limit) as it streams to the client, extends the lease
/// while it streams, and records the outcome before the last frame is
/// handed on, so that a client that has the whole response and retries is
/// answered by a replay.
pub(crate) struct Recorder {
    // Field order is drop order: the lease's renewals stop before a
    // dropped `held` queues its failure.
    heartbeat: Heartbeat,
    held: Option<Held>,
    outcome: Option<IdempotencyOutcome>,
    stored: Option<StoredResponse>,
    body: BytesMut,
    /// Body bytes that still fit the stored response.
    room: usize,
    kept: bool,
    /// Body bytes handed on so far, and how many the response declares.
    sent: u64,
    declared: Option<u64>,
    recording: Option<SyncFuture<()>>,
    /// What to hand on once the recording is durable.
    then: OutFrame,
    done: bool,
    /// The inner body has ended (or failed): nothing more is read from it.
    ended: bool,
}

impl Recorder {
    fn new<B: Body>(
        mut held: Held,
        heartbeat: Heartbeat,
        outcome: Option<IdempotencyOutcome>,
        parts: &http::response::Parts,
        body: &B,
    ) -> Box<Recorder> {
        held.dropped = "the client went away before the whole response was sent";
        let settings = &held.settings;
        let stored = StoredResponse::new(parts.status, &parts.headers, &settings.replay_headers);
        let room = settings
            .max_response_bytes
            .checked_sub(stored.len_without_body());
        let declared = declared_length(&parts.headers).or_else(|| body.size_hint().exact());
        Box::new(Recorder {
            heartbeat,
            held: Some(held),
            outcome,
            stored: Some(stored),
            body: BytesMut::new(),
            room: room.unwrap_or(0),
            kept: room.is_some(),
            sent: 0,
            declared,
            recording: None,
            then: None,
            done: false,
            ended: false,
        })
    }

    /// Whether the inner body has ended: the rest reads as the end.
    pub(crate) fn is_ended(&self) -> bool {
        self.ended
    }

    /// Whether the outcome is recorded and the rest of the body (if any)
    /// passes through untouched.
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// Drives the recording in flight: `Some` with what to hand on when
    /// there is one, `None` when the body should be read on.
    pub(crate) fn poll_recording(&mut self, cx: &mut Context<'_>) -> Option<Poll<OutFrame>> {
        let recording = self.recording.as_mut()?;
        if recording.poll(cx).is_pending() {
            // The lease is extended until the outcome is recorded.
            self.heartbeat.poll(cx);
            return Some(Poll::Pending);
        }
        self.recording = None;
        self.heartbeat.stop();
        self.done = true;
        Some(Poll::Ready(self.then.take()))
    }

    /// Extends the lease when it is time to.
    pub(crate) fn heartbeat(&mut self, cx: &mut Context<'_>) {
        self.heartbeat.poll(cx);
    }

    /// Keeps a data frame; `true` when it is the last one the response
    /// declared. Bytes past a declared `Content-Length` are not kept: a
    /// server does not send them.
    pub(crate) fn data(&mut self, data: &Bytes) -> bool {
        let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
        let sendable = match self.declared {
            Some(declared) => {
                let left = declared.saturating_sub(self.sent);
                usize::try_from(left.min(len)).unwrap_or(data.len())
            }
            None => data.len(),
        };
        let data = &data[..sendable];
        if self.kept {
            if data.len() <= self.room {
                self.body.extend_from_slice(data);
                self.room -= data.len();
            } else {
                self.kept = false;
                self.body = BytesMut::new();
            }
        }
        self.sent = self.sent.saturating_add(len);
        self.declared.is_some_and(|n| self.sent >= n)
    }

    /// The body ended (`then` is what to hand on after the recording:
    /// the last frame, or `None`): records the outcome.
    pub(crate) fn end(&mut self, then: OutFrame) {
        self.ended |= then.is_none();
        if let Some(declared) = self.declared.filter(|n| self.sent < *n) {
            // Shorter than it declared: the server aborts the response, so
            // the client never got it whole.
            let error: BoxError = format!(
                "the response body ended after {} of its {declared} declared bytes",
                self.sent
            )
            .into();
            return self.fail(error);
        }
        let (Some(held), Some(mut stored)) = (self.held.take(), self.stored.take()) else {
            self.heartbeat.stop();
            self.done = true;
            self.then = then;
            return;
        };
        stored.body = std::mem::take(&mut self.body).freeze();
        self.heartbeat.set_recording();
        self.recording = Some(SyncFuture::new(held.finish(
            self.outcome,
            stored,
            self.kept,
        )));
        self.then = then;
    }

    /// The body failed: records a retryable failure, then hands the error
    /// on.
    pub(crate) fn fail(&mut self, error: BoxError) {
        self.ended = true;
        let Some(held) = self.held.take() else {
            self.heartbeat.stop();
            self.done = true;
            self.then = Some(Err(error));
            return;
        };
        let reason = format!(
            "the response body failed after {} bytes: {error}",
            self.sent
        );
        self.heartbeat.set_recording();
        self.recording = Some(SyncFuture::new(held.fail_retryable(reason)));
        self.then = Some(Err(error));
    }
}

/// Extends the lease while the handler runs, while the response body
/// streams and while the outcome is recorded, on the schedule of
/// [`Store::execute`](crate::Store::execute)'s renewals
/// ([`crate::renewal`]): every third of the lease, each renewal under a
/// deadline of half the lease left (a PostgreSQL store drops a connection
/// that has not answered by then, so that a half-open one cannot hold the
/// renewal past the lease), one that did not reach the store tried again a
/// third of that later, until one is answered; after any other failure (a
/// stale lease) it stops.
///
/// The store's extender thread renews the lease ([`crate::extender`], as
/// for `Store::execute`), from before the inner service is called until
/// the outcome is recorded, so that a handler or a body that blocks its
/// thread, which stops the runtime from polling this request's task, and a
/// client that stops reading, keep the key. Only when that thread cannot
/// be started do the renewals run in the request's task, each time it is
/// polled, with timers from `futures-timer`, which needs no async runtime.
pub(crate) struct Heartbeat {
    /// The renewals run in the request's task (the extender's thread could
    /// not be started); `None` once handed on ([`Heartbeat::take`]).
    beat: Option<Beat>,
    /// The lease registered with the store's extender thread (dropped
    /// without waiting, see
    /// [`crate::extender::Extender::register_unwaited`]).
    registered: Option<crate::extender::Registration>,
}

/// A running [`Heartbeat`].
struct Beat {
    store: Arc<crate::store::Store>,
    /// A copy of the held lease (its key and token).
    lease: Lease,
    length: Duration,
    period: Duration,
    /// When the lease ends at the earliest: its last renewal's sending
    /// time plus its length.
    expires: Instant,
    delay: Delay,
    /// The renewal in flight and when it was sent.
    extending: Option<(Instant, SyncFuture<Result<u64>>)>,
    /// Whether the last renewal did not reach the store (see
    /// [`crate::renewal::after_renewal`]).
    unreachable: bool,
    /// While the outcome is recorded: a renewal's failure is not logged
    /// (the recording's own result is), since one that meets the recorded
    /// outcome fails as a stale lease.
    recording: bool,
    stopped: bool,
}

impl Heartbeat {
    /// The heartbeat of a key just acquired under `held`, started before
    /// the inner service is called: the store's extender thread renews the
    /// lease until the outcome is recorded, or, when that thread cannot be
    /// started (the system is out of threads), the request's own task does.
    pub(crate) fn running(held: &Held) -> Heartbeat {
        let length = held.lease_length();
        match held
            .settings
            .store
            .extender
            .register_unwaited(&held.lease, length)
        {
            Ok(registration) => Heartbeat {
                beat: None,
                registered: Some(registration),
            },
            Err(e) => {
                tracing::warn!(
                    key = %held.lease.key(),
                    error = %e,
                    "the lease extender cannot start; the request's task renews the lease"
                );
                Heartbeat::new(held)
            }
        }
    }

    fn new(held: &Held) -> Heartbeat {
        let length = held.lease_length();
        let period = crate::renewal::period_of(length);
        let now = Instant::now();
        Heartbeat {
            beat: Some(Beat {
                store: held.settings.store.clone(),
                lease: Lease::from_parts(held.lease.key().clone(), held.lease.token()),
                length,
                period,
                expires: now.checked_add(length).unwrap_or(now),
                delay: Delay::new(period),
                extending: None,
                unreachable: false,
                recording: false,
                stopped: false,
            }),
            registered: None,
        }
    }

    /// Moves the heartbeat out, leaving one that does nothing.
    fn take(&mut self) -> Heartbeat {
        Heartbeat {
            beat: self.beat.take(),
            registered: self.registered.take(),
        }
    }

    /// The outcome is being recorded: renewals go on, their failures
    /// unlogged.
    fn set_recording(&mut self) {
        if let Some(beat) = self.beat.as_mut() {
            beat.recording = true;
        }
        if let Some(registered) = &self.registered {
            registered.recording();
        }
    }

    /// Stops the renewals (one in flight is dropped).
    fn stop(&mut self) {
        self.beat = None;
        self.registered = None;
    }

    /// Drives the timer and any renewal in flight; never finishes.
    fn poll(&mut self, cx: &mut Context<'_>) {
        let Some(beat) = self.beat.as_mut() else {
            return;
        };
        while !beat.stopped {
            if let Some((sent, extending)) = beat.extending.as_mut() {
                let Poll::Ready(result) = extending.poll(cx) else {
                    return;
                };
                let sent = *sent;
                beat.extending = None;
                if result.is_ok() {
                    beat.expires = sent.checked_add(beat.length).unwrap_or(sent);
                }
                let next = if beat.recording {
                    crate::renewal::next_renewal(beat.period, &result)
                } else {
                    crate::renewal::after_renewal(
                        beat.lease.key(),
                        beat.period,
                        &result,
                        &mut beat.unreachable,
                    )
                };
                match next {
                    Some(after) => beat.delay.reset(after),
                    None => {
                        beat.stopped = true;
                        return;
                    }
                }
            }
            if Pin::new(&mut beat.delay).poll(cx).is_pending() {
                return;
            }
            let sent = Instant::now();
            let deadline = crate::renewal::renewal_deadline(sent, beat.expires, beat.period);
            let store = beat.store.clone();
            let lease = beat.lease.clone();
            let length = beat.length;
            beat.extending = Some((
                sent,
                SyncFuture::new(
                    async move { store.extend_by_async(&lease, length, deadline).await },
                ),
            ));
        }
    }
}
