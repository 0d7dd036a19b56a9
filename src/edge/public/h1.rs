//! Public HTTP/1.1 without hyper, for the requests that need nothing but
//! forwarding: a `GET` or `HEAD` without a body, for a host an HTTP
//! reservation holds. The head is read with httparse and written once, as
//! the text of its tunnel stream's head ([`Outgoing::Text`]); the agent's answer
//! comes back as text and goes to the client as it came, hop-by-hop and
//! culvert fields left out. hyper made a `HeaderMap` of each head, the
//! request's and the response's, and wrote it out again: two fifths of the
//! edge's instructions per request (bench/README.md, session 29).
//!
//! Anything else (a body, an upgrade, `Expect`, `Connection: close`,
//! HTTP/1.0, the edge's own paths and hosts, the default host, a head that
//! does not parse) hands the connection, with the bytes read of it, to
//! hyper ([`Served::Rest`]), which serves it from that request on as it did
//! before, refusals and error pages included.

use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tracing::{Instrument, debug};

use super::retry::{self, Answer, Outgoing};
use super::{FirstRequest, head};
use crate::api::{Reservation, ReservationKind};
use crate::constants::{FIRST_REQUEST_GRACE, HEADER_READ_TIMEOUT, MAX_HEADER_BYTES, RESERVED_PREFIX};
use crate::edge::Edge;
use crate::edge::acme::HTTP01_PREFIX;
use crate::edge::routes::RouteIndex;
use crate::edge::sni::Prefixed;
use crate::edge::stop::Cancelled;
use crate::http::{decimal, field_slots, is_culvert_name, is_hop_by_hop_name, parse_request, parse_response};
use crate::tunnel::body::BoxBody;
use crate::tunnel::budget::BudgetSlot;
use crate::tunnel::head::{Fields, put_field_line, put_fields};
use crate::tunnel::stream::RecvBody;

/// Fields a request head may have here; one with more goes to hyper.
const MAX_FIELDS: usize = 64;
/// Fields an agent's response head may have (hyper's client took 100).
const MAX_RESPONSE_FIELDS: usize = 100;
/// The largest response head taken from an agent, counted as HTTP/2 counts
/// a header list (what the tunnel's client holds other heads to).
const MAX_RESPONSE_LIST: usize = 16 * 1024;
/// Body bytes up to this go into the write buffer with the head (a small
/// answer leaves in one write); a larger chunk is written as it is, with
/// what the buffer holds, in one vectored write (TLS seals it from there:
/// copying it first cost a download 3 % more CPU).
const COPY_MAX: usize = 1024;
/// The write buffer goes out once it holds this much, and is let go after a
/// response that left it larger.
const FLUSH_AT: usize = 64 * 1024;

/// How a connection left the fast path.
pub(super) enum Served<IO> {
    /// It ended (the client closed, an error, the edge draining).
    Closed,
    /// A request the fast path does not serve: hyper serves the rest of the
    /// connection, from the bytes read.
    Rest(Prefixed<IO>),
}

/// Where a public connection came in.
pub(super) struct Public<'a> {
    pub edge: &'a Arc<Edge>,
    pub peer: SocketAddr,
    /// `https`, or `http` on the plain port.
    pub scheme: &'static str,
    pub first: &'a FirstRequest,
}

/// Serves the requests on `io` that need nothing but forwarding, until the
/// connection ends or a request needs hyper. `admit` runs before each
/// request is forwarded: a refusal is answered and the connection closed.
pub(super) async fn serve<IO>(
    at: Public<'_>,
    mut io: IO,
    mut admit: impl FnMut() -> Option<Response<BoxBody>>,
) -> Served<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let edge = at.edge;
    let port = if at.scheme == "https" { edge.https_port } else { edge.http_port };
    let (mut buf, mut out) = (BytesMut::new(), BytesMut::new());
    // hyper's header read timeout: from the start of each wait for a head.
    let mut timer = Box::pin(tokio::time::sleep(HEADER_READ_TIMEOUT));
    let mut served = false;
    // The forwarding fields, and the host they were made for.
    let mut forwarding: Option<(String, Fields)> = None;
    // Made once: each wait for a head selects on it.
    let mut draining = Cancelled::new(&edge.shutdown);
    loop {
        let routes = edge.routes();
        let mut deadline = None;
        let (len, request) = loop {
            let mut fields = field_slots::<MAX_FIELDS>();
            match read_request(&buf, &mut fields) {
                Parse::Request(req) => {
                    let Some(reservation) = forwardable(edge, &routes, &req, at.scheme) else {
                        return Served::Rest(Prefixed::new(buf.freeze(), io));
                    };
                    let host = reservation.hostname.as_deref().unwrap_or_default();
                    // The same for every request of the connection to one host.
                    let fields = match &mut forwarding {
                        Some((h, fields)) if h == host => &*fields,
                        cached => {
                            let fields = head::forwarding_fields(host, at.peer, at.scheme, port);
                            &cached.insert((host.to_string(), fields)).1
                        }
                    };
                    let Some(tunnel_head) = tunnel_head(&req, host, fields) else {
                        return Served::Rest(Prefixed::new(buf.freeze(), io));
                    };
                    break (
                        req.len,
                        Request { reservation, head: tunnel_head, bodiless_answer: req.is_head },
                    );
                }
                Parse::Other => return Served::Rest(Prefixed::new(buf.freeze(), io)),
                Parse::Partial => {}
            }
            // Draining: a connection between requests closes; the first
            // request, or one on its way, gets FIRST_REQUEST_GRACE.
            let drain = edge.shutdown.is_cancelled();
            if drain && served && buf.is_empty() {
                return Served::Closed;
            }
            let limit = if drain { FIRST_REQUEST_GRACE } else { HEADER_READ_TIMEOUT };
            let until = Instant::now() + limit;
            if deadline.is_none_or(|d| until < d) {
                deadline = Some(until);
                timer.as_mut().reset(until);
            }
            buf.reserve(4096);
            let read = tokio::select! {
                biased;
                read = io.read_buf(&mut buf) => read,
                () = &mut timer => {
                    debug!("no request head in time");
                    return Served::Closed;
                }
                () = &mut draining, if !drain => continue,
            };
            match read {
                Ok(0) => return Served::Closed,
                Ok(_) => {}
                Err(e) => {
                    debug!(error = %e, "reading a request head failed");
                    return Served::Closed;
                }
            }
        };
        at.first.arrived();
        served = true;
        buf.advance(len);
        if let Some(refused) = admit() {
            let _ = write_page(&mut io, &mut out, refused, true).await;
            return Served::Closed;
        }
        let span = tracing::debug_span!(
            "proxy",
            host = request.reservation.hostname.as_deref().unwrap_or(""),
            method = if request.bodiless_answer { "HEAD" } else { "GET" }
        );
        let kept = forward(edge, request, &mut io, &mut out).instrument(span).await;
        if out.capacity() > 2 * FLUSH_AT {
            out = BytesMut::new();
        }
        if !kept {
            let _ = io.shutdown().await;
            return Served::Closed;
        }
    }
}

/// A request the fast path forwards.
struct Request<'r> {
    reservation: &'r Reservation,
    /// Its head as the tunnel carries it.
    head: Bytes,
    /// A `HEAD`: the answer has no body, whatever its head says.
    bodiless_answer: bool,
}

/// Forwards `request` and writes the answer to `io`. Whether the connection
/// may serve another request: the answer was whole, and the edge was not
/// draining when it began (the answer then says `connection: close`).
async fn forward<IO>(edge: &Edge, request: Request<'_>, io: &mut IO, out: &mut BytesMut) -> bool
where
    IO: AsyncWrite + Unpin,
{
    let reservation = request.reservation;
    let name = reservation.hostname.as_deref().unwrap_or_default();
    let counters = edge.metrics.bytes(name);
    let tunnel = counters.tunnel;
    tunnel.request();
    let outgoing = Outgoing::Text(request.head);
    let sent = retry::send(edge, reservation, name, outgoing, &tunnel, &BudgetSlot::default()).await;
    // A drain that began while the agent answered ends the connection too.
    let close = edge.shutdown.is_cancelled();
    let (block, mut body, guard) = match sent {
        Ok((Answer::Text(block, body), guard)) => (block, body, guard),
        Ok((Answer::Response(_), _)) => unreachable!("a text head is answered as text"),
        Err(page) => return write_page(io, out, page, close).await.is_ok() && !close,
    };
    let framing = match response_head(&block, request.bodiless_answer, || body.is_end_stream(), close, out) {
        Ok((status, framing)) => {
            tunnel.answered(status);
            framing
        }
        Err(why) => {
            debug!(why, "the agent's response head was refused");
            tunnel.answered(StatusCode::BAD_GATEWAY);
            out.clear();
            let page = crate::http::error_page(StatusCode::BAD_GATEWAY, name, why);
            return write_page(io, out, page, close).await.is_ok() && !close;
        }
    };
    let whole = write_body(io, out, &mut body, framing, &counters.outbound).await;
    drop((body, guard));
    whole && !close
}

/// How a response's body is framed on the public connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body (a `HEAD`, 204, 304).
    None,
    /// `content-length`.
    Length(u64),
    Chunked,
}

/// Writes `body` after its head (in `out`), framed; whether all of it went
/// out as framed, so that the connection can serve another request.
async fn write_body<IO>(
    io: &mut IO,
    out: &mut BytesMut,
    body: &mut RecvBody,
    framing: Framing,
    counter: &prometheus_client::metrics::counter::Counter,
) -> bool
where
    IO: AsyncWrite + Unpin,
{
    let mut left = match framing {
        Framing::None => return flush(io, out).await.is_ok(),
        Framing::Length(n) => n,
        Framing::Chunked => u64::MAX,
    };
    let whole = loop {
        // What is there already goes out with what came before it.
        let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await;
        let frame = match polled {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                if flush(io, out).await.is_err() {
                    return false;
                }
                body.frame().await
            }
        };
        let data = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                // Trailers: HTTP/1.1 clients get none (as from hyper).
                Err(_) => continue,
            },
            None => break framing == Framing::Chunked || left == 0,
            Some(Err(e)) => {
                debug!(error = %e, "the response body from the tunnel failed");
                break false;
            }
        };
        if data.is_empty() {
            continue;
        }
        counter.inc_by(data.len() as u64);
        if framing == Framing::Chunked {
            put_chunk_size(out, data.len());
        } else if data.len() as u64 > left {
            debug!("the agent sent more than the response's content-length");
            out.put_slice(&data[..left as usize]);
            break false;
        } else {
            left -= data.len() as u64;
        }
        if data.len() <= COPY_MAX {
            out.put_slice(&data);
        } else if write_both(io, out, &data).await.is_err() {
            return false;
        }
        if framing == Framing::Chunked {
            out.put_slice(b"\r\n");
        }
        // What the tunnel has ready may outrun the client: a bounded buffer.
        if out.len() >= FLUSH_AT && flush_buffer(io, out).await.is_err() {
            return false;
        }
    };
    if whole && framing == Framing::Chunked {
        out.put_slice(b"0\r\n\r\n");
    }
    flush(io, out).await.is_ok() && whole
}

fn put_chunk_size(out: &mut BytesMut, len: usize) {
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    let mut n = len;
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.put_slice(&digits[at..]);
    out.put_slice(b"\r\n");
}

/// Writes what `out` holds, without flushing the connection.
async fn flush_buffer<IO: AsyncWrite + Unpin>(io: &mut IO, out: &mut BytesMut) -> std::io::Result<()> {
    if !out.is_empty() {
        io.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

/// Writes what `out` holds, then `data`, in vectored writes (a large chunk
/// is not copied).
async fn write_both<IO: AsyncWrite + Unpin>(
    io: &mut IO,
    out: &mut BytesMut,
    data: &[u8],
) -> std::io::Result<()> {
    let (mut head, mut data) = (&out[..], data);
    while !head.is_empty() || !data.is_empty() {
        let n = io.write_vectored(&[std::io::IoSlice::new(head), std::io::IoSlice::new(data)]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let taken = n.min(head.len());
        head = &head[taken..];
        data = &data[n - taken..];
    }
    out.clear();
    Ok(())
}

/// Writes what `out` holds and flushes the connection (a TLS record goes out).
async fn flush<IO: AsyncWrite + Unpin>(io: &mut IO, out: &mut BytesMut) -> std::io::Result<()> {
    flush_buffer(io, out).await?;
    io.flush().await
}

/// Writes a response the edge made itself (an error page, a refusal): its
/// body is small and whole.
async fn write_page<IO>(
    io: &mut IO,
    out: &mut BytesMut,
    page: Response<BoxBody>,
    close: bool,
) -> std::io::Result<()>
where
    IO: AsyncWrite + Unpin,
{
    let (parts, body) = page.into_parts();
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    put_status(out, parts.status);
    put_fields(out, &parts.headers);
    put_field_line(out, b"content-length", decimal(body.len() as u64, &mut [0; 20]));
    put_date(out);
    if close && !parts.headers.contains_key(http::header::CONNECTION) {
        out.put_slice(b"connection: close\r\n");
    }
    out.put_slice(b"\r\n");
    out.put_slice(&body);
    flush(io, out).await
}

fn put_status(out: &mut BytesMut, status: StatusCode) {
    out.put_slice(b"HTTP/1.1 ");
    out.put_slice(status.as_str().as_bytes());
    out.put_u8(b' ');
    out.put_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.put_slice(b"\r\n");
}

fn put_date(out: &mut BytesMut) {
    crate::http::with_http_date(|date| put_field_line(out, b"date", date));
}

/// The agent's response head (`block`, the multiplexer's text) written into
/// `out` for the client: the status line, its fields but hop-by-hop and
/// culvert ones, `date` when it has none, and the framing of its body.
/// `ended`: whether the body has already ended (a response without
/// `content-length` then says `content-length: 0`, not chunked). Fails with
/// why when the agent's head is not one to pass on.
fn response_head(
    block: &[u8],
    bodiless_answer: bool,
    ended: impl FnOnce() -> bool,
    close: bool,
    out: &mut BytesMut,
) -> Result<(StatusCode, Framing), &'static str> {
    let mut fields = field_slots::<MAX_RESPONSE_FIELDS>();
    let (resp, parsed) = parse_response(block, &mut fields);
    match parsed {
        Ok(httparse::Status::Complete(n)) if n == block.len() => {}
        _ => return Err("the agent's response head does not parse"),
    }
    let status =
        resp.code.and_then(|c| StatusCode::from_u16(c).ok()).ok_or("the agent's status is invalid")?;
    if status.is_informational() {
        return Err("the agent answered with an interim status");
    }
    let size: usize = 42 + resp.headers.iter().map(|f| f.name.len() + f.value.len() + 32).sum::<usize>();
    if size > MAX_RESPONSE_LIST {
        return Err("the response head is over 16 KiB");
    }
    // Fields a `Connection` names are this hop's too (an agent sends none).
    let listed: Vec<&[u8]> = crate::http::connection_listed_in(resp.headers).collect();
    out.reserve(block.len() + 96);
    put_status(out, status);
    let (mut length, mut dated) = (None, false);
    for f in resp.headers.iter() {
        let name = f.name.as_bytes();
        if is_hop_by_hop_name(name)
            || is_culvert_name(name)
            || listed.iter().any(|l| l.eq_ignore_ascii_case(name))
        {
            continue;
        }
        if name.eq_ignore_ascii_case(b"content-length") {
            let n = parse_length(f.value).ok_or("the agent's content-length is invalid")?;
            if length.is_some_and(|l| l != n) {
                return Err("the agent's content-length fields differ");
            }
            if length.is_some() {
                continue;
            }
            length = Some(n);
        }
        dated |= name.eq_ignore_ascii_case(b"date");
        put_field_line(out, name, f.value);
    }
    if !dated {
        put_date(out);
    }
    let framing = if bodiless_answer || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED
    {
        Framing::None
    } else if let Some(n) = length {
        Framing::Length(n)
    } else if ended() {
        out.put_slice(b"content-length: 0\r\n");
        Framing::Length(0)
    } else {
        out.put_slice(b"transfer-encoding: chunked\r\n");
        Framing::Chunked
    };
    if close {
        out.put_slice(b"connection: close\r\n");
    }
    out.put_slice(b"\r\n");
    Ok((status, framing))
}

/// A `content-length` value: digits only.
fn parse_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 19 {
        return None;
    }
    value.iter().try_fold(0u64, |n, &b| b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0')))
}

/// The reservation `req` goes to, when the fast path forwards it: a host
/// (not the default host) of an HTTP reservation, and on the plain port with
/// `--plain-http` only, never an ACME HTTP-01 answer.
fn forwardable<'r>(
    edge: &Edge,
    routes: &'r RouteIndex,
    req: &RequestHead<'_, '_>,
    scheme: &str,
) -> Option<&'r Reservation> {
    if scheme == "http" && (!edge.plain_http || edge.acme.is_some() && req.target.starts_with(HTTP01_PREFIX))
    {
        return None;
    }
    let reservation = routes.host(req.host)?;
    (reservation.kind != ReservationKind::Tcp && !reservation.is_default_host()).then_some(reservation)
}

/// `req`'s head as its tunnel stream carries it to `host` (what `head::rewrite_request`
/// and the tunnel's `encode_request` make of a request hyper read): the
/// target as `https://{host}{path and query}`, the client's fields but
/// hop-by-hop, culvert, `Host` and forwarding ones, then the edge's
/// forwarding fields. `None` when the target is not one hyper takes.
fn tunnel_head(req: &RequestHead<'_, '_>, host: &str, forwarding: &Fields) -> Option<Bytes> {
    let pq = http::uri::PathAndQuery::try_from(req.target).ok()?;
    let fields: usize = req.fields.iter().map(|f| f.name.len() + f.value.len() + 4).sum();
    let method: &[u8] = if req.is_head { b"HEAD" } else { b"GET" };
    let mut b = BytesMut::with_capacity(
        method.len() + 9 + host.len() + pq.as_str().len() + 11 + fields + forwarding.as_bytes().len() + 2,
    );
    b.put_slice(method);
    b.put_slice(b" https://");
    b.put_slice(host.as_bytes());
    b.put_slice(pq.as_str().as_bytes());
    b.put_slice(b" HTTP/1.1\r\n");
    for f in req.fields {
        if head::is_forwarded_name(f.name.as_bytes()) {
            put_field_line(&mut b, f.name.as_bytes(), f.value);
        }
    }
    b.put_slice(forwarding.as_bytes());
    b.put_slice(b"\r\n");
    Some(b.freeze())
}

/// What the head at the start of a connection's buffer is.
enum Parse<'b, 'h> {
    /// Not all there yet.
    Partial,
    /// One the fast path may forward, if its host is a tenant's.
    Request(RequestHead<'b, 'h>),
    /// One for hyper.
    Other,
}

/// A `GET` or `HEAD` without a body, HTTP/1.1, in origin form, with one
/// `Host` and no field that asks more of a proxy than forwarding.
struct RequestHead<'b, 'h> {
    /// The head's length in the buffer.
    len: usize,
    is_head: bool,
    target: &'b str,
    host: &'b str,
    fields: &'h [httparse::Header<'b>],
}

fn read_request<'b, 'h>(buf: &'b [u8], fields: &'h mut [MaybeUninit<httparse::Header<'b>>]) -> Parse<'b, 'h> {
    let (req, parsed) = parse_request(buf, fields);
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_HEADER_BYTES => return Parse::Partial,
        // Too large, too many fields, not HTTP/1: hyper's answer.
        _ => return Parse::Other,
    };
    let (Some(method), Some(target), Some(1)) = (req.method, req.path, req.version) else {
        return Parse::Other;
    };
    let is_head = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Parse::Other,
    };
    if !target.starts_with('/') || target.starts_with(RESERVED_PREFIX) {
        return Parse::Other;
    }
    let mut host = None;
    // The head as `head::refuse_head` measures it.
    let mut written = method.len() + 1 + target.len() + " HTTP/1.1\r\n".len() + 2;
    for f in req.headers.iter() {
        written += f.name.len() + f.value.len() + 4;
        let name = f.name.as_bytes();
        match name.len() {
            4 if name.eq_ignore_ascii_case(b"host") => {
                if host.is_some() {
                    return Parse::Other;
                }
                // A `Host` that is not visible ASCII names no host (as `to_str` says).
                match std::str::from_utf8(f.value) {
                    Ok(h) if h.bytes().all(|b| b.is_ascii_graphic()) => host = Some(h),
                    _ => return Parse::Other,
                }
            }
            // A body, or a proxy asked for more than forwarding.
            6 if name.eq_ignore_ascii_case(b"expect") => return Parse::Other,
            7 if name.eq_ignore_ascii_case(b"upgrade") => return Parse::Other,
            14 if name.eq_ignore_ascii_case(b"content-length") => return Parse::Other,
            17 if name.eq_ignore_ascii_case(b"transfer-encoding") => return Parse::Other,
            10 if name.eq_ignore_ascii_case(b"connection")
                && !f.value.trim_ascii().eq_ignore_ascii_case(b"keep-alive") =>
            {
                return Parse::Other;
            }
            _ => {}
        }
    }
    let Some(host) = host else { return Parse::Other };
    if written > MAX_HEADER_BYTES {
        return Parse::Other;
    }
    Parse::Request(RequestHead { len, is_head, target, host, fields: req.headers })
}

/// What the `http_head` fuzz target holds this module to, `data` being what
/// a client sends and, again, what an agent answers. A request the fast path
/// forwards gets the tunnel head hyper's path makes of it (as the agent
/// decodes both): the same method, target and fields, the client's
/// forwarding, culvert and hop-by-hop fields left out. A response head it
/// passes on parses as one, with none of those fields and one framing.
pub(crate) fn check_heads(data: &[u8]) {
    let mut fields = field_slots::<MAX_FIELDS>();
    if let Parse::Request(req) = read_request(data, &mut fields) {
        let peer: SocketAddr = "203.0.113.9:40000".parse().expect("an address");
        let host = "app.example.com";
        let forwarding = head::forwarding_fields(host, peer, "https", 443);
        if let Some(fast) = tunnel_head(&req, host, &forwarding) {
            let fast = crate::tunnel::head::decode_request(&fast).expect("the fast path's head parses");
            let mut request =
                http::Request::builder().method(if req.is_head { "HEAD" } else { "GET" }).uri(req.target);
            for f in req.fields {
                request = request.header(f.name, f.value);
            }
            let (mut parts, ()) = request.body(()).expect("what httparse took, http takes").into_parts();
            let forwarding =
                head::rewrite_request(&mut parts, host, peer, "https", 443, None).expect("origin form");
            let slow = crate::tunnel::head::encode_request(&parts, &forwarding);
            let slow = crate::tunnel::head::decode_request(&slow).expect("the edge's head parses");
            assert_eq!((&fast.method, &fast.uri), (&slow.method, &slow.uri));
            let sorted = |h: &http::HeaderMap| {
                let mut v: Vec<_> = h.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect();
                v.sort();
                v
            };
            assert_eq!(sorted(&fast.headers), sorted(&slow.headers));
        }
    }
    let mut out = BytesMut::new();
    if let Ok((status, framing)) = response_head(data, false, || false, false, &mut out) {
        let mut fields = [httparse::EMPTY_HEADER; MAX_RESPONSE_FIELDS + 2];
        let mut resp = httparse::Response::new(&mut fields);
        assert_eq!(resp.parse(&out), Ok(httparse::Status::Complete(out.len())), "the head written parses");
        assert_eq!(resp.code, Some(status.as_u16()));
        let framed = resp.headers.iter().filter(|f| {
            f.name.eq_ignore_ascii_case("content-length") || f.name.eq_ignore_ascii_case("transfer-encoding")
        });
        assert!(framed.count() <= 1 || framing == Framing::None, "one framing");
        for f in resp.headers.iter() {
            let name = f.name.as_bytes();
            assert!(!is_culvert_name(name), "{} reaches the client", f.name);
            assert!(
                !is_hop_by_hop_name(name) || f.name.eq_ignore_ascii_case("transfer-encoding"),
                "{} reaches the client",
                f.name
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> &'static str {
        let mut fields = field_slots::<MAX_FIELDS>();
        match read_request(text.as_bytes(), &mut fields) {
            Parse::Partial => "partial",
            Parse::Request(_) => "fast",
            Parse::Other => "hyper",
        }
    }

    /// What the fast path takes, and what goes to hyper: anything with a
    /// body, an upgrade, an expectation, another version or connection
    /// handling, the edge's own paths, or a host that is not one.
    #[test]
    fn only_bodiless_gets_and_heads_take_the_fast_path() {
        for (head, want) in [
            ("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n", "fast"),
            ("HEAD /x?y HTTP/1.1\r\nhost: a.test\r\nConnection: Keep-Alive\r\n\r\n", "fast"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\n", "partial"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nConnection: keep-alive, x-secret\r\n\r\n", "hyper"),
            ("GET / HTTP/1.0\r\nHost: a.test\r\n\r\n", "hyper"),
            ("POST / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 1\r\n\r\nx", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nContent-Length: 0\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nExpect: 100-continue\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.t\u{e9}st\r\n\r\n", "hyper"),
            ("GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n", "hyper"),
            ("OPTIONS * HTTP/1.1\r\nHost: a.test\r\n\r\n", "hyper"),
            ("GET /_culvert/v1/connect HTTP/1.1\r\nHost: a.test\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\r\nHost: a.test\r\nX: a\r\n b\r\n\r\n", "hyper"),
            ("GET / HTTP/1.1\nHost: a.test\n\n", "fast"),
            ("\x16\x03\x01", "hyper"),
        ] {
            assert_eq!(parse(head), want, "{head:?}");
        }
        // Over the edge's head limit, whole or not.
        let big = format!("GET / HTTP/1.1\r\nHost: a.test\r\nX: {}\r\n\r\n", "v".repeat(MAX_HEADER_BYTES));
        assert_eq!(parse(&big), "hyper");
        assert_eq!(parse(&big[..MAX_HEADER_BYTES + 10]), "hyper");
        // More fields than the fast path reads.
        let many = format!("GET / HTTP/1.1\r\nHost: a.test\r\n{}\r\n", "X: y\r\n".repeat(MAX_FIELDS));
        assert_eq!(parse(&many), "hyper");
    }

    /// The tunnel head made here is the one hyper's path makes of the same
    /// request (`head::rewrite_request`, then the tunnel's `encode_request`),
    /// as the agent decodes them ([`check_heads`]).
    #[test]
    fn the_tunnel_head_is_the_one_hyper_s_path_makes() {
        let text = "GET /p/a%20th?q=1&r#frag HTTP/1.1\r\nHost: App.Example.com:8443\r\nAccept: */*\r\n\
                    X-Forwarded-For: 6.6.6.6\r\nforwarded: for=x\r\nCulvert-Stream: tcp\r\nTE: trailers\r\n\
                    Proxy-Authorization: Basic eA==\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\
                    Cookie: a=1\r\nX-Two: 1\r\ncookie: b=2\r\n\r\n";
        check_heads(text.as_bytes());
        let mut fields = field_slots::<MAX_FIELDS>();
        let Parse::Request(req) = read_request(text.as_bytes(), &mut fields) else { panic!("not fast") };
        assert_eq!(req.len, text.len());
        let peer: SocketAddr = "203.0.113.9:40000".parse().unwrap();
        let forwarding = head::forwarding_fields("app.example.com", peer, "https", 443);
        let fast = tunnel_head(&req, "app.example.com", &forwarding).unwrap();
        let fast = crate::tunnel::head::decode_request(&fast).unwrap();
        assert_eq!(fast.uri.to_string(), "https://app.example.com/p/a%20th?q=1&r");
        let names: Vec<_> = fast.headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "accept",
                "cookie",
                "x-two",
                "x-forwarded-port",
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-forwarded-host"
            ]
        );
        assert_eq!(fast.headers["x-forwarded-for"], "203.0.113.9");
    }

    fn answer(
        block: &str,
        head: bool,
        ended: bool,
        close: bool,
    ) -> Result<(u16, Framing, String), &'static str> {
        let mut out = BytesMut::new();
        let (status, framing) = response_head(block.as_bytes(), head, || ended, close, &mut out)?;
        Ok((status.as_u16(), framing, String::from_utf8(out.to_vec()).unwrap()))
    }

    /// The agent's head goes to the client as it came but for what is this
    /// hop's or culvert's, with a `date`, and framed as its body is.
    #[test]
    fn the_agent_s_head_is_written_for_the_client() {
        let (status, framing, text) = answer(
            "HTTP/1.1 200 \r\nContent-Type: text/plain\r\nContent-Length: 5\r\nculvert-error: x\r\n\
             Connection: x-hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=1\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\n\r\n",
            false,
            false,
            false,
        )
        .unwrap();
        assert_eq!((status, framing), (200, Framing::Length(5)));
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\
             Date: Sun, 06 Nov 1994 08:49:37 GMT\r\n\r\n"
        );
        // No length: chunked, or `content-length: 0` when the body has ended.
        let (_, framing, text) = answer("HTTP/1.1 404 \r\nx-a: b\r\n\r\n", false, false, true).unwrap();
        assert_eq!(framing, Framing::Chunked);
        assert!(text.starts_with("HTTP/1.1 404 Not Found\r\nx-a: b\r\ndate: "), "{text}");
        assert!(text.ends_with(" GMT\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"), "{text}");
        let (_, framing, text) = answer("HTTP/1.1 200 \r\n\r\n", false, true, false).unwrap();
        assert_eq!(framing, Framing::Length(0));
        assert!(text.ends_with("content-length: 0\r\n\r\n"), "{text}");
        // A HEAD, 204 and 304 have no body whatever their head says.
        for (block, head) in [
            ("HTTP/1.1 200 \r\ncontent-length: 9\r\n\r\n", true),
            ("HTTP/1.1 204 \r\n\r\n", false),
            ("HTTP/1.1 304 \r\ncontent-length: 9\r\n\r\n", false),
        ] {
            let (_, framing, text) = answer(block, head, false, false).unwrap();
            assert_eq!(framing, Framing::None, "{block}");
            assert!(!text.contains("transfer-encoding"), "{text}");
        }
        // Heads not to pass on.
        for block in [
            "HTTP/1.1 200 \r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            "HTTP/1.1 200 \r\ncontent-length: -1\r\n\r\n",
            "HTTP/1.1 200 \r\ncontent-length: 1 2\r\n\r\n",
            "HTTP/1.1 100 \r\n\r\n",
            "HTTP/1.1 200 \r\nx: a\r\nb\r\n\r\n",
            "HTTP/1.1 200 \r\n\r\ntrailing",
            "HTTP/1.1 200 \r\n",
            "nonsense",
        ] {
            assert!(answer(block, false, false, false).is_err(), "{block:?}");
        }
        let big = format!("HTTP/1.1 200 \r\nx: {}\r\n\r\n", "v".repeat(MAX_RESPONSE_LIST));
        assert!(answer(&big, false, false, false).is_err());
        // The same length twice is one.
        let (_, framing, text) =
            answer("HTTP/1.1 200 \r\ncontent-length: 3\r\nContent-Length: 3\r\n\r\n", false, false, false)
                .unwrap();
        assert_eq!(framing, Framing::Length(3));
        assert_eq!(text.matches("ength: 3").count(), 1, "{text}");
    }

    #[test]
    fn chunk_sizes_in_hex() {
        for n in [0usize, 1, 15, 16, 255, 4096, 65535, 1 << 20] {
            let mut out = BytesMut::new();
            put_chunk_size(&mut out, n);
            assert_eq!(out, format!("{n:x}\r\n").as_bytes());
        }
    }
}
