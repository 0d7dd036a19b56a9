//! The Tunnel controller: validates the Tunnel against its namespace (the
//! Service, the Domain, TcpPort or UdpPort), resolves the backend addresses, mints one
//! tunnel key per Tunnel into a Secret it owns, and revokes the key behind a
//! finalizer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::edge_api::{Collection, EdgeApi};
use super::names::{FIELD_MANAGER, LABEL_TUNNEL, LABEL_UID, SECRET_KEY, SECRET_KEY_ID};
use super::reservation::{dns_label, labels_of};
use super::status::{
    Ctx, Note, apply_status, carry_transition, condition, failure, reconcile_finalized, retry_soon,
    since_transition,
};
use super::{BackendAddress, Context, Error};
use crate::agent::guard;
use crate::api::{CreateTunnelKeyRequest, Protocol, TunnelKey};
use crate::crd::{
    Condition, Domain, HttpOptions, ResolvedRoute, RouteFilterType, ServiceRef, TcpPort, Tunnel,
    TunnelProtocol, TunnelRoute, TunnelStatus, UdpPort, WeightedBackends,
};

/// Name of the Secret holding a Tunnel's key.
pub fn secret_name(tunnel: &str) -> String {
    format!("{tunnel}-culvert-key")
}

/// Name of the Secret holding a copy of the credentials the Tunnel's routes
/// ask for (`culvert.dev/auth-secret`), where the agents read them.
pub fn auth_secret_name(tunnel: &str) -> String {
    format!("{tunnel}-culvert-auth")
}

/// Keys of an auth copy: `<secret>.auth` and `<secret>.token`.
pub fn auth_copy_key(secret: &str, key: &str) -> String {
    format!("{secret}.{key}")
}

/// What a ready Tunnel resolved to.
struct Resolved {
    url: String,
    backends: Vec<String>,
    routes: Vec<ResolvedRoute>,
    /// Routes (or the default backend of routes) that cannot be served.
    problems: Vec<String>,
    agents: u32,
}

fn dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(dns_label)
}

/// Validate: the spec alone, without a client.
pub fn validate(t: &Tunnel) -> Result<(), Error> {
    for svc in t.spec.services() {
        if !dns_label(svc) {
            return Err(Error::Invalid(format!(
                "service `{svc}` must be the name of a Service in this namespace: \
                 IP addresses, host names and other namespaces are not allowed"
            )));
        }
    }
    if t.spec.service.is_none() && t.spec.routes.is_empty() {
        return Err(Error::Invalid("spec.service is required (or spec.routes, for http)".into()));
    }
    if !t.spec.routes.is_empty() && t.spec.protocol != TunnelProtocol::Http {
        return Err(Error::Invalid("spec.routes apply to protocol http only".into()));
    }
    if let Some(r) = t.spec.routes.iter().find(|r| !r.path.starts_with('/')) {
        return Err(Error::Invalid(format!("route path `{}` must start with /", r.path)));
    }
    let options = std::iter::once(("spec.options".to_string(), &t.spec.options))
        .chain(t.spec.routes.iter().map(|r| (format!("route {} options", r.path), &r.options)));
    for (what, o) in options {
        if !o.is_default() && t.spec.protocol != TunnelProtocol::Http {
            return Err(Error::Invalid(format!("{what} apply to protocol http only")));
        }
        if let Some(size) = &o.max_body_size {
            guard::parse_size(size).map_err(|e| Error::Invalid(format!("{what}: maxBodySize {e}")))?;
        }
        if let Some(name) = &o.auth_secret
            && !dns_subdomain(name)
        {
            return Err(Error::Invalid(format!(
                "{what}: authSecret `{name}` must be the name of a Secret in this namespace"
            )));
        }
    }
    match (t.spec.protocol, &t.spec.domain, &t.spec.tcp_port, &t.spec.udp_port) {
        (TunnelProtocol::Http | TunnelProtocol::Tls, Some(_), None, None)
        | (TunnelProtocol::Tcp, None, Some(_), None)
        | (TunnelProtocol::Udp, None, None, Some(_)) => Ok(()),
        (TunnelProtocol::Tls, ..) => Err(Error::Invalid(
            "protocol tls (passthrough) needs spec.domain (a Domain of this namespace) and no tcpPort or udpPort"
                .into(),
        )),
        (TunnelProtocol::Http, ..) => Err(Error::Invalid(
            "protocol http needs spec.domain (a Domain of this namespace) and no tcpPort or udpPort".into(),
        )),
        (TunnelProtocol::Tcp, ..) => Err(Error::Invalid(
            "protocol tcp needs spec.tcpPort (a TcpPort of this namespace) and no domain or udpPort".into(),
        )),
        (TunnelProtocol::Udp, ..) => Err(Error::Invalid(
            "protocol udp needs spec.udpPort (a UdpPort of this namespace) and no domain or tcpPort".into(),
        )),
    }
    .and_then(|()| match (t.spec.protocol, t.spec.proxy_protocol) {
        (TunnelProtocol::Http, Some(_)) => {
            Err(Error::Invalid("proxyProtocol applies to tcp, tls and udp only".into()))
        }
        (TunnelProtocol::Udp, Some(crate::crd::ProxyProtocol::V1)) => Err(Error::Invalid(
            "PROXY protocol v1 has no UDP form: use proxyProtocol v2 (a header before every datagram)".into(),
        )),
        _ => Ok(()),
    })
}

/// The wire protocol of a Tunnel's protocol.
pub fn wire_protocol(p: TunnelProtocol) -> Protocol {
    match p {
        TunnelProtocol::Http => Protocol::Http,
        TunnelProtocol::Tcp => Protocol::Tcp,
        TunnelProtocol::Tls => Protocol::Tls,
        TunnelProtocol::Udp => Protocol::Udp,
    }
}

/// The reservation a Tunnel publishes on, as its Domain, TcpPort or UdpPort says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Publish {
    /// The Domain's host name.
    Domain(String),
    /// The TcpPort's (protocol tcp) or UdpPort's (udp) port.
    Port(u16),
}

/// The reservation (`domain` host name or TCP port) the Tunnel publishes on.
async fn publish(t: &Tunnel, ctx: &Context, ns: &str) -> Result<Publish, Error> {
    let not_ready = |kind: &str, name: &str| {
        Error::Waiting(format!(
            "{kind} {name} of this namespace is not ready yet (see `kubectl describe {} {name}`)",
            kind.to_lowercase()
        ))
    };
    if let Some(name) = &t.spec.domain {
        let d = Api::<Domain>::namespaced(ctx.client.clone(), ns).get_opt(name).await?.ok_or_else(|| {
            Error::Waiting(format!("no Domain {name} in this namespace: create one (a Tunnel may only use its own namespace's Domains)"))
        })?;
        let status = d.status.unwrap_or_default();
        let Some(host) = status.hostname else {
            // What the Domain says (e.g. that the edge's admin must allow the key the default host).
            let why = status.conditions.iter().find(|c| c.type_ == "Ready" && c.status == "False");
            return Err(match why {
                Some(c) => {
                    Error::Waiting(format!("Domain {name} of this namespace is not ready: {}", c.message))
                }
                None => not_ready("Domain", name),
            });
        };
        return Ok(Publish::Domain(host));
    }
    let (kind, name, status) = if t.spec.protocol == TunnelProtocol::Udp {
        let name = t.spec.udp_port.clone().unwrap_or_default();
        let p = Api::<UdpPort>::namespaced(ctx.client.clone(), ns).get_opt(&name).await?;
        ("UdpPort", name, p.map(|p| p.status))
    } else {
        let name = t.spec.tcp_port.clone().unwrap_or_default();
        let p = Api::<TcpPort>::namespaced(ctx.client.clone(), ns).get_opt(&name).await?;
        ("TcpPort", name, p.map(|p| p.status))
    };
    let status = status.ok_or_else(|| {
        Error::Waiting(format!("no {kind} {name} in this namespace: create one (a Tunnel may only use its own namespace's {kind}s)"))
    })?;
    let port = status.and_then(|s| s.port).ok_or_else(|| not_ready(kind, &name))?;
    Ok(Publish::Port(port))
}

/// The addresses agents dial for a Service port.
/// The Service port's protocol must be the Tunnel's transport (`UDP` for
/// protocol udp, `TCP` or absent otherwise): a Service with DNS on TCP 53
/// and UDP 53 has two ports of that number.
async fn backends(svc_ref: &ServiceRef, ctx: &Context, ns: &str, udp: bool) -> Result<Vec<String>, Error> {
    let transport = if udp { "UDP" } else { "TCP" };
    let of_transport = |p: &Option<String>| p.as_deref().unwrap_or("TCP") == transport;
    let name = &svc_ref.name;
    let svc = Api::<Service>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await?
        .ok_or_else(|| Error::Waiting(format!("Service {name} not found in this namespace")))?;
    let spec = svc.spec.unwrap_or_default();
    if spec.type_.as_deref() == Some("ExternalName") {
        return Err(Error::Invalid(format!(
            "Service {name} is of type ExternalName: culvert only sends traffic to Services backed by this cluster"
        )));
    }
    let ports = spec.ports.unwrap_or_default();
    let port = ports
        .iter()
        .find(|p| {
            of_transport(&p.protocol)
                && match &svc_ref.port {
                    IntOrString::Int(n) => p.port == *n,
                    IntOrString::String(s) => p.name.as_deref() == Some(s.as_str()),
                }
        })
        .ok_or_else(|| {
            let port = match &svc_ref.port {
                IntOrString::Int(n) => n.to_string(),
                IntOrString::String(s) => s.clone(),
            };
            Error::Invalid(format!("Service {name} has no {transport} port {port}"))
        })?;
    let headless = spec.cluster_ip.as_deref().is_none_or(|ip| ip == "None" || ip.is_empty());
    if ctx.backend_address == BackendAddress::ClusterIp && !headless {
        let ip = spec.cluster_ip.unwrap_or_default();
        let ip = if ip.contains(':') { format!("[{ip}]") } else { ip };
        return Ok(vec![format!("{ip}:{}", port.port)]);
    }
    let slices = Api::<EndpointSlice>::namespaced(ctx.client.clone(), ns)
        .list(&kube::api::ListParams::default().labels(&format!("kubernetes.io/service-name={name}")))
        .await?;
    let mut out = Vec::new();
    for slice in slices.items {
        let target = slice
            .ports
            .unwrap_or_default()
            .iter()
            .find(|p| of_transport(&p.protocol) && (p.name == port.name || slice_single(&p.name, &port.name)))
            .and_then(|p| p.port);
        let Some(target) = target else { continue };
        for ep in slice.endpoints.unwrap_or_default() {
            if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for a in ep.addresses {
                out.push(if a.contains(':') { format!("[{a}]:{target}") } else { format!("{a}:{target}") });
            }
        }
    }
    out.sort();
    out.dedup();
    if out.is_empty() {
        return Err(Error::Waiting(format!("Service {name} has no ready endpoints")));
    }
    Ok(out)
}

fn slice_single(a: &Option<String>, b: &Option<String>) -> bool {
    a.as_deref().unwrap_or("").is_empty() && b.as_deref().unwrap_or("").is_empty()
}

/// What a Tunnel reconcile read, in Kubernetes and at the edge. Only the
/// reads that fail for Kubernetes or the edge fail [`observe`]; what the
/// user can fix (a missing Service, no endpoints) is kept for [`plan`].
#[derive(Debug)]
pub struct Observed {
    /// What the Tunnel's Domain or TcpPort holds.
    pub publish: Result<Publish, Error>,
    /// The backends of each of `spec.routes`' `service`, in order (none
    /// without a `service`).
    pub routes: Vec<Result<Vec<String>, Error>>,
    /// The backends of each of `spec.routes`' weighted `backends`, in order.
    pub weighted: Vec<Vec<Result<Vec<String>, Error>>>,
    /// The backends of `spec.service`.
    pub default: Option<Result<Vec<String>, Error>>,
    pub auth: Auth,
    /// The key the Tunnel's Secret names, as the edge knows it (`None`: no
    /// Secret, no key id in it, or no such key at the edge).
    pub key: Option<TunnelKey>,
}

/// Keeps what the user can fix, fails on the rest.
fn user_fixable<T>(r: Result<T, Error>) -> Result<Result<T, Error>, Error> {
    match r {
        Err(e @ (Error::Invalid(_) | Error::Waiting(_) | Error::Conflict(_))) => Ok(Err(e)),
        Err(e) => Err(e),
        Ok(v) => Ok(Ok(v)),
    }
}

/// Reads everything a (valid) Tunnel refers to.
async fn observe<E: EdgeApi>(edge: &E, t: &Tunnel, ctx: &Context) -> Result<Observed, Error> {
    let ns = t.namespace().unwrap_or_default();
    let publish = user_fixable(publish(t, ctx, &ns).await)?;
    let (mut routes, mut weighted) = (Vec::new(), Vec::new());
    for r in &t.spec.routes {
        routes.push(match &r.service {
            Some(s) => user_fixable(backends(s, ctx, &ns, false).await)?,
            None => Ok(Vec::new()),
        });
        let mut shares = Vec::new();
        for b in &r.backends {
            let s = ServiceRef { name: b.name.clone(), port: b.port.clone() };
            let found = match b.namespace.as_deref().filter(|other| *other != ns) {
                // Refused by the Gateway API controller: this share answers 500.
                _ if b.refused.is_some() => Err(Error::Invalid(b.refused.clone().unwrap_or_default())),
                None => backends(&s, ctx, &ns, false).await,
                Some(other) => match granted_or_routed(ctx, &ns, other, &b.name).await {
                    Ok(true) => backends(&s, ctx, other, false).await.map_err(|e| match e {
                        Error::Waiting(m) | Error::Invalid(m) => {
                            Error::Waiting(m.replace("in this namespace", &format!("in namespace {other}")))
                        }
                        e => e,
                    }),
                    Ok(false) => Err(Error::Invalid(format!(
                        "Service {other}/{}: a Service of another namespace needs a ReferenceGrant in \
                         namespace {other} from Gateway API routes of namespace {ns} to it",
                        b.name
                    ))),
                    Err(e) => Err(e),
                },
            };
            shares.push(user_fixable(found)?);
        }
        weighted.push(shares);
    }
    let default = match &t.spec.service {
        Some(s) => Some(user_fixable(backends(s, ctx, &ns, t.spec.protocol == TunnelProtocol::Udp).await)?),
        None => None,
    };
    let auth = auth_credentials(t, ctx, &ns).await?;
    let secret =
        Api::<Secret>::namespaced(ctx.client.clone(), &ns).get_opt(&secret_name(&t.name_any())).await?;
    let key_id = secret
        .as_ref()
        .and_then(|s| s.data.as_ref())
        .and_then(|d| d.get(SECRET_KEY_ID))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned());
    let key = match &key_id {
        Some(id) => edge.tunnel_key(id).await?,
        None => None,
    };
    Ok(Observed { publish, routes, weighted, default, auth, key })
}

/// What to do about the Tunnel's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyAction {
    /// The key is live and publishes what the Tunnel asks.
    Keep(TunnelKey),
    /// Revoke the key the Secret names (if any), mint one with this request.
    Mint { revoke: Option<String>, request: CreateTunnelKeyRequest },
}

/// What a ready Tunnel needs: its key, the agents' copy of credentials, and
/// what it resolved to.
#[derive(Debug, Clone)]
pub struct Plan {
    pub key: KeyAction,
    /// The agents' copy of the credentials the routes ask for.
    pub auth_copy: BTreeMap<String, ByteString>,
    pub backends: Vec<String>,
    pub routes: Vec<ResolvedRoute>,
    /// Routes (or the default backend of routes) that cannot be served.
    pub problems: Vec<String>,
}

/// May a Tunnel of `ns` send to Service `name` of namespace `other`: a
/// ReferenceGrant of `other` lets routes of `ns` refer to it, or a route of
/// `other` itself sends to it through a Gateway of `ns` (the default host's
/// Tunnel carries such routes; see ARCHITECTURE.md).
async fn granted_or_routed(ctx: &Context, ns: &str, other: &str, name: &str) -> Result<bool, Error> {
    if reference_granted(ctx, ns, other, name).await? {
        return Ok(true);
    }
    routed_by_a_route_of(ctx, other, ns, name).await
}

/// Does an HTTPRoute or GRPCRoute of `route_ns` attach to a Gateway of
/// `gateway_ns` and send to its own Service `name`? Without the Gateway API
/// CRDs (or the right to read them): no.
async fn routed_by_a_route_of(
    ctx: &Context,
    route_ns: &str,
    gateway_ns: &str,
    name: &str,
) -> Result<bool, Error> {
    const KINDS: [(&str, &str); 2] = [("HTTPRoute", "httproutes"), ("GRPCRoute", "grpcroutes")];
    for (kind, plural) in KINDS {
        let ar = kube::api::ApiResource {
            group: "gateway.networking.k8s.io".into(),
            version: "v1".into(),
            api_version: "gateway.networking.k8s.io/v1".into(),
            kind: kind.to_string(),
            plural: plural.to_string(),
        };
        let api = Api::<kube::api::DynamicObject>::namespaced_with(ctx.client.clone(), route_ns, &ar);
        match api.list(&Default::default()).await {
            Ok(list) => {
                if list.items.iter().any(|r| routes_to(&r.data, route_ns, gateway_ns, name)) {
                    return Ok(true);
                }
            }
            Err(kube::Error::Api(s)) if matches!(s.code, 403 | 404) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}

/// Does a route of `route_ns` (its JSON) name a Gateway of `gateway_ns` as
/// parent and Service `name` of its own namespace as a backend?
fn routes_to(route: &serde_json::Value, route_ns: &str, gateway_ns: &str, name: &str) -> bool {
    let list = |v: &serde_json::Value| v.as_array().cloned().unwrap_or_default();
    let parent = list(&route["spec"]["parentRefs"]).iter().any(|p| {
        p["group"].as_str().unwrap_or("gateway.networking.k8s.io") == "gateway.networking.k8s.io"
            && p["kind"].as_str().unwrap_or("Gateway") == "Gateway"
            && p["namespace"].as_str().unwrap_or(route_ns) == gateway_ns
    });
    parent
        && list(&route["spec"]["rules"]).iter().any(|rule| {
            list(&rule["backendRefs"]).iter().any(|b| {
                b["group"].as_str().unwrap_or("").is_empty()
                    && b["kind"].as_str().unwrap_or("Service") == "Service"
                    && b["namespace"].as_str().unwrap_or(route_ns) == route_ns
                    && b["name"] == name
            })
        })
}

/// Does a ReferenceGrant of namespace `to_ns` let Gateway API routes
/// (HTTPRoute, GRPCRoute) of `from_ns` refer to Service `name`? Without the
/// Gateway API CRDs (or the right to read them): no.
async fn reference_granted(ctx: &Context, from_ns: &str, to_ns: &str, name: &str) -> Result<bool, Error> {
    let ar = kube::api::ApiResource {
        group: "gateway.networking.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "gateway.networking.k8s.io/v1beta1".into(),
        kind: "ReferenceGrant".into(),
        plural: "referencegrants".into(),
    };
    let api = Api::<kube::api::DynamicObject>::namespaced_with(ctx.client.clone(), to_ns, &ar);
    match api.list(&Default::default()).await {
        Ok(list) => Ok(list.items.iter().any(|g| grants(&g.data, from_ns, name))),
        Err(kube::Error::Api(s)) if matches!(s.code, 403 | 404) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Does a ReferenceGrant's content (`spec.from`, `spec.to`) let Gateway API
/// routes of `from_ns` refer to Service `name`?
fn grants(grant: &serde_json::Value, from_ns: &str, name: &str) -> bool {
    let list = |k: &str| grant["spec"][k].as_array().cloned().unwrap_or_default();
    let from = list("from").iter().any(|f| {
        f["group"] == "gateway.networking.k8s.io"
            && (f["kind"] == "HTTPRoute" || f["kind"] == "GRPCRoute")
            && f["namespace"] == from_ns
    });
    let to = list("to").iter().any(|t| {
        t["group"].as_str().unwrap_or("").is_empty()
            && t["kind"] == "Service"
            && t["name"].as_str().is_none_or(|n| n == name)
    });
    from && to
}

/// The most a route's weight may be (as Gateway API's).
const MAX_WEIGHT: u32 = 1_000_000;

/// What is wrong with a route's backends, matches or filters (they compile
/// as the agents compile them).
fn check_route(r: &TunnelRoute) -> Result<(), String> {
    if r.service.is_some() && !r.backends.is_empty() {
        return Err("give service or backends, not both".into());
    }
    if let Some(n) = r.backends.iter().filter_map(|b| b.namespace.as_deref()).find(|n| !dns_label(n)) {
        return Err(format!("backend namespace `{n}` is not a namespace name"));
    }
    if let Some(b) = r.backends.iter().find(|b| b.weight > MAX_WEIGHT) {
        return Err(format!("backend {}: weight {} is more than {MAX_WEIGHT}", b.name, b.weight));
    }
    super::routes::Conditions::compile(r.method.as_deref(), &r.headers, &r.query_params)?
        .with_hosts(&r.hosts)?;
    let filters = crate::agent::filters::Filters::compile(&r.filters, &r.path, r.path_type)
        .map_err(|e| format!("filters: {e}"))?;
    if filters.redirect.is_some() && (r.service.is_some() || !r.backends.is_empty()) {
        return Err(
            "a RequestRedirect route is answered by the redirect: remove its service and backends".into()
        );
    }
    Ok(())
}

/// Decides, without IO, what the Tunnel needs from what was observed.
pub fn plan(t: &Tunnel, cluster_id: &str, o: Observed) -> Result<Plan, Error> {
    validate(t)?;
    let publish = o.publish?;
    // With routes, one unusable Service degrades its path only.
    let mut problems = Vec::new();
    let mut degrade = |what: String, r: Result<Vec<String>, Error>| match r {
        Err(e @ (Error::Invalid(_) | Error::Waiting(_))) => {
            problems.push(format!("{what}: {e}"));
            Ok(Vec::new())
        }
        r => r,
    };
    // A route whose credentials cannot be had is not served (never open).
    let failed = &o.auth.failed;
    let guarded = |options: &HttpOptions, found: Result<Vec<String>, Error>| match options
        .auth_secret
        .as_ref()
        .and_then(|n| failed.get(n))
    {
        Some(why) => Err(Error::Invalid(why.clone())),
        None => found,
    };
    let mut routes = Vec::new();
    let mut weighted = o.weighted.into_iter();
    for (r, found) in t.spec.routes.iter().zip(o.routes) {
        let what = format!("route {}", r.path);
        let shares = weighted.next().unwrap_or_default();
        // A route that does not make sense is left out (Gateway API drops an invalid rule).
        if let Err(e) = check_route(r) {
            degrade(what, Err(Error::Invalid(e)))?;
            continue;
        }
        let denied = r.options.auth_secret.as_ref().and_then(|n| failed.get(n)).cloned();
        if let Some(why) = &denied {
            degrade(what.clone(), Err(Error::Invalid(why.clone())))?;
        }
        let b =
            if denied.is_some() || r.service.is_none() { Vec::new() } else { degrade(what.clone(), found)? };
        let mut weighted = Vec::new();
        for (w, found) in
            r.backends.iter().zip(shares.into_iter().chain(std::iter::repeat_with(|| Ok(Vec::new()))))
        {
            let backends = if denied.is_some() {
                Vec::new()
            } else {
                degrade(format!("{what}: backend {}", w.name), found)?
            };
            weighted.push(WeightedBackends { weight: w.weight, backends });
        }
        let redirects = r.filters.iter().any(|f| f.type_ == RouteFilterType::RequestRedirect);
        if r.service.is_none() && r.backends.is_empty() && !redirects {
            // No backend at all: one empty share, so every request answers 500 (Gateway API).
            weighted.push(WeightedBackends { weight: 1, backends: Vec::new() });
        }
        routes.push(ResolvedRoute {
            path: r.path.clone(),
            path_type: r.path_type,
            backends: b,
            weighted,
            method: r.method.clone(),
            headers: r.headers.clone(),
            query_params: r.query_params.clone(),
            hosts: r.hosts.clone(),
            filters: r.filters.clone(),
            options: r.options.clone(),
        });
    }
    let default = o.default.map(|found| guarded(&t.spec.options, found));
    let backends = match default {
        Some(found) if t.spec.routes.is_empty() => found?,
        Some(found) => degrade("default backend".into(), found)?,
        None => Vec::new(),
    };
    let protocol = wire_protocol(t.spec.protocol);
    let live = o.key.as_ref().filter(|key| {
        let same = match &publish {
            Publish::Domain(host) => key.reservation.hostname.as_deref() == Some(host.as_str()),
            Publish::Port(port) => key.reservation.port == Some(*port),
        };
        key.revoked_at.is_none() && same && key.protocol == protocol
    });
    let key = match live {
        Some(key) => KeyAction::Keep(key.clone()),
        None => {
            let mut labels = labels_of(cluster_id, "Tunnel", t);
            labels.insert(LABEL_UID.into(), t.uid().unwrap_or_default());
            let (domain, port) = match publish {
                Publish::Domain(host) => (Some(host), None),
                Publish::Port(port) => (None, Some(port)),
            };
            KeyAction::Mint {
                revoke: o.key.as_ref().map(|k| k.id.clone()),
                request: CreateTunnelKeyRequest { domain, port, protocol: Some(protocol), labels },
            }
        }
    };
    Ok(Plan { key, auth_copy: o.auth.copy, backends, routes, problems })
}

/// What the edge part of [`execute`] did.
#[derive(Debug, Clone)]
pub struct Executed {
    pub key: TunnelKey,
    /// The secret of a key minted now, for the Tunnel's Secret.
    pub minted: Option<String>,
    /// The public URL of the key's reservation.
    pub url: String,
}

/// The edge part of a plan: revoke a stale key, mint a new one, learn the URL.
pub async fn execute_edge<E: EdgeApi>(edge: &E, key: &KeyAction) -> Result<Executed, Error> {
    let (key, minted) = match key {
        KeyAction::Keep(key) => (key.clone(), None),
        KeyAction::Mint { revoke, request } => {
            if let Some(id) = revoke {
                edge.revoke_tunnel_key(id).await?;
            }
            let created = edge.create_tunnel_key(request).await?;
            (created.key, Some(created.secret))
        }
    };
    let at = match (&key.reservation.hostname, key.reservation.port) {
        (_, Some(port)) if key.protocol == Protocol::Udp => Some((Collection::UdpPorts, port.to_string())),
        (_, Some(port)) => Some((Collection::Ports, port.to_string())),
        (Some(host), None) => Some((Collection::Domains, host.clone())),
        (None, None) => None,
    };
    let url = match at {
        Some((collection, k)) => {
            edge.reservation(collection, &k).await?.and_then(|r| r.url).unwrap_or_default()
        }
        None => String::new(),
    };
    Ok(Executed { key, minted, url })
}

/// Carries out a plan: the edge first, then Kubernetes (the key's Secret,
/// the agents' copy of credentials); the caller writes the status.
async fn execute(t: &Tunnel, ctx: &Context, plan: Plan) -> Result<Resolved, Error> {
    let ns = t.namespace().unwrap_or_default();
    let done = execute_edge(&ctx.edge, &plan.key).await?;
    if let Some(secret) = done.minted {
        let name = secret_name(&t.name_any());
        let data = BTreeMap::from([
            (SECRET_KEY.into(), ByteString(secret.into_bytes())),
            (SECRET_KEY_ID.into(), ByteString(done.key.id.clone().into_bytes())),
        ]);
        let secret = tunnel_secret(t, &name, &ns, data);
        Api::<Secret>::namespaced(ctx.client.clone(), &ns)
            .patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&secret))
            .await?;
        info!(key = %done.key.id, secret = %name, "minted a tunnel key");
    }
    apply_auth_copy(t, ctx, &ns, &plan.auth_copy, false).await?;
    Ok(Resolved {
        url: done.url,
        backends: plan.backends,
        routes: plan.routes,
        problems: plan.problems,
        agents: done.key.connections as u32,
    })
}

async fn resolve(t: &Tunnel, ctx: &Context) -> Result<Resolved, Error> {
    validate(t)?;
    let observed = observe(&ctx.edge, t, ctx).await?;
    let plan = plan(t, &ctx.cluster_id, observed)?;
    execute(t, ctx, plan).await
}

/// The credentials the Tunnel's options ask for: the data to copy for the
/// agents, and why the others cannot be used.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    pub copy: BTreeMap<String, ByteString>,
    pub failed: BTreeMap<String, String>,
}

async fn auth_credentials(t: &Tunnel, ctx: &Context, ns: &str) -> Result<Auth, Error> {
    let mut out = Auth::default();
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    let names: std::collections::BTreeSet<&str> = t.spec.auth_secrets().collect();
    for name in names {
        let Some(secret) = secrets.get_opt(name).await? else {
            out.failed.insert(
                name.into(),
                format!("auth Secret {name} not found in this namespace: create it with `{}` (htpasswd lines) or `{}` (bearer tokens)", guard::AUTH_KEY, guard::TOKEN_KEY),
            );
            continue;
        };
        let data = secret.data.unwrap_or_default();
        let text = |k: &str| data.get(k).map(|b| String::from_utf8_lossy(&b.0).into_owned());
        let (auth, token) = (text(guard::AUTH_KEY), text(guard::TOKEN_KEY));
        match guard::Credentials::parse(auth.as_deref(), token.as_deref()) {
            Ok(_) => {
                for (key, value) in [(guard::AUTH_KEY, auth), (guard::TOKEN_KEY, token)] {
                    if let Some(v) = value {
                        out.copy.insert(auth_copy_key(name, key), ByteString(v.into_bytes()));
                    }
                }
            }
            Err(e) => {
                out.failed.insert(name.into(), format!("auth Secret {name}: {e}"));
            }
        }
    }
    Ok(out)
}

/// Keeps the agents' copy of the credentials (a Secret owned by the Tunnel,
/// labelled like its key Secret) equal to `data`, before the status that
/// names them is written.
async fn apply_auth_copy(
    t: &Tunnel,
    ctx: &Context,
    ns: &str,
    data: &BTreeMap<String, ByteString>,
    even_empty: bool,
) -> Result<(), Error> {
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), ns);
    let name = auth_secret_name(&t.name_any());
    if data.is_empty() && !even_empty {
        // Removed after the status no longer names credentials (see `remove_auth_copy`).
        return Ok(());
    }
    let secret = tunnel_secret(t, &name, ns, data.clone());
    secrets.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&secret)).await?;
    Ok(())
}

/// Empties the agents' copy of the credentials once the status written last
/// (`old`) named some and the new one (`new`) names none, so agents never
/// see a guarded route without its credentials. (Emptied, not deleted: the
/// operator has no `delete` on Secrets; the garbage collector removes it with
/// the Tunnel.)
async fn remove_auth_copy(
    t: &Tunnel,
    ctx: &Context,
    old: &TunnelStatus,
    new: &TunnelStatus,
) -> Result<(), Error> {
    let guarded = |s: &TunnelStatus| {
        s.options.auth_secret.is_some() || s.routes.iter().any(|r| r.options.auth_secret.is_some())
    };
    if !guarded(old) || guarded(new) {
        return Ok(());
    }
    apply_auth_copy(t, ctx, &t.namespace().unwrap_or_default(), &BTreeMap::new(), true).await?;
    info!(secret = %auth_secret_name(&t.name_any()), "no route asks for credentials any more: emptied their copy");
    Ok(())
}

/// Condition types of a Tunnel, besides `Ready` (published and connected).
pub const PUBLISHED: &str = "Published";
pub const CONNECTED: &str = "Connected";

/// What to do about a Tunnel with no agent connected.
pub const NO_AGENT_HINT: &str = "the culvert operator's pods carry the traffic: their logs \
    (`kubectl logs`) say why their tunnel does not connect: the edge's URL not reachable from the \
    cluster (a firewall, a proxy: chart value proxy.httpsProxy), the edge's certificate not trusted \
    (chart value edge.caBundle), or the key revoked at the edge";

/// The outcome of a reconcile as the conditions see it.
pub enum Outcome {
    /// Published at `url`: reason `Published` or `Degraded`, with a message.
    Published { url: String, reason: &'static str, message: String, agents: u32 },
    /// Not published: the reason and what to do.
    Failed { reason: String, message: String },
}

/// `Published`, `Connected` and `Ready` (first: what the Ingress and Service
/// controllers and `kubectl wait --for=condition=Ready` read): Ready only
/// when published *and* an agent is connected at the edge.
pub fn tunnel_conditions(outcome: &Outcome, generation: Option<i64>) -> Vec<Condition> {
    let c = |t: &str, s: &str, r: &str, m: String| condition(t, s, r, m, generation);
    match outcome {
        Outcome::Failed { reason, message } => vec![
            c("Ready", "False", reason, message.clone()),
            c(PUBLISHED, "False", reason, message.clone()),
            c(
                CONNECTED,
                "Unknown",
                "NotPublished",
                "no agent can connect before the Tunnel is published".into(),
            ),
        ],
        Outcome::Published { url, reason, message, agents: 0 } => vec![
            c(
                "Ready",
                "False",
                "NoAgent",
                format!(
                    "{url} is published but no agent is connected at the edge (it answers 502): {NO_AGENT_HINT}"
                ),
            ),
            c(PUBLISHED, "True", reason, message.clone()),
            c(CONNECTED, "False", "NoAgent", format!("no agent is connected at the edge: {NO_AGENT_HINT}")),
        ],
        Outcome::Published { reason, message, agents, .. } => {
            let connected = format!("{agents} agent(s) connected at the edge");
            vec![
                c("Ready", "True", reason, format!("{message} ({connected})")),
                c(PUBLISHED, "True", reason, message.clone()),
                c(CONNECTED, "True", "AgentsConnected", connected),
            ]
        }
    }
}

/// `status.loadBalancer.ingress[].ports[].error` (Service and Ingress) of a
/// port whose Tunnel has no agent connected at the edge.
pub const PORT_ERROR_NO_AGENT: &str = "culvert.dev/NoAgent";

fn condition_is_true(conditions: &[Condition], type_: &str) -> Option<bool> {
    conditions.iter().find(|c| c.type_ == type_).map(|c| c.status == "True")
}

/// Is the Tunnel published (its address assigned, its key live)? A status
/// written before `Published` existed has only `Ready`.
pub fn is_published(conditions: &[Condition]) -> bool {
    condition_is_true(conditions, PUBLISHED)
        .or_else(|| condition_is_true(conditions, "Ready"))
        .unwrap_or(false)
}

/// Is an agent connected at the edge (as last seen)?
pub fn is_connected(conditions: &[Condition]) -> bool {
    condition_is_true(conditions, CONNECTED)
        .or_else(|| condition_is_true(conditions, "Ready"))
        .unwrap_or(false)
}

/// When to look at the edge again while no agent is connected, `since` the
/// Connected condition changed: at once at first (an agent connects within a
/// second of a new key), then less often.
pub fn unconnected_recheck(since: Duration) -> Duration {
    match since.as_secs() {
        0..30 => Duration::from_secs(1),
        30..300 => Duration::from_secs(5),
        _ => Duration::from_secs(30),
    }
}

/// How often a connected Tunnel is checked at the edge (at least once a
/// minute, so a lost agent shows).
const CONNECTED_RECHECK: Duration = Duration::from_secs(60);

async fn apply(t: Arc<Tunnel>, reporter: &Ctx) -> Result<Action, Error> {
    let ctx = &*reporter.base;
    let api: Api<Tunnel> = Api::namespaced(ctx.client.clone(), &t.namespace().unwrap_or_default());
    let outcome = resolve(&t, ctx).await;
    let generation = t.meta().generation;
    let old = t.status.clone().unwrap_or_default();
    let mut status = TunnelStatus {
        observed_generation: generation,
        key_secret: Some(secret_name(&t.name_any())),
        ..Default::default()
    };
    let found = match &outcome {
        Ok(r) => {
            status.url = Some(r.url.clone());
            status.backends = r.backends.clone();
            status.routes = r.routes.clone();
            status.options =
                if t.spec.service.is_some() { t.spec.options.clone() } else { Default::default() };
            status.agents = r.agents;
            let to = if r.routes.is_empty() {
                r.backends.join(", ")
            } else {
                format!("{} route(s)", r.routes.len())
            };
            let published = format!("{} → {to}", r.url);
            let (reason, message) = if r.problems.is_empty() {
                ("Published", published)
            } else {
                // Still serving the other paths.
                ("Degraded", format!("{published}; {}", r.problems.join("; ")))
            };
            Outcome::Published { url: r.url.clone(), reason, message, agents: r.agents }
        }
        Err(e) => {
            let (reason, message) = failure(e);
            Outcome::Failed { reason: reason.into(), message }
        }
    };
    // A transient failure keeps the last good data path running (and the
    // agents that carry it: `Published` stays as it was).
    let transient = matches!(outcome, Err(Error::Edge(_) | Error::Kube(_)));
    if transient {
        status.url = old.url.clone();
        status.backends = old.backends.clone();
        status.routes = old.routes.clone();
        status.options = old.options.clone();
        status.agents = old.agents;
    }
    let mut conditions = tunnel_conditions(&found, generation);
    if transient && let Some(published) = old.conditions.iter().find(|c| c.type_ == PUBLISHED) {
        conditions[1] = published.clone();
    }
    let changed: Vec<bool> = conditions.iter_mut().map(|c| carry_transition(c, &old.conditions)).collect();
    let ready = conditions[0].clone();
    let connected_since = conditions.iter().find(|c| c.type_ == CONNECTED).map(since_transition);
    // A Tunnel waiting for its agent is not a warning (it takes a second);
    // the condition says what to check when it lasts.
    let warning = (ready.status != "True" && ready.reason != "NoAgent") || ready.reason == "Degraded";
    status.conditions = conditions;
    apply_status(&api, &*t, &status).await?;
    remove_auth_copy(&t, ctx, &old, &status).await?;
    if changed[0] {
        reporter.event(&*t, &Note::new(warning, ready.reason, ready.message)).await;
    }
    match outcome {
        Ok(r) if r.agents == 0 => {
            Ok(Action::requeue(unconnected_recheck(connected_since.unwrap_or_default()).min(ctx.resync)))
        }
        Ok(_) => Ok(Action::requeue(ctx.resync.min(CONNECTED_RECHECK))),
        Err(Error::Invalid(_) | Error::Conflict(_)) => Ok(Action::requeue(ctx.resync)),
        Err(Error::Waiting(_)) => Ok(Action::requeue(ctx.resync.min(Duration::from_secs(30)))),
        Err(e) => Err(e),
    }
}

async fn cleanup(t: Arc<Tunnel>, ctx: &Context) -> Result<Action, Error> {
    let selector = format!("{LABEL_UID}={}", t.uid().unwrap_or_default());
    for key in ctx.edge.tunnel_keys(&selector).await? {
        ctx.edge.revoke_tunnel_key(&key.id).await?;
        info!(key = %key.id, "revoked the Tunnel's key");
    }
    Ok(Action::await_change())
}

async fn reconcile(t: Arc<Tunnel>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    reconcile_finalized("Tunnel", t, &ctx.base, |o| apply(o, &ctx), |o| cleanup(o, &ctx.base)).await
}

fn error_policy(obj: Arc<Tunnel>, e: &Error, _ctx: Arc<Ctx>) -> Action {
    retry_soon("Tunnel", &*obj, e)
}

pub async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let ns = ctx.watch_namespace.clone();
    let client = ctx.client.clone();
    let ns = ns.as_deref();
    let mut controller =
        Controller::new(super::watched::<Tunnel>(&client, ns), watcher::Config::default().any_semantic());
    // Services of other namespaces (weighted backends a ReferenceGrant
    // allows): the watches below see them without --watch-namespace; with
    // it, their own watches.
    if let Some(watched) = ns {
        controller =
            controller.reconcile_on(super::foreign::triggers(client.clone(), watched.into(), stop.clone()));
    }
    let store = controller.store();
    // Tunnels that use a changed Service (of their namespace or another).
    let users = {
        let store = store.clone();
        move |ns: Option<String>, name: String| {
            let ns = ns.unwrap_or_default();
            store
                .state()
                .into_iter()
                .filter(|t| super::foreign::uses_service(t, &ns, &name))
                .map(|t| ObjectRef::from_obj(&*t))
                .collect::<Vec<_>>()
        }
    };
    let users2 = users.clone();
    // Tunnels that refer to a changed object of their namespace.
    let refs = move |ns: Option<String>, pick: Box<dyn Fn(&Tunnel) -> bool + Send>| {
        store
            .state()
            .into_iter()
            .filter(|t| t.namespace() == ns && pick(t))
            .map(|t| ObjectRef::from_obj(&*t))
            .collect::<Vec<_>>()
    };
    let (r3, r4, r5, r6) = (refs.clone(), refs.clone(), refs.clone(), refs);
    controller
        .owns(super::watched::<Secret>(&client, ns), watcher::Config::default().labels(LABEL_TUNNEL))
        .watches(super::watched::<Service>(&client, ns), watcher::Config::default(), move |s: Service| {
            users(s.namespace(), s.name_any())
        })
        .watches(
            super::watched::<EndpointSlice>(&client, ns),
            watcher::Config::default().labels("kubernetes.io/service-name"),
            move |e: EndpointSlice| {
                users2(
                    e.namespace(),
                    e.labels().get("kubernetes.io/service-name").cloned().unwrap_or_default(),
                )
            },
        )
        .watches(super::watched::<Domain>(&client, ns), watcher::Config::default(), move |d: Domain| {
            let name = d.name_any();
            r3(d.namespace(), Box::new(move |t| t.spec.domain.as_deref() == Some(&name)))
        })
        .watches(super::watched::<TcpPort>(&client, ns), watcher::Config::default(), move |p: TcpPort| {
            let name = p.name_any();
            r4(p.namespace(), Box::new(move |t| t.spec.tcp_port.as_deref() == Some(&name)))
        })
        .watches(super::watched::<UdpPort>(&client, ns), watcher::Config::default(), move |p: UdpPort| {
            let name = p.name_any();
            r6(p.namespace(), Box::new(move |t| t.spec.udp_port.as_deref() == Some(&name)))
        })
        // An auth Secret a route names changed.
        .watches(super::watched::<Secret>(&client, ns), watcher::Config::default(), move |s: Secret| {
            let name = s.name_any();
            r5(s.namespace(), Box::new(move |t| t.spec.auth_secrets().any(|a| a == name)))
        })
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(reconcile, error_policy, Ctx::new(ctx))
        .for_each(|_| async {})
        .await;
}

/// A Secret of the Tunnel's own: owned by it (garbage-collected with it) and
/// labelled with its name, which is what the agents watch.
fn tunnel_secret(t: &Tunnel, name: &str, ns: &str, data: BTreeMap<String, ByteString>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some(BTreeMap::from([(LABEL_TUNNEL.into(), t.name_any())])),
            owner_references: t.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tunnel(spec: serde_json::Value) -> Tunnel {
        Tunnel::new("t", serde_json::from_value(spec).unwrap())
    }

    #[test]
    fn validation_rejects_what_isolation_forbids() {
        let ok = tunnel(json!({"service": {"name": "web", "port": 80}, "domain": "web"}));
        assert!(validate(&ok).is_ok());
        let routes_only = tunnel(json!({"routes": [{"path": "/api", "pathType": "Exact",
            "service": {"name": "api", "port": "http"}}], "domain": "web"}));
        assert!(validate(&routes_only).is_ok());
        for (spec, needle) in [
            (json!({"service": {"name": "10.0.0.1", "port": 80}, "domain": "d"}), "IP addresses"),
            (json!({"service": {"name": "web.other-ns", "port": 80}, "domain": "d"}), "other namespaces"),
            (json!({"service": {"name": "example.com", "port": 80}, "domain": "d"}), "host names"),
            (json!({"service": {"name": "web", "port": 80}}), "needs spec.domain"),
            (
                json!({"service": {"name": "web", "port": 80}, "protocol": "tcp", "domain": "d"}),
                "needs spec.tcpPort",
            ),
            (
                json!({"service": {"name": "web", "port": 80}, "domain": "d", "proxyProtocol": "v1"}),
                "tcp, tls and udp only",
            ),
            (
                json!({"service": {"name": "dns", "port": 53}, "protocol": "udp", "udpPort": "p", "proxyProtocol": "v1"}),
                "v1 has no UDP form",
            ),
            (
                json!({"service": {"name": "dns", "port": 53}, "protocol": "udp", "tcpPort": "p"}),
                "protocol udp needs spec.udpPort",
            ),
            (
                json!({"service": {"name": "dns", "port": 53}, "protocol": "tcp", "tcpPort": "p", "udpPort": "q"}),
                "no domain or udpPort",
            ),
            (json!({"domain": "d"}), "spec.service is required"),
            (
                json!({"routes": [{"path": "/", "service": {"name": "a.b", "port": 80}}], "domain": "d"}),
                "other namespaces",
            ),
            (
                json!({"routes": [{"path": "x", "service": {"name": "a", "port": 80}}], "domain": "d"}),
                "must start with /",
            ),
            (
                json!({"routes": [{"path": "/", "service": {"name": "a", "port": 80}}], "protocol": "tcp", "tcpPort": "p"}),
                "http only",
            ),
            (
                json!({"service": {"name": "a", "port": 80}, "protocol": "tcp", "tcpPort": "p",
                    "options": {"readTimeoutSeconds": 5}}),
                "apply to protocol http only",
            ),
            (
                json!({"routes": [{"path": "/", "service": {"name": "a", "port": 80},
                    "options": {"authSecret": "Other/Ns"}}], "domain": "d"}),
                "must be the name of a Secret",
            ),
            (
                json!({"service": {"name": "a", "port": 80}, "domain": "d", "options": {"maxBodySize": "10x"}}),
                "maxBodySize",
            ),
        ] {
            let err = validate(&tunnel(spec.clone())).unwrap_err().to_string();
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }

    fn by_type<'a>(cs: &'a [Condition], t: &str) -> (&'a str, &'a str, &'a str) {
        let c = cs.iter().find(|c| c.type_ == t).unwrap_or_else(|| panic!("no {t} in {cs:?}"));
        (c.status.as_str(), c.reason.as_str(), c.message.as_str())
    }

    #[test]
    fn ready_only_when_published_and_connected() {
        let published = |agents| Outcome::Published {
            url: "https://web.example.com".into(),
            reason: "Published",
            message: "https://web.example.com → 10.0.0.1:80".into(),
            agents,
        };
        // (outcome, Ready, Published, Connected) as (status, reason).
        let table = [
            (published(0), ("False", "NoAgent"), ("True", "Published"), ("False", "NoAgent")),
            (published(2), ("True", "Published"), ("True", "Published"), ("True", "AgentsConnected")),
            (
                Outcome::Published { url: "u".into(), reason: "Degraded", message: "m".into(), agents: 1 },
                ("True", "Degraded"),
                ("True", "Degraded"),
                ("True", "AgentsConnected"),
            ),
            (
                Outcome::Failed { reason: "Waiting".into(), message: "Domain web is not ready".into() },
                ("False", "Waiting"),
                ("False", "Waiting"),
                ("Unknown", "NotPublished"),
            ),
        ];
        for (outcome, ready, publ, conn) in table {
            let cs = tunnel_conditions(&outcome, Some(3));
            assert_eq!(cs[0].type_, "Ready", "Ready comes first");
            assert!(cs.iter().all(|c| c.observed_generation == Some(3)));
            for (t, want) in [("Ready", ready), (PUBLISHED, publ), (CONNECTED, conn)] {
                let (status, reason, _) = by_type(&cs, t);
                assert_eq!((status, reason), want, "{t}");
            }
        }
        let cs = tunnel_conditions(&published(0), None);
        let (_, _, message) = by_type(&cs, "Ready");
        assert!(
            message.contains("https://web.example.com") && message.contains("edge.caBundle"),
            "{message}"
        );
        let cs = tunnel_conditions(&published(2), None);
        assert!(by_type(&cs, "Ready").2.contains("2 agent(s) connected"));
    }

    fn observed(publish: Result<Publish, Error>, key: Option<TunnelKey>) -> Observed {
        Observed {
            publish,
            routes: Vec::new(),
            weighted: Vec::new(),
            default: Some(Ok(vec!["10.0.0.1:80".into()])),
            auth: Auth::default(),
            key,
        }
    }

    fn key(id: &str, host: Option<&str>, port: Option<u16>, protocol: Protocol, revoked: bool) -> TunnelKey {
        serde_json::from_value(json!({
            "id": id, "protocol": protocol, "createdAt": "2026-12-01T00:00:00Z",
            "reservation": {"id": "rs_1", "kind": "subdomain", "hostname": host, "port": port},
            "revokedAt": revoked.then_some("2026-12-01T00:00:01Z"), "connections": 2,
        }))
        .unwrap()
    }

    /// A plan's key action in words: `keep tk_1`, `mint web.edge.test http revoking tk_1`.
    fn key_words(p: &Plan) -> String {
        match &p.key {
            KeyAction::Keep(k) => format!("keep {}", k.id),
            KeyAction::Mint { revoke, request } => {
                let target =
                    request.domain.clone().or(request.port.map(|p| p.to_string())).unwrap_or_default();
                let protocol = request.protocol.map(|p| p.as_str()).unwrap_or("?");
                let revoking = revoke.as_ref().map(|id| format!(" revoking {id}")).unwrap_or_default();
                format!("mint {target} {protocol}{revoking}")
            }
        }
    }

    #[test]
    fn plans_keep_a_live_key_and_mint_otherwise() {
        let mut http = tunnel(json!({"service": {"name": "web", "port": 80}, "domain": "web"}));
        http.metadata.namespace = Some("shop".into());
        http.metadata.uid = Some("u1".into());
        let tls =
            tunnel(json!({"service": {"name": "web", "port": 443}, "domain": "web", "protocol": "tls"}));
        let tcp =
            tunnel(json!({"service": {"name": "db", "port": 5432}, "protocol": "tcp", "tcpPort": "db"}));
        let host = || Ok(Publish::Domain("web.edge.test".into()));
        let live = key("tk_1", Some("web.edge.test"), None, Protocol::Http, false);
        // (tunnel, observed, key action)
        let table = [
            (&http, observed(host(), None), "mint web.edge.test http"),
            (&http, observed(host(), Some(live.clone())), "keep tk_1"),
            (
                &http,
                observed(host(), Some(key("tk_1", Some("web.edge.test"), None, Protocol::Http, true))),
                "mint web.edge.test http revoking tk_1",
            ),
            // The Domain now names another host: a key for the new one.
            (
                &http,
                observed(Ok(Publish::Domain("shop.edge.test".into())), Some(live.clone())),
                "mint shop.edge.test http revoking tk_1",
            ),
            // The protocol changed (http to tls passthrough).
            (&tls, observed(host(), Some(live.clone())), "mint web.edge.test tls revoking tk_1"),
            (&tcp, observed(Ok(Publish::Port(20001)), None), "mint 20001 tcp"),
            (
                &tcp,
                observed(
                    Ok(Publish::Port(20001)),
                    Some(key("tk_2", None, Some(20001), Protocol::Tcp, false)),
                ),
                "keep tk_2",
            ),
            (
                &tcp,
                observed(
                    Ok(Publish::Port(20002)),
                    Some(key("tk_2", None, Some(20001), Protocol::Tcp, false)),
                ),
                "mint 20002 tcp revoking tk_2",
            ),
        ];
        for (t, o, want) in table {
            let p = plan(t, "c1", o).unwrap();
            assert_eq!(key_words(&p), want);
            assert_eq!(p.backends, ["10.0.0.1:80"]);
        }
        let KeyAction::Mint { request, .. } = plan(&http, "c1", observed(host(), None)).unwrap().key else {
            panic!("no key minted")
        };
        assert_eq!(request.labels[LABEL_UID], "u1");
        assert_eq!(request.labels[super::super::names::LABEL_NAMESPACE], "shop");
        assert_eq!(request.labels[super::super::names::LABEL_CLUSTER], "c1");
    }

    #[test]
    fn a_route_of_the_services_namespace_lets_its_gateways_namespace_reach_it() {
        let route = |parent: serde_json::Value, backend: serde_json::Value| json!({"spec": {"parentRefs": [parent], "rules": [{"backendRefs": [backend]}]}});
        let to_infra = json!({"name": "edge", "namespace": "infra"});
        let web = json!({"name": "web", "port": 80});
        assert!(routes_to(&route(to_infra.clone(), web.clone()), "apps", "infra", "web"));
        assert!(!routes_to(&route(to_infra.clone(), web.clone()), "apps", "infra", "db"), "another Service");
        assert!(
            !routes_to(&route(json!({"name": "edge"}), web.clone()), "apps", "infra", "web"),
            "a Gateway of its own namespace"
        );
        assert!(
            !routes_to(
                &route(to_infra.clone(), json!({"name": "web", "namespace": "x", "port": 80})),
                "apps",
                "infra",
                "web"
            ),
            "a Service of a third namespace"
        );
        assert!(!routes_to(
            &route(json!({"name": "edge", "namespace": "infra", "kind": "Service"}), web),
            "apps",
            "infra",
            "web"
        ));
        assert!(!routes_to(&json!({}), "apps", "infra", "web"));
    }

    #[test]
    fn reference_grants_let_routes_of_a_namespace_reach_a_service() {
        let grant =
            |from: serde_json::Value, to: serde_json::Value| json!({"spec": {"from": [from], "to": [to]}});
        let http_from_web =
            json!({"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "web"});
        let svc = |name: Option<&str>| json!({"group": "", "kind": "Service", "name": name});
        assert!(grants(&grant(http_from_web.clone(), svc(Some("api"))), "web", "api"));
        assert!(grants(&grant(http_from_web.clone(), svc(None)), "web", "any"), "no name: every Service");
        assert!(!grants(&grant(http_from_web.clone(), svc(Some("api"))), "web", "db"), "another Service");
        assert!(!grants(&grant(http_from_web.clone(), svc(Some("api"))), "shop", "api"), "another namespace");
        let grpc = json!({"group": "gateway.networking.k8s.io", "kind": "GRPCRoute", "namespace": "web"});
        assert!(grants(&grant(grpc, svc(Some("api"))), "web", "api"));
        let gateway = json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "web"});
        assert!(!grants(&grant(gateway, svc(Some("api"))), "web", "api"), "a Gateway's grant is for Secrets");
        let secret = json!({"group": "", "kind": "Secret", "name": "api"});
        assert!(!grants(&grant(http_from_web, secret), "web", "api"));
        assert!(!grants(&json!({}), "web", "api"));
    }

    #[test]
    fn a_refused_share_is_not_a_service_of_the_namespace() {
        // The Gateway API controller marks a backendRef it refuses; its name
        // (any kind's) is never checked or used as a Service.
        let t = tunnel(json!({"domain": "web", "routes": [{"path": "/", "backends": [
            {"name": "a", "port": 80, "weight": 2},
            {"name": "my.bucket", "port": 0, "refused": "backendRef x.io/Bucket my.bucket: only Services"}]}]}));
        assert!(validate(&t).is_ok());
        assert_eq!(t.spec.services().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn plans_resolve_weighted_backends_and_leave_out_bad_routes() {
        let t = tunnel(json!({"domain": "web", "routes": [
            {"path": "/", "backends": [{"name": "a", "port": 80, "weight": 80}, {"name": "gone", "port": 80, "weight": 20}],
             "method": "GET", "headers": [{"name": "x-env", "value": "canary"}],
             "filters": [{"type": "ResponseHeaderModifier", "responseHeaderModifier": {"set": [{"name": "x-r", "value": "1"}]}}]},
            {"path": "/empty"},
            {"path": "/moved", "filters": [{"type": "RequestRedirect", "requestRedirect": {"statusCode": 301}}]},
            {"path": "/regex", "service": {"name": "a", "port": 80},
             "headers": [{"name": "x-v", "value": "v[0-9", "type": "RegularExpression"}]},
            {"path": "/both", "service": {"name": "a", "port": 80}, "filters": [
                {"type": "RequestRedirect", "requestRedirect": {}}, {"type": "URLRewrite", "urlRewrite": {}}]},
            {"path": "/code", "filters": [{"type": "RequestRedirect", "requestRedirect": {"statusCode": 200}}]},
            {"path": "/redirect-and-backend", "service": {"name": "a", "port": 80},
             "filters": [{"type": "RequestRedirect", "requestRedirect": {}}]},
            {"path": "/two", "service": {"name": "a", "port": 80}, "backends": [{"name": "a", "port": 80}]},
        ]}));
        let mut o = observed(Ok(Publish::Domain("web.edge.test".into())), None);
        o.default = None;
        o.routes = (0..8).map(|_| Ok(vec!["10.0.0.5:80".into()])).collect();
        o.routes[0] = Ok(Vec::new());
        o.weighted = vec![
            vec![
                Ok(vec!["10.0.0.1:80".into()]),
                Err(Error::Waiting("Service gone not found in this namespace".into())),
            ],
            vec![],
        ];
        let p = plan(&t, "c1", o).unwrap();
        let paths: Vec<_> = p.routes.iter().map(|r| r.path.as_str()).collect();
        assert_eq!(paths, ["/", "/empty", "/moved"], "bad routes are left out");
        let w: Vec<_> = p.routes[0].weighted.iter().map(|w| (w.weight, w.backends.clone())).collect();
        assert_eq!(
            w,
            [(80, vec!["10.0.0.1:80".to_string()]), (20, vec![])],
            "a missing Service is an empty share"
        );
        assert_eq!(p.routes[0].method.as_deref(), Some("GET"));
        assert_eq!(p.routes[0].headers.len(), 1);
        assert_eq!(p.routes[0].filters.len(), 1);
        assert_eq!(
            p.routes[1].weighted,
            [WeightedBackends { weight: 1, backends: vec![] }],
            "no backend: 500"
        );
        assert!(p.routes[2].weighted.is_empty() && p.routes[2].backends.is_empty(), "the redirect answers");
        let want = [
            "route /: backend gone: Service gone not found in this namespace",
            "route /regex: header `x-v`: `v[0-9` is not a regular expression: unclosed character class",
            "route /both: filters: RequestRedirect and URLRewrite cannot be combined: a redirect never reaches a backend",
            "route /code: filters: requestRedirect: statusCode 200 is not allowed: use 301, 302, 303, 307 or 308",
            "route /redirect-and-backend: a RequestRedirect route is answered by the redirect: remove its service and backends",
            "route /two: give service or backends, not both",
        ];
        assert_eq!(p.problems, want);
    }

    #[test]
    fn plans_degrade_routes_and_refuse_what_is_missing() {
        let routes = tunnel(json!({"domain": "web", "service": {"name": "web", "port": 80}, "routes": [
            {"path": "/api", "service": {"name": "api", "port": 80}},
            {"path": "/admin", "service": {"name": "admin", "port": 80}, "options": {"authSecret": "creds"}},
            {"path": "/gone", "service": {"name": "gone", "port": 80}},
        ]}));
        let host = || Ok(Publish::Domain("web.edge.test".into()));
        let mut o = observed(host(), None);
        o.routes = vec![
            Ok(vec!["10.0.0.2:80".into()]),
            Ok(vec!["10.0.0.3:80".into()]),
            Err(Error::Waiting("Service gone not found in this namespace".into())),
        ];
        o.auth.failed.insert("creds".into(), "auth Secret creds not found in this namespace".into());
        let p = plan(&routes, "c1", o).unwrap();
        let served: Vec<_> = p.routes.iter().map(|r| (r.path.as_str(), r.backends.len())).collect();
        assert_eq!(served, [("/api", 1), ("/admin", 0), ("/gone", 0)]);
        assert_eq!(
            p.problems,
            [
                "route /admin: auth Secret creds not found in this namespace",
                "route /gone: Service gone not found in this namespace"
            ]
        );
        assert_eq!(p.backends, ["10.0.0.1:80"]);

        // Without routes, the one Service must be there; the Domain must be ready; the spec valid.
        let single = tunnel(json!({"service": {"name": "web", "port": 80}, "domain": "web"}));
        let mut o = observed(host(), None);
        o.default = Some(Err(Error::Waiting("Service web has no ready endpoints".into())));
        let e = plan(&single, "c1", o).unwrap_err();
        assert_eq!((e.category(), e.to_string().as_str()), ("Waiting", "Service web has no ready endpoints"));
        let e = plan(&single, "c1", observed(Err(Error::Waiting("Domain web is not ready".into())), None));
        assert_eq!(e.unwrap_err().category(), "Waiting");
        let bad = tunnel(json!({"service": {"name": "web.other", "port": 80}, "domain": "web"}));
        assert_eq!(plan(&bad, "c1", observed(host(), None)).unwrap_err().category(), "InvalidSpec");
    }

    #[tokio::test]
    async fn execute_mints_at_the_edge_and_revokes_the_stale_key() {
        use super::super::edge_api::ReserveRequest;
        use super::super::edge_api::fake::FakeEdge;
        use crate::api::ReserveDomainRequest;
        let edge = FakeEdge::default();
        let request = ReserveDomainRequest { name: Some("web".into()), ..Default::default() };
        edge.reserve(&ReserveRequest::Domain(request)).await.unwrap();
        let t = tunnel(json!({"service": {"name": "web", "port": 80}, "domain": "web"}));
        let host = || Ok(Publish::Domain("web.edge.test".into()));

        let p = plan(&t, "c1", observed(host(), None)).unwrap();
        let first = execute_edge(&edge, &p.key).await.unwrap();
        assert_eq!(first.url, "https://web.edge.test");
        assert!(first.minted.as_deref().is_some_and(|s| s.starts_with("culvert_t_")));

        // Observed again: kept, nothing written.
        let key = edge.tunnel_key(&first.key.id).await.unwrap();
        let p = plan(&t, "c1", observed(host(), key)).unwrap();
        let again = execute_edge(&edge, &p.key).await.unwrap();
        assert_eq!((again.key.id.as_str(), again.minted.as_deref()), (first.key.id.as_str(), None));

        // Now tls: the old key is revoked before the new one is minted.
        let tls =
            tunnel(json!({"service": {"name": "web", "port": 443}, "domain": "web", "protocol": "tls"}));
        let key = edge.tunnel_key(&first.key.id).await.unwrap();
        let p = plan(&tls, "c1", observed(host(), key)).unwrap();
        let third = execute_edge(&edge, &p.key).await.unwrap();
        assert_eq!(third.key.protocol, Protocol::Tls);
        let id = |k: &Executed| k.key.id.clone();
        assert_eq!(
            edge.state().journal,
            [
                "reserve web.edge.test".to_string(),
                format!("create {} for web.edge.test", id(&first)),
                format!("revoke {}", id(&first)),
                format!("create {} for web.edge.test", id(&third)),
            ]
        );
        assert_eq!(edge.tunnel_keys("").await.unwrap().len(), 1, "one live key");

        // The edge is down: an edge error (retried), never a key.
        edge.state().down = true;
        let e = execute_edge(&edge, &plan(&t, "c1", observed(host(), None)).unwrap().key).await.unwrap_err();
        assert_eq!(e.category(), "EdgeApiError");
    }

    #[test]
    fn unconnected_tunnels_are_checked_soon_then_less_often() {
        for (since, want) in [(0, 1), (29, 1), (30, 5), (299, 5), (300, 30), (86400, 30)] {
            assert_eq!(unconnected_recheck(Duration::from_secs(since)), Duration::from_secs(want), "{since}");
        }
    }
}
