//! Heads on their way through the edge: the public request's head rewritten
//! for the tunnel (hop-by-hop and culvert headers, `X-Forwarded-*`, `Host`,
//! culvert's stream headers) and the agent's response head cleaned for the
//! client.

use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::InvalidUri;
use http::{Request, Uri};

use crate::constants::{STREAM_HEADER, UPGRADE_HEADER};
use crate::http::{strip_culvert_headers, strip_hop_by_hop};
use crate::tunnel::StreamKind;

/// The request's host: `:authority` (h2) or `Host` (HTTP/1.1).
pub(super) fn request_host<B>(req: &Request<B>) -> Option<String> {
    req.uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| req.headers().get(header::HOST).and_then(|h| h.to_str().ok()).map(str::to_string))
}

/// Rewrites a public request's head into the head of one h2 stream to an
/// agent of `host`: the URI becomes `https://{host}{path and query}`,
/// hop-by-hop and culvert headers are dropped, client-supplied forwarding
/// headers are replaced by the edge's own, `Host` goes (the URI carries it),
/// and the stream kind (and the upgrade asked for) is added. Fails when the
/// request target does not make a URI.
pub(super) fn rewrite_request(
    parts: &mut http::request::Parts,
    host: &str,
    peer: SocketAddr,
    scheme: &'static str,
    upgrade: Option<&HeaderValue>,
) -> Result<(), InvalidUri> {
    let pq = parts.uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| "/".into());
    let uri = Uri::try_from(format!("https://{host}{pq}"))?;
    strip_hop_by_hop(&mut parts.headers);
    strip_culvert_headers(&mut parts.headers);
    let h = &mut parts.headers;
    // Client-supplied forwarding headers are replaced, never trusted.
    for name in ["x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-real-ip", "forwarded"] {
        h.remove(name);
    }
    h.remove(header::HOST);
    h.insert("x-forwarded-for", HeaderValue::from_str(&peer.ip().to_string()).expect("ip is ascii"));
    h.insert("x-forwarded-proto", HeaderValue::from_static(scheme));
    if let Ok(v) = HeaderValue::from_str(host) {
        h.insert("x-forwarded-host", v);
    }
    let kind = if upgrade.is_some() { StreamKind::Upgrade } else { StreamKind::Http };
    h.insert(STREAM_HEADER, HeaderValue::from_static(kind.header_value()));
    if let Some(u) = upgrade {
        h.insert(UPGRADE_HEADER, u.clone());
    }
    parts.uri = uri;
    parts.version = http::Version::HTTP_2;
    Ok(())
}

/// Cleans the agent's response head for the client: hop-by-hop and culvert
/// headers are dropped.
pub(super) fn clean_response(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    strip_culvert_headers(headers);
}
