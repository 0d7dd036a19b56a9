//! Tunnel routes with Gateway API's HTTPRoute features against a real
//! kube-apiserver (the kube-env harness), a real edge and real backends in a
//! network namespace the test creates: method, header and query matches and
//! their precedence (asked with curl), a weighted split, each filter as the
//! backend saw it (the backends echo what they received), redirects with
//! their exact Location and status, and route changes applied while a
//! WebSocket stays open.

mod support;
use support::{net, netns, operator as fixture};

use std::collections::BTreeMap;

use bytes::Bytes;
use culvert::crd::{Domain, Tunnel};
use fixture::{Fixture, listen_in, service_with_endpoints};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::Secret;
use netns::NetnsHost;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

type TestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// An HTTP backend named `label` in the network namespace: answers with
/// JSON of what it received (method, path and query, headers), with the
/// response headers `x-backend-drop` and `x-backend-keep`; a path ending in
/// `/ws` is a WebSocket echo that says which path and `x-ws` it was opened with.
fn echo_backend(host: &NetnsHost, port: u16, label: &'static str) {
    net::serve_http1(listen_in(host, port), move |req| echo(req, label));
}

async fn echo(
    mut req: Request<Incoming>,
    label: &'static str,
) -> Result<Response<TestBody>, std::convert::Infallible> {
    let full = |s: String| Full::new(Bytes::from(s)).map_err(|never| match never {}).boxed_unsync();
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (n, v) in req.headers() {
        headers.entry(n.to_string()).or_default().push(String::from_utf8_lossy(v.as_bytes()).into());
    }
    let target = req.uri().path_and_query().map(|p| p.to_string()).unwrap_or_default();
    if !req.uri().path().ends_with("/ws") {
        let body =
            json!({"label": label, "method": req.method().as_str(), "target": target, "headers": headers});
        let mut resp = Response::new(full(body.to_string()));
        resp.headers_mut().insert("x-backend-drop", "1".parse().unwrap());
        resp.headers_mut().insert("x-backend-keep", "1".parse().unwrap());
        return Ok(resp);
    }
    let ws_header = headers.get("x-ws").map(|v| v.join(",")).unwrap_or_default();
    let reply = move |msg| match msg {
        Message::Text(t) => Some(Message::text(format!("{label} {target} x-ws={ws_header} echoes {t}"))),
        _ => None,
    };
    Ok(net::websocket_upgrade(&mut req, reply)
        .header("x-backend-drop", "1")
        .body(full(String::new()))
        .unwrap())
}

/// An answer as curl saw it.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Response header names lower case.
    headers: BTreeMap<String, Vec<String>>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    /// Which backend answered.
    fn label(&self) -> String {
        self.json()["label"].as_str().unwrap_or_default().to_string()
    }

    fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).map(|v| v.join(","))
    }
}

/// One request with curl (HTTP/1.1 or h2 by ALPN, as curl chooses), never
/// following redirects: `args` are extra curl arguments (`-X`, `-H`, ...).
async fn curl(f: &Fixture, host: &str, path: &str, args: &[&str]) -> Answer {
    let port = f.edge.client().addr.port();
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "-i", "--max-time", "10", "--cacert"])
        .arg(&f.edge.ca_file)
        .arg("--resolve")
        .arg(format!("{host}:{port}:127.0.0.1"))
        .args(args)
        .arg(format!("https://{host}:{port}{path}"))
        .output()
        .await
        .expect("curl runs");
    assert!(out.status.success(), "curl {path}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in lines {
        if let Some((n, v)) = l.split_once(':') {
            headers.entry(n.trim().to_ascii_lowercase()).or_default().push(v.trim().to_string());
        }
    }
    Answer { status, headers, body: body.to_string() }
}

fn svc(name: &str) -> Value {
    json!({"name": name, "port": 80})
}

/// The routes of the Tunnel; `root` is the Service of the catch-all route.
fn routes(root: &str) -> Value {
    json!([
        {"path": "/", "service": svc(root)},
        {"path": "/", "headers": [{"name": "X-Env", "value": "canary"}], "service": svc("b")},
        {"path": "/", "method": "POST", "service": svc("c")},
        {"path": "/search", "queryParams": [{"name": "id", "value": "[0-9]+", "type": "RegularExpression"}],
         "service": svc("b")},
        {"path": "/search", "headers": [{"name": "x-v", "value": "v[0-9]+", "type": "RegularExpression"}],
         "queryParams": [{"name": "id", "value": "7"}], "service": svc("c")},
        {"path": "/split", "backends": [{"name": "a", "port": 80, "weight": 80}, {"name": "b", "port": 80, "weight": 20}]},
        {"path": "/zero", "backends": [{"name": "a", "port": 80, "weight": 0}, {"name": "b", "port": 80}]},
        {"path": "/filters", "service": svc("a"), "options": {"maxBodySize": "1k"}, "filters": [
            {"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "x-set", "value": "new"}], "add": [{"name": "x-add", "value": "added"}],
                "remove": ["x-remove"]}},
            {"type": "ResponseHeaderModifier", "responseHeaderModifier": {
                "set": [{"name": "x-resp", "value": "yes"}], "remove": ["x-backend-drop"]}},
            {"type": "URLRewrite", "urlRewrite": {"hostname": "internal.example",
                "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/rewritten"}}}]},
        {"path": "/full", "pathType": "Exact", "service": svc("a"), "filters": [
            {"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplaceFullPath", "replaceFullPath": "/one"}}}]},
        {"path": "/old", "filters": [{"type": "RequestRedirect", "requestRedirect": {"scheme": "https",
            "hostname": "new.example", "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/new"},
            "statusCode": 301}}]},
        {"path": "/here", "filters": [{"type": "RequestRedirect", "requestRedirect": {
            "path": {"type": "ReplaceFullPath", "replaceFullPath": "/there"}}}]},
        {"path": "/guarded", "options": {"authSecret": "creds"}, "filters": [{"type": "RequestRedirect",
            "requestRedirect": {"hostname": "inside.example", "statusCode": 307}}]},
        {"path": "/gone", "backends": [{"name": "nope", "port": 80}]},
        {"path": "/nothing"},
        // Service a of another namespace, without a ReferenceGrant: never this namespace's a.
        {"path": "/cross", "backends": [{"name": "a", "port": 80, "namespace": "routes-elsewhere"}]},
        {"path": "/live", "service": svc("a"), "filters": [
            {"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "x-ws", "value": "set"}]}},
            {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"remove": ["x-backend-drop"]}},
            {"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/x"}}}]},
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_routes_match_split_filter_redirect_and_change_live() {
    let Some(f) = Fixture::new("routes").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    for (label, port) in [("A", 8001), ("B", 8002), ("C", 8003)] {
        echo_backend(&backends, port, label);
        let name = label.to_ascii_lowercase();
        service_with_endpoints(&f, &name, &backends.ip, json!({}), &[("http", 80, port, "TCP")]).await;
    }
    f.create::<Secret>(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
        "stringData": {"token": "tok-1\n"}}))
        .await;
    let (stop, task) = f.operator();
    let label = format!("r{}", f.suffix());
    let host = format!("{label}.edge.test");
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
        "metadata": {"name": "web"}, "spec": {"name": label}}))
        .await;
    f.create::<Tunnel>(
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "metadata": {"name": "web"},
        "spec": {"domain": "web", "routes": routes("a")}}),
    )
    .await;
    // Served (Degraded: /gone names a Service that does not exist).
    let t = f.wait_reason::<Tunnel>("web", "Degraded").await;
    let message = t["status"]["conditions"][0]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("route /gone: backend nope: Service nope not found"), "{message}");
    assert!(
        message.contains("route /cross: backend a: Service routes-elsewhere/a: a Service of another namespace needs a ReferenceGrant"),
        "{message}"
    );
    f.get_until(&host, "/x", |s, b| s == StatusCode::OK && b.contains("\"label\":\"A\"")).await;

    // Matches and precedence, asked by curl.
    assert_eq!(curl(&f, &host, "/x", &[]).await.label(), "A");
    assert_eq!(
        curl(&f, &host, "/x", &["-H", "x-env: canary"]).await.label(),
        "B",
        "header name case-insensitive"
    );
    assert_eq!(curl(&f, &host, "/x", &["-H", "x-env: Canary"]).await.label(), "A", "header values exact");
    assert_eq!(curl(&f, &host, "/x", &["-X", "POST"]).await.label(), "C");
    assert_eq!(
        curl(&f, &host, "/x", &["-X", "POST", "-H", "x-env: canary"]).await.label(),
        "C",
        "a method match before a header match"
    );
    assert_eq!(curl(&f, &host, "/search?id=42", &[]).await.label(), "B");
    assert_eq!(
        curl(&f, &host, "/search?id=42x", &[]).await.label(),
        "A",
        "regular expressions match the whole value"
    );
    assert_eq!(
        curl(&f, &host, "/search?x=1&id=7", &["-H", "x-v: v2"]).await.label(),
        "C",
        "more matches first"
    );
    assert_eq!(curl(&f, &host, "/search?id=7", &["-H", "x-v: 2"]).await.label(), "B");
    assert_eq!(curl(&f, &host, "/searching?id=7", &[]).await.label(), "A", "element-wise prefixes");

    // A weighted split over real backends: 80/20 of 400 requests within 80 % +- 10 %
    // (5 standard deviations); weight 0 never gets one.
    let mut a = 0;
    for _ in 0..400 {
        let (s, body) = f.edge.client().get(&host, "/split").await;
        assert_eq!(s, StatusCode::OK, "{body}");
        a += usize::from(body.contains("\"label\":\"A\""));
    }
    assert!((280..=360).contains(&a), "80/20 split gave {a}/400 to A");
    for _ in 0..40 {
        assert!(
            f.edge.client().get(&host, "/zero").await.1.contains("\"label\":\"B\""),
            "weight 0 got a request"
        );
    }

    // Filters, as the backend saw them and as the client gets the response.
    let r =
        curl(&f, &host, "/filters/page?k=v", &["-H", "x-set: old", "-H", "x-add: mine", "-H", "x-remove: 1"])
            .await;
    assert_eq!(r.status, 200, "{r:?}");
    let seen = r.json();
    assert_eq!(seen["target"], "/rewritten/page?k=v", "ReplacePrefixMatch, the query kept");
    assert_eq!(seen["headers"]["host"], json!(["internal.example"]), "URLRewrite hostname is the Host");
    assert_eq!(seen["headers"]["x-set"], json!(["new"]), "set replaces");
    assert_eq!(seen["headers"]["x-add"], json!(["mine", "added"]), "add appends");
    assert!(seen["headers"].get("x-remove").is_none(), "remove removes: {seen}");
    assert_eq!(r.header("x-resp").as_deref(), Some("yes"), "ResponseHeaderModifier set");
    assert_eq!(r.header("x-backend-drop"), None, "ResponseHeaderModifier remove");
    assert_eq!(r.header("x-backend-keep").as_deref(), Some("1"));
    let big = Request::post("/filters").body(Full::new(Bytes::from(vec![b'x'; 2048]))).unwrap();
    let r = f.edge.client().send(&host, big, false).await.expect("request");
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE, "the route's options still apply");
    let r = curl(&f, &host, "/full", &[]).await;
    assert_eq!(r.json()["target"], "/one", "ReplaceFullPath");
    assert_eq!(r.json()["headers"]["host"], json!([host.clone()]), "no hostname rewrite: the public Host");

    // Redirects: status and Location exact; nothing reaches a backend.
    let r = curl(&f, &host, "/old/a/b?q=1", &[]).await;
    assert_eq!(r.status, 301);
    assert_eq!(
        r.header("location").as_deref(),
        Some("https://new.example/new/a/b?q=1"),
        "scheme given: its port 443 left out"
    );
    let port = f.edge.client().addr.port();
    let r = curl(&f, &host, "/here?q=1", &[]).await;
    assert_eq!(r.status, 302, "the default status");
    assert_eq!(
        r.header("location"),
        Some(format!("https://{host}:{port}/there?q=1")),
        "no scheme, no port: the listener's port"
    );

    // The route's auth comes before its redirect.
    f.get_until(&host, "/guarded", |s, _| s == StatusCode::UNAUTHORIZED).await;
    let r = curl(&f, &host, "/guarded/x", &["-H", "authorization: Bearer tok-1"]).await;
    let port = f.edge.client().addr.port();
    let want = format!("https://inside.example:{port}/guarded/x");
    assert_eq!((r.status, r.header("location")), (307, Some(want)), "admitted, then redirected");

    // No usable backend: 500, as Gateway API says.
    assert_eq!(curl(&f, &host, "/gone", &[]).await.status, 500);
    assert_eq!(curl(&f, &host, "/nothing", &[]).await.status, 500);
    assert_eq!(
        curl(&f, &host, "/cross", &[]).await.status,
        500,
        "not granted: not this namespace's Service a"
    );

    // Upgrades get the rewrite and the header changes; the WebSocket stays
    // open while the routes change, and the new routes apply.
    let (mut ws, handshake) = f.edge.client().websocket(&host, "/live/ws").await;
    assert!(handshake.get("x-backend-drop").is_none(), "the 101 gets the response header changes");
    assert_eq!(net::ws_roundtrip(&mut ws, "one").await, "A /x/ws x-ws=set echoes one");
    let mut changed = routes("b");
    changed.as_array_mut().unwrap().push(json!({"path": "/new-route", "method": "GET", "service": svc("c")}));
    f.patch::<Tunnel>("web", json!({"spec": {"routes": changed}})).await;
    f.get_until(&host, "/x", |s, b| s == StatusCode::OK && b.contains("\"label\":\"B\"")).await;
    assert_eq!(curl(&f, &host, "/new-route", &[]).await.label(), "C");
    assert_eq!(
        curl(&f, &host, "/new-route", &["-X", "PUT"]).await.label(),
        "B",
        "PUT falls to the catch-all"
    );
    assert_eq!(
        net::ws_roundtrip(&mut ws, "two").await,
        "A /x/ws x-ws=set echoes two",
        "the WebSocket survived"
    );
    ws.close(None).await.unwrap();
    f.finish(stop, task).await;
}
