//! Heads on their way through the edge: the public request's head rewritten
//! for the tunnel (hop-by-hop and culvert headers, `X-Forwarded-*`, `Host`,
//! culvert's stream headers) and the agent's response head cleaned for the
//! client.

use std::net::{IpAddr, SocketAddr};

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, StatusCode, Uri};

use http::header::HeaderName;

use crate::constants::{MAX_HEADER_BYTES, UPGRADE_HEADER, names};
use crate::edge::routes::normalize_host;
use crate::http::{is_culvert_header, strip_hop_by_hop_and, strip_hop_by_hop_and_culvert};
use crate::tunnel::StreamKind;
use crate::tunnel::head::Fields;

/// The request's host: `:authority` (h2) or `Host` (HTTP/1.1).
pub(crate) fn request_host<B>(req: &Request<B>) -> Option<&str> {
    req.uri()
        .authority()
        .map(|a| a.as_str())
        .or_else(|| req.headers().get(header::HOST).and_then(|h| h.to_str().ok()))
}

/// Whether a header carries a client address or port as some proxy or CDN
/// saw it: a client's own are never passed on (the edge sets `X-Forwarded-*`).
fn is_client_address_header(name: &HeaderName) -> bool {
    is_client_address_name(name.as_str().as_bytes())
}

/// [`is_client_address_header`] for a name as a head's text has it, in any case.
fn is_client_address_name(name: &[u8]) -> bool {
    const NAMES: [&[u8]; 10] = [
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"x-forwarded-port",
        b"x-real-ip",
        b"forwarded",
        b"true-client-ip",
        b"x-client-ip",
        b"cf-connecting-ip",
        b"x-original-forwarded-for",
    ];
    NAMES.iter().any(|n| n.len() == name.len() && n.eq_ignore_ascii_case(name))
}

/// Whether a public request's field, named as its text has it, goes on to
/// the agent: not hop-by-hop, culvert's, `Host` (the target carries it) or
/// a client address ([`rewrite_request`] drops the same).
pub(crate) fn is_forwarded_name(name: &[u8]) -> bool {
    !(crate::http::is_hop_by_hop_name(name)
        || crate::http::is_culvert_name(name)
        || name.eq_ignore_ascii_case(b"host")
        || is_client_address_name(name))
}

/// Why a public request head is refused before it goes anywhere: the status
/// to answer (431 or 400) and the reason.
pub(super) fn refuse_head<B: hyper::body::Body>(req: &Request<B>) -> Option<(StatusCode, &'static str)> {
    // hyper's HTTP/1 limit is on its read buffer, and a head that completes
    // within the read that crosses it gets through: the exact bound is here.
    // HTTP/2 heads were held to it by h2 already (`max_header_list_size`,
    // which counts more per field than this).
    if req.version() < http::Version::HTTP_2 && head_len(req) > MAX_HEADER_BYTES {
        let why = "request head too large: it is over the edge's 64 KiB; send fewer or smaller header fields";
        return Some((StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, why));
    }
    let bad = |why| Some((StatusCode::BAD_REQUEST, why));
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return bad("bad request: more than one Host header");
    }
    // h2: a Host next to :authority must name the same host.
    if let (Some(authority), Some(host)) = (req.uri().authority(), host)
        && !host.to_str().is_ok_and(|h| normalize_host(h) == normalize_host(authority.as_str()))
    {
        return bad("bad request: the Host header differs from the request's authority");
    }
    None
}

/// The length of `req`'s head as HTTP/1.1 writes it: the request line, and
/// `name: value\r\n` per field.
fn head_len<B>(req: &Request<B>) -> usize {
    let target = req.uri().path_and_query().map_or(1, |pq| pq.as_str().len());
    let fields: usize = req.headers().iter().map(|(n, v)| n.as_str().len() + v.len() + 4).sum();
    req.method().as_str().len() + target + " HTTP/1.1\r\n".len() + 1 + fields + 2
}

/// Rewrites a public request's head into the head of one stream to an agent
/// of `host`: the URI becomes `https://{host}{path and query}`, hop-by-hop
/// and culvert headers are dropped, `Host` goes (the URI carries it), and the
/// stream kind (and the upgrade asked for) is added. Client-supplied
/// forwarding headers are dropped too: the edge's own are returned, as
/// [`Fields`] the stream's head carries after the request's. Fails when the
/// request target does not make a URI.
pub(crate) fn rewrite_request(
    parts: &mut http::request::Parts,
    host: &str,
    peer: SocketAddr,
    scheme: &'static str,
    port: u16,
    upgrade: Option<&HeaderValue>,
) -> Result<Fields, BadTarget> {
    let pq = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    // Origin form only: `OPTIONS *` (or `PRI *`) is about the edge, not a
    // tenant's backend, and `https://host*` would name another authority.
    if !pq.as_str().starts_with('/') {
        return Err(BadTarget);
    }
    // From its parts: the path is the request's own (parsed once, by hyper).
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTPS);
    let authority = Authority::from_maybe_shared(bytes::Bytes::copy_from_slice(host.as_bytes()))
        .map_err(|_| BadTarget)?;
    uri.authority = Some(authority);
    uri.path_and_query = Some(pq);
    let uri = Uri::from_parts(uri).map_err(|_| BadTarget)?;
    // One pass drops hop-by-hop and culvert headers, the `Host` (the URI
    // carries it) and client-supplied forwarding headers: replaced, never trusted.
    strip_hop_by_hop_and(&mut parts.headers, |k| {
        is_culvert_header(k) || k == header::HOST || is_client_address_header(k)
    });
    // A plain request goes without `culvert-stream` (an HTTP stream is what
    // a stream without one is): one field less to write, decode and strip.
    if let Some(u) = upgrade {
        let h = &mut parts.headers;
        h.insert(names::STREAM.clone(), HeaderValue::from_static(StreamKind::Upgrade.header_value()));
        h.insert(UPGRADE_HEADER, u.clone());
    }
    parts.uri = uri;
    parts.version = http::Version::HTTP_2;
    Ok(forwarding_fields(host, peer, scheme, port))
}

/// The edge's `X-Forwarded-*` fields for a request from `peer` to `host`,
/// which the stream's head carries after the request's own.
pub(crate) fn forwarding_fields(host: &str, peer: SocketAddr, scheme: &'static str, port: u16) -> Fields {
    // The host is a valid authority, so a valid field value.
    let mut fields = Fields::writer(FORWARDING_LEN + host.len());
    fields
        .field(&names::X_FORWARDED_PORT, crate::http::decimal(port.into(), &mut [0; 20]))
        .field(&names::X_FORWARDED_FOR, address_text(peer.ip(), &mut [0; 15]).as_ref())
        .field(&names::X_FORWARDED_PROTO, scheme.as_bytes())
        .field(&names::X_FORWARDED_HOST, host.as_bytes());
    fields.finish()
}

/// The bytes of the forwarding fields but the host's value, with room for
/// an IPv6 address.
const FORWARDING_LEN: usize = 4 * "x-forwarded-proto: \r\n".len() + 5 + 39 + 5;

/// An address as text; IPv4 written by hand into `buf` (its `Display`,
/// through the formatting machinery, was a fifth of `rewrite_request`).
fn address_text(ip: IpAddr, buf: &mut [u8; 15]) -> std::borrow::Cow<'_, [u8]> {
    let IpAddr::V4(v4) = ip else {
        return std::borrow::Cow::Owned(ip.to_string().into_bytes());
    };
    let mut len = 0;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            buf[len] = b'.';
            len += 1;
        }
        for (place, digit) in [(100, octet / 100), (10, octet / 10 % 10), (1, octet % 10)] {
            if octet >= place || place == 1 {
                buf[len] = b'0' + digit;
                len += 1;
            }
        }
    }
    std::borrow::Cow::Borrowed(&buf[..len])
}

/// A request target the edge does not forward (answered `400`).
#[derive(Debug)]
pub(crate) struct BadTarget;

/// Cleans the agent's response head for the client: hop-by-hop and culvert
/// headers are dropped.
pub(super) fn clean_response(headers: &mut HeaderMap) {
    strip_hop_by_hop_and_culvert(headers);
}

#[cfg(test)]
mod tests {
    /// The head limit is on the head as written, to the byte.
    #[test]
    fn heads_over_the_limit_are_refused_with_431() {
        let head = |value: usize| {
            let req = http::Request::get("/a?b")
                .header("x-big", "v".repeat(value))
                .body(http_body_util::Empty::<bytes::Bytes>::new());
            super::refuse_head(&req.unwrap()).map(|(status, _)| status.as_u16())
        };
        // "GET /a?b HTTP/1.1\r\n" + "x-big: …\r\n" + "\r\n"
        let fits = super::MAX_HEADER_BYTES - 19 - 9 - 2;
        assert_eq!(head(fits), None);
        assert_eq!(head(fits + 1), Some(431));
    }

    #[test]
    fn addresses_and_ports_as_text() {
        let text = |ip: std::net::IpAddr| super::address_text(ip, &mut [0; 15]).into_owned();
        for ip in ["0.0.0.0", "203.0.113.9", "10.100.1.255", "255.255.255.255", "1.20.100.0", "2001:db8::1"] {
            assert_eq!(text(ip.parse().unwrap()), ip.as_bytes());
        }
        for o in 0..=255u8 {
            let ip = std::net::Ipv4Addr::new(o, o / 3, 255 - o, o % 10);
            assert_eq!(text(ip.into()), ip.to_string().as_bytes());
        }
        for n in [0u64, 1, 9, 10, 80, 443, 8080, 9999, 10000, 65535, u64::MAX] {
            assert_eq!(crate::http::decimal(n, &mut [0; 20]), n.to_string().as_bytes());
        }
    }

    /// Found by the `http_head` fuzz target: `PRI * HTTP/1.0` (asterisk
    /// form) was rewritten to `https://app.example.com*`, another authority.
    #[test]
    fn only_origin_form_targets_are_forwarded() {
        let peer = "203.0.113.9:40000".parse().unwrap();
        for (method, target, ok) in [
            ("OPTIONS", "*", false),
            ("PRI", "*", false),
            ("GET", "/a?b=c", true),
            ("GET", "http://x.test/p", true),
        ] {
            let req = http::Request::builder().method(method).uri(target).body(()).unwrap();
            let (mut parts, _) = req.into_parts();
            let got = super::rewrite_request(&mut parts, "app.example.com", peer, "https", 443, None);
            assert_eq!(got.is_ok(), ok, "{method} {target}");
            if ok {
                assert_eq!(parts.uri.authority().unwrap().as_str(), "app.example.com", "{target}");
            }
        }
    }
}
