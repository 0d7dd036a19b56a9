//! HTTP helpers shared by the edge and the agent: what is stripped from a
//! forwarded head, the text and error pages either side answers with, error
//! chains for messages, and percent-decoding. A leaf: it depends on no role.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};

/// The body type of the pages built here (the same type as
/// `tunnel::body::BoxBody`).
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, crate::BoxError>;

fn full(data: impl Into<Bytes>) -> BoxBody {
    Full::new(data.into()).map_err(|never| match never {}).boxed_unsync()
}

/// Removes every header whose name `drop` picks, in one pass over the
/// names: most heads carry none of them, and one lookup per candidate name
/// (each hashed, many parsed from a string first) was a few per cent of a
/// proxied request's instructions on either side.
fn remove_headers(headers: &mut HeaderMap, drop: impl Fn(&HeaderName) -> bool) {
    // One name at a time, no list: a head rarely has more than one.
    while let Some(name) = headers.keys().find(|k| drop(k)).cloned() {
        headers.remove(name);
    }
}

/// Whether a header belongs to one hop (it is never forwarded), whatever the
/// `Connection` header lists besides.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    is_hop_by_hop_name(name.as_str().as_bytes())
}

/// [`is_hop_by_hop`] for a name as a head's text has it, in any case. Every
/// head's every name goes through here: its length and first letter rule
/// out all but one candidate, and most names at once.
pub fn is_hop_by_hop_name(name: &[u8]) -> bool {
    let Some(first) = name.first().map(u8::to_ascii_lowercase) else {
        return false;
    };
    let hop: &[u8] = match (name.len(), first) {
        (2, b't') => b"te",
        (7, b't') => b"trailer",
        (7, b'u') => b"upgrade",
        (10, b'c') => b"connection",
        (10, b'k') => b"keep-alive",
        (16, b'p') => b"proxy-connection",
        (17, b't') => b"transfer-encoding",
        (18, b'p') => b"proxy-authenticate",
        (19, b'p') => b"proxy-authorization",
        _ => return false,
    };
    name.eq_ignore_ascii_case(hop)
}

/// Headers that belong to one hop and are never forwarded.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_hop_by_hop_and(headers, |_| false);
}

/// The hop-by-hop headers, those a `Connection` lists, and those `also`
/// picks. A head with none of them (so no `Connection` either) costs one
/// pass over its names.
pub fn strip_hop_by_hop_and(headers: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) {
    let drop = |k: &HeaderName| is_hop_by_hop(k) || also(k);
    if headers.keys().any(drop) {
        strip_connection_listed(headers);
        remove_headers(headers, drop);
    }
}

/// The header names a `Connection` value lists (RFC 9110, section 7.6.1),
/// without the connection's options, `close` and `keep-alive`.
pub fn connection_listed(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(<[u8]>::trim_ascii).filter(|t| {
        !t.is_empty() && !t.eq_ignore_ascii_case(b"close") && !t.eq_ignore_ascii_case(b"keep-alive")
    })
}

/// The field names the `Connection` fields of a parsed head list
/// ([`connection_listed`] of each): fields of this hop, as the hop-by-hop
/// ones are.
pub fn connection_listed_in<'b>(fields: &[httparse::Header<'b>]) -> impl Iterator<Item = &'b [u8]> {
    fields
        .iter()
        .filter(|f| f.name.eq_ignore_ascii_case("connection"))
        .flat_map(|f| connection_listed(f.value))
}

/// Removes the headers the `Connection` header names (the rest of
/// [`strip_hop_by_hop`] is [`is_hop_by_hop`]).
fn strip_connection_listed(headers: &mut HeaderMap) {
    // One lookup when there is none: gathering the names of none cost
    // twice that.
    if !headers.contains_key(header::CONNECTION) {
        return;
    }
    // The common values (`keep-alive`, `close`, `Upgrade`) name no header
    // that stays anyway: no name is made for them.
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| connection_listed(v.as_bytes()))
        .filter_map(|name| HeaderName::from_bytes(name).ok())
        .filter(|name| !is_hop_by_hop(name))
        .collect();
    for name in listed {
        headers.remove(name);
    }
}

/// Hop-by-hop and culvert's own headers, in one pass: what neither side
/// passes on, whichever way a head goes.
pub fn strip_hop_by_hop_and_culvert(headers: &mut HeaderMap) {
    strip_hop_by_hop_and(headers, is_culvert_header);
}

/// Whether a header is one of culvert's own wire headers.
pub fn is_culvert_header(name: &HeaderName) -> bool {
    is_culvert_name(name.as_str().as_bytes())
}

/// [`is_culvert_header`] for a name as a head's text has it, in any case.
pub fn is_culvert_name(name: &[u8]) -> bool {
    name.len() >= 8 && name[..8].eq_ignore_ascii_case(b"culvert-")
}

/// `n` in decimal, written into `buf` (without the formatting machinery).
pub fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Room for `N` field lines that httparse fills in, left unwritten: an
/// array of `httparse::EMPTY_HEADER`s is stored whole before every parse
/// (a hundred of them, ~400 instructions), though httparse writes the
/// lines it reads and hands back only those.
pub type FieldSlots<'b, const N: usize> = [std::mem::MaybeUninit<httparse::Header<'b>>; N];

/// [`FieldSlots`], not yet written.
pub const fn field_slots<'b, const N: usize>() -> FieldSlots<'b, N> {
    [const { std::mem::MaybeUninit::uninit() }; N]
}

/// A request head at the start of `buf`, its fields read into `slots`.
pub fn parse_request<'h, 'b>(
    buf: &'b [u8],
    slots: &'h mut [std::mem::MaybeUninit<httparse::Header<'b>>],
) -> (httparse::Request<'h, 'b>, httparse::Result<usize>) {
    let mut req = httparse::Request::new(&mut []);
    let status = httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut req, buf, slots);
    (req, status)
}

/// A response head at the start of `buf`, its fields read into `slots`.
pub fn parse_response<'h, 'b>(
    buf: &'b [u8],
    slots: &'h mut [std::mem::MaybeUninit<httparse::Header<'b>>],
) -> (httparse::Response<'h, 'b>, httparse::Result<usize>) {
    let mut resp = httparse::Response::new(&mut []);
    let status = httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut resp, buf, slots);
    (resp, status)
}

/// The current time as an HTTP date (`Sun, 06 Nov 1994 08:49:37 GMT`),
/// formatted once a second per thread.
pub fn with_http_date<R>(f: impl FnOnce(&[u8]) -> R) -> R {
    thread_local! {
        static DATE: std::cell::RefCell<(u64, [u8; 29])> = const { std::cell::RefCell::new((0, [0; 29])) };
    }
    let now = std::time::SystemTime::now();
    let secs = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|date| {
        let mut date = date.borrow_mut();
        if date.0 != secs {
            date.1.copy_from_slice(httpdate::fmt_http_date(now).as_bytes());
            date.0 = secs;
        }
        f(&date.1)
    })
}

/// An error and its sources on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// A plain-text answer.
pub fn text(status: StatusCode, msg: &str) -> Response<BoxBody> {
    let mut r = Response::new(full(msg.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// A short error page naming the host and the reason.
pub fn error_page(status: StatusCode, host: &str, reason: &str) -> Response<BoxBody> {
    let esc =
        |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
    let title = format!("{} {}", status.as_u16(), status.canonical_reason().unwrap_or(""));
    let page = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title></head>\
         <body><h1>{title}</h1><p><b>{}</b>: {}</p><hr><p>culvert edge</p></body></html>\n",
        esc(host),
        esc(reason)
    );
    let mut r = Response::new(full(page));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Decodes `%XX` escapes; `None` when an escape is bad or the result is not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let (bytes, clean) = decode_escapes(s);
    if !clean {
        return None;
    }
    String::from_utf8(bytes).ok()
}

/// Decodes the `%XX` escapes that are good and keeps the rest as written;
/// bytes that are not UTF-8 become U+FFFD.
pub fn percent_decode_lossy(s: &str) -> String {
    String::from_utf8_lossy(&decode_escapes(s).0).into_owned()
}

/// The decoded bytes, and whether every `%` began a good escape.
fn decode_escapes(s: &str) -> (Vec<u8>, bool) {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut clean = true;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
            clean = false;
        }
        out.push(bytes[i]);
        i += 1;
    }
    (out, clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%3Db%2Cc").as_deref(), Some("a=b,c"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(percent_decode_lossy("us%65r%zz%4"), "user%zz%4");
        assert_eq!(percent_decode_lossy("p%40ss"), "p@ss");
    }

    #[test]
    fn hop_by_hop_names_in_any_case() {
        for name in [
            "connection",
            "transfer-encoding",
            "upgrade",
            "te",
            "trailer",
            "proxy-authorization",
            "proxy-authenticate",
            "keep-alive",
            "proxy-connection",
        ] {
            assert!(is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
            assert!(is_hop_by_hop_name(name.to_ascii_uppercase().as_bytes()), "{name}");
        }
        for name in ["", "t", "tf", "trailers", "x-upgrade", "content-length", "keep-alivE2", "Upgrad3"] {
            assert!(!is_hop_by_hop_name(name.as_bytes()), "{name}");
        }
        let listed = |v: &'static str| connection_listed(v.as_bytes()).collect::<Vec<_>>();
        assert_eq!(listed("keep-alive, Close"), Vec::<&[u8]>::new());
        assert_eq!(listed(" X-A ,, close,x-b"), [&b"X-A"[..], b"x-b"]);
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, HeaderValue::from_static("close, x-a"));
        h.append(header::CONNECTION, HeaderValue::from_static("X-B"));
        for name in ["x-a", "x-b", "x-c"] {
            h.insert(name, HeaderValue::from_static("1"));
        }
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(HeaderName::as_str).collect::<Vec<_>>(), ["x-c"]);
    }

    #[test]
    fn error_chains() {
        let inner = std::io::Error::other("refused");
        let outer = std::io::Error::other(Wrap(inner));
        assert_eq!(error_chain(&outer), "wrapped: refused");
    }

    #[derive(Debug)]
    struct Wrap(std::io::Error);
    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("wrapped")
        }
    }
    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("culvert-stream", HeaderValue::from_static("tcp"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        h.append(header::TE, HeaderValue::from_static("trailers"));
        h.append(header::TE, HeaderValue::from_static("gzip"));
        strip_hop_by_hop(&mut h);
        remove_headers(&mut h, is_culvert_header);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
        // Nothing to remove: the map is left alone.
        remove_headers(&mut h, is_culvert_header);
        assert_eq!(h.len(), 1);
    }

    /// Both kinds in one call, and the names a `Connection` lists; a head
    /// with none of them keeps every field.
    #[test]
    fn hop_by_hop_and_culvert_headers_are_stripped_together() {
        let mut h = HeaderMap::new();
        h.insert("x-kept", HeaderValue::from_static("1"));
        h.insert("culvert-error", HeaderValue::from_static("x"));
        h.insert(header::SERVER, HeaderValue::from_static("app"));
        let untouched = h.clone();
        h.remove("culvert-error");
        let mut plain = h.clone();
        strip_hop_by_hop_and_culvert(&mut plain);
        assert_eq!(plain, h);
        let mut h = untouched;
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        strip_hop_by_hop_and_culvert(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["server", "x-kept"]);
        // Only a culvert header: it goes too.
        let mut h = HeaderMap::new();
        h.insert("culvert-stream", HeaderValue::from_static("tcp"));
        strip_hop_by_hop_and_culvert(&mut h);
        assert!(h.is_empty());
    }
}
