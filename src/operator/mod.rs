//! The operator: Kubernetes controllers (on the elected leader) that turn
//! `Domain`, `TcpPort` and `Tunnel` objects into reservations and tunnel keys
//! at the edge, and the in-cluster agent (on every replica) that carries the
//! traffic of every ready Tunnel.
//!
//! Phases of each reconcile, in order: observe (read into an `Observed`
//! value) → plan (pure) → execute (edge, then Kubernetes) → status, with
//! events through `status::Ctx`. Everything held at the edge lives behind a
//! finalizer.

pub(crate) mod agents;
pub(crate) mod edge;
pub(crate) mod edge_api;
pub(crate) mod foreign;
pub mod gateway;
pub mod ingress;
pub(crate) mod leader;
pub(crate) mod reservation;
pub(crate) mod routes;
pub(crate) mod service;
pub(crate) mod status;
pub(crate) mod tunnel;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::crd::{Domain, TcpPort, Tunnel, UdpPort};
use edge::EdgeClient;

/// Names used across the operator, defined once.
pub mod names {
    /// Finalizer on Domain, TcpPort, UdpPort and Tunnel: the edge side is released first.
    pub const FINALIZER: &str = "culvert.dev/finalizer";
    /// The one field manager of every server-side apply.
    pub const FIELD_MANAGER: &str = "culvert-operator";
    /// Edge labels (on reservations and tunnel keys) that say who holds them.
    pub const LABEL_CLUSTER: &str = "culvert.dev/cluster";
    pub const LABEL_NAMESPACE: &str = "culvert.dev/namespace";
    pub const LABEL_KIND: &str = "culvert.dev/kind";
    pub const LABEL_NAME: &str = "culvert.dev/name";
    pub const LABEL_UID: &str = "culvert.dev/uid";
    /// Label on the Secrets that hold tunnel keys (value: the Tunnel's name).
    pub const LABEL_TUNNEL: &str = "culvert.dev/tunnel";
    /// Keys of a tunnel key Secret.
    pub const SECRET_KEY: &str = "key";
    pub const SECRET_KEY_ID: &str = "keyId";
    /// The Lease that elects the reconciling replica.
    pub const LEASE: &str = "culvert-operator-leader";
    /// Reporter of events.
    pub const CONTROLLER: &str = "culvert-operator";

    /// `spec.controller` of the IngressClasses culvert serves.
    pub const INGRESS_CONTROLLER: &str = "culvert.dev/ingress-controller";
    /// The IngressClass name the chart creates (also served when no
    /// IngressClass object of that name exists).
    pub const INGRESS_CLASS: &str = "culvert";
    /// IngressClass annotation: this class serves Ingresses without a class.
    pub const DEFAULT_CLASS_ANNOTATION: &str = "ingressclass.kubernetes.io/is-default-class";
    /// The deprecated Ingress annotation that names a class.
    pub const LEGACY_CLASS_ANNOTATION: &str = "kubernetes.io/ingress.class";
    /// `spec.loadBalancerClass` of the Services culvert always manages.
    pub const LOAD_BALANCER_CLASS: &str = "culvert.dev/tunnel";

    /// Service annotation: `"1"` publishes a class-less LoadBalancer Service
    /// (in any namespace); `"0"` leaves it alone under
    /// `--manage-classless-load-balancers`.
    pub const ANNOTATION_MANAGE: &str = "culvert.dev/manage";
    /// Service annotation written by the operator: `servicePort=publicPort,…`.
    pub const ANNOTATION_PUBLIC_PORTS: &str = "culvert.dev/public-ports";
    /// Service annotation: `v1` or `v2` sends a PROXY protocol header to the backend.
    pub const ANNOTATION_PROXY_PROTOCOL: &str = "culvert.dev/proxy-protocol";
    /// Ingress and Service annotation: `Delete` (default) or `Retain` for the
    /// Domains and TcpPorts the operator creates for them.
    pub const ANNOTATION_RECLAIM_POLICY: &str = "culvert.dev/reclaim-policy";
    /// Ingress annotation `"true"`: the hosts are published as TLS passthrough
    /// (by SNI) to one backend that terminates TLS itself.
    pub const ANNOTATION_TLS_PASSTHROUGH: &str = "culvert.dev/tls-passthrough";
    /// Ingress annotations: options of the Ingress's paths (see `HttpOptions`).
    pub const ANNOTATION_BACKEND_PROTOCOL: &str = "culvert.dev/backend-protocol";
    pub const ANNOTATION_BACKEND_TLS_VERIFY: &str = "culvert.dev/backend-tls-verify";
    pub const ANNOTATION_CONNECT_TIMEOUT: &str = "culvert.dev/proxy-connect-timeout";
    pub const ANNOTATION_READ_TIMEOUT: &str = "culvert.dev/proxy-read-timeout";
    pub const ANNOTATION_BODY_SIZE: &str = "culvert.dev/proxy-body-size";
    pub const ANNOTATION_AUTH_SECRET: &str = "culvert.dev/auth-secret";
    /// On Tunnels and Domains made for an Ingress: the host they serve.
    pub const ANNOTATION_HOST: &str = "culvert.dev/host";
    /// On objects the operator makes for an Ingress or a Service: `ingress` or `service`.
    pub const LABEL_MANAGED_BY: &str = "culvert.dev/managed-by";
    /// On objects made for a Service: the Service's uid.
    pub const LABEL_OWNER_UID: &str = "culvert.dev/owner-uid";
}

/// What the operator does when an Ingress host has no Domain in its namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DomainPolicy {
    /// Create a Domain owned by the Ingress (released with it, unless the
    /// Ingress is annotated `culvert.dev/reclaim-policy: Retain`).
    Auto,
    /// The host is not published until a Domain of the namespace covers it.
    Require,
}

/// How agents reach a Tunnel's Service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendAddress {
    /// The Service's ClusterIP and port (needs kube-proxy or an equivalent; every
    /// ordinary cluster has one).
    ClusterIp,
    /// The ready endpoints of the Service (EndpointSlices), dialed directly.
    Endpoints,
}

/// `culvert operator` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct OperatorArgs {
    /// The edge's URL, e.g. https://edge.example.com. Several edges (sharing
    /// one store): repeat the flag or separate URLs with commas; agents keep a
    /// connection to each, API calls go to the first that answers at start.
    #[arg(long, env = "CULVERT_EDGE", value_delimiter = ',', required = true)]
    pub edge: Vec<String>,
    /// An API key of scope `endpoints` (it cannot carry traffic). Prefer
    /// --api-key-file or the environment: a flag is visible to every local user.
    #[arg(
        long,
        env = "CULVERT_API_KEY",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true
    )]
    pub api_key: String,
    /// Read the API key from this file (a mounted Secret); wins over --api-key.
    #[arg(long, env = "CULVERT_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Trust this PEM CA instead of the built-in Mozilla roots.
    #[arg(long, env = "CULVERT_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// The cipher the tunnels' TLS offers first: `auto` (AES-128-GCM on a
    /// CPU with AES instructions, ChaCha20-Poly1305 on one without, such
    /// as a Raspberry Pi 3 or 4), `aes-128-gcm` or `chacha20-poly1305`.
    #[arg(long, env = "CULVERT_TUNNEL_CIPHER", value_enum, default_value_t)]
    pub tunnel_cipher: crate::tls::TunnelCipher,
    /// Namespace of the leader election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "culvert-system")]
    pub namespace: String,
    /// This replica's identity in the election (the pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// How often every object is checked against the edge (re-creates
    /// reservations deleted out-of-band), in seconds.
    #[arg(long, env = "CULVERT_RESYNC_SECONDS", default_value_t = 300)]
    pub resync_seconds: u64,
    /// Lease duration of the leader election, in seconds.
    #[arg(long, env = "CULVERT_LEASE_SECONDS", default_value_t = 15)]
    pub lease_seconds: u64,
    /// How agents reach backends.
    #[arg(long, env = "CULVERT_BACKEND_ADDRESS", value_enum, default_value_t = BackendAddress::ClusterIp)]
    pub backend_address: BackendAddress,
    /// Metrics, /healthz and /readyz.
    #[arg(long, env = "CULVERT_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    pub admin_addr: SocketAddr,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "CULVERT_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// Also publish every LoadBalancer Service without a loadBalancerClass
    /// (the inlets-operator behaviour), unless annotated `culvert.dev/manage:
    /// "0"`; never in kube-system unless annotated `"1"`. Off: only class
    /// `culvert.dev/tunnel` and the annotated `"1"`.
    #[arg(
        long,
        env = "CULVERT_MANAGE_CLASSLESS_LOAD_BALANCERS",
        value_parser = clap::builder::BoolishValueParser::new(),
        conflicts_with = "annotated_only"
    )]
    pub manage_classless_load_balancers: bool,
    /// Deprecated no-op: managing only class `culvert.dev/tunnel` and the
    /// annotated is now the default.
    #[arg(long, env = "CULVERT_ANNOTATED_ONLY", hide = true, value_parser = clap::builder::BoolishValueParser::new())]
    pub annotated_only: bool,
    /// An Ingress host without a Domain in its namespace: create one (`auto`)
    /// or wait for one (`require`).
    #[arg(long, env = "CULVERT_DOMAIN_POLICY", value_enum, default_value_t = DomainPolicy::Auto)]
    pub domain_policy: DomainPolicy,
}

/// Why a reconcile failed; the category labels metrics and event reasons.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API call failed: {0}")]
    Kube(#[from] kube::Error),
    #[error("edge API call failed: {0}")]
    Edge(#[from] crate::api_client::ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Waiting(String),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl Error {
    pub fn category(&self) -> &'static str {
        match self {
            Error::Kube(_) => "KubeApiError",
            Error::Edge(_) => "EdgeApiError",
            Error::Invalid(_) => "InvalidSpec",
            Error::Conflict(_) => "Conflict",
            Error::Waiting(_) => "Waiting",
            Error::Finalizer(e) => match &**e {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.category(),
                _ => "FinalizerError",
            },
        }
    }
}

impl Error {
    /// A race with a deletion, not a failure: the object (or one this
    /// reconcile writes, or the reservation at the edge it refers to) is
    /// already gone (404), or it is being deleted
    /// (`deleting`) and changed under us (409, 422). The deletion's own watch
    /// event brings the next reconcile.
    pub fn is_deletion_race(&self, deleting: bool) -> bool {
        use kube::runtime::finalizer::Error as F;
        let code = |e: &kube::Error| match e {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        };
        let code = match self {
            Error::Kube(e) => code(e),
            // The edge no longer has what the object refers to (a Domain or
            // TcpPort released a moment ago); the status says so if it lasts.
            Error::Edge(crate::api_client::ClientError::Refused { status, .. }) => Some(*status),
            Error::Finalizer(f) => match &**f {
                F::ApplyFailed(e) | F::CleanupFailed(e) => return e.is_deletion_race(deleting),
                F::AddFinalizer(e) | F::RemoveFinalizer(e) => code(e),
                _ => None,
            },
            _ => None,
        };
        match code {
            Some(404) => true,
            Some(409 | 422) => deleting,
            _ => false,
        }
    }
}

/// Logs a failed reconcile of a `kind` object: a warning, except for a race
/// with its deletion (debug: nothing is wrong, and the next event retries).
pub fn log_failure(kind: &str, meta: &kube::api::ObjectMeta, e: &Error) {
    let name = meta.name.as_deref().unwrap_or_default();
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    if e.is_deletion_race(meta.deletion_timestamp.is_some()) {
        tracing::debug!(kind, namespace, name, error = %e, "reconcile raced with a deletion; retrying");
    } else {
        warn!(kind, namespace, name, error = %e, category = e.category(), "reconcile failed; retrying");
    }
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub edge: EdgeClient,
    /// The uid of the `kube-system` namespace: this cluster's id at the edge.
    pub cluster_id: String,
    pub resync: Duration,
    pub backend_address: BackendAddress,
    pub recorder: Recorder,
    pub metrics: status::Metrics,
    /// The edge's base domain: the CNAME target of custom domains.
    pub edge_domain: String,
    /// Only this namespace is watched, when set.
    pub watch_namespace: Option<String>,
    /// What the edge said about itself at start (domain, TCP range, public host).
    pub edge_info: crate::api::Info,
    /// `--manage-classless-load-balancers`.
    pub manage_classless: bool,
    pub domain_policy: DomainPolicy,
}

impl Context {
    /// An API over every watched namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        watched(&self.client, self.watch_namespace.as_deref())
    }
}

/// An API over `namespace`, or over all namespaces.
pub fn watched<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Fails with a one-line fix when the CRDs are not installed.
async fn check_crds(client: &Client, namespace: Option<&str>) -> Result<(), String> {
    let lp = kube::api::ListParams::default().limit(1);
    for (kind, res) in [
        ("Domain", watched::<Domain>(client, namespace).list(&lp).await.map(|_| ())),
        ("TcpPort", watched::<TcpPort>(client, namespace).list(&lp).await.map(|_| ())),
        ("UdpPort", watched::<UdpPort>(client, namespace).list(&lp).await.map(|_| ())),
        ("Tunnel", watched::<Tunnel>(client, namespace).list(&lp).await.map(|_| ())),
    ] {
        if let Err(kube::Error::Api(e)) = &res
            && e.code == 404
        {
            return Err(format!(
                "the {kind} CRD is not installed: run `culvert crd | kubectl apply -f -` (or install the Helm chart)"
            ));
        }
        res.map_err(|e| format!("cannot list {kind} objects: {e}"))?;
    }
    Ok(())
}

/// Where the operator runs: in a pod its advice names the chart's values,
/// elsewhere the flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Pod,
    Shell,
}

impl Place {
    /// A pod: Kubernetes sets `KUBERNETES_SERVICE_HOST` in every container.
    pub fn detect() -> Place {
        match std::env::var_os("KUBERNETES_SERVICE_HOST") {
            Some(v) if !v.is_empty() => Place::Pod,
            _ => Place::Shell,
        }
    }
}

/// Why the operator cannot use the edge at `edge` and what to do about it,
/// for the real cause (the network, TLS, the key), in the words of `place`.
pub fn edge_start_error(e: &crate::api_client::ClientError, edge: &str, place: Place) -> String {
    use crate::api_client::ClientError as E;
    let (url, ca, key, proxy) = match place {
        Place::Pod => (
            "the chart value edge.url or edge.urls (or the edge-url key of the credentials Secret)",
            "the chart value edge.caBundle",
            "the credentials Secret (chart value credentials.existingSecret, or credentials.apiKey)",
            "the chart value proxy.httpsProxy",
        ),
        Place::Shell => (
            "--edge (CULVERT_EDGE)",
            "--ca-file (CULVERT_CA_FILE)",
            "--api-key (CULVERT_API_KEY)",
            "HTTPS_PROXY",
        ),
    };
    let make_key = "`culvert admin api-key create --name operator --scope endpoints` on the edge";
    match e {
        E::Connect { source, .. } if crate::api_client::is_tls_error(source) => format!(
            "the edge at {edge} has a certificate the operator does not trust ({source}): for an edge \
             started with --self-signed or a private CA, give its CA certificate (the edge's DATA_DIR/ca.pem) \
             in {ca}; a public edge needs a certificate for the host name of {url}"
        ),
        E::Connect { source, .. } => format!(
            "cannot reach the edge at {edge} ({source}): check {url}, that its host name resolves from here, \
             and that no firewall between here and the edge blocks its HTTPS port; behind an outbound \
             proxy, set {proxy}"
        ),
        E::Refused { status: 401, message, .. } => format!(
            "the edge at {edge} does not accept the operator's API key ({message}): make one with {make_key} \
             and put it in {key}"
        ),
        E::Refused { status: 403, message, .. } => format!(
            "the edge at {edge} refused the operator's API key ({message}): the operator needs a key of scope \
             endpoints, made with {make_key}, in {key}"
        ),
        E::Refused { .. } | E::UnexpectedAnswer { .. } => {
            format!("{e}: is {url} the URL of a culvert edge (and of the same culvert version)?")
        }
        E::CaFile(err) => {
            format!("cannot load the edge's CA certificate ({err}): {ca} must hold PEM certificates")
        }
        E::BadEdge(_) | E::PlainHttp(_) => format!("{e}: set {url}"),
    }
}

/// Why the Kubernetes API cannot be used, in the words of `place`.
fn kube_start_error(e: &dyn std::fmt::Display, place: Place) -> String {
    match place {
        Place::Pod => format!(
            "cannot reach the Kubernetes API from the pod ({e}): the ServiceAccount token must be mounted \
             (automountServiceAccountToken) and egress to the API server allowed (NetworkPolicy)"
        ),
        Place::Shell => format!("cannot reach the Kubernetes API ({e}): set KUBECONFIG, or run in a pod"),
    }
}

/// `culvert operator`: runs until SIGINT/SIGTERM.
pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    tokio::spawn(crate::shutdown_on_signal(shutdown.clone()));
    let client =
        Client::try_default().await.map_err(|e| anyhow::anyhow!(kube_start_error(&e, Place::detect())))?;
    start(client, args, shutdown).await
}

/// The control API of every edge of `--edge` (edges share one store, any
/// of them will do: calls fail over to the next when one does not answer),
/// checked on the first that answers; the error of the first when none does.
async fn first_answering_edge(
    args: &OperatorArgs,
    place: Place,
) -> anyhow::Result<(EdgeClient, crate::api::Info, String)> {
    let edges = crate::agent::EdgeSet::parse(&args.edge).map_err(|e| anyhow::anyhow!("{e}"))?;
    let api_key =
        crate::secret::key_from(Some(&args.api_key), args.api_key_file.as_deref(), "--api-key-file")?
            .ok_or_else(|| {
                anyhow::anyhow!("no API key given: pass --api-key-file FILE or set CULVERT_API_KEY")
            })?;
    let bases: Vec<String> = edges.urls().iter().map(|u| format!("https://{}", u.authority())).collect();
    let client = EdgeClient::with_edges(&bases, &api_key, args.ca_file.as_deref())
        .map_err(|e| anyhow::anyhow!(edge_start_error(&e, &bases[0], place)))?;
    match client.check().await {
        Ok(info) => {
            let base = client.current_edge();
            Ok((client, info, base))
        }
        Err(e) => Err(anyhow::anyhow!(edge_start_error(&e, &bases[0], place))),
    }
}

/// Runs the operator with `client` until `shutdown` (tests call this directly).
pub async fn start(client: Client, args: OperatorArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    check_crds(&client, args.watch_namespace.as_deref()).await.map_err(anyhow::Error::msg)?;
    let place = Place::detect();
    let (edge, info, api_url) = first_answering_edge(&args, place).await?;
    let cluster_id = Api::<Namespace>::all(client.clone())
        .get("kube-system")
        .await?
        .metadata
        .uid
        .ok_or_else(|| anyhow::anyhow!("the kube-system namespace has no uid"))?;
    let identity = args.identity.clone().unwrap_or_else(|| format!("culvert-{}", crate::agent::agent_id()));
    info!(edge = %api_url, edges = %args.edge.join(","), domain = %info.domain, cluster = %cluster_id, %identity, "operator starting");
    if args.annotated_only {
        warn!(
            "--annotated-only (CULVERT_ANNOTATED_ONLY, chart value annotatedOnly) is deprecated and does \
             nothing: publishing only LoadBalancer Services of class culvert.dev/tunnel or annotated \
             culvert.dev/manage: \"1\" is now the default; remove it"
        );
    }

    let metrics = status::Metrics::default();
    let ctx = Arc::new(Context {
        recorder: Recorder::new(
            client.clone(),
            Reporter { controller: names::CONTROLLER.into(), instance: Some(identity.clone()) },
        ),
        client: client.clone(),
        edge,
        cluster_id,
        resync: Duration::from_secs(args.resync_seconds.max(1)),
        backend_address: args.backend_address,
        metrics: metrics.clone(),
        edge_domain: info.domain.clone(),
        watch_namespace: args.watch_namespace.clone(),
        edge_info: info.clone(),
        manage_classless: args.manage_classless_load_balancers,
        domain_policy: args.domain_policy,
    });

    let admin = tokio::net::TcpListener::bind(args.admin_addr).await?;
    tokio::spawn(status::serve_admin(admin, metrics.clone(), shutdown.clone()));

    // Every replica carries traffic.
    let agents = tokio::spawn(agents::run(client.clone(), args.clone(), metrics.clone(), shutdown.clone()));

    // One replica reconciles.
    let elector = leader::Elector::new(
        client.clone(),
        &args.namespace,
        identity,
        Duration::from_secs(args.lease_seconds.max(2)),
    );
    loop {
        tokio::select! {
            _ = elector.acquire() => {}
            _ = shutdown.cancelled() => break,
        }
        info!("elected leader: reconciling");
        metrics.set_leader(true);
        let term = shutdown.child_token();
        let lost = elector.hold(term.clone());
        if let Err(e) = reservation::revoke_orphans(&ctx).await {
            warn!(error = %e, "failed to revoke keys of objects deleted while the operator was down");
        }
        tokio::select! {
            _ = controllers(ctx.clone(), term.clone()) => {}
            _ = lost => warn!("lost the leader lease; stopping the controllers"),
            _ = shutdown.cancelled() => {}
        }
        term.cancel();
        metrics.set_leader(false);
        elector.release().await;
    }
    if let Err(e) = agents.await {
        error!(error = %e, "agent task failed");
    }
    Ok(())
}

async fn controllers(ctx: Arc<Context>, stop: CancellationToken) {
    tokio::join!(
        reservation::run_domains(ctx.clone(), stop.clone()),
        reservation::run_tcp_ports(ctx.clone(), stop.clone()),
        reservation::run_udp_ports(ctx.clone(), stop.clone()),
        tunnel::run(ctx.clone(), stop.clone()),
        ingress::run(ctx.clone(), stop.clone()),
        service::run(ctx.clone(), stop.clone()),
        gateway::run(ctx.clone(), stop.clone()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(kube::core::Status::failure("x", "y").with_code(code).boxed())
    }

    #[test]
    fn start_up_errors_say_what_to_do_where_the_operator_runs() {
        use crate::api_client::ClientError as E;
        let refused = |status: u16| E::Refused { status, code: "x".into(), message: "no such key".into() };
        let tls_error = || E::Connect {
            url: "https://edge.example.com/v1/info".into(),
            source: Box::new(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)),
            hint: "",
        };
        let unreachable = || E::Connect {
            url: "https://edge.example.com/v1/info".into(),
            source: Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
            hint: "",
        };
        // (error, place, what the message must name, what it must not)
        let table: Vec<(E, Place, &[&str], &[&str])> = vec![
            (tls_error(), Place::Pod, &["does not trust", "edge.caBundle", "ca.pem"], &["--ca-file"]),
            (tls_error(), Place::Shell, &["does not trust", "--ca-file"], &["edge.caBundle"]),
            (
                unreachable(),
                Place::Pod,
                &["cannot reach", "firewall", "edge.url", "proxy.httpsProxy"],
                &["trust"],
            ),
            (
                unreachable(),
                Place::Shell,
                &["cannot reach", "firewall", "--edge", "HTTPS_PROXY"],
                &["edge.url"],
            ),
            (
                refused(401),
                Place::Pod,
                &["does not accept", "credentials.existingSecret", "--scope endpoints"],
                &["--api-key"],
            ),
            (refused(401), Place::Shell, &["does not accept", "--api-key"], &["credentials."]),
            (refused(403), Place::Pod, &["scope", "endpoints", "credentials.existingSecret"], &[]),
            (refused(500), Place::Pod, &["URL of a culvert edge", "edge.url"], &[]),
            (E::BadEdge("edge".into()), Place::Pod, &["edge.url"], &[]),
        ];
        for (e, place, must, must_not) in table {
            let m = edge_start_error(&e, "https://edge.example.com", place);
            for part in must {
                assert!(m.contains(part), "{place:?} {e:?}: `{part}` missing in: {m}");
            }
            for part in must_not {
                assert!(!m.contains(part), "{place:?} {e:?}: `{part}` in: {m}");
            }
        }
        assert!(kube_start_error(&"x", Place::Pod).contains("automountServiceAccountToken"));
        assert!(kube_start_error(&"x", Place::Shell).contains("KUBECONFIG"));
    }

    #[test]
    fn deletion_races_are_not_failures() {
        use kube::runtime::finalizer::Error as F;
        let fin = |e: F<Error>| Error::Finalizer(Box::new(e));
        // (error, being deleted, a race?)
        let table = [
            (Error::Kube(api(404)), false, true),
            (Error::Kube(api(404)), true, true),
            (Error::Kube(api(409)), true, true),
            (Error::Kube(api(409)), false, false),
            (Error::Kube(api(422)), true, true),
            (Error::Kube(api(500)), true, false),
            (Error::Kube(api(403)), false, false),
            (
                Error::Edge(crate::api_client::ClientError::Refused {
                    status: 404,
                    code: "not_found".into(),
                    message: "gone".into(),
                }),
                false,
                true,
            ),
            (
                Error::Edge(crate::api_client::ClientError::Refused {
                    status: 401,
                    code: "unknown_key".into(),
                    message: "no".into(),
                }),
                false,
                false,
            ),
            (
                fin(F::ApplyFailed(Error::Edge(crate::api_client::ClientError::Refused {
                    status: 404,
                    code: "not_found".into(),
                    message: "gone".into(),
                }))),
                false,
                true,
            ),
            (fin(F::ApplyFailed(Error::Kube(api(404)))), false, true),
            (fin(F::CleanupFailed(Error::Kube(api(500)))), true, false),
            (fin(F::AddFinalizer(api(422))), true, true),
            (fin(F::RemoveFinalizer(api(404))), true, true),
            (fin(F::UnnamedObject), true, false),
            (Error::Invalid("bad".into()), true, false),
            (Error::Waiting("later".into()), false, false),
        ];
        for (e, deleting, race) in table {
            assert_eq!(e.is_deletion_race(deleting), race, "{e} (deleting: {deleting})");
        }
    }
}
