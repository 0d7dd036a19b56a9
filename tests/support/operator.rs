//! The operator test fixture, shared by the operator and Ingress suites: a
//! real kube-apiserver (the kube-env harness), an in-process edge, one
//! namespace per test and an in-process operator watching only it; helpers to
//! create objects, wait for events and statuses, and clean up; backends in a
//! network namespace (TCP listeners, an HTTPS backend) and a TLS passthrough client.
//!
//! Used as `support::operator` (see `support/mod.rs`); it builds on
//! `support::kube`, `support::net` and `support::netns`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use culvert::crd::{Domain, TcpPort, Tunnel};
use culvert::operator::{BackendAddress, DomainPolicy, OperatorArgs};
use culvert::tls::TunnelCipher;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Event, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::{Ingress, IngressClass};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::kube::{self as kube_env, TestNamespace, wait_until};
use super::net::{self, TestEdge};
use super::netns::NetnsHost;

pub const WAIT: Duration = Duration::from_secs(60);

/// A namespaced Kubernetes object type the fixture can create, read and wait on.
pub trait NamespacedObject:
    kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + serde::de::DeserializeOwned
    + serde::Serialize
    + std::fmt::Debug
{
}

impl<K> NamespacedObject for K where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug
{
}

pub struct Fixture {
    pub client: Client,
    pub ns: TestNamespace,
    pub edge: TestEdge,
    pub endpoints_key: String,
    /// Cluster-scoped IngressClasses this test made (deleted at the end).
    classes: std::sync::Mutex<Vec<String>>,
}

impl Fixture {
    pub async fn new(prefix: &str) -> Option<Fixture> {
        Self::new_with(prefix, |_| {}).await
    }

    /// A fixture whose edge runs with changed arguments.
    pub async fn new_with(
        prefix: &str,
        configure: impl FnOnce(&mut culvert::edge::EdgeArgs),
    ) -> Option<Fixture> {
        let env = kube_env::connect().await?;
        kube_env::install_culvert_crds(&env.client).await;
        let ns = env.namespace(prefix).await.unwrap();
        let edge = TestEdge::start_with(configure).await;
        let (s, k) = edge
            .api(
                "POST",
                "api-keys",
                Some(json!({"name": "operator", "scope": "endpoints", "customDomains": ["*"]})),
            )
            .await;
        assert!(s.is_success(), "{k}");
        Some(Fixture {
            client: env.client.clone(),
            ns,
            edge,
            endpoints_key: k["secret"].as_str().unwrap().into(),
            classes: Default::default(),
        })
    }

    pub fn suffix(&self) -> &str {
        &self.ns.name[self.ns.name.len() - 8..]
    }

    pub fn args(&self, identity: &str) -> OperatorArgs {
        OperatorArgs {
            edge: vec![self.edge.url()],
            api_key: self.endpoints_key.clone(),
            api_key_file: None,
            ca_file: Some(self.edge.ca_file.clone()),
            // What `auto` picks on a Raspberry Pi 4: the operator's tunnels
            // carry these tests on ChaCha20-Poly1305, the standalone agents'
            // tests (tests/support/net.rs) on AES-GCM.
            tunnel_cipher: TunnelCipher::Chacha20Poly1305,
            namespace: self.ns.name.clone(),
            identity: Some(identity.into()),
            resync_seconds: 1,
            lease_seconds: 2,
            backend_address: BackendAddress::Endpoints,
            admin_addr: "127.0.0.1:0".parse().unwrap(),
            watch_namespace: Some(self.ns.name.clone()),
            manage_classless_load_balancers: false,
            annotated_only: false,
            domain_policy: DomainPolicy::Auto,
        }
    }

    /// Starts an operator in this process; cancel the token to stop it.
    pub fn operator_with(&self, args: OperatorArgs) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let stop = CancellationToken::new();
        let (client, s) = (self.client.clone(), stop.clone());
        let task =
            tokio::spawn(
                async move { culvert::operator::start(client, args, s).await.expect("operator runs") },
            );
        (stop, task)
    }

    /// Waits until the operator serving metrics on `admin` (see
    /// [`serving_metrics`]) has reconciled the `kind` object `name` of
    /// `namespace` at least once: the signal before asserting that nothing
    /// happened to it.
    pub async fn wait_reconciled(&self, admin: SocketAddr, kind: &str, namespace: &str, name: &str) {
        wait_until(&format!("{kind} {namespace}/{name} reconciled"), WAIT, || async {
            Ok((reconciles(admin, kind, namespace, name).await > 0).then_some(()))
        })
        .await
        .unwrap();
    }

    pub fn operator(&self) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        self.operator_with(self.args("solo"))
    }

    /// An operator with its own identity (a replica, for leader election).
    pub fn operator_as(&self, identity: &str) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        self.operator_with(self.args(identity))
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    pub async fn create<K>(&self, obj: Value) -> K
    where
        K: NamespacedObject,
    {
        let obj: K = serde_json::from_value(obj).unwrap();
        self.api::<K>().create(&PostParams::default(), &obj).await.unwrap()
    }

    /// Merge-patches a namespaced object.
    pub async fn patch<K>(&self, name: &str, patch: Value)
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        self.api::<K>().patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    }

    /// An IngressClass (cluster-scoped, removed by `finish`).
    pub async fn ingress_class(&self, name: &str, controller: &str, default: bool) {
        let mut obj = json!({"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass",
            "metadata": {"name": name, "labels": {"culvert.dev/test": "true"}}, "spec": {"controller": controller}});
        if default {
            obj["metadata"]["annotations"] = json!({"ingressclass.kubernetes.io/is-default-class": "true"});
        }
        let api = Api::<IngressClass>::all(self.client.clone());
        api.patch(name, &PatchParams::apply("culvert-tests").force(), &Patch::Apply(&obj)).await.unwrap();
        let mut classes = self.classes.lock().unwrap();
        if !classes.iter().any(|c| c == name) {
            classes.push(name.into());
        }
    }

    pub async fn events_for(&self, name: &str) -> Vec<(String, String, String)> {
        let events = self.api::<Event>().list(&Default::default()).await.unwrap();
        events
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .map(|e| {
                (e.type_.unwrap_or_default(), e.reason.unwrap_or_default(), e.message.unwrap_or_default())
            })
            .collect()
    }

    pub async fn wait_event(&self, name: &str, kind: &str, reason: &str) -> String {
        wait_until(&format!("{kind} event {reason} on {name}"), WAIT, || async {
            Ok(self
                .events_for(name)
                .await
                .into_iter()
                .find(|(t, r, _)| t == kind && r == reason)
                .map(|e| e.2))
        })
        .await
        .unwrap()
    }

    /// Waits until the Ingress's status names `host`.
    pub async fn wait_ingress_published(&self, name: &str, host: &str) {
        let api = self.api::<Ingress>();
        let r = wait_until(&format!("Ingress {name} status names {host}"), WAIT, || async {
            let v = serde_json::to_value(api.get(name).await?)?;
            let hosts: Vec<String> = v["status"]["loadBalancer"]["ingress"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|i| i["hostname"].as_str().map(String::from))
                .collect();
            Ok(hosts.iter().any(|h| h == host).then_some(()))
        })
        .await;
        if let Err(e) = r {
            let tunnels: Vec<Value> = self
                .api::<Tunnel>()
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .map(|t| json!({"name": t.name_any(), "spec": t.spec, "status": t.status}))
                .collect();
            panic!("{e}; tunnels: {tunnels:#?}; events: {:?}", self.events_for(name).await);
        }
    }

    /// GET through the edge until `want(status, body)` holds; returns the last answer.
    pub async fn get_until(
        &self,
        host: &str,
        path: &str,
        want: impl Fn(StatusCode, &str) -> bool,
    ) -> (StatusCode, String) {
        self.get_within(host, path, WAIT, want).await
    }

    /// [`Fixture::get_until`] within `limit` (shorter than the operator's
    /// periodic checks, to show a change applied by a watch).
    pub async fn get_within(
        &self,
        host: &str,
        path: &str,
        limit: Duration,
        want: impl Fn(StatusCode, &str) -> bool,
    ) -> (StatusCode, String) {
        let want = &want;
        net::eventually(&format!("GET {host}{path}"), limit, || async move {
            let got = self.edge.client().get(host, path).await;
            if want(got.0, &got.1) { Ok(got) } else { Err(format!("still {} {:?}", got.0, got.1)) }
        })
        .await
    }

    /// Waits for the Ready condition's reason (any status).
    pub async fn wait_reason<K>(&self, name: &str, reason: &str) -> Value
    where
        K: NamespacedObject,
    {
        let api = self.api::<K>();
        let found = wait_until(&format!("{name} Ready reason {reason}"), WAIT, || async {
            let v = serde_json::to_value(api.get(name).await?)?;
            let got = v["status"]["conditions"][0]["reason"].as_str().unwrap_or("").to_string();
            Ok((got == reason).then_some(v))
        })
        .await;
        match found {
            Ok(v) => v,
            Err(e) => panic!(
                "{e}; last seen: {:?}",
                api.get(name).await.map(|o| serde_json::to_value(o).unwrap()["status"].clone())
            ),
        }
    }

    /// Deletes what the test made (the operator still running, so the
    /// finalizers complete), stops the operator and deletes the namespace.
    pub async fn finish(self, stop: CancellationToken, task: tokio::task::JoinHandle<()>) {
        let dp = DeleteParams::default();
        let lp = Default::default();
        self.api::<Ingress>().delete_collection(&dp, &lp).await.unwrap();
        for s in self.api::<Service>().list(&lp).await.unwrap() {
            self.api::<Service>().delete(&s.name_any(), &dp).await.unwrap();
        }
        self.api::<Tunnel>().delete_collection(&dp, &lp).await.unwrap();
        self.api::<Domain>().delete_collection(&dp, &lp).await.unwrap();
        self.api::<TcpPort>().delete_collection(&dp, &lp).await.unwrap();
        wait_until("culvert objects finalized", WAIT, || async {
            let left = self.api::<Tunnel>().list(&lp).await?.items.len()
                + self.api::<Domain>().list(&lp).await?.items.len()
                + self.api::<TcpPort>().list(&lp).await?.items.len();
            Ok((left == 0).then_some(()))
        })
        .await
        .unwrap();
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), task).await.expect("operator stops").unwrap();
        let classes = std::mem::take(&mut *self.classes.lock().unwrap());
        for c in classes {
            let _ = Api::<IngressClass>::all(self.client.clone()).delete(&c, &dp).await;
        }
        self.ns.delete_and_wait().await.unwrap();
    }
}

/// An HTTPS backend (HTTP/1.1) in `host` with a certificate for `names` from a
/// test CA; answers `tls <path> sni=<server name>`. Returns the CA (PEM).
pub fn tls_backend(host: &NetnsHost, port: u16, names: &[String]) -> String {
    use rustls_pki_types::pem::PemObject;
    let pki = culvert::tls::generate_pki(names).unwrap();
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pki.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes()).unwrap();
    let mut config =
        rustls::ServerConfig::builder().with_no_client_auth().with_single_cert(certs, key).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = listen_in(host, port);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let sni = tls.get_ref().1.server_name().unwrap_or("none").to_string();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let text = format!("tls {} sni={sni}", req.uri().path());
                    async move { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(text)))) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    pki.ca_pem
}

/// GET `/` over TLS to the edge with SNI `host`, trusting only `ca_pem`
/// (the backend's CA): an answer comes from the backend itself.
pub async fn get_passthrough(f: &Fixture, host: &str, ca_pem: &str) -> Result<String, String> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(f.edge.https).await.map_err(|e| e.to_string())?;
    let name = rustls_pki_types::ServerName::try_from(host.to_string()).unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let (mut s, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::get("/").header("host", host).body(Full::new(Bytes::new())).unwrap();
    let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// An HTTP/2-only backend without TLS (h2c, prior knowledge, as gRPC
/// servers are) on `port` of `host`: answers `h2c <version> <path>`.
pub fn h2c_backend(host: &NetnsHost, port: u16) {
    let listener = listen_in(host, port);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let text = format!("h2c {:?} {}", req.version(), req.uri().path());
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(text))))
                });
                let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
}

/// A TCP listener on `ip:port` inside the network namespace `host`.
pub fn listen_in(host: &NetnsHost, port: u16) -> TcpListener {
    use std::os::fd::AsRawFd;
    let (path, ip) = (format!("/run/netns/{}", host.name), host.ip.clone());
    // setns(2) moves only the calling thread: a short-lived one binds, and the
    // socket stays in the namespace it was made in.
    let listener = std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap();
        // SAFETY: setns on a valid descriptor of a network namespace, on this thread only.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        let l = std::net::TcpListener::bind((ip.as_str(), port)).unwrap();
        l.set_nonblocking(true).unwrap();
        l
    })
    .join()
    .unwrap();
    TcpListener::from_std(listener).unwrap()
}

/// A UDP socket on `ip:port` inside the network namespace `host`.
pub fn udp_in(host: &NetnsHost, port: u16) -> tokio::net::UdpSocket {
    use std::os::fd::AsRawFd;
    let (path, ip) = (format!("/run/netns/{}", host.name), host.ip.clone());
    // As in listen_in: bound on a short-lived thread moved into the namespace.
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
    tokio::net::UdpSocket::from_std(socket).unwrap()
}

/// A Service without selector whose EndpointSlice points at `ip` (ports:
/// (name, service port, target port, protocol)).
pub async fn service_with_endpoints(
    f: &Fixture,
    name: &str,
    ip: &str,
    spec: Value,
    ports: &[(&str, u16, u16, &str)],
) {
    let mut spec = spec;
    spec["ports"] = ports
        .iter()
        .map(|(n, p, t, proto)| json!({"name": n, "port": p, "targetPort": t, "protocol": proto}))
        .collect();
    f.create::<Service>(
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}),
    )
    .await;
    f.create::<EndpointSlice>(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-1"), "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": ports.iter().map(|(n, _, t, proto)| json!({"name": n, "port": t, "protocol": proto})).collect::<Vec<_>>(),
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}]}))
        .await;
}

/// `args` with the operator's admin port (metrics) on a free port of
/// 127.0.0.1, and that address.
pub fn serving_metrics(mut args: OperatorArgs) -> (OperatorArgs, SocketAddr) {
    let port = super::net::free_port_range(1).first;
    args.admin_addr = SocketAddr::from(([127, 0, 0, 1], port));
    let admin = args.admin_addr;
    (args, admin)
}

/// `culvert_operator_object_reconciles_total` of one object, from the
/// operator's `/metrics` on `admin` (0 while it does not answer yet).
pub async fn reconciles(admin: SocketAddr, kind: &str, namespace: &str, name: &str) -> u64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut tcp) = tokio::net::TcpStream::connect(admin).await else { return 0 };
    let request = "GET /metrics HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n";
    let mut text = String::new();
    if tcp.write_all(request.as_bytes()).await.is_err() || tcp.read_to_string(&mut text).await.is_err() {
        return 0;
    }
    let series = format!(
        "culvert_operator_object_reconciles_total{{kind=\"{kind}\",namespace=\"{namespace}\",name=\"{name}\"}} "
    );
    text.lines().find_map(|l| l.strip_prefix(&series)?.trim().parse().ok()).unwrap_or(0)
}
