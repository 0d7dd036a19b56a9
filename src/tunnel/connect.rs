//! The agent's end of the handshake: dial (maybe through a proxy), TLS 1.3,
//! WebSocket upgrade with the tunnel key.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use http::{HeaderValue, Request, StatusCode, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;

use super::proxy::{self, Proxy};
use super::ws::{self, Control, WsStream};
use crate::api::{ErrorBody, Protocol};
/// The protocol version an agent offers unless told otherwise.
pub use crate::constants::PROTOCOL_VERSION;
use crate::constants::{
    AGENT_ID_HEADER, CONNECT_PATH, EDGE_CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT, MIN_PROTOCOL_VERSION,
    PUBLIC_URL_HEADER, TUNNEL_PROTOCOL_HEADER, VERSION_HEADER,
};
use tracing::info;

/// Where the edge is: parsed from `--edge https://host[:port]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EdgeUrl {
    pub host: String,
    pub port: u16,
    /// One resolved address of `host` to dial instead of resolving it (one
    /// connection per address of a name); `host` still names the edge in TLS
    /// (SNI, certificate check) and in the Host header.
    pub addr: Option<SocketAddr>,
}

impl EdgeUrl {
    pub fn parse(url: &str) -> Result<EdgeUrl, ConnectError> {
        let bad = |why: &str| ConnectError::BadUrl { url: url.into(), why: why.into() };
        let rest = match url.split_once("://") {
            Some(("https", rest)) => rest,
            Some((_, _)) => return Err(bad("the edge is reached over https://")),
            None => url,
        };
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port) =
            proxy::split_host_port(authority, 443).ok_or_else(|| bad("expected https://HOST[:PORT]"))?;
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(EdgeUrl { host, port, addr: None })
    }

    /// The same edge, dialed at `addr`.
    pub fn pinned(&self, addr: SocketAddr) -> EdgeUrl {
        EdgeUrl { addr: Some(addr), ..self.clone() }
    }

    /// The host is a name (not an IP literal): it may resolve to several edges.
    pub fn is_name(&self) -> bool {
        self.host.parse::<std::net::IpAddr>().is_err()
    }

    /// `host:port` as written in a URL authority.
    pub fn authority(&self) -> String {
        match (self.host.contains(':'), self.port) {
            (true, 443) => format!("[{}]", self.host),
            (true, p) => format!("[{}]:{p}", self.host),
            (false, 443) => self.host.clone(),
            (false, p) => format!("{}:{p}", self.host),
        }
    }
}

/// For logs: `host:port`, and the address dialed when pinned (`host:port@addr`).
impl std::fmt::Display for EdgeUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            Some(addr) => write!(f, "{}@{addr}", self.authority()),
            None => f.write_str(&self.authority()),
        }
    }
}

/// Why a tunnel connection could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("bad edge URL `{url}`: {why}")]
    BadUrl { url: String, why: String },
    #[error("bad proxy setting: {0}")]
    Proxy(String),
    #[error("failed to reach the edge at {addr}: {source}")]
    Dial {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "TLS handshake with {addr} failed: {source} (for an edge started with --self-signed, pass its ca.pem with --ca-file)"
    )]
    Tls {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the edge refused the tunnel ({status}, {code}): {message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
        /// The edge's `Retry-After`, in seconds.
        retry_after: Option<Duration>,
    },
    #[error("WebSocket upgrade failed: {0}")]
    WebSocket(#[source] crate::BoxError),
    #[error("handshake timed out after {0:?}")]
    Timeout(std::time::Duration),
}

impl ConnectError {
    /// Static category for logs and metrics.
    pub fn category(&self) -> &'static str {
        match self {
            ConnectError::BadUrl { .. } => "bad_url",
            ConnectError::Proxy(_) => "proxy",
            ConnectError::Dial { .. } => "dial",
            ConnectError::Tls { .. } => "tls",
            ConnectError::Refused { .. } => "refused",
            ConnectError::WebSocket(_) => "websocket",
            ConnectError::Timeout(_) => "timeout",
        }
    }

    /// A refusal that retrying will not fix (bad or revoked key, old agent,
    /// wrong URL). Too-many-agents and server errors are worth retrying.
    pub fn is_permanent(&self) -> bool {
        match self {
            ConnectError::Refused { status, .. } => matches!(status, 400 | 401 | 403 | 404 | 426),
            ConnectError::BadUrl { .. } | ConnectError::Proxy(_) => true,
            _ => false,
        }
    }

    /// Nothing answered at the edge's address (connection refused or reset,
    /// no route, timed out): the edge is down or restarting, so cheap probes
    /// at a short interval find it back soon after it is up again. Any answer
    /// (an HTTP refusal, a TLS failure with a certificate) is not this.
    pub fn is_unreachable(&self) -> bool {
        use std::io::ErrorKind::*;
        match self {
            ConnectError::Dial { source, .. } => matches!(
                source.kind(),
                ConnectionRefused
                    | ConnectionReset
                    | ConnectionAborted
                    | TimedOut
                    | HostUnreachable
                    | NetworkUnreachable
                    | NotConnected
                    | AddrNotAvailable
            ),
            // The edge process went away during the handshake.
            ConnectError::Tls { source, .. } => {
                matches!(source.kind(), ConnectionReset | ConnectionAborted | UnexpectedEof | BrokenPipe)
            }
            ConnectError::Timeout(_) => true,
            _ => false,
        }
    }

    /// How long the edge asked the agent to wait (`Retry-After` on a refusal).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ConnectError::Refused { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// What the edge said about the tunnel in its 101 response.
#[derive(Debug, Clone)]
pub struct TunnelInfo {
    pub protocol: Option<Protocol>,
    pub public_url: Option<String>,
    /// The edge this connection is to (as in logs: `host:port[@addr]`).
    pub edge: String,
    /// The TLS cipher suite agreed with the edge.
    pub cipher: &'static str,
}

/// An open tunnel connection, before its streams' wire starts.
pub struct Connected {
    pub stream: WsStream<TokioIo<Upgraded>>,
    pub control: Arc<Control>,
    pub info: TunnelInfo,
    /// What the edge took: h2 or the multiplexer.
    pub wire: super::Wire,
}

/// Settings of an agent's connections.
#[derive(Clone)]
pub struct Dialer {
    pub edge: EdgeUrl,
    pub key: String,
    pub agent_id: String,
    pub tls: Arc<rustls::ClientConfig>,
    /// What the agent serves; the edge refuses a key made for another protocol.
    pub protocol: Option<Protocol>,
    /// The protocol version offered ([`PROTOCOL_VERSION`] but to rule the
    /// multiplexer out).
    pub version: u32,
}

impl Dialer {
    /// Dials the edge and performs the handshake, within [`HANDSHAKE_TIMEOUT`].
    #[tracing::instrument(skip(self), fields(edge = %self.edge))]
    pub async fn connect(&self) -> Result<Connected, ConnectError> {
        tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
            match self.connect_inner(self.version).await {
                // An edge older than this agent: ask again with the version it speaks.
                Err(ConnectError::Refused { status: 426, code, .. })
                    if code == "version_too_new" && self.version > MIN_PROTOCOL_VERSION =>
                {
                    info!(offered = self.version, "the edge speaks protocol version 1 only; connecting with 1 (upgrade the edge for the multiplexer)");
                    self.connect_inner(MIN_PROTOCOL_VERSION).await
                }
                r => r,
            }
        })
        .await
        .map_err(|_| ConnectError::Timeout(HANDSHAKE_TIMEOUT))?
    }

    async fn connect_inner(&self, version: u32) -> Result<Connected, ConnectError> {
        let addr = self.edge.authority();
        let dialed = match self.edge.addr {
            // A resolved address of the name: no proxy (the set was resolved here).
            Some(pinned) => {
                direct(async move {
                    let s = tokio::net::TcpStream::connect(pinned).await?;
                    s.set_nodelay(true)?;
                    Ok(s)
                })
                .await
            }
            None => match Proxy::from_env(&self.edge.host).map_err(ConnectError::Proxy)? {
                None => direct(proxy::dial(&self.edge.host, self.edge.port, None)).await,
                Some(p) => proxy::dial(&self.edge.host, self.edge.port, Some(&p)).await,
            },
        };
        let tcp = dialed.map_err(|source| ConnectError::Dial { addr: self.edge.to_string(), source })?;
        let server_name = rustls_pki_types::ServerName::try_from(self.edge.host.clone())
            .map_err(|_| ConnectError::BadUrl { url: addr.clone(), why: "invalid host name".into() })?;
        let tls = super::tls::connect(self.tls.clone(), server_name, tcp)
            .await
            .map_err(|source| ConnectError::Tls { addr: addr.clone(), source })?;
        let cipher = tls.cipher_name();

        // The WebSocket upgrade, as an HTTP/1.1 request on the TLS stream.
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| ConnectError::WebSocket(e.into()))?;
        tokio::spawn(async move {
            let _ = conn.with_upgrades().await;
        });
        // A nonce, not a secret: zeros if the source fails.
        let ws_key: [u8; 16] = crate::random_bytes().unwrap_or_default();
        let ws_key = base64::engine::general_purpose::STANDARD.encode(ws_key);
        let bearer =
            HeaderValue::from_str(&format!("Bearer {}", self.key)).map_err(|_| ConnectError::Refused {
                status: 401,
                code: "bad_key".into(),
                message: "the tunnel key has characters a header cannot carry".into(),
                retry_after: None,
            })?;
        let mut req = Request::get(CONNECT_PATH)
            .header(header::HOST, &addr)
            .header(header::CONNECTION, "Upgrade")
            .header(header::UPGRADE, "websocket")
            .header(header::SEC_WEBSOCKET_VERSION, "13")
            .header(header::SEC_WEBSOCKET_KEY, &ws_key)
            .header(header::AUTHORIZATION, bearer)
            .header(VERSION_HEADER, HeaderValue::from(version))
            .body(Empty::<bytes::Bytes>::new())
            .map_err(|e| ConnectError::WebSocket(e.into()))?;
        let headers = req.headers_mut();
        if let Some(p) = self.protocol {
            headers.insert(TUNNEL_PROTOCOL_HEADER, HeaderValue::from_static(p.as_str()));
        }
        if let Ok(id) = HeaderValue::from_str(&self.agent_id) {
            headers.insert(AGENT_ID_HEADER, id);
        }
        let resp = sender.send_request(req).await.map_err(|e| ConnectError::WebSocket(e.into()))?;
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            return Err(refusal(resp).await);
        }
        let accept = resp.headers().get(header::SEC_WEBSOCKET_ACCEPT).and_then(|v| v.to_str().ok());
        if accept != Some(super::handshake::accept_key(ws_key.as_bytes()).as_str()) {
            return Err(ConnectError::WebSocket(
                "the edge answered with a wrong Sec-WebSocket-Accept".into(),
            ));
        }
        let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok());
        // An edge that does not say took the version offered (edges of
        // version 1 only did not say).
        let took = header(VERSION_HEADER).and_then(|v| v.parse().ok()).unwrap_or(version);
        if !(MIN_PROTOCOL_VERSION..=version).contains(&took) {
            return Err(ConnectError::WebSocket(
                format!("the edge took protocol version {took}, not offered").into(),
            ));
        }
        let wire = super::Wire::of_version(took);
        let info = TunnelInfo {
            protocol: header(TUNNEL_PROTOCOL_HEADER).and_then(Protocol::parse),
            public_url: header(PUBLIC_URL_HEADER).map(str::to_string),
            edge: self.edge.to_string(),
            cipher,
        };
        let upgraded = hyper::upgrade::on(resp).await.map_err(|e| ConnectError::WebSocket(e.into()))?;
        let control = Arc::new(Control::default());
        let stream = WsStream::new(TokioIo::new(upgraded), ws::Role::Client, control.clone());
        Ok(Connected { stream, control, info, wire })
    }
}

/// A direct dial (no proxy) within [`EDGE_CONNECT_TIMEOUT`].
async fn direct(
    dial: impl std::future::Future<Output = std::io::Result<tokio::net::TcpStream>>,
) -> std::io::Result<tokio::net::TcpStream> {
    match tokio::time::timeout(EDGE_CONNECT_TIMEOUT, dial).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within {EDGE_CONNECT_TIMEOUT:?}"),
        )),
    }
}

/// Turns a non-101 upgrade response into a [`ConnectError::Refused`] with the
/// edge's reason.
async fn refusal(resp: http::Response<hyper::body::Incoming>) -> ConnectError {
    let status = resp.status().as_u16();
    // Seconds only (the HTTP-date form is not worth a date parser here).
    let retry_after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body =
        Limited::new(resp.into_body(), 64 * 1024).collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(b) => ConnectError::Refused { status, code: b.error.code, message: b.error.message, retry_after },
        Err(_) => ConnectError::Refused {
            status,
            retry_after,
            code: "http".into(),
            message: format!(
                "unexpected HTTP {status} (is this a culvert edge?): {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_urls() {
        assert_eq!(
            EdgeUrl::parse("https://edge.example.com").unwrap(),
            EdgeUrl { host: "edge.example.com".into(), port: 443, addr: None }
        );
        let u = EdgeUrl::parse("https://127.0.0.1:8443/").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.authority()), ("127.0.0.1", 8443, "127.0.0.1:8443".into()));
        assert!(EdgeUrl::parse("http://x").is_err());
        assert_eq!(EdgeUrl::parse("[::1]:9").unwrap().authority(), "[::1]:9");
        let name = EdgeUrl::parse("https://edges.example.com:8443").unwrap();
        assert!(name.is_name() && !u.is_name());
        let pinned = name.pinned("192.0.2.7:8443".parse().unwrap());
        assert_eq!(pinned.authority(), "edges.example.com:8443", "the name stays for TLS and Host");
        assert_eq!(pinned.to_string(), "edges.example.com:8443@192.0.2.7:8443");
    }

    /// An address that does not answer at all (a listener whose accept queue
    /// is full drops SYNs, like a machine that is gone): the dial gives up
    /// after EDGE_CONNECT_TIMEOUT, and that is a reason to probe.
    #[tokio::test]
    async fn an_edge_that_does_not_answer_times_out_soon() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        // Fill the accept queue (nothing accepts).
        let mut held = Vec::new();
        while let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(300), tokio::net::TcpStream::connect(addr)).await
        {
            held.push(s);
            assert!(held.len() < 64, "the accept queue never filled");
        }
        let dialer = Dialer {
            edge: EdgeUrl::parse(&format!("https://{addr}")).unwrap(),
            key: "culvert_t_x".into(),
            agent_id: "test".into(),
            tls: crate::tls::tunnel_client_config(None, crate::tls::TunnelCipher::Auto).unwrap(),
            protocol: None,
            version: PROTOCOL_VERSION,
        };
        let t0 = std::time::Instant::now();
        let err = dialer.connect().await.err().expect("no connection");
        assert!(matches!(&err, ConnectError::Dial { .. }) && err.is_unreachable(), "{err}");
        let took = t0.elapsed();
        assert!(took >= EDGE_CONNECT_TIMEOUT && took < HANDSHAKE_TIMEOUT, "{took:?}");
        drop(listener);
    }

    #[test]
    fn refused_addresses_are_probed_and_answers_back_off() {
        use std::io::{Error, ErrorKind};
        let dial = |kind| ConnectError::Dial { addr: "e".into(), source: Error::from(kind) };
        assert!(dial(ErrorKind::ConnectionRefused).is_unreachable());
        assert!(dial(ErrorKind::TimedOut).is_unreachable());
        assert!(ConnectError::Timeout(Duration::from_secs(10)).is_unreachable());
        assert!(!dial(ErrorKind::PermissionDenied).is_unreachable());
        let refused = |status| ConnectError::Refused {
            status,
            code: "x".into(),
            message: "x".into(),
            retry_after: Some(Duration::from_secs(3)),
        };
        for status in [429, 503, 401] {
            assert!(!refused(status).is_unreachable(), "{status}");
        }
        assert_eq!(refused(503).retry_after(), Some(Duration::from_secs(3)));
        let tls =
            ConnectError::Tls { addr: "e".into(), source: Error::new(ErrorKind::InvalidData, "bad cert") };
        assert!(!tls.is_unreachable(), "a certificate problem is an answer");
    }
}
