//! The LoadBalancer Service controller: each TCP port of a managed Service
//! becomes a `TcpPort` (the same port number at the edge when it is inside
//! the edge's range and free, else any free one) and a `Tunnel` (protocol
//! tcp), both owned by the Service; the public address goes to
//! `status.loadBalancer` and the annotation `culvert.dev/public-ports`.
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

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use super::names::{
    ANNOTATION_MANAGE, ANNOTATION_PROXY_PROTOCOL, ANNOTATION_PUBLIC_PORTS, ANNOTATION_RECLAIM_POLICY,
    FIELD_MANAGER, LABEL_MANAGED_BY, LABEL_OWNER_UID, LOAD_BALANCER_CLASS,
};
use super::status::{Ctx, ready_condition};
use super::{Context, Error};
use crate::crd::{ProxyProtocol, ReclaimPolicy, TcpPort, Tunnel};

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

/// One TCP port to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortPlan {
    /// The Service port.
    pub port: u16,
    /// Name of its TcpPort and Tunnel.
    pub name: String,
}

/// What a managed Service asks for (the Service alone, without a client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
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

pub fn plan(svc: &Service) -> Plan {
    let mut plan = Plan {
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
        if protocol == "TCP" {
            plan.ports.push(PortPlan { port, name: object_name(&name, port) });
        } else {
            plan.rejected
                .push(format!("{protocol} port {port} is not published: culvert carries TCP only (for now)"));
        }
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

/// Withdraws a Service that is no longer managed: its status first, then its
/// TcpPorts and Tunnels, and, once their finalizers have released the ports
/// and revoked the keys, the annotation `culvert.dev/public-ports` (while it
/// is there, [`touched`] brings the Service back here). `false`: children are
/// still being finalized (their deletion triggers the next reconcile).
async fn withdraw(svc: &Service, ctx: &Ctx, ns: &str) -> Result<bool, Error> {
    let client = ctx.base.client.clone();
    let api = Api::<Service>::namespaced(client.clone(), ns);
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let status = json!({ "apiVersion": "v1", "kind": "Service", "status": {} });
    api.patch_status(&svc.name_any(), &pp, &Patch::Apply(&status)).await?;

    let children = ListParams::default().labels(&format!(
        "{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_OWNER_UID}={}",
        svc.uid().unwrap_or_default()
    ));
    let dp = DeleteParams::background();
    let tunnels = Api::<Tunnel>::namespaced(client.clone(), ns);
    let ports = Api::<TcpPort>::namespaced(client.clone(), ns);
    let mut left = 0;
    for t in tunnels.list(&children).await?.items {
        if t.metadata.deletion_timestamp.is_none() {
            tunnels.delete(&t.name_any(), &dp).await?;
        }
        left += 1;
    }
    for p in ports.list(&children).await?.items {
        if p.metadata.deletion_timestamp.is_none() {
            ports.delete(&p.name_any(), &dp).await?;
        }
        left += 1;
    }
    if left > 0 {
        return Ok(false);
    }

    let released = svc.annotations().get(ANNOTATION_PUBLIC_PORTS).cloned().unwrap_or_default();
    let empty = json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": svc.name_any() } });
    api.patch(&svc.name_any(), &pp, &Patch::Apply(&empty)).await?;
    let note = if released.is_empty() {
        "no longer managed by culvert: its tunnels were removed".to_string()
    } else {
        format!(
            "no longer managed by culvert: removed its tunnels and released its public ports ({released})"
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
        return ("False", "NotPublished", "the Service has no TCP port to publish".into());
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

/// The condition for `status.conditions`, keeping the transition time of `old`.
fn service_condition_json(svc: &Service, ports: &[PortState]) -> serde_json::Value {
    let (status, reason, message) = service_condition(ports);
    let old = svc
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == SERVICE_CONNECTED))
        .filter(|c| c.status == status && c.reason == reason);
    let since = old.map(|c| c.last_transition_time.clone()).unwrap_or_else(|| Time(Timestamp::now()));
    json!({
        "type": SERVICE_CONNECTED,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": svc.metadata.generation,
    })
}

/// The edge's public address for `status.loadBalancer.ingress[]`: each
/// public port, with the error `culvert.dev/NoAgent` while no agent is
/// connected for it.
async fn lb_ingress(host: &str, ports: &[(u16, bool)]) -> serde_json::Value {
    let ports: Vec<_> = ports
        .iter()
        .map(|(p, connected)| {
            let mut port = json!({ "port": p, "protocol": "TCP" });
            if !connected {
                port["error"] = json!(super::tunnel::PORT_ERROR_NO_AGENT);
            }
            port
        })
        .collect();
    if host.parse::<IpAddr>().is_ok() {
        return json!({ "ip": host, "ports": ports });
    }
    let resolved = tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host((host, 0))).await;
    match resolved.ok().and_then(|r| r.ok()).and_then(|mut a| a.next()) {
        Some(a) => json!({ "hostname": host, "ip": a.ip().to_string(), "ports": ports }),
        None => json!({ "hostname": host, "ports": ports }),
    }
}

async fn apply(svc: Arc<Service>, ctx: &Ctx, ns: &str) -> Result<Action, Error> {
    let base = &ctx.base;
    if svc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    if !is_managed(&svc, base.manage_classless) {
        if touched(&svc) && !withdraw(&svc, ctx, ns).await? {
            // Children still being finalized: their deletion brings us back,
            // the requeue in case a watch event is missed.
            return Ok(Action::requeue(base.resync.min(Duration::from_secs(5))));
        }
        return Ok(Action::await_change());
    }
    let plan = plan(&svc);
    let client = base.client.clone();
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let port_api = Api::<TcpPort>::namespaced(client.clone(), ns);
    let tunnel_api = Api::<Tunnel>::namespaced(client.clone(), ns);
    let children = ListParams::default().labels(&format!(
        "{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_OWNER_UID}={}",
        svc.uid().unwrap_or_default()
    ));
    let existing_ports: BTreeMap<String, TcpPort> =
        port_api.list(&children).await?.items.into_iter().map(|p| (p.name_any(), p)).collect();
    let existing_tunnels = tunnel_api.list(&children).await?.items;
    let range = Some((base.edge_info.tcp_ports.first, base.edge_info.tcp_ports.last));

    let wanted: Vec<Option<u16>> =
        plan.ports.iter().map(|p| wanted_port(p.port, range, existing_ports.get(&p.name))).collect();
    // Ports that take any free port wait until those asking for their own
    // number have it, or the edge's lowest free port could be one of those.
    let specific_settled = plan.ports.iter().zip(&wanted).filter(|(_, w)| w.is_some()).all(|(p, _)| {
        existing_ports.get(&p.name).and_then(|t| t.status.as_ref()).is_some_and(|s| {
            s.port.is_some() || ready_condition(&s.conditions).is_some_and(|c| c.status == "False")
        })
    });

    let mut published: Vec<(u16, u16)> = Vec::new();
    let mut states: Vec<PortState> = Vec::new();
    let mut host = None;
    let mut problems = Vec::new();
    for (p, want) in plan.ports.iter().zip(wanted) {
        let existing = existing_ports.get(&p.name);
        if want.is_none() && existing.is_none() && !specific_settled {
            states.push((p.port, None));
            continue;
        }
        let mut spec = json!({ "reclaimPolicy": format!("{:?}", plan.reclaim) });
        if let Some(port) = want {
            spec["port"] = json!(port);
        }
        let mut body = json!({ "apiVersion": "culvert.dev/v1alpha1", "kind": "TcpPort", "spec": spec });
        body["metadata"] = child_meta(&svc, &p.name);
        let tcp_port = port_api.patch(&p.name, &pp, &Patch::Apply(&body)).await?;

        let mut spec = json!({
            "service": { "name": svc.name_any(), "port": p.port },
            "protocol": "tcp",
            "tcpPort": p.name,
        });
        if let Some(proxy) = plan.proxy {
            spec["proxyProtocol"] = serde_json::to_value(proxy).expect("serializable");
        }
        let mut body = json!({ "apiVersion": "culvert.dev/v1alpha1", "kind": "Tunnel", "spec": spec });
        body["metadata"] = child_meta(&svc, &p.name);
        let tunnel = tunnel_api.patch(&p.name, &pp, &Patch::Apply(&body)).await?;

        let status = tcp_port.status.unwrap_or_default();
        let tunnel_conditions = tunnel.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
        let connected = super::tunnel::is_connected(tunnel_conditions);
        states.push((
            p.port,
            status.port.filter(|_| status.address.is_some()).map(|public| (public, connected)),
        ));
        match (status.port, status.address) {
            (Some(public), Some(address)) => {
                published.push((p.port, public));
                let h = address.rsplit_once(':').map(|(h, _)| h).unwrap_or(&address);
                host = Some(h.trim_start_matches('[').trim_end_matches(']').to_string());
            }
            _ => {
                if let Some(c) = ready_condition(&status.conditions).filter(|c| c.status == "False") {
                    problems.push(format!("port {}: TcpPort {}: {}", p.port, p.name, c.message));
                }
            }
        }
        let tunnel_cond = tunnel.status.as_ref().and_then(|s| ready_condition(&s.conditions));
        // Waiting (for the port) and NoAgent (the condition says it) are no problems to warn about.
        if let Some(c) = tunnel_cond
            .filter(|c| c.status == "False" && !["Waiting", "NoAgent"].contains(&c.reason.as_str()))
        {
            problems.push(format!("port {}: Tunnel {}: {}", p.port, p.name, c.message));
        }
    }
    // Ports that went away.
    let names: Vec<&str> = plan.ports.iter().map(|p| p.name.as_str()).collect();
    let dp = DeleteParams::background();
    for t in existing_tunnels.iter().filter(|t| !names.contains(&t.name_any().as_str())) {
        tunnel_api.delete(&t.name_any(), &dp).await?;
    }
    for name in existing_ports.keys().filter(|n| !names.contains(&n.as_str())) {
        port_api.delete(name, &dp).await?;
    }

    // Annotation (always written, so a later withdraw knows we were here) and status.
    let public_ports = published.iter().map(|(s, p)| format!("{s}={p}")).collect::<Vec<_>>().join(",");
    let api = Api::<Service>::namespaced(client, ns);
    let meta = json!({ "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": svc.name_any(), "annotations": { ANNOTATION_PUBLIC_PORTS: public_ports } } });
    api.patch(&svc.name_any(), &pp, &Patch::Apply(&meta)).await?;
    let lb = match &host {
        Some(h) if !published.is_empty() => {
            let ports: Vec<(u16, bool)> = states.iter().filter_map(|(_, p)| *p).collect();
            json!({ "ingress": [lb_ingress(h, &ports).await] })
        }
        _ => json!({}),
    };
    let connected = service_condition_json(&svc, &states);
    let status = json!({ "apiVersion": "v1", "kind": "Service",
        "status": { "loadBalancer": lb, "conditions": [connected] } });
    api.patch_status(&svc.name_any(), &pp, &Patch::Apply(&status)).await?;

    // Events, on transitions. (The event recorder folds later events of the
    // same reason into the first one, note and all: so Published once every
    // port has its public port, naming them all.)
    if let Some(h) = host.as_ref().filter(|_| published.len() == plan.ports.len()) {
        let what: Vec<String> = published.iter().map(|(s, p)| format!("port {s} → {h}:{p}")).collect();
        ctx.report(&*svc, "published", false, "Published", what.join(", ")).await;
    }
    let (_, reason, message) = service_condition(&states);
    if reason != "NotPublished" {
        ctx.report(&*svc, "connected", false, reason, message).await;
    }
    for (topic, list, reason) in [
        ("rejected", &plan.rejected, "UnsupportedProtocol"),
        ("invalid", &plan.invalid, "InvalidAnnotation"),
        ("problems", &problems, "NotPublished"),
    ] {
        if list.is_empty() {
            ctx.forget(&*svc, topic);
        } else {
            ctx.report(&*svc, topic, true, reason, list.join("; ")).await;
        }
    }
    // Not connected: the Tunnel's status changes when an agent connects, and brings us back.
    let pending = published.len() < plan.ports.len();
    Ok(Action::requeue(if pending { base.resync.min(Duration::from_secs(5)) } else { base.resync }))
}

async fn reconcile(svc: Arc<Service>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = svc.namespace().unwrap_or_default();
    let span = tracing::info_span!("reconcile", kind = "Service", namespace = %ns, name = %svc.name_any());
    ctx.base.metrics.measure("Service", apply(svc.clone(), &ctx, &ns).instrument(span)).await
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
    fn plan_rejects_udp_and_reads_annotations() {
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
"#,
        );
        let p = plan(&svc);
        assert_eq!(
            p.ports,
            [
                PortPlan { port: 7777, name: "lb-game-7777".into() },
                PortPlan { port: 8080, name: "lb-game-8080".into() }
            ]
        );
        assert_eq!(p.rejected.len(), 1);
        assert!(p.rejected[0].contains("UDP port 7777"));
        assert_eq!(p.proxy, Some(ProxyProtocol::V2));
        assert_eq!(p.reclaim, ReclaimPolicy::Retain);
        let bad = service(
            "apiVersion: v1\nkind: Service\nmetadata: {name: x, annotations: {culvert.dev/proxy-protocol: v3}}\nspec: {type: LoadBalancer}\n",
        );
        assert_eq!(plan(&bad).invalid.len(), 1);
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
            (&[], "False", "NotPublished", "no TCP port"),
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
}
