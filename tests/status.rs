//! The status page over real sockets: a real edge with real agents and
//! backends on 127.0.0.1; the document and its Server-Sent Events on the
//! admin port, the login on the public path, the control API's `status` and
//! `culvert admin status`, the bounds (many tunnels, a client that never
//! reads), and the page in headless Chromium.

mod support;
use support::net;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use culvert::agent::Target;
use culvert::tls::TunnelCipher;
use futures_util::StreamExt;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use net::{TestAgent, TestEdge};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BIN: &str = env!("CARGO_BIN_EXE_culvert");

fn admin_addr(edge: &TestEdge) -> SocketAddr {
    edge.handle.as_ref().unwrap().admin_addr
}

/// One plain HTTP/1.1 request to the admin port.
async fn admin_get(addr: SocketAddr, path: &str) -> (StatusCode, HeaderMap, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    let req = Request::get(path).header("host", "localhost").body(Full::new(Bytes::new())).unwrap();
    let resp = s.send_request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
}

async fn admin_json(addr: SocketAddr, path: &str) -> Value {
    let (status, _, body) = admin_get(addr, path).await;
    assert_eq!(status, StatusCode::OK, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn tunnel<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["tunnels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tunnel {name} in {doc}"))
}

/// An edge with two published tunnels (`alpha`, `beta`: an agent and a
/// backend each) and a reservation without an agent (`gamma`).
async fn two_tunnels(configure: impl FnOnce(&mut culvert::edge::EdgeArgs)) -> (TestEdge, Vec<TestAgent>) {
    let edge = TestEdge::start_with(configure).await;
    let mut agents = Vec::new();
    // beta's agent as on a CPU without AES instructions.
    for (name, cipher) in [("alpha", TunnelCipher::Aes128Gcm), ("beta", TunnelCipher::Chacha20Poly1305)] {
        let backend = net::http_backend().await;
        let (_, key) = edge.http_tunnel_key(name).await;
        agents.push(TestAgent::start_cipher(&edge, &key, Target::http(backend.to_string()), cipher).await);
    }
    let (s, r) = edge.api("POST", "domains", Some(json!({"name": "gamma"}))).await;
    assert!(s.is_success(), "{r}");
    (edge, agents)
}

async fn traffic(edge: &TestEdge, name: &str, n: usize) {
    let host = format!("{name}.{}", net::DOMAIN);
    for _ in 0..n {
        let (s, _) = edge.client().get(&host, "/bytes?n=1000").await;
        assert_eq!(s, StatusCode::OK);
    }
}

/// Reads Server-Sent Events from a body until `n` `status` events came.
async fn read_events(body: &mut hyper::body::Incoming, n: usize) -> Vec<Value> {
    let mut buf = String::new();
    let mut events = Vec::new();
    while events.len() < n {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("an event within 10 s")
            .expect("the stream goes on")
            .unwrap();
        if let Ok(data) = frame.into_data() {
            buf.push_str(&String::from_utf8_lossy(&data));
        }
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            assert!(block.contains("event: status\n"), "{block}");
            let data = block.lines().find_map(|l| l.strip_prefix("data: ")).expect("a data line");
            events.push(serde_json::from_str(data).unwrap());
        }
    }
    events
}

#[tokio::test]
async fn the_admin_port_serves_the_document_the_page_and_live_events() {
    let (edge, _agents) = two_tunnels(|_| {}).await;
    let admin = admin_addr(&edge);
    traffic(&edge, "alpha", 3).await;
    traffic(&edge, "beta", 1).await;
    let (s, _) = edge.client().get("gamma.edge.test", "/").await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "gamma has no agent");

    let doc = admin_json(admin, "/status/json").await;
    assert_eq!(doc["statusVersion"], 1);
    assert_eq!(doc["tunnelsTotal"], 3);
    let e = &doc["edge"];
    assert_eq!(e["domain"], net::DOMAIN);
    assert_eq!(e["agentsConnected"], 2);
    assert_eq!(e["store"]["ok"], true, "{e}");
    assert!(e["fds"]["used"].as_u64().unwrap() > 3 && e["fds"]["budget"].as_u64().is_some(), "{e}");
    assert!(e["memory"]["used"].as_u64().unwrap() > 1 << 20, "{e}");
    let names: Vec<&str> =
        e["listeners"].as_array().unwrap().iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["https", "http", "admin"]);
    assert_eq!(e["listeners"][2]["address"], admin.to_string());

    let alpha = tunnel(&doc, "alpha.edge.test");
    assert_eq!(alpha["agentsConnected"], 1);
    let agent = &alpha["agents"][0];
    assert!(agent["address"].as_str().unwrap().starts_with("127.0.0.1:"), "{agent}");
    assert_eq!(agent["protocolVersion"], 2, "the multiplexer");
    assert_eq!(agent["cipher"], "TLS13_AES_128_GCM_SHA256");
    let beta_agent = &tunnel(&doc, "beta.edge.test")["agents"][0];
    assert_eq!(beta_agent["cipher"], "TLS13_CHACHA20_POLY1305_SHA256", "{beta_agent}");
    assert_eq!(agent["protocol"], "http");
    assert!(agent["keyId"].as_str().unwrap().starts_with("tk_"));
    assert_eq!(alpha["totals"]["requests"], 3);
    assert!(alpha["totals"]["bytesOut"].as_u64().unwrap() >= 3000, "{alpha}");
    assert_eq!(tunnel(&doc, "beta.edge.test")["totals"]["requests"], 1);
    let gamma = tunnel(&doc, "gamma.edge.test");
    assert_eq!((gamma["agentsConnected"].as_u64(), gamma["totals"]["offline"].as_u64()), (Some(0), Some(1)));
    assert_eq!(doc["tunnels"][2]["name"], "gamma.edge.test", "connected tunnels first");
    assert_eq!(admin_json(admin, "/status/json?limit=1").await["tunnelsShown"], 1);
    assert_eq!(admin_get(admin, "/status/json?limit=x").await.0, StatusCode::BAD_REQUEST);

    // The page, readable without JavaScript, with its compiled-in assets.
    let (s, h, page) = admin_get(admin, "/status").await;
    assert_eq!(s, StatusCode::OK);
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(h["content-security-policy"].to_str().unwrap().contains("frame-ancestors 'none'"));
    for want in [
        "alpha.edge.test",
        "beta.edge.test",
        "· CHACHA20-POLY1305 ·",
        "data-count=\"1\"",
        "<svg class=\"chart\"",
        "/status/page.js",
    ] {
        assert!(page.contains(want), "page lacks {want}");
    }
    let (s, h, js) = admin_get(admin, "/status/page.js").await;
    assert_eq!((s, h["content-type"].to_str().unwrap()), (StatusCode::OK, "text/javascript; charset=utf-8"));
    assert!(js.contains("EventSource"));
    assert_eq!(admin_get(admin, "/status/page.css").await.0, StatusCode::OK);
    assert_eq!(admin_get(admin, "/").await.0, StatusCode::SEE_OTHER);
    assert_eq!(admin_get(admin, "/metrics").await.0, StatusCode::OK, "metrics stay");

    // Live: the counters move between two events.
    let tcp = TcpStream::connect(admin).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    let req = Request::get("/status/events").header("host", "x").body(Full::new(Bytes::new())).unwrap();
    let resp = s.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    let first = read_events(&mut body, 1).await.remove(0);
    assert_eq!(first["edge"]["events"]["subscribers"], 1);
    let before = tunnel(&first, "alpha.edge.test")["totals"]["requests"].as_u64().unwrap();
    traffic(&edge, "alpha", 2).await;
    let next = read_events(&mut body, 1).await.remove(0);
    assert_eq!(tunnel(&next, "alpha.edge.test")["totals"]["requests"].as_u64().unwrap(), before + 2);
    drop(body);
    net::wait_for("the event stream to close", Duration::from_secs(10), || {
        (edge.edge().monitor.events_open() == 0).then_some(())
    })
    .await;
}

fn form(key: &str, origin: Option<&str>) -> Request<Full<Bytes>> {
    let mut b =
        Request::post("/_culvert/status/login").header("content-type", "application/x-www-form-urlencoded");
    if let Some(o) = origin {
        b = b.header("origin", o);
    }
    b.body(Full::new(Bytes::from(format!("key={key}")))).unwrap()
}

async fn send(edge: &TestEdge, req: Request<Full<Bytes>>) -> (StatusCode, HeaderMap, String) {
    let resp = edge.client().send(net::DOMAIN, req, false).await.unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, String::from_utf8_lossy(&body).into_owned())
}

fn get_with(path: &str, cookie: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::get(path);
    if let Some(c) = cookie {
        b = b.header("cookie", c);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

#[tokio::test]
async fn the_public_path_needs_an_admin_key() {
    let (edge, _agents) = two_tunnels(|a| a.public_status = true).await;
    // What a browser sends with this test client's Host (no port).
    let origin = format!("https://{}", net::DOMAIN);
    let (_, tunnel_key) = edge.http_tunnel_key("delta").await;
    let (s, endpoints) =
        edge.api("POST", "api-keys", Some(json!({"name": "ops", "scope": "endpoints"}))).await;
    assert!(s.is_success());
    let endpoints_key = endpoints["secret"].as_str().unwrap();

    // Nothing without the key: a login form and 401s.
    let (s, h, page) = send(&edge, get_with("/_culvert/status", None)).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(page.contains("<form method=\"post\" action=\"/_culvert/status/login\">"), "{page}");
    assert!(!page.contains("alpha") && !page.contains(net::DOMAIN), "no data before the login");
    assert_eq!(h["x-frame-options"], "DENY");
    for path in ["/_culvert/status/json", "/_culvert/status/events"] {
        let (s, _, body) = send(&edge, get_with(path, None)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        assert!(!body.contains("alpha"));
    }
    let forged = format!(
        "{}=00000000000000000000000000000000000000000000000000000000000000ff",
        "__Host-culvert-status"
    );
    assert_eq!(
        send(&edge, get_with("/_culvert/status/json", Some(&forged))).await.0,
        StatusCode::UNAUTHORIZED
    );

    // Refused: a wrong key, a tunnel key, an endpoints key, another site's form.
    let wrong = format!("culvert_a_{}", "0".repeat(64));
    for (key, status, says) in [
        (wrong.as_str(), StatusCode::UNAUTHORIZED, "Wrong key"),
        (tunnel_key.as_str(), StatusCode::FORBIDDEN, "tunnel key"),
        (endpoints_key, StatusCode::FORBIDDEN, "endpoints key"),
    ] {
        let (s, h, page) = send(&edge, form(key, Some(&origin))).await;
        assert_eq!(s, status, "{page}");
        assert!(page.contains(says), "{page}");
        assert!(h.get("set-cookie").is_none());
    }
    let (s, h, _) = send(&edge, form(&edge.admin_key, Some("https://evil.example"))).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "a login posted from another site");
    assert!(h.get("set-cookie").is_none());

    // The admin key: a session cookie, then the page and the document.
    let (s, h, _) = send(&edge, form(&edge.admin_key, Some(&origin))).await;
    assert_eq!(s, StatusCode::SEE_OTHER);
    assert_eq!(h["location"], "/_culvert/status");
    let set = h["set-cookie"].to_str().unwrap();
    for attr in ["__Host-culvert-status=", "HttpOnly", "Secure", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(attr), "{set} lacks {attr}");
    }
    assert!(!set.contains(&edge.admin_key), "the cookie is not the key");
    let cookie = set.split(';').next().unwrap().to_string();
    let (s, _, page) = send(&edge, get_with("/_culvert/status", Some(&cookie))).await;
    assert_eq!(s, StatusCode::OK);
    assert!(page.contains("alpha.edge.test") && page.contains("Log out"));
    assert!(page.contains("src=\"/_culvert/status/page.js\""));
    let (s, _, doc) = send(&edge, get_with("/_culvert/status/json", Some(&cookie))).await;
    assert_eq!(s, StatusCode::OK);
    let doc: Value = serde_json::from_str(&doc).unwrap();
    assert_eq!(tunnel(&doc, "beta.edge.test")["agentsConnected"], 1);

    // Other hosts: /_culvert/ is the edge's own, never forwarded to a tenant (nor the page served there).
    let (s, body) = edge.client().get("alpha.edge.test", "/_culvert/status").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{body}");
    assert!(!body.contains("hello from backend") && !body.contains("Log out"), "{body}");

    // A live view with the session; the logout below ends it.
    let resp = edge
        .client()
        .send(net::DOMAIN, get_with("/_culvert/status/events", Some(&cookie)), false)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut events = resp.into_body();
    assert_eq!(read_events(&mut events, 1).await[0]["tunnelsTotal"], 4);

    // Logout ends the session.
    let logout = Request::post("/_culvert/status/logout")
        .header("cookie", &cookie)
        .header("origin", &origin)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (s, h, _) = send(&edge, logout).await;
    assert_eq!(s, StatusCode::SEE_OTHER);
    assert!(h["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(Ok(_)) = events.frame().await {}
    })
    .await;
    assert!(ended.is_ok(), "the live view ends with the session");
    assert_eq!(
        send(&edge, get_with("/_culvert/status/json", Some(&cookie))).await.0,
        StatusCode::UNAUTHORIZED
    );

    // Revoking the key ends its sessions.
    let (s, admin2) = edge.api("POST", "api-keys", Some(json!({"name": "second", "scope": "admin"}))).await;
    assert!(s.is_success());
    let (_, h, _) = send(&edge, form(admin2["secret"].as_str().unwrap(), None)).await;
    let cookie = h["set-cookie"].to_str().unwrap().split(';').next().unwrap().to_string();
    assert_eq!(send(&edge, get_with("/_culvert/status/json", Some(&cookie))).await.0, StatusCode::OK);
    let id = admin2["id"].as_str().unwrap();
    assert!(edge.api("DELETE", &format!("api-keys/{id}"), None).await.0.is_success());
    assert_eq!(
        send(&edge, get_with("/_culvert/status/json", Some(&cookie))).await.0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn the_public_path_is_off_by_default() {
    let edge = TestEdge::start().await;
    let (s, _, body) = send(&edge, get_with("/_culvert/status", None)).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(body.contains("--public-status"), "{body}");
    assert_eq!(send(&edge, form(&edge.admin_key, None)).await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn the_control_api_and_culvert_admin_status() {
    let (edge, _agents) = two_tunnels(|_| {}).await;
    traffic(&edge, "alpha", 2).await;
    // A TCP port: connections count as requests.
    let echo = net::tcp_echo().await;
    let (port, key) = edge.tcp_tunnel_key().await;
    let _tcp_agent = TestAgent::start(&edge, &key, Target::Tcp { addr: echo.to_string(), proxy: None }).await;
    for _ in 0..3 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        s.read_exact(&mut got).await.unwrap();
    }
    let (s, doc) = edge.api("GET", "status", None).await;
    assert_eq!(s, StatusCode::OK, "{doc}");
    assert_eq!(tunnel(&doc, "alpha.edge.test")["totals"]["requests"], 2);
    let tcp = tunnel(&doc, &format!(":{port}"));
    assert_eq!((tcp["kind"].as_str(), tcp["agentsConnected"].as_u64()), (Some("tcp"), Some(1)));
    assert_eq!(tcp["totals"]["requests"], 3);
    assert_eq!(tcp["agents"][0]["protocol"], "tcp");
    assert_eq!(doc["edge"]["tcpListeners"], 1);
    let (s, endpoints) =
        edge.api("POST", "api-keys", Some(json!({"name": "ops", "scope": "endpoints"}))).await;
    assert!(s.is_success());
    let (s, err) = edge.api_as(endpoints["secret"].as_str().unwrap(), "GET", "status", None).await;
    assert_eq!((s, err["error"]["code"].as_str()), (StatusCode::FORBIDDEN, Some("admin_required")));

    let cli = |extra: &[&str]| {
        let mut c = tokio::process::Command::new(BIN);
        c.args(["admin", "--edge", &edge.url(), "--key", &edge.admin_key, "--ca-file"])
            .arg(&edge.ca_file)
            .args(extra);
        c
    };
    let out = cli(&["status"]).output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("EDGE") && table.contains("TUNNEL"), "{table}");
    let alpha = table.lines().find(|l| l.starts_with("alpha.edge.test")).expect(&table);
    let cols: Vec<&str> = alpha.split_whitespace().collect();
    assert_eq!((cols[1], cols[2], cols[4]), ("subdomain", "1", "2"), "{alpha}");
    assert!(table.lines().any(|l| l.starts_with("gamma.edge.test")));
    let out = cli(&["status", "-o", "json", "--limit", "1"]).output().await.unwrap();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((doc["statusVersion"].as_u64(), doc["tunnelsShown"].as_u64()), (Some(1), Some(1)));
}

/// Adds `n` domain reservations of the admin key straight into the stopped
/// edge's database, in one transaction (through the API each one reloads the
/// routes: minutes for thousands in a debug build).
async fn reserve_many(edge: &mut TestEdge, n: usize) {
    let (_, info) = edge.api("GET", "info", None).await;
    let owner = info["caller"]["id"].as_str().unwrap().to_string();
    edge.stop().await;
    let mut db = rusqlite::Connection::open(edge.dir.path().join("culvert.db")).unwrap();
    let tx = db.transaction().unwrap();
    for i in 0..n {
        tx.execute(
            "INSERT INTO reservations (id, kind, hostname, owner, labels, created_at) \
             VALUES (?1, 'subdomain', ?2, ?3, '{\"team\":\"load\"}', '2026-01-01T00:00:00Z')",
            (format!("rs_{i:012x}"), format!("t{i:04}.{}", net::DOMAIN), &owner),
        )
        .unwrap();
    }
    tx.commit().unwrap();
    drop(db);
    edge.restart().await;
}

#[tokio::test]
async fn many_tunnels_and_a_client_that_never_reads_stay_bounded() {
    let mut edge = TestEdge::start().await;
    reserve_many(&mut edge, 2000).await;
    let mut agents = Vec::new();
    for name in ["alpha", "beta"] {
        let backend = net::http_backend().await;
        let (_, key) = edge.http_tunnel_key(name).await;
        agents.push(TestAgent::start(&edge, &key, Target::http(backend.to_string())).await);
    }
    let (s, _) = edge.api("POST", "domains", Some(json!({"name": "gamma"}))).await;
    assert!(s.is_success());
    let admin = admin_addr(&edge);
    traffic(&edge, "beta", 1).await;

    // The document is bounded by its limit, whatever the number of tunnels.
    let (_, _, body) = admin_get(admin, "/status/json").await;
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((doc["tunnelsTotal"].as_u64(), doc["tunnelsShown"].as_u64()), (Some(2003), Some(100)));
    assert_eq!(doc["tunnels"][0]["name"], "beta.edge.test", "connected and busiest first");
    assert_eq!(doc["tunnels"][1]["name"], "alpha.edge.test");
    assert!(body.len() < 200 * 1024, "{} bytes for 100 tunnels", body.len());
    let (_, _, big) = admin_get(admin, "/status/json?limit=100000").await;
    let big: Value = serde_json::from_str(&big).unwrap();
    assert_eq!(big["tunnelsShown"], 1000, "at most MAX_LIMIT");

    // A subscriber with a tiny receive buffer that never reads its stream of
    // ~0.5 MB documents: the edge makes no new document for it once the
    // connection is full, so nothing queues.
    let rss_before = net::rss_kib();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(admin).await.unwrap();
    slow.write_all(b"GET /status/events?limit=1000 HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let sent = || edge.edge().monitor.events_bytes_sent();
    net::wait_for("the first event", Duration::from_secs(10), || (sent() > 0).then_some(())).await;
    let event_size = sent();
    assert!(event_size > 300 * 1024, "a large document: {event_size}");
    // The kernel takes what fits the socket buffers; then the edge makes no
    // more documents for this client: the count stops for 3 s in a row.
    let (mut last, mut still) = (sent(), 0);
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = sent();
        still = if now == last { still + 1 } else { 0 };
        last = now;
        if still == 3 {
            break;
        }
    }
    assert_eq!(still, 3, "documents are still made for a client that does not read: {last} bytes");
    let wmem_max: u64 = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .unwrap()
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        last <= wmem_max + 64 * 1024 + 3 * event_size,
        "{last} bytes made for the slow client: more than the socket buffer ({wmem_max}) and 3 events of {event_size}"
    );
    // Others are served meanwhile.
    let doc = admin_json(admin, "/status/json").await;
    assert_eq!(doc["edge"]["events"]["subscribers"], 1);
    let rss_after = net::rss_kib();
    assert!(rss_after < rss_before + 32 * 1024, "RSS {rss_before} KiB -> {rss_after} KiB");

    // The subscriber leaves: its slot is free again.
    drop(slow);
    net::wait_for("the slow stream to close", Duration::from_secs(10), || {
        (edge.edge().monitor.events_open() == 0).then_some(())
    })
    .await;
    // At most MAX_SUBSCRIBERS streams at once.
    let mut open = Vec::new();
    for _ in 0..culvert::edge::status::MAX_SUBSCRIBERS {
        let mut s = TcpStream::connect(admin).await.unwrap();
        s.write_all(b"GET /status/events?limit=1 HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        open.push(s);
    }
    let (s, _, body) = admin_get(admin, "/status/events").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
}

/// A DevTools protocol client over the browser's WebSocket (on 127.0.0.1).
struct Cdp {
    ws: tokio_tungstenite::WebSocketStream<TcpStream>,
    next: u64,
    session: Option<String>,
}

impl Cdp {
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.try_call(method, params).await.unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    /// A call; its error (a navigation that replaced the page, say) as `Err`.
    async fn try_call(&mut self, method: &str, params: Value) -> Result<Value, Value> {
        use futures_util::SinkExt;
        use tokio_tungstenite::tungstenite::Message;
        self.next += 1;
        let id = self.next;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = &self.session {
            msg["sessionId"] = json!(s);
        }
        self.ws.send(Message::text(msg.to_string())).await.unwrap();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(30), self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method}"))
                .expect("the browser is connected")
                .unwrap();
            let Message::Text(text) = m else { continue };
            let v: Value = serde_json::from_str(&text).unwrap();
            if v["id"] == id {
                return match v.get("error") {
                    Some(e) => Err(e.clone()),
                    None => Ok(v["result"].clone()),
                };
            }
        }
    }

    /// Evaluates a JavaScript expression in the page; its JSON value.
    async fn eval(&mut self, expr: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({"expression": expr, "returnByValue": true})).await;
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {r}");
        r["result"]["value"].clone()
    }

    /// Waits until `expr` is truthy in the page (after a navigation, say;
    /// an evaluation cut by the navigation counts as "not yet").
    async fn until(&mut self, what: &str, expr: &str) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        let eval = json!({"expression": expr, "returnByValue": true});
        loop {
            if let Ok(r) = self.try_call("Runtime.evaluate", eval.clone()).await {
                let v = r["result"]["value"].clone();
                if r.get("exceptionDetails").is_none() && !v.is_null() && v != json!(false) {
                    return v;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                let text =
                    json!({"expression": "document.body && document.body.innerText", "returnByValue": true});
                let page = self.try_call("Runtime.evaluate", text).await;
                panic!("{what}: not met within 90 s; page: {page:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
    }
}

/// The installed Chromium, if any.
fn chromium() -> Option<&'static str> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"].into_iter().find(|p| std::path::Path::new(p).exists())
}

/// Starts headless Chromium that talks to 127.0.0.1 only (edge.test maps to
/// it, every other name fails to resolve) and connects to its DevTools.
async fn browser(profile: &std::path::Path) -> (tokio::process::Child, Cdp) {
    use tokio::io::AsyncBufReadExt;
    let mut cmd = tokio::process::Command::new(chromium().unwrap());
    cmd.args([
        "--headless",
        "--disable-gpu",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-extensions",
        "--disable-breakpad",
        "--no-proxy-server",
        // The edge's self-signed CA is not in the browser's store.
        "--ignore-certificate-errors",
        "--host-resolver-rules=MAP edge.test 127.0.0.1, MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--window-size=1280,760",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .arg("about:blank")
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true);
    // SAFETY: geteuid only reads the process's user id.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--no-sandbox");
    }
    let mut child = cmd.spawn().expect("chromium starts");
    // The readiness signal: "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID".
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(url) = l.strip_prefix("DevTools listening on ") {
                return url.to_string();
            }
        }
        panic!("chromium ended before listening");
    })
    .await
    .expect("chromium listens within 60 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let addr = url.trim_start_matches("ws://").split('/').next().unwrap().to_string();
    assert!(addr.starts_with("127.0.0.1:"), "{url}");
    let tcp = TcpStream::connect(&addr).await.unwrap();
    let (ws, _) = tokio_tungstenite::client_async(url.as_str(), tcp).await.expect("DevTools WebSocket");
    let mut cdp = Cdp { ws, next: 0, session: None };
    let target = cdp.call("Target.createTarget", json!({"url": "about:blank"})).await;
    let session =
        cdp.call("Target.attachToTarget", json!({"targetId": target["targetId"], "flatten": true})).await;
    cdp.session = Some(session["sessionId"].as_str().unwrap().to_string());
    cdp.call("Page.enable", json!({})).await;
    cdp.call("Runtime.enable", json!({})).await;
    (child, cdp)
}

const ROWS: &str = "JSON.stringify([...document.querySelectorAll('#rows tr')].map(tr => ({name: tr.dataset.name, \
     agents: tr.querySelector('.agents').dataset.count, requests: +tr.querySelector('.requests').textContent})))";

fn rows(v: &Value) -> Vec<(String, String, u64)> {
    let list: Vec<Value> = serde_json::from_str(v.as_str().unwrap()).unwrap();
    list.iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap().into(),
                r["agents"].as_str().unwrap().into(),
                r["requests"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn requests_of(rows: &[(String, String, u64)], name: &str) -> u64 {
    rows.iter().find(|r| r.0 == name).map(|r| r.2).unwrap_or_else(|| panic!("no row {name}: {rows:?}"))
}

#[tokio::test]
async fn the_page_in_headless_chromium() {
    if chromium().is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is not installed (scripts/deps installs it): the browser test cannot run"
        );
        eprintln!("SKIPPED: chromium is not installed (scripts/deps installs it)");
        return;
    }
    let (edge, _agents) = two_tunnels(|a| a.public_status = true).await;
    let admin = admin_addr(&edge);
    let (_, tunnel_key) = edge.http_tunnel_key("delta").await;
    // Steady traffic through both tunnels while the browser looks.
    let client = edge.client();
    let load = tokio::spawn(async move {
        for i in 0u64.. {
            let name = if i % 3 == 0 { "beta" } else { "alpha" };
            let _ = client
                .get(&format!("{name}.edge.test"), &format!("/bytes?n={}", 2000 + (i * 7919) % 30000))
                .await;
            // Bursts and lulls, for a chart with a shape.
            tokio::time::sleep(Duration::from_millis(20 + (i / 40 % 6) * 25)).await;
        }
    });
    let profile = tempfile::tempdir().unwrap();
    let (_chromium, mut cdp) = browser(profile.path()).await;

    // The admin port: both tunnels, their agents, counters that move live.
    cdp.navigate(&format!("http://{admin}/status")).await;
    cdp.until("the live view", "document.getElementById('live').className === 'on'").await;
    let first = rows(&cdp.eval(ROWS).await);
    let names: Vec<&str> = first.iter().map(|r| r.0.as_str()).collect();
    for name in ["alpha.edge.test", "beta.edge.test", "gamma.edge.test", "delta.edge.test"] {
        assert!(names.contains(&name), "{first:?}");
    }
    for r in &first {
        let want = if r.0.starts_with("alpha") || r.0.starts_with("beta") { "1" } else { "0" };
        assert_eq!(r.1, want, "agents of {}", r.0);
    }
    let (a0, b0) = (requests_of(&first, "alpha.edge.test"), requests_of(&first, "beta.edge.test"));
    let moved = format!(
        "(() => {{ const r = {ROWS}; const l = JSON.parse(r); const n = x => l.find(t => t.name === x).requests; \
         return n('alpha.edge.test') > {a0} && n('beta.edge.test') > {b0}; }})()"
    );
    cdp.until("the counters to move without a reload", &moved).await;
    // A chart with a few points of history (for the README's screenshot a
    // minute of it), then the screenshot.
    let update = std::env::var_os("CULVERT_UPDATE_SCREENSHOT").is_some();
    let points = if update { 14 } else { 3 };
    cdp.until(
        "a chart with history",
        &format!(
            "[...document.querySelectorAll('tr[data-name=\"alpha.edge.test\"] polyline.requests')]\
             .some(p => p.getAttribute('points').split(' ').length >= {points})"
        ),
    )
    .await;
    let shot = cdp.call("Page.captureScreenshot", json!({"format": "png"})).await;
    use base64::Engine;
    let png = base64::engine::general_purpose::STANDARD.decode(shot["data"].as_str().unwrap()).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let file = match update {
        true => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/status-page.png"),
        false => std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("status-page.png"),
    };
    std::fs::write(&file, &png).unwrap();
    eprintln!("screenshot: {}", file.display());

    // The public path: a login form; a wrong key and a tunnel key are refused.
    let public = format!("https://{}:{}/_culvert/status", net::DOMAIN, edge.https.port());
    cdp.navigate(&public).await;
    cdp.until("the login form", "!!document.getElementById('key')").await;
    assert_eq!(cdp.eval("document.querySelectorAll('#rows').length").await, 0, "no data before the login");
    let login = |key: &str| {
        format!(
            "(() => {{ document.getElementById('key').value = {}; document.querySelector('button[type=submit]').click(); return true; }})()",
            json!(key)
        )
    };
    let wrong = format!("culvert_a_{}", "1".repeat(64));
    cdp.eval(&login(&wrong)).await;
    cdp.until(
        "the wrong key refused",
        "(document.querySelector('.refused') || {}).textContent?.includes('Wrong key')",
    )
    .await;
    cdp.eval(&login(&tunnel_key)).await;
    cdp.until(
        "the tunnel key refused",
        "(document.querySelector('.refused') || {}).textContent?.includes('tunnel key')",
    )
    .await;
    assert_eq!(cdp.eval("document.querySelectorAll('#rows').length").await, 0);
    // The admin key opens the page; the session cookie is out of the page's reach.
    cdp.eval(&login(&edge.admin_key)).await;
    cdp.until(
        "the page after the login",
        "!!document.querySelector('#rows tr[data-name=\"alpha.edge.test\"]')",
    )
    .await;
    cdp.until("the live view", "document.getElementById('live').className === 'on'").await;
    assert_eq!(cdp.eval("location.pathname").await, "/_culvert/status");
    assert_eq!(cdp.eval("document.cookie").await, "", "HttpOnly");
    let cookies = cdp.call("Network.getCookies", json!({"urls": [public]})).await;
    let c = &cookies["cookies"][0];
    assert_eq!(
        (&c["name"], &c["httpOnly"], &c["secure"], &c["sameSite"]),
        (&json!("__Host-culvert-status"), &json!(true), &json!(true), &json!("Strict")),
        "{cookies}"
    );
    let agents = rows(&cdp.eval(ROWS).await);
    assert_eq!(agents.iter().find(|r| r.0 == "beta.edge.test").unwrap().1, "1");
    load.abort();
}
