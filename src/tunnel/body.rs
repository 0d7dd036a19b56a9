//! Streaming bodies between sockets and HTTP/2 streams, without buffering
//! more than one chunk.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// A read from a socket into a body chunk: a little under 64 KiB, so that
/// the chunk, as one HTTP/2 DATA frame in one WebSocket frame, fits the
/// 64 KiB the TLS layer takes in one write (four full records, no stray small
/// one for the last few bytes).
const READ_CHUNK: usize = 64 * 1024 - 64;

/// A large read: where data has piled up in the socket (a sender faster than
/// the tunnel), one read takes four frames' worth. HTTP/2 still cuts the
/// chunk into DATA frames of at most `H2_MAX_FRAME`, so a stream's bytes take
/// turns with other streams' frame by frame; what it saves is three reads in
/// four, and the wake-ups of the tunnel's writer and of the peer with them
/// (`bench/counts --path tcp`: the sender's context switches per GB
/// ~12,800 → ~4,100, its CPU ~1.1 → ~0.8 s).
const LARGE_READ: usize = 256 * 1024;

/// Large chunks the [`ReadBody::new`] bodies of a process hold at once. A
/// stream whose window is shut (its public client stopped reading) keeps
/// the last chunk it read; past this many such chunks, reads stay at
/// [`READ_CHUNK`]: at most 16 MiB more than 64 KiB chunks would hold, and
/// never a wait.
const LARGE_READS: usize = 64;

/// The large chunks held, against their limit.
struct LargeReads {
    held: AtomicUsize,
    limit: usize,
}

impl LargeReads {
    const fn new(limit: usize) -> Self {
        LargeReads { held: AtomicUsize::new(0), limit }
    }

    fn try_take(&self) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1))
            .is_ok()
    }

    fn give_back(&self) {
        self.held.fetch_sub(1, Ordering::AcqRel);
    }
}

static LARGE: LargeReads = LargeReads::new(LARGE_READS);

pub fn empty() -> BoxBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

pub fn full(data: impl Into<Bytes>) -> BoxBody {
    Full::new(data.into()).map_err(|never| match never {}).boxed_unsync()
}

/// Any body, boxed, with its error boxed; a [`BoxBody`] as it is (boxed
/// again, each of its frames would be two calls through a box away, and
/// each response of the agent's backend client was).
pub fn boxed<B>(body: B) -> BoxBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Some(body);
    if let Some(boxed) = (&mut body as &mut dyn std::any::Any).downcast_mut::<Option<BoxBody>>() {
        return boxed.take().expect("just put there");
    }
    body.expect("not taken").map_err(Into::into).boxed_unsync()
}

/// First read size of a [`ReadBody`]; doubled up to [`LARGE_READ`] while
/// reads fill it.
const FIRST_READ: usize = 4 * 1024;

/// How much a body's next read of a socket takes, as data keeps coming:
/// doubled while reads fill it, to [`READ_CHUNK`], then to [`LARGE_READ`]
/// while the process holds fewer than [`LARGE_READS`] large chunks, or
/// always for a body whose chunks an upload budget bounds. Every byte path
/// that reads a socket into the tunnel sizes its reads with it: [`ReadBody`]
/// (TCP streams, upgrades) and `agent::h1` (a backend's response bodies).
pub struct ReadSize {
    chunk: usize,
    /// Where large reads are counted; `None`: charged to a budget instead.
    large: Option<&'static LargeReads>,
    /// The last chunk was a large one, counted in `large`: it is on its way
    /// until the body is polled again (the tunnel polls once it has room).
    holds_large: bool,
}

impl ReadSize {
    /// Reads from `first` bytes, large ones counted against the process's.
    pub fn new(first: usize) -> Self {
        ReadSize { chunk: first.clamp(1, READ_CHUNK), large: Some(&LARGE), holds_large: false }
    }

    /// Reads of a body whose chunks are charged to an upload budget
    /// ([`super::budget::Budgeted`]): the budget bounds what they hold, so its
    /// large reads are not counted.
    pub fn charged(first: usize) -> Self {
        ReadSize { large: None, ..ReadSize::new(first) }
    }

    /// The size of the next read; the chunk read before is on its way by now.
    /// A large read takes one of the process's large chunks, or is not large.
    pub fn next(&mut self) -> usize {
        self.give_back();
        let mut want = self.chunk;
        if want > READ_CHUNK
            && let Some(large) = self.large
        {
            if large.try_take() {
                self.holds_large = true;
            } else {
                want = READ_CHUNK;
            }
        }
        want
    }

    /// A read of `want` (at most [`next`](Self::next)'s) gave `n` bytes: the
    /// next one is larger if this one was filled (never smaller); a large
    /// chunk is held until the next.
    pub fn read(&mut self, want: usize, n: usize) {
        if n <= READ_CHUNK {
            self.give_back();
        }
        if n >= want {
            let max = if want < READ_CHUNK { READ_CHUNK } else { LARGE_READ };
            self.chunk = self.chunk.max((want * 2).min(max));
        }
    }

    /// The read found nothing, failed or ended: no chunk is held.
    pub fn give_back(&mut self) {
        if std::mem::take(&mut self.holds_large)
            && let Some(large) = self.large
        {
            large.give_back();
        }
    }
}

impl Drop for ReadSize {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// A body that reads a socket (or any `AsyncRead`) until EOF.
///
/// It holds no buffer while it waits for the socket (a thousand idle TCP
/// streams cost a thousand sockets, not a thousand 64 KiB buffers), and reads
/// in chunks that grow while data keeps coming ([`ReadSize`]).
pub struct ReadBody<R> {
    reader: R,
    buf: BytesMut,
    size: ReadSize,
    done: bool,
}

impl<R> ReadBody<R> {
    pub fn new(reader: R) -> Self {
        ReadBody { reader, buf: BytesMut::new(), size: ReadSize::new(FIRST_READ), done: false }
    }

    /// A body whose chunks are charged to an upload budget
    /// ([`super::budget::Budgeted`]): see [`ReadSize::charged`].
    pub fn charged(reader: R) -> Self {
        ReadBody { size: ReadSize::charged(FIRST_READ), ..ReadBody::new(reader) }
    }

    #[cfg(test)]
    fn counted_in(reader: R, large: Option<&'static LargeReads>) -> Self {
        ReadBody { size: ReadSize { large, ..ReadSize::new(FIRST_READ) }, ..ReadBody::new(reader) }
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
            this.size.give_back();
            return Poll::Ready(None);
        }
        let want = this.size.next();
        if this.buf.capacity() < want {
            this.buf.reserve(want);
        }
        // At most `want`: the buffer may have more room than it was asked for.
        match poll_read_buf(Pin::new(&mut this.reader), cx, &mut (&mut this.buf).limit(want)) {
            Poll::Ready(Ok(0)) => {
                this.size.give_back();
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Ok(n)) => {
                this.size.read(want, n);
                Poll::Ready(Some(Ok(Frame::data(this.buf.split().freeze()))))
            }
            Poll::Ready(Err(e)) => {
                this.size.give_back();
                this.done = true;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Pending => {
                this.size.give_back();
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
/// (half-close). Returns the bytes written. The frames ready at once are
/// written together, in one vectored write ([`poll_gather`]): a stream that
/// arrives in pieces leaves in writes as large as the backlog.
pub async fn copy_body<B, W>(mut body: B, mut writer: W) -> io::Result<u64>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    W: AsyncWrite + Unpin,
{
    let mut total = 0u64;
    let mut batch = VecDeque::new();
    loop {
        let gathered = std::future::poll_fn(|cx| poll_gather(Pin::new(&mut body), cx, &mut batch))
            .await
            .map_err(io::Error::other)?;
        total += gathered.len as u64;
        std::future::poll_fn(|cx| poll_write_all(Pin::new(&mut writer), cx, &mut batch, &mut false)).await?;
        writer.flush().await?;
        if gathered.end.is_some() {
            break;
        }
    }
    writer.shutdown().await?;
    Ok(total)
}

/// Most bytes [`poll_gather`] takes for one write.
const COPY_BATCH: usize = 256 * 1024;
/// Most frames [`poll_gather`] takes for one write.
const COPY_SLICES: usize = 64;

/// What [`poll_gather`] took.
#[derive(Debug, Default)]
pub struct Gathered {
    /// The data bytes appended.
    pub len: usize,
    /// `Some` when the body has ended, with its trailers if it had any.
    pub end: Option<Option<http::HeaderMap>>,
}

/// Appends to `batch` the data frames of `body` that are ready: it waits for
/// one (`Pending` until then), then takes those already there, up to 256 KiB
/// or 64 frames, or until the body ends. Every byte path that ends in a
/// socket writes what this gathers in one vectored write ([`copy_body`] for
/// TCP streams and upgrades, `agent::h1` for HTTP request bodies), so a body
/// whose frames pile up leaves in few large writes whatever carries it.
pub fn poll_gather<B>(
    mut body: Pin<&mut B>,
    cx: &mut Context<'_>,
    batch: &mut VecDeque<Bytes>,
) -> Poll<Result<Gathered, BoxError>>
where
    B: Body<Data = Bytes> + ?Sized,
    B::Error: Into<BoxError>,
{
    let mut taken = Gathered::default();
    while taken.len < COPY_BATCH && batch.len() < COPY_SLICES {
        match body.as_mut().poll_frame(cx) {
            Poll::Pending if taken.len == 0 => return Poll::Pending,
            Poll::Pending => break,
            Poll::Ready(None) => {
                taken.end = Some(None);
                break;
            }
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.into())),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if data.is_empty() => {}
                Ok(data) => {
                    taken.len += data.len();
                    batch.push_back(data);
                }
                Err(frame) => {
                    taken.end = Some(frame.into_trailers().ok());
                    break;
                }
            },
        }
    }
    Poll::Ready(Ok(taken))
}

/// Writes `bufs` whole, vectored, emptying it; `wrote` is set once a write
/// took any of it.
pub fn poll_write_all<W: AsyncWrite + ?Sized>(
    mut writer: Pin<&mut W>,
    cx: &mut Context<'_>,
    bufs: &mut VecDeque<Bytes>,
    wrote: &mut bool,
) -> Poll<io::Result<()>> {
    while !bufs.is_empty() {
        if bufs.len() == 1
            && let Some(one) = bufs.front_mut()
        {
            // One buffer: no slices to lay out.
            std::task::ready!(poll_write_one(writer.as_mut(), cx, one, wrote))?;
            bufs.clear();
            break;
        }
        let mut slices = [io::IoSlice::new(&[]); COPY_SLICES];
        let n = super::io_slices(bufs, &mut slices);
        let written = std::task::ready!(writer.as_mut().poll_write_vectored(cx, &slices[..n]))?;
        if written == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        *wrote = true;
        super::advance(bufs, written);
    }
    Poll::Ready(Ok(()))
}

/// Writes `buf` whole, emptying it; `wrote` is set once a write took any
/// of it.
pub fn poll_write_one<W: AsyncWrite + ?Sized>(
    mut writer: Pin<&mut W>,
    cx: &mut Context<'_>,
    buf: &mut Bytes,
    wrote: &mut bool,
) -> Poll<io::Result<()>> {
    use bytes::Buf;
    while !buf.is_empty() {
        let written = std::task::ready!(writer.as_mut().poll_write(cx, buf))?;
        if written == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        *wrote = true;
        buf.advance(written);
    }
    Poll::Ready(Ok(()))
}

/// Test helpers of the byte paths that end in a socket.
#[cfg(test)]
pub(crate) mod testing {
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::AsyncWrite;

    /// Records the bytes of each write; takes at most `max` per write.
    #[derive(Default)]
    pub struct Writes {
        pub sizes: Vec<usize>,
        pub bytes: Vec<u8>,
        pub max: usize,
        pub shut: bool,
    }

    impl Writes {
        /// A writer that takes at most `max` bytes per write.
        pub fn taking(max: usize) -> Self {
            Writes { max, ..Writes::default() }
        }

        /// The bytes of each write, in order.
        pub fn each(&self) -> Vec<&[u8]> {
            let mut at = 0;
            self.sizes
                .iter()
                .map(|n| {
                    at += n;
                    &self.bytes[at - n..at]
                })
                .collect()
        }
    }

    impl AsyncWrite for Writes {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            let this = self.get_mut();
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(this.max - n);
                this.bytes.extend_from_slice(&b[..take]);
                n += take;
            }
            this.sizes.push(n);
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            self.get_mut().shut = true;
            Poll::Ready(Ok(()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The largest chunk `body` reads of 2 MiB written at once.
    async fn largest_chunk(
        body: &mut ReadBody<tokio::io::DuplexStream>,
        w: &mut tokio::io::DuplexStream,
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
    async fn a_body_boxed_once_or_twice_keeps_its_frames_and_size() {
        let once = boxed(Full::new(Bytes::from_static(b"hello")));
        let twice = boxed(once);
        assert_eq!(twice.size_hint().exact(), Some(5));
        assert_eq!(twice.collect().await.unwrap().to_bytes(), "hello");
        let mut other =
            boxed(http_body_util::StreamBody::new(futures_util::stream::iter([Ok::<_, BoxError>(
                Frame::data(Bytes::from_static(b"a")),
            )])));
        assert_eq!(other.frame().await.unwrap().unwrap().into_data().unwrap(), "a");
        assert!(other.frame().await.is_none());
    }

    #[tokio::test]
    async fn an_idle_body_holds_no_buffer_and_bulk_reads_grow() {
        let (mut w, r) = tokio::io::duplex(4 << 20);
        let mut body = ReadBody::counted_in(r, Some(Box::leak(Box::new(LargeReads::new(1)))));
        w.write_all(&[7u8; 100]).await.unwrap();
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&data[..], &[7u8; 100][..]);
        // Nothing more to read: the buffer is given back while waiting.
        assert!(tokio::time::timeout(Duration::from_millis(20), body.frame()).await.is_err());
        assert_eq!(body.buf.capacity(), 0);
        // Reads grow while data keeps coming, to a large read.
        assert_eq!(largest_chunk(&mut body, &mut w).await, LARGE_READ);
        let (mut w, r) = tokio::io::duplex(4 << 20);
        assert_eq!(largest_chunk(&mut ReadBody::charged(r), &mut w).await, LARGE_READ);
    }

    #[test]
    fn reads_grow_when_filled_and_never_shrink_for_a_small_need() {
        let large: &'static LargeReads = Box::leak(Box::new(LargeReads::new(1)));
        let mut size = ReadSize { large: Some(large), ..ReadSize::new(64 * 1024) };
        let want = size.next();
        assert_eq!(want, READ_CHUNK, "from the first size, at most a chunk");
        size.read(want, want);
        let want = size.next();
        assert_eq!((want, large.held.load(Ordering::Relaxed)), (2 * READ_CHUNK, 1), "large, with the token");
        size.read(want, want);
        // The next read is cut to what a body still needs (a line end): it is
        // filled, but the reads after it stay large, and the token is back.
        assert_eq!(size.next(), 4 * READ_CHUNK);
        size.read(2, 2);
        assert_eq!(large.held.load(Ordering::Relaxed), 0);
        assert_eq!(size.next(), 4 * READ_CHUNK);
        // Another body finds the only token taken: its large read is a chunk.
        let mut other = ReadSize { large: Some(large), chunk: LARGE_READ, holds_large: false };
        assert_eq!(other.next(), READ_CHUNK);
        drop(size);
        assert_eq!(other.next(), LARGE_READ, "the token came back when the first was dropped");
    }

    #[tokio::test]
    async fn large_chunks_held_are_bounded_and_reads_go_on_in_small_ones() {
        let large: &'static LargeReads = Box::leak(Box::new(LargeReads::new(1)));
        let (mut wa, ra) = tokio::io::duplex(4 << 20);
        let mut a = ReadBody::counted_in(ra, Some(large));
        // `a` reads a large chunk and is not polled again (its stream's window is shut).
        wa.write_all(&vec![1u8; 1 << 20]).await.unwrap();
        while a.frame().await.unwrap().unwrap().into_data().unwrap().len() <= READ_CHUNK {}
        assert_eq!(large.held.load(Ordering::Relaxed), 1);
        let (mut wb, rb) = tokio::io::duplex(4 << 20);
        let mut b = ReadBody::counted_in(rb, Some(large));
        assert_eq!(
            largest_chunk(&mut b, &mut wb).await,
            READ_CHUNK,
            "no large read left: small ones, no wait"
        );
        // `a` goes on (or ends): its large read is given back, and `b` takes it.
        drop(a);
        assert_eq!(large.held.load(Ordering::Relaxed), 0);
        assert_eq!(largest_chunk(&mut b, &mut wb).await, LARGE_READ);
        drop(b);
        assert_eq!(large.held.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn copy_body_writes_the_frames_ready_together() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, io::Error>>(16);
        let body = http_body_util::StreamBody::new(tokio_stream_of(rx));
        for i in 0..5u8 {
            tx.send(Ok(Frame::data(Bytes::from(vec![i; 1000])))).await.unwrap();
        }
        drop(tx);
        let mut writes = testing::Writes::taking(2500);
        let n = copy_body(body, &mut writes).await.unwrap();
        assert_eq!(n, 5000);
        // The five frames there at once: one batch, in writes as large as
        // the writer takes, not one write each.
        assert_eq!(writes.sizes, [2500, 2500]);
        let want: Vec<u8> = (0..5u8).flat_map(|i| vec![i; 1000]).collect();
        assert_eq!(writes.bytes, want);
        assert!(writes.shut);
    }

    /// A stream of what `rx` receives.
    fn tokio_stream_of<T>(mut rx: tokio::sync::mpsc::Receiver<T>) -> impl futures_util::Stream<Item = T> {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
