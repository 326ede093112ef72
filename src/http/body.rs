//! [`IdempotencyBody`]: the one body type the layer hands on, in both
//! directions, and the bounded read of a body into memory.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

use super::future::Recorder;

/// The boxed error of an [`IdempotencyBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A body that is either held in memory (a buffered request, a replayed
    /// response, a rejection) or streamed from an inner body.
    ///
    /// The inner service receives requests with this body, and the layer's
    /// responses carry it. Trailers are not kept: neither those of a
    /// buffered request nor those of a recorded response (they are handed
    /// on to the first client, not replayed).
    ///
    /// The body of a response whose outcome the layer records streams to
    /// the client frame by frame as the handler's body yields it, while the
    /// layer keeps a copy for storage; the store's lease extender thread
    /// extends the key's lease until the outcome is recorded, whether or
    /// not the body is polled (the body's task does it, when polled, only
    /// when that thread cannot be started). The outcome is recorded, durably, before the last frame
    /// is handed on (the frame after which the inner body is at its end or
    /// has sent its declared `Content-Length`), so that a client holding
    /// the whole response that retries is answered by a replay (a write
    /// that still fails when its tries end is logged, and the frame handed
    /// on all the same: a retry after the lease is then a takeover). If the
    /// body fails, a retryable failure is recorded and the error handed
    /// on; if the body is dropped before its end (the client went away),
    /// a retryable failure is queued (once the outcome's write has begun,
    /// the write is left to land instead, and a retry gets its replay).
    /// Either way a retry runs the handler
    /// again as a takeover ([`IdempotencyContext::is_takeover`](super::IdempotencyContext::is_takeover)),
    /// which looks its effect up by key: the first client saw only part of
    /// the response, so there is no whole response to replay.
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes> },
        Stream { #[pin] rest: B },
        Recording { #[pin] rest: B, recorder: Box<Recorder> },
    }
}

impl<B> IdempotencyBody<B> {
    /// A body of `data`, held in memory.
    pub(crate) fn full(data: Bytes) -> Self {
        IdempotencyBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// The inner body, streamed as it is.
    pub(crate) fn stream(rest: B) -> Self {
        IdempotencyBody {
            kind: Kind::Stream { rest },
        }
    }

    /// The inner body, streamed while `recorder` keeps it and records the
    /// outcome at its end.
    pub(crate) fn recording(rest: B, recorder: Box<Recorder>) -> Self {
        IdempotencyBody {
            kind: Kind::Recording { rest, recorder },
        }
    }
}

impl<B> std::fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Full { data } => format!("full, {} bytes", data.as_ref().map_or(0, Bytes::len)),
            Kind::Stream { .. } => "stream".to_owned(),
            Kind::Recording { .. } => "recording".to_owned(),
        };
        f.debug_tuple("IdempotencyBody").field(&kind).finish()
    }
}

impl<B> Body for IdempotencyBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Stream { rest } => Poll::Ready(ready!(rest.poll_frame(cx)).map(out)),
            KindProj::Recording { mut rest, recorder } => loop {
                if let Some(poll) = recorder.poll_recording(cx) {
                    return poll;
                }
                if recorder.is_ended() {
                    return Poll::Ready(None);
                }
                if recorder.is_done() {
                    return Poll::Ready(ready!(rest.poll_frame(cx)).map(out));
                }
                recorder.heartbeat(cx);
                match ready!(rest.as_mut().poll_frame(cx)).map(out) {
                    None => recorder.end(None),
                    Some(Err(error)) => recorder.fail(error),
                    Some(Ok(frame)) => {
                        // Trailers end a body: a server hands them on and
                        // polls no more.
                        let last = match frame.data_ref() {
                            Some(data) => recorder.data(data),
                            None => frame.is_trailers(),
                        };
                        if last || rest.is_end_stream() {
                            recorder.end(Some(Ok(frame)));
                        } else {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Stream { rest } => rest.is_end_stream(),
            // Not at its end before the outcome is recorded and handed on.
            Kind::Recording { rest, recorder } => {
                recorder.is_done() && (recorder.is_ended() || rest.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Stream { rest } | Kind::Recording { rest, .. } => rest.size_hint(),
        }
    }
}

/// A frame of an inner body as this body hands it on.
fn out<D: Buf, E: Into<BoxError>>(frame: Result<Frame<D>, E>) -> Result<Frame<Bytes>, BoxError> {
    match frame {
        Ok(frame) => Ok(frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))),
        Err(e) => Err(e.into()),
    }
}

/// What a bounded read of a body found.
pub(crate) enum Collected {
    /// The whole body, at most the limit.
    Complete(Bytes),
    /// The body is longer than the limit.
    Over,
    /// The body failed before its end.
    Failed { error: BoxError },
}

/// Reads `body` into memory, stopping as soon as it is longer than `limit`
/// bytes. Trailers are dropped.
pub(crate) async fn collect_limited<B>(mut body: B, limit: usize) -> Collected
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    let mut buf = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Collected::Complete(buf.freeze()),
            Some(Err(e)) => return Collected::Failed { error: e.into() },
            Some(Ok(frame)) => {
                if let Ok(mut data) = frame.into_data() {
                    while data.has_remaining() {
                        let chunk = data.chunk();
                        buf.extend_from_slice(chunk);
                        let n = chunk.len();
                        data.advance(n);
                    }
                    if buf.len() > limit {
                        return Collected::Over;
                    }
                }
            }
        }
    }
}
