//! Waiting for the edge to drain or stop from a task that wakes for other
//! reasons many times a second: a public connection's. A token's
//! `cancelled()` locks the token's node and its waiter list each time it is
//! polled, and a connection's task polled it (and the other token's) at every
//! wake-up: ~1 k instructions of every request the edge forwarded.
//! [`Cancelled`] polls it only when it was the one that woke the task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// `token.cancelled()`, polled only on its first poll and after its own
/// wake-up; other polls cost an atomic swap.
pub struct Cancelled {
    inner: Pin<Box<WaitForCancellationFutureOwned>>,
    woken: Arc<Woken>,
    polled: bool,
}

/// The waker the token's future holds: it notes that it fired, then wakes
/// the task.
#[derive(Default)]
struct Woken {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Cancelled {
    pub fn new(token: &CancellationToken) -> Cancelled {
        Cancelled { inner: Box::pin(token.clone().cancelled_owned()), woken: Arc::default(), polled: false }
    }
}

impl Future for Cancelled {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        this.woken.task.register(cx.waker());
        if this.polled && !this.woken.fired.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.polled = true;
        let waker = Waker::from(this.woken.clone());
        this.inner.as_mut().poll(&mut Context::from_waker(&waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polled again and again by a task that other things wake, it ends
    /// when the token is cancelled, and wakes the task that waits on it.
    #[tokio::test]
    async fn ends_when_cancelled_and_wakes_its_task() {
        let token = CancellationToken::new();
        let mut cancelled = Cancelled::new(&token);
        for _ in 0..3 {
            assert!(futures_util::poll!(&mut cancelled).is_pending());
        }
        let waiter = tokio::spawn(cancelled);
        tokio::task::yield_now().await;
        token.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(10), waiter).await.unwrap().unwrap();
        // Cancelled before its first poll: at once.
        assert!(futures_util::poll!(Cancelled::new(&token)).is_ready());
    }
}
