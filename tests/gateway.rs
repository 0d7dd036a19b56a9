//! Gateway API (GatewayClass, Gateway, HTTPRoute, GRPCRoute, TLSRoute,
//! TCPRoute, ReferenceGrant) against a real kube-apiserver with the upstream
//! CRDs installed (`scripts/gateway-api-crds`), a real edge and real backends
//! in a network namespace the test creates; each test has its own namespace,
//! operator (`--watch-namespace`) and GatewayClass.

mod support;
use support::{kube as kube_env, net, netns, operator as fixture};

use std::time::Duration;

use bytes::Bytes;
use culvert::crd::{Domain, TcpPort, Tunnel, TunnelProtocol, UdpPort};
use culvert::operator::gateway::types::{
    GRPCRoute, Gateway, GatewayClass, HTTPRoute, ReferenceGrant, TCPRoute, TLSRoute, UDPRoute,
};
use fixture::{
    Fixture, NamespacedObject, WAIT, get_passthrough, h2c_backend, listen_in, service_with_endpoints,
    tls_backend,
};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube_env::wait_until;
use netns::NetnsHost;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

const CONTROLLER: &str = "culvert.dev/gateway-controller";
const GW: &str = "gateway.networking.k8s.io/v1";

type TestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// A fixture with the Gateway API CRDs installed and a GatewayClass of ours.
async fn fixture(prefix: &str) -> Option<(Fixture, String)> {
    let f = Fixture::new(prefix).await?;
    kube_env::install_gateway_api_crds(&f.client).await;
    let class = format!("culvert-{}", f.suffix());
    let obj = json!({"apiVersion": GW, "kind": "GatewayClass",
        "metadata": {"name": class, "labels": {"culvert.dev/test": "true"}},
        "spec": {"controllerName": CONTROLLER}});
    Api::<GatewayClass>::all(f.client.clone())
        .patch(&class, &PatchParams::apply("culvert-tests").force(), &Patch::Apply(&obj))
        .await
        .unwrap();
    Some((f, class))
}

/// Deletes the Gateway API objects first (their Tunnels and Domains go with
/// them), then what `Fixture::finish` cleans up, and the class.
async fn finish(
    f: Fixture,
    class: &str,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
) {
    let dp = DeleteParams::default();
    let lp = Default::default();
    f.api::<HTTPRoute>().delete_collection(&dp, &lp).await.unwrap();
    f.api::<GRPCRoute>().delete_collection(&dp, &lp).await.unwrap();
    f.api::<TLSRoute>().delete_collection(&dp, &lp).await.unwrap();
    f.api::<TCPRoute>().delete_collection(&dp, &lp).await.unwrap();
    f.api::<UDPRoute>().delete_collection(&dp, &lp).await.unwrap();
    f.api::<Gateway>().delete_collection(&dp, &lp).await.unwrap();
    wait_until("the routes' Tunnels gone", WAIT, || async {
        Ok(f.api::<Tunnel>().list(&lp).await?.items.is_empty().then_some(()))
    })
    .await
    .unwrap();
    let _ = Api::<GatewayClass>::all(f.client.clone()).delete(class, &dp).await;
    f.finish(stop, task).await;
}

/// An HTTP backend named `label` in the network namespace: answers
/// `<label> <METHOD> <path and query>` with each request header `x-*`
/// copied into the response as `echo-x-*`; paths ending in `/ws` are a
/// WebSocket echo.
fn http_backend(host: &NetnsHost, port: u16, label: &'static str) {
    net::serve_http1(listen_in(host, port), move |req| handle(req, label));
}

async fn handle(
    mut req: Request<Incoming>,
    label: &'static str,
) -> Result<Response<TestBody>, std::convert::Infallible> {
    let full = |s: String| Full::new(Bytes::from(s)).map_err(|never| match never {}).boxed_unsync();
    if !req.uri().path().ends_with("/ws") {
        let pq = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let mut resp = Response::new(full(format!("{label} {} {pq}", req.method())));
        for (k, v) in req.headers() {
            if k.as_str().starts_with("x-") {
                let name = http::HeaderName::try_from(format!("echo-{k}")).unwrap();
                resp.headers_mut().append(name, v.clone());
            }
        }
        resp.headers_mut().insert("x-backend", http::HeaderValue::from_static(label));
        return Ok(resp);
    }
    let reply = move |msg| match msg {
        Message::Text(t) => Some(Message::text(format!("{label} echoes {t}"))),
        _ => None,
    };
    Ok(net::websocket_upgrade(&mut req, reply).body(full(String::new())).unwrap())
}

/// A TCP echo in the network namespace: each line comes back prefixed with `label`.
fn tcp_echo(host: &NetnsHost, port: u16, label: &'static str) {
    let listener = listen_in(host, port);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let (r, mut w) = tcp.into_split();
                let mut r = BufReader::new(r);
                let mut line = String::new();
                while r.read_line(&mut line).await.unwrap_or(0) > 0 {
                    if w.write_all(format!("{label} {line}").as_bytes()).await.is_err() {
                        return;
                    }
                    line.clear();
                }
            });
        }
    });
}

/// A request through the edge: (status, body, headers).
async fn request(
    f: &Fixture,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String, http::HeaderMap) {
    let mut builder = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let resp = f
        .edge
        .client()
        .send(host, builder.body(Full::new(Bytes::new())).unwrap(), false)
        .await
        .expect("request through the edge");
    let (parts, b) = resp.into_parts();
    let b = b.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    (parts.status, String::from_utf8_lossy(&b).into_owned(), parts.headers)
}

fn gateway(name: &str, class: &str, listeners: Value) -> Value {
    json!({"apiVersion": GW, "kind": "Gateway", "metadata": {"name": name},
        "spec": {"gatewayClassName": class, "listeners": listeners}})
}

fn http_route(name: &str, parent: Value, hostnames: &[&str], rules: Value) -> Value {
    json!({"apiVersion": GW, "kind": "HTTPRoute", "metadata": {"name": name},
        "spec": {"parentRefs": [parent], "hostnames": hostnames, "rules": rules}})
}

/// A rule: a PathPrefix match to one Service port.
fn prefix_to(path: &str, service: &str, port: u16) -> Value {
    json!({"matches": [{"path": {"type": "PathPrefix", "value": path}}],
        "backendRefs": [{"name": service, "port": port}]})
}

/// The condition `type_` of our entry for the parentRef named `parent` in a route's status.
fn route_condition(route: &Value, parent: &str, type_: &str) -> Option<Value> {
    route["status"]["parents"]
        .as_array()?
        .iter()
        .find(|p| p["controllerName"] == CONTROLLER && p["parentRef"]["name"] == parent)
        .and_then(|p| p["conditions"].as_array()?.iter().find(|c| c["type"] == type_).cloned())
}

/// Waits until the route's condition `type_` on `parent` has `status` (and
/// `reason`); returns the route.
async fn wait_route<K: NamespacedObject>(
    f: &Fixture,
    name: &str,
    parent: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> Value {
    let api = f.api::<K>();
    let r = wait_until(&format!("{name}: {type_}={status} ({reason}) on {parent}"), WAIT, || async {
        let v = serde_json::to_value(api.get(name).await?)?;
        let ok = route_condition(&v, parent, type_)
            .is_some_and(|c| c["status"] == status && c["reason"] == reason);
        Ok(ok.then_some(v))
    })
    .await;
    match r {
        Ok(v) => v,
        Err(e) => {
            panic!("{e}; last: {:#}", serde_json::to_value(api.get(name).await.unwrap()).unwrap()["status"])
        }
    }
}

/// Waits until the Gateway's status holds `check`.
async fn wait_gateway(f: &Fixture, name: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let api = f.api::<Gateway>();
    let r = wait_until(&format!("Gateway {name}: {what}"), WAIT, || async {
        let v = serde_json::to_value(api.get(name).await?)?;
        Ok(check(&v["status"]).then_some(v))
    })
    .await;
    match r {
        Ok(v) => v["status"].clone(),
        Err(e) => {
            panic!("{e}; last: {:#}", serde_json::to_value(api.get(name).await.unwrap()).unwrap()["status"])
        }
    }
}

fn condition<'a>(conditions: &'a Value, type_: &str) -> &'a Value {
    conditions.as_array().and_then(|cs| cs.iter().find(|c| c["type"] == type_)).unwrap_or(&Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn httproute_end_to_end_with_statuses_and_a_live_change() {
    let Some((f, class)) = fixture("gw-http").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    http_backend(&backends, 8002, "B");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    service_with_endpoints(&f, "b", &backends.ip, json!({}), &[("http", 80, 8002, "TCP")]).await;
    let (stop, task) = f.operator();

    // The class is accepted.
    let classes = Api::<GatewayClass>::all(f.client.clone());
    wait_until("GatewayClass accepted", WAIT, || async {
        let v = serde_json::to_value(classes.get(&class).await?)?;
        let ok = condition(&v["status"]["conditions"], "Accepted")["status"] == "True"
            && condition(&v["status"]["conditions"], "SupportedVersion")["status"] == "True";
        Ok(ok.then_some(()))
    })
    .await
    .unwrap();

    // The listener's certificate must resolve (a Secret with a PEM pair),
    // though the edge serves its own.
    let pair = rcgen::generate_simple_self_signed(vec!["gw.edge.test".to_string()]).unwrap();
    f.create::<k8s_openapi::api::core::v1::Secret>(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "unused"}, "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": pair.cert.pem(), "tls.key": pair.signing_key.serialize_pem()},
    }))
    .await;
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([
            {"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test",
                "tls": {"mode": "Terminate", "certificateRefs": [{"name": "unused"}]}},
            {"name": "http", "protocol": "HTTP", "port": 80, "hostname": "*.edge.test"},
            {"name": "odd", "protocol": "HTTP", "port": 8080},
        ]),
    ))
    .await;
    let host = format!("g{}.edge.test", f.suffix());
    f.create::<HTTPRoute>(http_route("shop", json!({"name": "edge"}), &[&host], json!([
        prefix_to("/a", "a", 80),
        prefix_to("/b", "b", 80),
        {"matches": [{"path": {"type": "Exact", "value": "/exact"}}], "backendRefs": [{"name": "b", "port": 80}]},
    ])))
    .await;
    let route = wait_route::<HTTPRoute>(&f, "shop", "edge", "Accepted", "True", "Accepted").await;
    let resolved = route_condition(&route, "edge", "ResolvedRefs").unwrap();
    assert_eq!(resolved["status"], "True", "{resolved}");
    let accepted = route_condition(&route, "edge", "Accepted").unwrap();
    assert_eq!(accepted["observedGeneration"], route["metadata"]["generation"]);
    assert!(accepted["message"].as_str().unwrap().contains(&host), "{accepted}");

    // Real requests through the edge reach each backend by path.
    let ok = |want: String| move |s: StatusCode, b: &str| s == StatusCode::OK && b == want;
    f.get_until(&host, "/a/x", ok("A GET /a/x".into())).await;
    assert_eq!(f.edge.client().get(&host, "/b?q=1").await, (StatusCode::OK, "B GET /b?q=1".into()));
    assert_eq!(f.edge.client().get(&host, "/exact").await.1, "B GET /exact");
    let (status, body, headers) = request(&f, &host, "POST", "/a/p", &[("x-test", "1")]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "A POST /a/p"));
    assert_eq!(headers["echo-x-test"], "1", "request headers reach the backend");
    assert_eq!(f.edge.client().get(&host, "/exact/no").await.0, StatusCode::NOT_FOUND, "Exact is exact");
    assert_eq!(f.edge.client().get(&host, "/ab").await.0, StatusCode::NOT_FOUND, "/a is not a prefix of /ab");

    // The Gateway: the edge's address, listener conditions, attached routes, kinds.
    let st = wait_gateway(&f, "edge", "attachedRoutes counted", |s| s["listeners"][0]["attachedRoutes"] == 1)
        .await;
    assert_eq!(st["addresses"], json!([{"type": "IPAddress", "value": "127.0.0.1"}]));
    assert_eq!(condition(&st["conditions"], "Accepted")["reason"], "ListenersNotValid", "{st:#}");
    assert_eq!(condition(&st["conditions"], "Accepted")["status"], "True");
    assert_eq!(condition(&st["conditions"], "Programmed")["status"], "True");
    let l = &st["listeners"];
    assert_eq!(l[0]["name"], "https");
    assert_eq!(l[0]["supportedKinds"][0], json!({"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}));
    for (i, (t, s, r)) in [
        ("Accepted", "True", "Accepted"),
        ("Programmed", "True", "Programmed"),
        ("ResolvedRefs", "True", "ResolvedRefs"),
        ("Conflicted", "False", "NoConflicts"),
    ]
    .into_iter()
    .enumerate()
    {
        let c = condition(&l[0]["conditions"], t);
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some(s), Some(r)),
            "listener https {t} ({i}): {c}"
        );
    }
    assert!(
        condition(&l[0]["conditions"], "Accepted")["message"]
            .as_str()
            .unwrap()
            .contains("certificateRefs are not used")
    );
    assert_eq!(l[1]["attachedRoutes"], 1, "the HTTP listener carries it too");
    let odd = condition(&l[2]["conditions"], "Accepted");
    assert_eq!(
        (odd["status"].as_str(), odd["reason"].as_str()),
        (Some("False"), Some("PortUnavailable")),
        "{odd}"
    );
    assert_eq!(condition(&l[2]["conditions"], "Programmed")["status"], "False");

    // One Tunnel for the host (protocol http) on a Domain made for it, owned by the route.
    let tunnels = f.api::<Tunnel>().list(&Default::default()).await.unwrap().items;
    assert_eq!(tunnels.len(), 1, "{tunnels:?}");
    let tunnel = tunnels[0].name_any();
    assert_eq!(tunnels[0].owner_references()[0].kind, "HTTPRoute");
    assert_eq!(tunnels[0].owner_references()[0].name, "shop");
    let domain = f.api::<Domain>().get(&tunnel).await.unwrap();
    assert_eq!(domain.status.unwrap().hostname.as_deref(), Some(host.as_str()));

    // A WebSocket stays open while the route changes; the change applies.
    let (mut ws, _) = f.edge.client().websocket(&host, "/a/ws").await;
    assert_eq!(net::ws_roundtrip(&mut ws, "one").await, "A echoes one");
    f.patch::<HTTPRoute>(
        "shop",
        json!({"spec": {"rules": [
            prefix_to("/a", "a", 80),
            prefix_to("/c", "b", 80),
        ]}}),
    )
    .await;
    f.get_until(&host, "/c/d", ok("B GET /c/d".into())).await;
    assert_eq!(f.edge.client().get(&host, "/b").await.0, StatusCode::NOT_FOUND, "the removed rule");
    assert_eq!(net::ws_roundtrip(&mut ws, "two").await, "A echoes two", "the WebSocket survived the change");
    ws.close(None).await.unwrap();
    let route = wait_route::<HTTPRoute>(&f, "shop", "edge", "Accepted", "True", "Accepted").await;
    assert_eq!(route_condition(&route, "edge", "Accepted").unwrap()["observedGeneration"], 2);

    // Deleting the route removes its Tunnel and Domain and releases the name.
    f.api::<HTTPRoute>().delete("shop", &DeleteParams::default()).await.unwrap();
    wait_until("Tunnel and Domain gone", WAIT, || async {
        let left = f.api::<Tunnel>().get_opt(&tunnel).await?.is_some()
            || f.api::<Domain>().get_opt(&tunnel).await?.is_some();
        Ok((!left).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(f.edge.api("GET", &format!("domains/{host}"), None).await.0, StatusCode::NOT_FOUND);
    wait_gateway(&f, "edge", "no attached route", |s| s["listeners"][0]["attachedRoutes"] == 0).await;
    finish(f, &class, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_refusals_are_conditions_users_can_act_on() {
    let Some((f, class)) = fixture("gw-refuse").await else { return };
    service_with_endpoints(&f, "a", "10.213.255.2", json!({}), &[("http", 80, 8001, "TCP")]).await;
    let (stop, task) = f.operator();
    let p = f.edge.https.port();
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([
            {"name": "web", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test",
                "allowedRoutes": {"kinds": [{"kind": "HTTPRoute"}, {"kind": "TCPRoute"}]}},
            // HTTPS and TLS on one port (the edge's) with one hostname: a conflict.
            {"name": "dup", "protocol": "HTTPS", "port": p, "hostname": "*.edge.test"},
            {"name": "dup2", "protocol": "TLS", "port": p, "hostname": "*.edge.test", "tls": {"mode": "Passthrough"}},
            {"name": "plain", "protocol": "HTTPS", "port": 443},
        ]),
    ))
    .await;
    let st = wait_gateway(&f, "edge", "listeners reported", |s| {
        s["listeners"].as_array().is_some_and(|l| l.len() == 4)
    })
    .await;
    let l = &st["listeners"];
    let c = condition(&l[0]["conditions"], "ResolvedRefs");
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some("False"), Some("InvalidRouteKinds")),
        "{c}"
    );
    assert_eq!(l[0]["supportedKinds"], json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}]));
    assert_eq!(condition(&l[0]["conditions"], "Conflicted")["status"], "False");
    assert_eq!(condition(&l[0]["conditions"], "Programmed")["status"], "False", "kinds it cannot serve");
    for i in [1, 2] {
        let c = condition(&l[i]["conditions"], "Conflicted");
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("True"), Some("HostnameConflict")),
            "{c}"
        );
    }
    assert_eq!(condition(&l[3]["conditions"], "Programmed")["status"], "True");

    let host = format!("r{}.edge.test", f.suffix());
    let other = format!("r{}.example.org", f.suffix());
    // (route, parentRef, hostnames, backend, condition, status, reason, message part)
    let cases = [
        (
            "no-section",
            json!({"name": "edge", "sectionName": "nope"}),
            vec![host.clone()],
            "a",
            "Accepted",
            "False",
            "NoMatchingParent",
            "sectionName",
        ),
        (
            "conflicted",
            json!({"name": "edge", "sectionName": "dup"}),
            vec![host.clone()],
            "a",
            "Accepted",
            "False",
            "NoMatchingParent",
            "not served",
        ),
        (
            "wrong-port",
            json!({"name": "edge", "port": 8443}),
            vec![host.clone()],
            "a",
            "Accepted",
            "False",
            "NoMatchingParent",
            "port 8443",
        ),
        (
            // A listener without hostname: on the edge's default host, by host.
            "no-host",
            json!({"name": "edge", "sectionName": "plain"}),
            vec![other.clone()],
            "a",
            "Accepted",
            "True",
            "Accepted",
            "default host for",
        ),
        (
            "missing",
            json!({"name": "edge", "sectionName": "plain"}),
            vec![host.clone()],
            "gone",
            "ResolvedRefs",
            "False",
            "BackendNotFound",
            "gone not found",
        ),
    ];
    for (name, parent, hosts, backend, ..) in &cases {
        let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
        f.create::<HTTPRoute>(http_route(name, parent.clone(), &hosts, json!([prefix_to("/", backend, 80)])))
            .await;
    }
    for (name, _, _, _, type_, status, reason, part) in &cases {
        let v = wait_route::<HTTPRoute>(&f, name, "edge", type_, status, reason).await;
        let c = route_condition(&v, "edge", type_).unwrap();
        assert!(c["message"].as_str().unwrap().contains(part), "{name}: {c}");
    }
    // A listener without a hostname delegates nothing: the route names a
    // host of the edge, its namespace has no Domain for it: the default host.
    let st = wait_route::<HTTPRoute>(&f, "missing", "edge", "Accepted", "True", "Accepted").await;
    let msg = route_condition(&st, "edge", "Accepted").unwrap()["message"].clone();
    assert!(msg.as_str().unwrap().contains(&format!("default host for {host}")), "{msg}");
    // With a Domain of its namespace the same route is published on it.
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
        "metadata": {"name": "mine"}, "spec": {"name": format!("r{}", f.suffix())}}))
        .await;
    let v = wait_route::<HTTPRoute>(&f, "missing", "edge", "Accepted", "True", "Accepted").await;
    assert_eq!(route_condition(&v, "edge", "ResolvedRefs").unwrap()["reason"], "BackendNotFound");
    let t = wait_until("a Tunnel on the namespace's Domain", WAIT, || async {
        Ok(f.api::<Tunnel>()
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .find(|t| t.spec.domain.as_deref() == Some("mine")))
    })
    .await
    .unwrap();
    assert_eq!(t.spec.protocol, TunnelProtocol::Http);
    let made: Vec<Domain> = f.api::<Domain>().list(&Default::default()).await.unwrap().items;
    assert!(
        made.iter().all(|d| d.name_any() == "mine" || d.spec.fqdn.as_deref() == Some("*")),
        "no Domain made for the host: the namespace's is used"
    );
    finish(f, &class, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tlsroute_passes_tls_through_by_sni_and_tcproute_carries_tcp() {
    let Some((f, class)) = fixture("gw-l4").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    let host = format!("t{}.edge.test", f.suffix());
    let ca = tls_backend(&backends, 8443, std::slice::from_ref(&host));
    tcp_echo(&backends, 9000, "echo");
    service_with_endpoints(&f, "secure", &backends.ip, json!({}), &[("https", 443, 8443, "TCP")]).await;
    service_with_endpoints(&f, "echo", &backends.ip, json!({}), &[("tcp", 9000, 9000, "TCP")]).await;
    let (stop, task) = f.operator();
    let port = f.edge.tcp_ports.first;
    f.create::<Gateway>(gateway("edge", &class, json!([
        {"name": "tls", "protocol": "TLS", "port": 443, "hostname": "*.edge.test", "tls": {"mode": "Passthrough"}},
        {"name": "tcp", "protocol": "TCP", "port": port},
        {"name": "far", "protocol": "TCP", "port": 1},
    ])))
    .await;
    f.create::<TLSRoute>(json!({"apiVersion": GW, "kind": "TLSRoute", "metadata": {"name": "secure"},
        "spec": {"parentRefs": [{"name": "edge", "sectionName": "tls"}], "hostnames": [host],
            "rules": [{"backendRefs": [{"name": "secure", "port": 443}]}]}}))
        .await;
    f.create::<TCPRoute>(json!({"apiVersion": GW, "kind": "TCPRoute", "metadata": {"name": "echo"},
        "spec": {"parentRefs": [{"name": "edge", "sectionName": "tcp"}],
            "rules": [{"backendRefs": [{"name": "echo", "port": 9000}]}]}}))
        .await;
    f.create::<TCPRoute>(json!({"apiVersion": GW, "kind": "TCPRoute", "metadata": {"name": "second"},
        "spec": {"parentRefs": [{"name": "edge", "sectionName": "tcp"}],
            "rules": [{"backendRefs": [{"name": "echo", "port": 9000}]}]}}))
        .await;
    wait_route::<TLSRoute>(&f, "secure", "edge", "Accepted", "True", "Accepted").await;
    let v = wait_route::<TCPRoute>(&f, "echo", "edge", "Accepted", "True", "Accepted").await;
    assert!(
        route_condition(&v, "edge", "Accepted").unwrap()["message"]
            .as_str()
            .unwrap()
            .contains(&port.to_string())
    );
    let v = wait_route::<TCPRoute>(&f, "second", "edge", "Accepted", "False", "NotAllowedByListeners").await;
    assert!(
        route_condition(&v, "edge", "Accepted").unwrap()["message"]
            .as_str()
            .unwrap()
            .contains("already carries TCPRoute")
    );

    // TLS passthrough: the backend's certificate, the client's SNI.
    let body = wait_until("TLS passthrough to the backend", WAIT, || async {
        Ok(get_passthrough(&f, &host, &ca).await.ok())
    })
    .await
    .unwrap();
    assert_eq!(body, format!("tls / sni={host}"));

    // TCP: the listener's port at the edge, to the echo.
    let answer = wait_until("TCP echo through the edge", WAIT, || async {
        let Ok(tcp) = TcpStream::connect(("127.0.0.1", port)).await else { return Ok(None) };
        let (r, mut w) = tcp.into_split();
        let mut r = BufReader::new(r);
        w.write_all(b"hello\n").await?;
        let mut line = String::new();
        let n =
            tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut line)).await.unwrap_or(Ok(0))?;
        Ok((n > 0).then_some(line))
    })
    .await
    .unwrap();
    assert_eq!(answer, "echo hello\n");
    let ports = f.api::<TcpPort>().list(&Default::default()).await.unwrap().items;
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].spec.port, Some(port));
    let st = wait_gateway(&f, "edge", "routes attached", |s| {
        s["listeners"][0]["attachedRoutes"] == 1 && s["listeners"][1]["attachedRoutes"] == 1
    })
    .await;
    let far = condition(&st["listeners"][2]["conditions"], "Accepted");
    assert_eq!(far["reason"], "PortUnavailable", "{far}");
    assert_eq!(
        st["listeners"][1]["supportedKinds"],
        json!([{"group": "gateway.networking.k8s.io", "kind": "TCPRoute"}])
    );
    finish(f, &class, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcroute_method_matches_reach_an_h2c_backend() {
    let Some((f, class)) = fixture("gw-grpc").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    h2c_backend(&backends, 50051);
    service_with_endpoints(&f, "greeter", &backends.ip, json!({}), &[("grpc", 50051, 50051, "TCP")]).await;
    let (stop, task) = f.operator();
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([{"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test"}]),
    ))
    .await;
    let host = format!("grpc{}.edge.test", f.suffix());
    f.create::<GRPCRoute>(json!({"apiVersion": GW, "kind": "GRPCRoute", "metadata": {"name": "greeter"},
        "spec": {"parentRefs": [{"name": "edge"}], "hostnames": [host], "rules": [
            {"matches": [{"method": {"service": "helloworld.Greeter", "method": "SayHello"}}],
             "backendRefs": [{"name": "greeter", "port": 50051}]}]}}))
        .await;
    wait_route::<GRPCRoute>(&f, "greeter", "edge", "Accepted", "True", "Accepted").await;
    let call = |path: &'static str| {
        let f = &f;
        let host = host.clone();
        async move {
            let req = Request::post(path)
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = f.edge.client().send(&host, req, true).await.expect("h2 request");
            let status = resp.status();
            let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let answer = wait_until("the gRPC method through the edge", WAIT, || async {
        let (s, b) = call("/helloworld.Greeter/SayHello").await;
        Ok((s == StatusCode::OK).then_some(b))
    })
    .await
    .unwrap();
    assert_eq!(answer, "h2c HTTP/2.0 /helloworld.Greeter/SayHello", "HTTP/2 cleartext to the backend");
    assert_eq!(call("/helloworld.Greeter/Other").await.0, StatusCode::NOT_FOUND, "another method");
    let st = wait_gateway(&f, "edge", "the GRPCRoute attached", |s| s["listeners"][0]["attachedRoutes"] == 1)
        .await;
    let kinds: Vec<&str> = st["listeners"][0]["supportedKinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["HTTPRoute", "GRPCRoute"]);
    finish(f, &class, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_of_another_namespace_needs_a_reference_grant() {
    let Some((f, class)) = fixture("gw-grant").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "FAR");
    let env = kube_env::connect().await.unwrap();
    let other = env.namespace("gw-grant-far").await.unwrap();
    // The Service and its endpoints in the other namespace.
    let svc: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "far"}, "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8001}]}}))
    .unwrap();
    other.api::<Service>().create(&Default::default(), &svc).await.unwrap();
    let slice: EndpointSlice =
        serde_json::from_value(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "far-1", "labels": {"kubernetes.io/service-name": "far"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8001, "protocol": "TCP"}],
        "endpoints": [{"addresses": [backends.ip], "conditions": {"ready": true}}]}))
        .unwrap();
    other.api::<EndpointSlice>().create(&Default::default(), &slice).await.unwrap();
    let (stop, task) = f.operator();
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([{"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test"}]),
    ))
    .await;
    let host = format!("x{}.edge.test", f.suffix());
    f.create::<HTTPRoute>(http_route(
        "far",
        json!({"name": "edge"}),
        &[&host],
        json!([
        {"backendRefs": [{"name": "far", "namespace": other.name, "port": 80}]}]),
    ))
    .await;

    // Refused without a grant: the condition says what to create; nothing reaches the Service.
    let v = wait_route::<HTTPRoute>(&f, "far", "edge", "ResolvedRefs", "False", "RefNotPermitted").await;
    let msg = route_condition(&v, "edge", "ResolvedRefs").unwrap()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("ReferenceGrant") && msg.contains(&other.name), "{msg}");
    let (status, body) = f.get_until(&host, "/", |s, _| s.is_server_error()).await;
    assert!(!body.starts_with("FAR"), "{status} {body}");

    // A grant in the other namespace, from HTTPRoutes of ours to that Service: allowed.
    let grant: ReferenceGrant = serde_json::from_value(json!({"apiVersion": "gateway.networking.k8s.io/v1beta1",
        "kind": "ReferenceGrant", "metadata": {"name": "from-routes"},
        "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": f.ns.name}],
            "to": [{"group": "", "kind": "Service", "name": "far"}]}}))
    .unwrap();
    other.api::<ReferenceGrant>().create(&Default::default(), &grant).await.unwrap();
    wait_route::<HTTPRoute>(&f, "far", "edge", "ResolvedRefs", "True", "ResolvedRefs").await;
    f.get_until(&host, "/p", |s, b| s == StatusCode::OK && b == "FAR GET /p").await;

    // The grant withdrawn: refused again, and the Service is no longer reached.
    other.api::<ReferenceGrant>().delete("from-routes", &DeleteParams::default()).await.unwrap();
    wait_route::<HTTPRoute>(&f, "far", "edge", "ResolvedRefs", "False", "RefNotPermitted").await;
    f.get_until(&host, "/p", |s, _| s.is_server_error()).await;
    finish(f, &class, stop, task).await;
    other.delete_and_wait().await.unwrap();
}

/// A UDP echo on `ip:port` inside the network namespace: each datagram comes
/// back prefixed with `label `.
fn udp_echo(host: &NetnsHost, port: u16, label: &'static str) {
    use std::os::fd::AsRawFd;
    let (path, ip) = (format!("/run/netns/{}", host.name), host.ip.clone());
    let socket = std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap();
        // SAFETY: setns on a valid descriptor of a network namespace, on this thread only.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        let s = std::net::UdpSocket::bind((ip.as_str(), port)).unwrap();
        s.set_nonblocking(true).unwrap();
        s
    })
    .join()
    .unwrap();
    let socket = tokio::net::UdpSocket::from_std(socket).unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else { return };
            let mut answer = format!("{label} ").into_bytes();
            answer.extend_from_slice(&buf[..n]);
            let _ = socket.send_to(&answer, from).await;
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udproute_carries_datagrams_to_a_udp_echo() {
    let Some((f, class)) = fixture("gw-udp").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    udp_echo(&backends, 5353, "echo");
    service_with_endpoints(&f, "dns", &backends.ip, json!({}), &[("dns", 53, 5353, "UDP")]).await;
    let (stop, task) = f.operator();
    let port = f.edge.tcp_ports.first + 1;
    f.create::<Gateway>(gateway("edge", &class, json!([{"name": "dns", "protocol": "UDP", "port": port}])))
        .await;
    f.create::<UDPRoute>(json!({"apiVersion": GW, "kind": "UDPRoute", "metadata": {"name": "dns"},
        "spec": {"parentRefs": [{"name": "edge", "sectionName": "dns"}],
            "rules": [{"backendRefs": [{"name": "dns", "port": 53}]}]}}))
        .await;
    wait_route::<UDPRoute>(&f, "dns", "edge", "Accepted", "True", "Accepted").await;
    let client = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let answer = wait_until("a UDP echo through the edge", WAIT, || async {
        client.send_to(b"ping", ("127.0.0.1", port)).await?;
        let mut buf = [0u8; 64];
        match tokio::time::timeout(Duration::from_millis(500), client.recv(&mut buf)).await {
            Ok(Ok(n)) => Ok(Some(String::from_utf8_lossy(&buf[..n]).into_owned())),
            _ => Ok(None),
        }
    })
    .await
    .unwrap();
    assert_eq!(answer, "echo ping");
    let ports = f.api::<UdpPort>().list(&Default::default()).await.unwrap().items;
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].spec.port, Some(port));
    f.api::<UDPRoute>().delete("dns", &DeleteParams::default()).await.unwrap();
    wait_until("the UdpPort released", WAIT, || async {
        Ok(f.api::<UdpPort>().list(&Default::default()).await?.items.is_empty().then_some(()))
    })
    .await
    .unwrap();
    finish(f, &class, stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn httproute_weights_matches_and_filters_through_the_whole_path() {
    let Some((f, class)) = fixture("gw-filters").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    http_backend(&backends, 8002, "B");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    service_with_endpoints(&f, "b", &backends.ip, json!({}), &[("http", 80, 8002, "TCP")]).await;
    let (stop, task) = f.operator();
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([{"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test"}]),
    ))
    .await;
    let host = format!("w{}.edge.test", f.suffix());
    f.create::<HTTPRoute>(http_route("split", json!({"name": "edge"}), &[&host], json!([
        {"matches": [{"path": {"type": "PathPrefix", "value": "/split"}}],
         "backendRefs": [{"name": "a", "port": 80, "weight": 80}, {"name": "b", "port": 80, "weight": 20}]},
        {"matches": [{"path": {"type": "PathPrefix", "value": "/m"}, "headers": [{"name": "x-env", "value": "canary"}]},
                     {"path": {"type": "PathPrefix", "value": "/m"}, "method": "DELETE"}],
         "backendRefs": [{"name": "b", "port": 80}]},
        {"matches": [{"path": {"type": "PathPrefix", "value": "/m"}, "queryParams": [{"name": "v", "type": "RegularExpression", "value": "^[0-9]+$"}]}],
         "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "x-set", "value": "one"}], "add": [{"name": "x-add", "value": "two"}], "remove": ["x-drop"]}},
             {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"set": [{"name": "x-resp", "value": "yes"}]}}],
         "backendRefs": [{"name": "a", "port": 80}]},
        prefix_to("/m", "a", 80),
        {"matches": [{"path": {"type": "PathPrefix", "value": "/old"}}],
         "filters": [{"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/new"}}}],
         "backendRefs": [{"name": "b", "port": 80}]},
        {"matches": [{"path": {"type": "Exact", "value": "/moved"}}],
         "filters": [{"type": "RequestRedirect", "requestRedirect": {"scheme": "https", "hostname": "elsewhere.example.org", "statusCode": 301,
            "path": {"type": "ReplaceFullPath", "replaceFullPath": "/here"}}}]},
    ])))
    .await;
    wait_route::<HTTPRoute>(&f, "split", "edge", "Accepted", "True", "Accepted").await;
    f.get_until(&host, "/m", |s, b| s == StatusCode::OK && b == "A GET /m").await;

    // Matches: a header, a method, a query parameter by regular expression.
    assert_eq!(request(&f, &host, "GET", "/m", &[("x-env", "canary")]).await.1, "B GET /m");
    assert_eq!(request(&f, &host, "DELETE", "/m/x", &[]).await.1, "B DELETE /m/x");
    // Filters: request headers set, added and removed; a response header set.
    let (status, body, headers) =
        request(&f, &host, "GET", "/m?v=12", &[("x-set", "zero"), ("x-drop", "1")]).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "A GET /m?v=12"));
    assert_eq!(headers["echo-x-set"], "one", "set replaces");
    assert_eq!(headers["echo-x-add"], "two");
    assert!(!headers.contains_key("echo-x-drop"), "removed before the backend");
    assert_eq!(headers["x-resp"], "yes");
    assert_eq!(
        request(&f, &host, "GET", "/m?v=x1", &[]).await.1,
        "A GET /m?v=x1",
        "no match: the plain rule"
    );
    // URLRewrite: the prefix is replaced, the rest kept.
    assert_eq!(request(&f, &host, "GET", "/old/page?q=1", &[]).await.1, "B GET /new/page?q=1");
    // RequestRedirect: answered without a backend; with a scheme and no
    // port, the scheme's well-known port (none in the Location).
    let (status, _, headers) = request(&f, &host, "GET", "/moved", &[]).await;
    assert_eq!(status, StatusCode::MOVED_PERMANENTLY);
    assert_eq!(headers["location"], "https://elsewhere.example.org/here");

    // Weights 80/20 over 200 requests: A's share within 80% ± 10% (the
    // binomial standard deviation is 2.8%, so this fails by chance < 1e-3).
    let mut a = 0;
    for i in 0..200 {
        let (status, body) = f.edge.client().get(&host, &format!("/split/{i}")).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        if body.starts_with("A ") {
            a += 1;
        } else {
            assert!(body.starts_with("B "), "{body}");
        }
    }
    assert!((140..=180).contains(&a), "A got {a} of 200 requests, want 160 ± 20");
    finish(f, &class, stop, task).await;
}

/// Gateway API: a request to a rule whose backendRef cannot be used answers
/// 500 (HTTPRouteInvalidNonExistentBackendRef, ...UnknownKind,
/// ...CrossNamespaceBackendRef), and in a weighted split the refused
/// backendRef keeps its share of 500s; a Service without ready endpoints
/// answers 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_backend_refs_answer_500_and_keep_their_share_of_a_split() {
    let Some((f, class)) = fixture("gw-invalid").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    // A Service without endpoints.
    f.create::<Service>(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "idle"},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8001}]}}))
        .await;
    let (stop, task) = f.operator();
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([{"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test"}]),
    ))
    .await;
    let host = format!("i{}.edge.test", f.suffix());
    let other = format!("{}-elsewhere", f.ns.name);
    let one = |path: &str, backend: Value| json!([{"matches": [{"path": {"type": "PathPrefix", "value": path}}], "backendRefs": [backend]}]);
    let cases = [
        ("missing", "/missing", json!({"name": "gone", "port": 80}), "BackendNotFound"),
        ("kind", "/kind", json!({"group": "example.org", "kind": "Bucket", "name": "a"}), "InvalidKind"),
        ("cross", "/cross", json!({"name": "a", "namespace": other, "port": 80}), "RefNotPermitted"),
    ];
    for (name, path, backend, _) in &cases {
        f.create::<HTTPRoute>(http_route(
            name,
            json!({"name": "edge"}),
            &[&host],
            one(path, backend.clone()),
        ))
        .await;
    }
    f.create::<HTTPRoute>(http_route(
        "idle",
        json!({"name": "edge"}),
        &[&host],
        json!([prefix_to("/idle", "idle", 80)]),
    ))
    .await;
    // A split: A 50, an unknown kind 25, a Service of another namespace without a grant 25.
    f.create::<HTTPRoute>(http_route(
        "split",
        json!({"name": "edge"}),
        &[&host],
        json!([
        {"matches": [{"path": {"type": "PathPrefix", "value": "/split"}}],
         "backendRefs": [{"name": "a", "port": 80, "weight": 50},
            {"group": "example.org", "kind": "Bucket", "name": "b", "weight": 25},
            {"name": "a", "namespace": other, "port": 80, "weight": 25}]}]),
    ))
    .await;
    for (name, _, _, reason) in &cases {
        let v = wait_route::<HTTPRoute>(&f, name, "edge", "ResolvedRefs", "False", reason).await;
        assert_eq!(
            route_condition(&v, "edge", "Accepted").unwrap()["status"],
            "True",
            "{name}: still served"
        );
    }
    let v = wait_route::<HTTPRoute>(&f, "split", "edge", "ResolvedRefs", "False", "InvalidKind").await;
    let msg = route_condition(&v, "edge", "ResolvedRefs").unwrap()["message"].as_str().unwrap().to_string();
    assert!(msg.contains("only Services") && msg.contains("needs a ReferenceGrant"), "both named: {msg}");

    f.get_until(&host, "/split/x", |s, b| s == StatusCode::OK && b.starts_with("A ")).await;
    for (_, path, _, _) in &cases {
        let (status, body) = f.edge.client().get(&host, path).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{path}: {body}");
    }
    let (status, body) = f.edge.client().get(&host, "/idle").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "no ready endpoints: {body}");

    // The refused half of the split answers 500: over 200 requests, 100 ± 25
    // (the binomial standard deviation is 7.1, so this fails by chance < 1e-3).
    let mut errors = 0;
    for i in 0..200 {
        let (status, body) = f.edge.client().get(&host, &format!("/split/{i}")).await;
        match status {
            StatusCode::OK => assert!(body.starts_with("A "), "{body}"),
            StatusCode::INTERNAL_SERVER_ERROR => errors += 1,
            s => panic!("{s}: {body}"),
        }
    }
    assert!((75..=125).contains(&errors), "{errors} of 200 requests answered 500, want 100 ± 25");

    // The missing Service created: its rule is served.
    service_with_endpoints(&f, "gone", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    wait_route::<HTTPRoute>(&f, "missing", "edge", "ResolvedRefs", "True", "ResolvedRefs").await;
    f.get_until(&host, "/missing", |s, b| s == StatusCode::OK && b == "A GET /missing").await;
    finish(f, &class, stop, task).await;
}

/// A granted Service of another namespace (outside the operator's
/// --watch-namespace): its new endpoints, its port change and its deletion
/// apply at once, with the operator's resync at an hour (a connected
/// Tunnel is otherwise looked at again after a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_of_a_granted_service_of_another_namespace_apply_at_once() {
    let Some((f, class)) = fixture("gw-far").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "ONE");
    http_backend(&backends, 8002, "TWO");
    let env = kube_env::connect().await.unwrap();
    let other = env.namespace("gw-far-svc").await.unwrap();
    let service = |port: u16| -> Service {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "far"},
            "spec": {"ports": [{"name": "http", "port": port, "targetPort": 8001}]}}))
        .unwrap()
    };
    other.api::<Service>().create(&Default::default(), &service(80)).await.unwrap();
    let slice: EndpointSlice =
        serde_json::from_value(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "far-1", "labels": {"kubernetes.io/service-name": "far"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8001, "protocol": "TCP"}],
        "endpoints": [{"addresses": [backends.ip], "conditions": {"ready": true}}]}))
        .unwrap();
    other.api::<EndpointSlice>().create(&Default::default(), &slice).await.unwrap();
    let grant: ReferenceGrant = serde_json::from_value(json!({"apiVersion": "gateway.networking.k8s.io/v1beta1",
        "kind": "ReferenceGrant", "metadata": {"name": "from-routes"},
        "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": f.ns.name}],
            "to": [{"group": "", "kind": "Service", "name": "far"}]}}))
    .unwrap();
    other.api::<ReferenceGrant>().create(&Default::default(), &grant).await.unwrap();
    let mut args = f.args("solo");
    args.resync_seconds = 3600;
    let (stop, task) = f.operator_with(args);
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([{"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test"}]),
    ))
    .await;
    let host = format!("f{}.edge.test", f.suffix());
    f.create::<HTTPRoute>(http_route(
        "far",
        json!({"name": "edge"}),
        &[&host],
        json!([{"backendRefs": [{"name": "far", "namespace": other.name, "port": 80}]}]),
    ))
    .await;
    wait_route::<HTTPRoute>(&f, "far", "edge", "ResolvedRefs", "True", "ResolvedRefs").await;
    f.get_until(&host, "/p", |s, b| s == StatusCode::OK && b == "ONE GET /p").await;

    let limit = Duration::from_secs(15);
    let merge = |v: Value| Patch::Merge(v);
    let pp = PatchParams::default();
    // New endpoints.
    let port = json!({"ports": [{"name": "http", "port": 8002, "protocol": "TCP"}]});
    other.api::<EndpointSlice>().patch("far-1", &pp, &merge(port)).await.unwrap();
    f.get_within(&host, "/p", limit, |s, b| s == StatusCode::OK && b == "TWO GET /p").await;
    // The Service's port changes: the route's port 80 is gone (its share answers 500), then back.
    let ports = |p: u16| json!({"spec": {"ports": [{"name": "http", "port": p, "targetPort": 8001}]}});
    other.api::<Service>().patch("far", &pp, &merge(ports(81))).await.unwrap();
    f.get_within(&host, "/p", limit, |s, _| s == StatusCode::INTERNAL_SERVER_ERROR).await;
    other.api::<Service>().patch("far", &pp, &merge(ports(80))).await.unwrap();
    f.get_within(&host, "/p", limit, |s, b| s == StatusCode::OK && b == "TWO GET /p").await;
    // The Service deleted.
    other.api::<Service>().delete("far", &DeleteParams::default()).await.unwrap();
    f.get_within(&host, "/p", limit, |s, _| s == StatusCode::INTERNAL_SERVER_ERROR).await;
    finish(f, &class, stop, task).await;
    other.delete_and_wait().await.unwrap();
}

/// `curl` to the edge's address with `Host: host` (none: the address's own);
/// (status, body).
async fn curl_host(f: &Fixture, host: Option<&str>, path: &str) -> (String, String) {
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args(["-sS", "-w", "\n%{http_code}", "--cacert"]).arg(&f.edge.ca_file);
    if let Some(h) = host {
        cmd.arg("-H").arg(format!("Host: {h}"));
    }
    let out = cmd.arg(format!("https://127.0.0.1:{}{path}", f.edge.https.port())).output().await.unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, status) = out.rsplit_once('\n').unwrap_or((&out, ""));
    (status.to_string(), body.to_string())
}

/// A listener without hostname and an HTTPRoute without hostnames: served on
/// the edge's default host, so any Host reaches it (the edge's address, a
/// name nobody reserved); a route with `hostnames` on it is matched by host.
/// A key the edge's admin did not allow the default host: the Domain and the
/// Tunnel say what to ask for, and it works once allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_without_hostname_is_served_on_the_default_host() {
    let Some((f, class)) = fixture("gw-any").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "ANY");
    http_backend(&backends, 8002, "NAMED");
    service_with_endpoints(&f, "any", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    service_with_endpoints(&f, "named", &backends.ip, json!({}), &[("http", 80, 8002, "TCP")]).await;
    // The operator's key may not hold the default host yet.
    let (_, keys) = f.edge.api("GET", "api-keys", None).await;
    let key = keys["items"].as_array().unwrap().iter().find(|k| k["name"] == "operator").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let allow = |domains: Value| {
        let (f, key) = (&f, key.clone());
        async move {
            let (s, v) = f
                .edge
                .api("PATCH", &format!("api-keys/{key}"), Some(json!({"customDomains": domains})))
                .await;
            assert!(s.is_success(), "{v}");
        }
    };
    allow(json!(["example.org"])).await;
    let (stop, task) = f.operator();
    f.create::<Gateway>(gateway(
        "edge",
        &class,
        json!([{"name": "https", "protocol": "HTTPS", "port": 443}, {"name": "http", "protocol": "HTTP", "port": 80}]),
    ))
    .await;
    f.create::<HTTPRoute>(http_route(
        "any",
        json!({"name": "edge"}),
        &[],
        json!([prefix_to("/", "any", 80)]),
    ))
    .await;
    let route = wait_route::<HTTPRoute>(&f, "any", "edge", "Accepted", "True", "Accepted").await;
    let msg = route_condition(&route, "edge", "Accepted").unwrap()["message"].clone();
    assert!(msg.as_str().unwrap().contains("default host"), "{msg}");

    // Refused at the edge: the Tunnel's Ready says what to ask the edge's admin.
    let tunnel = wait_until("the default host's Tunnel", WAIT, || async {
        let list = f.api::<Tunnel>().list(&Default::default()).await?.items;
        Ok(list.into_iter().find(|t| t.spec.domain.is_some()))
    })
    .await
    .unwrap();
    let name = tunnel.name_any();
    let domain = f.api::<Domain>().get(&name).await.unwrap();
    assert_eq!(domain.spec.fqdn.as_deref(), Some("*"));
    assert_eq!(domain.owner_references()[0].kind, "Gateway");
    let why = wait_until("the Tunnel says why", WAIT, || async {
        let t = serde_json::to_value(f.api::<Tunnel>().get(&name).await?)?;
        let c = condition(&t["status"]["conditions"], "Ready").clone();
        Ok((c["status"] == "False" && c["message"].as_str().unwrap_or("").contains("api-key update"))
            .then_some(c))
    })
    .await
    .unwrap();
    let message = why["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("culvert admin api-key update {key} --custom-domain '*'")),
        "{message}"
    );
    assert_eq!(curl_host(&f, None, "/").await.0, "502", "nothing is on the default host yet");

    // Allowed: any host reaches the route, the edge's address too.
    allow(json!(["*"])).await;
    let ok = |want: &'static str| {
        let f = &f;
        async move {
            wait_until(&format!("{want} through the default host"), WAIT, || async {
                let (s, b) = curl_host(f, Some("anything.example.net"), "/x").await;
                Ok((s == "200" && b == want).then_some(()))
            })
            .await
            .unwrap()
        }
    };
    ok("ANY GET /x").await;
    assert_eq!(curl_host(&f, None, "/y").await, ("200".to_string(), "ANY GET /y".to_string()));
    assert_eq!(curl_host(&f, Some("203.0.113.9:443"), "/z").await.1, "ANY GET /z");

    // A route naming a host no Domain covers: matched by host on the default host.
    f.create::<HTTPRoute>(http_route(
        "named",
        json!({"name": "edge"}),
        &["a.example.com"],
        json!([prefix_to("/", "named", 80)]),
    ))
    .await;
    let route = wait_route::<HTTPRoute>(&f, "named", "edge", "Accepted", "True", "Accepted").await;
    let msg = route_condition(&route, "edge", "Accepted").unwrap()["message"].clone();
    assert!(msg.as_str().unwrap().contains("a.example.com"), "{msg}");
    wait_until("the named route by host", WAIT, || async {
        let (s, b) = curl_host(&f, Some("A.Example.com:443"), "/n").await;
        Ok((s == "200" && b == "NAMED GET /n").then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        curl_host(&f, Some("b.example.com"), "/n").await.1,
        "ANY GET /n",
        "another host: the other route"
    );
    let tunnels = f.api::<Tunnel>().list(&Default::default()).await.unwrap().items;
    assert_eq!(tunnels.len(), 1, "one Tunnel for the default host: {tunnels:?}");

    // The Gateway's listeners are programmed and count their routes.
    let st =
        wait_gateway(&f, "edge", "both routes attached", |s| s["listeners"][0]["attachedRoutes"] == 2).await;
    assert_eq!(condition(&st["listeners"][0]["conditions"], "Programmed")["status"], "True", "{st:#}");
    finish(f, &class, stop, task).await;
}
