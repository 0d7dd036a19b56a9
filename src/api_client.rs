//! The one client of the control API: async (hyper), typed requests and
//! answers, used by `culvert admin` and by the operator (`operator::edge`).
//!
//! One connection per call (HTTP/1.1, TLS unless the edge is `http://`),
//! through `HTTPS_PROXY` when asked, within [`API_CLIENT_TIMEOUT`]. Every
//! answer is checked to be a culvert answer: an error body becomes
//! [`ClientError::Refused`], anything else [`ClientError::UnexpectedAnswer`].
//!
//! Several edges (one store): [`Client::with_edges`] calls the edge that
//! answered last and fails over to the next one when it cannot be reached
//! (or answers 503): always when the request was not sent, and for GET and
//! DELETE also when it was sent but got no answer (a POST then is not
//! repeated: it may have been done).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::BoxError;
use crate::api::{
    CreateTunnelKeyRequest, CreatedTunnelKey, ErrorBody, Info, List, Reservation, ReserveDomainRequest,
    ReservePortRequest,
};
use crate::constants::{API_CLIENT_TIMEOUT, API_PREFIX};
use crate::tunnel::proxy::{self, Proxy};

/// The largest answer read (lists of many keys stay far below it).
const MAX_ANSWER: usize = 10 * 1024 * 1024;
/// With several edges, the connection (TCP and TLS) to one is given up
/// after this, for the next one.
const FAILOVER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a call of the control API failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `--edge` is not a URL we can use.
    #[error("--edge `{0}` is not a URL like https://edge.example.com")]
    BadEdge(String),
    /// `--edge http://…` to a host that is not loopback: the key would cross the network in clear text.
    #[error(
        "--edge `{0}` is plain HTTP: the API key would cross the network in clear text; use https:// (plain http:// is only allowed to loopback: localhost, 127.0.0.0/8, ::1)"
    )]
    PlainHttp(String),
    /// `--ca-file` could not be loaded.
    #[error("failed to load --ca-file: {0}")]
    CaFile(#[source] crate::tls::TlsError),
    /// The request did not get an answer.
    #[error("failed to reach {url}: {source}{hint}")]
    Connect {
        /// The URL asked for.
        url: String,
        /// Why.
        #[source]
        source: BoxError,
        /// What to try, if we can tell.
        hint: &'static str,
    },
    /// The edge answered with a culvert error.
    #[error("edge refused: {code}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The error code, e.g. `already_reserved`.
        code: String,
        /// The edge's message.
        message: String,
    },
    /// The answer is not what a culvert edge sends.
    #[error(
        "{url} answered {status} with something that is not a culvert answer ({detail}); is --edge the URL of a culvert edge?"
    )]
    UnexpectedAnswer {
        /// The URL asked for.
        url: String,
        /// HTTP status.
        status: u16,
        /// What was wrong with it.
        detail: String,
    },
}

impl ClientError {
    /// Static category for logs.
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::BadEdge(_) | ClientError::PlainHttp(_) => "usage",
            ClientError::CaFile(_) => "ca_file",
            ClientError::Connect { .. } => "connect",
            ClientError::Refused { .. } => "refused",
            ClientError::UnexpectedAnswer { .. } => "unexpected_answer",
        }
    }
}

/// Whether a [`ClientError::Connect`] source is a TLS failure (an untrusted
/// certificate, most often).
pub fn is_tls_error(e: &BoxError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(c) = cause {
        if c.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = c.downcast_ref::<std::io::Error>()
            && (io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>())
                || io.to_string().to_ascii_lowercase().contains("certificate"))
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// `localhost`, 127.0.0.0/8 or ::1: a plain HTTP edge there never crosses the network.
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A JSON answer and whether it was `201 Created`.
#[derive(Debug, Clone)]
pub struct Answer {
    pub value: Value,
    pub created: bool,
}

impl Answer {
    /// The answer as `T`.
    pub fn decode<T: DeserializeOwned>(self) -> Result<T, ClientError> {
        decode(self.value)
    }
}

/// A client of the control API of one edge, or of several sharing a store.
pub struct Client {
    edges: Vec<Endpoint>,
    /// The edge that answered last (tried first).
    current: AtomicUsize,
    bearer: String,
    proxy_from_env: bool,
}

/// One edge's API.
struct Endpoint {
    tls: Option<tokio_rustls::TlsConnector>,
    host: String,
    port: u16,
    base: String,
}

/// A request that failed without an answer.
struct NoAnswer {
    /// Whether the request may have reached the edge.
    sent: bool,
    error: BoxError,
}

impl Client {
    /// A client of the edge at `edge` (`https://host[:port]`; `https://` is
    /// assumed when no scheme is given) using `key`. `ca_file` replaces the
    /// built-in Mozilla roots; `proxy_from_env` honours `HTTPS_PROXY`/`NO_PROXY`.
    #[cfg(test)]
    pub fn new(
        edge: &str,
        key: &str,
        ca_file: Option<&Path>,
        proxy_from_env: bool,
    ) -> Result<Client, ClientError> {
        Client::with_edges(&[edge], key, ca_file, proxy_from_env)
    }

    /// A client of several edges sharing one store, tried in this order
    /// (see the module's documentation for when it fails over).
    pub fn with_edges<S: AsRef<str>>(
        edges: &[S],
        key: &str,
        ca_file: Option<&Path>,
        proxy_from_env: bool,
    ) -> Result<Client, ClientError> {
        let edges =
            edges.iter().map(|e| Endpoint::new(e.as_ref(), ca_file)).collect::<Result<Vec<_>, _>>()?;
        if edges.is_empty() {
            return Err(ClientError::BadEdge(String::new()));
        }
        Ok(Client { edges, current: AtomicUsize::new(0), bearer: format!("Bearer {key}"), proxy_from_env })
    }

    /// The base URL of the edge tried first now.
    pub fn current_edge(&self) -> &str {
        &self.edges[self.current.load(Ordering::Relaxed) % self.edges.len()].base
    }
}

impl Endpoint {
    fn new(edge: &str, ca_file: Option<&Path>) -> Result<Endpoint, ClientError> {
        let given = edge.trim();
        let bad = || ClientError::BadEdge(given.to_string());
        let (scheme, authority) = given.split_once("://").unwrap_or(("https", given));
        let authority = authority.trim_end_matches('/');
        if !matches!(scheme, "https" | "http")
            || authority.is_empty()
            || authority.contains(['/', '?', '#', ' ', '@'])
        {
            return Err(bad());
        }
        let default_port = if scheme == "https" { 443 } else { 80 };
        let (host, port) = proxy::split_host_port(authority, default_port).ok_or_else(bad)?;
        if host.is_empty() {
            return Err(bad());
        }
        if scheme == "http" && !is_loopback(&host) {
            return Err(ClientError::PlainHttp(given.to_string()));
        }
        let tls = match scheme {
            "https" => {
                let roots = crate::tls::root_store(ca_file).map_err(ClientError::CaFile)?;
                let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| ClientError::CaFile(crate::tls::TlsError::Config(e)))?
                .with_root_certificates(roots)
                .with_no_client_auth();
                Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
            }
            _ => {
                if let Some(path) = ca_file {
                    crate::tls::load_pem_certs(path).map_err(ClientError::CaFile)?;
                }
                None
            }
        };
        Ok(Endpoint { tls, host, port, base: format!("{scheme}://{authority}{API_PREFIX}") })
    }
}

impl Client {
    /// `GET <path>` with query parameters.
    pub async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Answer, ClientError> {
        self.call(Method::GET, path, query, None).await
    }

    /// `POST <path>` with a JSON body.
    pub async fn post(&self, path: &str, body: &impl Serialize) -> Result<Answer, ClientError> {
        let body = serde_json::to_vec(body).expect("request types serialize");
        self.call(Method::POST, path, &[], Some(body)).await
    }

    /// `DELETE <path>`.
    pub async fn delete(&self, path: &str) -> Result<Answer, ClientError> {
        self.call(Method::DELETE, path, &[], None).await
    }

    /// `GET info`: the edge's domain and the caller's key.
    pub async fn info(&self) -> Result<Info, ClientError> {
        self.get("info", &[]).await?.decode()
    }

    /// `POST domains`; the reservation and whether it is new.
    pub async fn reserve_domain(&self, r: &ReserveDomainRequest) -> Result<(Reservation, bool), ClientError> {
        let answer = self.post("domains", r).await?;
        let created = answer.created;
        Ok((answer.decode()?, created))
    }

    /// `POST ports`; the reservation and whether it is new.
    pub async fn reserve_port(&self, r: &ReservePortRequest) -> Result<(Reservation, bool), ClientError> {
        let answer = self.post("ports", r).await?;
        let created = answer.created;
        Ok((answer.decode()?, created))
    }

    /// `POST tunnel-keys`: a new key and its secret.
    pub async fn create_tunnel_key(
        &self,
        r: &CreateTunnelKeyRequest,
    ) -> Result<CreatedTunnelKey, ClientError> {
        self.post("tunnel-keys", r).await?.decode()
    }

    /// `GET <collection>` with a label selector: the items.
    pub async fn list<T: DeserializeOwned>(
        &self,
        collection: &str,
        selector: &str,
    ) -> Result<Vec<T>, ClientError> {
        let list: List<T> = self.get(collection, &[("selector", selector)]).await?.decode()?;
        Ok(list.items)
    }

    /// The call on the edge that answered last, then on the next ones.
    async fn call(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> Result<Answer, ClientError> {
        let n = self.edges.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let idempotent = method == Method::GET || method == Method::DELETE;
        let mut first_error = None;
        for i in 0..n {
            let index = (first + i) % n;
            let edge = &self.edges[index];
            let (result, sent) = self.call_one(edge, method.clone(), path, query, body.clone()).await;
            let next = match &result {
                Err(ClientError::Connect { .. }) => !sent || idempotent,
                Err(ClientError::Refused { status: 503, .. }) => true,
                _ => false,
            };
            if !next || i + 1 == n {
                if !next {
                    self.current.store(index, Ordering::Relaxed);
                }
                return match (result, first_error) {
                    (Err(_), Some(e)) if next => Err(e),
                    (result, _) => result,
                };
            }
            if let Err(e) = result {
                tracing::warn!(edge = %edge.base, error = %e, "the edge's API does not answer; trying the next edge");
                first_error.get_or_insert(e);
            }
        }
        unreachable!("the last edge returns")
    }

    /// One call on one edge; whether the request may have been sent.
    async fn call_one(
        &self,
        edge: &Endpoint,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        body: Option<Vec<u8>>,
    ) -> (Result<Answer, ClientError>, bool) {
        let mut sent = true;
        let result = self.call_on(edge, method, path, query, body, &mut sent).await;
        (result, sent)
    }

    async fn call_on(
        &self,
        edge: &Endpoint,
        method: Method,
        path: &str,
        query: &[(&str, &str)],
        body: Option<Vec<u8>>,
        sent: &mut bool,
    ) -> Result<Answer, ClientError> {
        let mut url = format!("{}{path}", edge.base);
        for (i, (k, v)) in query.iter().enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(&form_escape(k));
            url.push('=');
            url.push_str(&form_escape(v));
        }
        let connect_error = |source: BoxError| {
            let hint = if is_tls_error(&source) {
                "; if the edge uses a self-signed certificate (culvert edge --self-signed), pass --ca-file with its CA (DATA_DIR/ca.pem)"
            } else {
                ""
            };
            ClientError::Connect { url: url.clone(), source, hint }
        };
        let exchange = self.exchange(edge, method, &url, body);
        let (status, bytes) = match tokio::time::timeout(API_CLIENT_TIMEOUT, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(NoAnswer { sent: was_sent, error })) => {
                *sent = was_sent;
                return Err(connect_error(error));
            }
            Err(_) => {
                return Err(connect_error(
                    format!("no answer within {}s", API_CLIENT_TIMEOUT.as_secs()).into(),
                ));
            }
        };
        let text = String::from_utf8_lossy(&bytes);
        let status = status.as_u16();
        let unexpected = |detail: String| ClientError::UnexpectedAnswer { url: url.clone(), status, detail };
        if status >= 400 {
            let body: ErrorBody = serde_json::from_str(&text).map_err(|_| unexpected(snippet(&text)))?;
            return Err(ClientError::Refused { status, code: body.error.code, message: body.error.message });
        }
        if !(200..300).contains(&status) {
            return Err(unexpected(snippet(&text)));
        }
        let value = serde_json::from_str(&text).map_err(|e| unexpected(format!("not JSON: {e}")))?;
        Ok(Answer { value, created: status == 201 })
    }

    /// One request on a new connection: the status and the whole body.
    async fn exchange(
        &self,
        edge: &Endpoint,
        method: Method,
        url: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), NoAnswer> {
        let not_sent = |error: BoxError| NoAnswer { sent: false, error };
        let connect = async {
            let proxy = if self.proxy_from_env { Proxy::from_env(&edge.host)? } else { None };
            let tcp = proxy::dial(&edge.host, edge.port, proxy.as_ref()).await?;
            match &edge.tls {
                Some(tls) => {
                    let name = rustls_pki_types::ServerName::try_from(edge.host.clone())?;
                    Ok::<_, BoxError>(Stream::Tls(Box::new(tls.connect(name, tcp).await?)))
                }
                None => Ok(Stream::Plain(tcp)),
            }
        };
        // With several edges, one that does not answer is left for the next sooner.
        let stream = if self.edges.len() > 1 {
            match tokio::time::timeout(FAILOVER_CONNECT_TIMEOUT, connect).await {
                Ok(r) => r.map_err(not_sent)?,
                Err(_) => {
                    return Err(not_sent(
                        format!("no connection within {}s", FAILOVER_CONNECT_TIMEOUT.as_secs()).into(),
                    ));
                }
            }
        } else {
            connect.await.map_err(not_sent)?
        };
        let sent = |error: BoxError| NoAnswer { sent: true, error };
        match stream {
            Stream::Tls(s) => self.send(*s, method, url, body).await.map_err(sent),
            Stream::Plain(s) => self.send(s, method, url, body).await.map_err(sent),
        }
    }

    async fn send(
        &self,
        stream: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
        method: Method,
        url: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), BoxError> {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let uri: http::Uri = url.parse()?;
        let host = uri.authority().map(|a| a.to_string()).unwrap_or_default();
        let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/").to_string();
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, host)
            .header(header::AUTHORIZATION, &self.bearer)
            .header(header::USER_AGENT, concat!("culvert-admin/", env!("CARGO_PKG_VERSION")))
            .header(header::ACCEPT, "application/json");
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER).collect().await?.to_bytes();
        Ok((status, bytes))
    }
}

/// The connection of one call.
enum Stream {
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
    Plain(tokio::net::TcpStream),
}

fn decode<T: DeserializeOwned>(value: Value) -> Result<T, ClientError> {
    serde_json::from_value(value).map_err(|e| ClientError::UnexpectedAnswer {
        url: "the edge".into(),
        status: 200,
        detail: format!("unexpected JSON: {e}"),
    })
}

fn snippet(text: &str) -> String {
    let t: String = text.trim().chars().take(80).collect();
    if t.is_empty() { "an empty body".into() } else { format!("body starts with {t:?}") }
}

/// Escapes a path segment (host names and ids never need it; stray input must not change the path).
pub fn segment(s: &str) -> String {
    escape(s.trim())
}

fn form_escape(s: &str) -> String {
    escape(s)
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_urls_and_paths() {
        assert_eq!(segment("blog.example.com"), "blog.example.com");
        assert_eq!(segment("../x?y"), "..%2Fx%3Fy");
        assert_eq!(form_escape("k=v,k2!=v2"), "k%3Dv%2Ck2%21%3Dv2");
        for bad in ["https://", "ftp://x", "https://x/path", "", "https://[::1"] {
            assert!(matches!(Client::new(bad, "k", None, false), Err(ClientError::BadEdge(_))), "{bad}");
        }
        let c = Client::new("edge.example.com/", "k", None, false).unwrap();
        assert_eq!(c.edges[0].base, "https://edge.example.com/_culvert/v1/api/");
        assert_eq!((c.edges[0].host.as_str(), c.edges[0].port), ("edge.example.com", 443));
        for plain in ["http://edge.example.com", "http://10.0.0.1:8080", "http://[2001:db8::1]"] {
            let e = Client::new(plain, "k", None, false).err().expect("plain HTTP off loopback is refused");
            assert!(matches!(e, ClientError::PlainHttp(_)), "{plain}: {e}");
            assert!(e.to_string().contains("use https://"), "{e}");
        }
        for loopback in ["http://localhost:8080", "http://127.0.0.2", "http://[::1]:80"] {
            Client::new(loopback, "k", None, false).unwrap();
        }
        let c = Client::new("http://127.0.0.1:8080", "k", None, false).unwrap();
        let e = &c.edges[0];
        assert_eq!((e.host.as_str(), e.port, e.tls.is_none()), ("127.0.0.1", 8080, true));
        let two =
            Client::with_edges(&["https://a.example", "https://b.example:8443"], "k", None, false).unwrap();
        assert_eq!(two.current_edge(), "https://a.example/_culvert/v1/api/");
        assert_eq!(two.edges[1].port, 8443);
    }
}
