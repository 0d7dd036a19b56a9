//! A read-ahead buffer under TLS.
//!
//! rustls asks its transport for at most 4 KiB at a time, so a TLS stream
//! carrying bulk data makes four or five `recv` calls per 16 KiB record. Under
//! the TLS layer, [`ReadAhead`] turns those small reads into one large read
//! of whatever the socket has, and serves the small ones from memory.
//!
//! The buffer exists only while bulk data flows: it is dropped when it is
//! drained, the socket has nothing more and the last read was small, so
//! thousands of idle request/response connections cost nothing.

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
            if out.remaining() >= READ_AHEAD {
                // A large read gains nothing from the buffer.
                this.buf = BytesMut::new();
                return Pin::new(&mut this.inner).poll_read(cx, out);
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
                Poll::Pending => {
                    // Nothing to read. Unless bulk data is flowing (then
                    // more comes soon), the connection may stay idle for long.
                    if !this.busy {
                        this.buf = BytesMut::new();
                    }
                    return Poll::Pending;
                }
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
            if got.len() == 4096 {
                // The first small read pulled a whole buffer's worth.
                assert_eq!(r.buf.len(), READ_AHEAD - 4096);
            }
        }
        assert!(got == data);
        assert_eq!(r.buf.capacity(), 0, "the buffer is dropped at EOF");
    }

    #[tokio::test]
    async fn an_idle_stream_holds_no_buffer() {
        let (mut w, r) = tokio::io::duplex(1024);
        let mut r = ReadAhead::new(r);
        w.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 5];
        r.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hello");
        // Nothing more to read: the next read is pending and frees the buffer.
        let mut one = [0u8; 1];
        let pending = tokio::time::timeout(std::time::Duration::from_millis(20), r.read(&mut one)).await;
        assert!(pending.is_err());
        assert_eq!(r.buf.capacity(), 0);
    }
}
