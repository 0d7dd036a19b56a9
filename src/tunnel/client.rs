//! The edge's end of a tunnel connection's HTTP/2, on h2 itself: a request is
//! sent from the task that asks, and its response read there.
//!
//! hyper's HTTP/2 client would hand each request over a channel to a task of
//! its own that opens the stream, and spawn one more task per request to wait
//! for the response head and send it back over a oneshot: two more wake-ups
//! and a spawn for every request. Here the request's task opens the stream
//! and polls the response itself; only a request body that is not already
//! complete gets a task of its own, which feeds it to the stream as its
//! window allows (as in hyper).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use h2::Reason;
use http::{HeaderValue, Method, Request, Response, header};
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;
use tracing::{Instrument, debug};

use super::body::BoxBody;
use super::head::Fields;
use super::mux;
use super::stream::{Pipe, RecvBody, StreamError};
use crate::constants::{H2_CONN_WINDOW, H2_MAX_FRAME, H2_STREAM_WINDOW};

/// The largest response head the edge takes from an agent (what hyper's
/// client allowed).
const MAX_HEADER_LIST: u32 = 16 * 1024;
/// What h2 holds of a stream's body beyond its window (hyper's default).
const MAX_SEND_BUFFER: usize = 1024 * 1024;
/// Streams the edge may open before the agent's settings say how many.
const INITIAL_MAX_SEND_STREAMS: usize = 100;

/// Starts HTTP/2 on a tunnel connection, the edge being the client. The
/// [`Connection`] must be polled (it reads and writes the socket) for the
/// [`Sender`] to get anywhere.
pub async fn handshake<T>(io: T) -> Result<(Sender, Connection<T>), h2::Error>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut b = h2::client::Builder::new();
    // Fixed large windows, not adaptive: with 64 KiB a burst of small DATA
    // frames trips h2's too_many_data_frames limit and closes the tunnel.
    b.initial_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONN_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .max_concurrent_reset_streams(1024)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
        .enable_push(false);
    let (send, conn) = b.handshake::<T, Bytes>(io).await?;
    let closed = Arc::new(AtomicBool::new(false));
    Ok((
        Sender { link: Link::H2(send), closed: closed.clone() },
        Connection { conn: Conn::H2(Box::new(conn)), closed },
    ))
}

/// Starts a tunnel connection's wire, the edge's end: [`handshake`] or
/// [`multiplex`].
pub async fn start<T>(io: T, wire: super::Wire) -> Result<(Sender, Connection<T>), StreamError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    match wire {
        super::Wire::H2 => Ok(handshake(io).await?),
        super::Wire::Mux => Ok(multiplex(io)),
    }
}

/// Starts the multiplexer ([`super::mux`], protocol version 2) on a tunnel
/// connection, the edge's end: the same [`Sender`], each request a stream
/// whose `Open` carries its head ([`super::head`]).
pub fn multiplex<T>(io: T) -> (Sender, Connection<T>)
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let (handle, incoming, conn) = mux::new(io, mux::Side::Edge, super::mux_config());
    // The agent opens no streams.
    drop(incoming);
    let closed = Arc::new(AtomicBool::new(false));
    (Sender { link: Link::Mux(handle), closed: closed.clone() }, Connection { conn: Conn::Mux(conn), closed })
}

/// Drives a tunnel connection's HTTP/2 (or multiplexer) until it ends; then
/// (or when dropped) its [`Sender`] reports closed.
pub struct Connection<T> {
    conn: Conn<T>,
    closed: Arc<AtomicBool>,
}

enum Conn<T> {
    /// Boxed: h2's is 1.2 KiB, the multiplexer's 0.1.
    H2(Box<h2::client::Connection<T, Bytes>>),
    Mux(mux::Connection<T>),
}

impl<T: AsyncRead + AsyncWrite + Unpin> Future for Connection<T> {
    type Output = Result<(), StreamError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let done = match &mut self.conn {
            Conn::H2(conn) => ready!(Pin::new(conn).poll(cx)).map_err(StreamError::from),
            Conn::Mux(conn) => ready!(Pin::new(conn).poll(cx)).map_err(StreamError::from),
        };
        self.closed.store(true, Ordering::Relaxed);
        Poll::Ready(done)
    }
}

impl<T> Connection<T> {
    /// Ends the connection here, for `why`: requests waiting on it fail at
    /// once, on the multiplexer with `why` in their error (h2 says only that
    /// the connection ended, when this is dropped).
    pub fn close(&mut self, why: &str) {
        self.closed.store(true, Ordering::Relaxed);
        if let Conn::Mux(conn) = &mut self.conn {
            conn.close(why);
        }
    }
}

impl<T> Drop for Connection<T> {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

/// Opens streams on one tunnel connection; cheap to clone.
#[derive(Clone)]
pub struct Sender {
    link: Link,
    closed: Arc<AtomicBool>,
}

#[derive(Clone)]
enum Link {
    H2(h2::client::SendRequest<Bytes>),
    Mux(mux::Handle),
}

/// A request that failed, and the request itself when the connection never
/// took it (it was closing): it can be placed on another connection. A
/// request without a body that was sent but got no answer leaves its head
/// ([`SendError::take_replay`]), so that it can be placed again too.
#[derive(Debug)]
pub struct SendError {
    error: StreamError,
    request: Option<Request<BoxBody>>,
    replay: Option<http::request::Parts>,
    /// A head sent as text ([`Sender::send_head`]) may go out again.
    again: bool,
}

impl SendError {
    fn new(error: StreamError) -> SendError {
        SendError { error, request: None, replay: None, again: false }
    }

    pub fn error(&self) -> &StreamError {
        &self.error
    }

    /// The request, if it was never sent.
    pub fn take_message(&mut self) -> Option<Request<BoxBody>> {
        self.request.take()
    }

    /// The head of a request sent without a body that got no answer: the
    /// caller decides whether it may go out again. The multiplexer's end
    /// keeps the head it sent anyway; h2's send takes it, so it is copied
    /// there, for bodiless requests only.
    pub fn take_replay(&mut self) -> Option<http::request::Parts> {
        self.replay.take()
    }

    /// Whether the head [`Sender::send_head`] failed to place may be
    /// placed again: it was never taken, or got no answer (as
    /// [`take_message`](Self::take_message) and
    /// [`take_replay`](Self::take_replay) say of a request).
    pub fn may_send_again(&self) -> bool {
        self.again
    }
}

impl Sender {
    /// The connection has ended: nothing sent on it can get anywhere.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed) || matches!(&self.link, Link::Mux(h) if h.is_closed())
    }

    /// Opens a stream for `req` and waits for the response head. The body,
    /// unless it is already complete, is fed to the stream by a task of its
    /// own, which ends with it (or resets the stream when this future is
    /// dropped before the response came).
    pub async fn send(&self, req: Request<BoxBody>) -> Result<Response<RecvBody>, SendError> {
        self.send_with(req, &Fields::default()).await
    }

    /// [`send`](Self::send) with `extra` fields after the request's own. A
    /// request or head handed back in an error is without them.
    pub async fn send_with(
        &self,
        req: Request<BoxBody>,
        extra: &Fields,
    ) -> Result<Response<RecvBody>, SendError> {
        let (mut head, body) = req.into_parts();
        if let Some(len) = body.size_hint().exact()
            && (len != 0 || has_payload_semantics(&head.method))
            && !head.headers.contains_key(header::CONTENT_LENGTH)
        {
            head.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        let mut send = match &self.link {
            Link::H2(send) => send.clone(),
            Link::Mux(handle) => return send_mux(handle, head, body, extra).await,
        };
        // Fails only when the connection is closing; the request goes back.
        if let Err(error) = std::future::poll_fn(|cx| send.poll_ready(cx)).await {
            let request = Some(Request::from_parts(head, body));
            return Err(SendError { request, ..SendError::new(error.into()) });
        }
        let eos = body.is_end_stream();
        let replay = eos.then(|| head.clone());
        extra.append_to(&mut head.headers);
        let unanswered = |error: h2::Error, replay| SendError { replay, ..SendError::new(error.into()) };
        let (response, body_tx) = match send.send_request(Request::from_parts(head, ()), eos) {
            Ok(sent) => sent,
            Err(error) => return Err(unanswered(error, replay)),
        };
        let mut cancel = None;
        if !eos {
            let mut pipe = Pipe::new(body, body_tx);
            // Most small bodies are already there: no task for them.
            if std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut pipe).poll(cx))).await.is_pending() {
                let (tx, rx) = oneshot::channel();
                cancel = Some(CancelOnDrop(Some(tx)));
                tokio::spawn(PipeTask { pipe, cancel: Some(rx) }.in_current_span());
            }
        }
        let response = response.await;
        if let Some(mut c) = cancel {
            c.0 = None;
        }
        let (head, recv) = match response {
            Ok(response) => response.into_parts(),
            Err(error) => return Err(unanswered(error, replay)),
        };
        let body = RecvBody::new(recv, &head.headers);
        Ok(Response::from_parts(head, body))
    }
}

impl Sender {
    /// A request without a body whose head is already the multiplexer's
    /// text ([`super::head::encode_request`]'s form, forwarding fields and
    /// all), answered with the response head as text and the body after it:
    /// nothing is decoded on the way (the edge's HTTP/1.1 fast path reads and
    /// writes both as text). On protocol version 1 the head is decoded into
    /// an h2 request, and the answer's head encoded back. The head is the
    /// caller's to send again ([`SendError::may_send_again`]).
    pub async fn send_head(&self, head: Bytes) -> Result<(Bytes, RecvBody), SendError> {
        let again = |error: StreamError| SendError { again: true, ..SendError::new(error) };
        let handle = match &self.link {
            Link::Mux(handle) => handle,
            Link::H2(_) => {
                let invalid =
                    |e: super::head::HeadError| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
                let head =
                    super::head::decode_request(&head).map_err(|e| SendError::new(invalid(e).into()))?;
                let request = Request::from_parts(head, super::body::empty());
                let (head, body) = match self.send(request).await {
                    Ok(response) => response.into_parts(),
                    Err(mut e) => {
                        e.again = e.take_message().is_some() || e.take_replay().is_some();
                        return Err(e);
                    }
                };
                return Ok((super::head::encode_response(&head), body));
            }
        };
        let mut stream = handle.open_with(head, true).await.map_err(|e| {
            // A head too large goes nowhere else either.
            let refused = e.kind() == std::io::ErrorKind::InvalidInput;
            SendError { again: !refused, ..SendError::new(e.into()) }
        })?;
        match stream.recv_chunk().await {
            Ok(Some(mux::Chunk::Head(block))) => Ok((block, RecvBody::mux_text(stream))),
            Ok(_) => Err(again(no_head())),
            Err(e) => Err(again(super::stream::mux_error(&stream, e))),
        }
    }
}

/// An agent that answered a stream with bytes, or nothing, before a head.
fn no_head() -> StreamError {
    std::io::Error::new(std::io::ErrorKind::InvalidData, "the agent answered without a head").into()
}

/// [`Sender::send`] on the multiplexer: the head in the stream's `Open`
/// (the stream half-closed with it when there is no body), the body fed
/// from the request's own task while the response head is awaited (a body
/// hyper reads from the public connection in that same task goes on with no
/// hand-off to another task per chunk), and by a task of its own after that
/// if it has not ended; the response head is the first header block back.
async fn send_mux(
    handle: &mux::Handle,
    head: http::request::Parts,
    body: BoxBody,
    extra: &Fields,
) -> Result<Response<RecvBody>, SendError> {
    let eos = body.is_end_stream();
    let stream = match handle.open_with(super::head::encode_request(&head, extra), eos).await {
        Ok(stream) => stream,
        Err(e) => {
            // A head too large goes nowhere else either.
            let request =
                (e.kind() != std::io::ErrorKind::InvalidInput).then(|| Request::from_parts(head, body));
            return Err(SendError { request, ..SendError::new(e.into()) });
        }
    };
    let (recv, send) = stream.split();
    if eos {
        // A bodiless request's head is still here: it can be placed again.
        return response_of(recv)
            .await
            .map_err(|error| SendError { replay: Some(head), ..SendError::new(error) });
    }
    // Given up before the response head (dropped, or failed), the body's
    // half goes with the rest of the stream, which is then reset.
    let mut pipe = Some(Box::pin(super::stream::pipe_mux(body, send)));
    let mut response = std::pin::pin!(response_of(recv));
    let response = std::future::poll_fn(|cx| {
        if let Some(feed) = &mut pipe
            && let Poll::Ready(fed) = feed.as_mut().poll(cx)
        {
            if let Err(e) = fed {
                debug!(error = %e, "request body to the tunnel ended");
            }
            pipe = None;
        }
        response.as_mut().poll(cx)
    })
    .await
    .map_err(SendError::new)?;
    if let Some(feed) = pipe {
        tokio::spawn(
            async move {
                if let Err(e) = feed.await {
                    debug!(error = %e, "request body to the tunnel ended");
                }
            }
            .in_current_span(),
        );
    }
    Ok(response)
}

/// The first header block back on a stream, as the response head.
async fn response_of(mut recv: mux::Stream) -> Result<Response<RecvBody>, StreamError> {
    let invalid =
        |e: crate::BoxError| StreamError::from(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
    let block = match recv.recv_chunk().await {
        Ok(Some(mux::Chunk::Head(block))) => block,
        Ok(_) => return Err(no_head()),
        Err(e) => return Err(super::stream::mux_error(&recv, e)),
    };
    let head = super::head::decode_response(&block).map_err(|e| invalid(e.into()))?;
    // Held to h2's limit here too.
    if super::head::response_list_size(&head) > MAX_HEADER_LIST as usize {
        return Err(invalid("the response head is over 16 KiB".into()));
    }
    let body = RecvBody::mux(recv, &head.headers);
    Ok(Response::from_parts(head, body))
}

/// Methods whose request body means something even when empty (an empty
/// body of theirs is sent as `content-length: 0`, as hyper does).
pub(crate) fn has_payload_semantics(method: &Method) -> bool {
    !matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::CONNECT | Method::TRACE
    )
}

/// Tells a body's [`PipeTask`] to reset the stream, when dropped armed (the
/// request was given up before its response came).
struct CancelOnDrop(Option<oneshot::Sender<()>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// A [`Pipe`] in a task of its own, reset when the request is given up.
struct PipeTask {
    pipe: Pipe,
    cancel: Option<oneshot::Receiver<()>>,
}

impl Future for PipeTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let me = self.get_mut();
        if let Some(rx) = &mut me.cancel
            && let Poll::Ready(given_up) = Pin::new(rx).poll(cx)
        {
            me.cancel = None;
            if given_up.is_ok() {
                me.pipe.tx.send_reset(Reason::CANCEL);
                return Poll::Ready(());
            }
        }
        if let Err(e) = ready!(Pin::new(&mut me.pipe).poll(cx)) {
            debug!(error = %e, "request body to the tunnel ended");
        }
        Poll::Ready(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use hyper::body::Frame;
    use tokio::sync::mpsc;

    use super::*;
    use crate::BoxError;
    use crate::tunnel::{Wire, body};

    /// What the agent's end saw of one request: its head, its body or the
    /// error it ended in (a reset), its trailers.
    type Seen = (http::request::Parts, Result<Bytes, String>, Option<http::HeaderMap>);

    /// A tunnel connection whose agent end ([`crate::tunnel::server`]) reports
    /// each request and answers with `respond`'s body once it has read the
    /// request's body.
    async fn tunnel(wire: Wire, respond: fn() -> BoxBody) -> (Sender, mpsc::UnboundedReceiver<Seen>) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (seen_tx, seen) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let svc = move |req: Request<RecvBody>| {
                let seen_tx = seen_tx.clone();
                async move {
                    let (parts, body) = req.into_parts();
                    let seen: Seen = match body.collect().await {
                        Ok(b) => {
                            let trailers = b.trailers().cloned();
                            (parts, Ok(b.to_bytes()), trailers)
                        }
                        Err(e) => (parts, Err(e.to_string()), None),
                    };
                    let _ = seen_tx.send(seen);
                    Response::new(respond())
                }
            };
            let _ = crate::tunnel::server::serve_wire(server, wire, svc, std::future::pending()).await;
        });
        let (send, conn) = start(client, wire).await.unwrap();
        tokio::spawn(conn);
        (send, seen)
    }

    fn request(method: Method, body: BoxBody) -> Request<BoxBody> {
        let mut r = Request::new(body);
        *r.method_mut() = method;
        *r.uri_mut() = http::Uri::from_static("https://app.test/x");
        r
    }

    #[tokio::test]
    async fn bodies_cross_both_ways_beyond_the_windows() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            // 1 MiB each way: four times a stream's window, so both ends must
            // hand the window back as they read.
            fn big() -> BoxBody {
                body::full(vec![7u8; 1 << 20])
            }
            let (send, mut seen) = tunnel(wire, big).await;
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            let upload = body::boxed(http_body_util::StreamBody::new(tokio_stream_of(rx)));
            let feed = tokio::spawn(async move {
                for _ in 0..16 {
                    tx.send(Ok(Frame::data(Bytes::from(vec![1u8; 64 * 1024])))).await.unwrap();
                }
            });
            let resp = send.send(request(Method::POST, upload)).await.unwrap();
            feed.await.unwrap();
            let (_, got, _) = seen.recv().await.unwrap();
            assert_eq!(got.unwrap().len(), 1 << 20);
            assert_eq!(resp.body().size_hint().exact(), Some(1 << 20), "content-length carried");
            let down = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(down.len(), 1 << 20);
            assert!(down.iter().all(|b| *b == 7));
        }
    }

    #[tokio::test]
    async fn trailers_cross_both_ways() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            // gRPC's way: data, then trailers, in each direction.
            fn with_trailers() -> BoxBody {
                let mut t = http::HeaderMap::new();
                t.insert("grpc-status", HeaderValue::from_static("0"));
                let frames: Vec<Result<_, BoxError>> =
                    vec![Ok(Frame::data(Bytes::from_static(b"reply"))), Ok(Frame::trailers(t))];
                body::boxed(http_body_util::StreamBody::new(futures_util::stream::iter(frames)))
            }
            let (send, mut seen) = tunnel(wire, with_trailers).await;
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(2);
            let mut t = http::HeaderMap::new();
            t.insert("x-checksum", HeaderValue::from_static("abc"));
            tx.send(Ok(Frame::data(Bytes::from_static(b"ask")))).await.unwrap();
            tx.send(Ok(Frame::trailers(t))).await.unwrap();
            drop(tx);
            let upload = body::boxed(http_body_util::StreamBody::new(tokio_stream_of(rx)));
            let resp = send.send(request(Method::POST, upload)).await.unwrap();
            let (_, body, trailers) = seen.recv().await.unwrap();
            assert_eq!(body.unwrap(), "ask");
            assert_eq!(trailers.expect("request trailers").get("x-checksum").unwrap(), "abc");
            let got = resp.into_body().collect().await.unwrap();
            assert_eq!(got.trailers().unwrap().get("grpc-status").unwrap(), "0");
            assert_eq!(got.to_bytes(), "reply");
        }
    }

    /// An agent's end that answers at once, echoing the request's body as it
    /// comes (as a WebSocket or gRPC bidirectional stream would).
    #[tokio::test]
    async fn a_body_goes_on_after_an_early_answer() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (client, server) = tokio::io::duplex(64 * 1024);
            tokio::spawn(async move {
                let echo =
                    |req: Request<RecvBody>| async move { Response::new(body::boxed(req.into_body())) };
                let _ = crate::tunnel::server::serve_wire(server, wire, echo, std::future::pending()).await;
            });
            let (send, conn) = start(client, wire).await.unwrap();
            tokio::spawn(conn);
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            let upload = body::boxed(http_body_util::StreamBody::new(tokio_stream_of(rx)));
            // The answer's head comes before any of the body was sent.
            let resp = send.send(request(Method::POST, upload)).await.unwrap();
            let mut echoed = resp.into_body();
            for part in [&b"one"[..], b"two", b"three"] {
                tx.send(Ok(Frame::data(Bytes::from_static(part)))).await.unwrap();
                let frame = tokio::time::timeout(Duration::from_secs(10), echoed.frame()).await.unwrap();
                assert_eq!(frame.unwrap().unwrap().into_data().unwrap(), part);
            }
            drop(tx);
            // The body's end crossed too (h2 may carry it in an empty DATA frame).
            let rest = tokio::time::timeout(Duration::from_secs(10), echoed.collect()).await.unwrap();
            assert_eq!(rest.unwrap().to_bytes(), "");
        }
    }

    #[tokio::test]
    async fn an_empty_post_says_content_length_0_and_a_get_says_nothing() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (send, mut seen) = tunnel(wire, body::empty).await;
            send.send(request(Method::POST, body::empty())).await.unwrap();
            let (parts, _, _) = seen.recv().await.unwrap();
            assert_eq!(parts.headers.get(header::CONTENT_LENGTH).unwrap(), "0");
            send.send(request(Method::GET, body::empty())).await.unwrap();
            let (parts, _, _) = seen.recv().await.unwrap();
            assert!(parts.headers.get(header::CONTENT_LENGTH).is_none());
        }
    }

    #[tokio::test]
    async fn a_request_given_up_before_its_response_resets_its_stream() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (send, mut seen) = tunnel(wire, body::empty).await;
            // A body that never ends: the agent's end waits for it, the response never comes.
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            tx.send(Ok(Frame::data(Bytes::from_static(b"part")))).await.unwrap();
            let upload = body::boxed(http_body_util::StreamBody::new(tokio_stream_of(rx)));
            let pending = send.send(request(Method::POST, upload));
            assert!(
                tokio::time::timeout(Duration::from_millis(100), pending).await.is_err(),
                "no response yet"
            );
            // Given up (the future dropped): the agent's end sees its body fail.
            let seen = tokio::time::timeout(Duration::from_secs(10), seen.recv());
            let (_, got, _) = seen.await.expect("the agent's end saw the body end").unwrap();
            assert!(got.is_err(), "the stream was reset, not ended: {got:?}");
            drop(tx);
        }
    }

    /// A request the agent's end took, whose connection then went: one
    /// without a body leaves its head, to be placed again on another
    /// connection; one with a body does not (its bytes are gone).
    #[tokio::test]
    async fn a_bodiless_request_that_got_no_answer_leaves_its_head() {
        for wire in Wire::ALL {
            for with_body in [false, true] {
                eprintln!("wire: {wire:?}, with a body: {with_body}");
                let (client, server) = tokio::io::duplex(64 * 1024);
                let (took_tx, mut took) = mpsc::unbounded_channel::<()>();
                let agent = tokio::spawn(async move {
                    let svc = move |_req| {
                        let _ = took_tx.send(());
                        std::future::pending::<Response<BoxBody>>()
                    };
                    let _ =
                        crate::tunnel::server::serve_wire(server, wire, svc, std::future::pending()).await;
                });
                let (send, conn) = start(client, wire).await.unwrap();
                tokio::spawn(conn);
                let body = if with_body { body::full("upload") } else { body::empty() };
                let sending = tokio::spawn(async move { send.send(request(Method::GET, body)).await });
                took.recv().await.expect("the agent's end took the request");
                agent.abort();
                let mut err = sending.await.unwrap().expect_err("no answer came");
                assert!(err.take_message().is_none(), "it was sent");
                match err.take_replay() {
                    Some(head) => {
                        assert!(!with_body);
                        assert_eq!(
                            (head.method, head.uri.to_string()),
                            (Method::GET, "https://app.test/x".into())
                        );
                    }
                    None => assert!(with_body, "a bodiless request leaves its head"),
                }
            }
        }
    }

    /// The sender of a tunnel connection that has ended: its agent end
    /// stopped at once (GOAWAY before any stream).
    async fn closed(wire: Wire) -> Sender {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let agent = tokio::spawn(async move {
            let svc = |_req| async { Response::new(body::empty()) };
            let _ = crate::tunnel::server::serve_wire(server, wire, svc, std::future::ready(())).await;
        });
        let (send, conn) = start(client, wire).await.unwrap();
        let _ = conn.await;
        agent.await.unwrap();
        send
    }

    #[tokio::test]
    async fn a_request_on_a_closed_connection_comes_back() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let send = closed(wire).await;
            assert!(send.is_closed());
            let mut err = send.send(request(Method::GET, body::full("again"))).await.unwrap_err();
            let back = err.take_message().expect("the request comes back");
            assert_eq!(back.uri(), "https://app.test/x");
            assert_eq!(back.into_body().collect().await.unwrap().to_bytes(), "again");
        }
    }

    /// The edge's forwarding fields reach the agent after the request's own,
    /// on either wire; a request handed back is without them, as it came.
    #[tokio::test]
    async fn extra_fields_follow_the_requests_own() {
        use crate::constants::names;
        let mut extra = Fields::writer(64);
        extra.field(&names::X_FORWARDED_FOR, b"203.0.113.9").field(&names::X_FORWARDED_PORT, b"443");
        let extra = extra.finish();
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (send, mut seen) = tunnel(wire, body::empty).await;
            let mut req = request(Method::GET, body::empty());
            req.headers_mut().insert("x-own", HeaderValue::from_static("1"));
            send.send_with(req, &extra).await.unwrap();
            let (parts, _, _) = seen.recv().await.unwrap();
            let fields: Vec<_> =
                parts.headers.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect();
            assert_eq!(
                fields,
                [("x-own", "1"), ("x-forwarded-for", "203.0.113.9"), ("x-forwarded-port", "443")]
            );

            let send = closed(wire).await;
            let mut err = send.send_with(request(Method::POST, body::full("a")), &extra).await.unwrap_err();
            let back = err.take_message().expect("the request comes back");
            let names: Vec<_> = back.headers().keys().map(|n| n.as_str()).collect();
            assert_eq!(names, ["content-length"], "{wire:?}");
        }
    }

    /// A stream of body frames from a channel.
    fn tokio_stream_of(
        mut rx: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
    ) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BoxError>> + Send {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
