//! Forwarding HTTP requests, the one path for every HTTP stream (the
//! standalone agent's with the default options, the operator's with its
//! routes'): who may pass ([`admit`]), the body size limit (413), the scheme
//! of the backend (HTTP, h2c, HTTPS; pooled connections: [`backend::client`])
//! and the read timeout (504), the route's filters ([`super::filters`]:
//! URLRewrite, then the head made for the backend, then
//! RequestHeaderModifier; ResponseHeaderModifier on the answer). Also the
//! header rules every forwarded head follows, and the agent's own answers
//! (errors, redirects).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri};
use tokio::net::TcpStream;
use tracing::warn;

use super::backend::{self, Access, RouteOptions, Scheme};
use super::guard::{IdleTimeoutBody, LimitedBody};
use crate::constants::ERROR_HEADER;
use crate::http::{error_chain, strip_hop_by_hop, strip_hop_by_hop_and_culvert};
use crate::tunnel::body::{self, BoxBody};
use crate::tunnel::stream::RecvBody;

/// A response the agent makes itself, marked so the edge can tell.
pub fn agent_error(status: StatusCode, message: &str) -> Response<BoxBody> {
    let mut resp = Response::new(body::full(format!("culvert agent: {message}\n")));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    if let Ok(v) = HeaderValue::from_str(message) {
        h.insert(ERROR_HEADER, v);
    }
    resp
}

/// The agent's own answer of a route: a redirect to `location` (with the
/// route's response header changes), or an error.
pub fn answer(
    status: StatusCode,
    location: Option<&str>,
    message: &str,
    options: &RouteOptions,
) -> Response<BoxBody> {
    let Some(location) = location else {
        return agent_error(status, message);
    };
    let mut resp = Response::new(body::empty());
    *resp.status_mut() = status;
    match HeaderValue::from_str(location) {
        Ok(v) => resp.headers_mut().insert(header::LOCATION, v),
        Err(_) => {
            return agent_error(StatusCode::BAD_REQUEST, "the redirect's Location is not a header value");
        }
    };
    options.filters.edit_response(resp.headers_mut());
    resp
}

/// The request head as the backend sees it: origin-form URI, the public Host.
pub fn backend_request(mut parts: http::request::Parts) -> http::request::Parts {
    let host = parts.uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
    let pq = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    parts.uri = Uri::from(pq);
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop_and_culvert(&mut parts.headers);
    if let Some(host) = host {
        parts.headers.insert(header::HOST, host);
    }
    parts
}

/// Why a backend gave no response head.
#[derive(Debug, thiserror::Error)]
enum BackendError {
    #[error(transparent)]
    Pool(#[from] super::pool::PoolError),
    #[error(transparent)]
    Client(#[from] hyper_util::client::legacy::Error),
}

impl BackendError {
    fn is_connect(&self) -> bool {
        match self {
            BackendError::Pool(e) => e.is_connect(),
            BackendError::Client(e) => e.is_connect(),
        }
    }
}

/// Checks the request's credentials (removing them, so the backend never
/// sees them): `Err` is the answer to send instead.
#[allow(clippy::result_large_err)]
pub fn admit(headers: &mut HeaderMap, options: &RouteOptions) -> Result<(), Response<BoxBody>> {
    match &options.access {
        Access::Open => Ok(()),
        Access::Unavailable(why) => Err(agent_error(StatusCode::SERVICE_UNAVAILABLE, why)),
        Access::Credentials(c) if c.allows(headers) => {
            headers.remove(header::AUTHORIZATION);
            Ok(())
        }
        Access::Credentials(c) => {
            let mut resp = agent_error(StatusCode::UNAUTHORIZED, "authentication required");
            for v in c.challenges() {
                resp.headers_mut().append(header::WWW_AUTHENTICATE, v);
            }
            Err(resp)
        }
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

fn too_large(max: u64) -> Response<BoxBody> {
    agent_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("the request body is larger than this route allows ({max} bytes)"),
    )
}

/// Forwards one request to `authority` as `options` say.
pub async fn http(
    mut parts: http::request::Parts,
    body: RecvBody,
    authority: &str,
    options: &Arc<RouteOptions>,
) -> Response<BoxBody> {
    if let Err(refused) = admit(&mut parts.headers, options) {
        return refused;
    }
    if let Some(max) = options.max_body
        && content_length(&parts.headers).is_some_and(|n| n > max)
    {
        return too_large(max);
    }
    if let Err(e) = options.filters.rewrite_request(&mut parts) {
        return agent_error(StatusCode::BAD_REQUEST, &e);
    }
    // The public host (or the rewritten one): the TLS server name of an HTTPS backend.
    let server_name = parts.uri.host().map(str::to_string);
    let mut parts = backend_request(parts);
    options.filters.edit_request(&mut parts.headers);
    if options.scheme != Scheme::Http {
        let pq = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        match Uri::try_from(format!("{}://{authority}{pq}", options.uri_scheme())) {
            Ok(uri) => parts.uri = uri,
            Err(e) => return agent_error(StatusCode::BAD_REQUEST, &e.to_string()),
        }
    }
    let (body, tripped) = match options.max_body {
        Some(max) => {
            let (limited, tripped) = LimitedBody::new(body, max);
            (body::boxed(limited), Some(tripped))
        }
        None => (body::boxed(body), None),
    };
    let request = Request::from_parts(parts, body);
    let sent = async {
        if options.scheme == Scheme::Http {
            Ok(super::pool::send(authority, options.connect_timeout, request).await?)
        } else {
            let client = backend::client(options, server_name.as_deref());
            Ok::<_, BackendError>(client.request(request).await?.map(body::boxed))
        }
    };
    let answer = match options.read_timeout {
        Some(limit) => match tokio::time::timeout(limit, sent).await {
            Ok(r) => r,
            Err(_) => {
                let msg =
                    format!("backend {authority} did not answer within {limit:?} (the route's read timeout)");
                warn!(error = %msg, "http request timed out");
                return agent_error(StatusCode::GATEWAY_TIMEOUT, &msg);
            }
        },
        None => sent.await,
    };
    match answer {
        Ok(resp) => {
            let (mut parts, b) = resp.into_parts();
            // The HTTP/1 client's head goes on as its text, unless the
            // route's filters change it.
            if options.filters.response_headers.is_some()
                && let Err(e) = crate::tunnel::head::unwire(&mut parts)
            {
                return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {authority}: {e}"));
            }
            strip_hop_by_hop(&mut parts.headers);
            options.filters.edit_response(&mut parts.headers);
            let b = match options.read_timeout {
                Some(idle) => body::boxed(IdleTimeoutBody::new(b, idle)),
                None => body::boxed(b),
            };
            Response::from_parts(parts, b)
        }
        Err(_) if tripped.is_some_and(|t| t.load(Ordering::Relaxed)) => {
            too_large(options.max_body.unwrap_or_default())
        }
        Err(e) => {
            let chain = error_chain(&e);
            let hint = match options.scheme {
                Scheme::Https { verify: true } if chain.contains("certificate") => {
                    "; if the backend's certificate is self-signed, set culvert.dev/backend-tls-verify: \"false\""
                }
                Scheme::H2c => "; h2c needs a backend that speaks HTTP/2 in clear text",
                _ => "",
            };
            let what = if e.is_connect() { "unreachable" } else { "failed" };
            let msg = format!("backend {authority} {what}: {chain}{hint}");
            warn!(error = %msg, "http request failed");
            agent_error(StatusCode::BAD_GATEWAY, &msg)
        }
    }
}

/// TLS to an HTTPS backend for an upgraded (WebSocket) stream: HTTP/1.1 by
/// ALPN, the public host as the server name.
pub async fn tls_connect(
    tcp: TcpStream,
    verify: bool,
    server_name: Option<&str>,
    authority: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, String> {
    let mut config = (*backend::tls_config(verify)).clone();
    config.alpn_protocols = vec![crate::tls::ALPN_HTTP11.to_vec()];
    let name = server_name.or_else(|| authority.rsplit_once(':').map(|(h, _)| h)).unwrap_or(authority);
    let name = name.trim_start_matches('[').trim_end_matches(']');
    let name = rustls_pki_types::ServerName::try_from(name.to_string())
        .map_err(|e| format!("backend {authority}: bad TLS server name {name}: {e}"))?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("backend {authority}: TLS handshake failed: {e}"))
}
