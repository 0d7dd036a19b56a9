//! A read-ahead buffer under TLS.
//!
//! rustls asks its transport for at most 4 KiB at a time, so a TLS stream
//! carrying bulk data makes four or five `recv` calls per 16 KiB record. Under
//! the TLS layer, [`ReadAhead`] turns those small reads into one large read
//! of whatever the socket has, and serves the small ones from memory.
//!
//! The buffer exists only while bulk data flows. Small traffic (a request,
//! a response head) is read straight into the caller's buffer: no copy, and
//! no 64 KiB allocation per request (a profile of keep-alive HTTP showed
//! 4 % of the edge's CPU in the malloc and free of buffers that held one
//! request each). A read that fills the caller's buffer says more is waiting:
//! from then on reads go through the buffer, until a read comes back small
//! and the buffer is drained; so thousands of idle request/response
//! connections cost nothing.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, ReadBuf};
use tokio_util::io::poll_read_buf;

/// Size of one read from the socket.
pub const READ_AHEAD: usize = 64 * 1024;

pub struct ReadAhead<S> {
    inner: S,
    /// Bytes read and not yet served; no capacity while idle.
    buf: BytesMut,
    /// The last read from the socket filled a good part of the buffer.
    busy: bool,
}

impl<S> ReadAhead<S> {
    pub fn new(inner: S) -> Self {
        ReadAhead { inner, buf: BytesMut::new(), busy: false }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadAhead<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.buf.is_empty() {
            let room = out.remaining();
            if !this.busy || room >= READ_AHEAD {
                // Small traffic, or a read as large as ours: straight into the
                // caller's buffer (and whatever capacity is left goes).
                this.buf = BytesMut::new();
                let before = out.filled().len();
                std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, out))?;
                // Filled to the brim: more is waiting; read ahead from now on.
                this.busy = out.filled().len() - before == room && room < READ_AHEAD;
                return Poll::Ready(Ok(()));
            }
            // Reuses the allocation when it is still there (no zero-filling).
            this.buf.reserve(READ_AHEAD);
            match poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf) {
                Poll::Ready(Ok(0)) => {
                    this.buf = BytesMut::new();
                    return Poll::Ready(Ok(())); // EOF
                }
                Poll::Ready(Ok(n)) => this.busy = n >= READ_AHEAD / 4,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        let n = out.remaining().min(this.buf.len());
        out.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

crate::tunnel::write_through_inner!(ReadAhead);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read() {
        let (mut w, r) = tokio::io::duplex(256 * 1024);
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        w.write_all(&data).await.unwrap();
        drop(w);
        let mut r = ReadAhead::new(r);
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = r.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
            if got.len() == 2 * 4096 {
                // The first read filled the caller's buffer; the second
                // pulled a whole buffer's worth.
                assert_eq!(r.buf.len(), READ_AHEAD - 4096);
            }
        }
        assert!(got == data);
        assert_eq!(r.buf.capacity(), 0, "the buffer is dropped at EOF");
    }

    #[tokio::test]
    async fn small_traffic_never_allocates_the_buffer() {
        let (mut w, r) = tokio::io::duplex(1024);
        let mut r = ReadAhead::new(r);
        for _ in 0..3 {
            w.write_all(b"hello").await.unwrap();
            let mut b = [0u8; 4096];
            assert_eq!(r.read(&mut b).await.unwrap(), 5);
            assert_eq!(&b[..5], b"hello");
            assert_eq!(r.buf.capacity(), 0, "a small read goes straight to the caller");
        }
    }

    #[tokio::test]
    async fn an_idle_stream_holds_no_buffer() {
        let (mut w, r) = tokio::io::duplex(256 * 1024);
        let mut r = ReadAhead::new(r);
        // Bulk first: the buffer is in use.
        w.write_all(&vec![7u8; 100_000]).await.unwrap();
        let mut chunk = [0u8; 4096];
        let mut got = 0;
        while got < 100_000 {
            got += r.read(&mut chunk).await.unwrap();
            if got == 2 * 4096 {
                assert!(r.buf.capacity() >= READ_AHEAD - 4096);
            }
        }
        // Then a small message, and nothing more: the next read is pending
        // and the buffer is gone.
        w.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        r.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hello");
        let mut one = [0u8; 1];
        let pending = tokio::time::timeout(std::time::Duration::from_millis(20), r.read(&mut one)).await;
        assert!(pending.is_err());
        assert_eq!(r.buf.capacity(), 0);
    }
}
