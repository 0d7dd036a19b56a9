//! Services of other namespaces that Tunnels send to: a weighted backend
//! with a `namespace` (a Gateway API backendRef a ReferenceGrant allows).
//! Their changes (endpoints, ports, deletion) must reach the Tunnel at once,
//! as a Service of its own namespace does, not at the next resync.
//!
//! Without `--watch-namespace` the Tunnel controller's watches of Services
//! and EndpointSlices already see every namespace; [`uses_service`] maps a
//! change to the Tunnels that use the Service, in their namespace or another.
//! With it, those watches see the watched namespace only, so [`triggers`]
//! keeps one watch of Services and one of EndpointSlices per other namespace
//! that some Tunnel names (started and stopped as the Tunnels change) and
//! yields the Tunnels to reconcile.

use std::collections::{BTreeSet, HashMap};

use futures_util::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::crd::Tunnel;

/// The label that ties an EndpointSlice to its Service.
const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// `(namespace, name)` of the Services of other namespaces than the
/// Tunnel's that its weighted backends send to.
pub fn foreign_services(t: &Tunnel) -> impl Iterator<Item = (&str, &str)> {
    let own = t.metadata.namespace.as_deref().unwrap_or_default();
    t.spec
        .routes
        .iter()
        .flat_map(|r| &r.backends)
        .filter(|b| b.refused.is_none())
        .filter_map(move |b| Some((b.namespace.as_deref().filter(|ns| *ns != own)?, b.name.as_str())))
}

/// Does the Tunnel send to Service `name` of namespace `ns` (its own, or another)?
pub fn uses_service(t: &Tunnel, ns: &str, name: &str) -> bool {
    let own = t.metadata.namespace.as_deref() == Some(ns);
    (own && t.spec.services().any(|s| s == name)) || foreign_services(t).any(|f| f == (ns, name))
}

/// The Tunnels of `watched` to reconcile when a Service of another namespace
/// that they use changes (see the module doc), until `stop`.
pub fn triggers(
    client: Client,
    watched: String,
    stop: CancellationToken,
) -> impl Stream<Item = ObjectRef<Tunnel>> + Send + 'static {
    let (tx, mut rx) = mpsc::channel(256);
    tokio::spawn(run(client, watched, tx, stop));
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn run(client: Client, watched: String, tx: mpsc::Sender<ObjectRef<Tunnel>>, stop: CancellationToken) {
    let (reader, writer) = reflector::store::<Tunnel>();
    let tunnels = watcher(
        Api::<Tunnel>::namespaced(client.clone(), &watched),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .reflect(writer);
    let mut tunnels = std::pin::pin!(tunnels);
    // Namespace → its watch (aborted when dropped).
    let mut watches: HashMap<String, Watch> = HashMap::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            event = tunnels.next() => match event {
                None => return,
                Some(Err(e)) => {
                    debug!(error = %e, "watch of Tunnels for other namespaces' Services");
                    continue;
                }
                Some(Ok(_)) => {}
            },
        }
        let wanted: BTreeSet<String> = reader
            .state()
            .iter()
            .flat_map(|t| foreign_services(t).map(|(ns, _)| ns.to_string()).collect::<Vec<_>>())
            .collect();
        watches.retain(|ns, _| wanted.contains(ns));
        for ns in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = watches.entry(ns) {
                let ns = slot.key().clone();
                debug!(namespace = %ns, "watching the Services a Tunnel uses in another namespace");
                slot.insert(Watch(tokio::spawn(watch_namespace(
                    client.clone(),
                    ns,
                    reader.clone(),
                    tx.clone(),
                ))));
            }
        }
    }
}

/// The Service an event is about (`name` of the object); none for the
/// markers of a (re)list.
fn changed<K>(e: watcher::Event<K>, name: impl Fn(&K) -> String) -> Option<String> {
    match e {
        watcher::Event::Apply(o) | watcher::Event::Delete(o) | watcher::Event::InitApply(o) => Some(name(&o)),
        watcher::Event::Init | watcher::Event::InitDone => None,
    }
}

/// A namespace's watch task, aborted when dropped.
struct Watch(tokio::task::JoinHandle<()>);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Watches the Services and EndpointSlices of `ns` and sends the Tunnels
/// that use a changed Service.
async fn watch_namespace(
    client: Client,
    ns: String,
    tunnels: Store<Tunnel>,
    tx: mpsc::Sender<ObjectRef<Tunnel>>,
) {
    let services = watcher(Api::<Service>::namespaced(client.clone(), &ns), watcher::Config::default())
        .default_backoff()
        .map(|e| e.map(|e| changed(e, |s: &Service| s.name_any())));
    let slices = watcher(
        Api::<EndpointSlice>::namespaced(client, &ns),
        watcher::Config::default().labels(SERVICE_NAME),
    )
    .default_backoff()
    .map(|e| {
        e.map(|e| changed(e, |s: &EndpointSlice| s.labels().get(SERVICE_NAME).cloned().unwrap_or_default()))
    });
    let mut changes = std::pin::pin!(futures_util::stream::select(services, slices));
    let mut warned = false;
    while let Some(change) = changes.next().await {
        let name = match change {
            Ok(Some(n)) => n,
            Ok(None) => continue,
            Err(e) => {
                // No right to read that namespace (the chart's watchNamespace
                // binds the operator to its own): the Tunnel says so itself.
                if !warned {
                    warn!(namespace = %ns, error = %e, "cannot watch the Services a Tunnel uses in this namespace; their changes apply at the resync");
                    warned = true;
                }
                continue;
            }
        };
        for t in tunnels.state().iter().filter(|t| uses_service(t, &ns, &name)) {
            if tx.send(ObjectRef::from_obj(&**t)).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tunnels_use_services_of_their_namespace_and_granted_others() {
        let mut t = Tunnel::new(
            "t",
            serde_json::from_value(serde_json::json!({"domain": "d", "routes": [
                {"path": "/", "service": {"name": "web", "port": 80}},
                {"path": "/far", "backends": [{"name": "api", "namespace": "far", "port": 80},
                    {"name": "own", "namespace": "mine", "port": 80},
                    {"name": "no", "namespace": "far", "port": 80, "refused": "no grant"}]}]}))
            .unwrap(),
        );
        t.metadata.namespace = Some("mine".into());
        assert_eq!(foreign_services(&t).collect::<Vec<_>>(), [("far", "api")]);
        assert!(uses_service(&t, "mine", "web"));
        assert!(uses_service(&t, "mine", "own"), "its own namespace named");
        assert!(uses_service(&t, "far", "api"));
        assert!(!uses_service(&t, "far", "web"), "a name of its own namespace, not of another");
        assert!(!uses_service(&t, "far", "no"), "refused");
        assert!(!uses_service(&t, "other", "api"));
    }
}
