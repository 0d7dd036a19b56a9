//! Closes public connections that say nothing: the first byte must arrive
//! within [`HEADER_READ_TIMEOUT`] of the TLS handshake, and a connection
//! with no byte either way for [`PUBLIC_IDLE_TIMEOUT`] is closed, so idle
//! sockets cannot hold the connection slots.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::constants::{HEADER_READ_TIMEOUT, PUBLIC_IDLE_TIMEOUT};

pub struct IdleTimeout<S> {
    inner: S,
    /// When the connection may be closed, unless a byte came since: moved
    /// on only when it fires (a timer reset per read and write was ~1 % of
    /// a proxied request's instructions).
    deadline: Pin<Box<Sleep>>,
    /// The last byte either way, once the first has come.
    last: Option<Instant>,
    /// The waker the deadline was last polled with: it wakes that task
    /// when it fires, so the same task need not poll it again until then.
    registered: Option<Waker>,
}

impl<S> IdleTimeout<S> {
    pub fn new(inner: S) -> Self {
        IdleTimeout {
            inner,
            deadline: Box::pin(tokio::time::sleep(HEADER_READ_TIMEOUT)),
            last: None,
            registered: None,
        }
    }

    fn touch(&mut self) {
        self.last = Some(Instant::now());
    }

    /// Whether the connection has been silent too long; registers `cx` for
    /// the deadline otherwise.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        // Polling the timer at every wait for input was ~1 % of a proxied
        // request's instructions; it has this task's waker until it fires.
        if self.registered.as_ref().is_some_and(|w| w.will_wake(cx.waker())) && !self.deadline.is_elapsed() {
            return false;
        }
        while self.deadline.as_mut().poll(cx).is_ready() {
            match self.last {
                Some(last) if last + PUBLIC_IDLE_TIMEOUT > self.deadline.deadline() => {
                    self.deadline.as_mut().reset(last + PUBLIC_IDLE_TIMEOUT);
                }
                _ => return true,
            }
        }
        self.registered = Some(cx.waker().clone());
        false
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleTimeout<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.touch();
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if this.expired(cx) {
                    let what = if this.last.is_some() { "idle" } else { "silent after the handshake" };
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("connection {what}"),
                    )));
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) && this.last.is_some() {
            this.touch();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_is_closed() {
        let (_client, server) = tokio::io::duplex(64);
        let mut s = IdleTimeout::new(server);
        let mut buf = [0u8; 8];
        let err = s.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn traffic_keeps_it_open_until_idle() {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(64);
        let mut s = IdleTimeout::new(server);
        client.write_all(b"GET").await.unwrap();
        let mut buf = [0u8; 3];
        s.read_exact(&mut buf).await.unwrap();
        let started = Instant::now();
        let err = s.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= PUBLIC_IDLE_TIMEOUT);
        assert!(started.elapsed() < PUBLIC_IDLE_TIMEOUT + std::time::Duration::from_millis(10));
    }

    /// A connection read by one task, then handed to another (an upgraded
    /// one, to the tunnel's task): the deadline wakes the task that reads now.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_follows_the_connection_to_another_task() {
        let (_client, server) = tokio::io::duplex(64);
        let mut s = IdleTimeout::new(server);
        let mut buf = [0u8; 8];
        let first = tokio::time::timeout(HEADER_READ_TIMEOUT / 2, s.read(&mut buf)).await;
        assert!(first.is_err(), "nothing to read yet");
        let other = tokio::spawn(async move { s.read(&mut buf).await.map(|_| ()) });
        let ended = tokio::time::timeout(HEADER_READ_TIMEOUT, other).await.expect("the other task was woken");
        assert_eq!(ended.unwrap().unwrap_err().kind(), io::ErrorKind::TimedOut);
    }

    /// Bytes either way, each short of the timeout, keep a connection open
    /// past it; it closes one timeout after the last.
    #[tokio::test(start_paused = true)]
    async fn reads_and_writes_move_the_deadline() {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(64);
        let mut s = IdleTimeout::new(server);
        let opened = Instant::now();
        let reader = async {
            let mut buf = [0u8; 8];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) => return (Ok(()), s),
                    Ok(_) => s.write_all(b"ok").await.unwrap(),
                    Err(e) => return (Err(e), s),
                }
            }
        };
        let writer = async {
            let step = PUBLIC_IDLE_TIMEOUT * 2 / 3;
            let mut last = opened;
            for _ in 0..4 {
                client.write_all(b"x").await.unwrap();
                let mut ok = [0u8; 2];
                client.read_exact(&mut ok).await.unwrap();
                last = Instant::now();
                tokio::time::sleep(step).await;
            }
            (last, client)
        };
        let ((end, _s), (last, _client)) = tokio::join!(reader, writer);
        assert_eq!(end.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert!(opened.elapsed() > PUBLIC_IDLE_TIMEOUT * 2);
        let idle = last.elapsed();
        assert!(
            idle >= PUBLIC_IDLE_TIMEOUT && idle < PUBLIC_IDLE_TIMEOUT + std::time::Duration::from_millis(10),
            "{idle:?}"
        );
    }
}

/// Watches one spliced connection (a TCP reservation's client, an upgraded
/// HTTP connection): every byte either way, and half-closes. Its
/// [`expired`](Activity::expired) runs on a timer of its own, whether or not
/// anything reads: a connection silent for `idle`, or silent for
/// `half_close` once either side has half-closed (a peer that ignores the
/// half-close), is ended, and so is one whose reads or writes failed (a
/// client that reset it: nothing more can pass either way, so neither bound
/// is waited for); [`close`](Activity::close) then fails the reads still
/// pending elsewhere (the request body a tunnel stream is reading).
#[derive(Clone)]
pub struct Activity(std::sync::Arc<ActivityInner>);

/// [`ActivityInner::half_closed`]'s bits.
const READ_END: u8 = 1;
const WRITE_END: u8 = 2;
const FAILED: u8 = 4;

struct ActivityInner {
    start: Instant,
    /// Milliseconds since `start` of the last byte.
    last: std::sync::atomic::AtomicU64,
    /// Bit 0: the reads saw the end; bit 1: the writes were shut down;
    /// bit 2: a read or a write failed (the connection is gone).
    half_closed: std::sync::atomic::AtomicU8,
    changed: tokio::sync::Notify,
    closed: tokio_util::sync::CancellationToken,
}

impl Default for Activity {
    fn default() -> Self {
        Activity(std::sync::Arc::new(ActivityInner {
            start: Instant::now(),
            last: Default::default(),
            half_closed: Default::default(),
            changed: tokio::sync::Notify::new(),
            closed: tokio_util::sync::CancellationToken::new(),
        }))
    }
}

impl Activity {
    fn touch(&self) {
        let ms = self.0.start.elapsed().as_millis() as u64;
        self.0.last.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn half_close(&self, bit: u8) {
        if self.0.half_closed.fetch_or(bit, std::sync::atomic::Ordering::AcqRel) & bit == 0 {
            self.0.changed.notify_one();
        }
    }

    /// Ends the connection: pending and later reads through [`Tracked`] fail.
    pub fn close(&self) {
        self.0.closed.cancel();
    }

    /// Resolves when the connection has been silent too long; says why.
    pub async fn expired(&self, idle: std::time::Duration, half_close: std::time::Duration) -> &'static str {
        use std::sync::atomic::Ordering;
        loop {
            let closed = self.0.half_closed.load(Ordering::Acquire);
            if closed & FAILED != 0 {
                return "failed";
            }
            if closed == READ_END | WRITE_END {
                return "closed both ways";
            }
            let half = closed != 0;
            let limit = if half { half_close.min(idle) } else { idle };
            let last = self.0.start + std::time::Duration::from_millis(self.0.last.load(Ordering::Relaxed));
            // After a half-close the bound counts from then at the latest.
            let deadline = last + limit;
            if Instant::now() >= deadline {
                return if half { "half-closed and silent" } else { "idle" };
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = self.0.changed.notified() => { self.touch(); }
            }
        }
    }

    /// `io`, watched by this.
    pub fn track<S>(&self, io: S) -> Tracked<S> {
        Tracked {
            inner: io,
            activity: self.clone(),
            closed: Box::pin(self.0.closed.clone().cancelled_owned()),
        }
    }
}

/// An IO watched by an [`Activity`].
pub struct Tracked<S> {
    inner: S,
    activity: Activity,
    closed: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closed.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection ended: silent too long",
            )));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        match &r {
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.activity.touch(),
            Poll::Ready(Ok(())) if buf.remaining() > 0 => this.activity.half_close(READ_END),
            Poll::Ready(Err(_)) => this.activity.half_close(FAILED),
            _ => {}
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        match r {
            Poll::Ready(Ok(n)) if n > 0 => this.activity.touch(),
            Poll::Ready(Err(_)) => this.activity.half_close(FAILED),
            _ => {}
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        if let Poll::Ready(Err(_)) = r {
            this.activity.half_close(FAILED);
        }
        r
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        match r {
            Poll::Ready(Ok(())) => this.activity.half_close(WRITE_END),
            Poll::Ready(Err(_)) => this.activity.half_close(FAILED),
            Poll::Pending => {}
        }
        r
    }
}

#[cfg(test)]
mod activity_tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn a_half_close_shortens_the_bound_without_any_read() {
        let (mut client, server) = tokio::io::duplex(64);
        let activity = Activity::default();
        let mut s = activity.track(server);
        client.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.unwrap();
        client.shutdown().await.unwrap();
        assert_eq!(s.read(&mut b).await.unwrap(), 0);
        let started = Instant::now();
        // Nothing reads from here on: the timer runs anyway.
        let why = activity.expired(Duration::from_secs(3600), Duration::from_secs(5)).await;
        assert_eq!(why, "half-closed and silent");
        assert!(started.elapsed() <= Duration::from_secs(6), "{:?}", started.elapsed());
        activity.close();
        assert!(s.read(&mut b).await.is_err(), "reads fail once closed");
    }

    #[tokio::test(start_paused = true)]
    async fn closed_both_ways_ends_at_once() {
        let (mut client, server) = tokio::io::duplex(64);
        let activity = Activity::default();
        let mut s = activity.track(server);
        client.shutdown().await.unwrap();
        let mut b = [0u8; 1];
        assert_eq!(s.read(&mut b).await.unwrap(), 0);
        s.shutdown().await.unwrap();
        let started = Instant::now();
        let why = activity.expired(Duration::from_secs(3600), Duration::from_secs(5)).await;
        assert_eq!((why, started.elapsed()), ("closed both ways", Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_write_or_read_ends_it_at_once() {
        // The peer is gone (a reset): writes fail, and nothing more can pass.
        let (client, server) = tokio::io::duplex(64);
        let activity = Activity::default();
        let mut s = activity.track(server);
        drop(client);
        assert!(s.write_all(b"x").await.is_err());
        let started = Instant::now();
        let why = activity.expired(Duration::from_secs(3600), Duration::from_secs(60)).await;
        assert_eq!((why, started.elapsed()), ("failed", Duration::ZERO));

        struct Reset;
        impl AsyncRead for Reset {
            fn poll_read(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
                _: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()))
            }
        }
        let activity = Activity::default();
        let mut s = activity.track(Reset);
        assert!(s.read(&mut [0u8; 8]).await.is_err());
        let why = activity.expired(Duration::from_secs(3600), Duration::from_secs(60)).await;
        assert_eq!((why, started.elapsed()), ("failed", Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_is_idle_after_the_idle_bound() {
        let activity = Activity::default();
        let started = Instant::now();
        let why = activity.expired(Duration::from_secs(60), Duration::from_secs(5)).await;
        assert_eq!(why, "idle");
        assert!(started.elapsed() >= Duration::from_secs(60));
    }
}
