//! Answering the streams the edge opens: HTTP requests are forwarded to the
//! backend (pooled keep-alive connections), upgrades and TCP streams become
//! raw byte pipes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tracing::{Instrument, debug, warn};

use super::backend::RouteOptions;
use crate::constants::{
    BACKEND_CONNECT_TIMEOUT, CLIENT_ADDR_HEADER, ERROR_HEADER, SERVER_ADDR_HEADER, STATUS_HEADER,
    UPGRADE_HEADER,
};
use crate::http::{error_chain, strip_culvert_headers, strip_hop_by_hop};
use crate::tunnel::StreamKind;
use crate::tunnel::body::{self, BoxBody, ReadBody};

/// Where a stream goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An HTTP backend: `host:port`.
    Http { authority: String },
    /// An HTTP backend of a route with options (scheme, timeouts, body
    /// limit, credentials): see [`super::route`].
    HttpRoute { authority: String, options: Arc<RouteOptions> },
    /// A TCP backend: `host:port`, optionally told the public client's
    /// address with a PROXY protocol header.
    Tcp { addr: String, proxy: Option<ProxyHeader> },
}

impl Target {
    /// `8080`, `host:8080` or `http://host:8080`.
    pub fn parse_http(s: &str) -> Result<Target, String> {
        let rest = match s.split_once("://") {
            Some(("http", rest)) => rest,
            Some((scheme, _)) => return Err(format!("scheme `{scheme}` is not supported; use http://")),
            None => s,
        };
        let authority = rest.trim_end_matches('/');
        Ok(Target::Http { authority: host_port(authority)? })
    }

    /// `5432` or `host:5432`.
    pub fn parse_tcp(s: &str) -> Result<Target, String> {
        Ok(Target::Tcp { addr: host_port(s)?, proxy: None })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Http { authority } => write!(f, "http://{authority}"),
            Target::HttpRoute { authority, options } => write!(f, "{}://{authority}", options.uri_scheme()),
            Target::Tcp { addr, .. } => write!(f, "tcp://{addr}"),
        }
    }
}

fn host_port(s: &str) -> Result<String, String> {
    let check = |p: &str| match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("`{p}` is not a port (1-65535)")),
        Ok(_) => Ok(()),
    };
    if s.chars().all(|c| c.is_ascii_digit()) {
        check(s)?;
        return Ok(format!("127.0.0.1:{s}"));
    }
    match crate::tunnel::proxy::split_host_port(s, 0) {
        Some((host, port)) if port != 0 && !host.is_empty() && !host.contains('/') => {
            Ok(if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") })
        }
        _ => Err("expected PORT, HOST:PORT or http://HOST:PORT".into()),
    }
}

/// A PROXY protocol header (HAProxy's, versions 1 and 2) written to a TCP
/// backend before the stream's bytes, so it learns the public client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyHeader {
    /// The text form: `PROXY TCP4 <client> <edge> <client port> <edge port>\r\n`.
    V1,
    /// The binary form.
    V2,
}

/// The 12 bytes every PROXY protocol v2 header starts with.
pub const PROXY_V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

impl ProxyHeader {
    /// The header for a connection from `client` to `server` (the address at
    /// the edge it reached). Without both, v1 says `UNKNOWN` and v2 `LOCAL`;
    /// mixed families are both sent as IPv6 (v4-mapped).
    pub fn encode(self, client: Option<SocketAddr>, server: Option<SocketAddr>) -> Vec<u8> {
        let v6 = |a: SocketAddr| match a {
            SocketAddr::V4(v4) => SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port()),
            a => a,
        };
        let pair = match (client, server) {
            (Some(c), Some(s)) if c.is_ipv4() == s.is_ipv4() => Some((c, s)),
            (Some(c), Some(s)) => Some((v6(c), v6(s))),
            _ => None,
        };
        match (self, pair) {
            (ProxyHeader::V1, Some((c, s))) => {
                let family = if c.is_ipv4() { "TCP4" } else { "TCP6" };
                format!("PROXY {family} {} {} {} {}\r\n", c.ip(), s.ip(), c.port(), s.port()).into_bytes()
            }
            (ProxyHeader::V1, None) => b"PROXY UNKNOWN\r\n".to_vec(),
            (ProxyHeader::V2, pair) => {
                let mut out = PROXY_V2_SIGNATURE.to_vec();
                let mut addrs = Vec::with_capacity(36);
                let (command, family) = match pair {
                    Some((SocketAddr::V4(c), SocketAddr::V4(s))) => {
                        addrs.extend(c.ip().octets());
                        addrs.extend(s.ip().octets());
                        (0x21, 0x11) // PROXY, TCP over IPv4
                    }
                    Some((c, s)) => {
                        for a in [c, s] {
                            if let SocketAddr::V6(a) = v6(a) {
                                addrs.extend(a.ip().octets());
                            }
                        }
                        (0x21, 0x21) // PROXY, TCP over IPv6
                    }
                    None => (0x20, 0x00), // LOCAL, unspecified
                };
                if let Some((c, s)) = pair {
                    addrs.extend(c.port().to_be_bytes());
                    addrs.extend(s.port().to_be_bytes());
                }
                out.extend([command, family]);
                out.extend((addrs.len() as u16).to_be_bytes());
                out.extend(addrs);
                out
            }
        }
    }
}

/// An `ip:port` the edge put in a stream header.
fn header_addr(parts: &http::request::Parts, name: &str) -> Option<SocketAddr> {
    parts.headers.get(name)?.to_str().ok()?.parse().ok()
}

/// Chooses the backend of a stream from its request head (the Host and the
/// path for HTTP). `None` answers 404.
pub type Resolver = Arc<dyn Fn(&http::request::Parts) -> Option<Target> + Send + Sync>;

/// A resolver that sends everything to one target.
pub fn fixed(target: Target) -> Resolver {
    Arc::new(move |_| Some(target.clone()))
}

type HttpClient = Client<HttpConnector, BoxBody>;

fn http_client() -> &'static HttpClient {
    static CLIENT: OnceLock<HttpClient> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(BACKEND_CONNECT_TIMEOUT));
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(std::time::Duration::from_secs(60))
            .build(connector)
    })
}

/// The HTTP/2 service of a tunnel connection.
pub fn service(
    resolver: Resolver,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<BoxBody>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<BoxBody>, Infallible>> + Send,
> + Clone {
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let resolver = resolver.clone();
        let kind = StreamKind::of(&req);
        let span = tracing::debug_span!("stream", kind = kind.header_value(), uri = %req.uri());
        async move { Ok(handle(req, kind, &resolver).await) }.instrument(span)
    })
}

async fn handle(req: Request<Incoming>, kind: StreamKind, resolver: &Resolver) -> Response<BoxBody> {
    let (parts, body) = req.into_parts();
    let Some(target) = resolver(&parts) else {
        return agent_error(StatusCode::NOT_FOUND, "no backend for this host and path");
    };
    match (kind, target) {
        (StreamKind::Tcp, Target::Tcp { addr, proxy }) => {
            let header = proxy.map(|p| {
                p.encode(header_addr(&parts, CLIENT_ADDR_HEADER), header_addr(&parts, SERVER_ADDR_HEADER))
            });
            tcp(addr, header, body).await
        }
        (StreamKind::Http, Target::Http { authority }) => http(parts, body, &authority).await,
        (StreamKind::Upgrade, Target::Http { authority }) => upgrade(parts, body, &authority, None).await,
        (StreamKind::Http, Target::HttpRoute { authority, options }) => {
            super::route::http(parts, body, &authority, &options).await
        }
        (StreamKind::Upgrade, Target::HttpRoute { authority, options }) => {
            let mut parts = parts;
            if let Err(refused) = super::route::admit(&mut parts.headers, &options) {
                return refused;
            }
            upgrade(parts, body, &authority, Some(&options)).await
        }
        (kind, target) => agent_error(
            StatusCode::BAD_GATEWAY,
            &format!("a {} stream cannot go to {target}", kind.header_value()),
        ),
    }
}

/// A response the agent makes itself, marked so the edge can tell.
pub(super) fn agent_error(status: StatusCode, message: &str) -> Response<BoxBody> {
    let mut resp = Response::new(body::full(format!("culvert agent: {message}\n")));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    if let Ok(v) = HeaderValue::from_str(message) {
        h.insert(ERROR_HEADER, v);
    }
    resp
}

async fn dial(addr: &str) -> Result<TcpStream, String> {
    dial_within(addr, BACKEND_CONNECT_TIMEOUT).await
}

async fn dial_within(addr: &str, limit: std::time::Duration) -> Result<TcpStream, String> {
    match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(format!("backend {addr} unreachable: {e}")),
        Err(_) => Err(format!("backend {addr} did not accept within {limit:?}")),
    }
}

async fn tcp(addr: String, proxy_header: Option<Vec<u8>>, body: Incoming) -> Response<BoxBody> {
    let mut stream = match dial(&addr).await {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "tcp stream refused");
            return agent_error(StatusCode::BAD_GATEWAY, &e);
        }
    };
    if let Some(header) = proxy_header
        && let Err(e) = tokio::io::AsyncWriteExt::write_all(&mut stream, &header).await
    {
        return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {addr}: {e}"));
    }
    let (read, write) = stream.into_split();
    tokio::spawn(
        async move {
            if let Err(e) = body::copy_body(body, write).await {
                debug!(error = %e, "tcp stream: client to backend ended");
            }
        }
        .in_current_span(),
    );
    Response::new(body::boxed(ReadBody::new(read)))
}

/// The request head as the backend sees it: origin-form URI, the public Host.
pub(super) fn backend_request(
    mut parts: http::request::Parts,
    authority: &str,
) -> Result<http::request::Parts, String> {
    let host = parts.uri.authority().map(|a| a.as_str().to_string());
    let pq = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    parts.uri = Uri::try_from(format!("http://{authority}{pq}")).map_err(|e| e.to_string())?;
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    strip_culvert_headers(&mut parts.headers);
    if let Some(host) = host.and_then(|h| HeaderValue::from_str(&h).ok()) {
        parts.headers.insert(header::HOST, host);
    }
    Ok(parts)
}

async fn http(parts: http::request::Parts, body: Incoming, authority: &str) -> Response<BoxBody> {
    let parts = match backend_request(parts, authority) {
        Ok(p) => p,
        Err(e) => return agent_error(StatusCode::BAD_REQUEST, &e),
    };
    let req = Request::from_parts(parts, body::boxed(body));
    match http_client().request(req).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body::boxed(body))
        }
        Err(e) => {
            let what = if e.is_connect() { "unreachable" } else { "failed" };
            let msg = format!("backend {authority} {what}: {}", error_chain(&e));
            warn!(error = %msg, "http request failed");
            agent_error(StatusCode::BAD_GATEWAY, &msg)
        }
    }
}

async fn upgrade(
    parts: http::request::Parts,
    body: Incoming,
    authority: &str,
    options: Option<&RouteOptions>,
) -> Response<BoxBody> {
    let server_name = parts.uri.host().map(str::to_string);
    let upgrade_to = parts.headers.get(UPGRADE_HEADER).cloned();
    let mut parts = match backend_request(parts, authority) {
        Ok(p) => p,
        Err(e) => return agent_error(StatusCode::BAD_REQUEST, &e),
    };
    let Some(upgrade_to) = upgrade_to else {
        return agent_error(StatusCode::BAD_REQUEST, "upgrade stream without culvert-upgrade");
    };
    parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    parts.headers.insert(header::UPGRADE, upgrade_to);
    // Origin-form on a dedicated connection.
    parts.uri = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").parse().unwrap_or_default();
    let limit = options.map_or(BACKEND_CONNECT_TIMEOUT, |o| o.connect_timeout);
    let stream = match dial_within(authority, limit).await {
        Ok(s) => s,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &e),
    };
    let handshake = match options.map(|o| o.scheme) {
        Some(super::backend::Scheme::Https { verify }) => {
            match super::route::tls_connect(stream, verify, server_name.as_deref(), authority).await {
                Ok(tls) => http1_handshake(tls).await,
                Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &e),
            }
        }
        _ => http1_handshake(stream).await,
    };
    let mut sender = match handshake {
        Ok(s) => s,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {authority}: {e}")),
    };
    let resp = match sender.send_request(Request::from_parts(parts, body::empty())).await {
        Ok(r) => r,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &format!("backend {authority}: {e}")),
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        let (mut parts, b) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        return Response::from_parts(parts, body::boxed(b));
    }
    let mut headers = resp.headers().clone();
    let upgraded = match hyper::upgrade::on(resp).await {
        Ok(u) => u,
        Err(e) => return agent_error(StatusCode::BAD_GATEWAY, &format!("upgrade failed: {e}")),
    };
    let upgraded_to = headers.get(header::UPGRADE).cloned();
    strip_hop_by_hop(&mut headers);
    let (read, write) = tokio::io::split(TokioIo::new(upgraded));
    tokio::spawn(
        async move {
            if let Err(e) = body::copy_body(body, write).await {
                debug!(error = %e, "upgraded stream: client to backend ended");
            }
        }
        .in_current_span(),
    );
    let mut out = Response::new(body::boxed(ReadBody::new(read)));
    *out.headers_mut() = headers;
    out.headers_mut().insert(STATUS_HEADER, HeaderValue::from_static("101"));
    if let Some(v) = upgraded_to {
        out.headers_mut().insert(UPGRADE_HEADER, v);
    }
    out
}

/// An HTTP/1.1 client connection (with upgrades) over `io`, driven by its own task.
async fn http1_handshake<T>(io: T) -> Result<hyper::client::conn::http1::SendRequest<BoxBody>, hyper::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(Target::parse_http("8080").unwrap(), Target::Http { authority: "127.0.0.1:8080".into() });
        assert_eq!(
            Target::parse_http("http://app.local:3000/").unwrap(),
            Target::Http { authority: "app.local:3000".into() }
        );
        assert_eq!(
            Target::parse_tcp("db:5432").unwrap(),
            Target::Tcp { addr: "db:5432".into(), proxy: None }
        );
        assert!(Target::parse_http("https://x:1").is_err());
        assert!(Target::parse_tcp("0").is_err());
        assert!(Target::parse_tcp("host").is_err());
    }

    #[test]
    fn proxy_protocol_headers() {
        let c: SocketAddr = "203.0.113.7:51234".parse().unwrap();
        let s: SocketAddr = "192.0.2.1:20001".parse().unwrap();
        assert_eq!(
            ProxyHeader::V1.encode(Some(c), Some(s)),
            b"PROXY TCP4 203.0.113.7 192.0.2.1 51234 20001\r\n"
        );
        assert_eq!(ProxyHeader::V1.encode(None, Some(s)), b"PROXY UNKNOWN\r\n");
        let c6: SocketAddr = "[2001:db8::1]:4000".parse().unwrap();
        assert_eq!(
            ProxyHeader::V1.encode(Some(c6), Some(s)),
            b"PROXY TCP6 2001:db8::1 ::ffff:192.0.2.1 4000 20001\r\n"
        );
        let v2 = ProxyHeader::V2.encode(Some(c), Some(s));
        assert_eq!(&v2[..12], &PROXY_V2_SIGNATURE);
        assert_eq!(&v2[12..16], &[0x21, 0x11, 0, 12]);
        assert_eq!(&v2[16..], &[203, 0, 113, 7, 192, 0, 2, 1, 0xc8, 0x22, 0x4e, 0x21]);
        let v2 = ProxyHeader::V2.encode(Some(c6), Some(s));
        assert_eq!(&v2[12..16], &[0x21, 0x21, 0, 36]);
        assert_eq!(v2.len(), 16 + 36);
        assert_eq!(&ProxyHeader::V2.encode(None, None)[12..], &[0x20, 0x00, 0, 0]);
    }
}
