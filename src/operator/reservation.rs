//! The Domain, TcpPort and UdpPort controllers (TcpPort and UdpPort are one
//! code path, [`reserved_port`]): one reservation at the edge per
//! object, adopted when it already exists for this cluster and namespace,
//! re-created when it was deleted out-of-band, released (or kept, with
//! `reclaimPolicy: Retain`) behind a finalizer.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures_util::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::edge_api::{Collection, EdgeApi, EdgeError, ReserveRequest};
use super::names::{LABEL_CLUSTER, LABEL_KIND, LABEL_NAME, LABEL_NAMESPACE, LABEL_UID};
use super::status::{
    Ctx, Note, apply_status, carry_transition, failure, ready, reconcile_finalized, retry_soon,
};
use super::{Context, Error};
use crate::api::{
    CertificateState, CertificateStatus, Labels, PortProtocol, Reservation, ReserveDomainRequest,
    ReservePortRequest,
};
use crate::crd::{
    Condition, Domain, DomainStatus, ReclaimPolicy, TcpPort, TcpPortSpec, TcpPortStatus, Tunnel, UdpPort,
    UdpPortSpec,
};

/// What differs between Domain, TcpPort and UdpPort.
pub trait Reserved:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + std::fmt::Debug
    + serde::Serialize
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
    const KIND: &'static str;
    /// Where the edge keeps this kind.
    const COLLECTION: Collection;
    /// The object's status, written whole.
    type Status: serde::Serialize + Clone + std::fmt::Debug + Send + Sync;
    fn reclaim(&self) -> ReclaimPolicy;
    /// The reservation's key at the edge if the spec (or the status) names it.
    fn edge_key(&self) -> Result<Option<String>, Error>;
    /// The reservation request, with the owner labels.
    /// What to reserve; `held`: what the edge holds now, if anything.
    fn request(&self, labels: Labels, held: Option<&Reservation>) -> ReserveRequest;
    /// Whether what the edge holds is as the spec says (else it is reserved
    /// again, which changes it).
    fn up_to_date(&self, _held: &Reservation) -> bool {
        true
    }
    fn conditions(&self) -> Vec<Condition>;
    fn reservation_id(&self) -> Option<String>;
    /// The status for a held reservation (`None`: not held).
    fn status(&self, r: Option<&Reservation>, condition: Condition, edge_domain: &str) -> Self::Status;
    /// The conditions of a status.
    fn status_conditions(status: &mut Self::Status) -> &mut Vec<Condition>;
}

/// A DNS label (RFC 1123): lower case letters, digits and '-', at most 63.
pub fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Reserved for Domain {
    const KIND: &'static str = "Domain";
    const COLLECTION: Collection = Collection::Domains;
    type Status = DomainStatus;

    fn reclaim(&self) -> ReclaimPolicy {
        self.spec.reclaim_policy
    }

    fn edge_key(&self) -> Result<Option<String>, Error> {
        match (&self.spec.name, &self.spec.fqdn) {
            (Some(name), None) if dns_label(name) => Ok(Some(name.clone())),
            (Some(name), None) => Err(Error::Invalid(format!(
                "spec.name `{name}` is not a DNS label (a-z, 0-9 and '-', at most 63): for a full host name use spec.fqdn"
            ))),
            (None, Some(fqdn)) if fqdn.trim() == crate::api::DEFAULT_HOST => {
                Ok(Some(crate::api::DEFAULT_HOST.into()))
            }
            (None, Some(fqdn)) => {
                let fqdn = fqdn.trim_end_matches('.').to_ascii_lowercase();
                if fqdn.split('.').count() >= 2 && fqdn.split('.').all(dns_label) {
                    Ok(Some(fqdn))
                } else {
                    Err(Error::Invalid(format!("spec.fqdn `{fqdn}` is not a valid host name")))
                }
            }
            _ => Err(Error::Invalid(
                "give exactly one of spec.name (a subdomain) and spec.fqdn (a custom domain)".into(),
            )),
        }
    }

    fn request(&self, labels: Labels, _held: Option<&Reservation>) -> ReserveRequest {
        let (name, fqdn) = match (&self.spec.name, &self.spec.fqdn) {
            (Some(name), _) => (Some(name.clone()), None),
            (_, fqdn) => (None, fqdn.clone()),
        };
        ReserveRequest::Domain(ReserveDomainRequest { name, fqdn, labels })
    }

    fn conditions(&self) -> Vec<Condition> {
        self.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default()
    }

    fn reservation_id(&self) -> Option<String> {
        self.status.as_ref().and_then(|s| s.reservation_id.clone())
    }

    fn status(&self, r: Option<&Reservation>, condition: Condition, edge_domain: &str) -> DomainStatus {
        // The default host has no certificate of its own and no CNAME.
        let default_host = self.spec.fqdn.as_deref().is_some_and(|f| f.trim() == crate::api::DEFAULT_HOST);
        let custom = r.is_some_and(|r| r.kind == crate::api::ReservationKind::Custom) && !default_host;
        let mut conditions = vec![condition];
        let mut certificate_expiry = None;
        // A custom domain (spec.fqdn under another domain than the edge's).
        if custom || (r.is_none() && self.spec.fqdn.is_some() && !default_host) {
            let state = r.and_then(|r| r.certificate.as_deref());
            conditions.push(certificate_condition(r.is_some(), state, self.metadata.generation));
            certificate_expiry = state.and_then(|c| c.not_after.clone());
        }
        DomainStatus {
            observed_generation: self.metadata.generation,
            conditions,
            certificate_expiry,
            hostname: r.and_then(|r| r.hostname.clone()),
            url: r.and_then(|r| r.url.clone()),
            cname_target: custom.then(|| edge_domain.to_string()),
            reservation_id: r.map(|r| r.id.clone()),
        }
    }

    fn status_conditions(status: &mut DomainStatus) -> &mut Vec<Condition> {
        &mut status.conditions
    }
}

/// TcpPort and UdpPort are one code path: the same spec and status, told
/// apart by the edge collection (and so the protocol) they reserve in.
macro_rules! reserved_port {
    ($kind:ty, $name:literal, $collection:expr, $protocol:expr, $idle:expr) => {
        impl Reserved for $kind {
            const KIND: &'static str = $name;
            const COLLECTION: Collection = $collection;
            type Status = TcpPortStatus;

            fn reclaim(&self) -> ReclaimPolicy {
                self.spec.reclaim_policy
            }

            fn edge_key(&self) -> Result<Option<String>, Error> {
                port_key(self.spec.port, self.status.as_ref())
            }

            fn request(&self, labels: Labels, held: Option<&Reservation>) -> ReserveRequest {
                ReserveRequest::Port(ReservePortRequest {
                    port: self.spec.port,
                    protocol: $protocol,
                    labels,
                    idle_timeout_seconds: idle_request(($idle)(&self.spec), held),
                })
            }

            fn up_to_date(&self, held: &Reservation) -> bool {
                held.idle_timeout_seconds == ($idle)(&self.spec)
            }

            fn conditions(&self) -> Vec<Condition> {
                self.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default()
            }

            fn reservation_id(&self) -> Option<String> {
                self.status.as_ref().and_then(|s| s.reservation_id.clone())
            }

            fn status(
                &self,
                r: Option<&Reservation>,
                condition: Condition,
                _edge_domain: &str,
            ) -> TcpPortStatus {
                port_status(self.metadata.generation, r, condition)
            }

            fn status_conditions(status: &mut TcpPortStatus) -> &mut Vec<Condition> {
                &mut status.conditions
            }
        }
    };
}

reserved_port!(TcpPort, "TcpPort", Collection::Ports, PortProtocol::Tcp, |s: &TcpPortSpec| s
    .idle_timeout_seconds);
reserved_port!(UdpPort, "UdpPort", Collection::UdpPorts, PortProtocol::Udp, |_: &UdpPortSpec| None);

/// The idle timeout a port reservation asks for: the spec's; 0 (back to the
/// edge's own) when the field was removed from the spec; not sent at all
/// otherwise (older edges refuse unknown fields).
fn idle_request(wanted: Option<u64>, held: Option<&Reservation>) -> Option<u64> {
    match (wanted, held.and_then(|r| r.idle_timeout_seconds)) {
        (Some(s), _) => Some(s),
        (None, Some(_)) => Some(0),
        (None, None) => None,
    }
}

/// A port reservation's key at the edge: the spec's port, else the one the
/// status recorded.
fn port_key(spec: Option<u16>, status: Option<&TcpPortStatus>) -> Result<Option<String>, Error> {
    match spec {
        Some(0) => Err(Error::Invalid("spec.port must be 1-65535".into())),
        Some(p) => Ok(Some(p.to_string())),
        None => Ok(status.and_then(|s| s.port).map(|p| p.to_string())),
    }
}

/// The status of a TcpPort or UdpPort holding `r` (`None`: not held); the
/// address is the URL without its `tcp://` or `udp://`.
fn port_status(generation: Option<i64>, r: Option<&Reservation>, condition: Condition) -> TcpPortStatus {
    let address =
        r.and_then(|r| r.url.as_deref()).map(|u| u.split_once("://").map_or(u, |(_, a)| a).to_string());
    TcpPortStatus {
        observed_generation: generation,
        conditions: vec![condition],
        port: r.and_then(|r| r.port),
        address,
        reservation_id: r.map(|r| r.id.clone()),
    }
}

/// Type of the condition that carries a custom domain's certificate state.
pub const CERTIFICATE_READY: &str = "CertificateReady";

/// The `CertificateReady` condition of a custom domain from the edge's
/// certificate state (`None`: the edge does not run ACME).
pub fn certificate_condition(
    reserved: bool,
    state: Option<&CertificateState>,
    generation: Option<i64>,
) -> Condition {
    let (status, reason, message) = match state {
        _ if !reserved => ("Unknown", "NotReserved", "the domain is not reserved at the edge".to_string()),
        None => (
            "False",
            "AcmeDisabled",
            "the edge does not order certificates: start it with --acme, or give it a certificate for this name"
                .to_string(),
        ),
        Some(c) => {
            let error = c.last_error.as_deref().unwrap_or("no details");
            let retry = c.next_attempt_at.as_deref().map(|t| format!("; next try at {t}")).unwrap_or_default();
            match c.status {
                CertificateStatus::Ready => {
                    let until = c.not_after.as_deref().unwrap_or("unknown");
                    let renew = c.renew_at.as_deref().map(|t| format!(", renewed from {t}")).unwrap_or_default();
                    let last = c
                        .last_error
                        .as_deref()
                        .map(|e| format!("; the last renewal failed: {e}{retry}"))
                        .unwrap_or_default();
                    ("True", "Issued", format!("the certificate is valid until {until}{renew}{last}"))
                }
                CertificateStatus::Pending => {
                    ("False", "Pending", "the edge is ordering a certificate".to_string())
                }
                CertificateStatus::DnsMismatch => ("False", "DnsMismatch", format!("{error}{retry}")),
                CertificateStatus::Failed => {
                    ("False", "OrderFailed", format!("ordering the certificate failed: {error}{retry}"))
                }
                CertificateStatus::Expired => {
                    ("False", "Expired", format!("the certificate expired and was not renewed: {error}{retry}"))
                }
            }
        }
    };
    Condition {
        type_: CERTIFICATE_READY.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: Some(k8s_openapi::jiff::Timestamp::now().to_string()),
        observed_generation: generation,
    }
}

/// The edge labels that say an object of the cluster `cluster_id` and its
/// namespace holds a thing.
pub fn labels_of(cluster_id: &str, kind: &str, obj: &impl ResourceExt) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_CLUSTER.to_string(), cluster_id.to_string()),
        (LABEL_NAMESPACE.to_string(), obj.namespace().unwrap_or_default()),
        (LABEL_KIND.to_string(), kind.to_string()),
        (LABEL_NAME.to_string(), obj.name_any()),
    ])
}

pub fn selector(labels: &BTreeMap<String, String>) -> String {
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// How a reconcile came to hold its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Reserved now, or held already under the id the status names.
    Reserved,
    /// Held already by this namespace, under another (or no) recorded id.
    Adopted,
    /// The reservation the status names was gone at the edge: reserved again.
    Recreated,
}

/// What a reconcile read, at the edge and in Kubernetes.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// The reservation the object means: by its key, or by our labels.
    pub found: Option<Reservation>,
    /// `found` carries the name of another object of this namespace, and
    /// that object exists.
    pub other_holder_exists: bool,
}

/// Reads what the object refers to: the reservation at the edge, and (when
/// another object's name is on it) whether that object exists.
async fn observe<K: Reserved, E: EdgeApi>(edge: &E, ctx: &Context, obj: &K) -> Result<Observed, Error> {
    let labels = labels_of(&ctx.cluster_id, K::KIND, obj);
    let found = observe_edge(edge, obj, &labels).await?;
    let ns = obj.namespace().unwrap_or_default();
    // Only a reservation of this cluster and namespace can be another object's.
    let this_namespace = |r: &&Reservation| {
        r.labels.get(LABEL_CLUSTER) == Some(&ctx.cluster_id) && r.labels.get(LABEL_NAMESPACE) == Some(&ns)
    };
    let other = found
        .as_ref()
        .filter(this_namespace)
        .and_then(|r| r.labels.get(LABEL_NAME))
        .filter(|n| **n != obj.name_any());
    let other_holder_exists = match other {
        Some(name) if !name.is_empty() => {
            Api::<K>::namespaced(ctx.client.clone(), &ns).get_opt(name).await?.is_some()
        }
        _ => false,
    };
    Ok(Observed { found, other_holder_exists })
}

/// The edge part of [`observe`].
async fn observe_edge<K: Reserved, E: EdgeApi>(
    edge: &E,
    obj: &K,
    labels: &BTreeMap<String, String>,
) -> Result<Option<Reservation>, Error> {
    match obj.edge_key()? {
        Some(key) => match edge.reservation(K::COLLECTION, &key).await {
            Ok(r) => Ok(r),
            Err(EdgeError::Refused { status: 403, .. }) if key == crate::api::DEFAULT_HOST => Err(Error::Conflict(
                "the edge's default host `*` is held by another API key (one holder per edge): the edge's admin sees which (culvert admin domain list)".into(),
            )),
            Err(EdgeError::Refused { status: 403, .. }) => Err(Error::Conflict(format!(
                "{key} is reserved at the edge by another API key; pick another name"
            ))),
            Err(e) => Err(e.into()),
        },
        None => Ok(edge.reservations(K::COLLECTION, &selector(labels)).await?.into_iter().next()),
    }
}

/// The observed reservation, if this object may hold it: never one of
/// another cluster or namespace, nor one another existing object holds.
pub fn ours<'a, K: Reserved>(
    obj: &K,
    cluster_id: &str,
    observed: &'a Observed,
) -> Result<Option<&'a Reservation>, Error> {
    let Some(r) = &observed.found else { return Ok(None) };
    let holder = |k: &str| r.labels.get(k).map(String::as_str).unwrap_or("");
    if holder(LABEL_CLUSTER) != cluster_id || holder(LABEL_NAMESPACE) != obj.namespace().unwrap_or_default() {
        return Err(Error::Conflict(format!(
            "{} is held by another cluster or namespace (cluster {}, namespace {}); it is never taken over",
            r.target(),
            if holder(LABEL_CLUSTER).is_empty() { "unknown" } else { holder(LABEL_CLUSTER) },
            if holder(LABEL_NAMESPACE).is_empty() { "unknown" } else { holder(LABEL_NAMESPACE) },
        )));
    }
    if observed.other_holder_exists {
        return Err(Error::Conflict(format!(
            "{} is held by {} {} of this namespace",
            r.target(),
            K::KIND,
            holder(LABEL_NAME)
        )));
    }
    Ok(Some(r))
}

/// What to do at the edge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The reservation is held already.
    Keep(Reservation, Outcome),
    /// Reserve with this request.
    Reserve(ReserveRequest, Outcome),
}

/// Decides, without IO, what the object needs at the edge.
pub fn plan<K: Reserved>(obj: &K, cluster_id: &str, observed: &Observed) -> Result<Plan, Error> {
    obj.edge_key()?;
    Ok(match ours(obj, cluster_id, observed)? {
        Some(r) if !obj.up_to_date(r) => {
            let how = if obj.reservation_id().as_deref() == Some(&r.id) {
                Outcome::Reserved
            } else {
                Outcome::Adopted
            };
            Plan::Reserve(obj.request(labels_of(cluster_id, K::KIND, obj), Some(r)), how)
        }
        Some(r) if obj.reservation_id().as_deref() == Some(&r.id) => Plan::Keep(r.clone(), Outcome::Reserved),
        Some(r) => Plan::Keep(r.clone(), Outcome::Adopted),
        None => {
            let how = if obj.reservation_id().is_some() { Outcome::Recreated } else { Outcome::Reserved };
            Plan::Reserve(obj.request(labels_of(cluster_id, K::KIND, obj), None), how)
        }
    })
}

/// Carries out a plan at the edge.
pub async fn execute<E: EdgeApi>(edge: &E, plan: Plan) -> Result<(Reservation, Outcome), Error> {
    match plan {
        Plan::Keep(r, how) => Ok((r, how)),
        Plan::Reserve(request, how) => {
            let r = edge.reserve(&request).await.map_err(|e| match e {
                EdgeError::Refused { status: 409 | 422, message, .. } => Error::Conflict(message),
                // What the key may not hold: the edge's message says what to ask its admin.
                EdgeError::Refused { status: 403, code, message }
                    if ["custom_domain_not_allowed", "default_host_not_allowed", "quota_exceeded"]
                        .contains(&code.as_str()) =>
                {
                    Error::Conflict(message)
                }
                e => e.into(),
            })?;
            Ok((r, how))
        }
    }
}

/// What a reconcile writes after the edge: the status, the events, and when
/// to look again (`None`: fail with the error, to be retried).
#[derive(Debug)]
pub struct Report<S> {
    pub status: S,
    /// (warning, reason, note), in order.
    pub events: Vec<(bool, String, String)>,
    pub requeue: Option<std::time::Duration>,
}

/// The status, events and requeue for the result of [`execute`], without IO.
pub fn report<K: Reserved>(
    obj: &K,
    result: &Result<(Reservation, Outcome), Error>,
    edge_domain: &str,
    resync: std::time::Duration,
) -> Report<K::Status> {
    let generation = obj.meta().generation;
    let mut status = match result {
        Ok((r, _)) => {
            let msg =
                format!("{} is reserved at the edge: {}", r.target(), r.url.clone().unwrap_or_default());
            obj.status(Some(r), ready(true, "Reserved", msg, generation), edge_domain)
        }
        Err(e) => {
            let (reason, message) = failure(e);
            obj.status(None, ready(false, reason, message, generation), edge_domain)
        }
    };
    let old = obj.conditions();
    let conditions = K::status_conditions(&mut status);
    let changes: Vec<bool> = conditions.iter_mut().map(|c| carry_transition(c, &old)).collect();
    let (condition, changed) = (conditions[0].clone(), changes[0]);
    let certificate = conditions.iter().zip(&changes).find(|(c, _)| c.type_ == CERTIFICATE_READY);
    let certificate_pending = certificate.is_some_and(|(c, _)| {
        c.status != "True" && !matches!(c.reason.as_str(), "NotReserved" | "AcmeDisabled")
    });
    let mut events = Vec::new();
    if let Some((c, true)) = certificate {
        match c.reason.as_str() {
            "Issued" => events.push((false, "CertificateIssued".to_string(), c.message.clone())),
            "DnsMismatch" | "OrderFailed" | "Expired" | "AcmeDisabled" => {
                events.push((true, format!("Certificate{}", c.reason), c.message.clone()))
            }
            _ => {}
        }
    }
    match result {
        // Adopting and re-creating are events whenever they happen.
        Ok((_, Outcome::Recreated)) => {
            let note =
                format!("the reservation was missing at the edge and was re-created: {}", condition.message);
            events.push((false, "Recreated".into(), note))
        }
        Ok((_, Outcome::Adopted)) => {
            let note = format!("adopted the existing reservation of this namespace: {}", condition.message);
            events.push((false, "Adopted".into(), note))
        }
        _ if changed => {
            events.push((condition.status != "True", condition.reason.clone(), condition.message.clone()))
        }
        _ => {}
    }
    let requeue = match result {
        // The edge works on the certificate on its own: look again soon.
        Ok(_) if certificate_pending => Some(resync.min(CERTIFICATE_RECHECK)),
        Ok(_) | Err(Error::Invalid(_) | Error::Conflict(_)) => Some(resync),
        Err(_) => None,
    };
    Report { status, events, requeue }
}

async fn apply<K: Reserved>(obj: Arc<K>, reporter: &Ctx) -> Result<Action, Error> {
    let ctx = &*reporter.base;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let result = async {
        let observed = observe(&ctx.edge, ctx, &*obj).await?;
        execute(&ctx.edge, plan(&*obj, &ctx.cluster_id, &observed)?).await
    }
    .await;
    let report = report(&*obj, &result, &ctx.edge_domain, ctx.resync);
    apply_status(&api, &*obj, &report.status).await?;
    for (warning, reason, note) in report.events {
        reporter.event(&*obj, &Note::new(warning, reason, note)).await;
    }
    match (report.requeue, result) {
        (Some(after), _) => Ok(Action::requeue(after)),
        (None, Err(e)) => Err(e),
        (None, Ok(_)) => unreachable!("a reservation held is requeued"),
    }
}

/// How often a custom domain whose certificate is not ready is looked at again.
const CERTIFICATE_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// What to release at the edge when the object goes: its reservation, if
/// it is ours (a spec that never was valid, or a reservation of someone
/// else's, leaves nothing of ours to release).
pub fn plan_cleanup<K: Reserved>(obj: &K, cluster_id: &str, observed: &Observed) -> Option<String> {
    if obj.reclaim() == ReclaimPolicy::Retain {
        return None;
    }
    let r = ours(obj, cluster_id, observed).ok().flatten()?;
    Some(r.hostname.clone().or(r.port.map(|p| p.to_string())).unwrap_or_default())
}

async fn cleanup<K: Reserved>(obj: Arc<K>, ctx: &Context) -> Result<Action, Error> {
    if obj.reclaim() == ReclaimPolicy::Retain {
        info!("reclaimPolicy Retain: keeping the reservation at the edge");
        return Ok(Action::await_change());
    }
    let observed = match observe(&ctx.edge, ctx, &*obj).await {
        Ok(observed) => observed,
        Err(Error::Conflict(_) | Error::Invalid(_)) => Observed::default(),
        Err(e) => return Err(e),
    };
    if let Some(key) = plan_cleanup(&*obj, &ctx.cluster_id, &observed) {
        ctx.edge.release(K::COLLECTION, &key).await?;
        info!(reservation = %key, "released the reservation");
    }
    Ok(Action::await_change())
}

async fn reconcile<K: Reserved>(obj: Arc<K>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    reconcile_finalized(K::KIND, obj, &ctx.base, |o| apply(o, &ctx), |o| cleanup(o, &ctx.base)).await
}

fn error_policy<K: Reserved>(obj: Arc<K>, e: &Error, _ctx: Arc<Ctx>) -> Action {
    retry_soon(K::KIND, &*obj, e)
}

async fn run_controller<K: Reserved>(ctx: Arc<Context>, stop: CancellationToken) {
    let api = ctx.api::<K>();
    Controller::new(api, watcher::Config::default().any_semantic())
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(reconcile::<K>, error_policy::<K>, Ctx::new(ctx))
        .for_each(|_| async {})
        .await;
}

pub async fn run_domains(ctx: Arc<Context>, stop: CancellationToken) {
    run_controller::<Domain>(ctx, stop).await
}

pub async fn run_tcp_ports(ctx: Arc<Context>, stop: CancellationToken) {
    run_controller::<TcpPort>(ctx, stop).await
}

pub async fn run_udp_ports(ctx: Arc<Context>, stop: CancellationToken) {
    run_controller::<UdpPort>(ctx, stop).await
}

/// At start: revokes the keys of Tunnels of this cluster that no longer
/// exist (deleted while no operator was running).
pub async fn revoke_orphans(ctx: &Context) -> Result<(), Error> {
    let tunnels = ctx.api::<Tunnel>().list(&Default::default()).await?;
    let live: HashSet<String> = tunnels.items.iter().filter_map(|t| t.metadata.uid.clone()).collect();
    let mut selector = format!("{LABEL_CLUSTER}={},{LABEL_KIND}=Tunnel", ctx.cluster_id);
    if let Some(ns) = &ctx.watch_namespace {
        selector.push_str(&format!(",{LABEL_NAMESPACE}={ns}"));
    }
    for key in ctx.edge.tunnel_keys(&selector).await? {
        let uid = key.labels.get(LABEL_UID).cloned().unwrap_or_default();
        if !live.contains(&uid) {
            ctx.edge.revoke_tunnel_key(&key.id).await?;
            info!(key = %key.id, tunnel_uid = %uid, "revoked the key of a Tunnel deleted while the operator was down");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn state(status: CertificateStatus, error: Option<&str>) -> CertificateState {
        CertificateState {
            status,
            not_after: Some("2030-01-01T00:00:00Z".into()),
            renew_at: Some("2029-12-02T00:00:00Z".into()),
            next_attempt_at: error.map(|_| "2029-12-02T01:00:00Z".into()),
            last_error: error.map(str::to_string),
            updated_at: "2029-12-02T00:00:00Z".into(),
        }
    }

    #[test]
    fn certificate_conditions() {
        let c = |reserved, s: Option<CertificateState>| {
            let c = certificate_condition(reserved, s.as_ref(), Some(3));
            assert_eq!((c.type_.as_str(), c.observed_generation), (CERTIFICATE_READY, Some(3)));
            (c.status, c.reason, c.message)
        };
        let (status, reason, message) = c(true, Some(state(CertificateStatus::Ready, None)));
        assert_eq!((status.as_str(), reason.as_str()), ("True", "Issued"));
        assert_eq!(
            message,
            "the certificate is valid until 2030-01-01T00:00:00Z, renewed from 2029-12-02T00:00:00Z"
        );
        let (status, reason, message) = c(true, Some(state(CertificateStatus::Ready, Some("CA down"))));
        assert_eq!((status.as_str(), reason.as_str()), ("True", "Issued"));
        assert!(
            message.ends_with("; the last renewal failed: CA down; next try at 2029-12-02T01:00:00Z"),
            "{message}"
        );
        let wrong = "app.example.org resolves to 192.0.2.1, not to this edge";
        let (status, reason, message) = c(true, Some(state(CertificateStatus::DnsMismatch, Some(wrong))));
        assert_eq!((status.as_str(), reason.as_str()), ("False", "DnsMismatch"));
        assert!(message.starts_with(wrong), "{message}");
        let (_, reason, message) = c(true, Some(state(CertificateStatus::Failed, Some("rate limited"))));
        assert_eq!(reason, "OrderFailed");
        assert!(message.contains("rate limited") && message.contains("next try at"), "{message}");
        assert_eq!(c(true, Some(state(CertificateStatus::Pending, None))).1, "Pending");
        assert_eq!(c(true, Some(state(CertificateStatus::Expired, Some("x")))).1, "Expired");
        let (status, reason, message) = c(true, None);
        assert_eq!((status.as_str(), reason.as_str()), ("False", "AcmeDisabled"));
        assert!(message.contains("--acme"), "{message}");
        assert_eq!(c(false, None).0, "Unknown");
    }

    #[test]
    fn domain_status_carries_the_certificate() {
        let domain: Domain = serde_json::from_value(json!({
            "apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
            "metadata": {"name": "app", "namespace": "web", "generation": 2},
            "spec": {"fqdn": "app.example.org"}
        }))
        .unwrap();
        let mut r: Reservation = serde_json::from_value(json!({
            "id": "rs_0123456789ab", "kind": "custom", "hostname": "app.example.org",
            "createdAt": "2029-01-01T00:00:00Z", "url": "https://app.example.org"
        }))
        .unwrap();
        r.certificate = Some(Box::new(state(CertificateStatus::Ready, None)));
        let ready = super::super::status::ready(true, "Reserved", "ok", Some(2));
        let v = domain.status(Some(&r), ready.clone(), "edge.example.com");
        assert_eq!(v.certificate_expiry.as_deref(), Some("2030-01-01T00:00:00Z"));
        assert_eq!(v.cname_target.as_deref(), Some("edge.example.com"));
        assert_eq!(v.conditions[0].type_, "Ready");
        assert_eq!(v.conditions[1].type_, "CertificateReady");
        assert_eq!(v.conditions[1].status, "True");

        // A subdomain has no certificate condition.
        let sub: Domain = serde_json::from_value(json!({
            "apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
            "metadata": {"name": "blog", "namespace": "web"}, "spec": {"name": "blog"}
        }))
        .unwrap();
        r.kind = crate::api::ReservationKind::Subdomain;
        r.certificate = None;
        let v = serde_json::to_value(sub.status(Some(&r), ready, "edge.example.com")).unwrap();
        assert_eq!(v["conditions"].as_array().unwrap().len(), 1);
        assert!(v.get("certificateExpiry").is_none());
        assert!(v.get("cnameTarget").is_none());
    }

    const CLUSTER: &str = "c1";

    fn domain(spec: serde_json::Value, status: Option<serde_json::Value>) -> Domain {
        serde_json::from_value(json!({
            "apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
            "metadata": {"name": "blog", "namespace": "web", "generation": 1},
            "spec": spec, "status": status,
        }))
        .unwrap()
    }

    fn held(id: &str, cluster: &str, namespace: &str, name: &str) -> Reservation {
        serde_json::from_value(json!({
            "id": id, "kind": "subdomain", "hostname": "blog.edge.test", "createdAt": "2026-12-01T00:00:00Z",
            "url": "https://blog.edge.test",
            "labels": {LABEL_CLUSTER: cluster, LABEL_NAMESPACE: namespace, LABEL_KIND: "Domain", LABEL_NAME: name},
        }))
        .unwrap()
    }

    /// What a plan came to, in words: `keep Reserved`, `reserve Recreated`, `Conflict: ...`.
    fn words(p: Result<Plan, Error>) -> String {
        match p {
            Ok(Plan::Keep(_, how)) => format!("keep {how:?}"),
            Ok(Plan::Reserve(_, how)) => format!("reserve {how:?}"),
            Err(e) => format!("{}: {e}", e.category()),
        }
    }

    #[test]
    fn plans_reserve_adopt_recreate_and_refuse() {
        let blog = json!({"name": "blog"});
        let with_id = Some(json!({"reservationId": "rs_1"}));
        let mine = held("rs_1", CLUSTER, "web", "blog");
        let observed =
            |found: Option<Reservation>, other_holder_exists| Observed { found, other_holder_exists };
        // (spec, status, observed, plan)
        let table = [
            (blog.clone(), None, observed(None, false), "reserve Reserved"),
            (blog.clone(), with_id.clone(), observed(None, false), "reserve Recreated"),
            (blog.clone(), with_id.clone(), observed(Some(mine.clone()), false), "keep Reserved"),
            (blog.clone(), None, observed(Some(mine.clone()), false), "keep Adopted"),
            (
                blog.clone(),
                Some(json!({"reservationId": "rs_0"})),
                observed(Some(mine.clone()), false),
                "keep Adopted",
            ),
            (
                blog.clone(),
                None,
                observed(Some(held("rs_1", "c2", "web", "blog")), false),
                "Conflict: blog.edge.test is held by another cluster or namespace (cluster c2, namespace web); it is never taken over",
            ),
            (
                blog.clone(),
                None,
                observed(Some(held("rs_1", CLUSTER, "shop", "blog")), false),
                "Conflict: blog.edge.test is held by another cluster or namespace (cluster c1, namespace shop); it is never taken over",
            ),
            (
                blog.clone(),
                None,
                observed(Some(held("rs_1", "", "", "")), false),
                "Conflict: blog.edge.test is held by another cluster or namespace (cluster unknown, namespace unknown); it is never taken over",
            ),
            (
                blog.clone(),
                None,
                observed(Some(held("rs_1", CLUSTER, "web", "old-blog")), true),
                "Conflict: blog.edge.test is held by Domain old-blog of this namespace",
            ),
            // The other object is gone: its reservation is adopted.
            (
                blog.clone(),
                None,
                observed(Some(held("rs_1", CLUSTER, "web", "old-blog")), false),
                "keep Adopted",
            ),
            (
                json!({"name": "Blog"}),
                None,
                observed(None, false),
                "InvalidSpec: spec.name `Blog` is not a DNS label (a-z, 0-9 and '-', at most 63): for a full host name use spec.fqdn",
            ),
            (
                json!({}),
                None,
                observed(None, false),
                "InvalidSpec: give exactly one of spec.name (a subdomain) and spec.fqdn (a custom domain)",
            ),
        ];
        for (spec, status, observed, want) in table {
            let d = domain(spec.clone(), status.clone());
            assert_eq!(words(plan(&d, CLUSTER, &observed)), want, "{spec} {status:?}");
        }
        // A new reservation carries the owner labels.
        let Ok(Plan::Reserve(ReserveRequest::Domain(req), _)) =
            plan(&domain(blog, None), CLUSTER, &Observed::default())
        else {
            panic!("not a domain reservation")
        };
        assert_eq!((req.name.as_deref(), req.fqdn.as_deref()), (Some("blog"), None));
        assert_eq!(req.labels[LABEL_CLUSTER], CLUSTER);
        assert_eq!(req.labels[LABEL_NAME], "blog");
    }

    #[test]
    fn port_requests_name_the_port_or_none() {
        let port = |spec: serde_json::Value| -> TcpPort {
            serde_json::from_value(json!({
                "apiVersion": "culvert.dev/v1alpha1", "kind": "TcpPort",
                "metadata": {"name": "db", "namespace": "web"}, "spec": spec,
            }))
            .unwrap()
        };
        for (spec, want) in [(json!({"port": 20005}), Some(20005)), (json!({}), None)] {
            let Ok(Plan::Reserve(ReserveRequest::Port(req), Outcome::Reserved)) =
                plan(&port(spec), CLUSTER, &Observed::default())
            else {
                panic!("not a port reservation")
            };
            assert_eq!(req.port, want);
        }
        assert_eq!(
            words(plan(&port(json!({"port": 0})), CLUSTER, &Observed::default())),
            "InvalidSpec: spec.port must be 1-65535"
        );
    }

    /// A TcpPort's `idleTimeoutSeconds` (issue 18 item 2): sent when set,
    /// the held port reserved again when it differs, `0` when the field was
    /// removed (the edge's own again); nothing sent when neither has one.
    #[test]
    fn a_port_follows_its_idle_timeout() {
        let port = |spec: serde_json::Value| -> TcpPort {
            serde_json::from_value(json!({
                "apiVersion": "culvert.dev/v1alpha1", "kind": "TcpPort",
                "metadata": {"name": "db", "namespace": "web"}, "spec": spec,
                "status": {"reservationId": "rs_1"},
            }))
            .unwrap()
        };
        let held = |idle: Option<u64>| {
            let mut r: Reservation = serde_json::from_value(json!({
                "id": "rs_1", "kind": "tcp", "port": 20005, "createdAt": "2026-12-01T00:00:00Z",
                "labels": {LABEL_CLUSTER: CLUSTER, LABEL_NAMESPACE: "web", LABEL_KIND: "TcpPort", LABEL_NAME: "db"},
            }))
            .unwrap();
            r.idle_timeout_seconds = idle;
            Observed { found: Some(r), other_holder_exists: false }
        };
        let sent = |spec: serde_json::Value, idle: Option<u64>| match plan(&port(spec), CLUSTER, &held(idle))
        {
            Ok(Plan::Reserve(ReserveRequest::Port(req), Outcome::Reserved)) => Some(req.idle_timeout_seconds),
            Ok(Plan::Keep(..)) => None,
            other => panic!("{other:?}"),
        };
        let spec = json!({"port": 20005, "idleTimeoutSeconds": 90});
        assert_eq!(sent(spec.clone(), None), Some(Some(90)));
        assert_eq!(sent(spec.clone(), Some(30)), Some(Some(90)));
        assert_eq!(sent(spec, Some(90)), None, "as the spec says: kept");
        assert_eq!(sent(json!({"port": 20005}), Some(90)), Some(Some(0)), "removed: the edge's own");
        assert_eq!(sent(json!({"port": 20005}), None), None);
        // A new port: sent only when set.
        let Ok(Plan::Reserve(ReserveRequest::Port(req), _)) =
            plan(&port(json!({"idleTimeoutSeconds": 5})), CLUSTER, &Observed::default())
        else {
            panic!("a reservation")
        };
        assert_eq!(req.idle_timeout_seconds, Some(5));
    }

    #[test]
    fn cleanup_releases_only_what_is_ours() {
        let observed = |r| Observed { found: Some(r), other_holder_exists: false };
        let d = domain(json!({"name": "blog"}), None);
        let mine = observed(held("rs_1", CLUSTER, "web", "blog"));
        assert_eq!(plan_cleanup(&d, CLUSTER, &mine).as_deref(), Some("blog.edge.test"));
        assert_eq!(plan_cleanup(&d, CLUSTER, &observed(held("rs_1", "c2", "web", "blog"))), None);
        assert_eq!(plan_cleanup(&d, CLUSTER, &Observed::default()), None);
        let retained = domain(json!({"name": "blog", "reclaimPolicy": "Retain"}), None);
        assert_eq!(plan_cleanup(&retained, CLUSTER, &mine), None);
    }

    #[tokio::test]
    async fn execute_reserves_at_the_edge_and_reports() {
        use super::super::edge_api::fake::FakeEdge;
        let edge = FakeEdge::default();
        let d = domain(json!({"name": "blog"}), Some(json!({"reservationId": "rs_9"})));
        let labels = labels_of(CLUSTER, "Domain", &d);
        let observed =
            Observed { found: observe_edge(&edge, &d, &labels).await.unwrap(), other_holder_exists: false };
        let result = execute(&edge, plan(&d, CLUSTER, &observed).unwrap()).await;
        let (r, how) = result.as_ref().unwrap();
        assert_eq!((r.hostname.as_deref(), *how), (Some("blog.edge.test"), Outcome::Recreated));
        assert_eq!(edge.state().journal, ["reserve blog.edge.test"]);
        assert_eq!(edge.state().reservations["blog.edge.test"].labels, labels);
        let resync = std::time::Duration::from_secs(300);
        let rep = report(&d, &result, "edge.test", resync);
        assert_eq!(rep.status.reservation_id.as_deref(), Some(r.id.as_str()));
        assert_eq!(
            (rep.status.conditions[0].status.as_str(), rep.status.conditions[0].reason.as_str()),
            ("True", "Reserved")
        );
        assert_eq!(rep.events.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(), ["Recreated"]);
        assert_eq!(rep.requeue, Some(resync));

        // Found again by its labels (an object whose status lost the id): adopted, no write.
        let again = domain(json!({"name": "blog"}), None);
        let observed = Observed {
            found: observe_edge(&edge, &again, &labels).await.unwrap(),
            other_holder_exists: false,
        };
        let result = execute(&edge, plan(&again, CLUSTER, &observed).unwrap()).await;
        assert_eq!(result.as_ref().unwrap().1, Outcome::Adopted);
        assert_eq!(edge.state().journal.len(), 1, "nothing written");

        // Held by another API key: a conflict, reported as such, not retried as an error.
        edge.state().foreign.push("shop.edge.test".into());
        let shop = domain(json!({"name": "shop"}), None);
        let result = execute(&edge, plan(&shop, CLUSTER, &Observed::default()).unwrap()).await;
        let rep = report(&shop, &result, "edge.test", resync);
        assert_eq!(rep.status.conditions[0].reason, "Conflict");
        assert_eq!(rep.events, [(true, "Conflict".to_string(), rep.status.conditions[0].message.clone())]);
        assert_eq!(rep.requeue, Some(resync));

        // The edge is down: EdgeUnavailable, and the error is returned (retried).
        edge.state().down = true;
        let result = execute(&edge, plan(&shop, CLUSTER, &Observed::default()).unwrap()).await;
        let rep = report(&shop, &result, "edge.test", resync);
        assert_eq!(rep.status.conditions[0].reason, "EdgeUnavailable");
        assert!(rep.status.conditions[0].message.starts_with("cannot reach the edge: "));
        assert_eq!(rep.requeue, None);
    }

    #[test]
    fn kubernetes_errors_are_not_edge_errors() {
        let e = Error::Kube(kube::Error::Api(
            kube::core::Status::failure("denied", "Forbidden").with_code(403).boxed(),
        ));
        let rep = report(&domain(json!({"name": "blog"}), None), &Err(e), "edge.test", Default::default());
        let c = &rep.status.conditions[0];
        assert_eq!(c.reason, "KubeApiError");
        assert!(c.message.starts_with("kubernetes API call failed"), "{}", c.message);
        assert_eq!(rep.requeue, None);
    }
}
