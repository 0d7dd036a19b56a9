//! The pure part of the Gateway API controller: from everything observed
//! (classes, Gateways, routes, ReferenceGrants, the Domains, TcpPorts and
//! Tunnels of the namespaces) to the objects to apply, those to delete, and
//! every status, without IO.
//!
//! The rules, in the order they are applied:
//! - a GatewayClass is ours when `spec.controllerName` is
//!   [`CONTROLLER_NAME`]; a Gateway is ours when its class is ours and accepted;
//! - each listener is checked alone (protocol, port, TLS mode, route kinds),
//!   then against the Gateway's other listeners (`Conflicted`);
//! - each route, oldest first, is matched per `parentRef` to the listeners
//!   of the Gateway it names (`sectionName`, `port`, kind, namespace,
//!   hostname), then translated; a route that cannot be served on a parent
//!   gets `Accepted: False` there, with a reason and a message that says what
//!   to change;
//! - the hosts of the HTTP and gRPC routes of one namespace become one
//!   Tunnel per host (protocol http) on a Domain of that namespace, the
//!   routes' rules merged oldest route first; a TLSRoute host becomes a Tunnel
//!   of protocol tls; a TCP (UDP) listener with its TCPRoute (UDPRoute)
//!   becomes a TcpPort (UdpPort) and a Tunnel of protocol tcp (udp), in the
//!   route's namespace.
//!
//! Which hosts a route may publish: a host its own namespace holds a
//! `Domain` for (any listener), or, with `--domain-policy auto`, a host the
//! listener's own `hostname` names (exactly or by wildcard) — the Gateway's
//! owner delegated that name to the namespaces its `allowedRoutes` admits,
//! and a Domain is made for it in the route's namespace. A listener without a
//! hostname delegates nothing: its routes publish only hosts their namespace
//! holds a Domain for.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::default_host;
use super::types::*;
use crate::crd::{
    BackendProtocol, Condition, Domain, DomainSpec, HttpOptions, ReclaimPolicy, ServiceRef, TcpPort,
    TcpPortSpec, Tunnel, TunnelProtocol, TunnelRoute, TunnelSpec, UdpPort,
};
use crate::operator::DomainPolicy;
use crate::operator::names::LABEL_MANAGED_BY;
use crate::operator::status::{carry_transition, condition, ready_condition};

/// `spec.controllerName` of the GatewayClasses culvert serves.
pub const CONTROLLER_NAME: &str = "culvert.dev/gateway-controller";
/// Value of [`LABEL_MANAGED_BY`] on what this controller makes.
pub const MANAGED_BY: &str = "gateway";
/// The Gateway API minor versions (of the CRD bundle) this controller is written for.
pub const SUPPORTED_BUNDLE: &str = "v1.6";

/// The route kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Http,
    Grpc,
    Tls,
    Tcp,
    Udp,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Http => "HTTPRoute",
            Kind::Grpc => "GRPCRoute",
            Kind::Tls => "TLSRoute",
            Kind::Tcp => "TCPRoute",
            Kind::Udp => "UDPRoute",
        }
    }

    pub fn of(kind: &str) -> Option<Kind> {
        [Kind::Http, Kind::Grpc, Kind::Tls, Kind::Tcp, Kind::Udp].into_iter().find(|k| k.name() == kind)
    }
}

/// A route of any kind, as the plan reads it.
#[derive(Debug, Clone)]
pub struct Route {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub generation: Option<i64>,
    pub created: Option<Timestamp>,
    pub parent_refs: Vec<ParentRef>,
    pub hostnames: Vec<String>,
    pub status: RouteStatus,
    pub rules: Rules,
}

/// The rules of a route, by family.
#[derive(Debug, Clone)]
pub enum Rules {
    Http(Vec<HTTPRouteRule>),
    Grpc(Vec<GRPCRouteRule>),
    L4(Vec<L4Rule>),
}

impl Route {
    fn id(&self) -> String {
        format!("{} {}/{}", self.kind.name(), self.namespace, self.name)
    }

    pub fn backend_refs(&self) -> Vec<&BackendRef> {
        match &self.rules {
            Rules::Http(r) => r.iter().flat_map(|r| &r.backend_refs).collect(),
            Rules::Grpc(r) => r.iter().flat_map(|r| &r.backend_refs).collect(),
            Rules::L4(r) => r.iter().flat_map(|r| &r.backend_refs).collect(),
        }
    }

    fn owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: format!("{GROUP}/v1"),
            kind: self.kind.name().into(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            controller: Some(false),
            block_owner_deletion: None,
        }
    }
}

fn route_of<K: Resource>(
    kind: Kind,
    r: &K,
    parent_refs: &[ParentRef],
    hostnames: &[String],
    status: Option<&RouteStatus>,
    rules: Rules,
) -> Route {
    let m = r.meta();
    Route {
        kind,
        namespace: m.namespace.clone().unwrap_or_default(),
        name: m.name.clone().unwrap_or_default(),
        uid: m.uid.clone().unwrap_or_default(),
        generation: m.generation,
        created: m.creation_timestamp.as_ref().map(|t| t.0),
        parent_refs: parent_refs.to_vec(),
        hostnames: hostnames.to_vec(),
        status: status.cloned().unwrap_or_default(),
        rules,
    }
}

impl From<&HTTPRoute> for Route {
    fn from(r: &HTTPRoute) -> Route {
        route_of(
            Kind::Http,
            r,
            &r.spec.parent_refs,
            &r.spec.hostnames,
            r.status.as_ref(),
            Rules::Http(r.spec.rules.clone()),
        )
    }
}
impl From<&GRPCRoute> for Route {
    fn from(r: &GRPCRoute) -> Route {
        route_of(
            Kind::Grpc,
            r,
            &r.spec.parent_refs,
            &r.spec.hostnames,
            r.status.as_ref(),
            Rules::Grpc(r.spec.rules.clone()),
        )
    }
}
impl From<&TLSRoute> for Route {
    fn from(r: &TLSRoute) -> Route {
        route_of(
            Kind::Tls,
            r,
            &r.spec.parent_refs,
            &r.spec.hostnames,
            r.status.as_ref(),
            Rules::L4(r.spec.rules.clone()),
        )
    }
}
impl From<&TCPRoute> for Route {
    fn from(r: &TCPRoute) -> Route {
        route_of(Kind::Tcp, r, &r.spec.parent_refs, &[], r.status.as_ref(), Rules::L4(r.spec.rules.clone()))
    }
}
impl From<&UDPRoute> for Route {
    fn from(r: &UDPRoute) -> Route {
        route_of(Kind::Udp, r, &r.spec.parent_refs, &[], r.status.as_ref(), Rules::L4(r.spec.rules.clone()))
    }
}

/// Everything a reconcile read (fresh lists).
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub classes: Vec<GatewayClass>,
    pub gateways: Vec<Gateway>,
    pub routes: Vec<Route>,
    pub grants: Vec<ReferenceGrant>,
    pub domains: Vec<Domain>,
    /// Made by this controller.
    pub tunnels: Vec<Tunnel>,
    /// Made by this controller.
    pub tcp_ports: Vec<TcpPort>,
    /// Made by this controller.
    pub udp_ports: Vec<UdpPort>,
    /// `(namespace, name)` of the Services that exist.
    pub services: BTreeSet<(String, String)>,
    /// Labels of the namespaces (read only when a listener selects namespaces).
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    /// The route kinds whose CRDs are served.
    pub served: BTreeSet<Kind>,
    /// `gateway.networking.k8s.io/bundle-version` of the installed Gateway CRD.
    pub bundle_version: Option<String>,
    /// `(namespace, name)` of the Secrets HTTPS listeners' certificateRefs name
    /// that exist: true when they hold a PEM certificate and key (`tls.crt`,
    /// `tls.key`). The edge does not use them; they are checked for the
    /// listener's `ResolvedRefs`, as the spec asks.
    pub cert_secrets: BTreeMap<(String, String), bool>,
}

/// What the plan takes from the operator's settings and the edge.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    pub edge_domain: &'a str,
    /// The host name (or address) public clients connect to.
    pub public_host: &'a str,
    pub https_port: u16,
    pub tcp_ports: (u16, u16),
    pub domain_policy: DomainPolicy,
}

/// An object to apply, in a route's namespace.
#[derive(Debug, Clone, PartialEq)]
pub struct Child<S> {
    pub namespace: String,
    pub name: String,
    pub spec: S,
    pub owners: Vec<OwnerReference>,
    /// The public host, or `gateway/listener` for a port.
    pub serves: String,
}

/// What one reconcile does.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub class_status: Vec<(String, GatewayClassStatus)>,
    pub gateway_status: Vec<(String, String, GatewayStatus)>,
    pub route_status: Vec<(Kind, String, String, RouteStatus)>,
    pub domains: Vec<Child<DomainSpec>>,
    pub tcp_ports: Vec<Child<TcpPortSpec>>,
    /// UdpPorts (the same spec shape as a TcpPort's).
    pub udp_ports: Vec<Child<TcpPortSpec>>,
    pub tunnels: Vec<Child<TunnelSpec>>,
    /// `(namespace, name)` of what this controller made and no longer needs.
    pub delete_tunnels: Vec<(String, String)>,
    pub delete_domains: Vec<(String, String)>,
    pub delete_tcp_ports: Vec<(String, String)>,
    pub delete_udp_ports: Vec<(String, String)>,
}

/// The spec of an HTTP Tunnel on Domain `domain` with these rules.
fn http_tunnel(routes: Vec<TunnelRoute>, domain: String) -> TunnelSpec {
    TunnelSpec {
        service: None,
        routes,
        protocol: TunnelProtocol::Http,
        domain: Some(domain),
        tcp_port: None,
        udp_port: None,
        proxy_protocol: None,
        options: HttpOptions::default(),
    }
}

/// Name of the objects of a key (`gw-<slug>-<hash>`, at most 63 characters).
pub fn object_name(prefix: &str, key: &str) -> String {
    let slug: String =
        key.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    let slug = slug.trim_matches('-');
    let slug = slug[..slug.len().min(40)].trim_end_matches('-');
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let hash: String = digest.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{slug}-{hash}")
}

/// Does `pattern` (a host name, or `*.` and a suffix) match `host`?
pub fn host_matches(pattern: &str, host: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => host.len() > suffix.len() + 1 && host.ends_with(&format!(".{suffix}")),
        None => pattern == host,
    }
}

/// The hostnames a route has on a listener (Gateway API's intersection);
/// empty: none in common. `None` in the result: every host (neither names one).
pub fn intersect(route: &[String], listener: Option<&str>) -> Vec<Option<String>> {
    let route: Vec<String> = route.iter().map(|h| h.trim_end_matches('.').to_ascii_lowercase()).collect();
    match (route.is_empty(), listener) {
        (true, None) => vec![None],
        (true, Some(l)) => vec![Some(l.to_string())],
        (false, None) => route.into_iter().map(Some).collect(),
        (false, Some(l)) => {
            let mut out = Vec::new();
            for r in route {
                let pick = if host_matches(l, &r) || r == l {
                    Some(r)
                } else if host_matches(&r, l) {
                    Some(l.to_string())
                } else if let (Some(a), Some(b)) = (r.strip_prefix("*."), l.strip_prefix("*."))
                    && (a.ends_with(&format!(".{b}")) || b.ends_with(&format!(".{a}")))
                {
                    Some(if a.len() > b.len() { r } else { l.to_string() })
                } else {
                    None
                };
                if let Some(p) = pick
                    && !out.contains(&Some(p.clone()))
                {
                    out.push(Some(p));
                }
            }
            out
        }
    }
}

/// Does a ReferenceGrant in `to_ns` let a `from_kind` of `from_ns` refer to
/// the Service `name`?
pub fn granted(grants: &[ReferenceGrant], from_kind: &str, from_ns: &str, to_ns: &str, name: &str) -> bool {
    granted_core(grants, from_kind, from_ns, "Service", to_ns, name)
}

/// [`granted`] for any kind of the core group (`Service`, `Secret`).
fn granted_core(
    grants: &[ReferenceGrant],
    from_kind: &str,
    from_ns: &str,
    to_kind: &str,
    to_ns: &str,
    name: &str,
) -> bool {
    grants.iter().filter(|g| g.namespace().as_deref() == Some(to_ns)).any(|g| {
        g.spec.from.iter().any(|f| f.group == GROUP && f.kind == from_kind && f.namespace == from_ns)
            && g.spec.to.iter().any(|t| {
                t.group.is_empty() && t.kind == to_kind && t.name.as_deref().is_none_or(|n| n == name)
            })
    })
}

/// The Secrets an HTTPS listener's `tls.certificateRefs` name, as
/// `(namespace, name)`, with the refs that name something else.
pub fn certificate_refs(l: &Listener, gw_ns: &str) -> Vec<Result<(String, String), String>> {
    let refs = match l.tls.as_ref() {
        Some(t) if l.protocol == "HTTPS" => &t.certificate_refs,
        _ => return Vec::new(),
    };
    refs.iter()
        .map(|r| {
            let field = |k: &str| r.get(k).and_then(|v| v.as_str());
            let (group, kind) = (field("group").unwrap_or(""), field("kind").unwrap_or("Secret"));
            if !group.is_empty() || kind != "Secret" {
                return Err(format!("{}/{kind}", if group.is_empty() { "core" } else { group }));
            }
            Ok((field("namespace").unwrap_or(gw_ns).to_string(), field("name").unwrap_or("").to_string()))
        })
        .collect()
}

/// `ResolvedRefs` of an HTTPS listener's certificateRefs: each must be a
/// Secret that exists, holds a PEM certificate and key, and is in the
/// Gateway's namespace or granted to it by a ReferenceGrant. The edge
/// terminates TLS with its own certificate, so they are only checked.
fn check_certificate_refs(e: &mut ListenerEval, gw_ns: &str, o: &Observed) {
    if e.refused.is_some() || e.unresolved.is_some() {
        return;
    }
    let name = &e.spec.name;
    for r in certificate_refs(&e.spec, gw_ns) {
        let problem = match r {
            Err(kind) => Some((
                "InvalidCertificateRef",
                format!("listener {name}: certificateRefs name a {kind}; only core Secrets are supported"),
            )),
            Ok((ns, secret))
                if ns != gw_ns && !granted_core(&o.grants, "Gateway", gw_ns, "Secret", &ns, &secret) =>
            {
                Some((
                    "RefNotPermitted",
                    format!(
                        "listener {name}: Secret {ns}/{secret} is in another namespace and no ReferenceGrant there \
                         allows Gateways of {gw_ns} to use it"
                    ),
                ))
            }
            Ok((ns, secret)) => match o.cert_secrets.get(&(ns.clone(), secret.clone())) {
                Some(true) => None,
                Some(false) => Some((
                    "InvalidCertificateRef",
                    format!(
                        "listener {name}: Secret {ns}/{secret} holds no PEM certificate and key in tls.crt and tls.key"
                    ),
                )),
                None => Some((
                    "InvalidCertificateRef",
                    format!("listener {name}: Secret {ns}/{secret} does not exist"),
                )),
            },
        };
        if problem.is_some() {
            e.unresolved = problem;
            return;
        }
    }
}

/// The host names a Domain covers.
fn domain_hosts(d: &Domain, edge_domain: &str) -> Vec<String> {
    [
        d.status.as_ref().and_then(|s| s.hostname.clone()),
        d.spec.fqdn.as_ref().map(|f| f.trim_end_matches('.').to_ascii_lowercase()),
        d.spec.name.as_ref().map(|n| format!("{n}.{edge_domain}")),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn made_by_us(labels: &BTreeMap<String, String>) -> bool {
    labels.get(LABEL_MANAGED_BY).map(String::as_str) == Some(MANAGED_BY)
}

/// The Domain spec for a host: a subdomain of the edge, or a custom domain.
fn domain_spec(host: &str, edge_domain: &str) -> DomainSpec {
    match host.strip_suffix(&format!(".{edge_domain}")) {
        Some(label) if !label.contains('.') => {
            DomainSpec { name: Some(label.into()), fqdn: None, reclaim_policy: ReclaimPolicy::Delete }
        }
        _ => DomainSpec { name: None, fqdn: Some(host.into()), reclaim_policy: ReclaimPolicy::Delete },
    }
}

/// A condition with the transition time of the same one in `old`.
fn cond(
    type_: &str,
    ok: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
    old: &[Condition],
) -> Condition {
    let mut c = condition(type_, if ok { "True" } else { "False" }, reason, message, generation);
    carry_transition(&mut c, old);
    c
}

fn group_kind(kind: Kind) -> RouteGroupKind {
    RouteGroupKind { group: Some(GROUP.into()), kind: kind.name().into() }
}

/// A listener as checked.
#[derive(Debug, Clone)]
struct ListenerEval {
    spec: Listener,
    kinds: Vec<Kind>,
    /// `Accepted: False` (reason, message).
    refused: Option<(&'static str, String)>,
    conflicted: Option<(&'static str, String)>,
    /// `ResolvedRefs: False` (reason, message).
    unresolved: Option<(&'static str, String)>,
    /// A note for the Accepted message.
    note: Option<String>,
    attached: i32,
}

impl ListenerEval {
    fn usable(&self) -> bool {
        self.refused.is_none() && self.conflicted.is_none()
    }
}

fn check_listener(l: &Listener, s: Settings<'_>, served: &BTreeSet<Kind>) -> ListenerEval {
    let mut e = ListenerEval {
        spec: l.clone(),
        kinds: Vec::new(),
        refused: None,
        conflicted: None,
        unresolved: None,
        note: None,
        attached: 0,
    };
    let port = l.port;
    let https_ports = [443, i32::from(s.https_port)];
    let mode = l.tls.as_ref().and_then(|t| t.mode.as_deref()).unwrap_or("Terminate");
    let port_error = |what: String| Err(("PortUnavailable", what));
    let protocol_error = |what: String| Err(("UnsupportedProtocol", what));
    let kinds: Result<Vec<Kind>, (&'static str, String)> = match l.protocol.as_str() {
        "HTTP" if port == 80 || https_ports.contains(&port) => Ok(vec![Kind::Http, Kind::Grpc]),
        "HTTP" => port_error(format!(
            "the edge serves HTTP on port 80 only (and redirects it to HTTPS on {}); use port 80",
            s.https_port
        )),
        "HTTPS" | "TLS" if !https_ports.contains(&port) => {
            port_error(format!("the edge serves {} on port {} (or 443) only", l.protocol, s.https_port))
        }
        "HTTPS" if mode == "Passthrough" => protocol_error(
            "HTTPS with tls.mode Passthrough is not supported: use protocol TLS with mode Passthrough and a TLSRoute"
                .into(),
        ),
        "HTTPS" => {
            if l.tls.as_ref().is_some_and(|t| !t.certificate_refs.is_empty()) {
                e.note = Some(
                    "TLS is terminated at the edge with its own certificate (the edge's wildcard, or ACME for \
                     a custom Domain); certificateRefs are not used"
                        .into(),
                );
            }
            Ok(vec![Kind::Http, Kind::Grpc])
        }
        "TLS" if mode == "Passthrough" => Ok(vec![Kind::Tls]),
        "TLS" => protocol_error(
            "protocol TLS needs tls.mode Passthrough: the edge routes by SNI and the backend terminates TLS \
             (use HTTPS to terminate at the edge)"
                .into(),
        ),
        "TCP" if (i32::from(s.tcp_ports.0)..=i32::from(s.tcp_ports.1)).contains(&port) => Ok(vec![Kind::Tcp]),
        "TCP" => port_error(format!(
            "port {port} is outside the edge's TCP port range {}-{}",
            s.tcp_ports.0, s.tcp_ports.1
        )),
        "UDP" if (i32::from(s.tcp_ports.0)..=i32::from(s.tcp_ports.1)).contains(&port) => Ok(vec![Kind::Udp]),
        "UDP" => port_error(format!(
            "port {port} is outside the edge's port range {}-{}",
            s.tcp_ports.0, s.tcp_ports.1
        )),
        other => protocol_error(format!("protocol {other} is not supported: use HTTP, HTTPS, TLS, TCP or UDP")),
    };
    let kinds = match kinds {
        Ok(k) => k,
        Err((reason, m)) => {
            e.refused = Some((reason, format!("listener {}: {m}", l.name)));
            return e;
        }
    };
    let mut kinds: Vec<Kind> = kinds.into_iter().filter(|k| served.contains(k)).collect();
    if let Some(allowed) = l.allowed_routes.as_ref().filter(|a| !a.kinds.is_empty()) {
        let mut invalid = Vec::new();
        let mut want = Vec::new();
        for k in &allowed.kinds {
            let group_ok = k.group.as_deref().unwrap_or(GROUP) == GROUP;
            match Kind::of(&k.kind).filter(|k| group_ok && kinds.contains(k)) {
                Some(k) => want.push(k),
                None => invalid.push(format!("{}/{}", k.group.as_deref().unwrap_or(GROUP), k.kind)),
            }
        }
        if !invalid.is_empty() {
            e.unresolved = Some((
                "InvalidRouteKinds",
                format!(
                    "listener {}: allowedRoutes.kinds {} cannot attach to protocol {} (supported: {})",
                    l.name,
                    invalid.join(", "),
                    l.protocol,
                    kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        kinds = want;
    }
    e.kinds = kinds;
    e
}

/// Marks listeners that cannot share their port with the others.
fn check_conflicts(ls: &mut [ListenerEval]) {
    let family = |p: &str| match p {
        "HTTPS" | "TLS" => "tls",
        "HTTP" => "http",
        "UDP" => "udp",
        _ => "tcp",
    };
    for i in 0..ls.len() {
        if ls[i].refused.is_some() {
            continue;
        }
        let me = &ls[i].spec;
        let mut conflict = None;
        for (j, other) in ls.iter().enumerate() {
            if i == j || other.refused.is_some() || other.spec.port != me.port {
                continue;
            }
            let o = &other.spec;
            if family(&o.protocol) != family(&me.protocol)
                && !(family(&o.protocol) == "udp" || family(&me.protocol) == "udp")
            {
                conflict = Some((
                    "ProtocolConflict",
                    format!(
                        "listener {} shares port {} with listener {} of protocol {}",
                        me.name, me.port, o.name, o.protocol
                    ),
                ));
                break;
            }
            let single = matches!(me.protocol.as_str(), "TCP" | "UDP");
            if family(&o.protocol) == family(&me.protocol) && (single || o.hostname == me.hostname) {
                conflict = Some((
                    "HostnameConflict",
                    format!(
                        "listener {} has the same port {} and hostname as listener {}",
                        me.name, me.port, o.name
                    ),
                ));
                break;
            }
        }
        ls[i].conflicted = conflict;
    }
}

fn label_selector_matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_ok = sel.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    let exprs_ok = sel.match_expressions.iter().flatten().all(|e| {
        let vals = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => labels.get(&e.key).is_some_and(|v| vals.contains(v)),
            "NotIn" => labels.get(&e.key).is_none_or(|v| !vals.contains(v)),
            "Exists" => labels.contains_key(&e.key),
            "DoesNotExist" => !labels.contains_key(&e.key),
            _ => false,
        }
    });
    labels_ok && exprs_ok
}

/// May routes of `route_ns` attach to this listener of a Gateway in `gw_ns`?
fn namespace_allowed(l: &Listener, gw_ns: &str, route_ns: &str, o: &Observed) -> bool {
    let ns = l.allowed_routes.as_ref().and_then(|a| a.namespaces.as_ref());
    match ns.and_then(|n| n.from.as_deref()).unwrap_or("Same") {
        "All" => true,
        "Selector" => {
            let sel = ns.and_then(|n| n.selector.clone()).unwrap_or_default();
            o.namespaces.get(route_ns).is_some_and(|labels| label_selector_matches(&sel, labels))
        }
        _ => gw_ns == route_ns,
    }
}

/// (gateway namespace, gateway, listener) → the route a TCP or UDP listener carries.
type TcpClaims = BTreeMap<(String, String, String), PortClaim>;

/// The route a TCP or UDP listener carries.
#[derive(Debug, Clone)]
struct PortClaim {
    namespace: String,
    owner: OwnerReference,
    service: ServiceRef,
    port: u16,
    /// `Kind namespace/name` of the route.
    route: String,
    kind: Kind,
}

/// Why a route is not served on a parent: `Accepted: False` with this reason and message.
type Refusal = (&'static str, String);

/// What a route gives one host of its namespace (HTTP and gRPC).
#[derive(Debug, Clone)]
struct HostRoutes {
    owner: OwnerReference,
    routes: Vec<TunnelRoute>,
}

/// A Service of a backendRef that may be used, and its weight.
#[derive(Debug, Clone)]
struct Resolved {
    name: String,
    namespace: Option<String>,
    port: i32,
    weight: u32,
    /// The Service exists (a missing one's share answers 500).
    found: bool,
    /// Why the backendRef cannot be used (its share answers 500).
    refused: Option<String>,
}

/// The backendRefs of a route checked, each with its weight (a refused
/// one keeps its share, which answers 500), and `ResolvedRefs` (reason,
/// message) when one cannot be used.
fn resolve_refs(
    route: &Route,
    refs: &[BackendRef],
    o: &Observed,
    problems: &mut Vec<(&'static str, String)>,
) -> Vec<Resolved> {
    let mut out = Vec::new();
    for b in refs {
        let weight = b.weight.unwrap_or(1).clamp(0, 1_000_000) as u32;
        let mut refuse = |reason: &'static str, why: String| {
            problems.push((reason, why.clone()));
            out.push(Resolved {
                name: b.name.clone(),
                namespace: b.namespace.clone(),
                port: b.port.unwrap_or(0),
                weight,
                found: false,
                refused: Some(why),
            });
        };
        let group = b.group.as_deref().unwrap_or("");
        let kind = b.kind.as_deref().unwrap_or("Service");
        if !group.is_empty() || kind != "Service" {
            refuse(
                "InvalidKind",
                format!(
                    "backendRef {}/{kind} {}: only Services (group \"\", kind Service) are supported",
                    if group.is_empty() { "core" } else { group },
                    b.name
                ),
            );
            continue;
        }
        let ns = b.namespace.clone().filter(|n| *n != route.namespace);
        if let Some(other) = &ns
            && !granted(&o.grants, route.kind.name(), &route.namespace, other, &b.name)
        {
            refuse(
                "RefNotPermitted",
                format!(
                    "backendRef Service {other}/{}: a Service of another namespace needs a ReferenceGrant in namespace {other} from {} of namespace {} to Service {}",
                    b.name,
                    route.kind.name(),
                    route.namespace,
                    b.name
                ),
            );
            continue;
        }
        let Some(port) = b.port else {
            refuse("UnsupportedValue", format!("backendRef Service {}: port is required", b.name));
            continue;
        };
        let target_ns = ns.clone().unwrap_or_else(|| route.namespace.clone());
        let found = o.services.contains(&(target_ns.clone(), b.name.clone()));
        if !found {
            problems
                .push(("BackendNotFound", format!("backendRef Service {target_ns}/{} not found", b.name)));
            // Still routed: its share answers 500 until the Service exists.
        }
        out.push(Resolved { name: b.name.clone(), namespace: ns, port, weight, found, refused: None });
    }
    out
}

/// The backends that can be used (TLS, TCP and UDP routes carry one).
fn usable(backends: Vec<Resolved>) -> Vec<Resolved> {
    backends.into_iter().filter(|b| b.refused.is_none()).collect()
}

fn service_ref(r: &Resolved) -> ServiceRef {
    ServiceRef { name: r.name.clone(), port: IntOrString::Int(r.port) }
}

/// The Tunnel routes of one HTTP route rule, or why it cannot be served.
fn http_rule_routes(
    rule: &HTTPRouteRule,
    backends: &[Resolved],
    options: &HttpOptions,
) -> Result<Vec<TunnelRoute>, String> {
    for f in &rule.filters {
        let t = f.get("type").and_then(|t| t.as_str()).unwrap_or("");
        if !["RequestHeaderModifier", "ResponseHeaderModifier", "RequestRedirect", "URLRewrite"].contains(&t)
        {
            return Err(format!(
                "filter type {t} is not supported (supported: RequestHeaderModifier, ResponseHeaderModifier, RequestRedirect, URLRewrite)"
            ));
        }
    }
    let redirects =
        rule.filters.iter().any(|f| f.get("type").and_then(|t| t.as_str()) == Some("RequestRedirect"));
    let default_match = [HTTPRouteMatch::default()];
    let matches = if rule.matches.is_empty() { &default_match[..] } else { &rule.matches[..] };
    let mut out = Vec::new();
    for m in matches {
        let (path, path_type) = match &m.path {
            None => ("/".to_string(), "Prefix"),
            Some(p) => {
                let value = p.value.clone().unwrap_or_else(|| "/".into());
                match p.type_.as_deref().unwrap_or("PathPrefix") {
                    "Exact" => (value, "Exact"),
                    "PathPrefix" => (value, "Prefix"),
                    other => {
                        return Err(format!(
                            "path match type {other} is not supported (use Exact or PathPrefix)"
                        ));
                    }
                }
            }
        };
        let value_match = |v: &ValueMatch, what: &str| -> Result<serde_json::Value, String> {
            match v.type_.as_deref().unwrap_or("Exact") {
                t @ ("Exact" | "RegularExpression") => {
                    Ok(json!({"name": v.name, "value": v.value, "type": t}))
                }
                other => Err(format!("{what} match type {other} is not supported")),
            }
        };
        let headers: Vec<serde_json::Value> =
            m.headers.iter().map(|h| value_match(h, "header")).collect::<Result<_, _>>()?;
        let query: Vec<serde_json::Value> =
            m.query_params.iter().map(|q| value_match(q, "query parameter")).collect::<Result<_, _>>()?;
        let mut r = json!({
            "path": path,
            "pathType": path_type,
            "headers": headers,
            "queryParams": query,
            "filters": rule.filters,
            "options": options,
        });
        if let Some(method) = &m.method {
            r["method"] = json!(method.to_ascii_uppercase());
        }
        // A redirect answers every request of its rule: no backend is used.
        if !redirects {
            tunnel_backends(&mut r, backends);
        }
        out.push(serde_json::from_value(r).map_err(|e| format!("cannot be served: {e}"))?);
    }
    Ok(out)
}

/// Sets `service` (one backend of this namespace) or `backends` (weighted)
/// of a Tunnel route in JSON; none: the route answers 500 (or redirects).
/// A refused backendRef keeps its weight as a share marked `refused`, and a
/// missing Service stays a share: their requests answer 500, as Gateway API
/// asks, and the others keep theirs.
fn tunnel_backends(r: &mut serde_json::Value, backends: &[Resolved]) {
    match backends {
        [] => {}
        // One Service of this namespace that exists: the plain `service`.
        [one] if one.namespace.is_none() && one.weight > 0 && one.found && one.refused.is_none() => {
            r["service"] = json!(service_ref(one))
        }
        several => {
            r["backends"] = several
                .iter()
                .map(|b| {
                    let mut v = json!({"name": b.name, "port": b.port, "weight": b.weight});
                    if let Some(ns) = &b.namespace {
                        v["namespace"] = json!(ns);
                    }
                    if let Some(why) = &b.refused {
                        v["refused"] = json!(why);
                    }
                    v
                })
                .collect()
        }
    }
}

/// The Tunnel routes of one gRPC route rule (method → path, backends h2c).
fn grpc_rule_routes(rule: &GRPCRouteRule, backends: &[Resolved]) -> Result<Vec<TunnelRoute>, String> {
    let mut filters = Vec::new();
    for f in &rule.filters {
        let t = f.get("type").and_then(|t| t.as_str()).unwrap_or("");
        if !["RequestHeaderModifier", "ResponseHeaderModifier"].contains(&t) {
            return Err(format!(
                "GRPCRoute filter type {t} is not supported (supported: RequestHeaderModifier, ResponseHeaderModifier)"
            ));
        }
        filters.push(f.clone());
    }
    let options = HttpOptions { backend_protocol: Some(BackendProtocol::H2c), ..Default::default() };
    let http = HTTPRouteRule {
        matches: if rule.matches.is_empty() {
            Vec::new()
        } else {
            rule.matches
                .iter()
                .map(|m| {
                    let path =
                        match &m.method {
                            None => None,
                            Some(mm) if mm.type_.as_deref().unwrap_or("Exact") != "Exact" => {
                                return Err(
                                    "gRPC method match type RegularExpression is not supported (use Exact)"
                                        .to_string(),
                                );
                            }
                            Some(mm) => match (&mm.service, &mm.method) {
                                (Some(s), Some(me)) => Some(PathMatch {
                                    type_: Some("Exact".into()),
                                    value: Some(format!("/{s}/{me}")),
                                }),
                                (Some(s), None) => Some(PathMatch {
                                    type_: Some("PathPrefix".into()),
                                    value: Some(format!("/{s}")),
                                }),
                                (None, Some(_)) => return Err(
                                    "a gRPC method match without service is not supported: name the service"
                                        .into(),
                                ),
                                (None, None) => None,
                            },
                        };
                    Ok(HTTPRouteMatch {
                        path,
                        headers: m.headers.clone(),
                        query_params: Vec::new(),
                        method: None,
                    })
                })
                .collect::<Result<_, _>>()?
        },
        filters,
        backend_refs: Vec::new(),
    };
    http_rule_routes(&http, backends, &options)
}

/// Decides, without IO, everything a reconcile does.
pub fn plan(o: &Observed, s: Settings<'_>) -> Plan {
    let mut p = Plan::default();

    // GatewayClasses.
    let mut accepted_classes = BTreeSet::new();
    for c in o.classes.iter().filter(|c| c.spec.controller_name == CONTROLLER_NAME) {
        let old = c.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
        let g = c.metadata.generation;
        let version_ok = o.bundle_version.as_deref().is_none_or(supported_bundle);
        let version = match &o.bundle_version {
            Some(v) if version_ok => cond(
                "SupportedVersion",
                true,
                "SupportedVersion",
                format!("Gateway API {v} is supported"),
                g,
                old,
            ),
            Some(v) => cond(
                "SupportedVersion",
                false,
                "UnsupportedVersion",
                format!(
                    "Gateway API CRDs {v} are installed; culvert supports {SUPPORTED_BUNDLE}.x and later v1 releases: install the upstream {SUPPORTED_BUNDLE} standard-install.yaml"
                ),
                g,
                old,
            ),
            None => cond(
                "SupportedVersion",
                true,
                "SupportedVersion",
                "the installed Gateway API CRDs carry no bundle version; assuming a supported one",
                g,
                old,
            ),
        };
        let accepted = if !version_ok {
            cond("Accepted", false, "UnsupportedVersion", version.message.clone(), g, old)
        } else if c.spec.parameters_ref.is_some() {
            cond(
                "Accepted",
                false,
                "InvalidParameters",
                "culvert's GatewayClass takes no parametersRef: remove it (the operator's flags configure it)",
                g,
                old,
            )
        } else {
            accepted_classes.insert(c.name_any());
            cond(
                "Accepted",
                true,
                "Accepted",
                "culvert publishes the Gateways of this class through its edge",
                g,
                old,
            )
        };
        p.class_status.push((c.name_any(), GatewayClassStatus { conditions: vec![accepted, version] }));
    }

    // Gateways and their listeners.
    let mut listeners: BTreeMap<(String, String), Vec<ListenerEval>> = BTreeMap::new();
    let ours: Vec<&Gateway> =
        o.gateways.iter().filter(|g| accepted_classes.contains(&g.spec.gateway_class_name)).collect();
    for gw in &ours {
        let mut ls: Vec<ListenerEval> =
            gw.spec.listeners.iter().map(|l| check_listener(l, s, &o.served)).collect();
        let gw_ns = gw.namespace().unwrap_or_default();
        ls.iter_mut().for_each(|e| check_certificate_refs(e, &gw_ns, o));
        check_conflicts(&mut ls);
        listeners.insert((gw.namespace().unwrap_or_default(), gw.name_any()), ls);
    }
    // The edge's default host: one namespace's Gateways hold it (default_host.rs).
    let default_holder = default_host::holder(&ours, |g, i| {
        listeners.get(&(g.namespace().unwrap_or_default(), g.name_any())).is_some_and(|ls| ls[i].usable())
    });
    let default_ns = default_holder.and_then(|g| g.namespace());
    for gw in &ours {
        let Some(holder) = default_holder.filter(|_| gw.namespace() != default_ns) else { continue };
        let ls =
            listeners.get_mut(&(gw.namespace().unwrap_or_default(), gw.name_any())).expect("listed above");
        for l in ls.iter_mut().filter(|l| l.usable() && default_host::is_default_listener(&l.spec)) {
            l.conflicted = Some(("HostnameConflict", default_host::conflict_message(&l.spec.name, holder)));
        }
    }
    let mut default_routes = default_host::DefaultRoutes::new();

    // Routes, oldest first.
    let mut routes: Vec<&Route> = o.routes.iter().collect();
    routes.sort_by(|a, b| {
        (a.created, &a.namespace, &a.name, a.kind).cmp(&(b.created, &b.namespace, &b.name, b.kind))
    });
    // (namespace, host) → what HTTP/gRPC routes give it, oldest first.
    let mut http_hosts: BTreeMap<(String, String), Vec<HostRoutes>> = BTreeMap::new();
    // (namespace, host) → the TLS route's backend.
    let mut tls_hosts: BTreeMap<(String, String), (OwnerReference, ServiceRef, String)> = BTreeMap::new();
    // (gateway namespace, gateway, listener) → (route namespace, owner, backend, port, route id).
    let mut tcp_listeners: TcpClaims = BTreeMap::new();

    for route in routes {
        let mut parents = Vec::new();
        let mut problems: Vec<(&'static str, String)> = Vec::new();
        let refs: Vec<BackendRef> = route.backend_refs().into_iter().cloned().collect();
        let _ = resolve_refs(route, &refs, o, &mut problems);
        let resolved_cond = |old: &[Condition]| match problems.first() {
            None => {
                cond("ResolvedRefs", true, "ResolvedRefs", "every backendRef resolves", route.generation, old)
            }
            Some((reason, _)) => cond(
                "ResolvedRefs",
                false,
                reason,
                problems.iter().map(|(_, m)| m.as_str()).collect::<Vec<_>>().join("; "),
                route.generation,
                old,
            ),
        };
        let mut contributed_hosts: BTreeSet<String> = BTreeSet::new();
        for pr in &route.parent_refs {
            if pr.group.as_deref().unwrap_or(GROUP) != GROUP
                || pr.kind.as_deref().unwrap_or("Gateway") != "Gateway"
            {
                continue;
            }
            let gw_ns = pr.namespace.clone().unwrap_or_else(|| route.namespace.clone());
            let Some(gw) = ours
                .iter()
                .find(|g| g.namespace().as_deref() == Some(gw_ns.as_str()) && g.name_any() == pr.name)
            else {
                continue;
            };
            let old: Vec<Condition> = route
                .status
                .parents
                .iter()
                .find(|ps| ps.controller_name == CONTROLLER_NAME && ps.parent_ref == *pr)
                .map(|ps| ps.conditions.clone())
                .unwrap_or_default();
            let key = (gw_ns.clone(), gw.name_any());
            let ls = listeners.get_mut(&key).expect("every Gateway of ours has its listeners");
            let attach = attach(route, pr, &gw_ns, ls, o);
            let accepted = match attach {
                Err((reason, msg)) => cond("Accepted", false, reason, msg, route.generation, &old),
                Ok(idx) => {
                    let outcome = translate(
                        route,
                        &idx,
                        ls,
                        &gw_ns,
                        &gw.name_any(),
                        o,
                        s,
                        &mut TranslateOut {
                            http_hosts: &mut http_hosts,
                            tls_hosts: &mut tls_hosts,
                            tcp_listeners: &mut tcp_listeners,
                            contributed: &mut contributed_hosts,
                            default_routes: &mut default_routes,
                        },
                    );
                    match outcome {
                        Ok(msg) => {
                            for i in &idx {
                                ls[*i].attached += 1;
                            }
                            cond("Accepted", true, "Accepted", msg, route.generation, &old)
                        }
                        Err((reason, msg)) => cond("Accepted", false, reason, msg, route.generation, &old),
                    }
                }
            };
            parents.push(RouteParentStatus {
                parent_ref: pr.clone(),
                controller_name: CONTROLLER_NAME.into(),
                conditions: vec![accepted, resolved_cond(&old)],
            });
        }
        let mut status = RouteStatus { parents };
        // Entries of other controllers stay as they are.
        status
            .parents
            .extend(route.status.parents.iter().filter(|ps| ps.controller_name != CONTROLLER_NAME).cloned());
        let had_ours = route.status.parents.iter().any(|ps| ps.controller_name == CONTROLLER_NAME);
        if had_ours || status.parents.iter().any(|ps| ps.controller_name == CONTROLLER_NAME) {
            p.route_status.push((route.kind, route.namespace.clone(), route.name.clone(), status));
        }
    }

    // Gateway statuses.
    for gw in &ours {
        let (ns, name) = (gw.namespace().unwrap_or_default(), gw.name_any());
        let ls = &listeners[&(ns.clone(), name.clone())];
        let g = gw.metadata.generation;
        let old_status = gw.status.clone().unwrap_or_default();
        let mut statuses = Vec::new();
        for l in ls {
            let old = old_status
                .listeners
                .iter()
                .find(|x| x.name == l.spec.name)
                .map(|x| x.conditions.clone())
                .unwrap_or_default();
            let accepted = match &l.refused {
                Some((reason, msg)) => cond("Accepted", false, reason, msg.clone(), g, &old),
                None => cond(
                    "Accepted",
                    true,
                    "Accepted",
                    l.note
                        .clone()
                        .unwrap_or_else(|| format!("listener {} is served by the edge", l.spec.name)),
                    g,
                    &old,
                ),
            };
            let conflicted = match &l.conflicted {
                Some((reason, msg)) => cond("Conflicted", true, reason, msg.clone(), g, &old),
                None => {
                    cond("Conflicted", false, "NoConflicts", "no conflict with the other listeners", g, &old)
                }
            };
            let resolved = match &l.unresolved {
                Some((reason, msg)) => cond("ResolvedRefs", false, reason, msg.clone(), g, &old),
                None => {
                    cond("ResolvedRefs", true, "ResolvedRefs", "the listener's references resolve", g, &old)
                }
            };
            let programmed = if l.usable() && l.unresolved.is_none() {
                cond(
                    "Programmed",
                    true,
                    "Programmed",
                    format!("served at {}", listener_address(&l.spec, s)),
                    g,
                    &old,
                )
            } else {
                cond(
                    "Programmed",
                    false,
                    "Invalid",
                    "the listener is not served: see its Accepted, Conflicted and ResolvedRefs conditions",
                    g,
                    &old,
                )
            };
            statuses.push(ListenerStatus {
                name: l.spec.name.clone(),
                supported_kinds: l.kinds.iter().map(|k| group_kind(*k)).collect(),
                attached_routes: l.attached,
                conditions: vec![accepted, programmed, resolved, conflicted],
            });
        }
        let old = old_status.conditions.as_slice();
        let valid = ls.iter().filter(|l| l.usable()).count();
        let accepted = if !gw.spec.addresses.is_empty() {
            cond(
                "Accepted",
                false,
                "UnsupportedAddress",
                "spec.addresses cannot be honoured: the Gateway's address is the edge's; remove spec.addresses",
                g,
                old,
            )
        } else if valid == ls.len() {
            cond("Accepted", true, "Accepted", "every listener is served by the edge", g, old)
        } else if valid > 0 {
            cond(
                "Accepted",
                true,
                "ListenersNotValid",
                "some listeners are not served: see status.listeners",
                g,
                old,
            )
        } else {
            cond(
                "Accepted",
                false,
                "ListenersNotValid",
                "no listener can be served: see status.listeners",
                g,
                old,
            )
        };
        let programmed = if accepted.status == "True" {
            cond(
                "Programmed",
                true,
                "Programmed",
                format!("published through the edge at {}", s.public_host),
                g,
                old,
            )
        } else {
            cond(
                "Programmed",
                false,
                "Invalid",
                "the Gateway is not accepted: see its Accepted condition",
                g,
                old,
            )
        };
        let address_type =
            if s.public_host.parse::<std::net::IpAddr>().is_ok() { "IPAddress" } else { "Hostname" };
        let status = GatewayStatus {
            addresses: vec![GatewayStatusAddress { type_: address_type.into(), value: s.public_host.into() }],
            conditions: vec![accepted, programmed],
            listeners: statuses,
        };
        p.gateway_status.push((ns, name, status));
    }

    // The objects: HTTP hosts, TLS hosts, TCP listeners.
    for ((ns, host), contributions) in &http_hosts {
        let name = object_name("gw", host);
        let Some(domain) = domain_for(ns, host, &name, o, s, &mut p) else { continue };
        let mut owners: Vec<OwnerReference> = Vec::new();
        let mut routes = Vec::new();
        for c in contributions {
            if !owners.iter().any(|o| o.uid == c.owner.uid) {
                owners.push(c.owner.clone());
            }
            routes.extend(c.routes.iter().cloned());
        }
        if let Some(d) = p.domains.iter_mut().find(|d| d.namespace == *ns && d.name == name) {
            d.owners = owners.clone();
        }
        p.tunnels.push(Child {
            namespace: ns.clone(),
            name,
            spec: http_tunnel(routes, domain),
            owners,
            serves: host.clone(),
        });
    }
    if let (Some(holder), Some(ns)) = (default_holder, &default_ns)
        && let Some(routes) = default_routes.remove(ns)
    {
        let name = object_name("gw-default", ns);
        if let Some(domain) = domain_for(ns, default_host::HOST, &name, o, s, &mut p) {
            let owners: Vec<OwnerReference> = ours
                .iter()
                .filter(|g| g.namespace().as_ref() == Some(ns))
                .filter(|g| g.spec.listeners.iter().any(default_host::is_default_listener))
                .map(|g| default_host::gateway_owner(g))
                .collect();
            let owners = if owners.is_empty() { vec![default_host::gateway_owner(holder)] } else { owners };
            if let Some(d) = p.domains.iter_mut().find(|d| d.namespace == *ns && d.name == name) {
                d.owners = owners.clone();
            }
            p.tunnels.push(Child {
                namespace: ns.clone(),
                name,
                spec: http_tunnel(routes, domain),
                owners,
                serves: default_host::HOST.into(),
            });
        }
    }
    for ((ns, host), (owner, service, _)) in &tls_hosts {
        let name = object_name("gw", host);
        let Some(domain) = domain_for(ns, host, &name, o, s, &mut p) else { continue };
        if let Some(d) = p.domains.iter_mut().find(|d| d.namespace == *ns && d.name == name) {
            d.owners = vec![owner.clone()];
        }
        p.tunnels.push(Child {
            namespace: ns.clone(),
            name,
            spec: TunnelSpec {
                service: Some(service.clone()),
                routes: Vec::new(),
                protocol: TunnelProtocol::Tls,
                domain: Some(domain),
                tcp_port: None,
                udp_port: None,
                proxy_protocol: None,
                options: HttpOptions::default(),
            },
            owners: vec![owner.clone()],
            serves: host.clone(),
        });
    }
    for ((gw_ns, gw, listener), c) in &tcp_listeners {
        let udp = c.kind == Kind::Udp;
        let name = object_name(if udp { "gw-udp" } else { "gw-tcp" }, &format!("{gw_ns}.{gw}.{listener}"));
        let serves = format!("{gw_ns}/{gw}/{listener}");
        let port = Child {
            namespace: c.namespace.clone(),
            name: name.clone(),
            spec: TcpPortSpec {
                port: Some(c.port),
                reclaim_policy: ReclaimPolicy::Delete,
                idle_timeout_seconds: None,
            },
            owners: vec![c.owner.clone()],
            serves: serves.clone(),
        };
        if udp {
            p.udp_ports.push(port);
        } else {
            p.tcp_ports.push(port);
        }
        p.tunnels.push(Child {
            namespace: c.namespace.clone(),
            name: name.clone(),
            spec: TunnelSpec {
                service: Some(c.service.clone()),
                routes: Vec::new(),
                protocol: if udp { TunnelProtocol::Udp } else { TunnelProtocol::Tcp },
                domain: None,
                tcp_port: (!udp).then(|| name.clone()),
                udp_port: udp.then(|| name.clone()),
                proxy_protocol: None,
                options: HttpOptions::default(),
            },
            owners: vec![c.owner.clone()],
            serves,
        });
    }

    // What we made and no longer need.
    let wanted =
        |list: &[(String, String)], ns: &str, name: &str| list.iter().any(|(n, m)| n == ns && m == name);
    let t: Vec<(String, String)> = p.tunnels.iter().map(|c| (c.namespace.clone(), c.name.clone())).collect();
    let d: Vec<(String, String)> = p.domains.iter().map(|c| (c.namespace.clone(), c.name.clone())).collect();
    let tp: Vec<(String, String)> =
        p.tcp_ports.iter().map(|c| (c.namespace.clone(), c.name.clone())).collect();
    for x in o.tunnels.iter().filter(|x| made_by_us(x.labels()) && x.metadata.deletion_timestamp.is_none()) {
        let (ns, name) = (x.namespace().unwrap_or_default(), x.name_any());
        if !wanted(&t, &ns, &name) {
            p.delete_tunnels.push((ns, name));
        }
    }
    for x in o.domains.iter().filter(|x| made_by_us(x.labels()) && x.metadata.deletion_timestamp.is_none()) {
        let (ns, name) = (x.namespace().unwrap_or_default(), x.name_any());
        if !wanted(&d, &ns, &name) {
            p.delete_domains.push((ns, name));
        }
    }
    for x in o.tcp_ports.iter().filter(|x| made_by_us(x.labels()) && x.metadata.deletion_timestamp.is_none())
    {
        let (ns, name) = (x.namespace().unwrap_or_default(), x.name_any());
        if !wanted(&tp, &ns, &name) {
            p.delete_tcp_ports.push((ns, name));
        }
    }
    let up: Vec<(String, String)> =
        p.udp_ports.iter().map(|c| (c.namespace.clone(), c.name.clone())).collect();
    for x in o.udp_ports.iter().filter(|x| made_by_us(x.labels()) && x.metadata.deletion_timestamp.is_none())
    {
        let (ns, name) = (x.namespace().unwrap_or_default(), x.name_any());
        if !wanted(&up, &ns, &name) {
            p.delete_udp_ports.push((ns, name));
        }
    }
    p
}

/// Is this CRD bundle version (`v1.6.3`) one this controller supports?
pub fn supported_bundle(v: &str) -> bool {
    let mut parts = v.trim_start_matches('v').split('.');
    let major = parts.next().and_then(|m| m.parse::<u32>().ok());
    let minor = parts.next().and_then(|m| m.parse::<u32>().ok());
    matches!((major, minor), (Some(1), Some(m)) if m >= 6)
}

/// Where a listener is served, for its Programmed message.
fn listener_address(l: &Listener, s: Settings<'_>) -> String {
    match l.protocol.as_str() {
        "TCP" | "UDP" => format!("{}:{} (once a route attaches)", s.public_host, l.port),
        "HTTP" | "HTTPS" => format!("https://<host>:{} (HTTP on port 80 redirects there)", s.https_port),
        _ => format!("{}:{} by SNI", s.public_host, s.https_port),
    }
}

/// The Domain a host publishes on: one of its namespace (not ours) that
/// covers it, else one made for it (the route was let publish the host:
/// a listener delegated the name, under policy auto); `None`: not published.
fn domain_for(
    ns: &str,
    host: &str,
    name: &str,
    o: &Observed,
    s: Settings<'_>,
    p: &mut Plan,
) -> Option<String> {
    let ready = |d: &Domain| {
        d.status.as_ref().and_then(|s| ready_condition(&s.conditions)).is_some_and(|c| c.status == "True")
    };
    let covering: Vec<&Domain> = o
        .domains
        .iter()
        .filter(|d| d.namespace().as_deref() == Some(ns) && !made_by_us(d.labels()))
        .filter(|d| domain_hosts(d, s.edge_domain).iter().any(|h| h == host))
        .collect();
    if let Some(d) = covering.iter().find(|d| ready(d)).or(covering.first()) {
        return Some(d.name_any());
    }
    if s.domain_policy == DomainPolicy::Require {
        return None;
    }
    if !p.domains.iter().any(|d| d.namespace == ns && d.name == name) {
        p.domains.push(Child {
            namespace: ns.into(),
            name: name.into(),
            spec: domain_spec(host, s.edge_domain),
            owners: Vec::new(),
            serves: host.into(),
        });
    }
    Some(name.into())
}

/// The listeners (indices) of a Gateway a route's parentRef attaches to, or
/// why none.
fn attach(
    route: &Route,
    pr: &ParentRef,
    gw_ns: &str,
    ls: &[ListenerEval],
    o: &Observed,
) -> Result<Vec<usize>, Refusal> {
    let named: Vec<usize> = (0..ls.len())
        .filter(|i| pr.section_name.as_ref().is_none_or(|n| *n == ls[*i].spec.name))
        .filter(|i| pr.port.is_none_or(|p| p == ls[*i].spec.port))
        .collect();
    if named.is_empty() {
        let what = match (&pr.section_name, pr.port) {
            (Some(n), Some(p)) => format!("a listener named {n} on port {p}"),
            (Some(n), None) => format!("a listener named {n}"),
            (None, Some(p)) => format!("a listener on port {p}"),
            (None, None) => "a listener".into(),
        };
        return Err((
            "NoMatchingParent",
            format!("Gateway {gw_ns}/{} has no {what}: check parentRefs sectionName and port", pr.name),
        ));
    }
    let usable: Vec<usize> = named.iter().copied().filter(|i| ls[*i].usable()).collect();
    if usable.is_empty() {
        return Err((
            "NoMatchingParent",
            format!(
                "the listeners parentRef {} names are not served (see the Gateway's status.listeners)",
                pr.name
            ),
        ));
    }
    let kind_ok: Vec<usize> = usable.iter().copied().filter(|i| ls[*i].kinds.contains(&route.kind)).collect();
    if kind_ok.is_empty() {
        return Err((
            "NotAllowedByListeners",
            format!(
                "no listener of Gateway {gw_ns}/{} that the parentRef names accepts {} (see supportedKinds and allowedRoutes.kinds)",
                pr.name,
                route.kind.name()
            ),
        ));
    }
    let ns_ok: Vec<usize> = kind_ok
        .iter()
        .copied()
        .filter(|i| namespace_allowed(&ls[*i].spec, gw_ns, &route.namespace, o))
        .collect();
    if ns_ok.is_empty() {
        return Err((
            "NotAllowedByListeners",
            format!(
                "the listeners of Gateway {gw_ns}/{} do not admit routes of namespace {} (allowedRoutes.namespaces)",
                pr.name, route.namespace
            ),
        ));
    }
    if matches!(route.kind, Kind::Tcp | Kind::Udp) {
        return Ok(ns_ok);
    }
    let host_ok: Vec<usize> = ns_ok
        .iter()
        .copied()
        .filter(|i| !intersect(&route.hostnames, ls[*i].spec.hostname.as_deref()).is_empty())
        .collect();
    if host_ok.is_empty() {
        return Err((
            "NoMatchingListenerHostname",
            format!(
                "none of spec.hostnames ({}) matches a listener hostname of Gateway {gw_ns}/{}",
                route.hostnames.join(", "),
                pr.name
            ),
        ));
    }
    Ok(host_ok)
}

struct TranslateOut<'a> {
    http_hosts: &'a mut BTreeMap<(String, String), Vec<HostRoutes>>,
    tls_hosts: &'a mut BTreeMap<(String, String), (OwnerReference, ServiceRef, String)>,
    tcp_listeners: &'a mut TcpClaims,
    /// Hosts this route already gave (through another parent or listener).
    contributed: &'a mut BTreeSet<String>,
    /// Gateway namespace → the rules of its default host.
    default_routes: &'a mut default_host::DefaultRoutes,
}

/// Translates a route attached to listeners `idx` into what it gives; the
/// Accepted message, or why it cannot be served.
#[allow(clippy::too_many_arguments)]
fn translate(
    route: &Route,
    idx: &[usize],
    ls: &[ListenerEval],
    gw_ns: &str,
    gw: &str,
    o: &Observed,
    s: Settings<'_>,
    out: &mut TranslateOut<'_>,
) -> Result<String, Refusal> {
    let mut ignored = Vec::new();
    if matches!(route.kind, Kind::Tcp | Kind::Udp) {
        let Rules::L4(rules) = &route.rules else { unreachable!() };
        let refs: Vec<BackendRef> = rules.iter().flat_map(|r| r.backend_refs.clone()).collect();
        let mut problems = Vec::new();
        let backends = usable(resolve_refs(route, &refs, o, &mut problems));
        let [one] = backends.as_slice() else {
            return Err((
                "UnsupportedValue",
                format!(
                    "a {} is carried to one Service: give exactly one backendRef (has {})",
                    route.kind.name(),
                    backends.len()
                ),
            ));
        };
        if one.namespace.is_some() {
            return Err((
                "UnsupportedValue",
                format!("a {} sends to a Service of its own namespace only", route.kind.name()),
            ));
        }
        let mut taken = Vec::new();
        for i in idx {
            let l = &ls[*i].spec;
            let key = (gw_ns.to_string(), gw.to_string(), l.name.clone());
            match out.tcp_listeners.get(&key) {
                Some(other) if other.route != route.id() => {
                    taken.push(format!("listener {} already carries {}", l.name, other.route))
                }
                _ => {
                    let claim = PortClaim {
                        namespace: route.namespace.clone(),
                        owner: route.owner(),
                        service: service_ref(one),
                        port: l.port as u16,
                        route: route.id(),
                        kind: route.kind,
                    };
                    out.tcp_listeners.insert(key, claim);
                }
            }
        }
        if taken.len() == idx.len() {
            return Err((
                "NotAllowedByListeners",
                format!(
                    "{} (the oldest route wins; a TCP or UDP listener carries one route)",
                    taken.join("; ")
                ),
            ));
        }
        let ports: Vec<String> =
            idx.iter().map(|i| format!("{}:{}", s.public_host, ls[*i].spec.port)).collect();
        return Ok(format!("published at {}", ports.join(", ")));
    }

    // Hosts of this route on these listeners; on a listener without hostname,
    // what no Domain publishes goes to the default host (`None`: every host).
    let mut hosts: Vec<(String, bool)> = Vec::new();
    let mut on_default: Vec<Option<String>> = Vec::new();
    let http = !matches!(route.rules, Rules::L4(_));
    for i in idx {
        let l = &ls[*i].spec;
        let default_listener = http && default_host::is_default_listener(l);
        for h in intersect(&route.hostnames, l.hostname.as_deref()) {
            match h {
                h if default_listener && h.as_deref().is_none_or(|h| h.starts_with("*.")) => on_default.push(h),
                None => ignored.push("the listener and the route name no hostname: TLS passthrough needs a named host, give spec.hostnames".to_string()),
                Some(h) if h.starts_with("*.") => ignored.push(format!("wildcard host {h} is not published: culvert publishes one name per host, name each in spec.hostnames")),
                Some(h) => {
                    if default_listener {
                        on_default.push(Some(h.clone()));
                    }
                    let delegated = l.hostname.as_deref().is_some_and(|lh| host_matches(lh, &h));
                    match hosts.iter_mut().find(|(x, _)| *x == h) {
                        Some(e) => e.1 |= delegated,
                        None => hosts.push((h, delegated)),
                    }
                }
            }
        }
    }
    let has_domain = |h: &str| {
        o.domains.iter().any(|d| {
            d.namespace().as_deref() == Some(route.namespace.as_str())
                && !made_by_us(d.labels())
                && domain_hosts(d, s.edge_domain).iter().any(|x| x == h)
        })
    };
    let mut published = Vec::new();
    for (h, delegated) in hosts {
        if !(has_domain(&h) || delegated && s.domain_policy == DomainPolicy::Auto) {
            if on_default.contains(&Some(h.clone())) {
                continue; // matched by host on the default host
            }
            let why = if delegated {
                format!(
                    "host {h}: the operator runs with --domain-policy require and namespace {} has no Domain for it: create one (spec.name or spec.fqdn)",
                    route.namespace
                )
            } else {
                format!(
                    "host {h}: namespace {} has no Domain for it and no listener hostname of Gateway {gw_ns}/{gw} names it: create a Domain for it in {}, or give the listener a hostname that covers it",
                    route.namespace, route.namespace
                )
            };
            ignored.push(why);
            continue;
        }
        on_default.retain(|d| d.as_deref() != Some(h.as_str()));
        published.push(h);
    }

    match &route.rules {
        Rules::L4(rules) => {
            let refs: Vec<BackendRef> = rules.iter().flat_map(|r| r.backend_refs.clone()).collect();
            let mut problems = Vec::new();
            let backends = usable(resolve_refs(route, &refs, o, &mut problems));
            let [one] = backends.as_slice() else {
                return Err((
                    "UnsupportedValue",
                    format!(
                        "a TLSRoute is passed through to one Service: give exactly one backendRef (has {})",
                        backends.len()
                    ),
                ));
            };
            if one.namespace.is_some() {
                return Err((
                    "UnsupportedValue",
                    "a TLSRoute sends to a Service of its own namespace only".into(),
                ));
            }
            let mut served = Vec::new();
            for h in published {
                let key = (route.namespace.clone(), h.clone());
                if out.http_hosts.contains_key(&key) {
                    ignored.push(format!("host {h} is published as HTTPS by an HTTPRoute of this namespace; a host is either terminated at the edge or passed through"));
                    continue;
                }
                match out.tls_hosts.get(&key) {
                    Some((_, _, other)) if *other != route.id() => {
                        ignored.push(format!("host {h} is passed through to {other} (the oldest route)"))
                    }
                    _ => {
                        out.tls_hosts.insert(key, (route.owner(), service_ref(one), route.id()));
                        served.push(h);
                    }
                }
            }
            finish(served, ignored)
        }
        Rules::Http(_) | Rules::Grpc(_) => {
            let mut tunnel_routes = Vec::new();
            let mut problems = Vec::new();
            match &route.rules {
                Rules::Http(rules) => {
                    for (i, rule) in rules.iter().enumerate() {
                        let backends = resolve_refs(route, &rule.backend_refs, o, &mut problems);
                        let options = HttpOptions::default();
                        tunnel_routes.extend(
                            http_rule_routes(rule, &backends, &options)
                                .map_err(|m| ("UnsupportedValue", format!("rule {i}: {m}")))?,
                        );
                    }
                }
                Rules::Grpc(rules) => {
                    for (i, rule) in rules.iter().enumerate() {
                        let backends = resolve_refs(route, &rule.backend_refs, o, &mut problems);
                        tunnel_routes.extend(
                            grpc_rule_routes(rule, &backends)
                                .map_err(|m| ("UnsupportedValue", format!("rule {i}: {m}")))?,
                        );
                    }
                }
                Rules::L4(_) => unreachable!(),
            }
            let mut served = Vec::new();
            if !on_default.is_empty() {
                // Every host (a route without hostnames), or the hosts it names.
                let hosts: Vec<String> = if on_default.contains(&None) {
                    Vec::new()
                } else {
                    on_default.into_iter().flatten().collect()
                };
                if out.contributed.insert(format!("{} {gw_ns}", default_host::HOST)) {
                    let rules = default_host::rules_for(&tunnel_routes, &hosts, &route.namespace, gw_ns);
                    out.default_routes.entry(gw_ns.to_string()).or_default().extend(rules);
                }
                served.push(match hosts.is_empty() {
                    true => "the edge's default host (every host no reservation holds)".to_string(),
                    false => format!("the edge's default host for {}", hosts.join(", ")),
                });
            }
            for h in published {
                let key = (route.namespace.clone(), h.clone());
                if out.tls_hosts.contains_key(&key) {
                    ignored.push(format!("host {h} is passed through by a TLSRoute of this namespace"));
                    continue;
                }
                if out.contributed.insert(h.clone()) {
                    out.http_hosts
                        .entry(key)
                        .or_default()
                        .push(HostRoutes { owner: route.owner(), routes: tunnel_routes.clone() });
                }
                served.push(h);
            }
            finish(served, ignored)
        }
    }
}

/// The Accepted outcome of a route with hosts: served on some, or none.
fn finish(served: Vec<String>, ignored: Vec<String>) -> Result<String, Refusal> {
    if served.is_empty() {
        let why = if ignored.is_empty() { "no host to publish".to_string() } else { ignored.join("; ") };
        return Err(("NotAllowedByListeners", why));
    }
    let mut msg = format!("published on {}", served.join(", "));
    if !ignored.is_empty() {
        msg.push_str(&format!("; not published: {}", ignored.join("; ")));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj<K: serde::de::DeserializeOwned>(v: serde_json::Value) -> K {
        serde_json::from_value(v).unwrap()
    }

    const S: Settings<'static> = Settings {
        edge_domain: "edge.test",
        public_host: "edge.example.com",
        https_port: 8443,
        tcp_ports: (20000, 20010),
        domain_policy: DomainPolicy::Auto,
    };

    #[test]
    fn hostnames_match_and_intersect_as_gateway_api_says() {
        let table = [
            ("a.example.com", "a.example.com", true),
            ("*.example.com", "a.example.com", true),
            ("*.example.com", "a.b.example.com", true),
            ("*.example.com", "example.com", false),
            ("*.example.com", "aexample.com", false),
            ("a.example.com", "b.example.com", false),
        ];
        for (pattern, host, want) in table {
            assert_eq!(host_matches(pattern, host), want, "{pattern} {host}");
        }
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let some = |v: &[&str]| v.iter().map(|x| Some(x.to_string())).collect::<Vec<_>>();
        assert_eq!(intersect(&[], None), vec![None]);
        assert_eq!(intersect(&[], Some("*.edge.test")), some(&["*.edge.test"]));
        assert_eq!(intersect(&s(&["A.Edge.Test."]), None), some(&["a.edge.test"]));
        assert_eq!(intersect(&s(&["a.edge.test", "b.other"]), Some("*.edge.test")), some(&["a.edge.test"]));
        assert_eq!(intersect(&s(&["*.edge.test"]), Some("a.edge.test")), some(&["a.edge.test"]));
        assert_eq!(intersect(&s(&["*.a.edge.test"]), Some("*.edge.test")), some(&["*.a.edge.test"]));
        assert!(intersect(&s(&["b.other"]), Some("a.edge.test")).is_empty());
    }

    #[test]
    fn reference_grants_name_the_kind_the_namespace_and_the_service() {
        let g: ReferenceGrant =
            obj(json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": "g", "namespace": "backends"},
            "spec": {"from": [{"group": GROUP, "kind": "HTTPRoute", "namespace": "web"}],
                "to": [{"group": "", "kind": "Service", "name": "api"}]}}));
        let any: ReferenceGrant =
            obj(json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": "h", "namespace": "backends"},
            "spec": {"from": [{"group": GROUP, "kind": "TCPRoute", "namespace": "web"}],
                "to": [{"group": "", "kind": "Service"}]}}));
        let grants = [g, any];
        assert!(granted(&grants, "HTTPRoute", "web", "backends", "api"));
        assert!(!granted(&grants, "HTTPRoute", "web", "backends", "db"), "another Service");
        assert!(!granted(&grants, "HTTPRoute", "other", "backends", "api"), "another namespace");
        assert!(!granted(&grants, "GRPCRoute", "web", "backends", "api"), "another kind");
        assert!(
            !granted(&grants, "HTTPRoute", "web", "elsewhere", "api"),
            "a grant lives in the target namespace"
        );
        assert!(granted(&grants, "TCPRoute", "web", "backends", "db"), "no name: every Service");
    }

    #[test]
    fn listeners_are_checked_alone_then_together() {
        let all: BTreeSet<Kind> = [Kind::Http, Kind::Grpc, Kind::Tls, Kind::Tcp, Kind::Udp].into();
        let l = |v: serde_json::Value| -> Listener { obj(v) };
        // (listener, refused reason, kinds, unresolved reason)
        type Case = (Listener, Option<&'static str>, Vec<Kind>, Option<&'static str>);
        let table: Vec<Case> = vec![
            (
                l(json!({"name": "a", "protocol": "HTTPS", "port": 443})),
                None,
                vec![Kind::Http, Kind::Grpc],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "HTTPS", "port": 8443})),
                None,
                vec![Kind::Http, Kind::Grpc],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "HTTPS", "port": 9443})),
                Some("PortUnavailable"),
                vec![],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "HTTP", "port": 80})),
                None,
                vec![Kind::Http, Kind::Grpc],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "HTTP", "port": 8080})),
                Some("PortUnavailable"),
                vec![],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "TLS", "port": 443, "tls": {"mode": "Passthrough"}})),
                None,
                vec![Kind::Tls],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "TLS", "port": 443})),
                Some("UnsupportedProtocol"),
                vec![],
                None,
            ),
            (
                l(json!({"name": "a", "protocol": "HTTPS", "port": 443, "tls": {"mode": "Passthrough"}})),
                Some("UnsupportedProtocol"),
                vec![],
                None,
            ),
            (l(json!({"name": "a", "protocol": "TCP", "port": 20005})), None, vec![Kind::Tcp], None),
            (l(json!({"name": "a", "protocol": "TCP", "port": 5432})), Some("PortUnavailable"), vec![], None),
            (l(json!({"name": "a", "protocol": "UDP", "port": 20005})), None, vec![Kind::Udp], None),
            (
                l(json!({"name": "a", "protocol": "SCTP", "port": 20005})),
                Some("UnsupportedProtocol"),
                vec![],
                None,
            ),
            (
                l(
                    json!({"name": "a", "protocol": "HTTPS", "port": 443, "allowedRoutes": {"kinds": [{"kind": "GRPCRoute"}, {"kind": "TLSRoute"}]}}),
                ),
                None,
                vec![Kind::Grpc],
                Some("InvalidRouteKinds"),
            ),
        ];
        for (listener, refused, kinds, unresolved) in table {
            let e = check_listener(&listener, S, &all);
            assert_eq!(e.refused.as_ref().map(|r| r.0), refused, "{listener:?}");
            assert_eq!(e.kinds, kinds, "{listener:?}");
            assert_eq!(e.unresolved.as_ref().map(|r| r.0), unresolved, "{listener:?}");
        }
        let mut ls: Vec<ListenerEval> = [
            json!({"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "a.edge.test"}),
            json!({"name": "tls", "protocol": "TLS", "port": 443, "hostname": "a.edge.test", "tls": {"mode": "Passthrough"}}),
            json!({"name": "other", "protocol": "TLS", "port": 443, "hostname": "b.edge.test", "tls": {"mode": "Passthrough"}}),
            json!({"name": "http", "protocol": "HTTP", "port": 443}),
        ]
        .into_iter()
        .map(|v| check_listener(&l(v), S, &all))
        .collect();
        check_conflicts(&mut ls);
        let reasons: Vec<Option<&str>> = ls.iter().map(|e| e.conflicted.as_ref().map(|c| c.0)).collect();
        assert_eq!(
            reasons,
            [
                Some("HostnameConflict"),
                Some("HostnameConflict"),
                Some("ProtocolConflict"),
                Some("ProtocolConflict")
            ],
            "the first conflict found is reported"
        );
        ls.pop();
        check_conflicts(&mut ls);
        let reasons: Vec<Option<&str>> = ls.iter().map(|e| e.conflicted.as_ref().map(|c| c.0)).collect();
        assert_eq!(reasons, [Some("HostnameConflict"), Some("HostnameConflict"), None]);
    }

    fn world() -> Observed {
        let class: GatewayClass =
            obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": {"name": "culvert", "generation": 1}, "spec": {"controllerName": CONTROLLER_NAME}}));
        let other: GatewayClass =
            obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": {"name": "nginx"}, "spec": {"controllerName": "k8s.io/nginx"}}));
        let gw: Gateway = obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "edge", "namespace": "infra", "generation": 3},
            "spec": {"gatewayClassName": "culvert", "listeners": [
                {"name": "https", "protocol": "HTTPS", "port": 443, "hostname": "*.edge.test",
                    "allowedRoutes": {"namespaces": {"from": "All"}}},
                {"name": "tcp", "protocol": "TCP", "port": 20001, "allowedRoutes": {"namespaces": {"from": "Same"}}}]}}));
        let foreign: Gateway = obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "nginx", "namespace": "infra"},
            "spec": {"gatewayClassName": "nginx", "listeners": [{"name": "h", "protocol": "HTTP", "port": 80}]}}));
        Observed {
            classes: vec![class, other],
            gateways: vec![gw, foreign],
            served: [Kind::Http, Kind::Grpc, Kind::Tls, Kind::Tcp, Kind::Udp].into(),
            services: [("web", "a"), ("web", "b"), ("infra", "db")]
                .iter()
                .map(|(n, s)| (n.to_string(), s.to_string()))
                .collect(),
            bundle_version: Some("v1.6.3".into()),
            ..Default::default()
        }
    }

    fn http(
        name: &str,
        created: u32,
        hostnames: &[&str],
        parent: serde_json::Value,
        rules: serde_json::Value,
    ) -> Route {
        let r: HTTPRoute = obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": "web", "uid": format!("u-{name}"), "generation": 1,
                "creationTimestamp": format!("2026-01-01T00:00:{created:02}Z")},
            "spec": {"parentRefs": [parent], "hostnames": hostnames, "rules": rules}}));
        Route::from(&r)
    }

    fn accepted<'a>(p: &'a Plan, name: &str) -> (&'a str, &'a str, &'a str) {
        let (_, _, _, st) = p.route_status.iter().find(|(_, _, n, _)| n == name).expect("a status");
        let c = st.parents[0].conditions.iter().find(|c| c.type_ == "Accepted").unwrap();
        (c.status.as_str(), c.reason.as_str(), c.message.as_str())
    }

    fn resolved<'a>(p: &'a Plan, name: &str) -> (&'a str, &'a str) {
        let (_, _, _, st) = p.route_status.iter().find(|(_, _, n, _)| n == name).expect("a status");
        let c = st.parents[0].conditions.iter().find(|c| c.type_ == "ResolvedRefs").unwrap();
        (c.status.as_str(), c.reason.as_str())
    }

    #[test]
    fn routes_of_one_host_merge_oldest_first_into_one_tunnel() {
        let mut o = world();
        let parent = json!({"name": "edge", "namespace": "infra", "sectionName": "https"});
        o.routes = vec![
            // Younger, listed first: its rules come second.
            http(
                "young",
                5,
                &["shop.edge.test"],
                parent.clone(),
                json!([
                {"matches": [{"path": {"type": "PathPrefix", "value": "/"}, "method": "post",
                    "headers": [{"name": "x-env", "value": "canary"}]}],
                 "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"add": [{"name": "x-a", "value": "1"}]}}],
                 "backendRefs": [{"name": "a", "port": 80, "weight": 90}, {"name": "b", "port": 80, "weight": 10}]}]),
            ),
            http(
                "old",
                1,
                &["shop.edge.test"],
                parent.clone(),
                json!([
                {"matches": [{"path": {"type": "Exact", "value": "/x"}}, {"queryParams": [{"name": "q", "value": "1"}]}],
                 "backendRefs": [{"name": "a", "port": 80}]}]),
            ),
            http(
                "regex",
                2,
                &["shop.edge.test"],
                parent.clone(),
                json!([
                {"matches": [{"path": {"type": "RegularExpression", "value": "/.*"}}], "backendRefs": [{"name": "a", "port": 80}]}]),
            ),
            http(
                "mirror",
                3,
                &["other.edge.test"],
                parent.clone(),
                json!([
                {"filters": [{"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "b", "port": 80}}}],
                 "backendRefs": [{"name": "a", "port": 80}]}]),
            ),
        ];
        let p = plan(&o, S);
        assert_eq!(accepted(&p, "old").0, "True");
        assert_eq!(accepted(&p, "young").0, "True");
        assert_eq!(accepted(&p, "regex").1, "UnsupportedValue");
        assert!(accepted(&p, "mirror").2.contains("RequestMirror"), "{:?}", accepted(&p, "mirror"));
        assert_eq!(p.tunnels.len(), 1);
        let t = &p.tunnels[0];
        assert_eq!((t.namespace.as_str(), t.serves.as_str()), ("web", "shop.edge.test"));
        assert_eq!(t.spec.domain.as_deref(), Some(t.name.as_str()), "a Domain made for it");
        assert_eq!(p.domains[0].spec.name.as_deref(), Some("shop"));
        let owners: Vec<&str> = t.owners.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(owners, ["old", "young"]);
        assert_eq!(p.domains[0].owners.len(), 2);
        let r = serde_json::to_value(&t.spec.routes).unwrap();
        assert_eq!(
            r,
            json!([
                {"path": "/x", "pathType": "Exact", "service": {"name": "a", "port": 80}},
                {"path": "/", "pathType": "Prefix", "service": {"name": "a", "port": 80},
                    "queryParams": [{"name": "q", "value": "1", "type": "Exact"}]},
                {"path": "/", "pathType": "Prefix",
                    "backends": [{"name": "a", "port": 80, "weight": 90}, {"name": "b", "port": 80, "weight": 10}],
                    "method": "POST", "headers": [{"name": "x-env", "value": "canary", "type": "Exact"}],
                    "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"add": [{"name": "x-a", "value": "1"}]}}]}
            ])
        );
        // The Gateway counts the two accepted routes on the listener.
        let (_, _, gs) = &p.gateway_status[0];
        assert_eq!(gs.listeners[0].attached_routes, 2);
        assert_eq!(gs.addresses[0].type_, "Hostname");
        assert_eq!(p.gateway_status.len(), 1, "the nginx Gateway is not ours");
        assert_eq!(p.class_status.len(), 1);
    }

    #[test]
    fn refusals_name_their_reason() {
        let mut o = world();
        let p = |v: serde_json::Value| v;
        o.routes = vec![
            http(
                "section",
                1,
                &["a.edge.test"],
                p(json!({"name": "edge", "namespace": "infra", "sectionName": "nope"})),
                json!([]),
            ),
            http(
                "tcp-listener",
                1,
                &["a.edge.test"],
                p(json!({"name": "edge", "namespace": "infra", "sectionName": "tcp"})),
                json!([]),
            ),
            http(
                "hostname",
                1,
                &["a.other.org"],
                p(json!({"name": "edge", "namespace": "infra"})),
                json!([]),
            ),
            http(
                "cross",
                1,
                &["c.edge.test"],
                p(json!({"name": "edge", "namespace": "infra"})),
                json!([{"backendRefs": [{"name": "db", "namespace": "infra", "port": 5432}]}]),
            ),
            http(
                "kind",
                1,
                &["k.edge.test"],
                p(json!({"name": "edge", "namespace": "infra"})),
                json!([{"backendRefs": [{"group": "x.io", "kind": "Bucket", "name": "b"}]}]),
            ),
            http(
                "missing",
                1,
                &["m.edge.test"],
                p(json!({"name": "edge", "namespace": "infra"})),
                json!([{"backendRefs": [{"name": "gone", "port": 80}]}]),
            ),
            http(
                "foreign",
                1,
                &["f.edge.test"],
                p(json!({"name": "nginx", "namespace": "infra"})),
                json!([]),
            ),
        ];
        let plan1 = plan(&o, S);
        assert_eq!(accepted(&plan1, "section").1, "NoMatchingParent");
        assert_eq!(accepted(&plan1, "tcp-listener").1, "NotAllowedByListeners");
        assert_eq!(accepted(&plan1, "hostname").1, "NoMatchingListenerHostname");
        assert_eq!(resolved(&plan1, "cross"), ("False", "RefNotPermitted"));
        assert_eq!(resolved(&plan1, "kind"), ("False", "InvalidKind"));
        assert_eq!(resolved(&plan1, "missing"), ("False", "BackendNotFound"));
        assert!(!plan1.route_status.iter().any(|(_, _, n, _)| n == "foreign"), "not our Gateway: no status");
        // A refused or missing backend keeps its share, marked refused (or
        // left for the Tunnel to find missing): its requests answer 500.
        let route_of = |p: &Plan, host: &str| {
            serde_json::to_value(&p.tunnels.iter().find(|t| t.serves == host).unwrap().spec.routes[0])
                .unwrap()
        };
        let cross = route_of(&plan1, "c.edge.test");
        assert_eq!(cross["service"], json!(null));
        assert_eq!(cross["backends"][0]["namespace"], "infra");
        assert!(
            cross["backends"][0]["refused"].as_str().unwrap().contains("needs a ReferenceGrant"),
            "{cross}"
        );
        let kind = route_of(&plan1, "k.edge.test");
        assert_eq!(kind["backends"][0]["weight"], 1);
        assert!(kind["backends"][0]["refused"].as_str().unwrap().contains("only Services"), "{kind}");
        let missing = route_of(&plan1, "m.edge.test");
        assert_eq!(missing["backends"], json!([{"name": "gone", "port": 80, "weight": 1}]), "{missing}");
        // In a split, each refused backendRef keeps its weight.
        let mut split = o.clone();
        split.routes = vec![http(
            "split",
            1,
            &["s.edge.test"],
            p(json!({"name": "edge", "namespace": "infra"})),
            json!([{"backendRefs": [{"name": "a", "port": 80, "weight": 50},
                {"name": "db", "namespace": "infra", "port": 5432, "weight": 30},
                {"kind": "Bucket", "group": "x.io", "name": "b", "weight": 20}]},
                {"matches": [{"path": {"type": "Exact", "value": "/moved"}}],
                 "filters": [{"type": "RequestRedirect", "requestRedirect": {"hostname": "x.example"}}],
                 "backendRefs": [{"kind": "Bucket", "group": "x.io", "name": "b"}]}]),
        )];
        let ps = plan(&split, S);
        let t = &ps.tunnels[0].spec.routes;
        let shares: Vec<(u32, bool)> =
            t[0].backends.iter().map(|b| (b.weight, b.refused.is_some())).collect();
        assert_eq!(shares, [(50, false), (30, true), (20, true)]);
        assert!(t[1].backends.is_empty() && t[1].service.is_none(), "a redirect uses no backend");
        assert_eq!(resolved(&ps, "split"), ("False", "RefNotPermitted"), "the first problem's reason");
        // With a grant the other namespace's Service is a backend, namespace and all.
        o.grants = vec![obj(
            json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": "g", "namespace": "infra"},
            "spec": {"from": [{"group": GROUP, "kind": "HTTPRoute", "namespace": "web"}], "to": [{"group": "", "kind": "Service"}]}}),
        )];
        let plan2 = plan(&o, S);
        assert_eq!(resolved(&plan2, "cross"), ("True", "ResolvedRefs"));
        let cross = plan2.tunnels.iter().find(|t| t.serves == "c.edge.test").unwrap();
        assert_eq!(cross.spec.routes[0].backends[0].namespace.as_deref(), Some("infra"));
        // A namespace without a Domain, on a listener without hostname: on the
        // edge's default host, matched by host, its backends in its own namespace.
        o.gateways[0].spec.listeners[0].hostname = None;
        let plan3 = plan(&o, S);
        let (status, _, msg) = accepted(&plan3, "missing");
        assert_eq!(status, "True", "{msg}");
        assert!(msg.contains("default host for m.edge.test"), "{msg}");
        let any = plan3.tunnels.iter().find(|t| t.serves == "*").expect("the default host's Tunnel");
        assert_eq!(any.namespace, "infra", "in the Gateway's namespace");
        let rule = any.spec.routes.iter().find(|r| r.hosts == ["m.edge.test"]).expect("its rule");
        assert_eq!(rule.backends[0].namespace.as_deref(), Some(o.routes[0].namespace.as_str()));
        assert!(plan3.domains.iter().any(|d| d.namespace == "infra" && d.spec.fqdn.as_deref() == Some("*")));
        // TCP: routes of another namespace than the listener's (allowedRoutes Same).
        let tcp: TCPRoute = obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "TCPRoute",
            "metadata": {"name": "db", "namespace": "web", "uid": "u-db"},
            "spec": {"parentRefs": [{"name": "edge", "namespace": "infra", "sectionName": "tcp"}],
                "rules": [{"backendRefs": [{"name": "a", "port": 80}]}]}}));
        o.routes = vec![Route::from(&tcp)];
        let plan4 = plan(&o, S);
        assert_eq!(accepted(&plan4, "db").1, "NotAllowedByListeners");
        o.gateways[0].spec.listeners[1].allowed_routes = None;
        o.gateways[0].metadata.namespace = Some("web".into());
        o.routes[0].parent_refs[0].namespace = None;
        let plan5 = plan(&o, S);
        assert_eq!(accepted(&plan5, "db").0, "True");
        assert_eq!(plan5.tcp_ports[0].spec.port, Some(20001));
        assert_eq!(plan5.tunnels[0].spec.protocol, TunnelProtocol::Tcp);
        // UDP: a UdpPort with the listener's port and a Tunnel of protocol udp.
        o.gateways[0].spec.listeners.push(obj(json!({"name": "dns", "protocol": "UDP", "port": 20002})));
        let udp: UDPRoute = obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "UDPRoute",
            "metadata": {"name": "dns", "namespace": "web", "uid": "u-dns"},
            "spec": {"parentRefs": [{"name": "edge", "sectionName": "dns"}],
                "rules": [{"backendRefs": [{"name": "a", "port": 53}]}]}}));
        o.routes.push(Route::from(&udp));
        let plan6 = plan(&o, S);
        assert_eq!(accepted(&plan6, "dns").0, "True", "{:?}", accepted(&plan6, "dns"));
        assert_eq!(plan6.udp_ports[0].spec.port, Some(20002));
        let t = plan6.tunnels.iter().find(|t| t.spec.protocol == TunnelProtocol::Udp).unwrap();
        assert_eq!(t.spec.udp_port.as_deref(), Some(t.name.as_str()));
        assert_eq!(t.spec.tcp_port, None);
    }

    /// Listeners without hostname: the routes of every Gateway of the oldest
    /// namespace's on the default host, merged into one Tunnel there; another
    /// namespace's such listener is Conflicted and not programmed.
    #[test]
    fn listeners_without_hostname_share_the_default_host_of_the_oldest_namespace() {
        let mut o = world();
        let gw = |ns: &str, name: &str, created: u32| -> Gateway {
            obj(json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                "metadata": {"name": name, "namespace": ns, "uid": format!("g-{ns}-{name}"), "generation": 1,
                    "creationTimestamp": format!("2026-01-01T00:00:{created:02}Z")},
                "spec": {"gatewayClassName": "culvert", "listeners": [
                    {"name": "http", "protocol": "HTTP", "port": 80, "allowedRoutes": {"namespaces": {"from": "All"}}}]}}))
        };
        o.gateways = vec![gw("late", "g", 9), gw("web", "a", 1), gw("web", "b", 2)];
        let to = |name: &str| json!({"name": name, "namespace": "web"});
        let rules = |svc: &str| json!([{"backendRefs": [{"name": svc, "port": 80}]}]);
        o.routes = vec![
            http("any", 1, &[], to("a"), rules("a")),
            http("named", 2, &["a.example.com"], to("b"), rules("b")),
            http("elsewhere", 3, &[], json!({"name": "g", "namespace": "late"}), rules("a")),
        ];
        let p = plan(&o, S);
        assert_eq!(accepted(&p, "any").0, "True");
        assert!(
            accepted(&p, "named").2.contains("default host for a.example.com"),
            "{:?}",
            accepted(&p, "named")
        );
        let (status, reason, _) = accepted(&p, "elsewhere");
        assert_eq!((status, reason), ("False", "NoMatchingParent"));
        let t: Vec<_> = p.tunnels.iter().filter(|t| t.serves == "*").collect();
        assert_eq!(t.len(), 1, "one Tunnel for the namespace's Gateways");
        assert_eq!(t[0].namespace, "web");
        let hosts: Vec<Vec<String>> = t[0].spec.routes.iter().map(|r| r.hosts.clone()).collect();
        assert_eq!(
            hosts,
            [vec![], vec!["a.example.com".to_string()]],
            "oldest route first, each with its hosts"
        );
        let owners: Vec<&str> = t[0].owners.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(owners, ["a", "b"]);
        let (_, _, late) = p.gateway_status.iter().find(|(ns, _, _)| ns == "late").unwrap();
        let c = |t: &str| late.listeners[0].conditions.iter().find(|c| c.type_ == t).unwrap().clone();
        assert_eq!(
            (c("Conflicted").status.as_str(), c("Conflicted").reason.as_str()),
            ("True", "HostnameConflict")
        );
        assert!(c("Conflicted").message.contains("Gateway web/a"), "{}", c("Conflicted").message);
        assert_eq!(c("Programmed").status, "False");
        // The holder gone, the next oldest namespace takes it.
        o.gateways.retain(|g| g.namespace().as_deref() != Some("web"));
        let p = plan(&o, S);
        assert_eq!(accepted(&p, "elsewhere").0, "True");
        assert!(p.tunnels.iter().any(|t| t.serves == "*" && t.namespace == "late"));
        let rule = &p.tunnels.iter().find(|t| t.serves == "*").unwrap().spec.routes[0];
        assert_eq!(
            rule.backends[0].namespace.as_deref(),
            Some("web"),
            "the route's Services, in its namespace"
        );
    }

    #[test]
    fn classes_gateways_and_what_we_made() {
        let mut o = world();
        o.bundle_version = Some("v1.2.0".into());
        let p = plan(&o, S);
        let c = &p.class_status[0].1.conditions;
        assert_eq!((c[0].type_.as_str(), c[0].reason.as_str()), ("Accepted", "UnsupportedVersion"));
        assert_eq!((c[1].type_.as_str(), c[1].status.as_str()), ("SupportedVersion", "False"));
        assert!(p.gateway_status.is_empty(), "a class not accepted serves no Gateway");
        // Objects made earlier that no route asks for are deleted.
        o.bundle_version = None;
        o.tunnels = vec![obj(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel",
            "metadata": {"name": "gw-old", "namespace": "web", "labels": {LABEL_MANAGED_BY: MANAGED_BY}},
            "spec": {"domain": "x"}}))];
        let p = plan(&o, S);
        assert_eq!(p.delete_tunnels, [("web".to_string(), "gw-old".to_string())]);
        let (_, _, gs) = &p.gateway_status[0];
        let kinds: Vec<&str> = gs.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(kinds, ["Accepted", "Programmed"]);
        assert_eq!(gs.conditions[0].observed_generation, Some(3));
        assert!(supported_bundle("v1.6.3") && supported_bundle("v1.7.0") && !supported_bundle("v1.5.1"));
    }

    #[test]
    fn certificate_refs_must_resolve_though_the_edge_uses_its_own() {
        let mut o = world();
        let refs = json!([
            {"name": "ok"},
            {"name": "missing"},
            {"name": "garbage"},
            {"kind": "ConfigMap", "name": "ok"},
            {"group": "example.com", "kind": "Secret", "name": "ok"},
            {"name": "cert", "namespace": "certs"},
            {"name": "other", "namespace": "certs"},
        ]);
        let listeners: Vec<serde_json::Value> = refs
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                json!({"name": format!("l{i}"), "protocol": "HTTPS", "port": 443,
                "hostname": format!("h{i}.edge.test"), "tls": {"certificateRefs": [r]}})
            })
            .collect();
        o.gateways[0].spec.listeners =
            listeners.into_iter().map(|v| serde_json::from_value(v).unwrap()).collect();
        o.cert_secrets = [
            (("infra", "ok"), true),
            (("infra", "garbage"), false),
            (("certs", "cert"), true),
            (("certs", "other"), true),
        ]
        .into_iter()
        .map(|((n, s), ok)| ((n.to_string(), s.to_string()), ok))
        .collect();
        o.grants =
            vec![obj(json!({"apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": "g", "namespace": "certs"},
            "spec": {"from": [{"group": GROUP, "kind": "Gateway", "namespace": "infra"}],
                "to": [{"group": "", "kind": "Secret", "name": "cert"}]}}))];
        let p = plan(&o, S);
        let (_, _, gs) = &p.gateway_status[0];
        let got: Vec<(&str, &str, &str)> = gs
            .listeners
            .iter()
            .map(|l| {
                let c = |t: &str| l.conditions.iter().find(|c| c.type_ == t).unwrap();
                (
                    c("ResolvedRefs").reason.as_str(),
                    c("Programmed").status.as_str(),
                    c("Accepted").status.as_str(),
                )
            })
            .collect();
        let bad = ("InvalidCertificateRef", "False", "True");
        assert_eq!(
            got,
            [
                ("ResolvedRefs", "True", "True"),
                bad,
                bad,
                bad,
                bad,
                ("ResolvedRefs", "True", "True"),
                ("RefNotPermitted", "False", "True")
            ]
        );
    }
}
