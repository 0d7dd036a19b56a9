//! Ingresses and LoadBalancer Services against a real kube-apiserver (the
//! kube-env harness) and a real edge, each test in its own namespace with its
//! own operator (`--watch-namespace`). Backends are real servers listening
//! inside a network namespace the test creates (Service endpoints may not be
//! loopback addresses).

mod support;
use support::{kube as kube_env, net, netns, operator as fixture};

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use culvert::crd::{Domain, TcpPort, Tunnel, UdpPort};
use culvert::operator::DomainPolicy;
use fixture::{Fixture, WAIT, get_passthrough, h2c_backend, listen_in, service_with_endpoints, tls_backend};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::networking::v1::Ingress;
use kube::ResourceExt;
use kube::api::DeleteParams;
use kube_env::wait_until;
use netns::NetnsHost;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

const CONTROLLER: &str = "culvert.dev/ingress-controller";

type TestBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// An HTTP backend named `label` in the network namespace: answers
/// `<label> <path>`, and paths ending in `/ws` are a WebSocket echo.
fn http_backend(host: &NetnsHost, port: u16, label: &'static str) {
    net::serve_http1(listen_in(host, port), move |req| handle(req, label));
}

async fn handle(
    mut req: Request<Incoming>,
    label: &'static str,
) -> Result<Response<TestBody>, std::convert::Infallible> {
    let full = |s: String| Full::new(Bytes::from(s)).map_err(|never| match never {}).boxed_unsync();
    if !req.uri().path().ends_with("/ws") {
        return Ok(Response::new(full(format!("{label} {}", req.uri().path()))));
    }
    let reply = move |msg| match msg {
        Message::Text(t) => Some(Message::text(format!("{label} echoes {t}"))),
        _ => None,
    };
    Ok(net::websocket_upgrade(&mut req, reply).body(full(String::new())).unwrap())
}

/// What a PROXY protocol header said.
#[derive(Debug, Clone, PartialEq)]
enum Proxied {
    None,
    Tcp { version: u8, src: SocketAddr, dst: SocketAddr },
    Other(String),
}

/// Reads a PROXY protocol v1 or v2 header if the stream starts with one
/// (a parser written from the spec, independent of the agent's encoder).
async fn read_proxy_header(r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> std::io::Result<Proxied> {
    const V2: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
    let buf = r.fill_buf().await?;
    if buf.starts_with(b"PROXY ") {
        let mut line = String::new();
        r.read_line(&mut line).await?;
        let line = line.strip_suffix("\r\n").expect("v1 line ends with CRLF");
        let f: Vec<&str> = line.split(' ').collect();
        return Ok(match f.as_slice() {
            ["PROXY", "TCP4" | "TCP6", src, dst, sport, dport] => Proxied::Tcp {
                version: 1,
                src: SocketAddr::new(src.parse().unwrap(), sport.parse().unwrap()),
                dst: SocketAddr::new(dst.parse().unwrap(), dport.parse().unwrap()),
            },
            _ => Proxied::Other(line.to_string()),
        });
    }
    if buf.len() >= 12 && &buf[..12] == V2 {
        let mut head = [0u8; 16];
        r.read_exact(&mut head).await?;
        let len = u16::from_be_bytes([head[14], head[15]]) as usize;
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).await?;
        assert_eq!(head[12] >> 4, 2, "version 2");
        return Ok(match (head[12] & 0x0f, head[13]) {
            (1, 0x11) => {
                let ip = |b: &[u8]| std::net::IpAddr::from([b[0], b[1], b[2], b[3]]);
                let port = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
                Proxied::Tcp {
                    version: 2,
                    src: SocketAddr::new(ip(&body[0..4]), port(&body[8..10])),
                    dst: SocketAddr::new(ip(&body[4..8]), port(&body[10..12])),
                }
            }
            (cmd, fam) => Proxied::Other(format!("v2 command {cmd} family {fam:#x}")),
        });
    }
    Ok(Proxied::None)
}

/// A TCP backend in the network namespace: parses a PROXY header if one
/// comes, then answers each line: `whoami` with what the header said,
/// anything else echoed.
fn tcp_backend(host: &NetnsHost, port: u16) {
    let listener = listen_in(host, port);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let (r, mut w) = tcp.into_split();
                let mut r = BufReader::new(r);
                let proxied = match read_proxy_header(&mut r).await {
                    Ok(p) => p,
                    Err(_) => return,
                };
                let mut line = String::new();
                while r.read_line(&mut line).await.unwrap_or(0) > 0 {
                    let answer = match line.trim_end() {
                        "whoami" => match &proxied {
                            Proxied::None => "proxy none\n".to_string(),
                            Proxied::Tcp { version, src, dst } => format!("proxy v{version} {src} {dst}\n"),
                            Proxied::Other(s) => format!("proxy other {s}\n"),
                        },
                        _ => line.clone(),
                    };
                    if w.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    line.clear();
                }
            });
        }
    });
}

fn ingress(name: &str, class: Option<&str>, host: &str, paths: &[(&str, &str, &str)]) -> Value {
    let paths: Vec<Value> = paths
        .iter()
        .map(|(p, t, svc)| json!({"path": p, "pathType": t, "backend": {"service": {"name": svc, "port": {"number": 80}}}}))
        .collect();
    let mut v = json!({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": name},
        "spec": {"rules": [{"host": host, "http": {"paths": paths}}]}});
    if let Some(c) = class {
        v["spec"]["ingressClassName"] = json!(c);
    }
    v
}

async fn key_id(f: &Fixture, tunnel: &str) -> String {
    let s = f.api::<Secret>().get(&format!("{tunnel}-culvert-key")).await.unwrap();
    String::from_utf8(s.data.unwrap()["keyId"].0.clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_routes_paths_and_changes_them_live() {
    let Some(f) = Fixture::new("ing-paths").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    http_backend(&backends, 8002, "B");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    service_with_endpoints(&f, "b", &backends.ip, json!({}), &[("http", 80, 8002, "TCP")]).await;
    f.create::<Service>(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ext"},
        "spec": {"type": "ExternalName", "externalName": "example.com"}}))
        .await;
    let class = format!("culvert-{}", f.suffix());
    f.ingress_class(&class, CONTROLLER, false).await;
    let (stop, task) = f.operator();

    let host = format!("p{}.edge.test", f.suffix());
    let mut shop = ingress("shop", Some(&class), &host, &[("/a", "Prefix", "a"), ("/b", "Prefix", "b")]);
    shop["spec"]["tls"] = json!([{"hosts": [host], "secretName": "unused"}]);
    f.create::<Ingress>(shop).await;
    f.wait_ingress_published("shop", &host).await;

    // Two paths, two real backends; element-wise prefixes; unknown paths 404.
    let ok = |want: &'static str| move |s: StatusCode, b: &str| s == StatusCode::OK && b == want;
    f.get_until(&host, "/a/x", ok("A /a/x")).await;
    assert_eq!(f.edge.client().get(&host, "/a").await, (StatusCode::OK, "A /a".into()));
    assert_eq!(f.edge.client().get(&host, "/b/").await, (StatusCode::OK, "B /b/".into()));
    assert_eq!(f.edge.client().get(&host, "/ab").await.0, StatusCode::NOT_FOUND, "/a is not a prefix of /ab");
    assert_eq!(f.edge.client().get(&host, "/").await.0, StatusCode::NOT_FOUND, "no default backend");

    // One Tunnel for the host on a Domain made for it, both owned by the Ingress.
    let tunnels = f.api::<Tunnel>().list(&Default::default()).await.unwrap().items;
    assert_eq!(tunnels.len(), 1);
    let tunnel = tunnels[0].name_any();
    assert_eq!(tunnels[0].owner_references()[0].name, "shop");
    let domain = f.api::<Domain>().get(&tunnel).await.unwrap();
    assert_eq!(domain.status.unwrap().hostname.as_deref(), Some(host.as_str()));
    let key = key_id(&f, &tunnel).await;
    f.wait_event("shop", "Normal", "TLSAtEdge").await;

    // A WebSocket stays open while the paths change.
    let (mut ws, _) = f.edge.client().websocket(&host, "/a/ws").await;
    assert_eq!(net::ws_roundtrip(&mut ws, "one").await, "A echoes one");
    f.patch::<Ingress>(
        "shop",
        json!({"spec": {"defaultBackend": {"service": {"name": "a", "port": {"number": 80}}},
            "rules": [{"host": host, "http": {"paths": [
                {"path": "/a", "pathType": "Prefix", "backend": {"service": {"name": "b", "port": {"number": 80}}}},
                {"path": "/a/exact", "pathType": "Exact", "backend": {"service": {"name": "a", "port": {"number": 80}}}},
                {"path": "/c", "pathType": "ImplementationSpecific", "backend": {"service": {"name": "b", "port": {"number": 80}}}},
                {"path": "/ext", "pathType": "Prefix", "backend": {"service": {"name": "ext", "port": {"number": 80}}}}]}}]}}),
    )
    .await;
    f.get_until(&host, "/a/x", ok("B /a/x")).await;
    assert_eq!(f.edge.client().get(&host, "/a/exact").await.1, "A /a/exact", "Exact beats a shorter Prefix");
    assert_eq!(f.edge.client().get(&host, "/a/exact/more").await.1, "B /a/exact/more");
    assert_eq!(f.edge.client().get(&host, "/c/d").await.1, "B /c/d", "ImplementationSpecific is Prefix");
    assert_eq!(f.edge.client().get(&host, "/b").await.1, "A /b", "removed path: the default backend");
    assert_eq!(net::ws_roundtrip(&mut ws, "two").await, "A echoes two", "the WebSocket survived the change");
    // A path to an ExternalName Service is refused (a Warning on the Ingress); the others still work.
    let msg = f.wait_event("shop", "Warning", "Degraded").await;
    assert!(msg.contains("route /ext") && msg.contains("ExternalName"), "{msg}");
    assert_eq!(
        f.edge.client().get(&host, "/ext").await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "routed, not usable"
    );
    assert_eq!(key_id(&f, &tunnel).await, key, "same tunnel key");
    ws.close(None).await.unwrap();

    // Deleting the Ingress removes the Tunnel and the Domain (garbage
    // collector, then their finalizers) and releases the name at the edge.
    f.api::<Ingress>().delete("shop", &DeleteParams::default()).await.unwrap();
    wait_until("Tunnel and Domain gone", WAIT, || async {
        let left = f.api::<Tunnel>().get_opt(&tunnel).await?.is_some()
            || f.api::<Domain>().get_opt(&tunnel).await?.is_some();
        Ok((!left).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(f.edge.api("GET", &format!("domains/{host}"), None).await.0, StatusCode::NOT_FOUND);
    f.finish(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ingresses_share_a_host_and_conflicts_are_reported() {
    let Some(f) = Fixture::new("ing-share").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    http_backend(&backends, 8002, "B");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    service_with_endpoints(&f, "b", &backends.ip, json!({}), &[("http", 80, 8002, "TCP")]).await;
    let class = format!("culvert-{}", f.suffix());
    f.ingress_class(&class, CONTROLLER, false).await;
    let (stop, task) = f.operator();
    let host = format!("s{}.edge.test", f.suffix());

    f.create::<Ingress>(ingress("first", Some(&class), &host, &[("/x", "Prefix", "a")])).await;
    f.wait_ingress_published("first", &host).await;
    // Creation timestamps have a one-second resolution: "second" must be
    // younger, so it is made once the clock has left the second "first" was
    // made in (at once, mostly: publishing takes longer than that).
    let made = f.api::<Ingress>().get("first").await.unwrap().metadata.creation_timestamp.unwrap().0;
    let next_second = made.checked_add(k8s_openapi::jiff::SignedDuration::from_secs(1)).unwrap();
    wait_until("a second after the first Ingress was made", WAIT, || async move {
        Ok((k8s_openapi::jiff::Timestamp::now() >= next_second).then_some(()))
    })
    .await
    .unwrap();
    f.create::<Ingress>(ingress(
        "second",
        Some(&class),
        &host,
        &[("/y", "Prefix", "b"), ("/x", "Prefix", "b")],
    ))
    .await;
    f.wait_ingress_published("second", &host).await;
    f.get_until(&host, "/y", |s, b| s == StatusCode::OK && b == "B /y").await;
    assert_eq!(f.edge.client().get(&host, "/x").await.1, "A /x", "the older Ingress keeps /x");
    assert_eq!(
        f.api::<Tunnel>().list(&Default::default()).await.unwrap().items.len(),
        1,
        "one tunnel per host"
    );
    let msg = f.wait_event("second", "Warning", "PathConflict").await;
    assert!(msg.contains("Prefix /x") && msg.contains("/first was first"), "{msg}");
    f.wait_event("first", "Warning", "PathConflict").await;

    // The older one goes: its paths go, the younger one's /x is served.
    f.api::<Ingress>().delete("first", &DeleteParams::default()).await.unwrap();
    f.get_until(&host, "/x", |s, b| s == StatusCode::OK && b == "B /x").await;
    let tunnels = f.api::<Tunnel>().list(&Default::default()).await.unwrap().items;
    assert_eq!(tunnels.len(), 1);
    assert_eq!(tunnels[0].owner_references().iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["second"]);
    f.finish(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_classes_and_the_default_class() {
    let Some(f) = Fixture::new("ing-class").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    let ours = format!("culvert-{}", f.suffix());
    let theirs = format!("nginx-{}", f.suffix());
    f.ingress_class(&ours, CONTROLLER, false).await;
    f.ingress_class(&theirs, "k8s.io/ingress-nginx", false).await;
    let (args, admin) = fixture::serving_metrics(f.args("solo"));
    let (stop, task) = f.operator_with(args);
    let host = |n: &str| format!("{n}{}.edge.test", f.suffix());

    // Made before any class is default: stays class-less.
    f.create::<Ingress>(ingress("classless", None, &host("c"), &[("/", "Prefix", "a")])).await;
    f.create::<Ingress>(ingress("other", Some(&theirs), &host("o"), &[("/", "Prefix", "a")])).await;
    f.create::<Ingress>(ingress("mine", Some(&ours), &host("m"), &[("/", "Prefix", "a")])).await;
    f.wait_ingress_published("mine", &host("m")).await;
    f.get_until(&host("m"), "/", |s, b| s == StatusCode::OK && b == "A /").await;
    // Reconciled, and left alone.
    for name in ["classless", "other"] {
        f.wait_reconciled(admin, "Ingress", &f.ns.name, name).await;
    }
    assert_eq!(f.api::<Tunnel>().list(&Default::default()).await.unwrap().items.len(), 1, "only `mine`");
    for name in ["classless", "other"] {
        let i = f.api::<Ingress>().get(name).await.unwrap();
        assert!(
            i.status.and_then(|s| s.load_balancer).and_then(|l| l.ingress).unwrap_or_default().is_empty()
        );
    }

    // Our class made default: the class-less Ingress is served, the other class still not.
    f.ingress_class(&ours, CONTROLLER, true).await;
    f.wait_ingress_published("classless", &host("c")).await;
    f.get_until(&host("c"), "/", |s, b| s == StatusCode::OK && b == "A /").await;
    assert_eq!(f.api::<Tunnel>().list(&Default::default()).await.unwrap().items.len(), 2);

    // No longer default: withdrawn (Tunnel, Domain and status).
    f.ingress_class(&ours, CONTROLLER, false).await;
    wait_until("class-less Ingress withdrawn", WAIT, || async {
        let i = serde_json::to_value(f.api::<Ingress>().get("classless").await?)?;
        let tunnels = f.api::<Tunnel>().list(&Default::default()).await?.items.len();
        Ok((i["status"]["loadBalancer"]["ingress"].as_array().is_none_or(|a| a.is_empty()) && tunnels == 1)
            .then_some(()))
    })
    .await
    .unwrap();
    f.get_until(&host("c"), "/", |s, _| s != StatusCode::OK).await;
    f.finish(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_policy_waits_for_a_domain() {
    let Some(f) = Fixture::new("ing-require").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    http_backend(&backends, 8001, "A");
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    let class = format!("culvert-{}", f.suffix());
    f.ingress_class(&class, CONTROLLER, false).await;
    let mut args = f.args("solo");
    args.domain_policy = DomainPolicy::Require;
    let (stop, task) = f.operator_with(args);
    let label = format!("r{}", f.suffix());
    let host = format!("{label}.edge.test");
    f.create::<Ingress>(ingress("web", Some(&class), &host, &[("/", "Prefix", "a")])).await;
    let msg = f.wait_event("web", "Warning", "DomainRequired").await;
    assert!(msg.contains(&host), "{msg}");
    assert!(f.api::<Domain>().list(&Default::default()).await.unwrap().items.is_empty(), "none made");
    // The user's Domain covers the host: published on it.
    f.create::<Domain>(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain", "metadata": {"name": "mine"}, "spec": {"name": label}})).await;
    f.wait_ingress_published("web", &host).await;
    f.get_until(&host, "/", |s, b| s == StatusCode::OK && b == "A /").await;
    let t = &f.api::<Tunnel>().list(&Default::default()).await.unwrap().items[0];
    assert_eq!(t.spec.domain.as_deref(), Some("mine"));
    f.finish(stop, task).await;
}

fn lb_status(svc: &Service) -> Value {
    serde_json::to_value(svc).unwrap()["status"]["loadBalancer"].clone()
}

async fn connect_echo(
    port: u16,
) -> (BufReader<tokio::net::tcp::OwnedReadHalf>, tokio::net::tcp::OwnedWriteHalf, SocketAddr) {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let local = tcp.local_addr().unwrap();
    let (r, w) = tcp.into_split();
    (BufReader::new(r), w, local)
}

async fn ask(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    line: &str,
) -> String {
    w.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), r.read_line(&mut answer))
        .await
        .expect("answer in time")
        .unwrap();
    answer.trim_end().to_string()
}

/// Sends `payload` to the edge until one datagram comes back (within WAIT).
async fn udp_echo(c: &tokio::net::UdpSocket, payload: &[u8]) -> Vec<u8> {
    wait_until("udp echo through the edge", WAIT, || async {
        c.send(payload).await?;
        let mut buf = vec![0u8; 2048];
        let got = tokio::time::timeout(Duration::from_secs(2), c.recv(&mut buf)).await;
        Ok(got.ok().and_then(Result::ok).map(|n| buf[..n].to_vec()))
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancer_service_tcp_echo_proxy_protocol_and_release() {
    let Some(f) = Fixture::new("lb-echo").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    tcp_backend(&backends, 9000);
    // UDP 9000 in the same host: an echo (with PROXY v2 the header comes back too).
    let udp = fixture::udp_in(&backends, 9000);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, peer)) = udp.recv_from(&mut buf).await {
            let _ = udp.send_to(&buf[..n], peer).await;
        }
    });
    let same = f.edge.tcp_ports.first;
    service_with_endpoints(
        &f,
        "db",
        &backends.ip,
        json!({"type": "LoadBalancer", "loadBalancerClass": "culvert.dev/tunnel"}),
        &[("tcp", same, 9000, "TCP"), ("pg", 5432, 9000, "TCP"), ("dns", 53, 9000, "UDP")],
    )
    .await;
    let (stop, task) = f.operator();

    // Status: the edge's address with the three public ports (TCP, TCP,
    // UDP); the annotation maps them.
    let svc = wait_until("Service status written", WAIT, || async {
        let s = f.api::<Service>().get("db").await?;
        Ok((lb_status(&s)["ingress"][0]["ports"].as_array().map(Vec::len) == Some(3)).then_some(s))
    })
    .await
    .unwrap();
    let lb = lb_status(&svc);
    assert_eq!(lb["ingress"][0]["ip"], "127.0.0.1");
    let public: Vec<u16> = lb["ingress"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_u64().unwrap() as u16)
        .collect();
    assert_eq!(public[0], same, "the same port number when the edge's range has it free");
    assert!(
        f.edge.tcp_ports.contains(public[1]) && public[1] != same,
        "5432 is outside the range: any free port"
    );
    let protocols: Vec<&str> = lb["ingress"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["protocol"].as_str().unwrap())
        .collect();
    assert_eq!(protocols, ["TCP", "TCP", "UDP"]);
    assert!(f.edge.tcp_ports.contains(public[2]), "UDP 53 is outside the range: any free UDP port");
    assert_eq!(
        svc.annotations()["culvert.dev/public-ports"],
        format!("{same}={same},5432={},53/udp={}", public[1], public[2])
    );
    // Once the agents are connected: no port error, the condition True, an event naming the ports.
    let svc = wait_until("Service connected", WAIT, || async {
        let s = f.api::<Service>().get("db").await?;
        let connected =
            s.status.as_ref().and_then(|st| st.conditions.as_ref()).is_some_and(|cs| {
                cs.iter().any(|c| c.type_ == "culvert.dev/Connected" && c.status == "True")
            });
        Ok(connected.then_some(s))
    })
    .await
    .unwrap();
    let lb = lb_status(&svc);
    assert!(lb["ingress"][0]["ports"].as_array().unwrap().iter().all(|p| p.get("error").is_none()), "{lb}");
    let want = format!("port 5432 → 127.0.0.1:{}", public[1]);
    let found = wait_until("a Published event naming the public port", WAIT, || async {
        let events = f.events_for("db").await;
        Ok(events
            .iter()
            .any(|(t, r, m)| t == "Normal" && r == "Published" && m.contains(&want))
            .then_some(()))
    })
    .await;
    assert!(found.is_ok(), "{want}: {:?}", f.events_for("db").await);
    // Owned TcpPort and Tunnel per TCP port, listed by `kubectl get tunnels`.
    let mut names: Vec<String> = f
        .api::<Tunnel>()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|t| t.name_any())
        .collect();
    names.sort();
    let mut want = vec!["lb-db-5432".to_string(), format!("lb-db-{same}"), "lb-db-udp-53".to_string()];
    want.sort();
    assert_eq!(names, want);
    let udp_ports = f.api::<UdpPort>().list(&Default::default()).await.unwrap().items;
    assert_eq!(udp_ports.iter().map(|p| p.name_any()).collect::<Vec<_>>(), ["lb-db-udp-53"]);
    assert_eq!(udp_ports[0].status.as_ref().unwrap().address, Some(format!("127.0.0.1:{}", public[2])));

    // UDP echo end to end, a datagram through the edge and the tunnel.
    let udp_client = || async {
        let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.connect(("127.0.0.1", public[2])).await.unwrap();
        c
    };
    let first_client = udp_client().await;
    assert_eq!(udp_echo(&first_client, b"dns?").await, b"dns?");

    // TCP echo end to end, no PROXY header by default.
    let wait_echo = |port: u16| async move {
        wait_until("tcp echo through the edge", WAIT, || async {
            let (mut r, mut w, _) = connect_echo(port).await;
            w.write_all(b"hello\n").await?;
            let mut line = String::new();
            let n = tokio::time::timeout(Duration::from_secs(2), r.read_line(&mut line))
                .await
                .unwrap_or(Ok(0))?;
            Ok((n > 0 && line == "hello\n").then_some(()))
        })
        .await
        .unwrap()
    };
    wait_echo(public[0]).await;
    wait_echo(public[1]).await;
    let (mut r, mut w, _) = connect_echo(public[0]).await;
    assert_eq!(ask(&mut r, &mut w, "whoami").await, "proxy none");
    let (mut kept_r, mut kept_w, _) = connect_echo(public[0]).await;
    assert_eq!(ask(&mut kept_r, &mut kept_w, "before").await, "before");

    // PROXY protocol v1, then v2, without deleting the Service.
    for (version, value) in [(1, "v1"), (2, "v2")] {
        f.patch::<Service>("db", json!({"metadata": {"annotations": {"culvert.dev/proxy-protocol": value}}}))
            .await;
        let (src, answer) = wait_until(&format!("PROXY {value} reaches the backend"), WAIT, || async {
            let (mut r, mut w, local) = connect_echo(public[0]).await;
            let a = ask(&mut r, &mut w, "whoami").await;
            Ok(a.starts_with(&format!("proxy v{version} ")).then_some((local, a)))
        })
        .await
        .unwrap();
        assert_eq!(
            answer,
            format!("proxy v{version} {src} 127.0.0.1:{}", public[0]),
            "the real client address"
        );
    }
    // With v2, each UDP datagram of a new flow (a flow keeps the options it
    // started with) reaches the backend after a v2 header (UDP over IPv4,
    // the client's address); the echo sends it back.
    let (datagram, client) = wait_until("PROXY v2 before the UDP datagram", WAIT, || async {
        let c = udp_client().await;
        let got = udp_echo(&c, b"hi").await;
        Ok((got.len() > 16 && got[12..14] == [0x21, 0x12]).then(|| (got, c.local_addr().unwrap())))
    })
    .await
    .unwrap();
    assert_eq!(&datagram[..12], b"\r\n\r\n\0\r\nQUIT\n");
    assert_eq!(u16::from_be_bytes([datagram[24], datagram[25]]), client.port(), "the client's port");
    assert_eq!(u16::from_be_bytes([datagram[26], datagram[27]]), public[2], "the edge's port");
    assert_eq!(&datagram[28..], b"hi");
    assert_eq!(
        ask(&mut kept_r, &mut kept_w, "after").await,
        "after",
        "an open connection survived the changes"
    );

    // Switching the type withdraws the status, releases the ports, and last
    // removes the annotation (so its absence means everything is released).
    f.patch::<Service>("db", json!({"spec": {"type": "ClusterIP"}})).await;
    let svc = wait_until("culvert.dev/public-ports withdrawn", WAIT, || async {
        let s = f.api::<Service>().get("db").await?;
        Ok((!s.annotations().contains_key("culvert.dev/public-ports")).then_some(s))
    })
    .await
    .unwrap();
    assert!(lb_status(&svc)["ingress"].as_array().is_none_or(|a| a.is_empty()), "{}", lb_status(&svc));
    for p in &public[..2] {
        assert_eq!(
            f.edge.api("GET", &format!("ports/{p}"), None).await.0,
            StatusCode::NOT_FOUND,
            "{p} released"
        );
    }
    assert_eq!(
        f.edge.api("GET", &format!("ports/{}?protocol=udp", public[2]), None).await.0,
        StatusCode::NOT_FOUND,
        "UDP {} released",
        public[2]
    );
    assert!(f.api::<TcpPort>().list(&Default::default()).await.unwrap().items.is_empty());
    assert!(f.api::<UdpPort>().list(&Default::default()).await.unwrap().items.is_empty());
    assert!(f.api::<Tunnel>().list(&Default::default()).await.unwrap().items.is_empty());
    f.finish(stop, task).await;
}

/// Where k3s puts Traefik. The test's Services there carry the label
/// `culvert.dev/test`, so one left behind by a failed run can be found.
const SYSTEM_NS: &str = "kube-system";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn which_load_balancers_are_managed() {
    let Some(f) = Fixture::new("lb-manage").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    tcp_backend(&backends, 9000);
    let lb = |class: Option<&str>, manage: Option<&str>| {
        let mut spec = json!({"type": "LoadBalancer"});
        if let Some(c) = class {
            spec["loadBalancerClass"] = json!(c);
        }
        (spec, manage.map(String::from))
    };
    let make = |name: &'static str, (spec, manage): (Value, Option<String>)| {
        let f = &f;
        let ip = backends.ip.clone();
        async move {
            service_with_endpoints(f, name, &ip, spec, &[("tcp", 7000, 9000, "TCP")]).await;
            if let Some(m) = manage {
                f.patch::<Service>(name, json!({"metadata": {"annotations": {"culvert.dev/manage": m}}}))
                    .await;
            }
        }
    };
    let published_in = |ns: &str, name: &str| {
        let api = kube::Api::<Service>::namespaced(f.client.clone(), ns);
        let name = name.to_string();
        async move {
            let s = api.get(&name).await.unwrap();
            lb_status(&s)["ingress"].as_array().is_some_and(|a| !a.is_empty())
        }
    };
    let published = |name: &'static str| published_in(&f.ns.name, name);
    make("plain", lb(None, None)).await;
    make("optin", lb(None, Some("1"))).await;
    make("optout", lb(None, Some("0"))).await;
    make("classed", lb(Some("culvert.dev/tunnel"), None)).await;
    make("foreign", lb(Some("example.com/other"), None)).await;

    // kube-system (where k3s has Traefik): a class-less one, and one annotated "1",
    // served by a second operator that watches only kube-system.
    let system = kube::Api::<Service>::namespaced(f.client.clone(), SYSTEM_NS);
    let (ks_plain, ks_optin) = (format!("traefik-{}", f.suffix()), format!("optin-{}", f.suffix()));
    for (name, annotations) in [(&ks_plain, json!({})), (&ks_optin, json!({"culvert.dev/manage": "1"}))] {
        let svc: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": {"culvert.dev/test": "true"}, "annotations": annotations},
            "spec": {"type": "LoadBalancer", "ports": [{"name": "tcp", "port": 7000, "targetPort": 9000}]}}))
        .unwrap();
        system.create(&Default::default(), &svc).await.unwrap();
    }
    let system_operator = |manage_classless: bool| {
        let mut args = f.args(&format!("system-{}", f.suffix()));
        args.watch_namespace = Some(SYSTEM_NS.into());
        args.namespace = SYSTEM_NS.into();
        args.manage_classless_load_balancers = manage_classless;
        let (args, admin) = fixture::serving_metrics(args);
        let (stop, task) = f.operator_with(args);
        (stop, task, admin)
    };

    // Default: our class and the annotated "1" only, in every namespace.
    let (args, admin) = fixture::serving_metrics(f.args("solo"));
    let (stop, task) = f.operator_with(args);
    let (sys_stop, sys_task, sys_admin) = system_operator(false);
    for name in ["optin", "classed"] {
        wait_until(&format!("{name} published"), WAIT, || async { Ok(published(name).await.then_some(())) })
            .await
            .unwrap();
    }
    wait_until("kube-system Service annotated 1 published", WAIT, || async {
        Ok(published_in(SYSTEM_NS, &ks_optin).await.then_some(()))
    })
    .await
    .unwrap();
    // Both operators have reconciled the Services they leave alone.
    for name in ["plain", "optout", "foreign"] {
        f.wait_reconciled(admin, "Service", &f.ns.name, name).await;
    }
    f.wait_reconciled(sys_admin, "Service", SYSTEM_NS, &ks_plain).await;
    for name in ["plain", "optout", "foreign"] {
        assert!(!published(name).await, "{name} is not managed by default");
        assert!(f.api::<Tunnel>().get_opt(&format!("lb-{name}-7000")).await.unwrap().is_none());
    }
    assert!(!published_in(SYSTEM_NS, &ks_plain).await, "a class-less kube-system Service is left alone");
    stop.cancel();
    task.await.unwrap();
    sys_stop.cancel();
    sys_task.await.unwrap();

    // --manage-classless-load-balancers: every class-less one unless opted out,
    // but never kube-system's without the annotation.
    let mut args = f.args("classless");
    args.manage_classless_load_balancers = true;
    let (args, admin) = fixture::serving_metrics(args);
    let (stop, task) = f.operator_with(args);
    let (sys_stop, sys_task, sys_admin) = system_operator(true);
    wait_until("plain published", WAIT, || async { Ok(published("plain").await.then_some(())) })
        .await
        .unwrap();
    for name in ["optout", "foreign"] {
        f.wait_reconciled(admin, "Service", &f.ns.name, name).await;
    }
    f.wait_reconciled(sys_admin, "Service", SYSTEM_NS, &ks_plain).await;
    for name in ["optout", "foreign"] {
        assert!(!published(name).await, "{name} is not managed");
    }
    for name in ["plain", "optin", "classed"] {
        assert!(published(name).await, "{name} is managed");
    }
    assert!(!published_in(SYSTEM_NS, &ks_plain).await, "kube-system needs the annotation even so");
    assert!(published_in(SYSTEM_NS, &ks_optin).await);
    let system_tunnels = kube::Api::<Tunnel>::namespaced(f.client.clone(), SYSTEM_NS);
    assert!(system_tunnels.get_opt(&format!("lb-{ks_plain}-7000")).await.unwrap().is_none());

    // Deleting the kube-system ones releases what was made there (while its operator runs).
    for name in [&ks_plain, &ks_optin] {
        system.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let system_ports = kube::Api::<TcpPort>::namespaced(f.client.clone(), SYSTEM_NS);
    wait_until("kube-system objects finalized", WAIT, || async {
        let t = system_tunnels.get_opt(&format!("lb-{ks_optin}-7000")).await?;
        let p = system_ports.get_opt(&format!("lb-{ks_optin}-7000")).await?;
        Ok((t.is_none() && p.is_none()).then_some(()))
    })
    .await
    .unwrap();
    sys_stop.cancel();
    sys_task.await.unwrap();
    let leases =
        kube::Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(f.client.clone(), SYSTEM_NS);
    let _ = leases.delete("culvert-operator-leader", &DeleteParams::default()).await;

    // Opting out later withdraws; deleting a Service releases its port.
    f.patch::<Service>("plain", json!({"metadata": {"annotations": {"culvert.dev/manage": "0"}}})).await;
    wait_until("plain withdrawn", WAIT, || async {
        Ok((!published("plain").await && f.api::<Tunnel>().get_opt("lb-plain-7000").await?.is_none())
            .then_some(()))
    })
    .await
    .unwrap();
    let port = f.api::<TcpPort>().get("lb-optin-7000").await.unwrap().status.unwrap().port.unwrap();
    f.api::<Service>().delete("optin", &DeleteParams::default()).await.unwrap();
    wait_until("port of the deleted Service released", WAIT, || async {
        Ok((f.edge.api("GET", &format!("ports/{port}"), None).await.0 == StatusCode::NOT_FOUND).then_some(()))
    })
    .await
    .unwrap();
    f.finish(stop, task).await;
}

/// `label path body=<bytes> auth=<whether an Authorization header came>`;
/// paths ending in `/slow` answer after 3 s, `/ws` is a WebSocket echo.
fn info_backend(host: &NetnsHost, port: u16, label: &'static str) {
    net::serve_http1(listen_in(host, port), move |req: Request<Incoming>| async move {
        if req.uri().path().ends_with("/ws") {
            return handle(req, label).await;
        }
        if req.uri().path().ends_with("/slow") {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        let path = req.uri().path().to_string();
        let auth = req.headers().contains_key("authorization");
        let n = req.into_body().collect().await.map(|b| b.to_bytes().len()).unwrap_or(0);
        let text = format!("{label} {path} body={n} auth={auth}");
        Ok(Response::new(Full::new(Bytes::from(text)).map_err(|never| match never {}).boxed_unsync()))
    });
}

fn with_annotations(mut ing: Value, annotations: Value) -> Value {
    ing["metadata"]["annotations"] = annotations;
    ing
}

/// A request through the edge: (status, body, headers).
async fn request(
    f: &Fixture,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
    streamed: bool,
) -> (StatusCode, String, http::HeaderMap) {
    type Chunks =
        futures_util::stream::Iter<std::vec::IntoIter<Result<hyper::body::Frame<Bytes>, std::io::Error>>>;
    let body = body.unwrap_or_default();
    let mut builder = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let resp = if streamed {
        // Two chunks and no Content-Length: the limit is found while streaming.
        let half = body.len() / 2;
        let frames = vec![
            Ok(hyper::body::Frame::data(Bytes::copy_from_slice(&body[..half]))),
            Ok(hyper::body::Frame::data(Bytes::copy_from_slice(&body[half..]))),
        ];
        let stream: Chunks = futures_util::stream::iter(frames);
        f.edge.client().send(host, builder.body(http_body_util::StreamBody::new(stream)).unwrap(), true).await
    } else {
        f.edge.client().send(host, builder.body(Full::new(Bytes::from(body))).unwrap(), false).await
    }
    .expect("request through the edge");
    let (parts, b) = resp.into_parts();
    let b = b.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    (parts.status, String::from_utf8_lossy(&b).into_owned(), parts.headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_annotations_apply_per_path_and_change_live() {
    use base64::Engine;
    let Some(f) = Fixture::new("ing-annot").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    info_backend(&backends, 8001, "A");
    h2c_backend(&backends, 8002);
    let tls_host = format!("t{}.edge.test", f.suffix());
    tls_backend(&backends, 8443, &["backend.test".to_string()]);
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    service_with_endpoints(&f, "grpc", &backends.ip, json!({}), &[("http", 80, 8002, "TCP")]).await;
    service_with_endpoints(&f, "secure", &backends.ip, json!({}), &[("https", 80, 8443, "TCP")]).await;
    // alice:wonderland as `htpasswd -nbs` writes it, and a bearer token.
    f.create::<Secret>(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "users"},
        "stringData": {"auth": "alice:{SHA}tiY7sUhYKUwI5L3866kDY+ENcrQ=\n", "token": "tok-1\n"}}))
        .await;
    let class = format!("culvert-{}", f.suffix());
    f.ingress_class(&class, CONTROLLER, false).await;
    let (stop, task) = f.operator();

    // Two Ingresses share a host: the annotations of each apply to its own paths.
    let host = format!("g{}.edge.test", f.suffix());
    let guarded = |annotations: Value| {
        with_annotations(ingress("guarded", Some(&class), &host, &[("/private", "Prefix", "a")]), annotations)
    };
    f.create::<Ingress>(guarded(json!({"culvert.dev/auth-secret": "users",
        "culvert.dev/proxy-read-timeout": "1", "culvert.dev/proxy-body-size": "1k"})))
        .await;
    f.create::<Ingress>(ingress("open", Some(&class), &host, &[("/public", "Prefix", "a")])).await;
    let h2c_host = format!("h{}.edge.test", f.suffix());
    f.create::<Ingress>(with_annotations(
        ingress("h2c", Some(&class), &h2c_host, &[("/", "Prefix", "grpc")]),
        json!({"culvert.dev/backend-protocol": "h2c"}),
    ))
    .await;
    let mut tls = ingress("tls", Some(&class), &tls_host, &[("/", "Prefix", "secure")]);
    tls["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] = json!({"number": 80});
    f.create::<Ingress>(with_annotations(
        tls,
        json!({"culvert.dev/backend-protocol": "https", "culvert.dev/backend-tls-verify": "false"}),
    ))
    .await;
    f.create::<Ingress>(with_annotations(
        ingress("verified", Some(&class), &tls_host, &[("/verified", "Prefix", "secure")]),
        json!({"culvert.dev/backend-protocol": "https"}),
    ))
    .await;
    for (name, h) in [("guarded", &host), ("open", &host), ("h2c", &h2c_host), ("tls", &tls_host)] {
        f.wait_ingress_published(name, h).await;
    }

    let ok = |s: StatusCode, _: &str| s == StatusCode::OK;
    f.get_until(&host, "/public/x", ok).await;
    let alice = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("alice:wonderland"));
    let wrong = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("alice:nope"));
    f.get_until(&host, "/private/x", |s, _| s == StatusCode::UNAUTHORIZED).await;
    let (s, body, h) = request(&f, &host, "GET", "/private/x", &[], None, false).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{body}");
    let challenges: Vec<&str> = h.get_all("www-authenticate").iter().map(|v| v.to_str().unwrap()).collect();
    assert!(challenges.iter().any(|c| c.starts_with("Basic realm=")), "{challenges:?}");
    assert!(challenges.iter().any(|c| c.starts_with("Bearer realm=")), "{challenges:?}");
    let (s, _, _) = request(&f, &host, "GET", "/private/x", &[("authorization", &wrong)], None, false).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "a wrong password");
    let (s, body, _) =
        request(&f, &host, "GET", "/private/x", &[("authorization", &alice)], None, false).await;
    assert_eq!(
        (s, body.as_str()),
        (StatusCode::OK, "A /private/x body=0 auth=false"),
        "credentials not forwarded"
    );
    let (s, body, _) =
        request(&f, &host, "GET", "/private/y", &[("authorization", "Bearer tok-1")], None, false).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "A /private/y body=0 auth=false"));
    assert_eq!(
        request(&f, &host, "GET", "/public/x", &[("authorization", "Bearer x")], None, false).await.1,
        "A /public/x body=0 auth=true",
        "the other Ingress's path is open and its headers untouched"
    );

    // Read timeout: a slower backend is a 504 that says why.
    let (s, body, _) =
        request(&f, &host, "GET", "/private/slow", &[("authorization", &alice)], None, false).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "{body}");
    assert!(body.contains("did not answer within 1s"), "{body}");
    let (s, body, _) = request(&f, &host, "GET", "/public/slow", &[], None, false).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "A /public/slow body=0 auth=false"), "no timeout there");

    // Body size: 1k allowed; more is 413, by Content-Length and streamed.
    let auth = [("authorization", alice.as_str())];
    let (s, body, _) = request(&f, &host, "POST", "/private/up", &auth, Some(vec![b'x'; 1024]), false).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "A /private/up body=1024 auth=false"));
    let (s, body, _) = request(&f, &host, "POST", "/private/up", &auth, Some(vec![b'x'; 1025]), false).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    let (s, body, _) = request(&f, &host, "POST", "/private/up", &auth, Some(vec![b'x'; 4000]), true).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "streamed: {body}");
    let (s, body, _) = request(&f, &host, "POST", "/private/up", &auth, Some(vec![b'x'; 1000]), true).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "A /private/up body=1000 auth=false"), "streamed");
    let (s, _, _) = request(&f, &host, "POST", "/public/up", &[], Some(vec![b'x'; 4000]), false).await;
    assert_eq!(s, StatusCode::OK, "no limit on the other Ingress's paths");

    // h2c and https backends.
    f.get_until(&h2c_host, "/x", |s, b| s == StatusCode::OK && b == "h2c HTTP/2.0 /x").await;
    let (s, body) = f.get_until(&tls_host, "/x", ok).await;
    assert_eq!(body, format!("tls /x sni={tls_host}"), "{s}: the public host is the TLS server name");
    let (s, body) = f.get_until(&tls_host, "/verified", |s, _| s != StatusCode::NOT_FOUND).await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("certificate") && body.contains("backend-tls-verify"), "{body}");

    // Changes apply without reconnecting: a WebSocket stays open while the
    // guard goes, a new token comes and the limit changes.
    let tunnel = f.api::<Tunnel>().list(&Default::default()).await.unwrap().items;
    let tunnel =
        tunnel.iter().find(|t| t.annotations().get("culvert.dev/host") == Some(&host)).unwrap().name_any();
    let key = key_id(&f, &tunnel).await;
    let (mut ws, _) = f.edge.client().websocket(&host, "/public/ws").await;
    assert_eq!(net::ws_roundtrip(&mut ws, "one").await, "A echoes one");
    f.patch::<Secret>("users", json!({"stringData": {"token": "tok-2\n"}})).await;
    wait_until("the new token is accepted", WAIT, || async {
        let (s, _, _) =
            request(&f, &host, "GET", "/private/x", &[("authorization", "Bearer tok-2")], None, false).await;
        Ok((s == StatusCode::OK).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        request(&f, &host, "GET", "/private/x", &[("authorization", "Bearer tok-1")], None, false).await.0,
        StatusCode::UNAUTHORIZED,
        "the old token is not"
    );
    f.api::<Ingress>()
        .replace("guarded", &Default::default(), &{
            let mut i = f.api::<Ingress>().get("guarded").await.unwrap();
            i.metadata.annotations =
                Some([("culvert.dev/proxy-body-size".to_string(), "2k".to_string())].into());
            i
        })
        .await
        .unwrap();
    f.get_until(&host, "/private/x", |s, b| s == StatusCode::OK && b == "A /private/x body=0 auth=false")
        .await;
    let (s, _, _) = request(&f, &host, "POST", "/private/up", &[], Some(vec![b'x'; 2000]), false).await;
    assert_eq!(s, StatusCode::OK, "the new limit");
    let (s, body, _) = request(&f, &host, "GET", "/private/slow", &[], None, false).await;
    assert_eq!((s, body.as_str()), (StatusCode::OK, "A /private/slow body=0 auth=false"), "no timeout now");
    assert_eq!(net::ws_roundtrip(&mut ws, "two").await, "A echoes two", "the WebSocket survived");
    assert_eq!(key_id(&f, &tunnel).await, key, "same tunnel key");
    ws.close(None).await.unwrap();
    f.finish(stop, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_tls_passthrough_reaches_the_backend_by_sni() {
    let Some(f) = Fixture::new("ing-pass").await else { return };
    let Some(backends) = NetnsHost::create() else { return };
    let host = format!("s{}.edge.test", f.suffix());
    let ca = tls_backend(&backends, 8443, std::slice::from_ref(&host));
    info_backend(&backends, 8001, "A");
    service_with_endpoints(&f, "secure", &backends.ip, json!({}), &[("https", 443, 8443, "TCP")]).await;
    service_with_endpoints(&f, "a", &backends.ip, json!({}), &[("http", 80, 8001, "TCP")]).await;
    let class = format!("culvert-{}", f.suffix());
    f.ingress_class(&class, CONTROLLER, false).await;
    let (stop, task) = f.operator();

    let mut pass = with_annotations(
        ingress("pass", Some(&class), &host, &[("/", "Prefix", "secure")]),
        json!({"culvert.dev/tls-passthrough": "true"}),
    );
    pass["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["port"] = json!({"number": 443});
    pass["spec"]["tls"] = json!([{"hosts": [host]}]);
    f.create::<Ingress>(pass).await;
    f.wait_ingress_published("pass", &host).await;
    let t = &f.api::<Tunnel>().list(&Default::default()).await.unwrap().items[0];
    assert_eq!(t.spec.protocol, culvert::crd::TunnelProtocol::Tls);
    let body = wait_until("TLS passthrough to the backend", WAIT, || async {
        Ok(get_passthrough(&f, &host, &ca).await.ok())
    })
    .await
    .unwrap();
    assert_eq!(body, format!("tls / sni={host}"), "the backend's certificate, the client's SNI");
    let msg = f.wait_event("pass", "Normal", "TLSPassthrough").await;
    assert!(msg.contains(&host), "{msg}");

    // Paths to two Services cannot be one passthrough: a Warning, not published.
    let two = format!("d{}.edge.test", f.suffix());
    f.create::<Ingress>(with_annotations(
        ingress("two", Some(&class), &two, &[("/", "Prefix", "secure"), ("/a", "Prefix", "a")]),
        json!({"culvert.dev/tls-passthrough": "true"}),
    ))
    .await;
    let msg = f.wait_event("two", "Warning", "TLSPassthrough").await;
    assert!(msg.contains("several Services") && msg.contains(&two), "{msg}");
    assert_eq!(f.api::<Tunnel>().list(&Default::default()).await.unwrap().items.len(), 1, "not published");
    f.finish(stop, task).await;
}
