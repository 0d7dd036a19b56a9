//! The agent's end of a tunnel connection's HTTP/2, on h2 itself (as the
//! edge's end is, [`super::client`]): every stream the edge opens is answered
//! in a task of its own, which runs the service on the request, sends the
//! response head and feeds the body to the stream ([`Pipe`]).
//!
//! hyper's HTTP/2 server did the same with more in between, all of it for
//! every request: its request body wrapped h2's, its stream task stripped
//! connection headers with one hashed lookup per name and looked for a
//! `Date`, its body pipe re-checked the stream per chunk, and the tunnel's
//! bytes went through hyper's IO traits and back into tokio's. Here the
//! response's head is only cleaned when it carries a header HTTP/2 forbids
//! (one pass over its names; the forwarding path strips them already).

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use bytes::Bytes;
use h2::Reason;
use h2::server::SendResponse;
use http::{HeaderValue, Request, Response, header};
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::task::AbortOnDropHandle;
use tracing::{Instrument, debug};

use super::body::BoxBody;
use super::head::WireHead;
use super::mux;
use super::stream::{Pipe, RecvBody, StreamError};
use crate::constants::{H2_CONN_WINDOW, H2_MAX_FRAME, H2_MAX_STREAMS, H2_STREAM_WINDOW};

/// The largest request head the agent takes from the edge (hyper's server's
/// default, which the agent had before).
const MAX_HEADER_LIST: u32 = 16 * 1024;
/// What h2 holds of a stream's response body beyond its window (hyper's
/// server's default): the agent's buffering per stream whose public client
/// does not read.
const MAX_SEND_BUFFER: usize = 400 * 1024;
/// Streams reset because of an error of this end, before the connection is
/// closed as broken (hyper's default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;

fn builder() -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    // Fixed large windows, as at the edge's end (client::handshake).
    b.initial_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONN_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        // The edge cancels a tunnel stream whenever a public client goes away
        // or resets its request, possibly before this end accepted it. h2's
        // default (20 such resets, the rapid-reset guard meant for untrusted
        // clients) would let public clients tear the tunnel down; the edge
        // keeps that guard on its public side.
        .max_pending_accept_reset_streams(H2_MAX_STREAMS as usize);
    b
}

/// Serves the HTTP/2 of a tunnel connection, the agent being the server,
/// until the edge closes it or it fails. Each request goes to `service` in a
/// task of its own; the response it returns is sent back on its stream. When
/// `stop` completes, the connection is shut down gracefully (GOAWAY: the
/// streams already open finish, no new one is taken) and this returns once
/// they have.
pub async fn serve<T, S, F>(io: T, mut service: S, stop: impl Future<Output = ()>) -> Result<(), h2::Error>
where
    T: AsyncRead + AsyncWrite + Unpin,
    S: FnMut(Request<RecvBody>) -> F,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let mut stop = pin!(stop);
    let mut conn = tokio::select! {
        conn = builder().handshake::<T, Bytes>(io) => conn?,
        _ = stop.as_mut() => return Ok(()),
    };
    let mut stopping = false;
    std::future::poll_fn(|cx| {
        if !stopping && stop.as_mut().poll(cx).is_ready() {
            stopping = true;
            conn.graceful_shutdown();
        }
        // Accepting also drives the connection: it reads and writes the socket.
        loop {
            match std::task::ready!(conn.poll_accept(cx)) {
                Some(Ok((req, respond))) => {
                    let (head, recv) = req.into_parts();
                    let body = RecvBody::new(recv, &head.headers);
                    // Boxed: a task's future is copied whole when it is
                    // spawned and again when it ends (a profile showed those
                    // copies, ~2.5 k instructions a request, beside one
                    // allocation's ~0.2 k).
                    let response = Box::pin(service(Request::from_parts(head, body)));
                    tokio::spawn(answer(response, respond));
                }
                Some(Err(e)) => return Poll::Ready(Err(e)),
                None => return Poll::Ready(Ok(())),
            }
        }
    })
    .await
}

/// Waits for a stream's response and sends it: the head, then the body as
/// the stream's window allows. A reset from the edge (its public client went
/// away) drops the response's future, whatever it was waiting for.
async fn answer<F>(response: F, mut respond: SendResponse<Bytes>)
where
    F: Future<Output = Response<BoxBody>>,
{
    let Some(response) = response_or_reset(response, |cx| respond.poll_reset(cx).map(|_| ())).await else {
        return debug!("stream reset before its response");
    };
    let (mut head, body) = response.into_parts();
    if let Err(e) = super::head::unwire(&mut head) {
        debug!(error = %e, "a response head made for the multiplexer does not parse");
        return respond.send_reset(Reason::INTERNAL_ERROR);
    }
    let eos = ready_head(&mut head, &body);
    let tx = match respond.send_response(Response::from_parts(head, ()), eos) {
        Ok(tx) => tx,
        Err(e) => {
            debug!(error = %e, "sending a response head failed");
            return respond.send_reset(Reason::INTERNAL_ERROR);
        }
    };
    if !eos && let Err(e) = Pipe::new(body, tx).await {
        debug!(error = %e, "response body to the tunnel ended");
    }
}

/// The stream's response, or `None` when the edge resets the stream first
/// (its public client went away): the response's future is dropped then,
/// whatever it was waiting for.
async fn response_or_reset<F>(
    response: F,
    mut reset: impl FnMut(&mut std::task::Context<'_>) -> Poll<()>,
) -> Option<Response<BoxBody>>
where
    F: Future<Output = Response<BoxBody>>,
{
    let mut response = pin!(response);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = response.as_mut().poll(cx) {
            return Poll::Ready(Some(r));
        }
        reset(cx).map(|()| None)
    })
    .await
}

/// Makes a response head ready to send on either wire and says whether the
/// body is already over: what HTTP/2 forbids in a head is stripped (h2
/// refuses to send one with a connection-specific header; one pass over the
/// names finds nothing in the heads the forwarding path cleaned already; the
/// multiplexer's heads are the same), a body of known length says it.
fn ready_head(head: &mut http::response::Parts, body: &BoxBody) -> bool {
    crate::http::strip_hop_by_hop(&mut head.headers);
    let eos = body.is_end_stream();
    if !eos
        && let Some(len) = body.size_hint().exact()
        && !head.headers.contains_key(header::CONTENT_LENGTH)
    {
        head.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    eos
}

/// Serves a tunnel connection's wire, the agent's end: [`serve`] or
/// [`serve_mux`].
pub async fn serve_wire<T, S, F>(
    io: T,
    wire: super::Wire,
    service: S,
    stop: impl Future<Output = ()>,
) -> Result<(), StreamError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: FnMut(Request<RecvBody>) -> F,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    match wire {
        super::Wire::H2 => Ok(serve(io, service, stop).await?),
        super::Wire::Mux => serve_mux(io, service, stop).await,
    }
}

/// [`serve`] on the multiplexer ([`super::mux`], protocol version 2): each
/// stream the edge opens is a request whose head is the stream's `Open`
/// ([`super::head`]), answered by `service` in a task of its own. When `stop`
/// completes, new streams are refused (the edge opens them elsewhere), the
/// ones open finish, and this returns once they have.
pub async fn serve_mux<T, S, F>(
    io: T,
    mut service: S,
    stop: impl Future<Output = ()>,
) -> Result<(), StreamError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: FnMut(Request<RecvBody>) -> F,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let (handle, incoming, conn) = mux::new(io, mux::Side::Agent, super::mux_config());
    // The driver in a task of its own. Polled by this loop, a stream it
    // accepted woke the task that was running it; tokio then hands that task
    // to another worker (a futex wake and a thread switch), and the request's
    // own task raced it there: two of those per request at one request at a
    // time.
    let mut conn = AbortOnDropHandle::new(tokio::spawn(conn.in_current_span()));
    let mut stop = pin!(stop);
    let (mut handle, mut incoming) = (Some(handle), Some(incoming));
    let accept = async |incoming: &mut Option<mux::Incoming>| match incoming {
        Some(incoming) => incoming.accept().await,
        None => std::future::pending().await,
    };
    loop {
        tokio::select! {
            r = &mut conn => return match r {
                Ok(r) => r.map_err(StreamError::from),
                Err(e) => Err(StreamError::Io(std::io::Error::other(e))),
            },
            () = stop.as_mut(), if handle.is_some() => {
                if let Some(handle) = handle.take() {
                    handle.go_away();
                }
            }
            stream = accept(&mut incoming) => match stream {
                Some(stream) => {
                    let parts = match super::head::decode_request(stream.header()) {
                        Ok(parts) => parts,
                        Err(e) => {
                            debug!(error = %e, "a stream's request head does not parse; refused");
                            stream.reset(u32::from(Reason::PROTOCOL_ERROR));
                            continue;
                        }
                    };
                    let (recv, send) = stream.split();
                    // Held to h2's limit here too (h2 answers 431 itself).
                    if super::head::request_list_size(&parts) > MAX_HEADER_LIST as usize {
                        drop(recv);
                        let mut too_large = Response::new(super::body::empty());
                        *too_large.status_mut() = http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
                        tokio::spawn(answer_mux(std::future::ready(too_large), send));
                        continue;
                    }
                    let body = RecvBody::mux(recv, &parts.headers);
                    // Boxed, as in `serve`; and the task's own future
                    // too, about a kilobyte: spawning and finishing a task
                    // moved it whole five times (~1.1 k instructions a
                    // request, against one allocation and one move).
                    let response = Box::pin(service(Request::from_parts(parts, body)));
                    tokio::spawn(Box::pin(answer_mux(response, send)));
                }
                // Ended, or going away and every stream taken: the
                // connection ends once they are done.
                None => incoming = None,
            },
        }
    }
}

/// [`answer`] on the multiplexer: the response head as a header block (with
/// the end when there is no body), then the body.
async fn answer_mux<F>(response: F, mut stream: mux::Stream)
where
    F: Future<Output = Response<BoxBody>>,
{
    let Some(response) = response_or_reset(response, |cx| stream.poll_reset(cx).map(|_| ())).await else {
        return debug!("stream reset before its response");
    };
    let (mut head, body) = response.into_parts();
    // A head read as text is sent as it came (its body's length is in it).
    let (block, eos) = match head.extensions.remove::<WireHead>() {
        Some(WireHead(block)) => (block, body.is_end_stream()),
        None => {
            let eos = ready_head(&mut head, &body);
            (super::head::encode_response(&head), eos)
        }
    };
    if let Err(e) = stream.send_head(block, eos).await {
        debug!(error = %e, "sending a response head failed");
        return stream.reset(u32::from(Reason::INTERNAL_ERROR));
    }
    if !eos && let Err(e) = super::stream::pipe_mux(body, stream).await {
        debug!(error = %e, "response body to the tunnel ended");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use http::{Method, StatusCode};
    use http_body_util::BodyExt;
    use hyper::body::Frame;
    use tokio::sync::{mpsc, oneshot};

    use super::*;
    use crate::BoxError;
    use crate::tunnel::client::{self, Sender};
    use crate::tunnel::{Wire, body};

    /// A tunnel connection (in memory) served by `service`; `stop` shuts it
    /// down gracefully.
    async fn tunnel<S, F>(
        wire: Wire,
        service: S,
    ) -> (Sender, oneshot::Sender<()>, tokio::task::JoinHandle<Result<(), StreamError>>)
    where
        S: FnMut(Request<RecvBody>) -> F + Send + 'static,
        F: Future<Output = Response<BoxBody>> + Send + 'static,
    {
        let (edge, agent) = tokio::io::duplex(64 * 1024);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let served = tokio::spawn(serve_wire(agent, wire, service, async {
            let _ = stop_rx.await;
        }));
        let (send, conn) = client::start(edge, wire).await.unwrap();
        tokio::spawn(conn);
        (send, stop_tx, served)
    }

    fn get(path: &str) -> Request<BoxBody> {
        Request::builder().uri(format!("https://app.test{path}")).body(body::empty()).unwrap()
    }

    /// A head the agent's HTTP/1 client read goes out as it came on the
    /// multiplexer, and as fields on h2.
    #[tokio::test]
    async fn a_head_made_for_the_wire_is_sent_on_either_wire() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (send, _stop, _) = tunnel(wire, |_req| async {
                let mut r = Response::new(body::full("hello"));
                *r.status_mut() = StatusCode::CREATED;
                let block =
                    b"HTTP/1.1 201 \r\nX-Kept: 2\r\nx-many: 1\r\nX-Many: 2\r\nContent-Length: 5\r\n\r\n";
                r.extensions_mut().insert(WireHead(Bytes::from_static(block)));
                r
            })
            .await;
            let resp = send.send(get("/")).await.unwrap();
            assert_eq!(resp.status(), StatusCode::CREATED);
            let h = resp.headers();
            assert_eq!(h.get("x-kept").unwrap(), "2");
            assert_eq!(h.get_all("x-many").iter().collect::<Vec<_>>(), ["1", "2"]);
            assert_eq!(h.get(header::CONTENT_LENGTH).unwrap(), "5");
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "hello");
        }
    }

    #[tokio::test]
    async fn a_head_is_made_fit_for_http2_and_a_known_length_is_said() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (send, _stop, _) = tunnel(wire, |_req| async {
                let mut r = Response::new(body::full("hello"));
                // What a response filter could add; HTTP/2 forbids them.
                r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close, x-hop"));
                r.headers_mut().insert("x-hop", HeaderValue::from_static("1"));
                r.headers_mut().insert("x-kept", HeaderValue::from_static("2"));
                r.headers_mut().insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
                r
            })
            .await;
            let resp = send.send(get("/")).await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK);
            let h = resp.headers();
            assert!(h.get(header::CONNECTION).is_none() && h.get(header::TRANSFER_ENCODING).is_none());
            assert!(h.get("x-hop").is_none(), "a header the Connection header named");
            assert_eq!(h.get("x-kept").unwrap(), "2");
            assert_eq!(h.get(header::CONTENT_LENGTH).unwrap(), "5");
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "hello");
        }
    }

    #[tokio::test]
    async fn an_empty_response_ends_with_its_head_and_keeps_its_content_length() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            // A HEAD's answer: the length of what a GET would get, no body.
            let (send, _stop, _) = tunnel(wire, |_req| async {
                let mut r = Response::new(body::empty());
                r.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from_static("1234"));
                r
            })
            .await;
            let mut head = get("/");
            *head.method_mut() = Method::HEAD;
            let resp = send.send(head).await.unwrap();
            assert_eq!(resp.headers().get(header::CONTENT_LENGTH).unwrap(), "1234");
            assert!(resp.body().is_end_stream(), "the head ended the stream");
        }
    }

    #[tokio::test]
    async fn request_bodies_and_their_trailers_reach_the_service() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (send, _stop, _) = tunnel(wire, |req: Request<RecvBody>| async move {
                assert_eq!(req.body().size_hint().exact(), Some(1 << 20), "its content-length");
                let got = req.into_body().collect().await.unwrap();
                let trailers = got.trailers().cloned();
                let n = got.to_bytes().len();
                let mut r = Response::new(body::full(format!("{n}")));
                if let Some(t) = trailers.and_then(|t| t.get("x-sum").cloned()) {
                    r.headers_mut().insert("x-sum", t);
                }
                r
            })
            .await;
            let upload = Request::builder()
                .method(Method::POST)
                .uri("https://app.test/up")
                .body(body::full(vec![1u8; 1 << 20]))
                .unwrap();
            let resp = send.send(upload).await.unwrap();
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "1048576");

            let mut t = http::HeaderMap::new();
            t.insert("x-sum", HeaderValue::from_static("abc"));
            let frames: Vec<Result<_, BoxError>> =
                vec![Ok(Frame::data(Bytes::from_static(b"ask"))), Ok(Frame::trailers(t))];
            let with_trailers =
                body::boxed(http_body_util::StreamBody::new(futures_util::stream::iter(frames)));
            let req = Request::builder()
                .method(Method::POST)
                .uri("https://app.test/t")
                .body(with_trailers)
                .unwrap();
            let (send2, _stop2, _) = tunnel(wire, |req: Request<RecvBody>| async move {
                let got = req.into_body().collect().await.unwrap();
                let sum = got.trailers().and_then(|t| t.get("x-sum").cloned()).unwrap();
                let mut r = Response::new(body::full(got.to_bytes()));
                r.headers_mut().insert("x-sum", sum);
                r
            })
            .await;
            let resp = send2.send(req).await.unwrap();
            assert_eq!(resp.headers().get("x-sum").unwrap(), "abc");
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ask");
            drop(send);
        }
    }

    #[tokio::test]
    async fn a_reset_from_the_edge_drops_the_pending_response() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            // The service never answers; it tells when its future is dropped.
            let (dropped_tx, mut dropped) = mpsc::unbounded_channel::<()>();
            let (send, _stop, _) = tunnel(wire, move |_req| {
                let guard = DropSignal(dropped_tx.clone());
                async move {
                    let _guard = guard;
                    std::future::pending::<Response<BoxBody>>().await
                }
            })
            .await;
            let pending = send.send(get("/slow"));
            assert!(tokio::time::timeout(Duration::from_millis(50), pending).await.is_err());
            // The edge gave the request up (its future dropped: a reset).
            tokio::time::timeout(Duration::from_secs(10), dropped.recv())
                .await
                .expect("the service's future was dropped")
                .unwrap();
        }
    }

    /// The agent's connection dropped while a response body is still being
    /// sent (the drain timed out, the edge is gone): the body's task ends and
    /// lets go of the body (its backend connection), instead of waiting
    /// forever for credit from a connection nobody drives.
    #[tokio::test(start_paused = true)]
    async fn a_body_being_sent_ends_when_the_connection_is_dropped() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (body_tx, body_rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            let body_rx = Arc::new(std::sync::Mutex::new(Some(body_rx)));
            let (send, _stop, served) = tunnel(wire, move |_req| {
                let mut rx = body_rx.lock().unwrap().take().expect("one request");
                let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
                async move { Response::new(body::boxed(http_body_util::StreamBody::new(stream))) }
            })
            .await;
            // The edge takes the head and reads nothing of the body.
            let _resp = send.send(get("/download")).await.unwrap();
            served.abort();
            let _ = served.await;
            // Far more than any window: the body's task fails to write and
            // drops the body, or (before) blocks for ever.
            let chunk = Bytes::from(vec![0u8; 64 * 1024]);
            let mut sent = 0;
            loop {
                let sending = body_tx.send(Ok(Frame::data(chunk.clone())));
                match tokio::time::timeout(Duration::from_secs(60), sending).await {
                    Err(_) => panic!("the body's task still holds the body after {sent} chunks"),
                    Ok(Err(_)) => break,
                    Ok(Ok(())) => sent += 1,
                }
                assert!(sent < 1024, "64 MiB went into a connection nobody drives");
            }
        }
    }

    struct DropSignal(mpsc::UnboundedSender<()>);

    impl Drop for DropSignal {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    #[tokio::test]
    async fn stopping_lets_open_streams_finish_and_takes_no_new_one() {
        for wire in Wire::ALL {
            eprintln!("wire: {wire:?}");
            let (arrived_tx, mut arrived) = mpsc::unbounded_channel::<()>();
            let (release_tx, release_rx) = oneshot::channel::<()>();
            let release = Arc::new(std::sync::Mutex::new(Some(release_rx)));
            let (send, stop, served) = tunnel(wire, move |_req| {
                let release = release.lock().unwrap().take();
                let _ = arrived_tx.send(());
                async move {
                    if let Some(rx) = release {
                        let _ = rx.await;
                    }
                    Response::new(body::full("done"))
                }
            })
            .await;
            let in_flight = tokio::spawn({
                let send = send.clone();
                async move { send.send(get("/long")).await }
            });
            // The stream is open at the agent, then the stop comes.
            arrived.recv().await.unwrap();
            stop.send(()).unwrap();
            release_tx.send(()).unwrap();
            let resp = in_flight.await.unwrap().expect("the open stream was answered");
            assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "done");
            tokio::time::timeout(Duration::from_secs(10), served)
                .await
                .expect("the connection closed once its streams were done")
                .unwrap()
                .unwrap();
            assert!(send.send(get("/after")).await.is_err(), "no stream after the GOAWAY");
        }
    }
}
