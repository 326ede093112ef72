//! Claims whose caller stopped waiting: a [`Store::claim_async`] future
//! dropped after its claim was sent and before its answer came (an HTTP
//! client that hung up, a request timed out by a layer outside, a task
//! cancelled). The engine decides such a claim all the same, and when it
//! acquired the key nobody holds the lease: without this, every later
//! claim of the key answered "in progress" until the lease lapsed, and the
//! next one took the key over as a takeover, in doubt, though nothing ran.
//!
//! The claim's future (the engine's answer to come) is kept instead of
//! dropped. Before each later claim of the store, every kept claim is
//! polled once, without waiting: the lease a decided one acquired is given
//! back as the claim found the key (released when the key was absent,
//! failed retryably with the failure it found when it had failed
//! retryably), before the claim is made: waited for when it is the key
//! being claimed, queued without waiting otherwise. A takeover of a lapsed
//! lease is left to lapse again, so that the next claim is still told an
//! earlier holder may have acted. A claim not
//! yet decided stays kept for a later claim: nobody waits for it.
//!
//! [`Store::claim_async`]: crate::Store::claim_async

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use crate::error::Result;
use crate::key::Key;
use crate::record::{AcquiredFrom, ClaimOutcome, Lease, Op};

/// A claim in flight, owned (it holds the engine and the key).
pub(crate) type Claim = Pin<Box<dyn Future<Output = Result<ClaimOutcome>> + Send>>;

/// The most claims kept: past this, the oldest is dropped (its lease, if it
/// acquired one, lapses as before), so that a flood of hung-up requests
/// cannot grow memory without bound.
const MAX_ORPHANS: usize = 4096;

/// The claims of one store whose callers stopped waiting.
#[derive(Default)]
pub(crate) struct Orphans {
    claims: parking_lot::Mutex<Vec<Claim>>,
    /// `claims.len()`, read without the lock on every claim.
    count: AtomicUsize,
}

impl Orphans {
    /// Keeps `claim`, whose caller stopped waiting for it.
    pub(crate) fn adopt(&self, claim: Claim) {
        let mut claims = self.claims.lock();
        claims.push(claim);
        if claims.len() > MAX_ORPHANS {
            drop(claims.remove(0));
            tracing::warn!(
                max = MAX_ORPHANS,
                "too many abandoned claims in flight; the oldest is forgotten, its lease lapses"
            );
        }
        self.count.store(claims.len(), Ordering::SeqCst);
    }

    /// Polls every kept claim once, without waiting, and returns the
    /// writes that give back the leases the decided ones acquired (see the
    /// module docs). Claims not yet decided stay kept.
    pub(crate) fn collect(&self) -> Vec<(Key, Op)> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return Vec::new();
        }
        let mut cx = Context::from_waker(Waker::noop());
        let mut leases = Vec::new();
        let mut claims = self.claims.lock();
        claims.retain_mut(|claim| match claim.as_mut().poll(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Ok(ClaimOutcome::Acquired(lease))) => {
                leases.push(lease);
                false
            }
            Poll::Ready(_) => false,
        });
        self.count.store(claims.len(), Ordering::SeqCst);
        drop(claims);
        leases.into_iter().filter_map(give_back).collect()
    }
}

/// The write that gives `lease` back as its claim found the key; `None`
/// for a takeover of a lapsed lease, left to lapse. The failure given back
/// is the one stored already, written as it is (not checked against the
/// store's limit again).
fn give_back(lease: Lease) -> Option<(Key, Op)> {
    let token = lease.token();
    let op = match lease.acquired_from()? {
        AcquiredFrom::Absent => Op::Release { token },
        AcquiredFrom::RetryableFailure => Op::Fail {
            token,
            failure: lease
                .record()
                .and_then(|r| r.output.clone())
                .unwrap_or_default(),
            retryable: true,
        },
        AcquiredFrom::LapsedLease => return None,
    };
    Some((lease.key().clone(), op))
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
