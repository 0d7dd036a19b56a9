//! The Ingress controller: every host of the Ingresses culvert serves becomes
//! one `Tunnel` (protocol http, one tunnel key) on a `Domain` of the
//! Ingress's namespace, with the paths of every Ingress that names the host
//! merged into the Tunnel's routes. Route changes reach the agents through
//! the Tunnel's status, without reconnecting.
//!
//! Which Ingresses: `spec.ingressClassName` (or the deprecated
//! `kubernetes.io/ingress.class` annotation) naming an IngressClass whose
//! controller is `culvert.dev/ingress-controller` (or naming `culvert` when no
//! such IngressClass exists); without a class, when an IngressClass of ours is
//! marked default.
//!
//! Objects made for a host (`ing-<host>-<hash>`) are owned by every Ingress
//! that gives the host paths, so the garbage collector removes them with the
//! last one, and their own finalizers release the reservation and revoke the
//! key. No finalizer is put on the Ingress.
//!
//! Phases: observe (fresh lists of the namespace's IngressClasses,
//! Ingresses, Tunnels and Domains) → plan (pure: translate, merge, and what
//! each host needs) → execute (the Domain and Tunnel of each host) → report
//! (pure: the Ingress status and events) → write the status → events.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::networking::v1::{
    Ingress, IngressBackend, IngressClass, IngressLoadBalancerIngress, IngressLoadBalancerStatus,
    IngressPortStatus, IngressStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use super::names::{
    ANNOTATION_AUTH_SECRET, ANNOTATION_BACKEND_PROTOCOL, ANNOTATION_BACKEND_TLS_VERIFY, ANNOTATION_BODY_SIZE,
    ANNOTATION_CONNECT_TIMEOUT, ANNOTATION_HOST, ANNOTATION_READ_TIMEOUT, ANNOTATION_RECLAIM_POLICY,
    ANNOTATION_TLS_PASSTHROUGH, DEFAULT_CLASS_ANNOTATION, FIELD_MANAGER, INGRESS_CLASS, INGRESS_CONTROLLER,
    LABEL_MANAGED_BY, LEGACY_CLASS_ANNOTATION,
};
use super::routes::{self, Contribution, Merged, Rule};
use super::status::{Ctx, Note, apply_status, ready_condition};
use super::{Context, DomainPolicy, Error};
use crate::crd::{
    BackendProtocol, Domain, DomainSpec, HttpOptions, PathType, ReclaimPolicy, ServiceRef, Tunnel,
    TunnelProtocol, TunnelRoute, TunnelSpec,
};

/// Value of [`LABEL_MANAGED_BY`] on what this controller makes.
const MANAGED_BY: &str = "ingress";

/// Name of the Tunnel (and of the Domain, when one is made) of a host.
pub fn object_name(host: &str) -> String {
    let slug: String =
        host.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    let slug = slug.trim_matches('-');
    let slug = slug[..slug.len().min(40)].trim_end_matches('-');
    let digest = ring::digest::digest(&ring::digest::SHA256, host.as_bytes());
    let hash: String = digest.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("ing-{slug}-{hash}")
}

fn is_true(v: Option<&String>) -> bool {
    v.is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// Is `ing` served by culvert, given the cluster's IngressClasses?
pub fn is_ours(ing: &Ingress, classes: &[IngressClass]) -> bool {
    let ours =
        |c: &IngressClass| c.spec.as_ref().and_then(|s| s.controller.as_deref()) == Some(INGRESS_CONTROLLER);
    let class = ing
        .spec
        .as_ref()
        .and_then(|s| s.ingress_class_name.clone())
        .or_else(|| ing.annotations().get(LEGACY_CLASS_ANNOTATION).cloned());
    match class {
        Some(name) => match classes.iter().find(|c| c.name_any() == name) {
            Some(c) => ours(c),
            None => name == INGRESS_CLASS,
        },
        None => classes.iter().any(|c| ours(c) && is_true(c.annotations().get(DEFAULT_CLASS_ANNOTATION))),
    }
}

/// Where a path of an Ingress goes: a Service, with the options the
/// Ingress's annotations give its paths.
#[derive(Debug, Clone, PartialEq)]
pub struct Backend {
    pub service: ServiceRef,
    pub options: HttpOptions,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.service)?;
        if !self.options.is_default() {
            let o = serde_json::to_string(&self.options).unwrap_or_default();
            write!(f, " with options {o}")?;
        }
        Ok(())
    }
}

/// The options the annotations give every path of an Ingress, and messages
/// about values that are not understood (those are left out, except the
/// auth Secret: a bad name keeps the host unpublished rather than open).
pub fn options_of(ing: &Ingress) -> (HttpOptions, Vec<String>) {
    let a = ing.annotations();
    let mut o = HttpOptions::default();
    let mut problems = Vec::new();
    let get = |k: &str| a.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    match get(ANNOTATION_BACKEND_PROTOCOL).map(str::to_ascii_lowercase).as_deref() {
        None => {}
        Some("http") => o.backend_protocol = Some(BackendProtocol::Http),
        Some("h2c") => o.backend_protocol = Some(BackendProtocol::H2c),
        Some("https") => o.backend_protocol = Some(BackendProtocol::Https),
        Some(v) => problems.push(format!("{ANNOTATION_BACKEND_PROTOCOL}: `{v}` is not http, h2c or https")),
    }
    match get(ANNOTATION_BACKEND_TLS_VERIFY).map(str::to_ascii_lowercase).as_deref() {
        None => {}
        Some("true") => o.backend_tls_verify = Some(true),
        Some("false") => o.backend_tls_verify = Some(false),
        Some(v) => {
            problems.push(format!("{ANNOTATION_BACKEND_TLS_VERIFY}: `{v}` is not \"true\" or \"false\""))
        }
    }
    for (key, field, max) in [
        (ANNOTATION_CONNECT_TIMEOUT, &mut o.connect_timeout_seconds, 3600),
        (ANNOTATION_READ_TIMEOUT, &mut o.read_timeout_seconds, 86400),
    ] {
        if let Some(v) = get(key) {
            match v.trim_end_matches('s').parse::<u32>() {
                Ok(n) if (1..=max).contains(&n) => *field = Some(n),
                _ => problems.push(format!("{key}: `{v}` is not a number of seconds (1-{max})")),
            }
        }
    }
    if let Some(v) = get(ANNOTATION_BODY_SIZE) {
        match crate::agent::guard::parse_size(v) {
            Ok(_) => o.max_body_size = Some(v.to_string()),
            Err(e) => problems.push(format!("{ANNOTATION_BODY_SIZE}: {e}")),
        }
    }
    if let Some(v) = get(ANNOTATION_AUTH_SECRET) {
        o.auth_secret = Some(v.to_string());
    }
    (o, problems)
}

/// What one Ingress gives each of its hosts, and what of it cannot be served.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Translated {
    pub hosts: BTreeMap<String, Contribution<Backend>>,
    /// `culvert.dev/tls-passthrough: "true"`: its hosts are TLS passthrough.
    pub passthrough: bool,
    /// Messages for a Warning event.
    pub problems: Vec<String>,
    /// Hosts listed under `spec.tls`.
    pub tls_hosts: Vec<String>,
}

fn service_ref(b: &IngressBackend) -> Result<ServiceRef, String> {
    let Some(s) = &b.service else {
        return Err("resource backends are not supported; use a Service of this namespace".into());
    };
    let port = s.port.as_ref();
    let port = match (port.and_then(|p| p.number), port.and_then(|p| p.name.clone())) {
        (Some(n), _) => IntOrString::Int(n),
        (None, Some(name)) => IntOrString::String(name),
        (None, None) => return Err(format!("the backend service {} has no port", s.name)),
    };
    Ok(ServiceRef { name: s.name.clone(), port })
}

/// Translate: the Ingress alone, without a client.
pub fn translate(ing: &Ingress) -> Translated {
    let mut out = Translated::default();
    let source = format!("{}/{}", ing.namespace().unwrap_or_default(), ing.name_any());
    let Some(spec) = &ing.spec else { return out };
    let (options, problems) = options_of(ing);
    out.problems.extend(problems);
    out.passthrough = is_true(ing.annotations().get(ANNOTATION_TLS_PASSTHROUGH));
    let backend =
        |b: &IngressBackend| service_ref(b).map(|service| Backend { service, options: options.clone() });
    let default = match spec.default_backend.as_ref().map(backend) {
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            out.problems.push(format!("spec.defaultBackend: {e}"));
            None
        }
        None => None,
    };
    for rule in spec.rules.iter().flatten() {
        let Some(host) = rule.host.as_deref().map(|h| h.trim_end_matches('.').to_ascii_lowercase()) else {
            out.problems.push(
                "a rule without host is not served: culvert publishes one public name per host, give each rule a host"
                    .into(),
            );
            continue;
        };
        if host.starts_with("*.") {
            out.problems.push(format!("wildcard host {host} is not supported; name each host"));
            continue;
        }
        let entry = out.hosts.entry(host.clone()).or_insert_with(|| Contribution {
            source: source.clone(),
            rules: Vec::new(),
            default: default.clone(),
        });
        for p in rule.http.iter().flat_map(|h| &h.paths) {
            let path_type = match p.path_type.as_str() {
                "Exact" => PathType::Exact,
                // ImplementationSpecific behaves as Prefix.
                _ => PathType::Prefix,
            };
            let path = p.path.clone().unwrap_or_else(|| "/".into());
            if !path.starts_with('/') {
                out.problems.push(format!("host {host}: path `{path}` does not start with /"));
                continue;
            }
            match backend(&p.backend) {
                Ok(s) => entry.rules.push(Rule::new(path, path_type, s)),
                Err(e) => out.problems.push(format!("host {host} path {path}: {e}")),
            }
        }
    }
    if spec.rules.as_ref().is_none_or(|r| r.is_empty()) && default.is_some() {
        out.problems.push(
            "an Ingress with only a defaultBackend has no host to publish: add a rule with a host".into(),
        );
    }
    out.tls_hosts = spec.tls.iter().flatten().flat_map(|t| t.hosts.iter().flatten().cloned()).collect();
    out
}

/// The hosts an Ingress names (for the watch mappers).
fn hosts_of(ing: &Ingress) -> BTreeSet<String> {
    translate(ing).hosts.into_keys().collect()
}

/// The host names a Domain covers (by spec, status and our annotation).
fn domain_hosts(d: &Domain, edge_domain: &str) -> Vec<String> {
    let mut out: Vec<String> = [
        d.status.as_ref().and_then(|s| s.hostname.clone()),
        d.spec.fqdn.as_ref().map(|f| f.trim_end_matches('.').to_ascii_lowercase()),
        d.spec.name.as_ref().map(|n| format!("{n}.{edge_domain}")),
        d.annotations().get(ANNOTATION_HOST).cloned(),
    ]
    .into_iter()
    .flatten()
    .collect();
    out.dedup();
    out
}

/// The Domain spec for a host: a subdomain of the edge, or a custom domain.
fn domain_spec(host: &str, edge_domain: &str, reclaim_policy: ReclaimPolicy) -> DomainSpec {
    match host.strip_suffix(&format!(".{edge_domain}")) {
        Some(label) if !label.contains('.') => {
            DomainSpec { name: Some(label.into()), fqdn: None, reclaim_policy }
        }
        _ => DomainSpec { name: None, fqdn: Some(host.into()), reclaim_policy },
    }
}

fn owner_ref(ing: &Ingress) -> OwnerReference {
    OwnerReference {
        api_version: "networking.k8s.io/v1".into(),
        kind: "Ingress".into(),
        name: ing.name_any(),
        uid: ing.uid().unwrap_or_default(),
        controller: Some(false),
        block_owner_deletion: None,
    }
}

/// What an Ingress reconcile read: fresh lists of its namespace, so a
/// just-deleted Ingress never lingers in a host's routes.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub classes: Vec<IngressClass>,
    pub ingresses: Vec<Ingress>,
    /// The Tunnels this controller made.
    pub tunnels: Vec<Tunnel>,
    pub domains: Vec<Domain>,
}

async fn observe(client: &Client, ns: &str) -> Result<Observed, Error> {
    let lp = ListParams::default();
    let managed = ListParams::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY}"));
    Ok(Observed {
        classes: Api::<IngressClass>::all(client.clone()).list(&lp).await?.items,
        ingresses: Api::<Ingress>::namespaced(client.clone(), ns).list(&lp).await?.items,
        tunnels: Api::<Tunnel>::namespaced(client.clone(), ns).list(&managed).await?.items,
        domains: Api::<Domain>::namespaced(client.clone(), ns).list(&lp).await?.items,
    })
}

/// What the plan takes from the operator's settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    /// The edge's base domain.
    pub edge_domain: &'a str,
    pub domain_policy: DomainPolicy,
}

/// What a reconcile of one Ingress does.
#[derive(Debug, Clone)]
pub struct Plan {
    /// This Ingress, translated, when culvert serves it.
    pub mine: Option<Translated>,
    /// `namespace/name` of this Ingress.
    pub me: String,
    /// The hosts to sync: this Ingress's, and those it gave paths before.
    pub hosts: Vec<HostPlan>,
}

/// What one host needs, from every Ingress of the namespace that names it.
#[derive(Debug, Clone)]
pub struct HostPlan {
    pub host: String,
    /// Name of the host's Tunnel (and Domain, when one is made).
    pub name: String,
    pub action: HostAction,
    pub conflicts: Vec<routes::Conflict>,
    /// Warnings about TLS passthrough, for one Ingress (`namespace/name`) or all.
    pub problems: Vec<(Option<String>, String)>,
}

#[derive(Debug, Clone)]
pub enum HostAction {
    /// No Ingress names the host any more: delete the Tunnel and the Domain
    /// made for it, those that exist.
    Remove { tunnel: bool, domain: bool },
    /// `--domain-policy require` and no Domain of the namespace covers the
    /// host: the message says so.
    DomainRequired(String),
    /// Publish on the Domain with this Tunnel (`None`: a TLS passthrough host
    /// that cannot be published; `problems` says why), both owned by `owners`.
    Publish { domain: DomainAction, tunnel: Option<Box<TunnelSpec>>, owners: Vec<OwnerReference> },
}

#[derive(Debug, Clone)]
pub enum DomainAction {
    /// A Domain of the namespace (not made by us) covers the host.
    Use(Box<Domain>),
    /// Make (or keep) the host's own Domain with this spec.
    Make(DomainSpec),
}

fn made_by_us(labels: &BTreeMap<String, String>) -> bool {
    labels.get(LABEL_MANAGED_BY).map(String::as_str) == Some(MANAGED_BY)
}

/// Decides, without IO, what the Ingress `ing` needs from what was observed.
pub fn plan(ing: &Ingress, o: &Observed, s: Settings<'_>) -> Plan {
    let mut ours: Vec<(&Ingress, Translated)> = o
        .ingresses
        .iter()
        .filter(|i| i.metadata.deletion_timestamp.is_none() && is_ours(i, &o.classes))
        .map(|i| (i, translate(i)))
        .collect();
    ours.sort_by(|(a, _), (b, _)| {
        (a.metadata.creation_timestamp.as_ref().map(|t| t.0), a.name_any())
            .cmp(&(b.metadata.creation_timestamp.as_ref().map(|t| t.0), b.name_any()))
    });
    let ns = ing.namespace().unwrap_or_default();
    let uid = ing.uid().unwrap_or_default();
    let mine = ours.iter().find(|(i, _)| i.uid().as_deref() == Some(uid.as_str())).map(|(_, t)| t.clone());
    let mut hosts: BTreeSet<String> =
        mine.as_ref().map(|t| t.hosts.keys().cloned().collect()).unwrap_or_default();
    for t in &o.tunnels {
        if t.owner_references().iter().any(|o| o.uid == uid)
            && let Some(h) = t.annotations().get(ANNOTATION_HOST)
        {
            hosts.insert(h.clone());
        }
    }
    let hosts = hosts.iter().map(|h| plan_host(h, &ns, &ours, o, s)).collect();
    Plan { mine, me: format!("{ns}/{}", ing.name_any()), hosts }
}

/// A host's Domain and Tunnel as the Ingresses that name it (`ours`, oldest
/// first) ask, or their removal when none does.
fn plan_host(
    host: &str,
    ns: &str,
    ours: &[(&Ingress, Translated)],
    o: &Observed,
    s: Settings<'_>,
) -> HostPlan {
    let name = object_name(host);
    let done = |action, conflicts, problems| HostPlan {
        host: host.to_string(),
        name: name.clone(),
        action,
        conflicts,
        problems,
    };
    // The oldest Ingress decides whether the host is TLS passthrough; those
    // that disagree are left out.
    let all: Vec<(&Ingress, bool, &Contribution<Backend>)> =
        ours.iter().filter_map(|(i, t)| t.hosts.get(host).map(|c| (*i, t.passthrough, c))).collect();
    let passthrough = all.first().is_some_and(|(_, p, _)| *p);
    let mut problems: Vec<(Option<String>, String)> = Vec::new();
    let mut contributors: Vec<(&Ingress, &Contribution<Backend>)> = Vec::new();
    for (i, p, c) in &all {
        if *p == passthrough {
            contributors.push((i, c));
        } else {
            let (mode, first) =
                (if passthrough { "TLS passthrough" } else { "HTTPS at the edge" }, &all[0].2.source);
            problems.push((
                Some(c.source.clone()),
                format!(
                    "host {host} is published as {mode} by {first} (the oldest Ingress of the host); \
                     the paths of {} are not served: give both the same {ANNOTATION_TLS_PASSTHROUGH}",
                    c.source
                ),
            ));
        }
    }
    let existing_tunnel = o.tunnels.iter().find(|t| t.name_any() == name);
    let auto_domain = o.domains.iter().find(|d| d.name_any() == name && made_by_us(d.labels()));

    if contributors.is_empty() {
        let tunnel = existing_tunnel.is_some_and(|t| made_by_us(t.labels()));
        return done(HostAction::Remove { tunnel, domain: auto_domain.is_some() }, Vec::new(), problems);
    }

    let merged: Merged<Backend> =
        routes::merge(&contributors.iter().map(|(_, c)| (*c).clone()).collect::<Vec<_>>());
    let owners: Vec<OwnerReference> = contributors.iter().map(|(i, _)| owner_ref(i)).collect();

    // The Domain: one of the namespace that covers the host (a ready one
    // first), else one we make (policy auto).
    let covering: Vec<&Domain> =
        o.domains.iter().filter(|d| domain_hosts(d, s.edge_domain).iter().any(|h| h == host)).collect();
    let ready = |d: &Domain| {
        d.status.as_ref().and_then(|s| ready_condition(&s.conditions)).is_some_and(|c| c.status == "True")
    };
    let chosen = covering.iter().find(|d| ready(d)).or(auto_domain.as_ref()).or(covering.first()).copied();
    let (domain, domain_name) = match (chosen, s.domain_policy) {
        (Some(d), _) if !made_by_us(d.labels()) => (DomainAction::Use(Box::new(d.clone())), d.name_any()),
        (None, DomainPolicy::Require) => {
            let msg = format!(
                "host {host} is not covered by a Domain of namespace {ns}: create one (spec.name or spec.fqdn), \
                 or run the operator with --domain-policy auto"
            );
            return done(HostAction::DomainRequired(msg), merged.conflicts, problems);
        }
        _ => {
            let reclaim = contributors
                .iter()
                .find_map(|(i, _)| i.annotations().get(ANNOTATION_RECLAIM_POLICY).cloned())
                .map(|v| {
                    if v.eq_ignore_ascii_case("retain") {
                        ReclaimPolicy::Retain
                    } else {
                        ReclaimPolicy::Delete
                    }
                })
                .unwrap_or_default();
            (DomainAction::Make(domain_spec(host, s.edge_domain, reclaim)), name.clone())
        }
    };

    let tunnel = if passthrough {
        passthrough_backend(host, &merged, &mut problems).map(|service| {
            Box::new(TunnelSpec {
                service: Some(service),
                routes: Vec::new(),
                protocol: TunnelProtocol::Tls,
                domain: Some(domain_name),
                tcp_port: None,
                udp_port: None,
                proxy_protocol: None,
                options: HttpOptions::default(),
            })
        })
    } else {
        Some(Box::new(TunnelSpec {
            service: merged.default.as_ref().map(|b| b.service.clone()),
            routes: merged
                .rules
                .iter()
                .map(|r| TunnelRoute {
                    path: r.path.clone(),
                    path_type: r.path_type,
                    service: Some(r.backend.service.clone()),
                    backends: Vec::new(),
                    method: None,
                    headers: Vec::new(),
                    query_params: Vec::new(),
                    hosts: Vec::new(),
                    filters: Vec::new(),
                    options: r.backend.options.clone(),
                })
                .collect(),
            protocol: TunnelProtocol::Http,
            domain: Some(domain_name),
            tcp_port: None,
            udp_port: None,
            proxy_protocol: None,
            options: merged.default.as_ref().map(|b| b.options.clone()).unwrap_or_default(),
        }))
    };
    done(HostAction::Publish { domain, tunnel, owners }, merged.conflicts, problems)
}

/// A host's objects as [`execute_host`] left them.
#[derive(Debug, Clone)]
pub enum Applied {
    /// Nothing is published for the host.
    Nothing,
    /// The Domain used, and the Tunnel as applied (`None`: not published).
    Published { domain: Box<Domain>, tunnel: Option<Box<Tunnel>> },
}

/// Carries out a host's plan in Kubernetes. (An Ingress holds nothing at the
/// edge itself: the Domain and Tunnel controllers do.)
async fn execute_host(client: &Client, ns: &str, p: &HostPlan) -> Result<Applied, Error> {
    let tunnel_api = Api::<Tunnel>::namespaced(client.clone(), ns);
    let domain_api = Api::<Domain>::namespaced(client.clone(), ns);
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let (host, name) = (&p.host, &p.name);
    let meta = |owners: &[OwnerReference]| {
        json!({
            "name": name,
            "labels": { LABEL_MANAGED_BY: MANAGED_BY },
            "annotations": { ANNOTATION_HOST: host },
            "ownerReferences": owners,
        })
    };
    match &p.action {
        HostAction::Remove { tunnel, domain } => {
            if *tunnel {
                tunnel_api.delete(name, &DeleteParams::background()).await?;
                info!(%host, tunnel = %name, "no Ingress names the host any more: deleted its Tunnel");
            }
            if *domain {
                domain_api.delete(name, &DeleteParams::background()).await?;
                info!(%host, domain = %name, "deleted the Domain made for the host");
            }
            Ok(Applied::Nothing)
        }
        HostAction::DomainRequired(_) => Ok(Applied::Nothing),
        HostAction::Publish { domain, tunnel, owners } => {
            let domain = match domain {
                DomainAction::Use(d) => (**d).clone(),
                DomainAction::Make(spec) => {
                    let body = json!({
                        "apiVersion": "culvert.dev/v1alpha1",
                        "kind": "Domain",
                        "metadata": meta(owners),
                        "spec": spec,
                    });
                    domain_api.patch(name, &pp, &Patch::Apply(&body)).await?
                }
            };
            let tunnel = match tunnel {
                Some(spec) => {
                    let body = json!({
                        "apiVersion": "culvert.dev/v1alpha1",
                        "kind": "Tunnel",
                        "metadata": meta(owners),
                        "spec": spec,
                    });
                    Some(Box::new(tunnel_api.patch(name, &pp, &Patch::Apply(&body)).await?))
                }
                None => None,
            };
            Ok(Applied::Published { domain: Box::new(domain), tunnel })
        }
    }
}

/// What a host looks like after [`execute_host`], for the Ingress's status and events.
#[derive(Debug, Clone, PartialEq)]
pub struct HostState {
    /// The public name, once the Tunnel is published, and whether an agent is connected.
    pub public: Option<(String, bool)>,
    /// What to report on the Ingresses of the host.
    pub report: Option<Note>,
    pub conflicts: Vec<routes::Conflict>,
    /// Warnings about TLS passthrough, for one Ingress (`namespace/name`) or all.
    pub problems: Vec<(Option<String>, String)>,
}

/// The state of a host from its plan and what was applied, without IO.
pub fn host_state(p: &HostPlan, applied: &Applied) -> HostState {
    let (host, name) = (&p.host, &p.name);
    let mut state = HostState {
        public: None,
        report: None,
        conflicts: p.conflicts.clone(),
        problems: p.problems.clone(),
    };
    let (domain, tunnel) = match (&p.action, applied) {
        (HostAction::DomainRequired(msg), _) => {
            state.report = Some(Note::new(true, "DomainRequired", msg.clone()));
            return state;
        }
        (_, Applied::Published { domain, tunnel: Some(tunnel) }) => (domain, tunnel),
        _ => return state,
    };
    // What to tell the Ingresses: the Domain's trouble first, then the Tunnel's.
    let domain_cond = domain.status.as_ref().and_then(|s| ready_condition(&s.conditions)).cloned();
    let tunnel_cond = tunnel.status.as_ref().and_then(|s| ready_condition(&s.conditions)).cloned();
    let fresh = tunnel.status.as_ref().and_then(|s| s.observed_generation) == tunnel.metadata.generation;
    state.report = match (&domain_cond, &tunnel_cond) {
        (Some(d), _) if d.status == "False" => Some(Note::new(
            true,
            d.reason.clone(),
            format!("Domain {} for {host}: {}", domain.name_any(), d.message),
        )),
        (_, Some(t)) if fresh => {
            // Waiting for an agent is not a warning (it takes a second); the message says what to check.
            let warning = (t.status != "True" && t.reason != "NoAgent") || t.reason == "Degraded";
            Some(Note::new(warning, t.reason.clone(), format!("{host} (Tunnel {name}): {}", t.message)))
        }
        _ => None,
    };
    // Not `fresh`: the status keeps the name while a route change is reconciled.
    // The address stays while agents come and go (a rolling restart), so
    // what reads it (external-dns) does not flap; a port error says "no agent".
    let conditions = tunnel.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    state.public = super::tunnel::is_published(conditions)
        .then(|| domain.status.as_ref().and_then(|s| s.hostname.clone()))
        .flatten()
        .map(|h| (h, super::tunnel::is_connected(conditions)));
    state
}

/// The one Service a TLS passthrough host goes to: the default backend, or
/// the only Service its paths name. Path rules cannot apply (the edge never
/// sees the requests), nor can the HTTP options; what cannot be honoured is
/// added to `problems`, and `None` keeps the host unpublished.
fn passthrough_backend(
    host: &str,
    merged: &Merged<Backend>,
    problems: &mut Vec<(Option<String>, String)>,
) -> Option<ServiceRef> {
    let mut services: Vec<&ServiceRef> = Vec::new();
    for s in merged.rules.iter().map(|r| &r.backend.service) {
        if !services.contains(&s) {
            services.push(s);
        }
    }
    let options =
        merged.rules.iter().map(|r| &r.backend.options).chain(merged.default.iter().map(|b| &b.options));
    let guarded = options.clone().any(|o| o.auth_secret.is_some());
    let other = options.clone().any(|o| !o.is_default());
    let what = format!("host {host} is TLS passthrough ({ANNOTATION_TLS_PASSTHROUGH})");
    if guarded {
        problems.push((
            None,
            format!(
                "{what}: {ANNOTATION_AUTH_SECRET} cannot be enforced on traffic culvert does not decrypt; \
                 the host is not published"
            ),
        ));
        return None;
    }
    if other {
        problems
            .push((None, format!("{what}: the HTTP annotations of its paths do not apply and are ignored")));
    }
    match (&merged.default, services.as_slice()) {
        (Some(d), rest) => {
            if rest.iter().any(|s| **s != d.service) {
                problems.push((
                    None,
                    format!(
                        "{what}: all its traffic goes to the default backend {}; paths to other Services are ignored",
                        d.service
                    ),
                ));
            }
            Some(d.service.clone())
        }
        (None, [one]) => Some((*one).clone()),
        (None, []) => {
            problems.push((None, format!("{what} but names no backend Service")));
            None
        }
        (None, several) => {
            let names: Vec<String> = several.iter().map(|s| s.to_string()).collect();
            problems.push((
                None,
                format!(
                    "{what}: its paths name several Services ({}), but passthrough sends a host's traffic \
                     to one; give a defaultBackend or one Service. The host is not published",
                    names.join(", ")
                ),
            ));
            None
        }
    }
}

async fn reconcile(ing: Arc<Ingress>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = ing.namespace().unwrap_or_default();
    let span = tracing::info_span!("reconcile", kind = "Ingress", namespace = %ns, name = %ing.name_any());
    ctx.base.metrics.measure("Ingress", &*ing, apply(ing.clone(), &ctx, &ns).instrument(span)).await
}

/// What a reconcile writes after the hosts: the Ingress's status, its
/// events, and when to look again.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The status to write (`None`: leave it as it is).
    pub status: Option<IngressStatus>,
    /// Notes by topic, in order (`None`: the topic is fine again).
    pub notes: Vec<(String, Option<Note>)>,
    pub requeue: Duration,
}

/// The status, events and requeue of the Ingress `ing`, without IO.
pub fn report(ing: &Ingress, plan: &Plan, states: &[HostState], https_port: u16, resync: Duration) -> Report {
    let mut notes: Vec<(String, Option<Note>)> = Vec::new();
    let Some(t) = &plan.mine else {
        // No longer ours: withdraw the status we wrote, if any.
        let wrote_status = ing.managed_fields().iter().any(|m| {
            m.manager.as_deref() == Some(FIELD_MANAGER) && m.subresource.as_deref() == Some("status")
        });
        return Report { status: wrote_status.then(IngressStatus::default), notes, requeue: resync };
    };
    let me = &plan.me;
    let mut public = Vec::new();
    for (p, state) in plan.hosts.iter().zip(states) {
        let host = &p.host;
        public.extend(state.public.clone());
        notes.push((host.clone(), state.report.clone()));
        let conflicts: Vec<String> = state
            .conflicts
            .iter()
            .filter(|c| c.winner == *me || c.loser == *me)
            .map(|c| format!("host {host}: {c}"))
            .collect();
        let note = (!conflicts.is_empty()).then(|| Note::new(true, "PathConflict", conflicts.join("; ")));
        notes.push((format!("conflicts {host}"), note));
        let problems: Vec<&str> = state
            .problems
            .iter()
            .filter(|(who, _)| who.as_ref().is_none_or(|w| w == me))
            .map(|(_, m)| m.as_str())
            .collect();
        let note = (!problems.is_empty()).then(|| Note::new(true, "TLSPassthrough", problems.join("; ")));
        notes.push((format!("passthrough {host}"), note));
    }
    let note = (!t.problems.is_empty()).then(|| Note::new(true, "Unsupported", t.problems.join("; ")));
    notes.push(("problems".into(), note));
    if t.passthrough {
        let hosts: Vec<&str> = t.hosts.keys().map(String::as_str).collect();
        let msg = format!(
            "{} published as TLS passthrough: the edge routes by SNI and the backend terminates TLS",
            hosts.join(", ")
        );
        notes.push(("tls".into(), Some(Note::new(false, "TLSPassthrough", msg))));
    } else if !t.tls_hosts.is_empty() {
        let msg = format!(
            "TLS for {} is terminated at the edge with the edge's certificate; the Secrets in spec.tls are not used",
            t.tls_hosts.join(", ")
        );
        notes.push(("tls".into(), Some(Note::new(false, "TLSAtEdge", msg))));
    }
    let lb = public.iter().map(|(h, connected)| ingress_entry(h, https_port, *connected)).collect();
    let status = IngressStatus { load_balancer: Some(IngressLoadBalancerStatus { ingress: Some(lb) }) };
    let pending = public.len() < plan.hosts.len();
    let requeue = if pending { resync.min(Duration::from_secs(5)) } else { resync };
    Report { status: Some(status), notes, requeue }
}

/// Observe → plan → execute (the hosts' Domains and Tunnels) → the
/// Ingress's status → its events.
async fn apply(ing: Arc<Ingress>, ctx: &Ctx, ns: &str) -> Result<Action, Error> {
    let base = &ctx.base;
    let observed = observe(&base.client, ns).await?;
    let settings = Settings { edge_domain: &base.edge_info.domain, domain_policy: base.domain_policy };
    let plan = plan(&ing, &observed, settings);
    let mut states = Vec::new();
    for host in &plan.hosts {
        let applied = execute_host(&base.client, ns, host).await?;
        states.push(host_state(host, &applied));
    }
    let report = report(&ing, &plan, &states, base.edge_info.public_https_port, base.resync);
    if let Some(status) = &report.status {
        apply_status(&Api::<Ingress>::namespaced(base.client.clone(), ns), &*ing, status).await?;
    }
    ctx.report_all(&*ing, report.notes).await;
    Ok(Action::requeue(report.requeue))
}

/// One `status.loadBalancer.ingress[]` entry of an Ingress: the public host
/// name and HTTPS port, with the error `culvert.dev/NoAgent` while no agent
/// is connected.
fn ingress_entry(host: &str, https_port: u16, connected: bool) -> IngressLoadBalancerIngress {
    let port = IngressPortStatus {
        port: https_port.into(),
        protocol: "TCP".into(),
        error: (!connected).then(|| super::tunnel::PORT_ERROR_NO_AGENT.to_string()),
    };
    IngressLoadBalancerIngress { hostname: Some(host.into()), ip: None, ports: Some(vec![port]) }
}

fn error_policy(obj: Arc<Ingress>, e: &Error, _ctx: Arc<Ctx>) -> Action {
    super::log_failure("Ingress", obj.meta(), e);
    Action::requeue(Duration::from_secs(5))
}

pub async fn run(ctx: Arc<Context>, stop: CancellationToken) {
    let client = ctx.client.clone();
    let ns = ctx.watch_namespace.clone();
    let edge_domain = ctx.edge_info.domain.clone();
    let controller = Controller::new(
        super::watched::<Ingress>(&client, ns.as_deref()),
        watcher::Config::default().any_semantic(),
    );
    let store = controller.store();
    let all = store.clone();
    // Ingresses of a namespace naming one of `hosts`, except one.
    let naming = move |ns: Option<String>, hosts: Vec<String>, except: Option<String>| {
        store
            .state()
            .into_iter()
            .filter(|i| i.namespace() == ns && i.uid() != except)
            .filter(|i| hosts_of(i).iter().any(|h| hosts.contains(h)))
            .map(|i| ObjectRef::from_obj(&*i))
            .collect::<Vec<_>>()
    };
    let (n2, n3) = (naming.clone(), naming);
    let managed = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY}"));
    let reconcile_ctx = Ctx::new(ctx.clone());
    controller
        // A class made default, or its controller changed: every Ingress.
        .watches(Api::<IngressClass>::all(client.clone()), watcher::Config::default(), move |_| {
            all.state().iter().map(|i| ObjectRef::from_obj(&**i)).collect::<Vec<_>>()
        })
        // An Ingress changed or deleted: the others naming its hosts.
        .watches(
            super::watched::<Ingress>(&client, ns.as_deref()),
            watcher::Config::default(),
            move |i: Ingress| n2(i.namespace(), hosts_of(&i).into_iter().collect(), i.uid()),
        )
        // A host's Tunnel changed (its status) or was deleted: its Ingresses.
        .watches(super::watched::<Tunnel>(&client, ns.as_deref()), managed, move |t: Tunnel| {
            let ns = t.namespace().unwrap_or_default();
            t.owner_references()
                .iter()
                .filter(|o| o.kind == "Ingress")
                .map(|o| ObjectRef::new(&o.name).within(&ns))
                .collect::<Vec<_>>()
        })
        // A Domain changed: the Ingresses naming its host.
        .watches(
            super::watched::<Domain>(&client, ns.as_deref()),
            watcher::Config::default(),
            move |d: Domain| n3(d.namespace(), domain_hosts(&d, &edge_domain), None),
        )
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(reconcile, error_policy, reconcile_ctx)
        .for_each(|_| async {})
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::routes::Table;

    fn ingress(v: serde_json::Value) -> Ingress {
        serde_json::from_value(v).unwrap()
    }

    fn class(name: &str, controller: &str, default: bool) -> IngressClass {
        let mut v = json!({"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass",
            "metadata": {"name": name}, "spec": {"controller": controller}});
        if default {
            v["metadata"]["annotations"] = json!({DEFAULT_CLASS_ANNOTATION: "true"});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn class_filtering_and_the_default_class() {
        let named = |c: &str| {
            ingress(json!({"metadata": {"name": "i", "namespace": "n"}, "spec": {"ingressClassName": c}}))
        };
        let classless = ingress(json!({"metadata": {"name": "i", "namespace": "n"}, "spec": {}}));
        let legacy = ingress(json!({"metadata": {"name": "i", "namespace": "n",
            "annotations": {LEGACY_CLASS_ANNOTATION: "culvert"}}, "spec": {}}));
        let ours = class("culvert", INGRESS_CONTROLLER, false);
        let renamed = class("tunnels", INGRESS_CONTROLLER, false);
        let nginx = class("nginx", "k8s.io/ingress-nginx", true);
        let classes = vec![ours.clone(), renamed, nginx.clone()];
        assert!(is_ours(&named("culvert"), &classes));
        assert!(is_ours(&named("tunnels"), &classes), "any class of our controller");
        assert!(!is_ours(&named("nginx"), &classes));
        assert!(!is_ours(&named("unknown"), &classes));
        assert!(is_ours(&named("culvert"), &[]), "`culvert` without an IngressClass object");
        assert!(!is_ours(&named("culvert"), &[class("culvert", "other.io/x", false)]));
        assert!(is_ours(&legacy, &classes));
        assert!(!is_ours(&classless, &classes), "nginx is the default");
        assert!(is_ours(&classless, &[class("culvert", INGRESS_CONTROLLER, true), nginx]));
        assert!(!is_ours(&classless, &[]));
    }

    #[test]
    fn object_names_are_valid_and_distinct() {
        let a = object_name("podinfo.edge.example.com");
        assert!(a.starts_with("ing-podinfo-edge-example-com-"), "{a}");
        assert_ne!(object_name("a-b.example.com"), object_name("a.b.example.com"));
        let long = object_name(&format!("{}.example.com", "x".repeat(63)));
        assert!(long.len() <= 63 && !long.contains("--"), "{long}");
    }

    #[test]
    fn domain_spec_subdomain_or_custom() {
        let domain_spec = |h, e, r| serde_json::to_value(domain_spec(h, e, r)).unwrap();
        assert_eq!(
            domain_spec("web.edge.test", "edge.test", ReclaimPolicy::Delete),
            json!({"name": "web", "reclaimPolicy": "Delete"})
        );
        assert_eq!(
            domain_spec("a.b.edge.test", "edge.test", ReclaimPolicy::Retain),
            json!({"fqdn": "a.b.edge.test", "reclaimPolicy": "Retain"})
        );
        assert_eq!(
            domain_spec("app.example.org", "edge.test", ReclaimPolicy::Delete),
            json!({"fqdn": "app.example.org", "reclaimPolicy": "Delete"})
        );
    }

    /// An Ingress as a chart writes it, translated, merged and looked up.
    #[test]
    fn ingress_translates_to_routes_per_host() {
        let ing: Ingress = serde_saphyr::from_str(
            r#"
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {name: shop, namespace: demo}
spec:
  ingressClassName: culvert
  defaultBackend: {service: {name: web, port: {number: 80}}}
  tls: [{hosts: [shop.edge.test], secretName: ignored}]
  rules:
    - host: Shop.Edge.Test
      http:
        paths:
          - {path: /api, pathType: Prefix, backend: {service: {name: api, port: {name: http}}}}
          - {path: /api/health, pathType: Exact, backend: {service: {name: health, port: {number: 8080}}}}
          - {path: /static, pathType: ImplementationSpecific, backend: {service: {name: cdn, port: {number: 80}}}}
          - {path: /bucket, pathType: Prefix, backend: {resource: {apiGroup: x.io, kind: Bucket, name: b}}}
    - host: "*.edge.test"
      http: {paths: [{path: /, pathType: Prefix, backend: {service: {name: web, port: {number: 80}}}}]}
    - http: {paths: [{path: /, pathType: Prefix, backend: {service: {name: web, port: {number: 80}}}}]}
"#,
        )
        .unwrap();
        let t = translate(&ing);
        assert_eq!(t.hosts.keys().collect::<Vec<_>>(), ["shop.edge.test"]);
        assert_eq!(t.tls_hosts, ["shop.edge.test"]);
        assert_eq!(t.problems.len(), 3, "{:?}", t.problems);
        assert!(t.problems[0].contains("resource backends"));
        assert!(t.problems[1].contains("wildcard"));
        assert!(t.problems[2].contains("without host"));
        let c = &t.hosts["shop.edge.test"];
        assert_eq!(c.source, "demo/shop");
        let table = Table::new(c.rules.clone(), c.default.clone());
        let to = |path: &str| table.lookup(path).map(|b| b.service.name.clone());
        assert_eq!(to("/api/v1").as_deref(), Some("api"));
        assert_eq!(table.lookup("/api").unwrap().service.port, IntOrString::String("http".into()));
        assert_eq!(to("/api/health").as_deref(), Some("health"));
        assert_eq!(to("/api/health/x").as_deref(), Some("api"));
        assert_eq!(to("/static/app.js").as_deref(), Some("cdn"), "ImplementationSpecific is Prefix");
        assert_eq!(to("/apiary").as_deref(), Some("web"), "the default backend");
        assert_eq!(to("/bucket").as_deref(), Some("web"), "an unsupported backend is not routed");
    }

    #[test]
    fn annotations_become_the_options_of_the_ingress_paths() {
        let ing = ingress(json!({"metadata": {"name": "i", "namespace": "n", "annotations": {
            ANNOTATION_BACKEND_PROTOCOL: "HTTPS", ANNOTATION_BACKEND_TLS_VERIFY: "false",
            ANNOTATION_CONNECT_TIMEOUT: "5", ANNOTATION_READ_TIMEOUT: "30s", ANNOTATION_BODY_SIZE: "10m",
            ANNOTATION_AUTH_SECRET: "users"}},
            "spec": {"defaultBackend": {"service": {"name": "web", "port": {"number": 443}}},
                "rules": [{"host": "h.edge.test", "http": {"paths": [{"path": "/", "pathType": "Prefix",
                "backend": {"service": {"name": "web", "port": {"number": 443}}}}]}}]}}));
        let t = translate(&ing);
        assert!(t.problems.is_empty(), "{:?}", t.problems);
        let want = HttpOptions {
            backend_protocol: Some(BackendProtocol::Https),
            backend_tls_verify: Some(false),
            connect_timeout_seconds: Some(5),
            read_timeout_seconds: Some(30),
            max_body_size: Some("10m".into()),
            auth_secret: Some("users".into()),
        };
        let c = &t.hosts["h.edge.test"];
        assert_eq!(c.rules[0].backend.options, want);
        assert_eq!(c.default.as_ref().unwrap().options, want);
        let bad = ingress(json!({"metadata": {"name": "i", "namespace": "n", "annotations": {
            ANNOTATION_BACKEND_PROTOCOL: "grpc", ANNOTATION_READ_TIMEOUT: "0", ANNOTATION_BODY_SIZE: "10q",
            ANNOTATION_BACKEND_TLS_VERIFY: "no"}}}));
        let (o, problems) = options_of(&bad);
        assert!(o.is_default());
        assert_eq!(problems.len(), 4, "{problems:?}");
    }

    #[test]
    fn tls_passthrough_goes_to_one_service() {
        let b = |name: &str| Backend {
            service: ServiceRef { name: name.into(), port: IntOrString::Int(443) },
            options: HttpOptions::default(),
        };
        let merged = |rules: Vec<(&str, &str)>, default: Option<&str>| Merged {
            rules: rules.into_iter().map(|(p, s)| Rule::new(p, PathType::Prefix, b(s))).collect(),
            default: default.map(b),
            conflicts: Vec::new(),
        };
        let mut problems = Vec::new();
        let one = passthrough_backend("h", &merged(vec![("/", "a"), ("/x", "a")], None), &mut problems);
        assert_eq!(one.unwrap().name, "a");
        assert!(problems.is_empty());
        let default = passthrough_backend("h", &merged(vec![("/x", "b")], Some("a")), &mut problems);
        assert_eq!(default.unwrap().name, "a", "the default backend");
        assert!(problems[0].1.contains("paths to other Services are ignored"), "{problems:?}");
        problems.clear();
        assert!(
            passthrough_backend("h", &merged(vec![("/", "a"), ("/x", "b")], None), &mut problems).is_none()
        );
        assert!(problems[0].1.contains("several Services"), "{problems:?}");
        problems.clear();
        let mut guarded = merged(vec![("/", "a")], None);
        guarded.rules[0].backend.options.auth_secret = Some("s".into());
        assert!(passthrough_backend("h", &guarded, &mut problems).is_none(), "never published unguarded");
    }

    #[test]
    fn two_ingresses_share_a_host() {
        let a = ingress(
            json!({"metadata": {"name": "a", "namespace": "n"}, "spec": {"rules": [{"host": "h.edge.test",
            "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "web", "port": {"number": 80}}}}]}}]}}),
        );
        let b = ingress(
            json!({"metadata": {"name": "b", "namespace": "n"}, "spec": {"rules": [{"host": "h.edge.test",
            "http": {"paths": [
                {"path": "/blog", "pathType": "Prefix", "backend": {"service": {"name": "blog", "port": {"number": 80}}}},
                {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "other", "port": {"number": 80}}}}]}}]}}),
        );
        let merged = routes::merge(&[
            translate(&a).hosts["h.edge.test"].clone(),
            translate(&b).hosts["h.edge.test"].clone(),
        ]);
        let table = Table::new(merged.rules, merged.default);
        assert_eq!(table.lookup("/blog/post").unwrap().service.name, "blog");
        assert_eq!(table.lookup("/").unwrap().service.name, "web");
        assert_eq!(merged.conflicts.len(), 1);
        assert_eq!(merged.conflicts[0].loser, "n/b");
    }

    /// An Ingress `name` of namespace `n` (uid `u-<name>`), created at
    /// second `created`, with one path `/` of `host` to Service `svc`.
    fn named(name: &str, created: u32, host: &str, svc: &str, annotations: serde_json::Value) -> Ingress {
        ingress(json!({"metadata": {"name": name, "namespace": "n", "uid": format!("u-{name}"),
            "creationTimestamp": format!("2026-01-01T00:00:{created:02}Z"), "annotations": annotations},
            "spec": {"ingressClassName": "culvert", "rules": [{"host": host, "http": {"paths": [
                {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": svc, "port": {"number": 80}}}}]}}]}}))
    }

    fn object<K: serde::de::DeserializeOwned>(v: serde_json::Value) -> K {
        serde_json::from_value(v).unwrap()
    }

    /// The host's own Domain or Tunnel (made by this controller, owned by `owner`).
    fn made(kind: &str, host: &str, owner: &str, status: serde_json::Value) -> serde_json::Value {
        let spec = if kind == "Domain" { json!({"name": "x"}) } else { json!({"domain": "x"}) };
        json!({"apiVersion": "culvert.dev/v1alpha1", "kind": kind,
            "metadata": {"name": object_name(host), "namespace": "n", "generation": 1,
                "labels": {LABEL_MANAGED_BY: MANAGED_BY}, "annotations": {ANNOTATION_HOST: host},
                "ownerReferences": [{"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                    "name": owner, "uid": format!("u-{owner}")}]},
            "spec": spec, "status": status})
    }

    /// One line per host plan: what is done, then the problems.
    fn summary(p: &Plan) -> Vec<String> {
        p.hosts
            .iter()
            .map(|h| {
                let action = match &h.action {
                    HostAction::Remove { tunnel, domain } => {
                        format!("remove tunnel={tunnel} domain={domain}")
                    }
                    HostAction::DomainRequired(m) => format!("required: {}", m.contains("not covered")),
                    HostAction::Publish { domain, tunnel, owners } => {
                        let d = match domain {
                            DomainAction::Use(d) => format!("use {}", d.name_any()),
                            DomainAction::Make(spec) => {
                                format!("make {}", serde_json::to_string(spec).unwrap())
                            }
                        };
                        let t = match tunnel {
                            Some(t) => {
                                format!("{:?} {}", t.protocol, t.services().collect::<Vec<_>>().join("+"))
                            }
                            None => "no tunnel".into(),
                        };
                        let o: Vec<&str> = owners.iter().map(|o| o.name.as_str()).collect();
                        format!("{d}, {t}, owners {}", o.join("+"))
                    }
                };
                let problems: Vec<String> =
                    h.problems.iter().map(|(who, _)| who.clone().unwrap_or("all".into())).collect();
                format!("{}: {action}; problems for [{}]", h.host, problems.join(","))
            })
            .collect()
    }

    #[test]
    fn plans_per_host() {
        let h = "h.edge.test";
        let a = named("a", 1, h, "web", json!({}));
        let b = named("b", 2, h, "blog", json!({}));
        let retain = named("a", 1, h, "web", json!({ANNOTATION_RECLAIM_POLICY: "Retain"}));
        let pass = named("b", 2, h, "blog", json!({ANNOTATION_TLS_PASSTHROUGH: "true"}));
        let other_class = ingress(json!({"metadata": {"name": "a", "namespace": "n", "uid": "u-a"},
            "spec": {"ingressClassName": "nginx", "rules": [{"host": h}]}}));
        let user_domain: Domain = object(json!({"apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
            "metadata": {"name": "mine", "namespace": "n"}, "spec": {"name": "h"}}));
        let own_domain: Domain = object(made("Domain", h, "a", json!({})));
        let own_tunnel: Tunnel = object(made("Tunnel", h, "a", json!({})));
        let make = r#"make {"name":"h","reclaimPolicy":"Delete"}"#;
        // (case, the Ingress reconciled, the namespace's Ingresses, Domains, Tunnels, policy, plan)
        type Case<'a> =
            (&'a str, &'a Ingress, Vec<Ingress>, Vec<Domain>, Vec<Tunnel>, DomainPolicy, Vec<String>);
        let table: Vec<Case> = vec![
            (
                "a new host gets a Domain made for it",
                &a,
                vec![a.clone()],
                vec![],
                vec![],
                DomainPolicy::Auto,
                vec![format!("{h}: {make}, Http web, owners a; problems for []")],
            ),
            (
                "a Domain of the namespace covers the host",
                &a,
                vec![a.clone()],
                vec![user_domain.clone()],
                vec![],
                DomainPolicy::Require,
                vec![format!("{h}: use mine, Http web, owners a; problems for []")],
            ),
            (
                "policy require without a Domain",
                &a,
                vec![a.clone()],
                vec![],
                vec![],
                DomainPolicy::Require,
                vec![format!("{h}: required: true; problems for []")],
            ),
            (
                "Retain on the Ingress",
                &retain,
                vec![retain.clone()],
                vec![],
                vec![],
                DomainPolicy::Auto,
                vec![format!(
                    r#"{h}: make {{"name":"h","reclaimPolicy":"Retain"}}, Http web, owners a; problems for []"#
                )],
            ),
            (
                "two Ingresses share the host, oldest first",
                &b,
                vec![b.clone(), a.clone()],
                vec![own_domain.clone()],
                vec![own_tunnel.clone()],
                DomainPolicy::Auto,
                vec![format!("{h}: {make}, Http web, owners a+b; problems for []")],
            ),
            (
                "the younger disagrees on passthrough: left out",
                &a,
                vec![a.clone(), pass.clone()],
                vec![],
                vec![],
                DomainPolicy::Auto,
                vec![format!("{h}: {make}, Http web, owners a; problems for [n/b]")],
            ),
            (
                "the oldest is passthrough",
                &pass,
                vec![pass.clone()],
                vec![],
                vec![],
                DomainPolicy::Auto,
                vec![format!("{h}: {make}, Tls blog, owners b; problems for []")],
            ),
            (
                "no longer ours: what was made for it goes",
                &other_class,
                vec![other_class.clone()],
                vec![own_domain.clone(), user_domain.clone()],
                vec![own_tunnel.clone()],
                DomainPolicy::Auto,
                vec![format!("{h}: remove tunnel=true domain=true; problems for []")],
            ),
            (
                "another Ingress still names the host",
                &other_class,
                vec![other_class.clone(), b.clone()],
                vec![own_domain.clone()],
                vec![own_tunnel.clone()],
                DomainPolicy::Auto,
                vec![format!("{h}: {make}, Http blog, owners b; problems for []")],
            ),
            (
                "not ours and nothing made: nothing to do",
                &other_class,
                vec![other_class.clone()],
                vec![],
                vec![],
                DomainPolicy::Auto,
                vec![],
            ),
        ];
        for (case, ing, ingresses, domains, tunnels, policy, want) in table {
            let o = Observed { classes: Vec::new(), ingresses, tunnels, domains };
            let p = plan(ing, &o, Settings { edge_domain: "edge.test", domain_policy: policy });
            assert_eq!(summary(&p), want, "{case}");
            assert_eq!(p.mine.is_some(), is_ours(ing, &[]), "{case}");
        }
    }

    #[test]
    fn host_state_from_what_was_applied() {
        let h = "h.edge.test";
        let cond = |status: &str, reason: &str| json!({"type": "Ready", "status": status, "reason": reason, "message": "m"});
        let domain = |ready: &str, reason: &str| -> Domain {
            object(made("Domain", h, "a", json!({"hostname": h, "conditions": [cond(ready, reason)]})))
        };
        let tunnel = |generation: i64, conditions: serde_json::Value| -> Tunnel {
            object(made(
                "Tunnel",
                h,
                "a",
                json!({"observedGeneration": generation, "conditions": conditions}),
            ))
        };
        let published = |connected: bool| {
            let (ready, reason) = if connected { ("True", "Published") } else { ("False", "NoAgent") };
            json!([cond(ready, reason),
                {"type": "Published", "status": "True", "reason": "Published", "message": "p"},
                {"type": "Connected", "status": if connected { "True" } else { "False" }, "reason": "r", "message": "c"}])
        };
        let publish = HostAction::Publish {
            domain: DomainAction::Make(domain_spec(h, "edge.test", ReclaimPolicy::Delete)),
            tunnel: None,
            owners: Vec::new(),
        };
        let plan = |action: HostAction| HostPlan {
            host: h.into(),
            name: object_name(h),
            action,
            conflicts: Vec::new(),
            problems: Vec::new(),
        };
        let applied =
            |d: Domain, t: Tunnel| Applied::Published { domain: Box::new(d), tunnel: Some(Box::new(t)) };
        let note = |w: bool, r: &str| Some((w, r.to_string()));
        let at = |connected: bool| Some((h.to_string(), connected));
        // (case, action, applied, report (warning, reason), public)
        let table = vec![
            (
                "published and connected",
                publish.clone(),
                applied(domain("True", "Reserved"), tunnel(1, published(true))),
                note(false, "Published"),
                at(true),
            ),
            (
                "no agent yet: not a warning, the address stays",
                publish.clone(),
                applied(domain("True", "Reserved"), tunnel(1, published(false))),
                note(false, "NoAgent"),
                at(false),
            ),
            (
                "the Domain's trouble first",
                publish.clone(),
                applied(domain("False", "Conflict"), tunnel(1, published(true))),
                note(true, "Conflict"),
                at(true),
            ),
            (
                "a route change not reconciled yet: no report, the address stays",
                publish.clone(),
                applied(domain("True", "Reserved"), tunnel(0, published(true))),
                None,
                at(true),
            ),
            (
                "a failed Tunnel is a warning",
                publish.clone(),
                applied(domain("True", "Reserved"), tunnel(1, json!([cond("False", "InvalidSpec")]))),
                note(true, "InvalidSpec"),
                None,
            ),
            (
                "no Tunnel (passthrough that cannot be published)",
                publish.clone(),
                Applied::Published { domain: Box::new(domain("True", "Reserved")), tunnel: None },
                None,
                None,
            ),
            (
                "policy require",
                HostAction::DomainRequired("no Domain".into()),
                Applied::Nothing,
                note(true, "DomainRequired"),
                None,
            ),
            ("removed", HostAction::Remove { tunnel: true, domain: true }, Applied::Nothing, None, None),
        ];
        for (case, action, applied, report, public) in table {
            let s = host_state(&plan(action), &applied);
            assert_eq!(s.report.map(|n| (n.warning, n.reason)), report, "{case}");
            assert_eq!(s.public, public, "{case}");
        }
    }

    #[test]
    fn the_report_of_an_ingress() {
        let h = "h.edge.test";
        let a = named("a", 1, h, "web", json!({}));
        let o = Observed { ingresses: vec![a.clone()], ..Default::default() };
        let p = plan(&a, &o, Settings { edge_domain: "edge.test", domain_policy: DomainPolicy::Auto });
        let resync = Duration::from_secs(300);
        let state = |public: Option<(String, bool)>| HostState {
            public,
            report: Some(Note::new(false, "Published", "ok")),
            conflicts: Vec::new(),
            problems: Vec::new(),
        };
        let r = report(&a, &p, &[state(Some((h.into(), false)))], 8443, resync);
        let status = serde_json::to_value(r.status.unwrap()).unwrap();
        assert_eq!(
            status,
            json!({"loadBalancer": {"ingress": [{"hostname": h,
                "ports": [{"port": 8443, "protocol": "TCP", "error": "culvert.dev/NoAgent"}]}]}})
        );
        assert_eq!(r.requeue, resync);
        let topics: Vec<(&str, Option<&str>)> =
            r.notes.iter().map(|(t, n)| (t.as_str(), n.as_ref().map(|n| n.reason.as_str()))).collect();
        assert_eq!(
            topics,
            [
                (h, Some("Published")),
                ("conflicts h.edge.test", None),
                ("passthrough h.edge.test", None),
                ("problems", None)
            ]
        );
        // Not published yet: the status lists nothing, and the next look is soon.
        let r = report(&a, &p, &[state(None)], 8443, resync);
        assert_eq!(
            serde_json::to_value(r.status.unwrap()).unwrap(),
            json!({"loadBalancer": {"ingress": []}})
        );
        assert_eq!(r.requeue, Duration::from_secs(5));
        // No longer ours: the status is withdrawn only when we wrote it.
        let other = Observed::default();
        let gone = plan(&a, &other, Settings { edge_domain: "edge.test", domain_policy: DomainPolicy::Auto });
        assert_eq!(report(&a, &gone, &[], 8443, resync).status, None);
        let mut wrote = a.clone();
        wrote.metadata.managed_fields =
            Some(vec![object(json!({"manager": FIELD_MANAGER, "subresource": "status"}))]);
        assert_eq!(report(&wrote, &gone, &[], 8443, resync).status, Some(IngressStatus::default()));
    }
}
