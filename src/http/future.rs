//! [`ResponseFuture`]: the life of one request, from claim to stored outcome.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_timer::Delay;
use http::Response;
use http_body::Body;
use pin_project_lite::pin_project;

use crate::error::{Error, Result};
use crate::record::Lease;

use super::body::{BoxError, Collected, IdempotencyBody, collect_limited};
use super::layer::Settings;
use super::service::IdempotencyOutcome;
use super::stored::StoredResponse;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// What the claim step yields: the inner service's future under a held
/// lease, or a response given without calling the inner service.
type Prepared<F, B> = std::result::Result<(F, Held), Response<IdempotencyBody<B>>>;

pin_project! {
    /// The response future of [`Idempotency`](super::Idempotency).
    ///
    /// A refusal decided from the headers alone (missing key, body too
    /// large by its `Content-Length`), a replay, and every other refusal
    /// after the claim (409, 422, 503) are answered without calling the
    /// inner service. When the key is acquired, the inner service runs
    /// while this future extends the lease every third of its duration; its
    /// response is then stored, or recorded as a failure, before it is
    /// returned.
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
        Run { #[pin] future: F, held: Option<Held>, heartbeat: Heartbeat },
        // Storing the outcome.
        Record { future: BoxFuture<Response<IdempotencyBody<B>>> },
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
            State::Record { .. } => "record",
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
                    Ok((future, held)) => {
                        let heartbeat = Heartbeat::new(held.settings.lease);
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
                    if let Some(held) = held.as_ref() {
                        heartbeat.poll(cx, held);
                    }
                    let result = ready!(future.poll(cx));
                    let Some(held) = held.take() else {
                        panic!("ResponseFuture polled after completion")
                    };
                    match result {
                        Ok(response) => state.set(State::Record {
                            future: Box::pin(record(held, response)),
                        }),
                        Err(error) => {
                            held.abandon("the service returned an error instead of a response");
                            state.set(State::Done);
                            return Poll::Ready(Err(error));
                        }
                    }
                }
                StateProj::Record { future } => {
                    let response = ready!(future.as_mut().poll(cx));
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
}

impl Held {
    pub(crate) fn new(settings: Arc<Settings>, lease: Lease) -> Held {
        Held {
            settings,
            lease,
            finished: false,
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

    /// Records a retryable failure, waiting for it to be durable.
    async fn fail_retryable(&mut self, reason: &str) {
        tracing::warn!(key = %self.lease.key(), reason, "recording a retryable failure");
        let result = self
            .settings
            .store
            .fail_async(&self.lease, reason.as_bytes(), true)
            .await;
        self.finished = true;
        self.report(result.map(drop));
    }

    /// Stores `stored`, records it as a failure, or releases the key, as
    /// the outcome and the settings say.
    async fn finish(&mut self, outcome: Option<IdempotencyOutcome>, stored: &StoredResponse) {
        let status = stored.status;
        let store = &self.settings.store;
        let retryable = match outcome {
            Some(IdempotencyOutcome::NoEffect) => {
                let result = store.release_async(self.lease.clone()).await;
                self.finished = true;
                return self.report(result);
            }
            Some(IdempotencyOutcome::Final) => false,
            None => status.is_server_error() && !self.settings.store_server_errors,
        };
        let Some(bytes) = stored.encode() else {
            return self
                .fail_retryable("the response cannot be stored: a header is too long")
                .await;
        };
        let result = if retryable {
            store.fail_async(&self.lease, &bytes, true).await
        } else if status.is_client_error() || status.is_server_error() {
            store.fail_async(&self.lease, &bytes, false).await
        } else {
            store.complete_async(&self.lease, &bytes).await
        };
        match result {
            Err(Error::TooLarge { len, limit, .. }) => {
                let reason = format!(
                    "the response cannot be stored: {len} bytes, over the store's limit of {limit} bytes"
                );
                self.fail_retryable(&reason).await;
            }
            other => {
                self.finished = true;
                self.report(other.map(drop));
            }
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
            tracing::warn!(key = %self.lease.key(), "request dropped while its handler ran; recording a retryable failure");
            self.settings.store.fail_detached(
                &self.lease,
                b"the request was dropped while its handler ran",
            );
        }
    }
}

/// Buffers the response body, records the outcome, and returns the response.
async fn record<B>(mut held: Held, response: Response<B>) -> Response<IdempotencyBody<B>>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    let outcome = parts.extensions.remove::<IdempotencyOutcome>();
    let limit = held.settings.max_response_bytes;
    match collect_limited(body, limit).await {
        Collected::Complete(bytes) => {
            let stored = StoredResponse::new(
                parts.status,
                &parts.headers,
                &held.settings.replay_headers,
                bytes.clone(),
            );
            held.finish(outcome, &stored).await;
            Response::from_parts(parts, IdempotencyBody::full(bytes))
        }
        Collected::Over { prefix, rest } => {
            let reason = format!(
                "the response cannot be stored: its body is over max_response_bytes ({limit} bytes)"
            );
            held.fail_retryable(&reason).await;
            Response::from_parts(parts, IdempotencyBody::stream_after(prefix, rest))
        }
        Collected::Failed { error } => {
            held.fail_retryable(&format!("the response body failed: {error}"))
                .await;
            Response::from_parts(parts, IdempotencyBody::failed(error))
        }
    }
}

/// Extends the lease every third of its duration while the handler runs.
/// Timers come from `futures-timer`, which needs no async runtime.
pub(crate) struct Heartbeat {
    lease: Duration,
    delay: Delay,
    extending: Option<BoxFuture<Result<u64>>>,
    lost: bool,
}

impl Heartbeat {
    fn new(lease: Duration) -> Heartbeat {
        let lease = lease.max(Duration::from_millis(1));
        Heartbeat {
            lease,
            delay: Delay::new(lease / 3),
            extending: None,
            lost: false,
        }
    }

    /// Drives the timer and any extension in flight; never finishes.
    fn poll(&mut self, cx: &mut Context<'_>, held: &Held) {
        while !self.lost {
            if let Some(extending) = self.extending.as_mut() {
                let Poll::Ready(result) = extending.as_mut().poll(cx) else {
                    return;
                };
                self.extending = None;
                match result {
                    Ok(_) => {}
                    Err(error @ Error::StaleLease { .. }) => {
                        tracing::warn!(key = %held.lease.key(), %error, "lease lost while the handler ran");
                        self.lost = true;
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(key = %held.lease.key(), %error, "lease extension failed; trying again");
                    }
                }
                self.delay.reset(self.lease / 3);
            }
            if Pin::new(&mut self.delay).poll(cx).is_pending() {
                return;
            }
            let store = held.settings.store.clone();
            let lease = held.lease.clone();
            let duration = self.lease;
            self.extending = Some(Box::pin(async move {
                store.extend_async(&lease, duration).await
            }));
        }
    }
}
