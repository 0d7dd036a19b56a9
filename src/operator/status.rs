//! Status conditions, events, metrics and the admin port of the operator.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use http::{Response, StatusCode};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Api, Resource, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::names::{FIELD_MANAGER, FINALIZER};
use super::{Context, Error};
use crate::crd::Condition;
use crate::tunnel::body;

type Labels = Vec<(&'static str, String)>;

/// The operator's metrics (one registry; only `object_reconciles` is
/// labelled by object name).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    reconciles: Family<Labels, Counter>,
    /// Reconciles by object: what tests wait on before asserting that
    /// nothing happened to an object.
    object_reconciles: Family<Labels, Counter>,
    failures: Family<Labels, Counter>,
    durations: Family<Labels, Histogram>,
    pub tunnels_connected: Gauge,
    /// Ready tunnel connections by edge (`edge="host:port"`, `host:port@addr`
    /// for one address of a name).
    pub edge_connections: Family<Labels, Gauge>,
    leader: Gauge,
    ready: Arc<AtomicBool>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("culvert_operator");
        let reconciles = Family::<Labels, Counter>::default();
        r.register("reconciles", "Reconcile runs by kind", reconciles.clone());
        let object_reconciles = Family::<Labels, Counter>::default();
        r.register(
            "object_reconciles",
            "Reconcile runs by kind, namespace and name",
            object_reconciles.clone(),
        );
        let failures = Family::<Labels, Counter>::default();
        r.register("reconcile_failures", "Failed reconciles by kind and error category", failures.clone());
        let durations = Family::<Labels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
        });
        r.register("reconcile_duration_seconds", "Reconcile durations by kind", durations.clone());
        let tunnels_connected = Gauge::default();
        r.register(
            "tunnels_connected",
            "Tunnel connections this replica holds open",
            tunnels_connected.clone(),
        );
        let edge_connections = Family::<Labels, Gauge>::default();
        r.register(
            "edge_connections",
            "Tunnel connections of this replica the edge routes to, by edge",
            edge_connections.clone(),
        );
        let leader = Gauge::default();
        r.register("leader", "1 while this replica reconciles", leader.clone());
        // What this replica's agents drop (culvert_operator_udp_replies_dropped_total).
        crate::agent::metrics::register(&mut r);
        Metrics {
            registry: Arc::new(r),
            reconciles,
            object_reconciles,
            failures,
            durations,
            tunnels_connected,
            edge_connections,
            leader,
            ready: Arc::default(),
        }
    }
}

impl Metrics {
    /// Runs one reconcile of the `kind` object `obj` and records its count,
    /// duration and failure category.
    pub async fn measure<T, K: Resource>(
        &self,
        kind: &'static str,
        obj: &K,
        reconcile: impl std::future::Future<Output = Result<T, super::Error>>,
    ) -> Result<T, super::Error> {
        let started = std::time::Instant::now();
        let result = reconcile.await;
        let meta = obj.meta();
        let object = vec![
            ("kind", kind.to_string()),
            ("namespace", meta.namespace.clone().unwrap_or_default()),
            ("name", meta.name.clone().unwrap_or_default()),
        ];
        self.object_reconciles.get_or_create(&object).inc();
        self.reconciled(
            kind,
            started.elapsed().as_secs_f64(),
            result.as_ref().map(|_| ()).map_err(super::Error::category),
        );
        result
    }

    pub fn reconciled(&self, kind: &'static str, seconds: f64, result: Result<(), &'static str>) {
        let k = vec![("kind", kind.to_string())];
        self.reconciles.get_or_create(&k).inc();
        self.durations.get_or_create(&k).observe(seconds);
        if let Err(category) = result {
            self.failures
                .get_or_create(&vec![("kind", kind.to_string()), ("category", category.into())])
                .inc();
        }
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(leader as i64);
    }

    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// `/metrics`, `/healthz`, `/readyz` (ready once the agents' caches synced).
pub async fn serve_admin(listener: tokio::net::TcpListener, metrics: Metrics, stop: CancellationToken) {
    loop {
        let (tcp, _) = tokio::select! {
            r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
            _ = stop.cancelled() => return,
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                async move {
                    let (status, text) = match req.uri().path() {
                        "/metrics" => (StatusCode::OK, metrics.encode()),
                        "/healthz" => (StatusCode::OK, "ok\n".into()),
                        "/readyz" if metrics.ready.load(Ordering::Acquire) => (StatusCode::OK, "ok\n".into()),
                        "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, "caches not synced yet\n".into()),
                        _ => (StatusCode::NOT_FOUND, "try /metrics, /healthz or /readyz\n".into()),
                    };
                    let mut r = Response::new(body::full(text));
                    *r.status_mut() = status;
                    Ok::<_, std::convert::Infallible>(r)
                }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .http1_only()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

/// A `Ready` condition.
pub fn ready(ok: bool, reason: &str, message: impl Into<String>, generation: Option<i64>) -> Condition {
    Condition {
        type_: "Ready".into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: Some(Timestamp::now().to_string()),
        observed_generation: generation,
    }
}

/// A condition of type `type_`; `status` is `True`, `False` or `Unknown`.
pub fn condition(
    type_: &str,
    status: &str,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: Some(Timestamp::now().to_string()),
        observed_generation: generation,
    }
}

/// How long ago a condition last changed (zero when unknown or in the future).
pub fn since_transition(c: &Condition) -> std::time::Duration {
    let then = c.last_transition_time.as_deref().and_then(|t| t.parse::<Timestamp>().ok());
    then.and_then(|t| Timestamp::now().duration_since(t).try_into().ok()).unwrap_or_default()
}

/// Keeps the transition time when the condition did not change.
pub fn carry_transition(new: &mut Condition, old: &[Condition]) -> bool {
    match old.iter().find(|c| c.type_ == new.type_) {
        Some(o) if o.status == new.status && o.reason == new.reason => {
            new.last_transition_time = o.last_transition_time.clone();
            false
        }
        _ => true,
    }
}

/// The `Ready` condition among `conditions`.
pub fn ready_condition(conditions: &[Condition]) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == "Ready")
}

/// The reason and message of a failed reconcile's `Ready` condition: the
/// error's category for what the user can act on, `EdgeUnavailable` for the
/// edge, and Kubernetes API errors as such.
pub fn failure(e: &Error) -> (&'static str, String) {
    match e {
        Error::Edge(_) => ("EdgeUnavailable", format!("cannot reach the edge: {e}")),
        e => (e.category(), e.to_string()),
    }
}

/// Server-side applies `status` to the object's status subresource.
pub async fn apply_status<K, S>(api: &Api<K>, obj: &K, status: &S) -> Result<(), Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize,
{
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    api.patch_status(&obj.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(patch))
        .await?;
    Ok(())
}

/// The object to hand to `kube::runtime::finalizer()`: the cached one when it
/// already carries our finalizer (or is being deleted), else a fresh read.
///
/// `finalizer()` adds the finalizer with a JSON patch whose `test` operation
/// compares against the list it was given. A reconcile may run on a cached
/// copy older than its own previous write (the finalizer is on the server,
/// not yet in the cache): the `test` fails with 422. Reading the object again
/// costs one GET per object that lacks the finalizer, that is, once per new
/// object. `None`: the object is gone.
pub async fn fresh_for_finalizer<K>(api: &Api<K>, obj: Arc<K>) -> Result<Option<Arc<K>>, Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    if obj.meta().deletion_timestamp.is_some() || obj.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Some(obj));
    }
    Ok(api.get_opt(&obj.name_any()).await?.map(Arc::new))
}

/// One reconcile of an object that holds things at the edge behind the
/// finalizer (Domain, TcpPort, Tunnel): the span, the metrics, a fresh copy
/// for `finalizer()`, then `apply` or `cleanup`.
pub async fn reconcile_finalized<K, FA, FC>(
    kind: &'static str,
    obj: Arc<K>,
    ctx: &Context,
    apply: impl FnOnce(Arc<K>) -> FA,
    cleanup: impl FnOnce(Arc<K>) -> FC,
) -> Result<Action, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
    FA: Future<Output = Result<Action, Error>>,
    FC: Future<Output = Result<Action, Error>>,
{
    let namespace = obj.namespace().unwrap_or_default();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &namespace);
    let measured = obj.clone();
    let span = tracing::info_span!("reconcile", kind, namespace = %namespace, name = %obj.name_any());
    let reconcile = async {
        let Some(obj) = fresh_for_finalizer(&api, obj).await? else { return Ok(Action::await_change()) };
        finalizer(&api, FINALIZER, obj, |ev| async move {
            match ev {
                Finalizer::Apply(o) => apply(o).await,
                Finalizer::Cleanup(o) => cleanup(o).await,
            }
        })
        .await
        .map_err(|e| Error::Finalizer(Box::new(e)))
    }
    .instrument(span);
    ctx.metrics.measure(kind, &*measured, reconcile).await
}

/// The error policy of those controllers: log, and try again in 5 seconds.
pub fn retry_soon<K: Resource>(kind: &str, obj: &K, e: &Error) -> Action {
    super::log_failure(kind, obj.meta(), e);
    Action::requeue(std::time::Duration::from_secs(5))
}

/// A controller's context: the operator's, and the one reporting path of
/// every controller. [`Ctx::event`] publishes an event; [`Ctx::report`]
/// publishes one on transitions only, from what was last reported (for the
/// Ingress and Service controllers, which have no conditions of their own to
/// compare with; Domain, TcpPort and Tunnel compare their conditions and call
/// [`Ctx::event`] on a change).
pub struct Ctx {
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
        self.event(obj, &Note::new(warning, reason, message)).await;
    }

    /// Publishes an event about `obj`; failures to publish are only logged.
    pub async fn event<K>(&self, obj: &K, note: &Note)
    where
        K: Resource<DynamicType = ()>,
    {
        let ev = Event {
            type_: if note.warning { EventType::Warning } else { EventType::Normal },
            reason: note.reason.clone(),
            note: Some(note.message.clone()),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = self.base.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::debug!(error = %e, "failed to publish an event");
        }
    }

    /// The topic is fine again: its next problem is reported.
    pub fn forget<K: Resource>(&self, obj: &K, topic: &str) {
        let key = (obj.meta().uid.clone().unwrap_or_default(), topic.to_string());
        self.reported.lock().expect("poisoned").remove(&key);
    }

    /// Reports each topic's note ([`Ctx::report`]), or forgets the topics
    /// without one ([`Ctx::forget`]), in order.
    pub async fn report_all<K>(&self, obj: &K, notes: Vec<(String, Option<Note>)>)
    where
        K: Resource<DynamicType = ()>,
    {
        for (topic, note) in notes {
            match note {
                Some(n) => self.report(obj, &topic, n.warning, &n.reason, n.message).await,
                None => self.forget(obj, &topic),
            }
        }
    }
}

/// An event a reconcile decided on: Warning or Normal, a reason, a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

impl Note {
    pub fn new(warning: bool, reason: impl Into<String>, message: impl Into<String>) -> Note {
        Note { warning, reason: reason.into(), message: message.into() }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_agents_udp_drops_are_among_the_operators_metrics() {
        let text = super::Metrics::default().encode();
        for reason in ["queue_full", "oversize"] {
            let series = format!("culvert_operator_udp_replies_dropped_total{{reason=\"{reason}\"}} ");
            assert!(text.lines().any(|l| l.starts_with(&series)), "{series} in {text}");
        }
    }
}
