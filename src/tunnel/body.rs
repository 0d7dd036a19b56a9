//! Streaming bodies between sockets and HTTP/2 streams, without buffering
//! more than one chunk.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_util::io::poll_read_buf;

use crate::BoxError;

/// The body type every tunnelled request and response uses.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Largest read from a socket into a body chunk: a little under 64 KiB,
/// so that the chunk, as one HTTP/2 DATA frame in one WebSocket frame, fits
/// the 64 KiB the TLS layer takes in one write (four full records, no
/// stray small one for the last few bytes). A stream whose window is shut
/// holds at most one such chunk beyond it (the agent's downloads).
const READ_CHUNK: usize = 64 * 1024 - 64;

/// Largest read of a [`ReadBody::charged`], whose chunks count against an
/// upload budget (`tunnel::budget`): that bounds what they hold, not the read
/// size. HTTP/2 still cuts a chunk into DATA frames of at most
/// `H2_MAX_FRAME`, so a stream's bytes take turns with other streams' frame
/// by frame; where an upload has piled up in the socket (a client faster
/// than the tunnel), one read takes four frames' worth: a quarter of the
/// reads, and of the wake-ups of the tunnel's writer and of the agent
/// (`bench/counts --path tcp`: the edge's context switches per GB uploaded
/// ~12,800 → ~4,100, its CPU ~1.1 → ~0.8 s).
const CHARGED_READ_CHUNK: usize = 256 * 1024;

pub fn empty() -> BoxBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

pub fn full(data: impl Into<Bytes>) -> BoxBody {
    Full::new(data.into()).map_err(|never| match never {}).boxed_unsync()
}

/// Any body, boxed, with its error boxed.
pub fn boxed<B>(body: B) -> BoxBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// First read size of a [`ReadBody`]; doubled up to its largest
/// ([`READ_CHUNK`] or [`CHARGED_READ_CHUNK`]) while reads fill it.
const FIRST_READ: usize = 4 * 1024;

/// A body that reads a socket (or any `AsyncRead`) until EOF.
///
/// It holds no buffer while it waits for the socket (a thousand idle TCP
/// streams cost a thousand sockets, not a thousand 64 KiB buffers), and reads
/// in chunks that grow while data keeps coming.
pub struct ReadBody<R> {
    reader: R,
    buf: BytesMut,
    chunk: usize,
    max: usize,
    done: bool,
}

impl<R> ReadBody<R> {
    /// Chunks of at most [`READ_CHUNK`].
    pub fn new(reader: R) -> Self {
        ReadBody { reader, buf: BytesMut::new(), chunk: FIRST_READ, max: READ_CHUNK, done: false }
    }

    /// Chunks of at most [`CHARGED_READ_CHUNK`], for a body whose chunks are
    /// charged to an upload budget ([`super::budget::Budgeted`]).
    pub fn charged(reader: R) -> Self {
        ReadBody { max: CHARGED_READ_CHUNK, ..ReadBody::new(reader) }
    }
}

impl<R: AsyncRead + Unpin> Body for ReadBody<R> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.buf.capacity() < this.chunk {
            this.buf.reserve(this.chunk);
        }
        // At most `chunk`: the buffer may have more room than it was asked for.
        match poll_read_buf(Pin::new(&mut this.reader), cx, &mut (&mut this.buf).limit(this.chunk)) {
            Poll::Ready(Ok(0)) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Ok(n)) => {
                if n >= this.chunk {
                    this.chunk = (this.chunk * 2).min(this.max);
                }
                Poll::Ready(Some(Ok(Frame::data(this.buf.split().freeze()))))
            }
            Poll::Ready(Err(e)) => {
                this.done = true;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => {
                // Idle: give the buffer back rather than hold it while waiting.
                this.buf = BytesMut::new();
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// What a [`LateReadBody`] reads once it arrives, and something it keeps
/// alive until it ends.
pub type Late<R> = (R, Box<dyn std::any::Any + Send>);

/// A [`ReadBody`] over a reader that arrives later (an upgraded public
/// connection exists only once its 101 went out); ends at once if the
/// reader never comes. Nothing is buffered in between.
pub struct LateReadBody<R> {
    rx: oneshot::Receiver<Late<R>>,
    body: Option<(ReadBody<R>, Box<dyn std::any::Any + Send>)>,
    done: bool,
}

impl<R> LateReadBody<R> {
    pub fn new() -> (Self, oneshot::Sender<Late<R>>) {
        let (tx, rx) = oneshot::channel();
        (LateReadBody { rx, body: None, done: false }, tx)
    }
}

impl<R: AsyncRead + Unpin> Body for LateReadBody<R> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if this.body.is_none() {
            match std::task::ready!(Pin::new(&mut this.rx).poll(cx)) {
                Ok((reader, hold)) => this.body = Some((ReadBody::charged(reader), hold)),
                Err(_) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
            }
        }
        let (body, _) = this.body.as_mut().expect("the reader arrived");
        let polled = Pin::new(body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            // Ended: what it kept alive goes now.
            this.done = true;
            this.body = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// Counts the data bytes of a body into a Prometheus counter, and keeps
/// something alive (a stream slot) for as long as the body is.
pub struct Counted<B> {
    inner: B,
    counter: Counter,
    _hold: Option<Box<dyn std::any::Any + Send>>,
}

impl<B> Counted<B> {
    pub fn new(inner: B, counter: Counter) -> Self {
        Counted { inner, counter, _hold: None }
    }

    /// Drops `value` together with the body.
    pub fn hold(mut self, value: impl std::any::Any + Send) -> Self {
        self._hold = Some(Box::new(value));
        self
    }
}

impl<B> Body for Counted<B>
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
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            this.counter.inc_by(data.len() as u64);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Writes every data frame of `body` to `writer`, then shuts the writer down
/// (half-close). Returns the bytes written.
pub async fn copy_body<B, W>(mut body: B, mut writer: W) -> io::Result<u64>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    W: AsyncWrite + Unpin,
{
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| io::Error::other(e.into()))?;
        if let Ok(data) = frame.into_data() {
            total += data.len() as u64;
            writer.write_all(&data).await?;
            writer.flush().await?;
        }
    }
    writer.shutdown().await?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The largest chunk `body` reads of 2 MiB written at once.
    async fn largest_chunk(
        mut body: ReadBody<tokio::io::DuplexStream>,
        mut w: tokio::io::DuplexStream,
    ) -> usize {
        w.write_all(&vec![1u8; 2 << 20]).await.unwrap();
        let (mut got, mut largest) = (0, 0);
        while got < 2 << 20 {
            let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
            got += data.len();
            largest = largest.max(data.len());
        }
        largest
    }

    #[tokio::test]
    async fn an_idle_body_holds_no_buffer_and_bulk_reads_grow() {
        let (mut w, r) = tokio::io::duplex(4 << 20);
        let mut body = ReadBody::new(r);
        w.write_all(&[7u8; 100]).await.unwrap();
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&data[..], &[7u8; 100][..]);
        // Nothing more to read: the buffer is given back while waiting.
        assert!(tokio::time::timeout(Duration::from_millis(20), body.frame()).await.is_err());
        assert_eq!(body.buf.capacity(), 0);
        // Reads grow while data keeps coming, up to the body's largest.
        assert_eq!(largest_chunk(body, w).await, READ_CHUNK);
        let (w, r) = tokio::io::duplex(4 << 20);
        assert_eq!(largest_chunk(ReadBody::charged(r), w).await, CHARGED_READ_CHUNK);
    }
}
