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
//! Phases: read (fresh lists of the namespace's Ingresses, Tunnels and
//! Domains) → translate and merge (pure, below) → apply the Domain and Tunnel
//! of each host → Ingress status and events.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::networking::v1::{Ingress, IngressBackend, IngressClass};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, warn};

use super::names::{
    ANNOTATION_HOST, ANNOTATION_RECLAIM_POLICY, ANNOTATION_TLS_PASSTHROUGH, DEFAULT_CLASS_ANNOTATION,
    FIELD_MANAGER, INGRESS_CLASS, INGRESS_CONTROLLER, LABEL_MANAGED_BY, LEGACY_CLASS_ANNOTATION,
};
use super::routes::{self, Contribution, Merged, Rule};
use super::status::event;
use super::{Context, DomainPolicy, Error};
use crate::crd::{Condition, Domain, PathType, ReclaimPolicy, ServiceRef, Tunnel, TunnelRoute, TunnelSpec};

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

/// What one Ingress gives each of its hosts, and what of it cannot be served.
#[derive(Debug, Default, PartialEq)]
pub struct Translated {
    pub hosts: BTreeMap<String, Contribution<ServiceRef>>,
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
    let default = match spec.default_backend.as_ref().map(service_ref) {
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
            match service_ref(&p.backend) {
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
    if ing.annotations().contains_key(ANNOTATION_TLS_PASSTHROUGH) {
        out.problems.push(format!(
            "{ANNOTATION_TLS_PASSTHROUGH}: TLS passthrough is not supported by this version yet; \
             the hosts are published as HTTPS terminated at the edge"
        ));
    }
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
fn domain_spec(host: &str, edge_domain: &str, reclaim: ReclaimPolicy) -> serde_json::Value {
    let reclaim = match reclaim {
        ReclaimPolicy::Delete => "Delete",
        ReclaimPolicy::Retain => "Retain",
    };
    match host.strip_suffix(&format!(".{edge_domain}")) {
        Some(label) if !label.contains('.') => json!({ "name": label, "reclaimPolicy": reclaim }),
        _ => json!({ "fqdn": host, "reclaimPolicy": reclaim }),
    }
}

fn ready_condition(conditions: &[Condition]) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == "Ready")
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

/// What a host looks like after a sync, for the Ingress's status and events.
struct HostState {
    /// The public name, once the Tunnel is published.
    public: Option<String>,
    /// (warning, reason, message) to report on the Ingresses of the host.
    report: Option<(bool, String, String)>,
    conflicts: Vec<routes::Conflict>,
}

/// A controller's context: the operator's, and what was last reported, so
/// events are published on transitions only (while this replica leads).
pub(super) struct Ctx {
    pub base: Arc<Context>,
    /// (object uid, topic) → last event.
    reported: Mutex<HashMap<(String, String), String>>,
}

impl Ctx {
    pub fn new(base: Arc<Context>) -> Arc<Ctx> {
        Arc::new(Ctx { base, reported: Mutex::default() })
    }

    /// Publishes an event unless the same was last reported for this topic
    /// (Normal events by reason, Warnings by reason and message).
    pub async fn report<K>(&self, obj: &K, topic: &str, warning: bool, reason: &str, message: String)
    where
        K: Resource<DynamicType = ()>,
    {
        let key = (obj.meta().uid.clone().unwrap_or_default(), topic.to_string());
        let line = if warning { format!("Warning {reason} {message}") } else { format!("Normal {reason}") };
        {
            let mut seen = self.reported.lock().expect("poisoned");
            if seen.get(&key) == Some(&line) {
                return;
            }
            seen.insert(key, line);
        }
        event(&self.base, obj, warning, reason, message).await;
    }

    /// The topic is fine again: its next problem is reported.
    pub fn forget<K: Resource>(&self, obj: &K, topic: &str) {
        let key = (obj.meta().uid.clone().unwrap_or_default(), topic.to_string());
        self.reported.lock().expect("poisoned").remove(&key);
    }
}

/// Makes a host's Domain and Tunnel match the Ingresses that name it (`ours`,
/// oldest first), or removes them when none does.
async fn sync_host(
    ctx: &Context,
    ns: &str,
    host: &str,
    ours: &[(Arc<Ingress>, Translated)],
    tunnels: &[Tunnel],
    domains: &[Domain],
) -> Result<HostState, Error> {
    let name = object_name(host);
    let tunnel_api = Api::<Tunnel>::namespaced(ctx.client.clone(), ns);
    let domain_api = Api::<Domain>::namespaced(ctx.client.clone(), ns);
    let made_by_us = |labels: &BTreeMap<String, String>| {
        labels.get(LABEL_MANAGED_BY).map(String::as_str) == Some(MANAGED_BY)
    };
    let contributors: Vec<(&Ingress, &Contribution<ServiceRef>)> =
        ours.iter().filter_map(|(i, t)| t.hosts.get(host).map(|c| (&**i, c))).collect();
    let existing_tunnel = tunnels.iter().find(|t| t.name_any() == name);
    let edge_domain = &ctx.edge_info.domain;
    let auto_domain = domains.iter().find(|d| d.name_any() == name && made_by_us(d.labels()));

    if contributors.is_empty() {
        if existing_tunnel.is_some_and(|t| made_by_us(t.labels())) {
            tunnel_api.delete(&name, &DeleteParams::background()).await?;
            info!(host, tunnel = %name, "no Ingress names the host any more: deleted its Tunnel");
        }
        if auto_domain.is_some() {
            domain_api.delete(&name, &DeleteParams::background()).await?;
            info!(host, domain = %name, "deleted the Domain made for the host");
        }
        return Ok(HostState { public: None, report: None, conflicts: Vec::new() });
    }

    let merged: Merged<ServiceRef> =
        routes::merge(&contributors.iter().map(|(_, c)| (*c).clone()).collect::<Vec<_>>());
    let owners: Vec<OwnerReference> = contributors.iter().map(|(i, _)| owner_ref(i)).collect();
    let pp = PatchParams::apply(FIELD_MANAGER).force();

    // The Domain: one of the namespace that covers the host (a ready one
    // first), else one we make (policy auto).
    let covering: Vec<&Domain> =
        domains.iter().filter(|d| domain_hosts(d, edge_domain).iter().any(|h| h == host)).collect();
    let ready = |d: &Domain| {
        d.status.as_ref().and_then(|s| ready_condition(&s.conditions)).is_some_and(|c| c.status == "True")
    };
    let chosen = covering.iter().find(|d| ready(d)).or(auto_domain.as_ref()).or(covering.first()).copied();
    let domain = match (chosen, ctx.domain_policy) {
        (Some(d), _) if !made_by_us(d.labels()) => d.clone(),
        (None, DomainPolicy::Require) => {
            let msg = format!(
                "host {host} is not covered by a Domain of namespace {ns}: create one (spec.name or spec.fqdn), \
                 or run the operator with --domain-policy auto"
            );
            return Ok(HostState {
                public: None,
                report: Some((true, "DomainRequired".into(), msg)),
                conflicts: merged.conflicts,
            });
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
            let body = json!({
                "apiVersion": "culvert.dev/v1alpha1",
                "kind": "Domain",
                "metadata": {
                    "name": name,
                    "labels": { LABEL_MANAGED_BY: MANAGED_BY },
                    "annotations": { ANNOTATION_HOST: host },
                    "ownerReferences": owners,
                },
                "spec": domain_spec(host, edge_domain, reclaim),
            });
            domain_api.patch(&name, &pp, &Patch::Apply(&body)).await?
        }
    };

    let spec = TunnelSpec {
        service: merged.default.clone(),
        routes: merged
            .rules
            .iter()
            .map(|r| TunnelRoute { path: r.path.clone(), path_type: r.path_type, service: r.backend.clone() })
            .collect(),
        protocol: Default::default(),
        domain: Some(domain.name_any()),
        tcp_port: None,
        proxy_protocol: None,
    };
    let body = json!({
        "apiVersion": "culvert.dev/v1alpha1",
        "kind": "Tunnel",
        "metadata": {
            "name": name,
            "labels": { LABEL_MANAGED_BY: MANAGED_BY },
            "annotations": { ANNOTATION_HOST: host },
            "ownerReferences": owners,
        },
        "spec": spec,
    });
    let tunnel = tunnel_api.patch(&name, &pp, &Patch::Apply(&body)).await?;

    // What to tell the Ingresses: the Domain's trouble first, then the Tunnel's.
    let domain_cond = domain.status.as_ref().and_then(|s| ready_condition(&s.conditions)).cloned();
    let tunnel_cond = tunnel.status.as_ref().and_then(|s| ready_condition(&s.conditions)).cloned();
    let fresh = tunnel.status.as_ref().and_then(|s| s.observed_generation) == tunnel.metadata.generation;
    let report = match (&domain_cond, &tunnel_cond) {
        (Some(d), _) if d.status == "False" => {
            Some((true, d.reason.clone(), format!("Domain {} for {host}: {}", domain.name_any(), d.message)))
        }
        (_, Some(t)) if fresh => {
            let warning = t.status != "True" || t.reason == "Degraded";
            Some((warning, t.reason.clone(), format!("{host} (Tunnel {name}): {}", t.message)))
        }
        _ => None,
    };
    // Not `fresh`: the status keeps the name while a route change is reconciled.
    let published = tunnel_cond.as_ref().is_some_and(|c| c.status == "True");
    let public = published.then(|| domain.status.as_ref().and_then(|s| s.hostname.clone())).flatten();
    Ok(HostState { public, report, conflicts: merged.conflicts })
}

async fn reconcile(ing: Arc<Ingress>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let started = Instant::now();
    let ns = ing.namespace().unwrap_or_default();
    let span = tracing::info_span!("reconcile", kind = "Ingress", namespace = %ns, name = %ing.name_any());
    let result = apply(ing.clone(), &ctx, &ns).instrument(span).await;
    ctx.base.metrics.reconciled(
        "Ingress",
        started.elapsed().as_secs_f64(),
        result.as_ref().map(|_| ()).map_err(Error::category),
    );
    result
}

async fn apply(ing: Arc<Ingress>, ctx: &Ctx, ns: &str) -> Result<Action, Error> {
    let base = &ctx.base;
    let client = base.client.clone();
    let lp = ListParams::default();
    // Read: fresh lists, so a just-deleted Ingress never lingers in a host's routes.
    let classes = Api::<IngressClass>::all(client.clone()).list(&lp).await?.items;
    let mut ours: Vec<(Arc<Ingress>, Translated)> = Api::<Ingress>::namespaced(client.clone(), ns)
        .list(&lp)
        .await?
        .items
        .into_iter()
        .filter(|i| i.metadata.deletion_timestamp.is_none() && is_ours(i, &classes))
        .map(|i| {
            let t = translate(&i);
            (Arc::new(i), t)
        })
        .collect();
    ours.sort_by(|(a, _), (b, _)| {
        (a.metadata.creation_timestamp.as_ref().map(|t| t.0), a.name_any())
            .cmp(&(b.metadata.creation_timestamp.as_ref().map(|t| t.0), b.name_any()))
    });
    let uid = ing.uid().unwrap_or_default();
    let mine = ours.iter().find(|(i, _)| i.uid().as_deref() == Some(uid.as_str())).map(|(_, t)| t);
    let managed = ListParams::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGED_BY}"));
    let tunnels = Api::<Tunnel>::namespaced(client.clone(), ns).list(&managed).await?.items;
    let domains = Api::<Domain>::namespaced(client.clone(), ns).list(&lp).await?.items;

    // The hosts to sync: this Ingress's, and those it gave paths before.
    let mut hosts: BTreeSet<String> = mine.map(|t| t.hosts.keys().cloned().collect()).unwrap_or_default();
    for t in &tunnels {
        if t.owner_references().iter().any(|o| o.uid == uid)
            && let Some(h) = t.annotations().get(ANNOTATION_HOST)
        {
            hosts.insert(h.clone());
        }
    }
    let mut public = Vec::new();
    for host in &hosts {
        let state = sync_host(base, ns, host, &ours, &tunnels, &domains).await?;
        if mine.is_none() {
            continue;
        }
        public.extend(state.public);
        match state.report {
            Some((warning, reason, message)) => ctx.report(&*ing, host, warning, &reason, message).await,
            None => ctx.forget(&*ing, host),
        }
        let me = format!("{ns}/{}", ing.name_any());
        let conflicts: Vec<String> = state
            .conflicts
            .iter()
            .filter(|c| c.winner == me || c.loser == me)
            .map(|c| format!("host {host}: {c}"))
            .collect();
        let topic = format!("conflicts {host}");
        if conflicts.is_empty() {
            ctx.forget(&*ing, &topic);
        } else {
            ctx.report(&*ing, &topic, true, "PathConflict", conflicts.join("; ")).await;
        }
    }

    // Status and events of this Ingress.
    let api = Api::<Ingress>::namespaced(client, ns);
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    match mine {
        Some(t) => {
            let lb: Vec<_> = public.iter().map(|h| json!({ "hostname": h })).collect();
            let status = json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "Ingress",
                "status": { "loadBalancer": { "ingress": lb } },
            });
            api.patch_status(&ing.name_any(), &pp, &Patch::Apply(&status)).await?;
            if t.problems.is_empty() {
                ctx.forget(&*ing, "problems");
            } else {
                ctx.report(&*ing, "problems", true, "Unsupported", t.problems.join("; ")).await;
            }
            if !t.tls_hosts.is_empty() {
                let msg = format!(
                    "TLS for {} is terminated at the edge with the edge's certificate; the Secrets in spec.tls are not used",
                    t.tls_hosts.join(", ")
                );
                ctx.report(&*ing, "tls", false, "TLSAtEdge", msg).await;
            }
        }
        None => {
            // No longer ours: withdraw the status we wrote, if any.
            let wrote_status = ing.managed_fields().iter().any(|m| {
                m.manager.as_deref() == Some(FIELD_MANAGER) && m.subresource.as_deref() == Some("status")
            });
            if wrote_status {
                let status = json!({ "apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "status": {} });
                api.patch_status(&ing.name_any(), &pp, &Patch::Apply(&status)).await?;
            }
        }
    }
    let pending = mine.is_some() && public.len() < hosts.len();
    Ok(Action::requeue(if pending { base.resync.min(Duration::from_secs(5)) } else { base.resync }))
}

fn error_policy(_ing: Arc<Ingress>, e: &Error, _ctx: Arc<Ctx>) -> Action {
    warn!(error = %e, category = e.category(), "Ingress reconcile failed; retrying");
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
        let to = |path: &str| table.lookup(path).map(|s| s.name.clone());
        assert_eq!(to("/api/v1").as_deref(), Some("api"));
        assert_eq!(table.lookup("/api").unwrap().port, IntOrString::String("http".into()));
        assert_eq!(to("/api/health").as_deref(), Some("health"));
        assert_eq!(to("/api/health/x").as_deref(), Some("api"));
        assert_eq!(to("/static/app.js").as_deref(), Some("cdn"), "ImplementationSpecific is Prefix");
        assert_eq!(to("/apiary").as_deref(), Some("web"), "the default backend");
        assert_eq!(to("/bucket").as_deref(), Some("web"), "an unsupported backend is not routed");
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
        assert_eq!(table.lookup("/blog/post").unwrap().name, "blog");
        assert_eq!(table.lookup("/").unwrap().name, "web");
        assert_eq!(merged.conflicts.len(), 1);
        assert_eq!(merged.conflicts[0].loser, "n/b");
    }
}
