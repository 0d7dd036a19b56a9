//! Heads on the multiplexer ([`super::mux`], protocol version 2): a request
//! head, a response head and trailers as HTTP/1.1 text, parsed back by
//! httparse. A request's head is its stream's `Open` header, the response's
//! head and trailers are `Head` frames around the body's bytes.
//!
//! ```text
//! POST https://app.example.com/x HTTP/1.1\r\n    HTTP/1.1 200 \r\n    grpc-status: 0\r\n
//! content-type: text/plain\r\n                  server: app\r\n      \r\n
//! \r\n                                          \r\n
//! ```
//!
//! The request line carries the whole URI (scheme and authority too, as
//! h2's pseudo-headers did). Both ends see `HTTP/2.0` as the version, as
//! they did when h2 carried the heads: the forwarding code does not tell
//! the two apart.

use std::mem::MaybeUninit;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version, request, response};

use crate::constants::names;

/// A head that does not parse: the peer is broken or hostile. The stream
/// is refused; the connection goes on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeadError {
    #[error("the head does not parse: {0}")]
    Parse(String),
    #[error("the head is incomplete")]
    Incomplete,
    #[error("the head has bytes after its end")]
    Trailing,
    #[error("the head's {0} is not valid")]
    Invalid(&'static str),
    /// More field lines than room was made for: only the first, stack-sized
    /// try sees it (the second has room for every line).
    #[error("the head has more fields than lines")]
    TooManyFields,
}

impl HeadError {
    pub fn category(&self) -> &'static str {
        "tunnel_head"
    }
}

/// Field lines, `name: value`, and the head's end.
fn put_headers(b: &mut BytesMut, headers: &HeaderMap) {
    put_fields(b, headers);
    b.put_slice(b"\r\n");
}

/// Field lines, `name: value`.
pub(crate) fn put_fields(b: &mut BytesMut, headers: &HeaderMap) {
    for (name, value) in headers {
        put_field(b, name, value.as_bytes());
    }
}

/// One field line, `name: value` and its end.
fn put_field(b: &mut BytesMut, name: &HeaderName, value: &[u8]) {
    put_field_line(b, name.as_str().as_bytes(), value);
}

/// [`put_field`] for a name as a head's text has it.
pub(crate) fn put_field_line(b: &mut BytesMut, name: &[u8], value: &[u8]) {
    b.put_slice(name);
    b.put_slice(b": ");
    b.put_slice(value);
    b.put_slice(b"\r\n");
}

fn headers_len(headers: &HeaderMap) -> usize {
    headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum::<usize>() + 2
}

/// Field lines a request's head carries after its own, as they are (`name:
/// value` and the line end each): the edge's `X-Forwarded-*`, written as
/// text once rather than inserted into the request's `HeaderMap` and written
/// out of it again (four inserts, their values and their drops were ~2.5 k
/// instructions of every proxied request). Empty for every other stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fields(Bytes);

impl Fields {
    /// Fields written one by one, with room for `capacity` bytes made at once.
    pub fn writer(capacity: usize) -> FieldsWriter {
        FieldsWriter(BytesMut::with_capacity(capacity))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Appends the fields to `headers`: for the h2 wire, which carries a map.
    /// A writer's fields always parse (names are `HeaderName`s, values are
    /// checked in debug builds).
    pub fn append_to(&self, headers: &mut HeaderMap) {
        if self.is_empty() {
            return;
        }
        let mut block = BytesMut::with_capacity(self.0.len() + 2);
        block.put_slice(&self.0);
        block.put_slice(b"\r\n");
        if let Ok(fields) = decode_trailers(&block.freeze()) {
            for (name, value) in &fields {
                headers.append(name.clone(), value.clone());
            }
        }
    }
}

/// Writes [`Fields`].
pub struct FieldsWriter(BytesMut);

impl FieldsWriter {
    /// One field line; `value` holds only what a field value may (checked in
    /// debug builds, the fuzz targets' among them).
    pub fn field(&mut self, name: &HeaderName, value: &[u8]) -> &mut Self {
        debug_assert!(HeaderValue::from_bytes(value).is_ok(), "{name}: {value:?} is not a field value");
        put_field(&mut self.0, name, value);
        self
    }

    pub fn finish(self) -> Fields {
        Fields(self.0.freeze())
    }
}

/// A request's head on the multiplexer: the request line, its fields, then
/// `extra`'s.
pub fn encode_request(head: &request::Parts, extra: &Fields) -> Bytes {
    // The URI as its `Display` writes it, without the formatting machinery.
    let uri = &head.uri;
    let scheme = uri.scheme_str().unwrap_or_default();
    let authority = uri.authority().map_or("", |a| a.as_str());
    let (path, query) = (uri.path(), uri.query());
    let uri_len = scheme.len() + 3 + authority.len() + path.len() + query.map_or(0, |q| q.len() + 1);
    let mut b = BytesMut::with_capacity(
        head.method.as_str().len() + uri_len + 12 + headers_len(&head.headers) + extra.0.len(),
    );
    b.put_slice(head.method.as_str().as_bytes());
    b.put_u8(b' ');
    if !scheme.is_empty() {
        b.put_slice(scheme.as_bytes());
        b.put_slice(b"://");
    }
    b.put_slice(authority.as_bytes());
    b.put_slice(path.as_bytes());
    if let Some(query) = query {
        b.put_u8(b'?');
        b.put_slice(query.as_bytes());
    }
    b.put_slice(b" HTTP/1.1\r\n");
    put_fields(&mut b, &head.headers);
    b.put_slice(&extra.0);
    b.put_slice(b"\r\n");
    b.freeze()
}

pub fn encode_response(head: &response::Parts) -> Bytes {
    response_text(head.status, headers_len(&head.headers), |b| put_fields(b, &head.headers))
}

/// A response head as the multiplexer carries it: the status line, the
/// field lines `fields` writes (each `name: value` and its line end, taken
/// as they are) and the head's end. `len`: their size, room made at once.
/// [`encode_response`], and the [`WireHead`] of a head read as text.
pub fn response_text(status: StatusCode, len: usize, fields: impl FnOnce(&mut BytesMut)) -> Bytes {
    let mut b = BytesMut::with_capacity(15 + len);
    b.put_slice(b"HTTP/1.1 ");
    b.put_slice(status.as_str().as_bytes());
    b.put_slice(b" \r\n");
    fields(&mut b);
    b.put_slice(b"\r\n");
    b.freeze()
}

pub fn encode_trailers(trailers: &HeaderMap) -> Bytes {
    let mut b = BytesMut::with_capacity(headers_len(trailers));
    put_headers(&mut b, trailers);
    b.freeze()
}

/// A response head already in the multiplexer's form, made by code that
/// read it as text (the agent's HTTP/1 client): it
/// rides in the response's extensions and goes on the wire as it is, and the
/// response's own `HeaderMap` is empty. Building the map only to write it out
/// again was a sixth of the agent's instructions per proxied request.
///
/// Whoever makes one has left out the hop-by-hop fields, as
/// [`crate::http::strip_hop_by_hop`] would; names keep the case they came in.
#[derive(Debug, Clone)]
pub struct WireHead(pub Bytes);

/// Puts a [`WireHead`]'s fields back into the response's `HeaderMap`, for
/// code that reads or edits them (response filters, the h2 wire). A head
/// without one is left as it is.
pub fn unwire(head: &mut response::Parts) -> Result<(), HeadError> {
    if let Some(WireHead(block)) = head.extensions.remove::<WireHead>() {
        head.headers = decode_response(&block)?.headers;
    }
    Ok(())
}

/// A head's size counted as HTTP/2 counts a header list (RFC 9113, section
/// 6.5.2: name, value and 32 bytes per field, pseudo-fields included): the
/// tunnel holds heads to the same limit on either wire.
fn list_size<'a>(pseudo: impl IntoIterator<Item = (&'a str, usize)>, headers: &HeaderMap) -> usize {
    let fields = headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 32).sum::<usize>();
    pseudo.into_iter().map(|(n, v)| n.len() + v + 32).sum::<usize>() + fields
}

pub fn request_list_size(head: &request::Parts) -> usize {
    let uri = &head.uri;
    let pseudo = [
        (":method", head.method.as_str().len()),
        (":scheme", uri.scheme_str().map_or(0, str::len)),
        (":authority", uri.authority().map_or(0, |a| a.as_str().len())),
        (":path", uri.path_and_query().map_or(1, |p| p.as_str().len())),
    ];
    list_size(pseudo, &head.headers)
}

pub fn response_list_size(head: &response::Parts) -> usize {
    list_size([(":status", 3)], &head.headers)
}

/// Field lines a head usually has at most: room for them on the stack.
const STACK_FIELDS: usize = 32;

/// Runs `parse` with room for [`STACK_FIELDS`] field lines on the stack,
/// and again with room on the heap for every line of `block` when that was
/// not enough (counting the lines first cost every head a pass over its
/// bytes). The slots start as `empty`: left unwritten for heads
/// ([`crate::http::FieldSlots`]); trailers' parser wants them written.
fn with_slots<T: Copy, R>(
    block: &[u8],
    empty: T,
    mut parse: impl FnMut(&mut [T]) -> Result<R, HeadError>,
) -> Result<R, HeadError> {
    match parse(&mut [empty; STACK_FIELDS]) {
        Err(HeadError::TooManyFields) => {
            let lines = block.iter().filter(|&&c| c == b'\n').count();
            parse(&mut vec![empty; lines])
        }
        done => done,
    }
}

/// What httparse made of the whole `block`, whose length (`parsed`) must be
/// the block's own.
fn complete<T>(
    status: httparse::Result<T>,
    parsed: impl Fn(&T) -> usize,
    block: &[u8],
) -> Result<T, HeadError> {
    match status {
        Ok(httparse::Status::Complete(done)) if parsed(&done) == block.len() => Ok(done),
        Ok(httparse::Status::Complete(_)) => Err(HeadError::Trailing),
        Ok(httparse::Status::Partial) => Err(HeadError::Incomplete),
        Err(httparse::Error::TooManyHeaders) => Err(HeadError::TooManyFields),
        Err(e) => Err(HeadError::Parse(e.to_string())),
    }
}

/// The fields as a map whose values are slices of `block` (no copies), and
/// whose names are the standard ones or culvert's own statics where they
/// can be (a name outside both is copied).
fn header_map(block: &Bytes, fields: &[httparse::Header<'_>]) -> Result<HeaderMap, HeadError> {
    let mut headers = HeaderMap::with_capacity(fields.len());
    for f in fields {
        let name = match names::known(f.name.as_bytes()) {
            Some(name) => name,
            None => {
                HeaderName::from_bytes(f.name.as_bytes()).map_err(|_| HeadError::Invalid("field name"))?
            }
        };
        // SAFETY: httparse took every byte of the value (`\t`, ` ` to `~`,
        // 0x80 to 0xFF: its `HEADER_VALUE_MAP`), which are the bytes a
        // `HeaderValue` may hold (`http`'s `is_valid`), so checking them
        // again is not needed: that was a quarter of a decoded field's
        // instructions. Debug builds check anyway (this function does), and
        // `httparse_takes_only_what_a_header_value_holds` tries every byte.
        let value = unsafe { HeaderValue::from_maybe_shared_unchecked(block.slice_ref(f.value)) };
        headers.append(name, value);
    }
    Ok(headers)
}

pub fn decode_request(block: &Bytes) -> Result<request::Parts, HeadError> {
    with_slots(block, MaybeUninit::uninit(), |fields| {
        let (req, parsed) = crate::http::parse_request(block, fields);
        complete(parsed, |&n| n, block)?;
        let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes())
            .map_err(|_| HeadError::Invalid("method"))?;
        let uri = Uri::from_maybe_shared(block.slice_ref(req.path.unwrap_or_default().as_bytes()))
            .map_err(|_| HeadError::Invalid("URI"))?;
        let headers = header_map(block, req.headers)?;
        let (mut parts, ()) = http::Request::new(()).into_parts();
        (parts.method, parts.uri, parts.version, parts.headers) = (method, uri, Version::HTTP_2, headers);
        Ok(parts)
    })
}

pub fn decode_response(block: &Bytes) -> Result<response::Parts, HeadError> {
    with_slots(block, MaybeUninit::uninit(), |fields| {
        let (resp, parsed) = crate::http::parse_response(block, fields);
        complete(parsed, |&n| n, block)?;
        let status =
            StatusCode::from_u16(resp.code.unwrap_or_default()).map_err(|_| HeadError::Invalid("status"))?;
        let headers = header_map(block, resp.headers)?;
        let (mut parts, ()) = http::Response::new(()).into_parts();
        (parts.status, parts.version, parts.headers) = (status, Version::HTTP_2, headers);
        Ok(parts)
    })
}

pub fn decode_trailers(block: &Bytes) -> Result<HeaderMap, HeadError> {
    with_slots(block, httparse::EMPTY_HEADER, |fields| {
        let (_, fields) = complete(httparse::parse_headers(block, fields), |&(n, _)| n, block)?;
        header_map(block, fields)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_round_trip() {
        let req = http::Request::post("https://app.example.com/a/b?c=d%20e")
            .header("content-type", "text/plain")
            .header("x-many", "1")
            .header("x-many", "2")
            .header("x-odd", HeaderValue::from_bytes(b"caf\xc3\xa9 \t tab").unwrap())
            .body(())
            .unwrap();
        let (parts, ()) = req.into_parts();
        let back = decode_request(&encode_request(&parts, &Fields::default())).unwrap();
        assert_eq!((back.method, &back.uri, back.version), (Method::POST, &parts.uri, Version::HTTP_2));
        assert_eq!(back.headers, parts.headers);

        let (parts, ()) = http::Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("upgrade", "websocket")
            .body(())
            .unwrap()
            .into_parts();
        let back = decode_response(&encode_response(&parts)).unwrap();
        assert_eq!((back.status, back.headers), (parts.status, parts.headers));

        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        assert_eq!(decode_trailers(&encode_trailers(&trailers)).unwrap(), trailers);
        assert_eq!(decode_trailers(&encode_trailers(&HeaderMap::new())).unwrap(), HeaderMap::new());

        let (parts, ()) = http::Request::get("/").body(()).unwrap().into_parts();
        assert_eq!(decode_request(&encode_request(&parts, &Fields::default())).unwrap().uri, "/");
    }

    /// The request line's target is the URI as `Display` writes it.
    #[test]
    fn the_target_is_the_whole_uri() {
        for uri in ["https://app.example.com/a/b?c=d%20e", "https://app.example.com", "/", "/p?", "/p?q", "*"]
        {
            let (parts, ()) = http::Request::get(uri).body(()).unwrap().into_parts();
            let line = format!("GET {} HTTP/1.1\r\n", parts.uri);
            assert!(encode_request(&parts, &Fields::default()).starts_with(line.as_bytes()), "{uri}");
        }
    }

    /// Past the fields that fit on the stack, and with culvert's own names
    /// (parsed back to the statics): the same head back, its values slices
    /// of the block.
    #[test]
    fn heads_with_many_fields_and_culvert_names_round_trip() {
        let mut req =
            http::Request::get("https://app.example.com/p").header(&names::X_FORWARDED_FOR, "203.0.113.9");
        for i in 0..STACK_FIELDS + 8 {
            req = req.header(format!("x-field-{i}"), format!("value {i}"));
        }
        let (parts, ()) = req.header(&names::STREAM, "http").body(()).unwrap().into_parts();
        let block = encode_request(&parts, &Fields::default());
        let back = decode_request(&block).unwrap();
        assert_eq!((&back.uri, &back.headers), (&parts.uri, &parts.headers));
        let value = back.headers[&names::X_FORWARDED_FOR].as_bytes().as_ptr_range();
        assert!(block.as_ptr_range().contains(&value.start), "a value is a slice of the block");

        let mut trailers = HeaderMap::new();
        for i in 0..STACK_FIELDS * 2 {
            trailers.append("x-many", HeaderValue::from(i));
        }
        assert_eq!(decode_trailers(&encode_trailers(&trailers)).unwrap(), trailers);
    }

    /// Extra fields go after the request's own, as they were written, and
    /// read back as the same fields into a map.
    #[test]
    fn extra_fields_follow_a_requests_own() {
        let (parts, ()) = http::Request::get("https://app.example.com/")
            .header("x-own", "1")
            .body(())
            .unwrap()
            .into_parts();
        let mut extra = Fields::writer(0);
        extra.field(&names::X_FORWARDED_HOST, b"app.example.com").field(&names::X_FORWARDED_PROTO, b"https");
        let extra = extra.finish();
        assert_eq!(extra.as_bytes(), b"x-forwarded-host: app.example.com\r\nx-forwarded-proto: https\r\n");
        let block = encode_request(&parts, &extra);
        assert_eq!(
            &block[..],
            b"GET https://app.example.com/ HTTP/1.1\r\nx-own: 1\r\n\
              x-forwarded-host: app.example.com\r\nx-forwarded-proto: https\r\n\r\n"
        );
        let mut headers = parts.headers.clone();
        extra.append_to(&mut headers);
        assert_eq!(decode_request(&block).unwrap().headers, headers);
        assert_eq!(headers.len(), 3);
        assert_eq!(
            encode_request(&parts, &Fields::default()),
            "GET https://app.example.com/ HTTP/1.1\r\nx-own: 1\r\n\r\n"
        );
    }

    #[test]
    fn heads_that_cannot_be_are_refused() {
        assert_eq!(
            decode_request(&Bytes::from_static(b"GET / HTTP/1.1\r\n")).unwrap_err(),
            HeadError::Incomplete
        );
        assert_eq!(
            decode_request(&Bytes::from_static(b"GET / HTTP/1.1\r\n\r\nbody")).unwrap_err(),
            HeadError::Trailing
        );
        assert!(matches!(
            decode_request(&Bytes::from_static(b"GET / HTTP/1.1\r\nbad name: x\r\n\r\n")),
            Err(HeadError::Parse(_))
        ));
        assert!(matches!(
            decode_request(&Bytes::from_static(b"GET \x01 HTTP/1.1\r\n\r\n")),
            Err(HeadError::Parse(_))
        ));
        assert!(decode_response(&Bytes::from_static(b"HTTP/1.1 099 \r\n\r\n")).is_err());
        assert_eq!(decode_trailers(&Bytes::from_static(b"x: 1\r\n")), Err(HeadError::Incomplete));
        assert!(decode_request(&Bytes::from_static(b"")).is_err());
    }

    /// What `header_map` relies on to skip the check of each value: a byte
    /// httparse takes in a value, in any place, a `HeaderValue` holds too.
    #[test]
    fn httparse_takes_only_what_a_header_value_holds() {
        for b in 0..=255u8 {
            for at in 0..3 {
                let mut value = b"ab".to_vec();
                value.insert(at, b);
                let mut block = b"x: ".to_vec();
                block.extend_from_slice(&value);
                block.extend_from_slice(b"\r\n\r\n");
                let mut fields = [httparse::EMPTY_HEADER; 2];
                let taken = match httparse::parse_headers(&block, &mut fields) {
                    Ok(httparse::Status::Complete((_, fields))) => fields.first().map(|f| f.value.to_vec()),
                    _ => None,
                };
                if let Some(taken) = taken {
                    assert!(HeaderValue::from_bytes(&taken).is_ok(), "byte {b:#04x} at {at}: {taken:?}");
                }
            }
        }
    }
}
