//! The Domain and TcpPort controllers: one reservation at the edge per
//! object, adopted when it already exists for this cluster and namespace,
//! re-created when it was deleted out-of-band, released (or kept, with
//! `reclaimPolicy: Retain`) behind a finalizer.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures_util::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info};

use super::names::{FINALIZER, LABEL_CLUSTER, LABEL_KIND, LABEL_NAME, LABEL_NAMESPACE, LABEL_UID};
use super::status::{apply_status, carry_transition, event, fresh_for_finalizer, ready};
use super::{Context, Error};
use crate::api::{CertificateState, CertificateStatus, Reservation, TunnelKey};
use crate::api_client::ClientError as AdminError;
use crate::crd::{Condition, Domain, DomainStatus, ReclaimPolicy, TcpPort, TcpPortStatus, Tunnel};

/// What differs between Domain and TcpPort.
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
    /// `domains` or `ports`.
    const COLLECTION: &'static str;
    fn reclaim(&self) -> ReclaimPolicy;
    /// The reservation's key at the edge if the spec (or the status) names it.
    fn edge_key(&self) -> Result<Option<String>, Error>;
    /// The body of `POST <collection>` (labels are added).
    fn request(&self) -> Value;
    fn conditions(&self) -> Vec<Condition>;
    fn reservation_id(&self) -> Option<String>;
    /// The status for a held reservation (`None`: not held).
    fn status(&self, r: Option<&Reservation>, condition: Condition, edge_domain: &str) -> Value;
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

impl Reserved for Domain {
    const KIND: &'static str = "Domain";
    const COLLECTION: &'static str = "domains";

    fn reclaim(&self) -> ReclaimPolicy {
        self.spec.reclaim_policy
    }

    fn edge_key(&self) -> Result<Option<String>, Error> {
        match (&self.spec.name, &self.spec.fqdn) {
            (Some(name), None) if is_dns_label(name) => Ok(Some(name.clone())),
            (Some(name), None) => Err(Error::Invalid(format!(
                "spec.name `{name}` is not a DNS label (a-z, 0-9 and '-', at most 63): for a full host name use spec.fqdn"
            ))),
            (None, Some(fqdn)) => {
                let fqdn = fqdn.trim_end_matches('.').to_ascii_lowercase();
                if fqdn.split('.').count() >= 2 && fqdn.split('.').all(is_dns_label) {
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

    fn request(&self) -> Value {
        match (&self.spec.name, &self.spec.fqdn) {
            (Some(name), _) => json!({ "name": name }),
            (_, fqdn) => json!({ "fqdn": fqdn }),
        }
    }

    fn conditions(&self) -> Vec<Condition> {
        self.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default()
    }

    fn reservation_id(&self) -> Option<String> {
        self.status.as_ref().and_then(|s| s.reservation_id.clone())
    }

    fn status(&self, r: Option<&Reservation>, condition: Condition, edge_domain: &str) -> Value {
        let custom = r.is_some_and(|r| r.kind == crate::api::ReservationKind::Custom);
        let mut conditions = vec![condition];
        let mut certificate_expiry = None;
        // A custom domain (spec.fqdn under another domain than the edge's).
        if custom || (r.is_none() && self.spec.fqdn.is_some()) {
            let state = r.and_then(|r| r.certificate.as_deref());
            conditions.push(certificate_condition(r.is_some(), state, self.metadata.generation));
            certificate_expiry = state.and_then(|c| c.not_after.clone());
        }
        let status = DomainStatus {
            observed_generation: self.metadata.generation,
            conditions,
            certificate_expiry,
            hostname: r.and_then(|r| r.hostname.clone()),
            url: r.and_then(|r| r.url.clone()),
            cname_target: None,
            reservation_id: r.map(|r| r.id.clone()),
        };
        let mut v = serde_json::to_value(status).expect("serializable");
        if custom {
            v["cnameTarget"] = json!(edge_domain);
        }
        v
    }
}

impl Reserved for TcpPort {
    const KIND: &'static str = "TcpPort";
    const COLLECTION: &'static str = "ports";

    fn reclaim(&self) -> ReclaimPolicy {
        self.spec.reclaim_policy
    }

    fn edge_key(&self) -> Result<Option<String>, Error> {
        match self.spec.port {
            Some(0) => Err(Error::Invalid("spec.port must be 1-65535".into())),
            Some(p) => Ok(Some(p.to_string())),
            None => Ok(self.status.as_ref().and_then(|s| s.port).map(|p| p.to_string())),
        }
    }

    fn request(&self) -> Value {
        match self.spec.port {
            Some(p) => json!({ "port": p }),
            None => json!({}),
        }
    }

    fn conditions(&self) -> Vec<Condition> {
        self.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default()
    }

    fn reservation_id(&self) -> Option<String> {
        self.status.as_ref().and_then(|s| s.reservation_id.clone())
    }

    fn status(&self, r: Option<&Reservation>, condition: Condition, _edge_domain: &str) -> Value {
        let status = TcpPortStatus {
            observed_generation: self.metadata.generation,
            conditions: vec![condition],
            port: r.and_then(|r| r.port),
            address: r.and_then(|r| r.url.as_deref()).map(|u| u.trim_start_matches("tcp://").to_string()),
            reservation_id: r.map(|r| r.id.clone()),
        };
        serde_json::to_value(status).expect("serializable")
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

/// The edge labels that say an object of this cluster and namespace holds a thing.
pub fn owner_labels(ctx: &Context, kind: &str, obj: &impl ResourceExt) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_CLUSTER.to_string(), ctx.cluster_id.clone()),
        (LABEL_NAMESPACE.to_string(), obj.namespace().unwrap_or_default()),
        (LABEL_KIND.to_string(), kind.to_string()),
        (LABEL_NAME.to_string(), obj.name_any()),
    ])
}

pub fn selector(labels: &BTreeMap<String, String>) -> String {
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// Finds the reservation the object means: by its key, or by our labels.
async fn find<K: Reserved>(ctx: &Context, obj: &K) -> Result<Option<Reservation>, Error> {
    let labels = owner_labels(ctx, K::KIND, obj);
    let found = match obj.edge_key()? {
        Some(key) => match ctx.edge.get::<Reservation>(format!("{}/{key}", K::COLLECTION)).await {
            Ok(r) => r,
            Err(AdminError::Refused { status: 403, .. }) => {
                return Err(Error::Conflict(format!(
                    "{key} is reserved at the edge by another API key; pick another name"
                )));
            }
            Err(e) => return Err(e.into()),
        },
        None => ctx.edge.list::<Reservation>(K::COLLECTION, selector(&labels)).await?.into_iter().next(),
    };
    if let Some(r) = &found {
        let holder = |k: &str| r.labels.get(k).map(String::as_str).unwrap_or("");
        if holder(LABEL_CLUSTER) != ctx.cluster_id || holder(LABEL_NAMESPACE) != labels[LABEL_NAMESPACE] {
            return Err(Error::Conflict(format!(
                "{} is held by another cluster or namespace (cluster {}, namespace {}); it is never taken over",
                r.target(),
                if holder(LABEL_CLUSTER).is_empty() { "unknown" } else { holder(LABEL_CLUSTER) },
                if holder(LABEL_NAMESPACE).is_empty() { "unknown" } else { holder(LABEL_NAMESPACE) },
            )));
        }
        let other = holder(LABEL_NAME);
        if other != obj.name_any() && other_exists::<K>(ctx, &labels[LABEL_NAMESPACE], other).await? {
            return Err(Error::Conflict(format!(
                "{} is held by {} {other} of this namespace",
                r.target(),
                K::KIND
            )));
        }
    }
    Ok(found)
}

async fn other_exists<K: Reserved>(ctx: &Context, ns: &str, name: &str) -> Result<bool, Error> {
    Ok(!name.is_empty() && Api::<K>::namespaced(ctx.client.clone(), ns).get_opt(name).await?.is_some())
}

async fn apply<K: Reserved>(obj: Arc<K>, ctx: &Context) -> Result<Action, Error> {
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let outcome = async {
        let (reservation, how) = match find(ctx, &*obj).await? {
            Some(r) => {
                let how = if obj.reservation_id().as_deref() == Some(&r.id) { "Reserved" } else { "Adopted" };
                (r, how)
            }
            None => {
                let mut body = obj.request();
                body["labels"] = serde_json::to_value(owner_labels(ctx, K::KIND, &*obj)).expect("labels");
                let r: Reservation = ctx.edge.post(K::COLLECTION, body).await.map_err(|e| match e {
                    AdminError::Refused { status: 409 | 422, message, .. } => Error::Conflict(message),
                    e => e.into(),
                })?;
                let how = if obj.reservation_id().is_some() { "Recreated" } else { "Reserved" };
                (r, how)
            }
        };
        Ok::<_, Error>((reservation, how))
    }
    .await;
    let generation = obj.meta().generation;
    let (status, warn_reason) = match &outcome {
        Ok((r, _)) => {
            let msg =
                format!("{} is reserved at the edge: {}", r.target(), r.url.clone().unwrap_or_default());
            (obj.status(Some(r), ready(true, "Reserved", msg, generation), &ctx.edge_domain), None)
        }
        Err(e @ (Error::Invalid(_) | Error::Conflict(_))) => (
            obj.status(None, ready(false, e.category(), e.to_string(), generation), &ctx.edge_domain),
            Some(e.category()),
        ),
        Err(e) => {
            let msg = format!("cannot reach the edge: {e}");
            (
                obj.status(None, ready(false, "EdgeUnavailable", msg, generation), &ctx.edge_domain),
                Some("EdgeUnavailable"),
            )
        }
    };
    let mut conditions: Vec<Condition> =
        serde_json::from_value(status["conditions"].clone()).expect("conditions");
    let changes: Vec<bool> = conditions.iter_mut().map(|c| carry_transition(c, &obj.conditions())).collect();
    let (condition, changed) = (conditions[0].clone(), changes[0]);
    let certificate = conditions.iter().zip(&changes).find(|(c, _)| c.type_ == CERTIFICATE_READY);
    let certificate_pending = certificate.is_some_and(|(c, _)| {
        c.status != "True" && !matches!(c.reason.as_str(), "NotReserved" | "AcmeDisabled")
    });
    let certificate_event = certificate.filter(|(_, changed)| **changed).map(|(c, _)| c.clone());
    let mut status = status;
    status["conditions"] = json!(conditions);
    apply_status(&api, &*obj, &status).await?;
    if let Some(c) = certificate_event {
        match c.reason.as_str() {
            "Issued" => event(ctx, &*obj, false, "CertificateIssued", c.message).await,
            "DnsMismatch" | "OrderFailed" | "Expired" | "AcmeDisabled" => {
                event(ctx, &*obj, true, &format!("Certificate{}", c.reason), c.message).await
            }
            _ => {}
        }
    }
    match (&outcome, warn_reason) {
        // Adopting and re-creating are events whenever they happen.
        (Ok((_, "Recreated")), _) => {
            let note =
                format!("the reservation was missing at the edge and was re-created: {}", condition.message);
            event(ctx, &*obj, false, "Recreated", note).await
        }
        (Ok((_, "Adopted")), _) => {
            let note = format!("adopted the existing reservation of this namespace: {}", condition.message);
            event(ctx, &*obj, false, "Adopted", note).await
        }
        (Ok(_), _) if changed => event(ctx, &*obj, false, "Reserved", condition.message.clone()).await,
        (Err(_), Some(reason)) if changed => event(ctx, &*obj, true, reason, condition.message.clone()).await,
        _ => {}
    }
    match outcome {
        // The edge works on the certificate on its own: look again soon.
        Ok(_) if certificate_pending => Ok(Action::requeue(ctx.resync.min(CERTIFICATE_RECHECK))),
        Ok(_) | Err(Error::Invalid(_) | Error::Conflict(_)) => Ok(Action::requeue(ctx.resync)),
        Err(e) => Err(e),
    }
}

/// How often a custom domain whose certificate is not ready is looked at again.
const CERTIFICATE_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);

async fn cleanup<K: Reserved>(obj: Arc<K>, ctx: &Context) -> Result<Action, Error> {
    if obj.reclaim() == ReclaimPolicy::Retain {
        info!("reclaimPolicy Retain: keeping the reservation at the edge");
        return Ok(Action::await_change());
    }
    let found = match find(ctx, &*obj).await {
        Ok(found) => found,
        // Not ours (or the spec never was valid): nothing of ours to release.
        Err(Error::Conflict(_) | Error::Invalid(_)) => None,
        Err(e) => return Err(e),
    };
    if let Some(r) = found {
        let key = r.hostname.clone().or(r.port.map(|p| p.to_string())).unwrap_or_default();
        ctx.edge.delete(format!("{}/{key}", K::COLLECTION)).await?;
        info!(reservation = %r.target(), "released the reservation");
    }
    Ok(Action::await_change())
}

async fn reconcile<K: Reserved>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action, Error> {
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let span = tracing::info_span!("reconcile", kind = K::KIND, namespace = %obj.namespace().unwrap_or_default(), name = %obj.name_any());
    let reconcile = async {
        let Some(obj) = fresh_for_finalizer(&api, obj).await? else { return Ok(Action::await_change()) };
        finalizer(&api, FINALIZER, obj, |ev| async {
            match ev {
                Finalizer::Apply(o) => apply(o, &ctx).await,
                Finalizer::Cleanup(o) => cleanup(o, &ctx).await,
            }
        })
        .await
        .map_err(|e| Error::Finalizer(Box::new(e)))
    }
    .instrument(span);
    ctx.metrics.measure(K::KIND, reconcile).await
}

fn error_policy<K: Reserved>(obj: Arc<K>, e: &Error, _ctx: Arc<Context>) -> Action {
    super::log_failure(K::KIND, obj.meta(), e);
    Action::requeue(std::time::Duration::from_secs(5))
}

async fn run_controller<K: Reserved>(ctx: Arc<Context>, stop: CancellationToken) {
    let api = ctx.api::<K>();
    Controller::new(api, watcher::Config::default().any_semantic())
        .graceful_shutdown_on(async move { stop.cancelled().await })
        .run(reconcile::<K>, error_policy::<K>, ctx)
        .for_each(|_| async {})
        .await;
}

pub async fn run_domains(ctx: Arc<Context>, stop: CancellationToken) {
    run_controller::<Domain>(ctx, stop).await
}

pub async fn run_tcp_ports(ctx: Arc<Context>, stop: CancellationToken) {
    run_controller::<TcpPort>(ctx, stop).await
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
    for key in ctx.edge.list::<TunnelKey>("tunnel-keys", selector).await? {
        let uid = key.labels.get(LABEL_UID).cloned().unwrap_or_default();
        if !live.contains(&uid) {
            ctx.edge.delete(format!("tunnel-keys/{}", key.id)).await?;
            info!(key = %key.id, tunnel_uid = %uid, "revoked the key of a Tunnel deleted while the operator was down");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
        assert_eq!(v["certificateExpiry"], "2030-01-01T00:00:00Z");
        assert_eq!(v["cnameTarget"], "edge.example.com");
        assert_eq!(v["conditions"][0]["type"], "Ready");
        assert_eq!(v["conditions"][1]["type"], "CertificateReady");
        assert_eq!(v["conditions"][1]["status"], "True");

        // A subdomain has no certificate condition.
        let sub: Domain = serde_json::from_value(json!({
            "apiVersion": "culvert.dev/v1alpha1", "kind": "Domain",
            "metadata": {"name": "blog", "namespace": "web"}, "spec": {"name": "blog"}
        }))
        .unwrap();
        r.kind = crate::api::ReservationKind::Subdomain;
        r.certificate = None;
        let v = sub.status(Some(&r), ready, "edge.example.com");
        assert_eq!(v["conditions"].as_array().unwrap().len(), 1);
        assert!(v.get("certificateExpiry").is_none());
    }
}
