//! Test support for tunnel tests: an in-process edge with a self-signed CA on
//! 127.0.0.1 port 0, real backends, agents, and HTTPS clients.
//! Used as `support::net` (see `support/mod.rs`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use culvert::agent::{self, OnReady, Target, TunnelOptions};
use culvert::api::PortRange;
use culvert::edge::EdgeArgs;
use culvert::edge::{self, EdgeHandle};
use culvert::tls::TunnelCipher;
use culvert::tunnel::connect::{Dialer, EdgeUrl};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

pub const DOMAIN: &str = "edge.test";

pub fn init() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    culvert::telemetry::init(culvert::telemetry::LogFormat::Text);
}

/// A free contiguous range of `n` ports on 127.0.0.1 (checked by binding),
/// below the kernel's ephemeral range: the edge binds a reserved port only
/// when it is reserved, and a port of the ephemeral range may by then be the
/// local port of any outgoing loopback connection (the apiserver client, the
/// tunnel, the test's own requests), which makes that bind fail.
pub fn free_port_range(n: u16) -> PortRange {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Random bases, so tests running in parallel rarely pick the same range.
    let (low, high) = (10000u16, ephemeral_low.saturating_sub(n).max(10001));
    for _ in 0..200 {
        let base = low + random_u16() % (high - low);
        let ok = (base..base + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
        if ok {
            return PortRange { first: base, last: base + n - 1 };
        }
    }
    panic!("no free port range of {n} below {ephemeral_low}");
}

fn random_u16() -> u16 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 2];
    ring::rand::SystemRandom::new().fill(&mut b).expect("system randomness");
    u16::from_le_bytes(b)
}

pub fn edge_args(dir: &Path, https: SocketAddr, tcp_ports: PortRange) -> EdgeArgs {
    EdgeArgs {
        domain: DOMAIN.into(),
        data_dir: dir.to_path_buf(),
        store: None,
        tls_cert: None,
        tls_key: None,
        tls_watch_seconds: 1,
        self_signed: true,
        https_addr: https,
        http_addr: "127.0.0.1:0".parse().unwrap(),
        admin_addr: "127.0.0.1:0".parse().unwrap(),
        tcp_ports,
        tcp_bind: "127.0.0.1".parse().unwrap(),
        public_host: Some("127.0.0.1".into()),
        max_agents_per_key: 4,
        drain_seconds: 0,
        acme: Default::default(),
        plain_http: false,
        public_status: false,
        tcp_idle_timeout_seconds: 3600,
        half_close_timeout_seconds: 60,
        max_public_connections: 10_000,
        max_connections_per_tcp_port: 1_000,
        max_tunnel_streams: 4096,
        udp_idle_timeout_seconds: 60,
        max_udp_flows_per_port: 1_000,
        max_udp_flows: 10_000,
        allow_upgrade: vec!["websocket".into()],
        reserved_names: ["admin", "api", "edge", "status", "www"].map(String::from).into(),
    }
}

/// An edge running in this process.
pub struct TestEdge {
    pub handle: Option<EdgeHandle>,
    pub dir: tempfile::TempDir,
    pub https: SocketAddr,
    pub ca_file: PathBuf,
    pub admin_key: String,
    pub tcp_ports: PortRange,
    /// The arguments of the first start (a restart binds the same ports).
    pub args: EdgeArgs,
}

impl TestEdge {
    pub async fn start() -> TestEdge {
        Self::start_with(|_| {}).await
    }

    /// Starts with the test arguments changed by `configure`.
    pub async fn start_with(configure: impl FnOnce(&mut EdgeArgs)) -> TestEdge {
        init();
        let dir = tempfile::tempdir().unwrap();
        let tcp_ports = free_port_range(4);
        let mut args = edge_args(dir.path(), "127.0.0.1:0".parse().unwrap(), tcp_ports);
        configure(&mut args);
        let handle = edge::start(args.clone()).await.expect("edge starts");
        let admin_key = handle.new_admin_key.clone().expect("first start creates the admin key");
        TestEdge {
            https: handle.https_addr,
            // With --tls-cert the test sets the CA it made.
            ca_file: handle.ca_file.clone().unwrap_or_default(),
            handle: Some(handle),
            dir,
            admin_key,
            tcp_ports,
            args,
        }
    }

    /// Another edge on the store of `first` (`--store`, PostgreSQL), with
    /// its own data dir and ports, and the admin key made by `first`.
    pub async fn join(first: &TestEdge, configure: impl FnOnce(&mut EdgeArgs)) -> TestEdge {
        let dir = tempfile::tempdir().unwrap();
        let mut args = edge_args(dir.path(), "127.0.0.1:0".parse().unwrap(), first.tcp_ports);
        args.store = first.args.store.clone();
        configure(&mut args);
        let handle = edge::start(args.clone()).await.expect("edge starts");
        assert!(handle.new_admin_key.is_none(), "the store has its admin key");
        TestEdge {
            https: handle.https_addr,
            ca_file: handle.ca_file.clone().unwrap_or_default(),
            handle: Some(handle),
            dir,
            admin_key: first.admin_key.clone(),
            tcp_ports: first.tcp_ports,
            args,
        }
    }

    pub fn edge(&self) -> &Arc<edge::Edge> {
        &self.handle.as_ref().unwrap().edge
    }

    /// [`dialer`] to this edge.
    pub fn dialer(&self, key: &str) -> Dialer {
        dialer(&self.url(), &self.ca_file, key)
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.https.port())
    }

    pub fn client(&self) -> HttpsClient {
        HttpsClient { addr: self.https, ca_file: self.ca_file.clone() }
    }

    /// The id of the first tunnel key at the edge that `which` picks (from
    /// the control API's list, each key as JSON).
    pub async fn tunnel_key_id(&self, which: impl Fn(&Value) -> bool) -> String {
        let (s, keys) = self.api("GET", "tunnel-keys", None).await;
        assert!(s.is_success(), "{keys}");
        let items = keys["items"].as_array().expect("a list of keys");
        let key = items.iter().find(|k| which(k)).unwrap_or_else(|| panic!("no such key in {keys}"));
        key["id"].as_str().expect("a key id").to_string()
    }

    /// Calls the control API with the admin key.
    pub async fn api(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.api_as(&self.admin_key, method, path, body).await
    }

    pub async fn api_as(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = Request::builder()
            .method(method)
            .uri(format!("/_culvert/v1/api/{path}"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = self.client().send("127.0.0.1", req, false).await.expect("api call");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let json =
            serde_json::from_slice(&bytes).unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
        (status, json)
    }

    /// Reserves `<name>.edge.test` and mints an http tunnel key; returns (host, secret).
    pub async fn http_tunnel_key(&self, name: &str) -> (String, String) {
        let (s, r) = self.api("POST", "domains", Some(serde_json::json!({"name": name}))).await;
        assert!(s.is_success(), "reserve: {s} {r}");
        let host = r["hostname"].as_str().unwrap().to_string();
        let (s, k) = self
            .api("POST", "tunnel-keys", Some(serde_json::json!({"domain": host, "protocol": "http"})))
            .await;
        assert!(s.is_success(), "tunnel key: {s} {k}");
        (host, k["secret"].as_str().unwrap().to_string())
    }

    /// Reserves a TCP port and mints a tcp tunnel key; returns (port, secret).
    pub async fn tcp_tunnel_key(&self) -> (u16, String) {
        let (s, r) = self.api("POST", "ports", Some(serde_json::json!({}))).await;
        assert!(s.is_success(), "reserve port: {s} {r}");
        let port = r["port"].as_u64().unwrap() as u16;
        let (s, k) =
            self.api("POST", "tunnel-keys", Some(serde_json::json!({"port": port, "protocol": "tcp"}))).await;
        assert!(s.is_success(), "tunnel key: {s} {k}");
        (port, k["secret"].as_str().unwrap().to_string())
    }

    pub async fn stop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.stop().await;
        }
    }

    /// Starts again on the same data dir, HTTPS and HTTP ports.
    pub async fn restart(&mut self) {
        let mut args = self.args.clone();
        args.https_addr = self.https;
        if let Some(h) = &self.handle {
            args.http_addr = h.http_addr;
        }
        self.stop().await;
        let handle = edge::start(args).await.expect("edge restarts");
        assert!(handle.new_admin_key.is_none(), "the admin key survives a restart");
        self.handle = Some(handle);
    }
}

/// An HTTPS client that dials the edge and presents any host name (SNI and Host).
#[derive(Clone)]
pub struct HttpsClient {
    pub addr: SocketAddr,
    pub ca_file: PathBuf,
}

impl HttpsClient {
    pub fn tls_config(&self, h2: bool) -> Arc<rustls::ClientConfig> {
        let roots = culvert::tls::root_store(Some(&self.ca_file)).unwrap();
        let mut c = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
        c.alpn_protocols = vec![if h2 { b"h2".to_vec() } else { b"http/1.1".to_vec() }];
        Arc::new(c)
    }

    pub async fn connect(&self, host: &str, h2: bool) -> tokio_rustls::client::TlsStream<TcpStream> {
        self.tls(TcpStream::connect(self.addr).await.unwrap(), host, h2).await
    }

    /// [`HttpsClient::connect`] with the socket's send buffer fixed at
    /// `bytes` (the kernel doubles it), not grown by the kernel: a test
    /// with hundreds of clients that write until they block measures the
    /// edge, not gigabytes of its own clients' send buffers, which would put
    /// every TCP socket of the machine under memory pressure (tcp_mem) and
    /// have the kernel drop packets of the connections the test watches.
    pub async fn connect_with_send_buffer(
        &self,
        host: &str,
        bytes: u32,
    ) -> tokio_rustls::client::TlsStream<TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(bytes).unwrap();
        self.tls(socket.connect(self.addr).await.unwrap(), host, false).await
    }

    pub async fn tls(
        &self,
        tcp: TcpStream,
        host: &str,
        h2: bool,
    ) -> tokio_rustls::client::TlsStream<TcpStream> {
        let name = rustls_pki_types::ServerName::try_from(host.to_string()).unwrap();
        tokio_rustls::TlsConnector::from(self.tls_config(h2))
            .connect(name, tcp)
            .await
            .expect("TLS to the edge")
    }

    /// Opens a WebSocket to `host` at `path` through the edge (HTTP/1.1
    /// upgrade); also the 101's headers.
    pub async fn websocket(
        &self,
        host: &str,
        path: &str,
    ) -> (tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<TcpStream>>, http::HeaderMap)
    {
        let tls = self.connect(host, false).await;
        let (ws, resp) =
            tokio_tungstenite::client_async(format!("ws://{host}{path}"), tls).await.expect("websocket");
        assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
        (ws, resp.headers().clone())
    }

    /// Sends one request on a new connection (HTTP/1.1 or h2).
    pub async fn send<B>(
        &self,
        host: &str,
        mut req: Request<B>,
        h2: bool,
    ) -> hyper::Result<Response<Incoming>>
    where
        B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let tls = self.connect(host, h2).await;
        let pq = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or("/".into());
        if h2 {
            *req.uri_mut() = format!("https://{host}{pq}").parse().unwrap();
            let (mut s, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
            tokio::spawn(conn);
            s.send_request(req).await
        } else {
            req.headers_mut().insert("host", host.parse().unwrap());
            let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
            tokio::spawn(conn.with_upgrades());
            s.send_request(req).await
        }
    }

    /// GET and collect the body as a string.
    pub async fn get(&self, host: &str, path: &str) -> (StatusCode, String) {
        let req = Request::get(path).body(Full::new(Bytes::new())).unwrap();
        let resp = self.send(host, req, false).await.expect("request");
        let status = resp.status();
        let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

/// An agent running in this process.
pub struct TestAgent {
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<Result<(), culvert::tunnel::connect::ConnectError>>,
}

impl TestAgent {
    /// Connects and waits until the edge routes streams to it.
    pub async fn start(edge: &TestEdge, key: &str, target: Target) -> TestAgent {
        Self::start_at(&edge.url(), &edge.ca_file, key, target).await
    }

    pub async fn start_at(url: &str, ca_file: &Path, key: &str, target: Target) -> TestAgent {
        let agent = Self::spawn(url, ca_file, key, target, false);
        agent.1.notified().await;
        agent.0
    }

    /// [`TestAgent::start`] offering tunnel protocol `version`.
    pub async fn start_version(edge: &TestEdge, key: &str, target: Target, version: u32) -> TestAgent {
        let agent = Self::spawn_version(&edge.url(), &edge.ca_file, key, target, false, version);
        agent.1.notified().await;
        agent.0
    }

    /// Starts without waiting; the Notify fires on every ready connection.
    pub fn spawn(
        url: &str,
        ca_file: &Path,
        key: &str,
        target: Target,
        stop_on_permanent: bool,
    ) -> (TestAgent, Arc<tokio::sync::Notify>) {
        let version = culvert::tunnel::connect::PROTOCOL_VERSION;
        Self::spawn_version(url, ca_file, key, target, stop_on_permanent, version)
    }

    fn spawn_version(
        url: &str,
        ca_file: &Path,
        key: &str,
        target: Target,
        stop_on_permanent: bool,
        version: u32,
    ) -> (TestAgent, Arc<tokio::sync::Notify>) {
        let dialer = Dialer { agent_id: agent::agent_id(), version, ..dialer(url, ca_file, key) };
        Self::spawn_dialer(dialer, target, stop_on_permanent)
    }

    /// [`TestAgent::start`] offering `cipher` first in its TLS.
    pub async fn start_cipher(edge: &TestEdge, key: &str, target: Target, cipher: TunnelCipher) -> TestAgent {
        let tls = culvert::tls::tunnel_client_config(Some(&edge.ca_file), cipher).unwrap();
        let dialer = Dialer { agent_id: agent::agent_id(), tls, ..edge.dialer(key) };
        let agent = Self::spawn_dialer(dialer, target, false);
        agent.1.notified().await;
        agent.0
    }

    fn spawn_dialer(
        dialer: Dialer,
        target: Target,
        stop_on_permanent: bool,
    ) -> (TestAgent, Arc<tokio::sync::Notify>) {
        let ready = Arc::new(tokio::sync::Notify::new());
        let r = ready.clone();
        let on_ready: OnReady = Arc::new(move |_| r.notify_one());
        let shutdown = CancellationToken::new();
        let options = TunnelOptions {
            stop_on_permanent_error: stop_on_permanent,
            on_ready: Some(on_ready),
            on_lost: None,
        };
        let task = tokio::spawn(agent::run_tunnel(dialer, agent::fixed(target), options, shutdown.clone()));
        (TestAgent { shutdown, task }, ready)
    }

    /// Drains and stops.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

/// Settings of a tunnel connection to the edge at `url` trusting `ca_file`,
/// with `key`: no protocol asked, the current protocol version.
pub fn dialer(url: &str, ca_file: &Path, key: &str) -> Dialer {
    Dialer {
        edge: EdgeUrl::parse(url).unwrap(),
        key: key.into(),
        agent_id: "t".into(),
        tls: culvert::tls::tunnel_client_config(Some(ca_file), TunnelCipher::Auto).unwrap(),
        protocol: None,
        version: culvert::tunnel::connect::PROTOCOL_VERSION,
    }
}

/// A real HTTP/1.1 backend on 127.0.0.1:0:
/// - `/echo`: JSON of method, path, headers and body length;
/// - `/bytes?n=N`: streams N bytes;
/// - `/upload`: reads the body, answers its length;
/// - `/delay?ms=N`: answers after N ms;
/// - `/ws`: WebSocket echo;
/// - anything else: `hello from backend`.
pub async fn http_backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    serve_http1(listener, backend_handle);
    addr
}

/// Serves HTTP/1.1 (with upgrades) on each connection `listener` accepts,
/// every request by `handle`, until the listener fails.
pub fn serve_http1<F, Fut, B>(listener: TcpListener, handle: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Response<B>, std::convert::Infallible>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let _ = tcp.set_nodelay(true);
            let service = hyper::service::service_fn(handle.clone());
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .with_upgrades()
                    .await;
            });
        }
    });
}

type TestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

fn query_num(req: &Request<Incoming>, key: &str) -> u64 {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

async fn backend_handle(mut req: Request<Incoming>) -> Result<Response<TestBody>, std::convert::Infallible> {
    let full = |s: String| Full::new(Bytes::from(s)).map_err(|never| match never {}).boxed_unsync();
    Ok(match req.uri().path() {
        "/echo" => {
            let headers: serde_json::Map<String, Value> = req
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), Value::String(v.to_str().unwrap_or("").into())))
                .collect();
            let (method, path) = (req.method().to_string(), req.uri().to_string());
            let len = req.into_body().collect().await.map(|b| b.to_bytes().len()).unwrap_or(0);
            let json =
                serde_json::json!({"method": method, "path": path, "headers": headers, "bodyLength": len});
            Response::new(full(json.to_string()))
        }
        // `/chunked`: the same without a length (hyper sends it chunked).
        "/bytes" | "/chunked" => {
            let n = query_num(&req, "n");
            let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
            let stream = futures_util::stream::unfold(n, move |left| {
                let chunk = chunk.clone();
                async move {
                    (left > 0).then(|| {
                        let take = left.min(chunk.len() as u64);
                        (Ok(hyper::body::Frame::data(chunk.slice(..take as usize))), left - take)
                    })
                }
            });
            let mut r = Response::new(http_body_util::StreamBody::new(stream).boxed_unsync());
            if req.uri().path() == "/bytes" {
                r.headers_mut().insert("content-length", n.into());
            }
            r
        }
        "/upload" => {
            let mut body = req.into_body();
            let mut total = 0u64;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.unwrap().into_data() {
                    total += data.len() as u64;
                }
            }
            Response::new(full(total.to_string()))
        }
        "/delay" => {
            tokio::time::sleep(std::time::Duration::from_millis(query_num(&req, "ms"))).await;
            Response::new(full("delayed".into()))
        }
        "/ws" => websocket_upgrade(&mut req, |msg| (msg.is_text() || msg.is_binary()).then_some(msg))
            .body(full(String::new()))
            .unwrap(),
        _ => Response::new(full("hello from backend".into())),
    })
}

/// A backend's answer to a WebSocket upgrade: the 101 (the caller adds the
/// body), and a task that serves the socket once hyper hands it over,
/// sending `reply(message)` for each message it gets (`None`: nothing) until
/// the client goes.
pub fn websocket_upgrade(
    req: &mut Request<Incoming>,
    mut reply: impl FnMut(Message) -> Option<Message> + Send + 'static,
) -> http::response::Builder {
    use futures_util::{SinkExt, StreamExt};
    let key = req.headers().get("sec-websocket-key").cloned().expect("a WebSocket upgrade has a key");
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let up = on_upgrade.await.unwrap();
        let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
            TokioIo::new(up),
            tokio_tungstenite::tungstenite::protocol::Role::Server,
            None,
        )
        .await;
        while let Some(Ok(msg)) = ws.next().await {
            if let Some(out) = reply(msg)
                && ws.send(out).await.is_err()
            {
                break;
            }
        }
    });
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    Response::builder()
        .status(101)
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-accept", accept)
}

/// Sends `text` on a WebSocket and returns the text message that comes
/// back within 10 s.
pub async fn ws_roundtrip<S>(ws: &mut tokio_tungstenite::WebSocketStream<S>, text: &str) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::{SinkExt, StreamExt};
    ws.send(Message::text(text)).await.expect("websocket send");
    match tokio::time::timeout(std::time::Duration::from_secs(10), ws.next()).await {
        Ok(Some(Ok(Message::Text(t)))) => t.to_string(),
        other => panic!("websocket: {other:?}"),
    }
}

/// A TCP backend on 127.0.0.1:0 that runs `serve` on each connection.
pub async fn tcp_backend<F, Fut>(serve: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(serve(tcp));
        }
    });
    addr
}

/// A TCP echo server on 127.0.0.1:0.
pub async fn tcp_echo() -> SocketAddr {
    tcp_backend(|mut tcp| async move {
        let (mut r, mut w) = tcp.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    })
    .await
}

/// Resident memory of this process in KiB.
pub fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Polls `probe` every 50 ms until it yields, failing the test with
/// "`what` not met within `limit`" after `limit`.
pub async fn wait_for<T>(what: &str, limit: std::time::Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what} not met within {limit:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Polls the async `probe` every 50 ms until it yields `Ok`, failing the
/// test with "`what` not met within `limit`: <the last `Err`>" after `limit`
/// (the `Err` says what was seen instead).
pub async fn eventually<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    limit: std::time::Duration,
    mut probe: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "{what} not met within {limit:?}: {e}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A `culvert` process (or another command) whose stdout is read for its
/// readiness lines; its stderr goes to the test's, and it is killed when
/// dropped.
pub struct Proc {
    pub child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Proc {
    /// Runs the `culvert` binary of this build with `args`.
    pub fn culvert(args: &[&str]) -> Proc {
        Proc::spawn(tokio::process::Command::new(env!("CARGO_BIN_EXE_culvert")).args(args))
    }

    /// `culvert edge` with a self-signed CA in `dir`, serving HTTPS on
    /// `https` and its plain HTTP and admin ports on 127.0.0.1:0; TCP
    /// reservations listen on `tcp_bind` (`tcp_ports`: none when empty).
    /// Not started: the caller adds its own flags.
    pub fn edge_command(dir: &Path, https: &str, tcp_bind: &str, tcp_ports: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_culvert"));
        cmd.args(["edge", "--domain", DOMAIN, "--self-signed", "--data-dir"])
            .arg(dir)
            .args(["--https-addr", https, "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"])
            .args(["--tcp-bind", tcp_bind, "--public-host", tcp_bind]);
        if !tcp_ports.is_empty() {
            cmd.args(["--tcp-ports", tcp_ports]);
        }
        cmd
    }

    /// Runs `cmd` with `RUST_LOG=info`.
    pub fn spawn(cmd: &mut tokio::process::Command) -> Proc {
        use tokio::io::AsyncBufReadExt;
        let mut child = cmd
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("culvert runs");
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        Proc { child, lines }
    }

    /// The next stdout line that starts with `prefix` (the readiness signal),
    /// within 30 s.
    pub async fn line(&mut self, prefix: &str) -> String {
        self.line_within(prefix, std::time::Duration::from_secs(30)).await
    }

    /// [`Proc::line`] within `limit`.
    pub async fn line_within(&mut self, prefix: &str, limit: std::time::Duration) -> String {
        line_starting(&mut self.lines, prefix, limit).await
    }

    /// Sends `sig` (`-KILL`, `-TERM`, …) with kill(1).
    pub fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("running").to_string();
        let ok = std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success();
        assert!(ok, "kill {sig} {pid}");
    }

    /// Waits up to 30 s for the process to end.
    pub async fn exited(&mut self) {
        tokio::time::timeout(std::time::Duration::from_secs(30), self.child.wait())
            .await
            .expect("exits")
            .unwrap();
    }
}

/// The value of `key=value` in a log line.
pub fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|w| w.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// The next line of a child's stdout that starts with `prefix` (a process's
/// readiness signal), within `limit`.
pub async fn line_starting<R: tokio::io::AsyncBufRead + Unpin>(
    lines: &mut tokio::io::Lines<R>,
    prefix: &str,
    limit: std::time::Duration,
) -> String {
    line_where(lines, &format!("`{prefix}`"), limit, |l| l.starts_with(prefix)).await
}

/// The next line of a child's output for which `pred` holds (`what` names
/// it in the failure), within `limit`.
pub async fn line_where<R: tokio::io::AsyncBufRead + Unpin>(
    lines: &mut tokio::io::Lines<R>,
    what: &str,
    limit: std::time::Duration,
    pred: impl Fn(&str) -> bool,
) -> String {
    let read = async {
        loop {
            match lines.next_line().await.unwrap() {
                Some(l) if pred(&l) => return l,
                Some(_) => continue,
                None => panic!("process ended before printing {what}"),
            }
        }
    };
    tokio::time::timeout(limit, read).await.unwrap_or_else(|_| panic!("no {what} line in {limit:?}"))
}

/// Reads the rest of a child's output and drops it, so that the child never
/// blocks on a full pipe.
pub fn drain<R: tokio::io::AsyncBufRead + Unpin + Send + 'static>(mut lines: tokio::io::Lines<R>) {
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
}
