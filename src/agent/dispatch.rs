//! Answering the streams the edge opens: each stream goes where the
//! resolver says, by its kind ([`StreamKind`]): HTTP requests to
//! [`super::forward`], upgrades, TCP streams and UDP flows to [`super::pipe`].

use std::sync::Arc;

use http::{Request, Response, StatusCode};
use tracing::Instrument;

use super::backend::RouteOptions;
use super::forward::{self, agent_error};
use super::pipe::{self, ProxyHeader};
use crate::constants::{CLIENT_ADDR_HEADER, SERVER_ADDR_HEADER};
use crate::tunnel::StreamKind;
use crate::tunnel::body::BoxBody;
use crate::tunnel::stream::RecvBody;

/// Where a stream goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An HTTP backend, `host:port`, with its route's options (scheme,
    /// timeouts, body limit, credentials; the defaults for the standalone
    /// agent): see [`super::forward`].
    Http { authority: String, options: Arc<RouteOptions> },
    /// A TCP backend: `host:port`, optionally told the public client's
    /// address with a PROXY protocol header.
    Tcp { addr: String, proxy: Option<ProxyHeader> },
    /// A UDP backend: `host:port`, optionally told each datagram's public
    /// client with a PROXY protocol v2 header.
    Udp { addr: String, proxy: Option<ProxyHeader> },
    /// The agent answers an HTTP request itself, once its route's options
    /// admit it: a redirect to `location`, or an error (a route without a
    /// usable backend).
    Answer { status: StatusCode, location: Option<String>, message: String, options: Arc<RouteOptions> },
}

impl Target {
    /// An HTTP backend with the default options.
    pub fn http(authority: impl Into<String>) -> Target {
        Target::Http { authority: authority.into(), options: Arc::default() }
    }

    /// `8080`, `host:8080` or `http://host:8080`.
    pub fn parse_http(s: &str) -> Result<Target, String> {
        let rest = match s.split_once("://") {
            Some(("http", rest)) => rest,
            Some((scheme, _)) => return Err(format!("scheme `{scheme}` is not supported; use http://")),
            None => s,
        };
        let authority = rest.trim_end_matches('/');
        Ok(Target::http(host_port(authority)?))
    }

    /// `5432` or `host:5432`.
    pub fn parse_tcp(s: &str) -> Result<Target, String> {
        Ok(Target::Tcp { addr: host_port(s)?, proxy: None })
    }

    /// `53` or `host:53`.
    pub fn parse_udp(s: &str) -> Result<Target, String> {
        Ok(Target::Udp { addr: host_port(s)?, proxy: None })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Http { authority, options } => write!(f, "{}://{authority}", options.uri_scheme()),
            Target::Tcp { addr, .. } => write!(f, "tcp://{addr}"),
            Target::Udp { addr, .. } => write!(f, "udp://{addr}"),
            Target::Answer { status, .. } => write!(f, "the agent's own {status} answer"),
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

/// Chooses the backend of a stream from its request head (the Host and the
/// path for HTTP). `None` answers 404.
pub type Resolver = Arc<dyn Fn(&http::request::Parts) -> Option<Target> + Send + Sync>;

/// A resolver that sends everything to one target.
pub fn fixed(target: Target) -> Resolver {
    Arc::new(move |_| Some(target.clone()))
}

/// The answer to a stream the edge opened (the service of a tunnel
/// connection, which [`crate::tunnel::server::serve`] runs for each).
pub fn answer(
    resolver: &Resolver,
    req: Request<RecvBody>,
) -> impl Future<Output = Response<BoxBody>> + Send + 'static {
    let resolver = resolver.clone();
    let kind = StreamKind::of(&req);
    let span = tracing::debug_span!("stream", kind = kind.header_value(), uri = %req.uri());
    async move { handle(req, kind, &resolver).await }.instrument(span)
}

/// Every arm's future is boxed: this future is what each stream's task
/// holds, and a task moves its future whole, sized by the largest arm, when it
/// is spawned and when it finishes (memmove at task spawn showed at ~4 % of the
/// agent's CPU in a profile of keep-alive HTTP). One allocation per stream costs
/// less than those copies, and a held TCP stream no longer carries the room of
/// the HTTP forwarding's backend connect, pool checkout and timeout.
async fn handle(req: Request<RecvBody>, kind: StreamKind, resolver: &Resolver) -> Response<BoxBody> {
    let (parts, body) = req.into_parts();
    let Some(target) = resolver(&parts) else {
        return agent_error(StatusCode::NOT_FOUND, "no backend for this host and path");
    };
    match (kind, target) {
        (StreamKind::Tcp, Target::Tcp { addr, proxy }) => {
            let header = proxy.map(|p| {
                let addr = |name| pipe::header_addr(&parts, name);
                p.encode(addr(CLIENT_ADDR_HEADER), addr(SERVER_ADDR_HEADER))
            });
            Box::pin(pipe::tcp(addr, header, body)).await
        }
        (StreamKind::Udp, Target::Udp { addr, proxy }) => {
            let header = proxy.map(|p| {
                let addr = |name| pipe::header_addr(&parts, name);
                p.encode_datagram(addr(CLIENT_ADDR_HEADER), addr(SERVER_ADDR_HEADER))
            });
            Box::pin(pipe::udp(addr, header, body)).await
        }
        (StreamKind::Http, Target::Http { authority, options }) => {
            Box::pin(forward::http(parts, body, &authority, &options)).await
        }
        (StreamKind::Http | StreamKind::Upgrade, Target::Answer { status, location, message, options }) => {
            let mut parts = parts;
            if let Err(refused) = forward::admit(&mut parts.headers, &options) {
                return refused;
            }
            forward::answer(status, location.as_deref(), &message, &options)
        }
        (StreamKind::Upgrade, Target::Http { authority, options }) => {
            let mut parts = parts;
            if let Err(refused) = forward::admit(&mut parts.headers, &options) {
                return refused;
            }
            Box::pin(pipe::upgrade(parts, body, &authority, &options)).await
        }
        (kind, target) => agent_error(
            StatusCode::BAD_GATEWAY,
            &format!("a {} stream cannot go to {target}", kind.header_value()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(Target::parse_http("8080").unwrap(), Target::http("127.0.0.1:8080"));
        assert_eq!(Target::parse_http("http://app.local:3000/").unwrap(), Target::http("app.local:3000"));
        assert_eq!(Target::http("a:1").to_string(), "http://a:1");
        assert_eq!(
            Target::parse_tcp("db:5432").unwrap(),
            Target::Tcp { addr: "db:5432".into(), proxy: None }
        );
        assert!(Target::parse_http("https://x:1").is_err());
        assert!(Target::parse_tcp("0").is_err());
        assert!(Target::parse_tcp("host").is_err());
        assert_eq!(Target::parse_udp("53").unwrap().to_string(), "udp://127.0.0.1:53");
    }
}
