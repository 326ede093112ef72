//! [`IdempotencyBody`]: the one body type the layer hands on, in both
//! directions, and the bounded read of a body into memory.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

/// The boxed error of an [`IdempotencyBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A body that is either held in memory (a buffered request, a stored
    /// or replayed response, a rejection) or streamed from an inner body,
    /// possibly after a prefix that was already read.
    ///
    /// The inner service receives requests with this body, and the layer's
    /// responses carry it. Trailers of a buffered body are not kept.
    pub struct IdempotencyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes> },
        Stream { prefix: Option<Bytes>, #[pin] rest: B },
        Failed { error: Option<BoxError> },
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
    pub(crate) fn stream(body: B) -> Self {
        Self::stream_after(Bytes::new(), body)
    }

    /// `prefix`, then the rest of an inner body.
    pub(crate) fn stream_after(prefix: Bytes, rest: B) -> Self {
        IdempotencyBody {
            kind: Kind::Stream {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }

    /// A body whose first frame is `error` (the inner body failed while the
    /// layer was reading it).
    pub(crate) fn failed(error: BoxError) -> Self {
        IdempotencyBody {
            kind: Kind::Failed { error: Some(error) },
        }
    }
}

impl<B> std::fmt::Debug for IdempotencyBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Full { data } => format!("full, {} bytes", data.as_ref().map_or(0, Bytes::len)),
            Kind::Stream { .. } => "stream".to_owned(),
            Kind::Failed { .. } => "failed".to_owned(),
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
            KindProj::Failed { error } => Poll::Ready(error.take().map(Err)),
            KindProj::Stream { prefix, rest } => {
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(p))));
                }
                match rest.poll_frame(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
                    Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(
                        frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
                    ))),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Failed { error } => error.is_none(),
            Kind::Stream { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Failed { .. } => SizeHint::default(),
            Kind::Stream { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(extra));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(extra));
                }
                hint
            }
        }
    }
}

/// What a bounded read of a body found.
pub(crate) enum Collected<B> {
    /// The whole body, at most the limit.
    Complete(Bytes),
    /// The body is longer than the limit: what was read, and the rest.
    Over { prefix: Bytes, rest: B },
    /// The body failed before its end.
    Failed { error: BoxError },
}

/// Reads `body` into memory, stopping as soon as it is longer than `limit`
/// bytes. Trailers are dropped.
pub(crate) async fn collect_limited<B>(mut body: B, limit: usize) -> Collected<B>
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
                        return Collected::Over {
                            prefix: buf.freeze(),
                            rest: body,
                        };
                    }
                }
            }
        }
    }
}
