//! The options of one HTTP route as the agent applies them, and the pooled
//! clients that speak to its backends: HTTP/1.1, h2c (HTTP/2 with prior
//! knowledge) or HTTPS (verified, or not).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use hyper_rustls::{FixedServerNameResolver, HttpsConnector};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::crypto::ring as provider;
use rustls_pki_types::ServerName;

use super::filters::Filters;
use super::guard::Credentials;
use crate::constants::{BACKEND_CONNECT_TIMEOUT, BACKEND_POOL_IDLE_TIMEOUT};
use crate::tunnel::body::BoxBody;

/// How the agent speaks to an HTTP backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Scheme {
    #[default]
    Http,
    /// HTTP/2 in clear text, with prior knowledge.
    H2c,
    /// TLS; `verify: false` accepts any certificate.
    Https { verify: bool },
}

/// Who may use a route.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Access {
    #[default]
    Open,
    /// Only requests with these credentials.
    Credentials(Arc<Credentials>),
    /// The route asks for credentials the agent does not have (yet): every
    /// request is refused with 503 and this reason.
    Unavailable(String),
}

/// The options of one HTTP route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteOptions {
    pub scheme: Scheme,
    pub connect_timeout: Duration,
    /// How long the backend may take to send the response head, and the
    /// longest pause in the response body.
    pub read_timeout: Option<Duration>,
    /// Largest request body in bytes.
    pub max_body: Option<u64>,
    pub access: Access,
    /// The route's Gateway API filters (none for Ingress routes).
    pub filters: Filters,
}

impl Default for RouteOptions {
    fn default() -> Self {
        RouteOptions {
            scheme: Scheme::Http,
            connect_timeout: BACKEND_CONNECT_TIMEOUT,
            read_timeout: None,
            max_body: None,
            access: Access::Open,
            filters: Filters::default(),
        }
    }
}

impl RouteOptions {
    /// The URI scheme of requests to the backend.
    pub fn uri_scheme(&self) -> &'static str {
        match self.scheme {
            Scheme::Https { .. } => "https",
            Scheme::Http | Scheme::H2c => "http",
        }
    }
}

pub type BackendClient = Client<HttpsConnector<HttpConnector>, BoxBody>;

/// What a pooled client is made for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    scheme: Scheme,
    connect_timeout: Duration,
    /// The TLS server name (https): the public host name.
    server_name: Option<String>,
}

/// A client for `options` (one per scheme, connect timeout and TLS server
/// name, kept for the life of the process; few distinct ones exist).
pub fn client(options: &RouteOptions, server_name: Option<&str>) -> BackendClient {
    static CLIENTS: OnceLock<Mutex<HashMap<ClientKey, BackendClient>>> = OnceLock::new();
    // Plain HTTP with the default connect timeout, the most common: no lock, no lookup.
    static PLAIN: OnceLock<BackendClient> = OnceLock::new();
    if options.scheme == Scheme::Http && options.connect_timeout == BACKEND_CONNECT_TIMEOUT {
        let key =
            ClientKey { scheme: Scheme::Http, connect_timeout: BACKEND_CONNECT_TIMEOUT, server_name: None };
        return PLAIN.get_or_init(|| build(&key)).clone();
    }
    let key = ClientKey {
        scheme: options.scheme,
        connect_timeout: options.connect_timeout,
        server_name: matches!(options.scheme, Scheme::Https { .. })
            .then(|| server_name.map(str::to_string))
            .flatten(),
    };
    let mut clients = CLIENTS.get_or_init(Mutex::default).lock().expect("poisoned");
    clients.entry(key.clone()).or_insert_with(|| build(&key)).clone()
}

fn build(key: &ClientKey) -> BackendClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(key.connect_timeout));
    http.enforce_http(false);
    let verify = !matches!(key.scheme, Scheme::Https { verify: false });
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config((*tls_config(verify)).clone());
    let builder = builder.https_or_http();
    let builder = match key.server_name.as_deref().map(|n| ServerName::try_from(n.to_string())) {
        Some(Ok(name)) => builder.with_server_name_resolver(FixedServerNameResolver::new(name)),
        _ => builder,
    };
    let connector = builder.enable_all_versions().wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(BACKEND_POOL_IDLE_TIMEOUT)
        // Without a timer the pool closes idle connections only when it meets
        // them on a later checkout: after a burst, never.
        .pool_timer(TokioTimer::new())
        .http2_only(key.scheme == Scheme::H2c)
        .build(connector)
}

/// The TLS client configuration for HTTPS backends: the Mozilla roots, or
/// (`verify: false`) any certificate, the handshake signature still checked.
pub fn tls_config(verify: bool) -> Arc<rustls::ClientConfig> {
    static VERIFIED: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    static UNVERIFIED: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    let make = || {
        let provider = Arc::new(provider::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default versions");
        let config = if verify {
            builder
                .with_root_certificates(crate::tls::root_store(None).expect("the built-in roots load"))
                .with_no_client_auth()
        } else {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(crate::tls::AnyCertificate(provider)))
                .with_no_client_auth()
        };
        Arc::new(config)
    };
    if verify { VERIFIED.get_or_init(make).clone() } else { UNVERIFIED.get_or_init(make).clone() }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A backend connection left idle in the pool is closed after
    /// [`BACKEND_POOL_IDLE_TIMEOUT`], not kept until the backend closes it.
    #[tokio::test(start_paused = true)]
    async fn an_idle_backend_connection_is_closed_after_the_pool_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backend = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.ends_with(b"\r\n\r\n") {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request head comes first");
                head.extend_from_slice(&buf[..n]);
            }
            conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.unwrap();
            // Kept alive: the next read ends when the client closes the connection.
            let idle_since = tokio::time::Instant::now();
            assert_eq!(conn.read(&mut buf).await.unwrap(), 0, "no second request");
            idle_since.elapsed()
        });
        let key =
            ClientKey { scheme: Scheme::Http, connect_timeout: BACKEND_CONNECT_TIMEOUT, server_name: None };
        let client = build(&key);
        let req = http::Request::get(format!("http://{addr}/")).body(crate::tunnel::body::empty()).unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), "ok");
        let idle = tokio::time::timeout(3 * BACKEND_POOL_IDLE_TIMEOUT, backend)
            .await
            .expect("the idle connection is closed by the pool")
            .unwrap();
        assert!(idle >= BACKEND_POOL_IDLE_TIMEOUT, "not before the timeout: {idle:?}");
    }
}
