//! What both ends of a tunnel connection's HTTP/2 do with a stream's bodies:
//! read one as it arrives ([`RecvBody`]), feed one in as the stream's window
//! allows ([`Pipe`]).

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};
use http::header;
use hyper::body::{Body, Frame, SizeHint};

use super::body::BoxBody;
use super::mux;
use crate::BoxError;

/// The one valid `content-length`, if the head has one.
fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => v.to_str().ok()?.trim().parse().ok(),
        _ => None,
    }
}

/// Feeds a body to its stream (a request's at the edge, a response's at the
/// agent): a chunk at a time, each once the stream has room for it (h2 holds
/// what the window does not take yet, up to its send buffer), then its
/// trailers; a body that fails resets the stream.
pub(crate) struct Pipe {
    pub(crate) body: BoxBody,
    pub(crate) tx: SendStream<Bytes>,
    /// A chunk taken from the body, waiting for the stream's capacity.
    buffered: Option<(Bytes, bool)>,
}

impl Pipe {
    pub(crate) fn new(body: BoxBody, tx: SendStream<Bytes>) -> Pipe {
        Pipe { body, tx, buffered: None }
    }
}

impl Future for Pipe {
    type Output = Result<(), BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let me = self.get_mut();
        loop {
            // Woken by a reset from the agent while waiting for the body or for room.
            if let Poll::Ready(reset) = me.tx.poll_reset(cx) {
                let error = match reset {
                    Ok(reason) => h2::Error::from(reason),
                    Err(e) => e,
                };
                return Poll::Ready(Err(error.into()));
            }
            if let Some((data, eos)) = me.buffered.take() {
                while me.tx.capacity() == 0 {
                    match me.tx.poll_capacity(cx) {
                        Poll::Pending => {
                            me.buffered = Some((data, eos));
                            return Poll::Pending;
                        }
                        Poll::Ready(Some(Ok(0))) => {}
                        Poll::Ready(Some(Ok(_))) => break,
                        Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.into())),
                        Poll::Ready(None) => return Poll::Ready(Err("the tunnel stream closed".into())),
                    }
                }
                me.tx.send_data(data, eos)?;
                if eos {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            // The next chunk first, then room for it: capacity reserved ahead
            // of data would pin the connection window for a body that sends
            // nothing (hyper#4003).
            match ready!(Pin::new(&mut me.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(chunk) => {
                        let eos = me.body.is_end_stream();
                        if chunk.is_empty() {
                            me.tx.send_data(chunk, eos)?;
                            if eos {
                                return Poll::Ready(Ok(()));
                            }
                            continue;
                        }
                        // A minimal claim: h2 raises it to what is buffered.
                        me.tx.reserve_capacity(1);
                        me.buffered = Some((chunk, eos));
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            me.tx.reserve_capacity(0);
                            me.tx.send_trailers(trailers)?;
                            return Poll::Ready(Ok(()));
                        }
                    }
                },
                Some(Err(e)) => {
                    me.tx.send_reset(reason_of(&*e));
                    return Poll::Ready(Err(e));
                }
                None => {
                    me.tx.send_data(Bytes::new(), true)?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

/// The reset to send for a body that failed: the HTTP/2 reason behind it
/// (a public client's own reset), else `INTERNAL_ERROR`.
fn reason_of(mut e: &(dyn StdError + 'static)) -> Reason {
    loop {
        if let Some(reason) = e.downcast_ref::<h2::Error>().and_then(h2::Error::reason) {
            return reason;
        }
        if let Some(reason) = e.downcast_ref::<StreamError>().and_then(StreamError::reason) {
            return reason;
        }
        match e.source() {
            Some(source) => e = source,
            None => return Reason::INTERNAL_ERROR,
        }
    }
}

/// A body received on a tunnel stream (a response's at the edge, a request's
/// at the agent): its DATA as they come, each handed back to the stream's
/// window as it is taken, then its trailers. On the multiplexer (protocol
/// version 2) the same, from a [`mux::Stream`]: its bytes, then a header
/// block for the trailers.
#[derive(Debug)]
pub struct RecvBody {
    recv: Recv,
    data_done: bool,
    /// What remains of the response's `content-length`.
    content_length: Option<u64>,
}

enum Recv {
    H2(RecvStream),
    Mux(mux::Stream),
}

impl std::fmt::Debug for Recv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recv::H2(r) => r.fmt(f),
            Recv::Mux(s) => write!(f, "mux stream {}", s.id()),
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        let me = self.get_mut();
        let recv = match &mut me.recv {
            Recv::H2(recv) => recv,
            Recv::Mux(stream) => {
                if me.data_done {
                    return Poll::Ready(None);
                }
                return Poll::Ready(match ready!(stream.poll_chunk(cx)) {
                    Ok(Some(mux::Chunk::Data(data))) => {
                        if let Some(left) = &mut me.content_length {
                            *left = left.saturating_sub(data.len() as u64);
                        }
                        Some(Ok(Frame::data(data)))
                    }
                    Ok(Some(mux::Chunk::Head(block))) => {
                        me.data_done = true;
                        match super::head::decode_trailers(&block) {
                            Ok(trailers) => Some(Ok(Frame::trailers(trailers))),
                            Err(e) => Some(Err(mux_error(stream, std::io::Error::other(e)))),
                        }
                    }
                    Ok(None) => {
                        me.data_done = true;
                        None
                    }
                    Err(e) => Some(Err(mux_error(stream, e))),
                });
            }
        };
        if !me.data_done {
            match ready!(recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = recv.flow_control().release_capacity(data.len());
                    if let Some(left) = &mut me.content_length {
                        *left = left.saturating_sub(data.len() as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                // RST_STREAM(NO_ERROR) after a complete response: the agent
                // needs no more of the request; the response is whole.
                Some(Err(e)) if e.reason() == Some(Reason::NO_ERROR) => return Poll::Ready(None),
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => me.data_done = true,
            }
        }
        match ready!(recv.poll_trailers(cx)) {
            Ok(trailers) => Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t)))),
            Err(e) if e.reason() == Some(Reason::NO_ERROR) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e.into()))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.recv {
            Recv::H2(recv) => recv.is_end_stream(),
            Recv::Mux(stream) => self.data_done || stream.is_end(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.content_length.map(SizeHint::with_exact).unwrap_or_default()
    }
}

/// What ends a tunnel stream (or connection): h2's error on protocol
/// version 1, the multiplexer's on version 2.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    H2(#[from] h2::Error),
    /// The stream was reset by the peer, with this reason.
    #[error("the stream was reset by the other end ({0:?})")]
    Reset(Reason),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl StreamError {
    /// The HTTP/2 reason (a mux reset code is one) that ended the stream.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            StreamError::H2(e) => e.reason(),
            StreamError::Reset(r) => Some(*r),
            StreamError::Io(_) => None,
        }
    }
}

/// A mux stream's error: the peer's reset as its reason (what a public
/// client's own reset becomes on its way through), else the I/O error.
pub(crate) fn mux_error(stream: &mux::Stream, e: std::io::Error) -> StreamError {
    match stream.reset_code() {
        Some(code) => StreamError::Reset(Reason::from(code)),
        None => StreamError::Io(e),
    }
}

impl RecvBody {
    /// The body of a stream whose head was `headers`.
    pub(crate) fn new(recv: RecvStream, headers: &http::HeaderMap) -> RecvBody {
        RecvBody { recv: Recv::H2(recv), data_done: false, content_length: content_length(headers) }
    }

    /// The body that follows a head on a mux stream.
    pub(crate) fn mux(stream: mux::Stream, headers: &http::HeaderMap) -> RecvBody {
        RecvBody { recv: Recv::Mux(stream), data_done: false, content_length: content_length(headers) }
    }

    /// The body that follows a head on a mux stream, for a caller that
    /// reads the head as text (the body's size is the head's to say).
    pub(crate) fn mux_text(stream: mux::Stream) -> RecvBody {
        RecvBody { recv: Recv::Mux(stream), data_done: false, content_length: None }
    }
}

/// Feeds a body to a mux stream (protocol version 2), as [`Pipe`] does to an
/// h2 stream: its bytes as the stream's credit allows, then its trailers as
/// a header block, or the end; a body that fails resets the stream.
pub(crate) async fn pipe_mux(mut body: BoxBody, mut stream: mux::Stream) -> Result<(), BoxError> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    loop {
        match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => stream.send(data).await?,
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        stream.send_head(super::head::encode_trailers(&trailers), true).await?;
                        return Ok(());
                    }
                }
            },
            Some(Err(e)) => {
                stream.reset(reason_of(&*e).into());
                return Err(e);
            }
            None => {
                stream.shutdown().await?;
                return Ok(());
            }
        }
    }
}
