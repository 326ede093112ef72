//! Claims whose caller stopped waiting: a [`Store::claim_async`] future
//! dropped after its claim was sent and before its answer came (an HTTP
//! client that hung up, a request timed out by a layer outside, a task
//! cancelled). The engine decides such a claim all the same, and when it
//! acquired the key nobody holds the lease: without this, every later
//! claim of the key answered "in progress" until the lease lapsed, and the
//! next one took the key over as a takeover, in doubt, though nothing ran.
//!
//! The claim's future is kept instead of dropped, and before each later
//! claim of the store every kept claim is waited for (it is in flight: a
//! group commit or a transaction away) and the lease it acquired, if any,
//! is given back as the claim found the key: released when the key was
//! absent, failed retryably with its earlier failure when it had failed
//! retryably. A takeover of a lapsed lease is left to lapse again, so that
//! the next claim is still told that an earlier holder may have acted.
//!
//! [`Store::claim_async`]: crate::Store::claim_async

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use crate::error::Result;
use crate::record::{AcquiredFrom, ClaimOutcome, Lease};

/// A claim in flight, owned (it holds the engine and the key).
pub(crate) type Claim = Pin<Box<dyn Future<Output = Result<ClaimOutcome>> + Send>>;

/// The most claims kept: past this, the oldest is dropped (its lease, if it
/// acquired one, lapses as before), so that a flood of hung-up requests
/// cannot grow memory without bound.
pub(crate) const MAX_ORPHANS: usize = 4096;

/// The claims of one store whose callers stopped waiting.
#[derive(Default)]
pub(crate) struct Orphans {
    claims: parking_lot::Mutex<Vec<Claim>>,
    /// `claims.len()`, read without the lock on every claim.
    count: AtomicUsize,
}

/// What to do with a lease nobody holds.
pub(crate) enum GiveBack {
    /// Release it: the claim found the key absent.
    Release(Lease),
    /// Fail it retryably with this failure, the one the claim found.
    Fail(Lease, Vec<u8>),
}

impl Orphans {
    /// Keeps `claim`, whose caller stopped waiting for it.
    pub(crate) fn adopt(&self, claim: Claim) {
        self.adopt_all(vec![claim]);
    }

    fn adopt_all(&self, kept: Vec<Claim>) {
        if kept.is_empty() {
            return;
        }
        let mut claims = self.claims.lock();
        claims.extend(kept);
        if claims.len() > MAX_ORPHANS {
            let over = claims.len() - MAX_ORPHANS;
            drop(claims.drain(..over));
            tracing::warn!(
                max = MAX_ORPHANS,
                forgotten = over,
                "too many abandoned claims in flight; the oldest are forgotten, their leases lapse"
            );
        }
        self.count.store(claims.len(), Ordering::SeqCst);
    }

    /// Takes every kept claim and waits for each to be decided (a group
    /// commit or a transaction: the store's own latency), then tells what
    /// to do with the leases they acquired. Dropped before that, it gives
    /// the claims not yet decided back to be kept.
    pub(crate) fn settle(&self) -> Settling<'_> {
        let claims = if self.count.load(Ordering::SeqCst) == 0 {
            Vec::new()
        } else {
            let mut kept = self.claims.lock();
            self.count.store(0, Ordering::SeqCst);
            std::mem::take(&mut *kept)
        };
        Settling {
            claims,
            leases: Vec::new(),
            orphans: self,
        }
    }

    /// [`Orphans::settle`], blocking the calling thread (for the sync
    /// methods).
    pub(crate) fn settle_blocking(&self) -> Vec<GiveBack> {
        let mut settling = std::pin::pin!(self.settle());
        if settling.claims.is_empty() {
            return Vec::new();
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(given) = settling.as_mut().poll(&mut cx) {
                return given;
            }
            std::thread::park();
        }
    }
}

/// Wakes a thread blocked in [`Orphans::settle_blocking`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// The claims [`Orphans::settle`] took, until each is decided.
pub(crate) struct Settling<'a> {
    claims: Vec<Claim>,
    leases: Vec<Lease>,
    orphans: &'a Orphans,
}

impl Future for Settling<'_> {
    type Output = Vec<GiveBack>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let leases = &mut this.leases;
        this.claims
            .retain_mut(|claim| match claim.as_mut().poll(cx) {
                Poll::Pending => true,
                Poll::Ready(Ok(ClaimOutcome::Acquired(lease))) => {
                    leases.push(lease);
                    false
                }
                Poll::Ready(_) => false,
            });
        if !this.claims.is_empty() {
            return Poll::Pending;
        }
        Poll::Ready(
            std::mem::take(&mut this.leases)
                .into_iter()
                .filter_map(give_back)
                .collect(),
        )
    }
}

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        self.orphans.adopt_all(std::mem::take(&mut self.claims));
    }
}

/// How to give `lease` back as its claim found the key; `None` for a
/// takeover of a lapsed lease, left to lapse.
fn give_back(lease: Lease) -> Option<GiveBack> {
    match lease.acquired_from()? {
        AcquiredFrom::Absent => Some(GiveBack::Release(lease)),
        AcquiredFrom::RetryableFailure => {
            let failure = lease
                .record()
                .and_then(|r| r.output.clone())
                .unwrap_or_default();
            Some(GiveBack::Fail(lease, failure))
        }
        AcquiredFrom::LapsedLease => None,
    }
}

/// A claim future that hands itself to [`Orphans`] when dropped before it
/// finished.
pub(crate) struct InFlight<'a> {
    claim: Option<Claim>,
    orphans: &'a Orphans,
}

impl<'a> InFlight<'a> {
    pub(crate) fn new(claim: Claim, orphans: &'a Orphans) -> InFlight<'a> {
        InFlight {
            claim: Some(claim),
            orphans,
        }
    }
}

impl Future for InFlight<'_> {
    type Output = Result<ClaimOutcome>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(claim) = self.claim.as_mut() else {
            return Poll::Ready(Err(crate::error::Error::Closed));
        };
        let answer = claim.as_mut().poll(cx);
        if answer.is_ready() {
            self.claim = None;
        }
        answer
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(claim) = self.claim.take() {
            self.orphans.adopt(claim);
        }
    }
}
