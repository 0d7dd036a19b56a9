//! Budgets of buffered payload (issue 18 item 10): what the edge holds of
//! public clients' uploads (request bodies, upgraded and TCP streams) on
//! their way into a tunnel, per tunnel connection and for the whole edge,
//! enforced by backpressure.
//!
//! A body charges its data to its tunnel connection's budget (and through it
//! to the edge's) before HTTP/2 may take it; the tunnel's byte stream gives
//! budget back as it writes bytes to the socket. When a budget is spent,
//! bodies wait: the public clients' sockets stop being read, and their bytes
//! stay in the kernel, not in the edge. An agent that announces huge windows
//! and stops reading can make the edge hold one tunnel budget, no more.
//!
//! The accounting is conservative where it matters: every byte written
//! (frame headers and other streams' frames included) gives budget back, so a
//! budget errs towards letting bytes through, never towards a stall while the
//! socket moves. Bytes HTTP/2 drops unsent (a stream reset with data queued)
//! are given back when the connection has no stream open.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker, ready};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

/// A number of bytes that may be held at once; see the module docs.
pub struct Budget {
    limit: usize,
    held: AtomicUsize,
    parent: Option<Arc<Budget>>,
    waiting: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl Budget {
    /// A budget of `limit` bytes, charged to `parent` as well.
    pub fn new(limit: usize, parent: Option<Arc<Budget>>) -> Arc<Budget> {
        Arc::new(Budget {
            limit: limit.max(1),
            held: AtomicUsize::new(0),
            parent,
            waiting: AtomicBool::new(false),
            wakers: Mutex::default(),
        })
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Takes `n` bytes from this budget and its parent, or none.
    fn try_take(&self, n: usize) -> bool {
        let took = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            // One charge larger than the whole budget passes alone.
            (held == 0 || held + n <= self.limit).then_some(held + n)
        });
        if took.is_err() {
            return false;
        }
        if let Some(parent) = &self.parent
            && !parent.try_take(n)
        {
            self.give_back(n);
            return false;
        }
        true
    }

    /// Waits until `n` bytes could be taken from this budget and its parent.
    pub fn poll_take(&self, cx: &mut Context<'_>, n: usize) -> Poll<()> {
        if self.try_take(n) {
            return Poll::Ready(());
        }
        self.register(cx);
        // Given back between the attempt and the registration?
        if self.try_take(n) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    fn register(&self, cx: &mut Context<'_>) {
        if let Some(parent) = &self.parent {
            parent.register(cx);
        }
        let mut wakers = self.wakers.lock().expect("poisoned");
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        self.waiting.store(true, Ordering::Release);
    }

    /// Gives back up to `n` bytes (bytes went out); returns how many.
    pub fn release(&self, n: usize) -> usize {
        let Ok(held) = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| (held > 0).then(|| held - held.min(n)))
        else {
            return 0;
        };
        let released = held.min(n);
        if let Some(parent) = &self.parent {
            parent.give_back(released);
        }
        self.wake();
        released
    }

    /// Gives back everything (nothing can be queued any more).
    pub fn release_all(&self) {
        self.release(usize::MAX);
    }

    fn give_back(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::AcqRel);
        self.wake();
    }

    fn wake(&self) {
        if self.waiting.swap(false, Ordering::AcqRel) {
            for w in std::mem::take(&mut *self.wakers.lock().expect("poisoned")) {
                w.wake();
            }
        }
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        // What a closed connection still held goes back to the edge.
        if let Some(parent) = &self.parent {
            parent.give_back(*self.held.get_mut());
        }
    }
}

/// Which budget a [`Budgeted`] body charges: set once the tunnel connection
/// is chosen (again on a retry), before HTTP/2 polls the body.
#[derive(Clone, Default)]
pub struct BudgetSlot(Arc<Mutex<Option<Arc<Budget>>>>);

impl BudgetSlot {
    pub fn set(&self, budget: Arc<Budget>) {
        *self.0.lock().expect("poisoned") = Some(budget);
    }

    fn get(&self) -> Option<Arc<Budget>> {
        self.0.lock().expect("poisoned").clone()
    }
}

/// A body whose data frames are charged to a budget before they are yielded.
pub struct Budgeted<B> {
    inner: B,
    slot: BudgetSlot,
    /// A data frame read from `inner`, waiting for budget.
    pending: Option<Frame<Bytes>>,
}

impl<B> Budgeted<B> {
    pub fn new(inner: B, slot: BudgetSlot) -> Self {
        Budgeted { inner, slot, pending: None }
    }
}

impl<B> Body for Budgeted<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if this.pending.is_none() {
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) if frame.data_ref().is_some_and(|d| !d.is_empty()) => {
                    this.pending = Some(frame)
                }
                other => return Poll::Ready(other),
            }
        }
        let n = this.pending.as_ref().and_then(|f| f.data_ref()).map_or(0, |d| d.len());
        if let Some(budget) = this.slot.get() {
            ready!(budget.poll_take(cx, n));
        }
        Poll::Ready(this.pending.take().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn a_budget_is_shared_with_its_parent_and_given_back_by_writes() {
        let edge = Budget::new(100, None);
        let a = Budget::new(60, Some(edge.clone()));
        let b = Budget::new(60, Some(edge.clone()));
        assert!(a.try_take(50));
        assert!(!a.try_take(20), "a's own limit");
        assert!(b.try_take(50));
        assert!(!b.try_take(1), "the edge's limit");
        assert_eq!(edge.held(), 100);
        assert_eq!(a.release(30), 30);
        assert_eq!((a.held(), edge.held()), (20, 70));
        assert!(b.try_take(10));
        assert_eq!(a.release(1000), 20, "never more than was taken");
        assert_eq!(edge.held(), 60);
        drop(b);
        assert_eq!(edge.held(), 0, "a closed connection gives its bytes back");
        let big = Budget::new(10, None);
        assert!(big.try_take(64), "one frame larger than the budget passes alone");
        assert!(!big.try_take(1));
    }

    #[tokio::test]
    async fn a_body_waits_for_budget_and_resumes_when_bytes_go_out() {
        let budget = Budget::new(10, None);
        let slot = BudgetSlot::default();
        slot.set(budget.clone());
        let chunks = futures_util::stream::iter(
            (0..3).map(|_| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"12345678")))),
        );
        let mut body = Budgeted::new(http_body_util::StreamBody::new(chunks), slot);
        assert!(body.frame().await.is_some());
        assert_eq!(budget.held(), 8);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending(), "spent: the body waits");
        budget.release(8);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_ready(), "bytes went out: the body resumes");
        assert_eq!(budget.held(), 8);
    }
}
