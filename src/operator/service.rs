//! The LoadBalancer Service controller: each TCP port of a managed Service
//! becomes a `TcpPort` (the same port number at the edge when it is inside
//! the edge's range and free, else any free one) and a `Tunnel` (protocol
//! tcp), each UDP port a `UdpPort` and a `Tunnel` (protocol udp), all owned
//! by the Service; the public address goes to `status.loadBalancer` and the
//! annotation `culvert.dev/public-ports`. A UdpPort has the TcpPort's spec
//! and status, so it is planned and reported as one (its `protocol` says
//! which it is); only the API it is written to differs.
//!
//! Which Services (safe by default: nothing is published that did not ask):
//! type LoadBalancer with `loadBalancerClass: culvert.dev/tunnel`, or with no
//! class and annotated `culvert.dev/manage: "1"`; other classes never. With
//! `--manage-classless-load-balancers` (the inlets-operator behaviour) also
//! every class-less one not annotated `"0"`, except in `kube-system` (where a
//! stock k3s has Traefik), which still needs the annotation `"1"`.
//!
//! Deleting the Service removes the owned objects (garbage collector) and
//! their finalizers release the ports (unless `culvert.dev/reclaim-policy:
//! Retain`); a Service that stops being managed (type, class, annotation) has
//! them deleted here, and its annotation and status withdrawn.
//!
//! Phases: observe (the TcpPorts and Tunnels made for the Service) → plan
//! (pure: nothing, withdraw, or publish each port) → execute (the children)
//! → report (pure: the annotation, status and events) → write them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{
    LoadBalancerIngress, LoadBalancerStatus, PortStatus, Service, ServiceStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as ServiceCondition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use super::names::{
    ANNOTATION_MANAGE, ANNOTATION_PROXY_PROTOCOL, ANNOTATION_PUBLIC_PORTS, ANNOTATION_RECLAIM_POLICY,
    FIELD_MANAGER, LABEL_MANAGED_BY, LABEL_OWNER_UID, LOAD_BALANCER_CLASS,
};
use super::status::{Ctx, Note, apply_status, ready_condition};
use super::{Context, Error};
use crate::api::PortProtocol;
use crate::crd::{
    HttpOptions, ProxyProtocol, ReclaimPolicy, ServiceRef, TcpPort, TcpPortSpec, Tunnel, TunnelProtocol,
    TunnelSpec, UdpPort,
};

/// Value of [`LABEL_MANAGED_BY`] on what this controller makes.
const MANAGED_BY: &str = "service";

/// The namespace where class-less LoadBalancers are never taken without the
/// annotation `culvert.dev/manage: "1"` (k3s puts Traefik there).
const SYSTEM_NAMESPACE: &str = "kube-system";

/// Is this Service published by culvert? `manage_classless`:
/// `--manage-classless-load-balancers`.
pub fn is_managed(svc: &Service, manage_classless: bool) -> bool {
    let Some(spec) = &svc.spec else { return false };
    if spec.type_.as_deref() != Some("LoadBalancer") {
        return false;
    }
    let manage = svc.annotations().get(ANNOTATION_MANAGE).map(String::as_str);
    match spec.load_balancer_class.as_deref() {
        Some(LOAD_BALANCER_CLASS) => true,
        Some(_) => false,
        None if manage == Some("1") => true,
        None if !manage_classless => false,
        None if svc.namespace().as_deref() == Some(SYSTEM_NAMESPACE) => false,
        None => manage != Some("0"),
    }
}

/// One TCP or UDP port to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortPlan {
    /// The Service port.
    pub port: u16,
    /// Name of its TcpPort (UdpPort) and Tunnel.
    pub name: String,
    /// TCP or UDP.
    pub protocol: PortProtocol,
}

/// What a managed Service asks for (the Service alone, without a client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translated {
    pub ports: Vec<PortPlan>,
    /// Ports that cannot be published, for a Warning event.
    pub rejected: Vec<String>,
    pub proxy: Option<ProxyProtocol>,
    pub reclaim: ReclaimPolicy,
    /// Annotations with values we do not understand.
    pub invalid: Vec<String>,
}

/// Name of the TcpPort and Tunnel of a Service port (at most 63 characters,
/// so it fits a label value).
pub fn object_name(service: &str, port: u16) -> String {
    let name = format!("lb-{service}-{port}");
    if name.len() <= 63 {
        return name;
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, service.as_bytes());
    let hash: String = digest.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("lb-{}-{hash}-{port}", service[..40].trim_end_matches('-'))
}

/// Name of the UdpPort and Tunnel of a Service's UDP port: `lb-<svc>-udp-<port>`
/// (the TCP port of the same number is `lb-<svc>-<port>`).
pub fn udp_object_name(service: &str, port: u16) -> String {
    let name = format!("lb-{service}-udp-{port}");
    if name.len() <= 63 {
        return name;
    }
    let tcp = object_name(service, port);
    let (head, _) = tcp.rsplit_once('-').expect("lb-...-port");
    format!("{head}-udp-{port}")
}

/// Translate: the Service alone, without a client.
pub fn translate(svc: &Service) -> Translated {
    let mut plan = Translated {
        ports: Vec::new(),
        rejected: Vec::new(),
        proxy: None,
        reclaim: ReclaimPolicy::Delete,
        invalid: Vec::new(),
    };
    let annotations = svc.annotations();
    match annotations.get(ANNOTATION_PROXY_PROTOCOL).map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("none") => {}
        Some("v1") => plan.proxy = Some(ProxyProtocol::V1),
        Some("v2") => plan.proxy = Some(ProxyProtocol::V2),
        Some(other) => plan.invalid.push(format!("{ANNOTATION_PROXY_PROTOCOL}: `{other}` is not v1 or v2")),
    }
    match annotations.get(ANNOTATION_RECLAIM_POLICY).map(String::as_str) {
        None | Some("Delete") | Some("delete") => {}
        Some("Retain") | Some("retain") => plan.reclaim = ReclaimPolicy::Retain,
        Some(other) => {
            plan.invalid.push(format!("{ANNOTATION_RECLAIM_POLICY}: `{other}` is not Delete or Retain"))
        }
    }
    let name = svc.name_any();
    for p in svc.spec.iter().flat_map(|s| s.ports.iter().flatten()) {
        let protocol = p.protocol.as_deref().unwrap_or("TCP");
        let Ok(port) = u16::try_from(p.port) else { continue };
        match protocol {
            "TCP" => plan.ports.push(PortPlan {
                port,
                name: object_name(&name, port),
                protocol: PortProtocol::Tcp,
            }),
            "UDP" => plan.ports.push(PortPlan {
                port,
                name: udp_object_name(&name, port),
                protocol: PortProtocol::Udp,
            }),
            _ => plan
                .rejected
                .push(format!("{protocol} port {port} is not published: culvert carries TCP and UDP only")),
        }
    }
    if plan.proxy == Some(ProxyProtocol::V1) && plan.ports.iter().any(|p| p.protocol == PortProtocol::Udp) {
        plan.invalid.push(format!(
            "{ANNOTATION_PROXY_PROTOCOL}: v1 has no UDP form, so the UDP ports get no PROXY header: use v2 (TCP and UDP)"
        ));
    }
    plan
}

/// The port to ask the edge for: the Service's own when inside the edge's
/// range, unless asking for it already failed (then any free one).
fn wanted_port(port: u16, range: Option<(u16, u16)>, existing: Option<&TcpPort>) -> Option<u16> {
    if let Some(p) = existing {
        let failed = p
            .status
            .as_ref()
            .and_then(|s| ready_condition(&s.conditions))
            .is_some_and(|c| c.status == "False" && c.reason == "Conflict");
        if p.spec.port.is_none() || (failed && p.spec.port == Some(port)) {
            return None;
        }
    }
    range.filter(|(first, last)| (*first..=*last).contains(&port)).map(|_| port)
}

/// The labels and owner of what is made for `svc`.
fn child_meta(svc: &Service, name: &str) -> serde_json::Value {
    json!({
        "name": name,
        "labels": { LABEL_MANAGED_BY: MANAGED_BY, LABEL_OWNER_UID: svc.uid().unwrap_or_default() },
        "ownerReferences": [svc.controller_owner_ref(&())],
    })
}

/// Did this operator write (annotation or status) to the Service?
fn touched(svc: &Service) -> bool {
    svc.managed_fields().iter().any(|m| m.manager.as_deref() == Some(FIELD_MANAGER))
}

/// Does a reconcile of `svc` read anything? Not for a Service being deleted
/// (the garbage collector and the children's finalizers do the work), nor
/// for one that is not managed and was never written to.
pub fn needs_reading(svc: &Service, manage_classless: bool) -> bool {
    svc.metadata.deletion_timestamp.is_none() && (is_managed(svc, manage_classless) || touched(svc))
}

/// What a Service reconcile read: what this controller made for it.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// Its TcpPorts and UdpPorts (as the TcpPort each mirrors), by name.
    pub ports: BTreeMap<String, TcpPort>,
    /// Names in `ports` that are UdpPorts.
    pub udp: std::collections::BTreeSet<String>,
    pub tunnels: Vec<Tunnel>,
}

/// A UdpPort as the TcpPort of the same spec and status (see the module docs).
pub fn as_tcp_port(u: UdpPort) -> TcpPort {
    TcpPort {
        metadata: u.metadata,
        spec: TcpPortSpec {
            port: u.spec.port,
            reclaim_policy: u.spec.reclaim_policy,
            idle_timeout_seconds: None,
        },
        status: u.status,
    }
}

fn children(svc: &Service) -> ListParams {
    ListParams::default().labels(&format!(
        "{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_OWNER_UID}={}",
        svc.uid().unwrap_or_default()
    ))
}

async fn observe(client: &Client, ns: &str, svc: &Service) -> Result<Observed, Error> {
    let children = children(svc);
    let ports = Api::<TcpPort>::namespaced(client.clone(), ns).list(&children).await?.items;
    let udp_ports = Api::<UdpPort>::namespaced(client.clone(), ns).list(&children).await?.items;
    let tunnels = Api::<Tunnel>::namespaced(client.clone(), ns).list(&children).await?.items;
    let udp = udp_ports.iter().map(|p| p.name_any()).collect();
    let ports = ports.into_iter().chain(udp_ports.into_iter().map(as_tcp_port));
    Ok(Observed { ports: ports.map(|p| (p.name_any(), p)).collect(), udp, tunnels })
}

/// What a reconcile of a Service does.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Nothing to do.
    Nothing,
    /// No longer managed: withdraw what was written and made for it.
    Withdraw(Withdraw),
    /// Managed: publish each TCP port.
    Publish(Publish),
}

/// Withdrawing a Service: its status first, then its TcpPorts and Tunnels,
/// and, once their finalizers have released the ports and revoked the keys,
/// the annotation `culvert.dev/public-ports` (while it is there, [`touched`]
/// brings the Service back here).
#[derive(Debug, Clone, PartialEq)]
pub struct Withdraw {
    /// Children to delete (those not being deleted already).
    pub delete_tunnels: Vec<String>,
    /// TcpPorts and UdpPorts (those in `udp`).
    pub delete_ports: Vec<String>,
    pub udp: std::collections::BTreeSet<String>,
    /// Children are left (to delete, or being finalized): the annotation stays.
    pub children_left: bool,
    /// The annotation `culvert.dev/public-ports` as it was.
    pub released: String,
}

/// Publishing a managed Service.
#[derive(Debug, Clone, PartialEq)]
pub struct Publish {
    /// What the Service asks for.
    pub translated: Translated,
    /// Each TCP port, in the Service's order.
    pub ports: Vec<PortAction>,
    /// Children of ports that went away.
    pub delete_tunnels: Vec<String>,
    /// TcpPorts and UdpPorts (those in `udp`).
    pub delete_ports: Vec<String>,
    pub udp: std::collections::BTreeSet<String>,
}

/// One TCP or UDP port of a managed Service.
#[derive(Debug, Clone, PartialEq)]
pub struct PortAction {
    /// The Service port.
    pub port: u16,
    /// Name of its TcpPort (UdpPort) and Tunnel.
    pub name: String,
    /// TCP (a TcpPort) or UDP (a UdpPort of the same spec).
    pub protocol: PortProtocol,
    /// The specs to apply (`None`: this port takes any free port and waits
    /// for those asking for their own number).
    pub apply: Option<(TcpPortSpec, Box<TunnelSpec>)>,
}

/// Decides, without IO, what the Service needs from what was observed.
/// `range`: the edge's TCP port range.
pub fn plan(svc: &Service, o: &Observed, manage_classless: bool, range: Option<(u16, u16)>) -> Plan {
    if !needs_reading(svc, manage_classless) {
        return Plan::Nothing;
    }
    if !is_managed(svc, manage_classless) {
        let live = |deleting: bool, name: String| (!deleting).then_some(name);
        return Plan::Withdraw(Withdraw {
            delete_tunnels: o
                .tunnels
                .iter()
                .filter_map(|t| live(t.metadata.deletion_timestamp.is_some(), t.name_any()))
                .collect(),
            delete_ports: o
                .ports
                .values()
                .filter_map(|p| live(p.metadata.deletion_timestamp.is_some(), p.name_any()))
                .collect(),
            children_left: !o.tunnels.is_empty() || !o.ports.is_empty(),
            released: svc.annotations().get(ANNOTATION_PUBLIC_PORTS).cloned().unwrap_or_default(),
            udp: o.udp.clone(),
        });
    }
    let translated = translate(svc);
    let wanted: Vec<Option<u16>> =
        translated.ports.iter().map(|p| wanted_port(p.port, range, o.ports.get(&p.name))).collect();
    // Ports that take any free port wait until those asking for their own
    // number have it, or the edge's lowest free port could be one of those.
    let specific_settled = translated.ports.iter().zip(&wanted).filter(|(_, w)| w.is_some()).all(|(p, _)| {
        o.ports.get(&p.name).and_then(|t| t.status.as_ref()).is_some_and(|s| {
            s.port.is_some() || ready_condition(&s.conditions).is_some_and(|c| c.status == "False")
        })
    });
    let ports = translated
        .ports
        .iter()
        .zip(wanted)
        .map(|(p, want)| {
            let waits = want.is_none() && !o.ports.contains_key(&p.name) && !specific_settled;
            let tcp_port =
                TcpPortSpec { port: want, reclaim_policy: translated.reclaim, idle_timeout_seconds: None };
            let udp = p.protocol == PortProtocol::Udp;
            let tunnel = TunnelSpec {
                service: Some(ServiceRef { name: svc.name_any(), port: IntOrString::Int(p.port.into()) }),
                routes: Vec::new(),
                protocol: if udp { TunnelProtocol::Udp } else { TunnelProtocol::Tcp },
                domain: None,
                tcp_port: (!udp).then(|| p.name.clone()),
                udp_port: udp.then(|| p.name.clone()),
                // v1 has no UDP form (translate() warns about it).
                proxy_protocol: translated.proxy.filter(|v| !udp || *v == ProxyProtocol::V2),
                options: HttpOptions::default(),
            };
            PortAction {
                port: p.port,
                name: p.name.clone(),
                protocol: p.protocol,
                apply: (!waits).then(|| (tcp_port, Box::new(tunnel))),
            }
        })
        .collect();
    let names: Vec<&str> = translated.ports.iter().map(|p| p.name.as_str()).collect();
    let gone = |name: &String| !names.contains(&name.as_str());
    Plan::Publish(Publish {
        delete_tunnels: o.tunnels.iter().map(|t| t.name_any()).filter(gone).collect(),
        delete_ports: o.ports.keys().filter(|n| gone(n)).cloned().collect(),
        udp: o.udp.clone(),
        ports,
        translated,
    })
}

/// Withdraws a Service that is no longer managed. `false`: children are
/// still being finalized (their deletion triggers the next reconcile).
async fn withdraw(svc: &Service, ctx: &Ctx, ns: &str, w: &Withdraw) -> Result<bool, Error> {
    let client = ctx.base.client.clone();
    let api = Api::<Service>::namespaced(client.clone(), ns);
    apply_status(&api, svc, &ServiceStatus::default()).await?;
    let dp = DeleteParams::background();
    let tunnels = Api::<Tunnel>::namespaced(client.clone(), ns);
    for name in &w.delete_tunnels {
        tunnels.delete(name, &dp).await?;
    }
    for name in &w.delete_ports {
        delete_port(&client, ns, name, w.udp.contains(name)).await?;
    }
    if w.children_left {
        return Ok(false);
    }
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let empty = json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": svc.name_any() } });
    api.patch(&svc.name_any(), &pp, &Patch::Apply(&empty)).await?;
    let note = if w.released.is_empty() {
        "no longer managed by culvert: its tunnels were removed".to_string()
    } else {
        format!(
            "no longer managed by culvert: removed its tunnels and released its public ports ({})",
            w.released
        )
    };
    info!(service = %svc.name_any(), "{note}");
    ctx.report(svc, "published", false, "Released", note).await;
    Ok(true)
}

/// The condition type on a managed Service's `status.conditions`: every
/// port published and an agent connected for each.
pub const SERVICE_CONNECTED: &str = "culvert.dev/Connected";

/// One Service port as the status sees it: the Service port, and once
/// published its public port and whether an agent is connected.
type PortState = (u16, Option<(u16, bool)>);

/// `(status, reason, message)` of [`SERVICE_CONNECTED`].
pub fn service_condition(ports: &[PortState]) -> (&'static str, &'static str, String) {
    let pending: Vec<String> =
        ports.iter().filter(|(_, p)| p.is_none()).map(|(s, _)| s.to_string()).collect();
    let offline: Vec<String> = ports
        .iter()
        .filter_map(|(s, p)| {
            p.filter(|(_, connected)| !connected).map(|(public, _)| format!("{s} (public {public})"))
        })
        .collect();
    if ports.is_empty() {
        return ("False", "NotPublished", "the Service has no TCP or UDP port to publish".into());
    }
    if !offline.is_empty() {
        let message = format!(
            "no agent connected at the edge for port(s) {}: {}",
            offline.join(", "),
            super::tunnel::NO_AGENT_HINT
        );
        ("False", "NoAgent", message)
    } else if !pending.is_empty() {
        (
            "False",
            "NotPublished",
            format!("port(s) {} not published yet (see the events)", pending.join(", ")),
        )
    } else {
        ("True", "AgentsConnected", "every port is published and has an agent connected at the edge".into())
    }
}

/// The condition for `status.conditions`, keeping the transition time of the Service's.
fn connected_condition(svc: &Service, ports: &[PortState]) -> ServiceCondition {
    let (status, reason, message) = service_condition(ports);
    let old = svc
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == SERVICE_CONNECTED))
        .filter(|c| c.status == status && c.reason == reason);
    let since = old.map(|c| c.last_transition_time.clone()).unwrap_or_else(|| Time(Timestamp::now()));
    ServiceCondition {
        type_: SERVICE_CONNECTED.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: since,
        observed_generation: svc.metadata.generation,
    }
}

/// The edge's public address for `status.loadBalancer.ingress[]`: each
/// public port, with the error `culvert.dev/NoAgent` while no agent is
/// connected for it.
async fn lb_ingress(host: &str, ports: &[(u16, bool)], udp: &[bool]) -> LoadBalancerIngress {
    let ports: Vec<PortStatus> = ports
        .iter()
        .zip(udp.iter().chain(std::iter::repeat(&false)))
        .map(|((p, connected), udp)| PortStatus {
            port: (*p).into(),
            protocol: if *udp { "UDP" } else { "TCP" }.into(),
            error: (!connected).then(|| super::tunnel::PORT_ERROR_NO_AGENT.to_string()),
        })
        .collect();
    let entry = |hostname: Option<String>, ip: Option<String>| LoadBalancerIngress {
        hostname,
        ip,
        ip_mode: None,
        ports: Some(ports.clone()),
    };
    if host.parse::<IpAddr>().is_ok() {
        return entry(None, Some(host.into()));
    }
    let resolved = tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host((host, 0))).await;
    match resolved.ok().and_then(|r| r.ok()).and_then(|mut a| a.next()) {
        Some(a) => entry(Some(host.into()), Some(a.ip().to_string())),
        None => entry(Some(host.into()), None),
    }
}

/// What a reconcile of a managed Service writes after its children.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// `culvert.dev/public-ports`: `servicePort=publicPort,…`.
    pub public_ports: String,
    /// The edge's host and each public port with whether an agent is
    /// connected, for `status.loadBalancer` (`None`: nothing published).
    pub address: Option<(String, Vec<(u16, bool)>)>,
    pub condition: ServiceCondition,
    /// Notes by topic, in order (`None`: the topic is fine again).
    pub notes: Vec<(String, Option<Note>)>,
    pub requeue: Duration,
    /// For each public port of `address`, whether it is UDP.
    pub udp_ports: Vec<bool>,
}

/// The annotation, status, events and requeue of a managed Service from its
/// plan and its children as applied (`None`: not applied), without IO.
pub fn report(svc: &Service, p: &Publish, applied: &[Option<(TcpPort, Tunnel)>], resync: Duration) -> Report {
    let mut published: Vec<(u16, u16)> = Vec::new();
    let mut udp_public = Vec::new();
    // `servicePort=publicPort`; `53/udp=20053` for a UDP port (a Service may
    // have TCP 53 and UDP 53).
    let mut annotation = Vec::new();
    let mut states: Vec<PortState> = Vec::new();
    let mut host = None;
    let mut problems = Vec::new();
    for (port, applied) in p.ports.iter().zip(applied) {
        let Some((tcp_port, tunnel)) = applied else {
            states.push((port.port, None));
            continue;
        };
        let status = tcp_port.status.clone().unwrap_or_default();
        let tunnel_conditions = tunnel.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
        let connected = super::tunnel::is_connected(tunnel_conditions);
        states.push((
            port.port,
            status.port.filter(|_| status.address.is_some()).map(|public| (public, connected)),
        ));
        match (status.port, status.address) {
            (Some(public), Some(address)) => {
                published.push((port.port, public));
                let udp = port.protocol == PortProtocol::Udp;
                udp_public.push(udp);
                annotation.push(if udp {
                    format!("{}/udp={public}", port.port)
                } else {
                    format!("{}={public}", port.port)
                });
                let h = address.rsplit_once(':').map(|(h, _)| h).unwrap_or(&address);
                host = Some(h.trim_start_matches('[').trim_end_matches(']').to_string());
            }
            _ => {
                if let Some(c) = ready_condition(&status.conditions).filter(|c| c.status == "False") {
                    let kind = if port.protocol == PortProtocol::Udp { "UdpPort" } else { "TcpPort" };
                    problems.push(format!("port {}: {kind} {}: {}", port.port, port.name, c.message));
                }
            }
        }
        let tunnel_cond = tunnel.status.as_ref().and_then(|s| ready_condition(&s.conditions));
        // Waiting (for the port) and NoAgent (the condition says it) are no problems to warn about.
        if let Some(c) = tunnel_cond
            .filter(|c| c.status == "False" && !["Waiting", "NoAgent"].contains(&c.reason.as_str()))
        {
            problems.push(format!("port {}: Tunnel {}: {}", port.port, port.name, c.message));
        }
    }
    let public_ports = annotation.join(",");
    let address = match &host {
        Some(h) if !published.is_empty() => {
            Some((h.clone(), states.iter().filter_map(|(_, p)| *p).collect()))
        }
        _ => None,
    };
    // Events, on transitions. (The event recorder folds later events of the
    // same reason into the first one, note and all: so Published once every
    // port has its public port, naming them all.)
    let mut notes = Vec::new();
    if let Some(h) = host.as_ref().filter(|_| published.len() == p.ports.len()) {
        let what: Vec<String> = published.iter().map(|(s, p)| format!("port {s} → {h}:{p}")).collect();
        notes.push(("published".to_string(), Some(Note::new(false, "Published", what.join(", ")))));
    }
    let (_, reason, message) = service_condition(&states);
    if reason != "NotPublished" {
        notes.push(("connected".to_string(), Some(Note::new(false, reason, message))));
    }
    let t = &p.translated;
    for (topic, list, reason) in [
        ("rejected", &t.rejected, "UnsupportedProtocol"),
        ("invalid", &t.invalid, "InvalidAnnotation"),
        ("problems", &problems, "NotPublished"),
    ] {
        let note = (!list.is_empty()).then(|| Note::new(true, reason, list.join("; ")));
        notes.push((topic.to_string(), note));
    }
    // Not connected: the Tunnel's status changes when an agent connects, and brings us back.
    let pending = published.len() < p.ports.len();
    let requeue = if pending { resync.min(Duration::from_secs(5)) } else { resync };
    Report {
        public_ports,
        address,
        udp_ports: udp_public,
        condition: connected_condition(svc, &states),
        notes,
        requeue,
    }
}

/// Carries out the publishing in Kubernetes (a Service holds nothing at the
/// edge itself: its TcpPorts and Tunnels do): each port's TcpPort and
/// Tunnel, then the removal of ports that went away.
async fn execute(
    svc: &Service,
    client: &Client,
    ns: &str,
    p: &Publish,
) -> Result<Vec<Option<(TcpPort, Tunnel)>>, Error> {
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let port_api = Api::<TcpPort>::namespaced(client.clone(), ns);
    let udp_port_api = Api::<UdpPort>::namespaced(client.clone(), ns);
    let tunnel_api = Api::<Tunnel>::namespaced(client.clone(), ns);
    let mut applied = Vec::new();
    for port in &p.ports {
        let Some((tcp_port, tunnel)) = &port.apply else {
            applied.push(None);
            continue;
        };
        let udp = port.protocol == PortProtocol::Udp;
        let body = json!({ "apiVersion": "culvert.dev/v1alpha1", "kind": if udp { "UdpPort" } else { "TcpPort" },
            "metadata": child_meta(svc, &port.name), "spec": tcp_port });
        let tcp_port = if udp {
            as_tcp_port(udp_port_api.patch(&port.name, &pp, &Patch::Apply(&body)).await?)
        } else {
            port_api.patch(&port.name, &pp, &Patch::Apply(&body)).await?
        };
        let body = json!({ "apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel",
            "metadata": child_meta(svc, &port.name), "spec": tunnel });
        let tunnel = tunnel_api.patch(&port.name, &pp, &Patch::Apply(&body)).await?;
        applied.push(Some((tcp_port, tunnel)));
    }
    let dp = DeleteParams::background();
    for name in &p.delete_tunnels {
        tunnel_api.delete(name, &dp).await?;
    }
    for name in &p.delete_ports {
        delete_port(client, ns, name, p.udp.contains(name)).await?;
    }
    Ok(applied)
}

/// Deletes a TcpPort, or a UdpPort.
async fn delete_port(client: &Client, ns: &str, name: &str, udp: bool) -> Result<(), Error> {
    let dp = DeleteParams::background();
    if udp {
        Api::<UdpPort>::namespaced(client.clone(), ns).delete(name, &dp).await?;
    } else {
        Api::<TcpPort>::namespaced(client.clone(), ns).delete(name, &dp).await?;
    }
    Ok(())
}

/// Observe → plan → execute (the children) → the annotation and status → events.
async fn apply(svc: Arc<Service>, ctx: &Ctx, ns: &str) -> Result<Action, Error> {
    let base = &ctx.base;
    if !needs_reading(&svc, base.manage_classless) {
        return Ok(Action::await_change());
    }
    let observed = observe(&base.client, ns, &svc).await?;
    let range = Some((base.edge_info.tcp_ports.first, base.edge_info.tcp_ports.last));
    let publish = match plan(&svc, &observed, base.manage_classless, range) {
        Plan::Nothing => return Ok(Action::await_change()),
        Plan::Withdraw(w) => {
            if !withdraw(&svc, ctx, ns, &w).await? {
                // Children still being finalized: their deletion brings us back,
                // the requeue in case a watch event is missed.
                return Ok(Action::requeue(base.resync.min(Duration::from_secs(5))));
            }
            return Ok(Action::await_change());
        }
        Plan::Publish(p) => p,
    };
    let applied = execute(&svc, &base.client, ns, &publish).await?;
    let report = report(&svc, &publish, &applied, base.resync);

    // Annotation (always written, so a later withdraw knows we were here) and status.
    let api = Api::<Service>::namespaced(base.client.clone(), ns);
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let meta = json!({ "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": svc.name_any(), "annotations": { ANNOTATION_PUBLIC_PORTS: report.public_ports } } });
    let now = api.patch(&svc.name_any(), &pp, &Patch::Apply(&meta)).await?;
    if !is_managed(&now, base.manage_classless) {
        // Changed since this reconcile read it (another type or class): the
        // API would refuse a load balancer status on a type other than
        // LoadBalancer, and the change's watch event brings it back to be
        // withdrawn.
        return Ok(Action::await_change());
    }
    let ingress = match &report.address {
        Some((host, ports)) => Some(vec![lb_ingress(host, ports, &report.udp_ports).await]),
        None => None,
    };
    let status = ServiceStatus {
        load_balancer: Some(LoadBalancerStatus { ingress }),
        conditions: Some(vec![report.condition]),
    };
    apply_status(&api, &*svc, &status).await?;
    ctx.report_all(&*svc, report.notes).await;
    Ok(Action::requeue(report.requeue))
}

async fn reconcile(svc: Arc<Service>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = svc.namespace().unwrap_or_default();
    let span = tracing::info_span!("reconcile", kind = "Service", namespace = %ns, name = %svc.name_any());
    ctx.base.metrics.measure("Service", &*svc, apply(svc.clone(), &ctx, &ns).instrument(span)).await
}

fn error_policy(obj: Arc<Service>, e: &Error, _ctx: Arc<Ctx>) -> Action {
    super::log_failure("Service", obj.meta(), e);
    Action::requeue(Duration::from_secs(5))
}

pub async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let client = ctx.client.clone();
    let ns = ctx.watch_namespace.clone();
    let managed = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY}"));
    Controller::new(
        super::watched::<Service>(&client, ns.as_deref()),
        watcher::Config::default().any_semantic(),
    )
    .owns(super::watched::<TcpPort>(&client, ns.as_deref()), managed.clone())
    .owns(super::watched::<UdpPort>(&client, ns.as_deref()), managed.clone())
    .owns(super::watched::<Tunnel>(&client, ns.as_deref()), managed)
    .graceful_shutdown_on(async move { stop.cancelled().await })
    .run(reconcile, error_policy, Ctx::new(ctx))
    .for_each(|_| async {})
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(yaml: &str) -> Service {
        serde_saphyr::from_str(yaml).unwrap()
    }

    #[test]
    fn which_services_are_managed() {
        let svc = |ns: &str, class: Option<&str>, manage: Option<&str>, type_: &str| {
            let mut v = json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "db", "namespace": ns},
                "spec": {"type": type_, "ports": [{"port": 5432}]}});
            if let Some(c) = class {
                v["spec"]["loadBalancerClass"] = json!(c);
            }
            if let Some(m) = manage {
                v["metadata"]["annotations"] = json!({ANNOTATION_MANAGE: m});
            }
            serde_json::from_value::<Service>(v).unwrap()
        };
        let ours = Some("culvert.dev/tunnel");
        let other = Some("metallb.io/x");
        // (namespace, class, annotation, type, managed by default, managed with the opt-in)
        let table = [
            ("apps", None, None, "LoadBalancer", false, true),
            ("apps", None, Some("1"), "LoadBalancer", true, true),
            ("apps", None, Some("0"), "LoadBalancer", false, false),
            ("apps", None, Some("yes"), "LoadBalancer", false, true),
            ("kube-system", None, None, "LoadBalancer", false, false),
            ("kube-system", None, Some("0"), "LoadBalancer", false, false),
            ("kube-system", None, Some("1"), "LoadBalancer", true, true),
            ("apps", ours, None, "LoadBalancer", true, true),
            ("kube-system", ours, None, "LoadBalancer", true, true),
            ("apps", other, None, "LoadBalancer", false, false),
            ("apps", other, Some("1"), "LoadBalancer", false, false),
            ("apps", None, Some("1"), "ClusterIP", false, false),
            ("apps", None, None, "NodePort", false, false),
        ];
        for (ns, class, manage, type_, by_default, opted_in) in table {
            let s = svc(ns, class, manage, type_);
            let case = format!("{ns} {class:?} {manage:?} {type_}");
            assert_eq!(is_managed(&s, false), by_default, "default: {case}");
            assert_eq!(is_managed(&s, true), opted_in, "--manage-classless-load-balancers: {case}");
        }
    }

    #[test]
    fn plan_publishes_tcp_and_udp_and_reads_annotations() {
        let svc = service(
            r#"
apiVersion: v1
kind: Service
metadata:
  name: game
  annotations: {culvert.dev/proxy-protocol: v2, culvert.dev/reclaim-policy: Retain}
spec:
  type: LoadBalancer
  ports:
    - {name: tcp, port: 7777}
    - {name: udp, port: 7777, protocol: UDP}
    - {name: admin, port: 8080, protocol: TCP}
    - {name: sctp, port: 9999, protocol: SCTP}
"#,
        );
        let p = translate(&svc);
        let (tcp, udp) = (PortProtocol::Tcp, PortProtocol::Udp);
        assert_eq!(
            p.ports,
            [
                PortPlan { port: 7777, name: "lb-game-7777".into(), protocol: tcp },
                PortPlan { port: 7777, name: "lb-game-udp-7777".into(), protocol: udp },
                PortPlan { port: 8080, name: "lb-game-8080".into(), protocol: tcp }
            ]
        );
        assert_eq!(p.rejected.len(), 1);
        assert!(p.rejected[0].contains("SCTP port 9999"));
        assert_eq!(p.proxy, Some(ProxyProtocol::V2));
        assert!(p.invalid.is_empty());
        // The UDP port becomes a UdpPort and a Tunnel of protocol udp, with v2.
        let Plan::Publish(published) = plan(&svc, &Observed::default(), true, Some((20000, 20999))) else {
            panic!("publishes")
        };
        let (_, tunnel) =
            published.ports[1].apply.as_ref().expect("7777 is outside the range: any port, now");
        assert_eq!(published.ports[1].protocol, udp);
        assert_eq!(
            (tunnel.protocol, tunnel.udp_port.as_deref(), tunnel.tcp_port.as_deref(), tunnel.proxy_protocol),
            (TunnelProtocol::Udp, Some("lb-game-udp-7777"), None, Some(ProxyProtocol::V2))
        );
        // v1 has no UDP form: a warning, and no header on the UDP port.
        let v1 = service(
            "apiVersion: v1\nkind: Service\nmetadata: {name: dns, annotations: {culvert.dev/proxy-protocol: v1}}\nspec: {type: LoadBalancer, loadBalancerClass: culvert.dev/tunnel, ports: [{name: u, port: 53, protocol: UDP}]}\n",
        );
        assert_eq!(translate(&v1).invalid.len(), 1, "{:?}", translate(&v1).invalid);
        let Plan::Publish(published) = plan(&v1, &Observed::default(), false, None) else {
            panic!("publishes")
        };
        assert_eq!(published.ports[0].apply.as_ref().unwrap().1.proxy_protocol, None);
        assert!(udp_object_name(&"s".repeat(63), 65535).len() <= 63);
        assert_eq!(p.reclaim, ReclaimPolicy::Retain);
        let bad = service(
            "apiVersion: v1\nkind: Service\nmetadata: {name: x, annotations: {culvert.dev/proxy-protocol: v3}}\nspec: {type: LoadBalancer}\n",
        );
        assert_eq!(translate(&bad).invalid.len(), 1);
    }

    #[test]
    fn the_same_port_when_it_can_be_had() {
        let range = Some((20000, 20999));
        assert_eq!(wanted_port(20005, range, None), Some(20005));
        assert_eq!(wanted_port(5432, range, None), None, "outside the range: any free port");
        let port = |yaml: &str| -> TcpPort { serde_saphyr::from_str(yaml).unwrap() };
        let conflict = port(
            "apiVersion: culvert.dev/v1alpha1\nkind: TcpPort\nmetadata: {name: p}\nspec: {port: 20005}\nstatus: {conditions: [{type: Ready, status: \"False\", reason: Conflict, message: taken}]}\n",
        );
        assert_eq!(wanted_port(20005, range, Some(&conflict)), None, "taken: fall back to any");
        let fell_back =
            port("apiVersion: culvert.dev/v1alpha1\nkind: TcpPort\nmetadata: {name: p}\nspec: {}\n");
        assert_eq!(wanted_port(20005, range, Some(&fell_back)), None, "stays on the fallback");
        let fine = port(
            "apiVersion: culvert.dev/v1alpha1\nkind: TcpPort\nmetadata: {name: p}\nspec: {port: 20005}\n",
        );
        assert_eq!(wanted_port(20005, range, Some(&fine)), Some(20005));
    }

    #[test]
    fn the_service_condition_says_what_is_missing() {
        // (ports, status, reason, message part)
        let table: [(&[PortState], &str, &str, &str); 6] = [
            (&[], "False", "NotPublished", "no TCP or UDP port"),
            (&[(5432, Some((20005, true)))], "True", "AgentsConnected", "every port"),
            (&[(5432, Some((20005, false)))], "False", "NoAgent", "5432 (public 20005)"),
            (&[(5432, Some((20005, true))), (80, None)], "False", "NotPublished", "port(s) 80"),
            (&[(5432, Some((20005, false))), (80, None)], "False", "NoAgent", "edge.caBundle"),
            (
                &[(5432, Some((20005, true))), (80, Some((20006, false)))],
                "False",
                "NoAgent",
                "80 (public 20006)",
            ),
        ];
        for (ports, status, reason, part) in table {
            let (s, r, m) = service_condition(ports);
            assert_eq!((s, r), (status, reason), "{ports:?}");
            assert!(m.contains(part), "{ports:?}: {m}");
        }
    }

    #[test]
    fn names_fit_a_label() {
        assert_eq!(object_name("db", 5432), "lb-db-5432");
        let long = object_name(&"s".repeat(63), 65535);
        assert!(long.len() <= 63, "{long}");
    }

    fn lb(name: &str, ports: &[u16], annotations: serde_json::Value, managed_fields: bool) -> Service {
        let mut v = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "apps", "uid": "u1", "generation": 1, "annotations": annotations},
            "spec": {"type": "LoadBalancer", "loadBalancerClass": LOAD_BALANCER_CLASS,
                "ports": ports.iter().map(|p| json!({"port": p})).collect::<Vec<_>>()}});
        if managed_fields {
            v["metadata"]["managedFields"] = json!([{"manager": FIELD_MANAGER, "operation": "Apply"}]);
        }
        serde_json::from_value(v).unwrap()
    }

    fn child<K: serde::de::DeserializeOwned>(
        kind: &str,
        name: &str,
        deleting: bool,
        status: serde_json::Value,
    ) -> K {
        let mut v = json!({"apiVersion": "culvert.dev/v1alpha1", "kind": kind,
            "metadata": {"name": name, "namespace": "apps"},
            // A TcpPort asked for the port its status holds.
            "spec": if kind == "TcpPort" { json!({"port": status.get("port")}) } else { json!({"service": {"name": "db", "port": 1}, "protocol": "tcp", "tcpPort": name}) },
            "status": status});
        if deleting {
            v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        serde_json::from_value(v).unwrap()
    }

    fn observed(ports: Vec<TcpPort>, tunnels: Vec<Tunnel>) -> Observed {
        Observed {
            ports: ports.into_iter().map(|p| (p.name_any(), p)).collect(),
            udp: Default::default(),
            tunnels,
        }
    }

    fn summary(p: &Plan) -> String {
        match p {
            Plan::Nothing => "nothing".into(),
            Plan::Withdraw(w) => format!(
                "withdraw: delete tunnels {:?} ports {:?}, left {}, released {:?}",
                w.delete_tunnels, w.delete_ports, w.children_left, w.released
            ),
            Plan::Publish(p) => {
                let ports: Vec<String> = p
                    .ports
                    .iter()
                    .map(|a| match &a.apply {
                        None => format!("{} waits", a.name),
                        Some((port, tunnel)) => format!(
                            "{} port {:?} {:?} → {}:{:?}",
                            a.name,
                            port.port,
                            port.reclaim_policy,
                            tunnel.service.as_ref().unwrap().name,
                            tunnel.service.as_ref().unwrap().port
                        ),
                    })
                    .collect();
                format!(
                    "publish {}; delete tunnels {:?} ports {:?}",
                    ports.join(", "),
                    p.delete_tunnels,
                    p.delete_ports
                )
            }
        }
    }

    #[test]
    fn plans_of_a_service() {
        let range = Some((20000, 20999));
        let db = lb("db", &[20005, 80], json!({}), false);
        let mut deleting = db.clone();
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        let unmanaged = |touched| {
            let mut s = lb("db", &[80], json!({ANNOTATION_PUBLIC_PORTS: "80=20001"}), touched);
            s.spec.as_mut().unwrap().load_balancer_class = None;
            s
        };
        let (never, dropped) = (unmanaged(false), unmanaged(true));
        let held = json!({"port": 20005, "address": "edge.test:20005"});
        let retain = lb("db", &[20005], json!({ANNOTATION_RECLAIM_POLICY: "Retain"}), false);
        // (case, Service, what was made for it, plan)
        let table: Vec<(&str, &Service, Observed, &str)> = vec![
            ("being deleted", &deleting, Observed::default(), "nothing"),
            ("never managed", &never, Observed::default(), "nothing"),
            (
                "no longer managed, children left",
                &dropped,
                observed(
                    vec![child("TcpPort", "lb-db-80", false, json!({}))],
                    vec![child("Tunnel", "lb-db-80", true, json!({}))],
                ),
                r#"withdraw: delete tunnels [] ports ["lb-db-80"], left true, released "80=20001""#,
            ),
            (
                "no longer managed, children gone",
                &dropped,
                Observed::default(),
                r#"withdraw: delete tunnels [] ports [], left false, released "80=20001""#,
            ),
            (
                "any free port waits for the port that asks for its own",
                &db,
                Observed::default(),
                r#"publish lb-db-20005 port Some(20005) Delete → db:Int(20005), lb-db-80 waits; delete tunnels [] ports []"#,
            ),
            (
                "then it is asked for",
                &db,
                observed(vec![child("TcpPort", "lb-db-20005", false, held.clone())], vec![]),
                r#"publish lb-db-20005 port Some(20005) Delete → db:Int(20005), lb-db-80 port None Delete → db:Int(80); delete tunnels [] ports []"#,
            ),
            (
                "a port that went away, and Retain",
                &retain,
                observed(
                    vec![
                        child("TcpPort", "lb-db-20005", false, held.clone()),
                        child("TcpPort", "lb-db-81", false, json!({})),
                    ],
                    vec![child("Tunnel", "lb-db-81", false, json!({}))],
                ),
                r#"publish lb-db-20005 port Some(20005) Retain → db:Int(20005); delete tunnels ["lb-db-81"] ports ["lb-db-81"]"#,
            ),
        ];
        for (case, svc, o, want) in table {
            assert_eq!(summary(&plan(svc, &o, false, range)), want, "{case}");
        }
    }

    #[test]
    fn the_report_of_a_service() {
        let svc = lb("db", &[20005, 80], json!({ANNOTATION_PROXY_PROTOCOL: "v9"}), false);
        let Plan::Publish(p) = plan(&svc, &Observed::default(), false, Some((20000, 20999))) else {
            panic!()
        };
        let resync = Duration::from_secs(300);
        let ready = |s: &str, r: &str| json!([{"type": "Ready", "status": s, "reason": r, "message": "m"}]);
        let port = |n: &str, status| -> TcpPort { child("TcpPort", n, false, status) };
        let tunnel = |n: &str, connected: bool| -> Tunnel {
            let c = if connected { "True" } else { "False" };
            child(
                "Tunnel",
                n,
                false,
                json!({"conditions": [{"type": "Connected", "status": c, "reason": "r", "message": "m"}]}),
            )
        };
        let held = |p: u16| json!({"port": p, "address": format!("edge.test:{p}")});
        // (case, applied, annotation, address, condition reason, published note, requeue)
        type Address<'a> = Option<(&'a str, Vec<(u16, bool)>)>;
        type Case<'a> = (&'a str, Vec<Option<(TcpPort, Tunnel)>>, &'a str, Address<'a>, &'a str, bool, u64);
        let table: Vec<Case> = vec![
            ("nothing applied yet", vec![None, None], "", None, "NotPublished", false, 5),
            (
                "one port held, one waiting",
                vec![Some((port("lb-db-20005", held(20005)), tunnel("lb-db-20005", true))), None],
                "20005=20005",
                Some(("edge.test", vec![(20005, true)])),
                "NotPublished",
                false,
                5,
            ),
            (
                "both held, one without an agent",
                vec![
                    Some((port("lb-db-20005", held(20005)), tunnel("lb-db-20005", true))),
                    Some((port("lb-db-80", held(20006)), tunnel("lb-db-80", false))),
                ],
                "20005=20005,80=20006",
                Some(("edge.test", vec![(20005, true), (20006, false)])),
                "NoAgent",
                true,
                300,
            ),
            (
                "a port refused",
                vec![
                    Some((
                        port("lb-db-20005", json!({"conditions": ready("False", "Conflict")})),
                        tunnel("lb-db-20005", false),
                    )),
                    None,
                ],
                "",
                None,
                "NotPublished",
                false,
                5,
            ),
        ];
        for (case, applied, annotation, address, reason, published, requeue) in table {
            let r = report(&svc, &p, &applied, resync);
            assert_eq!(r.public_ports, annotation, "{case}");
            let got = r.address.as_ref().map(|(h, p)| (h.as_str(), p.clone()));
            assert_eq!(got, address, "{case}");
            assert_eq!(r.condition.reason, reason, "{case}");
            assert_eq!(r.condition.type_, SERVICE_CONNECTED, "{case}");
            assert_eq!(r.notes.iter().any(|(t, n)| t == "published" && n.is_some()), published, "{case}");
            assert_eq!(r.requeue, Duration::from_secs(requeue), "{case}");
            let invalid = r.notes.iter().find(|(t, _)| t == "invalid").and_then(|(_, n)| n.as_ref());
            assert_eq!(
                invalid.map(|n| (n.warning, n.reason.as_str())),
                Some((true, "InvalidAnnotation")),
                "{case}"
            );
            let refused = r.notes.iter().find(|(t, _)| t == "problems").and_then(|(_, n)| n.as_ref());
            assert_eq!(refused.is_some(), case == "a port refused", "{case}");
        }
    }
}
