//! Closes public connections that say nothing: the first byte must arrive
//! within [`HEADER_READ_TIMEOUT`] of the TLS handshake, and a connection
//! with no byte either way for [`PUBLIC_IDLE_TIMEOUT`] is closed, so idle
//! sockets cannot hold the connection slots.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::constants::{HEADER_READ_TIMEOUT, PUBLIC_IDLE_TIMEOUT};

pub struct IdleTimeout<S> {
    inner: S,
    deadline: Pin<Box<Sleep>>,
    started: bool,
}

impl<S> IdleTimeout<S> {
    pub fn new(inner: S) -> Self {
        IdleTimeout { inner, deadline: Box::pin(tokio::time::sleep(HEADER_READ_TIMEOUT)), started: false }
    }

    fn touch(&mut self) {
        self.started = true;
        self.deadline.as_mut().reset(Instant::now() + PUBLIC_IDLE_TIMEOUT);
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
                if this.deadline.as_mut().poll(cx).is_ready() {
                    let what = if this.started { "idle" } else { "silent after the handshake" };
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
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) && this.started {
            this.touch();
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) && this.started {
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
    }
}
