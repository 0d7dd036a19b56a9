//! One HTTP/1.1 exchange with a plain-HTTP backend on a connection of
//! [`super::pool`], run by the request's own task: it writes the head and
//! the body and reads the response head there, and the response body reads
//! the socket as it is polled. hyper's client connection would hand each
//! request to a task of its own over a channel and send the response head
//! and every body chunk back over others (in a profile of keep-alive HTTP,
//! ~25 k instructions per request on the agent, the largest single part of
//! its work); here nothing is handed over.
//!
//! What it speaks (RFC 9112): the request in origin form with its headers as
//! given, the body as `content-length` when its size is known and chunked
//! otherwise, written while the response is read (a backend may answer
//! before it has read the upload); the response framed by `content-length`,
//! chunked (trailers kept) or the connection's end; no body for `HEAD`, 204
//! and 304; interim 1xx answers skipped. The response head is handed on as
//! text in the multiplexer's form ([`WireHead`], without its hop-by-hop
//! fields), not as a `HeaderMap`. A connection goes back to the pool
//! only after a whole response on a connection both ends keep alive, with
//! nothing unread left on it.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_util::io::poll_read_buf;
use tracing::{Instrument, debug};

use crate::BoxError;
use crate::http::{field_slots, is_hop_by_hop_name, parse_response};
use crate::tunnel::body::{self, BoxBody, ReadSize};
use crate::tunnel::client::has_payload_semantics;
use crate::tunnel::head::WireHead;

/// The largest response head taken from a backend (the edge takes 16 KiB of
/// it through the tunnel).
const MAX_HEAD: usize = 64 * 1024;
/// Headers a response head may have (hyper's limit).
const MAX_HEADERS: usize = 100;
/// What a connection's buffer starts with: room for a typical response head
/// and a small body, read in one go.
const INITIAL_BUFFER: usize = 8 * 1024;
/// The first read of a response body (later ones grow as a TCP stream's
/// do: [`ReadSize`]).
const FIRST_READ: usize = 64 * 1024;
/// The longest chunk-size line (with extensions) taken.
const MAX_CHUNK_LINE: usize = 4096;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connection closed before the response head")]
    ClosedBeforeResponse,
    #[error("connection closed in the middle of the response")]
    ClosedInBody,
    #[error("writing the request failed")]
    Write(#[source] io::Error),
    #[error("reading the response failed")]
    Read(#[source] io::Error),
    #[error("the request body failed")]
    RequestBody(#[source] BoxError),
    #[error("the request body is not as long as its content-length")]
    RequestLength,
    #[error("invalid response head: {0}")]
    Head(&'static str),
    #[error("invalid chunked response body")]
    Chunked,
}

impl Error {
    /// The connection ended (closed or reset) before any of a response came
    /// back: a request that can be sent twice may go again on another.
    pub fn closed_before_response(&self) -> bool {
        match self {
            Error::ClosedBeforeResponse => true,
            Error::Read(e) | Error::Write(e) => {
                matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe)
            }
            _ => false,
        }
    }
}

/// A kept-alive connection to a backend, with what was read past the last
/// response (nothing, when it is idle).
pub struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

impl Conn {
    pub fn new(io: TcpStream) -> Conn {
        Conn { io, buf: BytesMut::new() }
    }

    /// Whether an idle connection may still take a request: the backend has
    /// neither closed it nor sent anything unasked. A peek, only when the
    /// runtime saw the socket readable since its last read; its `WouldBlock`
    /// also clears that, so the response head's first read waits for the
    /// answer instead of trying the socket first.
    pub fn is_open(&self) -> bool {
        match self.io.try_io(tokio::io::Interest::READABLE, || peek(&self.io)) {
            Err(e) => e.kind() == io::ErrorKind::WouldBlock,
            // The end (0), or bytes nobody asked for.
            Ok(_) => false,
        }
    }
}

/// `recv(MSG_PEEK | MSG_DONTWAIT)` of one byte: whether the socket has
/// something (or its end), without taking it.
fn peek(io: &TcpStream) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: a socket this stream owns, and a one-byte buffer of ours.
    let n =
        unsafe { libc::recv(io.as_raw_fd(), (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

/// A failed exchange, with the request when none of it was written (it can
/// go out on another connection as it is).
pub struct Failed {
    pub error: Error,
    pub request: Option<http::Request<BoxBody>>,
}

/// Sends `req` on `conn` and reads the response head. The response body
/// reads the rest; `checkin` gets the connection back once it may be used
/// again.
pub async fn exchange(
    conn: Conn,
    req: http::Request<BoxBody>,
    checkin: Checkin,
) -> Result<Response<ResponseBody>, Failed> {
    let Conn { mut io, mut buf } = conn;
    let (mut parts, body) = req.into_parts();
    let framing = request_framing(&mut parts, &body);
    let mut head = Vec::with_capacity(256);
    encode_head(&parts, &mut head);
    let head_request = parts.method == Method::HEAD;
    let head = Bytes::from(head);
    let mut upload =
        Some(Upload { head, body, framing, out: VecDeque::new(), done: framing == Framing::None });
    // Whether any of the request reached the socket, and a write that
    // failed after that (the backend may have answered early, a 413, and
    // closed its end: what it said is read all the same).
    let mut wrote = false;
    let mut write_failed: Option<io::Error> = None;
    let result = {
        let (mut rd, mut wr) = io.split();
        std::future::poll_fn(|cx| {
            if let Some(up) = &mut upload
                && write_failed.is_none()
            {
                match up.poll_write(cx, Pin::new(&mut wr), &mut wrote) {
                    Poll::Ready(Ok(())) => upload = None,
                    Poll::Ready(Err(UploadError::Write(e))) if !wrote => {
                        return Poll::Ready(Err(Error::Write(e)));
                    }
                    Poll::Ready(Err(UploadError::Write(e))) => write_failed = Some(e),
                    Poll::Ready(Err(UploadError::Body(e))) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
            match ready!(poll_head(cx, Pin::new(&mut rd), &mut buf, head_request)) {
                Err(Error::ClosedBeforeResponse) if write_failed.is_some() => {
                    Poll::Ready(Err(Error::Write(write_failed.take().expect("checked"))))
                }
                r => Poll::Ready(r),
            }
        })
        .await
    };
    let head = match result {
        Ok(head) => head,
        Err(error) => {
            // Nothing written: the request is whole, it can go elsewhere.
            let request = match upload {
                Some(up) if !wrote => Some(http::Request::from_parts(parts, up.body)),
                _ => None,
            };
            return Err(Failed { error, request });
        }
    };
    let Head { status, version, block, body: decoder, keep_alive } = head;
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    resp.extensions_mut().insert(WireHead(block));
    let reusable = keep_alive && write_failed.is_none() && decoder != Decoder::Eof;
    let reader = match upload {
        // The backend answered before the whole body was written: the
        // upload goes on with the write half while the response is read, and
        // the connection is not used again.
        Some(up) if write_failed.is_none() => {
            let (rd, wr) = io.into_split();
            tokio::spawn(finish_upload(up, wr).in_current_span());
            Reader::Half(rd)
        }
        _ => Reader::Whole(io),
    };
    let body = ResponseBody {
        reader: Some(reader),
        buf,
        size: ReadSize::new(FIRST_READ),
        decoder,
        reusable,
        large: false,
        checkin: Some(checkin),
    };
    Ok(resp.map(|()| body.finish_if_done()))
}

/// How the request body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    None,
    Length(u64),
    Chunked,
}

/// Decides the body's framing and sets the head's framing headers for it
/// (any `transfer-encoding` of the request is hop-by-hop and gone by now).
fn request_framing(parts: &mut http::request::Parts, body: &BoxBody) -> Framing {
    let declared =
        parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    parts.headers.remove(header::TRANSFER_ENCODING);
    if body.is_end_stream() {
        if declared.is_none() && has_payload_semantics(&parts.method) {
            parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        }
        return Framing::None;
    }
    match declared.or(body.size_hint().exact()) {
        Some(n) => {
            if declared.is_none() {
                parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            }
            if n == 0 { Framing::None } else { Framing::Length(n) }
        }
        None => {
            parts.headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
            Framing::Chunked
        }
    }
}

/// `METHOD path HTTP/1.1`, then the headers as they are.
fn encode_head(parts: &http::request::Parts, out: &mut Vec<u8>) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(parts.uri.path_and_query().map_or("/", |pq| pq.as_str()).as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// The request body on its way, with its framing: the frames the body has
/// ready are gathered and written together, in one vectored write, as a TCP
/// stream's are ([`body::poll_gather`]); chunked, a batch is one chunk.
struct Upload {
    /// The request head, written first and alone (before the body is
    /// waited for); empty once written.
    head: Bytes,
    body: BoxBody,
    framing: Framing,
    /// What is to be written after the head, in order: a batch of the body
    /// with its framing (the chunk-size line, the data, the line end), then
    /// the body's end (the last chunk and trailers).
    out: VecDeque<Bytes>,
    /// The body's end is in `out` (or it has none).
    done: bool,
}

enum UploadError {
    Write(io::Error),
    Body(Error),
}

impl Upload {
    /// Writes what is pending, then the body's next frames, until the body
    /// has ended and all of it is written.
    fn poll_write<W: AsyncWrite + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        mut w: Pin<&mut W>,
        wrote: &mut bool,
    ) -> Poll<Result<(), UploadError>> {
        ready!(body::poll_write_one(w.as_mut(), cx, &mut self.head, wrote)).map_err(UploadError::Write)?;
        loop {
            ready!(body::poll_write_all(w.as_mut(), cx, &mut self.out, wrote)).map_err(UploadError::Write)?;
            if self.done {
                return Poll::Ready(Ok(()));
            }
            let gathered = ready!(body::poll_gather(Pin::new(&mut self.body), cx, &mut self.out))
                .map_err(|e| UploadError::Body(Error::RequestBody(e)))?;
            self.frame(gathered.len).map_err(UploadError::Body)?;
            if let Some(trailers) = gathered.end {
                self.end(trailers).map_err(UploadError::Body)?;
            }
        }
    }

    /// Frames the `len` bytes of data just gathered into `out`.
    fn frame(&mut self, len: usize) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        match &mut self.framing {
            Framing::Length(left) => {
                *left = left.checked_sub(len as u64).ok_or(Error::RequestLength)?;
            }
            Framing::Chunked => {
                self.out.push_front(Bytes::from(format!("{len:x}\r\n")));
                self.out.push_back(Bytes::from_static(b"\r\n"));
            }
            Framing::None => return Err(Error::RequestLength),
        }
        Ok(())
    }

    fn end(&mut self, trailers: Option<HeaderMap>) -> Result<(), Error> {
        self.done = true;
        match self.framing {
            Framing::Length(0) | Framing::None => Ok(()),
            Framing::Length(_) => Err(Error::RequestLength),
            Framing::Chunked => {
                let mut last = b"0\r\n".to_vec();
                for (name, value) in trailers.iter().flatten() {
                    last.extend_from_slice(name.as_str().as_bytes());
                    last.extend_from_slice(b": ");
                    last.extend_from_slice(value.as_bytes());
                    last.extend_from_slice(b"\r\n");
                }
                last.extend_from_slice(b"\r\n");
                self.out.push_back(Bytes::from(last));
                Ok(())
            }
        }
    }
}

/// The rest of an upload the backend answered before it was written.
async fn finish_upload(mut up: Upload, mut wr: OwnedWriteHalf) {
    let mut wrote = true;
    let done = std::future::poll_fn(|cx| up.poll_write(cx, Pin::new(&mut wr), &mut wrote)).await;
    if let Err(UploadError::Write(e)) = done {
        debug!(error = %e, "the backend took no more of the request body");
    }
}

/// A response head, and how its body is framed.
struct Head {
    status: StatusCode,
    version: Version,
    /// The head as the response carries it: [`WireHead`].
    block: Bytes,
    body: Decoder,
    keep_alive: bool,
}

/// Reads until a final response head is in `buf` (interim 1xx heads are
/// skipped), and takes it out of `buf`.
fn poll_head<R: AsyncRead + ?Sized>(
    cx: &mut Context<'_>,
    mut rd: Pin<&mut R>,
    buf: &mut BytesMut,
    head_request: bool,
) -> Poll<Result<Head, Error>> {
    loop {
        if let Some(head) = head_from(buf, head_request)? {
            return Poll::Ready(Ok(head));
        }
        buf.reserve(INITIAL_BUFFER);
        match ready!(poll_read_buf(rd.as_mut(), cx, buf)) {
            Ok(0) => return Poll::Ready(Err(head_cut(buf))),
            Ok(_) => {}
            Err(e) => return Poll::Ready(Err(Error::Read(e))),
        }
    }
}

/// A final response head out of `buf`, `None` while it needs more bytes.
fn head_from(buf: &mut BytesMut, head_request: bool) -> Result<Option<Head>, Error> {
    if buf.is_empty() {
        return Ok(None);
    }
    match parse_head(buf, head_request)? {
        None if buf.len() >= MAX_HEAD => Err(Error::Head("larger than 64 KiB")),
        head => Ok(head),
    }
}

/// The connection ended before a whole head.
fn head_cut(buf: &BytesMut) -> Error {
    if buf.is_empty() { Error::ClosedBeforeResponse } else { Error::Head("the connection closed inside it") }
}

/// Parses a final response head at the start of `buf` and takes it out;
/// `None` while it is incomplete. An interim (1xx) head is taken out and
/// skipped.
fn parse_head(buf: &mut BytesMut, head_request: bool) -> Result<Option<Head>, Error> {
    loop {
        let mut slots = field_slots::<MAX_HEADERS>();
        let (resp, parsed) = parse_response(buf, &mut slots);
        let len = match parsed {
            Ok(httparse::Status::Complete(len)) if len > MAX_HEAD => {
                return Err(Error::Head("larger than 64 KiB"));
            }
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => return Err(Error::Head("more than 100 headers")),
            Err(_) => return Err(Error::Head("not HTTP/1.x")),
        };
        let code = resp.code.unwrap_or_default();
        let status = StatusCode::from_u16(code).map_err(|_| Error::Head("bad status code"))?;
        let version = if resp.version == Some(0) { Version::HTTP_10 } else { Version::HTTP_11 };
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(Error::Head("101 Switching Protocols to a request that asked for no upgrade"));
            }
            buf.advance(len);
            if buf.is_empty() {
                return Ok(None);
            }
            continue;
        }
        let mut framing = FramingHeaders::default();
        for h in resp.headers.iter() {
            framing.see(h.name.as_bytes(), h.value)?;
        }
        let block = wire_head(status, &buf[..len], resp.headers, framing.lists_names);
        buf.advance(len);
        let body = framing.decoder(status, head_request);
        // Both framings at once: the body is chunked, and the connection
        // closes after it (RFC 9112 6.3).
        let keep_alive = version == Version::HTTP_11
            && !framing.close
            && !(framing.transfer_encoding.is_some() && framing.length.is_some());
        return Ok(Some(Head { status, version, block, body, keep_alive }));
    }
}

/// The head in the multiplexer's form ([`WireHead`]): the status line, then
/// the field lines as they came (copied whole from `head`, a run of lines at
/// a time), without those of one hop (RFC 9110, section 7.6.1): the
/// hop-by-hop ones, and those a `Connection` field lists (`lists_names`:
/// whether one does). Writing each kept field anew, name, `: `, value and
/// line end, was four copies a field.
fn wire_head(status: StatusCode, head: &[u8], fields: &[httparse::Header<'_>], lists_names: bool) -> Bytes {
    let listed = |name: &[u8]| {
        crate::http::connection_listed_in(fields).any(|listed| listed.eq_ignore_ascii_case(name))
    };
    let kept = fields.iter().filter(|h| {
        let name = h.name.as_bytes();
        !(is_hop_by_hop_name(name) || (lists_names && listed(name)))
    });
    crate::tunnel::head::response_text(status, head.len(), |b| {
        let mut run = 0..0;
        for line in kept.map(|h| field_line(head, h)) {
            if line.start != run.end {
                b.extend_from_slice(&head[run]);
                run = line.start..line.start;
            }
            run.end = line.end;
        }
        b.extend_from_slice(&head[run]);
    })
}

/// Where a field's line lies in the `head` httparse read it from: its name
/// to its line end, inclusive. The line feed is looked for after the value
/// (httparse has trimmed its trailing blanks; a value holds no line feed),
/// not over the whole line, which cost more than the copies it saves.
fn field_line(head: &[u8], h: &httparse::Header<'_>) -> std::ops::Range<usize> {
    let offset = |s: &[u8]| s.as_ptr().addr() - head.as_ptr().addr();
    let start = offset(h.name.as_bytes());
    // An empty value's slice may lie anywhere: from the name's end then.
    let from = if h.value.is_empty() { start + h.name.len() } else { offset(h.value) + h.value.len() };
    let end = head[from..].iter().position(|&c| c == b'\n').map_or(head.len(), |n| from + n + 1);
    start..end
}

/// What a response head says of its body's framing and its connection,
/// gathered as its headers are taken.
#[derive(Default)]
struct FramingHeaders {
    /// `Connection: close`.
    close: bool,
    /// A `Connection` that lists header names (they are not forwarded).
    lists_names: bool,
    /// Whether the last transfer coding is `chunked`, when there is one.
    transfer_encoding: Option<bool>,
    length: Option<u64>,
}

impl FramingHeaders {
    fn see(&mut self, name: &[u8], value: &[u8]) -> Result<(), Error> {
        let text = || std::str::from_utf8(value).ok();
        if name.eq_ignore_ascii_case(b"content-length") {
            for part in text().ok_or(Error::Head("bad content-length"))?.split(',') {
                let n: u64 = part.trim().parse().map_err(|_| Error::Head("bad content-length"))?;
                if self.length.is_some_and(|l| l != n) {
                    return Err(Error::Head("content-lengths that differ"));
                }
                self.length = Some(n);
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            let last = text().and_then(|v| v.rsplit(',').next());
            self.transfer_encoding = Some(last.is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked")));
        } else if name.eq_ignore_ascii_case(b"connection") {
            self.close |=
                text().is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")));
            self.lists_names |= crate::http::connection_listed(value).next().is_some();
        }
        Ok(())
    }

    /// How the body is delimited (RFC 9112 6.3).
    fn decoder(&self, status: StatusCode, head_request: bool) -> Decoder {
        if head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            return Decoder::Done;
        }
        match (self.transfer_encoding, self.length) {
            (Some(true), _) => Decoder::Chunked(Chunk::Size),
            (Some(false), _) | (None, None) => Decoder::Eof,
            (None, Some(0)) => Decoder::Done,
            (None, Some(n)) => Decoder::Length(n),
        }
    }
}

/// Where the response body is in its framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decoder {
    /// This many bytes are left.
    Length(u64),
    Chunked(Chunk),
    /// Until the connection ends.
    Eof,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// A chunk-size line is next.
    Size,
    /// This many bytes of the chunk are left.
    Data(u64),
    /// The line end after a chunk's data.
    DataEnd,
    /// The trailer section after the last chunk.
    Trailers,
}

/// The socket a response body reads.
enum Reader {
    Whole(TcpStream),
    /// The upload goes on with the other half.
    Half(OwnedReadHalf),
}

impl AsyncRead for Reader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Reader::Whole(io) => Pin::new(io).poll_read(cx, buf),
            Reader::Half(io) => Pin::new(io).poll_read(cx, buf),
        }
    }
}

/// Gets a connection back once its response has ended.
pub type Checkin = Box<dyn FnOnce(Conn) + Send>;

/// A response body read from the backend's socket as it is polled; the
/// connection goes back through its [`Checkin`] at its end.
pub struct ResponseBody {
    reader: Option<Reader>,
    buf: BytesMut,
    size: ReadSize,
    decoder: Decoder,
    reusable: bool,
    /// The body was read in reads larger than a connection's first buffer:
    /// that buffer is not kept with the idle connection.
    large: bool,
    checkin: Option<Checkin>,
}

impl ResponseBody {
    /// At the end of the body: the connection goes back if it can.
    fn finish_if_done(mut self) -> Self {
        self.give_back();
        self
    }

    fn give_back(&mut self) {
        if self.decoder != Decoder::Done || !self.reusable || !self.buf.is_empty() {
            return;
        }
        if let (Some(Reader::Whole(io)), Some(checkin)) = (self.reader.take(), self.checkin.take()) {
            // An idle connection keeps a small buffer for its next answer, not
            // the allocation of a large body (up to 64 KiB each, for as many
            // connections as a burst left idle).
            let buf = if self.large { BytesMut::new() } else { std::mem::take(&mut self.buf) };
            checkin(Conn { io, buf });
        }
    }

    /// Reads more of the body into `buf`, up to what the body still `needs`:
    /// `false` at the connection's end.
    fn poll_fill(&mut self, cx: &mut Context<'_>, needs: usize) -> Poll<Result<bool, Error>> {
        let Some(reader) = &mut self.reader else { return Poll::Ready(Ok(false)) };
        let want = self.size.next().min(needs).max(1);
        self.large |= want > INITIAL_BUFFER;
        self.buf.reserve(want);
        match poll_read_buf(Pin::new(reader), cx, &mut (&mut self.buf).limit(want)) {
            Poll::Ready(Ok(n)) if n > 0 => {
                self.size.read(want, n);
                Poll::Ready(Ok(true))
            }
            read => {
                self.size.give_back();
                Poll::Ready(match ready!(read) {
                    Ok(_) => Ok(false),
                    Err(e) => Err(Error::Read(e)),
                })
            }
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let me = self.get_mut();
        loop {
            match me.decoder.next(&mut me.buf)? {
                Next::Frame(frame) => {
                    me.give_back();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Next::End => {
                    me.give_back();
                    return Poll::Ready(None);
                }
                Next::More(want) => {
                    if !ready!(me.poll_fill(cx, want))? {
                        return Poll::Ready(me.decoder.at_eof().err().map(Err));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.decoder == Decoder::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder {
            Decoder::Length(n) => SizeHint::with_exact(n),
            Decoder::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

/// What a [`Decoder`] makes of the bytes buffered.
enum Next {
    Frame(Frame<Bytes>),
    /// It needs more bytes (about this many).
    More(usize),
    /// The body has ended.
    End,
}

/// Takes up to `n` bytes from the front of `buf`.
fn take(buf: &mut BytesMut, n: u64) -> Bytes {
    let n = (buf.len() as u64).min(n) as usize;
    buf.split_to(n).freeze()
}

impl Decoder {
    /// The next frame of the body out of `buf`, free of IO: what it needs is
    /// read by the caller.
    fn next(&mut self, buf: &mut BytesMut) -> Result<Next, Error> {
        loop {
            match *self {
                Decoder::Done => return Ok(Next::End),
                Decoder::Length(left) if buf.is_empty() => {
                    return Ok(Next::More(usize::try_from(left).unwrap_or(usize::MAX)));
                }
                Decoder::Length(left) => {
                    let data = take(buf, left);
                    let left = left - data.len() as u64;
                    *self = if left == 0 { Decoder::Done } else { Decoder::Length(left) };
                    return Ok(Next::Frame(Frame::data(data)));
                }
                Decoder::Eof if buf.is_empty() => return Ok(Next::More(usize::MAX)),
                Decoder::Eof => return Ok(Next::Frame(Frame::data(take(buf, u64::MAX)))),
                Decoder::Chunked(Chunk::Size) => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((len, _))) if len > MAX_CHUNK_LINE => {
                        return Err(Error::Chunked);
                    }
                    Ok(httparse::Status::Complete((len, size))) => {
                        buf.advance(len);
                        *self = Decoder::Chunked(if size == 0 { Chunk::Trailers } else { Chunk::Data(size) });
                    }
                    Ok(httparse::Status::Partial) if buf.len() > MAX_CHUNK_LINE => {
                        return Err(Error::Chunked);
                    }
                    Ok(httparse::Status::Partial) => return Ok(Next::More(INITIAL_BUFFER)),
                    Err(_) => return Err(Error::Chunked),
                },
                // Past the chunk too: the next chunks' sizes and data come in
                // the same read, not in reads cut at each chunk's end.
                Decoder::Chunked(Chunk::Data(_)) if buf.is_empty() => return Ok(Next::More(usize::MAX)),
                Decoder::Chunked(Chunk::Data(left)) => {
                    let data = take(buf, left);
                    let left = left - data.len() as u64;
                    *self = Decoder::Chunked(if left == 0 { Chunk::DataEnd } else { Chunk::Data(left) });
                    return Ok(Next::Frame(Frame::data(data)));
                }
                Decoder::Chunked(Chunk::DataEnd) if buf.len() < 2 => return Ok(Next::More(2)),
                Decoder::Chunked(Chunk::DataEnd) if &buf[..2] == b"\r\n" => {
                    buf.advance(2);
                    *self = Decoder::Chunked(Chunk::Size);
                }
                Decoder::Chunked(Chunk::DataEnd) => return Err(Error::Chunked),
                Decoder::Chunked(Chunk::Trailers) => {
                    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    match httparse::parse_headers(buf, &mut slots) {
                        Ok(httparse::Status::Complete((len, _))) if len > MAX_HEAD => {
                            return Err(Error::Chunked);
                        }
                        Ok(httparse::Status::Complete((len, fields))) => {
                            let mut trailers = HeaderMap::new();
                            for f in fields {
                                if let (Ok(n), Ok(v)) = (
                                    HeaderName::from_bytes(f.name.as_bytes()),
                                    HeaderValue::from_bytes(f.value),
                                ) {
                                    trailers.append(n, v);
                                }
                            }
                            buf.advance(len);
                            *self = Decoder::Done;
                            if !trailers.is_empty() {
                                return Ok(Next::Frame(Frame::trailers(trailers)));
                            }
                        }
                        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => return Err(Error::Chunked),
                        Ok(httparse::Status::Partial) => return Ok(Next::More(INITIAL_BUFFER)),
                        Err(_) => return Err(Error::Chunked),
                    }
                }
            }
        }
    }

    /// The connection ended where the body needed more: its end (a
    /// close-delimited body, after which the connection is not used again),
    /// or an error.
    fn at_eof(&mut self) -> Result<(), Error> {
        match self {
            Decoder::Eof => {
                *self = Decoder::Done;
                Ok(())
            }
            _ => Err(Error::ClosedInBody),
        }
    }
}

/// How a response stream decodes, whole or in pieces ([`decode`]).
#[doc(hidden)]
#[derive(Debug, PartialEq, Eq)]
pub struct Decoded {
    pub status: Option<u16>,
    pub headers: usize,
    pub data: Vec<u8>,
    pub trailers: usize,
    /// How it ended: the body's end, or the error.
    pub end: String,
}

/// Decodes `stream`, a backend's response to a `HEAD` request or another,
/// arriving in pieces of `sizes` bytes (taken in turn; 0 counts as 1), as
/// an exchange reads it; the stream's end is the connection's. For the
/// `h1_response` fuzz target: what it decodes does not depend on the pieces.
#[doc(hidden)]
pub fn decode(stream: &[u8], sizes: &[u8], head_request: bool) -> Decoded {
    let mut out = Decoded { status: None, headers: 0, data: Vec::new(), trailers: 0, end: String::new() };
    let mut rest = stream;
    let mut turn = 0;
    let mut buf = BytesMut::new();
    // One more piece into `buf`: `false` at the stream's end.
    let mut fill = |buf: &mut BytesMut| {
        if rest.is_empty() {
            return false;
        }
        let size = sizes.get(turn % sizes.len().max(1)).map_or(rest.len(), |s| (*s as usize).max(1));
        turn += 1;
        let (piece, left) = rest.split_at(size.min(rest.len()));
        buf.extend_from_slice(piece);
        rest = left;
        true
    };
    let head = loop {
        match head_from(&mut buf, head_request) {
            Ok(Some(head)) => break head,
            Ok(None) if fill(&mut buf) => {}
            Ok(None) => {
                out.end = head_cut(&buf).to_string();
                return out;
            }
            Err(e) => {
                out.end = e.to_string();
                return out;
            }
        }
    };
    out.status = Some(head.status.as_u16());
    // What goes on the wire must be a head the edge takes.
    let fields = crate::tunnel::head::decode_response(&head.block).expect("a wire head decodes").headers;
    out.headers = fields.len();
    let mut decoder = head.body;
    loop {
        match decoder.next(&mut buf) {
            Ok(Next::Frame(frame)) => match frame.into_data() {
                Ok(data) => out.data.extend_from_slice(&data),
                Err(frame) => out.trailers = frame.into_trailers().map_or(0, |t| t.len()),
            },
            Ok(Next::End) => break,
            Ok(Next::More(_)) if fill(&mut buf) => {}
            Ok(Next::More(_)) => {
                if let Err(e) = decoder.at_eof() {
                    out.end = e.to_string();
                    return out;
                }
            }
            Err(e) => {
                out.end = e.to_string();
                return out;
            }
        }
    }
    out.end = "end".into();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tunnel::body::testing::Writes;

    fn head(bytes: &[u8], head_request: bool) -> Result<Option<Head>, Error> {
        parse_head(&mut BytesMut::from(bytes), head_request)
    }

    /// The fields the edge gets.
    fn fields(h: &Head) -> HeaderMap {
        crate::tunnel::head::decode_response(&h.block).unwrap().headers
    }

    #[test]
    fn response_heads_and_their_framing() {
        let h = head(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nX-A: 2\r\n\r\nhello", false)
            .unwrap()
            .unwrap();
        assert_eq!((h.status, h.body, h.keep_alive), (StatusCode::OK, Decoder::Length(5), true));
        assert_eq!(fields(&h).get_all("x-a").iter().collect::<Vec<_>>(), ["1", "2"]);
        let h = head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", false).unwrap().unwrap();
        assert_eq!(h.body, Decoder::Chunked(Chunk::Size));
        let h = head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", false).unwrap().unwrap();
        assert_eq!(h.body, Decoder::Eof);
        // Both framings: chunked wins, and the connection is not kept.
        let h = head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", false)
            .unwrap()
            .unwrap();
        assert_eq!((h.body, h.keep_alive), (Decoder::Chunked(Chunk::Size), false));
        let h = head(b"HTTP/1.1 200 OK\r\n\r\n", false).unwrap().unwrap();
        assert_eq!(h.body, Decoder::Eof);
        let h = head(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true).unwrap().unwrap();
        assert_eq!(h.body, Decoder::Done);
        for status in [204, 304] {
            let raw = format!("HTTP/1.1 {status} X\r\nContent-Length: 9\r\n\r\n");
            assert_eq!(head(raw.as_bytes(), false).unwrap().unwrap().body, Decoder::Done);
        }
        let h = head(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n", false)
            .unwrap()
            .unwrap();
        assert_eq!((h.body, h.keep_alive), (Decoder::Done, false));
        // Hop-by-hop headers are left out of the head, and so are those a
        // `Connection` names; the rest keep their order and their case.
        let raw = b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
            Transfer-Encoding: chunked\r\nX-A: 1\r\n\r\n";
        let h = head(raw, false).unwrap().unwrap();
        assert_eq!(h.block, "HTTP/1.1 200 \r\nX-A: 1\r\n\r\n");
        assert_eq!((h.body, h.keep_alive), (Decoder::Chunked(Chunk::Size), true));
        let raw = b"HTTP/1.1 200 OK\r\nConnection: close, X-A\r\nX-A: 1\r\nX-B:2\r\nContent-Length: 0\r\n\
            connection: x-c,, Keep-Alive\r\nx-c: 3\r\nTE: x\r\n\r\n";
        let h = head(raw, false).unwrap().unwrap();
        assert!(!h.keep_alive);
        assert_eq!(h.block, "HTTP/1.1 200 \r\nX-B:2\r\nContent-Length: 0\r\n\r\n");
        assert_eq!(fields(&h).keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-b", "content-length"]);
        // Lines go on as they came: bare line feeds, spaces around values,
        // empty values; runs of kept lines around the ones left out.
        let raw = b"HTTP/1.1 404 Not Found\nX-A:  1 \nTE: x\r\nX-B:\r\nX-C: 3\nKeep-Alive: 1\nX-D: \t4\r\n\n";
        let h = head(raw, false).unwrap().unwrap();
        assert_eq!(h.block, "HTTP/1.1 404 \r\nX-A:  1 \nX-B:\r\nX-C: 3\nX-D: \t4\r\n\r\n");
        let got = fields(&h);
        let got: Vec<_> = got.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect();
        assert_eq!(got, [("x-a", "1"), ("x-b", ""), ("x-c", "3"), ("x-d", "4")]);
        let h = head(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false).unwrap().unwrap();
        assert!(!h.keep_alive);
        // Interim answers are skipped.
        let h = head(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\nHTTP/1.1 201 Created\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.status, StatusCode::CREATED);
        assert!(head(b"HTTP/1.1 200 OK\r\nContent-Le", false).unwrap().is_none());
    }

    #[test]
    fn bad_response_heads_are_refused() {
        for raw in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        ] {
            assert!(head(raw, false).is_err(), "{}", String::from_utf8_lossy(raw));
        }
        let many: String = (0..101).map(|i| format!("x-{i}: 1\r\n")).collect();
        let raw = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        assert!(head(raw.as_bytes(), false).is_err());
        // The same length said twice is one length.
        let h = head(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\n", false).unwrap().unwrap();
        assert_eq!(h.body, Decoder::Length(2));
    }

    #[test]
    fn request_heads_and_framing() {
        let req = |method: Method, body: BoxBody| {
            let mut r = http::Request::new(body);
            *r.method_mut() = method;
            *r.uri_mut() = http::Uri::from_static("/p?q=1");
            r.headers_mut().insert(header::HOST, HeaderValue::from_static("app"));
            r.into_parts()
        };
        let (mut parts, body) = req(Method::GET, crate::tunnel::body::empty());
        assert_eq!(request_framing(&mut parts, &body), Framing::None);
        let mut out = Vec::new();
        encode_head(&parts, &mut out);
        assert_eq!(out, b"GET /p?q=1 HTTP/1.1\r\nhost: app\r\n\r\n");
        let (mut parts, body) = req(Method::POST, crate::tunnel::body::empty());
        assert_eq!(request_framing(&mut parts, &body), Framing::None);
        assert_eq!(parts.headers[header::CONTENT_LENGTH], "0");
        let (mut parts, body) = req(Method::PUT, crate::tunnel::body::full("abc"));
        assert_eq!(request_framing(&mut parts, &body), Framing::Length(3));
        assert_eq!(parts.headers[header::CONTENT_LENGTH], "3");
        let stream = http_body_util::StreamBody::new(futures_util::stream::iter([Ok::<_, BoxError>(
            Frame::data(Bytes::from_static(b"abc")),
        )]));
        let (mut parts, body) = req(Method::POST, crate::tunnel::body::boxed(stream));
        assert_eq!(request_framing(&mut parts, &body), Framing::Chunked);
        assert_eq!(parts.headers[header::TRANSFER_ENCODING], "chunked");
    }

    /// A backend on 127.0.0.1 that runs `script` on its one connection.
    async fn backend<F, Fut>(script: F) -> TcpStream
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { script(listener.accept().await.unwrap().0).await });
        TcpStream::connect(addr).await.unwrap()
    }

    /// Reads one request head (through its blank line).
    async fn read_head(tcp: &mut TcpStream) -> String {
        use tokio::io::AsyncReadExt;
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            assert_eq!(tcp.read(&mut b).await.unwrap(), 1, "the request head ended early");
            head.push(b[0]);
        }
        String::from_utf8(head).unwrap()
    }

    /// The exchange of `req` on `tcp`: the response and a slot that gets
    /// the connection when it may be used again.
    async fn send(
        tcp: TcpStream,
        req: http::Request<BoxBody>,
    ) -> (Response<ResponseBody>, std::sync::Arc<std::sync::Mutex<Option<Conn>>>) {
        let back = std::sync::Arc::new(std::sync::Mutex::new(None));
        let slot = back.clone();
        let resp = exchange(Conn::new(tcp), req, Box::new(move |c| *slot.lock().unwrap() = Some(c)))
            .await
            .map_err(|f| f.error)
            .unwrap();
        (resp, back)
    }

    fn get(path: &'static str) -> http::Request<BoxBody> {
        let mut r = http::Request::new(crate::tunnel::body::empty());
        *r.uri_mut() = http::Uri::from_static(path);
        r
    }

    #[tokio::test]
    async fn a_chunked_response_in_pieces_with_trailers_then_the_connection_goes_back() {
        use http_body_util::BodyExt;
        use tokio::io::AsyncWriteExt;
        let tcp = backend(|mut tcp| async move {
            read_head(&mut tcp).await;
            for piece in [
                &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhel"[..],
                b"lo\r",
                b"\n6\r\n world\r\n0\r\nx-t: 1\r",
                b"\n\r\n",
            ] {
                tcp.write_all(piece).await.unwrap();
                tcp.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            std::future::pending::<()>().await;
        })
        .await;
        let (resp, back) = send(tcp, get("/c")).await;
        let collected = resp.into_body().collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-t"], "1");
        assert_eq!(collected.to_bytes(), "hello world");
        assert!(back.lock().unwrap().is_some(), "kept alive");
    }

    #[tokio::test]
    async fn a_large_body_a_close_delimited_one_and_a_cut_one() {
        use http_body_util::BodyExt;
        use tokio::io::AsyncWriteExt;
        const LEN: usize = 300 * 1024;
        let tcp = backend(|mut tcp| async move {
            read_head(&mut tcp).await;
            tcp.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {LEN}\r\n\r\n").as_bytes())
                .await
                .unwrap();
            tcp.write_all(&vec![7u8; LEN]).await.unwrap();
            std::future::pending::<()>().await;
        })
        .await;
        let (resp, back) = send(tcp, get("/big")).await;
        assert_eq!(resp.body().size_hint().exact(), Some(LEN as u64));
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(body.len() == LEN && body.iter().all(|b| *b == 7));
        let idle = back.lock().unwrap().take().expect("kept alive");
        assert_eq!(idle.buf.capacity(), 0, "an idle connection keeps no large buffer");

        let tcp = backend(|mut tcp| async move {
            read_head(&mut tcp).await;
            tcp.write_all(b"HTTP/1.1 200 OK\r\n\r\nuntil the end").await.unwrap();
        })
        .await;
        let (resp, back) = send(tcp, get("/eof")).await;
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "until the end");
        assert!(back.lock().unwrap().is_none(), "a close-delimited body ends its connection");

        let tcp = backend(|mut tcp| async move {
            read_head(&mut tcp).await;
            tcp.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc").await.unwrap();
        })
        .await;
        let (resp, back) = send(tcp, get("/cut")).await;
        let err = resp.into_body().collect().await.unwrap_err();
        assert!(matches!(err, Error::ClosedInBody), "{err}");
        assert!(back.lock().unwrap().is_none());
    }

    #[tokio::test]
    async fn a_streamed_upload_goes_chunked_and_an_early_answer_is_read_while_it_goes_on() {
        use http_body_util::BodyExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let body = http_body_util::StreamBody::new(tokio_stream_from(rx));
        let mut req = get("/upload");
        *req.method_mut() = Method::POST;
        *req.body_mut() = crate::tunnel::body::boxed(body);
        let (got_tx, got_rx) = tokio::sync::oneshot::channel();
        let tcp = backend(|mut tcp| async move {
            let head = read_head(&mut tcp).await;
            assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
            // Answers before the body: too large.
            tcp.write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\n\r\nbig").await.unwrap();
            let mut rest = Vec::new();
            tcp.read_to_end(&mut rest).await.unwrap();
            let _ = got_tx.send(rest);
        })
        .await;
        tx.send(Ok(Frame::data(Bytes::from_static(b"abc")))).await.unwrap();
        let (resp, back) = send(tcp, req).await;
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "big");
        // The upload went on after the answer, to its end.
        tx.send(Ok(Frame::data(Bytes::from_static(b"defgh")))).await.unwrap();
        drop(tx);
        assert!(back.lock().unwrap().is_none(), "a connection with an upload going on is not reused");
        assert_eq!(got_rx.await.unwrap(), b"3\r\nabc\r\n5\r\ndefgh\r\n0\r\n\r\n");
    }

    /// A stream of an mpsc receiver's items.
    fn tokio_stream_from<T: Send + 'static>(
        mut rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures_util::Stream<Item = T> {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    /// A body of chunks that says it has ended as its last chunk is taken
    /// (as an HTTP/2 stream's DATA frame with END_STREAM does), of no known
    /// length.
    struct LastEnds(std::collections::VecDeque<Bytes>);

    impl Body for LastEnds {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.get_mut().0.pop_front().map(|b| Ok(Frame::data(b))))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    fn upload(body: impl Body<Data = Bytes, Error = BoxError> + Send + 'static, framing: Framing) -> Upload {
        let head = Bytes::from_static(b"HEAD\r\n\r\n");
        Upload { head, body: crate::tunnel::body::boxed(body), framing, out: VecDeque::new(), done: false }
    }

    #[tokio::test]
    async fn a_chunked_upload_whose_last_chunk_ends_it_written_a_byte_at_a_time() {
        let body = LastEnds([Bytes::from_static(b"abc"), Bytes::from_static(b"de")].into());
        let mut up = upload(body, Framing::Chunked);
        let mut w = Writes::taking(1);
        let mut wrote = false;
        let done = std::future::poll_fn(|cx| up.poll_write(cx, Pin::new(&mut w), &mut wrote)).await;
        assert!(done.is_ok() && wrote);
        // The two frames were there at once: one chunk.
        assert_eq!(String::from_utf8(w.bytes).unwrap(), "HEAD\r\n\r\n5\r\nabcde\r\n0\r\n\r\n");
    }

    /// The writes an upload makes of `batches`: each batch's frames are
    /// sent once the upload waits for its body, then the body ends.
    async fn writes_of(framing: Framing, batches: &[&[&'static [u8]]]) -> (Vec<String>, Result<(), String>) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(64);
        let mut up = upload(http_body_util::StreamBody::new(tokio_stream_from(rx)), framing);
        let (mut w, mut wrote, mut tx, mut batches) =
            (Writes::taking(usize::MAX), false, Some(tx), batches.iter());
        let result = std::future::poll_fn(|cx| {
            loop {
                if let Poll::Ready(r) = up.poll_write(cx, Pin::new(&mut w), &mut wrote) {
                    return Poll::Ready(r);
                }
                match (batches.next(), &tx) {
                    (Some(frames), Some(tx)) => {
                        for f in *frames {
                            tx.try_send(Ok(Frame::data(Bytes::from_static(f)))).unwrap();
                        }
                    }
                    _ => tx = None,
                }
            }
        })
        .await;
        let result = result.map_err(|e| match e {
            UploadError::Write(e) => e.to_string(),
            UploadError::Body(e) => e.to_string(),
        });
        (w.each().into_iter().map(|b| String::from_utf8(b.to_vec()).unwrap()).collect(), result)
    }

    #[tokio::test]
    async fn frames_ready_together_go_out_in_one_write() {
        // Chunked: a batch is one chunk, its size line and line end in the same write.
        let (writes, result) = writes_of(Framing::Chunked, &[&[b"ab", b"cd", b"e"], &[b"fg"]]).await;
        assert_eq!(result, Ok(()));
        assert_eq!(writes, ["HEAD\r\n\r\n", "5\r\nabcde\r\n", "2\r\nfg\r\n", "0\r\n\r\n"]);
        // With a length: the data alone, a write per batch.
        let (writes, result) = writes_of(Framing::Length(7), &[&[b"ab", b"cd", b"e"], &[b"fg"]]).await;
        assert_eq!(result, Ok(()));
        assert_eq!(writes, ["HEAD\r\n\r\n", "abcde", "fg"]);
        // More than the length said: an error, not a longer request.
        let (_, result) = writes_of(Framing::Length(4), &[&[b"ab", b"cd", b"e"]]).await;
        assert_eq!(result, Err(Error::RequestLength.to_string()));
        // Less than it said.
        let (_, result) = writes_of(Framing::Length(9), &[&[b"ab"]]).await;
        assert_eq!(result, Err(Error::RequestLength.to_string()));
    }
}
